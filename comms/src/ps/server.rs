//! The server of one shard: the [`Aggregator`] seam (what a server does with the pushes
//! of a step), the default [`DenseF32`], and the IO-free [`ServerMachine`].

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

use super::layout::{saturating_bound, PsLayout};
use super::wire::{PsMsg, Reduction};
use crate::algo::AlgoError;

/// What an [`Aggregator`] combines: the pushes of one step for one shard.
#[derive(Debug)]
pub struct ShardPushes<'a> {
    /// Shard index.
    pub shard: usize,
    /// The shard's element range in the model.
    pub range: Range<usize>,
    /// Step.
    pub step: u64,
    /// The reduction every worker asked for.
    pub aggregation: Reduction,
    /// `(worker rank, payload)` in worker order.
    pub pushes: &'a [(usize, &'a [u8])],
}

/// A push an [`Aggregator`] could not use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AggregateError {
    /// The worker whose payload (or requested reduction) is at fault.
    pub worker: usize,
    /// What was wrong.
    pub detail: String,
}

impl AggregateError {
    /// Refuses the reduction the workers asked for in `input` (blaming the first pusher):
    /// `server` says what this aggregator applies instead.
    pub fn unsupported(input: &ShardPushes<'_>, server: &str) -> Self {
        AggregateError {
            worker: input.pushes.first().map_or(0, |p| p.0),
            detail: format!("{server} cannot apply {:?}", input.aggregation),
        }
    }
}

/// Combines the pushes of one step for one shard into the bytes every worker pulls.
/// Must be deterministic (same inputs, same bytes). Closures
/// `FnMut(&ShardPushes) -> Result<Vec<u8>, AggregateError>` are aggregators too.
pub trait Aggregator: Send {
    /// Aggregates `input`.
    fn aggregate(&mut self, input: &ShardPushes<'_>) -> Result<Vec<u8>, AggregateError>;
}

impl<F> Aggregator for F
where
    F: FnMut(&ShardPushes<'_>) -> Result<Vec<u8>, AggregateError> + Send,
{
    fn aggregate(&mut self, input: &ShardPushes<'_>) -> Result<Vec<u8>, AggregateError> {
        self(input)
    }
}

/// The default aggregator: payloads are the shard's elements as little-endian f32;
/// [`Reduction::SUM`] adds them in worker order, [`Reduction::MEAN`] then divides by
/// the number of workers. Other reductions, and payloads of the wrong length, are
/// errors naming the worker.
#[derive(Debug, Clone, Copy, Default)]
pub struct DenseF32;

impl Aggregator for DenseF32 {
    fn aggregate(&mut self, input: &ShardPushes<'_>) -> Result<Vec<u8>, AggregateError> {
        let n = input.range.len();
        let mut acc = vec![0f32; n];
        for (i, &(worker, p)) in input.pushes.iter().enumerate() {
            if input.aggregation != Reduction::SUM && input.aggregation != Reduction::MEAN {
                return Err(AggregateError {
                    worker,
                    detail: format!("DenseF32 cannot apply {:?}", input.aggregation),
                });
            }
            if p.len() != 4 * n {
                return Err(AggregateError {
                    worker,
                    detail: format!(
                        "shard {} expects {} f32 ({} bytes), got {} bytes",
                        input.shard,
                        n,
                        4 * n,
                        p.len()
                    ),
                });
            }
            for (a, c) in acc.iter_mut().zip(p.chunks_exact(4)) {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                *a = if i == 0 { v } else { *a + v };
            }
        }
        if input.aggregation == Reduction::MEAN {
            let w = input.pushes.len() as f32;
            acc.iter_mut().for_each(|a| *a /= w);
        }
        Ok(acc.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// One worker's push as a server keeps it until its step is complete.
type Push = (Reduction, Vec<u8>);

/// The server of one shard, as an IO-free state machine (see the [module docs](crate::ps)).
pub struct ServerMachine<A: Aggregator> {
    layout: PsLayout,
    shard: usize,
    staleness: u64,
    aggregator: A,
    /// Per worker index: the next step it must push.
    next_push: Vec<u64>,
    /// Per worker index: the step count it left with.
    left: Vec<Option<u64>>,
    /// Step → per worker index: its push.
    pending: BTreeMap<u64, Vec<Option<Push>>>,
    /// Steps aggregated so far (the next step to complete).
    completed: u64,
    out: VecDeque<(usize, PsMsg)>,
}

impl<A: Aggregator> std::fmt::Debug for ServerMachine<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerMachine")
            .field("shard", &self.shard)
            .field("completed", &self.completed)
            .field("next_push", &self.next_push)
            .field("left", &self.left)
            .finish()
    }
}

impl<A: Aggregator> ServerMachine<A> {
    /// The server of `shard` with staleness bound `staleness`.
    ///
    /// # Panics
    /// If `shard >= layout.num_shards()`.
    pub fn new(layout: PsLayout, shard: usize, staleness: u64, aggregator: A) -> Self {
        assert!(shard < layout.num_shards(), "shard {shard} out of range");
        let w = layout.workers().len();
        ServerMachine {
            layout,
            shard,
            staleness,
            aggregator,
            next_push: vec![0; w],
            left: vec![None; w],
            pending: BTreeMap::new(),
            completed: 0,
            out: VecDeque::new(),
        }
    }

    /// Starts the clock at `step` instead of 0 (every worker's next push is `step`, as for
    /// a run resumed after `step` steps; see [`PsConfig::first_step`]).
    ///
    /// [`PsConfig::first_step`]: super::PsConfig::first_step
    pub fn starting_at(mut self, step: u64) -> Self {
        self.next_push.iter_mut().for_each(|n| *n = step);
        self.completed = step;
        self
    }

    /// Whether nothing was pushed, aggregated or left since the clock started at `first`.
    pub(super) fn is_fresh(&self, first: u64) -> bool {
        self.completed == first
            && self.pending.is_empty()
            && self.out.is_empty()
            && self.left.iter().all(Option::is_none)
            && self.next_push.iter().all(|&n| n == first)
    }

    /// The aggregator.
    pub fn aggregator(&self) -> &A {
        &self.aggregator
    }

    /// The aggregator, mutably (to restore its state before the first step).
    pub fn aggregator_mut(&mut self) -> &mut A {
        &mut self.aggregator
    }

    /// Steps aggregated so far (counting from the first step, 0 unless started later).
    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// Feeds one message from `from`.
    pub fn handle(&mut self, from: usize, msg: PsMsg) -> Result<(), AlgoError> {
        let Some(wi) = self.layout.worker_index(from) else {
            return Err(AlgoError::Protocol {
                peer: from,
                detail: "a rank that is not a worker sent to a server".into(),
            });
        };
        match msg {
            PsMsg::Push {
                shard,
                step,
                aggregation,
                payload,
            } => {
                if shard as usize != self.shard {
                    return Err(AlgoError::Protocol {
                        peer: from,
                        detail: format!("pushed shard {shard} to the server of {}", self.shard),
                    });
                }
                if self.left[wi].is_some() || step != self.next_push[wi] {
                    return Err(AlgoError::Protocol {
                        peer: from,
                        detail: format!(
                            "pushed step {step}, expected step {} (left: {:?})",
                            self.next_push[wi], self.left[wi]
                        ),
                    });
                }
                if step > saturating_bound(self.completed, self.staleness) {
                    return Err(AlgoError::Protocol {
                        peer: from,
                        detail: format!(
                            "pushed step {step} with only {} steps aggregated: beyond the \
                             staleness bound {}",
                            self.completed, self.staleness
                        ),
                    });
                }
                if let Some((li, steps)) = self.left_before(step) {
                    return Err(AlgoError::Mismatch {
                        peer: self.layout.workers()[li],
                        detail: format!(
                            "worker left after {steps} steps while rank {from} pushed step {step}"
                        ),
                    });
                }
                self.next_push[wi] += 1;
                let w = self.layout.workers().len();
                self.pending.entry(step).or_insert_with(|| vec![None; w])[wi] =
                    Some((aggregation, payload));
                self.try_complete()
            }
            PsMsg::Leave { steps } => {
                if self.left[wi].is_some() || steps != self.next_push[wi] {
                    return Err(AlgoError::Protocol {
                        peer: from,
                        detail: format!(
                            "left after {steps} steps but pushed {}",
                            self.next_push[wi]
                        ),
                    });
                }
                if let Some(&later) = self.pending.keys().next_back() {
                    if later >= steps {
                        return Err(AlgoError::Mismatch {
                            peer: from,
                            detail: format!(
                                "worker left after {steps} steps while others pushed step {later}"
                            ),
                        });
                    }
                }
                self.left[wi] = Some(steps);
                Ok(())
            }
            other => Err(AlgoError::Protocol {
                peer: from,
                detail: format!("unexpected message at a server: {other:?}"),
            }),
        }
    }

    /// A worker that left before pushing `step`, as (worker index, steps).
    fn left_before(&self, step: u64) -> Option<(usize, u64)> {
        self.left
            .iter()
            .enumerate()
            .find_map(|(i, l)| l.filter(|&s| s <= step).map(|s| (i, s)))
    }

    fn try_complete(&mut self) -> Result<(), AlgoError> {
        while let Some(slots) = self.pending.get(&self.completed) {
            if slots.iter().any(Option::is_none) {
                break;
            }
            let slots = self.pending.remove(&self.completed).expect("present");
            let workers = self.layout.workers();
            let first = slots[0].as_ref().expect("complete").0;
            let pushes: Vec<(usize, &[u8])> = slots
                .iter()
                .zip(workers)
                .map(|(s, &r)| (r, s.as_ref().expect("complete").1.as_slice()))
                .collect();
            for (s, &r) in slots.iter().zip(workers) {
                let a = s.as_ref().expect("complete").0;
                if a != first {
                    return Err(AlgoError::Mismatch {
                        peer: r,
                        detail: format!(
                            "step {}: pushed aggregation {a:?}, worker {} pushed {first:?}",
                            self.completed, workers[0]
                        ),
                    });
                }
            }
            let input = ShardPushes {
                shard: self.shard,
                range: self.layout.shard_range(self.shard),
                step: self.completed,
                aggregation: first,
                pushes: &pushes,
            };
            let agg = self
                .aggregator
                .aggregate(&input)
                .map_err(|e| AlgoError::Protocol {
                    peer: e.worker,
                    detail: format!("step {}: {}", self.completed, e.detail),
                })?;
            for &r in workers {
                self.out.push_back((
                    r,
                    PsMsg::Aggregate {
                        shard: self.shard as u32,
                        step: self.completed,
                        payload: agg.clone(),
                    },
                ));
            }
            self.completed += 1;
        }
        Ok(())
    }

    /// The next message to send, as `(to_rank, message)`.
    pub fn poll_transmit(&mut self) -> Option<(usize, PsMsg)> {
        self.out.pop_front()
    }

    /// Whether every worker has left and every aggregate was handed out.
    pub fn is_done(&self) -> bool {
        self.left.iter().all(Option::is_some) && self.out.is_empty()
    }

    /// Whether the server still needs messages from `rank` (a worker that has not left).
    pub fn expects_from(&self, rank: usize) -> bool {
        self.layout
            .worker_index(rank)
            .is_some_and(|i| self.left[i].is_none())
    }

    /// The workers holding up progress: those whose push of the oldest incomplete step is
    /// missing (or, if no step is pending, every worker that has not left).
    pub fn waiting_on(&self) -> Vec<usize> {
        let workers = self.layout.workers();
        match self.pending.get(&self.completed) {
            Some(slots) => slots
                .iter()
                .zip(workers)
                .filter(|(s, _)| s.is_none())
                .map(|(_, &r)| r)
                .collect(),
            None => workers
                .iter()
                .zip(&self.left)
                .filter(|(_, l)| l.is_none())
                .map(|(&r, _)| r)
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ps::wire::f32_payload;

    fn layout(w: usize, m: usize, len: usize) -> PsLayout {
        PsLayout::new(w + m, (0..w).collect(), (w..w + m).collect(), len).unwrap()
    }

    #[test]
    fn server_aggregates_in_worker_order_once_all_pushed() {
        let l = layout(2, 1, 2);
        let mut s = ServerMachine::new(l, 0, 0, DenseF32);
        let push = |v: &[f32]| PsMsg::Push {
            shard: 0,
            step: 0,
            aggregation: Reduction::MEAN,
            payload: f32_payload(v),
        };
        s.handle(1, push(&[1.0, 2.0])).unwrap();
        assert!(s.poll_transmit().is_none());
        assert_eq!(s.waiting_on(), vec![0]);
        s.handle(0, push(&[3.0, 6.0])).unwrap();
        let sent: Vec<_> = std::iter::from_fn(|| s.poll_transmit()).collect();
        assert_eq!(sent.len(), 2);
        assert_eq!(
            sent[0],
            (
                0,
                PsMsg::Aggregate {
                    shard: 0,
                    step: 0,
                    payload: f32_payload(&[2.0, 4.0])
                }
            )
        );
        assert_eq!(s.completed(), 1);
    }

    #[test]
    fn server_rejects_out_of_order_stale_and_mismatched_pushes() {
        let push = |step, agg: u8, n: usize| PsMsg::Push {
            shard: 0,
            step,
            aggregation: Reduction(agg),
            payload: vec![0; 4 * n],
        };
        // Out of order.
        let mut s = ServerMachine::new(layout(2, 1, 1), 0, 5, DenseF32);
        let e = s.handle(0, push(1, 0, 1)).unwrap_err();
        assert!(matches!(e, AlgoError::Protocol { peer: 0, .. }), "{e}");
        // Beyond the staleness bound 1: steps 0 and 1 fine, 2 not before step 0 completes.
        let mut s = ServerMachine::new(layout(2, 1, 1), 0, 1, DenseF32);
        s.handle(0, push(0, 0, 1)).unwrap();
        s.handle(0, push(1, 0, 1)).unwrap();
        let e = s.handle(0, push(2, 0, 1)).unwrap_err();
        assert!(matches!(e, AlgoError::Protocol { peer: 0, .. }), "{e}");
        // Different reductions for one step.
        let mut s = ServerMachine::new(layout(2, 1, 1), 0, 0, DenseF32);
        s.handle(0, push(0, 0, 1)).unwrap();
        let e = s.handle(1, push(0, 1, 1)).unwrap_err();
        assert!(matches!(e, AlgoError::Mismatch { peer: 1, .. }), "{e}");
        // Wrong payload length: the aggregator names the worker.
        let mut s = ServerMachine::new(layout(2, 1, 1), 0, 0, DenseF32);
        s.handle(0, push(0, 0, 1)).unwrap();
        let e = s.handle(1, push(0, 0, 2)).unwrap_err();
        assert!(matches!(e, AlgoError::Protocol { peer: 1, .. }), "{e}");
        // Not a worker.
        let e = s.handle(2, push(0, 0, 1)).unwrap_err();
        assert!(matches!(e, AlgoError::Protocol { peer: 2, .. }), "{e}");
        // Leaving early while another worker is ahead.
        let mut s = ServerMachine::new(layout(2, 1, 1), 0, 3, DenseF32);
        s.handle(0, push(0, 0, 1)).unwrap();
        let e = s.handle(1, PsMsg::Leave { steps: 0 }).unwrap_err();
        assert!(matches!(e, AlgoError::Mismatch { peer: 1, .. }), "{e}");
    }

    #[test]
    fn closures_are_aggregators() {
        let mut calls = 0;
        let mut last = |i: &ShardPushes<'_>| -> Result<Vec<u8>, AggregateError> {
            calls += 1;
            Ok(i.pushes.last().map(|p| p.1.to_vec()).unwrap_or_default())
        };
        let input = ShardPushes {
            shard: 0,
            range: 0..1,
            step: 0,
            aggregation: Reduction(42),
            pushes: &[(0, &[1u8][..]), (1, &[2u8][..])],
        };
        assert_eq!(last.aggregate(&input).unwrap(), vec![2]);
        assert_eq!(calls, 1);
    }
}
