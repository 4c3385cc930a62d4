//! [`PsLayout`]: which ranks are workers and which servers, how the model is sharded
//! across the servers, and the staleness bound both machines enforce.

use std::ops::Range;

use crate::comm::CommError;

/// Who does what in a parameter-server run, and how the model is sharded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PsLayout {
    world: usize,
    workers: Vec<usize>,
    servers: Vec<usize>,
    len: usize,
}

impl PsLayout {
    /// `workers` and `servers` are rank lists (each without duplicates, non-empty, ranks
    /// below `world`; a rank may be in both). Server `servers[j]` owns shard `j` of a model
    /// of `len` elements.
    pub fn new(
        world: usize,
        workers: Vec<usize>,
        servers: Vec<usize>,
        len: usize,
    ) -> Result<Self, CommError> {
        for (what, list) in [("workers", &workers), ("servers", &servers)] {
            if list.is_empty() {
                return Err(CommError::InvalidArgument(format!("no {what}")));
            }
            let mut sorted = list.clone();
            sorted.sort_unstable();
            sorted.dedup();
            if sorted.len() != list.len() {
                return Err(CommError::InvalidArgument(format!(
                    "duplicate rank in {what}"
                )));
            }
            if let Some(r) = list.iter().find(|&&r| r >= world) {
                return Err(CommError::InvalidArgument(format!(
                    "{what}: rank {r} out of range for world size {world}"
                )));
            }
        }
        Ok(PsLayout {
            world,
            workers,
            servers,
            len,
        })
    }

    /// Number of ranks of the run.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Worker ranks, in worker order (the order of aggregation).
    pub fn workers(&self) -> &[usize] {
        &self.workers
    }

    /// Server ranks; `servers()[j]` owns shard `j`.
    pub fn servers(&self) -> &[usize] {
        &self.servers
    }

    /// Model length in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the model is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of shards (= servers).
    pub fn num_shards(&self) -> usize {
        self.servers.len()
    }

    /// Element range of shard `j`.
    ///
    /// # Panics
    /// If `j >= num_shards()`.
    pub fn shard_range(&self, j: usize) -> Range<usize> {
        crate::segment_range(self.len, self.servers.len(), j)
    }

    /// The shard `rank` serves, if it is a server.
    pub fn shard_of(&self, rank: usize) -> Option<usize> {
        self.servers.iter().position(|&r| r == rank)
    }

    /// The index of `rank` in the worker list, if it is a worker.
    pub fn worker_index(&self, rank: usize) -> Option<usize> {
        self.workers.iter().position(|&r| r == rank)
    }
}

/// The last step a worker may push once `complete` steps are aggregated, under staleness
/// bound `staleness` (saturating, so `u64::MAX` is unbounded).
pub(super) fn saturating_bound(complete: u64, staleness: u64) -> u64 {
    complete.saturating_add(staleness)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_validated_and_shards_partition_the_model() {
        assert!(PsLayout::new(2, vec![], vec![0], 5).is_err());
        assert!(PsLayout::new(2, vec![0, 0], vec![1], 5).is_err());
        assert!(PsLayout::new(2, vec![0], vec![2], 5).is_err());
        let l = PsLayout::new(3, vec![0, 1, 2], vec![2, 0], 7).unwrap();
        assert_eq!(l.shard_range(0), 0..4);
        assert_eq!(l.shard_range(1), 4..7);
        assert_eq!(l.shard_of(0), Some(1));
        assert_eq!(l.shard_of(1), None);
        assert_eq!(l.worker_index(2), Some(2));
    }
}
