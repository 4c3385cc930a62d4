//! `onebit` on the device, in its exact-sum mode (`sum = "exact"`, one column a segment —
//! `column` unset): 1-bit SGD (the host codec `dtrain_compress::onebit`) with each segment's
//! sums of its non-negative values and of its negative values' magnitudes taken exactly on
//! the device (`exact`, one class per sign), the means `(μ+, μ−)` finished on the host from
//! the same sums with the host codec's own `means_from_sums` — so the payload is the host's
//! byte for byte. The body is the two means' eight bytes, then one sign bit per element
//! (`signs`). Decoding checks each segment with the host codec's reader and adds `μ+` or
//! `μ−` on the device.
//!
//! Not here: columns shorter than the segment (`column = c`), and the default `f64` sums.

use dtrain_compress::exact::Sum;
use dtrain_compress::onebit::{mean_pair, means_from_sums, read_segment, OneBitConfig};
use dtrain_compress::{read_frame, Ctx, Method, MethodId, Payload, Rng, WireError};

use crate::codec::{begin_payload, DeviceCodec};
use crate::error::DeviceError;
use crate::exact::abs_sums;
use crate::gpu::{Gpu, GpuBuffer};
use crate::signs::SignedBody;

/// The body: two header words (`μ+`, `μ−`), then the signs.
const BODY: SignedBody = SignedBody { h: 2 };

/// The `onebit` device codec (exact sums, one column a segment).
#[derive(Debug, Clone, Copy, Default)]
pub struct OneBit;

impl OneBit {
    /// The device codec of `cfg`, where it has one: `sum = "exact"`, no `column`.
    pub fn for_config(cfg: &OneBitConfig) -> Option<OneBit> {
        (cfg.sum == Sum::Exact && cfg.column.is_none()).then_some(OneBit)
    }
}

impl DeviceCodec for OneBit {
    fn method(&self) -> MethodId {
        OneBitConfig::ID
    }

    fn encode(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        _rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let segs = begin_payload(OneBitConfig::ID, grad.len(), ctx.segments, out)?;
        if segs.is_empty() {
            return Ok(());
        }
        let sums = abs_sums(gpu, grad, &segs, true, out)?;
        let header = sums
            .chunks_exact(2)
            .flat_map(|c| {
                let ((pos, pos_n), (neg, neg_n)) = (&c[0], &c[1]);
                let (mp, mn) = means_from_sums(pos, *pos_n as usize, neg, *neg_n as usize);
                [mp.to_bits(), mn.to_bits()]
            })
            .collect();
        BODY.encode(gpu, grad, &segs, header, out)
    }

    fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError> {
        let (mut r, segs) = read_frame(OneBitConfig::ID, payload, out.len())?;
        let at = r.position();
        let (mut pos, mut neg) = (Vec::new(), Vec::new());
        for seg in &segs {
            let (means, _) = read_segment(&mut r, seg.len(), 1)?;
            let (mp, mn) = mean_pair(means, 0)?;
            pos.push(mp);
            neg.push(mn);
        }
        if r.remaining() != 0 {
            return Err(WireError::TrailingBytes(r.remaining()).into());
        }
        if !segs.is_empty() {
            BODY.decode_add(gpu, &payload[at..], &segs, &pos, &neg, out);
        }
        Ok(())
    }
}
