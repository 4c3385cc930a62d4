//! Dissemination barrier: ⌈log2 P⌉ rounds; in round `k` rank `r` signals `r + 2^k` and
//! waits for `r − 2^k` (mod P), and sends round `k + 1` only after round `k` arrived. No
//! rank completes before every rank has entered.

use std::collections::VecDeque;

use super::{check_header, AlgoError, Machine};
use crate::wire::{Algo, Header, Kind, Message};

/// Dissemination barrier (see the [module docs](self)).
#[derive(Debug)]
pub struct Barrier {
    rank: usize,
    world: usize,
    seq: u64,
    next_send: usize,
    got: Vec<bool>,
    out: VecDeque<(usize, Message)>,
}

impl Barrier {
    /// A barrier over `world` ranks.
    ///
    /// # Panics
    /// If `rank >= world`.
    pub fn new(rank: usize, world: usize, seq: u64) -> Self {
        assert!(rank < world, "rank {rank} out of range for world {world}");
        let rounds = if world <= 1 {
            0
        } else {
            (usize::BITS - (world - 1).leading_zeros()) as usize
        };
        let mut m = Barrier {
            rank,
            world,
            seq,
            next_send: 0,
            got: vec![false; rounds],
            out: VecDeque::new(),
        };
        m.advance();
        m
    }

    fn advance(&mut self) {
        while self.next_send < self.got.len()
            && (self.next_send == 0 || self.got[self.next_send - 1])
        {
            let k = self.next_send;
            let h = Header {
                step: k as u32,
                ..Header::new(Kind::Barrier, Algo::Dissemination, self.seq)
            };
            let to = (self.rank + (1 << k)) % self.world;
            self.out.push_back((to, Message::new(h, &[])));
            self.next_send += 1;
        }
    }

    fn source(&self, k: usize) -> usize {
        (self.rank + self.world - (1 << k) % self.world) % self.world
    }
}

impl Machine for Barrier {
    fn handle(&mut self, from: usize, msg: Message) -> Result<(), AlgoError> {
        let h = *msg.header();
        check_header(from, &h, Kind::Barrier, Algo::Dissemination, Some(0))?;
        let k = h.step as usize;
        if k >= self.got.len() || from != self.source(k) || self.got[k] || !msg.payload().is_empty()
        {
            return Err(AlgoError::protocol(
                from,
                format!("unexpected barrier round {k}"),
            ));
        }
        self.got[k] = true;
        self.advance();
        Ok(())
    }

    fn poll_transmit(&mut self) -> Option<(usize, Message)> {
        self.out.pop_front()
    }

    fn is_done(&self) -> bool {
        self.got.iter().all(|&g| g) && self.next_send == self.got.len() && self.out.is_empty()
    }

    fn expects_from(&self, peer: usize) -> bool {
        (0..self.got.len()).any(|k| !self.got[k] && self.source(k) == peer)
    }
}
