//! [`PsNode`], the blocking driver of one rank's worker and/or server machine over a
//! [`Transport`], with its [`PsConfig`]: timeouts, co-located delivery, and failures
//! turned into aborts that name the culprit on every rank.

use std::time::{Duration, Instant};

use super::layout::PsLayout;
use super::server::{Aggregator, ServerMachine};
use super::wire::{f32_payload, PsMsg, Reduction};
use super::worker::{Aggregate, WorkerMachine};
use crate::algo::AlgoError;
use crate::comm::CommError;
use crate::transport::{Transport, TransportError};
use crate::wire::AbortReason;

/// Configuration of a [`PsNode`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PsConfig {
    /// Inactivity timeout. Default 30 s.
    pub timeout: Duration,
    /// Extra time a worker waits before blaming servers (so that a server's diagnosis of a
    /// stalled worker arrives first). Default 2 s.
    pub abort_grace: Duration,
    /// Staleness bound `s` (0 = synchronous, `u64::MAX` = unbounded). Default 0.
    pub staleness: u64,
    /// The step every clock starts at (default 0): a run resumed from a checkpoint taken
    /// after `k` steps starts at `k` on every rank, so that servers whose state depends on
    /// the step number (MIPD's alternating halves) continue where they stopped.
    pub first_step: u64,
}

impl Default for PsConfig {
    fn default() -> Self {
        PsConfig {
            timeout: Duration::from_secs(30),
            abort_grace: Duration::from_secs(2),
            staleness: 0,
            first_step: 0,
        }
    }
}

/// One rank of a parameter-server run over a [`Transport`]: its worker and/or server
/// machine, driven by blocking calls (see the [module docs](crate::ps)).
#[derive(Debug)]
pub struct PsNode<T: Transport, A: Aggregator> {
    transport: T,
    layout: PsLayout,
    cfg: PsConfig,
    server: Option<ServerMachine<A>>,
    worker: Option<WorkerMachine>,
    /// Why each peer is lost (`None`: not lost).
    closed: Vec<Option<String>>,
    failed: Option<String>,
}

impl<T: Transport, A: Aggregator> PsNode<T, A> {
    /// This rank's node; its roles come from `layout`. The aggregator is used if the rank
    /// is a server.
    pub fn new(
        transport: T,
        layout: PsLayout,
        cfg: PsConfig,
        aggregator: A,
    ) -> Result<Self, CommError> {
        let me = transport.rank();
        if layout.world_size() != transport.world_size() {
            return Err(CommError::InvalidArgument(format!(
                "layout for {} ranks, transport has {}",
                layout.world_size(),
                transport.world_size()
            )));
        }
        let server = layout.shard_of(me).map(|j| {
            ServerMachine::new(layout.clone(), j, cfg.staleness, aggregator)
                .starting_at(cfg.first_step)
        });
        let worker = layout
            .worker_index(me)
            .map(|_| WorkerMachine::new(layout.clone(), cfg.staleness).starting_at(cfg.first_step));
        if server.is_none() && worker.is_none() {
            return Err(CommError::InvalidArgument(format!(
                "rank {me} is neither a worker nor a server"
            )));
        }
        let world = transport.world_size();
        Ok(PsNode {
            transport,
            layout,
            cfg,
            server,
            worker,
            closed: vec![None; world],
            failed: None,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// Restarts this rank's clocks at `step` (see [`PsConfig::first_step`]) when nothing
    /// has been pushed or served yet: a run resumed from a checkpoint taken after `step`
    /// steps. Every rank of the run must start at the same step.
    pub fn start_at(&mut self, step: u64) -> Result<(), CommError> {
        let first = self.cfg.first_step;
        let fresh = self.worker.as_ref().is_none_or(|w| w.is_fresh(first))
            && self.server.as_ref().is_none_or(|s| s.is_fresh(first));
        if !fresh {
            return Err(CommError::InvalidArgument(format!(
                "the parameter server of rank {} cannot restart its clock at step {step}: it \
                 has already pushed or served",
                self.rank()
            )));
        }
        self.server = self.server.take().map(|m| m.starting_at(step));
        self.worker = self.worker.take().map(|m| m.starting_at(step));
        self.cfg.first_step = step;
        Ok(())
    }

    /// This rank's aggregator, if it serves a shard.
    pub fn aggregator(&self) -> Option<&A> {
        self.server.as_ref().map(ServerMachine::aggregator)
    }

    /// This rank's aggregator, mutably (to restore its state before the first step).
    pub fn aggregator_mut(&mut self) -> Option<&mut A> {
        self.server.as_mut().map(ServerMachine::aggregator_mut)
    }

    /// The layout.
    pub fn layout(&self) -> &PsLayout {
        &self.layout
    }

    /// The transport (for byte counts).
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The worker's clock: steps pushed so far (0 if not a worker).
    pub fn pushed(&self) -> u64 {
        self.worker.as_ref().map_or(0, WorkerMachine::pushed)
    }

    fn worker_mut(&mut self) -> Result<&mut WorkerMachine, CommError> {
        let me = self.rank();
        self.worker
            .as_mut()
            .ok_or_else(|| CommError::InvalidArgument(format!("rank {me} is not a worker")))
    }

    /// Pushes the next step's payloads (one per shard), first waiting — while serving,
    /// on a co-located rank — until the staleness bound allows it. Returns the step.
    pub fn push(
        &mut self,
        payloads: Vec<Vec<u8>>,
        aggregation: Reduction,
    ) -> Result<u64, CommError> {
        let shards = self.layout.num_shards();
        if self.worker_mut()?.has_left() {
            return Err(CommError::InvalidArgument("push after finish".into()));
        }
        if payloads.len() != shards {
            return Err(CommError::InvalidArgument(format!(
                "{} payloads for {shards} shards",
                payloads.len()
            )));
        }
        self.pump_until(|n| n.worker.as_ref().is_some_and(WorkerMachine::can_push))?;
        let step = self
            .worker_mut()?
            .push(aggregation, payloads)
            .map_err(CommError::InvalidArgument)?;
        self.pump_until(|_| true)?;
        Ok(step)
    }

    /// Waits until the aggregate of `step` (already pushed) has arrived, and returns every
    /// aggregate not returned before up to it (in step order).
    pub fn pull(&mut self, step: u64) -> Result<Vec<Aggregate>, CommError> {
        let w = self.worker_mut()?;
        if step >= w.pushed() {
            return Err(CommError::InvalidArgument(format!(
                "pull of step {step}, but only {} pushed",
                w.pushed()
            )));
        }
        self.pump_until(|n| n.worker.as_ref().is_some_and(|w| w.complete() > step))?;
        Ok(self.worker_mut()?.take_ready())
    }

    /// Returns the aggregates that have arrived and were not returned before, without
    /// waiting (after handling what the transport already holds).
    pub fn try_pull(&mut self) -> Result<Vec<Aggregate>, CommError> {
        self.worker_mut()?;
        self.pump_until(|_| true)?;
        Ok(self.worker_mut()?.take_ready())
    }

    /// One training step: pushes this step's payloads, then waits until the staleness
    /// bound allows the next push, and returns every aggregate that has arrived (in step
    /// order; with staleness 0 exactly this step's).
    pub fn step(
        &mut self,
        payloads: Vec<Vec<u8>>,
        aggregation: Reduction,
    ) -> Result<Vec<Aggregate>, CommError> {
        self.push(payloads, aggregation)?;
        self.pump_until(|n| n.worker.as_ref().is_some_and(WorkerMachine::can_push))?;
        Ok(self.worker_mut()?.take_ready())
    }

    /// [`PsNode::step`] for a dense f32 model of `layout.len()` elements: slices it by
    /// shard and encodes each slice for [`DenseF32`].
    ///
    /// [`DenseF32`]: super::DenseF32
    pub fn step_dense(
        &mut self,
        grad: &[f32],
        aggregation: Reduction,
    ) -> Result<Vec<Aggregate>, CommError> {
        if grad.len() != self.layout.len() {
            return Err(CommError::InvalidArgument(format!(
                "gradient of {} elements for a model of {}",
                grad.len(),
                self.layout.len()
            )));
        }
        let payloads = (0..self.layout.num_shards())
            .map(|j| f32_payload(&grad[self.layout.shard_range(j)]))
            .collect();
        self.step(payloads, aggregation)
    }

    /// Ends this rank's part: a worker waits for the aggregates of all its pushed steps
    /// (returned) and leaves; a server (co-located or not) then serves until every worker
    /// has left.
    pub fn finish(&mut self) -> Result<Vec<Aggregate>, CommError> {
        let mut got = Vec::new();
        if self.worker.is_some() {
            self.pump_until(|n| {
                n.worker
                    .as_ref()
                    .is_some_and(|w| w.complete() == w.pushed())
            })?;
            let w = self.worker_mut()?;
            got = w.take_ready();
            w.leave().map_err(CommError::InvalidArgument)?;
        }
        self.pump_until(|n| n.server.as_ref().is_none_or(ServerMachine::is_done))?;
        Ok(got)
    }

    /// Serves until every worker has left (a server-only rank's whole life; on a worker
    /// rank the same as [`PsNode::finish`]).
    pub fn serve(&mut self) -> Result<(), CommError> {
        self.finish().map(|_| ())
    }

    /// Sends what the machines have queued, then handles messages until `done(self)`.
    fn pump_until(&mut self, done: impl Fn(&Self) -> bool) -> Result<(), CommError> {
        if let Some(f) = &self.failed {
            return Err(CommError::Poisoned(f.clone()));
        }
        let r = self.pump_inner(done);
        if let Err(e) = &r {
            self.failed = Some(e.to_string());
        }
        r
    }

    fn patience(&self) -> Duration {
        if self.server.is_some() {
            self.cfg.timeout
        } else {
            self.cfg.timeout + self.cfg.abort_grace
        }
    }

    fn pump_inner(&mut self, done: impl Fn(&Self) -> bool) -> Result<(), CommError> {
        let me = self.rank();
        let mut deadline = Instant::now() + self.patience();
        loop {
            self.flush()?;
            if done(self) {
                return Ok(());
            }
            let (from, bytes) = match self.transport.recv(deadline) {
                Ok(x) => x,
                Err(e @ (TransportError::Closed { .. } | TransportError::PeerSilent { .. })) => {
                    let rank = self.mark_lost(&e);
                    if self.expects_from(rank) {
                        return Err(self.lost(rank));
                    }
                    continue;
                }
                Err(TransportError::Timeout) => {
                    let mut culprits = self
                        .server
                        .as_ref()
                        .map(ServerMachine::waiting_on)
                        .unwrap_or_default();
                    if culprits.is_empty() {
                        culprits = self
                            .worker
                            .as_ref()
                            .map(WorkerMachine::waiting_on)
                            .unwrap_or_default();
                    }
                    culprits.retain(|&r| r != me);
                    return Err(self.fail(
                        AbortReason::Timeout,
                        culprits,
                        format!("rank {me} made no progress for {:?}", self.patience()),
                    ));
                }
                Err(e) => return Err(e.into()),
            };
            let msg = match PsMsg::decode(bytes) {
                Ok(m) => m,
                Err(detail) => return Err(self.fail(AbortReason::Protocol, vec![from], detail)),
            };
            let r = match msg {
                PsMsg::Abort {
                    reason,
                    culprits,
                    detail,
                } => {
                    return Err(abort_error(
                        reason,
                        culprits,
                        from,
                        detail,
                        self.cfg.timeout,
                    ))
                }
                m @ (PsMsg::Push { .. } | PsMsg::Leave { .. }) => match &mut self.server {
                    Some(s) => s.handle(from, m),
                    None => Err(AlgoError::Protocol {
                        peer: from,
                        detail: "sent a push to a rank that is not a server".into(),
                    }),
                },
                m @ PsMsg::Aggregate { .. } => match &mut self.worker {
                    Some(w) => w.handle(from, m),
                    None => Err(AlgoError::Protocol {
                        peer: from,
                        detail: "sent an aggregate to a rank that is not a worker".into(),
                    }),
                },
            };
            match r {
                Ok(()) => deadline = Instant::now() + self.patience(),
                Err(AlgoError::Mismatch { peer, detail }) => {
                    return Err(self.fail(AbortReason::Mismatch, vec![peer], detail))
                }
                Err(AlgoError::Protocol { peer, detail }) => {
                    return Err(self.fail(AbortReason::Protocol, vec![peer], detail))
                }
            }
        }
    }

    fn expects_from(&self, rank: usize) -> bool {
        self.server.as_ref().is_some_and(|s| s.expects_from(rank))
            || self.worker.as_ref().is_some_and(|w| w.expects_from(rank))
    }

    /// Sends everything the machines queued; a closed peer that is still needed is fatal,
    /// one that is not (a worker that left) is skipped.
    fn flush(&mut self) -> Result<(), CommError> {
        loop {
            let next = match self.server.as_mut().and_then(ServerMachine::poll_transmit) {
                Some(x) => Some(x),
                None => self.worker.as_mut().and_then(WorkerMachine::poll_transmit),
            };
            let Some((to, msg)) = next else {
                return Ok(());
            };
            if to == self.rank() {
                // Co-located: deliver to the other role of this rank directly.
                let r = match msg {
                    m @ (PsMsg::Push { .. } | PsMsg::Leave { .. }) => {
                        self.server.as_mut().expect("layout").handle(to, m)
                    }
                    m => self.worker.as_mut().expect("layout").handle(to, m),
                };
                if let Err(e) = r {
                    let (kind, peer, detail) = match e {
                        AlgoError::Mismatch { peer, detail } => {
                            (AbortReason::Mismatch, peer, detail)
                        }
                        AlgoError::Protocol { peer, detail } => {
                            (AbortReason::Protocol, peer, detail)
                        }
                    };
                    return Err(self.fail(kind, vec![peer], detail));
                }
                continue;
            }
            if self.closed[to].is_some() {
                if self.expects_from(to) || matches!(msg, PsMsg::Push { .. }) {
                    return Err(self.lost(to));
                }
                continue;
            }
            match self.transport.send(to, msg.encode()) {
                Ok(()) => {}
                Err(e @ TransportError::Closed { .. }) => {
                    let rank = self.mark_lost(&e);
                    if self.expects_from(rank) || matches!(msg, PsMsg::Push { .. }) {
                        return Err(self.lost(rank));
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// `rank`'s connection closed while it was needed. A peer that failed for a reason of
    /// its own sent its abort before closing: look for queued aborts (briefly) before
    /// blaming the closed connection.
    fn lost(&mut self, rank: usize) -> CommError {
        let cap = Instant::now() + self.cfg.abort_grace.min(Duration::from_millis(200));
        loop {
            let dl = (Instant::now() + Duration::from_millis(20)).min(cap);
            match self.transport.recv(dl) {
                Ok((from, bytes)) => {
                    if let Ok(PsMsg::Abort {
                        reason,
                        culprits,
                        detail,
                    }) = PsMsg::decode(bytes)
                    {
                        return abort_error(reason, culprits, from, detail, self.cfg.timeout);
                    }
                }
                Err(e @ (TransportError::Closed { .. } | TransportError::PeerSilent { .. })) => {
                    self.mark_lost(&e);
                }
                Err(_) => break,
            }
        }
        let detail = self.closed[rank]
            .clone()
            .unwrap_or_else(|| "connection closed".into());
        self.fail(AbortReason::PeerLost, vec![rank], detail)
    }

    /// Records the peer of a [`TransportError::Closed`] / [`TransportError::PeerSilent`]
    /// as lost and returns it.
    fn mark_lost(&mut self, e: &TransportError) -> usize {
        let (rank, why) = e.lost_peer().expect("a lost-peer error");
        self.closed[rank].get_or_insert(why);
        rank
    }

    /// Tells every other rank of the run to give up, and returns the matching error.
    fn fail(&mut self, reason: AbortReason, culprits: Vec<usize>, detail: String) -> CommError {
        let me = self.rank();
        let bytes = PsMsg::Abort {
            reason,
            culprits: culprits.iter().map(|&r| r as u32).collect(),
            detail: detail.clone(),
        }
        .encode();
        for p in 0..self.transport.world_size() {
            if p != me && self.closed[p].is_none() {
                let _ = self.transport.send(p, bytes.clone());
            }
        }
        abort_error(
            reason,
            culprits.iter().map(|&r| r as u32).collect(),
            me,
            detail,
            self.cfg.timeout,
        )
    }
}

fn abort_error(
    reason: AbortReason,
    culprits: Vec<u32>,
    reported_by: usize,
    detail: String,
    timeout: Duration,
) -> CommError {
    let ranks: Vec<usize> = culprits.iter().map(|&r| r as usize).collect();
    let rank = ranks.first().copied().unwrap_or(reported_by);
    match reason {
        AbortReason::PeerLost => CommError::PeerLost {
            rank,
            reported_by,
            detail,
        },
        AbortReason::Timeout => CommError::Timeout { ranks, timeout },
        AbortReason::Mismatch => CommError::Mismatch {
            rank,
            reported_by,
            detail,
        },
        AbortReason::Protocol | AbortReason::Excluded => CommError::Protocol {
            rank,
            reported_by,
            detail,
        },
    }
}
