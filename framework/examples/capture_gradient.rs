//! Captures real layer gradients for `dtrain bench compress --from FILE`.
//!
//! Trains AlexNet-CIFAR on the cifar-like MNIST set (MNIST padded to 3×32×32; this is not
//! CIFAR-10) for a few SGD steps, then writes the flat gradient of the next batch: the whole
//! model to `OUT/model.f32` and every parameter with at least 10 000 elements to
//! `OUT/<name>.f32` (raw little-endian f32).
//!
//! ```text
//! cargo run --release -p dtrain-framework --example capture_gradient -- data/mnist runs/grads 20
//! ```

use std::path::PathBuf;

use dtrain_datasets::cifar_like::load_cifar_like;
use dtrain_datasets::Split;
use dtrain_models::{cpu_device, Batch, ModelSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let data = PathBuf::from(args.next().unwrap_or_else(|| "data/mnist".into()));
    let out = PathBuf::from(args.next().unwrap_or_else(|| "runs/grads".into()));
    let warm_steps: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(20);
    let batch = 32;

    let set = load_cifar_like(&data, Split::Train)?;
    let spec: ModelSpec = toml::from_str("kind = \"alexnet\"\nvariant = \"cifar\"")?;
    let device = cpu_device();
    let mut model = spec.build(&device)?;
    let n = model.table().num_params();
    let mut params = vec![0f32; n];
    let mut grads = vec![0f32; n];
    model.read_params(&mut params);

    let make_batch = |step: usize| {
        let mut images = Vec::with_capacity(batch * 3 * 32 * 32);
        let mut labels = Vec::with_capacity(batch);
        for j in 0..batch {
            let s = set.sample((step * batch + j * 7919) % set.len());
            images.extend_from_slice(&s.data);
            labels.push(s.label as i64);
        }
        Batch::images_from_slice(&images, [batch, 3, 32, 32], &labels, &device)
    };
    for step in 0..=warm_steps {
        let m = model.forward_backward(make_batch(step), &mut grads)?;
        if step == warm_steps {
            break;
        }
        for (p, g) in params.iter_mut().zip(&grads) {
            *p -= 0.01 * g;
        }
        model.write_params(&params);
        if step % 5 == 0 {
            eprintln!("step {step}: loss {:.4}", m.loss);
        }
    }
    std::fs::create_dir_all(&out)?;
    let write = |name: &str, v: &[f32]| -> std::io::Result<()> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        std::fs::write(out.join(format!("{name}.f32")), bytes)
    };
    write("model", &grads)?;
    for e in model.table().params() {
        if e.numel >= 10_000 {
            write(&e.name, &grads[e.offset..e.offset + e.numel])?;
            println!(
                "{}: {} elements -> {}/{}.f32",
                e.name,
                e.numel,
                out.display(),
                e.name
            );
        }
    }
    println!("model: {n} elements -> {}/model.f32", out.display());
    Ok(())
}
