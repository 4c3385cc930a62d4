//! A GPU worker's gradient handed to the device codecs with no copy through the host (issue
//! #51, ARCHITECTURE.md §10): a model trained on burn's wgpu backend (Mesa's lavapipe in
//! CI; `DTRAIN_TEST_WGPU` names another adapter) gives its gradient as one flat tensor on
//! the device; its buffer goes to the codecs' kernels on burn's own client; a bucket's range
//! is copied on the device; every payload is the host codec's, byte for byte, for the same
//! values. Runs only with `--features wgpu-train`.
#![cfg(feature = "wgpu-train")]

use dtrain_compress::{compress_new, CompressorConfig, Ctx, Payload, Rng};
use dtrain_device::{device_codec, DeviceSpec, Gpu};
use dtrain_framework::device::{worker_device, DeviceKind};
use dtrain_models::cube::cube_buffer;
use dtrain_models::synthetic::SyntheticBatch;
use dtrain_models::wgpu::Adapter;
use dtrain_models::{Model, ModelSpec};

fn adapter() -> Adapter {
    std::env::var("DTRAIN_TEST_WGPU")
        .unwrap_or_else(|_| "wgpu:cpu".into())
        .parse()
        .expect("DTRAIN_TEST_WGPU")
}

fn lenet() -> Box<dyn Model> {
    let device = worker_device(DeviceKind::Wgpu(adapter()), 0)
        .unwrap_or_else(|e| panic!("these tests need a wgpu adapter: {e}"));
    let spec: ModelSpec = serde_json::from_str(r#"{"kind": "lenet"}"#).unwrap();
    spec.build(&device).unwrap()
}

#[test]
fn a_gradient_reaches_the_device_codecs_without_the_host() {
    let mut model = lenet();
    let device = model.device().clone();
    let n = model.table().num_params();
    let batch = SyntheticBatch::new(model.input(), 8, 0, 7);

    // The host path's gradient, for the layout.
    let out = model.forward_loss(batch.on(&device)).unwrap();
    let mut through_host = vec![0.0; n];
    model.backward_into(out.loss, &mut through_host);

    // The same step's gradient left on the device.
    let out = model.forward_loss(batch.on(&device)).unwrap();
    let flat = model.backward_flat(out.loss);
    assert_eq!(flat.dims(), [n]);
    let host: Vec<f32> = flat.clone().into_data().try_to_vec::<f32>().unwrap();
    // The same layout: each parameter's gradient where the host path puts it (two passes
    // of a GPU backend need not sum in the same order: within rounding).
    let scale = through_host.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(scale > 0.0);
    for (i, (a, b)) in host.iter().zip(&through_host).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * scale,
            "element {i}: {a} against {b}"
        );
    }

    let cube = cube_buffer(flat).unwrap();
    let spec: DeviceSpec = adapter().to_string().parse().unwrap();
    let gpu = Gpu::with_client(cube.client.clone(), spec);
    let grad = gpu.adopt(cube.handle.clone(), cube.len).unwrap();
    // No copy: the codecs read burn's buffer itself.
    assert_eq!(gpu.download(&grad).unwrap(), host);

    for method in ["topk", "dgc", "signsgd", "fp16", "bf16"] {
        let cfg = CompressorConfig::default_for(method).unwrap();
        for (lo, hi) in [(0, n), (1000, 25_000), (n - 10, n)] {
            let part = gpu.copy_range(&grad, lo, hi - lo);
            assert_eq!(
                gpu.download(&part).unwrap(),
                host[lo..hi],
                "{method} {lo}..{hi}"
            );
            let ctx = Ctx::default();
            let mut on_device = Payload::new();
            device_codec(&cfg)
                .unwrap()
                .encode(
                    &gpu,
                    &part,
                    &ctx,
                    &mut Rng::seed_from_u64(0),
                    &mut on_device,
                )
                .unwrap();
            let mut codec = cfg.build().unwrap();
            let on_host = compress_new(
                codec.as_mut(),
                &host[lo..hi],
                &ctx,
                &mut Rng::seed_from_u64(0),
            )
            .unwrap();
            assert_eq!(
                on_device.as_bytes(),
                on_host.as_bytes(),
                "{method} {lo}..{hi}: the device payload is not the host codec's"
            );
        }
    }
}

#[test]
fn a_buffer_of_another_device_is_refused() {
    let mut model = lenet();
    let device = model.device().clone();
    let batch = SyntheticBatch::new(model.input(), 2, 0, 1);
    let out = model.forward_loss(batch.on(&device)).unwrap();
    let cube = cube_buffer(model.backward_flat(out.loss)).unwrap();
    let spec: DeviceSpec = adapter().to_string().parse().unwrap();
    let gpu = Gpu::with_client(cube.client.clone(), spec);
    // More elements than the buffer holds.
    let e = gpu
        .adopt(cube.handle.clone(), cube.len + 1_000_000)
        .unwrap_err();
    assert!(e.to_string().contains("fewer than"), "{e}");
    // A tensor on the CPU backend has no device buffer.
    let cpu = burn::tensor::Tensor::<1>::zeros([4], &dtrain_models::cpu_device());
    let e = cube_buffer(cpu)
        .err()
        .expect("a CPU tensor has no cubecl buffer");
    assert!(e.contains("not on a cubecl device"), "{e}");
}

mod common;

/// Every step's loss and the final parameters of the run on the device within rounding of
/// the CPU run's (the two backends sum in other orders).
fn assert_trains_alike(gpu: &common::Run, cpu: &common::Run, what: &str) {
    assert_eq!(gpu.losses.len(), cpu.losses.len(), "{what}");
    for (s, (a, b)) in gpu.losses.iter().zip(&cpu.losses).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{what}: step {s}: loss {a} on the device, {b} on the CPU"
        );
    }
    let scale = cpu.params.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (a, b)) in gpu.params.iter().zip(&cpu.params).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * scale,
            "{what}: parameter {i}: {a} on the device, {b} on the CPU"
        );
    }
}

/// A run on wgpu whose codecs are on the same device keeps its gradient there: the trainer
/// hands the flat gradient to the exchange (`Exchanger::exchange_device`), each device
/// bucket is encoded from its range, and only the host's buckets are read back. The run
/// says so, and trains as the same run on the CPU: every step's loss and the final
/// parameters within rounding (the two backends sum in other orders), with one
/// micro-batch a step and with two (summed on the device).
#[test]
fn a_run_on_wgpu_keeps_its_gradient_on_the_device_and_trains_as_on_the_cpu() {
    let device = format!("cluster.device=\"{}\"", adapter());
    let sparse = ["compress.ratio=0.1", "compress.collective=\"allgather\""];
    for (method, knobs) in [
        ("compress.kind=topk", &sparse[..]),
        ("compress.kind=dgc", &sparse[..]),
        // Its agreement on the device (P, Q_w, the summed payload's decode, the residual).
        ("compress.kind=powersgd", &["compress.rank=2"][..]),
    ] {
        for accumulate in ["train.accumulate=1", "train.accumulate=2"] {
            let mut sets = vec![method];
            sets.extend(knobs);
            sets.extend([accumulate, "train.max_steps=8"]);
            let what = format!("{method}, {accumulate}");
            let cpu = common::run(2, &sets, None, false);
            let mut on = sets.clone();
            on.extend([device.as_str(), "compress.device=\"auto\""]);
            let gpu = common::run(2, &on, None, false);
            assert!(
                gpu.messages
                    .iter()
                    .any(|m| m.contains("the gradient stays on the device")),
                "{what}: {:?}",
                gpu.messages
            );
            assert_trains_alike(&gpu, &cpu, &what);
        }
    }
}

/// A periodic synchronisation on wgpu: its local steps apply the gradient where it lies
/// (nothing crosses between the rounds), the rounds average the parameter change, and the
/// run trains as on the CPU — local SGD, DiLoCo with its outer Nesterov momentum, and
/// Streaming DiLoCo.
#[test]
fn local_steps_on_wgpu_keep_the_gradient_on_the_device_and_train_as_on_the_cpu() {
    let device = format!("cluster.device=\"{}\"", adapter());
    for sync in [
        &["sync.kind=\"local-sgd\"", "sync.period=3"][..],
        &[
            "sync.kind=\"diloco\"",
            "sync.period=3",
            "sync.outer_lr=0.7",
            "sync.outer_momentum=0.9",
        ][..],
        &[
            "sync.kind=\"streaming-diloco\"",
            "sync.period=3",
            "sync.fragments=2",
            "sync.overlap=1",
        ][..],
    ] {
        let mut sets = sync.to_vec();
        sets.push("train.max_steps=9");
        let what = sync[0];
        let cpu = common::run(2, &sets, None, false);
        let mut on = sets.clone();
        on.push(device.as_str());
        let gpu = common::run(2, &on, None, false);
        assert!(
            gpu.messages
                .iter()
                .any(|m| m.contains("the local steps keep the gradient on the device")),
            "{what}: {:?}",
            gpu.messages
        );
        assert_trains_alike(&gpu, &cpu, what);
    }
}

/// On wgpu the optimizer's moments live on the device (`optim_device`): a checkpoint
/// brings them back to the host, a resumed run takes them up again, and the run goes on
/// exactly as the straight one — SGD with momentum (its buffer) and Adam (both moments).
#[test]
fn a_run_on_wgpu_resumes_exactly_with_the_moments_kept_on_the_device() {
    let device = format!("cluster.device=\"{}\"", adapter());
    let on = [
        device.as_str(),
        "compress.kind=topk",
        "compress.ratio=0.1",
        "compress.device=\"auto\"",
    ];
    let adam = [
        "train.optimizer=\"adam\"",
        "train.momentum=0",
        "train.lr=0.003",
    ];
    for extra in [&[][..], &adam[..]] {
        let sets: Vec<&str> = on.iter().chain(extra).copied().collect();
        common::resume_is_exact(2, &sets);
    }
}

/// A device buffer (what the codecs decode into) becomes a burn tensor on the model's
/// device with no copy (`dtrain_models::cube::tensor_over`): its values, burn's operations
/// on it, the buffer left as it was; a length past the buffer is refused.
#[test]
fn a_device_buffer_becomes_a_burn_tensor_in_place() {
    let model = lenet();
    let device = model.device().clone();
    let client = dtrain_models::cube::client_of(&device).unwrap();
    let spec: DeviceSpec = adapter().to_string().parse().unwrap();
    let gpu = Gpu::with_client(client, spec);
    let values: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.37).sin()).collect();
    let buf = gpu.upload(&values);
    let t = dtrain_models::cube::tensor_over(&device, buf.handle().clone(), 4000).unwrap();
    assert_eq!(dtrain_models::flat::download(t.clone()), values[..4000]);
    let doubled = dtrain_models::flat::download(t.mul_scalar(2.0));
    let want: Vec<f32> = values[..4000].iter().map(|v| v * 2.0).collect();
    assert_eq!(doubled, want);
    assert_eq!(gpu.download(&buf).unwrap(), values);
    let e = dtrain_models::cube::tensor_over(&device, buf.handle().clone(), 6000).unwrap_err();
    assert!(e.contains("fewer than 6000"), "{e}");
}
