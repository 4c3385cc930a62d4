//! The explicit, seedable random-number generator every stochastic compressor takes.
//!
//! Reproducibility is part of the contract: two runs with the same `(seed, step, rank,
//! bucket)` produce bit-identical payloads. The generator is xoshiro256++ seeded through
//! SplitMix64, which is small, fast (about 1 ns per 64-bit draw) and has no dependency.

/// xoshiro256++ generator. Cheap to construct; construct one per (step, rank, bucket).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    s: [u64; 4],
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    /// A generator from one 64-bit seed (any value, zero included).
    pub fn seed_from_u64(seed: u64) -> Self {
        let mut st = seed;
        let s = [
            splitmix64(&mut st),
            splitmix64(&mut st),
            splitmix64(&mut st),
            splitmix64(&mut st),
        ];
        Rng { s }
    }

    /// The seed convention of ALGORITHMS.md §0.6: one stream per
    /// `(global seed, step, worker rank, bucket id)`.
    pub fn for_step(seed: u64, step: u64, rank: u64, bucket: u64) -> Self {
        Self::seed_from_u64(derive_seed(seed, step, rank, bucket))
    }

    /// Next 64 random bits.
    #[inline(always)]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform `f32` in `[0, 1)` with 24 random bits.
    #[inline(always)]
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform `f64` in `[0, 1)` with 53 random bits.
    #[inline(always)]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `[0, bound)` (Lemire's multiply-shift; `bound > 0`).
    ///
    /// # Panics
    /// If `bound == 0`.
    #[inline(always)]
    pub fn below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0, "Rng::below(0)");
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let m = (self.next_u64() as u128) * (bound as u128);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }
}

/// Mixes `(seed, step, rank, bucket)` into one 64-bit seed.
pub fn derive_seed(seed: u64, step: u64, rank: u64, bucket: u64) -> u64 {
    let mut st = seed;
    let mut h = splitmix64(&mut st);
    for v in [step, rank, bucket] {
        st = h ^ v.wrapping_mul(0xD6E8_FEB8_6659_FD93);
        h = splitmix64(&mut st);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = {
            let mut r = Rng::for_step(1, 2, 3, 4);
            (0..8).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = Rng::for_step(1, 2, 3, 4);
            (0..8).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        let c: Vec<u64> = {
            let mut r = Rng::for_step(1, 2, 4, 3);
            (0..8).map(|_| r.next_u64()).collect()
        };
        assert_ne!(a, c);
    }

    #[test]
    fn uniform_moments() {
        let mut r = Rng::seed_from_u64(7);
        let n = 200_000;
        let mut s = 0.0f64;
        let mut s2 = 0.0f64;
        for _ in 0..n {
            let u = r.next_f32() as f64;
            assert!((0.0..1.0).contains(&u));
            s += u;
            s2 += u * u;
        }
        let mean = s / n as f64;
        let var = s2 / n as f64 - mean * mean;
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
        assert!((var - 1.0 / 12.0).abs() < 0.002, "var {var}");
        let mut hist = [0u32; 10];
        for _ in 0..100_000 {
            hist[r.below(10) as usize] += 1;
        }
        for h in hist {
            assert!((9_400..10_600).contains(&h), "{hist:?}");
        }
    }
}
