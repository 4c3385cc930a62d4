//! `fp4`: 4-bit floats with a sign, a 3-bit exponent and no mantissa (E3M0), scaled per
//! segment — the format Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) sends
//! its outer gradients in, and usable on any gradient.
//!
//! A segment's scale is `s = max |x|`; a value travels as `sign · s · 2^(e − 7)` for an
//! exponent `e` in `1..=7`, or as 0 (`e = 0`): eight magnitudes `0, s/64, s/32, …, s/2, s`.
//! `|x|` between two neighbouring magnitudes `lo < hi` is rounded
//! * `rounding = "stochastic"` (default): up with probability `(|x| − lo)/(hi − lo)`, so
//!   the code is unbiased (`E[C(x)] = x`; variance at most `(hi − |x|)(|x| − lo)`), as
//!   natural compression does between powers of two;
//! * `rounding = "nearest"`: to the nearer of the two in value (deterministic and biased:
//!   pair it with error feedback).
//!
//! The paper names E3M0 as its 4-bit format; how it scales and rounds is not given in the
//! text this was written from (no reference code was reachable), so the per-segment
//! max-scaling and the unbiased default are dtrain's choices — stated, not inherited.
//!
//! # Body, per segment of `n` values
//! ```text
//! f32 scale s                  finite, ≥ 0
//! ⌈n/2⌉ bytes                  two 4-bit codes a byte, the low nibble first: bit 3 the
//!                              sign, bits 0..2 the exponent e; an unused high nibble is 0
//! ```
//! Bits: `32 + 8⌈n/2⌉`, about 4 bits per value (8× below f32). Aggregation: all-gather;
//! each receiver decodes and sums the payloads.

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::{ConfigError, WireError};
use crate::registry::Method;
use crate::rng::Rng;
use crate::wire::{Reader, Writer};

/// How a value between two magnitudes is rounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Rounding {
    /// Up with the probability that makes the code unbiased (default).
    #[default]
    Stochastic,
    /// To the nearer magnitude.
    Nearest,
}

/// Configuration of [`Fp4`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fp4Config {
    /// `"stochastic"` (default, unbiased) or `"nearest"`.
    #[serde(default)]
    pub rounding: Rounding,
}

impl Method for Fp4Config {
    const NAME: &'static str = "fp4";
    const ABOUT: &'static str =
        "4-bit E3M0 floats (sign + 3-bit exponent) scaled by each tensor's max, unbiased rounding";
    const ID: MethodId = MethodId(25);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(Fp4 {
            rounding: self.rounding,
        }))
    }
}

/// The E3M0 quantizer (see the [module docs](self)).
#[derive(Debug, Clone, Copy, Default)]
pub struct Fp4 {
    /// How values between two magnitudes are rounded.
    pub rounding: Rounding,
}

/// The smallest non-zero magnitude relative to the scale, `2^-6`.
const SMALLEST: f32 = 1.0 / 64.0;

/// The code of `x` for scale `s > 0` and a uniform `u` in `[0, 1)` (`None`: round to
/// nearest).
#[inline]
fn encode(x: f32, s: f32, u: Option<f32>) -> u8 {
    let r = (x.abs() / s).min(1.0);
    // The magnitudes around r, as exponents: lo = 2^(e − 7) (e = 0: lo = 0).
    let (e_lo, lo) = if r < SMALLEST {
        (0u8, 0.0)
    } else {
        // ⌊log₂ r⌋ from the exponent field (r is normal here: r ≥ 2^-6).
        let k = ((r.to_bits() >> 23) & 0xFF) as i32 - 127;
        ((k + 7) as u8, f32::from_bits(((k + 127) as u32) << 23))
    };
    let e = if e_lo == 7 {
        7
    } else {
        let hi = if e_lo == 0 { SMALLEST } else { 2.0 * lo };
        let frac = (r - lo) / (hi - lo);
        let up = match u {
            Some(u) => u < frac,
            None => frac > 0.5,
        };
        e_lo + u8::from(up)
    };
    (u8::from(x.is_sign_negative() && e > 0) << 3) | e
}

/// The value of `code` at scale `s`.
#[inline]
fn decode(code: u8, s: f32) -> f32 {
    let e = code & 7;
    if e == 0 {
        return 0.0;
    }
    let v = s * f32::from_bits(((e as u32 + 120) & 0xFF) << 23);
    if code & 8 != 0 {
        -v
    } else {
        v
    }
}

impl Compressor for Fp4 {
    fn method(&self) -> MethodId {
        Fp4Config::ID
    }

    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }

    fn unbiased(&self) -> bool {
        self.rounding == Rounding::Stochastic
    }

    fn encode_segment(&mut self, x: &[f32], rng: &mut Rng, w: &mut Writer<'_>) {
        let s = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        w.f32(s);
        let out = w.zeroed(x.len().div_ceil(2));
        if s == 0.0 {
            return;
        }
        for (byte, pair) in out.iter_mut().zip(x.chunks(2)) {
            let mut code = |v: f32| {
                let u = match self.rounding {
                    Rounding::Stochastic => {
                        Some((rng.next_u64() >> 40) as f32 / (1u32 << 24) as f32)
                    }
                    Rounding::Nearest => None,
                };
                encode(v, s, u)
            };
            let lo = code(pair[0]);
            let hi = pair.get(1).map_or(0, |&v| code(v));
            *byte = lo | (hi << 4);
        }
    }

    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let s = r.finite_f32("fp4 scale")?;
        if s < 0.0 {
            return Err(WireError::Invalid("fp4: negative scale"));
        }
        let bytes = r.take(out.len().div_ceil(2), "fp4 codes")?;
        if out.len() % 2 == 1 && bytes[bytes.len() - 1] >> 4 != 0 {
            return Err(WireError::Invalid("fp4: the unused code is not zero"));
        }
        for (pair, &b) in out.chunks_mut(2).zip(bytes) {
            pair[0] += decode(b & 0xF, s);
            if let Some(o) = pair.get_mut(1) {
                *o += decode(b >> 4, s);
            }
        }
        Ok(())
    }

    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(32 + 8 * n.div_ceil(2) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, Ctx};

    fn once(rounding: Rounding, x: &[f32], seed: u64) -> Vec<f32> {
        let mut c = Fp4 { rounding };
        let p = compress_new(&mut c, x, &Ctx::default(), &mut Rng::seed_from_u64(seed)).unwrap();
        let mut out = vec![0f32; x.len()];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        out
    }

    /// The eight magnitudes of scale `s`.
    fn levels(s: f32) -> Vec<f32> {
        std::iter::once(0.0)
            .chain((1..=7).map(|e| s * 2f32.powi(e - 7)))
            .collect()
    }

    #[test]
    fn values_land_on_a_neighbouring_magnitude_with_their_sign() {
        let x = [8.0f32, -3.0, 0.3, -0.1, 0.05, 1e-4, 0.0, -2.0, 5.0];
        let l = levels(8.0);
        for rounding in [Rounding::Stochastic, Rounding::Nearest] {
            for seed in 0..40 {
                let y = once(rounding, &x, seed);
                // The scale and the exact magnitudes travel exactly.
                assert_eq!((y[0], y[7]), (8.0, -2.0), "{rounding:?}");
                for (&a, &b) in x.iter().zip(&y) {
                    let i = l.iter().rposition(|&v| v <= a.abs()).unwrap();
                    let ok = b.abs() == l[i] || l.get(i + 1) == Some(&b.abs());
                    assert!(ok, "{rounding:?}: {a} -> {b}");
                    assert!(b == 0.0 || b.signum() == a.signum(), "{a} -> {b}");
                }
            }
        }
        // Nearest: 5 lies between 4 and 8, nearer 4; 0.05 between 0 and 0.125, nearer 0.
        let y = once(Rounding::Nearest, &x, 0);
        assert_eq!((y[8], y[4]), (4.0, 0.0));
        assert_eq!(y[2], 0.25);
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        let x = [1.0f32, 0.3, -0.77, 0.01, -0.004, 0.0625];
        let trials = 20_000;
        let mut sum = [0f64; 6];
        for seed in 0..trials {
            for (s, v) in sum.iter_mut().zip(once(Rounding::Stochastic, &x, seed)) {
                *s += f64::from(v);
            }
        }
        let l: Vec<f64> = levels(1.0).into_iter().map(f64::from).collect();
        for (s, &t) in sum.iter().zip(&x) {
            let a = f64::from(t.abs());
            let i = l.iter().rposition(|&v| v <= a).unwrap();
            let (lo, hi) = (l[i], *l.get(i + 1).unwrap_or(&l[i]));
            let tol = 5.0 * ((hi - a) * (a - lo) / trials as f64).sqrt() + 1e-7;
            let mean = s / trials as f64;
            assert!((mean - f64::from(t)).abs() <= tol, "{t}: mean {mean}");
        }
    }

    #[test]
    fn four_bits_per_value_and_malformed_bodies_refused() {
        let c = Fp4::default();
        assert_eq!(c.segment_bits(8), Some(64));
        assert_eq!(c.segment_bits(3), Some(48));
        let mut out = [0f32; 3];
        let scale = 2f32.to_le_bytes();
        let with = |codes: &[u8], s: [u8; 4]| [s.as_slice(), codes].concat();
        for body in [
            with(&[0x00, 0x10], scale),                 // the unused nibble set
            with(&[0x00], scale),                       // short
            with(&[0x00, 0x00], (-1f32).to_le_bytes()), // negative scale
            with(&[0x00, 0x00], f32::NAN.to_le_bytes()),
        ] {
            assert!(
                c.decode_segment_add(&mut Reader::new(&body), &mut out)
                    .is_err(),
                "{body:?}"
            );
        }
        // e = 7, e = 6 with the sign, e = 1: s, −s/2, s/64.
        out = [0.0; 3];
        c.decode_segment_add(&mut Reader::new(&with(&[0xE7, 0x01], scale)), &mut out)
            .unwrap();
        assert_eq!(out, [2.0, -1.0, 2.0 / 64.0]);
    }
}
