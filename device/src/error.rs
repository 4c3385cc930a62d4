//! The device path's errors.

use dtrain_compress::{CompressError, WireError};
use thiserror::Error;

/// What can go wrong on the device path. Each variant names what a user can act on: the
/// device asked for, the method, or the payload's defect.
#[derive(Debug, Error)]
pub enum DeviceError {
    /// A device string that is not one of the accepted forms.
    #[error("device {spec:?}: {reason} (expected wgpu, wgpu:N, wgpu:cpu, cuda or cuda:N)")]
    BadSpec {
        /// The string as given.
        spec: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The device cannot be opened: its runtime is not in this build, or the machine has
    /// no such device.
    #[error("device {spec}: {reason}")]
    Unavailable {
        /// The device asked for.
        spec: String,
        /// Why it cannot be had.
        reason: String,
    },
    /// The device failed a transfer or a launch.
    #[error("device {device}: {what}: {reason}")]
    Server {
        /// The device's name.
        device: String,
        /// The operation that failed.
        what: &'static str,
        /// The runtime's message.
        reason: String,
    },
    /// The method has no device codec in this configuration (the caller falls back to the
    /// host codec); `hint` names the setting under which it has one, where one does.
    #[error("method {method} has no device codec{}", hint.map(|h| format!(" ({h})")).unwrap_or_default())]
    NoCodec {
        /// The method.
        method: &'static str,
        /// The setting that gives it a device codec, if any.
        hint: Option<&'static str>,
    },
    /// The memory has no device form yet (the caller uses the host path).
    #[error("memory {0} has no device form")]
    NoMemory(String),
    /// A buffer of the wrong length for the operation.
    #[error("{what}: buffer of {found} elements, expected {expected}")]
    Length {
        /// The operation.
        what: &'static str,
        /// The length it needs.
        expected: usize,
        /// The length it got.
        found: usize,
    },
    /// The method's configuration is refused (the host codec's own error).
    #[error(transparent)]
    Config(#[from] dtrain_compress::ConfigError),
    /// The input cannot be compressed (non-finite values, bad segments): the host codec's
    /// own error, with the same fields.
    #[error(transparent)]
    Compress(#[from] CompressError),
    /// A malformed payload: the host decoder's own error.
    #[error(transparent)]
    Wire(#[from] WireError),
}
