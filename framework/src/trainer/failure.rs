//! The failure policy for non-finite losses and gradients (`[failure]`): abort, skip, or
//! roll back to the last checkpoint with a lower θ.

use std::time::Instant;

use dtrain_comms::Transport;

use super::step::StepOutcome;
use super::{StepRecord, TrainError, Trainer};
use crate::config::NonFinitePolicy;

impl<T: Transport> Trainer<T> {
    pub(super) fn bad_step(
        &mut self,
        what: &'static str,
        mut record: StepRecord,
        t0: Instant,
    ) -> Result<StepOutcome, TrainError> {
        let step = self.step;
        let f = &self.plan.config.failure;
        let ck = self
            .last_checkpoint
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "none".into());
        self.consecutive_bad += 1;
        if self.consecutive_bad > f.max_skips && f.non_finite != NonFinitePolicy::Abort {
            return Err(TrainError::NonFinite {
                step,
                what,
                policy: format!(
                    "{} consecutive bad steps exceed failure.max_skips",
                    self.consecutive_bad
                ),
                checkpoint: ck,
            });
        }
        match f.non_finite {
            NonFinitePolicy::Abort => Err(TrainError::NonFinite {
                step,
                what,
                policy: "failure.non_finite = \"abort\"".into(),
                checkpoint: ck,
            }),
            NonFinitePolicy::Skip => {
                self.skipped += 1;
                record.skipped = true;
                record.time.step_s = t0.elapsed().as_secs_f64();
                Ok(StepOutcome::Done(Box::new(record)))
            }
            NonFinitePolicy::Recover => {
                if self.recoveries >= f.max_recoveries {
                    return Err(TrainError::NonFinite {
                        step,
                        what,
                        policy: format!(
                            "{} rollbacks reached failure.max_recoveries",
                            self.recoveries
                        ),
                        checkpoint: ck,
                    });
                }
                let Some(dir) = self.last_checkpoint.clone() else {
                    return Err(TrainError::NonFinite {
                        step,
                        what,
                        policy: "recover found no checkpoint to roll back to".into(),
                        checkpoint: ck,
                    });
                };
                let recoveries = self.recoveries + 1;
                let bad = self.consecutive_bad;
                let factor = f.theta_factor;
                let scale = self.sync.theta_scale() * factor;
                self.resume_from(&dir)?;
                self.recoveries = recoveries;
                self.consecutive_bad = bad;
                // The checkpoint restored the old scale; lower θ below it.
                let restored = self.sync.theta_scale();
                if restored > 0.0 {
                    self.sync.scale_theta(scale / restored);
                }
                Ok(StepOutcome::RolledBack)
            }
        }
    }
}
