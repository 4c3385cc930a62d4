//! Finiteness checks: the scan that names the first NaN or infinity of a buffer, the fused
//! scale-and-check passes of the averages, and the bookkeeping of a method that finds
//! non-finite input in its own passes ([`crate::Compressor::finds_non_finite`]). The items
//! are re-exported from [`crate::compressor`], where callers have always found them.

use crate::simd::vector_dispatch;

/// Whether a short block holds a NaN or an infinity: a branch-free OR-reduction over the
/// exponent bits, which vectorises (a per-element `is_finite` early exit does not).
#[inline(always)]
fn block_non_finite(block: &[f32]) -> bool {
    block
        .iter()
        .fold(false, |bad, &v| bad | exponent_all_ones(v))
}

/// Whether `v` is a NaN or an infinity, as a bit test (all exponent bits set) that a
/// compiler vectorises inside a branch-free reduction, where `!v.is_finite()` is a compare
/// per element.
#[inline(always)]
pub(crate) fn exponent_all_ones(v: f32) -> bool {
    const EXP: u32 = 0x7F80_0000;
    v.to_bits() & EXP == EXP
}

vector_dispatch! {
    /// Index and value of the first non-finite element, if any.
    pub fn first_non_finite(x: &[f32]) -> Option<(usize, f32)> = first_non_finite_lanes;
}

#[inline(always)]
fn first_non_finite_lanes(x: &[f32]) -> Option<(usize, f32)> {
    // 64-element blocks; only a hit is rescanned.
    for (bi, block) in x.chunks(64).enumerate() {
        if block_non_finite(block) {
            let j = block.iter().position(|v| !v.is_finite()).unwrap_or(0);
            return Some((bi * 64 + j, block[j]));
        }
    }
    None
}

/// The bookkeeping of a method that [finds non-finite input](crate::Compressor::finds_non_finite)
/// itself: where the segment being encoded starts in the buffer, and the first non-finite
/// element found so far.
#[derive(Debug, Clone, Default)]
pub struct FirstNonFinite {
    next: usize,
    found: Option<(usize, f32)>,
}

impl FirstNonFinite {
    /// A new buffer ([`crate::Compressor::begin`]): offset 0, nothing found.
    pub fn reset(&mut self) {
        *self = Self::default();
    }

    /// Starts the next segment, of `n` elements; returns its offset in the buffer.
    pub fn segment(&mut self, n: usize) -> usize {
        let at = self.next;
        self.next += n;
        at
    }

    /// Notes `local` (an index in the segment starting at `at`, and its value) unless an
    /// earlier element was noted.
    pub fn note(&mut self, at: usize, local: Option<(usize, f32)>) {
        if self.found.is_none() {
            self.found = local.map(|(i, v)| (at + i, v));
        }
    }

    /// The first non-finite element noted since the last call or reset.
    pub fn take(&mut self) -> Option<(usize, f32)> {
        self.found.take()
    }
}

vector_dispatch! {
    /// Multiplies every element by `k`; returns whether the result holds a NaN or an
    /// infinity, in one pass over memory (each 64-element block is checked while it is
    /// still in L1): an average and its finiteness check at the cost of the average alone.
    pub fn scale_has_non_finite(x: &mut [f32], k: f32) -> bool = scale_has_non_finite_lanes;
}

#[inline(always)]
fn scale_has_non_finite_lanes(x: &mut [f32], k: f32) -> bool {
    let mut bad = false;
    for block in x.chunks_mut(64) {
        for v in block.iter_mut() {
            *v *= k;
        }
        bad |= block_non_finite(block);
    }
    bad
}

vector_dispatch! {
    /// Writes `src[i] · k` into `dst[i]`; returns whether the result holds a NaN or an
    /// infinity, checked block by block while each is still in L1 (see
    /// [`scale_has_non_finite`]). `dst` and `src` have the same length.
    pub fn scale_into_has_non_finite(dst: &mut [f32], src: &[f32], k: f32) -> bool =
        scale_into_has_non_finite_lanes;
}

#[inline(always)]
fn scale_into_has_non_finite_lanes(dst: &mut [f32], src: &[f32], k: f32) -> bool {
    scale_into_lanes::<false>(dst, src, k)
}

vector_dispatch! {
    /// Writes `(0 + src[i]) · k` into `dst[i]`: bit for bit zero-filling `dst`, adding
    /// `src` into it and scaling it by `k` (the `+ 0` turns a −0 into +0 as that addition
    /// does), in one pass; returns whether the result holds a NaN or an infinity (see
    /// [`scale_has_non_finite`]). `dst` and `src` have the same length.
    pub fn zero_add_scale_into_has_non_finite(dst: &mut [f32], src: &[f32], k: f32) -> bool =
        zero_add_scale_into_has_non_finite_lanes;
}

#[inline(always)]
fn zero_add_scale_into_has_non_finite_lanes(dst: &mut [f32], src: &[f32], k: f32) -> bool {
    scale_into_lanes::<true>(dst, src, k)
}

#[inline(always)]
fn scale_into_lanes<const FROM_ZERO: bool>(dst: &mut [f32], src: &[f32], k: f32) -> bool {
    debug_assert_eq!(dst.len(), src.len());
    let mut bad = false;
    for (d, s) in dst.chunks_mut(64).zip(src.chunks(64)) {
        for (d, &s) in d.iter_mut().zip(s) {
            *d = if FROM_ZERO { (0.0 + s) * k } else { s * k };
        }
        bad |= block_non_finite(d);
    }
    bad
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both block scans find a bad value wherever it sits (first block, block edge, tail
    /// block), and scaling can create one (overflow) or remove none — on every vector tier.
    #[test]
    fn non_finite_scans_find_every_position_and_scaling_overflow() {
        crate::simd::each_tier(every_position_and_overflow);
    }

    fn every_position_and_overflow() {
        for n in [1usize, 63, 64, 65, 200] {
            for at in [0, n / 2, n - 1] {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    let mut x: Vec<f32> = (0..n).map(|i| i as f32 - 7.5).collect();
                    assert_eq!(first_non_finite(&x), None);
                    x[at] = bad;
                    let (i, v) = first_non_finite(&x).expect("found");
                    assert_eq!(i, at);
                    assert_eq!(v.to_bits(), bad.to_bits());
                    let mut y = x.clone();
                    assert!(scale_has_non_finite(&mut y, 0.5));
                }
                let mut x: Vec<f32> = (0..n).map(|i| i as f32 - 7.5).collect();
                let want: Vec<f32> = x.iter().map(|v| v * 0.25).collect();
                assert!(!scale_has_non_finite(&mut x, 0.25));
                assert_eq!(x, want, "the same products as a plain multiply");
                x[at] = 3e38;
                assert!(scale_has_non_finite(&mut x, 2.0), "overflow at {at} of {n}");
                let mut src: Vec<f32> = (0..n).map(|i| i as f32 - 7.5).collect();
                src[at] = 3e38;
                let mut dst = vec![0.0; n];
                assert!(
                    scale_into_has_non_finite(&mut dst, &src, 2.0),
                    "into, {at} of {n}"
                );
                assert!(
                    !scale_into_has_non_finite(&mut dst, &src, 0.5),
                    "into, {at} of {n}"
                );
                let want: Vec<f32> = src.iter().map(|v| v * 0.5).collect();
                assert_eq!(dst, want, "into: the same products as a plain multiply");
                // From zero: the bits of a zero fill, an addition and a scaling, −0 included.
                src[at] = -0.0;
                let mut want = vec![0.0f32; n];
                want.iter_mut().zip(&src).for_each(|(w, s)| *w += s);
                want.iter_mut().for_each(|w| *w *= 0.5);
                let mut dst = vec![f32::NAN; n];
                assert!(!zero_add_scale_into_has_non_finite(&mut dst, &src, 0.5));
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&dst), bits(&want), "from zero, {at} of {n}");
                src[at] = 3e38;
                assert!(zero_add_scale_into_has_non_finite(&mut dst, &src, 2.0));
            }
        }
    }
}
