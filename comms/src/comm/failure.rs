//! How a failed collective is reported: the aborts a rank sends and relays, the grace
//! period after a timeout, and the error every rank returns (see the [parent module's
//! docs](super) for the rules).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::{CommError, Communicator};
use crate::algo::{AlgoError, Machine};
use crate::transport::{Transport, TransportError};
use crate::wire::{AbortInfo, AbortReason, Kind, Message};

impl<T: Transport> Communicator<T> {
    /// The peers `m` still expects a message from.
    pub(super) fn waiting_on<M: Machine>(&self, m: &M) -> Vec<usize> {
        let me = self.rank();
        (0..self.world_size())
            .filter(|&p| p != me && m.expects_from(p))
            .collect()
    }

    /// Of the peers this rank is `waiting` for, those that sent nothing at all of this
    /// collective: the ones to blame after a timeout (one that sent part of it may itself
    /// be waiting for the stalled rank).
    pub(super) fn silent(&self, waiting: &[usize]) -> BTreeSet<usize> {
        waiting
            .iter()
            .copied()
            .filter(|&p| !self.heard[p])
            .collect()
    }

    /// Handles an abort from `from`: relays it and returns the matching error. `waiting`
    /// and `silent` are as in [`Communicator::gossip`].
    pub(super) fn on_abort(
        &mut self,
        from: usize,
        msg: &Message,
        waiting: Vec<usize>,
        mut silent: BTreeSet<usize>,
    ) -> CommError {
        let me = self.rank();
        let info = match AbortInfo::from_payload(msg.payload()) {
            Ok(i) => i,
            Err(e) => return self.fail_algo(AlgoError::wire(from, e)),
        };
        if info.reason == AbortReason::Excluded {
            // Relayed to this rank's group: the others it names were dropped alike, and the
            // new group's members ignore a former member's messages.
            self.abort_all(info.clone());
            return self.poison(CommError::Excluded {
                detail: info.detail,
            });
        }
        let culprit = info.culprit as usize;
        if info.reason == AbortReason::Timeout {
            // Answer with our own suspect if we have one, else relay the sender's.
            let blame = silent.first().map_or(info.culprit, |&p| p as u32);
            self.abort_all(AbortInfo {
                reason: AbortReason::Timeout,
                culprit: blame,
                detail: format!("rank {me} answers the timeout abort of rank {from}"),
            });
            silent.insert(culprit);
            let e = self.gossip(BTreeSet::from([from]), silent, waiting);
            return self.poison(e);
        }
        self.abort_all(info.clone());
        let e = match info.reason {
            AbortReason::PeerLost => CommError::PeerLost {
                rank: culprit,
                reported_by: from,
                detail: info.detail,
            },
            AbortReason::Mismatch => CommError::Mismatch {
                rank: culprit,
                reported_by: from,
                detail: info.detail,
            },
            _ => CommError::Protocol {
                rank: culprit,
                reported_by: from,
                detail: info.detail,
            },
        };
        self.poison(e)
    }

    /// After a timeout: collect the other ranks' aborts for the grace period; the ranks not
    /// heard from are the unresponsive ones. If every rank answered (the late one did, in
    /// the end, or this rank is the late one and finds everyone's aborts waiting), they are
    /// the ranks the timed-out ranks blamed (`culprits` so far, plus those named by the
    /// timeout aborts received here), or failing that the peers this rank was `waiting` for.
    pub(super) fn gossip(
        &mut self,
        mut heard: BTreeSet<usize>,
        mut culprits: BTreeSet<usize>,
        waiting: Vec<usize>,
    ) -> CommError {
        let me = self.rank();
        let world = self.world_size();
        let deadline = Instant::now() + self.grace();
        while heard.len() < world - 1 {
            let before = self.transport.bytes().received;
            match self.transport.recv(deadline) {
                Ok((from, bytes)) => {
                    let n = self.transport.bytes().received - before;
                    let Ok(msg) = Message::decode(bytes) else {
                        continue;
                    };
                    if msg.header().kind != Kind::Abort && msg.header().seq > self.seq {
                        // A survivor already regrouping (`Communicator::regroup`): its
                        // message is for later.
                        self.stash.push_back((from, msg, n));
                        continue;
                    }
                    if msg.header().kind == Kind::Abort {
                        heard.insert(from);
                        if let Ok(info) = AbortInfo::from_payload(msg.payload()) {
                            if info.reason == AbortReason::Excluded {
                                // The others went on without this rank: that is the news.
                                return CommError::Excluded {
                                    detail: info.detail,
                                };
                            }
                            if info.reason == AbortReason::Timeout {
                                culprits.insert(info.culprit as usize);
                            }
                        }
                    }
                }
                // A lost peer: the group's transport has recorded it.
                Err(TransportError::Closed { .. } | TransportError::PeerSilent { .. }) => {}
                Err(_) => break,
            }
        }
        let mut ranks: Vec<usize> = (0..world)
            .filter(|&p| p != me && !heard.contains(&p))
            .collect();
        if ranks.is_empty() {
            ranks = culprits.into_iter().filter(|&p| p < world).collect();
        }
        if ranks.is_empty() {
            ranks = waiting;
        }
        CommError::Timeout {
            ranks,
            timeout: self.cfg.timeout,
        }
    }

    pub(super) fn abort_all(&mut self, info: AbortInfo) {
        let bytes = info.to_message(self.seq).into_bytes();
        for p in 0..self.world_size() {
            if p != self.rank() && self.transport.lost(p).is_none() {
                let _ = self.transport.send(p, bytes.clone());
            }
        }
    }

    pub(super) fn fail_peer_lost(&mut self, rank: usize) -> CommError {
        // A peer that aborted (for a reason of its own) and exited sent its abort before
        // closing: look for queued aborts before blaming the closed connection.
        let cap = Instant::now() + self.grace().min(Duration::from_millis(200));
        loop {
            let dl = (Instant::now() + Duration::from_millis(20)).min(cap);
            let before = self.transport.bytes().received;
            match self.transport.recv(dl) {
                Ok((from, bytes)) => {
                    let n = self.transport.bytes().received - before;
                    if let Ok(msg) = Message::decode(bytes) {
                        if msg.header().kind != Kind::Abort && msg.header().seq > self.seq {
                            // For later: a survivor already regrouping.
                            self.stash.push_back((from, msg, n));
                        } else if msg.header().kind == Kind::Abort && msg.header().seq >= self.floor
                        {
                            return self.on_abort(from, &msg, vec![rank], BTreeSet::new());
                        }
                    }
                }
                // A lost peer: the group's transport has recorded it.
                Err(TransportError::Closed { .. } | TransportError::PeerSilent { .. }) => {}
                Err(_) => break,
            }
        }
        let detail = self
            .transport
            .lost(rank)
            .cloned()
            .unwrap_or_else(|| "connection closed".into());
        self.abort_all(AbortInfo {
            reason: AbortReason::PeerLost,
            culprit: rank as u32,
            detail: detail.clone(),
        });
        let e = CommError::PeerLost {
            rank,
            reported_by: self.rank(),
            detail,
        };
        self.poison(e)
    }

    /// The grace period after an inactivity timeout: `abort_grace`, at most half the timeout.
    pub(super) fn grace(&self) -> Duration {
        self.cfg.abort_grace.min(self.cfg.timeout / 2)
    }

    pub(super) fn fail_algo(&mut self, e: AlgoError) -> CommError {
        let me = self.rank();
        let (reason, culprit, detail) = match &e {
            AlgoError::Mismatch { peer, detail } => (AbortReason::Mismatch, *peer, detail.clone()),
            AlgoError::Protocol { peer, detail } => (AbortReason::Protocol, *peer, detail.clone()),
        };
        self.abort_all(AbortInfo {
            reason,
            culprit: culprit as u32,
            detail: detail.clone(),
        });
        let err = match reason {
            AbortReason::Mismatch => CommError::Mismatch {
                rank: culprit,
                reported_by: me,
                detail,
            },
            _ => CommError::Protocol {
                rank: culprit,
                reported_by: me,
                detail,
            },
        };
        self.poison(err)
    }

    pub(super) fn poison(&mut self, e: CommError) -> CommError {
        self.failed = Some(e.to_string());
        e
    }
}
