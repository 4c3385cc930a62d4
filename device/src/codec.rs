//! The device codec seam, and the framing every device codec shares with its host codec.
//!
//! A device codec encodes a bucket that lives in device memory into the payload its host
//! codec would write for the same values — the framing (header and segment table) from
//! [`dtrain_compress::write_frame_header`], the bodies from kernels — and decodes a payload
//! into a device buffer, adding to what it holds, as [`dtrain_compress::decompress_add`]
//! does on the host. The payload is the only thing that crosses to the host.
//!
//! # Errors, as on the host
//! Encoding refuses non-finite input with the host's [`CompressError::NonFinite`] (the first
//! such element and its value: the kernels record the least index with an atomic minimum,
//! read back with the payload) and segment lists that do not tile the buffer. Decoding
//! checks the framing on the host (method, length, segment table, body lengths) and the
//! values on the device; a defect is the host decoder's [`WireError`], and `out` may then
//! hold part of the payload, as on the host. Where a payload has two defects the error may
//! name another one than the host's (the host reads segment by segment; here the framing is
//! checked before any value), never a different verdict.

use std::collections::BTreeMap;
use std::ops::Range;

use cubecl::prelude::*;
use cubecl::server::Handle;
use dtrain_compress::compressor::effective_segments;
use dtrain_compress::{
    decompress_add, Compressor, Ctx, read_frame, write_frame_header, CompressError, CompressorConfig, MethodId, Payload, Rng,
    WireError,
};

use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{to_words, words_for};

/// A method's device codec. The host codec of the same method is its specification.
pub trait DeviceCodec: Send {
    /// The method's id byte (the host codec's).
    fn method(&self) -> MethodId;

    /// The host codec's [`Compressor::ratio_metric`]
    /// after the last encode, where the knob moves with the step (DGC's warm-up density);
    /// `None` (the default) where the host's is fixed by the config and the host codec
    /// tells it without encoding.
    fn ratio_metric(&self) -> Option<(&'static str, f64)> {
        None
    }

    /// The shapes of the bucket's tensors, one per segment (the host's
    /// [`Compressor::set_segment_shapes`]): PowerSGD's matrices. Ignored by default.
    fn set_segment_shapes(&mut self, _shapes: &[Vec<usize>]) {}

    /// The number of ranks exchanging (the host's [`Compressor::set_world_size`]: PowerSGD's
    /// mean of the `Q`s). Ignored by default.
    fn set_world_size(&mut self, _world: usize) {}

    /// Summed-agreement methods (the host's [`Compressor::summed_agreement`]: PowerSGD's
    /// `P`): this rank's message for the compensated bucket `p`, written into `out`
    /// (cleared). The protocol is the host's: the messages are all-reduced, every rank
    /// installs the sum ([`DeviceCodec::install_sum`]), then [`DeviceCodec::encode`]s `p`
    /// under it. Default: an error (the method has no agreement).
    fn sum_message(
        &mut self,
        _gpu: &Gpu,
        _p: &GpuBuffer,
        _ctx: &Ctx<'_>,
        _out: &mut Vec<f32>,
    ) -> Result<(), DeviceError> {
        Err(CompressError::Agreement(format!("method {} has no summed agreement", self.method().0)).into())
    }

    /// Installs the summed messages for a bucket of `n` elements (the host's
    /// [`Compressor::install_sum`], its checks and errors). Default: an error.
    fn install_sum(&mut self, _summed: &[f32], _n: usize, _ctx: &Ctx<'_>) -> Result<(), DeviceError> {
        Err(CompressError::Agreement(format!("method {} has no summed agreement", self.method().0)).into())
    }

    /// The step's aggregate, `summed` (the payload with its lanes summed over the ranks), as
    /// the host's [`Compressor::absorb_aggregate`] takes it (PowerSGD's warm start). A no-op
    /// by default.
    fn absorb_aggregate(&mut self, _summed: &[u8], _ctx: &Ctx<'_>) {}

    /// The codec's own state in the host codec's `export_state` format, where it keeps one
    /// that the host codec does not (PowerSGD's warm-started `Q`, which moves as this codec
    /// encodes); `None` (the default): the host codec's state is the state.
    fn export_state(&self) -> Option<BTreeMap<String, f64>> {
        None
    }

    /// Encodes `grad` into `out` (cleared first): the bytes the host codec writes for the
    /// same values, context (`ctx.segments`: the layer boundaries, empty for one segment;
    /// `ctx.step` for a schedule) and encoder `rng` (drawn from as the host codec draws;
    /// the deterministic codecs ignore it).
    fn encode(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError>;

    /// Decodes `payload` and adds the values into `out`, as the host's `decompress_add`.
    fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError>;

    /// The receivers' mean of `payloads` (every worker's, in rank order) written into
    /// `out` — their decoded sum times `inv` — where the codec decodes them jointly on the
    /// device (FFT: the summed spectra and one inverse transform per chunk); an error names
    /// the offending payload. `None` (the default): decoded payload by payload
    /// ([`DeviceCodec::decode_add`]).
    fn decode_mean(
        &self,
        _gpu: &Gpu,
        _payloads: &[&[u8]],
        _inv: f32,
        _out: &GpuBuffer,
    ) -> Option<Result<(), (usize, DeviceError)>> {
        None
    }

    /// The parts of the codec that still run on the host, where some do (FFT's transform),
    /// for `--verify` and the logs; `None` (the default) where everything runs on the device
    /// but what the method's docs name.
    fn host_parts(&self) -> Option<&'static str> {
        None
    }

    /// Offered classic residual error feedback (as the host's
    /// `Compressor::adopt_error_feedback`): `true` takes it — the codec then encodes `g + e`
    /// and updates `e` itself, in its own domain, and the pipeline keeps no memory. The
    /// default declines.
    fn adopt_error_feedback(&mut self) -> bool {
        false
    }

    /// The adopted residuals in the host codec's `export_feedback` format (empty by default).
    fn export_feedback(&self, _gpu: &Gpu) -> Result<BTreeMap<u64, Vec<f32>>, DeviceError> {
        Ok(BTreeMap::new())
    }

    /// Restores [`DeviceCodec::export_feedback`] (or the host codec's).
    fn import_feedback(&mut self, _gpu: &Gpu, _state: &BTreeMap<u64, Vec<f32>>) {}

    /// Takes the host codec's `export_state` (FFT's θ scale after the "recover" rule), so
    /// that the device codec encodes at the host's knob; a no-op by default.
    fn import_state(&mut self, _state: &BTreeMap<String, f64>) -> Result<(), DeviceError> {
        Ok(())
    }
}

/// `out = src`.
#[cube(launch)]
pub(crate) fn copy_into(src: &[f32], out: &mut [f32]) {
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        out[i] = src[i];
        i += crate::words::grid_stride();
    }
}

/// Decodes `payload` with the host codec `host` into a copy of `out` and writes it back:
/// the decoders whose device form is not written yet (the host's verdicts and errors, and
/// its values bit for bit, `−0.0` where nothing was added included).
pub(crate) fn host_decode_add(
    gpu: &Gpu,
    host: &dyn Compressor,
    payload: &[u8],
    out: &GpuBuffer,
) -> Result<(), DeviceError> {
    let mut values = gpu.download(out)?;
    decompress_add(host, payload, &mut values)?;
    if values.is_empty() {
        return Ok(());
    }
    let (count, dim) = crate::words::geometry(out.len());
    copy_into::launch(gpu.client(), count, dim, gpu.upload(&values).arg(), out.arg());
    Ok(())
}

/// The device codec of `cfg`'s method, or `None` where it has none (the caller uses the
/// host codec on a copy of the bucket, and says so).
pub fn device_codec(cfg: &CompressorConfig) -> Option<Box<dyn DeviceCodec>> {
    use crate::{
        bf16, dgc, efsignsgd, fft, fp16, natural, onebit, powersgd, qsgd, signsgd, terngrad,
        threshold, topk,
    };
    Some(match cfg {
        CompressorConfig::Dgc(c) => Box::new(dgc::Dgc::for_config(c)?),
        CompressorConfig::Fft(c) => Box::new(fft::FftCodec::for_config(c).ok()?),
        CompressorConfig::OneBit(c) => Box::new(onebit::OneBit::for_config(c)?),
        CompressorConfig::EfSignSgd(c) => Box::new(efsignsgd::EfSignSgd::for_config(c)?),
        CompressorConfig::Natural(c) => Box::new(Stream(natural::Natural::for_config(c)?)),
        CompressorConfig::Qsgd(c) => Box::new(qsgd::Qsgd::for_config(c)?),
        CompressorConfig::PowerSgd(c) => Box::new(powersgd::PowerSgdCodec::for_config(c)),
        CompressorConfig::Threshold(c) => Box::new(threshold::Threshold::for_config(c)?),
        CompressorConfig::TernGrad(c) => Box::new(terngrad::TernGrad::for_config(c)?),
        CompressorConfig::TopK(c) => Box::new(topk::TopK::new(c)),
        CompressorConfig::Fp16(_) => Box::new(Stream(fp16::FP16)),
        CompressorConfig::Bf16(_) => Box::new(Stream(bf16::BF16)),
        CompressorConfig::SignSgd(_) => Box::new(Stream(signsgd::SignBits::SIGNSGD)),
        CompressorConfig::Signum(_) => Box::new(Stream(signsgd::SignBits::SIGNUM)),
        _ => return None,
    })
}

/// Where `cfg`'s method has a device codec under other settings than `cfg`'s, which ones
/// (for the message of a bucket left on the host); `None` where none has one.
pub fn device_form(cfg: &CompressorConfig) -> Option<&'static str> {
    Some(match cfg {
        CompressorConfig::OneBit(_) => "with sum = \"exact\" and one column a segment",
        CompressorConfig::EfSignSgd(_) => "with sum = \"exact\"",
        CompressorConfig::Natural(_) => "with draws = \"counter\"",
        CompressorConfig::Qsgd(_) => {
            "with draws = \"counter\", norm = \"max\" and coding = \"fixed\""
        }
        CompressorConfig::TernGrad(_) => {
            "with draws = \"counter\", and clip = 0 or sum = \"exact\""
        }
        _ => return None,
    })
}

/// A segment table on the device: `starts[s]` is segment `s`'s first element, and one more
/// entry the end of the buffer (`S + 1` words).
pub(crate) fn element_starts(segs: &[Range<usize>]) -> Vec<u32> {
    segs.iter()
        .map(|s| s.start as u32)
        .chain(segs.last().map(|s| s.end as u32))
        .collect()
}

/// Where each segment's body starts in the payload body when a segment of `n` elements
/// takes `len(n)` bytes, and one more entry the body's length (`S + 1` words).
pub(crate) fn body_starts(segs: &[Range<usize>], len: impl Fn(usize) -> usize) -> Vec<u32> {
    let mut at = 0u32;
    let mut out = vec![0];
    for s in segs {
        at += len(s.len()) as u32;
        out.push(at);
    }
    out
}

/// Checks that the unused bits of each segment's last byte are zero, in a body of `bits`-bit
/// codes packed LSB-first, each segment on bytes of its own (the host's rule; its error
/// `Invalid(what)`, with the first such segment).
pub(crate) fn check_padding(
    body: &[u8],
    segs: &[Range<usize>],
    bits: usize,
    what: &'static str,
) -> Result<(), (usize, WireError)> {
    let starts = body_starts(segs, |n| (bits * n).div_ceil(8));
    for (s, seg) in segs.iter().enumerate() {
        let used = bits * seg.len();
        if !used.is_multiple_of(8) && body[starts[s + 1] as usize - 1] >> (used % 8) != 0 {
            return Err((s, WireError::Invalid(what)));
        }
    }
    Ok(())
}

/// Tables of words on the device, each with its length (for `BufferArg::from_raw_parts`).
pub(crate) fn upload_tables<const N: usize>(gpu: &Gpu, tables: [Vec<u32>; N]) -> [(Handle, usize); N] {
    tables.map(|t| (gpu.client().create_from_slice(u32_bytes(&t)), t.len()))
}

/// A method whose payload body is one byte stream over all segments, written by one
/// encode kernel and read by one decode kernel, with no per-payload state: the shape of
/// the elementwise casts and the sign codecs. [`Stream`] turns one into a [`DeviceCodec`].
pub(crate) trait StreamCodec: Send {
    /// The method.
    fn method(&self) -> MethodId;

    /// Body bytes of a segment of `n` elements (the host's `segment_bits`, in bytes).
    fn segment_len(&self, n: usize) -> usize;

    /// What the host decoder calls a segment's body when it is cut short.
    fn body_what(&self) -> &'static str;

    /// Body bytes for these segments.
    fn body_len(&self, segs: &[Range<usize>]) -> usize {
        segs.iter().map(|s| self.segment_len(s.len())).sum()
    }

    /// The segment tables on the device: each segment's first element ([`element_starts`])
    /// and first body byte ([`body_starts`]).
    fn tables(&self, gpu: &Gpu, segs: &[Range<usize>]) -> [(Handle, usize); 2] {
        upload_tables(
            gpu,
            [
                element_starts(segs),
                body_starts(segs, |n| self.segment_len(n)),
            ],
        )
    }

    /// Launches the kernels writing the body of `grad` into `body` (zeroed, `⌈len/4⌉`
    /// words), drawing from `rng` as the host codec draws; a non-finite input element
    /// lowers `first_bad` (one word, `u32::MAX`) to its index.
    fn encode_body(
        &self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        segs: &[Range<usize>],
        rng: &mut Rng,
        body: &Handle,
        first_bad: &Handle,
    );

    /// Checks on the host what a look at a few bytes can (e.g. the padding bits of each
    /// segment's last byte); an error comes with its segment, since the host decoder,
    /// going segment by segment, reports an invalid value of an earlier segment first.
    fn check_body(&self, _body: &[u8], _segs: &[Range<usize>]) -> Result<(), (usize, WireError)> {
        Ok(())
    }

    /// Launches the kernels adding the values of `body` (as words) into `out`; an invalid
    /// value lowers `first_bad` to its element index.
    fn decode_body(
        &self,
        gpu: &Gpu,
        body: &Handle,
        segs: &[Range<usize>],
        out: &GpuBuffer,
        first_bad: &Handle,
    );

    /// The host decoder's error for an invalid value in the body.
    fn invalid_value(&self) -> WireError;
}

/// The [`DeviceCodec`] of a [`StreamCodec`]: framing, transfers and error reports.
pub(crate) struct Stream<C>(pub(crate) C);

impl<C: StreamCodec> DeviceCodec for Stream<C> {
    fn method(&self) -> MethodId {
        self.0.method()
    }

    fn encode(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let segs = begin_payload(self.0.method(), grad.len(), ctx.segments, out)?;
        if segs.is_empty() {
            return Ok(());
        }
        let len = self.0.body_len(&segs);
        let body = gpu.words(words_for(len), 0);
        let first_bad = gpu.words(1, u32::MAX);
        // On non-finite input the host codec leaves the Rng where it was.
        let saved = rng.clone();
        self.0.encode_body(gpu, grad, &segs, rng, &body, &first_bad);
        let mut read = gpu.read_words(vec![body, first_bad], "reading a payload")?;
        if let Err(e) = refuse_non_finite(gpu, grad, &read[1], out) {
            *rng = saved;
            return Err(e);
        }
        out.buffer_mut()
            .extend_from_slice(&read.swap_remove(0)[..len]);
        Ok(())
    }

    fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError> {
        let (r, segs) = read_frame(self.0.method(), payload, out.len())?;
        let body = &payload[r.position()..];
        // The host reads segment by segment: the first one cut short is its error.
        let mut len = 0;
        for s in &segs {
            let needed = self.0.segment_len(s.len());
            if body.len() - len < needed {
                return Err(WireError::Truncated {
                    what: self.0.body_what(),
                    needed,
                    available: body.len() - len,
                }
                .into());
            }
            len += needed;
        }
        if body.len() > len {
            return Err(WireError::TrailingBytes(body.len() - len).into());
        }
        if segs.is_empty() {
            return Ok(());
        }
        let checked = self.0.check_body(body, &segs).err();
        let words = gpu.client().create_from_slice(u32_bytes(&to_words(body)));
        let first_bad = gpu.words(1, u32::MAX);
        self.0.decode_body(gpu, &words, &segs, out, &first_bad);
        let read = gpu.read_words(vec![first_bad], "decoding a payload")?;
        let bad = u32::from_le_bytes(read[0][..4].try_into().expect("one word"));
        // The host's verdict: the first segment with a defect, its own check before its
        // values.
        let bad_segment = (bad != u32::MAX)
            .then(|| segs.iter().position(|s| s.contains(&(bad as usize))))
            .flatten();
        match (checked, bad_segment) {
            (Some((p, _)), Some(q)) if q < p => Err(self.0.invalid_value().into()),
            (Some((_, e)), _) => Err(e.into()),
            (None, Some(_)) => Err(self.0.invalid_value().into()),
            (None, None) => Ok(()),
        }
    }
}

/// Checks a buffer of `n` elements and its `segments` as the host's `compress` does, clears
/// `out` and writes the framing into it; the segments the bodies follow (none for `n = 0`).
pub(crate) fn begin_payload(
    method: MethodId,
    n: usize,
    segments: &[Range<usize>],
    out: &mut Payload,
) -> Result<Vec<Range<usize>>, DeviceError> {
    if n > dtrain_compress::compressor::MAX_ELEMS {
        return Err(CompressError::TooLarge(n).into());
    }
    let segs = effective_segments(n, segments)?;
    let bytes = out.buffer_mut();
    bytes.clear();
    write_frame_header(
        &mut dtrain_compress::wire::Writer::new(bytes),
        method,
        n,
        &segs,
    );
    Ok(segs)
}

/// The host's error for non-finite input where a kernel lowered `first_bad` (one word read
/// back) below `u32::MAX`: the first such element of `grad` and its value; `out` is cleared.
pub(crate) fn refuse_non_finite(
    gpu: &Gpu,
    grad: &GpuBuffer,
    first_bad: &[u8],
    out: &mut Payload,
) -> Result<(), DeviceError> {
    let bad = u32::from_le_bytes(first_bad[..4].try_into().expect("one word"));
    if bad == u32::MAX {
        return Ok(());
    }
    out.buffer_mut().clear();
    let index = bad as usize;
    let value = gpu.download(grad)?[index];
    Err(CompressError::NonFinite { index, value }.into())
}

/// Words as their little-endian bytes (for uploads).
pub(crate) fn u32_bytes(words: &[u32]) -> &[u8] {
    use cubecl::prelude::CubeElement;
    u32::as_bytes(words)
}
