//! # dtrain-device
//!
//! The device half of dtrain's gradient compressors: [cubecl] kernels that encode a bucket
//! held in GPU memory into the **host codecs' exact wire format** (the payload bytes of
//! `dtrain-compress`, framing included), and decode such payloads into a device buffer.
//! Only payload bytes cross to the host; the dense gradient never does (ARCHITECTURE.md §10).
//!
//! This crate is **not** a second set of methods: the host codec in `dtrain-compress` is
//! the specification, and every device codec is tested against it byte for byte (or, where
//! floating-point order differs, by the decode identity the method defines). It knows
//! nothing of burn, of networks or of the trainer.
//!
//! The kernels are written once, generic over cubecl's runtime: the same code runs on CUDA
//! (feature `cuda`) and on wgpu (feature `wgpu`: Vulkan, Metal, DX12 — and Mesa's software
//! Vulkan, lavapipe, on which CI runs them). Without either feature this crate is empty,
//! so the default CPU build compiles none of cubecl.
//!
//! ## Layout
//! (Plain names here, not links: without a runtime feature the items do not exist.)
//! * `gpu`: `DeviceSpec` (`wgpu`, `wgpu:N`, `wgpu:cpu`, `cuda`, `cuda:N`), the opened
//!   device `Gpu` and its flat `f32` buffers `GpuBuffer`.
//! * `codec`: the `DeviceCodec` seam, the framing around the kernels' bodies, and
//!   `device_codec`, which names the methods that have a device codec.
//! * One file per method, mirroring `compress/src/`: `dgc` (every adaptation), `fft`
//!   (selection, range-float quantization, the spectral residual and the joint decode on
//!   the device; its transforms in `transform`: dtrain's radix-2 / Bluestein kernels, or a
//!   vendor library behind `library`'s `FftLibrary` seam — cuFFT on CUDA, in `cufft`),
//!   `efsignsgd` and `onebit` (exact sums), `fp16`,
//!   `bf16` (their conversion
//!   kernels in `half16`), `natural` (counter draws), `signsgd` (`signsgd` and `signum`),
//!   `terngrad` and `qsgd` (counter draws), `powersgd` (its products; the small
//!   factors' algebra by the host codec),
//!   `threshold`, `topk`. `select` holds the radix select and the ordered compaction of
//!   `topk`, `dgc` and `threshold`, and their host-parsed adds; `signs` the sign bits behind per-segment header words of `efsignsgd` and
//!   `onebit`; `counter` the counter-based draws; `rangefloat` the range-float codes; `exact` the exact sums; `words` the helpers every kernel shares
//!   (grid-stride launch sizes, byte streams packed in `u32` words, segment search).
//! * `memory`: `DeviceMemory`, the error-feedback memories with a device form —
//!   `DeviceResidual` (residual error feedback) and `dgc_momentum`'s `DeviceDgcMemory` (DGC's
//!   momentum correction and masking) — their buffers on the device; `pipeline`: `DevicePipeline`, a codec and its memory as the trainer uses them.
//! * `adam`: `DeviceAdamMoments`, the compressed optimizers' moments (1-bit Adam, 0/1 Adam)
//!   on the device.
//! * `error`: `DeviceError`.
//!
//! [cubecl]: https://docs.rs/cubecl

/// Every item of this crate needs a runtime feature: without one the crate is these docs.
macro_rules! with_a_runtime {
    ($($item:item)*) => { $( #[cfg(any(feature = "wgpu", feature = "cuda"))] $item )* };
}

#[cfg(feature = "cuda")]
mod cufft;

with_a_runtime! {
    pub mod adam;
    pub mod bf16;
    pub mod codec;
    mod counter;
    pub mod dgc;
    pub mod dgc_momentum;
    pub mod efsignsgd;
    pub mod fft;
    pub mod filtered;
    pub mod error;
    mod exact;
    pub mod fp16;
    pub mod gpu;
    mod half16;
    pub mod library;
    mod rangefloat;
    pub mod memory;
    pub mod natural;
    pub mod onebit;
    pub mod pipeline;
    pub mod powersgd;
    pub mod qsgd;
    mod select;
    mod signs;
    pub mod signsgd;
    pub mod terngrad;
    pub mod threshold;
    pub mod transform;
    pub mod topk;
    mod words;

    pub use codec::{device_codec, DeviceCodec};
    pub use error::DeviceError;
    pub use gpu::{DeviceSpec, Gpu, GpuBuffer};
    pub use dgc_momentum::DeviceDgcMemory;
    pub use filtered::{DeviceLowPass, DeviceMomentum};
    pub use memory::{DeviceMemory, DeviceResidual};
    pub use pipeline::DevicePipeline;
    pub use library::{FftLibrary, Job};
    pub use transform::Rfft;
}
