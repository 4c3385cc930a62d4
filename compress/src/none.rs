//! `none`: uncompressed fp32 (the baseline every table is measured against).
//!
//! Body: `n` little-endian `f32`. Bits per element: 32. Aggregation: dense all-reduce.

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::ConfigError;
use crate::error::WireError;
use crate::finite::exponent_all_ones;
use crate::registry::Method;
use crate::rng::Rng;
use crate::wire::{f32_at, Reader, Writer};

/// Configuration of [`NoCompression`] (it has no parameters).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoneConfig {}

impl Method for NoneConfig {
    const NAME: &'static str = "none";
    const ABOUT: &'static str = "uncompressed fp32 (32 bits/element)";
    const ID: MethodId = MethodId(1);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()))
    }

    fn passthrough(&self) -> bool {
        true
    }
}

impl NoneConfig {
    /// Builds the compressor.
    pub fn init(&self) -> NoCompression {
        NoCompression
    }
}

/// The identity "compressor".
#[derive(Debug, Default, Clone)]
pub struct NoCompression;

impl Compressor for NoCompression {
    fn method(&self) -> MethodId {
        NoneConfig::ID
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Dense
    }
    fn unbiased(&self) -> bool {
        true
    }
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        w.f32_slice(x);
    }
    /// A NaN or an infinity is refused (`Invalid`), as fp16's and bf16's decoders refuse
    /// theirs: an encoder never sends one (the trainer skips a step whose gradient has one),
    /// so it is a damaged payload; `out` may then hold a partial sum.
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let b = r.take_items(out.len(), 4, "fp32 values")?;
        let mut bad = false;
        for (i, o) in out.iter_mut().enumerate() {
            let v = f32_at(b, i);
            bad |= exponent_all_ones(v);
            *o += v;
        }
        if bad {
            return Err(WireError::Invalid("non-finite fp32 value"));
        }
        Ok(())
    }
    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(32 * n as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress_add, Ctx};

    /// A payload decodes to its values; one whose value was damaged into a NaN or an
    /// infinity (an exponent bit flipped, as the fuzz test found) is refused.
    #[test]
    fn non_finite_values_are_refused() {
        let mut c = NoneConfig {}.init();
        let g: Vec<f32> = (0..64).map(|i| 1.0 + i as f32 / 64.0).collect();
        let p = compress_new(&mut c, &g, &Ctx::default(), &mut Rng::seed_from_u64(1)).unwrap();
        let mut out = vec![0.0f32; 64];
        decompress_add(&c, p.as_bytes(), &mut out).unwrap();
        assert_eq!(out, g);
        let at = p.as_bytes().len() - 4 * (64 - 30);
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut bytes = p.as_bytes().to_vec();
            bytes[at..at + 4].copy_from_slice(&bad.to_le_bytes());
            let r = decompress_add(&c, &bytes, &mut vec![0.0f32; 64]);
            assert_eq!(r, Err(WireError::Invalid("non-finite fp32 value")), "{bad}");
        }
    }
}
