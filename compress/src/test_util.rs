//! Helpers shared by the methods' unit tests (compiled for tests only).

use crate::compressor::{compress, decompress_add, decompress_mean, Compressor, Ctx, Payload};
use crate::finite::scale_has_non_finite;
use crate::rng::Rng;
use crate::touched::Touched;
use crate::wire::Reader;

/// Feeds a decoder random bytes, random bodies behind a valid header, and mutations of
/// the `valid` payloads (each decoding into a buffer of the paired length). Every call must
/// return without panicking, a payload that is accepted must decode to finite values, and
/// the mean of copies of it must be the decodes added into zeros and scaled, bit for bit
/// (the one-pass forms of a method that decodes densely included).
pub(crate) fn fuzz_decoder(
    c: &dyn Compressor,
    valid: &[(Vec<u8>, usize)],
    cases: usize,
    seed: u64,
) {
    let mut rng = Rng::seed_from_u64(seed);
    // The framing never passes an empty segment, but a direct call must not panic either.
    for bytes in [&[][..], &[0u8; 4][..], &[0u8; 16][..], &[0xFFu8; 16][..]] {
        let _ = c.decode_segment_add(&mut Reader::new(bytes), &mut []);
    }
    for case in 0..cases {
        let (base, n) = &valid[case % valid.len()];
        let mut bytes = base.clone();
        match rng.below(6) {
            0 => {
                // Pure noise.
                let len = rng.below(64) as usize;
                bytes = (0..len).map(|_| rng.next_u64() as u8).collect();
            }
            1 => {
                // Valid header, random body of random length.
                let keep = bytes.len().min(12);
                bytes.truncate(keep);
                let len = rng.below(2 * base.len() as u64 + 8) as usize;
                bytes.extend((0..len).map(|_| rng.next_u64() as u8));
            }
            2 => {
                // Truncate or extend.
                if rng.below(2) == 0 {
                    let len = rng.below(bytes.len() as u64 + 1) as usize;
                    bytes.truncate(len);
                } else {
                    let extra = 1 + rng.below(8) as usize;
                    bytes.extend((0..extra).map(|_| rng.next_u64() as u8));
                }
            }
            _ => {
                // Flip a few bits / overwrite a few bytes (mostly in the body).
                let edits = 1 + rng.below(3);
                for _ in 0..edits {
                    if bytes.is_empty() {
                        break;
                    }
                    let at = rng.below(bytes.len() as u64) as usize;
                    if rng.below(2) == 0 {
                        bytes[at] ^= 1 << rng.below(8);
                    } else {
                        bytes[at] = rng.next_u64() as u8;
                    }
                }
            }
        }
        let mut out = vec![0f32; *n];
        let added = decompress_add(c, &bytes, &mut out);
        if added.is_ok() {
            assert!(
                out.iter().all(|v| v.is_finite()),
                "accepted payload decoded to non-finite values"
            );
        }
        assert_mean_of_one_is_the_added(c, &bytes, &out, added.is_ok(), case);
    }
    for (case, (bytes, n)) in valid.iter().enumerate() {
        let mut out = vec![0f32; *n];
        let added = decompress_add(c, bytes, &mut out);
        assert!(added.is_ok(), "valid payload {case} refused: {added:?}");
        assert_mean_of_one_is_the_added(c, bytes, &out, true, case);
    }
}

/// The mean of one, two and three copies of a payload, at factors 1, 1/2 and 10³⁸ (the
/// last overflows, so the non-finite flag is checked too), written over a buffer of garbage
/// (a method that [decodes densely](Compressor::decodes_densely) puts each value where the
/// mean goes: no zero fill, the scaling fused into the last decode) accepts what the adding
/// decode into zeros accepted (`ok`) and then holds the bits and the flag of the passes
/// taken one by one: `added` (one decode into zeros), added again, and scaled.
fn assert_mean_of_one_is_the_added(
    c: &dyn Compressor,
    bytes: &[u8],
    added: &[f32],
    ok: bool,
    case: usize,
) {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (copies, k) in [(1usize, 1.0f32), (2, 0.5), (3, 1e38)] {
        let mut got = vec![-3.5f32; added.len()];
        let payloads = vec![bytes; copies];
        let mean = decompress_mean(c, &payloads, k, &mut got, &mut Touched::default());
        assert_eq!(
            mean.is_ok(),
            ok,
            "case {case} ×{copies}: mean {mean:?}, add ok {ok}"
        );
        if let Ok(bad) = mean {
            let mut want = added.to_vec();
            for _ in 1..copies {
                decompress_add(c, bytes, &mut want).expect("accepted once");
            }
            let want_bad = scale_has_non_finite(&mut want, k);
            assert!(
                bits(&got) == bits(&want),
                "case {case} ×{copies}: the mean differs"
            );
            assert_eq!(bad, want_bad, "case {case} ×{copies}: the non-finite flag");
        }
    }
}

/// Normal-ish random vector (sum of uniforms), scaled, with a few exact zeros.
pub(crate) fn test_vector(n: usize, scale: f32, seed: u64) -> Vec<f32> {
    let mut rng = Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            if i % 17 == 3 {
                0.0
            } else {
                let u: f32 = (0..4).map(|_| rng.next_f32()).sum::<f32>() - 2.0;
                scale * u
            }
        })
        .collect()
}

/// Roughly Gaussian data with a few heavy outliers.
pub(crate) fn outlier_vector(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let g: f32 = (0..4).map(|_| r.next_f32()).sum::<f32>() - 2.0;
            if i % 997 == 0 {
                g * 40.0
            } else {
                g
            }
        })
        .collect()
}

/// `c`'s payload of `x`, whose segments are tensors of `shapes` (handed to
/// [`Compressor::set_segment_shapes`] first).
pub(crate) fn compress_shaped(c: &mut dyn Compressor, x: &[f32], shapes: &[Vec<usize>]) -> Payload {
    c.set_segment_shapes(shapes);
    let mut at = 0;
    let segs: Vec<_> = shapes
        .iter()
        .map(|s| {
            let n: usize = s.iter().product();
            at += n;
            at - n..at
        })
        .collect();
    let ctx = Ctx {
        segments: &segs,
        ..Ctx::default()
    };
    let mut p = Payload::new();
    compress(c, x, &ctx, &mut Rng::seed_from_u64(0), &mut p).unwrap();
    p
}
