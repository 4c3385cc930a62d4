//! Cost of the flat paths against a training step.
//!
//! `cargo run --release -p dtrain-models --example flat_bench [steps]`
//!
//! For AlexNet-CIFAR (compact and FC-heavy) and ResNet-20 at batch 32, each step runs
//! forward + loss, backward, gradients → flat buffer, a flat SGD update and flat parameters →
//! module; it prints the median of each phase and the share of the step spent in the two flat
//! copies.

use std::time::Instant;

use burn::prelude::*;
use dtrain_models::flat::grads_into;
use dtrain_models::{AlexNetConfig, Batch, ImageClassifier, ImageModel, Model, ResNetConfig};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn bench<M: ImageClassifier>(
    name: &str,
    module: M,
    config_input: dtrain_models::InputSpec,
    device: &Device,
    steps: usize,
) {
    let mut model = ImageModel::new(name, module, config_input, device);
    let n = model.table().num_params();
    let mut grads = vec![0.0f32; n];
    let mut params = vec![0.0f32; n];
    model.read_params(&mut params);
    let batch = 32;
    let images: Vec<f32> = (0..batch * 3 * 32 * 32)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let labels: Vec<i64> = (0..batch as i64).map(|i| i % 10).collect();
    let (mut fwd, mut bwd, mut flat, mut opt, mut write, mut total) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for step in 0..steps + 2 {
        let b = Batch::images_from_slice(&images, [batch, 3, 32, 32], &labels, device);
        let t0 = Instant::now();
        let out = model.forward_loss(b).unwrap();
        let t1 = Instant::now();
        let mut g = out.loss.backward();
        drop(out.loss);
        let t2 = Instant::now();
        grads_into(model.module(), model.table(), &mut g, &mut grads);
        drop(g);
        let t3 = Instant::now();
        for (p, g) in params.iter_mut().zip(&grads) {
            *p -= 0.01 * g;
        }
        let t4 = Instant::now();
        model.write_params(&params);
        let t5 = Instant::now();
        if step >= 2 {
            let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
            fwd.push(ms(t0, t1));
            bwd.push(ms(t1, t2));
            flat.push(ms(t2, t3));
            opt.push(ms(t3, t4));
            write.push(ms(t4, t5));
            total.push(ms(t0, t5));
        }
    }
    let (f, b, g, o, w, t) = (
        median(fwd),
        median(bwd),
        median(flat.clone()),
        median(opt),
        median(write.clone()),
        median(total),
    );
    println!(
        "{name:<18} params={n:>9} step={t:>7.1} ms  fwd={f:>6.1}  bwd={b:>6.1}  grads->flat={g:>5.2}  sgd={o:>5.2}  flat->params={w:>5.2}  flat share={:.2}%",
        100.0 * (g + w) / t
    );
}

fn main() {
    let steps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let device = Device::flex().autodiff();
    device.seed(0);
    let c = AlexNetConfig::cifar();
    bench("alexnet-cifar", c.init(&device), c.input(), &device, steps);
    let c = AlexNetConfig::cifar_fc();
    bench(
        "alexnet-cifar-fc",
        c.init(&device),
        c.input(),
        &device,
        steps,
    );
    let c = ResNetConfig::resnet20();
    bench("resnet20", c.init(&device), c.input(), &device, steps);
}
