//! Reading run directories written by the trainer.
//!
//! A run directory `runs/<name>/<UTC stamp>/` holds `config.toml` (the resolved config),
//! `metrics.jsonl` (one record per step), `eval.jsonl` (one record per evaluation) and,
//! once the run finished, `summary.json`. The readers here are lenient where the trainer
//! may legitimately differ and strict where the data would be wrong:
//!
//! * unknown fields are ignored everywhere (newer trainers may add some);
//! * a run without `summary.json` (failed or interrupted) is read from `metrics.jsonl` and
//!   marked incomplete ([`Run::is_complete`]);
//! * a resumed run appends to `metrics.jsonl` / `eval.jsonl`, repeating the steps after the
//!   checkpoint: the **last** record of each step is kept;
//! * a last line without its newline that does not parse (a write cut short by a crash) is
//!   dropped with a note ([`Run::notes`]); any other malformed line is an error naming
//!   `file:line`;
//! * `null` numbers (how JSON writes a non-finite loss) read as missing.
//!
//! [`discover`] turns the paths given on the command line into run directories: a run
//! directory itself, a `runs/<name>/` parent of timestamped runs (the newest is taken),
//! or any directory holding run directories further down (all are taken).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use dtrain_comms::shaping::LinkSpec;
use dtrain_compress::{Collective, CompressorConfig};
pub use dtrain_records::{EvalRecord, Phases, StepRecord, Summary};
use serde::Deserialize;

use crate::error::{ReportError, Result};

/// The emulated link of a run (`[network]`).
#[derive(Debug, Clone, PartialEq)]
pub struct Network {
    /// `bandwidth` as written (`"1Gbit"`).
    pub bandwidth: Option<String>,
    /// `latency` as written (`"100us"`).
    pub latency: Option<String>,
    /// Both, parsed.
    pub link: LinkSpec,
}

impl Network {
    /// `1Gbit/100us`, `1Gbit`, or `100us`.
    pub fn label(&self) -> String {
        match (&self.bandwidth, &self.latency) {
            (Some(b), Some(l)) => format!("{b}/{l}"),
            (Some(b), None) => b.clone(),
            (None, Some(l)) => l.clone(),
            (None, None) => String::new(),
        }
    }
}

/// The headline quality metric of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FinalMetric {
    /// Test accuracy in `[0, 1]` (classification models).
    Accuracy(f64),
    /// Test perplexity (language models: model kind `lstm`).
    Perplexity(f64),
    /// Test loss (no accuracy / perplexity recorded).
    TestLoss(f64),
    /// Training loss (no evaluation at all).
    TrainLoss(f64),
}

/// One run, read from its directory.
#[derive(Debug, Clone)]
pub struct Run {
    /// The run directory.
    pub dir: PathBuf,
    /// Its last path component (the UTC stamp for trainer-written runs).
    pub stamp: String,
    /// Run name (`summary.json`, else `config.toml`, else the parent directory's name).
    pub name: String,
    /// Model kind (`mlp`, `lstm`, …); empty when unknown.
    pub model: String,
    /// Compression kind (`none`, `fft`, `topk`, …); `none` when unknown.
    pub method: String,
    /// Worker count (1 when unknown).
    pub workers: usize,
    /// `[network]`, when it shapes the link.
    pub network: Option<Network>,
    /// `[compress] bucket_mb` in bytes, when set.
    pub bucket_bytes: Option<f64>,
    /// The `[compress]` table as written (method options such as random-k's `shared`).
    pub compress: toml::Table,
    /// Per-worker batch size (`[data] batch_size`), when known.
    pub batch_size: Option<u64>,
    /// `summary.json`, when the run finished.
    pub summary: Option<Summary>,
    /// The collective that carried the compressed buckets: `summary.json`'s record, else
    /// (runs written before it was recorded, or unfinished runs) derived from the run's
    /// `[compress]` table through the method registry, with a note; `None` when neither
    /// tells (an unknown method or collective name, also noted).
    pub collective: Option<Collective>,
    /// Step records, one per step (the last written), ordered by step.
    pub steps: Vec<StepRecord>,
    /// Evaluations, one per step (the last written), ordered by step.
    pub evals: Vec<EvalRecord>,
    /// Things worth telling the reader (duplicate steps dropped, a cut last line, …).
    pub notes: Vec<String>,
}

const METRICS: &str = "metrics.jsonl";
const EVAL: &str = "eval.jsonl";
const SUMMARY: &str = "summary.json";
const CONFIG: &str = "config.toml";

/// Whether `dir` is a run directory (holds `metrics.jsonl` or `summary.json`).
pub fn is_run_dir(dir: &Path) -> bool {
    dir.join(METRICS).is_file() || dir.join(SUMMARY).is_file()
}

/// Sort key of a trainer stamp `YYYYMMDD-HHMMSS` or `YYYYMMDD-HHMMSS-k` (a second run in the
/// same second); `None` for other names.
fn stamp_key(name: &str) -> Option<(u64, u64, u64)> {
    let mut parts = name.split('-');
    let (d, t) = (parts.next()?, parts.next()?);
    let k = match parts.next() {
        Some(k) => k.parse().ok()?,
        None => 0,
    };
    if parts.next().is_some() || d.len() != 8 || t.len() != 6 {
        return None;
    }
    Some((d.parse().ok()?, t.parse().ok()?, k))
}

fn sorted_subdirs(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).map_err(|e| ReportError::io(dir, e))? {
        let e = e.map_err(|e| ReportError::io(dir, e))?;
        let p = e.path();
        if p.is_dir() && e.file_name() != "checkpoints" {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

/// Expands `dir` (not itself a run directory) into run directories, `depth` levels down.
fn expand(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut newest: Option<((u64, u64, u64), PathBuf)> = None;
    for sub in sorted_subdirs(dir)? {
        if is_run_dir(&sub) {
            let name = sub.file_name().and_then(|n| n.to_str()).unwrap_or("");
            match stamp_key(name) {
                // Timestamped runs of one name: only the newest counts.
                Some(k) if newest.as_ref().is_none_or(|(nk, _)| k > *nk) => newest = Some((k, sub)),
                Some(_) => {}
                None => out.push(sub),
            }
        } else if depth > 0 {
            expand(&sub, depth - 1, out)?;
        }
    }
    out.extend(newest.map(|(_, p)| p));
    Ok(())
}

/// Resolves the paths given on the command line into run directories (or `summary.json`
/// files), in a stable order without repeats:
///
/// * a run directory (holding `metrics.jsonl` or `summary.json`) is taken as is;
/// * a run's `metrics.jsonl`, `eval.jsonl` or `config.toml` stands for its directory;
/// * another file is taken as a run's summary (its directory is read with it when the file
///   is named `summary.json`);
/// * another directory is searched (up to four levels) for run directories: among
///   sibling runs named by the trainer's UTC stamp only the newest is taken (so
///   `runs/<name>/` means that name's latest run), other run directories are all taken.
pub fn discover(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    if inputs.is_empty() {
        return Err(ReportError::NoInput);
    }
    let mut out: Vec<PathBuf> = Vec::new();
    for input in inputs {
        let meta = fs::metadata(input).map_err(|e| ReportError::io(input, e))?;
        let mut found = Vec::new();
        let run_file = input
            .file_name()
            .is_some_and(|n| [METRICS, EVAL, CONFIG].iter().any(|f| n == *f));
        if meta.is_file() && run_file {
            // One of a run's own files: the run is its directory.
            let dir = input.parent().map(Path::to_path_buf).unwrap_or_default();
            found.push(if dir.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                dir
            });
        } else if meta.is_file() || is_run_dir(input) {
            found.push(input.clone());
        } else {
            expand(input, 3, &mut found)?;
            found.sort();
        }
        if found.is_empty() {
            return Err(ReportError::NoRun {
                path: input.clone(),
            });
        }
        for f in found {
            if !out.contains(&f) {
                out.push(f);
            }
        }
    }
    Ok(out)
}

/// Reads every run that [`discover`] finds under `inputs`.
pub fn load_runs(inputs: &[PathBuf]) -> Result<Vec<Run>> {
    discover(inputs)?.iter().map(|p| Run::load(p)).collect()
}

fn read_text(path: &Path) -> Result<Option<String>> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ReportError::io(path, e)),
    }
}

/// serde_json reports positions within the one line it was given: keep the column only.
fn json_message(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => format!("{} (column {})", &s[..i], e.column()),
        None => s,
    }
}

/// Parses a JSON Lines file; returns the records and a note when a cut-short last line
/// was dropped.
fn read_jsonl<T: serde::de::DeserializeOwned>(
    path: &Path,
    text: &str,
) -> Result<(Vec<T>, Option<String>)> {
    let mut out = Vec::new();
    let lines: Vec<&str> = text.split('\n').collect();
    let last = lines.len();
    for (i, line) in lines.iter().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        match serde_json::from_str::<T>(line) {
            Ok(r) => out.push(r),
            // The final piece of a file that does not end in '\n' is a line whose write
            // was interrupted.
            Err(e) if i + 1 == last && e.is_eof() => {
                let note = format!("{}:{}: incomplete last line ignored", path.display(), i + 1);
                return Ok((out, Some(note)));
            }
            Err(e) => return Err(ReportError::format(path, Some(i + 1), json_message(&e))),
        }
    }
    Ok((out, None))
}

fn toml_line(text: &str, e: &toml::de::Error) -> Option<usize> {
    e.span()
        .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1)
}

/// What the report needs from `config.toml`.
#[derive(Debug, Default)]
struct ConfigInfo {
    name: Option<String>,
    model: Option<String>,
    method: Option<String>,
    workers: Option<usize>,
    batch_size: Option<u64>,
    bandwidth: Option<String>,
    latency: Option<String>,
    bucket_mb: Option<f64>,
    compress: toml::Table,
    parameter_server: bool,
}

/// The collective of the compressed buckets: `summary.json`'s record when it has one;
/// else derived from the `[compress]` table through the method registry (what the trainer
/// of that run would have used), with a note saying so.
fn recorded_collective(
    summary: Option<&Summary>,
    config: &ConfigInfo,
    notes: &mut Vec<String>,
) -> Option<Collective> {
    if let Some(name) = summary.and_then(|s| s.collective.as_deref()) {
        return match serde_json::from_value(serde_json::Value::String(name.to_owned())) {
            Ok(c) => Some(c),
            Err(_) => {
                notes.push(format!(
                    "summary.json names collective {name:?}, which this version does not \
                     know: modelled as an all-gather"
                ));
                None
            }
        };
    }
    let derived = derive_collective(&config.compress, config.parameter_server);
    match derived {
        Some(c) => notes.push(format!(
            "the collective is not recorded (a run written before summary.json recorded \
             it, or an unfinished one): {c}, derived from its [compress] table"
        )),
        None => notes.push(
            "the collective is not recorded and the [compress] table names no registered \
             method: modelled as an all-gather"
                .to_owned(),
        ),
    }
    derived
}

/// The collective a run with this `[compress]` table (and `mode = "ps"` or not) used, by
/// the registry's rule ([`CompressorConfig::collective`]). The table also holds the
/// trainer's keys (bucket sizes, memory, collective); only the keys the method accepts are
/// passed to it. `None` when `kind` names no registered method.
pub(crate) fn derive_collective(
    compress: &toml::Table,
    parameter_server: bool,
) -> Option<Collective> {
    let kind = compress.get("kind")?.clone();
    let with = |extra: &[(&String, &toml::Value)]| {
        let mut t = toml::Table::new();
        t.insert("kind".into(), kind.clone());
        for (k, v) in extra {
            t.insert((*k).clone(), (*v).clone());
        }
        CompressorConfig::deserialize(toml::Value::Table(t)).ok()
    };
    with(&[])?;
    let own: Vec<_> = compress
        .iter()
        .filter(|(k, v)| k.as_str() != "kind" && with(&[(k, v)]).is_some())
        .collect();
    let method = with(&own)?;
    let requested = match compress.get("collective").and_then(|v| v.as_str()) {
        Some("sparse-allreduce") => Collective::SparseAllReduce,
        Some("compressed-allreduce") => Collective::CompressedAllReduce,
        Some("dlcp") => Collective::Dlcp,
        _ => Collective::AllGather,
    };
    method
        .collective(if parameter_server {
            Collective::ParameterServer
        } else {
            requested
        })
        .ok()
}

fn read_config(path: &Path) -> Result<Option<ConfigInfo>> {
    let Some(text) = read_text(path)? else {
        return Ok(None);
    };
    let table: toml::Table = toml::from_str(&text)
        .map_err(|e| ReportError::format(path, toml_line(&text, &e), e.message().trim()))?;
    let section = |k: &str| table.get(k).and_then(|v| v.as_table());
    let str_in = |sec: &str, k: &str| {
        section(sec)
            .and_then(|t| t.get(k))
            .and_then(|v| v.as_str())
            .map(str::to_owned)
    };
    let int_in = |sec: &str, k: &str| {
        section(sec)
            .and_then(|t| t.get(k))
            .and_then(|v| v.as_integer())
    };
    let bad = |field: &str, why: &str| ReportError::format(path, None, format!("{field}: {why}"));
    let workers = match int_in("cluster", "workers") {
        Some(w) if w >= 1 => Some(w as usize),
        Some(_) => return Err(bad("cluster.workers", "must be at least 1")),
        None => None,
    };
    let bucket_mb = section("compress")
        .and_then(|t| t.get("bucket_mb"))
        .and_then(|v| v.as_float().or_else(|| v.as_integer().map(|i| i as f64)));
    Ok(Some(ConfigInfo {
        name: table
            .get("name")
            .and_then(|v| v.as_str())
            .map(str::to_owned),
        model: str_in("model", "kind"),
        method: str_in("compress", "kind"),
        workers,
        batch_size: int_in("data", "batch_size").and_then(|b| u64::try_from(b).ok()),
        bandwidth: str_in("network", "bandwidth"),
        latency: str_in("network", "latency"),
        bucket_mb,
        compress: section("compress").cloned().unwrap_or_default(),
        parameter_server: str_in("cluster", "mode").as_deref() == Some("ps"),
    }))
}

fn read_summary(path: &Path) -> Result<Option<Summary>> {
    let Some(text) = read_text(path)? else {
        return Ok(None);
    };
    serde_json::from_str(&text).map(Some).map_err(|e| {
        ReportError::format(path, Some(e.line()), {
            let s = e.to_string();
            match s.rfind(" at line ") {
                Some(i) => s[..i].to_owned(),
                None => s,
            }
        })
    })
}

impl Run {
    /// Reads a run from its directory, or from a summary file (see [`discover`]).
    pub fn load(path: &Path) -> Result<Run> {
        let (dir, summary_path) = if path.is_file() {
            let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
            (dir, path.to_path_buf())
        } else {
            (path.to_path_buf(), path.join(SUMMARY))
        };
        // Sibling files belong to this run only when the summary is the run's own.
        let with_dir = !path.is_file() || path.file_name().is_some_and(|n| n == SUMMARY);
        let summary = read_summary(&summary_path)?;
        let (config, metrics_text, eval_text) = if with_dir {
            (
                read_config(&dir.join(CONFIG))?,
                read_text(&dir.join(METRICS))?,
                read_text(&dir.join(EVAL))?,
            )
        } else {
            (None, None, None)
        };
        if summary.is_none() && metrics_text.is_none() {
            return Err(ReportError::NoRun {
                path: path.to_path_buf(),
            });
        }
        let config = config.unwrap_or_default();
        let mut notes = Vec::new();

        let mut steps = BTreeMap::new();
        let mut repeated = 0usize;
        if let Some(text) = &metrics_text {
            let (recs, note) = read_jsonl::<StepRecord>(&dir.join(METRICS), text)?;
            notes.extend(note);
            for r in recs {
                if steps.insert(r.step, r).is_some() {
                    repeated += 1;
                }
            }
        }
        if repeated > 0 {
            notes.push(format!(
                "{METRICS}: {repeated} repeated step record(s) (resumed run): the last of each kept"
            ));
        }
        let mut evals = BTreeMap::new();
        if let Some(text) = &eval_text {
            let (recs, note) = read_jsonl::<EvalRecord>(&dir.join(EVAL), text)?;
            notes.extend(note);
            for r in recs {
                evals.insert(r.step, r);
            }
        }

        let s = summary.as_ref();
        let collective = recorded_collective(s, &config, &mut notes);
        let stamp = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let name = s
            .and_then(|s| s.name.clone())
            .or(config.name)
            .or_else(|| {
                dir.parent()
                    .and_then(|p| p.file_name())
                    .map(|n| n.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| stamp.clone());
        let network = if config.bandwidth.is_some() || config.latency.is_some() {
            let link = LinkSpec::parse(config.bandwidth.as_deref(), config.latency.as_deref())
                .map_err(|m| {
                    ReportError::format(dir.join(CONFIG), None, format!("network: {m}"))
                })?;
            Some(Network {
                bandwidth: config.bandwidth,
                latency: config.latency,
                link,
            })
        } else {
            None
        };
        Ok(Run {
            stamp,
            name,
            collective,
            model: s
                .and_then(|s| s.model.clone())
                .or(config.model)
                .unwrap_or_default(),
            method: s
                .and_then(|s| s.method.clone())
                .or(config.method)
                .unwrap_or_else(|| dtrain_compress::BASELINE.into()),
            workers: s
                .and_then(|s| s.workers)
                .or(config.workers)
                .unwrap_or(1)
                .max(1),
            network,
            bucket_bytes: config.bucket_mb.map(|mb| mb * (1u64 << 20) as f64),
            compress: config.compress,
            batch_size: config.batch_size,
            summary,
            steps: steps.into_values().collect(),
            evals: evals.into_values().collect(),
            notes,
            dir,
        })
    }

    /// Whether the run finished (wrote `summary.json`).
    pub fn is_complete(&self) -> bool {
        self.summary.is_some()
    }

    /// What shows that the run diverged: its final test loss or final training loss when
    /// that is not finite (`"test loss NaN"`), else `None`.
    pub fn divergence(&self) -> Option<String> {
        let bad = |x: Option<f64>| x.filter(|v| !v.is_finite());
        bad(self.final_eval().and_then(|e| e.loss))
            .map(|l| format!("test loss {}", crate::md::sig(l)))
            .or_else(|| {
                bad(self.final_train_loss()).map(|l| format!("train loss {}", crate::md::sig(l)))
            })
    }

    /// How often `dtrain run --max-restarts` restarted the workers (`summary.json`).
    pub fn restarts(&self) -> usize {
        self.summary
            .as_ref()
            .and_then(|s| s.restarts.as_ref())
            .map_or(0, Vec::len)
    }

    /// The changes of the group of workers under live membership (`summary.json`'s
    /// `membership`; empty when it never changed).
    pub fn membership(&self) -> &[dtrain_records::MembershipChange] {
        self.summary
            .as_ref()
            .and_then(|s| s.membership.as_deref())
            .unwrap_or(&[])
    }

    /// The group's size over the run as `(step, workers)` points of a step function: the
    /// configured workers from step 0, one point before and one after each change (at the
    /// step the group went on from), and the last step's size. Empty when the group never
    /// changed.
    pub fn group_size(&self) -> Vec<(u64, usize)> {
        let changes = self.membership();
        if changes.is_empty() {
            return Vec::new();
        }
        let mut n = self.workers;
        let mut out = vec![(0, n)];
        for c in changes {
            out.push((c.step, n));
            n = c.members.len();
            out.push((c.step, n));
        }
        let last = self.steps.last().map_or(0, |s| s.step);
        out.push((last.max(out.last().map_or(0, |p| p.0)), n));
        out
    }

    /// Whether the model is a language model (perplexity is its metric): kind `lstm` or
    /// `gpt`.
    pub fn is_language_model(&self) -> bool {
        ["lstm", "gpt"]
            .iter()
            .any(|k| self.model.eq_ignore_ascii_case(k))
    }

    /// The step records timing statistics use: all but the first (warm-up) one, unless it is
    /// the only one.
    pub fn timed_steps(&self) -> &[StepRecord] {
        if self.steps.len() > 1 {
            &self.steps[1..]
        } else {
            &self.steps
        }
    }

    /// Mean per-phase times per step: the summary's, else the mean of the step records
    /// without the first (warm-up) one, as the trainer computes it.
    pub fn mean_step(&self) -> Phases {
        if let Some(m) = self.summary.as_ref().and_then(|s| s.mean_step) {
            return m;
        }
        let recs = self.timed_steps();
        let mut p = Phases::default();
        for r in recs {
            p.add(&r.time);
        }
        if !recs.is_empty() {
            p = p.scaled(1.0 / recs.len() as f64);
        }
        p
    }

    /// The `q`-quantile (0..=1, nearest rank) of the step wall times in seconds, first
    /// (warm-up) step excluded; `None` without step records.
    pub fn step_quantile(&self, q: f64) -> Option<f64> {
        let mut t: Vec<f64> = self.timed_steps().iter().map(|r| r.time.step_s).collect();
        if t.is_empty() {
            return None;
        }
        t.sort_by(|a, b| a.total_cmp(b));
        let i = ((q.clamp(0.0, 1.0) * t.len() as f64).ceil() as usize).clamp(1, t.len()) - 1;
        Some(t[i])
    }

    /// Mean seconds per step rank 0's parameter server spent aggregating (steps that report
    /// it, the warm-up step excluded).
    pub fn mean_server_s(&self) -> Option<f64> {
        mean_where(self.timed_steps(), |r| r.server_s)
    }

    /// Per rank, the steps it was the slowest to reach the step's barrier: `summary.json`'s
    /// count for the whole run, else counted from the step records; `None` when the run
    /// does not say (one worker, asynchronous PS, or a trainer before this was recorded).
    pub fn slowest_rank_steps(&self) -> Option<Vec<u64>> {
        if let Some(v) = self
            .summary
            .as_ref()
            .and_then(|s| s.slowest_rank_steps.clone())
            .filter(|v| v.iter().any(|&n| n > 0))
        {
            return Some(v);
        }
        let mut v = vec![0u64; self.workers.max(1)];
        for r in self.steps.iter().filter_map(|s| s.slowest_rank) {
            if r >= v.len() {
                v.resize(r + 1, 0);
            }
            v[r] += 1;
        }
        v.iter().any(|&n| n > 0).then_some(v)
    }

    /// Mean lead of the slowest rank over rank 0 per step (steps that report it, the
    /// warm-up step excluded).
    pub fn mean_behind_slowest_s(&self) -> Option<f64> {
        mean_where(self.timed_steps(), |r| r.behind_slowest_s)
    }

    /// Mean of the DLCP dropped fraction over the steps that report one.
    pub fn mean_lossy_dropped(&self) -> Option<f64> {
        mean_where(&self.steps, |r| r.lossy_dropped)
    }

    fn mean_of(&self, f: impl Fn(&StepRecord) -> f64) -> f64 {
        if self.steps.is_empty() {
            0.0
        } else {
            self.steps.iter().map(f).sum::<f64>() / self.steps.len() as f64
        }
    }

    /// Mean bytes rank 0 sent per step.
    pub fn bytes_sent_per_step(&self) -> f64 {
        self.summary
            .as_ref()
            .and_then(|s| s.bytes_sent_per_step)
            .unwrap_or_else(|| self.mean_of(|r| r.bytes_sent as f64))
    }

    /// The most bytes rank 0 sent in one step (the step records, and `summary.json`'s
    /// `bytes_sent_peak` where a resumed run's earlier session is not in them): a periodic
    /// synchronisation's round, where the mean spreads it over the rounds' steps.
    pub fn peak_bytes_per_step(&self) -> f64 {
        let steps = self
            .steps
            .iter()
            .map(|s| s.bytes_sent as f64)
            .fold(0.0, f64::max);
        let summary = self.summary.as_ref().and_then(|s| s.bytes_sent_peak);
        summary.map_or(steps, |p| steps.max(p as f64))
    }

    /// Compute utilisation: the time rank 0 spent computing (data, forward, backward,
    /// optimizer) over the sum of its step times; `None` without steps.
    pub fn compute_utilisation(&self) -> Option<f64> {
        let wall: f64 = self.steps.iter().map(|s| s.time.step_s).sum();
        (wall > 0.0).then(|| self.steps.iter().map(|s| s.time.compute_s()).sum::<f64>() / wall)
    }

    /// Mean bytes rank 0 received per step (from the step records).
    pub fn bytes_received_per_step(&self) -> f64 {
        self.mean_of(|r| r.bytes_received as f64)
    }

    /// Mean payload bytes of rank 0 per step.
    pub fn payload_bytes_per_step(&self) -> f64 {
        self.summary
            .as_ref()
            .and_then(|s| s.payload_bytes_per_step)
            .unwrap_or_else(|| self.mean_of(|r| r.payload_bytes as f64))
    }

    /// Model parameters (from the summary only).
    pub fn params(&self) -> Option<u64> {
        self.summary.as_ref().and_then(|s| s.params)
    }

    /// `4·params / payload bytes per step` (from the summary only).
    pub fn compression_ratio(&self) -> Option<f64> {
        self.summary
            .as_ref()
            .and_then(|s| s.compression_ratio)
            .filter(|r| r.is_finite())
    }

    /// Examples per second over all workers: the summary's, else the step records' total
    /// examples over their total step time.
    pub fn samples_per_s(&self) -> Option<f64> {
        if let Some(v) = self.summary.as_ref().and_then(|s| s.samples_per_s) {
            return Some(v);
        }
        let t: f64 = self.steps.iter().map(|r| r.time.step_s).sum();
        let n: u64 = self.steps.iter().map(|r| r.samples).sum();
        (t > 0.0).then(|| n as f64 / t)
    }

    /// Training wall time in seconds: the summary's when the run was not resumed (the
    /// summary times only the last session), else the sum of the kept steps' `step_s`.
    pub fn wall_s(&self) -> f64 {
        match &self.summary {
            Some(Summary {
                wall_s: Some(w),
                resumed_from,
                ..
            }) if resumed_from.unwrap_or(0) == 0 => *w,
            _ => self.steps.iter().map(|r| r.time.step_s).sum(),
        }
    }

    /// Steps completed: the summary's count, else the step records'.
    pub fn step_count(&self) -> u64 {
        self.summary
            .as_ref()
            .and_then(|s| s.steps)
            .unwrap_or(self.steps.len() as u64)
    }

    /// The last evaluation: the summary's `final_eval`, else the last line of `eval.jsonl`.
    pub fn final_eval(&self) -> Option<&EvalRecord> {
        self.summary
            .as_ref()
            .and_then(|s| s.final_eval.as_ref())
            .or(self.evals.last())
    }

    /// The final training loss: the summary's (mean of the last epoch), else the last
    /// finite step loss.
    pub fn final_train_loss(&self) -> Option<f64> {
        self.summary
            .as_ref()
            .and_then(|s| s.final_train_loss)
            .or_else(|| self.steps.iter().rev().find_map(|r| r.loss))
    }

    /// The headline metric: perplexity for language models, accuracy otherwise, falling
    /// back to the test loss and then the training loss.
    pub fn final_metric(&self) -> Option<FinalMetric> {
        let ev = self.final_eval();
        let preferred = if self.is_language_model() {
            ev.and_then(|e| e.perplexity)
                .or_else(|| ev.and_then(|e| e.loss).map(f64::exp))
                .map(FinalMetric::Perplexity)
        } else {
            ev.and_then(|e| e.accuracy).map(FinalMetric::Accuracy)
        };
        preferred
            .or_else(|| ev.and_then(|e| e.loss).map(FinalMetric::TestLoss))
            .or_else(|| self.final_train_loss().map(FinalMetric::TrainLoss))
    }
}

/// Mean of `f` over the records that have a value; `None` when none has.
fn mean_where(recs: &[StepRecord], f: impl Fn(&StepRecord) -> Option<f64>) -> Option<f64> {
    let (sum, n) = recs
        .iter()
        .filter_map(f)
        .fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_sort_with_suffix() {
        assert_eq!(stamp_key("20261122-050826"), Some((20261122, 50826, 0)));
        assert_eq!(stamp_key("20261122-050826-2"), Some((20261122, 50826, 2)));
        assert!(stamp_key("20261122-050826-2") > stamp_key("20261122-050826"));
        assert_eq!(stamp_key("alexnet_fft"), None);
        assert_eq!(stamp_key("2026-1"), None);
    }

    #[test]
    fn phases_split() {
        let p = Phases {
            data_s: 1.0,
            forward_s: 2.0,
            backward_s: 3.0,
            optimizer_s: 4.0,
            compress_s: 0.5,
            decompress_s: 0.25,
            communicate_s: 9.0,
            wait_s: 2.0,
            sync_s: 0.5,
            step_s: 13.5,
            in_flight_s: 0.0,
            keep_s: 0.0,
        };
        assert_eq!(p.compute_s(), 10.0);
        assert_eq!(p.codec_s(), 0.75);
        assert_eq!(p.other_s(), 0.25);
        // Keeping the state (live membership) is its own part of the step.
        let kept = Phases { keep_s: 0.125, ..p };
        assert_eq!(kept.other_s(), 0.125);
    }

    #[test]
    fn cut_last_line_is_a_note_other_errors_are_not() {
        let p = Path::new("m.jsonl");
        let (r, note) = read_jsonl::<EvalRecord>(p, "{\"step\":1}\n{\"step\":2,\"lo").unwrap();
        assert_eq!(r.len(), 1);
        assert!(note.unwrap().contains("m.jsonl:2"));
        let e = read_jsonl::<EvalRecord>(p, "{\"step\":1}\n{\"step\":\"x\"}\n").unwrap_err();
        assert!(e.to_string().starts_with("m.jsonl:2: "), "{e}");
        assert!(!e.to_string().contains("at line"), "{e}");
    }
}
