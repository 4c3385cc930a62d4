//! The two filtering memories on the device, each the host's operation for operation (so
//! their state is the host's bit for bit where the device rounds each operation as IEEE f32
//! does: lavapipe, tested; CUDA's NVRTC may fuse a product and a sum into one rounding):
//!
//! * [`DeviceMomentum`], Signum's worker momentum (`memory::Momentum`): `p = β·m + (1−β)·g`
//!   (`(1−β)·g` where the bucket has none yet), then `m ← p`;
//! * [`DeviceLowPass`], ScaleCom's low-pass filtered memory (`memory::LowPass`): `p = m + g`
//!   (`g` where there is none), then `m ← p − t` for β = 1 or `m ← (1−β)·m + β·(p − t)`.

use std::collections::BTreeMap;

use cubecl::prelude::*;

use crate::codec::copy_into;
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::memory::{compensate_from, difference, same_len, state_of};
use crate::words::{geometry, grid_stride};

/// `m = (1−β)·m + β·(p − t)`, with `one_minus` = `1 − β` as the host computes it.
#[cube(launch)]
fn low_pass(m: &mut [f32], p: &[f32], t: &[f32], one_minus: f32, beta: f32) {
    let mut i = ABSOLUTE_POS;
    while i < m.len() {
        m[i] = one_minus * m[i] + beta * (p[i] - t[i]);
        i += grid_stride();
    }
}

/// Signum's worker momentum on the device, keyed by bucket like the host's.
#[derive(Debug)]
pub struct DeviceMomentum {
    beta: f32,
    pub(crate) momenta: BTreeMap<u64, GpuBuffer>,
}

impl DeviceMomentum {
    /// The momentum with decay `β`.
    pub fn new(beta: f32) -> Self {
        DeviceMomentum {
            beta,
            momenta: BTreeMap::new(),
        }
    }

    /// `out = β·m + (1−β)·g` for bucket `key`.
    pub fn compensate(
        &self,
        gpu: &Gpu,
        key: u64,
        grad: &GpuBuffer,
        out: &GpuBuffer,
    ) -> Result<(), DeviceError> {
        compensate_from(gpu, &self.momenta, key, grad, out, self.beta, 1.0 - self.beta)
    }

    /// `m ← p` (what was sent does not matter).
    pub fn update(&mut self, gpu: &Gpu, key: u64, compensated: &GpuBuffer) -> Result<(), DeviceError> {
        let m = state_of(&mut self.momenta, gpu, key, compensated.len());
        let (count, dim) = geometry(m.len());
        copy_into::launch(gpu.client(), count, dim, compensated.arg(), m.arg());
        Ok(())
    }
}

/// ScaleCom's low-pass filtered memory on the device, keyed by bucket like the host's.
#[derive(Debug)]
pub struct DeviceLowPass {
    beta: f32,
    pub(crate) mem: BTreeMap<u64, GpuBuffer>,
}

impl DeviceLowPass {
    /// The filter with coefficient `β` (1: plain error feedback).
    pub fn new(beta: f32) -> Self {
        DeviceLowPass {
            beta,
            mem: BTreeMap::new(),
        }
    }

    /// `out = m + g` for bucket `key`.
    pub fn compensate(
        &self,
        gpu: &Gpu,
        key: u64,
        grad: &GpuBuffer,
        out: &GpuBuffer,
    ) -> Result<(), DeviceError> {
        // The products by 1 are exact: `m + g`.
        compensate_from(gpu, &self.mem, key, grad, out, 1.0, 1.0)
    }

    /// `m ← (1−β)·m + β·(p − t)` (`p − t` for β = 1), from zeros for a new bucket.
    pub fn update(
        &mut self,
        gpu: &Gpu,
        key: u64,
        compensated: &GpuBuffer,
        transmitted: &GpuBuffer,
    ) -> Result<(), DeviceError> {
        same_len("update", compensated, transmitted)?;
        let m = state_of(&mut self.mem, gpu, key, compensated.len());
        let (count, dim) = geometry(m.len());
        let (p, t) = (compensated.arg(), transmitted.arg());
        if self.beta == 1.0 {
            difference::launch(gpu.client(), count, dim, p, t, m.arg());
        } else {
            let one_minus = 1.0 - self.beta;
            low_pass::launch(gpu.client(), count, dim, m.arg(), p, t, one_minus, self.beta);
        }
        Ok(())
    }
}
