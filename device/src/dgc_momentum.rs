//! DGC's momentum-corrected memory on the device (the host's `memory::DgcMemory`, ALGORITHMS.md
//! §10.2): per bucket a local momentum `u` and a velocity `v` in device memory.
//!
//! ```text
//! compensate:  g ← clamp(g, −c, c)   (clip = "value"; none: g as it is)
//!              u ← m·u + g, v ← v + u          (Nesterov: u ← m·(u + g), v ← v + (u + g))
//!              p = v
//! update:      v ← p − t; u[j] ← 0 where t[j] ≠ 0, in segments that held something back
//! ```
//! Operation for operation the host's, so `u` and `v` are the host's bit for bit where the
//! device rounds each operation as IEEE f32 does (lavapipe, tested). A compiler that fuses
//! `m·u + g` into one fused multiply-add (CUDA's NVRTC does by default) rounds once where
//! the host rounds twice: there the momentum can differ from the host's in its last bit.
//!
//! Not here: `clip = "norm"`, whose scale needs the bucket's f64 norm summed in the host's
//! order (a device sum in another order gives another scale); such a memory stays on the
//! host ([`crate::DeviceError::NoMemory`]).

use std::collections::BTreeMap;
use std::ops::Range;

use cubecl::prelude::*;
use dtrain_compress::memory::Clip;

use crate::codec::{element_starts, upload_tables};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride, segment_of};

/// `u ← m·u + g` (or the Nesterov form), `v ← v + …`, `out = v`; `g` clamped to `[−c, c]`
/// first with `clamp`.
#[cube(launch)]
fn accumulate(
    g: &[f32],
    u: &mut [f32],
    v: &mut [f32],
    out: &mut [f32],
    m: f32,
    c: f32,
    #[comptime] nesterov: bool,
    #[comptime] clamp: bool,
) {
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        let mut x = g[i];
        if clamp {
            // The host's `f32::clamp` for finite input (a compressed exchange sees no
            // non-finite gradient: the trainer skips that step before it).
            if x > c {
                x = c;
            } else if x < -c {
                x = -c;
            }
        }
        if nesterov {
            let un = m * (u[i] + x);
            u[i] = un;
            v[i] += un + x;
        } else {
            let un = m * u[i] + x;
            u[i] = un;
            v[i] += un;
        }
        out[i] = v[i];
        i += grid_stride();
    }
}

/// `held[s] = 1` for every segment `s` holding an element with `p ≠ t` (what was not sent
/// in full).
#[cube(launch)]
fn held_back(p: &[f32], t: &[f32], starts: &[u32], held: &[Atomic<u32>]) {
    let mut i = ABSOLUTE_POS;
    while i < p.len() {
        if p[i] != t[i] {
            held[segment_of(starts, i as u32) as usize].store(1u32);
        }
        i += grid_stride();
    }
}

/// `v ← p − t`; with `mask`, `u[j] ← 0` where `t[j] ≠ 0` in a segment that held back.
#[cube(launch)]
fn keep_unsent(
    p: &[f32],
    t: &[f32],
    starts: &[u32],
    held: &[u32],
    u: &mut [f32],
    v: &mut [f32],
    #[comptime] mask: bool,
) {
    let mut i = ABSOLUTE_POS;
    while i < v.len() {
        let sent = t[i];
        v[i] = p[i] - sent;
        if mask && sent != 0.0 && held[segment_of(starts, i as u32) as usize] != 0 {
            u[i] = 0.0;
        }
        i += grid_stride();
    }
}

/// One bucket's momentum and velocity.
#[derive(Debug, Clone)]
struct State {
    u: GpuBuffer,
    v: GpuBuffer,
}

/// DGC's momentum-corrected memory on the device, keyed by bucket id like the host's.
#[derive(Debug)]
pub struct DeviceDgcMemory {
    momentum: f32,
    nesterov: bool,
    masking: bool,
    /// `clip = "value"`'s bound (`None`: no clipping).
    clip: Option<f32>,
    state: BTreeMap<u64, State>,
}

impl DeviceDgcMemory {
    /// The memory of `kind = "dgc-momentum"` with these settings; `clip = "norm"` has no
    /// device form (see the module docs).
    pub fn new(momentum: f32, nesterov: bool, masking: bool, clip: Clip) -> Result<Self, DeviceError> {
        let clip = match clip {
            Clip::None => None,
            Clip::Value { max } => Some(max),
            Clip::Norm { .. } => {
                return Err(DeviceError::NoMemory(
                    "dgc-momentum with clip = \"norm\" (its scale is a host-ordered f64 sum)"
                        .into(),
                ))
            }
        };
        Ok(DeviceDgcMemory {
            momentum,
            nesterov,
            masking,
            clip,
            state: BTreeMap::new(),
        })
    }

    /// Bucket `key`'s state for `n` elements: zeros when it has none of that length.
    fn state_for(&mut self, gpu: &Gpu, key: u64, n: usize) -> State {
        match self.state.get(&key) {
            Some(s) if s.u.len() == n && s.v.len() == n => s.clone(),
            _ => {
                let s = State {
                    u: gpu.zeros(n),
                    v: gpu.zeros(n),
                };
                self.state.insert(key, s.clone());
                s
            }
        }
    }

    /// Accumulates bucket `key`'s gradient `grad` into its momentum and velocity and writes
    /// the velocity, the compensated gradient, into `out`.
    pub fn compensate(
        &mut self,
        gpu: &Gpu,
        key: u64,
        grad: &GpuBuffer,
        out: &GpuBuffer,
    ) -> Result<(), DeviceError> {
        crate::memory::same_len("compensate", grad, out)?;
        let s = self.state_for(gpu, key, grad.len());
        let (count, dim) = geometry(grad.len());
        accumulate::launch(
            gpu.client(),
            count,
            dim,
            grad.arg(),
            s.u.arg(),
            s.v.arg(),
            out.arg(),
            self.momentum,
            self.clip.unwrap_or(0.0),
            self.nesterov,
            self.clip.is_some(),
        );
        Ok(())
    }

    /// Keeps what was not sent (`v = p − t`) and masks the momentum of the sent coordinates
    /// of every segment of `segments` (all of the bucket when empty) that held something
    /// back.
    pub fn update(
        &mut self,
        gpu: &Gpu,
        key: u64,
        compensated: &GpuBuffer,
        transmitted: &GpuBuffer,
        segments: &[Range<usize>],
    ) -> Result<(), DeviceError> {
        crate::memory::same_len("update", compensated, transmitted)?;
        let n = compensated.len();
        let s = self.state_for(gpu, key, n);
        let whole = 0..n;
        let segs = if segments.is_empty() {
            std::slice::from_ref(&whole)
        } else {
            segments
        };
        let [starts] = upload_tables(gpu, [element_starts(segs)]);
        let held = gpu.words(segs.len(), 0);
        let (count, dim) = geometry(n);
        // SAFETY: `starts` holds S + 1 words and `held` S, for the S segments covering the
        // bucket.
        unsafe {
            let starts_arg = || BufferArg::from_raw_parts(starts.0.clone(), starts.1);
            let held_arg = || BufferArg::from_raw_parts(held.clone(), segs.len());
            if self.masking {
                held_back::launch(
                    gpu.client(),
                    count.clone(),
                    dim,
                    compensated.arg(),
                    transmitted.arg(),
                    starts_arg(),
                    held_arg(),
                );
            }
            keep_unsent::launch(
                gpu.client(),
                count,
                dim,
                compensated.arg(),
                transmitted.arg(),
                starts_arg(),
                held_arg(),
                s.u.arg(),
                s.v.arg(),
                self.masking,
            );
        }
        Ok(())
    }

    /// The host memory's export: per bucket `u` followed by `v`.
    pub fn export(&self, gpu: &Gpu) -> Result<BTreeMap<u64, Vec<f32>>, DeviceError> {
        self.state
            .iter()
            .map(|(&k, s)| {
                let mut b = gpu.download(&s.u)?;
                b.extend(gpu.download(&s.v)?);
                Ok((k, b))
            })
            .collect()
    }

    /// Restores [`DeviceDgcMemory::export`] (or the host memory's); a buffer of odd length
    /// is not a DGC state and is skipped, as the host skips it.
    pub fn import(&mut self, gpu: &Gpu, state: &BTreeMap<u64, Vec<f32>>) {
        self.state = state
            .iter()
            .filter(|(_, b)| b.len() % 2 == 0)
            .map(|(&k, b)| {
                let (u, v) = b.split_at(b.len() / 2);
                (
                    k,
                    State {
                        u: gpu.upload(u),
                        v: gpu.upload(v),
                    },
                )
            })
            .collect();
    }
}
