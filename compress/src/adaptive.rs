//! `adaptive-threshold`: Dryden et al.'s adaptive quantizer, 2016 variant (ALGORITHMS.md §7.2).
//!
//! Per segment of `n` elements, with proportion π (keep one entry in π of each sign):
//! ```text
//! P+ = {p_j ≥ 0}  (−0.0 counts here),  P− = {p_j < 0}
//! k+ = ⌊|P+|/π⌋,  k− = ⌊|P−|/π⌋
//! S+ = the k+ largest entries of P+,  S− = the k− largest-magnitude entries of P−
//!      (exact selection, ties → smaller index)
//! μ+ = mean(S+), μ− = mean(S−)     (f64 accumulation; 0 for an empty set)
//! send j ∈ S+ ∪ S− as (j, sign), reconstruct μ+ / μ−
//! ```
//! With `sampled = true` (LBANN's fast path) the two thresholds come from 1024 positions
//! drawn with the caller's [`Rng`]: τ± is the `⌈m±/π⌉`-th largest magnitude among the `m±`
//! samples of that sign, and every entry of that sign at or beyond τ± is sent. If that
//! set would exceed 4× the ideal count (`MAX_QUANTIZED_EXCESS`), or no sample had that
//! sign while `k± > 0`, that sign falls back to the exact selection. Segments of at most
//! 1024 elements always use the exact path. With ≈ 512 samples per sign and π = 100 the
//! sampled threshold rests on about 6 samples, so the sampled count is noisy (±40 %; 0.70×
//! the ideal count on one 4M-element Gaussian); only the 4× cap is guaranteed.
//!
//! The exact selection costs about one pass: a branch-free magnitude pass gathers the
//! candidates at or beyond thresholds estimated from a strided sample, the few candidates
//! are split by sign, and [`crate::select::top_k`] runs on each sign's candidates (the
//! whole sign is regathered if an estimate was too high).
//!
//! Body, per segment:
//! ```text
//! f32 μ+ (≥ 0), f32 μ− (≤ 0)
//! sign-word body (see crate::threshold): u32 count, count × u32 (index << 1) | sign
//! ```
//! Bits per segment: `96 + 32·count`, i.e. about `32/π + 96/n` bits per element; the count
//! depends on the signs of the data, so [`Compressor::segment_bits`] is `None`. Segments
//! are limited to `2^31` elements (31-bit indices).
//!
//! Deviation from LBANN: the means are exact over the sent sets (LBANN estimates them from
//! 128 samples). Biased; the registry pairs it with residual memory. Aggregation:
//! all-gather.

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::{ConfigError, WireError};
use crate::memory::MemoryConfig;
use crate::registry::Method;
use crate::rng::Rng;
use crate::select::{abs_key, gather_at_least, top_k, Scratch};
use crate::threshold::{read_sign_words_add, write_sign_words, MAX_SIGN_WORD_SEGMENT};
use crate::wire::{Reader, Writer};

/// Positions sampled to estimate the thresholds (LBANN's `NUM_THRESHOLD_SAMPLES`).
pub const THRESHOLD_SAMPLES: usize = 1024;
/// A sampled selection may send at most this many times the ideal count per sign
/// (LBANN's `MAX_QUANTIZED_EXCESS`); beyond it the exact selection is used.
pub const MAX_EXCESS: usize = 4;

/// Configuration of [`AdaptiveThreshold`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveThresholdConfig {
    /// π ≥ 1: keep one entry in every π of each sign. Default 100 (our choice; the paper's
    /// value is unknown, ALGORITHMS.md §7.3), i.e. ≈ 0.32 bits per element.
    #[serde(default = "default_proportion")]
    pub proportion: u32,
    /// Estimate the thresholds from 1024 random samples instead of exact selection.
    /// Default false (exact).
    #[serde(default)]
    pub sampled: bool,
}

fn default_proportion() -> u32 {
    100
}

impl Default for AdaptiveThresholdConfig {
    fn default() -> Self {
        AdaptiveThresholdConfig {
            proportion: default_proportion(),
            sampled: false,
        }
    }
}

impl Method for AdaptiveThresholdConfig {
    const NAME: &'static str = "adaptive-threshold";
    const ABOUT: &'static str = "Dryden's adaptive threshold: top 1/proportion of each sign, sent as sign words, reconstructed as per-sign means";
    const ID: MethodId = MethodId(6);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()?))
    }

    fn default_memory(&self) -> MemoryConfig {
        MemoryConfig::RESIDUAL
    }
}

impl AdaptiveThresholdConfig {
    /// Checks the parameters and builds the compressor.
    pub fn init(&self) -> Result<AdaptiveThreshold, ConfigError> {
        if self.proportion == 0 {
            return Err(ConfigError::new("proportion", "must be >= 1, got 0"));
        }
        Ok(AdaptiveThreshold {
            proportion: self.proportion as usize,
            sampled: self.sampled,
            scratch: Scratch::default(),
            pos: Vec::new(),
            neg: Vec::new(),
            cand: Vec::new(),
            words: Vec::new(),
            spos: Vec::new(),
            sneg: Vec::new(),
        })
    }
}

/// Dryden's adaptive-threshold quantizer (2016 variant).
#[derive(Debug, Clone)]
pub struct AdaptiveThreshold {
    proportion: usize,
    sampled: bool,
    scratch: Scratch,
    pos: Vec<u32>,
    neg: Vec<u32>,
    cand: Vec<u32>,
    words: Vec<u32>,
    spos: Vec<u32>,
    sneg: Vec<u32>,
}

/// Magnitude key of `v` and whether it belongs to P− (`v < 0`; −0.0 belongs to P+).
#[inline(always)]
fn signed_key(v: f32) -> (u32, bool) {
    let bits = v.to_bits();
    let mag = bits & 0x7FFF_FFFF;
    (mag + 1, (bits >> 31 != 0) & (mag != 0))
}

/// The ascending indices of the entries of P+ with key ≥ `tp` into `pos` and of P− with
/// key ≥ `tn` into `neg` (both cleared first). `u32::MAX` selects none of that sign, 1
/// selects all of it. One branch-free magnitude pass gathers the candidates at or beyond
/// the lower threshold into `cand`; the (few) candidates are then split by sign.
fn gather_by_sign(
    x: &[f32],
    tp: u32,
    tn: u32,
    pos: &mut Vec<u32>,
    neg: &mut Vec<u32>,
    cand: &mut Vec<u32>,
) {
    gather_at_least(x, tp.min(tn), cand);
    pos.clear();
    neg.clear();
    for &i in cand.iter() {
        let (key, is_neg) = signed_key(x[i as usize]);
        if is_neg {
            if key >= tn {
                neg.push(i);
            }
        } else if key >= tp {
            pos.push(i);
        }
    }
}

/// Threshold key from the samples of one sign: the `r`-th largest. `None` when there are
/// fewer than `r` samples.
fn kth_sample(samples: &mut [u32], r: usize) -> Option<u32> {
    if r == 0 || r > samples.len() {
        return None;
    }
    let (_, &mut t, _) = samples.select_nth_unstable_by(r - 1, |a, b| b.cmp(a));
    Some(t)
}

/// Mean of `x` over `idx` in f64, 0 for an empty set.
fn mean_of(x: &[f32], idx: &[u32]) -> f32 {
    if idx.is_empty() {
        return 0.0;
    }
    let s: f64 = idx.iter().map(|&i| x[i as usize] as f64).sum();
    (s / idx.len() as f64) as f32
}

/// Merges two ascending index lists into ascending sign words (`neg` gets sign 1).
fn merge_words(pos: &[u32], neg: &[u32], words: &mut Vec<u32>) {
    words.clear();
    words.reserve(pos.len() + neg.len());
    let (mut a, mut b) = (0, 0);
    while a < pos.len() && b < neg.len() {
        if pos[a] < neg[b] {
            words.push(pos[a] << 1);
            a += 1;
        } else {
            words.push((neg[b] << 1) | 1);
            b += 1;
        }
    }
    words.extend(pos[a..].iter().map(|&i| i << 1));
    words.extend(neg[b..].iter().map(|&i| (i << 1) | 1));
}

/// Positions of the strided sample that steers the exact selection (no randomness).
const EXACT_SAMPLE: usize = 2048;

impl AdaptiveThreshold {
    /// The proportion π.
    pub fn proportion(&self) -> usize {
        self.proportion
    }

    /// Reduces the candidate set `cand` (ascending, a superset of one sign's top `k`: every
    /// entry of that sign outside it is strictly smaller than every entry in it) to exactly
    /// the top `k`, ties → smaller index.
    fn reduce(x: &[f32], cand: &mut Vec<u32>, k: usize, scratch: &mut Scratch, tmp: &mut Vec<u32>) {
        if cand.len() <= k {
            return;
        }
        top_k(
            cand.len(),
            k,
            |j| abs_key(x[cand[j] as usize]),
            scratch,
            tmp,
        );
        for t in tmp.iter_mut() {
            *t = cand[*t as usize];
        }
        std::mem::swap(cand, tmp);
    }

    /// Candidate threshold keys for the exact selection: from a strided sample, aimed at
    /// about `1.5k + slack` candidates per sign; 1 (all of the sign) when the sample
    /// cannot tell, `u32::MAX` when `k = 0`.
    fn exact_thresholds(&mut self, x: &[f32], kp: usize, kn: usize) -> (u32, u32) {
        let n = x.len();
        let pick = |k: usize, samples: &mut Vec<u32>| -> u32 {
            if k == 0 {
                return u32::MAX;
            }
            let want = ((k as f64 * 1.5 / n as f64) * EXACT_SAMPLE as f64).ceil() as usize + 8;
            kth_sample(samples, want).unwrap_or(1)
        };
        if n <= 4 * EXACT_SAMPLE {
            return (
                if kp == 0 { u32::MAX } else { 1 },
                if kn == 0 { u32::MAX } else { 1 },
            );
        }
        self.spos.clear();
        self.sneg.clear();
        let step = n / EXACT_SAMPLE;
        for j in 0..EXACT_SAMPLE {
            let (key, is_neg) = signed_key(x[j * step + (j * 7919) % step]);
            if is_neg {
                self.sneg.push(key);
            } else {
                self.spos.push(key);
            }
        }
        let mut sp = std::mem::take(&mut self.spos);
        let mut sn = std::mem::take(&mut self.sneg);
        let t = (pick(kp, &mut sp), pick(kn, &mut sn));
        self.spos = sp;
        self.sneg = sn;
        t
    }

    /// Sampled (LBANN) thresholds: from [`THRESHOLD_SAMPLES`] random positions, the
    /// `⌈m±/π⌉`-th largest sampled magnitude per sign; `None` when no sample had that sign.
    fn sampled_thresholds(
        &mut self,
        x: &[f32],
        kp: usize,
        kn: usize,
        rng: &mut Rng,
    ) -> (Option<u32>, Option<u32>) {
        let n = x.len();
        self.spos.clear();
        self.sneg.clear();
        for _ in 0..THRESHOLD_SAMPLES {
            let (key, is_neg) = signed_key(x[rng.below(n as u64) as usize]);
            if is_neg {
                self.sneg.push(key);
            } else {
                self.spos.push(key);
            }
        }
        let prop = self.proportion;
        let tp = if kp == 0 {
            Some(u32::MAX)
        } else {
            let r = self.spos.len().div_ceil(prop).max(1);
            kth_sample(&mut self.spos, r)
        };
        let tn = if kn == 0 {
            Some(u32::MAX)
        } else {
            let r = self.sneg.len().div_ceil(prop).max(1);
            kth_sample(&mut self.sneg, r)
        };
        (tp, tn)
    }

    /// Fills `self.pos` / `self.neg` with the sent sets of segment `x`.
    fn select(&mut self, x: &[f32], kp: usize, kn: usize, rng: &mut Rng) {
        let mut tmp = std::mem::take(&mut self.words);
        if self.sampled && x.len() > THRESHOLD_SAMPLES {
            let (tp, tn) = self.sampled_thresholds(x, kp, kn, rng);
            gather_by_sign(
                x,
                tp.unwrap_or(1),
                tn.unwrap_or(1),
                &mut self.pos,
                &mut self.neg,
                &mut self.cand,
            );
            // A missing sample gathered the whole sign; an overshoot beyond the cap still
            // holds the top k (its threshold lies below the k-th largest): both reduce
            // exactly.
            if tp.is_none() || self.pos.len() > MAX_EXCESS * kp {
                Self::reduce(x, &mut self.pos, kp, &mut self.scratch, &mut tmp);
            }
            if tn.is_none() || self.neg.len() > MAX_EXCESS * kn {
                Self::reduce(x, &mut self.neg, kn, &mut self.scratch, &mut tmp);
            }
        } else {
            let (mut tp, mut tn) = self.exact_thresholds(x, kp, kn);
            gather_by_sign(x, tp, tn, &mut self.pos, &mut self.neg, &mut self.cand);
            if self.pos.len() < kp || self.neg.len() < kn {
                // The estimate was too high for a sign: take all of that sign.
                if self.pos.len() < kp {
                    tp = 1;
                }
                if self.neg.len() < kn {
                    tn = 1;
                }
                gather_by_sign(x, tp, tn, &mut self.pos, &mut self.neg, &mut self.cand);
            }
            Self::reduce(x, &mut self.pos, kp, &mut self.scratch, &mut tmp);
            Self::reduce(x, &mut self.neg, kn, &mut self.scratch, &mut tmp);
        }
        self.words = tmp;
    }
}

impl Compressor for AdaptiveThreshold {
    fn method(&self) -> MethodId {
        AdaptiveThresholdConfig::ID
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }
    fn encode_segment(&mut self, x: &[f32], rng: &mut Rng, w: &mut Writer<'_>) {
        let n = x.len();
        let npos = x.iter().filter(|&&v| v >= 0.0).count();
        let kp = npos / self.proportion;
        let kn = (n - npos) / self.proportion;
        self.select(x, kp, kn, rng);
        let mu_pos = mean_of(x, &self.pos);
        let mu_neg = mean_of(x, &self.neg);
        merge_words(&self.pos, &self.neg, &mut self.words);
        w.f32(mu_pos);
        w.f32(mu_neg);
        write_sign_words(&self.words, w);
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let mu_pos = r.finite_f32("adaptive mean of positives")?;
        let mu_neg = r.finite_f32("adaptive mean of negatives")?;
        if mu_pos < 0.0 || mu_neg > 0.0 {
            return Err(WireError::Invalid("adaptive means have the wrong sign"));
        }
        read_sign_words_add(r, out, mu_pos, mu_neg)
    }
    fn segment_bits(&self, _n: usize) -> Option<u64> {
        None
    }
    fn max_segment_len(&self) -> usize {
        MAX_SIGN_WORD_SEGMENT
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{decompress, HEADER_BITS};
    use crate::threshold::test_support::*;
    use crate::CompressorConfig;

    fn build(proportion: u32, sampled: bool) -> AdaptiveThreshold {
        AdaptiveThresholdConfig {
            proportion,
            sampled,
        }
        .init()
        .unwrap()
    }

    /// The brute-force selection: per sign, sort by magnitude (ties → smaller index) and
    /// keep ⌊count/π⌋.
    fn brute(x: &[f32], prop: usize) -> (Vec<u32>, Vec<u32>) {
        let pick = |positive: bool| {
            let mut idx: Vec<u32> = (0..x.len() as u32)
                .filter(|&i| (x[i as usize] >= 0.0) == positive)
                .collect();
            let k = idx.len() / prop;
            idx.sort_by(|&a, &b| {
                x[b as usize]
                    .abs()
                    .total_cmp(&x[a as usize].abs())
                    .then(a.cmp(&b))
            });
            idx.truncate(k);
            idx.sort();
            idx
        };
        (pick(true), pick(false))
    }

    /// Decoded positions per sign and the values there.
    fn sent(out: &[f32]) -> (Vec<u32>, Vec<u32>) {
        let pos = (0..out.len() as u32)
            .filter(|&i| out[i as usize] > 0.0)
            .collect();
        let neg = (0..out.len() as u32)
            .filter(|&i| out[i as usize] < 0.0)
            .collect();
        (pos, neg)
    }

    fn test_vectors(seed: u64) -> Vec<Vec<f32>> {
        let mut rng = Rng::seed_from_u64(seed);
        let mut v = Vec::new();
        for &n in &[1usize, 7, 99, 100, 250, 1024, 1025, 5000, 30_000] {
            v.push(gaussian(&mut rng, n, 1.0));
            // Skewed: mostly positive, with ties and signed zeros.
            let mut s: Vec<f32> = gaussian(&mut rng, n, 1.0)
                .iter()
                .map(|&z| ((z + 1.0) * 4.0).round() / 4.0)
                .collect();
            for j in (0..n).step_by(13) {
                s[j] = -0.0;
            }
            v.push(s);
        }
        v
    }

    #[test]
    fn exact_selection_keeps_floor_count_over_prop_per_sign() {
        for x in test_vectors(1) {
            for prop in [1u32, 3, 100] {
                let mut c = build(prop, false);
                let mut rng = Rng::seed_from_u64(2);
                let (p, _) = round_trip(&mut c, &x, &[], &mut rng);
                let (bp, bn) = brute(&x, prop as usize);
                let npos = x.iter().filter(|&&v| v >= 0.0).count();
                assert_eq!(bp.len(), npos / prop as usize);
                assert_eq!(bn.len(), (x.len() - npos) / prop as usize);
                // Compare sets through the encoder's own lists (a positive mean of
                // zeros would decode to 0 and hide positions).
                assert_eq!(c.pos, bp, "n {} prop {prop}", x.len());
                assert_eq!(c.neg, bn, "n {} prop {prop}", x.len());
                let count = bp.len() + bn.len();
                assert_eq!(
                    p.encoded_len() as u64 * 8,
                    HEADER_BITS + 64 + 32 + 32 * count as u64
                );
                if prop == 1 {
                    // Everything is sent.
                    assert_eq!(count, x.len());
                }
            }
        }
    }

    #[test]
    fn reconstructions_are_the_means_of_the_sent_sets_and_preserve_the_sum() {
        for x in test_vectors(3) {
            for sampled in [false, true] {
                let mut c = build(10, sampled);
                let mut rng = Rng::seed_from_u64(4);
                let (_, out) = round_trip(&mut c, &x, &[], &mut rng);
                for (set, sign) in [(c.pos.clone(), 1.0f32), (c.neg.clone(), -1.0)] {
                    if set.is_empty() {
                        continue;
                    }
                    let sum: f64 = set.iter().map(|&i| x[i as usize] as f64).sum();
                    let mean = (sum / set.len() as f64) as f32;
                    for &i in &set {
                        assert_eq!(out[i as usize], mean);
                        assert!(mean == 0.0 || mean.signum() == sign);
                    }
                    // Mean preservation: Σ recon over the sent set == Σ p over it.
                    let recon: f64 = set.iter().map(|&i| out[i as usize] as f64).sum();
                    assert!(
                        (recon - sum).abs() <= 1e-6 * sum.abs().max(1e-30),
                        "{recon} vs {sum}"
                    );
                }
                // Nothing outside the sent sets.
                let (dp, dn) = sent(&out);
                assert!(dp.iter().all(|i| c.pos.binary_search(i).is_ok()));
                assert_eq!(dn, c.neg);
            }
        }
    }

    #[test]
    fn sampled_sends_at_most_four_times_the_ideal_count() {
        let mut rng = Rng::seed_from_u64(5);
        for seed in 0..6u64 {
            let n = 50_000;
            let x = match seed % 3 {
                0 => gaussian(&mut rng, n, 1.0),
                1 => {
                    let g = gaussian(&mut rng, n, 1.0);
                    g.iter().map(|z| z * z * z + 0.3).collect()
                }
                _ => {
                    let g = gaussian(&mut rng, n, 1.0);
                    g.iter().map(|z| (z * 2.0).round()).collect()
                }
            };
            for prop in [20u32, 100, 1000] {
                let mut c = build(prop, true);
                let (_, out) = round_trip(&mut c, &x, &[], &mut Rng::seed_from_u64(seed));
                let npos = x.iter().filter(|&&v| v >= 0.0).count();
                let (kp, kn) = (npos / prop as usize, (n - npos) / prop as usize);
                assert!(c.pos.len() <= MAX_EXCESS * kp, "{} > 4·{kp}", c.pos.len());
                assert!(c.neg.len() <= MAX_EXCESS * kn, "{} > 4·{kn}", c.neg.len());
                // Sampled sets are threshold sets (everything of a sign at or beyond the
                // smallest sent magnitude of that sign is sent) unless the exact fallback
                // ran, which sends exactly the ideal count.
                for (set, positive, k) in [(&c.pos, true, kp), (&c.neg, false, kn)] {
                    if let Some(min) = set.iter().map(|&i| x[i as usize].abs()).reduce(f32::min) {
                        let beyond = x
                            .iter()
                            .filter(|&&v| (v >= 0.0) == positive && v.abs() >= min)
                            .count();
                        assert!(beyond == set.len() || set.len() == k);
                    }
                }
                assert!(out.iter().any(|&v| v != 0.0));
            }
        }
    }

    #[test]
    fn exact_selection_recovers_when_the_steering_sample_overestimates() {
        // White-box: the strided sample sees only large values, the rest are small, so the
        // first candidate pass finds too few entries and the whole sign is regathered.
        let n = 100_000;
        let step = n / EXACT_SAMPLE;
        let mut rng = Rng::seed_from_u64(11);
        let mut x: Vec<f32> = gaussian(&mut rng, n, 1e-3);
        for j in 0..EXACT_SAMPLE {
            let i = j * step + (j * 7919) % step;
            x[i] = if j % 2 == 0 {
                10.0 + j as f32
            } else {
                -10.0 - j as f32
            };
        }
        let mut c = build(20, false);
        let _ = round_trip(&mut c, &x, &[], &mut rng);
        let (bp, bn) = brute(&x, 20);
        assert_eq!(c.pos, bp);
        assert_eq!(c.neg, bn);
    }

    #[test]
    fn sampled_falls_back_to_exact_when_ties_overshoot() {
        // All positives equal: the sampled threshold selects every one of them.
        let n = 10_000;
        let mut x = vec![1.0f32; n];
        for j in (0..n).step_by(10) {
            x[j] = -2.0 - j as f32 * 1e-4;
        }
        let mut c = build(100, true);
        let _ = round_trip(&mut c, &x, &[], &mut Rng::seed_from_u64(6));
        let (bp, _) = brute(&x, 100);
        assert_eq!(c.pos, bp);
        assert_eq!(c.pos.len(), 9000 / 100);
        // Negatives are distinct: the sampled set stays a threshold set within the cap.
        assert!(!c.neg.is_empty() && c.neg.len() <= 4 * 10);
    }

    #[test]
    fn ef_invariant() {
        for sampled in [false, true] {
            check_ef_invariant(
                &CompressorConfig::AdaptiveThreshold(AdaptiveThresholdConfig {
                    proportion: 50,
                    sampled,
                }),
                6000,
                5,
                7,
            );
        }
    }

    #[test]
    fn config_is_validated() {
        let e = AdaptiveThresholdConfig {
            proportion: 0,
            sampled: false,
        }
        .init()
        .err()
        .unwrap();
        assert_eq!(e.field, "proportion");
        let cfg: CompressorConfig =
            toml::from_str("kind = \"adaptive-threshold\"\nproportion = 7\nsampled = true")
                .unwrap();
        assert_eq!(
            cfg,
            CompressorConfig::AdaptiveThreshold(AdaptiveThresholdConfig {
                proportion: 7,
                sampled: true
            })
        );
    }

    #[test]
    fn decoder_rejects_bad_means() {
        let c = build(2, false);
        let body = |mp: f32, mn: f32| {
            let mut b = vec![0xD7, 1, AdaptiveThresholdConfig::ID.0, 0];
            b.extend(4u32.to_le_bytes());
            b.extend(1u32.to_le_bytes());
            b.extend(mp.to_le_bytes());
            b.extend(mn.to_le_bytes());
            b.extend(2u32.to_le_bytes());
            b.extend(1u32.to_le_bytes()); // index 0, negative
            b.extend(6u32.to_le_bytes()); // index 3, positive
            b
        };
        let mut out = [0f32; 4];
        decompress(&c, &body(0.5, -0.25), &mut out).unwrap();
        assert_eq!(out, [-0.25, 0.0, 0.0, 0.5]);
        for (mp, mn) in [
            (-0.5, -0.25),
            (0.5, 0.25),
            (f32::NAN, -1.0),
            (1.0, f32::NEG_INFINITY),
        ] {
            assert!(
                decompress(&c, &body(mp, mn), &mut out).is_err(),
                "{mp} {mn}"
            );
        }
    }

    #[test]
    fn random_and_mutated_payloads_never_panic() {
        for sampled in [false, true] {
            fuzz_decoder(
                &CompressorConfig::AdaptiveThreshold(AdaptiveThresholdConfig {
                    proportion: 4,
                    sampled,
                }),
                8,
            );
        }
    }
}
