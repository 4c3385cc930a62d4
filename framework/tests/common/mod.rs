//! Helpers of the trainer's end-to-end tests: in-process ranks over channels.
#![allow(dead_code)]

use std::path::Path;

use dtrain_comms::{channel_mesh, split_ps, split_tagged, CommConfig, Communicator};
use dtrain_framework::config::{RunConfig, SyncConfig};
use dtrain_framework::data::TrainData;
use dtrain_framework::trainer::{RunDir, Summary, Trainer};

/// The base configuration: a small MLP on synthetic 8×8 images, 512 samples.
pub const BASE: &str = r#"
name = "t"
seed = 5
[model]
kind = "mlp"
in_channels = 1
image_size = 8
hidden = [32, 16]
[data]
kind = "synthetic"
shape = [1, 8, 8]
train_len = 512
test_len = 64
batch_size = 8
[train]
lr = 0.05
momentum = 0.9
[checkpoint]
every_epochs = 0
"#;

/// Pins `compress.collective` to `"allgather"` where the configuration leaves it to the
/// default `"auto"`. These tests compare independent runs bit for bit (a straight run with a
/// stopped and resumed one, one worker count with another, …), and `auto` chooses each
/// bucket's collective from timings measured at start-up, which may differ from run to run;
/// so they run the all-gather they were written for unless a test names a collective. The
/// tests of `auto` itself set it.
pub fn pin_collective(cfg: &mut RunConfig) {
    // A compressed optimizer's default is the compressed all-reduce, not `auto`.
    if !cfg.compress.contains_key("collective") && !cfg.train.optimizer.is_compressed() {
        cfg.compress
            .insert("collective".into(), toml::Value::String("allgather".into()));
    }
}

pub struct Run {
    /// The rank's final parameters.
    pub params: Vec<f32>,
    /// Its summary.
    pub summary: Summary,
    /// Its step losses.
    pub losses: Vec<f64>,
    /// Steps this rank recorded as skipped.
    pub skipped: usize,
    /// The messages this rank's run gave its observer (notes, the automatic choice, …).
    pub messages: Vec<String>,
}

/// Runs `world` in-process ranks of BASE + `sets`; returns rank 0's result. With `out`, rank
/// files go there; with `resume`, every rank restores the latest checkpoint first.
pub fn run(world: usize, sets: &[&str], out: Option<&Path>, resume: bool) -> Run {
    run_on(BASE, world, sets, out, resume)
}

/// [`run`] on another base configuration.
pub fn run_on(base: &str, world: usize, sets: &[&str], out: Option<&Path>, resume: bool) -> Run {
    run_all(base, world, sets, out, resume).swap_remove(0)
}

/// Every rank's result of [`run_on`] (checked to have identical replicas). Each rank's
/// connections are split into a collectives lane and a parameter-server lane; with
/// `cluster.mode = "ps"` the trainer attaches the latter.
pub fn run_all(
    base: &str,
    world: usize,
    sets: &[&str],
    out: Option<&Path>,
    resume: bool,
) -> Vec<Run> {
    run_all_slow(base, world, sets, out, resume, None)
}

/// [`run_all`], where rank `slow.0` (if any) sleeps `slow.1` after every step, between
/// the steps' collectives: a straggler.
pub fn run_all_slow(
    base: &str,
    world: usize,
    sets: &[&str],
    out: Option<&Path>,
    resume: bool,
    slow: Option<(usize, std::time::Duration)>,
) -> Vec<Run> {
    let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    sets.push(format!("cluster.workers={world}"));
    let mut cfg = RunConfig::parse(base, "base.toml", &sets).unwrap();
    if !sets.iter().any(|s| s.contains("\"auto\"")) {
        pin_collective(&mut cfg);
    }
    let ps = cfg.cluster.mode == dtrain_framework::config::ClusterMode::Ps;
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
                // As `dtrain worker` does: a second lane for the parameter server or for
                // exchanges in flight.
                let second = cfg.sync.wants_second_lane();
                let (coll, lane) = if second { split_tagged(t) } else { split_ps(t) };
                let comm = Communicator::new(coll, CommConfig::default());
                // As `dtrain worker` does: the device `cluster.device` names.
                let device =
                    dtrain_framework::device::worker_device(cfg.cluster.device, rank).unwrap();
                let mut tr = Trainer::new(plan, data, comm, &device, out.clone()).unwrap();
                if ps {
                    tr.attach_parameter_server(lane).unwrap();
                } else if second {
                    tr.attach_background(lane).unwrap();
                }
                if resume {
                    let dir = out.as_ref().unwrap().latest().expect("a checkpoint");
                    tr.resume_from(&dir).unwrap();
                }
                struct Record(Vec<f64>, usize, Option<std::time::Duration>, Vec<String>);
                impl dtrain_framework::trainer::Observer for Record {
                    fn on_step(&mut self, r: &dtrain_framework::trainer::StepRecord) {
                        self.0.push(r.loss.unwrap_or(f64::NAN));
                        self.1 += r.skipped as usize;
                        if let Some(d) = self.2 {
                            std::thread::sleep(d);
                        }
                    }
                    fn on_message(&mut self, msg: &str) {
                        self.3.push(msg.to_string());
                    }
                }
                let nap = slow.filter(|s| s.0 == rank).map(|s| s.1);
                let mut obs = Record(Vec::new(), 0, nap, Vec::new());
                let summary = tr.run(&mut obs).unwrap();
                Run {
                    params: tr.params(),
                    summary,
                    losses: obs.0,
                    skipped: obs.1,
                    messages: obs.3,
                }
            })
        })
        .collect();
    let runs: Vec<Run> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    // Identical replicas, unless a periodic [sync] stopped between two synchronisations.
    // (0/1 Adam schedules its own local steps: its tests check the replicas themselves.)
    let steps = runs[0].summary.steps.unwrap_or(0);
    let zeroone = cfg.train.optimizer == dtrain_framework::optim::OptimizerKind::ZerooneAdam;
    let synchronised = !zeroone
        && match cfg.sync {
            SyncConfig::PostLocalSgd {
                period,
                switch_step,
            } => steps <= switch_step || (steps - switch_step).is_multiple_of(period),
            // Fragments merge at staggered steps, keeping a share of each replica.
            SyncConfig::StreamingDiloco { .. } => false,
            ref other => other.period().is_none_or(|h| steps.is_multiple_of(h)),
        };
    if synchronised {
        for (r, run) in runs.iter().enumerate().skip(1) {
            same(&run.params, &runs[0].params, &format!("replica {r}"));
        }
    }
    runs
}

/// Bit-identical, or a short message naming the first difference.
pub fn same(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let diffs = a
        .iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    if let Some(i) = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
    {
        panic!(
            "{what}: {diffs} of {} differ, first at {i}: {} vs {}",
            a.len(),
            a[i],
            b[i]
        );
    }
}

/// One in-process rank of BASE + `sets` (with its checkpoints under `out`, if given).
pub fn single(sets: &[&str], out: Option<&Path>) -> Trainer<dtrain_comms::ChannelTransport> {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let mut cfg = RunConfig::parse(BASE, "b.toml", &sets).unwrap();
    pin_collective(&mut cfg);
    let data = TrainData::open(&cfg, 0, 1).unwrap();
    let plan = cfg.validate("b.toml", Some(data.train_examples())).unwrap();
    let comm = Communicator::new(channel_mesh(1).pop().unwrap(), CommConfig::default());
    let out = out.map(|p| RunDir {
        root: p.to_path_buf(),
    });
    Trainer::new(plan, data, comm, &dtrain_models::cpu_device(), out).unwrap()
}

pub fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

pub fn resume_is_exact(world: usize, sets: &[&str]) {
    resume_is_exact_on(BASE, world, sets)
}

pub fn resume_is_exact_on(base: &str, world: usize, sets: &[&str]) {
    resume_is_exact_at(base, world, sets, 6)
}

/// 12 steps straight vs `split` steps, a checkpoint, and a resumed run to step 12.
pub fn resume_is_exact_at(base: &str, world: usize, sets: &[&str], split: u64) {
    let dir = tempfile::tempdir().unwrap();
    let mut straight: Vec<&str> = sets.to_vec();
    straight.push("train.max_steps=12");
    let full = run_on(base, world, &straight, None, false);

    let mut first: Vec<&str> = sets.to_vec();
    let stop = format!("train.max_steps={split}");
    first.push(&stop);
    let a = run_on(base, world, &first, Some(dir.path()), false);
    assert_eq!(a.summary.steps, Some(split));
    let b = run_on(base, world, &straight, Some(dir.path()), true);
    assert_eq!(b.summary.resumed_from, Some(split));
    assert_eq!(b.summary.steps, Some(12));
    let mut joined = a.losses.clone();
    joined.extend(&b.losses);
    eprintln!("{sets:?}\n joined {joined:?}\n full   {:?}", full.losses);
    same(
        &b.params,
        &full.params,
        &format!("{sets:?}: parameters after resume"),
    );
    let mut joined = a.losses.clone();
    joined.extend(&b.losses);
    eprintln!("{sets:?}\n joined {joined:?}\n full   {:?}", full.losses);
    assert_eq!(joined, full.losses, "{sets:?}: metrics differ after resume");
}

/// The mean loss of the last 8 steps is below that of the first 8.
pub fn assert_loss_falls(losses: &[f64], what: &str) {
    let n = losses.len();
    let first: f64 = losses[..8].iter().sum::<f64>() / 8.0;
    let last: f64 = losses[n - 8..].iter().sum::<f64>() / 8.0;
    assert!(last < first, "{what}: loss {first} → {last}");
}

/// BASE + `sets` parses but fails validation with an error naming `field`.
pub fn refused_at(sets: &[&str], field: &str) {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let cfg = RunConfig::parse(BASE, "base.toml", &sets).unwrap();
    let e = cfg.validate("base.toml", None).unwrap_err();
    assert_eq!(e.field, field, "{sets:?}: {e}");
}

/// Every replica equals rank 0's, bit for bit ([`run_all`] checks it too; the PS tests say
/// it where it is their point).
pub fn assert_replicas_identical(runs: &[Run], what: &str) {
    for (r, run) in runs.iter().enumerate().skip(1) {
        same(&run.params, &runs[0].params, &format!("{what}: rank {r}"));
    }
}
