//! Ring all-reduce (reduce-scatter then all-gather) and ring reduce-scatter, chunked and
//! pipelined.
//!
//! The `n` elements are split into `P` segments ([`segment_range`]), and each segment into
//! chunks of `chunk` elements. Rank `r` sends only to `right = r+1` and receives only from
//! `left = r−1` (mod P).
//!
//! * **Reduce-scatter**, steps `k = 0..P−1`: at step `k` rank `r` sends segment
//!   `(r − 1 − k) mod P`. At step 0 that is its own data; at step `k > 0` it is the partial
//!   sum it received at step `k − 1` plus its own data. Each chunk moves on as soon as it
//!   arrives, so chunks pipeline through the ring. After the last step rank `r` holds the
//!   fully reduced segment `r`.
//! * **All-gather**, steps `k = 0..P−1`: rank `r` sends segment `(r − k) mod P`; each chunk
//!   received is stored and forwarded unchanged until every rank has every segment.
//!
//! # Summation order (bit-identical results)
//! Segment `s` is reduced exactly once, along the ring starting at rank `s+1`:
//! `((x[s+1] ⊕ x[s+2]) ⊕ …) ⊕ x[s]` (ranks mod P, left to right), where `x[q]` is rank
//! `q`'s input. The result is then copied to every rank, so all ranks hold the same bits,
//! and rerunning with the same inputs and the same P gives the same bits regardless of
//! chunk size, timing or delivery order.

use std::collections::VecDeque;
use std::ops::Range;

use super::{
    check_chunk_len, check_header, chunk_count, segment_range, AlgoError, Machine, ReduceOp,
};
use crate::wire::{
    combine_f32_le, copy_f32_le, copy_f32_le_non_finite, has_non_finite, Algo, Header, Kind,
    Message,
};

const RS: u8 = 0;
const AG: u8 = 1;

/// Ring all-reduce or reduce-scatter over a borrowed buffer (see the [module docs](self)).
#[derive(Debug)]
pub struct Ring<'a> {
    rank: usize,
    world: usize,
    seq: u64,
    op: ReduceOp,
    kind: Kind,
    buf: &'a mut [f32],
    chunk: usize,
    /// `seen[phase][step][chunk]`.
    seen: [Vec<Vec<bool>>; 2],
    remaining: usize,
    /// Chunks of step 0 of the reduce-scatter, built lazily in `poll_transmit` so that the
    /// first is on the wire while the next are still being copied.
    own_chunks: usize,
    own_sent: usize,
    out: VecDeque<(usize, Message)>,
    /// `Some(k)` for [`Ring::all_reduce_mean`]: each fully reduced chunk is multiplied by
    /// `k` before it is stored and sent round, and every stored chunk is checked.
    mean: Option<f32>,
    /// Whether a stored chunk held a NaN or an infinity (averaging rings only).
    non_finite: bool,
}

impl<'a> Ring<'a> {
    /// All-reduce `buf` in place with `op` over `world` ranks, cutting segments into chunks
    /// of `chunk_elems` elements (0 is treated as 1).
    ///
    /// # Panics
    /// If `rank >= world`.
    pub fn all_reduce(
        rank: usize,
        world: usize,
        seq: u64,
        op: ReduceOp,
        buf: &'a mut [f32],
        chunk_elems: usize,
    ) -> Self {
        Self::new(rank, world, seq, op, op.kind(), buf, chunk_elems)
    }

    /// All-reduce `buf` to the average over the ranks: the sum in the documented order,
    /// then each element multiplied by `1/world` (as `f32`) — bit for bit
    /// [`Ring::all_reduce`] with [`ReduceOp::Sum`] followed by that product — and
    /// [`Ring::non_finite`] tells whether the average holds a NaN or an infinity. The
    /// product is taken where each chunk's sum is completed and the check where each chunk
    /// is stored, while the chunk is in cache: no pass over `buf` of their own. With one
    /// rank nothing is exchanged and `buf` is its own average (checked all the same).
    ///
    /// # Panics
    /// If `rank >= world`.
    pub fn all_reduce_mean(
        rank: usize,
        world: usize,
        seq: u64,
        buf: &'a mut [f32],
        chunk_elems: usize,
    ) -> Self {
        let mut m = Self::all_reduce(rank, world, seq, ReduceOp::Sum, buf, chunk_elems);
        m.mean = Some(1.0 / world as f32);
        if world == 1 {
            m.non_finite = has_non_finite(m.buf);
        }
        m
    }

    /// For a ring made by [`Ring::all_reduce_mean`], once done: whether the average holds
    /// a NaN or an infinity (a sum can overflow even when every rank's input is finite).
    /// Always `false` for the other kinds.
    pub fn non_finite(&self) -> bool {
        self.non_finite
    }

    /// Reduce-scatter (sum): on completion `buf[segment_range(n, world, rank)]` holds the
    /// sum of that segment over all ranks; the rest of `buf` is left unchanged.
    ///
    /// # Panics
    /// If `rank >= world`.
    pub fn reduce_scatter(
        rank: usize,
        world: usize,
        seq: u64,
        buf: &'a mut [f32],
        chunk_elems: usize,
    ) -> Self {
        Self::new(
            rank,
            world,
            seq,
            ReduceOp::Sum,
            Kind::ReduceScatter,
            buf,
            chunk_elems,
        )
    }

    fn new(
        rank: usize,
        world: usize,
        seq: u64,
        op: ReduceOp,
        kind: Kind,
        buf: &'a mut [f32],
        chunk_elems: usize,
    ) -> Self {
        assert!(rank < world, "rank {rank} out of range for world {world}");
        let mut m = Ring {
            rank,
            world,
            seq,
            op,
            kind,
            buf,
            chunk: chunk_elems.max(1),
            seen: [Vec::new(), Vec::new()],
            remaining: 0,
            own_chunks: 0,
            own_sent: 0,
            out: VecDeque::new(),
            mean: None,
            non_finite: false,
        };
        if world == 1 {
            return m;
        }
        let left = m.left();
        for phase in [RS, AG] {
            let steps = if phase == AG && kind == Kind::ReduceScatter {
                0
            } else {
                world - 1
            };
            for k in 0..steps {
                let seg = m.seg(m.seg_at(phase, left, k));
                let c = chunk_count(seg.len(), m.chunk);
                m.remaining += c;
                m.seen[phase as usize].push(vec![false; c]);
            }
        }
        let seg = m.seg(m.seg_at(RS, rank, 0));
        m.own_chunks = chunk_count(seg.len(), m.chunk);
        m
    }

    /// Gives the buffer back (the hierarchical all-reduce lends its buffer to a ring among
    /// the leaders and broadcasts the result afterwards).
    pub fn into_buf(self) -> &'a mut [f32] {
        self.buf
    }

    /// The `j`-th chunk of this rank's own data sent at step 0 of the reduce-scatter.
    fn own_chunk(&self, j: usize) -> Message {
        let seg = self.seg(self.seg_at(RS, self.rank, 0));
        let r = self.chunk_range(&seg, j);
        Message::from_f32(self.header(RS, 0, r.start), &self.buf[r])
    }

    fn left(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    fn right(&self) -> usize {
        (self.rank + 1) % self.world
    }

    fn seg(&self, s: usize) -> Range<usize> {
        segment_range(self.buf.len(), self.world, s)
    }

    /// The segment rank `q` sends at step `k` of `phase`.
    fn seg_at(&self, phase: u8, q: usize, k: usize) -> usize {
        let p = self.world;
        if phase == RS {
            (q + 2 * p - 1 - k) % p
        } else {
            (q + p - k) % p
        }
    }

    fn chunk_range(&self, seg: &Range<usize>, j: usize) -> Range<usize> {
        let start = seg.start + j * self.chunk;
        start..(start + self.chunk).min(seg.end)
    }

    fn header(&self, phase: u8, step: usize, offset: usize) -> Header {
        Header {
            phase,
            step: step as u32,
            count: self.buf.len() as u64,
            offset: offset as u64,
            ..Header::new(self.kind, Algo::Ring, self.seq)
        }
    }
}

impl Ring<'_> {
    /// Stores a final chunk (fully reduced, or received in the all-gather) into `buf`,
    /// checking it on an averaging ring.
    fn store(&mut self, range: Range<usize>, payload: &[u8]) {
        if self.mean.is_some() {
            self.non_finite |= copy_f32_le_non_finite(&mut self.buf[range], payload);
        } else {
            copy_f32_le(&mut self.buf[range], payload);
        }
    }
}

impl Machine for Ring<'_> {
    fn handle(&mut self, from: usize, mut msg: Message) -> Result<(), AlgoError> {
        // A driver that feeds a message before draining `poll_transmit` must not see the
        // own chunks read after the buffer changed: build the rest now (a no-op for
        // drivers that drain first, as they should).
        while self.own_sent < self.own_chunks {
            let m = self.own_chunk(self.own_sent);
            self.own_sent += 1;
            self.out.push_back((self.right(), m));
        }
        let h = *msg.header();
        check_header(from, &h, self.kind, Algo::Ring, Some(self.buf.len() as u64))?;
        if self.world == 1 || from != self.left() {
            return Err(AlgoError::protocol(
                from,
                format!(
                    "ring message from rank {from}, expected only rank {}",
                    self.left()
                ),
            ));
        }
        let (phase, step) = (h.phase, h.step as usize);
        let Some(seen) = self.seen.get(phase as usize).and_then(|s| s.get(step)) else {
            return Err(AlgoError::protocol(
                from,
                format!("unexpected ring phase {phase} step {step}"),
            ));
        };
        let seg = self.seg(self.seg_at(phase, from, step));
        let off = usize::try_from(h.offset).unwrap_or(usize::MAX);
        let rel = off
            .checked_sub(seg.start)
            .filter(|rel| rel % self.chunk == 0);
        let j = match rel {
            Some(rel) if rel / self.chunk < seen.len() => rel / self.chunk,
            _ => {
                return Err(AlgoError::protocol(
                    from,
                    format!("offset {off} is not a chunk of segment {seg:?}"),
                ))
            }
        };
        let range = self.chunk_range(&seg, j);
        check_chunk_len(from, off, msg.payload().len(), range.len())?;
        if self.seen[phase as usize][step][j] {
            return Err(AlgoError::protocol(
                from,
                format!("duplicate chunk phase {phase} step {step} offset {off}"),
            ));
        }
        self.seen[phase as usize][step][j] = true;
        self.remaining -= 1;
        let last = step == self.world - 2;
        // The received message is reduced into in place and forwarded: no allocation and
        // one pass over the chunk per step.
        if phase == RS {
            // payload = received ⊕ own (the documented order); for the average, the
            // completed sum times k in the same pass (two roundings, as sum then scale).
            match (self.mean, last) {
                (Some(k), true) => {
                    combine_f32_le(msg.payload_mut(), &self.buf[range.clone()], |a, b| {
                        (a + b) * k
                    })
                }
                _ => self
                    .op
                    .combine_into(msg.payload_mut(), &self.buf[range.clone()]),
            }
            if !last {
                let h = self.header(RS, step + 1, off);
                self.out.push_back((self.right(), msg.with_header(h)));
            } else {
                self.store(range, msg.payload());
                if self.kind != Kind::ReduceScatter {
                    let h = self.header(AG, 0, off);
                    self.out.push_back((self.right(), msg.with_header(h)));
                }
            }
        } else {
            self.store(range, msg.payload());
            if !last {
                let h = self.header(AG, step + 1, off);
                self.out.push_back((self.right(), msg.with_header(h)));
            }
        }
        Ok(())
    }

    fn poll_transmit(&mut self) -> Option<(usize, Message)> {
        if let Some(m) = self.out.pop_front() {
            return Some(m);
        }
        (self.own_sent < self.own_chunks).then(|| {
            self.own_sent += 1;
            (self.right(), self.own_chunk(self.own_sent - 1))
        })
    }

    fn is_done(&self) -> bool {
        self.remaining == 0 && self.out.is_empty() && self.own_sent == self.own_chunks
    }

    fn expects_from(&self, peer: usize) -> bool {
        self.remaining > 0 && peer == self.left()
    }
}
