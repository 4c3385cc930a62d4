//! Training-mode batch normalisation of NCHW activations in two passes over the data, forward
//! and backward — a backend extension like [`crate::gemm_conv`].
//!
//! burn 0.22.1's generic `batch_norm_train` (which `Flex` does not override) swaps the batch
//! and channel dimensions of the input to reduce over them — a full copy, twice in the
//! forward pass and twice more in the backward pass — and composes the normalisation out of
//! about ten element-wise passes. On ResNet-20 those copies were 11 % of a one-thread step
//! (`copy_2d_tiled` in a sampling profile). Here, on `Flex` and `f32`:
//!
//! * forward: per channel, the mean and the biased variance (two passes, each row summed in
//!   16 `f32` lanes and the rows in `f64`), then `y = (x − μ)·(γ/σ) + β`, `σ = √(var + ε)`;
//! * backward: per channel `Σ dy` (β's gradient) and `Σ dy·x̂` (γ's), then
//!   `dx = (γ/σ)·(dy − Σdy/M − x̂·Σdy·x̂/M)` with `x̂ = (x − μ)/σ` and `M` values per channel,
//!
//! the statistics parallel over channels and the element-wise passes parallel over samples.
//! Every other backend and element type runs burn's own pair of operations.
//! [`forward`] applies a [`BatchNorm`] layer through it and updates the running statistics
//! exactly as [`BatchNorm::forward`] does; outside training it is [`BatchNorm::forward`].

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::flex::FlexTensor;
use burn::backend::ops::ModuleOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, Flex, TensorMetadata};
use burn::nn::BatchNorm;
use burn::prelude::*;
use burn::tensor::{DType, TensorData};
use rayon::prelude::*;

/// The output, the batch mean and the biased batch variance of training-mode batch
/// normalisation.
type Train<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

/// The gradients of the input, γ and β.
type TrainGrads<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

/// Training-mode batch normalisation and its backward pass as backend operations (see the
/// [module docs](self)); the default bodies are burn's own.
#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait BatchNormOps: Backend {
    /// `x [N, C, …]` normalised with its own per-channel statistics, scaled by `gamma [C]`
    /// and shifted by `beta [C]`: `(output, mean [C], variance [C])`.
    fn bn_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let r = Self::batch_norm_train(x, gamma, beta, epsilon);
        (r.output, r.mean, r.variance)
    }

    /// The gradients `(x, gamma, beta)` of [`BatchNormOps::bn_train`] for the output gradient
    /// `dy`, from the statistics it returned.
    fn bn_train_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let r = Self::batch_norm_train_backward(x, gamma, mean, variance, epsilon, dy);
        (r.x_grad, r.gamma_grad, r.beta_grad)
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl BatchNormOps for burn::backend::Cube {}

/// `[N, C, P]` of a tensor of rank ≥ 2 (`P` the product of the trailing dimensions).
fn ncp(t: &FlexTensor) -> [usize; 3] {
    let dims = t.shape().to_vec();
    [dims[0], dims[1], dims[2..].iter().product()]
}

fn f32s(t: &FlexTensor) -> Option<FlexTensor> {
    (t.dtype() == DType::F32).then(|| t.to_contiguous())
}

fn flex(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

impl BatchNormOps for Flex {
    fn bn_train(x: FlexTensor, gamma: FlexTensor, beta: FlexTensor, epsilon: f64) -> Train<Flex> {
        let (Some(xc), Some(gc), Some(bc)) = (f32s(&x), f32s(&gamma), f32s(&beta)) else {
            let r = Self::batch_norm_train(x, gamma, beta, epsilon);
            return (r.output, r.mean, r.variance);
        };
        let [n, c, p] = ncp(&xc);
        let xs: &[f32] = xc.storage();
        let (mean, var) = statistics(xs, [n, c, p]);
        let (g, b): (&[f32], &[f32]) = (gc.storage(), bc.storage());
        let scale: Vec<f32> = (0..c)
            .map(|ch| g[ch] / (var[ch] as f64 + epsilon).sqrt() as f32)
            .collect();
        let shift: Vec<f32> = (0..c).map(|ch| b[ch] - mean[ch] * scale[ch]).collect();
        let mut y = vec![0f32; xs.len()];
        y.par_chunks_mut(c * p)
            .zip(xs.par_chunks(c * p))
            .for_each(|(y_n, x_n)| {
                for ch in 0..c {
                    let (s, t) = (scale[ch], shift[ch]);
                    let (yr, xr) = (&mut y_n[ch * p..][..p], &x_n[ch * p..][..p]);
                    for (yv, xv) in yr.iter_mut().zip(xr) {
                        *yv = xv * s + t;
                    }
                }
            });
        (
            flex(y, xc.shape().to_vec()),
            flex(mean, vec![c]),
            flex(var, vec![c]),
        )
    }

    fn bn_train_backward(
        x: FlexTensor,
        gamma: FlexTensor,
        mean: FlexTensor,
        variance: FlexTensor,
        epsilon: f64,
        dy: FlexTensor,
    ) -> TrainGrads<Flex> {
        let all = (
            f32s(&x),
            f32s(&gamma),
            f32s(&mean),
            f32s(&variance),
            f32s(&dy),
        );
        let (Some(xc), Some(gc), Some(mc), Some(vc), Some(dyc)) = all else {
            let r = Self::batch_norm_train_backward(x, gamma, mean, variance, epsilon, dy);
            return (r.x_grad, r.gamma_grad, r.beta_grad);
        };
        let [n, c, p] = ncp(&xc);
        let (xs, dys): (&[f32], &[f32]) = (xc.storage(), dyc.storage());
        let (g, mu, var): (&[f32], &[f32], &[f32]) = (gc.storage(), mc.storage(), vc.storage());
        let inv_std: Vec<f32> = var
            .iter()
            .map(|&v| (1.0 / (v as f64 + epsilon).sqrt()) as f32)
            .collect();
        // Σ dy and Σ dy·x̂ per channel.
        let sums: Vec<(f64, f64)> = (0..c)
            .into_par_iter()
            .map(|ch| {
                let (mut s, mut sx) = (0f64, 0f64);
                for i in 0..n {
                    let off = (i * c + ch) * p;
                    let (xr, dr) = (&xs[off..off + p], &dys[off..off + p]);
                    s += lane_sum(dr, dr, |d, _| d);
                    sx += lane_sum(xr, dr, |x, d| d * (x - mu[ch]));
                }
                (s, sx * inv_std[ch] as f64)
            })
            .collect();
        let m = (n * p) as f64;
        let mut dx = vec![0f32; xs.len()];
        dx.par_chunks_mut(c * p)
            .zip(xs.par_chunks(c * p).zip(dys.par_chunks(c * p)))
            .for_each(|(dx_n, (x_n, dy_n))| {
                for ch in 0..c {
                    let k = g[ch] * inv_std[ch];
                    let mean_dy = (sums[ch].0 / m) as f32;
                    // x̂·Σdy·x̂/M = (x − μ)·σ⁻¹·Σdy·x̂/M
                    let proj = (sums[ch].1 / m) as f32 * inv_std[ch];
                    let rows = (
                        &mut dx_n[ch * p..][..p],
                        &x_n[ch * p..][..p],
                        &dy_n[ch * p..][..p],
                    );
                    for ((d, xv), dv) in rows.0.iter_mut().zip(rows.1).zip(rows.2) {
                        *d = k * (dv - mean_dy - (xv - mu[ch]) * proj);
                    }
                }
            });
        let dgamma: Vec<f32> = sums.iter().map(|s| s.1 as f32).collect();
        let dbeta: Vec<f32> = sums.iter().map(|s| s.0 as f32).collect();
        (
            flex(dx, xc.shape().to_vec()),
            flex(dgamma, vec![c]),
            flex(dbeta, vec![c]),
        )
    }
}

/// `Σ f(a_i, b_i)` over one row: [`LANES`] independent `f32` partial sums (so the loop is
/// vectorised and not bound by the latency of one chain of additions), added in `f64`.
fn lane_sum(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f64 {
    let mut lanes = [0f32; LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f64 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(&x, &y)| f(x, y) as f64)
        .sum();
    for (ca, cb) in ac.zip(bc) {
        for l in 0..LANES {
            lanes[l] += f(ca[l], cb[l]);
        }
    }
    lanes.iter().map(|&v| v as f64).sum::<f64>() + tail
}

/// Partial sums of [`lane_sum`].
const LANES: usize = 16;

/// Per-channel mean and biased variance of `x [N, C, P]`: two passes, each row summed by
/// [`lane_sum`] and the rows in `f64`.
fn statistics(xs: &[f32], [n, c, p]: [usize; 3]) -> (Vec<f32>, Vec<f32>) {
    let m = (n * p) as f64;
    (0..c)
        .into_par_iter()
        .map(|ch| {
            let rows = || (0..n).map(move |i| &xs[(i * c + ch) * p..][..p]);
            let sum: f64 = rows().map(|r| lane_sum(r, r, |x, _| x)).sum();
            let mean = (sum / m) as f32;
            let sq: f64 = rows()
                .map(|r| lane_sum(r, r, |x, _| (x - mean) * (x - mean)))
                .sum();
            (mean, (sq / m) as f32)
        })
        .unzip()
}

impl<B: Backend + BatchNormOps, C: CheckpointStrategy> BatchNormOps for Autodiff<B, C> {
    fn bn_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> Train<Self> {
        #[derive(Debug)]
        struct BnTrain;

        impl<B: Backend + BatchNormOps> Backward<B, 3> for BnTrain {
            type State = (
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                f64,
            );

            fn backward(
                self,
                ops: Ops<Self::State, 3>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let [node_x, node_gamma, node_beta] = ops.parents;
                let dy = grads.consume::<B>(&ops.node);
                let (x, gamma, mean, variance, epsilon) = ops.state;
                let (dx, dgamma, dbeta) =
                    B::bn_train_backward(x, gamma, mean, variance, epsilon, dy);
                for (node, grad) in [(node_x, dx), (node_gamma, dgamma), (node_beta, dbeta)] {
                    if let Some(node) = node {
                        grads.register::<B>(node.id, grad);
                    }
                }
            }
        }

        let untracked = <FloatTensor<Self>>::new;
        match BnTrain
            .prepare::<C>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (xp, gp) = (x.primitive().clone(), gamma.primitive().clone());
                let (y, mean, var) =
                    B::bn_train(xp.clone(), gp.clone(), beta.into_primitive(), epsilon);
                let state = (xp, gp, mean.clone(), var.clone(), epsilon);
                (prep.finish(state, y), untracked(mean), untracked(var))
            }
            OpsKind::UnTracked(prep) => {
                let (y, mean, var) = B::bn_train(
                    x.into_primitive(),
                    gamma.into_primitive(),
                    beta.into_primitive(),
                    epsilon,
                );
                (prep.finish(y), untracked(mean), untracked(var))
            }
        }
    }
}

/// `layer.forward(x)`: in training (an autodiff device and the layer's training flag on)
/// through [`BatchNormOps`], updating the running statistics as burn does; otherwise burn's
/// inference path.
pub fn forward<const D: usize>(layer: &BatchNorm, x: Tensor<D>) -> Tensor<D> {
    let device = x.device();
    if !(device.is_autodiff() && layer.training.is_enabled()) {
        return layer.forward(x);
    }
    let (y, mean, var) = <Dispatch as BatchNormOps>::bn_train(
        x.into_dispatch(),
        layer.gamma.val().into_dispatch(),
        layer.beta.val().into_dispatch(),
        layer.epsilon,
    );
    let (mean, var) = (
        Tensor::<1>::from_dispatch(mean),
        Tensor::<1>::from_dispatch(var),
    );
    let m = layer.momentum;
    let running_mean = layer.running_mean.value_sync().to_device(&device);
    let running_var = layer.running_var.value_sync().to_device(&device);
    layer.running_mean.update(
        running_mean
            .mul_scalar(1.0 - m)
            .add(mean.detach().mul_scalar(m))
            .detach(),
    );
    layer.running_var.update(
        running_var
            .mul_scalar(1.0 - m)
            .add(var.detach().mul_scalar(m))
            .detach(),
    );
    Tensor::<D>::from_dispatch(y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use burn::nn::BatchNormConfig;

    use crate::kernel_tests::{assert_close, host, values};

    /// [`values`] with a per-index offset, so that channels differ in mean.
    fn offset_values(n: usize, seed: u64) -> Vec<f32> {
        let mut v = values(n, seed);
        v.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x += (i % 7) as f32 * 0.3);
        v
    }

    fn layer(c: usize) -> BatchNorm {
        let device = Device::flex().autodiff();
        let mut l = BatchNormConfig::new(c).init(&device);
        let t =
            |seed| Tensor::<1>::from_data(TensorData::new(offset_values(c, seed), [c]), &device);
        l.gamma = Param::from_tensor(t(3));
        l.beta = Param::from_tensor(t(4));
        l
    }

    /// `(y, dx, dγ, dβ, running mean, running var)` of `L = Σ y ⊙ g` after one training
    /// forward through this module or burn's.
    fn run(dims: [usize; 4], ours: bool) -> [Vec<f32>; 6] {
        let device = Device::flex().autodiff();
        let l = layer(dims[1]);
        let n: usize = dims.iter().product();
        let x = Tensor::<4>::from_data(TensorData::new(offset_values(n, 1), dims), &device)
            .require_grad();
        let y = if ours {
            forward(&l, x.clone())
        } else {
            l.forward(x.clone())
        };
        let g = Tensor::<4>::from_data(TensorData::new(offset_values(n, 2), dims), &device);
        let grads = (y.clone() * g).sum().backward();
        [
            host(y.without_autodiff()),
            host(x.grad(&grads).expect("dx")),
            host(l.gamma.val().grad(&grads).expect("dgamma")),
            host(l.beta.val().grad(&grads).expect("dbeta")),
            host(l.running_mean.value()),
            host(l.running_var.value()),
        ]
    }

    #[test]
    fn matches_burns_batch_norm_its_gradients_and_running_statistics() {
        for dims in [
            [4, 3, 5, 5],
            [1, 2, 3, 1],
            [7, 16, 2, 2],
            [3, 5, 1, 1],
            [2, 8, 1, 1],
        ] {
            let ours = run(dims, true);
            let reference = run(dims, false);
            for (what, (a, b)) in ["y", "dx", "dgamma", "dbeta", "running mean", "running var"]
                .iter()
                .zip(ours.iter().zip(&reference))
            {
                assert_close(a, b, 2e-5, &format!("{what} {dims:?}"));
            }
        }
    }

    #[test]
    fn inference_is_burns_forward() {
        let device = Device::flex();
        let l = BatchNormConfig::new(3).init(&device);
        let x =
            Tensor::<4>::from_data(TensorData::new(offset_values(48, 5), [2, 3, 2, 4]), &device);
        assert_eq!(host(forward(&l, x.clone())), host(l.forward(x)));
    }
}
