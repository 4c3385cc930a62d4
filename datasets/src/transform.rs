//! Per-item transforms: CIFAR-style augmentation and per-channel normalisation.

use burn_dataset::{Dataset, DatasetError};

use crate::rng::SplitMix64;
use crate::sample::{ImageSet, Sample};

/// Per-channel `(x - mean[c]) / std[c]` on CHW samples.
#[derive(Debug, Clone, PartialEq)]
pub struct Normalize {
    /// Per-channel mean.
    pub mean: Vec<f32>,
    /// Per-channel standard deviation.
    pub std: Vec<f32>,
}

impl Normalize {
    /// MNIST training-set statistics on `[0, 1]` pixels.
    pub fn mnist() -> Self {
        Self {
            mean: vec![0.1307],
            std: vec![0.3081],
        }
    }

    /// CIFAR-10 training-set statistics on `[0, 1]` pixels (RGB).
    pub fn cifar10() -> Self {
        Self {
            mean: vec![0.4914, 0.4822, 0.4465],
            std: vec![0.2470, 0.2435, 0.2616],
        }
    }

    /// Measures per-channel mean and standard deviation of an image set (on `[0, 1]`
    /// pixels); a channel with zero spread gets std 1.
    pub fn fit(set: &ImageSet) -> Self {
        let [c, h, w] = set.shape();
        let (mut sum, mut sq) = (vec![0f64; c], vec![0f64; c]);
        for i in 0..set.len() {
            for (ch, plane) in set.pixels(i).chunks_exact(h * w).enumerate() {
                for &p in plane {
                    let x = p as f64 / 255.0;
                    sum[ch] += x;
                    sq[ch] += x * x;
                }
            }
        }
        let n = (set.len() * h * w).max(1) as f64;
        let mean: Vec<f32> = sum.iter().map(|s| (s / n) as f32).collect();
        let std = sq
            .iter()
            .zip(&sum)
            .map(|(q, s)| {
                let v = (q / n - (s / n) * (s / n)).max(0.0).sqrt() as f32;
                if v > 0.0 {
                    v
                } else {
                    1.0
                }
            })
            .collect();
        Self { mean, std }
    }

    /// Normalises a CHW sample in place.
    ///
    /// # Panics
    /// Panics if the sample's channel count differs from `mean.len()`.
    pub fn apply(&self, s: &mut Sample) {
        let c = s.shape[0];
        assert_eq!(
            c,
            self.mean.len(),
            "Normalize: {c} channels vs {} means",
            self.mean.len()
        );
        let plane = s.data.len() / c;
        for (ch, chunk) in s.data.chunks_exact_mut(plane).enumerate() {
            let (m, inv) = (self.mean[ch], 1.0 / self.std[ch]);
            for x in chunk {
                *x = (*x - m) * inv;
            }
        }
    }
}

/// CIFAR-style augmentation: zero-pad by `pad` pixels, take a random crop of the
/// original size, and flip horizontally with probability 1/2.
///
/// The random draws are keyed by `(seed, epoch, index)`, so the result does not depend
/// on the order or the thread in which items are fetched, and differs each epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CifarAugment {
    /// Padding on each side (4 for CIFAR).
    pub pad: usize,
    /// Whether to flip horizontally at random.
    pub flip: bool,
    /// Seed of the draws.
    pub seed: u64,
}

impl CifarAugment {
    /// Pad 4, flip on.
    pub fn new(seed: u64) -> Self {
        Self {
            pad: 4,
            flip: true,
            seed,
        }
    }

    /// Augments CHW sample `s`, item `index` of `epoch`. The padding value is 0 (black
    /// before normalisation, so apply this before [`Normalize`]).
    ///
    /// # Panics
    /// Panics if the sample is not 3-dimensional.
    pub fn apply(&self, s: &mut Sample, epoch: u64, index: usize) {
        assert_eq!(s.shape.len(), 3, "CifarAugment needs CHW samples");
        let (c, h, w) = (s.shape[0], s.shape[1], s.shape[2]);
        let mut r = SplitMix64::keyed(&[self.seed, 0x61756735, epoch, index as u64]);
        let span = 2 * self.pad as u64 + 1;
        let dy = r.below(span) as isize - self.pad as isize;
        let dx = r.below(span) as isize - self.pad as isize;
        let flip = self.flip && r.below(2) == 1;
        let src = std::mem::take(&mut s.data);
        let mut out = vec![0f32; src.len()];
        for ch in 0..c {
            for y in 0..h {
                let sy = y as isize + dy;
                if sy < 0 || sy >= h as isize {
                    continue;
                }
                for x in 0..w {
                    let xx = if flip { w - 1 - x } else { x };
                    let sx = xx as isize + dx;
                    if sx < 0 || sx >= w as isize {
                        continue;
                    }
                    out[(ch * h + y) * w + x] = src[(ch * h + sy as usize) * w + sx as usize];
                }
            }
        }
        s.data = out;
    }
}

/// A dataset with augmentation (training only) and normalisation applied on `get`.
#[derive(Debug, Clone)]
pub struct Transformed<D> {
    inner: D,
    augment: Option<CifarAugment>,
    normalize: Option<Normalize>,
    epoch: u64,
}

impl<D> Transformed<D> {
    /// Wraps `inner`; either transform may be `None`.
    pub fn new(inner: D, augment: Option<CifarAugment>, normalize: Option<Normalize>) -> Self {
        Self {
            inner,
            augment,
            normalize,
            epoch: 0,
        }
    }

    /// Sets the epoch that keys the augmentation draws.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The wrapped dataset.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// The wrapped dataset, mutably (e.g. to reshuffle a shard).
    pub fn inner_mut(&mut self) -> &mut D {
        &mut self.inner
    }
}

impl<D: Dataset<Sample>> Dataset<Sample> for Transformed<D> {
    /// # Panics
    /// Panics if `index >= len()`.
    fn get(&self, index: usize) -> Result<Sample, DatasetError> {
        let mut s = self.inner.get(index)?;
        if let Some(a) = &self.augment {
            a.apply(&mut s, self.epoch, index);
        }
        if let Some(n) = &self.normalize {
            n.apply(&mut s);
        }
        Ok(s)
    }

    fn len(&self) -> usize {
        self.inner.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp() -> Sample {
        Sample {
            data: (0..3 * 8 * 8).map(|i| i as f32 + 1.0).collect(),
            shape: vec![3, 8, 8],
            label: 0,
        }
    }

    #[test]
    fn augmentation_is_deterministic_and_varies() {
        let a = CifarAugment::new(5);
        let mut x = ramp();
        let mut y = ramp();
        a.apply(&mut x, 2, 9);
        a.apply(&mut y, 2, 9);
        assert_eq!(x, y);
        let outs: std::collections::HashSet<Vec<u32>> = (0..20)
            .map(|i| {
                let mut z = ramp();
                a.apply(&mut z, 0, i);
                z.data.iter().map(|v| v.to_bits()).collect()
            })
            .collect();
        assert!(outs.len() > 10, "crops should differ across items");
        let mut e = ramp();
        CifarAugment::new(6).apply(&mut e, 2, 9);
        let mut f = ramp();
        a.apply(&mut f, 3, 9);
        assert!(e != x || f != x);
    }

    #[test]
    fn augmentation_is_a_shifted_maybe_flipped_copy() {
        let a = CifarAugment {
            pad: 2,
            flip: true,
            seed: 1,
        };
        let src = ramp();
        for i in 0..30 {
            let mut s = ramp();
            a.apply(&mut s, 0, i);
            // Every non-zero output value comes from the same channel of the source,
            // and within a row values are consecutive (step +1 or −1 for a flip).
            for ch in 0..3 {
                for y in 0..8 {
                    let row = &s.data[(ch * 8 + y) * 8..(ch * 8 + y + 1) * 8];
                    let nz: Vec<f32> = row.iter().copied().filter(|&v| v != 0.0).collect();
                    for v in &nz {
                        let k = (*v - 1.0) as usize;
                        assert_eq!(k / 64, ch);
                        assert_eq!(src.data[k], *v);
                    }
                    for p in nz.windows(2) {
                        assert_eq!((p[1] - p[0]).abs(), 1.0);
                    }
                }
            }
        }
        let no = CifarAugment {
            pad: 0,
            flip: false,
            seed: 1,
        };
        let mut s = ramp();
        no.apply(&mut s, 0, 0);
        assert_eq!(s, ramp());
    }

    #[test]
    fn normalize_fit_and_apply() {
        let set = ImageSet::new(
            [2, 1, 2],
            vec![0, 255, 51, 51, 0, 255, 51, 51],
            vec![0, 0],
            1,
        )
        .unwrap();
        let n = Normalize::fit(&set);
        assert!((n.mean[0] - 0.5).abs() < 1e-6 && (n.std[0] - 0.5).abs() < 1e-6);
        assert!((n.mean[1] - 0.2).abs() < 1e-6 && n.std[1] == 1.0);
        let mut s = set.sample(0);
        n.apply(&mut s);
        assert!((s.data[0] + 1.0).abs() < 1e-6 && (s.data[1] - 1.0).abs() < 1e-6);
        assert!(s.data[2].abs() < 1e-6);
    }

    #[test]
    fn transformed_dataset_applies_both() {
        let set = ImageSet::new([1, 2, 2], vec![255; 4], vec![0], 1).unwrap();
        let n = Normalize {
            mean: vec![0.5],
            std: vec![0.25],
        };
        let t = Transformed::new(set, None, Some(n));
        assert_eq!(t.get(0).unwrap().data, vec![2.0; 4]);
        assert_eq!(t.len(), 1);
    }
}
