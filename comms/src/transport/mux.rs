//! Two logical transports over one: the messages of a [`crate::Communicator`]'s collectives
//! and those of a parameter server ([`crate::ps::PsNode`]) share a rank's connections.
//!
//! [`split`] turns one transport into two [`Lane`]s. A message belongs to a lane by its first
//! byte, which both protocols already make distinct: parameter-server messages start with
//! [`crate::ps::PS_MAGIC`] and collective messages with [`crate::wire::WIRE_VERSION`] (the
//! classifier is a plain function, so other pairs of protocols can share a transport too).
//! Sending goes straight through. Receiving on one lane reads the underlying transport and
//! keeps whatever belongs to the other lane, in arrival order, for that lane's next receive —
//! so a rank that is still serving parameter-server traffic while a faster peer has already
//! started the next collective neither loses nor misreads the early collective message.
//!
//! A peer whose connection closed (or went silent) is reported on **each** lane once, after
//! the messages it sent to that lane, exactly as the underlying driver reports it.
//!
//! Both lanes hold the transport behind one mutex. The intended use is sequential (a
//! trainer either runs a collective or a parameter-server step), so the lock is
//! uncontended; a receive holds it while it waits, so two threads receiving on the two
//! lanes at once would take turns.
//!
//! [`Transport::bytes`] of either lane is the underlying transport's: per-call byte counts
//! taken around a collective (as [`crate::Communicator::last_bytes`] does) stay exact as
//! long as the other lane is idle meanwhile.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{ByteCount, Transport, TransportError};

/// What a lane's queue holds: a message, or a peer that was lost (with the error the driver
/// gave for it).
enum Item {
    Msg(usize, Vec<u8>),
    Lost(usize, LostKind),
}

#[derive(Clone, Copy)]
enum LostKind {
    Closed,
    Silent(Duration),
}

impl LostKind {
    fn error(self, rank: usize) -> TransportError {
        match self {
            LostKind::Closed => TransportError::Closed { rank },
            LostKind::Silent(silent_for) => TransportError::PeerSilent { rank, silent_for },
        }
    }
}

struct Shared<T> {
    transport: T,
    /// Messages and losses waiting for lane 0 and lane 1.
    queues: [VecDeque<Item>; 2],
    classify: fn(&[u8]) -> usize,
}

/// One of the two logical transports made by [`split`].
pub struct Lane<T: Transport> {
    lane: usize,
    rank: usize,
    world: usize,
    shared: Arc<Mutex<Shared<T>>>,
}

impl<T: Transport> std::fmt::Debug for Lane<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane")
            .field("lane", &self.lane)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

/// The parameter server's lane number in [`split_ps`]: messages starting with
/// [`crate::ps::PS_MAGIC`].
pub const PS_LANE: usize = 1;

/// Splits `transport` into two lanes; `classify` maps a message (never empty: an empty
/// message goes to lane 0) to its lane, 0 or 1 (anything else counts as 1).
pub fn split<T: Transport>(transport: T, classify: fn(&[u8]) -> usize) -> (Lane<T>, Lane<T>) {
    let (rank, world) = (transport.rank(), transport.world_size());
    let shared = Arc::new(Mutex::new(Shared {
        transport,
        queues: [VecDeque::new(), VecDeque::new()],
        classify,
    }));
    let lane = |lane| Lane {
        lane,
        rank,
        world,
        shared: shared.clone(),
    };
    (lane(0), lane(1))
}

fn ps_classifier(msg: &[u8]) -> usize {
    usize::from(msg.first() == Some(&crate::ps::PS_MAGIC))
}

/// [`split`] for collectives (lane 0) and a parameter server (lane [`PS_LANE`]).
pub fn split_ps<T: Transport>(transport: T) -> (Lane<T>, Lane<T>) {
    split(transport, ps_classifier)
}

impl<T: Transport> Lane<T> {
    fn lock(&self) -> MutexGuard<'_, Shared<T>> {
        // A panic while holding the lock leaves the queues consistent (every mutation is a
        // single push or pop), so a poisoned lock is still usable.
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the first queued item of this lane that `want` accepts.
    fn take_queued(
        &self,
        s: &mut Shared<T>,
        want: impl Fn(usize) -> bool,
    ) -> Option<Result<(usize, Vec<u8>), TransportError>> {
        let q = &mut s.queues[self.lane];
        let pos = q.iter().position(|it| match it {
            Item::Msg(from, _) | Item::Lost(from, _) => want(*from),
        })?;
        Some(match q.remove(pos).expect("position is in range") {
            Item::Msg(from, m) => Ok((from, m)),
            Item::Lost(rank, kind) => Err(kind.error(rank)),
        })
    }

    fn recv_where(
        &mut self,
        deadline: Instant,
        want: impl Fn(usize) -> bool,
    ) -> Result<(usize, Vec<u8>), TransportError> {
        let lane = self.lane;
        let mut s = self.lock();
        loop {
            if let Some(r) = self.take_queued(&mut s, &want) {
                return r;
            }
            match s.transport.recv(deadline) {
                Ok((from, msg)) => {
                    let to = (s.classify)(&msg).min(1);
                    if to == lane && want(from) {
                        return Ok((from, msg));
                    }
                    s.queues[to].push_back(Item::Msg(from, msg));
                }
                Err(e) => {
                    let lost = match &e {
                        TransportError::Closed { rank } => Some((*rank, LostKind::Closed)),
                        TransportError::PeerSilent { rank, silent_for } => {
                            Some((*rank, LostKind::Silent(*silent_for)))
                        }
                        _ => None,
                    };
                    let Some((rank, kind)) = lost else {
                        return Err(e);
                    };
                    // Both lanes learn of the loss, each after the messages queued for it.
                    s.queues[1 - lane].push_back(Item::Lost(rank, kind));
                    if want(rank) {
                        return Err(e);
                    }
                    s.queues[lane].push_back(Item::Lost(rank, kind));
                }
            }
        }
    }
}

impl<T: Transport> Transport for Lane<T> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn send(&mut self, to: usize, msg: Vec<u8>) -> Result<(), TransportError> {
        self.lock().transport.send(to, msg)
    }

    fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
        self.recv_where(deadline, |_| true)
    }

    fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError> {
        self.recv_where(deadline, |r| r == from).map(|(_, m)| m)
    }

    fn bytes(&self) -> ByteCount {
        self.lock().transport.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::channel::channel_mesh;

    fn by_first_byte(m: &[u8]) -> usize {
        usize::from(m.first() == Some(&1))
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn messages_reach_their_lane_in_order() {
        let mut mesh = channel_mesh(3);
        let t2 = mesh.pop().unwrap();
        let mut t1 = mesh.pop().unwrap();
        let t0 = mesh.pop().unwrap();
        let (mut a, mut b) = split(t0, by_first_byte);
        // Interleaved lanes, two senders.
        t1.send(0, vec![0, 10]).unwrap();
        t1.send(0, vec![1, 20]).unwrap();
        t1.send(0, vec![0, 11]).unwrap();
        t1.send(0, vec![1, 21]).unwrap();
        let mut t2 = t2;
        t2.send(0, vec![1, 30]).unwrap();
        t2.send(0, vec![0, 40]).unwrap();
        // Lane 1 first: lane 0's messages are kept.
        assert_eq!(b.recv_from(2, soon()).unwrap(), vec![1, 30]);
        assert_eq!(b.recv_from(1, soon()).unwrap(), vec![1, 20]);
        assert_eq!(b.recv(soon()).unwrap(), (1, vec![1, 21]));
        assert_eq!(a.recv(soon()).unwrap(), (1, vec![0, 10]));
        assert_eq!(a.recv_from(2, soon()).unwrap(), vec![0, 40]);
        assert_eq!(a.recv(soon()).unwrap(), (1, vec![0, 11]));
        // Nothing left on either lane.
        let quick = Instant::now() + Duration::from_millis(20);
        assert!(matches!(a.recv(quick), Err(TransportError::Timeout)));
        let quick = Instant::now() + Duration::from_millis(20);
        assert!(matches!(b.recv(quick), Err(TransportError::Timeout)));
        // Sending goes through either lane.
        a.send(1, vec![0, 1]).unwrap();
        b.send(1, vec![1, 2]).unwrap();
        assert_eq!(t1.recv(soon()).unwrap(), (0, vec![0, 1]));
        assert_eq!(t1.recv(soon()).unwrap(), (0, vec![1, 2]));
        assert_eq!(a.bytes(), b.bytes());
    }

    #[test]
    fn a_lost_peer_is_reported_on_both_lanes_after_its_messages() {
        let mut mesh = channel_mesh(2);
        let mut t1 = mesh.pop().unwrap();
        let t0 = mesh.pop().unwrap();
        let (mut a, mut b) = split(t0, by_first_byte);
        t1.send(0, vec![1, 5]).unwrap();
        t1.send(0, vec![0, 6]).unwrap();
        drop(t1);
        // Lane 0 reads past lane 1's message and then the loss.
        assert_eq!(a.recv(soon()).unwrap(), (1, vec![0, 6]));
        assert!(matches!(
            a.recv(soon()),
            Err(TransportError::Closed { rank: 1 })
        ));
        // Lane 1 gets its message, then the same loss.
        assert_eq!(b.recv(soon()).unwrap(), (1, vec![1, 5]));
        assert!(matches!(
            b.recv_from(1, soon()),
            Err(TransportError::Closed { rank: 1 })
        ));
    }

    #[test]
    fn parameter_server_messages_are_told_apart_from_collectives() {
        assert_eq!(ps_classifier(&[crate::ps::PS_MAGIC, 0]), PS_LANE);
        assert_eq!(ps_classifier(&[crate::wire::WIRE_VERSION, 0]), 0);
        assert_eq!(ps_classifier(&[]), 0);
    }
}
