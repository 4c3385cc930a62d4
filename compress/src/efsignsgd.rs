//! `ef-signsgd`: the scaled sign of Karimireddy et al., "Error Feedback Fixes SignSGD and
//! other Gradient Compression Schemes" (ICML 2019), Algorithm 1 (EF-SIGNSGD).
//!
//! Per segment (tensor) `p` of `d` elements, the compressed value is
//! ```text
//! C(p) = (‖p‖₁ / d) · sign(p)        sign(p_j) = +1 if p_j ≥ 0 (−0.0 and +0 included), else −1
//! ```
//! The scale keeps the magnitude that plain signSGD throws away, and the error-feedback
//! memory (residual, this method's default) carries `p − C(p)` into the next step, which
//! is what makes the biased sign converge like SGD (the paper's Theorem II). A zero maps to
//! `+scale` (one bit cannot say 0), as GRACE's `efsignsgd` does; the residual absorbs it.
//! The scale is accumulated in `f64` and sent as `f32`.
//!
//! Payloads differ in scale between workers, so they are all-gathered and each receiver
//! decodes and sums them: the mean of the workers' scaled signs (the paper's aggregation).
//!
//! ## Body, per segment of `n` elements
//! ```text
//! f32 scale              finite, ≥ 0
//! ⌈n/8⌉ bytes            bit j = 1 iff p_j ≥ 0, LSB-first; unused bits of the last byte 0
//! ```
//! Bits: `32 + 8⌈n/8⌉`, i.e. 1 bit per element plus 32 per tensor (≤ 1.05 bits per element
//! from 640 elements on).
//!
//! ## The scale
//! `scale = "mean-abs"` (the default) is the paper's `‖p‖₁/d`, the scale that minimises
//! `‖p − s·sign(p)‖₂` and preserves the L1 norm. `scale = "rms"` is `‖p‖₂/√d`, the scale of
//! the 1-bit compressed all-reduce of DeepSpeed's 1-bit Adam and 0/1 Adam
//! (`deepspeed/runtime/comm/nccl.py`, `compressed_allreduce`: `norm(x)/sqrt(numel)`), which
//! preserves the L2 norm (it is ≥ the mean-abs scale, equal when every `|p_j|` is the same).
//! The wire format is the same; only the encoder's choice of `s` differs.

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::{ConfigError, WireError};
pub use crate::exact::Sum;
use crate::exact::{ExactSquares, ExactSum};
use crate::memory::MemoryConfig;
use crate::registry::Method;
use crate::rng::Rng;
use crate::wire::{Reader, Writer};

/// Configuration of [`EfSignSgd`] (the memory is configured as for every method, residual
/// by default).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EfSignSgdConfig {
    /// How each tensor's scale is computed (see the [module docs](self)). Default
    /// `mean-abs`.
    #[serde(default, skip_serializing_if = "SignScale::is_default")]
    pub scale: SignScale,
    /// How `‖p‖₁` is summed: `f64` (the default: an `f64` loop in element order) or `exact`
    /// (exactly, in any order, rounded once: [`ExactSum`] — the mode a device codec computes
    /// identically, so its payload can be checked byte for byte; with `scale = "rms"`, `Σp²`
    /// exactly: [`ExactSquares`]).
    #[serde(default, skip_serializing_if = "Sum::is_f64")]
    pub sum: Sum,
}

/// The magnitude that multiplies a tensor's signs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SignScale {
    /// `‖p‖₁/d` (Karimireddy et al.; GRACE's `efsignsgd`).
    #[default]
    MeanAbs,
    /// `‖p‖₂/√d` (DeepSpeed's 1-bit compressed all-reduce).
    Rms,
}

impl SignScale {
    fn is_default(&self) -> bool {
        *self == SignScale::MeanAbs
    }

    /// The scale of `x` (0 for an empty tensor), accumulated in `f64`.
    pub fn of(self, x: &[f32]) -> f32 {
        if x.is_empty() {
            return 0.0;
        }
        let d = x.len() as f64;
        match self {
            SignScale::MeanAbs => (x.iter().map(|v| f64::from(v.abs())).sum::<f64>() / d) as f32,
            SignScale::Rms => {
                let sq: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
                (sq / d).sqrt() as f32
            }
        }
    }
}

impl Method for EfSignSgdConfig {
    const NAME: &'static str = "ef-signsgd";
    const ABOUT: &'static str =
        "EF-SignSGD: (|p|_1/d)·sign(p) per tensor, 1 bit/element + one f32, error feedback";
    const ID: MethodId = MethodId(17);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(EfSignSgd {
            scale: self.scale,
            sum: self.sum,
        }))
    }

    /// The scaled sign is biased: the paper's error feedback is the residual memory.
    fn default_memory(&self) -> MemoryConfig {
        MemoryConfig::RESIDUAL
    }
}

/// Reads and checks one segment body of `n` elements: the scale and the sign bytes (public
/// for decoders that add the values elsewhere: the device codec of `dtrain-device`).
pub fn read_segment<'a>(r: &mut Reader<'a>, n: usize) -> Result<(f32, &'a [u8]), WireError> {
    let scale = r.finite_f32("ef-signsgd scale")?;
    if scale < 0.0 {
        return Err(WireError::Invalid("ef-signsgd scale is negative"));
    }
    let bits = r.sign_bits(n, "ef-signsgd sign bits (unused bits must be 0)")?;
    Ok((scale, bits))
}

/// The EF-SignSGD compressor (stateless and deterministic: it ignores the [`Rng`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct EfSignSgd {
    /// How each tensor's scale is computed.
    pub scale: SignScale,
    /// How its sum is accumulated.
    pub sum: Sum,
}

impl Compressor for EfSignSgd {
    fn method(&self) -> MethodId {
        EfSignSgdConfig::ID
    }

    /// A deterministic sign quantizer: its owners re-encode without a residual (see
    /// [`Compressor::owner_error_feedback`]).
    fn owner_error_feedback(&self) -> bool {
        false
    }

    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }

    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        w.f32(match self.sum {
            Sum::F64 => self.scale.of(x),
            // The exact Σ|p| or Σp², rounded once, over d.
            Sum::Exact => match self.scale {
                SignScale::MeanAbs => (ExactSum::of_abs(x).to_f64() / x.len() as f64) as f32,
                SignScale::Rms => (ExactSquares::of(x).to_f64() / x.len() as f64).sqrt() as f32,
            },
        });
        // 1 for p_j ≥ 0 (−0.0 included; the framing has checked x is finite).
        w.sign_bits(x);
    }

    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let (scale, bits) = read_segment(r, out.len())?;
        for (chunk, &b) in out.chunks_mut(8).zip(bits) {
            for (k, o) in chunk.iter_mut().enumerate() {
                *o += if b >> k & 1 == 1 { scale } else { -scale };
            }
        }
        Ok(())
    }

    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(32 + 8 * n.div_ceil(8) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, Ctx};
    use crate::memory::{Memory, Residual};

    fn round_trip(g: &[f32], segs: &[std::ops::Range<usize>]) -> Vec<f32> {
        let mut c = EfSignSgd::default();
        let ctx = Ctx {
            segments: segs,
            ..Ctx::default()
        };
        let p = compress_new(&mut c, g, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        let mut out = vec![0f32; g.len()];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        out
    }

    #[test]
    fn scaled_sign_per_tensor_by_hand() {
        // Tensor 1: ‖p‖₁ = 1 + 2 + 0 + 3 = 6, d = 4 → scale 1.5; zero and −0.0 map to +.
        // Tensor 2: ‖p‖₁ = 0.5 + 0.25 + 0.75 = 1.5, d = 3 → scale 0.5.
        let g = [1.0f32, -2.0, 0.0, 3.0, -0.5, -0.25, 0.75];
        let out = round_trip(&g, &[0..4, 4..7]);
        assert_eq!(out, [1.5, -1.5, 1.5, 1.5, -0.5, -0.5, 0.5]);
        let out = round_trip(&[-0.0, 0.0], &[]);
        assert_eq!(out, [0.0, 0.0], "an all-zero tensor has scale 0");
    }

    #[test]
    fn the_rms_scale_is_deepspeeds_and_keeps_the_l2_norm() {
        // ‖p‖₂ = √(1 + 4 + 0 + 9) = √14 over d = 4: scale √(14/4) = √3.5.
        let g = [1.0f32, -2.0, 0.0, 3.0];
        let cfg: EfSignSgdConfig = toml::from_str("scale = \"rms\"").unwrap();
        let mut c = cfg.build().unwrap();
        let ctx = Ctx::default();
        let p = compress_new(c.as_mut(), &g, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        let mut out = [0f32; 4];
        decompress(c.as_ref(), p.as_bytes(), &mut out).unwrap();
        let s = 3.5f32.sqrt();
        assert_eq!(out, [s, -s, s, s]);
        let l2 = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((l2(&out) - l2(&g)).abs() < 1e-5);
        // Same bytes on the wire as the default scale; the default differs (mean-abs 1.5).
        assert_eq!(round_trip(&g, &[]), [1.5, -1.5, 1.5, 1.5]);
        assert!(toml::from_str::<EfSignSgdConfig>("scale = \"l3\"").is_err());
    }

    #[test]
    fn the_scale_preserves_the_l1_norm_and_error_feedback_telescopes() {
        // ‖C(p)‖₁ = ‖p‖₁ per tensor; with residual memory, Σ_t C(p_t) + e_T = Σ_t g_t.
        let mut rng = Rng::seed_from_u64(3);
        let mut mem = Residual::new(1.0, 1.0);
        let (n, steps) = (1000, 20);
        let mut sent_sum = vec![0f64; n];
        let mut grad_sum = vec![0f64; n];
        let mut c = EfSignSgd::default();
        for step in 0..steps {
            let g: Vec<f32> = (0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect();
            let mut p = vec![0f32; n];
            mem.compensate(0, &g, &mut p);
            let ctx = Ctx {
                step,
                ..Ctx::default()
            };
            let payload = compress_new(&mut c, &p, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
            let mut d = vec![0f32; n];
            decompress(&c, payload.as_bytes(), &mut d).unwrap();
            let l1p: f64 = p.iter().map(|v| f64::from(v.abs())).sum();
            let l1d: f64 = d.iter().map(|v| f64::from(v.abs())).sum();
            assert!(
                (l1p - l1d).abs() <= 1e-4 * l1p,
                "step {step}: {l1p} vs {l1d}"
            );
            mem.update(0, &p, &d, &[]);
            for j in 0..n {
                sent_sum[j] += f64::from(d[j]);
                grad_sum[j] += f64::from(g[j]);
            }
        }
        let e = mem.export();
        let residual = &e[&0];
        for j in 0..n {
            let lhs = sent_sum[j] + f64::from(residual[j]);
            assert!(
                (lhs - grad_sum[j]).abs() < 1e-3,
                "{j}: {lhs} vs {}",
                grad_sum[j]
            );
        }
    }

    /// `sum = "exact"`: the scale is the exactly summed mean magnitude — the same as the
    /// f64 loop's here but for the last bit at most, order-free — and the Rms scale refuses
    /// it by name.
    #[test]
    fn the_exact_sum_mode_gives_the_exact_mean_magnitude() {
        use crate::compressor::compress_new;
        let cfg: EfSignSgdConfig = toml::from_str("sum = \"exact\"").unwrap();
        let mut c = cfg.build().unwrap();
        let mut r = Rng::seed_from_u64(4);
        let x: Vec<f32> = (0..5000)
            .map(|i| (r.next_f32() - 0.5) * 10f32.powi((i % 20) - 10))
            .collect();
        let p = compress_new(c.as_mut(), &x, &Ctx::default(), &mut r).unwrap();
        let scale = f32::from_le_bytes(p.as_bytes()[12..16].try_into().unwrap());
        let want = (ExactSum::of_abs(&x).to_f64() / 5000.0) as f32;
        assert_eq!(scale.to_bits(), want.to_bits());
        let loose = SignScale::MeanAbs.of(&x);
        assert!(
            scale.to_bits().abs_diff(loose.to_bits()) <= 1,
            "{scale} vs {loose}"
        );
        // The RMS scale: √(exact Σp² / d), within a bit of the f64 loop's.
        let cfg: EfSignSgdConfig = toml::from_str("sum = \"exact\"\nscale = \"rms\"").unwrap();
        let mut c = cfg.build().unwrap();
        let p = compress_new(c.as_mut(), &x, &Ctx::default(), &mut r).unwrap();
        let scale = f32::from_le_bytes(p.as_bytes()[12..16].try_into().unwrap());
        let want = (ExactSquares::of(&x).to_f64() / 5000.0).sqrt() as f32;
        assert_eq!(scale.to_bits(), want.to_bits());
        let loose = SignScale::Rms.of(&x);
        assert!(
            scale.to_bits().abs_diff(loose.to_bits()) <= 1,
            "{scale} vs {loose}"
        );
    }

    #[test]
    fn one_bit_per_element_plus_the_scale() {
        let c = EfSignSgd::default();
        assert_eq!(c.segment_bits(8), Some(32 + 8));
        assert_eq!(c.segment_bits(9), Some(32 + 16));
        let n = 640;
        let bits = c.segment_bits(n).unwrap() as f64 / n as f64;
        assert!(bits <= 1.05, "{bits}");
    }

    #[test]
    fn malformed_bodies_are_refused() {
        let c = EfSignSgd::default();
        let mut out = [0f32; 3];
        // Negative scale, non-finite scale, stray bits past n, short body.
        for body in [
            [(-1.0f32).to_le_bytes().as_slice(), &[0b101]].concat(),
            [f32::NAN.to_le_bytes().as_slice(), &[0b101]].concat(),
            [1.0f32.to_le_bytes().as_slice(), &[0b1101]].concat(),
            1.0f32.to_le_bytes().to_vec(),
        ] {
            let mut r = Reader::new(&body);
            assert!(c.decode_segment_add(&mut r, &mut out).is_err(), "{body:?}");
        }
        let body = [2.0f32.to_le_bytes().as_slice(), &[0b101]].concat();
        c.decode_segment_add(&mut Reader::new(&body), &mut out)
            .unwrap();
        assert_eq!(out, [2.0, -2.0, 2.0]);
    }
}
