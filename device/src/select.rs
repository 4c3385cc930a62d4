//! Ordered selection on the device, of many segments at once ([`select`]): of each segment
//! (a job), the `k` largest magnitudes ([`Rule::TopK`]: a radix select of the k-th key, then
//! the compaction below), or the entries whose magnitude key (`bits & 0x7FFF_FFFF`, which
//! orders finite values by `|x|`) lies above a threshold key `t` and the first `need`
//! entries equal to it ([`Rule::From`]), in ascending index order — what `topk` keeps once
//! it knows the k-th largest key, and what `threshold` keeps at `key(τ)` (`need`
//! unbounded). The device half of `dtrain_compress::select`'s ordering rule.
//!
//! The radix select takes four passes for every top-k job together, each a 256-bin
//! histogram per job of one key byte. Then one pass counts, per block of 1 024 elements of
//! every job, the keys above the job's `t` and equal to it (and finds non-finite input);
//! the host scans those counts into each block's first output slot and its first equal
//! key's rank; a second pass writes each kept index and value at its place, each cube
//! scanning its units' counts in shared memory. Six round trips to the host in all,
//! however many segments a bucket has (they were six a segment).

use std::ops::Range;

use cubecl::prelude::*;
use dtrain_compress::wire::Reader;
use dtrain_compress::{sparse, Payload, WireError};

use crate::codec::{refuse_non_finite, u32_bytes, upload_tables};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride, segment_of, UNITS};

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

/// The key of element `i` of the buffer where `i < end`, else `0xFFFF_FFFF` (no finite key
/// is that large).
#[cube]
fn key_before(x: &[f32], i: u32, end: u32) -> u32 {
    let mut key = 0xFFFF_FFFFu32;
    if i < end {
        key = u32::reinterpret(x[i as usize]) & 0x7FFF_FFFF;
    }
    key
}

/// Per block (block `b` of job `block_job[b]`, its first element `block_first[b]`): how many
/// keys lie above the job's threshold `job_t[j]` (`gt`) and how many equal it (`eq`), the
/// job's elements ending at `job_end[j]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn block_counts(
    x: &[f32],
    block_job: &[u32],
    block_first: &[u32],
    job_end: &[u32],
    job_t: &[u32],
    gt: &mut [u32],
    eq: &mut [u32],
    first_bad: &[Atomic<u32>],
) {
    let mut s_gt = Shared::<[u32]>::new_slice(UNITS as usize);
    let mut s_eq = Shared::<[u32]>::new_slice(UNITS as usize);
    let mut b = CUBE_POS;
    while b < gt.len() {
        let j = block_job[b] as usize;
        let (end, t) = (job_end[j], job_t[j]);
        let first = block_first[b] + UNIT_POS * PER_UNIT;
        let mut g = 0u32;
        let mut e = 0u32;
        for q in 0..PER_UNIT {
            let key = key_before(x, first + q, end);
            if key != 0xFFFF_FFFF {
                if key >= 0x7F80_0000 {
                    first_bad[0].fetch_min(first + q);
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

/// Writes each job's kept elements — keys above its `t`, and the first `need` keys equal
/// to it — at their places in `idx` (index within the job's segment, which starts at
/// `job_start[j]`) and `val`, in index order: block `b`'s first equal key has rank
/// `eq_before[b]` among its job's equal keys and its first kept element goes to
/// `kept_before[b]` (places of all jobs in one array).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn compact(
    x: &[f32],
    block_job: &[u32],
    block_first: &[u32],
    job_start: &[u32],
    job_end: &[u32],
    job_t: &[u32],
    job_need: &[u32],
    eq_before: &[u32],
    kept_before: &[u32],
    idx: &mut [u32],
    val: &mut [f32],
) {
    let mut s_eq = Shared::<[u32]>::new_slice(UNITS as usize);
    let mut s_kept = Shared::<[u32]>::new_slice(UNITS as usize);
    let mut b = CUBE_POS;
    while b < eq_before.len() {
        let j = block_job[b] as usize;
        let (end, t, need) = (job_end[j], job_t[j], job_need[j]);
        let first = block_first[b] + UNIT_POS * PER_UNIT;
        let mut e = 0u32;
        for q in 0..PER_UNIT {
            if key_before(x, first + q, end) == t {
                e += 1;
            }
        }
        s_eq[UNIT_POS as usize] = e;
        scan_in_place(&mut s_eq);
        let rank0 = eq_before[b] + s_eq[UNIT_POS as usize];
        let mut rank = rank0;
        let mut kept = 0u32;
        for q in 0..PER_UNIT {
            let key = key_before(x, first + q, end);
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
        for q in 0..PER_UNIT {
            let i = first + q;
            let key = key_before(x, i, end);
            if key != 0xFFFF_FFFF {
                let mut keep = key > t;
                if key == t {
                    keep = rank < need;
                    rank += 1;
                }
                if keep {
                    idx[pos] = i - job_start[j];
                    val[pos] = x[i as usize];
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
#[derive(Debug, Default)]
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

/// What a selection keeps of its segment.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Rule {
    /// The `k` largest magnitudes, ties to the smaller index (`k ≤` the segment's length).
    TopK(usize),
    /// Keys above `t`, and the first `need` keys equal to it.
    From {
        /// The threshold key.
        t: u32,
        /// How many keys equal to it are kept, in index order.
        need: u32,
    },
}

/// The kept entries of each job — a segment of `grad` and what to keep of it — in index
/// order, all jobs at once: one radix select of every top-k job's threshold (four
/// histogram passes) and one counting and one compaction pass over every job, so the
/// round trips do not grow with the number of segments. The host's error for non-finite
/// input (`out` is then cleared).
pub(crate) fn select(
    gpu: &Gpu,
    grad: &GpuBuffer,
    jobs: &[(Range<usize>, Rule)],
    out: &mut Payload,
) -> Result<Vec<Kept>, DeviceError> {
    let rules = thresholds(gpu, grad, jobs, out)?;
    let mut block_job = Vec::new();
    let mut block_first = Vec::new();
    for (j, (seg, _)) in jobs.iter().enumerate() {
        for b in 0..seg.len().div_ceil(BLOCK) {
            block_job.push(j as u32);
            block_first.push((seg.start + b * BLOCK) as u32);
        }
    }
    let blocks = block_job.len();
    if blocks == 0 {
        return Ok(jobs.iter().map(|_| Kept::default()).collect());
    }
    let job_start: Vec<u32> = jobs.iter().map(|(s, _)| s.start as u32).collect();
    let job_end: Vec<u32> = jobs.iter().map(|(s, _)| s.end as u32).collect();
    let job_t: Vec<u32> = rules.iter().map(|r| r.0).collect();
    let job_need: Vec<u32> = rules.iter().map(|r| r.1).collect();
    let tables = upload_tables(
        gpu,
        [block_job.clone(), block_first, job_start, job_end, job_t, job_need],
    );
    let [(t_block_job, nbj), (t_block_first, nbf), (t_start, ns), (t_end, ne), (t_t, nt), (t_need, nn)] =
        tables;
    let (count, dim) = (geometry(blocks * UNITS as usize).0, CubeDim::new_1d(UNITS));
    let (gt, eq) = (gpu.words(blocks, 0), gpu.words(blocks, 0));
    let first_bad = gpu.words(1, u32::MAX);
    // SAFETY: the block tables hold a word per block, the job tables a word per job, `gt`
    // and `eq` a word per block, `first_bad` one.
    unsafe {
        block_counts::launch(
            gpu.client(),
            count.clone(),
            dim,
            grad.arg(),
            BufferArg::from_raw_parts(t_block_job.clone(), nbj),
            BufferArg::from_raw_parts(t_block_first.clone(), nbf),
            BufferArg::from_raw_parts(t_end.clone(), ne),
            BufferArg::from_raw_parts(t_t.clone(), nt),
            BufferArg::from_raw_parts(gt.clone(), blocks),
            BufferArg::from_raw_parts(eq.clone(), blocks),
            BufferArg::from_raw_parts(first_bad.clone(), 1),
        );
    }
    let read = gpu.read_words(vec![gt, eq, first_bad], "reading block counts")?;
    refuse_non_finite(gpu, grad, &read[2], out)?;
    // Each block's first equal rank within its job and first place among all jobs' kept.
    let (mut eq_before, mut kept_before) = (Vec::with_capacity(blocks), Vec::with_capacity(blocks));
    let mut counts = vec![0usize; jobs.len()];
    let mut base = 0u32;
    let mut b = 0;
    for (j, &(_, need)) in rules.iter().enumerate() {
        let (mut gt_sum, mut eq_sum) = (0u32, 0u32);
        while b < blocks && block_job[b] as usize == j {
            eq_before.push(eq_sum);
            kept_before.push(base + gt_sum + eq_sum.min(need));
            gt_sum += word(&read[0], b);
            eq_sum += word(&read[1], b);
            b += 1;
        }
        counts[j] = (gt_sum + eq_sum.min(need)) as usize;
        base += counts[j] as u32;
    }
    let k = base as usize;
    if k == 0 {
        return Ok(jobs.iter().map(|_| Kept::default()).collect());
    }
    let [(t_eq_before, _), (t_kept_before, _)] = upload_tables(gpu, [eq_before, kept_before]);
    let (idx, val) = (gpu.words(k, 0), gpu.words(k, 0));
    // SAFETY: as above; the two scans hold a word per block, `idx` and `val` k words.
    unsafe {
        compact::launch(
            gpu.client(),
            count,
            dim,
            grad.arg(),
            BufferArg::from_raw_parts(t_block_job, nbj),
            BufferArg::from_raw_parts(t_block_first, nbf),
            BufferArg::from_raw_parts(t_start, ns),
            BufferArg::from_raw_parts(t_end, ne),
            BufferArg::from_raw_parts(t_t, nt),
            BufferArg::from_raw_parts(t_need, nn),
            BufferArg::from_raw_parts(t_eq_before, blocks),
            BufferArg::from_raw_parts(t_kept_before, blocks),
            BufferArg::from_raw_parts(idx.clone(), k),
            BufferArg::from_raw_parts(val.clone(), k),
        );
    }
    let read = gpu.read_words(vec![idx, val], "reading the kept entries")?;
    let mut at = 0;
    Ok(counts
        .iter()
        .map(|&c| {
            let kept = Kept {
                idx: (at..at + c).map(|q| word(&read[0], q)).collect(),
                val: read[1][4 * at..4 * (at + c)].to_vec(),
            };
            at += c;
            kept
        })
        .collect())
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

/// Counts, for every top-k job `j` (its elements `starts[j] ..`, numbered from `cum[j]` in
/// one sequence of `cum[last]`), into `hist[256·j ..]` the key byte at `shift` of each of
/// its elements whose key matches its `prefixes[j]` on `mask`; a non-finite element lowers
/// `first_bad` to its index.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn histogram(
    x: &[f32],
    cum: &[u32],
    starts: &[u32],
    shift: u32,
    mask: u32,
    prefixes: &[u32],
    hist: &[Atomic<u32>],
    first_bad: &[Atomic<u32>],
) {
    let total = cum[cum.len() - 1];
    let mut e = ABSOLUTE_POS as u32;
    while e < total {
        let j = segment_of(cum, e);
        let at = starts[j as usize] + e - cum[j as usize];
        let key = u32::reinterpret(x[at as usize]) & 0x7FFF_FFFF;
        if key >= 0x7F80_0000 {
            first_bad[0].fetch_min(at);
        }
        if (key & mask) == prefixes[j as usize] {
            hist[(256 * j + ((key >> shift) & 0xFF)) as usize].fetch_add(1);
        }
        e += grid_stride() as u32;
    }
}

/// Each job's threshold key and how many keys equal to it it keeps: a `From` job's own,
/// and for the top-k jobs, all at once, a radix select of the `k`-th largest key (four
/// 256-bin histograms of one key byte each, from the top byte down, over the elements
/// matching the bytes found so far); or the host's error where a segment holds a
/// non-finite value.
pub(crate) fn thresholds(
    gpu: &Gpu,
    grad: &GpuBuffer,
    jobs: &[(Range<usize>, Rule)],
    out: &mut Payload,
) -> Result<Vec<(u32, u32)>, DeviceError> {
    let mut rules: Vec<(u32, u32)> = jobs
        .iter()
        .map(|(_, r)| match *r {
            Rule::From { t, need } => (t, need),
            // Nothing is above the largest key: k = 0 keeps nothing.
            Rule::TopK(_) => (u32::MAX, 0),
        })
        .collect();
    // The top-k jobs with something to keep: (job, its remaining rank, prefix).
    let mut sel: Vec<(usize, u32, u32)> = jobs
        .iter()
        .enumerate()
        .filter_map(|(j, (seg, r))| match *r {
            Rule::TopK(k) if k > 0 && !seg.is_empty() => Some((j, k as u32, 0)),
            _ => None,
        })
        .collect();
    if sel.is_empty() {
        return Ok(rules);
    }
    let mut cum = vec![0u32];
    for &(j, _, _) in &sel {
        cum.push(cum.last().copied().unwrap_or(0) + jobs[j].0.len() as u32);
    }
    let starts: Vec<u32> = sel.iter().map(|&(j, _, _)| jobs[j].0.start as u32).collect();
    let total = *cum.last().expect("one entry") as usize;
    let [(t_cum, nc), (t_starts, ns)] = upload_tables(gpu, [cum, starts]);
    let mut mask = 0u32;
    for shift in [24u32, 16, 8, 0] {
        let prefixes: Vec<u32> = sel.iter().map(|s| s.2).collect();
        let [(t_prefixes, np)] = upload_tables(gpu, [prefixes]);
        let hist = gpu.words(256 * sel.len(), 0);
        let first_bad = gpu.words(1, u32::MAX);
        let (count, dim) = geometry(total);
        // SAFETY: `hist` holds 256 words a job, `first_bad` one, the tables a word a job
        // (and one more for `cum`).
        unsafe {
            histogram::launch(
                gpu.client(),
                count,
                dim,
                grad.arg(),
                BufferArg::from_raw_parts(t_cum.clone(), nc),
                BufferArg::from_raw_parts(t_starts.clone(), ns),
                shift,
                mask,
                BufferArg::from_raw_parts(t_prefixes, np),
                BufferArg::from_raw_parts(hist.clone(), 256 * sel.len()),
                BufferArg::from_raw_parts(first_bad.clone(), 1),
            );
        }
        let read = gpu.read_words(vec![hist, first_bad], "reading a histogram")?;
        refuse_non_finite(gpu, grad, &read[1], out)?;
        for (q, s) in sel.iter_mut().enumerate() {
            // The bin holding the `remaining`-th largest key, counting from the top.
            let mut digit = 0u32;
            for d in (0..256).rev() {
                let c = word(&read[0], 256 * q + d);
                if c >= s.1 {
                    digit = d as u32;
                    break;
                }
                s.1 -= c;
            }
            s.2 |= digit << shift;
        }
        mask |= 0xFF << shift;
    }
    for (j, remaining, prefix) in sel {
        rules[j] = (prefix, remaining);
    }
    Ok(rules)
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
