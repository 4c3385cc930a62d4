//! In-process driver: N ranks in one process (threads), connected by channels.
//!
//! Used by the test suites and for single-process multi-rank simulation. Dropping a
//! rank's transport closes its "connections": every peer's [`Transport::recv`] reports
//! [`TransportError::Closed`] for it after the messages it sent, exactly as a TCP peer that
//! exits.

use std::sync::mpsc::{channel, Sender};
use std::time::Instant;

use super::{check_peer, ByteCount, Event, Inbox, Transport, TransportError};

/// One rank of an in-process mesh built by [`channel_mesh`].
#[derive(Debug)]
pub struct ChannelTransport {
    rank: usize,
    world: usize,
    peers: Vec<Sender<Event>>,
    inbox: Inbox,
    sent: u64,
}

/// Builds `world` connected in-process transports; element `r` is rank `r`.
pub fn channel_mesh(world: usize) -> Vec<ChannelTransport> {
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..world).map(|_| channel()).unzip();
    rxs.into_iter()
        .enumerate()
        .map(|(rank, rx)| ChannelTransport {
            rank,
            world,
            peers: txs.clone(),
            inbox: Inbox::new(rx, txs[rank].clone(), world, 0),
            sent: 0,
        })
        .collect()
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
}

impl Drop for ChannelTransport {
    fn drop(&mut self) {
        for (p, tx) in self.peers.iter().enumerate() {
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
