//! # dtrain-records
//!
//! The records of a run directory, defined once: the trainer writes them and `dtrain
//! report` reads them back.
//!
//! * `metrics.jsonl`: one [`StepRecord`] per logged step;
//! * `eval.jsonl`: one [`EvalRecord`] per evaluation;
//! * `summary.json`: the [`Summary`], once a session finished.
//!
//! The types are written strictly and read leniently, so that a run directory written by
//! an older or a newer trainer still reads:
//!
//! * unknown fields are ignored (a newer trainer may add some), and a missing field reads
//!   as `None` / zero (an older one may lack it);
//! * every floating-point figure round-trips NaN and ±∞ (a diverged run's loss, the
//!   perplexity of an overflowing loss): they are written as the strings `"NaN"`,
//!   `"Infinity"` and `"-Infinity"` ([`float`] documents the encoding), and the `null` that
//!   earlier trainers wrote for them still reads (as `None`);
//! * `None` means "not measured" (no perplexity for a classifier), never "diverged";
//! * names that a newer trainer may extend (the collective) are kept as text.

pub mod float;

use serde::{Deserialize, Serialize};

/// Seconds per phase of one step (or the mean over steps).
///
/// `communicate_s` is the time inside collectives; with overlap on, the gradient
/// exchange's collectives run alongside compression, and `wait_s` is the part the step
/// actually waited for. `sync_s` is the step's control all-reduce, where a rank waits for
/// the slowest rank to finish its backward (load imbalance, jitter). The step's wall time
/// is therefore about `compute + compress + decompress + wait + sync` ([`Phases::other_s`]
/// is the remainder).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Phases {
    /// Building the batch (host data → tensors).
    #[serde(with = "float::num")]
    pub data_s: f64,
    /// Forward pass and loss.
    #[serde(with = "float::num")]
    pub forward_s: f64,
    /// Backward pass and gradient extraction into the flat buffer.
    #[serde(with = "float::num")]
    pub backward_s: f64,
    /// Compensate + compress (and the own-payload decode for error feedback).
    #[serde(with = "float::num")]
    pub compress_s: f64,
    /// Inside collectives (gradient exchange and the control all-reduce).
    #[serde(with = "float::num")]
    pub communicate_s: f64,
    /// Decoding, summing, averaging.
    #[serde(with = "float::num")]
    pub decompress_s: f64,
    /// Time the step waited on gradient communication that compression / decompression of
    /// other buckets did not hide (with overlap; equal to the exchange's share of
    /// `communicate_s` without).
    #[serde(with = "float::num")]
    pub wait_s: f64,
    /// The part of `communicate_s` spent in the step's control all-reduce, right after the
    /// backward pass. A rank waits there until the slowest rank has finished its backward,
    /// so this is mostly load imbalance and jitter between ranks (the call itself is a few
    /// floats); 0 where there is no lock-step control all-reduce (asynchronous PS) and in
    /// records written before it was split out.
    #[serde(with = "float::num")]
    pub sync_s: f64,
    /// Optimizer update and writing the parameters back into the model.
    #[serde(with = "float::num")]
    pub optimizer_s: f64,
    /// The whole step, wall clock.
    #[serde(with = "float::num")]
    pub step_s: f64,
    /// Exchanges left in flight across steps (Streaming DiLoCo's fragments): how long the
    /// ones taken back at this step ran on their own thread, beside the steps' compute. Not
    /// part of `step_s`; the part the overlap did not hide is the wait in `communicate_s`.
    #[serde(with = "float::num", skip_serializing_if = "is_zero")]
    pub in_flight_s: f64,
    /// Live membership (`cluster.membership = "live"`) under a periodic synchronisation:
    /// keeping this rank's state in memory before the step, so that the group can run it
    /// again without a lost member — what live membership costs such a step. Part of
    /// `step_s`; 0 (and not written) otherwise, where the survivors roll forward instead.
    #[serde(with = "float::num", skip_serializing_if = "is_zero")]
    pub keep_s: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl Phases {
    /// Computation: `data + forward + backward + optimizer`.
    pub fn compute_s(&self) -> f64 {
        self.data_s + self.forward_s + self.backward_s + self.optimizer_s
    }

    /// Codec time: `compress + decompress`.
    pub fn codec_s(&self) -> f64 {
        self.compress_s + self.decompress_s
    }

    /// What the step's wall time holds beyond compute, codec, waiting on the exchange, the
    /// control all-reduce and keeping the state (bookkeeping, metrics); never negative.
    pub fn other_s(&self) -> f64 {
        (self.step_s - self.compute_s() - self.codec_s() - self.wait_s - self.sync_s - self.keep_s)
            .max(0.0)
    }

    /// Adds `o` phase by phase.
    pub fn add(&mut self, o: &Phases) {
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
        self.in_flight_s += o.in_flight_s;
        self.keep_s += o.keep_s;
    }

    /// Every phase times `k` (a mean from a sum).
    pub fn scaled(&self, k: f64) -> Phases {
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
            in_flight_s: self.in_flight_s * k,
            keep_s: self.keep_s * k,
        }
    }
}

/// `Some(x)` when `x` is finite. For a figure that means nothing once not finite; a
/// measured value that diverged is kept as it is (NaN, ±∞), which records round-trip
/// ([`float`]).
pub fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepRecord {
    /// Global step (0-based) of this update.
    pub step: u64,
    /// Epoch (0-based).
    pub epoch: u64,
    /// Mean training loss over all ranks' batches (NaN or ±∞ when it diverged).
    #[serde(with = "float::opt")]
    pub loss: Option<f64>,
    /// Training accuracy over all ranks' batches.
    #[serde(with = "float::opt")]
    pub accuracy: Option<f64>,
    /// Learning rate used.
    #[serde(with = "float::opt")]
    pub lr: Option<f64>,
    /// The method's knob this step (`theta`, `density`), if it has one.
    pub ratio_name: Option<String>,
    /// Its value.
    #[serde(with = "float::opt")]
    pub ratio: Option<f64>,
    /// Bytes this rank sent (transport-level, framing included).
    pub bytes_sent: u64,
    /// Bytes this rank received.
    pub bytes_received: u64,
    /// Bytes of this rank's compressed payloads.
    pub payload_bytes: u64,
    /// Whether the update was skipped (non-finite values under `skip`).
    pub skipped: bool,
    /// Examples processed by all ranks this step.
    pub samples: u64,
    /// Per-phase times of this rank.
    pub time: Phases,
    /// DLCP (`compress.collective = "dlcp"`): fraction of all workers' gradient elements the
    /// bounded-loss all-reduce completed without, this step.
    #[serde(with = "float::opt", skip_serializing_if = "Option::is_none")]
    pub lossy_dropped: Option<f64>,
    /// DLCP: packets this rank retransmitted this step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retransmitted: Option<u64>,
    /// Parameter-server mode: seconds this rank's server spent aggregating this step.
    #[serde(with = "float::opt", skip_serializing_if = "Option::is_none")]
    pub server_s: Option<f64>,
    /// The rank whose local work since it left the previous step's gradient exchange
    /// (optimizer, logging, data, forward, backward) took longest. Ranks leave a collective
    /// nearly together (a wake-up apart), so this is the rank that reached the step's
    /// control all-reduce last: the one the others waited for in [`Phases::sync_s`]. Every
    /// rank's time travels in the control all-reduce (one float per rank). Absent with one
    /// worker and in the asynchronous PS mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slowest_rank: Option<usize>,
    /// How much longer the slowest rank's local work took than this rank's: the part of
    /// `sync_s` that is load imbalance or jitter rather than the call itself.
    #[serde(with = "float::opt", skip_serializing_if = "Option::is_none")]
    pub behind_slowest_s: Option<f64>,
    /// A 64-bit hash of this rank's parameters after the step (16 hex digits), at the
    /// steps where the workers compared theirs (`cluster.check_replicas_every`); the same
    /// on every rank, or the run stopped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub param_hash: Option<String>,
}

/// One line of `eval.jsonl` (also `summary.json`'s `final_eval`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EvalRecord {
    /// Epochs completed.
    pub epoch: u64,
    /// Steps completed.
    pub step: u64,
    /// Mean test loss (NaN or ±∞ when it diverged).
    #[serde(with = "float::opt")]
    pub loss: Option<f64>,
    /// Test accuracy (top-1; tokens for language models).
    #[serde(with = "float::opt")]
    pub accuracy: Option<f64>,
    /// Test perplexity `exp(loss)` of a language model (+∞ when that overflows); `None`
    /// for a classifier (and then not written).
    #[serde(with = "float::opt", skip_serializing_if = "Option::is_none")]
    pub perplexity: Option<f64>,
    /// Examples (or tokens) scored.
    pub count: u64,
}

/// `summary.json`. Every field may be missing (read as `None`), so that a summary from an
/// older or newer trainer still reads; the trainer fills every one it knows.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Summary {
    /// Run name.
    pub name: Option<String>,
    /// Model kind.
    pub model: Option<String>,
    /// Compression method.
    pub method: Option<String>,
    /// Workers.
    pub workers: Option<usize>,
    /// Steps completed (in total, including those before a resume).
    pub steps: Option<u64>,
    /// Steps run by the last session (after a resume: since the resume).
    pub steps_this_session: Option<u64>,
    /// The step the last session started at (0 unless resumed).
    pub resumed_from: Option<u64>,
    /// Final evaluation, if any.
    pub final_eval: Option<EvalRecord>,
    /// Mean training loss of the last epoch's steps (the last session's).
    #[serde(with = "float::opt")]
    pub final_train_loss: Option<f64>,
    /// Mean per-phase times per step, excluding the first step of the session (warm-up).
    pub mean_step: Option<Phases>,
    /// Mean bytes sent per step by rank 0.
    #[serde(with = "float::opt")]
    pub bytes_sent_per_step: Option<f64>,
    /// Mean payload bytes per step by rank 0.
    #[serde(with = "float::opt")]
    pub payload_bytes_per_step: Option<f64>,
    /// The most bytes rank 0 sent in one step of the session (a periodic
    /// synchronisation's round, where the mean spreads it over the round's steps); absent
    /// in runs written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_sent_peak: Option<u64>,
    /// Model parameters.
    pub params: Option<u64>,
    /// `4·params / payload bytes per step`.
    #[serde(with = "float::opt")]
    pub compression_ratio: Option<f64>,
    /// Training throughput, examples per second over all workers.
    #[serde(with = "float::opt")]
    pub samples_per_s: Option<f64>,
    /// Wall time of the last session in seconds.
    #[serde(with = "float::opt")]
    pub wall_s: Option<f64>,
    /// Steps skipped for non-finite values.
    pub skipped_steps: Option<u64>,
    /// Rollbacks of the recover policy.
    pub recoveries: Option<u64>,
    /// The factor applied to θ by the recover policy (1 = never lowered).
    #[serde(with = "float::opt")]
    pub theta_scale: Option<f64>,
    /// DLCP: mean fraction of the gradient dropped per step (absent without DLCP).
    #[serde(with = "float::opt", skip_serializing_if = "Option::is_none")]
    pub lossy_dropped: Option<f64>,
    /// Per rank, the steps of the last session in which it was the slowest to reach the
    /// control all-reduce ([`StepRecord::slowest_rank`]); absent where that is not measured
    /// (one worker, asynchronous PS). A rank far above `1/workers` is a straggler.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slowest_rank_steps: Option<Vec<u64>>,
    /// The collective that carried the run's compressed buckets (with no compressed bucket,
    /// the one of the dense buckets; with `mode = "ps"`, the parameter server): what `dtrain
    /// simulate` models. Its name as `dtrain_compress::Collective` spells it, kept as text so
    /// that a name from a newer trainer still reads; absent in runs written before it was
    /// recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub collective: Option<String>,
    /// Each bucket's collective, in bucket order, when they differ from one another (a
    /// compressed run's small dense buckets go through the dense all-reduce).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bucket_collectives: Option<Vec<String>>,
    /// The number of hosts the ranks were on, when the dense buckets went through the
    /// hierarchical all-reduce (`collective` or `bucket_collectives` name
    /// `hierarchical-allreduce`): what `dtrain simulate` needs to model it. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hosts: Option<usize>,
    /// Where the compressed buckets were encoded when `[compress] device` put them on a
    /// device: the device, how many of the compressed buckets, and why any stayed on the
    /// host. Absent for the host codecs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub codec_device: Option<String>,
    /// The `[sync]` kind when it is not `every-step` (`local-sgd`, `post-local-sgd`,
    /// `diloco`); absent for every-step runs and runs written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync: Option<String>,
    /// The `[sync]` period H (optimizer steps between synchronisations), with `sync`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<u64>,
    /// Streaming DiLoCo's overlap τ: the inner steps each fragment's exchange may overlap
    /// before its merge (absent for the other kinds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_overlap: Option<u64>,
    /// Streaming DiLoCo's fragment count F: each exchange carries one fragment, about 1/F
    /// of the parameters (absent for the other kinds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_fragments: Option<usize>,
    /// A compressed optimizer's name (`onebit-adam`, `zeroone-adam`), whose momentum the
    /// `collective` carried; absent for the other optimizers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compressed_optimizer: Option<String>,
    /// The restarts of `dtrain run --max-restarts` in the session that wrote this summary,
    /// in order; absent when there was none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restarts: Option<Vec<Restart>>,
    /// The changes of the group of workers under `cluster.membership = "live"`, in order;
    /// absent when the group never changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub membership: Option<Vec<MembershipChange>>,
    /// What the run was measured with and on: commit, build, date, machine. Absent in runs
    /// written before it was recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provenance: Option<Provenance>,
}

/// Where a run's figures come from: the build and the machine that produced them, so that
/// a table rendered from runs can say what it was measured at (`dtrain report` prints it
/// under each run's source). Every field may be missing.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Provenance {
    /// The dtrain commit the binary was built from (abbreviated), with `-dirty` when the
    /// checkout's tracked files differed from it at build time; absent for a build outside
    /// a git checkout.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
    /// The cargo profile of the build (`release`, or `debug` for the dev and test
    /// profiles).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// When the session started, UTC, `YYYY-mm-dd HH:MM:SS`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_utc: Option<String>,
    /// The CPU's model name (rank 0's host).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu: Option<String>,
    /// The x86-64 microarchitecture level the CPU supports (`x86-64`, `x86-64-v2`, `-v3`,
    /// `-v4`): training runs are bit for bit the same only within one level (burn's CPU
    /// kernels dispatch on it). Absent on other architectures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_level: Option<String>,
    /// Logical CPUs available to rank 0's process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpus: Option<usize>,
}

impl Provenance {
    /// One line for a report: `commit abc1234, release, 2026-11-28 12:20:17 UTC, Intel Xeon
    /// (x86-64-v4, 2 CPUs)`; the parts that are known.
    pub fn line(&self) -> String {
        let mut parts = Vec::new();
        if let Some(c) = &self.commit {
            parts.push(format!("commit {c}"));
        }
        if let Some(p) = &self.profile {
            parts.push(p.clone());
        }
        if let Some(t) = &self.started_utc {
            parts.push(format!("{t} UTC"));
        }
        let detail: Vec<String> = self
            .cpu_level
            .iter()
            .cloned()
            .chain(self.cpus.map(|n| format!("{n} CPUs")))
            .collect();
        match (&self.cpu, detail.is_empty()) {
            (Some(cpu), true) => parts.push(cpu.clone()),
            (Some(cpu), false) => parts.push(format!("{cpu} ({})", detail.join(", "))),
            (None, false) => parts.push(detail.join(", ")),
            (None, true) => {}
        }
        parts.join(", ")
    }
}

/// One restart of the workers after a failure (`dtrain run --max-restarts N`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Restart {
    /// The rank whose failure stopped the workers (the first to exit unsuccessfully), when
    /// one did (`None`: the workers were stopped by the supervisor, e.g. at a deadline).
    pub rank: Option<usize>,
    /// Why: the failed worker's exit status, or the supervisor's reason.
    pub cause: String,
    /// The step the workers were restarted from: the newest checkpoint intact on every
    /// rank (0 when none had been written, and the run started afresh).
    pub step: u64,
    /// Seconds from the start of the attempt to the failure.
    #[serde(with = "float::num")]
    pub after_s: f64,
    /// The steps the failed attempt had completed (its newest step + 1, from
    /// `metrics.jsonl`), at least `step`.
    pub reached: u64,
    /// The steps done again: `reached − step`.
    pub steps_lost: u64,
    /// The training time those steps had taken (their step times in `metrics.jsonl`,
    /// scaled up where `output.log_every` left steps out): the work the failure cost, the
    /// restart's own start-up aside.
    #[serde(with = "float::num")]
    pub lost_s: f64,
}

/// One change of the group of workers while the run went on (`cluster.membership =
/// "live"`): who left, when, why, and what it cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MembershipChange {
    /// The membership epoch the change began (1 for the first change).
    pub epoch: u64,
    /// The workers that left (their ranks at the start of the run).
    pub removed: Vec<usize>,
    /// The ranks newcomers took (each in a lost worker's place); absent when none joined.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub added: Vec<usize>,
    /// The workers that went on (ranks at the start of the run), in their new rank order.
    pub members: Vec<usize>,
    /// Why they left (the failure the survivors saw), or that newcomers joined.
    pub cause: String,
    /// The step the group went on from (it ran that step again, over the new group; a
    /// newcomer enters before it).
    pub step: u64,
    /// Seconds from the start of the session to the failure (the session of the worker
    /// that wrote the summary, whose record it is: a newcomer's starts when it asks to be
    /// admitted, so its own entry is at the seconds it waited before the state came).
    #[serde(with = "float::num")]
    pub after_s: f64,
    /// Steps this worker had completed beyond `step` and did again (0 or 1).
    pub steps_lost: u64,
    /// Seconds from the start of the failed step (or of the evaluation or checkpoint
    /// that failed) until the group was ready to run `step` again: the wait for the
    /// failure to show, the agreement, and the restore.
    #[serde(with = "float::num")]
    pub lost_s: f64,
    /// The step deadline in force when the failure happened, in seconds (a member silent
    /// for this long is dropped); absent in runs written before it was recorded.
    #[serde(default, with = "float::opt", skip_serializing_if = "Option::is_none")]
    pub deadline_s: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_values_are_written_as_strings_and_read_back() {
        let e = EvalRecord {
            epoch: 1,
            step: 10,
            loss: Some(1010.0),
            accuracy: Some(0.1),
            perplexity: Some(1010f64.exp()),
            count: 100,
        };
        let text = serde_json::to_string(&e).unwrap();
        assert!(text.contains("\"perplexity\":\"Infinity\""), "{text}");
        let back: EvalRecord = serde_json::from_str(&text).unwrap();
        assert_eq!(back, e);
        let s = Summary {
            final_train_loss: Some(f64::NAN),
            mean_step: Some(Phases {
                step_s: f64::NEG_INFINITY,
                ..Phases::default()
            }),
            final_eval: Some(e),
            ..Summary::default()
        };
        let text = serde_json::to_string_pretty(&s).unwrap();
        assert!(text.contains("\"final_train_loss\": \"NaN\""), "{text}");
        let back: Summary = serde_json::from_str(&text).unwrap();
        assert!(back.final_train_loss.unwrap().is_nan());
        assert_eq!(back.mean_step.unwrap().step_s, f64::NEG_INFINITY);
    }

    #[test]
    fn what_earlier_trainers_wrote_for_non_finite_values_still_reads() {
        // `null` (an `Option` filtered by `finite`, or serde_json's own NaN): not known.
        let e: EvalRecord = serde_json::from_str(r#"{"loss":1010.0,"perplexity":null}"#).unwrap();
        assert_eq!(e.perplexity, None);
        let p: Phases = serde_json::from_str(r#"{"step_s":null,"data_s":2}"#).unwrap();
        assert!(p.step_s.is_nan());
        assert_eq!(p.data_s, 2.0);
        // Anything else is an error naming what is accepted.
        let err = serde_json::from_str::<EvalRecord>(r#"{"loss":"lots"}"#).unwrap_err();
        assert!(err.to_string().contains("\"Infinity\""), "{err}");
    }

    #[test]
    fn missing_and_unknown_fields_read() {
        let r: StepRecord =
            serde_json::from_str(r#"{"step":3,"loss":null,"a_future_field":[1,2]}"#).unwrap();
        assert_eq!(r.step, 3);
        assert_eq!(r.loss, None);
        assert_eq!(r.time, Phases::default());
        let s: Summary = serde_json::from_str("{}").unwrap();
        assert_eq!(s, Summary::default());
    }

    #[test]
    fn absent_optional_figures_are_not_written() {
        let text = serde_json::to_string(&Summary::default()).unwrap();
        for k in [
            "lossy_dropped",
            "slowest_rank_steps",
            "collective",
            "bucket_collectives",
        ] {
            assert!(!text.contains(k), "{k} in {text}");
        }
        let text = serde_json::to_string(&StepRecord::default()).unwrap();
        for k in ["lossy_dropped", "retransmitted", "server_s", "slowest_rank"] {
            assert!(!text.contains(k), "{k} in {text}");
        }
        assert!(text.contains("\"ratio\":null"), "{text}");
    }

    /// Same value, where NaN equals NaN; finite values within serde_json's parsing
    /// precision (see [`float`]).
    fn same(a: f64, b: f64) -> bool {
        if a.is_finite() && b.is_finite() {
            a == b || (a - b).abs() <= a.abs().max(b.abs()) * 4.0 * f64::EPSILON
        } else {
            (a.is_nan() && b.is_nan()) || a == b
        }
    }

    fn same_opt(a: Option<f64>, b: Option<f64>) -> bool {
        match (a, b) {
            (Some(a), Some(b)) => same(a, b),
            (a, b) => a.is_none() && b.is_none(),
        }
    }

    fn same_phases(a: &Phases, b: &Phases) -> bool {
        let f = |p: &Phases| {
            [
                p.data_s,
                p.forward_s,
                p.backward_s,
                p.compress_s,
                p.communicate_s,
                p.decompress_s,
                p.wait_s,
                p.sync_s,
                p.optimizer_s,
                p.step_s,
                p.in_flight_s,
            ]
        };
        f(a).iter().zip(f(b)).all(|(x, y)| same(*x, y))
    }

    use proptest::prelude::*;

    /// Any float: every class (normal, subnormal, zero, ±∞, NaN), either sign.
    fn any_f64() -> impl Strategy<Value = f64> {
        prop_oneof![
            proptest::num::f64::ANY,
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(-0.0),
        ]
    }

    fn any_opt() -> impl Strategy<Value = Option<f64>> {
        proptest::option::of(any_f64())
    }

    fn any_phases() -> impl Strategy<Value = Phases> {
        proptest::collection::vec(any_f64(), 12).prop_map(|v| Phases {
            data_s: v[0],
            forward_s: v[1],
            backward_s: v[2],
            compress_s: v[3],
            communicate_s: v[4],
            decompress_s: v[5],
            wait_s: v[6],
            sync_s: v[7],
            optimizer_s: v[8],
            step_s: v[9],
            in_flight_s: v[10],
            keep_s: v[11],
        })
    }

    proptest! {
        #[test]
        fn every_record_round_trips_arbitrary_floats(
            f in proptest::collection::vec(any_opt(), 18),
            p in any_phases(),
            after in any_f64(),
        ) {
            let step = StepRecord {
                loss: f[0],
                accuracy: f[1],
                lr: f[2],
                ratio: f[3],
                lossy_dropped: f[4],
                server_s: f[5],
                behind_slowest_s: f[6],
                time: p,
                ..StepRecord::default()
            };
            let line = serde_json::to_string(&step).unwrap();
            prop_assert!(!line.contains('\n'), "one line: {}", line);
            let back: StepRecord = serde_json::from_str(&line).unwrap();
            for (a, b) in [
                (step.loss, back.loss),
                (step.accuracy, back.accuracy),
                (step.lr, back.lr),
                (step.ratio, back.ratio),
                (step.lossy_dropped, back.lossy_dropped),
                (step.server_s, back.server_s),
                (step.behind_slowest_s, back.behind_slowest_s),
            ] {
                prop_assert!(same_opt(a, b), "{:?} read back as {:?} from {}", a, b, line);
            }
            prop_assert!(same_phases(&step.time, &back.time), "{}", line);

            let eval = EvalRecord { loss: f[7], accuracy: f[8], perplexity: f[9], ..EvalRecord::default() };
            let line = serde_json::to_string(&eval).unwrap();
            let back: EvalRecord = serde_json::from_str(&line).unwrap();
            prop_assert!(same_opt(eval.loss, back.loss) && same_opt(eval.accuracy, back.accuracy)
                && same_opt(eval.perplexity, back.perplexity), "{}", line);

            let s = Summary {
                final_eval: Some(eval.clone()),
                final_train_loss: f[10],
                mean_step: Some(p),
                bytes_sent_per_step: f[11],
                payload_bytes_per_step: f[12],
                compression_ratio: f[13],
                samples_per_s: f[14],
                wall_s: f[15],
                theta_scale: f[16],
                lossy_dropped: f[17],
                restarts: Some(vec![Restart { rank: Some(1), cause: "x".into(), step: 3, after_s: after, reached: 5, steps_lost: 2, lost_s: after }]),
                membership: Some(vec![MembershipChange { epoch: 1, removed: vec![2], added: vec![], members: vec![0, 1], cause: "y".into(), step: 7, after_s: after, steps_lost: 1, lost_s: after, deadline_s: Some(10.0) }]),
                ..Summary::default()
            };
            let text = serde_json::to_string_pretty(&s).unwrap();
            let back: Summary = serde_json::from_str(&text).unwrap();
            let pairs = [
                (s.final_train_loss, back.final_train_loss),
                (s.bytes_sent_per_step, back.bytes_sent_per_step),
                (s.payload_bytes_per_step, back.payload_bytes_per_step),
                (s.compression_ratio, back.compression_ratio),
                (s.samples_per_s, back.samples_per_s),
                (s.wall_s, back.wall_s),
                (s.theta_scale, back.theta_scale),
                (s.lossy_dropped, back.lossy_dropped),
            ];
            for (a, b) in pairs {
                prop_assert!(same_opt(a, b), "{:?} read back as {:?} from {}", a, b, text);
            }
            prop_assert!(same_phases(&p, &back.mean_step.unwrap()));
            let e = back.final_eval.unwrap();
            prop_assert!(same_opt(eval.perplexity, e.perplexity));
            let r = &back.restarts.unwrap()[0];
            prop_assert!(same(after, r.after_s) && same(after, r.lost_s));
            prop_assert_eq!((r.reached, r.steps_lost), (5, 2));
            let m = &back.membership.unwrap()[0];
            prop_assert!(same(after, m.after_s) && same(after, m.lost_s));
            prop_assert_eq!((m.epoch, &m.removed, &m.members, m.step), (1, &vec![2], &vec![0, 1], 7));
        }
    }
}
