//! `threshold` on the device: Strom's fixed threshold (the host codec
//! `dtrain_compress::threshold`). Every entry with `|p| ≥ τ` — a magnitude key of at least
//! `key(τ)`, so the ordered compaction of `select` at `t = key(τ)` with every equal key kept
//! — comes back as its index and value; the host makes each sign word `(index << 1) | sign`
//! and writes the body with the host codec's own writer (`words` or `golomb-rice`), so the
//! payload is the host's by construction. Decoding parses the body on the host with the host
//! codec's reader (`O(count)`), then one kernel adds `±τ` at the indices.

use dtrain_compress::threshold::{
    read_golomb_rice, read_sign_words, write_golomb_rice, write_sign_words, IndexCoding,
    ThresholdConfig, MAX_SIGN_WORD_SEGMENT,
};
use dtrain_compress::wire::Writer;
use dtrain_compress::{read_frame, CompressError, Ctx, Method, MethodId, Payload, Rng};

use crate::codec::{begin_payload, DeviceCodec};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::select::{select, Adds, Rule};

/// The `threshold` device codec.
#[derive(Debug, Clone, Copy)]
pub struct Threshold {
    tau: f32,
    coding: IndexCoding,
}

impl Threshold {
    /// The codec of a config (τ is checked as the host checks it).
    pub fn for_config(cfg: &ThresholdConfig) -> Option<Threshold> {
        cfg.init().ok().map(|_| Threshold {
            tau: cfg.tau,
            coding: cfg.coding,
        })
    }
}

impl DeviceCodec for Threshold {
    fn method(&self) -> MethodId {
        ThresholdConfig::ID
    }

    fn encode(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        _rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let segs = begin_payload(ThresholdConfig::ID, grad.len(), ctx.segments, out)?;
        if let Some(s) = segs.iter().find(|s| s.len() > MAX_SIGN_WORD_SEGMENT) {
            out.buffer_mut().clear();
            return Err(CompressError::TooLarge(s.len()).into());
        }
        let t = self.tau.to_bits() & 0x7FFF_FFFF;
        let jobs: Vec<_> = segs
            .iter()
            .map(|s| (s.clone(), Rule::From { t, need: u32::MAX }))
            .collect();
        let all = select(gpu, grad, &jobs, out)?;
        let mut words = Vec::new();
        for kept in &all {
            words.clear();
            words.extend(
                (0..kept.idx.len()).map(|j| kept.idx[j] << 1 | u32::from(kept.value(j) < 0.0)),
            );
            let mut w = Writer::new(out.buffer_mut());
            match self.coding {
                IndexCoding::Words => write_sign_words(&words, &mut w),
                IndexCoding::GolombRice => write_golomb_rice(&words, &mut w),
            }
        }
        Ok(())
    }

    fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError> {
        let (mut r, segs) = read_frame(ThresholdConfig::ID, payload, out.len())?;
        let mut adds = Adds::default();
        for seg in &segs {
            let mut each = |i: usize, v: f32| adds.push((seg.start + i) as u32, v);
            match self.coding {
                IndexCoding::Words => {
                    read_sign_words(&mut r, seg.len(), self.tau, -self.tau, &mut each)
                }
                IndexCoding::GolombRice => {
                    read_golomb_rice(&mut r, seg.len(), self.tau, -self.tau, &mut each)
                }
            }?;
        }
        adds.finish(gpu, &r, out)
    }
}
