//! `fp16`: IEEE half precision (round to nearest even), as in Horovod / GRACE.
//!
//! Body: `n` little-endian binary16 values. Bits per element: 16. Values beyond ±65504
//! saturate to ±65504 rather than becoming infinite (a gradient must stay finite), and
//! values below 2⁻²⁴ flush to zero. Aggregation: dense (decode, then all-reduce in f32).

use half::f16;
use half::slice::HalfFloatSliceExt;
use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::ConfigError;
use crate::error::WireError;
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

const BLOCK: usize = 4096;

impl Compressor for Fp16 {
    fn method(&self) -> MethodId {
        Fp16Config::ID
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Dense
    }
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        self.buf.resize(BLOCK.min(x.len()), f16::ZERO);
        let out = w.zeroed(2 * x.len());
        for (xs, os) in x.chunks(BLOCK).zip(out.chunks_mut(2 * BLOCK)) {
            let h = &mut self.buf[..xs.len()];
            h.convert_from_f32_slice(xs);
            for (hv, o) in h.iter_mut().zip(os.chunks_exact_mut(2)) {
                let mut v = *hv;
                if v.is_infinite() {
                    v = if v.is_sign_negative() {
                        f16::MIN
                    } else {
                        f16::MAX
                    };
                }
                o.copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let b = r.take_items(out.len(), 2, "fp16 values")?;
        let mut h = [f16::ZERO; BLOCK];
        let mut f = [0f32; BLOCK];
        for (os, bs) in out.chunks_mut(BLOCK).zip(b.chunks(2 * BLOCK)) {
            let n = os.len();
            for (hv, c) in h[..n].iter_mut().zip(bs.chunks_exact(2)) {
                *hv = f16::from_bits(u16::from_le_bytes([c[0], c[1]]));
            }
            h[..n].convert_to_f32_slice(&mut f[..n]);
            for (o, v) in os.iter_mut().zip(&f[..n]) {
                if !v.is_finite() {
                    return Err(WireError::Invalid("non-finite fp16 value"));
                }
                *o += v;
            }
        }
        Ok(())
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
