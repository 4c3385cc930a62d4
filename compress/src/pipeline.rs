//! Compressor + error-feedback memory, composed the way the trainer uses them.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::compressor::{self, Compressor, Ctx, Payload, Touched};
use crate::error::{CompressError, WireError};
use crate::memory::{Memory, NoMemory};
use crate::rng::Rng;

/// One bucket's compression path: `compensate → compress → (decode own payload) → update`.
///
/// Scratch buffers are kept between calls, so a steady-state step allocates nothing.
///
/// ## Two-phase methods
/// [`Pipeline::compress`] is the one-call path. A method with a pre-compression agreement
/// ([`Compressor::broadcast_root`], e.g. ScaleCom's leader-chosen index set) is driven in
/// steps around the broadcast, with the memory composition still in here:
/// ```text
/// p = pipe.compensate(grad, ctx)                                   every rank
/// if rank == root: pipe.broadcast_message(ctx, &mut msg)            (from p)
/// broadcast msg from root
/// pipe.install_broadcast(&msg, ctx)                                 every rank
/// pipe.compress_compensated(ctx, rng, &mut payload)                 compress p, update memory
/// ```
/// For a one-phase method `compensate` + `compress_compensated` equals `compress`.
///
/// ## Compressed all-reduce
/// The worker encodes its buffer as one payload per owner's range
/// ([`Pipeline::compress_chunks`]); each owner reduces the shares of its range with a
/// pipeline of its own ([`Pipeline::reduce_shares`]: decode, sum, re-encode), whose memory
/// is the "server" residual of two-way error feedback (Tang et al., 2021).
///
/// ## Error feedback kept by the method
/// A method may keep classic residual error feedback itself, in its own domain
/// ([`Compressor::adopt_error_feedback`]; the FFT method keeps spectra): [`Pipeline::new`]
/// offers it, and where it is taken the pipeline keeps no memory and the checkpoint state
/// goes through [`Pipeline::export_memory`] / [`Pipeline::import_memory`] either way.
pub struct Pipeline {
    compressor: Box<dyn Compressor>,
    memory: Box<dyn Memory>,
    /// The compressor took the residual over (its name for the domain).
    adopted: Option<&'static str>,
    compensated: Vec<f32>,
    transmitted: Vec<f32>,
    /// The owner's sum of the shares ([`Pipeline::reduce_shares`]).
    shares_sum: Vec<f32>,
    /// The layer boundaries inside one range ([`Pipeline::compress_chunks`]), kept between
    /// calls.
    chunk_segs: Vec<Range<usize>>,
    /// A summed agreement was installed for a method whose memory learns from the
    /// aggregate: the memory update waits for [`Pipeline::absorb_aggregate`].
    feedback_pending: bool,
    /// The caller checks its gradients for non-finite values ([`Pipeline::set_prechecked`]).
    prechecked: bool,
}

impl Pipeline {
    /// Pairs a compressor with a memory. A classic residual memory is first offered to the
    /// compressor ([`Compressor::adopt_error_feedback`]).
    pub fn new(mut compressor: Box<dyn Compressor>, memory: Box<dyn Memory>) -> Self {
        // Only a one-phase method may keep it: the agreement phases read the compensated
        // buffer, which then would not hold the residual.
        let adopted = if memory.is_classic_residual() && !crate::two_phase(compressor.as_ref()) {
            compressor.adopt_error_feedback()
        } else {
            None
        };
        let memory: Box<dyn Memory> = match adopted {
            Some(_) => Box::new(NoMemory),
            None => memory,
        };
        Pipeline {
            compressor,
            memory,
            adopted,
            compensated: Vec::new(),
            transmitted: Vec::new(),
            shares_sum: Vec::new(),
            chunk_segs: Vec::new(),
            feedback_pending: false,
            prechecked: false,
        }
    }

    /// The compressor.
    pub fn compressor(&self) -> &dyn Compressor {
        self.compressor.as_ref()
    }

    /// The compressor, mutably.
    pub fn compressor_mut(&mut self) -> &mut dyn Compressor {
        self.compressor.as_mut()
    }

    /// The memory ([`NoMemory`] where the compressor adopted the error feedback).
    pub fn memory(&self) -> &dyn Memory {
        self.memory.as_ref()
    }

    /// The memory, mutably.
    pub fn memory_mut(&mut self) -> &mut dyn Memory {
        self.memory.as_mut()
    }

    /// The domain in which the compressor keeps the error feedback it adopted
    /// ([`Compressor::adopt_error_feedback`]), or `None` where the residual is over the
    /// signal: kept by the memory, or by the compressor in
    /// [`SIGNAL_DOMAIN`](crate::memory::SIGNAL_DOMAIN) — the same state, so a checkpoint of
    /// either keeper restores into the other.
    pub fn adopted_feedback(&self) -> Option<&'static str> {
        self.adopted.filter(|d| *d != crate::memory::SIGNAL_DOMAIN)
    }

    /// Whether anything keeps error feedback: an active memory or the compressor.
    pub fn feedback_active(&self) -> bool {
        self.adopted.is_some() || self.memory.is_active()
    }

    /// The error-feedback state for a checkpoint, wherever it is kept: the memory's, or the
    /// compressor's adopted residual.
    pub fn export_memory(&self) -> BTreeMap<u64, Vec<f32>> {
        match self.adopted {
            Some(_) => self.compressor.export_feedback(),
            None => self.memory.export(),
        }
    }

    /// The residual of bucket `key` over the signal, wherever it is kept (for diagnostics and
    /// tests): the classic residual memory's buffer, or the compressor's adopted residual
    /// mapped back to the signal ([`Compressor::feedback_signal`]); `None` for other memories
    /// or an unknown bucket. `segments` are the bucket's layer boundaries, `len` its length.
    pub fn residual_signal(
        &self,
        key: u64,
        segments: &[Range<usize>],
        len: usize,
    ) -> Option<Vec<f32>> {
        if self.adopted.is_some() {
            let mut out = vec![0.0; len];
            return self
                .compressor
                .feedback_signal(key, segments, &mut out)
                .then_some(out);
        }
        if !self.memory.is_classic_residual() {
            return None;
        }
        self.memory.export().remove(&key)
    }

    /// Restores [`Pipeline::export_memory`] (an empty map clears it).
    pub fn import_memory(&mut self, state: BTreeMap<u64, Vec<f32>>) {
        match self.adopted {
            Some(_) => self.compressor.import_feedback(state),
            None => self.memory.import(state),
        }
    }

    /// Whether the caller has checked every gradient it passes to [`Pipeline::compress`]
    /// and [`Pipeline::compress_chunks`] for non-finite values (default false). Where that
    /// gradient reaches the compressor unchanged (no memory, or one the compressor adopted)
    /// the encoder then skips its own scan ([`compressor::compress_scanning`]); a
    /// compensated buffer (gradient plus residual, which may overflow) is still scanned.
    pub fn set_prechecked(&mut self, on: bool) {
        self.prechecked = on;
    }

    /// Encodes `x`, a gradient as the caller passed it (unchanged), scanning it unless the
    /// caller checked it ([`Pipeline::set_prechecked`]).
    fn encode_input(
        &mut self,
        x: &[f32],
        ctx: &Ctx<'_>,
        rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), CompressError> {
        let scan = !self.prechecked;
        compressor::compress_scanning(self.compressor.as_mut(), x, ctx, rng, out, scan)
    }

    /// Compresses `grad` for bucket `ctx.bucket` into `out`, updating the memory.
    pub fn compress(
        &mut self,
        grad: &[f32],
        ctx: &Ctx<'_>,
        rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), CompressError> {
        if !self.memory.is_active() {
            return self.encode_input(grad, ctx, rng, out);
        }
        self.compensate(grad, ctx);
        self.compress_compensated(ctx, rng, out)
    }

    /// Two-phase step 1: the memory-compensated gradient `p` of `grad` for bucket
    /// `ctx.bucket`, kept in the pipeline for the following steps (a copy of `grad` when the
    /// memory is inactive).
    pub fn compensate(&mut self, grad: &[f32], ctx: &Ctx<'_>) -> &[f32] {
        // A new step: nothing of an earlier summed agreement is pending.
        self.feedback_pending = false;
        // `Memory::compensate` overwrites every element.
        self.compensated.resize(grad.len(), 0.0);
        self.memory
            .compensate(ctx.bucket, grad, &mut self.compensated);
        &self.compensated
    }

    /// The rank whose agreement message must be installed before compressing `ctx`'s
    /// buffer, or `None` for a one-phase method ([`Compressor::broadcast_root`]).
    pub fn broadcast_root(&self, ctx: &Ctx<'_>) -> Option<usize> {
        self.compressor.broadcast_root(ctx)
    }

    /// Two-phase step 2, on the root: the agreement message for the buffer of the last
    /// [`Pipeline::compensate`] ([`Compressor::broadcast_message`]).
    pub fn broadcast_message(
        &mut self,
        ctx: &Ctx<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), CompressError> {
        self.compressor
            .broadcast_message(&self.compensated, ctx, out)
    }

    /// Two-phase step 3, on every rank: installs the root's message for the buffer of the
    /// last [`Pipeline::compensate`] ([`Compressor::install_broadcast`]).
    pub fn install_broadcast(
        &mut self,
        message: &[u8],
        ctx: &Ctx<'_>,
    ) -> Result<(), CompressError> {
        self.compressor
            .install_broadcast(message, self.compensated.len(), ctx)
    }

    /// The length of the summed agreement message for `ctx`'s buffer, or `None`
    /// ([`Compressor::summed_agreement`]).
    pub fn summed_agreement(&self, ctx: &Ctx<'_>) -> Option<usize> {
        self.compressor.summed_agreement(ctx)
    }

    /// Summed agreement, step 1 on every rank: this rank's message for the buffer of the
    /// last [`Pipeline::compensate`] ([`Compressor::sum_message`]).
    pub fn sum_message(&mut self, ctx: &Ctx<'_>, out: &mut Vec<f32>) -> Result<(), CompressError> {
        self.compressor.sum_message(&self.compensated, ctx, out)
    }

    /// Summed agreement, step 3 on every rank: installs the summed messages
    /// ([`Compressor::install_sum`]). When the method's memory learns from the aggregate,
    /// the next [`Pipeline::compress_compensated`] leaves the memory to
    /// [`Pipeline::absorb_aggregate`].
    pub fn install_sum(&mut self, summed: &[f32], ctx: &Ctx<'_>) -> Result<(), CompressError> {
        self.compressor
            .install_sum(summed, self.compensated.len(), ctx)?;
        self.feedback_pending = self.compressor.feedback_from_aggregate();
        Ok(())
    }

    /// Whether [`Pipeline::absorb_aggregate`] must be called with the step's aggregate.
    pub fn absorbs_aggregate(&self, ctx: &Ctx<'_>) -> bool {
        self.feedback_pending || self.compressor.absorbs_aggregate(ctx)
    }

    /// The step's aggregate: `summed`, the payload with its lanes summed over the ranks, and
    /// `mean`, its decode divided by the number of ranks. The compressor sees it
    /// ([`Compressor::absorb_aggregate`]); a memory that learns from the aggregate is
    /// updated with `mean` (`e = p − mean`).
    pub fn absorb_aggregate(&mut self, summed: &[u8], mean: &[f32], ctx: &Ctx<'_>) {
        self.compressor.absorb_aggregate(summed, ctx);
        if std::mem::take(&mut self.feedback_pending) && self.memory.is_active() {
            self.memory
                .update(ctx.bucket, &self.compensated, mean, ctx.segments);
        }
    }

    /// Compresses the buffer of the last [`Pipeline::compensate`] into `out` and updates the
    /// memory with what was sent (the decode of `out`), unless a summed agreement deferred
    /// the update to [`Pipeline::absorb_aggregate`].
    pub fn compress_compensated(
        &mut self,
        ctx: &Ctx<'_>,
        rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), CompressError> {
        compressor::compress(self.compressor.as_mut(), &self.compensated, ctx, rng, out)?;
        if !self.feedback_pending {
            let all = 0..self.compensated.len();
            self.learn_sent(ctx, std::iter::once((all, &*out)));
        }
        Ok(())
    }

    /// The memory learns what was sent: `sent` are the payloads just encoded from the
    /// compensated buffer, each with the range of it that it encodes (together tiling it);
    /// their decodes make the transmitted buffer. A no-op for an inactive memory.
    fn learn_sent<'p>(
        &mut self,
        ctx: &Ctx<'_>,
        sent: impl Iterator<Item = (Range<usize>, &'p Payload)>,
    ) {
        if !self.memory.is_active() {
            return;
        }
        self.transmitted.clear();
        self.transmitted.resize(self.compensated.len(), 0.0);
        for (range, payload) in sent {
            compressor::decompress_add(
                self.compressor.as_ref(),
                payload.as_bytes(),
                &mut self.transmitted[range],
            )
            .expect("a payload this process just encoded decodes");
        }
        self.memory.update(
            ctx.bucket,
            &self.compensated,
            &self.transmitted,
            ctx.segments,
        );
    }

    /// Compressed all-reduce, worker side: compensates `grad` and encodes each range of
    /// `chunks` (one per owner, in order, tiling the buffer) into its own payload of `out`
    /// (resized to `chunks.len()`), every range with the layer boundaries that fall inside
    /// it ([`chunk_segments`]); the memory then learns from the concatenated decodes, as
    /// after [`Pipeline::compress`]. Per-tensor statistics are thereby per piece of a
    /// tensor where a range boundary cuts one.
    pub fn compress_chunks(
        &mut self,
        grad: &[f32],
        ctx: &Ctx<'_>,
        chunks: &[Range<usize>],
        rng: &mut Rng,
        out: &mut Vec<Payload>,
    ) -> Result<(), CompressError> {
        let n = grad.len();
        if chunks.first().map_or(n != 0, |c| c.start != 0)
            || chunks.windows(2).any(|w| w[0].end != w[1].start)
            || chunks.last().map_or(0, |c| c.end) != n
        {
            return Err(CompressError::Agreement(format!(
                "the chunks {chunks:?} do not tile a buffer of {n} elements"
            )));
        }
        // Without an active memory the ranges are encoded straight from `grad` (no copy).
        let active = self.memory.is_active();
        if active {
            self.compensate(grad, ctx);
        }
        out.resize_with(chunks.len(), Payload::new);
        let mut segs = std::mem::take(&mut self.chunk_segs);
        for (chunk, payload) in chunks.iter().zip(out.iter_mut()) {
            chunk_segments(ctx.segments, chunk.clone(), &mut segs);
            let sub = Ctx {
                segments: &segs,
                ..*ctx
            };
            self.compressor.feedback_offset(chunk.start);
            // (On an error the kept buffer is simply dropped.)
            if active {
                let x = &self.compensated[chunk.clone()];
                compressor::compress(self.compressor.as_mut(), x, &sub, rng, payload)?;
            } else {
                self.encode_input(&grad[chunk.clone()], &sub, rng, payload)?;
            }
        }
        self.chunk_segs = segs;
        self.learn_sent(ctx, chunks.iter().cloned().zip(out.iter()));
        Ok(())
    }

    /// Compressed all-reduce, owner side: decodes the workers' shares of one range (rank
    /// order; `len` elements each) into their sum (jointly where the method has a joint
    /// decoder, [`Compressor::joint_decompress_add`]) and compresses that sum into `out` like
    /// [`Pipeline::compress`] — compensated by this pipeline's memory and updating it, which
    /// makes the memory the owner's "server" residual. `ctx.segments` are the range's layer
    /// boundaries ([`chunk_segments`]).
    pub fn reduce_shares(
        &mut self,
        shares: &[&[u8]],
        len: usize,
        ctx: &Ctx<'_>,
        rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), ReduceError> {
        let mut sum = std::mem::take(&mut self.shares_sum);
        sum.clear();
        sum.resize(len, 0.0);
        // Jointly where the method has a joint decoder (FFT: the shares' spectra summed, one
        // inverse transform per chunk instead of P).
        let decoded = compressor::decompress_sum_add(self.compressor.as_ref(), shares, &mut sum)
            .map_err(|(q, e)| ReduceError::Share(q, e));
        // The sum is this pipeline's own making (it may overflow): always scanned.
        let prechecked = std::mem::replace(&mut self.prechecked, false);
        let res = decoded.and_then(|()| {
            self.compress(&sum, ctx, rng, out)
                .map_err(ReduceError::Compress)
        });
        self.prechecked = prechecked;
        self.shares_sum = sum;
        res
    }

    /// Decodes a (possibly remote) payload and adds it into `out`.
    pub fn decompress_add(&self, bytes: &[u8], out: &mut [f32]) -> Result<(), WireError> {
        compressor::decompress_add(self.compressor.as_ref(), bytes, out)
    }

    /// Decodes the payloads of all workers (rank order) and adds their sum into `out`, with
    /// the method's joint decoder where it has one (see [`compressor::decompress_sum_add`]).
    pub fn decompress_sum_add(
        &self,
        payloads: &[&[u8]],
        out: &mut [f32],
    ) -> Result<(), (usize, WireError)> {
        compressor::decompress_sum_add(self.compressor.as_ref(), payloads, out)
    }

    /// Writes the mean of the payloads of all workers (rank order, `inv` = 1/P) into `out`,
    /// scaling only the elements the decodes added to; returns whether the mean holds a NaN
    /// or an infinity (see [`compressor::decompress_mean`]; `touched` is reused scratch).
    pub fn decompress_mean(
        &self,
        payloads: &[&[u8]],
        inv: f32,
        out: &mut [f32],
        touched: &mut Touched,
    ) -> Result<bool, (usize, WireError)> {
        compressor::decompress_mean(self.compressor.as_ref(), payloads, inv, out, touched)
    }
}

/// Why [`Pipeline::reduce_shares`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ReduceError {
    /// The share of the rank with this index does not decode to the range.
    #[error("share of rank {0}: {1}")]
    Share(usize, WireError),
    /// The sum could not be compressed (e.g. it overflowed to infinity).
    #[error("the sum of the shares: {0}")]
    Compress(CompressError),
}

/// The layer boundaries of `segments` (of the whole buffer; empty means one segment) that
/// fall inside `chunk`, relative to its start, into `out` (cleared): each layer's
/// intersection with the chunk, empty ones left out. An empty `out` then means the chunk is
/// one segment (or empty).
pub fn chunk_segments(segments: &[Range<usize>], chunk: Range<usize>, out: &mut Vec<Range<usize>>) {
    out.clear();
    out.extend(segments.iter().filter_map(|s| {
        let (a, b) = (s.start.max(chunk.start), s.end.min(chunk.end));
        (a < b).then(|| a - chunk.start..b - chunk.start)
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryConfig;
    use crate::onebit::OneBitConfig;
    use crate::qsgd::QsgdConfig;
    use crate::registry::Method;
    use crate::topk::TopKConfig;

    fn pipeline<M: Method>(m: M, memory: MemoryConfig) -> Pipeline {
        Pipeline::new(m.build().unwrap(), memory.build().unwrap())
    }

    fn decode(p: &Pipeline, payload: &Payload, len: usize) -> Vec<f32> {
        let mut out = vec![0.0; len];
        p.decompress_add(payload.as_bytes(), &mut out).unwrap();
        out
    }

    #[test]
    fn prechecked_input_skips_only_the_scan_of_an_unchanged_gradient() {
        let mut grad: Vec<f32> = (0..40).map(|i| i as f32 * 0.25 - 3.0).collect();
        grad[3] = f32::NAN;
        let ctx = Ctx::default();
        let chunks = [0..20, 20..40];
        let rng = || Rng::seed_from_u64(1);
        let non_finite = |r: Result<(), CompressError>| {
            matches!(r, Err(CompressError::NonFinite { index: 3, .. }))
        };
        let topk = || TopKConfig { ratio: 0.25 };
        // No memory, and top-k's adopted residual: the gradient reaches the compressor
        // unchanged, so a caller that checked it spares the scan.
        for mut p in [
            pipeline(QsgdConfig::default(), MemoryConfig::None),
            pipeline(topk(), MemoryConfig::RESIDUAL),
        ] {
            let (mut out, mut outs) = (Payload::new(), Vec::new());
            assert!(non_finite(p.compress(&grad, &ctx, &mut rng(), &mut out)));
            let chunked = p.compress_chunks(&grad, &ctx, &chunks, &mut rng(), &mut outs);
            assert!(non_finite(chunked));
            p.set_prechecked(true);
            p.compress(&grad, &ctx, &mut rng(), &mut out).unwrap();
            p.compress_chunks(&grad, &ctx, &chunks, &mut rng(), &mut outs)
                .unwrap();
        }
        // A compensated buffer (gradient + residual) is this pipeline's own sum: scanned.
        let mut p = pipeline(QsgdConfig::default(), MemoryConfig::RESIDUAL);
        p.set_prechecked(true);
        let mut out = Payload::new();
        assert!(non_finite(p.compress(&grad, &ctx, &mut rng(), &mut out)));
        // So is an owner's sum of shares, which may overflow although each share is finite.
        let big = vec![3e38_f32; 40];
        let mut owner = pipeline(TopKConfig { ratio: 1.0 }, MemoryConfig::None);
        owner.set_prechecked(true);
        let share =
            compressor::compress_new(owner.compressor_mut(), &big, &ctx, &mut rng()).unwrap();
        let shares = [share.as_bytes(), share.as_bytes()];
        let res = owner.reduce_shares(&shares, 40, &ctx, &mut rng(), &mut out);
        assert!(
            matches!(
                res,
                Err(ReduceError::Compress(CompressError::NonFinite { .. }))
            ),
            "{res:?}"
        );
        assert!(owner.prechecked, "the caller's setting is kept");
    }

    #[test]
    fn chunk_segments_cut_layers_at_the_chunk_boundaries() {
        let layers = [0..10, 10..25, 25..30];
        let mut out = Vec::new();
        chunk_segments(&layers, 0..10, &mut out);
        assert_eq!(out, vec![0..10]);
        chunk_segments(&layers, 8..27, &mut out);
        assert_eq!(out, vec![0..2, 2..17, 17..19]);
        chunk_segments(&layers, 12..12, &mut out);
        assert!(out.is_empty());
        chunk_segments(&[], 3..9, &mut out);
        assert!(out.is_empty(), "one segment: the chunk is one too");
    }

    #[test]
    fn chunks_are_compressed_apart_and_the_memory_learns_from_all_of_them() {
        // 1-bit SGD is deterministic and biased: each chunk's layers get their own two
        // reconstruction values, and the residual is what the chunks' decodes missed.
        let grad: Vec<f32> = (0..30).map(|i| ((i * 7919) % 13) as f32 - 6.0).collect();
        let layers = [0..10, 10..25, 25..30];
        let ctx = Ctx {
            step: 0,
            rank: 0,
            bucket: 4,
            segments: &layers,
        };
        let chunks = [0..8, 8..27, 27..30];
        let mut p = pipeline(OneBitConfig::default(), MemoryConfig::RESIDUAL);
        let mut out = Vec::new();
        p.compress_chunks(&grad, &ctx, &chunks, &mut Rng::seed_from_u64(1), &mut out)
            .unwrap();
        assert_eq!(out.len(), 3);
        let mut sent = Vec::new();
        let mut segs = Vec::new();
        for (c, payload) in chunks.iter().zip(&out) {
            // Each payload is the chunk alone, compressed with its own layer pieces.
            chunk_segments(&layers, c.clone(), &mut segs);
            let alone = compressor::compress_new(
                p.compressor_mut(),
                &grad[c.clone()],
                &Ctx {
                    segments: &segs,
                    ..ctx
                },
                &mut Rng::seed_from_u64(1),
            )
            .unwrap();
            assert_eq!(payload, &alone);
            sent.extend(decode(&p, payload, c.len()));
        }
        // Residual = p − sent, so the next step's compensated buffer is g + residual.
        let mut next = vec![0.0; 30];
        p.memory_mut().compensate(4, &[0.0; 30], &mut next);
        for i in 0..30 {
            assert_eq!(next[i], grad[i] - sent[i], "element {i}");
        }
        assert!(
            next.iter().any(|&r| r != 0.0),
            "1-bit SGD leaves a residual"
        );
        // Chunks that do not tile the buffer are refused.
        let late_start = 1..30;
        for bad in [&[0..8, 9..30][..], &[0..8, 8..29], &[late_start]] {
            assert!(p
                .compress_chunks(&grad, &ctx, bad, &mut Rng::seed_from_u64(1), &mut out)
                .is_err());
        }
    }

    #[test]
    fn the_owner_sums_the_shares_and_keeps_its_own_residual() {
        let len = 40;
        let ctx = Ctx {
            step: 2,
            rank: 1,
            bucket: 9,
            segments: &[],
        };
        let mut worker = pipeline(QsgdConfig::default(), MemoryConfig::None);
        let shares: Vec<Payload> = (0..3)
            .map(|r| {
                let g: Vec<f32> = (0..len).map(|i| ((i + r * 5) % 7) as f32 - 3.0).collect();
                compressor::compress_new(
                    worker.compressor_mut(),
                    &g,
                    &ctx,
                    &mut Rng::seed_from_u64(r as u64),
                )
                .unwrap()
            })
            .collect();
        let views: Vec<&[u8]> = shares.iter().map(Payload::as_bytes).collect();
        let sum: Vec<f32> = (0..len)
            .map(|i| {
                views
                    .iter()
                    .map(|s| decode(&worker, &Payload::decode(s.to_vec()).unwrap(), len)[i])
                    .sum()
            })
            .collect();
        let mut owner = pipeline(QsgdConfig::default(), MemoryConfig::RESIDUAL);
        let mut out = Payload::new();
        owner
            .reduce_shares(&views, len, &ctx, &mut Rng::seed_from_u64(7), &mut out)
            .unwrap();
        let sent = decode(&owner, &out, len);
        let mut residual = vec![0.0; len];
        owner
            .memory_mut()
            .compensate(9, &vec![0.0; len], &mut residual);
        for i in 0..len {
            assert!((sent[i] + residual[i] - sum[i]).abs() < 1e-5, "element {i}");
        }
        // A share that is not a payload of the range is named by its index.
        let mut short = shares[2].as_bytes().to_vec();
        short.truncate(10);
        let bad: Vec<&[u8]> = vec![views[0], views[1], &short];
        match owner.reduce_shares(&bad, len, &ctx, &mut Rng::seed_from_u64(7), &mut out) {
            Err(ReduceError::Share(2, _)) => {}
            other => panic!("{other:?}"),
        }
        let e = owner
            .reduce_shares(&views, len + 1, &ctx, &mut Rng::seed_from_u64(7), &mut out)
            .unwrap_err();
        assert!(matches!(e, ReduceError::Share(0, _)), "{e}");
    }
}
