//! `bf16` on the device: bfloat16, round to nearest even, overflow saturated (the host
//! codec `dtrain_compress::bf16`); the kernels are `fp16`'s with the other format.

use std::ops::Range;

use cubecl::server::Handle;
use dtrain_compress::{bf16::Bf16Config, Method, MethodId, Rng, WireError};

use crate::codec::StreamCodec;
use crate::fp16::{decode_halves, encode_halves};
use crate::gpu::{Gpu, GpuBuffer};

/// The `bf16` device codec.
#[derive(Debug, Clone, Copy, Default)]
pub struct Bf16;

impl StreamCodec for Bf16 {
    fn method(&self) -> MethodId {
        Bf16Config::ID
    }
    fn segment_len(&self, n: usize) -> usize {
        2 * n
    }
    fn body_what(&self) -> &'static str {
        "bf16 values"
    }
    fn encode_body(
        &self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        _segs: &[Range<usize>],
        _rng: &mut Rng,
        body: &Handle,
        first_bad: &Handle,
    ) {
        encode_halves(gpu, grad, body, first_bad, true);
    }
    fn decode_body(
        &self,
        gpu: &Gpu,
        body: &Handle,
        _segs: &[Range<usize>],
        out: &GpuBuffer,
        first_bad: &Handle,
    ) {
        decode_halves(gpu, body, out, first_bad, true);
    }
    fn invalid_value(&self) -> WireError {
        WireError::Invalid("non-finite bf16 value")
    }
}
