//! Deterministic synthetic data that needs no dataset and does not touch burn's global RNG:
//! a batch that fits any model ([`SyntheticBatch`]: benchmarks, device checks, tests) and the
//! precision probe of a device's matrix products ([`matmul_rel_err`]).

use burn::prelude::*;
use burn::tensor::TensorData;

use crate::model::{Batch, InputSpec};

/// xorshift64: small, fast and the same on every platform.
#[derive(Debug, Clone)]
pub struct SynthRng(u64);

impl SynthRng {
    /// A generator from `seed` (every seed, 0 included, gives a usable state).
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in `[-1, 1)`.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// One batch of pseudo-random data for a model's [`InputSpec`], kept on the host so that the
/// same batch can be put on several devices: images uniform in `[-1, 1)` with uniformly
/// drawn labels, or uniformly drawn input and target tokens.
#[derive(Debug, Clone)]
pub enum SyntheticBatch {
    /// `[n, c, h, w]` images and `n` labels.
    Images {
        /// Row-major pixels.
        data: Vec<f32>,
        /// `[n, c, h, w]`.
        shape: [usize; 4],
        /// Class labels.
        labels: Vec<i64>,
    },
    /// `[n, seq]` input and target tokens.
    Tokens {
        /// Row-major input tokens.
        inputs: Vec<i64>,
        /// Row-major target tokens.
        targets: Vec<i64>,
        /// `[n, seq]`.
        shape: [usize; 2],
    },
}

impl SyntheticBatch {
    /// `batch` examples for `input` (sequences of `seq_len` tokens for a language model),
    /// drawn from `seed`: the pixels (or inputs) first, then the labels (or targets).
    pub fn new(input: InputSpec, batch: usize, seq_len: usize, seed: u64) -> Self {
        let mut rng = SynthRng::new(seed);
        match input {
            InputSpec::Images {
                channels,
                height,
                width,
                num_classes,
            } => {
                let shape = [batch, channels, height, width];
                let data = (0..shape.iter().product::<usize>())
                    .map(|_| rng.next_f32())
                    .collect();
                let labels = (0..batch).map(|_| rng.below(num_classes) as i64).collect();
                SyntheticBatch::Images {
                    data,
                    shape,
                    labels,
                }
            }
            InputSpec::Tokens { vocab } => {
                let n = batch * seq_len;
                let inputs = (0..n).map(|_| rng.below(vocab) as i64).collect();
                let targets = (0..n).map(|_| rng.below(vocab) as i64).collect();
                SyntheticBatch::Tokens {
                    inputs,
                    targets,
                    shape: [batch, seq_len],
                }
            }
        }
    }

    /// The batch on `device`.
    pub fn on(&self, device: &Device) -> Batch {
        match self {
            SyntheticBatch::Images {
                data,
                shape,
                labels,
            } => Batch::images_from_slice(data, *shape, labels, device),
            SyntheticBatch::Tokens {
                inputs,
                targets,
                shape,
            } => Batch::tokens_from_slice(inputs, targets, *shape, device),
        }
    }

    /// The shape for tables: `32x3x32x32`, or `20x35 tokens`.
    pub fn describe(&self) -> String {
        match self {
            SyntheticBatch::Images { shape, .. } => shape.map(|d| d.to_string()).join("x"),
            SyntheticBatch::Tokens { shape, .. } => format!("{}x{} tokens", shape[0], shape[1]),
        }
    }
}

/// Relative error (`‖C − C_cpu‖₂ / ‖C_cpu‖₂`) of an `n × n × n` f32 matrix product on
/// `device` against the same product on the CPU backend, from the same pseudo-random
/// operands. About 1e-7 means the device multiplies in f32; about 3e-4 means it rounds the
/// operands to TF32 (10-bit mantissa), as burn's CUDA backend does on tensor-core GPUs.
pub fn matmul_rel_err(device: &Device, n: usize) -> f64 {
    matmul_rel_err_between(device, &crate::cpu_device(), n)
}

/// [`matmul_rel_err`] against `reference` instead of the CPU backend; NaN when a product
/// cannot be read back.
pub fn matmul_rel_err_between(device: &Device, reference: &Device, n: usize) -> f64 {
    let mut rng = SynthRng::new(0x5eed);
    let a: Vec<f32> = (0..n * n).map(|_| rng.next_f32()).collect();
    let b: Vec<f32> = (0..n * n).map(|_| rng.next_f32()).collect();
    let product = |on: &Device| -> Option<Vec<f32>> {
        let ta = Tensor::<2>::from_data(TensorData::new(a.clone(), [n, n]), on);
        let tb = Tensor::<2>::from_data(TensorData::new(b.clone(), [n, n]), on);
        ta.matmul(tb).into_data().try_to_vec::<f32>().ok()
    };
    let (Some(got), Some(want)) = (product(device), product(reference)) else {
        return f64::NAN;
    };
    let (mut d, mut w) = (0.0f64, 0.0f64);
    for (x, y) in got.iter().zip(&want) {
        d += (*x as f64 - *y as f64).powi(2);
        w += (*y as f64).powi(2);
    }
    (d / w).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_deterministic_and_fit_the_input() {
        let input = InputSpec::Images {
            channels: 3,
            height: 4,
            width: 5,
            num_classes: 7,
        };
        let a = SyntheticBatch::new(input, 2, 0, 9);
        let b = SyntheticBatch::new(input, 2, 0, 9);
        match (&a, &b) {
            (
                SyntheticBatch::Images { data, labels, .. },
                SyntheticBatch::Images {
                    data: d2,
                    labels: l2,
                    ..
                },
            ) => {
                assert_eq!((data, labels), (d2, l2));
                assert_eq!(data.len(), 2 * 3 * 4 * 5);
                assert!(data.iter().all(|x| (-1.0..1.0).contains(x)));
                assert!(labels.iter().all(|l| (0..7).contains(l)));
            }
            _ => panic!("{a:?}"),
        }
        assert_eq!(a.describe(), "2x3x4x5");
        let t = SyntheticBatch::new(InputSpec::Tokens { vocab: 11 }, 3, 4, 1);
        assert_eq!(t.describe(), "3x4 tokens");
        assert_eq!(t.on(&crate::cpu_device()).batch_size(), 3);
    }

    #[test]
    fn the_cpu_against_itself_is_exact() {
        assert_eq!(matmul_rel_err(&crate::cpu_device(), 64), 0.0);
    }
}
