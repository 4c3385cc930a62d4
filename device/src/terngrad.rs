//! `terngrad` on the device, in its counter mode (`draws = "counter"`, clip off or with
//! `sum = "exact"`): the host
//! codec `dtrain_compress::terngrad` with [`counter_bits`](dtrain_compress::rng::counter_bits)
//! computed on the device, so the payload is the host's byte for byte.
//!
//! Encoding: one pass finds each segment's scaler `s = max|x|` (an atomic maximum of the
//! magnitudes' bits: exact, order-free) and any non-finite input; the scalers come back to
//! the host, which draws each segment's key from the encoder's Rng as the host codec does
//! and sends back `s`, `1/s` and the key; a second pass writes the body, four bytes to a
//! unit, each byte finding its segment by a binary search (a segment's body is `s` and its
//! 2-bit symbols, so bodies start at any byte). The trial is the host's arithmetic:
//! `p = |x|·(1/s)` (1 where `|x| ≥ s`), sent iff `u < p`, with `u` the top 24 bits of the
//! counter draw. A GPU that flushes subnormal products to zero could differ from the host
//! where `p` or `|x|` is subnormal and `u` is exactly 0 (a 2⁻²⁴ event per such element).
//!
//! Decoding validates each segment on the host with the host's own reader (scaler, symbol
//! codes, padding, the zero-scaler rule: `O(n/4)` bytes), then adds `{−s, 0, +s}` on the
//! device.
//!
//! Clipping (`clip > 0`) needs each segment's σ: with `sum = "exact"` the device accumulates
//! the segment's exact `Σx` (non-negative and negative parts) and `Σx²` (the `exact` module),
//! and the host works out σ, the bound `c·σ` and the scaler `min(max|x|, c·σ)` from them as
//! its own codec does — clipping then changes nothing else on the device, since an element
//! whose magnitude reaches the scaler is sent with probability 1 either way.
//!
//! Not here: clipping with the default `f64` σ (a sum in the host's order), the default
//! `lanes` draws, and the shared scalers of the summed all-reduce; those configurations have
//! no device codec ([`TernGrad::for_config`]).

use std::ops::Range;

use cubecl::prelude::*;
use cubecl::server::Handle;
use dtrain_compress::exact::std_dev_of_sums;
use dtrain_compress::terngrad::{read_segment, Draws, Sum, TernGradConfig};
use dtrain_compress::{read_frame, Ctx, Method, MethodId, Payload, Rng, WireError};

use crate::codec::{
    begin_payload, body_starts, element_starts, refuse_non_finite, upload_tables, DeviceCodec,
};
use crate::counter::counter_bits;
use crate::error::DeviceError;
use crate::exact;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride, segment_of, words_for};

/// The `terngrad` device codec (counter draws; clipping with exact sums).
#[derive(Debug, Clone, Copy, Default)]
pub struct TernGrad {
    /// The clip factor `c` (0: no clipping).
    clip: f32,
}

impl TernGrad {
    /// The device codec of `cfg`, where it has one: counter draws, and `clip = 0` or
    /// `sum = "exact"` (a config the host refuses has none either).
    pub fn for_config(cfg: &TernGradConfig) -> Option<TernGrad> {
        cfg.init().ok()?;
        (cfg.draws == Draws::Counter && (cfg.clip == 0.0 || cfg.sum == Sum::Exact))
            .then_some(TernGrad { clip: cfg.clip })
    }

    /// Each segment's clipping bound `c·σ` from its exact sums (∞ where σ = 0 or without
    /// clipping), as the host codec computes it.
    fn bounds(
        &self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        segs: &[Range<usize>],
        out: &mut Payload,
    ) -> Result<Vec<f32>, DeviceError> {
        if self.clip == 0.0 {
            return Ok(vec![f32::INFINITY; segs.len()]);
        }
        let sums = exact::abs_sums(gpu, grad, segs, true, out)?;
        let squares = exact::squares(gpu, grad, segs, out)?;
        Ok(segs
            .iter()
            .enumerate()
            .map(|(k, seg)| {
                let sd = std_dev_of_sums(&sums[2 * k].0, &sums[2 * k + 1].0, &squares[k], seg.len());
                let b = (self.clip as f64 * sd) as f32;
                if b > 0.0 {
                    b
                } else {
                    f32::INFINITY
                }
            })
            .collect())
    }
}

/// `max |x|` of each segment, as bits, into `max_bits`; non-finite input lowers
/// `first_bad`.
#[cube(launch)]
fn segment_max(x: &[f32], starts: &[u32], max_bits: &[Atomic<u32>], first_bad: &[Atomic<u32>]) {
    let mut i = ABSOLUTE_POS;
    while i < x.len() {
        let key = u32::reinterpret(x[i]) & 0x7FFF_FFFF;
        if key >= 0x7F80_0000 {
            first_bad[0].fetch_min(i as u32);
        }
        max_bits[segment_of(starts, i as u32) as usize].fetch_max(key);
        i += grid_stride();
    }
}

/// The symbol of one element: 0, 1 or 2 for −s, 0, +s.
#[cube]
fn symbol(v: f32, s: f32, inv: f32, k0: u32, k1: u32, j: u32) -> u32 {
    let a = f32::reinterpret(u32::reinterpret(v) & 0x7FFF_FFFF);
    let mut p = 1.0f32;
    if a < s {
        p = a * inv;
    }
    let bits = counter_bits(k0, k1, j);
    let u = f32::cast_from(bits >> 8) * 5.960_464_5e-8;
    let mut sym = 1u32;
    if u < p {
        sym = 2;
        if v < 0.0 {
            sym = 0;
        }
    }
    sym
}

/// Writes the bodies: per segment `s` (four bytes) and the 2-bit symbols, four body bytes
/// to a word of `out`. `params` holds per segment `s`'s bits, `1/s`'s bits and the key's two
/// halves.
#[cube(launch)]
fn encode(x: &[f32], starts: &[u32], body_starts: &[u32], params: &[u32], out: &mut [u32]) {
    let len = body_starts[body_starts.len() - 1];
    let mut w = ABSOLUTE_POS;
    while w < out.len() {
        let mut word = 0u32;
        for q in 0..4u32 {
            let b = 4 * w as u32 + q;
            if b < len {
                let seg = segment_of(body_starts, b) as usize;
                let off = b - body_starts[seg];
                let s_bits = params[4 * seg];
                let mut byte = 0u32;
                if off < 4 {
                    byte = (s_bits >> (8 * off)) & 0xFF;
                } else {
                    let j0 = 4 * (off - 4);
                    let first = starts[seg] + j0;
                    let count = min(4u32, starts[seg + 1] - first);
                    let s = f32::reinterpret(s_bits);
                    let inv = f32::reinterpret(params[4 * seg + 1]);
                    for l in 0..count {
                        let mut sym = 1u32;
                        if s_bits != 0 {
                            let v = x[(first + l) as usize];
                            sym =
                                symbol(v, s, inv, params[4 * seg + 2], params[4 * seg + 3], j0 + l);
                        }
                        byte |= sym << (2 * l);
                    }
                }
                word |= byte << (8 * q);
            }
        }
        out[w] = word;
        w += grid_stride();
    }
}

/// Adds `{−s, 0, +s}` for each symbol of `body` into `out`; `scales` per segment.
#[cube(launch)]
fn decode_add(body: &[u32], starts: &[u32], body_starts: &[u32], scales: &[f32], out: &mut [f32]) {
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        let seg = segment_of(starts, i as u32) as usize;
        let rel = i as u32 - starts[seg];
        let b = body_starts[seg] + 4 + rel / 4;
        let sym = (body[(b / 4) as usize] >> (8 * (b % 4) + 2 * (rel % 4))) & 3;
        let s = scales[seg];
        let mut v = 0.0f32;
        if sym == 0 {
            v = -s;
        } else if sym == 2 {
            v = s;
        }
        out[i] += v;
        i += grid_stride();
    }
}


/// Reads one word of a read-back buffer.
fn word(bytes: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("a word"))
}

/// Body bytes of a segment of `n` elements: the scaler and the 2-bit symbols.
fn segment_len(n: usize) -> usize {
    4 + n.div_ceil(4)
}

/// Body bytes of these segments.
fn body_len(segs: &[Range<usize>]) -> usize {
    segs.iter().map(|s| segment_len(s.len())).sum()
}

/// The element and body segment tables on the device.
fn tables(gpu: &Gpu, segs: &[Range<usize>]) -> [(Handle, usize); 2] {
    upload_tables(gpu, [element_starts(segs), body_starts(segs, segment_len)])
}

impl DeviceCodec for TernGrad {
    fn method(&self) -> MethodId {
        TernGradConfig::ID
    }

    fn encode(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let segs = begin_payload(TernGradConfig::ID, grad.len(), ctx.segments, out)?;
        if segs.is_empty() {
            return Ok(());
        }
        let client = gpu.client();
        let [(starts, ns), (body_starts, nb)] = tables(gpu, &segs);
        let max_bits = gpu.words(segs.len(), 0);
        let first_bad = gpu.words(1, u32::MAX);
        let (count, dim) = geometry(grad.len());
        // SAFETY: the table holds S + 1 words, `max_bits` S, `first_bad` one.
        unsafe {
            segment_max::launch(
                client,
                count,
                dim,
                grad.arg(),
                BufferArg::from_raw_parts(starts.clone(), ns),
                BufferArg::from_raw_parts(max_bits.clone(), segs.len()),
                BufferArg::from_raw_parts(first_bad.clone(), 1),
            );
        }
        let read = gpu.read_words(vec![max_bits, first_bad], "reading the scalers")?;
        refuse_non_finite(gpu, grad, &read[1], out)?;
        let bounds = self.bounds(gpu, grad, &segs, out)?;
        // The host codec's draws: one key per segment, in order.
        let mut params = Vec::with_capacity(4 * segs.len());
        for (k, bound) in bounds.iter().enumerate() {
            let s = f32::from_bits(word(&read[0], k)).min(*bound);
            let key = rng.next_u64();
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            params.extend([s.to_bits(), inv.to_bits(), key as u32, (key >> 32) as u32]);
        }
        let len = body_len(&segs);
        let words = words_for(len);
        let body = gpu.words(words, 0);
        let [(params, np)] = upload_tables(gpu, [params]);
        let (count, dim) = geometry(words);
        // SAFETY: the tables hold S + 1 words each, `params` 4·S, `body` ⌈len/4⌉.
        unsafe {
            encode::launch(
                client,
                count,
                dim,
                grad.arg(),
                BufferArg::from_raw_parts(starts, ns),
                BufferArg::from_raw_parts(body_starts, nb),
                BufferArg::from_raw_parts(params, np),
                BufferArg::from_raw_parts(body.clone(), words),
            );
        }
        let read = gpu.read_words(vec![body], "reading a payload")?;
        out.buffer_mut().extend_from_slice(&read[0][..len]);
        Ok(())
    }

    fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError> {
        let (mut r, segs) = read_frame(TernGradConfig::ID, payload, out.len())?;
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
        let body = crate::words::to_words(&payload[at..]);
        let [(starts, ns), (body_starts, nb), (body, nw)] = {
            let [a, b] = tables(gpu, &segs);
            let [c] = upload_tables(gpu, [body]);
            [a, b, c]
        };
        let (count, dim) = geometry(out.len());
        // SAFETY: every buffer holds the length given; the body was validated above.
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
