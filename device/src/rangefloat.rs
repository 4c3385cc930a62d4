//! Range-float codes on the device: round-to-nearest encoding of a block under one `Emax`
//! into codes packed LSB-first, and the codes' values decoded back — the host's
//! `dtrain_compress::rangefloat` for windows inside f32's normal range
//! (`RfEncoder::nearest_normal`, whose rule the host tests against its own encoder). A block
//! whose window reaches below the normal range is encoded on the host by the caller (the
//! host's exact slow path; such blocks hold values under ~2⁻¹¹⁰).

use cubecl::prelude::*;
use dtrain_compress::rangefloat::{NearestNormal, RfFormat};
use dtrain_compress::wire::bytes_for_bits;

use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride};

/// The code of `v` under the rule `c` (see [`NearestNormal`]'s docs).
#[cube]
fn code_nearest(v: f32, c: &[u32]) -> u32 {
    let bits = u32::reinterpret(v);
    let a = bits & 0x7FFF_FFFF;
    let (shift, half, base, top) = (c[0], c[1], c[2], c[3]);
    let (one, fast_lo, half_lo, sign_shift) = (c[4], c[5], c[6], c[7]);
    let mut mag = 0u32;
    if a >= fast_lo {
        mag = min(((a + half) >> shift) - base, top);
    } else if a >= half_lo {
        mag = one;
    }
    let mut neg = 0u32;
    if mag != 0 {
        neg = (bits >> 31) << sign_shift;
    }
    mag | neg
}

/// Writes the codes of `vals` (`b` bits each, LSB-first) into `out`, a word per unit: the
/// codes crossing bits `32w .. 32w + 32` of word `w`. `c` holds the rule's eight constants.
#[cube(launch)]
fn encode_nearest(vals: &[f32], c: &[u32], out: &mut [u32], b: u32) {
    let n = vals.len() as u32;
    let mut w = ABSOLUTE_POS;
    while w < out.len() {
        let o = 32 * w as u32;
        let mut word = 0u32;
        let mut j = o / b;
        while j < n && b * j < o + 32 {
            let code = code_nearest(vals[j as usize], c);
            let at = b * j;
            if at >= o {
                word |= code << (at - o);
            } else {
                word |= code >> (o - at);
            }
            j += 1;
        }
        out[w] = word;
        w += grid_stride();
    }
}

/// The values of the `b`-bit codes in `codes` (packed LSB-first, `e` exponent and `q`
/// mantissa bits, window bottom `emin ≥ −126`) into `out`, one per element.
#[cube(launch)]
fn decode_values(codes: &[u32], out: &mut [f32], b: u32, e: u32, q: u32, emin: i32) {
    let mut j = ABSOLUTE_POS;
    while j < out.len() {
        let at = b * j as u32;
        let lo = (at / 32) as usize;
        let s = at % 32;
        let mut code = codes[lo] >> s;
        if s + b > 32 {
            code |= codes[lo + 1] << (32 - s);
        }
        if b < 32 {
            code &= (1u32 << b) - 1;
        }
        let exp_code = (code >> q) & ((1u32 << e) - 1);
        let mut v = 0.0f32;
        if exp_code != 0 {
            let sign = (code >> (e + q)) & 1;
            let f = code & ((1u32 << q) - 1);
            let ex = u32::cast_from(emin - 1 + 127) + exp_code;
            v = f32::reinterpret((sign << 31) | (ex << 23) | (f << (23 - q)));
        }
        out[j] = v;
        j += grid_stride();
    }
}

/// The codes of a block of `vals.len()` values on the device: a buffer of words holding
/// `bytes_for_bits(len·b)` bytes of codes.
pub(crate) struct Codes {
    /// The packed codes, as words.
    pub(crate) words: cubecl::server::Handle,
    /// The bytes of codes the words hold (the rest is padding).
    pub(crate) bytes: usize,
}

/// Round-to-nearest codes of `vals` in format `f` under the rule `rule`.
pub(crate) fn encode(gpu: &Gpu, vals: &GpuBuffer, f: RfFormat, rule: &NearestNormal) -> Codes {
    let b = f.bits();
    let bytes = bytes_for_bits(vals.len() as u64 * b as u64);
    let words = bytes.div_ceil(4);
    let out = gpu.words(words, 0);
    let r = rule;
    let consts = [
        r.shift, r.half, r.base, r.top, r.one, r.fast_lo, r.half_lo, r.sign_shift,
    ];
    let consts = gpu.client().create_from_slice(crate::codec::u32_bytes(&consts));
    if words > 0 {
        let (count, dim) = geometry(words);
        // SAFETY: `consts` holds 8 words, `out` `words`.
        unsafe {
            encode_nearest::launch(
                gpu.client(),
                count,
                dim,
                vals.arg(),
                BufferArg::from_raw_parts(consts, 8),
                BufferArg::from_raw_parts(out.clone(), words),
                b,
            );
        }
    }
    Codes { words: out, bytes }
}

/// The values of `count` codes of format `f` (window bottom `emin ≥ −126`) into `out`
/// (`count` elements).
pub(crate) fn decode(gpu: &Gpu, codes: &Codes, f: RfFormat, emin: i32, out: &GpuBuffer) {
    if out.is_empty() {
        return;
    }
    let words = codes.bytes.div_ceil(4);
    let (count, dim) = geometry(out.len());
    // SAFETY: the codes' words hold `out.len()` codes of `b` bits.
    unsafe {
        decode_values::launch(
            gpu.client(),
            count,
            dim,
            BufferArg::from_raw_parts(codes.words.clone(), words.max(1)),
            out.arg(),
            f.bits(),
            f.exp_bits(),
            f.mantissa_bits(),
            emin,
        );
    }
}
