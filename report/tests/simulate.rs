//! The step-time simulator on synthetic runs.

mod common;

use std::fs;

use common::{check_plots, names, Spec, Times};
use dtrain_report::md::check_tables;
use dtrain_report::{
    collective_of, simulate, validate, Collective, Fabric, ReportError, Run, SimOptions, StepModel,
    DEFAULT_WORKERS,
};

fn model(spec: &Spec) -> StepModel {
    let tmp = tempfile::tempdir().unwrap();
    let dir = spec.write(tmp.path(), "run");
    StepModel::from_run(&Run::load(&dir).unwrap(), "r").unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 + 1e-9 * b.abs()
}

#[test]
fn ring_all_reduce_matches_hand_computation() {
    let link = Fabric::parse("1Gbit,100us").unwrap().link;
    // 1e6 parameters: 4 MB of f32 in one 25 MiB bucket.
    let m = model(&Spec::new("a", "none"));
    assert_eq!(m.collective, Collective::DenseAllReduce);
    assert_eq!((m.dense_bytes, m.buckets), (4e6, 1));
    // P = 4: 2·3/4 · 4e6 B / 125e6 B/s + 2·3 · 100 µs.
    assert!(
        close(m.comm_s(&link, 4), 0.048 + 0.0006),
        "{}",
        m.comm_s(&link, 4)
    );
    assert!(close(m.comm_s(&link, 2), 0.032 + 0.0002));
    assert_eq!(m.comm_s(&link, 1), 0.0);
    // T = compute 6 ms + compress 0.5 + decompress 0.5 + comm (+ other 0).
    assert!(
        close(m.step_s(&link, 4), 0.007 + 0.0486),
        "{}",
        m.step_s(&link, 4)
    );

    // Small buffers use recursive doubling: log2 4 = 2 rounds of the whole 40 kB.
    let mut small = Spec::new("a", "none");
    small.params = 10_000;
    let m = model(&small);
    assert!(
        close(m.comm_s(&link, 4), 2.0 * (40e3 / 125e6 + 1e-4)),
        "{}",
        m.comm_s(&link, 4)
    );

    // bucket_mb = 1: four buckets; the bandwidth term is unchanged, latency counts 4×.
    let mut bucketed = Spec::new("a", "none");
    bucketed.compress_extra = "bucket_mb = 1\n".into();
    let m = model(&bucketed);
    assert_eq!(m.buckets, 4);
    assert!(
        close(m.comm_s(&link, 4), 0.048 + 4.0 * 0.0006),
        "{}",
        m.comm_s(&link, 4)
    );
}

#[test]
fn gather_grows_linearly_in_p() {
    let link = Fabric::parse("1Gbit,100us").unwrap().link;
    let m = model(&Spec::new("a", "topk").payload(40_000, 40_100));
    assert_eq!(m.collective, Collective::AllGather);
    // (P−1) · (payload/β + α) per step, and P/P₀ times the measured decompress.
    let per_peer = 40e3 / 125e6 + 1e-4;
    for p in DEFAULT_WORKERS {
        assert!(
            close(m.comm_s(&link, p), (p - 1) as f64 * per_peer),
            "P={p}"
        );
        assert!(close(m.decompress_at(p), 0.0005 * p as f64 / 2.0), "P={p}");
    }
    // All-reduce methods neither grow their decompress time nor their bandwidth term.
    let none = model(&Spec::new("a", "none"));
    assert_eq!(none.decompress_at(256), none.decompress_at(2));
    let bw_only = Fabric::parse("1Gbit").unwrap().link;
    assert!(none.comm_s(&bw_only, 256) < 2.0 * 4e6 / 125e6);
}

#[test]
fn speedups_are_monotone_where_expected() {
    let tmp = tempfile::tempdir().unwrap();
    let none = Spec::new("m", "none").write(tmp.path(), "none");
    let topk = Spec::new("m", "topk")
        .payload(40_000, 40_100)
        .write(tmp.path(), "topk");
    let out = simulate(&[none, topk], &SimOptions::default()).unwrap();
    let speedup = |fabric: &str, p: usize| {
        out.points
            .iter()
            .find(|x| x.fabric == fabric && x.workers == p && x.run == "m/topk P=2")
            .and_then(|x| x.speedup)
            .unwrap()
    };
    // The baseline is the "none" run, whose own points carry 1×.
    assert!(out
        .points
        .iter()
        .filter(|x| x.run == "m/none P=2")
        .all(|x| x.speedup == Some(1.0)));
    // A compressed method helps more, the slower the fabric.
    let order = ["1GbE", "10GbE", "25GbE", "100GbE"];
    for p in DEFAULT_WORKERS {
        for w in order.windows(2) {
            assert!(
                speedup(w[0], p) >= speedup(w[1], p),
                "P={p}: {} vs {}",
                w[0],
                w[1]
            );
        }
    }
    // On 1GbE, top-k's gather grows with P while the ring's bytes do not: from P=4 on its
    // advantage only shrinks.
    for w in DEFAULT_WORKERS[1..].windows(2) {
        assert!(
            speedup("1GbE", w[0]) >= speedup("1GbE", w[1]),
            "P={} → {}",
            w[0],
            w[1]
        );
    }
    assert!(speedup("1GbE", 4) > 5.0);
    // The uncompressed run keeps scaling (P · T(1)/T(P) grows) on InfiniBand HDR.
    let scaling: Vec<f64> = out
        .points
        .iter()
        .filter(|x| x.fabric == "IB-HDR" && x.run == "m/none P=2")
        .map(|x| x.scaling)
        .collect();
    assert_eq!(scaling.len(), DEFAULT_WORKERS.len());
    assert!(scaling.windows(2).all(|w| w[1] > w[0]), "{scaling:?}");
}

#[test]
fn simulate_writes_tables_and_plot() {
    let tmp = tempfile::tempdir().unwrap();
    let none = Spec::new("m", "none").write(tmp.path(), "runs/none");
    let fft = Spec::new("m", "fft")
        .payload(400_000, 400_100)
        .write(tmp.path(), "runs/fft");
    let opts = SimOptions {
        fabrics: vec![
            Fabric::parse("10GbE").unwrap(),
            Fabric::parse("IB-HDR").unwrap(),
        ],
        workers: vec![2, 8, 64],
        baseline: Some("none".into()),
        out_dir: Some(tmp.path().join("sim")),
        ..SimOptions::default()
    };
    let out = simulate(&[none.clone(), fft.clone()], &opts).unwrap();
    assert_eq!(out.points.len(), 2 * 3 * 2);
    let md = &out.markdown;
    assert_eq!(check_tables(md), Ok(3), "{md}");
    assert!(md.contains("## 10GbE (10.0 Gbit/s, 30.0 µs)"), "{md}");
    assert!(md.contains("| m/fft P=2 speed-up |"), "{md}");
    assert!(md.contains("| m/fft P=2 | fft | all-gatherv | 2 |"), "{md}");
    assert_eq!(
        names(&out.files),
        [
            "simulate.md",
            "speedup_vs_workers.svg",
            "speedup_vs_workers.png"
        ]
    );
    check_plots(&out.files[1..]);

    // Without a baseline the plot shows scaling, and speed-ups are absent.
    let opts = SimOptions {
        baseline: None,
        out_dir: Some(tmp.path().join("sim2")),
        ..opts
    };
    let out = simulate(std::slice::from_ref(&fft), &opts).unwrap();
    assert!(out.points.iter().all(|p| p.speedup.is_none()));
    check_plots(&out.files[1..]);

    // A baseline that matches nothing is an error.
    let opts = SimOptions {
        baseline: Some("qsgd".into()),
        ..SimOptions::default()
    };
    assert!(matches!(
        simulate(&[none, fft], &opts),
        Err(ReportError::Baseline(_))
    ));
}

#[test]
fn a_lone_summary_file_is_enough() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = Spec::new("m", "dgc").payload(40_000, 40_100);
    let path = tmp.path().join("dgc-summary.json");
    fs::write(&path, serde_json::to_string(&spec.summary_json()).unwrap()).unwrap();
    let out = simulate(&[path], &SimOptions::default()).unwrap();
    assert_eq!(out.models[0].collective, Collective::AllGather);
    assert_eq!(out.models[0].dense_bytes, 4e6);
    assert_eq!(out.points.len(), 6 * DEFAULT_WORKERS.len());
}

#[test]
fn parameter_server_override() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = Spec::new("m", "none").write(tmp.path(), "r");
    let opts = SimOptions {
        fabrics: vec![Fabric::parse("1Gbit,0").unwrap()],
        workers: vec![8],
        collective: Some(Collective::ParameterServer { servers: 2 }),
        ..SimOptions::default()
    };
    let out = simulate(&[dir], &opts).unwrap();
    // Push + pull of the 4 MB payload, 8/2 workers per server link.
    assert!(close(out.points[0].comm_s, 2.0 * 4.0 * 4e6 / 125e6));
}

#[test]
fn validation_compares_with_the_emulated_step_time() {
    let tmp = tempfile::tempdir().unwrap();
    // Emulated 1Gbit/100us, P = 2: the model predicts 4e6/125e6 + 2·100 µs = 32.2 ms of
    // communication. The run waited 10 % longer than that.
    let mut spec = Spec::new("emu", "none").network("1Gbit", "100us");
    let wait = 0.0322 * 1.1;
    spec.times = Times {
        communicate: wait,
        wait,
        step: 0.007 + wait,
        ..Times::split(0.010)
    };
    let emulated = spec.write(tmp.path(), "emu");
    let plain = Spec::new("plain", "none").write(tmp.path(), "plain");
    let out = validate(&[emulated, plain.clone()]).unwrap();
    assert_eq!(out.rows.len(), 1);
    assert_eq!(out.skipped, vec!["plain/none P=2".to_owned()]);
    let v = &out.rows[0];
    assert_eq!(v.link, "1Gbit/100us");
    assert!(close(v.predicted_comm_s, 0.0322));
    assert!(close(v.predicted_step_s, 0.007 + 0.0322));
    let want = (0.0392 - (0.007 + wait)) / (0.007 + wait);
    assert!(close(v.rel_error, want), "{} vs {want}", v.rel_error);
    assert!(v.rel_error < 0.0 && v.rel_error > -0.15);
    assert_eq!(check_tables(&out.markdown), Ok(1), "{}", out.markdown);
    assert!(out.markdown.contains("-7.6 %"), "{}", out.markdown);

    // Nothing emulated: an error saying so.
    let e = validate(&[plain]).unwrap_err().to_string();
    assert!(e.contains("[network]"), "{e}");
}

#[test]
fn the_recorded_collective_is_modelled_and_old_runs_derive_theirs() {
    let tmp = tempfile::tempdir().unwrap();
    // Runs written before summary.json recorded it: derived from [compress] through the
    // method registry (its aggregation and options), with a note.
    let sparse = Collective::SparseAllReduce { new_fraction: 1.0 };
    for (i, (method, extra, expected)) in [
        ("none", "", Collective::DenseAllReduce),
        ("fp16", "bucket_mb = 4\n", Collective::DenseAllReduce),
        ("randomk", "", Collective::SummableAllReduce),
        (
            "randomk",
            "ratio = 0.1\nshared = false\n",
            Collective::AllGather,
        ),
        (
            "scalecom",
            "error_feedback = true\n",
            Collective::BroadcastAllReduce,
        ),
        ("topk", "collective = \"sparse-allreduce\"\n", sparse),
        ("dgc", "", Collective::AllGather),
        ("qsgd", "", Collective::AllGather),
        ("terngrad", "", Collective::AllGather),
        ("fft", "", Collective::AllGather),
        ("something-new", "", Collective::AllGather),
    ]
    .into_iter()
    .enumerate()
    {
        let mut spec = Spec::new("m", method);
        spec.compress_extra = extra.into();
        let run = Run::load(&spec.write(tmp.path(), &format!("old{i}"))).unwrap();
        assert_eq!(collective_of(&run), expected, "{method} {extra:?}");
        assert!(
            run.notes.iter().any(|n| n.contains("not recorded")),
            "{method}: {:?}",
            run.notes
        );
    }
    // A recorded collective is what the run used, whatever its method's name suggests.
    let spec = Spec::new("m", "topk");
    let dir = spec.write(tmp.path(), "new");
    let mut summary = spec.summary_json();
    summary["collective"] = "lanes".into();
    fs::write(dir.join("summary.json"), summary.to_string()).unwrap();
    let run = Run::load(&dir).unwrap();
    assert_eq!(collective_of(&run), Collective::SummableAllReduce);
    assert!(run.notes.is_empty(), "{:?}", run.notes);
    let ps = Spec::new("m", "none").workers(4);
    let dir = ps.write(tmp.path(), "ps");
    let mut summary = ps.summary_json();
    summary["collective"] = "ps".into();
    fs::write(dir.join("summary.json"), summary.to_string()).unwrap();
    let run = Run::load(&dir).unwrap();
    assert_eq!(
        collective_of(&run),
        Collective::ParameterServer { servers: 4 }
    );
    // A name from a newer trainer: noted, modelled as the all-gather.
    summary["collective"] = "carrier-pigeon".into();
    fs::write(dir.join("summary.json"), summary.to_string()).unwrap();
    let run = Run::load(&dir).unwrap();
    assert_eq!(collective_of(&run), Collective::AllGather);
    assert!(run.notes.iter().any(|n| n.contains("carrier-pigeon")));
}

/// Streaming DiLoCo's summary (`sync_fragments`, `sync_overlap`): an exchange carries one
/// fragment of the dense model, and up to τ steps of work hide it.
#[test]
fn a_streaming_run_exchanges_one_fragment_and_hides_its_overlap() {
    let link = Fabric::parse("100Mbit,100us").unwrap().link;
    let tmp = tempfile::tempdir().unwrap();
    let dir = Spec::new("s", "none").workers(4).write(tmp.path(), "run");
    let plain = StepModel::from_run(&Run::load(&dir).unwrap(), "r").unwrap();
    let path = dir.join("summary.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    v["sync_fragments"] = 4.into();
    v["sync_overlap"] = 1.into();
    fs::write(&path, v.to_string()).unwrap();
    let s = StepModel::from_run(&Run::load(&dir).unwrap(), "r").unwrap();
    assert_eq!(s.dense_bytes, plain.dense_bytes / 4.0);
    assert_eq!(s.overlap_steps, 1.0);
    // A quarter of the ring's bytes (its latency terms stay), less one step's work: the
    // 7 ms of compute, compress and decompress.
    let blocking = StepModel {
        overlap_steps: 0.0,
        ..s.clone()
    };
    let one = blocking.comm_s(&link, 4);
    assert!(one < plain.comm_s(&link, 4) / 3.9 && one > 0.007, "{one}");
    assert!(
        close(s.comm_s(&link, 4), one - 0.007),
        "{}",
        s.comm_s(&link, 4)
    );
}
