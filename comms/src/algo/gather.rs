//! Direct gather of variable-size byte buffers to some of the ranks (gatherv to several
//! roots): every rank sends its buffer, in chunks, straight to each *receiver* other than
//! itself, and each receiver collects every other rank's block. Nothing is relayed, so a
//! rank's link carries its own buffer once per receiver and nothing else: what a group
//! uses to hand its state to a newcomer in slices, one slice per member (an all-gather's
//! ring would have the newcomer's neighbour send it everything).
//!
//! Messages are [`Kind::AllGather`] with [`Algo::Direct`]; each names its block's owner
//! (`root`, the sender), the block's length (`count`) and the chunk's offset. An empty
//! block travels as one empty message. Blocks are bounded as in the all-gather.

use std::collections::VecDeque;

use super::{check_header, AlgoError, Block, Machine, OwnChunks};
use crate::wire::{Algo, Header, Kind, Message};

/// Direct gather to the receivers (see the [module docs](self)). The result is taken with
/// [`Gather::into_blocks`].
#[derive(Debug)]
pub struct Gather<'a> {
    rank: usize,
    max_block: u64,
    /// Per rank: whether it receives.
    receives: Vec<bool>,
    /// Blocks received (a receiver's; empty elsewhere).
    blocks: Vec<Block>,
    incomplete: usize,
    mine: &'a [u8],
    own: OwnChunks,
    /// The current chunk, still to go to the receivers in the queue.
    out: VecDeque<(usize, Message)>,
    /// The receivers this rank sends to.
    to: Vec<usize>,
}

impl<'a> Gather<'a> {
    /// Gathers `data` of every rank on each rank of `receivers` (duplicates and this rank
    /// allowed); chunks of at most `chunk_bytes`, blocks of peers at most
    /// `max_block_bytes`.
    ///
    /// # Panics
    /// If `rank` or a receiver is not below `world`.
    pub fn new(
        rank: usize,
        world: usize,
        seq: u64,
        data: &'a [u8],
        receivers: &[usize],
        chunk_bytes: usize,
        max_block_bytes: u64,
    ) -> Self {
        assert!(rank < world, "rank {rank} out of range for world {world}");
        let mut receives = vec![false; world];
        for &r in receivers {
            assert!(r < world, "receiver {r} out of range for world {world}");
            receives[r] = true;
        }
        let to: Vec<usize> = (0..world).filter(|&r| receives[r] && r != rank).collect();
        let h = Header {
            count: data.len() as u64,
            root: rank as u32,
            ..Header::new(Kind::AllGather, Algo::Direct, seq)
        };
        let own = OwnChunks::new(h, data.len(), chunk_bytes, !to.is_empty());
        let mut blocks: Vec<Block> = (0..world).map(|_| Block::default()).collect();
        let incomplete = if receives[rank] { world - 1 } else { 0 };
        blocks[rank].mark_complete(data.len() as u64);
        Gather {
            rank,
            max_block: max_block_bytes,
            receives,
            blocks,
            incomplete,
            mine: data,
            own,
            out: VecDeque::new(),
            to,
        }
    }

    /// The gathered buffers, indexed by rank (this rank's own included); all empty on a
    /// rank that does not receive, but for its own.
    ///
    /// # Panics
    /// If the machine is not done.
    pub fn into_blocks(self) -> Vec<Vec<u8>> {
        assert!(self.is_done(), "gather not complete");
        let mut blocks: Vec<Vec<u8>> = self.blocks.into_iter().map(|b| b.data).collect();
        blocks[self.rank].extend_from_slice(self.mine);
        blocks
    }
}

impl Machine for Gather<'_> {
    fn handle(&mut self, from: usize, msg: Message) -> Result<(), AlgoError> {
        let h = *msg.header();
        check_header(from, &h, Kind::AllGather, Algo::Direct, None)?;
        if !self.receives[self.rank] {
            return Err(AlgoError::protocol(
                from,
                "a gather's block sent to a rank that does not receive",
            ));
        }
        if h.root as usize != from {
            return Err(AlgoError::protocol(
                from,
                format!("block of rank {} sent by rank {from}", h.root),
            ));
        }
        if self.blocks[from].receive(from, from, &h, msg.payload(), self.max_block)? {
            self.incomplete -= 1;
        }
        Ok(())
    }

    fn poll_transmit(&mut self) -> Option<(usize, Message)> {
        if self.out.is_empty() {
            let m = self.own.next(self.mine)?;
            let (last, rest) = self.to.split_last().expect("chunks only with receivers");
            for &r in rest {
                self.out.push_back((r, m.clone()));
            }
            self.out.push_back((*last, m));
        }
        self.out.pop_front()
    }

    fn is_done(&self) -> bool {
        self.incomplete == 0 && self.out.is_empty() && self.own.is_done()
    }

    fn expects_from(&self, peer: usize) -> bool {
        self.receives[self.rank] && peer != self.rank && !self.blocks[peer].complete
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the gather on every rank in memory; returns each rank's blocks and the bytes
    /// each sent.
    fn run(data: &[Vec<u8>], receivers: &[usize], chunk: usize) -> Vec<(Vec<Vec<u8>>, usize)> {
        let world = data.len();
        let mut ms: Vec<Gather> = (0..world)
            .map(|r| Gather::new(r, world, 9, &data[r], receivers, chunk, 1 << 20))
            .collect();
        let mut sent = vec![0usize; world];
        loop {
            let mut moved = false;
            for r in 0..world {
                while let Some((to, m)) = ms[r].poll_transmit() {
                    sent[r] += m.payload().len();
                    ms[to].handle(r, m).unwrap();
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
        assert!(ms.iter().all(|m| m.is_done()));
        ms.into_iter().map(Gather::into_blocks).zip(sent).collect()
    }

    #[test]
    fn receivers_get_every_block_and_senders_send_theirs_once_each() {
        let data: Vec<Vec<u8>> = vec![vec![1; 10], vec![], vec![3; 25], vec![4; 7]];
        let out = run(&data, &[3, 1], 4);
        for r in [1, 3] {
            assert_eq!(out[r].0, data);
        }
        assert_eq!(out[0].0, vec![vec![1; 10], vec![], vec![], vec![]]);
        // Rank 0 sends its 10 bytes to two receivers; rank 3 its 7 to one.
        assert_eq!((out[0].1, out[2].1, out[3].1), (20, 50, 7));
    }

    #[test]
    fn a_block_from_a_rank_other_than_its_owner_is_refused() {
        let d = vec![1u8; 3];
        let mut a = Gather::new(0, 3, 0, &d, &[1], 8, 100);
        let mut b = Gather::new(1, 3, 0, &d, &[1], 8, 100);
        let (_, m) = a.poll_transmit().unwrap();
        assert!(b.handle(2, m).is_err());
    }
}
