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
//! * a number that was not finite is written as JSON `null` and reads as `None` (a
//!   diverged run's loss, the perplexity of an overflowing loss), never as an error;
//! * names that a newer trainer may extend (the collective) are kept as text.

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
    pub wait_s: f64,
    /// The part of `communicate_s` spent in the step's control all-reduce, right after the
    /// backward pass. A rank waits there until the slowest rank has finished its backward,
    /// so this is mostly load imbalance and jitter between ranks (the call itself is a few
    /// floats); 0 where there is no lock-step control all-reduce (asynchronous PS) and in
    /// records written before it was split out.
    pub sync_s: f64,
    /// Optimizer update and writing the parameters back into the model.
    pub optimizer_s: f64,
    /// The whole step, wall clock.
    pub step_s: f64,
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

    /// What the step's wall time holds beyond compute, codec, waiting on the exchange and
    /// the control all-reduce (bookkeeping, metrics); never negative.
    pub fn other_s(&self) -> f64 {
        (self.step_s - self.compute_s() - self.codec_s() - self.wait_s - self.sync_s).max(0.0)
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
        }
    }
}

/// `Some(x)` when `x` is finite: what a record holds for a measured value (JSON has no
/// NaN or infinity; such a value is written as `null` and reads as `None`).
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
    /// Mean training loss over all ranks' batches (`None` when not finite).
    pub loss: Option<f64>,
    /// Training accuracy over all ranks' batches.
    pub accuracy: Option<f64>,
    /// Learning rate used.
    pub lr: Option<f64>,
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
    /// Whether the update was skipped (non-finite values under `skip`).
    pub skipped: bool,
    /// Examples processed by all ranks this step.
    pub samples: u64,
    /// Per-phase times of this rank.
    pub time: Phases,
    /// DLCP (`compress.collective = "dlcp"`): fraction of all workers' gradient elements the
    /// bounded-loss all-reduce completed without, this step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lossy_dropped: Option<f64>,
    /// DLCP: packets this rank retransmitted this step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retransmitted: Option<u64>,
    /// Parameter-server mode: seconds this rank's server spent aggregating this step.
    #[serde(skip_serializing_if = "Option::is_none")]
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub behind_slowest_s: Option<f64>,
}

/// One line of `eval.jsonl` (also `summary.json`'s `final_eval`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EvalRecord {
    /// Epochs completed.
    pub epoch: u64,
    /// Steps completed.
    pub step: u64,
    /// Mean test loss (`None` when not finite).
    pub loss: Option<f64>,
    /// Test accuracy (top-1; tokens for language models).
    pub accuracy: Option<f64>,
    /// Test perplexity `exp(loss)` (`None` when that overflows).
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
    pub final_train_loss: Option<f64>,
    /// Mean per-phase times per step, excluding the first step of the session (warm-up).
    pub mean_step: Option<Phases>,
    /// Mean bytes sent per step by rank 0.
    pub bytes_sent_per_step: Option<f64>,
    /// Mean payload bytes per step by rank 0.
    pub payload_bytes_per_step: Option<f64>,
    /// Model parameters.
    pub params: Option<u64>,
    /// `4·params / payload bytes per step`.
    pub compression_ratio: Option<f64>,
    /// Training throughput, examples per second over all workers.
    pub samples_per_s: Option<f64>,
    /// Wall time of the last session in seconds.
    pub wall_s: Option<f64>,
    /// Steps skipped for non-finite values.
    pub skipped_steps: Option<u64>,
    /// Rollbacks of the recover policy.
    pub recoveries: Option<u64>,
    /// The factor applied to θ by the recover policy (1 = never lowered).
    pub theta_scale: Option<f64>,
    /// DLCP: mean fraction of the gradient dropped per step (absent without DLCP).
    #[serde(skip_serializing_if = "Option::is_none")]
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_values_are_written_as_null_and_read_back_as_none() {
        let e = EvalRecord {
            epoch: 1,
            step: 10,
            loss: finite(1010.0),
            accuracy: Some(0.1),
            perplexity: finite(1010f64.exp()),
            count: 100,
        };
        let text = serde_json::to_string(&e).unwrap();
        assert!(text.contains("\"perplexity\":null"), "{text}");
        let back: EvalRecord = serde_json::from_str(&text).unwrap();
        assert_eq!(back, e);
        assert_eq!(back.perplexity, None);
        // A `Some(NaN)` (a writer that did not filter) still reads.
        let s = Summary {
            final_train_loss: Some(f64::NAN),
            final_eval: Some(e),
            ..Summary::default()
        };
        let back: Summary = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back.final_train_loss, None);
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
}
