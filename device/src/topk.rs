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

use std::ops::Range;

use cubecl::prelude::*;
use dtrain_compress::topk::{k_for, TopKConfig};
use dtrain_compress::wire::{Reader, Writer};
use dtrain_compress::{Ctx, read_frame, sparse, Method, MethodId, Payload, Rng, WireError};

use crate::codec::{begin_payload, refuse_non_finite, DeviceCodec};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::select::{add_at, compact_segment, word, Kept};
use crate::words::{geometry, grid_stride};

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

/// Counts into `hist` the key byte at `shift` of every element of
/// `x[start .. start + len]` whose key matches `prefix` on `mask`; a non-finite element
/// lowers `first_bad` to its index in `x`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn histogram(
    x: &[f32],
    start: u32,
    len: u32,
    shift: u32,
    mask: u32,
    prefix: u32,
    hist: &[Atomic<u32>],
    first_bad: &[Atomic<u32>],
) {
    let mut i = ABSOLUTE_POS;
    while i < len as usize {
        let at = start as usize + i;
        let key = u32::reinterpret(x[at]) & 0x7FFF_FFFF;
        if key >= 0x7F80_0000 {
            first_bad[0].fetch_min(at as u32);
        }
        if (key & mask) == prefix {
            hist[((key >> shift) & 0xFF) as usize].fetch_add(1);
        }
        i += grid_stride();
    }
}

impl TopK {
    /// The threshold key `t` of the segment's k largest and how many keys equal to it they
    /// include; or the host's error where the segment holds a non-finite value.
    fn threshold(
        &self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        seg: &Range<usize>,
        k: usize,
        out: &mut Payload,
    ) -> Result<(u32, u32), DeviceError> {
        let (start, len) = (seg.start as u32, seg.len() as u32);
        let (mut prefix, mut mask, mut remaining) = (0u32, 0u32, k as u32);
        for shift in [24u32, 16, 8, 0] {
            let hist = gpu.words(256, 0);
            let first_bad = gpu.words(1, u32::MAX);
            let (count, dim) = geometry(seg.len());
            // SAFETY: `hist` holds 256 words, `first_bad` one, `grad` the segment.
            unsafe {
                histogram::launch(
                    gpu.client(),
                    count,
                    dim,
                    grad.arg(),
                    start,
                    len,
                    shift,
                    mask,
                    prefix,
                    BufferArg::from_raw_parts(hist.clone(), 256),
                    BufferArg::from_raw_parts(first_bad.clone(), 1),
                );
            }
            let read = gpu.read_words(vec![hist, first_bad], "reading a histogram")?;
            refuse_non_finite(gpu, grad, &read[1], out)?;
            // The bin holding the `remaining`-th largest key, counting from the top.
            let mut digit = 0u32;
            for d in (0..256).rev() {
                let c = word(&read[0], d);
                if c >= remaining {
                    digit = d as u32;
                    break;
                }
                remaining -= c;
            }
            prefix |= digit << shift;
            mask |= 0xFF << shift;
        }
        Ok((prefix, remaining))
    }

    /// The kept entries of one segment.
    fn select(
        &self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        seg: &Range<usize>,
        out: &mut Payload,
    ) -> Result<Kept, DeviceError> {
        let k = k_for(seg.len(), self.ratio);
        let (t, need) = self.threshold(gpu, grad, seg, k, out)?;
        let kept = compact_segment(gpu, grad, seg, t, need, out)?;
        debug_assert_eq!(kept.idx.len(), k);
        Ok(kept)
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
        for seg in &segs {
            let kept = self.select(gpu, grad, seg, out)?;
            let mut w = Writer::new(out.buffer_mut());
            sparse::write_indices(seg.len(), &kept.idx, &mut w);
            w.bytes(&kept.val);
        }
        Ok(())
    }

    fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError> {
        let (mut r, segs) = read_frame(TopKConfig::ID, payload, out.len())?;
        let (mut idx, mut val) = (Vec::new(), Vec::new());
        let mut seg_idx = Vec::new();
        for seg in &segs {
            seg_idx.clear();
            let k = sparse::read_indices(&mut r, seg.len(), &mut seg_idx)?;
            let vals = Reader::take_items(&mut r, k, 4, "sparse values")?;
            let vals = vals
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()));
            if vals.clone().any(|v| !v.is_finite()) {
                return Err(WireError::Invalid("non-finite sparse value").into());
            }
            idx.extend(seg_idx.iter().map(|&i| i + seg.start as u32));
            val.extend(vals);
        }
        if r.remaining() != 0 {
            return Err(WireError::TrailingBytes(r.remaining()).into());
        }
        add_at(gpu, &idx, &val, out);
        Ok(())
    }
}
