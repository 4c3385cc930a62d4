//! The trainer's view of a dataset: per-rank training batches addressed by `(epoch, index)`
//! and evaluation batches, both as burn [`Batch`]es on the model's device.
//!
//! Random access by `(epoch, index)` — rather than an iterator — is what makes resume exact:
//! a run restored at step `s` asks for batch `s mod steps_per_epoch` of epoch
//! `s / steps_per_epoch` and gets exactly the samples the uninterrupted run saw (the shard
//! permutation and the augmentation draws are pure functions of the seed, the epoch and the
//! item index).
//!
//! **Sharding.** Every rank computes the same seeded permutation of the training set and
//! takes every `world`-th item ([`dtrain_datasets::ShardSpec`], drop-last). Batch `j` of
//! rank `r` is therefore items `(j·b + i)·P + r` of the permutation, and the union of the P
//! ranks' batch `j` is the contiguous block `j·b·P … (j+1)·b·P` — exactly batch `j` of a
//! single worker with batch `P·b`. That is the data-parallel correctness property the
//! trainer tests rely on.
//!
//! Text (language modelling): the token stream is split into P contiguous rank shards, each
//! cut into `batch_size` BPTT rows; batch `j` is the `j`-th `seq_len` window of every row, so
//! recurrent state carries from batch to batch.

use std::path::Path;
use std::sync::Arc;

use dtrain_datasets::{
    cifar, cifar_like, idx, text, CifarAugment, Corpus, ImageSet, Level, Normalize, ShardSpec,
    Split, SyntheticConfig,
};
use dtrain_models::{Batch, Device};

use crate::config::{DataKind, RunConfig};

mod prefetch;
use prefetch::Prefetch;

/// Why data could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DataError(pub String);

enum Source {
    Images {
        train: ImageSet,
        test: ImageSet,
        normalize: Option<Normalize>,
        augment: Option<CifarAugment>,
    },
    /// One seeded set: items `0..train_len` train, the next `test_len` test (same class
    /// prototypes, fresh noise).
    Synthetic {
        set: dtrain_datasets::Synthetic,
        train_len: usize,
        test_len: usize,
    },
    Text {
        /// This rank's training rows, `batch` × `row_len`.
        rows: Vec<u32>,
        row_len: usize,
        /// This rank's test rows.
        test_rows: Vec<u32>,
        test_row_len: usize,
        vocab: usize,
        seq_len: usize,
    },
}

/// One rank's data.
pub struct TrainData {
    src: Arc<Source>,
    /// Assembles the next training batch of images in the background (when the host has a
    /// core that no worker's compute threads use).
    prefetch: Option<Prefetch>,
    shard: ShardSpec,
    batch: usize,
    eval_batch: usize,
    /// Per-epoch shard indices, cached for the current epoch.
    cached: Option<(u64, Vec<usize>)>,
    /// An epoch whose batches are shifted by this many positions of the epoch's
    /// permutation ([`TrainData::shift_epoch`]: resuming on another worker count).
    shift: Option<(u64, i64)>,
    train_len: usize,
    test_len: usize,
    scratch: Vec<f32>,
    labels: Vec<i64>,
}

fn rgb_normalize(set: &ImageSet, kind: DataKind) -> Normalize {
    match kind {
        DataKind::Mnist | DataKind::FashionMnist if set.shape()[0] == 1 => Normalize::mnist(),
        DataKind::Cifar10 => Normalize::cifar10(),
        _ => Normalize::fit(set),
    }
}

impl TrainData {
    /// Number of examples in the (limited) training set, or tokens for text: what
    /// [`RunConfig::validate`] needs to derive the steps per epoch.
    pub fn train_examples(&self) -> usize {
        self.train_len
    }

    /// Opens the data of `cfg` for `rank` of `world`.
    pub fn open(cfg: &RunConfig, rank: usize, world: usize) -> Result<TrainData, DataError> {
        let d = &cfg.data;
        let dir = cfg.data_dir();
        let missing = |e: &dyn std::fmt::Display| {
            let fetch = d
                .kind
                .fetch_name()
                .map(|n| {
                    if n == "cifar10" {
                        "; import it with `dtrain data fetch cifar10 --from cifar-10-binary.tar.gz`"
                            .to_string()
                    } else {
                        format!("; fetch it with `dtrain data fetch {n}`")
                    }
                })
                .unwrap_or_default();
            DataError(format!("data.kind = {:?}: {e}{fetch}", d.kind.name()))
        };
        let eval_default = 256;
        let src = match d.kind {
            DataKind::Synthetic => {
                let shape = d.shape.clone().unwrap_or_default();
                let classes = d.classes.unwrap_or(10);
                let train_len = d
                    .train_limit
                    .unwrap_or(usize::MAX)
                    .min(d.train_len.unwrap_or(1024));
                let test_len = d
                    .test_limit
                    .unwrap_or(usize::MAX)
                    .min(d.test_len.unwrap_or(256));
                let mut sc = SyntheticConfig::new(&shape, train_len + test_len, cfg.seed);
                sc.num_classes = classes;
                Source::Synthetic {
                    set: sc.init(),
                    train_len,
                    test_len,
                }
            }
            DataKind::Mnist | DataKind::FashionMnist | DataKind::Cifar10 | DataKind::CifarLike => {
                let dir = dir.expect("image kinds have a directory");
                let load = |split| -> Result<ImageSet, DataError> {
                    check_dir(&dir).map_err(|e| missing(&e))?;
                    match d.kind {
                        DataKind::Cifar10 => cifar::load_cifar10_dir(&dir, split),
                        DataKind::CifarLike => cifar_like::load_cifar_like(&dir, split),
                        _ => idx::load_mnist_dir(&dir, split),
                    }
                    .map_err(|e| missing(&e))
                };
                let mut train = load(Split::Train)?;
                let mut test = load(Split::Test)?;
                if let Some(n) = d.train_limit {
                    train.truncate(n);
                }
                if let Some(n) = d.test_limit {
                    test.truncate(n);
                }
                let normalize = d.normalize.then(|| rgb_normalize(&train, d.kind));
                let augment = d.augment.then(|| CifarAugment::new(cfg.seed ^ 0xa06));
                Source::Images {
                    train,
                    test,
                    normalize,
                    augment,
                }
            }
            DataKind::MobyDick | DataKind::Sotu => {
                let dir = dir.expect("text kinds have a directory");
                check_dir(&dir).map_err(|e| missing(&e))?;
                let level = if d.kind == DataKind::MobyDick {
                    Level::Char
                } else {
                    Level::Word
                };
                let file = find_text(&dir).map_err(|e| missing(&e))?;
                let corpus = Corpus::from_file(&file, level, d.min_count.unwrap_or(1))
                    .map_err(|e| missing(&e))?;
                let (train_ids, _, test_ids) = corpus.split(0.0, d.test_fraction.unwrap_or(0.1));
                let mut train_ids = train_ids.to_vec();
                let mut test_ids = test_ids.to_vec();
                if let Some(n) = d.train_limit {
                    train_ids.truncate(n);
                }
                if let Some(n) = d.test_limit {
                    test_ids.truncate(n);
                }
                let seq_len = d.seq_len();
                let mine = text::shard_tokens(&train_ids, rank, world);
                let row_len = mine.len() / d.batch_size;
                let test_mine = text::shard_tokens(&test_ids, rank, world);
                let eval_rows = d.eval_batch_size.unwrap_or(d.batch_size).max(1);
                let test_row_len = test_mine.len() / eval_rows;
                Source::Text {
                    rows: mine[..row_len * d.batch_size].to_vec(),
                    row_len,
                    test_rows: test_mine[..test_row_len * eval_rows].to_vec(),
                    test_row_len,
                    vocab: corpus.vocab.len(),
                    seq_len,
                }
            }
        };
        let (train_len, test_len) = match &src {
            Source::Images { train, test, .. } => (train.len(), test.len()),
            Source::Synthetic {
                train_len,
                test_len,
                ..
            } => (*train_len, *test_len),
            Source::Text { .. } => {
                // Report the whole stream length for the steps-per-epoch derivation.
                (0, 0)
            }
        };
        let mut shard = ShardSpec::new(rank, world, cfg.seed);
        shard.shuffle = d.shuffle;
        let src = Arc::new(src);
        // Only on a core no worker computes on: where every core runs a worker's compute
        // threads, the thread slows the forward pass by what it saves (measured: issue 25's
        // MLP, 2 workers on 2 cores: data 3.0 → 1.2 ms, forward +2 ms, step unchanged).
        // Without it the batches are assembled inline, as they are for text.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let spare_core = cores > world * cfg.cluster.threads.max(1);
        let prefetch = match *src {
            Source::Text { .. } => None,
            _ if !spare_core => None,
            _ => Prefetch::start(src.clone()).ok(),
        };
        let mut me = TrainData {
            src,
            prefetch,
            shard,
            batch: d.batch_size,
            eval_batch: d.eval_batch_size.unwrap_or(eval_default),
            cached: None,
            shift: None,
            train_len,
            test_len,
            scratch: Vec::new(),
            labels: Vec::new(),
        };
        if let Source::Text { row_len, .. } = &*me.src {
            // Tokens as the validator counts them: rows × row_len × world.
            me.train_len = row_len * me.batch * world;
            me.eval_batch = d.eval_batch_size.unwrap_or(d.batch_size).max(1);
        }
        Ok(me)
    }

    /// The vocabulary size of a text dataset (the LSTM's `vocab` must match).
    pub fn vocab(&self) -> Option<usize> {
        match &*self.src {
            Source::Text { vocab, .. } => Some(*vocab),
            _ => None,
        }
    }

    /// Full training batches per epoch on this rank.
    pub fn batches_per_epoch(&self) -> usize {
        match &*self.src {
            Source::Text {
                row_len, seq_len, ..
            } => row_len.saturating_sub(1).div_ceil(*seq_len),
            _ => self.train_len / self.shard.world_size / self.batch,
        }
    }

    /// Shifts the batches of `epoch` (images only) by `delta` positions of the epoch's
    /// permutation: batch `j` of rank `r` becomes items `(j·b + i)·P + r + delta` instead of
    /// `(j·b + i)·P + r`. A run resumed on another worker count continues an epoch from the
    /// sample where the checkpoint left it this way (see `trainer::elastic`). Positions
    /// outside the permutation (batches the resumed run never asks for) read its first item.
    pub fn shift_epoch(&mut self, epoch: u64, delta: i64) {
        self.shift = Some((epoch, delta));
        self.cached = None;
    }

    /// The dataset items of this rank's batch `index` of `epoch`, in order (images; empty
    /// for text, whose batches are windows of the rank's rows).
    pub fn batch_items(&mut self, epoch: u64, index: usize) -> Vec<usize> {
        if matches!(*self.src, Source::Text { .. }) {
            return Vec::new();
        }
        let (cached_epoch, idx) = match self.cached.take() {
            Some((e, idx)) if e == epoch => (e, idx),
            _ => (epoch, self.epoch_indices(epoch)),
        };
        let items = idx[index * self.batch..(index + 1) * self.batch].to_vec();
        self.cached = Some((cached_epoch, idx));
        items
    }

    /// This rank's items of `epoch`, in order: its shard, or the shifted positions of
    /// [`TrainData::shift_epoch`].
    fn epoch_indices(&self, epoch: u64) -> Vec<usize> {
        match self.shift {
            Some((e, delta)) if e == epoch => {
                let perm = self.shard.permutation(self.train_len, epoch);
                let (r, w) = (self.shard.rank, self.shard.world_size);
                let last = perm.len().saturating_sub(1) as i64;
                (0..self.train_len / w)
                    .map(|k| perm[((k * w + r) as i64 + delta).clamp(0, last) as usize])
                    .collect()
            }
            _ => self.shard.indices(self.train_len, epoch),
        }
    }

    /// Batch `index` of `epoch` for this rank.
    pub fn train_batch(&mut self, epoch: u64, index: usize, device: &Device) -> Batch {
        match &*self.src {
            Source::Text {
                rows,
                row_len,
                seq_len,
                ..
            } => text_window(rows, *row_len, self.batch, *seq_len, index, device),
            _ => {
                let (cached_epoch, idx) = match self.cached.take() {
                    Some((e, idx)) if e == epoch => (e, idx),
                    _ => (epoch, self.epoch_indices(epoch)),
                };
                let items = &idx[index * self.batch..(index + 1) * self.batch];
                let (data, labels) = (&mut self.scratch, &mut self.labels);
                let ready = self
                    .prefetch
                    .as_mut()
                    .and_then(|p| p.take_into(epoch, items, data, labels));
                let shape = ready
                    .unwrap_or_else(|| fill_images(&self.src, items, Some(epoch), data, labels));
                let b = images_batch(data, labels, shape, device);
                // The next batch of the epoch (the trainer asks for them in order), while the
                // model computes on this one.
                let next = (index + 1) * self.batch..(index + 2) * self.batch;
                if let (Some(p), Some(items)) = (self.prefetch.as_mut(), idx.get(next)) {
                    p.request(epoch, items);
                }
                self.cached = Some((cached_epoch, idx));
                b
            }
        }
    }

    /// Number of evaluation batches of this rank: the test set is split into `world`
    /// contiguous parts, so every example is scored exactly once over all ranks.
    pub fn eval_batches(&self) -> usize {
        match &*self.src {
            Source::Text {
                test_row_len,
                seq_len,
                ..
            } => test_row_len.saturating_sub(1).div_ceil(*seq_len),
            _ => {
                let (lo, hi) = self.eval_range();
                (hi - lo).div_ceil(self.eval_batch)
            }
        }
    }

    fn eval_range(&self) -> (usize, usize) {
        let w = self.shard.world_size;
        let r = self.shard.rank;
        let per = self.test_len.div_ceil(w);
        (
            (r * per).min(self.test_len),
            ((r + 1) * per).min(self.test_len),
        )
    }

    /// Evaluation batch `j` of this rank (see [`TrainData::eval_batches`]).
    pub fn eval_batch(&mut self, j: usize, device: &Device) -> Batch {
        match &*self.src {
            Source::Text {
                test_rows,
                test_row_len,
                seq_len,
                ..
            } => text_window(
                test_rows,
                *test_row_len,
                self.eval_batch,
                *seq_len,
                j,
                device,
            ),
            _ => {
                let (lo, hi) = self.eval_range();
                let a = lo + j * self.eval_batch;
                let b = (a + self.eval_batch).min(hi);
                let items: Vec<usize> = (a..b).collect();
                self.image_batch(&items, None, device)
            }
        }
    }

    /// Assembles images `items` (train set if `epoch` is given, else test set).
    fn image_batch(&mut self, items: &[usize], epoch: Option<u64>, device: &Device) -> Batch {
        let (data, labels) = (&mut self.scratch, &mut self.labels);
        let shape = fill_images(&self.src, items, epoch, data, labels);
        images_batch(data, labels, shape, device)
    }
}

/// The batch of the images in `data` (each `[c, h, w]`) and their `labels`.
fn images_batch(data: &[f32], labels: &[i64], [c, h, w]: [usize; 3], device: &Device) -> Batch {
    Batch::images_from_slice(data, [labels.len(), c, h, w], labels, device)
}

/// Draws `items` of `src` (training items of `epoch`, or test items for `None`) — augmented
/// and normalised as configured — into `data` and their labels into `labels` (both cleared);
/// returns the `[c, h, w]` of an item. Images and synthetic data only.
fn fill_images(
    src: &Source,
    items: &[usize],
    epoch: Option<u64>,
    data: &mut Vec<f32>,
    labels: &mut Vec<i64>,
) -> [usize; 3] {
    data.clear();
    labels.clear();
    let mut shape = [0usize; 3];
    for &i in items {
        let mut s = match (src, epoch) {
            (Source::Images { train, .. }, Some(_)) => train.sample(i),
            (Source::Images { test, .. }, None) => test.sample(i),
            (Source::Synthetic { set, .. }, Some(_)) => set.sample(i),
            (Source::Synthetic { set, train_len, .. }, None) => set.sample(train_len + i),
            (Source::Text { .. }, _) => unreachable!("text has no images"),
        };
        if let Source::Images {
            normalize, augment, ..
        } = src
        {
            if let (Some(a), Some(e)) = (augment, epoch) {
                a.apply(&mut s, e, i);
            }
            if let Some(n) = normalize {
                n.apply(&mut s);
            }
        }
        shape = [s.shape[0], s.shape[1], s.shape[2]];
        data.extend_from_slice(&s.data);
        labels.push(s.label as i64);
    }
    shape
}

fn text_window(
    rows: &[u32],
    row_len: usize,
    batch: usize,
    seq_len: usize,
    index: usize,
    device: &Device,
) -> Batch {
    let pos = index * seq_len;
    let seq = seq_len.min(row_len - 1 - pos);
    let mut inputs = Vec::with_capacity(batch * seq);
    let mut targets = Vec::with_capacity(batch * seq);
    for b in 0..batch {
        let row = &rows[b * row_len..(b + 1) * row_len];
        inputs.extend(row[pos..pos + seq].iter().map(|&t| t as i64));
        targets.extend(row[pos + 1..pos + 1 + seq].iter().map(|&t| t as i64));
    }
    Batch::tokens_from_slice(&inputs, &targets, [batch, seq], device)
}

fn check_dir(dir: &Path) -> Result<(), String> {
    if dir.is_dir() {
        Ok(())
    } else {
        Err(format!("no data directory {}", dir.display()))
    }
}

/// The text file of a fetched corpus directory (the largest `.txt` file).
fn find_text(dir: &Path) -> Result<std::path::PathBuf, String> {
    let mut best: Option<(u64, std::path::PathBuf)> = None;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))?;
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "txt") {
                let len = e.metadata().map(|m| m.len()).unwrap_or(0);
                if best.as_ref().is_none_or(|b| len > b.0) {
                    best = Some((len, p));
                }
            }
        }
    }
    best.map(|b| b.1)
        .ok_or_else(|| format!("no .txt file under {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(world: usize, rank: usize) -> TrainData {
        let text =
            "name = \"d\"\nseed = 9\n[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\n\
                    shape = [1, 4, 4]\ntrain_len = 512\ntest_len = 16\nbatch_size = 8\n\
                    [train]\nlr = 0.1\n";
        let cfg = RunConfig::parse(text, "d.toml", &[]).unwrap();
        TrainData::open(&cfg, rank, world).unwrap()
    }

    /// The items all `world` ranks see in batch `j` of `epoch`, sorted.
    fn step_items(ranks: &mut [TrainData], epoch: u64, j: usize) -> Vec<usize> {
        let mut v: Vec<usize> = ranks
            .iter_mut()
            .flat_map(|d| d.batch_items(epoch, j))
            .collect();
        v.sort_unstable();
        v
    }

    fn sorted(s: &[usize]) -> Vec<usize> {
        let mut v = s.to_vec();
        v.sort_unstable();
        v
    }

    /// The images and labels of a training batch, as host values.
    fn host(b: Batch) -> (Vec<f32>, Vec<i32>) {
        match b {
            Batch::Images { images, labels } => (
                images.into_data().try_to_vec().unwrap(),
                labels.into_data().try_to_vec().unwrap(),
            ),
            Batch::Tokens { .. } => unreachable!("images"),
        }
    }

    #[test]
    fn prefetched_batches_are_the_inline_ones_in_any_order_of_requests() {
        let device = dtrain_models::cpu_device();
        let mut fetched = open(2, 1);
        let mut inline = open(2, 1);
        // (Whatever the cores of the machine running the test.)
        if fetched.prefetch.is_none() {
            fetched.prefetch = Some(Prefetch::start(fetched.src.clone()).unwrap());
        }
        inline.prefetch = None;
        // In order (each prefetched while the last is used), across an epoch boundary and
        // the epoch's last batch, then out of order (a resume), and a repeat.
        let last = fetched.batches_per_epoch() - 1;
        let order = [
            (0, 0),
            (0, 1),
            (0, 2),
            (0, last - 1),
            (0, last),
            (1, 0),
            (1, 1),
        ];
        for (epoch, j) in order.into_iter().chain([(1, 5), (0, 3), (0, 3), (0, 4)]) {
            let a = host(fetched.train_batch(epoch, j, &device));
            let b = host(inline.train_batch(epoch, j, &device));
            assert_eq!(a, b, "epoch {epoch} batch {j}");
            assert_eq!(a.1.len(), 8);
        }
        // A shifted epoch (resumed on another worker count) is asked for anew.
        fetched.shift_epoch(1, -3);
        inline.shift_epoch(1, -3);
        for j in [2, 3] {
            let a = host(fetched.train_batch(1, j, &device));
            assert_eq!(
                a,
                host(inline.train_batch(1, j, &device)),
                "shifted batch {j}"
            );
        }
    }

    #[test]
    fn a_shifted_epoch_continues_at_the_sample_where_another_worker_count_stopped() {
        let perm = ShardSpec::new(0, 1, 9).permutation(512, 1);
        // Two workers (16 samples a step) take 5 steps of epoch 1: positions 0 … 79.
        let mut two: Vec<TrainData> = (0..2).map(|r| open(2, r)).collect();
        for j in 0..5 {
            assert_eq!(
                step_items(&mut two, 1, j),
                sorted(&perm[j * 16..(j + 1) * 16])
            );
        }
        // Four workers (32 a step) continue at batch 3, shifted by 80 − 3·32 = −16: from
        // position 80 on, every sample once, up to the last full step.
        let mut four: Vec<TrainData> = (0..4).map(|r| open(4, r)).collect();
        for d in &mut four {
            d.shift_epoch(1, -16);
        }
        for j in 3..16 {
            let lo = 80 + (j - 3) * 32;
            assert_eq!(
                step_items(&mut four, 1, j),
                sorted(&perm[lo..lo + 32]),
                "{j}"
            );
        }
        // Other epochs are not shifted.
        let plain: Vec<usize> = (0..4).flat_map(|r| open(4, r).batch_items(2, 0)).collect();
        assert_eq!(
            sorted(&plain),
            step_items(&mut four, 2, 0),
            "epoch 2 is the usual one"
        );
    }
}
