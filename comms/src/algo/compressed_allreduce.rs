//! Compressed all-reduce: an all-reduce whose values travel encoded both ways, with the
//! reduction done by the owner of each segment through the driver's codec
//! ([`SegmentReduce`]). This is the scatter-reduce / all-gather shape of CGX (Markov et al.,
//! 2022) and of DeepSpeed's compressed back end for 1-bit Adam (Tang et al., 2021): each
//! owner decodes what it receives, sums, and *re-encodes* the sum (keeping its own "server"
//! error-feedback residual, on the driver's side), so the bytes a rank sends stay about
//! twice the compressed size of its buffer, whatever the number of ranks — an all-gather of
//! whole payloads sends P − 1 times it.
//!
//! The machine moves bytes only: what a share or a reduced block contains, how a buffer is
//! cut into the P segments and how shares are decoded and summed are the driver's business.
//!
//! 1. **Scatter** (phase 0): rank `r` holds one encoded *share* per owner, `shares[q]` (its
//!    buffer's segment `q`, encoded), and sends `shares[q]` to every other rank `q`.
//! 2. **Reduce**: once the owner has all P shares of its segment (its own included), it calls
//!    [`SegmentReduce::reduce`] with them in rank order and gets its encoded reduced block.
//! 3. **Gather** (phase 1): the owner sends its reduced block to every other rank.
//!
//! Every rank ends with the P reduced blocks in owner order
//! ([`CompressedAllReduce::into_reduced`]): the same bytes on every rank, the owner's
//! included, so decoding them gives bit-identical results everywhere.
//!
//! # Bytes
//! Rank `r` sends `Σ_{q≠r} |shares[q]|` plus `(P − 1)·|reduced_r|`: with shares and
//! reduced blocks about `C/P` each for a buffer whose encoding is `C` bytes, `2·C·(P−1)/P`.
//! All messages of a phase go out at once (two latencies), at the price of `2(P−1)` messages
//! per rank per chunk column, as in the sparse all-reduce.
//!
//! # Wire
//! Header: kind [`Kind::CompressedAllReduce`], algorithm [`Algo::Direct`], `phase` 0 (share)
//! or 1 (reduced block), `root` = the segment's owner (the receiver of a share, the sender of
//! a reduced block), `count` = the block's byte length, `offset` = the chunk's byte offset,
//! `step` = the caller's layout key (every rank must pass the same, e.g. the buffer's element
//! count, so that ranks reducing different buffers report a mismatch). Blocks travel in
//! chunks of at most `chunk` bytes; a block announced over the limit is refused before
//! anything is allocated. Every field is checked against what this rank expects from that
//! peer; anything else is an [`AlgoError`], never a panic.

use std::collections::VecDeque;

use super::{check_header, AlgoError, Block, Machine, OwnChunks};
use crate::wire::{Algo, Header, Kind, Message};

const SHARE: u8 = 0;
const REDUCED: u8 = 1;

/// The owner's reduction of its segment: the driver's decode → sum → re-encode.
pub trait SegmentReduce {
    /// `shares[q]` is rank `q`'s encoded share of this rank's segment, in rank order, this
    /// rank's own included. Returns the encoded reduced segment, or the rank whose share is
    /// at fault and why (the machine then fails naming that rank).
    fn reduce(&mut self, shares: &[&[u8]]) -> Result<Vec<u8>, (usize, String)>;
}

impl<F: FnMut(&[&[u8]]) -> Result<Vec<u8>, (usize, String)>> SegmentReduce for F {
    fn reduce(&mut self, shares: &[&[u8]]) -> Result<Vec<u8>, (usize, String)> {
        self(shares)
    }
}

/// How blocks travel: chunk size and the largest block a peer may announce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes per message at most (0 is treated as 1).
    pub chunk_bytes: usize,
    /// Largest share or reduced block a peer may announce, in bytes.
    pub max_block_bytes: u64,
}

/// Compressed all-reduce on one rank (see the [module docs](self)).
pub struct CompressedAllReduce<'a> {
    rank: usize,
    world: usize,
    seq: u64,
    key: u32,
    chunk: usize,
    max_block: u64,
    /// This rank's share for each owner.
    shares: &'a [&'a [u8]],
    reducer: &'a mut dyn SegmentReduce,
    /// Peers' shares of this rank's segment, by sender (this rank's own stays in `shares`).
    received: Vec<Block>,
    shares_missing: usize,
    /// Reduced blocks by owner; this rank's own once reduced.
    reduced: Vec<Block>,
    /// Per peer: blocks still expected from it (its share and its reduced block).
    missing: Vec<usize>,
    total_missing: usize,
    /// Blocks still to send, as `(peer, phase)`: the shares at once, the reduced block to
    /// every peer once reduced.
    todo: VecDeque<(usize, u8)>,
    /// The block being cut into chunks: its receiver, phase and chunks.
    sending: Option<(usize, u8, OwnChunks)>,
}

impl std::fmt::Debug for CompressedAllReduce<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompressedAllReduce")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("seq", &self.seq)
            .field("total_missing", &self.total_missing)
            .finish_non_exhaustive()
    }
}

impl<'a> CompressedAllReduce<'a> {
    /// Reduces `shares` (one per rank, `shares[q]` for owner `q`) over `world` ranks with
    /// `reducer` on each owner; `key` must be the same on every rank. With one rank the
    /// reduction happens here.
    ///
    /// # Errors
    /// The reducer's error on a one-rank world, as a protocol error naming this rank.
    ///
    /// # Panics
    /// If `rank >= world` or `shares.len() != world`.
    pub fn new(
        rank: usize,
        world: usize,
        seq: u64,
        key: u32,
        shares: &'a [&'a [u8]],
        reducer: &'a mut dyn SegmentReduce,
        limits: Limits,
    ) -> Result<Self, AlgoError> {
        assert!(rank < world, "rank {rank} out of range for world {world}");
        assert_eq!(shares.len(), world, "one share per rank");
        let peers = world - 1;
        let mut m = CompressedAllReduce {
            rank,
            world,
            seq,
            key,
            chunk: limits.chunk_bytes.max(1),
            max_block: limits.max_block_bytes,
            shares,
            reducer,
            received: (0..world).map(|_| Block::default()).collect(),
            shares_missing: peers,
            reduced: (0..world).map(|_| Block::default()).collect(),
            missing: (0..world).map(|q| if q == rank { 0 } else { 2 }).collect(),
            total_missing: 2 * peers,
            todo: (1..world).map(|s| ((rank + s) % world, SHARE)).collect(),
            sending: None,
        };
        if world == 1 {
            m.reduce()?;
        }
        Ok(m)
    }

    fn header(&self, phase: u8, owner: usize, len: usize) -> Header {
        Header {
            phase,
            step: self.key,
            count: len as u64,
            root: owner as u32,
            ..Header::new(Kind::CompressedAllReduce, Algo::Direct, self.seq)
        }
    }

    /// The bytes of the block sent in `phase` to `to`.
    fn block(&self, to: usize, phase: u8) -> &[u8] {
        match phase {
            SHARE => self.shares[to],
            _ => &self.reduced[self.rank].data,
        }
    }

    /// All shares of this rank's segment are in: reduce and queue the reduced block.
    fn reduce(&mut self) -> Result<(), AlgoError> {
        let own = self.rank;
        let views: Vec<&[u8]> = (0..self.world)
            .map(|q| {
                if q == own {
                    self.shares[own]
                } else {
                    &self.received[q].data[..]
                }
            })
            .collect();
        let reduced = self
            .reducer
            .reduce(&views)
            .map_err(|(peer, detail)| AlgoError::protocol(peer, detail))?;
        // The peers' shares are no longer needed.
        for (q, b) in self.received.iter_mut().enumerate() {
            if q != own {
                b.data = Vec::new();
            }
        }
        self.reduced[own] = Block::filled(reduced);
        self.todo
            .extend((1..self.world).map(|s| ((own + s) % self.world, REDUCED)));
        Ok(())
    }

    /// The reduced blocks in owner order (the same bytes on every rank).
    ///
    /// # Panics
    /// If the machine is not done.
    pub fn into_reduced(self) -> Vec<Vec<u8>> {
        assert!(self.is_done(), "compressed all-reduce not complete");
        self.reduced.into_iter().map(|b| b.data).collect()
    }
}

impl Machine for CompressedAllReduce<'_> {
    fn handle(&mut self, from: usize, msg: Message) -> Result<(), AlgoError> {
        let h = *msg.header();
        check_header(from, &h, Kind::CompressedAllReduce, Algo::Direct, None)?;
        if from >= self.world || from == self.rank {
            return Err(AlgoError::protocol(
                from,
                format!("compressed all-reduce message from rank {from}, not a peer"),
            ));
        }
        if h.step != self.key {
            return Err(AlgoError::Mismatch {
                peer: from,
                detail: format!(
                    "peer's compressed all-reduce has layout key {}, this rank's {}",
                    h.step, self.key
                ),
            });
        }
        let block = match h.phase {
            SHARE if h.root as usize == self.rank => &mut self.received[from],
            SHARE => {
                return Err(AlgoError::protocol(
                    from,
                    format!("share of segment {} sent to rank {}", h.root, self.rank),
                ))
            }
            REDUCED if h.root as usize == from => &mut self.reduced[from],
            REDUCED => {
                return Err(AlgoError::protocol(
                    from,
                    format!("reduced block of segment {} sent by rank {from}", h.root),
                ))
            }
            other => {
                return Err(AlgoError::protocol(
                    from,
                    format!("unexpected compressed all-reduce phase {other}"),
                ))
            }
        };
        let what = if h.phase == SHARE {
            "share"
        } else {
            "reduced block"
        };
        // Formatted only if an error names it (no allocation per chunk).
        let name = format_args!("{what} of segment {}", h.root);
        if block.receive(from, name, &h, msg.payload(), self.max_block)? {
            self.missing[from] -= 1;
            self.total_missing -= 1;
            if h.phase == SHARE {
                self.shares_missing -= 1;
                if self.shares_missing == 0 {
                    self.reduce()?;
                }
            }
        }
        Ok(())
    }

    fn poll_transmit(&mut self) -> Option<(usize, Message)> {
        // Blocks in queue order (shares to rank+1, rank+2, …, then the reduced block in the
        // same order), each cut into chunks as they are asked for.
        loop {
            if let Some((to, phase, mut chunks)) = self.sending.take() {
                if let Some(msg) = chunks.next(self.block(to, phase)) {
                    self.sending = Some((to, phase, chunks));
                    return Some((to, msg));
                }
            }
            let (to, phase) = self.todo.pop_front()?;
            let owner = if phase == SHARE { to } else { self.rank };
            let len = self.block(to, phase).len();
            let h = self.header(phase, owner, len);
            self.sending = Some((to, phase, OwnChunks::new(h, len, self.chunk, true)));
        }
    }

    fn is_done(&self) -> bool {
        self.total_missing == 0
            && self.todo.is_empty()
            && self.sending.is_none()
            && self.reduced[self.rank].complete
    }

    fn expects_from(&self, peer: usize) -> bool {
        self.missing.get(peer).is_some_and(|&m| m > 0)
    }
}
