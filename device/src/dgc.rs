//! `dgc` on the device, in every adaptation: Deep Gradient Compression's compressor (the
//! host codec `dtrain_compress::dgc`). With `exact` (the default) the host
//! keeps exactly the `k = keep_count(n, density)` largest magnitudes, ties to the smaller
//! index — the sampled threshold is only its way of getting there fast — so the device's
//! top-k (`select`) writes the same payload: the layout byte, then the host's index coding
//! of the kept entries. A segment shorter than `min_sparse_len`, or whose `k` is all of it,
//! goes dense (every value, in order). The density follows the warm-up schedule of the step
//! (`ctx.step`), computed by the host codec itself. With `exact` the host draws its sample's
//! start from the encoder's Rng; the payload does not depend on it, and the device does not
//! draw.
//!
//! **The `synxlin` and `grace` adaptations** (the authors' code's and GRACE's rules, whose
//! kept sets depend on the sample): each sparse segment draws its sample's position from
//! the encoder's Rng as the host does (`dgc::sample_at`), a kernel gathers every segment's
//! strided sample into one buffer, one radix select finds each sample's threshold key at
//! the host's rank (`dgc::sample_rank`), and the host's own rules (`dgc::Adapt`) decide
//! from candidate counts that a kernel takes on the device — one round trip per round of
//! adaptation, every segment's count in it. The kept set is then the compaction at the
//! final key (`synxlin`: its first `k` in index order; or its `k` largest where the rule
//! says so), so the payload is the host's byte for byte. Any non-finite input is refused
//! first with the host's error (its first element: the host's candidates hold every NaN and
//! infinity).
//!
//! Decoding parses each segment on the host with the host codec's readers and adds on the
//! device. DGC's momentum-corrected memory is `dgc_momentum`'s.

use std::ops::Range;

use cubecl::prelude::*;
use dtrain_compress::dgc::{
    keep_count, sample_at, sample_rank, Adapt, AdaptStep, Adaptation, Dgc as HostDgc, DgcConfig,
};
use dtrain_compress::wire::{f32_at, Writer};
use dtrain_compress::{
    read_frame, sparse, CompressError, Compressor, Ctx, Method, MethodId, Payload, Rng,
    WireError,
};

use crate::codec::{begin_payload, upload_tables, DeviceCodec};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::select::{select, thresholds, word, Adds, Rule};
use crate::words::{geometry, grid_stride, segment_of};

/// `out[at + j] = x[first + j·stride]` for `j < m`: a segment's threshold sample.
#[cube(launch)]
fn gather_strided(x: &[f32], first: u32, stride: u32, m: u32, out: &mut [f32], at: u32) {
    let mut j = ABSOLUTE_POS as u32;
    while j < m {
        out[(at + j) as usize] = x[(first + j * stride) as usize];
        j += grid_stride() as u32;
    }
}

/// For each job `j` (its elements from `starts[j]`, numbered from `cum[j]` in one sequence
/// of `cum[last]`): how many keys are at least `keys[j]` in the host's terms
/// (`abs_key = (bits & 0x7FFF_FFFF) + 1`), into `counts[j]`. Each unit flushes its count
/// when its next element belongs to another job.
#[cube(launch)]
fn count_at_least(x: &[f32], cum: &[u32], starts: &[u32], keys: &[u32], counts: &[Atomic<u32>]) {
    let total = cum[cum.len() - 1];
    let mut e = ABSOLUTE_POS as u32;
    let mut job = 0xFFFF_FFFFu32;
    let mut n = 0u32;
    while e < total {
        let j = segment_of(cum, e);
        if j != job {
            if n > 0 {
                counts[job as usize].fetch_add(n);
            }
            job = j;
            n = 0;
        }
        let at = starts[j as usize] + e - cum[j as usize];
        let key = (u32::reinterpret(x[at as usize]) & 0x7FFF_FFFF) + 1;
        if key >= keys[j as usize] {
            n += 1;
        }
        e += grid_stride() as u32;
    }
    if n > 0 {
        counts[job as usize].fetch_add(n);
    }
}

/// The layout bytes of a DGC segment body.
const DENSE: u8 = 0;
const SPARSE: u8 = 1;

/// The `dgc` device codec (every adaptation).
#[derive(Debug, Clone)]
pub struct Dgc {
    /// The host codec: the density of a step comes from it.
    host: HostDgc,
    min_sparse_len: usize,
    adaptation: Adaptation,
    sample_ratio: f64,
    max_adapt_iters: u32,
}

impl Dgc {
    /// The device codec of `cfg` (a config the host refuses has none either).
    pub fn for_config(cfg: &DgcConfig) -> Option<Dgc> {
        cfg.init().ok().map(|host| Dgc {
            host,
            min_sparse_len: cfg.min_sparse_len,
            adaptation: cfg.adaptation,
            sample_ratio: cfg.sample_ratio,
            max_adapt_iters: cfg.max_adapt_iters,
        })
    }

    /// The `synxlin` / `grace` selections of the sparse `jobs` (segment, `k`; `Rule::TopK`
    /// in `jobs` marks them) in place: each job's rule becomes the compaction at its final
    /// key, or its top `k`; the second vector holds, per job, how many of the kept entries
    /// the payload takes (`synxlin`'s first `k`), `None` for all of them.
    fn adapt(
        &self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        jobs: &mut [(Range<usize>, Rule)],
        rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<Vec<Option<usize>>, DeviceError> {
        let mut limits = vec![None; jobs.len()];
        // The sparse jobs, their `k` and their samples' places (the host's draws, in order).
        let mut sparse = Vec::new();
        let mut sample_jobs = Vec::new();
        let mut m_total = 0;
        for (j, (seg, rule)) in jobs.iter().enumerate() {
            if let Rule::TopK(k) = *rule {
                let n = seg.len();
                let (start, stride, m) = sample_at(n, self.sample_ratio, rng);
                sparse.push((j, k, seg.start + start, stride, m));
                sample_jobs.push((m_total..m_total + m, Rule::TopK(sample_rank(k, m, n, false))));
                m_total += m;
            }
        }
        if sparse.is_empty() {
            return Ok(limits);
        }
        let sample = gpu.zeros(m_total);
        for (&(_, _, first, stride, m), (r, _)) in sparse.iter().zip(&sample_jobs) {
            let (count, dim) = geometry(m);
            gather_strided::launch(
                gpu.client(),
                count,
                dim,
                grad.arg(),
                first as u32,
                stride as u32,
                m as u32,
                sample.arg(),
                r.start as u32,
            );
        }
        // The device's keys are the host's minus one.
        let sampled = thresholds(gpu, &sample, &sample_jobs, out)?;
        let mut adapts: Vec<Adapt> = sparse
            .iter()
            .zip(&sampled)
            .map(|(&(_, k, ..), &(t, _))| {
                Adapt::new(self.adaptation, k, self.max_adapt_iters, t + 1)
            })
            .collect();
        let mut active: Vec<usize> = (0..sparse.len()).collect();
        let mut top_k = vec![false; sparse.len()];
        while !active.is_empty() {
            let segs: Vec<Range<usize>> = active.iter().map(|&a| jobs[sparse[a].0].0.clone()).collect();
            let keys: Vec<u32> = active.iter().map(|&a| adapts[a].key()).collect();
            let counts = counts_at_least(gpu, grad, &segs, &keys)?;
            active = active
                .into_iter()
                .zip(counts)
                .filter(|&(a, c)| match adapts[a].next(c) {
                    AdaptStep::Count(_) => true,
                    AdaptStep::Done { top_k: t } => {
                        top_k[a] = t;
                        false
                    }
                })
                .map(|(a, _)| a)
                .collect();
        }
        for (a, &(j, k, ..)) in sparse.iter().enumerate() {
            if !top_k[a] {
                // Every key at least the final one: the device's key (the host's minus one)
                // at least `key − 1`, i.e. above it or equal to it.
                jobs[j].1 = Rule::From {
                    t: adapts[a].key().saturating_sub(1),
                    need: u32::MAX,
                };
                if self.adaptation == Adaptation::Synxlin {
                    limits[j] = Some(k);
                }
            }
        }
        Ok(limits)
    }
}

/// How many keys of each segment are at least its key, in the host's terms (one kernel,
/// one read back).
fn counts_at_least(
    gpu: &Gpu,
    grad: &GpuBuffer,
    segs: &[Range<usize>],
    keys: &[u32],
) -> Result<Vec<usize>, DeviceError> {
    let mut cum = vec![0u32];
    for s in segs {
        cum.push(cum.last().copied().unwrap_or(0) + s.len() as u32);
    }
    let total = cum.last().copied().unwrap_or(0) as usize;
    let starts: Vec<u32> = segs.iter().map(|s| s.start as u32).collect();
    let [(t_cum, nc), (t_starts, ns), (t_keys, nk)] =
        upload_tables(gpu, [cum, starts, keys.to_vec()]);
    let counts = gpu.words(segs.len(), 0);
    let (count, dim) = geometry(total);
    // SAFETY: `cum` holds J + 1 words, `starts`, `keys` and `counts` J.
    unsafe {
        count_at_least::launch(
            gpu.client(),
            count,
            dim,
            grad.arg(),
            BufferArg::from_raw_parts(t_cum, nc),
            BufferArg::from_raw_parts(t_starts, ns),
            BufferArg::from_raw_parts(t_keys, nk),
            BufferArg::from_raw_parts(counts.clone(), segs.len()),
        );
    }
    let read = gpu.read_words(vec![counts], "reading candidate counts")?;
    Ok((0..segs.len()).map(|j| word(&read[0], j) as usize).collect())
}

impl DeviceCodec for Dgc {
    fn method(&self) -> MethodId {
        DgcConfig::ID
    }

    fn ratio_metric(&self) -> Option<(&'static str, f64)> {
        self.host.ratio_metric()
    }

    fn encode(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let segs = begin_payload(DgcConfig::ID, grad.len(), ctx.segments, out)?;
        // The step's density (the warm-up schedule), as the host codec sets it.
        self.host.begin(&[], ctx);
        let density = self.host.current_density();
        let jobs: Vec<_> = segs
            .iter()
            .map(|seg| {
                let n = seg.len();
                let k = keep_count(n, density);
                let rule = if n < self.min_sparse_len || k >= n {
                    // Every element, in order: the compaction at key 0 with every equal kept.
                    Rule::From { t: 0, need: u32::MAX }
                } else {
                    Rule::TopK(k)
                };
                (seg.clone(), rule)
            })
            .collect();
        // Which jobs are sparse (the layout), before the adaptations rewrite their rules.
        let is_sparse: Vec<bool> = jobs.iter().map(|(_, r)| matches!(r, Rule::TopK(_))).collect();
        let mut jobs = jobs;
        let limits = if self.adaptation == Adaptation::Exact {
            vec![None; jobs.len()]
        } else {
            // The host's error for non-finite input first: its candidates hold every NaN
            // and infinity, so it names the first (and the samples below stay finite).
            if let Some((index, value)) = gpu.first_non_finite(grad)? {
                out.buffer_mut().clear();
                return Err(CompressError::NonFinite { index, value }.into());
            }
            self.adapt(gpu, grad, &mut jobs, rng, out)?
        };
        let mut kept = select(gpu, grad, &jobs, out)?;
        let mut w = Writer::new(out.buffer_mut());
        for (((seg, _), kept), (&sparse_seg, limit)) in
            jobs.iter().zip(&mut kept).zip(is_sparse.iter().zip(limits))
        {
            if let Some(k) = limit {
                kept.idx.truncate(k);
                kept.val.truncate(4 * k);
            }
            if sparse_seg {
                w.u8(SPARSE);
                sparse::write_indices(seg.len(), &kept.idx, &mut w);
            } else {
                w.u8(DENSE);
            }
            w.bytes(&kept.val);
        }
        Ok(())
    }

    fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError> {
        let (mut r, segs) = read_frame(DgcConfig::ID, payload, out.len())?;
        let mut adds = Adds::default();
        for seg in &segs {
            match r.u8("dgc layout")? {
                DENSE => {
                    let vals = r.take_items(seg.len(), 4, "dgc dense values")?;
                    for j in 0..seg.len() {
                        let v = f32_at(vals, j);
                        if !v.is_finite() {
                            return Err(WireError::Invalid("non-finite dense value").into());
                        }
                        adds.push((seg.start + j) as u32, v);
                    }
                }
                SPARSE => adds.read_indexed(&mut r, seg)?,
                _ => return Err(WireError::Invalid("unknown dgc layout").into()),
            }
        }
        adds.finish(gpu, &r, out)
    }
}
