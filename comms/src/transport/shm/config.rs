//! [`ShmConfig`] (run identity, ring sizes, timeouts, spinning, liveness) and what a
//! launcher asks before picking this driver — do the ranks share a host
//! ([`same_host`]), is there room in the segment directory ([`ShmConfig::mesh_bytes`],
//! [`free_bytes`]) — and after ([`leftover_segments`]).

use std::path::PathBuf;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::{segment, sys};
use crate::shaping::LinkSpec;

/// Spin time before sleeping when the host has a CPU per rank (see [`ShmConfig::spin`]).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(20);

/// Configuration of a [`ShmTransport`].
///
/// [`ShmTransport`]: super::ShmTransport
#[derive(Clone, PartialEq)]
pub struct ShmConfig {
    /// The run token: a peer's segment must carry its hash.
    pub token: Vec<u8>,
    /// Identifies the run among others on the host (segment names derive from it); every
    /// rank of a run must use the same value, and concurrent runs different ones.
    pub run_id: Vec<u8>,
    /// Capacity of each ring (one per ordered pair of ranks), rounded up to a power of two
    /// of at least 4 KiB. A host holds `N·(N−1)` rings, reserved up front. Default 4 MiB.
    pub ring_bytes: usize,
    /// Largest message sent or accepted, in bytes after the length prefix (as for TCP).
    /// Default 64 MiB.
    pub max_frame: usize,
    /// How long set-up may take. Default 30 s.
    pub connect_timeout: Duration,
    /// How long dropping the transport waits to flush queued frames. Default 10 s.
    pub linger: Duration,
    /// Egress link emulation of this rank (see [`crate::shaping`]). Default unshaped.
    pub link: LinkSpec,
    /// How long a waiting receiver or writer spins before it sleeps. Default `None`:
    /// [`DEFAULT_SPIN`] when the host has at least as many CPUs as the world has ranks,
    /// else no spinning (a spinning rank would take the CPU of the rank it waits for).
    pub spin: Option<Duration>,
    /// How often a waiting rank checks that its peers' processes are alive, and so the
    /// bound on noticing a killed peer. Default 50 ms.
    pub liveness_interval: Duration,
    /// Directory of the segments (a tmpfs). Default `/dev/shm`.
    pub dir: PathBuf,
}

impl std::fmt::Debug for ShmConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmConfig")
            .field("token", &"<redacted>")
            .field("run_id", &String::from_utf8_lossy(&self.run_id))
            .field("ring_bytes", &self.ring_bytes)
            .field("max_frame", &self.max_frame)
            .field("connect_timeout", &self.connect_timeout)
            .field("linger", &self.linger)
            .field("link", &self.link)
            .field("spin", &self.spin)
            .field("liveness_interval", &self.liveness_interval)
            .field("dir", &self.dir)
            .finish()
    }
}

impl ShmConfig {
    /// Defaults with the given run token and run id.
    pub fn new(token: impl Into<Vec<u8>>, run_id: impl Into<Vec<u8>>) -> Self {
        ShmConfig {
            token: token.into(),
            run_id: run_id.into(),
            ring_bytes: 4 << 20,
            max_frame: 64 << 20,
            connect_timeout: Duration::from_secs(30),
            linger: Duration::from_secs(10),
            link: LinkSpec::default(),
            spin: None,
            liveness_interval: Duration::from_millis(50),
            dir: PathBuf::from("/dev/shm"),
        }
    }

    /// Defaults for the ranks of a finished rendezvous: the run id is derived from what
    /// every rank received (all ranks' addresses and the run certificate), which no other
    /// live run shares.
    #[cfg(feature = "tcp")]
    pub fn from_joined(token: impl Into<Vec<u8>>, joined: &crate::rendezvous::Joined) -> Self {
        let mut id = Sha256::new();
        id.update(b"dtrain-shm rendezvous run\0");
        id.update((joined.world as u64).to_le_bytes());
        for a in &joined.peers {
            id.update(a.to_string().as_bytes());
            id.update([0]);
        }
        id.update(&joined.identity.cert_der);
        Self::new(token, hex(&id.finalize()[..16]))
    }

    /// The path of `rank`'s segment while the mesh forms (removed once every peer mapped
    /// it, or when set-up fails).
    pub fn segment_path(&self, rank: usize) -> PathBuf {
        let mut h = Sha256::new();
        h.update(b"dtrain-shm run id\0");
        h.update(&self.run_id);
        self.dir
            .join(format!("dtrain-{}-{rank}", hex(&h.finalize()[..8])))
    }

    pub(super) fn token_hash(&self) -> [u64; 4] {
        let mut h = Sha256::new();
        h.update(b"dtrain-shm run token\0");
        h.update(&self.token);
        let d = h.finalize();
        std::array::from_fn(|i| u64::from_le_bytes(d[i * 8..i * 8 + 8].try_into().expect("8")))
    }

    /// The spin time for a world of `world` ranks (see [`ShmConfig::spin`]).
    pub fn spin_for(&self, world: usize) -> Duration {
        self.spin.unwrap_or_else(|| {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            if world <= cpus {
                DEFAULT_SPIN
            } else {
                Duration::ZERO
            }
        })
    }

    /// Bytes of [`ShmConfig::dir`] a mesh of `world` ranks reserves with this configuration
    /// (every rank's segment: a header page, and a control page and a ring per peer), so a
    /// launcher can check the space before it picks this driver.
    pub fn mesh_bytes(&self, world: usize) -> u64 {
        world as u64 * segment::segment_len(world, self.ring_capacity()) as u64
    }

    pub(super) fn ring_capacity(&self) -> usize {
        self.ring_bytes
            .clamp(segment::PAGE, 1 << 30)
            .next_power_of_two()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Whether every rank's address (as a rendezvous hands them out) points at one host: all
/// loopback, or all the same IP address. A heuristic for choosing this driver: ranks that
/// do not in fact share `/dev/shm` (separate containers behind one address) make
/// [`ShmTransport::connect`] fail naming the ranks whose segments never appeared, so a
/// launcher should try it with a short [`ShmConfig::connect_timeout`] and have all ranks
/// agree on the outcome before falling back.
///
/// [`ShmTransport::connect`]: super::ShmTransport::connect
pub fn same_host(addrs: &[std::net::SocketAddr]) -> bool {
    let all_loopback = addrs.iter().all(|a| a.ip().is_loopback());
    all_loopback || addrs.windows(2).all(|w| w[0].ip() == w[1].ip())
}

/// Free bytes of the file system holding `dir` that an unprivileged process may use
/// (`statvfs`: available blocks × fragment size). On Docker's default `/dev/shm` this is
/// 64 MiB, less what other processes hold.
pub fn free_bytes(dir: &std::path::Path) -> std::io::Result<u64> {
    sys::free_bytes(dir)
}

/// The segment files of the run of `cfg` (ranks `0..world`) that still exist: none once
/// a mesh is up or its set-up failed (a process killed during set-up leaves its own).
pub fn leftover_segments(cfg: &ShmConfig, world: usize) -> Vec<PathBuf> {
    (0..world)
        .map(|r| cfg.segment_path(r))
        .filter(|p| p.exists())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mesh_bytes_counts_every_segment_with_rounded_rings() {
        let page = 4096u64;
        let cfg = ShmConfig::new(b"t".to_vec(), b"r".to_vec());
        assert_eq!(cfg.mesh_bytes(2), 2 * (page + page + (4 << 20)));
        assert_eq!(cfg.mesh_bytes(1), page);
        // 5000 bytes round up to an 8 KiB ring; 3 ranks hold 2 rings each.
        let small = ShmConfig {
            ring_bytes: 5000,
            ..cfg
        };
        assert_eq!(small.mesh_bytes(3), 3 * (page + 2 * (page + 8192)));
    }

    #[test]
    fn same_host_by_address_and_config_derivations() {
        let a = |s: &str| s.parse::<std::net::SocketAddr>().unwrap();
        assert!(same_host(&[a("127.0.0.1:1"), a("127.0.0.2:2")]));
        assert!(same_host(&[a("10.0.0.5:1"), a("10.0.0.5:2")]));
        assert!(!same_host(&[a("10.0.0.5:1"), a("10.0.0.6:1")]));
        assert!(same_host(&[]));
        let c = ShmConfig::new(b"t".to_vec(), b"run".to_vec());
        assert_ne!(c.segment_path(0), c.segment_path(1));
        let other = ShmConfig::new(b"t".to_vec(), b"run2".to_vec());
        assert_ne!(c.segment_path(0), other.segment_path(0));
        assert_ne!(
            c.token_hash(),
            ShmConfig::new(b"u".to_vec(), b"run".to_vec()).token_hash()
        );
        assert_eq!(c.ring_capacity(), 4 << 20);
        let odd = ShmConfig {
            ring_bytes: 5000,
            ..c.clone()
        };
        assert_eq!(odd.ring_capacity(), 8192);
        let fixed = ShmConfig {
            spin: Some(Duration::ZERO),
            ..c.clone()
        };
        assert_eq!(fixed.spin_for(2), Duration::ZERO);
        assert_eq!(c.spin_for(usize::MAX), Duration::ZERO);
    }
}
