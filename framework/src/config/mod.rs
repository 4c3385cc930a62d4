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
//! 0.9 }`), `bucket_mb`, `dense_below`, `dense_1d`, `collective` (`"auto"`, the default:
//! per bucket the cheapest by the α–β model on the run's link, see
//! [`crate::exchange::auto`]; or fixed: `"allgather"`, `"sparse-allreduce"` for methods
//! whose payloads are gathered, `"compressed-allreduce"`, `"dlcp"` for the uncompressed
//! gradient — see [`crate::exchange`]), `server_error_feedback` and `device` (where the
//! compressed buckets are encoded: `"host"`, the default, `"auto"`, or a device such as
//! `"wgpu"` or `"cuda:0"` — see [`crate::device::CodecDevice`]).
//!
//! The optional `[sync]` table ([`SyncConfig`]) says how often the workers synchronise:
//! `kind = "every-step"` (the default), `"local-sgd"` / `"post-local-sgd"` / `"diloco"`
//! with a `period` (the rule is in `framework/src/sync/periodic.rs`).
//!
//! ## Layout
//! This file holds [`RunConfig`] and how it is read; `sections` the tables serde reads
//! (`sync` the `[sync]` one);
//! `model` the `[model]` table ([`ModelSection`]: the registry's spec and `init_from`);
//! `overrides` the `--set` overrides and field-naming of serde's messages; `sweep` the
//! `[[sweep]]` variants; `validate` one validator per section and `compress` the
//! `[compress]` one; `plan` runs them in order and builds the [`Plan`].

mod compress;
mod model;
mod overrides;
mod plan;
mod sections;
mod sweep;
mod sync;
mod validate;

pub use model::ModelSection;
pub use overrides::apply_override;
use overrides::{guess_field, one_line, set_path};
pub use plan::Plan;
pub use sections::{
    CheckpointConfig, ClusterConfig, ClusterMode, DataConfig, DataKind, DecaySpec, DlcpSettings,
    FailureConfig, Liveness, Membership, NetworkConfig, NonFinitePolicy, OutputConfig, TrainConfig,
    TransportKind,
};
use sweep::split_sweep;
pub use sweep::{sweep_entries, SweepEntry};
pub use sync::SyncConfig;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

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
    /// The model (a `dtrain-models` registry entry: `kind`, `variant`, family options) and
    /// the weights it may start from (`init_from`).
    pub model: ModelSection,
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
    /// How often the workers synchronise (default every step).
    #[serde(default)]
    pub sync: SyncConfig,
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

#[cfg(test)]
mod tests;
