//! A device codec and its memory composed as the trainer uses them: the device half of
//! `dtrain_compress::Pipeline` for the one-phase methods and the summed agreements
//! (PowerSGD: `sum_message`, `encode_agreed`, `absorb_aggregate`, the host pipeline's
//! protocol with the compensated bucket and the mean on the device).
//!
//! `compress`: `p = compensate(g)`, `payload = C(p)`, then the memory learns what was sent —
//! the payload decoded on the device into zeros, `t`, and `e ← p − t` — as the host
//! pipeline does with its payload. Nothing but the payload leaves the device.
//!
//! `decode_mean`: the receivers' side of an all-gather — every worker's payload, in rank
//! order, decoded and summed on the device, times `1/P`, then the method's
//! [`Combine::finish`] (signSGD's majority vote): the host's `decompress_mean` and
//! `Combine::finish`, operation for operation.

use std::collections::BTreeMap;

use cubecl::prelude::*;
use std::ops::Range;

use dtrain_compress::{chunk_segments, Combine, CompressorConfig, Ctx, MemoryConfig, Payload, Rng};

use crate::codec::{device_codec, DeviceCodec};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::memory::DeviceMemory;
use crate::words::{geometry, grid_stride};

/// `x *= k`.
#[cube(launch)]
fn scale_in_place(x: &mut [f32], k: f32) {
    let mut i = ABSOLUTE_POS;
    while i < x.len() {
        x[i] *= k;
        i += grid_stride();
    }
}

/// `x = sign(x)` ∈ {−1, 0, +1}, zeros (either sign) to +0 and a NaN kept (the host's
/// majority vote, `Combine::finish`).
#[cube(launch)]
fn majority_sign(x: &mut [f32]) {
    let mut i = ABSOLUTE_POS;
    while i < x.len() {
        let v = x[i];
        let mut s = v;
        if v > 0.0 {
            s = 1.0f32;
        } else if v < 0.0 {
            s = -1.0f32;
        } else if v == 0.0 {
            s = 0.0f32;
        }
        x[i] = s;
        i += grid_stride();
    }
}

/// A device codec with residual error feedback (or none).
pub struct DevicePipeline {
    codec: Box<dyn DeviceCodec>,
    combine: Combine,
    memory: Option<DeviceMemory>,
    /// `p` and `t` of the last bucket, reused while its length stays.
    compensated: Option<GpuBuffer>,
    transmitted: Option<GpuBuffer>,
    /// The compensated bucket of a summed agreement in progress (from
    /// [`DevicePipeline::sum_message`] to [`DevicePipeline::absorb_aggregate`]).
    agreed: Option<GpuBuffer>,
    /// Whether the codec keeps the error feedback itself (FFT's spectral residual).
    adopted: bool,
}

impl DevicePipeline {
    /// The device codec of `cfg`'s method with `memory` (none, the residual, or DGC's
    /// momentum-corrected memory); a method without a device codec, and another memory,
    /// have no device form yet and are refused by name.
    pub fn for_method(cfg: &CompressorConfig, memory: &MemoryConfig) -> Result<Self, DeviceError> {
        let mut codec = device_codec(cfg).ok_or(DeviceError::NoCodec {
            method: cfg.name(),
            hint: crate::codec::device_form(cfg),
        })?;
        let combine = cfg.build()?.combine();
        // Classic residual feedback is offered to the codec first, as the host pipeline
        // offers it (FFT keeps it as spectra).
        let classic = matches!(memory, MemoryConfig::Residual { beta, gamma } if *beta == 1.0 && *gamma == 1.0);
        let adopted = classic && codec.adopt_error_feedback();
        let memory = if adopted {
            None
        } else {
            DeviceMemory::for_config(memory)?
        };
        Ok(DevicePipeline {
            codec,
            combine,
            memory,
            compensated: None,
            transmitted: None,
            agreed: None,
            adopted,
        })
    }

    /// Whether [`DevicePipeline::compress_chunks`] can encode a bucket range by range: its
    /// error feedback, if any, is a memory over the bucket (a codec that keeps its own,
    /// FFT's spectral residual, keeps it per bucket only).
    pub fn encodes_ranges(&self) -> bool {
        !self.adopted
    }

    /// Decodes `payload` and adds the values into `out`, as the host's `decompress_add`.
    pub fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError> {
        self.codec.decode_add(gpu, payload, out)
    }

    /// Compressed all-reduce, worker side (the host pipeline's `compress_chunks`): `grad`
    /// compensated by the memory, each range of `chunks` (one per owner, in order, tiling
    /// the bucket) encoded into its own payload of `out` with the layer boundaries inside
    /// it, and the memory learning from their decodes put together. An error where the
    /// chunks do not tile the bucket, or the codec keeps its own error feedback
    /// ([`DevicePipeline::encodes_ranges`]).
    pub fn compress_chunks(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        chunks: &[Range<usize>],
        rng: &mut Rng,
        out: &mut Vec<Payload>,
    ) -> Result<(), DeviceError> {
        let n = grad.len();
        if chunks.first().map_or(n != 0, |c| c.start != 0)
            || chunks.windows(2).any(|w| w[0].end != w[1].start)
            || chunks.last().map_or(0, |c| c.end) != n
        {
            return Err(dtrain_compress::CompressError::Agreement(format!(
                "the chunks {chunks:?} do not tile a buffer of {n} elements"
            ))
            .into());
        }
        if self.adopted {
            return Err(DeviceError::NoMemory(
                "a codec's own error feedback over a bucket's ranges".into(),
            ));
        }
        let p = match &mut self.memory {
            Some(memory) => {
                let p = reuse(&mut self.compensated, gpu, n);
                memory.compensate(gpu, ctx.bucket, grad, &p)?;
                p
            }
            None => grad.clone(),
        };
        out.resize_with(chunks.len(), Payload::new);
        let mut segs = Vec::new();
        for (chunk, payload) in chunks.iter().zip(out.iter_mut()) {
            chunk_segments(ctx.segments, chunk.clone(), &mut segs);
            let sub = Ctx {
                segments: &segs,
                ..*ctx
            };
            let part = gpu.copy_range(&p, chunk.start, chunk.len());
            self.codec.encode(gpu, &part, &sub, rng, payload)?;
        }
        let Some(memory) = &mut self.memory else {
            return Ok(());
        };
        // What was sent, range by range, into one buffer: the memory learns from it.
        let t = reuse(&mut self.transmitted, gpu, n);
        gpu.fill_zero(&t);
        for (chunk, payload) in chunks.iter().zip(out.iter()) {
            let part = gpu.zeros(chunk.len());
            self.codec.decode_add(gpu, payload.as_bytes(), &part)?;
            gpu.copy_into(&part, &t, chunk.start);
        }
        memory.update(gpu, ctx.bucket, &p, &t, ctx.segments)
    }

    /// The shapes of the bucket's tensors, one per segment ([`DeviceCodec::set_segment_shapes`]).
    pub fn set_segment_shapes(&mut self, shapes: &[Vec<usize>]) {
        self.codec.set_segment_shapes(shapes);
    }

    /// The number of ranks exchanging ([`DeviceCodec::set_world_size`]).
    pub fn set_world_size(&mut self, world: usize) {
        self.codec.set_world_size(world);
    }

    /// The codec's own state, where it keeps one ([`DeviceCodec::export_state`]).
    pub fn export_state(&self) -> Option<BTreeMap<String, f64>> {
        self.codec.export_state()
    }

    /// The codec's moving knob after the last encode ([`DeviceCodec::ratio_metric`]).
    pub fn ratio_metric(&self) -> Option<(&'static str, f64)> {
        self.codec.ratio_metric()
    }

    /// The error-feedback state in the host pipeline's `export_memory` format, wherever it
    /// is kept (the memory, or the codec that adopted it), copied to the host.
    pub fn export_memory(&self, gpu: &Gpu) -> Result<BTreeMap<u64, Vec<f32>>, DeviceError> {
        match &self.memory {
            Some(m) => m.export(gpu),
            None => self.codec.export_feedback(gpu),
        }
    }

    /// Restores [`DevicePipeline::export_memory`] (or the host pipeline's).
    pub fn import_memory(&mut self, gpu: &Gpu, state: &BTreeMap<u64, Vec<f32>>) {
        match &mut self.memory {
            Some(m) => m.import(gpu, state),
            None => self.codec.import_feedback(gpu, state),
        }
    }

    /// Takes the host codec's knob state (`Compressor::export_state`: FFT's θ scale), so that
    /// both encode alike.
    pub fn import_state(&mut self, state: &BTreeMap<String, f64>) -> Result<(), DeviceError> {
        self.codec.import_state(state)
    }

    /// The memory, where there is one.
    pub fn memory(&self) -> Option<&DeviceMemory> {
        self.memory.as_ref()
    }

    /// The memory, mutably (to restore a checkpoint).
    pub fn memory_mut(&mut self) -> Option<&mut DeviceMemory> {
        self.memory.as_mut()
    }

    /// Compresses the gradient `grad` of bucket `ctx.bucket` (layer boundaries
    /// `ctx.segments`) through the memory into `out` with the encoder's `rng`, and updates
    /// the memory — as the host pipeline's `compress`.
    pub fn compress(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let Some(memory) = &mut self.memory else {
            return self.codec.encode(gpu, grad, ctx, rng, out);
        };
        let key = ctx.bucket;
        let n = grad.len();
        let p = reuse(&mut self.compensated, gpu, n);
        memory.compensate(gpu, key, grad, &p)?;
        self.codec.encode(gpu, &p, ctx, rng, out)?;
        let t = reuse(&mut self.transmitted, gpu, n);
        gpu.fill_zero(&t);
        self.codec.decode_add(gpu, out.as_bytes(), &t)?;
        memory.update(gpu, key, &p, &t, ctx.segments)
    }
}

impl DevicePipeline {
    /// Summed agreement, step 1 (the host pipeline's `compensate` and `sum_message`): the
    /// gradient `grad` of bucket `ctx.bucket` compensated by the memory (kept until the
    /// aggregate comes back), and this rank's message for it written into `out`.
    pub fn sum_message(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        out: &mut Vec<f32>,
    ) -> Result<(), DeviceError> {
        let p = match &mut self.memory {
            Some(memory) => {
                let p = reuse(&mut self.compensated, gpu, grad.len());
                memory.compensate(gpu, ctx.bucket, grad, &p)?;
                p
            }
            None => grad.clone(),
        };
        self.codec.sum_message(gpu, &p, ctx, out)?;
        self.agreed = Some(p);
        Ok(())
    }

    /// Summed agreement, steps 3 and 4 (the host's `install_sum` and
    /// `compress_compensated`): the summed messages installed, the compensated bucket
    /// encoded under them into `out`. The memory waits for the aggregate.
    pub fn encode_agreed(
        &mut self,
        gpu: &Gpu,
        summed: &[f32],
        ctx: &Ctx<'_>,
        rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let p = self.agreed.clone().ok_or_else(|| {
            DeviceError::Compress(dtrain_compress::CompressError::Agreement(
                "an agreement installed before its message was made".into(),
            ))
        })?;
        self.codec.install_sum(summed, p.len(), ctx)?;
        self.codec.encode(gpu, &p, ctx, rng, out)
    }

    /// Summed agreement, the end (the host's `absorb_aggregate`): `summed`, the payload
    /// with its lanes summed over the ranks, decoded on the device into `mean` (times
    /// `inv`), which the codec (its warm start) and the memory (`e = p − mean`) learn from.
    /// On a malformed `summed` the error is the host decoder's.
    pub fn absorb_aggregate(
        &mut self,
        gpu: &Gpu,
        summed: &[u8],
        inv: f32,
        ctx: &Ctx<'_>,
        mean: &GpuBuffer,
    ) -> Result<(), DeviceError> {
        self.decode_mean(gpu, &[summed], inv, mean)
            .map_err(|(_, e)| e)?;
        self.codec.absorb_aggregate(summed, ctx);
        let p = self.agreed.take();
        if let (Some(memory), Some(p)) = (&mut self.memory, p) {
            memory.update(gpu, ctx.bucket, &p, mean, ctx.segments)?;
        }
        Ok(())
    }

    /// The mean of `payloads` (every worker's, in rank order) written into `out`: decoded
    /// and summed on the device, times `inv` (`1/P`), then the method's combination (the
    /// majority vote's sign). On a malformed payload the error carries its index and `out`
    /// holds part of the sum.
    pub fn decode_mean(
        &self,
        gpu: &Gpu,
        payloads: &[&[u8]],
        inv: f32,
        out: &GpuBuffer,
    ) -> Result<(), (usize, DeviceError)> {
        let (count, dim) = geometry(out.len());
        match self.codec.decode_mean(gpu, payloads, inv, out) {
            Some(mean) => mean?,
            None => {
                gpu.fill_zero(out);
                for (i, p) in payloads.iter().enumerate() {
                    self.codec.decode_add(gpu, p, out).map_err(|e| (i, e))?;
                }
                scale_in_place::launch(gpu.client(), count.clone(), dim, out.arg(), inv);
            }
        }
        if self.combine == Combine::MajorityVote {
            majority_sign::launch(gpu.client(), count, dim, out.arg());
        }
        Ok(())
    }
}

impl DevicePipeline {
    /// [`DevicePipeline::decode_mean`] where the codec decodes jointly on the device (FFT's
    /// summed spectra and inverse transforms) and the method averages by the mean; `None`
    /// where it does not (the host's decoders are then as fast and bit for bit the same).
    pub fn joint_decode_mean(
        &self,
        gpu: &Gpu,
        payloads: &[&[u8]],
        inv: f32,
        out: &GpuBuffer,
    ) -> Option<Result<(), (usize, DeviceError)>> {
        if self.combine != Combine::Mean {
            return None;
        }
        self.codec.decode_mean(gpu, payloads, inv, out)
    }
}

/// `slot`'s buffer when it has `n` elements, else a new one kept there.
fn reuse(slot: &mut Option<GpuBuffer>, gpu: &Gpu, n: usize) -> GpuBuffer {
    match slot {
        Some(b) if b.len() == n => b.clone(),
        _ => slot.insert(gpu.zeros(n)).clone(),
    }
}
