//! The gradient exchange of one data-parallel step: bucket → compensate → compress → the
//! collective the method's aggregation needs → decompress / sum → average.
//!
//! | aggregation | collective | receive side |
//! |---|---|---|
//! | uncompressed bucket | all-reduce sum (f32) | — |
//! | `Dense` | decode own payload, all-reduce sum | — |
//! | `Summable` | all-reduce sum of the payload's f32 value lanes | decode the summed payload once |
//! | `Gather` | all-gather(v) of payload bytes | decode and add every rank's payload |
//! | `Gather`, [`GatherCollective::SparseAllReduce`] | decode own payload; sparse all-reduce of its non-zeros | — |
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

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use dtrain_comms::dlcp::{DlcpConfig, DlcpReport, DlcpTensor};
use dtrain_comms::{CommError, Communicator, SparseSlice, Transport};
use dtrain_compress::compressor::scale_has_non_finite;
use dtrain_compress::memory::DlcpResidual;
use dtrain_compress::{
    summable_lanes, Aggregation, Collective, CompressError, CompressorConfig, ConfigError, Ctx,
    MemoryConfig, Payload, Pipeline, Rng, WireError,
};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::bucket::{self, Bucket, BucketPolicy, ParamInfo};

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
    /// found out while writing it (the uncompressed path checks in its averaging pass, so
    /// the caller need not scan the gradient again); `None` where it did not look.
    #[serde(default)]
    pub non_finite: Option<bool>,
}

/// The bucket's range of the flat gradient, if its parameters are consecutive there (always
/// so in [`bucket::plan`]'s buckets unless dense bypasses are interleaved with them).
fn contiguous(b: &Bucket) -> Option<Range<usize>> {
    let r = &b.flat_ranges;
    let (first, last) = (r.first()?, r.last()?);
    r.windows(2)
        .all(|w| w[0].end == w[1].start)
        .then_some(first.start..last.end)
}

/// An uncompressed bucket's exchange on `data` where it lies (the bucket's own range of the
/// flat gradient when the bucket is contiguous there), with two ranks or more: the sum
/// all-reduce in place, then the average. Bit-identical to the pipelined path's gather, sum
/// and scatter times `1/P` (the same sum, then the same product), without its two copies:
/// on the 535 k-parameter MLP they were ~0.3 ms of a 5–7 ms step. The averaging pass also
/// checks finiteness (a sum can overflow even when every rank's gradient is finite) and
/// sets `st.non_finite` to `Some(true)` on a NaN or an infinity.
fn average_in_place<T: Transport>(
    comm: &mut Communicator<T>,
    data: &mut [f32],
    st: &mut ExchangeStats,
) -> Result<(), CommError> {
    let t0 = Instant::now();
    comm.all_reduce_sum(data)?;
    let t1 = Instant::now();
    if scale_has_non_finite(data, 1.0 / comm.world_size() as f32) {
        st.non_finite = Some(true);
    }
    let comm_s = (t1 - t0).as_secs_f64();
    st.communicate_s += comm_s;
    st.wait_s += comm_s;
    st.decompress_s += t1.elapsed().as_secs_f64();
    Ok(())
}

struct Slot {
    bucket: Bucket,
    pipe: Option<Pipeline>,
    /// The bucket's range of the flat gradient when it is one ([`contiguous`]), fixed by
    /// the plan: an uncompressed bucket is then averaged in place.
    range: Option<Range<usize>>,
}

/// One bucket in flight: its buffers travel with it (and to the communication thread and
/// back); they return to a pool afterwards, so a steady-state step allocates little.
#[derive(Default)]
struct Flight {
    /// The gathered gradient; then what goes into / comes out of a dense all-reduce.
    buf: Vec<f32>,
    /// Sparse all-reduce input: indices of the decoded payload's non-zeros.
    idx: Vec<u32>,
    /// Sparse all-reduce input: their values.
    vals: Vec<f32>,
    /// `Summable`: the value lanes (f32) being all-reduced.
    lane: Vec<f32>,
    /// The byte ranges of the lanes in `payload`.
    lanes: Vec<Range<usize>>,
    payload: Payload,
    /// A two-phase method's agreement message.
    msg: Vec<u8>,
}

/// Which collective carries the payloads of a `Gather` method.
/// Its serde names are the config's spelling (`[compress] collective`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum GatherCollective {
    /// All-gather(v) of the payload bytes; every rank decodes all of them.
    #[default]
    #[serde(rename = "allgather")]
    AllGather,
    /// Sparse all-reduce of each rank's decoded payload (see the [module docs](self)).
    #[serde(rename = "sparse-allreduce")]
    SparseAllReduce,
}

impl From<GatherCollective> for Collective {
    fn from(c: GatherCollective) -> Collective {
        match c {
            GatherCollective::AllGather => Collective::AllGather,
            GatherCollective::SparseAllReduce => Collective::SparseAllReduce,
        }
    }
}

/// A collective, with the buffers it works on.
enum Op {
    Sum(Vec<f32>),
    Gather(Vec<u8>),
    Broadcast(Vec<u8>, usize),
    /// Sparse all-reduce of (indices, values) into the dense output buffer.
    Sparse(Vec<u32>, Vec<f32>, Vec<f32>),
    /// DLCP bounded-loss all-reduce of a dense bucket with its tensors.
    Lossy(Vec<f32>, Arc<[DlcpTensor]>, Arc<DlcpConfig>),
}

/// A collective's result: the buffers, back.
enum Reply {
    Sum(Vec<f32>),
    /// The dense sum, and the index / value buffers back for reuse.
    Sparse(Vec<f32>, Vec<u32>, Vec<f32>),
    Gather(Vec<Vec<u8>>),
    Broadcast(Vec<u8>),
    /// The (lossy) sum and the round's report.
    Lossy(Vec<f32>, Box<DlcpReport>),
}

struct Done {
    result: Result<Reply, CommError>,
    /// Seconds the collective took where it ran.
    secs: f64,
}

fn run_op<T: Transport>(comm: &mut Communicator<T>, op: Op) -> Done {
    let t = Instant::now();
    let result = match op {
        Op::Sum(mut v) => comm.all_reduce_sum(&mut v).map(|()| Reply::Sum(v)),
        Op::Gather(b) => comm.all_gather(&b).map(Reply::Gather),
        Op::Broadcast(mut b, root) => comm.broadcast(&mut b, root).map(|()| Reply::Broadcast(b)),
        Op::Lossy(mut v, tensors, cfg) => comm
            .dlcp_all_reduce(&mut v, &tensors, &cfg)
            .map(|r| Reply::Lossy(v, Box::new(r))),
        Op::Sparse(idx, vals, mut out) => match SparseSlice::new(out.len(), &idx, &vals) {
            Ok(input) => comm
                .sparse_all_reduce_dense(input, &mut out)
                .map(|()| Reply::Sparse(out, idx, vals)),
            Err(e) => Err(CommError::InvalidArgument(format!(
                "sparse all-reduce input: {e}"
            ))),
        },
    };
    Done {
        result,
        secs: t.elapsed().as_secs_f64(),
    }
}

/// Where the collectives run: inline on the calling thread, or on the communication
/// thread (in submission order either way, which is what keeps the ranks in step).
enum Link<'a, T: Transport> {
    Inline {
        comm: &'a mut Communicator<T>,
        done: VecDeque<Done>,
    },
    Thread {
        jobs: mpsc::Sender<Op>,
        done: mpsc::Receiver<Done>,
    },
}

/// The link plus the calling thread's blocked time, so (de)compression timings can leave
/// it out.
struct Comms<'a, T: Transport> {
    link: Link<'a, T>,
    /// Seconds blocked on communication so far (→ `wait_s`).
    blocked: f64,
    /// Seconds inside collectives so far (→ `communicate_s`).
    busy: f64,
}

impl<T: Transport> Comms<'_, T> {
    fn submit(&mut self, op: Op) {
        match &mut self.link {
            Link::Inline { comm, done } => {
                let d = run_op(comm, op);
                self.blocked += d.secs;
                done.push_back(d);
            }
            Link::Thread { jobs, .. } => {
                // A closed channel means the thread stopped after a failed collective; the
                // failure is the next result `wait` returns.
                let _ = jobs.send(op);
            }
        }
    }

    fn wait(&mut self) -> Result<Reply, CommError> {
        let d = match &mut self.link {
            Link::Inline { done, .. } => done.pop_front().expect("a collective was submitted"),
            Link::Thread { done, .. } => {
                let t = Instant::now();
                let d = done
                    .recv()
                    .expect("the communication thread answers every submitted collective");
                self.blocked += t.elapsed().as_secs_f64();
                d
            }
        };
        self.busy += d.secs;
        d.result
    }
}

/// The communication thread: runs collectives in submission order until the channel
/// closes or one fails (later ones would only fail or hang; the caller stops at the first
/// error it receives).
fn comm_thread<T: Transport>(
    comm: &mut Communicator<T>,
    jobs: mpsc::Receiver<Op>,
    done: mpsc::Sender<Done>,
) {
    for op in jobs {
        let d = run_op(comm, op);
        let failed = d.result.is_err();
        if done.send(d).is_err() || failed {
            break;
        }
    }
}

/// Shape of one bucket, as recorded in an [`ExchangerState`] (a state only fits the plan
/// it was taken under).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketShape {
    /// Bucket id.
    pub id: u64,
    /// Whether the bucket is compressed.
    pub compressed: bool,
    /// Indices of its parameters in the model's listing.
    pub params: Vec<usize>,
    /// Its segment (parameter) lengths.
    pub segments: Vec<usize>,
}

impl BucketShape {
    fn of(b: &Bucket) -> Self {
        BucketShape {
            id: b.id,
            compressed: b.compressed,
            params: b.params.clone(),
            segments: b.segments.iter().map(|s| s.len()).collect(),
        }
    }
}

/// Everything an [`Exchanger`] carries from one step to the next, for checkpoints: a run
/// stopped after step `k` and resumed from this state (with the same configuration and
/// seed) continues bit for bit.
///
/// What is **not** in here because it is a pure function of (configuration, step, rank,
/// bucket): RNG streams ([`Rng::for_step`]), θ schedules (FFT), DGC's warm-up density,
/// random-k's index streams, ScaleCom's leader and index sets (chosen afresh each step),
/// TernGrad's / QSGD's / the threshold methods' per-call scratch. What is: every
/// error-feedback memory (residual, DGC momentum + velocity, ScaleCom low-pass), every
/// compressor's [`Compressor::export_state`](dtrain_compress::Compressor::export_state) (FFT: base θ and recover scale), and the
/// exchanger's θ scale.
///
/// Floating-point fields are serialized as their IEEE-754 bit patterns (`u32` / `u64`), so
/// any serde format (JSON included) round-trips them exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExchangerState {
    /// Format version, [`ExchangerState::VERSION`].
    pub version: u32,
    /// The compression method's `kind` ([`CompressorConfig::name`]).
    pub method: String,
    /// The error-feedback memory's `kind` (`none`, `residual`, `dgc-momentum`, `low-pass`).
    pub memory_kind: String,
    /// The bucket plan the state was taken under.
    pub plan: Vec<BucketShape>,
    /// [`Exchanger::theta_scale`].
    #[serde(with = "bits::f64_bits")]
    pub theta_scale: f64,
    /// Error-feedback memory per compressed bucket, keyed by bucket id.
    #[serde(with = "bits::memory_bits")]
    pub memory: BTreeMap<u64, Vec<f32>>,
    /// [`Compressor::export_state`](dtrain_compress::Compressor::export_state) per compressed bucket, for buckets whose compressor
    /// carries any.
    #[serde(with = "bits::state_bits")]
    pub compressors: BTreeMap<u64, BTreeMap<String, f64>>,
    /// DLCP error feedback per dense bucket (values the last round completed without),
    /// keyed by bucket id; empty without DLCP.
    #[serde(default, with = "bits::memory_bits")]
    pub lossy_residual: BTreeMap<u64, Vec<f32>>,
}

impl ExchangerState {
    /// The format version this build writes and reads.
    pub const VERSION: u32 = 1;
}

/// Exact serde for floats: IEEE bit patterns.
pub(crate) mod bits {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub mod f64_bits {
        use super::*;
        pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_u64(v.to_bits())
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
            u64::deserialize(d).map(f64::from_bits)
        }
    }

    pub mod memory_bits {
        use super::*;
        pub fn serialize<S: Serializer>(
            v: &BTreeMap<u64, Vec<f32>>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            let b: BTreeMap<u64, Vec<u32>> = v
                .iter()
                .map(|(&k, x)| (k, x.iter().map(|f| f.to_bits()).collect()))
                .collect();
            b.serialize(s)
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<BTreeMap<u64, Vec<f32>>, D::Error> {
            let b = BTreeMap::<u64, Vec<u32>>::deserialize(d)?;
            Ok(b.into_iter()
                .map(|(k, x)| (k, x.into_iter().map(f32::from_bits).collect()))
                .collect())
        }
    }

    pub mod state_bits {
        use super::*;
        type State = BTreeMap<u64, BTreeMap<String, f64>>;
        pub fn serialize<S: Serializer>(v: &State, s: S) -> Result<S::Ok, S::Error> {
            let b: BTreeMap<u64, BTreeMap<&str, u64>> = v
                .iter()
                .map(|(&k, m)| {
                    (
                        k,
                        m.iter().map(|(n, f)| (n.as_str(), f.to_bits())).collect(),
                    )
                })
                .collect();
            b.serialize(s)
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<State, D::Error> {
            let b = BTreeMap::<u64, BTreeMap<String, u64>>::deserialize(d)?;
            Ok(b.into_iter()
                .map(|(k, m)| {
                    (
                        k,
                        m.into_iter().map(|(n, f)| (n, f64::from_bits(f))).collect(),
                    )
                })
                .collect())
        }
    }
}

fn memory_kind(m: &MemoryConfig) -> &'static str {
    match m {
        MemoryConfig::None => "none",
        MemoryConfig::Residual { .. } => "residual",
        MemoryConfig::DgcMomentum { .. } => "dgc-momentum",
        MemoryConfig::LowPass { .. } => "low-pass",
    }
}

/// f32 words of memory per bucket element (DGC keeps momentum and velocity).
fn memory_words(m: &MemoryConfig) -> usize {
    match m {
        MemoryConfig::DgcMomentum { .. } => 2,
        _ => 1,
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
    total: usize,
    seed: u64,
    method: &'static str,
    memory: MemoryConfig,
    overlap: bool,
    gather: GatherCollective,
    theta_scale: f64,
    /// Buffers of finished buckets, reused by the next ones.
    spare: Vec<Flight>,
    /// DLCP for the dense buckets, and whether dropped values return to the sender.
    lossy: Option<Lossy>,
    /// DLCP error feedback: per dense bucket, this worker's values no owner used last time.
    lossy_residual: DlcpResidual,
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
            slots.push(Slot {
                bucket: b,
                pipe,
                range,
            });
        }
        Ok(Exchanger {
            slots,
            total: params.iter().map(|p| p.numel()).sum(),
            seed,
            method: method.name(),
            memory: *memory,
            overlap: true,
            gather: GatherCollective::AllGather,
            theta_scale: 1.0,
            spare: Vec::new(),
            lossy: None,
            lossy_residual: DlcpResidual::new(),
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

    /// Chooses the collective for `Gather` methods' payloads (default all-gather). Either
    /// gives bit-identical gradients; only bytes and time differ.
    pub fn set_gather_collective(&mut self, c: GatherCollective) {
        self.gather = c;
    }

    /// The collective for `Gather` methods' payloads.
    pub fn gather_collective(&self) -> GatherCollective {
        self.gather
    }

    /// The collective each bucket's exchange uses, in bucket order: the compressed buckets'
    /// follows from their method ([`Collective::of`]) and the gather collective; the
    /// uncompressed buckets use the dense all-reduce, or DLCP when it is set.
    pub fn collectives(&self) -> Vec<Collective> {
        let requested = Collective::from(self.gather);
        self.slots
            .iter()
            .map(|s| match &s.pipe {
                Some(pipe) => Collective::of(pipe.compressor(), requested),
                None if self.lossy.is_some() => Collective::Dlcp,
                None => Collective::AllReduce,
            })
            .collect()
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
        self.pipes().next()?.compressor().ratio_metric()
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
        if grad.len() != self.total {
            return Err(ExchangeError::Length {
                want: self.total,
                got: grad.len(),
            });
        }
        let world = comm.world_size();
        for p in self.pipes_mut() {
            p.compressor_mut().set_world_size(world);
        }
        let mut st = ExchangeStats {
            elements: self.total as u64,
            ..ExchangeStats::default()
        };
        let before = comm.total_bytes();
        if self.is_dense() {
            self.average_dense(comm, grad, &mut st)?;
        } else {
            self.pipelined(comm, grad, step, &mut st)?;
        }
        let d = comm.total_bytes() - before;
        st.bytes_sent = d.sent;
        st.bytes_received = d.received;
        Ok(st)
    }

    /// Whether [`Exchanger::exchange`] takes the dense path: no compressor on any bucket and
    /// no bounded-loss transport. Its result is then a plain sum (times 1/P) in which a NaN
    /// or infinity on any rank's gradient stays non-finite, and it is checked as it is
    /// averaged ([`ExchangeStats::non_finite`]; with one rank the gradient is its own
    /// average), so a caller need not scan the gradient before the exchange. A compressor
    /// may drop a non-finite value, so compressed exchanges need that scan.
    pub fn is_dense(&self) -> bool {
        self.lossy.is_none() && self.slots.iter().all(|s| s.pipe.is_none())
    }

    /// Every bucket uncompressed: nothing to overlap the collectives with, so no pipeline,
    /// no second thread, and a bucket that is one range of the flat gradient is summed and
    /// averaged right there (one rank: the gradient is already its average).
    fn average_dense<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        grad: &mut [f32],
        st: &mut ExchangeStats,
    ) -> Result<(), ExchangeError> {
        st.payload_bytes += 4 * self.total as u64;
        if comm.world_size() == 1 {
            return Ok(());
        }
        st.non_finite = Some(false);
        let mut buf = self.spare.pop().unwrap_or_default();
        for slot in &self.slots {
            let b = &slot.bucket;
            let res = match &slot.range {
                Some(r) => average_in_place(comm, &mut grad[r.clone()], st),
                None => {
                    let t0 = Instant::now();
                    bucket::gather(b, grad, &mut buf.buf);
                    st.compress_s += t0.elapsed().as_secs_f64();
                    let res = average_in_place(comm, &mut buf.buf, st);
                    let t1 = Instant::now();
                    bucket::scatter(b, &buf.buf, 1.0, grad);
                    st.decompress_s += t1.elapsed().as_secs_f64();
                    res
                }
            };
            res.map_err(|source| ExchangeError::Comm {
                bucket: b.id,
                source,
            })?;
        }
        self.spare.push(buf);
        Ok(())
    }

    /// The compressed (or DLCP) exchange: per bucket gather, compress, collective,
    /// decompress, average, with the collectives on a second thread when overlapping.
    fn pipelined<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        grad: &mut [f32],
        step: u64,
        st: &mut ExchangeStats,
    ) -> Result<(), ExchangeError> {
        let (world, rank) = (comm.world_size(), comm.rank());
        let job = Job {
            slots: &mut self.slots,
            spare: &mut self.spare,
            lossy: self.lossy.as_ref(),
            lossy_residual: &mut self.lossy_residual,
            gather: self.gather,
            seed: self.seed,
            step,
            rank,
            inv: 1.0 / world as f32,
        };
        // Overlap needs something to overlap with: two buckets and a peer.
        let (res, blocked, busy) = if self.overlap && job.slots.len() > 1 && world > 1 {
            let (jobs_tx, jobs_rx) = mpsc::channel();
            let (done_tx, done_rx) = mpsc::channel();
            std::thread::scope(|s| {
                let c = &mut *comm;
                s.spawn(move || comm_thread(c, jobs_rx, done_tx));
                let mut comms = Comms::<'_, T> {
                    link: Link::Thread {
                        jobs: jobs_tx,
                        done: done_rx,
                    },
                    blocked: 0.0,
                    busy: 0.0,
                };
                let res = job.run(&mut comms, grad, st);
                // Dropping the link closes the job channel: the thread finishes what was
                // submitted (on an error) and ends; the scope joins it.
                (res, comms.blocked, comms.busy)
            })
        } else {
            let mut comms = Comms {
                link: Link::Inline {
                    comm: &mut *comm,
                    done: VecDeque::new(),
                },
                blocked: 0.0,
                busy: 0.0,
            };
            let res = job.run(&mut comms, grad, st);
            (res, comms.blocked, comms.busy)
        };
        res?;
        st.wait_s = blocked;
        st.communicate_s = busy;
        Ok(())
    }

    /// Error-feedback state of every compressed bucket (part of [`Exchanger::export_state`]).
    fn export_memory(&self) -> BTreeMap<u64, Vec<f32>> {
        let mut all = BTreeMap::new();
        for p in self.pipes() {
            all.extend(p.memory().export());
        }
        all
    }

    /// Restores state written by `export_memory`, without the plan checks of
    /// [`Exchanger::import_state`] (which calls it after checking).
    fn import_memory(&mut self, mut state: BTreeMap<u64, Vec<f32>>) {
        for s in &mut self.slots {
            if let Some(p) = &mut s.pipe {
                let mine: BTreeMap<u64, Vec<f32>> = state
                    .remove(&s.bucket.id)
                    .map(|v| BTreeMap::from([(s.bucket.id, v)]))
                    .unwrap_or_default();
                p.memory_mut().import(mine);
            }
        }
    }

    /// Everything this exchanger carries across steps (see [`ExchangerState`]).
    pub fn export_state(&self) -> ExchangerState {
        let mut compressors = BTreeMap::new();
        for s in &self.slots {
            if let Some(p) = &s.pipe {
                let c = p.compressor().export_state();
                if !c.is_empty() {
                    compressors.insert(s.bucket.id, c);
                }
            }
        }
        ExchangerState {
            version: ExchangerState::VERSION,
            method: self.method.to_string(),
            memory_kind: memory_kind(&self.memory).to_string(),
            plan: self
                .slots
                .iter()
                .map(|s| BucketShape::of(&s.bucket))
                .collect(),
            theta_scale: self.theta_scale,
            memory: self.export_memory(),
            compressors,
            lossy_residual: self.lossy_residual.export(),
        }
    }

    /// Restores [`Exchanger::export_state`]. Refuses, with a message saying what differs and
    /// changing nothing, a state of another version, method, memory kind or bucket plan, or
    /// one whose buffers do not fit the buckets.
    pub fn import_state(&mut self, state: ExchangerState) -> Result<(), String> {
        if state.version != ExchangerState::VERSION {
            return Err(format!(
                "exchanger state version {} is not supported (this build reads {})",
                state.version,
                ExchangerState::VERSION
            ));
        }
        if state.method != self.method {
            return Err(format!(
                "exchanger state is for method {:?}, this run compresses with {:?}",
                state.method, self.method
            ));
        }
        let kind = memory_kind(&self.memory);
        if state.memory_kind != kind {
            return Err(format!(
                "exchanger state holds {:?} memory, this run uses {kind:?}",
                state.memory_kind
            ));
        }
        let plan: Vec<BucketShape> = self
            .slots
            .iter()
            .map(|s| BucketShape::of(&s.bucket))
            .collect();
        if state.plan != plan {
            let what = if state.plan.len() != plan.len() {
                format!("{} buckets, this run has {}", state.plan.len(), plan.len())
            } else {
                let (a, b) = state
                    .plan
                    .iter()
                    .zip(&plan)
                    .find(|(a, b)| a != b)
                    .expect("plans differ");
                format!("bucket {} was {a:?}, here it is {b:?}", a.id)
            };
            return Err(format!(
                "exchanger state was taken under another bucket plan ({what}); resume with \
                 the same model and bucket policy"
            ));
        }
        let words = memory_words(&self.memory);
        let len_of = |id: u64| -> Option<usize> {
            self.slots
                .iter()
                .find(|s| s.bucket.id == id && s.pipe.is_some())
                .map(|s| s.bucket.len())
        };
        for (&id, m) in &state.memory {
            match len_of(id) {
                Some(n) if m.len() == words * n => {}
                Some(n) => {
                    return Err(format!(
                        "memory of bucket {id} has {} values, {kind} memory of a {n}-element \
                         bucket has {}",
                        m.len(),
                        words * n
                    ))
                }
                None => return Err(format!("memory for bucket {id}, which is not compressed")),
            }
        }
        for (&id, r) in &state.lossy_residual {
            match self
                .slots
                .iter()
                .find(|s| s.bucket.id == id && s.pipe.is_none())
            {
                Some(s) if s.bucket.len() == r.len() => {}
                Some(s) => {
                    return Err(format!(
                        "DLCP residual of bucket {id} has {} values, the bucket {}",
                        r.len(),
                        s.bucket.len()
                    ))
                }
                None => {
                    return Err(format!(
                        "DLCP residual for bucket {id}, which is compressed"
                    ))
                }
            }
        }
        if let Some(id) = state.compressors.keys().find(|&&id| len_of(id).is_none()) {
            return Err(format!(
                "compressor state for bucket {id}, which is not compressed"
            ));
        }
        // Compressor imports can fail (each leaves its compressor unchanged): undo the ones
        // done so far, so a refused state changes nothing.
        let mut done: Vec<(usize, BTreeMap<String, f64>)> = Vec::new();
        let empty = BTreeMap::new();
        for i in 0..self.slots.len() {
            let id = self.slots[i].bucket.id;
            let Some(p) = self.slots[i].pipe.as_mut() else {
                continue;
            };
            let old = p.compressor().export_state();
            let new = state.compressors.get(&id).unwrap_or(&empty);
            if let Err(e) = p.compressor_mut().import_state(new) {
                for (j, old) in done {
                    if let Some(p) = self.slots[j].pipe.as_mut() {
                        p.compressor_mut()
                            .import_state(&old)
                            .expect("a state just exported imports");
                    }
                }
                return Err(format!("compressor state of bucket {id}: {e}"));
            }
            done.push((i, old));
        }
        self.import_memory(state.memory);
        self.lossy_residual.import(state.lossy_residual);
        self.theta_scale = state.theta_scale;
        Ok(())
    }
}

/// One exchange's compute side: the static bucket schedule.
struct Job<'a> {
    slots: &'a mut [Slot],
    spare: &'a mut Vec<Flight>,
    lossy: Option<&'a Lossy>,
    lossy_residual: &'a mut DlcpResidual,
    gather: GatherCollective,
    seed: u64,
    step: u64,
    rank: usize,
    inv: f32,
}

/// What the next collective result of a bucket is for.
enum Stage {
    /// Uncompressed bucket, or a `Dense` method: a dense sum.
    Dense,
    /// A two-phase method's agreement broadcast.
    Agreement,
    /// The all-reduce of the value lanes.
    Lanes,
    /// The all-gather of the payloads.
    Gathered,
    /// The sparse all-reduce of the decoded payloads.
    SparseSum,
    /// DLCP's bounded-loss all-reduce of a dense bucket.
    Lossy,
}

impl Job<'_> {
    fn run<T: Transport>(
        mut self,
        comms: &mut Comms<'_, T>,
        grad: &mut [f32],
        st: &mut ExchangeStats,
    ) -> Result<(), ExchangeError> {
        let n = self.slots.len();
        let mut flights: VecDeque<(Flight, Stage)> = VecDeque::new();
        if n > 0 {
            flights.push_back(self.start(0, comms, grad, st)?);
        }
        for i in 0..n {
            if matches!(flights[0].1, Stage::Agreement) {
                let (f, _) = flights.pop_front().expect("bucket i in flight");
                let next = self.agree(i, f, comms, st)?;
                flights.push_front(next);
            }
            if i + 1 < n {
                let next = self.start(i + 1, comms, grad, st)?;
                flights.push_back(next);
            }
            let (f, stage) = flights.pop_front().expect("bucket i in flight");
            self.finish(i, f, stage, comms, grad, st)?;
        }
        Ok(())
    }

    /// Phase one of bucket `i`: gather, then compress and submit its collective (or, for a
    /// two-phase method, compensate and submit the agreement broadcast).
    fn start<T: Transport>(
        &mut self,
        i: usize,
        comms: &mut Comms<'_, T>,
        grad: &[f32],
        st: &mut ExchangeStats,
    ) -> Result<(Flight, Stage), ExchangeError> {
        let t0 = Instant::now();
        let b0 = comms.blocked;
        let (step, rank, seed) = (self.step, self.rank, self.seed);
        let mut f = self.spare.pop().unwrap_or_default();
        let Slot { bucket, pipe, .. } = &mut self.slots[i];
        bucket::gather(bucket, grad, &mut f.buf);
        let id = bucket.id;
        let ctx = Ctx {
            step,
            rank: rank as u32,
            bucket: id,
            segments: &bucket.segments,
        };
        let compress_err = |source| ExchangeError::Compress { bucket: id, source };
        let stage = match pipe {
            None if self.lossy.is_some() => {
                let lossy = self.lossy.expect("checked");
                if lossy.error_feedback {
                    self.lossy_residual.add_back(id, &mut f.buf);
                }
                st.payload_bytes += 4 * f.buf.len() as u64;
                comms.submit(Op::Lossy(
                    std::mem::take(&mut f.buf),
                    lossy.tensors[&id].clone(),
                    lossy.cfg.clone(),
                ));
                Stage::Lossy
            }
            None => {
                st.payload_bytes += 4 * f.buf.len() as u64;
                comms.submit(Op::Sum(std::mem::take(&mut f.buf)));
                Stage::Dense
            }
            Some(pipe) => match pipe.broadcast_root(&ctx) {
                Some(root) => {
                    pipe.compensate(&f.buf, &ctx);
                    f.msg.clear();
                    if root == rank {
                        pipe.broadcast_message(&ctx, &mut f.msg)
                            .map_err(compress_err)?;
                        st.payload_bytes += f.msg.len() as u64;
                    }
                    comms.submit(Op::Broadcast(std::mem::take(&mut f.msg), root));
                    Stage::Agreement
                }
                None => {
                    let mut rng = Rng::for_step(seed, step, rank as u64, id);
                    pipe.compress(&f.buf, &ctx, &mut rng, &mut f.payload)
                        .map_err(compress_err)?;
                    submit_payload(pipe, id, rank, self.gather, &mut f, comms, st)?
                }
            },
        };
        st.compress_s += t0.elapsed().as_secs_f64() - (comms.blocked - b0);
        Ok((f, stage))
    }

    /// Phase two of a two-phase bucket: install the broadcast agreement, compress under it
    /// and submit the payload's collective.
    fn agree<T: Transport>(
        &mut self,
        i: usize,
        mut f: Flight,
        comms: &mut Comms<'_, T>,
        st: &mut ExchangeStats,
    ) -> Result<(Flight, Stage), ExchangeError> {
        let Slot { bucket, pipe, .. } = &mut self.slots[i];
        let id = bucket.id;
        let msg = match comms.wait() {
            Ok(Reply::Broadcast(m)) => m,
            Ok(_) => unreachable!("replies come in submission order"),
            Err(source) => return Err(ExchangeError::Comm { bucket: id, source }),
        };
        let t0 = Instant::now();
        let b0 = comms.blocked;
        let mut rng = Rng::for_step(self.seed, self.step, self.rank as u64, id);
        let pipe = pipe.as_mut().expect("two-phase buckets are compressed");
        let ctx = Ctx {
            step: self.step,
            rank: self.rank as u32,
            bucket: id,
            segments: &bucket.segments,
        };
        let compress_err = |source| ExchangeError::Compress { bucket: id, source };
        pipe.install_broadcast(&msg, &ctx).map_err(compress_err)?;
        pipe.compress_compensated(&ctx, &mut rng, &mut f.payload)
            .map_err(compress_err)?;
        f.msg = msg;
        let stage = submit_payload(pipe, id, self.rank, self.gather, &mut f, comms, st)?;
        st.compress_s += t0.elapsed().as_secs_f64() - (comms.blocked - b0);
        Ok((f, stage))
    }

    /// Waits for bucket `i`'s last collective, decodes, averages and scatters into `grad`.
    fn finish<T: Transport>(
        &mut self,
        i: usize,
        mut f: Flight,
        stage: Stage,
        comms: &mut Comms<'_, T>,
        grad: &mut [f32],
        st: &mut ExchangeStats,
    ) -> Result<(), ExchangeError> {
        let Slot { bucket, pipe, .. } = &self.slots[i];
        let id = bucket.id;
        let reply = comms
            .wait()
            .map_err(|source| ExchangeError::Comm { bucket: id, source })?;
        let t0 = Instant::now();
        let decode_err = |r: usize| {
            move |source| ExchangeError::Decode {
                rank: r,
                bucket: id,
                source,
            }
        };
        match (stage, reply, pipe) {
            (Stage::Dense, Reply::Sum(v), _) => f.buf = v,
            (Stage::Lossy, Reply::Lossy(v, report), _) => {
                f.buf = v;
                st.lossy_dropped += report.dropped_elems_all as u64;
                st.lossy_elems += report.elems_all as u64;
                st.retransmitted += report.retransmitted as u64;
                if self.lossy.is_some_and(|l| l.error_feedback) && !report.dropped.is_empty() {
                    report.add_dropped_to(self.lossy_residual.dropped_mut(id, bucket.len()));
                }
            }
            (Stage::SparseSum, Reply::Sparse(v, idx, vals), _) => {
                f.buf = v;
                f.idx = idx;
                f.vals = vals;
            }
            (Stage::Lanes, Reply::Sum(v), Some(pipe)) => {
                let bytes = f.payload.bytes_mut();
                let mut vals = v.iter();
                for l in &f.lanes {
                    for c in bytes[l.clone()].chunks_exact_mut(4) {
                        c.copy_from_slice(&vals.next().expect("lane length").to_le_bytes());
                    }
                }
                f.lane = v;
                f.buf.clear();
                f.buf.resize(bucket.len(), 0.0);
                pipe.decompress_add(f.payload.as_bytes(), &mut f.buf)
                    .map_err(decode_err(self.rank))?;
            }
            (Stage::Gathered, Reply::Gather(all), Some(pipe)) => {
                f.buf.clear();
                f.buf.resize(bucket.len(), 0.0);
                // Rank order; a method with a joint decoder (FFT: one inverse transform of
                // the summed spectra) uses it.
                let refs: Vec<&[u8]> = all.iter().map(Vec::as_slice).collect();
                pipe.decompress_sum_add(&refs, &mut f.buf)
                    .map_err(|(r, e)| decode_err(r)(e))?;
            }
            _ => unreachable!("replies come in submission order"),
        }
        // Averaging fused into the copy back: one pass over the bucket instead of two.
        bucket::scatter(bucket, &f.buf, self.inv, grad);
        self.spare.push(f);
        st.decompress_s += t0.elapsed().as_secs_f64();
        Ok(())
    }
}

/// Submits the collective for the compressed payload in `f` by the method's aggregation.
fn submit_payload<T: Transport>(
    pipe: &Pipeline,
    id: u64,
    rank: usize,
    gather: GatherCollective,
    f: &mut Flight,
    comms: &mut Comms<'_, T>,
    st: &mut ExchangeStats,
) -> Result<Stage, ExchangeError> {
    st.payload_bytes += f.payload.encoded_len() as u64;
    let own = |source| ExchangeError::Decode {
        rank,
        bucket: id,
        source,
    };
    Ok(match pipe.compressor().aggregation() {
        Aggregation::Dense => {
            f.buf.fill(0.0);
            pipe.decompress_add(f.payload.as_bytes(), &mut f.buf)
                .map_err(own)?;
            comms.submit(Op::Sum(std::mem::take(&mut f.buf)));
            Stage::Dense
        }
        Aggregation::Summable => {
            f.lanes = summable_lanes(pipe.compressor(), f.payload.as_bytes()).map_err(own)?;
            f.lane.clear();
            let bytes = f.payload.as_bytes();
            for l in &f.lanes {
                f.lane.extend(
                    bytes[l.clone()]
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                );
            }
            comms.submit(Op::Sum(std::mem::take(&mut f.lane)));
            Stage::Lanes
        }
        Aggregation::Gather if gather == GatherCollective::SparseAllReduce => {
            // Decode our own payload and hand its non-zeros (bitwise: −0.0 is kept, so the
            // sum is exactly the gathered path's) to the sparse all-reduce.
            f.buf.fill(0.0);
            pipe.decompress_add(f.payload.as_bytes(), &mut f.buf)
                .map_err(own)?;
            f.idx.clear();
            f.vals.clear();
            for (i, &v) in f.buf.iter().enumerate() {
                if v.to_bits() != 0 {
                    f.idx.push(i as u32);
                    f.vals.push(v);
                }
            }
            comms.submit(Op::Sparse(
                std::mem::take(&mut f.idx),
                std::mem::take(&mut f.vals),
                std::mem::take(&mut f.buf),
            ));
            Stage::SparseSum
        }
        Aggregation::Gather => {
            comms.submit(Op::Gather(f.payload.as_bytes().to_vec()));
            Stage::Gathered
        }
    })
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::compress::parse_method;
    use dtrain_comms::{channel_mesh, ChannelTransport, CommConfig};
    use dtrain_compress::dgc::{DgcConfig, Warmup};
    use dtrain_compress::fft::FftConfig;
    use dtrain_compress::scalecom::ScaleComConfig;
    use dtrain_compress::schedule::ThetaSchedule;

    fn params() -> Vec<ParamInfo> {
        shapes(&[vec![64, 3, 3, 3], vec![64], vec![128, 64], vec![10]])
    }

    /// Five buckets with the policy of [`policy`]: [1728], [8192], [2048], [2000, 600]
    /// compressed, one dense bucket of the 1-D tensors.
    fn params2() -> Vec<ParamInfo> {
        shapes(&[
            vec![64, 3, 3, 3],
            vec![64],
            vec![128, 64],
            vec![10],
            vec![32, 64],
            vec![32],
            vec![50, 40],
            vec![20, 30],
            vec![7],
        ])
    }

    fn shapes(s: &[Vec<usize>]) -> Vec<ParamInfo> {
        s.iter()
            .enumerate()
            .map(|(i, shape)| ParamInfo {
                name: format!("p{i}"),
                shape: shape.clone(),
            })
            .collect()
    }

    fn policy(elems: usize) -> BucketPolicy {
        BucketPolicy {
            bucket_bytes: 4 * elems,
            dense_1d: true,
            ..BucketPolicy::default()
        }
    }

    fn grad(rank: usize, n: usize, step: u64) -> Vec<f32> {
        let mut r = Rng::for_step(99, step, rank as u64, 0);
        (0..n).map(|_| r.next_f32() * 2.0 - 1.0).collect()
    }

    /// Runs `f(rank, communicator)` on `world` in-process ranks; returns every rank's result.
    fn on_ranks<R: Send>(
        world: usize,
        f: impl Fn(usize, &mut Communicator<ChannelTransport>) -> R + Sync,
    ) -> Vec<R> {
        let f = &f;
        std::thread::scope(|s| {
            let hs: Vec<_> = channel_mesh(world)
                .into_iter()
                .enumerate()
                .map(|(rank, t)| {
                    s.spawn(move || f(rank, &mut Communicator::new(t, CommConfig::default())))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// One rank's results of `steps` exchanges (the averaged gradients) and their stats.
    type Trace = (Vec<Vec<f32>>, Vec<ExchangeStats>);

    struct Setup {
        params: Vec<ParamInfo>,
        policy: BucketPolicy,
        method: CompressorConfig,
        memory: MemoryConfig,
        overlap: bool,
        gather: GatherCollective,
    }

    impl Setup {
        fn new(method: CompressorConfig) -> Self {
            Setup {
                params: params2(),
                policy: policy(3000),
                memory: method.default_memory(),
                method,
                overlap: true,
                gather: GatherCollective::AllGather,
            }
        }

        fn n(&self) -> usize {
            self.params.iter().map(|p| p.numel()).sum()
        }

        fn exchanger(&self) -> Exchanger {
            let mut ex =
                Exchanger::new(&self.params, &self.policy, &self.method, &self.memory, 7).unwrap();
            ex.set_overlap(self.overlap);
            ex.set_gather_collective(self.gather);
            ex
        }

        /// Exchanges steps `steps` on `ex` for `rank`.
        fn steps(
            &self,
            ex: &mut Exchanger,
            comm: &mut Communicator<ChannelTransport>,
            rank: usize,
            steps: std::ops::Range<u64>,
        ) -> Trace {
            let n = self.n();
            steps
                .map(|s| {
                    let mut g = grad(rank, n, s);
                    let st = ex.exchange(comm, &mut g, s).unwrap();
                    assert_eq!(st.elements as usize, n);
                    (g, st)
                })
                .unzip()
        }

        fn run(&self, world: usize, steps: u64) -> Vec<Trace> {
            on_ranks(world, |rank, comm| {
                let mut ex = self.exchanger();
                self.steps(&mut ex, comm, rank, 0..steps)
            })
        }
    }

    /// Asserts bit-identity, naming the first differing element (not dumping the vectors).
    fn assert_same(a: &[f32], b: &[f32], what: impl std::fmt::Display) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
            panic!("{what}: element {i} differs: {} vs {}", a[i], b[i]);
        }
    }

    fn differ(a: &[f32], b: &[f32]) -> bool {
        a.iter().zip(b).any(|(x, y)| x.to_bits() != y.to_bits())
    }

    /// Every rank holds bit-identical results at every step.
    fn assert_ranks_agree(res: &[Trace], what: &str) {
        for (r, other) in res.iter().enumerate().skip(1) {
            for (s, g) in other.0.iter().enumerate() {
                assert_same(g, &res[0].0[s], format!("{what}: rank {r} step {s}"));
            }
        }
    }

    /// Runs `steps` exchanges of `method` (with its default memory) on `world` ranks.
    fn run(world: usize, method: &str, steps: u64) -> Vec<Vec<Vec<f32>>> {
        let mut setup = Setup::new(parse_method(method).unwrap());
        setup.params = params();
        setup.policy = policy(4000);
        setup.run(world, steps).into_iter().map(|t| t.0).collect()
    }

    #[test]
    fn uncompressed_exchange_is_the_mean_and_identical_on_all_ranks() {
        for world in [1usize, 2, 3, 4] {
            let res = run(world, "none", 2);
            let n = res[0][0].len();
            for step in 0..2u64 {
                let s = step as usize;
                for other in &res[1..] {
                    assert_eq!(other[s], res[0][s], "bit-identical");
                }
                let grads: Vec<Vec<f32>> = (0..world).map(|r| grad(r, n, step)).collect();
                for (i, got) in res[0][s].iter().enumerate() {
                    let mean: f64 = grads.iter().map(|g| g[i] as f64).sum::<f64>() / world as f64;
                    assert!((*got as f64 - mean).abs() < 1e-6);
                }
            }
        }
    }

    /// The uncompressed exchange sums contiguous buckets where they lie and gathers the
    /// others; either way it must give the bits of gather → sum all-reduce → scatter × 1/P
    /// bucket by bucket (what the pipelined path computes), on every rank.
    #[test]
    fn uncompressed_exchange_in_place_matches_gather_sum_scatter_bit_for_bit() {
        let policies = [
            // Several buckets, all contiguous: summed in place.
            BucketPolicy {
                bucket_bytes: 4 * 3000,
                ..BucketPolicy::default()
            },
            // 1-D tensors bypass into one bucket of non-adjacent ranges: gathered.
            policy(3000),
        ];
        for (pi, pol) in policies.iter().enumerate() {
            for world in [1usize, 2, 3, 4] {
                let mut setup = Setup::new(parse_method("none").unwrap());
                setup.policy = pol.clone();
                let n = setup.n();
                let buckets = bucket::plan(&setup.params, pol);
                let in_place = buckets.iter().filter(|b| contiguous(b).is_some()).count();
                assert!(
                    if pi == 0 {
                        in_place == buckets.len() && buckets.len() > 2
                    } else {
                        in_place < buckets.len()
                    },
                    "policy {pi}: {in_place} of {} buckets contiguous",
                    buckets.len()
                );
                let got = setup.run(world, 2);
                let want = on_ranks(world, |rank, comm| {
                    (0..2u64)
                        .map(|s| {
                            let mut g = grad(rank, n, s);
                            let mut buf = Vec::new();
                            for b in &buckets {
                                bucket::gather(b, &g, &mut buf);
                                comm.all_reduce_sum(&mut buf).unwrap();
                                bucket::scatter(b, &buf, 1.0 / world as f32, &mut g);
                            }
                            g
                        })
                        .collect::<Vec<_>>()
                });
                for (rank, ((g, st), w)) in got.iter().zip(&want).enumerate() {
                    for (s, w) in w.iter().enumerate() {
                        let what = format!("policy {pi} world {world} rank {rank} step {s}");
                        assert_same(&g[s], w, what);
                        assert_eq!(st[s].payload_bytes, 4 * n as u64);
                        assert_eq!(st[s].non_finite, (world > 1).then_some(false));
                    }
                }
            }
        }
    }

    /// A sum can overflow although every rank's gradient is finite: the uncompressed
    /// exchange must say so (the trainer relies on it instead of scanning again).
    #[test]
    fn uncompressed_exchange_reports_an_overflowing_average() {
        let setup = Setup::new(parse_method("none").unwrap());
        let n = setup.n();
        let res = on_ranks(2, |rank, comm| {
            let mut ex = setup.exchanger();
            let mut g = grad(rank, n, 0);
            let ok = ex.exchange(comm, &mut g, 0).unwrap().non_finite;
            g[n - 1] = 3e38;
            let st = ex.exchange(comm, &mut g, 1).unwrap();
            (ok, st.non_finite, g[n - 1])
        });
        for (ok, overflow, last) in res {
            assert_eq!(ok, Some(false));
            assert_eq!(overflow, Some(true));
            assert!(last.is_infinite());
        }
    }

    #[test]
    fn a_non_finite_gradient_on_one_rank_makes_every_ranks_dense_average_non_finite() {
        // What lets the trainer skip its scan before a dense exchange.
        let setup = Setup::new(parse_method("none").unwrap());
        let n = setup.n();
        assert!(setup.exchanger().is_dense());
        assert!(!Setup::new(parse_method("topk:ratio=0.1").unwrap())
            .exchanger()
            .is_dense());
        for world in [2, 3] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for at in [0, n / 2, n - 1] {
                    let res = on_ranks(world, |rank, comm| {
                        let mut ex = setup.exchanger();
                        let mut g = grad(rank, n, 0);
                        if rank == world - 1 {
                            g[at] = bad;
                        }
                        ex.exchange(comm, &mut g, 0).unwrap().non_finite
                    });
                    assert!(
                        res.iter().all(|&r| r == Some(true)),
                        "world {world}, {bad} at {at}: {res:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn compressed_exchanges_agree_across_ranks_for_every_aggregation_kind() {
        // topk: gather; randomk: summable; fp16: dense.
        for method in ["topk:ratio=0.05", "randomk:ratio=0.2", "fp16"] {
            let res = run(3, method, 3);
            for (step, mine) in res[0].iter().enumerate() {
                assert_eq!(&res[1][step], mine, "{method}");
                assert_eq!(&res[2][step], mine, "{method}");
                assert!(mine.iter().any(|&v| v != 0.0), "{method}");
            }
        }
        // fp16 is close to the true mean.
        let res = run(2, "fp16", 1);
        let n = res[0][0].len();
        let (g0, g1) = (grad(0, n, 0), grad(1, n, 0));
        for (i, got) in res[0][0].iter().enumerate() {
            let mean = (g0[i] + g1[i]) / 2.0;
            assert!((got - mean).abs() < 1e-3);
        }
    }

    #[test]
    fn wrong_length_is_an_error() {
        let mut comm = Communicator::new(channel_mesh(1).pop().unwrap(), CommConfig::default());
        let cfg = CompressorConfig::default_for("topk").unwrap();
        let mut ex = Exchanger::new(
            &params(),
            &BucketPolicy::default(),
            &cfg,
            &MemoryConfig::None,
            0,
        )
        .unwrap();
        let mut g = vec![0f32; 3];
        assert!(matches!(
            ex.exchange(&mut comm, &mut g, 0),
            Err(ExchangeError::Length { .. })
        ));
    }

    /// Indices of the `k` largest `|x|` (ties → smaller index), ascending.
    fn brute_top_k(x: &[f32], k: usize) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..x.len()).collect();
        idx.sort_by(|&a, &b| x[b].abs().total_cmp(&x[a].abs()).then(a.cmp(&b)));
        idx.truncate(k);
        idx.sort();
        idx
    }

    /// ALGORITHMS.md §12.2, computed directly: per step and compressed bucket, `u_i = m_i +
    /// g_i`; the leader `t mod P` picks the top-k of its `u` per segment; every rank sends
    /// its `u` at those indices; the result is their average; `m_i ← (1 − β)·m_i + β·(u_i −
    /// c_i)`. Dense buckets are plain means.
    fn clt_k_reference(
        setup: &Setup,
        world: usize,
        steps: u64,
        ratio: f64,
        beta: f32,
    ) -> Vec<Vec<f32>> {
        let n = setup.n();
        let plan = bucket::plan(&setup.params, &setup.policy);
        let mut mem: Vec<BTreeMap<u64, Vec<f32>>> = vec![BTreeMap::new(); world];
        let mut out = Vec::new();
        for t in 0..steps {
            let grads: Vec<Vec<f32>> = (0..world).map(|r| grad(r, n, t)).collect();
            let mut want = vec![0f32; n];
            for b in &plan {
                let mut bufs = Vec::new();
                for g in &grads {
                    let mut v = Vec::new();
                    bucket::gather(b, g, &mut v);
                    bufs.push(v);
                }
                let mut avg = vec![0f32; b.len()];
                if !b.compressed {
                    for (j, a) in avg.iter_mut().enumerate() {
                        *a = (bufs.iter().map(|v| v[j] as f64).sum::<f64>() / world as f64) as f32;
                    }
                } else {
                    let u: Vec<Vec<f32>> = (0..world)
                        .map(|r| {
                            let m = mem[r].get(&b.id);
                            (0..b.len())
                                .map(|j| m.map_or(0.0, |m| m[j]) + bufs[r][j])
                                .collect()
                        })
                        .collect();
                    let leader = (t % world as u64) as usize;
                    let mut kept = Vec::new();
                    for s in &b.segments {
                        let k = dtrain_compress::topk::k_for(s.len(), ratio);
                        kept.extend(
                            brute_top_k(&u[leader][s.clone()], k)
                                .into_iter()
                                .map(|j| j + s.start),
                        );
                    }
                    for (r, ur) in u.iter().enumerate() {
                        let mut c = vec![0f32; b.len()];
                        for &j in &kept {
                            c[j] = ur[j];
                        }
                        let m = mem[r].entry(b.id).or_insert_with(|| vec![0.0; b.len()]);
                        for j in 0..b.len() {
                            m[j] = (1.0 - beta) * m[j] + beta * (ur[j] - c[j]);
                        }
                    }
                    for &j in &kept {
                        avg[j] =
                            (u.iter().map(|ur| ur[j] as f64).sum::<f64>() / world as f64) as f32;
                    }
                }
                bucket::scatter(b, &avg, 1.0, &mut want);
            }
            out.push(want);
        }
        out
    }

    #[test]
    fn scalecom_on_three_ranks_is_clt_k_with_a_low_pass_memory() {
        let (world, steps, beta) = (3, 7u64, 0.5f32);
        // `workers` is left at its default (1): the exchanger supplies the world size.
        let mut setup = Setup::new(parse_method("scalecom:ratio=0.05").unwrap());
        setup.memory = MemoryConfig::LowPass { beta };
        let want = clt_k_reference(&setup, world, steps, 0.05, beta);
        let mut default_workers = Vec::new();
        for overlap in [true, false] {
            setup.overlap = overlap;
            let res = setup.run(world, steps);
            default_workers = res[0].0.clone();
            assert_ranks_agree(&res, "scalecom");
            for (t, got) in res[0].0.iter().enumerate() {
                let mut nonzero = 0;
                for (j, (&a, &b)) in got.iter().zip(&want[t]).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                        "overlap {overlap} step {t} element {j}: {a} vs reference {b}"
                    );
                    // Unsent coordinates are exactly zero, as in the reference.
                    assert_eq!(a == 0.0, b == 0.0, "step {t} element {j}");
                    nonzero += (a != 0.0) as usize;
                }
                assert!(nonzero > 100, "step {t}: {nonzero}");
            }
            // Traffic: the index broadcast plus k values per bucket, not a gather of P
            // payloads.
            for st in &res[1].1 {
                assert!(st.bytes_sent > 0 && st.payload_bytes > 0);
            }
        }
        // An explicit, different `workers` in the config is overridden the same way.
        setup.method = CompressorConfig::ScaleCom(ScaleComConfig {
            ratio: 0.05,
            workers: 5,
        });
        let res = setup.run(world, 3);
        for (t, got) in res[0].0.iter().enumerate() {
            assert_same(got, &default_workers[t], format!("workers = 5, step {t}"));
        }
    }

    /// Every registered method at its defaults, plus denser variants of the sparsifiers
    /// (so that every bucket really is sparse or really is summed).
    fn all_kinds() -> Vec<CompressorConfig> {
        let mut v: Vec<CompressorConfig> = dtrain_compress::METHODS
            .iter()
            .map(|m| (m.default)())
            .collect();
        v.extend(
            [
                "randomk:ratio=0.2",
                "topk:ratio=0.05",
                "scalecom:ratio=0.05",
            ]
            .iter()
            .map(|m| parse_method(m).unwrap()),
        );
        v.push(CompressorConfig::Dgc(DgcConfig {
            ratio: 0.05,
            min_sparse_len: 1000,
            ..DgcConfig::default()
        }));
        v
    }

    #[test]
    fn sparse_all_reduce_gives_the_all_gather_gradients_bit_for_bit() {
        let mut covered = std::collections::BTreeSet::new();
        for world in [1usize, 2, 4] {
            for method in all_kinds() {
                let name = method.name();
                let mut setup = Setup::new(method);
                if setup
                    .exchanger()
                    .pipes()
                    .next()
                    .map(|p| p.compressor().aggregation())
                    != Some(Aggregation::Gather)
                    || name == "fft"
                {
                    // (FFT's gathered path sums spectra — one inverse transform — so its
                    // result differs by rounding; the config refuses fft + sparse-allreduce.)
                    continue;
                }
                covered.insert(name);
                let gathered = setup.run(world, 3);
                setup.gather = GatherCollective::SparseAllReduce;
                let sparse = setup.run(world, 3);
                for overlap in [false, true] {
                    setup.overlap = overlap;
                    let sparse2 = setup.run(world, 2);
                    for r in 0..world {
                        assert_same(
                            &sparse2[r].0[1],
                            &sparse[r].0[1],
                            format!("{name} overlap {overlap}"),
                        );
                    }
                }
                assert_ranks_agree(&sparse, name);
                for r in 0..world {
                    for s in 0..3 {
                        assert_same(
                            &sparse[r].0[s],
                            &gathered[r].0[s],
                            format!("{name}: P={world} rank {r} step {s}"),
                        );
                    }
                }
            }
        }
        // Every sparse method of the literature goes through it.
        for m in ["topk", "dgc", "threshold", "gradient-dropping"] {
            assert!(covered.contains(m), "{m} not covered: {covered:?}");
        }
    }

    #[test]
    fn overlap_is_bit_identical_to_the_sequential_path_for_every_aggregation_kind() {
        let world = 3;
        for method in all_kinds() {
            let name = method.name();
            let mut setup = Setup::new(method);
            assert_eq!(setup.exchanger().buckets().count(), 5);
            setup.overlap = false;
            let seq = setup.run(world, 3);
            setup.overlap = true;
            let ovl = setup.run(world, 3);
            assert_ranks_agree(&seq, name);
            assert_ranks_agree(&ovl, name);
            for r in 0..world {
                for s in 0..3 {
                    assert_same(
                        &ovl[r].0[s],
                        &seq[r].0[s],
                        format!("{name}: rank {r} step {s}"),
                    );
                    let (a, b) = (&seq[r].1[s], &ovl[r].1[s]);
                    // Same collectives, same bytes sent (received bytes may include early
                    // messages of a faster peer's next collective, so they vary).
                    assert_eq!(
                        (a.bytes_sent, a.payload_bytes),
                        (b.bytes_sent, b.payload_bytes),
                        "{name}"
                    );
                    // Sequentially every collective blocks the caller.
                    assert_eq!(a.wait_s, a.communicate_s, "{name}");
                    for x in [a, b] {
                        for t in [x.compress_s, x.communicate_s, x.wait_s, x.decompress_s] {
                            assert!(t.is_finite() && t >= 0.0, "{name}: {x:?}");
                        }
                        assert!(x.communicate_s > 0.0 && x.bytes_sent > 0, "{name}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_failing_compression_is_an_error_on_both_paths() {
        for overlap in [true, false] {
            let mut setup = Setup::new(parse_method("topk:ratio=0.05").unwrap());
            setup.overlap = overlap;
            let n = setup.n();
            let res = on_ranks(1, |_, comm| {
                let mut ex = setup.exchanger();
                let mut g = vec![0.5f32; n];
                g[3000] = f32::NAN; // in the second compressed bucket
                ex.exchange(comm, &mut g, 0)
            });
            assert!(
                matches!(res[0], Err(ExchangeError::Compress { bucket: 1, .. })),
                "{:?}",
                res[0]
            );
        }
    }

    #[test]
    fn ratio_metric_and_theta_scale_follow_the_schedules() {
        let n = params2().iter().map(|p| p.numel()).sum::<usize>();
        let sched = ThetaSchedule::Inv {
            theta0: 0.9,
            tau: 2.0,
        };
        let fft = CompressorConfig::Fft(FftConfig {
            theta_schedule: Some(sched.clone()),
            ..FftConfig::default()
        });
        let setup = Setup::new(fft);
        let res = on_ranks(1, |_, comm| {
            let mut ex = setup.exchanger();
            let mut plain = setup.exchanger();
            assert_eq!(ex.ratio_metric(), Some(("theta", sched.theta(0, 0))));
            assert_eq!(ex.theta_scale(), 1.0);
            let mut sizes = Vec::new();
            for s in 0..4u64 {
                let mut g = grad(0, n, s);
                let st = ex.exchange(comm, &mut g, s).unwrap();
                let mut h = grad(0, n, s);
                let pt = plain.exchange(comm, &mut h, s).unwrap();
                let scale = if s >= 2 { 0.5 * 0.5 } else { 1.0 };
                assert_eq!(
                    ex.ratio_metric(),
                    Some(("theta", sched.theta(s, 0) * scale))
                );
                sizes.push((st.payload_bytes, pt.payload_bytes));
                if s == 1 {
                    assert!(ex.scale_theta(0.5));
                    // Applies at once, on top of the schedule's current value...
                    assert_eq!(ex.ratio_metric(), Some(("theta", sched.theta(1, 0) * 0.5)));
                    assert!(ex.scale_theta(0.5));
                    assert_eq!(ex.theta_scale(), 0.25);
                }
            }
            sizes
        });
        // ... and keeps more bins at every later step than the unscaled run.
        let sizes = &res[0];
        assert_eq!(sizes[0].0, sizes[0].1);
        assert_eq!(sizes[1].0, sizes[1].1);
        assert!(
            sizes[2].0 > sizes[2].1 && sizes[3].0 > sizes[3].1,
            "{sizes:?}"
        );

        // DGC: the warm-up density of the last step.
        let warmup = Warmup::Exponential { epochs: 3 };
        let dgc = CompressorConfig::Dgc(DgcConfig {
            ratio: 0.01,
            steps_per_epoch: 1,
            warmup: warmup.clone(),
            min_sparse_len: 1000,
            ..DgcConfig::default()
        });
        let setup = Setup::new(dgc);
        on_ranks(1, |_, comm| {
            let mut ex = setup.exchanger();
            assert_eq!(
                ex.ratio_metric(),
                Some(("density", warmup.density(0, 0.01)))
            );
            for s in 0..5u64 {
                let mut g = grad(0, n, s);
                ex.exchange(comm, &mut g, s).unwrap();
                assert_eq!(
                    ex.ratio_metric(),
                    Some(("density", warmup.density(s, 0.01)))
                );
            }
            assert!(!ex.scale_theta(0.5));
            assert_eq!(ex.theta_scale(), 1.0);
        });

        for (m, want) in [
            ("topk:ratio=0.05", Some(("density", 0.05))),
            ("randomk:ratio=0.2", Some(("density", 0.2))),
            ("scalecom:ratio=0.03", Some(("density", 0.03))),
            ("gradient-dropping:drop_ratio=0.75", Some(("density", 0.25))),
            ("qsgd", None),
            ("fp16", None),
            ("none", None),
        ] {
            let mut ex = Setup::new(parse_method(m).unwrap()).exchanger();
            assert_eq!(ex.ratio_metric(), want, "{m}");
            assert!(!ex.scale_theta(0.5), "{m}");
            assert_eq!(ex.theta_scale(), 1.0, "{m}");
        }
    }

    /// Runs `2k` steps straight, and `k` steps → export (through JSON) → a new exchanger →
    /// import → `k` steps; `hook` runs before every step on both. Returns every rank's
    /// (straight, resumed, fresh-without-import) results of steps `k..2k`.
    fn resume(
        setup: &Setup,
        world: usize,
        k: u64,
        hook: impl Fn(&mut Exchanger, u64) + Sync,
    ) -> Vec<[Vec<Vec<f32>>; 3]> {
        on_ranks(world, |rank, comm| {
            let n = setup.n();
            let step = |ex: &mut Exchanger, comm: &mut Communicator<ChannelTransport>, s| {
                hook(ex, s);
                let mut g = grad(rank, n, s);
                ex.exchange(comm, &mut g, s).unwrap();
                g
            };
            let mut straight = setup.exchanger();
            let all: Vec<Vec<f32>> = (0..2 * k).map(|s| step(&mut straight, comm, s)).collect();
            let mut first = setup.exchanger();
            for s in 0..k {
                assert_same(&step(&mut first, comm, s), &all[s as usize], "first half");
            }
            let json = serde_json::to_string(&first.export_state()).unwrap();
            drop(first);
            let state: ExchangerState = serde_json::from_str(&json).unwrap();
            let mut second = setup.exchanger();
            second.import_state(state.clone()).unwrap();
            assert_eq!(second.export_state(), state);
            let resumed: Vec<Vec<f32>> = (k..2 * k).map(|s| step(&mut second, comm, s)).collect();
            let mut fresh = setup.exchanger();
            let fresh: Vec<Vec<f32>> = (k..2 * k).map(|s| step(&mut fresh, comm, s)).collect();
            [all[k as usize..].to_vec(), resumed, fresh]
        })
    }

    fn assert_resumes_bit_identically(name: &str, res: &[[Vec<Vec<f32>>; 3]]) {
        for (r, [straight, resumed, fresh]) in res.iter().enumerate() {
            for (s, (a, b)) in straight.iter().zip(resumed).enumerate() {
                assert_same(a, b, format!("{name}: rank {r}, step k+{s}"));
            }
            // The state matters: without it the run diverges at once.
            assert!(differ(&straight[0], &fresh[0]), "{name}: rank {r}");
        }
    }

    #[test]
    fn resume_from_exported_state_is_bit_identical() {
        let k = 4;
        // Top-k with residual error feedback.
        let setup = Setup::new(parse_method("topk:ratio=0.05").unwrap());
        assert_eq!(setup.memory, MemoryConfig::RESIDUAL);
        assert_resumes_bit_identically("topk", &resume(&setup, 2, k, |_, _| {}));

        // DGC: momentum-corrected memory, warm-up crossing the checkpoint.
        let setup = Setup::new(CompressorConfig::Dgc(DgcConfig {
            ratio: 0.02,
            steps_per_epoch: 2,
            warmup: Warmup::Exponential { epochs: 4 },
            min_sparse_len: 1000,
            ..DgcConfig::default()
        }));
        assert!(setup.memory.owns_momentum());
        assert_resumes_bit_identically("dgc", &resume(&setup, 2, k, |_, _| {}));

        // FFT with a θ schedule and a recover scale applied before the checkpoint.
        let setup = Setup::new(CompressorConfig::Fft(FftConfig {
            theta_schedule: Some(ThetaSchedule::Poly {
                theta0: 0.9,
                total_steps: 20,
                power: 1.0,
            }),
            ..FftConfig::default()
        }));
        let res = resume(&setup, 2, k, |ex, s| {
            if s == 1 {
                assert!(ex.scale_theta(0.5));
            }
        });
        assert_resumes_bit_identically("fft", &res);

        // ScaleCom on three ranks with a low-pass memory.
        let mut setup = Setup::new(parse_method("scalecom:ratio=0.05").unwrap());
        setup.memory = MemoryConfig::LowPass { beta: 0.5 };
        assert_resumes_bit_identically("scalecom", &resume(&setup, 3, k, |_, _| {}));
    }

    #[test]
    fn every_method_resumes_bit_identically() {
        // Catches compressor state that is neither re-derived from the step nor exported.
        for method in all_kinds() {
            let name = method.name();
            let res = resume(&Setup::new(method), 2, 2, |_, _| {});
            for (r, [straight, resumed, _]) in res.iter().enumerate() {
                for (s, (a, b)) in straight.iter().zip(resumed).enumerate() {
                    assert_same(a, b, format!("{name}: rank {r}, step k+{s}"));
                }
            }
        }
    }

    #[test]
    fn import_refuses_state_of_another_plan_method_or_shape() {
        let topk = parse_method("topk:ratio=0.05").unwrap();
        let setup = Setup::new(topk.clone());
        let n = setup.n();
        let state = on_ranks(1, |_, comm| {
            let mut ex = setup.exchanger();
            let mut g = grad(0, n, 0);
            ex.exchange(comm, &mut g, 0).unwrap();
            ex.export_state()
        })
        .pop()
        .unwrap();
        assert_eq!(state.memory.len(), 4, "one residual per compressed bucket");

        let err = |mut ex: Exchanger, st: ExchangerState| {
            let before = ex.export_state();
            let e = ex.import_state(st).unwrap_err();
            assert_eq!(
                ex.export_state(),
                before,
                "a refused import changes nothing"
            );
            e
        };
        // Another bucket policy, another model.
        let mut other = Setup::new(topk.clone());
        other.policy = policy(5000);
        let e = err(other.exchanger(), state.clone());
        assert!(e.contains("bucket plan"), "{e}");
        let mut other = Setup::new(topk.clone());
        other.params = params();
        let e = err(other.exchanger(), state.clone());
        assert!(e.contains("bucket plan"), "{e}");
        // Another method or memory.
        let e = err(
            Setup::new(parse_method("randomk").unwrap()).exchanger(),
            state.clone(),
        );
        assert!(e.contains("method"), "{e}");
        let mut other = Setup::new(topk.clone());
        other.memory = MemoryConfig::LowPass { beta: 1.0 };
        let e = err(other.exchanger(), state.clone());
        assert!(e.contains("memory"), "{e}");
        // Damaged contents.
        let mut bad = state.clone();
        bad.memory.get_mut(&0).unwrap().pop();
        let e = err(setup.exchanger(), bad);
        assert!(e.contains("bucket 0"), "{e}");
        let mut bad = state.clone();
        bad.memory.insert(4, vec![0.0; 113]);
        let e = err(setup.exchanger(), bad);
        assert!(e.contains("not compressed"), "{e}");
        let mut bad = state.clone();
        bad.version = 99;
        assert!(err(setup.exchanger(), bad).contains("version"));
        let mut bad = state.clone();
        bad.compressors
            .insert(1, BTreeMap::from([("theta_scale".to_string(), 0.5)]));
        let e = err(setup.exchanger(), bad);
        assert!(e.contains("bucket 1"), "{e}");
        // FFT: a bad value in the third bucket rolls back the first two.
        let fft = Setup::new(parse_method("fft").unwrap());
        let mut st = fft.exchanger().export_state();
        for (_, c) in st.compressors.iter_mut() {
            c.insert("theta_scale".into(), 0.5);
        }
        st.compressors
            .get_mut(&2)
            .unwrap()
            .insert("theta_base".into(), 1.5);
        let e = err(fft.exchanger(), st);
        assert!(e.contains("bucket 2"), "{e}");
        // The good state imports.
        setup.exchanger().import_state(state).unwrap();
    }
}
