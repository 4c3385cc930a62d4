//! Hierarchical all-reduce (sum): the ranks of each host reduce to their host's leader, the
//! leaders all-reduce the host sums across the network, and each leader broadcasts the
//! result on its host. This is Horovod's hierarchical all-reduce (a reduce within the node,
//! an all-reduce among one rank per node, a broadcast within the node; Sergeev & Del Balso,
//! 2018) and the shape of NCCL's tree-within / ring-across; the code follows neither, only
//! the idea. The grouping is a [`Topology`]; the leader of a host is its lowest rank.
//!
//! 1. **Reduce** (host-local, phase 0): a pipelined chain from the host's highest rank down
//!    to its leader. The last member sends its buffer; every member in between adds its own
//!    values to each chunk it receives and passes it on; the leader adds its own last. Every
//!    member sends its buffer's bytes once.
//! 2. **Across hosts** (leaders only): the flat all-reduce of the host sums among the `M`
//!    leaders — the ring ([`super::ring`]) or, for buffers the [`crate::Communicator`] sends
//!    by recursive doubling, [`super::recursive_doubling`] — with the leaders numbered in
//!    host order. Only these messages cross between hosts, so each leader sends exactly what
//!    it would send in a flat all-reduce of `M` ranks: `2(M−1)/M` of the buffer for the ring.
//! 3. **Broadcast** (host-local, phase 1): a pipelined chain from the leader up to the
//!    host's highest rank; every member but the last forwards each chunk as it arrives.
//!
//! # Summation order (bit-identical results)
//! With host `h`'s members `m₀ < m₁ < … < m_{k−1}` (`m₀` its leader), its host sum is
//! `H_h = ((x[m_{k−1}] ⊕ x[m_{k−2}]) ⊕ …) ⊕ x[m₀]`, and the result is the flat all-reduce of
//! `M` ranks whose inputs are `H₀ … H_{M−1}` (in the ring's order of [`super::ring`] for the
//! leaders, or its recursive-doubling tree). Every rank ends with those bits, and the same
//! inputs and topology give the same bits whatever the chunking, timing or delivery order.
//! With one rank per host this **is** the flat all-reduce, bit for bit; with one host it is
//! the host sum.
//!
//! It is not the flat ring's sum when a host has two ranks or more and there are two hosts
//! or more, and no algorithm that sends only the leaders' ring traffic across hosts can make
//! it so. The flat ring folds segment `s` left to right over the ranks in ring order from
//! `s + 1` (`((x[s+1] ⊕ x[s+2]) ⊕ …) ⊕ x[s]`): a chain that adds one rank at a time to a
//! running sum. Reproducing that fold for an element needs the running sum and each rank's
//! own value at the moment that rank's turn comes; a host that pre-adds two of its ranks'
//! values rounds once where the chain rounds twice, so the only way to keep the fold is to
//! carry the running sum through every host in ring order and back to the host where the
//! fold started — one crossing more per element than the leaders' ring makes for all but
//! the segments that start on a host boundary. The hierarchy therefore defines its own
//! order (above) and is tested bit for bit against it, and against the flat ring wherever
//! the two orders must agree: one rank per host, and sums that are exact in f32.
//!
//! # Wire
//! Host-local messages: kind [`Kind::AllReduceSum`], algorithm [`Algo::Hierarchical`],
//! `phase` 0 (reduce) or 1 (broadcast), `count` the buffer's element count, `offset` the
//! chunk's element offset, `root` the number of hosts (ranks grouped differently report a
//! mismatch). The leaders' messages are those of the ring or of recursive doubling. Every
//! message is checked against what this rank expects from that peer; anything else is an
//! [`AlgoError`], never a panic.

use std::collections::VecDeque;
use std::ops::Range;

use super::recursive_doubling::RecursiveDoubling;
use super::ring::Ring;
use super::{check_chunk_len, check_header, chunk_count, AlgoError, Machine, ReduceOp};
use crate::topology::Topology;
use crate::wire::{copy_f32_le, Algo, Header, Kind, Message};

const REDUCE: u8 = 0;
const BCAST: u8 = 1;

/// The leaders' all-reduce, in leader numbering (host order).
enum Inner<'a> {
    Ring(Ring<'a>),
    Doubling(RecursiveDoubling<'a>),
}

impl<'a> Inner<'a> {
    fn machine(&mut self) -> &mut dyn Machine {
        match self {
            Inner::Ring(m) => m,
            Inner::Doubling(m) => m,
        }
    }

    fn is_done(&self) -> bool {
        match self {
            Inner::Ring(m) => m.is_done(),
            Inner::Doubling(m) => m.is_done(),
        }
    }

    fn expects_from(&self, leader: usize) -> bool {
        match self {
            Inner::Ring(m) => m.expects_from(leader),
            Inner::Doubling(m) => m.expects_from(leader),
        }
    }

    fn into_buf(self) -> &'a mut [f32] {
        match self {
            Inner::Ring(m) => m.into_buf(),
            Inner::Doubling(m) => m.into_buf(),
        }
    }
}

/// Hierarchical all-reduce (sum) over a borrowed buffer (see the [module docs](self)).
pub struct Hierarchical<'a> {
    rank: usize,
    seq: u64,
    /// Elements of the buffer (`buf` is empty while the leaders' all-reduce holds it).
    n: usize,
    chunk: usize,
    chunks: usize,
    hosts: usize,
    /// This rank's host's members, ascending, and this rank's position among them.
    members: Vec<usize>,
    pos: usize,
    /// Every host's leader, in host order.
    leaders: Vec<usize>,
    /// Whether the leaders use recursive doubling (small buffers) instead of the ring.
    small: bool,
    buf: &'a mut [f32],
    /// Reduce chunks received (from the next member up the chain).
    reduce_seen: Vec<bool>,
    reduce_left: usize,
    /// Reduce chunks of this rank's own buffer handed out (the host's last member only).
    own_sent: usize,
    inner: Option<Inner<'a>>,
    /// Leaders' messages (by leader position) that came before this leader's host sum was
    /// complete.
    early: Vec<(usize, Message)>,
    across_done: bool,
    /// Broadcast chunks received (from the previous member down the chain).
    bcast_seen: Vec<bool>,
    bcast_left: usize,
    /// The leader's broadcast chunks handed out (`None` until the result is there).
    bcast_sent: Option<usize>,
    out: VecDeque<(usize, Message)>,
}

impl std::fmt::Debug for Hierarchical<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hierarchical")
            .field("rank", &self.rank)
            .field("seq", &self.seq)
            .field("members", &self.members)
            .field("leaders", &self.leaders)
            .field("reduce_left", &self.reduce_left)
            .field("across_done", &self.across_done)
            .field("bcast_left", &self.bcast_left)
            .finish_non_exhaustive()
    }
}

impl<'a> Hierarchical<'a> {
    /// All-reduce (sum) `buf` in place over the ranks of `topology`, cutting it into chunks
    /// of `chunk_elems` elements (0 is treated as 1); the leaders use recursive doubling when
    /// `small`, else the ring.
    ///
    /// # Panics
    /// If `rank >= topology.world()`.
    pub fn new(
        rank: usize,
        topology: &Topology,
        seq: u64,
        buf: &'a mut [f32],
        chunk_elems: usize,
        small: bool,
    ) -> Self {
        assert!(
            rank < topology.world(),
            "rank {rank} out of range for world {}",
            topology.world()
        );
        let members = topology.members(topology.host_of(rank)).to_vec();
        let pos = members
            .iter()
            .position(|&m| m == rank)
            .expect("a rank is a member of its host");
        let chunk = chunk_elems.max(1);
        let n = buf.len();
        let chunks = chunk_count(n, chunk);
        let last = pos + 1 == members.len();
        let mut m = Hierarchical {
            rank,
            seq,
            n,
            chunk,
            chunks,
            hosts: topology.hosts(),
            pos,
            leaders: topology.leaders(),
            small,
            buf,
            reduce_seen: vec![false; if last { 0 } else { chunks }],
            reduce_left: if last { 0 } else { chunks },
            own_sent: 0,
            inner: None,
            early: Vec::new(),
            across_done: false,
            bcast_seen: vec![false; if pos == 0 { 0 } else { chunks }],
            bcast_left: if pos == 0 { 0 } else { chunks },
            bcast_sent: None,
            out: VecDeque::new(),
            members,
        };
        if m.pos == 0 && m.reduce_left == 0 {
            // A leader alone on its host: its buffer is its host sum.
            m.start_across()
                .expect("no early message to feed before the first handle");
        }
        m
    }

    fn is_last(&self) -> bool {
        self.pos + 1 == self.members.len()
    }

    fn range(&self, j: usize) -> Range<usize> {
        let start = j * self.chunk;
        start.min(self.n)..(start + self.chunk).min(self.n)
    }

    fn header(&self, phase: u8, offset: usize) -> Header {
        Header {
            phase,
            count: self.n as u64,
            offset: offset as u64,
            root: self.hosts as u32,
            ..Header::new(Kind::AllReduceSum, Algo::Hierarchical, self.seq)
        }
    }

    /// The `j`-th chunk of this rank's buffer with `phase`'s header.
    fn chunk_msg(&self, phase: u8, j: usize) -> Message {
        let r = self.range(j);
        Message::from_f32(self.header(phase, r.start), &self.buf[r])
    }

    /// The host sum is complete on this leader: start the leaders' all-reduce (and feed it
    /// what the other leaders sent early), or, alone, go straight to the broadcast.
    fn start_across(&mut self) -> Result<(), AlgoError> {
        let m = self.leaders.len();
        if m == 1 {
            self.finish_across();
            return Ok(());
        }
        let me = self
            .leader_index(self.rank)
            .expect("a host's first member is its leader");
        let buf = std::mem::take(&mut self.buf);
        let (seq, chunk) = (self.seq, self.chunk);
        let mut inner = if self.small {
            Inner::Doubling(RecursiveDoubling::new(me, m, seq, ReduceOp::Sum, buf))
        } else {
            Inner::Ring(Ring::all_reduce(me, m, seq, ReduceOp::Sum, buf, chunk))
        };
        for (l, msg) in std::mem::take(&mut self.early) {
            inner.machine().handle(l, msg).map_err(|e| self.global(e))?;
        }
        self.inner = Some(inner);
        self.finish_across();
        Ok(())
    }

    /// Once the leaders' all-reduce is done (every message handed out): the buffer holds the
    /// result; start the host's broadcast.
    fn finish_across(&mut self) {
        let done = match &self.inner {
            Some(inner) => inner.is_done(),
            None => self.leaders.len() == 1 && self.pos == 0 && self.reduce_left == 0,
        };
        if !done || self.across_done {
            return;
        }
        if let Some(inner) = self.inner.take() {
            self.buf = inner.into_buf();
        }
        self.across_done = true;
        self.bcast_sent = Some(if self.members.len() > 1 {
            0
        } else {
            self.chunks
        });
    }

    /// A leader's position in host order (`None`: `rank` leads no host).
    fn leader_index(&self, rank: usize) -> Option<usize> {
        self.leaders.iter().position(|&l| l == rank)
    }

    /// An inner machine's error, which names a leader by its position, as a global rank.
    fn global(&self, e: AlgoError) -> AlgoError {
        let peer = self.leaders.get(e.peer()).copied().unwrap_or(e.peer());
        match e {
            AlgoError::Mismatch { detail, .. } => AlgoError::Mismatch { peer, detail },
            AlgoError::Protocol { detail, .. } => AlgoError::Protocol { peer, detail },
        }
    }

    /// A message of the leaders' all-reduce from `from`.
    fn handle_across(&mut self, from: usize, msg: Message) -> Result<(), AlgoError> {
        let algo = msg.header().algo;
        let (Some(l), 0) = (self.leader_index(from), self.pos) else {
            // Only leaders talk ring or recursive doubling to leaders: the peer runs a flat
            // all-reduce, or groups the ranks differently.
            return Err(AlgoError::Mismatch {
                peer: from,
                detail: format!(
                    "peer sent an all-reduce message of algorithm {algo:?} to rank {}; in this \
                     rank's hierarchical all-reduce over {} hosts only the leaders {:?} \
                     exchange those",
                    self.rank, self.hosts, self.leaders
                ),
            });
        };
        if self.across_done {
            return Err(AlgoError::protocol(
                from,
                "a message of the leaders' all-reduce after it finished",
            ));
        }
        match &mut self.inner {
            Some(inner) => {
                let r = inner.machine().handle(l, msg);
                r.map_err(|e| self.global(e))?;
                self.finish_across();
            }
            None => {
                // At most what the other leaders can send before they need this one's sum
                // (their first step of every chunk), with room to spare.
                let cap = 2 * self.leaders.len() * (self.chunks + 2);
                if self.early.len() >= cap {
                    return Err(AlgoError::protocol(
                        from,
                        format!("more than {cap} leaders' messages before this host's sum"),
                    ));
                }
                self.early.push((l, msg));
            }
        }
        Ok(())
    }

    /// A host-local message (reduce or broadcast chunk) from `from`.
    fn handle_local(&mut self, from: usize, mut msg: Message) -> Result<(), AlgoError> {
        let h = *msg.header();
        check_header(
            from,
            &h,
            Kind::AllReduceSum,
            Algo::Hierarchical,
            Some(self.n as u64),
        )?;
        if h.root as usize != self.hosts {
            return Err(AlgoError::Mismatch {
                peer: from,
                detail: format!(
                    "peer groups the ranks into {} hosts, this rank into {}",
                    h.root, self.hosts
                ),
            });
        }
        let expected_from = match h.phase {
            REDUCE if !self.is_last() => self.members[self.pos + 1],
            BCAST if self.pos > 0 => self.members[self.pos - 1],
            p => {
                return Err(AlgoError::protocol(
                    from,
                    format!(
                        "unexpected hierarchical phase {p} at rank {} (position {} of its host)",
                        self.rank, self.pos
                    ),
                ))
            }
        };
        if from != expected_from {
            return Err(AlgoError::protocol(
                from,
                format!(
                    "hierarchical phase {} chunk from rank {from}, expected only rank \
                     {expected_from}",
                    h.phase
                ),
            ));
        }
        let off = usize::try_from(h.offset).unwrap_or(usize::MAX);
        let j = off / self.chunk;
        if off % self.chunk != 0 || j >= self.chunks {
            return Err(AlgoError::protocol(
                from,
                format!("offset {off} is not a chunk of {} elements", self.n),
            ));
        }
        let range = self.range(j);
        check_chunk_len(from, off, msg.payload().len(), range.len())?;
        let (seen, left) = if h.phase == REDUCE {
            (&mut self.reduce_seen, &mut self.reduce_left)
        } else {
            (&mut self.bcast_seen, &mut self.bcast_left)
        };
        if seen[j] {
            return Err(AlgoError::protocol(
                from,
                format!("duplicate hierarchical phase {} chunk at {off}", h.phase),
            ));
        }
        seen[j] = true;
        *left -= 1;
        if h.phase == REDUCE {
            // payload = received ⊕ own (the documented order: down the chain).
            ReduceOp::Sum.combine_into(msg.payload_mut(), &self.buf[range.clone()]);
            if self.pos > 0 {
                let to = self.members[self.pos - 1];
                self.out.push_back((to, msg));
            } else {
                copy_f32_le(&mut self.buf[range], msg.payload());
                if self.reduce_left == 0 {
                    self.start_across()?;
                }
            }
        } else {
            copy_f32_le(&mut self.buf[range], msg.payload());
            if !self.is_last() {
                let to = self.members[self.pos + 1];
                self.out.push_back((to, msg));
            }
        }
        Ok(())
    }

    /// The host's last member hands out the chunks of its own buffer (lazily, so the first
    /// is on the wire while the next are cut).
    fn next_own(&mut self) -> Option<(usize, Message)> {
        if self.pos == 0 || !self.is_last() || self.own_sent == self.chunks {
            return None;
        }
        self.own_sent += 1;
        let to = self.members[self.pos - 1];
        Some((to, self.chunk_msg(REDUCE, self.own_sent - 1)))
    }
}

impl Machine for Hierarchical<'_> {
    fn handle(&mut self, from: usize, msg: Message) -> Result<(), AlgoError> {
        // Own chunks are read from the buffer, which the broadcast overwrites: cut them all
        // before anything else lands (a no-op for drivers that drain `poll_transmit` first).
        while let Some(m) = self.next_own() {
            self.out.push_back(m);
        }
        if from == self.rank {
            return Err(AlgoError::protocol(from, "a message from this rank itself"));
        }
        match msg.header().algo {
            Algo::Hierarchical => self.handle_local(from, msg),
            _ => {
                // The leaders' all-reduce checks its own headers; a message of another kind
                // altogether is a mismatch whatever its algorithm.
                let h = *msg.header();
                if h.kind != Kind::AllReduceSum {
                    return Err(AlgoError::Mismatch {
                        peer: from,
                        detail: format!(
                            "peer runs {:?}, this rank a hierarchical all-reduce",
                            h.kind
                        ),
                    });
                }
                self.handle_across(from, msg)
            }
        }
    }

    fn poll_transmit(&mut self) -> Option<(usize, Message)> {
        if let Some(m) = self.out.pop_front() {
            return Some(m);
        }
        if let Some(m) = self.next_own() {
            return Some(m);
        }
        if let Some(inner) = &mut self.inner {
            let sent = inner.machine().poll_transmit();
            if let Some((l, msg)) = sent {
                return Some((self.leaders[l], msg));
            }
            self.finish_across();
        }
        match self.bcast_sent {
            Some(j) if j < self.chunks => {
                self.bcast_sent = Some(j + 1);
                Some((self.members[1], self.chunk_msg(BCAST, j)))
            }
            _ => None,
        }
    }

    fn is_done(&self) -> bool {
        // Only the host's last member (not its leader) sends chunks of its own buffer.
        let own_out = self.pos == 0 || !self.is_last() || self.own_sent == self.chunks;
        let reduced = self.reduce_left == 0 && own_out;
        let across = self.pos != 0 || self.across_done;
        let broadcast = match self.bcast_sent {
            Some(j) => j == self.chunks,
            None => self.pos != 0,
        };
        reduced && across && broadcast && self.bcast_left == 0 && self.out.is_empty()
    }

    fn expects_from(&self, peer: usize) -> bool {
        if self.reduce_left > 0 && self.members.get(self.pos + 1) == Some(&peer) {
            return true;
        }
        if self.bcast_left > 0 && self.pos > 0 && self.members[self.pos - 1] == peer {
            return true;
        }
        if self.pos == 0 && !self.across_done {
            if let Some(l) = self.leaders.iter().position(|&x| x == peer) {
                return match &self.inner {
                    Some(inner) => inner.expects_from(l),
                    // Not started: every other leader still needs this one's sum.
                    None => peer != self.rank,
                };
            }
        }
        false
    }
}
