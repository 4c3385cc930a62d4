//! `[sync]`: local SGD, post-local SGD, DiLoCo and Streaming DiLoCo on in-process ranks — what they compute,
//! what they send, exact resume, and the configurations they refuse.

mod common;

use common::*;
use dtrain_framework::config::RunConfig;
use dtrain_framework::data::TrainData;
use dtrain_framework::trainer::Quiet;

/// Plain SGD (no momentum): averaging the parameters after one local step each is
/// `θ − lr·mean(gᵢ)`, the every-step update, up to the order of the float operations.
#[test]
fn local_sgd_with_period_one_is_every_step_sgd() {
    let sgd = ["train.momentum=0", "train.max_steps=12"];
    let every = run(2, &sgd, None, false);
    let mut local = sgd.to_vec();
    local.extend(["sync.kind=\"local-sgd\"", "sync.period=1"]);
    let local = run(2, &local, None, false);
    let d = max_rel_diff(&every.params, &local.params);
    assert!(d < 1e-5, "max relative difference {d}");
    assert!(d > 0.0, "suspiciously identical: was the local path taken?");
    for (a, b) in every.losses.iter().zip(&local.losses) {
        assert!((a - b).abs() < 1e-4 * a.abs().max(1.0), "{a} vs {b}");
    }
}

/// With one worker the average is the worker itself, so one DiLoCo round of H inner steps
/// from θ₀ to θ₁ ends at `θ₀ − η·(1 + μ)·(θ₀ − θ₁)` (Nesterov's first step: v = Δ, update
/// Δ + μ·v), where θ₁ is what H every-step steps reach.
#[test]
fn one_diloco_round_is_a_nesterov_outer_step_on_the_change() {
    let h = 6;
    let steps = format!("train.max_steps={h}");
    let plain = single(&[steps.as_str()], None);
    let theta0 = plain.params();
    let mut plain = plain;
    plain.run(&mut Quiet).unwrap();
    let theta1 = plain.params();
    let (lr, mu) = (0.7f32, 0.9f32);
    let mut outer = single(
        &[
            steps.as_str(),
            "sync.kind=\"diloco\"",
            "sync.period=6",
            "sync.outer_lr=0.7",
            "sync.outer_momentum=0.9",
        ],
        None,
    );
    outer.run(&mut Quiet).unwrap();
    let got = outer.params();
    let want: Vec<f32> = theta0
        .iter()
        .zip(&theta1)
        .map(|(&a, &b)| a - lr * (1.0 + mu) * (a - b))
        .collect();
    let d = max_rel_diff(&want, &got);
    assert!(d < 1e-5, "max relative difference {d}");
    // And it is not the inner model itself.
    assert!(max_rel_diff(&theta1, &got) > 1e-3);
}

/// SparseLoCo with one worker, every value kept exactly (k = chunk, 32 bits) and no outer
/// momentum: the decayed accumulator sends the whole change and keeps nothing, so one round
/// with outer lr 1 lands on the inner model θ₁ (up to the rounding of θ₀ − (θ₀ − θ₁)), and
/// outer lr η on θ₀ − η·(θ₀ − θ₁).
#[test]
fn one_sparseloco_round_with_every_value_kept_is_the_plain_outer_step() {
    let h = 6;
    let steps = format!("train.max_steps={h}");
    let mut plain = single(&[steps.as_str()], None);
    let theta0 = plain.params();
    plain.run(&mut Quiet).unwrap();
    let theta1 = plain.params();
    for eta in [1.0f32, 0.5] {
        let outer_lr = format!("sync.outer_lr={eta}");
        let mut sparse = single(
            &[
                steps.as_str(),
                "sync.kind=\"diloco\"",
                "sync.period=6",
                outer_lr.as_str(),
                "sync.outer_momentum=0",
                "compress.kind=\"sparseloco\"",
                "compress.chunk=64",
                "compress.k=64",
                "compress.bits=32",
            ],
            None,
        );
        sparse.run(&mut Quiet).unwrap();
        let want: Vec<f32> = theta0
            .iter()
            .zip(&theta1)
            .map(|(&a, &b)| a - eta * (a - b))
            .collect();
        let d = max_rel_diff(&want, &sparse.params());
        assert!(d < 1e-6, "outer lr {eta}: max relative difference {d}");
    }
}

/// SparseLoCo's defaults (64 of every 4 096 values, 2 bits, 12-bit indices): a round sends
/// more than 30× fewer bytes than DiLoCo's dense f32 change.
#[test]
fn sparseloco_sends_over_thirty_times_fewer_bytes_a_round_than_diloco() {
    let diloco = ["train.max_steps=8", "sync.kind=\"diloco\"", "sync.period=4"];
    let dense = run(2, &diloco, None, false);
    let mut sparse = diloco.to_vec();
    sparse.extend(["sync.outer_momentum=0", "compress.kind=\"sparseloco\""]);
    let sparse = run(2, &sparse, None, false);
    let per_step = |r: &Run| r.summary.bytes_sent_per_step.unwrap();
    let ratio = per_step(&dense) / per_step(&sparse);
    assert!(ratio > 30.0, "{ratio}");
    // Two rounds of 4 steps: every round's bytes go in its last step, so the busiest step
    // carries 4 steps' mean (the payloads' size does not depend on their values).
    for r in [&dense, &sparse] {
        let peak = r.summary.bytes_sent_peak.unwrap() as f64;
        assert!(
            (peak / per_step(r) - 4.0).abs() < 0.01,
            "peak {peak}, mean {}",
            per_step(r)
        );
    }
    assert!(sparse.losses.iter().all(|l| l.is_finite()));
}

/// Bytes: local SGD with H = 8 exchanges once per 8 optimizer steps, with the same bytes
/// per exchange as an every-step run's (both all-reduce the whole model).
#[test]
fn local_sgd_sends_an_hth_of_every_steps_bytes() {
    let n = ["train.max_steps=32"];
    let every = run(2, &n, None, false);
    let local = run(
        2,
        &[
            "train.max_steps=32",
            "sync.kind=\"local-sgd\"",
            "sync.period=8",
        ],
        None,
        false,
    );
    let per_step = |r: &Run| r.summary.bytes_sent_per_step.unwrap();
    let ratio = per_step(&local) / per_step(&every);
    assert!((ratio - 1.0 / 8.0).abs() < 1e-9, "ratio {ratio}");
    assert_loss_falls(&local.losses, "local SGD");
    // DiLoCo with a compressor: the change goes through top-k with error feedback.
    let dl = run(
        2,
        &[
            "train.max_steps=32",
            "sync.kind=\"diloco\"",
            "sync.period=4",
            "compress.kind=\"topk\"",
            "compress.ratio=0.1",
        ],
        None,
        false,
    );
    assert!(per_step(&dl) < per_step(&every) / 4.0 * 0.5);
    assert_loss_falls(&dl.losses, "DiLoCo + top-k");
}

/// Post-local SGD is every-step SGD until `switch_step`: the same losses bit for bit, then
/// its own.
#[test]
fn post_local_sgd_is_every_step_before_its_switch() {
    let every = run(2, &["train.max_steps=16"], None, false);
    let post = run(
        2,
        &[
            "train.max_steps=16",
            "sync.kind=\"post-local-sgd\"",
            "sync.switch_step=8",
            "sync.period=4",
        ],
        None,
        false,
    );
    assert_eq!(every.losses[..9], post.losses[..9]);
    assert_ne!(every.losses[9..], post.losses[9..]);
}

/// DiLoCo with `switch_step` is every-step training until the switch (the paper's start
/// from an every-step model), DiLoCo after it; and a resume inside its every-step phase and
/// inside its rounds is exact.
#[test]
fn diloco_is_every_step_before_its_switch() {
    let sets = [
        "train.max_steps=16",
        "sync.kind=\"diloco\"",
        "sync.switch_step=8",
        "sync.period=4",
    ];
    let every = run(2, &["train.max_steps=16"], None, false);
    let diloco = run(2, &sets, None, false);
    assert_eq!(every.losses[..9], diloco.losses[..9]);
    assert_ne!(every.losses[9..], diloco.losses[9..]);
    resume_is_exact_at(BASE, 2, &sets[1..], 3);
    resume_is_exact_at(BASE, 2, &sets[1..], 10);
}

/// Resume is exact, from a checkpoint between two synchronisations (step 6 of rounds of
/// 4), for every kind, with stateful optimizers and a compressor with error feedback.
#[test]
fn resume_is_exact_between_synchronisations() {
    resume_is_exact(2, &["sync.kind=\"local-sgd\"", "sync.period=4"]);
    resume_is_exact(
        2,
        &[
            "sync.kind=\"diloco\"",
            "sync.period=4",
            "train.optimizer=\"adamw\"",
            "train.momentum=0",
            "train.lr=0.003",
            "compress.kind=\"topk\"",
            "compress.ratio=0.1",
        ],
    );
    // SparseLoCo: the decayed error-feedback accumulator is per rank and resumes with it.
    resume_is_exact(
        2,
        &[
            "sync.kind=\"diloco\"",
            "sync.period=4",
            "sync.outer_lr=1.0",
            "sync.outer_momentum=0",
            "train.optimizer=\"adamw\"",
            "train.momentum=0",
            "train.lr=0.003",
            "compress.kind=\"sparseloco\"",
            "compress.chunk=256",
            "compress.k=8",
        ],
    );
    // Before the switch (step 3 of an every-step phase up to 4) and after it.
    let post = [
        "sync.kind=\"post-local-sgd\"",
        "sync.switch_step=4",
        "sync.period=3",
        "compress.kind=\"qsgd\"",
        "compress.error_feedback=true",
    ];
    resume_is_exact(2, &post);
    resume_is_exact_at(BASE, 2, &post, 3);
    // Streaming DiLoCo: fragment 0 of 2 exchanges after step 6 (rounds of 4 staggered by
    // 2) and merges one step later, so the checkpoint holds a merge in flight; each
    // fragment's top-k memory resumes with it.
    resume_is_exact(
        2,
        &[
            "sync.kind=\"streaming-diloco\"",
            "sync.period=4",
            "sync.fragments=2",
            "sync.overlap=1",
            "compress.kind=\"topk\"",
            "compress.ratio=0.1",
        ],
    );
}

/// Streaming DiLoCo with one fragment, no overlap and no mixing is DiLoCo, bit for bit.
#[test]
fn streaming_diloco_with_one_fragment_is_diloco() {
    let diloco = [
        "train.max_steps=12",
        "sync.kind=\"diloco\"",
        "sync.period=4",
    ];
    let plain = run(2, &diloco, None, false);
    let mut one = diloco.to_vec();
    one[1] = "sync.kind=\"streaming-diloco\"";
    one.extend([
        "sync.fragments=1",
        "sync.overlap=0",
        "sync.mixing=0",
        "sync.stripes=1",
    ]);
    let streaming = run(2, &one, None, false);
    same(&plain.params, &streaming.params, "parameters");
    assert_eq!(plain.losses, streaming.losses);
    // The defaults (4 fragments, overlap 1, mixing 0.5) train another model, and train.
    let mut four = diloco.to_vec();
    four[1] = "sync.kind=\"streaming-diloco\"";
    let four = run(2, &four, None, false);
    assert_ne!(plain.losses[4..], four.losses[4..]);
    assert_loss_falls(&four.losses, "streaming DiLoCo");
}

/// A fragment's exchange left in flight across the overlap's steps (on its own thread, over
/// the second lane of the connections, beside every step's control all-reduce) trains the
/// same model as the blocking exchange, bit for bit, and records the same traffic (each of
/// its messages carries one byte more: the lane's tag).
#[test]
fn streaming_diloco_in_flight_trains_the_blocking_model() {
    let sets = [
        "train.max_steps=20",
        "sync.kind=\"streaming-diloco\"",
        "sync.period=6",
        "sync.fragments=3",
        "sync.overlap=2",
        "compress.kind=\"topk\"",
        "compress.ratio=0.1",
        "compress.error_feedback=true",
    ];
    let blocking = run(
        3,
        &[&sets[..], &["sync.in_flight=false"]].concat(),
        None,
        false,
    );
    let in_flight = run(3, &sets, None, false);
    same(&blocking.params, &in_flight.params, "parameters");
    assert_eq!(blocking.losses, in_flight.losses);
    let bytes = |r: &Run| r.summary.bytes_sent_per_step.unwrap();
    let ratio = bytes(&in_flight) / bytes(&blocking);
    // Above 1: the tag bytes show the exchanges went over the second lane.
    assert!(
        ratio > 1.0 && ratio < 1.01,
        "bytes in flight / blocking: {ratio}"
    );
    let peak = |r: &Run| r.summary.bytes_sent_peak.unwrap() as f64;
    assert!(peak(&in_flight) >= peak(&blocking), "peak bytes");
    // The time the exchanges ran on their thread is recorded; the blocking ones have none.
    let in_flight_s = |r: &Run| r.summary.mean_step.unwrap().in_flight_s;
    assert!(in_flight_s(&in_flight) > 0.0);
    assert_eq!(in_flight_s(&blocking), 0.0);
}

/// The eager settings of `sync.period = 4` with `fragments` fragments.
fn eager(fragments: &'static str) -> Vec<&'static str> {
    vec![
        "sync.kind=\"streaming-diloco\"",
        "sync.period=4",
        fragments,
        "sync.stripes=1",
        "sync.overlap=4",
        "sync.mixing=0",
        "sync.eager=true",
    ]
}

/// With one worker the eager outer step is the worker's own change, taken at the round's
/// end (the average arriving a round later equals the change it corrects): DiLoCo, bit for
/// bit, with one fragment, and each fragment's DiLoCo round (no overlap, no mixing) with
/// two — though each exchange is in flight for a whole round.
#[test]
fn eager_streaming_diloco_with_one_worker_is_diloco() {
    let steps = "train.max_steps=14";
    let diloco = run(
        1,
        &[steps, "sync.kind=\"diloco\"", "sync.period=4"],
        None,
        false,
    );
    let one = run(
        1,
        &[&[steps][..], &eager("sync.fragments=1")].concat(),
        None,
        false,
    );
    same(&diloco.params, &one.params, "parameters, one fragment");
    assert_eq!(diloco.losses, one.losses);
    let streaming = run(
        1,
        &[
            steps,
            "sync.kind=\"streaming-diloco\"",
            "sync.period=4",
            "sync.fragments=2",
            "sync.stripes=1",
            "sync.overlap=0",
            "sync.mixing=0",
        ],
        None,
        false,
    );
    let two = run(
        1,
        &[&[steps][..], &eager("sync.fragments=2")].concat(),
        None,
        false,
    );
    same(&streaming.params, &two.params, "parameters, two fragments");
    assert_eq!(streaming.losses, two.losses);
}

/// With three workers the eager rule trains another model than DiLoCo (each replica steps
/// on its own change a round before the others'), the same in flight as blocking, and it
/// trains; a checkpoint taken with a round's average in flight and another waiting in
/// `arrived` resumes exactly.
#[test]
fn eager_streaming_diloco_trains_alike_in_flight_and_resumes_exactly() {
    let steps = "train.max_steps=24";
    let sets = [&[steps][..], &eager("sync.fragments=2")].concat();
    let in_flight = run(3, &sets, None, false);
    let blocking = run(
        3,
        &[&sets[..], &["sync.in_flight=false"]].concat(),
        None,
        false,
    );
    same(&blocking.params, &in_flight.params, "parameters");
    assert_eq!(blocking.losses, in_flight.losses);
    let diloco = run(
        3,
        &[steps, "sync.kind=\"diloco\"", "sync.period=4"],
        None,
        false,
    );
    assert_ne!(diloco.losses[6..], in_flight.losses[6..]);
    assert_loss_falls(&in_flight.losses, "eager streaming DiLoCo");
    // Fragment 0 exchanges after steps 1, 5, 9 and fragment 1 after 3, 7, 11: at step 6
    // both have an average arrived or in flight and an own change applied ahead.
    resume_is_exact(
        2,
        &[
            &eager("sync.fragments=2")[..],
            &["compress.kind=\"topk\"", "compress.ratio=0.1"],
        ]
        .concat(),
    );
}

/// One worker, outer lr 1 and no outer momentum: each fragment's outer step lands on the
/// worker's own values, so a merge without overlap (whatever α) leaves the model where
/// plain training takes it — up to the rounding of θ₀ − (θ₀ − θ). With an overlap the merge
/// pulls the fragment back towards where it was τ steps before, and the runs part.
#[test]
fn streaming_diloco_with_one_worker_and_a_unit_outer_step_is_plain_training() {
    let steps = "train.max_steps=16";
    let mut plain = single(&[steps, "train.momentum=0"], None);
    plain.run(&mut Quiet).unwrap();
    let want = plain.params();
    for (overlap, mixing) in [
        ("sync.overlap=0", "sync.mixing=0"),
        ("sync.overlap=2", "sync.mixing=0.5"),
    ] {
        let mut s = single(
            &[
                steps,
                "train.momentum=0",
                "sync.kind=\"streaming-diloco\"",
                "sync.period=8",
                "sync.outer_lr=1",
                "sync.outer_momentum=0",
                overlap,
                mixing,
            ],
            None,
        );
        s.run(&mut Quiet).unwrap();
        let d = max_rel_diff(&want, &s.params());
        if overlap.ends_with('0') {
            assert!(d < 1e-4, "{overlap} {mixing}: max relative difference {d}");
        } else {
            assert!(d > 1e-3, "{overlap} {mixing}: the merge did not mix ({d})");
        }
    }
}

/// The point of the fragments: a round's bytes are spread over F steps, so the busiest
/// step carries about 1/F of DiLoCo's, and a round as many bytes in all.
#[test]
fn streaming_diloco_peak_bytes_are_a_fragments_share_of_diloco() {
    let diloco = [
        "train.max_steps=16",
        "sync.kind=\"diloco\"",
        "sync.period=8",
    ];
    let dense = run(2, &diloco, None, false);
    let mut s = diloco.to_vec();
    s[1] = "sync.kind=\"streaming-diloco\"";
    s.push("sync.fragments=4");
    let streaming = run(2, &s, None, false);
    let peak = |r: &Run| r.summary.bytes_sent_peak.unwrap() as f64;
    let mean = |r: &Run| r.summary.bytes_sent_per_step.unwrap();
    let share = peak(&streaming) / peak(&dense);
    // 2 778 parameters cut at rows of up to 64 values: within a row of a quarter.
    assert!((share - 0.25).abs() < 0.05, "peak share {share}");
    let total = mean(&streaming) / mean(&dense);
    assert!((total - 1.0).abs() < 0.05, "bytes in all: {total}");
}

/// Another worker count cannot take a checkpoint written between two synchronisations
/// (each rank's parameters are their own there), and says why.
#[test]
fn another_worker_count_is_refused_between_synchronisations() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "sync.kind=\"local-sgd\"",
        "sync.period=4",
        "train.max_steps=6",
    ];
    run(2, &sets, Some(dir.path()), false);
    let e = resume_error(
        dir.path(),
        1,
        &[&sets[..2], &["cluster.workers=1"]].concat(),
    );
    assert!(e.contains("between two synchronisations"), "{e}");
}

/// A Streaming DiLoCo checkpoint cut into other fragments cannot be resumed: the error names
/// the setting (the fragments' anchors and memories would not line up).
#[test]
fn streaming_diloco_refuses_a_checkpoint_of_other_fragments() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "sync.kind=\"streaming-diloco\"",
        "sync.period=4",
        "sync.fragments=2",
        "train.max_steps=6",
    ];
    run(2, &sets, Some(dir.path()), false);
    for other in ["sync.fragments=4", "sync.stripes=3"] {
        let e = resume_error(
            dir.path(),
            2,
            &[&sets[..3], &[other, "cluster.workers=2"]].concat(),
        );
        assert!(e.contains("sync.fragments"), "{other}: {e}");
    }
}

/// `world` in-process ranks of BASE + `sets` + 12 steps each resume the newest checkpoint
/// under `dir`, which every rank must refuse; rank 0's error.
fn resume_error(dir: &std::path::Path, world: usize, sets: &[&str]) -> String {
    let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    sets.push("train.max_steps=12".into());
    let mut cfg = RunConfig::parse(BASE, "b.toml", &sets).unwrap();
    pin_collective(&mut cfg);
    let handles: Vec<_> = dtrain_comms::channel_mesh(world)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let cfg = cfg.clone();
            let root = dir.to_path_buf();
            std::thread::spawn(move || {
                let data = TrainData::open(&cfg, rank, world).unwrap();
                let plan = cfg.validate("b.toml", Some(data.train_examples())).unwrap();
                let comm = dtrain_comms::Communicator::new(t, Default::default());
                let out = dtrain_framework::trainer::RunDir { root };
                let latest = out.latest().unwrap();
                let mut tr = dtrain_framework::trainer::Trainer::new(
                    plan,
                    data,
                    comm,
                    &dtrain_models::cpu_device(),
                    Some(out),
                )
                .unwrap();
                tr.resume_from(&latest).map(|_| ()).unwrap_err().to_string()
            })
        })
        .collect();
    let mut errors: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    errors.swap_remove(0)
}

#[test]
fn sync_configuration_is_checked() {
    refused_at(&["sync.kind=\"local-sgd\"", "sync.period=0"], "sync.period");
    refused_at(
        &[
            "sync.kind=\"diloco\"",
            "sync.period=4",
            "sync.outer_momentum=1.0",
        ],
        "sync.outer_momentum",
    );
    refused_at(
        &["sync.kind=\"diloco\"", "sync.period=4", "sync.outer_lr=0"],
        "sync.outer_lr",
    );
    refused_at(
        &[
            "sync.kind=\"local-sgd\"",
            "sync.period=4",
            "cluster.mode=\"ps\"",
        ],
        "sync.kind",
    );
    refused_at(
        &[
            "sync.kind=\"local-sgd\"",
            "sync.period=4",
            "compress.kind=\"dgc\"",
        ],
        "sync.kind",
    );
    refused_at(
        &[
            "sync.kind=\"diloco\"",
            "sync.period=4",
            "compress.kind=\"signsgd\"",
        ],
        "sync.kind",
    );
    // DeMo's update is the sign of the mean: not an average of parameter changes.
    refused_at(
        &[
            "sync.kind=\"diloco\"",
            "sync.period=4",
            "compress.kind=\"demo\"",
        ],
        "sync.kind",
    );
    let streaming = ["sync.kind=\"streaming-diloco\"", "sync.period=4"];
    for (set, field) in [
        ("sync.fragments=5", "sync.fragments"),
        ("sync.fragments=0", "sync.fragments"),
        ("sync.overlap=4", "sync.overlap"),
        // The eager rule overlaps whole rounds and restarts them from the replica's anchor.
        ("sync.eager=true", "sync.eager"),
        ("sync.mixing=1", "sync.mixing"),
        ("sync.stripes=0", "sync.stripes"),
        ("sync.outer_lr=-1", "sync.outer_lr"),
    ] {
        let mut sets = streaming.to_vec();
        sets.push(set);
        refused_at(&sets, field);
    }
    refused_at(
        &[&streaming[..], &["sync.eager=true", "sync.overlap=4"]].concat(),
        "sync.eager",
    );
    // Keys of another kind, and a missing period, are parse errors naming the table.
    for sets in [
        vec![
            "sync.kind=\"local-sgd\"",
            "sync.period=4",
            "sync.outer_lr=0.5",
        ],
        vec!["sync.kind=\"local-sgd\""],
        vec!["sync.kind=\"gossip\""],
    ] {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let e = RunConfig::parse(BASE, "b.toml", &sets).unwrap_err();
        assert!(e.field.starts_with("sync"), "{sets:?}: {e}");
    }
}

/// Evaluations between two synchronisations (`train.eval_every_steps`) use the replicas'
/// average and hand each rank its own parameters back: the run trains exactly as without
/// them.
#[test]
fn evaluating_between_rounds_leaves_the_training_untouched() {
    let sets = [
        "sync.kind=\"local-sgd\"",
        "sync.period=8",
        "train.max_steps=16",
    ];
    let plain = run(2, &sets, None, false);
    let mut with_evals = sets.to_vec();
    with_evals.push("train.eval_every_steps=3");
    let evaluated = run(2, &with_evals, None, false);
    same(&plain.params, &evaluated.params, "parameters");
    assert_eq!(plain.losses, evaluated.losses);
    // One rank: evaluations at steps 3, 6, …, 15 and at the end.
    let mut tr = single(&["train.max_steps=16", "train.eval_every_steps=3"], None);
    tr.run(&mut Quiet).unwrap();
    let steps: Vec<u64> = tr.evals().iter().map(|e| e.step).collect();
    assert_eq!(steps, [3, 6, 9, 12, 15, 16]);
    refused_at(&["train.eval_every_steps=0"], "train.eval_every_steps");
}
