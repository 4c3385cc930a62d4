//! The gradient-synchronisation seam: how the workers of a run turn each step's local
//! gradients into the update every replica applies.
//!
//! The trainer's step computes the gradient, runs its control all-reduce (global loss, the
//! non-finite flags, every rank's time) and then hands the gradient to its
//! [`GradientSync`]. What comes back is the [`Update`] to apply: the step's average, in
//! place and identical on every rank, or aggregates of earlier steps each applied with its
//! own step's learning rate. The trainer does not know which implementation it has:
//!
//! * [`Collectives`] — the [`Exchanger`](crate::exchange::Exchanger): buckets,
//!   compression with error feedback, the collective each method's aggregation needs,
//!   the average in place (`[cluster] mode = "collective"`).
//! * [`Periodic`] — local SGD, post-local SGD and DiLoCo (`[sync]`): local steps on each
//!   rank's own gradient, and every `period` steps an outer step on the parameter change
//!   averaged through the same exchanger.
//! * [`Streaming`] — Streaming DiLoCo: DiLoCo in fragments synchronised at staggered
//!   steps, each through its own exchanger, merged a few steps after their exchange.
//! * [`ParameterServer`] — pushes to servers co-located with the workers and pulls their
//!   aggregates, possibly stale (`[cluster] mode = "ps"`, [`crate::ps_mode`]).
//! * [`OnebitAdam`] and [`ZeroOneAdam`] — the compressed optimizers (`train.optimizer =
//!   "onebit-adam"` / `"zeroone-adam"`): they keep Adam's moments, exchange the gradient
//!   densely while the variance is estimated, then the momentum (or 0/1 Adam's parameter
//!   change) compressed, and hand the trainer the direction `m/(√v + ε)`, which its
//!   optimizer applies with the learning rate and the weight decay.
//!
//! Each implementation also owns its part of a checkpoint (its sections, written and
//! restored by it) and names the collective a run used for `summary.json`.

mod collective;
mod in_flight;
mod moments;
mod onebit_adam;
mod parameter_server;
mod periodic;
mod streaming;
mod zeroone_adam;

#[cfg(test)]
mod tests;

use dtrain_comms::{CommError, Communicator, Transport};
use dtrain_compress::Collective;
use dtrain_models::Model;

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::Plan;
use crate::exchange::{DeviceGradient, ExchangeError};
use crate::optim::CompressedOptimizer;
use crate::ps_mode::Ready;
use dtrain_records::StepRecord;

pub(crate) use collective::{Collectives, SERVER_SECTION};
pub(crate) use in_flight::InFlight;
pub(crate) use moments::written_by;
pub(crate) use onebit_adam::OnebitAdam;
pub(crate) use parameter_server::ParameterServer;
pub(crate) use periodic::{Periodic, PeriodicState, PERIODIC_SECTION};
pub(crate) use streaming::{layout as fragment_layout, Streaming, StreamingSettings};
pub(crate) use zeroone_adam::{Schedule as ZeroOneSchedule, ZeroOneAdam};

/// What a synchronisation produced for the trainer to apply.
pub(crate) enum Update {
    /// The trainer's gradient buffer now holds the step's average (or, for a compressed
    /// optimizer, the direction it computed from it), identical on every rank;
    /// `non_finite` says whether the average held a NaN or an infinity (the failure policy
    /// then decides, alike on every rank).
    Averaged {
        /// Whether the average has a non-finite value.
        non_finite: bool,
    },
    /// The trainer's gradient buffer holds this rank's own gradient (or a compressed
    /// optimizer's local direction), to be applied by this rank alone (a local step of a
    /// [`Periodic`] synchronisation or of 0/1 Adam; the control all-reduce already told
    /// every rank whether any gradient was non-finite).
    Local,
    /// Aggregates that arrived, oldest first: each is applied with the learning rate of
    /// its own step, and a non-finite one is skipped (it is the same on every worker).
    Aggregates(Vec<Ready>),
}

/// Why a synchronisation (or its part of a checkpoint) failed; the trainer adds the step
/// or the checkpoint's path.
#[derive(Debug)]
pub(crate) enum SyncError {
    /// A collective or the parameter server's transport failed.
    Comm(CommError),
    /// The gradient exchange failed.
    Exchange(ExchangeError),
    /// A checkpoint section could not be read.
    Checkpoint(CheckpointError),
    /// A checkpoint's state does not fit this run (the reason).
    State(String),
    /// The thread of the exchanges in flight failed (why).
    Background(String),
}

impl From<CheckpointError> for SyncError {
    fn from(e: CheckpointError) -> Self {
        SyncError::Checkpoint(e)
    }
}

/// One way of synchronising the workers' gradients (see the [module docs](self)).
pub(crate) trait GradientSync<T: Transport> {
    /// Whether the workers run in lock-step: the trainer's control all-reduce runs every
    /// step. An asynchronous parameter server (staleness > 0) does not wait for the others.
    fn lockstep(&self) -> bool;

    /// Whether the trainer must scan the local gradient for non-finite values before the
    /// control all-reduce. A dense all-reduce keeps a NaN of any rank in the average and
    /// reports it ([`Update::Averaged`]); a compressor may drop one, and a parameter
    /// server aggregates elsewhere.
    fn scans_gradient(&self) -> bool;

    /// Synchronises `grads`, this rank's gradient of `step` (the model's parameters are
    /// those it was computed at; `lr` is the step's learning rate), and records the phase
    /// times, bytes and the method's figures in `record`.
    fn sync(
        &mut self,
        comm: &mut Communicator<T>,
        model: &dyn Model,
        grads: &mut [f32],
        step: u64,
        lr: f64,
        record: &mut StepRecord,
    ) -> Result<Update, SyncError>;

    /// Whether [`GradientSync::sync_device`] takes a gradient left on the device where it
    /// lies, so that the trainer (whose model is on a GPU) need not copy it to the host:
    /// some bucket is encoded there, or the local steps of a periodic synchronisation apply
    /// it there without reading it. Default: no.
    fn reads_device_gradient(&self) -> bool {
        false
    }

    /// [`GradientSync::sync`] of this rank's gradient `on_device` (a GPU worker's, on the
    /// device its buckets are encoded on); `grads` receives the update — or, with
    /// `mean_to_device` (for an [`Update::Averaged`]), `on_device`'s buffer does. Default:
    /// the gradient copied into `grads`, [`GradientSync::sync`], and the update copied up.
    #[allow(clippy::too_many_arguments)]
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
        sync_through_host(
            self,
            comm,
            model,
            grads,
            on_device,
            mean_to_device,
            step,
            lr,
            record,
        )
    }

    /// Called once the update of `step` is applied to `model`: a [`Periodic`]
    /// synchronisation ends its round here (averages the parameter change and writes the
    /// synchronised parameters), recording its exchange in `record`. Returns whether the
    /// averaged change was non-finite (every rank then learns the same). Default: nothing.
    fn after_update(
        &mut self,
        _comm: &mut Communicator<T>,
        _model: &mut dyn Model,
        _step: u64,
        _record: &mut StepRecord,
    ) -> Result<bool, SyncError> {
        Ok(false)
    }

    /// The parameters evaluation uses when the replicas differ (between a periodic
    /// synchronisation's rounds: their average, the same on every rank); `None` when the
    /// replicas are identical (the default).
    fn consensus(
        &mut self,
        _comm: &mut Communicator<T>,
        _model: &dyn Model,
    ) -> Result<Option<Vec<f32>>, SyncError> {
        Ok(None)
    }

    /// Whether every rank's parameters must be identical now (after this step's update):
    /// false between a periodic synchronisation's rounds, where each replica trains on
    /// its own. Default: true.
    fn identical(&self) -> bool {
        true
    }

    /// Whether `step`, the next step to run from this synchronisation's state, exchanges
    /// as an every-step synchronisation does: the replicas are identical before it and
    /// after it, and its update follows its last exchange. False for the local steps and
    /// round ends of the periodic synchronisations (their every-step phase before
    /// `switch_step` or 0/1 Adam's variance phase excepted). Live membership's survivors
    /// of a failure in such a step roll forward from one that finished it, or run it
    /// again, with no copy of the state kept before it. Default: true.
    fn every_step_exchange(&self, _step: u64) -> bool {
        true
    }

    /// Whether `step`, the next step to run from this synchronisation's state, ends a
    /// round whose exchange (in [`GradientSync::after_update`]), cut by a lost worker, can
    /// run again over the survivors, each from where the step's update left it: the
    /// exchange leaves nothing but each rank's own error-feedback memories changed until it
    /// completes, and after it the replicas share their whole state but those memories.
    /// Live membership keeps no copy before such a step. Default: false.
    fn reruns_round(&self, _step: u64) -> bool {
        false
    }

    /// Whether `step`, the next step to run from this synchronisation's state, is one a
    /// rank can run alone: a local step whose only collective is the trainer's control
    /// all-reduce (it ends no round). Live membership keeps no copy before such a step: a
    /// survivor that lags it catches up alone. Default: false.
    fn runs_alone(&self, _step: u64) -> bool {
        false
    }

    /// Waits for every update still in flight (before collectives that need identical
    /// replicas: evaluation, checkpoints). Default: nothing is ever in flight.
    fn drain(&mut self) -> Result<Vec<Ready>, SyncError> {
        Ok(Vec::new())
    }

    /// The run ends: what is still in flight, and leaving (a server keeps serving the
    /// others until they leave too). Default: nothing in flight, nothing to leave.
    fn finish(&mut self) -> Result<Vec<Ready>, SyncError> {
        Ok(Vec::new())
    }

    /// Takes `comm`, a second communicator over the same connections (the tagged lane of
    /// [`dtrain_comms::split_tagged`]), to run exchanges in flight across steps on a thread
    /// of its own ([`InFlight`]). Returns false where this synchronisation has no use for
    /// one (the default).
    fn attach_background(&mut self, _comm: Communicator<T>) -> bool
    where
        T: 'static,
    {
        false
    }

    /// The run (re)starts at `step` (after a resume; every rank does the same). Default:
    /// nothing to do.
    fn start_at(&mut self, _step: u64) -> Result<(), SyncError> {
        Ok(())
    }

    /// The run's collective and, when the buckets differ, each bucket's (`summary.json`).
    fn collectives(&self) -> (Collective, Vec<Collective>);

    /// The factor the recover policy has applied to θ (1 = never lowered).
    fn theta_scale(&self) -> f64;

    /// Multiplies θ by `factor` (the recover policy); a no-op without θ.
    fn scale_theta(&mut self, factor: f64);

    /// Writes this synchronisation's state into `ck` and returns the ids of the
    /// error-feedback memories that are per rank (the checkpoint's `memory_keys`); an
    /// error where state held on a device cannot be read back.
    fn save(&self, ck: &mut Checkpoint) -> Result<Vec<u64>, SyncError>;

    /// Restores what [`GradientSync::save`] wrote into a checkpoint of `step` whose
    /// `memory_keys` are given. Refuses a state that does not fit this run.
    fn restore(&mut self, ck: &Checkpoint, memory_keys: &[u64], step: u64)
        -> Result<(), SyncError>;
}

/// [`GradientSync::sync_device`] of a synchronisation that works on the host: the gradient
/// `on_device` copied into `grads`, [`GradientSync::sync`], and, with `mean_to_device`, the
/// update copied up into `on_device`'s buffer.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sync_through_host<T: Transport, S: GradientSync<T> + ?Sized>(
    sync: &mut S,
    comm: &mut Communicator<T>,
    model: &dyn Model,
    grads: &mut [f32],
    on_device: &DeviceGradient,
    mean_to_device: bool,
    step: u64,
    lr: f64,
    record: &mut StepRecord,
) -> Result<Update, SyncError> {
    on_device
        .download_range(0..grads.len(), grads)
        .map_err(device_failure)?;
    let update = sync.sync(comm, model, grads, step, lr, record)?;
    if mean_to_device {
        on_device.write_range(0, grads).map_err(device_failure)?;
    }
    Ok(update)
}

/// [`GradientSync::sync_device`] of a step that a periodic synchronisation hands to its
/// inner, every-step one (before its local phase): on the device where `inner`'s buckets
/// read the gradient there, else through the host.
#[allow(clippy::too_many_arguments)]
pub(crate) fn inner_sync_device<T: Transport>(
    inner: &mut Collectives,
    comm: &mut Communicator<T>,
    model: &dyn Model,
    grads: &mut [f32],
    on_device: &DeviceGradient,
    mean_to_device: bool,
    step: u64,
    lr: f64,
    record: &mut StepRecord,
) -> Result<Update, SyncError> {
    if GradientSync::<T>::reads_device_gradient(inner) {
        inner.sync_device(
            comm,
            model,
            grads,
            on_device,
            mean_to_device,
            step,
            lr,
            record,
        )
    } else {
        sync_through_host(
            inner,
            comm,
            model,
            grads,
            on_device,
            mean_to_device,
            step,
            lr,
            record,
        )
    }
}

/// A step on the device whose update is in `on_device`'s buffer (a periodic
/// synchronisation's local step, a compressed optimizer's direction): nothing to read,
/// unless the trainer applies the update from the host (`mean_to_device` off, for a clip
/// of it there), which then comes down into `grads`.
pub(crate) fn update_from_device(
    grads: &mut [f32],
    on_device: &DeviceGradient,
    mean_to_device: bool,
) -> Result<(), SyncError> {
    if mean_to_device {
        return Ok(());
    }
    on_device
        .download_range(0..grads.len(), grads)
        .map_err(device_failure)
}

/// A device operation's failure (`reason`), as the exchange reports one.
pub(crate) fn device_failure(reason: String) -> SyncError {
    SyncError::Exchange(ExchangeError::Device { bucket: 0, reason })
}

/// The average of the replicas' parameters, the same on every rank (one dense all-reduce):
/// what evaluation uses between the synchronisations of a kind whose replicas differ
/// ([`GradientSync::consensus`]).
fn average_params<T: Transport>(
    comm: &mut Communicator<T>,
    model: &dyn Model,
) -> Result<Vec<f32>, SyncError> {
    let mut avg = vec![0.0; model.table().num_params()];
    model.read_params(&mut avg);
    // (Non-finite parameters are the trainer's to report, not the consensus's.)
    comm.all_reduce_mean(&mut avg).map_err(SyncError::Comm)?;
    Ok(avg)
}

/// The synchronisation of a compressed optimizer: `dense` exchanges its dense steps,
/// `compressed` the compressed ones.
pub(crate) fn compressed_optimizer<T: Transport>(
    schedule: CompressedOptimizer,
    dense: Collectives,
    compressed: Collectives,
    num_params: usize,
    plan: &Plan,
) -> Box<dyn GradientSync<T>> {
    let (opt, clip) = (&plan.optimizer, plan.config.train.clip_norm);
    match schedule {
        CompressedOptimizer::OnebitAdam { freeze_step } => Box::new(OnebitAdam::new(
            dense,
            compressed,
            num_params,
            opt,
            freeze_step,
            clip,
        )),
        CompressedOptimizer::ZerooneAdam {
            var_freeze_step,
            var_update_scaler,
            local_step_scaler,
            local_step_clipper,
        } => Box::new(ZeroOneAdam::new(
            dense,
            compressed,
            num_params,
            opt,
            ZeroOneSchedule {
                var_freeze_step,
                var_update_scaler,
                local_step_scaler,
                local_step_clipper,
            },
            clip,
        )),
    }
}
