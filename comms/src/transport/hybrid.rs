//! Hybrid driver for runs over several hosts with several ranks each: shared memory
//! ([`ShmTransport`]) to the ranks on this host, TCP ([`TcpTransport`]) to the others. It is
//! what the hierarchical all-reduce ([`crate::algo::hierarchical`]) wants underneath: the
//! host-local reduce and broadcast move through `/dev/shm` rings, and only the leaders'
//! all-reduce crosses the network (Horovod's hierarchical all-reduce runs its host-local
//! stages over NCCL / shared memory for the same reason).
//!
//! # Set-up
//! [`HybridTransport::connect`] builds the TCP mesh of every rank first, exactly as
//! [`TcpTransport::connect`] does (token, deadlines, errors naming the peer). Then every rank
//! sends its **host key** (the same key the trainer groups ranks by: its host name, or the
//! node launcher's node) to every peer as the first message on each connection, and reads
//! one from each: messages from one peer arrive in order, so a key cannot be mistaken for
//! later traffic. The keys group the ranks ([`Topology::from_keys`]); the ranks of this
//! host then build a shared-memory mesh among themselves, numbered in rank order, with the
//! given [`ShmConfig`]'s run id extended by the host's lowest rank (so "hosts" carved out
//! of one machine, as in tests, get distinct segments). Before that, the ranks of a host
//! agree whether its shared-memory file system has room for their rings (each checks,
//! before any creates a segment, and tells the others); a host without room, and a host
//! with one rank, has no shared-memory mesh, and its ranks reach each other over TCP.
//!
//! # Data path
//! [`Transport::send`] to a same-host peer goes into its ring; to any other peer, over TCP.
//! [`Transport::recv_from`] waits on the driver that carries that peer. [`Transport::recv`]
//! takes what TCP has already queued, then waits on the shared-memory rings; the TCP reader
//! threads ring this rank's shared-memory doorbell after each event they queue
//! ([`OnEvent`]), so a message from another host wakes a receiver asleep on its rings at
//! once: no polling interval, no thread hand-off on the shared-memory side. Link emulation
//! is each driver's own: launchers shape the TCP side (the network) and leave the
//! shared-memory side unshaped.
//!
//! # Lost peers
//! Each peer is reported once, as [`TransportError::Closed`] or
//! [`TransportError::PeerSilent`], after the messages it sent. A peer on another host is
//! TCP's. A same-host peer is the shared-memory driver's (its rings closed, or its process
//! gone, through its pidfd) — except that its TCP connection, which carries nothing after
//! set-up but still heartbeats, reports it **silent** when it freezes (`SIGSTOP`, swapping),
//! which shared memory alone cannot see. The closing of that idle connection is not
//! reported (shared memory reports the peer once its last ring bytes are read).
//!
//! # Newcomers
//! With [`TcpConfig::accept_joiners`] (live membership), a newcomer takes a lost rank's
//! place over TCP alone ([`HybridTransport::join`]: [`TcpTransport::join`], no host keys
//! and no rings — it talks to every rank over TCP, same-host ones included). A member that
//! admits it ([`Transport::admit`]) reaches that rank over TCP from then on, and whatever
//! the lost rank's rings still say (their closing) is ignored.
//!
//! [`Transport::bytes`] counts both drivers; [`HybridTransport::network_bytes`] only TCP's,
//! the bytes that crossed between hosts.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use super::shm::{ShmConfig, ShmTransport};
use super::tcp::{TcpConfig, TcpTransport};
use super::{check_peer, ByteCount, OnEvent, Transport, TransportError};
use crate::topology::{Topology, MAX_KEY_LEN};

/// Prefix of the host-key message every rank sends each peer at set-up.
const KEY_MAGIC: &[u8] = b"dtrain-hybrid host key\0";
/// Prefix of the shared-memory verdict every rank sends its host mates at set-up.
const ROOM_MAGIC: &[u8] = b"dtrain-hybrid room\0";

/// The shared-memory doorbell's waker, once the shared-memory mesh exists.
type Bell = Arc<OnceLock<Box<dyn Fn() + Send + Sync>>>;

/// One rank of a hybrid mesh (see the [module docs](self)).
#[derive(Debug)]
pub struct HybridTransport {
    rank: usize,
    world: usize,
    topology: Topology,
    /// The ranks this one reaches through shared memory, itself included, ascending (its
    /// host's, or only itself: see [`agree_on_room`]); the shared-memory mesh's rank `i` is
    /// `members[i]`.
    members: Vec<usize>,
    /// The shared-memory rank of each rank in `members` (`None`: reached over TCP).
    local: Vec<Option<usize>>,
    /// `None` when this rank is alone on its host.
    shm: Option<ShmTransport>,
    tcp: TcpTransport,
    /// Events the TCP readers have queued so far (what a receiver asleep on its rings
    /// checks when its doorbell rings).
    tcp_events: Arc<AtomicU64>,
    /// Peers already reported lost.
    lost: Vec<bool>,
    /// Same-host ranks whose place a newcomer took: reached over TCP now, and nothing of
    /// their old rings is reported.
    replaced: Vec<bool>,
}

impl HybridTransport {
    /// Connects rank `rank` to every other rank: TCP to all of them (`peers[i]` is rank
    /// `i`'s listening address, `listener` this rank's bound listener, `tcp` as for
    /// [`TcpTransport::connect`]; its [`TcpConfig::on_event`] is this driver's), then shared
    /// memory among the ranks whose `host_key` equals this one's (with `shm`, its run id
    /// extended per host). Blocks until both meshes are up, or fails naming the peer, within
    /// `tcp.connect_timeout` for the TCP mesh and the key exchange and `shm.connect_timeout`
    /// for the shared-memory mesh.
    pub fn connect(
        rank: usize,
        peers: &[SocketAddr],
        listener: std::net::TcpListener,
        tcp: TcpConfig,
        shm: ShmConfig,
        host_key: &str,
    ) -> Result<Self, TransportError> {
        let world = peers.len();
        if host_key.len() > MAX_KEY_LEN {
            return Err(TransportError::Handshake {
                peer: "config".into(),
                detail: format!(
                    "host key of {} bytes, over the limit of {MAX_KEY_LEN}",
                    host_key.len()
                ),
            });
        }
        let tcp_events = Arc::new(AtomicU64::new(0));
        let bell: Bell = Arc::new(OnceLock::new());
        let on_event = {
            let (events, bell) = (tcp_events.clone(), bell.clone());
            OnEvent::new(move || {
                events.fetch_add(1, SeqCst);
                if let Some(ring) = bell.get() {
                    ring();
                }
            })
        };
        let timeout = tcp.connect_timeout;
        let mut tcp = TcpTransport::connect(
            rank,
            peers,
            listener,
            TcpConfig {
                on_event: Some(on_event),
                ..tcp
            },
        )?;
        let deadline = Instant::now() + timeout;
        let keys = exchange_keys(&mut tcp, host_key, deadline)?;
        let topology = Topology::from_keys(&keys);
        let mut members = topology.members(topology.host_of(rank)).to_vec();
        if members.len() > 1 && !agree_on_room(&mut tcp, &members, &shm, deadline)? {
            // Every rank of this host saw the same verdict: TCP between them as well.
            members = vec![rank];
        }
        let mut local = vec![None; world];
        for (i, &r) in members.iter().enumerate() {
            local[r] = Some(i);
        }
        let shm = if members.len() > 1 {
            let me = local[rank].expect("a rank is a member of its own host");
            let mut cfg = shm;
            cfg.run_id
                .extend_from_slice(format!("/host of rank {}", members[0]).as_bytes());
            let t = ShmTransport::connect(me, members.len(), cfg).map_err(|e| {
                TransportError::Handshake {
                    peer: format!("the shared memory of ranks {members:?}"),
                    detail: format!("{e} (ranks numbered 0..{} among them)", members.len()),
                }
            })?;
            if let Some(ring) = t.waker() {
                let _ = bell.set(Box::new(ring));
            }
            Some(t)
        } else {
            None
        };
        Ok(HybridTransport {
            rank,
            world,
            topology,
            members,
            local,
            shm,
            tcp,
            tcp_events,
            lost: vec![false; world],
            replaced: vec![false; world],
        })
    }

    /// A newcomer taking rank `rank`'s place in a running hybrid mesh (see the [module
    /// docs](self)): [`TcpTransport::join`] with `tcp`, and every peer over TCP. Its
    /// [`HybridTransport::topology`] is one rank per host (it took no part in the set-up's
    /// key exchange; the trainer learns the hosts with a collective of its own).
    pub fn join(
        rank: usize,
        peers: &[SocketAddr],
        listener: std::net::TcpListener,
        tcp: TcpConfig,
    ) -> Result<Self, TransportError> {
        let world = peers.len();
        let tcp = TcpTransport::join(rank, peers, listener, tcp)?;
        let mut local = vec![None; world];
        local[rank] = Some(0);
        Ok(HybridTransport {
            rank,
            world,
            topology: Topology::one_per_host(world),
            members: vec![rank],
            local,
            shm: None,
            tcp,
            tcp_events: Arc::new(AtomicU64::new(0)),
            lost: vec![false; world],
            replaced: vec![false; world],
        })
    }

    /// The hosts the ranks declared at set-up (every rank holds the same).
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Bytes sent and received over TCP only: what crossed between hosts (plus the host
    /// keys of set-up, counted before any collective).
    pub fn network_bytes(&self) -> ByteCount {
        self.tcp.bytes()
    }

    /// What to report of a TCP error: `None` for the closing of a same-host peer's idle
    /// connection (shared memory reports that peer), or for a peer reported already.
    fn tcp_loss(&mut self, e: TransportError) -> Option<TransportError> {
        let (p, silent) = match &e {
            TransportError::Closed { rank } => (*rank, false),
            TransportError::PeerSilent { rank, .. } => (*rank, true),
            _ => return Some(e),
        };
        if self.lost[p] || (self.local[p].is_some() && !silent) {
            return None;
        }
        self.lost[p] = true;
        Some(e)
    }

    /// A shared-memory error in global ranks; `None` for a peer reported already.
    fn shm_loss(&mut self, e: TransportError) -> Option<TransportError> {
        let e = match e {
            TransportError::Closed { rank } => TransportError::Closed {
                rank: self.members[rank],
            },
            TransportError::PeerSilent { rank, silent_for } => TransportError::PeerSilent {
                rank: self.members[rank],
                silent_for,
            },
            TransportError::InvalidRank { rank, .. } => TransportError::InvalidRank {
                rank: self.members.get(rank).copied().unwrap_or(rank),
                world: self.world,
            },
            other => return Some(other),
        };
        if let Some((p, _)) = e.lost_peer() {
            if self.replaced[p] || std::mem::replace(&mut self.lost[p], true) {
                return None;
            }
        }
        Some(e)
    }
}

/// Whether the shared-memory file system has room for the rings of this host's `members`
/// (their mesh with `cfg`, plus a quarter), as **every** member sees it: each checks before
/// any of them creates a segment, tells the others over TCP, and all take the conjunction,
/// so the host's ranks agree even while free space changes. A host without room is
/// logged, and its ranks talk over TCP (as they would under `cluster.transport = "tcp"`).
fn agree_on_room(
    tcp: &mut TcpTransport,
    members: &[usize],
    cfg: &ShmConfig,
    deadline: Instant,
) -> Result<bool, TransportError> {
    let rank = tcp.rank();
    let need = cfg.mesh_bytes(members.len());
    let want = need.saturating_add(need / 4);
    let mine = match super::shm::free_bytes(&cfg.dir) {
        Ok(free) if free >= want => true,
        Ok(free) => {
            tracing::warn!(
                "{}: {} MiB free, the shared-memory rings of ranks {members:?} need {} MiB: \
                 they talk over TCP (enlarge it, e.g. docker run --shm-size=1g)",
                cfg.dir.display(),
                free >> 20,
                want.div_ceil(1 << 20)
            );
            false
        }
        Err(e) => {
            tracing::warn!(
                "{} is not usable for shared memory ({e}): ranks {members:?} talk over TCP",
                cfg.dir.display()
            );
            false
        }
    };
    let others = || members.iter().copied().filter(move |&p| p != rank);
    for p in others() {
        tcp.send(p, [ROOM_MAGIC, &[u8::from(mine)]].concat())?;
    }
    let mut all = mine;
    for p in others() {
        let m = recv_setup(tcp, p, deadline, "its shared-memory verdict")?;
        match m.strip_prefix(ROOM_MAGIC) {
            Some([v @ (0 | 1)]) => all &= *v == 1,
            _ => {
                return Err(TransportError::Handshake {
                    peer: format!("rank {p}"),
                    detail: format!(
                        "a set-up message of {} bytes that is not its shared-memory verdict",
                        m.len()
                    ),
                })
            }
        }
    }
    Ok(all)
}

/// `p`'s next message during set-up, or an error naming it and `what` it did not send.
fn recv_setup(
    tcp: &mut TcpTransport,
    p: usize,
    deadline: Instant,
    what: &str,
) -> Result<Vec<u8>, TransportError> {
    match tcp.recv_from(p, deadline) {
        Err(TransportError::Timeout) => Err(TransportError::Handshake {
            peer: format!("rank {p}"),
            detail: format!("sent no {what} before the set-up deadline"),
        }),
        other => other,
    }
}

/// Sends `key` to every peer and reads each peer's (its first message); the keys in rank
/// order.
fn exchange_keys(
    tcp: &mut TcpTransport,
    key: &str,
    deadline: Instant,
) -> Result<Vec<String>, TransportError> {
    let (rank, world) = (tcp.rank(), tcp.world_size());
    let msg = [KEY_MAGIC, key.as_bytes()].concat();
    for p in (0..world).filter(|&p| p != rank) {
        tcp.send(p, msg.clone())?;
    }
    let mut keys = vec![String::new(); world];
    keys[rank] = key.to_string();
    for p in (0..world).filter(|&p| p != rank) {
        let m = recv_setup(tcp, p, deadline, "host key")?;
        keys[p] = m
            .strip_prefix(KEY_MAGIC)
            .filter(|k| k.len() <= MAX_KEY_LEN)
            .and_then(|k| String::from_utf8(k.to_vec()).ok())
            .ok_or_else(|| TransportError::Handshake {
                peer: format!("rank {p}"),
                detail: format!(
                    "its first message ({} bytes) is not a host key of at most {MAX_KEY_LEN} \
                     bytes of UTF-8",
                    m.len()
                ),
            })?;
    }
    Ok(keys)
}

impl Transport for HybridTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn send(&mut self, to: usize, msg: Vec<u8>) -> Result<(), TransportError> {
        check_peer(to, self.rank, self.world)?;
        match (self.local[to], self.shm.as_mut()) {
            (Some(l), Some(shm)) => shm.send(l, msg).map_err(|e| match e {
                TransportError::Closed { .. } => TransportError::Closed { rank: to },
                other => other,
            }),
            _ => self.tcp.send(to, msg),
        }
    }

    fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
        loop {
            let seen = self.tcp_events.load(SeqCst);
            // What TCP has queued already (a deadline in the past: no waiting).
            match self.tcp.recv(Instant::now()) {
                Ok((from, m)) if self.local[from].is_none() && !self.lost[from] => {
                    return Ok((from, m))
                }
                // A same-host peer sends nothing over TCP after set-up; a lost one nothing.
                Ok(_) => continue,
                Err(TransportError::Timeout) => {}
                Err(e) => match self.tcp_loss(e) {
                    Some(e) => return Err(e),
                    None => continue,
                },
            }
            let Some(shm) = self.shm.as_mut() else {
                // Alone on this host: TCP is everything.
                return match self.tcp.recv(deadline) {
                    Ok(got) => Ok(got),
                    Err(TransportError::Timeout) => Err(TransportError::Timeout),
                    Err(e) => match self.tcp_loss(e) {
                        Some(e) => Err(e),
                        None => continue,
                    },
                };
            };
            let events = &self.tcp_events;
            match shm.recv_or(None, deadline, &|| events.load(SeqCst) != seen) {
                Ok(Some((l, m))) => {
                    let from = self.members[l];
                    if !self.lost[from] && !self.replaced[from] {
                        return Ok((from, m));
                    }
                }
                // TCP queued something: take it at the top.
                Ok(None) => {}
                Err(e) => {
                    if let Some(e) = self.shm_loss(e) {
                        return Err(e);
                    }
                }
            }
        }
    }

    fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError> {
        check_peer(from, self.rank, self.world)?;
        let Some(l) = self.local[from].filter(|_| self.shm.is_some()) else {
            // Another host: TCP's (which reports the peer once, then keeps saying closed).
            return self.tcp.recv_from(from, deadline);
        };
        loop {
            if self.lost[from] {
                return Err(TransportError::Closed { rank: from });
            }
            let seen = self.tcp_events.load(SeqCst);
            // Only the news that the peer froze matters from its TCP connection; messages
            // of other peers stay queued there.
            if let Err(e @ TransportError::PeerSilent { .. }) =
                self.tcp.recv_from(from, Instant::now())
            {
                if let Some(e) = self.tcp_loss(e) {
                    return Err(e);
                }
            }
            let events = &self.tcp_events;
            let shm = self.shm.as_mut().expect("checked above");
            match shm.recv_or(Some(l), deadline, &|| events.load(SeqCst) != seen) {
                Ok(Some((_, m))) => return Ok(m),
                Ok(None) => {}
                Err(e) => {
                    if let Some(e) = self.shm_loss(e) {
                        return Err(e);
                    }
                }
            }
        }
    }

    fn bytes(&self) -> ByteCount {
        let (t, s) = (
            self.tcp.bytes(),
            self.shm.as_ref().map(Transport::bytes).unwrap_or_default(),
        );
        ByteCount {
            sent: t.sent + s.sent,
            received: t.received + s.received,
        }
    }

    fn joiners(&mut self) -> Vec<usize> {
        self.tcp.joiners()
    }

    /// TCP's admission; a same-host rank is reached over TCP from then on.
    fn admit(&mut self, rank: usize) -> Result<(), TransportError> {
        self.tcp.admit(rank)?;
        self.route_over_tcp(rank);
        Ok(())
    }

    fn link_member(&mut self, rank: usize, deadline: Instant) -> Result<(), TransportError> {
        self.tcp.link_member(rank, deadline)?;
        self.route_over_tcp(rank);
        Ok(())
    }
}

impl HybridTransport {
    /// `rank` (a newcomer in its place, or a member a newcomer links to) is reached over
    /// TCP from now on: its old rings say nothing more, and its connection's closing is
    /// reported as any other host's rank's.
    fn route_over_tcp(&mut self, rank: usize) {
        if rank == self.rank {
            return;
        }
        if self.local[rank].take().is_some() {
            self.replaced[rank] = true;
        }
        self.lost[rank] = false;
    }
}
