//! # dtrain-compress
//!
//! Gradient compressors of the communication-efficient-training literature, on flat `f32`
//! buffers, each with an exact, versioned, little-endian wire format; and the error-feedback
//! memories that make biased compressors converge.
//!
//! This crate is **not** a training framework and knows nothing of tensors, networks or
//! async runtimes: it takes `&[f32]` and produces bytes (no burn, no tokio). The trainer in
//! `dtrain-framework` decides buckets and collectives; `dtrain-comms` moves the bytes.
//!
//! ## Layout
//! * [`compressor`]: the [`Compressor`] seam, [`Payload`], the framing (header + segment
//!   table) and the drivers [`compress`] / [`decompress_add`].
//! * [`memory`]: the error-feedback seam ([`Memory`], [`MemoryConfig`]), a folder with one
//!   file per memory: none and residual (β, γ), DGC momentum correction, ScaleCom low-pass,
//!   DLCP's dropped-value residual. Methods import memories, never the reverse (the old
//!   paths such as `dgc::DgcMemory` are re-exports).
//! * [`pipeline`]: compressor + memory composed as the trainer uses them.
//! * [`config`]: the registry, a serde enum tagged `kind` ([`CompressorConfig`]).
//! * One file per method: [`none`], [`fp16`], [`topk`], [`randomk`], [`dgc`],
//!   [`scalecom`], …
//! * [`meprop`]: top-k column selection for meProp-style sparse back-propagation.
//! * [`mipd`]: MIPD (parameter-significance sparsification with per-layer code-books) and its
//!   parameter-server side (smoothing of dropped coordinates, alternating-half updates).
//! * Helpers: [`select`] (exact O(n) top-k selection), [`sparse`] (index list / bitmap
//!   bodies), [`wire`] (bounded readers, bit packing, Elias-gamma), [`rng`] (explicit
//!   seeded RNG).
//!
//! ## Example
//! ```
//! use dtrain_compress::{compress_new, decompress, CompressorConfig, Ctx, Rng};
//! let cfg: CompressorConfig = toml::from_str("kind = \"topk\"\nratio = 0.25").unwrap();
//! let mut c = cfg.build().unwrap();
//! let g = [0.1f32, -3.0, 0.2, 2.0, 0.0, 0.5, -0.05, 1.0];
//! let payload = compress_new(c.as_mut(), &g, &Ctx::default(), &mut Rng::seed_from_u64(1)).unwrap();
//! let mut out = [0f32; 8];
//! decompress(c.as_ref(), payload.as_bytes(), &mut out).unwrap();
//! assert_eq!(out, [0.0, -3.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0]);
//! ```
//!
//! ## Adding a compressor
//! 1. Write `src/mymethod.rs` with a `MyMethodConfig` (serde, `deny_unknown_fields`,
//!    documented defaults, an `init()` that validates and returns `Result<MyMethod,
//!    ConfigError>`) and a `MyMethod` implementing [`Compressor`]: `encode_segment` writes
//!    one segment's body with the [`wire::Writer`]; `decode_segment_add` reads it back with
//!    the bounds-checked [`wire::Reader`] and adds into the output, returning a
//!    [`WireError`] (never panicking) on malformed bytes; `segment_bits` returns the exact
//!    size formula when it depends only on `n`. Add a [`MethodId`] byte.
//! 2. Add one variant to [`CompressorConfig`] (and its arms in `name`, `build`,
//!    `default_memory`) and one [`config::METHODS`] entry. The shared property suite
//!    (`tests/properties.rs`) and the wire fuzz test pick the method up from `METHODS`
//!    automatically; `dtrain bench compress` lists it too.
//! 3. Put the method's own tests from ALGORITHMS.md at the bottom of its file.

pub mod columns;
pub mod compressor;
pub mod config;
pub mod dgc;
pub mod error;
pub mod fft;
pub mod fp16;
pub mod memory;
pub mod meprop;
pub mod mipd;
pub mod none;
pub mod pipeline;
pub mod randomk;
pub mod rangefloat;
pub mod rng;
pub mod scalecom;
pub mod schedule;
pub mod select;
pub mod sparse;
pub mod topk;
pub mod wire;

pub mod adaptive;
pub mod dropping;
pub mod onebit;
pub mod qsgd;
pub mod terngrad;
#[cfg(test)]
mod test_util;
pub mod threshold;

pub use compressor::{
    compress, compress_new, decompress, decompress_add, decompress_sum_add, payload_bits,
    sum_lanes, summable_lanes, Aggregation, Compressor, Ctx, MethodId, Payload, HEADER_BITS,
};
pub use config::{CompressorConfig, METHODS};
pub use error::{CompressError, ConfigError, WireError};
pub use memory::{Memory, MemoryConfig};
pub use pipeline::Pipeline;
pub use rng::Rng;
