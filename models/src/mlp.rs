//! Multi-layer perceptron over flattened images.

use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig, Relu};
use burn::prelude::*;

use serde::{Deserialize, Serialize};

use crate::family::{autodiff, ModelFamily};
use crate::layers::{check_dropout, check_positive};
use crate::meprop::meprop_forward;
use crate::model::{ImageClassifier, ImageModel, InputSpec, Model};
use crate::ModelError;

/// Configuration of an [`Mlp`]: `in_channels × image_size²` inputs → `hidden` (ReLU, dropout)
/// → `num_classes` logits.
#[derive(Debug, Clone, PartialEq)]
pub struct MlpConfig {
    /// Input channels.
    pub in_channels: usize,
    /// Input height and width.
    pub image_size: usize,
    /// Hidden layer widths, in order.
    pub hidden: Vec<usize>,
    /// Number of classes.
    pub num_classes: usize,
    /// Dropout after each hidden layer.
    pub dropout: f64,
    /// meProp (ALGORITHMS.md §11): when set, every layer with more than `k` outputs
    /// back-propagates through only its `k` output columns with the largest `Σ |∂L/∂y|`
    /// (unified mode, one column set per minibatch); `None` is ordinary backprop.
    pub meprop_k: Option<usize>,
}

impl MlpConfig {
    /// The MNIST classic: 784-512-256-10, no dropout (535 818 parameters).
    pub fn mnist() -> Self {
        Self {
            in_channels: 1,
            image_size: 28,
            hidden: vec![512, 256],
            num_classes: 10,
            dropout: 0.0,
            meprop_k: None,
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

    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ModelError> {
        check_positive("in_channels", self.in_channels)?;
        check_positive("image_size", self.image_size)?;
        check_positive("num_classes", self.num_classes)?;
        for &h in &self.hidden {
            check_positive("hidden width", h)?;
        }
        if let Some(k) = self.meprop_k {
            check_positive("meprop_k", k)?;
        }
        check_dropout(self.dropout)
    }

    /// Builds the module on `device`.
    ///
    /// # Panics
    ///
    /// Panics if the configuration is invalid (see [`MlpConfig::validate`]).
    pub fn init(&self, device: &Device) -> Mlp {
        self.validate().expect("invalid MLP config");
        let mut widths = vec![self.in_channels * self.image_size * self.image_size];
        widths.extend(&self.hidden);
        widths.push(self.num_classes);
        Mlp {
            layers: widths
                .windows(2)
                .map(|w| LinearConfig::new(w[0], w[1]).init(device))
                .collect(),
            dropout: DropoutConfig::new(self.dropout).init(),
            activation: Relu::new(),
            meprop_k: self.meprop_k,
        }
    }
}

/// Multi-layer perceptron. Parameters: `layers.{i}.weight` `[d_in, d_out]`, `layers.{i}.bias`.
#[derive(Module, Debug)]
pub struct Mlp {
    layers: Vec<Linear>,
    dropout: Dropout,
    activation: Relu,
    #[module(skip)]
    meprop_k: Option<usize>,
}

impl ImageClassifier for Mlp {
    /// Flattens the images and applies the layers.
    ///
    /// # Shapes
    ///
    /// - `images`: `[batch, channels, height, width]`
    /// - output: `[batch, num_classes]`
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let mut x = images.flatten::<2>(1, 3);
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            x = match self.meprop_k {
                Some(k) => meprop_forward(layer, x, k),
                None => crate::matmul::linear(layer, x),
            };
            if i < last {
                x = self.dropout.forward(self.activation.forward(x));
            }
        }
        x
    }
}

/// Registry spec of `kind = "mlp"`: `variant = "mnist"` (784-512-256-10); every option
/// overrides the variant's value.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MlpSpec {
    /// `mnist` (the default).
    pub variant: MlpVariant,
    /// Input channels (1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_channels: Option<usize>,
    /// Input height and width (28).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_size: Option<usize>,
    /// Number of classes (10).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_classes: Option<usize>,
    /// Hidden widths (`[512, 256]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hidden: Option<Vec<usize>>,
    /// Dropout after each hidden layer (0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
    /// meProp's `k` (ALGORITHMS.md §11): layers with more outputs back-propagate through their
    /// top-`k` output columns only. Unset: ordinary backprop.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub meprop_k: Option<usize>,
}

/// MLP variants.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MlpVariant {
    /// 784-512-256-10.
    #[default]
    Mnist,
}

impl MlpSpec {
    /// The resolved configuration.
    pub fn config(&self) -> MlpConfig {
        let base = match self.variant {
            MlpVariant::Mnist => MlpConfig::mnist(),
        };
        MlpConfig {
            in_channels: self.in_channels.unwrap_or(base.in_channels),
            image_size: self.image_size.unwrap_or(base.image_size),
            hidden: self.hidden.clone().unwrap_or(base.hidden),
            num_classes: self.num_classes.unwrap_or(base.num_classes),
            dropout: self.dropout.unwrap_or(base.dropout),
            meprop_k: self.meprop_k.or(base.meprop_k),
        }
    }
}

impl ModelFamily for MlpSpec {
    const VARIANTS: &'static [&'static str] = &["mnist"];
    const SUMMARY: &'static str = "multi-layer perceptron over flattened images (ReLU, dropout)";

    fn build(&self, device: &Device) -> Result<Box<dyn Model>, ModelError> {
        let config = self.config();
        config.validate()?;
        let device = autodiff(device);
        let module = config.init(&device);
        Ok(Box::new(ImageModel::new(
            "mlp",
            module,
            config.input(),
            &device,
        )))
    }
}
