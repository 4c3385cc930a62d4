//! `ef-signsgd` on the device, in its exact-sum mode (`sum = "exact"`, mean-abs scale): the
//! host codec `dtrain_compress::efsignsgd` with each tensor's `‖p‖₁` summed exactly on the
//! device (`exact`) and the scale `(Σ|p| / d) as f32` finished on the host from the same
//! exact sum — so the payload is the host's byte for byte. A second pass writes each
//! segment's body: the scale's four bytes, then one sign bit per element (1 iff `p ≥ 0`).
//!
//! Decoding checks each segment on the host with the host codec's reader (scale finite and
//! `≥ 0`, padding bits zero), then adds `±scale` on the device.
//!
//! The default `sum = "f64"` (an `f64` loop in element order) and the RMS scale of 1-bit
//! Adam have no device form yet.

use std::ops::Range;

use cubecl::prelude::*;
use cubecl::server::Handle;
use dtrain_compress::efsignsgd::{read_segment, EfSignSgdConfig, SignScale, Sum};
use dtrain_compress::{read_frame, CompressError, Method, MethodId, Payload, Rng, WireError};

use crate::codec::{begin_payload, body_starts, element_starts, upload_tables, DeviceCodec};
use crate::error::DeviceError;
use crate::exact::abs_sums;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride, segment_of, to_words, words_for};

/// The `ef-signsgd` device codec (exact sums, mean-abs scale).
#[derive(Debug, Clone, Copy, Default)]
pub struct EfSignSgd;

impl EfSignSgd {
    /// The device codec of `cfg`, where it has one: `sum = "exact"`, `scale = "mean-abs"`.
    pub fn for_config(cfg: &EfSignSgdConfig) -> Option<EfSignSgd> {
        (cfg.sum == Sum::Exact && cfg.scale == SignScale::MeanAbs).then_some(EfSignSgd)
    }
}

/// Writes the bodies — per segment the scale (`scales[s]`'s bits) and the sign bits — four
/// body bytes to a word of `out`.
#[cube(launch)]
fn encode(x: &[f32], starts: &[u32], body_starts: &[u32], scales: &[u32], out: &mut [u32]) {
    let len = body_starts[body_starts.len() - 1];
    let mut w = ABSOLUTE_POS;
    while w < out.len() {
        let mut word = 0u32;
        for q in 0..4u32 {
            let b = 4 * w as u32 + q;
            if b < len {
                let seg = segment_of(body_starts, b) as usize;
                let off = b - body_starts[seg];
                let mut byte = 0u32;
                if off < 4 {
                    byte = (scales[seg] >> (8 * off)) & 0xFF;
                } else {
                    let first = starts[seg] + 8 * (off - 4);
                    let end = min(first + 8, starts[seg + 1]);
                    for k in 0..end - first {
                        // p ≥ 0: the sign bit clear, or −0.0.
                        if u32::reinterpret(x[(first + k) as usize]) <= 0x8000_0000 {
                            byte |= 1u32 << k;
                        }
                    }
                }
                word |= byte << (8 * q);
            }
        }
        out[w] = word;
        w += grid_stride();
    }
}

/// Adds `±scales[s]` for each sign bit of `body` into `out`.
#[cube(launch)]
fn decode_add(body: &[u32], starts: &[u32], body_starts: &[u32], scales: &[f32], out: &mut [f32]) {
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        let seg = segment_of(starts, i as u32) as usize;
        let rel = i as u32 - starts[seg];
        let byte = body_starts[seg] + 4 + rel / 8;
        let bit = (body[(byte / 4) as usize] >> (8 * (byte % 4) + rel % 8)) & 1;
        let s = scales[seg];
        let mut v = -s;
        if bit == 1 {
            v = s;
        }
        out[i] += v;
        i += grid_stride();
    }
}

/// Body bytes of a segment of `n` elements: the scale and the sign bits.
fn segment_len(n: usize) -> usize {
    4 + n.div_ceil(8)
}

/// The element and body segment tables on the device.
fn tables(gpu: &Gpu, segs: &[Range<usize>]) -> [(Handle, usize); 2] {
    upload_tables(gpu, [element_starts(segs), body_starts(segs, segment_len)])
}

impl DeviceCodec for EfSignSgd {
    fn method(&self) -> MethodId {
        EfSignSgdConfig::ID
    }

    fn encode(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        segments: &[Range<usize>],
        _rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let segs = begin_payload(EfSignSgdConfig::ID, grad.len(), segments, out)?;
        if segs.is_empty() {
            return Ok(());
        }
        let [starts, (body_starts, nb)] = tables(gpu, &segs);
        let sums = match abs_sums(gpu, grad, &segs, &starts)? {
            Ok(sums) => sums,
            Err(index) => {
                out.buffer_mut().clear();
                let value = gpu.download(grad)?[index];
                return Err(CompressError::NonFinite { index, value }.into());
            }
        };
        // The host codec's scale, from the same exact sum.
        let scales: Vec<u32> = sums
            .iter()
            .zip(&segs)
            .map(|(s, seg)| ((s.to_f64() / seg.len() as f64) as f32).to_bits())
            .collect();
        let len: usize = segs.iter().map(|s| segment_len(s.len())).sum();
        let words = words_for(len);
        let body = gpu.words(words, 0);
        let [(scales, ns)] = upload_tables(gpu, [scales]);
        let (count, dim) = geometry(words);
        // SAFETY: the tables hold S + 1 words each, `scales` S, `body` ⌈len/4⌉.
        unsafe {
            encode::launch(
                gpu.client(),
                count,
                dim,
                grad.arg(),
                BufferArg::from_raw_parts(starts.0, starts.1),
                BufferArg::from_raw_parts(body_starts, nb),
                BufferArg::from_raw_parts(scales, ns),
                BufferArg::from_raw_parts(body.clone(), words),
            );
        }
        let read = gpu.read_words(vec![body], "reading a payload")?;
        out.buffer_mut().extend_from_slice(&read[0][..len]);
        Ok(())
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
        if segs.is_empty() {
            return Ok(());
        }
        let [(starts, ns), (body_starts, nb), (body, nw)] = {
            let [a, b] = tables(gpu, &segs);
            let [c] = upload_tables(gpu, [to_words(&payload[at..])]);
            [a, b, c]
        };
        let (count, dim) = geometry(out.len());
        // SAFETY: every buffer holds the length given; the body was checked above.
        unsafe {
            decode_add::launch(
                gpu.client(),
                count,
                dim,
                BufferArg::from_raw_parts(body, nw),
                BufferArg::from_raw_parts(starts, ns),
                BufferArg::from_raw_parts(body_starts, nb),
                gpu.upload(&scales).arg(),
                out.arg(),
            );
        }
        Ok(())
    }
}
