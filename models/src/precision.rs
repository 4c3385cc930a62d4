//! TF32 on the CPU: what rounding the operands of every matrix product to TF32 does to a
//! model's loss and gradients, measured without a GPU.
//!
//! burn's CUDA backend multiplies f32 matrices in TF32 on tensor-core GPUs (cubek-matmul
//! promotes f32 operands whenever the device has the type, unless [`set_allow_tf32`] forbids
//! it: `cluster.allow_tf32`): each
//! operand keeps 10 of its 23 mantissa bits, the products accumulate in f32. A GPU's
//! gradients then differ from the CPU's by more than f32 arithmetic in another order would
//! explain, and by how much depends on the model (the cancellation in its sums). With the
//! emulation on, dtrain's own CPU products — [`crate::matmul::MatmulOps::mm`] and the three
//! convolution products of [`crate::gemm_conv::GemmConvOps`] — first convert both operands
//! to TF32, then multiply in f32. A GPU converts in one of two ways, depending on the kernel
//! its autotuner picks: rounding to nearest, ties away from zero (CUDA's `__float_to_tf32`,
//! which cubecl's CUDA C++ emits for a cast, where a kernel's loads cast), or dropping the 13
//! low bits (what the tensor cores do with f32 bits that reach them unconverted, as
//! cubek-matmul's asynchronous loaders leave them: `memcpy_async` copies the f32 bits into
//! the TF32 stage as they are); [`Tf32`] emulates either. `dtrain bench models` runs the reference step once with each, so to say how far
//! TF32 alone moves each model, and derives a GPU's tolerance from it.
//!
//! **Coverage.** The MLP, LeNet-5, AlexNet, VGG and ResNet compute every product through
//! those operations; the LSTM and the GPT multiply in burn's own kernels (its `Linear`,
//! `Lstm` and attention products), which are not converted, so for them the emulation
//! covers only the LSTM's output layer and nothing of the GPT; nor does it cover meProp's
//! top-k products (an MLP with `meprop_k`): [`covers_every_product`].
//!
//! **Process-wide.** The switch is one flag for the whole process, read when an operation
//! starts: every operand multiplied on the CPU while it is on is converted, on every thread.
//! It is for measurements that run one step at a time (the bench), not for a process that
//! trains.

use std::sync::atomic::{AtomicU8, Ordering};

use burn::backend::flex::FlexTensor;
use burn::backend::TensorMetadata;
use burn::tensor::{DType, TensorData};

use crate::ModelSpec;

/// How CPU products treat their f32 operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Tf32 {
    /// As they are: f32 products (the default).
    Off = 0,
    /// Rounded to TF32, to nearest, ties away from zero: [`round_tf32`].
    Nearest = 1,
    /// Cut to TF32, their 13 low mantissa bits dropped: [`truncate_tf32`].
    Truncated = 2,
}

static TF32: AtomicU8 = AtomicU8::new(Tf32::Off as u8);

/// Sets the emulation for the whole process; returns what it was.
pub fn set_tf32_emulation(mode: Tf32) -> Tf32 {
    from_u8(TF32.swap(mode as u8, Ordering::SeqCst))
}

/// What CPU products currently do with their operands.
pub fn tf32_emulation() -> Tf32 {
    from_u8(TF32.load(Ordering::SeqCst))
}

/// Allows (`true`, burn's behaviour and the default) or forbids TF32 in the f32 matrix
/// products and convolutions of burn's GPU backends, for the whole process, as PyTorch's
/// `torch.backends.cuda.matmul.allow_tf32`: forbidden, cubek-matmul (patched by dtrain:
/// `patches/cubek-matmul/PATCH.md`) keeps f32 operands f32 and its tensor-core kernels
/// count as unavailable for them, so the autotuner picks among the f32 kernels. Set it
/// before the first product: a kernel choice already tuned or cached is not revisited.
/// Returns the previous setting. Without a GPU backend in the build (or on a device
/// without TF32: the CPU, Vulkan) nothing multiplies in TF32 either way.
pub fn set_allow_tf32(allow: bool) -> bool {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    {
        cubek_matmul::multi_level::definition::set_allow_tf32(allow)
    }
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    {
        ALLOW_TF32.swap(allow, Ordering::SeqCst)
    }
}

/// The setting of [`set_allow_tf32`].
pub fn allow_tf32() -> bool {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    {
        cubek_matmul::multi_level::definition::allow_tf32()
    }
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    {
        ALLOW_TF32.load(Ordering::SeqCst)
    }
}

/// [`set_allow_tf32`]'s setting in a build without a GPU backend (where it changes nothing).
#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
static ALLOW_TF32: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// The mode stored as `v` (`Tf32 as u8`).
fn from_u8(v: u8) -> Tf32 {
    match v {
        1 => Tf32::Nearest,
        2 => Tf32::Truncated,
        _ => Tf32::Off,
    }
}

/// The TF32 value nearest to `x`, ties away from zero (CUDA's `__float_to_tf32`, PTX
/// `cvt.rna.tf32.f32`), as an f32: the 13 low mantissa bits are zero. A value that rounds
/// past the largest finite TF32 becomes an infinity of its sign; infinities and NaNs stay.
pub fn round_tf32(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    // Adding half of the dropped unit to the magnitude's bits carries into the kept ones
    // exactly when the dropped part is at least half: to nearest, ties away from zero.
    f32::from_bits((x.to_bits() + 0x1000) & !0x1fff)
}

/// `x` with its 13 low mantissa bits dropped: the TF32 value next to it towards zero.
/// Infinities and NaNs stay.
pub fn truncate_tf32(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    f32::from_bits(x.to_bits() & !0x1fff)
}

/// Whether every product of the model `spec` builds goes through the operations the
/// emulation converts (see the [module docs](self)).
pub fn covers_every_product(spec: &ModelSpec) -> bool {
    match spec {
        ModelSpec::Mlp(mlp) => mlp.meprop_k.is_none(),
        other => matches!(other.kind(), "lenet" | "alexnet" | "vgg" | "resnet"),
    }
}

/// `t` with its values converted to TF32 as the emulation says, contiguous, when it is on
/// and `t` holds f32; `t` itself otherwise.
pub(crate) fn operand(t: FlexTensor) -> FlexTensor {
    let convert = match tf32_emulation() {
        Tf32::Off => return t,
        Tf32::Nearest => round_tf32,
        Tf32::Truncated => truncate_tf32,
    };
    if t.dtype() != DType::F32 {
        return t;
    }
    let t = t.to_contiguous();
    let values: Vec<f32> = t.storage::<f32>().iter().map(|&x| convert(x)).collect();
    FlexTensor::from_data(TensorData::new(values, t.shape()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_keeps_ten_mantissa_bits_to_nearest_ties_away() {
        let ulp = 2f32.powi(-10); // TF32's unit at 1.0
        assert_eq!(round_tf32(1.0), 1.0);
        assert_eq!(round_tf32(1.0 + ulp), 1.0 + ulp);
        // Below half a unit: down; at half: away from zero; above: up.
        assert_eq!(round_tf32(1.0 + 0.499 * ulp), 1.0);
        assert_eq!(round_tf32(1.0 + 0.5 * ulp), 1.0 + ulp);
        assert_eq!(round_tf32(-(1.0 + 0.5 * ulp)), -(1.0 + ulp));
        assert_eq!(round_tf32(1.0 + 1.5 * ulp), 1.0 + 2.0 * ulp);
        // A carry into the exponent.
        assert_eq!(round_tf32(2.0 - 0.5 * ulp), 2.0);
        // Subnormals and zeros keep their sign and round on the same grid.
        assert_eq!(round_tf32(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(round_tf32(f32::from_bits(0x0fff)), 0.0);
        assert_eq!(round_tf32(f32::from_bits(0x1000)), f32::from_bits(0x2000));
        // Past the largest TF32: infinity; non-finite values unchanged.
        assert_eq!(round_tf32(f32::MAX), f32::INFINITY);
        assert_eq!(round_tf32(f32::NEG_INFINITY), f32::NEG_INFINITY);
        assert!(round_tf32(f32::NAN).is_nan());
        // Relative error at most half a unit.
        for i in 0..10_000u32 {
            let x = f32::from_bits(0x3f80_0000 + i * 797) * if i % 2 == 0 { 1.0 } else { -3e5 };
            let r = round_tf32(x);
            assert_eq!(r.to_bits() & 0x1fff, 0, "{x}");
            assert!(((r - x) / x).abs() <= 0.5 * ulp, "{x} -> {r}");
        }
    }

    #[test]
    fn truncation_drops_the_low_bits_towards_zero() {
        let ulp = 2f32.powi(-10);
        assert_eq!(truncate_tf32(1.0 + 0.999 * ulp), 1.0);
        assert_eq!(truncate_tf32(-(1.0 + 1.5 * ulp)), -(1.0 + ulp));
        assert_eq!(truncate_tf32(f32::MAX), f32::from_bits(0x7f7f_e000));
        assert_eq!(truncate_tf32(f32::INFINITY), f32::INFINITY);
        assert!(truncate_tf32(f32::NAN).is_nan());
        for i in 0..10_000u32 {
            let x = f32::from_bits(0x3f80_0000 + i * 797) * if i % 2 == 0 { 1.0 } else { -3e5 };
            let t = truncate_tf32(x);
            assert_eq!(t.to_bits() & 0x1fff, 0, "{x}");
            assert!(
                t.abs() <= x.abs() && ((t - x) / x).abs() < ulp,
                "{x} -> {t}"
            );
        }
    }

    #[test]
    fn every_family_is_classified_and_meprop_is_not_covered() {
        for m in crate::MODELS {
            let text = format!(
                r#"{{"kind": "{}", "variant": "{}"}}"#,
                m.kind, m.variants[0]
            );
            let spec: ModelSpec = serde_json::from_str(&text).unwrap();
            let covered = covers_every_product(&spec);
            assert_eq!(covered, !matches!(m.kind, "lstm" | "gpt"), "{}", m.kind);
        }
        let meprop: ModelSpec = serde_json::from_str(r#"{"kind": "mlp", "meprop_k": 8}"#).unwrap();
        assert!(!covers_every_product(&meprop));
    }
}
