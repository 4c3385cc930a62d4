//! Live membership (issue 53, scope 2): a newcomer takes a lost worker's place mid-run,
//! receives the members' state, and trains with them as one group of identical replicas.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::*;

use dtrain_comms::{channel_mesh, ChannelTransport, CommConfig, Communicator};
use dtrain_framework::config::RunConfig;
use dtrain_framework::data::TrainData;
use dtrain_framework::trainer::{Observer, StepRecord, Summary, Trainer};

/// The victim dies after step `die_after`; every worker slows its steps a little so that
/// the run is still going when the newcomer arrives.
struct Slow {
    rank: usize,
    victim: Option<usize>,
    die_after: u64,
    steps: Vec<u64>,
    messages: Vec<String>,
}

impl Observer for Slow {
    fn on_step(&mut self, r: &StepRecord) {
        self.steps.push(r.step);
        if Some(self.rank) == self.victim && r.step == self.die_after {
            panic!("rank {} dies after step {}", self.rank, r.step);
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    fn on_message(&mut self, m: &str) {
        self.messages.push(m.to_string());
    }
}

struct Ended {
    params: Vec<f32>,
    summary: Summary,
    steps: Vec<u64>,
    messages: Vec<String>,
}

fn comm_cfg() -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(20),
        ..CommConfig::default()
    }
}

/// 3 workers of BASE + `sets` under live membership; worker 1 dies after step 4, and once
/// it is gone a newcomer takes its rank. Returns the two members' results and the
/// newcomer's.
fn run_with_newcomer(sets: &[&str]) -> (Vec<Ended>, Ended) {
    let world = 3;
    let victim = 1;
    let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    sets.push(format!("cluster.workers={world}"));
    sets.push("cluster.membership=\"live\"".into());
    sets.push("cluster.check_replicas_every=1".into());
    let mut cfg = RunConfig::parse(BASE, "base.toml", &sets).unwrap();
    pin_collective(&mut cfg);
    let mesh = channel_mesh(world);
    let slots = mesh[0].slots();
    let (gone_tx, gone) = mpsc::channel();
    let start = |rank: usize, cfg: RunConfig, t: ChannelTransport, join: bool| {
        std::thread::spawn(move || -> Result<Ended, String> {
            let data = TrainData::open(&cfg, rank, world).unwrap();
            let plan = cfg
                .validate("base.toml", Some(data.train_examples()))
                .unwrap();
            let device = dtrain_models::cpu_device();
            let comm = Communicator::new(t, comm_cfg());
            let mut tr = if join {
                Trainer::join(plan, data, comm, &device, None, Duration::from_secs(30))
                    .map_err(|e| e.to_string())?
            } else {
                Trainer::new(plan, data, comm, &device, None).unwrap()
            };
            let mut obs = Slow {
                rank,
                victim: Some(victim),
                die_after: 4,
                steps: Vec::new(),
                messages: Vec::new(),
            };
            let summary = tr.run(&mut obs).map_err(|e| e.to_string())?;
            Ok(Ended {
                params: tr.params(),
                summary,
                steps: obs.steps,
                messages: obs.messages,
            })
        })
    };
    let handles: Vec<_> = mesh
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let h = start(rank, cfg.clone(), t, false);
            if rank == victim {
                // Told once the victim's thread is gone (its transport dropped).
                let gone_tx = gone_tx.clone();
                std::thread::spawn(move || {
                    let _ = h.join();
                    gone_tx.send(()).unwrap();
                });
                return None;
            }
            Some(h)
        })
        .collect();
    gone.recv_timeout(Duration::from_secs(60)).unwrap();
    let newcomer = start(victim, cfg.clone(), slots.join(victim), true)
        .join()
        .unwrap()
        .unwrap();
    let members = handles
        .into_iter()
        .flatten()
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    (members, newcomer)
}

/// The run completes every step on the members; the newcomer enters after the loss, runs
/// every later step, and ends with the members' parameters, bit for bit (the replicas'
/// hashes were compared after every step); the members record the loss and the entry.
fn check(sets: &[&str], steps: u64) {
    let (members, newcomer) = run_with_newcomer(sets);
    for m in &members {
        assert_eq!(m.steps.last(), Some(&(steps - 1)));
        assert_eq!(m.params, members[0].params, "members' replicas identical");
        let changes = m.summary.membership.as_ref().expect("changes recorded");
        assert_eq!(changes.len(), 2, "{changes:?}");
        assert_eq!((changes[0].epoch, &changes[0].removed), (1, &vec![1]));
        let c = &changes[1];
        assert_eq!(
            (c.epoch, &c.added, &c.members),
            (2, &vec![1], &vec![0, 2, 1])
        );
        assert_eq!(c.steps_lost, 0);
        assert!(
            m.messages.iter().any(|s| s.contains("joined before step")),
            "{:?}",
            m.messages
        );
    }
    let entered = newcomer.steps[0];
    assert!(
        entered > 5 && entered < steps - 1,
        "entered at step {entered}"
    );
    assert_eq!(newcomer.steps, (entered..steps).collect::<Vec<_>>());
    assert_eq!(
        newcomer.params, members[0].params,
        "the newcomer's replica is identical"
    );
    assert!(
        newcomer
            .messages
            .iter()
            .any(|s| s.contains("joined the group as worker 1")),
        "{:?}",
        newcomer.messages
    );
    assert_eq!(
        members[0].summary.membership.as_ref().unwrap()[1].step,
        entered
    );
    // The newcomer holds the group's history too (it would write it, were it to lead).
    let history = newcomer
        .summary
        .membership
        .as_ref()
        .expect("history handed over");
    assert_eq!(history.len(), 2, "{history:?}");
    assert_eq!(
        (&history[0].removed, &history[1].added),
        (&vec![1], &vec![1])
    );
    assert_eq!(history[1].step, entered);
    // Its own entry counts from its own start: the wait to be admitted, not 0.
    assert!(history[1].after_s > 0.0, "{:?}", history[1]);
}

#[test]
fn a_newcomer_replaces_a_lost_worker_with_dense_gradients() {
    check(&["train.max_steps=60", "train.epochs=4"], 60);
}

#[test]
fn a_newcomer_replaces_a_lost_worker_under_topk_with_error_feedback() {
    check(
        &[
            "train.max_steps=60",
            "train.epochs=4",
            "compress.kind=\"topk\"",
            "compress.ratio=0.1",
            "compress.memory={kind=\"residual\"}",
        ],
        60,
    );
}

#[test]
fn a_newcomer_replaces_a_lost_worker_under_powersgd() {
    check(
        &[
            "train.max_steps=60",
            "train.epochs=4",
            "compress.kind=\"powersgd\"",
        ],
        60,
    );
}

#[test]
fn a_newcomer_replaces_a_lost_worker_under_dgc() {
    check(
        &[
            "train.max_steps=60",
            "train.epochs=4",
            "compress.kind=\"dgc\"",
            "compress.ratio=0.1",
            "compress.memory={kind=\"dgc-momentum\"}",
        ],
        60,
    );
}

#[test]
fn a_newcomer_replaces_a_lost_worker_under_diloco_at_a_rounds_end() {
    check(
        &[
            "train.max_steps=64",
            "train.epochs=4",
            "sync.kind=\"diloco\"",
            "sync.period=8",
            "cluster.check_replicas_every=8",
        ],
        64,
    );
}
