//! `natural` on the device, in its counter mode (`draws = "counter"`): natural compression
//! (the host codec `dtrain_compress::natural`), each element's 9-bit code — sign and an
//! exponent rounded up with probability `M/2²³` — from the top 23 bits of
//! [`counter_bits`](dtrain_compress::rng::counter_bits)`(key, j)`, the key one draw of the
//! encoder's Rng per segment, as the host draws it. Codes are packed LSB-first, each segment
//! on bytes of its own: a unit writes four body bytes, each byte taking the bits of the (at
//! most two) codes that cross it. Pure bit arithmetic, so the payload is the host's byte for
//! byte on any device. The decoder adds `±2^(E'−127)` (0 for `E' = 0`); an exponent of 255
//! is the host's error, and so are set padding bits (checked on the host).
//!
//! The default `lanes` draws (one Rng draw per element, sequential) have no device form.

use std::ops::Range;

use cubecl::prelude::*;
use cubecl::server::Handle;
use dtrain_compress::natural::NaturalConfig;
use dtrain_compress::rng::Draws;
use dtrain_compress::{Method, MethodId, Rng, WireError};

use crate::codec::{check_padding, u32_bytes, StreamCodec};
use crate::counter::counter_bits;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride, segment_of, words_for};

/// Bits per code.
const CODE_BITS: usize = 9;

/// The `natural` device codec (counter draws).
#[derive(Debug, Clone, Copy, Default)]
pub struct Natural;

impl Natural {
    /// The device codec of `cfg`, where it has one: counter draws.
    pub fn for_config(cfg: &NaturalConfig) -> Option<Natural> {
        (cfg.draws == Draws::Counter).then_some(Natural)
    }
}

/// The 9-bit code of element `j` (value bits `bits`) under key `(k0, k1)`.
#[cube]
fn code(bits: u32, k0: u32, k1: u32, j: u32) -> u32 {
    let u = counter_bits(k0, k1, j) >> 9;
    let e = (bits >> 23) & 0xFF;
    let m = bits & 0x7F_FFFF;
    let mut up = 0u32;
    if u < m && e < 254 {
        up = 1;
    }
    ((bits >> 31) << 8) | (e + up)
}

/// Writes the codes of `x`, four body bytes to a word of `out`; `keys` holds each segment's
/// key as two words.
#[cube(launch)]
fn encode(
    x: &[f32],
    starts: &[u32],
    byte_starts: &[u32],
    keys: &[u32],
    out: &mut [u32],
    first_bad: &[Atomic<u32>],
) {
    let len = byte_starts[byte_starts.len() - 1];
    let mut w = ABSOLUTE_POS;
    while w < out.len() {
        let mut word = 0u32;
        for q in 0..4u32 {
            let b = 4 * w as u32 + q;
            if b < len {
                let seg = segment_of(byte_starts, b) as usize;
                let n = starts[seg + 1] - starts[seg];
                let o = 8 * (b - byte_starts[seg]);
                let mut byte = 0u32;
                // The codes crossing bits o..o+8 of the segment: j0 = ⌊o/9⌋ and the next.
                let j0 = o / 9;
                for d in 0..2u32 {
                    let j = j0 + d;
                    let at = 9 * j;
                    if j < n && at < o + 8 {
                        let i = (starts[seg] + j) as usize;
                        let bits = u32::reinterpret(x[i]);
                        if (bits & 0x7FFF_FFFF) >= 0x7F80_0000 {
                            first_bad[0].fetch_min(i as u32);
                        }
                        let c = code(bits, keys[2 * seg], keys[2 * seg + 1], j);
                        if at >= o {
                            byte |= c << (at - o);
                        } else {
                            byte |= c >> (o - at);
                        }
                    }
                }
                word |= (byte & 0xFF) << (8 * q);
            }
        }
        out[w] = word;
        w += grid_stride();
    }
}

/// Adds the value of each code of `body` into `out`; an exponent of 255 lowers `first_bad`.
#[cube(launch)]
fn decode_add(
    body: &[u32],
    starts: &[u32],
    byte_starts: &[u32],
    out: &mut [f32],
    first_bad: &[Atomic<u32>],
) {
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        let seg = segment_of(starts, i as u32) as usize;
        let p = 8 * byte_starts[seg] + 9 * (i as u32 - starts[seg]);
        let shift = p % 32;
        let mut c = body[(p / 32) as usize] >> shift;
        if shift > 23 {
            c |= body[(p / 32 + 1) as usize] << (32 - shift);
        }
        c &= 0x1FF;
        let e = c & 0xFF;
        if e == 0xFF {
            first_bad[0].fetch_min(i as u32);
        }
        out[i] += f32::reinterpret(((c >> 8) << 31) | (e << 23));
        i += grid_stride();
    }
}



impl StreamCodec for Natural {
    fn method(&self) -> MethodId {
        NaturalConfig::ID
    }
    fn segment_len(&self, n: usize) -> usize {
        (CODE_BITS * n).div_ceil(8)
    }
    fn body_what(&self) -> &'static str {
        "natural codes"
    }
    fn encode_body(
        &self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        segs: &[Range<usize>],
        rng: &mut Rng,
        body: &Handle,
        first_bad: &Handle,
    ) {
        let keys: Vec<u32> = segs
            .iter()
            .flat_map(|_| {
                let k = rng.next_u64();
                [k as u32, (k >> 32) as u32]
            })
            .collect();
        let words = words_for(self.body_len(segs));
        let [(elems, ne), (bytes, nb)] = self.tables(gpu, segs);
        let (count, dim) = geometry(words);
        // SAFETY: the tables hold their lengths, `keys` 2·S words, `body` ⌈len/4⌉, `first_bad` one.
        unsafe {
            encode::launch(
                gpu.client(),
                count,
                dim,
                grad.arg(),
                BufferArg::from_raw_parts(elems, ne),
                BufferArg::from_raw_parts(bytes, nb),
                BufferArg::from_raw_parts(
                    gpu.client().create_from_slice(u32_bytes(&keys)),
                    keys.len(),
                ),
                BufferArg::from_raw_parts(body.clone(), words),
                BufferArg::from_raw_parts(first_bad.clone(), 1),
            );
        }
    }
    fn check_body(&self, body: &[u8], segs: &[Range<usize>]) -> Result<(), (usize, WireError)> {
        check_padding(body, segs, CODE_BITS, "natural: unused code bits are not zero")
    }
    fn decode_body(
        &self,
        gpu: &Gpu,
        body: &Handle,
        segs: &[Range<usize>],
        out: &GpuBuffer,
        first_bad: &Handle,
    ) {
        let words = words_for(self.body_len(segs));
        let [(elems, ne), (bytes, nb)] = self.tables(gpu, segs);
        let (count, dim) = geometry(out.len());
        // SAFETY: as in `encode_body`; a code's second word exists whenever its bits cross
        // into it, since the body holds every code's bits.
        unsafe {
            decode_add::launch(
                gpu.client(),
                count,
                dim,
                BufferArg::from_raw_parts(body.clone(), words),
                BufferArg::from_raw_parts(elems, ne),
                BufferArg::from_raw_parts(bytes, nb),
                out.arg(),
                BufferArg::from_raw_parts(first_bad.clone(), 1),
            );
        }
    }
    fn invalid_value(&self) -> WireError {
        WireError::Invalid("natural: exponent 255 is not a power of two")
    }
}
