//! `threshold`: Strom's fixed-threshold quantizer (ALGORITHMS.md §6), as LBANN ports it.
//!
//! Every entry with `|p_j| ≥ τ` is sent as its index and sign and reconstructed as `±τ`;
//! everything else is dropped. The paper builds error feedback into the quantizer; here it is
//! the separate [`crate::memory`] seam, and the registry pairs this method with residual
//! memory by default, which gives exactly Strom's `e_j = p_j ∓ τ` / `e_j = p_j`.
//!
//! Body, per segment of `n` elements (the *sign-word* body, shared with
//! [`crate::adaptive`]):
//! ```text
//! u32 count
//! count × u32 word = (index << 1) | sign      sign 1 = negative; indices strictly ascending
//! ```
//! Bits per segment: `32 + 32·count`. The count is data-dependent and has no upper bound
//! other than `n` (the method's known weakness), so [`Compressor::segment_bits`] is `None`.
//! An index must fit in 31 bits, so segments are limited to `2^31` elements
//! ([`Compressor::max_segment_len`]); [`crate::compress`] refuses longer ones with
//! [`crate::CompressError::TooLarge`].
//!
//! τ is not on the wire: the decoder must be built from the same configuration.
//! Biased; use error feedback. Aggregation: all-gather.

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::{ConfigError, WireError};
use crate::rng::Rng;
use crate::wire::{u32_at, Reader, Writer};

/// Longest segment a sign-word body can describe: indices must fit in 31 bits.
pub const MAX_SIGN_WORD_SEGMENT: usize = 1 << 31;

/// Configuration of [`Threshold`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThresholdConfig {
    /// The threshold τ > 0 (finite). Entries with `|p| ≥ τ` are sent as `±τ`. The right
    /// value is task-dependent (ALGORITHMS.md §6 marks it [U]); the default, 0.01, is our
    /// own choice, sized for gradients of order 1e-3 plus accumulated residual.
    #[serde(default = "default_tau")]
    pub tau: f32,
}

fn default_tau() -> f32 {
    0.01
}

impl Default for ThresholdConfig {
    fn default() -> Self {
        ThresholdConfig { tau: default_tau() }
    }
}

impl ThresholdConfig {
    /// Checks the parameters and builds the compressor.
    pub fn init(&self) -> Result<Threshold, ConfigError> {
        if !(self.tau.is_finite() && self.tau > 0.0) {
            return Err(ConfigError::new(
                "tau",
                format!("must be finite and > 0, got {}", self.tau),
            ));
        }
        Ok(Threshold {
            tau: self.tau,
            words: Vec::new(),
        })
    }
}

/// Strom's threshold quantizer.
#[derive(Debug, Clone)]
pub struct Threshold {
    tau: f32,
    words: Vec<u32>,
}

impl Threshold {
    /// The threshold τ.
    pub fn tau(&self) -> f32 {
        self.tau
    }
}

/// Appends the sign word of every entry of `x` with `x ≥ pos` or `x ≤ neg` to `words`
/// (cleared first), in ascending index order. `x.len()` must not exceed
/// [`MAX_SIGN_WORD_SEGMENT`].
pub fn collect_sign_words(x: &[f32], pos: f32, neg: f32, words: &mut Vec<u32>) {
    debug_assert!(x.len() <= MAX_SIGN_WORD_SEGMENT);
    words.clear();
    // Branch-free: write every candidate word into a stack block, advance only on a hit,
    // then append the hits.
    const BLOCK: usize = 2048;
    let mut buf = [0u32; BLOCK];
    for (b, block) in x.chunks(BLOCK).enumerate() {
        let base = (b * BLOCK) as u32;
        let mut m = 0usize;
        for (j, &v) in block.iter().enumerate() {
            buf[m] = ((base + j as u32) << 1) | (v <= neg) as u32;
            m += ((v >= pos) | (v <= neg)) as usize;
        }
        words.extend_from_slice(&buf[..m]);
    }
}

/// Writes a sign-word body: the count, then the words.
pub fn write_sign_words(words: &[u32], w: &mut Writer<'_>) {
    w.u32(words.len() as u32);
    w.u32_slice(words);
}

/// Bits of a sign-word body with `count` words.
pub fn sign_words_bits(count: usize) -> u64 {
    32 + 32 * count as u64
}

/// Reads a sign-word body and adds `pos` (sign 0) or `neg` (sign 1) at each index of `out`.
///
/// Checks that the count is at most `out.len()` and covered by the bytes present, that
/// every index is in range and that indices strictly ascend (no duplicates).
pub fn read_sign_words_add(
    r: &mut Reader<'_>,
    out: &mut [f32],
    pos: f32,
    neg: f32,
) -> Result<(), WireError> {
    let n = out.len();
    let count = r.u32("sign-word count")? as usize;
    if count > n {
        return Err(WireError::Invalid("more sign words than elements"));
    }
    let words = r.take_items(count, 4, "sign words")?;
    let mut next = 0usize;
    for j in 0..count {
        let word = u32_at(words, j);
        let i = (word >> 1) as usize;
        if i >= n {
            return Err(WireError::IndexOutOfRange {
                index: i as u64,
                len: n,
            });
        }
        if i < next {
            return Err(WireError::Invalid(
                "sign-word indices not strictly ascending",
            ));
        }
        out[i] += if word & 1 == 0 { pos } else { neg };
        next = i + 1;
    }
    Ok(())
}

impl Compressor for Threshold {
    fn method(&self) -> MethodId {
        MethodId::Threshold
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        collect_sign_words(x, self.tau, -self.tau, &mut self.words);
        write_sign_words(&self.words, w);
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        read_sign_words_add(r, out, self.tau, -self.tau)
    }
    fn segment_bits(&self, _n: usize) -> Option<u64> {
        None
    }
    fn max_segment_len(&self) -> usize {
        MAX_SIGN_WORD_SEGMENT
    }
}

/// Helpers shared by the tests of the threshold-style sparsifiers.
#[cfg(test)]
pub(crate) mod test_support {
    use crate::compressor::{compress_new, decompress, Compressor, Ctx};
    use crate::config::CompressorConfig;
    use crate::pipeline::Pipeline;
    use crate::rng::Rng;
    use crate::Payload;

    /// Standard normal draws (Box–Muller), scaled.
    pub fn gaussian(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u1 = 1.0 - rng.next_f64();
                let u2 = rng.next_f64();
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                z as f32 * scale
            })
            .collect()
    }

    /// Heavy-tailed draws: a Gaussian times an exponential magnitude.
    pub fn heavy_tailed(rng: &mut Rng, n: usize) -> Vec<f32> {
        let g = gaussian(rng, n, 1.0);
        g.into_iter()
            .map(|z| z * (-(1.0 - rng.next_f64()).ln() * 3.0).exp() as f32 * 1e-3)
            .collect()
    }

    /// Compresses and decodes `x` (one segment, or `segs`) and returns the payload too.
    pub fn round_trip(
        c: &mut dyn Compressor,
        x: &[f32],
        segs: &[std::ops::Range<usize>],
        rng: &mut Rng,
    ) -> (Payload, Vec<f32>) {
        let ctx = Ctx {
            segments: segs,
            ..Ctx::default()
        };
        let p = compress_new(c, x, &ctx, rng).unwrap();
        let mut out = vec![0f32; x.len()];
        decompress(c, p.as_bytes(), &mut out).unwrap();
        (p, out)
    }

    /// Runs `steps` steps of the method's default error-feedback pipeline and checks the
    /// invariant `D(msg) + e_new == g + e_old` element-wise, up to f32 rounding.
    pub fn check_ef_invariant(cfg: &CompressorConfig, n: usize, steps: usize, seed: u64) {
        let mem = cfg.default_memory().build().unwrap();
        let mut pipe = Pipeline::new(cfg.build().unwrap(), mem);
        let mut rng = Rng::seed_from_u64(seed);
        let segs = [0..n / 3, n / 3..n];
        let ctx = Ctx {
            segments: &segs,
            bucket: 7,
            ..Ctx::default()
        };
        let mut e_old = vec![0f32; n];
        let mut payload = Payload::new();
        let mut sent_any = false;
        for step in 0..steps {
            let g = gaussian(&mut rng, n, 1e-2);
            pipe.compress(&g, &ctx, &mut rng, &mut payload).unwrap();
            let mut d = vec![0f32; n];
            pipe.decompress_add(payload.as_bytes(), &mut d).unwrap();
            sent_any |= d.iter().any(|&v| v != 0.0);
            let e_new = pipe.memory().export().remove(&7).expect("residual kept");
            for j in 0..n {
                let lhs = d[j] as f64 + e_new[j] as f64;
                let rhs = g[j] as f64 + e_old[j] as f64;
                let tol = 1e-6 * (rhs.abs() + d[j].abs() as f64) + 1e-12;
                assert!(
                    (lhs - rhs).abs() <= tol,
                    "{} step {step} j {j}: {lhs} vs {rhs}",
                    cfg.name()
                );
            }
            e_old = e_new;
        }
        assert!(sent_any, "{}: nothing was ever transmitted", cfg.name());
    }

    /// Feeds random, truncated, extended and bit-flipped versions of valid payloads to the
    /// decoder: it must never panic, and whatever it accepts must decode to finite values.
    pub fn fuzz_decoder(cfg: &CompressorConfig, seed: u64) {
        let mut c = cfg.build().unwrap();
        let mut rng = Rng::seed_from_u64(seed);
        let mut rejected = 0usize;
        let mut tried = 0usize;
        for &n in &[1usize, 2, 17, 300, 2500] {
            let mut x = gaussian(&mut rng, n, 1.0);
            x[0] = 5.0;
            let segs: Vec<std::ops::Range<usize>> = if n > 4 {
                vec![0..n / 4, n / 4..n]
            } else {
                vec![]
            };
            let (p, _) = round_trip(c.as_mut(), &x, &segs, &mut rng);
            let good = p.into_bytes();
            for t in 0..300 {
                let mut b = good.clone();
                match t % 5 {
                    0 => {
                        let cut = rng.below(b.len() as u64) as usize;
                        b.truncate(cut);
                    }
                    1 => {
                        let extra = 1 + rng.below(8) as usize;
                        b.extend((0..extra).map(|_| rng.next_u64() as u8));
                    }
                    2 => {
                        // Random body after a valid header and segment table.
                        let keep = 12 + if segs.len() > 1 { 4 * segs.len() } else { 0 };
                        b.truncate(keep);
                        let len = rng.below(64) as usize;
                        b.extend((0..len).map(|_| rng.next_u64() as u8));
                    }
                    _ => {
                        for _ in 0..1 + rng.below(4) {
                            let at = 12 + rng.below((b.len() - 12).max(1) as u64) as usize;
                            if at < b.len() {
                                b[at] ^= 1 << rng.below(8);
                            }
                        }
                        if rng.below(4) == 0 {
                            // Hit a count or length field with a huge value.
                            let at = 12 + rng.below((b.len() - 12).max(1) as u64) as usize;
                            for k in at..(at + 4).min(b.len()) {
                                b[k] = 0xFF;
                            }
                        }
                    }
                }
                let mut out = vec![0f32; n];
                tried += 1;
                match decompress(c.as_ref(), &b, &mut out) {
                    Ok(()) => assert!(
                        out.iter().all(|v| v.is_finite()),
                        "{}: accepted bytes decode to non-finite values",
                        cfg.name()
                    ),
                    Err(_) => rejected += 1,
                }
            }
            // Pure noise of every small length.
            for len in 0..40 {
                let b: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
                let mut out = vec![0f32; n];
                assert!(decompress(c.as_ref(), &b, &mut out).is_err());
            }
        }
        assert!(
            rejected * 4 > tried,
            "{}: only {rejected} of {tried} corrupted payloads rejected",
            cfg.name()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;
    use crate::compressor::{decompress, Ctx, HEADER_BITS};
    use crate::config::CompressorConfig;

    fn build(tau: f32) -> Threshold {
        ThresholdConfig { tau }.init().unwrap()
    }

    #[test]
    fn sends_exactly_the_entries_at_or_beyond_tau_as_plus_minus_tau() {
        let mut rng = Rng::seed_from_u64(1);
        for &n in &[1usize, 5, 4095, 4096, 4097, 20_000] {
            let mut x = gaussian(&mut rng, n, 1.0);
            // Exact boundary values and signed zeros.
            x[0] = 0.5;
            if n > 3 {
                x[1] = -0.5;
                x[2] = -0.0;
                x[3] = f32::from_bits(0.5f32.to_bits() - 1);
            }
            let mut c = build(0.5);
            let (p, out) = round_trip(&mut c, &x, &[], &mut rng);
            let mut count = 0;
            for (j, (&v, &o)) in x.iter().zip(&out).enumerate() {
                if v >= 0.5 {
                    assert_eq!(o, 0.5, "j {j} v {v}");
                    count += 1;
                } else if v <= -0.5 {
                    assert_eq!(o, -0.5, "j {j} v {v}");
                    count += 1;
                } else {
                    assert_eq!(o, 0.0, "j {j} v {v}");
                }
            }
            assert!(count > 0);
            assert_eq!(
                p.encoded_len() as u64 * 8,
                HEADER_BITS + sign_words_bits(count),
                "n {n}"
            );
        }
    }

    #[test]
    fn encoded_length_with_segments_is_header_table_and_words() {
        let mut rng = Rng::seed_from_u64(2);
        let x = gaussian(&mut rng, 1000, 1.0);
        let mut c = build(1.0);
        let segs = [0..100, 100..1000];
        let (p, out) = round_trip(&mut c, &x, &segs, &mut rng);
        let count = out.iter().filter(|&&v| v != 0.0).count();
        let sent = x.iter().filter(|v| v.abs() >= 1.0).count();
        assert_eq!(count, sent);
        assert_eq!(
            p.encoded_len() as u64 * 8,
            HEADER_BITS + 64 + 2 * 32 + 32 * count as u64
        );
    }

    #[test]
    fn residual_after_a_step_follows_strom() {
        let cfg = CompressorConfig::Threshold(ThresholdConfig { tau: 0.02 });
        let mut pipe =
            crate::Pipeline::new(cfg.build().unwrap(), cfg.default_memory().build().unwrap());
        let mut rng = Rng::seed_from_u64(3);
        let n = 5000;
        let mut e_old = vec![0f32; n];
        let mut p = crate::Payload::new();
        for _ in 0..5 {
            let g = gaussian(&mut rng, n, 1e-2);
            pipe.compress(&g, &Ctx::default(), &mut rng, &mut p)
                .unwrap();
            let e = pipe.memory().export().remove(&0).unwrap();
            for j in 0..n {
                let pj = g[j] + e_old[j];
                if pj.abs() >= 0.02 {
                    assert!((e[j].abs() - (pj.abs() - 0.02)).abs() <= 1e-7, "j {j}");
                    assert_eq!(e[j].signum(), pj.signum());
                } else {
                    assert!(e[j].abs() < 0.02);
                    assert_eq!(e[j], pj);
                }
            }
            e_old = e;
        }
    }

    #[test]
    fn ef_invariant() {
        check_ef_invariant(
            &CompressorConfig::Threshold(ThresholdConfig { tau: 0.015 }),
            3000,
            6,
            4,
        );
    }

    #[test]
    fn config_is_validated() {
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let e = ThresholdConfig { tau: bad }.init().err().unwrap();
            assert_eq!(e.field, "tau");
        }
        let cfg: CompressorConfig = toml::from_str("kind = \"threshold\"\ntau = 0.25").unwrap();
        assert_eq!(
            cfg,
            CompressorConfig::Threshold(ThresholdConfig { tau: 0.25 })
        );
    }

    #[test]
    fn decoder_rejects_malformed_sign_words() {
        let c = build(1.0);
        let body = |words: &[u32], count: u32| {
            let mut b = vec![0xD7, 1, MethodId::Threshold as u8, 0];
            b.extend(4u32.to_le_bytes());
            b.extend(1u32.to_le_bytes());
            b.extend(count.to_le_bytes());
            for w in words {
                b.extend(w.to_le_bytes());
            }
            b
        };
        let mut out = [0f32; 4];
        decompress(&c, &body(&[1, 6], 2), &mut out).unwrap();
        assert_eq!(out, [-1.0, 0.0, 0.0, 1.0]);
        let mut out = [0f32; 4];
        assert!(matches!(
            decompress(&c, &body(&[8], 1), &mut out),
            Err(WireError::IndexOutOfRange { index: 4, len: 4 })
        ));
        assert!(decompress(&c, &body(&[6, 2], 2), &mut out).is_err());
        assert!(decompress(&c, &body(&[2, 3], 2), &mut out).is_err());
        assert!(decompress(&c, &body(&[2], 2), &mut out).is_err());
        assert!(decompress(&c, &body(&[0, 2, 4, 6, 7], 5), &mut out).is_err());
        assert!(decompress(&c, &body(&[2], u32::MAX), &mut out).is_err());
        assert!(decompress(&c, &body(&[2], 0), &mut out).is_err()); // trailing bytes
    }

    #[test]
    fn random_and_mutated_payloads_never_panic() {
        fuzz_decoder(
            &CompressorConfig::Threshold(ThresholdConfig { tau: 0.8 }),
            5,
        );
    }

    #[test]
    fn segment_limit_is_31_bits_and_words_pack_index_and_sign() {
        let c = build(1.0);
        assert_eq!(c.max_segment_len(), 1 << 31);
        let mut words = Vec::new();
        collect_sign_words(&[0.0, -2.0, 1.0, -0.5, 3.0], 1.0, -1.0, &mut words);
        assert_eq!(words, [3, 4, 8]);
    }
}
