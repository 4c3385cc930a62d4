//! `randomk`: keep `k = ⌈ρ·n⌉` uniformly chosen entries, scaled by `n/k` (ALGORITHMS.md §9).
//!
//! Unbiased, with variance `(n/k − 1)·‖v‖²`. The indices are **not sent**: they are
//! regenerated from a 64-bit seed carried in the body (Floyd's sampling, k draws).
//!
//! With `shared = true` (default) the seed depends on `(seed, step, bucket, segment)` but not
//! on the rank, so every worker keeps the same index set and the value lanes can be summed
//! by an all-reduce (aggregation `Summable`, as GRACE does). With `shared = false` each rank
//! draws its own set and payloads are all-gathered.
//!
//! Body, per segment: `u64 seed, u32 k, k × f32 value`. Bits per segment: `96 + 32k`.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, Ctx, MethodId, Touched};
use crate::error::{ConfigError, WireError};
use crate::registry::Method;
use crate::rng::{derive_seed, Rng};
use crate::topk::{check_ratio, k_for};
use crate::wire::{f32_at, Reader, Writer};

/// Configuration of [`RandomK`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomKConfig {
    /// Density ρ in (0, 1]. Default 0.01.
    #[serde(default = "default_ratio")]
    pub ratio: f64,
    /// Same index set on every rank (summable). Default true.
    #[serde(default = "yes")]
    pub shared: bool,
    /// Seed of the index streams (combined with step, bucket and segment). Default 0.
    #[serde(default)]
    pub seed: u64,
}

fn default_ratio() -> f64 {
    0.01
}
fn yes() -> bool {
    true
}

impl Default for RandomKConfig {
    fn default() -> Self {
        RandomKConfig {
            ratio: default_ratio(),
            shared: true,
            seed: 0,
        }
    }
}

impl Method for RandomKConfig {
    const NAME: &'static str = "randomk";
    const ABOUT: &'static str =
        "seeded unbiased Random-k; indices regenerated from the seed, not sent";
    const ID: MethodId = MethodId(4);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()?))
    }
}

impl RandomKConfig {
    /// Checks the parameters and builds the compressor.
    pub fn init(&self) -> Result<RandomK, ConfigError> {
        check_ratio("ratio", self.ratio)?;
        Ok(RandomK {
            cfg: self.clone(),
            base: 0,
            segment: 0,
            idx: Vec::new(),
            seen: Vec::new(),
        })
    }
}

/// Seeded Random-k sparsifier.
#[derive(Debug, Clone)]
pub struct RandomK {
    cfg: RandomKConfig,
    base: u64,
    segment: u64,
    idx: Vec<u32>,
    seen: Vec<u64>,
}

/// Fills `out` with `k` distinct indices of `0..n` drawn by Floyd's algorithm from `seed`.
/// `seen` is scratch of at least `⌈n/64⌉` words.
pub fn sample_indices(n: usize, k: usize, seed: u64, seen: &mut Vec<u64>, out: &mut Vec<u32>) {
    out.clear();
    seen.clear();
    seen.resize(n.div_ceil(64), 0);
    let mut rng = Rng::seed_from_u64(seed);
    for j in (n - k)..n {
        let t = rng.below(j as u64 + 1) as usize;
        let pick = if seen[t >> 6] & (1 << (t & 63)) != 0 {
            j
        } else {
            t
        };
        seen[pick >> 6] |= 1 << (pick & 63);
        out.push(pick as u32);
    }
}

impl RandomK {
    fn body_len(k: usize) -> usize {
        8 + 4 + 4 * k
    }
}

impl Compressor for RandomK {
    fn method(&self) -> MethodId {
        RandomKConfig::ID
    }
    fn ratio_metric(&self) -> Option<(&'static str, f64)> {
        Some(("density", self.cfg.ratio))
    }
    fn aggregation(&self) -> Aggregation {
        if self.cfg.shared {
            Aggregation::Summable
        } else {
            Aggregation::Gather
        }
    }
    fn unbiased(&self) -> bool {
        true
    }
    fn begin(&mut self, _grad: &[f32], ctx: &Ctx<'_>) {
        let rank = if self.cfg.shared {
            0
        } else {
            ctx.rank as u64 + 1
        };
        self.base = derive_seed(self.cfg.seed, ctx.step, rank, ctx.bucket);
        self.segment = 0;
    }
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        let n = x.len();
        let k = k_for(n, self.cfg.ratio);
        let seed = derive_seed(self.base, self.segment, 0, 0);
        self.segment += 1;
        sample_indices(n, k, seed, &mut self.seen, &mut self.idx);
        let scale = n as f32 / k as f32;
        w.u64(seed);
        w.u32(k as u32);
        let vals = w.zeroed(4 * k);
        for (o, &i) in vals.chunks_exact_mut(4).zip(&self.idx) {
            o.copy_from_slice(&(x[i as usize] * scale).to_le_bytes());
        }
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        read_add(r, out, |_| {})
    }
    fn decode_segment_add_touched(
        &self,
        r: &mut Reader<'_>,
        out: &mut [f32],
        touched: &mut Touched,
    ) -> Result<(), WireError> {
        read_add(r, out, |i| touched.mark(i))
    }
    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(8 * Self::body_len(k_for(n, self.cfg.ratio)) as u64)
    }
    fn segment_lane(&self, r: &mut Reader<'_>, len: usize) -> Result<Range<usize>, WireError> {
        if !self.cfg.shared {
            return Err(WireError::Invalid(
                "random-k without shared indices is not summable",
            ));
        }
        r.u64("random-k seed")?;
        let k = r.u32("random-k count")? as usize;
        if k > len {
            return Err(WireError::Invalid("more random-k entries than elements"));
        }
        let start = r.position();
        r.take_items(k, 4, "random-k values")?;
        Ok(start..r.position())
    }
}

/// Decodes a segment's body (seed, count, values) and adds it into `out`, calling `mark`
/// with each index it adds at.
fn read_add(
    r: &mut Reader<'_>,
    out: &mut [f32],
    mut mark: impl FnMut(usize),
) -> Result<(), WireError> {
    let n = out.len();
    let seed = r.u64("random-k seed")?;
    let k = r.u32("random-k count")? as usize;
    if k > n {
        return Err(WireError::Invalid("more random-k entries than elements"));
    }
    let vals = r.take_items(k, 4, "random-k values")?;
    let mut seen = Vec::new();
    let mut idx = Vec::with_capacity(k);
    sample_indices(n, k, seed, &mut seen, &mut idx);
    for (j, &i) in idx.iter().enumerate() {
        let v = f32_at(vals, j);
        if !v.is_finite() {
            return Err(WireError::Invalid("non-finite random-k value"));
        }
        out[i as usize] += v;
        mark(i as usize);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, Ctx};

    #[test]
    fn floyd_draws_k_distinct_indices() {
        let mut seen = Vec::new();
        let mut out = Vec::new();
        for (n, k) in [(1usize, 1usize), (10, 10), (1000, 7), (1000, 999)] {
            sample_indices(n, k, 42, &mut seen, &mut out);
            let mut s = out.clone();
            s.sort();
            s.dedup();
            assert_eq!(s.len(), k);
            assert!(s.iter().all(|&i| (i as usize) < n));
        }
    }

    #[test]
    fn unbiased_by_monte_carlo() {
        let n = 40;
        let x: Vec<f32> = (0..n).map(|i| (i as f32 - 17.0) / 5.0).collect();
        let mut c = RandomKConfig {
            ratio: 0.1,
            shared: false,
            seed: 1,
        }
        .init()
        .unwrap();
        let t = 20_000;
        let mut mean = vec![0f64; n];
        let mut out = vec![0f32; n];
        for step in 0..t {
            let ctx = Ctx {
                step,
                ..Ctx::default()
            };
            let p = compress_new(&mut c, &x, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
            decompress(&c, p.as_bytes(), &mut out).unwrap();
            for i in 0..n {
                mean[i] += out[i] as f64 / t as f64;
            }
        }
        // Var of one coordinate = x²(n/k − 1); standard error = |x|·sqrt((n/k−1)/T).
        let k = k_for(n, 0.1) as f64;
        for i in 0..n {
            let se = (x[i] as f64).abs() * ((n as f64 / k - 1.0) / t as f64).sqrt();
            assert!(
                (mean[i] - x[i] as f64).abs() <= 5.0 * se + 1e-9,
                "coord {i}: {} vs {}",
                mean[i],
                x[i]
            );
        }
    }

    #[test]
    fn shared_indices_agree_across_ranks_and_sum_in_place() {
        let x: Vec<f32> = (0..500).map(|i| i as f32).collect();
        let y: Vec<f32> = (0..500).map(|i| -(i as f32) * 0.5).collect();
        let mut c = RandomKConfig::default().init().unwrap();
        let cx = Ctx {
            step: 4,
            rank: 0,
            bucket: 2,
            segments: &[],
        };
        let cy = Ctx { rank: 3, ..cx };
        let px = compress_new(&mut c, &x, &cx, &mut Rng::seed_from_u64(0)).unwrap();
        let py = compress_new(&mut c, &y, &cy, &mut Rng::seed_from_u64(9)).unwrap();
        let lx = crate::compressor::summable_lanes(&c, px.as_bytes()).unwrap();
        let ly = crate::compressor::summable_lanes(&c, py.as_bytes()).unwrap();
        assert_eq!(lx, ly);
        assert_eq!(lx.len(), 1);
        // Sum the value lanes as an all-reduce would, then decode once.
        let mut summed = px.as_bytes().to_vec();
        crate::compressor::sum_lanes(&c, &mut summed, py.as_bytes()).unwrap();
        let mut d_sum = vec![0f32; 500];
        decompress(&c, &summed, &mut d_sum).unwrap();
        let mut d_sep = vec![0f32; 500];
        crate::compressor::decompress_add(&c, px.as_bytes(), &mut d_sep).unwrap();
        crate::compressor::decompress_add(&c, py.as_bytes(), &mut d_sep).unwrap();
        for i in 0..500 {
            assert!((d_sum[i] - d_sep[i]).abs() <= 1e-3 * d_sep[i].abs().max(1.0));
        }
        // Unshared: ranks draw different sets.
        let mut u = RandomKConfig {
            shared: false,
            ..RandomKConfig::default()
        }
        .init()
        .unwrap();
        let a = compress_new(&mut u, &x, &cx, &mut Rng::seed_from_u64(0)).unwrap();
        let b = compress_new(&mut u, &x, &cy, &mut Rng::seed_from_u64(0)).unwrap();
        assert_ne!(a, b);
    }
}
