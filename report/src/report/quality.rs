//! Quality against bytes: each run's final accuracy (or perplexity) beside the bytes it
//! sent per step — the trade a compression method makes, read the way the seed papers
//! claim it ("no loss of accuracy at N× fewer bytes").
//!
//! [`points`] gives one point per run that has both; [`section`] the report's table (the
//! difference from the run's baseline, how many times fewer bytes it sent, and whether the
//! run is on the frontier: no other run of the same metric is at least as good with at most
//! its bytes); the plots `accuracy_vs_bytes` and `perplexity_vs_bytes` draw the points with
//! the baseline's level (and, for accuracy, one point under it) as reference lines.

use std::fmt::Write as _;

use super::{metric_cell, RunRow};
use crate::md::{self, Table};
use crate::run::FinalMetric;

/// Which final metric a point carries (runs are compared only within one kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Test accuracy, in percent (higher is better).
    Accuracy,
    /// Test perplexity (lower is better).
    Perplexity,
}

impl Kind {
    fn of(m: FinalMetric) -> Option<(Kind, f64)> {
        match m {
            FinalMetric::Accuracy(a) => Some((Kind::Accuracy, 100.0 * a)),
            FinalMetric::Perplexity(p) => Some((Kind::Perplexity, p)),
            FinalMetric::TestLoss(_) | FinalMetric::TrainLoss(_) => None,
        }
    }

    /// Whether `a` is at least as good as `b`.
    fn at_least(self, a: f64, b: f64) -> bool {
        match self {
            Kind::Accuracy => a >= b,
            Kind::Perplexity => a <= b,
        }
    }

    /// The plot's file stem.
    pub(super) fn stem(self) -> &'static str {
        match self {
            Kind::Accuracy => "accuracy_vs_bytes",
            Kind::Perplexity => "perplexity_vs_bytes",
        }
    }

    /// The plot's caption.
    pub(super) fn title(self) -> &'static str {
        match self {
            Kind::Accuracy => "Final test accuracy vs bytes sent",
            Kind::Perplexity => "Final test perplexity vs bytes sent",
        }
    }

    /// The metric's name on an axis.
    pub(super) fn axis(self) -> &'static str {
        match self {
            Kind::Accuracy => "final test accuracy (%)",
            Kind::Perplexity => "final test perplexity",
        }
    }
}

/// One run's final quality against its bytes.
#[derive(Debug, Clone)]
pub(super) struct Point {
    /// The run's index in the report's rows.
    pub row: usize,
    /// Which metric `value` is.
    pub kind: Kind,
    /// Accuracy in percent, or perplexity.
    pub value: f64,
    /// Mean bytes rank 0 sent per step (> 0).
    pub bytes: f64,
    /// The baseline run's point, when the run has a baseline with the same metric.
    pub baseline: Option<usize>,
}

/// A point for every run with a finite accuracy or perplexity and a positive byte count;
/// none unless at least two runs of one kind have one.
pub(super) fn points(rows: &[RunRow]) -> Vec<Point> {
    let mut pts: Vec<Point> = rows
        .iter()
        .enumerate()
        .filter_map(|(row, r)| {
            let (kind, value) = Kind::of(r.final_metric?)?;
            let bytes = r.bytes_sent_per_step;
            (value.is_finite() && bytes.is_finite() && bytes > 0.0).then_some(Point {
                row,
                kind,
                value,
                bytes,
                baseline: None,
            })
        })
        .collect();
    let of_kind = |pts: &[Point], k: Kind| pts.iter().filter(|p| p.kind == k).count();
    let kinds: Vec<Kind> = [Kind::Accuracy, Kind::Perplexity]
        .into_iter()
        .filter(|&k| of_kind(&pts, k) >= 2)
        .collect();
    pts.retain(|p| kinds.contains(&p.kind));
    let found: Vec<Option<usize>> = pts
        .iter()
        .map(|p| {
            let label = rows[p.row].baseline.as_deref()?;
            pts.iter()
                .position(|q| q.kind == p.kind && rows[q.row].label == label)
        })
        .collect();
    for (p, b) in pts.iter_mut().zip(found) {
        p.baseline = b;
    }
    pts
}

/// Whether point `i` is on the frontier of its kind: no other point is at least as good
/// with at most its bytes, and strictly better in one of the two.
fn on_frontier(pts: &[Point], i: usize) -> bool {
    let p = &pts[i];
    !pts.iter().enumerate().any(|(j, q)| {
        j != i
            && q.kind == p.kind
            && q.bytes <= p.bytes
            && p.kind.at_least(q.value, p.value)
            && (q.bytes < p.bytes || q.value != p.value)
    })
}

/// The baseline's level (and, for accuracy, one point under it) for each distinct baseline
/// among `kind`'s points: legend text and y value.
pub(super) fn references(rows: &[RunRow], pts: &[Point], kind: Kind) -> Vec<(String, f64)> {
    let mut bases: Vec<usize> = pts
        .iter()
        .filter(|p| p.kind == kind)
        .filter_map(|p| p.baseline)
        .collect();
    bases.sort_unstable();
    bases.dedup();
    let mut refs = Vec::new();
    for b in bases {
        let (label, v) = (&rows[pts[b].row].label, pts[b].value);
        refs.push((format!("{label} (baseline)"), v));
        if kind == Kind::Accuracy {
            refs.push((format!("{label} − 1 point"), v - 1.0));
        }
    }
    refs
}

/// The report's "Quality against bytes" section, or nothing without points.
pub(super) fn section(rows: &[RunRow], pts: &[Point]) -> String {
    if pts.is_empty() {
        return String::new();
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n## Quality against bytes\n\nFinal test accuracy (or perplexity) against the mean \
         bytes rank 0 sent per step, fewest bytes first. *vs baseline*: accuracy in points \
         (perplexity in %) against the run's baseline; *fewer bytes*: the baseline's bytes ÷ \
         the run's; *frontier*: no other run is at least as good with at most its bytes.\n"
    );
    let mut order: Vec<usize> = (0..pts.len()).collect();
    order.sort_by(|&a, &b| {
        (pts[a].kind as u8)
            .cmp(&(pts[b].kind as u8))
            .then(pts[a].bytes.total_cmp(&pts[b].bytes))
    });
    let mut t = Table::new(&[
        "run",
        "final",
        "vs baseline",
        "sent/step",
        "fewer bytes",
        "frontier",
    ]);
    for i in order {
        let p = &pts[i];
        let base = p.baseline.filter(|&b| b != i).map(|b| &pts[b]);
        let vs = match p.kind {
            Kind::Accuracy => base.map(|b| format!("{:+.2}", p.value - b.value)),
            Kind::Perplexity => {
                base.map(|b| format!("{:+.1} %", 100.0 * (p.value / b.value - 1.0)))
            }
        };
        t.row(&[
            rows[p.row].label.clone(),
            metric_cell(rows[p.row].final_metric),
            vs.unwrap_or_else(|| "–".into()),
            md::bytes(p.bytes),
            base.map_or_else(|| "–".into(), |b| md::factor(b.bytes / p.bytes)),
            if on_frontier(pts, i) { "yes" } else { "no" }.into(),
        ]);
    }
    out.push_str(&t.render());
    out
}
