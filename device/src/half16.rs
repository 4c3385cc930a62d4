//! The 16-bit float casts of `fp16` and `bf16` on the device ([`Half16`]), in integer arithmetic, so the
//! rounding is the host's exactly whatever the device's own conversions do: round to
//! nearest even, an overflow saturated to the format's largest finite value (the host
//! codec's rule), `fp16` subnormals rounded as IEEE 754 says. Two values per word, the
//! element with the smaller index in the low half (the little-endian byte order of the
//! host's body).

use std::ops::Range;

use cubecl::prelude::*;
use cubecl::server::Handle;
use dtrain_compress::{bf16::Bf16Config, fp16::Fp16Config, Method, MethodId, Rng, WireError};

use crate::codec::StreamCodec;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride};

/// `f32` bits of the smallest non-finite magnitude (∞).
const INF_BITS: u32 = 0x7F80_0000;

/// The binary16 bits of `x` (finite), rounded to nearest even; magnitudes that round past
/// 65 504 give ±65 504.
#[cube]
fn f16_bits(bits: u32) -> u32 {
    let sign = (bits >> 16) & 0x8000;
    let a = bits & 0x7FFF_FFFF;
    let mut h = 0u32;
    if a >= 0x477F_F000 {
        // 65 520 and above round to ∞ (65 504 + half an ulp ties to the even ∞): saturate.
        h = 0x7BFF;
    } else if a >= 0x3880_0000 {
        // Normal in binary16 (≥ 2⁻¹⁴): rebias the exponent by 112, round off 13 bits.
        h = (a - 0x3800_0000 + 0x0FFF + ((a >> 13) & 1)) >> 13;
    } else if a > 0x3300_0000 {
        // Subnormal in binary16 (above 2⁻²⁵, which ties to 0): the value in units of 2⁻²⁴
        // is the 24-bit significand shifted right by 126 − e, rounded to nearest even.
        let m = (a & 0x007F_FFFF) | 0x0080_0000;
        let shift = 126 - (a >> 23);
        let q = m >> shift;
        let rem = m - (q << shift);
        let half = 1u32 << (shift - 1);
        h = q;
        if rem > half || (rem == half && (q & 1) == 1) {
            h += 1;
        }
    }
    sign | h
}

/// The bfloat16 bits of `x` (finite), rounded to nearest even; magnitudes that round past
/// the largest bfloat16 give ±that value.
#[cube]
fn bf16_bits(bits: u32) -> u32 {
    let sign = (bits >> 16) & 0x8000;
    let a = bits & 0x7FFF_FFFF;
    let mut h = (a + 0x7FFF + ((a >> 16) & 1)) >> 16;
    if h >= 0x7F80 {
        h = 0x7F7F;
    }
    sign | h
}

/// The 16-bit code of element `i` of `x`; a non-finite element lowers `first_bad` to `i`.
#[cube]
fn code(x: &[f32], i: usize, first_bad: &[Atomic<u32>], #[comptime] bf16: bool) -> u32 {
    let bits = u32::reinterpret(x[i]);
    if (bits & 0x7FFF_FFFF) >= INF_BITS {
        first_bad[0].fetch_min(i as u32);
    }
    if bf16 {
        bf16_bits(bits)
    } else {
        f16_bits(bits)
    }
}

/// Encodes `x` as 16-bit floats, two to a word of `out` (`⌈n/2⌉` words).
#[cube(launch)]
fn encode(
    x: &[f32],
    out: &mut [u32],
    first_bad: &[Atomic<u32>],
    #[comptime] bf16: bool,
) {
    let n = x.len();
    let words = n.div_ceil(2);
    let mut w = ABSOLUTE_POS;
    while w < words {
        let lo = code(x, 2 * w, first_bad, bf16);
        let mut hi = 0u32;
        if 2 * w + 1 < n {
            hi = code(x, 2 * w + 1, first_bad, bf16);
        }
        out[w] = lo | (hi << 16);
        w += grid_stride();
    }
}

/// The `f32` value of binary16 bits `h` (exact); ∞ and NaN codes lower `first_bad` to `i`.
#[cube]
fn f16_value(h: u32, i: usize, first_bad: &[Atomic<u32>]) -> f32 {
    let sign = (h & 0x8000) << 16;
    let e = (h >> 10) & 0x1F;
    let m = h & 0x3FF;
    let mut v = 0.0f32;
    if e == 0x1F {
        first_bad[0].fetch_min(i as u32);
    } else if e == 0 {
        // Subnormal: m · 2⁻²⁴, exact in f32 (a normal number for m > 0).
        v = f32::cast_from(m) * 5.960_464_5e-8;
        v = f32::reinterpret(u32::reinterpret(v) | sign);
    } else {
        v = f32::reinterpret(sign | ((e + 112) << 23) | (m << 13));
    }
    v
}

/// The `f32` value of bfloat16 bits `h` (exact); ∞ and NaN codes lower `first_bad` to `i`.
#[cube]
fn bf16_value(h: u32, i: usize, first_bad: &[Atomic<u32>]) -> f32 {
    if (h & 0x7F80) == 0x7F80 {
        first_bad[0].fetch_min(i as u32);
    }
    f32::reinterpret(h << 16)
}

/// Adds the 16-bit floats of `body` (two to a word) into `out`.
#[cube(launch)]
fn decode_add(
    body: &[u32],
    out: &mut [f32],
    first_bad: &[Atomic<u32>],
    #[comptime] bf16: bool,
) {
    let n = out.len();
    let mut i = ABSOLUTE_POS;
    while i < n {
        let h = (body[i / 2] >> (16 * (i % 2) as u32)) & 0xFFFF;
        let v = if bf16 {
            bf16_value(h, i, first_bad)
        } else {
            f16_value(h, i, first_bad)
        };
        out[i] += v;
        i += grid_stride();
    }
}

/// The device codec of `fp16` (`bf16: false`) or `bf16`: 16 bits an element, one encode
/// and one decode kernel; the segments do not change the body.
#[derive(Debug, Clone, Copy)]
pub struct Half16 {
    bf16: bool,
}

impl Half16 {
    /// `fp16`'s codec.
    pub const FP16: Half16 = Half16 { bf16: false };
    /// `bf16`'s codec.
    pub const BF16: Half16 = Half16 { bf16: true };
}

impl StreamCodec for Half16 {
    fn method(&self) -> MethodId {
        if self.bf16 {
            Bf16Config::ID
        } else {
            Fp16Config::ID
        }
    }
    fn segment_len(&self, n: usize) -> usize {
        2 * n
    }
    fn body_what(&self) -> &'static str {
        if self.bf16 {
            "bf16 values"
        } else {
            "fp16 values"
        }
    }
    fn encode_body(
        &self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        _segs: &[Range<usize>],
        _rng: &mut Rng,
        body: &Handle,
        first_bad: &Handle,
    ) {
        let words = grad.len().div_ceil(2);
        let (count, dim) = geometry(words);
        // SAFETY: `body` holds ⌈n/2⌉ words and `first_bad` one (made by `Stream::encode`).
        unsafe {
            encode::launch(
                gpu.client(),
                count,
                dim,
                grad.arg(),
                BufferArg::from_raw_parts(body.clone(), words),
                BufferArg::from_raw_parts(first_bad.clone(), 1),
                self.bf16,
            );
        }
    }
    fn decode_body(
        &self,
        gpu: &Gpu,
        body: &Handle,
        _segs: &[Range<usize>],
        out: &GpuBuffer,
        first_bad: &Handle,
    ) {
        let (count, dim) = geometry(out.len());
        // SAFETY: `body` holds ⌈n/2⌉ words (its length was checked) and `first_bad` one.
        unsafe {
            decode_add::launch(
                gpu.client(),
                count,
                dim,
                BufferArg::from_raw_parts(body.clone(), out.len().div_ceil(2)),
                out.arg(),
                BufferArg::from_raw_parts(first_bad.clone(), 1),
                self.bf16,
            );
        }
    }
    fn invalid_value(&self) -> WireError {
        WireError::Invalid(if self.bf16 {
            "non-finite bf16 value"
        } else {
            "non-finite fp16 value"
        })
    }
}
