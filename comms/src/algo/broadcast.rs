//! Broadcast of a byte buffer from any root, as a pipelined chain.
//!
//! Ranks form the chain `root, root+1, …, root+P−1` (mod P). The root cuts its buffer into
//! chunks of at most `chunk` bytes and sends them to the next rank; every other rank stores
//! each chunk and forwards it unchanged, so chunks pipeline down the chain (time ≈
//! size/bandwidth + (P−1)·chunk/bandwidth). Non-roots learn the length from the first chunk;
//! an empty buffer travels as one empty message. Lengths over the configured limit are
//! rejected before anything is allocated.

use std::collections::VecDeque;

use super::{check_header, place, AlgoError, Machine, OwnChunks};
use crate::wire::{Algo, Header, Kind, Message};

/// Chain broadcast into a borrowed buffer (see the [module docs](self)).
#[derive(Debug)]
pub struct Broadcast<'a> {
    rank: usize,
    world: usize,
    root: usize,
    max_bytes: u64,
    data: &'a mut Vec<u8>,
    total: Option<u64>,
    received: u64,
    done_recv: bool,
    /// The root's chunks, cut lazily.
    own: OwnChunks,
    out: VecDeque<(usize, Message)>,
}

impl<'a> Broadcast<'a> {
    /// Broadcasts `data` from `root`: on the root `data` is read, elsewhere it is replaced
    /// by the root's buffer. Chunks are at most `chunk_bytes` (0 is treated as 1); the root's
    /// buffer may be at most `max_bytes` long.
    ///
    /// # Panics
    /// If `rank >= world` or `root >= world`.
    pub fn new(
        rank: usize,
        world: usize,
        seq: u64,
        root: usize,
        data: &'a mut Vec<u8>,
        chunk_bytes: usize,
        max_bytes: u64,
    ) -> Self {
        assert!(rank < world, "rank {rank} out of range for world {world}");
        assert!(root < world, "root {root} out of range for world {world}");
        let is_root = rank == root;
        let h = Header {
            count: data.len() as u64,
            root: root as u32,
            ..Header::new(Kind::Broadcast, Algo::Chain, seq)
        };
        let own = OwnChunks::new(h, data.len(), chunk_bytes, is_root && world > 1);
        if !is_root {
            data.clear();
        }
        Broadcast {
            rank,
            world,
            root,
            max_bytes,
            data,
            total: None,
            received: 0,
            done_recv: is_root,
            own,
            out: VecDeque::new(),
        }
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }
}

impl Machine for Broadcast<'_> {
    fn handle(&mut self, from: usize, msg: Message) -> Result<(), AlgoError> {
        let h = *msg.header();
        check_header(from, &h, Kind::Broadcast, Algo::Chain, None)?;
        if h.root as usize != self.root {
            return Err(AlgoError::Mismatch {
                peer: from,
                detail: format!(
                    "peer broadcasts from root {}, this rank from root {}",
                    h.root, self.root
                ),
            });
        }
        if self.done_recv || from != self.prev() {
            return Err(AlgoError::protocol(from, "unexpected broadcast chunk"));
        }
        if h.count > self.max_bytes {
            return Err(AlgoError::protocol(
                from,
                format!(
                    "broadcast of {} bytes is over the limit of {}",
                    h.count, self.max_bytes
                ),
            ));
        }
        match self.total {
            Some(t) if t != h.count => {
                return Err(AlgoError::protocol(
                    from,
                    format!("broadcast length changed from {t} to {}", h.count),
                ))
            }
            _ => self.total = Some(h.count),
        }
        let len = msg.payload().len() as u64;
        let end = h.offset.checked_add(len).filter(|&e| e <= h.count);
        let ok = match end {
            Some(_) if h.count == 0 => true,
            Some(_) => len > 0 && self.received + len <= h.count,
            None => false,
        };
        let Some(_) = end.filter(|_| ok) else {
            return Err(AlgoError::protocol(
                from,
                format!(
                    "bad broadcast chunk: offset {} length {len} total {}",
                    h.offset, h.count
                ),
            ));
        };
        let off = h.offset as usize;
        place(self.data, off, msg.payload());
        self.received += len;
        if self.received == h.count {
            self.done_recv = true;
        }
        let next = (self.rank + 1) % self.world;
        if next != self.root {
            self.out.push_back((next, msg));
        }
        Ok(())
    }

    fn poll_transmit(&mut self) -> Option<(usize, Message)> {
        let next = (self.rank + 1) % self.world;
        self.out
            .pop_front()
            .or_else(|| Some((next, self.own.next(self.data)?)))
    }

    fn is_done(&self) -> bool {
        self.done_recv && self.out.is_empty() && self.own.is_done()
    }

    fn expects_from(&self, peer: usize) -> bool {
        !self.done_recv && peer == self.prev()
    }
}
