//! Conformance suite over the in-process channel transport, N = 1..=8.

mod common;

use common::*;
use dtrain_comms::{channel_mesh, ChannelTransport};

struct Channels;

impl Mesh for Channels {
    type T = ChannelTransport;
    fn make(&self, world: usize) -> Vec<ChannelTransport> {
        channel_mesh(world)
    }
}

const WORLDS: std::ops::RangeInclusive<usize> = 1..=8;

#[test]
fn all_reduce_matches_reference_bit_for_bit() {
    for w in WORLDS {
        check_all_reduce(&Channels, w);
    }
}

#[test]
fn all_gather_variable_sizes() {
    for w in WORLDS {
        check_all_gather(&Channels, w);
    }
}

#[test]
fn broadcast_from_every_root() {
    for w in WORLDS {
        check_broadcast(&Channels, w);
    }
}

#[test]
fn reduce_scatter_matches_reference() {
    for w in WORLDS {
        check_reduce_scatter(&Channels, w);
    }
}

#[test]
fn barrier_waits_for_everyone() {
    for w in WORLDS {
        check_barrier(&Channels, w);
    }
}

#[test]
fn mixed_sequence_and_byte_counts() {
    for w in WORLDS {
        check_sequence_and_bytes(&Channels, w);
    }
}

#[test]
fn dead_peer_is_named_by_every_survivor() {
    for w in 2..=8 {
        check_dead_peer(&Channels, w);
    }
}

#[test]
fn stalled_peer_is_named_by_every_survivor() {
    for_worlds_concurrently(Channels, &[2, 3, 5, 8], check_stalled_peer);
}

#[test]
fn mismatched_collectives_are_reported() {
    for w in 2..=8 {
        check_mismatch(&Channels, w);
    }
}
