//! `bf16`: bfloat16 (the upper 16 bits of an `f32`: 8 exponent bits, 7 mantissa bits),
//! rounded to nearest even, as PyTorch's `bf16_compress_hook` casts the gradient bucket.
//!
//! Body: `n` little-endian bfloat16 values. Bits per element: 16. The exponent range is
//! `f32`'s, so nothing flushes that `f32` keeps; the relative error is at most 2⁻⁸. A value
//! that would round up past the largest bfloat16 (±3.3895·10³⁸, i.e. the top of the `f32`
//! range) saturates to it rather than becoming infinite (a gradient must stay finite).
//! Aggregation: dense, like `fp16` (decode, then all-reduce in `f32`; PyTorch all-reduces
//! the bfloat16 values themselves and decompresses the sum).

use half::bf16;
use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::{ConfigError, WireError};
use crate::half16;
use crate::registry::Method;
use crate::rng::Rng;
use crate::wire::{Reader, Writer};

/// Configuration of [`Bf16`] (no parameters).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bf16Config {}

impl Method for Bf16Config {
    const NAME: &'static str = "bf16";
    const ABOUT: &'static str = "bfloat16, round to nearest even (16 bits/element)";
    const ID: MethodId = MethodId(21);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(Bf16::default()))
    }
}

/// The bfloat16 cast.
#[derive(Debug, Default, Clone)]
pub struct Bf16 {
    buf: Vec<bf16>,
}

impl Compressor for Bf16 {
    fn method(&self) -> MethodId {
        Bf16Config::ID
    }

    fn aggregation(&self) -> Aggregation {
        Aggregation::Dense
    }

    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        half16::encode(x, &mut self.buf, w);
    }

    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        half16::decode_add::<bf16>(r, out, "bf16 values", "non-finite bf16 value")
    }

    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(16 * n as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, Ctx};

    fn round_trip(x: &[f32]) -> Vec<f32> {
        let mut c = Bf16::default();
        let p = compress_new(&mut c, x, &Ctx::default(), &mut Rng::seed_from_u64(0)).unwrap();
        let mut out = vec![0f32; x.len()];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        out
    }

    #[test]
    fn round_to_nearest_even_by_hand() {
        // 1 + 2⁻⁸ is halfway between 1 and 1 + 2⁻⁷: ties to the even mantissa (1.0);
        // 1 + 3·2⁻⁸ is halfway between 1 + 2⁻⁷ and 1 + 2⁻⁶: ties to 1 + 2⁻⁶.
        let h = 2f32.powi(-8);
        let x = [1.0 + h, 1.0 + 3.0 * h, 1.0 + 1.5 * h, -2.0 - h, 0.0, -0.0];
        let out = round_trip(&x);
        assert_eq!(out[0], 1.0);
        assert_eq!(out[1], 1.0 + 4.0 * h);
        assert_eq!(out[2], 1.0 + 2.0 * h, "above the halfway point rounds up");
        assert_eq!(out[3], -2.0);
        assert_eq!(out[4].to_bits(), 0);
        assert_eq!(out[5], 0.0);
    }

    #[test]
    fn relative_error_saturation_and_the_f32_exponent_range() {
        let mut r = Rng::seed_from_u64(5);
        let x: Vec<f32> = (0..10_000)
            .map(|_| (r.next_f32() - 0.5) * 10f32.powi((r.next_f32() * 60.0) as i32 - 30))
            .chain([f32::MAX, -f32::MAX, 1e-38, f32::MIN_POSITIVE])
            .collect();
        let out = round_trip(&x);
        for (i, (&a, &b)) in x.iter().zip(&out).enumerate().take(10_000) {
            assert!((a - b).abs() <= a.abs() * 2f32.powi(-8), "{i}: {a} vs {b}");
        }
        let n = x.len();
        assert_eq!(out[n - 4], bf16::MAX.to_f32(), "saturates instead of inf");
        assert_eq!(out[n - 3], bf16::MIN.to_f32());
        assert!(out[n - 2] > 0.0, "no flush to zero where f32 has none");
        assert_eq!(out[n - 1], f32::MIN_POSITIVE, "a power of two is exact");
    }

    #[test]
    fn non_finite_values_on_the_wire_are_refused() {
        let c = Bf16::default();
        let mut out = [0f32; 2];
        for bits in [bf16::INFINITY.to_bits(), bf16::NAN.to_bits()] {
            let body = [
                1.0f32.to_bits().to_le_bytes()[2..].to_vec(),
                bits.to_le_bytes().to_vec(),
            ]
            .concat();
            assert!(c
                .decode_segment_add(&mut Reader::new(&body), &mut out)
                .is_err());
        }
    }
}
