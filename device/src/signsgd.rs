//! `signsgd` and `signum` on the device: one bit per element, 1 iff `p_j ≥ 0` (−0.0
//! included), LSB-first, each segment's bits starting on a byte of their own (the host codec
//! `dtrain_compress::signsgd`). Signum's momentum is the memory's, applied before the codec,
//! so both methods share these kernels; only the id byte differs.
//!
//! Each unit writes one word (four body bytes), finding each byte's segment by a binary
//! search in the segment table; the decoder finds each element's bit the same way.

use std::ops::Range;

use cubecl::prelude::*;
use cubecl::server::Handle;
use dtrain_compress::{
    signsgd::{SignSgdConfig, SignumConfig},
    Method, MethodId, Rng, WireError,
};

use crate::codec::{check_padding, StreamCodec};
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride, segment_of, words_for};

/// The host's error for set padding bits (the same text for both methods).
const PADDING: &str = "signsgd sign bits (unused bits must be 0)";

/// The sign-bit device codec of `signsgd` ([`SignBits::SIGNSGD`]) and `signum`
/// ([`SignBits::SIGNUM`]).
#[derive(Debug, Clone, Copy)]
pub struct SignBits {
    id: MethodId,
}

impl SignBits {
    /// `signsgd`'s.
    pub const SIGNSGD: SignBits = SignBits {
        id: SignSgdConfig::ID,
    };
    /// `signum`'s.
    pub const SIGNUM: SignBits = SignBits {
        id: SignumConfig::ID,
    };
}


/// Writes the sign bits of `x`, four body bytes to a word of `out`.
#[cube(launch)]
fn encode(
    x: &[f32],
    elem_starts: &[u32],
    byte_starts: &[u32],
    out: &mut [u32],
    first_bad: &[Atomic<u32>],
) {
    let len = byte_starts[byte_starts.len() - 1];
    let mut w = ABSOLUTE_POS;
    while w < out.len() {
        let mut word = 0u32;
        for j in 0..4u32 {
            let b = 4 * w as u32 + j;
            if b < len {
                let s = segment_of(byte_starts, b) as usize;
                let first = elem_starts[s] + 8 * (b - byte_starts[s]);
                let end = min(first + 8, elem_starts[s + 1]);
                let mut byte = 0u32;
                for k in 0..end - first {
                    let i = first + k;
                    let bits = u32::reinterpret(x[i as usize]);
                    if (bits & 0x7FFF_FFFF) >= 0x7F80_0000 {
                        first_bad[0].fetch_min(i);
                    }
                    // p ≥ 0: the sign bit clear, or −0.0.
                    if bits <= 0x8000_0000 {
                        byte |= 1u32 << k;
                    }
                }
                word |= byte << (8 * j);
            }
        }
        out[w] = word;
        w += grid_stride();
    }
}

/// Adds ±1 for each sign bit of `body` into `out`.
#[cube(launch)]
fn decode_add(body: &[u32], elem_starts: &[u32], byte_starts: &[u32], out: &mut [f32]) {
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        let s = segment_of(elem_starts, i as u32) as usize;
        let rel = i as u32 - elem_starts[s];
        let byte = byte_starts[s] + rel / 8;
        let bit = (body[(byte / 4) as usize] >> (8 * (byte % 4) + rel % 8)) & 1;
        out[i] += if bit == 1 { 1.0f32 } else { -1.0f32 };
        i += grid_stride();
    }
}


impl StreamCodec for SignBits {
    fn method(&self) -> MethodId {
        self.id
    }
    fn segment_len(&self, n: usize) -> usize {
        n.div_ceil(8)
    }
    fn body_what(&self) -> &'static str {
        PADDING
    }
    fn encode_body(
        &self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        segs: &[Range<usize>],
        _rng: &mut Rng,
        body: &Handle,
        first_bad: &Handle,
    ) {
        let words = words_for(self.body_len(segs));
        let [(elems, ne), (bytes, nb)] = self.tables(gpu, segs);
        let (count, dim) = geometry(words);
        // SAFETY: the tables hold their lengths, `body` ⌈len/4⌉ words, `first_bad` one.
        unsafe {
            encode::launch(
                gpu.client(),
                count,
                dim,
                grad.arg(),
                BufferArg::from_raw_parts(elems, ne),
                BufferArg::from_raw_parts(bytes, nb),
                BufferArg::from_raw_parts(body.clone(), words),
                BufferArg::from_raw_parts(first_bad.clone(), 1),
            );
        }
    }
    fn check_body(&self, body: &[u8], segs: &[Range<usize>]) -> Result<(), (usize, WireError)> {
        check_padding(body, segs, 1, PADDING)
    }
    fn decode_body(
        &self,
        gpu: &Gpu,
        body: &Handle,
        segs: &[Range<usize>],
        out: &GpuBuffer,
        _first_bad: &Handle,
    ) {
        let words = words_for(self.body_len(segs));
        let [(elems, ne), (bytes, nb)] = self.tables(gpu, segs);
        let (count, dim) = geometry(out.len());
        // SAFETY: as in `encode_body`.
        unsafe {
            decode_add::launch(
                gpu.client(),
                count,
                dim,
                BufferArg::from_raw_parts(body.clone(), words),
                BufferArg::from_raw_parts(elems, ne),
                BufferArg::from_raw_parts(bytes, nb),
                out.arg(),
            );
        }
    }
    fn invalid_value(&self) -> WireError {
        WireError::Invalid(PADDING)
    }
}
