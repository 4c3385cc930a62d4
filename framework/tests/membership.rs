//! Live membership (issue 53, scope 1): a worker lost mid-run is dropped, and the others
//! finish every step without a restart, as one group with identical replicas.

mod common;

use std::time::Duration;

use common::*;
use std::time::Instant;

use dtrain_comms::{channel_mesh, ByteCount, CommConfig, Communicator, Transport, TransportError};
use dtrain_framework::config::RunConfig;
use dtrain_framework::data::TrainData;
use dtrain_framework::trainer::{Observer, RunDir, StepRecord, Summary, Trainer};

/// On the victim, once it has recorded the step of its [`Death`]: dies (its thread panics,
/// dropping its connections), or stops for a while (a process stopped and continued).
struct DieAt {
    rank: usize,
    victim: usize,
    death: Death,
    messages: Vec<String>,
    /// The most a step spent keeping a copy of the state.
    keep_s: f64,
    /// The steps that kept one.
    copied: Vec<u64>,
}

impl Observer for DieAt {
    fn on_step(&mut self, r: &StepRecord) {
        self.keep_s = self.keep_s.max(r.time.keep_s);
        if r.time.keep_s > 0.0 {
            self.copied.push(r.step);
        }
        if self.rank != self.victim {
            return;
        }
        match self.death {
            Death::AfterStep(s) if r.step == s => {
                panic!("rank {} dies after step {}", self.rank, r.step)
            }
            Death::Stall(s, d) if r.step == s => std::thread::sleep(d),
            _ => {}
        }
    }
    fn on_message(&mut self, m: &str) {
        self.messages.push(m.to_string());
    }
}

struct Survivor {
    params: Vec<f32>,
    summary: Summary,
    messages: Vec<String>,
    steps: u64,
    keep_s: f64,
    copied: Vec<u64>,
}

/// A transport that dies (panics, dropping its connections) at its `left`-th send: a
/// worker killed in the middle of a collective, with part of its messages sent.
struct Fuse<T> {
    inner: T,
    left: Option<usize>,
}

impl<T: Transport> Transport for Fuse<T> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn send(&mut self, to: usize, msg: Vec<u8>) -> Result<(), TransportError> {
        if let Some(n) = &mut self.left {
            if *n == 0 {
                panic!("rank {} dies while sending", self.inner.rank());
            }
            *n -= 1;
        }
        self.inner.send(to, msg)
    }
    fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
        self.inner.recv(deadline)
    }
    fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError> {
        self.inner.recv_from(from, deadline)
    }
    fn bytes(&self) -> ByteCount {
        self.inner.bytes()
    }
}

/// How the victim dies.
#[derive(Clone, Copy)]
enum Death {
    /// Once it has recorded this step.
    AfterStep(u64),
    /// At its n-th message.
    AtSend(usize),
    /// Stops for this long once it has recorded the step, and goes on.
    Stall(u64, Duration),
}

/// `world` ranks of BASE + `sets` with live membership; rank `victim` dies as `death`
/// says. Each rank's result: what it ended with, or its run's error (`"panicked"` for a
/// rank that died).
fn run_cut(
    world: usize,
    sets: &[&str],
    victim: usize,
    death: Death,
    out: Option<&std::path::Path>,
) -> Vec<Result<Survivor, String>> {
    let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    sets.push(format!("cluster.workers={world}"));
    sets.push("cluster.membership=\"live\"".into());
    let mut cfg = RunConfig::parse(BASE, "base.toml", &sets).unwrap();
    pin_collective(&mut cfg);
    let handles: Vec<_> = channel_mesh(world)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let cfg = cfg.clone();
            let out = out.map(|p| RunDir {
                root: p.to_path_buf(),
            });
            std::thread::spawn(move || {
                let data = TrainData::open(&cfg, rank, world).unwrap();
                let plan = cfg
                    .validate("base.toml", Some(data.train_examples()))
                    .unwrap();
                let left = match death {
                    Death::AtSend(n) if rank == victim => Some(n),
                    _ => None,
                };
                let comm = Communicator::new(
                    Fuse { inner: t, left },
                    CommConfig {
                        timeout: Duration::from_secs(20),
                        ..CommConfig::default()
                    },
                );
                let device = dtrain_models::cpu_device();
                let mut tr = Trainer::new(plan, data, comm, &device, out).unwrap();
                let mut obs = DieAt {
                    rank,
                    victim,
                    death,
                    messages: Vec::new(),
                    keep_s: 0.0,
                    copied: Vec::new(),
                };
                let summary = tr.run(&mut obs).map_err(|e| e.to_string())?;
                Ok(Survivor {
                    params: tr.params(),
                    summary,
                    messages: obs.messages,
                    steps: tr.step(),
                    keep_s: obs.keep_s,
                    copied: obs.copied,
                })
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().unwrap_or_else(|_| Err("panicked".into())))
        .collect()
}

/// Every survivor finished every step with the same parameters, and recorded the one
/// change: `victim` removed, the group going on from step `from` (any, when `None`).
fn check(
    out: &[Result<Survivor, String>],
    victim: usize,
    steps: u64,
    from: impl Into<Option<u64>>,
) {
    check_group(out, victim, steps, from);
    let alive: Vec<&Survivor> = out.iter().flatten().collect();
    for s in &alive {
        assert_eq!(s.params, alive[0].params, "replicas identical");
    }
}

/// [`check`] where the replicas may differ at the end (between a periodic synchronisation's
/// rounds).
fn check_group(
    out: &[Result<Survivor, String>],
    victim: usize,
    steps: u64,
    from: impl Into<Option<u64>>,
) {
    let from = from.into();
    assert!(out[victim].is_err(), "the victim is gone");
    let alive: Vec<&Survivor> = out.iter().flatten().collect();
    assert_eq!(alive.len(), out.len() - 1);
    let members: Vec<usize> = (0..out.len()).filter(|&r| r != victim).collect();
    for s in &alive {
        assert_eq!(s.steps, steps);
        assert!(s.params.iter().all(|x| x.is_finite()));
        let changes = s
            .summary
            .membership
            .as_ref()
            .expect("the change is recorded");
        assert_eq!(changes.len(), 1, "{changes:?}");
        let c = &changes[0];
        assert_eq!(c.epoch, 1, "{c:?}");
        if let Some(from) = from {
            assert_eq!(c.step, from, "{c:?}");
        }
        assert_eq!(c.step, changes[0].step);
        assert!(c.steps_lost <= 1, "{c:?}");
        assert_eq!(c.removed, vec![victim]);
        assert_eq!(c.members, members);
        assert!(
            c.cause.contains(&format!("rank {victim}"))
                || c.cause.contains(&format!("rank(s): [{victim}]")),
            "{}",
            c.cause
        );
        assert!(
            s.messages.iter().any(|m| m.contains("membership epoch 1")),
            "{:?}",
            s.messages
        );
        assert_eq!(s.summary.workers, Some(out.len()));
    }
}

#[test]
fn the_survivors_of_a_lost_worker_finish_every_step() {
    // Dense gradients: rank 2 of 3 dies after step 4; the others fail in step 5's first
    // collective and run it again as two.
    let out = run_cut(3, &["train.max_steps=12"], 2, Death::AfterStep(4), None);
    check(&out, 2, 12, 5);
}

#[test]
fn a_lost_leader_is_replaced_and_its_logs_go_on() {
    // Rank 0 (which writes metrics.jsonl and summary.json) dies: rank 1 leads, and the
    // logs hold every step once.
    let dir = tempfile::tempdir().unwrap();
    let out = run_cut(
        3,
        &[
            "train.max_steps=10",
            "compress.kind=\"topk\"",
            "compress.ratio=0.1",
        ],
        0,
        Death::AfterStep(3),
        Some(dir.path()),
    );
    check(&out, 0, 10, 4);
    let text = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, (0..10).collect::<Vec<_>>());
    let summary: Summary =
        serde_json::from_slice(&std::fs::read(dir.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary.membership.unwrap()[0].removed, vec![0]);
}

#[test]
fn diloco_loses_a_worker_inside_a_round() {
    // The round of steps 4..8 is under way when rank 1 dies after step 5: the survivors
    // go on from step 6 with their own inner states and the round's anchor.
    let out = run_cut(
        3,
        &[
            "train.max_steps=12",
            "sync.kind=\"diloco\"",
            "sync.period=4",
            "cluster.check_replicas_every=4",
        ],
        1,
        Death::AfterStep(5),
        None,
    );
    // Between rounds the replicas differ: compare at the end (step 12 closes a round).
    check(&out, 1, 12, 6);
}

#[test]
fn live_membership_is_refused_where_the_group_cannot_shrink() {
    refused_at(
        &[
            "cluster.membership=\"live\"",
            "cluster.mode=\"ps\"",
            "cluster.workers=2",
        ],
        "cluster.membership",
    );
}

#[test]
fn a_worker_killed_inside_a_collective_is_dropped_alike_everywhere() {
    // The victim dies at its n-th message: inside the control all-reduce, inside the
    // gradient exchange, between them. Whether a survivor had finished that step or not,
    // the group agrees on one step to go on from, and the replicas stay identical.
    let mut from = Vec::new();
    for n in 12..=22 {
        let out = run_cut(
            3,
            &[
                "train.max_steps=10",
                "compress.kind=\"topk\"",
                "compress.ratio=0.1",
            ],
            1,
            Death::AtSend(n),
            None,
        );
        check(&out, 1, 10, None);
        let s = out[0]
            .as_ref()
            .unwrap()
            .summary
            .membership
            .as_ref()
            .unwrap()[0]
            .step;
        // Every survivor records the same step.
        assert_eq!(
            out[2]
                .as_ref()
                .unwrap()
                .summary
                .membership
                .as_ref()
                .unwrap()[0]
                .step,
            s
        );
        from.push(s);
    }
    // The cuts fell in different steps.
    from.dedup();
    assert!(from.len() >= 2, "{from:?}");
}

#[test]
fn a_stall_shorter_than_the_deadline_is_waited_for_and_a_longer_one_drops_the_worker() {
    // Steps of about a millisecond: the deadline is its floor, 1.5 s.
    let sets = [
        "train.max_steps=40",
        "train.epochs=4",
        "cluster.deadline_floor_s=1.5",
        "cluster.timeout_s=30",
    ];
    // Rank 1 stops for 0.5 s after step 10: everyone waits, nobody is dropped.
    let out = run_cut(
        3,
        &sets,
        1,
        Death::Stall(10, Duration::from_millis(500)),
        None,
    );
    for o in &out {
        let s = o.as_ref().unwrap();
        assert_eq!(s.steps, 40);
        assert!(s.summary.membership.is_none(), "{:?}", s.summary.membership);
        assert_eq!(s.params, out[0].as_ref().unwrap().params);
    }
    // For 4 s: the others drop it after the deadline and finish; when it goes on, it
    // learns that it was dropped and stops with that error rather than training alone.
    let t = Instant::now();
    let out = run_cut(3, &sets, 1, Death::Stall(10, Duration::from_secs(4)), None);
    check(&out, 1, 40, 11);
    let e = out[1].as_ref().err().unwrap();
    assert!(e.contains("dropped from the group"), "{e}");
    let c = &out[0]
        .as_ref()
        .unwrap()
        .summary
        .membership
        .as_ref()
        .unwrap()[0];
    assert_eq!(c.deadline_s, Some(1.5));
    assert!(c.cause.contains("timed out"), "{}", c.cause);
    // The time lost is about the deadline (plus the abort round), not the stall.
    assert!(c.lost_s >= 1.0 && c.lost_s < 3.5, "{c:?}");
    assert!(t.elapsed() >= Duration::from_secs(4));
}

#[test]
fn the_survivors_roll_forward_from_one_that_finished_the_step_with_no_copy_kept() {
    // The victim dies at each of its messages in turn: some cuts leave one survivor a step
    // behind the other (it takes the state of the step from it), some leave PowerSGD's Q
    // or the compressed all-reduce's state half updated (the survivors agree on one), and
    // some fall in the comparison of the replicas after a step's update. Every run ends
    // with identical replicas and every step done, and no step copied the state.
    let (mut ahead, mut took) = (0, 0);
    for sets in [
        &["compress.kind=\"powersgd\"", "compress.rank=2"][..],
        &[
            "compress.kind=\"topk\"",
            "compress.ratio=0.1",
            "compress.collective=\"compressed-allreduce\"",
        ],
        &["compress.kind=\"none\"", "cluster.check_replicas_every=1"],
    ] {
        for n in 10..=24 {
            let mut s = vec!["train.max_steps=12"];
            s.extend(sets.iter().copied());
            let out = run_cut(3, &s, 1, Death::AtSend(n), None);
            check(&out, 1, 12, None);
            for o in out.iter().flatten() {
                let c = &o.summary.membership.as_ref().unwrap()[0];
                // The step the failure came in, as the cause names it.
                let failed: u64 = c.cause["step ".len()..c.cause.find(':').unwrap()]
                    .parse()
                    .unwrap();
                ahead += usize::from(c.step > failed);
                took += o
                    .messages
                    .iter()
                    .filter(|m| m.contains("took the state of step"))
                    .count();
                assert_eq!(o.keep_s, 0.0, "{sets:?} n={n}: a copy was kept");
            }
        }
    }
    assert!(
        ahead > 0,
        "no cut left a survivor that had finished the step"
    );
    assert!(took > 0, "no survivor took the state from the others");
}

#[test]
fn diloco_keeps_copies_only_before_the_steps_that_end_a_round() {
    // Of 4 workers, the victim dies at each of its messages in turn, inside local steps and
    // inside the rounds' exchanges. A survivor a local step behind runs it alone; one cut inside a
    // round's exchange goes back with the others to the copy kept before that step. Every
    // run ends with every step done and identical replicas (step 24 ends a round), and only
    // the round-ending steps (3, 7, …, 23, and one run again) kept a copy.
    let (mut alone, mut back) = (0, 0);
    for n in 8..=40 {
        let out = run_cut(
            4,
            &[
                "train.max_steps=24",
                "train.epochs=2",
                "sync.kind=\"diloco\"",
                "sync.period=4",
                "cluster.check_replicas_every=4",
            ],
            1,
            Death::AtSend(n),
            None,
        );
        check(&out, 1, 24, None);
        for o in out.iter().flatten() {
            back += o
                .messages
                .iter()
                .filter(|m| m.contains("goes back"))
                .count();
            alone += o.messages.iter().filter(|m| m.contains("alone")).count();
            assert!(
                o.copied.len() <= 7,
                "n={n}: steps {:?} kept a copy",
                o.copied
            );
        }
    }
    assert!(alone > 0, "no survivor caught up alone");
    assert!(back > 0, "no cut fell inside a round's exchange");
}

/// What the survivors of a series of cuts did: for each survivor, the step the failure
/// came in and how it went on — took the state from others (rolled forward), ran a step
/// alone, went back to a copy, or none of those (rolled forward from a state it shared).
#[derive(Default, Debug)]
struct Ways(Vec<(u64, &'static str)>);

impl Ways {
    fn add(&mut self, o: &Survivor) {
        let c = &o.summary.membership.as_ref().unwrap()[0];
        // The step the failure came in, as the cause names it.
        let failed = c.cause["step ".len()..c.cause.find(':').unwrap()]
            .parse()
            .unwrap();
        let said = |what: &str| o.messages.iter().any(|m| m.contains(what));
        let way = if said("took the state of step") {
            "took"
        } else if said("up to its round exchange") {
            "rerun-joined"
        } else if said("ran the round exchange of step") {
            "rerun"
        } else if said("alone to catch up") {
            "alone"
        } else if said("goes back") {
            "back"
        } else {
            "own"
        };
        self.0.push((failed, way));
    }

    /// Whether a survivor went on `way` after a failure in a step `in_steps` holds.
    fn any(&self, way: &str, in_steps: impl Fn(u64) -> bool) -> bool {
        self.0.iter().any(|&(s, w)| w == way && in_steps(s))
    }
}

#[test]
fn post_local_sgd_rolls_forward_before_switch_step_and_copies_only_at_round_ends() {
    // Of 4 workers: every-step averaging of top-k gradients until step 6, then local SGD
    // with rounds ending after steps 8, 11, 14 and 17. The victim dies at each of its
    // messages in turn: a failure before the switch rolls forward (no copy), one in a local
    // step lets a laggard run it alone, one inside a round's exchange goes back to the copy
    // kept before that step. No step before the switch keeps a copy.
    let ways = cut_at_every_message(
        &[
            "train.max_steps=18",
            "train.epochs=2",
            "compress.kind=\"topk\"",
            "compress.ratio=0.1",
            "sync.kind=\"post-local-sgd\"",
            "sync.switch_step=6",
            "sync.period=3",
            "cluster.check_replicas_every=3",
        ],
        18,
        true,
        |s| [8, 11, 14, 17].contains(&s),
    );
    // Before the switch nobody went back (nothing was copied to go back to).
    assert!(!ways.any("back", |s| s < 6), "{ways:?}");
    assert!(
        ways.any("took", |s| s < 6),
        "{ways:?}: nobody took the state"
    );
    assert!(ways.any("own", |s| s < 6), "{ways:?}");
    assert!(
        ways.any("alone", |s| s >= 6),
        "{ways:?}: nobody caught up alone"
    );
    assert!(
        ways.any("back", |s| s >= 6),
        "{ways:?}: no cut inside an exchange"
    );
}

#[test]
fn streaming_diloco_copies_only_before_its_fragments_exchanges() {
    // Streaming DiLoCo over 4 workers, two fragments of a 4-step period, exchanges blocking
    // their step: fragment 0 is exchanged after steps 1, 5, 9, 13 and fragment 1 after steps
    // 3, 7, 11, 15. The victim dies at each of its messages in turn: a laggard runs a step
    // without an exchange alone; a cut exchange goes back to the copy kept before its step.
    // Only the exchanges' steps keep a copy; the fragments merge at staggered steps, so the
    // replicas differ at the end.
    let ways = cut_at_every_message(
        &[
            "train.max_steps=16",
            "train.epochs=2",
            "sync.kind=\"streaming-diloco\"",
            "sync.period=4",
            "sync.fragments=2",
            "sync.in_flight=false",
        ],
        16,
        false,
        |s| s % 2 == 1,
    );
    assert!(
        ways.any("alone", |s| s % 2 == 0),
        "{ways:?}: nobody caught up alone"
    );
    assert!(
        ways.any("back", |s| s % 2 == 1),
        "{ways:?}: no cut inside an exchange"
    );
}

#[test]
fn zeroone_adam_keeps_no_copy_of_the_state() {
    // 0/1 Adam over 4 workers: variance phase (steps 0..4, every step a dense or 1-bit
    // exchange) then the frozen phase, synchronising after steps 4, 5, 7 and 11 as the
    // local interval doubles (1, 2, 4). The victim dies at each of its messages in turn:
    // the survivors roll forward in the variance phase, a laggard runs a local step alone,
    // and a cut synchronisation runs its exchange again over the survivors from where each
    // replica's update left it. Step 7's interval is 2 when it begins and 4 after it: a
    // survivor a step ahead would call it a local step, and only the laggard's own word
    // keeps the group from running a synchronisation alone. No step keeps a copy.
    // With PowerSGD (several buckets) for its compressed exchanges, a cut synchronisation
    // leaves Q updated on some survivors and not on others: they agree on one before it
    // runs again (`handover::agree_exchangers`, whose own test checks what each ends with).
    for compress in [
        &["compress.kind=\"onebit\""][..],
        &[
            "compress.kind=\"powersgd\"",
            "compress.rank=2",
            "compress.collective=\"allgather\"",
            "compress.bucket_mb=0.002",
        ],
    ] {
        let mut sets = vec![
            "train.momentum=0",
            "train.lr=0.002",
            "train.optimizer=\"zeroone-adam\"",
            "train.var_freeze_step=4",
            "train.var_update_scaler=2",
            "train.local_step_scaler=2",
            "train.local_step_clipper=4",
            "train.max_steps=12",
        ];
        sets.extend_from_slice(compress);
        // Step 11 synchronises: the replicas are identical at the end.
        let ways = cut_at_every_message(&sets, 12, true, |_| false);
        assert!(!ways.any("back", |_| true), "{ways:?}");
        assert!(ways.any("own", |s| s < 4), "{ways:?}");
        assert!(
            ways.any("alone", |s| s >= 4),
            "{ways:?}: nobody caught up alone"
        );
        assert!(
            ways.any("rerun", |s| s >= 4),
            "{ways:?}: no synchronisation ran again"
        );
    }
}

/// Runs BASE + `sets` over 4 workers, worker 1 dying at each of its messages in turn
/// until its n-th message comes after the others' last collective; checks every run
/// (every step of `steps` done, the change recorded, identical replicas at the end where
/// `identical`), and that only steps `may_copy` allows kept a copy of the state. Returns
/// what the survivors did.
fn cut_at_every_message(
    sets: &[&str],
    steps: u64,
    identical: bool,
    may_copy: impl Fn(u64) -> bool,
) -> Ways {
    let mut ways = Ways::default();
    for n in 6.. {
        let out = run_cut(4, sets, 1, Death::AtSend(n), None);
        if out.iter().flatten().any(|s| s.summary.membership.is_none()) {
            break;
        }
        if identical {
            check(&out, 1, steps, None);
        } else {
            check_group(&out, 1, steps, None);
        }
        for o in out.iter().flatten() {
            ways.add(o);
            assert!(
                o.copied.iter().all(|&s| may_copy(s)),
                "{sets:?} n={n}: steps {:?} kept a copy",
                o.copied
            );
        }
    }
    ways
}
