//! dtrain-report: what `dtrain report` and `dtrain simulate` do, as a library.
//!
//! No burn and no runtime: it reads the run directories the trainer writes
//! (`runs/<name>/<UTC stamp>/`: `config.toml`, `metrics.jsonl`, `eval.jsonl`,
//! `summary.json`, see [`run`]) and
//!
//! * [`report()`] renders a comparison of runs as markdown tables (final metric, step-time
//!   breakdown, bytes, compression, speed-up vs a baseline and vs each peer, stragglers,
//!   bytes per worker vs P, and the time to a target quality with [`Target`]) and plots (loss vs time / step, accuracy vs epoch, step
//!   breakdown, bytes vs P) as SVG and PNG;
//! * [`simulate()`] projects each run's step time onto other fabrics and worker counts with
//!   the α–β cost of its method's collective, and [`validate`] checks that model against
//!   runs made on an emulated link.
//!
//! ```no_run
//! use std::path::PathBuf;
//! use dtrain_report::{report, simulate, ReportOptions, SimOptions};
//!
//! let runs = vec![PathBuf::from("runs/mlp_none"), PathBuf::from("runs/mlp_fft")];
//! let out = report(&runs, &ReportOptions::new("runs/report"))?;
//! println!("{}", out.markdown);
//! let sim = simulate(&runs, &SimOptions::default())?;
//! println!("{}", sim.markdown);
//! # Ok::<(), dtrain_report::ReportError>(())
//! ```
//!
//! Errors never panic: bad input is a [`ReportError`] naming the file and line.

pub mod error;
pub mod md;
pub mod plot;
pub mod report;
pub mod run;
pub mod simulate;
pub mod target;

pub use error::{ReportError, Result};
pub use report::{report, report_runs, ReportOptions, ReportOutput, RunRow};
pub use run::{discover, load_runs, FinalMetric, Phases, Run};
pub use simulate::{
    collective_of, parse_workers, simulate, simulate_runs, validate, validate_runs, Collective,
    Fabric, SimOptions, SimOutput, SimPoint, StepModel, Validation, ValidationOutput,
    DEFAULT_WORKERS,
};
pub use target::{Reached, Target, TargetMetric};
