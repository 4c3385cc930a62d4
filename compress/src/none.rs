//! `none`: uncompressed fp32 (the baseline every table is measured against).
//!
//! Body: `n` little-endian `f32`. Bits per element: 32. Aggregation: dense all-reduce.

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::ConfigError;
use crate::error::WireError;
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
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let b = r.take_items(out.len(), 4, "fp32 values")?;
        for (i, o) in out.iter_mut().enumerate() {
            *o += f32_at(b, i);
        }
        Ok(())
    }
    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(32 * n as u64)
    }
}
