//! The run loop: steps, evaluations, checkpoints, the summary.

use std::time::Instant;

use dtrain_comms::Transport;
use dtrain_models::pool::on_pool_for;
use dtrain_models::Metrics;

use super::metrics::Tally;
use super::step::StepOutcome;
use super::{EvalRecord, Observer, Summary, TrainError, Trainer};
use crate::config::NonFinitePolicy;

impl<T: Transport> Trainer<T> {
    /// Runs to the end of the plan (from the current step) and returns the summary (rank 0
    /// also writes `summary.json`).
    pub fn run(&mut self, obs: &mut dyn Observer) -> Result<Summary, TrainError> {
        self.open_logs()?;
        let per_epoch = self.plan.steps_per_epoch;
        let total = self.plan.total_steps;
        obs.on_rank(self.rank, self.step);
        obs.on_start(self.step, total, per_epoch);
        for note in std::mem::take(&mut self.notes) {
            obs.on_message(&note);
        }
        // Taken once: a `take()` inside the `if let` tuple below emptied the note before the
        // `else` branch looked, so a fresh run never printed its choice.
        let auto_note = self.auto_note.take();
        if let (Some(step), Some(_)) = (self.resumed_step, &auto_note) {
            // The checkpoint's routes replaced what the set-up measured.
            let (_, per_bucket) = self.sync.collectives();
            let names: Vec<&str> = per_bucket.iter().map(|c| c.name()).collect();
            obs.on_message(&format!(
                "compress.collective = \"auto\": the routes of the checkpoint at step {step}: {}",
                if names.is_empty() {
                    self.sync.collectives().0.name().to_string()
                } else {
                    names.join(", ")
                }
            ));
        } else if let Some(note) = auto_note {
            obs.on_message(&note);
        }
        let t_start = Instant::now();
        self.live_session(t_start);
        let session_start = self.step;
        let mut tally = Tally::new(session_start);
        let policy = self.plan.config.failure.non_finite;
        if policy == NonFinitePolicy::Recover && self.last_checkpoint.is_none() {
            // A rollback target from the very start.
            self.save_checkpoint()?;
        }
        // The evaluation and checkpoint due after the step just finished are yet to be made.
        let mut post_pending = false;
        loop {
            if post_pending {
                if let Err(e) = self.after_step(obs) {
                    // Under live membership, a lost worker: the others make them again
                    // where any of them had not finished them.
                    post_pending = self.survive(e, obs, true)?;
                    continue;
                }
                post_pending = false;
            }
            if self.step >= total {
                break;
            }
            if self.stopping.is_none() && !self.sync.lockstep() {
                // Asynchronous parameter server: no control all-reduce to agree in.
                self.stopping = self.stop.as_ref().and_then(|s| s.signal());
            }
            if let Some(signal) = self.stopping {
                return self.stop_here(signal, obs);
            }
            let step = self.step;
            let epoch = step / per_epoch;
            let j = (step % per_epoch) as usize;
            if j == 0 {
                tally.new_epoch();
            }
            let keep_s = self.begin_step()?;
            if let Err(e) = self.admit_newcomers(obs) {
                // A member (or the newcomer) lost while admitting: as in a step.
                post_pending = self.survive(e, obs, false)?;
                continue;
            }
            let rec = match self.train_step(epoch, j, false) {
                Ok(rec) => rec,
                Err(e) => {
                    // Under live membership, a lost worker: the others go on without it
                    // (from this step, the next, or a kept one). Any other error is returned.
                    post_pending = self.survive(e, obs, false)?;
                    continue;
                }
            };
            match rec {
                StepOutcome::Done(mut r) => {
                    // The copy of the state is part of what the step cost.
                    r.time.keep_s = keep_s;
                    r.time.step_s += keep_s;
                    self.adapt_deadline(r.time.step_s);
                    tally.add(&r, self.world);
                    if step.is_multiple_of(self.plan.config.output.log_every.max(1)) {
                        Self::log_line(
                            &mut self.metrics_file,
                            self.out.as_ref(),
                            "metrics.jsonl",
                            &r,
                        )?;
                        self.log_tensorboard(|tb| tb.step(&r))?;
                        self.keep_record(&r);
                    }
                    obs.on_step(&r);
                }
                StepOutcome::RolledBack => {
                    obs.on_message(&format!(
                        "step {step}: rolled back to step {} (recover policy, θ scale {:.3})",
                        self.step,
                        self.sync.theta_scale()
                    ));
                    continue;
                }
            }
            self.step += 1;
            post_pending = true;
        }
        if session_start == total && total > 0 {
            // Resumed at the end: a finished run is re-evaluated (e.g. with a larger
            // `data.test_limit`); its training is not repeated.
            self.evaluate_and_log(total / per_epoch, obs)?;
        }
        // Leave the synchronisation (a parameter server keeps serving the others until they
        // leave too).
        self.finish_sync()?;
        let wall = t_start.elapsed().as_secs_f64();
        self.finish_summary(tally, wall)
    }

    /// After a step: the evaluation and the checkpoint due at the step count reached.
    fn after_step(&mut self, obs: &mut dyn Observer) -> Result<(), TrainError> {
        let per_epoch = self.plan.steps_per_epoch;
        let done_epoch = self.step.is_multiple_of(per_epoch);
        let epochs_done = self.step / per_epoch;
        let last = self.step == self.plan.total_steps;
        let eval_every = self.plan.config.train.eval_every_epochs;
        let by_steps = self
            .plan
            .config
            .train
            .eval_every_steps
            .is_some_and(|n| self.step.is_multiple_of(n));
        if (done_epoch && eval_every > 0 && epochs_done.is_multiple_of(eval_every))
            || last
            || by_steps
        {
            self.evaluate_and_log(epochs_done, obs)?;
        }
        let ck = &self.plan.config.checkpoint;
        let by_steps = ck
            .every_steps
            .is_some_and(|n| n > 0 && self.step.is_multiple_of(n));
        let by_epochs = done_epoch
            && ck
                .every_epochs
                .is_some_and(|n| n > 0 && epochs_done.is_multiple_of(n));
        if by_steps || by_epochs || (last && self.out.is_some()) {
            if let Some(d) = self.save_checkpoint()? {
                obs.on_message(&format!("checkpoint {}", d.display()));
            }
        }
        Ok(())
    }

    /// Ends the run after a stop request (see [`Trainer::stop_on`]): a checkpoint of the
    /// current step (unless one was just written), then [`TrainError::Stopped`].
    fn stop_here(&mut self, signal: i32, obs: &mut dyn Observer) -> Result<Summary, TrainError> {
        let step = self.step;
        let checkpoint = if !self.sync.lockstep() {
            // The ranks did not agree on a step: a checkpoint's barrier would not match.
            None
        } else if self
            .last_checkpoint
            .as_deref()
            .and_then(super::checkpoint_step)
            == Some(step)
        {
            self.last_checkpoint.clone()
        } else {
            self.save_checkpoint()?
        };
        obs.on_message(&format!(
            "{} received: stopping after step {step}{}",
            crate::signals::signal_name(signal),
            checkpoint
                .as_ref()
                .map(|c| format!(", checkpoint {}", c.display()))
                .unwrap_or_default()
        ));
        Err(TrainError::Stopped {
            step,
            signal,
            checkpoint,
        })
    }

    /// Evaluates ([`Trainer::evaluate`]), logs the record to `eval.jsonl` and the observer,
    /// and keeps it.
    fn evaluate_and_log(
        &mut self,
        epochs_done: u64,
        obs: &mut dyn Observer,
    ) -> Result<(), TrainError> {
        let e = self.evaluate(epochs_done)?;
        Self::log_line(&mut self.eval_file, self.out.as_ref(), "eval.jsonl", &e)?;
        self.log_tensorboard(|tb| tb.eval(&e))?;
        obs.on_eval(&e);
        self.evals.push(e);
        Ok(())
    }

    /// Evaluates on this rank's part of the test set, with BatchNorm running statistics
    /// averaged over the workers first; the result is the global one on every rank.
    pub fn evaluate(&mut self, epochs_done: u64) -> Result<EvalRecord, TrainError> {
        self.drain()?;
        let step = self.step;
        if !self.buffers.is_empty() {
            self.model.read_buffers(&mut self.buffers);
            self.comm
                .all_reduce_sum(&mut self.buffers)
                .map_err(|source| TrainError::Comm { step, source })?;
            let inv = 1.0 / self.world as f32;
            for b in self.buffers.iter_mut() {
                *b *= inv;
            }
            self.model.write_buffers(&self.buffers);
        }
        // Between a periodic synchronisation's rounds the replicas differ: evaluate their
        // average, then go on training this rank's own parameters.
        let own = match self
            .sync
            .consensus(&mut self.comm, self.model.as_ref())
            .map_err(|e| self.step_error(e))?
        {
            Some(avg) => {
                let own = self.params();
                self.model.write_params(&avg);
                Some(own)
            }
            None => None,
        };
        let device = self.model.device().clone();
        let mut m = Metrics::default();
        self.model.reset_eval_state();
        for j in 0..self.data.eval_batches() {
            let b = self.data.eval_batch(j, &device);
            let model = &mut self.model;
            let r = on_pool_for(&device, || model.evaluate(b))
                .map_err(|source| TrainError::Model { step, source })?;
            m.merge(&r);
        }
        if let Some(own) = own {
            self.model.write_params(&own);
        }
        let mut v = [
            (m.loss * m.count as f64) as f32,
            m.correct as f32,
            m.count as f32,
        ];
        self.comm
            .all_reduce_sum(&mut v)
            .map_err(|source| TrainError::Comm { step, source })?;
        let count = v[2].max(1.0) as f64;
        let loss = v[0] as f64 / count;
        Ok(EvalRecord {
            epoch: epochs_done,
            step,
            loss: Some(loss),
            accuracy: Some(v[1] as f64 / count),
            // A perplexity only means something for a language model; +∞ when the loss
            // overflows it (records keep it, see dtrain_records::float).
            perplexity: self.plan.config.data.kind.is_text().then(|| loss.exp()),
            count: v[2] as u64,
        })
    }
}
