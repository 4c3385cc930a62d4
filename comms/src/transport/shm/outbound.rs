//! The sending side towards one peer: the queue of frames that did not fit its ring, the
//! direct copy when nothing is queued, and the writer thread that streams the rest as
//! space frees up (honouring emulated release times), then closes the ring.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::segment::{spin_until_changed, Header, Ring};
use super::sys::{self, Process};
use crate::frame::{self, FRAME_HEADER_LEN};
use crate::pool;
use crate::transport::TransportError;

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
pub(super) enum Pump {
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
pub(super) struct Outbound {
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
    /// The sending side into `ring`, which lies in the segment of the peer whose header is
    /// `peer` and whose process is `process`.
    pub(super) fn new(
        ring: Ring,
        peer: Header,
        process: Arc<Process>,
        spin: Duration,
        liveness: Duration,
    ) -> Self {
        Outbound {
            ring,
            peer,
            process,
            state: Mutex::new(OutState::default()),
            queued: AtomicUsize::new(0),
            cv: Condvar::new(),
            dead: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            spin,
            liveness,
        }
    }

    fn lock(&self) -> MutexGuard<'_, OutState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn peer_gone(&self) -> bool {
        self.dead.load(Acquire) || self.peer.owner_closed()
    }

    /// Fails with [`TransportError::Closed`] naming `to` (this peer) if the peer is gone,
    /// marking it dead.
    pub(super) fn check_open(&self, to: usize) -> Result<(), TransportError> {
        if self.peer_gone() {
            self.dead.store(true, Release);
            return Err(TransportError::Closed { rank: to });
        }
        Ok(())
    }

    /// Sends `msg` to `to` (this peer), to be written no earlier than `release`: copies it
    /// straight into the ring when nothing is queued ahead of it, else (or for what does
    /// not fit) queues it for the writer thread.
    pub(super) fn send(
        &self,
        to: usize,
        msg: Vec<u8>,
        release: Option<Instant>,
    ) -> Result<(), TransportError> {
        let len = msg.len() + FRAME_HEADER_LEN;
        if self.has_queued() {
            self.pump(true);
        }
        let mut g = self.lock();
        if self.dead.load(Acquire) {
            return Err(TransportError::Closed { rank: to });
        }
        let mut done = 0;
        if release.is_none() && g.queue.is_empty() && !g.writing {
            // Nothing ahead of it: copy straight into the ring (the lock keeps the writer
            // thread off the producer side meanwhile).
            done = self.ring.write([&frame::data_prefix(msg.len()), &msg], 0);
            if done > 0 {
                self.peer.get().bell.0.notify();
            }
        }
        if done == len {
            drop(g);
            pool::put(msg);
        } else {
            g.queue.push_back(Outgoing { release, msg, done });
            self.queued.fetch_add(1, Release);
            drop(g);
            self.cv.notify_one();
        }
        Ok(())
    }

    /// Whether frames are queued and not completely written (a lock-free hint).
    pub(super) fn has_queued(&self) -> bool {
        self.queued.load(Acquire) > 0
    }

    /// Marks the peer dead (its process exited) and wakes the writer thread.
    pub(super) fn mark_dead(&self) {
        self.dead.store(true, Release);
        self.cv.notify_all();
    }

    /// Tells the writer thread to flush the queue, close the ring and exit.
    pub(super) fn start_closing(&self) {
        self.lock().closing = true;
        self.cv.notify_all();
    }

    /// Tells the writer thread to give up writing (the linger time ran out), waking it
    /// wherever it waits.
    pub(super) fn stop(&self) {
        self.stop.store(true, Release);
        self.cv.notify_all();
        self.ring.ctl().space.0.notify();
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
    pub(super) fn pump_counting(&self, hand_over: bool) -> (Pump, usize) {
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

/// The writer thread of one peer: moves queued frames into the ring, waiting for space
/// or release times, until the transport drops and the queue is flushed (or the linger
/// time runs out, or the peer goes away); then marks the ring closed.
pub(super) fn writer_loop(out: Arc<Outbound>, done: mpsc::Sender<()>) {
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
