//! dtrain's model zoo on burn: MLP, LeNet-5, AlexNet, VGG, ResNet, and two language models
//! (an LSTM and a GPT-style transformer),
//! the [`Model`] trait the trainer drives, flat `f32` views of parameters, gradients and
//! BatchNorm buffers, and a serde registry.
//!
//! This crate is *not* the trainer: it knows nothing of compression, collectives, datasets or
//! optimizers. It turns a batch into a loss and gradients, and moves parameters and buffers
//! in and out of flat buffers quickly; `dtrain-framework` does the rest.
//!
//! # Layout
//!
//! - [`model`]: the [`Model`] trait, [`Batch`], [`Metrics`], the module traits
//!   [`ImageClassifier`] and [`LanguageModel`], and their adapters [`ImageModel`], [`LmModel`].
//! - [`flat`]: [`ParamTable`] (deterministic names, shapes, offsets) and the bulk-copy paths.
//! - one file per family: [`mlp`], [`lenet`], [`alexnet`], [`vgg`], [`resnet`], [`lstm`], [`gpt`],
//!   each with `XConfig` → `init(&device)`, variant constructors and a registry spec.
//! - [`registry`]: [`ModelSpec`] (serde, tagged `kind`) and the static list [`MODELS`].
//! - [`torch_names`]: PyTorch's names and layouts of every model's tensors ([`TorchLayout`]),
//!   for safetensors export and import.
//! - [`synthetic`]: deterministic batches for any model and a device-precision probe.
//! - `cube` (the `cuda` or `wgpu` feature): a GPU tensor's device buffer, for the device
//!   codecs.
//! - `cuda` (the `cuda` feature): opening a GPU, with errors naming what is missing.
//! - `wgpu` (the `wgpu` feature): a GPU that wgpu reaches (Vulkan, Metal, DX12), or Mesa's
//!   software Vulkan (lavapipe) without one.
//!
//! # Example
//!
//! ```
//! use burn::prelude::*;
//! use dtrain_models::{Batch, Model, ModelSpec};
//!
//! let spec: ModelSpec = serde_json::from_str(r#"{"kind": "lenet"}"#).unwrap();
//! let device = Device::flex().autodiff();
//! let mut model = spec.build(&device).unwrap();
//! assert_eq!(model.table().num_params(), 61_706);
//!
//! let images = vec![0.5f32; 2 * 28 * 28];
//! let batch = Batch::images_from_slice(&images, [2, 1, 28, 28], &[3, 7], &device);
//! let mut grads = vec![0.0f32; model.table().num_params()];
//! let metrics = model.forward_backward(batch, &mut grads).unwrap();
//! assert_eq!(metrics.count, 2);
//! assert!(grads.iter().any(|g| *g != 0.0));
//! ```

pub mod alexnet;
pub mod batch_norm;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub mod cube;
#[cfg(feature = "cuda")]
pub mod cuda;
mod family;
pub mod flat;
pub mod gemm_conv;
pub mod gpt;
#[cfg(test)]
mod kernel_tests;
mod layers;
pub mod lenet;
pub mod lstm;
pub mod matmul;
pub mod meprop;
pub mod mlp;
pub mod model;
pub mod pool;
pub mod precision;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod probe;
pub mod registry;
pub mod resnet;
pub mod synthetic;
pub mod torch_names;
pub mod vgg;
pub mod wgpu;

pub use alexnet::{AlexNet, AlexNetConfig, AlexNetVariant};
pub use flat::{ParamEntry, ParamTable, TensorRole};
pub use gpt::{Gpt, GptConfig, GptSpec};
pub use lenet::{LeNet5, LeNet5Config};
pub use lstm::{LstmLm, LstmLmConfig};
pub use mlp::{Mlp, MlpConfig};
pub use model::{
    Batch, ImageClassifier, ImageModel, InputSpec, LanguageModel, LmModel, LossOutput, Metrics,
    Model, ModelError,
};
pub use registry::{model_names, ModelFamily, ModelInfo, ModelSpec, MODELS};
pub use resnet::{ResNet, ResNetConfig, Shortcut};
pub use synthetic::{matmul_rel_err, matmul_rel_err_between, SyntheticBatch};
pub use torch_names::{TorchLayout, TorchTensor, TorchValues};
pub use vgg::{Vgg, VggConfig, VggDepth, VggHead};

/// The burn device type models live on (re-exported so users of this crate need no direct
/// burn dependency).
pub use burn::prelude::Device;

/// A flat `f32` tensor on a model's device: its gradient as [`Model::backward_flat`] leaves
/// it there (re-exported, as [`Device`] is).
pub type FlatTensor = burn::prelude::Tensor<1>;

/// The default training device: burn's `flex` CPU backend with autodiff.
pub fn cpu_device() -> Device {
    Device::flex().autodiff()
}

/// CUDA GPU `index` with autodiff (the `cuda` feature). Everything the GPU needs (driver,
/// its CUDA version, the GPU, NVRTC, the CUDA headers) is checked first and a failure comes
/// back as an error naming what to install; see [`cuda`].
#[cfg(feature = "cuda")]
pub fn cuda_device(index: usize) -> Result<Device, String> {
    cuda::cuda_device(index)
}

/// The wgpu adapter `adapter` names, with autodiff (the `wgpu` feature); an error, never a
/// panic, where the machine has no such adapter. See [`wgpu`].
#[cfg(feature = "wgpu")]
pub fn wgpu_device(adapter: wgpu::Adapter) -> Result<Device, String> {
    wgpu::wgpu_device(adapter)
}
