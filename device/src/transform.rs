//! Real forward transforms on the device: each chunk of a bucket (any length) scaled as the
//! FFT codec scales it and transformed into its `n/2 + 1` bins, with cubecl kernels — the
//! same code on CUDA and on wgpu.
//!
//! A power-of-two complex transform (radix-2 Stockham: `log₂ L` passes, each reading one
//! buffer and writing the other in natural order, twiddles from a table computed in `f64`
//! once per `L`) serves every length: a power-of-two `n` directly, any other through
//! Bluestein's chirp-z identity `X_k = c̄_k · Σ_j (x_j c̄_j) c_{k−j}` with `c_t = e^{iπt²/n}`,
//! the convolution taken by transforms of length `L ≥ n + m − 1` (the chirp's angles reduced
//! as `t² mod 2n` in integers and evaluated in `f64`; the chirp's transform made once per
//! `n`). Tables and scratch are kept between calls.
//!
//! **Accuracy**: `f32` throughout, so a bin differs from the host's (`realfft`, another
//! algorithm and order) by rounding — measured by the tests against the host transform,
//! relative to each chunk's largest bin: about 1e-6 at the lengths of a CNN's layers. Where
//! two bins' energies nearly tie, the device and the host may keep different ones; a caller
//! that needs the host's payloads byte for byte takes the host's transform
//! (`transform = "host"`).

use std::collections::HashMap;
use std::ops::Range;

use cubecl::prelude::*;
use dtrain_compress::fft::parts::forward_scales;

use crate::codec::{refuse_non_finite, upload_tables};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::library::{FftLibrary, LibraryFft, Span, SHORTEST};
use crate::select::word;
use crate::words::{geometry, grid_stride, segment_of};
use dtrain_compress::Payload;

/// Each chunk's largest magnitude (bits) into `amax`; a non-finite element lowers
/// `first_bad` to its index. `starts` holds each chunk's first element and the end.
#[cube(launch)]
fn chunk_max(x: &[f32], starts: &[u32], amax: &[Atomic<u32>], first_bad: &[Atomic<u32>]) {
    let end = starts[starts.len() - 1];
    let mut i = ABSOLUTE_POS as u32;
    while i < end {
        let key = u32::reinterpret(x[i as usize]) & 0x7FFF_FFFF;
        if key >= 0x7F80_0000 {
            first_bad[0].fetch_min(i);
        }
        let c = segment_of(starts, i) as usize;
        amax[c].fetch_max(key);
        i += grid_stride() as u32;
    }
}

/// `a[j] = pre · x[start + j] · chirp[j]` for `j < n` (`chirp` only where `use_chirp`), zero
/// up to `a`'s length (complex, interleaved).
#[cube(launch)]
fn load(x: &[f32], start: u32, n: u32, pre: f32, chirp: &[f32], use_chirp: u32, a: &mut [f32]) {
    let len = a.len() as u32 / 2;
    let mut j = ABSOLUTE_POS as u32;
    while j < len {
        let mut re = 0.0f32;
        let mut im = 0.0f32;
        if j < n {
            let v = x[(start + j) as usize] * pre;
            if use_chirp == 1 {
                re = v * chirp[2 * j as usize];
                im = v * chirp[2 * j as usize + 1];
            } else {
                re = v;
            }
        }
        a[2 * j as usize] = re;
        a[2 * j as usize + 1] = im;
        j += grid_stride() as u32;
    }
}

/// One radix-2 Stockham pass of a length-`2·half` transform, sub-transforms of `ns` growing
/// to `2·ns`: twiddle `tw[k·stride]` (`stride = half / ns`), its imaginary part times
/// `sign` (−1: the inverse transform).
#[cube(launch)]
fn stockham(src: &[f32], dst: &mut [f32], tw: &[f32], ns: u32, half: u32, stride: u32, sign: f32) {
    let mut j = ABSOLUTE_POS as u32;
    while j < half {
        let k = j & (ns - 1);
        let r0 = src[2 * j as usize];
        let i0 = src[2 * j as usize + 1];
        let r1 = src[2 * (j + half) as usize];
        let i1 = src[2 * (j + half) as usize + 1];
        let t = (k * stride) as usize;
        let wr = tw[2 * t];
        let wi = sign * tw[2 * t + 1];
        let xr = r1 * wr - i1 * wi;
        let xi = r1 * wi + i1 * wr;
        let d = (j - k) * 2 + k;
        dst[2 * d as usize] = r0 + xr;
        dst[2 * d as usize + 1] = i0 + xi;
        dst[2 * (d + ns) as usize] = r0 - xr;
        dst[2 * (d + ns) as usize + 1] = i0 - xi;
        j += grid_stride() as u32;
    }
}

/// `a ← a · b · scale`, complex, elementwise.
#[cube(launch)]
fn multiply(a: &mut [f32], b: &[f32], scale: f32) {
    let len = a.len() / 2;
    let mut j = ABSOLUTE_POS;
    while j < len {
        let (ar, ai) = (a[2 * j], a[2 * j + 1]);
        let (br, bi) = (b[2 * j], b[2 * j + 1]);
        a[2 * j] = (ar * br - ai * bi) * scale;
        a[2 * j + 1] = (ar * bi + ai * br) * scale;
        j += grid_stride();
    }
}

/// Bins `0..m` of `c` (times `chirp`, where `use_chirp`) into the spectra from bin `first`.
#[cube(launch)]
fn store(c: &[f32], chirp: &[f32], use_chirp: u32, m: u32, first: u32, spec: &mut [f32]) {
    let mut k = ABSOLUTE_POS as u32;
    while k < m {
        let (cr, ci) = (c[2 * k as usize], c[2 * k as usize + 1]);
        let mut re = cr;
        let mut im = ci;
        if use_chirp == 1 {
            let (wr, wi) = (chirp[2 * k as usize], chirp[2 * k as usize + 1]);
            re = cr * wr - ci * wi;
            im = cr * wi + ci * wr;
        }
        spec[2 * (first + k) as usize] = re;
        spec[2 * (first + k) as usize + 1] = im;
        k += grid_stride() as u32;
    }
}

/// The conjugated Hermitian extension of one chunk's spectrum (bins from `first`, length
/// `n`), times `chirp` where `use_chirp`, zero up to `a`'s length: `a_k = conj X_k` for
/// `k ≤ n/2`, `X_{n−k}` above (DC's and an even `n`'s Nyquist's imaginary parts zero).
#[cube(launch)]
fn hermitian(spec: &[f32], first: u32, n: u32, chirp: &[f32], use_chirp: u32, a: &mut [f32]) {
    let len = a.len() as u32 / 2;
    let m = n / 2 + 1;
    let mut k = ABSOLUTE_POS as u32;
    while k < len {
        let mut re = 0.0f32;
        let mut im = 0.0f32;
        if k < n {
            if k < m {
                re = spec[2 * (first + k) as usize];
                im = -spec[2 * (first + k) as usize + 1];
            } else {
                re = spec[2 * (first + n - k) as usize];
                im = spec[2 * (first + n - k) as usize + 1];
            }
            if k == 0 || ((n & 1) == 0 && k == n / 2) {
                im = 0.0f32;
            }
            if use_chirp == 1 {
                let (wr, wi) = (chirp[2 * k as usize], chirp[2 * k as usize + 1]);
                let r = re * wr - im * wi;
                im = re * wi + im * wr;
                re = r;
            }
        }
        a[2 * k as usize] = re;
        a[2 * k as usize + 1] = im;
        k += grid_stride() as u32;
    }
}

/// `out[start + j] = scale · Re(c_j · chirp_j)` (`chirp` only where `use_chirp`), `j < n`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn store_real(
    c: &[f32],
    chirp: &[f32],
    use_chirp: u32,
    start: u32,
    n: u32,
    scale: f32,
    out: &mut [f32],
) {
    let mut j = ABSOLUTE_POS as u32;
    while j < n {
        let mut re = c[2 * j as usize];
        if use_chirp == 1 {
            re = re * chirp[2 * j as usize] - c[2 * j as usize + 1] * chirp[2 * j as usize + 1];
        }
        out[(start + j) as usize] = scale * re;
        j += grid_stride() as u32;
    }
}

/// Bluestein's tables for one length `n` and number of outputs: the transform length `L`,
/// the chirp `c̄_j = e^{−iπj²/n}` for `j < n`, and the transform of the kernel `c_t` wrapped
/// into `L`.
struct Chirp {
    l: usize,
    chirp: GpuBuffer,
    kernel_hat: GpuBuffer,
}

/// One transform's length, scratch and Bluestein tables ([`Rfft::plan`]).
struct Plan {
    l: usize,
    a: GpuBuffer,
    b: GpuBuffer,
    /// 1 where Bluestein's chirp applies.
    use_chirp: u32,
    chirp: GpuBuffer,
    hat: Option<GpuBuffer>,
}

/// What runs the transforms of an [`Rfft`].
#[derive(Debug, Default)]
enum Engine {
    /// Not chosen yet: chosen on the first call, when the device is known.
    #[default]
    Unchosen,
    /// dtrain's own kernels (this file's).
    Own,
    /// A library (cuFFT), for chunks of [`SHORTEST`] elements or more.
    Library(Box<LibraryFft>),
}

/// Real forward transforms of a bucket's chunks on the device; tables and scratch kept.
#[derive(Default)]
pub struct Rfft {
    /// What runs the transforms (chosen on first use: cuFFT on a CUDA device where it loads
    /// and `DTRAIN_CUFFT` is not `0`, else this file's kernels).
    engine: Engine,
    /// Twiddles `e^{−2πit/L}`, `t < L/2`, interleaved, per `L`.
    twiddles: HashMap<usize, GpuBuffer>,
    /// Bluestein's tables per length `n` that is not a power of two and number of outputs
    /// (`n/2 + 1` forward, `n` inverse).
    chirps: HashMap<(usize, usize), Chirp>,
    /// Two scratch buffers of `2·L` floats for the largest `L` so far.
    scratch: Option<(GpuBuffer, GpuBuffer)>,
}

impl std::fmt::Debug for Rfft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rfft")
            .field("engine", &self.engine())
            .field("bluestein", &self.chirps.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// `e^{iφ}` as `f32` (re, im), `φ` in `f64`.
fn unit(phi: f64) -> [f32; 2] {
    [phi.cos() as f32, phi.sin() as f32]
}

impl Rfft {
    /// A transformer with nothing cached yet; what runs its transforms is chosen on its
    /// first call (see [`Rfft::engine`]).
    pub fn new() -> Self {
        Rfft::default()
    }

    /// A transformer whose chunks of [`SHORTEST`] elements or more are transformed by
    /// `library` (a vendor FFT on a device this crate has no binding for, or a test's
    /// stand-in), the shorter ones by this crate's kernels.
    pub fn with_library(library: Box<dyn FftLibrary>) -> Self {
        Rfft {
            engine: Engine::Library(Box::new(LibraryFft::new(library))),
            ..Rfft::default()
        }
    }

    /// What runs the transforms: the library's name (`cuFFT (version …)`), `dtrain's
    /// kernels`, or `not chosen yet` before the first call.
    pub fn engine(&self) -> String {
        match &self.engine {
            Engine::Unchosen => "not chosen yet".into(),
            Engine::Own => "dtrain's kernels".into(),
            Engine::Library(l) => l.name(),
        }
    }

    /// The library for this device, chosen on the first call: cuFFT on CUDA (unless
    /// `DTRAIN_CUFFT=0`) where it loads, else none — said once per process on stderr.
    fn library(&mut self, gpu: &Gpu) -> Option<&mut LibraryFft> {
        if matches!(self.engine, Engine::Unchosen) {
            self.engine = choose(gpu);
        }
        match &mut self.engine {
            Engine::Library(l) => Some(l),
            _ => None,
        }
    }

    /// Runs `run` with this device's library on the chunks it takes ([`SHORTEST`] elements
    /// or more) and returns the rest, for this file's kernels (all of them where no library
    /// is at hand).
    fn library_share(
        &mut self,
        gpu: &Gpu,
        spans: Vec<Span>,
        run: impl FnOnce(&mut LibraryFft, &[Span]) -> Result<(), DeviceError>,
    ) -> Result<Vec<Span>, DeviceError> {
        let Some(lib) = self.library(gpu) else {
            return Ok(spans);
        };
        let (long, short): (Vec<_>, Vec<_>) =
            spans.into_iter().partition(|s| s.range.len() >= SHORTEST);
        run(lib, &long)?;
        Ok(short)
    }

    fn twiddles(&mut self, gpu: &Gpu, l: usize) -> GpuBuffer {
        self.twiddles
            .entry(l)
            .or_insert_with(|| {
                let tw: Vec<f32> = (0..(l / 2).max(1))
                    .flat_map(|t| unit(-2.0 * std::f64::consts::PI * t as f64 / l as f64))
                    .collect();
                gpu.upload(&tw)
            })
            .clone()
    }

    /// Scratch buffers of at least `2·l` floats each.
    fn scratch(&mut self, gpu: &Gpu, l: usize) -> (GpuBuffer, GpuBuffer) {
        match &self.scratch {
            Some((a, b)) if a.len() >= 2 * l => (a.clone(), b.clone()),
            _ => self
                .scratch
                .insert((gpu.zeros(2 * l), gpu.zeros(2 * l)))
                .clone(),
        }
    }

    /// The complex transform of length `l` (a power of two) of `a` (its first `2·l`
    /// floats), with `b` as scratch; returns which of the two holds the result.
    fn complex(&mut self, gpu: &Gpu, a: &GpuBuffer, b: &GpuBuffer, l: usize, inverse: bool) -> bool {
        let tw = self.twiddles(gpu, l);
        let half = (l / 2) as u32;
        let (count, dim) = geometry(l / 2);
        let sign = if inverse { -1.0f32 } else { 1.0 };
        let mut in_a = true;
        let mut ns = 1u32;
        while (ns as usize) < l {
            let (src, dst) = if in_a { (a, b) } else { (b, a) };
            // SAFETY: both buffers hold at least 2·l floats, the table l/2 pairs.
            unsafe {
                stockham::launch(
                    gpu.client(),
                    count.clone(),
                    dim,
                    BufferArg::from_raw_parts(src.handle.clone(), 2 * l),
                    BufferArg::from_raw_parts(dst.handle.clone(), 2 * l),
                    tw.arg(),
                    ns,
                    half,
                    half / ns,
                    sign,
                );
            }
            in_a = !in_a;
            ns *= 2;
        }
        in_a
    }

    /// Bluestein's tables for length `n` and outputs `0..m` (made once).
    fn chirp(&mut self, gpu: &Gpu, n: usize, m: usize) -> (usize, GpuBuffer, GpuBuffer) {
        if let Some(c) = self.chirps.get(&(n, m)) {
            return (c.l, c.chirp.clone(), c.kernel_hat.clone());
        }
        let l = (n + m - 1).next_power_of_two();
        let two_n = 2 * n as u64;
        // e^{iπ t²/n}, the angle reduced exactly: t² mod 2n.
        let c = |t: u64| unit(std::f64::consts::PI * ((t * t) % two_n) as f64 / n as f64);
        let chirp: Vec<f32> = (0..n.max(m) as u64)
            .flat_map(|t| {
                let [re, im] = c(t);
                [re, -im]
            })
            .collect();
        let mut kernel = vec![0f32; 2 * l];
        for t in 0..m.max(n) {
            let [re, im] = c(t as u64);
            if t < m {
                kernel[2 * t] = re;
                kernel[2 * t + 1] = im;
            }
            if t > 0 && t < n {
                kernel[2 * (l - t)] = re;
                kernel[2 * (l - t) + 1] = im;
            }
        }
        let a = gpu.upload(&kernel);
        let b = gpu.zeros(2 * l);
        let hat = if self.complex(gpu, &a, &b, l, false) { a } else { b };
        let entry = Chirp {
            l,
            chirp: gpu.upload(&chirp),
            kernel_hat: hat,
        };
        let out = (entry.l, entry.chirp.clone(), entry.kernel_hat.clone());
        self.chirps.insert((n, m), entry);
        out
    }

    /// What a transform of length `n` with outputs `0..m` runs on: its length `L` (`n` for
    /// a power of two, else Bluestein's), the scratch, and Bluestein's chirp and kernel
    /// transform where it takes them (`filler`, any buffer, stands for the chirp
    /// argument where it does not).
    fn plan(&mut self, gpu: &Gpu, n: usize, m: usize, filler: &GpuBuffer) -> Plan {
        let (l, chirp, hat) = if n.is_power_of_two() {
            (n, filler.clone(), None)
        } else {
            let (l, chirp, hat) = self.chirp(gpu, n, m);
            (l, chirp, Some(hat))
        };
        let (a, b) = self.scratch(gpu, l);
        Plan {
            l,
            a,
            b,
            use_chirp: hat.is_some() as u32,
            chirp,
            hat,
        }
    }

    /// The DFT of the loaded `a` (`2·l` floats, `b` the scratch): directly (a power of
    /// two), or Bluestein's convolution with the kernel's transform `hat`; the buffer
    /// holding the result.
    fn transform_loaded(
        &mut self,
        gpu: &Gpu,
        a: GpuBuffer,
        b: GpuBuffer,
        l: usize,
        hat: Option<&GpuBuffer>,
    ) -> GpuBuffer {
        let (mut res, mut other) = if self.complex(gpu, &a, &b, l, false) {
            (a, b)
        } else {
            (b, a)
        };
        if let Some(hat) = hat {
            let (count, dim) = geometry(l);
            // SAFETY: both hold 2·l floats.
            unsafe {
                multiply::launch(
                    gpu.client(),
                    count,
                    dim,
                    BufferArg::from_raw_parts(res.handle.clone(), 2 * l),
                    hat.arg(),
                    1.0 / l as f32,
                );
            }
            if !self.complex(gpu, &res, &other, l, true) {
                std::mem::swap(&mut res, &mut other);
            }
        }
        res
    }

    /// The inverse real transforms (unnormalised, as the host decoder's) of the spectra
    /// `spec` (`2·Σ(n/2 + 1)` floats, chunk after chunk, as [`Rfft::forward`] writes them;
    /// DC's and an even length's Nyquist's imaginary parts taken as zero) times `scale`,
    /// written into `out` over the chunks' elements.
    pub fn inverse(
        &mut self,
        gpu: &Gpu,
        spec: &GpuBuffer,
        chunks: &[Range<usize>],
        scale: f32,
        out: &GpuBuffer,
    ) -> Result<(), DeviceError> {
        let mut spans = Vec::with_capacity(chunks.len());
        let mut first = 0;
        for r in chunks {
            spans.push(Span {
                range: r.clone(),
                first,
                pre: 1.0,
            });
            first += r.len() / 2 + 1;
        }
        let own = self.library_share(gpu, spans, |lib, long| lib.inverse(gpu, spec, long, scale, out))?;
        for s in &own {
            self.own_inverse(gpu, spec, s, scale, out);
        }
        Ok(())
    }

    /// One chunk's inverse transform by this file's kernels (see [`Rfft::inverse`]).
    fn own_inverse(&mut self, gpu: &Gpu, spec: &GpuBuffer, span: &Span, scale: f32, out: &GpuBuffer) {
        let r = &span.range;
        let first = span.first as u32;
        let n = r.len();
        // x_j = Re Σ_k X_k e^{2πijk/n} = Re DFT(conj X)_j over the Hermitian spectrum.
        let Plan { l, a, b, use_chirp, chirp, hat } = self.plan(gpu, n, n, spec);
        let (count, dim) = geometry(l);
        // SAFETY: `a` holds at least 2·l floats, the chirp n pairs when used, the
        // spectra the chunk's m bins from `first`.
        unsafe {
            hermitian::launch(
                gpu.client(),
                count,
                dim,
                spec.arg(),
                first,
                n as u32,
                chirp.arg(),
                use_chirp,
                BufferArg::from_raw_parts(a.handle.clone(), 2 * l),
            );
        }
        let res = self.transform_loaded(gpu, a, b, l, hat.as_ref());
        let (count, dim) = geometry(n);
        // SAFETY: `res` holds 2·l ≥ 2·n floats, `out` the chunk's elements.
        unsafe {
            store_real::launch(
                gpu.client(),
                count,
                dim,
                BufferArg::from_raw_parts(res.handle.clone(), 2 * l),
                chirp.arg(),
                use_chirp,
                r.start as u32,
                n as u32,
                scale,
                out.arg(),
            );
        }
    }

    /// The spectra of the chunks `chunks` (consecutive ranges tiling `x` from its start,
    /// as the codec's chunk plans are) — each chunk scaled by its `pre`
    /// ([`forward_scales`]) and transformed — into one buffer of `2·Σ(n/2 + 1)` floats
    /// (real and imaginary parts interleaved, chunk after chunk), with each chunk's `post`.
    /// The host's error where `x` holds a non-finite value (`out` is then cleared).
    pub fn forward(
        &mut self,
        gpu: &Gpu,
        x: &GpuBuffer,
        chunks: &[Range<usize>],
        out: &mut Payload,
    ) -> Result<(GpuBuffer, Vec<f32>), DeviceError> {
        let mut starts: Vec<u32> = chunks.iter().map(|c| c.start as u32).collect();
        starts.push(chunks.last().map_or(0, |c| c.end as u32));
        let total: usize = chunks.iter().map(|c| c.len() / 2 + 1).sum();
        // Every chunk's bins are written by its `store`.
        let spec = gpu.empty(2 * total);
        if chunks.is_empty() {
            return Ok((spec, Vec::new()));
        }
        let amax = gpu.words(chunks.len(), 0);
        let first_bad = gpu.words(1, u32::MAX);
        let elems = chunks.last().map_or(0, |c| c.end) - chunks[0].start;
        let [(t_starts, ns)] = upload_tables(gpu, [starts]);
        let (count, dim) = geometry(elems);
        // SAFETY: the table holds C + 1 words, `amax` C, `first_bad` one.
        unsafe {
            chunk_max::launch(
                gpu.client(),
                count,
                dim,
                x.arg(),
                BufferArg::from_raw_parts(t_starts, ns),
                BufferArg::from_raw_parts(amax.clone(), chunks.len()),
                BufferArg::from_raw_parts(first_bad.clone(), 1),
            );
        }
        let read = gpu.read_words(vec![amax, first_bad], "reading the chunks' maxima")?;
        refuse_non_finite(gpu, x, &read[1], out)?;
        let mut posts = Vec::with_capacity(chunks.len());
        let mut spans = Vec::with_capacity(chunks.len());
        let mut first = 0;
        for (c, r) in chunks.iter().enumerate() {
            let (pre, post) = forward_scales(word(&read[0], c), r.len());
            posts.push(post);
            spans.push(Span {
                range: r.clone(),
                first,
                pre,
            });
            first += r.len() / 2 + 1;
        }
        let own = self.library_share(gpu, spans, |lib, long| lib.forward(gpu, x, long, &spec))?;
        for s in &own {
            self.own_forward(gpu, x, s, &spec);
        }
        Ok((spec, posts))
    }

    /// One chunk's forward transform by this file's kernels (see [`Rfft::forward`]).
    fn own_forward(&mut self, gpu: &Gpu, x: &GpuBuffer, span: &Span, spec: &GpuBuffer) {
        let Span { range: r, first, pre } = span;
        let (pre, first) = (*pre, *first as u32);
        let n = r.len();
        let m = n / 2 + 1;
        let Plan { l, a, b, use_chirp, chirp, hat } = self.plan(gpu, n, m, spec);
        let (count, dim) = geometry(l);
        // SAFETY: `a` holds at least 2·l floats; the chirp max(n, m) pairs when used.
        unsafe {
            load::launch(
                gpu.client(),
                count,
                dim,
                x.arg(),
                r.start as u32,
                n as u32,
                pre,
                chirp.arg(),
                use_chirp,
                BufferArg::from_raw_parts(a.handle.clone(), 2 * l),
            );
        }
        let res = self.transform_loaded(gpu, a, b, l, hat.as_ref());
        let (count, dim) = geometry(m);
        // SAFETY: `res` holds 2·l ≥ 2·m floats, the spectra 2·total.
        unsafe {
            store::launch(
                gpu.client(),
                count,
                dim,
                BufferArg::from_raw_parts(res.handle.clone(), 2 * l),
                chirp.arg(),
                use_chirp,
                m as u32,
                first,
                spec.arg(),
            );
        }
    }
}

/// The engine for `gpu`: cuFFT on a CUDA device where it loads (unless `DTRAIN_CUFFT=0`),
/// else this crate's kernels; the choice on a CUDA device said once per process.
fn choose(gpu: &Gpu) -> Engine {
    #[cfg(feature = "cuda")]
    if let crate::gpu::DeviceSpec::Cuda(ordinal) = gpu.spec() {
        static SAID: std::sync::Once = std::sync::Once::new();
        let chosen = if std::env::var("DTRAIN_CUFFT").is_ok_and(|v| v == "0") {
            Err("DTRAIN_CUFFT=0".to_string())
        } else {
            crate::cufft::CuFft::open(ordinal)
        };
        return match chosen {
            Ok(lib) => {
                let lib = Box::new(LibraryFft::new(Box::new(lib)));
                SAID.call_once(|| eprintln!("dtrain-device: FFT transforms on {gpu} by {}", lib.name()));
                Engine::Library(lib)
            }
            Err(why) => {
                SAID.call_once(|| {
                    eprintln!("dtrain-device: FFT transforms on {gpu} by dtrain's kernels, not cuFFT: {why}")
                });
                Engine::Own
            }
        };
    }
    let _ = gpu;
    Engine::Own
}
