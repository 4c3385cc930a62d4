//! Seeded synthetic datasets of any shape, for benchmarks and tests.
//!
//! Item `i` is a class prototype plus Gaussian noise, both drawn from [`SplitMix64`]
//! streams keyed by the seed (and `i`), so any item can be produced independently, in
//! any order, on any rank, and is the same every time. The classes are separable, so a
//! model can actually learn them.

use burn_dataset::{Dataset, DatasetError};

use crate::rng::SplitMix64;
use crate::sample::Sample;

/// Settings of a [`Synthetic`] dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticConfig {
    /// Shape of every item, e.g. `[3, 32, 32]` or `[784]`.
    pub shape: Vec<usize>,
    /// Number of items.
    pub len: usize,
    /// Number of classes (at least 1).
    pub num_classes: usize,
    /// Standard deviation of the per-item noise around the class prototype (prototypes
    /// have unit variance).
    pub noise: f32,
    /// Seed of the prototypes, labels and noise.
    pub seed: u64,
}

impl SyntheticConfig {
    /// A config with 10 classes and noise 1.0.
    pub fn new(shape: &[usize], len: usize, seed: u64) -> Self {
        Self {
            shape: shape.to_vec(),
            len,
            num_classes: 10,
            noise: 1.0,
            seed,
        }
    }

    /// Builds the dataset (draws the class prototypes).
    ///
    /// # Panics
    /// Panics if `num_classes == 0` or the shape has a zero dimension.
    pub fn init(&self) -> Synthetic {
        assert!(self.num_classes > 0, "num_classes must be positive");
        let size: usize = self.shape.iter().product();
        assert!(size > 0, "shape {:?} has no elements", self.shape);
        let prototypes = (0..self.num_classes)
            .map(|c| {
                let mut r = SplitMix64::keyed(&[self.seed, 0x70726f74, c as u64]);
                let mut p = vec![0f32; size];
                r.fill_normal_f32(&mut p);
                p
            })
            .collect();
        Synthetic {
            config: self.clone(),
            prototypes,
        }
    }
}

/// A synthetic classification dataset; see the module docs.
#[derive(Debug, Clone)]
pub struct Synthetic {
    config: SyntheticConfig,
    prototypes: Vec<Vec<f32>>,
}

impl Synthetic {
    /// The config it was built from.
    pub fn config(&self) -> &SyntheticConfig {
        &self.config
    }

    /// Item `index`.
    ///
    /// # Panics
    /// Panics if `index >= len`.
    pub fn sample(&self, index: usize) -> Sample {
        assert!(
            index < self.config.len,
            "index {index} >= len {}",
            self.config.len
        );
        let mut r = SplitMix64::keyed(&[self.config.seed, 0x6974656d, index as u64]);
        let label = r.below(self.config.num_classes as u64) as usize;
        let mut data = vec![0f32; self.prototypes[label].len()];
        r.fill_normal_f32(&mut data);
        for (d, &p) in data.iter_mut().zip(&self.prototypes[label]) {
            *d = p + self.config.noise * *d;
        }
        Sample {
            data,
            shape: self.config.shape.clone(),
            label,
        }
    }
}

impl Dataset<Sample> for Synthetic {
    /// # Panics
    /// Panics if `index >= len()`.
    fn get(&self, index: usize) -> Result<Sample, DatasetError> {
        Ok(self.sample(index))
    }

    fn len(&self) -> usize {
        self.config.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_any_shape_and_seed_dependent() {
        let a = SyntheticConfig::new(&[2, 3, 4], 50, 9).init();
        let b = SyntheticConfig::new(&[2, 3, 4], 50, 9).init();
        let c = SyntheticConfig::new(&[2, 3, 4], 50, 10).init();
        assert_eq!(a.len(), 50);
        let x = a.get(17).unwrap();
        assert_eq!(x.shape, vec![2, 3, 4]);
        assert_eq!(x.data.len(), 24);
        assert_eq!(x, b.get(17).unwrap());
        assert_ne!(x.data, c.get(17).unwrap().data);
        assert!(x.label < 10);
        let labels: std::collections::HashSet<usize> = (0..50).map(|i| a.sample(i).label).collect();
        assert!(labels.len() > 5);
    }

    #[test]
    fn classes_are_separable_by_nearest_prototype() {
        let mut cfg = SyntheticConfig::new(&[64], 200, 3);
        cfg.noise = 0.5;
        let d = cfg.init();
        let correct = (0..200)
            .filter(|&i| {
                let s = d.sample(i);
                let best = (0..10)
                    .min_by(|&p, &q| {
                        let dist = |k: usize| -> f32 {
                            s.data
                                .iter()
                                .zip(&d.prototypes[k])
                                .map(|(a, b)| (a - b) * (a - b))
                                .sum()
                        };
                        dist(p).total_cmp(&dist(q))
                    })
                    .unwrap();
                best == s.label
            })
            .count();
        assert_eq!(correct, 200);
    }
}
