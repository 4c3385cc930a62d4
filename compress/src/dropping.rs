//! `gradient-dropping`: Aji & Heafield's gradient dropping (ALGORITHMS.md §8).
//!
//! Drop the fraction R of entries with the smallest magnitudes and send the rest:
//! ```text
//! thr  = the magnitude below which a fraction R of |p| lies (sampled or exact)
//! mask = |p| ≥ thr  and  p ≠ 0
//! send (idx, p[idx]) for mask                       (one_bit = false)
//! send idx, sign bits, μ+ and μ− of the survivors   (one_bit = true)
//! ```
//! The target count is `k = ⌈(1−R)·n⌉` (at least 1; computed with a 1e-9 slack so that
//! `R = 0.99, n = 1000` gives 10, not 11 from `1 − 0.99 > 0.01` in binary).
//!
//! **Threshold.** Exact (`exact = true` or `sample_fraction = 1`): `thr` is the k-th largest
//! magnitude, found with [`crate::select::top_k`]; the mask then holds k entries plus any
//! ties at `thr`. Sampled (default): `m = max(64, ⌈sample_fraction·n⌉)` positions are drawn
//! uniformly (with replacement) with the caller's [`Rng`], and `thr` is the `r`-th largest
//! sampled magnitude with `r = max(1, round(k/n·m))`. The count sent is then random with
//! relative spread about `1/√r`: at R = 0.99 the ±30 % band needs `m ≳ 10⁴` samples, i.e.
//! `n ≳ 10⁷` at the default fraction 0.001. When `m ≥ n` the exact threshold is used.
//! Exact zeros are never sent (`thr` is at least the smallest positive magnitude).
//!
//! **Scope.** `tensor` (default): one threshold per segment. `global`: one threshold over
//! the whole buffer, computed in [`Compressor::begin`] with `k = ⌈(1−R)·N⌉` for the whole
//! buffer. `begin` does not receive the caller's `Rng`, so a sampled global threshold draws
//! its positions from `Rng::for_step(GLOBAL_SAMPLE_SEED, step, rank, bucket)`, which is
//! still reproducible from the [`crate::Ctx`].
//!
//! **Bodies**, per segment:
//! ```text
//! one_bit = false: the crate::sparse body (u8 layout, u32 count, index list or bitmap,
//!                  count × f32 value) — 64·(1−R) bits/element when the list wins
//! one_bit = true:  f32 μ+ (≥ 0), f32 μ− (≤ 0), u32 count, count × u32 index (strictly
//!                  ascending), ⌈count/8⌉ bytes of sign bits (LSB-first, 1 = negative,
//!                  padding bits zero) — 96 + 32·count + 8·⌈count/8⌉ bits
//! ```
//! The one-bit body carries a count word the §8 formula `33(1−R) + 64/n` leaves out.
//! Sizes are data-dependent, so [`Compressor::segment_bits`] is `None`. Biased; the
//! registry pairs it with residual memory (the paper's local accumulation). Aggregation:
//! all-gather.

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, Ctx, MethodId, Touched};
use crate::error::{ConfigError, WireError};
use crate::memory::MemoryConfig;
use crate::registry::Method;
use crate::rng::Rng;
use crate::select::{abs_key, gather_at_least, top_k_abs, Scratch};
use crate::sparse;
use crate::wire::{u32_at, Reader, Writer};

/// Fewest positions a sampled threshold is estimated from.
pub const MIN_SAMPLES: usize = 64;
/// Seed of the sample positions of a sampled *global* threshold (see the module docs).
pub const GLOBAL_SAMPLE_SEED: u64 = 0x6472_6f70_7069_6e67;
/// Smallest threshold key: the key of the smallest positive magnitude, so zeros are
/// never sent.
const MIN_KEY: u32 = 2;

/// Where one threshold applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ThresholdScope {
    /// One threshold per segment (layer).
    #[default]
    Tensor,
    /// One threshold for the whole buffer.
    Global,
}

/// Configuration of [`GradientDropping`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GradientDroppingConfig {
    /// R in [0, 1): the fraction of entries dropped. Default 0.99 (the paper's).
    #[serde(default = "default_drop_ratio")]
    pub drop_ratio: f64,
    /// Fraction of positions sampled to estimate the threshold, in (0, 1]; 1 means exact.
    /// Default 0.001 (ALGORITHMS.md §8, unverified); at least 64 positions are sampled.
    #[serde(default = "default_sample_fraction")]
    pub sample_fraction: f64,
    /// Compute the exact threshold by selection instead of sampling. Default false.
    #[serde(default)]
    pub exact: bool,
    /// Threshold per segment (`"tensor"`, default) or over the whole buffer (`"global"`).
    #[serde(default)]
    pub scope: ThresholdScope,
    /// Send survivors as sign bits plus the two means μ+ and μ− instead of their values.
    /// Default false.
    #[serde(default)]
    pub one_bit: bool,
}

fn default_drop_ratio() -> f64 {
    0.99
}
fn default_sample_fraction() -> f64 {
    0.001
}

impl Default for GradientDroppingConfig {
    fn default() -> Self {
        GradientDroppingConfig {
            drop_ratio: default_drop_ratio(),
            sample_fraction: default_sample_fraction(),
            exact: false,
            scope: ThresholdScope::Tensor,
            one_bit: false,
        }
    }
}

impl Method for GradientDroppingConfig {
    const NAME: &'static str = "gradient-dropping";
    const ABOUT: &'static str = "Aji & Heafield gradient dropping: drop the drop_ratio smallest |p| (sampled or exact threshold, per tensor or global)";
    const ID: MethodId = MethodId(7);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()?))
    }

    fn default_memory(&self) -> MemoryConfig {
        MemoryConfig::RESIDUAL
    }
}

impl GradientDroppingConfig {
    /// Checks the parameters and builds the compressor.
    pub fn init(&self) -> Result<GradientDropping, ConfigError> {
        if !(self.drop_ratio >= 0.0 && self.drop_ratio < 1.0) {
            return Err(ConfigError::new(
                "drop_ratio",
                format!("must be in [0, 1), got {}", self.drop_ratio),
            ));
        }
        if !(self.sample_fraction > 0.0 && self.sample_fraction <= 1.0) {
            return Err(ConfigError::new(
                "sample_fraction",
                format!("must be in (0, 1], got {}", self.sample_fraction),
            ));
        }
        Ok(GradientDropping {
            keep: 1.0 - self.drop_ratio,
            sample_fraction: self.sample_fraction,
            exact: self.exact || self.sample_fraction >= 1.0,
            scope: self.scope,
            one_bit: self.one_bit,
            scratch: Scratch::default(),
            idx: Vec::new(),
            samples: Vec::new(),
            global_key: None,
        })
    }
}

/// Aji & Heafield's gradient dropping.
#[derive(Debug, Clone)]
pub struct GradientDropping {
    keep: f64,
    sample_fraction: f64,
    exact: bool,
    scope: ThresholdScope,
    one_bit: bool,
    scratch: Scratch,
    idx: Vec<u32>,
    samples: Vec<u32>,
    global_key: Option<u32>,
}

/// Target count `⌈keep·n⌉`, at least 1, at most `n` (0 for `n = 0`).
pub fn keep_count(n: usize, keep: f64) -> usize {
    if n == 0 {
        return 0;
    }
    ((keep * n as f64 - 1e-9).ceil() as usize).clamp(1, n)
}

impl GradientDropping {
    /// The magnitude key of the threshold for `x` (exact or sampled), at least the key of
    /// the smallest positive magnitude.
    fn threshold_key(&mut self, x: &[f32], rng: &mut Rng) -> u32 {
        let n = x.len();
        let k = keep_count(n, self.keep);
        let m = ((self.sample_fraction * n as f64).ceil() as usize).max(MIN_SAMPLES);
        let key = if self.exact || m >= n {
            top_k_abs(x, k, &mut self.scratch, &mut self.idx);
            self.idx
                .iter()
                .map(|&i| abs_key(x[i as usize]))
                .min()
                .unwrap_or(u32::MAX)
        } else {
            self.samples.clear();
            self.samples
                .extend((0..m).map(|_| abs_key(x[rng.below(n as u64) as usize])));
            let r = ((k as f64 / n as f64 * m as f64).round() as usize).clamp(1, m);
            let (_, &mut t, _) = self.samples.select_nth_unstable_by(r - 1, |a, b| b.cmp(a));
            t
        };
        key.max(MIN_KEY)
    }

    /// The threshold (as a magnitude) that the last [`Compressor::begin`] computed for a
    /// global scope; `None` for a per-tensor scope.
    pub fn global_threshold(&self) -> Option<f32> {
        self.global_key.map(|k| f32::from_bits(k - 1))
    }

    fn write_one_bit(&self, x: &[f32], w: &mut Writer<'_>) {
        let (mut sp, mut np, mut sn, mut nn) = (0f64, 0usize, 0f64, 0usize);
        for &i in &self.idx {
            let v = x[i as usize];
            if v < 0.0 {
                sn += v as f64;
                nn += 1;
            } else {
                sp += v as f64;
                np += 1;
            }
        }
        let mu_pos = if np > 0 { (sp / np as f64) as f32 } else { 0.0 };
        let mu_neg = if nn > 0 { (sn / nn as f64) as f32 } else { 0.0 };
        w.f32(mu_pos);
        w.f32(mu_neg);
        w.u32(self.idx.len() as u32);
        w.u32_slice(&self.idx);
        let signs = w.zeroed(self.idx.len().div_ceil(8));
        for (j, &i) in self.idx.iter().enumerate() {
            signs[j >> 3] |= ((x[i as usize] < 0.0) as u8) << (j & 7);
        }
    }

    /// A segment's body, in this configuration's layout, added into `out`; with `touched`,
    /// the elements it added to are marked there.
    fn read_body_add(
        &self,
        r: &mut Reader<'_>,
        out: &mut [f32],
        touched: Option<&mut Touched>,
    ) -> Result<(), WireError> {
        match (self.one_bit, touched) {
            (true, touched) => {
                Self::read_one_bit_add(r, out)?;
                if let Some(t) = touched {
                    t.mark_range(0..out.len());
                }
                Ok(())
            }
            (false, Some(t)) => sparse::read_indexed_add_touched(r, out, t),
            (false, None) => sparse::read_indexed_add(r, out),
        }
    }

    fn read_one_bit_add(r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let n = out.len();
        let mu_pos = r.finite_f32("dropping mean of positives")?;
        let mu_neg = r.finite_f32("dropping mean of negatives")?;
        if mu_pos < 0.0 || mu_neg > 0.0 {
            return Err(WireError::Invalid("dropping means have the wrong sign"));
        }
        let count = r.u32("dropping count")? as usize;
        if count > n {
            return Err(WireError::Invalid("more dropping survivors than elements"));
        }
        let idx = r.take_items(count, 4, "dropping indices")?;
        let signs = r.take(count.div_ceil(8), "dropping sign bits")?;
        if !count.is_multiple_of(8) && signs[signs.len() - 1] >> (count % 8) != 0 {
            return Err(WireError::Invalid("sign bits set past the last survivor"));
        }
        let mut next = 0usize;
        for j in 0..count {
            let i = u32_at(idx, j) as usize;
            if i >= n {
                return Err(WireError::IndexOutOfRange {
                    index: i as u64,
                    len: n,
                });
            }
            if i < next {
                return Err(WireError::Invalid(
                    "dropping indices not strictly ascending",
                ));
            }
            let negative = (signs[j >> 3] >> (j & 7)) & 1 != 0;
            out[i] += if negative { mu_neg } else { mu_pos };
            next = i + 1;
        }
        Ok(())
    }
}

impl Compressor for GradientDropping {
    fn method(&self) -> MethodId {
        GradientDroppingConfig::ID
    }
    fn ratio_metric(&self) -> Option<(&'static str, f64)> {
        Some(("density", self.keep))
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }
    fn begin(&mut self, grad: &[f32], ctx: &Ctx<'_>) {
        self.global_key = None;
        if self.scope == ThresholdScope::Global && !grad.is_empty() {
            let mut rng = Rng::for_step(GLOBAL_SAMPLE_SEED, ctx.step, ctx.rank as u64, ctx.bucket);
            self.global_key = Some(self.threshold_key(grad, &mut rng));
        }
    }
    fn encode_segment(&mut self, x: &[f32], rng: &mut Rng, w: &mut Writer<'_>) {
        // A global scope uses the key from `begin`; without one (a caller that skipped
        // `begin`) the segment gets its own threshold.
        let key = match self.global_key {
            Some(k) => k,
            None => self.threshold_key(x, rng),
        };
        gather_at_least(x, key, &mut self.idx);
        if self.one_bit {
            self.write_one_bit(x, w);
        } else {
            sparse::write_indexed(x.len(), &self.idx, |i| x[i as usize], w);
        }
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        self.read_body_add(r, out, None)
    }
    fn decode_segment_add_touched(
        &self,
        r: &mut Reader<'_>,
        out: &mut [f32],
        touched: &mut Touched,
    ) -> Result<(), WireError> {
        self.read_body_add(r, out, Some(touched))
    }
    fn segment_bits(&self, _n: usize) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, HEADER_BITS};
    use crate::threshold::test_support::*;
    use crate::CompressorConfig;

    fn cfg(
        drop_ratio: f64,
        exact: bool,
        scope: ThresholdScope,
        one_bit: bool,
    ) -> GradientDroppingConfig {
        GradientDroppingConfig {
            drop_ratio,
            exact,
            scope,
            one_bit,
            ..GradientDroppingConfig::default()
        }
    }

    /// Checks `dropped |p| < thr ≤ kept |p|` with `thr` the smallest kept magnitude, and
    /// returns the number kept.
    /// Positions of the non-zero entries of `v`.
    fn nonzero(v: &[f32]) -> Vec<u32> {
        (0..v.len() as u32)
            .filter(|&i| v[i as usize] != 0.0)
            .collect()
    }

    fn check_split(x: &[f32], out: &[f32]) -> usize {
        let kept_min = x
            .iter()
            .zip(out)
            .filter(|(_, &o)| o != 0.0)
            .map(|(v, _)| v.abs())
            .fold(f32::INFINITY, f32::min);
        let dropped_max = x
            .iter()
            .zip(out)
            .filter(|(_, &o)| o == 0.0)
            .map(|(v, _)| v.abs())
            .fold(0.0, f32::max);
        let kept = out.iter().filter(|&&o| o != 0.0).count();
        if kept > 0 && kept < x.len() {
            assert!(dropped_max < kept_min, "{dropped_max} !< {kept_min}");
        }
        kept
    }

    #[test]
    fn keep_count_rounds_up_without_binary_noise() {
        assert_eq!(keep_count(1000, 1.0 - 0.99), 10);
        assert_eq!(keep_count(1001, 1.0 - 0.99), 11);
        assert_eq!(keep_count(50, 1.0 - 0.99), 1);
        assert_eq!(keep_count(7, 1.0), 7);
        assert_eq!(keep_count(0, 0.5), 0);
        assert_eq!(keep_count(3, 0.5), 2);
    }

    #[test]
    fn exact_threshold_keeps_ceil_count_and_splits_by_magnitude() {
        let mut rng = Rng::seed_from_u64(1);
        for &n in &[1usize, 10, 99, 1000, 4097, 30_000] {
            for r in [0.0, 0.5, 0.9, 0.99, 0.999] {
                let x = gaussian(&mut rng, n, 1.0);
                let mut c = cfg(r, true, ThresholdScope::Tensor, false).init().unwrap();
                let (p, out) = round_trip(&mut c, &x, &[], &mut rng);
                let kept = check_split(&x, &out);
                assert_eq!(kept, keep_count(n, 1.0 - r), "n {n} R {r}");
                // Kept values are sent verbatim.
                for (&v, &o) in x.iter().zip(&out) {
                    assert!(o == 0.0 || o == v);
                }
                assert_eq!(
                    p.encoded_len() as u64 * 8,
                    HEADER_BITS + 8 * sparse::indexed_len(n, &nonzero(&out)) as u64
                );
            }
        }
    }

    #[test]
    fn exact_threshold_with_ties_keeps_all_ties_and_no_zeros() {
        let mut x: Vec<f32> = (0..1000).map(|i| ((i % 10) as f32) * 0.5).collect();
        x[3] = -4.5;
        let mut c = cfg(0.95, true, ThresholdScope::Tensor, false)
            .init()
            .unwrap();
        let (_, out) = round_trip(&mut c, &x, &[], &mut Rng::seed_from_u64(0));
        // k = 50 but 101 entries (i % 10 == 9, and i = 3) tie at the top magnitude 4.5:
        // all are kept, with their signs.
        assert_eq!(check_split(&x, &out), 101);
        assert_eq!(out[3], -4.5);
        let zeros = vec![0f32; 64];
        let (_, out) = round_trip(&mut c, &zeros, &[], &mut Rng::seed_from_u64(0));
        assert!(out.iter().all(|&v| v == 0.0));
        let mut c = cfg(0.5, true, ThresholdScope::Tensor, false)
            .init()
            .unwrap();
        let mut sparse_x = vec![0f32; 100];
        sparse_x[17] = -1.0;
        let (p, out) = round_trip(&mut c, &sparse_x, &[], &mut Rng::seed_from_u64(0));
        assert_eq!(out, sparse_x);
        assert_eq!(
            p.encoded_len() as u64 * 8,
            HEADER_BITS + 8 * sparse::indexed_len(100, &[17]) as u64
        );
    }

    /// 2% of 2^20 positions puts about 210 samples above the threshold (relative spread
    /// ≈ 7%), so ±30% is over 4 standard deviations. At the default fraction 0.001 the
    /// spread on 4M elements is about 15% (3 of 60 seeds fell outside ±30% in a trial).
    #[test]
    fn sampled_count_is_within_30_percent_of_target() {
        let mut rng = Rng::seed_from_u64(2);
        let n = 1 << 20;
        for seed in 0..4u64 {
            let x = if seed % 2 == 0 {
                gaussian(&mut rng, n, 1e-3)
            } else {
                heavy_tailed(&mut rng, n)
            };
            let c = GradientDroppingConfig {
                sample_fraction: 0.02,
                ..GradientDroppingConfig::default()
            };
            let mut c = c.init().unwrap();
            let (_, out) = round_trip(&mut c, &x, &[], &mut Rng::seed_from_u64(seed));
            let kept = check_split(&x, &out);
            let target = keep_count(n, 0.01) as f64;
            assert!(
                (kept as f64 - target).abs() <= 0.3 * target,
                "seed {seed}: kept {kept}, target {target}"
            );
        }
    }

    #[test]
    fn global_and_tensor_scopes_differ_on_segments_of_different_scales() {
        let mut rng = Rng::seed_from_u64(3);
        let mut x = gaussian(&mut rng, 5000, 1e-3);
        x.extend(gaussian(&mut rng, 15_000, 1.0));
        let segs = [0..5000, 5000..20_000];
        let mut t = cfg(0.9, true, ThresholdScope::Tensor, false)
            .init()
            .unwrap();
        let (_, out) = round_trip(&mut t, &x, &segs, &mut rng);
        assert_eq!(check_split(&x[..5000], &out[..5000]), 500);
        assert_eq!(check_split(&x[5000..], &out[5000..]), 1500);
        let mut g = cfg(0.9, true, ThresholdScope::Global, false)
            .init()
            .unwrap();
        let (_, out) = round_trip(&mut g, &x, &segs, &mut rng);
        assert_eq!(check_split(&x, &out), 2000);
        assert!(out[..5000].iter().all(|&v| v == 0.0));
        let thr = g.global_threshold().unwrap();
        let kept_min = x
            .iter()
            .zip(&out)
            .filter(|(_, &o)| o != 0.0)
            .map(|(v, _)| v.abs())
            .fold(f32::INFINITY, f32::min);
        assert_eq!(thr, kept_min);
        // Sampled global: one threshold, reproducible from the Ctx, still near the target.
        let mut s = GradientDroppingConfig {
            drop_ratio: 0.9,
            sample_fraction: 0.1,
            scope: ThresholdScope::Global,
            ..GradientDroppingConfig::default()
        }
        .init()
        .unwrap();
        let (a, out) = round_trip(&mut s, &x, &segs, &mut Rng::seed_from_u64(1));
        let (b, _) = round_trip(&mut s, &x, &segs, &mut Rng::seed_from_u64(2));
        assert_eq!(
            a, b,
            "global sampling depends on the Ctx, not the caller's Rng"
        );
        let kept = check_split(&x, &out);
        assert!(out[..5000].iter().all(|&v| v == 0.0));
        assert!((1400..=2600).contains(&kept), "kept {kept}");
    }

    #[test]
    fn one_bit_sends_signs_and_survivor_means() {
        let mut rng = Rng::seed_from_u64(4);
        for &n in &[1usize, 9, 1000, 12_345] {
            let x = gaussian(&mut rng, n, 1.0);
            let mut plain = cfg(0.9, true, ThresholdScope::Tensor, false)
                .init()
                .unwrap();
            let (_, kept_vals) = round_trip(&mut plain, &x, &[], &mut rng);
            let mut c = cfg(0.9, true, ThresholdScope::Tensor, true).init().unwrap();
            let (p, out) = round_trip(&mut c, &x, &[], &mut rng);
            let (mut sp, mut np, mut sn, mut nn) = (0f64, 0, 0f64, 0);
            for &v in &kept_vals {
                if v > 0.0 {
                    sp += v as f64;
                    np += 1;
                } else if v < 0.0 {
                    sn += v as f64;
                    nn += 1;
                }
            }
            for (&k, &o) in kept_vals.iter().zip(&out) {
                if k > 0.0 {
                    assert_eq!(o, (sp / np as f64) as f32);
                } else if k < 0.0 {
                    assert_eq!(o, (sn / nn as f64) as f32);
                } else {
                    assert_eq!(o, 0.0);
                }
            }
            let count = (np + nn) as u64;
            assert_eq!(
                p.encoded_len() as u64 * 8,
                HEADER_BITS + 96 + 32 * count + 8 * count.div_ceil(8)
            );
        }
    }

    #[test]
    fn ef_invariant_in_every_mode() {
        for one_bit in [false, true] {
            for exact in [false, true] {
                for scope in [ThresholdScope::Tensor, ThresholdScope::Global] {
                    let c = GradientDroppingConfig {
                        drop_ratio: 0.95,
                        sample_fraction: 0.05,
                        exact,
                        scope,
                        one_bit,
                    };
                    check_ef_invariant(&CompressorConfig::GradientDropping(c), 4000, 4, 5);
                }
            }
        }
    }

    #[test]
    fn config_is_validated() {
        for (r, f, field) in [
            (1.0, 0.001, "drop_ratio"),
            (-0.1, 0.001, "drop_ratio"),
            (f64::NAN, 0.001, "drop_ratio"),
            (0.99, 0.0, "sample_fraction"),
            (0.99, 1.5, "sample_fraction"),
            (0.99, f64::NAN, "sample_fraction"),
        ] {
            let e = GradientDroppingConfig {
                drop_ratio: r,
                sample_fraction: f,
                ..GradientDroppingConfig::default()
            }
            .init()
            .err()
            .unwrap();
            assert_eq!(e.field, field);
        }
        let cfg: CompressorConfig = toml::from_str(
            "kind = \"gradient-dropping\"\ndrop_ratio = 0.9\nscope = \"global\"\none_bit = true",
        )
        .unwrap();
        let CompressorConfig::GradientDropping(c) = cfg else {
            panic!("wrong variant")
        };
        assert_eq!(c.scope, ThresholdScope::Global);
        assert!(c.one_bit && c.drop_ratio == 0.9 && !c.exact);
        // sample_fraction = 1 means exact.
        let full = GradientDroppingConfig {
            sample_fraction: 1.0,
            ..GradientDroppingConfig::default()
        };
        let mut c = full.init().unwrap();
        let x = gaussian(&mut Rng::seed_from_u64(9), 10_000, 1.0);
        let p = compress_new(&mut c, &x, &Ctx::default(), &mut Rng::seed_from_u64(1)).unwrap();
        let mut out = vec![0f32; x.len()];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        assert_eq!(check_split(&x, &out), 100);
    }

    #[test]
    fn one_bit_decoder_rejects_malformed_bodies() {
        let c = cfg(0.5, true, ThresholdScope::Tensor, true).init().unwrap();
        let body = |mp: f32, mn: f32, idx: &[u32], signs: u8| {
            let mut b = vec![0xD7, 1, GradientDroppingConfig::ID.0, 0];
            b.extend(4u32.to_le_bytes());
            b.extend(1u32.to_le_bytes());
            b.extend(mp.to_le_bytes());
            b.extend(mn.to_le_bytes());
            b.extend((idx.len() as u32).to_le_bytes());
            for i in idx {
                b.extend(i.to_le_bytes());
            }
            b.push(signs);
            b
        };
        let mut out = [0f32; 4];
        decompress(&c, &body(2.0, -1.0, &[0, 3], 0b01), &mut out).unwrap();
        assert_eq!(out, [-1.0, 0.0, 0.0, 2.0]);
        for bad in [
            body(2.0, -1.0, &[0, 4], 0),
            body(2.0, -1.0, &[3, 0], 0),
            body(2.0, -1.0, &[1, 1], 0),
            body(2.0, -1.0, &[0, 3], 0b100),
            body(-2.0, -1.0, &[0, 3], 0),
            body(2.0, f32::NAN, &[0, 3], 0),
            body(2.0, -1.0, &[0, 1, 2, 3, 0], 0),
        ] {
            assert!(decompress(&c, &bad, &mut out).is_err());
        }
    }

    #[test]
    fn random_and_mutated_payloads_never_panic() {
        for one_bit in [false, true] {
            let c = GradientDroppingConfig {
                drop_ratio: 0.8,
                one_bit,
                ..GradientDroppingConfig::default()
            };
            fuzz_decoder(&CompressorConfig::GradientDropping(c), 6);
        }
    }
}
