//! `topk` on the device: the `k = ⌈ρn⌉` largest magnitudes of each segment, ties to the
//! smaller index, in ascending index order (the host codec `dtrain_compress::topk`).
//!
//! Selection is a radix select of the k-th largest magnitude key (`bits & 0x7FFF_FFFF`,
//! which orders finite values by `|x|`): four passes, each a 256-bin histogram of one key
//! byte over the elements that match the bytes found so far, from the top byte down. With
//! the threshold `t` and the number `need` of elements equal to it that the k must include,
//! the ordered compaction of `select` keeps every key above `t` and the first `need` keys
//! equal to it, in index order. Only the `k` indices
//! and values come back; the host writes them in the smallest index layout (list, bitmap
//! or Rice-coded gaps) with the host codec's own `sparse::write_indices`, so the layout
//! choice is the host's by construction.
//!
//! Decoding parses the index part on the host (it is `O(k)`), then one kernel adds the
//! values at their indices.
//!
//! Not yet here: the error-feedback residual on the device (the host codec's adopted
//! residual), and per-cube histograms in shared memory (the four histogram passes use
//! global atomics).

use dtrain_compress::topk::{k_for, TopKConfig};
use dtrain_compress::wire::Writer;
use dtrain_compress::{read_frame, sparse, Ctx, Method, MethodId, Payload, Rng};

use crate::codec::{begin_payload, DeviceCodec};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::select::{select, Adds, Rule};

/// The `topk` device codec at density `ratio`.
#[derive(Debug, Clone, Copy)]
pub struct TopK {
    ratio: f64,
}

impl TopK {
    /// The codec of a checked config.
    pub fn new(cfg: &TopKConfig) -> Self {
        TopK { ratio: cfg.ratio }
    }
}

impl DeviceCodec for TopK {
    fn method(&self) -> MethodId {
        TopKConfig::ID
    }

    fn encode(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        _rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let segs = begin_payload(TopKConfig::ID, grad.len(), ctx.segments, out)?;
        let jobs: Vec<_> = segs
            .iter()
            .map(|s| (s.clone(), Rule::TopK(k_for(s.len(), self.ratio))))
            .collect();
        let kept = select(gpu, grad, &jobs, out)?;
        let mut w = Writer::new(out.buffer_mut());
        for (seg, kept) in segs.iter().zip(&kept) {
            sparse::write_indices(seg.len(), &kept.idx, &mut w);
            w.bytes(&kept.val);
        }
        Ok(())
    }

    fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError> {
        let (mut r, segs) = read_frame(TopKConfig::ID, payload, out.len())?;
        let mut adds = Adds::default();
        for seg in &segs {
            adds.read_indexed(&mut r, seg)?;
        }
        adds.finish(gpu, &r, out)
    }
}
