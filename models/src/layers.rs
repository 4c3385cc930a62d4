//! Small constructors shared by the families (crate-private).

use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, PaddingConfig2d};
use burn::prelude::*;

/// Square convolution with symmetric zero padding.
pub(crate) fn conv(
    c_in: usize,
    c_out: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    bias: bool,
    device: &Device,
) -> Conv2d {
    Conv2dConfig::new([c_in, c_out], [kernel, kernel])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(
            padding, padding, padding, padding,
        ))
        .with_bias(bias)
        .init(device)
}

/// BatchNorm with PyTorch's defaults (momentum 0.1, epsilon 1e-5).
pub(crate) fn batch_norm(channels: usize, device: &Device) -> BatchNorm {
    BatchNormConfig::new(channels).init(device)
}

/// Square max pooling with symmetric padding.
pub(crate) fn max_pool(kernel: usize, stride: usize, padding: usize) -> MaxPool2d {
    MaxPool2dConfig::new([kernel, kernel])
        .with_strides([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(
            padding, padding, padding, padding,
        ))
        .init()
}

/// Output side of a convolution or pooling window over a side of `size`.
pub(crate) fn out_size(size: usize, kernel: usize, stride: usize, padding: usize) -> Option<usize> {
    (size + 2 * padding)
        .checked_sub(kernel)
        .map(|s| s / stride + 1)
}

/// Checks a dropout probability.
pub(crate) fn check_dropout(p: f64) -> Result<(), crate::ModelError> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(crate::ModelError::Config(format!(
            "dropout must be in [0, 1), got {p}"
        )))
    }
}

/// A language model's `vocab`, which must be set before building (the trainer sets it from
/// the corpus when the configuration leaves it out).
pub(crate) fn require_vocab(vocab: Option<usize>) -> Result<usize, crate::ModelError> {
    vocab.ok_or_else(|| {
        crate::ModelError::Config(
            "vocab is not set: it defaults to the vocabulary of the text dataset, which only a \
             run with data knows; set vocab"
                .into(),
        )
    })
}

/// Checks that a count is positive.
pub(crate) fn check_positive(what: &str, value: usize) -> Result<(), crate::ModelError> {
    if value > 0 {
        Ok(())
    } else {
        Err(crate::ModelError::Config(format!(
            "{what} must be positive"
        )))
    }
}
