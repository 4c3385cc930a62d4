//! The run configuration: a TOML file (ARCHITECTURE.md §6), read in two stages.
//!
//! 1. **Raw**: [`RunConfig`] is what serde reads, with `deny_unknown_fields` on every table,
//!    after `--set key=value` overrides were applied to the TOML tree. Parse errors name the
//!    file, line and key (toml's own messages).
//! 2. **Validated**: [`RunConfig::validate`] checks every range and every combination
//!    (ScaleCom with the parameter server, DGC with Adam, a per-worker batch too large for the
//!    shard, …) and returns a [`Plan`]: the objects the trainer builds, with the derived
//!    values filled in (DGC / FFT `steps_per_epoch`, ScaleCom `workers`, the memory a method
//!    gets by default, DGC's momentum moved from the optimizer into the memory). Nothing is
//!    started and nothing is written before this succeeds.
//!
//! ```toml
//! name = "alexnet_fft"
//! seed = 42
//! [model]
//! kind = "alexnet"
//! variant = "cifar"
//! [data]
//! kind = "cifar-like"
//! batch_size = 32          # per worker
//! [train]
//! epochs = 1
//! optimizer = "sgd"
//! lr = 0.01
//! momentum = 0.9
//! lr_schedule = "cosine"
//! [cluster]
//! workers = 2
//! transport = "tcp"
//! [compress]
//! kind = "fft"
//! theta = 0.9
//! error_feedback = false   # trainer key: memory = none (true: residual EF)
//! bucket_mb = 25           # trainer key
//! ```
//!
//! The `[compress]` table holds the method's own keys (see `dtrain list`) plus the trainer's
//! keys `error_feedback`, `memory` (a full memory table, e.g. `{ kind = "residual", beta =
//! 0.9 }`), `bucket_mb`, `dense_below`, `dense_1d` and `collective` (`"allgather"`, the
//! default, or `"sparse-allreduce"` for methods whose payloads are gathered — see
//! [`crate::exchange`]).

use std::path::{Path, PathBuf};

use dtrain_compress::{Collective, CompressorConfig, MemoryConfig, RunFacts, RunUse};

use crate::exchange::GatherCollective;
use dtrain_models::ModelSpec;
use serde::{Deserialize, Serialize};

use crate::device::DeviceKind;
use crate::exchange::bucket::BucketPolicy;
use crate::lr::{Decay, LrSchedule};
use crate::optim::{OptimizerConfig, OptimizerKind};

/// A configuration error: the file, the field (dotted path) and what is wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{file}: {field}: {message}")]
pub struct ConfigError {
    /// The configuration file (or `<string>`).
    pub file: String,
    /// Dotted path of the field, e.g. `train.lr` (`-` when the whole file is unreadable).
    pub field: String,
    /// What is wrong.
    pub message: String,
}

/// The whole run, as written in the TOML file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Run name; the output goes to `<output.dir>/<name>/<timestamp>/`.
    pub name: String,
    /// Seed of everything random (model init, shuffles, augmentation, stochastic
    /// compressors). Default 0.
    #[serde(default)]
    pub seed: u64,
    /// The model (a `dtrain-models` registry entry: `kind`, `variant`, family options).
    pub model: ModelSpec,
    /// The dataset.
    pub data: DataConfig,
    /// Optimisation.
    pub train: TrainConfig,
    /// Workers and transport.
    #[serde(default)]
    pub cluster: ClusterConfig,
    /// Optional link emulation (every worker's egress).
    #[serde(default)]
    pub network: NetworkConfig,
    /// Compression (a method's table plus the trainer's keys; default `none`).
    #[serde(default = "default_compress")]
    pub compress: toml::Table,
    /// Checkpointing.
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// What to do with non-finite losses or gradients.
    #[serde(default)]
    pub failure: FailureConfig,
    /// Where outputs go.
    #[serde(default)]
    pub output: OutputConfig,
}

fn default_compress() -> toml::Table {
    let mut t = toml::Table::new();
    t.insert(
        "kind".into(),
        toml::Value::String(dtrain_compress::BASELINE.into()),
    );
    t
}

/// Which dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DataKind {
    /// MNIST IDX (`dtrain data fetch mnist`), `1×28×28`, 10 classes.
    Mnist,
    /// Fashion-MNIST IDX (`dtrain data fetch fashion-mnist`), `1×28×28`, 10 classes.
    FashionMnist,
    /// CIFAR-10 binary (`dtrain data fetch cifar10 --from cifar-10-binary.tar.gz`).
    Cifar10,
    /// Fashion-MNIST padded to `3×32×32` (a CIFAR-shaped stand-in that a fresh machine can
    /// fetch; it is not CIFAR-10).
    CifarLike,
    /// Seeded random images of `shape` with `classes` labels (benchmarks and tests).
    Synthetic,
    /// Moby Dick, character level (`dtrain data fetch moby-dick`).
    MobyDick,
    /// State of the Union addresses, word level (`dtrain data fetch sotu`).
    Sotu,
}

impl DataKind {
    /// The name used in configuration files.
    pub fn name(self) -> &'static str {
        match self {
            DataKind::Mnist => "mnist",
            DataKind::FashionMnist => "fashion-mnist",
            DataKind::Cifar10 => "cifar10",
            DataKind::CifarLike => "cifar-like",
            DataKind::Synthetic => "synthetic",
            DataKind::MobyDick => "moby-dick",
            DataKind::Sotu => "sotu",
        }
    }

    /// The `dtrain data fetch` name of the files this kind reads, if any.
    pub fn fetch_name(self) -> Option<&'static str> {
        match self {
            DataKind::Mnist => Some("mnist"),
            DataKind::FashionMnist | DataKind::CifarLike => Some("fashion-mnist"),
            DataKind::Cifar10 => Some("cifar10"),
            DataKind::Synthetic => None,
            DataKind::MobyDick => Some("moby-dick"),
            DataKind::Sotu => Some("sotu"),
        }
    }

    /// Whether the items are token streams (language modelling).
    pub fn is_text(self) -> bool {
        matches!(self, DataKind::MobyDick | DataKind::Sotu)
    }
}

/// `[data]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Which dataset.
    pub kind: DataKind,
    /// Directory of the files; default `$DTRAIN_DATA_DIR/<name>` or `data/<name>`.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Examples (images, or BPTT rows) per worker and step.
    pub batch_size: usize,
    /// Examples per evaluation batch (default 256 images / the training rows for text).
    #[serde(default)]
    pub eval_batch_size: Option<usize>,
    /// Use only the first N training examples (short runs). Default all.
    #[serde(default)]
    pub train_limit: Option<usize>,
    /// Evaluate on only the first N test examples. Default all.
    #[serde(default)]
    pub test_limit: Option<usize>,
    /// Random crop + flip (CIFAR-style). Default false.
    #[serde(default)]
    pub augment: bool,
    /// Normalise with the dataset's channel means / standard deviations. Default true.
    #[serde(default = "yes")]
    pub normalize: bool,
    /// Shuffle the training set each epoch. Default true.
    #[serde(default = "yes")]
    pub shuffle: bool,
    /// Synthetic: item shape `[c, h, w]`.
    #[serde(default)]
    pub shape: Option<Vec<usize>>,
    /// Synthetic: number of classes (default 10).
    #[serde(default)]
    pub classes: Option<usize>,
    /// Synthetic: training-set size (default 1024).
    #[serde(default)]
    pub train_len: Option<usize>,
    /// Synthetic: test-set size (default 256).
    #[serde(default)]
    pub test_len: Option<usize>,
    /// Text: BPTT length (default 35).
    #[serde(default)]
    pub seq_len: Option<usize>,
    /// Text: drop tokens seen fewer times (default 1 = keep all).
    #[serde(default)]
    pub min_count: Option<usize>,
    /// Text: fraction of the stream held out for testing (default 0.1).
    #[serde(default)]
    pub test_fraction: Option<f64>,
}

fn yes() -> bool {
    true
}

/// A learning-rate decay given by name (`"cosine"`) or as a full table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DecaySpec {
    /// `constant`, `cosine` (to 0) or `step` (milestones from `lr_milestones`).
    Name(String),
    /// `{ kind = "step", milestones = [..], gamma = 0.1 }` etc.
    Table(Decay),
}

impl Default for DecaySpec {
    fn default() -> Self {
        DecaySpec::Name("constant".into())
    }
}

/// `[train]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Epochs (default 1).
    #[serde(default = "one_u64")]
    pub epochs: u64,
    /// Stop after this many steps in total (short runs). Default: all epochs.
    #[serde(default)]
    pub max_steps: Option<u64>,
    /// `sgd` (default), `adam` or `adamw`.
    #[serde(default)]
    pub optimizer: OptimizerKind,
    /// Base learning rate.
    pub lr: f64,
    /// SGD momentum (default 0). With DGC it moves into the DGC memory.
    #[serde(default)]
    pub momentum: f32,
    /// SGD dampening (default 0).
    #[serde(default)]
    pub dampening: f32,
    /// Nesterov momentum (default false).
    #[serde(default)]
    pub nesterov: bool,
    /// Weight decay (default 0).
    #[serde(default)]
    pub weight_decay: f32,
    /// Adam β₁ (default 0.9).
    #[serde(default)]
    pub beta1: Option<f32>,
    /// Adam β₂ (default 0.999).
    #[serde(default)]
    pub beta2: Option<f32>,
    /// Adam ε (default 1e-8).
    #[serde(default)]
    pub eps: Option<f32>,
    /// Decay: `"constant"` (default), `"cosine"`, `"step"` or a table.
    #[serde(default)]
    pub lr_schedule: DecaySpec,
    /// Milestone epochs for `lr_schedule = "step"`.
    #[serde(default)]
    pub lr_milestones: Vec<f64>,
    /// Factor per milestone for `lr_schedule = "step"` (default 0.1).
    #[serde(default)]
    pub lr_gamma: Option<f64>,
    /// Gradual warm-up length in epochs (default 0).
    #[serde(default)]
    pub warmup_epochs: f64,
    /// Warm-up start factor.
    #[serde(default)]
    pub warmup_start: Option<f64>,
    /// Linear scaling rule reference batch (`lr × global_batch / ref`). Default off.
    #[serde(default)]
    pub scale_batch_ref: Option<usize>,
    /// Evaluate every N epochs (default 1; 0 = only at the end).
    #[serde(default = "one_u64")]
    pub eval_every_epochs: u64,
    /// Gradient clipping by global L2 norm (PyTorch's `clip_grad_norm_`): the averaged
    /// gradient is scaled to norm at most `clip_norm` before the optimizer. Default off.
    /// With DGC's momentum memory this becomes DGC's *local* clipping (ALGORITHMS.md
    /// §10.2): each worker scales its own gradient to norm at most `clip_norm / √workers`
    /// before accumulating it, unless `compress.memory.clip` is set explicitly.
    #[serde(default)]
    pub clip_norm: Option<f32>,
}

fn one_u64() -> u64 {
    1
}

/// Byte transports for the collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// The default: `shm` when every rank is a worker process of one `dtrain run` on this
    /// host (no `--nnodes`, no scheduler) and the shared-memory file system has room for
    /// the rings, else `tcp`. The launcher resolves it before the workers start: the run
    /// directory's `config.toml` names the transport chosen, and the launch log says why
    /// (see [`crate::launch::resolve_transport`]).
    #[default]
    Auto,
    /// TCP with the run token.
    Tcp,
    /// QUIC (quinn) with TLS and pinned run certificate.
    Quic,
    /// Shared memory between processes on one host (Linux `/dev/shm` rings; every rank
    /// must be on the same host). The fastest choice for a standalone run.
    Shm,
    /// MPI point-to-point messages (dtrain's own collectives on top): the ranks are MPI's,
    /// started by `mpirun` (`dtrain run` starts it itself on one node). Needs a `dtrain`
    /// built with the `mpi` feature.
    Mpi,
}

impl std::str::FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(TransportKind::Auto),
            "tcp" => Ok(TransportKind::Tcp),
            "quic" => Ok(TransportKind::Quic),
            "shm" => Ok(TransportKind::Shm),
            "mpi" => Ok(TransportKind::Mpi),
            _ => Err(format!(
                "unknown transport {s:?} (auto, tcp, quic, shm, mpi)"
            )),
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportKind::Auto => "auto",
            TransportKind::Tcp => "tcp",
            TransportKind::Quic => "quic",
            TransportKind::Shm => "shm",
            TransportKind::Mpi => "mpi",
        })
    }
}

/// `[cluster]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Worker processes (default 1).
    #[serde(default = "one_usize")]
    pub workers: usize,
    /// Transport (default `auto`: shared memory for a standalone run on one host, else
    /// tcp).
    #[serde(default)]
    pub transport: TransportKind,
    /// Compute threads per worker (default 1).
    #[serde(default = "one_usize")]
    pub threads: usize,
    /// Where each worker computes: `"cpu"` (default), `"cuda"` (the GPU of the worker's
    /// rank on its node) or `"cuda:N"` (see [`crate::device`]).
    #[serde(default, skip_serializing_if = "is_default")]
    pub device: DeviceKind,
    /// Seconds a collective may stall before the run stops naming the silent rank
    /// (default 120).
    #[serde(default = "default_timeout")]
    pub timeout_s: f64,
    /// How gradients are combined: `"allreduce"` (default: collectives, lock-step) or
    /// `"ps"` (a parameter server co-located with the workers, see [`ClusterConfig::servers`]
    /// and [`ClusterConfig::staleness`]).
    #[serde(default, skip_serializing_if = "is_default")]
    pub mode: ClusterMode,
    /// `mode = "ps"`: how many ranks (the first ones) also serve a shard of the model
    /// (default: every worker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub servers: Option<usize>,
    /// `mode = "ps"`: staleness bound `s` of stale-synchronous parallel — a worker may run
    /// at most `s` steps ahead of the slowest (0 = synchronous, the default; a large value
    /// is asynchronous, as in Project Adam).
    #[serde(default, skip_serializing_if = "is_default")]
    pub staleness: u64,
    /// Seconds of silence after which a connection sends a heartbeat (tcp, quic; default 1).
    #[serde(default = "default_heartbeat")]
    pub heartbeat_s: f64,
    /// Seconds without anything from a peer — no data, no heartbeat — after which it counts
    /// as lost and the run stops naming it (tcp, quic; default 10; at least twice
    /// `heartbeat_s`). Catches frozen or unreachable peers whose connection stays open.
    #[serde(default = "default_peer_timeout")]
    pub peer_timeout_s: f64,
}

fn default_heartbeat() -> f64 {
    1.0
}
fn default_peer_timeout() -> f64 {
    10.0
}

impl ClusterConfig {
    /// The transports' heartbeat interval and peer timeout.
    pub fn liveness(&self) -> Liveness {
        Liveness {
            heartbeat: std::time::Duration::from_secs_f64(self.heartbeat_s),
            peer_timeout: std::time::Duration::from_secs_f64(self.peer_timeout_s),
        }
    }
}

/// How the network transports notice a silent peer (`[cluster] heartbeat_s`,
/// `peer_timeout_s`; built by [`ClusterConfig::liveness`]). Defined here, next to the
/// fields it is made from, so that `config` does not import `launch`; re-exported as
/// `launch::Liveness`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Liveness {
    /// An idle connection sends a heartbeat this often.
    pub heartbeat: std::time::Duration,
    /// A peer silent this long is lost.
    pub peer_timeout: std::time::Duration,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            heartbeat: std::time::Duration::from_secs(1),
            peer_timeout: std::time::Duration::from_secs(10),
        }
    }
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// `[cluster] mode`: how the workers combine gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ClusterMode {
    /// Collectives (all-reduce / all-gather), every worker in lock-step.
    #[default]
    AllReduce,
    /// Parameter server: every worker pushes its gradient shards to the servers and applies
    /// the aggregates it pulls, in step order; with a staleness bound > 0 workers run ahead
    /// of each other by up to that many steps (stale-synchronous parallel).
    Ps,
}

fn one_usize() -> usize {
    1
}
fn default_timeout() -> f64 {
    120.0
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            workers: 1,
            transport: TransportKind::Auto,
            threads: 1,
            device: DeviceKind::Cpu,
            timeout_s: default_timeout(),
            mode: ClusterMode::AllReduce,
            servers: None,
            staleness: 0,
            heartbeat_s: default_heartbeat(),
            peer_timeout_s: default_peer_timeout(),
        }
    }
}

/// `[compress.dlcp]`: DLCP (ALGORITHMS.md §13), the bounded-loss all-reduce of dense
/// gradients selected by `[compress] collective = "dlcp"` (see
/// [`dtrain_comms::dlcp`]). Gradients travel as self-describing prioritized packets; a
/// round completes once every tensor has at least `1 − p_max` of its packets (or all of
/// them), missing packets count as zeros, and with `error_feedback` each worker adds what
/// it lost to its next gradient.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DlcpSettings {
    /// Largest fraction of a tensor's packets a round may complete without, in `[0, 1)`
    /// (default 0.01; 0 = reliable, retransmitting every loss).
    #[serde(default = "dlcp_p_max")]
    pub p_max: f64,
    /// Packet body bytes (default 1400: 350 f32).
    #[serde(default = "dlcp_mtu")]
    pub mtu: usize,
    /// When an owner applies the loss bound, from the start of the round (default "20ms").
    #[serde(default = "dlcp_deadline")]
    pub deadline: String,
    /// How often missing packets are asked for again while the bound is exceeded (default
    /// "10ms").
    #[serde(default = "dlcp_retransmit")]
    pub retransmit: String,
    /// Bytes each worker may send per round before the lowest-priority packets are dropped
    /// (the emulated switch queue; default unlimited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_bytes: Option<usize>,
    /// Priority boost of the input layer over the output layer (default 1; 0 = by gradient
    /// magnitude only).
    #[serde(default = "dlcp_layer_weight")]
    pub layer_weight: f32,
    /// Return this worker's dropped values to its next gradient (default true).
    #[serde(default = "yes")]
    pub error_feedback: bool,
    /// Emulated packet loss: probability that a packet is lost (default 0).
    #[serde(default)]
    pub loss: f64,
    /// Emulated tail latency: probability that a packet straggles (default 0)…
    #[serde(default)]
    pub tail: f64,
    /// …by this much (default "50ms").
    #[serde(default = "dlcp_tail_delay")]
    pub tail_delay: String,
}

fn dlcp_p_max() -> f64 {
    0.01
}
fn dlcp_mtu() -> usize {
    1400
}
fn dlcp_deadline() -> String {
    "20ms".into()
}
fn dlcp_retransmit() -> String {
    "10ms".into()
}
fn dlcp_layer_weight() -> f32 {
    1.0
}
fn dlcp_tail_delay() -> String {
    "50ms".into()
}

impl Default for DlcpSettings {
    fn default() -> Self {
        DlcpSettings {
            p_max: dlcp_p_max(),
            mtu: dlcp_mtu(),
            deadline: dlcp_deadline(),
            retransmit: dlcp_retransmit(),
            budget_bytes: None,
            layer_weight: dlcp_layer_weight(),
            error_feedback: true,
            loss: 0.0,
            tail: 0.0,
            tail_delay: dlcp_tail_delay(),
        }
    }
}

impl DlcpSettings {
    /// The collective's configuration for a model of `num_layers` parameter tensors; the
    /// emulated losses are seeded by `seed`. Errors name the `[compress.dlcp]` field.
    pub fn to_config(
        &self,
        num_layers: usize,
        seed: u64,
    ) -> Result<dtrain_comms::dlcp::DlcpConfig, (String, String)> {
        use dtrain_comms::shaping::parse_duration;
        let dur = |field: &str, v: &str| {
            parse_duration(v).map_err(|e| (format!("compress.dlcp.{field}"), e.to_string()))
        };
        let cfg = dtrain_comms::dlcp::DlcpConfig {
            p_max: self.p_max,
            mtu: self.mtu,
            deadline: dur("deadline", &self.deadline)?,
            retransmit_interval: dur("retransmit", &self.retransmit)?,
            budget_bytes: self.budget_bytes,
            priority: dtrain_comms::dlcp::Priority::LayerMagnitude {
                layer_weight: self.layer_weight,
                num_layers: num_layers.min(u32::MAX as usize) as u32,
            },
            loss: dtrain_comms::dlcp::LossModel {
                drop_prob: self.loss,
                delay_prob: self.tail,
                delay: dur("tail_delay", &self.tail_delay)?,
                seed,
            },
        };
        if !(self.layer_weight.is_finite() && self.layer_weight >= 0.0) {
            return Err((
                "compress.dlcp.layer_weight".into(),
                format!("must be ≥ 0, got {}", self.layer_weight),
            ));
        }
        cfg.validate().map_err(|e| {
            // The collective's field names, as this table spells them.
            let field = match e.field {
                "retransmit_interval" => "retransmit",
                "loss.drop_prob" => "loss",
                "loss.delay_prob" => "tail",
                f => f,
            };
            (format!("compress.dlcp.{field}"), e.reason)
        })?;
        Ok(cfg)
    }
}

/// `[network]`: link emulation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct NetworkConfig {
    /// Egress bandwidth per worker, e.g. `"1Gbit"`.
    #[serde(default)]
    pub bandwidth: Option<String>,
    /// One-way latency per message, e.g. `"100us"`.
    #[serde(default)]
    pub latency: Option<String>,
}

/// `[checkpoint]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Checkpoint every N steps (default off).
    #[serde(default)]
    pub every_steps: Option<u64>,
    /// Checkpoint every N epochs (default 1).
    #[serde(default = "some_one")]
    pub every_epochs: Option<u64>,
    /// Keep the newest N checkpoints (default 2).
    #[serde(default = "two")]
    pub keep: usize,
}

fn some_one() -> Option<u64> {
    Some(1)
}
fn two() -> usize {
    2
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            every_steps: None,
            every_epochs: Some(1),
            keep: 2,
        }
    }
}

/// What to do when the loss or a gradient is not finite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum NonFinitePolicy {
    /// Stop the run with an error (default).
    #[default]
    Abort,
    /// Skip the step (no update) and go on; abort after `max_skips` in a row.
    Skip,
    /// Roll back to the last checkpoint, lower θ (FFT) by `theta_factor`, and go on.
    Recover,
}

/// `[failure]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailureConfig {
    /// Policy for non-finite losses / gradients (default `abort`).
    #[serde(default)]
    pub non_finite: NonFinitePolicy,
    /// Consecutive skipped (or recovered) steps before giving up (default 10).
    #[serde(default = "ten")]
    pub max_skips: u64,
    /// `recover` also triggers when the loss exceeds `spike_ratio ×` its running minimum
    /// (default off).
    #[serde(default)]
    pub spike_ratio: Option<f64>,
    /// `recover`: multiply θ by this after each rollback (default 0.5).
    #[serde(default = "half")]
    pub theta_factor: f64,
    /// `recover`: rollbacks allowed over the whole run before giving up (default 10).
    #[serde(default = "ten")]
    pub max_recoveries: u64,
}

fn ten() -> u64 {
    10
}
fn half() -> f64 {
    0.5
}

impl Default for FailureConfig {
    fn default() -> Self {
        FailureConfig {
            non_finite: NonFinitePolicy::Abort,
            max_skips: 10,
            spike_ratio: None,
            theta_factor: 0.5,
            max_recoveries: 10,
        }
    }
}

/// `[output]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputConfig {
    /// Root of run directories (default `runs`).
    #[serde(default = "runs")]
    pub dir: PathBuf,
    /// Log a metrics line every N steps (default 1 = every step).
    #[serde(default = "one_u64")]
    pub log_every: u64,
}

fn runs() -> PathBuf {
    PathBuf::from("runs")
}

impl Default for OutputConfig {
    fn default() -> Self {
        OutputConfig {
            dir: runs(),
            log_every: 1,
        }
    }
}

/// `[compress]` split into its parts ([`RunConfig::validate`]'s input).
struct CompressSection {
    method: CompressorConfig,
    /// An explicit memory, if any.
    memory: Option<MemoryConfig>,
    policy: BucketPolicy,
    collective: GatherCollective,
    dlcp: Option<DlcpSettings>,
}

/// The trainer's keys inside `[compress]`.
const TRAINER_KEYS: [&str; 7] = [
    "error_feedback",
    "memory",
    "bucket_mb",
    "dense_below",
    "dense_1d",
    "collective",
    "dlcp",
];

/// Everything the trainer builds, validated and with derived values filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The configuration it came from (after overrides).
    pub config: RunConfig,
    /// The compression method, with `steps_per_epoch` / `workers` set.
    pub method: CompressorConfig,
    /// The error-feedback memory.
    pub memory: MemoryConfig,
    /// Bucketing.
    pub buckets: BucketPolicy,
    /// The collective for gathered payloads (`compress.collective`).
    pub collective: GatherCollective,
    /// DLCP bounded-loss all-reduce of the dense gradient (`compress.collective = "dlcp"`,
    /// settings in `[compress.dlcp]`).
    pub dlcp: Option<DlcpSettings>,
    /// The optimizer (momentum on the weight-decay term alone where the memory owns the
    /// gradient's momentum).
    pub optimizer: OptimizerConfig,
    /// The learning-rate schedule.
    pub lr: LrSchedule,
    /// Steps per epoch (every worker runs the same number).
    pub steps_per_epoch: u64,
    /// Total steps of the run.
    pub total_steps: u64,
    /// Training examples per epoch (after `train_limit`), for the data check.
    pub train_examples: usize,
    /// Global-norm clipping of the averaged gradient before the optimizer (`train.clip_norm`;
    /// `None` when off or when DGC's local clipping took it over).
    pub clip_norm: Option<f32>,
}

impl RunConfig {
    /// Reads `path`, applies `overrides` (`key.path=value`, value in TOML syntax or a bare
    /// string) and deserializes. Does not validate ranges (see [`RunConfig::validate`]).
    pub fn load(path: &Path, overrides: &[String]) -> Result<RunConfig, ConfigError> {
        Self::load_variant(path, None, overrides)
    }

    /// [`RunConfig::load`] from a string; `file` names it in errors. A sweep file parses as
    /// its base configuration (the `[[sweep]]` entries are ignored; see
    /// [`RunConfig::parse_variant`]).
    pub fn parse(text: &str, file: &str, overrides: &[String]) -> Result<RunConfig, ConfigError> {
        Self::parse_variant(text, file, None, overrides)
    }

    /// [`RunConfig::load`] for one variant of a sweep file: the `[[sweep]]` entry labelled
    /// `variant` is applied to the base configuration (each of its keys replaces the value at
    /// that dotted path, as `--set` does), its label is appended to `name`
    /// (`<name>-<label>`), then `overrides` are applied.
    pub fn load_variant(
        path: &Path,
        variant: Option<&str>,
        overrides: &[String],
    ) -> Result<RunConfig, ConfigError> {
        let (file, text) = read_config(path)?;
        Self::parse_variant(&text, &file, variant, overrides)
    }

    /// [`RunConfig::load_variant`] from a string.
    pub fn parse_variant(
        text: &str,
        file: &str,
        variant: Option<&str>,
        overrides: &[String],
    ) -> Result<RunConfig, ConfigError> {
        let err = |field: &str, message: String| ConfigError {
            file: file.to_string(),
            field: field.to_string(),
            message,
        };
        let mut tree: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| err("-", one_line(&e.to_string())))?;
        let sweep = split_sweep(&mut tree, file)?;
        if let Some(label) = variant {
            let Some(entry) = sweep.iter().find(|e| e.label == label) else {
                let known: Vec<&str> = sweep.iter().map(|e| e.label.as_str()).collect();
                return Err(err(
                    "sweep",
                    format!("no variant {label:?} (the file has: {})", known.join(", ")),
                ));
            };
            for (key, value) in &entry.sets {
                set_path(&mut tree, key, value.clone())
                    .map_err(|m| err(&format!("sweep.{key}"), m))?;
            }
            if let Some(toml::Value::String(name)) = tree.get_mut("name") {
                *name = format!("{name}-{label}");
            }
        }
        for o in overrides {
            apply_override(&mut tree, o).map_err(|m| err(o.split('=').next().unwrap_or(o), m))?;
        }
        RunConfig::deserialize(toml::Value::Table(tree)).map_err(|e| {
            let msg = one_line(&e.to_string());
            // toml names the key path in its message for value-level errors; point at the
            // section when we can tell it.
            let field = guess_field(&msg);
            err(&field, msg)
        })
    }

    /// The configuration as TOML (written as `config.toml` into the run directory).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# not serializable: {e}\n"))
    }

    /// Checks everything and derives the trainer's objects. `train_examples` is the size of
    /// the training set after `train_limit` (the data is opened by the caller; pass `None`
    /// to skip the checks that need it, e.g. before data are fetched).
    pub fn validate(&self, file: &str, train_examples: Option<usize>) -> Result<Plan, ConfigError> {
        let err = |field: &str, message: String| ConfigError {
            file: file.to_string(),
            field: field.to_string(),
            message,
        };
        if self.name.is_empty()
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            || self.name.starts_with('.')
        {
            return Err(err(
                "name",
                format!(
                    "{:?} must be non-empty and use only letters, digits, '-', '_', '.'",
                    self.name
                ),
            ));
        }
        // Cluster.
        let c = &self.cluster;
        if c.workers == 0 || c.workers > 1024 {
            return Err(err(
                "cluster.workers",
                format!("must be in 1..=1024, got {}", c.workers),
            ));
        }
        if c.threads == 0 {
            return Err(err("cluster.threads", "must be at least 1".into()));
        }
        if matches!(c.device, DeviceKind::Cuda(_)) && !crate::device::CUDA_BUILT {
            return Err(err("cluster.device", crate::device::NO_CUDA.into()));
        }
        if !(c.timeout_s.is_finite() && c.timeout_s > 0.0) {
            return Err(err(
                "cluster.timeout_s",
                format!("must be > 0, got {}", c.timeout_s),
            ));
        }
        if !(c.heartbeat_s.is_finite() && c.heartbeat_s > 0.0) {
            return Err(err(
                "cluster.heartbeat_s",
                format!("must be > 0, got {}", c.heartbeat_s),
            ));
        }
        if !(c.peer_timeout_s.is_finite() && c.peer_timeout_s >= 2.0 * c.heartbeat_s) {
            return Err(err(
                "cluster.peer_timeout_s",
                format!(
                    "must be at least twice heartbeat_s ({} s), got {}",
                    c.heartbeat_s, c.peer_timeout_s
                ),
            ));
        }
        if c.mode == ClusterMode::AllReduce {
            if c.servers.is_some() {
                return Err(err(
                    "cluster.servers",
                    "applies to mode = \"ps\" only".into(),
                ));
            }
            if c.staleness != 0 {
                return Err(err(
                    "cluster.staleness",
                    "applies to mode = \"ps\" only".into(),
                ));
            }
        }
        if let Some(n) = c.servers {
            if n == 0 || n > c.workers {
                return Err(err(
                    "cluster.servers",
                    format!("must be in 1..={} (the workers), got {n}", c.workers),
                ));
            }
        }
        if let Some(b) = &self.network.bandwidth {
            dtrain_comms::shaping::parse_bandwidth(b)
                .map_err(|e| err("network.bandwidth", e.to_string()))?;
        }
        if let Some(l) = &self.network.latency {
            dtrain_comms::shaping::parse_duration(l)
                .map_err(|e| err("network.latency", e.to_string()))?;
        }
        // Data.
        let d = &self.data;
        if d.batch_size == 0 {
            return Err(err("data.batch_size", "must be at least 1".into()));
        }
        if d.eval_batch_size == Some(0) {
            return Err(err("data.eval_batch_size", "must be at least 1".into()));
        }
        for (name, set) in [
            ("shape", d.shape.is_some()),
            ("classes", d.classes.is_some()),
            ("train_len", d.train_len.is_some()),
            ("test_len", d.test_len.is_some()),
        ] {
            if set && d.kind != DataKind::Synthetic {
                return Err(err(
                    &format!("data.{name}"),
                    "applies to kind = \"synthetic\" only".into(),
                ));
            }
        }
        for (name, set) in [
            ("seq_len", d.seq_len.is_some()),
            ("min_count", d.min_count.is_some()),
            ("test_fraction", d.test_fraction.is_some()),
        ] {
            if set && !d.kind.is_text() {
                return Err(err(
                    &format!("data.{name}"),
                    "applies to text datasets (moby-dick, sotu) only".into(),
                ));
            }
        }
        if d.augment && d.kind.is_text() {
            return Err(err("data.augment", "does not apply to text".into()));
        }
        if d.kind == DataKind::Synthetic {
            match &d.shape {
                Some(s) if s.len() == 3 && s.iter().all(|&x| x > 0) => {}
                Some(s) => {
                    return Err(err(
                        "data.shape",
                        format!("must be [channels, height, width], got {s:?}"),
                    ))
                }
                None => return Err(err("data.shape", "is required for synthetic data".into())),
            }
            if d.classes == Some(0) || d.classes.is_some_and(|c| c > u16::MAX as usize) {
                return Err(err("data.classes", "must be in 1..=65535".into()));
            }
        }
        if d.seq_len == Some(0) {
            return Err(err("data.seq_len", "must be at least 1".into()));
        }
        if let Some(f) = d.test_fraction {
            if !(f > 0.0 && f < 1.0) {
                return Err(err(
                    "data.test_fraction",
                    format!("must be in (0, 1), got {f}"),
                ));
            }
        }
        if d.train_limit == Some(0) {
            return Err(err("data.train_limit", "must be at least 1".into()));
        }
        if d.test_limit == Some(0) {
            return Err(err("data.test_limit", "must be at least 1".into()));
        }
        self.check_model_fits_data().map_err(|(f, m)| err(&f, m))?;
        // Steps.
        let t = &self.train;
        if t.epochs == 0 {
            return Err(err("train.epochs", "must be at least 1".into()));
        }
        if t.max_steps == Some(0) {
            return Err(err("train.max_steps", "must be at least 1".into()));
        }
        let steps_per_epoch = match train_examples {
            Some(n) if d.kind.is_text() => {
                // BPTT: rows of n / (workers·batch) tokens, cut in seq_len pieces.
                let rows = c.workers * d.batch_size;
                let row_len = n / rows;
                if row_len < 2 {
                    return Err(err(
                        "data.batch_size",
                        format!(
                            "{n} training tokens cannot fill {rows} BPTT rows \
                             (workers × batch_size) of at least 2 tokens"
                        ),
                    ));
                }
                (row_len - 1).div_ceil(d.seq_len.unwrap_or(35)) as u64
            }
            Some(n) => {
                let per = n / c.workers / d.batch_size;
                if per == 0 {
                    return Err(err(
                        "data.batch_size",
                        format!(
                            "{n} training examples give no full batch of {} per worker \
                             on {} workers",
                            d.batch_size, c.workers
                        ),
                    ));
                }
                per as u64
            }
            None => 1,
        };
        let total_steps = (steps_per_epoch * t.epochs).min(t.max_steps.unwrap_or(u64::MAX));
        // Optimizer and schedule.
        let mut opt = OptimizerConfig {
            kind: t.optimizer,
            momentum: t.momentum,
            dampening: t.dampening,
            nesterov: t.nesterov,
            weight_decay: t.weight_decay,
            ..OptimizerConfig::default()
        };
        if let Some(b) = t.beta1 {
            opt.beta1 = b;
        }
        if let Some(b) = t.beta2 {
            opt.beta2 = b;
        }
        if let Some(e) = t.eps {
            opt.eps = e;
        }
        if t.optimizer == OptimizerKind::Sgd && (t.beta1.is_some() || t.beta2.is_some()) {
            return Err(err("train.beta1", "applies to adam / adamw only".into()));
        }
        opt.validate().map_err(|m| split_field(file, &m))?;
        if let Some(c) = t.clip_norm {
            if !(c.is_finite() && c > 0.0) {
                return Err(err("train.clip_norm", format!("must be > 0, got {c}")));
            }
        }
        let decay = match &t.lr_schedule {
            DecaySpec::Table(d) => {
                if !t.lr_milestones.is_empty() || t.lr_gamma.is_some() {
                    return Err(err(
                        "train.lr_milestones",
                        "give milestones inside the lr_schedule table".into(),
                    ));
                }
                d.clone()
            }
            DecaySpec::Name(n) => match n.as_str() {
                "constant" => Decay::Constant,
                "cosine" => Decay::Cosine { min_factor: 0.0 },
                "step" => {
                    if t.lr_milestones.is_empty() {
                        return Err(err(
                            "train.lr_milestones",
                            "lr_schedule = \"step\" needs lr_milestones = [epochs…]".into(),
                        ));
                    }
                    Decay::Step {
                        milestones: t.lr_milestones.clone(),
                        gamma: t.lr_gamma.unwrap_or(0.1),
                    }
                }
                other => {
                    return Err(err(
                        "train.lr_schedule",
                        format!("unknown schedule {other:?} (constant, cosine, step, or a table)"),
                    ))
                }
            },
        };
        if matches!(decay, Decay::Constant | Decay::Cosine { .. })
            && (!t.lr_milestones.is_empty() || t.lr_gamma.is_some())
        {
            return Err(err(
                "train.lr_milestones",
                "applies to lr_schedule = \"step\" only".into(),
            ));
        }
        let lr = LrSchedule {
            lr: t.lr,
            decay,
            warmup_epochs: t.warmup_epochs,
            warmup_start: t.warmup_start,
            scale_batch_ref: t.scale_batch_ref,
        };
        lr.validate().map_err(|m| split_field(file, &m))?;
        if t.eval_every_epochs > t.epochs {
            return Err(err(
                "train.eval_every_epochs",
                format!(
                    "{} exceeds train.epochs = {}",
                    t.eval_every_epochs, t.epochs
                ),
            ));
        }
        let f = &self.failure;
        if !(f.theta_factor > 0.0 && f.theta_factor <= 1.0) {
            return Err(err(
                "failure.theta_factor",
                format!("must be in (0, 1], got {}", f.theta_factor),
            ));
        }
        if let Some(r) = f.spike_ratio {
            if !(r.is_finite() && r > 1.0) {
                return Err(err("failure.spike_ratio", format!("must be > 1, got {r}")));
            }
            if f.non_finite != NonFinitePolicy::Recover {
                return Err(err(
                    "failure.spike_ratio",
                    "applies to non_finite = \"recover\" only".into(),
                ));
            }
        }
        // Compression.
        let CompressSection {
            mut method,
            memory,
            policy: buckets,
            collective,
            dlcp,
        } = self.compress_section(file)?;
        let memory = match memory {
            Some(m) => m,
            None => method.default_memory(),
        };
        let mut memory = memory;
        method.resolve(&RunFacts {
            workers: c.workers,
            steps_per_epoch,
        });
        if memory.owns_momentum() {
            if t.optimizer != OptimizerKind::Sgd {
                return Err(err(
                    "train.optimizer",
                    "the dgc-momentum memory applies the momentum itself and needs \
                     optimizer = \"sgd\" (ALGORITHMS.md §10)"
                        .into(),
                ));
            }
            if t.dampening != 0.0 {
                return Err(err(
                    "train.dampening",
                    "is not supported with the dgc-momentum memory".into(),
                ));
            }
            // The momentum moves into the memory; the optimizer steps plain SGD.
            if let MemoryConfig::DgcMomentum {
                momentum, nesterov, ..
            } = &mut memory
            {
                if t.momentum > 0.0 {
                    *momentum = t.momentum;
                    *nesterov = t.nesterov;
                }
            }
            // The weight-decay term is the same on every worker and is not sent: it keeps
            // its momentum in the optimizer (as in the DGC authors' optimizer), so that the
            // decay is as strong as in the momentum-SGD baseline. Without decay the
            // optimizer is plain SGD.
            if opt.weight_decay > 0.0 {
                opt.decay_momentum_only = true;
            } else {
                opt.momentum = 0.0;
                opt.nesterov = false;
            }
            // Clipping moves too: DGC clips each worker's gradient before accumulation.
            if let (Some(max_norm), MemoryConfig::DgcMomentum { clip, .. }) =
                (t.clip_norm, &mut memory)
            {
                if *clip != dtrain_compress::dgc::Clip::None {
                    return Err(err(
                        "train.clip_norm",
                        "with the dgc-momentum memory clipping is DGC's local clipping; \
                         set either train.clip_norm or compress.memory.clip, not both"
                            .into(),
                    ));
                }
                *clip = dtrain_compress::dgc::Clip::Norm {
                    max_norm,
                    workers: c.workers as u32,
                };
            }
        }
        memory
            .build()
            .map_err(|e| err(&format!("compress.memory.{}", e.field), e.reason.clone()))?;
        method
            .check(&RunUse {
                collective: match &dlcp {
                    Some(_) => Collective::Dlcp,
                    None => collective.into(),
                },
                parameter_server: c.mode == ClusterMode::Ps,
                memory: &memory,
            })
            .map_err(|e| err(&format!("compress.{}", e.field), e.reason.clone()))?;
        if let Some(d) = &dlcp {
            if c.mode == ClusterMode::Ps {
                return Err(err(
                    "compress.collective",
                    "\"dlcp\" is a collective; mode = \"ps\" pushes to servers".into(),
                ));
            }
            d.to_config(1, self.seed)
                .map_err(|(field, m)| err(&field, m))?;
        }
        if c.mode == ClusterMode::Ps && f.non_finite == NonFinitePolicy::Recover {
            return Err(err(
                "failure.non_finite",
                "\"recover\" rolls every rank back to a checkpoint, which a parameter \
                 server's step clock cannot follow; use \"skip\" or \"abort\" with mode = \"ps\""
                    .into(),
            ));
        }
        Ok(Plan {
            config: self.clone(),
            method,
            memory,
            buckets,
            collective,
            dlcp,
            optimizer: opt,
            lr,
            steps_per_epoch,
            total_steps,
            train_examples: train_examples.unwrap_or(0),
            // Under DGC's momentum memory the clipping happened locally, before accumulation.
            clip_norm: t.clip_norm.filter(|_| !memory.owns_momentum()),
        })
    }

    /// Splits `[compress]` into the method, an explicit memory (if any) and the bucket
    /// policy.
    fn compress_section(&self, file: &str) -> Result<CompressSection, ConfigError> {
        let err = |field: &str, message: String| ConfigError {
            file: file.to_string(),
            field: field.to_string(),
            message,
        };
        let mut table = self.compress.clone();
        let mut extract = |k: &str| table.remove(k);
        let ef = extract("error_feedback");
        let mem = extract("memory");
        let bucket_mb = extract("bucket_mb");
        let dense_below = extract("dense_below");
        let dense_1d = extract("dense_1d");
        let collective = extract("collective");
        let dlcp = extract("dlcp");
        if !table.contains_key("kind") {
            return Err(err(
                "compress.kind",
                "is required (see `dtrain list` for the methods)".into(),
            ));
        }
        let method = CompressorConfig::deserialize(toml::Value::Table(table)).map_err(|e| {
            let m = one_line(&e.to_string());
            let hint = if m.contains("unknown field") {
                format!(
                    " (besides the method's own keys, [compress] takes the trainer keys {})",
                    TRAINER_KEYS.join(", ")
                )
            } else {
                String::new()
            };
            err("compress", format!("{m}{hint}"))
        })?;
        let memory = match (ef, mem) {
            (Some(_), Some(_)) => {
                return Err(err(
                    "compress.error_feedback",
                    "give either error_feedback or memory, not both".into(),
                ))
            }
            (Some(toml::Value::Boolean(true)), None) => Some(match method.default_memory() {
                MemoryConfig::None => MemoryConfig::RESIDUAL,
                m => m,
            }),
            (Some(toml::Value::Boolean(false)), None) => Some(MemoryConfig::None),
            (Some(v), None) => {
                return Err(err(
                    "compress.error_feedback",
                    format!("must be true or false, got {v}"),
                ))
            }
            (None, Some(v)) => Some(
                MemoryConfig::deserialize(v)
                    .map_err(|e| err("compress.memory", one_line(&e.to_string())))?,
            ),
            (None, None) => None,
        };
        let mut policy = BucketPolicy::default();
        if let Some(v) = bucket_mb {
            let mb = v
                .as_float()
                .or_else(|| v.as_integer().map(|i| i as f64))
                .filter(|m| m.is_finite() && *m > 0.0 && *m <= 4096.0)
                .ok_or_else(|| {
                    err(
                        "compress.bucket_mb",
                        format!("must be in (0, 4096], got {v}"),
                    )
                })?;
            policy.bucket_bytes = ((mb * (1u64 << 20) as f64) as usize).max(4);
        }
        if let Some(v) = dense_below {
            policy.dense_below = v.as_integer().filter(|&i| i >= 0).ok_or_else(|| {
                err(
                    "compress.dense_below",
                    format!("must be an integer >= 0, got {v}"),
                )
            })? as usize;
        }
        if let Some(v) = dense_1d {
            policy.dense_1d = v.as_bool().ok_or_else(|| {
                err(
                    "compress.dense_1d",
                    format!("must be true or false, got {v}"),
                )
            })?;
        }
        let is_dlcp = collective.as_ref().and_then(|v| v.as_str()) == Some("dlcp");
        let collective = match collective {
            None => GatherCollective::default(),
            Some(_) if is_dlcp => GatherCollective::default(),
            Some(v) => GatherCollective::deserialize(v).map_err(|e| {
                err(
                    "compress.collective",
                    format!("{} (or \"dlcp\")", one_line(&e.to_string())),
                )
            })?,
        };
        let dlcp = match (is_dlcp, dlcp) {
            (false, None) => None,
            (false, Some(_)) => {
                return Err(err(
                    "compress.dlcp",
                    "applies to collective = \"dlcp\" only".into(),
                ))
            }
            (true, None) => Some(DlcpSettings::default()),
            (true, Some(v)) => Some(
                DlcpSettings::deserialize(v)
                    .map_err(|e| err("compress.dlcp", one_line(&e.to_string())))?,
            ),
        };
        Ok(CompressSection {
            method,
            memory,
            policy,
            collective,
            dlcp,
        })
    }

    /// The model's input must match the data: image shape / classes, or a text kind.
    fn check_model_fits_data(&self) -> Result<(), (String, String)> {
        let text_model = matches!(self.model, ModelSpec::Lstm(_));
        if text_model != self.data.kind.is_text() {
            return Err((
                "data.kind".into(),
                if text_model {
                    format!(
                        "model kind {:?} is a language model but data kind {:?} is images",
                        self.model.kind(),
                        self.data.kind
                    )
                } else {
                    format!(
                        "model kind {:?} classifies images but data kind {:?} is text",
                        self.model.kind(),
                        self.data.kind
                    )
                },
            ));
        }
        Ok(())
    }

    /// The directory the data are read from.
    pub fn data_dir(&self) -> Option<PathBuf> {
        if let Some(p) = &self.data.path {
            return Some(p.clone());
        }
        let name = self.data.kind.fetch_name()?;
        Some(default_data_root().join(name))
    }
}

/// `$DTRAIN_DATA_DIR` or `data`.
pub fn default_data_root() -> PathBuf {
    std::env::var_os("DTRAIN_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("data"))
}

/// Turns a `train.x must …` message into a [`ConfigError`] on field `train.x`.
fn split_field(file: &str, msg: &str) -> ConfigError {
    let (field, rest) = match msg.split_once(' ') {
        Some((f, r)) if f.contains('.') => (f.trim_end_matches(':').to_string(), r.to_string()),
        _ => ("train".to_string(), msg.to_string()),
    };
    ConfigError {
        file: file.to_string(),
        field,
        message: rest,
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Picks the section a serde message is about (`unknown field `x`` inside `[train]` …).
fn guess_field(msg: &str) -> String {
    // "... in `cluster.workers`" names the key exactly.
    if let Some(i) = msg.rfind(" in `") {
        let rest = &msg[i + 5..];
        if let Some(end) = rest.find('`') {
            let key = &rest[..end];
            if let Some(f) = msg.find("unknown field `") {
                let name = &msg[f + 15..];
                if let Some(e) = name.find('`') {
                    return format!("{key}.{}", &name[..e]);
                }
            }
            return key.to_string();
        }
    }
    // toml messages read "... in `train` ..." or carry the key in backticks.
    for sec in [
        "model",
        "data",
        "train",
        "cluster",
        "network",
        "compress",
        "checkpoint",
        "failure",
        "output",
    ] {
        if msg.contains(&format!("`{sec}`")) || msg.contains(&format!("{sec}.")) {
            return sec.to_string();
        }
    }
    if let Some(start) = msg.find('`') {
        if let Some(len) = msg[start + 1..].find('`') {
            return msg[start + 1..start + 1 + len].to_string();
        }
    }
    "-".to_string()
}

/// Applies `a.b.c=value` to the TOML tree (creating tables on the way).
pub fn apply_override(tree: &mut toml::Table, spec: &str) -> Result<(), String> {
    let (key, value) = spec
        .split_once('=')
        .ok_or_else(|| format!("--set {spec:?}: expected key=value"))?;
    let key = key.trim();
    let value = value.trim();
    let parsed: toml::Value = match format!("v = {value}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").unwrap_or(toml::Value::String(value.into())),
        Err(_) => toml::Value::String(value.to_string()),
    };
    set_path(tree, key, parsed).map_err(|m| format!("--set {spec:?}: {m}"))
}

/// Replaces the value at the dotted path `key` (creating tables on the way).
fn set_path(tree: &mut toml::Table, key: &str, value: toml::Value) -> Result<(), String> {
    if key.is_empty() || key.split('.').any(|p| p.is_empty()) {
        return Err(format!("bad key {key:?}"));
    }
    let parts: Vec<&str> = key.split('.').collect();
    let mut cur = tree;
    for p in &parts[..parts.len() - 1] {
        let entry = cur
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry
            .as_table_mut()
            .ok_or_else(|| format!("`{p}` is not a table"))?;
    }
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

/// The file's name (for errors) and text.
fn read_config(path: &Path) -> Result<(String, String), ConfigError> {
    let file = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => Ok((file, text)),
        Err(e) => Err(ConfigError {
            file,
            field: "-".into(),
            message: format!("cannot read: {e}"),
        }),
    }
}

/// One `[[sweep]]` entry of a configuration file: a labelled set of replacements.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepEntry {
    /// The variant's label (`label = "..."`): letters, digits, `-`, `_`, `.`; unique.
    pub label: String,
    /// `(dotted key, value)` pairs, applied in key order; each replaces the whole value at
    /// its path (`compress = { kind = "none" }` replaces the `[compress]` table).
    pub sets: Vec<(String, toml::Value)>,
}

/// The `[[sweep]]` entries of a configuration file (empty when it is not a sweep).
///
/// A sweep file is a base configuration plus entries such as
///
/// ```toml
/// [[sweep]]
/// label = "none"
/// compress = { kind = "none" }
///
/// [[sweep]]
/// label = "fft-100mbit"
/// "network.bandwidth" = "100Mbit"
/// ```
///
/// `dtrain run` runs every variant (or those named with `--variant`) one after the other,
/// each as its own run `<name>-<label>`, and reports them together.
pub fn sweep_entries(path: &Path) -> Result<Vec<SweepEntry>, ConfigError> {
    let (file, text) = read_config(path)?;
    let mut tree: toml::Table = text.parse().map_err(|e: toml::de::Error| ConfigError {
        file: file.clone(),
        field: "-".into(),
        message: one_line(&e.to_string()),
    })?;
    split_sweep(&mut tree, &file)
}

/// Removes `sweep` from `tree` and checks its entries.
fn split_sweep(tree: &mut toml::Table, file: &str) -> Result<Vec<SweepEntry>, ConfigError> {
    let err = |field: String, message: String| ConfigError {
        file: file.to_string(),
        field,
        message,
    };
    let Some(v) = tree.remove("sweep") else {
        return Ok(Vec::new());
    };
    let toml::Value::Array(items) = v else {
        return Err(err(
            "sweep".into(),
            "must be an array of tables ([[sweep]])".into(),
        ));
    };
    let mut out: Vec<SweepEntry> = Vec::new();
    for (i, item) in items.into_iter().enumerate() {
        let toml::Value::Table(mut t) = item else {
            return Err(err(format!("sweep[{i}]"), "must be a table".into()));
        };
        let label = match t.remove("label") {
            Some(toml::Value::String(l))
                if !l.is_empty()
                    && !l.starts_with('.')
                    && l.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) =>
            {
                l
            }
            Some(other) => {
                return Err(err(
                    format!("sweep[{i}].label"),
                    format!("{other} must be a non-empty string of letters, digits, '-', '_', '.'"),
                ))
            }
            None => return Err(err(format!("sweep[{i}].label"), "is required".into())),
        };
        if out.iter().any(|e| e.label == label) {
            return Err(err(
                format!("sweep[{i}].label"),
                format!("{label:?} is used twice"),
            ));
        }
        if t.is_empty() {
            return Err(err(
                format!("sweep[{i}]"),
                format!("variant {label:?} changes nothing"),
            ));
        }
        // `compress = { kind = "none" }` is one replacement of the whole table; a quoted
        // dotted key (`"network.bandwidth" = "1Gbit"`) addresses a nested value.
        let sets = t.into_iter().collect();
        out.push(SweepEntry { label, sets });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "t"
seed = 3
[model]
kind = "mlp"
[data]
kind = "synthetic"
shape = [1, 4, 4]
batch_size = 8
[train]
lr = 0.1
momentum = 0.9
[cluster]
workers = 2
[compress]
kind = "topk"
ratio = 0.1
bucket_mb = 1
"#;

    fn parse(text: &str, sets: &[&str]) -> Result<Plan, ConfigError> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        RunConfig::parse(text, "t.toml", &sets)?.validate("t.toml", Some(1000))
    }

    #[test]
    fn a_good_config_validates_with_derived_values() {
        let p = parse(GOOD, &[]).unwrap();
        assert_eq!(p.steps_per_epoch, 1000 / 2 / 8);
        assert_eq!(p.total_steps, 62);
        assert_eq!(p.memory, MemoryConfig::RESIDUAL);
        assert_eq!(p.buckets.bucket_bytes, 1 << 20);
        assert_eq!(p.optimizer.momentum, 0.9);
    }

    #[test]
    fn overrides_apply_before_validation() {
        let p = parse(
            GOOD,
            &["train.lr=0.5", "cluster.workers=4", "train.max_steps=3"],
        )
        .unwrap();
        assert_eq!(p.lr.lr, 0.5);
        assert_eq!(p.config.cluster.workers, 4);
        assert_eq!(p.total_steps, 3);
        let p = parse(GOOD, &["compress.kind=none", "compress.ratio=0.1"]);
        assert!(p.is_err(), "none has no ratio");
        let p = parse(GOOD, &["name=other"]).unwrap();
        assert_eq!(p.config.name, "other");
    }

    #[test]
    fn the_transport_defaults_to_auto_and_every_kind_round_trips() {
        let p = parse(GOOD, &[]).unwrap();
        assert_eq!(p.config.cluster.transport, TransportKind::Auto);
        for k in ["auto", "tcp", "quic", "shm", "mpi"] {
            let p = parse(GOOD, &[&format!("cluster.transport=\"{k}\"")]).unwrap();
            assert_eq!(p.config.cluster.transport.to_string(), k);
            assert_eq!(
                k.parse::<TransportKind>().unwrap(),
                p.config.cluster.transport
            );
            // What the run directory's config.toml holds reads back the same.
            let again = RunConfig::parse(&p.config.to_toml(), "c.toml", &[]).unwrap();
            assert_eq!(again.cluster.transport, p.config.cluster.transport);
        }
        let e = parse(GOOD, &["cluster.transport=\"udp\""]).unwrap_err();
        assert!(e.to_string().contains("transport"), "{e}");
    }

    #[test]
    fn errors_name_the_field() {
        let cases: &[(&[&str], &str)] = &[
            (&["train.lrr=0.1"], "train.lrr"),
            (&["train.lr=-1"], "train.lr"),
            (&["cluster.workers=0"], "cluster.workers"),
            (&["cluster.heartbeat_s=0"], "cluster.heartbeat_s"),
            (&["cluster.peer_timeout_s=1.5"], "cluster.peer_timeout_s"),
            (&["data.batch_size=1000"], "data.batch_size"),
            (&["compress.ratio=2.0"], "compress.ratio"),
            (&["compress.error_feedback=3"], "compress.error_feedback"),
            (&["data.seq_len=5"], "data.seq_len"),
            (&["train.lr_schedule=\"wavy\""], "train.lr_schedule"),
            (&["network.bandwidth=\"fast\""], "network.bandwidth"),
            (&["train.optimizer=\"adam\""], "train.momentum"),
            (&["cluster.device=\"tpu\""], "cluster.device"),
        ];
        for (sets, field) in cases {
            let e = parse(GOOD, sets).unwrap_err();
            assert_eq!(e.file, "t.toml");
            assert!(e.field.starts_with(field), "{sets:?}: {e}");
        }
        // A GPU in a build without the `cuda` feature is refused at validation.
        let cuda = parse(GOOD, &["cluster.device=\"cuda:1\""]);
        if crate::device::CUDA_BUILT {
            assert_eq!(
                cuda.unwrap().config.cluster.device,
                DeviceKind::Cuda(Some(1))
            );
        } else {
            let e = cuda.unwrap_err();
            assert_eq!(e.field, "cluster.device");
            assert!(e.message.contains("--features cuda"), "{e}");
        }
        let e = parse("name = \"x\"\n[model]\nkind = \"mlp\"\n", &[]).unwrap_err();
        assert!(e.message.contains("data"), "{e}");
        let e = parse("name = 1", &[]).unwrap_err();
        assert!(e.to_string().starts_with("t.toml: "), "{e}");
    }

    #[test]
    fn sweep_variants_replace_values_and_extend_the_name() {
        let text = format!(
            "{GOOD}\n[[sweep]]\nlabel = \"a\"\ncompress = {{ kind = \"topk\", ratio = 0.1 }}\n\
             [[sweep]]\nlabel = \"b\"\n\"cluster.workers\" = 3\n"
        );
        // The base ignores the sweep.
        let base = RunConfig::parse(&text, "t.toml", &[]).unwrap();
        assert_eq!(base.name, "t");
        let a = RunConfig::parse_variant(&text, "t.toml", Some("a"), &[]).unwrap();
        assert_eq!(a.name, "t-a");
        assert_eq!(
            a.compress.get("kind").and_then(|v| v.as_str()),
            Some("topk")
        );
        // The inline table replaced [compress] whole.
        assert_eq!(a.compress.len(), 2, "{:?}", a.compress);
        let b = RunConfig::parse_variant(&text, "t.toml", Some("b"), &["cluster.workers=5".into()])
            .unwrap();
        // --set applies after the variant.
        assert_eq!((b.name.as_str(), b.cluster.workers), ("t-b", 5));
        let b = RunConfig::parse_variant(&text, "t.toml", Some("b"), &[]).unwrap();
        assert_eq!(b.cluster.workers, 3);
        assert_eq!(b.compress, base.compress);
        let e = RunConfig::parse_variant(&text, "t.toml", Some("c"), &[]).unwrap_err();
        assert_eq!(e.field, "sweep");
        assert!(e.message.contains("a, b"), "{e}");
        // Resolved configs carry no sweep: they round-trip as plain configs.
        let again = RunConfig::parse(&a.to_toml(), "config.toml", &[]).unwrap();
        assert_eq!(again, a);
    }

    #[test]
    fn bad_sweeps_name_the_entry() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            (
                "[[sweep]]\ncompress = { kind = \"none\" }\n",
                "sweep[0].label",
            ),
            ("[[sweep]]\nlabel = \"x y\"\nseed = 1\n", "sweep[0].label"),
            (
                "[[sweep]]\nlabel = \"x\"\nseed = 1\n[[sweep]]\nlabel = \"x\"\nseed = 2\n",
                "sweep[1].label",
            ),
            ("[[sweep]]\nlabel = \"x\"\n", "sweep[0]"),
            ("sweep = 3\n", "sweep"),
        ];
        for (extra, field) in cases {
            let p = dir.path().join("s.toml");
            // `sweep = 3` must precede the tables to stay a top-level key.
            let text = if extra.starts_with("sweep =") {
                format!("{extra}{GOOD}")
            } else {
                format!("{GOOD}\n{extra}")
            };
            std::fs::write(&p, text).unwrap();
            let e = sweep_entries(&p).unwrap_err();
            assert_eq!(e.field, field, "{extra:?}: {e}");
        }
        let p = dir.path().join("plain.toml");
        std::fs::write(&p, GOOD).unwrap();
        assert!(sweep_entries(&p).unwrap().is_empty());
    }

    #[test]
    fn sparse_allreduce_is_for_gathered_payloads_only() {
        let p = parse(
            GOOD,
            &[
                "compress.kind=\"topk\"",
                "compress.collective=\"sparse-allreduce\"",
            ],
        )
        .unwrap();
        assert_eq!(p.collective, GatherCollective::SparseAllReduce);
        let p = parse(GOOD, &["compress.kind=\"topk\""]).unwrap();
        assert_eq!(p.collective, GatherCollective::AllGather);
        let e = parse(
            GOOD,
            &["compress={ kind = \"fp16\", collective = \"sparse-allreduce\" }"],
        )
        .unwrap_err();
        assert_eq!(e.field, "compress.collective", "{e}");
        let e = parse(GOOD, &["compress.collective=\"ring\""]).unwrap_err();
        assert_eq!(e.field, "compress.collective", "{e}");
    }

    #[test]
    fn dgc_moves_momentum_into_the_memory_and_rejects_adam() {
        let p = parse(GOOD, &["compress.kind=dgc", "compress.ratio=0.01"]).unwrap();
        assert!(p.memory.owns_momentum());
        assert_eq!(p.optimizer.momentum, 0.0);
        let CompressorConfig::Dgc(d) = &p.method else {
            panic!()
        };
        assert_eq!(d.steps_per_epoch, p.steps_per_epoch);
        let e = parse(
            GOOD,
            &[
                "compress.kind=dgc",
                "compress.ratio=0.01",
                "train.optimizer=adam",
                "train.momentum=0",
            ],
        )
        .unwrap_err();
        assert_eq!(e.field, "train.optimizer");
    }

    #[test]
    fn clip_norm_clips_the_average_or_becomes_dgcs_local_clipping() {
        use dtrain_compress::dgc::Clip;
        for bad in ["0", "-1", "nan"] {
            let e = parse(GOOD, &[&format!("train.clip_norm={bad}")]).unwrap_err();
            assert_eq!(e.field, "train.clip_norm", "{e}");
        }
        let p = parse(GOOD, &["train.clip_norm=5"]).unwrap();
        assert_eq!(p.clip_norm, Some(5.0));
        assert!(parse(GOOD, &[]).unwrap().clip_norm.is_none());
        // DGC: local clipping at clip_norm/√N inside the memory, not a second clip after.
        let p = parse(
            GOOD,
            &[
                "compress.kind=dgc",
                "train.clip_norm=5",
                "cluster.workers=4",
            ],
        )
        .unwrap();
        assert_eq!(p.clip_norm, None);
        let MemoryConfig::DgcMomentum { clip, .. } = p.memory else {
            panic!("{:?}", p.memory)
        };
        assert_eq!(
            clip,
            Clip::Norm {
                max_norm: 5.0,
                workers: 4
            }
        );
        // Both an explicit memory clip and clip_norm: ambiguous, refused.
        let mem = "compress.memory={kind=\"dgc-momentum\", clip={kind=\"value\", max=0.5}}";
        let e = parse(GOOD, &["compress.kind=dgc", "train.clip_norm=5", mem]).unwrap_err();
        assert_eq!(e.field, "train.clip_norm", "{e}");
        let p = parse(GOOD, &["compress.kind=dgc", mem]).unwrap();
        let MemoryConfig::DgcMomentum { clip, .. } = p.memory else {
            panic!()
        };
        assert_eq!(clip, Clip::Value { max: 0.5 });
    }

    #[test]
    fn scalecom_gets_the_worker_count_and_memory_keys_are_checked() {
        let p = parse(GOOD, &["compress.kind=scalecom", "cluster.workers=3"]).unwrap();
        let CompressorConfig::ScaleCom(s) = &p.method else {
            panic!()
        };
        assert_eq!(s.workers, 3);
        let e = parse(
            GOOD,
            &[
                "compress.memory.kind=residual",
                "compress.error_feedback=true",
            ],
        )
        .unwrap_err();
        assert_eq!(e.field, "compress.error_feedback");
        let p = parse(GOOD, &["compress.error_feedback=false"]).unwrap();
        assert_eq!(p.memory, MemoryConfig::None);
    }

    #[test]
    fn model_and_data_must_agree() {
        let e = parse(GOOD, &["data.kind=moby-dick", "data.shape=[]"]).unwrap_err();
        assert!(e.field.starts_with("data."), "{e}");
    }
}
