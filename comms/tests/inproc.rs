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

#[test]
fn messages_of_later_collectives_are_kept_and_counted_for_their_call() {
    for w in 2..=4 {
        check_run_ahead(&Channels, w);
    }
}

#[test]
fn garbage_from_a_peer_is_a_protocol_error_naming_it() {
    use dtrain_comms::{CommError, Communicator, Transport};
    let mut ts = channel_mesh(2);
    let mut rogue = ts.pop().unwrap();
    rogue.send(0, vec![0xAB; 50]).unwrap();
    let mut c = Communicator::new(ts.pop().unwrap(), test_config());
    let e = c.barrier().unwrap_err();
    assert!(
        matches!(
            e,
            CommError::Protocol {
                rank: 1,
                reported_by: 0,
                ..
            }
        ),
        "{e}"
    );
    // The rogue rank is told: after rank 0's barrier message comes an abort.
    let kinds: Vec<_> = (0..2)
        .map(|_| {
            let dl = std::time::Instant::now() + std::time::Duration::from_secs(1);
            let (from, msg) = rogue.recv(dl).unwrap();
            assert_eq!(from, 0);
            dtrain_comms::wire::Message::decode(msg)
                .unwrap()
                .header()
                .kind
        })
        .collect();
    use dtrain_comms::wire::Kind;
    assert_eq!(kinds, vec![Kind::Barrier, Kind::Abort]);
}
