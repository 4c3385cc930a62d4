//! Error types of the compression layer.

use thiserror::Error;

/// Why a payload could not be decoded. Decoders return this for any malformed or hostile
/// input; they never panic and never allocate more than the payload's own length allows.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    /// The payload ended before a field was complete.
    #[error("payload truncated reading {what}: needed {needed} bytes, {available} left")]
    Truncated {
        /// The field being read.
        what: &'static str,
        /// Bytes the field needs.
        needed: usize,
        /// Bytes that were left.
        available: usize,
    },
    /// The first byte is not the dtrain payload magic.
    #[error("not a dtrain payload (magic byte {0:#04x})")]
    BadMagic(u8),
    /// The payload was written by an unknown wire-format version.
    #[error("unsupported payload version {0}")]
    UnsupportedVersion(u8),
    /// The payload was produced by a different compressor than the decoding one.
    #[error("payload was written by method id {found}, decoder is {expected}")]
    WrongMethod {
        /// This decoder's method id.
        expected: u8,
        /// The id in the payload header.
        found: u8,
    },
    /// The payload describes a buffer of another length than the output buffer.
    #[error("payload describes {payload} elements but the output buffer has {buffer}")]
    LengthMismatch {
        /// Elements in the payload header.
        payload: usize,
        /// Elements in the output buffer.
        buffer: usize,
    },
    /// The segment table does not add up to the payload length.
    #[error("bad segment table: {0}")]
    BadSegments(&'static str),
    /// A sparse index lies outside its segment.
    #[error("index {index} out of range for a segment of {len} elements")]
    IndexOutOfRange {
        /// The offending index.
        index: u64,
        /// The segment length.
        len: usize,
    },
    /// Bytes remained after the last segment.
    #[error("{0} trailing bytes after the payload")]
    TrailingBytes(usize),
    /// A field holds a value the format forbids.
    #[error("invalid payload: {0}")]
    Invalid(&'static str),
}

/// Why a gradient could not be compressed.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum CompressError {
    /// The input contains NaN or ±Inf; no method transmits non-finite values.
    #[error("non-finite gradient value {value} at element {index}")]
    NonFinite {
        /// Position of the first non-finite element.
        index: usize,
        /// The value found there.
        value: f32,
    },
    /// The buffer (or a segment) is larger than the wire format can describe.
    #[error("buffer of {0} elements exceeds the wire format's limit")]
    TooLarge(usize),
    /// The segment layout does not describe the buffer.
    #[error("segments do not tile the buffer: {0}")]
    BadSegments(String),
    /// A two-phase method's agreement message (e.g. ScaleCom's index broadcast, see
    /// [`crate::Compressor::broadcast_root`]) is missing, malformed, or does not fit the
    /// buffer being compressed.
    #[error("pre-compression agreement failed: {0}")]
    Agreement(String),
}

/// A compressor or memory configuration that cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("compress.{field}: {reason}")]
pub struct ConfigError {
    /// The offending field, as named in the TOML config.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl ConfigError {
    /// A new error naming `field`.
    pub fn new(field: &'static str, reason: impl Into<String>) -> Self {
        ConfigError {
            field,
            reason: reason.into(),
        }
    }
}
