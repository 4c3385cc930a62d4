//! `range-float`: the range-based floating-point quantizer (RF) of ALGORITHMS.md §2, as
//! reusable block functions ([`RfFormat`], [`RfEncoder`], [`RfDecoder`]) and as a dense
//! compressor ([`RangeFloat`]).
//!
//! ## Format
//! A code is `b = 1 + e + q` bits: `sign << (e+q) | exp_code << q | f`. Per block there is
//! one `Emax = ⌊log2 max|v|⌋` (an `i8`; clamped to `[-128, 127]`, and 0 for an all-zero
//! block). Exponent codes `1..2^e−1` stand for `E = Emin − 1 + exp_code` with
//! `Emin = Emax − (2^e − 2)`; a normal code is `±(1 + f/2^q)·2^E`. Code 0 is zero; any other
//! code with `exp_code == 0` is non-canonical and rejected by the decoder.
//!
//! Encoding rounds to nearest (ties away from zero), or stochastically (`floor(z + U)`),
//! saturating at the top of the window and snapping values below `2^Emin` to 0 or `2^Emin`.
//! Error bound (tested): `|v − Q(v)| ≤ max(2^−(q+1)|v|, 2^(Emin−1))`.
//!
//! The fast path works on the f32 bit pattern (adding half a unit in the last kept place to
//! the exponent+mantissa field carries into the exponent by itself); values whose window
//! reaches below the f32 normal range take an exact f64 slow path.
//!
//! ## Dense body (one per segment)
//! ```text
//! i8   Emax
//! ⌈n·b/8⌉ bytes   n codes of b bits, LSB-first
//! ```
//! Bits per segment: `8 + n·b` exactly. Round-to-nearest is biased (default memory:
//! residual); stochastic rounding is unbiased inside the window (default memory: none)
//! except for values above the top representable magnitude, which saturate.
//! Aggregation: dense (decode, then all-reduce in f32).

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::{ConfigError, WireError};
use crate::memory::MemoryConfig;
use crate::registry::Method;
use crate::rng::Rng;
use crate::wire::{bytes_for_bits, BitReader, BitWriter, Reader, Writer};

/// How a value between two representable neighbours is rounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Rounding {
    /// Round to nearest, ties away from zero (deterministic, biased).
    #[default]
    Nearest,
    /// `floor(z + U)`, `U ~ Uniform[0,1)`: unbiased inside the window.
    Stochastic,
}

/// An RF code format: `e` exponent bits and `q` mantissa bits (plus one sign bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RfFormat {
    e: u32,
    q: u32,
}

impl RfFormat {
    /// A format with `exp_bits ∈ 1..=8` and `mantissa_bits ∈ 0..=23` (so `1+e+q ≤ 32`).
    pub fn new(exp_bits: u8, mantissa_bits: u8) -> Result<Self, ConfigError> {
        if !(1..=8).contains(&exp_bits) {
            return Err(ConfigError::new(
                "exp_bits",
                format!("must be in 1..=8, got {exp_bits}"),
            ));
        }
        if mantissa_bits > 23 {
            return Err(ConfigError::new(
                "mantissa_bits",
                format!("must be in 0..=23, got {mantissa_bits}"),
            ));
        }
        Ok(RfFormat {
            e: exp_bits as u32,
            q: mantissa_bits as u32,
        })
    }

    /// Exponent bits `e`.
    pub fn exp_bits(&self) -> u32 {
        self.e
    }

    /// Mantissa bits `q`.
    pub fn mantissa_bits(&self) -> u32 {
        self.q
    }

    /// Code width `b = 1 + e + q`.
    pub fn bits(&self) -> u32 {
        1 + self.e + self.q
    }

    /// Bottom exponent of the window, `Emin = Emax − (2^e − 2)`.
    pub fn emin(&self, emax: i8) -> i32 {
        emax as i32 - ((1i32 << self.e) - 2)
    }

    /// Bits of one block of `n` values: `8 + n·b` (the `Emax` byte and the codes).
    pub fn block_bits(&self, n: usize) -> u64 {
        8 + n as u64 * self.bits() as u64
    }

    /// Largest magnitude code (`exp_code = 2^e − 1`, `f = 2^q − 1`).
    fn top(&self) -> u32 {
        (((1u32 << self.e) - 1) << self.q) | ((1u32 << self.q) - 1)
    }

    /// Exact value of code `code` in f64, or `None` for a non-canonical zero.
    pub fn value_f64(&self, emax: i8, code: u32) -> Option<f64> {
        let sign = (code >> (self.e + self.q)) & 1;
        let exp_code = (code >> self.q) & ((1 << self.e) - 1);
        let f = code & ((1 << self.q) - 1);
        if exp_code == 0 {
            return if code == 0 { Some(0.0) } else { None };
        }
        let e = self.emin(emax) - 1 + exp_code as i32;
        let mag = (1.0 + f as f64 / (1u64 << self.q) as f64) * pow2(e);
        Some(if sign == 1 { -mag } else { mag })
    }

    /// Value of `code` as an f32 (bit assembly for normal results), `None` if non-canonical.
    #[inline]
    pub fn value(&self, emax: i8, code: u32) -> Option<f32> {
        let sign = (code >> (self.e + self.q)) & 1;
        let exp_code = (code >> self.q) & ((1 << self.e) - 1);
        if exp_code == 0 {
            return if code == 0 { Some(0.0) } else { None };
        }
        let e = self.emin(emax) - 1 + exp_code as i32;
        if e >= -126 {
            let f = code & ((1 << self.q) - 1);
            let bits = (sign << 31) | (((e + 127) as u32) << 23) | (f << (23 - self.q));
            Some(f32::from_bits(bits))
        } else {
            self.value_f64(emax, code).map(|v| v as f32)
        }
    }

    /// Round trip of one value through the format with round-to-nearest: `Q(v)`.
    pub fn quantize(&self, emax: i8, v: f32) -> f32 {
        let enc = RfEncoder::new(*self, emax);
        let code = enc.code_nearest(v);
        self.value(emax, code).unwrap_or(0.0)
    }
}

/// `2^e` as f64 for `e` in f64's normal range (RF exponents always are).
#[inline]
fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// `Emax = ⌊log2 max|v|⌋` of a block, clamped to `[-128, 127]`; 0 for an all-zero block.
/// Non-finite values count as the largest magnitude (Emax 127).
pub fn emax_of(x: &[f32]) -> i8 {
    emax_of_abs_bits(crate::simd::max_magnitude_bits(x))
}

/// [`emax_of`] from the bit pattern of the block's largest magnitude.
pub fn emax_of_abs_bits(m: u32) -> i8 {
    if m == 0 {
        return 0;
    }
    let e = if m >= 0x0080_0000 {
        (m >> 23) as i32 - 127
    } else {
        -149 + (31 - m.leading_zeros() as i32)
    };
    e.clamp(-128, 127) as i8
}

/// The constants of [`RfEncoder`]'s round-to-nearest path for a window inside f32's normal
/// range (`Emin ≥ −126`), for an encoder written elsewhere (dtrain-device's kernels): with
/// `a` a value's sign-cleared bits, its magnitude code is `min((a + half) >> shift − base,
/// top)` (wrapping subtraction) where `a ≥ fast_lo`, else `one` where `a ≥ half_lo`, else 0;
/// a non-zero magnitude of a negative value gets `1 << sign_shift` added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NearestNormal {
    /// `23 − q`.
    pub shift: u32,
    /// Half a unit in the last kept place (0 when `q = 23`).
    pub half: u32,
    /// The exponent-and-mantissa field of `2^Emin`, shifted, minus code 1's.
    pub base: u32,
    /// The largest magnitude code.
    pub top: u32,
    /// The magnitude code of `2^Emin`.
    pub one: u32,
    /// The bits of `2^Emin`.
    pub fast_lo: u32,
    /// The bits of `2^(Emin−1)`.
    pub half_lo: u32,
    /// Where the sign bit goes, `e + q`.
    pub sign_shift: u32,
}

/// Per-block encoder: the format and `Emax` with the bit-trick constants precomputed.
#[derive(Debug, Clone, Copy)]
pub struct RfEncoder {
    fmt: RfFormat,
    emax: i32,
    emin: i32,
    shift: u32,
    half: u32,
    base: u32,
    top: u32,
    one: u32,
    fast_lo: u32,
    half_lo: u32,
    sign_shift: u32,
    lo_f64: f64,
    below_scale: f64,
}

impl RfEncoder {
    /// An encoder for blocks with this `Emax`.
    pub fn new(fmt: RfFormat, emax: i8) -> Self {
        let emin = fmt.emin(emax);
        let q = fmt.q;
        let shift = 23 - q;
        let fast_e = emin.max(-126);
        RfEncoder {
            fmt,
            emax: emax as i32,
            emin,
            shift,
            half: if shift == 0 { 0 } else { 1 << (shift - 1) },
            base: ((emin + 126) as i64 * (1i64 << q)) as u32,
            top: fmt.top(),
            one: 1 << q,
            fast_lo: ((fast_e + 127) as u32) << 23,
            // 2^(Emin-1) as f32 bits; only used when Emin ≥ -126 (so Emin-1 ≥ -127).
            half_lo: if emin >= -126 {
                (pow2(emin - 1) as f32).to_bits()
            } else {
                0
            },
            sign_shift: fmt.e + q,
            lo_f64: pow2(emin),
            below_scale: pow2(32 - emin),
        }
    }

    /// The round-to-nearest constants where the window lies in f32's normal range, `None`
    /// where it reaches below (those blocks take the exact slow path).
    pub fn nearest_normal(&self) -> Option<NearestNormal> {
        (self.emin >= -126).then_some(NearestNormal {
            shift: self.shift,
            half: self.half,
            base: self.base,
            top: self.top,
            one: self.one,
            fast_lo: self.fast_lo,
            half_lo: self.half_lo,
            sign_shift: self.sign_shift,
        })
    }

    /// Exact reference encoder of a magnitude `a` (f64), with `u = Some(U)` for stochastic
    /// rounding. Returns the magnitude code.
    fn slow(&self, a: f64, u: Option<f64>) -> u32 {
        let lo = self.lo_f64;
        if a < lo {
            let up = match u {
                None => a >= 0.5 * lo,
                Some(u) => u < a / lo,
            };
            return if up { self.one } else { 0 };
        }
        let fl = ((a.to_bits() >> 52) as i32) - 1023; // a ≥ 2^-382: normal in f64
        let mut e = fl.min(self.emax);
        let scale = (1u64 << self.fmt.q) as f64;
        let z = (a / pow2(e) - 1.0) * scale;
        let mut f = match u {
            None => (z + 0.5).floor(),
            Some(u) => (z + u).floor(),
        };
        if f >= scale {
            if e < self.emax {
                e += 1;
                f = 0.0;
            } else {
                f = scale - 1.0;
            }
        }
        ((((e - self.emin + 1) as u32) << self.fmt.q) | f as u32).min(self.top)
    }

    #[inline(always)]
    fn mag_nearest(&self, abits: u32) -> u32 {
        if abits >= self.fast_lo {
            ((abits + self.half) >> self.shift)
                .wrapping_sub(self.base)
                .min(self.top)
        } else if self.emin >= -126 {
            if abits >= self.half_lo {
                self.one
            } else {
                0
            }
        } else {
            self.slow(f32::from_bits(abits) as f64, None)
        }
    }

    #[inline(always)]
    fn mag_stochastic(&self, abits: u32, r: u32) -> u32 {
        if abits >= self.fast_lo {
            // The top `shift` bits of r: floor(z + U) with the same U as the slow path sees.
            let rr = (r >> 9) >> (23 - self.shift);
            ((abits + rr) >> self.shift)
                .wrapping_sub(self.base)
                .min(self.top)
        } else {
            let u = r as f64 * (1.0 / 4_294_967_296.0);
            self.slow(f32::from_bits(abits) as f64, Some(u))
        }
    }

    #[inline(always)]
    fn with_sign(&self, bits: u32, mag: u32) -> u32 {
        let neg = ((bits >> 31) & (mag != 0) as u32) << self.sign_shift;
        mag | neg
    }

    /// Round-to-nearest code of `v`.
    #[inline(always)]
    pub fn code_nearest(&self, v: f32) -> u32 {
        let bits = v.to_bits();
        self.with_sign(bits, self.mag_nearest(bits & 0x7FFF_FFFF))
    }

    /// Stochastic-rounding code of `v` using 32 random bits `r`.
    #[inline(always)]
    pub fn code_stochastic(&self, v: f32, r: u32) -> u32 {
        let bits = v.to_bits();
        self.with_sign(bits, self.mag_stochastic(bits & 0x7FFF_FFFF, r))
    }

    /// Reference (slow, f64) encoder, exposed for tests: same result as the fast path.
    pub fn code_reference(&self, v: f32, u: Option<f64>) -> u32 {
        let bits = v.to_bits();
        let a = f32::from_bits(bits & 0x7FFF_FFFF) as f64;
        let mag = if a >= pow2(self.emax + 1) {
            self.top
        } else {
            self.slow(a, u)
        };
        self.with_sign(bits, mag)
    }

    /// Branch-free round-to-nearest magnitude for windows inside the f32 normal range.
    #[inline(always)]
    fn mag_nearest_normal(&self, abits: u32) -> u32 {
        let hi = ((abits.wrapping_add(self.half)) >> self.shift)
            .wrapping_sub(self.base)
            .min(self.top);
        let lo = if abits >= self.half_lo { self.one } else { 0 };
        if abits >= self.fast_lo {
            hi
        } else {
            lo
        }
    }

    /// Branch-free stochastic magnitude for windows inside the f32 normal range; the same
    /// result as [`RfEncoder::code_stochastic`] for the same `r`.
    #[inline(always)]
    fn mag_stochastic_normal(&self, abits: u32, r: u32) -> u32 {
        let rr = (r >> 9) >> (23 - self.shift);
        let hi = ((abits.wrapping_add(rr)) >> self.shift)
            .wrapping_sub(self.base)
            .min(self.top);
        // Below the window: up with probability a/2^Emin, i.e. r/2^32 < a/2^Emin.
        let a = f32::from_bits(abits) as f64;
        let lo = if (r as f64) < a * self.below_scale {
            self.one
        } else {
            0
        };
        if abits >= self.fast_lo {
            hi
        } else {
            lo
        }
    }

    /// Encodes `x` into `out` (zeroed, exactly `bytes_for_bits(x.len()·b)` bytes), codes
    /// packed LSB-first. Stochastic rounding draws from `rng` (32 bits per element).
    pub fn encode(&self, x: &[f32], rounding: Rounding, rng: &mut Rng, out: &mut [u8]) {
        debug_assert_eq!(
            out.len(),
            bytes_for_bits(x.len() as u64 * self.fmt.bits() as u64)
        );
        let normal = self.emin >= -126;
        let b = self.fmt.bits() as usize;
        // Blocks of 256 codes (a whole number of bytes for any width).
        let mut r = [0u32; 256];
        for (i, xs) in x.chunks(256).enumerate() {
            let os = &mut out[i * 32 * b..];
            let os = &mut os[..bytes_for_bits((xs.len() * b) as u64)];
            match (rounding, normal) {
                (Rounding::Nearest, true) => self.pack(xs, os, |v, _| {
                    let bits = v.to_bits();
                    self.with_sign(bits, self.mag_nearest_normal(bits & 0x7FFF_FFFF))
                }),
                (Rounding::Nearest, false) => self.pack(xs, os, |v, _| self.code_nearest(v)),
                (Rounding::Stochastic, _) => {
                    for p in r.chunks_exact_mut(2) {
                        let u = rng.next_u64();
                        p[0] = u as u32;
                        p[1] = (u >> 32) as u32;
                    }
                    if normal {
                        self.pack(xs, os, |v, j| {
                            let bits = v.to_bits();
                            let m = self.mag_stochastic_normal(bits & 0x7FFF_FFFF, r[j]);
                            self.with_sign(bits, m)
                        })
                    } else {
                        self.pack(xs, os, |v, j| self.code_stochastic(v, r[j]))
                    }
                }
            }
        }
    }

    #[inline(always)]
    fn pack(&self, x: &[f32], out: &mut [u8], code: impl Fn(f32, usize) -> u32) {
        let b = self.fmt.bits();
        match b {
            8 => {
                for (j, (o, &v)) in out.iter_mut().zip(x).enumerate() {
                    *o = code(v, j) as u8;
                }
            }
            16 => {
                for (j, (o, &v)) in out.chunks_exact_mut(2).zip(x).enumerate() {
                    o.copy_from_slice(&(code(v, j) as u16).to_le_bytes());
                }
            }
            _ => {
                let mut w = BitWriter::new(out);
                for (j, &v) in x.iter().enumerate() {
                    w.put(code(v, j), b);
                }
                w.finish();
            }
        }
    }
}

/// Per-block decoder; uses a lookup table of all `2^b` codes when `b ≤ 16` and the block is
/// large enough to amortise building it.
#[derive(Debug, Clone)]
pub struct RfDecoder {
    fmt: RfFormat,
    emax: i8,
    table: Vec<f32>,
}

impl RfDecoder {
    /// A decoder for a block with this `Emax` that will decode about `count` codes.
    pub fn new(fmt: RfFormat, emax: i8, count: usize) -> Self {
        let b = fmt.bits();
        let table = if b <= 16 && count >= (1usize << b) / 4 {
            (0..1u32 << b)
                .map(|c| fmt.value(emax, c).unwrap_or(f32::NAN))
                .collect()
        } else {
            Vec::new()
        };
        RfDecoder { fmt, emax, table }
    }

    /// Decodes `out.len()` codes from `bytes`, which must be exactly
    /// `bytes_for_bits(out.len()·b)` long with zero padding bits; overwrites `out`.
    /// Non-canonical codes and non-zero padding are [`WireError::Invalid`].
    pub fn decode(&self, bytes: &[u8], out: &mut [f32]) -> Result<(), WireError> {
        let b = self.fmt.bits();
        let nbits = out.len() as u64 * b as u64;
        if bytes.len() != bytes_for_bits(nbits) {
            return Err(WireError::Invalid(
                "range-float code bytes have the wrong length",
            ));
        }
        let pad = (nbits % 8) as u32;
        if pad != 0 && (bytes[bytes.len() - 1] >> pad) != 0 {
            return Err(WireError::Invalid("range-float padding bits are not zero"));
        }
        if !self.table.is_empty() {
            let t = &self.table[..];
            match b {
                8 => {
                    for (o, &c) in out.iter_mut().zip(bytes) {
                        *o = t[c as usize];
                    }
                }
                16 => {
                    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                        *o = t[u16::from_le_bytes([c[0], c[1]]) as usize];
                    }
                }
                _ => {
                    let mask = (1usize << b) - 1;
                    let mut r = BitReader::new(bytes);
                    for o in out.iter_mut() {
                        *o = t[r.get(b) as usize & mask];
                    }
                }
            }
            if out.iter().fold(false, |acc, v| acc | v.is_nan()) {
                return Err(WireError::Invalid("non-canonical range-float zero code"));
            }
        } else {
            let mut r = BitReader::new(bytes);
            for o in out.iter_mut() {
                *o = self
                    .fmt
                    .value(self.emax, r.get(b))
                    .ok_or(WireError::Invalid("non-canonical range-float zero code"))?;
            }
        }
        Ok(())
    }
}

/// Configuration of [`RangeFloat`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RangeFloatConfig {
    /// Exponent bits `e`, 1..=8. Default 4.
    #[serde(default = "default_exp_bits")]
    pub exp_bits: u8,
    /// Mantissa bits `q`, 0..=23. Default 3 (so `b = 8`).
    #[serde(default = "default_mantissa_bits")]
    pub mantissa_bits: u8,
    /// `nearest` (default) or `stochastic`.
    #[serde(default)]
    pub rounding: Rounding,
}

pub(crate) fn default_exp_bits() -> u8 {
    4
}
pub(crate) fn default_mantissa_bits() -> u8 {
    3
}

impl Default for RangeFloatConfig {
    fn default() -> Self {
        RangeFloatConfig {
            exp_bits: default_exp_bits(),
            mantissa_bits: default_mantissa_bits(),
            rounding: Rounding::Nearest,
        }
    }
}

impl Method for RangeFloatConfig {
    const NAME: &'static str = "range-float";
    const ABOUT: &'static str =
        "range-based float: 1+e+q-bit codes under one per-tensor Emax (default 8 bits)";
    const ID: MethodId = MethodId(11);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()?))
    }

    fn default_memory(&self) -> MemoryConfig {
        match self.rounding {
            // Round-to-nearest is biased (and zeroes values below the window): residual;
            // stochastic rounding is unbiased inside the window: none.
            Rounding::Nearest => MemoryConfig::RESIDUAL,
            Rounding::Stochastic => MemoryConfig::None,
        }
    }
}

impl RangeFloatConfig {
    /// Checks the parameters and builds the compressor.
    pub fn init(&self) -> Result<RangeFloat, ConfigError> {
        Ok(RangeFloat {
            fmt: RfFormat::new(self.exp_bits, self.mantissa_bits)?,
            rounding: self.rounding,
        })
    }
}

/// Dense range-float quantizer: one `Emax` per segment, `b` bits per element.
#[derive(Debug, Clone)]
pub struct RangeFloat {
    fmt: RfFormat,
    rounding: Rounding,
}

impl RangeFloat {
    /// The code format.
    pub fn format(&self) -> RfFormat {
        self.fmt
    }
}

/// Codes per decode block: a multiple of 8, so every block starts on a byte boundary.
const BLOCK: usize = 4096;

impl Compressor for RangeFloat {
    fn method(&self) -> MethodId {
        RangeFloatConfig::ID
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Dense
    }
    fn unbiased(&self) -> bool {
        self.rounding == Rounding::Stochastic
    }
    fn encode_segment(&mut self, x: &[f32], rng: &mut Rng, w: &mut Writer<'_>) {
        let emax = emax_of(x);
        w.u8(emax as u8);
        let out = w.zeroed(bytes_for_bits(x.len() as u64 * self.fmt.bits() as u64));
        RfEncoder::new(self.fmt, emax).encode(x, self.rounding, rng, out);
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let emax = r.u8("range-float Emax")? as i8;
        let b = self.fmt.bits() as usize;
        let n = out.len();
        let bytes = r.take(bytes_for_bits(n as u64 * b as u64), "range-float codes")?;
        let dec = RfDecoder::new(self.fmt, emax, n);
        let mut tmp = [0f32; BLOCK];
        for (i, os) in out.chunks_mut(BLOCK).enumerate() {
            let start = i * BLOCK * b / 8;
            let len = bytes_for_bits((os.len() * b) as u64);
            let t = &mut tmp[..os.len()];
            dec.decode(&bytes[start..start + len], t)?;
            for (o, v) in os.iter_mut().zip(t.iter()) {
                *o += v;
            }
        }
        Ok(())
    }
    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(self.fmt.block_bits(n))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, payload_bits, Ctx};

    const FORMATS: [(u8, u8); 4] = [(3, 4), (4, 3), (2, 5), (5, 10)];

    /// Log-uniform magnitudes over `decades` binades below 2^top, random signs, some zeros.
    fn log_uniform(rng: &mut Rng, n: usize, top: i32, binades: f64) -> Vec<f32> {
        (0..n)
            .map(|i| {
                if i % 97 == 5 {
                    return 0.0;
                }
                let l = top as f64 - binades * rng.next_f64();
                let v = (2f64).powf(l) as f32;
                if rng.next_u64() & 1 == 1 {
                    -v
                } else {
                    v
                }
            })
            .collect()
    }

    fn quantize_block(fmt: RfFormat, x: &[f32]) -> (i8, Vec<f32>) {
        let emax = emax_of(x);
        let mut bytes = vec![0u8; bytes_for_bits(x.len() as u64 * fmt.bits() as u64)];
        RfEncoder::new(fmt, emax).encode(
            x,
            Rounding::Nearest,
            &mut Rng::seed_from_u64(0),
            &mut bytes,
        );
        let mut out = vec![0f32; x.len()];
        RfDecoder::new(fmt, emax, x.len())
            .decode(&bytes, &mut out)
            .unwrap();
        (emax, out)
    }

    #[test]
    fn error_bound_sign_and_zero_on_log_uniform_data() {
        let mut rng = Rng::seed_from_u64(11);
        for (e, q) in FORMATS {
            let fmt = RfFormat::new(e, q).unwrap();
            for (top, binades) in [
                (0, 40.0),
                (20, 10.0),
                (-30, 25.0),
                (-100, 30.0),
                (100, 60.0),
            ] {
                let x = log_uniform(&mut rng, 20_000, top, binades);
                let (emax, y) = quantize_block(fmt, &x);
                let emin = fmt.emin(emax);
                for (&v, &qv) in x.iter().zip(&y) {
                    let err = (v as f64 - qv as f64).abs();
                    let bound =
                        (2f64.powi(-(q as i32 + 1)) * (v as f64).abs()).max(2f64.powi(emin - 1));
                    assert!(
                        err <= bound,
                        "({e},{q}) v={v} Q={qv} err={err} bound={bound}"
                    );
                    if qv != 0.0 {
                        assert_eq!(qv.is_sign_negative(), v.is_sign_negative(), "sign of {v}");
                    }
                    if v == 0.0 {
                        assert_eq!(qv.to_bits(), 0);
                    }
                }
            }
        }
    }

    #[test]
    fn fast_path_matches_reference_encoder() {
        let mut rng = Rng::seed_from_u64(12);
        for (e, q) in FORMATS.into_iter().chain([(8, 23), (1, 0), (6, 1), (8, 2)]) {
            let fmt = RfFormat::new(e, q).unwrap();
            for emax in [-128i8, -120, -100, -3, 0, 5, 127] {
                let enc = RfEncoder::new(fmt, emax);
                for _ in 0..3000 {
                    let l = emax as f64 + 1.0 - 300.0 * rng.next_f64().powi(3);
                    let v =
                        (2f64.powf(l) as f32) * if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
                    assert_eq!(
                        enc.code_nearest(v),
                        enc.code_reference(v, None),
                        "({e},{q}) emax {emax} v {v:e}"
                    );
                    let r = rng.next_u64() as u32;
                    let u = r as f64 / 4_294_967_296.0;
                    // z has at most 23−q fractional bits, so floor(z + U) only depends on
                    // the top 23−q bits of U: fast and reference agree exactly.
                    assert_eq!(
                        enc.code_stochastic(v, r),
                        enc.code_reference(v, Some(u)),
                        "stochastic ({e},{q}) emax {emax} v {v:e} r {r:#x}"
                    );
                }
            }
        }
    }

    #[test]
    fn block_encoder_matches_reference_for_both_roundings() {
        let mut rng = Rng::seed_from_u64(19);
        for (e, q) in FORMATS.into_iter().chain([(8, 2), (1, 0), (7, 23)]) {
            let fmt = RfFormat::new(e, q).unwrap();
            for top in [0i32, -90, -120, 60] {
                let x = log_uniform(&mut rng, 1000, top, 70.0);
                let emax = emax_of(&x);
                let enc = RfEncoder::new(fmt, emax);
                let nbytes = bytes_for_bits(x.len() as u64 * fmt.bits() as u64);
                for rounding in [Rounding::Nearest, Rounding::Stochastic] {
                    let mut bytes = vec![0u8; nbytes];
                    enc.encode(&x, rounding, &mut Rng::seed_from_u64(5), &mut bytes);
                    // The same random stream: 128 draws per block of 256, low half first.
                    let mut rs = Rng::seed_from_u64(5);
                    let mut r = Vec::new();
                    for _ in 0..x.len().div_ceil(256) {
                        for _ in 0..128 {
                            let u = rs.next_u64();
                            r.push(u as u32);
                            r.push((u >> 32) as u32);
                        }
                    }
                    let mut br = BitReader::new(&bytes);
                    for (i, &v) in x.iter().enumerate() {
                        let u = match rounding {
                            Rounding::Nearest => None,
                            Rounding::Stochastic => Some(r[i] as f64 / 4_294_967_296.0),
                        };
                        assert_eq!(
                            br.get(fmt.bits()),
                            enc.code_reference(v, u),
                            "({e},{q}) top {top} {rounding:?} v {v:e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn monotone_idempotent_and_exact_values_round_trip() {
        let mut rng = Rng::seed_from_u64(13);
        for (e, q) in FORMATS {
            let fmt = RfFormat::new(e, q).unwrap();
            let mut x = log_uniform(&mut rng, 5000, 3, 30.0);
            x.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let (emax, y) = quantize_block(fmt, &x);
            for w in y.windows(2) {
                assert!(w[0] <= w[1], "not monotone: {} > {}", w[0], w[1]);
            }
            // Idempotent: same Emax, same values.
            let (emax2, y2) = quantize_block(fmt, &y);
            assert_eq!(emax, emax2);
            assert_eq!(y, y2);
            // Every representable value of this window round-trips exactly.
            let codes: Vec<u32> = (1..1u32 << fmt.bits())
                .step_by(((1usize << fmt.bits()) / 4096).max(1))
                .collect();
            let enc = RfEncoder::new(fmt, emax);
            for c in codes {
                if let Some(v) = fmt.value(emax, c) {
                    assert_eq!(enc.code_nearest(v), c, "code {c:#x} value {v}");
                    assert_eq!(fmt.value_f64(emax, c).unwrap(), v as f64);
                }
            }
        }
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        let fmt = RfFormat::new(4, 3).unwrap();
        let emax = 0i8;
        let emin = fmt.emin(emax);
        let enc = RfEncoder::new(fmt, emax);
        let mut rng = Rng::seed_from_u64(14);
        // Inside the window (several binades) and below it.
        let vals = [
            0.7131f32,
            -0.30017,
            0.0123,
            1.3,
            -1.77,
            2f32.powi(emin) * 0.37,
            -2f32.powi(emin) * 0.81,
        ];
        let t = 40_000;
        for &v in &vals {
            let mut s = 0f64;
            let mut s2 = 0f64;
            for _ in 0..t {
                let c = enc.code_stochastic(v, rng.next_u64() as u32);
                let d = fmt.value(emax, c).unwrap() as f64;
                s += d;
                s2 += d * d;
            }
            let mean = s / t as f64;
            let var = (s2 / t as f64 - mean * mean).max(0.0);
            let se = (var / t as f64).sqrt().max(1e-12);
            assert!(
                (mean - v as f64).abs() <= 5.0 * se,
                "v {v} mean {mean} se {se}"
            );
            // And it is really random (not collapsing to one neighbour).
            assert!(var > 0.0, "v {v}");
        }
    }

    #[test]
    fn dense_compressor_size_and_round_trip() {
        let mut rng = Rng::seed_from_u64(15);
        for (e, q) in FORMATS {
            for rounding in [Rounding::Nearest, Rounding::Stochastic] {
                let cfg = RangeFloatConfig {
                    exp_bits: e,
                    mantissa_bits: q,
                    rounding,
                };
                let mut c = cfg.init().unwrap();
                for n in [1usize, 2, 3, 7, 8, 4095, 4097, 10_001] {
                    let x = log_uniform(&mut rng, n, 2, 12.0);
                    let p = compress_new(&mut c, &x, &Ctx::default(), &mut rng).unwrap();
                    let bits = payload_bits(&c, &[n]).unwrap();
                    assert_eq!(p.encoded_len() as u64 * 8, bits);
                    assert_eq!(c.segment_bits(n), Some(8 + n as u64 * (1 + e + q) as u64));
                    let mut out = vec![0f32; n];
                    decompress(&c, p.as_bytes(), &mut out).unwrap();
                    let emax = emax_of(&x);
                    let emin = fmt_emin(e, q, emax);
                    for (&v, &d) in x.iter().zip(&out) {
                        let step = (v.abs() as f64 * 2f64.powi(-(q as i32))).max(2f64.powi(emin));
                        assert!((v as f64 - d as f64).abs() <= step, "{v} {d}");
                    }
                }
            }
        }
    }

    /// Feeds random bytes, every single-byte mutation of sampled positions, and every
    /// truncation of `valid` to the decoder: it must return (Ok or Err), never panic, and
    /// any Ok output must be finite.
    pub(crate) fn fuzz_decoder(c: &dyn Compressor, valid: &[u8], n: usize, seed: u64) {
        use crate::compressor::decompress;
        let mut rng = Rng::seed_from_u64(seed);
        let mut out = vec![0f32; n];
        let check = |bytes: &[u8], out: &mut Vec<f32>| {
            if decompress(c, bytes, out).is_ok() {
                assert!(
                    out.iter().all(|v| v.is_finite()),
                    "Ok with non-finite output"
                );
            }
        };
        for _ in 0..200 {
            let len = rng.below(valid.len() as u64 + 40) as usize;
            let mut b: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            check(&b, &mut out);
            // Keep a valid header so the body decoder is reached.
            let h = valid.len().min(12).min(b.len());
            b[..h].copy_from_slice(&valid[..h]);
            check(&b, &mut out);
        }
        for cut in 0..valid.len() {
            check(&valid[..cut], &mut out);
        }
        for _ in 0..600 {
            let mut b = valid.to_vec();
            let i = rng.below(b.len() as u64) as usize;
            b[i] ^= 1 << rng.below(8);
            if rng.below(4) == 0 {
                let j = rng.below(b.len() as u64) as usize;
                b[j] = rng.next_u64() as u8;
            }
            check(&b, &mut out);
        }
        let mut longer = valid.to_vec();
        longer.push(0);
        assert!(decompress(c, &longer, &mut out).is_err());
    }

    #[test]
    fn random_and_mutated_payloads_never_panic() {
        let mut rng = Rng::seed_from_u64(16);
        for (e, q) in FORMATS {
            let mut c = RangeFloatConfig {
                exp_bits: e,
                mantissa_bits: q,
                rounding: Rounding::Nearest,
            }
            .init()
            .unwrap();
            let x = log_uniform(&mut rng, 300, 0, 20.0);
            let p = compress_new(&mut c, &x, &Ctx::default(), &mut rng).unwrap();
            fuzz_decoder(&c, p.as_bytes(), x.len(), 17);
            let segs = [0..100, 100..101, 101..300];
            let ctx = Ctx {
                segments: &segs,
                ..Ctx::default()
            };
            let p = compress_new(&mut c, &x, &ctx, &mut rng).unwrap();
            fuzz_decoder(&c, p.as_bytes(), x.len(), 18);
        }
    }

    fn fmt_emin(e: u8, q: u8, emax: i8) -> i32 {
        RfFormat::new(e, q).unwrap().emin(emax)
    }

    #[test]
    fn edge_values_do_not_break() {
        let fmt = RfFormat::new(4, 3).unwrap();
        let x = [f32::MAX, -f32::MAX, f32::MIN_POSITIVE, 1e-45, 0.0, -0.0];
        let (emax, y) = quantize_block(fmt, &x);
        assert_eq!(emax, 127);
        assert!(y.iter().all(|v| v.is_finite()));
        assert_eq!(y[4].to_bits(), 0);
        assert_eq!(y[5].to_bits(), 0);
        let tiny = [1e-45f32, -3e-45, 0.0];
        let (emax, y) = quantize_block(RfFormat::new(8, 23).unwrap(), &tiny);
        assert_eq!(emax, -128);
        assert_eq!(y, tiny);
        assert!(RfFormat::new(0, 3).is_err());
        assert!(RfFormat::new(9, 3).is_err());
        assert!(RfFormat::new(4, 24).is_err());
    }

    #[test]
    fn malformed_codes_are_rejected() {
        let fmt = RfFormat::new(4, 3).unwrap();
        let dec = RfDecoder::new(fmt, 0, 1000);
        let mut out = [0f32; 2];
        assert!(dec.decode(&[0x80, 0], &mut out).is_err()); // "-0"
        assert!(dec.decode(&[0x01, 0], &mut out).is_err()); // f ≠ 0 with exp 0
        assert!(dec.decode(&[0x10, 0x90], &mut out).is_ok());
        assert!(dec.decode(&[0x10], &mut out).is_err());
        let fmt = RfFormat::new(3, 1).unwrap(); // 5-bit codes
        let dec = RfDecoder::new(fmt, 0, 1);
        let mut out = [0f32; 1];
        assert!(dec.decode(&[0x02], &mut out).is_ok());
        assert!(dec.decode(&[0x22], &mut out).is_err()); // padding bit set
    }

    /// The documented [`NearestNormal`] rule gives [`RfEncoder::code_nearest`]'s codes
    /// (what the device encoders compute from it), and is offered exactly where the window
    /// lies in the normal range.
    #[test]
    fn the_nearest_normal_rule_is_the_encoders() {
        let mut rng = Rng::seed_from_u64(11);
        for (e, q) in [(4u8, 3u8), (8, 7), (1, 0), (3, 23), (2, 1)] {
            let f = RfFormat::new(e, q).unwrap();
            for emax in [-128i8, -120, -112, -100, -20, 0, 5, 127] {
                let enc = RfEncoder::new(f, emax);
                let Some(c) = enc.nearest_normal() else {
                    assert!(f.emin(emax) < -126, "({e},{q}) emax {emax}");
                    continue;
                };
                assert!(f.emin(emax) >= -126);
                for _ in 0..2000 {
                    // Magnitudes from far below the window to above it.
                    let a = (rng.next_f32() * 2.0)
                        * pow2(emax as i32 - rng.below(40) as i32 + 1) as f32;
                    let v = if rng.next_u64() & 1 == 1 { -a } else { a };
                    let abits = v.to_bits() & 0x7FFF_FFFF;
                    let mag = if abits >= c.fast_lo {
                        ((abits + c.half) >> c.shift)
                            .wrapping_sub(c.base)
                            .min(c.top)
                    } else if abits >= c.half_lo {
                        c.one
                    } else {
                        0
                    };
                    let code = mag | (((v.to_bits() >> 31) & (mag != 0) as u32) << c.sign_shift);
                    assert_eq!(code, enc.code_nearest(v), "({e},{q}) emax {emax} v {v}");
                }
            }
        }
    }
}
