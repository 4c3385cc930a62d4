//! VGG-11/13/16/19 (Simonyan & Zisserman 2015), with or without BatchNorm.
//!
//! Two heads: [`VggHead::ImageNet`] is torchvision's (7×7 adaptive average pooling, then
//! 25088-4096-4096-classes with dropout; VGG-16 has 138.4 M parameters at 1000 classes);
//! [`VggHead::Cifar`] is the compact head used for 32×32 inputs (one linear layer from the
//! 512 channels of the last 1×1 feature map, as in the CIFAR VGGs of the compression papers).

use burn::nn::conv::Conv2d;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d};
use burn::nn::{BatchNorm, Dropout, DropoutConfig, Linear, LinearConfig, Relu};
use burn::prelude::*;

use serde::{Deserialize, Serialize};

use crate::batch_norm as bn;
use crate::family::{autodiff, ModelFamily};
use crate::flat::ParamTable;
use crate::gemm_conv::conv2d;
use crate::layers::{batch_norm, check_dropout, check_positive, conv, max_pool};
use crate::matmul::linear;
use crate::model::{ImageClassifier, ImageModel, InputSpec, Model};
use crate::torch_names::{classifier_name, count_indexed, reindex, TorchLayout};
use crate::ModelError;

/// Depth of the network (number of weight layers); registry names `vgg11` … `vgg19`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VggDepth {
    /// Configuration A.
    Vgg11,
    /// Configuration B.
    Vgg13,
    /// Configuration D.
    Vgg16,
    /// Configuration E.
    Vgg19,
}

impl VggDepth {
    /// Convolution widths; `0` marks a 2×2 max pool.
    fn layers(self) -> &'static [usize] {
        match self {
            VggDepth::Vgg11 => &[64, 0, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0],
            VggDepth::Vgg13 => &[
                64, 64, 0, 128, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0,
            ],
            VggDepth::Vgg16 => &[
                64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0,
            ],
            VggDepth::Vgg19 => &[
                64, 64, 0, 128, 128, 0, 256, 256, 256, 256, 0, 512, 512, 512, 512, 0, 512, 512,
                512, 512, 0,
            ],
        }
    }
}

/// Classifier head; registry names `cifar`, `imagenet`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum VggHead {
    /// One linear layer on the flattened last feature map (for CIFAR-sized inputs).
    #[serde(rename = "cifar")]
    Cifar,
    /// 7×7 adaptive average pooling, then 25088-4096-4096-classes with dropout.
    #[serde(rename = "imagenet")]
    ImageNet,
}

/// Configuration of [`Vgg`].
#[derive(Debug, Clone, PartialEq)]
pub struct VggConfig {
    /// Depth.
    pub depth: VggDepth,
    /// BatchNorm after every convolution (convolutions then have no bias).
    pub batch_norm: bool,
    /// Classifier head.
    pub head: VggHead,
    /// Input channels.
    pub in_channels: usize,
    /// Input height and width (a multiple of 32).
    pub image_size: usize,
    /// Number of classes.
    pub num_classes: usize,
    /// Dropout in the ImageNet head.
    pub dropout: f64,
}

impl VggConfig {
    /// ImageNet VGG of the given depth (3×224×224, 1000 classes, no BatchNorm).
    pub fn new(depth: VggDepth) -> Self {
        Self {
            depth,
            batch_norm: false,
            head: VggHead::ImageNet,
            in_channels: 3,
            image_size: 224,
            num_classes: 1000,
            dropout: 0.5,
        }
    }

    /// VGG-11 (ImageNet).
    pub fn vgg11() -> Self {
        Self::new(VggDepth::Vgg11)
    }
    /// VGG-13 (ImageNet).
    pub fn vgg13() -> Self {
        Self::new(VggDepth::Vgg13)
    }
    /// VGG-16 (ImageNet, 138 357 544 parameters).
    pub fn vgg16() -> Self {
        Self::new(VggDepth::Vgg16)
    }
    /// VGG-19 (ImageNet).
    pub fn vgg19() -> Self {
        Self::new(VggDepth::Vgg19)
    }
    /// VGG-11 with BatchNorm (ImageNet).
    pub fn vgg11_bn() -> Self {
        Self::vgg11().with_batch_norm(true)
    }
    /// VGG-13 with BatchNorm (ImageNet).
    pub fn vgg13_bn() -> Self {
        Self::vgg13().with_batch_norm(true)
    }
    /// VGG-16 with BatchNorm (ImageNet).
    pub fn vgg16_bn() -> Self {
        Self::vgg16().with_batch_norm(true)
    }
    /// VGG-19 with BatchNorm (ImageNet).
    pub fn vgg19_bn() -> Self {
        Self::vgg19().with_batch_norm(true)
    }

    /// Returns the config with BatchNorm switched on or off.
    pub fn with_batch_norm(mut self, batch_norm: bool) -> Self {
        self.batch_norm = batch_norm;
        self
    }

    /// Returns the config for CIFAR-sized inputs: 3×32×32, compact head, `num_classes`.
    pub fn cifar(mut self, num_classes: usize) -> Self {
        self.head = VggHead::Cifar;
        self.image_size = 32;
        self.num_classes = num_classes;
        self
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
        check_positive("num_classes", self.num_classes)?;
        check_dropout(self.dropout)?;
        if self.image_size == 0 || !self.image_size.is_multiple_of(32) {
            return Err(ModelError::Config(format!(
                "VGG needs an image size that is a positive multiple of 32, got {}",
                self.image_size
            )));
        }
        Ok(())
    }

    /// Builds the module on `device`.
    ///
    /// # Panics
    ///
    /// Panics if the configuration is invalid (see [`VggConfig::validate`]).
    pub fn init(&self, device: &Device) -> Vgg {
        self.validate().expect("invalid VGG config");
        let (mut features, mut norms, mut pool_after) = (Vec::new(), Vec::new(), Vec::new());
        let mut c_in = self.in_channels;
        for &width in self.depth.layers() {
            if width == 0 {
                if let Some(last) = pool_after.last_mut() {
                    *last = true;
                }
                continue;
            }
            features.push(conv(c_in, width, 3, 1, 1, !self.batch_norm, device));
            if self.batch_norm {
                norms.push(batch_norm(width, device));
            }
            pool_after.push(false);
            c_in = width;
        }
        let side = self.image_size / 32;
        let widths: Vec<usize> = match self.head {
            VggHead::Cifar => vec![512 * side * side, self.num_classes],
            VggHead::ImageNet => vec![512 * 7 * 7, 4096, 4096, self.num_classes],
        };
        Vgg {
            features,
            norms,
            pool_after,
            pool: max_pool(2, 2, 0),
            avgpool: (self.head == VggHead::ImageNet)
                .then(|| AdaptiveAvgPool2dConfig::new([7, 7]).init()),
            classifier: widths
                .windows(2)
                .map(|w| LinearConfig::new(w[0], w[1]).init(device))
                .collect(),
            dropout: DropoutConfig::new(self.dropout).init(),
            activation: Relu::new(),
        }
    }
}

/// VGG. Parameters: `features.{i}` (convolutions), `norms.{i}` (BatchNorm `gamma`/`beta`;
/// buffers `running_mean`/`running_var`), `classifier.{i}` (linear layers).
#[derive(Module, Debug)]
pub struct Vgg {
    features: Vec<Conv2d>,
    norms: Vec<BatchNorm>,
    pool_after: Vec<bool>,
    pool: MaxPool2d,
    avgpool: Option<AdaptiveAvgPool2d>,
    classifier: Vec<Linear>,
    dropout: Dropout,
    activation: Relu,
}

impl ImageClassifier for Vgg {
    /// # Shapes
    ///
    /// - `images`: `[batch, channels, image_size, image_size]`
    /// - output: `[batch, num_classes]`
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let mut x = images;
        for (i, layer) in self.features.iter().enumerate() {
            x = conv2d(layer, x);
            if let Some(norm) = self.norms.get(i) {
                x = bn::forward(norm, x);
            }
            x = self.activation.forward(x);
            if self.pool_after[i] {
                x = self.pool.forward(x);
            }
        }
        if let Some(avgpool) = &self.avgpool {
            x = avgpool.forward(x);
        }
        let mut x = x.flatten::<2>(1, 3);
        let last = self.classifier.len() - 1;
        for (i, layer) in self.classifier.iter().enumerate() {
            x = linear(layer, x);
            if i < last {
                x = self.dropout.forward(self.activation.forward(x));
            }
        }
        x
    }
}

/// Registry spec of `kind = "vgg"`. The head defaults to `cifar` (3×32×32, 10 classes);
/// with `head = "imagenet"` the defaults are 3×224×224 and 1000 classes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VggSpec {
    /// `vgg11`, `vgg13`, `vgg16` or `vgg19`.
    pub variant: VggDepth,
    /// BatchNorm after every convolution (false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_norm: Option<bool>,
    /// `cifar` (default) or `imagenet`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head: Option<VggHead>,
    /// Input channels (3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_channels: Option<usize>,
    /// Input height and width, a multiple of 32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_size: Option<usize>,
    /// Number of classes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_classes: Option<usize>,
    /// Dropout in the ImageNet head (0.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
}

impl VggSpec {
    /// The resolved configuration.
    pub fn config(&self) -> VggConfig {
        let mut base = VggConfig::new(self.variant);
        if self.head.unwrap_or(VggHead::Cifar) == VggHead::Cifar {
            base = base.cifar(10);
        }
        VggConfig {
            batch_norm: self.batch_norm.unwrap_or(base.batch_norm),
            in_channels: self.in_channels.unwrap_or(base.in_channels),
            image_size: self.image_size.unwrap_or(base.image_size),
            num_classes: self.num_classes.unwrap_or(base.num_classes),
            dropout: self.dropout.unwrap_or(base.dropout),
            ..base
        }
    }
}

impl ModelFamily for VggSpec {
    const VARIANTS: &'static [&'static str] = &["vgg11", "vgg13", "vgg16", "vgg19"];
    const SUMMARY: &'static str =
        "VGG-11/13/16/19, optional BatchNorm, compact CIFAR head or torchvision ImageNet head";

    /// torchvision's names with the ImageNet head (`features.{k}` counting every
    /// convolution, BatchNorm, ReLU and pool; `classifier.{0,3,6}`); the twin's with the
    /// CIFAR head (`features.{i}`, `norms.{i}`, a single `classifier`).
    fn torch_layout(&self, table: &ParamTable) -> Result<TorchLayout, ModelError> {
        let config = self.config();
        let torchvision = config.head == VggHead::ImageNet;
        // torchvision's index of each convolution.
        let mut at = Vec::new();
        let mut k = 0;
        for &width in config.depth.layers() {
            if width == 0 {
                k += 1;
            } else {
                at.push(k);
                k += if config.batch_norm { 3 } else { 2 };
            }
        }
        let conv_at = |i: usize, shift: usize| at.get(i).map_or(i, |k| k + shift);
        let head = count_indexed(table, "classifier");
        Ok(TorchLayout::generic(table, |path| {
            let module = |name: &str, shift: usize| {
                reindex(path, name, |i| {
                    if torchvision {
                        format!("features.{}", conv_at(i, shift))
                    } else {
                        format!("{name}.{i}")
                    }
                })
            };
            module("features", 0)
                .or_else(|| module("norms", 1))
                .or_else(|| reindex(path, "classifier", |i| classifier_name(i, head, [0, 3, 6])))
                .unwrap_or_else(|| path.to_string())
        }))
    }

    fn build(&self, device: &Device) -> Result<Box<dyn Model>, ModelError> {
        let config = self.config();
        config.validate()?;
        let device = autodiff(device);
        let module = config.init(&device);
        let depth = match self.variant {
            VggDepth::Vgg11 => "vgg11",
            VggDepth::Vgg13 => "vgg13",
            VggDepth::Vgg16 => "vgg16",
            VggDepth::Vgg19 => "vgg19",
        };
        let name = if config.batch_norm {
            format!("{depth}-bn")
        } else {
            depth.to_string()
        };
        Ok(Box::new(ImageModel::new(
            name,
            module,
            config.input(),
            &device,
        )))
    }
}
