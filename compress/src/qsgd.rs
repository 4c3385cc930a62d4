//! `qsgd`: stochastic multi-level quantization of Alistarh et al. (ALGORITHMS.md §4).
//!
//! Each segment is cut into buckets of `d` elements (the last one may be shorter). For a
//! bucket `v` with norm `N` (max-norm or 2-norm, accumulated in `f64`, sent as `f32`):
//! ```text
//! r_j = s·|v_j| / N,  l_j = ⌊r_j⌋,  τ_j = r_j − l_j
//! level_j = l_j + 1 with probability τ_j, else l_j          (level ∈ 0..=s)
//! Q(v)_j  = sign(v_j) · N · level_j / s
//! ```
//! The rounding draws come from the [`Rng`] passed to the encoder (two 24-bit uniforms per
//! 64-bit draw), so the same seed gives the same bytes. `E[Q(v)] = v` (unbiased) and
//! `E‖Q(v) − v‖² = (N/s)²·Σ τ_j(1−τ_j)`.
//!
//! **Counter draws** (`draws = "counter"`, the mode a device codec computes identically):
//! element `j` of a segment draws the top 24 bits of
//! [`counter_bits`]`(key, j)`, the key one draw of the encoder's Rng
//! per segment; every bucket takes the `f32` rule below (so `levels < 2²³`), a bucket whose
//! `s/N` overflows `f32` (a norm below about `s·2⁻¹²⁸`) with `v` and `N` first multiplied by
//! `2⁶⁴` — exact, and the levels are a function of `v/N` — where the default draws evaluate
//! the rule in `f64`. The wire format is the same.
//!
//! ## Body, per segment of `n` elements, `m = ⌈n/d⌉` buckets
//! ```text
//! coding = "fixed":
//!   m × f32 bucket norm N
//!   n codes of w = 1 + ⌈log2(s+1)⌉ bits, packed LSB-first over the whole segment;
//!   code = level << 1 | sign (sign = 1 for negative; always 0 when level = 0);
//!   the last byte is zero-padded.                     bits: 32·m + n·w
//! coding = "elias":
//!   m × f32 bucket norm N
//!   u32 K (non-zero levels), u32 L (stream bytes), L bytes of bit stream holding, for each
//!   non-zero in index order: γ(gap), sign bit, γ(level), where γ is Elias-gamma and
//!   gap = index − previous index (the first gap is index + 1); zero-padded.
//!                                                     bits: data-dependent
//! ```
//! Arithmetic: `r` is formed in `f32` as `|v|·(s/N)` (an element equal to `N` gets exactly
//! `r = s`), so the rounding is unbiased up to `f32` resolution (about `N·2⁻²⁴` per element);
//! buckets with a subnormal norm, or `s ≥ 2²³`, use the same rule in `f64`. A 2-norm too
//! large for `f32` is sent as `f32::MAX` (still ≥ every |v_j|, so still unbiased).
//!
//! A zero-norm bucket carries only zero levels. With s = 7, d = 512 (the defaults) the fixed
//! code costs 4 + 32/512 = 4.0625 bits per element. Aggregation: all-gather (each worker has
//! its own norms).

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::{ConfigError, WireError};
use crate::put::{dense_by_passes, put, put_mode, put_nothing, with_put_mode, Put};
use crate::registry::Method;
use crate::rng::{counter_bits, Draws, Rng};
use crate::simd::vector_dispatch;
use crate::wire::{
    bytes_for_bits, elias_gamma_len, elias_gamma_put, f32_at, BitReader, BitWriter, GammaReader,
    Reader, Writer,
};

/// Largest accepted number of levels `s` (levels are computed in `f32`, exact up to 2²⁴).
pub const MAX_LEVELS: u32 = 1 << 24;

/// Which norm scales a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QsgdNorm {
    /// `N = max_j |v_j|` (the practical variant; per-coordinate variance ≤ N²/(4s²)).
    #[default]
    Max,
    /// `N = ‖v‖₂` (the paper's theory; variance ≤ min(d/s², √d/s)·‖v‖²).
    L2,
}

/// How the signs and levels are coded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QsgdCoding {
    /// Fixed width `1 + ⌈log2(s+1)⌉` bits per element; size depends only on `n`.
    #[default]
    Fixed,
    /// Elias-gamma coded gaps and levels of the non-zeros only; data-dependent size.
    Elias,
}

/// Configuration of [`Qsgd`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QsgdConfig {
    /// Number of levels `s` in `1..=2²⁴`. Default 7 (4 bits per element with the sign).
    #[serde(default = "default_levels")]
    pub levels: u32,
    /// Bucket length `d` (elements sharing one norm), ≥ 1. Default 512.
    #[serde(default = "default_bucket")]
    pub bucket: usize,
    /// Bucket norm, `"max"` (default) or `"l2"`.
    #[serde(default)]
    pub norm: QsgdNorm,
    /// Coding, `"fixed"` (default) or `"elias"`.
    #[serde(default)]
    pub coding: QsgdCoding,
    /// Where the rounding draws come from: `lanes` (default: two per 64-bit draw of the
    /// encoder's Rng, in order) or `counter` (see the module docs; needs `levels < 2²³`).
    #[serde(default, skip_serializing_if = "Draws::is_lanes")]
    pub draws: Draws,
}

fn default_levels() -> u32 {
    7
}
fn default_bucket() -> usize {
    512
}

impl Default for QsgdConfig {
    fn default() -> Self {
        QsgdConfig {
            levels: default_levels(),
            bucket: default_bucket(),
            norm: QsgdNorm::default(),
            coding: QsgdCoding::default(),
            draws: Draws::Lanes,
        }
    }
}

/// Code width in bits for `s` levels: one sign bit plus `⌈log2(s+1)⌉`.
pub fn code_width(s: u32) -> u32 {
    1 + (32 - s.leading_zeros())
}

/// Widths up to this use a per-bucket lookup table in the decoder.
const TABLE_MAX_WIDTH: u32 = 9;

impl Method for QsgdConfig {
    const NAME: &'static str = "qsgd";
    const ABOUT: &'static str =
        "QSGD unbiased stochastic quantization, s levels per bucket norm (fixed or Elias)";
    const ID: MethodId = MethodId(8);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()?))
    }
}

impl QsgdConfig {
    /// Checks the parameters and builds the compressor.
    pub fn init(&self) -> Result<Qsgd, ConfigError> {
        if !(1..=MAX_LEVELS).contains(&self.levels) {
            return Err(ConfigError::new(
                "levels",
                format!("must be in 1..={MAX_LEVELS}, got {}", self.levels),
            ));
        }
        if self.draws == Draws::Counter && self.levels >= 1 << 23 {
            return Err(ConfigError::new(
                "levels",
                format!(
                    "must be below 2^23 with draws = \"counter\" (its rule is f32's), got {}",
                    self.levels
                ),
            ));
        }
        if self.bucket == 0 || self.bucket > u32::MAX as usize {
            return Err(ConfigError::new(
                "bucket",
                format!("must be in 1..=2^32-1, got {}", self.bucket),
            ));
        }
        let width = code_width(self.levels);
        let valid_codes = if width <= TABLE_MAX_WIDTH {
            (0..1u32 << width)
                .map(|c| code_is_valid(c, self.levels))
                .collect()
        } else {
            Vec::new()
        };
        let mut bad_byte = [false; 256];
        if matches!(width, 2 | 4 | 8) {
            let mask = (1u32 << width) - 1;
            for (byte, bad) in bad_byte.iter_mut().enumerate() {
                *bad = (0..8 / width)
                    .any(|j| !code_is_valid((byte as u32 >> (j * width)) & mask, self.levels));
            }
        }
        Ok(Qsgd {
            bad_byte,
            s: self.levels,
            d: self.bucket,
            norm: self.norm,
            coding: self.coding,
            draws: self.draws,
            width,
            valid_codes,
            codes: Vec::new(),
            codes8: Vec::new(),
            norms: Vec::new(),
        })
    }
}

#[inline(always)]
fn code_is_valid(code: u32, s: u32) -> bool {
    let level = code >> 1;
    level <= s && !(level == 0 && code & 1 == 1)
}

/// QSGD quantizer.
#[derive(Debug, Clone)]
pub struct Qsgd {
    s: u32,
    d: usize,
    norm: QsgdNorm,
    coding: QsgdCoding,
    draws: Draws,
    width: u32,
    /// `valid_codes[c]` for every `c < 2^width` (only when `width <= TABLE_MAX_WIDTH`).
    valid_codes: Vec<bool>,
    /// For widths 2, 4 and 8: whether a byte holds an invalid code.
    bad_byte: [bool; 256],
    /// Elias scratch: one code per element of the segment.
    codes: Vec<u32>,
    /// Fixed-width scratch: one byte code per element (when `width <= 8`).
    codes8: Vec<u8>,
    /// Elias scratch: the segment's bucket norms.
    norms: Vec<f32>,
}

vector_dispatch! {
    /// `max |x|` ([`max_norm_lanes`]) with the widest vectors the CPU has.
    fn max_norm(x: &[f32]) -> f32 = max_norm_lanes;
}

vector_dispatch! {
    /// The 2-norm ([`l2_norm_lanes`]) with the widest vectors the CPU has: the same eight
    /// `f64` partial sums in the same order on every tier.
    fn l2_norm(x: &[f32]) -> f32 = l2_norm_lanes;
}

/// `f32` max-norm of `x` (exact).
#[inline(always)]
fn max_norm_lanes(x: &[f32]) -> f32 {
    let mut m = [0f32; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for k in 0..8 {
            let a = c[k].abs();
            m[k] = if a > m[k] { a } else { m[k] };
        }
    }
    let mut r = it.remainder().iter().fold(0f32, |m, v| m.max(v.abs()));
    for v in m {
        r = r.max(v);
    }
    r
}

/// 2-norm of `x` accumulated in `f64`, rounded to `f32` (saturating at `f32::MAX`).
#[inline(always)]
fn l2_norm_lanes(x: &[f32]) -> f32 {
    let mut acc = [0f64; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for k in 0..8 {
            let v = c[k] as f64;
            acc[k] += v * v;
        }
    }
    let mut s: f64 = it
        .remainder()
        .iter()
        .map(|&v| (v as f64) * (v as f64))
        .sum();
    s += acc.iter().sum::<f64>();
    let n = s.sqrt() as f32;
    if n.is_finite() {
        n
    } else {
        f32::MAX
    }
}

/// The decoded magnitude of `level` in a bucket of norm `nrm`: `N·level/s` (computed in
/// `f64`, so both codings and every decoder path agree bit for bit).
#[inline(always)]
fn level_value(nrm: f32, level: u32, s: u32) -> f32 {
    (nrm as f64 * level as f64 / s as f64) as f32
}

const U24: f32 = 1.0 / (1u32 << 24) as f32;

/// `2²³`: adding it to an `f32` in `[0, 2²³)` leaves the rounded integer in the mantissa.
const MAGIC: f32 = 8_388_608.0;

/// Whether the `f32` fast path applies to a bucket: `s/N` is finite and `r ≤ s < 2²³`.
#[inline(always)]
fn fast_ok(scale: f32, s: u32) -> bool {
    scale.is_finite() && s < (1 << 23)
}

/// The code of one element: the rounding rule in `f32` arithmetic (requires
/// [`fast_ok`]). `⌊r⌋` is taken with the 2²³ trick instead of a float→int conversion, so
/// the block loop in [`quantize_bucket_u8`] vectorises; every coding goes through this one
/// function, so all of them produce identical levels.
#[inline(always)]
fn fast_code(v: f32, bits: u32, nrm: f32, scale: f32, sf: f32, s: i32) -> u32 {
    let a = v.abs();
    let r = if a >= nrm { sf } else { a * scale };
    // Round to nearest, then step down if that went up: ⌊r⌋ exactly, for 0 ≤ r < 2²³.
    let m = r + MAGIC;
    let t = m - MAGIC;
    let down = (t > r) as i32;
    let l = (m.to_bits() & 0x7F_FFFF) as i32 - down;
    let tau = r - (t - down as f32);
    let u = ((bits >> 8) as i32) as f32 * U24;
    let level = (l + (u < tau) as i32).min(s);
    let sign = (v.to_bits() >> 31) & (level != 0) as u32;
    ((level as u32) << 1) | sign
}

/// The code of one element when [`fast_ok`] fails (`s/N` overflows `f32` for a subnormal
/// norm, or `s ≥ 2²³`): the same rule evaluated in `f64`.
#[inline(always)]
fn slow_code(v: f32, bits: u32, nrm: f32, s: u32) -> u32 {
    let (sd, nd) = (s as f64, nrm as f64);
    let r = (v.abs() as f64 * sd / nd).min(sd);
    let l = r.floor();
    let tau = r - l;
    let up = ((((bits >> 8) as i32) as f32 * U24) as f64) < tau;
    let level = (l as u32 + up as u32).min(s);
    let sign = (v.to_bits() >> 31) & (level != 0) as u32;
    (level << 1) | sign
}

/// Stochastically rounds one bucket, calling `emit(code)` for each element in order.
///
/// Randomness: one 64-bit draw per pair of elements (low half first); an odd last element
/// takes the low half of a fresh draw. Zero-norm buckets draw nothing.
#[inline(always)]
fn quantize_bucket(x: &[f32], nrm: f32, s: u32, rng: &mut Rng, mut emit: impl FnMut(u32)) {
    if nrm == 0.0 {
        for _ in x {
            emit(0);
        }
        return;
    }
    let sf = s as f32;
    let scale = sf / nrm;
    let fast = fast_ok(scale, s);
    let code = |v: f32, bits: u32| {
        if fast {
            fast_code(v, bits, nrm, scale, sf, s as i32)
        } else {
            slow_code(v, bits, nrm, s)
        }
    };
    let mut it = x.chunks_exact(2);
    for p in &mut it {
        let u = rng.next_u64();
        emit(code(p[0], u as u32));
        emit(code(p[1], (u >> 32) as u32));
    }
    if let [v] = it.remainder() {
        let u = rng.next_u64();
        emit(code(*v, u as u32));
    }
}

/// `2⁶⁴`, the exact factor a counter-mode bucket whose `s/N` overflows is scaled by.
const PRESCALE: f32 = 18_446_744_073_709_551_616.0;

/// A bucket's arithmetic in counter mode: `(factor, N', s/N')` — the bucket's values are
/// multiplied by `factor` (1, or 2⁶⁴ where `s/N` overflows `f32`) and then rounded
/// by the `f32` rule under the norm `N' = N·factor`. What a device codec computes per bucket
/// (on the host, from the norms it reads back).
pub fn counter_bucket_scale(nrm: f32, s: u32) -> (f32, f32, f32) {
    let sf = s as f32;
    let scale = sf / nrm;
    if scale.is_finite() {
        (1.0, nrm, scale)
    } else {
        let n2 = nrm * PRESCALE;
        (PRESCALE, n2, sf / n2)
    }
}

/// [`quantize_bucket`] with counter draws: element `k` of the bucket is element `j0 + k` of
/// its segment and draws `counter_bits(key, j0 + k)`; `s < 2²³`.
#[inline(always)]
fn quantize_bucket_counter(
    x: &[f32],
    nrm: f32,
    s: u32,
    key: u64,
    j0: usize,
    mut emit: impl FnMut(u32),
) {
    if nrm == 0.0 {
        for _ in x {
            emit(0);
        }
        return;
    }
    let (factor, n2, scale) = counter_bucket_scale(nrm, s);
    for (k, &v) in x.iter().enumerate() {
        let bits = counter_bits(key, (j0 + k) as u32);
        emit(fast_code(v * factor, bits, n2, scale, s as f32, s as i32));
    }
}

/// Elements per block of random draws in [`quantize_bucket_u8`] (even, so pairs line up).
const BLOCK: usize = 256;

/// [`quantize_bucket`] for codes that fit a byte, written into `codes` (`x.len()` long):
/// the draws of a block are made first, then one vectorisable loop computes the codes.
/// Consumes the generator exactly as [`quantize_bucket`] does and yields the same codes.
fn quantize_bucket_u8(x: &[f32], nrm: f32, s: u32, rng: &mut Rng, codes: &mut [u8]) {
    if nrm == 0.0 {
        codes.fill(0);
        return;
    }
    let sf = s as f32;
    let scale = sf / nrm;
    if !fast_ok(scale, s) {
        let mut at = 0;
        quantize_bucket(x, nrm, s, rng, |c| {
            codes[at] = c as u8;
            at += 1;
        });
        return;
    }
    let mut rnd = [0u32; BLOCK];
    for (xb, cb) in x.chunks(BLOCK).zip(codes.chunks_mut(BLOCK)) {
        let m = xb.len();
        for pair in rnd[..m.div_ceil(2) * 2].chunks_exact_mut(2) {
            let u = rng.next_u64();
            pair[0] = u as u32;
            pair[1] = (u >> 32) as u32;
        }
        block_codes(xb, &rnd[..m], cb, nrm, scale, sf, s as i32);
    }
}

vector_dispatch! {
    /// The codes of a block from its draws ([`fast_code`] of each element), with the widest
    /// vectors the CPU has (the same bits on every tier, tested).
    fn block_codes(xb: &[f32], rnd: &[u32], cb: &mut [u8], nrm: f32, scale: f32, sf: f32, s: i32) =
        block_codes_lanes;
}

#[inline(always)]
fn block_codes_lanes(
    xb: &[f32],
    rnd: &[u32],
    cb: &mut [u8],
    nrm: f32,
    scale: f32,
    sf: f32,
    s: i32,
) {
    for ((c, &v), &b) in cb.iter_mut().zip(xb).zip(rnd) {
        *c = fast_code(v, b, nrm, scale, sf, s) as u8;
    }
}

/// Packs byte codes of `width` bits LSB-first into the zeroed `out`.
fn pack_codes(codes: &[u8], width: u32, out: &mut [u8]) {
    match width {
        8 => out.copy_from_slice(codes),
        4 => {
            let mut it = codes.chunks_exact(2);
            for (o, c) in out.iter_mut().zip(&mut it) {
                *o = c[0] | (c[1] << 4);
            }
            if let [c] = it.remainder() {
                out[codes.len() / 2] = *c;
            }
        }
        2 => {
            let mut it = codes.chunks_exact(4);
            for (o, c) in out.iter_mut().zip(&mut it) {
                *o = c[0] | (c[1] << 2) | (c[2] << 4) | (c[3] << 6);
            }
            let mut last = 0u8;
            for (k, &c) in it.remainder().iter().enumerate() {
                last |= c << (2 * k);
            }
            if !it.remainder().is_empty() {
                out[codes.len() / 4] = last;
            }
        }
        _ => {
            let mut bw = BitWriter::new(out);
            for &c in codes {
                bw.put(c as u32, width);
            }
            bw.finish();
        }
    }
}

fn check_norm(nrm: f32) -> Result<(), WireError> {
    if nrm.is_finite() && nrm.is_sign_positive() {
        Ok(())
    } else {
        Err(WireError::Invalid(
            "qsgd bucket norm is negative or not finite",
        ))
    }
}

impl Qsgd {
    fn bucket_norm(&self, x: &[f32]) -> f32 {
        match self.norm {
            QsgdNorm::Max => max_norm(x),
            QsgdNorm::L2 => l2_norm(x),
        }
    }

    fn encode_fixed(&mut self, x: &[f32], rng: &mut Rng, w: &mut Writer<'_>) {
        let n = x.len();
        let nb = n.div_ceil(self.d);
        let width = self.width;
        let body = w.zeroed(4 * nb + bytes_for_bits(n as u64 * width as u64));
        let (norm_bytes, code_bytes) = body.split_at_mut(4 * nb);
        if self.draws == Draws::Counter {
            let key = rng.next_u64();
            let mut bw = BitWriter::new(code_bytes);
            for (b, chunk) in x.chunks(self.d).enumerate() {
                let nrm = self.bucket_norm(chunk);
                norm_bytes[4 * b..4 * b + 4].copy_from_slice(&nrm.to_le_bytes());
                quantize_bucket_counter(chunk, nrm, self.s, key, b * self.d, |c| bw.put(c, width));
            }
            bw.finish();
        } else if width <= 8 {
            let mut codes = std::mem::take(&mut self.codes8);
            codes.resize(n, 0);
            for (b, (chunk, cb)) in x.chunks(self.d).zip(codes.chunks_mut(self.d)).enumerate() {
                let nrm = self.bucket_norm(chunk);
                norm_bytes[4 * b..4 * b + 4].copy_from_slice(&nrm.to_le_bytes());
                quantize_bucket_u8(chunk, nrm, self.s, rng, cb);
            }
            pack_codes(&codes, width, code_bytes);
            self.codes8 = codes;
        } else {
            let mut bw = BitWriter::new(code_bytes);
            for (b, chunk) in x.chunks(self.d).enumerate() {
                let nrm = self.bucket_norm(chunk);
                norm_bytes[4 * b..4 * b + 4].copy_from_slice(&nrm.to_le_bytes());
                quantize_bucket(chunk, nrm, self.s, rng, |c| bw.put(c, width));
            }
            bw.finish();
        }
    }

    fn encode_elias(&mut self, x: &[f32], rng: &mut Rng, w: &mut Writer<'_>) {
        let n = x.len();
        let mut codes = std::mem::take(&mut self.codes);
        let mut norms = std::mem::take(&mut self.norms);
        codes.clear();
        norms.clear();
        let key = (self.draws == Draws::Counter).then(|| rng.next_u64());
        for (b, chunk) in x.chunks(self.d).enumerate() {
            let nrm = self.bucket_norm(chunk);
            norms.push(nrm);
            match key {
                Some(key) => {
                    quantize_bucket_counter(chunk, nrm, self.s, key, b * self.d, |c| codes.push(c))
                }
                None => quantize_bucket(chunk, nrm, self.s, rng, |c| codes.push(c)),
            }
        }
        debug_assert_eq!(codes.len(), n);
        let mut k = 0u32;
        let mut bits = 0u64;
        let mut prev = 0usize; // one past the previous non-zero
        for (i, &c) in codes.iter().enumerate() {
            if c >> 1 != 0 {
                k += 1;
                bits += elias_gamma_len((i + 1 - prev) as u32) + 1 + elias_gamma_len(c >> 1);
                prev = i + 1;
            }
        }
        let len = bytes_for_bits(bits);
        w.reserve(4 * norms.len() + 8 + len);
        w.f32_slice(&norms);
        w.u32(k);
        w.u32(u32::try_from(len).expect("a qsgd Elias stream is under 4 GiB"));
        let mut bw = BitWriter::new(w.zeroed(len));
        let mut prev = 0usize;
        for (i, &c) in codes.iter().enumerate() {
            if c >> 1 != 0 {
                elias_gamma_put(&mut bw, (i + 1 - prev) as u32);
                bw.put(c & 1, 1);
                elias_gamma_put(&mut bw, c >> 1);
                prev = i + 1;
            }
        }
        bw.finish();
        self.codes = codes;
        self.norms = norms;
    }

    /// The fixed-width decoder, putting each value into `out` as the mode `M` says, with
    /// factor `k` ([`put`]); whether a scaled value is non-finite.
    fn decode_fixed<const M: u8>(
        &self,
        r: &mut Reader<'_>,
        out: &mut [f32],
        k: f32,
    ) -> Result<bool, WireError> {
        let n = out.len();
        let nb = n.div_ceil(self.d);
        let width = self.width;
        let norms = r.take_items(nb, 4, "qsgd norms")?;
        let nbits = n as u64 * width as u64;
        let codes = r.take(bytes_for_bits(nbits), "qsgd codes")?;
        if !nbits.is_multiple_of(8) && codes[codes.len() - 1] >> (nbits % 8) != 0 {
            return Err(WireError::Invalid("qsgd padding bits are not zero"));
        }
        if (self.d as u64 * width as u64).is_multiple_of(8) {
            match width {
                2 => return self.decode_bytes::<2, M>(norms, codes, out, k),
                4 => return self.decode_bytes::<4, M>(norms, codes, out, k),
                8 => return self.decode_bytes::<8, M>(norms, codes, out, k),
                _ => {}
            }
        }
        let mut br = BitReader::new(codes);
        let s = self.s;
        let mut table = [0f32; 1 << TABLE_MAX_WIDTH];
        let mut non_finite = false;
        for (b, o) in out.chunks_mut(self.d).enumerate() {
            let nrm = f32_at(norms, b);
            check_norm(nrm)?;
            let mut bad = false;
            if nrm == 0.0 {
                for o in o.iter_mut() {
                    bad |= br.get(width) != 0;
                    non_finite |= put_nothing::<M>(o, k);
                }
            } else if width <= TABLE_MAX_WIDTH {
                let valid = &self.valid_codes[..1 << width];
                let table = &mut table[..1 << width];
                for (c, t) in table.iter_mut().enumerate() {
                    let level = (c as u32 >> 1).min(s);
                    let v = level_value(nrm, level, s);
                    *t = if c & 1 == 1 { -v } else { v };
                }
                for o in o.iter_mut() {
                    let c = br.get(width) as usize;
                    bad |= !valid[c];
                    non_finite |= put::<M>(o, table[c], k);
                }
            } else {
                for o in o.iter_mut() {
                    let c = br.get(width);
                    let level = c >> 1;
                    bad |= !code_is_valid(c, s);
                    let v = level_value(nrm, level.min(s), s);
                    non_finite |= put::<M>(o, if c & 1 == 1 { -v } else { v }, k);
                }
            }
            if bad {
                return Err(WireError::Invalid(
                    "qsgd code out of range (level > s, signed zero, or non-zero in a zero bucket)",
                ));
            }
        }
        Ok(non_finite)
    }

    /// The fixed-width decoder for widths dividing 8 when every bucket starts on a byte:
    /// whole bytes at a time, one value table per bucket, one validity table per byte.
    fn decode_bytes<const W: u32, const M: u8>(
        &self,
        norms: &[u8],
        codes: &[u8],
        out: &mut [f32],
        k: f32,
    ) -> Result<bool, WireError> {
        let per = (8 / W) as usize;
        let mask = ((1u32 << W) - 1) as u8;
        let bucket_bytes = self.d / per;
        let mut table = [0f32; 256];
        let mut non_finite = false;
        for (b, o) in out.chunks_mut(self.d).enumerate() {
            let nrm = f32_at(norms, b);
            check_norm(nrm)?;
            let start = b * bucket_bytes;
            let cb = &codes[start..start + o.len().div_ceil(per)];
            if nrm == 0.0 {
                if cb.iter().any(|&c| c != 0) {
                    return Err(WireError::Invalid("qsgd non-zero in a zero-norm bucket"));
                }
                for o in o.iter_mut() {
                    non_finite |= put_nothing::<M>(o, k);
                }
                continue;
            }
            for (c, t) in table[..1 << W].iter_mut().enumerate() {
                let level = (c as u32 >> 1).min(self.s);
                let v = level_value(nrm, level, self.s);
                *t = if c & 1 == 1 { -v } else { v };
            }
            let mut bad = false;
            // 4-bit codes: whole groups of 16 with vector table lookups where the CPU has
            // them (`nibbles`), the rest below.
            let done = if W == 4 {
                nibbles::put::<M>(cb, &table, &self.bad_byte, o, k, &mut bad, &mut non_finite)
            } else {
                0
            };
            let (o, cb) = (&mut o[done..], &cb[done / per..]);
            let mut it = o.chunks_exact_mut(per);
            for (oc, &byte) in (&mut it).zip(cb) {
                bad |= self.bad_byte[byte as usize];
                for (j, o) in oc.iter_mut().enumerate() {
                    non_finite |= put::<M>(o, table[((byte >> (j as u32 * W)) & mask) as usize], k);
                }
            }
            let rest = it.into_remainder();
            if !rest.is_empty() {
                let byte = cb[cb.len() - 1];
                bad |= self.bad_byte[byte as usize];
                for (j, o) in rest.iter_mut().enumerate() {
                    non_finite |= put::<M>(o, table[((byte >> (j as u32 * W)) & mask) as usize], k);
                }
            }
            if bad {
                return Err(WireError::Invalid(
                    "qsgd code out of range (level > s or signed zero)",
                ));
            }
        }
        Ok(non_finite)
    }

    fn decode_elias(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let n = out.len();
        let nb = n.div_ceil(self.d);
        let norms = r.take_items(nb, 4, "qsgd norms")?;
        for b in 0..nb {
            check_norm(f32_at(norms, b))?;
        }
        let k = r.u32("qsgd non-zero count")? as usize;
        let len = r.u32("qsgd stream length")? as usize;
        let stream = r.take(len, "qsgd stream")?;
        if k > n {
            return Err(WireError::Invalid("more qsgd non-zeros than elements"));
        }
        let avail = 8 * len as u64;
        // Each entry takes at least 3 bits; this also bounds the loop by the stream length.
        if 3 * k as u64 > avail {
            return Err(WireError::Invalid("qsgd stream too short for its count"));
        }
        let mut br = GammaReader::new(stream);
        let mut next = 0usize;
        for _ in 0..k {
            let gap = br.get().ok_or(WireError::Invalid("bad qsgd gap code"))?;
            let idx = next + gap as usize - 1;
            if idx >= n {
                return Err(WireError::IndexOutOfRange {
                    index: idx as u64,
                    len: n,
                });
            }
            let neg = br.bit();
            let level = br.get().ok_or(WireError::Invalid("bad qsgd level code"))?;
            if br.bits_read() > avail {
                return Err(WireError::Truncated {
                    what: "qsgd stream",
                    needed: bytes_for_bits(br.bits_read()),
                    available: len,
                });
            }
            if level > self.s {
                return Err(WireError::Invalid("qsgd level exceeds s"));
            }
            let nrm = f32_at(norms, idx / self.d);
            if nrm == 0.0 {
                return Err(WireError::Invalid("qsgd non-zero in a zero-norm bucket"));
            }
            let v = level_value(nrm, level, self.s);
            out[idx] += if neg { -v } else { v };
            next = idx + 1;
        }
        let used = br.bits_read();
        if bytes_for_bits(used) != len {
            return Err(WireError::Invalid(
                "qsgd stream length disagrees with its content",
            ));
        }
        if !used.is_multiple_of(8) && stream[len - 1] >> (used % 8) != 0 {
            return Err(WireError::Invalid("qsgd padding bits are not zero"));
        }
        Ok(())
    }
}

impl Compressor for Qsgd {
    fn method(&self) -> MethodId {
        QsgdConfig::ID
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }
    fn unbiased(&self) -> bool {
        true
    }
    fn encode_segment(&mut self, x: &[f32], rng: &mut Rng, w: &mut Writer<'_>) {
        match self.coding {
            QsgdCoding::Fixed => self.encode_fixed(x, rng, w),
            QsgdCoding::Elias => self.encode_elias(x, rng, w),
        }
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        match self.coding {
            QsgdCoding::Fixed => self
                .decode_fixed::<{ put_mode::ADD }>(r, out, 1.0)
                .map(drop),
            QsgdCoding::Elias => self.decode_elias(r, out),
        }
    }
    /// Fixed-width codes give every element a value; Elias codes list the non-zeros.
    fn decodes_densely(&self) -> bool {
        self.coding == QsgdCoding::Fixed
    }
    fn decode_segment_dense(
        &self,
        r: &mut Reader<'_>,
        out: &mut [f32],
        put: Put,
    ) -> Result<bool, WireError> {
        match self.coding {
            QsgdCoding::Fixed => with_put_mode!(put, |M, k| self.decode_fixed::<M>(r, out, k)),
            QsgdCoding::Elias => dense_by_passes(self, r, out, put),
        }
    }
    fn segment_bits(&self, n: usize) -> Option<u64> {
        match self.coding {
            QsgdCoding::Fixed => {
                Some(32 * n.div_ceil(self.d) as u64 + n as u64 * self.width as u64)
            }
            QsgdCoding::Elias => None,
        }
    }
}

/// The 4-bit fixed-width decoder's inner loop, sixteen values at a time: eight code bytes
/// widened to sixteen lanes (each byte twice, shifted by 0 and 4: the low nibble is the
/// earlier value), the values looked up in the bucket's 16-entry table by one permute, and
/// added to the output (or to zero, written over it, and scaled, as the mode says:
/// [`put`](crate::put::put)). The validity of a code is looked up the same way. The same
/// additions of the same table values as the scalar loop, so the same bits (tested).
mod nibbles {
    use crate::put::put_mode;

    /// Puts the values of the first `16 · g` codes of `cb` (two per byte, low nibble first)
    /// into `out` through `table` as the mode `M` says, with factor `k`
    /// ([`put`](crate::put::put)), for as many whole groups `g` as the CPU's vector
    /// path takes (none without AVX-512); sets `bad` if one of the codes is invalid
    /// (`bad_byte[c]` for a code `c < 16`) and `non_finite` if a scaled value is; returns
    /// `16 · g`.
    pub(super) fn put<const M: u8>(
        cb: &[u8],
        table: &[f32; 256],
        bad_byte: &[bool; 256],
        out: &mut [f32],
        k: f32,
        bad: &mut bool,
        non_finite: &mut bool,
    ) -> usize {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::widest() == crate::simd::Tier::Avx512 {
            let groups = (out.len() / 16).min(cb.len() / 8);
            let mut flags = [0u32; 16];
            for (f, &b) in flags.iter_mut().zip(bad_byte) {
                *f = u32::from(b);
            }
            // SAFETY: the CPU executes AVX-512F/BW/DQ/VL (`widest`, above); `groups` whole
            // groups fit in `cb` (8 bytes each) and `out` (16 values each).
            let (invalid, inf) = unsafe {
                put_avx512::<M>(&cb[..groups * 8], table, &flags, &mut out[..groups * 16], k)
            };
            *bad |= invalid;
            *non_finite |= inf;
            return groups * 16;
        }
        let _ = (cb, table, bad_byte, out, k, bad, non_finite);
        0
    }

    /// Returns whether a code was invalid and whether a scaled value is non-finite.
    /// `cb.len() · 2 == out.len()`, a multiple of 16.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
    unsafe fn put_avx512<const M: u8>(
        cb: &[u8],
        table: &[f32; 256],
        flags: &[u32; 16],
        out: &mut [f32],
        k: f32,
    ) -> (bool, bool) {
        use std::arch::x86_64::*;
        debug_assert!(cb.len() * 2 == out.len() && out.len().is_multiple_of(16));
        // SAFETY: each step reads 8 bytes at 8·g of `cb` and 16 values at 16·g of `out`,
        // g < out.len() / 16; the tables are 16 entries long (at least).
        unsafe {
            let values = _mm512_loadu_ps(table.as_ptr());
            let invalid = _mm512_loadu_si512(flags.as_ptr().cast());
            let shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
            let nibble = _mm512_set1_epi32(15);
            let factor = _mm512_set1_ps(k);
            let exponent = _mm512_set1_epi32(0x7F80_0000);
            let mut any = _mm512_setzero_si512();
            let mut inf: u16 = 0;
            for g in 0..out.len() / 16 {
                let bytes = _mm_loadl_epi64(cb.as_ptr().add(8 * g).cast());
                let twice = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));
                let code = _mm512_and_si512(_mm512_srlv_epi32(twice, shifts), nibble);
                any = _mm512_or_si512(any, _mm512_permutexvar_epi32(code, invalid));
                let po = out.as_mut_ptr().add(16 * g);
                let base = if M & put_mode::WRITE_BIT != 0 {
                    _mm512_setzero_ps()
                } else {
                    _mm512_loadu_ps(po)
                };
                let mut v = _mm512_add_ps(base, _mm512_permutexvar_ps(code, values));
                if M & put_mode::SCALE_BIT != 0 {
                    v = _mm512_mul_ps(v, factor);
                    let e = _mm512_and_si512(_mm512_castps_si512(v), exponent);
                    inf |= _mm512_cmpeq_epi32_mask(e, exponent);
                }
                _mm512_storeu_ps(po, v);
            }
            (_mm512_test_epi32_mask(any, any) != 0, inf != 0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{
        compress, compress_new, decompress, decompress_add, payload_bits, Ctx, Payload,
    };
    use crate::test_util::{fuzz_decoder, test_vector};

    /// The encoder's dispatched loops (norms, codes) give the same payload bytes on every
    /// tier, for both norms and the three byte-packed widths, buckets whole and partial.
    #[test]
    fn payloads_are_the_same_on_every_tier() {
        for levels in [1, 7, 127] {
            for norm in [QsgdNorm::Max, QsgdNorm::L2] {
                let mut c = qsgd(levels, 512, norm, QsgdCoding::Fixed);
                let v = test_vector(5000, 3.0, u64::from(levels));
                crate::simd::assert_same_on_every_tier("qsgd encode", || {
                    compress_new(&mut c, &v, &Ctx::default(), &mut Rng::seed_from_u64(9))
                        .unwrap()
                        .as_bytes()
                        .to_vec()
                });
            }
        }
    }

    /// The 4-bit decoder's vector groups give the scalar loop's sums and errors on every
    /// tier: buckets of whole groups, of groups and a rest, shorter than a group, a partial
    /// last bucket with a padding nibble; payloads as encoded and with code bytes mutated
    /// (some into invalid codes).
    #[test]
    fn nibble_decoder_is_the_scalar_loop_on_every_tier() {
        let mut rng = Rng::seed_from_u64(23);
        for (bucket, n) in [(512, 4096), (40, 1000), (6, 100), (512, 4099), (48, 47)] {
            let mut c = qsgd(7, bucket, QsgdNorm::Max, QsgdCoding::Fixed);
            assert_eq!(c.width, 4);
            let v = test_vector(n, 1.0, n as u64);
            let p = compress_new(&mut c, &v, &Ctx::default(), &mut Rng::seed_from_u64(5)).unwrap();
            for trial in 0..20 {
                let mut bytes = p.as_bytes().to_vec();
                if trial > 0 {
                    // Code bytes are the payload's tail.
                    let tail = bytes.len() / 2;
                    for _ in 0..1 + trial % 3 {
                        let at = bytes.len() - 1 - rng.below(tail as u64) as usize;
                        bytes[at] = rng.below(256) as u8;
                    }
                }
                crate::simd::assert_same_on_every_tier("qsgd 4-bit decode", || {
                    let mut out: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
                    let r = decompress_add(&c, &bytes, &mut out);
                    (r, out.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                });
            }
        }
    }

    fn qsgd(levels: u32, bucket: usize, norm: QsgdNorm, coding: QsgdCoding) -> Qsgd {
        QsgdConfig {
            levels,
            bucket,
            norm,
            coding,
            draws: Draws::Lanes,
        }
        .init()
        .unwrap()
    }

    /// Counter draws: unbiased per element; a function of the element's value, its bucket's
    /// norm and the key alone (one Rng draw per segment); a bucket whose `s/N` overflows
    /// `f32` rounds as the same values scaled up by a power of two do; the fixed and the
    /// Elias codings decode alike; `levels ≥ 2²³` refused.
    #[test]
    fn counter_draws_are_unbiased_and_scale_free() {
        use crate::compressor::{compress_new, decompress_add};
        let cfg = |coding| QsgdConfig {
            levels: 5,
            bucket: 16,
            coding,
            draws: Draws::Counter,
            ..QsgdConfig::default()
        };
        let mut c = cfg(QsgdCoding::Fixed).init().unwrap();
        let x: Vec<f32> = (0..40).map(|i| (i as f32 - 13.0) / 7.0).collect();
        let (rounds, mut mean) = (4000, vec![0f64; x.len()]);
        for k in 0..rounds {
            let p = compress_new(&mut c, &x, &Ctx::default(), &mut Rng::seed_from_u64(k)).unwrap();
            let mut out = vec![0f32; x.len()];
            decompress_add(&c, p.as_bytes(), &mut out).unwrap();
            for (m, o) in mean.iter_mut().zip(&out) {
                *m += f64::from(*o) / rounds as f64;
            }
        }
        for (b, (mb, xb)) in mean.chunks(16).zip(x.chunks(16)).enumerate() {
            let step = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 5.0;
            for (m, &v) in mb.iter().zip(xb) {
                // Four standard errors of a Bernoulli step of one level.
                let tol = 4.0 * step / (rounds as f64).sqrt();
                assert!((m - v as f64).abs() <= tol, "bucket {b}: {m} vs {v}");
            }
        }
        let encode = |c: &mut Qsgd, v: &[f32], seed| {
            compress_new(c, v, &Ctx::default(), &mut Rng::seed_from_u64(seed)).unwrap()
        };
        // The codes (after the three buckets' norms) of x and of x·2⁻¹⁴⁰, whose s/N
        // overflows: equal.
        let tiny: Vec<f32> = x.iter().map(|v| v * 2f32.powi(-140)).collect();
        assert!(!(5.0 / tiny.iter().fold(0f32, |m, v| m.max(v.abs()))).is_finite());
        let codes = |p: &Payload| p.as_bytes()[p.as_bytes().len() - (40 * 4) / 8..].to_vec();
        let (px, pt) = (encode(&mut c, &x, 3), encode(&mut c, &tiny, 3));
        assert_eq!(codes(&px), codes(&pt));
        let mut out = vec![0f32; 40];
        decompress_add(&c, pt.as_bytes(), &mut out).unwrap();
        assert!(out.iter().any(|&v| v != 0.0));
        // Element j's code depends on x_j, its bucket's norm and the key only.
        let mut y = x.clone();
        y[3] = 0.01;
        let (bx, by) = (codes(&px), codes(&encode(&mut c, &y, 3)));
        for j in (0..40).filter(|&j| j != 3) {
            assert_eq!(
                bx[j / 2] >> (4 * (j % 2)) & 15,
                by[j / 2] >> (4 * (j % 2)) & 15,
                "{j}"
            );
        }
        // One Rng draw per segment.
        let segs = [0..10, 10..40];
        let mut rng = Rng::seed_from_u64(4);
        let ctx = Ctx {
            segments: &segs,
            ..Ctx::default()
        };
        compress_new(&mut c, &x, &ctx, &mut rng).unwrap();
        let mut two = Rng::seed_from_u64(4);
        two.next_u64();
        two.next_u64();
        assert_eq!(rng.next_u64(), two.next_u64());
        // Elias decodes as fixed.
        let mut e = cfg(QsgdCoding::Elias).init().unwrap();
        let (mut a, mut b) = (vec![0f32; 40], vec![0f32; 40]);
        let (pc, pe) = (encode(&mut c, &x, 8), encode(&mut e, &x, 8));
        decompress_add(&c, pc.as_bytes(), &mut a).unwrap();
        decompress_add(&e, pe.as_bytes(), &mut b).unwrap();
        assert_eq!(a, b);
        let big = QsgdConfig {
            levels: 1 << 23,
            ..cfg(QsgdCoding::Fixed)
        };
        assert!(big.init().is_err());
    }

    /// Exact per-coordinate quantities of the rule for a bucketed vector:
    /// (N of the coordinate's bucket, τ_j, l_j), in f64 from the f32 norm the encoder sends.
    fn exact(v: &[f32], d: usize, s: u32, norm: QsgdNorm) -> Vec<(f64, f64, f64)> {
        let mut out = Vec::new();
        for b in v.chunks(d) {
            let nrm = match norm {
                QsgdNorm::Max => max_norm(b),
                QsgdNorm::L2 => l2_norm(b),
            } as f64;
            for &x in b {
                let r = if nrm == 0.0 {
                    0.0
                } else {
                    (s as f64 * (x as f64).abs() / nrm).min(s as f64)
                };
                out.push((nrm, r - r.floor(), r.floor()));
            }
        }
        out
    }

    /// `T` decoded draws of Q(v) through the full framing.
    fn draws(c: &mut Qsgd, v: &[f32], t: usize, seed: u64, mut f: impl FnMut(&[f32])) {
        let mut rng = Rng::seed_from_u64(seed);
        let mut p = Payload::new();
        let mut out = vec![0f32; v.len()];
        for _ in 0..t {
            compress(c, v, &Ctx::default(), &mut rng, &mut p).unwrap();
            decompress(c, p.as_bytes(), &mut out).unwrap();
            f(&out);
        }
    }

    #[test]
    fn qsgd_monte_carlo_mean_is_v() {
        let t = 10_000;
        for (norm, s, d) in [(QsgdNorm::Max, 4, 64), (QsgdNorm::L2, 2, 100)] {
            let v = test_vector(256, 1.5, 11);
            let mut c = qsgd(s, d, norm, QsgdCoding::Fixed);
            let mut sum = vec![0f64; v.len()];
            draws(&mut c, &v, t, 5, |q| {
                for (a, &x) in sum.iter_mut().zip(q) {
                    *a += x as f64;
                }
            });
            for (j, ((&x, &a), &(nrm, tau, _))) in
                v.iter().zip(&sum).zip(&exact(&v, d, s, norm)).enumerate()
            {
                let mean = a / t as f64;
                let se = (nrm / s as f64) * (tau * (1.0 - tau) / t as f64).sqrt();
                let tol = 5.0 * se + 1e-6 * nrm;
                assert!(
                    (mean - x as f64).abs() <= tol,
                    "{norm:?} coord {j}: mean {mean} vs {x} (tol {tol})"
                );
            }
        }
    }

    #[test]
    fn qsgd_monte_carlo_variance_matches_exact_formula() {
        let t = 10_000;
        for (norm, s, d) in [(QsgdNorm::L2, 4, 300), (QsgdNorm::Max, 3, 50)] {
            let v = test_vector(300, 0.7, 21);
            let ex = exact(&v, d, s, norm);
            // E‖Q−v‖² = Σ (N/s)² τ(1−τ); Var of one draw's ‖Q−v‖² is Σ Var(e_j²).
            let mut want = 0.0;
            let mut var_of_err = 0.0;
            for &(nrm, tau, _) in &ex {
                let q2 = (nrm / s as f64).powi(2);
                want += q2 * tau * (1.0 - tau);
                let m2 = q2 * (tau * (1.0 - tau).powi(2) + (1.0 - tau) * tau * tau);
                let m4 = q2 * q2 * (tau * (1.0 - tau).powi(4) + (1.0 - tau) * tau.powi(4));
                var_of_err += m4 - m2 * m2;
            }
            let mut acc = 0.0f64;
            draws(&mut qsgd(s, d, norm, QsgdCoding::Fixed), &v, t, 9, |q| {
                acc += q
                    .iter()
                    .zip(&v)
                    .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
                    .sum::<f64>();
            });
            let got = acc / t as f64;
            let tol = 5.0 * (var_of_err / t as f64).sqrt() + 1e-9 * want;
            assert!(
                (got - want).abs() <= tol,
                "{norm:?}: MC variance {got} vs exact {want} (tol {tol})"
            );
        }
    }

    #[test]
    fn qsgd_l2_variance_is_below_the_lemma_bound() {
        // d = n recovers the paper's setting. Checked on the exact formula for many vectors
        // and levels, and by Monte Carlo for one of them.
        for seed in 0..20u64 {
            for s in [1u32, 2, 4, 8, 31] {
                let n = 50 + 37 * seed as usize;
                let v = test_vector(n, 2.0, 100 + seed);
                let sq: f64 = v.iter().map(|&x| (x as f64).powi(2)).sum();
                let bound =
                    ((n as f64) / (s as f64).powi(2)).min((n as f64).sqrt() / s as f64) * sq;
                let var: f64 = exact(&v, n, s, QsgdNorm::L2)
                    .iter()
                    .map(|&(nrm, tau, _)| (nrm / s as f64).powi(2) * tau * (1.0 - tau))
                    .sum();
                assert!(var <= bound, "n {n} s {s}: {var} > {bound}");
            }
        }
        let n = 400;
        let s = 2;
        let v = test_vector(n, 1.0, 77);
        let sq: f64 = v.iter().map(|&x| (x as f64).powi(2)).sum();
        let bound = ((n as f64) / 4.0).min((n as f64).sqrt() / 2.0) * sq;
        let t = 2_000;
        let mut acc = 0.0;
        draws(
            &mut qsgd(s, n, QsgdNorm::L2, QsgdCoding::Fixed),
            &v,
            t,
            3,
            |q| {
                acc += q
                    .iter()
                    .zip(&v)
                    .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
                    .sum::<f64>();
            },
        );
        assert!(
            acc / t as f64 <= bound,
            "MC {} > bound {bound}",
            acc / t as f64
        );
    }

    #[test]
    fn qsgd_expected_nonzeros_within_bound() {
        let t = 10_000;
        for (n, s) in [(1000usize, 2u32), (400, 4), (900, 1)] {
            let v = test_vector(n, 1.0, n as u64);
            let mut nnz = 0u64;
            draws(
                &mut qsgd(s, n, QsgdNorm::L2, QsgdCoding::Fixed),
                &v,
                t,
                4,
                |q| {
                    nnz += q.iter().filter(|&&x| x != 0.0).count() as u64;
                },
            );
            let mean = nnz as f64 / t as f64;
            // Exact expectation: a coordinate is non-zero iff l ≥ 1, or l = 0 and it rounds up.
            let ex = exact(&v, n, s, QsgdNorm::L2);
            let want: f64 = ex
                .iter()
                .map(|&(_, tau, l)| if l >= 1.0 { 1.0 } else { tau })
                .sum();
            let sd: f64 = ex
                .iter()
                .map(|&(_, tau, l)| if l >= 1.0 { 0.0 } else { tau * (1.0 - tau) })
                .sum::<f64>()
                .sqrt();
            assert!(
                (mean - want).abs() <= 5.0 * sd / (t as f64).sqrt() + 1e-9,
                "n {n} s {s}: mean nnz {mean} vs {want}"
            );
            let bound = s as f64 * (s as f64 + (n as f64).sqrt());
            assert!(mean <= bound, "n {n} s {s}: E nnz {mean} > {bound}");
        }
    }

    #[test]
    fn qsgd_decoded_values_are_on_the_grid_with_input_signs() {
        for (norm, s, d) in [
            (QsgdNorm::Max, 7, 512),
            (QsgdNorm::L2, 5, 33),
            (QsgdNorm::Max, 1, 10),
        ] {
            let v = test_vector(1000, 3.0, s as u64);
            let ex = exact(&v, d, s, norm);
            let mut c = qsgd(s, d, norm, QsgdCoding::Fixed);
            draws(&mut c, &v, 50, 8, |q| {
                for ((&qj, &vj), &(nrm, _, l)) in q.iter().zip(&v).zip(&ex) {
                    let level = (qj.abs() as f64 * s as f64 / nrm).round();
                    assert!(level <= s as f64, "level {level} > {s}");
                    assert_eq!(qj.abs(), level_value(nrm as f32, level as u32, s));
                    assert!(
                        level == l || level == l + 1.0,
                        "level {level} from floor {l}"
                    );
                    if qj != 0.0 {
                        assert_eq!(qj.is_sign_negative(), vj.is_sign_negative());
                    }
                }
            });
        }
    }

    #[test]
    fn qsgd_large_s_approaches_identity() {
        let v = test_vector(500, 1.0, 5);
        let s = 1 << 22;
        let mut c = qsgd(s, 64, QsgdNorm::Max, QsgdCoding::Fixed);
        let ex = exact(&v, 64, s, QsgdNorm::Max);
        draws(&mut c, &v, 3, 1, |q| {
            for ((&a, &b), &(nrm, _, _)) in q.iter().zip(&v).zip(&ex) {
                // One level step plus the f32 rounding of the decoded value.
                let tol = nrm / s as f64 + f32::EPSILON as f64 * (b as f64).abs();
                assert!((a as f64 - b as f64).abs() <= tol, "{a} vs {b}");
            }
        });
        // The error shrinks with s: compare max errors at s = 4 and s = 2^22.
        let max_err = |s: u32| {
            let mut c = qsgd(s, 64, QsgdNorm::Max, QsgdCoding::Fixed);
            let p = compress_new(&mut c, &v, &Ctx::default(), &mut Rng::seed_from_u64(2)).unwrap();
            let mut q = vec![0f32; v.len()];
            decompress(&c, p.as_bytes(), &mut q).unwrap();
            q.iter()
                .zip(&v)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max)
        };
        assert!(max_err(1 << 22) < 1e-5 * max_err(4));
    }

    #[test]
    fn qsgd_same_seed_same_bytes() {
        let v = test_vector(3000, 1.0, 3);
        for coding in [QsgdCoding::Fixed, QsgdCoding::Elias] {
            let mut c = qsgd(7, 512, QsgdNorm::Max, coding);
            let ctx = Ctx::default();
            let a = compress_new(&mut c, &v, &ctx, &mut Rng::for_step(1, 2, 3, 4)).unwrap();
            let b = compress_new(&mut c, &v, &ctx, &mut Rng::for_step(1, 2, 3, 4)).unwrap();
            let other = compress_new(&mut c, &v, &ctx, &mut Rng::for_step(1, 2, 4, 4)).unwrap();
            assert_eq!(a, b);
            assert_ne!(a, other);
        }
    }

    #[test]
    fn qsgd_encoded_length_matches_formula() {
        for (s, d) in [(7u32, 512usize), (1, 1), (3, 7), (127, 8192), (1000, 100)] {
            let mut c = qsgd(s, d, QsgdNorm::Max, QsgdCoding::Fixed);
            for n in [1usize, 2, 7, 511, 512, 513, 1000, 4099] {
                let v = test_vector(n, 1.0, n as u64);
                let p =
                    compress_new(&mut c, &v, &Ctx::default(), &mut Rng::seed_from_u64(0)).unwrap();
                let w = code_width(s) as u64;
                let want = 32 * n.div_ceil(d) as u64 + n as u64 * w;
                assert_eq!(c.segment_bits(n), Some(want));
                assert_eq!(8 * p.encoded_len() as u64, 96 + want.div_ceil(8) * 8);
                assert_eq!(payload_bits(&c, &[n]), Some(8 * p.encoded_len() as u64));
                if n > 3 {
                    let segs = [0..1, 1..3, 3..n];
                    let ctx = Ctx {
                        segments: &segs,
                        ..Ctx::default()
                    };
                    let p = compress_new(&mut c, &v, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
                    assert_eq!(
                        payload_bits(&c, &[1, 2, n - 3]),
                        Some(8 * p.encoded_len() as u64)
                    );
                }
            }
        }
        assert_eq!(code_width(7), 4);
        assert_eq!(code_width(8), 5);
        assert_eq!(code_width(1), 2);
        assert_eq!(code_width(127), 8);
    }

    #[test]
    fn qsgd_elias_decodes_identically_to_fixed() {
        for (s, d, norm, n) in [
            (7u32, 512usize, QsgdNorm::Max, 3000usize),
            (2, 1000, QsgdNorm::L2, 1000),
            (1, 50, QsgdNorm::L2, 777),
            (300, 64, QsgdNorm::Max, 129),
            // Byte-aligned fast decoders (widths 2, 8) and an unaligned width-4 layout.
            (1, 64, QsgdNorm::Max, 1001),
            (127, 100, QsgdNorm::L2, 1001),
            (5, 7, QsgdNorm::Max, 1001),
        ] {
            let mut v = test_vector(n, 1.0, s as u64 + n as u64);
            v[n / 2..n / 2 + 64.min(n / 2)].fill(0.0); // a zero bucket or two
            let segs = [0..n / 3, n / 3..n];
            let ctx = Ctx {
                segments: &segs,
                ..Ctx::default()
            };
            let mut f = qsgd(s, d, norm, QsgdCoding::Fixed);
            let mut e = qsgd(s, d, norm, QsgdCoding::Elias);
            for seed in 0..5 {
                let pf = compress_new(&mut f, &v, &ctx, &mut Rng::seed_from_u64(seed)).unwrap();
                let pe = compress_new(&mut e, &v, &ctx, &mut Rng::seed_from_u64(seed)).unwrap();
                let mut qf = vec![0f32; n];
                let mut qe = vec![0f32; n];
                decompress(&f, pf.as_bytes(), &mut qf).unwrap();
                decompress(&e, pe.as_bytes(), &mut qe).unwrap();
                let bits = |q: &[f32]| q.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&qf), bits(&qe), "s {s} d {d} n {n}");
                if s == 1 && norm == QsgdNorm::L2 {
                    // Sparse regime (E nnz ≤ s(s+√d) = 8 of 50): Elias is shorter.
                    assert!(pe.encoded_len() < pf.encoded_len());
                }
            }
        }
    }

    #[test]
    fn qsgd_decoders_reject_malformed_bodies() {
        let v = test_vector(10, 1.0, 1);
        // s = 5: width 4, levels 6 and 7 are representable but invalid.
        let mut c = qsgd(5, 4, QsgdNorm::Max, QsgdCoding::Fixed);
        let p = compress_new(&mut c, &v, &Ctx::default(), &mut Rng::seed_from_u64(0)).unwrap();
        let base = p.into_bytes();
        let codes_at = 12 + 4 * 3;
        let mut out = vec![0f32; 10];
        assert!(decompress(&c, &base, &mut out).is_ok());
        let mut bad = base.clone();
        bad[codes_at] = (bad[codes_at] & 0xF0) | (6 << 1); // level 6 > s
        assert!(decompress(&c, &bad, &mut out).is_err());
        let mut bad = base.clone();
        bad[codes_at] &= 0xF0;
        bad[codes_at] |= 1; // signed zero
        assert!(decompress(&c, &bad, &mut out).is_err());
        let mut bad = base.clone();
        bad[12..16].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(decompress(&c, &bad, &mut out).is_err());
        let mut bad = base.clone();
        bad[12..16].copy_from_slice(&(-1.0f32).to_le_bytes());
        assert!(decompress(&c, &bad, &mut out).is_err());
        // 10 codes × 4 bits = 40 bits: no padding; use 9 elements for padding checks.
        let v9 = &v[..9];
        let p = compress_new(&mut c, v9, &Ctx::default(), &mut Rng::seed_from_u64(0)).unwrap();
        let mut bad = p.into_bytes();
        *bad.last_mut().unwrap() |= 0x80;
        assert!(decompress(&c, &bad, &mut out[..9]).is_err());
        // Elias: a count larger than the stream can hold, a trailing byte, a level > s.
        let mut e = qsgd(5, 4, QsgdNorm::Max, QsgdCoding::Elias);
        let p = compress_new(&mut e, &v, &Ctx::default(), &mut Rng::seed_from_u64(0)).unwrap();
        let base = p.into_bytes();
        assert!(decompress(&e, &base, &mut out).is_ok());
        let k_at = 12 + 4 * 3;
        let mut bad = base.clone();
        bad[k_at..k_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decompress(&e, &bad, &mut out).is_err());
        let mut bad = base.clone();
        let len = u32::from_le_bytes(bad[k_at + 4..k_at + 8].try_into().unwrap());
        bad[k_at + 4..k_at + 8].copy_from_slice(&(len + 1).to_le_bytes());
        bad.push(0);
        assert!(decompress(&e, &bad, &mut out).is_err());
        // Hand-made stream: one entry, gap 1 (bit 1), sign 0, level γ(6) = 00110.
        let mut bad = base[..k_at].to_vec();
        bad.extend_from_slice(&1u32.to_le_bytes());
        bad.extend_from_slice(&1u32.to_le_bytes());
        // bits LSB-first: 1, 0, 0,0,1,1,0 → 0b0011_0001
        bad.push(0b0011_0001);
        assert!(matches!(
            decompress(&e, &bad, &mut out),
            Err(WireError::Invalid("qsgd level exceeds s"))
        ));
        // The same with level γ(5) = 00101 is accepted.
        *bad.last_mut().unwrap() = 0b0101_0001;
        assert!(
            decompress(&e, &bad, &mut out).is_ok(),
            "{:?}",
            decompress(&e, &bad, &mut out)
        );
    }

    #[test]
    fn qsgd_decoders_never_panic() {
        for coding in [QsgdCoding::Fixed, QsgdCoding::Elias] {
            for (s, d) in [
                (7u32, 16usize),
                (5, 3),
                (1000, 8),
                (127, 5),
                (1, 12),
                (2, 9),
            ] {
                let mut c = qsgd(s, d, QsgdNorm::Max, coding);
                let mut valid = Vec::new();
                for n in [1usize, 5, 40, 130] {
                    let mut v = test_vector(n, 1.0, n as u64);
                    if n > 20 {
                        v[..16].fill(0.0);
                    }
                    let segs = [0..n / 2, n / 2..n];
                    let ctx = Ctx {
                        segments: if n > 1 { &segs } else { &[] },
                        ..Ctx::default()
                    };
                    let p =
                        compress_new(&mut c, &v, &ctx, &mut Rng::seed_from_u64(n as u64)).unwrap();
                    valid.push((p.into_bytes(), n));
                }
                fuzz_decoder(&c, &valid, 3000, s as u64);
            }
        }
    }

    #[test]
    fn qsgd_config_parses_and_validates() {
        let cfg: crate::CompressorConfig = toml::from_str(
            "kind = \"qsgd\"\nlevels = 127\nbucket = 8192\nnorm = \"l2\"\ncoding = \"elias\"",
        )
        .unwrap();
        assert_eq!(
            cfg,
            crate::CompressorConfig::Qsgd(QsgdConfig {
                levels: 127,
                bucket: 8192,
                norm: QsgdNorm::L2,
                coding: QsgdCoding::Elias,
                draws: Draws::Lanes,
            })
        );
        assert!(cfg.build().unwrap().segment_bits(10).is_none());
        for bad in ["levels = 0", "bucket = 0", "levels = 16777217"] {
            let cfg: crate::CompressorConfig =
                toml::from_str(&format!("kind = \"qsgd\"\n{bad}")).unwrap();
            assert!(cfg.build().is_err(), "{bad}");
        }
        assert!(
            toml::from_str::<crate::CompressorConfig>("kind = \"qsgd\"\nnorm = \"l1\"").is_err()
        );
    }
}
