//! The one error type of the crate.

use std::fmt;
use std::path::{Path, PathBuf};

/// Everything that can go wrong while reading runs, rendering a report or projecting step
/// times. Every variant that comes from a file names it (and the line, where there is one),
/// so a message reads like `runs/x/20261122-050826/metrics.jsonl:17: expected value`.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file or directory could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A file's content is malformed.
    #[error("{}", Located { path, line: *line, message })]
    Format {
        /// The file.
        path: PathBuf,
        /// 1-based line, where the format has lines (JSON Lines, TOML).
        line: Option<usize>,
        /// What is wrong.
        message: String,
    },
    /// A path given as input holds no run directory.
    #[error("{}: no run found (a run directory holds metrics.jsonl or summary.json)", path.display())]
    NoRun {
        /// The path given.
        path: PathBuf,
    },
    /// No input paths were given.
    #[error("no runs given")]
    NoInput,
    /// The requested baseline matches no run, or several runs ambiguously.
    #[error("baseline: {0}")]
    Baseline(String),
    /// An option is invalid (a fabric string, a worker count, …).
    #[error("{0}")]
    Invalid(String),
    /// Rendering a plot failed.
    #[error("{}: plot: {message}", path.display())]
    Plot {
        /// The file being written.
        path: PathBuf,
        /// What the renderer said.
        message: String,
    },
}

/// `path:line: message` (or `path: message` without a line).
struct Located<'a> {
    path: &'a Path,
    line: Option<usize>,
    message: &'a str,
}

impl fmt::Display for Located<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(l) => write!(f, "{}:{l}: {}", self.path.display(), self.message),
            None => write!(f, "{}: {}", self.path.display(), self.message),
        }
    }
}

impl ReportError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ReportError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn format(
        path: impl Into<PathBuf>,
        line: Option<usize>,
        message: impl Into<String>,
    ) -> Self {
        ReportError::Format {
            path: path.into(),
            line,
            message: message.into(),
        }
    }
}

/// The crate's result type.
pub type Result<T, E = ReportError> = std::result::Result<T, E>;
