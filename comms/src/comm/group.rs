//! Live membership: the group a [`Communicator`] runs its collectives over, and how the
//! survivors of a failure agree on a smaller group on the same connections.
//!
//! A communicator starts with every rank of its transport. Its collectives name ranks of
//! the *current group*: `rank()` and `world_size()` are this rank's index in the group and
//! the group's size, and a wrapper of the transport under the collectives maps them to the
//! transport's (physical) ranks, dropping messages and closed-connection events of ranks
//! that are no longer members.
//!
//! # Re-forming the group ([`Communicator::regroup`])
//! After a collective failed naming ranks (a lost peer, a timeout, a mismatch), the
//! survivors call `regroup` with the ranks the error blamed. Each survivor holds a set of
//! *excluded* physical ranks (the blamed ones, plus any member whose connection it saw
//! close) and runs rounds over the candidates — the previous members not excluded:
//!
//! 1. round `r` of epoch `e` is an all-gather, at sequence number `e·2⁴⁰ + r`, of each
//!    candidate's excluded set;
//! 2. if the all-gather fails, the ranks its error blames join the set, and the next round
//!    runs over fewer candidates;
//! 3. otherwise every candidate holds every candidate's set (the same sets on every one);
//!    if they are all equal to its own, the group is agreed — the candidates, in their
//!    old order — else each takes the union and runs another round.
//!
//! Every candidate decides from the same sets, so they agree on the same group in the same
//! round; sets only grow, so there are at most as many rounds as ranks. Messages of the
//! failed collective and of earlier rounds that are still in flight (relayed aborts, chunks
//! sent before a peer died) carry sequence numbers below the new floor and are dropped.
//!
//! **Who may go on.** A group may go on only if it holds a strict majority of the
//! previous group, or if every rank it lost is gone for certain (its connection closed:
//! its process exited or was killed). A minority that lost the others to silence or
//! timeouts stops with [`CommError::NoMajority`]: in a network partition both halves see
//! each other fall silent, and at most one of them may continue. A rank that the others
//! excluded while it was alive (frozen past the deadline, say) is told so once it talks
//! again and fails with [`CommError::Excluded`], instead of carrying on alone; it may come
//! back only as a joiner.
//!
//! # Admitting newcomers ([`Communicator::admit`], [`Communicator::join`])
//! A newcomer takes the transport rank of a lost member: its transport connects to the
//! members, which report it as waiting ([`Transport::joiners`]). At a point every member
//! reaches together (the trainer: a step boundary), the members call `admit`: one
//! all-gather of the newcomers each has connected, and the ones *every* member has are
//! admitted — the transport switches to their connections ([`Transport::admit`]), and the
//! group of the next epoch is the old members in their order followed by the newcomers
//! (so no member's group rank changes, and the leader stays). The leader then sends each
//! newcomer a [`Welcome`] (epoch and members), which the newcomer's `join` waits for; from
//! there on the newcomer is a member like the others, at the same sequence numbers.
//! A newcomer some member has not (yet) seen is left waiting for a later `admit`.
//! Newcomers need a link among themselves too (a node's workers coming back): of two, the
//! later one learned the other's new address and dialed it, the earlier one knew only its
//! predecessor's. So a newcomer reports the newcomers it dialed as waiting (it admits
//! them once it is a member), and on its welcome it keeps the connection it dialed to
//! each member or admits the one it was dialed on ([`Transport::link_member`]).
//!
//! The ranks a `regroup` names ([`Membership::members`], [`Membership::removed`]) are the
//! transport's: stable for the life of the run, unlike the group indices, which shift down
//! past a removed rank.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::{CommError, Communicator};
use crate::transport::{ByteCount, Transport, TransportError};
use crate::wire::{AbortInfo, AbortReason, Kind, Message, Welcome};

/// The sequence numbers of membership epoch `e` start at `e · EPOCH_SEQ`: far above any
/// count of collectives a run makes in one epoch.
const EPOCH_SEQ: u64 = 1 << 40;

/// The collectives of an agreed group start this far into their epoch's sequence numbers,
/// above every agreement round.
const GROUP_SEQ: u64 = 1 << 32;

/// The sequence number of the notice that tells an excluded rank so: above every floor,
/// so it is never dropped as stale.
const NOTICE_SEQ: u64 = u64::MAX - 1;

/// The sequence number of a [`Welcome`] (never stale either).
const WELCOME_SEQ: u64 = u64::MAX - 2;

/// How long a welcomed newcomer waits for a member that was a newcomer itself to have
/// connected to it (see [`crate::Transport::link_member`]; at most the collective timeout).
const NEWCOMER_LINK: Duration = Duration::from_secs(10);

/// The group a [`Communicator::regroup`], [`Communicator::admit`] or
/// [`Communicator::join`] agreed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    /// The membership epoch: 0 for the first group, one more at each change.
    pub epoch: u64,
    /// The members' transport ranks, in order: member `i` is the group's rank `i`.
    pub members: Vec<usize>,
    /// The transport ranks this change removed.
    pub removed: Vec<usize>,
    /// The transport ranks this change admitted (newcomers).
    pub added: Vec<usize>,
    /// This rank's index in the group.
    pub rank: usize,
}

/// A transport restricted to a group of its ranks (see the [module docs](self)).
#[derive(Debug)]
pub(crate) struct Grouped<T> {
    inner: T,
    epoch: u64,
    /// Group index → transport rank.
    members: Vec<usize>,
    /// Transport rank → group index (`None`: not a member).
    index: Vec<Option<usize>>,
    /// Transport ranks whose connection closed or went silent, with why.
    gone: Vec<Option<String>>,
    /// This rank's group index.
    me: usize,
}

impl<T: Transport> Grouped<T> {
    /// Every rank of `inner`, epoch 0.
    pub(crate) fn new(inner: T) -> Self {
        let world = inner.world_size();
        Grouped {
            me: inner.rank(),
            inner,
            epoch: 0,
            members: (0..world).collect(),
            index: (0..world).map(Some).collect(),
            gone: vec![None; world],
        }
    }

    pub(crate) fn inner(&self) -> &T {
        &self.inner
    }

    fn inner_mut(&mut self) -> &mut T {
        &mut self.inner
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    pub(crate) fn members(&self) -> &[usize] {
        &self.members
    }

    /// Why member `r` is lost (its connection closed or went silent); `None` while it is
    /// not. Every such event passes through this wrapper, which records it.
    pub(crate) fn lost(&self, r: usize) -> Option<&String> {
        self.gone[self.members[r]].as_ref()
    }

    /// The transport rank of group index `r`.
    pub(crate) fn physical(&self, r: usize) -> usize {
        self.members[r]
    }

    /// Makes `members` (transport ranks, containing this one) the group of `epoch`.
    fn set(&mut self, epoch: u64, members: Vec<usize>) {
        let me = self.inner.rank();
        self.index.fill(None);
        for (i, &p) in members.iter().enumerate() {
            self.index[p] = Some(i);
        }
        self.me = self.index[me].expect("this rank is a member");
        self.members = members;
        self.epoch = epoch;
    }

    /// A transport error about transport rank `p` in group terms; `None` when `p` is not a
    /// member (its events no longer concern the group).
    fn group_error(&mut self, e: TransportError) -> Option<TransportError> {
        if let Some((p, why)) = e.lost_peer() {
            self.gone[p].get_or_insert(why);
            let r = self.index[p]?;
            return Some(match e {
                TransportError::PeerSilent { silent_for, .. } => TransportError::PeerSilent {
                    rank: r,
                    silent_for,
                },
                _ => TransportError::Closed { rank: r },
            });
        }
        Some(e)
    }

    /// A send to a transport rank that need not be a member (the exclusion notice).
    fn send_physical(&mut self, p: usize, msg: Vec<u8>) {
        if self.gone[p].is_none() {
            let _ = self.inner.send(p, msg);
        }
    }
}

impl<T: Transport> Transport for Grouped<T> {
    fn rank(&self) -> usize {
        self.me
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn send(&mut self, to: usize, msg: Vec<u8>) -> Result<(), TransportError> {
        let Some(&p) = self.members.get(to) else {
            return Err(TransportError::InvalidRank {
                rank: to,
                world: self.members.len(),
            });
        };
        match self.inner.send(p, msg) {
            Ok(()) => Ok(()),
            Err(e) => Err(self
                .group_error(e)
                .unwrap_or(TransportError::Closed { rank: to })),
        }
    }

    fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
        loop {
            match self.inner.recv(deadline) {
                Ok((p, bytes)) => {
                    if let Some(r) = self.index[p] {
                        return Ok((r, bytes));
                    }
                    // A former member's late message: not for this group.
                }
                Err(e) => {
                    if let Some(e) = self.group_error(e) {
                        return Err(e);
                    }
                }
            }
        }
    }

    fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError> {
        let Some(&p) = self.members.get(from) else {
            return Err(TransportError::InvalidRank {
                rank: from,
                world: self.members.len(),
            });
        };
        self.inner.recv_from(p, deadline).map_err(|e| {
            self.group_error(e)
                .unwrap_or(TransportError::Closed { rank: from })
        })
    }

    fn bytes(&self) -> ByteCount {
        self.inner.bytes()
    }
}

impl<T: Transport> Communicator<T> {
    /// The membership epoch: 0 until the first [`Communicator::regroup`].
    pub fn epoch(&self) -> u64 {
        self.transport.epoch()
    }

    /// The transport ranks of the current group, in group order.
    pub fn members(&self) -> &[usize] {
        self.transport.members()
    }

    /// After a failed collective, agrees with the other survivors on the group that goes
    /// on without `suspects` (group ranks, usually the failed call's
    /// [`CommError::failed_ranks`]) and makes it this communicator's group: the
    /// communicator is usable again, its ranks are the new group's, and messages of the
    /// failed collective still in flight are dropped. Every survivor must call it; see the
    /// [module docs](self) for the protocol and for who may go on.
    ///
    /// Fails with [`CommError::Excluded`] when the others dropped this rank, with
    /// [`CommError::NoMajority`] when the survivors may not go on, and with the error of a
    /// round that failed for a reason no rank is blamed for.
    pub fn regroup(&mut self, suspects: &[usize]) -> Result<Membership, CommError> {
        let previous: Vec<usize> = self.transport.members().to_vec();
        let me = self.transport.inner().rank();
        let mut out: BTreeSet<usize> = suspects
            .iter()
            .filter(|&&r| r < previous.len())
            .map(|&r| previous[r])
            .collect();
        let epoch = self.transport.epoch() + 1;
        let base = epoch * EPOCH_SEQ;
        for round in 0..=previous.len() as u64 {
            out.extend(
                previous
                    .iter()
                    .copied()
                    .filter(|&p| self.transport.gone[p].is_some()),
            );
            if out.contains(&me) {
                let e = CommError::Excluded {
                    detail: format!(
                        "membership epoch {epoch}: the other survivors count this rank as lost"
                    ),
                };
                self.failed = Some(e.to_string());
                return Err(e);
            }
            let members: Vec<usize> = previous
                .iter()
                .copied()
                .filter(|p| !out.contains(p))
                .collect();
            self.enter(epoch, members.clone(), base + round);
            let mine: Vec<u8> = out.iter().flat_map(|&p| (p as u32).to_le_bytes()).collect();
            match self.all_gather(&mine) {
                Ok(sets) => {
                    let mut union = out.clone();
                    for (r, s) in sets.iter().enumerate() {
                        if s.len() % 4 != 0 {
                            return Err(CommError::Protocol {
                                rank: members[r],
                                reported_by: me,
                                detail: format!("a membership set of {} bytes", s.len()),
                            });
                        }
                        union.extend(
                            s.chunks_exact(4)
                                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize),
                        );
                    }
                    if union == out {
                        return self.agreed(epoch, previous, members, base);
                    }
                    out = union;
                }
                Err(e) => {
                    let blamed = e.failed_ranks();
                    if blamed.is_empty() {
                        return Err(e);
                    }
                    out.extend(
                        blamed
                            .into_iter()
                            .filter(|&r| r < members.len())
                            .map(|r| members[r]),
                    );
                }
            }
        }
        Err(CommError::Poisoned(format!(
            "membership epoch {epoch}: no agreement after {} rounds",
            previous.len() + 1
        )))
    }

    /// Makes `members` the group at sequence number `seq` (also the floor below which
    /// messages are stale), with a fresh failure state.
    fn enter(&mut self, epoch: u64, members: Vec<usize>, seq: u64) {
        // Messages a peer already sent for this round or later (a survivor that got here
        // first), kept while this rank still waited in the failed collective: renamed to
        // the new group's ranks; the rest is stale.
        let stash: Vec<_> = std::mem::take(&mut self.stash)
            .into_iter()
            .filter(|(_, m, _)| m.header().seq >= seq)
            .map(|(r, m, n)| (self.transport.physical(r), m, n))
            .collect();
        self.transport.set(epoch, members);
        for (p, m, n) in stash {
            if let Some(r) = self.transport.index[p] {
                self.stash.push_back((r, m, n));
            }
        }
        let n = self.transport.members().len();
        self.seq = seq;
        self.floor = seq;
        self.failed = None;
        self.heard = vec![false; n];
    }

    /// The group is agreed: decides whether it may go on, tells the ranks it excluded
    /// while they were alive, and starts its collectives.
    fn agreed(
        &mut self,
        epoch: u64,
        previous: Vec<usize>,
        members: Vec<usize>,
        base: u64,
    ) -> Result<Membership, CommError> {
        let removed: Vec<usize> = previous
            .iter()
            .copied()
            .filter(|p| !members.contains(p))
            .collect();
        let all_gone = removed.iter().all(|&p| self.transport.gone[p].is_some());
        if 2 * members.len() <= previous.len() && !all_gone {
            let e = CommError::NoMajority {
                epoch,
                members: members.clone(),
                previous: previous.len(),
            };
            self.failed = Some(e.to_string());
            return Err(e);
        }
        let notice = AbortInfo {
            reason: AbortReason::Excluded,
            culprit: AbortInfo::NO_CULPRIT,
            detail: format!(
                "membership epoch {epoch}: the group went on as ranks {members:?} without you"
            ),
        }
        .to_message(NOTICE_SEQ)
        .into_bytes();
        for &p in &removed {
            self.transport.send_physical(p, notice.clone());
        }
        let rank = self.transport.rank();
        self.enter(epoch, members.clone(), base + GROUP_SEQ);
        Ok(Membership {
            epoch,
            members,
            removed,
            added: Vec::new(),
            rank,
        })
    }

    /// The newcomers connected to this rank and waiting to be admitted: transport ranks
    /// that are not members (see [`Transport::joiners`]).
    pub fn waiting_joiners(&mut self) -> Vec<usize> {
        let mut w = self.transport.inner_mut().joiners();
        w.retain(|&p| self.transport.index[p].is_none());
        w
    }

    /// Admits the newcomers every member has connected (see the [module docs](self)): a
    /// collective of the current group, which every member must call at the same point.
    /// `None` when there is none to admit (this time); otherwise the group of the new
    /// epoch, which this communicator now runs over, and whose leader has welcomed them.
    pub fn admit(&mut self) -> Result<Option<Membership>, CommError> {
        let mine = self.waiting_joiners();
        let bytes: Vec<u8> = mine
            .iter()
            .flat_map(|&p| (p as u32).to_le_bytes())
            .collect();
        let sets = self.all_gather(&bytes)?;
        let world = self.transport.inner().world_size();
        let mut agreed: BTreeSet<usize> = mine.into_iter().collect();
        for (r, s) in sets.iter().enumerate() {
            if s.len() % 4 != 0 {
                return Err(CommError::Protocol {
                    rank: self.transport.physical(r),
                    reported_by: self.transport.inner().rank(),
                    detail: format!("a set of newcomers of {} bytes", s.len()),
                });
            }
            let theirs: BTreeSet<usize> = s
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize)
                .filter(|&p| p < world)
                .collect();
            agreed = agreed.intersection(&theirs).copied().collect();
        }
        if agreed.is_empty() {
            return Ok(None);
        }
        for &p in &agreed {
            // Every member admits the same newcomers: one this rank cannot switch to (its
            // connection gone meanwhile) is a member that fails the next collective, which
            // the group then survives like any loss, rather than an error here that would
            // leave this rank out of step with the others.
            match self.transport.inner_mut().admit(p) {
                Ok(()) => self.transport.gone[p] = None,
                Err(e) => {
                    self.transport.gone[p] = Some(format!("admitting it failed: {e}"));
                }
            }
        }
        let epoch = self.transport.epoch() + 1;
        let added: Vec<usize> = agreed.into_iter().collect();
        let mut members = self.transport.members().to_vec();
        members.extend(&added);
        self.enter(epoch, members.clone(), epoch * EPOCH_SEQ + GROUP_SEQ);
        let rank = self.transport.rank();
        if rank == 0 {
            let welcome = Welcome {
                epoch,
                joined: added.len() as u32,
                members: members.iter().map(|&p| p as u32).collect(),
            }
            .to_message(WELCOME_SEQ)
            .into_bytes();
            for &p in &added {
                let r = self.transport.index[p].expect("a member now");
                // A newcomer gone already fails the group's next collective (and is
                // dropped then, as any lost member).
                let _ = self.transport.send(r, welcome.clone());
            }
        }
        Ok(Some(Membership {
            epoch,
            members,
            removed: Vec::new(),
            added,
            rank,
        }))
    }

    /// A newcomer's communicator (its transport holding a lost member's rank) waits, for
    /// at most `timeout`, until the group admits it ([`Communicator::admit`]) and welcomes
    /// it; it is then a member of the group of the welcome's epoch. What members send it
    /// before the welcome arrives is kept for the collectives it belongs to.
    pub fn join(&mut self, timeout: Duration) -> Result<Membership, CommError> {
        let me = self.transport.inner().rank();
        let deadline = Instant::now() + timeout;
        loop {
            let before = self.transport.bytes().received;
            let (from, bytes) = match self.transport.recv(deadline) {
                Ok(m) => m,
                Err(TransportError::Timeout) => {
                    return Err(CommError::Timeout {
                        timeout,
                        ranks: Vec::new(),
                    })
                }
                // A lost rank whose place is still empty, or a member that went meanwhile
                // (the group's business once this rank is in it) — unless every other rank
                // is gone: the group ended, or never was.
                Err(TransportError::Closed { .. } | TransportError::PeerSilent { .. }) => {
                    let world = self.transport.inner().world_size();
                    if (0..world).all(|p| p == me || self.transport.gone[p].is_some()) {
                        return Err(CommError::Poisoned(format!(
                            "waiting to join as rank {me}: every other rank is gone (the run \
                             ended, or its workers were lost)"
                        )));
                    }
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let n = self.transport.bytes().received - before;
            let msg = Message::decode(bytes).map_err(|e| CommError::Protocol {
                rank: from,
                reported_by: me,
                detail: e.to_string(),
            })?;
            if msg.header().kind != Kind::Welcome {
                if msg.header().kind != Kind::Abort {
                    self.stash.push_back((from, msg, n));
                }
                continue;
            }
            let w = Welcome::from_payload(msg.payload()).map_err(|e| CommError::Protocol {
                rank: from,
                reported_by: me,
                detail: e.to_string(),
            })?;
            let members: Vec<usize> = w.members.iter().map(|&p| p as usize).collect();
            let world = self.transport.inner().world_size();
            if !members.contains(&me) || members.iter().any(|&p| p >= world) {
                return Err(CommError::Protocol {
                    rank: from,
                    reported_by: me,
                    detail: format!(
                        "a welcome into members {members:?}, which do not hold this rank \
                         ({me} of {world})"
                    ),
                });
            }
            let added = members[members.len() - w.joined as usize..].to_vec();
            if !added.contains(&me) {
                return Err(CommError::Protocol {
                    rank: from,
                    reported_by: me,
                    detail: format!("a welcome whose newcomers {added:?} do not hold rank {me}"),
                });
            }
            // A link to each member (one that cannot be made is a member that fails the
            // group's first collective, and is dropped then).
            let by = Instant::now() + self.cfg.timeout.min(NEWCOMER_LINK);
            for &p in members.iter().filter(|&&p| p != me) {
                self.transport.gone[p] = match self.transport.inner_mut().link_member(p, by) {
                    Ok(()) => None,
                    Err(e) => Some(format!("linking to it on being welcomed: {e}")),
                };
            }
            self.enter(w.epoch, members.clone(), w.epoch * EPOCH_SEQ + GROUP_SEQ);
            return Ok(Membership {
                epoch: w.epoch,
                added,
                removed: Vec::new(),
                rank: self.transport.rank(),
                members,
            });
        }
    }
}
