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

mod segment;
mod sys;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tracing::warn;

use self::segment::{Header, Ring, Segment};
use self::sys::Process;
use super::{check_peer, ByteCount, Transport, TransportError};
use crate::frame::{self, FRAME_HEADER_LEN, TAG_DATA};
use crate::pool;
use crate::shaping::{LinkSpec, Shaper};

/// Spin time before sleeping when the host has a CPU per rank (see [`ShmConfig::spin`]).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(20);

/// Configuration of a [`ShmTransport`].
#[derive(Clone, PartialEq)]
pub struct ShmConfig {
    /// The run token: a peer's segment must carry its hash.
    pub token: Vec<u8>,
    /// Identifies the run among others on the host (segment names derive from it); every
    /// rank of a run must use the same value, and concurrent runs different ones.
    pub run_id: Vec<u8>,
    /// Capacity of each ring (one per ordered pair of ranks), rounded up to a power of two
    /// of at least 4 KiB. A host holds `N·(N−1)` rings, reserved up front. Default 4 MiB.
    pub ring_bytes: usize,
    /// Largest message sent or accepted, in bytes after the length prefix (as for TCP).
    /// Default 64 MiB.
    pub max_frame: usize,
    /// How long set-up may take. Default 30 s.
    pub connect_timeout: Duration,
    /// How long dropping the transport waits to flush queued frames. Default 10 s.
    pub linger: Duration,
    /// Egress link emulation of this rank (see [`crate::shaping`]). Default unshaped.
    pub link: LinkSpec,
    /// How long a waiting receiver or writer spins before it sleeps. Default `None`:
    /// [`DEFAULT_SPIN`] when the host has at least as many CPUs as the world has ranks,
    /// else no spinning (a spinning rank would take the CPU of the rank it waits for).
    pub spin: Option<Duration>,
    /// How often a waiting rank checks that its peers' processes are alive, and so the
    /// bound on noticing a killed peer. Default 50 ms.
    pub liveness_interval: Duration,
    /// Directory of the segments (a tmpfs). Default `/dev/shm`.
    pub dir: PathBuf,
}

impl std::fmt::Debug for ShmConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmConfig")
            .field("token", &"<redacted>")
            .field("run_id", &String::from_utf8_lossy(&self.run_id))
            .field("ring_bytes", &self.ring_bytes)
            .field("max_frame", &self.max_frame)
            .field("connect_timeout", &self.connect_timeout)
            .field("linger", &self.linger)
            .field("link", &self.link)
            .field("spin", &self.spin)
            .field("liveness_interval", &self.liveness_interval)
            .field("dir", &self.dir)
            .finish()
    }
}

impl ShmConfig {
    /// Defaults with the given run token and run id.
    pub fn new(token: impl Into<Vec<u8>>, run_id: impl Into<Vec<u8>>) -> Self {
        ShmConfig {
            token: token.into(),
            run_id: run_id.into(),
            ring_bytes: 4 << 20,
            max_frame: 64 << 20,
            connect_timeout: Duration::from_secs(30),
            linger: Duration::from_secs(10),
            link: LinkSpec::default(),
            spin: None,
            liveness_interval: Duration::from_millis(50),
            dir: PathBuf::from("/dev/shm"),
        }
    }

    /// Defaults for the ranks of a finished rendezvous: the run id is derived from what
    /// every rank received (all ranks' addresses and the run certificate), which no other
    /// live run shares.
    #[cfg(feature = "tcp")]
    pub fn from_joined(token: impl Into<Vec<u8>>, joined: &crate::rendezvous::Joined) -> Self {
        let mut id = Sha256::new();
        id.update(b"dtrain-shm rendezvous run\0");
        id.update((joined.world as u64).to_le_bytes());
        for a in &joined.peers {
            id.update(a.to_string().as_bytes());
            id.update([0]);
        }
        id.update(&joined.identity.cert_der);
        Self::new(token, hex(&id.finalize()[..16]))
    }

    /// The path of `rank`'s segment while the mesh forms (removed once every peer mapped
    /// it, or when set-up fails).
    pub fn segment_path(&self, rank: usize) -> PathBuf {
        let mut h = Sha256::new();
        h.update(b"dtrain-shm run id\0");
        h.update(&self.run_id);
        self.dir
            .join(format!("dtrain-{}-{rank}", hex(&h.finalize()[..8])))
    }

    fn token_hash(&self) -> [u64; 4] {
        let mut h = Sha256::new();
        h.update(b"dtrain-shm run token\0");
        h.update(&self.token);
        let d = h.finalize();
        std::array::from_fn(|i| u64::from_le_bytes(d[i * 8..i * 8 + 8].try_into().expect("8")))
    }

    /// The spin time for a world of `world` ranks (see [`ShmConfig::spin`]).
    pub fn spin_for(&self, world: usize) -> Duration {
        self.spin.unwrap_or_else(|| {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            if world <= cpus {
                DEFAULT_SPIN
            } else {
                Duration::ZERO
            }
        })
    }

    /// Bytes of [`ShmConfig::dir`] a mesh of `world` ranks reserves with this configuration
    /// (every rank's segment: a header page, and a control page and a ring per peer), so a
    /// launcher can check the space before it picks this driver.
    pub fn mesh_bytes(&self, world: usize) -> u64 {
        world as u64 * segment::segment_len(world, self.ring_capacity()) as u64
    }

    fn ring_capacity(&self) -> usize {
        self.ring_bytes
            .clamp(segment::PAGE, 1 << 30)
            .next_power_of_two()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A frame queued for a peer.
#[derive(Debug)]
struct Outgoing {
    /// When the emulated link delivers it (`None`: at once).
    release: Option<Instant>,
    msg: Vec<u8>,
    /// Frame bytes (prefix included) already in the ring.
    done: usize,
}

#[derive(Debug, Default)]
struct OutState {
    queue: VecDeque<Outgoing>,
    /// Someone (the caller's thread or the writer thread) is copying the front frame into
    /// the ring, outside the lock: only they touch the producer side.
    writing: bool,
    /// The transport is dropping: flush and exit.
    closing: bool,
}

/// What one [`Outbound::pump`] left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pump {
    /// Everything queued is in the ring.
    Empty,
    /// The other thread is writing.
    Busy,
    /// The front frame is held until its emulated release time.
    Hold(Instant),
    /// The ring is full.
    Full,
    /// The peer is gone.
    Gone,
}

/// The sending side towards one peer, shared with its writer thread.
#[derive(Debug)]
struct Outbound {
    ring: Ring,
    /// The peer's segment header (doorbell, closed flag).
    peer: Header,
    process: Arc<Process>,
    state: Mutex<OutState>,
    /// Frames queued and not completely written (a lock-free hint for the caller).
    queued: AtomicUsize,
    cv: Condvar,
    /// The peer is gone (closed its segment, or its process exited).
    dead: AtomicBool,
    /// Give up writing (linger expired).
    stop: AtomicBool,
    spin: Duration,
    liveness: Duration,
}

impl Outbound {
    fn lock(&self) -> MutexGuard<'_, OutState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn peer_gone(&self) -> bool {
        self.dead.load(Acquire) || self.peer.owner_closed()
    }

    /// Moves queued frames into the ring as far as they fit, without waiting. Called by
    /// the writer thread, and by the caller's thread whenever it is in the transport
    /// anyway (so that on a busy host progress does not wait for the writer thread to be
    /// scheduled); the caller's thread passes `hand_over`, so that frames it leaves queued
    /// are handed to the writer thread.
    fn pump(&self, hand_over: bool) -> Pump {
        self.pump_counting(hand_over).0
    }

    /// [`Outbound::pump`], also returning how many bytes it wrote.
    fn pump_counting(&self, hand_over: bool) -> (Pump, usize) {
        let mut wrote = 0;
        let mut g = self.lock();
        let state = loop {
            if self.peer_gone() {
                break Pump::Gone;
            }
            if g.writing {
                break Pump::Busy;
            }
            let Some(front) = g.queue.front() else {
                break Pump::Empty;
            };
            if let Some(at) = front.release {
                if Instant::now() < at {
                    break Pump::Hold(at);
                }
            }
            let mut o = g.queue.pop_front().expect("front exists");
            g.writing = true;
            drop(g);
            let n = self
                .ring
                .write([&frame::data_prefix(o.msg.len()), &o.msg], o.done);
            if n > 0 {
                self.peer.get().bell.0.notify();
            }
            wrote += n;
            o.done += n;
            if o.done == o.msg.len() + FRAME_HEADER_LEN {
                pool::put(o.msg);
                g = self.lock();
                g.writing = false;
                self.queued.fetch_sub(1, Release);
                continue;
            }
            g = self.lock();
            g.writing = false;
            g.queue.push_front(o);
            break Pump::Full;
        };
        if hand_over && matches!(state, Pump::Full | Pump::Hold(_)) {
            // The writer thread may be waiting for this thread to let go of the ring.
            drop(g);
            self.cv.notify_one();
        }
        (state, wrote)
    }

    /// Marks the peer gone and drops what is queued.
    fn fail(&self) {
        self.dead.store(true, Release);
        let mut g = self.lock();
        for o in g.queue.drain(..) {
            pool::put(o.msg);
        }
        self.queued.store(0, Release);
    }
}

/// Spins until `word` differs from `seen` or `spin` passes; returns whether it changed.
fn spin_until_changed(word: &std::sync::atomic::AtomicU32, seen: u32, spin: Duration) -> bool {
    if spin.is_zero() {
        return false;
    }
    let end = Instant::now() + spin;
    loop {
        for _ in 0..64 {
            if word.load(Relaxed) != seen {
                return true;
            }
            std::hint::spin_loop();
        }
        if Instant::now() >= end {
            return false;
        }
    }
}

/// The writer thread of one peer: moves queued frames into the ring, waiting for space
/// or release times, until the transport drops and the queue is flushed (or the linger
/// time runs out, or the peer goes away); then marks the ring closed.
fn writer_loop(out: Arc<Outbound>, done: mpsc::Sender<()>) {
    let space = &out.ring.ctl().space.0;
    let mut next_check = Instant::now() + out.liveness;
    let ok = loop {
        if out.stop.load(Acquire) {
            break false;
        }
        let seen = space.word.load(SeqCst);
        match out.pump(false) {
            Pump::Gone => break false,
            Pump::Empty | Pump::Busy => {
                let g = out.lock();
                if g.closing && g.queue.is_empty() && !g.writing {
                    break true;
                }
                if (g.queue.is_empty() || g.writing) && !out.stop.load(Acquire) {
                    drop(out.cv.wait(g).unwrap_or_else(|e| e.into_inner()));
                }
            }
            Pump::Hold(at) => {
                let g = out.lock();
                let wait = at.saturating_duration_since(Instant::now());
                if !out.stop.load(Acquire) {
                    drop(
                        out.cv
                            .wait_timeout(g, wait)
                            .unwrap_or_else(|e| e.into_inner()),
                    );
                }
            }
            Pump::Full => {
                let now = Instant::now();
                if now >= next_check {
                    if !out.process.is_alive() {
                        break false;
                    }
                    next_check = now + out.liveness;
                }
                if spin_until_changed(&space.word, seen, out.spin) {
                    continue;
                }
                space.sleeping.store(1, SeqCst);
                if space.word.load(SeqCst) == seen {
                    sys::futex_wait(&space.word, seen, next_check.saturating_duration_since(now));
                }
                space.sleeping.store(0, SeqCst);
            }
        }
    };
    if !ok {
        out.fail();
    }
    out.ring.close_producer(&out.peer);
    drop(done);
}

/// Frame reassembly state of one inbound ring.
#[derive(Debug)]
enum Partial {
    /// Reading the frame prefix.
    Prefix([u8; FRAME_HEADER_LEN], usize),
    /// Reading a message of `buf.len()` bytes, `have` so far.
    Body(Vec<u8>, usize),
}

/// The receiving side from one peer.
#[derive(Debug)]
struct Inbound {
    ring: Ring,
    process: Arc<Process>,
    partial: Partial,
    /// The peer's process exited (checked by [`ShmTransport::check_liveness`]).
    dead: bool,
    /// The close was reported.
    reported: bool,
}

/// What polling one inbound ring gave.
enum Polled {
    Msg(Vec<u8>),
    Closed,
    Nothing,
}

impl Inbound {
    /// Takes what the ring holds: a whole message, the peer's close (once the ring is
    /// drained), or nothing yet.
    fn poll(&mut self, from: usize, max_frame: usize) -> Polled {
        loop {
            let avail = self.ring.readable();
            if avail == 0 {
                // The closed flag is set after the last byte: check the ring again after it.
                if (self.dead || self.ring.producer_closed()) && self.ring.readable() == 0 {
                    if let Partial::Body(b, _) = std::mem::replace(
                        &mut self.partial,
                        Partial::Prefix([0; FRAME_HEADER_LEN], 0),
                    ) {
                        pool::put(b);
                    }
                    return Polled::Closed;
                }
                if avail == self.ring.readable() {
                    return Polled::Nothing;
                }
                continue;
            }
            match &mut self.partial {
                Partial::Prefix(p, have) => {
                    let n = (FRAME_HEADER_LEN - *have).min(avail);
                    self.ring.copy_out(0, &mut p[*have..*have + n]);
                    self.ring.consume(n);
                    *have += n;
                    if *have < FRAME_HEADER_LEN {
                        continue;
                    }
                    let len = u32::from_le_bytes(p[..4].try_into().expect("4 bytes")) as usize;
                    if len == 0 || p[4] != TAG_DATA || len - 1 > max_frame {
                        warn!(
                            "shared-memory ring from rank {from}: malformed frame \
                             (length {len}, tag {}); treating the peer as closed",
                            p[4]
                        );
                        self.dead = true;
                        self.partial = Partial::Prefix([0; FRAME_HEADER_LEN], 0);
                        return Polled::Closed;
                    }
                    self.partial = Partial::Body(pool::take_filled(len - 1), 0);
                }
                Partial::Body(b, have) => {
                    let n = (b.len() - *have).min(avail);
                    self.ring.copy_out(0, &mut b[*have..*have + n]);
                    self.ring.consume(n);
                    *have += n;
                }
            }
            if let Partial::Body(b, have) = &self.partial {
                if *have == b.len() {
                    let Partial::Body(b, _) = std::mem::replace(
                        &mut self.partial,
                        Partial::Prefix([0; FRAME_HEADER_LEN], 0),
                    ) else {
                        unreachable!("checked above")
                    };
                    return Polled::Msg(b);
                }
            }
        }
    }
}

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
            self.outbound[p] = Some(Arc::new(Outbound {
                ring,
                peer: seg.header,
                process: processes[p].clone().expect("just set"),
                state: Mutex::new(OutState::default()),
                queued: AtomicUsize::new(0),
                cv: Condvar::new(),
                dead: AtomicBool::new(false),
                stop: AtomicBool::new(false),
                spin: self.spin,
                liveness: self.liveness,
            }));
        }
        for (s, ring) in own.rings.into_iter().enumerate() {
            let p = if s < rank { s } else { s + 1 };
            self.inbound[p] = Some(Inbound {
                ring,
                process: processes[p].clone().expect("every peer opened"),
                partial: Partial::Prefix([0; FRAME_HEADER_LEN], 0),
                dead: false,
                reported: false,
            });
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

    /// Marks peers whose process exited as dead (both directions).
    fn check_liveness(&mut self) {
        for (inb, out) in self.inbound.iter_mut().zip(&self.outbound) {
            let (Some(inb), Some(out)) = (inb, out) else {
                continue;
            };
            if !inb.dead && !inb.reported && !inb.process.is_alive() {
                inb.dead = true;
                out.dead.store(true, Release);
                out.cv.notify_all();
            }
        }
    }

    /// Moves frames queued for any peer into its ring, as far as they fit; returns whether
    /// it wrote anything.
    fn pump_all(&self) -> bool {
        let mut wrote = 0;
        for out in self.outbound.iter().flatten() {
            if out.queued.load(Acquire) > 0 {
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

    fn recv_inner(
        &mut self,
        only: Option<usize>,
        deadline: Instant,
    ) -> Result<(usize, Vec<u8>), TransportError> {
        let Some(own) = self.own.clone() else {
            std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
            return Err(TransportError::Timeout);
        };
        let bell = &own.get().bell.0;
        loop {
            let seen = bell.word.load(SeqCst);
            if let Some(r) = self.poll(only) {
                return r;
            }
            let now = Instant::now();
            if now >= self.next_check {
                self.next_check = now + self.liveness;
                self.check_liveness();
                if let Some(r) = self.poll(only) {
                    return r;
                }
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

/// Opens every peer's segment (retrying until it exists), checks it and attaches to this
/// rank's ring in it; `segs[p]` receives peer `p`'s.
fn open_peers(
    cfg: &ShmConfig,
    rank: usize,
    token_hash: &[u64; 4],
    own: &Header,
    deadline: Instant,
    segs: &mut [Option<Segment>],
) -> Result<(), TransportError> {
    let world = segs.len();
    let mut missing: Vec<usize> = (0..world).filter(|&p| p != rank).collect();
    let mut pause = Duration::from_micros(200);
    loop {
        let mut still = Vec::new();
        for p in missing {
            match segment::open(&cfg.segment_path(p), p, rank, world, token_hash)? {
                Some(seg) => {
                    if !Process::new(seg.header.pid()).is_alive() {
                        return Err(died_during_setup(cfg, p));
                    }
                    let prod = &seg.rings[0].ctl().prod.0;
                    prod.attached.store(1, Release);
                    seg.header.get().bell.0.notify();
                    segs[p] = Some(seg);
                }
                None => still.push(p),
            }
        }
        missing = still;
        if missing.is_empty() {
            return Ok(());
        }
        for (p, seg) in segs.iter().enumerate() {
            if seg
                .as_ref()
                .is_some_and(|s| !Process::new(s.header.pid()).is_alive())
            {
                return Err(died_during_setup(cfg, p));
            }
        }
        if own.owner_closed() || Instant::now() >= deadline {
            return Err(TransportError::Handshake {
                peer: format!("rank(s) {missing:?}"),
                detail: format!(
                    "no shared-memory segment appeared within {:?} (not on this host, or \
                     not started?)",
                    cfg.connect_timeout
                ),
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(5));
    }
}

/// Waits until every peer has attached to this rank's segment; fails early if a peer
/// whose segment is open here exits first.
fn await_attached(
    own: &Segment,
    peers: &[Option<Segment>],
    rank: usize,
    cfg: &ShmConfig,
    deadline: Instant,
) -> Result<(), TransportError> {
    let bell = &own.header.get().bell.0;
    let processes: Vec<Option<Process>> = peers
        .iter()
        .map(|s| s.as_ref().map(|s| Process::new(s.header.pid())))
        .collect();
    loop {
        let seen = bell.word.load(SeqCst);
        let missing: Vec<usize> = (0..peers.len())
            .filter(|&p| p != rank)
            .filter(|&p| {
                let ring = &own.rings[segment::slot(p, rank)];
                ring.ctl().prod.0.attached.load(Acquire) == 0
            })
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        for &p in &missing {
            if processes[p].as_ref().is_some_and(|x| !x.is_alive()) {
                return Err(died_during_setup(cfg, p));
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(TransportError::Handshake {
                peer: format!("rank(s) {missing:?}"),
                detail: format!(
                    "did not attach to this rank's shared-memory segment within {:?}",
                    cfg.connect_timeout
                ),
            });
        }
        sys::futex_wait(
            &bell.word,
            seen,
            (deadline - now).min(Duration::from_millis(20)),
        );
    }
}

/// The error for peer `p` whose process exited during set-up; removes its segment file,
/// which it can no longer remove itself.
fn died_during_setup(cfg: &ShmConfig, p: usize) -> TransportError {
    let path = cfg.segment_path(p);
    let _ = std::fs::remove_file(&path);
    TransportError::Handshake {
        peer: format!("rank {p}"),
        detail: format!(
            "its process exited during set-up (removed its segment {})",
            path.display()
        ),
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
        if msg.len() + 1 > self.max_frame {
            return Err(TransportError::TooLarge {
                len: msg.len() + 1,
                max: self.max_frame,
            });
        }
        let out = self.outbound[to]
            .as_ref()
            .ok_or(TransportError::Closed { rank: to })?;
        if out.peer_gone() {
            out.dead.store(true, Release);
            return Err(TransportError::Closed { rank: to });
        }
        let len = msg.len() + FRAME_HEADER_LEN;
        let release = self.shaper.as_mut().map(|s| s.release(Instant::now(), len));
        if out.queued.load(Acquire) > 0 {
            out.pump(true);
        }
        let mut g = out.lock();
        if out.dead.load(Acquire) {
            return Err(TransportError::Closed { rank: to });
        }
        let mut done = 0;
        if release.is_none() && g.queue.is_empty() && !g.writing {
            // Nothing ahead of it: copy straight into the ring (the lock keeps the writer
            // thread off the producer side meanwhile).
            done = out.ring.write([&frame::data_prefix(msg.len()), &msg], 0);
            if done > 0 {
                out.peer.get().bell.0.notify();
            }
        }
        if done == len {
            drop(g);
            pool::put(msg);
        } else {
            g.queue.push_back(Outgoing { release, msg, done });
            out.queued.fetch_add(1, Release);
            drop(g);
            out.cv.notify_one();
        }
        self.sent += len as u64;
        Ok(())
    }

    fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
        self.recv_inner(None, deadline)
    }

    fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError> {
        check_peer(from, self.rank, self.world)?;
        self.recv_inner(Some(from), deadline).map(|(_, m)| m)
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
            out.lock().closing = true;
            out.cv.notify_all();
        }
        // Nothing is ever sent on `writers_done`: it disconnects when the last writer
        // returns (no writers: set-up failed, or a world of one).
        if !self.writers.is_empty() {
            let _ = self.writers_done.recv_timeout(self.linger);
        }
        for out in self.outbound.iter().flatten() {
            out.stop.store(true, Release);
            out.cv.notify_all();
            out.ring.ctl().space.0.notify();
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

/// Whether every rank's address (as a rendezvous hands them out) points at one host: all
/// loopback, or all the same IP address. A heuristic for choosing this driver: ranks that
/// do not in fact share `/dev/shm` (separate containers behind one address) make
/// [`ShmTransport::connect`] fail naming the ranks whose segments never appeared, so a
/// launcher should try it with a short [`ShmConfig::connect_timeout`] and have all ranks
/// agree on the outcome before falling back.
pub fn same_host(addrs: &[std::net::SocketAddr]) -> bool {
    let all_loopback = addrs.iter().all(|a| a.ip().is_loopback());
    all_loopback || addrs.windows(2).all(|w| w[0].ip() == w[1].ip())
}

/// Free bytes of the file system holding `dir` that an unprivileged process may use
/// (`statvfs`: available blocks × fragment size). On Docker's default `/dev/shm` this is
/// 64 MiB, less what other processes hold.
pub fn free_bytes(dir: &std::path::Path) -> std::io::Result<u64> {
    sys::free_bytes(dir)
}

/// The segment files of the run of `cfg` (ranks `0..world`) that still exist: none once
/// a mesh is up or its set-up failed (a process killed during set-up leaves its own).
pub fn leftover_segments(cfg: &ShmConfig, world: usize) -> Vec<PathBuf> {
    (0..world)
        .map(|r| cfg.segment_path(r))
        .filter(|p| p.exists())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mesh_bytes_counts_every_segment_with_rounded_rings() {
        let page = 4096u64;
        let cfg = ShmConfig::new(b"t".to_vec(), b"r".to_vec());
        assert_eq!(cfg.mesh_bytes(2), 2 * (page + page + (4 << 20)));
        assert_eq!(cfg.mesh_bytes(1), page);
        // 5000 bytes round up to an 8 KiB ring; 3 ranks hold 2 rings each.
        let small = ShmConfig {
            ring_bytes: 5000,
            ..cfg
        };
        assert_eq!(small.mesh_bytes(3), 3 * (page + 2 * (page + 8192)));
    }

    #[test]
    fn same_host_by_address_and_config_derivations() {
        let a = |s: &str| s.parse::<std::net::SocketAddr>().unwrap();
        assert!(same_host(&[a("127.0.0.1:1"), a("127.0.0.2:2")]));
        assert!(same_host(&[a("10.0.0.5:1"), a("10.0.0.5:2")]));
        assert!(!same_host(&[a("10.0.0.5:1"), a("10.0.0.6:1")]));
        assert!(same_host(&[]));
        let c = ShmConfig::new(b"t".to_vec(), b"run".to_vec());
        assert_ne!(c.segment_path(0), c.segment_path(1));
        let other = ShmConfig::new(b"t".to_vec(), b"run2".to_vec());
        assert_ne!(c.segment_path(0), other.segment_path(0));
        assert_ne!(
            c.token_hash(),
            ShmConfig::new(b"u".to_vec(), b"run".to_vec()).token_hash()
        );
        assert_eq!(c.ring_capacity(), 4 << 20);
        let odd = ShmConfig {
            ring_bytes: 5000,
            ..c.clone()
        };
        assert_eq!(odd.ring_capacity(), 8192);
        let fixed = ShmConfig {
            spin: Some(Duration::ZERO),
            ..c.clone()
        };
        assert_eq!(fixed.spin_for(2), Duration::ZERO);
        assert_eq!(c.spin_for(usize::MAX), Duration::ZERO);
    }
}
