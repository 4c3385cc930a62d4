//! Real transforms by a vendor FFT library in place of dtrain's own kernels — cuFFT on CUDA
//! (`cufft`, loaded at run time) — behind one small seam, [`FftLibrary`], with the batching
//! around it: each chunk scaled into a scratch buffer, every chunk's transform run by the
//! library in one batch (one hand-off each way between cubecl's queue and the library's),
//! the results copied out by kernels. [`crate::Rfft`] takes this path where a library is
//! at hand and its own kernels (radix-2 Stockham and Bluestein) elsewhere.
//!
//! The library only ever reads and writes the two scratch buffers kept here, which kernels
//! of this crate wrote or zeroed before (a buffer handed to a foreign library must be
//! allocated on the device, and cubecl allocates lazily).

use std::ops::Range;

use cubecl::prelude::*;

use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride};

/// One transform of a batch: its length `n` and where its data lie, in `f32`s from the
/// start of the real and of the complex scratch buffer (`n` reals; `n/2 + 1` complex bins,
/// real and imaginary parts interleaved). Every offset is a multiple of 4 (16 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Job {
    /// The transform's length.
    pub n: usize,
    /// Its first real, in `f32`s.
    pub real: usize,
    /// Its first bin's real part, in `f32`s.
    pub complex: usize,
}

/// A library that runs batches of real transforms on device memory (cuFFT; a test's
/// stand-in). Both directions are unnormalised, as the host's `realfft` is.
///
/// When a call begins, kernels launched on `gpu` that write its input may still be queued:
/// the library waits for them. When it returns, its output is written (kernels launched
/// after it read it).
pub trait FftLibrary: Send {
    /// Its name as a log line gives it (`cuFFT 12.8` — with the version it reports).
    fn name(&self) -> String;

    /// `X_k = Σ_j x_j e^{−2πijk/n}`, `k ≤ n/2`: for each job, the `n` reals of `real` at
    /// `job.real` into the `n/2 + 1` bins of `complex` at `job.complex`.
    fn forward(
        &mut self,
        gpu: &Gpu,
        real: &GpuBuffer,
        complex: &GpuBuffer,
        jobs: &[Job],
    ) -> Result<(), DeviceError>;

    /// `x_j = Σ_k X_k e^{2πijk/n}` over the Hermitian extension of the `n/2 + 1` bins of
    /// `complex` at `job.complex` (their DC's and an even `n`'s Nyquist's imaginary parts
    /// are zero), into the `n` reals of `real` at `job.real`. `complex` may be overwritten
    /// (cuFFT's complex-to-real transforms use their input as scratch).
    fn inverse(
        &mut self,
        gpu: &Gpu,
        complex: &GpuBuffer,
        real: &GpuBuffer,
        jobs: &[Job],
    ) -> Result<(), DeviceError>;
}

/// `dst[dst_at + j] = s · src[src_at + j]` for `j < n` (`s` a power of two, or 1: exact).
#[cube(launch)]
fn scale_copy(src: &[f32], src_at: u32, n: u32, s: f32, dst: &mut [f32], dst_at: u32) {
    let mut j = ABSOLUTE_POS as u32;
    while j < n {
        dst[(dst_at + j) as usize] = s * src[(src_at + j) as usize];
        j += grid_stride() as u32;
    }
}

/// The `n/2 + 1` bins of one chunk's spectrum (from bin `first` of `spec`) into `dst` from
/// `at` (`f32`s), DC's and an even `n`'s Nyquist's imaginary parts set to zero (the host
/// decoder ignores them; a complex-to-real library need not).
#[cube(launch)]
fn half_spectrum(spec: &[f32], first: u32, n: u32, dst: &mut [f32], at: u32) {
    let m = n / 2 + 1;
    let mut k = ABSOLUTE_POS as u32;
    while k < m {
        let mut im = spec[2 * (first + k) as usize + 1];
        if k == 0 || ((n & 1) == 0 && k == n / 2) {
            im = 0.0f32;
        }
        dst[(at + 2 * k) as usize] = spec[2 * (first + k) as usize];
        dst[(at + 2 * k + 1) as usize] = im;
        k += grid_stride() as u32;
    }
}

/// One chunk of a batch: its elements, its first bin in the spectra and the factor it is
/// multiplied by before the forward transform (1 for the inverse).
#[derive(Debug, Clone)]
pub(crate) struct Span {
    pub(crate) range: Range<usize>,
    pub(crate) first: usize,
    pub(crate) pre: f32,
}

/// The shortest chunk a library transforms: shorter ones take [`crate::Rfft`]'s own kernels
/// (a pass or two; not worth a plan, and libraries differ on lengths 1 and 2).
pub const SHORTEST: usize = 16;

/// `v` rounded up to a multiple of 4 (16-byte alignment of every job's data).
fn padded(v: usize) -> usize {
    v.div_ceil(4) * 4
}

/// A library and the two scratch buffers its batches run in (kept between calls, grown
/// to the largest batch).
pub(crate) struct LibraryFft {
    lib: Box<dyn FftLibrary>,
    real: Option<GpuBuffer>,
    complex: Option<GpuBuffer>,
}

impl std::fmt::Debug for LibraryFft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LibraryFft")
            .field("lib", &self.lib.name())
            .finish_non_exhaustive()
    }
}

impl LibraryFft {
    pub(crate) fn new(lib: Box<dyn FftLibrary>) -> Self {
        LibraryFft {
            lib,
            real: None,
            complex: None,
        }
    }

    pub(crate) fn name(&self) -> String {
        self.lib.name()
    }

    /// The jobs of `chunks` (packed, each at a 16-byte boundary) and the two scratch
    /// buffers, each at least as long as they need (zeroed when made: allocated on the
    /// device before the library sees them).
    fn layout(&mut self, gpu: &Gpu, chunks: &[Span]) -> (Vec<Job>, GpuBuffer, GpuBuffer) {
        let (mut real, mut complex) = (0, 0);
        let jobs: Vec<Job> = chunks
            .iter()
            .map(|Span { range: r, .. }| {
                let job = Job {
                    n: r.len(),
                    real,
                    complex,
                };
                real += padded(r.len());
                complex += padded(2 * (r.len() / 2 + 1));
                job
            })
            .collect();
        let fit = |slot: &mut Option<GpuBuffer>, len: usize| match slot {
            Some(b) if b.len() >= len => b.clone(),
            _ => slot.insert(gpu.zeros(len)).clone(),
        };
        let r = fit(&mut self.real, real);
        let c = fit(&mut self.complex, complex);
        (jobs, r, c)
    }

    /// The spectra of `chunks` of `x`, each multiplied by its `pre` first, into `spec` from
    /// each chunk's `first` bin (`n/2 + 1` interleaved bins), as [`crate::Rfft::forward`]
    /// lays them out.
    pub(crate) fn forward(
        &mut self,
        gpu: &Gpu,
        x: &GpuBuffer,
        chunks: &[Span],
        spec: &GpuBuffer,
    ) -> Result<(), DeviceError> {
        if chunks.is_empty() {
            return Ok(());
        }
        let (jobs, real, complex) = self.layout(gpu, chunks);
        for (c, job) in chunks.iter().zip(&jobs) {
            launch_scale_copy(gpu, x, c.range.start, job.n, c.pre, &real, job.real);
        }
        self.lib.forward(gpu, &real, &complex, &jobs)?;
        for (c, job) in chunks.iter().zip(&jobs) {
            let m = job.n / 2 + 1;
            launch_scale_copy(gpu, &complex, job.complex, 2 * m, 1.0, spec, 2 * c.first);
        }
        Ok(())
    }

    /// The inverse transforms of the chunks' spectra (from each one's `first` bin of `spec`,
    /// as [`LibraryFft::forward`] writes them) times `scale`, into `out` over the chunks'
    /// elements.
    pub(crate) fn inverse(
        &mut self,
        gpu: &Gpu,
        spec: &GpuBuffer,
        chunks: &[Span],
        scale: f32,
        out: &GpuBuffer,
    ) -> Result<(), DeviceError> {
        if chunks.is_empty() {
            return Ok(());
        }
        let (jobs, real, complex) = self.layout(gpu, chunks);
        for (c, job) in chunks.iter().zip(&jobs) {
            let (count, dim) = geometry(job.n / 2 + 1);
            half_spectrum::launch(
                gpu.client(),
                count,
                dim,
                spec.arg(),
                c.first as u32,
                job.n as u32,
                complex.arg(),
                job.complex as u32,
            );
        }
        self.lib.inverse(gpu, &complex, &real, &jobs)?;
        for (c, job) in chunks.iter().zip(&jobs) {
            launch_scale_copy(gpu, &real, job.real, job.n, scale, out, c.range.start);
        }
        Ok(())
    }
}

/// One [`scale_copy`] launch.
fn launch_scale_copy(
    gpu: &Gpu,
    src: &GpuBuffer,
    src_at: usize,
    n: usize,
    s: f32,
    dst: &GpuBuffer,
    dst_at: usize,
) {
    if n == 0 {
        return;
    }
    let (count, dim) = geometry(n);
    scale_copy::launch(
        gpu.client(),
        count,
        dim,
        src.arg(),
        src_at as u32,
        n as u32,
        s,
        dst.arg(),
        dst_at as u32,
    );
}
