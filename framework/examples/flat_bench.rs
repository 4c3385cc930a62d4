//! Cost of moving gradients and parameters between burn and flat buffers, against a training
//! step, with the system allocator and with [`ReuseAlloc`] side by side in one process.
//!
//! `cargo run --release -p dtrain-framework --example flat_bench [steps]`
//!
//! For AlexNet-CIFAR (compact and FC-heavy) and ResNet-20 at batch 32, each step runs
//! forward + loss, backward, gradients → flat buffer (`grads_into`) and the optimizer. The
//! optimizer runs two ways: the trainer's in-place update (`update_params`, SGD with momentum
//! straight into each parameter tensor) and, for comparison, the former path (SGD on a flat
//! copy of the parameters, then `write_params` back into the module), on alternate steps.
//! Medians are printed. "Flat share, in place" is grads → flat over the step with the in-place
//! update (the trainer's path: the update costs nothing beyond the optimizer's own
//! arithmetic); "flat share, flat copy" adds `write_params` and is over that path's step.

use std::time::Instant;

use dtrain_framework::alloc::ReuseAlloc;
use dtrain_framework::optim::OptimizerConfig;
use dtrain_models::flat::grads_into;
use dtrain_models::{
    AlexNetConfig, Batch, Device, ImageClassifier, ImageModel, InputSpec, Model, ResNetConfig,
};

#[global_allocator]
static ALLOC: ReuseAlloc = ReuseAlloc::new();

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn bench<M: ImageClassifier>(
    name: &str,
    module: M,
    input: InputSpec,
    device: &Device,
    steps: usize,
) {
    let mut model = ImageModel::new(name, module, input, device);
    let n = model.table().num_params();
    let mut grads = vec![0.0f32; n];
    let mut params = vec![0.0f32; n];
    model.read_params(&mut params);
    let cfg = OptimizerConfig {
        momentum: 0.9,
        ..Default::default()
    };
    let mut opt = cfg.build().unwrap();
    let batch = 32;
    let images: Vec<f32> = (0..batch * 3 * 32 * 32)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let labels: Vec<i64> = (0..batch as i64).map(|i| i % 10).collect();
    let mut t: [Vec<f64>; 6] = Default::default();
    let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
    for step in 0..steps + 2 {
        let b = Batch::images_from_slice(&images, [batch, 3, 32, 32], &labels, device);
        let t0 = Instant::now();
        let out = model.forward_loss(b).unwrap();
        let t1 = Instant::now();
        let mut g = out.loss.backward();
        let t2 = Instant::now();
        grads_into(model.module(), model.table(), &mut g, &mut grads);
        drop(g);
        let t3 = Instant::now();
        // Odd steps: the trainer's in-place update; even steps: flat SGD + write back.
        let in_place = step % 2 == 1;
        if in_place {
            opt.begin(0, n);
            model.update_params(&mut |off, p| {
                opt.apply(0, off, p, &grads[off..off + p.len()], 0.01)
            });
        } else {
            // (The flat copy drifts from the module's values; only the timing matters here.)
            opt.step(0, &mut params, &grads, 0.01);
        }
        let t4 = Instant::now();
        if !in_place {
            model.write_params(&params);
        }
        let t5 = Instant::now();
        if step >= 2 {
            t[0].push(ms(t0, t1));
            t[1].push(ms(t1, t2));
            t[2].push(ms(t2, t3));
            if in_place {
                t[3].push(ms(t3, t4));
            } else {
                t[4].push(ms(t3, t4));
                t[5].push(ms(t4, t5));
            }
        }
    }
    let [f, b, g, inplace, flat_sgd, write] = t.map(median);
    let step = f + b + g + inplace;
    println!(
        "| {name} | {n} | {step:.1} | {f:.1} | {b:.1} | {g:.2} | {inplace:.2} | {flat_sgd:.2} | {write:.2} | {:.2}% | {:.2}% |",
        100.0 * g / step,
        100.0 * (g + write) / (f + b + g + flat_sgd + write),
    );
}

fn main() {
    let steps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let device = Device::flex().autodiff();
    println!("| allocator / model | params | step ms (in place) | fwd | bwd | grads→flat | SGD in place | SGD on flat copy | write_params | flat share, in place | flat share, flat copy |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (label, limit) in [("system", 0), ("reuse", ReuseAlloc::DEFAULT_LIMIT)] {
        ALLOC.set_limit(limit);
        device.seed(0);
        let c = AlexNetConfig::cifar();
        bench(
            &format!("{label} / alexnet-cifar"),
            c.init(&device),
            c.input(),
            &device,
            steps,
        );
        let c = AlexNetConfig::cifar_fc();
        bench(
            &format!("{label} / alexnet-cifar-fc"),
            c.init(&device),
            c.input(),
            &device,
            steps,
        );
        let c = ResNetConfig::resnet20();
        bench(
            &format!("{label} / resnet20"),
            c.init(&device),
            c.input(),
            &device,
            steps,
        );
    }
    let (hits, misses) = ALLOC.hits_misses();
    println!("\nreuse allocator: {hits} large allocations served from parked blocks, {misses} from the system");
}
