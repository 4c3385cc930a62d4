//! The device's real forward transform (`dtrain_device::Rfft`) against the host codec's
//! (`Fft::spectrum_into`, realfft): every bin of every chunk, in `Y = X/n` units, within
//! 1e-5 of the chunk's largest bin — powers of two (direct) and every other length
//! (Bluestein), chunks of different lengths side by side, tiny and huge magnitudes (the
//! pre-scaling) — and non-finite input refused with the host's error. On
//! `DTRAIN_TEST_DEVICE` (default `wgpu` where built, else `cuda`).
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use std::ops::Range;

use dtrain_compress::fft::FftConfig;
use dtrain_compress::{CompressError, Payload, Rng};
use dtrain_device::{DeviceError, Rfft};

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
    rfft.inverse(&gpu, &gpu.upload(&spec), &chunks, scale, &out);
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
