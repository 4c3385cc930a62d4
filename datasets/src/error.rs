//! The crate's error type.

use std::path::{Path, PathBuf};

/// Everything that can go wrong while reading, fetching or arranging data.
///
/// Every variant that concerns a file names it, and says what is wrong with it.
/// Misuse of an API with impossible arguments (a `world_size` of 0, an index past
/// `len()`) panics instead; each such function says so under `# Panics`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// The file could not be opened, read or written.
    #[error("{path}: {op} failed")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done (`open`, `read`, `write`, ...).
        op: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file was read but its contents are not in the expected format
    /// (bad magic number, truncated, inconsistent dimensions, label out of range, ...).
    #[error("{path}: {what}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        what: String,
    },
    /// The image could not be decoded.
    #[error("{path}: cannot decode image")]
    Image {
        /// The file.
        path: PathBuf,
        /// The decoder's error.
        #[source]
        source: image::ImageError,
    },
    /// A file's sha256 differs from the pinned or recorded one.
    #[error("{path}: sha256 mismatch: expected {expected}, found {actual}")]
    Checksum {
        /// The file.
        path: PathBuf,
        /// The pinned or recorded digest (lower-case hex).
        expected: String,
        /// The digest of the file as it is.
        actual: String,
    },
    /// An external registry client (`npm`, `pip`, `apt-get`, `dpkg-deb`) failed or is missing.
    #[error("`{command}` failed: {detail}")]
    Tool {
        /// The command line that was run.
        command: String,
        /// Exit status and the tail of its stderr, or why it could not start.
        detail: String,
    },
    /// A dataset name that `dtrain data fetch` does not know.
    #[error("unknown dataset `{name}` (known: {known})")]
    UnknownDataset {
        /// The name asked for.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// An argument or combination of items that cannot work (mismatched shapes in a batch,
    /// an empty corpus, ...).
    #[error("{0}")]
    Invalid(String),
}

impl DataError {
    /// A [`DataError::Format`] for `path`.
    pub fn format(path: impl AsRef<Path>, what: impl Into<String>) -> Self {
        DataError::Format {
            path: path.as_ref().to_path_buf(),
            what: what.into(),
        }
    }

    /// A [`DataError::Io`] for `path`.
    pub fn io(path: impl AsRef<Path>, op: &'static str, source: std::io::Error) -> Self {
        DataError::Io {
            path: path.as_ref().to_path_buf(),
            op,
            source,
        }
    }
}

/// Shorthand for results in this crate.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// Reads a whole file, naming it in the error.
pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| DataError::io(path, "read", e))
}
