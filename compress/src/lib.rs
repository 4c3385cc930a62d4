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
//! * [`sharded`]: the seam of methods with a parameter-server protocol of their own
//!   (servers that keep state, as MIPD's smoothing).
//! * [`registry`]: the [`Method`] trait each method's config implements, and what the
//!   one-line registration generates: [`CompressorConfig`] (a `[compress]` table tagged
//!   `kind`) and [`METHODS`]; also the [`Collective`] a run records per bucket.
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
//! One file and two lines of this file: see `compress/README.md` for the worked example.
//! In short, `src/mymethod.rs` holds `MyMethodConfig` (serde, `deny_unknown_fields`,
//! documented defaults) implementing [`Method`] (name, description, wire id, `build`,
//! default memory, what it derives from the run and what it refuses), and `MyMethod`
//! implementing [`Compressor`]; then `pub mod mymethod;` and `MyMethod(mymethod::MyMethodConfig),`
//! in the `methods!` list below. The property suite (`tests/properties.rs`), the wire fuzz
//! test, `dtrain list` and `dtrain bench compress` pick the method up from [`METHODS`].

// The seams and helpers.
pub mod compressor;
pub mod error;
pub mod exact;
mod finite;
mod half16;
mod lanes;
pub mod memory;
pub mod meprop;
pub mod pipeline;
pub mod put;
#[macro_use]
pub mod registry;
pub mod chunked;
pub mod rng;
pub mod schedule;
pub mod select;
pub mod sharded;
mod simd;
pub mod sparse;
#[cfg(test)]
mod test_util;
pub mod touched;
pub mod wire;

// The methods: a `mod` line each, and one registry line each below.
pub mod adaptive;
pub mod bf16;
pub mod columns;
pub mod demo;
pub mod dgc;
pub mod dropping;
pub mod efsignsgd;
pub mod fft;
pub mod fp16;
pub mod fp4;
pub mod mipd;
pub mod natural;
pub mod none;
pub mod onebit;
pub mod powersgd;
pub mod qsgd;
pub mod randomk;
pub mod rangefloat;
pub mod scalecom;
pub mod signsgd;
pub mod sparseloco;
pub mod terngrad;
pub mod threshold;
pub mod topk;

// The registry, in listing order (`dtrain list`).
methods! {
    None(none::NoneConfig),
    Fp16(fp16::Fp16Config),
    TopK(topk::TopKConfig),
    RandomK(randomk::RandomKConfig),
    Qsgd(qsgd::QsgdConfig),
    TernGrad(terngrad::TernGradConfig),
    OneBit(onebit::OneBitConfig),
    Threshold(threshold::ThresholdConfig),
    AdaptiveThreshold(adaptive::AdaptiveThresholdConfig),
    GradientDropping(dropping::GradientDroppingConfig),
    Dgc(dgc::DgcConfig),
    ScaleCom(scalecom::ScaleComConfig),
    RangeFloat(rangefloat::RangeFloatConfig),
    Fft(fft::FftConfig),
    Mipd(mipd::MipdConfig),
    Columns(columns::ColumnsConfig),
    EfSignSgd(efsignsgd::EfSignSgdConfig),
    Natural(natural::NaturalConfig),
    SignSgd(signsgd::SignSgdConfig),
    Signum(signsgd::SignumConfig),
    Bf16(bf16::Bf16Config),
    PowerSgd(powersgd::PowerSgdConfig),
    SparseLoco(sparseloco::SparseLocoConfig),
    Demo(demo::DemoConfig),
    Fp4(fp4::Fp4Config),
}

pub use compressor::{
    compress, compress_new, decompress, decompress_add, decompress_add_touched, decompress_mean,
    decompress_sum_add, payload_bits, read_frame, sum_lanes, summable_lanes, two_phase,
    write_frame_header, Aggregation, Combine, Compressor, Ctx, LaneFormat, MethodId, Payload,
    Touched, HEADER_BITS,
};
pub use error::{CompressError, ConfigError, WireError};
pub use memory::{Memory, MemoryConfig};
pub use pipeline::{chunk_segments, Pipeline, ReduceError};
pub use put::Put;
pub use registry::{Collective, Method, MethodInfo, RunFacts, RunUse};
pub use rng::Rng;

/// The `kind` of the uncompressed baseline (fp32), the method every table compares against
/// and the default of `[compress]`.
pub const BASELINE: &str = <none::NoneConfig as Method>::NAME;

/// The configuration of the [`BASELINE`] method (no compression).
pub fn baseline() -> CompressorConfig {
    CompressorConfig::from(none::NoneConfig::default())
}

/// The method that compresses the momentum of the compressed optimizers (1-bit Adam, 0/1
/// Adam) when `[compress]` leaves it at [`BASELINE`]: the 1-bit scaled sign with the RMS
/// scale `‖x‖₂/√d` of DeepSpeed's compressed all-reduce (its residual memory is the worker's
/// error feedback).
pub fn one_bit_momentum() -> CompressorConfig {
    CompressorConfig::from(efsignsgd::EfSignSgdConfig {
        scale: efsignsgd::SignScale::Rms,
        ..Default::default()
    })
}
