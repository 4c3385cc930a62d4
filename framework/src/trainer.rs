//! The data-parallel trainer: one [`Trainer`] per worker, all running the same step in
//! lock-step over a [`Communicator`].
//!
//! ```text
//! batch (epoch, j) of this rank ─► forward ─► backward into the flat gradient
//! ─► control all-reduce [loss·n, n, correct, non-finite flags, each rank's local time]
//!    (global loss; every rank decides alike; names the rank the others waited for)
//! ─► Exchanger: buckets → compensate → compress → collective → decompress → average
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

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use dtrain_comms::{CommError, Communicator, Transport};
use dtrain_compress::compressor::first_non_finite;
use dtrain_compress::Collective;
use dtrain_models::{Device, Metrics, Model};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, Checkpoint, CheckpointError};
use crate::config::{NonFinitePolicy, Plan};
use crate::data::TrainData;
use crate::exchange::bucket::ParamInfo;
use crate::exchange::{ExchangeError, Exchanger};
use crate::optim::{GroupState, Optimizer};
use crate::ps_mode::{PsState, Ready};

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
    /// A checkpoint does not fit this run.
    #[error("cannot resume from {path}: {reason}")]
    Resume {
        /// The checkpoint.
        path: String,
        /// Why.
        reason: String,
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

/// Seconds per phase of one step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Phases {
    /// Building the batch (host data → tensors).
    pub data_s: f64,
    /// Forward pass and loss.
    pub forward_s: f64,
    /// Backward pass and gradient extraction into the flat buffer.
    pub backward_s: f64,
    /// Compensate + compress (and the own-payload decode for error feedback).
    pub compress_s: f64,
    /// Inside collectives (gradient exchange and the control all-reduce).
    pub communicate_s: f64,
    /// Decoding, summing, averaging.
    pub decompress_s: f64,
    /// Time the step waited on gradient communication that compression / decompression of
    /// other buckets did not hide (with overlap; equal to the exchange's share of
    /// `communicate_s` without).
    #[serde(default)]
    pub wait_s: f64,
    /// The part of `communicate_s` spent in the step's control all-reduce, right after the
    /// backward pass. A rank waits there until the slowest rank has finished its backward,
    /// so this is mostly load imbalance and jitter between ranks (the call itself is a few
    /// floats); 0 where there is no lock-step control all-reduce (asynchronous PS).
    #[serde(default)]
    pub sync_s: f64,
    /// Optimizer update and writing the parameters back into the model.
    pub optimizer_s: f64,
    /// The whole step, wall clock.
    pub step_s: f64,
}

impl Phases {
    fn add(&mut self, o: &Phases) {
        self.data_s += o.data_s;
        self.forward_s += o.forward_s;
        self.backward_s += o.backward_s;
        self.compress_s += o.compress_s;
        self.communicate_s += o.communicate_s;
        self.decompress_s += o.decompress_s;
        self.wait_s += o.wait_s;
        self.sync_s += o.sync_s;
        self.optimizer_s += o.optimizer_s;
        self.step_s += o.step_s;
    }

    fn scaled(&self, k: f64) -> Phases {
        Phases {
            data_s: self.data_s * k,
            forward_s: self.forward_s * k,
            backward_s: self.backward_s * k,
            compress_s: self.compress_s * k,
            communicate_s: self.communicate_s * k,
            decompress_s: self.decompress_s * k,
            wait_s: self.wait_s * k,
            sync_s: self.sync_s * k,
            optimizer_s: self.optimizer_s * k,
            step_s: self.step_s * k,
        }
    }
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Global step (0-based) of this update.
    pub step: u64,
    /// Epoch (0-based).
    pub epoch: u64,
    /// Mean training loss over all ranks' batches.
    pub loss: f64,
    /// Training accuracy over all ranks' batches.
    pub accuracy: f64,
    /// Learning rate used.
    pub lr: f64,
    /// The method's knob this step (`theta`, `density`), if it has one.
    pub ratio_name: Option<String>,
    /// Its value.
    pub ratio: Option<f64>,
    /// Bytes this rank sent (transport-level, framing included).
    pub bytes_sent: u64,
    /// Bytes this rank received.
    pub bytes_received: u64,
    /// Bytes of this rank's compressed payloads.
    pub payload_bytes: u64,
    /// Whether the update was skipped (non-finite under `skip`).
    pub skipped: bool,
    /// Examples processed by all ranks this step.
    pub samples: u64,
    /// Per-phase times of this rank.
    pub time: Phases,
    /// DLCP (`compress.collective = "dlcp"`): fraction of all workers' gradient elements the
    /// bounded-loss all-reduce completed without, this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lossy_dropped: Option<f64>,
    /// DLCP: packets this rank retransmitted this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retransmitted: Option<u64>,
    /// Parameter-server mode: seconds this rank's server spent aggregating this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_s: Option<f64>,
    /// The rank whose local work since it left the previous step's gradient exchange
    /// (optimizer, logging, data, forward, backward) took longest. Ranks leave a collective
    /// nearly together (a wake-up apart), so this is the rank that reached the step's
    /// control all-reduce last: the one the others waited for in [`Phases::sync_s`]. Every
    /// rank's time travels in the control all-reduce (one float per rank). Absent with one
    /// worker and in the asynchronous PS mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slowest_rank: Option<usize>,
    /// How much longer the slowest rank's local work took than this rank's: the part of
    /// `sync_s` that is load imbalance or jitter rather than the call itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub behind_slowest_s: Option<f64>,
}

/// One line of `eval.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    /// Epochs completed.
    pub epoch: u64,
    /// Steps completed.
    pub step: u64,
    /// Mean test loss.
    pub loss: f64,
    /// Test accuracy (top-1; tokens for language models).
    pub accuracy: f64,
    /// Test perplexity `exp(loss)`.
    pub perplexity: f64,
    /// Examples (or tokens) scored.
    pub count: u64,
}

/// `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Run name.
    pub name: String,
    /// Model kind.
    pub model: String,
    /// Compression method.
    pub method: String,
    /// Workers.
    pub workers: usize,
    /// Steps completed (in total, including those before a resume).
    pub steps: u64,
    /// Steps run by this process (after a resume: since the resume).
    pub steps_this_session: u64,
    /// The step this session started at (0 unless resumed).
    pub resumed_from: u64,
    /// Final evaluation, if any.
    pub final_eval: Option<EvalRecord>,
    /// Mean training loss of the last epoch's steps (this session).
    pub final_train_loss: Option<f64>,
    /// Mean per-phase times per step, excluding the first step of the session (warm-up).
    pub mean_step: Phases,
    /// Mean bytes sent per step by rank 0.
    pub bytes_sent_per_step: f64,
    /// Mean payload bytes per step by rank 0.
    pub payload_bytes_per_step: f64,
    /// Model parameters.
    pub params: u64,
    /// `4·params / payload bytes per step`.
    pub compression_ratio: f64,
    /// Training throughput, examples per second over all workers.
    pub samples_per_s: f64,
    /// Wall time of this session in seconds.
    pub wall_s: f64,
    /// Steps skipped for non-finite values.
    pub skipped_steps: u64,
    /// Rollbacks of the recover policy.
    pub recoveries: u64,
    /// The factor applied to θ by the recover policy (1 = never lowered).
    pub theta_scale: f64,
    /// DLCP: mean fraction of the gradient dropped per step (absent without DLCP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lossy_dropped: Option<f64>,
    /// Per rank, the steps of this session in which it was the slowest to reach the
    /// control all-reduce ([`StepRecord::slowest_rank`]); empty where that is not measured
    /// (one worker, asynchronous PS). A rank far above `1/workers` is a straggler.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slowest_rank_steps: Vec<u64>,
    /// The collective that carried the run's compressed buckets (with no compressed bucket,
    /// the one of the dense buckets; with `mode = "ps"`, the parameter server): what `dtrain
    /// simulate` models. `None` in runs written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collective: Option<Collective>,
    /// Each bucket's collective, in bucket order, when they differ from one another (a
    /// compressed run's small dense buckets go through the dense all-reduce); empty when
    /// every bucket used [`Summary::collective`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bucket_collectives: Vec<Collective>,
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

/// Serialises model construction: burn's CPU RNG is process-global, so seeding and
/// initialising must not interleave between threads (in-process tests run several ranks).
static BUILD: Mutex<()> = Mutex::new(());

/// Builds the model of `plan` on `device`, initialised from the run seed.
pub fn build_model(plan: &Plan, device: &Device) -> Result<Box<dyn Model>, TrainError> {
    let _g = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    device.seed(plan.config.seed);
    let model = plan
        .config
        .model
        .build(device)
        .map_err(|e| TrainError::Config(format!("model: {e}")))?;
    // burn initialises parameters lazily, on first access: force it while the seeded RNG is
    // ours.
    let mut scratch = vec![0f32; model.table().num_params()];
    model.read_params(&mut scratch);
    let mut scratch = vec![0f32; model.table().num_buffers()];
    model.read_buffers(&mut scratch);
    Ok(model)
}

fn mix(a: u64, b: u64, c: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ c.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Meta {
    step: u64,
    world: usize,
    rank: usize,
    seed: u64,
    params: usize,
    buffers: usize,
    method: String,
    optimizer_steps: BTreeMap<u64, u64>,
    /// Buckets whose error-feedback memory is stored as `mem/<id>`.
    memory_keys: Vec<u64>,
    skipped: u64,
    recoveries: u64,
    /// Stored as IEEE bits so that JSON cannot round it.
    best_loss_bits: Option<u64>,
    /// Steps per epoch of the run that wrote it (maps the step to an epoch on an elastic
    /// resume).
    #[serde(default)]
    steps_per_epoch: u64,
}

/// The scalar part of a MIPD server's checkpointed state (section `ps/mipd/server`; its
/// vectors are the raw sections `ps/mipd/smoothed`, `ps/mipd/carry`, `ps/mipd/received`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct MipdServerMeta {
    /// The shard the rank serves.
    shard: usize,
    /// The server's next step (the checkpoint's step).
    next_step: u64,
}

/// One worker of a data-parallel run.
pub struct Trainer<T: Transport> {
    plan: Plan,
    rank: usize,
    world: usize,
    comm: Communicator<T>,
    model: Box<dyn Model>,
    data: TrainData,
    exchanger: Exchanger,
    optimizer: Optimizer,
    grads: Vec<f32>,
    buffers: Vec<f32>,
    step: u64,
    out: Option<RunDir>,
    metrics_file: Option<std::fs::File>,
    eval_file: Option<std::fs::File>,
    skipped: u64,
    consecutive_bad: u64,
    recoveries: u64,
    best_loss: Option<f64>,
    last_checkpoint: Option<PathBuf>,
    start_step: u64,
    evals: Vec<EvalRecord>,
    /// Parameter-server mode (`[cluster] mode = "ps"`), once attached.
    ps: Option<PsState<T>>,
    /// The control all-reduce's buffer: [`CTL_LEN`] values, then one slot per rank for
    /// its local time (see [`StepRecord::slowest_rank`]) where the world has two ranks or
    /// more.
    ctl: Vec<f32>,
    /// When this rank last left the gradient exchange (the step's last collective).
    left_exchange: Option<Instant>,
}

/// Values of the control all-reduce before the per-rank slots: loss·n, n, correct, the
/// loss and the gradient non-finite flags.
const CTL_LEN: usize = 5;

impl<T: Transport> Trainer<T> {
    /// Builds the worker: model (seeded, then rank 0's parameters and buffers broadcast),
    /// data shard, exchanger, optimizer. `out` is the run directory (rank 0 writes the
    /// metrics there; every rank writes its checkpoints there).
    pub fn new(
        plan: Plan,
        data: TrainData,
        comm: Communicator<T>,
        device: &Device,
        out: Option<RunDir>,
    ) -> Result<Self, TrainError> {
        let rank = comm.rank();
        let world = comm.world_size();
        if world != plan.config.cluster.workers {
            return Err(TrainError::Config(format!(
                "cluster.workers = {} but {world} ranks are connected",
                plan.config.cluster.workers
            )));
        }
        if let (Some(v), dtrain_models::ModelSpec::Lstm(spec)) = (data.vocab(), &plan.config.model)
        {
            if spec.vocab != v {
                return Err(TrainError::Config(format!(
                    "model.vocab = {} but the {:?} corpus has {v} tokens: set model.vocab = {v}",
                    spec.vocab, plan.config.data.kind
                )));
            }
        }
        let model = build_model(&plan, device)?;
        let table = model.table();
        let infos: Vec<ParamInfo> = table
            .params()
            .map(|p| ParamInfo {
                name: p.name.clone(),
                shape: p.shape.clone(),
            })
            .collect();
        let mut exchanger = Exchanger::new(
            &infos,
            &plan.buckets,
            &plan.method,
            &plan.memory,
            plan.config.seed,
        )
        .map_err(|e| TrainError::Config(format!("compress.{}: {}", e.field, e.reason)))?;
        exchanger.set_gather_collective(plan.collective);
        if let Some(d) = &plan.dlcp {
            let cfg = d
                .to_config(infos.len(), plan.config.seed)
                .map_err(|(field, m)| TrainError::Config(format!("{field}: {m}")))?;
            exchanger.set_dlcp(cfg, d.error_feedback);
        }
        let optimizer = plan.optimizer.build().map_err(TrainError::Config)?;
        let n = table.num_params();
        let nb = table.num_buffers();
        let mut t = Trainer {
            rank,
            world,
            comm,
            model,
            data,
            exchanger,
            optimizer,
            grads: vec![0.0; n],
            buffers: vec![0.0; nb],
            step: 0,
            metrics_file: None,
            eval_file: None,
            skipped: 0,
            consecutive_bad: 0,
            recoveries: 0,
            best_loss: None,
            ctl: Vec::new(),
            left_exchange: None,
            last_checkpoint: None,
            start_step: 0,
            evals: Vec::new(),
            ps: None,
            out,
            plan,
        };
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

    /// Switches this worker to parameter-server mode (`[cluster] mode = "ps"`, see
    /// [`crate::ps_mode`]): gradients are pushed to the servers over `transport` — the
    /// parameter-server lane of the same connections as the communicator's
    /// ([`dtrain_comms::split_ps`]) — instead of going through the exchanger. Every worker
    /// of the run must attach before its first step.
    pub fn attach_parameter_server(&mut self, transport: T) -> Result<(), TrainError> {
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
        self.ps = Some(ps);
        Ok(())
    }

    /// Applies one parameter-server aggregate (the mean gradient of `r.step`) with that
    /// step's learning rate. A non-finite aggregate is the same on every worker, so every
    /// worker skips it alike.
    fn apply_aggregate(&mut self, mut r: Ready) {
        if first_non_finite(&r.grad).is_some() {
            self.skipped += 1;
            return;
        }
        if let Some(c) = self.plan.clip_norm {
            clip_to_norm(&mut r.grad, c);
        }
        let lr = self.lr_at(r.step);
        self.optimizer.begin(0, self.num_params());
        let optimizer = &mut self.optimizer;
        let grads = &r.grad;
        self.model.update_params(&mut |offset, p| {
            optimizer.apply(0, offset, p, &grads[offset..offset + p.len()], lr as f32)
        });
    }

    /// The learning rate of `step`.
    fn lr_at(&self, step: u64) -> f64 {
        let global_batch = self.plan.config.data.batch_size * self.world;
        self.plan.lr.at(
            step as f64 / self.plan.steps_per_epoch as f64,
            self.plan.config.train.epochs as f64,
            global_batch,
        )
    }

    /// Parameter-server mode: waits for and applies the aggregates of every step pushed so
    /// far, so that every replica is identical and no server traffic is in flight (before
    /// collectives: evaluation, checkpoints). A no-op otherwise.
    fn ps_sync(&mut self) -> Result<(), TrainError> {
        let step = self.step;
        let Some(ps) = self.ps.as_mut() else {
            return Ok(());
        };
        let ready = ps
            .drain()
            .map_err(|source| TrainError::Comm { step, source })?;
        for r in ready {
            self.apply_aggregate(r);
        }
        Ok(())
    }

    /// This worker's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The run's collective and, when the buckets differ, each bucket's
    /// ([`Summary::collective`], [`Summary::bucket_collectives`]).
    fn collectives(&self) -> (Collective, Vec<Collective>) {
        if self.ps.is_some() {
            return (Collective::ParameterServer, Vec::new());
        }
        let per_bucket = self.exchanger.collectives();
        let dense = [Collective::AllReduce, Collective::Dlcp];
        let main = per_bucket
            .iter()
            .copied()
            .find(|c| !dense.contains(c))
            .or_else(|| per_bucket.first().copied())
            .unwrap_or(Collective::AllReduce);
        if per_bucket.iter().all(|&c| c == main) {
            (main, Vec::new())
        } else {
            (main, per_bucket)
        }
    }

    /// Number of trainable parameters. They live only in the model: the optimizer updates
    /// each tensor's storage in place ([`Model::update_params`]).
    fn num_params(&self) -> usize {
        self.model.table().num_params()
    }

    /// A flat copy of the current parameters (identical on every rank).
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

    /// Restores the state of checkpoint directory `dir` (this rank's file in it).
    ///
    /// With a different worker count the checkpoint is accepted only where that is well
    /// defined: no per-rank state (no error-feedback memory) and written at an epoch
    /// boundary. Every rank then starts from rank 0's file (parameters and optimizer state
    /// are identical on all ranks) at the first step of the next epoch under the new shard
    /// layout.
    pub fn resume_from(&mut self, dir: &Path) -> Result<(), TrainError> {
        let bad_at = |path: &Path, reason: String| TrainError::Resume {
            path: path.display().to_string(),
            reason,
        };
        // Normally this rank's own file is the only one read; rank 0's file is the fallback
        // when the worker count changed (its file is missing, or it names another world).
        let own = dir.join(format!("rank-{}.ckpt", self.rank));
        let mut loaded = if own.exists() {
            let ck = Checkpoint::load(&own)?;
            let world = ck.json::<Meta>("meta")?.world;
            (world == self.world).then_some((own, ck))
        } else {
            None
        };
        let elastic = loaded.is_none();
        if elastic {
            let rank0 = dir.join("rank-0.ckpt");
            if !rank0.exists() {
                return Err(bad_at(&rank0, "missing (incomplete checkpoint?)".into()));
            }
            let ck0 = Checkpoint::load(&rank0)?;
            let meta0: Meta = ck0.json("meta")?;
            let why = if !meta0.memory_keys.is_empty() {
                Some("its error-feedback memories are per rank".to_string())
            } else if ck0
                .names()
                .any(|n| n.starts_with("ps/mem/") || n.starts_with("ps/mipd/"))
            {
                Some("its parameter-server state is per rank and per shard".to_string())
            } else if meta0.steps_per_epoch == 0 || meta0.step % meta0.steps_per_epoch != 0 {
                Some(format!(
                    "it was written at step {} inside an epoch (data shards are per rank)",
                    meta0.step
                ))
            } else {
                None
            };
            if let Some(why) = why {
                return Err(bad_at(
                    dir,
                    format!(
                        "written by {} workers, this run has {}: a different cluster.workers is \
                         only possible from an epoch-boundary checkpoint without per-rank state, \
                         and {why}",
                        meta0.world, self.world
                    ),
                ));
            }
            loaded = Some((rank0, ck0));
        }
        let (path, ck) = loaded.expect("a checkpoint file was loaded");
        let bad = |reason: String| bad_at(&path, reason);
        let meta: Meta = ck.json("meta")?;
        if meta.params != self.num_params() || meta.buffers != self.buffers.len() {
            return Err(bad(format!(
                "the checkpoint's model has {} parameters / {} buffers, this one {} / {}",
                meta.params,
                meta.buffers,
                self.num_params(),
                self.buffers.len()
            )));
        }
        if meta.method != self.plan.method.name() {
            return Err(bad(format!(
                "written with compress.kind = {:?}, this run uses {:?}",
                meta.method,
                self.plan.method.name()
            )));
        }
        if meta.seed != self.plan.config.seed {
            return Err(bad(format!(
                "written with seed {}, this run has seed {} (data order would differ)",
                meta.seed, self.plan.config.seed
            )));
        }
        let params = ck.f32("params")?;
        let buffers = ck.f32("buffers")?;
        if params.len() != self.num_params() || buffers.len() != self.buffers.len() {
            return Err(bad(format!(
                "its parameter sections hold {} + {} values, this model has {} + {}",
                params.len(),
                buffers.len(),
                self.num_params(),
                self.buffers.len()
            )));
        }
        self.buffers = buffers;
        let mut opt = BTreeMap::new();
        for (&key, &steps) in &meta.optimizer_steps {
            opt.insert(
                key,
                GroupState {
                    step: steps,
                    m: ck.f32(&format!("opt/{key}/m"))?,
                    v: ck.f32(&format!("opt/{key}/v"))?,
                },
            );
        }
        self.optimizer.import(opt);
        let mut ex: crate::exchange::ExchangerState = ck.json("exchanger")?;
        for key in &meta.memory_keys {
            ex.memory.insert(*key, ck.f32(&format!("mem/{key}"))?);
        }
        self.exchanger.import_state(ex).map_err(bad)?;
        if let Some(ps) = self.ps.as_mut() {
            let names: Vec<String> = ck.names().map(|n| n.to_string()).collect();
            let mut st: crate::ps_mode::PsCodecState = if names.iter().any(|n| n == "ps/state") {
                ck.json("ps/state")?
            } else {
                Default::default()
            };
            for n in &names {
                if let Some(k) = n.strip_prefix("ps/mem/") {
                    let k: u64 = k
                        .parse()
                        .map_err(|_| bad(format!("bad section name {n:?}")))?;
                    st.memory.insert(k, ck.f32(n)?);
                }
            }
            if names.iter().any(|n| n == "ps/mipd/server") {
                let m: MipdServerMeta = ck.json("ps/mipd/server")?;
                if m.next_step != meta.step {
                    return Err(bad(format!(
                        "its MIPD server state is at step {}, the checkpoint at step {}",
                        m.next_step, meta.step
                    )));
                }
                let received = ck.bytes("ps/mipd/received")?;
                if let Some(b) = received.iter().find(|&&b| b > 1) {
                    return Err(bad(format!("ps/mipd/received holds {b}, not 0 or 1")));
                }
                st.mipd_server = Some((
                    m.shard,
                    dtrain_compress::mipd::MipdServerState {
                        next_step: m.next_step,
                        smoothed: ck.f32("ps/mipd/smoothed")?,
                        carry: ck.f32("ps/mipd/carry")?,
                        received: received.iter().map(|&b| b == 1).collect(),
                    },
                ));
            }
            ps.import_state(st).map_err(bad)?;
        }
        self.model.write_params(&params);
        if !self.buffers.is_empty() {
            self.model.write_buffers(&self.buffers);
        }
        self.model.reset_state();
        // A recurrent model's carried state (per rank, its own batch rows) continues where it
        // was; after an elastic resume the shards changed, so it starts afresh.
        if !elastic && ck.names().any(|n| n == "model_state") {
            let state = ck.f32("model_state")?;
            self.model
                .set_carried_state(&state)
                .map_err(|e| bad(e.to_string()))?;
        }
        self.step = if elastic {
            meta.step / meta.steps_per_epoch * self.plan.steps_per_epoch
        } else {
            meta.step
        };
        self.start_step = self.step;
        if let Some(ps) = self.ps.as_mut() {
            // The servers count trainer steps: every rank restarts the clock here.
            ps.start_at(self.step).map_err(|source| TrainError::Comm {
                step: self.step,
                source,
            })?;
        }
        self.skipped = meta.skipped;
        self.recoveries = meta.recoveries;
        self.best_loss = meta.best_loss_bits.map(f64::from_bits);
        self.last_checkpoint = Some(dir.to_path_buf());
        Ok(())
    }

    /// Writes this rank's checkpoint for the current step; rank 0 then points
    /// `checkpoints/LATEST` at it (after a barrier, so LATEST only ever names complete
    /// checkpoints) and prunes old ones.
    pub fn save_checkpoint(&mut self) -> Result<Option<PathBuf>, TrainError> {
        self.ps_sync()?;
        let Some(out) = self.out.clone() else {
            return Ok(None);
        };
        let dir = out.checkpoints().join(format!("step-{:010}", self.step));
        std::fs::create_dir_all(&dir).map_err(|source| TrainError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        let mut ck = Checkpoint::new();
        let opt = self.optimizer.export();
        let mut ex = self.exchanger.export_state();
        // The memories are large: stored as raw f32 sections, not JSON.
        let mem = std::mem::take(&mut ex.memory);
        let meta = Meta {
            step: self.step,
            world: self.world,
            rank: self.rank,
            seed: self.plan.config.seed,
            params: self.num_params(),
            buffers: self.buffers.len(),
            method: self.plan.method.name().to_string(),
            optimizer_steps: opt.iter().map(|(k, g)| (*k, g.step)).collect(),
            memory_keys: mem.keys().copied().collect(),
            skipped: self.skipped,
            recoveries: self.recoveries,
            best_loss_bits: self.best_loss.map(f64::to_bits),
            steps_per_epoch: self.plan.steps_per_epoch,
        };
        ck.put_json("meta", &meta);
        ck.put_json("exchanger", &ex);
        ck.put_f32("params", &self.params());
        let carried = self.model.carried_state();
        if !carried.is_empty() {
            ck.put_f32("model_state", &carried);
        }
        if !self.buffers.is_empty() {
            self.model.read_buffers(&mut self.buffers);
        }
        ck.put_f32("buffers", &self.buffers);
        for (k, g) in &opt {
            ck.put_f32(&format!("opt/{k}/m"), &g.m);
            ck.put_f32(&format!("opt/{k}/v"), &g.v);
        }
        for (k, v) in &mem {
            ck.put_f32(&format!("mem/{k}"), v);
        }
        if let Some(ps) = &self.ps {
            // Compressed pushes: each shard's compressor state (JSON) and memory (raw f32);
            // MIPD: the worker residual, and the server state of the shard this rank serves.
            let st = ps.export_state();
            ck.put_json("ps/state", &st);
            for (k, v) in &st.memory {
                ck.put_f32(&format!("ps/mem/{k}"), v);
            }
            if let Some((shard, server)) = &st.mipd_server {
                ck.put_json(
                    "ps/mipd/server",
                    &MipdServerMeta {
                        shard: *shard,
                        next_step: server.next_step,
                    },
                );
                ck.put_f32("ps/mipd/smoothed", &server.smoothed);
                ck.put_f32("ps/mipd/carry", &server.carry);
                ck.put_bytes(
                    "ps/mipd/received",
                    server.received.iter().map(|&r| r as u8).collect(),
                );
            }
        }
        ck.put_bytes("config.toml", self.plan.config.to_toml().into_bytes());
        ck.save(&dir.join(format!("rank-{}.ckpt", self.rank)))?;
        let step = self.step;
        self.comm
            .barrier()
            .map_err(|source| TrainError::Comm { step, source })?;
        if self.rank == 0 {
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default();
            checkpoint::write_atomic(&out.checkpoints().join("LATEST"), name.as_bytes())?;
            self.prune(&out)?;
        }
        self.last_checkpoint = Some(dir.clone());
        Ok(Some(dir))
    }

    fn prune(&self, out: &RunDir) -> Result<(), TrainError> {
        let keep = self.plan.config.checkpoint.keep.max(1);
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(out.checkpoints())
            .map(|d| {
                d.flatten()
                    .map(|e| e.path())
                    .filter(|p| {
                        p.is_dir()
                            && p.file_name()
                                .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
                    })
                    .collect()
            })
            .unwrap_or_default();
        dirs.sort();
        if dirs.len() > keep {
            for d in &dirs[..dirs.len() - keep] {
                let _ = std::fs::remove_dir_all(d);
            }
        }
        Ok(())
    }

    fn open_logs(&mut self) -> Result<(), TrainError> {
        if self.rank != 0 {
            return Ok(());
        }
        if let Some(out) = &self.out {
            let open = |name: &str| {
                let p = out.root.join(name);
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&p)
                    .map_err(|source| TrainError::Io {
                        path: p.display().to_string(),
                        source,
                    })
            };
            self.metrics_file = Some(open("metrics.jsonl")?);
            self.eval_file = Some(open("eval.jsonl")?);
        }
        Ok(())
    }

    /// Appends `v` as one JSON line to `file` (opened only on rank 0 with a run directory).
    fn log_line<S: Serialize>(
        file: &mut Option<std::fs::File>,
        out: Option<&RunDir>,
        name: &str,
        v: &S,
    ) -> Result<(), TrainError> {
        if let Some(f) = file {
            let mut line = serde_json::to_string(v).unwrap_or_default();
            line.push('\n');
            f.write_all(line.as_bytes())
                .map_err(|source| TrainError::Io {
                    path: out
                        .map_or_else(|| name.into(), |o| o.root.join(name).display().to_string()),
                    source,
                })?;
        }
        Ok(())
    }

    /// Runs to the end of the plan (from the current step) and returns the summary (rank 0
    /// also writes `summary.json`).
    pub fn run(&mut self, obs: &mut dyn Observer) -> Result<Summary, TrainError> {
        self.open_logs()?;
        let per_epoch = self.plan.steps_per_epoch;
        let total = self.plan.total_steps;
        let epochs = self.plan.config.train.epochs;
        let global_batch = self.plan.config.data.batch_size * self.world;
        obs.on_start(self.step, total, per_epoch);
        let t_start = Instant::now();
        let session_start = self.step;
        let mut sum = Phases::default();
        let mut timed = 0u64;
        let (mut bytes, mut payload) = (0f64, 0f64);
        // DLCP: sum of per-step dropped fractions, steps.
        let mut lossy = (0f64, 0u64);
        let mut samples = 0u64;
        let mut slowest = Vec::new();
        let mut epoch_loss = (0f64, 0u64);
        let policy = self.plan.config.failure.non_finite;
        if policy == NonFinitePolicy::Recover && self.last_checkpoint.is_none() {
            // A rollback target from the very start.
            self.save_checkpoint()?;
        }
        while self.step < total {
            let step = self.step;
            let epoch = step / per_epoch;
            let j = (step % per_epoch) as usize;
            if j == 0 {
                epoch_loss = (0.0, 0);
            }
            let rec = self.train_step(epoch, j, global_batch, epochs as f64)?;
            match rec {
                StepOutcome::Done(r) => {
                    if step > session_start {
                        sum.add(&r.time);
                        timed += 1;
                    }
                    bytes += r.bytes_sent as f64;
                    payload += r.payload_bytes as f64;
                    if let Some(d) = r.lossy_dropped {
                        lossy.0 += d;
                        lossy.1 += 1;
                    }
                    samples += r.samples;
                    if let Some(k) = r.slowest_rank {
                        slowest.resize(self.world, 0u64);
                        slowest[k] += 1;
                    }
                    epoch_loss.0 += r.loss;
                    epoch_loss.1 += 1;
                    if step % self.plan.config.output.log_every.max(1) == 0 {
                        Self::log_line(
                            &mut self.metrics_file,
                            self.out.as_ref(),
                            "metrics.jsonl",
                            &r,
                        )?;
                    }
                    obs.on_step(&r);
                }
                StepOutcome::RolledBack => {
                    obs.on_message(&format!(
                        "step {step}: rolled back to step {} (recover policy, θ scale {:.3})",
                        self.step,
                        self.exchanger.theta_scale()
                    ));
                    continue;
                }
            }
            self.step += 1;
            let done_epoch = self.step % per_epoch == 0;
            let epochs_done = self.step / per_epoch;
            let last = self.step == total;
            let eval_every = self.plan.config.train.eval_every_epochs;
            if (done_epoch && eval_every > 0 && epochs_done % eval_every == 0) || last {
                let e = self.evaluate(epochs_done)?;
                Self::log_line(&mut self.eval_file, self.out.as_ref(), "eval.jsonl", &e)?;
                obs.on_eval(&e);
                self.evals.push(e);
            }
            let ck = &self.plan.config.checkpoint;
            let by_steps = ck.every_steps.is_some_and(|n| n > 0 && self.step % n == 0);
            let by_epochs = done_epoch
                && ck
                    .every_epochs
                    .is_some_and(|n| n > 0 && epochs_done % n == 0);
            if by_steps || by_epochs || (last && self.out.is_some()) {
                if let Some(d) = self.save_checkpoint()? {
                    obs.on_message(&format!("checkpoint {}", d.display()));
                }
            }
        }
        if session_start == total && total > 0 {
            // Resumed at the end: a finished run is re-evaluated (e.g. with a larger
            // `data.test_limit`); its training is not repeated.
            let e = self.evaluate(total / per_epoch)?;
            Self::log_line(&mut self.eval_file, self.out.as_ref(), "eval.jsonl", &e)?;
            obs.on_eval(&e);
            self.evals.push(e);
        }
        if let Some(ps) = self.ps.as_mut() {
            // Leave the parameter server (serving the others until they leave too).
            let step = self.step;
            let ready = ps
                .finish()
                .map_err(|source| TrainError::Comm { step, source })?;
            for r in ready {
                self.apply_aggregate(r);
            }
        }
        let wall = t_start.elapsed().as_secs_f64();
        let n_session = self.step - session_start;
        let mean = if timed > 0 {
            sum.scaled(1.0 / timed as f64)
        } else {
            sum
        };
        let per = |x: f64| {
            if n_session > 0 {
                x / n_session as f64
            } else {
                0.0
            }
        };
        let payload_per_step = per(payload);
        let params = self.num_params() as u64;
        let (collective, bucket_collectives) = self.collectives();
        let summary = Summary {
            name: self.plan.config.name.clone(),
            model: self.plan.config.model.kind().to_string(),
            method: self.plan.method.name().to_string(),
            workers: self.world,
            steps: self.step,
            steps_this_session: n_session,
            resumed_from: session_start,
            final_eval: self.evals.last().cloned(),
            final_train_loss: (epoch_loss.1 > 0).then(|| epoch_loss.0 / epoch_loss.1 as f64),
            mean_step: mean,
            bytes_sent_per_step: per(bytes),
            payload_bytes_per_step: payload_per_step,
            params,
            compression_ratio: if payload_per_step > 0.0 {
                4.0 * params as f64 / payload_per_step
            } else {
                0.0
            },
            samples_per_s: if wall > 0.0 {
                samples as f64 / wall
            } else {
                0.0
            },
            wall_s: wall,
            skipped_steps: self.skipped,
            recoveries: self.recoveries,
            theta_scale: self.exchanger.theta_scale(),
            lossy_dropped: (self.plan.dlcp.is_some() && lossy.1 > 0)
                .then(|| lossy.0 / lossy.1 as f64),
            slowest_rank_steps: slowest,
            collective: Some(collective),
            bucket_collectives,
        };
        // A session that trained nothing keeps the finished run's figures (bytes, step
        // times, wall time) and only brings the new evaluation.
        let summary = match (&self.out, n_session) {
            (Some(out), 0) => match std::fs::read(out.root.join("summary.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<Summary>(&b).ok())
            {
                Some(old) => Summary {
                    final_eval: summary.final_eval.or(old.final_eval),
                    steps_this_session: 0,
                    resumed_from: session_start,
                    ..old
                },
                None => summary,
            },
            _ => summary,
        };
        if self.rank == 0 {
            if let Some(out) = &self.out {
                let p = out.root.join("summary.json");
                let text = serde_json::to_string_pretty(&summary).unwrap_or_default();
                checkpoint::write_atomic(&p, text.as_bytes())?;
            }
        }
        Ok(summary)
    }

    fn train_step(
        &mut self,
        epoch: u64,
        j: usize,
        global_batch: usize,
        epochs: f64,
    ) -> Result<StepOutcome, TrainError> {
        let step = self.step;
        let t0 = Instant::now();
        let device = self.model.device().clone();
        let batch = self.data.train_batch(epoch, j, &device);
        let t1 = Instant::now();
        // Dropout masks: a pure function of (seed, step, rank).
        {
            let _g = BUILD.lock().unwrap_or_else(|e| e.into_inner());
            device.seed(mix(self.plan.config.seed, step, self.rank as u64));
        }
        let out = self
            .model
            .forward_loss(batch)
            .map_err(|source| TrainError::Model { step, source })?;
        let t2 = Instant::now();
        let m: Metrics = out.metrics;
        self.model.backward_into(out.loss, &mut self.grads);
        let t3 = Instant::now();
        // A dense exchange checks the average it makes, and a non-finite value on any rank
        // stays non-finite in it (`Exchanger::is_dense`), so scanning here too would be a
        // second pass over the gradient for the same answer (~2 % of the MLP's step). A
        // compressor may drop a NaN, and the parameter server aggregates elsewhere: scan.
        // (A vectorised scan: `iter().any(!is_finite)` is a scalar loop that cost ~0.15 ms
        // per scan on the 535 k-parameter MLP, 5 % of its step.)
        let bad_grad = (self.ps.is_some() || !self.exchanger.is_dense())
            && first_non_finite(&self.grads).is_some();
        let bad_loss = !m.loss.is_finite();
        // Asynchronous parameter server: no lock-step control all-reduce; the record holds
        // this worker's own loss and accuracy.
        let async_ps = self.ps.as_ref().is_some_and(|p| p.staleness() > 0);
        let per_rank = self.world > 1 && !async_ps;
        let t_sync = Instant::now();
        let local_s = (t_sync - self.left_exchange.unwrap_or(t0)).as_secs_f64();
        let ctl = &mut self.ctl;
        ctl.clear();
        ctl.extend([
            if bad_loss {
                0.0
            } else {
                (m.loss * m.count as f64) as f32
            },
            m.count as f32,
            m.correct as f32,
            bad_loss as u8 as f32,
            bad_grad as u8 as f32,
        ]);
        if per_rank {
            // Each rank fills its own slot; the sum delivers every rank's time to all.
            ctl.resize(CTL_LEN + self.world, 0.0);
            ctl[CTL_LEN + self.rank] = local_s as f32;
        }
        if !async_ps {
            self.comm
                .all_reduce_sum(ctl)
                .map_err(|source| TrainError::Comm { step, source })?;
        }
        let t4 = Instant::now();
        // Until the exchange (or the PS round) ends the step, this was the last collective.
        self.left_exchange = Some(t4);
        let ctl = &self.ctl;
        let (slowest_rank, behind_slowest_s) = if per_rank {
            // The first of equal maxima: every rank picks the same one.
            let (r, max) = ctl[CTL_LEN..]
                .iter()
                .enumerate()
                .fold((0, f32::MIN), |a, (r, &v)| if v > a.1 { (r, v) } else { a });
            (Some(r), Some((max as f64 - local_s).max(0.0)))
        } else {
            (None, None)
        };
        let ctl: [f32; CTL_LEN] = ctl[..CTL_LEN].try_into().expect("control values");
        let count = ctl[1].max(1.0) as f64;
        let loss = if ctl[3] > 0.0 {
            f64::NAN
        } else {
            ctl[0] as f64 / count
        };
        let accuracy = ctl[2] as f64 / count;
        let spike = match (self.plan.config.failure.spike_ratio, self.best_loss) {
            (Some(r), Some(best))
                if self.plan.config.failure.non_finite == NonFinitePolicy::Recover =>
            {
                loss > r * best
            }
            _ => false,
        };
        let mut time = Phases {
            data_s: (t1 - t0).as_secs_f64(),
            forward_s: (t2 - t1).as_secs_f64(),
            backward_s: (t3 - t2).as_secs_f64(),
            communicate_s: (t4 - t3).as_secs_f64(),
            sync_s: (t4 - t_sync).as_secs_f64(),
            ..Phases::default()
        };
        let lr = self.plan.lr.at(
            step as f64 / self.plan.steps_per_epoch as f64,
            epochs,
            global_batch,
        );
        let mut record = StepRecord {
            step,
            epoch,
            loss,
            accuracy,
            lr,
            ratio_name: None,
            ratio: None,
            bytes_sent: 0,
            bytes_received: 0,
            payload_bytes: 0,
            skipped: false,
            samples: ctl[1] as u64,
            time,
            lossy_dropped: None,
            retransmitted: None,
            server_s: None,
            slowest_rank,
            behind_slowest_s,
        };
        if async_ps && (ctl[3] > 0.0 || ctl[4] > 0.0) {
            // The servers' step clock needs this step's push from every worker: push zeros.
            self.grads.fill(0.0);
            self.skipped += 1;
            record.skipped = true;
        } else if ctl[3] > 0.0 || ctl[4] > 0.0 || spike {
            let what = if ctl[3] > 0.0 || spike {
                "loss"
            } else {
                "gradient"
            };
            return self.bad_step(what, record, t0);
        }
        self.consecutive_bad = 0;
        if loss.is_finite() {
            self.best_loss = Some(self.best_loss.map_or(loss, |b| b.min(loss)));
        }
        if let Some(ps) = self.ps.as_mut() {
            let model = &self.model;
            let (ready, pst) = ps
                .step(step, |p| model.read_params(p), &self.grads)
                .map_err(|source| TrainError::Comm { step, source })?;
            self.left_exchange = Some(Instant::now());
            record.server_s = Some(pst.server_s);
            time.compress_s = pst.encode_s;
            time.communicate_s += pst.communicate_s;
            time.wait_s = pst.communicate_s;
            time.decompress_s = pst.decode_s;
            let t5 = Instant::now();
            for r in ready {
                self.apply_aggregate(r);
            }
            time.optimizer_s = t5.elapsed().as_secs_f64();
            time.step_s = t0.elapsed().as_secs_f64();
            record.bytes_sent = pst.bytes_sent;
            record.bytes_received = pst.bytes_received;
            record.payload_bytes = pst.payload_bytes;
            record.time = time;
            return Ok(StepOutcome::Done(Box::new(record)));
        }
        let st = self
            .exchanger
            .exchange(&mut self.comm, &mut self.grads, step)
            .map_err(|source| TrainError::Exchange { step, source })?;
        self.left_exchange = Some(Instant::now());
        time.compress_s = st.compress_s;
        time.communicate_s += st.communicate_s;
        time.decompress_s = st.decompress_s;
        time.wait_s = st.wait_s;
        if let Some((name, v)) = self.exchanger.ratio_metric() {
            record.ratio_name = Some(name.to_string());
            record.ratio = Some(v);
        }
        let bad_average = st
            .non_finite
            .unwrap_or_else(|| first_non_finite(&self.grads).is_some());
        if bad_average {
            // Identical on every rank (the averaged gradient is), so every rank decides alike.
            record.time = time;
            return self.bad_step("gradient", record, t0);
        }
        let t5 = Instant::now();
        if let Some(c) = self.plan.clip_norm {
            // The averaged gradient is identical on every rank, so is its clipping.
            clip_to_norm(&mut self.grads, c);
        }
        // The update is written straight into each parameter tensor's storage: no flat
        // parameter buffer, no copy back into the module.
        self.optimizer.begin(0, self.num_params());
        let (optimizer, grads) = (&mut self.optimizer, &self.grads);
        self.model.update_params(&mut |offset, p| {
            optimizer.apply(0, offset, p, &grads[offset..offset + p.len()], lr as f32)
        });
        time.optimizer_s = t5.elapsed().as_secs_f64();
        time.step_s = t0.elapsed().as_secs_f64();
        record.bytes_sent = st.bytes_sent;
        record.bytes_received = st.bytes_received;
        record.payload_bytes = st.payload_bytes;
        if self.plan.dlcp.is_some() {
            record.lossy_dropped = Some(if st.lossy_elems > 0 {
                st.lossy_dropped as f64 / st.lossy_elems as f64
            } else {
                0.0
            });
            record.retransmitted = Some(st.retransmitted);
        }
        record.time = time;
        Ok(StepOutcome::Done(Box::new(record)))
    }

    fn bad_step(
        &mut self,
        what: &'static str,
        mut record: StepRecord,
        t0: Instant,
    ) -> Result<StepOutcome, TrainError> {
        let step = self.step;
        let f = &self.plan.config.failure;
        let ck = self
            .last_checkpoint
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "none".into());
        self.consecutive_bad += 1;
        if self.consecutive_bad > f.max_skips && f.non_finite != NonFinitePolicy::Abort {
            return Err(TrainError::NonFinite {
                step,
                what,
                policy: format!(
                    "{} consecutive bad steps exceed failure.max_skips",
                    self.consecutive_bad
                ),
                checkpoint: ck,
            });
        }
        match f.non_finite {
            NonFinitePolicy::Abort => Err(TrainError::NonFinite {
                step,
                what,
                policy: "failure.non_finite = \"abort\"".into(),
                checkpoint: ck,
            }),
            NonFinitePolicy::Skip => {
                self.skipped += 1;
                record.skipped = true;
                record.time.step_s = t0.elapsed().as_secs_f64();
                Ok(StepOutcome::Done(Box::new(record)))
            }
            NonFinitePolicy::Recover => {
                if self.recoveries >= f.max_recoveries {
                    return Err(TrainError::NonFinite {
                        step,
                        what,
                        policy: format!(
                            "{} rollbacks reached failure.max_recoveries",
                            self.recoveries
                        ),
                        checkpoint: ck,
                    });
                }
                let Some(dir) = self.last_checkpoint.clone() else {
                    return Err(TrainError::NonFinite {
                        step,
                        what,
                        policy: "recover found no checkpoint to roll back to".into(),
                        checkpoint: ck,
                    });
                };
                let recoveries = self.recoveries + 1;
                let bad = self.consecutive_bad;
                let factor = f.theta_factor;
                let scale = self.exchanger.theta_scale() * factor;
                self.resume_from(&dir)?;
                self.recoveries = recoveries;
                self.consecutive_bad = bad;
                // The checkpoint restored the old scale; lower θ below it.
                let restored = self.exchanger.theta_scale();
                if restored > 0.0 {
                    self.exchanger.scale_theta(scale / restored);
                }
                Ok(StepOutcome::RolledBack)
            }
        }
    }

    /// Evaluates on this rank's part of the test set, with BatchNorm running statistics
    /// averaged over the workers first; the result is the global one on every rank.
    pub fn evaluate(&mut self, epochs_done: u64) -> Result<EvalRecord, TrainError> {
        self.ps_sync()?;
        let step = self.step;
        if !self.buffers.is_empty() {
            self.model.read_buffers(&mut self.buffers);
            self.comm
                .all_reduce_sum(&mut self.buffers)
                .map_err(|source| TrainError::Comm { step, source })?;
            let inv = 1.0 / self.world as f32;
            for b in self.buffers.iter_mut() {
                *b *= inv;
            }
            self.model.write_buffers(&self.buffers);
        }
        let device = self.model.device().clone();
        let mut m = Metrics::default();
        self.model.reset_eval_state();
        for j in 0..self.data.eval_batches() {
            let b = self.data.eval_batch(j, &device);
            let r = self
                .model
                .evaluate(b)
                .map_err(|source| TrainError::Model { step, source })?;
            m.merge(&r);
        }
        let mut v = [
            (m.loss * m.count as f64) as f32,
            m.correct as f32,
            m.count as f32,
        ];
        self.comm
            .all_reduce_sum(&mut v)
            .map_err(|source| TrainError::Comm { step, source })?;
        let count = v[2].max(1.0) as f64;
        let loss = v[0] as f64 / count;
        Ok(EvalRecord {
            epoch: epochs_done,
            step,
            loss,
            accuracy: v[1] as f64 / count,
            perplexity: loss.exp(),
            count: v[2] as u64,
        })
    }
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

enum StepOutcome {
    Done(Box<StepRecord>),
    RolledBack,
}

/// Scales `g` to L2 norm at most `max` (`train.clip_norm`; the norm is accumulated in f64
/// in index order, so every rank computes the same factor).
fn clip_to_norm(g: &mut [f32], max: f32) {
    let norm = g
        .iter()
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt();
    if norm > max as f64 {
        let scale = (max as f64 / norm) as f32;
        g.iter_mut().for_each(|x| *x *= scale);
    }
}
