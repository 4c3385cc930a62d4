//! A worker: the IO-free [`WorkerMachine`], which pushes steps within the staleness bound
//! and hands out each step's [`Aggregate`] once every shard's server sent it.

use std::collections::{BTreeMap, VecDeque};

use super::layout::{saturating_bound, PsLayout};
use super::wire::{f32_values, PsMsg, Reduction};
use crate::algo::AlgoError;

/// The aggregate of one step: one payload per shard, in shard order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Aggregate {
    /// Step.
    pub step: u64,
    /// `shards[j]` is shard `j`'s aggregate.
    pub shards: Vec<Vec<u8>>,
}

impl Aggregate {
    /// The shards' f32 values concatenated: the whole model for [`DenseF32`] aggregates.
    ///
    /// [`DenseF32`]: super::DenseF32
    pub fn dense(&self) -> Vec<f32> {
        self.shards.iter().flat_map(|s| f32_values(s)).collect()
    }
}

/// A worker, as an IO-free state machine (see the [module docs](crate::ps)).
#[derive(Debug)]
pub struct WorkerMachine {
    layout: PsLayout,
    staleness: u64,
    /// Steps pushed.
    pushed: u64,
    /// Per shard: aggregates received (they arrive in step order).
    received: Vec<u64>,
    /// Step → per shard aggregate, for steps not yet handed out.
    ready: BTreeMap<u64, Vec<Option<Vec<u8>>>>,
    /// Steps whose aggregate arrived from every shard.
    complete: u64,
    /// Steps handed out by `take_ready`.
    taken: u64,
    left: bool,
    out: VecDeque<(usize, PsMsg)>,
}

impl WorkerMachine {
    /// A worker of `layout` with staleness bound `staleness`.
    pub fn new(layout: PsLayout, staleness: u64) -> Self {
        let m = layout.num_shards();
        WorkerMachine {
            layout,
            staleness,
            pushed: 0,
            received: vec![0; m],
            ready: BTreeMap::new(),
            complete: 0,
            taken: 0,
            left: false,
            out: VecDeque::new(),
        }
    }

    /// Starts the clock at `step` instead of 0: the next push is `step` (a run resumed
    /// after `step` steps; see [`PsConfig::first_step`]).
    ///
    /// [`PsConfig::first_step`]: super::PsConfig::first_step
    pub fn starting_at(mut self, step: u64) -> Self {
        self.pushed = step;
        self.received.iter_mut().for_each(|r| *r = step);
        self.complete = step;
        self.taken = step;
        self
    }

    /// Whether nothing was pushed or left since the clock started at `first`.
    pub(super) fn is_fresh(&self, first: u64) -> bool {
        self.pushed == first && !self.left && self.out.is_empty()
    }

    /// Whether the worker has left (queued its leave messages).
    pub(super) fn has_left(&self) -> bool {
        self.left
    }

    /// Steps pushed so far (the worker's clock; the next push is this step).
    pub fn pushed(&self) -> u64 {
        self.pushed
    }

    /// Steps whose aggregate has arrived from every shard.
    pub fn complete(&self) -> u64 {
        self.complete
    }

    /// Whether the staleness bound allows pushing the next step now.
    pub fn can_push(&self) -> bool {
        !self.left && self.pushed <= saturating_bound(self.complete, self.staleness)
    }

    /// Queues the pushes of the next step (one payload per shard); returns the step.
    /// Errors (nothing queued) if the bound does not allow it yet, the worker has left, or
    /// the number of payloads is not the number of shards.
    pub fn push(&mut self, aggregation: Reduction, payloads: Vec<Vec<u8>>) -> Result<u64, String> {
        if payloads.len() != self.layout.num_shards() {
            return Err(format!(
                "{} payloads for {} shards",
                payloads.len(),
                self.layout.num_shards()
            ));
        }
        if !self.can_push() {
            return Err(format!(
                "step {} not allowed: {} steps complete, staleness bound {} (left: {})",
                self.pushed, self.complete, self.staleness, self.left
            ));
        }
        let step = self.pushed;
        for (j, payload) in payloads.into_iter().enumerate() {
            self.out.push_back((
                self.layout.servers()[j],
                PsMsg::Push {
                    shard: j as u32,
                    step,
                    aggregation,
                    payload,
                },
            ));
        }
        self.pushed += 1;
        Ok(step)
    }

    /// Queues the leave messages. Errors if aggregates of pushed steps are outstanding.
    pub fn leave(&mut self) -> Result<(), String> {
        if self.complete != self.pushed {
            return Err(format!(
                "{} steps pushed but only {} aggregated",
                self.pushed, self.complete
            ));
        }
        if !self.left {
            self.left = true;
            for &s in self.layout.servers() {
                self.out.push_back((s, PsMsg::Leave { steps: self.pushed }));
            }
        }
        Ok(())
    }

    /// Feeds one message from `from`.
    pub fn handle(&mut self, from: usize, msg: PsMsg) -> Result<(), AlgoError> {
        match msg {
            PsMsg::Aggregate {
                shard,
                step,
                payload,
            } => {
                let j = shard as usize;
                if j >= self.layout.num_shards() || self.layout.servers()[j] != from {
                    return Err(AlgoError::Protocol {
                        peer: from,
                        detail: format!("sent an aggregate of shard {shard} it does not serve"),
                    });
                }
                if step != self.received[j] || step >= self.pushed {
                    return Err(AlgoError::Protocol {
                        peer: from,
                        detail: format!(
                            "sent the aggregate of step {step}; expected step {} ({} pushed)",
                            self.received[j], self.pushed
                        ),
                    });
                }
                self.received[j] += 1;
                let m = self.layout.num_shards();
                self.ready.entry(step).or_insert_with(|| vec![None; m])[j] = Some(payload);
                self.complete = *self.received.iter().min().expect("at least one shard");
                Ok(())
            }
            other => Err(AlgoError::Protocol {
                peer: from,
                detail: format!("unexpected message at a worker: {other:?}"),
            }),
        }
    }

    /// The next message to send, as `(to_rank, message)`.
    pub fn poll_transmit(&mut self) -> Option<(usize, PsMsg)> {
        self.out.pop_front()
    }

    /// Hands out the aggregates of completed steps not handed out before, in step order.
    pub fn take_ready(&mut self) -> Vec<Aggregate> {
        let mut v = Vec::new();
        while self.taken < self.complete {
            let shards = self
                .ready
                .remove(&self.taken)
                .expect("complete step is ready");
            v.push(Aggregate {
                step: self.taken,
                shards: shards.into_iter().map(|s| s.expect("complete")).collect(),
            });
            self.taken += 1;
        }
        v
    }

    /// Whether the worker waits for a message from `rank` (a server with outstanding
    /// aggregates).
    pub fn expects_from(&self, rank: usize) -> bool {
        self.layout
            .shard_of(rank)
            .is_some_and(|j| self.received[j] < self.pushed)
    }

    /// The servers whose aggregate of the oldest incomplete step is missing.
    pub fn waiting_on(&self) -> Vec<usize> {
        let servers = self.layout.servers();
        (0..servers.len())
            .filter(|&j| self.received[j] < self.pushed)
            .map(|j| servers[j])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(w: usize, m: usize, len: usize) -> PsLayout {
        PsLayout::new(w + m, (0..w).collect(), (w..w + m).collect(), len).unwrap()
    }

    #[test]
    fn worker_respects_the_staleness_bound_and_orders_aggregates() {
        let l = layout(1, 2, 4);
        let mut w = WorkerMachine::new(l, 1);
        let p = || vec![vec![0u8; 8], vec![0u8; 8]];
        assert_eq!(w.push(Reduction::SUM, p()).unwrap(), 0);
        assert_eq!(w.push(Reduction::SUM, p()).unwrap(), 1);
        assert!(!w.can_push());
        assert!(w.push(Reduction::SUM, p()).is_err());
        assert!(w.push(Reduction::SUM, vec![]).is_err());
        assert_eq!(std::iter::from_fn(|| w.poll_transmit()).count(), 4);
        let agg = |shard, step| PsMsg::Aggregate {
            shard,
            step,
            payload: vec![shard as u8],
        };
        // Shard 1's server is rank 2; rank 1 does not serve shard 1.
        assert!(w.handle(1, agg(1, 0)).is_err());
        w.handle(2, agg(1, 0)).unwrap();
        assert!(w.take_ready().is_empty());
        assert_eq!(w.waiting_on(), vec![1, 2]);
        w.handle(1, agg(0, 0)).unwrap();
        assert!(w.can_push());
        let got = w.take_ready();
        assert_eq!(
            got,
            vec![Aggregate {
                step: 0,
                shards: vec![vec![0], vec![1]]
            }]
        );
        // Step 2 was never pushed: an aggregate for it is a protocol error.
        w.handle(1, agg(0, 1)).unwrap();
        assert!(w.handle(1, agg(0, 2)).is_err());
        assert!(w.leave().is_err());
    }
}
