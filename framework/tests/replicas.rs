//! The replicas stay identical (issue 53, scope 3): the workers compare a hash of their
//! parameters every `cluster.check_replicas_every` steps, write it into `metrics.jsonl`, and
//! stop naming the ranks and the step when the replicas differ.

mod common;

use common::*;
use dtrain_framework::config::RunConfig;
use dtrain_framework::data::TrainData;
use dtrain_framework::trainer::{Quiet, RunDir, Trainer};

/// `(step, param_hash)` of every line of rank 0's `metrics.jsonl` under `dir`.
fn hashes(dir: &std::path::Path) -> Vec<(u64, Option<String>)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap(),
                v["param_hash"].as_str().map(str::to_string),
            )
        })
        .collect()
}

/// The steps whose record carries the hash.
fn checked_steps(dir: &std::path::Path) -> Vec<u64> {
    hashes(dir)
        .into_iter()
        .filter_map(|(s, h)| h.map(|_| s))
        .collect()
}

#[test]
fn the_hash_is_checked_and_written_where_the_replicas_must_agree() {
    // Every step: every second step carries the hash.
    let dir = tempfile::tempdir().unwrap();
    run(
        3,
        &["train.max_steps=8", "cluster.check_replicas_every=2"],
        Some(dir.path()),
        false,
    );
    let h = hashes(dir.path());
    assert_eq!(h.len(), 8);
    for (step, hash) in &h {
        assert_eq!(hash.is_some(), step % 2 == 1, "step {step}: {hash:?}");
        if let Some(x) = hash {
            assert_eq!(x.len(), 16);
        }
    }
    // The parameters change, so does the hash.
    assert_ne!(h[1].1, h[3].1);
    // Local SGD with rounds of 4: only the rounds' ends are checked (the replicas differ
    // between them).
    let dir = tempfile::tempdir().unwrap();
    run(
        2,
        &[
            "train.max_steps=8",
            "cluster.check_replicas_every=2",
            "sync.kind=\"local-sgd\"",
            "sync.period=4",
        ],
        Some(dir.path()),
        false,
    );
    assert_eq!(checked_steps(dir.path()), vec![3, 7]);
    // DiLoCo with rounds of 4, checks every 3 steps: each check waits for the round's end
    // (steps 3, 7, 11: one per multiple of 3 passed).
    let dir = tempfile::tempdir().unwrap();
    run(
        2,
        &[
            "train.max_steps=12",
            "cluster.check_replicas_every=3",
            "sync.kind=\"diloco\"",
            "sync.period=4",
        ],
        Some(dir.path()),
        false,
    );
    assert_eq!(checked_steps(dir.path()), vec![3, 7, 11]);
    // Off.
    let dir = tempfile::tempdir().unwrap();
    run(
        2,
        &["train.max_steps=4", "cluster.check_replicas_every=0"],
        Some(dir.path()),
        false,
    );
    assert!(hashes(dir.path()).iter().all(|(_, h)| h.is_none()));
}

/// Rank 1 trains with another learning rate (as a rank with a bad state would): its
/// parameters part from the others' at the first step, and the first check stops every
/// rank with an error naming it, its hash and the step.
#[test]
fn replicas_that_differ_stop_the_run_naming_the_ranks() {
    let world = 3;
    let handles: Vec<_> = dtrain_comms::channel_mesh(world)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            std::thread::spawn(move || {
                let lr = if rank == 1 {
                    "train.lr=0.06"
                } else {
                    "train.lr=0.05"
                };
                let sets = [
                    "train.max_steps=8".to_string(),
                    "cluster.check_replicas_every=3".to_string(),
                    format!("cluster.workers={world}"),
                    lr.to_string(),
                ];
                let mut cfg = RunConfig::parse(BASE, "b.toml", &sets).unwrap();
                pin_collective(&mut cfg);
                let data = TrainData::open(&cfg, rank, world).unwrap();
                let plan = cfg.validate("b.toml", Some(data.train_examples())).unwrap();
                let comm = dtrain_comms::Communicator::new(t, Default::default());
                let mut tr = Trainer::new(
                    plan,
                    data,
                    comm,
                    &dtrain_models::cpu_device(),
                    None::<RunDir>,
                )
                .unwrap();
                tr.run(&mut Quiet).map(|_| ()).unwrap_err().to_string()
            })
        })
        .collect();
    for h in handles {
        let e = h.join().unwrap();
        assert!(
            e.contains("step 2")
                && e.contains("replicas' parameters differ")
                && e.contains("ranks 0, 2: ")
                && e.contains("rank 1: ")
                && e.contains("cluster.check_replicas_every = 3"),
            "{e}"
        );
    }
}
