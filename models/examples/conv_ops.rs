//! Where a CNN step's time goes on burn's `Flex` CPU backend, by convolution pass: for each
//! distinct convolution of ResNet-20 (CIFAR, option-A shortcuts) and AlexNet-CIFAR at batch
//! 32, the forward pass, the input gradient (`conv2d_x_backward`: a transposed convolution)
//! and the weight gradient (`conv2d_weight_backward`: burn's default, a convolution of the
//! batch-swapped input with the batch-swapped output gradient), each timed alone on the
//! backend (no autodiff bookkeeping), median of `steps` after one warm-up, multiplied by how
//! often the layer occurs in the model (issue #26's per-operation profile).
//!
//! ```text
//! RAYON_NUM_THREADS=1 cargo run --release -p dtrain-models --example conv_ops -- [steps] [model] [kernels]
//! ```
//!
//! `model` is `resnet20` (default), `alexnet` or `all`; `kernels` is `burn` (Flex's own
//! passes), `gemm` (the zoo's, `dtrain_models::gemm_conv`) or `both` (default, one after the
//! other). Prints one row per layer shape and
//! the totals per pass; `FLOP/s` is 2·MACs / time of the pass, the figure to hold against the
//! machine's peak (one AVX2 core with two FMA units: 16 f32 FMAs, 32 FLOP, a cycle).

use std::time::Instant;

use burn::backend::ops::{ConvOptions, FloatTensorOps, ModuleOps};
use burn::backend::tensor::FloatTensor;
use burn::backend::Flex;
use burn::tensor::TensorData;
use dtrain_models::gemm_conv::{ConvGeometry, GemmConvOps};

/// One convolution of a model: input `[n, c_in, h, w]`, `c_out` filters `k × k`, stride,
/// padding, and how many times it occurs.
struct Layer {
    name: &'static str,
    c_in: usize,
    hw: usize,
    c_out: usize,
    k: usize,
    stride: usize,
    pad: usize,
    count: usize,
}

/// A [`Layer`] in one line: name, `c_in`, input size, `c_out`, kernel, stride, padding,
/// count.
#[allow(clippy::too_many_arguments)]
const fn layer(
    name: &'static str,
    c_in: usize,
    hw: usize,
    c_out: usize,
    k: usize,
    stride: usize,
    pad: usize,
    count: usize,
) -> Layer {
    Layer {
        name,
        c_in,
        hw,
        c_out,
        k,
        stride,
        pad,
        count,
    }
}

const RESNET20: &[Layer] = &[
    layer("stem 3→16 @32", 3, 32, 16, 3, 1, 1, 1),
    layer("16→16 @32", 16, 32, 16, 3, 1, 1, 6),
    layer("16→32 /2 @32", 16, 32, 32, 3, 2, 1, 1),
    layer("32→32 @16", 32, 16, 32, 3, 1, 1, 5),
    layer("32→64 /2 @16", 32, 16, 64, 3, 2, 1, 1),
    layer("64→64 @8", 64, 8, 64, 3, 1, 1, 5),
];

// AlexNet-CIFAR as models/src/alexnet.rs builds it (CIFAR_CONVS; 2×2 max pools after
// convolutions 1, 2 and 5: 32 → 8 → 4 → 2).
const ALEXNET: &[Layer] = &[
    layer("3→64 11x11 /4 @32", 3, 32, 64, 11, 4, 5, 1),
    layer("64→192 5x5 @4", 64, 4, 192, 5, 1, 2, 1),
    layer("192→384 @2", 192, 2, 384, 3, 1, 1, 1),
    layer("384→256 @2", 384, 2, 256, 3, 1, 1, 1),
    layer("256→256 @2", 256, 2, 256, 3, 1, 1, 1),
];

const BATCH: usize = 32;

fn tensor(shape: [usize; 4], seed: u64) -> FloatTensor<Flex> {
    let n: usize = shape.iter().product();
    let mut s = seed.max(1);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    Flex::float_from_data(TensorData::new(v, shape), &Default::default())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds of `f` over `steps` calls after one warm-up.
fn time(steps: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..steps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn profile(model: &str, layers: &[Layer], steps: usize, gemm: bool) {
    println!(
        "\n{model}, {} kernels, batch {BATCH}, RAYON_NUM_THREADS={}: ms per occurrence × count (GFLOP/s of the pass)",
        if gemm { "gemm_conv" } else { "burn's Flex" },
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into())
    );
    println!(
        "{:<18} {:>5} {:>22} {:>22} {:>22}",
        "layer", "count", "forward", "input grad", "weight grad"
    );
    let mut totals = [0.0f64; 3];
    for l in layers {
        let out = (l.hw + 2 * l.pad - l.k) / l.stride + 1;
        let opts = ConvOptions::new([l.stride; 2], [l.pad; 2], [1, 1], 1);
        let geo = ConvGeometry {
            stride: [l.stride; 2],
            padding: [l.pad; 2],
        };
        let x = tensor([BATCH, l.c_in, l.hw, l.hw], 1);
        let w = tensor([l.c_out, l.c_in, l.k, l.k], 2);
        let g = tensor([BATCH, l.c_out, out, out], 3);
        let macs = (BATCH * l.c_out * out * out * l.c_in * l.k * l.k) as f64;
        let passes = [
            time(steps, || {
                let _ = if gemm {
                    Flex::gemm_conv2d(x.clone(), w.clone(), geo)
                } else {
                    Flex::conv2d(x.clone(), w.clone(), None, opts.clone())
                };
            }),
            time(steps, || {
                let (x, w, g) = (x.clone(), w.clone(), g.clone());
                let _ = if gemm {
                    Flex::gemm_conv2d_x_backward(x, w, g, geo)
                } else {
                    Flex::conv2d_x_backward(x, w, g, opts.clone())
                };
            }),
            time(steps, || {
                let (x, w, g) = (x.clone(), w.clone(), g.clone());
                let _ = if gemm {
                    Flex::gemm_conv2d_weight_backward(x, w, g, geo)
                } else {
                    Flex::conv2d_weight_backward(x, w, g, opts.clone())
                };
            }),
        ];
        let cells: Vec<String> = passes
            .iter()
            .map(|s| format!("{:8.2} ({:5.1} GF/s)", s * 1e3, 2.0 * macs / s / 1e9))
            .collect();
        println!(
            "{:<18} {:>5} {:>22} {:>22} {:>22}",
            l.name, l.count, cells[0], cells[1], cells[2]
        );
        for (t, s) in totals.iter_mut().zip(passes) {
            *t += s * l.count as f64;
        }
    }
    println!(
        "{:<18} {:>5} {:>13.1} ms {:>19.1} ms {:>19.1} ms",
        "total × count",
        "",
        totals[0] * 1e3,
        totals[1] * 1e3,
        totals[2] * 1e3
    );
}

fn main() {
    let mut args = std::env::args().skip(1);
    let steps: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(10);
    let model = args.next().unwrap_or_else(|| "resnet20".into());
    let kernels = args.next().unwrap_or_else(|| "both".into());
    for gemm in [false, true] {
        if kernels != "both" && (kernels == "gemm") != gemm {
            continue;
        }
        if model == "resnet20" || model == "all" {
            profile("ResNet-20", RESNET20, steps, gemm);
        }
        if model == "alexnet" || model == "all" {
            profile("AlexNet-CIFAR", ALEXNET, steps, gemm);
        }
    }
}
