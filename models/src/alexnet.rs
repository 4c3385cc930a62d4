//! AlexNet (Krizhevsky et al. 2012) in three sizes, with optional local response
//! normalisation.
//!
//! - [`AlexNetVariant::ImageNet`]: torchvision's single-tower AlexNet (64-192-384-256-256
//!   convolutions, 6×6 adaptive pooling, 9216-4096-4096-classes classifier), 61.1 M parameters
//!   at 1000 classes.
//! - [`AlexNetVariant::Cifar`]: the compact CIFAR AlexNet (11×11 stride-4 first convolution,
//!   one linear layer; 2.47 M parameters), as in `pytorch-classification`.
//! - [`AlexNetVariant::CifarFc`]: CIFAR AlexNet with the large fully connected head
//!   (3×3 stride-2 first convolution, 1024-4096-4096-classes; 23.3 M parameters), the
//!   FC-heavy variant gradient-compression papers train on CIFAR.
//!
//! With `lrn`, LocalResponseNorm (size 5, α 1e-4, β 0.75, k 2, as in the paper) follows the
//! ReLU of the first two convolutions.

use burn::nn::conv::Conv2d;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d};
use burn::nn::{
    Dropout, DropoutConfig, Linear, LinearConfig, LocalResponseNorm, LocalResponseNormConfig, Relu,
};
use burn::prelude::*;

use serde::{Deserialize, Serialize};

use crate::family::{autodiff, ModelFamily};
use crate::flat::ParamTable;
use crate::gemm_conv::conv2d;
use crate::layers::{check_dropout, check_positive, conv, max_pool, out_size};
use crate::matmul::linear;
use crate::model::{ImageClassifier, ImageModel, InputSpec, Model};
use crate::torch_names::{classifier_name, count_indexed, reindex, TorchLayout};
use crate::ModelError;

/// Which AlexNet (registry names `cifar`, `cifar-fc`, `imagenet`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AlexNetVariant {
    /// Compact CIFAR AlexNet (one linear layer).
    #[serde(rename = "cifar")]
    Cifar,
    /// CIFAR AlexNet with the 4096-4096 fully connected head.
    #[serde(rename = "cifar-fc")]
    CifarFc,
    /// torchvision's ImageNet AlexNet.
    #[serde(rename = "imagenet")]
    ImageNet,
}

/// Configuration of [`AlexNet`].
#[derive(Debug, Clone, PartialEq)]
pub struct AlexNetConfig {
    /// Which AlexNet.
    pub variant: AlexNetVariant,
    /// Input channels.
    pub in_channels: usize,
    /// Input height and width.
    pub image_size: usize,
    /// Number of classes.
    pub num_classes: usize,
    /// Local response normalisation after the first two convolutions.
    pub lrn: bool,
    /// Dropout before the hidden fully connected layers (not used by `Cifar`).
    pub dropout: f64,
}

/// Convolutions: (out channels, kernel, stride, padding).
const IMAGENET_CONVS: [(usize, usize, usize, usize); 5] = [
    (64, 11, 4, 2),
    (192, 5, 1, 2),
    (384, 3, 1, 1),
    (256, 3, 1, 1),
    (256, 3, 1, 1),
];
const CIFAR_CONVS: [(usize, usize, usize, usize); 5] = [
    (64, 11, 4, 5),
    (192, 5, 1, 2),
    (384, 3, 1, 1),
    (256, 3, 1, 1),
    (256, 3, 1, 1),
];
const CIFAR_FC_CONVS: [(usize, usize, usize, usize); 5] = [
    (64, 3, 2, 1),
    (192, 3, 1, 1),
    (384, 3, 1, 1),
    (256, 3, 1, 1),
    (256, 3, 1, 1),
];

impl AlexNetConfig {
    /// torchvision's AlexNet: 3×224×224, 1000 classes, no LRN, dropout 0.5.
    pub fn imagenet() -> Self {
        Self {
            variant: AlexNetVariant::ImageNet,
            in_channels: 3,
            image_size: 224,
            num_classes: 1000,
            lrn: false,
            dropout: 0.5,
        }
    }

    /// Compact CIFAR AlexNet: 3×32×32, 10 classes.
    pub fn cifar() -> Self {
        Self {
            variant: AlexNetVariant::Cifar,
            image_size: 32,
            num_classes: 10,
            ..Self::imagenet()
        }
    }

    /// FC-heavy CIFAR AlexNet: 3×32×32, 10 classes, dropout 0.5.
    pub fn cifar_fc() -> Self {
        Self {
            variant: AlexNetVariant::CifarFc,
            ..Self::cifar()
        }
    }

    /// Returns the config with local response normalisation switched on or off.
    pub fn with_lrn(mut self, lrn: bool) -> Self {
        self.lrn = lrn;
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

    fn convs(&self) -> &'static [(usize, usize, usize, usize); 5] {
        match self.variant {
            AlexNetVariant::Cifar => &CIFAR_CONVS,
            AlexNetVariant::CifarFc => &CIFAR_FC_CONVS,
            AlexNetVariant::ImageNet => &IMAGENET_CONVS,
        }
    }

    /// (kernel, stride) of the max pools after convolutions 1, 2 and 5.
    fn pool(&self) -> (usize, usize) {
        match self.variant {
            AlexNetVariant::ImageNet => (3, 2),
            _ => (2, 2),
        }
    }

    /// Side of the feature map entering the classifier, or `None` if the image is too small.
    fn feature_size(&self) -> Option<usize> {
        let (pk, ps) = self.pool();
        let mut s = self.image_size;
        for (i, &(_, k, stride, p)) in self.convs().iter().enumerate() {
            s = out_size(s, k, stride, p).filter(|&s| s > 0)?;
            if matches!(i, 0 | 1 | 4) {
                s = out_size(s, pk, ps, 0).filter(|&s| s > 0)?;
            }
        }
        Some(match self.variant {
            AlexNetVariant::ImageNet => 6,
            _ => s,
        })
    }

    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ModelError> {
        check_positive("in_channels", self.in_channels)?;
        check_positive("num_classes", self.num_classes)?;
        check_dropout(self.dropout)?;
        if self.feature_size().is_none() {
            return Err(ModelError::Config(format!(
                "image_size {} is too small for AlexNet {:?}",
                self.image_size, self.variant
            )));
        }
        Ok(())
    }

    /// Builds the module on `device`.
    ///
    /// # Panics
    ///
    /// Panics if the configuration is invalid (see [`AlexNetConfig::validate`]).
    pub fn init(&self, device: &Device) -> AlexNet {
        self.validate().expect("invalid AlexNet config");
        let mut c_in = self.in_channels;
        let features = self
            .convs()
            .iter()
            .map(|&(c_out, k, s, p)| {
                let layer = conv(c_in, c_out, k, s, p, true, device);
                c_in = c_out;
                layer
            })
            .collect();
        let s = self.feature_size().expect("validated");
        let flat = 256 * s * s;
        let widths: Vec<usize> = match self.variant {
            AlexNetVariant::Cifar => vec![flat, self.num_classes],
            _ => vec![flat, 4096, 4096, self.num_classes],
        };
        let (pk, ps) = self.pool();
        AlexNet {
            features,
            lrn: self.lrn.then(|| {
                LocalResponseNormConfig::new(5)
                    .with_alpha(1e-4)
                    .with_beta(0.75)
                    .with_k(2.0)
                    .init()
            }),
            pool: max_pool(pk, ps, 0),
            avgpool: (self.variant == AlexNetVariant::ImageNet)
                .then(|| AdaptiveAvgPool2dConfig::new([6, 6]).init()),
            classifier: widths
                .windows(2)
                .map(|w| LinearConfig::new(w[0], w[1]).init(device))
                .collect(),
            dropout: DropoutConfig::new(self.dropout).init(),
            activation: Relu::new(),
        }
    }
}

/// AlexNet. Parameters: `features.{0..5}` (convolutions), `classifier.{i}` (linear layers).
#[derive(Module, Debug)]
pub struct AlexNet {
    features: Vec<Conv2d>,
    lrn: Option<LocalResponseNorm>,
    pool: MaxPool2d,
    avgpool: Option<AdaptiveAvgPool2d>,
    classifier: Vec<Linear>,
    dropout: Dropout,
    activation: Relu,
}

impl ImageClassifier for AlexNet {
    /// # Shapes
    ///
    /// - `images`: `[batch, channels, image_size, image_size]`
    /// - output: `[batch, num_classes]`
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let mut x = images;
        for (i, layer) in self.features.iter().enumerate() {
            x = self.activation.forward(conv2d(layer, x));
            if i < 2 {
                if let Some(lrn) = &self.lrn {
                    x = lrn.forward(x);
                }
            }
            if matches!(i, 0 | 1 | 4) {
                x = self.pool.forward(x);
            }
        }
        if let Some(avgpool) = &self.avgpool {
            x = avgpool.forward(x);
        }
        let mut x = x.flatten::<2>(1, 3);
        let last = self.classifier.len() - 1;
        for (i, layer) in self.classifier.iter().enumerate() {
            if i < last {
                x = self
                    .activation
                    .forward(linear(layer, self.dropout.forward(x)));
            } else {
                x = linear(layer, x);
            }
        }
        x
    }
}

/// Registry spec of `kind = "alexnet"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlexNetSpec {
    /// `cifar`, `cifar-fc` or `imagenet`.
    pub variant: AlexNetVariant,
    /// Input channels (3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_channels: Option<usize>,
    /// Input height and width (32 for the CIFAR variants, 224 for `imagenet`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_size: Option<usize>,
    /// Number of classes (10 for CIFAR, 1000 for `imagenet`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_classes: Option<usize>,
    /// Local response normalisation (false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lrn: Option<bool>,
    /// Dropout in the fully connected head (0.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
}

impl AlexNetSpec {
    /// The resolved configuration.
    pub fn config(&self) -> AlexNetConfig {
        let base = match self.variant {
            AlexNetVariant::Cifar => AlexNetConfig::cifar(),
            AlexNetVariant::CifarFc => AlexNetConfig::cifar_fc(),
            AlexNetVariant::ImageNet => AlexNetConfig::imagenet(),
        };
        AlexNetConfig {
            variant: self.variant,
            in_channels: self.in_channels.unwrap_or(base.in_channels),
            image_size: self.image_size.unwrap_or(base.image_size),
            num_classes: self.num_classes.unwrap_or(base.num_classes),
            lrn: self.lrn.unwrap_or(base.lrn),
            dropout: self.dropout.unwrap_or(base.dropout),
        }
    }
}

impl ModelFamily for AlexNetSpec {
    const VARIANTS: &'static [&'static str] = &["cifar", "cifar-fc", "imagenet"];
    const SUMMARY: &'static str =
        "AlexNet: compact CIFAR (2.5 M), FC-heavy CIFAR (23 M), torchvision ImageNet (61 M); optional LRN";

    /// torchvision's names for `imagenet` (`features.{0,3,6,8,10}`, `classifier.{1,4,6}`);
    /// the twin's for the CIFAR variants (`features.{0..4}`, a single `classifier`, or
    /// `classifier.{1,4,6}` for `cifar-fc`'s three layers).
    fn torch_layout(&self, table: &ParamTable) -> Result<TorchLayout, ModelError> {
        let imagenet = self.variant == AlexNetVariant::ImageNet;
        let head = count_indexed(table, "classifier");
        Ok(TorchLayout::generic(table, |path| {
            reindex(path, "features", |i| {
                let at = if imagenet {
                    [0, 3, 6, 8, 10][i.min(4)]
                } else {
                    i
                };
                format!("features.{at}")
            })
            .or_else(|| reindex(path, "classifier", |i| classifier_name(i, head, [1, 4, 6])))
            .unwrap_or_else(|| path.to_string())
        }))
    }

    fn build(&self, device: &Device) -> Result<Box<dyn Model>, ModelError> {
        let config = self.config();
        config.validate()?;
        let device = autodiff(device);
        let module = config.init(&device);
        let name = match self.variant {
            AlexNetVariant::Cifar => "alexnet-cifar",
            AlexNetVariant::CifarFc => "alexnet-cifar-fc",
            AlexNetVariant::ImageNet => "alexnet-imagenet",
        };
        Ok(Box::new(ImageModel::new(
            name,
            module,
            config.input(),
            &device,
        )))
    }
}
