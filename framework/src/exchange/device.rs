//! Compressed buckets encoded on a device (`[compress] device`, ARCHITECTURE.md §10): a
//! bucket whose method and memory have a device form is compensated, encoded and learnt from
//! by `dtrain_device::DevicePipeline` — its error-feedback memory lives in device memory —
//! and only the payload, the host codec's exact wire format, comes back. The collectives are
//! the host path's, unchanged, and so is the decode of every rank's payload for the methods
//! whose device payloads are the host's byte for byte: ranks on the host and on a device
//! exchange with each other.
//!
//! FFT also decodes on the device: the gathered payloads' kept values summed into one
//! spectrum there and one inverse transform per chunk (the host's joint decode, with the
//! device's transforms), the mean read back. That mean is the host's within rounding, not
//! bit for bit, so **every rank of an FFT run must decode alike**: all on devices of one
//! kind (each rank's kernels are deterministic), or all on the host. A mix of host and
//! device ranks would average within rounding of each other and their replicas would
//! drift apart (slowly: ~1e-7 relative a step, measured).
//!
//! Where the gradient comes from: a worker training on the same GPU (`cluster.device` a
//! GPU, `compress.device = "auto"`, a build that trains there) hands its gradient over as
//! one flat buffer on the device ([`DeviceGradient`], read through burn's own client,
//! [`place_codecs`]); [`Exchanger::exchange_device`] encodes each device bucket from its
//! range of it (a device-to-device copy) and reads back only the ranges of the buckets
//! the host sends (dense, or encoded on the host). Otherwise — the model on the CPU, or a
//! periodic synchronisation — the device buckets are uploaded from the host's gradient
//! (one upload per bucket and step). With the gradient on the device the average can be
//! made there too (`mean_on_device`): each device bucket's gathered payloads are decoded
//! into its range of the gradient's buffer (the host decoders' sums, bit for bit), a
//! sparse all-reduce's sum of one is kept sparse and scattered there (only its entries go
//! up), the host's averages of the other buckets are uploaded into theirs, and the
//! optimizer steps on that buffer as a burn tensor (`crate::optim_device`).
//!
//! Which buckets: every compressed one whose method and memory have a device form —
//! through the all-gather and the sparse all-reduce, a summable method's summed lanes, a
//! summed agreement (PowerSGD: `P = M·Q` on the device, all-reduced, installed, `Q_w`
//! encoded on the device, and the summed payload decoded there into the mean its memory
//! and warm start learn from) and the compressed all-reduce (each owner's range encoded on
//! the device, the memory learning from them together; the owners' sums decoded into the
//! device gradient when the mean is made there; the owner's reduce itself runs on the
//! host, on the communication thread). A codec that keeps its own error feedback (FFT)
//! cannot encode by ranges: on the compressed all-reduce it stays on the host, and says so.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;

use dtrain_compress::{Compressor, Ctx, Payload, Rng};
use serde::{Deserialize, Serialize};

use super::{ExchangeError, Exchanger, GatherCollective, Route};

#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) use imp::{open, OnDevice};

/// Whether this build can encode on a device (the `wgpu` or `cuda` feature).
pub const DEVICE_CODECS_BUILT: bool = cfg!(any(feature = "wgpu", feature = "cuda"));

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod imp {
    use super::*;
    use dtrain_compress::{CompressorConfig, MemoryConfig};
    use dtrain_device::{DeviceError, DevicePipeline, DeviceSpec, Gpu, GpuBuffer};

    /// Opens the device `spec` names (`wgpu`, `wgpu:N`, `wgpu:cpu`, `cuda:N`).
    pub(crate) fn open(spec: &str) -> Result<Gpu, String> {
        let spec: DeviceSpec = spec.parse().map_err(|e| format!("{e}"))?;
        Gpu::open(spec).map_err(|e| format!("{e}"))
    }

    /// One bucket's encoder on a device: the codec, its memory, the device it runs on.
    pub(crate) struct OnDevice {
        gpu: Gpu,
        pipe: DevicePipeline,
        /// The device buffer of the decoded mean, kept while the bucket's length stays.
        mean: Option<GpuBuffer>,
    }

    impl OnDevice {
        /// The device form of `method` with `memory` on `gpu`, or why it has none.
        pub(crate) fn new(
            gpu: &Gpu,
            method: &CompressorConfig,
            memory: &MemoryConfig,
        ) -> Result<Self, String> {
            let pipe = DevicePipeline::for_method(method, memory).map_err(|e| e.to_string())?;
            Ok(OnDevice {
                gpu: gpu.clone(),
                pipe,
                mean: None,
            })
        }

        /// The codec's moving knob after the last encode (DGC's density).
        pub(crate) fn ratio_metric(&self) -> Option<(&'static str, f64)> {
            self.pipe.ratio_metric()
        }

        /// Compresses `input` (the bucket's gradient, copied to the device) through the
        /// memory into `out`, as the host pipeline's `compress`.
        pub(crate) fn compress(
            &mut self,
            host: &dyn Compressor,
            input: &[f32],
            ctx: &Ctx<'_>,
            rng: &mut Rng,
            out: &mut Payload,
        ) -> Result<(), String> {
            let grad = self.bucket_buffer(input, None);
            self.compress_buffer(host, &grad, ctx, rng, out)
        }

        /// [`OnDevice::compress`] of `range` of a gradient that is on the device already
        /// (the bucket's range copied there, one kernel): nothing crosses to the device.
        pub(crate) fn compress_range(
            &mut self,
            host: &dyn Compressor,
            grad: &DeviceGradient,
            range: Range<usize>,
            ctx: &Ctx<'_>,
            rng: &mut Rng,
            out: &mut Payload,
        ) -> Result<(), String> {
            let part = self.bucket_buffer(&[], Some((grad, range)));
            self.compress_buffer(host, &part, ctx, rng, out)
        }

        /// The bucket's gradient on this device: `range` of the device gradient `from`
        /// (copied there), or `input` uploaded.
        fn bucket_buffer(
            &self,
            input: &[f32],
            from: Option<(&DeviceGradient, Range<usize>)>,
        ) -> GpuBuffer {
            match from {
                Some((g, r)) => self.gpu.copy_range(&g.buf, r.start, r.len()),
                None => self.gpu.upload(input),
            }
        }

        /// The shapes of the bucket's tensors and the host codec's state (PowerSGD's `Q`),
        /// told once where the bucket is placed or restored.
        pub(crate) fn adopt_plan(
            &mut self,
            shapes: &[Vec<usize>],
            host: &dyn Compressor,
        ) -> Result<(), String> {
            self.pipe.set_segment_shapes(shapes);
            self.import_state(host)
        }

        /// Takes the host codec's state (a restored checkpoint's).
        pub(crate) fn import_state(&mut self, host: &dyn Compressor) -> Result<(), String> {
            self.pipe
                .import_state(&host.export_state())
                .map_err(|e| e.to_string())
        }

        /// The codec's own state where it keeps one (PowerSGD's `Q`), for a checkpoint.
        pub(crate) fn export_state(&self) -> Option<BTreeMap<String, f64>> {
            self.pipe.export_state()
        }

        /// A summed agreement's first step on the device (PowerSGD's `P = M·Q`): the
        /// bucket's gradient (`input` uploaded, or `from` the device gradient) compensated
        /// there and this rank's message for it written into `out`, for `world` ranks.
        pub(crate) fn sum_message(
            &mut self,
            input: &[f32],
            from: Option<(&DeviceGradient, Range<usize>)>,
            world: usize,
            ctx: &Ctx<'_>,
            out: &mut Vec<f32>,
        ) -> Result<(), String> {
            let grad = self.bucket_buffer(input, from);
            self.pipe.set_world_size(world);
            self.pipe
                .sum_message(&self.gpu, &grad, ctx, out)
                .map_err(|e| e.to_string())
        }

        /// The summed messages installed and the compensated bucket encoded under them
        /// into `out` (PowerSGD's `Q_w = Mᵀ·P̂` on the device).
        pub(crate) fn encode_agreed(
            &mut self,
            summed: &[f32],
            ctx: &Ctx<'_>,
            rng: &mut Rng,
            out: &mut Payload,
        ) -> Result<(), String> {
            self.pipe
                .encode_agreed(&self.gpu, summed, ctx, rng, out)
                .map_err(|e| e.to_string())
        }

        /// The step's aggregate (`summed`, the payload with its lanes summed over the
        /// ranks) decoded into the mean on the device, which the codec and the memory learn
        /// from; the mean is then written into `range` of `into` (the device gradient, with
        /// the mean there) or returned (for the host).
        pub(crate) fn absorb_aggregate(
            &mut self,
            summed: &[u8],
            inv: f32,
            ctx: &Ctx<'_>,
            n: usize,
            into: Option<(&DeviceGradient, Range<usize>)>,
        ) -> Result<Option<Vec<f32>>, DecodeFailure> {
            let buf = self.mean_buffer(n);
            self.pipe
                .absorb_aggregate(&self.gpu, summed, inv, ctx, &buf)
                .map_err(|e| match e {
                    DeviceError::Wire(w) => DecodeFailure::Wire(ctx.rank as usize, w),
                    other => DecodeFailure::Device(other.to_string()),
                })?;
            match into {
                Some((g, r)) => {
                    self.gpu.copy_into(&buf, &g.buf, r.start);
                    Ok(None)
                }
                None => self
                    .gpu
                    .download(&buf)
                    .map(Some)
                    .map_err(|e| DecodeFailure::Device(e.to_string())),
            }
        }

        /// Whether this bucket can be encoded range by range (the compressed all-reduce):
        /// not where the codec keeps its own error feedback (FFT's spectral residual).
        pub(crate) fn encodes_ranges(&self) -> bool {
            self.pipe.encodes_ranges()
        }

        /// The compressed all-reduce's worker side on the device: the bucket's gradient
        /// (`input` uploaded, or `from` the device gradient) compensated there and each of
        /// `chunks` encoded into its payload of `out`, the memory learning from them.
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn compress_chunks(
            &mut self,
            host: &dyn Compressor,
            input: &[f32],
            from: Option<(&DeviceGradient, Range<usize>)>,
            ctx: &Ctx<'_>,
            chunks: &[Range<usize>],
            rng: &mut Rng,
            out: &mut Vec<Payload>,
        ) -> Result<(), String> {
            let grad = self.bucket_buffer(input, from);
            self.pipe
                .import_state(&host.export_state())
                .map_err(|e| e.to_string())?;
            self.pipe
                .compress_chunks(&self.gpu, &grad, ctx, chunks, rng, out)
                .map_err(|e| e.to_string())
        }

        /// The compressed all-reduce's result on the device: each owner's summed payload
        /// (`sums[q]`, owner order) decoded into its range `chunks[q]` of the bucket's
        /// `range` of `into`, and that range scaled by `inv` into the mean. Nothing comes
        /// to the host. A malformed sum is the host decoder's error, with its owner.
        pub(crate) fn decode_sums_into(
            &mut self,
            sums: &[Vec<u8>],
            chunks: &[Range<usize>],
            inv: f32,
            into: &DeviceGradient,
            range: Range<usize>,
        ) -> Result<(), DecodeFailure> {
            for (q, (sum, chunk)) in sums.iter().zip(chunks).enumerate() {
                let part = self.gpu.zeros(chunk.len());
                self.pipe
                    .decode_add(&self.gpu, sum, &part)
                    .map_err(|e| match e {
                        DeviceError::Wire(w) => DecodeFailure::Wire(q, w),
                        other => DecodeFailure::Device(other.to_string()),
                    })?;
                self.gpu
                    .copy_into(&part, &into.buf, range.start + chunk.start);
            }
            self.gpu
                .scale_range(&into.buf, range.start, range.len(), inv);
            Ok(())
        }

        /// Compresses `grad`, a buffer on this device, with the host codec's state.
        fn compress_buffer(
            &mut self,
            host: &dyn Compressor,
            grad: &GpuBuffer,
            ctx: &Ctx<'_>,
            rng: &mut Rng,
            out: &mut Payload,
        ) -> Result<(), String> {
            // The host codec's knob (FFT's θ scale after `Exchanger::scale_theta`).
            self.pipe
                .import_state(&host.export_state())
                .map_err(|e| e.to_string())?;
            self.pipe
                .compress(&self.gpu, grad, ctx, rng, out)
                .map_err(|e| e.to_string())
        }

        /// Whether `grad` is on this bucket's device (the same client).
        pub(crate) fn reaches(&self, grad: &DeviceGradient) -> bool {
            self.gpu.holds(&grad.buf)
        }

        /// The mean of the gathered `payloads` (rank order) written into `out`, decoded on
        /// the device where its codec decodes jointly there (FFT). `None` where the codec has
        /// no joint device decoder, or where the device's mean holds a NaN or an infinity:
        /// the host then decodes (overwriting `out`), and its verdict — an error naming the
        /// payload whose reconstruction is not finite — stands. A malformed payload is the
        /// host decoder's error with its rank.
        pub(crate) fn decode_mean(
            &mut self,
            payloads: &[&[u8]],
            inv: f32,
            out: &mut [f32],
        ) -> Option<Result<(), DecodeFailure>> {
            let buf = self.mean_buffer(out.len());
            let done = self
                .pipe
                .joint_decode_mean(&self.gpu, payloads, inv, &buf)?;
            let mean = done
                .map_err(|(rank, e)| match e {
                    DeviceError::Wire(w) => DecodeFailure::Wire(rank, w),
                    other => DecodeFailure::Device(other.to_string()),
                })
                .and_then(|()| {
                    self.gpu
                        .download(&buf)
                        .map_err(|e| DecodeFailure::Device(e.to_string()))
                });
            match mean {
                Ok(mean) if mean.iter().any(|v| !v.is_finite()) => None,
                Ok(mean) => {
                    out.copy_from_slice(&mean);
                    Some(Ok(()))
                }
                Err(e) => Some(Err(e)),
            }
        }

        /// The mean of the gathered `payloads` (rank order) decoded on the device and
        /// written into `range` of `into` (the device gradient's buffer, which then holds
        /// the average): nothing comes to the host. A malformed payload is the host
        /// decoder's error with its rank.
        pub(crate) fn decode_mean_into(
            &mut self,
            payloads: &[&[u8]],
            inv: f32,
            into: &DeviceGradient,
            range: Range<usize>,
        ) -> Result<(), DecodeFailure> {
            let buf = self.mean_buffer(range.len());
            self.pipe
                .decode_mean(&self.gpu, payloads, inv, &buf)
                .map_err(|(rank, e)| match e {
                    DeviceError::Wire(w) => DecodeFailure::Wire(rank, w),
                    other => DecodeFailure::Device(other.to_string()),
                })?;
            self.gpu.copy_into(&buf, &into.buf, range.start);
            Ok(())
        }

        /// The buffer of a decoded mean of `n` elements, kept while the bucket's length
        /// stays.
        fn mean_buffer(&mut self, n: usize) -> GpuBuffer {
            match &self.mean {
                Some(b) if b.len() == n => b.clone(),
                _ => self.mean.insert(self.gpu.zeros(n)).clone(),
            }
        }

        /// The memory's state, copied to the host in the host memory's format.
        pub(crate) fn export_memory(&self) -> Result<BTreeMap<u64, Vec<f32>>, String> {
            self.pipe
                .export_memory(&self.gpu)
                .map_err(|e| e.to_string())
        }

        /// Restores [`OnDevice::export_memory`] (or the host memory's export).
        pub(crate) fn import_memory(&mut self, state: &BTreeMap<u64, Vec<f32>>) {
            self.pipe.import_memory(&self.gpu, state);
        }
    }
}

/// A worker's flat gradient left on its device (`cluster.device` a GPU, `compress.device`
/// the same one): [`Exchanger::exchange_device`] encodes the buckets that have a device
/// encoder from it where it lies, and downloads only the ranges of the others. Cloning
/// shares the buffer.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[derive(Clone)]
pub struct DeviceGradient {
    gpu: dtrain_device::Gpu,
    buf: dtrain_device::GpuBuffer,
}

/// Without a device runtime in the build there is no device gradient: this type has no
/// values.
#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
pub enum DeviceGradient {}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl DeviceGradient {
    /// The gradient in `buf` on `gpu`; an error where the buffer is another device's.
    pub fn new(gpu: dtrain_device::Gpu, buf: dtrain_device::GpuBuffer) -> Result<Self, String> {
        if !gpu.holds(&buf) {
            return Err(format!("the gradient's buffer is not on {gpu}"));
        }
        Ok(DeviceGradient { gpu, buf })
    }

    /// The device it is on.
    pub fn gpu(&self) -> &dtrain_device::Gpu {
        &self.gpu
    }

    /// The buffer (what it holds after [`Exchanger::exchange_device`] with the mean on the
    /// device: the average).
    pub fn buffer(&self) -> &dtrain_device::GpuBuffer {
        &self.buf
    }
}

impl DeviceGradient {
    /// The buffer as a flat burn tensor on `device` (the model's, whose client the buffer
    /// belongs to), in place: what the exchange left there (the average) for the optimizer
    /// step on the device. An error in a build that does not train on GPUs.
    pub fn into_tensor(
        self,
        device: &dtrain_models::Device,
    ) -> Result<dtrain_models::FlatTensor, String> {
        #[cfg(any(feature = "cuda", feature = "wgpu-train"))]
        return dtrain_models::cube::tensor_over(device, self.buf.handle().clone(), self.buf.len());
        #[cfg(not(any(feature = "cuda", feature = "wgpu-train")))]
        {
            let _ = device;
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            return Err("this build does not train on GPUs".into());
            #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
            match self {}
        }
    }
}

impl DeviceGradient {
    /// Elements.
    pub fn len(&self) -> usize {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        return self.buf.len();
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        match *self {}
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first NaN or infinity and its index (`None`: every element is finite), found
    /// on the device (one word read back).
    pub fn first_non_finite(&self) -> Result<Option<(usize, f32)>, String> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        return self
            .gpu
            .first_non_finite(&self.buf)
            .map_err(|e| e.to_string());
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        match *self {}
    }

    /// Writes `values` into the buffer from element `start` (one upload of just them).
    pub fn write_range(&self, start: usize, values: &[f32]) -> Result<(), String> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        {
            if start + values.len() > self.buf.len() {
                return Err(format!(
                    "{} values at {start} do not fit {} elements",
                    values.len(),
                    self.buf.len()
                ));
            }
            let part = self.gpu.upload(values);
            self.gpu.copy_into(&part, &self.buf, start);
            Ok(())
        }
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        {
            let _ = (start, values);
            match *self {}
        }
    }

    /// Writes the mean of a sparse sum into `range`: zeros there, then each of `vals`
    /// times `k` at its index in `idx` (relative to `range`). Only the entries go up.
    pub fn scatter_mean(
        &self,
        range: Range<usize>,
        idx: &[u32],
        vals: &[f32],
        k: f32,
    ) -> Result<(), String> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        return self
            .gpu
            .scatter_scaled(&self.buf, range.start, range.len(), idx, vals, k)
            .map_err(|e| e.to_string());
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        {
            let _ = (range, idx, vals, k);
            match *self {}
        }
    }

    /// Copies `range` of the gradient into `out` (of `range`'s length).
    pub fn download_range(&self, range: Range<usize>, out: &mut [f32]) -> Result<(), String> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        {
            let v = self
                .gpu
                .download_range(&self.buf, range.start, range.len())
                .map_err(|e| e.to_string())?;
            out.copy_from_slice(&v);
            Ok(())
        }
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        {
            let _ = (range, out);
            match *self {}
        }
    }
}

/// Why a device decode failed: a malformed payload (its rank and the host decoder's error),
/// or the device itself.
#[derive(Debug)]
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub(crate) enum DecodeFailure {
    /// The payload of this rank is malformed.
    Wire(usize, dtrain_compress::WireError),
    /// The device failed (a transfer, a launch).
    Device(String),
}

/// Without a device runtime in the build there is no device encoder: this type has no
/// values, and a config naming a device is refused at validation.
#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
pub(crate) enum OnDevice {}

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
impl OnDevice {
    pub(crate) fn ratio_metric(&self) -> Option<(&'static str, f64)> {
        match *self {}
    }

    pub(crate) fn compress(
        &mut self,
        _: &dyn Compressor,
        _: &[f32],
        _: &Ctx<'_>,
        _: &mut Rng,
        _: &mut Payload,
    ) -> Result<(), String> {
        match *self {}
    }

    pub(crate) fn compress_range(
        &mut self,
        _: &dyn Compressor,
        _: &DeviceGradient,
        _: Range<usize>,
        _: &Ctx<'_>,
        _: &mut Rng,
        _: &mut Payload,
    ) -> Result<(), String> {
        match *self {}
    }

    pub(crate) fn reaches(&self, _: &DeviceGradient) -> bool {
        match *self {}
    }

    pub(crate) fn decode_mean_into(
        &mut self,
        _: &[&[u8]],
        _: f32,
        _: &DeviceGradient,
        _: Range<usize>,
    ) -> Result<(), DecodeFailure> {
        match *self {}
    }

    pub(crate) fn export_memory(&self) -> Result<BTreeMap<u64, Vec<f32>>, String> {
        match *self {}
    }

    pub(crate) fn decode_mean(
        &mut self,
        _: &[&[u8]],
        _: f32,
        _: &mut [f32],
    ) -> Option<Result<(), DecodeFailure>> {
        match *self {}
    }

    pub(crate) fn import_memory(&mut self, _: &BTreeMap<u64, Vec<f32>>) {
        match *self {}
    }

    pub(crate) fn import_state(&mut self, _: &dyn Compressor) -> Result<(), String> {
        match *self {}
    }

    pub(crate) fn encodes_ranges(&self) -> bool {
        match *self {}
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn compress_chunks(
        &mut self,
        _: &dyn Compressor,
        _: &[f32],
        _: Option<(&DeviceGradient, Range<usize>)>,
        _: &Ctx<'_>,
        _: &[Range<usize>],
        _: &mut Rng,
        _: &mut Vec<Payload>,
    ) -> Result<(), String> {
        match *self {}
    }

    pub(crate) fn decode_sums_into(
        &mut self,
        _: &[Vec<u8>],
        _: &[Range<usize>],
        _: f32,
        _: &DeviceGradient,
        _: Range<usize>,
    ) -> Result<(), DecodeFailure> {
        match *self {}
    }

    pub(crate) fn export_state(&self) -> Option<BTreeMap<String, f64>> {
        match *self {}
    }

    pub(crate) fn sum_message(
        &mut self,
        _: &[f32],
        _: Option<(&DeviceGradient, Range<usize>)>,
        _: usize,
        _: &Ctx<'_>,
        _: &mut Vec<f32>,
    ) -> Result<(), String> {
        match *self {}
    }

    pub(crate) fn encode_agreed(
        &mut self,
        _: &[f32],
        _: &Ctx<'_>,
        _: &mut Rng,
        _: &mut Payload,
    ) -> Result<(), String> {
        match *self {}
    }

    pub(crate) fn absorb_aggregate(
        &mut self,
        _: &[u8],
        _: f32,
        _: &Ctx<'_>,
        _: usize,
        _: Option<(&DeviceGradient, Range<usize>)>,
    ) -> Result<Option<Vec<f32>>, DecodeFailure> {
        match *self {}
    }
}

/// Where a run's compressed buckets were encoded (`summary.json`'s `codec_device`, and a line
/// of the run's log).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceUse {
    /// The device asked for (`wgpu:cpu (wgpu)`, `cuda:0 (cuda)`).
    pub device: String,
    /// Compressed buckets encoded there.
    pub buckets: usize,
    /// Compressed buckets in all (the rest are encoded on the host).
    pub compressed: usize,
    /// Why buckets stay on the host, once each (empty when none does).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_because: Vec<String>,
    /// Whether the worker's gradient is encoded where it lies on the device, every step
    /// (a GPU worker's own device, [`Exchanger::exchange_device`]), rather than uploaded
    /// from the host.
    #[serde(default)]
    pub gradient_in_place: bool,
}

impl DeviceUse {
    /// Adds another exchanger's placement on the same device (a Streaming DiLoCo
    /// fragment's) to this one: its buckets counted, its reasons added where new.
    pub fn absorb(&mut self, other: DeviceUse) {
        self.buckets += other.buckets;
        self.compressed += other.compressed;
        for why in other.host_because {
            if !self.host_because.contains(&why) {
                self.host_because.push(why);
            }
        }
    }
}

impl fmt::Display for DeviceUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "compress.device = {}: {} of {} compressed buckets encoded there",
            self.device, self.buckets, self.compressed
        )?;
        if !self.host_because.is_empty() {
            write!(f, "; on the host: {}", self.host_because.join("; "))?;
        }
        if self.gradient_in_place {
            write!(
                f,
                "; the gradient stays on the device (only payloads and the host's buckets \
                 cross), its average is made there and the optimizer steps there"
            )?;
        }
        Ok(())
    }
}

/// Places `exchanger`'s compressed buckets on the device `spec` names
/// (`Exchanger::set_codec_device`, in a build with a device runtime); in a build without
/// device codecs an error saying how to build them.
///
/// With `model`, the device the worker's model is on when `spec` names it too: where it is a
/// GPU of a build that trains there, the codecs run on burn's client for it, so that the
/// worker's gradient can be encoded where it lies ([`Exchanger::exchange_device`]);
/// [`DeviceUse::gradient_in_place`] then says whether a bucket would read it.
pub fn place_codecs(
    exchanger: &mut Exchanger,
    spec: &str,
    model: Option<&dtrain_models::Device>,
) -> Result<DeviceUse, String> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return match model
        .map(|d| crate::device::model_gpu(d, spec))
        .transpose()?
        .flatten()
    {
        Some(gpu) => {
            let mut used = exchanger.set_codec_gpu(&gpu);
            used.gradient_in_place = exchanger.reads_device_gradient();
            Ok(used)
        }
        None => exchanger.set_codec_device(spec),
    };
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (exchanger, model);
        Err(format!(
            "{spec}: this dtrain was built without device codecs; rebuild it with \
             `--features wgpu` or `--features cuda`"
        ))
    }
}

/// `ranges` sorted, adjacent ones joined.
fn merged(ranges: impl IntoIterator<Item = Range<usize>>) -> Vec<Range<usize>> {
    let mut ranges: Vec<Range<usize>> = ranges.into_iter().collect();
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::new();
    for r in ranges {
        match out.last_mut() {
            Some(m) if m.end == r.start => m.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

/// Why a bucket on `route` cannot be encoded by `d` on the device (`None`: it can).
fn route_refuses(route: Route, d: &OnDevice) -> Option<&'static str> {
    match route {
        Route::Compressed(GatherCollective::CompressedAllReduce) if !d.encodes_ranges() => Some(
            "the compressed all-reduce encodes each owner's range, and a codec that keeps its \
             own error feedback (FFT's spectral residual) keeps it per bucket: on the host",
        ),
        _ => None,
    }
}

impl Exchanger {
    /// Encodes the compressed buckets on the device `spec` names (`wgpu`, `wgpu:N`,
    /// `wgpu:cpu`, `cuda:N`) where the method and its memory have a device form and the
    /// bucket's route encodes it whole; the others stay on the host, and the returned
    /// [`DeviceUse`] says why. Call it after the routes are chosen
    /// ([`Exchanger::choose_collectives`]); a bucket's memory so far goes with it. An error
    /// where the device cannot be opened.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    pub fn set_codec_device(&mut self, spec: &str) -> Result<DeviceUse, String> {
        let used = self.set_codec_gpu(&open(spec)?);
        // A device of the codecs' own: no worker's gradient lies there.
        self.gradient_in_place = false;
        Ok(used)
    }

    /// [`Exchanger::set_codec_device`] on `gpu`, opened already: the worker's own device
    /// over burn's client ([`dtrain_device::Gpu::with_client`]), whose gradient buffers
    /// [`Exchanger::exchange_device`] then reads where they lie
    /// ([`Exchanger::reads_device_gradient`]).
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    pub fn set_codec_gpu(&mut self, gpu: &dtrain_device::Gpu) -> DeviceUse {
        let mut why = Vec::new();
        for s in &mut self.slots {
            let Some(pipe) = &s.pipe else { continue };
            let placed = OnDevice::new(gpu, &self.method_cfg, &self.memory).and_then(|mut d| {
                if let Some(r) = route_refuses(s.route, &d) {
                    return Err(r.to_string());
                }
                d.adopt_plan(&s.shapes, pipe.compressor())?;
                d.import_memory(&pipe.export_memory());
                Ok(d)
            });
            match placed {
                Ok(d) => s.device = Some(d),
                Err(e) => why.push(e),
            }
        }
        why.dedup();
        let device = gpu.to_string();
        let used = DeviceUse {
            device: device.clone(),
            buckets: self.slots.iter().filter(|s| s.device.is_some()).count(),
            compressed: self.slots.iter().filter(|s| s.pipe.is_some()).count(),
            host_because: why.clone(),
            gradient_in_place: false,
        };
        self.device = Some((device, why));
        self.gradient_in_place = true;
        used
    }

    /// Copies into `grad` the ranges of `on_device` that the host needs: every bucket's
    /// but those encoded from the device gradient where it lies (`Slot::reads_device`),
    /// adjacent ranges in one read. An error where such a bucket's device is not the
    /// gradient's.
    pub(super) fn download_host_ranges(
        &self,
        on_device: &DeviceGradient,
        grad: &mut [f32],
    ) -> Result<(), ExchangeError> {
        let mut ranges: Vec<Range<usize>> = Vec::new();
        for s in &self.slots {
            if s.reads_device() {
                let d = s.device.as_ref().expect("reads_device");
                if !d.reaches(on_device) {
                    return Err(ExchangeError::Device {
                        bucket: s.bucket.id,
                        reason: "the gradient is on another device than the bucket's encoder"
                            .into(),
                    });
                }
                continue;
            }
            ranges.extend(s.bucket.flat_ranges.iter().cloned());
        }
        for r in merged(ranges) {
            on_device
                .download_range(r.clone(), &mut grad[r])
                .map_err(|reason| ExchangeError::Device { bucket: 0, reason })?;
        }
        Ok(())
    }

    /// Writes into `on_device` the averages the host made (every bucket's but those
    /// decoded on the device, `decoded[i]`), adjacent ranges in one upload, and says
    /// whether the whole average there has a NaN or an infinity (one pass on the device).
    pub(super) fn upload_host_means(
        &self,
        on_device: &DeviceGradient,
        grad: &[f32],
        decoded: &[bool],
    ) -> Result<bool, ExchangeError> {
        let ranges = self
            .slots
            .iter()
            .zip(decoded.iter().chain(std::iter::repeat(&false)))
            .filter(|(_, &d)| !d)
            .flat_map(|(s, _)| s.bucket.flat_ranges.iter().cloned());
        let device_err = |reason| ExchangeError::Device { bucket: 0, reason };
        for r in merged(ranges) {
            on_device
                .write_range(r.start, &grad[r])
                .map_err(device_err)?;
        }
        Ok(on_device.first_non_finite().map_err(device_err)?.is_some())
    }

    /// Where the compressed buckets are encoded, when a device was set.
    pub fn codec_device(&self) -> Option<DeviceUse> {
        let (device, why) = self.device.as_ref()?;
        Some(DeviceUse {
            device: device.clone(),
            buckets: self.slots.iter().filter(|s| s.device.is_some()).count(),
            compressed: self.slots.iter().filter(|s| s.pipe.is_some()).count(),
            host_because: why.clone(),
            gradient_in_place: false,
        })
    }

    /// Moves to the host the buckets whose route (restored from a checkpoint after
    /// `Exchanger::set_codec_device`) the device cannot encode. Their memory is the
    /// host's already: a restored memory goes to both.
    pub(super) fn settle_devices(&mut self) {
        for s in &mut self.slots {
            if let Some(d) = &s.device {
                if let Some(r) = route_refuses(s.route, d) {
                    s.device = None;
                    if let Some((_, why)) = &mut self.device {
                        if !why.iter().any(|n| n == r) {
                            why.push(r.to_string());
                        }
                    }
                }
            }
        }
    }
}
