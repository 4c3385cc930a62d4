//! `report()` on synthetic run directories.

mod common;

use std::fs;

use common::{check_plots, edit_steps, names, Spec, Times};
use dtrain_report::md::check_tables;
use dtrain_report::{report, FinalMetric, ReportError, ReportOptions, Run};

fn opts(out: &std::path::Path) -> ReportOptions {
    ReportOptions::new(out.join("out"))
}

#[test]
fn complete_run_renders_tables_and_plots() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = Spec::new("mlp_a", "none").write(tmp.path(), "runs/mlp_a/20261122-050826");
    let out = report(std::slice::from_ref(&dir), &opts(tmp.path())).unwrap();

    assert_eq!(out.runs.len(), 1);
    let r = &out.runs[0];
    assert_eq!(r.label, "mlp_a/none P=2");
    assert!(r.complete);
    assert_eq!(r.final_metric, Some(FinalMetric::Accuracy(0.85)));
    assert_eq!(r.steps, 10);
    assert!((r.mean_step.step_s - 0.010).abs() < 1e-12);
    assert_eq!(r.compression_ratio, Some(1.0));
    // The only "none" run is its own baseline.
    assert_eq!(r.speedup, Some(1.0));

    let md = &out.markdown;
    assert_eq!(check_tables(md), Ok(1), "{md}");
    assert!(
        md.contains("| mlp_a/none P=2 | none | 2 | complete | acc 85.00 % |"),
        "{md}"
    );
    assert!(
        md.contains("| 10.0 | 6.00 | 1.00 | 3.00 | 3.00 | 0 | 4.00 MB | 1.00× |"),
        "{md}"
    );
    assert!(md.contains("![loss vs time](loss_vs_time.svg)"), "{md}");

    assert_eq!(out.files[0], tmp.path().join("out/report.md"));
    assert_eq!(fs::read_to_string(&out.files[0]).unwrap(), *md);
    let n = names(&out.files);
    for stem in [
        "loss_vs_time",
        "loss_vs_step",
        "accuracy_vs_epoch",
        "step_breakdown",
    ] {
        assert!(n.contains(&format!("{stem}.svg")), "{n:?}");
        assert!(n.contains(&format!("{stem}.png")), "{n:?}");
    }
    // One worker count only: no bytes-vs-P plot; not a language model: no perplexity.
    assert!(!n
        .iter()
        .any(|f| f.starts_with("bytes_vs_workers") || f.starts_with("perplexity")));
    check_plots(&out.files[1..]);
}

#[test]
fn run_without_summary_is_incomplete_and_derived_from_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = Spec::new("mlp_b", "topk")
        .payload(40_000, 40_100)
        .no_summary();
    let dir = spec.write(tmp.path(), "mlp_b/20261122-060000");
    // A slow first step: the derived mean must leave it out, as the trainer does.
    let text = fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    lines[0] = spec.step_line(0, 2.3, &Times::split(1.0));
    fs::write(dir.join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();

    let run = Run::load(&dir).unwrap();
    assert!(!run.is_complete());
    assert!((run.mean_step().step_s - 0.010).abs() < 1e-12);
    assert_eq!(run.payload_bytes_per_step(), 40_000.0);
    assert_eq!(run.compression_ratio(), None);
    assert!((run.wall_s() - (1.0 + 9.0 * 0.010)).abs() < 1e-9);
    assert_eq!(run.final_metric(), Some(FinalMetric::Accuracy(0.85)));

    let out = report(&[dir], &opts(tmp.path())).unwrap();
    assert!(!out.runs[0].complete);
    assert!(out.markdown.contains("| incomplete |"), "{}", out.markdown);
    assert!(out.markdown.contains("no summary.json"), "{}", out.markdown);
    // No method "none" among the runs: no baseline.
    assert_eq!(out.runs[0].speedup, None);
    assert_eq!(check_tables(&out.markdown), Ok(1));
}

#[test]
fn resumed_run_keeps_the_last_record_of_each_step() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = Spec::new("mlp_r", "none").no_summary();
    let dir = spec.write(tmp.path(), "mlp_r/20261122-070000");
    // The resumed session repeats steps 6..10 with other losses.
    let mut m = fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    for s in 6..10 {
        m += &spec.step_line(s, 0.1 * s as f64, &spec.times);
        m.push('\n');
    }
    fs::write(dir.join("metrics.jsonl"), m).unwrap();
    // eval.jsonl repeats the step-10 evaluation.
    let mut e = fs::read_to_string(dir.join("eval.jsonl")).unwrap();
    e += "{\"epoch\":1,\"step\":10,\"loss\":0.4,\"accuracy\":0.9,\"perplexity\":1.5,\"count\":1000}\n";
    fs::write(dir.join("eval.jsonl"), e).unwrap();

    let run = Run::load(&dir).unwrap();
    assert_eq!(run.steps.len(), 10);
    assert_eq!(
        run.steps.iter().map(|r| r.step).collect::<Vec<_>>(),
        (0..10).collect::<Vec<_>>()
    );
    assert_eq!(run.steps[7].loss, Some(0.7000000000000001));
    assert_eq!(run.evals.len(), 2);
    assert_eq!(run.final_metric(), Some(FinalMetric::Accuracy(0.9)));
    assert!(
        run.notes.iter().any(|n| n.contains("4 repeated step")),
        "{:?}",
        run.notes
    );
    let out = report(&[dir], &opts(tmp.path())).unwrap();
    assert_eq!(out.runs[0].steps, 10);
    assert!(out.markdown.contains("4 repeated step record(s)"));
}

#[test]
fn malformed_lines_name_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = Spec::new("bad", "none").write(tmp.path(), "bad/20261122-080000");
    let path = dir.join("metrics.jsonl");
    let text = fs::read_to_string(&path).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[2] = "{\"step\": 2, \"loss\": oops}";
    fs::write(&path, lines.join("\n") + "\n").unwrap();
    let e = report(std::slice::from_ref(&dir), &opts(tmp.path())).unwrap_err();
    assert!(
        matches!(e, ReportError::Format { line: Some(3), .. }),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(msg.starts_with(&format!("{}:3: ", path.display())), "{msg}");

    // A wrong type is an error too, as is a summary that is not JSON and a broken config.
    lines[2] = "{\"step\": \"two\"}";
    fs::write(&path, lines.join("\n") + "\n").unwrap();
    let msg = Run::load(&dir).unwrap_err().to_string();
    assert!(msg.contains("metrics.jsonl:3: invalid type"), "{msg}");
    fs::write(&path, text).unwrap();
    fs::write(
        dir.join("summary.json"),
        "{\n  \"name\": \"x\",\n  \"steps\": -1\n}",
    )
    .unwrap();
    let msg = Run::load(&dir).unwrap_err().to_string();
    assert!(msg.contains("summary.json:3: "), "{msg}");
    fs::remove_file(dir.join("summary.json")).unwrap();
    fs::write(
        dir.join("config.toml"),
        "name = \"x\"\n[cluster]\nworkers = \n",
    )
    .unwrap();
    let msg = Run::load(&dir).unwrap_err().to_string();
    assert!(msg.contains("config.toml:3: "), "{msg}");

    // A directory without runs, and a missing path.
    let empty = tmp.path().join("empty");
    fs::create_dir_all(&empty).unwrap();
    let msg = report(&[empty], &opts(tmp.path())).unwrap_err().to_string();
    assert!(msg.contains("no run found"), "{msg}");
    assert!(report(&[tmp.path().join("nope")], &opts(tmp.path())).is_err());
}

#[test]
fn a_cut_last_line_is_dropped_with_a_note() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = Spec::new("cut", "none")
        .no_summary()
        .write(tmp.path(), "cut/20261122-090000");
    let path = dir.join("metrics.jsonl");
    let mut text = fs::read_to_string(&path).unwrap();
    text += "{\"step\":10,\"epoch\":2,\"lo";
    fs::write(&path, text).unwrap();
    let run = Run::load(&dir).unwrap();
    assert_eq!(run.steps.len(), 10);
    assert!(run
        .notes
        .iter()
        .any(|n| n.contains("metrics.jsonl:11: incomplete last line")));
}

#[test]
fn two_methods_speedup_vs_baseline_and_peers() {
    let tmp = tempfile::tempdir().unwrap();
    let none = Spec::new("alexnet", "none")
        .step_s(0.010)
        .write(tmp.path(), "runs/alexnet_none/20261122-050826");
    let fft = Spec::new("alexnet", "fft")
        .step_s(0.004)
        .payload(400_000, 400_100)
        .write(tmp.path(), "runs/alexnet_fft/20261122-051000");
    let inputs = vec![none.clone(), fft.clone()];

    // Default baseline: the one "none" run.
    let out = report(&inputs, &opts(tmp.path())).unwrap();
    let md = &out.markdown;
    // Runs, quality against bytes, the speed-up matrix.
    assert_eq!(check_tables(md), Ok(3), "{md}");
    let f = &out.runs[1];
    assert_eq!(f.label, "alexnet/fft P=2");
    assert_eq!(f.baseline.as_deref(), Some("alexnet/none P=2"));
    assert!((f.speedup.unwrap() - 2.5).abs() < 1e-9);
    assert_eq!(f.compression_ratio, Some(10.0));
    assert!(md.contains("| alexnet/none P=2 | 2.50× |"), "{md}");
    // The matrix: fft vs none 2.5×, none vs fft 0.4×, diagonal 1.
    assert!(md.contains("| alexnet/fft P=2 | 2.50× | 1.00× |"), "{md}");
    assert!(md.contains("| alexnet/none P=2 | 1.00× | 0.40× |"), "{md}");

    // Baseline by method and by label; against fft, none is 0.4×.
    let mut o = opts(tmp.path());
    o.baseline = Some("fft".into());
    let out = report(&inputs, &o).unwrap();
    assert!((out.runs[0].speedup.unwrap() - 0.4).abs() < 1e-9);
    o.baseline = Some("alexnet/none P=2".into());
    let out = report(&inputs, &o).unwrap();
    assert!((out.runs[1].speedup.unwrap() - 2.5).abs() < 1e-9);
    o.baseline = Some("qsgd".into());
    let e = report(&inputs, &o).unwrap_err();
    assert!(matches!(e, ReportError::Baseline(_)), "{e}");
    assert!(e.to_string().contains("alexnet/fft P=2"), "{e}");
}

#[test]
fn worker_sweep_has_bytes_vs_p_table_and_plot() {
    let tmp = tempfile::tempdir().unwrap();
    let mut inputs = Vec::new();
    for p in [2usize, 4, 8] {
        let ring = 2 * (p as u64 - 1) * 4_000_000 / p as u64;
        inputs.push(
            Spec::new("sweep", "none")
                .workers(p)
                .payload(4_000_000, ring)
                .write(tmp.path(), &format!("sweep_none_p{p}")),
        );
        inputs.push(
            Spec::new("sweep", "topk")
                .workers(p)
                .payload(80_000, (p as u64 - 1) * 80_000)
                .step_s(0.005)
                .write(tmp.path(), &format!("sweep_topk_p{p}")),
        );
    }
    // One directory holding all six run directories.
    let out = report(&[tmp.path().to_path_buf()], &opts(tmp.path())).unwrap();
    assert_eq!(out.runs.len(), 6);
    let md = &out.markdown;
    assert_eq!(check_tables(md), Ok(4), "{md}");
    assert!(md.contains("## Bytes per worker per step vs P"));
    assert!(md.contains("| run | P=2 | P=4 | P=8 |"), "{md}");
    assert!(
        md.contains("| sweep/none | 4.00 MB | 6.00 MB | 7.00 MB |"),
        "{md}"
    );
    assert!(
        md.contains("| sweep/topk | 80.0 kB | 240 kB | 560 kB |"),
        "{md}"
    );
    // Several "none" runs: each run is compared with the one of its own P.
    for r in &out.runs {
        assert_eq!(
            r.baseline.as_deref(),
            Some(format!("sweep/none P={}", r.workers).as_str())
        );
        let want = if r.method == "topk" { 2.0 } else { 1.0 };
        assert!((r.speedup.unwrap() - want).abs() < 1e-9);
    }
    let n = names(&out.files);
    assert!(n.contains(&"bytes_vs_workers.svg".to_owned()), "{n:?}");
    check_plots(&out.files[1..]);
}

#[test]
fn language_models_report_perplexity() {
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = Spec::new("ptb", "dgc");
    spec.model = "lstm".into();
    spec.evals = vec![(0, 5, 5.0, 0.2, 148.4), (1, 10, 4.8, 0.25, 121.5)];
    let dir = spec.write(tmp.path(), "ptb/20261122-100000");
    let out = report(&[dir], &opts(tmp.path())).unwrap();
    assert_eq!(
        out.runs[0].final_metric,
        Some(FinalMetric::Perplexity(121.5))
    );
    assert!(out.markdown.contains("| ppl 122 |"), "{}", out.markdown);
    let n = names(&out.files);
    assert!(n.contains(&"perplexity_vs_epoch.png".to_owned()), "{n:?}");
    // Two evaluations: the perplexity against the wall time that led to each.
    assert!(n.contains(&"perplexity_vs_time.svg".to_owned()), "{n:?}");
    check_plots(&out.files[1..]);
}

#[test]
fn parent_dirs_take_the_newest_stamp_and_links_label_runs() {
    let tmp = tempfile::tempdir().unwrap();
    Spec::new("mlp", "none")
        .step_s(0.5)
        .write(tmp.path(), "runs/mlp/20261121-230000");
    Spec::new("mlp", "none")
        .step_s(0.3)
        .write(tmp.path(), "runs/mlp/20261122-010000");
    let newest = Spec::new("mlp", "none")
        .step_s(0.2)
        .network("1Gbit", "100us")
        .write(tmp.path(), "runs/mlp/20261122-010000-2");
    let found = dtrain_report::discover(&[tmp.path().join("runs/mlp")]).unwrap();
    assert_eq!(found, vec![newest.clone()]);
    // A run's own file stands for its directory.
    let found = dtrain_report::discover(&[newest.join("metrics.jsonl")]).unwrap();
    assert_eq!(found, vec![newest.clone()]);
    // The whole runs/ tree: one run per name.
    Spec::new("cnn", "fft").write(tmp.path(), "runs/cnn/20261122-020000");
    let found = dtrain_report::discover(&[tmp.path().join("runs")]).unwrap();
    assert_eq!(found.len(), 2);
    assert!(found.contains(&newest));

    let out = report(&[tmp.path().join("runs/mlp")], &opts(tmp.path())).unwrap();
    assert_eq!(out.runs[0].label, "mlp/none P=2 @1Gbit,100us");
    assert!(out.markdown.contains("| link |"), "{}", out.markdown);
    assert!(out.markdown.contains("| 1Gbit/100us |"), "{}", out.markdown);

    // Two identical configs get their stamps to tell them apart.
    let a = tmp.path().join("runs/mlp/20261121-230000");
    let b = tmp.path().join("runs/mlp/20261122-010000");
    let out = report(&[a, b], &opts(tmp.path())).unwrap();
    assert_eq!(out.runs[0].label, "mlp/none P=2 (20261121-230000)");
    assert_eq!(out.runs[1].label, "mlp/none P=2 (20261122-010000)");
}

#[test]
fn step_time_tail_quantiles_and_dlcp_drops_are_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = Spec::new("tail", "none");
    spec.steps = 41;
    let dir = spec.write(tmp.path(), "runs/tail/20261122-090000");
    // Steps 1..=40 take 1..=40 ms (step 0, the warm-up, is excluded); step 7 dropped 2 %.
    edit_steps(&dir, |s, v| {
        v["time"]["step_s"] = serde_json::json!(s as f64 * 1e-3);
        v["lossy_dropped"] = serde_json::json!(if s == 7 { 0.02 } else { 0.0 });
        v["server_s"] = serde_json::json!(if s == 0 { 1.0 } else { 0.002 });
    });
    let run = Run::load(&dir).unwrap();
    assert_eq!(run.step_quantile(0.5), Some(0.020));
    assert_eq!(run.step_quantile(0.95), Some(0.038));
    assert_eq!(run.step_quantile(0.99), Some(0.040));
    assert_eq!(run.step_quantile(1.0), Some(0.040));
    let d = run.mean_lossy_dropped().unwrap();
    assert!((d - 0.02 / 41.0).abs() < 1e-12, "{d}");
    let out = report(std::slice::from_ref(&dir), &opts(tmp.path())).unwrap();
    let md = &out.markdown;
    assert!(md.contains("## Step-time tail"), "{md}");
    assert!(
        md.contains("| 40 | 10.0 | 20.0 | 38.0 | 40.0 | 40.0 | 0.049 % |"),
        "{md}"
    );
    let n = names(&out.files);
    assert!(n.contains(&"step_time_cdf.svg".to_string()), "{n:?}");
    // The parameter server's aggregate time, warm-up step excluded.
    assert!((run.mean_server_s().unwrap() - 0.002).abs() < 1e-12);
    assert!(md.contains("## Parameter server"), "{md}");
    assert!(md.contains("| 2.00 |"), "{md}");
}

#[test]
fn the_rank_the_others_waited_for_is_reported_from_steps_or_summary() {
    let tmp = tempfile::tempdir().unwrap();
    // Old runs record no slowest rank: no section.
    let old = Spec::new("old", "none").write(tmp.path(), "runs/old/20261122-080000");
    let out = report(std::slice::from_ref(&old), &opts(tmp.path())).unwrap();
    assert!(!out.markdown.contains("The rank the others waited for"));

    // Steps 0..10: rank 1 slowest in steps 3..10 (7 steps), rank 0 in 0..3, with a lead of
    // 2 ms over rank 0 in every step but the warm-up one (excluded from the mean).
    let spec = Spec::new("strag", "none").no_summary();
    let dir = spec.write(tmp.path(), "runs/strag/20261122-090000");
    edit_steps(&dir, |s, v| {
        v["slowest_rank"] = serde_json::json!(if s < 3 { 0 } else { 1 });
        v["behind_slowest_s"] = serde_json::json!(if s == 0 { 1.0 } else { 0.002 });
    });
    let run = Run::load(&dir).unwrap();
    assert_eq!(run.slowest_rank_steps(), Some(vec![3, 7]));
    assert!((run.mean_behind_slowest_s().unwrap() - 0.002).abs() < 1e-12);
    let out = report(std::slice::from_ref(&dir), &opts(tmp.path())).unwrap();
    let md = &out.markdown;
    assert!(md.contains("## The rank the others waited for"), "{md}");
    assert!(md.contains("| rank 1 70 %, rank 0 30 % |"), "{md}");
    assert!(md.contains("| 2.00 |"), "{md}");

    // summary.json's count covers the whole run (a resumed run's metrics may not): it wins.
    let mut s: serde_json::Value = spec.summary_json();
    s["slowest_rank_steps"] = serde_json::json!([1, 1, 6, 0, 0, 2]);
    fs::write(dir.join("summary.json"), s.to_string()).unwrap();
    let run = Run::load(&dir).unwrap();
    assert_eq!(run.slowest_rank_steps(), Some(vec![1, 1, 6, 0, 0, 2]));
    let out = report(std::slice::from_ref(&dir), &opts(tmp.path())).unwrap();
    assert!(
        out.markdown
            .contains("| rank 2 60 %, rank 5 20 %, rank 0 10 %, rank 1 10 %, 2 more |"),
        "{}",
        out.markdown
    );
}

/// A diverged run (issue #24: ResNet-20 whose evaluation loss overflowed): its records hold
/// NaN and ∞ as the trainer writes them (`dtrain_records::float`), and the report renders
/// the run, says it diverged, and still draws its plots.
#[test]
fn a_diverged_run_with_non_finite_figures_is_reported_as_diverged() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = Spec::new("rn", "none").write(tmp.path(), "runs/rn/20261122-050826");
    edit_steps(&dir, |step, r| {
        if step >= 6 {
            r["loss"] = "NaN".into();
        }
    });
    fs::write(
        dir.join("eval.jsonl"),
        "{\"epoch\":1,\"step\":10,\"loss\":1010.0,\"accuracy\":0.1,\"perplexity\":\"Infinity\",\
         \"count\":1000}\n",
    )
    .unwrap();
    let mut s = Spec::new("rn", "none").summary_json();
    s["final_train_loss"] = "NaN".into();
    s["final_eval"] = serde_json::json!({"epoch": 1, "step": 10, "loss": "Infinity",
        "accuracy": 0.1, "count": 1000});
    s["restarts"] = serde_json::json!([{"rank": 1, "cause": "worker 1 failed (signal: 9)",
        "step": 4, "after_s": 2.5}]);
    fs::write(
        dir.join("summary.json"),
        serde_json::to_string_pretty(&s).unwrap(),
    )
    .unwrap();
    let run = Run::load(&dir).unwrap();
    assert!(run.final_train_loss().unwrap().is_nan());
    assert_eq!(run.divergence().as_deref(), Some("test loss ∞"));
    assert_eq!(run.restarts(), 1);
    let out = report(std::slice::from_ref(&dir), &opts(tmp.path())).unwrap();
    let md = &out.markdown;
    assert_eq!(check_tables(md), Ok(1), "{md}");
    assert!(
        md.contains("| complete, diverged (test loss ∞), 1 restart | acc 10.00 % |"),
        "{md}"
    );
    check_plots(&out.files[1..]);
}

/// Live membership (issue #53, scope 5): a run whose group lost a worker (and later took a
/// newcomer in its place) says so in its status, lists the changes, and plots the group's
/// size beside the loss curve.
#[test]
fn a_run_that_lost_a_worker_shows_the_group_size_over_time() {
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = Spec::new("live", "topk");
    spec.workers = 3;
    let dir = spec.write(tmp.path(), "runs/live/20261130-110000");
    let mut s = spec.summary_json();
    s["membership"] = serde_json::json!([{"epoch": 1, "removed": [0], "members": [1, 2],
        "cause": "step 4: rank 0 was lost (connection closed; detected by rank 1)", "step": 4,
        "after_s": 0.5, "steps_lost": 0, "lost_s": 0.02, "deadline_s": 10.0},
        {"epoch": 2, "removed": [], "added": [0], "members": [1, 2, 0],
        "cause": "worker(s) [0] joined", "step": 7, "after_s": 0.9, "steps_lost": 0,
        "lost_s": 0.01}]);
    fs::write(
        dir.join("summary.json"),
        serde_json::to_string_pretty(&s).unwrap(),
    )
    .unwrap();
    let run = Run::load(&dir).unwrap();
    assert_eq!(
        run.group_size(),
        vec![(0, 3), (4, 3), (4, 2), (7, 2), (7, 3), (9, 3)]
    );
    let out = report(std::slice::from_ref(&dir), &opts(tmp.path())).unwrap();
    let md = &out.markdown;
    assert_eq!(check_tables(md), Ok(2), "{md}");
    assert!(md.contains("| complete, 1 worker lost |"), "{md}");
    assert!(md.contains("## Membership"), "{md}");
    assert!(
        md.contains("| 4 | [0] | [] | [1, 2] | step 4: rank 0 was lost"),
        "{md}"
    );
    assert!(
        md.contains("| 7 | [] | [0] | [1, 2, 0] | worker(s) [0] joined"),
        "{md}"
    );
    assert!(
        names(&out.files).contains(&"workers_vs_step.svg".to_string()),
        "the group's size is plotted"
    );
    check_plots(&out.files[1..]);
}

/// `--target`: the time to the first evaluation at or above the accuracy, interpolated,
/// and the speed-up to it against the baseline; a run that never gets there says so.
#[test]
fn time_to_target_is_interpolated_and_compared_with_the_baseline() {
    let tmp = tempfile::tempdir().unwrap();
    // Both evaluate after steps 5 (70 %) and 10 (85 %): 80 % is two thirds of the way,
    // at step 8.33, i.e. 8.33 steps' time. fp32 takes 10 ms a step, top-k 5 ms.
    let none = Spec::new("cmp", "none").write(tmp.path(), "runs/cmp-none/20261122-050826");
    let topk = Spec::new("cmp", "topk")
        .step_s(0.005)
        .write(tmp.path(), "runs/cmp-topk/20261122-050826");
    let mut low = Spec::new("cmp", "qsgd");
    low.evals = vec![(0, 5, 0.9, 0.6, 2.4), (1, 10, 0.8, 0.75, 2.2)];
    let low = low.write(tmp.path(), "runs/cmp-qsgd/20261122-050826");
    let mut o = opts(tmp.path());
    o.target = Some("accuracy=0.8".parse().unwrap());
    let out = report(&[none, topk, low], &o).unwrap();
    let t = |i: usize| out.runs[i].to_target.map(|r| (r.steps, r.time_s));
    let (steps, time) = t(0).unwrap();
    assert!((steps - 25.0 / 3.0).abs() < 1e-9, "{steps}");
    // The first step is timed like the others here: 8.33 steps of 10 ms.
    assert!((time - 0.25 / 3.0).abs() < 1e-9, "{time}");
    assert!((out.runs[1].target_speedup.unwrap() - 2.0).abs() < 1e-9);
    assert_eq!(t(2), None);
    assert!(out
        .markdown
        .contains("## Time to target: test accuracy ≥ 80.00 %"));
    assert!(out.markdown.contains("not reached"));
    check_tables(&out.markdown).unwrap();
    // Without a target there is no such section.
    let plain = report(&[out.runs[0].dir.clone()], &opts(tmp.path())).unwrap();
    assert!(!plain.markdown.contains("Time to target"));
}

/// A run that recorded its provenance has it under its source, and the report's preamble
/// says what the runs were measured at; a run from before provenance was recorded has a
/// bare source line, and the preamble counts it out.
#[test]
fn sources_carry_the_commit_date_and_machine_each_run_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let a = Spec::new("mlp_a", "none").write(tmp.path(), "runs/mlp_a/20261128-122722");
    let b = Spec::new("mlp_b", "topk").write(tmp.path(), "runs/mlp_b/20261128-122801");
    let c = Spec::new("mlp_c", "qsgd").write(tmp.path(), "runs/mlp_c/20261127-090000");
    for (dir, started) in [(&a, "2026-11-28 12:27:22"), (&b, "2026-11-28 12:28:01")] {
        let path = dir.join("summary.json");
        let mut s: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        s["provenance"] = serde_json::json!({
            "commit": "f9b530eca", "profile": "release", "started_utc": started,
            "cpu": "Intel(R) Xeon(R) Processor", "cpu_level": "x86-64-v4", "cpus": 2,
            "a_later_field": true,
        });
        fs::write(&path, serde_json::to_vec(&s).unwrap()).unwrap();
    }
    let out = report(&[a, b, c], &opts(tmp.path())).unwrap();
    let md = &out.markdown;
    assert!(
        md.contains(
            "Measured at commit f9b530eca, started 2026-11-28 12:27:22 – 2026-11-28 12:28:01 \
             UTC, on Intel(R) Xeon(R) Processor, x86-64-v4. (2 of the 3 runs recorded this.)"
        ),
        "{md}"
    );
    assert!(
        md.contains(
            "/runs/mlp_a/20261128-122722` (commit f9b530eca, release, 2026-11-28 12:27:22 UTC, \
             Intel(R) Xeon(R) Processor (x86-64-v4, 2 CPUs))\n"
        ),
        "{md}"
    );
    assert!(md.contains("/runs/mlp_c/20261127-090000`\n"), "{md}");
}

/// A periodic synchronisation sends a round's bytes in one step: the report shows the peak
/// beside the mean, and compute utilisation; and the test loss against the bytes sent
/// before each evaluation is plotted.
#[test]
fn bursts_show_their_peak_and_loss_is_plotted_against_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let every = Spec::new("lm", "none").write(tmp.path(), "lm-every/20261129-100000");
    let bursty = Spec::new("lm", "sparseloco")
        .payload(100, 200)
        .write(tmp.path(), "lm-rounds/20261129-100000");
    // Rounds of 5 steps: 1 000 bytes every fifth step, nothing between.
    edit_steps(&bursty, |step, r| {
        r["bytes_sent"] = serde_json::json!(if step % 5 == 4 { 1000 } else { 0 });
    });
    let out = report(&[every, bursty], &opts(tmp.path())).unwrap();
    let md = &out.markdown;
    assert!(md.contains("## Bytes per step: mean and peak"), "{md}");
    // The rounds' mean of 200 bytes a step against their peak of 1 000, and the every-step
    // run's equal mean and peak; compute is 60 % of each step (Spec's split).
    assert!(
        md.contains("| lm/none P=2 | 4.00 MB | 4.00 MB | 1.00× | 60"),
        "{md}"
    );
    assert!(
        md.contains("| lm/sparseloco P=2 | 200 B | 1.00 kB | 5.00× | 60"),
        "{md}"
    );
    let n = names(&out.files);
    assert!(n.contains(&"loss_vs_bytes.svg".to_owned()), "{n:?}");
    check_plots(&out.files[1..]);
}

#[test]
fn final_accuracy_is_tabled_and_plotted_against_bytes_with_the_frontier() {
    let tmp = tempfile::tempdir().unwrap();
    // (method, final accuracy, bytes sent per step)
    let runs = [
        ("none", 0.90, 4_000_000),
        ("fft", 0.895, 400_000),
        ("topk", 0.88, 400_000),
        ("qsgd", 0.91, 1_000_000),
    ];
    let inputs: Vec<_> = runs
        .iter()
        .map(|&(m, acc, sent)| {
            let mut spec = Spec::new("eq", m).payload(sent - 100, sent);
            spec.evals = vec![(0, 5, 0.9, 0.5, 2.0), (1, 10, 0.5, acc, 1.6)];
            spec.write(tmp.path(), &format!("eq_{m}/20261130-040000"))
        })
        .collect();
    let out = report(&inputs, &opts(tmp.path())).unwrap();
    let md = &out.markdown;
    assert!(md.contains("## Quality against bytes"), "{md}");
    // Fewest bytes first; topk is beaten by fft at the same bytes, none by qsgd at fewer.
    let at = |s: &str| md.find(s).unwrap_or_else(|| panic!("{s:?} not in {md}"));
    assert!(
        at("| eq/fft P=2 | acc 89.50 % | -0.50 | 400 kB | 10.00× | yes |")
            < at("| eq/qsgd P=2 | acc 91.00 % | +1.00 | 1.00 MB | 4.00× | yes |")
    );
    at("| eq/topk P=2 | acc 88.00 % | -2.00 | 400 kB | 10.00× | no |");
    at("| eq/none P=2 | acc 90.00 % | – | 4.00 MB | – | no |");
    let n = names(&out.files);
    assert!(n.contains(&"accuracy_vs_bytes.svg".to_owned()), "{n:?}");
    assert!(n.contains(&"accuracy_vs_bytes.png".to_owned()), "{n:?}");
    assert!(
        !n.iter().any(|f| f.starts_with("perplexity_vs_bytes")),
        "{n:?}"
    );
    // The baseline's level and one point under it are drawn as reference lines.
    let svg = fs::read_to_string(tmp.path().join("out/accuracy_vs_bytes.svg")).unwrap();
    assert!(svg.contains("eq/none P=2 (baseline)"), "{svg}");
    assert!(svg.contains("eq/none P=2 − 1 point"), "{svg}");
    check_plots(&out.files[1..]);

    // One run with an accuracy: nothing to compare, no section and no plot.
    let out = report(&inputs[..1], &opts(&tmp.path().join("one"))).unwrap();
    assert!(!out.markdown.contains("## Quality against bytes"));
    assert!(!names(&out.files)
        .iter()
        .any(|f| f.starts_with("accuracy_vs_bytes")));
}
