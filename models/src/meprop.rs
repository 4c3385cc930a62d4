//! meProp — sparsified back-propagation for linear layers (ALGORITHMS.md §11, Sun et al.,
//! ICML 2017), as a burn backend extension with a hand-written backward pass.
//!
//! [`meprop_linear`] computes `y = x·W + b` exactly as [`burn::nn::Linear`] does. Its backward
//! pass is **unified meProp**: from the output gradient `dy` (`[n, out]`, `n` = examples ×
//! time steps) it picks one set of `k` output columns per minibatch — the `k` largest column
//! sums `Σ_examples |dy|` — and only those columns take part in the weight and input
//! gradients:
//!
//! * `dx = dy[:, K] · W[:, K]ᵀ` (a `[n, k] × [k, in]` product instead of `[n, out] × [out, in]`);
//! * `dW[:, K] = xᵀ · dy[:, K]`, every other column of `dW` is exactly zero;
//! * the bias gradient stays dense (it is the ordinary autodiff of `+ b`).
//!
//! With `k ≥ out` the backward pass is the dense one (the same two products autodiff uses for
//! a matmul). The forward pass never changes.
//!
//! # Backends
//! The operation is the trait [`MepropOps`], implemented for burn's `Flex` CPU backend, for the
//! `Cube` backend when the `cuda` or `wgpu` feature is on (both with the plain matmul as forward), and for
//! `Autodiff<B>` over any of them, where the sparsified backward lives. Selecting the `k`
//! columns sorts the `out` column scores with the backend's `float_argsort` (a host read-back
//! of `out` values on CPU backends).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{backend_extension, Backend, Dispatch, Flex, TensorMetadata};
use burn::prelude::*;
use burn::tensor::{IndexingUpdateOp, IntDType, Slice};

/// The meProp matrix product as a backend operation (see the [module docs](self)).
#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait MepropOps: Backend {
    /// `x · w` for `x: [n, in]`, `w: [in, out]`; on autodiff backends the backward pass keeps
    /// only the `k` output columns with the largest `Σ_n |dy|`.
    fn meprop_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>, k: usize) -> FloatTensor<Self> {
        let _ = k;
        Self::float_matmul(x, w)
    }
}

impl MepropOps for Flex {}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl MepropOps for burn::backend::Cube {}

/// The `k` columns of `dy: [n, out]` with the largest L1 mass, as an int tensor of shape `[k]`
/// (in descending score order).
fn top_columns<B: Backend>(dy: FloatTensor<B>, k: usize) -> IntTensor<B> {
    let out = dy.shape().dims::<2>()[1];
    let score = B::float_sum_dim(B::float_abs(dy), 0);
    let score = B::float_reshape(score, Shape::new([out]));
    let order = B::float_argsort(score, 0, true, IntDType::I64);
    B::int_slice(order, &[Slice::from(0..k)])
}

/// The meProp backward pass on plain tensors: `(dx, dw)` for the output gradient `dy`, the
/// forward inputs `x: [n, in]`, `w: [in, out]`, and `k`.
fn meprop_backward<B: Backend>(
    dy: FloatTensor<B>,
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    k: usize,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let w_shape = w.shape();
    let out = w_shape.dims::<2>()[1];
    if k >= out {
        let dx = B::float_matmul(dy.clone(), B::float_transpose(w));
        let dw = B::float_matmul(B::float_transpose(x), dy);
        return (dx, dw);
    }
    let cols = top_columns::<B>(dy.clone(), k);
    let dy_k = B::float_select(dy, 1, cols.clone());
    let w_k = B::float_select(w.clone(), 1, cols.clone());
    let dx = B::float_matmul(dy_k.clone(), B::float_transpose(w_k));
    let dw_k = B::float_matmul(B::float_transpose(x), dy_k);
    let device = w.device();
    let zeros = B::float_zeros(w_shape, &device, w.dtype().into());
    let dw = B::float_select_assign(zeros, 1, cols, dw_k, IndexingUpdateOp::Add);
    (dx, dw)
}

impl<B: Backend + MepropOps, C: CheckpointStrategy> MepropOps for Autodiff<B, C> {
    fn meprop_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>, k: usize) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct MepropMatmul;

        impl<B: Backend> Backward<B, 2> for MepropMatmul {
            type State = (FloatTensor<B>, FloatTensor<B>, usize);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let [node_x, node_w] = ops.parents;
                let dy = grads.consume::<B>(&ops.node);
                let (x, w, k) = ops.state;
                let (dx, dw) = meprop_backward::<B>(dy, x, w, k);
                if let Some(node) = node_x {
                    grads.register::<B>(node.id, dx);
                }
                if let Some(node) = node_w {
                    grads.register::<B>(node.id, dw);
                }
            }
        }

        match MepropMatmul
            .prepare::<C>([x.node(), w.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let xp = x.primitive().clone();
                let wp = w.primitive().clone();
                let y = B::meprop_matmul(xp.clone(), wp.clone(), k);
                prep.finish((xp, wp, k), y)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::meprop_matmul(x.into_primitive(), w.into_primitive(), k))
            }
        }
    }
}

/// `x · weight + bias` with a meProp backward pass keeping `k` output columns (see the
/// [module docs](self)). `x` is `[n, in]`, `weight` `[in, out]` (burn's `Linear` layout),
/// `bias` `[out]`.
pub fn meprop_linear(
    x: Tensor<2>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    k: usize,
) -> Tensor<2> {
    let y = Tensor::<2>::from_dispatch(<Dispatch as MepropOps>::meprop_matmul(
        x.into_dispatch(),
        weight.into_dispatch(),
        k,
    ));
    match bias {
        Some(b) => y + b.unsqueeze_dim(0),
        None => y,
    }
}

/// [`meprop_linear`] applied to a [`burn::nn::Linear`]'s parameters, for inputs of any rank ≥ 2
/// (leading dimensions are flattened into examples, as unified meProp selects over all of them).
pub fn meprop_forward<const D: usize>(
    layer: &burn::nn::Linear,
    x: Tensor<D>,
    k: usize,
) -> Tensor<D> {
    let dims = x.dims();
    let d_in = dims[D - 1];
    let n: usize = dims[..D - 1].iter().product();
    let y = meprop_linear(
        x.reshape([n, d_in]),
        layer.weight.val(),
        layer.bias.as_ref().map(|b| b.val()),
        k,
    );
    let d_out = y.dims()[1];
    let mut out = dims;
    out[D - 1] = d_out;
    y.reshape(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use burn::nn::Linear;
    use burn::tensor::TensorData;

    /// Deterministic pseudo-random values in [-1, 1) (a tiny LCG: the test needs no rand).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn tensor(v: Vec<f32>, shape: [usize; 2], device: &Device) -> Tensor<2> {
        Tensor::from_data(TensorData::new(v, shape), device)
    }

    fn host(t: Tensor<2>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().expect("f32 data")
    }

    /// `a [r × m] · b [m × c]` on the host, f64 accumulation.
    fn matmul(a: &[f32], b: &[f32], r: usize, m: usize, c: usize) -> Vec<f32> {
        let mut out = vec![0f32; r * c];
        for i in 0..r {
            for j in 0..c {
                let s: f64 = (0..m)
                    .map(|t| a[i * m + t] as f64 * b[t * c + j] as f64)
                    .sum();
                out[i * c + j] = s as f32;
            }
        }
        out
    }

    fn transpose(a: &[f32], r: usize, c: usize) -> Vec<f32> {
        let mut out = vec![0f32; r * c];
        for i in 0..r {
            for j in 0..c {
                out[j * r + i] = a[i * c + j];
            }
        }
        out
    }

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    }

    /// A `Linear` with deterministic weights (every run of a test sees the same layer).
    fn linear(d_in: usize, d_out: usize, device: &Device) -> Linear {
        let w = tensor(values(d_in * d_out, 7), [d_in, d_out], device);
        let b = Tensor::<1>::from_data(TensorData::new(values(d_out, 8), [d_out]), device);
        Linear {
            weight: Param::from_tensor(w),
            bias: Some(Param::from_tensor(b)),
        }
    }

    struct Grads {
        y: Vec<f32>,
        dx: Vec<f32>,
        dw: Vec<f32>,
        db: Vec<f32>,
    }

    /// Runs `y = layer(x)` (meProp with `k`, or burn's own `Linear` when `k` is `None`) and
    /// back-propagates `L = Σ y ⊙ g`, so that `∂L/∂y = g` exactly.
    fn run(
        n: usize,
        d_in: usize,
        d_out: usize,
        k: Option<usize>,
    ) -> (Grads, Vec<f32>, Vec<f32>, Vec<f32>) {
        let device = Device::flex().autodiff();
        let layer = linear(d_in, d_out, &device);
        let xv = values(n * d_in, 1);
        let gv = values(n * d_out, 2);
        let x = tensor(xv.clone(), [n, d_in], &device).require_grad();
        let g = tensor(gv.clone(), [n, d_out], &device);
        let y = match k {
            Some(k) => meprop_forward(&layer, x.clone(), k),
            None => layer.forward(x.clone()),
        };
        let loss = (y.clone() * g).sum();
        let grads = loss.backward();
        let w = host(layer.weight.val().without_autodiff());
        let out = Grads {
            y: host(y.without_autodiff()),
            dx: host(x.grad(&grads).unwrap()),
            dw: host(layer.weight.val().grad(&grads).unwrap()),
            db: layer
                .bias
                .as_ref()
                .unwrap()
                .val()
                .grad(&grads)
                .unwrap()
                .into_data()
                .try_to_vec::<f32>()
                .expect("f32 data"),
        };
        (out, xv, gv, w)
    }

    #[test]
    fn k_equal_to_out_reproduces_standard_backprop() {
        let (dense, ..) = run(6, 9, 7, None);
        for k in [7, 50] {
            let (me, ..) = run(6, 9, 7, Some(k));
            assert_eq!(me.y, dense.y, "forward differs");
            assert_eq!(me.dx, dense.dx, "dx differs at k = {k}");
            assert_eq!(me.dw, dense.dw, "dW differs at k = {k}");
            assert_eq!(me.db, dense.db, "db differs at k = {k}");
        }
    }

    #[test]
    fn unified_mode_keeps_exactly_the_top_k_columns() {
        let (n, d_in, d_out, k) = (5, 8, 12, 3);
        let (me, xv, gv, w) = run(n, d_in, d_out, Some(k));
        // The columns meProp must keep: the k largest Σ_n |g|.
        let mut score: Vec<(f64, usize)> = (0..d_out)
            .map(|c| ((0..n).map(|r| gv[r * d_out + c].abs() as f64).sum(), c))
            .collect();
        score.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap());
        let keep: Vec<usize> = score[..k].iter().map(|s| s.1).collect();
        let mut masked = gv.clone();
        for r in 0..n {
            for c in 0..d_out {
                if !keep.contains(&c) {
                    masked[r * d_out + c] = 0.0;
                }
            }
        }
        // dW has exactly k non-zero columns, the kept ones.
        let nonzero_cols: Vec<usize> = (0..d_out)
            .filter(|&c| (0..d_in).any(|r| me.dw[r * d_out + c] != 0.0))
            .collect();
        let mut sorted_keep = keep.clone();
        sorted_keep.sort_unstable();
        assert_eq!(nonzero_cols, sorted_keep);
        // dx and dW equal the dense computation applied to the masked dy.
        let want_dw = matmul(&transpose(&xv, n, d_in), &masked, d_in, n, d_out);
        let want_dx = matmul(&masked, &transpose(&w, d_in, d_out), n, d_out, d_in);
        assert_close(&me.dw, &want_dw, "dW");
        assert_close(&me.dx, &want_dx, "dx");
        // The bias gradient stays dense: Σ_n g.
        let want_db: Vec<f32> = (0..d_out)
            .map(|c| (0..n).map(|r| gv[r * d_out + c]).sum())
            .collect();
        assert_close(&me.db, &want_db, "db");
        // The forward pass is unchanged.
        let (dense, ..) = run(n, d_in, d_out, None);
        assert_eq!(me.y, dense.y);
    }

    #[test]
    fn leading_dimensions_are_examples() {
        // A [2, 3, 4] input (batch × time × features) selects over all 6 rows.
        let device = Device::flex().autodiff();
        let layer = linear(4, 5, &device);
        let x = Tensor::<3>::from_data(TensorData::new(values(24, 3), [2, 3, 4]), &device);
        let y = meprop_forward(&layer, x.clone(), 2);
        assert_eq!(y.dims(), [2, 3, 5]);
        let y_dense = layer.forward(x);
        assert_eq!(
            y.into_data().try_to_vec::<f32>().expect("f32 data"),
            y_dense.into_data().try_to_vec::<f32>().expect("f32 data")
        );
    }

    #[test]
    fn untracked_inputs_run_the_plain_product() {
        let device = Device::flex();
        let layer = linear(3, 4, &device);
        let x = tensor(values(6, 4), [2, 3], &device);
        let y = meprop_forward(&layer, x.clone(), 1);
        assert_eq!(host(y), host(layer.forward(x)));
    }
}
