//! Learning-rate schedules, as pure functions of the (fractional) epoch.
//!
//! `lr(e) = η_target · decay(e) · warmup(e)`, where
//! * `η_target = η · B_global / B_ref` when the linear scaling rule of Goyal et al.
//!   ("Accurate, Large Minibatch SGD") is on (`scale_batch_ref = B_ref`), else `η`;
//! * `warmup(e) = s + (1 − s)·e/W` for `e < W` (gradual warm-up over `W` epochs), else 1;
//!   the default start `s` is `B_ref/B_global` under the scaling rule (so warm-up starts at
//!   the small-batch rate η, as in the paper) and 0.1 otherwise;
//! * `decay` is `constant`, `step` (×γ at each milestone epoch) or `cosine` (from 1 to
//!   `min_factor` over the run).

use serde::{Deserialize, Serialize};

/// The decay part of the schedule, tagged by `kind`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Decay {
    /// No decay.
    #[default]
    Constant,
    /// Multiply by `gamma` at each milestone epoch.
    Step {
        /// Epochs at which the rate drops (ascending).
        milestones: Vec<f64>,
        /// Factor per milestone (default 0.1).
        #[serde(default = "tenth")]
        gamma: f64,
    },
    /// Half-cosine from 1 down to `min_factor` at the last epoch.
    Cosine {
        /// Final factor (default 0).
        #[serde(default)]
        min_factor: f64,
    },
}

fn tenth() -> f64 {
    0.1
}

/// A complete learning-rate schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrSchedule {
    /// Base learning rate η (for the reference batch when scaling).
    pub lr: f64,
    /// Decay shape.
    #[serde(default)]
    pub decay: Decay,
    /// Warm-up length in epochs (0 = none).
    #[serde(default)]
    pub warmup_epochs: f64,
    /// Warm-up start factor (see the module docs for the default).
    #[serde(default)]
    pub warmup_start: Option<f64>,
    /// Reference batch for the linear scaling rule; `None` disables scaling.
    #[serde(default)]
    pub scale_batch_ref: Option<usize>,
}

impl LrSchedule {
    /// A constant rate.
    pub fn constant(lr: f64) -> Self {
        LrSchedule {
            lr,
            decay: Decay::Constant,
            warmup_epochs: 0.0,
            warmup_start: None,
            scale_batch_ref: None,
        }
    }

    /// Checks the parameters; errors name the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(format!("train.lr must be > 0, got {}", self.lr));
        }
        if !(self.warmup_epochs.is_finite() && self.warmup_epochs >= 0.0) {
            return Err("train.warmup_epochs must be >= 0".into());
        }
        if let Some(s) = self.warmup_start {
            if !(0.0..=1.0).contains(&s) {
                return Err(format!("train.warmup_start must be in [0, 1], got {s}"));
            }
        }
        if self.scale_batch_ref == Some(0) {
            return Err("train.scale_batch_ref must be > 0".into());
        }
        match &self.decay {
            Decay::Step { milestones, gamma } => {
                if milestones.windows(2).any(|w| w[1] < w[0]) {
                    return Err("train.lr_schedule.milestones must be ascending".into());
                }
                if !(*gamma > 0.0 && *gamma <= 1.0) {
                    return Err(format!(
                        "train.lr_schedule.gamma must be in (0, 1], got {gamma}"
                    ));
                }
            }
            Decay::Cosine { min_factor } => {
                if !(0.0..=1.0).contains(min_factor) {
                    return Err("train.lr_schedule.min_factor must be in [0, 1]".into());
                }
            }
            Decay::Constant => {}
        }
        Ok(())
    }

    /// The learning rate at fractional epoch `epoch` of a run of `total_epochs`, for a
    /// global batch of `global_batch` samples.
    pub fn at(&self, epoch: f64, total_epochs: f64, global_batch: usize) -> f64 {
        let k = match self.scale_batch_ref {
            Some(r) => global_batch as f64 / r as f64,
            None => 1.0,
        };
        let target = self.lr * k;
        let decay = match &self.decay {
            Decay::Constant => 1.0,
            Decay::Step { milestones, gamma } => {
                gamma.powi(milestones.iter().filter(|&&m| epoch >= m).count() as i32)
            }
            Decay::Cosine { min_factor } => {
                let t = if total_epochs > 0.0 {
                    (epoch / total_epochs).clamp(0.0, 1.0)
                } else {
                    1.0
                };
                min_factor + (1.0 - min_factor) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
            }
        };
        let warm = if self.warmup_epochs > 0.0 && epoch < self.warmup_epochs {
            let s = self
                .warmup_start
                .unwrap_or(if self.scale_batch_ref.is_some() {
                    (1.0 / k).min(1.0)
                } else {
                    0.1
                });
            s + (1.0 - s) * epoch / self.warmup_epochs
        } else {
            1.0
        };
        target * decay * warm
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn goyal_linear_scaling_with_gradual_warmup() {
        // η = 0.1 per 256 samples, global batch 8192 (k = 32), 5 warm-up epochs.
        let s = LrSchedule {
            lr: 0.1,
            decay: Decay::Step {
                milestones: vec![30.0, 60.0, 80.0],
                gamma: 0.1,
            },
            warmup_epochs: 5.0,
            warmup_start: None,
            scale_batch_ref: Some(256),
        };
        s.validate().unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12 * b.abs().max(1.0);
        assert!(
            close(s.at(0.0, 90.0, 8192), 0.1),
            "starts at the small-batch rate"
        );
        assert!(close(s.at(2.5, 90.0, 8192), 0.1 + (3.2 - 0.1) * 0.5));
        assert!(
            close(s.at(5.0, 90.0, 8192), 3.2),
            "reaches k·η after warm-up"
        );
        assert!(close(s.at(29.9, 90.0, 8192), 3.2));
        assert!(close(s.at(30.0, 90.0, 8192), 0.32));
        assert!(close(s.at(85.0, 90.0, 8192), 0.0032));
        // Monotone during warm-up.
        let mut prev = 0.0;
        for i in 0..50 {
            let v = s.at(i as f64 * 0.1, 90.0, 8192);
            assert!(v >= prev);
            prev = v;
        }
    }

    #[test]
    fn cosine_endpoints_and_validation() {
        let s = LrSchedule {
            decay: Decay::Cosine { min_factor: 0.01 },
            ..LrSchedule::constant(0.5)
        };
        assert!((s.at(0.0, 10.0, 1) - 0.5).abs() < 1e-12);
        assert!((s.at(5.0, 10.0, 1) - 0.5 * (0.01 + 0.99 * 0.5)).abs() < 1e-12);
        assert!((s.at(10.0, 10.0, 1) - 0.005).abs() < 1e-12);
        assert!(LrSchedule::constant(-1.0)
            .validate()
            .unwrap_err()
            .contains("train.lr"));
        let bad = LrSchedule {
            decay: Decay::Step {
                milestones: vec![3.0, 1.0],
                gamma: 0.1,
            },
            ..LrSchedule::constant(0.1)
        };
        assert!(bad.validate().unwrap_err().contains("ascending"));
        let t: LrSchedule =
            toml::from_str("lr = 0.1\nwarmup_epochs = 2\n[decay]\nkind = \"cosine\"").unwrap();
        assert_eq!(t.decay, Decay::Cosine { min_factor: 0.0 });
    }
}
