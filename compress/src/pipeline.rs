//! Compressor + error-feedback memory, composed the way the trainer uses them.

use crate::compressor::{self, Compressor, Ctx, Payload};
use crate::error::{CompressError, WireError};
use crate::memory::Memory;
use crate::rng::Rng;

/// One bucket's compression path: `compensate → compress → (decode own payload) → update`.
///
/// Scratch buffers are kept between calls, so a steady-state step allocates nothing.
pub struct Pipeline {
    compressor: Box<dyn Compressor>,
    memory: Box<dyn Memory>,
    compensated: Vec<f32>,
    transmitted: Vec<f32>,
}

impl Pipeline {
    /// Pairs a compressor with a memory.
    pub fn new(compressor: Box<dyn Compressor>, memory: Box<dyn Memory>) -> Self {
        Pipeline {
            compressor,
            memory,
            compensated: Vec::new(),
            transmitted: Vec::new(),
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
        self.compensated.resize(grad.len(), 0.0);
        self.memory
            .compensate(ctx.bucket, grad, &mut self.compensated);
        compressor::compress(self.compressor.as_mut(), &self.compensated, ctx, rng, out)?;
        self.transmitted.clear();
        self.transmitted.resize(grad.len(), 0.0);
        compressor::decompress_add(
            self.compressor.as_ref(),
            out.as_bytes(),
            &mut self.transmitted,
        )
        .expect("a payload this process just encoded decodes");
        self.memory
            .update(ctx.bucket, &self.compensated, &self.transmitted);
        Ok(())
    }

    /// Decodes a (possibly remote) payload and adds it into `out`.
    pub fn decompress_add(&self, bytes: &[u8], out: &mut [f32]) -> Result<(), WireError> {
        compressor::decompress_add(self.compressor.as_ref(), bytes, out)
    }
}
