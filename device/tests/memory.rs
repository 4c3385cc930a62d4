//! Error feedback on the device against the host pipeline: over several steps of a codec
//! with the residual memory, every payload equals the host's and the residual after each
//! step equals the host's bit for bit (issue #51: "the residual after a device step equal to
//! the CPU residual"). On `DTRAIN_TEST_DEVICE` (default `wgpu` where built, else `cuda`).
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use std::ops::Range;

use dtrain_compress::{CompressorConfig, Ctx, MemoryConfig, Payload, Pipeline, Rng};
use dtrain_device::DevicePipeline;

mod common;

fn gradient(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| (r.next_f32() - 0.5) * 10f32.powi(-(((i / 50) % 5) as i32)))
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Compresses gradients of steps `0..steps` of one bucket through a host pipeline and a
/// device pipeline of `cfg` with `memory` and asserts that every payload and the memory's
/// state after every step (its export) are the host's bit for bit; with `import_at`, the
/// host's state is imported on the device before that step (a checkpoint's round trip).
fn steps_agree(
    cfg: &CompressorConfig,
    memory: &MemoryConfig,
    segs: &[Range<usize>],
    steps: u64,
    import_at: Option<u64>,
    what: &str,
) {
    let gpu = common::open_test_device();
    let n = segs.last().map_or(0, |s| s.end);
    let key = 7;
    let mut host = Pipeline::new(cfg.build().unwrap(), memory.build().unwrap());
    let mut dev = DevicePipeline::for_method(cfg, memory).unwrap();
    let (mut hp, mut dp) = (Payload::new(), Payload::new());
    for step in 0..steps {
        if import_at == Some(step) {
            dev.import_memory(&gpu, &host.export_memory());
        }
        let g = gradient(n, 31 * step + 5);
        let ctx = Ctx {
            step,
            bucket: key,
            segments: segs,
            ..Ctx::default()
        };
        let mut rng = Rng::seed_from_u64(step);
        host.compress(&g, &ctx, &mut rng.clone(), &mut hp).unwrap();
        dev.compress(&gpu, &gpu.upload(&g), &ctx, &mut rng, &mut dp)
            .unwrap();
        assert_eq!(dp.as_bytes(), hp.as_bytes(), "{what}, step {step}: payload");
        let want = host.export_memory().remove(&key).expect("a host state");
        let got = dev.export_memory(&gpu).unwrap().remove(&key).unwrap();
        assert_eq!(bits(&got), bits(&want), "{what}, step {step}: memory");
    }
}

#[test]
fn residual_after_each_device_step_is_the_hosts() {
    let segs: Vec<Range<usize>> = vec![0..1000, 1000..1001, 1001..2500, 2500..3000];
    for (name, memory) in [
        ("topk", MemoryConfig::RESIDUAL),
        ("fp16", MemoryConfig::RESIDUAL),
        (
            "bf16",
            MemoryConfig::Residual {
                beta: 0.9,
                gamma: 0.5,
            },
        ),
        ("signsgd", MemoryConfig::RESIDUAL),
        // Signum's own momentum, and ScaleCom's low-pass memory under top-k.
        ("signum", MemoryConfig::Momentum { beta: 0.9 }),
        ("signum", MemoryConfig::Momentum { beta: 0.3 }),
        ("topk", MemoryConfig::LowPass { beta: 1.0 }),
        ("topk", MemoryConfig::LowPass { beta: 0.4 }),
    ] {
        let cfg = CompressorConfig::default_for(name).unwrap();
        steps_agree(&cfg, &memory, &segs, 4, None, name);
    }
}

/// DGC's momentum-corrected memory on the device: over several steps the payloads equal the
/// host's and the momentum and velocity (`u` then `v`, the host's export) equal the host's
/// bit for bit — plain and Nesterov, with and without masking, with by-value clipping — and
/// a state exported by the host and imported on the device carries on as the host does.
#[test]
fn dgc_momentum_after_each_device_step_is_the_hosts() {
    let segs: Vec<Range<usize>> = vec![0..4500, 4500..4510, 4510..6000];
    let cfg: CompressorConfig =
        toml::from_str("kind = \"dgc\"\nratio = 0.01\nmin_sparse_len = 1000").unwrap();
    for memory in [
        "kind = \"dgc-momentum\"",
        "kind = \"dgc-momentum\"\nnesterov = true",
        "kind = \"dgc-momentum\"\nmasking = false\nmomentum = 0.5",
        "kind = \"dgc-momentum\"\n[clip]\nkind = \"value\"\nmax = 0.02",
    ] {
        let parsed: MemoryConfig = toml::from_str(memory).unwrap();
        steps_agree(&cfg, &parsed, &segs, 5, Some(3), memory);
    }
}

/// FFT's spectral residual (the classic residual, kept as spectra by the codec), with the
/// host's transform (`transform = "host"`, so that the bytes can be compared): every
/// payload and the packed residual after every step are the host's bit for bit — whole
/// tensors and chunks, energy and low-pass selection, range-float and raw values, a θ
/// schedule, a host residual imported mid-way — and with `spectral_feedback = false` the
/// generic residual over the signal (decoded through the host's inverse transform).
#[test]
fn fft_spectral_residual_after_each_device_step_is_the_hosts() {
    let segs: Vec<Range<usize>> = vec![0..1000, 1000..1001, 1001..2500, 2500..3000];
    for spec in [
        "kind = \"fft\"\ntransform = \"host\"",
        "kind = \"fft\"\ntransform = \"host\"\nchunk = 256\ntheta = 0.7",
        "kind = \"fft\"\ntransform = \"host\"\nselect = \"lowpass\"\nquantize = false",
        "kind = \"fft\"\ntransform = \"host\"\ntheta_schedule = { kind = \"inv\", theta0 = 0.9, tau = 2.0 }",
        "kind = \"fft\"\ntransform = \"host\"\nspectral_feedback = false\nexp_bits = 5\nmantissa_bits = 10",
    ] {
        let cfg: CompressorConfig = toml::from_str(spec).unwrap();
        steps_agree(&cfg, &MemoryConfig::RESIDUAL, &segs, 5, Some(3), spec);
    }
}

#[test]
fn memories_and_methods_without_a_device_form_are_refused_by_name() {
    let norm: MemoryConfig =
        toml::from_str("kind = \"dgc-momentum\"\n[clip]\nkind = \"norm\"\nmax_norm = 1.0").unwrap();
    let dgc = CompressorConfig::default_for("dgc").unwrap();
    let e = DevicePipeline::for_method(&dgc, &norm)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("norm"), "{e}");
    let qsgd = CompressorConfig::default_for("qsgd").unwrap();
    let e = DevicePipeline::for_method(&qsgd, &MemoryConfig::RESIDUAL)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("qsgd"), "{e}");
}

/// A three-rank exchange on the device path gives the host path's mean (issue #51, item 4):
/// each rank compresses its own gradient through its memory on the device, the payloads are
/// gathered (here: collected in rank order, as the all-gather delivers them), and every rank
/// decodes their mean on the device — equal bit for bit to the host's `decompress_mean` and
/// `Combine::finish` of the host pipelines' payloads, over three steps, for a dense codec, a
/// sparse one with error feedback and the majority vote.
#[test]
fn three_ranks_on_the_device_path_average_as_the_host_path() {
    use dtrain_compress::{decompress_mean, Touched};
    let gpu = common::open_test_device();
    let (n, ranks) = (2500, 3);
    let segs: Vec<Range<usize>> = vec![0..700, 700..2500];
    let inv = 1.0 / ranks as f32;
    for (name, memory) in [
        ("fp16", MemoryConfig::None),
        ("topk", MemoryConfig::RESIDUAL),
        ("signsgd", MemoryConfig::None),
    ] {
        let cfg = CompressorConfig::default_for(name).unwrap();
        let mut host: Vec<Pipeline> = (0..ranks)
            .map(|_| Pipeline::new(cfg.build().unwrap(), memory.build().unwrap()))
            .collect();
        let mut dev: Vec<DevicePipeline> = (0..ranks)
            .map(|_| DevicePipeline::for_method(&cfg, &memory).unwrap())
            .collect();
        for step in 0..3u64 {
            let mut hp = vec![Payload::new(); ranks];
            let mut dp = vec![Payload::new(); ranks];
            for r in 0..ranks {
                let g = gradient(n, 100 * step + r as u64);
                let ctx = Ctx {
                    step,
                    rank: r as u32,
                    segments: &segs,
                    ..Ctx::default()
                };
                let mut rng = Rng::for_step(1, step, r as u64, 0);
                host[r]
                    .compress(&g, &ctx, &mut rng.clone(), &mut hp[r])
                    .unwrap();
                dev[r]
                    .compress(&gpu, &gpu.upload(&g), &ctx, &mut rng, &mut dp[r])
                    .unwrap();
            }
            assert_eq!(dp, hp, "{name}, step {step}: payloads");
            let all: Vec<&[u8]> = hp.iter().map(|p| p.as_bytes()).collect();
            let c = cfg.build().unwrap();
            let mut want = vec![0f32; n];
            decompress_mean(c.as_ref(), &all, inv, &mut want, &mut Touched::default()).unwrap();
            c.combine().finish(&mut want);
            for rank in &dev {
                let out = gpu.zeros(n);
                rank.decode_mean(&gpu, &all, inv, &out).unwrap();
                let got = gpu.download(&out).unwrap();
                assert_eq!(bits(&got), bits(&want), "{name}, step {step}: mean");
            }
        }
    }
}

/// FFT's joint decode on the device (the kept values summed into one spectrum, one inverse
/// transform per chunk): the mean of three ranks' payloads within 1e-5 (L2, relative) of the
/// host's `decompress_mean` — whole tensors, chunks, low-pass raw values — and a malformed
/// payload refused with the host's error and its index.
#[test]
fn fft_joint_decode_on_the_device_is_the_hosts_mean_within_rounding() {
    use dtrain_compress::{decompress_mean, Touched};
    let gpu = common::open_test_device();
    let (n, ranks) = (5000, 3);
    let segs: Vec<Range<usize>> = vec![0..1, 1..1025, 1025..4100, 4100..5000];
    let inv = 1.0 / ranks as f32;
    let mut worst = 0f64;
    for spec in [
        "kind = \"fft\"",
        "kind = \"fft\"\nchunk = 300\ntheta = 0.5",
        "kind = \"fft\"\nselect = \"lowpass\"\nquantize = false",
    ] {
        let cfg: CompressorConfig = toml::from_str(spec).unwrap();
        let c = cfg.build().unwrap();
        let payloads: Vec<Payload> = (0..ranks)
            .map(|r| {
                let ctx = Ctx {
                    segments: &segs,
                    ..Ctx::default()
                };
                let mut host =
                    Pipeline::new(cfg.build().unwrap(), MemoryConfig::None.build().unwrap());
                let mut p = Payload::new();
                host.compress(
                    &gradient(n, 7 + r),
                    &ctx,
                    &mut Rng::seed_from_u64(0),
                    &mut p,
                )
                .unwrap();
                p
            })
            .collect();
        let all: Vec<&[u8]> = payloads.iter().map(|p| p.as_bytes()).collect();
        let mut want = vec![0f32; n];
        decompress_mean(c.as_ref(), &all, inv, &mut want, &mut Touched::default()).unwrap();
        let dev = DevicePipeline::for_method(&cfg, &MemoryConfig::None).unwrap();
        let out = gpu.zeros(n);
        dev.decode_mean(&gpu, &all, inv, &out).unwrap();
        let got = gpu.download(&out).unwrap();
        let diff: f64 = got
            .iter()
            .zip(&want)
            .map(|(g, w)| ((g - w) as f64).powi(2))
            .sum();
        let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
        let rel = (diff / norm).sqrt();
        assert!(rel <= 1e-5, "{spec}: {rel:e}");
        worst = worst.max(rel);
        // The second payload cut short: the host's verdict, naming it.
        let cut = &all[1][..all[1].len() - 3];
        let bad = [all[0], cut, all[2]];
        let host_err =
            decompress_mean(c.as_ref(), &bad, inv, &mut want, &mut Touched::default()).unwrap_err();
        let (i, e) = dev.decode_mean(&gpu, &bad, inv, &out).unwrap_err();
        assert_eq!(
            (i, e.to_string()),
            (host_err.0, host_err.1.to_string()),
            "{spec}"
        );
    }
    println!("largest relative difference of the mean: {worst:.2e}");
}

/// 1-bit Adam's moments on the device (`DeviceAdamMoments`) against the host's rules as the
/// framework's `sync::moments` writes them, over warm-up and compressed steps: the moments
/// and the direction bit for bit, a coordinate of zero variance masked, and a buffer of
/// another length refused.
#[test]
fn adam_moments_on_the_device_are_the_hosts() {
    use dtrain_device::adam::DeviceAdamMoments;
    let gpu = common::open_test_device();
    let n = 1000;
    let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let mut dev = DeviceAdamMoments::upload(&gpu, &m, &v, b1, b2, eps).unwrap();
    for step in 0..6u64 {
        let mut g = gradient(n, 17 * step + 3);
        // Coordinate 5 never moves: its variance stays 0, and it is masked.
        g[5] = 0.0;
        let dg = gpu.upload(&g);
        if step < 3 {
            for ((m, v), &g) in m.iter_mut().zip(&mut v).zip(&g) {
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
            }
            dev.absorb(&gpu, &dg).unwrap();
        } else {
            for (g, &m) in g.iter_mut().zip(&m) {
                *g = b1 * m + (1.0 - b1) * *g;
            }
            dev.local_momentum(&gpu, &dg).unwrap();
            assert_eq!(
                bits(&gpu.download(&dg).unwrap()),
                bits(&g),
                "step {step}: momentum"
            );
            // What an exchange hands back: here the momentum itself, with the code's error
            // where the variance is zero.
            g[5] = 0.25;
            let dx = gpu.upload(&g);
            for (x, &v) in g.iter_mut().zip(&v) {
                if v == 0.0 {
                    *x = 0.0;
                }
            }
            m.copy_from_slice(&g);
            dev.take_masked(&gpu, &dx).unwrap();
            assert_eq!(
                bits(&gpu.download(&dx).unwrap()),
                bits(&g),
                "step {step}: masked"
            );
        }
        let (dm, dv) = dev.download(&gpu).unwrap();
        assert_eq!(bits(&dm), bits(&m), "step {step}: m");
        assert_eq!(bits(&dv), bits(&v), "step {step}: v");
        assert_eq!(dm[5], 0.0);
        let want: Vec<f32> = m
            .iter()
            .zip(&v)
            .map(|(&m, &v)| m / (v.sqrt() + eps))
            .collect();
        let out = gpu.zeros(n);
        dev.direction(&gpu, &out).unwrap();
        assert_eq!(
            bits(&gpu.download(&out).unwrap()),
            bits(&want),
            "step {step}: direction"
        );
    }
    let e = dev.absorb(&gpu, &gpu.zeros(n - 1)).unwrap_err().to_string();
    assert!(e.contains("999") && e.contains("1000"), "{e}");
}
