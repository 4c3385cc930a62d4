//! The compressed optimizers (`train.optimizer = "onebit-adam"` / `"zeroone-adam"`) on
//! in-process ranks: they train, what they send, exact resume in each of their phases, the
//! checkpoints they refuse, and the configurations they refuse. (Their arithmetic against
//! DeepSpeed's step functions is tested in `framework/src/sync/tests.rs`.)

mod common;

use std::path::Path;

use common::*;
use dtrain_framework::config::RunConfig;
use dtrain_framework::data::TrainData;
use dtrain_framework::optim::CompressedOptimizer;
use dtrain_framework::trainer::{RunDir, StepRecord, Trainer};

/// Adam's settings for the base MLP (it has no momentum key).
const ADAM: [&str; 2] = ["train.momentum=0", "train.lr=0.002"];

fn with(extra: &[&'static str]) -> Vec<&'static str> {
    let mut v = ADAM.to_vec();
    v.extend_from_slice(extra);
    v
}

const ONEBIT: &str = "train.optimizer=\"onebit-adam\"";
const ZEROONE: &str = "train.optimizer=\"zeroone-adam\"";
/// A 0/1 Adam schedule that reaches every phase in 12 steps: variance refreshed at t = 1, 2,
/// 4; frozen after t = 4; synchronisations at t = 5, 6, 8, 12 (the local interval doubles
/// every 2 frozen steps, up to 4).
const ZEROONE_SCHEDULE: [&str; 5] = [
    ZEROONE,
    "train.var_freeze_step=4",
    "train.var_update_scaler=2",
    "train.local_step_scaler=2",
    "train.local_step_clipper=4",
];

/// The step records rank 0 wrote into `dir`.
fn steps_of(dir: &Path) -> Vec<StepRecord> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn mean_sent(steps: &[StepRecord]) -> f64 {
    steps.iter().map(|s| s.bytes_sent as f64).sum::<f64>() / steps.len() as f64
}

#[test]
fn two_workers_train_with_each_compressed_optimizer() {
    for opt in [
        with(&[ONEBIT, "train.freeze_step=16", "train.max_steps=64"]),
        with(&[
            ZEROONE,
            "train.var_freeze_step=16",
            "train.local_step_scaler=8",
            "train.max_steps=64",
        ]),
    ] {
        let runs = run_all(BASE, 2, &opt, None, false);
        assert_loss_falls(&runs[0].losses, &format!("{opt:?}"));
        // 64 is a synchronisation of this 0/1 Adam schedule too (interval 8 by then).
        assert_replicas_identical(&runs, &format!("{opt:?}"));
        assert_eq!(
            runs[0].summary.collective.as_deref(),
            Some("compressed-allreduce")
        );
        assert!(runs[0].summary.compressed_optimizer.is_some());
    }
}

/// After the freeze, 1-bit Adam's momentum costs about one bit per parameter where Adam's
/// gradient costs 32 (plus each tensor's scale and the framing: the base MLP has 2,778
/// parameters in six tensors, so the overhead is visible here; LeNet's ratio is in
/// `experiments/README.md`). Before the freeze both send the dense gradient.
#[test]
fn onebit_adam_sends_about_a_32nd_of_adams_bytes_after_the_freeze() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    run(
        2,
        &with(&["train.optimizer=\"adam\"", "train.max_steps=16"]),
        Some(a.path()),
        false,
    );
    run(
        2,
        &with(&[ONEBIT, "train.freeze_step=4", "train.max_steps=16"]),
        Some(b.path()),
        false,
    );
    let (adam, onebit) = (steps_of(a.path()), steps_of(b.path()));
    let warm = mean_sent(&onebit[..4]) / mean_sent(&adam[..4]);
    assert!(
        (warm - 1.0).abs() < 0.01,
        "warm-up sends {warm} of Adam's bytes"
    );
    let ratio = mean_sent(&onebit[4..]) / mean_sent(&adam[4..]);
    assert!(
        ratio < 1.0 / 20.0 && ratio > 1.0 / 40.0,
        "after the freeze 1-bit Adam sends {ratio} of Adam's bytes"
    );
}

#[test]
fn resume_is_exact_in_every_phase() {
    // 1-bit Adam: a checkpoint in the warm-up, and one after the freeze (worker and server
    // residuals, the frozen variance).
    for split in [2, 8] {
        resume_is_exact_at(BASE, 2, &with(&[ONEBIT, "train.freeze_step=4"]), split);
    }
    // 0/1 Adam: in the variance phase (between two refreshes), at a synchronisation of the
    // frozen phase, and between two of them (each rank's own parameters and momentum).
    for split in [3, 6, 10] {
        resume_is_exact_at(BASE, 2, &with(&ZEROONE_SCHEDULE), split);
    }
}

/// A checkpoint of one optimizer is refused by another, naming both; 0/1 Adam's checkpoint
/// between two synchronisations is refused by another worker count.
#[test]
fn checkpoints_of_a_compressed_optimizer_are_refused_where_they_do_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    run(
        2,
        &with(&[ONEBIT, "train.freeze_step=2", "train.max_steps=4"]),
        Some(dir.path()),
        false,
    );
    let e = resume_error(
        dir.path(),
        &with(&["train.optimizer=\"adam\"", "train.max_steps=8"]),
        2,
    );
    assert!(e.contains("onebit-adam"), "{e}");
    let e = resume_error(dir.path(), &with(&[ZEROONE, "train.max_steps=8"]), 2);
    assert!(
        e.contains("onebit-adam") && e.contains("zeroone-adam"),
        "{e}"
    );

    // 0/1 Adam stopped at t = 10, between its synchronisations at 8 and 12.
    let dir = tempfile::tempdir().unwrap();
    let mut sets = with(&ZEROONE_SCHEDULE);
    sets.push("train.max_steps=10");
    let runs = run_all(BASE, 2, &sets, Some(dir.path()), false);
    assert!(
        runs[0].params != runs[1].params,
        "replicas identical mid-interval"
    );
    let e = resume_error(dir.path(), &sets, 1);
    assert!(e.contains("between two synchronisations"), "{e}");
}

/// What `resume_from` says when `world` ranks of BASE + `sets` resume `dir`'s latest
/// checkpoint (rank 0's view).
fn resume_error(dir: &Path, sets: &[&str], world: usize) -> String {
    let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    sets.push(format!("cluster.workers={world}"));
    let cfg = RunConfig::parse(BASE, "b.toml", &sets).unwrap();
    let out = RunDir {
        root: dir.to_path_buf(),
    };
    let latest = out.latest().unwrap();
    let handles: Vec<_> = dtrain_comms::channel_mesh(world)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let (cfg, out, latest) = (cfg.clone(), out.clone(), latest.clone());
            std::thread::spawn(move || {
                let data = TrainData::open(&cfg, rank, world).unwrap();
                let plan = cfg.validate("b.toml", Some(data.train_examples())).unwrap();
                let comm = dtrain_comms::Communicator::new(t, dtrain_comms::CommConfig::default());
                let mut tr =
                    Trainer::new(plan, data, comm, &dtrain_models::cpu_device(), Some(out))
                        .unwrap();
                tr.resume_from(&latest)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    let results: Vec<Result<(), String>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    results[0].clone().expect_err("the resume was accepted")
}

#[test]
fn defaults_and_refusals_name_their_fields() {
    let plan = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let cfg = RunConfig::parse(BASE, "b.toml", &sets).unwrap();
        cfg.validate("b.toml", Some(512)).unwrap()
    };
    // Without [compress]: DeepSpeed's 1-bit scaled sign through the compressed all-reduce,
    // with worker and server residuals; the warm-up is 15 % of the steps (64 an epoch).
    let p = plan(&with(&[ONEBIT]));
    assert_eq!(p.method.name(), "ef-signsgd");
    assert_eq!(
        p.collective,
        dtrain_framework::exchange::GatherCollective::CompressedAllReduce
    );
    assert_eq!(p.server_error_feedback, Some(true));
    assert_eq!(
        p.compressed_optimizer,
        Some(CompressedOptimizer::OnebitAdam { freeze_step: 10 })
    );
    let p = plan(&with(&[ZEROONE, "train.warmup_epochs=0.5"]));
    assert_eq!(
        p.compressed_optimizer,
        Some(CompressedOptimizer::ZerooneAdam {
            var_freeze_step: 32,
            var_update_scaler: 16,
            local_step_scaler: 32678,
            local_step_clipper: 16
        })
    );
    // Another method that averages may compress the momentum.
    let p = plan(&with(&[
        ONEBIT,
        "compress.kind=\"qsgd\"",
        "compress.levels=7",
    ]));
    assert_eq!(p.method.name(), "qsgd");
    // train.clip_norm moves into the optimizer's synchronisation.
    assert_eq!(
        plan(&with(&[ONEBIT, "train.clip_norm=1.0"])).clip_norm,
        None
    );

    refused_at(&with(&["train.freeze_step=5"]), "train.freeze_step");
    refused_at(
        &with(&[ONEBIT, "train.var_freeze_step=5"]),
        "train.var_freeze_step",
    );
    refused_at(&with(&[ONEBIT, "train.freeze_step=0"]), "train.freeze_step");
    refused_at(
        &with(&[ZEROONE, "train.local_step_clipper=0"]),
        "train.local_step_clipper",
    );
    refused_at(&with(&[ONEBIT, "cluster.mode=\"ps\""]), "train.optimizer");
    refused_at(
        &with(&[ONEBIT, "compress.kind=\"signsgd\""]),
        "compress.kind",
    );
    refused_at(
        &with(&[ZEROONE, "sync.kind=\"local-sgd\"", "sync.period=4"]),
        "sync.kind",
    );
    refused_at(
        &with(&[
            ONEBIT,
            "compress={ kind = \"none\", collective = \"dlcp\" }",
        ]),
        "compress.collective",
    );
    refused_at(&with(&[ONEBIT, "compress.kind=\"dgc\""]), "train.optimizer");
    let sets: Vec<String> = [ONEBIT, "train.momentum=0.9"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let e = RunConfig::parse(BASE, "b.toml", &sets)
        .unwrap()
        .validate("b.toml", None)
        .unwrap_err();
    assert!(e.to_string().contains("onebit-adam has beta1"), "{e}");
}
