//! The types shared by `dtrain bench allreduce` ([`super::allreduce`]) and its compressed
//! variant ([`super::exchange`]): what to measure ([`Options`], [`Op`]) and what comes back
//! ([`Row`], [`Breakdown`]). They live here, importing neither, so that the two
//! benchmarks depend on this file and not on each other; both re-export them at their old
//! paths.

use std::str::FromStr;
use std::time::Duration;

use dtrain_comms::shaping::LinkSpec;
use serde::{Deserialize, Serialize};

use crate::config::TransportKind;
use crate::exchange::GatherCollective;

/// The collective being measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// f32 sum all-reduce of `size` bytes.
    AllReduce,
    /// All-gather producing `size` bytes on every rank (`size/N` from each).
    AllGather,
    /// Broadcast of `size` bytes from rank 0.
    Broadcast,
}

impl FromStr for Op {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "allreduce" => Ok(Op::AllReduce),
            "allgather" => Ok(Op::AllGather),
            "broadcast" => Ok(Op::Broadcast),
            _ => Err(format!(
                "unknown op {s:?} (allreduce, allgather, broadcast)"
            )),
        }
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Op::AllReduce => "allreduce",
            Op::AllGather => "allgather",
            Op::Broadcast => "broadcast",
        })
    }
}

impl Op {
    /// nccl-tests' bus-bandwidth factor for `world` ranks.
    pub fn bus_factor(self, world: usize) -> f64 {
        let n = world as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather => (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }

    /// The α–β prediction of one call on `link`, in seconds.
    pub fn predict(self, link: &LinkSpec, bytes: usize, world: usize) -> f64 {
        let b = bytes as f64;
        match self {
            Op::AllReduce => link.predict_all_reduce(b, world),
            Op::AllGather => link.predict_all_gather(b, world),
            Op::Broadcast => link.predict_broadcast(b, world),
        }
    }
}

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Transport.
    pub transport: TransportKind,
    /// Number of worker processes.
    pub workers: usize,
    /// Message sizes in bytes.
    pub sizes: Vec<usize>,
    /// Collective.
    pub op: Op,
    /// Emulated egress bandwidth per worker, as given (e.g. `"1Gbit"`).
    pub bandwidth: Option<String>,
    /// Emulated one-way latency per worker, as given (e.g. `"100us"`).
    pub latency: Option<String>,
    /// Timed calls per size; 0 chooses by size (about 256 MB moved, between 2 and 50).
    pub iters: usize,
    /// Untimed calls per size before timing.
    pub warmup: usize,
    /// Limit for the whole run.
    pub timeout: Duration,
    /// Compression methods (`name` or `name:key=value,…`): when given, each size is one
    /// layer's whole compressed exchange per method instead of a bare collective (see
    /// [`super::exchange`]).
    pub methods: Vec<String>,
    /// The collective the compressed exchanges' payloads take (`--collective`); `None`:
    /// the trainer's default.
    pub collective: Option<GatherCollective>,
}

impl Options {
    /// The emulated link these options describe.
    pub fn link(&self) -> Result<LinkSpec, String> {
        LinkSpec::parse(self.bandwidth.as_deref(), self.latency.as_deref())
    }

    /// `", emulated egress link B / L per worker"` for table titles (empty when unshaped).
    pub fn link_note(&self) -> String {
        match (&self.bandwidth, &self.latency) {
            (None, None) => String::new(),
            (b, l) => format!(
                ", emulated egress link {} / {} per worker",
                b.as_deref().unwrap_or("unlimited"),
                l.as_deref().unwrap_or("0")
            ),
        }
    }

    /// Timed calls for `bytes`.
    pub fn iters_for(&self, bytes: usize) -> usize {
        if self.iters > 0 {
            self.iters
        } else {
            ((256usize << 20) / bytes.max(1)).clamp(2, 50)
        }
    }
}

/// One measured size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Message size in bytes (nccl-tests' `size`).
    pub bytes: usize,
    /// f32 elements (all-reduce) or bytes (the byte collectives).
    pub count: usize,
    /// Timed calls.
    pub iters: usize,
    /// Time per call, maximum over ranks, in microseconds.
    pub time_us: f64,
    /// `bytes / time` in GB/s.
    pub algbw_gbs: f64,
    /// `algbw · factor` in GB/s (see [`super::allreduce`]'s module docs).
    pub busbw_gbs: f64,
    /// α–β prediction per call in microseconds, when the link is emulated.
    pub predicted_us: Option<f64>,
    /// Bytes rank 0 sent per call (framing included).
    pub sent_per_call: u64,
    /// The compression method, for an exchange row (`--compress`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The exchange's time split, for an exchange row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breakdown: Option<Breakdown>,
    /// The collective the exchange took, for an exchange row (`allreduce` for a layer
    /// left uncompressed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collective: Option<String>,
}

/// Time split of one compressed exchange, microseconds per call (maximum over ranks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Breakdown {
    /// Error-feedback compensation and encoding.
    pub compress_us: f64,
    /// Inside the collective (transfer and waiting for peers).
    pub communicate_us: f64,
    /// Decoding, summing and averaging.
    pub decompress_us: f64,
}
