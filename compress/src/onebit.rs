//! `onebit`: 1-bit quantization of Seide et al. with per-column means (ALGORITHMS.md §3).
//!
//! Each segment is viewed as columns of `c` contiguous elements (the last one may be
//! shorter; by default the whole segment is one column). Per column, with threshold 0:
//! ```text
//! μ+ = mean{p_j : p_j ≥ 0}   (−0.0 counts as ≥ 0; 0 if there is none)
//! μ− = mean{p_j : p_j < 0}   (0 if there is none)
//! q_j = μ+ if p_j ≥ 0 else μ−
//! ```
//! Means are accumulated in `f64` and sent as `f32`, so each column's sum is preserved up to
//! that one rounding. The quantizer is deterministic (it ignores the [`Rng`]) and biased:
//! the paper's error feedback is the separate [`crate::memory`] seam, and this method's
//! default memory is residual (`p = g + e` is what reaches the encoder).
//!
//! ## Body, per segment of `n` elements, `m = ⌈n/c⌉` columns
//! ```text
//! m × (f32 μ+, f32 μ−)    μ+ finite ≥ 0, μ− finite and < 0 or +0
//! ⌈n/8⌉ bytes             bit j = 1 iff p_j ≥ 0, LSB-first; unused bits of the last
//!                         byte are zero                         bits: n + 64m
//! ```
//! About `1 + 64/c` bits per element. Aggregation: all-gather (the means differ between
//! workers).

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, Ctx, FirstNonFinite, MethodId};
use crate::error::{ConfigError, WireError};
use crate::exact::{ExactSum, Sum};
use crate::memory::MemoryConfig;
use crate::registry::Method;
use crate::rng::Rng;
use crate::simd::vector_dispatch;
use crate::wire::{f32_at, Reader, Writer};

/// Configuration of [`OneBit`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OneBitConfig {
    /// Column length `c` ≥ 1 (elements sharing one pair of means). Absent (the default):
    /// each segment is a single column.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub column: Option<usize>,
    /// How the column sums are accumulated: `f64` (the default: an `f64` loop) or `exact`
    /// (exactly, in any order, rounded once: [`ExactSum`] — the mode a device codec computes
    /// identically).
    #[serde(default, skip_serializing_if = "Sum::is_f64")]
    pub sum: Sum,
}

impl Method for OneBitConfig {
    const NAME: &'static str = "onebit";
    const ABOUT: &'static str =
        "1-bit SGD: sign bit + per-column means (1 + 64/c bits/element), error feedback";
    const ID: MethodId = MethodId(10);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()?))
    }

    fn default_memory(&self) -> MemoryConfig {
        MemoryConfig::RESIDUAL
    }
}

impl OneBitConfig {
    /// Checks the parameters and builds the compressor.
    pub fn init(&self) -> Result<OneBit, ConfigError> {
        if let Some(c) = self.column {
            if c == 0 || c > u32::MAX as usize {
                return Err(ConfigError::new(
                    "column",
                    format!("must be in 1..=2^32-1, got {c}"),
                ));
            }
        }
        Ok(OneBit {
            column: self.column,
            sum: self.sum,
            non_finite: FirstNonFinite::default(),
        })
    }
}

/// 1-bit quantizer with per-column reconstruction means.
#[derive(Debug, Clone)]
pub struct OneBit {
    column: Option<usize>,
    sum: Sum,
    non_finite: FirstNonFinite,
}

impl OneBit {
    /// The column length used for a segment of `n` elements.
    fn col(&self, n: usize) -> usize {
        self.column.unwrap_or(n).clamp(1, n.max(1))
    }
}

vector_dispatch! {
    /// `(μ+, μ−)` of one column, accumulated in `f64`; `None` when the column holds a NaN
    /// or an infinity (a sum of finite `f32` values cannot overflow `f64`, and a NaN or ±∞
    /// makes one of the two sums non-finite).
    fn column_means(x: &[f32]) -> Option<(f32, f32)> = column_means_lanes;
}

#[inline(always)]
fn column_means_lanes(x: &[f32]) -> Option<(f32, f32)> {
    let mut sp = [0f64; 8];
    let mut sn = [0f64; 8];
    let mut np = [0u32; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for k in 0..8 {
            let v = c[k];
            let pos = v >= 0.0;
            let d = v as f64;
            sp[k] += if pos { d } else { 0.0 };
            sn[k] += if pos { 0.0 } else { d };
            np[k] += pos as u32;
        }
    }
    let (mut pos_sum, mut neg_sum, mut pos_n) = (0f64, 0f64, 0usize);
    for k in 0..8 {
        pos_sum += sp[k];
        neg_sum += sn[k];
        pos_n += np[k] as usize;
    }
    for &v in it.remainder() {
        if v >= 0.0 {
            pos_sum += v as f64;
            pos_n += 1;
        } else {
            neg_sum += v as f64;
        }
    }
    if !(pos_sum.is_finite() && neg_sum.is_finite()) {
        return None;
    }
    let neg_n = x.len() - pos_n;
    let mp = if pos_n > 0 {
        (pos_sum / pos_n as f64) as f32
    } else {
        0.0
    };
    let mn = if neg_n > 0 {
        (neg_sum / neg_n as f64) as f32
    } else {
        0.0
    };
    Some((mp, mn))
}

/// [`column_means`] from exact sums ([`Sum::Exact`]): `μ+ = (Σ_{p ≥ 0} p) / n+` and
/// `μ− = −(Σ_{p < 0} |p|) / n−`, each sum exact and rounded once to `f64` (rounding is
/// symmetric, so the negative mean is the same as from a negative sum).
fn column_means_exact(x: &[f32]) -> Option<(f32, f32)> {
    if x.iter().any(|v| !v.is_finite()) {
        return None;
    }
    let (mut pos, mut neg, mut pos_n) = (ExactSum::default(), ExactSum::default(), 0usize);
    for &v in x {
        if v >= 0.0 {
            pos.add_abs(v);
            pos_n += 1;
        } else {
            neg.add_abs(v);
        }
    }
    Some(means_from_sums(&pos, pos_n, &neg, x.len() - pos_n))
}

/// `(μ+, μ−)` from the exact sums of a column's non-negative values (`pos_n` of them) and of
/// its negative values' magnitudes (`neg_n`); 0 for an empty side.
pub fn means_from_sums(pos: &ExactSum, pos_n: usize, neg: &ExactSum, neg_n: usize) -> (f32, f32) {
    let mean = |s: &ExactSum, k: usize| match k {
        0 => 0.0,
        _ => (s.to_f64() / k as f64) as f32,
    };
    (mean(pos, pos_n), -mean(neg, neg_n) + 0.0)
}

vector_dispatch! {
    /// The sign bits of `x` into `bits` (`⌈len/8⌉` bytes, LSB first).
    fn sign_bits(x: &[f32], bits: &mut [u8]) = sign_bits_lanes;
}

#[inline(always)]
fn sign_bits_lanes(x: &[f32], bits: &mut [u8]) {
    for (o, c) in bits.iter_mut().zip(x.chunks(8)) {
        let mut b = 0u8;
        for (k, &v) in c.iter().enumerate() {
            b |= ((v >= 0.0) as u8) << k;
        }
        *o = b;
    }
}

/// Reads one segment body of `n` elements in `m` columns: the means' bytes (`8m`, checked
/// by [`mean_pair`]) and the sign bytes (padding checked). Public, with [`mean_pair`], for
/// decoders that add the values elsewhere (the device codec of `dtrain-device`).
pub fn read_segment<'a>(
    r: &mut Reader<'a>,
    n: usize,
    m: usize,
) -> Result<(&'a [u8], &'a [u8]), WireError> {
    let means = r.take_items(m, 8, "onebit means")?;
    let bits = r.take(n.div_ceil(8), "onebit bits")?;
    if !n.is_multiple_of(8) && bits[bits.len() - 1] >> (n % 8) != 0 {
        return Err(WireError::Invalid("onebit padding bits are not zero"));
    }
    Ok((means, bits))
}

/// Column `j`'s `(μ+, μ−)` from the means' bytes, checked: `μ+` finite and `≥ +0`, `μ−`
/// finite and negative or `+0`.
pub fn mean_pair(means: &[u8], j: usize) -> Result<(f32, f32), WireError> {
    let mp = f32_at(means, 2 * j);
    let mn = f32_at(means, 2 * j + 1);
    if !(mp.is_finite() && mp.is_sign_positive()) {
        return Err(WireError::Invalid("onebit μ+ is negative or not finite"));
    }
    if !(mn.is_finite() && (mn < 0.0 || mn.to_bits() == 0)) {
        return Err(WireError::Invalid("onebit μ− is not negative (or +0)"));
    }
    Ok((mp, mn))
}

impl Compressor for OneBit {
    fn method(&self) -> MethodId {
        OneBitConfig::ID
    }
    /// A deterministic sign quantizer: its owners re-encode without a residual (see
    /// [`Compressor::owner_error_feedback`]).
    fn owner_error_feedback(&self) -> bool {
        false
    }

    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }
    fn begin(&mut self, _grad: &[f32], _ctx: &Ctx<'_>) {
        self.non_finite.reset();
    }
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        let n = x.len();
        let at = self.non_finite.segment(n);
        let c = self.col(n);
        let m = n.div_ceil(c);
        let body = w.zeroed(8 * m + n.div_ceil(8));
        let (means, bits) = body.split_at_mut(8 * m);
        for (j, (col, o)) in x.chunks(c).zip(means.chunks_exact_mut(8)).enumerate() {
            let means = match self.sum {
                Sum::F64 => column_means(col),
                Sum::Exact => column_means_exact(col),
            };
            let (mp, mn) = match means {
                Some(means) => means,
                None => {
                    let bad = col.iter().position(|v| !v.is_finite());
                    self.non_finite.note(at, bad.map(|i| (j * c + i, col[i])));
                    (0.0, 0.0)
                }
            };
            o[..4].copy_from_slice(&mp.to_le_bytes());
            o[4..].copy_from_slice(&mn.to_le_bytes());
        }
        sign_bits(x, bits);
    }
    /// The column sums are non-finite exactly when the input is (a sum of finite `f32`
    /// values cannot overflow `f64`).
    fn finds_non_finite(&self) -> bool {
        true
    }
    fn take_non_finite(&mut self) -> Option<(usize, f32)> {
        self.non_finite.take()
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let n = out.len();
        let c = self.col(n);
        let m = n.div_ceil(c);
        let (means, bits) = read_segment(r, n, m)?;
        for (j, o) in out.chunks_mut(c).enumerate() {
            let (mp, mn) = mean_pair(means, j)?;
            let table = [mn, mp];
            let start = j * c;
            if start.is_multiple_of(8) {
                // Whole bytes at a time.
                let bytes = &bits[start / 8..];
                let full = o.len() / 8;
                let mut it = o.chunks_exact_mut(8);
                for (oc, &b) in (&mut it).zip(bytes) {
                    for (k, o) in oc.iter_mut().enumerate() {
                        *o += table[((b >> k) & 1) as usize];
                    }
                }
                let rest = it.into_remainder();
                if !rest.is_empty() {
                    let b = bytes[full];
                    for (k, o) in rest.iter_mut().enumerate() {
                        *o += table[((b >> k) & 1) as usize];
                    }
                }
            } else {
                for (k, o) in o.iter_mut().enumerate() {
                    let i = start + k;
                    *o += table[((bits[i / 8] >> (i % 8)) & 1) as usize];
                }
            }
        }
        Ok(())
    }
    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(n as u64 + 64 * n.div_ceil(self.col(n)) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, payload_bits, Ctx, Payload};
    use crate::memory::MemoryConfig;
    use crate::pipeline::Pipeline;
    use crate::test_util::{fuzz_decoder, test_vector};
    use crate::CompressorConfig;

    fn onebit(column: Option<usize>) -> OneBit {
        OneBitConfig {
            column,
            ..OneBitConfig::default()
        }
        .init()
        .unwrap()
    }

    fn round_trip(c: &mut OneBit, x: &[f32]) -> (Payload, Vec<f32>) {
        let p = compress_new(c, x, &Ctx::default(), &mut Rng::seed_from_u64(0)).unwrap();
        let mut q = vec![0f32; x.len()];
        decompress(c, p.as_bytes(), &mut q).unwrap();
        (p, q)
    }

    /// `sum = "exact"`: the means are the exactly summed ones — within an ulp of the f64
    /// loop's, the same whatever the order — in every column layout.
    #[test]
    fn exact_sums_give_the_exact_means() {
        let mut rng = Rng::seed_from_u64(8);
        let x: Vec<f32> = (0..3000)
            .map(|i| (rng.next_f32() - 0.5) * 10f32.powi((i % 17) - 8))
            .collect();
        for column in COLUMNS {
            let mut exact = OneBitConfig {
                column,
                sum: Sum::Exact,
            }
            .init()
            .unwrap();
            let (p, _) = round_trip(&mut exact, &x);
            let (q, _) = round_trip(&mut onebit(column), &x);
            let c = exact.col(x.len());
            for (j, col) in x.chunks(c).enumerate() {
                let (mut pos, mut neg) = (ExactSum::default(), ExactSum::default());
                let pos_n = col.iter().filter(|v| **v >= 0.0).count();
                for &v in col {
                    if v >= 0.0 {
                        pos.add_abs(v)
                    } else {
                        neg.add_abs(v)
                    }
                }
                let want = means_from_sums(&pos, pos_n, &neg, col.len() - pos_n);
                let got = (
                    f32_at(&p.as_bytes()[12..], 2 * j),
                    f32_at(&p.as_bytes()[12..], 2 * j + 1),
                );
                assert_eq!(
                    (got.0.to_bits(), got.1.to_bits()),
                    (want.0.to_bits(), want.1.to_bits())
                );
                let loose = (
                    f32_at(&q.as_bytes()[12..], 2 * j),
                    f32_at(&q.as_bytes()[12..], 2 * j + 1),
                );
                assert!(
                    got.0.to_bits().abs_diff(loose.0.to_bits()) <= 1,
                    "{got:?} {loose:?}"
                );
                assert!(
                    got.1.to_bits().abs_diff(loose.1.to_bits()) <= 1,
                    "{got:?} {loose:?}"
                );
            }
        }
    }

    const COLUMNS: [Option<usize>; 6] = [None, Some(1), Some(7), Some(64), Some(100), Some(5000)];

    #[test]
    fn every_vector_tier_computes_the_same_bits() {
        use crate::simd::assert_same_on_every_tier as same;
        let mut rng = Rng::seed_from_u64(12);
        for n in [0usize, 1, 7, 8, 9, 63, 64, 65, 1000, 4099] {
            let mut x: Vec<f32> = (0..n).map(|_| rng.next_f32() - 0.5).collect();
            for (i, v) in [(2, -0.0), (4, 0.0), (5, f32::from_bits(0x8000_0001))] {
                if i < n {
                    x[i] = v;
                }
            }
            same("column means", || {
                column_means(&x).map(|(p, q)| (p.to_bits(), q.to_bits()))
            });
            same("sign bits", || {
                let mut bits = vec![0u8; n.div_ceil(8)];
                sign_bits(&x, &mut bits);
                bits
            });
        }
    }

    #[test]
    fn onebit_preserves_every_column_sum() {
        let mut x = test_vector(1000, 3.0, 1);
        x[5] = 0.25; // make some columns lopsided
        x[6] = -0.0;
        for col in COLUMNS {
            let mut c = onebit(col);
            let (_, q) = round_trip(&mut c, &x);
            let cl = col.unwrap_or(x.len()).min(x.len());
            for (xc, qc) in x.chunks(cl).zip(q.chunks(cl)) {
                let sx: f64 = xc.iter().map(|&v| v as f64).sum();
                let sq: f64 = qc.iter().map(|&v| v as f64).sum();
                let l1: f64 = xc.iter().map(|&v| (v as f64).abs()).sum();
                // Only the f32 rounding of the two means: ≤ 2⁻²⁴ of each group's |sum|.
                assert!(
                    (sx - sq).abs() <= l1 * 2f64.powi(-23),
                    "column {col:?}: {sx} vs {sq}"
                );
            }
        }
    }

    #[test]
    fn onebit_column_has_two_values_mu_plus_nonnegative_mu_minus_negative() {
        let mut x = test_vector(999, 1.0, 2);
        x[10] = -0.0; // counts as non-negative
        x[11] = 0.0;
        for col in COLUMNS {
            let mut c = onebit(col);
            let (_, q) = round_trip(&mut c, &x);
            let cl = col.unwrap_or(x.len()).min(x.len());
            for (xc, qc) in x.chunks(cl).zip(q.chunks(cl)) {
                let mut pos = None;
                let mut neg = None;
                for (&v, &t) in xc.iter().zip(qc) {
                    let slot = if v >= 0.0 { &mut pos } else { &mut neg };
                    match *slot {
                        None => *slot = Some(t),
                        Some(u) => assert_eq!(u.to_bits(), t.to_bits(), "one value per sign"),
                    }
                }
                if let Some(mp) = pos {
                    assert!(mp >= 0.0);
                    let want = xc
                        .iter()
                        .filter(|v| **v >= 0.0)
                        .map(|&v| v as f64)
                        .sum::<f64>()
                        / xc.iter().filter(|v| **v >= 0.0).count() as f64;
                    assert_eq!(mp, want as f32);
                }
                if let Some(mn) = neg {
                    assert!(mn < 0.0);
                }
            }
        }
        let (_, q) = round_trip(&mut onebit(None), &[-0.0, -2.0, 4.0]);
        assert_eq!(q, [2.0, -2.0, 2.0], "−0.0 joins the non-negative group");
    }

    #[test]
    fn onebit_payload_size_matches_formula() {
        for col in COLUMNS {
            let mut c = onebit(col);
            for n in [1usize, 7, 8, 9, 64, 100, 1001] {
                let x = test_vector(n, 1.0, n as u64);
                let (p, _) = round_trip(&mut c, &x);
                let cl = col.unwrap_or(n).min(n);
                let bits = n as u64 + 64 * n.div_ceil(cl) as u64;
                assert_eq!(c.segment_bits(n), Some(bits));
                assert_eq!(8 * p.encoded_len() as u64, 96 + bits.div_ceil(8) * 8);
                assert_eq!(payload_bits(&c, &[n]), Some(8 * p.encoded_len() as u64));
            }
        }
        let mut c = onebit(Some(64));
        let x = test_vector(300, 1.0, 3);
        let segs = [0..100, 100..300];
        let ctx = Ctx {
            segments: &segs,
            ..Ctx::default()
        };
        let p = compress_new(&mut c, &x, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        assert_eq!(
            payload_bits(&c, &[100, 200]),
            Some(8 * p.encoded_len() as u64)
        );
    }

    #[test]
    fn onebit_is_deterministic() {
        let x = test_vector(777, 1.0, 4);
        let mut c = onebit(Some(64));
        let a = compress_new(&mut c, &x, &Ctx::default(), &mut Rng::seed_from_u64(1)).unwrap();
        let b = compress_new(&mut c, &x, &Ctx::default(), &mut Rng::seed_from_u64(2)).unwrap();
        assert_eq!(a, b);
    }

    fn pipeline(column: Option<usize>) -> Pipeline {
        let cfg = CompressorConfig::OneBit(OneBitConfig {
            column,
            ..OneBitConfig::default()
        });
        assert_eq!(cfg.default_memory(), MemoryConfig::RESIDUAL);
        Pipeline::new(cfg.build().unwrap(), cfg.default_memory().build().unwrap())
    }

    #[test]
    fn onebit_error_feedback_invariant_through_pipeline() {
        let n = 600;
        let segs = [0..250, 250..600];
        let mut pipe = pipeline(Some(50));
        let mut payload = Payload::new();
        let mut e_old = vec![0f32; n];
        for step in 0..6u64 {
            let g = test_vector(n, 1.0 + step as f32, 30 + step);
            let ctx = Ctx {
                step,
                bucket: 4,
                segments: &segs,
                ..Ctx::default()
            };
            pipe.compress(&g, &ctx, &mut Rng::seed_from_u64(step), &mut payload)
                .unwrap();
            let mut d = vec![0f32; n];
            pipe.decompress_add(payload.as_bytes(), &mut d).unwrap();
            let e_new = pipe.memory().export().remove(&4).unwrap();
            for i in 0..n {
                let lhs = d[i] as f64 + e_new[i] as f64;
                let rhs = g[i] as f64 + e_old[i] as f64;
                let tol = 2.0 * f32::EPSILON as f64 * (rhs.abs() + (d[i] as f64).abs() + 1e-30);
                assert!(
                    (lhs - rhs).abs() <= tol,
                    "step {step} i {i}: {lhs} vs {rhs}"
                );
            }
            e_old = e_new;
        }
    }

    #[test]
    fn onebit_constant_gradient_with_error_feedback_transmits_the_mean() {
        let n = 256;
        let g = test_vector(n, 1.0, 9);
        let gmax = g.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        let mut pipe = pipeline(Some(64));
        let mut payload = Payload::new();
        let t_steps = 2000;
        let mut sum = vec![0f64; n];
        let mut worst_e = 0f64;
        let mut worst_first_half = 0f64;
        let mut q = vec![0f32; n];
        for step in 0..t_steps {
            let ctx = Ctx {
                step,
                ..Ctx::default()
            };
            pipe.compress(&g, &ctx, &mut Rng::seed_from_u64(0), &mut payload)
                .unwrap();
            q.fill(0.0);
            pipe.decompress_add(payload.as_bytes(), &mut q).unwrap();
            for (s, &v) in sum.iter_mut().zip(&q) {
                *s += v as f64;
            }
            let e = pipe.memory().export().remove(&0).unwrap();
            let norm = e.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
            worst_e = worst_e.max(norm);
            if step < t_steps / 2 {
                worst_first_half = worst_e;
            }
        }
        // ‖e_t‖ stays bounded (a 1/c-contraction with EF): far below the T·‖g‖ it would
        // reach if the error accumulated.
        let gnorm = g.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        assert!(
            worst_e <= 10.0 * gnorm,
            "‖e‖ reached {worst_e} (‖g‖ = {gnorm})"
        );
        assert!(
            worst_e <= 1.05 * worst_first_half,
            "‖e‖ still growing: {worst_first_half} in the first half, {worst_e} overall"
        );
        // Σ q_t = T·g − e_T, so the mean is within ‖e‖∞/T of g.
        let mut worst_mean_err = 0f64;
        for (i, (&s, &gi)) in sum.iter().zip(&g).enumerate() {
            let mean = s / t_steps as f64;
            worst_mean_err = worst_mean_err.max((mean - gi as f64).abs());
            assert!(
                (mean - gi as f64).abs() <= worst_e / t_steps as f64 + 1e-4 * gmax,
                "coord {i}: mean {mean} vs g {gi}"
            );
        }
        assert!(worst_mean_err <= 0.02 * gmax, "mean error {worst_mean_err}");
    }

    #[test]
    fn onebit_decoder_rejects_bad_means_and_padding() {
        let x = test_vector(12, 1.0, 5);
        let mut c = onebit(Some(8));
        let (p, _) = round_trip(&mut c, &x);
        let base = p.into_bytes();
        let mut out = vec![0f32; 12];
        assert!(decompress(&c, &base, &mut out).is_ok());
        for (at, v) in [
            (12, f32::NAN),
            (12, -1.0),
            (12, -0.0),
            (16, 1.0),
            (16, -0.0),
            (20, f32::INFINITY),
        ] {
            let mut bad = base.clone();
            bad[at..at + 4].copy_from_slice(&v.to_le_bytes());
            assert!(
                decompress(&c, &bad, &mut out).is_err(),
                "offset {at} value {v}"
            );
        }
        let mut bad = base.clone();
        *bad.last_mut().unwrap() |= 0x80; // 12 bits: bits 12..16 are padding
        assert!(decompress(&c, &bad, &mut out).is_err());
    }

    #[test]
    fn onebit_decoders_never_panic() {
        for col in [None, Some(3), Some(8)] {
            let mut c = onebit(col);
            let mut valid = Vec::new();
            for n in [1usize, 7, 8, 30, 131] {
                let x = test_vector(n, 1.0, n as u64);
                let segs = [0..n / 2, n / 2..n];
                let ctx = Ctx {
                    segments: if n > 1 { &segs } else { &[] },
                    ..Ctx::default()
                };
                let p = compress_new(&mut c, &x, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
                valid.push((p.into_bytes(), n));
            }
            fuzz_decoder(&c, &valid, 3000, 23);
        }
    }

    #[test]
    fn onebit_config_parses_and_validates() {
        let cfg: CompressorConfig = toml::from_str("kind = \"onebit\"\ncolumn = 64").unwrap();
        assert_eq!(
            cfg,
            CompressorConfig::OneBit(OneBitConfig {
                column: Some(64),
                ..OneBitConfig::default()
            })
        );
        let text = toml::to_string(&cfg).unwrap();
        assert_eq!(toml::from_str::<CompressorConfig>(&text).unwrap(), cfg);
        let bad: CompressorConfig = toml::from_str("kind = \"onebit\"\ncolumn = 0").unwrap();
        assert_eq!(bad.build().err().unwrap().field, "column");
    }
}
