//! Exact, order-free sums of `f32` magnitudes: the sum a device can compute as the host does.
//!
//! A float sum depends on the order of its additions, so a GPU's parallel reduction and a
//! CPU's loop agree only by luck, and a payload that carries a per-tensor scale (EF-signSGD's
//! mean magnitude) differs in its last bit now and then. An exact sum does not: every finite
//! `|x|` is `m · 2^(E' − 150)` with a 24-bit integer significand `m` and `E' = max(E, 1)` for
//! the exponent field `E` (a subnormal is `m · 2^-149` with `m` its fraction), so the sum is
//! `Σ_E' (Σ m) · 2^(E' − 150)`: one integer accumulator per exponent (256 of them, each below
//! 2⁵⁶ for up to 2³² elements) in any order, then one rounding. [`ExactSum::to_f64`] rounds
//! the exact value to the nearest `f64` (ties to even) through a 320-bit integer.
//!
//! The bins are the wire between a device and the host: a kernel accumulates them with
//! 32-bit atomics (a carry into the high word), the host reads them back
//! ([`ExactSum::from_bins`]) and finishes the scalar arithmetic — so both sides compute the
//! same number by construction.

/// How a codec accumulates a per-tensor sum (`sum` in the configs of `ef-signsgd` and
/// `onebit`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Sum {
    /// An `f64` loop in the method's own order (the default).
    #[default]
    F64,
    /// Exact and order-free, rounded once to `f64` ([`ExactSum`]): what a device codec
    /// computes identically.
    Exact,
}

impl Sum {
    /// Whether this is the default (for `skip_serializing_if`).
    pub fn is_f64(&self) -> bool {
        *self == Sum::F64
    }
}

/// The exact sum of a set of `f32` magnitudes, as one integer per exponent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExactSum {
    bins: [u64; 256],
}

impl Default for ExactSum {
    fn default() -> Self {
        ExactSum { bins: [0; 256] }
    }
}

impl ExactSum {
    /// The exact `Σ |x_j|` of finite `x` (a non-finite value's magnitude is not counted:
    /// callers check finiteness first).
    pub fn of_abs(x: &[f32]) -> Self {
        let mut s = ExactSum::default();
        for &v in x {
            s.add_abs(v);
        }
        s
    }

    /// Adds `|x|` (nothing for a NaN or an infinity).
    #[inline]
    pub fn add_abs(&mut self, x: f32) {
        let (bin, m) = bin_of(x.to_bits());
        if bin < 255 {
            self.bins[bin] += u64::from(m);
        }
    }

    /// The sum from its bins, as a device accumulates them: `bins[e]` the sum of the
    /// significands of exponent field `max(E, 1) = e` (entry 0 and 255 unused).
    pub fn from_bins(bins: [u64; 256]) -> Self {
        ExactSum { bins }
    }

    /// The bins (see [`ExactSum::from_bins`]).
    pub fn bins(&self) -> &[u64; 256] {
        &self.bins
    }

    /// The exact sum rounded to the nearest `f64`, ties to even.
    pub fn to_f64(&self) -> f64 {
        // The value in units of 2^-149: Σ bins[e] · 2^(e − 1), at most 2^(253 + 56).
        let mut limbs = [0u64; 5];
        for (e, &b) in self.bins.iter().enumerate().skip(1).take(254) {
            add_shifted(&mut limbs, u128::from(b), e - 1);
        }
        round_to_f64(&limbs, -149)
    }
}

/// The exact sum of the squares of a set of `f32` values, as one integer per exponent: `x²`
/// is `m² · 2^(2(E' − 150))` with `m² < 2⁴⁸`, so bin `E'` holds `Σ m²` (below 2⁸⁰ for up to
/// 2³² elements) and the sum is one rounding of `Σ bins[e] · 2^(2(e − 1))` in units of
/// `2⁻²⁹⁸`. On a device the bins are three 32-bit words each, accumulated with carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExactSquares {
    bins: [u128; 256],
}

impl Default for ExactSquares {
    fn default() -> Self {
        ExactSquares { bins: [0; 256] }
    }
}

impl ExactSquares {
    /// The exact `Σ x_j²` of finite `x` (a non-finite value is not counted).
    pub fn of(x: &[f32]) -> Self {
        let mut s = ExactSquares::default();
        for &v in x {
            s.add(v);
        }
        s
    }

    /// Adds `x²` (nothing for a NaN or an infinity).
    #[inline]
    pub fn add(&mut self, x: f32) {
        let (bin, m) = bin_of(x.to_bits());
        if bin < 255 {
            self.bins[bin] += u128::from(u64::from(m) * u64::from(m));
        }
    }

    /// The sum from its bins, as a device accumulates them (`bins[e]`: the sum of the
    /// squared significands of exponent field `max(E, 1) = e`).
    pub fn from_bins(bins: [u128; 256]) -> Self {
        ExactSquares { bins }
    }

    /// The exact sum rounded to the nearest `f64`, ties to even.
    pub fn to_f64(&self) -> f64 {
        // Units of 2^-298; the largest term is below 2^(2·253 + 80).
        let mut limbs = [0u64; 10];
        for (e, &b) in self.bins.iter().enumerate().skip(1).take(254) {
            add_shifted(&mut limbs, b, 2 * (e - 1));
        }
        round_to_f64(&limbs, -298)
    }
}

/// The population standard deviation of a set of `n` values from its exact sums — `Σ` of the
/// non-negative values, `Σ|x|` of the negative ones and `Σ x²` — as `√max(Σx²/n − (Σx/n)², 0)`
/// in `f64` from the sums rounded once each: what the host and a device (which accumulates
/// the same sums) compute alike (TernGrad's `sum = "exact"`). 0 for `n = 0`.
pub fn std_dev_of_sums(pos: &ExactSum, neg: &ExactSum, squares: &ExactSquares, n: usize) -> f64 {
    if n == 0 {
        return 0.0;
    }
    let n = n as f64;
    let mean = (pos.to_f64() - neg.to_f64()) / n;
    (squares.to_f64() / n - mean * mean).max(0.0).sqrt()
}

/// Adds `value · 2^shift` into the little-endian integer `limbs` (`value < 2¹²⁸`; what does
/// not fit the limbs is dropped, which the callers' sizes rule out).
fn add_shifted(limbs: &mut [u64], value: u128, shift: usize) {
    const LOW: u128 = u64::MAX as u128;
    let (word, bit) = (shift / 64, shift % 64);
    let lo = (value & LOW) << bit; // < 2^128
    let hi = (value >> 64) << bit; // < 2^128
    let t0 = lo & LOW;
    let t1 = (lo >> 64) + (hi & LOW);
    let t2 = (hi >> 64) + (t1 >> 64);
    let mut carry = 0u128;
    for (k, part) in [t0, t1 & LOW, t2].into_iter().enumerate() {
        if word + k >= limbs.len() {
            return;
        }
        let sum = u128::from(limbs[word + k]) + part + carry;
        limbs[word + k] = sum as u64;
        carry = sum >> 64;
    }
    let mut k = word + 3;
    while carry != 0 && k < limbs.len() {
        let sum = u128::from(limbs[k]) + carry;
        limbs[k] = sum as u64;
        carry = sum >> 64;
        k += 1;
    }
}

/// The little-endian integer `limbs` times `2^unit`, rounded to the nearest `f64` (ties to
/// even).
fn round_to_f64(limbs: &[u64], unit: i32) -> f64 {
    let Some(top_limb) = (0..limbs.len()).rev().find(|&k| limbs[k] != 0) else {
        return 0.0;
    };
    let top = 64 * top_limb + 63 - limbs[top_limb].leading_zeros() as usize;
    let bit = |i: usize| (limbs[i / 64] >> (i % 64)) & 1;
    if top < 53 {
        return limbs[0] as f64 * 2f64.powi(unit);
    }
    // The 53 bits from `top` down, then round to nearest even on what lies below.
    let low = top - 52;
    let mut mant = 0u64;
    for i in (low..=top).rev() {
        mant = mant << 1 | bit(i);
    }
    let half = bit(low - 1) == 1;
    let sticky = (0..low - 1).any(|i| bit(i) == 1);
    if half && (sticky || mant & 1 == 1) {
        mant += 1;
    }
    mant as f64 * 2f64.powi(low as i32 + unit)
}

/// The bin and the significand of an `f32`'s magnitude (bits `bits`): bin 255 for a NaN or
/// an infinity.
#[inline]
pub fn bin_of(bits: u32) -> (usize, u32) {
    let e = (bits >> 23) & 0xFF;
    let frac = bits & 0x7F_FFFF;
    match e {
        0 => (1, frac),
        _ => (e as usize, frac | 0x80_0000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// Squares against an independent oracle (multiples of 2^-30 below 2^20 with at most 24
    /// significant bits: their squares are multiples of 2^-60 summing exactly as `u128`,
    /// which `as f64` rounds to nearest even), the ends of the range, and the standard
    /// deviation against the two-pass `f64` formula.
    #[test]
    fn squares_are_exact_and_rounded_once() {
        let mut r = Rng::seed_from_u64(23);
        for _ in 0..200 {
            let n = 1 + r.below(2000) as usize;
            let ks: Vec<u64> = (0..n)
                .map(|_| {
                    let bits = 1 + r.below(24) as u32;
                    r.next_u64() >> (64 - bits)
                })
                .collect();
            let x: Vec<f32> = ks
                .iter()
                .enumerate()
                .map(|(i, &k)| if i % 3 == 0 { -1.0 } else { 1.0 } * k as f32 * 2f32.powi(-30))
                .collect();
            let oracle: u128 = ks.iter().map(|&k| u128::from(k) * u128::from(k)).sum();
            let want = oracle as f64 * 2f64.powi(-60);
            assert_eq!(ExactSquares::of(&x).to_f64(), want);
            let mut y = x.clone();
            y.reverse();
            assert_eq!(ExactSquares::of(&y), ExactSquares::of(&x));
        }
        // Subnormals square to 2^-298 units; the largest values far above f32's range.
        let s = ExactSquares::of(&[f32::from_bits(1), f32::from_bits(3), 0.0, -0.0]);
        assert_eq!(s.to_f64(), 10.0 * 2f64.powi(-298));
        let m = f64::from(f32::MAX);
        assert_eq!(
            ExactSquares::of(&[f32::MAX, -f32::MAX]).to_f64(),
            2.0 * m * m
        );
        assert_eq!(ExactSquares::of(&[f32::NAN, 2.0]).to_f64(), 4.0);
        // σ from the exact sums: the two-pass formula's, to rounding.
        let x: Vec<f32> = (0..5000).map(|_| (r.next_f32() - 0.3) * 7.0).collect();
        let (mut pos, mut neg) = (ExactSum::default(), ExactSum::default());
        for &v in &x {
            if v >= 0.0 {
                pos.add_abs(v)
            } else {
                neg.add_abs(v)
            }
        }
        let sd = std_dev_of_sums(&pos, &neg, &ExactSquares::of(&x), x.len());
        let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / 5000.0;
        let two_pass = (x
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / 5000.0)
            .sqrt();
        assert!(
            (sd - two_pass).abs() <= 1e-12 * two_pass,
            "{sd} vs {two_pass}"
        );
        assert_eq!(
            std_dev_of_sums(&pos, &neg, &ExactSquares::default(), 0),
            0.0
        );
    }

    /// Exact where an f64 loop is not, independent of the order, and right at the ends of
    /// the range.
    #[test]
    fn sums_are_exact_and_rounded_once() {
        // 1 + 2^-60 + 2^-60 … : an f64 loop loses every tiny term, the exact sum keeps them
        // until they reach the last bit of the result.
        let tiny = 2f32.powi(-60);
        let mut x = vec![1.0f32];
        x.extend(std::iter::repeat_n(tiny, 1 << 10));
        let exact = ExactSum::of_abs(&x).to_f64();
        assert_eq!(exact, 1.0 + 2f64.powi(-50));
        let naive: f64 = x.iter().map(|&v| f64::from(v)).sum();
        assert_eq!(naive, 1.0, "an f64 loop loses every term");
        // Order does not matter, bit for bit, where an f64 loop's result does.
        let mut r = Rng::seed_from_u64(3);
        let mut y: Vec<f32> = (0..10_000)
            .map(|i| (r.next_f32() - 0.5) * 10f32.powi((i % 30) - 15))
            .collect();
        let a = ExactSum::of_abs(&y).to_f64();
        y.reverse();
        assert_eq!(ExactSum::of_abs(&y).to_f64().to_bits(), a.to_bits());
        let f64_sum: f64 = y.iter().map(|v| f64::from(v.abs())).sum();
        assert!((a - f64_sum).abs() <= a * 1e-12, "{a} vs {f64_sum}");
        // Subnormals, the largest value, zeros.
        let s = ExactSum::of_abs(&[f32::from_bits(1), f32::from_bits(3), -0.0, 0.0]);
        assert_eq!(s.to_f64(), 4.0 * 2f64.powi(-149));
        let s = ExactSum::of_abs(&[f32::MAX, f32::MAX, -f32::MAX]);
        assert_eq!(s.to_f64(), 3.0 * f64::from(f32::MAX));
        assert_eq!(ExactSum::of_abs(&[]).to_f64(), 0.0);
        // NaN and infinities are not counted.
        assert_eq!(
            ExactSum::of_abs(&[1.0, f32::NAN, f32::INFINITY]).to_f64(),
            1.0
        );
    }

    /// Against an independent oracle: values that are multiples of 2^-30 below 2^20 sum
    /// exactly as 128-bit integers, and `i128 as f64` rounds to nearest even.
    #[test]
    fn matches_integer_sums_rounded_by_the_language() {
        let mut r = Rng::seed_from_u64(17);
        for trial in 0..200 {
            let n = 1 + r.below(3000) as usize;
            let ints: Vec<i64> = (0..n)
                .map(|_| {
                    let bits = 1 + r.below(49) as u32; // up to 2^49 · 2^-30 < 2^20
                    (r.next_u64() >> (64 - bits)) as i64
                        & !(if trial % 2 == 0 { 0 } else { 0xFFFF })
                })
                .collect();
            // Only integers with at most 24 significant bits are f32 values exactly.
            let x: Vec<f32> = ints
                .iter()
                .map(|&k| {
                    let t = 64 - (k as u64).leading_zeros();
                    let k = if t > 24 { k >> (t - 24) << (t - 24) } else { k };
                    k as f32 * 2f32.powi(-30)
                })
                .collect();
            let exact: i128 = x
                .iter()
                .map(|v| (f64::from(*v) * 2f64.powi(30)) as i128)
                .sum();
            let want = exact as f64 * 2f64.powi(-30);
            assert_eq!(
                ExactSum::of_abs(&x).to_f64().to_bits(),
                want.to_bits(),
                "trial {trial}"
            );
        }
    }

    /// Round to nearest even on a tie: 2^53 + 1 (a tie) rounds down to 2^53, 2^53 + 3 up.
    #[test]
    fn ties_round_to_even() {
        // 2^53 as (2^24 · 2^29) and 1 as 1.0: build from f32 values exactly.
        let big = 2f32.powi(53);
        assert_eq!(ExactSum::of_abs(&[big, 1.0]).to_f64(), 2f64.powi(53));
        assert_eq!(
            ExactSum::of_abs(&[big, 1.0, 2.0]).to_f64(),
            2f64.powi(53) + 4.0
        );
        assert_eq!(
            ExactSum::of_abs(&[big, 1.0, 0.5]).to_f64(),
            2f64.powi(53) + 2.0,
            "above the tie"
        );
        // From bins as a device accumulates them: the same number.
        let s = ExactSum::of_abs(&[3.5, -1e-30, 7e20]);
        assert_eq!(ExactSum::from_bins(*s.bins()).to_f64(), s.to_f64());
    }
}
