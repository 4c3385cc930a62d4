//! A device codec and its memory composed as the trainer uses them: the device half of
//! `dtrain_compress::Pipeline` for the one-phase methods.
//!
//! `compress`: `p = compensate(g)`, `payload = C(p)`, then the memory learns what was sent —
//! the payload decoded on the device into zeros, `t`, and `e ← p − t` — as the host
//! pipeline does with its payload. Nothing but the payload leaves the device.

use std::ops::Range;

use dtrain_compress::{MemoryConfig, Payload, Rng};

use crate::codec::DeviceCodec;
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::memory::DeviceResidual;

/// A device codec with residual error feedback (or none).
pub struct DevicePipeline {
    codec: Box<dyn DeviceCodec>,
    memory: Option<DeviceResidual>,
    /// `p` and `t` of the last bucket, reused while its length stays.
    compensated: Option<GpuBuffer>,
    transmitted: Option<GpuBuffer>,
}

impl DevicePipeline {
    /// `codec` with `memory`: none, or the residual; another memory has no device form yet
    /// and is refused by name.
    pub fn new(codec: Box<dyn DeviceCodec>, memory: &MemoryConfig) -> Result<Self, DeviceError> {
        let memory = match *memory {
            MemoryConfig::None => None,
            MemoryConfig::Residual { beta, gamma } => Some(DeviceResidual::new(beta, gamma)),
            ref other => return Err(DeviceError::NoMemory(format!("{other:?}"))),
        };
        Ok(DevicePipeline {
            codec,
            memory,
            compensated: None,
            transmitted: None,
        })
    }

    /// The memory, where there is one.
    pub fn memory(&self) -> Option<&DeviceResidual> {
        self.memory.as_ref()
    }

    /// The memory, mutably (to restore a checkpoint).
    pub fn memory_mut(&mut self) -> Option<&mut DeviceResidual> {
        self.memory.as_mut()
    }

    /// Compresses bucket `key`'s gradient `grad` (layer boundaries `segments`) through the
    /// memory into `out` with the encoder's `rng`, and updates the memory.
    pub fn compress(
        &mut self,
        gpu: &Gpu,
        key: u64,
        grad: &GpuBuffer,
        segments: &[Range<usize>],
        rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let Some(memory) = &mut self.memory else {
            return self.codec.encode(gpu, grad, segments, rng, out);
        };
        let n = grad.len();
        let p = reuse(&mut self.compensated, gpu, n);
        memory.compensate(gpu, key, grad, &p)?;
        self.codec.encode(gpu, &p, segments, rng, out)?;
        let t = reuse(&mut self.transmitted, gpu, n);
        gpu.fill_zero(&t);
        self.codec.decode_add(gpu, out.as_bytes(), &t)?;
        memory.update(gpu, key, &p, &t)
    }
}

/// `slot`'s buffer when it has `n` elements, else a new one kept there.
fn reuse(slot: &mut Option<GpuBuffer>, gpu: &Gpu, n: usize) -> GpuBuffer {
    match slot {
        Some(b) if b.len() == n => b.clone(),
        _ => slot.insert(gpu.zeros(n)).clone(),
    }
}
