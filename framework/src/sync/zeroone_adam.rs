//! 0/1 Adam (`train.optimizer = "zeroone-adam"`): Lu et al., "Maximizing Communication
//! Efficiency for Large-scale Training via 0/1 Adam" (ICLR 2023, arXiv 2202.06009), with the
//! semantics and parameter names of DeepSpeed's `ZeroOneAdam`
//! (`deepspeed/runtime/fp16/onebit/zoadam.py`).
//!
//! Steps are counted from 1 here (`t = step + 1`, DeepSpeed's `state['step']`).
//!
//! ```text
//! variance phase, t ≤ var_freeze_step:
//!   t a multiple of var_interval:   ḡ = dense all-reduce of the gᵢ
//!                                   m ← β₁m + (1−β₁)ḡ,  v ← β₂v + (1−β₂)ḡ²
//!                                   every κ such steps, var_interval doubles (1, 2, 4, …)
//!   other steps:                    ĝ = compressed all-reduce of the gᵢ (1-bit, two-way EF)
//!                                   m ← β₁m + (1−β₁)ĝ
//!   update:                         p ← p − η·(m/(√v + ε) + λp)
//! frozen phase, t > var_freeze_step (the residuals are emptied once, on entry):
//!   each rank, locally:             mᵢ ← β₁mᵢ + (1−β₁)gᵢ,  Σηᵢ += η
//!                                   pᵢ ← pᵢ − η·(mᵢ/(√v + ε) + λpᵢ)
//!   t a multiple of the local-step interval (1, doubling every local_step_scaler steps up
//!   to H = local_step_clipper):
//!                                   uᵢ = (pᵢ − p₀)·(√v + ε)         p₀: the last synchronised parameters
//!                                   ū = compressed all-reduce of the uᵢ
//!                                   m ← −ū/Σηᵢ,  p₀ ← p₀ + ū/(√v + ε),  every pᵢ ← p₀,  Σηᵢ ← 0
//! ```
//! Every compressed exchange's result is masked where `v = 0` (see `moments`: DeepSpeed's
//! `exp_avg_mask`, derived instead of asked for). DeepSpeed accumulates the local change as
//! a buffer `u += −η·update`; here it is read off the parameters as `pᵢ − p₀`, the same
//! quantity up to rounding. Between two
//! synchronisations of the frozen phase the replicas differ: evaluation then uses their
//! average ([`GradientSync::consensus`]), and a checkpoint written there holds each rank's
//! own parameters and momentum (each rank writes its own file) and is refused by another
//! worker count (the `[sync]` rule, [`PERIODIC_SECTION`]).
//!
//! Where this differs from DeepSpeed, on purpose: the variance phase ends after step
//! `var_freeze_step` as its docstring defines it (DeepSpeed's code switches one step
//! later); there is no buffer-initialising first step; the residuals are kept across a
//! resume (DeepSpeed resets them on load), so a resumed run repeats the uninterrupted one
//! exactly; the 1-bit scales are per tensor and owner range (see `onebit_adam`).

use dtrain_comms::{Communicator, Transport};
use dtrain_compress::Collective;
use dtrain_models::Model;
use serde::{Deserialize, Serialize};

use super::moments::{restore_state, AdamState, Moments, ADAM_SECTION};
use super::periodic::{PeriodicState, PERIODIC_SECTION};
use super::{average_params, Collectives, GradientSync, SyncError, Update};
use crate::checkpoint::Checkpoint;
use crate::exchange::DeviceGradient;
use crate::optim::{clip_to_norm, OptimizerConfig, OptimizerKind};
use dtrain_records::StepRecord;

const ANCHOR_SECTION: &str = "sync/zeroone/anchor";

/// 0/1 Adam's schedule (DeepSpeed's parameter names; see
/// [`CompressedOptimizer::ZerooneAdam`](crate::optim::CompressedOptimizer::ZerooneAdam)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Schedule {
    pub(crate) var_freeze_step: u64,
    pub(crate) var_update_scaler: u64,
    pub(crate) local_step_scaler: u64,
    pub(crate) local_step_clipper: u64,
}

/// 0/1 Adam's counters, in DeepSpeed's names, as its checkpoint section holds them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct Counters {
    /// The schedule it was written with.
    schedule: Schedule,
    /// Steps between variance updates.
    var_interval: u64,
    /// Variance updates at the current interval.
    var_counter: u64,
    /// Steps between synchronisations in the frozen phase.
    local_step_interval: u64,
    /// Frozen-phase steps since the interval last doubled.
    local_step_counter: u64,
    /// Σ η of the local steps since the last synchronisation (f64 bits: exact).
    lrs_bits: u64,
    /// Whether the frozen phase has begun (its residuals emptied, its anchor taken).
    frozen: bool,
    /// Whether the replicas (parameters and momenta) are identical.
    identical: bool,
}

impl Counters {
    fn new(schedule: Schedule) -> Self {
        Counters {
            schedule,
            var_interval: 1,
            var_counter: 0,
            local_step_interval: 1,
            local_step_counter: 0,
            lrs_bits: 0f64.to_bits(),
            frozen: false,
            identical: true,
        }
    }

    fn lrs(&self) -> f64 {
        f64::from_bits(self.lrs_bits)
    }
}

/// 0/1 Adam (see the [module docs](self)).
pub(crate) struct ZeroOneAdam {
    /// The variance steps' dense all-reduce (an exchanger without compression).
    dense: Collectives,
    /// The 1-bit all-reduce of gradients, then of parameter changes.
    compressed: Collectives,
    moments: Moments,
    c: Counters,
    /// p₀, the parameters at the last synchronisation (frozen phase; empty before).
    anchor: Vec<f32>,
    /// Scratch: the parameters, then the change.
    scratch: Vec<f32>,
    clip: Option<f32>,
}

impl ZeroOneAdam {
    /// 0/1 Adam over `num_params` parameters with the moments' settings of `opt` and the
    /// `schedule`; `dense` exchanges the variance steps' gradients, `compressed` the other
    /// steps' gradients and the frozen phase's changes; `clip` is `train.clip_norm`.
    pub(crate) fn new(
        dense: Collectives,
        compressed: Collectives,
        num_params: usize,
        opt: &OptimizerConfig,
        schedule: Schedule,
        clip: Option<f32>,
    ) -> Self {
        ZeroOneAdam {
            dense,
            compressed,
            moments: Moments::new(num_params, opt),
            c: Counters::new(schedule),
            anchor: Vec::new(),
            scratch: Vec::new(),
            clip,
        }
    }

    /// The first step of the frozen phase: the residuals, which held gradients, are emptied
    /// (from here they hold parameter changes), and p₀ is taken from `model`.
    fn enter_frozen(&mut self, model: &dyn Model) {
        if !self.c.frozen {
            self.compressed.clear_memories();
            self.anchor = vec![0.0; self.moments.m.len()];
            model.read_params(&mut self.anchor);
            self.c.frozen = true;
        }
    }

    /// Whether step `step` (from 0) is in the frozen phase.
    fn frozen_at(&self, step: u64) -> bool {
        step + 1 > self.c.schedule.var_freeze_step
    }

    fn clip(&self, g: &mut [f32]) {
        if let Some(c) = self.clip {
            clip_to_norm(g, c);
        }
    }

    /// A step of the variance phase: the gradient exchanged densely (refreshing the
    /// variance) or 1-bit compressed; `grads` becomes the direction. Returns whether the
    /// average was non-finite (then nothing changed).
    fn variance_step<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        grads: &mut [f32],
        step: u64,
        record: &mut StepRecord,
    ) -> Result<bool, SyncError> {
        let refresh = (step + 1).is_multiple_of(self.c.var_interval);
        if refresh {
            if self.dense.exchange(comm, grads, step, record)? {
                return Ok(true);
            }
            self.clip(grads);
            self.moments.absorb(grads);
            self.c.var_counter += 1;
            if self.c.var_counter == self.c.schedule.var_update_scaler {
                self.c.var_counter = 0;
                self.c.var_interval = self.c.var_interval.saturating_mul(2);
            }
        } else {
            self.clip(grads);
            if self.compressed.exchange(comm, grads, step, record)? {
                return Ok(true);
            }
            self.moments.mask(grads);
            self.moments.absorb_first(grads);
        }
        self.moments.direction(grads);
        Ok(false)
    }

    /// The frozen phase's synchronisation after the local update of `step`: the change
    /// since p₀, in momentum units, averaged 1-bit compressed; the new momentum and
    /// parameters from it. Returns whether the average was non-finite (the round is then
    /// discarded: every replica goes back to p₀).
    fn synchronise<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        model: &mut dyn Model,
        step: u64,
        record: &mut StepRecord,
    ) -> Result<bool, SyncError> {
        // The round works on the host's moments: those of the local steps on the device
        // come back (and go up again at the next step there).
        self.moments.settle()?;
        let mut u = std::mem::take(&mut self.scratch);
        u.resize(self.anchor.len(), 0.0);
        model.read_params(&mut u);
        for ((u, &a), den) in u
            .iter_mut()
            .zip(&self.anchor)
            .zip(self.moments.denominators())
        {
            *u = (*u - a) * den;
        }
        let non_finite = self.compressed.exchange(comm, &mut u, step, record)?;
        let lrs = self.c.lrs();
        if !non_finite {
            self.moments.mask(&mut u);
            // With Σηᵢ = 0 (a zero learning rate) nobody moved: the momentum stays.
            let inv = if lrs > 0.0 {
                Some((-1.0 / lrs) as f32)
            } else {
                None
            };
            self.moments.take_change(&mut self.anchor, &u, inv);
        }
        self.scratch = u;
        model.write_params(&self.anchor);
        self.c.lrs_bits = 0f64.to_bits();
        // A discarded round leaves each rank's own momentum.
        self.c.identical = !non_finite;
        Ok(non_finite)
    }
}

impl<T: Transport> GradientSync<T> for ZeroOneAdam {
    fn lockstep(&self) -> bool {
        true
    }

    fn scans_gradient(&self) -> bool {
        // 1-bit codes and local steps: the control all-reduce must learn of a NaN.
        true
    }

    fn sync(
        &mut self,
        comm: &mut Communicator<T>,
        model: &dyn Model,
        grads: &mut [f32],
        step: u64,
        lr: f64,
        record: &mut StepRecord,
    ) -> Result<Update, SyncError> {
        // Moments a step on the device left there come back first.
        self.moments.settle()?;
        if !self.frozen_at(step) {
            let non_finite = self.variance_step(comm, grads, step, record)?;
            return Ok(Update::Averaged { non_finite });
        }
        self.enter_frozen(model);
        self.clip(grads);
        self.moments.absorb_first(grads);
        self.c.lrs_bits = (self.c.lrs() + lr).to_bits();
        self.moments.direction(grads);
        self.c.identical = false;
        Ok(Update::Local)
    }

    /// The gradient is taken where it lies when the compressed exchange encodes some bucket
    /// there (its codecs on the worker's own GPU) and no clip needs it whole on the host.
    fn reads_device_gradient(&self) -> bool {
        self.clip.is_none() && GradientSync::<T>::reads_device_gradient(&self.compressed)
    }

    /// [`GradientSync::sync`] on the device: the moments live there and each step's rules
    /// run there in the host's order; the variance phase's exchanges (dense or 1-bit) take
    /// and leave their buffers there, and the frozen phase's local steps exchange nothing —
    /// their direction is written into `on_device`'s buffer. A round's synchronisation
    /// (`after_update`) works on the host's copy of the moments.
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
            let update = if !self.frozen_at(step) {
                let refresh = (step + 1).is_multiple_of(self.c.var_interval);
                let exchanger = if refresh {
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
                    if refresh {
                        d.absorb(gpu, buf)
                    } else {
                        d.mask(gpu, buf)?;
                        d.absorb_first(gpu, buf)
                    }
                })?;
                if refresh {
                    self.c.var_counter += 1;
                    if self.c.var_counter == self.c.schedule.var_update_scaler {
                        self.c.var_counter = 0;
                        self.c.var_interval = self.c.var_interval.saturating_mul(2);
                    }
                }
                Update::Averaged { non_finite: false }
            } else {
                self.enter_frozen(model);
                self.moments
                    .with_device(on_device, |d, gpu, buf| d.absorb_first(gpu, buf))?;
                self.c.lrs_bits = (self.c.lrs() + lr).to_bits();
                self.c.identical = false;
                Update::Local
            };
            self.moments
                .direction_on_device(on_device, grads, mean_to_device)?;
            Ok(update)
        }
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        {
            let _ = (comm, model, grads, mean_to_device, step, lr, record);
            match *on_device {}
        }
    }

    fn after_update(
        &mut self,
        comm: &mut Communicator<T>,
        model: &mut dyn Model,
        step: u64,
        record: &mut StepRecord,
    ) -> Result<bool, SyncError> {
        if !self.frozen_at(step) {
            return Ok(false);
        }
        let non_finite = if (step + 1).is_multiple_of(self.c.local_step_interval) {
            self.synchronise(comm, model, step, record)?
        } else {
            false
        };
        self.c.local_step_counter += 1;
        if self.c.local_step_counter == self.c.schedule.local_step_scaler {
            self.c.local_step_counter = 0;
            self.c.local_step_interval = self
                .c
                .local_step_interval
                .saturating_mul(2)
                .min(self.c.schedule.local_step_clipper);
        }
        Ok(non_finite)
    }

    fn identical(&self) -> bool {
        self.c.identical
    }

    /// The variance phase.
    fn every_step_exchange(&self, step: u64) -> bool {
        !self.frozen_at(step)
    }

    /// A synchronisation of the frozen phase: until its exchange completes, the anchor, the
    /// moments' shared parts and the counters are as the local update left them (the
    /// exchange changes only this rank's residuals and what it is exchanging), and after
    /// it the replicas are identical (a round whose average was not finite leaves each its
    /// own momentum). A compressor with state shared between ranks (PowerSGD's Q) that a
    /// cut leaves half updated is made one survivor's on all before the exchange runs again.
    fn reruns_round(&self, step: u64) -> bool {
        self.frozen_at(step) && (step + 1).is_multiple_of(self.c.local_step_interval)
    }

    /// A frozen-phase step that ends no local-step interval (the interval is the one
    /// this state holds: it doubles as the phase goes on).
    fn runs_alone(&self, step: u64) -> bool {
        self.frozen_at(step) && !(step + 1).is_multiple_of(self.c.local_step_interval)
    }

    fn consensus(
        &mut self,
        comm: &mut Communicator<T>,
        model: &dyn Model,
    ) -> Result<Option<Vec<f32>>, SyncError> {
        if self.c.identical {
            return Ok(None);
        }
        average_params(comm, model).map(Some)
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

    /// The compressed exchanger's sections, the moments, the counters ([`ADAM_SECTION`]),
    /// p₀, and whether the replicas are identical ([`PERIODIC_SECTION`], which an elastic
    /// resume reads).
    fn save(&self, ck: &mut Checkpoint) -> Result<Vec<u64>, SyncError> {
        let keys = GradientSync::<T>::save(&self.compressed, ck)?;
        self.moments.save(ck)?;
        let optimizer = OptimizerKind::ZerooneAdam.name().to_string();
        ck.put_json(
            PERIODIC_SECTION,
            &PeriodicState {
                kind: optimizer.clone(),
                identical: self.c.identical,
            },
        );
        ck.put_json(
            ADAM_SECTION,
            &AdamState {
                optimizer,
                counters: self.c,
            },
        );
        ck.put_f32(ANCHOR_SECTION, &self.anchor);
        Ok(keys)
    }

    fn restore(
        &mut self,
        ck: &Checkpoint,
        memory_keys: &[u64],
        step: u64,
    ) -> Result<(), SyncError> {
        let c: Counters = restore_state(ck, OptimizerKind::ZerooneAdam.name())?;
        if c.schedule != self.c.schedule {
            return Err(SyncError::State(format!(
                "it was written at step {step} with the 0/1 Adam schedule {:?}, this run has \
                 {:?} (resume with the same train.var_freeze_step, var_update_scaler, \
                 local_step_scaler and local_step_clipper)",
                c.schedule, self.c.schedule
            )));
        }
        let anchor = ck.f32(ANCHOR_SECTION)?;
        let n = self.moments.m.len();
        if !anchor.is_empty() && anchor.len() != n {
            return Err(SyncError::State(format!(
                "its 0/1 Adam anchor holds {} values, this model has {n} parameters",
                anchor.len()
            )));
        }
        self.compressed.restore_exchanger(ck, memory_keys)?;
        self.moments.restore(ck)?;
        self.anchor = anchor;
        self.c = c;
        Ok(())
    }
}
