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
//! The lanes of [`split_tagged`] may be used from two threads at once (a trainer's control
//! collectives on one, a fragment exchange left in flight across steps on the other).
//! Whichever lane is waiting reads the underlying transport, in slices of at most
//! [`READ_SLICE`], and hands the other lane's messages over (waking it); a lane that finds
//! the transport being read waits for such a hand-over instead. A send waits for the
//! current read slice to end, so a send can be late by up to [`READ_SLICE`] while the other
//! lane is receiving. [`split`]'s lanes (the parameter server's) are used in turn: a read
//! there waits its whole deadline in one call, as the transport's own would.
//!
//! [`Transport::bytes`] of a lane counts that lane's messages only (framing included, as
//! the driver counts them): its sends, and the messages classified to it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};
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

/// The longest a lane reads the underlying transport before it lets the other lane (or a
/// send) have it.
pub const READ_SLICE: Duration = Duration::from_millis(1);

/// What the lanes share besides the transport: the queues and each lane's bytes.
struct Queues {
    /// Messages and losses waiting for lane 0 and lane 1.
    items: [VecDeque<Item>; 2],
    /// Bytes of each lane's messages.
    bytes: [ByteCount; 2],
}

struct Shared<T> {
    /// Locked by the lane reading or sending; never held while `queues` waits.
    transport: Mutex<T>,
    queues: Mutex<Queues>,
    /// Signalled when a message or a loss is queued for a lane, and when a send is done.
    queued: Condvar,
    /// Sends waiting for the transport: a reading lane lets them have it first.
    sends_waiting: AtomicUsize,
    classify: fn(&[u8]) -> usize,
    /// The tag lane 1's messages carry as their first byte ([`split_tagged`]). Its lanes
    /// are meant for two threads: a read holds the transport for [`READ_SLICE`] at most.
    /// (Without a tag the lanes are used in turn, and a read waits its whole deadline.)
    tag: Option<u8>,
}

/// One of the two logical transports made by [`split`].
pub struct Lane<T: Transport> {
    lane: usize,
    rank: usize,
    world: usize,
    shared: Arc<Shared<T>>,
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
    split_with(transport, classify, None)
}

fn split_with<T: Transport>(
    transport: T,
    classify: fn(&[u8]) -> usize,
    tag: Option<u8>,
) -> (Lane<T>, Lane<T>) {
    let (rank, world) = (transport.rank(), transport.world_size());
    let shared = Arc::new(Shared {
        transport: Mutex::new(transport),
        queues: Mutex::new(Queues {
            items: [VecDeque::new(), VecDeque::new()],
            bytes: [ByteCount::default(); 2],
        }),
        queued: Condvar::new(),
        sends_waiting: AtomicUsize::new(0),
        classify,
        tag,
    });
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

/// The first byte of every message of [`split_tagged`]'s second lane (distinct from
/// [`crate::wire::WIRE_VERSION`], which starts every collective message, and from
/// [`crate::ps::PS_MAGIC`]).
pub const SECOND_LANE_TAG: u8 = 0xD6;

fn tag_classifier(msg: &[u8]) -> usize {
    usize::from(msg.first() == Some(&SECOND_LANE_TAG))
}

/// Two lanes for two [`crate::Communicator`]s over one transport: lane 1 prefixes each of
/// its messages with [`SECOND_LANE_TAG`] (and takes it off on receipt), lane 0 sends as
/// the transport does. Each lane runs its own collectives, from its own thread if need be
/// (a trainer's control collectives beside a synchronisation left in flight across steps).
pub fn split_tagged<T: Transport>(transport: T) -> (Lane<T>, Lane<T>) {
    split_with(transport, tag_classifier, Some(SECOND_LANE_TAG))
}

/// Locks `m`; a panic while holding either lock leaves the state consistent (every mutation
/// is a single push, pop or count), so a poisoned lock is still usable.
fn lock<X>(m: &Mutex<X>) -> MutexGuard<'_, X> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T: Transport> Lane<T> {
    /// Takes the first queued item of this lane that `want` accepts.
    fn take_queued(
        &self,
        q: &mut Queues,
        want: &impl Fn(usize) -> bool,
    ) -> Option<Result<(usize, Vec<u8>), TransportError>> {
        let items = &mut q.items[self.lane];
        let pos = items.iter().position(|it| match it {
            Item::Msg(from, _) | Item::Lost(from, _) => want(*from),
        })?;
        Some(match items.remove(pos).expect("position is in range") {
            Item::Msg(from, m) => Ok((from, self.untag(m))),
            Item::Lost(rank, kind) => Err(kind.error(rank)),
        })
    }

    /// A received message of this lane without its tag.
    fn untag(&self, mut m: Vec<u8>) -> Vec<u8> {
        if self.lane == 1 && self.shared.tag.is_some() && !m.is_empty() {
            m.remove(0);
        }
        m
    }

    /// Reads the transport once (until `until`) with it locked: a message or loss for this
    /// lane that `want` accepts is returned, anything else queued for its lane.
    fn read_once(
        &self,
        t: &mut T,
        until: Instant,
        want: &impl Fn(usize) -> bool,
    ) -> Option<Result<(usize, Vec<u8>), TransportError>> {
        let lane = self.lane;
        let before = t.bytes().received;
        let got = t.recv(until);
        let read = t.bytes().received - before;
        let mut q = lock(&self.shared.queues);
        match got {
            Ok((from, msg)) => {
                let to = (self.shared.classify)(&msg).min(1);
                q.bytes[to].received += read;
                if to == lane && want(from) {
                    return Some(Ok((from, self.untag(msg))));
                }
                q.items[to].push_back(Item::Msg(from, msg));
            }
            Err(TransportError::Timeout) => return None,
            Err(e) => {
                let lost = match &e {
                    TransportError::Closed { rank } => Some((*rank, LostKind::Closed)),
                    TransportError::PeerSilent { rank, silent_for } => {
                        Some((*rank, LostKind::Silent(*silent_for)))
                    }
                    _ => None,
                };
                let Some((rank, kind)) = lost else {
                    return Some(Err(e));
                };
                // Both lanes learn of the loss, each after the messages queued for it.
                q.items[1 - lane].push_back(Item::Lost(rank, kind));
                if want(rank) {
                    self.shared.queued.notify_all();
                    return Some(Err(e));
                }
                q.items[lane].push_back(Item::Lost(rank, kind));
            }
        }
        self.shared.queued.notify_all();
        None
    }

    fn recv_where(
        &mut self,
        deadline: Instant,
        want: impl Fn(usize) -> bool,
    ) -> Result<(usize, Vec<u8>), TransportError> {
        loop {
            if let Some(r) = self.take_queued(&mut lock(&self.shared.queues), &want) {
                return r;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::Timeout);
            }
            let until = match self.shared.tag {
                Some(_) => deadline.min(now + READ_SLICE),
                None => deadline,
            };
            let got = if self.shared.sends_waiting.load(Ordering::Acquire) > 0 {
                Err(TryLockError::WouldBlock)
            } else {
                self.shared.transport.try_lock()
            };
            let mut t = match got {
                Ok(t) => t,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    // The other lane (or a send) has the transport: wait for what it hands
                    // over, or for the transport to be free.
                    let mut q = lock(&self.shared.queues);
                    if let Some(r) = self.take_queued(&mut q, &want) {
                        return r;
                    }
                    let wait = until.saturating_duration_since(Instant::now());
                    let _ = self.shared.queued.wait_timeout(q, wait);
                    continue;
                }
            };
            // Something may have been queued for this lane since the look above.
            if let Some(r) = self.take_queued(&mut lock(&self.shared.queues), &want) {
                return r;
            }
            if let Some(r) = self.read_once(&mut t, until, &want) {
                return r;
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
        let msg = match self.shared.tag {
            Some(tag) if self.lane == 1 => {
                let mut m = Vec::with_capacity(msg.len() + 1);
                m.push(tag);
                m.extend_from_slice(&msg);
                m
            }
            _ => msg,
        };
        self.shared.sends_waiting.fetch_add(1, Ordering::AcqRel);
        let mut t = lock(&self.shared.transport);
        self.shared.sends_waiting.fetch_sub(1, Ordering::AcqRel);
        let before = t.bytes().sent;
        let r = t.send(to, msg);
        let sent = t.bytes().sent - before;
        drop(t);
        lock(&self.shared.queues).bytes[self.lane].sent += sent;
        // A lane that waited for the transport may read again.
        self.shared.queued.notify_all();
        r
    }

    fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
        self.recv_where(deadline, |_| true)
    }

    fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError> {
        self.recv_where(deadline, |r| r == from).map(|(_, m)| m)
    }

    fn bytes(&self) -> ByteCount {
        lock(&self.shared.queues).bytes[self.lane]
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
        // Each lane counts its own messages, framing included as the driver counts it.
        assert_eq!(a.bytes().sent + b.bytes().sent, t1.bytes().received);
        assert_eq!(
            a.bytes().received + b.bytes().received,
            t1.bytes().sent + t2.bytes().sent
        );
        // Three messages of two bytes each per lane.
        assert_eq!((a.bytes().received, b.bytes().received), (6, 6));
    }

    #[test]
    fn the_tagged_lane_carries_its_tag_on_the_wire_only() {
        let mut mesh = channel_mesh(2);
        let mut t1 = mesh.pop().unwrap();
        let (mut a, mut b) = split_tagged(mesh.pop().unwrap());
        b.send(1, vec![crate::wire::WIRE_VERSION, 7]).unwrap();
        a.send(1, vec![crate::wire::WIRE_VERSION, 8]).unwrap();
        assert_eq!(
            t1.recv(soon()).unwrap().1,
            vec![SECOND_LANE_TAG, crate::wire::WIRE_VERSION, 7]
        );
        assert_eq!(
            t1.recv(soon()).unwrap().1,
            vec![crate::wire::WIRE_VERSION, 8]
        );
        t1.send(0, vec![SECOND_LANE_TAG, 9]).unwrap();
        t1.send(0, vec![crate::wire::WIRE_VERSION, 10]).unwrap();
        assert_eq!(
            a.recv(soon()).unwrap(),
            (1, vec![crate::wire::WIRE_VERSION, 10])
        );
        assert_eq!(b.recv_from(1, soon()).unwrap(), vec![9]);
        assert_eq!(tag_classifier(&[crate::wire::WIRE_VERSION]), 0);
        assert_ne!(SECOND_LANE_TAG, crate::ps::PS_MAGIC);
    }

    /// Two communicators per rank, each on its own thread, run different collectives at
    /// once over the same connections: every result is exact.
    #[test]
    fn two_threads_run_collectives_on_the_two_lanes_at_once() {
        use crate::{CommConfig, Communicator};
        let world = 3;
        let handles: Vec<_> = channel_mesh(world)
            .into_iter()
            .map(|t| {
                std::thread::spawn(move || {
                    let rank = t.rank();
                    let (a, b) = split_tagged(t);
                    let big = std::thread::spawn(move || {
                        let mut c = Communicator::new(b, CommConfig::default());
                        let mut sums = Vec::new();
                        for round in 0..20 {
                            let mut v = vec![(rank + round) as f32; 10_000];
                            c.all_reduce_sum(&mut v).unwrap();
                            sums.push(v[9_999]);
                        }
                        sums
                    });
                    let mut c = Communicator::new(a, CommConfig::default());
                    let mut small = Vec::new();
                    for round in 0..200 {
                        let mut v = [rank as f32 * round as f32; 4];
                        c.all_reduce_sum(&mut v).unwrap();
                        small.push(v[3]);
                    }
                    (small, big.join().unwrap())
                })
            })
            .collect();
        let r: usize = (0..world).sum();
        for h in handles {
            let (small, big) = h.join().unwrap();
            let want: Vec<f32> = (0..200).map(|round| (r * round) as f32).collect();
            assert_eq!(small, want);
            let want: Vec<f32> = (0..20).map(|round| (r + world * round) as f32).collect();
            assert_eq!(big, want);
        }
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
