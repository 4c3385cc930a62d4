//! Residual error feedback on the device (`p = β·e + γ·g`, then `e ← p − D(C(p))`): the
//! host's `memory::Residual`, its buffers kept in device memory per bucket.
//!
//! The arithmetic is the host's operation for operation — `β·e + γ·g`, `γ·g` where the
//! bucket has no residual yet, `p − t` — so the residual is the host's bit for bit where the
//! device rounds each operation as IEEE f32 does (lavapipe, tested). With β = γ = 1, classic
//! error feedback and the default, that holds even where a compiler fuses `β·e + γ·g` into
//! a fused multiply-add (CUDA's NVRTC does by default): the products by 1 are exact.

use std::collections::BTreeMap;
use std::ops::Range;

use cubecl::prelude::*;

use dtrain_compress::MemoryConfig;

use crate::dgc_momentum::DeviceDgcMemory;
use crate::filtered::{DeviceLowPass, DeviceMomentum};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride};

/// `out = β·e + γ·g`.
#[cube(launch)]
fn compensate(e: &[f32], g: &[f32], out: &mut [f32], beta: f32, gamma: f32) {
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        out[i] = beta * e[i] + gamma * g[i];
        i += grid_stride();
    }
}

/// `out = γ·g`.
#[cube(launch)]
fn scale(g: &[f32], out: &mut [f32], gamma: f32) {
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        out[i] = gamma * g[i];
        i += grid_stride();
    }
}

/// `e = p − t`.
#[cube(launch)]
pub(crate) fn difference(p: &[f32], t: &[f32], e: &mut [f32]) {
    let mut i = ABSOLUTE_POS;
    while i < e.len() {
        e[i] = p[i] - t[i];
        i += grid_stride();
    }
}

/// Residual memory on the device, keyed by bucket id like the host's.
#[derive(Debug)]
pub struct DeviceResidual {
    beta: f32,
    gamma: f32,
    residuals: BTreeMap<u64, GpuBuffer>,
}

impl DeviceResidual {
    /// A residual memory; `β = γ = 1` is classic error feedback.
    pub fn new(beta: f32, gamma: f32) -> Self {
        DeviceResidual {
            beta,
            gamma,
            residuals: BTreeMap::new(),
        }
    }

    /// Writes the compensated gradient `β·e + γ·g` of bucket `key` into `out`.
    pub fn compensate(
        &self,
        gpu: &Gpu,
        key: u64,
        grad: &GpuBuffer,
        out: &GpuBuffer,
    ) -> Result<(), DeviceError> {
        compensate_from(gpu, &self.residuals, key, grad, out, self.beta, self.gamma)
    }

    /// Sets bucket `key`'s residual to `compensated − transmitted`.
    pub fn update(
        &mut self,
        gpu: &Gpu,
        key: u64,
        compensated: &GpuBuffer,
        transmitted: &GpuBuffer,
    ) -> Result<(), DeviceError> {
        same_len("update", compensated, transmitted)?;
        let n = compensated.len();
        let e = state_of(&mut self.residuals, gpu, key, n);
        let (count, dim) = geometry(n);
        difference::launch(
            gpu.client(),
            count,
            dim,
            compensated.arg(),
            transmitted.arg(),
            e.arg(),
        );
        Ok(())
    }

    /// The residuals, copied to the host (a checkpoint's `export`, the host memory's format).
    pub fn export(&self, gpu: &Gpu) -> Result<BTreeMap<u64, Vec<f32>>, DeviceError> {
        export_states(&self.residuals, gpu)
    }

    /// Restores [`DeviceResidual::export`] (or the host memory's export).
    pub fn import(&mut self, gpu: &Gpu, state: &BTreeMap<u64, Vec<f32>>) {
        self.residuals = import_states(gpu, state);
    }
}

/// `out = β·e + γ·g` where bucket `key` has a state `e` of `grad`'s length, else `γ·g`: the
/// compensation the residual and the two filtering memories share.
pub(crate) fn compensate_from(
    gpu: &Gpu,
    state: &BTreeMap<u64, GpuBuffer>,
    key: u64,
    grad: &GpuBuffer,
    out: &GpuBuffer,
    beta: f32,
    gamma: f32,
) -> Result<(), DeviceError> {
    same_len("compensate", grad, out)?;
    let (count, dim) = geometry(grad.len());
    match state.get(&key) {
        Some(e) if e.len() == grad.len() => compensate::launch(
            gpu.client(),
            count,
            dim,
            e.arg(),
            grad.arg(),
            out.arg(),
            beta,
            gamma,
        ),
        _ => scale::launch(gpu.client(), count, dim, grad.arg(), out.arg(), gamma),
    }
    Ok(())
}

/// Bucket `key`'s state buffer of `n` elements: the one kept, or zeros kept from now on
/// where there is none of that length (a bucket that changed length starts again).
pub(crate) fn state_of(
    map: &mut BTreeMap<u64, GpuBuffer>,
    gpu: &Gpu,
    key: u64,
    n: usize,
) -> GpuBuffer {
    match map.get(&key) {
        Some(e) if e.len() == n => e.clone(),
        _ => {
            let e = gpu.zeros(n);
            map.insert(key, e.clone());
            e
        }
    }
}

/// The state buffers, copied to the host (a checkpoint's `export`, the host memory's
/// format).
pub(crate) fn export_states(
    map: &BTreeMap<u64, GpuBuffer>,
    gpu: &Gpu,
) -> Result<BTreeMap<u64, Vec<f32>>, DeviceError> {
    map.iter()
        .map(|(&k, e)| Ok((k, gpu.download(e)?)))
        .collect()
}

/// The state buffers of a host memory's export, on the device.
pub(crate) fn import_states(gpu: &Gpu, state: &BTreeMap<u64, Vec<f32>>) -> BTreeMap<u64, GpuBuffer> {
    state.iter().map(|(&k, e)| (k, gpu.upload(e))).collect()
}

/// Refuses buffers of different lengths.
pub(crate) fn same_len(what: &'static str, a: &GpuBuffer, b: &GpuBuffer) -> Result<(), DeviceError> {
    if a.len() != b.len() {
        return Err(DeviceError::Length {
            what,
            expected: a.len(),
            found: b.len(),
        });
    }
    Ok(())
}

/// An error-feedback memory on the device: the host memories that have a device form.
#[derive(Debug)]
pub enum DeviceMemory {
    /// `kind = "residual"` ([`DeviceResidual`]).
    Residual(DeviceResidual),
    /// `kind = "dgc-momentum"` ([`DeviceDgcMemory`]).
    DgcMomentum(DeviceDgcMemory),
    /// `kind = "momentum"`, Signum's ([`DeviceMomentum`]).
    Momentum(DeviceMomentum),
    /// `kind = "low-pass"`, ScaleCom's ([`DeviceLowPass`]).
    LowPass(DeviceLowPass),
}

impl DeviceMemory {
    /// The device form of `config`: `Ok(None)` for no memory; an error where a setting has
    /// no device form (DGC's `clip = "norm"`).
    pub fn for_config(config: &MemoryConfig) -> Result<Option<Self>, DeviceError> {
        Ok(Some(match *config {
            MemoryConfig::None => return Ok(None),
            MemoryConfig::Residual { beta, gamma } => {
                DeviceMemory::Residual(DeviceResidual::new(beta, gamma))
            }
            MemoryConfig::DgcMomentum {
                momentum,
                nesterov,
                masking,
                clip,
            } => DeviceMemory::DgcMomentum(DeviceDgcMemory::new(momentum, nesterov, masking, clip)?),
            MemoryConfig::Momentum { beta } => DeviceMemory::Momentum(DeviceMomentum::new(beta)),
            MemoryConfig::LowPass { beta } => DeviceMemory::LowPass(DeviceLowPass::new(beta)),
        }))
    }

    /// Writes bucket `key`'s compensated gradient into `out` (the memory learns `grad`
    /// where it accumulates it, as DGC's does).
    pub fn compensate(
        &mut self,
        gpu: &Gpu,
        key: u64,
        grad: &GpuBuffer,
        out: &GpuBuffer,
    ) -> Result<(), DeviceError> {
        match self {
            DeviceMemory::Residual(m) => m.compensate(gpu, key, grad, out),
            DeviceMemory::DgcMomentum(m) => m.compensate(gpu, key, grad, out),
            DeviceMemory::Momentum(m) => m.compensate(gpu, key, grad, out),
            DeviceMemory::LowPass(m) => m.compensate(gpu, key, grad, out),
        }
    }

    /// Learns what bucket `key` sent: `transmitted`, the payload decoded, of `compensated`
    /// (layer boundaries `segments`).
    pub fn update(
        &mut self,
        gpu: &Gpu,
        key: u64,
        compensated: &GpuBuffer,
        transmitted: &GpuBuffer,
        segments: &[Range<usize>],
    ) -> Result<(), DeviceError> {
        match self {
            DeviceMemory::Residual(m) => m.update(gpu, key, compensated, transmitted),
            DeviceMemory::DgcMomentum(m) => {
                m.update(gpu, key, compensated, transmitted, segments)
            }
            DeviceMemory::Momentum(m) => m.update(gpu, key, compensated),
            DeviceMemory::LowPass(m) => m.update(gpu, key, compensated, transmitted),
        }
    }

    /// The state, copied to the host in the host memory's export format.
    pub fn export(&self, gpu: &Gpu) -> Result<BTreeMap<u64, Vec<f32>>, DeviceError> {
        match self {
            DeviceMemory::Residual(m) => m.export(gpu),
            DeviceMemory::DgcMomentum(m) => m.export(gpu),
            DeviceMemory::Momentum(m) => export_states(&m.momenta, gpu),
            DeviceMemory::LowPass(m) => export_states(&m.mem, gpu),
        }
    }

    /// Restores [`DeviceMemory::export`] (or the host memory's export).
    pub fn import(&mut self, gpu: &Gpu, state: &BTreeMap<u64, Vec<f32>>) {
        match self {
            DeviceMemory::Residual(m) => m.import(gpu, state),
            DeviceMemory::DgcMomentum(m) => m.import(gpu, state),
            DeviceMemory::Momentum(m) => m.momenta = import_states(gpu, state),
            DeviceMemory::LowPass(m) => m.mem = import_states(gpu, state),
        }
    }
}
