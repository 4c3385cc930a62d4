//! Collating samples into batches.

use burn_dataset::{Dataset, DatasetError};

use crate::error::DataError;
use crate::sample::Sample;

/// A batch ready to become a tensor: `data` is row-major `[n, item shape...]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Values, `shape.iter().product()` of them.
    pub data: Vec<f32>,
    /// `[n, ...]`: the batch size followed by the item shape.
    pub shape: Vec<usize>,
    /// One label per item.
    pub labels: Vec<usize>,
}

impl Batch {
    /// Stacks samples of one shape. Errors on an empty slice or mismatched shapes.
    pub fn collate(items: &[Sample]) -> Result<Batch, DataError> {
        let first = items
            .first()
            .ok_or_else(|| DataError::Invalid("cannot collate an empty batch".into()))?;
        let per: usize = first.shape.iter().product();
        let mut data = Vec::with_capacity(per * items.len());
        for (i, s) in items.iter().enumerate() {
            if s.shape != first.shape || s.data.len() != per {
                return Err(DataError::Invalid(format!(
                    "batch item {i} has shape {:?} ({} values), item 0 has {:?}",
                    s.shape,
                    s.data.len(),
                    first.shape
                )));
            }
            data.extend_from_slice(&s.data);
        }
        let mut shape = vec![items.len()];
        shape.extend_from_slice(&first.shape);
        Ok(Batch {
            data,
            shape,
            labels: items.iter().map(|s| s.label).collect(),
        })
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when the batch holds no items.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
}

/// Iterates over a dataset in index order, `batch_size` items at a time. Shuffling and
/// rank sharding belong to the dataset (see [`ShardedDataset`](crate::shard::ShardedDataset)).
#[derive(Debug)]
pub struct Batcher<'a, D> {
    dataset: &'a D,
    batch_size: usize,
    drop_last: bool,
    pos: usize,
}

impl<'a, D: Dataset<Sample>> Batcher<'a, D> {
    /// A batcher; with `drop_last` a final partial batch is skipped (so every rank does
    /// the same number of steps when shard sizes are equal).
    ///
    /// # Panics
    /// Panics if `batch_size == 0`.
    pub fn new(dataset: &'a D, batch_size: usize, drop_last: bool) -> Self {
        assert!(batch_size > 0, "batch_size must be positive");
        Self {
            dataset,
            batch_size,
            drop_last,
            pos: 0,
        }
    }

    /// Number of batches in a pass.
    pub fn num_batches(&self) -> usize {
        let n = self.dataset.len();
        if self.drop_last {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }
}

impl<D: Dataset<Sample>> Iterator for Batcher<'_, D> {
    type Item = Result<Batch, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        let n = self.dataset.len();
        let end = (self.pos + self.batch_size).min(n);
        if self.pos >= n || (self.drop_last && end - self.pos < self.batch_size) {
            return None;
        }
        let items: Result<Vec<Sample>, DatasetError> =
            (self.pos..end).map(|i| self.dataset.get(i)).collect();
        self.pos = end;
        Some(items.and_then(|v| Batch::collate(&v).map_err(DatasetError::new)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::SyntheticConfig;

    #[test]
    fn batches_have_the_right_shapes() {
        let d = SyntheticConfig::new(&[3, 4], 10, 1).init();
        let b: Vec<Batch> = Batcher::new(&d, 4, false).map(|b| b.unwrap()).collect();
        assert_eq!(b.len(), 3);
        assert_eq!(b[0].shape, vec![4, 3, 4]);
        assert_eq!(b[2].shape, vec![2, 3, 4]);
        assert_eq!(b[0].data.len(), 48);
        assert_eq!(&b[1].data[12..24], d.sample(5).data.as_slice());
        assert_eq!(b[1].labels[1], d.sample(5).label);
        let dropped = Batcher::new(&d, 4, true);
        assert_eq!(dropped.num_batches(), 2);
        assert_eq!(dropped.count(), 2);
    }

    #[test]
    fn mismatched_shapes_are_an_error() {
        let a = SyntheticConfig::new(&[2], 1, 1).init().sample(0);
        let b = SyntheticConfig::new(&[3], 1, 1).init().sample(0);
        assert!(Batch::collate(&[a, b]).is_err());
        assert!(Batch::collate(&[]).is_err());
    }
}
