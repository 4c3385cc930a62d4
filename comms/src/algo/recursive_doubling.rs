//! Recursive-doubling all-reduce for small messages (latency-bound: ⌈log2 P⌉ rounds of one
//! whole-buffer exchange instead of the ring's 2(P−1) steps).
//!
//! Let `P2` be the largest power of two ≤ P. Ranks `r ≥ P2` first send their data to
//! `r − P2` (fold-in) and at the end receive the result back (fold-out). Among the first
//! `P2` ranks, round `k` exchanges the current value with partner `r XOR 2^k`.
//!
//! # Summation order (bit-identical results)
//! Every combination is computed as `lower-rank operand ⊕ higher-rank operand`, and both
//! partners of a round compute it from the same two operands, so all ranks hold the same
//! bits. The result is the balanced binary tree over the leaves `L[i]` in rank order:
//! `L[i] = x[i] ⊕ x[i+P2]` for `i < P − P2`, else `x[i]`; then
//! `T(L[a..b]) = T(L[a..m]) ⊕ T(L[m..b])` with `m` the midpoint.

use std::collections::VecDeque;

use super::{check_header, AlgoError, Machine, ReduceOp};
use crate::wire::{f32s, Algo, Header, Message};

const FOLD_IN: u8 = 0;
const ROUND: u8 = 1;
const FOLD_OUT: u8 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// A rank ≥ P2 waiting for its result.
    Extra,
    /// Waiting for the fold-in partner.
    Fold,
    /// In round `k`.
    Round(usize),
    Done,
}

/// Recursive-doubling all-reduce over a borrowed buffer (see the [module docs](self)).
#[derive(Debug)]
pub struct RecursiveDoubling<'a> {
    rank: usize,
    world: usize,
    seq: u64,
    op: ReduceOp,
    buf: &'a mut [f32],
    p2: usize,
    rounds: usize,
    stage: Stage,
    sent_round: bool,
    val: Vec<f32>,
    fold: Option<Vec<f32>>,
    fold_received: bool,
    got: Vec<Option<Vec<f32>>>,
    received: Vec<bool>,
    out: VecDeque<(usize, Message)>,
}

impl<'a> RecursiveDoubling<'a> {
    /// All-reduce `buf` in place with `op` over `world` ranks.
    ///
    /// # Panics
    /// If `rank >= world`.
    pub fn new(rank: usize, world: usize, seq: u64, op: ReduceOp, buf: &'a mut [f32]) -> Self {
        assert!(rank < world, "rank {rank} out of range for world {world}");
        let p2 = 1usize << (usize::BITS - 1 - world.leading_zeros());
        let rounds = p2.trailing_zeros() as usize;
        let mut m = RecursiveDoubling {
            rank,
            world,
            seq,
            op,
            val: buf.to_vec(),
            buf,
            p2,
            rounds,
            stage: if rank >= p2 {
                Stage::Extra
            } else {
                Stage::Fold
            },
            sent_round: false,
            fold: None,
            fold_received: false,
            got: vec![None; rounds],
            received: vec![false; rounds],
            out: VecDeque::new(),
        };
        if rank >= p2 {
            let msg = Message::from_f32(m.header(FOLD_IN, 0), m.buf);
            m.out.push_back((rank - p2, msg));
        }
        m.advance();
        m
    }

    /// Gives the buffer back (see [`super::ring::Ring::into_buf`]).
    pub fn into_buf(self) -> &'a mut [f32] {
        self.buf
    }

    fn header(&self, phase: u8, step: usize) -> Header {
        Header {
            phase,
            step: step as u32,
            count: self.buf.len() as u64,
            ..Header::new(self.op.kind(), Algo::RecursiveDoubling, self.seq)
        }
    }

    fn has_fold(&self) -> bool {
        self.rank < self.p2 && self.rank + self.p2 < self.world
    }

    fn advance(&mut self) {
        let op = self.op;
        loop {
            match self.stage {
                Stage::Extra | Stage::Done => return,
                Stage::Fold => {
                    if self.has_fold() {
                        let Some(x) = self.fold.take() else { return };
                        for (v, x) in self.val.iter_mut().zip(x) {
                            *v = op.apply(*v, x);
                        }
                    }
                    self.stage = Stage::Round(0);
                    self.sent_round = false;
                }
                Stage::Round(k) if k < self.rounds => {
                    let partner = self.rank ^ (1 << k);
                    if !self.sent_round {
                        let msg = Message::from_f32(self.header(ROUND, k), &self.val);
                        self.out.push_back((partner, msg));
                        self.sent_round = true;
                    }
                    let Some(x) = self.got[k].take() else { return };
                    let lower_first = partner > self.rank;
                    for (v, x) in self.val.iter_mut().zip(x) {
                        *v = if lower_first {
                            op.apply(*v, x)
                        } else {
                            op.apply(x, *v)
                        };
                    }
                    self.stage = Stage::Round(k + 1);
                    self.sent_round = false;
                }
                Stage::Round(_) => {
                    if self.has_fold() {
                        let msg = Message::from_f32(self.header(FOLD_OUT, 0), &self.val);
                        self.out.push_back((self.rank + self.p2, msg));
                    }
                    self.buf.copy_from_slice(&self.val);
                    self.stage = Stage::Done;
                }
            }
        }
    }
}

impl Machine for RecursiveDoubling<'_> {
    fn handle(&mut self, from: usize, msg: Message) -> Result<(), AlgoError> {
        let h = *msg.header();
        let n = self.buf.len();
        check_header(
            from,
            &h,
            self.op.kind(),
            Algo::RecursiveDoubling,
            Some(n as u64),
        )?;
        if msg.payload().len() != n * 4 {
            return Err(AlgoError::protocol(
                from,
                "payload length differs from the element count",
            ));
        }
        let vals: Vec<f32> = f32s(msg.payload())
            .map_err(|e| AlgoError::wire(from, e))?
            .collect();
        let step = h.step as usize;
        let unexpected = || {
            AlgoError::protocol(
                from,
                format!(
                    "unexpected recursive-doubling phase {} step {step}",
                    h.phase
                ),
            )
        };
        match h.phase {
            FOLD_IN if self.has_fold() && from == self.rank + self.p2 && !self.fold_received => {
                self.fold_received = true;
                self.fold = Some(vals);
            }
            ROUND
                if self.rank < self.p2
                    && step < self.rounds
                    && from == self.rank ^ (1 << step)
                    && !self.received[step] =>
            {
                self.received[step] = true;
                self.got[step] = Some(vals);
            }
            FOLD_OUT if self.stage == Stage::Extra && from + self.p2 == self.rank => {
                self.buf.copy_from_slice(&vals);
                self.stage = Stage::Done;
            }
            _ => return Err(unexpected()),
        }
        self.advance();
        Ok(())
    }

    fn poll_transmit(&mut self) -> Option<(usize, Message)> {
        self.out.pop_front()
    }

    fn is_done(&self) -> bool {
        self.stage == Stage::Done && self.out.is_empty()
    }

    fn expects_from(&self, peer: usize) -> bool {
        if self.stage == Stage::Extra {
            return peer + self.p2 == self.rank;
        }
        if self.has_fold() && !self.fold_received && peer == self.rank + self.p2 {
            return true;
        }
        (0..self.rounds).any(|k| !self.received[k] && peer == self.rank ^ (1 << k))
    }
}
