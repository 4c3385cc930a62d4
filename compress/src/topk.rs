//! `topk`: keep the `k = ⌈ρ·n⌉` largest-magnitude entries of each segment (ALGORITHMS.md §9).
//!
//! Selection is exact (ties → smaller index) and O(n) on average ([`crate::select`]).
//!
//! Body, per segment of `n` elements:
//! ```text
//! u8  layout   0 = index list, 1 = bitmap
//! u32 k
//! list:   k × u32 index (ascending), k × f32 value
//! bitmap: ⌈n/8⌉ bytes (bit i set ⇔ i kept, LSB-first), k × f32 value (ascending index)
//! ```
//! The smaller layout is chosen: the bitmap wins when `k/n > 1/32` (ALGORITHMS.md §0.5).
//! Bits per segment: `40 + min(64k, 8⌈n/8⌉ + 32k)`. Biased (a δ-contraction with
//! δ = k/n); use error feedback. Aggregation: all-gather.

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::{ConfigError, WireError};
use crate::rng::Rng;
use crate::select::{abs_key, top_k, Scratch};
use crate::sparse;
use crate::wire::{Reader, Writer};

/// Configuration of [`TopK`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopKConfig {
    /// Density ρ: the fraction of each segment kept, in (0, 1]. Default 0.01.
    #[serde(default = "default_ratio")]
    pub ratio: f64,
}

fn default_ratio() -> f64 {
    0.01
}

impl Default for TopKConfig {
    fn default() -> Self {
        TopKConfig {
            ratio: default_ratio(),
        }
    }
}

impl TopKConfig {
    /// Checks the parameters and builds the compressor.
    pub fn init(&self) -> Result<TopK, ConfigError> {
        check_ratio("ratio", self.ratio)?;
        Ok(TopK {
            ratio: self.ratio,
            scratch: Scratch::default(),
            idx: Vec::new(),
        })
    }
}

/// Checks a density parameter lies in (0, 1].
pub(crate) fn check_ratio(field: &'static str, r: f64) -> Result<(), ConfigError> {
    if !(r > 0.0 && r <= 1.0) {
        return Err(ConfigError::new(
            field,
            format!("must be in (0, 1], got {r}"),
        ));
    }
    Ok(())
}

/// Entries kept for a segment of `n` elements at density `ratio`: `⌈ρn⌉`, at least 1.
pub fn k_for(n: usize, ratio: f64) -> usize {
    if n == 0 {
        return 0;
    }
    ((ratio * n as f64).ceil() as usize).clamp(1, n)
}

/// Exact Top-k sparsifier.
#[derive(Debug, Clone)]
pub struct TopK {
    ratio: f64,
    scratch: Scratch,
    idx: Vec<u32>,
}

impl Compressor for TopK {
    fn method(&self) -> MethodId {
        MethodId::TopK
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        let k = k_for(x.len(), self.ratio);
        top_k(
            x.len(),
            k,
            |i| abs_key(x[i]),
            &mut self.scratch,
            &mut self.idx,
        );
        debug_assert_eq!(self.idx.len(), k);
        sparse::write_indexed(x.len(), &self.idx, |i| x[i as usize], w);
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        sparse::read_indexed_add(r, out)
    }
    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(sparse::indexed_bits(n, k_for(n, self.ratio)))
    }
}
