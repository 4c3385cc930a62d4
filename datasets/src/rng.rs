//! A small, explicitly specified PRNG (SplitMix64).
//!
//! Shuffles, shards and augmentations must be identical on every rank and across
//! builds, so they use this fixed algorithm rather than a crate whose stream may
//! change between versions.

/// SplitMix64 (Steele, Lea, Flood 2014): 64-bit state, one add and a mix per draw.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator whose seed is derived from several keys (e.g. seed, epoch, index),
    /// so that streams for different keys are unrelated.
    pub fn keyed(keys: &[u64]) -> Self {
        let mut h = 0x243f_6a88_85a3_08d3_u64;
        for &k in keys {
            h = mix(h ^ k).wrapping_add(0x9e37_79b9_7f4a_7c15);
        }
        Self::new(h)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.state)
    }

    /// A uniform integer in `0..n` (Lemire's multiply-shift with rejection; unbiased).
    ///
    /// # Panics
    /// Panics if `n == 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "SplitMix64::below(0)");
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = (self.next_u64() as u128) * (n as u128);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }

    /// A uniform float in `[0, 1)`.
    pub fn unit_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Two independent standard normal draws: Box–Muller's cosine and sine of one angle
    /// (in `f64`, from two 53-bit uniforms).
    pub fn normal_pair_f32(&mut self) -> (f32, f32) {
        let u1 = 1.0 - (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        let u2 = (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        let r = (-2.0 * u1.ln()).sqrt();
        let (sin, cos) = (std::f64::consts::TAU * u2).sin_cos();
        ((r * cos) as f32, (r * sin) as f32)
    }

    /// Fills `out` with standard normal draws, two per [`SplitMix64::normal_pair_f32`] (an
    /// odd length drops the last pair's sine): half the logarithms, roots and two draws
    /// per value of one draw per value.
    pub fn fill_normal_f32(&mut self, out: &mut [f32]) {
        for pair in out.chunks_mut(2) {
            let (a, b) = self.normal_pair_f32();
            pair[0] = a;
            if let [_, second] = pair {
                *second = b;
            }
        }
    }

    /// Shuffles `v` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_stream() {
        // SplitMix64 reference values for seed 1234567 (from the published C code).
        let mut r = SplitMix64::new(1234567);
        assert_eq!(r.next_u64(), 6457827717110365317);
        assert_eq!(r.next_u64(), 3203168211198807973);
    }

    #[test]
    fn normal_draws_have_unit_moments_and_independent_halves() {
        let mut r = SplitMix64::new(11);
        let mut x = vec![0f32; 200_001];
        r.fill_normal_f32(&mut x);
        let n = x.len() as f64;
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        let kurt = x.iter().map(|&v| (v as f64 - mean).powi(4)).sum::<f64>() / n / var / var;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "var {var}");
        assert!((kurt - 3.0).abs() < 0.05, "kurtosis {kurt}");
        // The two halves of a pair (cosine, sine of one angle) are uncorrelated.
        let pairs = x.len() / 2;
        let cov = (0..pairs)
            .map(|i| x[2 * i] as f64 * x[2 * i + 1] as f64)
            .sum::<f64>()
            / pairs as f64;
        assert!(cov.abs() < 0.01, "covariance of a pair's halves {cov}");
        let within_one = x.iter().filter(|v| v.abs() < 1.0).count() as f64 / n;
        assert!(
            (within_one - 0.6827).abs() < 0.005,
            "P(|x| < 1) = {within_one}"
        );
    }

    #[test]
    fn below_is_in_range_and_roughly_uniform() {
        let mut r = SplitMix64::new(7);
        let mut counts = [0usize; 6];
        for _ in 0..60_000 {
            counts[r.below(6) as usize] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn shuffle_is_a_permutation_and_seed_dependent() {
        let mut a: Vec<usize> = (0..100).collect();
        let mut b = a.clone();
        SplitMix64::new(1).shuffle(&mut a);
        SplitMix64::new(2).shuffle(&mut b);
        assert_ne!(a, b);
        let mut s = a.clone();
        s.sort();
        assert_eq!(s, (0..100).collect::<Vec<_>>());
    }
}
