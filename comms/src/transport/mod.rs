//! The transport seam: moving opaque byte messages between ranks.
//!
//! A [`Transport`] knows nothing of collectives. It delivers each message whole (framing is
//! its business), to one peer, and reports a peer whose connection closed, or (for the
//! network drivers) that went silent: no message and no heartbeat for its peer timeout,
//! see [`TransportError::PeerSilent`]. Heartbeats are the drivers' business too: they are
//! never delivered, nor counted in [`ByteCount`]. Everything
//! else — algorithms, sequence numbers, timeouts policy, failure propagation — lives above
//! it, so a driver is a few hundred lines and every driver passes the same conformance suite.
//!
//! Drivers: [`channel`] (in-process, N ranks as threads); with the `tcp` feature,
//! [`tcp`] (tokio, one connection per rank pair, authenticated by the run token); with the
//! `quic` feature, [`quic`] (quinn, TLS 1.3 with the pinned run certificate, plus the run
//! token); with the `shm` feature (Linux), [`shm`] (ranks on one host: byte rings in
//! `/dev/shm` mappings, futex waits); with both, [`hybrid`] (shared memory to the ranks on
//! this host, TCP to the others, for multi-host runs). The byte-stream drivers share their framing and egress shaping (`stream.rs`),
//! and TCP and QUIC their mesh set-up (who dials whom, the hello both ways, deadlines,
//! errors naming the peer) and their send side, generic over a small `Link` trait
//! (`mesh.rs`); TCP moves data with a blocking reader and writer thread per connection
//! (`threaded.rs`), QUIC with a reader and a writer task (`quic_stream.rs`).

pub mod channel;
#[cfg(all(feature = "tcp", feature = "shm", target_os = "linux"))]
pub mod hybrid;
#[cfg(feature = "tcp")]
mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod mux;
#[cfg(feature = "quic")]
pub mod quic;
#[cfg(feature = "quic")]
mod quic_stream;
#[cfg(all(feature = "shm", target_os = "linux"))]
pub mod shm;
#[cfg(feature = "tcp")]
pub(crate) mod stream;
#[cfg(feature = "tcp")]
pub mod tcp;
#[cfg(feature = "tcp")]
pub(crate) mod threaded;

use std::collections::VecDeque;
use std::ops::Sub;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::frame::FrameError;

/// Errors of a transport driver.
#[derive(Debug, Error)]
pub enum TransportError {
    /// The connection to `rank` is closed (the peer exited, crashed or dropped its transport).
    #[error("connection to rank {rank} is closed")]
    Closed {
        /// The peer.
        rank: usize,
    },
    /// Nothing — no message, no heartbeat — arrived from `rank` for `silent_for`, the
    /// driver's peer timeout: the peer is taken as lost (its process is frozen or gone, or
    /// the network between us is), and its connection is dropped. Reported once, like
    /// [`TransportError::Closed`], after every message the peer sent; afterwards the peer
    /// counts as closed.
    #[error("rank {rank} sent nothing, not even a heartbeat, for {silent_for:?}")]
    PeerSilent {
        /// The peer.
        rank: usize,
        /// The peer timeout that passed.
        silent_for: Duration,
    },
    /// No message arrived before the deadline.
    #[error("timed out waiting for a message")]
    Timeout,
    /// `rank` is not a peer of this rank (out of range, or this rank itself).
    #[error("rank {rank} is not a peer (world size {world})")]
    InvalidRank {
        /// The rank asked for.
        rank: usize,
        /// The world size.
        world: usize,
    },
    /// A message does not fit in one frame.
    #[error("message of {len} bytes exceeds the maximum frame size of {max} bytes")]
    TooLarge {
        /// Bytes in the frame.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Connection set-up failed (peer unreachable, refused, or failed authentication).
    #[error("handshake with {peer} failed: {detail}")]
    Handshake {
        /// Who (rank or address).
        peer: String,
        /// What went wrong.
        detail: String,
    },
    /// An I/O error.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// A malformed frame.
    #[error(transparent)]
    Frame(#[from] FrameError),
}

/// Bytes moved by a transport: cumulative ([`Transport::bytes`]) or per collective call
/// ([`crate::Communicator::last_bytes`]). Counted as the driver puts them on / takes them
/// off its link, framing included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByteCount {
    /// Bytes sent.
    pub sent: u64,
    /// Bytes received.
    pub received: u64,
}

impl Sub for ByteCount {
    type Output = ByteCount;
    fn sub(self, rhs: ByteCount) -> ByteCount {
        ByteCount {
            sent: self.sent - rhs.sent,
            received: self.received - rhs.received,
        }
    }
}

/// Moves framed byte messages between the ranks of one run.
///
/// Design: the trait is deliberately minimal and blocking with deadlines, because the
/// trainer is synchronous and the collectives are sans-IO state machines driven by
/// [`crate::Communicator`]; an async driver (TCP, QUIC) runs its runtime inside and hands
/// messages over through a queue. `send` must not wait for the peer to read — ring
/// algorithms have every rank send before it receives, and a blocking send would deadlock
/// the ring — so drivers queue outgoing messages.
pub trait Transport: Send {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Queues `msg` for delivery to `to`. Messages to one peer are delivered in order.
    /// Returns [`TransportError::Closed`] if the connection to `to` is known to be closed.
    fn send(&mut self, to: usize, msg: Vec<u8>) -> Result<(), TransportError>;
    /// The next message from any peer as `(from, bytes)`, waiting until `deadline`.
    /// A peer whose connection closed is reported once, as [`TransportError::Closed`] (or
    /// [`TransportError::PeerSilent`] when the driver gave up on a silent peer), after
    /// every message it sent before that.
    fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError>;
    /// The next message from `from`, waiting until `deadline`; messages from other peers
    /// that arrive meanwhile are kept for later `recv` calls.
    fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError>;
    /// Cumulative bytes sent and received.
    fn bytes(&self) -> ByteCount;

    /// Newcomers waiting to take the place of a lost peer: the ranks for which one has
    /// connected to this rank and authenticated (claiming that rank), not yet admitted.
    /// Only drivers that accept joiners report any (the in-process driver, and TCP under
    /// live membership); the default is none. See [`Transport::admit`].
    fn joiners(&mut self) -> Vec<usize> {
        Vec::new()
    }

    /// Makes the newcomer waiting for `rank` ([`Transport::joiners`]) that rank's peer
    /// from now on, in place of its lost predecessor: the old connection is closed if it
    /// was not, and nothing it delivered after this call is reported (a late close of the
    /// old connection must not be taken for the newcomer's). The caller decides when —
    /// every rank of the group admits at the same point of its collectives, see
    /// [`crate::Communicator::admit`]. Fails for a rank with no waiting newcomer, and on
    /// drivers that accept none.
    fn admit(&mut self, rank: usize) -> Result<(), TransportError> {
        Err(TransportError::Handshake {
            peer: format!("rank {rank}"),
            detail: "this transport does not accept joiners".into(),
        })
    }

    /// On a newcomer welcomed into the group: makes its link to the member for `rank` the
    /// one both use. A newcomer reached the members it knew the addresses of; a member
    /// that was a newcomer itself (welcomed earlier, or together with this one) may have
    /// learned this one's address and reached it instead, and is admitted here as
    /// [`Transport::admit`] does a joiner — once it has connected, waited for until
    /// `deadline`. The default admits a waiting joiner for `rank` if there is one, and
    /// otherwise keeps the link it has; see [`crate::Communicator::join`].
    fn link_member(&mut self, rank: usize, deadline: Instant) -> Result<(), TransportError> {
        let _ = deadline;
        if self.joiners().contains(&rank) {
            self.admit(rank)
        } else {
            Ok(())
        }
    }
}

impl<T: Transport + ?Sized> Transport for Box<T> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn send(&mut self, to: usize, msg: Vec<u8>) -> Result<(), TransportError> {
        (**self).send(to, msg)
    }
    fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
        (**self).recv(deadline)
    }
    fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError> {
        (**self).recv_from(from, deadline)
    }
    fn bytes(&self) -> ByteCount {
        (**self).bytes()
    }
    fn joiners(&mut self) -> Vec<usize> {
        (**self).joiners()
    }
    fn admit(&mut self, rank: usize) -> Result<(), TransportError> {
        (**self).admit(rank)
    }
    fn link_member(&mut self, rank: usize, deadline: Instant) -> Result<(), TransportError> {
        (**self).link_member(rank, deadline)
    }
}

/// A callback a driver's receiving threads make after each event (message, closed or silent
/// peer) they queue for the rank: how a receiver that waits on something else as well (the
/// [`hybrid`] driver, asleep on its shared-memory doorbell) learns that this driver has
/// something for it. It runs on the driver's threads, so it must be quick and must not
/// block.
#[derive(Clone)]
pub struct OnEvent(std::sync::Arc<dyn Fn() + Send + Sync>);

impl OnEvent {
    /// Wraps `f`.
    pub fn new(f: impl Fn() + Send + Sync + 'static) -> Self {
        OnEvent(std::sync::Arc::new(f))
    }

    /// Makes the call (from the TCP driver's threads: unused without it).
    #[cfg_attr(not(feature = "tcp"), allow(dead_code))]
    pub(crate) fn call(&self) {
        (self.0)()
    }
}

impl std::fmt::Debug for OnEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnEvent(..)")
    }
}

/// Two callbacks are equal when they are the same one.
impl PartialEq for OnEvent {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

/// What a driver's connections deliver to a rank's [`Inbox`].
#[derive(Debug)]
pub(crate) enum Event {
    /// A message from a peer.
    Msg(usize, Vec<u8>),
    /// The connection to a peer closed.
    Closed(usize),
    /// Nothing arrived from a peer for the given peer timeout; its connection is dropped.
    /// (Only the socket drivers, features `tcp` / `quic`, have heartbeats.)
    #[cfg_attr(not(any(feature = "tcp", feature = "quic")), allow(dead_code))]
    Silent(usize, Duration),
    /// A peer's rank was given to a newcomer ([`Transport::admit`]): what the inbox
    /// received for that rank before this marker was its predecessor's, and is dropped;
    /// what follows is the newcomer's.
    Admitted(usize),
}

/// The receive side shared by the drivers: one queue of [`Event`]s, plus the events that
/// `recv_from` skipped.
#[derive(Debug)]
pub(crate) struct Inbox {
    rx: Receiver<Event>,
    /// Keeps the queue connected even when every peer is gone.
    keep: Sender<Event>,
    skipped: VecDeque<Event>,
    closed: Vec<bool>,
    /// Ranks given to a newcomer whose [`Event::Admitted`] marker is still ahead in the
    /// queue: their events until then are the predecessor's, and are dropped.
    admitting: Vec<bool>,
    /// Of those, the ranks whose messages are kept (the newcomer's own already: see
    /// [`Inbox::admit_sender`]); only their losses are dropped.
    keeps_messages: Vec<bool>,
    received: u64,
    overhead: u64,
}

impl Inbox {
    /// An inbox over `rx`; `keep` is a sender of the same queue; `overhead` is the framing
    /// bytes counted per message on top of its length.
    pub(crate) fn new(
        rx: Receiver<Event>,
        keep: Sender<Event>,
        world: usize,
        overhead: u64,
    ) -> Self {
        Inbox {
            rx,
            keep,
            skipped: VecDeque::new(),
            closed: vec![false; world],
            admitting: vec![false; world],
            keeps_messages: vec![false; world],
            received: 0,
            overhead,
        }
    }

    pub(crate) fn received(&self) -> u64 {
        self.received
    }

    fn next_event(&mut self, deadline: Instant) -> Result<Event, TransportError> {
        loop {
            let now = Instant::now();
            let e = if now >= deadline {
                // Still take what is already there.
                self.rx.try_recv().map_err(|_| TransportError::Timeout)?
            } else {
                match self.rx.recv_timeout(deadline - now) {
                    Ok(e) => e,
                    Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                        return Err(TransportError::Timeout)
                    }
                }
            };
            if let Some(e) = self.screen(e) {
                return Ok(e);
            }
        }
    }

    /// Drops what a replaced peer's connection delivered before its [`Event::Admitted`]
    /// marker, and takes the marker itself.
    fn screen(&mut self, e: Event) -> Option<Event> {
        match e {
            Event::Admitted(p) => {
                self.admitting[p] = false;
                self.keeps_messages[p] = false;
                self.closed[p] = false;
                None
            }
            Event::Msg(p, _) if self.admitting[p] && !self.keeps_messages[p] => None,
            Event::Closed(p) | Event::Silent(p, _) if self.admitting[p] => None,
            e => Some(e),
        }
    }

    /// Rank `p` is given to a newcomer, once everything its predecessor's connection
    /// delivered is queued (and before the newcomer's connection delivers): queues the
    /// [`Event::Admitted`] marker, and until it comes out of the queue, events for `p` are
    /// the predecessor's and are dropped (those already set aside included).
    pub(crate) fn admit(&mut self, p: usize) {
        self.admitting[p] = true;
        self.skipped.retain(
            |e| !matches!(e, Event::Msg(f, _) | Event::Closed(f) | Event::Silent(f, _) if *f == p),
        );
        let _ = self.keep.send(Event::Admitted(p));
    }

    /// As [`Inbox::admit`] for a newcomer that may have sent already into this queue (an
    /// in-process newcomer linked to another: see `ChannelTransport::link_member`): only
    /// the predecessor's losses before the marker are dropped — its messages, none of
    /// which can be the predecessor's, are kept.
    pub(crate) fn admit_sender(&mut self, p: usize) {
        self.admitting[p] = true;
        self.keeps_messages[p] = true;
        self.skipped
            .retain(|e| !matches!(e, Event::Closed(f) | Event::Silent(f, _) if *f == p));
        let _ = self.keep.send(Event::Admitted(p));
    }

    /// Queues rank `p`'s connection as closed (a newcomer's transport: a rank it could not
    /// reach).
    #[cfg_attr(not(feature = "tcp"), allow(dead_code))]
    pub(crate) fn closed(&self, p: usize) {
        let _ = self.keep.send(Event::Closed(p));
    }

    fn deliver(&mut self, e: Event) -> Result<(usize, Vec<u8>), TransportError> {
        match e {
            Event::Msg(from, b) => {
                self.received += b.len() as u64 + self.overhead;
                Ok((from, b))
            }
            Event::Closed(rank) => {
                self.closed[rank] = true;
                Err(TransportError::Closed { rank })
            }
            Event::Silent(rank, silent_for) => {
                self.closed[rank] = true;
                Err(TransportError::PeerSilent { rank, silent_for })
            }
            Event::Admitted(_) => unreachable!("markers are taken by Inbox::screen"),
        }
    }

    pub(crate) fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
        let e = match self.skipped.pop_front() {
            Some(e) => e,
            None => self.next_event(deadline)?,
        };
        self.deliver(e)
    }

    pub(crate) fn recv_from(
        &mut self,
        from: usize,
        deadline: Instant,
    ) -> Result<Vec<u8>, TransportError> {
        let pos = self.skipped.iter().position(|e| match e {
            Event::Msg(f, _) | Event::Closed(f) | Event::Silent(f, _) => *f == from,
            Event::Admitted(_) => false,
        });
        if let Some(i) = pos {
            let e = self.skipped.remove(i).expect("index from position");
            return self.deliver(e).map(|(_, b)| b);
        }
        if self.closed[from] {
            return Err(TransportError::Closed { rank: from });
        }
        loop {
            match self.next_event(deadline)? {
                Event::Msg(f, b) if f == from => {
                    return self.deliver(Event::Msg(f, b)).map(|(_, b)| b)
                }
                e @ (Event::Closed(f) | Event::Silent(f, _)) if f == from => {
                    return self.deliver(e).map(|(_, b)| b)
                }
                other => self.skipped.push_back(other),
            }
        }
    }
}

impl TransportError {
    /// The peer this error reports as gone — [`TransportError::Closed`] or
    /// [`TransportError::PeerSilent`] — and how it went; `None` for other errors.
    pub fn lost_peer(&self) -> Option<(usize, String)> {
        match self {
            TransportError::Closed { rank } => Some((*rank, "connection closed".into())),
            TransportError::PeerSilent { rank, silent_for } => Some((
                *rank,
                format!("nothing received, not even a heartbeat, for {silent_for:?}"),
            )),
            _ => None,
        }
    }
}

/// Refuses a message of `len` bytes that would not fit a frame of at most `max` bytes with
/// its one-byte tag (the stream and shared-memory transports).
#[cfg(any(feature = "tcp", all(feature = "shm", target_os = "linux")))]
pub(crate) fn check_frame(len: usize, max: usize) -> Result<(), TransportError> {
    if len + 1 > max {
        return Err(TransportError::TooLarge { len: len + 1, max });
    }
    Ok(())
}

pub(crate) fn check_peer(to: usize, rank: usize, world: usize) -> Result<(), TransportError> {
    if to >= world || to == rank {
        return Err(TransportError::InvalidRank { rank: to, world });
    }
    Ok(())
}
