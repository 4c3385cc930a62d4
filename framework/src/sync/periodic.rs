//! Infrequent synchronisation (`[sync]`, [`SyncConfig`]): local SGD, post-local SGD and
//! DiLoCo.
//!
//! Each worker applies its own gradient with its own optimizer (a *local* step,
//! [`Update::Local`]); every `period` optimizer steps the workers synchronise. All three
//! kinds are one rule, an outer step on the averaged parameter change:
//!
//! ```text
//! anchor  θ₀  the parameters at the last synchronisation (identical on every rank)
//! local   θᵢ  rank i's parameters after its H local steps
//! Δ = mean_i(θ₀ − θᵢ)                 through the Exchanger: the run's compressor and
//!                                     error feedback apply to the change, not a gradient
//! v ← μ·v + Δ                         (μ = outer_momentum; no v when μ = 0)
//! θ₀ ← θ₀ − η·(Δ + μ·v)               Nesterov, as PyTorch's SGD(nesterov=True)
//! every rank's parameters ← θ₀
//! ```
//!
//! * `local-sgd` is η = 1, μ = 0: `θ₀ − mean(θ₀ − θᵢ) = mean(θᵢ)`, the model average of
//!   Lin et al. (2020) and PyTorch's `PeriodicModelAverager` (up to f32 rounding; with a
//!   compressor, the compressed average of the changes).
//! * `post-local-sgd` averages every step's *gradient* through the [`Collectives`] before
//!   `switch_step` (PyTorch's `post_localSGD_hook`), then runs local SGD. At the switch
//!   the error-feedback memories are emptied: they held gradient residuals, which are in
//!   other units than the parameter changes they would be added to.
//! * `diloco` (Douillard et al. 2023) is η = `outer_lr`, μ = `outer_momentum`
//!   (0.7 and 0.9 by default), the inner optimizer that of `[train]`. With `switch_step`
//!   it averages every step's gradient before that step, like post-local SGD: the paper
//!   starts DiLoCo from a model pre-trained with every-step AdamW.
//!
//! A round ends after every `period` local steps counted from the first local step, and
//! nowhere else: a run stopped at `train.max_steps` mid-round and resumed with more steps
//! repeats the longer run exactly. A run that ends mid-round evaluates the average of its
//! replicas, and its last checkpoint holds each rank's own parameters. The inner optimizer's
//! state (momentum, Adam moments) stays per rank across rounds, as in the reference
//! implementations. Between synchronisations the replicas differ: evaluation uses their
//! average ([`GradientSync::consensus`]); checkpoints hold each rank's own parameters and
//! optimizer state (every rank writes its own file) plus the anchor and the outer
//! momentum, so a resume is exact.

use dtrain_comms::{Communicator, Transport};
use dtrain_compress::Collective;
use dtrain_models::Model;
use serde::{Deserialize, Serialize};

use super::{average_params, Collectives, GradientSync, SyncError, Update};
use crate::checkpoint::Checkpoint;
use crate::config::SyncConfig;
use crate::exchange::DeviceGradient;
use dtrain_records::StepRecord;

/// The checkpoint section of [`PeriodicState`].
pub(crate) const PERIODIC_SECTION: &str = "sync/periodic";
const ANCHOR_SECTION: &str = "sync/anchor";
const VELOCITY_SECTION: &str = "sync/velocity";

/// What a periodic synchronisation writes into a checkpoint besides its vectors.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct PeriodicState {
    /// `sync.kind`.
    pub(crate) kind: String,
    /// Whether the replicas were identical when it was written (at a synchronisation, or
    /// before the first local step): only then may another worker count resume it.
    pub(crate) identical: bool,
}

/// Local SGD, post-local SGD or DiLoCo (see the [module docs](self)).
pub(crate) struct Periodic {
    inner: Collectives,
    kind: &'static str,
    period: u64,
    /// The first local step (`switch_step` of post-local SGD and DiLoCo, else 0).
    start: u64,
    outer_lr: f32,
    outer_momentum: f32,
    num_params: usize,
    /// θ₀; empty before the first local step.
    anchor: Vec<f32>,
    /// The outer momentum v (empty until the first outer step with μ > 0).
    velocity: Vec<f32>,
    /// Scratch: the parameters, then the change.
    scratch: Vec<f32>,
    identical: bool,
}

impl Periodic {
    /// The synchronisation `cfg` on a model of `num_params` parameters, exchanging through
    /// `inner`: `inner` itself for `every-step`, else a periodic one. `None` for
    /// `streaming-diloco`, which the trainer builds itself (it needs an exchanger per
    /// fragment, see [`super::Streaming`]).
    pub(crate) fn for_config<T: Transport>(
        inner: Collectives,
        cfg: &SyncConfig,
        num_params: usize,
    ) -> Option<Box<dyn GradientSync<T>>> {
        let (period, start, outer_lr, outer_momentum) = match *cfg {
            SyncConfig::EveryStep => return Some(Box::new(inner)),
            SyncConfig::LocalSgd { period } => (period, 0, 1.0, 0.0),
            SyncConfig::PostLocalSgd {
                period,
                switch_step,
            } => (period, switch_step, 1.0, 0.0),
            SyncConfig::Diloco {
                period,
                outer_lr,
                outer_momentum,
                switch_step,
            } => (period, switch_step, outer_lr as f32, outer_momentum as f32),
            SyncConfig::StreamingDiloco { .. } => return None,
        };
        Some(Box::new(Periodic {
            inner,
            kind: cfg.name(),
            period: period.max(1),
            start,
            outer_lr,
            outer_momentum,
            num_params,
            anchor: Vec::new(),
            velocity: Vec::new(),
            scratch: Vec::new(),
            identical: true,
        }))
    }

    /// Whether `step` is a local step.
    fn local(&self, step: u64) -> bool {
        step >= self.start
    }

    /// Whether the round ends after `step` (a local step).
    fn round_ends(&self, step: u64) -> bool {
        (step + 1 - self.start).is_multiple_of(self.period)
    }

    /// The outer step on the averaged change `delta` (in `self.scratch`): moves the anchor.
    fn outer_step(&mut self) {
        outer_step(
            &mut self.anchor,
            &mut self.velocity,
            &self.scratch,
            self.outer_lr,
            self.outer_momentum,
        );
    }
}

/// DiLoCo's outer step on the averaged change `delta`: `v ← μ·v + Δ; θ₀ ← θ₀ − η·(Δ + μ·v)`
/// (Nesterov), or `θ₀ ← θ₀ − η·Δ` with μ = 0 (no `v` kept). `velocity` is sized on first use.
pub(super) fn outer_step(
    anchor: &mut [f32],
    velocity: &mut Vec<f32>,
    delta: &[f32],
    lr: f32,
    mu: f32,
) {
    if mu > 0.0 {
        if velocity.len() != delta.len() {
            *velocity = vec![0.0; delta.len()];
        }
        for ((a, v), &d) in anchor.iter_mut().zip(velocity.iter_mut()).zip(delta) {
            *v = mu * *v + d;
            *a -= lr * (d + mu * *v);
        }
    } else {
        for (a, &d) in anchor.iter_mut().zip(delta) {
            *a -= lr * d;
        }
    }
}

impl<T: Transport> GradientSync<T> for Periodic {
    fn lockstep(&self) -> bool {
        true
    }

    fn scans_gradient(&self) -> bool {
        // A local step applies this rank's own gradient: the control all-reduce must learn
        // of a non-finite value on any rank.
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
        if !self.local(step) {
            return GradientSync::<T>::sync(&mut self.inner, comm, model, grads, step, lr, record);
        }
        if self.anchor.is_empty() {
            // The first local step: the replicas are identical here (at step 0, or after
            // the every-step phase), and this is θ₀.
            self.anchor = vec![0.0; self.num_params];
            model.read_params(&mut self.anchor);
            if self.start > 0 {
                self.inner.clear_memories();
            }
        }
        self.identical = false;
        Ok(Update::Local)
    }

    /// A local step applies the gradient where it lies: nothing to read.
    fn reads_device_gradient(&self) -> bool {
        true
    }

    /// A local step: nothing crosses (the trainer applies the gradient on the device; with
    /// `mean_to_device` off, for a clip on the host, it comes down). A step of the
    /// every-step phase before `start`: the inner synchronisation's, on the device where
    /// its buckets are, else through the host.
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
        if !self.local(step) {
            return super::inner_sync_device(
                &mut self.inner,
                comm,
                model,
                grads,
                on_device,
                mean_to_device,
                step,
                lr,
                record,
            );
        }
        super::update_from_device(grads, on_device, mean_to_device)?;
        GradientSync::<T>::sync(self, comm, model, grads, step, lr, record)
    }

    fn after_update(
        &mut self,
        comm: &mut Communicator<T>,
        model: &mut dyn Model,
        step: u64,
        record: &mut StepRecord,
    ) -> Result<bool, SyncError> {
        if !self.local(step) || !self.round_ends(step) {
            return Ok(false);
        }
        let mut delta = std::mem::take(&mut self.scratch);
        delta.resize(self.anchor.len(), 0.0);
        model.read_params(&mut delta);
        for (d, &a) in delta.iter_mut().zip(&self.anchor) {
            *d = a - *d;
        }
        let non_finite = self.inner.exchange(comm, &mut delta, step, record)?;
        self.scratch = delta;
        if !non_finite {
            self.outer_step();
        }
        // A non-finite average leaves every replica at the anchor: the round is discarded
        // alike on every rank (the average is the same everywhere).
        model.write_params(&self.anchor);
        self.identical = true;
        Ok(non_finite)
    }

    fn identical(&self) -> bool {
        self.identical
    }

    /// The every-step phase before `switch_step`.
    fn every_step_exchange(&self, step: u64) -> bool {
        !self.local(step)
    }

    fn runs_alone(&self, step: u64) -> bool {
        self.local(step) && !self.round_ends(step)
    }

    fn consensus(
        &mut self,
        comm: &mut Communicator<T>,
        model: &dyn Model,
    ) -> Result<Option<Vec<f32>>, SyncError> {
        if self.identical {
            return Ok(None);
        }
        average_params(comm, model).map(Some)
    }

    fn collectives(&self) -> (Collective, Vec<Collective>) {
        GradientSync::<T>::collectives(&self.inner)
    }

    fn theta_scale(&self) -> f64 {
        GradientSync::<T>::theta_scale(&self.inner)
    }

    fn scale_theta(&mut self, factor: f64) {
        GradientSync::<T>::scale_theta(&mut self.inner, factor);
    }

    fn save(&self, ck: &mut Checkpoint) -> Result<Vec<u64>, SyncError> {
        let keys = GradientSync::<T>::save(&self.inner, ck)?;
        ck.put_json(
            PERIODIC_SECTION,
            &PeriodicState {
                kind: self.kind.to_string(),
                identical: self.identical,
            },
        );
        ck.put_f32(ANCHOR_SECTION, &self.anchor);
        ck.put_f32(VELOCITY_SECTION, &self.velocity);
        Ok(keys)
    }

    fn restore(
        &mut self,
        ck: &Checkpoint,
        memory_keys: &[u64],
        _step: u64,
    ) -> Result<(), SyncError> {
        self.inner.restore_exchanger(ck, memory_keys)?;
        if !ck.names().any(|n| n == PERIODIC_SECTION) {
            // Written by an every-step run: identical replicas, no anchor yet (the next
            // local step takes it).
            self.anchor.clear();
            self.velocity.clear();
            self.identical = true;
            return Ok(());
        }
        let st: PeriodicState = ck.json(PERIODIC_SECTION)?;
        let anchor = ck.f32(ANCHOR_SECTION)?;
        let velocity = ck.f32(VELOCITY_SECTION)?;
        let n = self.num_params;
        // An empty anchor: written before the first local step.
        if !anchor.is_empty() && anchor.len() != n || !velocity.is_empty() && velocity.len() != n {
            return Err(SyncError::State(format!(
                "its [sync] state holds {} anchor and {} momentum values, this model has {n} \
                 parameters",
                anchor.len(),
                velocity.len()
            )));
        }
        if st.kind != self.kind && !st.identical {
            return Err(SyncError::State(format!(
                "it was written between two synchronisations of sync.kind = {:?}; this run \
                 has {:?} (resume with the same kind, or from a checkpoint at a \
                 synchronisation)",
                st.kind, self.kind
            )));
        }
        self.anchor = anchor;
        self.velocity = velocity;
        self.identical = st.identical;
        Ok(())
    }
}
