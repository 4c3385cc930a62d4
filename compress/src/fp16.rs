//! `fp16`: IEEE half precision (round to nearest even), as in Horovod / GRACE.
//!
//! Body: `n` little-endian binary16 values. Bits per element: 16. Values beyond ±65504
//! saturate to ±65504 rather than becoming infinite (a gradient must stay finite), and
//! values below 2⁻²⁴ flush to zero. Aggregation: dense (decode, then all-reduce in f32).

use half::f16;
use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::ConfigError;
use crate::error::WireError;
use crate::half16;
use crate::registry::Method;
use crate::rng::Rng;
use crate::wire::{Reader, Writer};

/// Configuration of [`Fp16`] (no parameters).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fp16Config {}

impl Method for Fp16Config {
    const NAME: &'static str = "fp16";
    const ABOUT: &'static str = "IEEE half precision (16 bits/element)";
    const ID: MethodId = MethodId(2);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()))
    }
}

impl Fp16Config {
    /// Builds the compressor.
    pub fn init(&self) -> Fp16 {
        Fp16::default()
    }
}

/// Half-precision cast.
#[derive(Debug, Default, Clone)]
pub struct Fp16 {
    buf: Vec<f16>,
}

impl Compressor for Fp16 {
    fn method(&self) -> MethodId {
        Fp16Config::ID
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Dense
    }
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        half16::encode(x, &mut self.buf, w);
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        half16::decode_add::<f16>(r, out, "fp16 values", "non-finite fp16 value")
    }
    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(16 * n as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, Ctx};

    #[test]
    fn relative_error_and_saturation() {
        let x = [1.0f32, -0.333, 1e-3, 65504.0, 1e6, -1e6, 1e-9, 0.0];
        let mut c = Fp16Config::default().init();
        let p = compress_new(&mut c, &x, &Ctx::default(), &mut Rng::seed_from_u64(0)).unwrap();
        let mut out = [0f32; 8];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        for i in 0..3 {
            assert!((out[i] - x[i]).abs() <= x[i].abs() * 2f32.powi(-11));
        }
        assert_eq!(out[3], 65504.0);
        assert_eq!(out[4], 65504.0, "saturates instead of inf");
        assert_eq!(out[5], -65504.0);
        assert_eq!(out[6], 0.0, "below the smallest subnormal flushes to zero");
        assert_eq!(out[7], 0.0);
    }
}
