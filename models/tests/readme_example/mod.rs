//! A two-layer CNN, added to the zoo as one file.

use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use dtrain_models::{ImageClassifier, ImageModel, InputSpec, Model, ModelError, ModelFamily};

/// Configuration: `XConfig` → `init(&device)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TinyCnnConfig {
    /// Input channels.
    pub in_channels: usize,
    /// Input height and width.
    pub image_size: usize,
    /// Width of both convolutions.
    pub width: usize,
    /// Number of classes.
    pub num_classes: usize,
}

impl TinyCnnConfig {
    /// What the model consumes.
    pub fn input(&self) -> InputSpec {
        InputSpec::Images {
            channels: self.in_channels,
            height: self.image_size,
            width: self.image_size,
            num_classes: self.num_classes,
        }
    }

    /// Builds the module.
    pub fn init(&self, device: &Device) -> TinyCnn {
        let conv = |c_in, c_out| {
            Conv2dConfig::new([c_in, c_out], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device)
        };
        TinyCnn {
            conv1: conv(self.in_channels, self.width),
            conv2: conv(self.width, self.width),
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            fc: LinearConfig::new(self.width, self.num_classes).init(device),
            activation: Relu::new(),
        }
    }
}

/// The module: field names become parameter names (`conv1.weight`, `fc.bias`, ...).
#[derive(Module, Debug)]
pub struct TinyCnn {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: AdaptiveAvgPool2d,
    fc: Linear,
    activation: Relu,
}

impl ImageClassifier for TinyCnn {
    /// # Shapes
    ///
    /// - `images`: `[batch, in_channels, image_size, image_size]`
    /// - output: `[batch, num_classes]`
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self.activation.forward(self.conv1.forward(images));
        let x = self.activation.forward(self.conv2.forward(x));
        self.fc.forward(self.pool.forward(x).flatten::<2>(1, 3))
    }
}

/// Registry spec: the keys a TOML `[model]` table with `kind = "tinycnn"` may set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TinyCnnSpec {
    /// Convolution width.
    #[serde(default = "default_width")]
    pub width: usize,
    /// Number of classes.
    #[serde(default = "default_classes")]
    pub num_classes: usize,
}

fn default_width() -> usize {
    16
}

fn default_classes() -> usize {
    10
}

impl ModelFamily for TinyCnnSpec {
    const VARIANTS: &'static [&'static str] = &["tinycnn"];
    const SUMMARY: &'static str = "two 3×3 convolutions, global pooling, one linear layer";

    fn build(&self, device: &Device) -> Result<Box<dyn Model>, ModelError> {
        if self.width == 0 || self.num_classes == 0 {
            return Err(ModelError::Config(
                "width and num_classes must be positive".into(),
            ));
        }
        let device = device.clone().autodiff();
        let config = TinyCnnConfig {
            in_channels: 3,
            image_size: 32,
            width: self.width,
            num_classes: self.num_classes,
        };
        let module = config.init(&device);
        Ok(Box::new(ImageModel::new(
            "tinycnn",
            module,
            config.input(),
            &device,
        )))
    }
}
