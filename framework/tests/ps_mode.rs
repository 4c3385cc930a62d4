//! The trainer's parameter-server mode (`[cluster] mode = "ps"`) on in-process ranks:
//! synchronous PS gives the all-reduce trainer's parameters bit for bit, asynchronous PS
//! (bounded staleness) keeps every replica identical and trains, and the configuration is
//! checked.

use dtrain_comms::{channel_mesh, split_ps, CommConfig, Communicator};
use dtrain_framework::config::RunConfig;
use dtrain_framework::data::TrainData;
use dtrain_framework::trainer::{Observer, StepRecord, Summary, Trainer};

const BASE: &str = r#"
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
epochs = 2
[checkpoint]
every_epochs = 0
"#;

struct Run {
    params: Vec<f32>,
    summary: Summary,
    losses: Vec<f64>,
    skipped: usize,
}

struct Record(Vec<f64>, usize);
impl Observer for Record {
    fn on_step(&mut self, r: &StepRecord) {
        self.0.push(r.loss);
        self.1 += r.skipped as usize;
    }
}

/// Runs `world` ranks of BASE + `sets`; in PS mode every rank attaches the parameter-server
/// lane of its connections. Returns every rank's result.
fn run(world: usize, sets: &[&str]) -> Vec<Run> {
    let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    sets.push(format!("cluster.workers={world}"));
    let cfg = RunConfig::parse(BASE, "base.toml", &sets).unwrap();
    let ps = cfg.cluster.mode == dtrain_framework::config::ClusterMode::Ps;
    let handles: Vec<_> = channel_mesh(world)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let data = TrainData::open(&cfg, rank, world).unwrap();
                let plan = cfg
                    .validate("base.toml", Some(data.train_examples()))
                    .unwrap();
                let (coll, lane) = split_ps(t);
                let comm = Communicator::new(coll, CommConfig::default());
                let device = dtrain_models::cpu_device();
                let mut tr = Trainer::new(plan, data, comm, &device, None).unwrap();
                if ps {
                    tr.attach_parameter_server(lane).unwrap();
                }
                let mut obs = Record(Vec::new(), 0);
                let summary = tr.run(&mut obs).unwrap();
                Run {
                    params: tr.params(),
                    summary,
                    losses: obs.0,
                    skipped: obs.1,
                }
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn assert_replicas_identical(runs: &[Run], what: &str) {
    for (r, run) in runs.iter().enumerate().skip(1) {
        let diff = run
            .params
            .iter()
            .zip(&runs[0].params)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            diff, 0,
            "{what}: rank {r} differs from rank 0 in {diff} parameters"
        );
    }
}

#[test]
fn synchronous_ps_reproduces_the_all_reduce_trainer_exactly() {
    // Two workers: the all-reduce's a + b and the server's a + b in worker order, then the
    // same halving, are the same floats.
    let ar = run(2, &[]);
    let ps = run(2, &["cluster.mode=\"ps\""]);
    assert_replicas_identical(&ar, "all-reduce");
    assert_replicas_identical(&ps, "ps");
    assert_eq!(
        ar[0].params, ps[0].params,
        "PS and all-reduce trained differently"
    );
    assert_eq!(ar[0].losses, ps[0].losses);
    // One server holding the whole model gives the same result too.
    let one = run(2, &["cluster.mode=\"ps\"", "cluster.servers=1"]);
    assert_eq!(one[0].params, ps[0].params);
    // The bytes are reported: each worker pushes its shards and pulls the aggregates.
    assert!(ps[0].summary.bytes_sent_per_step > 0.0);
}

#[test]
fn asynchronous_ps_keeps_replicas_identical_and_trains() {
    let runs = run(3, &["cluster.mode=\"ps\"", "cluster.staleness=2"]);
    assert_replicas_identical(&runs, "staleness 2");
    for (r, run) in runs.iter().enumerate() {
        assert_eq!(run.skipped, 0, "rank {r}");
        let n = run.losses.len();
        let first: f64 = run.losses[..8].iter().sum::<f64>() / 8.0;
        let last: f64 = run.losses[n - 8..].iter().sum::<f64>() / 8.0;
        assert!(last < first, "rank {r}: loss {first} → {last}");
    }
    // Every worker applied every step's aggregate: the final evaluation is the same on all.
    let acc: Vec<_> = runs
        .iter()
        .map(|r| r.summary.final_eval.as_ref().unwrap().accuracy)
        .collect();
    assert!(acc.iter().all(|&a| a == acc[0]), "{acc:?}");
}

#[test]
fn ps_configuration_is_checked() {
    let check = |sets: &[&str], field: &str| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let cfg = RunConfig::parse(BASE, "base.toml", &sets).unwrap();
        let e = cfg.validate("base.toml", None).unwrap_err();
        assert_eq!(e.field, field, "{sets:?}: {e}");
    };
    check(&["cluster.staleness=2"], "cluster.staleness");
    check(&["cluster.servers=1"], "cluster.servers");
    check(
        &[
            "cluster.mode=\"ps\"",
            "cluster.workers=2",
            "cluster.servers=3",
        ],
        "cluster.servers",
    );
    check(
        &["cluster.mode=\"ps\"", "compress.kind=\"topk\""],
        "compress.kind",
    );
    check(
        &["cluster.mode=\"ps\"", "failure.non_finite=\"recover\""],
        "failure.non_finite",
    );
}

#[test]
fn mipd_over_the_parameter_server_keeps_replicas_identical_and_trains() {
    for sets in [
        vec![
            "compress.kind=\"mipd\"",
            "compress.significance=\"gradient\"",
        ],
        vec![
            "compress.kind=\"mipd\"",
            "compress.significance=\"gradient\"",
            "compress.error_feedback=true",
            "cluster.staleness=1",
        ],
        vec![
            "compress.kind=\"mipd\"",
            "compress.lambda=0.0",
            "compress.halves=\"off\"",
        ],
    ] {
        let mut all = vec!["cluster.mode=\"ps\"", "train.momentum=0.0", "train.lr=0.2"];
        all.extend(sets.iter().copied());
        let runs = run(3, &all);
        assert_replicas_identical(&runs, &format!("{sets:?}"));
        let r = &runs[0];
        let n = r.losses.len();
        let first: f64 = r.losses[..8].iter().sum::<f64>() / 8.0;
        let last: f64 = r.losses[n - 8..].iter().sum::<f64>() / 8.0;
        assert!(last < first, "{sets:?}: loss {first} → {last}");
        // Fewer bytes than dense PS: a worker pushes two thirds of a 4-byte-per-parameter
        // gradient and serves a third to two peers.
        let dense_bytes = 4.0 * r.summary.params as f64 * (2.0 / 3.0) * 2.0;
        assert!(
            r.summary.bytes_sent_per_step < 0.5 * dense_bytes,
            "{sets:?}: {} bytes/step vs dense ≈ {dense_bytes}",
            r.summary.bytes_sent_per_step
        );
    }
}
