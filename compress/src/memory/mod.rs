//! The error-feedback seam (ALGORITHMS.md §0.3).
//!
//! ```text
//! p   = β·e + γ·g          compensate
//! msg = C(p)               (the compressor)
//! e   = p − D(msg)         update: keep what was not transmitted
//! ```
//! Memory is its own seam, not part of the compressors, so any biased compressor can be
//! paired with any memory. State is keyed by a stable bucket id and can be exported for
//! checkpoints ([`Memory::export`] / [`Memory::import`]).
//!
//! One file per memory; methods import memories, never the reverse:
//! * `residual`: [`NoMemory`] and [`Residual`] (β, γ).
//! * `dgc_momentum`: DGC's momentum-corrected memory [`DgcMemory`] and its local gradient
//!   clipping [`Clip`].
//! * `lowpass`: ScaleCom's low-pass-filtered memory [`LowPass`].
//! * `momentum`: Signum's worker momentum [`Momentum`] (not error feedback: the compressor
//!   sends the sign of the momentum).
//! * `adopted`: the per-bucket residual buffers of a compressor that keeps error feedback
//!   itself ([`Compressor::adopt_error_feedback`](crate::Compressor::adopt_error_feedback)),
//!   and [`SIGNAL_DOMAIN`].
//! * `dlcp`: DLCP's dropped-value residual [`DlcpResidual`], which the framework's exchanger
//!   keeps per dense bucket (it is not a [`Memory`]: see its docs).
//!
//! [`MemoryConfig`] selects and builds the others.

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

mod adopted;
mod dgc_momentum;
mod dlcp;
mod lowpass;
mod momentum;
mod residual;

pub(crate) use adopted::AdoptedResidual;
pub use adopted::SIGNAL_DOMAIN;
pub use dgc_momentum::{reference_clip_value, Clip, DgcMemory};
pub use dlcp::DlcpResidual;
pub use lowpass::LowPass;
pub use momentum::Momentum;
pub use residual::{NoMemory, Residual};

/// An error-feedback memory.
pub trait Memory: Send {
    /// Writes the compensated gradient `p` for bucket `key` into `out` (same length as `grad`).
    fn compensate(&mut self, key: u64, grad: &[f32], out: &mut [f32]);

    /// Records what was transmitted: `transmitted` is `D(C(p))` for the `compensated` buffer
    /// returned by [`Memory::compensate`], whose layer boundaries are `segments` (as in
    /// [`Ctx::segments`](crate::compressor::Ctx::segments); empty means one segment).
    fn update(
        &mut self,
        key: u64,
        compensated: &[f32],
        transmitted: &[f32],
        segments: &[Range<usize>],
    );

    /// Whether this memory does anything (lets callers skip the decode of their own payload).
    fn is_active(&self) -> bool {
        true
    }

    /// Whether this is classic residual error feedback (`e ← p − t`, β = γ = 1), which a
    /// compressor may keep in its own domain
    /// ([`Compressor::adopt_error_feedback`](crate::Compressor::adopt_error_feedback)).
    fn is_classic_residual(&self) -> bool {
        false
    }

    /// The state for a checkpoint: one named buffer per bucket key.
    fn export(&self) -> BTreeMap<u64, Vec<f32>>;

    /// Restores state written by [`Memory::export`].
    fn import(&mut self, state: BTreeMap<u64, Vec<f32>>);
}

/// Memory configuration, tagged by `kind` in TOML (`kind = "residual"`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum MemoryConfig {
    /// No error feedback.
    #[default]
    None,
    /// Residual error feedback `p = β·e + γ·g`.
    Residual {
        /// Decay of the stored residual (default 1).
        #[serde(default = "one")]
        beta: f32,
        /// Gain on the fresh gradient (default 1).
        #[serde(default = "one")]
        gamma: f32,
    },
    /// DGC's momentum-corrected memory ([`DgcMemory`]): the gradient's momentum
    /// lives here and the optimizer must not apply it again (see
    /// [`MemoryConfig::owns_momentum`]).
    DgcMomentum {
        /// Momentum `m` in [0, 1) (default 0.9).
        #[serde(default = "momentum_default")]
        momentum: f32,
        /// Nesterov form `u ← m·(u + g); v ← v + u + g` (default false).
        #[serde(default)]
        nesterov: bool,
        /// Momentum-factor masking: zero `u` at the sent coordinates (default true).
        #[serde(default = "yes")]
        masking: bool,
        /// Local gradient clipping before accumulation (default none).
        #[serde(default)]
        clip: Clip,
    },
    /// ScaleCom's low-pass-filtered memory ([`LowPass`]):
    /// `p = m + g; m ← (1 − β)·m + β·(p − D(C(p)))`; β = 1 is plain error feedback.
    LowPass {
        /// Filter coefficient β in (0, 1] (default 1).
        #[serde(default = "one")]
        beta: f32,
    },
    /// Signum's worker momentum ([`Momentum`]): `p = β·m + (1 − β)·g; m ← p`.
    Momentum {
        /// β in [0, 1) (default 0.9).
        #[serde(default = "momentum_default")]
        beta: f32,
    },
}

fn momentum_default() -> f32 {
    0.9
}

fn yes() -> bool {
    true
}

fn one() -> f32 {
    1.0
}

impl MemoryConfig {
    /// Classic error feedback (β = γ = 1).
    pub const RESIDUAL: MemoryConfig = MemoryConfig::Residual {
        beta: 1.0,
        gamma: 1.0,
    };

    /// Whether the memory applies the optimizer's momentum itself (DGC's momentum
    /// correction): the trainer must then step with the aggregated gradient as it is, with
    /// no momentum on it (a momentum on terms that are not sent, such as weight decay,
    /// stays in the optimizer).
    pub fn owns_momentum(&self) -> bool {
        matches!(self, MemoryConfig::DgcMomentum { .. })
    }

    /// Builds the memory.
    pub fn build(&self) -> Result<Box<dyn Memory>, ConfigError> {
        match *self {
            MemoryConfig::None => Ok(Box::new(NoMemory)),
            MemoryConfig::Residual { beta, gamma } => {
                if !(beta.is_finite() && (0.0..=1.0).contains(&beta)) {
                    return Err(ConfigError::new(
                        "memory.beta",
                        format!("must be in [0, 1], got {beta}"),
                    ));
                }
                if !(gamma.is_finite() && gamma > 0.0) {
                    return Err(ConfigError::new(
                        "memory.gamma",
                        format!("must be > 0, got {gamma}"),
                    ));
                }
                Ok(Box::new(Residual::new(beta, gamma)))
            }
            MemoryConfig::DgcMomentum {
                momentum,
                nesterov,
                masking,
                clip,
            } => {
                if !(momentum.is_finite() && (0.0..1.0).contains(&momentum)) {
                    return Err(ConfigError::new(
                        "memory.momentum",
                        format!("must be in [0, 1), got {momentum}"),
                    ));
                }
                clip.validate()?;
                Ok(Box::new(DgcMemory::new(momentum, nesterov, masking, clip)))
            }
            MemoryConfig::LowPass { beta } => {
                if !(beta.is_finite() && beta > 0.0 && beta <= 1.0) {
                    return Err(ConfigError::new(
                        "memory.beta",
                        format!("must be in (0, 1], got {beta}"),
                    ));
                }
                Ok(Box::new(LowPass::new(beta)))
            }
            MemoryConfig::Momentum { beta } => {
                if !(beta.is_finite() && (0.0..1.0).contains(&beta)) {
                    return Err(ConfigError::new(
                        "memory.beta",
                        format!("must be in [0, 1), got {beta}"),
                    ));
                }
                Ok(Box::new(Momentum::new(beta)))
            }
        }
    }

    /// The memory's `kind` as written in TOML (and recorded in checkpoints).
    pub fn kind(&self) -> &'static str {
        match self {
            MemoryConfig::None => "none",
            MemoryConfig::Residual { .. } => "residual",
            MemoryConfig::DgcMomentum { .. } => "dgc-momentum",
            MemoryConfig::LowPass { .. } => "low-pass",
            MemoryConfig::Momentum { .. } => "momentum",
        }
    }

    /// `f32` words of state per bucket element (DGC keeps momentum and velocity).
    pub fn words_per_element(&self) -> usize {
        match self {
            MemoryConfig::DgcMomentum { .. } => 2,
            _ => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kind_is_the_toml_tag_and_every_default_builds() {
        for m in [
            MemoryConfig::None,
            MemoryConfig::RESIDUAL,
            toml::from_str("kind = \"dgc-momentum\"").unwrap(),
            toml::from_str("kind = \"low-pass\"").unwrap(),
            toml::from_str("kind = \"momentum\"").unwrap(),
        ] {
            let t = toml::Value::try_from(m).unwrap();
            assert_eq!(t["kind"].as_str(), Some(m.kind()), "{m:?}");
            m.build().unwrap();
        }
        let bad: MemoryConfig = toml::from_str("kind = \"momentum\"\nbeta = 1.0").unwrap();
        let e = bad.build().err().unwrap();
        assert_eq!(e.field, "memory.beta");
    }
}
