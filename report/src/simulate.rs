//! `dtrain simulate`: projected step time for P workers on a named fabric, from a measured
//! run and an α–β model of the collective its method uses (ARCHITECTURE.md §5).
//!
//! ## The model
//! For a run measured with `P₀` workers and P projected workers on a link of bandwidth β
//! (bytes/s) and per-message latency α:
//!
//! ```text
//! T(P) = compute + compress + decompress · s(P) + comm(P) + other
//! ```
//!
//! * `compute` = data + forward + backward + optimizer, `compress`, `decompress` and
//!   `other` (the part of the measured step not attributed to a phase) are the run's
//!   measured means per step ([`Run::mean_step`]). The per-worker batch is fixed (weak
//!   scaling), so compute does not depend on P.
//! * `s(P) = P / P₀` for all-gather methods (every rank decodes and adds P payloads),
//!   `1` otherwise. The whole measured decompress time is scaled, including its constant
//!   part (averaging, scatter), which slightly overestimates it.
//! * `comm(P)` is the α–β time of the method's collective, from [`dtrain_comms::cost`]
//!   (the formulas live there, once: the trainer's automatic choice of collective uses
//!   them too, and the ring's and all-gather's are what the link emulation is checked
//!   against). The step's gradient is
//!   exchanged in `B` buckets (`B = ⌈4·params / bucket bytes⌉`, bucket size
//!   `[compress] bucket_mb`, default 25 MiB), so the latency terms count `B` times while the
//!   bandwidth terms see the total.
//! * Communication is **not** overlapped with (de)compression in the model: the times add
//!   up. With one bucket (most small models) the trainer cannot overlap either; with many
//!   buckets the projection is an upper bound of the step time.
//! * No contention, congestion, switch hops or software overhead beyond α: each worker has
//!   a full-duplex link of the fabric's nominal rate.
//!
//! ## Collective per method
//! The run records the collective its compressed buckets used (`summary.json`'s
//! `collective`, [`Run::collective`]; older runs: derived from their `[compress]` table by
//! the method registry), and [`collective_of`] maps it to the model; the bytes `n` are per
//! rank:
//!
//! | kind | collective | n | comm(P) |
//! |---|---|---|---|
//! | `none` | ring all-reduce (f32) | 4·params | `2(P−1)/P · n/β + 2(P−1)·α·B` |
//! | `fp16`, `range-float` (`Dense`: the decoded f32 gradient is all-reduced) | ring all-reduce | 4·params | same |
//! | `randomk` with `shared = true` (default; `Summable`) | ring all-reduce of the value lanes | payload | same |
//! | `scalecom` (`Summable`, two-phase) | chain broadcast of the leader's index set, then all-reduce of the value lanes | payload / 2 each | `n/β + (P−1)·α·B` + the ring term |
//! | `topk`, `dgc`, `qsgd`, `terngrad`, `onebit`, `threshold`, `adaptive-threshold`, `gradient-dropping`, `fft`, `sparseloco`, `demo`, `randomk` with `shared = false` (`Gather`), and any run whose collective is unknown | ring all-gatherv of every rank's payload | payload | `(P−1) · n/β + (P−1)·α·B` |
//!
//! With `[compress] collective = "sparse-allreduce"` a gather method uses dtrain-comms' sparse
//! all-reduce instead ([`Collective::SparseAllReduce`]): each rank sends every owner its share
//! of its `k` non-zeros and receives the owners' reduced ranges, two rounds of direct
//! messages. Per rank and step it receives `(P−1)/P · k` entries at density `k/n` and
//! `(P−1)/P · |sum|` entries at density `|sum|/n`. An entry is a 4-byte value and a LEB128
//! index gap ([`entry_bytes`]: 1 byte plus one per power of 2⁷ the gap reaches, for gaps
//! geometric at that density); a range goes dense, 4 bytes per element, once that is
//! cheaper. So `comm(P) = 2·α·B + (P−1)/P · (k·e(k/n) + min(|sum|·e(|sum|/n), 4n)) / β`,
//! with `k` = payload / 8 (the gathered (u32, f32) pairs) and
//! `|sum|(P) = min(k·(1 + u·(P−1)), params)`. `u`, the fraction of another
//! rank's entries that are new to the sum, is read off the measured run when it used the
//! sparse all-reduce (from the bytes it received at P₀), else taken as 1 (independent index
//! sets: the upper bound).
//!
//! With `collective = "compressed-allreduce"` ([`Collective::CompressedAllReduce`]) each rank
//! sends every owner its payload of the owner's range and the owner sends its re-encoded sum
//! to every rank, two rounds of direct messages: with `n` = payload (one encoded copy of the
//! buffer), `comm(P) = 2·α·B + 2(P−1)/P · n/β`, and decoding stays one buffer's worth.
//!
//! A run whose dense buckets went through the hierarchical all-reduce
//! ([`Collective::Hierarchical`]: ranks on several hosts, `summary.json`'s `hosts`) is
//! modelled as the dense all-reduce among one leader per host, `⌈P / per_host⌉` of them,
//! with the same workers per host at every P (the host-local stages are not charged:
//! [`dtrain_comms::cost`]).
//!
//! All-reduces of at most 64 KiB per bucket use recursive doubling, as dtrain-comms does:
//! `⌈log2 P⌉(+2 off powers of two) · (n/β + α)`. A parameter-server exchange (push + pull
//! over `servers` server links, `2·max(P/servers, 1)·n/β + 2α`) can be requested with
//! [`SimOptions::collective`]; no method uses it by default.
//!
//! **Infrequent synchronisation** (`[sync]`: local SGD, post-local SGD, DiLoCo): a run
//! exchanges on a fraction `f` of its steps ([`exchange_fraction`], measured from the
//! steps that sent bytes, else `1/H`), so `comm(P)` above is the time of one exchange of
//! `payload / f` bytes, times `f`. Streaming DiLoCo exchanges one of its F fragments on
//! each of `F/H` of the steps (measured the same way), so an exchange is a fragment's
//! bytes (`4·params / F` for a dense one) — `payload / f` is also the run's peak bytes per
//! step — and its overlap τ
//! (`summary.json`'s `sync_overlap`) hides up to τ steps of work
//! (`compute + compress + decompress + other`) of each exchange: `comm(P) = f ·
//! max(0, exchange(P) − τ · work(P))`.
//!
//! The payload is the run's mean payload bytes per step (rank 0; it includes buckets a
//! method leaves dense, which are really all-reduced — a small overestimate for gather
//! methods). Without `params` (no `summary.json`) 4·params is estimated from the bytes
//! rank 0 sent: a ring all-reduce sends `2(P₀−1)/P₀ · n`.
//!
//! ## Fabrics
//! [`Fabric::presets`]: nominal line rates; latencies are per message as seen by the
//! application (kernel TCP stack for Ethernet, verbs/MPI for InfiniBand):
//!
//! | fabric | bandwidth | α |
//! |---|---|---|
//! | 1GbE | 1 Gbit/s | 50 µs |
//! | 10GbE | 10 Gbit/s | 30 µs |
//! | 25GbE | 25 Gbit/s | 25 µs |
//! | 100GbE | 100 Gbit/s | 20 µs |
//! | IB-EDR | 100 Gbit/s | 1.5 µs |
//! | IB-HDR | 200 Gbit/s | 1 µs |
//!
//! Custom fabrics are `"BANDWIDTH,LATENCY"` strings in the config's units
//! (`"1Gbit,100us"`, `"2.5GB/s,5us"`), parsed by dtrain-comms.
//!
//! ## Validation
//! [`validate`] applies the same model to runs made on an emulated link (`[network]`), at
//! their own worker count and link, and compares with the measured mean step time. As
//! compute, codec and other times come from the run itself, the relative error is
//! `(predicted comm − measured wait) / measured step`: it tests the α–β collective model
//! and the no-overlap assumption, not the compute measurements.

use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use dtrain_comms::cost;
pub use dtrain_comms::cost::entry_bytes;
use dtrain_comms::shaping::LinkSpec;

use crate::error::{ReportError, Result};
use crate::md::{self, Table};
use crate::plot::{self, Legend, LinePlot, Scale, Series};
use crate::report::labels;
use crate::run::{load_runs, Run};

/// A network fabric: a name and its α–β link.
#[derive(Debug, Clone, PartialEq)]
pub struct Fabric {
    /// Display name (`10GbE`, or the custom string).
    pub name: String,
    /// Per-worker bandwidth and per-message latency.
    pub link: LinkSpec,
}

impl Fabric {
    fn preset(name: &str, gbit: f64, latency_us: f64) -> Fabric {
        Fabric {
            name: name.into(),
            link: LinkSpec {
                bandwidth: Some(gbit * 1e9 / 8.0),
                latency: Duration::from_secs_f64(latency_us * 1e-6),
            },
        }
    }

    /// The named fabrics (see the [module docs](self) for their values).
    pub fn presets() -> Vec<Fabric> {
        vec![
            Fabric::preset("1GbE", 1.0, 50.0),
            Fabric::preset("10GbE", 10.0, 30.0),
            Fabric::preset("25GbE", 25.0, 25.0),
            Fabric::preset("100GbE", 100.0, 20.0),
            Fabric::preset("IB-EDR", 100.0, 1.5),
            Fabric::preset("IB-HDR", 200.0, 1.0),
        ]
    }

    /// A preset by name (case, `-`, `_` and spaces ignored: `ib-edr`, `IB_EDR`, `10gbe`),
    /// or a custom `"BANDWIDTH,LATENCY"` / `"BANDWIDTH"` string (`"1Gbit,100us"`).
    pub fn parse(s: &str) -> Result<Fabric> {
        let norm = |x: &str| {
            x.chars()
                .filter(|c| !matches!(c, '-' | '_' | ' '))
                .collect::<String>()
                .to_ascii_lowercase()
        };
        if let Some(f) = Fabric::presets()
            .into_iter()
            .find(|f| norm(&f.name) == norm(s))
        {
            return Ok(f);
        }
        let mut parts = s.splitn(2, ',');
        let bw = parts.next().unwrap_or("").trim();
        let lat = parts.next().map(str::trim);
        let link = LinkSpec::parse(Some(bw), lat).map_err(|m| {
            let names: Vec<String> = Fabric::presets().into_iter().map(|f| f.name).collect();
            ReportError::Invalid(format!(
                "fabric {s:?}: {m} (a preset: {}; or \"BANDWIDTH,LATENCY\" like \"1Gbit,100us\")",
                names.join(", ")
            ))
        })?;
        Ok(Fabric {
            name: s.trim().to_owned(),
            link,
        })
    }

    /// `10 Gbit/s, 30 µs`.
    pub fn describe(&self) -> String {
        describe_link(&self.link)
    }
}

fn describe_link(l: &LinkSpec) -> String {
    let bw = match l.bandwidth {
        Some(b) => format!("{} Gbit/s", md::sig(b * 8.0 / 1e9)),
        None => "unlimited".into(),
    };
    format!("{bw}, {} µs", md::sig(l.latency.as_secs_f64() * 1e6))
}

/// The default projected worker counts: 2, 4, 8, …, 256.
pub const DEFAULT_WORKERS: [usize; 8] = [2, 4, 8, 16, 32, 64, 128, 256];

/// Parses a worker list: `"2,4,8"`, or `"2..256"` for the powers of two in that range.
pub fn parse_workers(s: &str) -> Result<Vec<usize>> {
    let bad = |why: &str| ReportError::Invalid(format!("workers {s:?}: {why}"));
    let num = |x: &str| -> Result<usize> {
        match x.trim().parse::<usize>() {
            Ok(v) if v >= 1 => Ok(v),
            _ => Err(bad(&format!("{:?} is not a worker count (≥ 1)", x.trim()))),
        }
    };
    let mut out: Vec<usize> = if let Some((a, b)) = s.split_once("..") {
        let (a, b) = (num(a)?, num(b)?);
        if a > b {
            return Err(bad("empty range"));
        }
        let mut v = Vec::new();
        let mut p = a.next_power_of_two();
        while p <= b {
            v.push(p);
            p *= 2;
        }
        v
    } else {
        s.split(',').map(num).collect::<Result<_>>()?
    };
    out.sort_unstable();
    out.dedup();
    if out.is_empty() {
        return Err(bad("no worker count"));
    }
    Ok(out)
}

/// The collective a method's gradient exchange uses (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Collective {
    /// Ring all-reduce of the dense f32 gradient (`4·params` bytes).
    DenseAllReduce,
    /// Ring all-reduce of the payload's f32 value lanes (`Summable` methods).
    SummableAllReduce,
    /// Chain broadcast of the leader's index set, then all-reduce of the value lanes
    /// (ScaleCom), each half of the payload.
    BroadcastAllReduce,
    /// Ring all-gatherv of every rank's payload (`Gather` methods).
    AllGather,
    /// Parameter server: push and pull of the payload over `servers` server links.
    ParameterServer {
        /// Server links the payload is sharded over.
        servers: usize,
    },
    /// dtrain-comms' sparse all-reduce of each rank's non-zeros (see the [module
    /// docs](self)).
    SparseAllReduce {
        /// Fraction of another rank's entries that are new to the sum, in [0, 1].
        new_fraction: f64,
    },
    /// dtrain-comms' compressed all-reduce: payload ranges to their owners, re-encoded sums
    /// back (see the [module docs](self)).
    CompressedAllReduce,
    /// dtrain-comms' hierarchical all-reduce of the dense gradient: reduced on each host,
    /// all-reduced among one leader per host, broadcast on each host; P workers are on
    /// `⌈P / per_host⌉` hosts.
    Hierarchical {
        /// Workers per host.
        per_host: usize,
    },
}

impl Collective {
    /// A short name for tables.
    pub fn name(&self) -> String {
        match self {
            Collective::DenseAllReduce => "all-reduce (f32)".into(),
            Collective::SummableAllReduce => "all-reduce (lanes)".into(),
            Collective::BroadcastAllReduce => "broadcast + all-reduce".into(),
            Collective::AllGather => "all-gatherv".into(),
            Collective::ParameterServer { servers } => format!("PS ×{servers}"),
            Collective::SparseAllReduce { new_fraction } => {
                format!("sparse all-reduce (u = {})", md::sig(*new_fraction))
            }
            Collective::CompressedAllReduce => "compressed all-reduce".into(),
            Collective::Hierarchical { per_host } => {
                format!("hierarchical all-reduce ({per_host} per host)")
            }
        }
    }

    /// Parses a collective override: `allreduce` (dense f32), `lanes` (summable lanes),
    /// `allgather`, `broadcast-allreduce`, `sparse-allreduce`, `compressed-allreduce`,
    /// `hierarchical:K` (the dense gradient, hierarchically, K workers per host), or
    /// `ps` / `ps:S` (a parameter server with `S` server links, default 1).
    pub fn parse(s: &str) -> Result<Collective> {
        let t = s.trim().to_ascii_lowercase();
        if let Some(k) = t.strip_prefix("hierarchical:") {
            return match k.parse::<usize>() {
                Ok(per_host) if per_host >= 1 => Ok(Collective::Hierarchical { per_host }),
                _ => Err(ReportError::Invalid(format!(
                    "collective {s:?}: hierarchical:K needs K >= 1 workers per host"
                ))),
            };
        }
        Ok(match t.as_str() {
            "allreduce" | "all-reduce" => Collective::DenseAllReduce,
            "lanes" => Collective::SummableAllReduce,
            "allgather" | "all-gather" | "allgatherv" => Collective::AllGather,
            "broadcast-allreduce" => Collective::BroadcastAllReduce,
            "sparse-allreduce" => Collective::SparseAllReduce { new_fraction: 1.0 },
            "compressed-allreduce" => Collective::CompressedAllReduce,
            "ps" => Collective::ParameterServer { servers: 1 },
            _ => match t.strip_prefix("ps:").map(|n| n.parse::<usize>()) {
                Some(Ok(servers)) if servers >= 1 => Collective::ParameterServer { servers },
                _ => {
                    return Err(ReportError::Invalid(format!(
                        "collective {s:?}: expected allreduce, lanes, allgather, \
                         broadcast-allreduce, sparse-allreduce, compressed-allreduce, \
                         hierarchical:PER_HOST, ps or ps:SERVERS"
                    )))
                }
            },
        })
    }

    /// Whether every rank decodes all P payloads (decompress time grows with P).
    pub fn decodes_all(&self) -> bool {
        matches!(self, Collective::AllGather)
    }
}

/// The model of the collective `run` used ([`Run::collective`]: recorded in `summary.json`,
/// or derived from its `[compress]` table for older runs); an all-gather — the most
/// expensive in P — when neither tells. DLCP is modelled as the dense all-reduce it bounds
/// (it never sends more); a parameter-server run as one server per worker (dtrain's
/// default `servers`).
pub fn collective_of(run: &Run) -> Collective {
    use dtrain_compress::Collective as Recorded;
    match run.collective {
        Some(Recorded::AllReduce | Recorded::Dlcp) => Collective::DenseAllReduce,
        Some(Recorded::Lanes) => Collective::SummableAllReduce,
        Some(Recorded::BroadcastAllReduce) => Collective::BroadcastAllReduce,
        Some(Recorded::SparseAllReduce) => Collective::SparseAllReduce { new_fraction: 1.0 },
        Some(Recorded::CompressedAllReduce) => Collective::CompressedAllReduce,
        Some(Recorded::HierarchicalAllReduce) => Collective::Hierarchical {
            per_host: run
                .summary
                .as_ref()
                .and_then(|s| s.hosts)
                .filter(|&h| h >= 1)
                .map_or(1, |h| run.workers.div_ceil(h)),
        },
        Some(Recorded::ParameterServer) => Collective::ParameterServer {
            servers: run.workers,
        },
        Some(Recorded::AllGather) | None => Collective::AllGather,
    }
}

/// The trainer's default bucket size.
const DEFAULT_BUCKET: f64 = (25u64 << 20) as f64;

/// The step-time model of one measured run (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq)]
pub struct StepModel {
    /// The run's label.
    pub label: String,
    /// Its compression method.
    pub method: String,
    /// The collective its method uses.
    pub collective: Collective,
    /// Workers of the measured run (P₀).
    pub measured_workers: usize,
    /// Measured data + forward + backward + optimizer seconds per step.
    pub compute_s: f64,
    /// Measured compress seconds per step.
    pub compress_s: f64,
    /// Measured decompress seconds per step (at P₀).
    pub decompress_s: f64,
    /// Measured remainder of the step, including the wait at the control all-reduce
    /// (load imbalance between ranks; kept as a fixed per-step cost).
    pub other_s: f64,
    /// Payload bytes per rank per exchange.
    pub payload_bytes: f64,
    /// The fraction of steps that exchange ([`exchange_fraction`]): 1 for every-step
    /// runs, about 1/H for local SGD and DiLoCo.
    pub exchange_fraction: f64,
    /// Dense bytes of one exchange: 4·params (measured or estimated), over F for Streaming
    /// DiLoCo's fragments.
    pub dense_bytes: f64,
    /// Inner steps each exchange may overlap before its result is needed (Streaming
    /// DiLoCo's τ; 0 for every other run): only the part of an exchange longer than τ
    /// steps' computation is exposed.
    pub overlap_steps: f64,
    /// Buckets (collectives) per step.
    pub buckets: usize,
}

impl StepModel {
    /// Builds the model of `run`, labelled `label`.
    pub fn from_run(run: &Run, label: &str) -> Result<StepModel> {
        let m = run.mean_step();
        if m.step_s.is_nan() || m.step_s <= 0.0 {
            return Err(ReportError::Invalid(format!(
                "{}: no step timings to project from",
                run.dir.display()
            )));
        }
        let p0 = run.workers;
        let fraction = exchange_fraction(run);
        let payload = run.payload_bytes_per_step() / fraction;
        // Streaming DiLoCo exchanges one of F fragments at a time.
        let fragments = run
            .summary
            .as_ref()
            .and_then(|s| s.sync_fragments)
            .unwrap_or(1)
            .max(1) as f64;
        let dense = match run.params() {
            Some(n) if n > 0 => 4.0 * n as f64 / fragments,
            _ if p0 >= 2 && run.bytes_sent_per_step() > 0.0 => {
                run.bytes_sent_per_step() / fraction * p0 as f64 / (2.0 * (p0 as f64 - 1.0))
            }
            _ => payload,
        };
        let bucket = run
            .bucket_bytes
            .filter(|b| *b > 0.0)
            .unwrap_or(DEFAULT_BUCKET);
        let mut collective = collective_of(run);
        if let Collective::SparseAllReduce { new_fraction } = &mut collective {
            // Received at P₀: (P₀−1)/P₀·(k + |sum|)·8 ⇒ |sum|, then u from |sum| = k(1 + u(P₀−1)).
            let k = payload / 8.0;
            let received = run.bytes_received_per_step() / fraction;
            if p0 >= 2 && k > 0.0 && received > 0.0 {
                let sum = received / 8.0 * p0 as f64 / (p0 as f64 - 1.0) - k;
                *new_fraction = ((sum / k - 1.0) / (p0 as f64 - 1.0)).clamp(0.0, 1.0);
            }
        }
        Ok(StepModel {
            label: label.to_owned(),
            method: run.method.clone(),
            collective,
            measured_workers: p0,
            compute_s: m.compute_s(),
            compress_s: m.compress_s,
            decompress_s: m.decompress_s,
            other_s: m.other_s() + m.sync_s + m.keep_s,
            payload_bytes: payload,
            exchange_fraction: fraction,
            dense_bytes: dense,
            overlap_steps: run
                .summary
                .as_ref()
                .and_then(|s| s.sync_overlap)
                .unwrap_or(0) as f64,
            buckets: ((dense / bucket).ceil() as usize).max(1),
        })
    }

    /// Uses `c` instead of the method's own collective.
    pub fn with_collective(mut self, c: Collective) -> Self {
        self.collective = c;
        self
    }

    /// Exposed seconds of communication per step on `link` with `p` workers: an
    /// exchange's seconds, less the `overlap_steps` steps of work it runs beside, times
    /// the fraction of steps that exchange.
    pub fn comm_s(&self, link: &LinkSpec, p: usize) -> f64 {
        if p < 2 {
            return 0.0;
        }
        let hidden = self.overlap_steps * self.work_s(p);
        self.exchange_fraction * (self.exchange_s(link, p) - hidden).max(0.0)
    }

    /// A step's seconds without its communication.
    fn work_s(&self, p: usize) -> f64 {
        self.compute_s + self.compress_s + self.decompress_at(p) + self.other_s
    }

    /// Seconds of one exchange on `link` with `p` workers: `B` buckets of the step's bytes,
    /// each costed by [`dtrain_comms::cost`].
    fn exchange_s(&self, link: &LinkSpec, p: usize) -> f64 {
        let b = self.buckets as f64;
        let (dense, payload) = (self.dense_bytes / b, self.payload_bytes / b);
        b * match self.collective {
            Collective::DenseAllReduce => cost::dense_all_reduce(link, dense, p),
            Collective::SummableAllReduce => cost::dense_all_reduce(link, payload, p),
            Collective::BroadcastAllReduce => cost::broadcast_all_reduce(link, payload, p),
            Collective::AllGather => cost::all_gather(link, payload, p),
            Collective::ParameterServer { servers } => {
                link.predict_parameter_server(payload, p, servers)
            }
            // The gathered (u32, f32) pairs: payload / 8 entries.
            Collective::SparseAllReduce { new_fraction } => {
                cost::sparse_all_reduce(link, payload / 8.0, dense / 4.0, new_fraction, p)
            }
            Collective::CompressedAllReduce => cost::compressed_all_reduce(link, payload, p),
            Collective::Hierarchical { per_host } => {
                cost::hierarchical_all_reduce(link, dense, p.div_ceil(per_host.max(1)))
            }
        }
    }

    /// Decompress seconds per step with `p` workers.
    pub fn decompress_at(&self, p: usize) -> f64 {
        if self.collective.decodes_all() {
            self.decompress_s * p as f64 / self.measured_workers.max(1) as f64
        } else {
            self.decompress_s
        }
    }

    /// Projected step seconds on `link` with `p` workers.
    pub fn step_s(&self, link: &LinkSpec, p: usize) -> f64 {
        self.work_s(p) + self.comm_s(link, p)
    }

    /// Step seconds of one worker alone (nothing to compress or exchange).
    pub fn single_worker_s(&self) -> f64 {
        self.compute_s + self.other_s
    }
}

/// What [`simulate`] should project.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Fabrics to project onto (default: all presets).
    pub fabrics: Vec<Fabric>,
    /// Worker counts (default [`DEFAULT_WORKERS`]).
    pub workers: Vec<usize>,
    /// The baseline run among the inputs (label, method or name); `None`: the run with
    /// method `none` when there is exactly one.
    pub baseline: Option<String>,
    /// Overrides every run's collective (e.g. a parameter server).
    pub collective: Option<Collective>,
    /// Where to write `simulate.md` and the plot; `None`: write nothing.
    pub out_dir: Option<PathBuf>,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            fabrics: Fabric::presets(),
            workers: DEFAULT_WORKERS.to_vec(),
            baseline: None,
            collective: None,
            out_dir: None,
        }
    }
}

/// One projected point.
#[derive(Debug, Clone, PartialEq)]
pub struct SimPoint {
    /// Run label.
    pub run: String,
    /// Fabric name.
    pub fabric: String,
    /// Workers.
    pub workers: usize,
    /// Projected step seconds.
    pub step_s: f64,
    /// Its communication part.
    pub comm_s: f64,
    /// Baseline step time ÷ this run's at the same fabric and P.
    pub speedup: Option<f64>,
    /// Throughput relative to one worker: `P · T(1) / T(P)`.
    pub scaling: f64,
}

/// What [`simulate`] produced.
#[derive(Debug, Clone)]
pub struct SimOutput {
    /// Markdown: the model per run and one table per fabric.
    pub markdown: String,
    /// Every projected point.
    pub points: Vec<SimPoint>,
    /// The models used, one per run.
    pub models: Vec<StepModel>,
    /// Files written (`simulate.md`, `speedup_vs_workers.svg` / `.png`).
    pub files: Vec<PathBuf>,
}

/// Projects the runs under `inputs` (run directories or `summary.json` files) onto
/// `opts.fabrics` × `opts.workers` (see the [module docs](self)).
pub fn simulate(inputs: &[PathBuf], opts: &SimOptions) -> Result<SimOutput> {
    simulate_runs(&load_runs(inputs)?, opts)
}

fn pick_baseline(runs: &[Run], labels: &[String], want: Option<&str>) -> Result<Option<usize>> {
    let matches: Vec<usize> = match want {
        Some(w) => {
            let l: Vec<usize> = (0..runs.len()).filter(|&i| labels[i] == w).collect();
            if l.is_empty() {
                (0..runs.len())
                    .filter(|&i| runs[i].method == w || runs[i].name == w)
                    .collect()
            } else {
                l
            }
        }
        None => (0..runs.len())
            .filter(|&i| runs[i].method == dtrain_compress::BASELINE)
            .collect(),
    };
    match (&matches[..], want) {
        (&[i], _) => Ok(Some(i)),
        ([], None) => Ok(None),
        (_, None) => Ok(None),
        ([], Some(w)) => Err(ReportError::Baseline(format!(
            "{w:?} matches no run; runs: {}",
            labels.join(", ")
        ))),
        (_, Some(w)) => Err(ReportError::Baseline(format!(
            "{w:?} matches several runs; name one by its label: {}",
            matches
                .iter()
                .map(|&i| labels[i].as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// [`simulate`] for runs already read.
pub fn simulate_runs(runs: &[Run], opts: &SimOptions) -> Result<SimOutput> {
    if runs.is_empty() {
        return Err(ReportError::NoInput);
    }
    if opts.fabrics.is_empty() || opts.workers.is_empty() || opts.workers.contains(&0) {
        return Err(ReportError::Invalid(
            "simulate needs at least one fabric and worker counts ≥ 1".into(),
        ));
    }
    let labels = labels(runs);
    let base = pick_baseline(runs, &labels, opts.baseline.as_deref())?;
    let models: Vec<StepModel> = runs
        .iter()
        .zip(&labels)
        .map(|(r, l)| {
            let m = StepModel::from_run(r, l)?;
            Ok(match opts.collective {
                Some(c) => m.with_collective(c),
                None => m,
            })
        })
        .collect::<Result<_>>()?;
    let mut workers = opts.workers.clone();
    workers.sort_unstable();
    workers.dedup();

    let mut points = Vec::new();
    for f in &opts.fabrics {
        for &p in &workers {
            let tb = base.map(|b| models[b].step_s(&f.link, p));
            for m in &models {
                let t = m.step_s(&f.link, p);
                points.push(SimPoint {
                    run: m.label.clone(),
                    fabric: f.name.clone(),
                    workers: p,
                    step_s: t,
                    comm_s: m.comm_s(&f.link, p),
                    speedup: tb.map(|tb| tb / t),
                    scaling: p as f64 * m.single_worker_s() / t,
                });
            }
        }
    }

    let markdown = sim_markdown(
        &models,
        base.map(|b| labels[b].as_str()),
        opts,
        &workers,
        &points,
    );
    let mut files = Vec::new();
    if let Some(dir) = &opts.out_dir {
        fs::create_dir_all(dir).map_err(|e| ReportError::io(dir, e))?;
        let path = dir.join("simulate.md");
        fs::write(&path, &markdown).map_err(|e| ReportError::io(&path, e))?;
        files.push(path);
        files.extend(sim_plot(
            dir,
            base.map(|b| labels[b].as_str()),
            opts,
            &points,
        )?);
    }
    Ok(SimOutput {
        markdown,
        points,
        models,
        files,
    })
}

fn sim_markdown(
    models: &[StepModel],
    base: Option<&str>,
    opts: &SimOptions,
    workers: &[usize],
    points: &[SimPoint],
) -> String {
    let mut out = String::from("# dtrain simulate\n\n");
    out.push_str(
        "Projected step time T(P) = compute + compress + decompress(P) + comm(P) + other, \
         from each run's measured mean step and an α–β model of its collective \
         (no overlap but Streaming DiLoCo's τ steps, nominal link rates). Speed-up = baseline T(P) ÷ run T(P) on the same \
         fabric; scaling = P · T(1) / T(P).\n\n",
    );
    match base {
        Some(b) => {
            let _ = writeln!(out, "Baseline: {b}.\n");
        }
        None => out.push_str("No baseline run: speed-ups are not shown.\n\n"),
    }
    out.push_str("## Models\n\n");
    let mut t = Table::new(&[
        "run",
        "method",
        "collective",
        "P₀",
        "compute ms",
        "compress ms",
        "decompress ms (P₀)",
        "other ms",
        "payload/step",
        "4·params",
        "buckets",
    ])
    .align(1, md::Align::Left)
    .align(2, md::Align::Left);
    for m in models {
        t.row(&[
            m.label.clone(),
            m.method.clone(),
            m.collective.name(),
            m.measured_workers.to_string(),
            md::ms(m.compute_s),
            md::ms(m.compress_s),
            md::ms(m.decompress_s),
            md::ms(m.other_s),
            md::bytes(m.payload_bytes),
            md::bytes(m.dense_bytes),
            m.buckets.to_string(),
        ]);
    }
    out.push_str(&t.render());

    for f in &opts.fabrics {
        let _ = writeln!(out, "\n## {} ({})\n", f.name, f.describe());
        let mut head = vec!["P".to_owned()];
        for m in models {
            head.push(format!("{} step ms", m.label));
            head.push(format!("{} comm ms", m.label));
            if base.is_some_and(|b| b != m.label) {
                head.push(format!("{} speed-up", m.label));
            }
            head.push(format!("{} scaling", m.label));
        }
        let mut t = Table::new(&head);
        for &p in workers {
            let mut cells = vec![p.to_string()];
            for m in models {
                let Some(pt) = points
                    .iter()
                    .find(|x| x.fabric == f.name && x.workers == p && x.run == m.label)
                else {
                    continue;
                };
                cells.push(md::ms(pt.step_s));
                cells.push(md::ms(pt.comm_s));
                if base.is_some_and(|b| b != m.label) {
                    cells.push(pt.speedup.map(md::factor).unwrap_or_else(|| "–".into()));
                }
                cells.push(md::sig(pt.scaling));
            }
            t.row(&cells);
        }
        out.push_str(&t.render());
    }
    out
}

fn sim_plot(
    dir: &std::path::Path,
    base: Option<&str>,
    opts: &SimOptions,
    points: &[SimPoint],
) -> Result<Vec<PathBuf>> {
    let mut runs: Vec<&str> = Vec::new();
    for p in points {
        if !runs.contains(&p.run.as_str()) {
            runs.push(&p.run);
        }
    }
    // Speed-up vs the baseline when there is one (and another run); else the scaling of
    // every run.
    let vs_base = base.is_some() && runs.iter().any(|r| Some(*r) != base);
    if vs_base {
        runs.retain(|r| Some(*r) != base);
    }
    let (title, y) = if vs_base {
        (
            format!("Projected speed-up vs {}", base.unwrap_or_default()),
            "speed-up (×)",
        )
    } else {
        (
            "Projected scaling vs one worker".to_owned(),
            "P · T(1) / T(P)",
        )
    };
    // One panel per fabric, one line per run.
    let panels: Vec<LinePlot> = opts
        .fabrics
        .iter()
        .map(|f| LinePlot {
            title: format!("{} ({})", f.name, f.describe()),
            x_label: "workers (P)".into(),
            y_label: y.into(),
            x_scale: Scale::Log2,
            y_scale: Scale::Linear,
            y_from_zero: true,
            markers: true,
            connect: true,
            references: Vec::new(),
            y_format: md::tick,
            legend: Legend::UpperLeft,
            series: runs
                .iter()
                .map(|r| Series {
                    label: (*r).to_owned(),
                    points: points
                        .iter()
                        .filter(|p| p.fabric == f.name && p.run == *r)
                        .filter_map(|p| {
                            let y = if vs_base { p.speedup? } else { p.scaling };
                            Some((p.workers as f64, y))
                        })
                        .collect(),
                })
                .collect(),
        })
        .collect();
    plot::line_grid(dir, "speedup_vs_workers", &title, &panels)
}

/// One emulated run: the model's prediction at the run's own link and worker count vs
/// the measured step time.
#[derive(Debug, Clone, PartialEq)]
pub struct Validation {
    /// Run label.
    pub run: String,
    /// Workers.
    pub workers: usize,
    /// The emulated link, as configured.
    pub link: String,
    /// Measured mean step seconds.
    pub measured_step_s: f64,
    /// Predicted step seconds.
    pub predicted_step_s: f64,
    /// Measured time inside collectives per step.
    pub measured_communicate_s: f64,
    /// Measured time the step waited for communication.
    pub measured_wait_s: f64,
    /// Predicted communication seconds.
    pub predicted_comm_s: f64,
    /// `(predicted − measured) / measured` step time.
    pub rel_error: f64,
}

/// What [`validate`] produced.
#[derive(Debug, Clone)]
pub struct ValidationOutput {
    /// A markdown table of the comparisons.
    pub markdown: String,
    /// One row per emulated run.
    pub rows: Vec<Validation>,
    /// Labels of input runs skipped for having no `[network]` link.
    pub skipped: Vec<String>,
}

/// Checks the model against runs made on an emulated link (see the [module docs](self)).
pub fn validate(inputs: &[PathBuf]) -> Result<ValidationOutput> {
    validate_runs(&load_runs(inputs)?)
}

/// [`validate`] for runs already read. Runs without `[network]` are skipped; an error if
/// none is left.
pub fn validate_runs(runs: &[Run]) -> Result<ValidationOutput> {
    if runs.is_empty() {
        return Err(ReportError::NoInput);
    }
    let labels = labels(runs);
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    for (r, l) in runs.iter().zip(&labels) {
        let Some(net) = r.network.as_ref().filter(|n| n.link.is_shaped()) else {
            skipped.push(l.clone());
            continue;
        };
        let m = StepModel::from_run(r, l)?;
        let mean = r.mean_step();
        let pred = m.step_s(&net.link, r.workers);
        rows.push(Validation {
            run: l.clone(),
            workers: r.workers,
            link: net.label(),
            measured_step_s: mean.step_s,
            predicted_step_s: pred,
            measured_communicate_s: mean.communicate_s,
            measured_wait_s: mean.wait_s,
            predicted_comm_s: m.comm_s(&net.link, r.workers),
            rel_error: (pred - mean.step_s) / mean.step_s,
        });
    }
    if rows.is_empty() {
        return Err(ReportError::Invalid(
            "validate: no run has an emulated link ([network] bandwidth / latency)".into(),
        ));
    }
    let mut out = String::from(
        "# Simulator validation on emulated links\n\nPredicted step time (the simulator's \
         model at the run's own link and P) vs the measured mean step time.\n\n",
    );
    let mut t = Table::new(&[
        "run",
        "P",
        "link",
        "measured step ms",
        "predicted step ms",
        "measured comm ms",
        "measured wait ms",
        "predicted comm ms",
        "error",
    ])
    .align(2, md::Align::Left);
    for v in &rows {
        t.row(&[
            v.run.clone(),
            v.workers.to_string(),
            v.link.clone(),
            md::ms(v.measured_step_s),
            md::ms(v.predicted_step_s),
            md::ms(v.measured_communicate_s),
            md::ms(v.measured_wait_s),
            md::ms(v.predicted_comm_s),
            format!("{:+.1} %", v.rel_error * 100.0),
        ]);
    }
    out.push_str(&t.render());
    let worst = rows.iter().map(|v| v.rel_error.abs()).fold(0.0, f64::max);
    let _ = writeln!(out, "\nLargest |error|: {:.1} %.", worst * 100.0);
    if !skipped.is_empty() {
        let _ = writeln!(out, "\nSkipped (no emulated link): {}.", skipped.join(", "));
    }
    Ok(ValidationOutput {
        markdown: out,
        rows,
        skipped,
    })
}

/// The fraction of a run's steps that exchange: the share of its timed steps that sent
/// bytes (a measured multi-worker run), else `1/H` from `summary.json`'s `sync_period`,
/// else 1. Local SGD and DiLoCo (`[sync]`) exchange the parameter change once per `H`
/// steps, post-local SGD every step before its switch and once per `H` after it; the
/// measured share covers all three.
pub fn exchange_fraction(run: &Run) -> f64 {
    let steps = run.timed_steps();
    let sent = steps.iter().filter(|r| r.bytes_sent > 0).count();
    if run.workers >= 2 && sent > 0 {
        return sent as f64 / steps.len() as f64;
    }
    match run.summary.as_ref().and_then(|s| s.sync_period) {
        Some(h) if h > 0 => 1.0 / h as f64,
        _ => 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_all_reduce_model_beats_all_gather_at_one_percent() {
        let link = LinkSpec::parse(Some("10Gbit"), Some("10us")).unwrap();
        let model = |c: Collective| StepModel {
            label: "x".into(),
            method: "topk".into(),
            collective: c,
            measured_workers: 4,
            compute_s: 0.0,
            compress_s: 0.0,
            decompress_s: 0.0,
            other_s: 0.0,
            // 1 % of 4 M parameters as (index, value) pairs.
            payload_bytes: 40_000.0 * 8.0,
            exchange_fraction: 1.0,
            dense_bytes: 4.0 * 4_000_000.0,
            overlap_steps: 0.0,
            buckets: 1,
        };
        let gather = model(Collective::AllGather);
        let independent = model(Collective::SparseAllReduce { new_fraction: 1.0 });
        let shared = model(Collective::SparseAllReduce { new_fraction: 0.1 });
        for p in [4usize, 16, 64] {
            assert!(shared.comm_s(&link, p) < gather.comm_s(&link, p), "P={p}");
        }
        // Independent sets at 1 %: the delta-coded entries (≈ 5 bytes against the pairs' 8)
        // already beat the all-gather at P = 4, and the margin grows with P …
        assert!(independent.comm_s(&link, 4) < gather.comm_s(&link, 4));
        // … and once the sum goes dense its cost stops growing with P.
        let (a, b) = (
            independent.comm_s(&link, 128),
            independent.comm_s(&link, 256),
        );
        assert!(
            b < 1.01 * a && b < gather.comm_s(&link, 256) / 4.0,
            "{a} {b}"
        );
        assert!(matches!(
            Collective::parse("sparse-allreduce").unwrap(),
            Collective::SparseAllReduce { .. }
        ));
    }

    #[test]
    fn infrequent_synchronisation_pays_its_exchange_once_per_period() {
        // Local SGD with H = 8 exchanges the dense model once per 8 steps: an eighth of the
        // every-step ring's time per step, latency terms included.
        let link = LinkSpec::parse(Some("100Mbit"), Some("50us")).unwrap();
        let model = |f: f64| StepModel {
            label: "x".into(),
            method: "none".into(),
            collective: Collective::DenseAllReduce,
            measured_workers: 2,
            compute_s: 0.01,
            compress_s: 0.0,
            decompress_s: 0.0,
            other_s: 0.0,
            payload_bytes: 4.0 * 1e6,
            exchange_fraction: f,
            dense_bytes: 4.0 * 1e6,
            overlap_steps: 0.0,
            buckets: 2,
        };
        let (every, local) = (model(1.0), model(0.125));
        for p in [2usize, 8, 64] {
            let (e, l) = (every.comm_s(&link, p), local.comm_s(&link, p));
            assert!((l - e / 8.0).abs() < 1e-12 * e, "P={p}: {l} vs {e}");
            assert!(local.step_s(&link, p) < every.step_s(&link, p));
        }
    }

    #[test]
    fn an_overlapped_exchange_exposes_only_what_outlasts_its_steps() {
        // Streaming DiLoCo: a fragment of 1 MB every 2 of 8 steps, overlapping τ steps of
        // 10 ms; on 100 Mbit/s one exchange takes tens of ms, of which τ·10 ms are hidden.
        let link = LinkSpec::parse(Some("100Mbit"), Some("50us")).unwrap();
        let model = |tau: f64| StepModel {
            label: "x".into(),
            method: "none".into(),
            collective: Collective::DenseAllReduce,
            measured_workers: 2,
            compute_s: 0.01,
            compress_s: 0.0,
            decompress_s: 0.0,
            other_s: 0.0,
            payload_bytes: 1e6,
            exchange_fraction: 0.25,
            dense_bytes: 1e6,
            overlap_steps: tau,
            buckets: 1,
        };
        for p in [2usize, 8, 64] {
            let blocking = model(0.0).comm_s(&link, p);
            let one = blocking / 0.25;
            assert!(one > 0.03, "P={p}: {one}");
            let tau1 = model(1.0).comm_s(&link, p);
            assert!((tau1 - 0.25 * (one - 0.01)).abs() < 1e-12, "P={p}: {tau1}");
            // Enough overlap hides the whole exchange: the step is the computation.
            assert_eq!(model(1e3).comm_s(&link, p), 0.0);
            assert_eq!(model(1e3).step_s(&link, p), 0.01);
        }
    }

    #[test]
    fn compressed_all_reduce_model_stays_flat_in_the_worker_count() {
        // 4-bit QSGD of 4 M parameters: the all-gather's bytes grow with P − 1 and pass the
        // dense ring's at about P = 16; the compressed all-reduce's stay under two payloads.
        let link = LinkSpec::parse(Some("10Gbit"), Some("10us")).unwrap();
        let model = |c: Collective, payload: f64| StepModel {
            label: "x".into(),
            method: "qsgd".into(),
            collective: c,
            measured_workers: 2,
            compute_s: 0.0,
            compress_s: 0.0,
            decompress_s: 1.0,
            other_s: 0.0,
            payload_bytes: payload,
            exchange_fraction: 1.0,
            dense_bytes: 4.0 * 4_000_000.0,
            overlap_steps: 0.0,
            buckets: 1,
        };
        let q = 4.0 * 4_000_000.0 / 8.0;
        let (gather, car, dense) = (
            model(Collective::AllGather, q),
            model(Collective::CompressedAllReduce, q),
            model(Collective::DenseAllReduce, 4.0 * 4_000_000.0),
        );
        assert!(gather.comm_s(&link, 32) > dense.comm_s(&link, 32));
        for p in [2usize, 8, 64, 256] {
            let c = car.comm_s(&link, p);
            assert!(
                c < 2.0 * q / 1.25e9 + 1e-4 && c < dense.comm_s(&link, p) / 3.0,
                "P={p}: {c}"
            );
        }
        // Decoding stays one buffer's worth: the owners' sums, not P payloads.
        assert_eq!(car.decompress_at(64), 1.0);
        assert_eq!(gather.decompress_at(64), 32.0);
        assert_eq!(
            Collective::parse("compressed-allreduce").unwrap(),
            Collective::CompressedAllReduce
        );
    }

    #[test]
    fn collective_overrides_parse_and_bad_ones_are_named() {
        assert_eq!(
            Collective::parse("allgather").unwrap(),
            Collective::AllGather
        );
        assert_eq!(
            Collective::parse("PS:4").unwrap(),
            Collective::ParameterServer { servers: 4 }
        );
        assert_eq!(
            Collective::parse("ps").unwrap(),
            Collective::ParameterServer { servers: 1 }
        );
        for bad in ["ps:0", "ps:x", "ring", ""] {
            let e = Collective::parse(bad).unwrap_err().to_string();
            assert!(e.contains("collective"), "{e}");
        }
    }

    #[test]
    fn fabrics_parse() {
        let f = Fabric::parse("ib_edr").unwrap();
        assert_eq!(f.name, "IB-EDR");
        assert_eq!(f.link.bandwidth, Some(12.5e9));
        assert_eq!(
            Fabric::parse("10gbe").unwrap().link.latency,
            Duration::from_micros(30)
        );
        let c = Fabric::parse("1Gbit,100us").unwrap();
        assert_eq!(c.link.bandwidth, Some(125e6));
        assert_eq!(c.link.latency, Duration::from_micros(100));
        assert_eq!(c.describe(), "1.00 Gbit/s, 100 µs");
        let e = Fabric::parse("warp-drive").unwrap_err().to_string();
        assert!(e.contains("warp-drive") && e.contains("IB-HDR"), "{e}");
    }

    #[test]
    fn workers_parse() {
        assert_eq!(parse_workers("8,2,4,4").unwrap(), vec![2, 4, 8]);
        assert_eq!(parse_workers("2..256").unwrap(), DEFAULT_WORKERS.to_vec());
        assert_eq!(parse_workers("3..20").unwrap(), vec![4, 8, 16]);
        assert!(parse_workers("0").is_err());
        assert!(parse_workers("8..2").is_err());
        assert!(parse_workers("x").is_err());
    }
}
