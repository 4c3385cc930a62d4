//! The tables of the configuration file as serde reads them: `[data]`, `[train]`,
//! `[cluster]`, `[network]`, `[sync]`, `[checkpoint]`, `[failure]`, `[output]` and the DLCP
//! settings of `[compress]`.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::device::DeviceKind;
use crate::lr::Decay;
use crate::optim::OptimizerKind;

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
    /// Text: BPTT length (default 35, [`DataConfig::seq_len`]).
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

impl DataConfig {
    /// `seq_len` when unset: the BPTT length of Zaremba et al.'s LSTM.
    pub const DEFAULT_SEQ_LEN: usize = 35;

    /// Text: tokens per sequence (`seq_len`, default [`DataConfig::DEFAULT_SEQ_LEN`]).
    pub fn seq_len(&self) -> usize {
        self.seq_len.unwrap_or(Self::DEFAULT_SEQ_LEN)
    }
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
    /// Gradient accumulation: micro-batches of `data.batch_size` per optimizer step
    /// (default 1). Their gradients are averaged locally and exchanged once per step, as
    /// DDP's `no_sync`, Horovod's `backward_passes_per_step` and DeepSpeed's
    /// `gradient_accumulation_steps`; a step then consumes `accumulate × batch_size` samples
    /// per worker, and every count in steps (`max_steps`, `metrics.jsonl`, schedules)
    /// counts optimizer steps.
    #[serde(default = "one_u64")]
    pub accumulate: u64,
    /// `sgd` (default), `adam`, `adamw`, or a compressed optimizer: `onebit-adam` (1-bit
    /// Adam) or `zeroone-adam` (0/1 Adam), whose momentum is exchanged compressed by the
    /// `[compress]` method (default: the 1-bit scaled sign with DeepSpeed's RMS scale)
    /// through the compressed all-reduce.
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
    /// `onebit-adam`: optimizer steps of dense Adam before the variance freezes and the
    /// momentum is exchanged compressed. Default: 15 % of `epochs` × steps per epoch (the
    /// DeepSpeed tutorial's advice of 15–25 % of the training steps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freeze_step: Option<u64>,
    /// `zeroone-adam`: the last step (counted from 1) that may update the variance. Default:
    /// the end of the learning-rate warm-up (`warmup_epochs`) when there is one, else 15 %
    /// of the training steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub var_freeze_step: Option<u64>,
    /// `zeroone-adam`: κ, variance updates at one interval before the interval doubles
    /// (default 16, DeepSpeed's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub var_update_scaler: Option<u64>,
    /// `zeroone-adam`: steps after the variance freeze before the local-step interval
    /// doubles (default 32678, DeepSpeed's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_step_scaler: Option<u64>,
    /// `zeroone-adam`: H, the largest local-step interval (default 16, DeepSpeed's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_step_clipper: Option<u64>,
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
    /// Also evaluate every N optimizer steps (default off): the points of a test metric
    /// against wall time within a short run (`dtrain report`'s `perplexity_vs_time`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_every_steps: Option<u64>,
    /// Gradient clipping by global L2 norm (PyTorch's `clip_grad_norm_`): the averaged
    /// gradient is scaled to norm at most `clip_norm` before the optimizer. Default off.
    /// With DGC's momentum memory this becomes DGC's *local* clipping (ALGORITHMS.md
    /// §10.2): each worker scales its own gradient to norm at most `clip_norm / √workers`
    /// before accumulating it, unless `compress.memory.clip` is set explicitly. With a
    /// method whose update is a vote of signs (signSGD, Signum, DeMo) each worker clips its
    /// own gradient before the exchange: clipping the ±1 vote would shrink every step.
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
    /// the rings; `hybrid` for `--nnodes` runs with several workers per node; else `tcp`.
    /// The launcher resolves it before the workers start: the run
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
    /// Shared memory among the ranks on one host, TCP between hosts (the hybrid driver of
    /// `dtrain_comms::transport::hybrid`): what `auto` picks for a multi-node run
    /// (`--nnodes`) with several workers per node, so the hierarchical all-reduce's
    /// host-local stages stay off the network. Ranks group by their host key (the node
    /// launcher's node, else the host name); a host whose `/dev/shm` has no room for the
    /// rings uses TCP between its ranks too.
    Hybrid,
    /// MPI point-to-point messages (dtrain's own collectives on top): the ranks are MPI's,
    /// started by `mpirun` (`dtrain run` starts it itself on one node). Needs a `dtrain`
    /// built with the `mpi` feature.
    Mpi,
}

impl TransportKind {
    /// Whether newcomers can take lost workers' places over it (live membership): TCP,
    /// QUIC, and the hybrid driver, whose newcomers talk over TCP alone.
    pub fn takes_newcomers(self) -> bool {
        matches!(
            self,
            TransportKind::Tcp | TransportKind::Quic | TransportKind::Hybrid
        )
    }
}

impl std::str::FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(TransportKind::Auto),
            "tcp" => Ok(TransportKind::Tcp),
            "quic" => Ok(TransportKind::Quic),
            "shm" => Ok(TransportKind::Shm),
            "hybrid" => Ok(TransportKind::Hybrid),
            "mpi" => Ok(TransportKind::Mpi),
            _ => Err(format!(
                "unknown transport {s:?} (auto, tcp, quic, shm, hybrid, mpi)"
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
            TransportKind::Hybrid => "hybrid",
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
    /// Whether a GPU may multiply f32 matrices (products, convolutions) in TF32 where it has
    /// the type (NVIDIA from Ampere on), as PyTorch's `allow_tf32`: `true` (default; burn's
    /// behaviour, the tensor cores' speed, operands rounded to 10 mantissa bits: gradients
    /// some 1e-3 – 7e-2 from f32's, README "GPUs") or `false` (f32 arithmetic throughout).
    /// PyTorch's default is `false` for products and `true` for cuDNN's convolutions; dtrain
    /// has one switch for both. No effect on the CPU or on Vulkan (no TF32 there).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub allow_tf32: bool,
    /// Seconds a collective may stall before the run stops naming the silent rank
    /// (default 120).
    #[serde(default = "default_timeout")]
    pub timeout_s: f64,
    /// Every how many steps the workers compare a hash of their parameters (default 100; 0
    /// turns the check off): one all-reduce of four floats per worker. The hash goes into
    /// `metrics.jsonl` (`param_hash`), and replicas that differ stop the run, naming the
    /// ranks and the step. Steps where the replicas legitimately differ (between the rounds
    /// of a periodic `[sync]`, an asynchronous parameter server) are not checked: the check
    /// waits for the next step where they must agree (a round's end). Streaming DiLoCo's
    /// replicas never agree after its first local step, so it is never checked there.
    #[serde(
        default = "check_replicas_every",
        skip_serializing_if = "is_check_replicas_every"
    )]
    pub check_replicas_every: u64,
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
    /// Under live membership the step deadline decides instead (see
    /// [`ClusterConfig::liveness`]).
    #[serde(default = "default_peer_timeout")]
    pub peer_timeout_s: f64,
    /// What a lost worker does to the run: `"live"` drops it and the others go on without
    /// a restart (see [`Membership::Live`]); `"fixed"` stops the run, naming the worker
    /// (`--max-restarts` then restarts every worker from the newest checkpoint); `"auto"`
    /// (default) is live wherever a run can have it, fixed elsewhere (see
    /// [`Membership::Auto`]).
    #[serde(default, skip_serializing_if = "is_default")]
    pub membership: Membership,
    /// Live membership: the shortest step deadline, in seconds (default 10). A member that
    /// sends nothing of a step's collectives for the deadline is dropped; one that stalls
    /// for less is waited for.
    #[serde(default = "deadline_floor", skip_serializing_if = "is_deadline_floor")]
    pub deadline_floor_s: f64,
    /// Live membership: the step deadline in measured steps (default 20): the deadline is
    /// this many times the mean step time so far, at least `deadline_floor_s` and at most
    /// `timeout_s` (which is the deadline until the first steps are measured), so a run
    /// whose steps take long does not drop a member for a pause shorter than a few steps.
    #[serde(
        default = "deadline_factor",
        skip_serializing_if = "is_deadline_factor"
    )]
    pub deadline_factor: f64,
}

fn deadline_floor() -> f64 {
    10.0
}
fn is_deadline_floor(v: &f64) -> bool {
    *v == deadline_floor()
}
fn deadline_factor() -> f64 {
    20.0
}
fn is_deadline_factor(v: &f64) -> bool {
    *v == deadline_factor()
}

/// `[cluster] membership`: whether the group of workers may change while the run goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Membership {
    /// [`Membership::Live`] wherever the run can have it, [`Membership::Fixed`] where it
    /// cannot run (the parameter server, MPI, an exchange kept in flight across steps; see
    /// [`crate::config::RunConfig::live_membership_refused`]).
    #[default]
    Auto,
    /// The group is the one the run started with: a lost worker stops the run.
    Fixed,
    /// A worker lost during a step (its connection closed, or it stalled past the step
    /// deadline) is dropped: the survivors agree on the smaller group and go on from the
    /// most steps any of them finished — one that lags a step takes the replicated state
    /// from those that finished it and keeps its own error-feedback memory; when none
    /// finished, they run the step again over the group (its mean is over the survivors, so
    /// its effective batch is theirs). Nothing is copied before such a step. Under the
    /// periodic `[sync]` kinds and 0/1 Adam, whose replicas differ between rounds, their
    /// every-step phases (before `switch_step`, 0/1 Adam's variance phase) go the same way;
    /// a survivor a local step behind runs it alone; a synchronisation of 0/1 Adam's frozen
    /// phase cut part-way runs its exchange again over the survivors; and before a step
    /// that ends a round of local SGD or DiLoCo, or exchanges a Streaming DiLoCo fragment,
    /// each keeps an in-memory copy of its state, to which the group goes back when a
    /// failure cut such a step part-way (`trainer/recovery.rs`). Each keeps reading its own
    /// data shard; the lost worker's shard is not
    /// read while its place is empty. The change is recorded in `summary.json`
    /// (`membership`).
    Live,
}

fn default_heartbeat() -> f64 {
    1.0
}
fn default_peer_timeout() -> f64 {
    10.0
}

impl ClusterConfig {
    /// The transports' heartbeat interval and peer timeout. Under live membership the step
    /// deadline judges a silent member (see [`ClusterConfig::deadline_floor_s`]): the peer
    /// timeout is raised to `timeout_s`, the deadline's ceiling, so that the transport does
    /// not drop a stopped member before the deadline does.
    /// `live`: whether the run has live membership
    /// ([`crate::config::RunConfig::live_membership`]).
    pub fn liveness(&self, live: bool) -> Liveness {
        let peer_timeout = if live {
            self.peer_timeout_s.max(self.timeout_s)
        } else {
            self.peer_timeout_s
        };
        Liveness {
            heartbeat: std::time::Duration::from_secs_f64(self.heartbeat_s),
            peer_timeout: std::time::Duration::from_secs_f64(peer_timeout),
            accept_joiners: live,
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
    /// Keep accepting newcomers that take a lost peer's place (live membership; the tcp
    /// transport).
    pub accept_joiners: bool,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            heartbeat: std::time::Duration::from_secs(1),
            peer_timeout: std::time::Duration::from_secs(10),
            accept_joiners: false,
        }
    }
}

fn check_replicas_every() -> u64 {
    100
}

fn is_check_replicas_every(v: &u64) -> bool {
    *v == check_replicas_every()
}

fn is_true(v: &bool) -> bool {
    *v
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
            allow_tf32: true,
            timeout_s: default_timeout(),
            check_replicas_every: check_replicas_every(),
            mode: ClusterMode::AllReduce,
            servers: None,
            staleness: 0,
            heartbeat_s: default_heartbeat(),
            peer_timeout_s: default_peer_timeout(),
            membership: Membership::Auto,
            deadline_floor_s: deadline_floor(),
            deadline_factor: deadline_factor(),
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
    /// Keep the newest N checkpoints (default 2, at least 1). Older ones are deleted once a
    /// newer one is complete on every rank, so the last intact checkpoint is never deleted
    /// (see [`crate::trainer::retained`]).
    #[serde(default = "two")]
    pub keep: usize,
    /// Seconds the workers have, after `dtrain run` got SIGTERM or SIGINT, to finish the
    /// current step, write a checkpoint and exit before they are killed (default 30, as
    /// Slurm's preemption grace).
    #[serde(default = "thirty")]
    pub grace_s: f64,
}

fn thirty() -> f64 {
    30.0
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
            grace_s: thirty(),
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
    /// Also write TensorBoard event files into the run directory as the run goes (rank 0;
    /// the same steps as `metrics.jsonl`, every evaluation, the configuration as text; see
    /// `framework/src/tensorboard.rs`). Default false.
    #[serde(default)]
    pub tensorboard: bool,
}

fn runs() -> PathBuf {
    PathBuf::from("runs")
}

impl Default for OutputConfig {
    fn default() -> Self {
        OutputConfig {
            dir: runs(),
            log_every: 1,
            tensorboard: false,
        }
    }
}
