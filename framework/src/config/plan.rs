//! The validated plan: every section checked, derived values filled in.

use dtrain_compress::{CompressorConfig, MemoryConfig};

use super::compress::Compression;
use super::validate::error;
use super::{ClusterMode, ConfigError, DlcpSettings, NonFinitePolicy, RunConfig};
use crate::device::CodecDevice;
use crate::exchange::bucket::BucketPolicy;
use crate::exchange::GatherCollective;
use crate::lr::LrSchedule;
use crate::optim::{CompressedOptimizer, OptimizerConfig};

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
    /// The compressed all-reduce's server residual (`compress.server_error_feedback`);
    /// `None`: on when the run has error feedback and the method averages.
    pub server_error_feedback: Option<bool>,
    /// Where the compressed buckets are encoded (`compress.device`).
    pub codec_device: CodecDevice,
    /// The optimizer (momentum on the weight-decay term alone where the memory owns the
    /// gradient's momentum).
    pub optimizer: OptimizerConfig,
    /// A compressed optimizer's schedule (`train.optimizer = "onebit-adam"` /
    /// `"zeroone-adam"`, defaults resolved); its moments live in the run's gradient
    /// synchronisation.
    pub compressed_optimizer: Option<CompressedOptimizer>,
    /// The learning-rate schedule.
    pub lr: LrSchedule,
    /// Steps per epoch (every worker runs the same number).
    pub steps_per_epoch: u64,
    /// Total steps of the run.
    pub total_steps: u64,
    /// Training examples per epoch (after `train_limit`), for the data check.
    pub train_examples: usize,
    /// Global-norm clipping of the averaged gradient before the optimizer (`train.clip_norm`;
    /// `None` when off, when DGC's local clipping took it over, or with a compressed
    /// optimizer, whose synchronisation clips each gradient before its moments take it).
    pub clip_norm: Option<f32>,
    /// Whether `clip_norm` scales each worker's own gradient before the exchange rather
    /// than the average after it: for the methods whose update is a vote of signs (signSGD,
    /// Signum, DeMo), whose ±1 "average" the global-norm clipping would shrink to nothing
    /// (DeMo's reference clips the local gradient before its momentum takes it).
    pub clip_local: bool,
}

impl Plan {
    /// The norm each worker clips its own gradient to before the exchange (a vote of signs:
    /// [`Plan::clip_local`]), if any.
    pub fn local_clip(&self) -> Option<f32> {
        self.clip_norm.filter(|_| self.clip_local)
    }

    /// The norm the averaged gradient is clipped to after the exchange, if any.
    pub fn mean_clip(&self) -> Option<f32> {
        self.clip_norm.filter(|_| !self.clip_local)
    }
}

impl RunConfig {
    /// Checks everything and derives the trainer's objects. `train_examples` is the size of
    /// the training set after `train_limit` (the data is opened by the caller; pass `None`
    /// to skip the checks that need it, e.g. before data are fetched).
    pub fn validate(&self, file: &str, train_examples: Option<usize>) -> Result<Plan, ConfigError> {
        // Each section in turn, in this order (the first error is the one reported).
        self.check_name(file)?;
        self.check_cluster(file)?;
        self.check_data(file)?;
        let (steps_per_epoch, total_steps) = self.steps(file, train_examples)?;
        let (mut opt, lr) = self.optimizer(file)?;
        self.check_failure(file)?;
        self.check_checkpoint(file)?;
        let Compression {
            method,
            memory,
            buckets,
            collective,
            dlcp,
            server_error_feedback,
            codec_device,
        } = self.compression(file, steps_per_epoch, &mut opt)?;
        self.check_sync(file, &memory, &method)?;
        let (c, f) = (&self.cluster, &self.failure);
        if c.mode == ClusterMode::Ps && f.non_finite == NonFinitePolicy::Recover {
            return Err(error(
                file,
                "failure.non_finite",
                "\"recover\" rolls every rank back to a checkpoint, which a parameter \
                 server's step clock cannot follow; use \"skip\" or \"abort\" with mode = \"ps\""
                    .into(),
            ));
        }
        let clip_local = method
            .combine()
            .is_ok_and(|c| c != dtrain_compress::Combine::Mean);
        Ok(Plan {
            clip_local,
            config: self.clone(),
            method,
            memory,
            buckets,
            collective,
            dlcp,
            server_error_feedback,
            codec_device,
            optimizer: opt,
            compressed_optimizer: self.compressed_optimizer(steps_per_epoch),
            lr,
            steps_per_epoch,
            total_steps,
            train_examples: train_examples.unwrap_or(0),
            // Under DGC's momentum memory the clipping happened locally, before accumulation;
            // a compressed optimizer clips before its moments.
            clip_norm: self
                .train
                .clip_norm
                .filter(|_| !memory.owns_momentum() && !self.train.optimizer.is_compressed()),
        })
    }
}
