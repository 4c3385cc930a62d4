//! `[sync]`: how often the workers synchronise (every step, or the periodic kinds: local
//! SGD, post-local SGD, DiLoCo, Streaming DiLoCo).

use serde::{Deserialize, Serialize};

/// `[sync]`: how often the workers synchronise (the rule: `framework/src/sync/periodic.rs`).
///
/// ```toml
/// [sync]
/// kind = "diloco"       # or "every-step" (default), "local-sgd", "post-local-sgd",
///                       # "streaming-diloco" (with fragments, overlap, mixing, stripes)
/// period = 16           # H: local optimizer steps between synchronisations
/// outer_lr = 0.7
/// outer_momentum = 0.9
/// switch_step = 0       # diloco / post-local-sgd: every-step averaging before this step
/// ```
///
/// The periodic kinds average the parameter change since the last synchronisation (through
/// the run's compressor and error feedback when `[compress]` sets one) instead of every
/// step's gradient.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum SyncConfig {
    /// Every step's gradient is averaged (the default; what `[compress]` describes).
    #[default]
    EveryStep,
    /// Local SGD (Lin et al., ICLR 2020; PyTorch's `PeriodicModelAverager`): each worker
    /// takes `period` optimizer steps on its own gradients, then the parameters are
    /// averaged.
    LocalSgd {
        /// H, optimizer steps between averagings (≥ 1).
        period: u64,
    },
    /// Post-local SGD (Lin et al. 2020; PyTorch's `post_localSGD_hook`): every-step
    /// averaging of gradients before optimizer step `switch_step`, local SGD with `period`
    /// from then on.
    PostLocalSgd {
        /// H after the switch (≥ 1).
        period: u64,
        /// The first optimizer step of the local phase.
        switch_step: u64,
    },
    /// DiLoCo (Douillard et al. 2023): `period` inner steps with the `[train]` optimizer,
    /// then an outer Nesterov-momentum SGD step on the averaged parameter change. The
    /// paper pairs it with an inner AdamW; under an inner momentum SGD the outer momentum's
    /// gain (up to η/(1−μ) = 7× the change at the defaults) diverged on LeNet-5 / MNIST
    /// (`experiments/README.md`): lower `outer_lr` or `outer_momentum` there.
    Diloco {
        /// H, inner steps per outer step (≥ 1).
        period: u64,
        /// The outer learning rate (default 0.7, the paper's).
        #[serde(default = "outer_lr")]
        outer_lr: f64,
        /// The outer Nesterov momentum (default 0.9, the paper's; 0 turns it off).
        #[serde(default = "outer_momentum")]
        outer_momentum: f64,
        /// The first inner step (default 0): before it every step's gradient is averaged,
        /// as post-local SGD does. The paper starts DiLoCo from a model pre-trained with
        /// every-step AdamW; this is that start inside one run.
        #[serde(default)]
        switch_step: u64,
    },
    /// Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512; `sync/streaming.rs`):
    /// DiLoCo whose parameters are synchronised in `fragments` parts at staggered steps
    /// (each fragment every `period` inner steps, fragment `p` after steps `(p + 1)·H/F`,
    /// `2H + (p + 1)·H/F`, …), each fragment's synchronised value merged `overlap` inner
    /// steps after its exchange began as `mixing·local + (1 − mixing)·global`.
    StreamingDiloco {
        /// H, inner steps between two synchronisations of one fragment (≥ `fragments`).
        period: u64,
        /// The outer learning rate (default 0.7).
        #[serde(default = "outer_lr")]
        outer_lr: f64,
        /// The outer Nesterov momentum (default 0.9).
        #[serde(default = "outer_momentum")]
        outer_momentum: f64,
        /// The first inner step (default 0), as for `diloco`.
        #[serde(default)]
        switch_step: u64,
        /// F, the number of fragments (default 4; 1 ≤ F ≤ H).
        #[serde(default = "fragments")]
        fragments: usize,
        /// τ, inner steps between a fragment's exchange and its merge (default 1; < H, or
        /// = H with `eager`): the steps its communication overlaps.
        #[serde(default = "overlap")]
        overlap: u64,
        /// α, the share of the local fragment kept at the merge (default 0.5; 0 replaces
        /// it by the global value, as DiLoCo does).
        #[serde(default = "mixing")]
        mixing: f64,
        /// Pieces per fragment (default 2): the parameter vector is cut at tensor rows into
        /// `fragments·stripes` pieces of equal size, piece `j` in fragment `j mod F`, so each
        /// fragment spans the depth of the model and holds 1/F of its values.
        #[serde(default = "stripes")]
        stripes: usize,
        /// Whether a fragment's exchange stays in flight while the next `overlap` inner
        /// steps compute (default true): it runs on its own thread, over a second lane of
        /// the same connections, and the step of its merge waits for what is left of it.
        /// `false` runs it at the step that starts it, blocking that step (the trained
        /// model is the same either way). Needs `overlap ≥ 1` to matter; MPI runs block.
        #[serde(default = "in_flight")]
        in_flight: bool,
        /// The eager outer step (Kale, Douillard & Donchev 2025, arXiv 2502.12996; default
        /// false): a fragment's exchange overlaps its whole next round (`overlap = period`,
        /// `mixing = 0`), and at each round's end the replica takes its outer step at once
        /// on its own change over the workers, `Δᵢ/M`, plus the other workers' share of the
        /// round before, which has arrived meanwhile — instead of waiting for the average.
        /// On `experiments/low_comm_gpt.toml` (13 rounds) it diverged at the default outer
        /// 0.7 / 0.9 and trained with less outer momentum (`experiments/README.md`).
        #[serde(default)]
        eager: bool,
    },
}

fn in_flight() -> bool {
    true
}

fn fragments() -> usize {
    4
}
fn overlap() -> u64 {
    1
}
fn mixing() -> f64 {
    0.5
}
fn stripes() -> usize {
    2
}

fn outer_lr() -> f64 {
    0.7
}
fn outer_momentum() -> f64 {
    0.9
}

impl SyncConfig {
    /// The `kind` as written in the file.
    pub fn name(&self) -> &'static str {
        match self {
            SyncConfig::EveryStep => "every-step",
            SyncConfig::LocalSgd { .. } => "local-sgd",
            SyncConfig::PostLocalSgd { .. } => "post-local-sgd",
            SyncConfig::Diloco { .. } => "diloco",
            SyncConfig::StreamingDiloco { .. } => "streaming-diloco",
        }
    }

    /// Whether the run keeps exchanges in flight across steps on a second lane of its
    /// connections (Streaming DiLoCo with `in_flight` and an overlap of at least one step).
    pub fn wants_second_lane(&self) -> bool {
        matches!(
            *self,
            SyncConfig::StreamingDiloco {
                in_flight: true,
                overlap: 1..,
                ..
            }
        )
    }

    /// The period H of a periodic kind (`None` for every-step).
    pub fn period(&self) -> Option<u64> {
        match *self {
            SyncConfig::EveryStep => None,
            SyncConfig::LocalSgd { period }
            | SyncConfig::PostLocalSgd { period, .. }
            | SyncConfig::Diloco { period, .. }
            | SyncConfig::StreamingDiloco { period, .. } => Some(period),
        }
    }
}
