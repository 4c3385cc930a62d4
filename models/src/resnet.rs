//! Residual networks (He et al. 2016).
//!
//! - CIFAR ResNets, depth `6n + 2` ([`ResNetConfig::resnet20`], 32, 44, 56, 110): a 3×3
//!   16-channel stem, three stages of `n` basic blocks (16, 32, 64 channels), global average
//!   pooling and one linear layer. Shortcuts that change shape use **option A** by default,
//!   as in the paper's CIFAR experiments: identity, subsampled with stride 2 and zero-padded
//!   with the new channels (no parameters; ResNet-20 has 0.27 M parameters). Option B
//!   (1×1 projection + BatchNorm) is available with [`Shortcut::B`].
//! - ImageNet ResNets ([`ResNetConfig::resnet18`], 34 with basic blocks, 50 with bottleneck
//!   blocks): 7×7 stride-2 stem and 3×3 max pool, four stages (64…512 channels, ×4 for
//!   bottlenecks), option-B projection shortcuts, the stride on the bottleneck's 3×3
//!   convolution (torchvision's "v1.5"); ResNet-50 has 25.6 M parameters.

use burn::nn::conv::Conv2d;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d};
use burn::nn::{BatchNorm, Linear, LinearConfig, Relu};
use burn::prelude::*;

use serde::{Deserialize, Serialize};

use crate::batch_norm as bn;
use crate::family::{autodiff, ModelFamily};
use crate::flat::ParamTable;
use crate::gemm_conv::conv2d;
use crate::layers::{batch_norm, check_positive, conv, max_pool};
use crate::matmul::linear;
use crate::model::{ImageClassifier, ImageModel, InputSpec, Model};
use crate::torch_names::TorchLayout;
use crate::ModelError;

/// How a block's shortcut matches a change of shape; registry names `a`, `b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Shortcut {
    /// Stride-2 subsampling of the identity and zero channels (parameter-free).
    A,
    /// 1×1 convolution with stride, then BatchNorm.
    B,
}

/// Block type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// Two 3×3 convolutions.
    Basic,
    /// 1×1 reduce, 3×3, 1×1 expand (×4).
    Bottleneck,
}

/// Configuration of [`ResNet`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResNetConfig {
    /// Blocks per stage.
    pub blocks: Vec<usize>,
    /// Block type.
    pub block: BlockKind,
    /// Width of the first stage (doubled at each following stage).
    pub base_width: usize,
    /// ImageNet stem (7×7 stride 2 + max pool) instead of the CIFAR 3×3 stem.
    pub imagenet_stem: bool,
    /// Shortcut option where shapes change.
    pub shortcut: Shortcut,
    /// Input channels.
    pub in_channels: usize,
    /// Input height and width.
    pub image_size: usize,
    /// Number of classes.
    pub num_classes: usize,
}

impl ResNetConfig {
    /// CIFAR ResNet of depth `6n + 2` (3×32×32, 10 classes, option-A shortcuts).
    ///
    /// # Panics
    ///
    /// Panics if `depth` is not of the form `6n + 2` with `n ≥ 1`.
    pub fn cifar(depth: usize) -> Self {
        assert!(
            depth >= 8 && (depth - 2).is_multiple_of(6),
            "CIFAR ResNet depth must be 6n+2, got {depth}"
        );
        let n = (depth - 2) / 6;
        Self {
            blocks: vec![n; 3],
            block: BlockKind::Basic,
            base_width: 16,
            imagenet_stem: false,
            shortcut: Shortcut::A,
            in_channels: 3,
            image_size: 32,
            num_classes: 10,
        }
    }

    /// ResNet-20 (CIFAR, 0.27 M parameters).
    pub fn resnet20() -> Self {
        Self::cifar(20)
    }
    /// ResNet-32 (CIFAR).
    pub fn resnet32() -> Self {
        Self::cifar(32)
    }
    /// ResNet-44 (CIFAR).
    pub fn resnet44() -> Self {
        Self::cifar(44)
    }
    /// ResNet-56 (CIFAR).
    pub fn resnet56() -> Self {
        Self::cifar(56)
    }
    /// ResNet-110 (CIFAR).
    pub fn resnet110() -> Self {
        Self::cifar(110)
    }

    fn imagenet(blocks: [usize; 4], block: BlockKind) -> Self {
        Self {
            blocks: blocks.to_vec(),
            block,
            base_width: 64,
            imagenet_stem: true,
            shortcut: Shortcut::B,
            in_channels: 3,
            image_size: 224,
            num_classes: 1000,
        }
    }

    /// ResNet-18 (ImageNet, 11.7 M parameters).
    pub fn resnet18() -> Self {
        Self::imagenet([2, 2, 2, 2], BlockKind::Basic)
    }
    /// ResNet-34 (ImageNet, 21.8 M parameters).
    pub fn resnet34() -> Self {
        Self::imagenet([3, 4, 6, 3], BlockKind::Basic)
    }
    /// ResNet-50 (ImageNet, 25.6 M parameters).
    pub fn resnet50() -> Self {
        Self::imagenet([3, 4, 6, 3], BlockKind::Bottleneck)
    }

    /// Returns the config with another shortcut option.
    pub fn with_shortcut(mut self, shortcut: Shortcut) -> Self {
        self.shortcut = shortcut;
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

    fn expansion(&self) -> usize {
        match self.block {
            BlockKind::Basic => 1,
            BlockKind::Bottleneck => 4,
        }
    }

    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ModelError> {
        check_positive("in_channels", self.in_channels)?;
        check_positive("num_classes", self.num_classes)?;
        check_positive("base_width", self.base_width)?;
        check_positive("image_size", self.image_size)?;
        if self.blocks.is_empty() || self.blocks.contains(&0) {
            return Err(ModelError::Config(
                "every ResNet stage needs at least one block".into(),
            ));
        }
        if self.shortcut == Shortcut::A && self.block == BlockKind::Bottleneck {
            return Err(ModelError::Config(
                "option-A shortcuts are defined for basic blocks only".into(),
            ));
        }
        if self.shortcut == Shortcut::A && !self.base_width.is_multiple_of(2) {
            return Err(ModelError::Config(
                "option-A shortcuts need an even base_width (channels are padded evenly)".into(),
            ));
        }
        Ok(())
    }

    /// Builds the module on `device`.
    ///
    /// # Panics
    ///
    /// Panics if the configuration is invalid (see [`ResNetConfig::validate`]).
    pub fn init(&self, device: &Device) -> ResNet {
        self.validate().expect("invalid ResNet config");
        let expansion = self.expansion();
        let (stem_conv, stem_pool) = if self.imagenet_stem {
            (
                conv(self.in_channels, self.base_width, 7, 2, 3, false, device),
                Some(max_pool(3, 2, 1)),
            )
        } else {
            (
                conv(self.in_channels, self.base_width, 3, 1, 1, false, device),
                None,
            )
        };
        let mut c_in = self.base_width;
        let mut stages = Vec::new();
        for (s, &n) in self.blocks.iter().enumerate() {
            let width = self.base_width << s;
            let mut stage = Vec::new();
            for b in 0..n {
                let stride = if s > 0 && b == 0 { 2 } else { 1 };
                stage.push(Block::new(
                    self.block,
                    self.shortcut,
                    c_in,
                    width,
                    expansion,
                    stride,
                    device,
                ));
                c_in = width * expansion;
            }
            stages.push(stage);
        }
        ResNet {
            conv1: stem_conv,
            bn1: batch_norm(self.base_width, device),
            maxpool: stem_pool,
            stages,
            avgpool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            fc: LinearConfig::new(c_in, self.num_classes).init(device),
            activation: Relu::new(),
        }
    }
}

/// Projection shortcut (option B): 1×1 convolution with stride, then BatchNorm.
#[derive(Module, Debug)]
pub struct Downsample {
    conv: Conv2d,
    bn: BatchNorm,
}

/// A residual block, basic (`conv3` absent) or bottleneck.
#[derive(Module, Debug)]
pub struct Block {
    conv1: Conv2d,
    bn1: BatchNorm,
    conv2: Conv2d,
    bn2: BatchNorm,
    conv3: Option<Conv2d>,
    bn3: Option<BatchNorm>,
    downsample: Option<Downsample>,
    /// Option A: subsampling of the identity (1×1 max pool with stride 2).
    subsample: Option<MaxPool2d>,
    /// Option A: zero channels added before and after the identity.
    pad_channels: usize,
    activation: Relu,
}

impl Block {
    fn new(
        kind: BlockKind,
        shortcut: Shortcut,
        c_in: usize,
        width: usize,
        expansion: usize,
        stride: usize,
        device: &Device,
    ) -> Self {
        let c_out = width * expansion;
        let reshapes = stride != 1 || c_in != c_out;
        let (conv1, conv2, conv3, bn3) = match kind {
            BlockKind::Basic => (
                conv(c_in, width, 3, stride, 1, false, device),
                conv(width, width, 3, 1, 1, false, device),
                None,
                None,
            ),
            BlockKind::Bottleneck => (
                conv(c_in, width, 1, 1, 0, false, device),
                conv(width, width, 3, stride, 1, false, device),
                Some(conv(width, c_out, 1, 1, 0, false, device)),
                Some(batch_norm(c_out, device)),
            ),
        };
        let projection = reshapes && shortcut == Shortcut::B;
        let zero_pad = reshapes && shortcut == Shortcut::A;
        Self {
            conv1,
            bn1: batch_norm(width, device),
            conv2,
            bn2: batch_norm(width, device),
            conv3,
            bn3,
            downsample: projection.then(|| Downsample {
                conv: conv(c_in, c_out, 1, stride, 0, false, device),
                bn: batch_norm(c_out, device),
            }),
            subsample: (zero_pad && stride != 1).then(|| max_pool(1, stride, 0)),
            pad_channels: if zero_pad { (c_out - c_in) / 2 } else { 0 },
            activation: Relu::new(),
        }
    }

    /// # Shapes
    ///
    /// - `x`: `[batch, c_in, h, w]`
    /// - output: `[batch, c_out, h / stride, w / stride]`
    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let relu = &self.activation;
        let identity = match (&self.downsample, &self.subsample) {
            (Some(down), _) => bn::forward(&down.bn, conv2d(&down.conv, x.clone())),
            (None, Some(sub)) => sub.forward(x.clone()),
            (None, None) => x.clone(),
        };
        let identity = if self.pad_channels > 0 {
            let [b, _, h, w] = identity.dims();
            let zeros = Tensor::<4>::zeros([b, self.pad_channels, h, w], &identity.device());
            Tensor::cat(vec![zeros.clone(), identity, zeros], 1)
        } else {
            identity
        };
        let out = relu.forward(bn::forward(&self.bn1, conv2d(&self.conv1, x)));
        let out = bn::forward(&self.bn2, conv2d(&self.conv2, out));
        let out = match (&self.conv3, &self.bn3) {
            (Some(conv3), Some(bn3)) => bn::forward(bn3, conv2d(conv3, relu.forward(out))),
            _ => out,
        };
        relu.forward(out + identity)
    }
}

/// ResNet. Parameters: `conv1`, `bn1` (stem), `stages.{s}.{b}.{conv,bn}{1,2,3}`,
/// `stages.{s}.{b}.downsample.{conv,bn}`, `fc`.
#[derive(Module, Debug)]
pub struct ResNet {
    conv1: Conv2d,
    bn1: BatchNorm,
    maxpool: Option<MaxPool2d>,
    stages: Vec<Vec<Block>>,
    avgpool: AdaptiveAvgPool2d,
    fc: Linear,
    activation: Relu,
}

impl ImageClassifier for ResNet {
    /// # Shapes
    ///
    /// - `images`: `[batch, channels, image_size, image_size]`
    /// - output: `[batch, num_classes]`
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let mut x = self
            .activation
            .forward(bn::forward(&self.bn1, conv2d(&self.conv1, images)));
        if let Some(pool) = &self.maxpool {
            x = pool.forward(x);
        }
        for stage in &self.stages {
            for block in stage {
                x = block.forward(x);
            }
        }
        linear(&self.fc, self.avgpool.forward(x).flatten::<2>(1, 3))
    }
}

/// ResNet variants (registry names `resnet20` … `resnet110`, `resnet18`, `resnet34`,
/// `resnet50`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResNetVariant {
    /// CIFAR ResNet-20.
    Resnet20,
    /// CIFAR ResNet-32.
    Resnet32,
    /// CIFAR ResNet-44.
    Resnet44,
    /// CIFAR ResNet-56.
    Resnet56,
    /// CIFAR ResNet-110.
    Resnet110,
    /// ImageNet ResNet-18.
    Resnet18,
    /// ImageNet ResNet-34.
    Resnet34,
    /// ImageNet ResNet-50.
    Resnet50,
}

/// Registry spec of `kind = "resnet"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResNetSpec {
    /// Which ResNet.
    pub variant: ResNetVariant,
    /// Input channels (3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_channels: Option<usize>,
    /// Input height and width (32 for CIFAR variants, 224 for ImageNet ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_size: Option<usize>,
    /// Number of classes (10 for CIFAR variants, 1000 for ImageNet ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_classes: Option<usize>,
    /// Shortcut option (`a` for CIFAR variants, `b` for ImageNet ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shortcut: Option<Shortcut>,
}

impl ResNetSpec {
    /// The resolved configuration.
    pub fn config(&self) -> ResNetConfig {
        let base = match self.variant {
            ResNetVariant::Resnet20 => ResNetConfig::resnet20(),
            ResNetVariant::Resnet32 => ResNetConfig::resnet32(),
            ResNetVariant::Resnet44 => ResNetConfig::resnet44(),
            ResNetVariant::Resnet56 => ResNetConfig::resnet56(),
            ResNetVariant::Resnet110 => ResNetConfig::resnet110(),
            ResNetVariant::Resnet18 => ResNetConfig::resnet18(),
            ResNetVariant::Resnet34 => ResNetConfig::resnet34(),
            ResNetVariant::Resnet50 => ResNetConfig::resnet50(),
        };
        ResNetConfig {
            in_channels: self.in_channels.unwrap_or(base.in_channels),
            image_size: self.image_size.unwrap_or(base.image_size),
            num_classes: self.num_classes.unwrap_or(base.num_classes),
            shortcut: self.shortcut.unwrap_or(base.shortcut),
            ..base
        }
    }

    fn name(&self) -> &'static str {
        match self.variant {
            ResNetVariant::Resnet20 => "resnet20",
            ResNetVariant::Resnet32 => "resnet32",
            ResNetVariant::Resnet44 => "resnet44",
            ResNetVariant::Resnet56 => "resnet56",
            ResNetVariant::Resnet110 => "resnet110",
            ResNetVariant::Resnet18 => "resnet18",
            ResNetVariant::Resnet34 => "resnet34",
            ResNetVariant::Resnet50 => "resnet50",
        }
    }
}

impl ModelFamily for ResNetSpec {
    const VARIANTS: &'static [&'static str] = &[
        "resnet20",
        "resnet32",
        "resnet44",
        "resnet56",
        "resnet110",
        "resnet18",
        "resnet34",
        "resnet50",
    ];
    const SUMMARY: &'static str =
        "ResNet: CIFAR 6n+2 (option-A shortcuts by default) and ImageNet 18/34/50";

    /// torchvision's names for the ImageNet ResNets (`layer{s+1}.{b}`, a projection
    /// shortcut at `downsample.0` / `downsample.1`); the twin's for the CIFAR ones (blocks
    /// numbered through the stages, `blocks.{k}`).
    fn torch_layout(&self, table: &ParamTable) -> Result<TorchLayout, ModelError> {
        let config = self.config();
        let torchvision = config.imagenet_stem;
        let first: Vec<usize> = config
            .blocks
            .iter()
            .scan(0, |acc, &n| {
                let at = *acc;
                *acc += n;
                Some(at)
            })
            .collect();
        Ok(TorchLayout::generic(table, |path| {
            let path = path
                .replace("downsample.conv", "downsample.0")
                .replace("downsample.bn", "downsample.1");
            let mut parts = path.splitn(4, '.');
            let (Some("stages"), Some(stage), Some(block)) =
                (parts.next(), parts.next(), parts.next())
            else {
                return path;
            };
            let (Ok(s), Ok(b)) = (stage.parse::<usize>(), block.parse::<usize>()) else {
                return path;
            };
            let head = if torchvision {
                format!("layer{}.{b}", s + 1)
            } else {
                format!("blocks.{}", first.get(s).copied().unwrap_or(0) + b)
            };
            match parts.next() {
                Some(tail) => format!("{head}.{tail}"),
                None => head,
            }
        }))
    }

    fn build(&self, device: &Device) -> Result<Box<dyn Model>, ModelError> {
        let config = self.config();
        config.validate()?;
        let device = autodiff(device);
        let module = config.init(&device);
        Ok(Box::new(ImageModel::new(
            self.name(),
            module,
            config.input(),
            &device,
        )))
    }
}
