//! Ordered selection on the device: the `k` largest magnitudes of a segment
//! ([`top_k_segment`]: a radix select of the k-th key, then the compaction below), and the
//! entries of a segment whose magnitude key
//! (`bits & 0x7FFF_FFFF`, which orders finite values by `|x|`) lies above a threshold key `t`,
//! and the first `need` entries equal to it, in ascending index order — what `topk` keeps
//! once it knows the k-th largest key, and what `threshold` keeps at `key(τ)` (`need`
//! unbounded). The device half of `dtrain_compress::select`'s ordering rule.
//!
//! One pass counts, per block of 1 024 elements, the keys above `t` and equal to it (and
//! finds non-finite input); the host scans those counts into each block's first output slot
//! and its first equal key's rank; a second pass writes each kept index and value at its
//! place, each cube scanning its units' counts in shared memory.

use std::ops::Range;

use cubecl::prelude::*;
use dtrain_compress::wire::Reader;
use dtrain_compress::{sparse, Payload, WireError};

use crate::codec::{refuse_non_finite, u32_bytes};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride, UNITS};

/// Elements each unit of the compaction takes, consecutive.
const PER_UNIT: u32 = 4;
/// Elements per block of the compaction (one cube).
const BLOCK: usize = (UNITS * PER_UNIT) as usize;

/// An exclusive prefix sum of `s` in place, by unit 0 (256 words), between two barriers.
#[cube]
fn scan_in_place(s: &mut Shared<[u32]>) {
    sync_cube();
    if UNIT_POS == 0 {
        let mut acc = 0u32;
        for u in 0..UNITS as usize {
            let v = s[u];
            s[u] = acc;
            acc += v;
        }
    }
    sync_cube();
}

/// The key of element `i` of the segment, or `0xFFFF_FFFF` past its end (no finite key is
/// that large).
#[cube]
fn key_at(x: &[f32], start: u32, len: u32, i: usize) -> u32 {
    let mut key = 0xFFFF_FFFFu32;
    if i < len as usize {
        key = u32::reinterpret(x[start as usize + i]) & 0x7FFF_FFFF;
    }
    key
}

/// Per block of the segment: how many keys lie above `t` (`gt`) and how many equal it
/// (`eq`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn block_counts(
    x: &[f32],
    start: u32,
    len: u32,
    t: u32,
    gt: &mut [u32],
    eq: &mut [u32],
    first_bad: &[Atomic<u32>],
) {
    let mut s_gt = Shared::<[u32]>::new_slice(UNITS as usize);
    let mut s_eq = Shared::<[u32]>::new_slice(UNITS as usize);
    let mut b = CUBE_POS;
    while b < gt.len() {
        let first = b * BLOCK + UNIT_POS as usize * PER_UNIT as usize;
        let mut g = 0u32;
        let mut e = 0u32;
        for j in 0..PER_UNIT as usize {
            let key = key_at(x, start, len, first + j);
            if key != 0xFFFF_FFFF {
                if key >= 0x7F80_0000 {
                    first_bad[0].fetch_min(start + (first + j) as u32);
                }
                if key > t {
                    g += 1;
                } else if key == t {
                    e += 1;
                }
            }
        }
        s_gt[UNIT_POS as usize] = g;
        s_eq[UNIT_POS as usize] = e;
        sync_cube();
        if UNIT_POS == 0 {
            let mut sg = 0u32;
            let mut se = 0u32;
            for u in 0..UNITS as usize {
                sg += s_gt[u];
                se += s_eq[u];
            }
            gt[b] = sg;
            eq[b] = se;
        }
        sync_cube();
        b += CUBE_COUNT;
    }
}

/// Writes the kept elements of the segment — keys above `t`, and the first `need` keys
/// equal to it — at their places in `idx` (index within the segment) and `val`, in index
/// order: block `b`'s first equal key has rank `eq_before[b]` among the equal keys and its
/// first kept element goes to `kept_before[b]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn compact(
    x: &[f32],
    start: u32,
    len: u32,
    t: u32,
    need: u32,
    eq_before: &[u32],
    kept_before: &[u32],
    idx: &mut [u32],
    val: &mut [f32],
) {
    let mut s_eq = Shared::<[u32]>::new_slice(UNITS as usize);
    let mut s_kept = Shared::<[u32]>::new_slice(UNITS as usize);
    let mut b = CUBE_POS;
    while b < eq_before.len() {
        let first = b * BLOCK + UNIT_POS as usize * PER_UNIT as usize;
        let mut e = 0u32;
        for j in 0..PER_UNIT as usize {
            if key_at(x, start, len, first + j) == t {
                e += 1;
            }
        }
        s_eq[UNIT_POS as usize] = e;
        scan_in_place(&mut s_eq);
        let rank0 = eq_before[b] + s_eq[UNIT_POS as usize];
        let mut rank = rank0;
        let mut kept = 0u32;
        for j in 0..PER_UNIT as usize {
            let key = key_at(x, start, len, first + j);
            if key != 0xFFFF_FFFF {
                if key > t {
                    kept += 1;
                } else if key == t {
                    if rank < need {
                        kept += 1;
                    }
                    rank += 1;
                }
            }
        }
        s_kept[UNIT_POS as usize] = kept;
        scan_in_place(&mut s_kept);
        let mut pos = (kept_before[b] + s_kept[UNIT_POS as usize]) as usize;
        rank = rank0;
        for j in 0..PER_UNIT as usize {
            let i = first + j;
            let key = key_at(x, start, len, i);
            if key != 0xFFFF_FFFF {
                let mut keep = key > t;
                if key == t {
                    keep = rank < need;
                    rank += 1;
                }
                if keep {
                    idx[pos] = i as u32;
                    val[pos] = x[start as usize + i];
                    pos += 1;
                }
            }
        }
        sync_cube();
        b += CUBE_COUNT;
    }
}

/// Reads one word of a read-back buffer.
pub(crate) fn word(bytes: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("a word"))
}

/// The kept entries of one segment: indices within the segment, ascending, and the values
/// as little-endian `f32` bytes.
pub(crate) struct Kept {
    /// Indices within the segment, ascending.
    pub idx: Vec<u32>,
    /// The values, four bytes each, in the same order.
    pub val: Vec<u8>,
}

impl Kept {
    /// The value of the `j`-th kept entry.
    pub fn value(&self, j: usize) -> f32 {
        f32::from_bits(word(&self.val, j))
    }
}

/// The entries of `grad[seg]` with key above `t`, and the first `need` with key `t`, in
/// index order; the host's error for non-finite input in the segment (`out` is then
/// cleared).
pub(crate) fn compact_segment(
    gpu: &Gpu,
    grad: &GpuBuffer,
    seg: &Range<usize>,
    t: u32,
    need: u32,
    out: &mut Payload,
) -> Result<Kept, DeviceError> {
    let (start, len) = (seg.start as u32, seg.len() as u32);
    let blocks = seg.len().div_ceil(BLOCK);
    let (count, dim) = (geometry(blocks * UNITS as usize).0, CubeDim::new_1d(UNITS));
    let (gt, eq) = (gpu.words(blocks, 0), gpu.words(blocks, 0));
    let first_bad = gpu.words(1, u32::MAX);
    // SAFETY: `gt` and `eq` hold a word per block, `first_bad` one.
    unsafe {
        block_counts::launch(
            gpu.client(),
            count.clone(),
            dim,
            grad.arg(),
            start,
            len,
            t,
            BufferArg::from_raw_parts(gt.clone(), blocks),
            BufferArg::from_raw_parts(eq.clone(), blocks),
            BufferArg::from_raw_parts(first_bad.clone(), 1),
        );
    }
    let read = gpu.read_words(vec![gt, eq, first_bad], "reading block counts")?;
    refuse_non_finite(gpu, grad, &read[2], out)?;
    let (mut eq_before, mut kept_before) = (Vec::with_capacity(blocks), Vec::new());
    let (mut gt_sum, mut eq_sum) = (0u32, 0u32);
    for b in 0..blocks {
        eq_before.push(eq_sum);
        kept_before.push(gt_sum + eq_sum.min(need));
        gt_sum += word(&read[0], b);
        eq_sum += word(&read[1], b);
    }
    let k = (gt_sum + eq_sum.min(need)) as usize;
    if k == 0 {
        return Ok(Kept {
            idx: Vec::new(),
            val: Vec::new(),
        });
    }
    let eq_before = gpu.client().create_from_slice(u32_bytes(&eq_before));
    let kept_before = gpu.client().create_from_slice(u32_bytes(&kept_before));
    let (idx, val) = (gpu.words(k, 0), gpu.words(k, 0));
    // SAFETY: the tables hold a word per block, `idx` and `val` k words.
    unsafe {
        compact::launch(
            gpu.client(),
            count,
            dim,
            grad.arg(),
            start,
            len,
            t,
            need,
            BufferArg::from_raw_parts(eq_before, blocks),
            BufferArg::from_raw_parts(kept_before, blocks),
            BufferArg::from_raw_parts(idx.clone(), k),
            BufferArg::from_raw_parts(val.clone(), k),
        );
    }
    let mut read = gpu.read_words(vec![idx, val], "reading the kept entries")?;
    let val = read.pop().expect("values");
    Ok(Kept {
        idx: (0..k).map(|j| word(&read[0], j)).collect(),
        val: val[..4 * k].to_vec(),
    })
}

/// Adds `val[j]` at `out[idx[j]]` (the indices are distinct).
#[cube(launch)]
fn scatter_add(idx: &[u32], val: &[f32], out: &mut [f32]) {
    let mut j = ABSOLUTE_POS;
    while j < idx.len() {
        out[idx[j] as usize] += val[j];
        j += crate::words::grid_stride();
    }
}

/// Adds `val[j]` at `out[idx[j]]` for distinct in-range indices (a sparse decoder's adds,
/// after the host parsed and checked the payload).
fn add_at(gpu: &Gpu, idx: &[u32], val: &[f32], out: &GpuBuffer) {
    if idx.is_empty() {
        return;
    }
    let n = idx.len();
    let idx = gpu.client().create_from_slice(u32_bytes(idx));
    let val = gpu.upload(val);
    let (count, dim) = geometry(n);
    // SAFETY: `idx` and `val` hold n words; every index is below `out.len()` (the caller's
    // decoder checked it).
    unsafe {
        scatter_add::launch(
            gpu.client(),
            count,
            dim,
            BufferArg::from_raw_parts(idx, n),
            val.arg(),
            out.arg(),
        );
    }
}

/// Counts into `hist` the key byte at `shift` of every element of
/// `x[start .. start + len]` whose key matches `prefix` on `mask`; a non-finite element
/// lowers `first_bad` to its index in `x`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn histogram(
    x: &[f32],
    start: u32,
    len: u32,
    shift: u32,
    mask: u32,
    prefix: u32,
    hist: &[Atomic<u32>],
    first_bad: &[Atomic<u32>],
) {
    let mut i = ABSOLUTE_POS;
    while i < len as usize {
        let at = start as usize + i;
        let key = u32::reinterpret(x[at]) & 0x7FFF_FFFF;
        if key >= 0x7F80_0000 {
            first_bad[0].fetch_min(at as u32);
        }
        if (key & mask) == prefix {
            hist[((key >> shift) & 0xFF) as usize].fetch_add(1);
        }
        i += grid_stride();
    }
}

/// The threshold key `t` of the `k` largest magnitudes of `grad[seg]` and how many keys
/// equal to `t` they include (a radix select: four 256-bin histograms of one key byte each,
/// from the top byte down, over the elements matching the bytes found so far); or the host's
/// error where the segment holds a non-finite value.
fn kth_key(
    gpu: &Gpu,
    grad: &GpuBuffer,
    seg: &Range<usize>,
    k: usize,
    out: &mut Payload,
) -> Result<(u32, u32), DeviceError> {
    let (start, len) = (seg.start as u32, seg.len() as u32);
    let (mut prefix, mut mask, mut remaining) = (0u32, 0u32, k as u32);
    for shift in [24u32, 16, 8, 0] {
        let hist = gpu.words(256, 0);
        let first_bad = gpu.words(1, u32::MAX);
        let (count, dim) = geometry(seg.len());
        // SAFETY: `hist` holds 256 words, `first_bad` one, `grad` the segment.
        unsafe {
            histogram::launch(
                gpu.client(),
                count,
                dim,
                grad.arg(),
                start,
                len,
                shift,
                mask,
                prefix,
                BufferArg::from_raw_parts(hist.clone(), 256),
                BufferArg::from_raw_parts(first_bad.clone(), 1),
            );
        }
        let read = gpu.read_words(vec![hist, first_bad], "reading a histogram")?;
        refuse_non_finite(gpu, grad, &read[1], out)?;
        // The bin holding the `remaining`-th largest key, counting from the top.
        let mut digit = 0u32;
        for d in (0..256).rev() {
            let c = word(&read[0], d);
            if c >= remaining {
                digit = d as u32;
                break;
            }
            remaining -= c;
        }
        prefix |= digit << shift;
        mask |= 0xFF << shift;
    }
    Ok((prefix, remaining))
}

/// The `k` largest magnitudes of `grad[seg]` (`1 ≤ k ≤ len`), ties to the smaller index, in
/// index order: the host's `select::top_k_abs`.
pub(crate) fn top_k_segment(
    gpu: &Gpu,
    grad: &GpuBuffer,
    seg: &Range<usize>,
    k: usize,
    out: &mut Payload,
) -> Result<Kept, DeviceError> {
    let (t, need) = kth_key(gpu, grad, seg, k, out)?;
    let kept = compact_segment(gpu, grad, seg, t, need, out)?;
    debug_assert_eq!(kept.idx.len(), k);
    Ok(kept)
}

/// The adds a sparse payload makes, parsed on the host (`O(k)`): global indices and values,
/// made on the device by [`Adds::finish`].
#[derive(Debug, Default)]
pub(crate) struct Adds {
    idx: Vec<u32>,
    val: Vec<f32>,
}

impl Adds {
    /// Reads an indexed body of `seg` with the host codec's reader (its checks and errors).
    pub(crate) fn read_indexed(&mut self, r: &mut Reader<'_>, seg: &Range<usize>) -> Result<(), WireError> {
        let at = seg.start as u32;
        sparse::read_indexed(r, seg.len(), |i, v| {
            self.idx.push(at + i);
            self.val.push(v);
        })
    }

    /// Adds `value` at element `index` of the buffer.
    pub(crate) fn push(&mut self, index: u32, value: f32) {
        self.idx.push(index);
        self.val.push(value);
    }

    /// Refuses bytes left in `r` as the host does, then adds everything into `out`.
    pub(crate) fn finish(self, gpu: &Gpu, r: &Reader<'_>, out: &GpuBuffer) -> Result<(), DeviceError> {
        if r.remaining() != 0 {
            return Err(WireError::TrailingBytes(r.remaining()).into());
        }
        add_at(gpu, &self.idx, &self.val, out);
        Ok(())
    }
}
