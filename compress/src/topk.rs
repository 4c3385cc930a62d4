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
//!
//! With classic residual error feedback the method keeps the residual itself
//! ([`Compressor::adopt_error_feedback`], domain [`SIGNAL_DOMAIN`]): the kept values are
//! sent exactly, so `e ← p − D(C(p))` is `p` with the kept entries zeroed, and one pass
//! `e += g`, fused with the selection's candidate pass ([`top_k_accumulate`]), and a zeroing
//! of the `k` kept entries after it replace the generic memory's compensation, the decode of
//! the own payload and its three-array update.
//! The payloads and the residual are bit for bit those of the generic memory (tested). One
//! difference: where `e + g` overflows (magnitudes near `f32::MAX`) the generic memory
//! refuses to compress the infinity, while here it is sent and reaches the receivers'
//! average, which the trainer's non-finite policy then handles.

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, Ctx, MethodId, Touched};
use crate::error::{ConfigError, WireError};
use crate::memory::{AdoptedResidual, MemoryConfig, SIGNAL_DOMAIN};
use crate::registry::Method;
use crate::rng::Rng;
use crate::select::{top_k_abs, top_k_accumulate, Scratch};
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
            feedback: None,
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
    /// The residual, once classic error feedback is adopted.
    feedback: Option<AdoptedResidual>,
}

impl TopK {
    /// Selects the `k` largest magnitudes of `x` into `self.idx` and writes the segment.
    fn select_and_write(&mut self, x: &[f32], w: &mut Writer<'_>) {
        let k = k_for(x.len(), self.ratio);
        top_k_abs(x, k, &mut self.scratch, &mut self.idx);
        debug_assert_eq!(self.idx.len(), k);
        sparse::write_indexed(x.len(), &self.idx, |i| x[i as usize], w);
    }
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
    fn begin(&mut self, _grad: &[f32], ctx: &Ctx<'_>) {
        if let Some(fb) = &mut self.feedback {
            fb.begin(ctx.bucket);
        }
    }
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        let Some(mut fb) = self.feedback.take() else {
            return self.select_and_write(x, w);
        };
        // p = e + g in place (the generic memory's `1·e + 1·g`; a new residual is `g`),
        // summed in the selection's own pass where the residual is known.
        let n = x.len();
        let (e, known) = fb.claim_known(n);
        let k = k_for(n, self.ratio);
        if known == n {
            top_k_accumulate(e, x, k, &mut self.scratch, &mut self.idx);
        } else {
            for (e, &g) in e[..known].iter_mut().zip(x) {
                *e += g;
            }
            e[known..].copy_from_slice(&x[known..]);
            top_k_abs(e, k, &mut self.scratch, &mut self.idx);
        }
        debug_assert_eq!(self.idx.len(), k);
        sparse::write_indexed(n, &self.idx, |i| e[i as usize], w);
        // e = p − D(C(p)): the kept values were sent exactly, so they leave nothing behind.
        for &i in &self.idx {
            e[i as usize] = 0.0;
        }
        self.feedback = Some(fb);
    }
    /// The residual over the signal (see the module docs).
    fn adopt_error_feedback(&mut self) -> Option<&'static str> {
        self.feedback.get_or_insert_with(AdoptedResidual::default);
        Some(SIGNAL_DOMAIN)
    }
    fn feedback_offset(&mut self, offset: usize) {
        if let Some(fb) = &mut self.feedback {
            fb.set_offset(offset);
        }
    }
    fn export_feedback(&self) -> BTreeMap<u64, Vec<f32>> {
        self.feedback
            .as_ref()
            .map(|fb| fb.residuals.clone())
            .unwrap_or_default()
    }
    fn import_feedback(&mut self, state: BTreeMap<u64, Vec<f32>>) {
        if let Some(fb) = &mut self.feedback {
            fb.residuals = state;
        }
    }
    fn feedback_signal(&self, key: u64, _segments: &[Range<usize>], out: &mut [f32]) -> bool {
        match self.feedback.as_ref().and_then(|fb| fb.residuals.get(&key)) {
            Some(e) if e.len() == out.len() => {
                out.copy_from_slice(e);
                true
            }
            _ => false,
        }
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        sparse::read_indexed_add(r, out)
    }
    fn decode_segment_add_touched(
        &self,
        r: &mut Reader<'_>,
        out: &mut [f32],
        touched: &mut Touched,
    ) -> Result<(), WireError> {
        sparse::read_indexed_add_touched(r, out, touched)
    }
    /// `None`: the index set's size depends on where the entries are (see [`sparse`]).
    fn segment_bits(&self, _n: usize) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress};

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

    /// Top-k with the generic memory: everything but the adoption is the wrapped method's.
    struct Generic(TopK);

    impl Compressor for Generic {
        fn method(&self) -> MethodId {
            self.0.method()
        }
        fn aggregation(&self) -> Aggregation {
            self.0.aggregation()
        }
        fn encode_segment(&mut self, x: &[f32], rng: &mut Rng, w: &mut Writer<'_>) {
            self.0.encode_segment(x, rng, w)
        }
        fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
            self.0.decode_segment_add(r, out)
        }
        fn segment_bits(&self, n: usize) -> Option<u64> {
            self.0.segment_bits(n)
        }
    }

    /// A gradient with exact zeros of both signs among its values (ReLU layers give them).
    fn gradient(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::seed_from_u64(seed);
        (0..n)
            .map(|_| match rng.next_u64() % 8 {
                0 => 0.0,
                1 => -0.0,
                _ => rng.next_f32() * 2.0 - 1.0,
            })
            .collect()
    }

    /// The adopted residual is the generic memory's, bit for bit: the same payloads and the
    /// same residual after every step, through whole buckets and through the compressed
    /// all-reduce's ranges; and the checkpoint of either restores into the other.
    #[test]
    fn adopted_feedback_is_the_generic_memory_bit_for_bit() {
        use crate::memory::MemoryConfig;
        use crate::pipeline::Pipeline;
        use crate::Payload;

        let cfg = TopKConfig { ratio: 0.05 };
        let memory = || MemoryConfig::RESIDUAL.build().unwrap();
        let mut adopted = Pipeline::new(Box::new(cfg.init().unwrap()), memory());
        let mut generic = Pipeline::new(Box::new(Generic(cfg.init().unwrap())), memory());
        assert!(!adopted.memory().is_active() && adopted.feedback_active());
        assert!(generic.memory().is_active());
        assert_eq!(
            adopted.adopted_feedback(),
            None,
            "the signal domain is the memory's"
        );
        let (n, segs) = (1000usize, [0..300, 300..301, 301..1000]);
        let ranges = [0..400, 400..1000];
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for step in 0..8u64 {
            let g = gradient(n, 40 + step);
            let ctx = Ctx {
                step,
                rank: 0,
                bucket: 6,
                segments: &segs,
            };
            let mut rng = Rng::seed_from_u64(step);
            if step % 2 == 0 {
                let (mut a, mut b) = (Payload::new(), Payload::new());
                adopted.compress(&g, &ctx, &mut rng, &mut a).unwrap();
                generic.compress(&g, &ctx, &mut rng, &mut b).unwrap();
                assert_eq!(a.as_bytes(), b.as_bytes(), "step {step}");
            } else {
                let (mut a, mut b) = (Vec::new(), Vec::new());
                adopted
                    .compress_chunks(&g, &ctx, &ranges, &mut rng, &mut a)
                    .unwrap();
                generic
                    .compress_chunks(&g, &ctx, &ranges, &mut rng, &mut b)
                    .unwrap();
                for (a, b) in a.iter().zip(&b) {
                    assert_eq!(a.as_bytes(), b.as_bytes(), "step {step}");
                }
            }
            let (ea, eb) = (adopted.export_memory(), generic.export_memory());
            assert_eq!(bits(&ea[&6]), bits(&eb[&6]), "step {step}");
            assert_eq!(adopted.residual_signal(6, &segs, n).unwrap(), ea[&6]);
        }
        // Checkpoints cross: the generic memory's state restored into the adopting method.
        let mut resumed = Pipeline::new(Box::new(cfg.init().unwrap()), memory());
        resumed.import_memory(generic.export_memory());
        let g = gradient(n, 99);
        let ctx = Ctx {
            step: 8,
            rank: 0,
            bucket: 6,
            segments: &segs,
        };
        let (mut a, mut b) = (Payload::new(), Payload::new());
        resumed
            .compress(&g, &ctx, &mut Rng::seed_from_u64(8), &mut a)
            .unwrap();
        generic
            .compress(&g, &ctx, &mut Rng::seed_from_u64(8), &mut b)
            .unwrap();
        assert_eq!(a.as_bytes(), b.as_bytes());
    }

    #[test]
    fn config_rejects_bad_ratio() {
        for r in [0.0, -0.1, 1.01, f64::NAN] {
            assert!(TopKConfig { ratio: r }.init().is_err());
        }
    }
}
