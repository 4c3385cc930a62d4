//! The zoo's 2-D convolutions as im2col times a matrix product, in NCHW, for the forward pass
//! and both backward passes — a backend extension like [`crate::meprop`].
//!
//! burn 0.22.1's `Flex` backend computes a convolution's weight gradient with its generic
//! rule, a convolution of the batch-swapped input by the batch-swapped output gradient, and
//! converts layouts serially around every pass. On ResNet-20 at batch 32 that weight gradient
//! alone took 275 ms of a 526 ms one-thread step (`models/examples/conv_ops.rs`). Here every
//! pass is one GEMM per group of `G` samples on buffers the kernel owns, called through the
//! `gemm` crate that `Flex` itself uses:
//!
//! * forward: `y [O × G·P] = W [O × K] · cols(x) [K × G·P]`;
//! * input gradient: `dx = col2im(Wᵀ [K × O] · dy [O × G·P])`, or — for stride 1, kernels up
//!   to 3×3 and at least 16 input channels — the forward convolution of `dy` by the flipped,
//!   transposed kernel with padding `k − 1 − p` (no scatter-add, `O·kh·kw` terms a product);
//! * weight gradient: `dW [O × K] = Σ dy [O × G·P] · cols(x)ᵀ [G·P × K]`, computed as its
//!   transpose for at most [`TRANSPOSED_WEIGHT_GRAD_MAX_O`] output channels,
//!
//! with `K = C·kh·kw`, `P = OH·OW` and `G` the fewest samples whose `G·P` reaches
//! [`MIN_COLUMNS`] (one sample for ResNet's 32×32 and 16×16 maps, the batch for AlexNet's 2×2);
//! `cols(x_n)` row `(c, i, j)` holds input channel `c` shifted by the kernel offset `(i, j)`,
//! zero where the window falls in the padding. Groups run in parallel on rayon's pool. The
//! weight gradient sums fixed runs of at least [`SAMPLES_PER_PARTIAL`] samples and then the
//! runs in order, so its bits do not depend on the thread count.
//!
//! # Backends
//! [`GemmConvOps`] is implemented for `Flex` (these kernels, for contiguous-or-not `f32`
//! tensors; any other element type takes burn's own convolution), for `Cube` when the `cuda` or `wgpu`
//! feature is on (burn's convolution), and for `Autodiff<B>` over either, whose backward pass
//! calls the backend's two gradient operations. [`conv2d`] applies a [`Conv2d`] layer through
//! it when the layer has symmetric padding, no dilation and one group, and through
//! [`Conv2d::forward`] otherwise.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::flex::FlexTensor;
use burn::backend::ops::ModuleOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, Flex, TensorMetadata};
use burn::nn::conv::Conv2d;
use burn::nn::PaddingConfig2d;
use burn::prelude::*;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, TensorData};
use rayon::prelude::*;

use crate::precision;

/// Samples summed into one partial weight gradient before the partials are added in order
/// (at least; a multiple of the samples of one product).
pub const SAMPLES_PER_PARTIAL: usize = 4;

/// The most output channels for which [`GemmConvOps::gemm_conv2d_weight_backward`] computes
/// `dWᵀ` instead of `dW` (see `weight_backward`).
pub const TRANSPOSED_WEIGHT_GRAD_MAX_O: usize = 64;

/// Columns a matrix product should have at least: samples are grouped into one product until
/// `G·P` reaches it.
pub const MIN_COLUMNS: usize = 256;

/// Stride and zero padding of a square-or-not 2-D convolution without dilation or groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvGeometry {
    /// Vertical and horizontal stride.
    pub stride: [usize; 2],
    /// Zero padding on each side, vertical and horizontal.
    pub padding: [usize; 2],
}

impl ConvGeometry {
    /// burn's options for the same convolution.
    pub fn options(self) -> ConvOptions<2> {
        ConvOptions::new(self.stride, self.padding, [1, 1], 1)
    }
}

/// The convolution and its two gradients as backend operations (see the
/// [module docs](self)). The default bodies are burn's own convolution operations.
#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait GemmConvOps: Backend {
    /// `x [N, C, H, W]` convolved with `w [O, C, kh, kw]`, no bias: `[N, O, OH, OW]`.
    fn gemm_conv2d(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        geometry: ConvGeometry,
    ) -> FloatTensor<Self> {
        Self::conv2d(x, w, None, geometry.options())
    }

    /// The gradient with respect to `x` of [`GemmConvOps::gemm_conv2d`] for the output
    /// gradient `dy`.
    fn gemm_conv2d_x_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        geometry: ConvGeometry,
    ) -> FloatTensor<Self> {
        Self::conv2d_x_backward(x, w, dy, geometry.options())
    }

    /// The gradient with respect to `w` of [`GemmConvOps::gemm_conv2d`] for the output
    /// gradient `dy`.
    fn gemm_conv2d_weight_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        geometry: ConvGeometry,
    ) -> FloatTensor<Self> {
        Self::conv2d_weight_backward(x, w, dy, geometry.options())
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl GemmConvOps for burn::backend::Cube {}

/// The f32 storage of a Flex tensor in row-major order (a copy only when it is a strided view).
fn f32_contiguous(t: FlexTensor) -> Option<FlexTensor> {
    (t.dtype() == DType::F32).then(|| t.to_contiguous())
}

fn flex_tensor(values: Vec<f32>, shape: [usize; 4]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// The shapes of one convolution, from `x [N, C, H, W]`, `w [O, C, kh, kw]` and the geometry.
fn shapes(x: &FlexTensor, w: &FlexTensor, geometry: ConvGeometry) -> Shapes {
    let [n, c, h, wd] = x.shape().dims::<4>();
    let [o, wc, kh, kw] = w.shape().dims::<4>();
    assert_eq!(
        c, wc,
        "gemm_conv2d: input has {c} channels, weight expects {wc}"
    );
    Shapes::new([n, c, h, wd], [o, kh, kw], geometry)
}

impl GemmConvOps for Flex {
    fn gemm_conv2d(x: FlexTensor, w: FlexTensor, geometry: ConvGeometry) -> FlexTensor {
        let s = shapes(&x, &w, geometry);
        let (x, w) = (precision::operand(x), precision::operand(w));
        match (f32_contiguous(x.clone()), f32_contiguous(w.clone())) {
            (Some(xc), Some(wc)) => {
                let mut y = vec![0f32; s.n * s.o * s.p()];
                forward(&s, xc.storage(), wc.storage(), &mut y);
                flex_tensor(y, [s.n, s.o, s.oh, s.ow])
            }
            _ => Self::conv2d(x, w, None, geometry.options()),
        }
    }

    fn gemm_conv2d_x_backward(
        x: FlexTensor,
        w: FlexTensor,
        dy: FlexTensor,
        geometry: ConvGeometry,
    ) -> FlexTensor {
        let s = shapes(&x, &w, geometry);
        let (w, dy) = (precision::operand(w), precision::operand(dy));
        match (f32_contiguous(w.clone()), f32_contiguous(dy.clone())) {
            (Some(wc), Some(dyc)) if x.dtype() == DType::F32 => {
                let mut dx = vec![0f32; s.n * s.c * s.h * s.w];
                x_backward_any(&s, wc.storage(), dyc.storage(), &mut dx);
                flex_tensor(dx, [s.n, s.c, s.h, s.w])
            }
            _ => Self::conv2d_x_backward(x, w, dy, geometry.options()),
        }
    }

    fn gemm_conv2d_weight_backward(
        x: FlexTensor,
        w: FlexTensor,
        dy: FlexTensor,
        geometry: ConvGeometry,
    ) -> FlexTensor {
        let s = shapes(&x, &w, geometry);
        let (x, dy) = (precision::operand(x), precision::operand(dy));
        match (f32_contiguous(x.clone()), f32_contiguous(dy.clone())) {
            (Some(xc), Some(dyc)) if w.dtype() == DType::F32 => {
                let mut dw = vec![0f32; s.o * s.k()];
                weight_backward(&s, xc.storage(), dyc.storage(), &mut dw);
                flex_tensor(dw, [s.o, s.c, s.kh, s.kw])
            }
            _ => Self::conv2d_weight_backward(x, w, dy, geometry.options()),
        }
    }
}

impl<B: Backend + GemmConvOps, C: CheckpointStrategy> GemmConvOps for Autodiff<B, C> {
    fn gemm_conv2d(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        geometry: ConvGeometry,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct GemmConv2d;

        impl<B: Backend + GemmConvOps> Backward<B, 2> for GemmConv2d {
            type State = (FloatTensor<B>, FloatTensor<B>, ConvGeometry);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let [node_x, node_w] = ops.parents;
                let dy = grads.consume::<B>(&ops.node);
                let (x, w, geometry) = ops.state;
                if let Some(node) = node_x {
                    let dx = B::gemm_conv2d_x_backward(x.clone(), w.clone(), dy.clone(), geometry);
                    grads.register::<B>(node.id, dx);
                }
                if let Some(node) = node_w {
                    grads
                        .register::<B>(node.id, B::gemm_conv2d_weight_backward(x, w, dy, geometry));
                }
            }
        }

        match GemmConv2d
            .prepare::<C>([x.node(), w.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let xp = x.primitive().clone();
                let wp = w.primitive().clone();
                let y = B::gemm_conv2d(xp.clone(), wp.clone(), geometry);
                prep.finish((xp, wp, geometry), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::gemm_conv2d(
                x.into_primitive(),
                w.into_primitive(),
                geometry,
            )),
        }
    }
}

/// The geometry of a layer when [`GemmConvOps`] can run it: symmetric padding (explicit,
/// valid, or "same" at stride 1 with odd kernels), no dilation, one group.
pub fn layer_geometry(layer: &Conv2d) -> Option<ConvGeometry> {
    let padding = match layer.padding {
        PaddingConfig2d::Valid => [0, 0],
        PaddingConfig2d::Explicit(top, left, bottom, right) if top == bottom && left == right => {
            [top, left]
        }
        PaddingConfig2d::Same
            if layer.stride == [1, 1] && layer.kernel_size.iter().all(|k| k % 2 == 1) =>
        {
            [layer.kernel_size[0] / 2, layer.kernel_size[1] / 2]
        }
        _ => return None,
    };
    (layer.dilation == [1, 1] && layer.groups == 1).then_some(ConvGeometry {
        stride: layer.stride,
        padding,
    })
}

/// `layer.forward(x)` through [`GemmConvOps`] (the same result up to float rounding), or
/// through burn's convolution when the layer's geometry is one this module does not cover.
pub fn conv2d(layer: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    let Some(geometry) = layer_geometry(layer) else {
        return layer.forward(x);
    };
    let y = Tensor::<4>::from_dispatch(<Dispatch as GemmConvOps>::gemm_conv2d(
        x.into_dispatch(),
        layer.weight.val().into_dispatch(),
        geometry,
    ));
    match &layer.bias {
        Some(b) => {
            let o = b.dims()[0];
            y + b.val().reshape([1, o, 1, 1])
        }
        None => y,
    }
}

/// All the sizes of one convolution.
#[derive(Debug, Clone, Copy)]
struct Shapes {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    sh: usize,
    sw: usize,
    ph: usize,
    pw: usize,
    oh: usize,
    ow: usize,
}

impl Shapes {
    fn new(x: [usize; 4], kernel: [usize; 3], g: ConvGeometry) -> Self {
        let [n, c, h, w] = x;
        let [o, kh, kw] = kernel;
        let [sh, sw] = g.stride;
        let [ph, pw] = g.padding;
        assert!(sh > 0 && sw > 0, "gemm_conv2d: zero stride");
        let out = |size: usize, k: usize, p: usize, s: usize| {
            (size + 2 * p)
                .checked_sub(k)
                .map(|d| d / s + 1)
                .expect("gemm_conv2d: kernel larger than the padded input")
        };
        Self {
            n,
            c,
            h,
            w,
            o,
            kh,
            kw,
            sh,
            sw,
            ph,
            pw,
            oh: out(h, kh, ph, sh),
            ow: out(w, kw, pw, sw),
        }
    }

    /// Rows of a column matrix: `C·kh·kw`.
    fn k(&self) -> usize {
        self.c * self.kh * self.kw
    }

    /// Output positions of one sample: `OH·OW`.
    fn p(&self) -> usize {
        self.oh * self.ow
    }

    /// Values of one input sample: `C·H·W`.
    fn x_len(&self) -> usize {
        self.c * self.h * self.w
    }

    /// Samples per matrix product: enough that its column count `G·P` reaches
    /// [`MIN_COLUMNS`] (AlexNet-CIFAR's last layers have `P = 4`: one sample's product is a
    /// matrix–vector product), at most the batch.
    fn group(&self) -> usize {
        MIN_COLUMNS
            .div_ceil(self.p().max(1))
            .clamp(1, self.n.max(1))
    }

    /// Whether `cols(x_n)` is `x_n` itself (1×1 kernel, stride 1, no padding).
    fn identity_cols(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.sh == 1 && self.sw == 1 && self.ph == 0 && self.pw == 0
    }

    /// [`Shapes::valid`] of every kernel row `i` and every kernel column `j`: they depend on
    /// the kernel position only, so one sample's passes compute them once, not once per
    /// channel (two divisions each, which cost more than the copies of the small maps of
    /// AlexNet-CIFAR's last layers).
    fn valid_ranges(&self) -> (Vec<Span>, Vec<Span>) {
        let rows = (0..self.kh).map(|i| Self::valid(self.oh, self.h, i, self.sh, self.ph));
        let cols = (0..self.kw).map(|j| Self::valid(self.ow, self.w, j, self.sw, self.pw));
        (rows.collect(), cols.collect())
    }

    /// The output indices `lo..hi` along one side whose input index `o·s + k − p` lies in
    /// `0..size`.
    fn valid(out: usize, size: usize, k: usize, s: usize, p: usize) -> (usize, usize) {
        // o·s + k ≥ p  ⇔  o ≥ ceil((p − k) / s);  o·s + k − p ≤ size − 1.
        let lo = p.saturating_sub(k).div_ceil(s);
        let hi = if size + p > k {
            ((size + p - k - 1) / s + 1).min(out)
        } else {
            0
        };
        (lo.min(hi), hi)
    }
}

/// A range `lo..hi` of output indices, as `(lo, hi)`.
type Span = (usize, usize);

/// Writes one sample's `cols(x_n)` (`K` rows of `P`) into `cols` at column `off` of rows
/// `ld` long: row `(c, i, j)`, column `off + oh·OW + ow`.
///
/// With stride 1 and an output as wide as the input (ResNet's and VGG's 3×3 layers, and the
/// input gradient's flipped convolution), output position `d = oh·W + ow` reads input
/// position `d + (i − ph)·W + (j − pw)`: the valid rows of a row of `cols` are one shifted
/// copy of the plane, after which the few columns the shift wrapped around are zeroed. That
/// is one copy per `(c, i, j)` instead of one per output row (a 32×32 map: 32 `memmove`
/// calls of 31 values each, whose call overhead was most of the copy).
fn im2col(s: &Shapes, x_n: &[f32], cols: &mut [f32], ld: usize, off: usize) {
    let p = s.p();
    let shifted_copy = s.sh == 1 && s.sw == 1 && s.ow == s.w;
    let (rows_valid, cols_valid) = s.valid_ranges();
    for c in 0..s.c {
        let plane = &x_n[c * s.h * s.w..(c + 1) * s.h * s.w];
        for (i, &(oh_lo, oh_hi)) in rows_valid.iter().enumerate() {
            for (j, &(ow_lo, ow_hi)) in cols_valid.iter().enumerate() {
                let row = &mut cols[((c * s.kh + i) * s.kw + j) * ld + off..][..p];
                row[..oh_lo * s.ow].fill(0.0);
                row[oh_hi * s.ow..].fill(0.0);
                if shifted_copy && oh_lo < oh_hi && ow_lo < ow_hi {
                    // First and last valid output positions, and the constant shift to the
                    // input (both ends read valid input positions, so everything between
                    // lies inside the plane).
                    let (lo, hi) = (oh_lo * s.ow + ow_lo, (oh_hi - 1) * s.ow + ow_hi);
                    let src = (oh_lo + i - s.ph) * s.w + ow_lo + j - s.pw;
                    row[lo..hi].copy_from_slice(&plane[src..src + (hi - lo)]);
                    // Column by column (a stride-`OW` walk): a row-by-row loop over one or
                    // two values becomes a `memset` call per output row.
                    let valid_rows = oh_lo * s.ow..oh_hi * s.ow;
                    for ow in (0..ow_lo).chain(ow_hi..s.ow) {
                        let column = row[valid_rows.clone()].iter_mut().skip(ow).step_by(s.ow);
                        column.for_each(|v| *v = 0.0);
                    }
                    continue;
                }
                for oh in oh_lo..oh_hi {
                    let ih = oh * s.sh + i - s.ph;
                    let dst = &mut row[oh * s.ow..(oh + 1) * s.ow];
                    dst[..ow_lo].fill(0.0);
                    dst[ow_hi..].fill(0.0);
                    let src = &plane[ih * s.w..(ih + 1) * s.w];
                    if s.sw == 1 {
                        let start = ow_lo + j - s.pw;
                        dst[ow_lo..ow_hi].copy_from_slice(&src[start..start + ow_hi - ow_lo]);
                    } else {
                        let start = ow_lo * s.sw + j - s.pw;
                        let strided = src[start..].iter().step_by(s.sw);
                        for (d, &v) in dst[ow_lo..ow_hi].iter_mut().zip(strided) {
                            *d = v;
                        }
                    }
                }
            }
        }
    }
}

/// Adds the columns `off..off + P` of `cols` (`K` rows `ld` long) back into one sample's
/// input gradient `dx_n [C × H × W]` — the adjoint of [`im2col`].
fn col2im_add(s: &Shapes, cols: &[f32], ld: usize, off: usize, dx_n: &mut [f32]) {
    let p = s.p();
    let (rows_valid, cols_valid) = s.valid_ranges();
    for c in 0..s.c {
        let plane = &mut dx_n[c * s.h * s.w..(c + 1) * s.h * s.w];
        for (i, &(oh_lo, oh_hi)) in rows_valid.iter().enumerate() {
            for (j, &(ow_lo, ow_hi)) in cols_valid.iter().enumerate() {
                let row = &cols[((c * s.kh + i) * s.kw + j) * ld + off..][..p];
                for oh in oh_lo..oh_hi {
                    let ih = oh * s.sh + i - s.ph;
                    let src = &row[oh * s.ow..(oh + 1) * s.ow];
                    let dst = &mut plane[ih * s.w..(ih + 1) * s.w];
                    if s.sw == 1 {
                        let start = ow_lo + j - s.pw;
                        for (d, v) in dst[start..start + ow_hi - ow_lo]
                            .iter_mut()
                            .zip(&src[ow_lo..ow_hi])
                        {
                            *d += v;
                        }
                    } else {
                        for (ow, v) in src.iter().enumerate().take(ow_hi).skip(ow_lo) {
                            dst[ow * s.sw + j - s.pw] += v;
                        }
                    }
                }
            }
        }
    }
}

/// `cols [K × G·P]` of the `G` samples in `xs`, sample `n` in columns `n·P..(n + 1)·P`.
fn im2col_group(s: &Shapes, xs: &[f32], cols: &mut [f32]) {
    let g = xs.len() / s.x_len();
    for (n, x_n) in xs.chunks(s.x_len()).enumerate() {
        im2col(s, x_n, cols, g * s.p(), n * s.p());
    }
}

/// `G` samples' `[G × O × P]` (NCHW) as one matrix `[O × G·P]`.
fn to_matrix(s: &Shapes, nchw: &[f32], matrix: &mut [f32]) {
    let p = s.p();
    let g = nchw.len() / (s.o * p);
    for (n, sample) in nchw.chunks(s.o * p).enumerate() {
        for (o, row) in sample.chunks(p).enumerate() {
            matrix[o * g * p + n * p..][..p].copy_from_slice(row);
        }
    }
}

/// The output gradient of a group of `G` samples as one matrix `[O × G·P]`: the sample's
/// own rows when `G = 1`, else [`to_matrix`]'s copy into `scratch`.
fn dy_matrix<'a>(s: &Shapes, dys: &'a [f32], scratch: &'a mut [f32]) -> &'a [f32] {
    if dys.len() == s.o * s.p() {
        return dys;
    }
    let m = &mut scratch[..dys.len()];
    to_matrix(s, dys, m);
    m
}

/// The inverse of [`to_matrix`].
fn from_matrix(s: &Shapes, matrix: &[f32], nchw: &mut [f32]) {
    let p = s.p();
    let g = nchw.len() / (s.o * p);
    for (n, sample) in nchw.chunks_mut(s.o * p).enumerate() {
        for (o, row) in sample.chunks_mut(p).enumerate() {
            row.copy_from_slice(&matrix[o * g * p + n * p..][..p]);
        }
    }
}

/// A row-major matrix view for [`matmul`]: pointer, row stride, column stride.
#[derive(Clone, Copy)]
struct View {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}

impl View {
    /// A row-major `[rows × cols]` matrix.
    fn rows(data: &[f32], cols: usize) -> Self {
        Self {
            ptr: data.as_ptr(),
            rs: cols as isize,
            cs: 1,
        }
    }

    /// The transpose of a row-major `[rows × cols]` matrix.
    fn transposed(data: &[f32], cols: usize) -> Self {
        Self {
            ptr: data.as_ptr(),
            rs: 1,
            cs: cols as isize,
        }
    }
}

/// `dst [m × n] (+)= a [m × k] · b [k × n]`, with `dst` row-major and `accumulate` choosing
/// between overwriting and adding. Single-threaded: the callers parallelise over samples.
fn matmul(dst: &mut [f32], m: usize, n: usize, k: usize, a: View, b: View, accumulate: bool) {
    assert!(dst.len() >= m * n, "matmul: destination too small");
    // SAFETY: `dst` holds `m × n` values at row stride `n`; every caller builds `a` and `b`
    // from slices holding `m × k` and `k × n` values at the strides given (checked by the
    // shapes of the tensors they come from), and nothing else aliases `dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.ptr,
            a.cs,
            a.rs,
            b.ptr,
            b.cs,
            b.rs,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `y = W · cols(x)`, `G` samples per product.
fn forward(s: &Shapes, x: &[f32], w: &[f32], y: &mut [f32]) {
    let (k, p, g) = (s.k(), s.p(), s.group());
    let direct = g == 1 && s.identity_cols();
    y.par_chunks_mut(g * s.o * p)
        .zip(x.par_chunks(g * s.x_len()))
        .for_each(|(ys, xs)| {
            Scratch::with(s, !direct, g > 1, |scratch| {
                let gn = xs.len() / s.x_len();
                let cols: &[f32] = if direct {
                    xs
                } else {
                    im2col_group(s, xs, &mut scratch.cols);
                    &scratch.cols
                };
                let a = View::rows(w, k);
                if gn == 1 {
                    matmul(ys, s.o, p, k, a, View::rows(cols, p), false);
                } else {
                    let out = &mut scratch.matrix[..s.o * gn * p];
                    matmul(out, s.o, gn * p, k, a, View::rows(cols, gn * p), false);
                    from_matrix(s, out, ys);
                }
            })
        });
}

/// The input gradient: for stride 1 (and padding inside the kernel) the forward convolution
/// of `dy` by the flipped, transposed kernel with padding `k − 1 − p` — an im2col of row
/// copies and a product with `O·kh·kw` terms — else [`x_backward`]'s product with `O` terms
/// and col2im scatter-add. The first is faster for kernels up to 3×3 into at least 16 input
/// channels (ResNet's 16-channel layers, AlexNet's 3×3 ones); for ResNet's 3-channel stem
/// and AlexNet's 5×5 layer on 4×4 maps the second (`models/examples/conv_ops.rs`).
fn x_backward_any(s: &Shapes, w: &[f32], dy: &[f32], dx: &mut [f32]) {
    let worth_it = s.c >= 16 && s.kh * s.kw <= 9;
    if !(worth_it && s.sh == 1 && s.sw == 1 && s.ph < s.kh && s.pw < s.kw) {
        return x_backward(s, w, dy, dx);
    }
    let (kh, kw) = (s.kh, s.kw);
    // w' [C, O, kh, kw] with w'[c, o, i, j] = w[o, c, kh − 1 − i, kw − 1 − j].
    let mut flipped = vec![0f32; w.len()];
    for o in 0..s.o {
        for c in 0..s.c {
            let src = &w[(o * s.c + c) * kh * kw..][..kh * kw];
            let dst = &mut flipped[(c * s.o + o) * kh * kw..][..kh * kw];
            for (d, v) in dst.iter_mut().zip(src.iter().rev()) {
                *d = *v;
            }
        }
    }
    let transposed = Shapes::new(
        [s.n, s.o, s.oh, s.ow],
        [s.c, kh, kw],
        ConvGeometry {
            stride: [1, 1],
            padding: [kh - 1 - s.ph, kw - 1 - s.pw],
        },
    );
    forward(&transposed, dy, &flipped, dx);
}

/// `dx = col2im(Wᵀ · dy)`, `G` samples per product.
fn x_backward(s: &Shapes, w: &[f32], dy: &[f32], dx: &mut [f32]) {
    let (k, p, g) = (s.k(), s.p(), s.group());
    let direct = g == 1 && s.identity_cols();
    dx.par_chunks_mut(g * s.x_len())
        .zip(dy.par_chunks(g * s.o * p))
        .for_each(|(dxs, dys)| {
            Scratch::with(s, !direct, g > 1, |scratch| {
                let gn = dxs.len() / s.x_len();
                let a = View::transposed(w, k);
                let b = View::rows(dy_matrix(s, dys, &mut scratch.matrix), gn * p);
                if direct {
                    matmul(dxs, k, p, s.o, a, b, false);
                    return;
                }
                let cols = &mut scratch.cols[..k * gn * p];
                matmul(cols, k, gn * p, s.o, a, b, false);
                dxs.fill(0.0);
                for (n, dx_n) in dxs.chunks_mut(s.x_len()).enumerate() {
                    col2im_add(s, cols, gn * p, n * p, dx_n);
                }
            })
        });
}

/// `dW = Σ_n dy_n · cols(x_n)ᵀ`: partial sums over fixed runs of samples (a multiple of `G`,
/// at least [`SAMPLES_PER_PARTIAL`]), then the partials in order — whatever the thread count.
///
/// With at most [`TRANSPOSED_WEIGHT_GRAD_MAX_O`] output channels each product is computed
/// transposed, `dWᵀ [K × O] += cols [K × G·P] · dyᵀ [G·P × O]`: `gemm` then runs it with the
/// few output channels as its micro-kernel's rows and reads the column matrix down its
/// columns, about 2.5× faster on ResNet-20's 16-channel layers; with hundreds of channels
/// (AlexNet) the direct product is faster (`models/examples/conv_ops.rs`).
fn weight_backward(s: &Shapes, x: &[f32], dy: &[f32], dw: &mut [f32]) {
    let (k, p, g) = (s.k(), s.p(), s.group());
    let direct = g == 1 && s.identity_cols();
    let run = g * SAMPLES_PER_PARTIAL.div_ceil(g);
    let partials: Vec<Vec<f32>> = x
        .par_chunks(run * s.x_len())
        .zip(dy.par_chunks(run * s.o * p))
        .map(|(xs, dys)| {
            Scratch::with(s, !direct, g > 1, |scratch| {
                let mut part = vec![0f32; k * s.o];
                let transposed = s.o <= TRANSPOSED_WEIGHT_GRAD_MAX_O;
                let groups = xs.chunks(g * s.x_len()).zip(dys.chunks(g * s.o * p));
                for (i, (xg, dyg)) in groups.enumerate() {
                    let gn = xg.len() / s.x_len();
                    let cols: &[f32] = if direct {
                        xg
                    } else {
                        im2col_group(s, xg, &mut scratch.cols);
                        &scratch.cols
                    };
                    let dy_m = dy_matrix(s, dyg, &mut scratch.matrix);
                    let n = gn * p;
                    if transposed {
                        let (a, b) = (View::rows(cols, n), View::transposed(dy_m, n));
                        matmul(&mut part, k, s.o, n, a, b, i > 0);
                    } else {
                        let (a, b) = (View::rows(dy_m, n), View::transposed(cols, n));
                        matmul(&mut part, s.o, k, n, a, b, i > 0);
                    }
                }
                part
            })
        })
        .collect();
    dw.fill(0.0);
    for part in &partials {
        if s.o <= TRANSPOSED_WEIGHT_GRAD_MAX_O {
            for (o, row) in dw.chunks_mut(k).enumerate() {
                for (r, d) in row.iter_mut().enumerate() {
                    *d += part[r * s.o + o];
                }
            }
        } else {
            for (d, v) in dw.iter_mut().zip(part) {
                *d += v;
            }
        }
    }
}

/// One thread's buffers: the column matrix of a group and its output-sized matrix.
///
/// Kept per thread across calls and only grown: a fresh zeroed pair per rayon split and per
/// layer cost an allocation and a memset of up to `K × G·P` values each time, which
/// [`im2col`] then overwrote entirely. Every user writes the part it reads first
/// ([`im2col_group`], [`dy_matrix`], or a product that does not accumulate), so stale values
/// from another layer are never read.
#[derive(Default)]
struct Scratch {
    cols: Vec<f32>,
    matrix: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

impl Scratch {
    /// Runs `f` with this thread's scratch, at least as large as shape `s` needs (`cols`:
    /// the column matrix, `matrix`: the `O × G·P` one). `f` must not start parallel work:
    /// a task stolen onto this thread while `f` runs would find the scratch borrowed.
    fn with<R>(s: &Shapes, cols: bool, matrix: bool, f: impl FnOnce(&mut Scratch) -> R) -> R {
        SCRATCH.with(|cell| {
            let mut scratch = cell.borrow_mut();
            let columns = s.group() * s.p();
            let need = |wanted: bool, len: usize| if wanted { len } else { 0 };
            let (c, m) = (need(cols, s.k() * columns), need(matrix, s.o * columns));
            if scratch.cols.len() < c {
                scratch.cols.resize(c, 0.0);
            }
            if scratch.matrix.len() < m {
                scratch.matrix.resize(m, 0.0);
            }
            f(&mut scratch)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use burn::nn::conv::Conv2dConfig;

    use crate::kernel_tests::{assert_close, host, output_and_grads, values};

    /// The tests' tolerance, relative to the largest value.
    const TOL: f32 = 1e-5;

    /// A layer with deterministic weights and bias.
    fn layer(c: usize, o: usize, k: [usize; 2], stride: [usize; 2], pad: [usize; 2]) -> Conv2d {
        let device = Device::flex().autodiff();
        let mut l = Conv2dConfig::new([c, o], k)
            .with_stride(stride)
            .with_padding(PaddingConfig2d::Explicit(pad[0], pad[1], pad[0], pad[1]))
            .init(&device);
        let w = Tensor::<4>::from_data(
            TensorData::new(values(o * c * k[0] * k[1], 3), [o, c, k[0], k[1]]),
            &device,
        );
        l.weight = Param::from_tensor(w);
        l.bias = Some(Param::from_tensor(Tensor::<1>::from_data(
            TensorData::new(values(o, 4), [o]),
            &device,
        )));
        l
    }

    /// `(y, dx, dW, db)` of `L = Σ y ⊙ g` through this module or through burn's `forward`.
    fn run(layer: &Conv2d, x_dims: [usize; 4], ours: bool) -> [Vec<f32>; 4] {
        let device = Device::flex().autodiff();
        let n: usize = x_dims.iter().product();
        let x =
            Tensor::<4>::from_data(TensorData::new(values(n, 1), x_dims), &device).require_grad();
        let y = if ours {
            conv2d(layer, x.clone())
        } else {
            layer.forward(x.clone())
        };
        let bias = layer.bias.as_ref().expect("bias").val();
        output_and_grads(y, &x, layer.weight.val(), bias)
    }

    #[test]
    fn matches_burns_convolution_and_its_gradients() {
        // The zoo's shapes and the corner cases
        // (strides 2 and 4, asymmetric kernels, 1×1 with and without stride, padding
        // wider than the kernel's reach, one output row).
        /// `(C, O, kernel, stride, padding, input dims)`.
        type Case = (usize, usize, [usize; 2], [usize; 2], [usize; 2], [usize; 4]);
        let cases: &[Case] = &[
            (3, 16, [3, 3], [1, 1], [1, 1], [5, 3, 8, 8]),
            (16, 32, [3, 3], [2, 2], [1, 1], [4, 16, 9, 9]),
            (4, 6, [1, 1], [1, 1], [0, 0], [3, 4, 5, 7]),
            (4, 6, [1, 1], [2, 2], [0, 0], [3, 4, 6, 6]),
            (3, 5, [5, 5], [1, 1], [2, 2], [2, 3, 7, 6]),
            (3, 4, [11, 11], [4, 4], [2, 2], [2, 3, 23, 23]),
            (2, 3, [3, 1], [1, 2], [0, 3], [6, 2, 5, 4]),
            (2, 3, [3, 3], [1, 1], [0, 0], [9, 2, 3, 3]),
            // More output channels than TRANSPOSED_WEIGHT_GRAD_MAX_O: dW untransposed.
            (5, 80, [3, 3], [1, 1], [1, 1], [3, 5, 4, 4]),
            // ResNet-50's last stage at CIFAR size: 1×1 maps, two samples.
            (8, 16, [1, 1], [1, 1], [0, 0], [2, 8, 1, 1]),
            (8, 16, [3, 3], [1, 1], [1, 1], [2, 8, 1, 1]),
            (8, 16, [1, 1], [2, 2], [0, 0], [2, 8, 2, 2]),
            (8, 16, [3, 3], [2, 2], [1, 1], [2, 8, 2, 2]),
        ];
        for &(c, o, k, stride, pad, x) in cases {
            let l = layer(c, o, k, stride, pad);
            let [y, dx, dw, db] = run(&l, x, true);
            let [y_ref, dx_ref, dw_ref, db_ref] = run(&l, x, false);
            let what = format!("C={c} O={o} k={k:?} s={stride:?} p={pad:?} x={x:?}");
            assert_close(&y, &y_ref, TOL, &format!("y {what}"));
            assert_close(&dx, &dx_ref, TOL, &format!("dx {what}"));
            assert_close(&dw, &dw_ref, TOL, &format!("dW {what}"));
            assert_close(&db, &db_ref, TOL, &format!("db {what}"));
        }
    }

    #[test]
    fn im2col_equals_its_definition() {
        // The shifted-copy path (stride 1, output as wide as the input) and the row-by-row
        // path, against `cols[(c, i, j), oh·OW + ow] = x[c, oh·sh + i − ph, ow·sw + j − pw]`
        // (zero outside), written at an offset into wider rows as the groups use it.
        /// `(C, H, W, kernel, stride, padding)`.
        type Case = (usize, usize, usize, [usize; 2], [usize; 2], [usize; 2]);
        let cases: &[Case] = &[
            (2, 5, 6, [3, 3], [1, 1], [1, 1]),
            (2, 4, 4, [5, 5], [1, 1], [2, 2]),
            (1, 3, 5, [3, 3], [1, 1], [3, 1]),
            (2, 7, 4, [5, 3], [1, 1], [0, 1]),
            (1, 1, 1, [3, 3], [1, 1], [1, 1]),
            (1, 2, 3, [1, 1], [1, 1], [0, 0]),
            (2, 6, 6, [3, 3], [2, 2], [1, 1]),
            (1, 5, 5, [3, 1], [1, 2], [0, 3]),
            (2, 13, 15, [11, 11], [4, 4], [2, 2]),
        ];
        for &(c, h, w, [kh, kw], stride, padding) in cases {
            let s = Shapes::new([1, c, h, w], [1, kh, kw], ConvGeometry { stride, padding });
            let x = values(c * h * w, 3);
            let (p, off) = (s.p(), 3);
            let ld = p + off + 2;
            let mut cols = vec![f32::NAN; s.k() * ld];
            im2col(&s, &x, &mut cols, ld, off);
            for ((ci, i), j) in (0..c)
                .flat_map(|ci| (0..kh).map(move |i| (ci, i)))
                .flat_map(|ci_i| (0..kw).map(move |j| (ci_i, j)))
            {
                for oh in 0..s.oh {
                    for ow in 0..s.ow {
                        let ih = (oh * s.sh + i) as isize - s.ph as isize;
                        let iw = (ow * s.sw + j) as isize - s.pw as isize;
                        let inside = (0..h as isize).contains(&ih) && (0..w as isize).contains(&iw);
                        let want = if inside {
                            x[ci * h * w + ih as usize * w + iw as usize]
                        } else {
                            0.0
                        };
                        let got = cols[((ci * kh + i) * kw + j) * ld + off + oh * s.ow + ow];
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "case {:?} at c={ci} i={i} j={j} oh={oh} ow={ow}",
                            (c, h, w, [kh, kw], stride, padding)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_layer_path_runs_these_kernels() {
        // Through `conv2d` on an autodiff Flex device, the output and both gradients are the
        // bits of the slice kernels themselves (without a bias, which adds a rounding step).
        let mut l = layer(3, 5, [3, 3], [2, 1], [1, 2]);
        l.bias = None;
        let x_dims = [3, 3, 7, 6];
        let device = Device::flex().autodiff();
        let xv = values(x_dims.iter().product(), 1);
        let x = Tensor::<4>::from_data(TensorData::new(xv.clone(), x_dims), &device).require_grad();
        let y = conv2d(&l, x.clone());
        let gv = values(y.dims().iter().product(), 2);
        let g = Tensor::<4>::from_data(TensorData::new(gv.clone(), y.dims()), &device);
        let grads = (y.clone() * g).sum().backward();
        let s = Shapes::new(
            x_dims,
            [5, 3, 3],
            ConvGeometry {
                stride: [2, 1],
                padding: [1, 2],
            },
        );
        let wv = host(l.weight.val().without_autodiff());
        let mut want_y = vec![0f32; s.n * s.o * s.p()];
        forward(&s, &xv, &wv, &mut want_y);
        let mut want_dx = vec![0f32; xv.len()];
        x_backward(&s, &wv, &gv, &mut want_dx);
        let mut want_dw = vec![0f32; wv.len()];
        weight_backward(&s, &xv, &gv, &mut want_dw);
        assert_eq!(host(y.without_autodiff()), want_y);
        assert_eq!(host(x.grad(&grads).expect("dx")), want_dx);
        assert_eq!(host(l.weight.val().grad(&grads).expect("dW")), want_dw);
    }

    #[test]
    fn weight_gradient_bits_do_not_depend_on_the_thread_count() {
        let l = layer(3, 8, [3, 3], [1, 1], [1, 1]);
        let [.., dw_default, _] = run(&l, [11, 3, 6, 6], true);
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("pool");
        let [.., dw_one, _] = one.install(|| run(&l, [11, 3, 6, 6], true));
        let three = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("pool");
        let [.., dw_three, _] = three.install(|| run(&l, [11, 3, 6, 6], true));
        assert_eq!(dw_one, dw_default);
        assert_eq!(dw_one, dw_three);
    }

    #[test]
    fn uncovered_geometries_fall_back_to_burn() {
        let device = Device::flex();
        let grouped = Conv2dConfig::new([4, 4], [3, 3])
            .with_groups(2)
            .init(&device);
        assert_eq!(layer_geometry(&grouped), None);
        let dilated = Conv2dConfig::new([2, 2], [3, 3])
            .with_dilation([2, 2])
            .init(&device);
        assert_eq!(layer_geometry(&dilated), None);
        let asymmetric = Conv2dConfig::new([2, 2], [3, 3])
            .with_padding(PaddingConfig2d::Explicit(1, 0, 0, 0))
            .init(&device);
        assert_eq!(layer_geometry(&asymmetric), None);
        let x = Tensor::<4>::from_data(TensorData::new(values(128, 5), [2, 4, 4, 4]), &device);
        assert_eq!(host(conv2d(&grouped, x.clone())), host(grouped.forward(x)));
        let same = Conv2dConfig::new([2, 2], [3, 3])
            .with_padding(PaddingConfig2d::Same)
            .init(&device);
        assert_eq!(
            layer_geometry(&same),
            Some(ConvGeometry {
                stride: [1, 1],
                padding: [1, 1]
            })
        );
    }

    #[test]
    fn untracked_inputs_work() {
        let device = Device::flex();
        let l = Conv2dConfig::new([2, 3], [3, 3])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
            .init(&device);
        let x = Tensor::<4>::from_data(
            TensorData::new(values(2 * 2 * 5 * 5, 6), [2, 2, 5, 5]),
            &device,
        );
        assert_close(
            &host(conv2d(&l, x.clone())),
            &host(l.forward(x)),
            TOL,
            "untracked",
        );
    }
}
