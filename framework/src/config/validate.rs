//! One validator per section of the configuration, each naming the field it refuses
//! ([`RunConfig::validate`] runs them in order).

use super::overrides::split_field;
use super::{
    ClusterMode, ConfigError, DataKind, DecaySpec, Membership, NonFinitePolicy, RunConfig,
    SyncConfig, TransportKind,
};
use crate::device::DeviceKind;
use crate::lr::{Decay, LrSchedule};
use crate::optim::{CompressedOptimizer, OptimizerConfig, OptimizerKind};

/// A [`ConfigError`] in `file` on `field`.
pub(super) fn error(file: &str, field: &str, message: String) -> ConfigError {
    ConfigError {
        file: file.to_string(),
        field: field.to_string(),
        message,
    }
}

impl RunConfig {
    /// Why this run cannot have live membership (`None` when it can): the parameter
    /// server, MPI, or an exchange kept in flight across steps.
    pub fn live_membership_refused(&self) -> Option<&'static str> {
        let c = &self.cluster;
        if c.mode == ClusterMode::Ps {
            Some(
                "the parameter server's shards and step clock are not re-formed over the survivors",
            )
        } else if c.transport == TransportKind::Mpi {
            Some("an MPI world cannot shrink: a lost rank ends the MPI job")
        } else if self.sync.wants_second_lane() {
            Some("an exchange left in flight across steps (sync.in_flight) runs on a second lane that is not re-formed")
        } else {
            None
        }
    }

    /// Whether the run has live membership: `cluster.membership = "live"`, or `"auto"` (the
    /// default) wherever it can run ([`RunConfig::live_membership_refused`] finds nothing
    /// against it).
    pub fn live_membership(&self) -> bool {
        match self.cluster.membership {
            Membership::Live => true,
            Membership::Fixed => false,
            Membership::Auto => self.live_membership_refused().is_none(),
        }
    }

    /// `name`: a path component of the run directory.
    pub(super) fn check_name(&self, file: &str) -> Result<(), ConfigError> {
        let err = |field: &str, message: String| error(file, field, message);
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
        Ok(())
    }

    /// `[cluster]` and `[network]`.
    pub(super) fn check_cluster(&self, file: &str) -> Result<(), ConfigError> {
        let err = |field: &str, message: String| error(file, field, message);
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
        if matches!(c.device, DeviceKind::Wgpu(_)) && !crate::device::WGPU_TRAIN_BUILT {
            return Err(err("cluster.device", crate::device::NO_WGPU_TRAIN.into()));
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
        if !(c.deadline_floor_s.is_finite() && c.deadline_floor_s > 0.0) {
            return Err(err(
                "cluster.deadline_floor_s",
                format!("must be > 0, got {}", c.deadline_floor_s),
            ));
        }
        if !(c.deadline_factor.is_finite() && c.deadline_factor >= 1.0) {
            return Err(err(
                "cluster.deadline_factor",
                format!("must be at least 1 (steps), got {}", c.deadline_factor),
            ));
        }
        if c.membership == Membership::Live {
            if let Some(why) = self.live_membership_refused() {
                return Err(err(
                    "cluster.membership",
                    format!("\"live\" cannot run here: {why} (use \"fixed\")"),
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
        Ok(())
    }

    /// `[data]`, and that the model fits it.
    pub(super) fn check_data(&self, file: &str) -> Result<(), ConfigError> {
        let err = |field: &str, message: String| error(file, field, message);
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
        Ok(())
    }

    /// `train.epochs` / `train.max_steps`, and the steps per epoch and in total that
    /// `train_examples` (when known) give on the run's workers.
    pub(super) fn steps(
        &self,
        file: &str,
        train_examples: Option<usize>,
    ) -> Result<(u64, u64), ConfigError> {
        let err = |field: &str, message: String| error(file, field, message);
        let (c, d) = (&self.cluster, &self.data);
        let t = &self.train;
        if t.epochs == 0 {
            return Err(err("train.epochs", "must be at least 1".into()));
        }
        if t.max_steps == Some(0) {
            return Err(err("train.max_steps", "must be at least 1".into()));
        }
        if t.accumulate == 0 {
            return Err(err("train.accumulate", "must be at least 1".into()));
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
                (row_len - 1).div_ceil(d.seq_len()) as u64
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
        // Micro-batches an epoch (above) make this many optimizer steps; the rest of the
        // epoch's micro-batches are not used, as the last partial batch is not.
        // (Unknown data size: one step an epoch, as above.)
        let micro = steps_per_epoch;
        let steps_per_epoch = if train_examples.is_some() {
            micro / t.accumulate
        } else {
            micro
        };
        if steps_per_epoch == 0 {
            return Err(err(
                "train.accumulate",
                format!(
                    "{} micro-batches per step exceed the {micro} batches of {} per worker \
                     in an epoch",
                    t.accumulate, d.batch_size
                ),
            ));
        }
        let total_steps = (steps_per_epoch * t.epochs).min(t.max_steps.unwrap_or(u64::MAX));
        Ok((steps_per_epoch, total_steps))
    }

    /// The optimizer and the learning-rate schedule of `[train]`.
    pub(super) fn optimizer(
        &self,
        file: &str,
    ) -> Result<(OptimizerConfig, LrSchedule), ConfigError> {
        let err = |field: &str, message: String| error(file, field, message);
        let t = &self.train;
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
        // The compressed optimizers' own keys: each applies to its optimizer only, and
        // counts steps (at least 1).
        let own: [(&str, Option<u64>, OptimizerKind); 5] = [
            ("freeze_step", t.freeze_step, OptimizerKind::OnebitAdam),
            (
                "var_freeze_step",
                t.var_freeze_step,
                OptimizerKind::ZerooneAdam,
            ),
            (
                "var_update_scaler",
                t.var_update_scaler,
                OptimizerKind::ZerooneAdam,
            ),
            (
                "local_step_scaler",
                t.local_step_scaler,
                OptimizerKind::ZerooneAdam,
            ),
            (
                "local_step_clipper",
                t.local_step_clipper,
                OptimizerKind::ZerooneAdam,
            ),
        ];
        for (key, value, kind) in own {
            let Some(v) = value else { continue };
            if t.optimizer != kind {
                return Err(err(
                    &format!("train.{key}"),
                    format!(
                        "applies to optimizer = {:?} only (this run has {:?})",
                        kind.name(),
                        t.optimizer.name()
                    ),
                ));
            }
            if v == 0 {
                return Err(err(
                    &format!("train.{key}"),
                    "must be at least 1: the first steps need the dense exchange that \
                     estimates the variance"
                        .into(),
                ));
            }
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
        if t.eval_every_steps == Some(0) {
            return Err(err(
                "train.eval_every_steps",
                "must be at least 1 (leave it out to evaluate by epochs only)".into(),
            ));
        }
        if t.eval_every_epochs > t.epochs {
            return Err(err(
                "train.eval_every_epochs",
                format!(
                    "{} exceeds train.epochs = {}",
                    t.eval_every_epochs, t.epochs
                ),
            ));
        }
        Ok((opt, lr))
    }

    /// The compressed optimizer's schedule (`train.optimizer = "onebit-adam"` /
    /// `"zeroone-adam"`), its defaults resolved against the run's `steps_per_epoch`; `None`
    /// for the other optimizers. The keys were checked by [`RunConfig::optimizer`].
    pub(super) fn compressed_optimizer(&self, steps_per_epoch: u64) -> Option<CompressedOptimizer> {
        let t = &self.train;
        // 15 % of the planned steps (`max_steps` does not move it: a run stopped early and
        // resumed with more steps keeps its schedule).
        let fifteen_percent = (t.epochs.saturating_mul(steps_per_epoch) * 15).div_ceil(100);
        match t.optimizer {
            OptimizerKind::OnebitAdam => Some(CompressedOptimizer::OnebitAdam {
                freeze_step: t.freeze_step.unwrap_or(fifteen_percent.max(1)),
            }),
            OptimizerKind::ZerooneAdam => {
                let warmup = (t.warmup_epochs * steps_per_epoch as f64).ceil() as u64;
                let default = if warmup > 0 { warmup } else { fifteen_percent };
                Some(CompressedOptimizer::ZerooneAdam {
                    var_freeze_step: t.var_freeze_step.unwrap_or(default.max(1)),
                    var_update_scaler: t.var_update_scaler.unwrap_or(16),
                    local_step_scaler: t.local_step_scaler.unwrap_or(32678),
                    local_step_clipper: t.local_step_clipper.unwrap_or(16),
                })
            }
            _ => None,
        }
    }

    /// `[failure]`.
    pub(super) fn check_failure(&self, file: &str) -> Result<(), ConfigError> {
        let err = |field: &str, message: String| error(file, field, message);
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
        Ok(())
    }

    /// `[sync]`, and the combinations it does not support: the parameter server (its
    /// servers apply every step's gradients), a memory that owns the optimizer's momentum
    /// (the local steps would run without momentum), the voting aggregations (a vote of
    /// the signs of parameter changes is not their average).
    pub(super) fn check_sync(
        &self,
        file: &str,
        memory: &dtrain_compress::MemoryConfig,
        method: &dtrain_compress::CompressorConfig,
    ) -> Result<(), ConfigError> {
        let err = |field: &str, message: String| error(file, field, message);
        let s = &self.sync;
        let Some(period) = s.period() else {
            return Ok(());
        };
        let kind = s.name();
        if period == 0 {
            return Err(err(
                "sync.period",
                format!("must be at least 1 optimizer step, got 0 (kind = {kind:?})"),
            ));
        }
        if let SyncConfig::StreamingDiloco {
            fragments,
            overlap,
            mixing,
            stripes,
            eager,
            ..
        } = *s
        {
            if !(1..=period as usize).contains(&fragments) {
                return Err(err(
                    "sync.fragments",
                    format!(
                        "must be in [1, period = {period}] (each fragment gets its own step), \
                         got {fragments}"
                    ),
                ));
            }
            if eager && overlap != period {
                return Err(err(
                    "sync.eager",
                    format!(
                        "the eager outer step applies the other workers' share one round \
                         late, so a fragment's exchange overlaps its whole round: set \
                         overlap = period = {period} (got overlap = {overlap})"
                    ),
                ));
            }
            if eager && mixing != 0.0 {
                return Err(err(
                    "sync.eager",
                    format!(
                        "the eager outer step restarts each round from the replica's own \
                         outer-stepped model: set mixing = 0.0 (got {mixing})"
                    ),
                ));
            }
            if !eager && overlap >= period {
                return Err(err(
                    "sync.overlap",
                    format!(
                        "must be below period = {period} (a fragment merges before its next \
                         exchange; the eager outer step, `eager = true`, takes overlap = \
                         period), got {overlap}"
                    ),
                ));
            }
            if !(0.0..1.0).contains(&mixing) {
                return Err(err(
                    "sync.mixing",
                    format!("must be in [0, 1), got {mixing}"),
                ));
            }
            if stripes == 0 {
                return Err(err("sync.stripes", "must be at least 1, got 0".into()));
            }
        }
        if let SyncConfig::Diloco {
            outer_lr,
            outer_momentum,
            ..
        }
        | SyncConfig::StreamingDiloco {
            outer_lr,
            outer_momentum,
            ..
        } = *s
        {
            if !(outer_lr.is_finite() && outer_lr > 0.0) {
                return Err(err("sync.outer_lr", format!("must be > 0, got {outer_lr}")));
            }
            if !(0.0..1.0).contains(&outer_momentum) {
                return Err(err(
                    "sync.outer_momentum",
                    format!("must be in [0, 1), got {outer_momentum}"),
                ));
            }
        }
        if self.cluster.mode == ClusterMode::Ps {
            return Err(err(
                "sync.kind",
                format!(
                    "{kind:?} is not supported with cluster.mode = \"ps\": the servers apply \
                     every step's gradients (use mode = \"allreduce\")"
                ),
            ));
        }
        if memory.owns_momentum() {
            return Err(err(
                "sync.kind",
                format!(
                    "{kind:?} cannot run with compress.kind = {:?}'s momentum memory: it takes \
                     the momentum out of the optimizer, and the local steps would run without \
                     it (set compress.memory = \"residual\", or use every-step)",
                    method.name()
                ),
            ));
        }
        if method
            .combine()
            .is_ok_and(|c| c != dtrain_compress::Combine::Mean)
        {
            return Err(err(
                "sync.kind",
                format!(
                    "{kind:?} averages parameter changes, and compress.kind = {:?} aggregates \
                     by majority vote (a vote of the changes' signs is not their average)",
                    method.name()
                ),
            ));
        }
        Ok(())
    }

    /// `[checkpoint]`.
    pub(super) fn check_checkpoint(&self, file: &str) -> Result<(), ConfigError> {
        let err = |field: &str, message: String| error(file, field, message);
        let c = &self.checkpoint;
        if c.keep == 0 {
            return Err(err(
                "checkpoint.keep",
                "must be at least 1 (the newest checkpoint is never deleted)".into(),
            ));
        }
        if !(c.grace_s.is_finite() && c.grace_s > 0.0) {
            return Err(err(
                "checkpoint.grace_s",
                format!("must be > 0 seconds, got {}", c.grace_s),
            ));
        }
        Ok(())
    }

    /// The model's input must match the data: image shape / classes, or a text kind.
    fn check_model_fits_data(&self) -> Result<(), (String, String)> {
        self.model
            .check()
            .map_err(|e| ("model".to_string(), e.to_string()))?;
        if let Some(p) = &self.model.init_from {
            if !p.is_file() {
                return Err((
                    "model.init_from".into(),
                    format!("{}: no such file", p.display()),
                ));
            }
        }
        let text_model = self.model.is_language_model();
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
        if let Some(context) = self.model.context() {
            let seq_len = self.data.seq_len();
            if text_model && seq_len > context {
                let given = if self.data.seq_len.is_some() {
                    ""
                } else {
                    " (the default)"
                };
                return Err((
                    "data.seq_len".into(),
                    format!(
                        "{seq_len}{given} is longer than model.context = {context}: a \
                         {:?} model takes at most model.context tokens per sequence; set \
                         data.seq_len <= {context} or raise model.context",
                        self.model.kind()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Fills `model.vocab` of a language model from the corpus when it is unset, and refuses
    /// an explicit one that differs from the corpus's `corpus` tokens (`None`: the data is
    /// not text, nothing to do). `dtrain check`, `dtrain run` and the trainer all call it
    /// once the data is open, so a wrong value is refused before anything starts.
    pub fn resolve_vocab(&mut self, file: &str, corpus: Option<usize>) -> Result<(), ConfigError> {
        let Some(v) = corpus.filter(|_| self.model.is_language_model()) else {
            return Ok(());
        };
        match self.model.vocab() {
            None => {
                self.model.set_vocab(v);
                Ok(())
            }
            Some(given) if given == v => Ok(()),
            Some(given) => Err(error(
                file,
                "model.vocab",
                format!(
                    "{given} but the {:?} corpus has {v} tokens: set model.vocab = {v}, \
                     or leave it out (it defaults to the corpus's)",
                    self.data.kind.name()
                ),
            )),
        }
    }
}
