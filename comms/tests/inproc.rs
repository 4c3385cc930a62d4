//! What only the in-process channel driver is used for: a rogue peer sending garbage,
//! sparse all-reduce properties over many random cases, and its bytes against an
//! all-gather. The channel driver's conformance suite is in `conformance.rs`.

mod common;

use common::*;
use dtrain_comms::channel_mesh;

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

mod sparse_props {
    use super::*;
    use dtrain_comms::{CommConfig, SparseSlice};
    use proptest::prelude::*;

    fn pattern() -> impl Strategy<Value = Pattern> {
        prop_oneof![
            Just(Pattern::Independent(0.0)),
            (0.0f64..1.0).prop_map(Pattern::Independent),
            Just(Pattern::Mixed),
            (0.0f64..=1.0).prop_map(Pattern::Overlapping),
            (0.0f64..=1.0).prop_map(Pattern::Disjoint),
            ((0.0f64..0.3), (0.0f64..=1.0))
                .prop_map(|(density, overlap)| Pattern::Shared { density, overlap }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        /// Random sparse inputs on 1..=8 ranks over channels: every rank gets the reference
        /// sum bit for bit, whatever the chunk size (so both encodings and many chunks per
        /// segment occur).
        #[test]
        fn sparse_all_reduce_is_exact_and_bit_identical(
            p in 1usize..=8,
            n in prop_oneof![0usize..10, 0usize..2000],
            pattern in pattern(),
            chunk_bytes in prop_oneof![1usize..64, Just(1usize << 20)],
            seed: u64,
        ) {
            let inputs = sparse_inputs(seed, p, n, pattern);
            let want = sparse_reference(&inputs, n);
            let cfg = CommConfig { chunk_bytes, ..test_config() };
            let ins = inputs.clone();
            let out = run_ranks(channel_mesh(p), cfg, move |c| {
                let (idx, vals) = &ins[c.rank()];
                let input = SparseSlice::new(n, idx, vals).unwrap();
                c.sparse_all_reduce(input).unwrap()
            });
            for (r, got) in out.iter().enumerate() {
                assert_sparse_matches(got, &want, &format!("p {p} n {n} {pattern:?} rank {r}"));
            }
        }
    }
}

/// Bytes received per worker (`last_bytes`, framing included) by the sparse all-reduce
/// against an all-gather of the same (index, value) payloads, P = 4, n = 1M, 1% density.
///
/// The sparse all-reduce receives each peer's entries in its own segment, then the sum
/// outside it: about `(P−1)/P · (k + |sum|) · 8` bytes against `(P−1) · k · 8` for the
/// all-gather (k entries per rank). It wins when the ranks' indices overlap (|sum| well
/// below P·k, as for Top-k of correlated gradients) or when the sum is dense enough for the
/// dense encoding; with independent uniform indices at 1% the sum has ≈ P·k entries, and
/// then no scheme that delivers the sum can receive less than the all-gather: this test
/// measures that case too and checks the model, not a win.
#[test]
fn sparse_all_reduce_receives_less_than_all_gather_of_the_pairs() {
    use dtrain_comms::{CommConfig, SparseSlice};
    let (p, n) = (4usize, 1usize << 20);
    let measure = |pattern: Pattern| {
        let inputs = sparse_inputs(5, p, n, pattern);
        let want = sparse_reference(&inputs, n);
        let union = want.iter().filter(|v| v.to_bits() != 0).count();
        let ins = inputs.clone();
        let out = run_ranks(channel_mesh(p), CommConfig::default(), move |c| {
            let (idx, vals) = &ins[c.rank()];
            let mut payload = Vec::with_capacity(idx.len() * 8);
            for (i, v) in idx.iter().zip(vals) {
                payload.extend_from_slice(&i.to_le_bytes());
                payload.extend_from_slice(&v.to_le_bytes());
            }
            c.all_gather(&payload).unwrap();
            let gather = c.last_bytes().received;
            let sum = c
                .sparse_all_reduce(SparseSlice::new(n, idx, vals).unwrap())
                .unwrap();
            (gather, c.last_bytes().received, sum)
        });
        let k = inputs.iter().map(|x| x.0.len()).sum::<usize>() / p;
        for (r, (gather, sparse, sum)) in out.iter().enumerate() {
            assert_sparse_matches(sum, &want, &format!("{pattern:?} rank {r}"));
            eprintln!(
                "{pattern:?}: k {k} |sum| {union}: rank {r} received {gather} B (all-gather) \
                 vs {sparse} B (sparse all-reduce)"
            );
        }
        (out, k, union)
    };
    // Bytes per entry on the wire: a 4-byte value and a LEB128 gap of 1–2 bytes at these
    // densities (the delta encoding), against 8 for the all-gather's (u32, f32) pairs.
    let model = |k: usize, union: usize, per_entry: f64| {
        ((p - 1) as f64 / p as f64) * (k + union) as f64 * per_entry
    };
    // Half of every rank's entries on shared indices: |sum| ≈ 2.5 k.
    let (out, k, union) = measure(Pattern::Shared {
        density: 0.01,
        overlap: 0.5,
    });
    for (r, (gather, sparse, _)) in out.iter().enumerate() {
        assert!(sparse < gather, "rank {r}: {sparse} >= {gather}");
        assert!(
            (*sparse as f64) < model(k, union, 6.0) * 1.1 + 1e4,
            "rank {r}"
        );
    }
    // Fully overlapping index sets: the sum is no larger than one input, so the sparse
    // all-reduce receives well under 2/P of the all-gather.
    let (out, _, _) = measure(Pattern::Overlapping(0.01));
    for (r, (gather, sparse, _)) in out.iter().enumerate() {
        assert!(10 * sparse < 5 * gather, "rank {r}: {sparse} vs {gather}");
    }
    // Independent indices: |sum| ≈ P·k, so with 8-byte entries the sparse all-reduce would
    // receive (P+1)/P times the all-gather; with 5–6-byte entries it receives less (the
    // acceptance point of issue 9: 1 % density, P = 4).
    let (out, k, union) = measure(Pattern::Independent(0.01));
    for (r, (gather, sparse, _)) in out.iter().enumerate() {
        let (lo, hi) = (model(k, union, 5.0), model(k, union, 6.0));
        assert!(
            (*sparse as f64) > 0.95 * lo && (*sparse as f64) < 1.05 * hi,
            "rank {r}: {sparse} outside the model's [{lo}, {hi}]"
        );
        assert!(sparse < gather, "rank {r}: {sparse} >= {gather}");
    }
    // Independent but dense enough that the sum goes dense (25% per rank, |sum| ≈ 68%):
    // the dense encoding caps the sum at 4 bytes per element.
    let (out, _, _) = measure(Pattern::Independent(0.25));
    for (r, (gather, sparse, _)) in out.iter().enumerate() {
        assert!(sparse < gather, "rank {r}: {sparse} >= {gather}");
    }
}

/// The averaging all-reduce is bit for bit the sum followed by the product with `1/P`, on
/// every rank, by the ring (many chunks) and by recursive doubling (small sizes), for
/// 1..=5 ranks; and it reports a NaN or an infinity on every rank, whether one rank's input
/// held it (first, middle or last chunk) or the sum overflowed from finite inputs.
#[test]
fn all_reduce_mean_is_the_sum_times_one_over_p_and_reports_non_finite() {
    use dtrain_comms::CommConfig;
    for p in 1usize..=5 {
        for n in [0usize, 1, 7, 16, 1000, 4099] {
            let inputs: Vec<Vec<f32>> = (0..p)
                .map(|r| {
                    (0..n)
                        .map(|i| ((i * 7919 + r * 104_729) % 2003) as f32 / 317.0 - 3.1)
                        .collect()
                })
                .collect();
            let cfg = CommConfig {
                chunk_bytes: 96,
                ..test_config()
            };
            let ins = inputs.clone();
            let out = run_ranks(channel_mesh(p), cfg.clone(), move |c| {
                let mut sum = ins[c.rank()].clone();
                c.all_reduce_sum(&mut sum).unwrap();
                let k = 1.0 / c.world_size() as f32;
                sum.iter_mut().for_each(|v| *v *= k);
                let mut mean = ins[c.rank()].clone();
                let bad = c.all_reduce_mean(&mut mean).unwrap();
                (sum, mean, bad)
            });
            for (r, (want, got, bad)) in out.iter().enumerate() {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(got), bits(want), "p {p} n {n} rank {r}");
                assert!(
                    !bad,
                    "p {p} n {n} rank {r}: finite inputs reported non-finite"
                );
            }
            if n == 0 {
                continue;
            }
            // One rank's bad value, or an overflowing sum of finite inputs.
            let mut cases: Vec<(String, Vec<Vec<f32>>)> = Vec::new();
            for at in [0, n / 2, n - 1] {
                for (who, v) in [(p - 1, f32::NAN), (0, f32::NEG_INFINITY)] {
                    let mut ins = inputs.clone();
                    ins[who][at] = v;
                    cases.push((format!("{v} at {at} on rank {who}"), ins));
                }
            }
            if p > 1 {
                let mut ins = inputs.clone();
                ins.iter_mut().for_each(|x| x[n - 1] = f32::MAX);
                cases.push(("an overflowing sum".into(), ins));
            }
            for (what, ins) in cases {
                let out = run_ranks(channel_mesh(p), cfg.clone(), move |c| {
                    let mut x = ins[c.rank()].clone();
                    c.all_reduce_mean(&mut x).unwrap()
                });
                assert!(out.iter().all(|&b| b), "p {p} n {n}: {what}: {out:?}");
            }
        }
    }
}

/// The hierarchical average (2 hosts × 2 ranks) is the hierarchical sum times `1/P` on every
/// rank, ring-sized and recursive-doubling-sized, and reports an overflowing sum.
#[test]
fn hierarchical_all_reduce_mean_is_its_sum_times_one_over_p_and_reports_non_finite() {
    use dtrain_comms::topology::Topology;
    use dtrain_comms::CommConfig;
    let cfg = CommConfig {
        chunk_bytes: 96,
        ..test_config()
    };
    for n in [3usize, 1000] {
        for overflow in [false, true] {
            let out = run_ranks(channel_mesh(4), cfg.clone(), move |c| {
                let hosts = Topology::from_nodes(4, 2).unwrap();
                let r = c.rank();
                let mut x: Vec<f32> = (0..n)
                    .map(|i| ((i * 31 + r * 17) % 97) as f32 / 7.0)
                    .collect();
                if overflow {
                    x[n - 1] = f32::MAX;
                }
                let mut sum = x.clone();
                c.hierarchical_all_reduce_sum(&mut sum, &hosts).unwrap();
                sum.iter_mut().for_each(|v| *v *= 0.25);
                let bad = c.hierarchical_all_reduce_mean(&mut x, &hosts).unwrap();
                (sum, x, bad)
            });
            for (r, (want, got, bad)) in out.iter().enumerate() {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(got), bits(want), "n {n} rank {r}");
                assert_eq!(*bad, overflow, "n {n} rank {r}");
            }
        }
    }
}
