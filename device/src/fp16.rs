//! `fp16` on the device: IEEE half precision, round to nearest even, overflow saturated
//! (the host codec `dtrain_compress::fp16`). The body is the whole bucket's binary16 values
//! in order, so the segments do not change it; one kernel writes it, two values a word.

use std::ops::Range;

use cubecl::prelude::*;
use cubecl::server::Handle;
use dtrain_compress::{fp16::Fp16Config, Method, MethodId, Rng, WireError};

use crate::codec::StreamCodec;
use crate::gpu::{Gpu, GpuBuffer};
use crate::half16;
use crate::words::geometry;

/// The `fp16` device codec.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fp16;

/// What `fp16` and `bf16` share: 16 bits an element, one encode and one decode kernel.
pub(crate) fn encode_halves(
    gpu: &Gpu,
    grad: &GpuBuffer,
    body: &Handle,
    first_bad: &Handle,
    bf16: bool,
) {
    let words = grad.len().div_ceil(2);
    let (count, dim) = geometry(words);
    // SAFETY: `body` holds ⌈n/2⌉ words and `first_bad` one (made by `Stream::encode`).
    unsafe {
        half16::encode::launch(
            gpu.client(),
            count,
            dim,
            grad.arg(),
            BufferArg::from_raw_parts(body.clone(), words),
            BufferArg::from_raw_parts(first_bad.clone(), 1),
            bf16,
        );
    }
}

/// The decoding half of [`encode_halves`].
pub(crate) fn decode_halves(
    gpu: &Gpu,
    body: &Handle,
    out: &GpuBuffer,
    first_bad: &Handle,
    bf16: bool,
) {
    let (count, dim) = geometry(out.len());
    // SAFETY: `body` holds ⌈n/2⌉ words (checked against the body length) and `first_bad` one.
    unsafe {
        half16::decode_add::launch(
            gpu.client(),
            count,
            dim,
            BufferArg::from_raw_parts(body.clone(), out.len().div_ceil(2)),
            out.arg(),
            BufferArg::from_raw_parts(first_bad.clone(), 1),
            bf16,
        );
    }
}

impl StreamCodec for Fp16 {
    fn method(&self) -> MethodId {
        Fp16Config::ID
    }
    fn segment_len(&self, n: usize) -> usize {
        2 * n
    }
    fn body_what(&self) -> &'static str {
        "fp16 values"
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
        encode_halves(gpu, grad, body, first_bad, false);
    }
    fn decode_body(
        &self,
        gpu: &Gpu,
        body: &Handle,
        _segs: &[Range<usize>],
        out: &GpuBuffer,
        first_bad: &Handle,
    ) {
        decode_halves(gpu, body, out, first_bad, false);
    }
    fn invalid_value(&self) -> WireError {
        WireError::Invalid("non-finite fp16 value")
    }
}
