//! `fp16` on the device: IEEE half precision, round to nearest even, overflow saturated
//! (the host codec `dtrain_compress::fp16`). The body is the whole bucket's binary16 values
//! in order, so the segments do not change it; one kernel writes it, two values a word. The
//! kernels, shared with `bf16`, are in `half16`.

pub use crate::half16::Half16;

/// The `fp16` device codec.
pub const FP16: Half16 = Half16::FP16;
