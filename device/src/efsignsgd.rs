//! `ef-signsgd` on the device, in its exact-sum mode (`sum = "exact"`): the host codec
//! `dtrain_compress::efsignsgd` with each tensor's `‖p‖₁` (mean-abs scale) or `Σp²` (RMS
//! scale) summed exactly on the device (`exact`) and the scale — `(Σ|p| / d) as f32` or
//! `√(Σp² / d) as f32` — finished on the host from the same exact sum, so the payload is the
//! host's byte for byte. A second pass writes each
//! segment's body: the scale's four bytes, then one sign bit per element (`signs`).
//!
//! Decoding checks each segment on the host with the host codec's reader (scale finite and
//! `≥ 0`, padding bits zero), then adds `±scale` on the device.
//!
//! The default `sum = "f64"` (an `f64` loop in element order) has no device form.

use dtrain_compress::efsignsgd::{read_segment, EfSignSgdConfig, SignScale, Sum};
use dtrain_compress::{read_frame, Ctx, Method, MethodId, Payload, Rng, WireError};

use crate::codec::{begin_payload, DeviceCodec};
use crate::error::DeviceError;
use crate::exact::{abs_sums, squares};
use crate::gpu::{Gpu, GpuBuffer};
use crate::signs::SignedBody;

/// The body: one header word (the scale), then the signs.
const BODY: SignedBody = SignedBody { h: 1 };

/// The `ef-signsgd` device codec (exact sums).
#[derive(Debug, Clone, Copy)]
pub struct EfSignSgd {
    scale: SignScale,
}

impl EfSignSgd {
    /// The device codec of `cfg`, where it has one: `sum = "exact"`.
    pub fn for_config(cfg: &EfSignSgdConfig) -> Option<EfSignSgd> {
        (cfg.sum == Sum::Exact).then_some(EfSignSgd { scale: cfg.scale })
    }
}

impl DeviceCodec for EfSignSgd {
    fn method(&self) -> MethodId {
        EfSignSgdConfig::ID
    }

    fn encode(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        _rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let segs = begin_payload(EfSignSgdConfig::ID, grad.len(), ctx.segments, out)?;
        if segs.is_empty() {
            return Ok(());
        }
        // The host codec's scale, from the same exact sum.
        let scales = match self.scale {
            SignScale::MeanAbs => abs_sums(gpu, grad, &segs, false, out)?
                .iter()
                .zip(&segs)
                .map(|((s, _), seg)| ((s.to_f64() / seg.len() as f64) as f32).to_bits())
                .collect(),
            SignScale::Rms => squares(gpu, grad, &segs, out)?
                .iter()
                .zip(&segs)
                .map(|(s, seg)| ((s.to_f64() / seg.len() as f64).sqrt() as f32).to_bits())
                .collect(),
        };
        BODY.encode(gpu, grad, &segs, scales, out)
    }

    fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError> {
        let (mut r, segs) = read_frame(EfSignSgdConfig::ID, payload, out.len())?;
        let at = r.position();
        let mut scales = Vec::with_capacity(segs.len());
        for seg in &segs {
            scales.push(read_segment(&mut r, seg.len())?.0);
        }
        if r.remaining() != 0 {
            return Err(WireError::TrailingBytes(r.remaining()).into());
        }
        if !segs.is_empty() {
            let neg: Vec<f32> = scales.iter().map(|s| -s).collect();
            BODY.decode_add(gpu, &payload[at..], &segs, &scales, &neg, out);
        }
        Ok(())
    }
}
