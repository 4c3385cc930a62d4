//! The device's real forward transform (`dtrain_device::Rfft`) against the host codec's
//! (`Fft::spectrum_into`, realfft): every bin of every chunk, in `Y = X/n` units, within
//! 1e-5 of the chunk's largest bin — powers of two (direct) and every other length
//! (Bluestein), chunks of different lengths side by side, tiny and huge magnitudes (the
//! pre-scaling) — and non-finite input refused with the host's error; and the path a
//! vendor library (cuFFT) takes, with the host's realfft standing in for it. On
//! `DTRAIN_TEST_DEVICE` (default `wgpu` where built, else `cuda`).
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use std::ops::Range;

use dtrain_compress::fft::FftConfig;
use dtrain_compress::{CompressError, Payload, Rng};
use dtrain_device::{DeviceError, DeviceSpec, FftLibrary, Gpu, GpuBuffer, Job, Rfft};
use realfft::num_complex::Complex;
use realfft::RealFftPlanner;

mod common;

/// The largest error of the device's spectra against the host's, relative to each chunk's
/// largest bin.
fn worst_error(x: &[f32], chunks: &[Range<usize>], rfft: &mut Rfft) -> f64 {
    let gpu = common::open_test_device();
    let mut host = FftConfig::default().init().unwrap();
    let (spec, posts) = rfft
        .forward(&gpu, &gpu.upload(x), chunks, &mut Payload::new())
        .unwrap();
    let dev = gpu.download(&spec).unwrap();
    let mut worst = 0f64;
    let mut at = 0;
    for (c, r) in chunks.iter().enumerate() {
        let m = r.len() / 2 + 1;
        let mut want = vec![0f32; 2 * m];
        let post = host.spectrum_into(&x[r.clone()], &mut want);
        assert_eq!(post, posts[c], "chunk {c}: post");
        let got = &dev[2 * at..2 * (at + m)];
        let top = want
            .iter()
            .fold(0f64, |a, &v| a.max((v as f64 * post as f64).abs()));
        let err = got.iter().zip(&want).fold(0f64, |a, (&g, &w)| {
            a.max(((g - w) as f64 * post as f64).abs())
        });
        if top > 0.0 {
            worst = worst.max(err / top);
        } else {
            assert_eq!(err, 0.0, "chunk {c}: zeros");
        }
        at += m;
    }
    worst
}

fn signal(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut r = Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| ((r.next_f32() - 0.5) + (i as f32 * 0.01).sin()) * scale)
        .collect()
}

#[test]
fn device_spectra_are_the_hosts_within_rounding() {
    let mut rfft = Rfft::new();
    let mut worst = 0f64;
    for (i, &n) in [
        1usize, 2, 3, 4, 5, 7, 8, 9, 16, 31, 64, 100, 1000, 1023, 1024, 4097, 30_000, 100_003,
    ]
    .iter()
    .enumerate()
    {
        for scale in [1.0f32, 3e-30, 7e25] {
            let x = signal(n, i as u64, scale);
            let e = worst_error(&x, std::slice::from_ref(&(0..n)), &mut rfft);
            assert!(e < 1e-5, "n = {n}, scale {scale}: {e:e}");
            worst = worst.max(e);
        }
    }
    // Chunks of several lengths in one bucket, and an all-zero one.
    let mut x = signal(5000, 9, 1e-3);
    x[1000..1300].fill(0.0);
    let chunks = vec![0..1000, 1000..1300, 1300..1301, 1301..4096, 4096..5000];
    let e = worst_error(&x, &chunks, &mut rfft);
    assert!(e < 1e-5, "chunks: {e:e}");
    println!(
        "largest error relative to a chunk's largest bin: {:.2e}",
        worst.max(e)
    );
}

#[test]
fn non_finite_input_is_the_hosts_error() {
    let gpu = common::open_test_device();
    let mut x = signal(300, 1, 1.0);
    x[123] = f32::NAN;
    x[200] = f32::INFINITY;
    let mut out = Payload::new();
    let e = Rfft::new()
        .forward(&gpu, &gpu.upload(&x), &[0..100, 100..300], &mut out)
        .unwrap_err();
    assert!(
        matches!(e, DeviceError::Compress(CompressError::NonFinite { index: 123, value }) if value.is_nan()),
        "{e}"
    );
}

/// The device's inverse real transforms against the host decoder's (`Fft::inverse_add`,
/// realfft's unnormalised C2R): every element within 1e-5 of the chunk's largest, for
/// powers of two and other lengths side by side, DC's and Nyquist's imaginary parts
/// ignored as the host ignores them, and the scale applied.
#[test]
fn device_inverse_transforms_are_the_hosts_within_rounding() {
    let gpu = common::open_test_device();
    let host = FftConfig::default().init().unwrap();
    let lens = [1usize, 2, 3, 8, 9, 100, 1024, 4097, 30_000];
    let mut r = Rng::seed_from_u64(17);
    let mut chunks = Vec::new();
    let mut spec = Vec::new();
    let mut at = 0;
    for &n in &lens {
        chunks.push(at..at + n);
        at += n;
        for _ in 0..(n / 2 + 1) {
            spec.push(r.next_f32() - 0.5);
            spec.push(r.next_f32() - 0.5);
        }
    }
    let scale = 0.25f32;
    let out = gpu.zeros(at);
    let mut rfft = Rfft::new();
    rfft.inverse(&gpu, &gpu.upload(&spec), &chunks, scale, &out)
        .unwrap();
    let dev = gpu.download(&out).unwrap();
    let mut worst = 0f64;
    let mut first = 0;
    for c in &chunks {
        let m = c.len() / 2 + 1;
        let mut want = vec![0f32; c.len()];
        host.inverse_add(&spec[2 * first..2 * (first + m)], &mut want)
            .unwrap();
        let top = want
            .iter()
            .fold(0f64, |a, &v| a.max((v * scale).abs() as f64));
        for (g, w) in dev[c.clone()].iter().zip(&want) {
            worst = worst.max(((g - w * scale) as f64).abs() / top);
        }
        first += m;
    }
    assert!(worst < 1e-5, "{worst:e}");
    println!("largest inverse error relative to a chunk's largest element: {worst:.2e}");
}

/// A stand-in for a vendor FFT library (cuFFT) that computes each job on the host with
/// realfft, the host codec's own transform, and records the batches it was given.
struct HostLibrary {
    batches: Batches,
}

/// The batches a [`HostLibrary`] was given: each one's direction (`true`: inverse) and jobs.
type Batches = std::sync::Arc<std::sync::Mutex<Vec<(bool, Vec<Job>)>>>;

impl HostLibrary {
    /// Runs `jobs` from `src` into `dst` (`inverse`: complex to real), as the device
    /// library would: the whole buffers read back, each job transformed, `dst` written.
    fn run(
        &self,
        gpu: &Gpu,
        src: &GpuBuffer,
        dst: &GpuBuffer,
        jobs: &[Job],
        inverse: bool,
    ) -> Result<(), DeviceError> {
        self.batches.lock().unwrap().push((inverse, jobs.to_vec()));
        let input = gpu.download(src)?;
        let mut out = gpu.download(dst)?;
        let mut planner = RealFftPlanner::<f32>::new();
        for job in jobs {
            assert!(
                job.real % 4 == 0 && job.complex % 4 == 0,
                "{job:?}: not 16-byte aligned"
            );
            let (n, m) = (job.n, job.n / 2 + 1);
            if inverse {
                let mut c: Vec<Complex<f32>> = input[job.complex..job.complex + 2 * m]
                    .chunks_exact(2)
                    .map(|v| Complex::new(v[0], v[1]))
                    .collect();
                // realfft refuses non-zero imaginary parts at DC and Nyquist.
                planner
                    .plan_fft_inverse(n)
                    .process(&mut c, &mut out[job.real..job.real + n])
                    .unwrap();
            } else {
                let mut x = input[job.real..job.real + n].to_vec();
                let mut c = vec![Complex::default(); m];
                planner.plan_fft_forward(n).process(&mut x, &mut c).unwrap();
                for (k, v) in c.iter().enumerate() {
                    out[job.complex + 2 * k] = v.re;
                    out[job.complex + 2 * k + 1] = v.im;
                }
            }
        }
        gpu.copy_into(&gpu.upload(&out), dst, 0);
        Ok(())
    }
}

impl FftLibrary for HostLibrary {
    fn name(&self) -> String {
        "realfft on the host (a test's stand-in)".into()
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

/// The path a vendor library takes (cuFFT on CUDA), with realfft standing in for it: each
/// chunk of 16 elements or more scaled, packed and transformed in one batch per direction,
/// the bins copied back into the spectra — the host codec's spectra bit for bit, as the
/// same transform runs — and the shorter chunks left to the device's own kernels (within
/// rounding). The inverse: DC's and Nyquist's imaginary parts dropped (realfft refuses
/// them), every element the host decoder's times the scale, bit for bit.
#[test]
fn a_library_gets_the_long_chunks_in_one_batch_and_gives_the_hosts_bits() {
    let gpu = common::open_test_device();
    let batches = Batches::default();
    let lib = HostLibrary {
        batches: batches.clone(),
    };
    let mut rfft = Rfft::with_library(Box::new(lib));
    assert_eq!(rfft.engine(), "realfft on the host (a test's stand-in)");
    let lens = [1usize, 15, 16, 17, 100, 3, 1024, 4097, 2, 30_001];
    let mut chunks = Vec::new();
    let mut at = 0;
    for &n in &lens {
        chunks.push(at..at + n);
        at += n;
    }
    let mut x = signal(at, 5, 1e-2);
    x[chunks[4].clone()].iter_mut().for_each(|v| *v *= 1e20);
    let mut host = FftConfig::default().init().unwrap();
    let (spec, posts) = rfft
        .forward(&gpu, &gpu.upload(&x), &chunks, &mut Payload::new())
        .unwrap();
    let dev = gpu.download(&spec).unwrap();
    let mut first = 0;
    for (c, r) in chunks.iter().enumerate() {
        let m = r.len() / 2 + 1;
        let mut want = vec![0f32; 2 * m];
        assert_eq!(host.spectrum_into(&x[r.clone()], &mut want), posts[c]);
        let got = &dev[2 * first..2 * (first + m)];
        if r.len() >= 16 {
            assert_eq!(got, &want[..], "chunk {c} ({} elements)", r.len());
        } else {
            let top = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-5 * top, "chunk {c}: {g} vs {w}");
            }
        }
        first += m;
    }
    let long: Vec<usize> = lens.iter().copied().filter(|&n| n >= 16).collect();
    {
        let b = batches.lock().unwrap();
        assert_eq!(b.len(), 1, "one batch forward");
        assert!(!b[0].0);
        assert_eq!(b[0].1.iter().map(|j| j.n).collect::<Vec<_>>(), long);
    }

    // The inverse of arbitrary spectra (non-zero imaginary parts at DC and Nyquist).
    let mut r = Rng::seed_from_u64(3);
    let spec: Vec<f32> = (0..2 * first).map(|_| r.next_f32() - 0.5).collect();
    let scale = 0.125f32;
    let out = gpu.zeros(at);
    rfft.inverse(&gpu, &gpu.upload(&spec), &chunks, scale, &out)
        .unwrap();
    let dev = gpu.download(&out).unwrap();
    let mut first = 0;
    for (c, r) in chunks.iter().enumerate() {
        let m = r.len() / 2 + 1;
        let mut want = vec![0f32; r.len()];
        host.inverse_add(&spec[2 * first..2 * (first + m)], &mut want)
            .unwrap();
        let want: Vec<f32> = want.iter().map(|w| w * scale).collect();
        if r.len() >= 16 {
            assert_eq!(
                &dev[r.clone()],
                &want[..],
                "chunk {c} ({} elements)",
                r.len()
            );
        } else {
            let top = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (g, w) in dev[r.clone()].iter().zip(&want) {
                assert!((g - w).abs() <= 1e-5 * top, "chunk {c}: {g} vs {w}");
            }
        }
        first += m;
    }
    let b = batches.lock().unwrap();
    assert_eq!(b.len(), 2, "one batch each way");
    assert!(b[1].0);
    assert_eq!(b[1].1.iter().map(|j| j.n).collect::<Vec<_>>(), long);
}

/// Where no library is given, the engine is chosen on the first call: on wgpu (and on CUDA
/// without cuFFT) the device's own kernels.
#[test]
fn the_engine_is_chosen_on_the_first_call() {
    let gpu = common::open_test_device();
    let mut rfft = Rfft::new();
    assert_eq!(rfft.engine(), "not chosen yet");
    rfft.forward(
        &gpu,
        &gpu.upload(&[1.0, 2.0]),
        std::slice::from_ref(&(0..2)),
        &mut Payload::new(),
    )
    .unwrap();
    if matches!(gpu.spec(), DeviceSpec::Wgpu(_)) {
        assert_eq!(rfft.engine(), "dtrain's kernels");
    } else {
        println!("engine on {gpu}: {}", rfft.engine());
    }
}
