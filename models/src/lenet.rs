//! LeNet-5 (LeCun et al. 1998) with ReLU and max pooling, as commonly trained today.

use burn::nn::conv::Conv2d;
use burn::nn::pool::MaxPool2d;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::prelude::*;

use serde::{Deserialize, Serialize};

use crate::family::{autodiff, ModelFamily};
use crate::gemm_conv::conv2d;
use crate::layers::{check_positive, conv, max_pool};
use crate::matmul::linear;
use crate::model::{ImageClassifier, ImageModel, InputSpec, Model};
use crate::ModelError;

/// Configuration of [`LeNet5`]: conv 5×5 (6, padding 2) → pool → conv 5×5 (16) → pool →
/// 120 → 84 → `num_classes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeNet5Config {
    /// Input channels.
    pub in_channels: usize,
    /// Input height and width (at least 12).
    pub image_size: usize,
    /// Number of classes.
    pub num_classes: usize,
}

impl LeNet5Config {
    /// MNIST-shaped LeNet-5 (1×28×28, 10 classes; 61 706 parameters).
    pub fn mnist() -> Self {
        Self {
            in_channels: 1,
            image_size: 28,
            num_classes: 10,
        }
    }

    /// What the model consumes.
    pub fn input(&self) -> InputSpec {
        InputSpec::Images {
            channels: self.in_channels,
            height: self.image_size,
            width: self.image_size,
            num_classes: self.num_classes,
        }
    }

    /// Side of the last feature map.
    fn feature_size(&self) -> usize {
        (self.image_size / 2).saturating_sub(4) / 2
    }

    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ModelError> {
        check_positive("in_channels", self.in_channels)?;
        check_positive("num_classes", self.num_classes)?;
        if self.image_size < 12 {
            return Err(ModelError::Config(format!(
                "LeNet-5 needs images of at least 12×12, got {}",
                self.image_size
            )));
        }
        Ok(())
    }

    /// Builds the module on `device`.
    ///
    /// # Panics
    ///
    /// Panics if the configuration is invalid (see [`LeNet5Config::validate`]).
    pub fn init(&self, device: &Device) -> LeNet5 {
        self.validate().expect("invalid LeNet-5 config");
        let s = self.feature_size();
        LeNet5 {
            conv1: conv(self.in_channels, 6, 5, 1, 2, true, device),
            conv2: conv(6, 16, 5, 1, 0, true, device),
            fc1: LinearConfig::new(16 * s * s, 120).init(device),
            fc2: LinearConfig::new(120, 84).init(device),
            fc3: LinearConfig::new(84, self.num_classes).init(device),
            pool: max_pool(2, 2, 0),
            activation: Relu::new(),
        }
    }
}

/// LeNet-5. Parameters: `conv1`, `conv2`, `fc1`, `fc2`, `fc3` (`.weight`, `.bias`).
#[derive(Module, Debug)]
pub struct LeNet5 {
    conv1: Conv2d,
    conv2: Conv2d,
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
    pool: MaxPool2d,
    activation: Relu,
}

impl ImageClassifier for LeNet5 {
    /// # Shapes
    ///
    /// - `images`: `[batch, channels, image_size, image_size]`
    /// - output: `[batch, num_classes]`
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let relu = &self.activation;
        let x = self.pool.forward(relu.forward(conv2d(&self.conv1, images)));
        let x = self.pool.forward(relu.forward(conv2d(&self.conv2, x)));
        let x = x.flatten::<2>(1, 3);
        let x = relu.forward(linear(&self.fc1, x));
        let x = relu.forward(linear(&self.fc2, x));
        linear(&self.fc3, x)
    }
}

/// Registry spec of `kind = "lenet"`: `variant = "lenet5"` (1×28×28, 10 classes).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LeNet5Spec {
    /// `lenet5` (the default).
    pub variant: LeNetVariant,
    /// Input channels (1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_channels: Option<usize>,
    /// Input height and width (28).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_size: Option<usize>,
    /// Number of classes (10).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_classes: Option<usize>,
}

/// LeNet variants.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LeNetVariant {
    /// LeNet-5.
    #[default]
    Lenet5,
}

impl LeNet5Spec {
    /// The resolved configuration.
    pub fn config(&self) -> LeNet5Config {
        let base = LeNet5Config::mnist();
        LeNet5Config {
            in_channels: self.in_channels.unwrap_or(base.in_channels),
            image_size: self.image_size.unwrap_or(base.image_size),
            num_classes: self.num_classes.unwrap_or(base.num_classes),
        }
    }
}

impl ModelFamily for LeNet5Spec {
    const VARIANTS: &'static [&'static str] = &["lenet5"];
    const SUMMARY: &'static str = "LeNet-5 (ReLU, max pooling), MNIST-sized by default";

    fn build(&self, device: &Device) -> Result<Box<dyn Model>, ModelError> {
        let config = self.config();
        config.validate()?;
        let device = autodiff(device);
        let module = config.init(&device);
        Ok(Box::new(ImageModel::new(
            "lenet5",
            module,
            config.input(),
            &device,
        )))
    }
}
