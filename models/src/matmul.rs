//! The matrix product of the zoo's linear layers, threaded by output blocks — a backend
//! extension like [`crate::gemm_conv`].
//!
//! burn 0.22.1's `Flex` multiplies two matrices with one `gemm` call, and hands it `gemm`'s
//! own threading once the product has 192³ multiply-adds. For the shapes of an MLP step (64
//! rows against 512–2048 columns) that threading costs more than it gains: on this 2-core
//! machine a `64 × 1024 · 1024 × 2048` product took 6.3–8.0 ms on two threads against
//! 5.0–6.2 ms on one, and the 784-512-256-10 MLP's step was slower on two threads than on one.
//! Here the output is cut into [`blocks`] along its longer side — at most
//! [`MAX_BLOCKS`], each at least [`MIN_BLOCK`] wide and [`MIN_BLOCK_MACS`] of work — and each
//! block is one single-threaded `gemm` call, the blocks parallel on rayon's pool (the same
//! product took 3.5–4.5 ms on two threads). The cut depends on the shape only, never on the
//! thread count, and every output element is one `gemm` dot product over the whole `k` in
//! either case, so the bits do not depend on the threads (tested).
//!
//! [`MatmulOps::mm`] is implemented for `Flex` (these kernels, for `f32` matrices of any
//! strides; other element types take burn's product), for `Cube` when the `cuda` or `wgpu` feature is
//! on (burn's product), and for `Autodiff<B>`, whose backward pass is the two products
//! `dA = dC · Bᵀ` and `dB = Aᵀ · dC` through the same operation (the transposes are views).
//! [`linear`] applies a [`Linear`] layer through it.

use std::mem::MaybeUninit;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, Flex, TensorMetadata};
use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::{Bytes, DType};
use rayon::prelude::*;

use crate::precision;

/// The most blocks an output is cut into.
pub const MAX_BLOCKS: usize = 8;

/// The narrowest block (rows or columns of the output).
pub const MIN_BLOCK: usize = 256;

/// The least work of a block, in multiply-adds (about 40 µs on one core here).
pub const MIN_BLOCK_MACS: usize = 1 << 21;

/// The matrix product as a backend operation (see the [module docs](self)); the default
/// body is burn's.
#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait MatmulOps: Backend {
    /// `lhs [m, k] · rhs [k, n]`.
    fn mm(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(lhs, rhs)
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl MatmulOps for burn::backend::Cube {}

/// How many blocks an `m × n` output of a product over `k` is cut into, along its longer side.
pub fn blocks(m: usize, n: usize, k: usize) -> usize {
    let macs = m.saturating_mul(n).saturating_mul(k);
    (m.max(n) / MIN_BLOCK)
        .min(macs / MIN_BLOCK_MACS)
        .clamp(1, MAX_BLOCKS)
}

/// A 2-D `f32` operand: its storage, the offset of element `[0, 0]`, its row and column
/// strides (in elements).
struct Operand<'a> {
    data: &'a [f32],
    offset: usize,
    rs: isize,
    cs: isize,
}

impl<'a> Operand<'a> {
    fn of(t: &'a FlexTensor) -> Self {
        let layout = t.layout();
        let strides = layout.strides();
        Self {
            data: t.storage(),
            offset: layout.start_offset(),
            rs: strides[0],
            cs: strides[1],
        }
    }

    /// The pointer to element `[row, col]`.
    fn at(&self, row: usize, col: usize) -> *const f32 {
        let i = self.index(row, col);
        assert!(
            i >= 0 && (i as usize) < self.data.len(),
            "mm: operand view outside its storage"
        );
        // SAFETY: `i` lies inside `data` (checked above).
        unsafe { self.data.as_ptr().offset(i) }
    }

    fn index(&self, row: usize, col: usize) -> isize {
        self.offset as isize + row as isize * self.rs + col as isize * self.cs
    }

    /// Panics unless every element of a `rows × cols` view lies inside the storage: the
    /// extreme elements of a strided view are its corners.
    fn check(&self, rows: usize, cols: usize) {
        for (r, c) in [(0, 0), (rows - 1, 0), (0, cols - 1), (rows - 1, cols - 1)] {
            let i = self.index(r, c);
            assert!(
                i >= 0 && (i as usize) < self.data.len(),
                "mm: operand view outside its storage"
            );
        }
    }
}

/// `out [m × n] = a [m × k] · b [k × n]`, `out` row-major, in [`blocks`] parallel blocks.
/// Every element of `out` is written (and none read), so it may come uninitialised.
fn product(out: &mut [MaybeUninit<f32>], m: usize, n: usize, k: usize, a: &Operand, b: &Operand) {
    assert_eq!(out.len(), m * n, "mm: output size");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.fill(MaybeUninit::new(0.0));
        return;
    }
    a.check(m, k);
    b.check(k, n);
    let count = blocks(m, n, k);
    let by_columns = n >= m;
    let side = if by_columns { n } else { m };
    let width = side.div_ceil(count);
    // The output's address as an integer, so that the blocks can share it across threads:
    // each writes its own rows or columns only.
    let out_addr = out.as_mut_ptr().cast::<f32>() as usize;
    (0..side.div_ceil(width)).into_par_iter().for_each(|blk| {
        let (lo, hi) = (blk * width, ((blk + 1) * width).min(side));
        let (rows, cols, a0, b0, dst) = if by_columns {
            (m, hi - lo, a.at(0, 0), b.at(0, lo), lo)
        } else {
            (hi - lo, n, a.at(lo, 0), b.at(0, 0), lo * n)
        };
        // SAFETY: `a0` / `b0` address `rows × k` and `k × cols` elements at the operands'
        // strides, inside their storage (`check` above); `dst` addresses this block's
        // `rows × cols` outputs at row stride `n`, which no other block writes.
        unsafe {
            let dst = (out_addr as *mut f32).add(dst);
            gemm_block(
                [rows, cols, k],
                (dst, n),
                (a0, a.rs, a.cs),
                (b0, b.rs, b.cs),
            );
        }
    });
}

/// One single-threaded `gemm` call: `dst [rows × cols] = a [rows × k] · b [k × cols]`, each
/// operand a pointer with its row and column strides (`dst` row-major at row stride `ld`,
/// not read).
///
/// # Safety
/// The pointers must address that many elements at those strides, and nothing else may
/// access `dst`'s elements during the call.
unsafe fn gemm_block(
    [rows, cols, k]: [usize; 3],
    (dst, ld): (*mut f32, usize),
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, b_rs, b_cs): (*const f32, isize, isize),
) {
    // SAFETY: the caller's contract.
    unsafe {
        gemm::gemm(
            rows,
            cols,
            k,
            dst,
            1,
            ld as isize,
            false,
            a,
            a_cs,
            a_rs,
            b,
            b_cs,
            b_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

impl MatmulOps for Flex {
    fn mm(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
        let (lhs, rhs) = (precision::operand(lhs), precision::operand(rhs));
        let two_d = lhs.shape().num_dims() == 2 && rhs.shape().num_dims() == 2;
        if !two_d || lhs.dtype() != DType::F32 || rhs.dtype() != DType::F32 {
            return Self::float_matmul(lhs, rhs);
        }
        let [m, k] = lhs.shape().dims::<2>();
        let [k2, n] = rhs.shape().dims::<2>();
        assert_eq!(k, k2, "mm: inner dimensions {k} and {k2}");
        // The output allocated typed and left uninitialised: `FlexTensor::empty` zeroes
        // bytes (alignment 1) and then copies them into a 16-byte-aligned buffer — two
        // passes over every product's output that `gemm` overwrites anyway (5 % of the MLP
        // step's samples in a profile).
        let mut data: Vec<f32> = Vec::with_capacity(m * n);
        product(
            &mut data.spare_capacity_mut()[..m * n],
            m,
            n,
            k,
            &Operand::of(&lhs),
            &Operand::of(&rhs),
        );
        // SAFETY: `product` wrote all `m · n` elements.
        unsafe { data.set_len(m * n) };
        FlexTensor::new(
            Bytes::from_elems(data),
            Layout::contiguous(Shape::new([m, n])),
            DType::F32,
        )
    }
}

impl<B: Backend + MatmulOps, C: CheckpointStrategy> MatmulOps for Autodiff<B, C> {
    fn mm(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct Mm;

        impl<B: Backend + MatmulOps> Backward<B, 2> for Mm {
            type State = (FloatTensor<B>, FloatTensor<B>);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let [node_lhs, node_rhs] = ops.parents;
                let dc = grads.consume::<B>(&ops.node);
                let (lhs, rhs) = ops.state;
                if let Some(node) = node_lhs {
                    let d = B::mm(dc.clone(), B::float_transpose(rhs));
                    grads.register::<B>(node.id, d);
                }
                if let Some(node) = node_rhs {
                    grads.register::<B>(node.id, B::mm(B::float_transpose(lhs), dc));
                }
            }
        }

        match Mm
            .prepare::<C>([lhs.node(), rhs.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (l, r) = (lhs.primitive().clone(), rhs.primitive().clone());
                let y = B::mm(l.clone(), r.clone());
                prep.finish((l, r), y)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::mm(lhs.into_primitive(), rhs.into_primitive()))
            }
        }
    }
}

/// `a · b` of two matrices through [`MatmulOps::mm`].
pub fn matmul(a: Tensor<2>, b: Tensor<2>) -> Tensor<2> {
    Tensor::<2>::from_dispatch(<Dispatch as MatmulOps>::mm(
        a.into_dispatch(),
        b.into_dispatch(),
    ))
}

/// `layer.forward(x)` — `x · W + b` over the last dimension of `x` — with the product
/// through [`MatmulOps::mm`] (the leading dimensions of `x` are flattened into rows).
pub fn linear<const D: usize>(layer: &Linear, x: Tensor<D>) -> Tensor<D> {
    let dims = x.dims();
    let weight = layer.weight.val();
    let [d_in, d_out] = weight.dims();
    assert_eq!(
        dims[D - 1],
        d_in,
        "linear: input width {} for {d_in}",
        dims[D - 1]
    );
    let rows: usize = dims[..D - 1].iter().product();
    let y = matmul(x.reshape([rows, d_in]), weight);
    let y = match &layer.bias {
        Some(b) => y + b.val().unsqueeze_dim(0),
        None => y,
    };
    let mut out = dims;
    out[D - 1] = d_out;
    y.reshape(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use burn::nn::LinearConfig;
    use burn::tensor::TensorData;

    use crate::kernel_tests::{assert_close, host, output_and_grads, values};

    /// `(y, dx, dW, db)` of `L = Σ y ⊙ g` through [`linear`] or burn's `Linear::forward`.
    fn run(rows: usize, d_in: usize, d_out: usize, ours: bool) -> [Vec<f32>; 4] {
        let device = Device::flex().autodiff();
        let mut layer = LinearConfig::new(d_in, d_out).init(&device);
        layer.weight = Param::from_tensor(Tensor::<2>::from_data(
            TensorData::new(values(d_in * d_out, 8), [d_in, d_out]),
            &device,
        ));
        layer.bias = Some(Param::from_tensor(Tensor::<1>::from_data(
            TensorData::new(values(d_out, 9), [d_out]),
            &device,
        )));
        let x = Tensor::<2>::from_data(
            TensorData::new(values(rows * d_in, 1), [rows, d_in]),
            &device,
        )
        .require_grad();
        let y = if ours {
            linear(&layer, x.clone())
        } else {
            layer.forward(x.clone())
        };
        let bias = layer.bias.as_ref().expect("bias").val();
        output_and_grads(y, &x, layer.weight.val(), bias)
    }

    #[test]
    fn matches_burns_linear_and_its_gradients() {
        // One block, column blocks (n ≥ m), row blocks (the weight gradient's m = d_in), an
        // uneven last block, and the empty-k corner through burn's shapes.
        for (rows, d_in, d_out) in [(3, 5, 7), (64, 300, 1100), (40, 1300, 600), (1, 2, 1)] {
            let ours = run(rows, d_in, d_out, true);
            let reference = run(rows, d_in, d_out, false);
            for (what, (a, b)) in ["y", "dx", "dW", "db"]
                .iter()
                .zip(ours.iter().zip(&reference))
            {
                assert_close(a, b, 1e-5, &format!("{what} {rows}x{d_in}x{d_out}"));
            }
        }
    }

    #[test]
    fn the_cut_depends_on_the_shape_only() {
        assert_eq!(blocks(64, 2048, 1024), 8);
        assert_eq!(blocks(64, 512, 784), 2);
        assert_eq!(blocks(64, 256, 512), 1);
        assert_eq!(blocks(1, 1, 1), 1);
        assert_eq!(blocks(784, 512, 64), 3);
        // The bits are those of one unblocked product, at any thread count.
        let device = Device::flex();
        let (m, k, n) = (64, 700, 1500);
        let a = Tensor::<2>::from_data(TensorData::new(values(m * k, 3), [m, k]), &device);
        let b = Tensor::<2>::from_data(TensorData::new(values(k * n, 4), [k, n]), &device);
        let run = || host(matmul(a.clone(), b.clone()));
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("pool");
        let three = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("pool");
        let (r1, r3) = (one.install(run), three.install(run));
        assert_eq!(r1, r3);
        let mut whole = vec![0f32; m * n];
        let (av, bv) = (host(a.clone()), host(b.clone()));
        // SAFETY: row-major m × k and k × n inputs, m × n output.
        unsafe {
            gemm_block(
                [m, n, k],
                (whole.as_mut_ptr(), n),
                (av.as_ptr(), k as isize, 1),
                (bv.as_ptr(), n as isize, 1),
            );
        }
        assert_eq!(r1, whole);
    }

    #[test]
    fn transposed_views_and_other_ranks() {
        // A transposed operand (strides swapped, no copy) and a rank-3 input.
        let device = Device::flex();
        let a = Tensor::<2>::from_data(TensorData::new(values(6 * 4, 5), [6, 4]), &device);
        let b = Tensor::<2>::from_data(TensorData::new(values(6 * 3, 6), [6, 3]), &device);
        let ours = matmul(a.clone().transpose(), b.clone());
        assert_close(&host(ours), &host(a.transpose().matmul(b)), 1e-6, "aᵀ·b");
        let layer = LinearConfig::new(4, 3).init(&device);
        let x = Tensor::<3>::from_data(TensorData::new(values(2 * 5 * 4, 7), [2, 5, 4]), &device);
        assert_close(
            &host(linear(&layer, x.clone())),
            &host(layer.forward(x)),
            1e-6,
            "rank 3",
        );
    }
}
