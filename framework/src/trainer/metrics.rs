//! The run's records: `metrics.jsonl`, `eval.jsonl`, `summary.json`.

use std::io::Write;

use dtrain_comms::Transport;
use dtrain_compress::Collective;
use serde::{Deserialize, Serialize};

use super::{RunDir, TrainError, Trainer};
use crate::checkpoint;

/// Seconds per phase of one step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Phases {
    /// Building the batch (host data → tensors).
    pub data_s: f64,
    /// Forward pass and loss.
    pub forward_s: f64,
    /// Backward pass and gradient extraction into the flat buffer.
    pub backward_s: f64,
    /// Compensate + compress (and the own-payload decode for error feedback).
    pub compress_s: f64,
    /// Inside collectives (gradient exchange and the control all-reduce).
    pub communicate_s: f64,
    /// Decoding, summing, averaging.
    pub decompress_s: f64,
    /// Time the step waited on gradient communication that compression / decompression of
    /// other buckets did not hide (with overlap; equal to the exchange's share of
    /// `communicate_s` without).
    #[serde(default)]
    pub wait_s: f64,
    /// The part of `communicate_s` spent in the step's control all-reduce, right after the
    /// backward pass. A rank waits there until the slowest rank has finished its backward,
    /// so this is mostly load imbalance and jitter between ranks (the call itself is a few
    /// floats); 0 where there is no lock-step control all-reduce (asynchronous PS).
    #[serde(default)]
    pub sync_s: f64,
    /// Optimizer update and writing the parameters back into the model.
    pub optimizer_s: f64,
    /// The whole step, wall clock.
    pub step_s: f64,
}

impl Phases {
    pub(super) fn add(&mut self, o: &Phases) {
        self.data_s += o.data_s;
        self.forward_s += o.forward_s;
        self.backward_s += o.backward_s;
        self.compress_s += o.compress_s;
        self.communicate_s += o.communicate_s;
        self.decompress_s += o.decompress_s;
        self.wait_s += o.wait_s;
        self.sync_s += o.sync_s;
        self.optimizer_s += o.optimizer_s;
        self.step_s += o.step_s;
    }

    pub(super) fn scaled(&self, k: f64) -> Phases {
        Phases {
            data_s: self.data_s * k,
            forward_s: self.forward_s * k,
            backward_s: self.backward_s * k,
            compress_s: self.compress_s * k,
            communicate_s: self.communicate_s * k,
            decompress_s: self.decompress_s * k,
            wait_s: self.wait_s * k,
            sync_s: self.sync_s * k,
            optimizer_s: self.optimizer_s * k,
            step_s: self.step_s * k,
        }
    }
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Global step (0-based) of this update.
    pub step: u64,
    /// Epoch (0-based).
    pub epoch: u64,
    /// Mean training loss over all ranks' batches.
    pub loss: f64,
    /// Training accuracy over all ranks' batches.
    pub accuracy: f64,
    /// Learning rate used.
    pub lr: f64,
    /// The method's knob this step (`theta`, `density`), if it has one.
    pub ratio_name: Option<String>,
    /// Its value.
    pub ratio: Option<f64>,
    /// Bytes this rank sent (transport-level, framing included).
    pub bytes_sent: u64,
    /// Bytes this rank received.
    pub bytes_received: u64,
    /// Bytes of this rank's compressed payloads.
    pub payload_bytes: u64,
    /// Whether the update was skipped (non-finite under `skip`).
    pub skipped: bool,
    /// Examples processed by all ranks this step.
    pub samples: u64,
    /// Per-phase times of this rank.
    pub time: Phases,
    /// DLCP (`compress.collective = "dlcp"`): fraction of all workers' gradient elements the
    /// bounded-loss all-reduce completed without, this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lossy_dropped: Option<f64>,
    /// DLCP: packets this rank retransmitted this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retransmitted: Option<u64>,
    /// Parameter-server mode: seconds this rank's server spent aggregating this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_s: Option<f64>,
    /// The rank whose local work since it left the previous step's gradient exchange
    /// (optimizer, logging, data, forward, backward) took longest. Ranks leave a collective
    /// nearly together (a wake-up apart), so this is the rank that reached the step's
    /// control all-reduce last: the one the others waited for in [`Phases::sync_s`]. Every
    /// rank's time travels in the control all-reduce (one float per rank). Absent with one
    /// worker and in the asynchronous PS mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slowest_rank: Option<usize>,
    /// How much longer the slowest rank's local work took than this rank's: the part of
    /// `sync_s` that is load imbalance or jitter rather than the call itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub behind_slowest_s: Option<f64>,
}

/// One line of `eval.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    /// Epochs completed.
    pub epoch: u64,
    /// Steps completed.
    pub step: u64,
    /// Mean test loss.
    pub loss: f64,
    /// Test accuracy (top-1; tokens for language models).
    pub accuracy: f64,
    /// Test perplexity `exp(loss)`.
    pub perplexity: f64,
    /// Examples (or tokens) scored.
    pub count: u64,
}

/// `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Run name.
    pub name: String,
    /// Model kind.
    pub model: String,
    /// Compression method.
    pub method: String,
    /// Workers.
    pub workers: usize,
    /// Steps completed (in total, including those before a resume).
    pub steps: u64,
    /// Steps run by this process (after a resume: since the resume).
    pub steps_this_session: u64,
    /// The step this session started at (0 unless resumed).
    pub resumed_from: u64,
    /// Final evaluation, if any.
    pub final_eval: Option<EvalRecord>,
    /// Mean training loss of the last epoch's steps (this session).
    pub final_train_loss: Option<f64>,
    /// Mean per-phase times per step, excluding the first step of the session (warm-up).
    pub mean_step: Phases,
    /// Mean bytes sent per step by rank 0.
    pub bytes_sent_per_step: f64,
    /// Mean payload bytes per step by rank 0.
    pub payload_bytes_per_step: f64,
    /// Model parameters.
    pub params: u64,
    /// `4·params / payload bytes per step`.
    pub compression_ratio: f64,
    /// Training throughput, examples per second over all workers.
    pub samples_per_s: f64,
    /// Wall time of this session in seconds.
    pub wall_s: f64,
    /// Steps skipped for non-finite values.
    pub skipped_steps: u64,
    /// Rollbacks of the recover policy.
    pub recoveries: u64,
    /// The factor applied to θ by the recover policy (1 = never lowered).
    pub theta_scale: f64,
    /// DLCP: mean fraction of the gradient dropped per step (absent without DLCP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lossy_dropped: Option<f64>,
    /// Per rank, the steps of this session in which it was the slowest to reach the
    /// control all-reduce ([`StepRecord::slowest_rank`]); empty where that is not measured
    /// (one worker, asynchronous PS). A rank far above `1/workers` is a straggler.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slowest_rank_steps: Vec<u64>,
    /// The collective that carried the run's compressed buckets (with no compressed bucket,
    /// the one of the dense buckets; with `mode = "ps"`, the parameter server): what `dtrain
    /// simulate` models. `None` in runs written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collective: Option<Collective>,
    /// Each bucket's collective, in bucket order, when they differ from one another (a
    /// compressed run's small dense buckets go through the dense all-reduce); empty when
    /// every bucket used [`Summary::collective`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bucket_collectives: Vec<Collective>,
}
impl<T: Transport> Trainer<T> {
    pub(super) fn open_logs(&mut self) -> Result<(), TrainError> {
        if self.rank != 0 {
            return Ok(());
        }
        if let Some(out) = &self.out {
            let open = |name: &str| {
                let p = out.root.join(name);
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&p)
                    .map_err(|source| TrainError::Io {
                        path: p.display().to_string(),
                        source,
                    })
            };
            self.metrics_file = Some(open("metrics.jsonl")?);
            self.eval_file = Some(open("eval.jsonl")?);
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

/// What a session's steps add up to, for `summary.json`.
pub(super) struct Tally {
    /// The step the session started at.
    session_start: u64,
    /// Phase times of the timed steps (the session's first is warm-up).
    sum: Phases,
    timed: u64,
    bytes: f64,
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
        self.epoch_loss.0 += r.loss;
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
            name: self.plan.config.name.clone(),
            model: self.plan.config.model.kind().to_string(),
            method: self.plan.method.name().to_string(),
            workers: self.world,
            steps: self.step,
            steps_this_session: n_session,
            resumed_from: session_start,
            final_eval: self.evals.last().cloned(),
            final_train_loss: (t.epoch_loss.1 > 0).then(|| t.epoch_loss.0 / t.epoch_loss.1 as f64),
            mean_step: mean,
            bytes_sent_per_step: per(t.bytes),
            payload_bytes_per_step: payload_per_step,
            params,
            compression_ratio: if payload_per_step > 0.0 {
                4.0 * params as f64 / payload_per_step
            } else {
                0.0
            },
            samples_per_s: if wall > 0.0 {
                t.samples as f64 / wall
            } else {
                0.0
            },
            wall_s: wall,
            skipped_steps: self.skipped,
            recoveries: self.recoveries,
            theta_scale: self.sync.theta_scale(),
            lossy_dropped: (self.plan.dlcp.is_some() && t.lossy.1 > 0)
                .then(|| t.lossy.0 / t.lossy.1 as f64),
            slowest_rank_steps: t.slowest,
            collective: Some(collective),
            bucket_collectives,
        };
        let summary = match (&self.out, n_session) {
            (Some(out), 0) => match std::fs::read(out.root.join("summary.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<Summary>(&b).ok())
            {
                Some(old) => Summary {
                    final_eval: summary.final_eval.or(old.final_eval),
                    steps_this_session: 0,
                    resumed_from: session_start,
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
