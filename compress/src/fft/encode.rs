//! Encoding one chunk of the FFT method, and the chunks of a bucket side by side.
//!
//! The encoder of a chunk needs the compressor's settings ([`Encoding`]), a forward plan for
//! the chunk's length and scratch buffers of its own ([`EncScratch`]); nothing else. So the
//! chunks of a bucket can be encoded on several threads at once ([`encode_parallel`]), each
//! into its own bytes, concatenated in order afterwards: the bytes, and the adopted residual,
//! are the same as one thread's (tested), since each chunk's arithmetic is the same.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;
use realfft::num_complex::Complex;
use realfft::RealToComplex;

use super::feedback::{compensate_spectrum, take_off_sent};
use super::{
    bin_weight, bins, emax_of_bits, grown, kept_bins, pow2_f32, pow2_f64, IndexCoding, Select,
    BITMAP, LIST, PREFIX,
};
use crate::rangefloat::{emax_of, RfDecoder, RfEncoder, RfFormat, Rounding};
use crate::rng::Rng;
use crate::select::{top_k_keys, Scratch};
use crate::simd::{max_magnitude_bits, vector_dispatch};
use crate::wire::{bytes_for_bits, Writer};

/// The settings a chunk's encoding reads (θ in effect, value format, selection, index coding).
#[derive(Debug, Clone, Copy)]
pub(super) struct Encoding {
    pub(super) theta: f64,
    pub(super) fmt: Option<RfFormat>,
    pub(super) select: Select,
    pub(super) coding: IndexCoding,
}

impl Encoding {
    /// The index layout of a chunk of `m` bins keeping `k`.
    pub(super) fn layout(&self, m: usize, k: usize) -> u8 {
        match (self.select, self.coding) {
            (Select::Lowpass, _) => PREFIX,
            (_, IndexCoding::Bitmap) => BITMAP,
            (_, IndexCoding::List) => LIST,
            (_, IndexCoding::Auto) => {
                if (m.div_ceil(8) as u64) * 8 < 32 * k as u64 {
                    BITMAP
                } else {
                    LIST
                }
            }
        }
    }
}

/// The power of two `pre` a chunk of `n` elements is scaled by before its forward transform
/// (bringing its largest magnitude, given as its sign-cleared bits `amax`, into `[1, 2)`; 1
/// for an all-zero chunk), and the factor `post` that turns the transform of the scaled chunk
/// into `Y = X/n`.
pub(super) fn forward_scales(amax: u32, n: usize) -> (f32, f32) {
    let e0 = if amax == 0 {
        0
    } else {
        emax_of_bits(amax).clamp(-100, 100)
    };
    (pow2_f32(-e0), (pow2_f64(e0) / n as f64) as f32)
}

/// One encoder's buffers, reused from chunk to chunk.
#[derive(Default)]
pub(super) struct EncScratch {
    input: Vec<f32>,
    pub(super) spec: Vec<Complex<f32>>,
    fft_scratch: Vec<Complex<f32>>,
    keys: Vec<u32>,
    pub(super) keep: Vec<u32>,
    vals: Vec<f32>,
    /// The decoded (quantized) `vals`, for the adopted residual.
    sent: Vec<f32>,
    sel: Scratch,
}

vector_dispatch! {
    /// `dst[i] = src[i] · k` (equal lengths).
    fn scale_into(dst: &mut [f32], src: &[f32], k: f32) = scale_into_lanes;
}

#[inline(always)]
fn scale_into_lanes(dst: &mut [f32], src: &[f32], k: f32) {
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = v * k;
    }
}

impl EncScratch {
    /// Forward transform of `x` with `plan` (scaled by a power of two into `[1, 2)` at the
    /// top so that energies neither overflow nor underflow) into `spec`; returns the factor
    /// that turns `spec` into `Y = X/n`.
    pub(super) fn forward(&mut self, plan: &dyn RealToComplex<f32>, x: &[f32]) -> f32 {
        let n = x.len();
        let (pre, post) = forward_scales(max_magnitude_bits(x), n);
        let input = grown(&mut self.input, n);
        scale_into(input, x, pre);
        self.spec.resize(bins(n), Complex::default());
        let scratch = grown(&mut self.fft_scratch, plan.get_scratch_len());
        // Lengths match the plan by construction, so this cannot fail.
        let _ = plan.process_with_scratch(input, &mut self.spec, scratch);
        post
    }

    /// Fills `keep` with the kept bins of the spectrum in `spec` (of a length-`n` chunk),
    /// whose energies are taken after multiplying it by `scale` (a power of two).
    pub(super) fn choose(&mut self, cfg: &Encoding, n: usize, scale: f32) {
        let m = bins(n);
        let k = kept_bins(m, cfg.theta);
        self.keep.clear();
        match cfg.select {
            Select::Lowpass => self.keep.extend(0..k as u32),
            Select::EnergyTopk => {
                self.keys.clear();
                self.keys.extend(self.spec.iter().enumerate().map(|(i, c)| {
                    let (re, im) = (c.re * scale, c.im * scale);
                    let e = bin_weight(n, i) * (re * re + im * im);
                    e.to_bits() + 1
                }));
                top_k_keys(&self.keys, k, &mut self.sel, &mut self.keep);
            }
        }
    }

    /// Encodes the chunk `x` (body format in the module docs of [`super`]) into `w`. With a
    /// `residual` (the chunk's packed spectral residual, adopted error feedback), encodes
    /// `x + e` and leaves the new residual there.
    pub(super) fn encode_chunk(
        &mut self,
        cfg: &Encoding,
        plan: &dyn RealToComplex<f32>,
        x: &[f32],
        mut residual: Option<&mut [f32]>,
        w: &mut Writer<'_>,
    ) {
        let n = x.len();
        let m = bins(n);
        let mut post = self.forward(plan, x);
        let mut scale = 1.0;
        if let Some(e) = residual.as_deref_mut() {
            // Y_p = Y_g + E: the spectrum in Y units, compensated (and packed into `e`);
            // energies then need a power-of-two scale of their own.
            scale = compensate_spectrum(&mut self.spec, post, e);
            post = 1.0;
        }
        self.choose(cfg, n, scale);
        let layout = cfg.layout(m, self.keep.len());
        let nyq = if n.is_multiple_of(2) {
            n / 2
        } else {
            usize::MAX
        };
        self.vals.clear();
        for &b in &self.keep {
            let c = self.spec[b as usize];
            let b = b as usize;
            let im = if b == 0 || b == nyq { 0.0 } else { c.im * post };
            // Y is bounded by ~2·max|x|; clamp the (only theoretical) overflow near f32::MAX.
            self.vals.push((c.re * post).clamp(-f32::MAX, f32::MAX));
            self.vals.push(im.clamp(-f32::MAX, f32::MAX));
        }
        write_head(w, layout, cfg.fmt, m, &self.keep);
        match cfg.fmt {
            Some(f) => {
                let emax = emax_of(&self.vals);
                w.u8(emax as u8);
                let out = w.zeroed(bytes_for_bits(self.vals.len() as u64 * f.bits() as u64));
                // Nearest rounding never draws from the RNG.
                RfEncoder::new(f, emax).encode(
                    &self.vals,
                    Rounding::Nearest,
                    &mut Rng::seed_from_u64(0),
                    out,
                );
                if residual.is_some() {
                    self.sent.resize(self.vals.len(), 0.0);
                    let decoded =
                        RfDecoder::new(f, emax, self.vals.len()).decode(out, &mut self.sent);
                    if decoded.is_err() {
                        // Codes just encoded always decode; this is only belt and braces.
                        for (t, &v) in self.sent.iter_mut().zip(&self.vals) {
                            *t = f.quantize(emax, v);
                        }
                    }
                }
            }
            None => {
                w.f32_slice(&self.vals);
                self.sent.clear();
                self.sent.extend_from_slice(&self.vals);
            }
        }
        if let Some(e) = residual {
            take_off_sent(&self.keep, &self.sent, e);
        }
    }
}

/// Writes a chunk body's head — layout, value format, `K` — and its index part (module
/// docs of [`super`]) for the kept bins `keep` (ascending) of `m`.
pub(super) fn write_head(
    w: &mut Writer<'_>,
    layout: u8,
    fmt: Option<RfFormat>,
    m: usize,
    keep: &[u32],
) {
    w.u8(layout);
    match fmt {
        Some(f) => {
            w.u8(f.exp_bits() as u8);
            w.u8(f.mantissa_bits() as u8);
        }
        None => {
            w.u8(0);
            w.u8(0);
        }
    }
    w.u32(keep.len() as u32);
    match layout {
        LIST => w.u32_slice(keep),
        BITMAP => {
            let bm = w.zeroed(m.div_ceil(8));
            for &i in keep {
                bm[(i >> 3) as usize] |= 1 << (i & 7);
            }
        }
        _ => {}
    }
}

/// One chunk of a parallel encoding: where it lies in the bucket, its plan, its bytes.
pub(super) struct Job {
    pub(super) range: Range<usize>,
    pub(super) plan: Arc<dyn RealToComplex<f32>>,
    pub(super) out: Vec<u8>,
}

/// A scratch borrowed from a pool for one rayon split, handed back when the split ends, so
/// the pool holds about one scratch per thread, each grown to the largest chunk it met.
pub(super) struct Lease<'a, T> {
    pool: &'a Mutex<Vec<T>>,
    scratch: Option<T>,
}

impl<'a, T: Default> Lease<'a, T> {
    /// Takes a scratch from `pool` (a new one if it is empty).
    pub(super) fn take(pool: &'a Mutex<Vec<T>>) -> Self {
        let scratch = pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
        Lease {
            pool,
            scratch: Some(scratch.unwrap_or_default()),
        }
    }

    /// The borrowed scratch.
    pub(super) fn get(&mut self) -> &mut T {
        self.scratch.get_or_insert_with(T::default)
    }
}

impl<T> Drop for Lease<'_, T> {
    fn drop(&mut self) {
        if let Some(s) = self.scratch.take() {
            self.pool.lock().unwrap_or_else(|e| e.into_inner()).push(s);
        }
    }
}

/// Encodes every job's chunk of `x` (ranges in order, tiling the part of `x` they cover) on
/// rayon's threads, each into its `out`. `residual`, when error feedback is adopted, is the
/// packed residual of exactly the jobs' elements (`residual.len()` = the ranges' total, the
/// first range starting at `x`'s index 0 of it).
pub(super) fn encode_parallel(
    cfg: &Encoding,
    x: &[f32],
    jobs: &mut [Job],
    residual: Option<&mut [f32]>,
    pool: &Mutex<Vec<EncScratch>>,
) {
    // Cut the residual into the jobs' disjoint pieces.
    let mut pieces: Vec<Option<&mut [f32]>> = Vec::with_capacity(jobs.len());
    match residual {
        Some(mut rest) => {
            for j in jobs.iter() {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(j.range.len());
                pieces.push(Some(head));
                rest = tail;
            }
        }
        None => pieces.resize_with(jobs.len(), || None),
    }
    jobs.par_iter_mut().zip(pieces).for_each_init(
        || Lease::take(pool),
        |lease, (job, piece)| {
            let scratch = lease.get();
            job.out.clear();
            let mut w = Writer::new(&mut job.out);
            scratch.encode_chunk(cfg, &*job.plan, &x[job.range.clone()], piece, &mut w);
        },
    );
}

#[cfg(test)]
mod tests {
    use crate::compressor::{Ctx, Payload};
    use crate::fft::{FftConfig, PARALLEL_MIN};
    use crate::memory::MemoryConfig;
    use crate::pipeline::Pipeline;
    use crate::rng::Rng;

    /// Several threads write the same bytes and keep the same residual as one, with and
    /// without adopted error feedback, whole tensors and chunked; the joint decode gives
    /// the same sum.
    #[test]
    fn the_threads_encode_what_one_thread_encodes() {
        let lens = [70_000usize, 3, 40_000, 1, 25_001];
        let n: usize = lens.iter().sum();
        assert!(n >= PARALLEL_MIN);
        let mut segs = Vec::new();
        let mut at = 0;
        for l in lens {
            segs.push(at..at + l);
            at += l;
        }
        let mut rng = Rng::seed_from_u64(5);
        let grads: Vec<Vec<f32>> = (0..3)
            .map(|_| (0..n).map(|_| rng.next_f32() - 0.5).collect())
            .collect();
        for (chunk, memory) in [
            (None, MemoryConfig::RESIDUAL),
            (Some(8192), MemoryConfig::RESIDUAL),
            (None, MemoryConfig::None),
        ] {
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    let cfg = FftConfig {
                        chunk,
                        ..FftConfig::default()
                    };
                    let mut p =
                        Pipeline::new(Box::new(cfg.init().unwrap()), memory.build().unwrap());
                    let payloads: Vec<Vec<u8>> = grads
                        .iter()
                        .enumerate()
                        .map(|(step, g)| {
                            let ctx = Ctx {
                                step: step as u64,
                                rank: 0,
                                bucket: 2,
                                segments: &segs,
                            };
                            let mut out = Payload::new();
                            p.compress(g, &ctx, &mut Rng::seed_from_u64(0), &mut out)
                                .unwrap();
                            out.into_bytes()
                        })
                        .collect();
                    // The receivers' joint decode of two payloads, inverse transforms side
                    // by side or not.
                    let mut sum = vec![0f32; n];
                    p.decompress_sum_add(&[&payloads[1], &payloads[2]], &mut sum)
                        .unwrap();
                    (payloads, p.export_memory(), sum)
                })
            };
            let (one, three) = (run(1), run(3));
            assert!(
                one.0 == three.0,
                "bytes: chunk {chunk:?}, memory {memory:?}"
            );
            assert!(
                one.1 == three.1,
                "residual: chunk {chunk:?}, memory {memory:?}"
            );
            assert!(
                one.2 == three.2,
                "decoded sum: chunk {chunk:?}, memory {memory:?}"
            );
        }
    }
}
