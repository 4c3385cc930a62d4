//! θ schedules for the FFT sparsifier (ALGORITHMS.md §1.5) and the `recover` rule.
//!
//! Convergence without error feedback needs a diminishing drop ratio: with steps `α_t`,
//! `Σα_t = ∞`, `Σα_t² < ∞` and `Σ α_t √θ_t < ∞` suffice (§1.5). A [`ThetaSchedule`] is a pure
//! function of `(step, epoch)`; the trainer evaluates it before each step and hands the
//! value to [`crate::fft::Fft::set_theta`].
//!
//! ```toml
//! [theta]
//! kind = "poly"
//! theta0 = 0.9
//! total_steps = 100000
//! power = 2.0
//! ```
//!
//! [`Recover`] is the accuracy-recovery rule as a pure state machine: fed each step's loss,
//! it answers [`Verdict::Continue`], or [`Verdict::RollBack`] with a reduced θ when the loss
//! is non-finite or exceeds `ratio ×` its running minimum. The trainer performs the rollback
//! (restores its last checkpoint) and keeps multiplying scheduled θ values by
//! [`Recover::scale`].

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// A drop-ratio schedule, tagged by `kind`. Every variant is non-increasing in its time
/// argument and stays in `[0, θ₀] ⊂ [0, 1)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum ThetaSchedule {
    /// `θ_t = θ₀`.
    Constant {
        /// θ₀ ∈ [0, 1).
        theta0: f64,
    },
    /// `θ = θ₀ · γ^(number of milestones ≤ epoch)`: multiplied by γ at each milestone epoch
    /// (typically the learning-rate milestones).
    Step {
        /// θ₀ ∈ [0, 1).
        theta0: f64,
        /// Factor γ ∈ [0, 1] applied at each milestone. Default 0.5.
        #[serde(default = "default_gamma")]
        gamma: f64,
        /// Epochs at which θ is multiplied by γ.
        milestones: Vec<u64>,
    },
    /// `θ_t = θ₀ (1 − t/T)^p` for step `t < T`, then 0.
    Poly {
        /// θ₀ ∈ [0, 1).
        theta0: f64,
        /// Horizon T in steps (> 0).
        total_steps: u64,
        /// Power p > 0. Default 1.
        #[serde(default = "default_power")]
        power: f64,
    },
    /// `θ_t = θ₀ / (1 + t/τ)` for step `t`.
    Inv {
        /// θ₀ ∈ [0, 1).
        theta0: f64,
        /// Time constant τ in steps (> 0).
        tau: f64,
    },
}

fn default_gamma() -> f64 {
    0.5
}
fn default_power() -> f64 {
    1.0
}

fn check_theta0(t: f64) -> Result<(), ConfigError> {
    if !(0.0..1.0).contains(&t) {
        return Err(ConfigError::new(
            "theta0",
            format!("must be in [0, 1), got {t}"),
        ));
    }
    Ok(())
}

impl ThetaSchedule {
    /// Checks the parameters.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self {
            ThetaSchedule::Constant { theta0 } => check_theta0(*theta0),
            ThetaSchedule::Step { theta0, gamma, .. } => {
                check_theta0(*theta0)?;
                if !(0.0..=1.0).contains(gamma) {
                    return Err(ConfigError::new(
                        "gamma",
                        format!("must be in [0, 1], got {gamma}"),
                    ));
                }
                Ok(())
            }
            ThetaSchedule::Poly {
                theta0,
                total_steps,
                power,
            } => {
                check_theta0(*theta0)?;
                if *total_steps == 0 {
                    return Err(ConfigError::new("total_steps", "must be positive"));
                }
                if !(*power > 0.0 && power.is_finite()) {
                    return Err(ConfigError::new(
                        "power",
                        format!("must be positive, got {power}"),
                    ));
                }
                Ok(())
            }
            ThetaSchedule::Inv { theta0, tau } => {
                check_theta0(*theta0)?;
                if !(*tau > 0.0 && tau.is_finite()) {
                    return Err(ConfigError::new(
                        "tau",
                        format!("must be positive, got {tau}"),
                    ));
                }
                Ok(())
            }
        }
    }

    /// θ at global step `step` during epoch `epoch` (only `step` uses epochs).
    pub fn theta(&self, step: u64, epoch: u64) -> f64 {
        let t = match self {
            ThetaSchedule::Constant { theta0 } => *theta0,
            ThetaSchedule::Step {
                theta0,
                gamma,
                milestones,
            } => {
                let passed = milestones.iter().filter(|&&m| m <= epoch).count();
                theta0 * gamma.powi(passed.min(i32::MAX as usize) as i32)
            }
            ThetaSchedule::Poly {
                theta0,
                total_steps,
                power,
            } => {
                let frac = 1.0 - (step.min(*total_steps) as f64 / *total_steps as f64);
                theta0 * frac.powf(*power)
            }
            ThetaSchedule::Inv { theta0, tau } => theta0 / (1.0 + step as f64 / tau),
        };
        // Guard against NaN from unvalidated parameters: stay inside [0, 1).
        if t.is_nan() {
            0.0
        } else {
            t.clamp(0.0, 1.0 - f64::EPSILON)
        }
    }
}

/// Parameters of [`Recover`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecoverConfig {
    /// A loss above `ratio ×` the running minimum is a failure. Default 1.5.
    #[serde(default = "default_ratio")]
    pub ratio: f64,
    /// θ is multiplied by this on each failure. Default 0.5.
    #[serde(default = "default_factor")]
    pub factor: f64,
}

fn default_ratio() -> f64 {
    1.5
}
fn default_factor() -> f64 {
    0.5
}

impl Default for RecoverConfig {
    fn default() -> Self {
        RecoverConfig {
            ratio: default_ratio(),
            factor: default_factor(),
        }
    }
}

/// What the trainer should do after a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Keep going.
    Continue,
    /// Restore the last checkpoint and continue with this (smaller) θ.
    RollBack {
        /// The reduced drop ratio: the θ in effect times `factor`.
        new_theta: f64,
    },
}

/// The accuracy-recovery rule of §1.5 as a state machine. Losses are assumed non-negative.
#[derive(Debug, Clone, PartialEq)]
pub struct Recover {
    cfg: RecoverConfig,
    best: f64,
    scale: f64,
    failures: u64,
}

impl Recover {
    /// A fresh rule (no loss seen yet; scale 1).
    pub fn new(cfg: RecoverConfig) -> Result<Self, ConfigError> {
        if !(cfg.ratio >= 1.0 && cfg.ratio.is_finite()) {
            return Err(ConfigError::new(
                "ratio",
                format!("must be a finite number ≥ 1, got {}", cfg.ratio),
            ));
        }
        if !(cfg.factor >= 0.0 && cfg.factor < 1.0) {
            return Err(ConfigError::new(
                "factor",
                format!("must be in [0, 1), got {}", cfg.factor),
            ));
        }
        Ok(Recover {
            cfg,
            best: f64::INFINITY,
            scale: 1.0,
            failures: 0,
        })
    }

    /// Feeds the loss of the step just taken with drop ratio `theta`. A non-finite loss or
    /// one above `ratio ×` the running minimum answers [`Verdict::RollBack`] with
    /// `theta × factor` (and multiplies [`Recover::scale`] by `factor`); the failed loss does
    /// not enter the running minimum. Otherwise the minimum is updated.
    pub fn observe(&mut self, loss: f64, theta: f64) -> Verdict {
        let failed =
            !loss.is_finite() || (self.best.is_finite() && loss > self.cfg.ratio * self.best);
        if failed {
            self.failures += 1;
            self.scale *= self.cfg.factor;
            return Verdict::RollBack {
                new_theta: theta * self.cfg.factor,
            };
        }
        self.best = self.best.min(loss);
        Verdict::Continue
    }

    /// Running minimum of the accepted losses (`+∞` before the first).
    pub fn best(&self) -> f64 {
        self.best
    }

    /// Product of the reductions so far: multiply scheduled θ values by this.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Number of failures seen.
    pub fn failures(&self) -> u64 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<ThetaSchedule> {
        vec![
            ThetaSchedule::Constant { theta0: 0.9 },
            ThetaSchedule::Step {
                theta0: 0.9,
                gamma: 0.5,
                milestones: vec![3, 6, 9],
            },
            ThetaSchedule::Poly {
                theta0: 0.95,
                total_steps: 5000,
                power: 2.0,
            },
            ThetaSchedule::Poly {
                theta0: 0.5,
                total_steps: 10,
                power: 0.5,
            },
            ThetaSchedule::Inv {
                theta0: 0.99,
                tau: 100.0,
            },
        ]
    }

    #[test]
    fn schedules_are_non_increasing_and_stay_in_range() {
        for s in all() {
            s.validate().unwrap();
            let mut prev = f64::INFINITY;
            for step in 0..12_000u64 {
                let epoch = step / 1000;
                let t = s.theta(step, epoch);
                assert!((0.0..1.0).contains(&t), "{s:?} at {step}: {t}");
                assert!(t <= prev, "{s:?} increased at {step}: {prev} -> {t}");
                prev = t;
            }
        }
        let s = ThetaSchedule::Step {
            theta0: 0.8,
            gamma: 0.5,
            milestones: vec![2, 4],
        };
        assert_eq!(
            [0, 1, 2, 3, 4, 9].map(|e| s.theta(0, e)),
            [0.8, 0.8, 0.4, 0.4, 0.2, 0.2]
        );
        let p = ThetaSchedule::Poly {
            theta0: 0.9,
            total_steps: 100,
            power: 1.0,
        };
        assert!((p.theta(50, 0) - 0.45).abs() < 1e-12);
        assert_eq!(p.theta(100, 0), 0.0);
        assert_eq!(p.theta(1000, 0), 0.0);
        let i = ThetaSchedule::Inv {
            theta0: 0.9,
            tau: 10.0,
        };
        assert!((i.theta(10, 0) - 0.45).abs() < 1e-12);
    }

    #[test]
    fn invalid_parameters_are_rejected() {
        for bad in [
            ThetaSchedule::Constant { theta0: 1.0 },
            ThetaSchedule::Step {
                theta0: 0.5,
                gamma: 1.5,
                milestones: vec![],
            },
            ThetaSchedule::Poly {
                theta0: 0.5,
                total_steps: 0,
                power: 1.0,
            },
            ThetaSchedule::Inv {
                theta0: 0.5,
                tau: 0.0,
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let s: ThetaSchedule =
            toml::from_str("kind = \"poly\"\ntheta0 = 0.9\ntotal_steps = 10").unwrap();
        assert_eq!(
            s,
            ThetaSchedule::Poly {
                theta0: 0.9,
                total_steps: 10,
                power: 1.0
            }
        );
        assert!(
            toml::from_str::<ThetaSchedule>("kind = \"inv\"\ntheta0 = 0.9\ntau = 1\nx = 1")
                .is_err()
        );
    }

    /// Partial sums of Σ α_t √θ_t with α_t = t^−0.6, θ_t = θ₀/(1 + t/τ) (∝ 1/t): the tail
    /// behaves like Σ t^−1.1, so partial sums must level off, unlike Σ α_t alone.
    #[test]
    fn convergence_sum_is_finite_for_inv_schedule() {
        let s = ThetaSchedule::Inv {
            theta0: 0.9,
            tau: 1.0,
        };
        let partial = |upto: u64| -> (f64, f64) {
            let (mut a, mut b) = (0f64, 0f64);
            for t in 1..=upto {
                let alpha = (t as f64).powf(-0.6);
                a += alpha * s.theta(t, 0).sqrt();
                b += alpha;
            }
            (a, b)
        };
        let (s1, a1) = partial(100_000);
        let (s2, a2) = partial(1_000_000);
        // Σ α_t diverges: it grows by ≈ (1e6^0.4 − 1e5^0.4)/0.4 ≈ 378 over the same range.
        assert!(a2 - a1 > 300.0, "{a1} {a2}");
        // Σ α_t √θ_t: increment from 1e5 to 1e6 bounded by ∫ √0.9 t^−1.1 dt ≈ 10·√0.9·(1e5^−0.1 − 1e6^−0.1).
        let bound = 10.0 * 0.9f64.sqrt() * (1e5f64.powf(-0.1) - 1e6f64.powf(-0.1)) + 1e-3;
        assert!(s2 - s1 <= bound, "{s1} {s2} {bound}");
        // Upper bound of the whole series: 1 + ∫_1^∞ √0.9 t^−1.1 dt = 1 + 10√0.9.
        assert!(s2 < 1.0 + 10.0 * 0.9f64.sqrt());
    }

    #[test]
    fn recover_triggers_on_non_finite_and_on_ratio() {
        let mut r = Recover::new(RecoverConfig::default()).unwrap();
        assert_eq!(r.observe(2.0, 0.9), Verdict::Continue);
        assert_eq!(r.observe(1.0, 0.9), Verdict::Continue);
        assert_eq!(r.best(), 1.0);
        assert_eq!(r.observe(1.4, 0.9), Verdict::Continue); // 1.4 ≤ 1.5 × 1.0
        assert_eq!(r.best(), 1.0);
        assert_eq!(r.observe(1.6, 0.9), Verdict::RollBack { new_theta: 0.45 });
        assert_eq!(r.best(), 1.0, "a failed loss must not enter the minimum");
        assert_eq!(
            r.observe(f64::NAN, 0.45),
            Verdict::RollBack { new_theta: 0.225 }
        );
        assert_eq!(
            r.observe(f64::INFINITY, 0.225),
            Verdict::RollBack { new_theta: 0.1125 }
        );
        assert_eq!(r.failures(), 3);
        assert!((r.scale() - 0.125).abs() < 1e-15);
        // The running minimum keeps tracking after recovery.
        assert_eq!(r.observe(0.5, 0.1125), Verdict::Continue);
        assert_eq!(
            r.observe(0.76, 0.1125),
            Verdict::RollBack { new_theta: 0.05625 }
        );
        assert_eq!(r.observe(0.74, 0.05625), Verdict::Continue);
        // The first loss can only fail by being non-finite.
        let mut r = Recover::new(RecoverConfig::default()).unwrap();
        assert_eq!(r.observe(1e30, 0.9), Verdict::Continue);
        let mut r = Recover::new(RecoverConfig::default()).unwrap();
        assert!(matches!(r.observe(f64::NAN, 0.9), Verdict::RollBack { .. }));
        assert!(Recover::new(RecoverConfig {
            ratio: 0.9,
            factor: 0.5
        })
        .is_err());
        assert!(Recover::new(RecoverConfig {
            ratio: 1.5,
            factor: 1.0
        })
        .is_err());
    }
}
