//! Which host a worker is on: the grouping of the hierarchical all-reduce
//! ([`dtrain_comms::algo::hierarchical`]).
//!
//! Every worker reports a **host key** once at start-up, and the ranks exchange them in one
//! all-gather ([`Topology::gather`]), so every rank holds the same grouping whatever started
//! it:
//!
//! * started by `dtrain run --nnodes M --node-rank i`, the key is the launcher's node,
//!   `node i` ([`NODE_ENV`], set for its workers by the node launcher): node launchers on
//!   one machine (tests, or a machine split into "hosts") stay apart;
//! * otherwise — a standalone `dtrain run`, ranks started by Slurm or `mpirun` — the key is
//!   the machine's host name (`/proc/sys/kernel/hostname`, else `$HOSTNAME`), so ranks that
//!   a scheduler placed on one machine are grouped, whatever the transport.
//!
//! A standalone run's workers share one host, and a run with one worker per host has no
//! hierarchy: both keep the flat all-reduce ([`Topology::is_hierarchical`]).

use dtrain_comms::topology::Topology;
use dtrain_comms::{CommError, Communicator, Transport};

/// The environment variable carrying the node launcher's `--node-rank` to its workers
/// (set only with `--nnodes` above 1).
pub const NODE_ENV: &str = "DTRAIN_NODE_RANK";

/// This worker's host key (see the [module docs](self)), at most
/// [`MAX_KEY_LEN`](dtrain_comms::topology::MAX_KEY_LEN) bytes (keys are bounded on the wire;
/// a longer host name is cut at a character boundary).
pub fn host_key() -> String {
    let mut key = match std::env::var(NODE_ENV) {
        Ok(node) => format!("node {}", node.trim()),
        Err(_) => {
            let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .or_else(|| std::env::var("HOSTNAME").ok())
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty());
            format!("host {}", name.as_deref().unwrap_or("localhost"))
        }
    };
    while key.len() > dtrain_comms::topology::MAX_KEY_LEN {
        key.pop();
    }
    key
}

/// The run's topology, learnt from every rank's [`host_key`] (one all-gather; none for a
/// single worker).
pub fn discover<T: Transport>(comm: &mut Communicator<T>) -> Result<Topology, CommError> {
    if comm.world_size() == 1 {
        return Ok(Topology::single_host(1));
    }
    Topology::gather(comm, &host_key())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_learns_the_same_grouping() {
        let out: Vec<Topology> = std::thread::scope(|s| {
            let hs: Vec<_> = dtrain_comms::channel_mesh(3)
                .into_iter()
                .map(|t| {
                    s.spawn(move || {
                        let mut c = Communicator::new(t, dtrain_comms::CommConfig::default());
                        discover(&mut c).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Threads of one process: one host (unless a node launcher set the variable, which
        // it sets for every worker alike).
        for t in &out {
            assert_eq!(t, &out[0]);
            assert_eq!(t.hosts(), 1);
            assert!(!t.is_hierarchical());
        }
        assert!(host_key().starts_with("host ") || host_key().starts_with("node "));
    }
}
