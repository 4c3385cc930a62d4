//! The CPU's TF32 emulation (`dtrain_models::precision`): with it on, dtrain's products give
//! exactly the f32 product of the converted operands. A test binary of its own, because the
//! switch is process-wide and would change the products of tests running beside it.

use burn::backend::flex::FlexTensor;
use burn::backend::Flex;
use burn::tensor::TensorData;
use dtrain_models::gemm_conv::{ConvGeometry, GemmConvOps};
use dtrain_models::matmul::MatmulOps;
use dtrain_models::precision::{round_tf32, set_tf32_emulation, truncate_tf32, Tf32};

/// Deterministic values in about [−2, 2] with full mantissas (so that converting changes them).
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let h = (i ^ seed.wrapping_mul(0x9e37_79b9)).wrapping_mul(0x85eb_ca6b) ^ (i >> 3);
            (h % 40_001) as f32 / 10_000.0 - 2.0 + 1.0 / 3.0
        })
        .collect()
}

fn tensor(values: Vec<f32>, shape: &[usize]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape.to_vec()))
}

fn data(t: &FlexTensor) -> Vec<f32> {
    t.to_contiguous().storage::<f32>().to_vec()
}

/// `f` with the emulation set to `mode`, off again afterwards.
fn with<T>(mode: Tf32, f: impl FnOnce() -> T) -> T {
    set_tf32_emulation(mode);
    let out = f();
    set_tf32_emulation(Tf32::Off);
    out
}

#[test]
fn emulated_products_are_f32_products_of_the_converted_operands() {
    let geometry = ConvGeometry {
        stride: [1, 1],
        padding: [1, 1],
    };
    let (a, b) = (values(37 * 53, 1), values(53 * 29, 2));
    let (x, w, dy) = (
        values(2 * 3 * 6 * 6, 3),
        values(4 * 3 * 3 * 3, 4),
        values(2 * 4 * 6 * 6, 5),
    );
    // Every product: the two-matrix one, the convolution and its two gradients.
    let products = |a: &[f32], b: &[f32], x: &[f32], w: &[f32], dy: &[f32]| {
        let t = |v: &[f32], s: &[usize]| tensor(v.to_vec(), s);
        [
            data(&<Flex as MatmulOps>::mm(t(a, &[37, 53]), t(b, &[53, 29]))),
            data(&<Flex as GemmConvOps>::gemm_conv2d(
                t(x, &[2, 3, 6, 6]),
                t(w, &[4, 3, 3, 3]),
                geometry,
            )),
            data(&<Flex as GemmConvOps>::gemm_conv2d_x_backward(
                t(x, &[2, 3, 6, 6]),
                t(w, &[4, 3, 3, 3]),
                t(dy, &[2, 4, 6, 6]),
                geometry,
            )),
            data(&<Flex as GemmConvOps>::gemm_conv2d_weight_backward(
                t(x, &[2, 3, 6, 6]),
                t(w, &[4, 3, 3, 3]),
                t(dy, &[2, 4, 6, 6]),
                geometry,
            )),
        ]
    };
    let plain = products(&a, &b, &x, &w, &dy);
    for (mode, convert) in [
        (Tf32::Nearest, round_tf32 as fn(f32) -> f32),
        (Tf32::Truncated, truncate_tf32),
    ] {
        let c = |v: &[f32]| v.iter().map(|&e| convert(e)).collect::<Vec<_>>();
        let expected = products(&c(&a), &c(&b), &c(&x), &c(&w), &c(&dy));
        let emulated = with(mode, || products(&a, &b, &x, &w, &dy));
        for (i, ((e, want), p)) in emulated.iter().zip(&expected).zip(&plain).enumerate() {
            assert_eq!(e.len(), want.len());
            let first = e
                .iter()
                .zip(want)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(
                first, None,
                "{mode:?}, product {i}: first differing element"
            );
            // And TF32 is not f32: the results move, by about TF32's rounding.
            let (mut d, mut n) = (0f64, 0f64);
            for (&e, &p) in e.iter().zip(p) {
                d += ((e - p) as f64).powi(2);
                n += (p as f64).powi(2);
            }
            let rel = (d / n).sqrt();
            assert!(rel > 1e-5 && rel < 1e-2, "{mode:?}, product {i}: {rel}");
        }
    }
    // Off again: the plain products, bit for bit.
    assert_eq!(products(&a, &b, &x, &w, &dy), plain);
}
