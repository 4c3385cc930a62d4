//! In-process driver: N ranks in one process (threads), connected by channels.
//!
//! Used by the test suites and for single-process multi-rank simulation. Dropping a
//! rank's transport closes its "connections": every peer's [`Transport::recv`] reports
//! [`TransportError::Closed`] for it after the messages it sent, exactly as a TCP peer that
//! exits.
//!
//! A lost rank's place can be taken by a newcomer ([`ChannelSlots::join`]): the ranks see
//! it waiting ([`Transport::joiners`]) and switch to it when they admit it. The driver
//! assumes the predecessor is gone (its transport dropped) by then: a predecessor still
//! sending would be taken for the newcomer.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{check_peer, ByteCount, Event, Inbox, Transport, TransportError};

/// Every rank's inbox sender, how many times its rank was taken by a newcomer, and the
/// newest generation of each rank that some rank admitted.
#[derive(Debug)]
struct Registry {
    txs: Vec<Sender<Event>>,
    generation: Vec<u64>,
    admitted: Vec<u64>,
}

/// The ranks of an in-process mesh, to give a lost one's place to a newcomer: see
/// [`ChannelTransport::slots`].
#[derive(Debug, Clone)]
pub struct ChannelSlots(Arc<Mutex<Registry>>);

impl ChannelSlots {
    /// A newcomer for `rank` of the mesh (a rank whose transport was dropped): the other
    /// ranks report it in [`Transport::joiners`] until they admit it.
    ///
    /// # Panics
    /// If `rank` is outside the mesh.
    pub fn join(&self, rank: usize) -> ChannelTransport {
        let mut reg = self.0.lock().expect("registry");
        let world = reg.txs.len();
        assert!(rank < world, "rank {rank} of a mesh of {world}");
        let (tx, rx) = channel();
        reg.txs[rank] = tx.clone();
        reg.generation[rank] += 1;
        ChannelTransport {
            rank,
            generation: reg.generation[rank],
            world,
            peers: reg.txs.clone(),
            known: reg.generation.clone(),
            registry: self.clone(),
            inbox: Inbox::new(rx, tx, world, 0),
            sent: 0,
        }
    }
}

/// One rank of an in-process mesh built by [`channel_mesh`].
#[derive(Debug)]
pub struct ChannelTransport {
    rank: usize,
    /// How many newcomers took this rank before this one (0: one of the mesh's own).
    generation: u64,
    world: usize,
    peers: Vec<Sender<Event>>,
    /// The generation of each peer's sender in `peers` (see [`Registry`]).
    known: Vec<u64>,
    registry: ChannelSlots,
    inbox: Inbox,
    sent: u64,
}

/// Builds `world` connected in-process transports; element `r` is rank `r`.
pub fn channel_mesh(world: usize) -> Vec<ChannelTransport> {
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..world).map(|_| channel()).unzip();
    let registry = ChannelSlots(Arc::new(Mutex::new(Registry {
        txs: txs.clone(),
        generation: vec![0; world],
        admitted: vec![0; world],
    })));
    rxs.into_iter()
        .enumerate()
        .map(|(rank, rx)| ChannelTransport {
            rank,
            generation: 0,
            world,
            peers: txs.clone(),
            known: vec![0; world],
            registry: registry.clone(),
            inbox: Inbox::new(rx, txs[rank].clone(), world, 0),
            sent: 0,
        })
        .collect()
}

impl ChannelTransport {
    /// The ranks of this transport's mesh, to start a newcomer in a lost rank's place.
    pub fn slots(&self) -> ChannelSlots {
        self.registry.clone()
    }
}

impl Transport for ChannelTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn send(&mut self, to: usize, msg: Vec<u8>) -> Result<(), TransportError> {
        check_peer(to, self.rank, self.world)?;
        let len = msg.len() as u64;
        self.peers[to]
            .send(Event::Msg(self.rank, msg))
            .map_err(|_| TransportError::Closed { rank: to })?;
        self.sent += len;
        Ok(())
    }

    fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
        self.inbox.recv(deadline)
    }

    fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError> {
        check_peer(from, self.rank, self.world)?;
        self.inbox.recv_from(from, deadline)
    }

    fn bytes(&self) -> ByteCount {
        ByteCount {
            sent: self.sent,
            received: self.inbox.received(),
        }
    }

    fn joiners(&mut self) -> Vec<usize> {
        let reg = self.registry.0.lock().expect("registry");
        (0..self.world)
            .filter(|&p| p != self.rank && reg.generation[p] > self.known[p])
            .collect()
    }

    fn admit(&mut self, rank: usize) -> Result<(), TransportError> {
        self.take_newcomer(rank, false)
    }

    /// A newcomer that joined after this one (its generation newer than the one this
    /// newcomer knew) may have been welcomed first and sent already: linked to with its
    /// messages kept (`Inbox::admit_sender`).
    fn link_member(&mut self, rank: usize, _deadline: Instant) -> Result<(), TransportError> {
        if self.joiners().contains(&rank) {
            self.take_newcomer(rank, true)
        } else {
            Ok(())
        }
    }
}

impl ChannelTransport {
    /// Sends to the newcomer for `rank` from now on; `sent_already`: it may have sent
    /// into this rank's queue (kept), otherwise only its predecessor did (dropped).
    fn take_newcomer(&mut self, rank: usize, sent_already: bool) -> Result<(), TransportError> {
        check_peer(rank, self.rank, self.world)?;
        let mut reg = self.registry.0.lock().expect("registry");
        if reg.generation[rank] == self.known[rank] {
            return Err(TransportError::Handshake {
                peer: format!("rank {rank}"),
                detail: "no newcomer is waiting for this rank".into(),
            });
        }
        // The predecessor is gone: all it sent is queued, so the marker goes right behind.
        if sent_already {
            self.inbox.admit_sender(rank);
        } else {
            self.inbox.admit(rank);
        }
        self.peers[rank] = reg.txs[rank].clone();
        self.known[rank] = reg.generation[rank];
        reg.admitted[rank] = reg.admitted[rank].max(reg.generation[rank]);
        Ok(())
    }
}

impl Drop for ChannelTransport {
    fn drop(&mut self) {
        // Every rank's current inbox, newcomers' included; a newcomer nobody admitted
        // leaves silently (the others know its rank's predecessor, not it).
        let txs = match self.registry.0.lock() {
            Ok(reg) if self.generation > reg.admitted[self.rank] => return,
            Ok(reg) => reg.txs.clone(),
            Err(_) => self.peers.clone(),
        };
        for (p, tx) in txs.iter().enumerate() {
            if p != self.rank {
                let _ = tx.send(Event::Closed(self.rank));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn delivers_in_order_and_reports_close_after_messages() {
        let mut m = channel_mesh(3);
        let t2 = m.pop().unwrap();
        let mut t1 = m.pop().unwrap();
        let mut t0 = m.pop().unwrap();
        t1.send(0, vec![1]).unwrap();
        t1.send(0, vec![2]).unwrap();
        drop(t1);
        let dl = Instant::now() + Duration::from_secs(1);
        assert_eq!(t0.recv(dl).unwrap(), (1, vec![1]));
        assert_eq!(t0.recv_from(1, dl).unwrap(), vec![2]);
        assert!(matches!(
            t0.recv(dl),
            Err(TransportError::Closed { rank: 1 })
        ));
        assert!(matches!(
            t0.send(1, vec![0]),
            Err(TransportError::Closed { rank: 1 })
        ));
        assert!(matches!(
            t0.send(0, vec![0]),
            Err(TransportError::InvalidRank { .. })
        ));
        let short = Instant::now() + Duration::from_millis(20);
        assert!(matches!(t0.recv(short), Err(TransportError::Timeout)));
        assert_eq!(
            t0.bytes(),
            ByteCount {
                sent: 0,
                received: 2
            }
        );
        drop(t2);
    }

    #[test]
    fn recv_from_keeps_other_messages() {
        let mut m = channel_mesh(3);
        let dl = Instant::now() + Duration::from_secs(1);
        m[2].send(0, vec![2]).unwrap();
        m[1].send(0, vec![1]).unwrap();
        assert_eq!(m[0].recv_from(1, dl).unwrap(), vec![1]);
        assert_eq!(m[0].recv(dl).unwrap(), (2, vec![2]));
    }
}
