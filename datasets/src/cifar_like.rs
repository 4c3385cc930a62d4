//! `cifar10-like` datasets: real greyscale images in the CIFAR-10 tensor shape.
//!
//! **These are not CIFAR-10.** The full CIFAR-10 set cannot be obtained through a
//! package registry here, so CIFAR-size models (AlexNet-CIFAR, VGG, ResNet-20/32/56/110)
//! are trained on Fashion-MNIST (or MNIST) brought to `3 × 32 × 32`: each 28 × 28 image
//! is zero-padded by 2 pixels on every side and its grey channel is copied into all
//! three channels. The images are real and the task is a real 10-class problem, but it
//! is easier than CIFAR-10 and accuracies are not comparable with published CIFAR-10
//! numbers. When the official CIFAR-10 archive is available, import it with
//! `dtrain data fetch cifar10 --from cifar-10-binary.tar.gz` and use
//! [`load_cifar10_dir`](crate::cifar::load_cifar10_dir) instead.

use std::path::Path;

use crate::error::{DataError, Result};
use crate::idx::load_mnist_dir;
use crate::sample::{ImageSet, Split};

/// Pads a 1-channel set to `size × size` (centred, zeros) and replicates it to 3 channels.
///
/// Errors if the set is not 1-channel or is larger than `size`.
pub fn to_cifar_like(set: &ImageSet, size: usize) -> Result<ImageSet> {
    let [c, h, w] = set.shape();
    if c != 1 || h > size || w > size {
        return Err(DataError::Invalid(format!(
            "cifar10-like: need a 1-channel set of at most {size}×{size}, got {:?}",
            set.shape()
        )));
    }
    let (top, left) = ((size - h) / 2, (size - w) / 2);
    Ok(set.map_images([3, size, size], |src, out| {
        for y in 0..h {
            let row = &src[y * w..(y + 1) * w];
            for ch in 0..3 {
                let o = ch * size * size + (y + top) * size + left;
                out[o..o + w].copy_from_slice(row);
            }
        }
    }))
}

/// Fashion-MNIST (or MNIST — any directory of the four IDX files) as a `3 × 32 × 32`
/// cifar10-like set. See the module docs: this is not CIFAR-10.
pub fn load_cifar_like(mnist_dir: impl AsRef<Path>, split: Split) -> Result<ImageSet> {
    to_cifar_like(&load_mnist_dir(mnist_dir, split)?, 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_and_replicates() {
        let set = ImageSet::new([1, 2, 3], vec![1, 2, 3, 4, 5, 6], vec![7], 10).unwrap();
        let c = to_cifar_like(&set, 4).unwrap();
        assert_eq!(c.shape(), [3, 4, 4]);
        let p = c.pixels(0);
        // top = 1, left = 0
        for ch in 0..3 {
            let plane = &p[ch * 16..(ch + 1) * 16];
            assert_eq!(plane, &[0, 0, 0, 0, 1, 2, 3, 0, 4, 5, 6, 0, 0, 0, 0, 0]);
        }
        assert_eq!(c.label(0), 7);
        assert!(to_cifar_like(&c, 32).is_err());
    }
}
