//! The in-memory item every dataset yields, and an image set stored compactly as bytes.

use burn_dataset::{Dataset, DatasetError};

use crate::error::{DataError, Result};

/// One item ready to become a tensor: a dense row-major `f32` array, its shape, and a label.
///
/// Images are `[channels, height, width]` (CHW) with values in `[0, 1]` unless a
/// [`Normalize`](crate::transform::Normalize) was applied. Synthetic items may have any shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Row-major values; `data.len()` equals the product of `shape`.
    pub data: Vec<f32>,
    /// The item's shape, e.g. `[3, 32, 32]`.
    pub shape: Vec<usize>,
    /// Class index in `0..num_classes`.
    pub label: usize,
}

/// Which part of a dataset to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// The training set.
    Train,
    /// The test set.
    Test,
}

/// A labelled image set held as `u8` pixels (a quarter of the memory of `f32`).
///
/// `get(i)` converts one image to a [`Sample`] with values `pixel / 255`.
#[derive(Debug, Clone)]
pub struct ImageSet {
    shape: [usize; 3],
    pixels: Vec<u8>,
    labels: Vec<u16>,
    num_classes: usize,
}

impl ImageSet {
    /// An image set from CHW `u8` pixels, one label per image.
    ///
    /// Returns [`DataError::Invalid`] when `pixels.len()` is not `labels.len()` images of
    /// `shape`, or a label is not below `num_classes`.
    pub fn new(
        shape: [usize; 3],
        pixels: Vec<u8>,
        labels: Vec<u16>,
        num_classes: usize,
    ) -> Result<Self> {
        let per = shape.iter().product::<usize>();
        if per == 0 || pixels.len() != per * labels.len() {
            return Err(DataError::Invalid(format!(
                "image set: {} pixel bytes is not {} images of shape {shape:?}",
                pixels.len(),
                labels.len()
            )));
        }
        if let Some(bad) = labels.iter().find(|&&l| l as usize >= num_classes) {
            return Err(DataError::Invalid(format!(
                "image set: label {bad} is not below num_classes {num_classes}"
            )));
        }
        Ok(Self {
            shape,
            pixels,
            labels,
            num_classes,
        })
    }

    /// `[channels, height, width]` of every image.
    pub fn shape(&self) -> [usize; 3] {
        self.shape
    }

    /// Number of classes.
    pub fn num_classes(&self) -> usize {
        self.num_classes
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when there are no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The raw CHW bytes of image `i`.
    ///
    /// # Panics
    /// Panics if `i >= len()`.
    pub fn pixels(&self, i: usize) -> &[u8] {
        let per = self.shape.iter().product::<usize>();
        &self.pixels[i * per..(i + 1) * per]
    }

    /// The label of image `i`.
    ///
    /// # Panics
    /// Panics if `i >= len()`.
    pub fn label(&self, i: usize) -> usize {
        self.labels[i] as usize
    }

    /// All labels.
    pub fn labels(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        self.labels.iter().map(|&l| l as usize)
    }

    /// Image `i` as a [`Sample`] with values in `[0, 1]`.
    ///
    /// # Panics
    /// Panics if `i >= len()`.
    pub fn sample(&self, i: usize) -> Sample {
        Sample {
            data: self
                .pixels(i)
                .iter()
                .map(|&p| p as f32 * (1.0 / 255.0))
                .collect(),
            shape: self.shape.to_vec(),
            label: self.label(i),
        }
    }

    /// Keeps the first `n` images (or all, if fewer).
    pub fn truncate(&mut self, n: usize) {
        let per = self.shape.iter().product::<usize>();
        self.labels.truncate(n);
        self.pixels.truncate(self.labels.len() * per);
    }

    /// Maps every image through `f` (input CHW bytes of [`shape`](Self::shape),
    /// output CHW bytes of `new_shape`).
    pub fn map_images(&self, new_shape: [usize; 3], f: impl Fn(&[u8], &mut [u8])) -> ImageSet {
        let per = new_shape.iter().product::<usize>();
        let mut pixels = vec![0u8; per * self.len()];
        for (i, out) in pixels.chunks_exact_mut(per).enumerate() {
            f(self.pixels(i), out);
        }
        ImageSet {
            shape: new_shape,
            pixels,
            labels: self.labels.clone(),
            num_classes: self.num_classes,
        }
    }
}

impl Dataset<Sample> for ImageSet {
    /// # Panics
    /// Panics if `index >= len()`, as burn's contract says.
    fn get(&self, index: usize) -> Result<Sample, DatasetError> {
        assert!(index < self.len(), "index {index} >= len {}", self.len());
        Ok(self.sample(index))
    }

    fn len(&self) -> usize {
        self.labels.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_inconsistent_sizes_and_labels() {
        assert!(ImageSet::new([1, 2, 2], vec![0; 7], vec![0, 1], 2).is_err());
        assert!(ImageSet::new([1, 2, 2], vec![0; 8], vec![0, 2], 2).is_err());
        let s = ImageSet::new([1, 2, 2], (0..8).collect(), vec![0, 1], 2).unwrap();
        assert_eq!(s.pixels(1), &[4, 5, 6, 7]);
        let x = Dataset::get(&s, 1).unwrap();
        assert_eq!(x.shape, vec![1, 2, 2]);
        assert_eq!(x.label, 1);
        assert!((x.data[3] - 7.0 / 255.0).abs() < 1e-7);
    }
}
