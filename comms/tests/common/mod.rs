//! Shared helpers of the comms test suites: deterministic random data, reference
//! reductions in the documented orders, a simulated network for the state machines, and
//! the transport conformance suite.

#![allow(dead_code)]

mod drivers;
pub use drivers::*;

use std::collections::VecDeque;
use std::sync::{Arc, Barrier as StdBarrier};
use std::thread;
use std::time::{Duration, Instant};

use dtrain_comms::algo::{AlgoError, Machine};
use dtrain_comms::topology::Topology;
use dtrain_comms::wire::Algo;
use dtrain_comms::{segment_range, CommConfig, CommError, Communicator, ReduceOp, Transport};

/// For the harness-less programs run under `mpirun`: never hang and never unwind. A check
/// still running after `limit` ends the process with status 124 (and mpirun the job), and a
/// panic exits with 101 at once (unwinding would run MPI_Finalize, which waits for the
/// other ranks).
pub fn exit_on_hang_or_panic(name: &'static str, limit: Duration) {
    thread::spawn(move || {
        thread::sleep(limit);
        eprintln!("{name}: watchdog fired after {limit:?}");
        std::process::exit(124);
    });
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        std::process::exit(101);
    }));
}

/// SplitMix64: small deterministic generator for test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// A float with a random sign and a magnitude spread over many binades, so that the
    /// summation order changes the rounded result.
    pub fn f32(&mut self) -> f32 {
        let m = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 + 0.5;
        let e = self.below(40) as i32 - 20;
        let s = if self.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
        s * m * 2f32.powi(e)
    }

    pub fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// Reference ring reduction: segment `s` accumulated from rank `s+1` around the ring to `s`.
pub fn ring_reference(inputs: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    let p = inputs.len();
    let n = inputs[0].len();
    let mut out = vec![0.0; n];
    for s in 0..p {
        for i in segment_range(n, p, s) {
            let mut acc = inputs[(s + 1) % p][i];
            for k in 2..=p {
                acc = op.apply(acc, inputs[(s + k) % p][i]);
            }
            out[i] = acc;
        }
    }
    out
}

/// Reference recursive-doubling reduction: balanced tree over the folded leaves.
pub fn tree_reference(inputs: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    let p = inputs.len();
    let p2 = 1usize << (usize::BITS - 1 - p.leading_zeros());
    let leaves: Vec<Vec<f32>> = (0..p2)
        .map(|i| {
            if i + p2 < p {
                inputs[i]
                    .iter()
                    .zip(&inputs[i + p2])
                    .map(|(a, b)| op.apply(*a, *b))
                    .collect()
            } else {
                inputs[i].clone()
            }
        })
        .collect();
    fn tree(l: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
        if l.len() == 1 {
            return l[0].clone();
        }
        let (a, b) = l.split_at(l.len() / 2);
        tree(a, op)
            .iter()
            .zip(tree(b, op))
            .map(|(x, y)| op.apply(*x, y))
            .collect()
    }
    tree(&leaves, op)
}

/// Reference hierarchical all-reduce (sum) over `topology`: each host's sum folded from its
/// highest rank down to its leader, then the flat all-reduce of the host sums among the
/// leaders in host order — the tree of recursive doubling when `small`, else the ring.
pub fn hierarchical_reference(inputs: &[Vec<f32>], topology: &Topology, small: bool) -> Vec<f32> {
    let sums: Vec<Vec<f32>> = (0..topology.hosts())
        .map(|h| {
            let members = topology.members(h);
            let mut acc = inputs[*members.last().unwrap()].clone();
            for &m in members.iter().rev().skip(1) {
                for (a, x) in acc.iter_mut().zip(&inputs[m]) {
                    *a += x;
                }
            }
            acc
        })
        .collect();
    flat_reference(&sums, ReduceOp::Sum, small)
}

/// The groupings of `world` ranks the hierarchical scenarios run on: two or more hosts of
/// equal size, hosts of unequal sizes with interleaved ranks, one host, one rank per host.
pub fn topologies(world: usize) -> Vec<Topology> {
    let mut out: Vec<Topology> = (2..world)
        .filter(|h| world.is_multiple_of(*h))
        .map(|h| Topology::from_nodes(world, h).unwrap())
        .collect();
    if world >= 3 {
        // Ranks 0, 2, 4, … on one host, the others alone on theirs.
        let keys: Vec<String> = (0..world)
            .map(|r| {
                if r % 2 == 0 {
                    "even".into()
                } else {
                    format!("odd{r}")
                }
            })
            .collect();
        out.push(Topology::from_keys(&keys));
    }
    out.push(Topology::single_host(world));
    out.push(Topology::one_per_host(world));
    out
}

/// The hierarchical all-reduce on every grouping of [`topologies`], at the lengths of the
/// flat scenario: every rank ends with the reference's bits; with one rank per host that is
/// the flat all-reduce's, and on sums that are exact in f32 (small integers) it is the flat
/// all-reduce's whatever the grouping.
pub fn check_hierarchical_all_reduce<M: Mesh>(mesh: &M, world: usize) {
    let cfg = test_config();
    let lens = all_reduce_lens(world, &cfg);
    for (ti, topo) in topologies(world).into_iter().enumerate() {
        for (li, &n) in lens.iter().enumerate() {
            let seed = (world * 1000 + ti * 10 + li) as u64;
            let random: Vec<Vec<f32>> = (0..world)
                .map(|r| Rng(seed * 31 + r as u64).f32s(n))
                .collect();
            let integers: Vec<Vec<f32>> = (0..world)
                .map(|r| {
                    let mut g = Rng(seed * 37 + r as u64);
                    (0..n).map(|_| g.below(2001) as f32 - 1000.0).collect()
                })
                .collect();
            for (what, inputs) in [("random", random), ("integer", integers)] {
                let (ins, t) = (inputs.clone(), topo.clone());
                let out = run_ranks(mesh.make(world), cfg.clone(), move |c| {
                    let mut v = ins[c.rank()].clone();
                    let small = c.all_reduce_algo(v.len()) == Algo::RecursiveDoubling;
                    c.hierarchical_all_reduce_sum(&mut v, &t).unwrap();
                    (v, small)
                });
                let small = out[0].1;
                let want = hierarchical_reference(&inputs, &topo, small);
                let flat = flat_reference(&inputs, ReduceOp::Sum, small);
                let place = format!("world {world} {} n {n} {what}", topo.describe());
                for (r, (v, _)) in out.iter().enumerate() {
                    assert_eq!(bits(v), bits(&want), "{place}: rank {r}");
                    if what == "integer" || topo.max_per_host() == 1 {
                        assert_eq!(bits(v), bits(&flat), "{place}: rank {r} vs the flat one");
                    }
                }
            }
        }
    }
}

/// A rank gone before a hierarchical all-reduce over two-rank hosts (the victim, rank
/// `world / 2`, is a leader or a host's other member by the parity of `world / 2`): every
/// survivor names it, quickly.
pub fn check_hierarchical_dead_peer<M: Mesh>(mesh: &M, world: usize) {
    let keys: Vec<usize> = (0..world).map(|r| r / 2).collect();
    let topo = Topology::from_keys(&keys.iter().map(|k| k.to_string()).collect::<Vec<_>>());
    dead_peer_during(mesh, world, move |c| {
        let mut v = vec![1.0f32; 1000];
        c.hierarchical_all_reduce_sum(&mut v, &topo).unwrap_err()
    });
}

/// Plain rank-order sum `((x0 + x1) + x2) + …` (to show that orders differ).
pub fn rank_order_sum(inputs: &[Vec<f32>]) -> Vec<f32> {
    let mut out = inputs[0].clone();
    for x in &inputs[1..] {
        for (o, v) in out.iter_mut().zip(x) {
            *o += v;
        }
    }
    out
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Runs machines over a simulated network until all are done. Each step delivers one
/// message of a random non-empty link; with `reorder`, a random message of that link (so
/// links are not FIFO). Fails the test if the network goes quiet before all are done.
pub fn simulate(
    machines: &mut [&mut dyn Machine],
    rng: &mut Rng,
    reorder: bool,
) -> Result<(), AlgoError> {
    simulate_counted(machines, rng, reorder).map(|_| ())
}

/// [`simulate`], returning the bytes (header and payload) sent on each link, at index
/// `from · P + to`.
pub fn simulate_counted(
    machines: &mut [&mut dyn Machine],
    rng: &mut Rng,
    reorder: bool,
) -> Result<Vec<u64>, AlgoError> {
    let p = machines.len();
    let mut sent = vec![0u64; p * p];
    let mut links: Vec<VecDeque<dtrain_comms::wire::Message>> =
        (0..p * p).map(|_| VecDeque::new()).collect();
    loop {
        for (from, m) in machines.iter_mut().enumerate() {
            while let Some((to, msg)) = m.poll_transmit() {
                assert!(to < p && to != from, "machine {from} sent to {to}");
                sent[from * p + to] += msg.len() as u64;
                links[from * p + to].push_back(msg);
            }
        }
        let busy: Vec<usize> = (0..p * p).filter(|&l| !links[l].is_empty()).collect();
        if busy.is_empty() {
            assert!(
                machines.iter().all(|m| m.is_done()),
                "network quiet but machines not done"
            );
            return Ok(sent);
        }
        let l = busy[rng.below(busy.len())];
        let i = if reorder {
            rng.below(links[l].len())
        } else {
            0
        };
        let msg = links[l].remove(i).unwrap();
        machines[l % p].handle(l / p, msg)?;
    }
}

/// Runs `f` on every rank (one thread each) and returns the results in rank order.
pub fn run_ranks<T, R, F>(transports: Vec<T>, cfg: CommConfig, f: F) -> Vec<R>
where
    T: Transport + 'static,
    R: Send + 'static,
    F: Fn(&mut Communicator<T>) -> R + Send + Sync + 'static,
{
    let f = Arc::new(f);
    let handles: Vec<_> = transports
        .into_iter()
        .map(|t| {
            let f = f.clone();
            let cfg = cfg.clone();
            thread::spawn(move || {
                let mut c = Communicator::new(t, cfg);
                f(&mut c)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// Admits the newcomers of the group once any is waiting (polling every 20 ms).
pub fn admit_when_waiting<T: Transport>(c: &mut Communicator<T>) -> dtrain_comms::Membership {
    loop {
        if let Some(m) = c.admit().unwrap() {
            return m;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Live membership over a network driver: three ranks, each connected by its entry of
/// `members`, all-reduce once; rank 2 then leaves (its transport dropped), the survivors
/// regroup and wait to admit a newcomer. Half a second later `before_join` runs (a
/// stranger's attempt, say), then the newcomer `join` makes takes rank 2's place, is
/// welcomed, and the three all-reduce again.
pub fn a_newcomer_takes_a_lost_ranks_place<T: Transport + Send + 'static>(
    members: Vec<Box<dyn FnOnce() -> T + Send>>,
    before_join: impl FnOnce(),
    join: impl FnOnce() -> T,
) {
    let cc = || CommConfig {
        timeout: Duration::from_secs(10),
        ..CommConfig::default()
    };
    let hs: Vec<_> = members
        .into_iter()
        .enumerate()
        .map(|(r, connect)| {
            thread::spawn(move || {
                let mut c = Communicator::new(connect(), cc());
                let mut v = vec![1.0f32; 50_000];
                c.all_reduce_sum(&mut v).unwrap();
                if r == 2 {
                    return None;
                }
                let e = c.all_reduce_sum(&mut v).unwrap_err();
                c.regroup(&e.failed_ranks()).unwrap();
                let m = admit_when_waiting(&mut c);
                let mut v = vec![r as f32; 50_000];
                c.all_reduce_sum(&mut v).unwrap();
                Some((m, v[0], v[49_999]))
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(500));
    before_join();
    let mut c = Communicator::new(join(), cc());
    let m = c.join(Duration::from_secs(20)).unwrap();
    assert_eq!((m.epoch, m.members.clone(), m.rank), (2, vec![0, 1, 2], 2));
    let mut v = vec![2.0f32; 50_000];
    c.all_reduce_sum(&mut v).unwrap();
    assert_eq!((v[0], v[49_999]), (3.0, 3.0));
    for h in hs.into_iter().take(2) {
        let (m, a, b) = h.join().unwrap().unwrap();
        assert_eq!((m.epoch, m.added.clone()), (2, vec![2]));
        assert_eq!((a, b), (3.0, 3.0));
    }
}
/// A config with small chunks (to exercise pipelining) and short timeouts.
pub fn test_config() -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(10),
        abort_grace: Duration::from_millis(500),
        chunk_bytes: 256,
        small_all_reduce_bytes: 64,
        max_buffer_bytes: 1 << 20,
    }
}

/// Builds a fresh set of connected transports for `world` ranks.
pub trait Mesh: Sync + Send + 'static {
    type T: Transport + 'static;
    fn make(&self, world: usize) -> Vec<Self::T>;
}

/// The in-process channel driver.
pub struct Channels;

impl Mesh for Channels {
    type T = dtrain_comms::ChannelTransport;
    fn make(&self, world: usize) -> Vec<Self::T> {
        dtrain_comms::channel_mesh(world)
    }
}

/// The buffer lengths of the all-reduce scenarios: empty, one element, fewer than the ranks,
/// both sides of the recursive-doubling limit of `cfg`, and a ring's worth.
pub fn all_reduce_lens(world: usize, cfg: &CommConfig) -> [usize; 6] {
    let elems_small = cfg.small_all_reduce_bytes / 4;
    [
        0,
        1,
        world.saturating_sub(1),
        elems_small,
        elems_small + 1,
        1000,
    ]
}

/// The flat all-reduce's result in its documented order: recursive doubling's tree for
/// `small` buffers, else the ring's.
pub fn flat_reference(inputs: &[Vec<f32>], op: ReduceOp, small: bool) -> Vec<f32> {
    if small {
        tree_reference(inputs, op)
    } else {
        ring_reference(inputs, op)
    }
}

pub fn check_all_reduce<M: Mesh>(mesh: &M, world: usize) {
    let cfg = test_config();
    let lens = all_reduce_lens(world, &cfg);
    for (li, &n) in lens.iter().enumerate() {
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let seed = (world * 100 + li) as u64;
            let inputs: Vec<Vec<f32>> = (0..world)
                .map(|r| Rng(seed * 31 + r as u64).f32s(n))
                .collect();
            let ins = inputs.clone();
            let out = run_ranks(mesh.make(world), cfg.clone(), move |c| {
                let mut v = ins[c.rank()].clone();
                let algo = c.all_reduce_algo(v.len());
                match op {
                    ReduceOp::Sum => c.all_reduce_sum(&mut v).unwrap(),
                    ReduceOp::Max => c.all_reduce_max(&mut v).unwrap(),
                }
                (v, algo)
            });
            let algo = out[0].1;
            let want = flat_reference(&inputs, op, algo == Algo::RecursiveDoubling);
            for (r, (v, a)) in out.iter().enumerate() {
                assert_eq!(*a, algo);
                assert_eq!(
                    bits(v),
                    bits(&want),
                    "world {world} n {n} {op:?} {algo:?}: rank {r} differs"
                );
            }
        }
    }
}

pub fn check_all_gather<M: Mesh>(mesh: &M, world: usize) {
    for trial in 0..3u64 {
        let mut rng = Rng(world as u64 * 7 + trial);
        // Sizes with zeros, tiny, multi-chunk (chunk is 256 bytes).
        let inputs: Vec<Vec<u8>> = (0..world)
            .map(|_| {
                let n = [0, 0, 1, 255, 256, 1000][rng.below(6)];
                rng.bytes(n)
            })
            .collect();
        let ins = inputs.clone();
        let out = run_ranks(mesh.make(world), test_config(), move |c| {
            c.all_gather(&ins[c.rank()]).unwrap()
        });
        for (r, got) in out.iter().enumerate() {
            assert_eq!(got, &inputs, "world {world} trial {trial}: rank {r}");
        }
    }
}

/// `all_gather_into` over reused output buffers: sizes that grow, shrink and vanish from
/// call to call, and an output vector that starts with the wrong number of (junk) buffers.
pub fn check_all_gather_into<M: Mesh>(mesh: &M, world: usize) {
    let rounds: Vec<Vec<Vec<u8>>> = (0..5u64)
        .map(|k| {
            let mut rng = Rng(world as u64 * 131 + k);
            (0..world)
                .map(|_| {
                    let n = [0, 1, 255, 1000, 3000][rng.below(5)];
                    rng.bytes(n)
                })
                .collect()
        })
        .collect();
    let rs = rounds.clone();
    let out = run_ranks(mesh.make(world), test_config(), move |c| {
        let mut out = vec![vec![0xEE; 77]; world + 2 - c.rank() % 3];
        rs.iter()
            .map(|inputs| {
                c.all_gather_into(&inputs[c.rank()], &mut out).unwrap();
                out.clone()
            })
            .collect::<Vec<_>>()
    });
    for (r, got) in out.iter().enumerate() {
        for (k, inputs) in rounds.iter().enumerate() {
            assert_eq!(&got[k], inputs, "world {world} rank {r} round {k}");
        }
    }
}

pub fn check_broadcast<M: Mesh>(mesh: &M, world: usize) {
    for root in 0..world {
        for n in [0usize, 5, 700] {
            let payload = Rng((root * 10 + n) as u64).bytes(n);
            let p = payload.clone();
            let out = run_ranks(mesh.make(world), test_config(), move |c| {
                let mut v = if c.rank() == root {
                    p.clone()
                } else {
                    vec![9; 3]
                };
                c.broadcast(&mut v, root).unwrap();
                v
            });
            for (r, got) in out.iter().enumerate() {
                assert_eq!(got, &payload, "world {world} root {root} n {n}: rank {r}");
            }
        }
    }
}

pub fn check_reduce_scatter<M: Mesh>(mesh: &M, world: usize) {
    for n in [0usize, 1, world + 1, 333] {
        let inputs: Vec<Vec<f32>> = (0..world)
            .map(|r| Rng((n * 13 + r) as u64).f32s(n))
            .collect();
        let want = ring_reference(&inputs, ReduceOp::Sum);
        let ins = inputs.clone();
        let out = run_ranks(mesh.make(world), test_config(), move |c| {
            let mut v = ins[c.rank()].clone();
            let range = c.reduce_scatter(&mut v).unwrap();
            (range, v)
        });
        for (r, (range, v)) in out.iter().enumerate() {
            assert_eq!(*range, segment_range(n, world, r));
            assert_eq!(
                bits(&v[range.clone()]),
                bits(&want[range.clone()]),
                "world {world} n {n} rank {r}"
            );
            // Outside its segment the buffer is untouched.
            for i in (0..n).filter(|i| !range.contains(i)) {
                assert_eq!(v[i].to_bits(), inputs[r][i].to_bits());
            }
        }
    }
}

pub fn check_barrier<M: Mesh>(mesh: &M, world: usize) {
    let out = run_ranks(mesh.make(world), test_config(), |c| {
        // Later ranks enter later; nobody may leave before the last one entered.
        thread::sleep(Duration::from_millis(15 * c.rank() as u64));
        let enter = Instant::now();
        c.barrier().unwrap();
        (enter, Instant::now())
    });
    let last_enter = out.iter().map(|x| x.0).max().unwrap();
    for (r, (_, exit)) in out.iter().enumerate() {
        assert!(
            *exit >= last_enter,
            "world {world}: rank {r} left the barrier early"
        );
    }
}

/// Several different collectives back to back on one communicator: exercises messages of
/// the next collective arriving before this one finished.
pub fn check_sequence_and_bytes<M: Mesh>(mesh: &M, world: usize) {
    let n = 1000usize;
    let out = run_ranks(mesh.make(world), test_config(), move |c| {
        let r = c.rank();
        let mut sums = Vec::new();
        for i in 0..5 {
            let mut v = vec![(r + i) as f32; n];
            c.all_reduce_sum(&mut v).unwrap();
            sums.push(v[0]);
            let g = c.all_gather(&vec![r as u8; r + i]).unwrap();
            assert_eq!(g.len(), world);
            c.barrier().unwrap();
        }
        let mut v = vec![1.0f32; n];
        c.all_reduce_sum(&mut v).unwrap();
        (sums, c.last_bytes(), c.total_bytes())
    });
    for (sums, _, _) in &out {
        let want: Vec<f32> = (0..5)
            .map(|i| (0..world).map(|r| (r + i) as f32).sum())
            .collect();
        assert_eq!(sums, &want);
    }
    let sent: u64 = out.iter().map(|x| x.1.sent).sum();
    let recv: u64 = out.iter().map(|x| x.1.received).sum();
    assert_eq!(sent, recv, "bytes sent and received over all ranks agree");
    let total_sent: u64 = out.iter().map(|x| x.2.sent).sum();
    let total_recv: u64 = out.iter().map(|x| x.2.received).sum();
    assert_eq!(total_sent, total_recv);
    if world > 1 {
        // Ring all-reduce: every rank sends 2(P-1)/P of the buffer plus headers.
        let payload = (2 * (world - 1) * n * 4 / world) as u64;
        for (r, x) in out.iter().enumerate() {
            assert!(
                x.1.sent >= payload,
                "rank {r} sent {} < {payload}",
                x.1.sent
            );
            assert!(
                x.1.sent <= payload + 8 + 64 * 2 * (world as u64) * 41,
                "rank {r} sent {}",
                x.1.sent
            );
        }
    } else {
        assert_eq!(out[0].1.sent, 0);
    }
}

/// A peer whose transport is dropped: every survivor fails fast with an error naming it.
pub fn check_dead_peer<M: Mesh>(mesh: &M, world: usize) {
    dead_peer_during(mesh, world, |c| {
        let mut v = vec![1.0f32; 1000];
        let e = c.all_reduce_sum(&mut v).unwrap_err();
        // The communicator stays failed afterwards.
        assert!(matches!(c.barrier(), Err(CommError::Poisoned(_))));
        e
    });
}

/// Rank `world / 2` is gone before the collective `op`: every survivor's `op` fails within
/// 4 s with [`CommError::PeerLost`] naming it.
fn dead_peer_during<M: Mesh>(
    mesh: &M,
    world: usize,
    op: impl Fn(&mut Communicator<M::T>) -> CommError + Send + Sync + 'static,
) {
    assert!(world >= 2);
    let victim = world / 2;
    let cfg = CommConfig {
        timeout: Duration::from_secs(5),
        ..test_config()
    };
    let start = Instant::now();
    let out = run_ranks(mesh.make(world), cfg, move |c| {
        (c.rank() != victim).then(|| op(c))
    });
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "took {:?}",
        start.elapsed()
    );
    for (r, e) in out.into_iter().enumerate() {
        if let Some(e) = e {
            assert!(matches!(e, CommError::PeerLost { .. }), "rank {r}: {e}");
            assert_eq!(e.failed_ranks(), vec![victim], "rank {r}: {e}");
        }
    }
}

/// A peer that stays connected but never joins: every survivor times out naming it. (The
/// 0.6 s abort grace keeps loaded machines from mistaking a slow survivor for a stalled
/// one; the grace is part of the 1.5 s timeout.)
pub fn check_stalled_peer<M: Mesh>(mesh: &M, world: usize) {
    assert!(world >= 2);
    let victim = world - 1;
    let cfg = CommConfig {
        timeout: Duration::from_millis(1500),
        abort_grace: Duration::from_millis(600),
        ..test_config()
    };
    let start = Instant::now();
    let finished = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let out = run_ranks(mesh.make(world), cfg, move |c| {
        use std::sync::atomic::Ordering::SeqCst;
        if c.rank() == victim {
            // Stay connected but silent until every survivor has given up (at most 5 s).
            while finished.load(SeqCst) < world - 1 && start.elapsed() < Duration::from_secs(6) {
                thread::sleep(Duration::from_millis(10));
            }
            return None;
        }
        let mut v = vec![1.0f32; 1000];
        let t = Instant::now();
        let e = c.all_reduce_sum(&mut v).unwrap_err();
        let took = t.elapsed();
        finished.fetch_add(1, SeqCst);
        Some((e, took))
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
    for (r, e) in out.into_iter().enumerate() {
        if let Some((e, took)) = e {
            assert!(matches!(e, CommError::Timeout { .. }), "rank {r}: {e}");
            assert_eq!(e.failed_ranks(), vec![victim], "rank {r}: {e}");
            // Reported within the timeout, give or take scheduling.
            assert!(
                took < Duration::from_millis(2200),
                "world {world} rank {r} took {took:?}"
            );
        }
    }
}

/// A rank that stalls *between* collectives for longer than the timeout (alive, its
/// transport open, it just does not call the next collective): every survivor fails in the
/// next collective within the timeout (plus a little slack) naming it, and the late rank,
/// when it finally calls, fails naming itself.
pub fn check_late_rank<M: Mesh>(mesh: &M, world: usize) {
    assert!(world >= 2);
    let victim = world - 1;
    let timeout = Duration::from_millis(1000);
    let cfg = CommConfig {
        timeout,
        abort_grace: Duration::from_millis(300),
        ..test_config()
    };
    let out = run_ranks(mesh.make(world), cfg, move |c| {
        let mut v = vec![1.0f32; 1000];
        c.all_reduce_sum(&mut v).unwrap();
        if c.rank() == victim {
            thread::sleep(Duration::from_millis(2500));
        }
        let t = Instant::now();
        let e = c.all_reduce_sum(&mut v).unwrap_err();
        (e, t.elapsed())
    });
    for (r, (e, took)) in out.iter().enumerate() {
        assert!(matches!(e, CommError::Timeout { .. }), "rank {r}: {e}");
        assert_eq!(
            e.failed_ranks(),
            vec![victim],
            "world {world} rank {r}: {e}"
        );
        if r != victim {
            assert!(
                *took < timeout + Duration::from_millis(600),
                "world {world} rank {r} took {took:?}"
            );
        }
    }
}

/// Liveness traffic is invisible: with heartbeats every 20 ms and a 300 ms peer timeout,
/// a mesh left idle for 1 s (long past the peer timeout) still works, and the collective
/// after the pause moves exactly the bytes of the one before it — heartbeats are neither
/// delivered nor counted.
pub fn check_idle_heartbeats<D: Heartbeats>(d: &D) {
    let world = 3;
    let mut cfg = d.config();
    D::set_liveness(
        &mut cfg,
        Some(Duration::from_millis(20)),
        Some(Duration::from_millis(300)),
    );
    let ts = d.mesh_with(world, cfg);
    let out = run_ranks(ts, test_config(), |c| {
        let mut v = vec![c.rank() as f32; 1000];
        c.all_reduce_sum(&mut v).unwrap();
        let (before, total_before) = (c.last_bytes(), c.total_bytes());
        thread::sleep(Duration::from_millis(1000));
        let idle = c.total_bytes();
        c.all_reduce_sum(&mut v).unwrap();
        (before, total_before, idle, c.last_bytes(), v[0])
    });
    for (r, (before, total_before, idle, after, v0)) in out.into_iter().enumerate() {
        assert_eq!(v0, 9.0, "rank {r}");
        assert_eq!(idle, total_before, "rank {r}: bytes counted while idle");
        assert_eq!(before, after, "rank {r}");
    }
}

/// Ranks calling different collectives (or different lengths) all fail, none hangs.
pub fn check_mismatch<M: Mesh>(mesh: &M, world: usize) {
    assert!(world >= 2);
    let cfg = CommConfig {
        timeout: Duration::from_secs(5),
        ..test_config()
    };
    let start = Instant::now();
    // Different lengths on rank 0.
    let out = run_ranks(mesh.make(world), cfg.clone(), |c| {
        let mut v = vec![1.0f32; if c.rank() == 0 { 500 } else { 501 }];
        c.all_reduce_sum(&mut v).unwrap_err()
    });
    for (r, e) in out.iter().enumerate() {
        assert!(matches!(e, CommError::Mismatch { .. }), "rank {r}: {e}");
    }
    // Different kinds: rank 1 gathers, the others barrier.
    let sync = Arc::new(StdBarrier::new(world));
    let out = run_ranks(mesh.make(world), cfg, move |c| {
        sync.wait();
        if c.rank() == 1 {
            c.all_gather(b"x").unwrap_err()
        } else {
            c.barrier().map(|_| ()).unwrap_err()
        }
    });
    for (r, e) in out.iter().enumerate() {
        assert!(matches!(e, CommError::Mismatch { .. }), "rank {r}: {e}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "took {:?}",
        start.elapsed()
    );
}

/// One rank's sparse input: strictly increasing indices and their values.
pub type SparseInput = (Vec<u32>, Vec<f32>);

/// How the ranks' index sets of a sparse test case relate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pattern {
    /// Each rank draws its own indices with the given density (0 gives an empty input).
    Independent(f64),
    /// Rank `q` draws with density `densities[q % 4]`: empty, sparse and dense ranks mixed.
    Mixed,
    /// Every rank stores the same indices; rank 1 stores the negation of rank 0's values at
    /// some of them, so that partial sums cancel to exactly zero.
    Overlapping(f64),
    /// Every index is stored by at most one rank.
    Disjoint(f64),
    /// A fraction `overlap` of each rank's `density · n` entries lies on indices shared by
    /// all ranks, the rest is drawn independently (Top-k of correlated gradients).
    Shared { density: f64, overlap: f64 },
}

impl Rng {
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A test value: mostly spread over many binades, sometimes ±0.0 or a small integer.
    pub fn sparse_value(&mut self) -> f32 {
        match self.below(16) {
            0 => 0.0,
            1 => -0.0,
            2 => self.below(4) as f32,
            _ => self.f32(),
        }
    }
}

/// Sparse inputs of `world` ranks over dimension `n` (deterministic in `seed`).
pub fn sparse_inputs(seed: u64, world: usize, n: usize, pattern: Pattern) -> Vec<SparseInput> {
    let mut rng = Rng(seed);
    let pick =
        |rng: &mut Rng, d: f64| -> Vec<u32> { (0..n as u32).filter(|_| rng.unit() < d).collect() };
    let with_values = |rng: &mut Rng, idx: Vec<u32>| -> SparseInput {
        let vals = idx.iter().map(|_| rng.sparse_value()).collect();
        (idx, vals)
    };
    match pattern {
        Pattern::Independent(d) => (0..world)
            .map(|_| {
                let idx = pick(&mut rng, d);
                with_values(&mut rng, idx)
            })
            .collect(),
        Pattern::Mixed => (0..world)
            .map(|q| {
                let idx = pick(&mut rng, [0.0, 0.05, 0.6, 1.0][q % 4]);
                with_values(&mut rng, idx)
            })
            .collect(),
        Pattern::Overlapping(d) => {
            let idx = pick(&mut rng, d);
            let mut out: Vec<SparseInput> = (0..world)
                .map(|_| with_values(&mut rng, idx.clone()))
                .collect();
            if world > 1 {
                for k in 0..idx.len() {
                    if rng.below(3) == 0 {
                        out[1].1[k] = -out[0].1[k];
                    }
                }
            }
            out
        }
        Pattern::Disjoint(d) => {
            let mut idx: Vec<Vec<u32>> = vec![Vec::new(); world];
            for i in 0..n as u32 {
                if rng.unit() < d {
                    idx[rng.below(world)].push(i);
                }
            }
            idx.into_iter().map(|i| with_values(&mut rng, i)).collect()
        }
        Pattern::Shared { density, overlap } => {
            let k = (density * n as f64) as usize;
            let shared: Vec<u32> = (0..(overlap * k as f64) as usize)
                .map(|_| rng.below(n.max(1)) as u32)
                .collect();
            (0..world)
                .map(|_| {
                    let mut idx = shared.clone();
                    idx.extend((shared.len()..k).map(|_| rng.below(n.max(1)) as u32));
                    idx.sort_unstable();
                    idx.dedup();
                    with_values(&mut rng, idx)
                })
                .collect()
        }
    }
}

/// The dense sum of the inputs made dense, in rank order from `+0.0`: the documented
/// result of the sparse all-reduce, computed without any of its machinery.
pub fn sparse_reference(inputs: &[SparseInput], n: usize) -> Vec<f32> {
    let mut acc = vec![0.0f32; n];
    for (idx, vals) in inputs {
        let mut dense = vec![0.0f32; n];
        for (&i, &v) in idx.iter().zip(vals) {
            dense[i as usize] = v;
        }
        for (a, d) in acc.iter_mut().zip(&dense) {
            *a += *d;
        }
    }
    acc
}

/// Checks a sparse result against the reference: same dense bits, and exactly the indices
/// whose sum is not +0.0.
pub fn assert_sparse_matches(got: &dtrain_comms::SparseVec, want: &[f32], what: &str) {
    assert_eq!(got.dim(), want.len(), "{what}: dimension");
    assert_eq!(bits(&got.to_dense()), bits(want), "{what}: values");
    let nz: Vec<u32> = (0..want.len() as u32)
        .filter(|&i| want[i as usize].to_bits() != 0)
        .collect();
    assert_eq!(got.indices(), &nz[..], "{what}: index set");
}

/// The sparse test cases of a world size: empty, tiny, not divisible by P, overlapping,
/// disjoint, mixed and dense inputs.
pub fn sparse_cases(world: usize) -> Vec<(usize, Pattern)> {
    let mut cases = Vec::new();
    for n in [
        0,
        1,
        world.saturating_sub(1),
        world + 1,
        7 * world + 3,
        1000,
    ] {
        cases.push((n, Pattern::Independent(0.0)));
        cases.push((n, Pattern::Independent(0.3)));
        cases.push((n, Pattern::Mixed));
        cases.push((n, Pattern::Overlapping(0.4)));
        cases.push((n, Pattern::Disjoint(0.5)));
    }
    cases.push((1000, Pattern::Independent(0.02)));
    cases.push((1000, Pattern::Overlapping(1.0)));
    cases.push((1000, Pattern::Disjoint(1.0)));
    cases.push((
        1000,
        Pattern::Shared {
            density: 0.05,
            overlap: 0.5,
        },
    ));
    cases
}

/// Sparse all-reduce of every case in [`sparse_cases`] on one mesh, sparse and dense
/// results: equal to the reference bit for bit on every rank.
pub fn check_sparse_all_reduce<M: Mesh>(mesh: &M, world: usize) {
    let cases = sparse_cases(world);
    let cs = cases.clone();
    let out = run_ranks(mesh.make(world), test_config(), move |c| {
        let r = c.rank();
        cs.iter()
            .enumerate()
            .map(|(k, &(n, pattern))| {
                let inputs = sparse_inputs(k as u64 * 977 + world as u64, world, n, pattern);
                let (idx, vals) = &inputs[r];
                let input = dtrain_comms::SparseSlice::new(n, idx, vals).unwrap();
                let sparse = c.sparse_all_reduce(input).unwrap();
                let mut dense = vec![f32::NAN; n];
                c.sparse_all_reduce_dense(input, &mut dense).unwrap();
                (sparse, dense)
            })
            .collect::<Vec<_>>()
    });
    for (k, &(n, pattern)) in cases.iter().enumerate() {
        let inputs = sparse_inputs(k as u64 * 977 + world as u64, world, n, pattern);
        let want = sparse_reference(&inputs, n);
        for (r, results) in out.iter().enumerate() {
            let what = format!("world {world} n {n} {pattern:?}: rank {r}");
            assert_sparse_matches(&results[k].0, &want, &what);
            assert_eq!(bits(&results[k].1), bits(&want), "{what} (dense)");
        }
    }
}

/// A rank with another dimension, or another collective: every rank fails, none hangs.
pub fn check_sparse_mismatch<M: Mesh>(mesh: &M, world: usize) {
    assert!(world >= 2);
    let cfg = CommConfig {
        timeout: Duration::from_secs(5),
        ..test_config()
    };
    let start = Instant::now();
    let out = run_ranks(mesh.make(world), cfg.clone(), |c| {
        let n = if c.rank() == 0 { 100 } else { 101 };
        let input = dtrain_comms::SparseSlice::new(n, &[3, 50], &[1.0, 2.0]).unwrap();
        c.sparse_all_reduce(input).unwrap_err()
    });
    for (r, e) in out.iter().enumerate() {
        assert!(matches!(e, CommError::Mismatch { .. }), "rank {r}: {e}");
    }
    let out = run_ranks(mesh.make(world), cfg, move |c| {
        if c.rank() == world - 1 {
            let input = dtrain_comms::SparseSlice::new(500, &[3], &[1.0]).unwrap();
            c.sparse_all_reduce(input).map(|_| ()).unwrap_err()
        } else {
            c.all_reduce_sum(&mut [1.0f32; 500]).unwrap_err()
        }
    });
    for (r, e) in out.iter().enumerate() {
        assert!(matches!(e, CommError::Mismatch { .. }), "rank {r}: {e}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "took {:?}",
        start.elapsed()
    );
}

/// The f32 "codec" of the compressed all-reduce scenarios: shares and reduced blocks are
/// little-endian f32; the owner sums its segment's shares in rank order from `+0.0`.
pub fn sum_f32_shares(shares: &[&[u8]]) -> Result<Vec<u8>, (usize, String)> {
    let n = shares.first().map_or(0, |s| s.len());
    let mut acc = vec![0.0f32; n / 4];
    for (q, s) in shares.iter().enumerate() {
        if s.len() != n || !n.is_multiple_of(4) {
            return Err((q, format!("share of {} bytes, expected {n}", s.len())));
        }
        for (a, c) in acc.iter_mut().zip(s.chunks_exact(4)) {
            *a += f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
    Ok(acc.iter().flat_map(|v| v.to_le_bytes()).collect())
}

/// One rank's shares of `x` for the compressed all-reduce with the f32 codec: owner `q`'s
/// range of it, little-endian.
pub fn f32_shares(x: &[f32], world: usize) -> Vec<Vec<u8>> {
    (0..world)
        .map(|q| {
            x[segment_range(x.len(), world, q)]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect()
        })
        .collect()
}

/// Little-endian f32 bytes as values.
pub fn le_f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The most a rank may send in a compressed all-reduce of `n` f32 values on `world` ranks
/// with the f32 codec: its P − 1 shares and P − 1 copies of its reduced block (segments of
/// at most ⌈n/P⌉ values: 2·(P−1)/P of the buffer's 4n bytes), each block cut into chunks
/// of `chunk_bytes`, each message with its header and at most 16 bytes of framing.
pub fn compressed_sent_bound(n: usize, world: usize) -> u64 {
    let (p, seg) = (world as u64 - 1, 4 * (n as u64).div_ceil(world as u64));
    let msgs = 2 * p * seg.div_ceil(test_config().chunk_bytes as u64).max(1);
    2 * p * seg + msgs * (dtrain_comms::wire::HEADER_LEN as u64 + 16)
}

/// The compressed all-reduce with a lossless f32 codec: every rank ends with the rank-order
/// sum, bit for bit, and sends about twice its buffer's bytes, not P − 1 times.
pub fn check_compressed_all_reduce<M: Mesh>(mesh: &M, world: usize) {
    let lens = [0usize, 1, 5, 1000, 70_000];
    let out = run_ranks(mesh.make(world), test_config(), move |c| {
        let r = c.rank();
        lens.iter()
            .map(|&n| {
                let x = Rng(n as u64 * 31 + r as u64).f32s(n);
                let shares = f32_shares(&x, world);
                let mut red = sum_f32_shares;
                let views: Vec<&[u8]> = shares.iter().map(|b| &b[..]).collect();
                let blocks = c.compressed_all_reduce(&views, n as u32, &mut red).unwrap();
                (le_f32s(&blocks.concat()), c.last_bytes().sent)
            })
            .collect::<Vec<_>>()
    });
    for (k, &n) in lens.iter().enumerate() {
        let inputs: Vec<Vec<f32>> = (0..world)
            .map(|r| Rng(n as u64 * 31 + r as u64).f32s(n))
            .collect();
        let want = rank_order_sum(&inputs);
        for (r, results) in out.iter().enumerate() {
            let (sum, sent) = &results[k];
            assert_eq!(bits(sum), bits(&want), "world {world} n {n}: rank {r}");
            let bound = compressed_sent_bound(n, world);
            assert!(
                *sent <= bound,
                "world {world} n {n}: rank {r} sent {sent}, bound {bound}"
            );
            if n >= 1000 && world > 2 {
                // Far below the all-gather of the whole buffer's P − 1 copies.
                assert!(
                    *sent < (world as u64 - 1) * 4 * n as u64,
                    "world {world} n {n}: rank {r} sent {sent}"
                );
            }
        }
    }
}

/// A rank gone before a compressed all-reduce: every survivor names it, quickly.
pub fn check_compressed_dead_peer<M: Mesh>(mesh: &M, world: usize) {
    dead_peer_during(mesh, world, move |c| {
        let zeros = [0u8; 400];
        let shares = vec![&zeros[..]; world];
        let mut red = sum_f32_shares;
        c.compressed_all_reduce(&shares, 100, &mut red).unwrap_err()
    });
}

/// Binds `world` sockets on 127.0.0.1 (ephemeral ports) with `bind`; returns them with
/// their addresses.
#[cfg(feature = "tcp")]
pub fn bind_each<S>(
    world: usize,
    bind: impl Fn(&str) -> std::io::Result<S>,
    addr: impl Fn(&S) -> std::io::Result<std::net::SocketAddr>,
) -> (Vec<S>, Vec<std::net::SocketAddr>) {
    let ss: Vec<S> = (0..world).map(|_| bind("127.0.0.1:0").unwrap()).collect();
    let addrs = ss.iter().map(|s| addr(s).unwrap()).collect();
    (ss, addrs)
}

/// Sets up rank `r` with `connect(r, addrs, socks[r], cfgs[r])`, every rank on its own
/// thread; returns each rank's result in rank order.
#[cfg(feature = "tcp")]
pub fn connect_each<S, C, T>(
    socks: Vec<S>,
    addrs: Vec<std::net::SocketAddr>,
    cfgs: Vec<C>,
    connect: fn(usize, &[std::net::SocketAddr], S, C) -> Result<T, dtrain_comms::TransportError>,
) -> Vec<Result<T, dtrain_comms::TransportError>>
where
    S: Send + 'static,
    C: Send + 'static,
    T: Send + 'static,
{
    let hs: Vec<_> = socks
        .into_iter()
        .zip(cfgs)
        .enumerate()
        .map(|(r, (s, cfg))| {
            let addrs = addrs.clone();
            thread::spawn(move || connect(r, &addrs, s, cfg))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// TCP meshes over 127.0.0.1 (ephemeral ports), set up concurrently from one thread per rank.
#[cfg(feature = "tcp")]
pub mod tcp {
    use std::net::{SocketAddr, TcpListener};
    use std::time::Duration;

    use dtrain_comms::{TcpConfig, TcpTransport, TransportError};

    pub const TOKEN: &[u8] = b"test-run-token";

    pub fn config(token: &[u8]) -> TcpConfig {
        TcpConfig {
            connect_timeout: Duration::from_secs(10),
            ..TcpConfig::new(token.to_vec())
        }
    }

    /// Binds `world` listeners and returns them with their addresses.
    pub fn listeners(world: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
        super::bind_each(world, |a| TcpListener::bind(a), TcpListener::local_addr)
    }

    /// Connects every rank with its own config; returns each rank's result.
    pub fn try_mesh(cfgs: Vec<TcpConfig>) -> Vec<Result<TcpTransport, TransportError>> {
        let (ls, addrs) = listeners(cfgs.len());
        super::connect_each(ls, addrs, cfgs, TcpTransport::connect)
    }

    pub fn mesh(world: usize) -> Vec<TcpTransport> {
        try_mesh(vec![config(TOKEN); world])
            .into_iter()
            .map(|t| t.expect("mesh set-up"))
            .collect()
    }
}

/// Runs `check` for each world size concurrently (for the slow, timing-based checks).
pub fn for_worlds_concurrently<M: Mesh>(mesh: M, worlds: &[usize], check: fn(&M, usize)) {
    let mesh = Arc::new(mesh);
    let hs: Vec<_> = worlds
        .iter()
        .map(|&w| {
            let mesh = mesh.clone();
            thread::spawn(move || check(&mesh, w))
        })
        .collect();
    for h in hs {
        h.join().expect("world check panicked");
    }
}

/// A root that runs ahead: rank 0 starts late, so the messages of the second broadcast
/// arrive during the first and must be kept for later — and counted for the call they
/// belong to.
pub fn check_run_ahead<M: Mesh>(mesh: &M, world: usize) {
    assert!(world >= 2);
    let out = run_ranks(mesh.make(world), test_config(), move |c| {
        let root = world - 1;
        if c.rank() == 0 {
            thread::sleep(Duration::from_millis(100));
        }
        let mut got = Vec::new();
        for i in 0..3u8 {
            let mut v = if c.rank() == root {
                vec![i; 10 + i as usize]
            } else {
                Vec::new()
            };
            c.broadcast(&mut v, root).unwrap();
            got.push((v, c.last_bytes()));
        }
        got
    });
    for (r, got) in out.iter().enumerate() {
        for (i, (v, bytes)) in got.iter().enumerate() {
            assert_eq!(v, &vec![i as u8; 10 + i], "rank {r} broadcast {i}");
            // Chain: every rank but the root receives exactly one message per broadcast.
            if r != world - 1 {
                let header = dtrain_comms::wire::HEADER_LEN as u64;
                let framing = bytes.received - (header + 10 + i as u64);
                assert!(
                    framing == 0 || framing == 5,
                    "rank {r} call {i}: received {}",
                    bytes.received
                );
            }
        }
    }
}

/// Link emulation: a 2-rank all-reduce of 4 MB over links shaped to 200 Mbit/s and 1 ms
/// takes at least the α–β prediction (the shaping is a hard floor) and not wildly more
/// (generous ceiling for loaded hosts); a small all-reduce over a 30 ms link takes ≥ 30 ms
/// on the slower rank.
pub fn check_emulated_link<D: Driver>(d: &D) {
    use dtrain_comms::shaping::LinkSpec;
    let make = |world: usize, link: LinkSpec| {
        let mut cfg = d.config();
        D::set_link(&mut cfg, link);
        d.mesh_with(world, cfg)
    };
    let spec = LinkSpec::parse(Some("200Mbit"), Some("1ms")).unwrap();
    let n = 1usize << 20; // 4 MiB of f32
    let bytes = (n * 4) as f64;
    let want = spec.predict_all_reduce(bytes, 2);
    let out = run_ranks(make(2, spec), CommConfig::default(), move |c| {
        let mut v = vec![c.rank() as f32 + 1.0; n];
        c.barrier().unwrap();
        let t = Instant::now();
        c.all_reduce_sum(&mut v).unwrap();
        let el = t.elapsed().as_secs_f64();
        assert!(v.iter().all(|&x| x == 3.0));
        el
    });
    let took = out.iter().cloned().fold(0.0, f64::max);
    assert!(
        took >= 0.95 * want,
        "took {took:.3} s, below the α–β floor {want:.3} s: link not shaped"
    );
    assert!(
        took <= 3.0 * want + 0.5,
        "took {took:.3} s, far above the prediction {want:.3} s"
    );
    // Latency alone: one exchange (recursive doubling) waits one one-way latency.
    let spec = LinkSpec::parse(None, Some("30ms")).unwrap();
    let out = run_ranks(make(2, spec), CommConfig::default(), |c| {
        c.barrier().unwrap();
        let t = Instant::now();
        let mut v = vec![1.0f32; 4];
        c.all_reduce_sum(&mut v).unwrap();
        (t.elapsed(), v)
    });
    // Per rank the time depends on the barrier exit skew; the slower rank waits ≥ 30 ms.
    let el = out.iter().map(|x| x.0).max().unwrap();
    assert!(el >= Duration::from_millis(29), "{el:?}");
    assert!(el < Duration::from_secs(2), "{el:?}");
    for (_, v) in out {
        assert_eq!(v, vec![2.0; 4]);
    }
}

/// QUIC meshes over 127.0.0.1 (ephemeral UDP ports), one run identity per mesh.
#[cfg(feature = "quic")]
pub mod quic {
    use std::net::{SocketAddr, UdpSocket};
    use std::time::Duration;

    use dtrain_comms::rendezvous::RunIdentity;
    use dtrain_comms::{QuicConfig, QuicTransport, TransportError};

    pub const TOKEN: &[u8] = b"test-run-token";

    pub fn config(token: &[u8], identity: RunIdentity) -> QuicConfig {
        QuicConfig {
            connect_timeout: Duration::from_secs(10),
            ..QuicConfig::new(token.to_vec(), identity)
        }
    }

    /// Binds `world` UDP sockets and returns them with their addresses.
    pub fn sockets(world: usize) -> (Vec<UdpSocket>, Vec<SocketAddr>) {
        super::bind_each(world, |a| UdpSocket::bind(a), UdpSocket::local_addr)
    }

    /// Connects every rank with its own config; returns each rank's result.
    pub fn try_mesh(cfgs: Vec<QuicConfig>) -> Vec<Result<QuicTransport, TransportError>> {
        let (ss, addrs) = sockets(cfgs.len());
        super::connect_each(ss, addrs, cfgs, QuicTransport::connect)
    }

    pub fn mesh(world: usize) -> Vec<QuicTransport> {
        let id = RunIdentity::generate().unwrap();
        try_mesh(vec![config(TOKEN, id); world])
            .into_iter()
            .map(|t| t.expect("mesh set-up"))
            .collect()
    }
}

/// Shared-memory meshes (ranks as threads), one fresh run id per mesh; every builder
/// checks that set-up left no segment file behind.
#[cfg(all(feature = "shm", target_os = "linux"))]
pub mod shm {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::thread;
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use dtrain_comms::transport::shm::leftover_segments;
    use dtrain_comms::{ShmConfig, ShmTransport, TransportError};

    pub const TOKEN: &[u8] = b"test-run-token";

    /// A run id no other mesh of any test process uses.
    pub fn run_id() -> String {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        format!(
            "test-{}-{}-{nanos}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// Small rings (64 KiB), so that large messages stream and rings fill up.
    pub fn config(token: &[u8]) -> ShmConfig {
        ShmConfig {
            connect_timeout: Duration::from_secs(10),
            ring_bytes: 64 << 10,
            ..ShmConfig::new(token.to_vec(), run_id())
        }
    }

    /// Connects every rank with its own config (one thread each).
    pub fn try_mesh(cfgs: Vec<ShmConfig>) -> Vec<Result<ShmTransport, TransportError>> {
        let world = cfgs.len();
        let hs: Vec<_> = cfgs
            .into_iter()
            .enumerate()
            .map(|(r, cfg)| thread::spawn(move || ShmTransport::connect(r, world, cfg)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// A mesh of `world` ranks with `cfg`; asserts that no segment file is left.
    pub fn mesh_with(world: usize, cfg: ShmConfig) -> Vec<ShmTransport> {
        let m = dtrain_comms::shm_mesh(world, cfg.clone()).expect("mesh set-up");
        assert_eq!(
            leftover_segments(&cfg, world),
            Vec::<std::path::PathBuf>::new()
        );
        m
    }

    pub fn mesh(world: usize) -> Vec<ShmTransport> {
        mesh_with(world, config(TOKEN))
    }
}

/// Hybrid meshes (shared memory within a "host", TCP across): every `per_host` consecutive
/// ranks declare the same host key, over 127.0.0.1, set up concurrently.
#[cfg(all(feature = "tcp", feature = "shm", target_os = "linux"))]
pub mod hybrid {
    use std::net::{SocketAddr, TcpListener};

    use dtrain_comms::transport::hybrid::HybridTransport;
    use dtrain_comms::{ShmConfig, TcpConfig, TransportError};

    /// One rank's TCP and shared-memory configs and host key.
    pub type Config = (TcpConfig, ShmConfig, String);

    /// Configs for `world` ranks, `per_host` to a host (the last host may have fewer).
    pub fn configs(world: usize, per_host: usize) -> Vec<Config> {
        let shm = super::shm::config(super::tcp::TOKEN);
        (0..world)
            .map(|r| {
                (
                    super::tcp::config(super::tcp::TOKEN),
                    shm.clone(),
                    format!("host {}", r / per_host),
                )
            })
            .collect()
    }

    fn connect(
        rank: usize,
        peers: &[SocketAddr],
        l: TcpListener,
        (tcp, shm, key): Config,
    ) -> Result<HybridTransport, TransportError> {
        HybridTransport::connect(rank, peers, l, tcp, shm, &key)
    }

    /// Connects every rank with its own config; returns each rank's result.
    pub fn try_mesh(cfgs: Vec<Config>) -> Vec<Result<HybridTransport, TransportError>> {
        let (ls, addrs) = super::tcp::listeners(cfgs.len());
        super::connect_each(ls, addrs, cfgs, connect)
    }

    /// A working mesh of `world` ranks, `per_host` to a host.
    pub fn mesh(world: usize, per_host: usize) -> Vec<HybridTransport> {
        try_mesh(configs(world, per_host))
            .into_iter()
            .map(|t| t.expect("mesh set-up"))
            .collect()
    }
}
