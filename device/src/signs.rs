//! Sign bits behind per-segment header words — the body of `ef-signsgd` (one word, the
//! scale) and of `onebit` with one column a segment (two, `μ+` and `μ−`): per segment the
//! header's `4h` bytes, then one bit per element, 1 iff `p ≥ 0` (−0.0 included), LSB-first,
//! the segment's last byte zero-padded. The header words are the host's to compute (from
//! exact sums, `exact`); these kernels write and read the rest.

use std::ops::Range;

use cubecl::prelude::*;
use dtrain_compress::Payload;

use crate::codec::{body_starts, element_starts, upload_tables};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride, segment_of, to_words, words_for};

/// Writes the bodies, four body bytes to a word of `out`; `header` holds `h` words a
/// segment.
#[cube(launch)]
fn encode(
    x: &[f32],
    starts: &[u32],
    body_starts: &[u32],
    header: &[u32],
    out: &mut [u32],
    #[comptime] h: u32,
) {
    let len = body_starts[body_starts.len() - 1];
    let mut w = ABSOLUTE_POS;
    while w < out.len() {
        let mut word = 0u32;
        for q in 0..4u32 {
            let b = 4 * w as u32 + q;
            if b < len {
                let seg = segment_of(body_starts, b);
                let off = b - body_starts[seg as usize];
                let mut byte = 0u32;
                if off < 4 * h {
                    byte = (header[(h * seg + off / 4) as usize] >> (8 * (off % 4))) & 0xFF;
                } else {
                    let first = starts[seg as usize] + 8 * (off - 4 * h);
                    let end = min(first + 8, starts[seg as usize + 1]);
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

/// Adds `pos[s]` for each set bit of segment `s` and `neg[s]` for each clear one.
#[cube(launch)]
fn decode_add(
    body: &[u32],
    starts: &[u32],
    body_starts: &[u32],
    pos: &[f32],
    neg: &[f32],
    out: &mut [f32],
    #[comptime] h: u32,
) {
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        let seg = segment_of(starts, i as u32) as usize;
        let rel = i as u32 - starts[seg];
        let byte = body_starts[seg] + 4 * h + rel / 8;
        let bit = (body[(byte / 4) as usize] >> (8 * (byte % 4) + rel % 8)) & 1;
        let mut v = neg[seg];
        if bit == 1 {
            v = pos[seg];
        }
        out[i] += v;
        i += grid_stride();
    }
}

/// The body layout of `h` header words a segment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SignedBody {
    /// Header words a segment.
    pub h: u32,
}

impl SignedBody {
    /// Body bytes of a segment of `n` elements.
    fn segment_len(self, n: usize) -> usize {
        4 * self.h as usize + n.div_ceil(8)
    }

    /// Appends the bodies of `grad`'s segments to `out`, `header` holding `h` words a
    /// segment.
    pub(crate) fn encode(
        self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        segs: &[Range<usize>],
        header: Vec<u32>,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let starts = body_starts(segs, |n| self.segment_len(n));
        let len = *starts.last().expect("a segment at least") as usize;
        let words = words_for(len);
        let body = gpu.words(words, 0);
        let [(elems, ne), (starts, ns), (header, nh)] =
            upload_tables(gpu, [element_starts(segs), starts, header]);
        let (count, dim) = geometry(words);
        // SAFETY: the tables hold S + 1 words each, `header` h·S, `body` ⌈len/4⌉.
        unsafe {
            encode::launch(
                gpu.client(),
                count,
                dim,
                grad.arg(),
                BufferArg::from_raw_parts(elems, ne),
                BufferArg::from_raw_parts(starts, ns),
                BufferArg::from_raw_parts(header, nh),
                BufferArg::from_raw_parts(body.clone(), words),
                self.h,
            );
        }
        let read = gpu.read_words(vec![body], "reading a payload")?;
        out.buffer_mut().extend_from_slice(&read[0][..len]);
        Ok(())
    }

    /// Adds the values of `body` (every segment's, checked by the host codec's reader) into
    /// `out`: `pos[s]` for a set bit of segment `s`, `neg[s]` for a clear one.
    pub(crate) fn decode_add(
        self,
        gpu: &Gpu,
        body: &[u8],
        segs: &[Range<usize>],
        pos: &[f32],
        neg: &[f32],
        out: &GpuBuffer,
    ) {
        let [(elems, ne), (starts, ns), (body, nw)] = upload_tables(
            gpu,
            [
                element_starts(segs),
                body_starts(segs, |n| self.segment_len(n)),
                to_words(body),
            ],
        );
        let (count, dim) = geometry(out.len());
        // SAFETY: every buffer holds the length given.
        unsafe {
            decode_add::launch(
                gpu.client(),
                count,
                dim,
                BufferArg::from_raw_parts(body, nw),
                BufferArg::from_raw_parts(elems, ne),
                BufferArg::from_raw_parts(starts, ns),
                gpu.upload(pos).arg(),
                gpu.upload(neg).arg(),
                out.arg(),
                self.h,
            );
        }
    }
}
