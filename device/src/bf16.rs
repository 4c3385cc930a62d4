//! `bf16` on the device: bfloat16, round to nearest even, overflow saturated (the host
//! codec `dtrain_compress::bf16`); the kernels are `fp16`'s with the other format (`half16`).

pub use crate::half16::Half16;

/// The `bf16` device codec.
pub const BF16: Half16 = Half16::BF16;
