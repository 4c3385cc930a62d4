//! The gradient exchange of one data-parallel step: bucket → compensate → compress → the
//! collective the method's aggregation needs → decompress / sum → average.
//!
//! | aggregation | collective | receive side |
//! |---|---|---|
//! | uncompressed bucket (or sent uncompressed by `auto`) | all-reduce sum (f32), hierarchical over several hosts | — |
//! | `Dense` | decode own payload, all-reduce sum | — |
//! | `Summable` | all-reduce sum of the payload's f32 value lanes | decode the summed payload once |
//! | `Gather` | all-gather(v) of payload bytes | decode and add every rank's payload |
//! | `Gather`, [`GatherCollective::SparseAllReduce`] | decode own payload; sparse all-reduce of its non-zeros | — |
//! | `Gather` or `Dense`, [`GatherCollective::CompressedAllReduce`] | one payload per owner's range; each owner decodes, sums, re-encodes | decode the P re-encoded sums |
//! | two-phase (ScaleCom) | broadcast of the root's agreement, then the above | as above |
//!
//! Every rank ends with bit-identical averaged gradients: all-reduce sums are bit-identical
//! by construction in dtrain-comms, and gathered payloads are decoded in rank order.
//!
//! ## Sparse all-reduce instead of all-gather
//! With [`GatherCollective::SparseAllReduce`] (`[compress] collective = "sparse-allreduce"`)
//! a `Gather` method's bucket is not gathered: every rank decodes its own payload and the
//! non-zeros of the result go through dtrain-comms' sparse all-reduce (each rank owns an
//! index range, sums the shares of its range in rank order, and sends the reduced range to
//! everyone; a range switches to a dense encoding once that is cheaper). Each rank then
//! receives about `(P−1)/P·(k + |sum|)` delta-coded entries (≈ 5 bytes) instead of `(P−1)·k`
//! 8-byte pairs: less from P = 3 on even for independent index sets, far less when they
//! overlap (the usual case for top-k / DGC gradients), and never the
//! "gradient build-up" of decoding P payloads. The sum is taken in rank order from `+0.0`,
//! exactly as the gathered payloads are added, so both collectives give bit-identical
//! gradients (tested for every sparse method).
//!
//! ## Compressed all-reduce
//! With [`GatherCollective::CompressedAllReduce`] (`[compress] collective =
//! "compressed-allreduce"`) a bucket is cut into P ranges (rank `q` owns
//! [`segment_range`](dtrain_comms::segment_range)`(n, P, q)`), each compensated range is
//! encoded on its own ([`Pipeline::compress_chunks`]; the worker's memory learns from all of
//! them), and dtrain-comms' compressed all-reduce sends each payload to its owner. The owner
//! decodes its range's P payloads, sums them in rank order and encodes the sum with a
//! pipeline of its own ([`Pipeline::reduce_shares`]), whose residual memory is the "server"
//! side of two-way error feedback (Tang et al., 2021) when the run has error feedback and
//! the method averages (a majority vote re-encodes the plain sum: signSGD's vote). Every rank
//! decodes the P encoded sums into the bucket: bit-identical everywhere. A rank sends about
//! twice one payload whatever P, where the all-gather sends P − 1 payloads; the price is a
//! second quantisation of the sum. The server residuals are in [`ExchangerState`].
//!
//! ## Automatic choice, and hierarchy
//! With [`GatherCollective::Auto`] (`[compress] collective = "auto"`, the default) every
//! compressed bucket takes the route the α–β model predicts cheapest on the run's link with
//! the method's measured codec costs — sent uncompressed, or the method's payloads through
//! the all-gather, the sparse all-reduce or the compressed all-reduce — decided once, alike on
//! every rank, and kept in checkpoints (see [`auto`]). With ranks on several hosts, some with
//! several ranks ([`Exchanger::set_topology`]), the dense buckets go through dtrain-comms'
//! hierarchical all-reduce: reduced on each host, all-reduced among one leader per host,
//! broadcast on each host; only the leaders' all-reduce crosses between hosts.
//!
//! ## Two-phase methods (ScaleCom's CLT-k)
//! A compressor whose [`Compressor::broadcast_root`](dtrain_compress::Compressor::broadcast_root) names a root (ScaleCom: the leader
//! `step mod P`) runs the agreement protocol of that method before compressing: every rank
//! compensates its gradient with its memory; the root encodes its message (ScaleCom: the
//! top-k index set of its compensated gradient); the message is broadcast from the root;
//! every rank installs it and compresses at it; the memory is updated with the rank's own
//! decoded payload; the payloads' value lanes are all-reduced and the sum decoded once.
//! See [`dtrain_compress::Pipeline`] for the calls.
//!
//! The world size is the communicator's: before every step the exchanger hands it to every
//! compressor ([`Compressor::set_world_size`](dtrain_compress::Compressor::set_world_size)), which **overrides** a world size written in
//! the method's config (ScaleCom's `workers`, whose default is 1), so a config need not
//! repeat `[cluster] workers`.
//!
//! ## Overlap
//! With [`Exchanger::set_overlap`] on (the default) the collectives run on a second thread
//! (scoped to the call) while the calling thread compresses and decompresses: bucket `i`'s
//! communication overlaps the compression of bucket `i + 1` and the decompression of bucket
//! `i − 1`, the way DDP overlaps buckets with backward. Both paths run the same static
//! schedule (per bucket `i`: [the second phase of `i`,] the first phase of `i + 1`, then
//! finish `i`), so the collectives are issued in the same order on every rank and the
//! results are bit-identical to the sequential path (overlap off). [`ExchangeStats`]
//! documents what each timing means in both modes.
//!
//! ## Layout
//! The gradient goes out and comes back inside this folder: [`bucket`] plans the
//! layer-aligned buckets and gathers / scatters them; `dense` is the fast path where every
//! bucket goes dense; `schedule` the static per-bucket schedule of a compressed (or DLCP)
//! exchange and each bucket's [`Route`]; [`auto`] the automatic choice of routes; `link`
//! runs the collectives inline or on the communication thread; `state` is what an exchanger
//! carries across steps ([`ExchangerState`]); [`device`] encodes buckets on a GPU
//! (`[compress] device`).

pub mod auto;
pub mod bucket;
mod dense;
pub mod device;
mod link;
mod schedule;
mod state;

use std::collections::BTreeMap;
use std::sync::Arc;

use dtrain_comms::dlcp::{DlcpConfig, DlcpTensor};
use dtrain_comms::shaping::LinkSpec;
use dtrain_comms::topology::Topology;
use dtrain_comms::{CommError, Communicator, Transport};
use dtrain_compress::memory::DlcpResidual;
use dtrain_compress::{
    Collective, CompressError, CompressorConfig, ConfigError, MemoryConfig, Pipeline, WireError,
};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use bucket::{Bucket, BucketPolicy, ParamInfo};
use dense::contiguous;
pub use device::{DeviceGradient, DeviceUse};
pub use schedule::Route;
use schedule::{Flight, OwnerReduce, Slot};
pub(crate) use state::bits;
pub use state::{BucketShape, ExchangerState};

/// Why an exchange failed.
#[derive(Debug, Error)]
pub enum ExchangeError {
    /// The collective failed (names the peer where one is to blame).
    #[error("communication failed in bucket {bucket}: {source}")]
    Comm {
        /// Bucket id.
        bucket: u64,
        /// The collective's error.
        source: CommError,
    },
    /// The local gradient could not be compressed (e.g. non-finite values), or a two-phase
    /// method's agreement message did not fit.
    #[error("compression failed in bucket {bucket}: {source}")]
    Compress {
        /// Bucket id.
        bucket: u64,
        /// The compressor's error.
        source: CompressError,
    },
    /// A payload received from a peer did not decode.
    #[error("payload from rank {rank} in bucket {bucket} did not decode: {source}")]
    Decode {
        /// Sending rank.
        rank: usize,
        /// Bucket id.
        bucket: u64,
        /// The decoder's error.
        source: WireError,
    },
    /// The device encoding or decoding a bucket failed (`[compress] device`).
    #[error("the device path of bucket {bucket} failed: {reason}")]
    Device {
        /// Bucket id.
        bucket: u64,
        /// What the device said.
        reason: String,
    },
    /// Restored state does not fit this run (found when it is first used).
    #[error("exchanger state: {0}")]
    State(String),
    /// The flat gradient does not match the parameter listing.
    #[error("gradient has {got} elements, the model lists {want}")]
    Length {
        /// Elements the model's parameters add up to.
        want: usize,
        /// Elements given.
        got: usize,
    },
}

/// Time and bytes of one exchange.
///
/// The calling thread's wall time of [`Exchanger::exchange`] is about
/// `compress_s + decompress_s + wait_s` in both modes. With overlap off, every collective
/// runs on the calling thread and `wait_s == communicate_s`. With overlap on, the
/// collectives run on the communication thread; `communicate_s` is that thread's busy time,
/// `wait_s` the part of it the calling thread could not hide behind (de)compression, so
/// `communicate_s − wait_s` estimates the hidden communication.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ExchangeStats {
    /// Seconds the calling thread spent before communication: gathering buckets,
    /// compensate + compress (including the own-payload decode for error feedback), a
    /// two-phase method's agreement message and install, the own decode of `Dense` methods
    /// and the extraction of `Summable` value lanes.
    pub compress_s: f64,
    /// Seconds inside collectives (sum over collectives of their duration, measured where
    /// they run). Overlaps `compress_s` / `decompress_s` when overlapping.
    pub communicate_s: f64,
    /// Seconds the calling thread was blocked on communication: waiting for a collective's
    /// result that was not ready (overlap on), or running it (overlap off, then equal to
    /// `communicate_s`).
    #[serde(default)]
    pub wait_s: f64,
    /// Seconds the calling thread spent after communication: decoding and summing received
    /// payloads, averaging and scattering into the flat gradient.
    pub decompress_s: f64,
    /// Bytes this rank sent (framing included).
    pub bytes_sent: u64,
    /// Bytes this rank received (framing included).
    pub bytes_received: u64,
    /// Bytes of this rank's encoded payloads (what a perfect transport would send), plus
    /// the agreement messages this rank broadcast as root.
    pub payload_bytes: u64,
    /// Elements exchanged (the model size).
    pub elements: u64,
    /// DLCP: gradient elements (all workers' contributions) the bounded-loss all-reduce
    /// completed without, this exchange.
    #[serde(default)]
    pub lossy_dropped: u64,
    /// DLCP: gradient elements (all workers' contributions) it carried.
    #[serde(default)]
    pub lossy_elems: u64,
    /// DLCP: packets this worker retransmitted.
    #[serde(default)]
    pub retransmitted: u64,
    /// Whether the averaged gradient holds a NaN or an infinity, where the exchange already
    /// found out while writing it (the uncompressed path checks in its averaging pass, the
    /// bucket pipeline as it writes each average back, so the caller need not scan the
    /// gradient again); `None` where it did not look.
    #[serde(default)]
    pub non_finite: Option<bool>,
}

/// Which collective carries the payloads of a compressed bucket (the method's aggregation
/// has the last word: [`Collective::of`]). Its serde names are the config's spelling
/// (`[compress] collective`); a run's default is [`GatherCollective::Auto`], an
/// [`Exchanger`]'s before [`Exchanger::set_gather_collective`] the all-gather.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum GatherCollective {
    /// Per bucket, the cheapest by the α–β model ([`auto`]): the dense all-reduce (the
    /// bucket is sent uncompressed), or the method's payloads through the all-gather, the
    /// sparse all-reduce or the compressed all-reduce, whichever the method allows.
    #[default]
    #[serde(rename = "auto")]
    Auto,
    /// All-gather(v) of the payload bytes; every rank decodes all of them.
    #[serde(rename = "allgather")]
    AllGather,
    /// Sparse all-reduce of each rank's decoded payload (see the [module docs](self)).
    #[serde(rename = "sparse-allreduce")]
    SparseAllReduce,
    /// The compressed all-reduce: each owner re-encodes its range's sum (see the
    /// [module docs](self)); `Dense` methods' buckets take it too.
    #[serde(rename = "compressed-allreduce")]
    CompressedAllReduce,
}

impl GatherCollective {
    /// Every variant, in the order the docs list them.
    pub const ALL: [GatherCollective; 4] = [
        GatherCollective::Auto,
        GatherCollective::AllGather,
        GatherCollective::SparseAllReduce,
        GatherCollective::CompressedAllReduce,
    ];

    /// The config's spelling (`auto`, `allgather`, `sparse-allreduce`,
    /// `compressed-allreduce`).
    pub fn name(self) -> &'static str {
        self.fixed().map_or("auto", Collective::name)
    }

    /// The collective asked for, as a run records it; `None` for
    /// [`GatherCollective::Auto`], which chooses per bucket.
    pub fn fixed(self) -> Option<Collective> {
        match self {
            GatherCollective::Auto => None,
            GatherCollective::AllGather => Some(Collective::AllGather),
            GatherCollective::SparseAllReduce => Some(Collective::SparseAllReduce),
            GatherCollective::CompressedAllReduce => Some(Collective::CompressedAllReduce),
        }
    }
}

impl std::fmt::Display for GatherCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for GatherCollective {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|c| c.name()).collect();
                format!("unknown collective {s:?} ({})", names.join(", "))
            })
    }
}

/// DLCP for the dense buckets ([`Exchanger::set_dlcp`]), built once: the configuration and
/// each bucket's tensors are shared with every round instead of rebuilt per step.
struct Lossy {
    cfg: Arc<DlcpConfig>,
    /// Whether dropped values return to the next gradient.
    error_feedback: bool,
    /// Per bucket id: its parameters as DLCP tensors, numbered by model position.
    tensors: BTreeMap<u64, Arc<[DlcpTensor]>>,
}

/// Compresses and exchanges flat gradients, bucket by bucket. One per worker.
pub struct Exchanger {
    slots: Vec<Slot>,
    /// The ranges the dense path averages ([`dense::dense_plan`]).
    dense_plan: Vec<std::ops::Range<usize>>,
    total: usize,
    seed: u64,
    method: &'static str,
    /// The method's configuration (the compressed all-reduce's owners build their own
    /// compressors from it).
    method_cfg: CompressorConfig,
    /// Server residuals restored from a checkpoint, installed when the owners' pipelines
    /// are built (at the first compressed all-reduce, which knows the world size).
    server_state: BTreeMap<u64, Vec<f32>>,
    /// Whether the owners keep a server residual; `None`: when the workers have error
    /// feedback and the method averages.
    server_ef: Option<bool>,
    memory: MemoryConfig,
    overlap: bool,
    gather: GatherCollective,
    /// With [`GatherCollective::Auto`], whether the buckets' routes are still to be chosen
    /// (at the first exchange, unless chosen before or restored from a checkpoint).
    auto_pending: bool,
    /// The emulated link the automatic choice models (`[network]`); `None`: probe it.
    link: Option<LinkSpec>,
    /// The hosts of the hierarchical dense all-reduce; `None`: the flat one.
    hosts: Option<Arc<Topology>>,
    /// What the automatic choice measured and chose, once made in this process.
    auto_report: Option<auto::AutoReport>,
    theta_scale: f64,
    /// Buffers of finished buckets, reused by the next ones.
    spare: Vec<Flight>,
    /// DLCP for the dense buckets, and whether dropped values return to the sender.
    lossy: Option<Lossy>,
    /// DLCP error feedback: per dense bucket, this worker's values no owner used last time.
    lossy_residual: DlcpResidual,
    /// The device the compressed buckets are encoded on (`Exchanger::set_codec_device`)
    /// and why buckets stay on the host.
    device: Option<(String, Vec<String>)>,
    /// With a device gradient: whether the device buckets' averages are decoded into it
    /// (`Exchanger::exchange_device`), and which buckets were (by slot).
    mean_on_device: bool,
    decoded_on_device: Vec<bool>,
    /// Whether that device is the one the worker's gradient lies on
    /// (`Exchanger::set_codec_gpu`, not `Exchanger::set_codec_device`).
    gradient_in_place: bool,
}

impl Exchanger {
    /// Plans buckets for `params` and builds one compressor + memory per compressed bucket.
    /// Overlap is on; the world size comes from the communicator at each exchange.
    pub fn new(
        params: &[ParamInfo],
        policy: &BucketPolicy,
        method: &CompressorConfig,
        memory: &MemoryConfig,
        seed: u64,
    ) -> Result<Self, ConfigError> {
        let uncompressed = method.passthrough();
        let mut slots = Vec::new();
        for b in bucket::plan(params, policy) {
            let pipe = if b.compressed && !uncompressed {
                let mut c = method.build()?;
                let shapes: Vec<Vec<usize>> =
                    b.params.iter().map(|&i| params[i].shape.clone()).collect();
                c.set_segment_shapes(&shapes);
                Some(Pipeline::new(c, memory.build()?))
            } else {
                None
            };
            let range = contiguous(&b);
            let shapes = b.params.iter().map(|&i| params[i].shape.clone()).collect();
            let route = Route::fixed(pipe.is_some(), GatherCollective::AllGather);
            slots.push(Slot {
                bucket: b,
                pipe,
                server: None,
                range,
                shapes,
                route,
                device: None,
            });
        }
        Ok(Exchanger {
            slots,
            dense_plan: dense::dense_plan(params, policy),
            total: params.iter().map(|p| p.numel()).sum(),
            seed,
            method: method.name(),
            method_cfg: method.clone(),
            server_state: BTreeMap::new(),
            server_ef: None,
            memory: *memory,
            overlap: true,
            gather: GatherCollective::AllGather,
            auto_pending: false,
            link: None,
            hosts: None,
            auto_report: None,
            theta_scale: 1.0,
            spare: Vec::new(),
            lossy: None,
            lossy_residual: DlcpResidual::new(),
            device: None,
            mean_on_device: false,
            decoded_on_device: Vec::new(),
            gradient_in_place: false,
        })
    }

    /// Sends the uncompressed (dense f32) buckets through DLCP's bounded-loss all-reduce
    /// ([`Communicator::dlcp_all_reduce`]) instead of the ring: each bucket's parameters are
    /// its tensors, numbered by their position in the model (layer 0 = input side). With
    /// `error_feedback`, the values of this worker that a round completed without are added
    /// to its gradient of the bucket at the next exchange.
    pub fn set_dlcp(&mut self, cfg: DlcpConfig, error_feedback: bool) {
        let tensors = self
            .slots
            .iter()
            .map(|s| {
                let first = s.bucket.params.first().copied().unwrap_or(0);
                let first = first.min(u32::MAX as usize) as u32;
                (
                    s.bucket.id,
                    DlcpTensor::from_segments(&s.bucket.segments, first).into(),
                )
            })
            .collect();
        self.lossy = Some(Lossy {
            cfg: Arc::new(cfg),
            error_feedback,
            tensors,
        });
        self.lossy_residual.clear();
    }

    /// Chooses the collective for the compressed buckets' payloads (default all-gather).
    /// The all-gather and the sparse all-reduce give bit-identical gradients (only bytes and
    /// time differ); the compressed all-reduce re-encodes the owners' sums;
    /// [`GatherCollective::Auto`] chooses per bucket at the first exchange (or at
    /// [`Exchanger::choose_collectives`]), see [`auto`].
    pub fn set_gather_collective(&mut self, c: GatherCollective) {
        self.gather = c;
        self.auto_pending = c == GatherCollective::Auto;
        for s in &mut self.slots {
            s.route = Route::fixed(s.pipe.is_some(), c);
        }
    }

    /// The link the automatic choice models: the run's emulated `[network]` link, or `None`
    /// (the default) to measure the real one with a short probe
    /// ([`Exchanger::choose_collectives`]).
    pub fn set_link(&mut self, link: Option<LinkSpec>) {
        self.link = link.filter(LinkSpec::is_shaped);
    }

    /// The hosts of the run's ranks: when they make a hierarchy
    /// ([`Topology::is_hierarchical`]), the dense buckets go through the hierarchical
    /// all-reduce ([`Communicator::hierarchical_all_reduce_sum`]) instead of the flat one.
    /// The topology must be the same on every rank and match the communicator's world.
    pub fn set_topology(&mut self, topology: &Topology) {
        self.hosts = topology
            .is_hierarchical()
            .then(|| Arc::new(topology.clone()));
    }

    /// The number of hosts of the hierarchical dense all-reduce, when it is used.
    pub fn hierarchical_hosts(&self) -> Option<usize> {
        self.hosts.as_ref().map(|h| h.hosts())
    }

    /// Whether the compressed all-reduce's owners keep a server residual (`Some`), or, with
    /// `None` (the default), whether the workers have error feedback and the method wants one
    /// ([`Compressor::owner_error_feedback`](dtrain_compress::Compressor::owner_error_feedback)).
    /// A method that votes never keeps one (its owners re-encode the plain sum, which is the
    /// vote). Applies to owners built afterwards.
    pub fn set_server_error_feedback(&mut self, on: Option<bool>) {
        self.server_ef = on;
    }

    /// The compressed all-reduce's owner pipelines, built on first use: per compressed
    /// bucket that takes it, a compressor of the method and the server residual (error
    /// feedback on and a method that averages) or no memory, with any restored residual
    /// installed after checking that it fits this rank's range.
    fn ensure_servers(&mut self, world: usize, rank: usize) -> Result<(), ExchangeError> {
        let explicit = self.server_ef;
        let server_memory = |p: &Pipeline| {
            let mean = p.compressor().combine() == dtrain_compress::Combine::Mean;
            let default = p.feedback_active() && p.compressor().owner_error_feedback();
            if mean && explicit.unwrap_or(default) {
                MemoryConfig::RESIDUAL
            } else {
                MemoryConfig::None
            }
        };
        for s in &mut self.slots {
            let Some(pipe) = &s.pipe else { continue };
            if s.route != Route::Compressed(GatherCollective::CompressedAllReduce)
                || s.server.is_some()
                || !Collective::chunkable(pipe.compressor())
            {
                continue;
            }
            let id = s.bucket.id;
            let built = |e: ConfigError| ExchangeError::State(format!("bucket {id}: {e}"));
            let mut server = Pipeline::new(
                self.method_cfg.build().map_err(built)?,
                server_memory(pipe).build().map_err(built)?,
            );
            if let Some(r) = self.server_state.remove(&id) {
                let want = dtrain_comms::segment_range(s.bucket.len(), world, rank).len();
                if r.len() != want || !server.feedback_active() {
                    return Err(ExchangeError::State(format!(
                        "the server residual of bucket {id} has {} values, this rank's range of \
                         it at {world} workers {want}{}: resume with the worker count and \
                         error feedback the checkpoint was written with",
                        r.len(),
                        if server.feedback_active() {
                            ""
                        } else {
                            " (and this run keeps none: see compress.server_error_feedback)"
                        },
                    )));
                }
                server.import_memory(BTreeMap::from([(id, r)]));
            }
            s.server = Some(Box::new(OwnerReduce::new(server, id, self.seed)));
        }
        Ok(())
    }

    /// The collective asked for the compressed buckets' payloads.
    pub fn gather_collective(&self) -> GatherCollective {
        self.gather
    }

    /// How each bucket travels, in bucket order (with [`GatherCollective::Auto`], the
    /// all-gather until the choice is made).
    pub fn routes(&self) -> Vec<Route> {
        self.slots.iter().map(|s| s.route).collect()
    }

    /// The collective each bucket's exchange uses, in bucket order: a compressed bucket's
    /// follows from its method ([`Collective::of`]) and its route; the dense ones use the
    /// all-reduce (hierarchical over several hosts, [`Exchanger::set_topology`]), or DLCP
    /// when it is set.
    pub fn collectives(&self) -> Vec<Collective> {
        self.slots
            .iter()
            .map(|s| self.collective_of(s.pipe.as_ref(), s.route))
            .collect()
    }

    /// The collective of a bucket with compressor pipeline `pipe` sent by `route`.
    fn collective_of(&self, pipe: Option<&Pipeline>, route: Route) -> Collective {
        match (pipe, route) {
            (Some(pipe), Route::Compressed(g)) => Collective::of(
                pipe.compressor(),
                g.fixed().unwrap_or(Collective::AllGather),
            ),
            _ if self.lossy.is_some() => Collective::Dlcp,
            _ if self.hosts.is_some() => Collective::HierarchicalAllReduce,
            _ => Collective::AllReduce,
        }
    }

    /// The bucket plan.
    pub fn buckets(&self) -> impl Iterator<Item = &Bucket> {
        self.slots.iter().map(|s| &s.bucket)
    }

    /// Turns the overlap of communication with (de)compression on (the default) or off.
    /// Results are bit-identical either way; only the timing changes.
    pub fn set_overlap(&mut self, on: bool) {
        self.overlap = on;
    }

    /// Whether communication overlaps (de)compression.
    pub fn overlap(&self) -> bool {
        self.overlap
    }

    fn pipes(&self) -> impl Iterator<Item = &Pipeline> {
        self.slots.iter().filter_map(|s| s.pipe.as_ref())
    }

    fn pipes_mut(&mut self) -> impl Iterator<Item = &mut Pipeline> {
        self.slots.iter_mut().filter_map(|s| s.pipe.as_mut())
    }

    /// What to log as the method's compression knob after a step:
    /// `("theta", θ)` for FFT (θ of the last exchange, after its schedule and
    /// [`Exchanger::scale_theta`]), `("density", ρ)` for top-k, random-k, ScaleCom,
    /// gradient dropping and DGC (its warm-up density of the last exchange); `None` for the
    /// other methods and when nothing is compressed ([`Compressor::ratio_metric`](dtrain_compress::Compressor::ratio_metric)). Before
    /// the first exchange, the configured starting value.
    pub fn ratio_metric(&self) -> Option<(&'static str, f64)> {
        let s = self.slots.iter().find(|s| s.pipe.is_some())?;
        match &s.device {
            Some(d) => d
                .ratio_metric()
                .or_else(|| s.pipe.as_ref()?.compressor().ratio_metric()),
            None => s.pipe.as_ref()?.compressor().ratio_metric(),
        }
    }

    /// The "recover" rule ([`dtrain_compress::schedule::Recover`]): multiplies the drop
    /// ratio θ of every FFT compressor by `factor`. The scale persists and applies on top
    /// of the θ schedule at every later step; it is part of [`Exchanger::export_state`].
    /// Returns `false`, changing nothing, when the method has no θ.
    ///
    /// # Panics
    /// If `factor` is negative or not finite.
    pub fn scale_theta(&mut self, factor: f64) -> bool {
        dtrain_compress::compressor::check_factor(factor);
        let mut any = false;
        for p in self.pipes_mut() {
            any |= p.compressor_mut().scale_theta(factor);
        }
        if any {
            self.theta_scale *= factor;
        }
        any
    }

    /// The product of the factors of every successful [`Exchanger::scale_theta`] (1
    /// initially, and always 1 for methods without θ).
    pub fn theta_scale(&self) -> f64 {
        self.theta_scale
    }

    /// Replaces `grad` (this rank's flat gradient) by the average over all ranks of the
    /// (compressed) gradients, identically on every rank. `step` must advance identically on
    /// every rank (it seeds RNG streams, schedules and ScaleCom's leader).
    pub fn exchange<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        grad: &mut [f32],
        step: u64,
    ) -> Result<ExchangeStats, ExchangeError> {
        self.exchange_checked(comm, grad, step, false)
    }

    /// [`Exchanger::exchange`]; `prechecked`: the caller has checked `grad` for non-finite
    /// values on every rank (the trainer does before a compressed exchange, and skips the
    /// step when one has any), so the compressors do not scan it again where it reaches
    /// them unchanged ([`Pipeline::set_prechecked`]).
    pub fn exchange_checked<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        grad: &mut [f32],
        step: u64,
        prechecked: bool,
    ) -> Result<ExchangeStats, ExchangeError> {
        self.exchange_from(comm, grad, None, step, prechecked)
    }

    /// [`Exchanger::exchange_checked`] of a gradient `on_device` (this rank's, on the
    /// device its compressed buckets are encoded on, `Exchanger::set_codec_gpu`):
    /// each bucket with a device encoder is encoded from its range where it lies, and only
    /// the other buckets' ranges are copied into `grad` first; only payloads reach the
    /// host. The average comes back into `grad`, as from
    /// [`Exchanger::exchange_checked`] — or, with `mean_on_device`, into `on_device`'s
    /// buffer, where the device buckets' gathered payloads are decoded on the device and
    /// the host's averages of the others are uploaded (`grad` then holds only the
    /// latter, and [`ExchangeStats::non_finite`] is checked there). The same bit for bit
    /// for methods whose device payloads and decoders are the host codec's. An error where
    /// a device bucket's device is not the gradient's, or the lengths differ.
    pub fn exchange_device<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        grad: &mut [f32],
        on_device: &DeviceGradient,
        mean_on_device: bool,
        step: u64,
        prechecked: bool,
    ) -> Result<ExchangeStats, ExchangeError> {
        if on_device.len() != self.total {
            return Err(ExchangeError::Length {
                want: self.total,
                got: on_device.len(),
            });
        }
        self.mean_on_device = mean_on_device;
        // Which buckets the device decodes is learnt by this exchange (none on the dense path).
        self.decoded_on_device.clear();
        let res = self.exchange_from(comm, grad, Some(on_device), step, prechecked);
        self.mean_on_device = false;
        let mut st = res?;
        if mean_on_device {
            let t0 = std::time::Instant::now();
            let decoded = std::mem::take(&mut self.decoded_on_device);
            let bad = self.upload_host_means(on_device, grad, &decoded);
            self.decoded_on_device = decoded;
            st.non_finite = Some(bad?);
            st.decompress_s += t0.elapsed().as_secs_f64();
        }
        Ok(st)
    }

    /// Whether the worker's gradient should be handed over on the device
    /// ([`Exchanger::exchange_device`]): the codecs' device is the worker's own
    /// (`Exchanger::set_codec_gpu`, in a build with device codecs) and, with the routes
    /// chosen, some compressed bucket has a device encoder there and is one range of the
    /// gradient.
    pub fn reads_device_gradient(&self) -> bool {
        self.gradient_in_place && !self.auto_pending && self.slots.iter().any(Slot::reads_device)
    }

    fn exchange_from<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        grad: &mut [f32],
        on_device: Option<&DeviceGradient>,
        step: u64,
        prechecked: bool,
    ) -> Result<ExchangeStats, ExchangeError> {
        if grad.len() != self.total {
            return Err(ExchangeError::Length {
                want: self.total,
                got: grad.len(),
            });
        }
        let world = comm.world_size();
        if let Some(h) = &self.hosts {
            if h.world() != world {
                return Err(ExchangeError::State(format!(
                    "the topology ({}) has {} ranks, the communicator {world}",
                    h.describe(),
                    h.world()
                )));
            }
        }
        for p in self.pipes_mut() {
            p.compressor_mut().set_world_size(world);
            p.set_prechecked(prechecked);
        }
        if self.auto_pending {
            self.choose_collectives(comm)?;
        }
        self.settle_devices();
        let mut st = ExchangeStats {
            elements: self.total as u64,
            ..ExchangeStats::default()
        };
        self.ensure_servers(world, comm.rank())?;
        if let Some(g) = on_device {
            let t0 = std::time::Instant::now();
            self.download_host_ranges(g, grad)?;
            st.compress_s += t0.elapsed().as_secs_f64();
        }
        let before = comm.total_bytes();
        if self.is_dense() {
            self.average_dense(comm, grad, &mut st)?;
        } else {
            self.pipelined(comm, grad, on_device, step, &mut st)?;
        }
        let d = comm.total_bytes() - before;
        st.bytes_sent = d.sent;
        st.bytes_received = d.received;
        Ok(st)
    }

    /// Whether [`Exchanger::exchange`] takes the dense path: every bucket dense (no
    /// compressor, or sent uncompressed by the automatic choice) and no bounded-loss
    /// transport. Its result is then a plain sum (times 1/P) in which a NaN
    /// or infinity on any rank's gradient stays non-finite, and it is checked as it is
    /// averaged ([`ExchangeStats::non_finite`]; with one rank the gradient is its own
    /// average), so a caller need not scan the gradient before the exchange. A compressor
    /// may drop a non-finite value, so compressed exchanges need that scan.
    pub fn is_dense(&self) -> bool {
        self.lossy.is_none() && self.slots.iter().all(|s| s.route == Route::Dense)
    }

    /// Whether the dense buckets go through DLCP ([`Exchanger::set_dlcp`]).
    pub fn is_lossy(&self) -> bool {
        self.lossy.is_some()
    }
}

#[cfg(test)]
mod tests;
