//! Time to a target quality: the measure of the gradient-compression papers' speed-up
//! tables (the FFT paper's 2.26×, DGC's, …) is the training time to reach an accuracy, not
//! the time of one step.
//!
//! A [`Target`] is a metric and a threshold (`accuracy=0.7`, `perplexity=150`, `loss=0.3`).
//! For each run, its evaluations (`eval.jsonl`) are placed at the training time that led
//! to them — the sum of the step times before the evaluation's step, so evaluation time
//! itself is not counted — and the first crossing of the threshold is interpolated linearly
//! between the evaluation before it and the one that crossed ([`Reached`]). A run whose
//! first evaluation already crosses is placed at that evaluation (an upper bound: nothing
//! before it was measured).

use crate::error::{ReportError, Result};
use crate::run::Run;

/// Which evaluation metric a [`Target`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetMetric {
    /// Test accuracy, a fraction in (0, 1]: reached when at or above.
    Accuracy,
    /// Test perplexity (language models): reached when at or below.
    Perplexity,
    /// Test loss: reached when at or below.
    Loss,
}

/// A quality threshold (`--target METRIC=VALUE`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Target {
    /// The metric.
    pub metric: TargetMetric,
    /// The threshold.
    pub value: f64,
}

impl std::str::FromStr for Target {
    type Err = ReportError;

    /// `accuracy=0.7` (a fraction), `perplexity=150` or `loss=0.3`.
    fn from_str(s: &str) -> Result<Target> {
        let bad = |why: String| ReportError::Invalid(format!("--target {s:?}: {why}"));
        let (name, value) = s
            .split_once('=')
            .ok_or_else(|| bad("expected METRIC=VALUE, e.g. accuracy=0.7".into()))?;
        let value: f64 = value
            .trim()
            .parse()
            .map_err(|_| bad(format!("{value:?} is not a number")))?;
        let metric = match name.trim() {
            "accuracy" => TargetMetric::Accuracy,
            "perplexity" => TargetMetric::Perplexity,
            "loss" => TargetMetric::Loss,
            other => {
                return Err(bad(format!(
                    "unknown metric {other:?} (accuracy, perplexity, loss)"
                )))
            }
        };
        let ok = match metric {
            TargetMetric::Accuracy => value > 0.0 && value <= 1.0,
            TargetMetric::Perplexity => value.is_finite() && value >= 1.0,
            TargetMetric::Loss => value.is_finite() && value >= 0.0,
        };
        if !ok {
            return Err(bad(match metric {
                TargetMetric::Accuracy => "an accuracy is a fraction in (0, 1], e.g. 0.7".into(),
                TargetMetric::Perplexity => "a perplexity is at least 1".into(),
                TargetMetric::Loss => "a loss is a finite number >= 0".into(),
            }));
        }
        Ok(Target { metric, value })
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.metric {
            TargetMetric::Accuracy => write!(f, "test accuracy ≥ {:.2} %", self.value * 100.0),
            TargetMetric::Perplexity => write!(f, "test perplexity ≤ {}", self.value),
            TargetMetric::Loss => write!(f, "test loss ≤ {}", self.value),
        }
    }
}

/// Where a run reached a [`Target`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reached {
    /// Training seconds (the sum of step times) to the interpolated crossing.
    pub time_s: f64,
    /// Optimizer steps to the interpolated crossing.
    pub steps: f64,
    /// Whether the crossing is the run's first evaluation (an upper bound).
    pub first_eval: bool,
}

impl Target {
    /// The value of this target's metric in an evaluation, if recorded and finite.
    fn value_of(&self, e: &dtrain_records::EvalRecord) -> Option<f64> {
        match self.metric {
            TargetMetric::Accuracy => e.accuracy,
            TargetMetric::Perplexity => e.perplexity,
            TargetMetric::Loss => e.loss,
        }
        .filter(|v| v.is_finite())
    }

    fn met(&self, v: f64) -> bool {
        match self.metric {
            TargetMetric::Accuracy => v >= self.value,
            TargetMetric::Perplexity | TargetMetric::Loss => v <= self.value,
        }
    }

    /// Where `run` first reached the target (see the [module docs](self)); `None` when it
    /// never did.
    pub fn reached(&self, run: &Run) -> Option<Reached> {
        // Evaluations and steps are both ordered by step: one walk accumulates the time
        // before each evaluation.
        let (mut t, mut next) = (0.0, run.steps.iter().peekable());
        let mut prev: Option<(f64, f64, f64)> = None;
        for e in &run.evals {
            while let Some(s) = next.next_if(|s| s.step < e.step) {
                t += s.time.step_s;
            }
            let Some(v) = self.value_of(e) else {
                continue;
            };
            let here = (t, e.step as f64, v);
            if self.met(v) {
                return Some(match prev {
                    Some((t0, s0, v0)) if v != v0 => {
                        let f = ((self.value - v0) / (v - v0)).clamp(0.0, 1.0);
                        Reached {
                            time_s: t0 + f * (here.0 - t0),
                            steps: s0 + f * (here.1 - s0),
                            first_eval: false,
                        }
                    }
                    _ => Reached {
                        time_s: here.0,
                        steps: here.1,
                        first_eval: prev.is_none(),
                    },
                });
            }
            prev = Some(here);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dtrain_records::{EvalRecord, StepRecord};

    fn run_with(step_s: f64, evals: &[(u64, f64)]) -> Run {
        let mut r = Run {
            dir: "runs/t".into(),
            stamp: "t".into(),
            name: "t".into(),
            model: "mlp".into(),
            method: "none".into(),
            workers: 1,
            network: None,
            bucket_bytes: None,
            compress: toml::Table::new(),
            batch_size: None,
            summary: None,
            collective: None,
            steps: Vec::new(),
            evals: Vec::new(),
            notes: Vec::new(),
        };
        r.steps = (0..100)
            .map(|step| {
                let mut s = StepRecord {
                    step,
                    ..StepRecord::default()
                };
                s.time.step_s = step_s;
                s
            })
            .collect();
        r.evals = evals
            .iter()
            .map(|&(step, acc)| EvalRecord {
                step,
                accuracy: Some(acc),
                loss: Some(1.0 - acc),
                ..EvalRecord::default()
            })
            .collect();
        r
    }

    #[test]
    fn the_crossing_is_interpolated_between_evaluations() {
        // 0.5 s a step; evaluations after 20 steps (10 s) at 60 % and 40 steps (20 s) at
        // 80 %: 70 % is reached half-way, at 15 s and step 30.
        let r = run_with(0.5, &[(20, 0.6), (40, 0.8), (60, 0.9)]);
        let t: Target = "accuracy=0.7".parse().unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let got = t.reached(&r).unwrap();
        assert!(close(got.time_s, 15.0) && close(got.steps, 30.0) && !got.first_eval);
        // Exactly on an evaluation.
        let t: Target = "accuracy=0.8".parse().unwrap();
        assert!(close(t.reached(&r).unwrap().steps, 40.0));
        // A loss target reads downwards: loss = 1 − accuracy, 0.15 between 0.2 and 0.1.
        let t: Target = "loss=0.15".parse().unwrap();
        assert!(close(t.reached(&r).unwrap().steps, 50.0));
        // Never reached.
        let t: Target = "accuracy=0.95".parse().unwrap();
        assert_eq!(t.reached(&r), None);
        // Reached at the first evaluation: an upper bound.
        let t: Target = "accuracy=0.5".parse().unwrap();
        let got = t.reached(&r).unwrap();
        assert!(got.first_eval && got.time_s == 10.0);
        // No perplexity recorded: never reached.
        let t: Target = "perplexity=10".parse().unwrap();
        assert_eq!(t.reached(&r), None);
    }

    #[test]
    fn bad_targets_say_why() {
        for (s, want) in [
            ("accuracy", "METRIC=VALUE"),
            ("accuracy=70", "fraction"),
            ("accuracy=x", "not a number"),
            ("bleu=20", "unknown metric"),
            ("perplexity=0.5", "at least 1"),
            ("loss=-1", ">= 0"),
        ] {
            let e = s.parse::<Target>().unwrap_err().to_string();
            assert!(e.contains(want), "{s}: {e}");
        }
        assert_eq!(
            "accuracy=0.7".parse::<Target>().unwrap().to_string(),
            "test accuracy ≥ 70.00 %"
        );
    }
}
