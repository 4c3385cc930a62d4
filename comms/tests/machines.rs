//! Property tests of the IO-free state machines over a simulated network: random world
//! sizes, lengths (0 and < N included), chunk sizes and delivery order per link.

mod common;

use common::*;
use dtrain_comms::algo::allgather::AllGather;
use dtrain_comms::algo::barrier::Barrier;
use dtrain_comms::algo::broadcast::Broadcast;
use dtrain_comms::algo::compressed_allreduce::{CompressedAllReduce, Limits};
use dtrain_comms::algo::hierarchical::Hierarchical;
use dtrain_comms::algo::recursive_doubling::RecursiveDoubling;
use dtrain_comms::algo::ring::Ring;
use dtrain_comms::algo::sparse_allreduce::SparseAllReduce;
use dtrain_comms::algo::{AlgoError, Machine};
use dtrain_comms::topology::Topology;
use dtrain_comms::wire::{Algo, Header, Kind, Message};
use dtrain_comms::SparseSlice;
use dtrain_comms::{segment_range, ReduceOp};
use proptest::prelude::*;

fn ring_all_reduce(
    inputs: &[Vec<f32>],
    op: ReduceOp,
    chunk: usize,
    seed: u64,
    reorder: bool,
) -> Vec<Vec<f32>> {
    let p = inputs.len();
    let mut bufs = inputs.to_vec();
    let mut ms: Vec<Ring> = bufs
        .iter_mut()
        .enumerate()
        .map(|(r, b)| Ring::all_reduce(r, p, 0, op, b, chunk))
        .collect();
    let mut dyns: Vec<&mut dyn Machine> = ms.iter_mut().map(|m| m as &mut dyn Machine).collect();
    simulate(&mut dyns, &mut Rng(seed), reorder).unwrap();
    drop(ms);
    bufs
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn ring_all_reduce_is_exact_and_bit_identical(
        p in 1usize..=8,
        n in prop_oneof![0usize..8, 0usize..300],
        chunk in 1usize..40,
        seed: u64,
        reorder: bool,
    ) {
        let inputs: Vec<Vec<f32>> = (0..p).map(|r| Rng(seed ^ ((r as u64 + 1) * 0x1234_5678)).f32s(n)).collect();
        let want = ring_reference(&inputs, ReduceOp::Sum);
        for (r, got) in ring_all_reduce(&inputs, ReduceOp::Sum, chunk, seed, reorder).iter().enumerate() {
            prop_assert_eq!(bits(got), bits(&want), "rank {}", r);
        }
        let want = ring_reference(&inputs, ReduceOp::Max);
        for got in ring_all_reduce(&inputs, ReduceOp::Max, chunk, seed, reorder) {
            prop_assert_eq!(bits(&got), bits(&want));
        }
    }

    #[test]
    fn ring_reduce_scatter_leaves_each_rank_its_segment(
        p in 1usize..=8, n in 0usize..200, chunk in 1usize..40, seed: u64,
    ) {
        let inputs: Vec<Vec<f32>> = (0..p).map(|r| Rng(seed.wrapping_add(r as u64)).f32s(n)).collect();
        let want = ring_reference(&inputs, ReduceOp::Sum);
        let mut bufs = inputs.clone();
        let mut ms: Vec<Ring> = bufs.iter_mut().enumerate()
            .map(|(r, b)| Ring::reduce_scatter(r, p, 3, b, chunk)).collect();
        let mut dyns: Vec<&mut dyn Machine> = ms.iter_mut().map(|m| m as &mut dyn Machine).collect();
        simulate(&mut dyns, &mut Rng(seed), true).unwrap();
        drop(ms);
        for (r, b) in bufs.iter().enumerate() {
            let s = segment_range(n, p, r);
            prop_assert_eq!(bits(&b[s.clone()]), bits(&want[s]));
        }
    }

    #[test]
    fn recursive_doubling_is_exact_and_bit_identical(p in 1usize..=8, n in 0usize..40, seed: u64) {
        let inputs: Vec<Vec<f32>> = (0..p).map(|r| Rng(seed.wrapping_mul(r as u64 + 3)).f32s(n)).collect();
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let want = tree_reference(&inputs, op);
            let mut bufs = inputs.clone();
            let mut ms: Vec<RecursiveDoubling> = bufs.iter_mut().enumerate()
                .map(|(r, b)| RecursiveDoubling::new(r, p, 0, op, b)).collect();
            let mut dyns: Vec<&mut dyn Machine> = ms.iter_mut().map(|m| m as &mut dyn Machine).collect();
            simulate(&mut dyns, &mut Rng(seed), true).unwrap();
            drop(ms);
            for b in &bufs {
                prop_assert_eq!(bits(b), bits(&want));
            }
        }
    }

    #[test]
    fn all_gatherv_with_zero_sizes(p in 1usize..=8, sizes in proptest::collection::vec(prop_oneof![Just(0usize), 0usize..50], 8), chunk in 1usize..16, seed: u64) {
        let inputs: Vec<Vec<u8>> = (0..p).map(|r| Rng(seed + r as u64).bytes(sizes[r])).collect();
        let mut ms: Vec<AllGather> = (0..p).map(|r| AllGather::new(r, p, 0, &inputs[r], chunk, 1 << 20)).collect();
        let mut dyns: Vec<&mut dyn Machine> = ms.iter_mut().map(|m| m as &mut dyn Machine).collect();
        simulate(&mut dyns, &mut Rng(seed), true).unwrap();
        for m in ms {
            prop_assert_eq!(m.into_blocks(), inputs.clone());
        }
    }

    #[test]
    fn broadcast_from_any_root(p in 1usize..=8, root_pick: usize, n in 0usize..100, chunk in 1usize..16, seed: u64) {
        let root = root_pick % p;
        let payload = Rng(seed).bytes(n);
        let mut bufs: Vec<Vec<u8>> = (0..p).map(|r| if r == root { payload.clone() } else { vec![7; 5] }).collect();
        let mut ms: Vec<Broadcast> = bufs.iter_mut().enumerate()
            .map(|(r, b)| Broadcast::new(r, p, 0, root, b, chunk, 1 << 20)).collect();
        let mut dyns: Vec<&mut dyn Machine> = ms.iter_mut().map(|m| m as &mut dyn Machine).collect();
        simulate(&mut dyns, &mut Rng(seed), true).unwrap();
        drop(ms);
        for b in &bufs {
            prop_assert_eq!(b, &payload);
        }
    }

    #[test]
    fn barrier_completes_only_when_all_entered(p in 1usize..=8, late_pick: usize, seed: u64) {
        // All but one rank enter; none may finish. Then the last enters; all finish.
        let late = late_pick % p;
        let mut ms: Vec<Barrier> = (0..p).map(|r| Barrier::new(r, p, 0)).collect();
        let mut early: Vec<&mut dyn Machine> = ms.iter_mut().enumerate()
            .filter(|(r, _)| *r != late).map(|(_, m)| m as &mut dyn Machine).collect();
        // Deliver among early ranks only (messages to the late rank are held back).
        let mut held = Vec::new();
        let idx: Vec<usize> = (0..p).filter(|&r| r != late).collect();
        loop {
            let mut moved = false;
            for i in 0..early.len() {
                while let Some((to, msg)) = early[i].poll_transmit() {
                    if to == late {
                        held.push((idx[i], msg));
                    } else {
                        let j = idx.iter().position(|&r| r == to).unwrap();
                        early[j].handle(idx[i], msg).unwrap();
                        moved = true;
                    }
                }
            }
            if !moved { break; }
        }
        if p > 1 {
            for m in &early {
                prop_assert!(!m.is_done());
            }
        }
        drop(early);
        for (from, msg) in held {
            ms[late].handle(from, msg).unwrap();
        }
        let mut all: Vec<&mut dyn Machine> = ms.iter_mut().map(|m| m as &mut dyn Machine).collect();
        simulate(&mut all, &mut Rng(seed), true).unwrap();
    }

    #[test]
    fn hostile_messages_are_errors_not_panics(
        kind in 1u8..=10, algo in 0u8..=6, phase in 0u8..4, step in 0u32..10, count in 0u64..400,
        offset in prop_oneof![0u64..400, any::<u64>()], root in 0u32..10,
        payload in proptest::collection::vec(any::<u8>(), 0..64), from in 0usize..4,
    ) {
        let mut raw = Message::new(Header::new(Kind::Barrier, Algo::Ring, 0), &payload).into_bytes();
        raw[1] = kind;
        raw[2] = algo;
        raw[3] = phase;
        raw[4..8].copy_from_slice(&step.to_le_bytes());
        raw[16..24].copy_from_slice(&count.to_le_bytes());
        raw[24..32].copy_from_slice(&offset.to_le_bytes());
        raw[32..36].copy_from_slice(&root.to_le_bytes());
        let Ok(msg) = Message::decode(raw) else { return Ok(()) };
        let mut buf = vec![1.0f32; 100];
        let mut bytes = vec![1u8; 10];
        let _ = Ring::all_reduce(1, 4, 0, ReduceOp::Sum, &mut buf, 7).handle(from, msg.clone());
        let _ = Ring::reduce_scatter(1, 4, 0, &mut buf, 7).handle(from, msg.clone());
        let _ = RecursiveDoubling::new(1, 3, 0, ReduceOp::Sum, &mut buf[..4]).handle(from, msg.clone());
        let _ = AllGather::new(1, 4, 0, b"abc", 4, 100).handle(from, msg.clone());
        let _ = Broadcast::new(1, 4, 0, 0, &mut bytes, 4, 100).handle(from, msg.clone());
        let _ = Barrier::new(1, 4, 0).handle(from, msg.clone());
        let input = SparseSlice::new(count as usize, &[], &[]).unwrap();
        let _ = SparseAllReduce::new(1, 4, 0, input, 7).handle(from, msg.clone());
        let input = SparseSlice::new(100, &[2, 30, 99], &[1.0, 2.0, 3.0]).unwrap();
        let _ = SparseAllReduce::new(1, 4, 0, input, 7).handle(from, msg.clone());
        // Hosts {0, 1} and {2, 3}: a leader (ranks 0 and 2) and a last member (rank 1), with
        // the leaders' ring and their recursive doubling.
        let pairs = Topology::from_nodes(4, 2).unwrap();
        for (rank, small) in [(0, false), (1, false), (2, true)] {
            let _ = Hierarchical::new(rank, &pairs, 0, &mut buf, 7, small).handle(from, msg.clone());
        }
    }

    /// Sparse shares and reduced chunks with valid headers and arbitrary payloads: errors
    /// naming the sender, never panics.
    #[test]
    fn hostile_sparse_payloads_are_errors_not_panics(
        phase in 0u8..3, offset in prop_oneof![0u64..100, any::<u64>()], root in 0u32..5,
        prefix in prop_oneof![Just(vec![1u8]), Just(vec![2u8]), Just(vec![1u8, 3, 0, 0, 0])],
        payload in proptest::collection::vec(any::<u8>(), 0..80), from in 0usize..5,
    ) {
        let h = Header { phase, count: 100, offset, root, ..Header::new(Kind::SparseAllReduce, Algo::Direct, 0) };
        let mut bytes = prefix;
        bytes.extend_from_slice(&payload);
        let input = SparseSlice::new(100, &[2, 30, 99], &[1.0, 2.0, 3.0]).unwrap();
        let mut m = SparseAllReduce::new(1, 4, 0, input, 7);
        if let Err(e) = m.handle(from, Message::new(h, &bytes)) {
            prop_assert_eq!(e.peer(), from);
        }
    }

    /// The sparse all-reduce machines over a simulated network with random delivery order
    /// per link and random chunk sizes: every rank ends with the reference sum, bit for bit.
    #[test]
    fn sparse_all_reduce_is_exact_under_any_delivery_order(
        p in 1usize..=8,
        n in prop_oneof![0usize..10, 0usize..400],
        density in prop_oneof![Just(0.0f64), 0.0f64..=1.0],
        overlap: bool,
        chunk in 1usize..50,
        seed: u64,
        reorder: bool,
    ) {
        let pattern = if overlap { Pattern::Overlapping(density) } else { Pattern::Independent(density) };
        let inputs = sparse_inputs(seed, p, n, pattern);
        let want = sparse_reference(&inputs, n);
        let mut ms: Vec<SparseAllReduce> = inputs.iter().enumerate()
            .map(|(r, (idx, vals))| SparseAllReduce::new(r, p, 2, SparseSlice::new(n, idx, vals).unwrap(), chunk))
            .collect();
        let mut dyns: Vec<&mut dyn Machine> = ms.iter_mut().map(|m| m as &mut dyn Machine).collect();
        simulate(&mut dyns, &mut Rng(seed), reorder).unwrap();
        for (r, m) in ms.into_iter().enumerate() {
            let mut dense = vec![f32::NAN; n];
            m.write_dense(&mut dense);
            prop_assert_eq!(bits(&dense), bits(&want), "rank {}", r);
            assert_sparse_matches(&m.into_sparse(), &want, &format!("rank {r}"));
        }
    }
}

/// The orders differ, so the bit-for-bit checks above can fail: ring order, tree order and
/// plain rank order give different bits for these inputs, and the machine matches its own.
#[test]
fn summation_orders_are_distinguishable() {
    let inputs: Vec<Vec<f32>> = (0..5).map(|r| Rng(40 + r).f32s(64)).collect();
    let ring = ring_reference(&inputs, ReduceOp::Sum);
    let tree = tree_reference(&inputs, ReduceOp::Sum);
    let plain = rank_order_sum(&inputs);
    assert_ne!(bits(&ring), bits(&plain));
    assert_ne!(bits(&tree), bits(&plain));
    assert_ne!(bits(&ring), bits(&tree));
    let got = ring_all_reduce(&inputs, ReduceOp::Sum, 3, 1, true);
    assert_eq!(bits(&got[0]), bits(&ring));
}

/// Rank order from +0.0 is what the sparse all-reduce computes, and the test data tells it
/// from the reverse order and from the ring's order.
#[test]
fn sparse_summation_order_is_rank_order() {
    let (p, n) = (5, 200);
    let inputs = sparse_inputs(11, p, n, Pattern::Overlapping(1.0));
    let want = sparse_reference(&inputs, n);
    let mut reversed = inputs.clone();
    reversed.reverse();
    assert_ne!(bits(&sparse_reference(&reversed, n)), bits(&want));
    let dense: Vec<Vec<f32>> = inputs
        .iter()
        .map(|(i, v)| SparseSlice::new(n, i, v).unwrap().to_dense())
        .collect();
    assert_ne!(bits(&ring_reference(&dense, ReduceOp::Sum)), bits(&want));
    let mut ms: Vec<SparseAllReduce> = inputs
        .iter()
        .enumerate()
        .map(|(r, (i, v))| SparseAllReduce::new(r, p, 0, SparseSlice::new(n, i, v).unwrap(), 9))
        .collect();
    let mut dyns: Vec<&mut dyn Machine> = ms.iter_mut().map(|m| m as &mut dyn Machine).collect();
    simulate(&mut dyns, &mut Rng(3), true).unwrap();
    for m in ms {
        assert_sparse_matches(&m.into_sparse(), &want, "rank order");
    }
}

#[test]
fn sparse_mismatch_and_misrouting_name_the_peer() {
    let a = SparseSlice::new(10, &[1], &[1.0]).unwrap();
    let b = SparseSlice::new(11, &[1], &[1.0]).unwrap();
    let mut m0 = SparseAllReduce::new(0, 3, 0, a, 4);
    let mut m1 = SparseAllReduce::new(1, 3, 0, b, 4);
    let (to, msg) = m0.poll_transmit().unwrap();
    assert_eq!(to, 1);
    assert!(matches!(
        m1.handle(0, msg.clone()),
        Err(AlgoError::Mismatch { peer: 0, .. })
    ));
    // A share for rank 1 delivered to rank 2, and the same share twice.
    let mut m2 = SparseAllReduce::new(2, 3, 0, a, 4);
    assert!(matches!(
        m2.handle(0, msg.clone()),
        Err(AlgoError::Protocol { peer: 0, .. })
    ));
    let mut m1 = SparseAllReduce::new(1, 3, 0, a, 4);
    m1.handle(0, msg.clone()).unwrap();
    assert!(matches!(
        m1.handle(0, msg.clone()),
        Err(AlgoError::Protocol { peer: 0, .. })
    ));
    // A reduced chunk of segment 0 sent by rank 2, or a share sent by this rank to itself.
    let h = Header {
        phase: 1,
        count: 10,
        root: 0,
        ..Header::new(Kind::SparseAllReduce, Algo::Direct, 0)
    };
    let empty_pairs = [1u8, 0, 0, 0, 0];
    SparseAllReduce::new(1, 3, 0, a, 4)
        .handle(0, Message::new(h, &empty_pairs))
        .unwrap();
    assert!(matches!(
        SparseAllReduce::new(1, 3, 0, a, 4).handle(2, Message::new(h, &empty_pairs)),
        Err(AlgoError::Protocol { peer: 2, .. })
    ));
    assert!(matches!(
        SparseAllReduce::new(1, 3, 0, a, 4).handle(1, msg.clone()),
        Err(AlgoError::Protocol { peer: 1, .. })
    ));
    // Another collective's message.
    let mut x = vec![0f32; 10];
    let (_, ring) = Ring::all_reduce(0, 3, 0, ReduceOp::Sum, &mut x, 4)
        .poll_transmit()
        .unwrap();
    assert!(matches!(
        SparseAllReduce::new(1, 3, 0, a, 4).handle(0, ring),
        Err(AlgoError::Mismatch { peer: 0, .. })
    ));
}

#[test]
fn mismatch_names_the_peer() {
    let mut a = vec![0f32; 10];
    let mut b = vec![0f32; 11];
    let mut m0 = Ring::all_reduce(0, 2, 0, ReduceOp::Sum, &mut a, 4);
    let mut m1 = Ring::all_reduce(1, 2, 0, ReduceOp::Sum, &mut b, 4);
    let (to, msg) = m0.poll_transmit().unwrap();
    assert_eq!(to, 1);
    assert!(matches!(
        m1.handle(0, msg),
        Err(AlgoError::Mismatch { peer: 0, .. })
    ));
    let mut g = AllGather::new(1, 2, 0, b"", 4, 10);
    let (_, msg) = m0.poll_transmit().unwrap();
    assert!(matches!(
        g.handle(0, msg),
        Err(AlgoError::Mismatch { peer: 0, .. })
    ));
    let mut x = Vec::new();
    let mut y = Vec::new();
    let mut b0 = Broadcast::new(0, 2, 0, 0, &mut x, 4, 10);
    let mut b1 = Broadcast::new(1, 2, 0, 1, &mut y, 4, 10);
    let (_, msg) = b0.poll_transmit().unwrap();
    assert!(matches!(
        b1.handle(0, msg),
        Err(AlgoError::Mismatch { peer: 0, .. })
    ));
}

#[test]
fn oversized_announcements_are_rejected_before_allocating() {
    let h = Header {
        count: u64::MAX,
        offset: u64::MAX - 2,
        root: 0,
        ..Header::new(Kind::AllGather, Algo::Ring, 0)
    };
    let mut g = AllGather::new(1, 2, 0, b"", 4, 1 << 20);
    assert!(matches!(
        g.handle(0, Message::new(h, b"abc")),
        Err(AlgoError::Protocol { peer: 0, .. })
    ));
    let h = Header {
        count: 10,
        offset: 9,
        ..h
    };
    assert!(matches!(
        g.handle(0, Message::new(h, b"abc")),
        Err(AlgoError::Protocol { peer: 0, .. })
    ));
}

/// An owner's reduction in these tests.
type Reduce = fn(&[&[u8]]) -> Result<Vec<u8>, (usize, String)>;

/// The test "codec" of the compressed all-reduce: the reduced block of a segment is every
/// share in rank order, each behind its length (so the result shows exactly what the owner
/// received, from whom, in which order).
fn concat_shares(shares: &[&[u8]]) -> Result<Vec<u8>, (usize, String)> {
    let mut out = Vec::new();
    for s in shares {
        out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        out.extend_from_slice(s);
    }
    Ok(out)
}

/// `shares[r][q]`: rank r's share for owner q, of random length (0 included).
fn random_shares(p: usize, max_len: usize, seed: u64) -> Vec<Vec<Vec<u8>>> {
    let mut rng = Rng(seed);
    (0..p)
        .map(|_| {
            (0..p)
                .map(|_| {
                    let n = rng.below(max_len + 1);
                    rng.bytes(n)
                })
                .collect()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Over a simulated network with random delivery order and chunk sizes, every owner
    /// reduces exactly the P shares of its segment in rank order, and every rank ends with
    /// every owner's reduced block, byte for byte.
    #[test]
    fn compressed_all_reduce_delivers_every_share_and_every_reduced_block(
        p in 1usize..=8,
        max_len in prop_oneof![0usize..4, 0usize..300],
        chunk in 1usize..64,
        seed: u64,
        reorder: bool,
    ) {
        let shares = random_shares(p, max_len, seed);
        let want: Vec<Vec<u8>> = (0..p)
            .map(|q| {
                let col: Vec<&[u8]> = (0..p).map(|r| &shares[r][q][..]).collect();
                concat_shares(&col).unwrap()
            })
            .collect();
        let views: Vec<Vec<&[u8]>> = shares.iter().map(|s| s.iter().map(|b| &b[..]).collect()).collect();
        let mut reducers: Vec<Reduce> = vec![concat_shares; p];
        let mut ms: Vec<CompressedAllReduce> = views.iter().zip(reducers.iter_mut()).enumerate()
            .map(|(r, (s, red))| CompressedAllReduce::new(r, p, 3, 77, s, red, Limits { chunk_bytes: chunk, max_block_bytes: 1 << 20 }).unwrap())
            .collect();
        let mut dyns: Vec<&mut dyn Machine> = ms.iter_mut().map(|m| m as &mut dyn Machine).collect();
        simulate(&mut dyns, &mut Rng(seed), reorder).unwrap();
        for (r, m) in ms.into_iter().enumerate() {
            prop_assert_eq!(&m.into_reduced(), &want, "rank {}", r);
        }
    }

    /// Compressed all-reduce messages with valid headers and arbitrary fields: errors
    /// naming the sender, never panics.
    #[test]
    fn hostile_compressed_all_reduce_messages_are_errors_not_panics(
        phase in 0u8..3, offset in prop_oneof![0u64..100, any::<u64>()], root in 0u32..5,
        count in prop_oneof![0u64..100, any::<u64>()], key in prop_oneof![Just(9u32), any::<u32>()],
        payload in proptest::collection::vec(any::<u8>(), 0..80), from in 0usize..5,
    ) {
        let h = Header { phase, step: key, count, offset, root, ..Header::new(Kind::CompressedAllReduce, Algo::Direct, 0) };
        let own = [1u8; 10];
        let shares = vec![&own[..]; 4];
        let mut red = concat_shares;
        let mut m = CompressedAllReduce::new(1, 4, 0, 9, &shares, &mut red, Limits { chunk_bytes: 7, max_block_bytes: 1000 }).unwrap();
        if let Err(e) = m.handle(from, Message::new(h, &payload)) {
            prop_assert_eq!(e.peer(), from);
        }
    }
}

/// A reducer's refusal names the rank whose share it could not use; a block over the limit
/// is refused before anything is allocated; a different layout key is a mismatch.
#[test]
fn compressed_all_reduce_refusals_name_the_peer() {
    let own = [5u8; 3];
    let shares = vec![&own[..]; 3];
    // Rank 0 owns segment 0; rank 2's share of it is refused by the reducer.
    let mut refuse = |s: &[&[u8]]| -> Result<Vec<u8>, (usize, String)> {
        Err((2, format!("share of {} bytes is not a payload", s[2].len())))
    };
    let mut m = CompressedAllReduce::new(
        0,
        3,
        0,
        1,
        &shares,
        &mut refuse,
        Limits {
            chunk_bytes: 64,
            max_block_bytes: 1000,
        },
    )
    .unwrap();
    let share = |count: u64, key: u32| {
        let h = Header {
            phase: 0,
            step: key,
            count,
            root: 0,
            ..Header::new(Kind::CompressedAllReduce, Algo::Direct, 0)
        };
        Message::new(h, &vec![1u8; count as usize])
    };
    m.handle(1, share(3, 1)).unwrap();
    let e = m.handle(2, share(3, 1)).unwrap_err();
    assert_eq!(e.peer(), 2, "{e}");
    assert!(e.to_string().contains("not a payload"), "{e}");

    let mut ok = concat_shares;
    let mut m = CompressedAllReduce::new(
        0,
        3,
        0,
        1,
        &shares,
        &mut ok,
        Limits {
            chunk_bytes: 64,
            max_block_bytes: 8,
        },
    )
    .unwrap();
    let e = m.handle(1, share(9, 1)).unwrap_err();
    assert!(e.to_string().contains("over the limit"), "{e}");
    let e = m.handle(2, share(3, 2)).unwrap_err();
    assert!(matches!(e, AlgoError::Mismatch { peer: 2, .. }), "{e}");
    // A one-rank world reduces at once; its refusal comes from the constructor.
    let one: Vec<&[u8]> = vec![&[1u8]];
    let mut refuse_own =
        |_: &[&[u8]]| -> Result<Vec<u8>, (usize, String)> { Err((0, "own".into())) };
    assert!(CompressedAllReduce::new(
        0,
        1,
        0,
        1,
        &one,
        &mut refuse_own,
        Limits {
            chunk_bytes: 64,
            max_block_bytes: 8
        }
    )
    .is_err());
}

/// Hierarchical all-reduces of `inputs` over `topology` on a simulated network; returns the
/// ranks' buffers and the bytes sent per link (index `from · P + to`).
fn hierarchical(
    inputs: &[Vec<f32>],
    topology: &Topology,
    chunk: usize,
    small: bool,
    seed: u64,
    reorder: bool,
) -> (Vec<Vec<f32>>, Vec<u64>) {
    let mut bufs = inputs.to_vec();
    let mut ms: Vec<Hierarchical> = bufs
        .iter_mut()
        .enumerate()
        .map(|(r, b)| Hierarchical::new(r, topology, 0, b, chunk, small))
        .collect();
    let mut dyns: Vec<&mut dyn Machine> = ms.iter_mut().map(|m| m as &mut dyn Machine).collect();
    let sent = simulate_counted(&mut dyns, &mut Rng(seed), reorder).unwrap();
    drop(ms);
    (bufs, sent)
}

/// A random grouping of `p` ranks into at most `hosts` hosts.
fn random_topology(p: usize, hosts: usize, seed: u64) -> Topology {
    let mut g = Rng(seed);
    let keys: Vec<String> = (0..p).map(|_| g.below(hosts).to_string()).collect();
    Topology::from_keys(&keys)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn hierarchical_all_reduce_is_exact_and_bit_identical(
        p in 1usize..=9,
        hosts in 1usize..=4,
        n in prop_oneof![0usize..8, 0usize..300],
        chunk in 1usize..40,
        small: bool,
        seed: u64,
        reorder: bool,
    ) {
        let topo = random_topology(p, hosts, seed);
        let inputs: Vec<Vec<f32>> = (0..p).map(|r| Rng(seed ^ ((r as u64 + 7) * 0x9e37)).f32s(n)).collect();
        let want = hierarchical_reference(&inputs, &topo, small);
        let (got, _) = hierarchical(&inputs, &topo, chunk, small, seed, reorder);
        for (r, g) in got.iter().enumerate() {
            prop_assert_eq!(bits(g), bits(&want), "rank {} of {}", r, topo.describe());
        }
    }

    /// Only the leaders' messages cross between hosts, and they are exactly those of a
    /// flat all-reduce among the leaders: per pair of leaders the same bytes as the flat
    /// machine sends between their positions.
    #[test]
    fn bytes_between_hosts_are_one_leaders_all_reduce(
        p in 2usize..=9,
        hosts in 2usize..=4,
        n in 0usize..500,
        chunk in 1usize..64,
        small: bool,
        seed: u64,
    ) {
        let topo = random_topology(p, hosts, seed);
        let inputs: Vec<Vec<f32>> = (0..p).map(|r| Rng(seed.wrapping_add(r as u64)).f32s(n)).collect();
        let (_, sent) = hierarchical(&inputs, &topo, chunk, small, seed, true);
        let leaders = topo.leaders();
        let m = leaders.len();
        let mut sums = vec![vec![0.0f32; n]; m];
        let mut flat: Vec<Box<dyn Machine + '_>> = sums
            .iter_mut()
            .enumerate()
            .map(|(l, b)| -> Box<dyn Machine + '_> {
                if small {
                    Box::new(RecursiveDoubling::new(l, m, 0, ReduceOp::Sum, b))
                } else {
                    Box::new(Ring::all_reduce(l, m, 0, ReduceOp::Sum, b, chunk))
                }
            })
            .collect();
        let mut dyns: Vec<&mut dyn Machine> = flat.iter_mut().map(|b| b.as_mut() as &mut dyn Machine).collect();
        let flat_sent = simulate_counted(&mut dyns, &mut Rng(seed), true).unwrap();
        for a in 0..p {
            for b in 0..p {
                if topo.host_of(a) == topo.host_of(b) {
                    continue;
                }
                let want = match (leaders.iter().position(|&l| l == a), leaders.iter().position(|&l| l == b)) {
                    (Some(la), Some(lb)) => flat_sent[la * m + lb],
                    _ => 0,
                };
                prop_assert_eq!(sent[a * p + b], want, "{} -> {} of {}", a, b, topo.describe());
            }
        }
    }
}

/// With one rank per host the hierarchy is the flat all-reduce, bit for bit; with hosts of
/// several ranks its order differs from the flat ring's (so the bit-for-bit checks above
/// can fail), and on exact sums the two agree.
#[test]
fn hierarchical_order_is_the_flat_one_exactly_where_it_must_be() {
    let inputs: Vec<Vec<f32>> = (0..6).map(|r| Rng(70 + r).f32s(64)).collect();
    let ring = ring_reference(&inputs, ReduceOp::Sum);
    let (alone, _) = hierarchical(&inputs, &Topology::one_per_host(6), 5, false, 3, true);
    assert_eq!(bits(&alone[0]), bits(&ring));
    let pairs = Topology::from_nodes(6, 3).unwrap();
    let (got, _) = hierarchical(&inputs, &pairs, 5, false, 3, true);
    assert_ne!(bits(&got[0]), bits(&ring));
    let ints: Vec<Vec<f32>> = (0..6)
        .map(|r| {
            (0..64)
                .map(|i| ((i * 7 + r * 13) % 41) as f32 - 20.0)
                .collect()
        })
        .collect();
    let (got, _) = hierarchical(&ints, &pairs, 5, false, 3, true);
    assert_eq!(bits(&got[5]), bits(&ring_reference(&ints, ReduceOp::Sum)));
}

/// A peer that groups the ranks differently, runs the flat all-reduce, sends a chunk out of
/// its place or twice: the machine names it, never panics.
#[test]
fn hierarchical_refusals_name_the_peer() {
    let pairs = Topology::from_nodes(4, 2).unwrap();
    let singles = Topology::one_per_host(4);
    let (mut a, mut b) = (vec![0f32; 10], vec![0f32; 10]);
    // Rank 1 (host 0's last member) sends its first reduce chunk to its leader, rank 0.
    let mut m1 = Hierarchical::new(1, &pairs, 0, &mut a, 4, false);
    let (to, chunk) = m1.poll_transmit().unwrap();
    assert_eq!(to, 0);
    let mut m0 = Hierarchical::new(0, &pairs, 0, &mut b, 4, false);
    m0.handle(1, chunk.clone()).unwrap();
    assert!(matches!(
        m0.handle(1, chunk.clone()),
        Err(AlgoError::Protocol { peer: 1, .. })
    ));
    // Rank 3 may not send host 0's leader a host-local chunk.
    let mut c = vec![0f32; 10];
    let mut m0 = Hierarchical::new(0, &pairs, 0, &mut c, 4, false);
    assert!(matches!(
        m0.handle(3, chunk.clone()),
        Err(AlgoError::Protocol { peer: 3, .. })
    ));
    // A rank grouping the ranks one per host.
    let mut d = vec![0f32; 10];
    let mut lone = Hierarchical::new(0, &singles, 0, &mut d, 4, false);
    assert!(matches!(
        lone.handle(1, chunk),
        Err(AlgoError::Mismatch { peer: 1, .. })
    ));
    // A flat ring's message reaching a host's non-leader.
    let mut e = vec![0f32; 10];
    let mut flat = Ring::all_reduce(0, 4, 0, ReduceOp::Sum, &mut e, 4);
    let (_, ring_msg) = flat.poll_transmit().unwrap();
    let mut f = vec![0f32; 10];
    let mut m1 = Hierarchical::new(1, &pairs, 0, &mut f, 4, false);
    assert!(matches!(
        m1.handle(0, ring_msg),
        Err(AlgoError::Mismatch { peer: 0, .. })
    ));
}
