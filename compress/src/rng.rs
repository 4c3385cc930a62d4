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

/// Four xoshiro256++ generators side by side, for loops that need one random word per
/// element: a single generator's state update is a serial chain (about 1 ns per draw), four
/// independent ones advance together in vector registers. Each lane is seeded through
/// SplitMix64 from one draw of the parent [`Rng`], so the lanes' streams are as
/// reproducible as the parent's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaneRng {
    /// `s[w][l]`: state word `w` of lane `l` (word-major, so each update is one vector op).
    s: [[u64; 4]; 4],
}

impl LaneRng {
    /// Four lanes seeded from four draws of `parent`.
    pub fn from_rng(parent: &mut Rng) -> Self {
        let mut s = [[0u64; 4]; 4];
        for l in 0..4 {
            let lane = Rng::seed_from_u64(parent.next_u64());
            for (w, word) in s.iter_mut().enumerate() {
                word[l] = lane.s[w];
            }
        }
        LaneRng { s }
    }

    /// The next 64 random bits of each lane (lane `l`'s `next_u64`).
    #[inline(always)]
    pub fn next_u64x4(&mut self) -> [u64; 4] {
        let mut s = self.s;
        let out = step(&mut s);
        self.s = s;
        out
    }

    /// Fills `out` with 32-bit words, eight per step: the low then the high half of lane 0,
    /// lane 1, lane 2, lane 3. A length that is not a multiple of eight discards the rest of
    /// the last step.
    #[inline(always)]
    pub fn fill_u32(&mut self, out: &mut [u32]) {
        let mut s = self.s;
        #[cfg(target_arch = "x86_64")]
        let rest = sse2::fill_u32(&mut s, out);
        #[cfg(not(target_arch = "x86_64"))]
        let rest = {
            let mut it = out.chunks_exact_mut(8);
            for c in &mut it {
                let u = step(&mut s);
                for l in 0..4 {
                    c[2 * l] = u[l] as u32;
                    c[2 * l + 1] = (u[l] >> 32) as u32;
                }
            }
            it.into_remainder()
        };
        if !rest.is_empty() {
            let u = step(&mut s);
            for (j, r) in rest.iter_mut().enumerate() {
                *r = (u[j / 2] >> (32 * (j % 2))) as u32;
            }
        }
        self.s = s;
    }
}

/// One xoshiro256++ step of four lanes (state word-major).
#[inline(always)]
fn step(s: &mut [[u64; 4]; 4]) -> [u64; 4] {
    let [s0, s1, s2, s3] = s;
    let mut out = [0u64; 4];
    for l in 0..4 {
        out[l] = s0[l]
            .wrapping_add(s3[l])
            .rotate_left(23)
            .wrapping_add(s0[l]);
        let t = s1[l] << 17;
        s2[l] ^= s0[l];
        s3[l] ^= s1[l];
        s1[l] ^= s2[l];
        s0[l] ^= s3[l];
        s2[l] ^= t;
        s3[l] = s3[l].rotate_left(45);
    }
    out
}

/// The lanes' steps in SSE2 registers (two lanes per register; SSE2 is part of every
/// x86-64 CPU). The compiler does not vectorise [`step`] itself: sixteen state words do not
/// fit the general registers, and the scalar loop spills them.
#[cfg(target_arch = "x86_64")]
mod sse2 {
    use std::arch::x86_64::{
        __m128i, _mm_add_epi64, _mm_loadu_si128, _mm_or_si128, _mm_slli_epi64, _mm_srli_epi64,
        _mm_storeu_si128, _mm_xor_si128,
    };

    /// Fills the longest prefix of `out` that is a whole number of steps (eight words) and
    /// returns the rest.
    #[inline(always)]
    pub(super) fn fill_u32<'a>(s: &mut [[u64; 4]; 4], out: &'a mut [u32]) -> &'a mut [u32] {
        // SAFETY: SSE2 is in the x86-64 baseline; every load and store is unaligned and
        // within the 32-byte state words or the 8-word chunk it names.
        unsafe {
            let load = |w: &[u64; 4], half: usize| {
                _mm_loadu_si128(w.as_ptr().add(2 * half).cast::<__m128i>())
            };
            let mut lo = [
                load(&s[0], 0),
                load(&s[1], 0),
                load(&s[2], 0),
                load(&s[3], 0),
            ];
            let mut hi = [
                load(&s[0], 1),
                load(&s[1], 1),
                load(&s[2], 1),
                load(&s[3], 1),
            ];
            let mut it = out.chunks_exact_mut(8);
            for c in &mut it {
                let p = c.as_mut_ptr().cast::<__m128i>();
                _mm_storeu_si128(p, step(&mut lo));
                _mm_storeu_si128(p.add(1), step(&mut hi));
            }
            for (w, word) in s.iter_mut().enumerate() {
                let q = word.as_mut_ptr().cast::<__m128i>();
                _mm_storeu_si128(q, lo[w]);
                _mm_storeu_si128(q.add(1), hi[w]);
            }
            it.into_remainder()
        }
    }

    /// One xoshiro256++ step of the two lanes held in `s` (words 0..4); returns their
    /// outputs, lane 0's in the low 64 bits.
    #[inline(always)]
    unsafe fn step(s: &mut [__m128i; 4]) -> __m128i {
        // SAFETY: register-only SSE2 operations (in the x86-64 baseline).
        unsafe {
            let [s0, s1, s2, s3] = s;
            let a = _mm_add_epi64(*s0, *s3);
            let rot = _mm_or_si128(_mm_slli_epi64::<23>(a), _mm_srli_epi64::<41>(a));
            let out = _mm_add_epi64(rot, *s0);
            let t = _mm_slli_epi64::<17>(*s1);
            *s2 = _mm_xor_si128(*s2, *s0);
            *s3 = _mm_xor_si128(*s3, *s1);
            *s1 = _mm_xor_si128(*s1, *s2);
            *s0 = _mm_xor_si128(*s0, *s3);
            *s2 = _mm_xor_si128(*s2, t);
            *s3 = _mm_or_si128(_mm_slli_epi64::<45>(*s3), _mm_srli_epi64::<19>(*s3));
            out
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

/// Where a stochastic codec's random bits come from (`draws` in the configs of `terngrad`
/// and `natural`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Draws {
    /// The method's own stream from the encoder's Rng (the default; the fastest on a CPU).
    #[default]
    Lanes,
    /// Counter-based: element `j` of a segment draws [`counter_bits`]`(key, j)`, the key one
    /// draw of the encoder's Rng per segment. The mode a device codec computes identically,
    /// so its payload can be checked byte for byte against the host's.
    Counter,
}

impl Draws {
    /// Whether this is the default (for `skip_serializing_if`).
    pub fn is_lanes(&self) -> bool {
        *self == Draws::Lanes
    }
}

/// The counter-based draw of element `index` under `key`: 32 random bits that depend only on
/// `(key, index)`, so any element's draw can be made on its own, in any order, on any
/// device — the "counter" mode of the stochastic codecs (TernGrad's `draws = "counter"`),
/// whose device codecs compute the same function and so write the host's bytes.
///
/// Two rounds of a 32-bit bijective integer hash (Chris Wellons' `lowbias32`, from his
/// hash-prospector search) over `index` mixed with the key's two halves; only 32-bit
/// operations, which every GPU shading language has (WGSL has no 64-bit integers). It is a
/// statistical generator for Bernoulli trials, not a cryptographic one. The key is one
/// draw of the encoder's [`Rng`] per segment, so the stream stays tied to
/// `(seed, step, rank, bucket)` as every other draw of a run.
#[inline(always)]
pub fn counter_bits(key: u64, index: u32) -> u32 {
    let (k0, k1) = (key as u32, (key >> 32) as u32);
    lowbias32(lowbias32(index ^ k0).wrapping_add(k1))
}

/// Wellons' `lowbias32`: a bijective 32-bit mix with low bias.
#[inline(always)]
fn lowbias32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x7feb_352d);
    h ^= h >> 15;
    h = h.wrapping_mul(0x846c_a68b);
    h ^= h >> 16;
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

    /// Each lane is the scalar generator seeded from the parent's draw, word for word.
    #[test]
    fn lanes_are_scalar_generators_seeded_from_the_parent() {
        let mut parent = Rng::seed_from_u64(3);
        let mut lanes = LaneRng::from_rng(&mut parent);
        let mut check = Rng::seed_from_u64(3);
        let mut scalar: Vec<Rng> = (0..4)
            .map(|_| Rng::seed_from_u64(check.next_u64()))
            .collect();
        assert_eq!(parent, check, "four parent draws");
        let mut words = [0u32; 8 * 5 + 3];
        lanes.fill_u32(&mut words);
        for (step, c) in words.chunks(8).enumerate() {
            let want: Vec<u32> = scalar
                .iter_mut()
                .flat_map(|r| {
                    let u = r.next_u64();
                    [u as u32, (u >> 32) as u32]
                })
                .collect();
            assert_eq!(c, &want[..c.len()], "step {step}");
        }
        // The lanes are distinct streams.
        let w = lanes.next_u64x4();
        assert!((0..4).all(|i| (i + 1..4).all(|j| w[i] != w[j])));
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

    /// The counter draws: every bit position balanced and successive indices uncorrelated
    /// over 2^16 indices of one key, different keys giving different streams, and a value
    /// fixed for all time (a device codec must compute the same function).
    #[test]
    fn counter_bits_are_balanced_and_fixed() {
        let n = 1u32 << 16;
        let mut ones = [0u32; 32];
        let mut same_top = 0u32;
        for j in 0..n {
            let b = counter_bits(0x0123_4567_89ab_cdef, j);
            for (k, o) in ones.iter_mut().enumerate() {
                *o += b >> k & 1;
            }
            same_top += u32::from(b >> 31 == counter_bits(0x0123_4567_89ab_cdef, j + 1) >> 31);
        }
        let tol = 4 * (n as f64).sqrt() as u32 / 2;
        for (k, &o) in ones.iter().enumerate() {
            assert!(o.abs_diff(n / 2) <= tol, "bit {k}: {o} of {n}");
        }
        assert!(same_top.abs_diff(n / 2) <= tol, "{same_top}");
        assert_ne!(counter_bits(1, 7), counter_bits(2, 7));
        assert_ne!(counter_bits(1 << 32, 7), counter_bits(2 << 32, 7));
        // Golden value, computed independently (Python, from Wellons' published constants).
        assert_eq!(counter_bits(0x0123_4567_89ab_cdef, 12345), 0xe3b8_2514);
    }
}
