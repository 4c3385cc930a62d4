//! The report's plots ([`write_plots`]): each as `.svg` and `.png`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::{bytes_by_group, fmt_percent, quality, RunRow};
use crate::error::Result;
use crate::md;
use crate::plot::{self, Legend, LinePlot, Scale, Series, StackedBars};
use crate::run::{EvalRecord, Phases, Run, StepRecord};

/// Writes every plot the runs have data for into `dir` (see the [module docs](super)) and
/// returns the files written.
pub(super) fn write_plots(
    runs: &[Run],
    rows: &[RunRow],
    pts: &[quality::Point],
    dir: &Path,
) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let line = |title: &str, x: &str, y: &str, series: Vec<Series>| LinePlot {
        title: title.into(),
        x_label: x.into(),
        y_label: y.into(),
        x_scale: Scale::Linear,
        y_scale: Scale::Linear,
        y_from_zero: false,
        markers: false,
        connect: true,
        references: Vec::new(),
        y_format: md::tick,
        legend: Legend::UpperRight,
        series,
    };
    let nonempty = |s: &[Series]| s.iter().any(|s| !s.points.is_empty());

    let by_time: Vec<Series> = runs
        .iter()
        .zip(rows)
        .map(|(r, row)| {
            let mut t = 0.0;
            let points = r
                .steps
                .iter()
                .filter_map(|s| {
                    t += s.time.step_s;
                    s.loss.map(|l| (t, l))
                })
                .collect();
            Series {
                label: row.label.clone(),
                points,
            }
        })
        .collect();
    if nonempty(&by_time) {
        let p = line(
            "Training loss vs wall time",
            "wall time (s, sum of step times)",
            "loss",
            by_time,
        );
        files.extend(plot::line_plot(dir, "loss_vs_time", &p)?);
    }

    // Step-time distribution (the tail a bounded-loss transport cuts): the empirical CDF of
    // each run's step times, warm-up step excluded.
    if runs.iter().any(|r| r.steps.len() >= 20) {
        let cdf: Vec<Series> = runs
            .iter()
            .zip(rows)
            .map(|(r, row)| {
                let mut t: Vec<f64> = r
                    .steps
                    .iter()
                    .skip(1)
                    .map(|s| s.time.step_s * 1e3)
                    .collect();
                t.sort_by(|a, b| a.total_cmp(b));
                let n = t.len() as f64;
                Series {
                    label: row.label.clone(),
                    points: t
                        .iter()
                        .enumerate()
                        .map(|(i, &ms)| (ms, 100.0 * (i + 1) as f64 / n))
                        .collect(),
                }
            })
            .collect();
        let mut p = line(
            "Step-time distribution",
            "step time (ms)",
            "steps at or below (%)",
            cdf,
        );
        p.y_format = fmt_percent;
        p.legend = Legend::LowerRight;
        files.extend(plot::line_plot(dir, "step_time_cdf", &p)?);
    }

    let by_step: Vec<Series> = runs
        .iter()
        .zip(rows)
        .map(|(r, row)| Series {
            label: row.label.clone(),
            points: r
                .steps
                .iter()
                .filter_map(|s| s.loss.map(|l| (s.step as f64, l)))
                .collect(),
        })
        .collect();
    if nonempty(&by_step) {
        let p = line("Training loss vs step", "step", "loss", by_step);
        files.extend(plot::line_plot(dir, "loss_vs_step", &p)?);
    }

    // Beside the loss curve: the group's size over the same steps (live membership).
    let group: Vec<Series> = runs
        .iter()
        .zip(rows)
        .map(|(r, row)| Series {
            label: row.label.clone(),
            points: r
                .group_size()
                .into_iter()
                .map(|(s, n)| (s as f64, n as f64))
                .collect(),
        })
        .filter(|s| !s.points.is_empty())
        .collect();
    if !group.is_empty() {
        let p = line("Workers in the group vs step", "step", "workers", group);
        files.extend(plot::line_plot(dir, "workers_vs_step", &p)?);
    }

    let eval_series = |f: &dyn Fn(&crate::run::EvalRecord) -> Option<f64>, lm: Option<bool>| {
        runs.iter()
            .zip(rows)
            .filter(|(r, _)| lm.is_none_or(|lm| r.is_language_model() == lm))
            .map(|(r, row)| Series {
                label: row.label.clone(),
                points: r
                    .evals
                    .iter()
                    .filter_map(|e| f(e).map(|v| (e.epoch as f64, v)))
                    .collect(),
            })
            .collect::<Vec<_>>()
    };
    let acc = eval_series(&|e| e.accuracy.map(|a| a * 100.0), None);
    if nonempty(&acc) {
        let mut p = line("Test accuracy vs epoch", "epoch", "accuracy (%)", acc);
        p.markers = true;
        p.y_format = fmt_percent;
        p.legend = Legend::LowerRight;
        files.extend(plot::line_plot(dir, "accuracy_vs_epoch", &p)?);
    }
    let ppl = eval_series(&|e| e.perplexity, Some(true));
    if nonempty(&ppl) {
        let mut p = line("Test perplexity vs epoch", "epoch", "perplexity", ppl);
        p.markers = true;
        files.extend(plot::line_plot(dir, "perplexity_vs_epoch", &p)?);
    }
    // A language model's test perplexity against the training wall time it took to get
    // there (the sum of the step times before the evaluation's step): what "time to a
    // target perplexity" is read off. Points per run: its evaluations
    // (`train.eval_every_steps` gives several within an epoch).
    let ppl_time: Vec<Series> = runs
        .iter()
        .zip(rows)
        .filter(|(r, _)| r.is_language_model())
        .map(|(r, row)| Series {
            label: row.label.clone(),
            points: before_evals(r, |s| s.time.step_s, |e, _| e.perplexity),
        })
        .collect();
    if ppl_time.iter().any(|s| s.points.len() >= 2) {
        let mut p = line(
            "Test perplexity vs wall time",
            "wall time (s, sum of step times)",
            "perplexity",
            ppl_time,
        );
        p.markers = true;
        files.extend(plot::line_plot(dir, "perplexity_vs_time", &p)?);
    }

    // Test loss against the bytes rank 0 had sent before each evaluation: the
    // communication a method spends for its quality (one line per run).
    let loss_bytes: Vec<Series> = runs
        .iter()
        .zip(rows)
        .map(|(r, row)| Series {
            label: row.label.clone(),
            points: before_evals(
                r,
                |s| s.bytes_sent as f64,
                |e, sent| e.loss.filter(|l| l.is_finite() && sent > 0.0),
            ),
        })
        .collect();
    if loss_bytes.iter().any(|s| s.points.len() >= 2) {
        let p = LinePlot {
            x_scale: Scale::Log10,
            markers: true,
            ..line(
                "Test loss vs bytes sent",
                "bytes sent by rank 0 (cumulative)",
                "test loss",
                loss_bytes,
            )
        };
        files.extend(plot::line_plot(dir, "loss_vs_bytes", &p)?);
    }

    // Final quality against bytes per step: one point per run, the baseline's level (and,
    // for accuracy, one point under it) as dashed lines.
    for kind in [quality::Kind::Accuracy, quality::Kind::Perplexity] {
        let series: Vec<Series> = pts
            .iter()
            .filter(|p| p.kind == kind)
            .map(|p| Series {
                label: rows[p.row].label.clone(),
                points: vec![(p.bytes, p.value)],
            })
            .collect();
        if series.is_empty() {
            continue;
        }
        let mut p = LinePlot {
            x_scale: Scale::Log10,
            connect: false,
            references: quality::references(rows, pts, kind),
            ..line(
                kind.title(),
                "bytes sent per step by rank 0 (mean)",
                kind.axis(),
                series,
            )
        };
        if kind == quality::Kind::Accuracy {
            p.y_format = fmt_percent;
        }
        files.extend(plot::line_plot(dir, kind.stem(), &p)?);
    }

    let ms = |f: fn(&Phases) -> f64| {
        rows.iter()
            .map(|r| f(&r.mean_step) * 1e3)
            .collect::<Vec<_>>()
    };
    let bars = StackedBars {
        title: "Mean step time breakdown".into(),
        x_label: "ms per step".into(),
        categories: rows.iter().map(|r| r.label.clone()).collect(),
        segments: vec![
            ("compute".into(), ms(Phases::compute_s)),
            ("compress + decompress".into(), ms(Phases::codec_s)),
            ("communicate (waited)".into(), ms(|p| p.wait_s)),
            ("waiting for the slowest rank".into(), ms(|p| p.sync_s)),
            ("other".into(), ms(Phases::other_s)),
        ],
    };
    files.extend(plot::stacked_bars(dir, "step_breakdown", &bars)?);

    let workers: BTreeSet<usize> = runs.iter().map(|r| r.workers).collect();
    if workers.len() > 1 {
        let series = bytes_by_group(runs, rows)
            .into_iter()
            .map(|(g, by_p)| Series {
                label: g,
                points: by_p.into_iter().map(|(p, b)| (p as f64, b)).collect(),
            })
            .collect();
        let p = LinePlot {
            x_scale: Scale::Log2,
            y_scale: Scale::Log10,
            markers: true,
            y_format: md::bytes,
            legend: Legend::UpperLeft,
            ..line(
                "Bytes sent per worker per step vs workers",
                "workers (P)",
                "bytes / step",
                series,
            )
        };
        files.extend(plot::line_plot(dir, "bytes_vs_workers", &p)?);
    }
    Ok(files)
}

/// One point per evaluation of `run` that `y` gives a value for: `x` summed over the steps
/// before the evaluation's step (both lists are ordered by step, so one walk), and
/// `y(evaluation, that sum)`.
fn before_evals(
    run: &Run,
    x: impl Fn(&StepRecord) -> f64,
    y: impl Fn(&EvalRecord, f64) -> Option<f64>,
) -> Vec<(f64, f64)> {
    let (mut sum, mut next) = (0.0, run.steps.iter().peekable());
    run.evals
        .iter()
        .filter_map(|e| {
            while let Some(s) = next.next_if(|s| s.step < e.step) {
                sum += x(s);
            }
            y(e, sum).map(|v| (sum, v))
        })
        .collect()
}
