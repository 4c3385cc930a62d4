//! Which elements of a decode buffer the decodes added to, so that the mean of gathered
//! payloads ([`crate::compressor::decompress_mean`]) scales those alone.
//!
//! A sparsifier's payload adds at its listed indices only: after a zero fill and the P
//! decodes, every other element is still `+0.0`, which the mean's `·1/P` would leave as it
//! is. On the 4.2 M-parameter MLP with top-k 1 % on two workers, the full scaling pass was
//! about a third of the in-step decompression in an instrumented run (1.9 of 5.2 ms, the
//! bucket no longer in cache after the step's other passes); a bitmap of the touched
//! elements (one bit each, 0.5 MB for that bucket) is cleared, marked and scanned in
//! 0.5–0.75 ms.
//! A dense method marks its whole segment, and runs of full words are scaled as one slice,
//! so its mean costs what the plain scaling pass did.

use std::ops::Range;

use crate::finite::{exponent_all_ones, scale_has_non_finite};

/// One bit per element of a buffer: set where a decode added to it. Reused across calls
/// (allocates only when the buffer grows).
#[derive(Debug, Clone, Default)]
pub struct Touched {
    words: Vec<u64>,
    /// Buffer offset of the segment being decoded: marks are relative to it.
    base: usize,
    len: usize,
}

impl Touched {
    /// Clears every mark, for a buffer of `len` elements; the segment offset is 0.
    pub fn reset(&mut self, len: usize) {
        self.words.clear();
        self.words.resize(len.div_ceil(64), 0);
        self.base = 0;
        self.len = len;
    }

    /// The length [`Touched::reset`] was given.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Makes later marks relative to buffer offset `base` (the framing sets it to each
    /// segment's start before decoding that segment's body).
    pub(crate) fn set_base(&mut self, base: usize) {
        self.base = base;
    }

    /// Marks element `i` of the current segment. `i` must lie inside the buffer (the
    /// decoders mark only indices they have checked and added at).
    #[inline(always)]
    pub fn mark(&mut self, i: usize) {
        let j = self.base + i;
        self.words[j / 64] |= 1 << (j % 64);
    }

    /// Marks elements `range` of the current segment (a dense body: all of it).
    pub fn mark_range(&mut self, range: Range<usize>) {
        let (a, b) = (self.base + range.start, self.base + range.end);
        if a >= b {
            return;
        }
        let (wa, wb) = (a / 64, (b - 1) / 64);
        let lo = !0u64 << (a % 64);
        let hi = !0u64 >> (63 - (b - 1) % 64);
        if wa == wb {
            self.words[wa] |= lo & hi;
            return;
        }
        self.words[wa] |= lo;
        self.words[wa + 1..wb].fill(!0);
        self.words[wb] |= hi;
    }

    /// Whether element `i` of the buffer (not of the segment) is marked.
    pub fn is_marked(&self, i: usize) -> bool {
        self.words[i / 64] >> (i % 64) & 1 == 1
    }

    /// Multiplies every marked element of `x` (the buffer, `len` long) by `k`; returns
    /// whether a marked element is then a NaN or an infinity. Unmarked elements are left
    /// as they are: where they hold `+0.0` (a zero-filled buffer the decodes did not add
    /// to) and `k` is finite and positive, the result is bit for bit a full
    /// [`scale_has_non_finite`]'s. A run of fully marked words is scaled as one slice.
    pub fn scale(&self, x: &mut [f32], k: f32) -> bool {
        debug_assert_eq!(x.len(), self.len);
        let mut bad = false;
        let mut w = 0;
        while w < self.words.len() {
            let word = self.words[w];
            if word == !0 {
                let run = self.words[w..].iter().take_while(|&&v| v == !0).count();
                let end = ((w + run) * 64).min(x.len());
                bad |= scale_has_non_finite(&mut x[w * 64..end], k);
                w += run;
                continue;
            }
            let mut bits = word;
            while bits != 0 {
                let v = &mut x[w * 64 + bits.trailing_zeros() as usize];
                *v *= k;
                bad |= exponent_all_ones(*v);
                bits &= bits - 1;
            }
            w += 1;
        }
        bad
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The marks of every range and index, against a plain set.
    #[test]
    fn ranges_and_indices_mark_exactly_their_elements() {
        let n = 300;
        let cases: &[(usize, Range<usize>)] = &[
            (0, 0..0),
            (0, 0..1),
            (0, 0..64),
            (0, 0..65),
            (10, 53..54),
            (7, 57..121),
            (0, 63..64),
            (64, 0..64),
            (1, 0..299),
            (100, 27..200),
        ];
        for (base, r) in cases {
            let mut t = Touched::default();
            t.reset(n);
            t.set_base(*base);
            t.mark_range(r.clone());
            t.mark(0);
            for i in 0..n {
                let want = i == *base || (base + r.start..base + r.end).contains(&i);
                assert_eq!(t.is_marked(i), want, "base {base} range {r:?} element {i}");
            }
        }
    }

    /// Scaling the marked elements of a buffer that is zero elsewhere equals scaling all of
    /// it, bit for bit, including -0, subnormals, overflow to ∞ and NaN; and the flag says
    /// whether a marked element is non-finite.
    #[test]
    fn scaling_the_marks_is_the_full_scale_where_the_rest_is_zero() {
        let n = 1000;
        let mut t = Touched::default();
        for pattern in 0..6 {
            t.reset(n);
            let mut x = vec![0f32; n];
            match pattern {
                0 => {}
                1 => t.mark_range(0..n),
                2 => t.mark_range(64..640),
                _ => {
                    for i in (pattern..n).step_by(pattern * 7) {
                        t.mark(i);
                    }
                    t.mark_range(128..256 + pattern);
                }
            }
            let special = [-0.0, 1e-45, f32::MAX, -3.5, 1.0e38, 2.0];
            for i in 0..n {
                if t.is_marked(i) {
                    x[i] = special[i % special.len()] * (1 + i % 3) as f32;
                }
            }
            for (k, nan) in [(0.5f32, false), (1.0 / 3.0, false), (0.25, true)] {
                let mut a = x.clone();
                if nan {
                    if let Some(i) = (0..n).find(|&i| t.is_marked(i)) {
                        a[i] = f32::NAN;
                    }
                }
                let mut b = a.clone();
                let bad_a = t.scale(&mut a, k);
                let bad_b = scale_has_non_finite(&mut b, k);
                assert_eq!(bad_a, bad_b, "pattern {pattern} k {k}");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "pattern {pattern} k {k}");
            }
        }
    }
}
