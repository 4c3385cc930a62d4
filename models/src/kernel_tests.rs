//! Helpers of the unit tests that hold the zoo's own kernels (`gemm_conv`, `batch_norm`,
//! `matmul`) against burn's operations (test builds only).

use burn::prelude::*;
use burn::tensor::TensorData;

/// `(y, dx, dW, db)` of `L = Σ y ⊙ g`, `g` = [`values`] of seed 2, for a layer's output `y`
/// from the tracked input `x`, with weight `w` and bias `b` (the layer's parameter values).
pub(crate) fn output_and_grads<const D: usize, const W: usize>(
    y: Tensor<D>,
    x: &Tensor<D>,
    w: Tensor<W>,
    b: Tensor<1>,
) -> [Vec<f32>; 4] {
    let g = Tensor::<D>::from_data(
        TensorData::new(values(y.dims().iter().product(), 2), y.dims()),
        &y.device(),
    );
    let grads = (y.clone() * g).sum().backward();
    [
        host(y.without_autodiff()),
        host(x.grad(&grads).expect("dx")),
        host(w.grad(&grads).expect("dW")),
        host(b.grad(&grads).expect("db")),
    ]
}

/// Deterministic values in [-1, 1) (xorshift; the tests need no rand).
pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A tensor's values on the host.
pub(crate) fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().expect("f32 data")
}

/// Every `got[i]` within `tol × max(1, max |want|)` of `want[i]`.
pub(crate) fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}[{i}]: {g} vs {w} (scale {scale})"
        );
    }
}
