//! meProp backward time against ordinary backprop, side by side in one process.
//!
//! ```text
//! cargo run --release -p dtrain-models --example meprop_bench -- [steps] [batch]
//! ```
//!
//! For the MNIST MLP of the meProp paper (784-500-500-10) it times forward + backward of one
//! minibatch with burn's `Linear` backward and with meProp at k = 80, 40, 20, 10, alternating
//! the variants step by step so that machine load affects them alike, and prints the median
//! backward time (backward alone, gradients materialised) and its ratio to dense.

use std::time::Instant;

use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use dtrain_models::meprop::meprop_forward;

fn forward(layers: &[Linear], x: Tensor<2>, k: Option<usize>) -> Tensor<2> {
    let last = layers.len() - 1;
    let mut x = x;
    for (i, l) in layers.iter().enumerate() {
        x = match k {
            Some(k) => meprop_forward(l, x, k),
            None => l.forward(x),
        };
        if i < last {
            x = burn::tensor::activation::relu(x);
        }
    }
    x
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("finite times"));
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let steps: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(200);
    let batch: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(64);
    let device = Device::flex().autodiff();
    let widths = [784, 500, 500, 10];
    let layers: Vec<Linear> = widths
        .windows(2)
        .map(|w| LinearConfig::new(w[0], w[1]).init(&device))
        .collect();
    let variants: [Option<usize>; 5] = [None, Some(80), Some(40), Some(20), Some(10)];
    let mut times = vec![Vec::with_capacity(steps); variants.len()];
    for step in 0..steps + 10 {
        let x = Tensor::<2>::random([batch, 784], Distribution::Uniform(0.0, 1.0), &device);
        for (v, &k) in variants.iter().enumerate() {
            let y = forward(&layers, x.clone(), k);
            let loss = (y.clone() * y).sum();
            let start = Instant::now();
            let grads = loss.backward();
            // Materialise every weight gradient so lazy backends cannot defer the work.
            for l in &layers {
                let g = l.weight.val().grad(&grads).expect("weight gradient");
                let _ = g.into_data();
            }
            if step >= 10 {
                times[v].push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    println!("MLP 784-500-500-10, batch {batch}, {steps} steps per variant (median backward ms)");
    println!("| variant | backward ms | vs dense |");
    println!("|---|---|---|");
    let dense = median(&mut times[0].clone());
    for (v, &k) in variants.iter().enumerate() {
        let m = median(&mut times[v]);
        let name = k.map_or("dense".to_string(), |k| format!("meProp k = {k}"));
        println!("| {name} | {m:.3} | {:.2}× |", dense / m);
    }
}
