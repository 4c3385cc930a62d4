//! Conformance suite over MPI (feature `mpi`), run one rank per process under `mpirun`:
//!
//! ```text
//! cargo test -p dtrain-comms --features mpi --test mpi --no-run
//! mpirun --oversubscribe -n 4 target/debug/deps/mpi-<hash>
//! ```
//!
//! With `mpirun -n P` every check runs for each world size N = 1..=P on the first N ranks
//! (sub-communicators), for both [`MpiTransport`] under [`Communicator`] (results bit-equal
//! to the documented reference orders) and the native [`MpiCollectives`] (bit-identical
//! across ranks, within rounding of the reference). Run without `mpirun` it is a
//! singleton (N = 1). A watchdog ends the process if anything hangs.

mod common;

use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;
use dtrain_comms::ps::{DenseF32, PsConfig, PsLayout, PsNode, Reduction};
use dtrain_comms::wire::Algo;
use dtrain_comms::{
    segment_range, CommConfig, CommError, Communicator, MpiCollectives, MpiTransport, ReduceOp,
};
use mpi::environment::Threading;
use mpi::topology::Communicator as _;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

type Comm = Communicator<MpiTransport>;

fn comm(sub: &SimpleCommunicator, cfg: CommConfig) -> Comm {
    Communicator::new(MpiTransport::new(sub).expect("MPI transport"), cfg)
}

fn all_reduce(sub: &SimpleCommunicator, world: usize) {
    let cfg = test_config();
    let me = sub.rank() as usize;
    let lens = all_reduce_lens(world, &cfg);
    let mut c = comm(sub, cfg.clone());
    for (li, &n) in lens.iter().enumerate() {
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let seed = (world * 100 + li) as u64;
            let inputs: Vec<Vec<f32>> = (0..world)
                .map(|r| Rng(seed * 31 + r as u64).f32s(n))
                .collect();
            let mut v = inputs[me].clone();
            match op {
                ReduceOp::Sum => c.all_reduce_sum(&mut v).unwrap(),
                ReduceOp::Max => c.all_reduce_max(&mut v).unwrap(),
            }
            let want = flat_reference(&inputs, op, c.all_reduce_algo(n) == Algo::RecursiveDoubling);
            assert_eq!(
                bits(&v),
                bits(&want),
                "world {world} n {n} {op:?} rank {me}"
            );
        }
    }
}

fn all_gather(sub: &SimpleCommunicator, world: usize) {
    let me = sub.rank() as usize;
    let mut c = comm(sub, test_config());
    for trial in 0..3u64 {
        let mut rng = Rng(world as u64 * 7 + trial);
        let inputs: Vec<Vec<u8>> = (0..world)
            .map(|_| {
                let n = [0, 0, 1, 255, 256, 1000][rng.below(6)];
                rng.bytes(n)
            })
            .collect();
        assert_eq!(c.all_gather(&inputs[me]).unwrap(), inputs, "trial {trial}");
    }
}

fn broadcast(sub: &SimpleCommunicator, world: usize) {
    let me = sub.rank() as usize;
    let mut c = comm(sub, test_config());
    for root in 0..world {
        for n in [0usize, 5, 700] {
            let payload = Rng((root * 10 + n) as u64).bytes(n);
            let mut v = if me == root {
                payload.clone()
            } else {
                vec![9; 3]
            };
            c.broadcast(&mut v, root).unwrap();
            assert_eq!(v, payload, "world {world} root {root} n {n}");
        }
    }
}

fn reduce_scatter(sub: &SimpleCommunicator, world: usize) {
    let me = sub.rank() as usize;
    let mut c = comm(sub, test_config());
    for n in [0usize, 1, world + 1, 333] {
        let inputs: Vec<Vec<f32>> = (0..world)
            .map(|r| Rng((n * 13 + r) as u64).f32s(n))
            .collect();
        let want = ring_reference(&inputs, ReduceOp::Sum);
        let mut v = inputs[me].clone();
        let range = c.reduce_scatter(&mut v).unwrap();
        assert_eq!(range, segment_range(n, world, me));
        assert_eq!(bits(&v[range.clone()]), bits(&want[range.clone()]));
        for i in (0..n).filter(|i| !range.contains(i)) {
            assert_eq!(v[i].to_bits(), inputs[me][i].to_bits());
        }
    }
}

/// The compressed all-reduce with the lossless f32 codec of the other transports' suites:
/// the rank-order sum bit for bit, and about two buffers' bytes sent, not P − 1.
fn compressed_all_reduce(sub: &SimpleCommunicator, world: usize) {
    let me = sub.rank() as usize;
    let mut c = comm(sub, test_config());
    for n in [0usize, 1, 5, 1000, 70_000] {
        let inputs: Vec<Vec<f32>> = (0..world)
            .map(|r| Rng(n as u64 * 31 + r as u64).f32s(n))
            .collect();
        let shares = f32_shares(&inputs[me], world);
        let views: Vec<&[u8]> = shares.iter().map(|b| &b[..]).collect();
        let mut red = sum_f32_shares;
        let blocks = c.compressed_all_reduce(&views, n as u32, &mut red).unwrap();
        assert_eq!(
            bits(&le_f32s(&blocks.concat())),
            bits(&rank_order_sum(&inputs)),
            "world {world} n {n} rank {me}"
        );
        let sent = c.last_bytes().sent;
        let bound = compressed_sent_bound(n, world);
        assert!(
            sent <= bound,
            "world {world} n {n} rank {me}: sent {sent}, bound {bound}"
        );
    }
}

/// The hierarchical all-reduce on every grouping of the other transports' suites: the
/// reference's bits on every rank.
fn hierarchical_all_reduce(sub: &SimpleCommunicator, world: usize) {
    let me = sub.rank() as usize;
    let cfg = test_config();
    let mut c = comm(sub, cfg.clone());
    for topo in topologies(world) {
        for n in all_reduce_lens(world, &cfg) {
            let inputs: Vec<Vec<f32>> = (0..world)
                .map(|r| Rng(n as u64 * 37 + r as u64).f32s(n))
                .collect();
            let small = c.all_reduce_algo(n) == Algo::RecursiveDoubling;
            let mut v = inputs[me].clone();
            c.hierarchical_all_reduce_sum(&mut v, &topo).unwrap();
            assert_eq!(
                bits(&v),
                bits(&hierarchical_reference(&inputs, &topo, small)),
                "world {world} {} n {n} rank {me}",
                topo.describe()
            );
        }
    }
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// Gathers one u64 from every rank (native MPI, for cross-process checks).
fn gather_u64(native: &mut MpiCollectives, x: u64) -> Vec<u64> {
    native
        .all_gather(&x.to_le_bytes())
        .unwrap()
        .iter()
        .map(|b| u64::from_le_bytes(b[..8].try_into().unwrap()))
        .collect()
}

fn barrier(sub: &SimpleCommunicator, _world: usize) {
    let me = sub.rank() as usize;
    let mut native = MpiCollectives::new(sub).unwrap();
    let mut c = comm(sub, test_config());
    native.barrier().unwrap();
    thread::sleep(Duration::from_millis(15 * me as u64));
    let enter = unix_nanos();
    c.barrier().unwrap();
    let exit = unix_nanos();
    let last_enter = *gather_u64(&mut native, enter).iter().max().unwrap();
    assert!(exit >= last_enter, "rank {me} left the barrier early");
}

fn sequence_and_bytes(sub: &SimpleCommunicator, world: usize) {
    let me = sub.rank() as usize;
    let mut native = MpiCollectives::new(sub).unwrap();
    let mut c = comm(sub, test_config());
    let n = 1000usize;
    for i in 0..5 {
        let mut v = vec![(me + i) as f32; n];
        c.all_reduce_sum(&mut v).unwrap();
        let want: f32 = (0..world).map(|r| (r + i) as f32).sum();
        assert_eq!(v[0], want);
        assert_eq!(c.all_gather(&vec![me as u8; me + i]).unwrap().len(), world);
        c.barrier().unwrap();
    }
    let mut v = vec![1.0f32; n];
    c.all_reduce_sum(&mut v).unwrap();
    let (last, total) = (c.last_bytes(), c.total_bytes());
    let sent: u64 = gather_u64(&mut native, last.sent).iter().sum();
    let recv: u64 = gather_u64(&mut native, last.received).iter().sum();
    assert_eq!(sent, recv, "bytes of the last call agree over all ranks");
    let sent: u64 = gather_u64(&mut native, total.sent).iter().sum();
    let recv: u64 = gather_u64(&mut native, total.received).iter().sum();
    assert_eq!(sent, recv, "total bytes agree over all ranks");
    let payload = (2 * (world - 1) * n * 4 / world) as u64;
    assert!(last.sent >= payload, "sent {} < {payload}", last.sent);
    assert!(last.sent <= payload + 8 + 64 * 2 * (world as u64) * 41);
}

fn dead_peer(sub: &SimpleCommunicator, world: usize) {
    dead_peer_during(sub, world, |c| {
        let mut v = vec![1.0f32; 1000];
        c.all_reduce_sum(&mut v).unwrap_err()
    });
}

/// The hierarchical all-reduce over hosts of two ranks with rank `world / 2` gone.
fn hierarchical_dead_peer(sub: &SimpleCommunicator, world: usize) {
    let keys: Vec<String> = (0..world).map(|r| (r / 2).to_string()).collect();
    let topo = dtrain_comms::topology::Topology::from_keys(&keys);
    dead_peer_during(sub, world, |c| {
        let mut v = vec![1.0f32; 1000];
        c.hierarchical_all_reduce_sum(&mut v, &topo).unwrap_err()
    });
}

/// Rank `world / 2` drops its transport before `op`: every survivor's `op` fails within
/// 4 s naming it, and the communicator stays failed.
fn dead_peer_during(sub: &SimpleCommunicator, world: usize, op: impl Fn(&mut Comm) -> CommError) {
    let me = sub.rank() as usize;
    let victim = world / 2;
    let cfg = CommConfig {
        timeout: Duration::from_secs(5),
        ..test_config()
    };
    let mut c = comm(sub, cfg);
    if me == victim {
        return; // drops its transport: peers are told it closed
    }
    let start = Instant::now();
    let e = op(&mut c);
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
    assert!(matches!(e, CommError::PeerLost { .. }), "rank {me}: {e}");
    assert_eq!(e.failed_ranks(), vec![victim], "rank {me}: {e}");
    assert!(matches!(c.barrier(), Err(CommError::Poisoned(_))));
}

fn stalled_peer(sub: &SimpleCommunicator, world: usize) {
    let me = sub.rank() as usize;
    let victim = world - 1;
    let cfg = CommConfig {
        timeout: Duration::from_millis(300),
        abort_grace: Duration::from_millis(1000),
        ..test_config()
    };
    let mut native = MpiCollectives::new(sub).unwrap();
    let mut c = comm(sub, cfg);
    if me == victim {
        // Connected but silent until every survivor has given up.
        native.barrier().unwrap();
        return;
    }
    let start = Instant::now();
    let mut v = vec![1.0f32; 1000];
    let e = c.all_reduce_sum(&mut v).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    assert!(matches!(e, CommError::Timeout { .. }), "rank {me}: {e}");
    assert_eq!(e.failed_ranks(), vec![victim], "rank {me}: {e}");
    native.barrier().unwrap();
}

fn mismatch(sub: &SimpleCommunicator, _world: usize) {
    let me = sub.rank();
    let cfg = CommConfig {
        timeout: Duration::from_secs(5),
        ..test_config()
    };
    let mut c = comm(sub, cfg);
    let mut v = vec![1.0f32; if me == 0 { 500 } else { 501 }];
    let e = c.all_reduce_sum(&mut v).unwrap_err();
    assert!(matches!(e, CommError::Mismatch { .. }), "rank {me}: {e}");
}

/// Parameter server over MPI: every rank a worker and the first two also servers; then
/// (N >= 2) the last rank a separate server for the others, with staleness 1.
fn parameter_server(sub: &SimpleCommunicator, world: usize) {
    let me = sub.rank() as usize;
    let len = 1001;
    let grads = |step: u64, w: usize| Rng(step * 1000 + w as u64).f32s(len);
    let mut layouts = vec![(
        PsLayout::new(
            world,
            (0..world).collect(),
            (0..world.min(2)).collect(),
            len,
        )
        .unwrap(),
        0,
    )];
    if world >= 2 {
        let l = PsLayout::new(world, (0..world - 1).collect(), vec![world - 1], len).unwrap();
        layouts.push((l, 1));
    }
    for (layout, staleness) in layouts {
        let t = MpiTransport::new(sub).unwrap();
        let cfg = PsConfig {
            timeout: Duration::from_secs(10),
            staleness,
            ..PsConfig::default()
        };
        let mut node = PsNode::new(t, layout.clone(), cfg, DenseF32).unwrap();
        let Some(wi) = layout.worker_index(me) else {
            node.serve().unwrap();
            continue;
        };
        let workers = layout.workers().len();
        let mut got = Vec::new();
        for step in 0..3u64 {
            got.extend(node.step_dense(&grads(step, wi), Reduction::SUM).unwrap());
        }
        got.extend(node.finish().unwrap());
        assert_eq!(got.len(), 3);
        for (step, a) in got.iter().enumerate() {
            let inputs: Vec<Vec<f32>> = (0..workers).map(|w| grads(step as u64, w)).collect();
            assert_eq!(a.step, step as u64);
            assert_eq!(bits(&a.dense()), bits(&rank_order_sum(&inputs)));
        }
    }
}

/// Native collectives: equal lengths checked, results bit-identical across ranks and
/// within rounding of the exact sum.
fn native(sub: &SimpleCommunicator, world: usize) {
    let me = sub.rank() as usize;
    let mut m = MpiCollectives::new(sub).unwrap();
    assert_eq!((m.rank(), m.world_size()), (me, world));
    for n in [0usize, 1, 17, 100_000] {
        let inputs: Vec<Vec<f32>> = (0..world)
            .map(|r| Rng((n * 7 + r) as u64).f32s(n))
            .collect();
        let mut v = inputs[me].clone();
        m.all_reduce_sum(&mut v).unwrap();
        let gathered = m
            .all_gather(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
            .unwrap();
        assert!(gathered.windows(2).all(|p| p[0] == p[1]), "ranks differ");
        for i in 0..n {
            let exact: f64 = inputs.iter().map(|x| x[i] as f64).sum();
            let mag: f64 = inputs.iter().map(|x| x[i].abs() as f64).sum();
            let tol = mag * f32::EPSILON as f64 * world as f64;
            assert!((v[i] as f64 - exact).abs() <= tol, "n {n} i {i}");
        }
        let mut v = inputs[me].clone();
        m.all_reduce_max(&mut v).unwrap();
        let want: Vec<f32> = (0..n)
            .map(|i| inputs.iter().map(|x| x[i]).fold(f32::MIN, f32::max))
            .collect();
        assert_eq!(bits(&v), bits(&want));
        let mut v = inputs[me].clone();
        let range = m.reduce_scatter(&mut v).unwrap();
        assert_eq!(range, segment_range(n, world, me));
        for i in 0..n {
            if range.contains(&i) {
                let exact: f64 = inputs.iter().map(|x| x[i] as f64).sum();
                let mag: f64 = inputs.iter().map(|x| x[i].abs() as f64).sum();
                assert!((v[i] as f64 - exact).abs() <= mag * f32::EPSILON as f64 * world as f64);
            } else {
                assert_eq!(v[i].to_bits(), inputs[me][i].to_bits());
            }
        }
    }
    let mut rng = Rng(world as u64);
    let blocks: Vec<Vec<u8>> = (0..world)
        .map(|_| {
            let n = [0, 0, 3, 1000][rng.below(4)];
            rng.bytes(n)
        })
        .collect();
    assert_eq!(m.all_gather(&blocks[me]).unwrap(), blocks);
    for (root, block) in blocks.iter().enumerate() {
        let mut v = if me == root {
            block.clone()
        } else {
            vec![7; 9]
        };
        m.broadcast(&mut v, root).unwrap();
        assert_eq!(&v, block);
    }
    assert!(m.broadcast(&mut Vec::new(), world).is_err());
    m.barrier().unwrap();
    if world > 1 {
        let mut v = vec![0f32; 10 + usize::from(me == 0)];
        let e = m.all_reduce_sum(&mut v).unwrap_err();
        assert!(matches!(e, CommError::InvalidArgument(_)), "{e}");
    }
}

type Check = fn(&SimpleCommunicator, usize);

fn main() {
    exit_on_hang_or_panic("mpi conformance", Duration::from_secs(120));
    let (universe, threading) =
        mpi::initialize_with_threading(Threading::Serialized).expect("MPI initialises once");
    assert!(matches!(
        threading,
        Threading::Serialized | Threading::Multiple
    ));
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let checks: &[(&str, Check, usize)] = &[
        ("all_reduce", all_reduce, 1),
        ("all_gather", all_gather, 1),
        ("broadcast", broadcast, 1),
        ("reduce_scatter", reduce_scatter, 1),
        ("compressed_all_reduce", compressed_all_reduce, 1),
        ("hierarchical_all_reduce", hierarchical_all_reduce, 1),
        ("barrier", barrier, 1),
        ("sequence_and_bytes", sequence_and_bytes, 1),
        ("dead_peer", dead_peer, 2),
        ("hierarchical_dead_peer", hierarchical_dead_peer, 2),
        ("stalled_peer", stalled_peer, 2),
        ("mismatch", mismatch, 2),
        ("parameter_server", parameter_server, 1),
        ("native", native, 1),
    ];
    let mut passed = 0;
    for n in 1..=size {
        let color = if rank < n {
            Color::with_value(0)
        } else {
            Color::undefined()
        };
        let sub = world.split_by_color(color);
        for (name, check, min) in checks {
            if n < *min {
                continue;
            }
            if let Some(sub) = &sub {
                let start = Instant::now();
                check(sub, n);
                if rank == 0 {
                    println!("test mpi::{name} (N = {n}) ... ok ({:?})", start.elapsed());
                }
            }
            passed += 1;
            world.barrier();
        }
    }
    if rank == 0 {
        println!("\nmpi conformance suite, world size {size} (N = 1..={size}):");
        println!("mpi: {passed} passed, 0 failed");
    }
}
