//! The DLCP all-reduce as an IO-free state machine with timers (see the [module
//! docs](super) for the protocol).
//!
//! Like the other [`Machine`]s it is fed messages and polled for messages to send; it also
//! has timers — the owner's deadline and NACK interval, and the release of packets held by
//! the tail injector — which the driver learns from [`Machine::poll_timeout`] and fires by
//! calling [`Machine::handle_timeout`] with the current time (the machine never reads the
//! clock, so tests drive it with made-up times).
//!
//! # Wire
//! Header: kind [`Kind::Dlcp`], algorithm [`Algo::Direct`], `count = n`, `step = mtu / 4`
//! (so ranks with different buffers or packet sizes report a mismatch), `root` = the owner
//! of the segment concerned, `phase`:
//! * 0 **data**: payload = one packet ([`super::packet`]); header `offset` = its slot;
//! * 1 **NACK**, owner → sender: payload = the slots to resend, u32 LE each;
//! * 2 **used**, owner → everyone: payload = bitmap of `P · K` bits (LSB first), bit
//!   `s · K + k` set if slot `k` of sender `s` was used (`K` = slots in the segment);
//! * 3 **reduced**, owner → everyone: payload = f32 LE of the reduced segment from element
//!   `offset`, in chunks; always after the bitmap on the same link;
//! * 4 **sent**, sender → owner: empty; the end-of-transmission marker, sent right after the
//!   sender's last first transmission to that owner (see [`super`] on the round rule).

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use super::packet::{self, check_tensors, DlcpTensor, Inserted, Layout, Reassembler};
use super::{DlcpConfig, DlcpReport, Fate};
use crate::algo::{check_header, chunk_count, segment_range, AlgoError, Machine};
use crate::wire::{f32s, Algo, Header, Kind, Message};

const DATA: u8 = 0;
const NACK: u8 = 1;
const USED: u8 = 2;
const REDUCED: u8 = 3;
const SENT: u8 = 4;

/// One rank's DLCP all-reduce of a flat buffer in place (see the [module docs](self)).
#[derive(Debug)]
pub struct DlcpAllReduce<'a> {
    rank: usize,
    world: usize,
    seq: u64,
    cfg: DlcpConfig,
    data: &'a mut [f32],
    /// The packet plan of every segment.
    layouts: Vec<Arc<Layout>>,
    start: Instant,
    now: Instant,
    gather_chunk: usize,

    // Sender.
    /// First transmissions in strict priority order (owner, slot), after the budget.
    order: Vec<(u32, u32)>,
    next_first: usize,
    /// Per owner: the position in `order` after which its end-of-transmission marker goes
    /// out (`None`: nothing to send it, so the marker goes first).
    last_pos: Vec<Option<usize>>,
    /// Priority of every packet, per owner and slot.
    prios: Vec<Vec<f32>>,
    /// Transmissions of every packet so far, per owner and slot.
    attempts: Vec<Vec<u32>>,
    out: VecDeque<(usize, Message)>,
    /// Packets held by the tail injector, by release time.
    held: BTreeMap<(Instant, u64), (usize, Message)>,
    held_count: u64,

    // Owner.
    recv: Vec<Option<Reassembler>>,
    /// Per tensor of this rank's segment: packets missing over all senders, and how many
    /// may be missing (`⌊p_max · expected⌋`).
    missing_t: Vec<usize>,
    allowed_t: Vec<usize>,
    /// Tensors missing more than allowed.
    over: usize,
    total_missing: usize,
    owner_done: bool,
    deadline_passed: bool,
    /// Per peer: whether its end-of-transmission marker arrived.
    fin: Vec<bool>,
    fins_left: usize,
    next_nack: Option<Instant>,

    // Gather.
    used_in: Vec<bool>,
    reduced_got: Vec<Vec<bool>>,
    reduced_left: Vec<usize>,
    /// Per owner: ranges of this rank's contribution it did not use, and their values.
    dropped: Vec<Vec<Range<usize>>>,
    dropped_vals: Vec<Vec<f32>>,
    report: DlcpReport,
}

impl<'a> DlcpAllReduce<'a> {
    /// Starts a DLCP all-reduce of `data` at time `now`: `tensors` tile `data` (see
    /// [`check_tensors`]; an empty list is one tensor of layer 0), the reduced segments
    /// are gathered in chunks of `gather_chunk` elements (0 is taken as 1). `cfg` must be
    /// valid ([`DlcpConfig::validate`]).
    ///
    /// # Panics
    /// If `rank >= world`, `world > 65536`, the tensors do not tile `data`, or `cfg` is
    /// invalid (the communicator checks these and returns errors instead).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rank: usize,
        world: usize,
        seq: u64,
        data: &'a mut [f32],
        tensors: &[DlcpTensor],
        cfg: &DlcpConfig,
        gather_chunk: usize,
        now: Instant,
    ) -> Self {
        assert!(rank < world, "rank {rank} out of range for world {world}");
        assert!(world <= 1 << 16, "DLCP supports at most 65536 ranks");
        cfg.validate().expect("valid DLCP config");
        let n = data.len();
        let whole;
        let tensors = if tensors.is_empty() {
            whole = [DlcpTensor {
                range: 0..n,
                layer: 0,
            }];
            &whole[..]
        } else {
            tensors
        };
        check_tensors(n, tensors).expect("tensors tile the buffer");
        let num_layers = tensors
            .iter()
            .map(|t| t.layer)
            .max()
            .unwrap_or(0)
            .saturating_add(1);
        let mtu = cfg.mtu_elems();
        let layouts: Vec<Arc<Layout>> = (0..world)
            .map(|q| Arc::new(Layout::new(tensors, segment_range(n, world, q), mtu)))
            .collect();

        // Sender: priorities, strict priority order, the capacity budget.
        let mut prios = vec![Vec::new(); world];
        let mut order = Vec::new();
        for q in (0..world).filter(|&q| q != rank) {
            prios[q] = layouts[q]
                .slots()
                .iter()
                .map(|s| cfg.priority.of(s.layer, num_layers, &data[s.range()]))
                .collect();
            order.extend((0..layouts[q].len()).map(|k| (q as u32, k as u32)));
        }
        order.sort_by(|a, b| {
            let (pa, pb) = (
                prios[a.0 as usize][a.1 as usize],
                prios[b.0 as usize][b.1 as usize],
            );
            pb.total_cmp(&pa).then(a.1.cmp(&b.1)).then(a.0.cmp(&b.0))
        });
        let mut report = DlcpReport {
            packets: order.len(),
            ..DlcpReport::default()
        };
        if let Some(budget) = cfg.budget_bytes {
            let mut used = 0usize;
            let keep = order
                .iter()
                .take_while(|(q, k)| {
                    let c = layouts[*q as usize].slots()[*k as usize].count as usize;
                    used += crate::wire::HEADER_LEN + packet::encoded_len(c);
                    used <= budget
                })
                .count();
            report.capacity_dropped = order.len() - keep;
            order.truncate(keep);
        }
        let mut last_pos = vec![None; world];
        for (i, (q, _)) in order.iter().enumerate() {
            last_pos[*q as usize] = Some(i);
        }
        let attempts = (0..world)
            .map(|q| {
                if q == rank {
                    Vec::new()
                } else {
                    vec![0; layouts[q].len()]
                }
            })
            .collect();

        // Owner.
        let mine = layouts[rank].clone();
        let recv = (0..world)
            .map(|q| {
                (q != rank).then(|| Reassembler::new(seq, q as u16, rank as u16, mine.clone()))
            })
            .collect();
        let peers = world - 1;
        let missing_t: Vec<usize> = (0..mine.tensors())
            .map(|t| mine.tensor_slots(t) * peers)
            .collect();
        let allowed_t: Vec<usize> = missing_t
            .iter()
            .map(|&e| (cfg.p_max * e as f64 + 1e-9).floor() as usize)
            .collect();
        let over = missing_t
            .iter()
            .zip(&allowed_t)
            .filter(|(m, a)| m > a)
            .count();
        let total_missing = mine.len() * peers;

        let chunk = gather_chunk.max(1);
        let reduced_got: Vec<Vec<bool>> = (0..world)
            .map(|q| vec![false; chunk_count(layouts[q].range().len(), chunk)])
            .collect();
        let mut reduced_left: Vec<usize> = reduced_got.iter().map(Vec::len).collect();
        reduced_left[rank] = 0;

        let mut m = DlcpAllReduce {
            rank,
            world,
            seq,
            cfg: cfg.clone(),
            data,
            layouts,
            start: now,
            now,
            gather_chunk: chunk,
            order,
            next_first: 0,
            last_pos,
            prios,
            attempts,
            out: VecDeque::new(),
            held: BTreeMap::new(),
            held_count: 0,
            recv,
            missing_t,
            allowed_t,
            over,
            total_missing,
            owner_done: false,
            deadline_passed: false,
            fin: vec![false; world],
            fins_left: world - 1,
            next_nack: None,
            used_in: vec![false; world],
            reduced_got,
            reduced_left,
            dropped: vec![Vec::new(); world],
            dropped_vals: vec![Vec::new(); world],
            report,
        };
        for q in (0..world).filter(|&q| q != rank && m.last_pos[q].is_none()) {
            let fin = Message::new(m.header(SENT, q, 0), &[]);
            m.out.push_back((q, fin));
        }
        m.progress();
        m
    }

    fn n(&self) -> usize {
        self.data.len()
    }

    fn header(&self, phase: u8, owner: usize, offset: usize) -> Header {
        Header {
            phase,
            step: self.cfg.mtu_elems() as u32,
            count: self.n() as u64,
            offset: offset as u64,
            root: owner as u32,
            ..Header::new(Kind::Dlcp, Algo::Direct, self.seq)
        }
    }

    /// One transmission of slot `k` of this rank's contribution to `owner`, through the
    /// loss model.
    fn transmit(&mut self, owner: usize, k: usize) {
        let attempt = self.attempts[owner][k];
        self.attempts[owner][k] = attempt.saturating_add(1);
        let fate = self.cfg.loss.fate(self.seq, self.rank, owner, k, attempt);
        if fate == Fate::Drop {
            self.report.lost += 1;
            return;
        }
        let s = self.layouts[owner].slots()[k];
        let ph = packet::header_for(
            self.seq,
            self.rank as u16,
            owner as u16,
            k,
            &s,
            self.prios[owner][k],
        );
        let vals = &self.data[s.range()];
        let msg = Message::build(
            self.header(DATA, owner, k),
            packet::encoded_len(vals.len()),
            |out| packet::encode(&ph, vals, out),
        );
        match fate {
            Fate::Delay(d) => {
                self.report.delayed += 1;
                self.held
                    .insert((self.now + d, self.held_count), (owner, msg));
                self.held_count += 1;
            }
            _ => {
                self.report.sent += 1;
                self.out.push_back((owner, msg));
            }
        }
    }

    /// Applies the round rule after any event: complete when every packet arrived; at a
    /// decision point (the deadline passed, or every peer's end-of-transmission marker
    /// arrived) complete if every tensor is within the loss bound, else NACK (once at the
    /// decision point, then every retransmit interval, see `handle_timeout`).
    fn progress(&mut self) {
        if self.owner_done {
            return;
        }
        if self.total_missing == 0 {
            self.complete_owner();
            return;
        }
        if !(self.deadline_passed || self.fins_left == 0) {
            return;
        }
        if self.over == 0 {
            self.complete_owner();
        } else if self.next_nack.is_none() {
            self.nack();
        }
    }

    /// NACKs the missing packets of the tensors over the loss bound, to the senders whose
    /// end-of-transmission marker arrived (the others' may still be in flight), and arms
    /// the retransmit timer.
    fn nack(&mut self) {
        let layout = self.layouts[self.rank].clone();
        let mut nacks = Vec::new();
        for (q, r) in self.recv.iter().enumerate() {
            let Some(r) = r.as_ref().filter(|_| self.fin[q]) else {
                continue;
            };
            let slots: Vec<u32> = r
                .missing()
                .filter(|&k| {
                    let t = layout.local_tensor(k);
                    self.missing_t[t] > self.allowed_t[t]
                })
                .map(|k| k as u32)
                .collect();
            if !slots.is_empty() {
                nacks.push((q, slots));
            }
        }
        if !nacks.is_empty() {
            self.report.nack_rounds += 1;
        }
        for (q, slots) in nacks {
            let msg = Message::build(self.header(NACK, self.rank, 0), slots.len() * 4, |out| {
                for s in &slots {
                    out.extend_from_slice(&s.to_le_bytes());
                }
            });
            self.out.push_back((q, msg));
            self.report.nacks_sent += 1;
        }
        self.next_nack = Some(self.now + self.cfg.retransmit_interval);
    }

    /// Reduces this rank's segment in rank order, and sends the used-bitmap and the sum.
    fn complete_owner(&mut self) {
        self.owner_done = true;
        self.next_nack = None;
        self.report.completed_with_loss = self.total_missing > 0;
        let layout = self.layouts[self.rank].clone();
        let seg = layout.range();
        let mut acc = vec![0.0f32; seg.len()];
        for q in 0..self.world {
            let src = match &self.recv[q] {
                Some(r) => r.values(),
                None => &self.data[seg.clone()],
            };
            for (a, v) in acc.iter_mut().zip(src) {
                *a += v;
            }
        }
        self.data[seg.clone()].copy_from_slice(&acc);
        let k = layout.len();
        let mut bitmap = vec![0u8; (self.world * k).div_ceil(8)];
        for q in 0..self.world {
            for slot in 0..k {
                let used = self.recv[q].as_ref().is_none_or(|r| r.arrived(slot));
                if used {
                    let bit = q * k + slot;
                    bitmap[bit / 8] |= 1 << (bit % 8);
                }
            }
        }
        self.recv.iter_mut().for_each(|r| *r = None);
        self.absorb_used(self.rank, &bitmap);
        if self.world == 1 {
            return;
        }
        let used = Message::new(self.header(USED, self.rank, 0), &bitmap);
        for p in (0..self.world).filter(|&p| p != self.rank) {
            self.out.push_back((p, used.clone()));
        }
        for c in 0..self.reduced_got[self.rank].len() {
            let r = self.chunk_range(self.rank, c);
            let msg = Message::from_f32(self.header(REDUCED, self.rank, r.start), &self.data[r]);
            for p in (0..self.world).filter(|&p| p != self.rank) {
                self.out.push_back((p, msg.clone()));
            }
        }
    }

    fn chunk_range(&self, q: usize, c: usize) -> Range<usize> {
        let seg = self.layouts[q].range();
        let s = seg.start + c * self.gather_chunk;
        s..(s + self.gather_chunk).min(seg.end)
    }

    /// Takes in owner `q`'s used-bitmap (already length-checked): counts, and this rank's
    /// dropped ranges and values (read before `q`'s reduced segment overwrites them).
    fn absorb_used(&mut self, q: usize, bitmap: &[u8]) {
        let layout = self.layouts[q].clone();
        let k = layout.len();
        for s in (0..self.world).filter(|&s| s != q) {
            for (slot, sl) in layout.slots().iter().enumerate() {
                let bit = s * k + slot;
                if bitmap[bit / 8] & (1 << (bit % 8)) != 0 {
                    continue;
                }
                self.report.dropped_packets_all += 1;
                self.report.dropped_elems_all += sl.count as usize;
                if s == self.rank {
                    let r = sl.range();
                    self.dropped_vals[q].extend_from_slice(&self.data[r.clone()]);
                    match self.dropped[q].last_mut() {
                        Some(last) if last.end == r.start => last.end = r.end,
                        _ => self.dropped[q].push(r),
                    }
                }
            }
        }
        self.report.packets_all += (self.world - 1) * k;
        self.report.elems_all += (self.world - 1) * layout.range().len();
        self.used_in[q] = true;
    }

    fn on_data(&mut self, from: usize, h: &Header, payload: &[u8]) -> Result<(), AlgoError> {
        if h.root as usize != self.rank {
            return Err(AlgoError::protocol(
                from,
                format!(
                    "DLCP packet for segment {} sent to rank {}",
                    h.root, self.rank
                ),
            ));
        }
        let (ph, body) =
            packet::decode(payload).map_err(|e| AlgoError::protocol(from, e.to_string()))?;
        let Some(r) = self.recv[from].as_mut() else {
            // The segment is reduced: a late or duplicate packet.
            self.report.ignored += 1;
            return Ok(());
        };
        match r
            .insert_decoded(&ph, body)
            .map_err(|e| AlgoError::protocol(from, e.to_string()))?
        {
            Inserted::New(k) => {
                let t = self.layouts[self.rank].local_tensor(k);
                self.missing_t[t] -= 1;
                if self.missing_t[t] == self.allowed_t[t] {
                    self.over -= 1;
                }
                self.total_missing -= 1;
                self.progress();
            }
            Inserted::Duplicate(_) | Inserted::Stale => self.report.ignored += 1,
        }
        Ok(())
    }

    fn on_sent(&mut self, from: usize, h: &Header) -> Result<(), AlgoError> {
        if h.root as usize != self.rank || self.fin[from] {
            return Err(AlgoError::protocol(
                from,
                format!(
                    "unexpected end-of-transmission marker for segment {}",
                    h.root
                ),
            ));
        }
        self.fin[from] = true;
        self.fins_left -= 1;
        self.progress();
        Ok(())
    }

    fn on_nack(&mut self, from: usize, payload: &[u8]) -> Result<(), AlgoError> {
        if self.used_in[from] {
            return Ok(()); // The owner already reduced; nothing to resend.
        }
        let k = self.layouts[from].len();
        if !payload.len().is_multiple_of(4) || payload.len() / 4 > k {
            return Err(AlgoError::protocol(
                from,
                format!(
                    "NACK of {} bytes for a segment of {k} packets",
                    payload.len()
                ),
            ));
        }
        let slots: Vec<usize> = payload
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize)
            .collect();
        if let Some(bad) = slots.iter().find(|&&s| s >= k) {
            return Err(AlgoError::protocol(
                from,
                format!("NACK of packet {bad}, the segment has {k}"),
            ));
        }
        for s in slots {
            self.report.retransmitted += 1;
            self.transmit(from, s);
        }
        Ok(())
    }

    fn on_used(&mut self, from: usize, payload: &[u8]) -> Result<(), AlgoError> {
        if self.used_in[from] {
            return Err(AlgoError::protocol(from, "duplicate DLCP used-bitmap"));
        }
        let want = (self.world * self.layouts[from].len()).div_ceil(8);
        if payload.len() != want {
            return Err(AlgoError::protocol(
                from,
                format!("used-bitmap of {} bytes, expected {want}", payload.len()),
            ));
        }
        self.absorb_used(from, payload);
        Ok(())
    }

    fn on_reduced(&mut self, from: usize, h: &Header, payload: &[u8]) -> Result<(), AlgoError> {
        if !self.used_in[from] {
            return Err(AlgoError::protocol(
                from,
                "DLCP reduced segment before its used-bitmap",
            ));
        }
        let seg = self.layouts[from].range();
        let off = usize::try_from(h.offset).unwrap_or(usize::MAX);
        let c = off
            .checked_sub(seg.start)
            .filter(|rel| rel % self.gather_chunk == 0)
            .map(|rel| rel / self.gather_chunk)
            .filter(|&c| c < self.reduced_got[from].len() && !self.reduced_got[from][c])
            .ok_or_else(|| {
                AlgoError::protocol(
                    from,
                    format!("reduced chunk at {off} is not an awaited chunk of segment {seg:?}"),
                )
            })?;
        let r = self.chunk_range(from, c);
        if payload.len() != 4 * r.len() {
            return Err(AlgoError::protocol(
                from,
                format!(
                    "reduced chunk of {} bytes, expected {}",
                    payload.len(),
                    4 * r.len()
                ),
            ));
        }
        let vals = f32s(payload).map_err(|e| AlgoError::wire(from, e))?;
        for (d, v) in self.data[r].iter_mut().zip(vals) {
            *d = v;
        }
        self.reduced_got[from][c] = true;
        self.reduced_left[from] -= 1;
        Ok(())
    }

    /// The report of the finished round (bytes are left to the driver).
    ///
    /// # Panics
    /// If the machine is not done.
    pub fn into_report(mut self) -> DlcpReport {
        assert!(self.is_done(), "DLCP all-reduce not complete");
        let mut r = std::mem::take(&mut self.report);
        r.delayed_discarded = self.held.len();
        for (ranges, vals) in self.dropped.iter_mut().zip(&mut self.dropped_vals) {
            for g in ranges.drain(..) {
                match r.dropped.last_mut() {
                    Some(last) if last.end == g.start => last.end = g.end,
                    _ => r.dropped.push(g),
                }
            }
            r.dropped_values.append(vals);
        }
        r
    }
}

impl Machine for DlcpAllReduce<'_> {
    fn handle(&mut self, from: usize, msg: Message) -> Result<(), AlgoError> {
        let h = *msg.header();
        check_header(from, &h, Kind::Dlcp, Algo::Direct, Some(self.n() as u64))?;
        if h.step as usize != self.cfg.mtu_elems() {
            return Err(AlgoError::Mismatch {
                peer: from,
                detail: format!(
                    "peer's DLCP packets hold {} elements, this rank's {}",
                    h.step,
                    self.cfg.mtu_elems()
                ),
            });
        }
        if from >= self.world || from == self.rank {
            return Err(AlgoError::protocol(
                from,
                format!("DLCP message from rank {from}, not a peer"),
            ));
        }
        if !matches!(h.phase, DATA | SENT) && h.root as usize != from {
            return Err(AlgoError::protocol(
                from,
                format!(
                    "DLCP control message about segment {} from rank {from}",
                    h.root
                ),
            ));
        }
        match h.phase {
            DATA => self.on_data(from, &h, msg.payload()),
            NACK => self.on_nack(from, msg.payload()),
            USED => self.on_used(from, msg.payload()),
            REDUCED => self.on_reduced(from, &h, msg.payload()),
            SENT => self.on_sent(from, &h),
            other => Err(AlgoError::protocol(
                from,
                format!("unknown DLCP phase {other}"),
            )),
        }
    }

    fn poll_transmit(&mut self) -> Option<(usize, Message)> {
        loop {
            if let Some(m) = self.out.pop_front() {
                return Some(m);
            }
            let i = self.next_first;
            let &(q, k) = self.order.get(i)?;
            self.next_first += 1;
            let q = q as usize;
            self.transmit(q, k as usize);
            if self.last_pos[q] == Some(i) {
                let fin = Message::new(self.header(SENT, q, 0), &[]);
                self.out.push_back((q, fin));
            }
        }
    }

    fn is_done(&self) -> bool {
        self.owner_done
            && self.out.is_empty()
            && self.used_in.iter().all(|&u| u)
            && self.reduced_left.iter().all(|&l| l == 0)
    }

    fn expects_from(&self, peer: usize) -> bool {
        peer < self.world
            && peer != self.rank
            && (!self.used_in[peer]
                || self.reduced_left[peer] > 0
                || self.recv[peer].as_ref().is_some_and(|r| !r.is_complete())
                || (!self.owner_done && !self.fin[peer]))
    }

    fn poll_timeout(&self) -> Option<Instant> {
        let held = self.held.keys().next().map(|k| k.0);
        let owner = if self.owner_done {
            None
        } else if !self.deadline_passed {
            let d = self.start + self.cfg.deadline;
            Some(self.next_nack.map_or(d, |t| t.min(d)))
        } else {
            self.next_nack
        };
        match (held, owner) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        self.now = self.now.max(now);
        while let Some(entry) = self.held.first_entry() {
            if entry.key().0 > self.now {
                break;
            }
            let msg = entry.remove();
            self.report.sent += 1;
            self.out.push_back(msg);
        }
        if self.owner_done {
            return;
        }
        if !self.deadline_passed && self.now >= self.start + self.cfg.deadline {
            self.deadline_passed = true;
            self.progress();
        }
        if !self.owner_done && self.next_nack.is_some_and(|t| self.now >= t) {
            self.nack();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use super::*;
    use crate::dlcp::{splitmix, LossModel, Priority};

    /// One message in flight in the simulated network.
    struct InFlight {
        from: usize,
        to: usize,
        msg: Message,
        at: Instant,
    }

    /// What a simulated run saw.
    struct Run {
        results: Vec<Vec<f32>>,
        reports: Vec<DlcpReport>,
        /// Virtual time each rank finished, from the start.
        finished: Vec<Duration>,
        /// Data packets put on the wire, as (sender, owner, slot, prio), in send order.
        sent: Vec<(usize, usize, usize, f32)>,
    }

    fn tensors(n: usize) -> Vec<DlcpTensor> {
        // Three layers of uneven sizes.
        DlcpTensor::from_ends(&[n / 5, n / 2, n], 0)
    }

    fn inputs(world: usize, n: usize, seed: u64) -> Vec<Vec<f32>> {
        let mut s = seed;
        (0..world)
            .map(|_| {
                (0..n)
                    .map(|_| ((splitmix(&mut s) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0)
                    .collect()
            })
            .collect()
    }

    /// Runs the machines over a simulated network: `deliver(from, to, msg)` decides
    /// whether a message is delivered, and after how long (`None` = lost on the wire);
    /// messages that are due are delivered one at a time in an order drawn from
    /// `order_seed` that keeps only the per-link order of the used-bitmap and reduced
    /// chunks; time jumps to the next timer or arrival when nothing is due.
    fn simulate(
        inputs: &[Vec<f32>],
        tensors: &[DlcpTensor],
        cfg: &DlcpConfig,
        order_seed: u64,
        mut deliver: impl FnMut(usize, usize, &Message) -> Option<Duration>,
    ) -> Run {
        let world = inputs.len();
        let mut datas: Vec<Vec<f32>> = inputs.to_vec();
        let t0 = Instant::now();
        let mut now = t0;
        let mut sent = Vec::new();
        let mut finished = vec![None; world];
        let mut reports = Vec::new();
        {
            let mut ms: Vec<DlcpAllReduce<'_>> = datas
                .iter_mut()
                .enumerate()
                .map(|(r, d)| DlcpAllReduce::new(r, world, 5, d, tensors, cfg, 7, now))
                .collect();
            let mut flight: Vec<InFlight> = Vec::new();
            let mut s = order_seed;
            for _ in 0..1_000_000 {
                for (i, m) in ms.iter_mut().enumerate() {
                    m.handle_timeout(now);
                    while let Some((to, msg)) = m.poll_transmit() {
                        if msg.header().phase == DATA {
                            let (h, _) = packet::decode(msg.payload()).unwrap();
                            sent.push((i, to, h.index as usize, h.prio));
                        }
                        if let Some(d) = deliver(i, to, &msg) {
                            flight.push(InFlight {
                                from: i,
                                to,
                                msg,
                                at: now + d,
                            });
                        }
                    }
                    if m.is_done() && finished[i].is_none() {
                        finished[i] = Some(now - t0);
                    }
                }
                if ms.iter().all(|m| m.is_done()) && flight.is_empty() {
                    break;
                }
                // Pick a due message. Links are FIFO (as the Transport promises) only where
                // the protocol relies on it: the used-bitmap and reduced chunks keep their
                // order, and an end-of-transmission marker does not overtake data.
                let eligible: Vec<usize> = (0..flight.len())
                    .filter(|&i| {
                        let f = &flight[i];
                        let p = f.msg.header().phase;
                        let blocks = |g: &InFlight| {
                            let q = g.msg.header().phase;
                            match p {
                                USED | REDUCED => q == USED || q == REDUCED,
                                SENT => q == DATA,
                                _ => false,
                            }
                        };
                        f.at <= now
                            && !flight[..i]
                                .iter()
                                .any(|g| g.from == f.from && g.to == f.to && blocks(g))
                    })
                    .collect();
                if eligible.is_empty() {
                    now = ms
                        .iter()
                        .filter_map(|m| m.poll_timeout())
                        .chain(flight.iter().map(|f| f.at))
                        .min()
                        .expect("stuck: nothing in flight and no timer");
                    continue;
                }
                let pick = eligible[(splitmix(&mut s) % eligible.len() as u64) as usize];
                let f = flight.remove(pick);
                ms[f.to].handle(f.from, f.msg).unwrap();
            }
            assert!(ms.iter().all(|m| m.is_done()), "simulation did not finish");
            for m in ms {
                reports.push(m.into_report());
            }
        }
        Run {
            results: datas,
            reports,
            finished: finished.into_iter().map(Option::unwrap).collect(),
            sent,
        }
    }

    /// The rank-order sum from +0.0 of the inputs, with `zeroed(sender, flat_index)`
    /// contributions left out.
    fn reference(inputs: &[Vec<f32>], zeroed: impl Fn(usize, usize) -> bool) -> Vec<f32> {
        let n = inputs[0].len();
        (0..n)
            .map(|i| {
                let mut acc = 0.0f32;
                for (q, x) in inputs.iter().enumerate() {
                    if !zeroed(q, i) {
                        acc += x[i];
                    }
                }
                acc
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    const NOW: Option<Duration> = Some(Duration::ZERO);

    fn cfg(p_max: f64) -> DlcpConfig {
        DlcpConfig {
            p_max,
            mtu: 16, // 4 elements per packet
            deadline: Duration::from_millis(20),
            retransmit_interval: Duration::from_millis(10),
            ..DlcpConfig::default()
        }
    }

    fn is_data(msg: &Message) -> Option<usize> {
        (msg.header().phase == DATA).then(|| msg.header().offset as usize)
    }

    #[test]
    fn no_loss_gives_the_rank_order_sum_on_every_rank() {
        for world in 1..=5 {
            for n in [0, 3, 7, 64, 203] {
                let x = inputs(world, n, 11 + n as u64);
                let t = if n == 0 { Vec::new() } else { tensors(n) };
                for seed in 0..3 {
                    let run = simulate(&x, &t, &cfg(0.05), seed, |_, _, _| NOW);
                    let want = reference(&x, |_, _| false);
                    for (r, got) in run.results.iter().enumerate() {
                        assert_eq!(bits(got), bits(&want), "world {world} n {n} rank {r}");
                        let rep = &run.reports[r];
                        assert!(rep.dropped.is_empty());
                        assert_eq!((rep.nack_rounds, rep.retransmitted), (0, 0));
                        assert!(!rep.completed_with_loss);
                        assert_eq!(rep.dropped_fraction(), 0.0);
                    }
                    // Nothing was lost, so nobody waited for the deadline.
                    assert!(run.finished.iter().all(|&f| f < Duration::from_millis(20)));
                }
            }
        }
    }

    /// Owner 0's segment of n = 100 over 3 ranks is 0..34: tensors 0..20 and 20..34 (with
    /// mtu 4: 5 + 4 slots per sender, 10 + 8 over both senders).
    #[test]
    fn drop_within_p_max_completes_without_retransmission() {
        let x = inputs(3, 100, 3);
        let t = tensors(100);
        // p_max 0.1: tensor 0 may miss ⌊0.1 · 10⌋ = 1 packet: drop slot 2 from rank 1.
        let mut dropped = 0;
        let run = simulate(&x, &t, &cfg(0.1), 1, |from, to, msg| {
            if from == 1 && to == 0 && is_data(msg) == Some(2) {
                dropped += 1;
                return None;
            }
            NOW
        });
        assert_eq!(dropped, 1, "dropped once, never resent");
        let want = reference(&x, |q, i| q == 1 && (8..12).contains(&i));
        for (r, got) in run.results.iter().enumerate() {
            assert_eq!(
                bits(got),
                bits(&want),
                "rank {r}: the sum with the dropped packet zeroed"
            );
            assert_eq!(run.reports[r].retransmitted, 0);
            assert_eq!(run.reports[r].dropped_packets_all, 1);
        }
        assert_eq!(run.reports[0].nack_rounds, 0);
        assert!(run.reports[0].completed_with_loss);
        // Every sender's end-of-transmission marker was in: the loss is known, and within
        // the bound, so the owner did not wait for the deadline.
        assert!(run.finished[0] < Duration::from_millis(20));
        // The sender learns exactly what was dropped, with its values (for EF).
        assert_eq!(run.reports[1].dropped, vec![8..12]);
        assert_eq!(run.reports[1].dropped_values, x[1][8..12].to_vec());
        assert!(run.reports[2].dropped.is_empty());
    }

    #[test]
    fn drop_beyond_p_max_triggers_retransmission() {
        let x = inputs(3, 100, 4);
        let t = tensors(100);
        // Two packets of tensor 0 at owner 0 (one from each sender): over the bound of 1.
        let mut first = HashMap::new();
        let run = simulate(&x, &t, &cfg(0.1), 2, |from, to, msg| {
            let lose = to == 0 && matches!((from, is_data(msg)), (1, Some(0)) | (2, Some(4)));
            // Lose only the first transmission.
            let n = first.entry((from, to, is_data(msg))).or_insert(0);
            *n += 1;
            (!(lose && *n == 1)).then_some(Duration::ZERO)
        });
        assert_eq!(run.reports[0].nack_rounds, 1);
        assert_eq!(run.reports[0].nacks_sent, 2);
        assert_eq!(
            (run.reports[1].retransmitted, run.reports[2].retransmitted),
            (1, 1)
        );
        // The loss was known (markers in) before the deadline: NACKed at once.
        assert!(run.finished[0] < Duration::from_millis(20));
        // The owner completes as soon as the bound holds again: with the first of the two
        // retransmissions, so at most one packet (the bound) is left out.
        let dropped: Vec<Vec<Range<usize>>> =
            run.reports.iter().map(|r| r.dropped.clone()).collect();
        let want = reference(&x, |q, i| dropped[q].iter().any(|r| r.contains(&i)));
        for got in &run.results {
            assert_eq!(bits(got), bits(&want));
        }
        assert!(run.reports.iter().all(|r| r.dropped_packets_all <= 1));
    }

    #[test]
    fn reliable_mode_retransmits_until_everything_arrived() {
        let x = inputs(4, 90, 5);
        let t = tensors(90);
        let mut c = cfg(0.0);
        c.loss = LossModel {
            drop_prob: 0.2,
            delay_prob: 0.1,
            delay: Duration::from_millis(35),
            seed: 9,
        };
        let run = simulate(&x, &t, &c, 3, |_, _, _| NOW);
        let want = reference(&x, |_, _| false);
        for got in &run.results {
            assert_eq!(bits(got), bits(&want));
        }
        let lost: usize = run.reports.iter().map(|r| r.lost).sum();
        let resent: usize = run.reports.iter().map(|r| r.retransmitted).sum();
        assert!(lost > 0 && resent >= lost, "lost {lost}, resent {resent}");
    }

    #[test]
    fn lossy_mode_keeps_replicas_identical_and_reports_the_drops() {
        let x = inputs(4, 400, 6);
        let t = tensors(400);
        let mut c = cfg(0.3);
        c.loss = LossModel {
            drop_prob: 0.1,
            delay_prob: 0.05,
            delay: Duration::from_millis(50),
            seed: 1,
        };
        let run = simulate(&x, &t, &c, 4, |_, _, _| NOW);
        // Every rank's dropped ranges, zeroed, reproduce the result exactly.
        let dropped: Vec<Vec<Range<usize>>> =
            run.reports.iter().map(|r| r.dropped.clone()).collect();
        let want = reference(&x, |q, i| dropped[q].iter().any(|r| r.contains(&i)));
        for got in &run.results {
            assert_eq!(bits(got), bits(&want));
        }
        let r0 = &run.reports[0];
        assert!(r0.dropped_packets_all > 0);
        assert!(run
            .reports
            .iter()
            .all(|r| r.dropped_packets_all == r0.dropped_packets_all));
        let mine: usize = run
            .reports
            .iter()
            .map(|r| r.dropped.iter().map(|g| g.len()).sum::<usize>())
            .sum();
        assert_eq!(mine, r0.dropped_elems_all);
        assert_eq!(r0.elems_all, 3 * 400);
        // Every round ended once the markers were in (no tensor exceeded 30 %), before any
        // delayed packet came out.
        assert!(
            run.finished.iter().all(|&f| f < Duration::from_millis(50)),
            "{:?}",
            run.finished
        );
    }

    #[test]
    fn capacity_budget_drops_the_lowest_priorities_first() {
        let world = 3;
        let n = 120;
        let x = inputs(world, n, 8);
        let t = tensors(n);
        let mut c = cfg(0.9);
        c.priority = Priority::LayerMagnitude {
            layer_weight: 2.0,
            num_layers: 0,
        };
        // Rank 0 may send 10 packets of 4 elements (36 + 36 + 16 bytes each).
        let per = crate::wire::HEADER_LEN + packet::encoded_len(4);
        c.budget_bytes = Some(10 * per + per / 2);
        let run = simulate(&x, &t, &c, 5, |_, _, _| NOW);
        let r0 = &run.reports[0];
        assert_eq!(r0.capacity_dropped, r0.packets - 10);
        // Priorities of rank 0's packets, all of them.
        let layouts: Vec<Layout> = (0..world)
            .map(|q| Layout::new(&t, segment_range(n, world, q), 4))
            .collect();
        let mut all: Vec<(f32, usize, usize)> = Vec::new();
        for (q, layout) in layouts.iter().enumerate().skip(1) {
            for (k, s) in layout.slots().iter().enumerate() {
                all.push((c.priority.of(s.layer, 3, &x[0][s.range()]), q, k));
            }
        }
        let sent: Vec<(usize, usize, f32)> = run
            .sent
            .iter()
            .filter(|s| s.0 == 0)
            .map(|&(_, q, k, p)| (q, k, p))
            .collect();
        assert_eq!(sent.len(), 10);
        // Sent in strict priority order, and every packet not sent has a lower priority.
        assert!(sent.windows(2).all(|w| w[0].2 >= w[1].2));
        let min_sent = sent.iter().map(|s| s.2).fold(f32::INFINITY, f32::min);
        for (p, q, k) in &all {
            if !sent.iter().any(|s| (s.0, s.1) == (*q, *k)) {
                assert!(
                    *p <= min_sent,
                    "dropped packet ({q}, {k}) has prio {p} > {min_sent}"
                );
            }
        }
        // What was not sent is what the report says was dropped.
        let dropped_elems: usize = r0.dropped.iter().map(|r| r.len()).sum();
        let unsent_elems: usize = all
            .iter()
            .filter(|(_, q, k)| !sent.iter().any(|s| (s.0, s.1) == (*q, *k)))
            .map(|(_, q, k)| layouts[*q].slots()[*k].count as usize)
            .sum();
        assert_eq!(dropped_elems, unsent_elems);
    }

    #[test]
    fn error_feedback_restores_the_dropped_mass_on_the_next_step() {
        let world = 3;
        let n = 150;
        let g1 = inputs(world, n, 21);
        let g2 = inputs(world, n, 22);
        let t = tensors(n);
        let mut lossy = cfg(0.4);
        lossy.loss = LossModel {
            drop_prob: 0.2,
            seed: 3,
            ..LossModel::default()
        };
        let step1 = simulate(&g1, &t, &lossy, 0, |_, _, _| NOW);
        assert!(step1.reports.iter().any(|r| !r.dropped.is_empty()));
        // Each rank's residual gets what it lost; step 2 sends g2 + residual without loss.
        let next: Vec<Vec<f32>> = (0..world)
            .map(|r| {
                let mut e = vec![0.0f32; n];
                step1.reports[r].add_dropped_to(&mut e);
                g2[r].iter().zip(&e).map(|(a, b)| a + b).collect()
            })
            .collect();
        let step2 = simulate(&next, &t, &cfg(0.4), 0, |_, _, _| NOW);
        let plain = simulate(&g2, &t, &cfg(0.4), 0, |_, _, _| NOW);
        let total = reference(
            &(0..world)
                .map(|r| g1[r].iter().zip(&g2[r]).map(|(a, b)| a + b).collect())
                .collect::<Vec<Vec<f32>>>(),
            |_, _| false,
        );
        let err = |s2: &[f32]| -> f64 {
            (0..n)
                .map(|i| f64::from(step1.results[0][i] + s2[i] - total[i]).abs())
                .fold(0.0, f64::max)
        };
        let with_ef = err(&step2.results[0]);
        let without = err(&plain.results[0]);
        assert!(
            with_ef < 1e-5,
            "with EF the two steps sum to the gradients: {with_ef}"
        );
        assert!(
            without > 0.1,
            "without EF the dropped mass is lost: {without}"
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// Whatever the delivery order and loss pattern, every rank holds the same bits:
        /// the rank-order sum with exactly the reported dropped ranges zeroed; without loss,
        /// the plain rank-order sum.
        #[test]
        fn any_delivery_order_and_loss_gives_consistent_bits(
            world in 2usize..5,
            n in 1usize..120,
            order_seed in proptest::prelude::any::<u64>(),
            loss_seed in proptest::prelude::any::<u64>(),
            drop_prob in 0.0f64..0.3,
            p_max in 0.0f64..0.5,
        ) {
            let x = inputs(world, n, loss_seed);
            let t = tensors(n);
            let mut c = cfg(p_max);
            c.loss = LossModel { drop_prob, seed: loss_seed, ..LossModel::default() };
            let run = simulate(&x, &t, &c, order_seed, |_, _, _| NOW);
            let dropped: Vec<Vec<Range<usize>>> =
                run.reports.iter().map(|r| r.dropped.clone()).collect();
            let want = reference(&x, |q, i| dropped[q].iter().any(|r| r.contains(&i)));
            for got in &run.results {
                proptest::prop_assert_eq!(bits(got), bits(&want));
            }
            let clean = simulate(&x, &t, &cfg(p_max), order_seed, |_, _, _| NOW);
            for got in &clean.results {
                proptest::prop_assert_eq!(bits(got), bits(&reference(&x, |_, _| false)));
            }
        }
    }

    /// Rank 2's marker and one of its packets to owner 0 straggle by 100 ms.
    fn straggle(from: usize, to: usize, msg: &Message) -> Option<Duration> {
        let late = from == 2 && to == 0 && (msg.header().phase == SENT || is_data(msg) == Some(3));
        Some(Duration::from_millis(if late { 100 } else { 0 }))
    }

    #[test]
    fn a_straggler_within_the_bound_is_cut_at_the_deadline() {
        let x = inputs(3, 100, 9);
        let t = tensors(100);
        let run = simulate(&x, &t, &cfg(0.1), 3, straggle);
        assert_eq!(run.finished[0], Duration::from_millis(20));
        assert!(run.reports[0].completed_with_loss);
        assert!(run.reports.iter().all(|r| r.retransmitted == 0));
        assert_eq!(run.reports[2].dropped, vec![12..16]);
        let want = reference(&x, |q, i| q == 2 && (12..16).contains(&i));
        for got in &run.results {
            assert_eq!(bits(got), bits(&want));
        }
    }

    #[test]
    fn reliable_mode_waits_for_a_straggler_without_nacking_packets_in_flight() {
        let x = inputs(3, 100, 9);
        let t = tensors(100);
        let run = simulate(&x, &t, &cfg(0.0), 3, straggle);
        assert_eq!(run.finished[0], Duration::from_millis(100));
        assert!(run
            .reports
            .iter()
            .all(|r| r.retransmitted == 0 && r.nack_rounds == 0));
        let want = reference(&x, |_, _| false);
        for got in &run.results {
            assert_eq!(bits(got), bits(&want));
        }
    }

    /// A machine of rank 0 in a world of 3 (n = 30, mtu 4) and a valid packet from rank 1.
    fn victim(data: &mut [f32]) -> (DlcpAllReduce<'_>, Message) {
        let t = tensors(30);
        let c = cfg(0.1);
        let m = DlcpAllReduce::new(0, 3, 5, data, &t, &c, 7, Instant::now());
        let mut other = vec![1.0f32; 30];
        let mut peer = DlcpAllReduce::new(1, 3, 5, &mut other, &t, &c, 7, Instant::now());
        peer.handle_timeout(Instant::now());
        let pk = std::iter::from_fn(|| peer.poll_transmit())
            .find(|(to, _)| *to == 0)
            .unwrap()
            .1;
        (m, pk)
    }

    fn with_payload(msg: &Message, f: impl FnOnce(&mut Vec<u8>)) -> Message {
        let mut p = msg.payload().to_vec();
        f(&mut p);
        Message::new(*msg.header(), &p)
    }

    #[test]
    fn bad_input_is_an_error_naming_the_peer() {
        let mut d = vec![0.0f32; 30];
        let (mut m, pk) = victim(&mut d);
        let h = *pk.header();
        let cases: Vec<(&str, Message)> = vec![
            (
                "marker for another",
                Message::new(
                    Header {
                        phase: SENT,
                        root: 2,
                        ..h
                    },
                    &[],
                ),
            ),
            ("truncated", with_payload(&pk, |p| p.truncate(20))),
            ("odd body", with_payload(&pk, |p| p.push(0))),
            (
                "slot out of range",
                with_payload(&pk, |p| p[24..28].copy_from_slice(&999u32.to_le_bytes())),
            ),
            ("wrong offset", with_payload(&pk, |p| p[16] ^= 1)),
            ("wrong sender", with_payload(&pk, |p| p[32] = 2)),
            ("future round", with_payload(&pk, |p| p[0] = 6)),
            (
                "nan prio",
                with_payload(&pk, |p| {
                    p[28..32].copy_from_slice(&f32::NAN.to_bits().to_le_bytes())
                }),
            ),
            (
                "wrong segment",
                Message::new(Header { root: 2, ..h }, pk.payload()),
            ),
            (
                "unknown phase",
                Message::new(Header { phase: 9, ..h }, pk.payload()),
            ),
            (
                "nack out of range",
                Message::new(
                    Header {
                        phase: NACK,
                        root: 1,
                        ..h
                    },
                    &77u32.to_le_bytes(),
                ),
            ),
            (
                "nack ragged",
                Message::new(
                    Header {
                        phase: NACK,
                        root: 1,
                        ..h
                    },
                    &[1, 2],
                ),
            ),
            (
                "used short",
                Message::new(
                    Header {
                        phase: USED,
                        root: 1,
                        ..h
                    },
                    &[],
                ),
            ),
            (
                "reduced first",
                Message::new(
                    Header {
                        phase: REDUCED,
                        root: 1,
                        offset: 10,
                        ..h
                    },
                    &[0; 28],
                ),
            ),
            (
                "control for another",
                Message::new(
                    Header {
                        phase: USED,
                        root: 2,
                        ..h
                    },
                    &[0; 3],
                ),
            ),
        ];
        for (what, msg) in cases {
            let e = m.handle(1, msg).expect_err(what);
            assert_eq!(e.peer(), 1, "{what}: {e}");
        }
        let e = m
            .handle(1, Message::new(Header { step: 3, ..h }, pk.payload()))
            .unwrap_err();
        assert!(matches!(e, AlgoError::Mismatch { peer: 1, .. }), "{e}");
        // Nothing above was taken; the genuine packet still is, once; a stale one is ignored.
        m.handle(1, pk.clone()).unwrap();
        m.handle(1, pk.clone()).unwrap();
        m.handle(1, with_payload(&pk, |p| p[0] = 4)).unwrap();
        assert_eq!(m.report.ignored, 2);
        assert_eq!(m.total_missing, 2 * 3 - 1);
    }
}
