//! Error feedback on the device against the host pipeline: over several steps of a codec
//! with the residual memory, every payload equals the host's and the residual after each
//! step equals the host's bit for bit (issue #51: "the residual after a device step equal to
//! the CPU residual"). On `DTRAIN_TEST_DEVICE` (default `wgpu` where built, else `cuda`).
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use std::ops::Range;

use dtrain_compress::{CompressorConfig, Ctx, MemoryConfig, Payload, Pipeline, Rng};
use dtrain_device::{device_codec, DevicePipeline};

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

#[test]
fn residual_after_each_device_step_is_the_hosts() {
    let gpu = common::open_test_device();
    let n = 3000;
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
    ] {
        let cfg = CompressorConfig::default_for(name).unwrap();
        let mut host = Pipeline::new(cfg.build().unwrap(), memory.build().unwrap());
        let mut dev = DevicePipeline::new(device_codec(&cfg).unwrap(), &memory).unwrap();
        let (mut hp, mut dp) = (Payload::new(), Payload::new());
        for step in 0..4u64 {
            let g = gradient(n, 31 * step + 5);
            let ctx = Ctx {
                step,
                bucket: 7,
                segments: &segs,
                ..Ctx::default()
            };
            host.compress(&g, &ctx, &mut Rng::seed_from_u64(step), &mut hp)
                .unwrap();
            dev.compress(
                &gpu,
                7,
                &gpu.upload(&g),
                &segs,
                &mut Rng::seed_from_u64(step),
                &mut dp,
            )
            .unwrap();
            assert_eq!(dp.as_bytes(), hp.as_bytes(), "{name}, step {step}: payload");
            let want = host.export_memory().remove(&7).expect("a host residual");
            let got = dev
                .memory()
                .unwrap()
                .export(&gpu)
                .unwrap()
                .remove(&7)
                .unwrap();
            assert_eq!(bits(&got), bits(&want), "{name}, step {step}: residual");
        }
    }
}

#[test]
fn memories_without_a_device_form_are_refused_by_name() {
    let cfg = CompressorConfig::default_for("topk").unwrap();
    let memory: MemoryConfig = toml::from_str("kind = \"low-pass\"").unwrap();
    let e = DevicePipeline::new(device_codec(&cfg).unwrap(), &memory)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("LowPass"), "{e}");
}
