//! `dtrain report`: markdown tables and plots comparing runs.
//!
//! [`report`] reads the runs under the given paths ([`crate::discover`]), labels them,
//! picks the baseline, and writes into [`ReportOptions::out_dir`]:
//!
//! * `report.md`: the summary table (final metric, wall time, steps, mean step time and its
//!   breakdown, bytes sent per step, compression ratio, throughput, speed-up vs the
//!   baseline), the step-time tail (runs of at least 20 steps), the rank the others waited
//!   for (runs that record it: how often each rank reached the step's barrier last), the
//!   pairwise speed-up matrix, quality against bytes (final accuracy or perplexity, the
//!   difference from the baseline, bytes saved, the frontier; `report/quality.rs`), mean
//!   and peak bytes per step with compute utilisation (when some run sends in bursts: a
//!   peak above 1.5× its mean), and — when the runs differ in worker count — bytes per
//!   worker vs P;
//! * plots, each as `.svg` and `.png`: `loss_vs_time`, `loss_vs_step`,
//!   `accuracy_vs_epoch` (and, for language models, `perplexity_vs_epoch` and — with two
//!   evaluations or more — `perplexity_vs_time`), `loss_vs_bytes` (test loss against the
//!   bytes sent before each evaluation, with two evaluations or more),
//!   `accuracy_vs_bytes` / `perplexity_vs_bytes` (each run's final metric against its mean
//!   bytes per step, the baseline's level as a reference line; two such runs or more),
//!   `step_breakdown`,
//!   `workers_vs_step` (the group's size, when a worker was lost under live membership;
//!   `report.md` lists the changes),
//!   `step_time_cdf` (runs of at least 20 steps: the step-time distribution) and
//!   `bytes_vs_workers` (at least two worker counts).
//!
//! ## Definitions
//! * **Label**: `name/method P=workers`, plus `@bandwidth,latency` when `[network]` shapes
//!   the link; a label that is still not unique gets the run's stamp, then `#k`.
//! * **Final metric**: test accuracy; perplexity for language models (model kind `lstm`);
//!   the test loss when neither was recorded; the training loss without any evaluation.
//! * **Step breakdown** (mean per step, first step excluded as the trainer does): compute
//!   = data + forward + backward + optimizer; compress = compress + decompress;
//!   communicate = time inside collectives, of which *wait* is what the step waited for
//!   (the rest overlapped (de)compression); other = the remainder of the step's wall time.
//! * **Speed-up** of run A vs run B = B's mean step time ÷ A's (> 1: A is faster). The
//!   baseline is the run named by [`ReportOptions::baseline`] (a label, a method or a run
//!   name); without one, the run whose method is `none`. When several runs match, each run
//!   is compared with the match of its own worker count and link, and gets none if that is
//!   not unique.
//! * **Bytes per worker**: mean bytes rank 0 sent per step (transport level, framing
//!   included).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;

use crate::error::{ReportError, Result};
use crate::md::{self, Table};
use crate::run::{load_runs, FinalMetric, Phases, Run};
use crate::target::{Reached, Target};
use dtrain_records::Provenance;

mod plots;
mod quality;
use plots::write_plots;

/// What [`report`] should do.
#[derive(Debug, Clone)]
pub struct ReportOptions {
    /// The baseline run: a label, a method (`none`, `fp16`, …) or a run name. `None`: the
    /// run with method `none`, if there is one (per worker count and link).
    pub baseline: Option<String>,
    /// Where `report.md` and the plots are written (created if missing).
    pub out_dir: PathBuf,
    /// Whether to render plots (SVG + PNG).
    pub plots: bool,
    /// A quality to reach (`--target accuracy=0.7`): the report then gives each run's
    /// training time to it and the speed-up to it against the baseline.
    pub target: Option<Target>,
}

impl ReportOptions {
    /// Default options writing into `out_dir`: baseline `none`, with plots.
    pub fn new(out_dir: impl Into<PathBuf>) -> Self {
        ReportOptions {
            baseline: None,
            out_dir: out_dir.into(),
            plots: true,
            target: None,
        }
    }
}

/// One run's line of the summary table, as numbers.
#[derive(Debug, Clone)]
pub struct RunRow {
    /// The run's unique label.
    pub label: String,
    /// Its directory.
    pub dir: PathBuf,
    /// Compression method.
    pub method: String,
    /// Worker count.
    pub workers: usize,
    /// Whether the run finished (has `summary.json`).
    pub complete: bool,
    /// What shows that it diverged ([`Run::divergence`]), if it did.
    pub divergence: Option<String>,
    /// Restarts of its workers after failures (`dtrain run --max-restarts`).
    pub restarts: usize,
    /// Workers the group lost while the run went on (live membership).
    pub workers_lost: usize,
    /// Final quality metric.
    pub final_metric: Option<FinalMetric>,
    /// Training wall time in seconds.
    pub wall_s: f64,
    /// Steps completed.
    pub steps: u64,
    /// Mean per-phase step times.
    pub mean_step: Phases,
    /// Mean bytes sent per step per worker.
    pub bytes_sent_per_step: f64,
    /// `4·params / payload bytes`.
    pub compression_ratio: Option<f64>,
    /// Examples per second over all workers.
    pub samples_per_s: Option<f64>,
    /// The label of the run this one is compared with.
    pub baseline: Option<String>,
    /// Baseline mean step time ÷ this run's.
    pub speedup: Option<f64>,
    /// Where the run reached [`ReportOptions::target`], if it did.
    pub to_target: Option<Reached>,
    /// The baseline's training time to the target ÷ this run's (both reached it).
    pub target_speedup: Option<f64>,
}

/// What [`report`] produced.
#[derive(Debug, Clone)]
pub struct ReportOutput {
    /// The markdown of `report.md`.
    pub markdown: String,
    /// Every file written: `report.md` first, then the plots (`.svg`, `.png` pairs).
    pub files: Vec<PathBuf>,
    /// The summary table as numbers, one row per run in input order.
    pub runs: Vec<RunRow>,
}

/// Reads the runs under `inputs` and writes the report (see the [module docs](self)).
pub fn report(inputs: &[PathBuf], opts: &ReportOptions) -> Result<ReportOutput> {
    let runs = load_runs(inputs)?;
    report_runs(&runs, opts)
}

/// [`report`] for runs already read.
pub fn report_runs(runs: &[Run], opts: &ReportOptions) -> Result<ReportOutput> {
    if runs.is_empty() {
        return Err(ReportError::NoInput);
    }
    let labels = labels(runs);
    let base = baselines(runs, &labels, opts.baseline.as_deref())?;
    let rows: Vec<RunRow> = runs
        .iter()
        .zip(&labels)
        .zip(&base)
        .map(|((r, label), b)| {
            let mean = r.mean_step();
            let speedup = b.and_then(|b| {
                let t = runs[b].mean_step().step_s;
                (mean.step_s > 0.0 && t > 0.0).then(|| t / mean.step_s)
            });
            let to_target = opts.target.and_then(|t| t.reached(r));
            let target_speedup = match (opts.target, b, to_target) {
                (Some(t), Some(b), Some(mine)) => t
                    .reached(&runs[*b])
                    .filter(|theirs| mine.time_s > 0.0 && theirs.time_s > 0.0)
                    .map(|theirs| theirs.time_s / mine.time_s),
                _ => None,
            };
            RunRow {
                label: label.clone(),
                dir: r.dir.clone(),
                method: r.method.clone(),
                workers: r.workers,
                complete: r.is_complete(),
                divergence: r.divergence(),
                restarts: r.restarts(),
                workers_lost: r.membership().iter().map(|c| c.removed.len()).sum(),
                final_metric: r.final_metric(),
                wall_s: r.wall_s(),
                steps: r.step_count(),
                mean_step: mean,
                bytes_sent_per_step: r.bytes_sent_per_step(),
                compression_ratio: r.compression_ratio(),
                samples_per_s: r.samples_per_s(),
                baseline: b.map(|b| labels[b].clone()),
                speedup,
                to_target,
                target_speedup,
            }
        })
        .collect();

    fs::create_dir_all(&opts.out_dir).map_err(|e| ReportError::io(&opts.out_dir, e))?;
    let quality = quality::points(&rows);
    let plots = if opts.plots {
        write_plots(runs, &rows, &quality, &opts.out_dir)?
    } else {
        Vec::new()
    };
    let markdown = render_markdown(runs, &rows, &quality, &plots, opts.target.as_ref());
    let md_path = opts.out_dir.join("report.md");
    fs::write(&md_path, &markdown).map_err(|e| ReportError::io(&md_path, e))?;
    let mut files = vec![md_path];
    files.extend(plots);
    Ok(ReportOutput {
        markdown,
        files,
        runs: rows,
    })
}

/// Unique labels for `runs` (see the [module docs](self)).
pub fn labels(runs: &[Run]) -> Vec<String> {
    let base: Vec<String> = runs
        .iter()
        .map(|r| {
            let mut l = format!("{} P={}", group_label(r), r.workers);
            if let Some(n) = &r.network {
                let _ = write!(l, " @{}", n.label().replace('/', ","));
            }
            l
        })
        .collect();
    let count = |v: &[String], s: &str| v.iter().filter(|x| *x == s).count();
    let mut out: Vec<String> = base
        .iter()
        .zip(runs)
        .map(|(l, r)| {
            if count(&base, l) > 1 {
                format!("{l} ({})", r.stamp)
            } else {
                l.clone()
            }
        })
        .collect();
    for i in 0..out.len() {
        if out[..i].contains(&out[i]) {
            let mut k = 2;
            while out.contains(&format!("{} #{k}", out[i])) {
                k += 1;
            }
            out[i] = format!("{} #{k}", out[i]);
        }
    }
    out
}

/// `name/method`: the label without worker count and link, grouping a worker sweep.
fn group_label(r: &Run) -> String {
    format!("{}/{}", r.name, r.method)
}

fn link_key(r: &Run) -> String {
    r.network.as_ref().map(|n| n.label()).unwrap_or_default()
}

/// For every run, the index of the run it is compared with (see the [module docs](self)).
pub fn baselines(
    runs: &[Run],
    labels: &[String],
    want: Option<&str>,
) -> Result<Vec<Option<usize>>> {
    let candidates: Vec<usize> = match want {
        Some(w) => {
            let by_label: Vec<usize> = (0..runs.len()).filter(|&i| labels[i] == w).collect();
            if by_label.is_empty() {
                (0..runs.len())
                    .filter(|&i| runs[i].method == w || runs[i].name == w)
                    .collect()
            } else {
                by_label
            }
        }
        None => (0..runs.len())
            .filter(|&i| runs[i].method == dtrain_compress::BASELINE)
            .collect(),
    };
    if candidates.is_empty() {
        return match want {
            Some(w) => Err(ReportError::Baseline(format!(
                "{w:?} matches no run (label, method or name); runs: {}",
                labels.join(", ")
            ))),
            None => Ok(vec![None; runs.len()]),
        };
    }
    Ok(runs
        .iter()
        .map(|r| {
            if let [only] = candidates[..] {
                return Some(only);
            }
            let same: Vec<usize> = candidates
                .iter()
                .copied()
                .filter(|&c| runs[c].workers == r.workers && link_key(&runs[c]) == link_key(r))
                .collect();
            match same[..] {
                [only] => Some(only),
                _ => None,
            }
        })
        .collect())
}

fn metric_cell(m: Option<FinalMetric>) -> String {
    match m {
        Some(FinalMetric::Accuracy(a)) => format!("acc {:.2} %", a * 100.0),
        Some(FinalMetric::Perplexity(p)) => format!("ppl {}", md::sig(p)),
        Some(FinalMetric::TestLoss(l)) => format!("test loss {}", md::sig(l)),
        Some(FinalMetric::TrainLoss(l)) => format!("train loss {}", md::sig(l)),
        None => "–".into(),
    }
}

/// `complete` / `incomplete`, then what shows a divergence and how many restarts there
/// were: `complete, diverged (test loss NaN), 1 restart`.
fn status_cell(row: &RunRow) -> String {
    let mut s = if row.complete {
        "complete"
    } else {
        "incomplete"
    }
    .to_owned();
    if let Some(d) = &row.divergence {
        let _ = write!(s, ", diverged ({d})");
    }
    match row.restarts {
        0 => {}
        1 => s.push_str(", 1 restart"),
        n => {
            let _ = write!(s, ", {n} restarts");
        }
    }
    match row.workers_lost {
        0 => {}
        1 => s.push_str(", 1 worker lost"),
        n => {
            let _ = write!(s, ", {n} workers lost");
        }
    }
    s
}

/// The changes of the group of workers (live membership), when some run had any: who
/// left at which step, who went on, why, and the time each change cost.
fn membership_section(runs: &[Run], rows: &[RunRow]) -> String {
    if runs.iter().all(|r| r.membership().is_empty()) {
        return String::new();
    }
    let mut out = String::from(
        "\n## Membership\n\nWorkers lost while the run went on (`cluster.membership = \"live\"`): \
         the step the others went on from (they ran it again, over the smaller group), the \
         time from the start of the failed step until they were ready to; and newcomers that \
         took a lost worker's place, entering before the step shown, with the time their \
         admission and the state's hand-over took (`workers_vs_step` plots the group's \
         size).\n\n",
    );
    let mut t = Table::new(&[
        "run",
        "step",
        "lost",
        "joined",
        "group",
        "cause",
        "lost s",
        "deadline s",
    ]);
    for i in [0, 2, 3, 4, 5] {
        t = t.align(i, md::Align::Left);
    }
    for (r, row) in runs.iter().zip(rows) {
        for c in r.membership() {
            t.row(&[
                row.label.clone(),
                c.step.to_string(),
                format!("{:?}", c.removed),
                format!("{:?}", c.added),
                format!("{:?}", c.members),
                c.cause.replace('|', "/"),
                md::sig(c.lost_s),
                opt(c.deadline_s, md::sig),
            ]);
        }
    }
    out.push_str(&t.render());
    out
}

fn opt<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
    v.map(f).unwrap_or_else(|| "–".into())
}

fn render_markdown(
    runs: &[Run],
    rows: &[RunRow],
    quality: &[quality::Point],
    plots: &[PathBuf],
    target: Option<&Target>,
) -> String {
    let mut out = String::from("# dtrain report\n\n");
    let _ = writeln!(
        out,
        "{} run(s). Times are means per step (first step excluded); bytes are per worker per \
         step, as sent by rank 0 (framing included). Speed-up = baseline step time ÷ run step \
         time.\n",
        rows.len()
    );
    if let Some(m) = measured(runs) {
        let _ = writeln!(out, "{m}\n");
    }

    let _ = writeln!(out, "## Runs\n");
    let any_link = runs.iter().any(|r| r.network.is_some());
    let mut head = vec!["run", "method", "P"];
    if any_link {
        head.push("link");
    }
    head.extend([
        "status",
        "final metric",
        "wall s",
        "steps",
        "step ms",
        "compute ms",
        "compress ms",
        "communicate ms",
        "wait ms",
        "sync ms",
        "sent/step",
        "compression",
        "samples/s",
        "baseline",
        "speed-up",
    ]);
    let mut t = Table::new(&head);
    for (i, h) in head.iter().enumerate() {
        if ["method", "link", "status", "final metric", "baseline"].contains(h) {
            t = t.align(i, md::Align::Left);
        }
    }
    for (r, row) in runs.iter().zip(rows) {
        let m = &row.mean_step;
        let mut cells = vec![
            row.label.clone(),
            row.method.clone(),
            row.workers.to_string(),
        ];
        if any_link {
            cells.push(
                r.network
                    .as_ref()
                    .map(|n| n.label())
                    .unwrap_or_else(|| "–".into()),
            );
        }
        cells.extend([
            status_cell(row),
            metric_cell(row.final_metric),
            md::sig(row.wall_s),
            row.steps.to_string(),
            md::ms(m.step_s),
            md::ms(m.compute_s()),
            md::ms(m.codec_s()),
            md::ms(m.communicate_s),
            md::ms(m.wait_s),
            md::ms(m.sync_s),
            md::bytes(row.bytes_sent_per_step),
            opt(row.compression_ratio, |c| format!("{}×", md::sig(c))),
            opt(row.samples_per_s, md::sig),
            row.baseline.clone().unwrap_or_else(|| "–".into()),
            opt(row.speedup, md::factor),
        ]);
        t.row(&cells);
    }
    out.push_str(&t.render());
    if let Some(target) = target {
        out.push_str(&target_section(target, rows));
    }
    out.push_str(&quality::section(rows, quality));
    out.push_str(&membership_section(runs, rows));

    // Periodic synchronisation sends in bursts: the link must carry a round's bytes in one
    // step, so the peak matters as much as the mean.
    if runs
        .iter()
        .any(|r| r.peak_bytes_per_step() > 1.5 * r.bytes_sent_per_step())
    {
        let _ = writeln!(
            out,
            "\n## Bytes per step: mean and peak\n\nBytes rank 0 sent per step, on average and \
             in its busiest step, and compute utilisation (compute time ÷ wall time).\n"
        );
        let mut t = Table::new(&[
            "run",
            "mean/step",
            "peak/step",
            "peak ÷ mean",
            "compute utilisation",
        ]);
        for (r, row) in runs.iter().zip(rows) {
            let (mean, peak) = (row.bytes_sent_per_step, r.peak_bytes_per_step());
            t.row(&[
                row.label.clone(),
                md::bytes(mean),
                md::bytes(peak),
                if mean > 0.0 {
                    md::factor(peak / mean)
                } else {
                    "–".into()
                },
                opt(r.compute_utilisation(), |u| fmt_percent(100.0 * u)),
            ]);
        }
        out.push_str(&t.render());
    }

    if runs.iter().any(|r| r.mean_server_s().is_some()) {
        let _ = writeln!(
            out,
            "\n## Parameter server\n\nPer step: time rank 0's co-located server spent \
             aggregating its shard, bytes rank 0 sent and received.\n"
        );
        let mut t = Table::new(&["run", "server aggregate ms", "sent/step", "received/step"]);
        for (r, row) in runs.iter().zip(rows) {
            let recv = if r.steps.is_empty() {
                0.0
            } else {
                r.steps.iter().map(|s| s.bytes_received as f64).sum::<f64>() / r.steps.len() as f64
            };
            t.row(&[
                row.label.clone(),
                r.mean_server_s().map_or_else(|| "–".into(), md::ms),
                md::bytes(row.bytes_sent_per_step),
                md::bytes(recv),
            ]);
        }
        out.push_str(&t.render());
    }

    if runs.iter().any(|r| r.steps.len() >= 20) {
        let lossy = runs.iter().any(|r| r.mean_lossy_dropped().is_some());
        let _ = writeln!(
            out,
            "\n## Step-time tail\n\nWall time per step of rank 0 (first step excluded), \
             nearest-rank quantiles.{}\n",
            if lossy {
                " Dropped = mean fraction of the gradient DLCP's bounded-loss all-reduce \
                 completed without."
            } else {
                ""
            }
        );
        let mut head = vec![
            "run", "steps", "mean ms", "p50 ms", "p95 ms", "p99 ms", "max ms",
        ];
        if lossy {
            head.push("dropped");
        }
        let mut t = Table::new(&head);
        for (r, row) in runs.iter().zip(rows) {
            let q = |x: f64| r.step_quantile(x).map_or_else(|| "–".into(), md::ms);
            let mut cells = vec![
                row.label.clone(),
                r.steps.len().saturating_sub(1).to_string(),
                md::ms(row.mean_step.step_s),
                q(0.5),
                q(0.95),
                q(0.99),
                q(1.0),
            ];
            if lossy {
                cells.push(
                    r.mean_lossy_dropped()
                        .map_or_else(|| "–".into(), |d| format!("{:.3} %", 100.0 * d)),
                );
            }
            t.row(&cells);
        }
        out.push_str(&t.render());
    }

    if runs.iter().any(|r| r.slowest_rank_steps().is_some()) {
        let _ = writeln!(
            out,
            "\n## The rank the others waited for\n\nPer run: the share of steps each rank \
             reached the step's barrier last (even is 1/P each; a rank far above it is a \
             straggler), rank 0's mean wait there (sync) and the slowest rank's mean lead \
             over rank 0.\n"
        );
        let mut t = Table::new(&[
            "run",
            "P",
            "slowest rank: share of steps",
            "sync ms",
            "lead ms",
        ])
        .align(2, md::Align::Left);
        for (r, row) in runs.iter().zip(rows) {
            let Some(counts) = r.slowest_rank_steps() else {
                continue;
            };
            t.row(&[
                row.label.clone(),
                row.workers.to_string(),
                md::rank_shares(&counts).unwrap_or_else(|| "–".into()),
                md::ms(row.mean_step.sync_s),
                r.mean_behind_slowest_s().map_or_else(|| "–".into(), md::ms),
            ]);
        }
        out.push_str(&t.render());
    }

    if rows.len() > 1 {
        let _ = writeln!(
            out,
            "\n## Speed-up of each run vs each peer\n\nCell = the column run's mean step time ÷ \
             the row run's (> 1: the row run is faster).\n"
        );
        let mut head = vec!["run \\ vs".to_owned()];
        head.extend(rows.iter().map(|r| r.label.clone()));
        let mut t = Table::new(&head);
        for a in rows {
            let mut cells = vec![a.label.clone()];
            for b in rows {
                let (ta, tb) = (a.mean_step.step_s, b.mean_step.step_s);
                cells.push(if ta > 0.0 && tb > 0.0 {
                    md::factor(tb / ta)
                } else {
                    "–".into()
                });
            }
            t.row(&cells);
        }
        out.push_str(&t.render());
    }

    let workers: BTreeSet<usize> = runs.iter().map(|r| r.workers).collect();
    if workers.len() > 1 {
        let _ = writeln!(out, "\n## Bytes per worker per step vs P\n");
        let mut head = vec!["run".to_owned()];
        head.extend(workers.iter().map(|p| format!("P={p}")));
        let mut t = Table::new(&head);
        for (g, by_p) in bytes_by_group(runs, rows) {
            let mut cells = vec![g];
            cells.extend(workers.iter().map(|p| {
                by_p.get(p)
                    .map(|b| md::bytes(*b))
                    .unwrap_or_else(|| "–".into())
            }));
            t.row(&cells);
        }
        out.push_str(&t.render());
    }

    if !plots.is_empty() {
        let _ = writeln!(out, "\n## Plots\n");
        for p in plots
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "svg"))
        {
            let file = p
                .file_name()
                .map(|f| f.to_string_lossy())
                .unwrap_or_default();
            let stem = p
                .file_stem()
                .map(|f| f.to_string_lossy())
                .unwrap_or_default();
            let png = file.replace(".svg", ".png");
            let _ = writeln!(
                out,
                "![{}]({file}) ([PNG]({png}))\n",
                stem.replace('_', " ")
            );
        }
    }

    let notes: Vec<String> = runs
        .iter()
        .zip(rows)
        .flat_map(|(r, row)| {
            let mut v: Vec<String> = r.notes.iter().map(|n| format!("{}: {n}", row.label)).collect();
            if !row.complete {
                v.push(format!(
                    "{}: no summary.json (failed or interrupted); figures derived from metrics.jsonl",
                    row.label
                ));
            }
            v
        })
        .collect();
    if !notes.is_empty() {
        let _ = writeln!(out, "\n## Notes\n");
        for n in notes {
            let _ = writeln!(out, "- {n}");
        }
    }
    let _ = writeln!(out, "\n## Sources\n");
    for (run, row) in runs.iter().zip(rows) {
        let _ = write!(out, "- {}: `{}`", row.label, row.dir.display());
        match provenance(run).map(Provenance::line) {
            Some(line) if !line.is_empty() => {
                let _ = writeln!(out, " ({line})");
            }
            _ => out.push('\n'),
        }
    }
    out
}

/// A run's provenance, when its summary recorded one.
fn provenance(run: &Run) -> Option<&Provenance> {
    run.summary.as_ref()?.provenance.as_ref()
}

/// One sentence saying what the runs were measured at: their commits, the span of their
/// start times and their machines (`None` when no run recorded a provenance).
fn measured(runs: &[Run]) -> Option<String> {
    let ps: Vec<&Provenance> = runs.iter().filter_map(provenance).collect();
    if ps.is_empty() {
        return None;
    }
    let distinct = |f: &dyn Fn(&Provenance) -> Option<String>| {
        let mut v: Vec<String> = ps.iter().filter_map(|p| f(p)).collect();
        v.sort();
        v.dedup();
        v
    };
    let commits = distinct(&|p| p.commit.clone());
    let machines = distinct(&|p| {
        let level = p.cpu_level.as_deref().map(|l| format!(", {l}"));
        p.cpu
            .clone()
            .map(|c| format!("{c}{}", level.unwrap_or_default()))
    });
    let starts = distinct(&|p| p.started_utc.clone());
    let mut s = format!(
        "Measured at {}",
        if commits.is_empty() {
            "an unrecorded commit".to_string()
        } else {
            format!("commit {}", commits.join(" / "))
        }
    );
    match (starts.first(), starts.last()) {
        (Some(a), Some(b)) if a == b => {
            let _ = write!(s, ", started {a} UTC");
        }
        (Some(a), Some(b)) => {
            let _ = write!(s, ", started {a} – {b} UTC");
        }
        _ => {}
    }
    if !machines.is_empty() {
        let _ = write!(s, ", on {}", machines.join(" / "));
    }
    s.push('.');
    if ps.len() < runs.len() {
        let _ = write!(
            s,
            " ({} of the {} runs recorded this.)",
            ps.len(),
            runs.len()
        );
    }
    Some(s)
}

/// Bytes sent per step, by group label (`name/method` + link) and worker count.
fn bytes_by_group(runs: &[Run], rows: &[RunRow]) -> BTreeMap<String, BTreeMap<usize, f64>> {
    let mut m: BTreeMap<String, BTreeMap<usize, f64>> = BTreeMap::new();
    for (r, row) in runs.iter().zip(rows) {
        let mut g = group_label(r);
        if let Some(n) = &r.network {
            let _ = write!(g, " @{}", n.label().replace('/', ","));
        }
        m.entry(g)
            .or_default()
            .insert(r.workers, row.bytes_sent_per_step);
    }
    m
}

fn fmt_percent(v: f64) -> String {
    format!("{} %", md::tick(v))
}

/// The "Time to target" section: each run's training time and steps to `target`, and its
/// speed-up to it against the baseline.
fn target_section(target: &Target, rows: &[RunRow]) -> String {
    let mut sec = format!(
        "\n## Time to target: {target}\n\nTraining time (the sum of step times, evaluations \
         excluded) and optimizer steps to the first evaluation that reached it, interpolated \
         linearly from the evaluation before; `≤`: reached at the run's first evaluation. \
         Speed-up = the baseline's time ÷ the run's.\n\n"
    );
    let mut t = Table::new(&["run", "time s", "steps", "baseline", "speed-up"]);
    for row in rows {
        let (time, steps) = match row.to_target {
            Some(r) => {
                let le = if r.first_eval { "≤ " } else { "" };
                (
                    format!("{le}{}", md::sig(r.time_s)),
                    format!("{le}{:.0}", r.steps),
                )
            }
            None => ("not reached".into(), "–".into()),
        };
        t.row(&[
            row.label.clone(),
            time,
            steps,
            row.baseline.clone().unwrap_or_else(|| "–".into()),
            row.target_speedup.map_or_else(|| "–".into(), md::factor),
        ]);
    }
    sec.push_str(&t.render());
    sec
}
