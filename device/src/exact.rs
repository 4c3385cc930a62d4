//! Exact, order-free sums on the device: the bins of `dtrain_compress::exact::ExactSum`
//! accumulated with 32-bit atomics — each bin a low and a high word, a carry into the high
//! one where the low one wraps — then read back, and rounded once on the host. The host's
//! number by construction, whatever order the device adds in.
//!
//! Every element of a segment with the same exponent adds into the same pair of words, so
//! on a GPU the atomics contend; per-cube bins in shared memory would cut that by the cube
//! size (not written yet: lavapipe checks results, not speed).

use std::ops::Range;

use cubecl::prelude::*;
use dtrain_compress::exact::{ExactSquares, ExactSum};
use dtrain_compress::Payload;

use crate::codec::{element_starts, refuse_non_finite, upload_tables};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::select::word;
use crate::words::{geometry, grid_stride, segment_of};

/// Bins per segment (one per exponent field).
const BINS: usize = 256;

/// The bin of a finite `f32`'s magnitude (bits `bits`) and its integer significand, packed
/// as `bin << 24 | m`: `bin = max(E, 1)` for the exponent field `E`, `m` the fraction with
/// the hidden bit where `E > 0` (the host's `exact::bin_of`).
#[cube]
fn bin_and_significand(bits: u32) -> u32 {
    let e = (bits >> 23) & 0xFF;
    let mut bin = e;
    let mut m = bits & 0x7F_FFFF;
    if e == 0 {
        bin = 1;
    } else {
        m |= 0x80_0000;
    }
    (bin << 24) | m
}

/// Adds each element's magnitude to its class's bins (`2·256` words a class: the low and
/// high word of each bin) and counts it; a class is the element's segment, or with `split`
/// the segment and the sign (class `2s` for `p ≥ 0`, −0.0 included; `2s + 1` for `p < 0`).
/// A non-finite element lowers `first_bad` to its index.
#[cube(launch)]
fn abs_bins(
    x: &[f32],
    starts: &[u32],
    bins: &[Atomic<u32>],
    counts: &[Atomic<u32>],
    first_bad: &[Atomic<u32>],
    #[comptime] split: bool,
) {
    let mut i = ABSOLUTE_POS;
    while i < x.len() {
        let bits = u32::reinterpret(x[i]);
        if (bits >> 23) & 0xFF == 0xFF {
            first_bad[0].fetch_min(i as u32);
        } else {
            let packed = bin_and_significand(bits);
            let bin = packed >> 24;
            let m = packed & 0xFF_FFFF;
            let mut class = segment_of(starts, i as u32);
            if split {
                class *= 2;
                if bits > 0x8000_0000 {
                    class += 1;
                }
            }
            counts[class as usize].fetch_add(1);
            let at = (2 * (256 * class + bin)) as usize;
            let old = bins[at].fetch_add(m);
            if old > 0xFFFF_FFFF - m {
                bins[at + 1].fetch_add(1);
            }
        }
        i += grid_stride();
    }
}

/// The exact `Σ|x|` of each class of `grad`'s elements and how many it holds — a class per
/// segment, or with `split` two (`p ≥ 0`, then `p < 0`); or the host's error for non-finite
/// input (the first such element and its value; `out` is then cleared).
pub(crate) fn abs_sums(
    gpu: &Gpu,
    grad: &GpuBuffer,
    segs: &[Range<usize>],
    split: bool,
    out: &mut Payload,
) -> Result<Vec<(ExactSum, u32)>, DeviceError> {
    let [starts] = upload_tables(gpu, [element_starts(segs)]);
    let classes = segs.len() * if split { 2 } else { 1 };
    let words = 2 * BINS * classes;
    let bins = gpu.words(words, 0);
    let counts = gpu.words(classes, 0);
    let first_bad = gpu.words(1, u32::MAX);
    let (count, dim) = geometry(grad.len());
    // SAFETY: `starts` holds S + 1 words, `bins` 2·256 a class, `counts` one a class,
    // `first_bad` one.
    unsafe {
        abs_bins::launch(
            gpu.client(),
            count,
            dim,
            grad.arg(),
            BufferArg::from_raw_parts(starts.0.clone(), starts.1),
            BufferArg::from_raw_parts(bins.clone(), words),
            BufferArg::from_raw_parts(counts.clone(), classes),
            BufferArg::from_raw_parts(first_bad.clone(), 1),
            split,
        );
    }
    let read = gpu.read_words(vec![bins, counts, first_bad], "reading exact sums")?;
    refuse_non_finite(gpu, grad, &read[2], out)?;
    Ok((0..classes)
        .map(|c| {
            let mut b = [0u64; BINS];
            for (e, v) in b.iter_mut().enumerate() {
                let at = 2 * (BINS * c + e);
                *v = u64::from(word(&read[0], at)) | u64::from(word(&read[0], at + 1)) << 32;
            }
            (ExactSum::from_bins(b), word(&read[1], c))
        })
        .collect())
}

/// Adds each element's squared significand (`m²`, 48 bits) to its segment's bin for its
/// exponent, three words a bin (low, middle, high), carrying where a word wraps. A
/// non-finite element lowers `first_bad` to its index.
#[cube(launch)]
fn square_bins(x: &[f32], starts: &[u32], bins: &[Atomic<u32>], first_bad: &[Atomic<u32>]) {
    let mut i = ABSOLUTE_POS;
    while i < x.len() {
        let bits = u32::reinterpret(x[i]);
        if (bits >> 23) & 0xFF == 0xFF {
            first_bad[0].fetch_min(i as u32);
        } else {
            let packed = bin_and_significand(bits);
            let bin = packed >> 24;
            let m = packed & 0xFF_FFFF;
            // m² = a²·2²⁴ + 2ab·2¹² + b² for the 12-bit halves a, b of m: its low word and
            // the 16 bits above it, in 32-bit arithmetic.
            let a = m >> 12;
            let b = m & 0xFFF;
            let ab2 = 2 * a * b;
            let aa = a * a;
            let mut lo = b * b;
            let mut hi = (ab2 >> 20) + (aa >> 8);
            // The rest, (ab2 mod 2²⁰)·2¹² + (aa mod 2⁸)·2²⁴, in two parts.
            let t1 = (ab2 & 0xF_FFFF) << 12;
            let t2 = (aa & 0xFF) << 24;
            if lo > 0xFFFF_FFFF - t1 {
                hi += 1;
            }
            lo += t1;
            if lo > 0xFFFF_FFFF - t2 {
                hi += 1;
            }
            lo += t2;
            let class = segment_of(starts, i as u32);
            let at = (3 * (256 * class + bin)) as usize;
            let old = bins[at].fetch_add(lo);
            if old > 0xFFFF_FFFF - lo {
                hi += 1;
            }
            let old = bins[at + 1].fetch_add(hi);
            if old > 0xFFFF_FFFF - hi {
                bins[at + 2].fetch_add(1);
            }
        }
        i += grid_stride();
    }
}

/// The exact `Σx²` of each segment of `grad`; or the host's error for non-finite input (the
/// first such element and its value; `out` is then cleared).
pub(crate) fn squares(
    gpu: &Gpu,
    grad: &GpuBuffer,
    segs: &[Range<usize>],
    out: &mut Payload,
) -> Result<Vec<ExactSquares>, DeviceError> {
    let [starts] = upload_tables(gpu, [element_starts(segs)]);
    let words = 3 * BINS * segs.len();
    let bins = gpu.words(words, 0);
    let first_bad = gpu.words(1, u32::MAX);
    let (count, dim) = geometry(grad.len());
    // SAFETY: `starts` holds S + 1 words, `bins` 3·256 a segment, `first_bad` one.
    unsafe {
        square_bins::launch(
            gpu.client(),
            count,
            dim,
            grad.arg(),
            BufferArg::from_raw_parts(starts.0.clone(), starts.1),
            BufferArg::from_raw_parts(bins.clone(), words),
            BufferArg::from_raw_parts(first_bad.clone(), 1),
        );
    }
    let read = gpu.read_words(vec![bins, first_bad], "reading exact squares")?;
    refuse_non_finite(gpu, grad, &read[1], out)?;
    Ok((0..segs.len())
        .map(|c| {
            let mut b = [0u128; BINS];
            for (e, v) in b.iter_mut().enumerate() {
                let at = 3 * (BINS * c + e);
                *v = u128::from(word(&read[0], at))
                    | u128::from(word(&read[0], at + 1)) << 32
                    | u128::from(word(&read[0], at + 2)) << 64;
            }
            ExactSquares::from_bins(b)
        })
        .collect())
}
