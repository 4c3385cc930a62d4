//! Exact selection of the `k` largest keys in O(n) average time.
//!
//! Used by Top-k, Dryden's adaptive threshold and exact-threshold gradient dropping. The
//! approach is the one that makes sparsifiers fast on CPUs: estimate a threshold from a
//! small deterministic sample, gather the (few) candidates above it in one branch-light
//! pass, then run an exact `select_nth_unstable` on the candidates only. The result is
//! identical to a full sort: the `k` largest keys, ties broken towards the smaller index,
//! returned in ascending index order.
//!
//! Keys are `u32` so that comparisons are integer comparisons: for a finite `f32`,
//! `(x.to_bits() & 0x7FFF_FFFF)` orders by `|x|`. A key of 0 marks an element that must
//! never be selected (see [`abs_key`]).

use crate::simd::vector_dispatch;

/// Order-preserving key of `|x|` for finite `x`, shifted by one so that 0 stays reserved
/// for "not a member".
#[inline(always)]
pub fn abs_key(x: f32) -> u32 {
    (x.to_bits() & 0x7FFF_FFFF) + 1
}

vector_dispatch! {
    // AVX2 at most: the AVX-512 copy measured 10 % slower (DGC 0.1 % on 4 M values).
    avx2_only;
    /// Writes into `out` (cleared first) the ascending indices of `x` whose magnitude key
    /// is at least `key` (the candidate gather of DGC, gradient dropping and Dryden's
    /// threshold).
    ///
    /// At the densities these methods run at (0.1–5 %), most 64-element chunks hold
    /// nothing: a vectorised "any" test skips them, and a chunk with a hit is gathered
    /// branch-free (every index written, the cursor advanced only on a hit).
    pub fn gather_at_least(x: &[f32], key: u32, out: &mut Vec<u32>) = gather_at_least_lanes;
}

#[inline(always)]
fn gather_at_least_lanes(x: &[f32], key: u32, out: &mut Vec<u32>) {
    out.clear();
    let mut buf = [0u32; 64];
    for (b, chunk) in x.chunks(64).enumerate() {
        if !chunk
            .iter()
            .fold(false, |any, &v| any | (abs_key(v) >= key))
        {
            continue;
        }
        let base = (b * 64) as u32;
        let mut m = 0usize;
        for (j, &v) in chunk.iter().enumerate() {
            // m <= j < 64: the mask only spares the bounds check.
            buf[m & 63] = base + j as u32;
            m += (abs_key(v) >= key) as usize;
        }
        out.extend_from_slice(&buf[..m]);
    }
}

/// Reusable buffers for [`top_k`].
#[derive(Debug, Default, Clone)]
pub struct Scratch {
    cand: Vec<u32>,
    keys: Vec<u32>,
    sample: Vec<u32>,
}

const SAMPLE: usize = 2048;

/// Writes into `out` (cleared first) the ascending indices of the `k` elements of
/// `0..len` with the largest non-zero `key(i)`, ties broken by smaller index.
///
/// If fewer than `k` elements have a non-zero key, all of them are returned.
pub fn top_k(
    len: usize,
    k: usize,
    key: impl Fn(usize) -> u32,
    s: &mut Scratch,
    out: &mut Vec<u32>,
) {
    out.clear();
    if k == 0 || len == 0 {
        return;
    }
    let t = threshold_estimate(len, k, &key, s);
    candidates(len, &key, t, k, s);
    finish(k, s, out);
}

/// [`top_k`] of `keys[i]` (keys computed beforehand): the same indices, with the keys of a
/// block compared side by side (vectorised) in the candidate pass.
pub fn top_k_keys(keys: &[u32], k: usize, s: &mut Scratch, out: &mut Vec<u32>) {
    out.clear();
    if k == 0 || keys.is_empty() {
        return;
    }
    let t = threshold_estimate(keys.len(), k, |i| keys[i], s);
    s.cand.clear();
    s.keys.clear();
    let full = keys.len() - keys.len() % BLOCK;
    blocks::gather_keys(&keys[..full], t, s);
    gather_block(full, &keys[full..], t, s);
    if s.cand.len() < k && t > 1 {
        candidates(keys.len(), |i| keys[i], (t / 2).max(1), k, s);
    }
    finish(k, s, out);
}

/// [`top_k`] of `abs_key(x[i])`, the largest magnitudes of `x`: the same indices, with the
/// keys of a block of elements computed side by side (vectorised) in the candidate pass.
pub fn top_k_abs(x: &[f32], k: usize, s: &mut Scratch, out: &mut Vec<u32>) {
    out.clear();
    if k == 0 || x.is_empty() {
        return;
    }
    let t = threshold_estimate(x.len(), k, |i| abs_key(x[i]), s);
    s.cand.clear();
    s.keys.clear();
    let full = x.len() - x.len() % BLOCK;
    blocks::gather_abs(&x[..full], t, s);
    let mut keys = [0u32; BLOCK];
    let tail = &x[full..];
    for (key, &v) in keys.iter_mut().zip(tail) {
        *key = abs_key(v);
    }
    gather_block(full, &keys[..tail.len()], t, s);
    if s.cand.len() < k && t > 1 {
        candidates(x.len(), |i| abs_key(x[i]), (t / 2).max(1), k, s);
    }
    finish(k, s, out);
}

/// `e += g` element by element, then [`top_k`] of `abs_key(e[i])` into `out` — in one pass
/// over the two buffers where the threshold estimate holds (the selection's candidate pass
/// reads each sum as it is stored). The same indices as the two steps one after the other.
///
/// # Panics
/// If `e` and `g` differ in length.
pub fn top_k_accumulate(e: &mut [f32], g: &[f32], k: usize, s: &mut Scratch, out: &mut Vec<u32>) {
    assert_eq!(
        e.len(),
        g.len(),
        "top_k_accumulate: buffers of different lengths"
    );
    out.clear();
    let len = e.len();
    if k == 0 || len == 0 {
        for (e, &g) in e.iter_mut().zip(g) {
            *e += g;
        }
        return;
    }
    let t = threshold_estimate(len, k, |i| abs_key(e[i] + g[i]), s);
    s.cand.clear();
    s.keys.clear();
    let full = len - len % BLOCK;
    let (eh, et) = e.split_at_mut(full);
    blocks::gather_accumulate(eh, &g[..full], t, s);
    let mut keys = [0u32; BLOCK];
    for ((key, e), &g) in keys.iter_mut().zip(et.iter_mut()).zip(&g[full..]) {
        *e += g;
        *key = abs_key(*e);
    }
    gather_block(full, &keys[..et.len()], t, s);
    if s.cand.len() < k && t > 1 {
        // Under-estimated: the sums are stored, so the retries read them alone.
        candidates(len, |i| abs_key(e[i]), (t / 2).max(1), k, s);
    }
    finish(k, s, out);
}

/// Elements per block of the vectorised candidate passes (one `u64` mask).
const BLOCK: usize = 64;

/// Appends the elements of a block (starting at `base`, with these keys) whose key reaches
/// `t` to the candidates, with their keys: a branch-free mask, then its few set bits (the
/// partial last block; whole blocks go through [`blocks`]).
#[inline(always)]
fn gather_block(base: usize, keys: &[u32], t: u32, s: &mut Scratch) {
    let mut mask = 0u64;
    for (j, &key) in keys.iter().enumerate() {
        mask |= u64::from(key >= t) << j;
    }
    push_hits(base, mask, |j| keys[j], s);
}

/// The set bits `j` of `mask` as candidates `base + j`, with their keys `key(j)`.
#[inline(always)]
fn push_hits(base: usize, mut mask: u64, key: impl Fn(usize) -> u32, s: &mut Scratch) {
    while mask != 0 {
        let j = mask.trailing_zeros() as usize;
        mask &= mask - 1;
        s.cand.push((base + j) as u32);
        s.keys.push(key(j));
    }
}

/// The candidate passes over whole 64-element blocks, one mask per block and then its few
/// set bits. The mask is the part that costs: written as a loop of shifted comparisons
/// (above), the compiler builds it from 64-bit variable shifts, several instructions per
/// element; here it is a compare and a move-mask per vector (x86-64: SSE2, AVX2, or
/// AVX-512's compare into a mask register, the widest the CPU has). Every copy gives the
/// same candidates (and, accumulating, the same sums: one IEEE addition per element,
/// whatever the width), held by a test per tier.
mod blocks {
    use super::{abs_key, push_hits, Scratch, BLOCK};

    /// Appends the indices (offset by nothing: `x` starts a buffer) and keys of the
    /// elements of `x` whose [`abs_key`] reaches `t` to `s.cand` / `s.keys`, in order.
    /// `x.len()` is a multiple of [`BLOCK`].
    pub(super) fn gather_abs(x: &[f32], t: u32, s: &mut Scratch) {
        debug_assert_eq!(x.len() % BLOCK, 0);
        #[cfg(target_arch = "x86_64")]
        x86::gather_abs(x, t, s);
        #[cfg(not(target_arch = "x86_64"))]
        pass_abs(x, s, |b| portable_mask(b, t));
    }

    /// `e += g` element by element, with [`gather_abs`] of the sums as they are stored.
    /// The lengths are equal multiples of [`BLOCK`].
    pub(super) fn gather_accumulate(e: &mut [f32], g: &[f32], t: u32, s: &mut Scratch) {
        debug_assert!(e.len() == g.len() && e.len().is_multiple_of(BLOCK));
        #[cfg(target_arch = "x86_64")]
        x86::gather_accumulate(e, g, t, s);
        #[cfg(not(target_arch = "x86_64"))]
        pass_accumulate(e, g, s, |e, g| {
            for (e, &g) in e.iter_mut().zip(g) {
                *e += g;
            }
            portable_mask(e, t)
        });
    }

    /// Appends the indices and keys of the members of `keys` that reach `t` (at least 1)
    /// to `s.cand` / `s.keys`, in order. `keys.len()` is a multiple of [`BLOCK`].
    pub(super) fn gather_keys(keys: &[u32], t: u32, s: &mut Scratch) {
        debug_assert!(t >= 1 && keys.len().is_multiple_of(BLOCK));
        #[cfg(target_arch = "x86_64")]
        x86::gather_keys(keys, t, s);
        #[cfg(not(target_arch = "x86_64"))]
        pass_keys(keys, s, |b| portable_key_mask(b, t));
    }

    /// [`portable_mask`] of precomputed keys.
    #[cfg_attr(all(target_arch = "x86_64", not(test)), allow(dead_code))]
    #[inline(always)]
    pub(super) fn portable_key_mask(b: &[u32; BLOCK], t: u32) -> u64 {
        let mut mask = 0u64;
        for (j, &key) in b.iter().enumerate() {
            mask |= u64::from(key >= t) << j;
        }
        mask
    }

    /// The loop of [`gather_keys`] with a block mask.
    #[inline(always)]
    pub(super) fn pass_keys(keys: &[u32], s: &mut Scratch, mask: impl Fn(&[u32; BLOCK]) -> u64) {
        for (i, b) in keys.chunks_exact(BLOCK).enumerate() {
            let b: &[u32; BLOCK] = b.try_into().expect("a whole block");
            push_hits(i * BLOCK, mask(b), |j| b[j], s);
        }
    }

    /// The block's mask as the partial block's loop builds it (the reference of the tests;
    /// the path off x86-64).
    #[cfg_attr(all(target_arch = "x86_64", not(test)), allow(dead_code))]
    #[inline(always)]
    pub(super) fn portable_mask(b: &[f32; BLOCK], t: u32) -> u64 {
        let mut mask = 0u64;
        for (j, &v) in b.iter().enumerate() {
            mask |= u64::from(abs_key(v) >= t) << j;
        }
        mask
    }

    /// The loop of [`gather_abs`] with a block mask.
    #[inline(always)]
    pub(super) fn pass_abs(x: &[f32], s: &mut Scratch, mask: impl Fn(&[f32; BLOCK]) -> u64) {
        for (i, b) in x.chunks_exact(BLOCK).enumerate() {
            let b: &[f32; BLOCK] = b.try_into().expect("a whole block");
            push_hits(i * BLOCK, mask(b), |j| abs_key(b[j]), s);
        }
    }

    /// The loop of [`gather_accumulate`] with a block step that adds `g` into `e` and
    /// returns the mask of the sums.
    #[inline(always)]
    pub(super) fn pass_accumulate(
        e: &mut [f32],
        g: &[f32],
        s: &mut Scratch,
        add_mask: impl Fn(&mut [f32; BLOCK], &[f32; BLOCK]) -> u64,
    ) {
        for (i, (eb, gb)) in e
            .chunks_exact_mut(BLOCK)
            .zip(g.chunks_exact(BLOCK))
            .enumerate()
        {
            let eb: &mut [f32; BLOCK] = eb.try_into().expect("a whole block");
            let gb: &[f32; BLOCK] = gb.try_into().expect("a whole block");
            let mask = add_mask(eb, gb);
            push_hits(i * BLOCK, mask, |j| abs_key(eb[j]), s);
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        use super::{pass_abs, pass_accumulate, pass_keys, Scratch, BLOCK};
        use crate::simd::{widest, Tier};

        /// The signed bound `lim` with `(bits & 0x7FFF_FFFF) > lim` exactly when
        /// `abs_key >= t` (`abs_key` is the magnitude bits plus one, so `≥ t` is `> t − 2`;
        /// magnitude bits are non-negative as `i32`, and `t ≥ 1`).
        fn bound(t: u32) -> i32 {
            if t > 0x8000_0000 {
                // Above every key.
                i32::MAX
            } else {
                (t as i32).wrapping_sub(2)
            }
        }

        pub(super) fn gather_abs(x: &[f32], t: u32, s: &mut Scratch) {
            let lim = bound(t);
            match widest() {
                // SAFETY: `widest` names AVX-512 only when the CPU executes it.
                Tier::Avx512 => unsafe { abs_avx512(x, lim, s) },
                // SAFETY: `widest` names AVX2 only when the CPU executes it.
                Tier::Avx2 => unsafe { abs_avx2(x, lim, s) },
                Tier::Sse2 => abs_sse2(x, lim, s),
            }
        }

        pub(super) fn gather_accumulate(e: &mut [f32], g: &[f32], t: u32, s: &mut Scratch) {
            let lim = bound(t);
            match widest() {
                // SAFETY: `widest` names AVX-512 only when the CPU executes it.
                Tier::Avx512 => unsafe { acc_avx512(e, g, lim, s) },
                // SAFETY: `widest` names AVX2 only when the CPU executes it.
                Tier::Avx2 => unsafe { acc_avx2(e, g, lim, s) },
                Tier::Sse2 => acc_sse2(e, g, lim, s),
            }
        }

        pub(super) fn gather_keys(keys: &[u32], t: u32, s: &mut Scratch) {
            match widest() {
                // SAFETY: `widest` names AVX-512 only when the CPU executes it.
                Tier::Avx512 => unsafe { keys_avx512(keys, t, s) },
                // SAFETY: `widest` names AVX2 only when the CPU executes it.
                Tier::Avx2 => unsafe { keys_avx2(keys, t, s) },
                Tier::Sse2 => keys_sse2(keys, t, s),
            }
        }

        /// `key ≥ t` for `t ≥ 1` as a signed comparison: both sides with the top bit
        /// flipped (which orders `u32`s as `i32`s), against `t − 1` with `>`.
        fn key_bound(t: u32) -> (i32, i32) {
            (i32::MIN, ((t - 1) ^ 0x8000_0000) as i32)
        }

        fn keys_sse2(keys: &[u32], t: u32, s: &mut Scratch) {
            let (flip, lim) = key_bound(t);
            // SAFETY: SSE2 is part of x86-64; each load reads 4 keys at 4·i < 64.
            unsafe {
                let (flip, lim) = (_mm_set1_epi32(flip), _mm_set1_epi32(lim));
                pass_keys(keys, s, |b| {
                    let mut m = 0u64;
                    for i in 0..BLOCK / 4 {
                        let v = _mm_loadu_si128(b.as_ptr().add(4 * i).cast());
                        let c = _mm_cmpgt_epi32(_mm_xor_si128(v, flip), lim);
                        m |= (_mm_movemask_ps(_mm_castsi128_ps(c)) as u64) << (4 * i);
                    }
                    m
                })
            }
        }

        #[target_feature(enable = "avx2")]
        unsafe fn keys_avx2(keys: &[u32], t: u32, s: &mut Scratch) {
            let (flip, lim) = key_bound(t);
            // SAFETY: AVX2 is enabled; each load reads 8 keys at 8·i < 64.
            unsafe {
                let (flip, lim) = (_mm256_set1_epi32(flip), _mm256_set1_epi32(lim));
                pass_keys(keys, s, |b| {
                    let mut m = 0u64;
                    for i in 0..BLOCK / 8 {
                        let v = _mm256_loadu_si256(b.as_ptr().add(8 * i).cast());
                        let c = _mm256_cmpgt_epi32(_mm256_xor_si256(v, flip), lim);
                        m |= (_mm256_movemask_ps(_mm256_castsi256_ps(c)) as u32 as u64) << (8 * i);
                    }
                    m
                })
            }
        }

        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
        unsafe fn keys_avx512(keys: &[u32], t: u32, s: &mut Scratch) {
            // SAFETY: AVX-512F is enabled; each load reads 16 keys at 16·i < 64.
            unsafe {
                let t = _mm512_set1_epi32(t as i32);
                pass_keys(keys, s, |b| {
                    let mut m = 0u64;
                    for i in 0..BLOCK / 16 {
                        let v = _mm512_loadu_si512(b.as_ptr().add(16 * i).cast());
                        m |= (_mm512_cmpge_epu32_mask(v, t) as u64) << (16 * i);
                    }
                    m
                })
            }
        }

        // Each step: four (SSE2), eight (AVX2) or sixteen (AVX-512) elements loaded as
        // integers, the sign bit masked off, compared (signed) with `lim`, the comparison
        // turned into that many mask bits at the step's offset. The loads and stores are
        // unaligned and stay inside the 64-element block the references give.

        fn abs_sse2(x: &[f32], lim: i32, s: &mut Scratch) {
            // SAFETY: SSE2 is part of x86-64; each load reads 4 floats at 4·i < 64.
            unsafe {
                let (mag, lim) = (_mm_set1_epi32(0x7FFF_FFFF), _mm_set1_epi32(lim));
                pass_abs(x, s, |b| {
                    let mut m = 0u64;
                    for i in 0..BLOCK / 4 {
                        let v = _mm_loadu_si128(b.as_ptr().add(4 * i).cast());
                        let c = _mm_cmpgt_epi32(_mm_and_si128(v, mag), lim);
                        m |= (_mm_movemask_ps(_mm_castsi128_ps(c)) as u64) << (4 * i);
                    }
                    m
                })
            }
        }

        fn acc_sse2(e: &mut [f32], g: &[f32], lim: i32, s: &mut Scratch) {
            // SAFETY: as in `abs_sse2`, for the loads of `e` and `g` and the store to `e`.
            unsafe {
                let (mag, lim) = (_mm_set1_epi32(0x7FFF_FFFF), _mm_set1_epi32(lim));
                pass_accumulate(e, g, s, |eb, gb| {
                    let mut m = 0u64;
                    for i in 0..BLOCK / 4 {
                        let pe = eb.as_mut_ptr().add(4 * i);
                        let v = _mm_add_ps(_mm_loadu_ps(pe), _mm_loadu_ps(gb.as_ptr().add(4 * i)));
                        _mm_storeu_ps(pe, v);
                        let c = _mm_cmpgt_epi32(_mm_and_si128(_mm_castps_si128(v), mag), lim);
                        m |= (_mm_movemask_ps(_mm_castsi128_ps(c)) as u64) << (4 * i);
                    }
                    m
                })
            }
        }

        #[target_feature(enable = "avx2")]
        unsafe fn abs_avx2(x: &[f32], lim: i32, s: &mut Scratch) {
            // SAFETY: AVX2 is enabled; each load reads 8 floats at 8·i < 64.
            unsafe {
                let (mag, lim) = (_mm256_set1_epi32(0x7FFF_FFFF), _mm256_set1_epi32(lim));
                pass_abs(x, s, |b| {
                    let mut m = 0u64;
                    for i in 0..BLOCK / 8 {
                        let v = _mm256_loadu_si256(b.as_ptr().add(8 * i).cast());
                        let c = _mm256_cmpgt_epi32(_mm256_and_si256(v, mag), lim);
                        m |= (_mm256_movemask_ps(_mm256_castsi256_ps(c)) as u32 as u64) << (8 * i);
                    }
                    m
                })
            }
        }

        #[target_feature(enable = "avx2")]
        unsafe fn acc_avx2(e: &mut [f32], g: &[f32], lim: i32, s: &mut Scratch) {
            // SAFETY: as in `abs_avx2`, for the loads of `e` and `g` and the store to `e`.
            unsafe {
                let (mag, lim) = (_mm256_set1_epi32(0x7FFF_FFFF), _mm256_set1_epi32(lim));
                pass_accumulate(e, g, s, |eb, gb| {
                    let mut m = 0u64;
                    for i in 0..BLOCK / 8 {
                        let pe = eb.as_mut_ptr().add(8 * i);
                        let v = _mm256_add_ps(
                            _mm256_loadu_ps(pe),
                            _mm256_loadu_ps(gb.as_ptr().add(8 * i)),
                        );
                        _mm256_storeu_ps(pe, v);
                        let c =
                            _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), mag), lim);
                        m |= (_mm256_movemask_ps(_mm256_castsi256_ps(c)) as u32 as u64) << (8 * i);
                    }
                    m
                })
            }
        }

        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
        unsafe fn abs_avx512(x: &[f32], lim: i32, s: &mut Scratch) {
            // SAFETY: AVX-512F is enabled; each load reads 16 floats at 16·i < 64.
            unsafe {
                let (mag, lim) = (_mm512_set1_epi32(0x7FFF_FFFF), _mm512_set1_epi32(lim));
                pass_abs(x, s, |b| {
                    let mut m = 0u64;
                    for i in 0..BLOCK / 16 {
                        let v = _mm512_loadu_si512(b.as_ptr().add(16 * i).cast());
                        let k = _mm512_cmpgt_epi32_mask(_mm512_and_si512(v, mag), lim);
                        m |= (k as u64) << (16 * i);
                    }
                    m
                })
            }
        }

        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
        unsafe fn acc_avx512(e: &mut [f32], g: &[f32], lim: i32, s: &mut Scratch) {
            // SAFETY: as in `abs_avx512`, for the loads of `e` and `g` and the store to `e`.
            unsafe {
                let (mag, lim) = (_mm512_set1_epi32(0x7FFF_FFFF), _mm512_set1_epi32(lim));
                pass_accumulate(e, g, s, |eb, gb| {
                    let mut m = 0u64;
                    for i in 0..BLOCK / 16 {
                        let pe = eb.as_mut_ptr().add(16 * i);
                        let v = _mm512_add_ps(
                            _mm512_loadu_ps(pe),
                            _mm512_loadu_ps(gb.as_ptr().add(16 * i)),
                        );
                        _mm512_storeu_ps(pe, v);
                        let c = _mm512_and_si512(_mm512_castps_si512(v), mag);
                        m |= (_mm512_cmpgt_epi32_mask(c, lim) as u64) << (16 * i);
                    }
                    m
                })
            }
        }
    }
}

/// A threshold that about 1.5k keys reach, from a strided sample with a fixed odd step
/// (deterministic); 1 (every member) for short buffers or large `k`.
fn threshold_estimate(len: usize, k: usize, key: impl Fn(usize) -> u32, s: &mut Scratch) -> u32 {
    if !(len > 4 * SAMPLE && k < len / 4) {
        return 1;
    }
    s.sample.clear();
    let step = len / SAMPLE;
    for j in 0..SAMPLE {
        // Spread the sample point inside each stride to avoid aliasing with layer
        // structure (multiplicative hash of j).
        let off = (j.wrapping_mul(0x9E37_79B1) >> 7) % step;
        s.sample.push(key(j * step + off));
    }
    // Expected candidates above sample rank r: r/SAMPLE·len. Aim for ~1.5k + slack.
    let want = ((k as f64 * 1.5 / len as f64) * SAMPLE as f64).ceil() as usize + 8;
    if want >= SAMPLE {
        return 1;
    }
    s.sample.select_nth_unstable_by(want, |a, b| b.cmp(a));
    s.sample[want].max(1)
}

/// The indices whose key reaches `t` into `s.cand` and their keys into `s.keys`, `t` halved
/// and the pass repeated until there are at least `k` of them or `t` is 1 (every member).
fn candidates(len: usize, key: impl Fn(usize) -> u32, mut t: u32, k: usize, s: &mut Scratch) {
    loop {
        s.cand.clear();
        s.keys.clear();
        for i in 0..len {
            let v = key(i);
            if v >= t {
                s.cand.push(i as u32);
                s.keys.push(v);
            }
        }
        if s.cand.len() >= k || t == 1 {
            return;
        }
        // Under-estimated: retry from a threshold at most half as large.
        t = (t / 2).max(1);
    }
}

/// The `k` largest keys among the candidates (`s.cand`, ascending, with their keys in
/// `s.keys`) into `out`, ascending.
fn finish(k: usize, s: &mut Scratch, out: &mut Vec<u32>) {
    if s.cand.len() <= k {
        out.extend_from_slice(&s.cand);
        return;
    }
    // Exact k-th largest key among the candidates (on a copy: the keys stay in index order).
    s.sample.clear();
    s.sample.extend_from_slice(&s.keys);
    let (_, &mut kth, _) = s.sample.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    let above = s.keys.iter().filter(|&&x| x > kth).count();
    let mut ties = k - above;
    out.reserve(k);
    for (&i, &kv) in s.cand.iter().zip(&s.keys) {
        if kv > kth {
            out.push(i);
        } else if kv == kth && ties > 0 {
            out.push(i);
            ties -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn brute(v: &[u32], k: usize) -> Vec<u32> {
        let mut idx: Vec<u32> = (0..v.len() as u32).filter(|&i| v[i as usize] > 0).collect();
        idx.sort_by(|&a, &b| v[b as usize].cmp(&v[a as usize]).then(a.cmp(&b)));
        idx.truncate(k);
        idx.sort();
        idx
    }

    #[test]
    fn every_vector_tier_gathers_the_same_indices() {
        let mut rng = Rng::seed_from_u64(13);
        for n in [0usize, 1, 63, 64, 65, 1000, 4099] {
            let x: Vec<f32> = (0..n).map(|_| rng.next_f32() - 0.5).collect();
            for key in [1, abs_key(0.45), abs_key(0.499), u32::MAX] {
                crate::simd::assert_same_on_every_tier("gather", || {
                    let mut out = Vec::new();
                    gather_at_least(&x, key, &mut out);
                    out
                });
            }
        }
    }

    /// Every tier's block passes give the candidates (indices and keys) and sums of the
    /// portable mask's loop, at thresholds from "every element" to "none", on inputs with
    /// both zeros, subnormals, infinities and NaNs (as keys order them: above every finite).
    #[test]
    fn block_passes_are_the_portable_mask_on_every_tier() {
        let mut rng = Rng::seed_from_u64(17);
        let mut x: Vec<f32> = (0..BLOCK * 40)
            .map(|_| rng.next_f32() * 2.0 - 1.0)
            .collect();
        let specials = [
            0.0,
            -0.0,
            f32::MIN_POSITIVE / 4.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7FFF_FFFF),
            f32::MAX,
        ];
        for (j, v) in specials.iter().enumerate() {
            x[j * 67 + 5] = *v;
        }
        let g: Vec<f32> = (0..x.len()).map(|_| rng.next_f32() - 0.5).collect();
        let thresholds = [
            1,
            2,
            abs_key(0.5),
            abs_key(0.999),
            abs_key(f32::MAX),
            abs_key(f32::INFINITY),
            0x8000_0000,
            0x8000_0001,
            u32::MAX,
        ];
        for t in thresholds {
            let mut want = Scratch::default();
            blocks::pass_abs(&x, &mut want, |b| blocks::portable_mask(b, t));
            crate::simd::assert_same_on_every_tier("abs", || {
                let mut s = Scratch::default();
                blocks::gather_abs(&x, t, &mut s);
                assert_eq!((&s.cand, &s.keys), (&want.cand, &want.keys), "t {t:#x}");
                s.cand
            });
            let mut e_want = x.clone();
            let mut want = Scratch::default();
            blocks::pass_accumulate(&mut e_want, &g, &mut want, |e, g| {
                for (e, &g) in e.iter_mut().zip(g) {
                    *e += g;
                }
                blocks::portable_mask(e, t)
            });
            crate::simd::assert_same_on_every_tier("accumulate", || {
                let mut s = Scratch::default();
                let mut e = x.clone();
                blocks::gather_accumulate(&mut e, &g, t, &mut s);
                assert_eq!((&s.cand, &s.keys), (&want.cand, &want.keys), "t {t:#x}");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&e), bits(&e_want), "t {t:#x}: the stored sums");
                s.cand
            });
        }
    }

    /// The keyed block pass is the portable mask's loop on every tier, for thresholds
    /// across the whole `u32` range (the SSE2 / AVX2 copies compare with the top bit
    /// flipped), and `top_k_keys` is `top_k` of the same keys.
    #[test]
    fn keyed_passes_are_the_portable_mask_on_every_tier() {
        let mut rng = Rng::seed_from_u64(19);
        let mut keys: Vec<u32> = (0..BLOCK * 30).map(|_| rng.next_u64() as u32).collect();
        for (j, v) in [0, 1, 2, 0x7FFF_FFFF, 0x8000_0000, 0x8000_0001, u32::MAX]
            .iter()
            .enumerate()
        {
            keys[j * 131 + 7] = *v;
        }
        for t in [
            1,
            2,
            0x7FFF_FFFF,
            0x8000_0000,
            0x8000_0001,
            0xC000_0000,
            u32::MAX,
        ] {
            let mut want = Scratch::default();
            blocks::pass_keys(&keys, &mut want, |b| blocks::portable_key_mask(b, t));
            crate::simd::assert_same_on_every_tier("keys", || {
                let mut s = Scratch::default();
                blocks::gather_keys(&keys, t, &mut s);
                assert_eq!((&s.cand, &s.keys), (&want.cand, &want.keys), "t {t:#x}");
                s.cand
            });
        }
        let mut s = Scratch::default();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for &len in &[0usize, 1, 63, 64, 65, 9000, 40_001] {
            for &k in &[0usize, 1, len / 100 + 1, len / 7, len] {
                // Few distinct keys (ties), zeros (never members) among them.
                let v: Vec<u32> = (0..len)
                    .map(|_| rng.below(200) as u32 * 0x0100_0001)
                    .collect();
                top_k_keys(&v, k, &mut s, &mut a);
                top_k(len, k, |i| v[i], &mut s, &mut b);
                assert_eq!(a, b, "len {len} k {k}");
                assert_eq!(a, brute(&v, k), "len {len} k {k}");
            }
        }
    }

    #[test]
    fn gather_at_least_is_the_filter_at_every_density_and_tail() {
        let mut rng = Rng::seed_from_u64(11);
        let mut out = vec![7u32; 3];
        for &len in &[0usize, 1, 63, 64, 65, 127, 128, 1000, 4099] {
            let x: Vec<f32> = (0..len).map(|_| rng.next_f32() * 2.0 - 1.0).collect();
            // From every element kept to none; 0.999 keeps ~0.1 %, the DGC regime.
            for cut in [0.0f32, 0.5, 0.9, 0.999, 1.0] {
                let key = abs_key(cut);
                gather_at_least(&x, key, &mut out);
                let want: Vec<u32> = (0..len as u32)
                    .filter(|&i| abs_key(x[i as usize]) >= key)
                    .collect();
                assert_eq!(out, want, "len {len}, cut {cut}");
            }
            if len > 0 {
                // Hits only in the last, partial chunk and at chunk edges.
                let mut y = vec![0.0f32; len];
                for i in [0, 63.min(len - 1), 64.min(len - 1), len - 1] {
                    y[i] = -3.0;
                }
                y[len / 2] = 2.0; // exactly at the key: kept
                gather_at_least(&y, abs_key(2.0), &mut out);
                let want: Vec<u32> = (0..len as u32).filter(|&i| y[i as usize] != 0.0).collect();
                assert_eq!(out, want, "edges, len {len}");
            }
        }
    }

    #[test]
    fn matches_brute_force() {
        let mut rng = Rng::seed_from_u64(3);
        let mut s = Scratch::default();
        let mut out = Vec::new();
        for &len in &[1usize, 2, 7, 100, 5000, 40_000] {
            for &k in &[0usize, 1, 3, len / 100 + 1, len / 3, len] {
                for distinct in [4u64, 1 << 20] {
                    let v: Vec<u32> = (0..len).map(|_| rng.below(distinct) as u32).collect();
                    top_k(len, k, |i| v[i], &mut s, &mut out);
                    assert_eq!(out, brute(&v, k), "len {len} k {k} distinct {distinct}");
                }
            }
        }
    }

    #[test]
    fn by_magnitude_matches_the_keyed_selection() {
        let mut rng = Rng::seed_from_u64(9);
        let mut s = Scratch::default();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for &len in &[0usize, 1, 63, 64, 65, 9000, 40_001] {
            for &k in &[0usize, 1, len / 100 + 1, len / 3, len] {
                // Few distinct magnitudes (ties) and both signs.
                let x: Vec<f32> = (0..len)
                    .map(|_| (rng.below(64) as f32 - 32.0) * 0.125)
                    .collect();
                top_k_abs(&x, k, &mut s, &mut a);
                top_k(len, k, |i| abs_key(x[i]), &mut s, &mut b);
                assert_eq!(a, b, "len {len} k {k}");
                let brute_b = brute(&x.iter().map(|&v| abs_key(v)).collect::<Vec<_>>(), k);
                assert_eq!(a, brute_b, "len {len} k {k}");
            }
        }
    }

    #[test]
    fn accumulating_selects_what_adding_then_selecting_does() {
        let mut rng = Rng::seed_from_u64(5);
        let mut s = Scratch::default();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for &len in &[0usize, 1, 9, 5000, 40_000] {
            for &k in &[0usize, 1, len / 100 + 1, len / 3, len] {
                let g: Vec<f32> = (0..len).map(|_| rng.next_f32() - 0.5).collect();
                // A residual that hides large values where the sample never looks too.
                let e0: Vec<f32> = (0..len)
                    .map(|i| {
                        if i % 97 == 3 {
                            50.0
                        } else {
                            rng.next_f32() - 0.5
                        }
                    })
                    .collect();
                let mut e = e0.clone();
                top_k_accumulate(&mut e, &g, k, &mut s, &mut a);
                let sum: Vec<f32> = e0.iter().zip(&g).map(|(e, g)| e + g).collect();
                assert_eq!(e, sum, "len {len} k {k}: the sums are stored");
                top_k(len, k, |i| abs_key(sum[i]), &mut s, &mut b);
                assert_eq!(a, b, "len {len} k {k}");
            }
        }
        // Large values at the first sample points only: the estimate is too high, the
        // fused pass finds fewer than k and the retry reads the stored sums.
        let (len, k) = (40_000usize, 401);
        let step = len / SAMPLE;
        let mut e: Vec<f32> = (0..len).map(|i| (i % 13) as f32 * 1e-3).collect();
        for j in 0..60 {
            e[j * step + (j.wrapping_mul(0x9E37_79B1) >> 7) % step] = 50.0 + j as f32;
        }
        let g = vec![1e-4f32; len];
        let sum: Vec<f32> = e.iter().zip(&g).map(|(e, g)| e + g).collect();
        top_k_accumulate(&mut e, &g, k, &mut s, &mut a);
        top_k(len, k, |i| abs_key(sum[i]), &mut s, &mut b);
        assert_eq!((a.len(), &a), (k, &b));
    }

    #[test]
    fn adversarial_sample_miss() {
        // Large values hidden where the strided sample never looks: estimate too high.
        let len = 100_000;
        let mut v = vec![1u32; len];
        for i in (0..len).step_by(97) {
            v[i] = 1000 + i as u32;
        }
        let mut s = Scratch::default();
        let mut out = Vec::new();
        top_k(len, 2000, |i| v[i], &mut s, &mut out);
        assert_eq!(out, brute(&v, 2000));
    }
}
