//! Sparse all-reduce (sum): every rank contributes a sparse vector of the same dimension
//! `n` and every rank gets their exact sum, with receive volume that follows the size of the
//! *sum*, not P times the size of the inputs (as an all-gather of the inputs would).
//!
//! The index space `[0, n)` is split into `P` segments ([`segment_range`]); rank `r` owns
//! segment `r`. Each segment is cut into chunks of `chunk` elements (at least one chunk per
//! segment, even an empty one), and every message carries one chunk, encoded as
//! (index, value) pairs or densely, whichever is smaller ([`crate::sparse`]: the switch
//! happens once `nnz · 8 ≥ len · 4` bytes).
//!
//! 1. **Scatter** (phase 0): rank `r` sends every other rank `q` its entries in each chunk of
//!    segment `q` (one message per chunk, possibly empty).
//! 2. **Reduce**: once the owner has every peer's share of one of its chunks, it sums the
//!    chunk (order below) and
//! 3. **Gather** (phase 1): sends the reduced chunk to every other rank.
//!
//! Every rank then holds every reduced chunk; [`SparseAllReduce::into_sparse`] and
//! [`SparseAllReduce::write_dense`] assemble them. Each entry travels at most twice (once to
//! its owner, once per receiver of the sum), and all messages of a phase go out at once (two
//! latencies in all), at the price of `2(P−1)` messages per rank per chunk column, which suits
//! the moderate P of data-parallel training.
//!
//! # Summation order (bit-identical results)
//! For every index `i`, its owner computes `s_i = (((+0.0 + x_0[i]) + x_1[i]) + …) + x_{P−1}[i]`,
//! where `x_q` is rank `q`'s input made dense (absent entries `+0.0`): **rank order 0..P−1,
//! starting from `+0.0`**, whatever order the shares arrive in (the owner keeps them until
//! all of a chunk's shares are in). Since the accumulator starts at `+0.0` it can never be
//! `−0.0`, so adding an absent entry is an exact no-op: summing only the stored entries (or
//! the dense chunks the encoding switch sends) gives the same bits as that dense sum. The
//! owner's bits are copied to every rank, so every rank holds the same result, and the same
//! inputs on the same P give the same bits regardless of chunk size, encodings, timing or
//! delivery order.
//!
//! The sparse result lists exactly the indices whose sum is not `+0.0` (sums that cancel
//! to zero are dropped), so it is the same whichever encoding carried a chunk.
//!
//! # Wire
//! Header: kind [`Kind::SparseAllReduce`], algorithm [`Algo::Direct`], `count = n` (so
//! ranks with different dimensions report a mismatch), `phase` 0 (share) or 1 (reduced
//! chunk), `root` = the owner of the chunk's segment (the receiver of a share, the sender of
//! a reduced chunk), `offset` = the chunk's first index. Payload: one chunk
//! ([`crate::sparse`]). Every field is checked against what this rank expects from that
//! peer; anything else is an [`AlgoError`], never a panic.

use std::collections::VecDeque;
use std::ops::Range;

use super::{check_header, chunk_count, segment_range, AlgoError, Machine};
use crate::sparse::{decode_chunk, encode_entries, Chunk, SparseSlice, SparseVec};
use crate::wire::{Algo, Header, Kind, Message};

const SHARE: u8 = 0;
const REDUCED: u8 = 1;

/// Sparse all-reduce of a borrowed sparse vector (see the [module docs](self)). The result
/// is taken with [`SparseAllReduce::into_sparse`] or [`SparseAllReduce::write_dense`].
#[derive(Debug)]
pub struct SparseAllReduce<'a> {
    rank: usize,
    world: usize,
    seq: u64,
    input: SparseSlice<'a>,
    chunk: usize,
    /// `shares[c][q]`: rank `q`'s share of chunk `c` of this rank's segment, until reduced.
    shares: Vec<Vec<Option<Chunk>>>,
    /// Per chunk of this rank's segment: peers' shares still missing.
    shares_missing: Vec<usize>,
    /// `reduced[q][c]`: the sum over chunk `c` of segment `q`.
    reduced: Vec<Vec<Option<Chunk>>>,
    /// Per peer: messages still expected from it (its shares plus its reduced chunks).
    missing: Vec<usize>,
    total_missing: usize,
    /// The next share to send: chunk `.1` of the segment of rank `rank + .0`.
    next_share: (usize, usize),
    out: VecDeque<(usize, Message)>,
}

impl<'a> SparseAllReduce<'a> {
    /// Sums `input` over `world` ranks; chunks are `chunk_elems` elements (0 is treated as
    /// 1). Every rank must pass the same dimension and chunk size.
    ///
    /// # Panics
    /// If `rank >= world`.
    pub fn new(
        rank: usize,
        world: usize,
        seq: u64,
        input: SparseSlice<'a>,
        chunk_elems: usize,
    ) -> Self {
        assert!(rank < world, "rank {rank} out of range for world {world}");
        let mut m = SparseAllReduce {
            rank,
            world,
            seq,
            input,
            chunk: chunk_elems.max(1),
            shares: Vec::new(),
            shares_missing: Vec::new(),
            reduced: Vec::new(),
            missing: vec![0; world],
            total_missing: 0,
            next_share: (1, 0),
            out: VecDeque::new(),
        };
        m.reduced = (0..world).map(|q| vec![None; m.chunks(q)]).collect();
        let mine = m.chunks(rank);
        m.shares = vec![vec![None; world]; mine];
        m.shares_missing = vec![world - 1; mine];
        for q in (0..world).filter(|&q| q != rank) {
            m.missing[q] = mine + m.chunks(q);
            m.total_missing += m.missing[q];
        }
        if world == 1 {
            for c in 0..mine {
                m.reduce(c);
            }
        }
        m
    }

    fn seg(&self, q: usize) -> Range<usize> {
        segment_range(self.input.dim(), self.world, q)
    }

    fn chunks(&self, q: usize) -> usize {
        chunk_count(self.seg(q).len(), self.chunk)
    }

    fn chunk_range(&self, q: usize, c: usize) -> Range<usize> {
        let seg = self.seg(q);
        let start = seg.start + c * self.chunk;
        start..(start + self.chunk).min(seg.end)
    }

    fn header(&self, phase: u8, owner: usize, offset: usize) -> Header {
        Header {
            phase,
            count: self.input.dim() as u64,
            offset: offset as u64,
            root: owner as u32,
            ..Header::new(Kind::SparseAllReduce, Algo::Direct, self.seq)
        }
    }

    /// The chunk of segment `q` that starts at `offset`.
    fn chunk_at(&self, from: usize, q: usize, offset: u64) -> Result<usize, AlgoError> {
        let seg = self.seg(q);
        let off = usize::try_from(offset).unwrap_or(usize::MAX);
        off.checked_sub(seg.start)
            .filter(|rel| rel % self.chunk == 0 && rel / self.chunk < self.chunks(q))
            .map(|rel| rel / self.chunk)
            .ok_or_else(|| {
                AlgoError::protocol(
                    from,
                    format!("offset {off} is not a chunk of segment {q} ({seg:?})"),
                )
            })
    }

    /// Sums chunk `c` of this rank's segment in rank order and sends it to every peer.
    fn reduce(&mut self, c: usize) {
        let range = self.chunk_range(self.rank, c);
        let mut shares: Vec<Option<Chunk>> = self.shares[c].iter_mut().map(Option::take).collect();
        let own = self.input.entries_in(&range);
        let stored: usize = own.0.len() + shares.iter().flatten().map(Chunk::stored).sum::<usize>();
        let all_pairs = shares
            .iter()
            .flatten()
            .all(|s| matches!(s, Chunk::Pairs { .. }));
        // Both ways add the same values in the same order from +0.0, so they give the same
        // bits; merging the sorted lists avoids a pass over the whole chunk when it is sparse.
        let sum = if all_pairs && stored.saturating_mul(self.world) <= 4 * range.len() {
            let lists: Vec<(&[u32], &[f32])> = (0..self.world)
                .map(|q| match &shares[q] {
                    _ if q == self.rank => own,
                    Some(Chunk::Pairs { indices, values }) => (&indices[..], &values[..]),
                    _ => (&[][..], &[][..]),
                })
                .collect();
            let (idx, vals) = merge_in_rank_order(&lists);
            Chunk::from_entries(&range, idx, vals)
        } else {
            let mut acc = vec![0.0f32; range.len()];
            for (q, share) in shares.iter_mut().enumerate() {
                if q == self.rank {
                    for (&i, &v) in own.0.iter().zip(own.1) {
                        acc[i as usize - range.start] += v;
                    }
                } else if let Some(share) = share.take() {
                    share.add_to(&mut acc, range.start);
                }
            }
            Chunk::from_sum(range.start, acc)
        };
        if self.world > 1 {
            let msg = sum.to_message(self.header(REDUCED, self.rank, range.start), &range);
            for s in 1..self.world - 1 {
                self.out
                    .push_back(((self.rank + s) % self.world, msg.clone()));
            }
            self.out
                .push_back(((self.rank + self.world - 1) % self.world, msg));
        }
        self.reduced[self.rank][c] = Some(sum);
    }

    fn done_chunks(&self) -> impl Iterator<Item = (usize, &Chunk)> + '_ {
        (0..self.world).flat_map(move |q| {
            self.reduced[q]
                .iter()
                .enumerate()
                .map(move |(c, ch)| (self.chunk_range(q, c).start, ch))
                .filter_map(|(base, ch)| Some((base, ch.as_ref()?)))
        })
    }

    /// The sum as a sparse vector of the same dimension: the indices whose sum is not
    /// `+0.0`, in increasing order.
    ///
    /// # Panics
    /// If the machine is not done.
    pub fn into_sparse(self) -> SparseVec {
        assert!(self.total_missing == 0, "sparse all-reduce not complete");
        let cap: usize = self.done_chunks().map(|(_, ch)| ch.stored()).sum();
        let (mut idx, mut vals) = (Vec::with_capacity(cap), Vec::with_capacity(cap));
        for (base, ch) in self.done_chunks() {
            ch.push_nonzero(base, &mut idx, &mut vals);
        }
        // Every chunk was built here or validated on receipt (indices strictly increasing
        // inside the chunk), and the chunks are visited in index order.
        SparseVec::from_valid_parts(self.input.dim(), idx, vals)
    }

    /// Writes the sum densely into `out` (every element is overwritten).
    ///
    /// # Panics
    /// If the machine is not done, or `out.len()` is not the dimension.
    pub fn write_dense(&self, out: &mut [f32]) {
        assert!(self.total_missing == 0, "sparse all-reduce not complete");
        assert_eq!(out.len(), self.input.dim(), "output length");
        for q in 0..self.world {
            for (c, ch) in self.reduced[q].iter().enumerate() {
                let r = self.chunk_range(q, c);
                if let Some(ch) = ch {
                    ch.write_dense(&mut out[r.clone()], r.start);
                }
            }
        }
    }
}

/// The sum of sorted sparse lists, given in rank order: for every index present in any list,
/// `+0.0` plus the lists' values in list order; indices whose sum is `+0.0` are left out.
fn merge_in_rank_order(lists: &[(&[u32], &[f32])]) -> (Vec<u32>, Vec<f32>) {
    let cap = lists.iter().map(|l| l.0.len()).max().unwrap_or(0);
    let (mut idx, mut vals) = (Vec::with_capacity(cap), Vec::with_capacity(cap));
    let mut pos = vec![0usize; lists.len()];
    loop {
        let next = lists
            .iter()
            .zip(&pos)
            .filter_map(|(l, &p)| l.0.get(p))
            .min();
        let Some(&i) = next else { break };
        let mut acc = 0.0f32;
        for (l, p) in lists.iter().zip(pos.iter_mut()) {
            if l.0.get(*p) == Some(&i) {
                acc += l.1[*p];
                *p += 1;
            }
        }
        if acc.to_bits() != 0 {
            idx.push(i);
            vals.push(acc);
        }
    }
    (idx, vals)
}

impl Machine for SparseAllReduce<'_> {
    fn handle(&mut self, from: usize, msg: Message) -> Result<(), AlgoError> {
        let h = *msg.header();
        check_header(
            from,
            &h,
            Kind::SparseAllReduce,
            Algo::Direct,
            Some(self.input.dim() as u64),
        )?;
        if from >= self.world || from == self.rank {
            return Err(AlgoError::protocol(
                from,
                format!("sparse all-reduce message from rank {from}, not a peer"),
            ));
        }
        match h.phase {
            SHARE => {
                if h.root as usize != self.rank {
                    return Err(AlgoError::protocol(
                        from,
                        format!("share of segment {} sent to rank {}", h.root, self.rank),
                    ));
                }
                let c = self.chunk_at(from, self.rank, h.offset)?;
                if self.shares_missing[c] == 0 || self.shares[c][from].is_some() {
                    return Err(AlgoError::protocol(
                        from,
                        format!("duplicate share of chunk at {}", h.offset),
                    ));
                }
                let range = self.chunk_range(self.rank, c);
                let share =
                    decode_chunk(msg.payload(), &range).map_err(|e| AlgoError::wire(from, e))?;
                self.shares[c][from] = Some(share);
                self.shares_missing[c] -= 1;
                self.missing[from] -= 1;
                self.total_missing -= 1;
                if self.shares_missing[c] == 0 {
                    self.reduce(c);
                }
            }
            REDUCED => {
                if h.root as usize != from {
                    return Err(AlgoError::protocol(
                        from,
                        format!("reduced chunk of segment {} sent by rank {from}", h.root),
                    ));
                }
                let c = self.chunk_at(from, from, h.offset)?;
                if self.reduced[from][c].is_some() {
                    return Err(AlgoError::protocol(
                        from,
                        format!("duplicate reduced chunk at {}", h.offset),
                    ));
                }
                let range = self.chunk_range(from, c);
                let sum =
                    decode_chunk(msg.payload(), &range).map_err(|e| AlgoError::wire(from, e))?;
                self.reduced[from][c] = Some(sum);
                self.missing[from] -= 1;
                self.total_missing -= 1;
            }
            other => {
                return Err(AlgoError::protocol(
                    from,
                    format!("unexpected sparse all-reduce phase {other}"),
                ))
            }
        }
        Ok(())
    }

    fn poll_transmit(&mut self) -> Option<(usize, Message)> {
        if let Some(m) = self.out.pop_front() {
            return Some(m);
        }
        // Shares are cut lazily from the borrowed input, peers in the order rank+1, rank+2, …
        while self.next_share.0 < self.world {
            let (s, c) = self.next_share;
            let q = (self.rank + s) % self.world;
            if c < self.chunks(q) {
                self.next_share.1 += 1;
                let range = self.chunk_range(q, c);
                let (idx, vals) = self.input.entries_in(&range);
                let h = self.header(SHARE, q, range.start);
                return Some((q, encode_entries(h, &range, idx, vals)));
            }
            self.next_share = (s + 1, 0);
        }
        None
    }

    fn is_done(&self) -> bool {
        self.total_missing == 0 && self.out.is_empty() && self.next_share.0 >= self.world
    }

    fn expects_from(&self, peer: usize) -> bool {
        self.missing.get(peer).is_some_and(|&m| m > 0)
    }
}
