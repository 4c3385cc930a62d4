//! `threshold`: Strom's fixed-threshold quantizer (ALGORITHMS.md §6), as LBANN ports it.
//!
//! Every entry with `|p_j| ≥ τ` is sent as its index and sign and reconstructed as `±τ`;
//! everything else is dropped. The paper builds error feedback into the quantizer; here it is
//! the separate [`crate::memory`] seam, and the registry pairs this method with residual
//! memory by default, which gives exactly Strom's `e_j = p_j ∓ τ` / `e_j = p_j`.
//!
//! Body, per segment of `n` elements (the *sign-word* body, shared with
//! [`crate::adaptive`]):
//! ```text
//! u32 count
//! count × u32 word = (index << 1) | sign      sign 1 = negative; indices strictly ascending
//! ```
//! Bits per segment: `32 + 32·count`. The count is data-dependent and has no upper bound
//! other than `n` (the method's known weakness), so [`Compressor::segment_bits`] is `None`.
//! An index must fit in 31 bits, so segments are limited to `2^31` elements
//! ([`Compressor::max_segment_len`]); [`crate::compress`] refuses longer ones with
//! [`crate::CompressError::TooLarge`].
//!
//! With `coding = "golomb-rice"` (LBANN's older `compress_thresholds`) the words are
//! replaced by delta + Rice-coded indices:
//! ```text
//! u32 count
//! u8  k          Rice parameter, 0..=31 (chosen from the mean gap)
//! u32 nbytes     length of the bit stream
//! nbytes bytes   per entry, LSB-first: gap d = index − previous index − 1 (the first
//!                index itself) as q = d >> k zero bits and a one bit, then the low k bits
//!                of d, then the sign bit; zero padding to a byte
//! ```
//! Bits per segment: `72 + 8·⌈Σ(q_j + k + 2)/8⌉`, about `k + 3` bits per sent entry
//! instead of 32 (≈ 10 at 1 % density).
//!
//! τ and the coding are not on the wire: the decoder must be built from the same
//! configuration.
//! Biased; use error feedback. Aggregation: all-gather.

use serde::{Deserialize, Serialize};

use crate::compressor::{first_non_finite, Aggregation, Compressor, Ctx, FirstNonFinite, MethodId};
use crate::error::{ConfigError, WireError};
use crate::finite::exponent_all_ones;
use crate::memory::MemoryConfig;
use crate::registry::Method;
use crate::rng::Rng;
use crate::wire::{u32_at, BitReader, BitWriter, Reader, Writer};

/// Longest segment a sign-word body can describe: indices must fit in 31 bits.
pub const MAX_SIGN_WORD_SEGMENT: usize = 1 << 31;

/// Configuration of [`Threshold`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThresholdConfig {
    /// The threshold τ > 0 (finite). Entries with `|p| ≥ τ` are sent as `±τ`. The right
    /// value is task-dependent (ALGORITHMS.md §6 marks it unverified); the default, 0.01, is our
    /// own choice, sized for gradients of order 1e-3 plus accumulated residual.
    #[serde(default = "default_tau")]
    pub tau: f32,
    /// How the sent indices are written: `"words"` (default; one u32 word per entry) or
    /// `"golomb-rice"` (delta + Rice coded).
    #[serde(default)]
    pub coding: IndexCoding,
}

/// Index coding of the Strom body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IndexCoding {
    /// `(index << 1) | sign` as one little-endian u32 per entry.
    #[default]
    Words,
    /// Gaps between successive indices, Rice coded, each followed by the sign bit.
    GolombRice,
}

fn default_tau() -> f32 {
    0.01
}

impl Default for ThresholdConfig {
    fn default() -> Self {
        ThresholdConfig {
            tau: default_tau(),
            coding: IndexCoding::Words,
        }
    }
}

impl Method for ThresholdConfig {
    const NAME: &'static str = "threshold";
    const ABOUT: &'static str =
        "Strom's fixed threshold: send (index, sign) of |p| >= tau, reconstruct ±tau";
    const ID: MethodId = MethodId(5);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()?))
    }

    fn default_memory(&self) -> MemoryConfig {
        MemoryConfig::RESIDUAL
    }
}

impl ThresholdConfig {
    /// Checks the parameters and builds the compressor.
    pub fn init(&self) -> Result<Threshold, ConfigError> {
        if !(self.tau.is_finite() && self.tau > 0.0) {
            return Err(ConfigError::new(
                "tau",
                format!("must be finite and > 0, got {}", self.tau),
            ));
        }
        Ok(Threshold {
            tau: self.tau,
            coding: self.coding,
            words: Vec::new(),
            non_finite: FirstNonFinite::default(),
        })
    }
}

/// Strom's threshold quantizer.
#[derive(Debug, Clone)]
pub struct Threshold {
    tau: f32,
    coding: IndexCoding,
    words: Vec<u32>,
    non_finite: FirstNonFinite,
}

impl Threshold {
    /// The threshold τ.
    pub fn tau(&self) -> f32 {
        self.tau
    }
}

/// Appends the sign word of every entry of `x` with `x ≥ pos` or `x ≤ neg` to `words`
/// (cleared first), in ascending index order; returns the index of the first NaN or ±∞ of
/// `x`, if any (found in the same pass). `x.len()` must not exceed
/// [`MAX_SIGN_WORD_SEGMENT`].
pub fn collect_sign_words(x: &[f32], pos: f32, neg: f32, words: &mut Vec<u32>) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    match crate::simd::widest() {
        // SAFETY: `widest` names AVX-512 only when the CPU executes it (F among others).
        crate::simd::Tier::Avx512 => {
            return unsafe { avx512::collect_sign_words(x, pos, neg, words) }
        }
        // SAFETY: `widest` names AVX2 only when the CPU executes it.
        crate::simd::Tier::Avx2 => return unsafe { avx2::collect_sign_words(x, pos, neg, words) },
        crate::simd::Tier::Sse2 => {}
    }
    collect_sign_words_portable(x, pos, neg, words)
}

/// [`collect_sign_words`] without AVX2.
fn collect_sign_words_portable(
    x: &[f32],
    pos: f32,
    neg: f32,
    words: &mut Vec<u32>,
) -> Option<usize> {
    debug_assert!(x.len() <= MAX_SIGN_WORD_SEGMENT);
    words.clear();
    // A vectorised "any" test skips the 16-element chunks without a hit (about half at
    // Strom's τ on Gaussian-like gradients, most at sparser ones); a chunk with a hit is
    // gathered branch-free: every candidate word written into a stack block, the cursor
    // advanced only on a hit, then the hits appended. The same test flags a chunk holding
    // a NaN or an infinity (all exponent bits set).
    const CHUNK: usize = 16;
    const BLOCK: usize = 2048;
    let mut buf = [0u32; BLOCK];
    let mut first_bad = None;
    for (b, block) in x.chunks(BLOCK).enumerate() {
        let mut m = 0usize;
        for (c, chunk) in block.chunks(CHUNK).enumerate() {
            let (hit, bad) = chunk.iter().fold((false, false), |(hit, bad), &v| {
                (hit | (v >= pos) | (v <= neg), bad | exponent_all_ones(v))
            });
            let base = b * BLOCK + c * CHUNK;
            if bad && first_bad.is_none() {
                first_bad = first_non_finite(chunk).map(|(j, _)| base + j);
            }
            if !hit {
                continue;
            }
            for (j, &v) in chunk.iter().enumerate() {
                buf[m] = ((base + j) as u32) << 1 | (v <= neg) as u32;
                m += ((v >= pos) | (v <= neg)) as usize;
            }
        }
        words.extend_from_slice(&buf[..m]);
    }
    first_bad
}

/// [`collect_sign_words`] with AVX2: eight elements per step, their hits packed to the
/// front of the vector by a permutation looked up from the hit mask and stored at the
/// cursor, which advances by the number of hits (AVX2 has no compress-store). Branch-free
/// whatever the density; an all-miss step costs a store that the next one overwrites.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{
        __m256i, _mm256_and_ps, _mm256_and_si256, _mm256_castps_si256, _mm256_cmp_ps,
        _mm256_cmpeq_epi32, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_movemask_ps, _mm256_or_ps,
        _mm256_or_si256, _mm256_permutevar8x32_epi32, _mm256_set1_epi32, _mm256_set1_ps,
        _mm256_setr_epi32, _mm256_setzero_si256, _mm256_slli_epi32, _mm256_storeu_si256,
        _mm256_testz_si256, _CMP_GE_OQ, _CMP_LE_OQ,
    };

    use super::MAX_SIGN_WORD_SEGMENT;
    use crate::compressor::first_non_finite;

    /// For each 8-bit hit mask, the lanes that hit in ascending order, then zeros.
    static PACK: [[u32; 8]; 256] = pack_table();

    const fn pack_table() -> [[u32; 8]; 256] {
        let mut t = [[0u32; 8]; 256];
        let mut m = 0;
        while m < 256 {
            let (mut lane, mut k) = (0, 0);
            while lane < 8 {
                if m & (1 << lane) != 0 {
                    t[m][k] = lane as u32;
                    k += 1;
                }
                lane += 1;
            }
            m += 1;
        }
        t
    }

    /// Elements per block: the hits of a block are gathered on the stack, then appended.
    const BLOCK: usize = 2048;

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn collect_sign_words(
        x: &[f32],
        pos: f32,
        neg: f32,
        words: &mut Vec<u32>,
    ) -> Option<usize> {
        debug_assert!(x.len() <= MAX_SIGN_WORD_SEGMENT);
        words.clear();
        // Eight spare words: a step stores a whole vector at the cursor.
        let mut buf = [0u32; BLOCK + 8];
        let mut first_bad = None;
        // SAFETY: the loads read 8 elements of an 8-element chunk of `x`, the table row
        // is 8 words, and the store writes 8 words at `m <= BLOCK` of `buf` (BLOCK + 8).
        unsafe {
            let vpos = _mm256_set1_ps(pos);
            let vneg = _mm256_set1_ps(neg);
            let exp = _mm256_set1_ps(f32::from_bits(0x7F80_0000));
            let one = _mm256_set1_epi32(1);
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            for (b, block) in x.chunks(BLOCK).enumerate() {
                let mut m = 0usize;
                let mut bad = _mm256_setzero_si256();
                let mut it = block.chunks_exact(8);
                for (c, v8) in (&mut it).enumerate() {
                    let v = _mm256_loadu_ps(v8.as_ptr());
                    let ge = _mm256_cmp_ps::<_CMP_GE_OQ>(v, vpos);
                    let le = _mm256_cmp_ps::<_CMP_LE_OQ>(v, vneg);
                    let hit = _mm256_movemask_ps(_mm256_or_ps(ge, le)) as usize;
                    let e = _mm256_castps_si256(_mm256_and_ps(v, exp));
                    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(e, _mm256_castps_si256(exp)));
                    let base = _mm256_set1_epi32((b * BLOCK + c * 8) as i32);
                    let idx = _mm256_or_si256(base, lanes);
                    let sign = _mm256_and_si256(_mm256_castps_si256(le), one);
                    let word = _mm256_or_si256(_mm256_slli_epi32::<1>(idx), sign);
                    let perm = _mm256_loadu_si256(PACK[hit].as_ptr().cast::<__m256i>());
                    let packed = _mm256_permutevar8x32_epi32(word, perm);
                    _mm256_storeu_si256(buf.as_mut_ptr().add(m).cast::<__m256i>(), packed);
                    m += hit.count_ones() as usize;
                }
                let tail = block.len() - it.remainder().len();
                for (j, &v) in it.remainder().iter().enumerate() {
                    buf[m] = ((b * BLOCK + tail + j) as u32) << 1 | (v <= neg) as u32;
                    m += ((v >= pos) | (v <= neg)) as usize;
                    if !v.is_finite() {
                        bad = _mm256_set1_epi32(-1);
                    }
                }
                if first_bad.is_none() && _mm256_testz_si256(bad, bad) == 0 {
                    first_bad = first_non_finite(block).map(|(j, _)| b * BLOCK + j);
                }
                words.extend_from_slice(&buf[..m]);
            }
        }
        first_bad
    }
}

/// [`collect_sign_words`] with AVX-512F, for symmetric thresholds (`neg = −pos < 0`, as
/// the threshold method calls it; otherwise the AVX2 pass): sixteen magnitudes compared
/// with `pos` into a hit mask (as integers: for non-negative floats the bits order as the
/// values), the words of the hits compressed to the front of a vector in one instruction
/// (`vpcompressd`) and stored straight into `words` at the cursor (32 bytes when at most
/// eight hit, which keeps most stores within one cache line), which advances by the mask's
/// popcount. Branch-free whatever the density apart from that store's width. A word's sign
/// is the element's sign bit (for a hit, `x ≤ neg` exactly when it is set); the NaN/∞ test
/// is the largest magnitude's bits, one integer maximum per step.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        _mm256_storeu_si256, _mm512_add_epi32, _mm512_and_si512, _mm512_castsi512_si256,
        _mm512_cmpge_epu32_mask, _mm512_loadu_si512, _mm512_maskz_compress_epi32, _mm512_max_epu32,
        _mm512_or_si512, _mm512_reduce_max_epu32, _mm512_set1_epi32, _mm512_setr_epi32,
        _mm512_setzero_si512, _mm512_srli_epi32, _mm512_storeu_si512,
    };

    use super::MAX_SIGN_WORD_SEGMENT;
    use crate::compressor::first_non_finite;

    /// Elements per block: room for a block's words is reserved before it, and its NaN/∞
    /// test made after it.
    const BLOCK: usize = 2048;

    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn collect_sign_words(
        x: &[f32],
        pos: f32,
        neg: f32,
        words: &mut Vec<u32>,
    ) -> Option<usize> {
        if !(pos > 0.0 && neg == -pos) {
            // SAFETY: every AVX-512F CPU executes AVX2.
            return unsafe { super::avx2::collect_sign_words(x, pos, neg, words) };
        }
        debug_assert!(x.len() <= MAX_SIGN_WORD_SEGMENT);
        words.clear();
        let mut first_bad = None;
        // For a positive `pos`, `|x| ≥ pos` as floats is `|x|`'s bits ≥ `pos`'s bits as
        // integers, except that a NaN's bits are above every finite value's: a NaN hits.
        // A block holding a NaN or an infinity is then redone by a scalar loop (which
        // leaves NaN out) and reports its first.
        let tau = pos.to_bits() as i32;
        // SAFETY: the loads read 16 elements of a 16-element chunk of `x`; each block
        // reserves room for all its words plus 16 spare, so a store writes at most 16
        // words at `m <= BLOCK` past the words' length, within the capacity, and the
        // length is set to cover exactly the `m` words written.
        unsafe {
            let vtau = _mm512_set1_epi32(tau);
            let magnitude = _mm512_set1_epi32(0x7FFF_FFFF);
            let step = _mm512_set1_epi32(32);
            // Each lane's index, shifted to its place in the word.
            let lanes =
                _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            for (b, block) in x.chunks(BLOCK).enumerate() {
                words.reserve(block.len() + 16);
                let buf = words.as_mut_ptr().add(words.len());
                let mut m = 0usize;
                let mut top = _mm512_setzero_si512();
                // Indices < 2^31, so the shifted index fits the word.
                let mut idx =
                    _mm512_add_epi32(_mm512_set1_epi32((((b * BLOCK) as u32) << 1) as i32), lanes);
                let mut it = block.chunks_exact(16);
                for v16 in &mut it {
                    let v = _mm512_loadu_si512(v16.as_ptr().cast());
                    let a = _mm512_and_si512(v, magnitude);
                    top = _mm512_max_epu32(top, a);
                    let hit = _mm512_cmpge_epu32_mask(a, vtau);
                    let word = _mm512_or_si512(idx, _mm512_srli_epi32::<31>(v));
                    let packed = _mm512_maskz_compress_epi32(hit, word);
                    let n = hit.count_ones() as usize;
                    if n <= 8 {
                        _mm256_storeu_si256(buf.add(m).cast(), _mm512_castsi512_si256(packed));
                    } else {
                        _mm512_storeu_si512(buf.add(m).cast(), packed);
                    }
                    m += n;
                    idx = _mm512_add_epi32(idx, step);
                }
                let bad = _mm512_reduce_max_epu32(top) >= 0x7F80_0000;
                if bad {
                    // Redone without the NaN hits; the tail is part of the block.
                    m = 0;
                    let base = b * BLOCK;
                    for (j, &v) in block.iter().enumerate() {
                        buf.add(m)
                            .write(((base + j) as u32) << 1 | (v <= neg) as u32);
                        m += ((v >= pos) | (v <= neg)) as usize;
                    }
                    if first_bad.is_none() {
                        first_bad = first_non_finite(block).map(|(j, _)| base + j);
                    }
                } else {
                    let tail = block.len() - it.remainder().len();
                    for (j, &v) in it.remainder().iter().enumerate() {
                        buf.add(m)
                            .write(((b * BLOCK + tail + j) as u32) << 1 | (v <= neg) as u32);
                        m += ((v >= pos) | (v <= neg)) as usize;
                        if !v.is_finite() && first_bad.is_none() {
                            first_bad = Some(b * BLOCK + tail + j);
                        }
                    }
                }
                words.set_len(words.len() + m);
            }
        }
        first_bad
    }
}

/// Writes a sign-word body: the count, then the words.
pub fn write_sign_words(words: &[u32], w: &mut Writer<'_>) {
    w.u32(words.len() as u32);
    w.u32_slice(words);
}

/// Bits of a sign-word body with `count` words.
pub fn sign_words_bits(count: usize) -> u64 {
    32 + 32 * count as u64
}

/// Reads a sign-word body and adds `pos` (sign 0) or `neg` (sign 1) at each index of `out`.
///
/// Checks that the count is at most `out.len()` and covered by the bytes present, that
/// every index is in range and that indices strictly ascend (no duplicates).
pub fn read_sign_words_add(
    r: &mut Reader<'_>,
    out: &mut [f32],
    pos: f32,
    neg: f32,
) -> Result<(), WireError> {
    let n = out.len();
    read_sign_words(r, n, pos, neg, |i, v| out[i] += v)
}

/// [`read_sign_words_add`] for a segment of `n` elements, calling `each(index, value)` for
/// each entry in order instead of adding (a decoder that adds elsewhere: the device codec of
/// `dtrain-device`). The same checks, the same errors.
pub fn read_sign_words(
    r: &mut Reader<'_>,
    n: usize,
    pos: f32,
    neg: f32,
    mut each: impl FnMut(usize, f32),
) -> Result<(), WireError> {
    let count = r.u32("sign-word count")? as usize;
    if count > n {
        return Err(WireError::Invalid("more sign words than elements"));
    }
    let words = r.take_items(count, 4, "sign words")?;
    // Indexed rather than branched: signs are random, a branch would mispredict half the time.
    let recon = [pos, neg];
    let mut next = 0usize;
    for j in 0..count {
        let word = u32_at(words, j);
        let i = (word >> 1) as usize;
        if i >= n {
            return Err(WireError::IndexOutOfRange {
                index: i as u64,
                len: n,
            });
        }
        if i < next {
            return Err(WireError::Invalid(
                "sign-word indices not strictly ascending",
            ));
        }
        each(i, recon[(word & 1) as usize]);
        next = i + 1;
    }
    Ok(())
}

/// Rice parameter for `count` entries whose last index is `last`: `⌊log2(mean gap)⌋`.
fn rice_k(count: usize, last: u32) -> u32 {
    if count == 0 {
        return 0;
    }
    let gaps = (last as u64 + 1 - count as u64) / count as u64;
    if gaps == 0 {
        0
    } else {
        63 - gaps.leading_zeros()
    }
}

/// Writes sign words (ascending) as a Golomb–Rice body (see the module docs).
pub fn write_golomb_rice(words: &[u32], w: &mut Writer<'_>) {
    let k = rice_k(words.len(), words.last().map_or(0, |&wd| wd >> 1));
    let mut bits = 0u64;
    let mut prev = 0u32; // next index without a gap
    for &wd in words {
        let d = (wd >> 1) - prev;
        bits += (d >> k) as u64 + k as u64 + 2;
        prev = (wd >> 1) + 1;
    }
    let nbytes = bits.div_ceil(8) as usize;
    w.u32(words.len() as u32);
    w.u8(k as u8);
    w.u32(nbytes as u32);
    let mut bw = BitWriter::new(w.zeroed(nbytes));
    let mut prev = 0u32;
    for &wd in words {
        let d = (wd >> 1) - prev;
        let mut q = d >> k;
        while q > 0 {
            let c = q.min(32);
            bw.put(0, c);
            q -= c;
        }
        bw.put(1, 1);
        if k > 0 {
            bw.put(d & ((1u32 << k) - 1), k);
        }
        bw.put(wd & 1, 1);
        prev = (wd >> 1) + 1;
    }
    bw.finish();
}

/// Reads a Golomb–Rice body and adds `pos` / `neg` at each index of `out`. Every loop is
/// bounded by the bits actually present.
pub fn read_golomb_rice_add(
    r: &mut Reader<'_>,
    out: &mut [f32],
    pos: f32,
    neg: f32,
) -> Result<(), WireError> {
    let n = out.len();
    read_golomb_rice(r, n, pos, neg, |i, v| out[i] += v)
}

/// [`read_golomb_rice_add`] for a segment of `n` elements, calling `each(index, value)` for
/// each entry in order instead of adding. The same checks, the same errors.
pub fn read_golomb_rice(
    r: &mut Reader<'_>,
    n: usize,
    pos: f32,
    neg: f32,
    mut each: impl FnMut(usize, f32),
) -> Result<(), WireError> {
    let count = r.u32("rice count")? as usize;
    if count > n {
        return Err(WireError::Invalid("more rice entries than elements"));
    }
    let k = r.u8("rice parameter")? as u32;
    if k > 31 {
        return Err(WireError::Invalid("rice parameter above 31"));
    }
    let nbytes = r.u32("rice stream length")? as usize;
    let bytes = r.take(nbytes, "rice stream")?;
    let avail = 8 * nbytes as u64;
    if count as u64 * (k as u64 + 2) > avail {
        return Err(WireError::Invalid("rice stream too short for its count"));
    }
    let overrun = WireError::Invalid("rice stream overrun");
    let mut br = BitReader::new(bytes);
    let mut next = 0u64;
    for _ in 0..count {
        let mut q = 0u64;
        while !br.bit() {
            q += 1;
            if br.bits_read() > avail {
                return Err(overrun);
            }
        }
        let low = if k > 0 { br.get(k) as u64 } else { 0 };
        let negative = br.bit();
        if br.bits_read() > avail {
            return Err(overrun);
        }
        let i = next + ((q << k) | low);
        if i >= n as u64 {
            return Err(WireError::IndexOutOfRange { index: i, len: n });
        }
        each(i as usize, if negative { neg } else { pos });
        next = i + 1;
    }
    if br.bits_read().div_ceil(8) != nbytes as u64 {
        return Err(WireError::Invalid("rice stream longer than its entries"));
    }
    Ok(())
}

impl Compressor for Threshold {
    fn method(&self) -> MethodId {
        ThresholdConfig::ID
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }
    fn begin(&mut self, _grad: &[f32], _ctx: &Ctx<'_>) {
        self.non_finite.reset();
    }
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        let at = self.non_finite.segment(x.len());
        let bad = collect_sign_words(x, self.tau, -self.tau, &mut self.words);
        self.non_finite.note(at, bad.map(|i| (i, x[i])));
        match self.coding {
            IndexCoding::Words => write_sign_words(&self.words, w),
            IndexCoding::GolombRice => write_golomb_rice(&self.words, w),
        }
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        match self.coding {
            IndexCoding::Words => read_sign_words_add(r, out, self.tau, -self.tau),
            IndexCoding::GolombRice => read_golomb_rice_add(r, out, self.tau, -self.tau),
        }
    }
    fn segment_bits(&self, _n: usize) -> Option<u64> {
        None
    }
    fn max_segment_len(&self) -> usize {
        MAX_SIGN_WORD_SEGMENT
    }
    /// The sign-word pass flags every NaN and infinity ([`collect_sign_words`]).
    fn finds_non_finite(&self) -> bool {
        true
    }
    fn take_non_finite(&mut self) -> Option<(usize, f32)> {
        self.non_finite.take()
    }
}

/// Helpers shared by the tests of the threshold-style sparsifiers.
#[cfg(test)]
pub(crate) mod test_support {
    use crate::compressor::{compress_new, decompress, Compressor, Ctx};
    use crate::pipeline::Pipeline;
    use crate::rng::Rng;
    use crate::CompressorConfig;
    use crate::Payload;

    /// Standard normal draws (Box–Muller), scaled.
    pub fn gaussian(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u1 = 1.0 - rng.next_f64();
                let u2 = rng.next_f64();
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                z as f32 * scale
            })
            .collect()
    }

    /// Heavy-tailed draws: a Gaussian times an exponential magnitude.
    pub fn heavy_tailed(rng: &mut Rng, n: usize) -> Vec<f32> {
        let g = gaussian(rng, n, 1.0);
        g.into_iter()
            .map(|z| z * (-(1.0 - rng.next_f64()).ln() * 3.0).exp() as f32 * 1e-3)
            .collect()
    }

    /// Compresses and decodes `x` (one segment, or `segs`) and returns the payload too.
    pub fn round_trip(
        c: &mut dyn Compressor,
        x: &[f32],
        segs: &[std::ops::Range<usize>],
        rng: &mut Rng,
    ) -> (Payload, Vec<f32>) {
        let ctx = Ctx {
            segments: segs,
            ..Ctx::default()
        };
        let p = compress_new(c, x, &ctx, rng).unwrap();
        let mut out = vec![0f32; x.len()];
        decompress(c, p.as_bytes(), &mut out).unwrap();
        (p, out)
    }

    /// Runs `steps` steps of the method's default error-feedback pipeline and checks the
    /// invariant `D(msg) + e_new == g + e_old` element-wise, up to f32 rounding.
    pub fn check_ef_invariant(cfg: &CompressorConfig, n: usize, steps: usize, seed: u64) {
        let mem = cfg.default_memory().build().unwrap();
        let mut pipe = Pipeline::new(cfg.build().unwrap(), mem);
        let mut rng = Rng::seed_from_u64(seed);
        let segs = [0..n / 3, n / 3..n];
        let ctx = Ctx {
            segments: &segs,
            bucket: 7,
            ..Ctx::default()
        };
        let mut e_old = vec![0f32; n];
        let mut payload = Payload::new();
        let mut sent_any = false;
        for step in 0..steps {
            let g = gaussian(&mut rng, n, 1e-2);
            pipe.compress(&g, &ctx, &mut rng, &mut payload).unwrap();
            let mut d = vec![0f32; n];
            pipe.decompress_add(payload.as_bytes(), &mut d).unwrap();
            sent_any |= d.iter().any(|&v| v != 0.0);
            let e_new = pipe.memory().export().remove(&7).expect("residual kept");
            for j in 0..n {
                let lhs = d[j] as f64 + e_new[j] as f64;
                let rhs = g[j] as f64 + e_old[j] as f64;
                let tol = 1e-6 * (rhs.abs() + d[j].abs() as f64) + 1e-12;
                assert!(
                    (lhs - rhs).abs() <= tol,
                    "{} step {step} j {j}: {lhs} vs {rhs}",
                    cfg.name()
                );
            }
            e_old = e_new;
        }
        assert!(sent_any, "{}: nothing was ever transmitted", cfg.name());
    }

    /// Feeds random, truncated, extended and bit-flipped versions of valid payloads to the
    /// decoder: it must never panic, and whatever it accepts must decode to finite values.
    pub fn fuzz_decoder(cfg: &CompressorConfig, seed: u64) {
        let mut c = cfg.build().unwrap();
        let mut rng = Rng::seed_from_u64(seed);
        let mut rejected = 0usize;
        let mut tried = 0usize;
        for &n in &[1usize, 2, 17, 300, 2500] {
            let mut x = gaussian(&mut rng, n, 1.0);
            x[0] = 5.0;
            let segs: Vec<std::ops::Range<usize>> = if n > 4 {
                vec![0..n / 4, n / 4..n]
            } else {
                vec![]
            };
            let (p, _) = round_trip(c.as_mut(), &x, &segs, &mut rng);
            let good = p.into_bytes();
            for t in 0..300 {
                let mut b = good.clone();
                match t % 5 {
                    0 => {
                        let cut = rng.below(b.len() as u64) as usize;
                        b.truncate(cut);
                    }
                    1 => {
                        let extra = 1 + rng.below(8) as usize;
                        b.extend((0..extra).map(|_| rng.next_u64() as u8));
                    }
                    2 => {
                        // Random body after a valid header and segment table.
                        let keep = 12 + if segs.len() > 1 { 4 * segs.len() } else { 0 };
                        b.truncate(keep);
                        let len = rng.below(64) as usize;
                        b.extend((0..len).map(|_| rng.next_u64() as u8));
                    }
                    _ => {
                        for _ in 0..1 + rng.below(4) {
                            let at = 12 + rng.below((b.len() - 12).max(1) as u64) as usize;
                            if at < b.len() {
                                b[at] ^= 1 << rng.below(8);
                            }
                        }
                        if rng.below(4) == 0 {
                            // Hit a count or length field with a huge value.
                            let at = 12 + rng.below((b.len() - 12).max(1) as u64) as usize;
                            for k in at..(at + 4).min(b.len()) {
                                b[k] = 0xFF;
                            }
                        }
                    }
                }
                let mut out = vec![0f32; n];
                tried += 1;
                match decompress(c.as_ref(), &b, &mut out) {
                    Ok(()) => assert!(
                        out.iter().all(|v| v.is_finite()),
                        "{}: accepted bytes decode to non-finite values",
                        cfg.name()
                    ),
                    Err(_) => rejected += 1,
                }
            }
            // Pure noise of every small length.
            for len in 0..40 {
                let b: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
                let mut out = vec![0f32; n];
                assert!(decompress(c.as_ref(), &b, &mut out).is_err());
            }
        }
        assert!(
            rejected * 4 > tried,
            "{}: only {rejected} of {tried} corrupted payloads rejected",
            cfg.name()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;
    use crate::compressor::{decompress, Ctx, HEADER_BITS};
    use crate::CompressorConfig;

    fn build(tau: f32) -> Threshold {
        ThresholdConfig {
            tau,
            ..ThresholdConfig::default()
        }
        .init()
        .unwrap()
    }

    #[test]
    fn sends_exactly_the_entries_at_or_beyond_tau_as_plus_minus_tau() {
        let mut rng = Rng::seed_from_u64(1);
        for &n in &[1usize, 5, 4095, 4096, 4097, 20_000] {
            let mut x = gaussian(&mut rng, n, 1.0);
            // Exact boundary values and signed zeros.
            x[0] = 0.5;
            if n > 3 {
                x[1] = -0.5;
                x[2] = -0.0;
                x[3] = f32::from_bits(0.5f32.to_bits() - 1);
            }
            let mut c = build(0.5);
            let (p, out) = round_trip(&mut c, &x, &[], &mut rng);
            let mut count = 0;
            for (j, (&v, &o)) in x.iter().zip(&out).enumerate() {
                if v >= 0.5 {
                    assert_eq!(o, 0.5, "j {j} v {v}");
                    count += 1;
                } else if v <= -0.5 {
                    assert_eq!(o, -0.5, "j {j} v {v}");
                    count += 1;
                } else {
                    assert_eq!(o, 0.0, "j {j} v {v}");
                }
            }
            assert!(count > 0);
            assert_eq!(
                p.encoded_len() as u64 * 8,
                HEADER_BITS + sign_words_bits(count),
                "n {n}"
            );
        }
    }

    #[test]
    fn encoded_length_with_segments_is_header_table_and_words() {
        let mut rng = Rng::seed_from_u64(2);
        let x = gaussian(&mut rng, 1000, 1.0);
        let mut c = build(1.0);
        let segs = [0..100, 100..1000];
        let (p, out) = round_trip(&mut c, &x, &segs, &mut rng);
        let count = out.iter().filter(|&&v| v != 0.0).count();
        let sent = x.iter().filter(|v| v.abs() >= 1.0).count();
        assert_eq!(count, sent);
        assert_eq!(
            p.encoded_len() as u64 * 8,
            HEADER_BITS + 64 + 2 * 32 + 32 * count as u64
        );
    }

    #[test]
    fn residual_after_a_step_follows_strom() {
        let cfg = CompressorConfig::Threshold(ThresholdConfig {
            tau: 0.02,
            ..ThresholdConfig::default()
        });
        let mut pipe =
            crate::Pipeline::new(cfg.build().unwrap(), cfg.default_memory().build().unwrap());
        let mut rng = Rng::seed_from_u64(3);
        let n = 5000;
        let mut e_old = vec![0f32; n];
        let mut p = crate::Payload::new();
        for _ in 0..5 {
            let g = gaussian(&mut rng, n, 1e-2);
            pipe.compress(&g, &Ctx::default(), &mut rng, &mut p)
                .unwrap();
            let e = pipe.memory().export().remove(&0).unwrap();
            for j in 0..n {
                let pj = g[j] + e_old[j];
                if pj.abs() >= 0.02 {
                    assert!((e[j].abs() - (pj.abs() - 0.02)).abs() <= 1e-7, "j {j}");
                    assert_eq!(e[j].signum(), pj.signum());
                } else {
                    assert!(e[j].abs() < 0.02);
                    assert_eq!(e[j], pj);
                }
            }
            e_old = e;
        }
    }

    #[test]
    fn ef_invariant() {
        check_ef_invariant(
            &CompressorConfig::Threshold(ThresholdConfig {
                tau: 0.015,
                ..ThresholdConfig::default()
            }),
            3000,
            6,
            4,
        );
    }

    #[test]
    fn config_is_validated() {
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let e = ThresholdConfig {
                tau: bad,
                ..ThresholdConfig::default()
            }
            .init()
            .err()
            .unwrap();
            assert_eq!(e.field, "tau");
        }
        let cfg: CompressorConfig = toml::from_str("kind = \"threshold\"\ntau = 0.25").unwrap();
        let rice: CompressorConfig =
            toml::from_str("kind = \"threshold\"\ncoding = \"golomb-rice\"").unwrap();
        let CompressorConfig::Threshold(r) = rice else {
            panic!("wrong variant")
        };
        assert_eq!(r.coding, IndexCoding::GolombRice);
        assert_eq!(
            cfg,
            CompressorConfig::Threshold(ThresholdConfig {
                tau: 0.25,
                ..ThresholdConfig::default()
            })
        );
    }

    #[test]
    fn decoder_rejects_malformed_sign_words() {
        let c = build(1.0);
        let body = |words: &[u32], count: u32| {
            let mut b = vec![0xD7, 1, ThresholdConfig::ID.0, 0];
            b.extend(4u32.to_le_bytes());
            b.extend(1u32.to_le_bytes());
            b.extend(count.to_le_bytes());
            for w in words {
                b.extend(w.to_le_bytes());
            }
            b
        };
        let mut out = [0f32; 4];
        decompress(&c, &body(&[1, 6], 2), &mut out).unwrap();
        assert_eq!(out, [-1.0, 0.0, 0.0, 1.0]);
        let mut out = [0f32; 4];
        assert!(matches!(
            decompress(&c, &body(&[8], 1), &mut out),
            Err(WireError::IndexOutOfRange { index: 4, len: 4 })
        ));
        assert!(decompress(&c, &body(&[6, 2], 2), &mut out).is_err());
        assert!(decompress(&c, &body(&[2, 3], 2), &mut out).is_err());
        assert!(decompress(&c, &body(&[2], 2), &mut out).is_err());
        assert!(decompress(&c, &body(&[0, 2, 4, 6, 7], 5), &mut out).is_err());
        assert!(decompress(&c, &body(&[2], u32::MAX), &mut out).is_err());
        assert!(decompress(&c, &body(&[2], 0), &mut out).is_err()); // trailing bytes
    }

    #[test]
    fn random_and_mutated_payloads_never_panic() {
        fuzz_decoder(
            &CompressorConfig::Threshold(ThresholdConfig {
                tau: 0.8,
                ..ThresholdConfig::default()
            }),
            5,
        );
    }

    fn rice(tau: f32) -> Threshold {
        ThresholdConfig {
            tau,
            coding: IndexCoding::GolombRice,
        }
        .init()
        .unwrap()
    }

    #[test]
    fn golomb_rice_decodes_to_the_same_vector_and_is_smaller() {
        let mut rng = Rng::seed_from_u64(12);
        for &n in &[1usize, 3, 100, 4097, 50_000] {
            let mut x = gaussian(&mut rng, n, 1.0);
            x[n - 1] = -3.0;
            for tau in [0.01f32, 1.0, 2.5758, 100.0] {
                let segs: Vec<std::ops::Range<usize>> = if n > 10 {
                    vec![0..n / 3, n / 3..n]
                } else {
                    vec![]
                };
                let (pw, ow) = round_trip(&mut build(tau), &x, &segs, &mut rng);
                let (pr, or) = round_trip(&mut rice(tau), &x, &segs, &mut rng);
                assert_eq!(ow, or, "n {n} tau {tau}");
                let count = ow.iter().filter(|&&v| v != 0.0).count();
                if tau == 2.5758 && n == 50_000 {
                    // ≈ 1 % density: about k + 3 ≈ 9.6 bits per entry instead of 32.
                    let per_entry = (pr.encoded_len() * 8) as f64 / count as f64;
                    assert!(per_entry < 12.0, "{per_entry} bits per entry");
                    assert!(pr.encoded_len() * 3 < pw.encoded_len());
                }
            }
        }
    }

    #[test]
    fn golomb_rice_decoder_is_bounded_by_its_bits() {
        let c = rice(1.0);
        let body = |count: u32, k: u8, stream: &[u8]| {
            let mut b = vec![0xD7, 1, ThresholdConfig::ID.0, 0];
            b.extend(8u32.to_le_bytes());
            b.extend(1u32.to_le_bytes());
            b.extend(count.to_le_bytes());
            b.push(k);
            b.extend((stream.len() as u32).to_le_bytes());
            b.extend(stream);
            b
        };
        let mut out = [0f32; 8];
        // k = 1: entry index 2 (d = 2: q = 1 → "01", low bit 0, sign 0), then index 3
        // (d = 0: "1", low 0, sign 1). LSB-first bits: 0,1,0,0, 1,0,1 → 0b0101_0010.
        decompress(&c, &body(2, 1, &[0b0101_0010]), &mut out).unwrap();
        assert_eq!(out, [0.0, 0.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0]);
        for bad in [
            body(1, 0, &[0, 0, 0, 0]),       // unary never ends
            body(1, 0, &[0b1000_0000]),      // index 7, no bit left for its sign
            body(1, 0, &[0, 0b1]),           // index 8 out of range
            body(2, 31, &[0xFF; 8]),         // 2 × 33 bits > 64 present
            body(1, 40, &[1]),               // k > 31
            body(1, 1, &[0b0000_0001, 0]),   // stream longer than its entry
            body(9, 0, &[0xFF, 0xFF, 0xFF]), // count > n
            body(1, 2, &[]),                 // empty stream
        ] {
            assert!(decompress(&c, &bad, &mut out).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn golomb_rice_random_and_mutated_payloads_never_panic() {
        fuzz_decoder(
            &CompressorConfig::Threshold(ThresholdConfig {
                tau: 0.8,
                coding: IndexCoding::GolombRice,
            }),
            13,
        );
    }

    #[test]
    fn segment_limit_is_31_bits_and_words_pack_index_and_sign() {
        let c = build(1.0);
        assert_eq!(c.max_segment_len(), 1 << 31);
        let mut words = Vec::new();
        collect_sign_words(&[0.0, -2.0, 1.0, -0.5, 3.0], 1.0, -1.0, &mut words);
        assert_eq!(words, [3, 4, 8]);
    }

    #[test]
    fn sign_words_are_every_element_beyond_the_thresholds_in_order() {
        // The blocked pass against the definition, at lengths around the block size, with
        // values on the thresholds and non-finite ones.
        let mut rng = Rng::seed_from_u64(5);
        let mut words = Vec::new();
        // Dense (half the entries beyond ±1) and sparse (about 2 %: most 16-element chunks
        // are skipped), with hits on chunk and block edges.
        for (n, spread) in [0, 1, 63, 64, 65, 127, 128, 1000, 4099]
            .into_iter()
            .flat_map(|n| [(n, 4.0f32), (n, 2.04)])
        {
            let mut x: Vec<f32> = (0..n).map(|_| (rng.next_f32() - 0.5) * spread).collect();
            let edges = [
                (3, 1.0),
                (15, -1.0),
                (16, 1.5),
                (70, -1.0),
                (2047, 1.0),
                (2048, -3.0),
            ];
            for (i, v) in edges.into_iter().chain([
                (200, f32::NAN),
                (500, f32::INFINITY),
                (n.max(1) - 1, f32::NAN),
            ]) {
                if i < n {
                    x[i] = v;
                }
            }
            let want: Vec<u32> = (0..n)
                .filter(|&i| x[i] >= 1.0 || x[i] <= -1.0)
                .map(|i| (i as u32) << 1 | (x[i] <= -1.0) as u32)
                .collect();
            let first_bad = x.iter().position(|v| !v.is_finite());
            // The dispatched pass (AVX-512 or AVX2 where the CPU has it), each vector pass
            // the CPU executes, and the portable one.
            let bad = collect_sign_words(&x, 1.0, -1.0, &mut words);
            assert_eq!(words, want, "n = {n}, spread {spread}");
            assert_eq!(bad, first_bad, "n = {n}");
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: checked on the line above.
                    let bad = unsafe { avx512::collect_sign_words(&x, 1.0, -1.0, &mut words) };
                    assert_eq!(words, want, "AVX-512, n = {n}, spread {spread}");
                    assert_eq!(bad, first_bad, "AVX-512, n = {n}");
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: checked on the line above.
                    let bad = unsafe { avx2::collect_sign_words(&x, 1.0, -1.0, &mut words) };
                    assert_eq!(words, want, "AVX2, n = {n}, spread {spread}");
                    assert_eq!(bad, first_bad, "AVX2, n = {n}");
                }
            }
            let bad = collect_sign_words_portable(&x, 1.0, -1.0, &mut words);
            assert_eq!(words, want, "portable, n = {n}, spread {spread}");
            assert_eq!(bad, first_bad, "portable, n = {n}");
            // Asymmetric thresholds (the AVX-512 pass hands them to the AVX2 one).
            let want: Vec<u32> = (0..n)
                .filter(|&i| x[i] >= 1.0 || x[i] <= -0.5)
                .map(|i| (i as u32) << 1 | (x[i] <= -0.5) as u32)
                .collect();
            let bad = collect_sign_words(&x, 1.0, -0.5, &mut words);
            assert_eq!(words, want, "asymmetric, n = {n}, spread {spread}");
            assert_eq!(bad, first_bad, "asymmetric, n = {n}");
        }
    }
}
