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
use crate::memory::MemoryConfig;
use crate::registry::Method;
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

impl Method for TopKConfig {
    const NAME: &'static str = "topk";
    const ABOUT: &'static str =
        "exact Top-k sparsification, index list or bitmap (ratio = density)";
    const ID: MethodId = MethodId(3);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()?))
    }

    fn default_memory(&self) -> MemoryConfig {
        MemoryConfig::RESIDUAL
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
        TopKConfig::ID
    }
    fn ratio_metric(&self) -> Option<(&'static str, f64)> {
        Some(("density", self.ratio))
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
    /// `None`: the index set's size depends on where the entries are (see [`sparse`]).
    fn segment_bits(&self, _n: usize) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, Ctx};

    fn run(c: &mut TopK, x: &[f32]) -> (Vec<f32>, usize) {
        let p = compress_new(c, x, &Ctx::default(), &mut Rng::seed_from_u64(0)).unwrap();
        let mut out = vec![0f32; x.len()];
        decompress(c, p.as_bytes(), &mut out).unwrap();
        (out, p.encoded_len())
    }

    #[test]
    fn keeps_exactly_k_largest_and_contracts() {
        let mut rng = Rng::seed_from_u64(11);
        for &(n, ratio) in &[
            (1000usize, 0.01),
            (1000, 0.1),
            (1000, 0.5),
            (37, 0.2),
            (100_000, 0.001),
        ] {
            let x: Vec<f32> = (0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect();
            let mut c = TopKConfig { ratio }.init().unwrap();
            let (out, _) = run(&mut c, &x);
            let k = k_for(n, ratio);
            let kept: Vec<usize> = (0..n).filter(|&i| out[i] != 0.0).collect();
            assert_eq!(kept.len(), k, "n {n} ratio {ratio}");
            let min_kept = kept
                .iter()
                .map(|&i| x[i].abs())
                .fold(f32::INFINITY, f32::min);
            let max_dropped = (0..n)
                .filter(|i| out[*i] == 0.0)
                .map(|i| x[i].abs())
                .fold(0.0, f32::max);
            assert!(min_kept >= max_dropped);
            for &i in &kept {
                assert_eq!(out[i], x[i], "values are sent exactly");
            }
            let err: f64 = (0..n).map(|i| ((x[i] - out[i]) as f64).powi(2)).sum();
            let norm: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
            assert!(err <= (1.0 - k as f64 / n as f64) * norm + 1e-9);
        }
    }

    #[test]
    fn ties_go_to_the_smaller_index_and_zero_vectors_are_fine() {
        let x = [1.0f32, -1.0, 1.0, 1.0, 0.5];
        let mut c = TopKConfig { ratio: 0.4 }.init().unwrap();
        let (out, _) = run(&mut c, &x);
        assert_eq!(out, [1.0, -1.0, 0.0, 0.0, 0.0]);
        let z = [0.0f32; 10];
        let (out, _) = run(&mut c, &z);
        assert_eq!(out, z);
    }

    #[test]
    fn index_sets_take_the_smallest_layout() {
        let x: Vec<f32> = (0..1024).map(|i| i as f32).collect();
        let mut sparse = TopKConfig { ratio: 0.01 }.init().unwrap();
        let mut dense = TopKConfig { ratio: 0.25 }.init().unwrap();
        let (_, l1) = run(&mut sparse, &x);
        let (_, l2) = run(&mut dense, &x);
        // Header 12 bytes. The kept entries are the last ones: one long gap, then gaps of
        // zero, which Rice codes in a few bits each (a u32 list would be 5 + 8k bytes).
        let idx = |k: u32| (1024 - k..1024).collect::<Vec<u32>>();
        assert_eq!(l1, 12 + sparse::indexed_len(1024, &idx(11)));
        assert!(l1 < 12 + 5 + 8 * 11);
        assert_eq!(l2, 12 + sparse::indexed_len(1024, &idx(256)));
        assert!(l2 <= 12 + 5 + 128 + 4 * 256, "no worse than the bitmap");
        // Spread entries of a long segment: about 1.5 bytes per index instead of 4.
        let n = 1_000_000;
        let y: Vec<f32> = (0..n as u64)
            .map(|i| ((i * 7919) % 10_007) as f32)
            .collect();
        let mut c = TopKConfig { ratio: 0.001 }.init().unwrap();
        let (out, len) = run(&mut c, &y);
        let k = out.iter().filter(|v| **v != 0.0).count();
        assert_eq!(k, 1000);
        let per_index = (len - 12 - 5 - 4 * k) as f64 / k as f64;
        assert!(per_index < 2.0, "{per_index} bytes per index");
    }

    #[test]
    fn config_rejects_bad_ratio() {
        for r in [0.0, -0.1, 1.01, f64::NAN] {
            assert!(TopKConfig { ratio: r }.init().is_err());
        }
    }
}
