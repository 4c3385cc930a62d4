//! The property suite every registered compressor must pass (ALGORITHMS.md §0, issue #2).
//!
//! Methods are taken from `METHODS`, so a newly registered compressor is covered without
//! editing this file.

use std::ops::Range;

use dtrain_compress::compressor::scale_has_non_finite;
use dtrain_compress::memory::{Memory, Residual};
use dtrain_compress::{
    compress_new, decompress, decompress_add, decompress_add_touched, decompress_mean,
    decompress_sum_add, payload_bits, CompressError, Compressor, Ctx, Payload, Pipeline, Rng,
    Touched, WireError, HEADER_BITS, METHODS,
};
use proptest::prelude::*;

fn all() -> Vec<(&'static str, Box<dyn Compressor>)> {
    let mut v: Vec<(&'static str, Box<dyn Compressor>)> = METHODS
        .iter()
        .map(|m| (m.name, (m.default)().build().expect(m.name)))
        .collect();
    // The modes a device codec computes identically (counter draws, exact sums): the same
    // properties as the defaults.
    for (name, toml) in [
        (
            "qsgd, counter draws",
            "kind = \"qsgd\"\ndraws = \"counter\"",
        ),
        (
            "qsgd, counter draws, elias",
            "kind = \"qsgd\"\ndraws = \"counter\"\ncoding = \"elias\"\nlevels = 3",
        ),
        (
            "terngrad, counter draws",
            "kind = \"terngrad\"\ndraws = \"counter\"",
        ),
        (
            "terngrad, counter draws, exact sums",
            "kind = \"terngrad\"\ndraws = \"counter\"\nsum = \"exact\"",
        ),
        (
            "natural, counter draws",
            "kind = \"natural\"\ndraws = \"counter\"",
        ),
        (
            "ef-signsgd, exact sums",
            "kind = \"ef-signsgd\"\nsum = \"exact\"",
        ),
        (
            "ef-signsgd, rms, exact sums",
            "kind = \"ef-signsgd\"\nsum = \"exact\"\nscale = \"rms\"",
        ),
        ("onebit, exact sums", "kind = \"onebit\"\nsum = \"exact\""),
        // Templar's tiles (each segment one row here: tiles of up to 8 values).
        (
            "sparseloco, tiles",
            "kind = \"sparseloco\"\ntile = 8\nk = 3",
        ),
    ] {
        let cfg: dtrain_compress::CompressorConfig = toml::from_str(toml).expect(name);
        v.push((name, cfg.build().expect(name)));
    }
    v
}

/// A gradient-like vector: layer scales spanning decades, heavy tails, some exact zeros.
fn gradient(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let layer_scale = 10f32.powi(-(((i / 97) % 4) as i32));
            let u = r.next_f32().max(1e-7);
            let lap = -u.ln() * if r.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
            if r.next_u64().is_multiple_of(17) {
                0.0
            } else {
                layer_scale * lap
            }
        })
        .collect()
}

fn segments(lens: &[usize]) -> Vec<Range<usize>> {
    let mut at = 0;
    lens.iter()
        .map(|&l| {
            let r = at..at + l;
            at += l;
            r
        })
        .collect()
}

fn ctx(segs: &[Range<usize>]) -> Ctx<'_> {
    Ctx {
        step: 3,
        rank: 1,
        bucket: 7,
        segments: segs,
    }
}

#[test]
fn round_trip_restores_length_and_is_finite() {
    for (name, mut c) in all() {
        for (n, lens) in [
            (1usize, vec![]),
            (2, vec![]),
            (5, vec![2, 3]),
            (1000, vec![]),
            (4099, vec![1, 2048, 2050]),
        ] {
            let g = gradient(n, 1);
            let segs = segments(&lens);
            let p = compress_new(c.as_mut(), &g, &ctx(&segs), &mut Rng::seed_from_u64(2))
                .unwrap_or_else(|e| panic!("{name} n={n}: {e}"));
            let mut out = vec![0f32; n];
            decompress(c.as_ref(), p.as_bytes(), &mut out)
                .unwrap_or_else(|e| panic!("{name} n={n}: {e}"));
            assert!(
                out.iter().all(|v| v.is_finite()),
                "{name}: non-finite output"
            );
            // Wrong output length is a typed error.
            let mut short = vec![0f32; n + 1];
            assert!(
                matches!(
                    decompress(c.as_ref(), p.as_bytes(), &mut short),
                    Err(WireError::LengthMismatch { .. })
                ),
                "{name}"
            );
        }
    }
}

/// Decoding the payloads of several workers at once equals decoding them one by one: bit for
/// bit where a method has no joint decoder, and up to float rounding where it has (FFT sums
/// the spectra and inverse-transforms once). A malformed payload is named by its index.
#[test]
fn joint_decoding_of_several_payloads_equals_decoding_each() {
    for (name, mut c) in all() {
        let n = 4099;
        let segs = segments(&[1, 2048, 2050]);
        let payloads: Vec<Payload> = (0..3)
            .map(|w| {
                let g = gradient(n, 10 + w);
                compress_new(c.as_mut(), &g, &ctx(&segs), &mut Rng::seed_from_u64(w))
                    .unwrap_or_else(|e| panic!("{name}: {e}"))
            })
            .collect();
        let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_bytes()).collect();
        let mut each = vec![0f32; n];
        for p in &refs {
            decompress_add(c.as_ref(), p, &mut each).unwrap();
        }
        let mut joint = vec![0f32; n];
        decompress_sum_add(c.as_ref(), &refs, &mut joint).unwrap_or_else(|(i, e)| {
            panic!("{name}: payload {i}: {e}");
        });
        let joint_decoder = c.joint_decompress_add(&refs, &mut vec![0f32; n]).is_some();
        let scale = each.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
        for (i, (a, b)) in joint.iter().zip(&each).enumerate() {
            if joint_decoder {
                assert!((a - b).abs() <= 1e-5 * scale, "{name}[{i}]: {a} vs {b}");
            } else {
                assert_eq!(a.to_bits(), b.to_bits(), "{name}[{i}]");
            }
        }
        let mut bad = payloads[1].as_bytes().to_vec();
        bad.truncate(bad.len() / 2);
        let broken = [refs[0], bad.as_slice(), refs[2]];
        let (i, _) = decompress_sum_add(c.as_ref(), &broken, &mut vec![0f32; n]).unwrap_err();
        assert_eq!(i, 1, "{name}: the truncated payload is named");
    }
}

/// The mean the exchanger writes (`decompress_mean`: zero, decode every payload, scale
/// only the elements the decodes marked) is bit for bit the zero fill, the sum and the
/// full scaling pass, for every method over one to three payloads, one segment or several;
/// the sparsifiers mark only their entries (else the shortcut would be no faster); and a
/// malformed payload is named by its index.
#[test]
fn the_mean_of_payloads_scales_only_what_the_decodes_marked_bit_for_bit() {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let mut touched = Touched::default();
    for (name, mut c) in all() {
        for lens in [vec![5000usize], vec![1, 2048, 2050]] {
            let n: usize = lens.iter().sum();
            let segs = segments(&lens);
            let payloads: Vec<Payload> = (0..3)
                .map(|w| {
                    let g = gradient(n, 30 + w);
                    compress_new(c.as_mut(), &g, &ctx(&segs), &mut Rng::seed_from_u64(w))
                        .unwrap_or_else(|e| panic!("{name}: {e}"))
                })
                .collect();
            let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_bytes()).collect();
            for p in 1..=3 {
                let inv = 1.0 / p as f32;
                let mut want = vec![0f32; n];
                decompress_sum_add(c.as_ref(), &refs[..p], &mut want).unwrap();
                let want_bad = scale_has_non_finite(&mut want, inv);
                let mut got = vec![-7.5f32; n];
                let bad = decompress_mean(c.as_ref(), &refs[..p], inv, &mut got, &mut touched)
                    .unwrap_or_else(|(i, e)| panic!("{name}: payload {i}: {e}"));
                assert_eq!(bits(&got), bits(&want), "{name} {lens:?} P={p}");
                assert_eq!(bad, want_bad, "{name} {lens:?} P={p}");
                let marked = (0..n).filter(|&i| touched.is_marked(i)).count();
                if ["topk", "randomk"].contains(&name) {
                    assert!(marked <= n / 4, "{name}: {marked} of {n} marked");
                }
            }
            // A fresh (empty) `touched` is sized by the call, not a panic.
            let mut fresh = Touched::default();
            let mut sum = vec![0f32; n];
            decompress_add_touched(c.as_ref(), refs[0], &mut sum, &mut fresh).unwrap();
            assert_eq!(fresh.len(), n, "{name}");
            assert!(
                (0..n).all(|i| sum[i] == 0.0 || fresh.is_marked(i)),
                "{name}: an element changed without a mark"
            );
            let mut broken = refs.clone();
            let bad = [0xD7u8, 1, 0, 0];
            broken[1] = &bad;
            let err = decompress_mean(c.as_ref(), &broken, 0.5, &mut vec![0f32; n], &mut touched);
            assert!(matches!(err, Err((1, _))), "{name}");
        }
    }
}

#[test]
fn empty_input_round_trips() {
    for (name, mut c) in all() {
        let p = compress_new(c.as_mut(), &[], &Ctx::default(), &mut Rng::seed_from_u64(0))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(p.encoded_len() as u64 * 8, HEADER_BITS, "{name}");
        let mut out: Vec<f32> = vec![];
        decompress(c.as_ref(), p.as_bytes(), &mut out).unwrap();
    }
}

#[test]
fn length_one_input() {
    for (name, mut c) in all() {
        for v in [0.0f32, 1.5, -2.25, 1e-30, -3e30] {
            let p = compress_new(
                c.as_mut(),
                &[v],
                &Ctx::default(),
                &mut Rng::seed_from_u64(0),
            )
            .unwrap();
            let mut out = [0f32];
            decompress(c.as_ref(), p.as_bytes(), &mut out).unwrap();
            assert!(out[0].is_finite(), "{name}");
            if v != 0.0 && out[0] != 0.0 {
                assert_eq!(
                    out[0].signum(),
                    v.signum(),
                    "{name}: sign of {v} -> {}",
                    out[0]
                );
            }
        }
    }
}

#[test]
fn non_finite_input_is_an_error_naming_the_element() {
    for (name, mut c) in all() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut g = gradient(300, 4);
            g[123] = bad;
            let e = compress_new(c.as_mut(), &g, &Ctx::default(), &mut Rng::seed_from_u64(0))
                .unwrap_err();
            assert!(
                matches!(e, CompressError::NonFinite { index: 123, .. }),
                "{name}: {e:?}"
            );
        }
    }
}

/// Methods that find non-finite input in their own passes ([`Compressor::finds_non_finite`])
/// must answer as the scan would: the first bad element of the buffer over all its segments,
/// with the generator and the method's state as they were (the next call encodes the same
/// bytes as on a compressor that never saw the bad buffer).
#[test]
fn non_finite_input_is_found_first_across_segments_and_leaves_no_trace() {
    let segs = segments(&[3000, 5000, 100, 6000]);
    let n = segs.last().unwrap().end;
    let clean = gradient(n, 9);
    let positions: [&[usize]; 6] = [
        &[0],
        &[2999],
        &[3000, 8100],
        &[7999, 8050],
        &[8150],
        &[n - 1],
    ];
    for m in METHODS {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in positions {
                let mut g = clean.clone();
                for &i in at {
                    g[i] = bad;
                }
                let mut seen = (m.default)().build().expect(m.name);
                let mut rng = Rng::seed_from_u64(5);
                let e = compress_new(seen.as_mut(), &g, &ctx(&segs), &mut rng).unwrap_err();
                assert!(
                    matches!(e, CompressError::NonFinite { index, .. } if index == at[0]),
                    "{}: {bad} at {at:?}: {e:?}",
                    m.name
                );
                assert_eq!(rng, Rng::seed_from_u64(5), "{}: generator moved", m.name);
                let after = compress_new(seen.as_mut(), &clean, &ctx(&segs), &mut rng).unwrap();
                let mut fresh = (m.default)().build().expect(m.name);
                let want = compress_new(
                    fresh.as_mut(),
                    &clean,
                    &ctx(&segs),
                    &mut Rng::seed_from_u64(5),
                )
                .unwrap();
                assert_eq!(after.as_bytes(), want.as_bytes(), "{}: state kept", m.name);
            }
        }
    }
}

#[test]
fn bad_segments_are_rejected() {
    for (name, mut c) in all() {
        let g = gradient(10, 4);
        for segs in [vec![0..4, 5..10], vec![0..4, 4..4, 4..10], vec![0..4, 4..9]] {
            let e = compress_new(c.as_mut(), &g, &ctx(&segs), &mut Rng::seed_from_u64(0));
            assert!(matches!(e, Err(CompressError::BadSegments(_))), "{name}");
        }
    }
}

#[test]
fn deterministic_under_a_seed() {
    for (name, mut c) in all() {
        let g = gradient(5000, 5);
        let segs = segments(&[1000, 4000]);
        let a = compress_new(c.as_mut(), &g, &ctx(&segs), &mut Rng::for_step(9, 3, 1, 7)).unwrap();
        let b = compress_new(c.as_mut(), &g, &ctx(&segs), &mut Rng::for_step(9, 3, 1, 7)).unwrap();
        assert_eq!(a, b, "{name}: same seed, different payload");
    }
}

#[test]
fn encoded_length_equals_the_formula() {
    for (name, mut c) in all() {
        for lens in [
            vec![1usize],
            vec![7],
            vec![100],
            vec![4096],
            vec![33, 1000, 5],
        ] {
            let n: usize = lens.iter().sum();
            let g = gradient(n, 6);
            let segs = segments(&lens);
            let p = compress_new(c.as_mut(), &g, &ctx(&segs), &mut Rng::seed_from_u64(3)).unwrap();
            if let Some(bits) = payload_bits(c.as_ref(), &lens) {
                assert_eq!(p.encoded_len() as u64 * 8, bits, "{name} {lens:?}");
            }
        }
    }
}

/// One step of `pipe` on bucket 1 of rank 0 of 1: `g` compressed (through its memory) into
/// `payload`, and the payload's decode.
fn pipeline_step(
    pipe: &mut Pipeline,
    g: &[f32],
    step: u64,
    segs: &[Range<usize>],
    payload: &mut Payload,
) -> Vec<f32> {
    let c = Ctx {
        step,
        rank: 0,
        bucket: 1,
        segments: segs,
    };
    pipe.compress(g, &c, &mut Rng::for_step(1, step, 0, 1), payload)
        .unwrap();
    let mut d = vec![0f32; g.len()];
    pipe.decompress_add(payload.as_bytes(), &mut d).unwrap();
    d
}

#[test]
fn error_feedback_invariant() {
    // D(msg) + e_new == g + e_old, for every method under residual memory.
    for m in METHODS {
        let cfg = (m.default)();
        let mut pipe = Pipeline::new(cfg.build().unwrap(), Box::new(Residual::new(1.0, 1.0)));
        let n = 3000;
        let mut payload = Payload::new();
        let segs = segments(&[1000, 2000]);
        let mut e_old = vec![0f32; n];
        for step in 0..4u64 {
            let g = gradient(n, 10 + step);
            let d = pipeline_step(&mut pipe, &g, step, &segs, &mut payload);
            let e_new = pipe.residual_signal(1, &segs, n).unwrap();
            let mut worst = 0f64;
            for i in 0..n {
                let lhs = d[i] as f64 + e_new[i] as f64;
                let rhs = g[i] as f64 + e_old[i] as f64;
                let tol = 1e-6 * (1.0 + rhs.abs().max(d[i].abs() as f64));
                worst = worst.max((lhs - rhs).abs() / tol);
            }
            assert!(
                worst <= 1.0,
                "{}: EF invariant off by {worst} tolerances",
                m.name
            );
            e_old = e_new;
        }
    }
}

/// DGC's momentum correction (`compress.memory = { kind = "dgc-momentum" }`, issue 55) under
/// every method: the memory accumulates the velocity `u ← m·u + g`, `v ← v + u`, sends
/// `C(v)` and keeps `v − D(C(v))`; with masking, the momentum of every coordinate sent out of
/// a segment that held something back stops. Checked through the pipeline, as the
/// exchanger runs it, and across a checkpoint of the memory (export / import).
#[test]
fn momentum_correction_invariant() {
    use dtrain_compress::memory::{Clip, DgcMemory};
    let m = 0.9f32;
    for method in METHODS {
        let cfg = (method.default)();
        let mut pipe = Pipeline::new(
            cfg.build().unwrap(),
            Box::new(DgcMemory::new(m, false, true, Clip::None)),
        );
        let n = 3000;
        let segs = segments(&[1000, 2000]);
        let mut payload = Payload::new();
        let (mut u, mut v) = (vec![0f32; n], vec![0f32; n]);
        for step in 0..4u64 {
            if step == 2 {
                // A checkpoint and a resume in the middle: the state carries over exactly.
                let state = pipe.export_memory();
                let mut fresh = Pipeline::new(
                    cfg.build().unwrap(),
                    Box::new(DgcMemory::new(m, false, true, Clip::None)),
                );
                fresh.import_memory(state.clone());
                assert_eq!(fresh.export_memory(), state, "{}", method.name);
                // The compressor's own state (θ schedules, warm starts) is not the
                // memory's: keep the original pipeline, whose memory now round-tripped.
                pipe.import_memory(state);
            }
            let g = gradient(n, 20 + step);
            let d = pipeline_step(&mut pipe, &g, step, &segs, &mut payload);
            let state = pipe.export_memory().remove(&1).unwrap();
            let (u_new, v_new) = state.split_at(n);
            let mut worst = 0f64;
            for seg in &segs {
                // Whether the segment held anything back (then its sent momentum stops).
                let partial = seg.clone().any(|i| v_new[i] != 0.0);
                for i in seg.clone() {
                    let u_want = m * u[i] + g[i];
                    let p = v[i] + u_want;
                    // D(msg) + v_new == v_old + u_new.
                    let lhs = d[i] as f64 + v_new[i] as f64;
                    let tol = 1e-6 * (1.0 + (p as f64).abs().max(d[i].abs() as f64));
                    worst = worst.max((lhs - p as f64).abs() / tol);
                    let sent = d[i] != 0.0;
                    let u_expect = if partial && sent { 0.0 } else { u_want };
                    assert_eq!(
                        u_new[i].to_bits(),
                        u_expect.to_bits(),
                        "{}: step {step}, momentum of {i}",
                        method.name
                    );
                }
            }
            assert!(
                worst <= 1.0,
                "{}: momentum-correction invariant off by {worst} tolerances",
                method.name
            );
            u = u_new.to_vec();
            v = v_new.to_vec();
        }
    }
}

#[test]
fn payload_from_another_method_is_refused() {
    let mut methods = all();
    let (_, first) = &mut methods[0];
    let p = compress_new(
        first.as_mut(),
        &[1.0, 2.0],
        &Ctx::default(),
        &mut Rng::seed_from_u64(0),
    )
    .unwrap();
    for (name, c) in methods.iter().skip(1) {
        let mut out = [0f32; 2];
        assert!(
            matches!(
                decompress_add(c.as_ref(), p.as_bytes(), &mut out),
                Err(WireError::WrongMethod { .. })
            ),
            "{name}"
        );
    }
}

fn valid_payloads() -> Vec<(usize, Vec<u8>, usize)> {
    // (method index, payload, n)
    let mut v = Vec::new();
    for (mi, (_, mut c)) in all().into_iter().enumerate() {
        for lens in [vec![1usize], vec![64], vec![300], vec![10, 90]] {
            let n: usize = lens.iter().sum();
            let g = gradient(n, 20);
            let segs = segments(&lens);
            let p = compress_new(c.as_mut(), &g, &ctx(&segs), &mut Rng::seed_from_u64(1)).unwrap();
            v.push((mi, p.into_bytes(), n));
        }
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// Random bytes never panic any decoder (with or without a valid-looking header).
    #[test]
    fn decoders_survive_arbitrary_bytes(body in proptest::collection::vec(any::<u8>(), 0..600),
                                        n in 0usize..400, method in 0u8..32, with_header in any::<bool>()) {
        let cs = all();
        for (_, c) in &cs {
            let mut bytes = body.clone();
            if with_header {
                let mut h = vec![0xD7, 1, method, 0];
                h.extend_from_slice(&(n as u32).to_le_bytes());
                h.extend_from_slice(&(u32::from(n > 0)).to_le_bytes());
                h.extend_from_slice(&bytes);
                bytes = h;
            }
            let mut out = vec![0f32; n];
            let _ = decompress_add(c.as_ref(), &bytes, &mut out);
            let _ = decompress_mean(c.as_ref(), &[&bytes, &bytes], 0.5, &mut out, &mut Touched::default());
            let _ = Payload::decode(bytes);
        }
    }

    /// Mutated valid payloads (bit flips, truncation, extension) never panic; when they
    /// decode, the output is finite.
    #[test]
    fn decoders_survive_mutated_payloads(which in any::<prop::sample::Index>(),
                                         flips in proptest::collection::vec((any::<prop::sample::Index>(), 0u8..8), 0..6),
                                         cut in any::<prop::sample::Index>(), truncate in any::<bool>(),
                                         extra in proptest::collection::vec(any::<u8>(), 0..4)) {
        let cs = all();
        let payloads = valid_payloads();
        let (mi, mut bytes, n) = payloads[which.index(payloads.len())].clone();
        for (pos, bit) in flips {
            let i = pos.index(bytes.len());
            bytes[i] ^= 1 << bit;
        }
        if truncate {
            let c = cut.index(bytes.len() + 1);
            bytes.truncate(c);
        }
        bytes.extend_from_slice(&extra);
        let mut out = vec![0f32; n];
        if decompress_add(cs[mi].1.as_ref(), &bytes, &mut out).is_ok() {
            prop_assert!(out.iter().all(|v| v.is_finite()));
            // What a mutated payload decodes to, its mean marks: scaling only the marked
            // elements gives the full pass's bits.
            let mut want = out.clone();
            let want_bad = scale_has_non_finite(&mut want, 0.5);
            let mut got = vec![1.0f32; n];
            let c = cs[mi].1.as_ref();
            let bad = decompress_mean(c, &[&bytes], 0.5, &mut got, &mut Touched::default());
            prop_assert_eq!(bad.ok(), Some(want_bad));
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&got), bits(&want));
        } else {
            let r = decompress_mean(cs[mi].1.as_ref(), &[&bytes], 0.5, &mut out, &mut Touched::default());
            prop_assert!(r.is_err());
        }
    }
}

#[test]
fn memory_state_round_trips_for_checkpoints() {
    let mut m = Residual::new(1.0, 1.0);
    let mut p = vec![0f32; 3];
    m.compensate(5, &[1.0, 2.0, 3.0], &mut p);
    m.update(5, &p, &[1.0, 0.0, 0.0], &[]);
    let state = m.export();
    let mut m2 = Residual::new(1.0, 1.0);
    m2.import(state.clone());
    assert_eq!(m2.export(), state);
    assert_eq!(state[&5], vec![0.0, 2.0, 3.0]);
}

#[test]
fn summable_methods_sum_in_compressed_form() {
    use dtrain_compress::{sum_lanes, summable_lanes, Aggregation};
    for (name, mut c) in all() {
        if c.aggregation() != Aggregation::Summable {
            continue;
        }
        let n = 2000;
        let segs = segments(&[500, 1500]);
        let mut payloads = Vec::new();
        let mut separate = vec![0f32; n];
        for rank in 0..3u32 {
            let g = gradient(n, 30 + rank as u64);
            let cx = Ctx {
                step: 5,
                rank,
                bucket: 2,
                segments: &segs,
            };
            let p = compress_new(
                c.as_mut(),
                &g,
                &cx,
                &mut Rng::for_step(1, 5, rank as u64, 2),
            )
            .unwrap();
            decompress_add(c.as_ref(), p.as_bytes(), &mut separate).unwrap();
            payloads.push(p.into_bytes());
        }
        let lanes = summable_lanes(c.as_ref(), &payloads[0]).unwrap();
        let mut acc = payloads[0].clone();
        for p in &payloads[1..] {
            assert_eq!(summable_lanes(c.as_ref(), p).unwrap(), lanes, "{name}");
            sum_lanes(c.as_ref(), &mut acc, p).unwrap();
        }
        let mut summed = vec![0f32; n];
        decompress(c.as_ref(), &acc, &mut summed).unwrap();
        for i in 0..n {
            let tol = 1e-5 * (1.0 + separate[i].abs());
            assert!(
                (summed[i] - separate[i]).abs() <= tol,
                "{name}: element {i}"
            );
        }
    }
}
