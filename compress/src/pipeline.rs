//! Compressor + error-feedback memory, composed the way the trainer uses them.

use crate::compressor::{self, Compressor, Ctx, Payload};
use crate::error::{CompressError, WireError};
use crate::memory::Memory;
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
pub struct Pipeline {
    compressor: Box<dyn Compressor>,
    memory: Box<dyn Memory>,
    compensated: Vec<f32>,
    transmitted: Vec<f32>,
    /// A summed agreement was installed for a method whose memory learns from the
    /// aggregate: the memory update waits for [`Pipeline::absorb_aggregate`].
    feedback_pending: bool,
}

impl Pipeline {
    /// Pairs a compressor with a memory.
    pub fn new(compressor: Box<dyn Compressor>, memory: Box<dyn Memory>) -> Self {
        Pipeline {
            compressor,
            memory,
            compensated: Vec::new(),
            transmitted: Vec::new(),
            feedback_pending: false,
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

    /// The memory.
    pub fn memory(&self) -> &dyn Memory {
        self.memory.as_ref()
    }

    /// The memory, mutably (checkpoint restore).
    pub fn memory_mut(&mut self) -> &mut dyn Memory {
        self.memory.as_mut()
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
            return compressor::compress(self.compressor.as_mut(), grad, ctx, rng, out);
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
        if !self.memory.is_active() || self.feedback_pending {
            return Ok(());
        }
        self.transmitted.clear();
        self.transmitted.resize(self.compensated.len(), 0.0);
        compressor::decompress_add(
            self.compressor.as_ref(),
            out.as_bytes(),
            &mut self.transmitted,
        )
        .expect("a payload this process just encoded decodes");
        self.memory.update(
            ctx.bucket,
            &self.compensated,
            &self.transmitted,
            ctx.segments,
        );
        Ok(())
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
}
