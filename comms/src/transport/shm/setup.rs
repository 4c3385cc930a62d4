//! Mesh set-up: opening every peer's segment (checking its header and the peer's
//! process), and waiting until every peer has attached to this rank's segment.

use std::sync::atomic::Ordering::*;
use std::time::{Duration, Instant};

use super::config::ShmConfig;
use super::segment::{self, Header, Segment};
use super::sys::{self, Process};
use crate::transport::TransportError;

/// Opens every peer's segment (retrying until it exists), checks it and attaches to this
/// rank's ring in it; `segs[p]` receives peer `p`'s.
pub(super) fn open_peers(
    cfg: &ShmConfig,
    rank: usize,
    token_hash: &[u64; 4],
    own: &Header,
    deadline: Instant,
    segs: &mut [Option<Segment>],
) -> Result<(), TransportError> {
    let world = segs.len();
    let mut missing: Vec<usize> = (0..world).filter(|&p| p != rank).collect();
    let mut pause = Duration::from_micros(200);
    loop {
        let mut still = Vec::new();
        for p in missing {
            match segment::open(&cfg.segment_path(p), p, rank, world, token_hash)? {
                Some(seg) => {
                    if !Process::new(seg.header.pid()).is_alive() {
                        return Err(died_during_setup(cfg, p));
                    }
                    let prod = &seg.rings[0].ctl().prod.0;
                    prod.attached.store(1, Release);
                    seg.header.get().bell.0.notify();
                    segs[p] = Some(seg);
                }
                None => still.push(p),
            }
        }
        missing = still;
        if missing.is_empty() {
            return Ok(());
        }
        for (p, seg) in segs.iter().enumerate() {
            if seg
                .as_ref()
                .is_some_and(|s| !Process::new(s.header.pid()).is_alive())
            {
                return Err(died_during_setup(cfg, p));
            }
        }
        if own.owner_closed() || Instant::now() >= deadline {
            return Err(TransportError::Handshake {
                peer: format!("rank(s) {missing:?}"),
                detail: format!(
                    "no shared-memory segment appeared within {:?} (not on this host, or \
                     not started?)",
                    cfg.connect_timeout
                ),
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(5));
    }
}

/// Waits until every peer has attached to this rank's segment; fails early if a peer
/// whose segment is open here exits first.
pub(super) fn await_attached(
    own: &Segment,
    peers: &[Option<Segment>],
    rank: usize,
    cfg: &ShmConfig,
    deadline: Instant,
) -> Result<(), TransportError> {
    let bell = &own.header.get().bell.0;
    let processes: Vec<Option<Process>> = peers
        .iter()
        .map(|s| s.as_ref().map(|s| Process::new(s.header.pid())))
        .collect();
    loop {
        let seen = bell.word.load(SeqCst);
        let missing: Vec<usize> = (0..peers.len())
            .filter(|&p| p != rank)
            .filter(|&p| {
                let ring = &own.rings[segment::slot(p, rank)];
                ring.ctl().prod.0.attached.load(Acquire) == 0
            })
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        for &p in &missing {
            if processes[p].as_ref().is_some_and(|x| !x.is_alive()) {
                return Err(died_during_setup(cfg, p));
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(TransportError::Handshake {
                peer: format!("rank(s) {missing:?}"),
                detail: format!(
                    "did not attach to this rank's shared-memory segment within {:?}",
                    cfg.connect_timeout
                ),
            });
        }
        sys::futex_wait(
            &bell.word,
            seen,
            (deadline - now).min(Duration::from_millis(20)),
        );
    }
}

/// The error for peer `p` whose process exited during set-up; removes its segment file,
/// which it can no longer remove itself.
fn died_during_setup(cfg: &ShmConfig, p: usize) -> TransportError {
    let path = cfg.segment_path(p);
    let _ = std::fs::remove_file(&path);
    TransportError::Handshake {
        peer: format!("rank {p}"),
        detail: format!(
            "its process exited during set-up (removed its segment {})",
            path.display()
        ),
    }
}
