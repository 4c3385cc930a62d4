//! `scalecom`: cyclic local top-k (CLT-k) with a low-pass-filtered memory (Chen et al.,
//! NeurIPS 2020; ALGORITHMS.md §12).
//!
//! Each step one worker, the **leader** `t mod P`, picks the index set `I_t` as the top-k of
//! its own memory-compensated gradient; the set is broadcast and **every** worker sends its
//! values at `I_t`. Because all payloads share one index set, their value lanes can be
//! summed by an all-reduce (aggregation [`Aggregation::Summable`]); traffic per worker does
//! not grow with P.
//!
//! ## Driving a step (the trainer's side)
//! ```text
//! p_i  = memory.compensate(g_i)                         every worker
//! if rank == sc.leader(step):  set = sc.leader_indices(p_i, ctx);  msg = set.encode()
//! broadcast msg from the leader;  set = IndexSet::decode(msg)
//! sc.compress_with_indices(p_i, ctx, &set, &mut payload) every worker
//! decode own payload → memory.update(p_i, D(payload))   every worker
//! all-reduce the f32 lanes of `value_lanes(payload)` (or `add_summable` after a gather),
//! decode the summed payload once, divide by P
//! ```
//! [`ScaleComWorker`] packages exactly this sequence (compressor + [`LowPass`] memory).
//! The same sequence is reachable through the generic two-phase hooks of the
//! [`Compressor`] trait ([`Compressor::broadcast_root`] = the leader,
//! [`Compressor::broadcast_message`] = the encoded [`IndexSet`],
//! [`Compressor::install_broadcast`] = decode, validate and pin the set for the step), which
//! [`crate::Pipeline`] composes with any memory; that is how the framework's exchanger
//! drives ScaleCom through a `Box<dyn Compressor>`.
//! ## The plain [`crate::compress`] path
//! The compressor keeps, per bucket, the index set of the current step. On the **leader**
//! (`ctx.rank == step mod P`) a plain compress always selects the top-k of the buffer and
//! records it ([`ScaleCom::indices_for`]: what the leader broadcasts). On any other rank it
//! uses the set recorded or installed ([`ScaleCom::set_indices`], the received broadcast)
//! for the same `(step, bucket)` and layout. So with one worker the plain path is exactly
//! CLT-k, and a driver holding the concrete type can run P workers with plain `compress`
//! calls: leader first, then `set_indices` on the others. A non-leader without a set for
//! the step falls back to its own top-k, which is **not** summable with the others;
//! [`ScaleCom::compress_with_indices`] validates the set and cannot make that mistake.
//!
//! ## Body, per segment of `n` elements (the [`crate::sparse`] body)
//! ```text
//! the sparse body of [`crate::sparse`]: layout, k, the indices (u32 list, bitmap or
//! Rice-coded gaps, whichever is smallest), then k × f32 value   ← the summable lane
//! ```
//! Every worker codes the same index set the same way, so only the value lanes differ; the
//! size depends on the set, never on P.
//!
//! ## Index broadcast message
//! ```text
//! u8 magic 0xD9, u8 version 1, u16 reserved 0, u64 step, u64 bucket,
//! u32 n, u32 s, s × u32 segment length, then per segment the index part of a sparse body
//! (layout, count, then a u32 list, a bitmap or Rice-coded gaps: see [`crate::sparse`])
//! ```

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::compressor::{
    self, effective_segments, first_non_finite, Aggregation, Compressor, Ctx, MethodId, Payload,
    Touched, MAX_ELEMS,
};
use crate::error::{CompressError, ConfigError, WireError};
use crate::memory::Memory;
use crate::memory::MemoryConfig;
use crate::registry::{Method, RunFacts, RunUse};
use crate::rng::Rng;
use crate::select::{abs_key, top_k, top_k_abs, Scratch};
use crate::sparse;
use crate::topk::{check_ratio, k_for};
use crate::wire::{f32_at, u32_at, Reader, Writer};

pub use crate::memory::LowPass;

/// First byte of an index broadcast message.
pub const INDEX_MAGIC: u8 = 0xD9;
const INDEX_VERSION: u8 = 2;

/// Configuration of [`ScaleCom`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScaleComConfig {
    /// Density ρ = k/n per segment, in (0, 1]. Default 0.01.
    #[serde(default = "default_ratio")]
    pub ratio: f64,
    /// Number of workers P (the leader of step t is `t mod P`). Default 1. A multi-rank
    /// driver sets it through [`Compressor::set_world_size`]: the framework's exchanger
    /// overrides this value with the communicator's world size at every step.
    #[serde(default = "one")]
    pub workers: u32,
}

fn default_ratio() -> f64 {
    0.01
}
fn one() -> u32 {
    1
}

impl Default for ScaleComConfig {
    fn default() -> Self {
        ScaleComConfig {
            ratio: default_ratio(),
            workers: 1,
        }
    }
}

impl Method for ScaleComConfig {
    const NAME: &'static str = "scalecom";
    const ABOUT: &'static str =
        "ScaleCom cyclic local top-k: leader-chosen shared indices, all-reduce summable";
    const ID: MethodId = MethodId(14);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()?))
    }

    fn default_memory(&self) -> MemoryConfig {
        MemoryConfig::LowPass { beta: 1.0 }
    }

    /// The leader rotates over the run's workers.
    fn resolve(&mut self, run: &RunFacts) {
        self.workers = run.workers as u32;
    }

    /// The leader's index set is broadcast among workers: a collective.
    fn check(&self, run: &RunUse<'_>) -> Result<(), ConfigError> {
        if run.parameter_server {
            return Err(ConfigError::new(
                "kind",
                "ScaleCom's workers compress at indices a leader broadcasts to them, a \
                 collective among workers; mode = \"ps\" has none (use mode = \"allreduce\")",
            ));
        }
        Ok(())
    }
}

impl ScaleComConfig {
    /// Checks the parameters and builds the compressor.
    pub fn init(&self) -> Result<ScaleCom, ConfigError> {
        check_ratio("ratio", self.ratio)?;
        if self.workers == 0 {
            return Err(ConfigError::new("workers", "must be >= 1"));
        }
        Ok(ScaleCom {
            cfg: self.clone(),
            scratch: Scratch::default(),
            own: Vec::new(),
            sets: BTreeMap::new(),
            bucket: 0,
            reuse: false,
            forced: false,
            pinned: BTreeMap::new(),
            seg: 0,
        })
    }
}

/// A shared index set: for each segment of a buffer, the ascending segment-local indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexSet {
    /// The step it was chosen for.
    pub step: u64,
    /// The bucket it belongs to.
    pub bucket: u64,
    n: usize,
    seg_lens: Vec<usize>,
    /// `starts[i]..starts[i+1]` is segment i's slice of `idx`.
    starts: Vec<usize>,
    idx: Vec<u32>,
}

impl IndexSet {
    /// Elements in the buffer it describes.
    pub fn n(&self) -> usize {
        self.n
    }

    /// The segment lengths.
    pub fn segment_lens(&self) -> &[usize] {
        &self.seg_lens
    }

    /// Ascending local indices of segment `i`.
    pub fn segment(&self, i: usize) -> &[u32] {
        &self.idx[self.starts[i]..self.starts[i + 1]]
    }

    /// Total number of indices.
    pub fn len(&self) -> usize {
        self.idx.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.idx.is_empty()
    }

    /// Global (buffer) indices, ascending.
    pub fn global_indices(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.idx.len());
        let mut off = 0usize;
        for (i, &len) in self.seg_lens.iter().enumerate() {
            out.extend(self.segment(i).iter().map(|&j| (off + j as usize) as u32));
            off += len;
        }
        out
    }

    /// Encodes the broadcast message (layout in the module docs) into `out` (cleared).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.clear();
        let mut w = Writer::new(out);
        w.u8(INDEX_MAGIC);
        w.u8(INDEX_VERSION);
        w.u8(0);
        w.u8(0);
        w.u64(self.step);
        w.u64(self.bucket);
        w.u32(self.n as u32);
        w.u32(self.seg_lens.len() as u32);
        for &l in &self.seg_lens {
            w.u32(l as u32);
        }
        for (i, &len) in self.seg_lens.iter().enumerate() {
            sparse::write_indices(len, self.segment(i), &mut w);
        }
    }

    /// Decodes and validates a broadcast message. Never panics; allocates no more than the
    /// message length allows.
    pub fn decode(bytes: &[u8]) -> Result<IndexSet, WireError> {
        let mut r = Reader::new(bytes);
        let magic = r.u8("index magic")?;
        if magic != INDEX_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let version = r.u8("index version")?;
        if version != INDEX_VERSION {
            return Err(WireError::UnsupportedVersion(version));
        }
        if r.u8("reserved")? != 0 || r.u8("reserved")? != 0 {
            return Err(WireError::Invalid(
                "reserved index-message bytes are not zero",
            ));
        }
        let step = r.u64("index step")?;
        let bucket = r.u64("index bucket")?;
        let n = r.u32("index n")? as usize;
        let s = r.u32("index segment count")? as usize;
        if (n == 0) != (s == 0) || s > n {
            return Err(WireError::BadSegments("index message segment count"));
        }
        let table = r.take_items(s, 4, "index segment table")?;
        let mut seg_lens = Vec::with_capacity(s);
        let mut total = 0usize;
        for i in 0..s {
            let l = u32_at(table, i) as usize;
            if l == 0 {
                return Err(WireError::BadSegments("empty segment"));
            }
            total = total
                .checked_add(l)
                .filter(|&t| t <= n)
                .ok_or(WireError::BadSegments("segments exceed n"))?;
            seg_lens.push(l);
        }
        if total != n {
            return Err(WireError::BadSegments("segments do not cover n"));
        }
        let mut starts = Vec::with_capacity(s + 1);
        starts.push(0);
        let mut idx = Vec::new();
        for &len in &seg_lens {
            sparse::read_indices(&mut r, len, &mut idx)?;
            starts.push(idx.len());
        }
        if r.remaining() != 0 {
            return Err(WireError::TrailingBytes(r.remaining()));
        }
        Ok(IndexSet {
            step,
            bucket,
            n,
            seg_lens,
            starts,
            idx,
        })
    }
}

/// The ScaleCom (CLT-k) compressor.
#[derive(Debug, Clone)]
pub struct ScaleCom {
    cfg: ScaleComConfig,
    scratch: Scratch,
    own: Vec<u32>,
    /// The index set of the current step, per bucket.
    sets: BTreeMap<u64, IndexSet>,
    /// Bucket of the buffer being encoded.
    bucket: u64,
    /// Whether the buffer being encoded uses `sets[bucket]` (else it selects and records).
    reuse: bool,
    /// Set by `compress_with_indices`: use the installed set even on the leader.
    forced: bool,
    /// Bucket → step of a set installed by [`Compressor::install_broadcast`]: used even on
    /// the leader (which then need not select twice).
    pinned: BTreeMap<u64, u64>,
    seg: usize,
}

impl ScaleCom {
    /// The leader (rank) of `step`: `step mod P`.
    pub fn leader(&self, step: u64) -> u32 {
        (step % self.cfg.workers as u64) as u32
    }

    /// Whether `ctx.rank` leads `ctx.step`.
    pub fn is_leader(&self, ctx: &Ctx<'_>) -> bool {
        self.leader(ctx.step) == ctx.rank
    }

    /// Entries kept in a segment of `n` elements.
    pub fn k_for(&self, n: usize) -> usize {
        k_for(n, self.cfg.ratio)
    }

    /// Phase 1, on the leader: the top-k index set of its compensated gradient, per
    /// segment (`k = ⌈ρ·len⌉`, ties → smaller index).
    pub fn leader_indices(
        &mut self,
        compensated: &[f32],
        ctx: &Ctx<'_>,
    ) -> Result<IndexSet, CompressError> {
        let n = compensated.len();
        if n > MAX_ELEMS {
            return Err(CompressError::TooLarge(n));
        }
        if let Some((index, value)) = first_non_finite(compensated) {
            return Err(CompressError::NonFinite { index, value });
        }
        let segs = effective_segments(n, ctx.segments)?;
        let mut starts = vec![0];
        let mut idx = Vec::new();
        for s in &segs {
            let x = &compensated[s.clone()];
            top_k(
                x.len(),
                self.k_for(x.len()),
                |i| abs_key(x[i]),
                &mut self.scratch,
                &mut self.own,
            );
            idx.extend_from_slice(&self.own);
            starts.push(idx.len());
        }
        Ok(IndexSet {
            step: ctx.step,
            bucket: ctx.bucket,
            n,
            seg_lens: segs.iter().map(|s| s.len()).collect(),
            starts,
            idx,
        })
    }

    /// Phase 2, on every worker: compresses `compensated` at the shared `indices` into
    /// `out`. Fails if the set does not belong to this step, bucket and segment layout, or
    /// does not hold `⌈ρ·len⌉` indices per segment.
    pub fn compress_with_indices(
        &mut self,
        compensated: &[f32],
        ctx: &Ctx<'_>,
        indices: &IndexSet,
        out: &mut Payload,
    ) -> Result<(), CompressError> {
        self.check_set(indices, compensated.len(), ctx)
            .map_err(|m| CompressError::BadSegments(format!("index set: {m}")))?;
        self.set_indices(indices.clone());
        self.forced = true;
        let r = compressor::compress(self, compensated, ctx, &mut Rng::seed_from_u64(0), out);
        self.forced = false;
        r
    }

    /// Checks that `set` belongs to `ctx`'s step and bucket, describes a buffer of `n`
    /// elements with `ctx`'s segment layout, and holds `⌈ρ·len⌉` indices per segment.
    fn check_set(&self, set: &IndexSet, n: usize, ctx: &Ctx<'_>) -> Result<(), String> {
        let segs = effective_segments(n, ctx.segments).map_err(|e| e.to_string())?;
        if set.step != ctx.step || set.bucket != ctx.bucket {
            return Err(format!(
                "chosen for step {} bucket {}, not step {} bucket {}",
                set.step, set.bucket, ctx.step, ctx.bucket
            ));
        }
        if set.n != n
            || set.seg_lens.len() != segs.len()
            || set.seg_lens.iter().zip(&segs).any(|(&l, s)| l != s.len())
        {
            return Err("segment layout differs from the buffer's".into());
        }
        for (i, &l) in set.seg_lens.iter().enumerate() {
            if set.segment(i).len() != self.k_for(l) {
                return Err("wrong number of indices for the configured ratio".into());
            }
        }
        Ok(())
    }

    /// Installs a (received) index set for its `(step, bucket)`: the next plain compress of
    /// that bucket at that step with a matching layout uses it.
    pub fn set_indices(&mut self, set: IndexSet) {
        self.sets.insert(set.bucket, set);
    }

    /// The index set last installed or chosen for `bucket` (the leader broadcasts this
    /// after a plain compress).
    pub fn indices_for(&self, bucket: u64) -> Option<&IndexSet> {
        self.sets.get(&bucket)
    }

    fn matches(&self, set: &IndexSet, n: usize, ctx: &Ctx<'_>) -> bool {
        if set.step != ctx.step || set.bucket != ctx.bucket || set.n != n {
            return false;
        }
        let lens: Vec<usize> = if ctx.segments.is_empty() {
            if n == 0 {
                vec![]
            } else {
                vec![n]
            }
        } else {
            ctx.segments.iter().map(|r| r.len()).collect()
        };
        set.seg_lens == lens && (0..lens.len()).all(|i| set.segment(i).len() == self.k_for(lens[i]))
    }
}

impl Compressor for ScaleCom {
    fn method(&self) -> MethodId {
        ScaleComConfig::ID
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Summable
    }
    fn begin(&mut self, grad: &[f32], ctx: &Ctx<'_>) {
        self.seg = 0;
        self.bucket = ctx.bucket;
        let n = grad.len();
        let pinned = self.pinned.get(&ctx.bucket) == Some(&ctx.step);
        self.reuse = (self.forced || pinned || !self.is_leader(ctx))
            && self
                .sets
                .get(&ctx.bucket)
                .is_some_and(|s| self.matches(s, n, ctx));
        if !self.reuse {
            self.sets.insert(
                ctx.bucket,
                IndexSet {
                    step: ctx.step,
                    bucket: ctx.bucket,
                    n,
                    seg_lens: Vec::new(),
                    starts: vec![0],
                    idx: Vec::new(),
                },
            );
        }
    }
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        let n = x.len();
        let set = self
            .sets
            .get_mut(&self.bucket)
            .expect("begin installs the bucket's set");
        if self.reuse {
            sparse::write_indexed(n, set.segment(self.seg), |i| x[i as usize], w);
        } else {
            let k = k_for(n, self.cfg.ratio);
            top_k_abs(x, k, &mut self.scratch, &mut self.own);
            sparse::write_indexed(n, &self.own, |i| x[i as usize], w);
            set.seg_lens.push(n);
            set.idx.extend_from_slice(&self.own);
            set.starts.push(set.idx.len());
        }
        self.seg += 1;
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        sparse::read_indexed_add(r, out)
    }
    fn decode_segment_add_touched(
        &self,
        r: &mut Reader<'_>,
        out: &mut [f32],
        touched: &mut Touched,
    ) -> Result<(), WireError> {
        sparse::read_indexed_add_touched(r, out, touched)
    }
    /// `None`: the index set's size depends on where the entries are (see [`sparse`]).
    fn segment_bits(&self, _n: usize) -> Option<u64> {
        None
    }
    fn segment_lane(&self, r: &mut Reader<'_>, len: usize) -> Result<Range<usize>, WireError> {
        segment_lane(r, len)
    }
    /// The leader rotates over the exchanger's world size (overriding `workers`).
    fn set_world_size(&mut self, world: usize) {
        self.cfg.workers = world.clamp(1, u32::MAX as usize) as u32;
    }
    /// CLT-k is two-phase: the step's leader broadcasts its index set.
    fn broadcast_root(&self, ctx: &Ctx<'_>) -> Option<usize> {
        Some(self.leader(ctx.step) as usize)
    }
    /// The encoded [`IndexSet`] of [`ScaleCom::leader_indices`].
    fn broadcast_message(
        &mut self,
        compensated: &[f32],
        ctx: &Ctx<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), CompressError> {
        self.leader_indices(compensated, ctx)?.encode(out);
        Ok(())
    }
    /// Decodes and validates the leader's [`IndexSet`] and pins it for `(step, bucket)`:
    /// the next compress of the bucket uses it on every rank, the leader included.
    fn install_broadcast(
        &mut self,
        message: &[u8],
        n: usize,
        ctx: &Ctx<'_>,
    ) -> Result<(), CompressError> {
        let set = IndexSet::decode(message)
            .map_err(|e| CompressError::Agreement(format!("index broadcast: {e}")))?;
        self.check_set(&set, n, ctx)
            .map_err(|m| CompressError::Agreement(format!("index broadcast: {m}")))?;
        self.pinned.insert(ctx.bucket, ctx.step);
        self.set_indices(set);
        Ok(())
    }
    fn ratio_metric(&self) -> Option<(&'static str, f64)> {
        Some(("density", self.cfg.ratio))
    }
}

/// Byte ranges of the summable `f32` value lanes (one per segment) in a ScaleCom payload.
/// Everything outside the lanes (header, counts, indices) is identical on all workers that
/// used the same index set.
pub fn value_lanes(payload: &[u8]) -> Result<Vec<Range<usize>>, WireError> {
    let mut r = Reader::new(payload);
    // The fixed header is 12 bytes; Payload::decode validates it.
    let h = Payload::decode(payload[..payload.len().min(12)].to_vec())?.header()?;
    if h.method != ScaleComConfig::ID.0 {
        return Err(WireError::WrongMethod {
            expected: ScaleComConfig::ID.0,
            found: h.method,
        });
    }
    r.take(12, "header")?;
    let lens: Vec<usize> = if h.segments > 1 {
        let t = r.take_items(h.segments, 4, "segment table")?;
        (0..h.segments).map(|i| u32_at(t, i) as usize).collect()
    } else if h.n > 0 {
        vec![h.n]
    } else {
        vec![]
    };
    let mut lanes = Vec::with_capacity(lens.len());
    for n in lens {
        lanes.push(segment_lane(&mut r, n)?);
    }
    if r.remaining() != 0 {
        return Err(WireError::TrailingBytes(r.remaining()));
    }
    Ok(lanes)
}

/// Skips one ScaleCom segment body of `len` elements in `r` and returns the byte range of
/// its `f32` value lane (relative to the reader's buffer). This is the body of the seam's
/// per-segment lane hook for summable methods.
pub fn segment_lane(r: &mut Reader<'_>, len: usize) -> Result<Range<usize>, WireError> {
    let k = sparse::skip_indices(r, len)?;
    let start = r.position();
    r.take_items(k, 4, "sparse values")?;
    Ok(start..r.position())
}

/// Adds the value lanes of `other` into `acc` (what an all-reduce does to ScaleCom
/// payloads). Fails unless both are valid ScaleCom payloads of identical length whose bytes
/// outside the lanes (layout, counts, indices) are identical, i.e. they share an index set.
pub fn add_summable(acc: &mut [u8], other: &[u8]) -> Result<(), WireError> {
    let lanes = value_lanes(acc)?;
    if other.len() != acc.len() {
        return Err(WireError::Invalid("summable payloads differ in length"));
    }
    let mut at = 0;
    for l in &lanes {
        if acc[at..l.start] != other[at..l.start] {
            return Err(WireError::Invalid(
                "summable payloads use different index sets",
            ));
        }
        at = l.end;
    }
    if acc[at..] != other[at..] {
        return Err(WireError::Invalid(
            "summable payloads use different index sets",
        ));
    }
    for l in lanes {
        for j in (l.start..l.end).step_by(4) {
            let s = f32_at(&acc[j..j + 4], 0) + f32_at(&other[j..j + 4], 0);
            acc[j..j + 4].copy_from_slice(&s.to_le_bytes());
        }
    }
    Ok(())
}

/// One worker's ScaleCom step driver: compressor + low-pass memory + scratch, so the
/// trainer only moves bytes. Per step and bucket:
/// 1. [`ScaleComWorker::compensate`] (every worker);
/// 2. on the leader ([`ScaleComWorker::is_leader`]): [`ScaleComWorker::leader_message`],
///    then broadcast the bytes;
/// 3. [`ScaleComWorker::compress`] with the received message (every worker): compresses at
///    the shared set and updates the memory;
/// 4. all-reduce the [`value_lanes`] of the payloads (or [`add_summable`]), decode the sum
///    once with [`ScaleComWorker::decompress_add`], divide by P.
pub struct ScaleComWorker {
    sc: ScaleCom,
    memory: LowPass,
    compensated: Vec<f32>,
    transmitted: Vec<f32>,
}

impl ScaleComWorker {
    /// A worker from a compressor config and the memory's β in (0, 1].
    pub fn new(cfg: &ScaleComConfig, beta: f32) -> Result<Self, ConfigError> {
        if !(beta.is_finite() && beta > 0.0 && beta <= 1.0) {
            return Err(ConfigError::new("memory.beta", "must be in (0, 1]"));
        }
        Ok(ScaleComWorker {
            sc: cfg.init()?,
            memory: LowPass::new(beta),
            compensated: Vec::new(),
            transmitted: Vec::new(),
        })
    }

    /// The compressor.
    pub fn compressor(&self) -> &ScaleCom {
        &self.sc
    }

    /// The memory (checkpoints: [`Memory::export`] / [`Memory::import`]).
    pub fn memory_mut(&mut self) -> &mut LowPass {
        &mut self.memory
    }

    /// Whether this rank leads `ctx.step`.
    pub fn is_leader(&self, ctx: &Ctx<'_>) -> bool {
        self.sc.is_leader(ctx)
    }

    /// Step 1: `p = m + g` for bucket `ctx.bucket`; returns `p`.
    pub fn compensate(&mut self, grad: &[f32], ctx: &Ctx<'_>) -> &[f32] {
        self.compensated.resize(grad.len(), 0.0);
        self.memory
            .compensate(ctx.bucket, grad, &mut self.compensated);
        &self.compensated
    }

    /// Step 2, leader only: the encoded index broadcast for the compensated buffer.
    pub fn leader_message(
        &mut self,
        ctx: &Ctx<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), CompressError> {
        let set = self.sc.leader_indices(&self.compensated, ctx)?;
        set.encode(out);
        Ok(())
    }

    /// Step 3: decodes the broadcast `message`, compresses the compensated buffer at its
    /// set into `out` and updates the memory with what was sent.
    pub fn compress(
        &mut self,
        message: &[u8],
        ctx: &Ctx<'_>,
        out: &mut Payload,
    ) -> Result<(), CompressError> {
        let set = IndexSet::decode(message)
            .map_err(|e| CompressError::BadSegments(format!("index message: {e}")))?;
        self.sc
            .compress_with_indices(&self.compensated, ctx, &set, out)?;
        self.transmitted.clear();
        self.transmitted.resize(self.compensated.len(), 0.0);
        compressor::decompress_add(&self.sc, out.as_bytes(), &mut self.transmitted)
            .expect("a payload this process just encoded decodes");
        self.memory.update(
            ctx.bucket,
            &self.compensated,
            &self.transmitted,
            ctx.segments,
        );
        Ok(())
    }

    /// Step 4: decodes a (summed) payload and adds it into `out`.
    pub fn decompress_add(&self, bytes: &[u8], out: &mut [f32]) -> Result<(), WireError> {
        compressor::decompress_add(&self.sc, bytes, out)
    }
}

/// Contraction diagnostic of ALGORITHMS.md §12.5: `‖u − C_I(u)‖² / ‖u‖²` for the shared
/// set `set` (0 for a zero `u`). Logged, not asserted: it measures how well the leader's
/// set suits this worker.
///
/// # Panics
/// If `u.len() != set.n()`.
pub fn contraction(u: &[f32], set: &IndexSet) -> f64 {
    assert_eq!(u.len(), set.n(), "buffer and index set differ in length");
    let total: f64 = u.iter().map(|&x| (x as f64) * (x as f64)).sum();
    if total == 0.0 {
        return 0.0;
    }
    let kept: f64 = set
        .global_indices()
        .iter()
        .map(|&i| (u[i as usize] as f64).powi(2))
        .sum();
    ((total - kept) / total).max(0.0)
}

/// Jaccard overlap `|A ∩ B| / |A ∪ B|` of two ascending index lists (1 for two empty
/// lists): the similarity between the leader's set and a worker's own top-k.
pub fn jaccard(a: &[u32], b: &[u32]) -> f64 {
    let (mut i, mut j, mut both) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                both += 1;
                i += 1;
                j += 1;
            }
        }
    }
    let union = a.len() + b.len() - both;
    if union == 0 {
        1.0
    } else {
        both as f64 / union as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, decompress_add, payload_bits};
    use crate::memory::Residual;
    use crate::pipeline::Pipeline;

    fn sc(ratio: f64, workers: u32) -> ScaleCom {
        ScaleComConfig { ratio, workers }.init().unwrap()
    }

    fn vecs(p: usize, n: usize, seed: u64) -> Vec<Vec<f32>> {
        let mut r = Rng::seed_from_u64(seed);
        (0..p)
            .map(|_| (0..n).map(|_| r.next_f32() * 2.0 - 1.0).collect())
            .collect()
    }

    fn brute_top_k(x: &[f32], k: usize) -> Vec<u32> {
        let mut idx: Vec<u32> = (0..x.len() as u32).collect();
        idx.sort_by(|&a, &b| {
            abs_key(x[b as usize])
                .cmp(&abs_key(x[a as usize]))
                .then(a.cmp(&b))
        });
        idx.truncate(k);
        idx.sort();
        idx
    }

    /// One simulated step of P workers: returns (index message, payloads, summed payload).
    fn step(c: &mut [ScaleCom], u: &[Vec<f32>], ctx: &Ctx<'_>) -> (Vec<u8>, Vec<Payload>, Vec<u8>) {
        let leader = c[0].leader(ctx.step) as usize;
        let lctx = Ctx {
            rank: leader as u32,
            ..*ctx
        };
        assert!(c[leader].is_leader(&lctx));
        let set = c[leader].leader_indices(&u[leader], &lctx).unwrap();
        let mut msg = Vec::new();
        set.encode(&mut msg);
        let received = IndexSet::decode(&msg).unwrap();
        assert_eq!(received, set);
        let mut payloads = Vec::new();
        for (i, (ci, ui)) in c.iter_mut().zip(u).enumerate() {
            let wctx = Ctx {
                rank: i as u32,
                ..*ctx
            };
            let mut p = Payload::new();
            ci.compress_with_indices(ui, &wctx, &received, &mut p)
                .unwrap();
            payloads.push(p);
        }
        let mut acc = payloads[0].as_bytes().to_vec();
        for p in &payloads[1..] {
            add_summable(&mut acc, p.as_bytes()).unwrap();
        }
        (msg, payloads, acc)
    }

    #[test]
    fn compress_then_sum_equals_sum_then_compress() {
        let (p, n) = (4, 10_000);
        let segs = [0..3000, 3000..n];
        let mut c: Vec<ScaleCom> = (0..p).map(|_| sc(0.02, p as u32)).collect();
        for t in 0..6u64 {
            let u = vecs(p, n, t);
            let ctx = Ctx {
                step: t,
                bucket: 2,
                segments: &segs,
                ..Ctx::default()
            };
            let (msg, _, acc) = step(&mut c, &u, &ctx);
            let set = IndexSet::decode(&msg).unwrap();
            let mut total = u[0].clone();
            for ui in &u[1..] {
                for (s, &x) in total.iter_mut().zip(ui) {
                    *s += x;
                }
            }
            let mut direct = Payload::new();
            c[0].compress_with_indices(&total, &ctx, &set, &mut direct)
                .unwrap();
            assert_eq!(acc, direct.as_bytes(), "C_I(Σu) == ΣC_I(u) bytewise");
            let mut out = vec![0f32; n];
            decompress(&c[0], &acc, &mut out).unwrap();
            let g = set.global_indices();
            for (j, &o) in out.iter().enumerate() {
                if g.binary_search(&(j as u32)).is_ok() {
                    assert_eq!(o, total[j]);
                } else {
                    assert_eq!(o, 0.0);
                }
            }
        }
    }

    #[test]
    fn leader_rotates_and_picks_its_own_top_k() {
        let (p, n) = (5usize, 4000);
        let mut c: Vec<ScaleCom> = (0..p).map(|_| sc(0.01, p as u32)).collect();
        let mut leaders = Vec::new();
        for t in 0..(2 * p) as u64 {
            let u = vecs(p, n, 100 + t);
            let ctx = Ctx {
                step: t,
                ..Ctx::default()
            };
            let (msg, payloads, _) = step(&mut c, &u, &ctx);
            let leader = c[0].leader(t) as usize;
            leaders.push(leader);
            let set = IndexSet::decode(&msg).unwrap();
            assert_eq!(set.len(), 40);
            assert_eq!(set.segment(0), brute_top_k(&u[leader], 40).as_slice());
            // Every worker's payload holds the same indices: identical outside the lanes.
            let lanes = value_lanes(payloads[0].as_bytes()).unwrap();
            for w in &payloads[1..] {
                let b = w.as_bytes();
                assert_eq!(value_lanes(b).unwrap(), lanes);
                assert_eq!(
                    b[..lanes[0].start],
                    payloads[0].as_bytes()[..lanes[0].start]
                );
            }
        }
        let mut first: Vec<usize> = leaders[..p].to_vec();
        first.sort();
        assert_eq!(first, (0..p).collect::<Vec<_>>(), "each worker leads once");
        assert_eq!(leaders[p..], leaders[..p]);
    }

    #[test]
    fn bytes_per_worker_do_not_depend_on_p() {
        let n = 50_000;
        let mut sizes = Vec::new();
        for p in [1usize, 2, 4, 8] {
            let mut c: Vec<ScaleCom> = (0..p).map(|_| sc(0.01, p as u32)).collect();
            let u = vecs(p, n, p as u64);
            let (msg, payloads, acc) = step(&mut c, &u, &Ctx::default());
            for w in &payloads {
                assert_eq!(w.encoded_len(), payloads[0].encoded_len());
            }
            let lane: usize = value_lanes(&acc).unwrap().iter().map(|l| l.len()).sum();
            assert_eq!(lane, 4 * 500);
            sizes.push((payloads[0].encoded_len(), msg.len(), lane));
        }
        // The value lane is exactly the same for every P; the coded index set (in the
        // payload and in the leader's broadcast) varies a little with where the entries
        // fall, never with P itself, and costs well under the 4 bytes per index of a u32
        // list.
        let spread = |f: fn(&(usize, usize, usize)) -> usize| {
            let (lo, hi) = sizes
                .iter()
                .map(f)
                .fold((usize::MAX, 0), |(lo, hi), v| (lo.min(v), hi.max(v)));
            assert!(hi - lo <= lo / 50, "sizes vary by more than 2 %: {sizes:?}");
            hi
        };
        assert!(spread(|s| s.0) < 4 * 500 + 2 * 500, "{sizes:?}");
        assert!(spread(|s| s.1) < 4 * 500, "{sizes:?}");
        assert_eq!(payload_bits(&sc(0.01, 1), &[n]), None);
    }

    #[test]
    fn one_worker_plain_path_is_its_own_leader() {
        let n = 3000;
        let u = vecs(1, n, 9).remove(0);
        let segs = [0..1000, 1000..n];
        let ctx = Ctx {
            segments: &segs,
            ..Ctx::default()
        };
        let mut c = sc(0.05, 1);
        let plain = compress_new(&mut c, &u, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        let set = c.leader_indices(&u, &ctx).unwrap();
        let mut two = Payload::new();
        c.compress_with_indices(&u, &ctx, &set, &mut two).unwrap();
        assert_eq!(plain, two);
    }

    #[test]
    fn plain_path_drives_p_workers_with_installed_sets() {
        // Leader compresses first through the plain path, its set is broadcast, the others
        // install it and compress through the plain path too.
        let (p, n) = (3usize, 6000);
        let segs = [0..2000, 2000..n];
        let mut c: Vec<ScaleCom> = (0..p).map(|_| sc(0.01, p as u32)).collect();
        for t in 0..4u64 {
            let u = vecs(p, n, 70 + t);
            let leader = c[0].leader(t) as usize;
            let ctx = |rank: u32| Ctx {
                step: t,
                rank,
                bucket: 9,
                segments: &segs,
            };
            let mut rng = Rng::seed_from_u64(0);
            let lead =
                compress_new(&mut c[leader], &u[leader], &ctx(leader as u32), &mut rng).unwrap();
            let mut msg = Vec::new();
            c[leader].indices_for(9).unwrap().encode(&mut msg);
            assert_eq!(
                c[leader].indices_for(9).unwrap().global_indices(),
                brute_top_k(&u[leader][..2000], 20)
                    .into_iter()
                    .chain(
                        brute_top_k(&u[leader][2000..], 40)
                            .into_iter()
                            .map(|i| i + 2000)
                    )
                    .collect::<Vec<_>>()
            );
            let mut acc = lead.as_bytes().to_vec();
            let mut separate = vec![0f32; n];
            decompress_add(&c[0], lead.as_bytes(), &mut separate).unwrap();
            for i in (0..p).filter(|&i| i != leader) {
                c[i].set_indices(IndexSet::decode(&msg).unwrap());
                let pi = compress_new(&mut c[i], &u[i], &ctx(i as u32), &mut rng).unwrap();
                decompress_add(&c[0], pi.as_bytes(), &mut separate).unwrap();
                add_summable(&mut acc, pi.as_bytes()).unwrap();
            }
            let mut summed = vec![0f32; n];
            decompress(&c[0], &acc, &mut summed).unwrap();
            for j in 0..n {
                assert!((summed[j] - separate[j]).abs() <= 1e-6 * (1.0 + separate[j].abs()));
            }
        }
        // A set for another step is not reused: the worker selects its own top-k.
        let u = vecs(1, n, 1).remove(0);
        let stale = Ctx {
            step: 99,
            bucket: 9,
            segments: &segs,
            ..Ctx::default()
        };
        compress_new(&mut c[1], &u, &stale, &mut Rng::seed_from_u64(0)).unwrap();
        assert_eq!(c[1].indices_for(9).unwrap().step, 99);
        assert_eq!(
            c[1].indices_for(9).unwrap().segment(0),
            brute_top_k(&u[..2000], 20).as_slice()
        );
    }

    #[test]
    fn leader_reselects_but_compress_with_indices_obeys_the_set() {
        let n = 4000;
        let u = vecs(2, n, 12);
        let mut c = sc(0.01, 2);
        let ctx = Ctx::default(); // rank 0 leads step 0
        let own = c.leader_indices(&u[0], &ctx).unwrap();
        let other = c.leader_indices(&u[1], &ctx).unwrap();
        assert_ne!(own, other);
        let mut p = Payload::new();
        c.compress_with_indices(&u[0], &ctx, &other, &mut p)
            .unwrap();
        let mut out = vec![0f32; n];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        let nz: Vec<u32> = (0..n as u32).filter(|&j| out[j as usize] != 0.0).collect();
        assert_eq!(nz, other.global_indices());
        // A plain compress on the leader re-selects from its own data.
        let q = compress_new(&mut c, &u[0], &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        decompress(&c, q.as_bytes(), &mut out).unwrap();
        let nz: Vec<u32> = (0..n as u32).filter(|&j| out[j as usize] != 0.0).collect();
        assert_eq!(nz, own.global_indices());
    }

    #[test]
    fn contraction_and_overlap_diagnostics() {
        let n = 1000;
        let u = vecs(2, n, 31);
        let mut c = sc(0.1, 2);
        let own = c.leader_indices(&u[0], &Ctx::default()).unwrap();
        let other = c.leader_indices(&u[1], &Ctx::default()).unwrap();
        // The own top-k is the best set of its size: contraction ≤ 1 − k/n and ≤ any other.
        let a = contraction(&u[0], &own);
        let b = contraction(&u[0], &other);
        assert!(a <= 1.0 - 0.1 + 1e-12 && a <= b && b < 1.0, "{a} {b}");
        assert_eq!(jaccard(&own.global_indices(), &own.global_indices()), 1.0);
        let j = jaccard(&own.global_indices(), &other.global_indices());
        assert!((0.0..1.0).contains(&j));
        assert_eq!(jaccard(&[1, 2, 3], &[2, 3, 4]), 0.5);
        assert_eq!(jaccard(&[], &[]), 1.0);
    }

    #[test]
    fn worker_driver_runs_p_workers_with_a_low_pass_memory() {
        let (p, n, beta) = (4usize, 3000, 0.5f32);
        let segs = [0..1000, 1000..n];
        let cfg = ScaleComConfig {
            ratio: 0.02,
            workers: p as u32,
        };
        let mut w: Vec<ScaleComWorker> = (0..p)
            .map(|_| ScaleComWorker::new(&cfg, beta).unwrap())
            .collect();
        assert!(ScaleComWorker::new(&cfg, 0.0).is_err());
        for t in 0..6u64 {
            let g = vecs(p, n, 200 + t);
            let ctx = |rank: usize| Ctx {
                step: t,
                rank: rank as u32,
                bucket: 4,
                segments: &segs,
            };
            let mut compensated = Vec::new();
            let mut before = Vec::new();
            for (i, wi) in w.iter_mut().enumerate() {
                before.push(wi.memory_mut().memory_of(4).map(|m| m.to_vec()));
                compensated.push(wi.compensate(&g[i], &ctx(i)).to_vec());
            }
            let leader = (t % p as u64) as usize;
            assert!(w[leader].is_leader(&ctx(leader)));
            let mut msg = Vec::new();
            w[leader].leader_message(&ctx(leader), &mut msg).unwrap();
            let mut payloads = Vec::new();
            for (i, wi) in w.iter_mut().enumerate() {
                let mut out = Payload::new();
                wi.compress(&msg, &ctx(i), &mut out).unwrap();
                payloads.push(out);
            }
            let mut acc = payloads[0].as_bytes().to_vec();
            for q in &payloads[1..] {
                add_summable(&mut acc, q.as_bytes()).unwrap();
            }
            let mut sum = vec![0f32; n];
            w[0].decompress_add(&acc, &mut sum).unwrap();
            let set = IndexSet::decode(&msg).unwrap().global_indices();
            for (i, wi) in w.iter_mut().enumerate() {
                let m = wi.memory_mut().memory_of(4).unwrap().to_vec();
                for j in 0..n {
                    let sent = if set.binary_search(&(j as u32)).is_ok() {
                        compensated[i][j]
                    } else {
                        0.0
                    };
                    let old = before[i].as_ref().map_or(0.0, |b| b[j]);
                    let want = (1.0 - beta) * old + beta * (compensated[i][j] - sent);
                    assert!((m[j] - want).abs() <= 1e-6 * (1.0 + want.abs()));
                }
            }
            for &j in &set {
                let direct: f32 = compensated.iter().map(|c| c[j as usize]).sum();
                assert!((sum[j as usize] - direct).abs() <= 1e-5 * (1.0 + direct.abs()));
            }
        }
        // A corrupted broadcast is an error, not a panic.
        let mut out = Payload::new();
        let ctx = Ctx::default();
        w[0].compensate(&vecs(1, n, 1)[0], &ctx);
        assert!(w[0].compress(&[0xD9, 1, 0], &ctx, &mut out).is_err());
    }

    #[test]
    fn index_sets_are_validated() {
        let n = 2000;
        let u = vecs(1, n, 3).remove(0);
        let mut c = sc(0.01, 2);
        let ctx = Ctx {
            step: 4,
            bucket: 1,
            ..Ctx::default()
        };
        let set = c.leader_indices(&u, &ctx).unwrap();
        let mut out = Payload::new();
        let stale = Ctx { step: 5, ..ctx };
        assert!(c.compress_with_indices(&u, &stale, &set, &mut out).is_err());
        let segs = [0..1000, 1000..n];
        let split = Ctx {
            segments: &segs,
            ..ctx
        };
        assert!(c.compress_with_indices(&u, &split, &set, &mut out).is_err());
        let other = sc(0.02, 2);
        let mut other = other;
        assert!(other
            .compress_with_indices(&u, &ctx, &set, &mut out)
            .is_err());
        // Different index sets are not summable.
        let mut a = compress_new(&mut c, &u, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        let v = vecs(1, n, 4).remove(0);
        let b = compress_new(&mut sc(0.01, 2), &v, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        assert!(add_summable(a.bytes_mut(), b.as_bytes()).is_err());
    }

    #[test]
    fn decoders_never_panic_on_arbitrary_bytes() {
        let n = 3000;
        let segs = [0..7, 7..n];
        let ctx = Ctx {
            segments: &segs,
            ..Ctx::default()
        };
        let u = vecs(1, n, 5).remove(0);
        let mut c = sc(0.05, 3);
        let set = c.leader_indices(&u, &ctx).unwrap();
        let mut msg = Vec::new();
        set.encode(&mut msg);
        let mut payload = Payload::new();
        c.compress_with_indices(&u, &ctx, &set, &mut payload)
            .unwrap();
        let good = payload.into_bytes();
        let mut rng = Rng::seed_from_u64(1);
        let (mut bad_msg, mut bad_payload) = (0, 0);
        for trial in 0..4000 {
            let src = if trial % 2 == 0 { &msg } else { &good };
            let mut b = src.clone();
            match trial % 6 {
                0 | 1 => {
                    let i = rng.below(b.len() as u64) as usize;
                    b[i] ^= 1 << rng.below(8);
                }
                2 | 3 => b.truncate(rng.below(b.len() as u64) as usize),
                _ => {
                    let len = rng.below(80) as usize;
                    b = (0..len).map(|_| rng.next_u64() as u8).collect();
                }
            }
            if IndexSet::decode(&b).is_err() {
                bad_msg += 1;
            }
            let mut out = vec![0f32; n];
            if decompress_add(&c, &b, &mut out).is_err() {
                bad_payload += 1;
            }
            let _ = value_lanes(&b);
            let mut acc = good.clone();
            let _ = add_summable(&mut acc, &b);
        }
        assert!(
            bad_msg > 1500 && bad_payload > 1500,
            "{bad_msg} {bad_payload}"
        );
    }

    #[test]
    fn low_pass_with_beta_one_is_plain_error_feedback() {
        let n = 5000;
        let mk = || ScaleComConfig {
            ratio: 0.01,
            workers: 1,
        };
        let mut a = Pipeline::new(Box::new(mk().init().unwrap()), Box::new(LowPass::new(1.0)));
        let mut b = Pipeline::new(
            Box::new(mk().init().unwrap()),
            Box::new(Residual::new(1.0, 1.0)),
        );
        let (mut pa, mut pb) = (Payload::new(), Payload::new());
        for t in 0..8u64 {
            let g = vecs(1, n, 50 + t).remove(0);
            let ctx = Ctx {
                step: t,
                bucket: 3,
                ..Ctx::default()
            };
            a.compress(&g, &ctx, &mut Rng::seed_from_u64(t), &mut pa)
                .unwrap();
            b.compress(&g, &ctx, &mut Rng::seed_from_u64(t), &mut pb)
                .unwrap();
            assert_eq!(pa, pb, "step {t}");
            assert_eq!(a.memory().export(), b.memory().export());
        }
    }

    #[test]
    fn trait_two_phase_protocol_through_pipelines_matches_the_worker_driver() {
        // The generic hooks (what the framework's exchanger calls through
        // `Box<dyn Compressor>`) produce the same payloads and memories as `ScaleComWorker`.
        let (p, n, beta) = (3usize, 3000, 0.5f32);
        let segs = [0..1000, 1000..n];
        let cfg = ScaleComConfig {
            ratio: 0.02,
            workers: p as u32,
        };
        let mut workers: Vec<ScaleComWorker> = (0..p)
            .map(|_| ScaleComWorker::new(&cfg, beta).unwrap())
            .collect();
        let mut pipes: Vec<Pipeline> = (0..p)
            .map(|_| {
                // Configured for one worker: the driver's world size overrides it.
                let mut c = ScaleComConfig {
                    workers: 1,
                    ..cfg.clone()
                }
                .init()
                .unwrap();
                c.set_world_size(p);
                Pipeline::new(Box::new(c), Box::new(LowPass::new(beta)))
            })
            .collect();
        for t in 0..5u64 {
            let g = vecs(p, n, 300 + t);
            let ctx = |rank: usize| Ctx {
                step: t,
                rank: rank as u32,
                bucket: 2,
                segments: &segs,
            };
            let leader = (t % p as u64) as usize;
            let mut msg = Vec::new();
            for (i, pipe) in pipes.iter_mut().enumerate() {
                assert_eq!(pipe.broadcast_root(&ctx(i)), Some(leader));
                pipe.compensate(&g[i], &ctx(i));
                workers[i].compensate(&g[i], &ctx(i));
            }
            pipes[leader]
                .broadcast_message(&ctx(leader), &mut msg)
                .unwrap();
            let mut want = Vec::new();
            workers[leader]
                .leader_message(&ctx(leader), &mut want)
                .unwrap();
            assert_eq!(msg, want);
            for i in 0..p {
                pipes[i].install_broadcast(&msg, &ctx(i)).unwrap();
                let (mut a, mut b) = (Payload::new(), Payload::new());
                pipes[i]
                    .compress_compensated(&ctx(i), &mut Rng::seed_from_u64(0), &mut a)
                    .unwrap();
                workers[i].compress(&msg, &ctx(i), &mut b).unwrap();
                assert_eq!(a, b, "step {t} rank {i}");
                assert_eq!(
                    pipes[i].memory().export().get(&2),
                    workers[i]
                        .memory_mut()
                        .memory_of(2)
                        .map(|m| m.to_vec())
                        .as_ref()
                );
            }
        }
    }

    #[test]
    fn installed_broadcasts_are_validated_and_bind_the_leader_too() {
        let n = 2000;
        let u = vecs(2, n, 8);
        let mut c = sc(0.01, 2);
        let ctx = Ctx {
            step: 4,
            bucket: 1,
            ..Ctx::default()
        }; // rank 0 leads step 4
        assert_eq!(c.broadcast_root(&ctx), Some(0));
        assert_eq!(c.ratio_metric(), Some(("density", 0.01)));
        let mut other = Vec::new();
        c.broadcast_message(&u[1], &ctx, &mut other).unwrap();
        let agreement = |r: Result<(), CompressError>| {
            assert!(matches!(r, Err(CompressError::Agreement(_))), "{r:?}");
        };
        agreement(c.install_broadcast(&other, n, &Ctx { step: 5, ..ctx }));
        agreement(c.install_broadcast(&other, n, &Ctx { bucket: 2, ..ctx }));
        agreement(c.install_broadcast(&other, n + 1, &ctx));
        let segs = [0..1000, 1000..n];
        agreement(c.install_broadcast(
            &other,
            n,
            &Ctx {
                segments: &segs,
                ..ctx
            },
        ));
        agreement(c.install_broadcast(&other[..other.len() - 4], n, &ctx));
        agreement(sc(0.02, 2).install_broadcast(&other, n, &ctx));
        // The leader compresses at the installed set, not at its own top-k.
        c.install_broadcast(&other, n, &ctx).unwrap();
        let p = compress_new(&mut c, &u[0], &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        let mut out = vec![0f32; n];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        let nz: Vec<u32> = (0..n as u32).filter(|&j| out[j as usize] != 0.0).collect();
        assert_eq!(nz, IndexSet::decode(&other).unwrap().global_indices());
        assert_ne!(nz, brute_top_k(&u[0], 20));
        // The world size moves the leader.
        c.set_world_size(4);
        assert_eq!(c.broadcast_root(&Ctx { step: 7, ..ctx }), Some(3));
    }
}
