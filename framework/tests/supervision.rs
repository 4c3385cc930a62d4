//! Issue #24 on in-process ranks (channel transport): a stop request on one rank stops every
//! rank after the same step with a checkpoint that resumes exactly; `--resume` falls back
//! past damaged checkpoints; retention keeps the last intact one.

use std::path::Path;

use dtrain_comms::{channel_mesh, CommConfig, Communicator};
use dtrain_framework::config::RunConfig;
use dtrain_framework::data::TrainData;
use dtrain_framework::signals::{StopRequest, SIGTERM};
use dtrain_framework::trainer::{
    checkpoint_dir_name, verify_checkpoint, Observer, RunDir, StepRecord, TrainError, Trainer,
};

mod common;

/// The trainer tests' MLP ([`common::BASE`]) on two ranks with top-k 10 %: a compressor
/// with memory, so that checkpoints carry per-rank state. Later overrides win.
fn config(sets: &[String]) -> RunConfig {
    let mut all = vec![
        "cluster.workers=2".to_string(),
        "compress={ kind = \"topk\", ratio = 0.1 }".to_string(),
    ];
    all.extend_from_slice(sets);
    let mut cfg = RunConfig::parse(common::BASE, "base.toml", &all).unwrap();
    common::pin_collective(&mut cfg);
    cfg
}

/// What one rank ended with.
struct Ended {
    params: Vec<f32>,
    losses: Vec<f64>,
    result: Result<u64, TrainError>,
}

/// Raises `stop` once step `at` is done (on the rank that owns this observer).
struct StopAt {
    stop: StopRequest,
    at: Option<u64>,
    losses: Vec<f64>,
}

impl Observer for StopAt {
    fn on_step(&mut self, r: &StepRecord) {
        self.losses.push(r.loss.unwrap());
        if Some(r.step) == self.at {
            self.stop.request(SIGTERM);
        }
    }
}

/// Two in-process ranks of [`config`]`(sets)` writing into `out`; rank `stop.0` raises its own
/// stop request after step `stop.1` (the other rank gets none). `resume`: from LATEST first.
fn run(sets: &[&str], out: &Path, resume: bool, stop: Option<(usize, u64)>) -> Vec<Ended> {
    run_on(2, sets, out, resume, stop)
}

/// [`run`] on `world` ranks.
fn run_on(
    world: usize,
    sets: &[&str],
    out: &Path,
    resume: bool,
    stop: Option<(usize, u64)>,
) -> Vec<Ended> {
    let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    sets.push(format!("cluster.workers={world}"));
    let cfg = config(&sets);
    let handles: Vec<_> = channel_mesh(world)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let cfg = cfg.clone();
            let out = RunDir {
                root: out.to_path_buf(),
            };
            std::thread::spawn(move || {
                let data = TrainData::open(&cfg, rank, world).unwrap();
                let plan = cfg.validate("b.toml", Some(data.train_examples())).unwrap();
                let comm = Communicator::new(t, CommConfig::default());
                let mut tr = Trainer::new(
                    plan,
                    data,
                    comm,
                    &dtrain_models::cpu_device(),
                    Some(out.clone()),
                )
                .unwrap();
                if resume {
                    tr.resume_from(&out.latest().unwrap()).unwrap();
                }
                let request = StopRequest::manual();
                tr.stop_on(request.clone());
                let mut obs = StopAt {
                    stop: request,
                    at: stop.filter(|s| s.0 == rank).map(|s| s.1),
                    losses: Vec::new(),
                };
                let result = tr.run(&mut obs).map(|s| s.steps.unwrap());
                Ended {
                    params: tr.params(),
                    losses: obs.losses,
                    result,
                }
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_stop_on_one_rank_stops_all_after_the_same_step_and_the_checkpoint_resumes_exactly() {
    let straight_dir = tempfile::tempdir().unwrap();
    let full = run(&["train.max_steps=12"], straight_dir.path(), false, None);
    let dir = tempfile::tempdir().unwrap();
    // Rank 1 alone is asked to stop once step 4 is done: the request reaches rank 0 in the
    // next step's control all-reduce, both finish step 5 and stop with 6 steps done.
    let stopped = run(&["train.max_steps=12"], dir.path(), false, Some((1, 4)));
    for (rank, e) in stopped.iter().enumerate() {
        match &e.result {
            Err(TrainError::Stopped {
                step,
                signal,
                checkpoint,
            }) => {
                assert_eq!(*step, 6, "rank {rank}");
                assert_eq!(*signal, SIGTERM);
                let ck = checkpoint.as_ref().expect("a checkpoint");
                assert_eq!(
                    ck,
                    &dir.path().join("checkpoints").join(checkpoint_dir_name(6))
                );
            }
            other => panic!(
                "rank {rank}: {:?}",
                other.as_ref().map_err(|e| e.to_string())
            ),
        }
    }
    assert_eq!(bits(&stopped[0].params), bits(&stopped[1].params));
    let ck =
        verify_checkpoint(&dir.path().join("checkpoints").join(checkpoint_dir_name(6))).unwrap();
    assert_eq!((ck.step, ck.world), (6, 2));
    // No summary: the run did not finish.
    assert!(!dir.path().join("summary.json").exists());
    // Resumed, it ends exactly where the uninterrupted run does.
    let resumed = run(&["train.max_steps=12"], dir.path(), true, None);
    assert_eq!(resumed[0].result.as_ref().ok(), Some(&12));
    assert_eq!(bits(&resumed[0].params), bits(&full[0].params));
    let mut joined = stopped[0].losses.clone();
    joined.extend(&resumed[0].losses);
    assert_eq!(joined, full[0].losses);
    // metrics.jsonl holds each step once.
    let steps: Vec<u64> = std::fs::read_to_string(dir.path().join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<StepRecord>(l).unwrap().step)
        .collect();
    assert_eq!(steps, (0..12).collect::<Vec<_>>());
}

/// Flips one byte in the middle of `path`.
fn damage(path: &Path) {
    let mut b = std::fs::read(path).unwrap();
    let i = b.len() / 2;
    b[i] ^= 0x40;
    std::fs::write(path, b).unwrap();
}

#[test]
fn resume_falls_back_to_the_newest_checkpoint_intact_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    run(
        &[
            "train.max_steps=12",
            "checkpoint.every_steps=4",
            "checkpoint.keep=3",
        ],
        dir.path(),
        false,
        None,
    );
    let out = RunDir {
        root: dir.path().to_path_buf(),
    };
    let ck = |s: u64| dir.path().join("checkpoints").join(checkpoint_dir_name(s));
    let steps: Vec<u64> = out.checkpoint_dirs().iter().map(|d| d.0).collect();
    assert_eq!(steps, [12, 8, 4]);
    assert_eq!(out.newest_intact().0.unwrap().step, 12);

    // One byte of rank 1's newest file, and rank 0's file of the one before is missing.
    damage(&ck(12).join("rank-1.ckpt"));
    std::fs::remove_file(ck(8).join("rank-0.ckpt")).unwrap();
    let (best, skipped) = out.newest_intact();
    assert_eq!(best.unwrap().dir, ck(4));
    assert_eq!(skipped.len(), 2);
    assert_eq!(skipped[0].dir, ck(12));
    assert!(
        skipped[0].reason.contains("rank-1.ckpt") && skipped[0].reason.contains("checksum"),
        "{}",
        skipped[0].reason
    );
    assert!(
        skipped[1].reason.contains("rank-0.ckpt") && skipped[1].reason.contains("missing"),
        "{}",
        skipped[1].reason
    );
    // The launcher's choice: logs each skipped checkpoint, points LATEST at the one chosen.
    let mut lines = Vec::new();
    let chosen =
        dtrain_framework::launch::choose_checkpoint(&out, &mut |m| lines.push(m.to_string()))
            .unwrap();
    assert_eq!(chosen.step, 4);
    assert_eq!(out.latest().unwrap(), ck(4));
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(lines[2].contains("step-0000000004") && lines[2].contains("intact"));

    // The workers resume from it and go on; the retention rule then removes the damaged
    // checkpoints after it (an abandoned trajectory) and keeps the newest three.
    let resumed = run(
        &[
            "train.max_steps=16",
            "checkpoint.every_steps=4",
            "checkpoint.keep=3",
        ],
        dir.path(),
        true,
        None,
    );
    assert_eq!(resumed[0].result.as_ref().ok(), Some(&16));
    let steps: Vec<u64> = out.checkpoint_dirs().iter().map(|d| d.0).collect();
    assert_eq!(steps, [16, 12, 8]);
    for s in steps {
        verify_checkpoint(&ck(s)).unwrap();
    }

    // Nothing intact at all: the error names what is wrong with each.
    for s in [8, 12, 16] {
        damage(&ck(s).join("rank-0.ckpt"));
    }
    let e = dtrain_framework::launch::choose_checkpoint(&out, &mut |_| {}).unwrap_err();
    assert!(e.contains("no checkpoint is intact on every rank"), "{e}");
    assert_eq!(e.matches("checksum").count(), 3, "{e}");
}

#[test]
fn ranks_that_restored_different_steps_refuse_to_train() {
    let dir = tempfile::tempdir().unwrap();
    run(
        &[
            "train.max_steps=8",
            "checkpoint.every_steps=4",
            "checkpoint.keep=2",
        ],
        dir.path(),
        false,
        None,
    );
    let cfg = config(&[]);
    let handles: Vec<_> = channel_mesh(2)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let cfg = cfg.clone();
            let root = dir.path().to_path_buf();
            std::thread::spawn(move || {
                let data = TrainData::open(&cfg, rank, 2).unwrap();
                let plan = cfg.validate("b.toml", Some(data.train_examples())).unwrap();
                let comm = Communicator::new(t, CommConfig::default());
                let out = RunDir { root: root.clone() };
                let mut tr =
                    Trainer::new(plan, data, comm, &dtrain_models::cpu_device(), Some(out))
                        .unwrap();
                // Rank 0 resumes from step 8, rank 1 from step 4 (as a rank that read a
                // stale LATEST would).
                let step = if rank == 0 { 8 } else { 4 };
                tr.resume_from(&root.join("checkpoints").join(checkpoint_dir_name(step)))
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    for h in handles {
        let e = h.join().unwrap().unwrap_err();
        assert!(
            e.contains("restored different steps") && e.contains("rank 0: 8"),
            "{e}"
        );
    }
}

/// Issue #24, acceptance: a checkpoint written at P = 4 resumes at P = 2 (and the reverse)
/// for `none`, top-k with error feedback, DGC and QSGD through the compressed all-reduce
/// with worker and server residuals (issue #22), mid-epoch, by the rule of
/// `dtrain_framework::trainer::elastic`: it continues at the sample where the checkpoint
/// left the epoch, and trains on.
#[test]
fn a_checkpoint_resumes_on_another_worker_count_for_none_topk_dgc_and_compressed_allreduce() {
    let methods: [&[&str]; 5] = [
        &["compress={ kind = \"none\" }"],
        &["compress={ kind = \"topk\", ratio = 0.05 }"],
        &["compress={ kind = \"dgc\", ratio = 0.01, min_sparse_len = 64 }"],
        &[
            "compress={ kind = \"qsgd\", levels = 7, error_feedback = true, \
             collective = \"compressed-allreduce\" }",
        ],
        // 1-bit Adam past its freeze: replicated moments, worker and server residuals.
        &[
            "train.optimizer=\"onebit-adam\"",
            "train.freeze_step=2",
            "train.momentum=0",
            "train.lr=0.002",
        ],
    ];
    // 512 samples, batch 8, a checkpoint after 5 steps. From 4 workers (160 samples used)
    // to 2: 16 a step, so step 10 of 32. From 2 (80 used) to 4: 32 a step, 13 full steps
    // left of 16, so step 3, reading from sample 80.
    for (from, to, resumed_at, per_epoch) in [(4, 2, 10, 32), (2, 4, 3, 16)] {
        for sets in methods {
            let what = format!("{sets:?} from {from} to {to} workers");
            let dir = tempfile::tempdir().unwrap();
            let mut first = sets.to_vec();
            first.push("train.max_steps=5");
            let a = run_on(from, &first, dir.path(), false, None);
            assert_eq!(a[0].result.as_ref().ok(), Some(&5), "{what}");
            let ck = dtrain_framework::checkpoint::Checkpoint::load(
                &dir.path()
                    .join("checkpoints")
                    .join(checkpoint_dir_name(5))
                    .join("rank-0.ckpt"),
            )
            .unwrap();
            let servers = ck.names().filter(|n| n.starts_with("srv/")).count();
            let car = sets[0].contains("compressed-allreduce") || sets[0].contains("onebit");
            assert_eq!(
                servers > 0,
                car,
                "{what}: server residuals in the checkpoint"
            );
            let b = run_on(to, sets, dir.path(), true, None);
            let steps = b[0]
                .result
                .as_ref()
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(*steps, per_epoch, "{what}");
            assert_eq!(b[0].losses.len() as u64, per_epoch - resumed_at, "{what}");
            assert!(b[0].losses.iter().all(|l| l.is_finite()), "{what}");
            for r in &b[1..] {
                assert_eq!(bits(&r.params), bits(&b[0].params), "{what}: replicas");
            }
            let first_step: StepRecord = serde_json::from_str(
                std::fs::read_to_string(dir.path().join("metrics.jsonl"))
                    .unwrap()
                    .lines()
                    .nth(5)
                    .unwrap(),
            )
            .unwrap();
            assert_eq!(first_step.step, resumed_at, "{what}");
        }
    }
}
