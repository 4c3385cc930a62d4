//! `int8`: symmetric 8-bit linear quantization with one f32 scale per segment.
//!
//! Body per segment: the scale `s = max|x| / 127` (f32), then `n` codes `round(x / s)` as
//! i8. Bits per element: 8 (+ 32 per segment). Aggregation: all-gather (the scales differ
//! between workers, so the codes cannot be summed as they are).

use serde::{Deserialize, Serialize};

use dtrain_compress::wire::{Reader, Writer};
use dtrain_compress::{
    Aggregation, Compressor, ConfigError, MemoryConfig, Method, MethodId, Rng, WireError,
};

/// Configuration of [`Int8`]: `[compress] kind = "int8"`, no parameters.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Int8Config {}

impl Method for Int8Config {
    const NAME: &'static str = "int8";
    const ABOUT: &'static str = "symmetric 8-bit linear quantization, one scale per tensor";
    const ID: MethodId = MethodId(200);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(Int8))
    }

    /// Round-to-nearest is biased: error feedback by default.
    fn default_memory(&self) -> MemoryConfig {
        MemoryConfig::RESIDUAL
    }
}

/// The compressor: stateless.
#[derive(Debug, Clone, Default)]
pub struct Int8;

impl Compressor for Int8 {
    fn method(&self) -> MethodId {
        Int8Config::ID
    }

    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }

    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = max / 127.0;
        w.f32(scale);
        for &v in x {
            let code = if scale > 0.0 {
                (v / scale).round()
            } else {
                0.0
            };
            w.u8(code.clamp(-127.0, 127.0) as i8 as u8);
        }
    }

    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let scale = r.f32("int8 scale")?;
        if !(scale.is_finite() && scale >= 0.0) {
            return Err(WireError::Invalid("int8 scale is negative or not finite"));
        }
        let codes = r.take_items(out.len(), 1, "int8 codes")?;
        for (o, &c) in out.iter_mut().zip(codes) {
            *o += scale * f32::from(c as i8);
        }
        Ok(())
    }

    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(32 + 8 * n as u64)
    }
}
