//! The run's records: `metrics.jsonl`, `eval.jsonl`, `summary.json`.

use std::io::Write;

use dtrain_comms::Transport;
use dtrain_compress::Collective;
use dtrain_records::{EvalRecord, Phases, StepRecord, Summary};
use serde::Serialize;

use super::{RunDir, TrainError, Trainer};
use crate::checkpoint;

impl<T: Transport> Trainer<T> {
    pub(super) fn open_logs(&mut self) -> Result<(), TrainError> {
        if self.rank != 0 {
            return Ok(());
        }
        if let Some(out) = &self.out {
            if let Some(start) = self.resumed_step {
                // Resumed: records the previous session wrote after this checkpoint (it
                // failed or was stopped later) are of steps this session runs again. (The
                // checkpoint's step counts the steps of the run that wrote it: on another
                // worker count the session goes on from another step number.)
                trim_records(out, start, true)?;
            }
            let open = |name: &str| open_log(out, name);
            self.metrics_file = Some(open("metrics.jsonl")?);
            self.eval_file = Some(open("eval.jsonl")?);
            if self.plan.config.output.tensorboard {
                let io = |source| TrainError::Io {
                    path: out.root.display().to_string(),
                    source,
                };
                let mut tb = crate::tensorboard::EventWriter::create(&out.root).map_err(io)?;
                if let Some(start) = self.resumed_step {
                    // TensorBoard drops every point at `start` and after; the evaluation at
                    // `start` (of the checkpoint's state) stays in eval.jsonl, so it is
                    // written again.
                    tb.session_start(start).map_err(io)?;
                    let evals =
                        std::fs::read_to_string(out.root.join("eval.jsonl")).unwrap_or_default();
                    for e in evals
                        .lines()
                        .filter_map(|l| serde_json::from_str::<EvalRecord>(l).ok())
                        .filter(|e| e.step == start)
                    {
                        tb.eval(&e).map_err(io)?;
                    }
                }
                let config = self.plan.config.to_toml();
                // The text plugin renders markdown: the TOML as a code block.
                tb.text(self.step, "config", &format!("```toml\n{config}```"))
                    .map_err(io)?;
                self.tensorboard = Some(tb);
            }
        }
        Ok(())
    }

    /// Writes a step's or an evaluation's scalars to the TensorBoard event file, if open.
    pub(super) fn log_tensorboard(
        &mut self,
        write: impl FnOnce(&mut crate::tensorboard::EventWriter) -> std::io::Result<()>,
    ) -> Result<(), TrainError> {
        if let Some(tb) = &mut self.tensorboard {
            write(tb).map_err(|source| TrainError::Io {
                path: tb.path().display().to_string(),
                source,
            })?;
        }
        Ok(())
    }

    /// Appends `v` as one JSON line to `file` (opened only on rank 0 with a run directory).
    pub(super) fn log_line<S: Serialize>(
        file: &mut Option<std::fs::File>,
        out: Option<&RunDir>,
        name: &str,
        v: &S,
    ) -> Result<(), TrainError> {
        if let Some(f) = file {
            let mut line = serde_json::to_string(v).unwrap_or_default();
            line.push('\n');
            f.write_all(line.as_bytes())
                .map_err(|source| TrainError::Io {
                    path: out
                        .map_or_else(|| name.into(), |o| o.root.join(name).display().to_string()),
                    source,
                })?;
        }
        Ok(())
    }
}

/// Opens `name` of the run directory `out` for appending records (created if missing).
pub(super) fn open_log(out: &RunDir, name: &str) -> Result<std::fs::File, TrainError> {
    let p = out.root.join(name);
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&p)
        .map_err(|source| TrainError::Io {
            path: p.display().to_string(),
            source,
        })
}

/// Drops the records of the steps from `start` on (they are run again) from the run's
/// `metrics.jsonl`, and from its `eval.jsonl` those after `start` (the evaluation at
/// `start` is of the state the run goes on from), and the one at `start` too unless
/// `keep_eval_at_start` (it is made again).
pub(super) fn trim_records(
    out: &RunDir,
    start: u64,
    keep_eval_at_start: bool,
) -> Result<(), TrainError> {
    let eval_kept = move |s: u64| s < start || (keep_eval_at_start && s == start);
    for (name, keep) in [
        (
            "metrics.jsonl",
            &(|s: u64| s < start) as &dyn Fn(u64) -> bool,
        ),
        ("eval.jsonl", &eval_kept),
    ] {
        let p = out.root.join(name);
        trim_log(&p, keep).map_err(|source| TrainError::Io {
            path: p.display().to_string(),
            source,
        })?;
    }
    Ok(())
}

/// Keeps the records of the JSON-lines file at `path` whose `step` passes `keep` (and any
/// line without a readable step, except a cut last line, which a killed writer leaves),
/// rewriting the file atomically when anything goes. A missing file is left missing.
pub(super) fn trim_log(path: &std::path::Path, keep: &dyn Fn(u64) -> bool) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let cut = !text.is_empty() && !text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::with_capacity(text.len());
    let mut dropped = false;
    for (i, line) in lines.iter().enumerate() {
        let step = serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v.get("step").and_then(|s| s.as_u64()));
        let last_cut = cut && i + 1 == lines.len();
        if last_cut || step.is_some_and(|s| !keep(s)) {
            dropped = true;
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    if dropped {
        checkpoint::write_atomic(path, out.as_bytes()).map_err(|e| match e {
            checkpoint::CheckpointError::Io { source, .. } => source,
            other => std::io::Error::other(other.to_string()),
        })?;
    }
    Ok(())
}

/// The step of the last readable record of the JSON-lines file at `path` (`None` when it
/// is missing or has none).
pub(super) fn last_step(path: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .lines()
        .rev()
        .find_map(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
        })
}

/// What a session's steps add up to, for `summary.json`.
pub(super) struct Tally {
    /// The step the session started at.
    session_start: u64,
    /// Phase times of the timed steps (the session's first is warm-up).
    sum: Phases,
    timed: u64,
    bytes: f64,
    /// The most bytes sent in one step.
    peak: u64,
    payload: f64,
    /// DLCP: sum of per-step dropped fractions, steps.
    lossy: (f64, u64),
    samples: u64,
    /// Per rank, the steps it was the slowest.
    slowest: Vec<u64>,
    /// The current epoch's loss sum and steps.
    epoch_loss: (f64, u64),
}

impl Tally {
    /// An empty tally of a session starting at `session_start`.
    pub(super) fn new(session_start: u64) -> Self {
        Tally {
            session_start,
            sum: Phases::default(),
            timed: 0,
            bytes: 0.0,
            peak: 0,
            payload: 0.0,
            lossy: (0.0, 0),
            samples: 0,
            slowest: Vec::new(),
            epoch_loss: (0.0, 0),
        }
    }

    /// A new epoch starts (the final training loss is the last epoch's).
    pub(super) fn new_epoch(&mut self) {
        self.epoch_loss = (0.0, 0);
    }

    /// Adds the record of a finished step of a `world`-rank run.
    pub(super) fn add(&mut self, r: &StepRecord, world: usize) {
        if r.step > self.session_start {
            self.sum.add(&r.time);
            self.timed += 1;
        }
        self.bytes += r.bytes_sent as f64;
        self.peak = self.peak.max(r.bytes_sent);
        self.payload += r.payload_bytes as f64;
        if let Some(d) = r.lossy_dropped {
            self.lossy.0 += d;
            self.lossy.1 += 1;
        }
        self.samples += r.samples;
        if let Some(k) = r.slowest_rank {
            self.slowest.resize(world, 0u64);
            self.slowest[k] += 1;
        }
        // A non-finite loss (a skipped step) makes the epoch's mean non-finite.
        self.epoch_loss.0 += r.loss.unwrap_or(f64::NAN);
        self.epoch_loss.1 += 1;
    }
}

impl<T: Transport> Trainer<T> {
    /// The summary of a session that tallied `t` in `wall` seconds; rank 0 writes it to
    /// `summary.json`. A session that trained nothing (resumed at the end) keeps the
    /// finished run's figures (bytes, step times, wall time) and only brings the new
    /// evaluation.
    pub(super) fn finish_summary(&self, t: Tally, wall: f64) -> Result<Summary, TrainError> {
        let session_start = t.session_start;
        let n_session = self.step - session_start;
        let mean = if t.timed > 0 {
            t.sum.scaled(1.0 / t.timed as f64)
        } else {
            t.sum
        };
        let per = |x: f64| {
            if n_session > 0 {
                x / n_session as f64
            } else {
                0.0
            }
        };
        let payload_per_step = per(t.payload);
        let params = self.num_params() as u64;
        let (collective, bucket_collectives) = self.sync.collectives();
        let summary = Summary {
            name: Some(self.plan.config.name.clone()),
            model: Some(self.plan.config.model.kind().to_string()),
            method: Some(self.plan.method.name().to_string()),
            // The configured count: under live membership the group may have shrunk
            // (`membership` says when).
            workers: Some(self.plan.config.cluster.workers),
            steps: Some(self.step),
            steps_this_session: Some(n_session),
            resumed_from: Some(session_start),
            final_eval: self.evals.last().cloned(),
            final_train_loss: (t.epoch_loss.1 > 0).then(|| t.epoch_loss.0 / t.epoch_loss.1 as f64),
            mean_step: Some(mean),
            bytes_sent_per_step: Some(per(t.bytes)),
            bytes_sent_peak: Some(t.peak),
            payload_bytes_per_step: Some(payload_per_step),
            params: Some(params),
            compression_ratio: Some(if payload_per_step > 0.0 {
                4.0 * params as f64 / payload_per_step
            } else {
                0.0
            }),
            samples_per_s: Some(if wall > 0.0 {
                t.samples as f64 / wall
            } else {
                0.0
            }),
            wall_s: Some(wall),
            skipped_steps: Some(self.skipped),
            recoveries: Some(self.recoveries),
            theta_scale: Some(self.sync.theta_scale()),
            lossy_dropped: (self.plan.dlcp.is_some() && t.lossy.1 > 0)
                .then(|| t.lossy.0 / t.lossy.1 as f64),
            slowest_rank_steps: (!t.slowest.is_empty()).then_some(t.slowest),
            collective: Some(collective.name().to_string()),
            bucket_collectives: (!bucket_collectives.is_empty()).then(|| {
                bucket_collectives
                    .iter()
                    .map(|c| c.name().to_string())
                    .collect()
            }),
            sync: self
                .plan
                .config
                .sync
                .period()
                .map(|_| self.plan.config.sync.name().to_string()),
            sync_period: self.plan.config.sync.period(),
            sync_overlap: match self.plan.config.sync {
                crate::config::SyncConfig::StreamingDiloco { overlap, .. } => Some(overlap),
                _ => None,
            },
            sync_fragments: match self.plan.config.sync {
                crate::config::SyncConfig::StreamingDiloco { fragments, .. } => Some(fragments),
                _ => None,
            },
            compressed_optimizer: self
                .plan
                .config
                .train
                .optimizer
                .is_compressed()
                .then(|| self.plan.config.train.optimizer.name().to_string()),
            hosts: self.hosts.filter(|_| {
                bucket_collectives.contains(&Collective::HierarchicalAllReduce)
                    || collective == Collective::HierarchicalAllReduce
            }),
            codec_device: self.codec_device.clone(),
            // The launcher adds the restarts it made (`dtrain run --max-restarts`).
            restarts: None,
            membership: self
                .live
                .as_ref()
                .map(|l| l.changes.clone())
                .filter(|c| !c.is_empty()),
            provenance: Some(crate::provenance::provenance(
                std::time::SystemTime::now()
                    .checked_sub(std::time::Duration::from_secs_f64(wall.max(0.0)))
                    .unwrap_or_else(std::time::SystemTime::now),
            )),
        };
        let summary = match (&self.out, n_session) {
            (Some(out), 0) => match std::fs::read(out.root.join("summary.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<Summary>(&b).ok())
            {
                Some(old) => Summary {
                    final_eval: summary.final_eval.or(old.final_eval),
                    steps_this_session: Some(0),
                    resumed_from: Some(session_start),
                    ..old
                },
                None => summary,
            },
            _ => summary,
        };
        if self.rank == 0 {
            if let Some(out) = &self.out {
                let p = out.root.join("summary.json");
                let text = serde_json::to_string_pretty(&summary).unwrap_or_default();
                checkpoint::write_atomic(&p, text.as_bytes())?;
            }
        }
        Ok(summary)
    }
}

#[cfg(test)]
mod tests {
    use super::trim_log;

    #[test]
    fn a_resumed_log_loses_the_steps_run_again_and_a_cut_line_only() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("metrics.jsonl");
        std::fs::write(
            &p,
            "{\"step\":0}\n{\"step\":1}\nnot json\n{\"step\":2}\n{\"step\":3}\n{\"step\":4,\"lo",
        )
        .unwrap();
        trim_log(&p, &|s| s < 2).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "{\"step\":0}\n{\"step\":1}\nnot json\n"
        );
        // Nothing to drop: the file is left as it is; a missing one stays missing.
        trim_log(&p, &|s| s < 2).unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap().lines().count(), 3);
        let gone = dir.path().join("eval.jsonl");
        trim_log(&gone, &|_| true).unwrap();
        assert!(!gone.exists());
    }
}
