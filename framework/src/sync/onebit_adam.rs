//! 1-bit Adam (`train.optimizer = "onebit-adam"`): Tang et al., "1-bit Adam:
//! Communication Efficient Large-Scale Training with Adam's Convergence Speed" (ICML 2021),
//! with the semantics of DeepSpeed's `OnebitAdam` (`deepspeed/runtime/fp16/onebit/adam.py`)
//! and its compressed all-reduce (`deepspeed/runtime/comm/nccl.py`).
//!
//! ```text
//! warm-up, steps 0 … freeze_step − 1:   ḡ = mean_i gᵢ                 dense all-reduce
//!                                       m ← β₁m + (1−β₁)ḡ,  v ← β₂v + (1−β₂)ḡ²
//! compression, the later steps:         mᵢ = β₁m + (1−β₁)gᵢ           each rank, its own gradient
//!                                       m ← compressed all-reduce of the mᵢ
//!                                       v stays frozen; m ← 0 where v = 0 (the mask)
//! every step (the trainer's optimizer): p ← p − η·(m/(√v + ε) + λp)
//! ```
//! The compressed all-reduce is the run's exchanger with `compress.collective =
//! "compressed-allreduce"`: each rank encodes (with its own residual, the *worker error*)
//! the range of the momentum each peer owns, the owner decodes and sums the shares, adds
//! its own residual (the *server error*) and re-encodes, and the encoded sums go to every
//! rank. With `[compress]` left out the encoding is the 1-bit scaled sign with DeepSpeed's
//! scale `‖x‖₂/√d` ([`dtrain_compress::one_bit_momentum`]); any method that averages can
//! take its place. Because the momentum is linear in the gradients, averaging the workers'
//! momenta is the momentum of the averaged gradient: exactly so without compression, and up
//! to the residuals with it.
//!
//! Where this differs from DeepSpeed, on purpose:
//! * DeepSpeed's first call only allocates its buffers (it updates the moments without
//!   moving the parameters); here step 0 is an ordinary warm-up step.
//! * DeepSpeed scales each worker's signs once per tensor and each server's once per chunk;
//!   here once per tensor within each owner's range, on both sides (the compressed
//!   all-reduce's payloads are per range).
//! * DeepSpeed resets both residuals when it loads a checkpoint (it saves rank 0's only);
//!   here every rank's file holds its own residuals, so a resumed run repeats the
//!   uninterrupted one exactly.
//! * `train.clip_norm` clips the averaged gradient during the warm-up and each rank's own
//!   gradient afterwards, before the moments take it.

use dtrain_comms::{Communicator, Transport};
use dtrain_compress::Collective;
use dtrain_models::Model;
use serde::{Deserialize, Serialize};

use super::moments::{restore_state, AdamState, Moments, ADAM_SECTION};
use super::{Collectives, GradientSync, SyncError, Update};
use crate::checkpoint::Checkpoint;
use crate::exchange::DeviceGradient;
use crate::optim::{clip_to_norm, OptimizerConfig, OptimizerKind};
use dtrain_records::StepRecord;

/// 1-bit Adam's counters in its checkpoint section (it has none beyond the step).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Counters {
    /// The warm-up's length it was written with.
    freeze_step: u64,
}

/// 1-bit Adam (see the [module docs](self)).
pub(crate) struct OnebitAdam {
    /// The warm-up's dense all-reduce (an exchanger without compression).
    dense: Collectives,
    /// The momentum's compressed all-reduce.
    compressed: Collectives,
    moments: Moments,
    freeze_step: u64,
    clip: Option<f32>,
}

impl OnebitAdam {
    /// 1-bit Adam over `num_params` parameters with the moments' settings of `opt`: the
    /// warm-up exchanges through `dense`, the later steps through `compressed`; `clip` is
    /// `train.clip_norm`.
    pub(crate) fn new(
        dense: Collectives,
        compressed: Collectives,
        num_params: usize,
        opt: &OptimizerConfig,
        freeze_step: u64,
        clip: Option<f32>,
    ) -> Self {
        OnebitAdam {
            dense,
            compressed,
            moments: Moments::new(num_params, opt),
            freeze_step,
            clip,
        }
    }

    fn clip(&self, g: &mut [f32]) {
        if let Some(c) = self.clip {
            clip_to_norm(g, c);
        }
    }
}

impl<T: Transport> GradientSync<T> for OnebitAdam {
    fn lockstep(&self) -> bool {
        true
    }

    fn scans_gradient(&self) -> bool {
        // The 1-bit code cannot carry a NaN: the control all-reduce must learn of one.
        true
    }

    fn sync(
        &mut self,
        comm: &mut Communicator<T>,
        _model: &dyn Model,
        grads: &mut [f32],
        step: u64,
        _lr: f64,
        record: &mut StepRecord,
    ) -> Result<Update, SyncError> {
        // Moments a step on the device left there come back first.
        self.moments.settle()?;
        if step < self.freeze_step {
            if self.dense.exchange(comm, grads, step, record)? {
                return Ok(Update::Averaged { non_finite: true });
            }
            self.clip(grads);
            self.moments.absorb(grads);
        } else {
            self.clip(grads);
            self.moments.local_momentum(grads);
            if self.compressed.exchange(comm, grads, step, record)? {
                return Ok(Update::Averaged { non_finite: true });
            }
            self.moments.mask(grads);
            self.moments.m.copy_from_slice(grads);
        }
        self.moments.direction(grads);
        Ok(Update::Averaged { non_finite: false })
    }

    /// The gradient is taken where it lies when the momentum's exchange encodes some bucket
    /// there (its codecs on the worker's own GPU) and no clip needs it whole on the host.
    fn reads_device_gradient(&self) -> bool {
        self.clip.is_none() && GradientSync::<T>::reads_device_gradient(&self.compressed)
    }

    /// [`GradientSync::sync`] on the device: the moments live there, each step's rules run
    /// there in the host's order (bit for bit the host's where the device rounds as IEEE f32
    /// does), the exchanges take and leave their buffers there (the warm-up's dense buckets
    /// and any the device does not encode cross as in every device exchange), and the
    /// direction is written into `on_device`'s buffer.
    fn sync_device(
        &mut self,
        comm: &mut Communicator<T>,
        model: &dyn Model,
        grads: &mut [f32],
        on_device: &DeviceGradient,
        mean_to_device: bool,
        step: u64,
        lr: f64,
        record: &mut StepRecord,
    ) -> Result<Update, SyncError> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        {
            let warm = step < self.freeze_step;
            if !warm {
                self.moments
                    .with_device(on_device, |d, gpu, buf| d.local_momentum(gpu, buf))?;
            }
            let exchanger = if warm {
                &mut self.dense
            } else {
                &mut self.compressed
            };
            let up = GradientSync::<T>::sync_device(
                exchanger, comm, model, grads, on_device, true, step, lr, record,
            )?;
            if matches!(up, Update::Averaged { non_finite: true }) {
                return Ok(up);
            }
            self.moments.with_device(on_device, |d, gpu, buf| {
                if warm {
                    d.absorb(gpu, buf)
                } else {
                    d.take_masked(gpu, buf)
                }
            })?;
            self.moments
                .direction_on_device(on_device, grads, mean_to_device)?;
            Ok(Update::Averaged { non_finite: false })
        }
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        {
            let _ = (comm, model, grads, mean_to_device, step, lr, record);
            match *on_device {}
        }
    }

    fn collectives(&self) -> (Collective, Vec<Collective>) {
        GradientSync::<T>::collectives(&self.compressed)
    }

    fn theta_scale(&self) -> f64 {
        GradientSync::<T>::theta_scale(&self.compressed)
    }

    fn scale_theta(&mut self, factor: f64) {
        GradientSync::<T>::scale_theta(&mut self.compressed, factor);
    }

    /// The compressed exchanger's sections (`exchanger`, `mem/*`, `srv/*`), the moments and
    /// [`ADAM_SECTION`]; the dense exchanger keeps no state.
    fn save(&self, ck: &mut Checkpoint) -> Result<Vec<u64>, SyncError> {
        let keys = GradientSync::<T>::save(&self.compressed, ck)?;
        self.moments.save(ck)?;
        ck.put_json(
            ADAM_SECTION,
            &AdamState {
                optimizer: OptimizerKind::OnebitAdam.name().to_string(),
                counters: Counters {
                    freeze_step: self.freeze_step,
                },
            },
        );
        Ok(keys)
    }

    fn restore(
        &mut self,
        ck: &Checkpoint,
        memory_keys: &[u64],
        step: u64,
    ) -> Result<(), SyncError> {
        let c: Counters = restore_state(ck, OptimizerKind::OnebitAdam.name())?;
        // Past either freeze, the variance in the file is frozen at the old one's step.
        if c.freeze_step != self.freeze_step && step > c.freeze_step.min(self.freeze_step) {
            return Err(SyncError::State(format!(
                "it was written at step {step} with train.freeze_step = {}, this run has {}: \
                 its variance was frozen at another step (resume with the same freeze_step)",
                c.freeze_step, self.freeze_step
            )));
        }
        self.compressed.restore_exchanger(ck, memory_keys)?;
        self.moments.restore(ck)
    }
}
