//! Shared-memory driver for ranks on one host (Linux): messages move through byte rings in
//! `/dev/shm` mappings, so a same-host collective costs memory copies, not system calls.
//!
//! # Layout
//! Every rank creates one segment (a file in [`ShmConfig::dir`], mode 0600, created
//! exclusively, named after a hash of the run id and the rank: [`ShmConfig::segment_path`])
//! holding one single-producer single-consumer byte ring per sender, and maps the header
//! and its own ring of every peer's segment. A ring carries the stream drivers' frames
//! ([`crate::frame`]: length, tag, message) — the same bytes a TCP connection would carry,
//! counted the same way by [`Transport::bytes`] — so a message of any size up to
//! [`ShmConfig::max_frame`] streams through a ring of any size. Ring layout and the
//! wake-up protocol are described in `segment.rs`.
//!
//! # Set-up
//! [`ShmTransport::connect`] creates this rank's segment, opens every peer's (retrying
//! until it appears), checks its header — magic, layout version, world size, rank, and a
//! hash of the run token (a segment of another token is refused with
//! [`TransportError::Handshake`] naming the peer) — marks itself attached, waits until
//! every peer has attached to its own segment and then removes the segment's name: once
//! the mesh is up nothing is left in `/dev/shm`, and a failed set-up removes what it
//! created. [`ShmConfig::from_joined`] derives the run id from a finished rendezvous, so a
//! launcher can pick this driver when all ranks are on one host; [`shm_mesh`] builds a
//! mesh of ranks as threads of one process (tests, simulation).
//!
//! # Data path
//! [`Transport::send`] copies the frame straight into the peer's ring when nothing is
//! queued for that peer (no thread hand-off, no system call unless the receiver sleeps);
//! what does not fit is queued, and a writer thread per peer streams it as space frees up
//! — so `send` never waits for the peer. While the caller's thread is in the transport
//! anyway (waiting in `recv`, or sending), it moves queued frames itself, so that on a
//! busy host progress does not wait for the writer thread to be scheduled; a flag in the
//! queue's lock keeps the two off the ring's producer side at the same time. With
//! [`ShmConfig::link`] set, every frame is stamped with its release time on the rank's
//! emulated egress link ([`crate::shaping`]) and written no earlier. [`Transport::recv`]
//! copies frames out of the rings on the caller's thread into buffers from the crate's
//! pool (the sender gives its message buffers back to the pool once copied, so in a ring
//! collective the same few chunk buffers circulate); messages from peers that
//! `recv_from` does not ask for stay in their rings.
//!
//! # Waiting
//! A receiver with nothing to read spins for a few microseconds ([`ShmConfig::spin`]; not
//! when the ranks outnumber the CPUs), then sleeps on its
//! doorbell (a process-shared futex every sender rings after publishing bytes; the ring
//! costs a system call only while the receiver sleeps). A writer facing a full ring does
//! the same on the ring's space word. Sleeps are bounded by the deadline and by
//! [`ShmConfig::liveness_interval`].
//!
//! # Liveness
//! Dropping a transport flushes what is queued (for up to [`ShmConfig::linger`]), marks
//! each of its rings closed after the last byte, and marks its segment closed; peers
//! report it as [`TransportError::Closed`] after every message it sent. A peer process
//! that dies without dropping (`SIGKILL`, abort) is noticed through a pidfd at the next
//! liveness check, so it is reported as closed within about
//! [`ShmConfig::liveness_interval`].
//!
//! # Files
//! `config.rs` ([`ShmConfig`], and the checks a launcher makes around this driver),
//! `setup.rs` (opening the peers' segments, waiting for attachment), `outbound.rs` (the
//! send queue and writer thread per peer), `inbound.rs` (frame reassembly per peer),
//! `segment.rs` (segment and ring layout, wake-up protocol), `sys.rs` (every system call
//! and `unsafe` block); this file holds [`ShmTransport`] itself.

mod config;
mod inbound;
mod outbound;
mod segment;
mod setup;
mod sys;

use std::sync::atomic::Ordering::*;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use self::inbound::{Inbound, Polled};
use self::outbound::{writer_loop, Outbound};
use self::segment::{spin_until_changed, Header, Segment};
use self::setup::{await_attached, open_peers};
use self::sys::Process;
use super::{check_frame, check_peer, ByteCount, Transport, TransportError};
use crate::frame::FRAME_HEADER_LEN;
use crate::shaping::Shaper;

pub use self::config::{free_bytes, leftover_segments, same_host, ShmConfig, DEFAULT_SPIN};

/// One rank of a shared-memory mesh (see the [module docs](self)).
#[derive(Debug)]
pub struct ShmTransport {
    rank: usize,
    world: usize,
    max_frame: usize,
    linger: Duration,
    spin: Duration,
    liveness: Duration,
    /// This rank's segment header (doorbell); `None` for a world of one.
    own: Option<Header>,
    inbound: Vec<Option<Inbound>>,
    outbound: Vec<Option<Arc<Outbound>>>,
    writers: Vec<JoinHandle<()>>,
    /// Disconnects once every writer thread has returned.
    writers_done: mpsc::Receiver<()>,
    shaper: Option<Shaper>,
    sent: u64,
    received: u64,
    /// Where the next `recv` starts looking (round robin over peers).
    next: usize,
    next_check: Instant,
}

impl ShmTransport {
    /// Connects rank `rank` of `world` (all on this host, all with the same
    /// [`ShmConfig::run_id`] and token). Blocks until every peer has attached, or fails
    /// after [`ShmConfig::connect_timeout`] naming the missing ranks; a peer whose segment
    /// carries another token is refused at once with [`TransportError::Handshake`].
    pub fn connect(rank: usize, world: usize, cfg: ShmConfig) -> Result<Self, TransportError> {
        if rank >= world {
            return Err(TransportError::InvalidRank { rank, world });
        }
        if world > u32::MAX as usize {
            return Err(TransportError::Handshake {
                peer: "config".into(),
                detail: format!("world size {world} too large"),
            });
        }
        let deadline = Instant::now() + cfg.connect_timeout;
        let (done_tx, writers_done) = mpsc::channel();
        let mut t = ShmTransport {
            rank,
            world,
            max_frame: cfg.max_frame,
            linger: cfg.linger,
            spin: cfg.spin_for(world),
            liveness: cfg.liveness_interval.max(Duration::from_millis(1)),
            own: None,
            inbound: (0..world).map(|_| None).collect(),
            outbound: (0..world).map(|_| None).collect(),
            writers: Vec::new(),
            writers_done,
            shaper: Shaper::new(&cfg.link),
            sent: 0,
            received: 0,
            next: 0,
            next_check: Instant::now(),
        };
        if world == 1 {
            return Ok(t);
        }
        let token_hash = cfg.token_hash();
        let (own, mut unlink) = segment::create(
            &cfg.segment_path(rank),
            rank,
            world,
            cfg.ring_capacity(),
            &token_hash,
        )?;
        let mut peers: Vec<Option<Segment>> = (0..world).map(|_| None).collect();
        let r = open_peers(&cfg, rank, &token_hash, &own.header, deadline, &mut peers)
            .and_then(|()| await_attached(&own, &peers, rank, &cfg, deadline));
        if let Err(e) = r {
            // Whoever attached already learns that this rank is gone.
            own.header.get().meta.0.closed.store(1, Release);
            for seg in peers.iter().flatten() {
                seg.rings[0].close_producer(&seg.header);
            }
            return Err(e);
        }
        unlink.now();
        t.start(own, peers, done_tx)?;
        Ok(t)
    }

    /// Wires the rings of a formed mesh and starts one writer thread per peer.
    fn start(
        &mut self,
        own: Segment,
        peers: Vec<Option<Segment>>,
        done_tx: mpsc::Sender<()>,
    ) -> Result<(), TransportError> {
        let rank = self.rank;
        let mut processes: Vec<Option<Arc<Process>>> = (0..self.world).map(|_| None).collect();
        for (p, seg) in peers.into_iter().enumerate() {
            let Some(seg) = seg else { continue };
            processes[p] = Some(Arc::new(Process::new(seg.header.pid())));
            let ring = seg
                .rings
                .into_iter()
                .next()
                .expect("one ring per peer segment");
            self.outbound[p] = Some(Arc::new(Outbound::new(
                ring,
                seg.header,
                processes[p].clone().expect("just set"),
                self.spin,
                self.liveness,
            )));
        }
        for (s, ring) in own.rings.into_iter().enumerate() {
            let p = if s < rank { s } else { s + 1 };
            self.inbound[p] = Some(Inbound::new(
                ring,
                processes[p].clone().expect("every peer opened"),
            ));
        }
        self.own = Some(own.header);
        for (p, out) in self.outbound.iter().enumerate() {
            let Some(out) = out else { continue };
            let (o, done) = (out.clone(), done_tx.clone());
            self.writers.push(
                std::thread::Builder::new()
                    .name(format!("dtrain-shm-wr{p}"))
                    .spawn(move || writer_loop(o, done))?,
            );
        }
        Ok(())
    }

    /// Capacity of the rings this rank receives on (after rounding), 0 for a world of one.
    pub fn ring_bytes(&self) -> usize {
        self.inbound
            .iter()
            .flatten()
            .map(|i| i.ring.capacity())
            .next()
            .unwrap_or(0)
    }

    /// A handle that wakes this rank's receiver from another thread of this process: it
    /// rings the doorbell every sender rings, so a [`ShmTransport::recv_or`] asleep on it
    /// re-checks its `interrupt` (the hybrid driver's TCP readers call it after queuing a
    /// message). `None` for a world of one (nothing to wake: no doorbell).
    pub(crate) fn waker(&self) -> Option<impl Fn() + Send + Sync + 'static> {
        let own = self.own.clone()?;
        Some(move || own.get().bell.0.notify())
    }

    /// [`Transport::recv`] (from any peer, or only from `only`) that also returns
    /// `Ok(None)` once `interrupt` returns true: for a receiver that waits on these rings
    /// and on something else. Whatever changes that something must call
    /// [`ShmTransport::waker`]'s handle after the change is visible to `interrupt`, so no
    /// wake-up is lost between the check and the sleep.
    pub(crate) fn recv_or(
        &mut self,
        only: Option<usize>,
        deadline: Instant,
        interrupt: &dyn Fn() -> bool,
    ) -> Result<Option<(usize, Vec<u8>)>, TransportError> {
        if let Some(from) = only {
            check_peer(from, self.rank, self.world)?;
        }
        self.recv_inner(only, deadline, Some(interrupt))
    }

    /// Marks peers whose process exited as dead (both directions).
    fn check_liveness(&mut self) {
        for (inb, out) in self.inbound.iter_mut().zip(&self.outbound) {
            let (Some(inb), Some(out)) = (inb, out) else {
                continue;
            };
            if !inb.dead && !inb.reported && !inb.process.is_alive() {
                inb.dead = true;
                out.mark_dead();
            }
        }
    }

    /// Moves frames queued for any peer into its ring, as far as they fit; returns whether
    /// it wrote anything.
    fn pump_all(&self) -> bool {
        let mut wrote = 0;
        for out in self.outbound.iter().flatten() {
            if out.has_queued() {
                wrote += out.pump_counting(true).1;
            }
        }
        wrote > 0
    }

    /// Polls the inbound rings (all, or only `only`), round robin.
    fn poll(&mut self, only: Option<usize>) -> Option<Result<(usize, Vec<u8>), TransportError>> {
        for k in 0..self.world {
            let p = (self.next + k) % self.world;
            if only.is_some_and(|o| o != p) {
                continue;
            }
            let Some(inb) = self.inbound[p].as_mut() else {
                continue;
            };
            if inb.reported {
                if only.is_some() {
                    return Some(Err(TransportError::Closed { rank: p }));
                }
                continue;
            }
            match inb.poll(p, self.max_frame) {
                Polled::Msg(m) => {
                    self.received += (m.len() + FRAME_HEADER_LEN) as u64;
                    self.next = (p + 1) % self.world;
                    return Some(Ok((p, m)));
                }
                Polled::Closed => {
                    inb.reported = true;
                    return Some(Err(TransportError::Closed { rank: p }));
                }
                Polled::Nothing => {}
            }
        }
        None
    }

    /// The next message (from `only`, or from any peer), waiting until `deadline`; with
    /// `interrupt`, `Ok(None)` as soon as it returns true (checked whenever no message is
    /// ready, and again after every ring of the doorbell: see [`ShmTransport::waker`]).
    fn recv_inner(
        &mut self,
        only: Option<usize>,
        deadline: Instant,
        interrupt: Option<&dyn Fn() -> bool>,
    ) -> Result<Option<(usize, Vec<u8>)>, TransportError> {
        let Some(own) = self.own.clone() else {
            std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
            return Err(TransportError::Timeout);
        };
        let bell = &own.get().bell.0;
        loop {
            let seen = bell.word.load(SeqCst);
            if let Some(r) = self.poll(only) {
                return r.map(Some);
            }
            let now = Instant::now();
            if now >= self.next_check {
                self.next_check = now + self.liveness;
                self.check_liveness();
                if let Some(r) = self.poll(only) {
                    return r.map(Some);
                }
            }
            if interrupt.is_some_and(|stop| stop()) {
                return Ok(None);
            }
            if now >= deadline {
                return Err(TransportError::Timeout);
            }
            if self.pump_all() {
                continue;
            }
            if spin_until_changed(&bell.word, seen, self.spin) {
                continue;
            }
            bell.sleeping.store(1, SeqCst);
            if bell.word.load(SeqCst) == seen {
                let until = deadline.min(self.next_check);
                sys::futex_wait(
                    &bell.word,
                    seen,
                    until.saturating_duration_since(Instant::now()),
                );
            }
            bell.sleeping.store(0, SeqCst);
        }
    }
}

impl Transport for ShmTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn send(&mut self, to: usize, msg: Vec<u8>) -> Result<(), TransportError> {
        check_peer(to, self.rank, self.world)?;
        check_frame(msg.len(), self.max_frame)?;
        let out = self.outbound[to]
            .as_ref()
            .ok_or(TransportError::Closed { rank: to })?;
        out.check_open(to)?;
        let len = msg.len() + FRAME_HEADER_LEN;
        let release = self.shaper.as_mut().map(|s| s.release(Instant::now(), len));
        out.send(to, msg, release)?;
        self.sent += len as u64;
        Ok(())
    }

    fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
        self.recv_inner(None, deadline, None)?
            .ok_or(TransportError::Timeout)
    }

    fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError> {
        check_peer(from, self.rank, self.world)?;
        self.recv_inner(Some(from), deadline, None)?
            .map(|(_, m)| m)
            .ok_or(TransportError::Timeout)
    }

    fn bytes(&self) -> ByteCount {
        ByteCount {
            sent: self.sent,
            received: self.received,
        }
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        // Let every writer flush its queue and close its ring (up to the linger time),
        // then stop the ones still stuck (a peer that stopped reading).
        for out in self.outbound.iter().flatten() {
            out.start_closing();
        }
        // Nothing is ever sent on `writers_done`: it disconnects when the last writer
        // returns (no writers: set-up failed, or a world of one).
        if !self.writers.is_empty() {
            let _ = self.writers_done.recv_timeout(self.linger);
        }
        for out in self.outbound.iter().flatten() {
            out.stop();
        }
        // Tell peers' writers blocked on this rank's rings that nobody will read them.
        if let Some(own) = &self.own {
            own.get().meta.0.closed.store(1, Release);
        }
        for inb in self.inbound.iter().flatten() {
            inb.ring.ctl().space.0.notify();
        }
        for t in self.writers.drain(..) {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// Builds a mesh of `world` ranks as threads of this process (tests, single-process
/// simulation); element `r` is rank `r`. Every rank uses `cfg`.
pub fn shm_mesh(world: usize, cfg: ShmConfig) -> Result<Vec<ShmTransport>, TransportError> {
    let hs: Vec<_> = (0..world)
        .map(|r| {
            let cfg = cfg.clone();
            std::thread::Builder::new()
                .name(format!("dtrain-shm-connect{r}"))
                .spawn(move || ShmTransport::connect(r, world, cfg))
        })
        .collect::<Result<_, _>>()?;
    hs.into_iter()
        .map(|h| h.join().expect("connect thread panicked"))
        .collect()
}
