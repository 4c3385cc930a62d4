//! The data-parallel trainer: one [`Trainer`] per worker, all running the same step in
//! lock-step over a [`Communicator`].
//!
//! ```text
//! batch (epoch, j) of this rank ─► forward ─► backward into the flat gradient
//! ─► control all-reduce [loss·n, n, correct, non-finite flags, each rank's local time]
//!    (global loss; every rank decides alike; names the rank the others waited for)
//! ─► gradient synchronisation (crate::sync): the Exchanger's buckets → compensate →
//!    compress → collective → decompress → average, or the parameter server's push / pull
//! ─► optimizer on the flat parameters (where the DGC memory owns the gradient's momentum,
//!    the optimizer keeps only the weight-decay term's)
//! ─► parameters written back into the model
//! ```
//!
//! Every quantity that decides what happens next — the global loss, the non-finite flag,
//! the averaged gradient — is identical on all ranks, so the ranks never diverge in control
//! flow, and a failure on one rank becomes the same decision everywhere.
//!
//! **Determinism and exact resume.** Parameters are initialised from the run seed and then
//! broadcast from rank 0; the data of step `s` is a pure function of `(seed, epoch, j)`
//! ([`crate::data`]); the model's RNG (dropout) is reseeded every step from `(seed, step,
//! rank)`; stochastic compressors draw from `(seed, step, rank, bucket)`; the learning rate is
//! a function of the step. A checkpoint therefore only needs the parameters, BatchNorm
//! buffers, optimizer state, error-feedback memories and the step — and a resumed run repeats
//! the uninterrupted one bit for bit on the CPU backend.
//!
//! ## Layout
//! This file holds the worker and how it is built; `step` is one training step (the control
//! all-reduce, the `GradientSync` of `crate::sync` it hands the gradient to, the update);
//! `failure` the policy for non-finite values; `checkpointing` what a rank writes and how
//! it resumes; [`elastic`] the rule for resuming on another worker count; `run` the loop
//! of steps, evaluations and checkpoints; `metrics` the records of `metrics.jsonl`,
//! `eval.jsonl` and `summary.json`.

mod checkpointing;
pub mod elastic;
mod failure;
mod handover;
mod membership;
mod metrics;
mod recovery;
mod replicas;
mod run;
mod step;

pub use checkpointing::{
    checkpoint_dir_name, checkpoint_step, retained, verify_checkpoint, IntactCheckpoint,
    SkippedCheckpoint,
};
pub use dtrain_records::{EvalRecord, MembershipChange, Phases, Restart, StepRecord, Summary};

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use dtrain_comms::shaping::LinkSpec;
use dtrain_comms::topology::Topology;
use dtrain_comms::{CommError, Communicator, Transport};
use dtrain_models::{Device, Model};

use crate::checkpoint::CheckpointError;
use crate::config::{Plan, SyncConfig};
use crate::data::TrainData;
use crate::exchange::bucket::ParamInfo;
use crate::exchange::{DeviceUse, ExchangeError, Exchanger};
use crate::optim::Optimizer;
use crate::optim_device::DeviceMoments;
use crate::ps_mode::PsState;
use crate::signals::StopRequest;
use crate::sync::{
    Collectives, GradientSync, ParameterServer, Periodic, Streaming, StreamingSettings,
};

/// Why a run stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The configuration could not be turned into objects.
    #[error("configuration: {0}")]
    Config(String),
    /// A collective failed (a dead or silent peer is named).
    #[error("step {step}: {source}")]
    Comm {
        /// Step at which it happened.
        step: u64,
        /// The communicator's error.
        source: CommError,
    },
    /// The gradient exchange failed.
    #[error("step {step}: {source}")]
    Exchange {
        /// Step at which it happened.
        step: u64,
        /// The exchanger's error.
        source: ExchangeError,
    },
    /// The model rejected a batch.
    #[error("step {step}: {source}")]
    Model {
        /// Step.
        step: u64,
        /// Message.
        #[source]
        source: dtrain_models::ModelError,
    },
    /// A non-finite loss or gradient under the `abort` policy (or too many in a row).
    #[error("step {step}: {what} is not finite ({policy}); last checkpoint: {checkpoint}")]
    NonFinite {
        /// Step.
        step: u64,
        /// `loss` or `gradient`.
        what: &'static str,
        /// What the policy did.
        policy: String,
        /// Where the last checkpoint is, or `none`.
        checkpoint: String,
    },
    /// Reading or writing a checkpoint failed.
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] CheckpointError),
    /// The synchronisation failed outside a collective of its own step (an exchange left
    /// in flight across steps).
    #[error("step {step}: {reason}")]
    Sync {
        /// The step at which it was found.
        step: u64,
        /// What failed.
        reason: String,
    },
    /// A checkpoint does not fit this run.
    #[error("cannot resume from {path}: {reason}")]
    Resume {
        /// The checkpoint.
        path: String,
        /// Why.
        reason: String,
    },
    /// A stop was requested (SIGTERM / SIGINT, [`Trainer::stop_on`]); the run stopped after
    /// `step` steps.
    #[error("stopped by {} after step {step}; {}", crate::signals::signal_name(*signal),
        checkpoint.as_ref().map_or_else(|| "no checkpoint written".to_string(),
            |c| format!("checkpoint {}", c.display())))]
    Stopped {
        /// Steps completed.
        step: u64,
        /// The signal that asked.
        signal: i32,
        /// The checkpoint written at `step` (`None` without a run directory, or in the
        /// asynchronous parameter-server mode).
        checkpoint: Option<PathBuf>,
    },
    /// Writing metrics failed.
    #[error("writing {path}: {source}")]
    Io {
        /// File.
        path: String,
        /// The error.
        source: std::io::Error,
    },
}

impl TrainError {
    /// The communicator's error behind this one: a collective of the step (`Comm`) or of
    /// its gradient exchange (`Exchange`) failed.
    pub fn comm_error(&self) -> Option<&CommError> {
        match self {
            TrainError::Comm { source, .. }
            | TrainError::Exchange {
                source: crate::exchange::ExchangeError::Comm { source, .. },
                ..
            } => Some(source),
            _ => None,
        }
    }
}

/// What the trainer reports as it goes (progress bars, logs). Every method has a default.
pub trait Observer {
    /// The run starts (or resumes) at `step` of `total` steps, `per_epoch` steps an epoch.
    fn on_start(&mut self, _step: u64, _total: u64, _per_epoch: u64) {}
    /// A step finished.
    fn on_step(&mut self, _r: &StepRecord) {}
    /// An evaluation finished.
    fn on_eval(&mut self, _r: &EvalRecord) {}
    /// A notice (checkpoint written, rollback, skip).
    fn on_message(&mut self, _msg: &str) {}
    /// This worker's rank in its group is `rank` from step `step` on: called before
    /// [`Observer::on_start`], and again when the group changes (live membership). Rank 0
    /// leads: it writes the logs, and is the one a progress display follows.
    fn on_rank(&mut self, _rank: usize, _step: u64) {}
}

/// An observer that reports nothing.
pub struct Quiet;
impl Observer for Quiet {}

/// The per-rank files of a run directory.
#[derive(Debug, Clone)]
pub struct RunDir {
    /// The run directory.
    pub root: PathBuf,
}

impl RunDir {
    /// `root/checkpoints`.
    pub fn checkpoints(&self) -> PathBuf {
        self.root.join("checkpoints")
    }

    /// The checkpoint directory named in `checkpoints/LATEST`, if any.
    pub fn latest(&self) -> Option<PathBuf> {
        let name = std::fs::read_to_string(self.checkpoints().join("LATEST")).ok()?;
        let dir = self.checkpoints().join(name.trim());
        dir.is_dir().then_some(dir)
    }
}

/// Serialises every use of burn's random number generator, which is process-global (one
/// stream for the whole process, on the CPU backend and the GPU's alike): seeding then
/// initialising a model ([`build_model`]), and seeding then running a training forward
/// pass, whose dropout layers draw their masks from that stream. Held across the whole
/// draw, so what a worker draws is a pure function of its seed, whatever other threads do.
/// Separate worker processes never contend for it; in-process ranks (the trainer's tests,
/// which run several runs at once) do, and without it one run's dropout draws landed in
/// the middle of another run's initialisation: different initial weights, found as a
/// resumed run that no longer matched its straight twin.
pub(super) static RNG: Mutex<()> = Mutex::new(());

/// Builds the model of `plan` on `device`, initialised from the run seed, then from
/// `model.init_from` when the configuration names a file.
///
/// The initial weights are drawn on the CPU backend whatever the device, then copied to a
/// GPU: burn's GPU backends draw other numbers from the same seed, and a seed that meant
/// another model on another device would make a GPU run incomparable with its CPU twin.
pub fn build_model(plan: &Plan, device: &Device) -> Result<Box<dyn Model>, TrainError> {
    let _g = RNG.lock().unwrap_or_else(|e| e.into_inner());
    let build = |on: &Device| {
        plan.config
            .model
            .build(on)
            .map_err(|e| TrainError::Config(format!("model: {e}")))
    };
    let cpu = dtrain_models::cpu_device();
    cpu.seed(plan.config.seed);
    let drawn = build(&cpu)?;
    // burn initialises parameters lazily, on first access: force it while the seeded RNG is
    // ours.
    let mut params = vec![0f32; drawn.table().num_params()];
    drawn.read_params(&mut params);
    let mut buffers = vec![0f32; drawn.table().num_buffers()];
    drawn.read_buffers(&mut buffers);
    let mut model = if *device == cpu {
        drawn
    } else {
        let mut on_device = build(device)?;
        on_device.write_params(&params);
        on_device.write_buffers(&buffers);
        on_device
    };
    if let Some(path) = &plan.config.model.init_from {
        crate::export::load_into(&plan.config.model, model.as_mut(), path)
            .map_err(|e| TrainError::Config(format!("model.init_from: {e}")))?;
    }
    Ok(model)
}

/// One worker of a data-parallel run.
pub struct Trainer<T: Transport> {
    plan: Plan,
    rank: usize,
    world: usize,
    comm: Communicator<T>,
    model: Box<dyn Model>,
    data: TrainData,
    optimizer: Optimizer,
    /// The optimizer's moments on the model's device, where the model is on a GPU: the
    /// step runs there ([`crate::optim_device`]); `optimizer` counts the steps and holds the
    /// state for checkpoints.
    device_moments: Option<DeviceMoments>,
    grads: Vec<f32>,
    /// A micro-batch's gradient before it is added into `grads` (`train.accumulate > 1`).
    micro_grads: Vec<f32>,
    buffers: Vec<f32>,
    step: u64,
    out: Option<RunDir>,
    metrics_file: Option<std::fs::File>,
    eval_file: Option<std::fs::File>,
    /// TensorBoard's event file (rank 0, `output.tensorboard`).
    tensorboard: Option<crate::tensorboard::EventWriter>,
    skipped: u64,
    consecutive_bad: u64,
    recoveries: u64,
    best_loss: Option<f64>,
    last_checkpoint: Option<PathBuf>,
    start_step: u64,
    evals: Vec<EvalRecord>,
    /// How the gradients are synchronised: collectives, or the parameter server once
    /// attached ([`Trainer::attach_parameter_server`]).
    sync: Box<dyn GradientSync<T>>,
    /// The control all-reduce's buffer: [`CTL_LEN`] values, then one slot per rank for
    /// its local time (see [`StepRecord::slowest_rank`]) where the world has two ranks or
    /// more.
    ctl: Vec<f32>,
    /// When this rank last left the gradient exchange (the step's last collective).
    left_exchange: Option<Instant>,
    /// The step of the checkpoint this worker resumed from, as its writer counted steps.
    /// The step count (`step + 1`) of the last comparison of the replicas' hashes.
    replicas_checked_at: u64,
    resumed_step: Option<u64>,
    /// Where a request to stop comes from ([`Trainer::stop_on`]).
    stop: Option<StopRequest>,
    /// Set once the ranks agreed to stop (the signal): the run checkpoints and ends after
    /// the current step.
    stopping: Option<i32>,
    /// What the set-up decided that the run's log should say (the hosts of a hierarchical
    /// all-reduce, the automatic choice of collective per bucket), said at the start of
    /// [`Trainer::run`].
    notes: Vec<String>,
    /// The automatic choice of collective per bucket, as the set-up made it (a resumed run
    /// takes the checkpoint's instead, and says so).
    auto_note: Option<String>,
    /// The hosts of the hierarchical dense all-reduce, when it is used (`summary.json`).
    hosts: Option<usize>,
    /// Where the compressed buckets are encoded, when on a device (`summary.json`).
    codec_device: Option<String>,
    /// Live membership's state (`cluster.membership = "live"`; `None` when fixed).
    live: Option<membership::Live>,
}

/// Values of the control all-reduce before the per-rank slots: loss·n, n, correct, the
/// loss and the gradient non-finite flags, the stop request, and whether a newcomer waits.
const CTL_LEN: usize = 7;

impl<T: Transport> Trainer<T> {
    /// Builds the worker: model (seeded, then rank 0's parameters and buffers broadcast),
    /// data shard, exchanger, optimizer. `out` is the run directory (rank 0 writes the
    /// metrics there; every rank writes its checkpoints there).
    pub fn new(
        plan: Plan,
        data: TrainData,
        mut comm: Communicator<T>,
        device: &Device,
        out: Option<RunDir>,
    ) -> Result<Self, TrainError> {
        let world = comm.world_size();
        if world != plan.config.cluster.workers {
            return Err(TrainError::Config(format!(
                "cluster.workers = {} but {world} ranks are connected",
                plan.config.cluster.workers
            )));
        }
        // A language model's vocabulary: the corpus's when unset, refused when it differs
        // (`dtrain check` / `dtrain run` resolved it already; in-process callers may not have).
        let mut plan = plan;
        plan.config
            .resolve_vocab("config", data.vocab())
            .map_err(|e| TrainError::Config(e.to_string()))?;
        let model = build_model(&plan, device)?;
        let infos = param_infos(model.as_ref());
        let built = build_sync(&plan, &infos, &mut comm, model.device())?;
        let mut t = Self::assemble(plan, data, comm, model, built, out)?;
        let (n, nb) = (t.num_params(), t.buffers.len());
        // Identical replicas: rank 0's initial state wins.
        let mut params = vec![0.0; n];
        t.model.read_params(&mut params);
        t.model.read_buffers(&mut t.buffers);
        let step = 0;
        broadcast_f32(&mut t.comm, &mut params)
            .map_err(|source| TrainError::Comm { step, source })?;
        if nb > 0 {
            broadcast_f32(&mut t.comm, &mut t.buffers)
                .map_err(|source| TrainError::Comm { step, source })?;
            t.model.write_buffers(&t.buffers);
        }
        t.model.write_params(&params);
        Ok(t)
    }

    /// A worker that takes a lost worker's place in a running group (live membership;
    /// `comm`'s transport holds that worker's rank, connected to the members, e.g.
    /// `TcpTransport::join`): waits for the group to admit it (at most `timeout`), builds
    /// the synchronisation over the group with the members, and receives the state of
    /// the step it enters at from them (see `handover`). [`Trainer::run`] then goes on
    /// from that step. `data` is the shard of the rank it takes.
    pub fn join(
        plan: Plan,
        data: TrainData,
        mut comm: Communicator<T>,
        device: &Device,
        out: Option<RunDir>,
        timeout: std::time::Duration,
    ) -> Result<Self, TrainError> {
        if !plan.config.live_membership() {
            return Err(TrainError::Config(
                "joining a running group needs cluster.membership = \"live\"".into(),
            ));
        }
        let workers = plan.config.cluster.workers;
        if comm.world_size() != workers {
            return Err(TrainError::Config(format!(
                "cluster.workers = {workers} but the transport has {} ranks",
                comm.world_size()
            )));
        }
        let mut plan = plan;
        plan.config
            .resolve_vocab("config", data.vocab())
            .map_err(|e| TrainError::Config(e.to_string()))?;
        let model = build_model(&plan, device)?;
        let comm_err = |source| TrainError::Comm { step: 0, source };
        // The newcomer's session begins as it asks to be admitted.
        let t_join = std::time::Instant::now();
        let membership = comm.join(timeout).map_err(comm_err)?;
        let infos = param_infos(model.as_ref());
        let built = build_sync(&plan, &infos, &mut comm, model.device())?;
        let mut t = Self::assemble(plan, data, comm, model, built, out)?;
        t.live_session(t_join);
        t.enter(&membership)?;
        Ok(t)
    }

    /// The worker of `plan` around a built model and synchronisation (the rank and world
    /// are `comm`'s group's), before any state is set.
    fn assemble(
        plan: Plan,
        data: TrainData,
        comm: Communicator<T>,
        model: Box<dyn Model>,
        built: BuiltSync<T>,
        out: Option<RunDir>,
    ) -> Result<Self, TrainError> {
        // On a GPU the optimizer step runs there (`crate::optim_device`).
        let device_moments =
            (*model.device() != dtrain_models::cpu_device()).then(DeviceMoments::default);
        let BuiltSync {
            sync,
            notes,
            auto_note,
            hosts,
            codec_device,
        } = built;
        let optimizer = plan.optimizer.build().map_err(TrainError::Config)?;
        let table = model.table();
        let n = table.num_params();
        let nb = table.num_buffers();
        Ok(Trainer {
            rank: comm.rank(),
            world: comm.world_size(),
            comm,
            model,
            data,
            device_moments,
            optimizer,
            grads: vec![0.0; n],
            micro_grads: Vec::new(),
            buffers: vec![0.0; nb],
            step: 0,
            metrics_file: None,
            eval_file: None,
            tensorboard: None,
            skipped: 0,
            consecutive_bad: 0,
            recoveries: 0,
            best_loss: None,
            ctl: Vec::new(),
            left_exchange: None,
            last_checkpoint: None,
            resumed_step: None,
            replicas_checked_at: 0,
            stop: None,
            stopping: None,
            hosts,
            codec_device,
            live: plan
                .config
                .live_membership()
                .then(membership::Live::default),
            start_step: 0,
            evals: Vec::new(),
            sync,
            out,
            plan,
            notes,
            auto_note,
        })
    }

    /// Switches this worker to parameter-server mode (`[cluster] mode = "ps"`, see
    /// [`crate::ps_mode`]): gradients are pushed to the servers over `transport` — the
    /// parameter-server lane of the same connections as the communicator's
    /// ([`dtrain_comms::split_ps`]) — instead of going through the exchanger. Every worker
    /// of the run must attach before its first step.
    pub fn attach_parameter_server(&mut self, transport: T) -> Result<(), TrainError>
    where
        T: 'static,
    {
        let c = &self.plan.config.cluster;
        if c.mode != crate::config::ClusterMode::Ps {
            return Err(TrainError::Config(
                "cluster.mode is not \"ps\": the trainer exchanges gradients with collectives"
                    .into(),
            ));
        }
        let step = self.step;
        let layers: Vec<std::ops::Range<usize>> = self
            .model
            .table()
            .params()
            .map(|p| p.offset..p.offset + p.numel)
            .collect();
        let ps = PsState::new(
            transport,
            c,
            &self.plan.method,
            &self.plan.memory,
            layers,
            self.plan.config.seed,
        )
        .map_err(|source| TrainError::Comm { step, source })?;
        self.sync = Box::new(ParameterServer::new(ps));
        Ok(())
    }

    /// Gives the synchronisation a second lane of this worker's connections (the tagged
    /// lane of [`dtrain_comms::split_tagged`], whose other lane is the communicator's) for
    /// exchanges left in flight across steps: Streaming DiLoCo's fragments with
    /// `sync.in_flight` (see [`crate::config::SyncConfig::wants_second_lane`]). Every worker
    /// of the run must attach before its first step, or none.
    pub fn attach_background(&mut self, transport: T) -> Result<(), TrainError>
    where
        T: 'static,
    {
        // The same settings as the communicator's (its timeout, chunking).
        let comm = Communicator::new(transport, self.comm.config().clone());
        if !self.sync.attach_background(comm) {
            return Err(TrainError::Config(format!(
                "sync.kind = {:?} runs no exchange in flight: it has no use for a second lane",
                self.plan.config.sync.name()
            )));
        }
        Ok(())
    }

    /// Stops the run when `stop` is raised (SIGTERM / SIGINT, see [`crate::signals`]): the
    /// request travels in the next step's control all-reduce, so every rank learns of it in
    /// the same step, whichever rank got it; they finish that step, write a checkpoint, and
    /// [`Trainer::run`] returns [`TrainError::Stopped`]. (The asynchronous parameter server
    /// has no lock-step all-reduce: a worker there stops at its next step without a
    /// checkpoint.)
    pub fn stop_on(&mut self, stop: StopRequest) {
        self.stop = Some(stop);
    }

    /// This worker's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of trainable parameters. They live only in the model: the optimizer updates
    /// each tensor's storage in place ([`Model::update_params`]).
    pub(super) fn num_params(&self) -> usize {
        self.model.table().num_params()
    }

    /// A flat copy of this rank's current parameters (identical on every rank, except
    /// between the synchronisations of a periodic `[sync]` kind).
    pub fn params(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.num_params()];
        self.model.read_params(&mut out);
        out
    }

    /// Steps completed.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The evaluations so far.
    pub fn evals(&self) -> &[EvalRecord] {
        &self.evals
    }
}

/// The gradient synchronisation of `plan` over the group of `comm`: what [`build_sync`]
/// built, and what the run's log and summary say of it.
struct BuiltSync<T: Transport> {
    sync: Box<dyn GradientSync<T>>,
    notes: Vec<String>,
    auto_note: Option<String>,
    hosts: Option<usize>,
    codec_device: Option<String>,
}

/// Builds the gradient synchronisation of `plan` for parameters `infos` over the group of
/// `comm` (a collective: the hosts' discovery and the automatic choice of collectives run
/// on every member): at the start, and again over the survivors when the group changes
/// (`membership`).
fn build_sync<T: Transport>(
    plan: &Plan,
    infos: &[ParamInfo],
    comm: &mut Communicator<T>,
    model_device: &Device,
) -> Result<BuiltSync<T>, TrainError> {
    let table_params: usize = infos.iter().map(ParamInfo::numel).sum();
    let mut exchanger = build_exchanger(plan, infos)?;
    let ExchangeSetup {
        mut notes,
        auto_note,
        topology,
    } = setup_exchange(&mut exchanger, comm, plan)?;
    // After the routes are chosen: a bucket's device encoder depends on its route.
    let local = crate::device::local_rank(comm.members()[comm.rank()]);
    let streaming_sync = plan.compressed_optimizer.is_none()
        && matches!(plan.config.sync, SyncConfig::StreamingDiloco { .. });
    let codec_spec = plan.codec_device.resolve(plan.config.cluster.device, local);
    let mut codec_use = match &codec_spec {
        Some(spec) => {
            let own = crate::device::CodecDevice::Auto.resolve(plan.config.cluster.device, local);
            let used = crate::exchange::device::place_codecs(
                &mut exchanger,
                spec,
                // The model's device, where the codecs' device is the worker's own.
                (own.as_deref() == Some(spec.as_str())).then_some(model_device),
            )
            .map_err(|e| TrainError::Config(format!("compress.device: {e}")))?;
            Some(used)
        }
        None => None,
    };
    let exchanger_hosts = exchanger.hierarchical_hosts();
    let sync = match plan.compressed_optimizer {
        None if streaming_sync => {
            let (sync, fragments) = streaming(
                plan,
                infos,
                exchanger,
                comm,
                topology.as_ref(),
                codec_spec.as_deref(),
            )?;
            // The fragments' buckets beside the whole model's (its every-step exchange
            // before `switch_step`).
            if let (Some(used), Some(f)) = (&mut codec_use, fragments) {
                used.absorb(f);
            }
            sync
        }
        None => Periodic::for_config(Collectives::new(exchanger), &plan.config.sync, table_params)
            .ok_or_else(|| {
                TrainError::Config(format!(
                    "sync.kind = {:?} has no single-exchanger synchronisation",
                    plan.config.sync.name()
                ))
            })?,
        Some(schedule) => {
            // The dense steps' all-reduce: the same buckets, uncompressed (hierarchical
            // across hosts as the run's own dense buckets are).
            let mut dense = Exchanger::new(
                infos,
                &plan.buckets,
                &dtrain_compress::baseline(),
                &dtrain_compress::MemoryConfig::None,
                plan.config.seed,
            )
            .map_err(config_error)?;
            if let Some(t) = &topology {
                dense.set_topology(t);
            }
            crate::sync::compressed_optimizer(
                schedule,
                Collectives::new(dense),
                Collectives::new(exchanger),
                table_params,
                plan,
            )
        }
    };
    // A periodic synchronisation's local steps apply the gradient where it lies: on a GPU
    // it never comes to the host between the rounds (`Periodic::sync_device`).
    let periodic =
        !matches!(plan.config.sync, SyncConfig::EveryStep) && plan.compressed_optimizer.is_none();
    if periodic
        && cfg!(any(feature = "cuda", feature = "wgpu-train"))
        && *model_device != dtrain_models::cpu_device()
        && plan.local_clip().is_none()
    {
        notes.push(format!(
            "sync.kind = {:?}: the local steps keep the gradient on the device (the optimizer \
             steps there; nothing crosses until a round exchanges the parameter change)",
            plan.config.sync.name()
        ));
    }
    let codec_device = codec_use.as_mut().map(|used| {
        // Whether the exchange reads the gradient where it lies
        // (`Trainer::gradient_stays_on_device`): the every-step exchange's buckets (a
        // periodic synchronisation's rounds exchange parameter changes, from the host).
        let shared = used.gradient_in_place;
        used.gradient_in_place &=
            !periodic && sync.reads_device_gradient() && plan.local_clip().is_none();
        notes.push(used.to_string());
        if let (true, Some(_)) = (used.gradient_in_place, plan.clip_norm) {
            notes.push(
                "the average comes to the host to be clipped (train.clip_norm), then goes up \
                 for the optimizer step on the device"
                    .into(),
            );
        }
        if shared && !used.gradient_in_place {
            notes.push(format!(
                "the gradient comes through the host to {}: {}",
                used.device,
                if plan.local_clip().is_some() {
                    "each worker clips its own gradient there first (train.clip_norm with a vote)"
                } else if plan.compressed_optimizer.is_some()
                    && plan.config.train.clip_norm.is_some()
                {
                    "the compressed optimizer clips each worker's gradient (train.clip_norm) \
                     on the host"
                } else if matches!(plan.config.sync, SyncConfig::EveryStep) {
                    "no bucket is encoded on the device from its own range of the gradient"
                } else if periodic {
                    "a round exchanges the parameter change from the host (the local steps \
                     keep the gradient on the device)"
                } else {
                    "this synchronisation exchanges on the host (only sync.kind = \"every-step\" \
                     hands the gradient over)"
                }
            ));
        }
        used.to_string()
    });
    Ok(BuiltSync {
        sync,
        notes,
        auto_note,
        hosts: exchanger_hosts,
        codec_device,
    })
}

/// The names and shapes of `model`'s parameters, in the order of its flat vector (what an
/// exchanger is built for).
pub(crate) fn param_infos(model: &dyn Model) -> Vec<ParamInfo> {
    model
        .table()
        .params()
        .map(|p| ParamInfo {
            name: p.name.clone(),
            shape: p.shape.clone(),
        })
        .collect()
}

/// Gives the exchanger the run's hosts (the hierarchical all-reduce of the dense buckets
/// over several hosts with several workers each: [`crate::launch::hosts`]) and emulated
/// link, and makes the automatic choice of collective per bucket (`compress.collective =
/// "auto"`) now, on every rank alike, rather than at the first step, so that the run's log
/// says it first. Returns the lines for that log (the hierarchy's, and the choice's) and
/// the hosts. A parameter-server run's exchanger is replaced before its first step
/// ([`Trainer::attach_parameter_server`]): nothing to do.
fn setup_exchange<T: Transport>(
    exchanger: &mut Exchanger,
    comm: &mut Communicator<T>,
    plan: &Plan,
) -> Result<ExchangeSetup, TrainError> {
    let mut notes = Vec::new();
    if plan.config.cluster.mode == crate::config::ClusterMode::Ps {
        return Ok(ExchangeSetup {
            notes,
            auto_note: None,
            topology: None,
        });
    }
    exchanger.set_link(Some(link_of(plan)?));
    let topology = crate::launch::hosts::discover(comm)
        .map_err(|source| TrainError::Comm { step: 0, source })?;
    exchanger.set_topology(&topology);
    if exchanger.hierarchical_hosts().is_some() {
        notes.push(format!(
            "dense buckets: hierarchical all-reduce over {} (leaders {:?})",
            topology.describe(),
            topology.leaders()
        ));
    }
    Ok(ExchangeSetup {
        notes,
        auto_note: choose_auto(exchanger, comm)?,
        topology: Some(topology),
    })
}

/// The emulated link of `[network]`.
fn link_of(plan: &Plan) -> Result<LinkSpec, TrainError> {
    let net = &plan.config.network;
    LinkSpec::parse(net.bandwidth.as_deref(), net.latency.as_deref())
        .map_err(|e| TrainError::Config(format!("network: {e}")))
}

/// With `compress.collective = "auto"`, times and chooses each bucket's collective (a
/// collective: every rank at once); the choice's line for the log, when it chose any.
fn choose_auto<T: Transport>(
    exchanger: &mut Exchanger,
    comm: &mut Communicator<T>,
) -> Result<Option<String>, TrainError> {
    if exchanger.gather_collective() != crate::exchange::GatherCollective::Auto {
        return Ok(None);
    }
    let report = exchanger
        .choose_collectives(comm)
        .map_err(|source| TrainError::Exchange { step: 0, source })?;
    Ok((!report.buckets.is_empty()).then(|| report.to_string()))
}

/// Streaming DiLoCo's synchronisation: `whole` for the every-step phase, and one exchanger
/// per fragment of `infos` (the run's method, buckets and link; each fragment's collectives
/// chosen for its own buckets).
///
/// Each fragment's exchanger encodes its compressed buckets on the device `codec_spec`
/// names, where one does (the fragment's change is on the host: its buckets go up, their
/// payloads come back); what they placed is returned beside the synchronisation.
fn streaming<T: Transport>(
    plan: &Plan,
    infos: &[ParamInfo],
    whole: Exchanger,
    comm: &mut Communicator<T>,
    topology: Option<&Topology>,
    codec_spec: Option<&str>,
) -> Result<StreamingBuilt<T>, TrainError> {
    let SyncConfig::StreamingDiloco {
        period,
        outer_lr,
        outer_momentum,
        switch_step,
        fragments,
        overlap,
        mixing,
        stripes,
        eager,
        ..
    } = plan.config.sync
    else {
        return Err(TrainError::Config("sync.kind: not streaming-diloco".into()));
    };
    let layouts = crate::sync::fragment_layout(infos, fragments, stripes)
        .map_err(|e| TrainError::Config(format!("sync.fragments: {e}")))?;
    let link = link_of(plan)?;
    let mut parts = Vec::with_capacity(layouts.len());
    let mut placed: Option<DeviceUse> = None;
    for l in layouts {
        let mut ex = build_exchanger(plan, &l.infos)?;
        ex.set_link(Some(link));
        if let Some(t) = topology {
            ex.set_topology(t);
        }
        choose_auto(&mut ex, comm)?;
        // After the routes are chosen, as for the whole model's exchanger.
        if let Some(spec) = codec_spec {
            let u = crate::exchange::device::place_codecs(&mut ex, spec, None)
                .map_err(|e| TrainError::Config(format!("compress.device: {e}")))?;
            match &mut placed {
                Some(p) => p.absorb(u),
                None => placed = Some(u),
            }
        }
        parts.push((l, Collectives::new(ex)));
    }
    let sync: Box<dyn GradientSync<T>> = Box::new(Streaming::new(
        Collectives::new(whole),
        parts,
        StreamingSettings {
            period,
            start: switch_step,
            outer_lr: outer_lr as f32,
            outer_momentum: outer_momentum as f32,
            overlap,
            mixing: mixing as f32,
            eager,
            total_steps: plan.total_steps,
        },
        infos.iter().map(ParamInfo::numel).sum(),
    ));
    Ok((sync, placed))
}

/// What [`streaming`] builds: the synchronisation, and where its fragments' compressed
/// buckets are encoded when a device was asked for.
type StreamingBuilt<T> = (Box<dyn GradientSync<T>>, Option<DeviceUse>);

/// What [`setup_exchange`] found: the lines for the run's log (the hierarchy's, the
/// automatic choice's) and the ranks' hosts (`None` for a parameter-server run).
struct ExchangeSetup {
    notes: Vec<String>,
    auto_note: Option<String>,
    topology: Option<Topology>,
}

/// Broadcasts `v` from rank 0 (f32 little-endian on the wire).
fn broadcast_f32<T: Transport>(comm: &mut Communicator<T>, v: &mut [f32]) -> Result<(), CommError> {
    let mut bytes: Vec<u8> = if comm.rank() == 0 {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    } else {
        Vec::new()
    };
    comm.broadcast(&mut bytes, 0)?;
    if comm.rank() != 0 {
        for (x, c) in v.iter_mut().zip(bytes.chunks_exact(4)) {
            *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
    Ok(())
}

/// The exchanger of `plan` for parameters `infos`: buckets, the method and its memory, the
/// collective of gathered payloads, the server residual, DLCP.
pub(crate) fn build_exchanger(plan: &Plan, infos: &[ParamInfo]) -> Result<Exchanger, TrainError> {
    let mut exchanger = Exchanger::new(
        infos,
        &plan.buckets,
        &plan.method,
        &plan.memory,
        plan.config.seed,
    )
    .map_err(config_error)?;
    exchanger.set_gather_collective(plan.collective);
    exchanger.set_server_error_feedback(plan.server_error_feedback);
    if let Some(d) = &plan.dlcp {
        let cfg = d
            .to_config(infos.len(), plan.config.seed)
            .map_err(|(field, m)| TrainError::Config(format!("{field}: {m}")))?;
        exchanger.set_dlcp(cfg, d.error_feedback);
    }
    Ok(exchanger)
}

fn config_error(e: dtrain_compress::ConfigError) -> TrainError {
    TrainError::Config(format!("compress.{}: {}", e.field, e.reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker dropped while alive learns it in whichever collective it was in: the
    /// step's control all-reduce or a bucket of its gradient exchange (the launcher lets it
    /// come back as a newcomer either way).
    #[test]
    fn the_comm_error_behind_a_step_or_an_exchange_is_found() {
        let excluded = || CommError::Excluded {
            detail: "membership epoch 1: the group went on without you".into(),
        };
        let in_exchange = TrainError::Exchange {
            step: 64,
            source: crate::exchange::ExchangeError::Comm {
                bucket: 0,
                source: excluded(),
            },
        };
        let in_control = TrainError::Comm {
            step: 64,
            source: excluded(),
        };
        for e in [in_exchange, in_control] {
            assert!(
                matches!(e.comm_error(), Some(CommError::Excluded { .. })),
                "{e}"
            );
        }
        assert!(TrainError::Config("x".into()).comm_error().is_none());
    }
}
