//! Ring all-gather of variable-size byte buffers (all-gatherv), sizes 0 included.
//!
//! At step `k = 0..P−1` rank `r` sends block `(r − k) mod P` to its right neighbour: its
//! own buffer at step 0, afterwards the block it received at step `k − 1`. Blocks travel in
//! chunks of at most `chunk` bytes; each message names the block's owner (`root`), total
//! length (`count`) and byte offset, so ranks need not know each other's sizes in advance.
//! An empty block travels as one empty message. A block announced larger than the
//! configured limit is rejected before anything is allocated, and a block's buffer only
//! grows as its bytes actually arrive.

use std::collections::VecDeque;

use super::{check_header, AlgoError, Block, Machine, OwnChunks};
use crate::wire::{Algo, Header, Kind, Message};

/// Ring all-gatherv (see the [module docs](self)). The result is taken with
/// [`AllGather::into_blocks`] (or [`AllGather::into_buffers`]).
#[derive(Debug)]
pub struct AllGather<'a> {
    rank: usize,
    world: usize,
    max_block: u64,
    blocks: Vec<Block>,
    incomplete: usize,
    /// This rank's buffer.
    mine: &'a [u8],
    /// This rank's chunks (of `mine`), cut lazily.
    own: OwnChunks,
    out: VecDeque<(usize, Message)>,
}

impl<'a> AllGather<'a> {
    /// Gathers `data` from every rank; chunks are at most `chunk_bytes` (0 is treated as 1)
    /// and peers' blocks may be at most `max_block_bytes` long.
    ///
    /// # Panics
    /// If `rank >= world`.
    pub fn new(
        rank: usize,
        world: usize,
        seq: u64,
        data: &'a [u8],
        chunk_bytes: usize,
        max_block_bytes: u64,
    ) -> Self {
        Self::with_buffers(
            rank,
            world,
            seq,
            data,
            chunk_bytes,
            max_block_bytes,
            Vec::new(),
        )
    }

    /// As [`AllGather::new`], writing the blocks into `buffers` (element `r` receives rank
    /// `r`'s block; missing elements are added, extra ones dropped). Each buffer is cleared
    /// and its capacity reused, so a caller that passes the buffers of its previous
    /// all-gather of the same sizes allocates nothing.
    ///
    /// # Panics
    /// If `rank >= world`.
    pub fn with_buffers(
        rank: usize,
        world: usize,
        seq: u64,
        data: &'a [u8],
        chunk_bytes: usize,
        max_block_bytes: u64,
        mut buffers: Vec<Vec<u8>>,
    ) -> Self {
        assert!(rank < world, "rank {rank} out of range for world {world}");
        buffers.resize_with(world, Vec::new);
        let h = Header {
            count: data.len() as u64,
            root: rank as u32,
            ..Header::new(Kind::AllGather, Algo::Ring, seq)
        };
        let own = OwnChunks::new(h, data.len(), chunk_bytes, world > 1);
        let mut blocks: Vec<Block> = buffers.into_iter().map(Block::reusing).collect();
        // This rank's block is copied into the result only at the end (`into_blocks`), so
        // that sending starts at once.
        blocks[rank].mark_complete(data.len() as u64);
        AllGather {
            rank,
            world,
            max_block: max_block_bytes,
            blocks,
            incomplete: world - 1,
            mine: data,
            own,
            out: VecDeque::new(),
        }
    }

    fn left(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// The gathered buffers, indexed by rank.
    ///
    /// # Panics
    /// If the machine is not done.
    pub fn into_blocks(self) -> Vec<Vec<u8>> {
        assert!(self.incomplete == 0, "all-gather not complete");
        self.into_buffers()
    }

    /// The block buffers, indexed by rank: the gathered buffers if the machine is done,
    /// else with unspecified contents (for reuse after a failed call).
    pub fn into_buffers(self) -> Vec<Vec<u8>> {
        let mut blocks = self.blocks;
        if self.incomplete == 0 {
            blocks[self.rank].data.extend_from_slice(self.mine);
        }
        blocks.into_iter().map(|b| b.data).collect()
    }
}

impl Machine for AllGather<'_> {
    fn handle(&mut self, from: usize, msg: Message) -> Result<(), AlgoError> {
        let h = *msg.header();
        check_header(from, &h, Kind::AllGather, Algo::Ring, None)?;
        let p = self.world;
        if p == 1 || from != self.left() {
            return Err(AlgoError::protocol(
                from,
                "all-gather message from a rank other than the left neighbour",
            ));
        }
        let step = h.step as usize;
        if step >= p - 1 {
            return Err(AlgoError::protocol(
                from,
                format!("all-gather step {step} out of range"),
            ));
        }
        let b = (from + p - step) % p;
        if h.root as usize != b {
            return Err(AlgoError::protocol(
                from,
                format!("step {step} carries block {} instead of {b}", h.root),
            ));
        }
        if self.blocks[b].receive(from, b, &h, msg.payload(), self.max_block)? {
            self.incomplete -= 1;
        }
        if step < p - 2 {
            let h = Header {
                step: h.step + 1,
                ..h
            };
            self.out
                .push_back(((self.rank + 1) % p, msg.with_header(h)));
        }
        Ok(())
    }

    fn poll_transmit(&mut self) -> Option<(usize, Message)> {
        let right = (self.rank + 1) % self.world;
        self.out
            .pop_front()
            .or_else(|| Some((right, self.own.next(self.mine)?)))
    }

    fn is_done(&self) -> bool {
        self.incomplete == 0 && self.out.is_empty() && self.own.is_done()
    }

    fn expects_from(&self, peer: usize) -> bool {
        self.incomplete > 0 && peer == self.left()
    }
}
