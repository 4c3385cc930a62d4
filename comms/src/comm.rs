//! The blocking facade the trainer calls: [`Communicator`] drives the collective state
//! machines over any [`Transport`], and owns timeouts, failure detection and failure
//! propagation.
//!
//! # Failure handling
//! * **Lost peer**: a peer whose connection closed (its process exited or was killed), or
//!   that the transport gave up on because nothing, not even a heartbeat, came from it for
//!   the transport's peer timeout (a frozen process, a vanished host: see
//!   `TcpConfig::peer_timeout`, `QuicConfig::peer_timeout`), is fatal as
//!   soon as a collective still needs a message from it or has one to send to it (a peer
//!   that finished its part and exited does not fail the others). The detecting rank
//!   broadcasts an abort naming the peer, so ranks that never talk to it directly fail
//!   fast with [`CommError::PeerLost`] naming it too.
//! * **Inactivity timeout** ([`CommConfig::timeout`], default 30 s), for a peer that is
//!   alive but does not take part (stuck or busy outside the collectives): a rank that
//!   receives no message of the current collective for `timeout − grace` broadcasts an
//!   abort, then listens for `grace` for the aborts of the other ranks (every rank that
//!   receives an abort answers with its own), where `grace` is [`CommConfig::abort_grace`]
//!   capped at half the timeout. The ranks not heard from are reported in
//!   [`CommError::Timeout`] — on every surviving rank, the stalled rank(s), at most about
//!   `timeout` after the collective stopped making progress.
//! * **Mismatched collectives** (kind, algorithm, length or root differ, or a peer is a
//!   collective behind): [`CommError::Mismatch`] naming the peer, propagated the same way.
//!
//! After any of these the communicator is unusable ([`CommError::Poisoned`]): messages of
//! the failed collective may be in flight. The run either stops (and resumes from a
//! checkpoint), or the survivors agree on a smaller group with
//! [`Communicator::regroup`] and go on over the same connections (see [`group`]). Invalid
//! arguments ([`CommError::InvalidArgument`]) do not poison it.

use std::collections::{BTreeSet, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use thiserror::Error;

mod failure;
pub mod group;

use group::Grouped;
pub use group::Membership;

use crate::algo::allgather::AllGather;
use crate::algo::barrier::Barrier;
use crate::algo::broadcast::Broadcast;
use crate::algo::compressed_allreduce::{CompressedAllReduce, Limits, SegmentReduce};
use crate::algo::hierarchical::Hierarchical;
use crate::algo::recursive_doubling::RecursiveDoubling;
use crate::algo::ring::Ring;
use crate::algo::sparse_allreduce::SparseAllReduce;
use crate::algo::{AlgoError, Machine, ReduceOp};
use crate::dlcp::packet::check_tensors;
use crate::dlcp::{DlcpAllReduce, DlcpConfig, DlcpReport, DlcpTensor};
use crate::sparse::{SparseSlice, SparseVec};
use crate::topology::Topology;
use crate::transport::{ByteCount, Transport, TransportError};
use crate::wire::{scale_non_finite, AbortInfo, AbortReason, Algo, Kind, Message};

/// Errors of a collective call. Every failure caused by a peer names it.
#[derive(Debug, Error)]
pub enum CommError {
    /// A peer's connection closed, or the peer went silent past the transport's peer
    /// timeout, while it was still needed.
    #[error("rank {rank} was lost ({detail}; detected by rank {reported_by})")]
    PeerLost {
        /// The lost rank.
        rank: usize,
        /// The rank that saw it go (this rank, or the one whose abort told us).
        reported_by: usize,
        /// How it was lost ("connection closed", or how long it was silent).
        detail: String,
    },
    /// The collective made no progress for the configured timeout.
    #[error("collective timed out after {timeout:?}; unresponsive rank(s): {ranks:?}")]
    Timeout {
        /// Ranks that did not answer.
        ranks: Vec<usize>,
        /// The configured timeout.
        timeout: Duration,
    },
    /// Ranks called different collectives, or the same one with different arguments.
    #[error("collective mismatch with rank {rank} (detected by rank {reported_by}): {detail}")]
    Mismatch {
        /// The mismatching rank.
        rank: usize,
        /// The rank that detected it.
        reported_by: usize,
        /// What differs.
        detail: String,
    },
    /// A peer sent a malformed or unexpected message.
    #[error("protocol error from rank {rank} (detected by rank {reported_by}): {detail}")]
    Protocol {
        /// The offending rank.
        rank: usize,
        /// The rank that detected it.
        reported_by: usize,
        /// What was wrong.
        detail: String,
    },
    /// The call's arguments are invalid (nothing was sent; the communicator stays usable).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The transport failed in a way not attributable to one peer.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// An earlier collective failed; this communicator can no longer be used.
    #[error("communicator unusable after an earlier failure: {0}")]
    Poisoned(String),
    /// The other ranks went on without this one ([`Communicator::regroup`]): it was taken
    /// for lost (frozen or cut off past the deadline) while it was alive.
    #[error("this rank was dropped from the group: {detail}")]
    Excluded {
        /// What the group said (its epoch and members).
        detail: String,
    },
    /// The survivors of a failure may not go on ([`Communicator::regroup`]): they are no
    /// strict majority of the previous group, and some rank they lost may still be alive
    /// (it fell silent rather than closing its connection), so it may be the other side
    /// of a partition.
    #[error(
        "membership epoch {epoch}: the {} surviving rank(s) {members:?} are no majority of the \
         {previous} before, and the others may be alive elsewhere",
        members.len()
    )]
    NoMajority {
        /// The epoch that was not formed.
        epoch: u64,
        /// The survivors' transport ranks.
        members: Vec<usize>,
        /// The size of the previous group.
        previous: usize,
    },
}

impl CommError {
    /// The ranks this error blames (empty for local errors).
    pub fn failed_ranks(&self) -> Vec<usize> {
        match self {
            CommError::PeerLost { rank, .. }
            | CommError::Mismatch { rank, .. }
            | CommError::Protocol { rank, .. } => vec![*rank],
            CommError::Timeout { ranks, .. } => ranks.clone(),
            _ => Vec::new(),
        }
    }
}

/// Tuning and limits of a [`Communicator`]. All ranks of a run must use the same values
/// for `small_all_reduce_bytes` (it selects the algorithm, and a disagreement is reported
/// as a mismatch). One message carries at most `max(chunk_bytes, small_all_reduce_bytes)`
/// payload bytes plus the 36-byte header (plus one encoding byte for the sparse
/// all-reduce); that must fit the transport's frame limit
/// (64 MiB by default for TCP), or the call fails with [`TransportError::TooLarge`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommConfig {
    /// Inactivity timeout of a collective: a collective that receives nothing for this long
    /// fails with [`CommError::Timeout`] naming the unresponsive rank(s), on every rank,
    /// within about this time (the last [`CommConfig::abort_grace`] of it is spent telling
    /// the stalled ranks from the live ones). Default 30 s. Dead or frozen peers are
    /// usually reported sooner, by the transport's peer timeout.
    pub timeout: Duration,
    /// After the inactivity timeout, how long to collect the other ranks' aborts to tell the
    /// stalled rank(s) from the live ones; capped at half of [`CommConfig::timeout`].
    /// Default 2 s.
    pub abort_grace: Duration,
    /// Chunk size of the pipelined algorithms in bytes. Default 1 MiB.
    pub chunk_bytes: usize,
    /// All-reduces of at most this many bytes use recursive doubling, larger ones the ring.
    /// Default 64 KiB.
    pub small_all_reduce_bytes: usize,
    /// Largest buffer a peer may contribute to an all-gather or broadcast. Default 4 GiB.
    pub max_buffer_bytes: u64,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            timeout: Duration::from_secs(30),
            abort_grace: Duration::from_secs(2),
            chunk_bytes: 1 << 20,
            small_all_reduce_bytes: 64 << 10,
            max_buffer_bytes: 4 << 30,
        }
    }
}

/// Blocking collectives over a [`Transport`] (see the [module docs](self) for failures).
///
/// ```
/// use dtrain_comms::{channel_mesh, CommConfig, Communicator};
/// let handles: Vec<_> = channel_mesh(3)
///     .into_iter()
///     .map(|t| {
///         std::thread::spawn(move || {
///             let mut c = Communicator::new(t, CommConfig::default());
///             let mut v = vec![c.rank() as f32 + 1.0; 4];
///             c.all_reduce_sum(&mut v).unwrap();
///             v
///         })
///     })
///     .collect();
/// for h in handles {
///     assert_eq!(h.join().unwrap(), vec![6.0; 4]);
/// }
/// ```
#[derive(Debug)]
pub struct Communicator<T: Transport> {
    transport: Grouped<T>,
    cfg: CommConfig,
    seq: u64,
    /// Messages with a lower sequence number belong to a failed membership epoch (or an
    /// earlier agreement round) and are dropped.
    floor: u64,
    /// Messages of later collectives, with the bytes the transport counted for them.
    stash: VecDeque<(usize, Message, u64)>,
    /// Received bytes moved between calls' accounts by the stash (out of / into this call).
    stashed_out: u64,
    stashed_in: u64,
    /// The peers a message of the current collective came from.
    heard: Vec<bool>,
    failed: Option<String>,
    last: ByteCount,
}

impl<T: Transport> Communicator<T> {
    /// Wraps a connected transport.
    pub fn new(transport: T, cfg: CommConfig) -> Self {
        let world = transport.world_size();
        Communicator {
            transport: Grouped::new(transport),
            cfg,
            seq: 0,
            floor: 0,
            stash: VecDeque::new(),
            stashed_out: 0,
            stashed_in: 0,
            heard: vec![false; world],
            failed: None,
            last: ByteCount::default(),
        }
    }

    /// This rank: its index in the current group (its transport rank until the first
    /// [`Communicator::regroup`]).
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// Number of ranks in the current group.
    pub fn world_size(&self) -> usize {
        self.transport.world_size()
    }

    /// The configuration.
    pub fn config(&self) -> &CommConfig {
        &self.cfg
    }

    /// Changes the inactivity timeout of the collectives from the next call on (a step
    /// deadline that adapts to the measured step time). Every rank should use about the
    /// same: the one with the shortest timeout is the first to give up on a silent peer.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.cfg.timeout = timeout;
    }

    /// The transport (its ranks are the transport's, not the group's: see
    /// [`Communicator::members`]).
    pub fn transport(&self) -> &T {
        self.transport.inner()
    }

    /// Bytes sent and received by the last collective call (framing included).
    pub fn last_bytes(&self) -> ByteCount {
        self.last
    }

    /// Bytes sent and received since the transport was created.
    pub fn total_bytes(&self) -> ByteCount {
        self.transport.bytes()
    }

    /// The algorithm [`Communicator::all_reduce_sum`] uses for `len` elements.
    pub fn all_reduce_algo(&self, len: usize) -> Algo {
        if len.saturating_mul(4) <= self.cfg.small_all_reduce_bytes {
            Algo::RecursiveDoubling
        } else {
            Algo::Ring
        }
    }

    /// Sums `data` element-wise over all ranks, in place. The summation order is fixed
    /// (see [`crate::algo::ring`] and [`crate::algo::recursive_doubling`]), so every rank
    /// gets bit-identical results. All ranks must pass the same length.
    pub fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CommError> {
        self.all_reduce(data, ReduceOp::Sum)
    }

    /// Averages `data` element-wise over all ranks, in place, and returns whether the
    /// average holds a NaN or an infinity (on every rank alike: a sum can overflow even
    /// when every rank's input is finite). The values are bit for bit those of
    /// [`Communicator::all_reduce_sum`] followed by a product with `1/P` (as `f32`). Over
    /// the ring the product and the check ride on the collective's own passes over each
    /// chunk ([`Ring::all_reduce_mean`]); for the small sizes that go by recursive
    /// doubling they are one pass after it.
    pub fn all_reduce_mean(&mut self, data: &mut [f32]) -> Result<bool, CommError> {
        let (rank, world, seq) = (self.rank(), self.world_size(), self.seq);
        match self.all_reduce_algo(data.len()) {
            Algo::RecursiveDoubling => {
                self.drive(&mut RecursiveDoubling::new(
                    rank,
                    world,
                    seq,
                    ReduceOp::Sum,
                    data,
                ))?;
                Ok(scale_non_finite(data, 1.0 / world as f32))
            }
            _ => {
                let chunk = self.chunk_elems();
                let mut m = Ring::all_reduce_mean(rank, world, seq, data, chunk);
                self.drive(&mut m)?;
                Ok(m.non_finite())
            }
        }
    }

    /// Element-wise maximum over all ranks, in place.
    pub fn all_reduce_max(&mut self, data: &mut [f32]) -> Result<(), CommError> {
        self.all_reduce(data, ReduceOp::Max)
    }

    fn all_reduce(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let (rank, world, seq) = (self.rank(), self.world_size(), self.seq);
        match self.all_reduce_algo(data.len()) {
            Algo::RecursiveDoubling => {
                let mut m = RecursiveDoubling::new(rank, world, seq, op, data);
                self.drive(&mut m)
            }
            _ => {
                let chunk = self.chunk_elems();
                let mut m = Ring::all_reduce(rank, world, seq, op, data, chunk);
                self.drive(&mut m)
            }
        }
    }

    /// Sums `data` element-wise over all ranks, in place, hierarchically over `topology`
    /// (see [`crate::algo::hierarchical`]): each host's ranks reduce to its leader (its
    /// lowest rank), the leaders all-reduce across hosts — by the ring, or by recursive
    /// doubling for the sizes [`Communicator::all_reduce_sum`] sends that way — and each
    /// leader broadcasts the result on its host. Only the leaders' messages cross between
    /// hosts, exactly those of a flat all-reduce among them. Every rank gets bit-identical
    /// results in the documented order; with one rank per host they are the flat
    /// all-reduce's. All ranks must pass the same length and topology, or every rank fails
    /// naming a peer.
    ///
    /// ```
    /// use dtrain_comms::topology::Topology;
    /// use dtrain_comms::{channel_mesh, CommConfig, Communicator};
    /// let hosts = Topology::from_nodes(4, 2).unwrap(); // ranks {0, 1} and {2, 3}
    /// let handles: Vec<_> = channel_mesh(4)
    ///     .into_iter()
    ///     .map(|t| {
    ///         let hosts = hosts.clone();
    ///         std::thread::spawn(move || {
    ///             let mut c = Communicator::new(t, CommConfig::default());
    ///             let mut v = vec![c.rank() as f32 + 1.0; 4];
    ///             c.hierarchical_all_reduce_sum(&mut v, &hosts).unwrap();
    ///             v
    ///         })
    ///     })
    ///     .collect();
    /// for h in handles {
    ///     assert_eq!(h.join().unwrap(), vec![10.0; 4]);
    /// }
    /// ```
    pub fn hierarchical_all_reduce_sum(
        &mut self,
        data: &mut [f32],
        topology: &Topology,
    ) -> Result<(), CommError> {
        if topology.world() != self.world_size() {
            return Err(CommError::InvalidArgument(format!(
                "a topology of {} ranks for a world of {}",
                topology.world(),
                self.world_size()
            )));
        }
        let small = self.all_reduce_algo(data.len()) == Algo::RecursiveDoubling;
        let chunk = self.chunk_elems();
        let mut m = Hierarchical::new(self.rank(), topology, self.seq, data, chunk, small);
        self.drive(&mut m)
    }

    /// [`Communicator::hierarchical_all_reduce_sum`], then the product with `1/P` (as
    /// `f32`) and the finiteness check in one pass after it: the average over `topology`
    /// as [`Communicator::all_reduce_mean`] gives it flat (the same bits wherever the
    /// hierarchical sum equals the flat one), and whether it holds a NaN or an infinity.
    pub fn hierarchical_all_reduce_mean(
        &mut self,
        data: &mut [f32],
        topology: &Topology,
    ) -> Result<bool, CommError> {
        self.hierarchical_all_reduce_sum(data, topology)?;
        Ok(scale_non_finite(data, 1.0 / self.world_size() as f32))
    }

    /// Reduce-scatter (sum): on return `data[range]` holds the sum over all ranks of that
    /// segment, where `range` (returned) is [`crate::segment_range`]`(data.len(), world,
    /// rank)`; the rest of `data` is unchanged. All ranks must pass the same length.
    pub fn reduce_scatter(&mut self, data: &mut [f32]) -> Result<Range<usize>, CommError> {
        let (rank, world, seq) = (self.rank(), self.world_size(), self.seq);
        let chunk = self.chunk_elems();
        let range = crate::segment_range(data.len(), world, rank);
        let mut m = Ring::reduce_scatter(rank, world, seq, data, chunk);
        self.drive(&mut m)?;
        Ok(range)
    }

    /// Gathers every rank's buffer (sizes may differ, 0 included); element `r` of the
    /// result is rank `r`'s buffer. Allocates the result; to gather repeatedly, reuse it
    /// with [`Communicator::all_gather_into`].
    pub fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let mut out = Vec::new();
        self.all_gather_into(data, &mut out)?;
        Ok(out)
    }

    /// [`Communicator::all_gather`] into caller-owned buffers: on success `out` has one
    /// element per rank, element `r` holding rank `r`'s buffer. The vectors already in
    /// `out` are cleared and refilled (their capacity reused; missing ones are added, extra
    /// ones dropped), so gathering the same sizes again allocates, page-faults and zeroes
    /// nothing: each received byte is copied once, from the network into its place. After
    /// an error the contents of `out` are unspecified, but its buffers are kept.
    ///
    /// ```
    /// use dtrain_comms::{channel_mesh, CommConfig, Communicator};
    /// let handles: Vec<_> = channel_mesh(2)
    ///     .into_iter()
    ///     .map(|t| {
    ///         std::thread::spawn(move || {
    ///             let mut c = Communicator::new(t, CommConfig::default());
    ///             let mut out = Vec::new();
    ///             for step in 0..3u8 {
    ///                 c.all_gather_into(&[c.rank() as u8, step], &mut out).unwrap();
    ///             }
    ///             out
    ///         })
    ///     })
    ///     .collect();
    /// for h in handles {
    ///     assert_eq!(h.join().unwrap(), vec![vec![0, 2], vec![1, 2]]);
    /// }
    /// ```
    pub fn all_gather_into(
        &mut self,
        data: &[u8],
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), CommError> {
        let mut m = AllGather::with_buffers(
            self.rank(),
            self.world_size(),
            self.seq,
            data,
            self.cfg.chunk_bytes,
            self.cfg.max_buffer_bytes,
            std::mem::take(out),
        );
        let r = self.drive(&mut m);
        *out = m.into_buffers();
        r
    }

    /// Gathers every rank's buffer on each rank of `receivers` (group ranks), sent directly
    /// from each rank to each receiver ([`crate::algo::gather`]): element `r` of the result
    /// is rank `r`'s buffer on a receiver; a rank that does not receive gets only its own
    /// (the others empty). Every rank must pass the same `receivers`.
    pub fn gather_to(
        &mut self,
        data: &[u8],
        receivers: &[usize],
    ) -> Result<Vec<Vec<u8>>, CommError> {
        if let Some(&r) = receivers.iter().find(|&&r| r >= self.world_size()) {
            return Err(CommError::InvalidArgument(format!(
                "receiver {r} in a group of {}",
                self.world_size()
            )));
        }
        let mut m = crate::algo::gather::Gather::new(
            self.rank(),
            self.world_size(),
            self.seq,
            data,
            receivers,
            self.cfg.chunk_bytes,
            self.cfg.max_buffer_bytes,
        );
        self.drive(&mut m)?;
        Ok(m.into_blocks())
    }

    /// Sums a sparse vector over all ranks and returns the sum as a sparse vector (the
    /// indices whose sum is not `+0.0`), bit-identical on every rank. Inputs may have any
    /// number of entries (0 included); all ranks must pass the same dimension, or every rank
    /// fails with [`CommError::Mismatch`].
    ///
    /// Each index is summed by the owner of its segment in rank order 0..P−1 starting from
    /// `+0.0` — the dense sum of the inputs in rank order, bit for bit (see
    /// [`crate::algo::sparse_allreduce`]). A rank receives its peers' entries in its segment
    /// and the sum outside it, each chunk as (index, value) pairs or dense, whichever is
    /// smaller: unlike an all-gather of the inputs, the volume follows the size of the sum.
    ///
    /// ```
    /// use dtrain_comms::{channel_mesh, CommConfig, Communicator, SparseSlice};
    /// let handles: Vec<_> = channel_mesh(2)
    ///     .into_iter()
    ///     .map(|t| {
    ///         std::thread::spawn(move || {
    ///             let mut c = Communicator::new(t, CommConfig::default());
    ///             let (idx, vals) = match c.rank() {
    ///                 0 => (vec![1, 5], vec![1.0, 2.0]),
    ///                 _ => (vec![5], vec![3.0]),
    ///             };
    ///             let input = SparseSlice::new(8, &idx, &vals).unwrap();
    ///             let sum = c.sparse_all_reduce(input).unwrap();
    ///             (sum.indices().to_vec(), sum.values().to_vec())
    ///         })
    ///     })
    ///     .collect();
    /// for h in handles {
    ///     assert_eq!(h.join().unwrap(), (vec![1, 5], vec![1.0, 5.0]));
    /// }
    /// ```
    pub fn sparse_all_reduce(&mut self, input: SparseSlice<'_>) -> Result<SparseVec, CommError> {
        let mut m = self.sparse_machine(input);
        self.drive(&mut m)?;
        Ok(m.into_sparse())
    }

    /// [`Communicator::sparse_all_reduce`] with a dense result: `out` (of length
    /// `input.dim()`, every element overwritten) receives the sum.
    pub fn sparse_all_reduce_dense(
        &mut self,
        input: SparseSlice<'_>,
        out: &mut [f32],
    ) -> Result<(), CommError> {
        if out.len() != input.dim() {
            return Err(CommError::InvalidArgument(format!(
                "dense output of length {} for a sparse vector of dimension {}",
                out.len(),
                input.dim()
            )));
        }
        let mut m = self.sparse_machine(input);
        self.drive(&mut m)?;
        m.write_dense(out);
        Ok(())
    }

    fn sparse_machine<'a>(&self, input: SparseSlice<'a>) -> SparseAllReduce<'a> {
        let chunk = self.chunk_elems();
        SparseAllReduce::new(self.rank(), self.world_size(), self.seq, input, chunk)
    }

    /// Compressed all-reduce (see [`crate::algo::compressed_allreduce`]): `shares[q]` is
    /// this rank's encoded share of owner `q`'s segment; on each owner `reducer` turns the
    /// P shares of its segment (rank order, its own included) into its encoded reduced
    /// block. Returns the P reduced blocks in owner order, the same bytes on every rank.
    ///
    /// `key` (e.g. the buffer's element count) must be the same on every rank, or every
    /// rank fails with [`CommError::Mismatch`]; a reducer's error fails every rank with
    /// [`CommError::Protocol`] naming the rank whose share it could not use. A rank sends
    /// its P − 1 shares for the others and P − 1 copies of its reduced block: about twice
    /// the encoded size of its buffer, whatever P.
    ///
    /// ```
    /// use dtrain_comms::{channel_mesh, CommConfig, Communicator};
    /// // A "codec" of one byte per segment: each owner adds its segment's shares.
    /// let handles: Vec<_> = channel_mesh(3)
    ///     .into_iter()
    ///     .map(|t| {
    ///         std::thread::spawn(move || {
    ///             let mut c = Communicator::new(t, CommConfig::default());
    ///             let own: Vec<[u8; 1]> = (0..3).map(|q| [c.rank() as u8 + q]).collect();
    ///             let shares: Vec<&[u8]> = own.iter().map(|b| &b[..]).collect();
    ///             let mut add = |s: &[&[u8]]| Ok(vec![s.iter().map(|b| b[0]).sum::<u8>()]);
    ///             c.compressed_all_reduce(&shares, 1, &mut add).unwrap()
    ///         })
    ///     })
    ///     .collect();
    /// for h in handles {
    ///     // Segment q: (0 + q) + (1 + q) + (2 + q).
    ///     assert_eq!(h.join().unwrap(), vec![vec![3], vec![6], vec![9]]);
    /// }
    /// ```
    pub fn compressed_all_reduce(
        &mut self,
        shares: &[&[u8]],
        key: u32,
        reducer: &mut dyn SegmentReduce,
    ) -> Result<Vec<Vec<u8>>, CommError> {
        if shares.len() != self.world_size() {
            return Err(CommError::InvalidArgument(format!(
                "{} shares for a world of {} ranks",
                shares.len(),
                self.world_size()
            )));
        }
        let mut m = match CompressedAllReduce::new(
            self.rank(),
            self.world_size(),
            self.seq,
            key,
            shares,
            reducer,
            Limits {
                chunk_bytes: self.cfg.chunk_bytes,
                max_block_bytes: self.cfg.max_buffer_bytes,
            },
        ) {
            Ok(m) => m,
            Err(e) => return Err(self.fail_algo(e)),
        };
        self.drive(&mut m)?;
        Ok(m.into_reduced())
    }

    /// DLCP all-reduce (sum) with bounded loss (see [`crate::dlcp`]): on return `data` holds
    /// the sum over all ranks, bit-identical on every rank, in which each owner may have left
    /// out up to `cfg.p_max` of each tensor's packets (as zeros) to finish its segment at
    /// the deadline instead of waiting for stragglers or retransmissions. `tensors` tile
    /// `data` in order and give each tensor's layer, for packet priorities (empty = one
    /// tensor of layer 0). With nothing lost the result is the sum in rank order 0..P−1 from
    /// `+0.0` (it equals [`Communicator::all_reduce_sum`] up to summation order).
    ///
    /// The returned report says what was sent, lost, retransmitted and dropped; its
    /// [`DlcpReport::dropped`] ranges (with values) are the parts of this rank's `data` that
    /// did not make it into the sum, for error feedback ([`DlcpReport::add_dropped_to`]).
    /// All ranks must pass the same length, tensor boundaries and `cfg.mtu`.
    ///
    /// ```
    /// use dtrain_comms::dlcp::{DlcpConfig, DlcpTensor};
    /// use dtrain_comms::{channel_mesh, CommConfig, Communicator};
    /// let handles: Vec<_> = channel_mesh(3)
    ///     .into_iter()
    ///     .map(|t| {
    ///         std::thread::spawn(move || {
    ///             let mut c = Communicator::new(t, CommConfig::default());
    ///             let mut g = vec![c.rank() as f32 + 1.0; 1000];
    ///             let layers = DlcpTensor::from_ends(&[400, 1000], 0);
    ///             let report = c.dlcp_all_reduce(&mut g, &layers, &DlcpConfig::default()).unwrap();
    ///             (g, report.dropped)
    ///         })
    ///     })
    ///     .collect();
    /// for h in handles {
    ///     let (g, dropped) = h.join().unwrap();
    ///     assert_eq!(g, vec![6.0; 1000]);
    ///     assert!(dropped.is_empty());
    /// }
    /// ```
    pub fn dlcp_all_reduce(
        &mut self,
        data: &mut [f32],
        tensors: &[DlcpTensor],
        cfg: &DlcpConfig,
    ) -> Result<DlcpReport, CommError> {
        cfg.validate()
            .map_err(|e| CommError::InvalidArgument(e.to_string()))?;
        if !tensors.is_empty() {
            check_tensors(data.len(), tensors).map_err(CommError::InvalidArgument)?;
        }
        if self.world_size() > 1 << 16 {
            return Err(CommError::InvalidArgument(
                "DLCP supports at most 65536 ranks".into(),
            ));
        }
        let (rank, world, seq) = (self.rank(), self.world_size(), self.seq);
        let chunk = self.chunk_elems();
        let mut m = DlcpAllReduce::new(rank, world, seq, data, tensors, cfg, chunk, Instant::now());
        self.drive(&mut m)?;
        let mut report = m.into_report();
        report.bytes = self.last;
        Ok(report)
    }

    /// Broadcasts `data` from `root`: on other ranks `data` is replaced by the root's bytes.
    pub fn broadcast(&mut self, data: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        if root >= self.world_size() {
            return Err(CommError::InvalidArgument(format!(
                "broadcast root {root} out of range for world size {}",
                self.world_size()
            )));
        }
        let mut m = Broadcast::new(
            self.rank(),
            self.world_size(),
            self.seq,
            root,
            data,
            self.cfg.chunk_bytes,
            self.cfg.max_buffer_bytes,
        );
        self.drive(&mut m)
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&mut self) -> Result<(), CommError> {
        let mut m = Barrier::new(self.rank(), self.world_size(), self.seq);
        self.drive(&mut m)
    }

    fn chunk_elems(&self) -> usize {
        (self.cfg.chunk_bytes / 4).max(1)
    }

    /// Runs one collective: counts its bytes and advances the sequence number on success.
    fn drive<M: Machine>(&mut self, m: &mut M) -> Result<(), CommError> {
        let start = self.transport.bytes();
        self.stashed_in = 0;
        self.stashed_out = 0;
        let r = self.drive_inner(m);
        let mut last = self.transport.bytes() - start;
        last.received = last.received + self.stashed_in - self.stashed_out;
        self.last = last;
        if r.is_ok() {
            self.seq += 1;
        }
        r
    }

    fn drive_inner<M: Machine>(&mut self, m: &mut M) -> Result<(), CommError> {
        if let Some(f) = &self.failed {
            return Err(CommError::Poisoned(f.clone()));
        }
        let me = self.rank();
        self.heard.fill(false);
        for (from, msg, n) in std::mem::take(&mut self.stash) {
            if msg.header().seq == self.seq {
                self.stashed_in += n;
                self.heard[from] = true;
                if let Err(e) = m.handle(from, msg) {
                    return Err(self.fail_algo(e));
                }
            } else {
                self.stash.push_back((from, msg, n));
            }
        }
        // A peer that closed is delivered after all it sent, so this collective can still
        // complete if it needs nothing more from it.
        if let Some(p) =
            (0..self.world_size()).find(|&p| self.transport.lost(p).is_some() && m.expects_from(p))
        {
            return Err(self.fail_peer_lost(p));
        }
        let stall = self.cfg.timeout - self.grace();
        let mut deadline = Instant::now() + stall;
        loop {
            m.handle_timeout(Instant::now());
            while let Some((to, msg)) = m.poll_transmit() {
                if self.transport.lost(to).is_some() {
                    return Err(self.fail_peer_lost(to));
                }
                match self.transport.send(to, msg.into_bytes()) {
                    Ok(()) => {}
                    Err(e @ TransportError::Closed { .. }) => {
                        let rank = e.lost_peer().expect("a lost peer").0;
                        return Err(self.fail_peer_lost(rank));
                    }
                    Err(e) => return Err(self.poison(e.into())),
                }
            }
            if m.is_done() {
                return Ok(());
            }
            let before = self.transport.bytes().received;
            let wake = m.poll_timeout().map_or(deadline, |t| t.min(deadline));
            match self.transport.recv(wake) {
                Ok((from, bytes)) => {
                    let n = self.transport.bytes().received - before;
                    let msg = match Message::decode(bytes) {
                        Ok(msg) => msg,
                        Err(e) => return Err(self.fail_algo(AlgoError::wire(from, e))),
                    };
                    if msg.header().seq < self.floor {
                        // Of a failed membership epoch (a relayed abort, a chunk sent
                        // before a peer was lost): the group has gone on without it.
                        continue;
                    }
                    if msg.header().kind == Kind::Abort {
                        let waiting = self.waiting_on(m);
                        let silent = self.silent(&waiting);
                        return Err(self.on_abort(from, &msg, waiting, silent));
                    }
                    let seq = msg.header().seq;
                    if seq > self.seq {
                        self.stashed_out += n;
                        self.stash.push_back((from, msg, n));
                    } else if seq < self.seq && msg.header().kind == Kind::Dlcp {
                        // A late packet of an earlier lossy round: legal, and useless now.
                        continue;
                    } else if seq < self.seq {
                        return Err(self.fail_algo(AlgoError::Mismatch {
                            peer: from,
                            detail: format!(
                                "peer sent a message of collective #{seq} while this rank runs #{}",
                                self.seq
                            ),
                        }));
                    } else {
                        self.heard[from] = true;
                        if let Err(e) = m.handle(from, msg) {
                            return Err(self.fail_algo(e));
                        }
                        deadline = Instant::now() + stall;
                    }
                }
                Err(e @ (TransportError::Closed { .. } | TransportError::PeerSilent { .. })) => {
                    let rank = e.lost_peer().expect("a lost peer").0;
                    if m.expects_from(rank) {
                        return Err(self.fail_peer_lost(rank));
                    }
                }
                // The machine's own timer is due (handled at the top of the loop).
                Err(TransportError::Timeout) if Instant::now() < deadline => {}
                Err(TransportError::Timeout) => {
                    // Blame only a peer that sent nothing at all of this collective: one
                    // that sent part of it may itself be waiting for the stalled rank.
                    let waiting = self.waiting_on(m);
                    let silent = self.silent(&waiting);
                    let culprit = silent.first().map_or(AbortInfo::NO_CULPRIT, |&p| p as u32);
                    self.abort_all(AbortInfo {
                        reason: AbortReason::Timeout,
                        culprit,
                        detail: format!("rank {me} timed out after {:?}", self.cfg.timeout),
                    });
                    let e = self.gossip(BTreeSet::new(), silent, waiting);
                    return Err(self.poison(e));
                }
                Err(e) => return Err(self.poison(e.into())),
            }
        }
    }
}
