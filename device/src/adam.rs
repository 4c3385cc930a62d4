//! Adam's moments as the compressed optimizers keep them (1-bit Adam, 0/1 Adam), on the
//! device: the host's `sync::moments` in the framework, operation for operation, so the
//! moments and the direction are the host's bit for bit where the device rounds each
//! operation as IEEE f32 does (lavapipe, tested; CUDA's NVRTC may fuse a product and a sum
//! into one rounding, as for the other memories).
//!
//! ```text
//! absorb(g):           m ← β₁·m + (1−β₁)·g      v ← β₂·v + (1−β₂)·g·g
//! absorb_first(g):     m ← β₁·m + (1−β₁)·g      (the variance stays)
//! mask(x):             x ← 0 where v = 0
//! local_momentum(g):   g ← β₁·m + (1−β₁)·g      (this rank's momentum; m unchanged)
//! take_masked(x):      x ← 0 where v = 0;  m ← x (the exchanged momentum)
//! direction(d):        d ← m / (√v + ε)
//! ```
//! `1 − β` is computed on the host, as the host computes it, and passed to the kernels.

use cubecl::prelude::*;

use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride};

/// `m = β₁·m + (1−β₁)·g`, `v = β₂·v + (1−β₂)·g·g`.
#[cube(launch)]
fn absorb(m: &mut [f32], v: &mut [f32], g: &[f32], b1: f32, omb1: f32, b2: f32, omb2: f32) {
    let mut i = ABSOLUTE_POS;
    while i < m.len() {
        let x = g[i];
        m[i] = b1 * m[i] + omb1 * x;
        v[i] = b2 * v[i] + omb2 * x * x;
        i += grid_stride();
    }
}

/// `g = β₁·m + (1−β₁)·g`.
#[cube(launch)]
fn local_momentum(m: &[f32], g: &mut [f32], b1: f32, omb1: f32) {
    let mut i = ABSOLUTE_POS;
    while i < g.len() {
        g[i] = b1 * m[i] + omb1 * g[i];
        i += grid_stride();
    }
}

/// `m = β₁·m + (1−β₁)·g`.
#[cube(launch)]
fn absorb_first(m: &mut [f32], g: &[f32], b1: f32, omb1: f32) {
    let mut i = ABSOLUTE_POS;
    while i < m.len() {
        m[i] = b1 * m[i] + omb1 * g[i];
        i += grid_stride();
    }
}

/// `x = 0` where `v = 0`.
#[cube(launch)]
fn mask(v: &[f32], x: &mut [f32]) {
    let mut i = ABSOLUTE_POS;
    while i < x.len() {
        if v[i] == 0.0 {
            x[i] = 0.0;
        }
        i += grid_stride();
    }
}

/// `x = 0` where `v = 0`, then `m = x`.
#[cube(launch)]
fn take_masked(v: &[f32], x: &mut [f32], m: &mut [f32]) {
    let mut i = ABSOLUTE_POS;
    while i < x.len() {
        if v[i] == 0.0 {
            x[i] = 0.0;
        }
        m[i] = x[i];
        i += grid_stride();
    }
}

/// `d = m / (√v + ε)`.
#[cube(launch)]
fn direction(m: &[f32], v: &[f32], d: &mut [f32], eps: f32) {
    let mut i = ABSOLUTE_POS;
    while i < d.len() {
        d[i] = m[i] / (f32::sqrt(v[i]) + eps);
        i += grid_stride();
    }
}

/// The first and second moments of every parameter, flat, in device memory.
#[derive(Debug)]
pub struct DeviceAdamMoments {
    beta1: f32,
    beta2: f32,
    eps: f32,
    m: GpuBuffer,
    v: GpuBuffer,
}

impl DeviceAdamMoments {
    /// The moments `m` and `v` (as long as each other) uploaded to `gpu`, with β₁, β₂, ε.
    pub fn upload(
        gpu: &Gpu,
        m: &[f32],
        v: &[f32],
        beta1: f32,
        beta2: f32,
        eps: f32,
    ) -> Result<Self, DeviceError> {
        if m.len() != v.len() {
            return Err(DeviceError::Length {
                what: "the second moment",
                expected: m.len(),
                found: v.len(),
            });
        }
        Ok(DeviceAdamMoments {
            beta1,
            beta2,
            eps,
            m: gpu.upload(m),
            v: gpu.upload(v),
        })
    }

    /// How many parameters the moments cover.
    pub fn len(&self) -> usize {
        self.m.len()
    }

    /// Whether they cover none.
    pub fn is_empty(&self) -> bool {
        self.m.is_empty()
    }

    fn fits(&self, what: &'static str, x: &GpuBuffer) -> Result<(u32, CubeCount, CubeDim), DeviceError> {
        if x.len() != self.m.len() {
            return Err(DeviceError::Length {
                what,
                expected: self.m.len(),
                found: x.len(),
            });
        }
        let (count, dim) = geometry(x.len());
        Ok((x.len() as u32, count, dim))
    }

    /// A dense step: both moments take the averaged gradient `g`.
    pub fn absorb(&mut self, gpu: &Gpu, g: &GpuBuffer) -> Result<(), DeviceError> {
        let (n, count, dim) = self.fits("the gradient", g)?;
        if n > 0 {
            let (b1, b2) = (self.beta1, self.beta2);
            absorb::launch(
                gpu.client(),
                count,
                dim,
                self.m.arg(),
                self.v.arg(),
                g.arg(),
                b1,
                1.0 - b1,
                b2,
                1.0 - b2,
            );
        }
        Ok(())
    }

    /// The first moment alone takes `g` (0/1 Adam: the variance is frozen, or not
    /// refreshed this step).
    pub fn absorb_first(&mut self, gpu: &Gpu, g: &GpuBuffer) -> Result<(), DeviceError> {
        let (n, count, dim) = self.fits("the gradient", g)?;
        if n > 0 {
            let b1 = self.beta1;
            absorb_first::launch(gpu.client(), count, dim, self.m.arg(), g.arg(), b1, 1.0 - b1);
        }
        Ok(())
    }

    /// Zeroes `x` where the variance is exactly zero.
    pub fn mask(&self, gpu: &Gpu, x: &GpuBuffer) -> Result<(), DeviceError> {
        let (n, count, dim) = self.fits("the exchanged gradient", x)?;
        if n > 0 {
            mask::launch(gpu.client(), count, dim, self.v.arg(), x.arg());
        }
        Ok(())
    }

    /// Replaces `g` (this rank's gradient) by this rank's momentum `β₁·m + (1−β₁)·g`.
    pub fn local_momentum(&self, gpu: &Gpu, g: &GpuBuffer) -> Result<(), DeviceError> {
        let (n, count, dim) = self.fits("the gradient", g)?;
        if n > 0 {
            let b1 = self.beta1;
            local_momentum::launch(gpu.client(), count, dim, self.m.arg(), g.arg(), b1, 1.0 - b1);
        }
        Ok(())
    }

    /// The exchanged momentum `x`, zeroed where the variance is exactly zero (the code's
    /// error there, not a gradient), becomes the first moment.
    pub fn take_masked(&mut self, gpu: &Gpu, x: &GpuBuffer) -> Result<(), DeviceError> {
        let (n, count, dim) = self.fits("the exchanged momentum", x)?;
        if n > 0 {
            take_masked::launch(gpu.client(), count, dim, self.v.arg(), x.arg(), self.m.arg());
        }
        Ok(())
    }

    /// Writes the direction `m / (√v + ε)` into `out`.
    pub fn direction(&self, gpu: &Gpu, out: &GpuBuffer) -> Result<(), DeviceError> {
        let (n, count, dim) = self.fits("the direction", out)?;
        if n > 0 {
            let eps = self.eps;
            direction::launch(gpu.client(), count, dim, self.m.arg(), self.v.arg(), out.arg(), eps);
        }
        Ok(())
    }

    /// The moments `(m, v)`, copied to the host.
    pub fn download(&self, gpu: &Gpu) -> Result<(Vec<f32>, Vec<f32>), DeviceError> {
        Ok((gpu.download(&self.m)?, gpu.download(&self.v)?))
    }
}
