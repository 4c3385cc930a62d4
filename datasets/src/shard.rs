//! Rank sharding with a seeded per-epoch shuffle.
//!
//! Every rank computes the same permutation of `0..len` from `(seed, epoch)` — no
//! communication needed — and takes every `world_size`-th element starting at its rank.
//! The shards are therefore disjoint and together cover the dataset; [`ShardMode`]
//! decides what happens to the `len % world_size` leftover items, because synchronous
//! data-parallel training needs every rank to run the same number of steps.

use burn_dataset::{Dataset, DatasetError};

use crate::rng::SplitMix64;

/// What to do when `len` is not a multiple of `world_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShardMode {
    /// Disjoint and covering; shard sizes differ by at most one.
    Exact,
    /// Drop the last `len % world_size` items of the permutation: disjoint, equal sizes,
    /// covers all but fewer than `world_size` items (different ones each epoch).
    #[default]
    DropLast,
    /// Repeat the first items of the permutation: equal sizes, covering, and
    /// disjoint except for fewer than `world_size` repeated items.
    Pad,
}

/// Which part of the data one rank sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Shuffle seed; must be the same on every rank.
    pub seed: u64,
    /// Whether to shuffle at all (false: the permutation is the identity).
    pub shuffle: bool,
    /// Treatment of the remainder.
    pub mode: ShardMode,
}

impl ShardSpec {
    /// A shuffled, [`ShardMode::DropLast`] spec.
    ///
    /// # Panics
    /// Panics if `rank >= world_size`.
    pub fn new(rank: usize, world_size: usize, seed: u64) -> Self {
        assert!(rank < world_size, "rank {rank} >= world_size {world_size}");
        Self {
            rank,
            world_size,
            seed,
            shuffle: true,
            mode: ShardMode::DropLast,
        }
    }

    /// The permutation of `0..len` for `epoch`, the same on every rank.
    pub fn permutation(&self, len: usize, epoch: u64) -> Vec<usize> {
        let mut perm: Vec<usize> = (0..len).collect();
        if self.shuffle {
            SplitMix64::keyed(&[self.seed, 0x73687566, epoch]).shuffle(&mut perm);
        }
        perm
    }

    /// The dataset indices of this rank for `epoch`, in the order to visit them.
    ///
    /// # Panics
    /// Panics if `rank >= world_size`.
    pub fn indices(&self, len: usize, epoch: u64) -> Vec<usize> {
        assert!(
            self.rank < self.world_size,
            "rank {} >= world_size {}",
            self.rank,
            self.world_size
        );
        let w = self.world_size;
        let mut perm = self.permutation(len, epoch);
        match self.mode {
            ShardMode::Exact => {}
            ShardMode::DropLast => perm.truncate(len - len % w),
            ShardMode::Pad => {
                let pad = (w - len % w) % w;
                if len > 0 {
                    for i in 0..pad {
                        perm.push(perm[i % len]);
                    }
                }
            }
        }
        perm.into_iter().skip(self.rank).step_by(w).collect()
    }
}

/// A rank's view of a dataset: `get(i)` is item `indices[i]` of the inner dataset, in
/// the shuffled order of the current epoch (a PartialDataset-style wrapper).
#[derive(Debug, Clone)]
pub struct ShardedDataset<D> {
    inner: D,
    spec: ShardSpec,
    epoch: u64,
    indices: Vec<usize>,
}

impl<D> ShardedDataset<D> {
    /// Wraps `inner` for `spec`, at epoch 0.
    pub fn new<I>(inner: D, spec: ShardSpec) -> Self
    where
        D: Dataset<I>,
    {
        let indices = spec.indices(inner.len(), 0);
        Self {
            inner,
            spec,
            epoch: 0,
            indices,
        }
    }

    /// Reshuffles for `epoch` (call at the start of every epoch, with the same value on
    /// every rank).
    pub fn set_epoch<I>(&mut self, epoch: u64)
    where
        D: Dataset<I>,
    {
        self.epoch = epoch;
        self.indices = self.spec.indices(self.inner.len(), epoch);
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The inner dataset indices this rank visits this epoch.
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }

    /// The wrapped dataset.
    pub fn inner(&self) -> &D {
        &self.inner
    }
}

impl<D: Dataset<I>, I> Dataset<I> for ShardedDataset<D> {
    /// # Panics
    /// Panics if `index >= len()`.
    fn get(&self, index: usize) -> Result<I, DatasetError> {
        self.inner.get(self.indices[index])
    }

    fn len(&self) -> usize {
        self.indices.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn all(len: usize, w: usize, epoch: u64, mode: ShardMode) -> Vec<Vec<usize>> {
        (0..w)
            .map(|r| {
                let mut s = ShardSpec::new(r, w, 42);
                s.mode = mode;
                s.indices(len, epoch)
            })
            .collect()
    }

    #[test]
    fn exact_is_disjoint_and_covering() {
        for (len, w) in [(10, 3), (12, 4), (7, 7), (3, 5), (0, 2), (1000, 8)] {
            let shards = all(len, w, 1, ShardMode::Exact);
            let mut union: Vec<usize> = shards.concat();
            union.sort();
            assert_eq!(union, (0..len).collect::<Vec<_>>(), "len {len} w {w}");
            let sizes: Vec<usize> = shards.iter().map(|s| s.len()).collect();
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        }
    }

    #[test]
    fn drop_last_is_disjoint_and_equal() {
        for (len, w) in [(10, 3), (12, 4), (1001, 8)] {
            let shards = all(len, w, 3, ShardMode::DropLast);
            let union: HashSet<usize> = shards.iter().flatten().copied().collect();
            assert_eq!(union.len(), len - len % w);
            assert!(shards.iter().all(|s| s.len() == len / w));
        }
    }

    #[test]
    fn pad_is_covering_and_equal() {
        for (len, w) in [(10, 3), (12, 4), (1001, 8), (2, 5)] {
            let shards = all(len, w, 0, ShardMode::Pad);
            let union: HashSet<usize> = shards.iter().flatten().copied().collect();
            assert_eq!(union.len(), len);
            let n = shards[0].len();
            assert!(shards.iter().all(|s| s.len() == n));
            assert_eq!(n, len.div_ceil(w));
        }
    }

    #[test]
    fn shuffle_is_per_epoch_and_identical_on_all_ranks() {
        let a = ShardSpec::new(0, 4, 7);
        let b = ShardSpec::new(3, 4, 7);
        // Every rank derives the same permutation independently.
        assert_eq!(a.permutation(100, 5), b.permutation(100, 5));
        assert_ne!(a.permutation(100, 5), a.permutation(100, 6));
        assert_ne!(
            a.permutation(100, 5),
            ShardSpec::new(0, 4, 8).permutation(100, 5)
        );
        assert_ne!(a.indices(100, 0), a.indices(100, 1));
        let mut s = a;
        s.shuffle = false;
        assert_eq!(s.indices(10, 3), vec![0, 4]);
        s.mode = ShardMode::Exact;
        assert_eq!(s.indices(10, 3), vec![0, 4, 8]);
    }

    #[test]
    fn sharded_dataset_wraps_and_reshuffles() {
        let inner = burn_dataset::InMemDataset::new((0..20u32).collect::<Vec<_>>());
        let mut d = ShardedDataset::new(inner, ShardSpec::new(1, 3, 0));
        assert_eq!(d.len(), 6);
        let e0: Vec<u32> = (0..d.len()).map(|i| d.get(i).unwrap()).collect();
        assert_eq!(
            e0,
            d.indices().iter().map(|&i| i as u32).collect::<Vec<_>>()
        );
        d.set_epoch(1);
        let e1: Vec<u32> = (0..d.len()).map(|i| d.get(i).unwrap()).collect();
        assert_ne!(e0, e1);
        assert_eq!(d.epoch(), 1);
    }

    proptest::proptest! {
        #[test]
        fn shard_properties(len in 0usize..500, w in 1usize..9, epoch in 0u64..4, seed: u64) {
            for mode in [ShardMode::Exact, ShardMode::DropLast, ShardMode::Pad] {
                let shards: Vec<Vec<usize>> = (0..w)
                    .map(|r| ShardSpec { rank: r, world_size: w, seed, shuffle: true, mode }
                        .indices(len, epoch))
                    .collect();
                let total: usize = shards.iter().map(|s| s.len()).sum();
                let distinct: HashSet<usize> = shards.iter().flatten().copied().collect();
                let sizes: HashSet<usize> = shards.iter().map(|s| s.len()).collect();
                proptest::prop_assert!(distinct.iter().all(|&i| i < len));
                match mode {
                    ShardMode::Exact => {
                        proptest::prop_assert_eq!(total, len);
                        proptest::prop_assert_eq!(distinct.len(), len);
                    }
                    ShardMode::DropLast => {
                        proptest::prop_assert_eq!(total, len - len % w);
                        proptest::prop_assert_eq!(distinct.len(), total);
                        proptest::prop_assert_eq!(sizes.len(), 1);
                    }
                    ShardMode::Pad => {
                        proptest::prop_assert_eq!(distinct.len(), len);
                        proptest::prop_assert_eq!(total, len.div_ceil(w) * w);
                        proptest::prop_assert_eq!(sizes.len(), 1);
                    }
                }
            }
        }
    }
}
