//! The transport conformance suite: every scenario over every driver it applies to — the
//! collectives against their references, a peer dead, stalled or late, mismatched calls,
//! messages of later collectives; and for the networked and shared-memory drivers the
//! frame limit, link emulation, refused run tokens, heartbeats and a peer process killed
//! or stopped. One module per driver: `channel` (N = 1..=8), `tcp`, `quic`, `shm`
//! (N = 1..=4), `hybrid` (N = 1..=4, hosts of two ranks: its collectives only). What only one driver has (TLS pinning, segment files, …) is tested in its
//! own file (`tcp.rs`, `quic.rs`, `shm.rs`, `inproc.rs`).

mod common;

/// The world sizes a driver's collective scenarios run at.
struct Worlds {
    /// Correct collectives.
    all: &'static [usize],
    /// A dead peer, mismatched collectives.
    faults: &'static [usize],
    /// A stalled peer (run concurrently: timing-based).
    stalled: &'static [usize],
    /// Messages of later collectives.
    run_ahead: &'static [usize],
    /// A rank late between collectives (run concurrently: timing-based).
    late: &'static [usize],
    /// Sparse all-reduce.
    sparse: &'static [usize],
    /// Sparse all-reduce mismatches.
    sparse_faults: &'static [usize],
}

/// The networked and shared-memory drivers: N = 1..=4.
#[cfg_attr(
    not(any(feature = "tcp", all(feature = "shm", target_os = "linux"))),
    allow(dead_code)
)]
const NETWORK: Worlds = Worlds {
    all: &[1, 2, 3, 4],
    faults: &[2, 3, 4],
    stalled: &[2, 4],
    run_ahead: &[2, 3],
    late: &[2, 3],
    sparse: &[2, 4],
    sparse_faults: &[2, 4],
};

/// The collective scenarios over the driver `$mesh` at the world sizes `$w`.
macro_rules! collectives {
    ($mesh:expr, $w:expr) => {
        #[test]
        fn all_reduce_matches_reference_bit_for_bit() {
            for &w in $w.all {
                check_all_reduce(&$mesh, w);
            }
        }

        #[test]
        fn all_gather_variable_sizes() {
            for &w in $w.all {
                check_all_gather(&$mesh, w);
            }
        }

        #[test]
        fn all_gather_into_reuses_its_buffers() {
            for &w in $w.all {
                check_all_gather_into(&$mesh, w);
            }
        }

        #[test]
        fn broadcast_from_every_root() {
            for &w in $w.all {
                check_broadcast(&$mesh, w);
            }
        }

        #[test]
        fn reduce_scatter_matches_reference() {
            for &w in $w.all {
                check_reduce_scatter(&$mesh, w);
            }
        }

        #[test]
        fn barrier_waits_for_everyone() {
            for &w in $w.all {
                check_barrier(&$mesh, w);
            }
        }

        #[test]
        fn mixed_sequence_and_byte_counts() {
            for &w in $w.all {
                check_sequence_and_bytes(&$mesh, w);
            }
        }

        #[test]
        fn dead_peer_is_named_by_every_survivor() {
            for &w in $w.faults {
                check_dead_peer(&$mesh, w);
            }
        }

        #[test]
        fn stalled_peer_is_named_by_every_survivor() {
            for_worlds_concurrently($mesh, $w.stalled, check_stalled_peer);
        }

        #[test]
        fn mismatched_collectives_are_reported() {
            for &w in $w.faults {
                check_mismatch(&$mesh, w);
            }
        }

        #[test]
        fn messages_of_later_collectives_are_kept_and_counted_for_their_call() {
            for &w in $w.run_ahead {
                check_run_ahead(&$mesh, w);
            }
        }

        #[test]
        fn late_rank_is_named_by_every_rank() {
            for_worlds_concurrently($mesh, $w.late, check_late_rank);
        }

        #[test]
        fn sparse_all_reduce_matches_reference_bit_for_bit() {
            for &w in $w.sparse {
                check_sparse_all_reduce(&$mesh, w);
            }
        }

        #[test]
        fn sparse_all_reduce_mismatches_are_reported() {
            for &w in $w.sparse_faults {
                check_sparse_mismatch(&$mesh, w);
            }
        }

        #[test]
        fn compressed_all_reduce_matches_reference_bit_for_bit() {
            for &w in $w.sparse {
                check_compressed_all_reduce(&$mesh, w);
            }
        }

        #[test]
        fn compressed_all_reduce_dead_peer_is_named_by_every_survivor() {
            for &w in $w.faults {
                check_compressed_dead_peer(&$mesh, w);
            }
        }

        #[test]
        fn hierarchical_all_reduce_matches_reference_bit_for_bit() {
            for &w in $w.sparse {
                check_hierarchical_all_reduce(&$mesh, w);
            }
        }

        #[test]
        fn hierarchical_all_reduce_dead_peer_is_named_by_every_survivor() {
            for &w in $w.faults {
                check_hierarchical_dead_peer(&$mesh, w);
            }
        }
    };
}

/// The scenarios of a driver set up from a config (a [`common::Driver`]).
#[cfg_attr(
    not(any(feature = "tcp", all(feature = "shm", target_os = "linux"))),
    allow(unused_macros)
)]
macro_rules! configured {
    ($driver:expr) => {
        #[test]
        fn oversized_message_is_rejected_at_send() {
            check_oversized_message(&$driver);
        }

        #[test]
        fn emulated_link_follows_the_alpha_beta_model() {
            check_emulated_link(&$driver);
        }
    };
}

/// The scenarios of a networked driver (a [`common::Heartbeats`] and [`common::Spawned`]
/// driver): refused tokens, heartbeats, large frames, a killed or stopped peer process.
/// `$setup` is the set-up deadline of the refused-token mesh; `$seed` seeds the large
/// frames; `$liveness` is the (heartbeat, peer timeout) of the child-process meshes;
/// `$killed` and `$stopped` are what the survivors of a killed and a stopped child see.
#[cfg_attr(not(feature = "tcp"), allow(unused_macros))]
macro_rules! networked {
    (
        $driver:expr,
        setup: $setup:expr,
        seed: $seed:expr,
        liveness: $liveness:expr,
        killed: $killed:expr,
        stopped: $stopped:expr $(,)?
    ) => {
        #[test]
        fn rank_with_wrong_token_is_refused() {
            check_wrong_token_is_refused(&$driver, $setup);
        }

        #[test]
        fn heartbeats_keep_an_idle_mesh_alive_and_are_not_counted() {
            check_idle_heartbeats(&$driver);
        }

        #[test]
        fn peer_timeout_must_leave_room_for_heartbeats() {
            check_peer_timeout_leaves_room_for_heartbeats(&$driver);
        }

        #[test]
        fn large_frames_stay_exact() {
            check_large_frames(&$driver, $seed);
        }

        #[test]
        fn killed_process_is_named_by_every_survivor() {
            check_fault_in_child_process(
                &$driver,
                concat!(
                    module_path!(),
                    "::killed_process_is_named_by_every_survivor"
                ),
                Fault::Kill,
                $liveness,
                $killed,
            );
        }

        #[test]
        fn stopped_process_is_named_by_every_survivor() {
            check_fault_in_child_process(
                &$driver,
                concat!(
                    module_path!(),
                    "::stopped_process_is_named_by_every_survivor"
                ),
                Fault::Stop,
                $liveness,
                $stopped,
            );
        }
    };
}

/// In-process channels: N = 1..=8.
mod channel {
    use super::common::*;
    use super::Worlds;

    collectives!(
        Channels,
        Worlds {
            all: &[1, 2, 3, 4, 5, 6, 7, 8],
            faults: &[2, 3, 4, 5, 6, 7, 8],
            stalled: &[2, 3, 5, 8],
            run_ahead: &[2, 3, 4],
            late: &[2, 3, 5],
            sparse: &[1, 2, 3, 4, 5, 6, 7, 8],
            sparse_faults: &[2, 3, 4, 5, 6, 7, 8],
        }
    );
}

#[cfg(feature = "tcp")]
mod tcp {
    use std::time::Duration;

    use super::common::*;
    use super::NETWORK;

    collectives!(Tcp, NETWORK);
    configured!(Tcp);
    // A SIGKILLed peer's kernel closes its connections: the survivors fail fast. A
    // SIGSTOPped one keeps them open and sends nothing: the survivors' readers give up on
    // it after the 1 s peer timeout (its heartbeats stopped), long before the collective's
    // 20 s timeout.
    networked!(
        Tcp,
        setup: Duration::from_millis(800),
        seed: 77,
        liveness: (Duration::from_millis(200), Duration::from_millis(1000)),
        killed: Expect { within: Duration::from_secs(3), silent: false },
        stopped: Expect { within: Duration::from_millis(2500), silent: true },
    );
}

#[cfg(feature = "quic")]
mod quic {
    use std::time::Duration;

    use super::common::*;
    use super::NETWORK;

    collectives!(Quic, NETWORK);
    configured!(Quic);
    // Killed or stopped, the peer sends nothing more over UDP, not even keep-alives: the
    // survivors notice through the 1.5 s peer timeout (QUIC's idle timeout).
    networked!(
        Quic,
        setup: Duration::from_millis(1500),
        seed: 91,
        liveness: (Duration::from_millis(300), Duration::from_millis(1500)),
        killed: Expect { within: Duration::from_millis(4000), silent: true },
        stopped: Expect { within: Duration::from_millis(4000), silent: true },
    );
}

// Hosts of two ranks: shared memory within, TCP across (world 3: a host of one).
#[cfg(all(feature = "tcp", feature = "shm", target_os = "linux"))]
mod hybrid {
    use super::common::*;
    use super::NETWORK;

    collectives!(Hybrid, NETWORK);
}

#[cfg(all(feature = "shm", target_os = "linux"))]
mod shm {
    use super::common::*;
    use super::NETWORK;

    collectives!(Shm, NETWORK);
    configured!(Shm);
}
