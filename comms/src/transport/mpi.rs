//! MPI driver (feature `mpi`): the `mpi` crate (rsmpi) over the system MPI (Open MPI).
//!
//! This is how dtrain reaches RDMA / InfiniBand fabrics: Open MPI picks the fastest path
//! it has (shared memory on one host, UCX / verbs on a cluster). Two layers are offered,
//! for two different needs:
//!
//! * [`MpiTransport`] implements [`Transport`] with non-blocking point-to-point messages
//!   (`MPI_Isend`, `MPI_Improbe` + `MPI_Mrecv`), so the collective state machines,
//!   [`crate::Communicator`] (timeouts, abort propagation, mismatch detection, byte
//!   accounting) and the parameter-server mode run over MPI unchanged, and the
//!   conformance suite applies as is. Results are bit-identical to every other transport.
//! * [`MpiCollectives`] calls MPI's own collectives (`MPI_Allreduce`, `MPI_Allgatherv`,
//!   `MPI_Bcast`, `MPI_Reduce_scatter`, `MPI_Barrier`) behind the same method names as
//!   [`crate::Communicator`]. These are the tuned, fabric-aware algorithms (and the
//!   baseline dtrain's own ring is measured against). Their caveats, which is why they are
//!   a separate type and not a `Communicator`:
//!   - **No timeouts, no failure naming.** A blocking MPI collective cannot be abandoned; a
//!     dead rank makes `mpirun` abort the job, a stalled one hangs it (run under a job
//!     time limit). A mismatched call (different lengths) is undefined behaviour in MPI;
//!     the lengths are checked with an extra small `MPI_Allreduce` first
//!     ([`MpiCollectives::all_reduce_sum`] and [`MpiCollectives::reduce_scatter`]).
//!   - **Summation order is MPI's.** Open MPI's default (`tuned`) algorithms reduce each
//!     element in one order that depends only on the communicator size, message size and
//!     tuning, so all ranks of one call get bit-identical results, but the order differs
//!     from dtrain's ring (results differ in the last bits from [`crate::Communicator`])
//!     and may change with the Open MPI version, `OMPI_MCA_coll_*` settings or a different
//!     fabric component. The MPI standard only *recommends* identical results on all ranks.
//!   - **Max** is `MPI_MAX`, whose result with NaN operands is implementation-defined
//!     (dtrain's [`crate::ReduceOp::Max`] ignores NaNs).
//!   - **Bytes** are not observable (MPI does not report link bytes).
//!
//! # Threads and lifetime
//! MPI must be initialised by the program (`mpi::initialize_with_threading`) with at least
//! `Threading::Serialized`, because a transport may be moved to and used from another
//! thread (one at a time: every method takes `&mut self`). Each transport duplicates the
//! communicator it is given, so its messages never match anyone else's, and never frees
//! the duplicate (a few kilobytes per transport): peers' close messages may still be in
//! flight when it is dropped, and Open MPI reuses a freed communicator's context id, so a
//! later communicator would receive them.
//!
//! # Peer loss
//! MPI has no per-peer connection. By default, when a process dies `mpirun` aborts the
//! whole job (fault-tolerant MPI, ULFM, is not in Open MPI's default build). Started with
//! `mpirun --mca orte_enable_recovery 1 --mca orte_abort_on_non_zero_status 0` (Open MPI
//! 4), the survivors keep running and a killed rank is simply silent: this driver only
//! uses non-blocking calls, so [`crate::Communicator`]'s timeout fires on the rank waiting
//! for it and the abort notices name it on every survivor (test `mpi_killed`, run by CI
//! for 2 and 4 ranks). A peer that *drops its transport* is reported sooner: the drop
//! sends a close message to every peer, delivered after everything it sent before (MPI
//! keeps the order of messages between two ranks on one communicator), and reported once
//! as [`TransportError::Closed`] — the same contract as the channel and TCP drivers. A
//! stalled peer is caught by the timeout as everywhere else.

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::time::{Duration, Instant};

use ::mpi::collective::SystemOperation;
use ::mpi::environment::{threading_support, Threading};
use ::mpi::point_to_point::MatchedReceiveVec;
use ::mpi::request::{Request, StaticScope};
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::*;

use super::{check_peer, ByteCount, Transport, TransportError};
use crate::comm::CommError;

/// Tag of data messages.
const TAG_DATA: i32 = 1;
/// Tag of the close message a transport sends to every peer when dropped.
const TAG_CLOSE: i32 = 2;
/// How long dropping a transport waits for its queued sends to be received.
const DRAIN: Duration = Duration::from_secs(5);

/// A send in flight: MPI reads `buf` until `req` completes, then `buf` is freed.
struct Pending {
    req: Request<'static, [u8], StaticScope>,
    buf: *mut [u8],
}

/// One rank of an MPI communicator, as a [`Transport`] (see the [module docs](self)).
pub struct MpiTransport {
    /// Never freed: peers' close messages may still be in flight when this transport is
    /// dropped, and Open MPI reuses the context id of a freed communicator, so a later
    /// communicator would receive them.
    comm: ManuallyDrop<SimpleCommunicator>,
    rank: usize,
    world: usize,
    pending: Vec<Pending>,
    /// Messages received while `recv_from` waited for another peer; `None` = closed.
    skipped: VecDeque<(usize, Option<Vec<u8>>)>,
    closed: Vec<bool>,
    sent: u64,
    received: u64,
}

// SAFETY: MPI handles (communicator, requests) are process-wide and valid on any thread;
// the constructor checks that MPI was initialised with at least `Threading::Serialized`,
// and every method takes `&mut self`, so calls into MPI through one transport never
// overlap. The raw buffers in `pending` are owned by the transport (leaked boxes).
unsafe impl Send for MpiTransport {}

impl std::fmt::Debug for MpiTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiTransport")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("pending_sends", &self.pending.len())
            .field("sent", &self.sent)
            .field("received", &self.received)
            .finish()
    }
}

fn check_threading() -> Result<(), TransportError> {
    match threading_support() {
        Threading::Serialized | Threading::Multiple => Ok(()),
        t => Err(TransportError::Handshake {
            peer: "mpi".into(),
            detail: format!(
                "MPI initialised with threading level {t:?}; at least Serialized is needed"
            ),
        }),
    }
}

impl MpiTransport {
    /// A transport over a duplicate of `comm` (ranks and size are `comm`'s). Collective
    /// over `comm`: every rank of it must call this.
    ///
    /// Fails if MPI was not initialised with at least `Threading::Serialized`.
    pub fn new(comm: &SimpleCommunicator) -> Result<Self, TransportError> {
        check_threading()?;
        let comm = ManuallyDrop::new(comm.duplicate());
        let rank = comm.rank() as usize;
        let world = comm.size() as usize;
        Ok(MpiTransport {
            comm,
            rank,
            world,
            pending: Vec::new(),
            skipped: VecDeque::new(),
            closed: vec![false; world],
            sent: 0,
            received: 0,
        })
    }

    /// Sends still in flight (not yet received by their peer, for large messages).
    pub fn pending_sends(&self) -> usize {
        self.pending.len()
    }

    /// Frees the buffers of completed sends.
    fn reap(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            let Pending { req, buf } = self.pending.swap_remove(i);
            match req.test() {
                Ok(_) => {
                    // SAFETY: `buf` came from `Box::leak` in `isend`, and the request that
                    // borrowed it has completed, so MPI no longer reads it.
                    drop(unsafe { Box::from_raw(buf) });
                }
                Err(req) => {
                    self.pending.push(Pending { req, buf });
                    let last = self.pending.len() - 1;
                    self.pending.swap(i, last);
                    i += 1;
                }
            }
        }
    }

    fn isend(&mut self, to: usize, msg: Vec<u8>, tag: i32) {
        let buf: &'static mut [u8] = Box::leak(msg.into_boxed_slice());
        let ptr: *mut [u8] = buf;
        // SAFETY: `ptr` points to the leaked box above, which stays allocated until the
        // request completes (see `reap` and `Drop`); nothing else accesses it meanwhile.
        let shared: &'static [u8] = unsafe { &*ptr };
        let req = self
            .comm
            .process_at_rank(to as i32)
            .immediate_send_with_tag(StaticScope, shared, tag);
        self.pending.push(Pending { req, buf: ptr });
    }

    /// Takes one message or close notice if one has arrived.
    fn poll(&mut self) -> Option<(usize, Option<Vec<u8>>)> {
        let (msg, status) = self.comm.any_process().immediate_matched_probe()?;
        let from = status.source_rank() as usize;
        let tag = status.tag();
        let (bytes, _) = (msg, status).matched_receive_vec::<u8>();
        if tag == TAG_CLOSE {
            Some((from, None))
        } else {
            Some((from, Some(bytes)))
        }
    }

    /// Waits for the next message or close notice until `deadline`, progressing sends.
    fn next_event(
        &mut self,
        deadline: Instant,
    ) -> Result<(usize, Option<Vec<u8>>), TransportError> {
        let mut idle = 0u32;
        loop {
            if let Some(e) = self.poll() {
                return Ok(e);
            }
            self.reap();
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::Timeout);
            }
            // Spin briefly for latency, then back off: ranks often share few cores.
            idle += 1;
            if idle < 64 {
                std::thread::yield_now();
            } else {
                let nap = Duration::from_micros(if idle < 1024 { 20 } else { 200 });
                std::thread::sleep(nap.min(deadline - now));
            }
        }
    }

    fn deliver(
        &mut self,
        (from, msg): (usize, Option<Vec<u8>>),
    ) -> Result<(usize, Vec<u8>), TransportError> {
        match msg {
            Some(b) => {
                self.received += b.len() as u64;
                Ok((from, b))
            }
            None => {
                self.closed[from] = true;
                Err(TransportError::Closed { rank: from })
            }
        }
    }
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn send(&mut self, to: usize, msg: Vec<u8>) -> Result<(), TransportError> {
        check_peer(to, self.rank, self.world)?;
        if self.closed[to] {
            return Err(TransportError::Closed { rank: to });
        }
        if msg.len() > i32::MAX as usize {
            return Err(TransportError::TooLarge {
                len: msg.len(),
                max: i32::MAX as usize,
            });
        }
        self.sent += msg.len() as u64;
        self.isend(to, msg, TAG_DATA);
        self.reap();
        Ok(())
    }

    fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
        let e = match self.skipped.pop_front() {
            Some(e) => e,
            None => self.next_event(deadline)?,
        };
        self.deliver(e)
    }

    fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError> {
        check_peer(from, self.rank, self.world)?;
        if let Some(i) = self.skipped.iter().position(|e| e.0 == from) {
            let e = self.skipped.remove(i).expect("index from position");
            return self.deliver(e).map(|(_, b)| b);
        }
        if self.closed[from] {
            return Err(TransportError::Closed { rank: from });
        }
        loop {
            let e = self.next_event(deadline)?;
            if e.0 == from {
                return self.deliver(e).map(|(_, b)| b);
            }
            self.skipped.push_back(e);
        }
    }

    fn bytes(&self) -> ByteCount {
        ByteCount {
            sent: self.sent,
            received: self.received,
        }
    }
}

impl Drop for MpiTransport {
    fn drop(&mut self) {
        for p in 0..self.world {
            if p != self.rank && !self.closed[p] {
                // One byte, not zero: an empty Vec's dangling pointer is 0x1, which Open
                // MPI reads as MPI_IN_PLACE.
                self.isend(p, vec![0], TAG_CLOSE);
            }
        }
        // Large messages complete only once received; give peers a while, then leak what
        // is left (freeing a buffer MPI may still read would be unsound).
        let deadline = Instant::now() + DRAIN;
        loop {
            self.reap();
            if self.pending.is_empty() || Instant::now() >= deadline {
                break;
            }
            // Keep draining incoming messages too, so a peer blocked on us progresses.
            if self.poll().is_none() {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        for p in self.pending.drain(..) {
            p.req.cancel();
            std::mem::forget(p.req);
        }
    }
}

/// MPI's native collectives behind [`crate::Communicator`]'s method names (see the
/// [module docs](self) for what they do not offer: timeouts, failure naming, dtrain's
/// summation order, byte counts).
pub struct MpiCollectives {
    comm: SimpleCommunicator,
}

// SAFETY: as for `MpiTransport`: checked threading level, `&mut self` methods.
unsafe impl Send for MpiCollectives {}

impl std::fmt::Debug for MpiCollectives {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiCollectives")
            .field("rank", &self.rank())
            .field("world", &self.world_size())
            .finish()
    }
}

impl MpiCollectives {
    /// Native collectives over a duplicate of `comm` (collective over `comm`).
    ///
    /// Fails if MPI was not initialised with at least `Threading::Serialized`.
    pub fn new(comm: &SimpleCommunicator) -> Result<Self, TransportError> {
        check_threading()?;
        Ok(MpiCollectives {
            comm: comm.duplicate(),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.comm.size() as usize
    }

    /// Checks that every rank passed the same `len` (min and max agree).
    fn check_same_len(&mut self, what: &str, len: usize) -> Result<(), CommError> {
        let mine = [len as u64, u64::MAX - len as u64];
        let mut both = [0u64; 2];
        self.comm
            .all_reduce_into(&mine[..], &mut both[..], SystemOperation::max());
        let (max, min) = (both[0], u64::MAX - both[1]);
        if min != max {
            return Err(CommError::InvalidArgument(format!(
                "{what}: ranks passed different lengths (between {min} and {max}; this rank {len})"
            )));
        }
        Ok(())
    }

    fn all_reduce(&mut self, data: &mut [f32], op: SystemOperation) -> Result<(), CommError> {
        self.check_same_len("all-reduce", data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let send = data.to_vec();
        self.comm.all_reduce_into(&send[..], data, op);
        Ok(())
    }

    /// `MPI_Allreduce(MPI_SUM)` in place. Lengths are checked to agree first (an extra
    /// 16-byte all-reduce); a mismatch is an error on every rank.
    pub fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CommError> {
        self.all_reduce(data, SystemOperation::sum())
    }

    /// `MPI_Allreduce(MPI_MAX)` in place (lengths checked as for the sum).
    pub fn all_reduce_max(&mut self, data: &mut [f32]) -> Result<(), CommError> {
        self.all_reduce(data, SystemOperation::max())
    }

    /// `MPI_Allreduce(MPI_SUM)` in place without the length check: the lowest-overhead
    /// call, for benchmarks and for callers that guarantee equal lengths.
    pub fn all_reduce_sum_unchecked(&mut self, data: &mut [f32]) {
        if !data.is_empty() {
            let send = data.to_vec();
            self.comm
                .all_reduce_into(&send[..], data, SystemOperation::sum());
        }
    }

    /// `MPI_Reduce_scatter` (sum): on return `data[range]` holds the sum over all ranks of
    /// that segment, `range` being [`crate::segment_range`]`(data.len(), world, rank)` as
    /// for [`crate::Communicator::reduce_scatter`]; the rest of `data` is unchanged.
    pub fn reduce_scatter(
        &mut self,
        data: &mut [f32],
    ) -> Result<std::ops::Range<usize>, CommError> {
        self.check_same_len("reduce-scatter", data.len())?;
        let (world, rank) = (self.world_size(), self.rank());
        let range = crate::segment_range(data.len(), world, rank);
        let counts: Vec<i32> = (0..world)
            .map(|s| crate::segment_range(data.len(), world, s).len() as i32)
            .collect();
        if data.is_empty() {
            return Ok(range);
        }
        let mut out = vec![0f32; range.len()];
        // SAFETY: `data` holds sum(counts) floats (the segments partition it) and `out`
        // holds counts[rank]; both are valid for the duration of the blocking call.
        unsafe {
            ::mpi::ffi::MPI_Reduce_scatter(
                data.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                counts.as_ptr(),
                ::mpi::ffi::RSMPI_FLOAT,
                ::mpi::ffi::RSMPI_SUM,
                self.comm.as_raw(),
            );
        }
        data[range.clone()].copy_from_slice(&out);
        Ok(range)
    }

    /// Sizes by `MPI_Allgather`, then `MPI_Allgatherv` of the bytes; element `r` of the
    /// result is rank `r`'s buffer (sizes may differ, 0 included).
    pub fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let world = self.world_size();
        let mut sizes = vec![0u64; world];
        self.comm
            .all_gather_into(&(data.len() as u64), &mut sizes[..]);
        let total: u64 = sizes.iter().sum();
        if sizes.iter().any(|&s| s > i32::MAX as u64) || total > i32::MAX as u64 {
            return Err(CommError::InvalidArgument(format!(
                "all-gather of {total} bytes exceeds MPI's 2 GiB count limit"
            )));
        }
        if total == 0 {
            return Ok(vec![Vec::new(); world]);
        }
        // An empty slice's dangling pointer can be 0x1, Open MPI's MPI_IN_PLACE: send from
        // a real (zero-length) place instead.
        let dummy = [0u8; 1];
        let data = if data.is_empty() { &dummy[..0] } else { data };
        let counts: Vec<i32> = sizes.iter().map(|&s| s as i32).collect();
        let displs: Vec<i32> = counts
            .iter()
            .scan(0i32, |acc, &c| {
                let d = *acc;
                *acc += c;
                Some(d)
            })
            .collect();
        let mut all = vec![0u8; total as usize];
        {
            let mut part =
                ::mpi::datatype::PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
            self.comm.all_gather_varcount_into(data, &mut part);
        }
        Ok(counts
            .iter()
            .zip(&displs)
            .map(|(&c, &d)| all[d as usize..(d + c) as usize].to_vec())
            .collect())
    }

    /// `MPI_Bcast` of the length, then of the bytes, from `root`: on other ranks `data` is
    /// replaced by the root's bytes.
    pub fn broadcast(&mut self, data: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        if root >= self.world_size() {
            return Err(CommError::InvalidArgument(format!(
                "broadcast root {root} out of range for world size {}",
                self.world_size()
            )));
        }
        let proc = self.comm.process_at_rank(root as i32);
        let mut len = data.len() as u64;
        proc.broadcast_into(&mut len);
        if self.rank() != root {
            data.clear();
            data.resize(len as usize, 0);
        }
        if len > 0 {
            proc.broadcast_into(&mut data[..]);
        }
        Ok(())
    }

    /// `MPI_Barrier`.
    pub fn barrier(&mut self) -> Result<(), CommError> {
        self.comm.barrier();
        Ok(())
    }
}
