//! Which ranks share a host: the grouping the hierarchical all-reduce
//! ([`crate::algo::hierarchical`]) reduces within before one leader per host crosses the
//! network.
//!
//! A [`Topology`] gives every rank a host, numbered in the order of each host's lowest rank
//! (so rank 0 is on host 0), and makes each host's lowest rank its **leader**. It is built
//! from what launched the ranks, and every rank must hold the same one (the hierarchical
//! all-reduce reports ranks that disagree as a mismatch or a protocol error, never a wrong
//! sum):
//!
//! * [`Topology::from_nodes`]: a launcher that started `world / nodes` consecutive ranks on
//!   each of `nodes` nodes (`dtrain run --nnodes M --node-rank i`);
//! * [`Topology::from_keys`]: ranks started by a scheduler or `mpirun`, grouped by a key each
//!   reported (its host name), e.g. after [`Topology::gather`] exchanged them;
//! * [`Topology::single_host`] and [`Topology::one_per_host`]: the two trivial groupings, for
//!   which the hierarchical all-reduce has nothing to gain
//!   ([`Topology::is_hierarchical`] is false).

use crate::comm::{CommError, Communicator};
use crate::transport::Transport;

/// Longest host key [`Topology::gather`] accepts, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// The hosts of a run's ranks (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Host of each rank.
    host_of: Vec<usize>,
    /// Ranks of each host, ascending.
    members: Vec<Vec<usize>>,
}

impl Topology {
    /// Groups the ranks by their hosts' numbers (any numbering: hosts are renumbered in the
    /// order of their lowest rank).
    fn from_host_ids(ids: &[usize]) -> Self {
        let mut renumber: Vec<(usize, usize)> = Vec::new();
        let mut host_of = Vec::with_capacity(ids.len());
        let mut members: Vec<Vec<usize>> = Vec::new();
        for (rank, &id) in ids.iter().enumerate() {
            let h = match renumber.iter().find(|(k, _)| *k == id) {
                Some(&(_, h)) => h,
                None => {
                    renumber.push((id, members.len()));
                    members.push(Vec::new());
                    members.len() - 1
                }
            };
            host_of.push(h);
            members[h].push(rank);
        }
        Topology { host_of, members }
    }

    /// Every rank on one host.
    pub fn single_host(world: usize) -> Self {
        Self::from_host_ids(&vec![0; world])
    }

    /// Every rank on its own host.
    pub fn one_per_host(world: usize) -> Self {
        Self::from_host_ids(&(0..world).collect::<Vec<_>>())
    }

    /// `world` ranks started by `nodes` launchers, `world / nodes` consecutive ranks each:
    /// rank `r` is on node `r / (world / nodes)`.
    ///
    /// # Errors
    /// When `nodes` is 0 or does not divide `world`.
    pub fn from_nodes(world: usize, nodes: usize) -> Result<Self, String> {
        if nodes == 0 || !world.is_multiple_of(nodes) {
            return Err(format!(
                "{world} ranks cannot be split evenly over {nodes} nodes"
            ));
        }
        let per = world / nodes;
        Ok(Self::from_host_ids(
            &(0..world).map(|r| r / per.max(1)).collect::<Vec<_>>(),
        ))
    }

    /// Ranks grouped by equal keys (`keys[r]` is rank `r`'s, e.g. its host name).
    pub fn from_keys<K: AsRef<str>>(keys: &[K]) -> Self {
        let mut distinct: Vec<&str> = Vec::new();
        let ids: Vec<usize> = keys
            .iter()
            .map(|k| {
                let k = k.as_ref();
                match distinct.iter().position(|d| *d == k) {
                    Some(i) => i,
                    None => {
                        distinct.push(k);
                        distinct.len() - 1
                    }
                }
            })
            .collect();
        Self::from_host_ids(&ids)
    }

    /// Learns the run's topology from every rank's `key` (its host name, or the launcher's
    /// node): one all-gather, after which every rank holds the same [`Topology`].
    ///
    /// # Errors
    /// [`CommError::InvalidArgument`] for a key longer than [`MAX_KEY_LEN`] bytes (nothing
    /// is sent); the all-gather's errors (a lost peer is named); and
    /// [`CommError::Protocol`] naming the rank whose key is not UTF-8 or too long.
    pub fn gather<T: Transport>(comm: &mut Communicator<T>, key: &str) -> Result<Self, CommError> {
        if key.len() > MAX_KEY_LEN {
            return Err(CommError::InvalidArgument(format!(
                "host key of {} bytes, over the limit of {MAX_KEY_LEN}",
                key.len()
            )));
        }
        let all = comm.all_gather(key.as_bytes())?;
        let mut keys = Vec::with_capacity(all.len());
        for (rank, k) in all.into_iter().enumerate() {
            match String::from_utf8(k) {
                Ok(s) if s.len() <= MAX_KEY_LEN => keys.push(s),
                _ => {
                    return Err(CommError::Protocol {
                        rank,
                        reported_by: comm.rank(),
                        detail: format!("its host key is not UTF-8 of at most {MAX_KEY_LEN} bytes"),
                    })
                }
            }
        }
        Ok(Self::from_keys(&keys))
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.host_of.len()
    }

    /// Number of hosts.
    pub fn hosts(&self) -> usize {
        self.members.len()
    }

    /// The host of `rank`.
    ///
    /// # Panics
    /// If `rank >= world()`.
    pub fn host_of(&self, rank: usize) -> usize {
        self.host_of[rank]
    }

    /// The ranks of host `host`, ascending (the first is its leader).
    ///
    /// # Panics
    /// If `host >= hosts()`.
    pub fn members(&self, host: usize) -> &[usize] {
        &self.members[host]
    }

    /// The leader (lowest rank) of every host, in host order.
    pub fn leaders(&self) -> Vec<usize> {
        self.members.iter().map(|m| m[0]).collect()
    }

    /// The most ranks any host has.
    pub fn max_per_host(&self) -> usize {
        self.members.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Whether a hierarchical all-reduce differs from the flat one: two hosts or more, one of
    /// them with two ranks or more.
    pub fn is_hierarchical(&self) -> bool {
        self.hosts() >= 2 && self.max_per_host() >= 2
    }

    /// `2 hosts × 2 ranks`, or `3 hosts of 1–2 ranks`.
    pub fn describe(&self) -> String {
        let min = self.members.iter().map(Vec::len).min().unwrap_or(0);
        let max = self.max_per_host();
        let hosts = match self.hosts() {
            1 => "1 host".to_string(),
            h => format!("{h} hosts"),
        };
        if min == max {
            format!("{hosts} × {max} rank{}", if max == 1 { "" } else { "s" })
        } else {
            format!("{hosts} of {min}–{max} ranks")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groupings_number_hosts_by_their_lowest_rank() {
        let t = Topology::from_nodes(6, 3).unwrap();
        assert_eq!((t.hosts(), t.world()), (3, 6));
        assert_eq!(t.members(1), &[2, 3]);
        assert_eq!(t.leaders(), vec![0, 2, 4]);
        assert_eq!(t.host_of(5), 2);
        assert!(t.is_hierarchical());
        assert_eq!(t.describe(), "3 hosts × 2 ranks");
        assert!(Topology::from_nodes(6, 4).is_err() && Topology::from_nodes(6, 0).is_err());

        let t = Topology::from_keys(&["b", "a", "b", "c", "a"]);
        assert_eq!(t.leaders(), vec![0, 1, 3]);
        assert_eq!(t.members(0), &[0, 2]);
        assert_eq!(t.members(1), &[1, 4]);
        assert_eq!(t.describe(), "3 hosts of 1–2 ranks");

        for t in [Topology::single_host(4), Topology::one_per_host(4)] {
            assert!(!t.is_hierarchical(), "{}", t.describe());
        }
        assert_eq!(Topology::single_host(4).describe(), "1 host × 4 ranks");
        assert_eq!(Topology::one_per_host(2).describe(), "2 hosts × 1 rank");
    }
}
