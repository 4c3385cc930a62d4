//! Parameter-server mode over the in-process transport (and TCP): push / pull equals the
//! reference sum for separate and co-located servers, the stale-synchronous bound holds
//! with random worker speeds, and dead or stalled workers and servers are named by rank.

mod common;

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use dtrain_comms::ps::{
    Aggregate, AggregateError, Aggregator, DenseF32, PsConfig, PsLayout, PsMsg, PsNode, Reduction,
    ServerMachine, ShardPushes,
};
use dtrain_comms::{channel_mesh, CommError, Transport};

/// Runs `f(node)` on every rank of `layout` (one thread each); results in rank order.
fn run_nodes<T, A, R, F>(
    transports: Vec<T>,
    layout: &PsLayout,
    cfg: &PsConfig,
    aggregator: impl Fn() -> A,
    f: F,
) -> Vec<R>
where
    T: Transport + 'static,
    A: dtrain_comms::ps::Aggregator + 'static,
    R: Send + 'static,
    F: Fn(&mut PsNode<T, A>) -> R + Send + Sync + 'static,
{
    let f = Arc::new(f);
    let hs: Vec<_> = transports
        .into_iter()
        .map(|t| {
            let node = PsNode::new(t, layout.clone(), cfg.clone(), aggregator());
            let f = f.clone();
            thread::spawn(move || f(&mut node.expect("node")))
        })
        .collect();
    hs.into_iter()
        .map(|h| h.join().expect("rank panicked"))
        .collect()
}

/// Worker `w`'s gradient of `step`.
fn grad(step: u64, w: usize, len: usize) -> Vec<f32> {
    Rng(step * 7919 + w as u64 * 104_729 + len as u64).f32s(len)
}

/// The aggregate every worker must get: sum in worker order (then mean, if asked), as
/// [`DenseF32`] computes it per element.
fn reference(step: u64, workers: usize, len: usize, agg: Reduction) -> Vec<f32> {
    let inputs: Vec<Vec<f32>> = (0..workers).map(|w| grad(step, w, len)).collect();
    let mut s = rank_order_sum(&inputs);
    if agg == Reduction::MEAN {
        s.iter_mut().for_each(|x| *x /= workers as f32);
    }
    s
}

fn agg_of(step: u64) -> Reduction {
    if step.is_multiple_of(2) {
        Reduction::SUM
    } else {
        Reduction::MEAN
    }
}

/// A layout with workers `0..w` and `m` servers: on their own ranks `w..w+m`, or
/// co-located on ranks `m-1, …, 0` (reversed, so shard order is not rank order).
fn layout(w: usize, m: usize, colocated: bool, len: usize) -> PsLayout {
    if colocated {
        PsLayout::new(w.max(m), (0..w).collect(), (0..m).rev().collect(), len).unwrap()
    } else {
        PsLayout::new(w + m, (0..w).collect(), (w..w + m).collect(), len).unwrap()
    }
}

/// Synchronous push/pull: every worker gets each step's aggregate, bit-equal to the
/// reference, exactly once and in order.
fn check_sync<T: Transport + 'static>(
    make: impl Fn(usize) -> Vec<T>,
    w: usize,
    m: usize,
    colocated: bool,
    len: usize,
) {
    let steps = 4u64;
    let l = layout(w, m, colocated, len);
    let out = run_nodes(
        make(l.world_size()),
        &l,
        &PsConfig::default(),
        || DenseF32,
        move |node| {
            let me = node.rank();
            let Some(wi) = node.layout().worker_index(me) else {
                node.serve().unwrap();
                return None;
            };
            let mut got = Vec::new();
            for step in 0..steps {
                got.extend(node.step_dense(&grad(step, wi, len), agg_of(step)).unwrap());
            }
            assert!(node.finish().unwrap().is_empty());
            Some(got)
        },
    );
    for (r, got) in out.into_iter().enumerate() {
        let Some(got) = got else { continue };
        assert_eq!(got.len(), steps as usize, "rank {r}");
        for (step, a) in got.iter().enumerate() {
            let step = step as u64;
            assert_eq!(a.step, step);
            assert_eq!(a.shards.len(), m);
            for (j, s) in a.shards.iter().enumerate() {
                assert_eq!(s.len(), 4 * l.shard_range(j).len());
            }
            assert_eq!(
                bits(&a.dense()),
                bits(&reference(step, w, len, agg_of(step))),
                "{w} workers, {m} servers, co-located {colocated}, rank {r}, step {step}"
            );
        }
    }
}

#[test]
fn push_pull_equals_reference_sum_separate_and_colocated() {
    for (w, m) in [(1, 1), (2, 1), (3, 2), (1, 3), (5, 2), (4, 4)] {
        for colocated in [false, true] {
            check_sync(channel_mesh, w, m, colocated, 1001);
        }
    }
    // Fewer elements than servers: some shards are empty.
    check_sync(channel_mesh, 3, 4, false, 2);
    check_sync(channel_mesh, 2, 2, true, 0);
}

#[cfg(feature = "tcp")]
#[test]
fn push_pull_over_tcp() {
    check_sync(common::tcp::mesh, 3, 2, true, 1001);
    check_sync(common::tcp::mesh, 2, 2, false, 777);
}

#[cfg(all(feature = "shm", target_os = "linux"))]
#[test]
fn push_pull_over_shm() {
    check_sync(common::shm::mesh, 3, 2, true, 1001);
    check_sync(common::shm::mesh, 2, 2, false, 777);
}

/// SSP: with per-worker random compute times, a worker starting step `t` never finds a
/// worker whose clock (steps finished) is below `t - s`; every aggregate is still exact.
/// Returns the largest lead observed.
fn check_ssp(
    w: usize,
    m: usize,
    s: u64,
    steps: u64,
    delay_us: impl Fn(usize, u64) -> u64 + Send + Sync + 'static,
) -> u64 {
    let len = 64;
    let l = layout(w, m, false, len);
    let cfg = PsConfig {
        staleness: s,
        timeout: Duration::from_secs(10),
        ..PsConfig::default()
    };
    let clocks = Arc::new(Mutex::new(vec![0u64; w]));
    let max_lead = Arc::new(AtomicU64::new(0));
    let (c2, ml) = (clocks.clone(), max_lead.clone());
    let out = run_nodes(
        channel_mesh(w + m),
        &l,
        &cfg,
        || DenseF32,
        move |node| {
            let Some(wi) = node.layout().worker_index(node.rank()) else {
                node.serve().unwrap();
                return Vec::new();
            };
            let mut got: Vec<Aggregate> = Vec::new();
            for t in 0..steps {
                {
                    let c = c2.lock().unwrap();
                    let slowest = *c.iter().min().unwrap();
                    let lead = t - slowest;
                    assert!(lead <= s, "worker {wi} starts step {t} while a worker finished only {slowest} (s = {s})");
                    ml.fetch_max(lead, SeqCst);
                }
                thread::sleep(Duration::from_micros(delay_us(wi, t)));
                c2.lock().unwrap()[wi] = t + 1;
                got.extend(node.step_dense(&grad(t, wi, len), Reduction::SUM).unwrap());
                // Sees every step up to t - s, nothing it has not pushed.
                let seen = got.len() as u64;
                assert!(
                    seen + s > t && seen <= t + 1,
                    "worker {wi} after step {t}: {seen} aggregates (s = {s})"
                );
            }
            got.extend(node.finish().unwrap());
            got
        },
    );
    for (r, got) in out.into_iter().enumerate().take(w) {
        assert_eq!(got.len() as u64, steps, "worker {r}");
        for (t, a) in got.iter().enumerate() {
            assert_eq!(a.step, t as u64);
            assert_eq!(
                bits(&a.dense()),
                bits(&reference(t as u64, w, len, Reduction::SUM))
            );
        }
    }
    max_lead.load(SeqCst)
}

#[test]
fn ssp_no_worker_runs_more_than_s_steps_ahead_random_speeds() {
    for (trial, s) in [0u64, 1, 2, 3].into_iter().enumerate() {
        let seed = trial as u64;
        let lead = check_ssp(4, 2, s, 16, move |w, t| {
            Rng(seed * 1000 + w as u64 * 100 + t).below(2000) as u64
        });
        assert!(lead <= s);
    }
    // Unbounded staleness (Project Adam): still exact aggregates, no bound asserted past 16.
    check_ssp(3, 1, u64::MAX, 8, |w, t| {
        Rng(w as u64 * 10 + t).below(1000) as u64
    });
}

#[test]
fn ssp_fast_workers_reach_but_never_exceed_the_bound() {
    // Worker 0 is slow, the others compute instantly: they run exactly s steps ahead.
    for s in [0u64, 1, 3] {
        let lead = check_ssp(3, 2, s, 12, |w, _| if w == 0 { 4000 } else { 0 });
        assert_eq!(lead, s, "s = {s}");
    }
}

/// Every rank but `victim` fails, within `limit` of `start`, with an error naming
/// `victim` (of the kind `want` accepts).
fn expect_named(
    out: Vec<Option<(CommError, Duration)>>,
    victim: usize,
    limit: Duration,
    want: fn(&CommError) -> bool,
) {
    for (r, e) in out.into_iter().enumerate() {
        if r == victim {
            continue;
        }
        let (e, took) = e.unwrap_or_else(|| panic!("rank {r} did not fail"));
        assert!(took < limit, "rank {r} failed after {took:?}");
        assert!(want(&e), "rank {r}: {e}");
        assert_eq!(e.failed_ranks(), vec![victim], "rank {r}: {e}");
    }
}

/// Workers run steps until they fail, servers serve; `victim` behaves as `victim_does`
/// instead. Returns each rank's error and when it came (from `start`).
fn run_failure(
    l: &PsLayout,
    cfg: PsConfig,
    victim: usize,
    start: Instant,
    victim_does: impl Fn(&mut PsNode<dtrain_comms::ChannelTransport, DenseF32>) + Send + Sync + 'static,
) -> Vec<Option<(CommError, Duration)>> {
    let len = l.len();
    run_nodes(
        channel_mesh(l.world_size()),
        l,
        &cfg,
        || DenseF32,
        move |node| {
            if node.rank() == victim {
                victim_does(node);
                return None;
            }
            let Some(wi) = node.layout().worker_index(node.rank()) else {
                let e = node.serve().unwrap_err();
                return Some((e, start.elapsed()));
            };
            for t in 0..1000 {
                if let Err(e) = node.step_dense(&grad(t, wi, len), Reduction::SUM) {
                    let took = start.elapsed();
                    // The node stays failed.
                    assert!(matches!(node.finish(), Err(CommError::Poisoned(_))));
                    return Some((e, took));
                }
            }
            panic!("worker {wi} never noticed the failure");
        },
    )
}

fn cfg5() -> PsConfig {
    PsConfig {
        timeout: Duration::from_secs(5),
        abort_grace: Duration::from_millis(500),
        staleness: 1,
        ..PsConfig::default()
    }
}

#[test]
fn dead_worker_is_named_by_every_rank() {
    // Co-located: ranks 0..3 are workers, servers on ranks 1 and 0; rank 2 is only a worker.
    for (colocated, victim) in [(false, 0), (true, 2)] {
        let l = layout(3, 2, colocated, 100);
        let start = Instant::now();
        let out = run_failure(&l, cfg5(), victim, start, move |node| {
            // One step, then the worker dies (its transport is dropped).
            node.step_dense(&grad(0, victim, 100), Reduction::SUM)
                .unwrap();
        });
        expect_named(out, victim, Duration::from_secs(3), |e| {
            matches!(e, CommError::PeerLost { .. })
        });
    }
}

#[test]
fn dead_server_is_named_by_every_rank() {
    let l = layout(2, 2, false, 100);
    let victim = 3;
    let out = run_failure(&l, cfg5(), victim, Instant::now(), |_| {});
    expect_named(out, victim, Duration::from_secs(3), |e| {
        matches!(e, CommError::PeerLost { .. })
    });
}

#[test]
fn stalled_worker_is_named_by_every_rank_within_the_timeout() {
    let l = layout(3, 2, false, 100);
    let victim = 2;
    let cfg = PsConfig {
        timeout: Duration::from_millis(300),
        abort_grace: Duration::from_millis(1000),
        staleness: 0,
        ..PsConfig::default()
    };
    let out = run_failure(&l, cfg, victim, Instant::now(), |_node| {
        // Connected but silent for longer than everyone's patience.
        thread::sleep(Duration::from_millis(2500));
    });
    // The servers time out after 300 ms and name the worker; the workers, whose own
    // patience is 1.3 s, learn it from them.
    expect_named(out, victim, Duration::from_millis(1200), |e| {
        matches!(e, CommError::Timeout { .. })
    });
}

#[test]
fn custom_aggregators_get_opaque_payloads_in_worker_order() {
    // "Concatenate" over arbitrary bytes of different lengths per worker.
    let l = layout(3, 2, true, 10);
    let concat = || {
        |i: &ShardPushes<'_>| -> Result<Vec<u8>, AggregateError> {
            assert_eq!(i.aggregation, Reduction(42));
            let mut v = vec![i.shard as u8];
            for (w, p) in i.pushes {
                v.push(*w as u8);
                v.extend_from_slice(p);
            }
            Ok(v)
        }
    };
    let out = run_nodes(channel_mesh(3), &l, &PsConfig::default(), concat, |node| {
        let me = node.rank() as u8;
        let got = node
            .step(vec![vec![me; me as usize], vec![100 + me]], Reduction(42))
            .unwrap();
        node.finish().unwrap();
        got
    });
    let want = Aggregate {
        step: 0,
        shards: vec![vec![0, 0, 1, 1, 2, 2, 2], vec![1, 0, 100, 1, 101, 2, 102]],
    };
    for got in out {
        assert_eq!(got, vec![want.clone()]);
    }
}

#[test]
fn a_payload_the_aggregator_rejects_is_blamed_on_its_worker_everywhere() {
    let l = layout(3, 1, false, 8);
    let out = run_nodes(
        channel_mesh(4),
        &l,
        &cfg5(),
        || DenseF32,
        |node| {
            let Some(wi) = node.layout().worker_index(node.rank()) else {
                return node.serve().unwrap_err();
            };
            // Worker 1 sends one element too few.
            let n = if wi == 1 { 7 } else { 8 };
            node.step(vec![vec![0; 4 * n]], Reduction::SUM)
                .and_then(|_| node.finish())
                .unwrap_err()
        },
    );
    for (r, e) in out.iter().enumerate() {
        if r == 1 {
            continue;
        }
        assert!(
            matches!(e, CommError::Protocol { rank: 1, .. }),
            "rank {r}: {e}"
        );
    }
}

#[test]
fn invalid_calls_are_refused_without_poisoning() {
    let l = layout(1, 1, true, 4);
    let t = channel_mesh(1).pop().unwrap();
    let mut node = PsNode::new(t, l, PsConfig::default(), DenseF32).unwrap();
    assert!(matches!(
        node.step_dense(&[1.0; 3], Reduction::SUM),
        Err(CommError::InvalidArgument(_))
    ));
    assert!(matches!(
        node.step(vec![], Reduction::SUM),
        Err(CommError::InvalidArgument(_))
    ));
    assert!(matches!(node.pull(0), Err(CommError::InvalidArgument(_))));
    let got = node
        .step_dense(&[1.0, 2.0, 3.0, 4.0], Reduction::SUM)
        .unwrap();
    assert_eq!(got[0].dense(), vec![1.0, 2.0, 3.0, 4.0]);
    assert!(node.try_pull().unwrap().is_empty());
    node.finish().unwrap();
    assert!(node.step_dense(&[0.0; 4], Reduction::SUM).is_err());
    // A layout whose world size differs from the transport's.
    let l2 = layout(2, 1, false, 4);
    let t = channel_mesh(1).pop().unwrap();
    assert!(PsNode::new(t, l2, PsConfig::default(), DenseF32).is_err());
}

/// A run resumed after `k` steps starts every clock at `k` (from the configuration, or with
/// `start_at` before the first call): aggregates carry the global step numbers, servers hand
/// their aggregator those steps, a push of an earlier step is a protocol error, and a node
/// that has pushed or served cannot restart its clock.
#[test]
fn clocks_start_at_the_first_step_of_a_resumed_run() {
    let (first, steps, len) = (5u64, 3u64, 100);
    for colocated in [false, true] {
        let l = layout(3, 2, colocated, len);
        // Separate servers: the clock starts from the configuration; co-located: restarted.
        let cfg = PsConfig {
            first_step: if colocated { 0 } else { first },
            ..PsConfig::default()
        };
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        let recording = move || {
            let s = s2.clone();
            move |i: &ShardPushes<'_>| -> Result<Vec<u8>, AggregateError> {
                s.lock().unwrap().push((i.shard, i.step));
                DenseF32.aggregate(i)
            }
        };
        let out = run_nodes(
            channel_mesh(l.world_size()),
            &l,
            &cfg,
            recording,
            move |node| {
                if colocated {
                    node.start_at(first).unwrap();
                }
                let Some(wi) = node.layout().worker_index(node.rank()) else {
                    node.serve().unwrap();
                    assert!(node.start_at(0).is_err());
                    return Vec::new();
                };
                assert_eq!(node.pushed(), first);
                let mut got = Vec::new();
                for t in first..first + steps {
                    got.extend(node.step_dense(&grad(t, wi, len), agg_of(t)).unwrap());
                }
                // Every pushed step is aggregated and taken, yet the clock has moved.
                assert!(node.start_at(0).is_err());
                assert!(node.finish().unwrap().is_empty());
                let e = node.start_at(0).unwrap_err();
                assert!(e.to_string().contains("already pushed or served"), "{e}");
                got
            },
        );
        for got in out.iter().take(3) {
            let got_steps: Vec<u64> = got.iter().map(|a| a.step).collect();
            assert_eq!(got_steps, (first..first + steps).collect::<Vec<_>>());
            for a in got {
                assert_eq!(
                    bits(&a.dense()),
                    bits(&reference(a.step, 3, len, agg_of(a.step)))
                );
            }
        }
        let mut seen = seen.lock().unwrap().clone();
        seen.sort();
        let want: Vec<(usize, u64)> = (0..2)
            .flat_map(|j| (first..first + steps).map(move |t| (j, t)))
            .collect();
        assert_eq!(seen, want, "co-located {colocated}");
    }
    // A server started at step 5 refuses a push of step 0.
    let l = layout(1, 1, false, 4);
    let mut server = ServerMachine::new(l, 0, 0, DenseF32).starting_at(first);
    let e = server
        .handle(
            0,
            PsMsg::Push {
                shard: 0,
                step: 0,
                aggregation: Reduction::SUM,
                payload: dtrain_comms::ps::f32_payload(&[0.0; 4]),
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("expected step 5"), "{e}");
}
