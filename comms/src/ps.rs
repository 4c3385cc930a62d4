//! Parameter-server mode: workers push per-shard payloads, servers aggregate them and every
//! worker pulls the aggregate — synchronously or with bounded staleness (stale-synchronous
//! parallel, SSP).
//!
//! # Model
//! * A [`PsLayout`] names the worker ranks and the server ranks of a run (a rank may be
//!   both: co-located) and shards a model of `len` elements across the servers by
//!   contiguous ranges ([`PsLayout::shard_range`], the same split as
//!   [`crate::segment_range`]). Server `j` (the `j`-th rank of the server list) owns shard `j`.
//! * Every worker pushes, for each step, one payload per shard — opaque bytes (a dense
//!   f32 slice, or a compressed encoding of the shard) plus the [`Aggregation`] the server
//!   must apply. Workers push steps 0, 1, 2, … in order — or, for a run resumed from a
//!   checkpoint, from [`PsConfig::first_step`] on, so that step numbers stay global.
//! * A server aggregates step `t` of its shard once every worker has pushed it, in worker
//!   order (deterministic: every worker receives the same bytes), with a pluggable
//!   [`Aggregator`] (default [`DenseF32`]: sum or mean of f32 slices; compressed
//!   decode-and-sum or MIPD's smoothing plug in here), and sends the result to every worker.
//! * **Staleness bound `s`** ([`PsConfig::staleness`]): a worker may push step `t` only once
//!   the aggregates of every step `< t − s` arrived (all workers pushed them). Its clock
//!   (steps pushed) is therefore never more than `s` ahead of the slowest worker's:
//!   `s = 0` is synchronous (push `t`, wait for aggregate `t`), `s = u64::MAX` fully
//!   asynchronous (Project Adam). Servers check the bound too and reject a worker that
//!   breaks it. A step's aggregate always contains every worker's push of that step (SSP
//!   with per-step aggregation: staleness delays when a worker *sees* an aggregate, never
//!   what is in it).
//!
//! # Layers
//! [`ServerMachine`] and [`WorkerMachine`] are IO-free state machines like [`crate::algo`]:
//! feed them decoded [`PsMsg`]s with `handle`, drain `poll_transmit`. [`PsNode`] is the
//! blocking facade over any [`Transport`]: it runs the worker and/or server machine of its
//! rank, owns timeouts and failure propagation, and reports failures as [`CommError`]s
//! naming the culprit rank:
//! * a peer whose transport closed while still needed → [`CommError::PeerLost`] on the
//!   rank that saw it, which broadcasts an abort so every other rank of the run fails with
//!   the same error within moments;
//! * no progress for [`PsConfig::timeout`] → a server names the workers whose push of the
//!   oldest incomplete step is missing ([`CommError::Timeout`]), and aborts everyone.
//!   Workers wait `timeout + abort_grace` before blaming the servers themselves, so a
//!   stalled worker is named by the servers' abort rather than a server being blamed.
//! * protocol violations (out-of-order or duplicate pushes, a broken staleness bound, a
//!   payload the aggregator rejects, different aggregations for one step) →
//!   [`CommError::Protocol`] / [`CommError::Mismatch`] naming the worker.
//!
//! A rank that is only a server calls [`PsNode::serve`]; a worker calls [`PsNode::step`]
//! (or [`PsNode::push`] and [`PsNode::pull`]) and finally [`PsNode::finish`], which on a
//! co-located rank keeps serving until every worker has finished. Note that a co-located
//! server makes progress only while its rank is inside a `PsNode` call: with `s > 0`, a
//! co-located rank busy computing delays the aggregates of its shard by up to one of its
//! steps (use separate server ranks, e.g. threads with their own transport, to avoid it).

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::algo::AlgoError;
use crate::comm::CommError;
use crate::transport::{Transport, TransportError};

/// First byte of every parameter-server message (collective messages start with
/// [`crate::wire::WIRE_VERSION`], so the two are never confused).
pub const PS_MAGIC: u8 = 0xD5;
/// Length of the parameter-server message header.
pub const PS_HEADER_LEN: usize = 16;

/// Which aggregation a server applies to the pushes of one step and shard. Codes below 16
/// are reserved for dtrain; [`DenseF32`] implements [`Aggregation::SUM`] and
/// [`Aggregation::MEAN`]. All workers must push the same aggregation for a step and shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Aggregation(pub u8);

impl Aggregation {
    /// Element-wise f32 sum, in worker order.
    pub const SUM: Aggregation = Aggregation(0);
    /// Element-wise f32 sum in worker order, then divided by the number of workers.
    pub const MEAN: Aggregation = Aggregation(1);
}

/// A parameter-server message (wire layout: magic, type, aggregation or reason, 0,
/// shard u32, step u64, payload; little-endian).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PsMsg {
    /// Worker → server: the worker's payload of `step` for `shard`.
    Push {
        /// Shard index.
        shard: u32,
        /// Step.
        step: u64,
        /// Aggregation to apply.
        aggregation: Aggregation,
        /// Opaque payload.
        payload: Vec<u8>,
    },
    /// Server → worker: the aggregate of `step` for `shard`.
    Aggregate {
        /// Shard index.
        shard: u32,
        /// Step.
        step: u64,
        /// The aggregator's output.
        payload: Vec<u8>,
    },
    /// Worker → server: the worker is done after `steps` steps.
    Leave {
        /// Steps the worker pushed.
        steps: u64,
    },
    /// Any → any: the sender gave up; the run fails with this error everywhere.
    Abort {
        /// Why.
        reason: AbortKind,
        /// The ranks blamed.
        culprits: Vec<u32>,
        /// Human-readable detail (at most 512 bytes on the wire).
        detail: String,
    },
}

/// Reason of a [`PsMsg::Abort`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum AbortKind {
    /// The culprit's transport closed.
    PeerLost = 1,
    /// The culprit disagrees (different aggregation, different number of steps).
    Mismatch = 2,
    /// The culprits did not answer in time.
    Timeout = 3,
    /// The culprit sent something malformed or unexpected.
    Protocol = 4,
}

const T_PUSH: u8 = 1;
const T_AGGREGATE: u8 = 2;
const T_LEAVE: u8 = 3;
const T_ABORT: u8 = 4;
const MAX_DETAIL: usize = 512;

impl PsMsg {
    /// Encodes the message.
    pub fn encode(&self) -> Vec<u8> {
        let (ty, b2, shard, step, payload): (u8, u8, u32, u64, &[u8]) = match self {
            PsMsg::Push {
                shard,
                step,
                aggregation,
                payload,
            } => (T_PUSH, aggregation.0, *shard, *step, payload),
            PsMsg::Aggregate {
                shard,
                step,
                payload,
            } => (T_AGGREGATE, 0, *shard, *step, payload),
            PsMsg::Leave { steps } => (T_LEAVE, 0, 0, *steps, &[]),
            PsMsg::Abort { .. } => (T_ABORT, 0, 0, 0, &[]),
        };
        let mut out = Vec::with_capacity(PS_HEADER_LEN + payload.len());
        out.extend_from_slice(&[PS_MAGIC, ty, b2, 0]);
        out.extend_from_slice(&shard.to_le_bytes());
        out.extend_from_slice(&step.to_le_bytes());
        out.extend_from_slice(payload);
        if let PsMsg::Abort {
            reason,
            culprits,
            detail,
        } = self
        {
            out[2] = *reason as u8;
            out.extend_from_slice(&(culprits.len() as u32).to_le_bytes());
            for c in culprits {
                out.extend_from_slice(&c.to_le_bytes());
            }
            let mut cut = detail.len().min(MAX_DETAIL);
            while !detail.is_char_boundary(cut) {
                cut -= 1;
            }
            out.extend_from_slice(&detail.as_bytes()[..cut]);
        }
        out
    }

    /// Decodes a message; never panics on hostile bytes.
    pub fn decode(mut b: Vec<u8>) -> Result<PsMsg, String> {
        if b.len() < PS_HEADER_LEN {
            return Err(format!("parameter-server message of {} bytes", b.len()));
        }
        if b[0] != PS_MAGIC {
            return Err(format!(
                "not a parameter-server message (first byte {})",
                b[0]
            ));
        }
        let shard = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let mut s = [0u8; 8];
        s.copy_from_slice(&b[8..16]);
        let step = u64::from_le_bytes(s);
        let (ty, b2) = (b[1], b[2]);
        let payload = b.split_off(PS_HEADER_LEN);
        Ok(match ty {
            T_PUSH => PsMsg::Push {
                shard,
                step,
                aggregation: Aggregation(b2),
                payload,
            },
            T_AGGREGATE => PsMsg::Aggregate {
                shard,
                step,
                payload,
            },
            T_LEAVE => PsMsg::Leave { steps: step },
            T_ABORT => {
                let reason = match b2 {
                    1 => AbortKind::PeerLost,
                    2 => AbortKind::Mismatch,
                    3 => AbortKind::Timeout,
                    4 => AbortKind::Protocol,
                    r => return Err(format!("unknown abort reason {r}")),
                };
                if payload.len() < 4 {
                    return Err("short abort payload".into());
                }
                let n = u32::from_le_bytes([payload[0], payload[1], payload[2], payload[3]]);
                let n = n as usize;
                if n > (payload.len() - 4) / 4 {
                    return Err("abort culprit list longer than the message".into());
                }
                let culprits = payload[4..4 + 4 * n]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let detail = String::from_utf8_lossy(&payload[4 + 4 * n..]).into_owned();
                PsMsg::Abort {
                    reason,
                    culprits,
                    detail,
                }
            }
            t => return Err(format!("unknown parameter-server message type {t}")),
        })
    }
}

/// Who does what in a parameter-server run, and how the model is sharded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PsLayout {
    world: usize,
    workers: Vec<usize>,
    servers: Vec<usize>,
    len: usize,
}

impl PsLayout {
    /// `workers` and `servers` are rank lists (each without duplicates, non-empty, ranks
    /// below `world`; a rank may be in both). Server `servers[j]` owns shard `j` of a model
    /// of `len` elements.
    pub fn new(
        world: usize,
        workers: Vec<usize>,
        servers: Vec<usize>,
        len: usize,
    ) -> Result<Self, CommError> {
        for (what, list) in [("workers", &workers), ("servers", &servers)] {
            if list.is_empty() {
                return Err(CommError::InvalidArgument(format!("no {what}")));
            }
            let mut sorted = list.clone();
            sorted.sort_unstable();
            sorted.dedup();
            if sorted.len() != list.len() {
                return Err(CommError::InvalidArgument(format!(
                    "duplicate rank in {what}"
                )));
            }
            if let Some(r) = list.iter().find(|&&r| r >= world) {
                return Err(CommError::InvalidArgument(format!(
                    "{what}: rank {r} out of range for world size {world}"
                )));
            }
        }
        Ok(PsLayout {
            world,
            workers,
            servers,
            len,
        })
    }

    /// Number of ranks of the run.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Worker ranks, in worker order (the order of aggregation).
    pub fn workers(&self) -> &[usize] {
        &self.workers
    }

    /// Server ranks; `servers()[j]` owns shard `j`.
    pub fn servers(&self) -> &[usize] {
        &self.servers
    }

    /// Model length in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the model is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of shards (= servers).
    pub fn num_shards(&self) -> usize {
        self.servers.len()
    }

    /// Element range of shard `j`.
    ///
    /// # Panics
    /// If `j >= num_shards()`.
    pub fn shard_range(&self, j: usize) -> Range<usize> {
        crate::segment_range(self.len, self.servers.len(), j)
    }

    /// The shard `rank` serves, if it is a server.
    pub fn shard_of(&self, rank: usize) -> Option<usize> {
        self.servers.iter().position(|&r| r == rank)
    }

    /// The index of `rank` in the worker list, if it is a worker.
    pub fn worker_index(&self, rank: usize) -> Option<usize> {
        self.workers.iter().position(|&r| r == rank)
    }
}

/// What an [`Aggregator`] combines: the pushes of one step for one shard.
#[derive(Debug)]
pub struct ShardPushes<'a> {
    /// Shard index.
    pub shard: usize,
    /// The shard's element range in the model.
    pub range: Range<usize>,
    /// Step.
    pub step: u64,
    /// The aggregation every worker asked for.
    pub aggregation: Aggregation,
    /// `(worker rank, payload)` in worker order.
    pub pushes: &'a [(usize, &'a [u8])],
}

/// A push an [`Aggregator`] could not use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AggregateError {
    /// The worker whose payload (or requested aggregation) is at fault.
    pub worker: usize,
    /// What was wrong.
    pub detail: String,
}

impl AggregateError {
    /// Refuses the aggregation the workers asked for in `input` (blaming the first pusher):
    /// `server` says what this aggregator applies instead.
    pub fn unsupported(input: &ShardPushes<'_>, server: &str) -> Self {
        AggregateError {
            worker: input.pushes.first().map_or(0, |p| p.0),
            detail: format!("{server} cannot apply {:?}", input.aggregation),
        }
    }
}

/// Combines the pushes of one step for one shard into the bytes every worker pulls.
/// Must be deterministic (same inputs, same bytes). Closures
/// `FnMut(&ShardPushes) -> Result<Vec<u8>, AggregateError>` are aggregators too.
pub trait Aggregator: Send {
    /// Aggregates `input`.
    fn aggregate(&mut self, input: &ShardPushes<'_>) -> Result<Vec<u8>, AggregateError>;
}

impl<F> Aggregator for F
where
    F: FnMut(&ShardPushes<'_>) -> Result<Vec<u8>, AggregateError> + Send,
{
    fn aggregate(&mut self, input: &ShardPushes<'_>) -> Result<Vec<u8>, AggregateError> {
        self(input)
    }
}

/// The default aggregator: payloads are the shard's elements as little-endian f32;
/// [`Aggregation::SUM`] adds them in worker order, [`Aggregation::MEAN`] then divides by
/// the number of workers. Other aggregations, and payloads of the wrong length, are
/// errors naming the worker.
#[derive(Debug, Clone, Copy, Default)]
pub struct DenseF32;

impl Aggregator for DenseF32 {
    fn aggregate(&mut self, input: &ShardPushes<'_>) -> Result<Vec<u8>, AggregateError> {
        let n = input.range.len();
        let mut acc = vec![0f32; n];
        for (i, &(worker, p)) in input.pushes.iter().enumerate() {
            if input.aggregation != Aggregation::SUM && input.aggregation != Aggregation::MEAN {
                return Err(AggregateError {
                    worker,
                    detail: format!("DenseF32 cannot apply {:?}", input.aggregation),
                });
            }
            if p.len() != 4 * n {
                return Err(AggregateError {
                    worker,
                    detail: format!(
                        "shard {} expects {} f32 ({} bytes), got {} bytes",
                        input.shard,
                        n,
                        4 * n,
                        p.len()
                    ),
                });
            }
            for (a, c) in acc.iter_mut().zip(p.chunks_exact(4)) {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                *a = if i == 0 { v } else { *a + v };
            }
        }
        if input.aggregation == Aggregation::MEAN {
            let w = input.pushes.len() as f32;
            acc.iter_mut().for_each(|a| *a /= w);
        }
        Ok(acc.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// Encodes f32 values as the little-endian bytes [`DenseF32`] expects.
pub fn f32_payload(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Decodes little-endian f32 bytes (a trailing partial value is ignored).
pub fn f32_values(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn saturating_bound(complete: u64, staleness: u64) -> u64 {
    complete.saturating_add(staleness)
}

/// One worker's push as a server keeps it until its step is complete.
type Push = (Aggregation, Vec<u8>);

/// The server of one shard, as an IO-free state machine (see the [module docs](self)).
pub struct ServerMachine<A: Aggregator> {
    layout: PsLayout,
    shard: usize,
    staleness: u64,
    aggregator: A,
    /// Per worker index: the next step it must push.
    next_push: Vec<u64>,
    /// Per worker index: the step count it left with.
    left: Vec<Option<u64>>,
    /// Step → per worker index: its push.
    pending: BTreeMap<u64, Vec<Option<Push>>>,
    /// Steps aggregated so far (the next step to complete).
    completed: u64,
    out: VecDeque<(usize, PsMsg)>,
}

impl<A: Aggregator> std::fmt::Debug for ServerMachine<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerMachine")
            .field("shard", &self.shard)
            .field("completed", &self.completed)
            .field("next_push", &self.next_push)
            .field("left", &self.left)
            .finish()
    }
}

impl<A: Aggregator> ServerMachine<A> {
    /// The server of `shard` with staleness bound `staleness`.
    ///
    /// # Panics
    /// If `shard >= layout.num_shards()`.
    pub fn new(layout: PsLayout, shard: usize, staleness: u64, aggregator: A) -> Self {
        assert!(shard < layout.num_shards(), "shard {shard} out of range");
        let w = layout.workers().len();
        ServerMachine {
            layout,
            shard,
            staleness,
            aggregator,
            next_push: vec![0; w],
            left: vec![None; w],
            pending: BTreeMap::new(),
            completed: 0,
            out: VecDeque::new(),
        }
    }

    /// Starts the clock at `step` instead of 0 (every worker's next push is `step`, as for
    /// a run resumed after `step` steps; see [`PsConfig::first_step`]).
    pub fn starting_at(mut self, step: u64) -> Self {
        self.next_push.iter_mut().for_each(|n| *n = step);
        self.completed = step;
        self
    }

    /// Whether nothing was pushed, aggregated or left since the clock started at `first`.
    fn is_fresh(&self, first: u64) -> bool {
        self.completed == first
            && self.pending.is_empty()
            && self.out.is_empty()
            && self.left.iter().all(Option::is_none)
            && self.next_push.iter().all(|&n| n == first)
    }

    /// The aggregator.
    pub fn aggregator(&self) -> &A {
        &self.aggregator
    }

    /// The aggregator, mutably (to restore its state before the first step).
    pub fn aggregator_mut(&mut self) -> &mut A {
        &mut self.aggregator
    }

    /// Steps aggregated so far (counting from the first step, 0 unless started later).
    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// Feeds one message from `from`.
    pub fn handle(&mut self, from: usize, msg: PsMsg) -> Result<(), AlgoError> {
        let Some(wi) = self.layout.worker_index(from) else {
            return Err(AlgoError::Protocol {
                peer: from,
                detail: "a rank that is not a worker sent to a server".into(),
            });
        };
        match msg {
            PsMsg::Push {
                shard,
                step,
                aggregation,
                payload,
            } => {
                if shard as usize != self.shard {
                    return Err(AlgoError::Protocol {
                        peer: from,
                        detail: format!("pushed shard {shard} to the server of {}", self.shard),
                    });
                }
                if self.left[wi].is_some() || step != self.next_push[wi] {
                    return Err(AlgoError::Protocol {
                        peer: from,
                        detail: format!(
                            "pushed step {step}, expected step {} (left: {:?})",
                            self.next_push[wi], self.left[wi]
                        ),
                    });
                }
                if step > saturating_bound(self.completed, self.staleness) {
                    return Err(AlgoError::Protocol {
                        peer: from,
                        detail: format!(
                            "pushed step {step} with only {} steps aggregated: beyond the \
                             staleness bound {}",
                            self.completed, self.staleness
                        ),
                    });
                }
                if let Some((li, steps)) = self.left_before(step) {
                    return Err(AlgoError::Mismatch {
                        peer: self.layout.workers()[li],
                        detail: format!(
                            "worker left after {steps} steps while rank {from} pushed step {step}"
                        ),
                    });
                }
                self.next_push[wi] += 1;
                let w = self.layout.workers().len();
                self.pending.entry(step).or_insert_with(|| vec![None; w])[wi] =
                    Some((aggregation, payload));
                self.try_complete()
            }
            PsMsg::Leave { steps } => {
                if self.left[wi].is_some() || steps != self.next_push[wi] {
                    return Err(AlgoError::Protocol {
                        peer: from,
                        detail: format!(
                            "left after {steps} steps but pushed {}",
                            self.next_push[wi]
                        ),
                    });
                }
                if let Some(&later) = self.pending.keys().next_back() {
                    if later >= steps {
                        return Err(AlgoError::Mismatch {
                            peer: from,
                            detail: format!(
                                "worker left after {steps} steps while others pushed step {later}"
                            ),
                        });
                    }
                }
                self.left[wi] = Some(steps);
                Ok(())
            }
            other => Err(AlgoError::Protocol {
                peer: from,
                detail: format!("unexpected message at a server: {other:?}"),
            }),
        }
    }

    /// A worker that left before pushing `step`, as (worker index, steps).
    fn left_before(&self, step: u64) -> Option<(usize, u64)> {
        self.left
            .iter()
            .enumerate()
            .find_map(|(i, l)| l.filter(|&s| s <= step).map(|s| (i, s)))
    }

    fn try_complete(&mut self) -> Result<(), AlgoError> {
        while let Some(slots) = self.pending.get(&self.completed) {
            if slots.iter().any(Option::is_none) {
                break;
            }
            let slots = self.pending.remove(&self.completed).expect("present");
            let workers = self.layout.workers();
            let first = slots[0].as_ref().expect("complete").0;
            let pushes: Vec<(usize, &[u8])> = slots
                .iter()
                .zip(workers)
                .map(|(s, &r)| (r, s.as_ref().expect("complete").1.as_slice()))
                .collect();
            for (s, &r) in slots.iter().zip(workers) {
                let a = s.as_ref().expect("complete").0;
                if a != first {
                    return Err(AlgoError::Mismatch {
                        peer: r,
                        detail: format!(
                            "step {}: pushed aggregation {a:?}, worker {} pushed {first:?}",
                            self.completed, workers[0]
                        ),
                    });
                }
            }
            let input = ShardPushes {
                shard: self.shard,
                range: self.layout.shard_range(self.shard),
                step: self.completed,
                aggregation: first,
                pushes: &pushes,
            };
            let agg = self
                .aggregator
                .aggregate(&input)
                .map_err(|e| AlgoError::Protocol {
                    peer: e.worker,
                    detail: format!("step {}: {}", self.completed, e.detail),
                })?;
            for &r in workers {
                self.out.push_back((
                    r,
                    PsMsg::Aggregate {
                        shard: self.shard as u32,
                        step: self.completed,
                        payload: agg.clone(),
                    },
                ));
            }
            self.completed += 1;
        }
        Ok(())
    }

    /// The next message to send, as `(to_rank, message)`.
    pub fn poll_transmit(&mut self) -> Option<(usize, PsMsg)> {
        self.out.pop_front()
    }

    /// Whether every worker has left and every aggregate was handed out.
    pub fn is_done(&self) -> bool {
        self.left.iter().all(Option::is_some) && self.out.is_empty()
    }

    /// Whether the server still needs messages from `rank` (a worker that has not left).
    pub fn expects_from(&self, rank: usize) -> bool {
        self.layout
            .worker_index(rank)
            .is_some_and(|i| self.left[i].is_none())
    }

    /// The workers holding up progress: those whose push of the oldest incomplete step is
    /// missing (or, if no step is pending, every worker that has not left).
    pub fn waiting_on(&self) -> Vec<usize> {
        let workers = self.layout.workers();
        match self.pending.get(&self.completed) {
            Some(slots) => slots
                .iter()
                .zip(workers)
                .filter(|(s, _)| s.is_none())
                .map(|(_, &r)| r)
                .collect(),
            None => workers
                .iter()
                .zip(&self.left)
                .filter(|(_, l)| l.is_none())
                .map(|(&r, _)| r)
                .collect(),
        }
    }
}

/// The aggregate of one step: one payload per shard, in shard order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Aggregate {
    /// Step.
    pub step: u64,
    /// `shards[j]` is shard `j`'s aggregate.
    pub shards: Vec<Vec<u8>>,
}

impl Aggregate {
    /// The shards' f32 values concatenated: the whole model for [`DenseF32`] aggregates.
    pub fn dense(&self) -> Vec<f32> {
        self.shards.iter().flat_map(|s| f32_values(s)).collect()
    }
}

/// A worker, as an IO-free state machine (see the [module docs](self)).
#[derive(Debug)]
pub struct WorkerMachine {
    layout: PsLayout,
    staleness: u64,
    /// Steps pushed.
    pushed: u64,
    /// Per shard: aggregates received (they arrive in step order).
    received: Vec<u64>,
    /// Step → per shard aggregate, for steps not yet handed out.
    ready: BTreeMap<u64, Vec<Option<Vec<u8>>>>,
    /// Steps whose aggregate arrived from every shard.
    complete: u64,
    /// Steps handed out by `take_ready`.
    taken: u64,
    left: bool,
    out: VecDeque<(usize, PsMsg)>,
}

impl WorkerMachine {
    /// A worker of `layout` with staleness bound `staleness`.
    pub fn new(layout: PsLayout, staleness: u64) -> Self {
        let m = layout.num_shards();
        WorkerMachine {
            layout,
            staleness,
            pushed: 0,
            received: vec![0; m],
            ready: BTreeMap::new(),
            complete: 0,
            taken: 0,
            left: false,
            out: VecDeque::new(),
        }
    }

    /// Starts the clock at `step` instead of 0: the next push is `step` (a run resumed
    /// after `step` steps; see [`PsConfig::first_step`]).
    pub fn starting_at(mut self, step: u64) -> Self {
        self.pushed = step;
        self.received.iter_mut().for_each(|r| *r = step);
        self.complete = step;
        self.taken = step;
        self
    }

    /// Whether nothing was pushed or left since the clock started at `first`.
    fn is_fresh(&self, first: u64) -> bool {
        self.pushed == first && !self.left && self.out.is_empty()
    }

    /// Steps pushed so far (the worker's clock; the next push is this step).
    pub fn pushed(&self) -> u64 {
        self.pushed
    }

    /// Steps whose aggregate has arrived from every shard.
    pub fn complete(&self) -> u64 {
        self.complete
    }

    /// Whether the staleness bound allows pushing the next step now.
    pub fn can_push(&self) -> bool {
        !self.left && self.pushed <= saturating_bound(self.complete, self.staleness)
    }

    /// Queues the pushes of the next step (one payload per shard); returns the step.
    /// Errors (nothing queued) if the bound does not allow it yet, the worker has left, or
    /// the number of payloads is not the number of shards.
    pub fn push(
        &mut self,
        aggregation: Aggregation,
        payloads: Vec<Vec<u8>>,
    ) -> Result<u64, String> {
        if payloads.len() != self.layout.num_shards() {
            return Err(format!(
                "{} payloads for {} shards",
                payloads.len(),
                self.layout.num_shards()
            ));
        }
        if !self.can_push() {
            return Err(format!(
                "step {} not allowed: {} steps complete, staleness bound {} (left: {})",
                self.pushed, self.complete, self.staleness, self.left
            ));
        }
        let step = self.pushed;
        for (j, payload) in payloads.into_iter().enumerate() {
            self.out.push_back((
                self.layout.servers()[j],
                PsMsg::Push {
                    shard: j as u32,
                    step,
                    aggregation,
                    payload,
                },
            ));
        }
        self.pushed += 1;
        Ok(step)
    }

    /// Queues the leave messages. Errors if aggregates of pushed steps are outstanding.
    pub fn leave(&mut self) -> Result<(), String> {
        if self.complete != self.pushed {
            return Err(format!(
                "{} steps pushed but only {} aggregated",
                self.pushed, self.complete
            ));
        }
        if !self.left {
            self.left = true;
            for &s in self.layout.servers() {
                self.out.push_back((s, PsMsg::Leave { steps: self.pushed }));
            }
        }
        Ok(())
    }

    /// Feeds one message from `from`.
    pub fn handle(&mut self, from: usize, msg: PsMsg) -> Result<(), AlgoError> {
        match msg {
            PsMsg::Aggregate {
                shard,
                step,
                payload,
            } => {
                let j = shard as usize;
                if j >= self.layout.num_shards() || self.layout.servers()[j] != from {
                    return Err(AlgoError::Protocol {
                        peer: from,
                        detail: format!("sent an aggregate of shard {shard} it does not serve"),
                    });
                }
                if step != self.received[j] || step >= self.pushed {
                    return Err(AlgoError::Protocol {
                        peer: from,
                        detail: format!(
                            "sent the aggregate of step {step}; expected step {} ({} pushed)",
                            self.received[j], self.pushed
                        ),
                    });
                }
                self.received[j] += 1;
                let m = self.layout.num_shards();
                self.ready.entry(step).or_insert_with(|| vec![None; m])[j] = Some(payload);
                self.complete = *self.received.iter().min().expect("at least one shard");
                Ok(())
            }
            other => Err(AlgoError::Protocol {
                peer: from,
                detail: format!("unexpected message at a worker: {other:?}"),
            }),
        }
    }

    /// The next message to send, as `(to_rank, message)`.
    pub fn poll_transmit(&mut self) -> Option<(usize, PsMsg)> {
        self.out.pop_front()
    }

    /// Hands out the aggregates of completed steps not handed out before, in step order.
    pub fn take_ready(&mut self) -> Vec<Aggregate> {
        let mut v = Vec::new();
        while self.taken < self.complete {
            let shards = self
                .ready
                .remove(&self.taken)
                .expect("complete step is ready");
            v.push(Aggregate {
                step: self.taken,
                shards: shards.into_iter().map(|s| s.expect("complete")).collect(),
            });
            self.taken += 1;
        }
        v
    }

    /// Whether the worker waits for a message from `rank` (a server with outstanding
    /// aggregates).
    pub fn expects_from(&self, rank: usize) -> bool {
        self.layout
            .shard_of(rank)
            .is_some_and(|j| self.received[j] < self.pushed)
    }

    /// The servers whose aggregate of the oldest incomplete step is missing.
    pub fn waiting_on(&self) -> Vec<usize> {
        let servers = self.layout.servers();
        (0..servers.len())
            .filter(|&j| self.received[j] < self.pushed)
            .map(|j| servers[j])
            .collect()
    }
}

/// Configuration of a [`PsNode`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PsConfig {
    /// Inactivity timeout. Default 30 s.
    pub timeout: Duration,
    /// Extra time a worker waits before blaming servers (so that a server's diagnosis of a
    /// stalled worker arrives first). Default 2 s.
    pub abort_grace: Duration,
    /// Staleness bound `s` (0 = synchronous, `u64::MAX` = unbounded). Default 0.
    pub staleness: u64,
    /// The step every clock starts at (default 0): a run resumed from a checkpoint taken
    /// after `k` steps starts at `k` on every rank, so that servers whose state depends on
    /// the step number (MIPD's alternating halves) continue where they stopped.
    pub first_step: u64,
}

impl Default for PsConfig {
    fn default() -> Self {
        PsConfig {
            timeout: Duration::from_secs(30),
            abort_grace: Duration::from_secs(2),
            staleness: 0,
            first_step: 0,
        }
    }
}

/// One rank of a parameter-server run over a [`Transport`]: its worker and/or server
/// machine, driven by blocking calls (see the [module docs](self)).
#[derive(Debug)]
pub struct PsNode<T: Transport, A: Aggregator> {
    transport: T,
    layout: PsLayout,
    cfg: PsConfig,
    server: Option<ServerMachine<A>>,
    worker: Option<WorkerMachine>,
    /// Why each peer is lost (`None`: not lost).
    closed: Vec<Option<String>>,
    failed: Option<String>,
}

impl<T: Transport, A: Aggregator> PsNode<T, A> {
    /// This rank's node; its roles come from `layout`. The aggregator is used if the rank
    /// is a server.
    pub fn new(
        transport: T,
        layout: PsLayout,
        cfg: PsConfig,
        aggregator: A,
    ) -> Result<Self, CommError> {
        let me = transport.rank();
        if layout.world_size() != transport.world_size() {
            return Err(CommError::InvalidArgument(format!(
                "layout for {} ranks, transport has {}",
                layout.world_size(),
                transport.world_size()
            )));
        }
        let server = layout.shard_of(me).map(|j| {
            ServerMachine::new(layout.clone(), j, cfg.staleness, aggregator)
                .starting_at(cfg.first_step)
        });
        let worker = layout
            .worker_index(me)
            .map(|_| WorkerMachine::new(layout.clone(), cfg.staleness).starting_at(cfg.first_step));
        if server.is_none() && worker.is_none() {
            return Err(CommError::InvalidArgument(format!(
                "rank {me} is neither a worker nor a server"
            )));
        }
        let world = transport.world_size();
        Ok(PsNode {
            transport,
            layout,
            cfg,
            server,
            worker,
            closed: vec![None; world],
            failed: None,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// Restarts this rank's clocks at `step` (see [`PsConfig::first_step`]) when nothing
    /// has been pushed or served yet: a run resumed from a checkpoint taken after `step`
    /// steps. Every rank of the run must start at the same step.
    pub fn start_at(&mut self, step: u64) -> Result<(), CommError> {
        let first = self.cfg.first_step;
        let fresh = self.worker.as_ref().is_none_or(|w| w.is_fresh(first))
            && self.server.as_ref().is_none_or(|s| s.is_fresh(first));
        if !fresh {
            return Err(CommError::InvalidArgument(format!(
                "the parameter server of rank {} cannot restart its clock at step {step}: it \
                 has already pushed or served",
                self.rank()
            )));
        }
        self.server = self.server.take().map(|m| m.starting_at(step));
        self.worker = self.worker.take().map(|m| m.starting_at(step));
        self.cfg.first_step = step;
        Ok(())
    }

    /// This rank's aggregator, if it serves a shard.
    pub fn aggregator(&self) -> Option<&A> {
        self.server.as_ref().map(ServerMachine::aggregator)
    }

    /// This rank's aggregator, mutably (to restore its state before the first step).
    pub fn aggregator_mut(&mut self) -> Option<&mut A> {
        self.server.as_mut().map(ServerMachine::aggregator_mut)
    }

    /// The layout.
    pub fn layout(&self) -> &PsLayout {
        &self.layout
    }

    /// The transport (for byte counts).
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The worker's clock: steps pushed so far (0 if not a worker).
    pub fn pushed(&self) -> u64 {
        self.worker.as_ref().map_or(0, WorkerMachine::pushed)
    }

    fn worker_mut(&mut self) -> Result<&mut WorkerMachine, CommError> {
        let me = self.rank();
        self.worker
            .as_mut()
            .ok_or_else(|| CommError::InvalidArgument(format!("rank {me} is not a worker")))
    }

    /// Pushes the next step's payloads (one per shard), first waiting — while serving,
    /// on a co-located rank — until the staleness bound allows it. Returns the step.
    pub fn push(
        &mut self,
        payloads: Vec<Vec<u8>>,
        aggregation: Aggregation,
    ) -> Result<u64, CommError> {
        let shards = self.layout.num_shards();
        if self.worker_mut()?.left {
            return Err(CommError::InvalidArgument("push after finish".into()));
        }
        if payloads.len() != shards {
            return Err(CommError::InvalidArgument(format!(
                "{} payloads for {shards} shards",
                payloads.len()
            )));
        }
        self.pump_until(|n| n.worker.as_ref().is_some_and(WorkerMachine::can_push))?;
        let step = self
            .worker_mut()?
            .push(aggregation, payloads)
            .map_err(CommError::InvalidArgument)?;
        self.pump_until(|_| true)?;
        Ok(step)
    }

    /// Waits until the aggregate of `step` (already pushed) has arrived, and returns every
    /// aggregate not returned before up to it (in step order).
    pub fn pull(&mut self, step: u64) -> Result<Vec<Aggregate>, CommError> {
        let w = self.worker_mut()?;
        if step >= w.pushed() {
            return Err(CommError::InvalidArgument(format!(
                "pull of step {step}, but only {} pushed",
                w.pushed()
            )));
        }
        self.pump_until(|n| n.worker.as_ref().is_some_and(|w| w.complete() > step))?;
        Ok(self.worker_mut()?.take_ready())
    }

    /// Returns the aggregates that have arrived and were not returned before, without
    /// waiting (after handling what the transport already holds).
    pub fn try_pull(&mut self) -> Result<Vec<Aggregate>, CommError> {
        self.worker_mut()?;
        self.pump_until(|_| true)?;
        Ok(self.worker_mut()?.take_ready())
    }

    /// One training step: pushes this step's payloads, then waits until the staleness
    /// bound allows the next push, and returns every aggregate that has arrived (in step
    /// order; with staleness 0 exactly this step's).
    pub fn step(
        &mut self,
        payloads: Vec<Vec<u8>>,
        aggregation: Aggregation,
    ) -> Result<Vec<Aggregate>, CommError> {
        self.push(payloads, aggregation)?;
        self.pump_until(|n| n.worker.as_ref().is_some_and(WorkerMachine::can_push))?;
        Ok(self.worker_mut()?.take_ready())
    }

    /// [`PsNode::step`] for a dense f32 model of `layout.len()` elements: slices it by
    /// shard and encodes each slice for [`DenseF32`].
    pub fn step_dense(
        &mut self,
        grad: &[f32],
        aggregation: Aggregation,
    ) -> Result<Vec<Aggregate>, CommError> {
        if grad.len() != self.layout.len() {
            return Err(CommError::InvalidArgument(format!(
                "gradient of {} elements for a model of {}",
                grad.len(),
                self.layout.len()
            )));
        }
        let payloads = (0..self.layout.num_shards())
            .map(|j| f32_payload(&grad[self.layout.shard_range(j)]))
            .collect();
        self.step(payloads, aggregation)
    }

    /// Ends this rank's part: a worker waits for the aggregates of all its pushed steps
    /// (returned) and leaves; a server (co-located or not) then serves until every worker
    /// has left.
    pub fn finish(&mut self) -> Result<Vec<Aggregate>, CommError> {
        let mut got = Vec::new();
        if self.worker.is_some() {
            self.pump_until(|n| {
                n.worker
                    .as_ref()
                    .is_some_and(|w| w.complete() == w.pushed())
            })?;
            let w = self.worker_mut()?;
            got = w.take_ready();
            w.leave().map_err(CommError::InvalidArgument)?;
        }
        self.pump_until(|n| n.server.as_ref().is_none_or(ServerMachine::is_done))?;
        Ok(got)
    }

    /// Serves until every worker has left (a server-only rank's whole life; on a worker
    /// rank the same as [`PsNode::finish`]).
    pub fn serve(&mut self) -> Result<(), CommError> {
        self.finish().map(|_| ())
    }

    /// Sends what the machines have queued, then handles messages until `done(self)`.
    fn pump_until(&mut self, done: impl Fn(&Self) -> bool) -> Result<(), CommError> {
        if let Some(f) = &self.failed {
            return Err(CommError::Poisoned(f.clone()));
        }
        let r = self.pump_inner(done);
        if let Err(e) = &r {
            self.failed = Some(e.to_string());
        }
        r
    }

    fn patience(&self) -> Duration {
        if self.server.is_some() {
            self.cfg.timeout
        } else {
            self.cfg.timeout + self.cfg.abort_grace
        }
    }

    fn pump_inner(&mut self, done: impl Fn(&Self) -> bool) -> Result<(), CommError> {
        let me = self.rank();
        let mut deadline = Instant::now() + self.patience();
        loop {
            self.flush()?;
            if done(self) {
                return Ok(());
            }
            let (from, bytes) = match self.transport.recv(deadline) {
                Ok(x) => x,
                Err(e @ (TransportError::Closed { .. } | TransportError::PeerSilent { .. })) => {
                    let rank = self.mark_lost(&e);
                    if self.expects_from(rank) {
                        return Err(self.lost(rank));
                    }
                    continue;
                }
                Err(TransportError::Timeout) => {
                    let mut culprits = self
                        .server
                        .as_ref()
                        .map(ServerMachine::waiting_on)
                        .unwrap_or_default();
                    if culprits.is_empty() {
                        culprits = self
                            .worker
                            .as_ref()
                            .map(WorkerMachine::waiting_on)
                            .unwrap_or_default();
                    }
                    culprits.retain(|&r| r != me);
                    return Err(self.fail(
                        AbortKind::Timeout,
                        culprits,
                        format!("rank {me} made no progress for {:?}", self.patience()),
                    ));
                }
                Err(e) => return Err(e.into()),
            };
            let msg = match PsMsg::decode(bytes) {
                Ok(m) => m,
                Err(detail) => return Err(self.fail(AbortKind::Protocol, vec![from], detail)),
            };
            let r = match msg {
                PsMsg::Abort {
                    reason,
                    culprits,
                    detail,
                } => {
                    return Err(abort_error(
                        reason,
                        culprits,
                        from,
                        detail,
                        self.cfg.timeout,
                    ))
                }
                m @ (PsMsg::Push { .. } | PsMsg::Leave { .. }) => match &mut self.server {
                    Some(s) => s.handle(from, m),
                    None => Err(AlgoError::Protocol {
                        peer: from,
                        detail: "sent a push to a rank that is not a server".into(),
                    }),
                },
                m @ PsMsg::Aggregate { .. } => match &mut self.worker {
                    Some(w) => w.handle(from, m),
                    None => Err(AlgoError::Protocol {
                        peer: from,
                        detail: "sent an aggregate to a rank that is not a worker".into(),
                    }),
                },
            };
            match r {
                Ok(()) => deadline = Instant::now() + self.patience(),
                Err(AlgoError::Mismatch { peer, detail }) => {
                    return Err(self.fail(AbortKind::Mismatch, vec![peer], detail))
                }
                Err(AlgoError::Protocol { peer, detail }) => {
                    return Err(self.fail(AbortKind::Protocol, vec![peer], detail))
                }
            }
        }
    }

    fn expects_from(&self, rank: usize) -> bool {
        self.server.as_ref().is_some_and(|s| s.expects_from(rank))
            || self.worker.as_ref().is_some_and(|w| w.expects_from(rank))
    }

    /// Sends everything the machines queued; a closed peer that is still needed is fatal,
    /// one that is not (a worker that left) is skipped.
    fn flush(&mut self) -> Result<(), CommError> {
        loop {
            let next = match self.server.as_mut().and_then(ServerMachine::poll_transmit) {
                Some(x) => Some(x),
                None => self.worker.as_mut().and_then(WorkerMachine::poll_transmit),
            };
            let Some((to, msg)) = next else {
                return Ok(());
            };
            if to == self.rank() {
                // Co-located: deliver to the other role of this rank directly.
                let r = match msg {
                    m @ (PsMsg::Push { .. } | PsMsg::Leave { .. }) => {
                        self.server.as_mut().expect("layout").handle(to, m)
                    }
                    m => self.worker.as_mut().expect("layout").handle(to, m),
                };
                if let Err(e) = r {
                    let (kind, peer, detail) = match e {
                        AlgoError::Mismatch { peer, detail } => (AbortKind::Mismatch, peer, detail),
                        AlgoError::Protocol { peer, detail } => (AbortKind::Protocol, peer, detail),
                    };
                    return Err(self.fail(kind, vec![peer], detail));
                }
                continue;
            }
            if self.closed[to].is_some() {
                if self.expects_from(to) || matches!(msg, PsMsg::Push { .. }) {
                    return Err(self.lost(to));
                }
                continue;
            }
            match self.transport.send(to, msg.encode()) {
                Ok(()) => {}
                Err(e @ TransportError::Closed { .. }) => {
                    let rank = self.mark_lost(&e);
                    if self.expects_from(rank) || matches!(msg, PsMsg::Push { .. }) {
                        return Err(self.lost(rank));
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// `rank`'s connection closed while it was needed. A peer that failed for a reason of
    /// its own sent its abort before closing: look for queued aborts (briefly) before
    /// blaming the closed connection.
    fn lost(&mut self, rank: usize) -> CommError {
        let cap = Instant::now() + self.cfg.abort_grace.min(Duration::from_millis(200));
        loop {
            let dl = (Instant::now() + Duration::from_millis(20)).min(cap);
            match self.transport.recv(dl) {
                Ok((from, bytes)) => {
                    if let Ok(PsMsg::Abort {
                        reason,
                        culprits,
                        detail,
                    }) = PsMsg::decode(bytes)
                    {
                        return abort_error(reason, culprits, from, detail, self.cfg.timeout);
                    }
                }
                Err(e @ (TransportError::Closed { .. } | TransportError::PeerSilent { .. })) => {
                    self.mark_lost(&e);
                }
                Err(_) => break,
            }
        }
        let detail = self.closed[rank]
            .clone()
            .unwrap_or_else(|| "connection closed".into());
        self.fail(AbortKind::PeerLost, vec![rank], detail)
    }

    /// Records the peer of a [`TransportError::Closed`] / [`TransportError::PeerSilent`]
    /// as lost and returns it.
    fn mark_lost(&mut self, e: &TransportError) -> usize {
        let (rank, why) = e.lost_peer().expect("a lost-peer error");
        self.closed[rank].get_or_insert(why);
        rank
    }

    /// Tells every other rank of the run to give up, and returns the matching error.
    fn fail(&mut self, reason: AbortKind, culprits: Vec<usize>, detail: String) -> CommError {
        let me = self.rank();
        let bytes = PsMsg::Abort {
            reason,
            culprits: culprits.iter().map(|&r| r as u32).collect(),
            detail: detail.clone(),
        }
        .encode();
        for p in 0..self.transport.world_size() {
            if p != me && self.closed[p].is_none() {
                let _ = self.transport.send(p, bytes.clone());
            }
        }
        abort_error(
            reason,
            culprits.iter().map(|&r| r as u32).collect(),
            me,
            detail,
            self.cfg.timeout,
        )
    }
}

fn abort_error(
    reason: AbortKind,
    culprits: Vec<u32>,
    reported_by: usize,
    detail: String,
    timeout: Duration,
) -> CommError {
    let ranks: Vec<usize> = culprits.iter().map(|&r| r as usize).collect();
    let rank = ranks.first().copied().unwrap_or(reported_by);
    match reason {
        AbortKind::PeerLost => CommError::PeerLost {
            rank,
            reported_by,
            detail,
        },
        AbortKind::Timeout => CommError::Timeout { ranks, timeout },
        AbortKind::Mismatch => CommError::Mismatch {
            rank,
            reported_by,
            detail,
        },
        AbortKind::Protocol => CommError::Protocol {
            rank,
            reported_by,
            detail,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(w: usize, m: usize, len: usize) -> PsLayout {
        PsLayout::new(w + m, (0..w).collect(), (w..w + m).collect(), len).unwrap()
    }

    #[test]
    fn messages_round_trip_and_hostile_bytes_are_errors() {
        let msgs = [
            PsMsg::Push {
                shard: 3,
                step: 1 << 40,
                aggregation: Aggregation(77),
                payload: vec![1, 2, 3],
            },
            PsMsg::Aggregate {
                shard: 1,
                step: 9,
                payload: vec![],
            },
            PsMsg::Leave { steps: 12 },
            PsMsg::Abort {
                reason: AbortKind::Timeout,
                culprits: vec![2, 5],
                detail: "slow".into(),
            },
        ];
        for m in msgs {
            assert_eq!(PsMsg::decode(m.encode()).unwrap(), m);
        }
        assert!(PsMsg::decode(vec![PS_MAGIC; 3]).is_err());
        assert!(PsMsg::decode(vec![1; 40]).is_err());
        let mut b = PsMsg::Leave { steps: 1 }.encode();
        b[1] = 99;
        assert!(PsMsg::decode(b).is_err());
        let mut b = PsMsg::Abort {
            reason: AbortKind::PeerLost,
            culprits: vec![1],
            detail: String::new(),
        }
        .encode();
        b[PS_HEADER_LEN] = 200; // claims 200 culprits
        assert!(PsMsg::decode(b).is_err());
    }

    #[test]
    fn layout_is_validated_and_shards_partition_the_model() {
        assert!(PsLayout::new(2, vec![], vec![0], 5).is_err());
        assert!(PsLayout::new(2, vec![0, 0], vec![1], 5).is_err());
        assert!(PsLayout::new(2, vec![0], vec![2], 5).is_err());
        let l = PsLayout::new(3, vec![0, 1, 2], vec![2, 0], 7).unwrap();
        assert_eq!(l.shard_range(0), 0..4);
        assert_eq!(l.shard_range(1), 4..7);
        assert_eq!(l.shard_of(0), Some(1));
        assert_eq!(l.shard_of(1), None);
        assert_eq!(l.worker_index(2), Some(2));
    }

    #[test]
    fn server_aggregates_in_worker_order_once_all_pushed() {
        let l = layout(2, 1, 2);
        let mut s = ServerMachine::new(l, 0, 0, DenseF32);
        let push = |v: &[f32]| PsMsg::Push {
            shard: 0,
            step: 0,
            aggregation: Aggregation::MEAN,
            payload: f32_payload(v),
        };
        s.handle(1, push(&[1.0, 2.0])).unwrap();
        assert!(s.poll_transmit().is_none());
        assert_eq!(s.waiting_on(), vec![0]);
        s.handle(0, push(&[3.0, 6.0])).unwrap();
        let sent: Vec<_> = std::iter::from_fn(|| s.poll_transmit()).collect();
        assert_eq!(sent.len(), 2);
        assert_eq!(
            sent[0],
            (
                0,
                PsMsg::Aggregate {
                    shard: 0,
                    step: 0,
                    payload: f32_payload(&[2.0, 4.0])
                }
            )
        );
        assert_eq!(s.completed(), 1);
    }

    #[test]
    fn server_rejects_out_of_order_stale_and_mismatched_pushes() {
        let push = |step, agg: u8, n: usize| PsMsg::Push {
            shard: 0,
            step,
            aggregation: Aggregation(agg),
            payload: vec![0; 4 * n],
        };
        // Out of order.
        let mut s = ServerMachine::new(layout(2, 1, 1), 0, 5, DenseF32);
        let e = s.handle(0, push(1, 0, 1)).unwrap_err();
        assert!(matches!(e, AlgoError::Protocol { peer: 0, .. }), "{e}");
        // Beyond the staleness bound 1: steps 0 and 1 fine, 2 not before step 0 completes.
        let mut s = ServerMachine::new(layout(2, 1, 1), 0, 1, DenseF32);
        s.handle(0, push(0, 0, 1)).unwrap();
        s.handle(0, push(1, 0, 1)).unwrap();
        let e = s.handle(0, push(2, 0, 1)).unwrap_err();
        assert!(matches!(e, AlgoError::Protocol { peer: 0, .. }), "{e}");
        // Different aggregations for one step.
        let mut s = ServerMachine::new(layout(2, 1, 1), 0, 0, DenseF32);
        s.handle(0, push(0, 0, 1)).unwrap();
        let e = s.handle(1, push(0, 1, 1)).unwrap_err();
        assert!(matches!(e, AlgoError::Mismatch { peer: 1, .. }), "{e}");
        // Wrong payload length: the aggregator names the worker.
        let mut s = ServerMachine::new(layout(2, 1, 1), 0, 0, DenseF32);
        s.handle(0, push(0, 0, 1)).unwrap();
        let e = s.handle(1, push(0, 0, 2)).unwrap_err();
        assert!(matches!(e, AlgoError::Protocol { peer: 1, .. }), "{e}");
        // Not a worker.
        let e = s.handle(2, push(0, 0, 1)).unwrap_err();
        assert!(matches!(e, AlgoError::Protocol { peer: 2, .. }), "{e}");
        // Leaving early while another worker is ahead.
        let mut s = ServerMachine::new(layout(2, 1, 1), 0, 3, DenseF32);
        s.handle(0, push(0, 0, 1)).unwrap();
        let e = s.handle(1, PsMsg::Leave { steps: 0 }).unwrap_err();
        assert!(matches!(e, AlgoError::Mismatch { peer: 1, .. }), "{e}");
    }

    #[test]
    fn worker_respects_the_staleness_bound_and_orders_aggregates() {
        let l = layout(1, 2, 4);
        let mut w = WorkerMachine::new(l, 1);
        let p = || vec![vec![0u8; 8], vec![0u8; 8]];
        assert_eq!(w.push(Aggregation::SUM, p()).unwrap(), 0);
        assert_eq!(w.push(Aggregation::SUM, p()).unwrap(), 1);
        assert!(!w.can_push());
        assert!(w.push(Aggregation::SUM, p()).is_err());
        assert!(w.push(Aggregation::SUM, vec![]).is_err());
        assert_eq!(std::iter::from_fn(|| w.poll_transmit()).count(), 4);
        let agg = |shard, step| PsMsg::Aggregate {
            shard,
            step,
            payload: vec![shard as u8],
        };
        // Shard 1's server is rank 2; rank 1 does not serve shard 1.
        assert!(w.handle(1, agg(1, 0)).is_err());
        w.handle(2, agg(1, 0)).unwrap();
        assert!(w.take_ready().is_empty());
        assert_eq!(w.waiting_on(), vec![1, 2]);
        w.handle(1, agg(0, 0)).unwrap();
        assert!(w.can_push());
        let got = w.take_ready();
        assert_eq!(
            got,
            vec![Aggregate {
                step: 0,
                shards: vec![vec![0], vec![1]]
            }]
        );
        // Step 2 was never pushed: an aggregate for it is a protocol error.
        w.handle(1, agg(0, 1)).unwrap();
        assert!(w.handle(1, agg(0, 2)).is_err());
        assert!(w.leave().is_err());
    }

    #[test]
    fn closures_are_aggregators() {
        let mut calls = 0;
        let mut last = |i: &ShardPushes<'_>| -> Result<Vec<u8>, AggregateError> {
            calls += 1;
            Ok(i.pushes.last().map(|p| p.1.to_vec()).unwrap_or_default())
        };
        let input = ShardPushes {
            shard: 0,
            range: 0..1,
            step: 0,
            aggregation: Aggregation(42),
            pushes: &[(0, &[1u8][..]), (1, &[2u8][..])],
        };
        assert_eq!(last.aggregate(&input).unwrap(), vec![2]);
        assert_eq!(calls, 1);
    }
}
