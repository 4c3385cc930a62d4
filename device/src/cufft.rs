//! cuFFT as the [`FftLibrary`] of a CUDA device: NVIDIA's library, loaded at run time
//! through cudarc (`libcufft.so`; nothing of CUDA is needed to build), with one plan per
//! length and direction made on first use and kept.
//!
//! **Hand-offs.** cubecl 0.11 does not expose the stream its kernels run on, so a batch
//! starts by waiting for the device client (every kernel queued before it, among them the
//! ones that wrote the batch's input) and ends by waiting for cuFFT's own stream, after
//! which cubecl's kernels read the output. Two host waits per batch, one batch per bucket
//! and direction; `scripts/gpu-check` times the codec with them.
//!
//! **Memory.** The device addresses are cubecl's buffers' own (`get_resource` on the CUDA
//! server, which also keeps each buffer in place while the transform runs); cubecl and
//! cudarc share the device's primary context.

use std::collections::HashMap;
use std::sync::Arc;

use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::cufft::{result as cufft, sys};
use cudarc::driver::{CudaContext, CudaStream};

use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::library::{FftLibrary, Job};

/// cuFFT on one CUDA device: its context (the primary one, as cubecl's), a stream of its
/// own and the plans made so far.
pub(crate) struct CuFft {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Plans per (length, inverse).
    plans: HashMap<(usize, bool), sys::cufftHandle>,
    version: i32,
}

// SAFETY: the plans are plain handles used from one thread at a time (`&mut self`); cuFFT
// plans may be used from any thread once the context is bound, which every call does.
unsafe impl Send for CuFft {}

impl CuFft {
    /// cuFFT on CUDA device `ordinal`, or why not (the library not found, the device not
    /// opened): the caller falls back to its own kernels and says so.
    pub(crate) fn open(ordinal: usize) -> Result<CuFft, String> {
        // SAFETY: only probes whether the library loads (cudarc's own check).
        if !unsafe { sys::is_culib_present() } {
            return Err(
                "libcufft.so not found on the library path (a CUDA toolkit's lib64 holds it; \
                 where only a versioned libcufft.so.N is installed, a link to it named \
                 libcufft.so in a folder on LD_LIBRARY_PATH)"
                    .into(),
            );
        }
        let version = cufft::get_version().map_err(|e| format!("cufftGetVersion: {e}"))?;
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e}"))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("a stream for cuFFT: {e}"))?;
        Ok(CuFft {
            ctx,
            stream,
            plans: HashMap::new(),
            version,
        })
    }

    /// The plan of one length and direction (made and bound to this stream once).
    fn plan(&mut self, n: usize, inverse: bool) -> Result<sys::cufftHandle, String> {
        if let Some(&p) = self.plans.get(&(n, inverse)) {
            return Ok(p);
        }
        let nx = i32::try_from(n).map_err(|_| format!("a transform of {n} elements"))?;
        let kind = if inverse {
            sys::cufftType::CUFFT_C2R
        } else {
            sys::cufftType::CUFFT_R2C
        };
        let plan = cufft::plan_1d(nx, kind, 1).map_err(|e| format!("cufftPlan1d({n}): {e}"))?;
        // SAFETY: a plan just made and this context's live stream.
        unsafe { cufft::set_stream(plan, self.stream.cu_stream() as _) }
            .map_err(|e| format!("cufftSetStream: {e}"))?;
        self.plans.insert((n, inverse), plan);
        Ok(plan)
    }

    /// Runs `jobs` from `src` into `dst` (R2C, or C2R where `inverse`) after every kernel
    /// queued on `gpu`, and waits for them.
    fn run(
        &mut self,
        gpu: &Gpu,
        src: &GpuBuffer,
        dst: &GpuBuffer,
        jobs: &[Job],
        inverse: bool,
    ) -> Result<(), DeviceError> {
        let fail = |e: String| gpu.server_error("a cuFFT batch", e);
        gpu.sync()?;
        type Server = <CudaRuntime as Runtime>::Server;
        let s = gpu
            .client()
            .get_resource::<Server>(src.handle.clone())
            .map_err(|e| fail(format!("the input's address: {e}")))?;
        let d = gpu
            .client()
            .get_resource::<Server>(dst.handle.clone())
            .map_err(|e| fail(format!("the output's address: {e}")))?;
        let (s_ptr, d_ptr) = (s.resource().ptr, d.resource().ptr);
        self.ctx
            .bind_to_thread()
            .map_err(|e| fail(format!("binding the context: {e}")))?;
        for job in jobs {
            let plan = self.plan(job.n, inverse).map_err(fail)?;
            let (re, co) = (job.real as u64 * 4, job.complex as u64 * 4);
            // SAFETY: the layout (`LibraryFft`) put each job's `n` reals and `n/2 + 1` bins
            // inside the two buffers, whose addresses stay valid while `s` and `d` are held.
            let r = unsafe {
                if inverse {
                    cufft::exec_c2r(plan, (s_ptr + co) as *mut _, (d_ptr + re) as *mut _)
                } else {
                    cufft::exec_r2c(plan, (s_ptr + re) as *mut _, (d_ptr + co) as *mut _)
                }
            };
            r.map_err(|e| fail(format!("a transform of {} elements: {e}", job.n)))?;
        }
        self.stream
            .synchronize()
            .map_err(|e| fail(format!("waiting for the transforms: {e}")))?;
        drop((s, d));
        Ok(())
    }
}

impl FftLibrary for CuFft {
    fn name(&self) -> String {
        format!("cuFFT (version {})", self.version)
    }

    fn forward(
        &mut self,
        gpu: &Gpu,
        real: &GpuBuffer,
        complex: &GpuBuffer,
        jobs: &[Job],
    ) -> Result<(), DeviceError> {
        self.run(gpu, real, complex, jobs, false)
    }

    fn inverse(
        &mut self,
        gpu: &Gpu,
        complex: &GpuBuffer,
        real: &GpuBuffer,
        jobs: &[Job],
    ) -> Result<(), DeviceError> {
        self.run(gpu, complex, real, jobs, true)
    }
}

impl Drop for CuFft {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            for (_, plan) in self.plans.drain() {
                // SAFETY: each plan was made once here and is destroyed once.
                let _ = unsafe { cufft::destroy(plan) };
            }
        }
    }
}
