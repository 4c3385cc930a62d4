//! Collective algorithms as IO-free state machines.
//!
//! A machine is created with its rank, the world size, the collective's sequence number
//! and its operands; the driver then repeatedly
//! 1. drains [`Machine::poll_transmit`] and sends each `(to_rank, message)`,
//! 2. stops once [`Machine::is_done`],
//! 3. otherwise receives one message and feeds it to [`Machine::handle`].
//!
//! Machines never touch sockets or the clock: timeouts, peer failure and the transport are
//! the driver's business ([`crate::Communicator`]). They accept messages of one link in any
//! order (every message names its step and offset), so a transport need not be FIFO; they
//! validate every header and payload against what they expect from that peer and return
//! [`AlgoError`] (never panic) on anything else. Every message a machine expects is needed
//! for its completion, so once a machine is done no further message of its collective can
//! arrive — a later one is a protocol violation.
//!
//! | collective | machine | messages per rank |
//! |---|---|---|
//! | all-reduce (large), reduce-scatter | [`ring::Ring`] | 2(P−1) per chunk column (P−1 for reduce-scatter) |
//! | all-reduce (small) | [`recursive_doubling::RecursiveDoubling`] | log2 P (+1 off powers of two) |
//! | all-gatherv | [`allgather::AllGather`] | P−1 blocks, chunked |
//! | broadcast | [`broadcast::Broadcast`] | 1 chain hop, chunked |
//! | barrier | [`barrier::Barrier`] | ⌈log2 P⌉ |
//! | sparse all-reduce | [`sparse_allreduce::SparseAllReduce`] | 2(P−1) per chunk column, direct |
//! | compressed all-reduce | [`compressed_allreduce::CompressedAllReduce`] | 2(P−1) blocks, chunked, direct |
//! | hierarchical all-reduce | [`hierarchical::Hierarchical`] | a host chain down (reduce) and up (broadcast); leaders: the ring's or recursive doubling's among M leaders |
//! | DLCP bounded-loss all-reduce | [`crate::dlcp::DlcpAllReduce`] (the one with timers) | one per packet to each owner, + markers, NACKs, bitmaps, sums |

pub mod allgather;
pub mod barrier;
pub mod broadcast;
pub mod compressed_allreduce;
pub mod gather;
pub mod hierarchical;
pub mod recursive_doubling;
pub mod ring;
pub mod sparse_allreduce;

use std::ops::Range;
use std::time::Instant;

use thiserror::Error;

use crate::wire::{combine_f32_le, Algo, Header, Kind, Message, WireError};

/// Errors of a collective state machine: the peer sent something this rank did not expect.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum AlgoError {
    /// The peer runs a different collective (kind, algorithm, length or root differ).
    #[error("collective mismatch with rank {peer}: {detail}")]
    Mismatch {
        /// The peer that sent the mismatching message.
        peer: usize,
        /// What differs.
        detail: String,
    },
    /// The peer sent a message that is malformed or not expected at this point.
    #[error("protocol error from rank {peer}: {detail}")]
    Protocol {
        /// The peer that sent the message.
        peer: usize,
        /// What was wrong.
        detail: String,
    },
}

impl AlgoError {
    /// The peer this error names.
    pub fn peer(&self) -> usize {
        match self {
            AlgoError::Mismatch { peer, .. } | AlgoError::Protocol { peer, .. } => *peer,
        }
    }

    pub(crate) fn protocol(peer: usize, detail: impl Into<String>) -> Self {
        AlgoError::Protocol {
            peer,
            detail: detail.into(),
        }
    }

    pub(crate) fn wire(peer: usize, e: WireError) -> Self {
        AlgoError::protocol(peer, e.to_string())
    }
}

/// One collective in progress on one rank (see the [module docs](self) for the driving loop).
pub trait Machine {
    /// Feeds one message received from rank `from`.
    fn handle(&mut self, from: usize, msg: Message) -> Result<(), AlgoError>;
    /// The next message to send, as `(to_rank, message)`.
    fn poll_transmit(&mut self) -> Option<(usize, Message)>;
    /// Whether the collective is complete on this rank (all expected messages received and
    /// all messages handed out by `poll_transmit`).
    fn is_done(&self) -> bool;
    /// Whether this machine still expects a message from `peer` (lets a driver tell a peer
    /// that finished and left from one whose loss breaks this collective).
    fn expects_from(&self, peer: usize) -> bool;
    /// The time at which this machine wants [`Machine::handle_timeout`] called (a deadline
    /// or a held packet's release), if any. Default: none — the collectives that need
    /// every message have no timers; only lossy ones ([`crate::dlcp`]) do.
    fn poll_timeout(&self) -> Option<Instant> {
        None
    }
    /// Tells the machine the current time; the driver calls it before every
    /// [`Machine::poll_transmit`] round, so a machine with timers fires those that are due
    /// (the only way a machine learns the time: it never reads the clock). Default: no-op.
    fn handle_timeout(&mut self, now: Instant) {
        let _ = now;
    }
}

/// The element-wise reduction of an all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// `a + b`.
    Sum,
    /// `f32::max(a, b)` (a NaN operand yields the other operand).
    Max,
}

impl ReduceOp {
    /// Applies the reduction; callers pass the operands in the documented order.
    #[inline]
    pub fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            ReduceOp::Sum => a + b,
            ReduceOp::Max => a.max(b),
        }
    }

    /// `payload[i] = apply(payload[i], own[i])` over a little-endian f32 payload, in
    /// place (the received operand first), vectorised per operation.
    pub(crate) fn combine_into(self, payload: &mut [u8], own: &[f32]) {
        match self {
            ReduceOp::Sum => combine_f32_le(payload, own, |a, b| a + b),
            ReduceOp::Max => combine_f32_le(payload, own, f32::max),
        }
    }

    pub(crate) fn kind(self) -> Kind {
        match self {
            ReduceOp::Sum => Kind::AllReduceSum,
            ReduceOp::Max => Kind::AllReduceMax,
        }
    }
}

/// The range of segment `s` when `n` elements are split into `world` contiguous segments:
/// the first `n % world` segments get one element more. Reduce-scatter leaves segment `r`
/// on rank `r`.
///
/// # Panics
/// If `world == 0` or `s >= world`.
pub fn segment_range(n: usize, world: usize, s: usize) -> Range<usize> {
    assert!(s < world, "segment {s} out of range for world {world}");
    let base = n / world;
    let rem = n % world;
    let start = s * base + s.min(rem);
    start..start + base + usize::from(s < rem)
}

/// Number of chunks of a segment of `len` units cut into chunks of `chunk` units: at least
/// one, so that even an empty segment sends one (empty) message and mismatches are seen.
pub(crate) fn chunk_count(len: usize, chunk: usize) -> usize {
    len.div_ceil(chunk).max(1)
}

/// The chunks of a rank's own byte buffer, cut one at a time as `poll_transmit` asks for
/// them (so the first chunk is on the wire while the next ones are still being copied).
#[derive(Debug)]
pub(crate) struct OwnChunks {
    header: Header,
    chunk: usize,
    next: usize,
    count: usize,
}

impl OwnChunks {
    /// Chunks of at most `chunk` bytes (at least 1) of a buffer of `len` bytes, each sent
    /// with `header` and its offset; `send == false` sends none.
    pub(crate) fn new(header: Header, len: usize, chunk: usize, send: bool) -> Self {
        let chunk = chunk.max(1);
        OwnChunks {
            header,
            chunk,
            next: 0,
            count: if send { chunk_count(len, chunk) } else { 0 },
        }
    }

    /// The next chunk of `data` (the buffer the chunks were planned for).
    pub(crate) fn next(&mut self, data: &[u8]) -> Option<Message> {
        if self.next == self.count {
            return None;
        }
        let start = self.next * self.chunk;
        let end = (start + self.chunk).min(data.len());
        self.next += 1;
        let h = Header {
            offset: start as u64,
            ..self.header
        };
        Some(Message::new(h, &data[start..end]))
    }

    /// Whether every chunk was handed out.
    pub(crate) fn is_done(&self) -> bool {
        self.next == self.count
    }
}

/// Writes `bytes` at `off` into `data`, growing it as needed: a chunk that continues the
/// buffer (the usual, in-order case) is appended without zero-filling first; only a gap
/// left by an out-of-order chunk is zero-filled.
pub(crate) fn place(data: &mut Vec<u8>, off: usize, bytes: &[u8]) {
    if off == data.len() {
        data.extend_from_slice(bytes);
        return;
    }
    let end = off + bytes.len();
    if data.len() < end {
        data.resize(end, 0);
    }
    data[off..end].copy_from_slice(bytes);
}

/// A variable-size byte block that arrives in chunks (all-gather(v), compressed
/// all-reduce): every message names the block's total length (`count`, checked against a
/// limit before anything is allocated) and the chunk's byte offset; the buffer grows only
/// as bytes actually arrive, and an empty block travels as one empty message.
#[derive(Debug, Default)]
pub(crate) struct Block {
    pub(crate) data: Vec<u8>,
    total: Option<u64>,
    received: u64,
    pub(crate) complete: bool,
}

impl Block {
    /// An empty block that fills `data`'s capacity (cleared).
    pub(crate) fn reusing(mut data: Vec<u8>) -> Self {
        data.clear();
        Block {
            data,
            ..Block::default()
        }
    }

    /// A complete block holding `data`.
    pub(crate) fn filled(data: Vec<u8>) -> Self {
        let len = data.len() as u64;
        let mut b = Block {
            data,
            ..Block::default()
        };
        b.mark_complete(len);
        b
    }

    /// Marks the block complete with `len` bytes that the caller keeps elsewhere (a rank's
    /// own block, copied in at the end).
    pub(crate) fn mark_complete(&mut self, len: u64) {
        self.total = Some(len);
        self.received = len;
        self.complete = true;
    }

    /// Takes one chunk (`h.count` the block's total, `h.offset` the chunk's offset) of the
    /// block named `name` in errors, from `from`. `Ok(true)` when it completed the block.
    pub(crate) fn receive(
        &mut self,
        from: usize,
        name: impl std::fmt::Display,
        h: &Header,
        payload: &[u8],
        max_block: u64,
    ) -> Result<bool, AlgoError> {
        if h.count > max_block {
            return Err(AlgoError::protocol(
                from,
                format!(
                    "block {name} announces {} bytes, over the limit of {max_block}",
                    h.count
                ),
            ));
        }
        let len = payload.len() as u64;
        if self.complete {
            return Err(AlgoError::protocol(
                from,
                format!("duplicate data for complete block {name}"),
            ));
        }
        match self.total {
            Some(t) if t != h.count => {
                return Err(AlgoError::protocol(
                    from,
                    format!("block {name} length changed from {t} to {}", h.count),
                ))
            }
            _ => self.total = Some(h.count),
        }
        let end = h.offset.checked_add(len).filter(|&e| e <= h.count);
        let ok = match end {
            Some(_) if h.count == 0 => true,
            Some(_) => len > 0 && self.received + len <= h.count,
            None => false,
        };
        if end.filter(|_| ok).is_none() {
            return Err(AlgoError::protocol(
                from,
                format!(
                    "bad chunk of block {name}: offset {} length {len} total {}",
                    h.offset, h.count
                ),
            ));
        }
        // Bounded: end <= count <= max_block.
        place(&mut self.data, h.offset as usize, payload);
        self.received += len;
        self.complete = self.received == h.count;
        Ok(self.complete)
    }
}

/// Checks that a chunk of f32 values at element offset `off` carries `payload` bytes for
/// the `elems` elements it should.
pub(crate) fn check_chunk_len(
    from: usize,
    off: usize,
    payload: usize,
    elems: usize,
) -> Result<(), AlgoError> {
    if payload != elems * 4 {
        return Err(AlgoError::protocol(
            from,
            format!("chunk at {off} has {payload} bytes, expected {}", elems * 4),
        ));
    }
    Ok(())
}

/// Checks the fields every rank must agree on.
pub(crate) fn check_header(
    from: usize,
    got: &Header,
    kind: Kind,
    algo: Algo,
    count: Option<u64>,
) -> Result<(), AlgoError> {
    if got.kind != kind {
        return Err(AlgoError::Mismatch {
            peer: from,
            detail: format!("peer runs {:?}, this rank runs {kind:?}", got.kind),
        });
    }
    if got.algo != algo {
        return Err(AlgoError::Mismatch {
            peer: from,
            detail: format!(
                "peer uses algorithm {:?}, this rank {algo:?} (different sizes or configs?)",
                got.algo
            ),
        });
    }
    if let Some(c) = count {
        if got.count != c {
            return Err(AlgoError::Mismatch {
                peer: from,
                detail: format!(
                    "peer's {kind:?} has {} elements, this rank's {c}",
                    got.count
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_partition_the_range() {
        for n in 0..30 {
            for world in 1..9 {
                let mut next = 0;
                for s in 0..world {
                    let r = segment_range(n, world, s);
                    assert_eq!(r.start, next);
                    assert!(r.len() == n / world || r.len() == n / world + 1);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn place_appends_and_fills_gaps() {
        let mut d = Vec::new();
        place(&mut d, 0, b"ab");
        place(&mut d, 4, b"ef");
        place(&mut d, 2, b"cd");
        place(&mut d, 6, b"");
        assert_eq!(d, b"abcdef");
    }

    #[test]
    fn chunk_counts() {
        assert_eq!(chunk_count(0, 4), 1);
        assert_eq!(chunk_count(4, 4), 1);
        assert_eq!(chunk_count(5, 4), 2);
    }
}
