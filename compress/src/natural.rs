//! `natural`: natural compression of Horváth et al., "Natural Compression for Distributed
//! Deep Learning" (2019): each value is rounded at random to one of the two powers of two
//! around it, so that the rounding is unbiased and only a sign and an exponent are sent.
//!
//! For `t` with `2^a ≤ |t| < 2^(a+1)`:
//! ```text
//! C(t) = sign(t) · 2^(a+1)   with probability (|t| − 2^a) / 2^a
//!        sign(t) · 2^a       otherwise                          E[C(t)] = t
//! ```
//! On f32 this is exact bit arithmetic: with exponent field `E` and mantissa `M` (23 bits),
//! the probability of rounding up is `M / 2^23`, drawn with 23 bits of the seeded [`Rng`];
//! the result has mantissa 0 and exponent field `E` or `E + 1`. Subnormals (`E = 0`) round
//! the same way between 0 and the smallest normal `2^-126`, so they stay unbiased too. Two
//! edges are not: a value of at least `2^127` (exponent field 254) is never rounded up to
//! `2^128`, which f32 cannot hold, and keeps its lower power of two.
//!
//! Unbiased, so no error feedback by default (variance at most `t²/8` for normal values, the
//! paper's Theorem 1; a subnormal's can be larger relative to it). Payloads are all-gathered and each receiver decodes and sums them.
//!
//! ## Body, per segment of `n` elements
//! ```text
//! ⌈9n/8⌉ bytes    n codes of 9 bits, LSB-first: bits 0..8 the exponent field E' (0 = zero,
//!                 1..=254 a power of two; 255 is invalid), bit 8 the sign;
//!                 unused bits of the last byte 0
//! ```
//! Bits: `8⌈9n/8⌉`, 9 bits per element.
//!
//! ## Random bits
//! `draws = "lanes"` (the default) takes one draw of the encoder's Rng per element;
//! `draws = "counter"` one per segment, the key of [`counter_bits`], whose top 23 bits for
//! element `j` are its `u` — the mode the device codec computes identically.

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::{ConfigError, WireError};
use crate::registry::Method;
use crate::rng::{counter_bits, Draws, Rng};
use crate::wire::{bytes_for_bits, BitReader, BitWriter, Reader, Writer};

/// Bits per element.
const CODE_BITS: u32 = 9;

/// Configuration of [`Natural`] (it has no parameters).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NaturalConfig {
    /// Where the 23 random bits of each element come from: `lanes` (the default: one draw
    /// of the encoder's Rng per element) or `counter` (the top 23 bits of
    /// [`counter_bits`]`(key, j)`, one key drawn per segment: what a device codec computes
    /// identically).
    #[serde(default, skip_serializing_if = "Draws::is_lanes")]
    pub draws: Draws,
}

impl Method for NaturalConfig {
    const NAME: &'static str = "natural";
    const ABOUT: &'static str =
        "natural compression: unbiased random rounding to a power of two (sign + exponent, 9 bits/element)";
    const ID: MethodId = MethodId(18);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(Natural { draws: self.draws }))
    }
}

/// The natural-compression quantizer (stateless; randomness from the [`Rng`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Natural {
    /// Where the random bits come from.
    pub draws: Draws,
}

/// The 9-bit code of `x` for the 23 random bits `u` (`u < 2^23`).
#[inline]
pub fn encode(x: f32, u: u32) -> u32 {
    let bits = x.to_bits();
    let sign = bits >> 31;
    let e = (bits >> 23) & 0xFF;
    let m = bits & 0x7F_FFFF;
    let up = u32::from(u < m && e < 254);
    (sign << 8) | (e + up)
}

impl Compressor for Natural {
    fn method(&self) -> MethodId {
        NaturalConfig::ID
    }

    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }

    fn unbiased(&self) -> bool {
        true
    }

    fn encode_segment(&mut self, x: &[f32], rng: &mut Rng, w: &mut Writer<'_>) {
        let out = w.zeroed(bytes_for_bits(CODE_BITS as u64 * x.len() as u64));
        let mut bw = BitWriter::new(out);
        match self.draws {
            Draws::Lanes => {
                for &v in x {
                    let u = (rng.next_u64() >> 41) as u32;
                    bw.put(encode(v, u), CODE_BITS);
                }
            }
            Draws::Counter => {
                let key = rng.next_u64();
                for (j, &v) in x.iter().enumerate() {
                    bw.put(encode(v, counter_bits(key, j as u32) >> 9), CODE_BITS);
                }
            }
        }
        bw.finish();
    }

    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let nbits = CODE_BITS as u64 * out.len() as u64;
        let bytes = r.take(bytes_for_bits(nbits), "natural codes")?;
        if !nbits.is_multiple_of(8) && bytes[bytes.len() - 1] >> (nbits % 8) != 0 {
            return Err(WireError::Invalid("natural: unused code bits are not zero"));
        }
        let mut br = BitReader::new(bytes);
        for o in out.iter_mut() {
            let code = br.get(CODE_BITS);
            let e = code & 0xFF;
            if e == 0xFF {
                return Err(WireError::Invalid(
                    "natural: exponent 255 is not a power of two",
                ));
            }
            *o += f32::from_bits(((code >> 8) << 31) | (e << 23));
        }
        Ok(())
    }

    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(8 * bytes_for_bits(CODE_BITS as u64 * n as u64) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, Ctx};

    fn once(x: &[f32], seed: u64) -> Vec<f32> {
        once_drawn(Draws::Lanes, x, seed)
    }

    fn once_drawn(draws: Draws, x: &[f32], seed: u64) -> Vec<f32> {
        let mut c = Natural { draws };
        let p = compress_new(&mut c, x, &Ctx::default(), &mut Rng::seed_from_u64(seed)).unwrap();
        let mut out = vec![0f32; x.len()];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        out
    }

    #[test]
    fn rounds_to_one_of_the_two_neighbouring_powers_of_two() {
        let x = [3.0f32, -0.3, 1e-3, 5e-40, 1.0, -0.25, 0.0, -0.0, 1.5e38];
        for seed in 0..50 {
            let y = once(&x, seed);
            for (&a, &b) in x.iter().zip(&y) {
                if a == 0.0 {
                    assert_eq!(b, 0.0);
                    continue;
                }
                assert_eq!(a.is_sign_negative(), b.is_sign_negative(), "{a} -> {b}");
                let lo = if a.abs() < f32::MIN_POSITIVE {
                    0.0
                } else {
                    f32::from_bits(a.abs().to_bits() & 0x7F80_0000)
                };
                let hi = if lo == 0.0 {
                    f32::MIN_POSITIVE
                } else {
                    2.0 * lo
                };
                assert!(b.abs() == lo || b.abs() == hi, "{a} -> {b}");
            }
            // Powers of two are exact.
            assert_eq!(y[4], 1.0);
            assert_eq!(y[5], -0.25);
        }
        // ≥ 2^127 is never rounded up to 2^128 (not an f32).
        let big = f32::MAX;
        for seed in 0..20 {
            assert_eq!(once(&[big], seed)[0], 2f32.powi(127));
        }
    }

    /// Unbiased with either source of random bits.
    #[test]
    fn unbiased_over_seeds() {
        for draws in [Draws::Lanes, Draws::Counter] {
            unbiased_with(draws);
        }
    }

    fn unbiased_with(draws: Draws) {
        let x = [3.0f32, -0.3, 1e-3, 7.9, 5e-40, -1.0e-39];
        let trials = 20_000;
        let mut sum = [0f64; 6];
        for seed in 0..trials {
            for (s, v) in sum.iter_mut().zip(once_drawn(draws, &x, seed)) {
                *s += f64::from(v);
            }
        }
        for (s, &t) in sum.iter().zip(&x) {
            let mean = s / trials as f64;
            // Bernoulli between the two powers: variance (hi − |t|)(|t| − lo) (at most t²/8
            // for normal values); 5 standard errors of the mean.
            let a = f64::from(t.abs());
            let lo = if t.abs() < f32::MIN_POSITIVE {
                0.0
            } else {
                f64::from(f32::from_bits(t.abs().to_bits() & 0x7F80_0000))
            };
            let hi = if lo == 0.0 {
                f64::from(f32::MIN_POSITIVE)
            } else {
                2.0 * lo
            };
            let tol = 5.0 * ((hi - a) * (a - lo) / trials as f64).sqrt();
            assert!(
                (mean - f64::from(t)).abs() <= tol,
                "{draws:?} {t}: mean {mean}"
            );
        }
    }

    #[test]
    fn nine_bits_per_element_and_malformed_codes_refused() {
        let c = Natural::default();
        assert_eq!(c.segment_bits(8), Some(72));
        assert_eq!(c.segment_bits(1), Some(16));
        let mut out = [0f32; 1];
        // Exponent 255; a stray bit past the 9th; a short body.
        for body in [vec![0xFF, 0x00], vec![0x7F, 0x02], vec![0x7F]] {
            assert!(
                c.decode_segment_add(&mut Reader::new(&body), &mut out)
                    .is_err(),
                "{body:?}"
            );
        }
        // E' = 127, sign 1: −1.
        c.decode_segment_add(&mut Reader::new(&[0x7F, 0x01]), &mut out)
            .unwrap();
        assert_eq!(out, [-1.0]);
    }
}
