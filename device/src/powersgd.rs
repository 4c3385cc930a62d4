//! `powersgd` on the device: rank-r PowerSGD's products where the bucket lies (the host
//! codec `dtrain_compress::powersgd`, its specification).
//!
//! The work of a step is three products per matrix `M` (`m × c`): `P = M·Q` (`m × r`),
//! `Q_w = Mᵀ·P̂` (`c × r`) and, to decode, `P̂·Qᵀ` added into the `m × c` output; they run
//! here, one unit per output value summing in the host's order (so that a payload is the
//! host's byte for byte where the device does not contract a multiply and an add into one
//! fused operation, as lavapipe does not; CUDA's compiler does, which moves last bits).
//! What is `O((m + c)·r²)` stays with the host codec, which this codec drives
//! (`PowerSgd::begin_plans` and the hooks after it): the plans, `Q`'s draw and its
//! orthogonalization, `P̂`'s Gram–Schmidt in `f64`, the payload's writing, the warm-started
//! `Q` and its checkpoint state. So `P` (`m·r` values) comes to the host and `P̂` goes back;
//! the matrix never does. Dense segments (biases, and every segment before `start_step`)
//! are read back as they are: the payload carries them.
//!
//! Alone (`dtrain bench compress --device`, a single process), `P̂` comes from the worker's
//! own `M`, as on the host. In a multi-rank exchange `P` is all-reduced between the two
//! products: [`DeviceCodec::sum_message`] computes it, [`DeviceCodec::install_sum`] takes the
//! sum (the host codec's checks and Gram–Schmidt), and the encode then only computes `Q_w`;
//! [`DeviceCodec::absorb_aggregate`] warm-starts the next step from the summed `Q`s. The
//! codec's host `PowerSgd` holds `Q`, so [`DeviceCodec::export_state`] is its state.
//!
//! Decoding reads each segment with the host codec's reader (`read_segment`: its checks
//! and errors), uploads `P̂` and `Q` (or the dense values) and adds on the device.

use cubecl::prelude::*;
use dtrain_compress::powersgd::{read_segment, PowerSgd, PowerSgdConfig, Segment};
use dtrain_compress::wire::Writer;
use dtrain_compress::{
    read_frame, CompressError, Compressor, Ctx, Method, MethodId, Payload, Rng, WireError,
};

use crate::codec::{begin_payload, DeviceCodec};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride};

/// `out[out_at + i·r + k] = Σ_j a[a_at + i·cols + j] · b[j·r + k]` for the `len = rows·r`
/// values of `P = M·Q`, `j` ascending from a sum of `+0` (the host's `mat_mul`).
#[cube(launch)]
fn mat_mul(a: &[f32], a_at: u32, cols: u32, b: &[f32], r: u32, out: &mut [f32], out_at: u32, len: u32) {
    let mut t = ABSOLUTE_POS;
    while t < len as usize {
        let i = t / r as usize;
        let k = t % r as usize;
        let row = a_at as usize + i * cols as usize;
        let mut acc = 0.0f32;
        let mut j = 0usize;
        while j < cols as usize {
            acc += a[row + j] * b[j * r as usize + k];
            j += 1;
        }
        out[out_at as usize + t] = acc;
        t += grid_stride();
    }
}

/// `out[j·r + k] = Σ_i a[a_at + i·cols + j] · b[b_at + i·r + k]` for the `len = cols·r`
/// values of `Q_w = Mᵀ·P̂`, `i` ascending from `+0` (the host's `mat_t_mul`).
#[cube(launch)]
fn mat_t_mul(
    a: &[f32],
    a_at: u32,
    rows: u32,
    cols: u32,
    b: &[f32],
    b_at: u32,
    r: u32,
    out: &mut [f32],
    out_at: u32,
    len: u32,
) {
    let mut t = ABSOLUTE_POS;
    while t < len as usize {
        let j = t / r as usize;
        let k = t % r as usize;
        let mut acc = 0.0f32;
        let mut i = 0usize;
        while i < rows as usize {
            acc += a[a_at as usize + i * cols as usize + j] * b[b_at as usize + i * r as usize + k];
            i += 1;
        }
        out[out_at as usize + t] = acc;
        t += grid_stride();
    }
}

/// `out[at + i·c + j] += Σ_k p[i·r + k] · q[j·r + k]` for the `len = m·c` values of one
/// segment, the sum over `k` made first from `+0` (the host's `add_outer`).
#[cube(launch)]
fn add_outer(p: &[f32], q: &[f32], r: u32, c: u32, out: &mut [f32], at: u32, len: u32) {
    let mut t = ABSOLUTE_POS;
    while t < len as usize {
        let i = t / c as usize;
        let j = t % c as usize;
        let mut sum = 0.0f32;
        let mut k = 0usize;
        while k < r as usize {
            sum += p[i * r as usize + k] * q[j * r as usize + k];
            k += 1;
        }
        out[at as usize + t] += sum;
        t += grid_stride();
    }
}

/// `out[at + i] += v[i]`.
#[cube(launch)]
fn add_at(v: &[f32], out: &mut [f32], at: u32) {
    let mut i = ABSOLUTE_POS;
    while i < v.len() {
        out[at as usize + i] += v[i];
        i += grid_stride();
    }
}

/// The `powersgd` device codec: the host codec's state, the device's products.
#[derive(Debug, Clone)]
pub struct PowerSgdCodec {
    host: PowerSgd,
}

impl PowerSgdCodec {
    /// The codec of a checked config.
    pub fn for_config(cfg: &PowerSgdConfig) -> Self {
        PowerSgdCodec {
            host: PowerSgd::new(cfg.clone()),
        }
    }
}

/// One segment of the bucket being encoded.
#[derive(Debug, Clone, Copy)]
struct Part {
    /// Its first element in the bucket.
    start: usize,
    /// Its elements.
    len: usize,
    /// Its matrix `(m, c)` where it is sent low-rank.
    shape: Option<(usize, usize)>,
}

impl PowerSgdCodec {
    /// The bucket's segments as the encoder sees them (`segs`, tiling the bucket), with
    /// the matrices of those sent low-rank at the step begun; an error where a segment does
    /// not hold its tensor's elements.
    fn parts(&self, segs: &[std::ops::Range<usize>]) -> Result<Vec<Part>, DeviceError> {
        segs.iter()
            .enumerate()
            .map(|(s, seg)| {
                let shape = self.host.low_rank_shape(s);
                match shape {
                    Some((m, c)) if m * c != seg.len() => Err(DeviceError::Length {
                        what: "powersgd: a segment against its tensor's shape",
                        expected: m * c,
                        found: seg.len(),
                    }),
                    _ => Ok(Part {
                        start: seg.start,
                        len: seg.len(),
                        shape,
                    }),
                }
            })
            .collect()
    }

    /// `P = M·Q` of every low-rank segment of `grad`, in order (`Σ m·r` values), computed
    /// on the device and read back once.
    fn p_of(&mut self, gpu: &Gpu, grad: &GpuBuffer, parts: &[Part], ctx: &Ctx<'_>) -> Result<Vec<f32>, DeviceError> {
        let r = self.host.rank_r();
        let total: usize = parts.iter().filter_map(|p| p.shape).map(|(m, _)| m * r).sum();
        if total == 0 {
            return Ok(Vec::new());
        }
        let p = gpu.empty(total);
        let mut at = 0;
        for (s, part) in parts.iter().enumerate() {
            let Some((m, c)) = part.shape else { continue };
            let q = gpu.upload(self.host.q_for(s, c, ctx));
            let (count, dim) = geometry(m * r);
            mat_mul::launch(
                gpu.client(),
                count,
                dim,
                grad.arg(),
                part.start as u32,
                c as u32,
                q.arg(),
                r as u32,
                p.arg(),
                at as u32,
                (m * r) as u32,
            );
            at += m * r;
        }
        gpu.download(&p)
    }
}

impl DeviceCodec for PowerSgdCodec {
    fn method(&self) -> MethodId {
        PowerSgdConfig::ID
    }

    fn set_segment_shapes(&mut self, shapes: &[Vec<usize>]) {
        self.host.set_segment_shapes(shapes);
    }

    fn set_world_size(&mut self, world: usize) {
        self.host.set_world_size(world);
    }

    fn sum_message(
        &mut self,
        gpu: &Gpu,
        p: &GpuBuffer,
        ctx: &Ctx<'_>,
        out: &mut Vec<f32>,
    ) -> Result<(), DeviceError> {
        // The host's check: as many segments as tensor shapes.
        let n_segs = ctx.segments.len().max(1);
        if n_segs != self.host.plan_count() {
            return Err(CompressError::Agreement(format!(
                "powersgd: {n_segs} segments, {} tensor shapes",
                self.host.plan_count()
            ))
            .into());
        }
        let segs = dtrain_compress::compressor::effective_segments(p.len(), ctx.segments)?;
        // Begun as the encode begins: the plans fixed, whether the step compresses.
        self.host.begin_plans(ctx);
        let parts = self.parts(&segs)?;
        *out = self.p_of(gpu, p, &parts, ctx)?;
        Ok(())
    }

    fn install_sum(&mut self, summed: &[f32], n: usize, ctx: &Ctx<'_>) -> Result<(), DeviceError> {
        Ok(self.host.install_sum(summed, n, ctx)?)
    }

    fn absorb_aggregate(&mut self, summed: &[u8], ctx: &Ctx<'_>) {
        self.host.absorb_aggregate(summed, ctx);
    }

    fn export_state(&self) -> Option<std::collections::BTreeMap<String, f64>> {
        Some(self.host.export_state())
    }

    fn import_state(
        &mut self,
        state: &std::collections::BTreeMap<String, f64>,
    ) -> Result<(), DeviceError> {
        self.host
            .import_state(state)
            .map_err(|e| CompressError::Agreement(format!("restoring powersgd's Q: {e}")).into())
    }

    fn encode(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        _rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let segs = begin_payload(PowerSgdConfig::ID, grad.len(), ctx.segments, out)?;
        if let Some((index, value)) = gpu.first_non_finite(grad)? {
            out.buffer_mut().clear();
            return Err(CompressError::NonFinite { index, value }.into());
        }
        if segs.is_empty() {
            return Ok(());
        }
        let needs_p = self.host.begin_plans(ctx);
        let r = self.host.rank_r();
        let parts = self.parts(&segs)?;
        // The low-rank segments: (segment, start, m, c).
        let low_rank: Vec<(usize, usize, usize, usize)> = parts
            .iter()
            .enumerate()
            .filter_map(|(s, p)| p.shape.map(|(m, c)| (s, p.start, m, c)))
            .collect();
        if needs_p {
            // Alone: P̂ from this worker's own M.
            let p = self.p_of(gpu, grad, &parts, ctx)?;
            self.host.install_p(&p, ctx);
        }
        // Q_w of every low-rank segment from the installed P̂, in one buffer read back once.
        let mut q_all = Vec::new();
        let mut q_at = Vec::with_capacity(low_rank.len());
        if !low_rank.is_empty() {
            let p_hat: Vec<f32> = low_rank
                .iter()
                .flat_map(|&(s, ..)| self.host.p_hat_of(s).iter().copied())
                .collect();
            let p_hat = gpu.upload(&p_hat);
            let total: usize = low_rank.iter().map(|&(_, _, _, c)| c * r).sum();
            let q = gpu.empty(total);
            let (mut p_at, mut at) = (0, 0);
            for &(_, start, m, c) in &low_rank {
                let (count, dim) = geometry(c * r);
                mat_t_mul::launch(
                    gpu.client(),
                    count,
                    dim,
                    grad.arg(),
                    start as u32,
                    m as u32,
                    c as u32,
                    p_hat.arg(),
                    p_at as u32,
                    r as u32,
                    q.arg(),
                    at as u32,
                    (c * r) as u32,
                );
                q_at.push(at);
                p_at += m * r;
                at += c * r;
            }
            q_all = gpu.download(&q)?;
        }
        // The dense segments' values, gathered into one buffer read back once.
        let dense_len: usize = parts.iter().filter(|p| p.shape.is_none()).map(|p| p.len).sum();
        let dense = if dense_len == grad.len() {
            gpu.download(grad)?
        } else if dense_len > 0 {
            let buf = gpu.empty(dense_len);
            let mut at = 0;
            for p in parts.iter().filter(|p| p.shape.is_none()) {
                gpu.copy_into(&gpu.copy_range(grad, p.start, p.len), &buf, at);
                at += p.len;
            }
            gpu.download(&buf)?
        } else {
            Vec::new()
        };
        let mut w = Writer::new(out.buffer_mut());
        let (mut low, mut d_at) = (0, 0);
        for (s, p) in parts.iter().enumerate() {
            match p.shape {
                Some((_, c)) => {
                    let at = q_at[low];
                    self.host
                        .write_low_rank(s, q_all[at..at + c * r].to_vec(), &mut w);
                    low += 1;
                }
                None => {
                    self.host.write_dense(s, &dense[d_at..d_at + p.len], &mut w);
                    d_at += p.len;
                }
            }
        }
        Ok(())
    }

    fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError> {
        let (mut r, segs) = read_frame(PowerSgdConfig::ID, payload, out.len())?;
        // Every segment read (and checked) on the host before anything is added.
        let bodies = segs
            .iter()
            .map(|seg| read_segment(&mut r, seg.len()))
            .collect::<Result<Vec<_>, _>>()?;
        if r.remaining() > 0 {
            return Err(WireError::TrailingBytes(r.remaining()).into());
        }
        for (seg, body) in segs.iter().zip(bodies) {
            match body {
                Segment::Dense(v) => {
                    let (count, dim) = geometry(v.len());
                    add_at::launch(
                        gpu.client(),
                        count,
                        dim,
                        gpu.upload(&v).arg(),
                        out.arg(),
                        seg.start as u32,
                    );
                }
                Segment::LowRank { m, c, rank, p, q } => {
                    let (count, dim) = geometry(m * c);
                    add_outer::launch(
                        gpu.client(),
                        count,
                        dim,
                        gpu.upload(&p).arg(),
                        gpu.upload(&q).arg(),
                        rank as u32,
                        c as u32,
                        out.arg(),
                        seg.start as u32,
                        (m * c) as u32,
                    );
                }
            }
        }
        Ok(())
    }

    fn host_parts(&self) -> Option<&'static str> {
        Some("Q's draw, P̂'s Gram–Schmidt (m·r values) and the payload's writing")
    }
}
