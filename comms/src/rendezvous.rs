//! Rendezvous: how the ranks of a run find each other.
//!
//! One process hosts the rendezvous ([`Host::spawn`] or [`serve`]; rank 0 in standalone
//! runs, or whoever owns the given `host:port`). Every rank — rank 0 included — binds its
//! data-plane socket (a TCP listener or a UDP socket for QUIC), then [`join`]s with the run
//! token, its rank, the world size and that socket's address. When all `world` ranks have
//! joined, the host answers each with a [`Joined`]: every rank's address (rank order) and
//! the run's [`RunIdentity`] (for QUIC, the per-run self-signed certificate every peer
//! presents and pins). The ranks then build their mesh (`TcpTransport::connect`,
//! `QuicTransport::connect`).
//!
//! ```text
//! message = len: u32 LE (≤ limit) | "DTRV" | version u8 | tag u8 | body
//! Join    (tag 1) = rank u32 | world u32 | token_len u16 | token | addr_len u8 | addr (utf-8)
//! Welcome (tag 2) = world u32 | world × (addr_len u8 | addr) | cert_len u32 | cert
//!                   | key_len u32 | key
//! Reject  (tag 3) = reason_len u16 | reason (utf-8)
//! ```
//!
//! Messages are bounded ([`MAX_JOIN`], [`MAX_WELCOME`]); every read and write has a
//! deadline ([`RendezvousConfig::timeout`]). A connection with a wrong token is closed
//! without an answer and logged; a duplicate rank or a different world size gets a
//! [`RendezvousError::Rejected`] naming the rank; a host still missing ranks at the
//! deadline fails with [`RendezvousError::Timeout`] naming them (and tells the ranks that
//! did join). A rank bound to an unspecified address (`0.0.0.0:p`) is published with the
//! IP address its join came from.
//!
//! The identity's private key travels over the rendezvous connection, which is only as
//! private as the run token itself (both are sent in the clear): use the rendezvous on a
//! trusted network, as with the token.
//!
//! Ranks and world size come from flags or the scheduler's environment: [`placement`].

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{info, warn};

use crate::frame::MAX_TOKEN_LEN;

/// Largest world size a rendezvous accepts.
pub const MAX_WORLD: usize = 4096;
/// Largest join message (bytes after the length prefix).
pub const MAX_JOIN: usize = 4 + 2 + 4 + 4 + 2 + MAX_TOKEN_LEN + 1 + 255;
/// Largest welcome or reject message (bytes after the length prefix).
pub const MAX_WELCOME: usize = 4 << 20;
const MAGIC: &[u8; 4] = b"DTRV";
const VERSION: u8 = 1;
const TAG_JOIN: u8 = 1;
const TAG_WELCOME: u8 = 2;
const TAG_REJECT: u8 = 3;
/// Largest certificate or key in a welcome.
const MAX_IDENTITY_PART: usize = 64 << 10;

/// Errors of the rendezvous; each names the peer or ranks concerned.
#[derive(Debug, Error)]
pub enum RendezvousError {
    /// The host could not be reached before the deadline.
    #[error("rendezvous host {addr} unreachable: {detail}")]
    Unreachable {
        /// The host's address.
        addr: SocketAddr,
        /// What failed.
        detail: String,
    },
    /// The host refused this rank (or closed the connection without an answer).
    #[error("rendezvous host {addr} refused rank {rank}: {reason}")]
    Rejected {
        /// The host's address.
        addr: SocketAddr,
        /// The refused rank.
        rank: usize,
        /// Why.
        reason: String,
    },
    /// Not every rank joined before the deadline.
    #[error("rendezvous timed out after {timeout:?}; ranks that never joined: {missing:?}")]
    Timeout {
        /// The ranks that did not join.
        missing: Vec<usize>,
        /// The configured timeout.
        timeout: Duration,
    },
    /// A peer sent something that is not a valid rendezvous message.
    #[error("rendezvous protocol error with {peer}: {detail}")]
    Protocol {
        /// The peer (address, or host).
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// Invalid arguments (rank out of range, token too long, …).
    #[error("invalid rendezvous argument: {0}")]
    Invalid(String),
    /// An I/O error not attributable to a peer.
    #[error("rendezvous i/o error: {0}")]
    Io(#[from] std::io::Error),
}

/// The run's TLS identity, created once per run by the rendezvous host and handed to
/// every rank (empty for transports that do not use it): a self-signed certificate (DER)
/// and its PKCS#8 private key (DER).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RunIdentity {
    /// The certificate every rank presents and every peer pins.
    pub cert_der: Vec<u8>,
    /// Its private key.
    pub key_der: Vec<u8>,
}

impl std::fmt::Debug for RunIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunIdentity")
            .field("cert_der", &format_args!("{} bytes", self.cert_der.len()))
            .field("key_der", &"<redacted>")
            .finish()
    }
}

/// Settings of a rendezvous (host and joiners).
#[derive(Clone, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// The run token (at most [`MAX_TOKEN_LEN`] bytes).
    pub token: Vec<u8>,
    /// How long the host waits for all ranks, and a joiner for its answer. Default 60 s.
    pub timeout: Duration,
}

impl std::fmt::Debug for RendezvousConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RendezvousConfig")
            .field("token", &"<redacted>")
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl RendezvousConfig {
    /// Defaults with the given run token.
    pub fn new(token: impl Into<Vec<u8>>) -> Self {
        RendezvousConfig {
            token: token.into(),
            timeout: Duration::from_secs(60),
        }
    }
}

/// What a rank learns at the rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Joined {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Every rank's data-plane address, in rank order.
    pub peers: Vec<SocketAddr>,
    /// The run's TLS identity (empty if the host has none).
    pub identity: RunIdentity,
}

/// A rendezvous message.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Msg {
    Join {
        rank: u32,
        world: u32,
        token: Vec<u8>,
        addr: String,
    },
    Welcome {
        peers: Vec<String>,
        identity: RunIdentity,
    },
    Reject(String),
}

impl Msg {
    /// Encodes with the length prefix.
    fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; 4];
        b.extend_from_slice(MAGIC);
        b.push(VERSION);
        match self {
            Msg::Join {
                rank,
                world,
                token,
                addr,
            } => {
                b.push(TAG_JOIN);
                b.extend_from_slice(&rank.to_le_bytes());
                b.extend_from_slice(&world.to_le_bytes());
                b.extend_from_slice(&(token.len() as u16).to_le_bytes());
                b.extend_from_slice(token);
                put_short_str(&mut b, addr);
            }
            Msg::Welcome { peers, identity } => {
                b.push(TAG_WELCOME);
                b.extend_from_slice(&(peers.len() as u32).to_le_bytes());
                for p in peers {
                    put_short_str(&mut b, p);
                }
                for part in [&identity.cert_der, &identity.key_der] {
                    b.extend_from_slice(&(part.len() as u32).to_le_bytes());
                    b.extend_from_slice(part);
                }
            }
            Msg::Reject(reason) => {
                b.push(TAG_REJECT);
                let r = truncate_utf8(reason, 4096);
                b.extend_from_slice(&(r.len() as u16).to_le_bytes());
                b.extend_from_slice(r.as_bytes());
            }
        }
        let len = (b.len() - 4) as u32;
        b[..4].copy_from_slice(&len.to_le_bytes());
        b
    }

    /// Decodes a message body (after the length prefix). Never panics; allocates at most
    /// the body's size.
    fn decode(body: &[u8]) -> Result<Msg, String> {
        let mut c = Reader { b: body, p: 0 };
        if c.take(4)? != MAGIC {
            return Err("bad magic (not a dtrain rendezvous peer)".into());
        }
        if c.u8()? != VERSION {
            return Err("unsupported rendezvous version".into());
        }
        let m = match c.u8()? {
            TAG_JOIN => {
                let rank = c.u32()?;
                let world = c.u32()?;
                let tl = c.u16()? as usize;
                if tl > MAX_TOKEN_LEN {
                    return Err("token too long".into());
                }
                let token = c.take(tl)?.to_vec();
                let addr = c.short_str()?;
                Msg::Join {
                    rank,
                    world,
                    token,
                    addr,
                }
            }
            TAG_WELCOME => {
                let n = c.u32()? as usize;
                if n == 0 || n > MAX_WORLD {
                    return Err(format!("world size {n} out of range"));
                }
                let mut peers = Vec::with_capacity(n);
                for _ in 0..n {
                    peers.push(c.short_str()?);
                }
                let mut parts = [Vec::new(), Vec::new()];
                for part in &mut parts {
                    let l = c.u32()? as usize;
                    if l > MAX_IDENTITY_PART {
                        return Err("identity too large".into());
                    }
                    *part = c.take(l)?.to_vec();
                }
                let [cert_der, key_der] = parts;
                Msg::Welcome {
                    peers,
                    identity: RunIdentity { cert_der, key_der },
                }
            }
            TAG_REJECT => {
                let l = c.u16()? as usize;
                Msg::Reject(String::from_utf8_lossy(c.take(l)?).into_owned())
            }
            t => return Err(format!("unknown message tag {t}")),
        };
        if c.p != body.len() {
            return Err("trailing bytes".into());
        }
        Ok(m)
    }
}

fn put_short_str(b: &mut Vec<u8>, s: &str) {
    let s = truncate_utf8(s, 255);
    b.push(s.len() as u8);
    b.extend_from_slice(s.as_bytes());
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

struct Reader<'a> {
    b: &'a [u8],
    p: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .p
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or("truncated message")?;
        let s = &self.b[self.p..end];
        self.p = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn short_str(&mut self) -> Result<String, String> {
        let l = self.u8()? as usize;
        String::from_utf8(self.take(l)?.to_vec()).map_err(|_| "address is not utf-8".to_string())
    }
}

/// Reads one message of at most `max` body bytes (blocking; the socket's read timeout
/// bounds the wait). `Ok(None)` if the peer closed before sending anything.
fn read_msg(s: &mut TcpStream, max: usize) -> Result<Option<Msg>, String> {
    let mut len = [0u8; 4];
    match s.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {
            return Ok(None)
        }
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            return Err("no message before the deadline".into())
        }
        Err(e) => return Err(e.to_string()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(format!("message of {len} bytes exceeds the limit of {max}"));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).map_err(|e| e.to_string())?;
    Msg::decode(&body).map(Some)
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

fn check_token(token: &[u8]) -> Result<(), RendezvousError> {
    if token.len() > MAX_TOKEN_LEN {
        return Err(RendezvousError::Invalid(format!(
            "run token longer than {MAX_TOKEN_LEN} bytes"
        )));
    }
    Ok(())
}

fn tokens_equal(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A rendezvous host serving on a background thread.
#[derive(Debug)]
pub struct Host {
    addr: SocketAddr,
    handle: JoinHandle<Result<(), RendezvousError>>,
    /// Ends the late joins of a live host ([`Host::spawn_live`]).
    stop: Option<Arc<AtomicBool>>,
}

impl Host {
    /// Serves the rendezvous of `world` ranks on `listener` in a background thread (see
    /// [`serve`]).
    pub fn spawn(
        listener: TcpListener,
        world: usize,
        identity: RunIdentity,
        cfg: RendezvousConfig,
    ) -> Result<Host, RendezvousError> {
        Self::start(listener, &cfg.token.clone(), None, move |l| {
            serve(l, world, identity, cfg)
        })
    }

    /// As [`Host::spawn`], and then, until [`Host::wait`], serves *late* joins (live
    /// membership): a rank that joins after the world has formed — a newcomer taking a
    /// lost rank's place — is answered at once with every rank's current address, its
    /// own replaced by the one it publishes. The ranks' addresses stay valid as long as
    /// their transports keep their listeners open (TCP's `accept_joiners`).
    pub fn spawn_live(
        listener: TcpListener,
        world: usize,
        identity: RunIdentity,
        cfg: RendezvousConfig,
    ) -> Result<Host, RendezvousError> {
        let stop = Arc::new(AtomicBool::new(false));
        let until = stop.clone();
        Self::start(listener, &cfg.token.clone(), Some(stop), move |l| {
            let peers = form(&l, world, &identity, &cfg)?;
            serve_late(&l, peers, &identity, &cfg, &until);
            Ok(())
        })
    }

    /// Runs `body` on `listener` in the rendezvous thread.
    fn start(
        listener: TcpListener,
        token: &[u8],
        stop: Option<Arc<AtomicBool>>,
        body: impl FnOnce(TcpListener) -> Result<(), RendezvousError> + Send + 'static,
    ) -> Result<Host, RendezvousError> {
        let addr = listener.local_addr()?;
        check_token(token)?;
        let handle = thread::Builder::new()
            .name("dtrain-rendezvous".into())
            .spawn(move || body(listener))?;
        Ok(Host { addr, handle, stop })
    }

    /// The address ranks join at.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until every rank was answered (or the rendezvous failed); a live host stops
    /// serving late joins.
    pub fn wait(self) -> Result<(), RendezvousError> {
        if let Some(stop) = &self.stop {
            stop.store(true, Ordering::Relaxed);
        }
        self.handle.join().unwrap_or_else(|_| {
            Err(RendezvousError::Invalid(
                "rendezvous thread panicked".into(),
            ))
        })
    }
}

type Checked = (TcpStream, SocketAddr, Result<Msg, String>);

/// Hosts the rendezvous of `world` ranks on `listener` (blocking) until every rank has
/// joined and been answered, or [`RendezvousConfig::timeout`] passes.
pub fn serve(
    listener: TcpListener,
    world: usize,
    identity: RunIdentity,
    cfg: RendezvousConfig,
) -> Result<(), RendezvousError> {
    form(&listener, world, &identity, &cfg).map(drop)
}

/// One short-lived reader per connection, so a slow or silent client cannot hold up the
/// others; its read is bounded by `wait`. The checked message goes to `tx`.
fn read_join(s: TcpStream, from: SocketAddr, wait: Duration, tx: mpsc::Sender<Checked>) {
    thread::spawn(move || {
        let mut s = s;
        let r = s
            .set_nonblocking(false)
            .and_then(|_| s.set_read_timeout(Some(wait)))
            .map_err(|e| e.to_string())
            .and_then(|_| read_msg(&mut s, MAX_JOIN))
            .and_then(|m| m.ok_or_else(|| "closed before joining".to_string()));
        let _ = tx.send((s, from, r));
    });
}

/// Serves late joins on `listener` until `stop` (see [`Host::spawn_live`]): `peers` are
/// the ranks' current addresses.
fn serve_late(
    listener: &TcpListener,
    mut peers: Vec<SocketAddr>,
    identity: &RunIdentity,
    cfg: &RendezvousConfig,
    stop: &AtomicBool,
) {
    let world = peers.len();
    let (tx, rx) = mpsc::channel::<Checked>();
    let nobody: Vec<Option<(TcpStream, SocketAddr)>> = (0..world).map(|_| None).collect();
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((s, from)) => read_join(s, from, Duration::from_secs(10), tx.clone()),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => warn!("rendezvous: accept failed: {e}"),
        }
        while let Ok((mut s, from, r)) = rx.try_recv() {
            match admit(r, from, world, &cfg.token, &nobody) {
                Ok((rank, addr)) => {
                    info!("rendezvous: rank {rank} joined late from {addr} (a newcomer)");
                    peers[rank] = addr;
                    let welcome = Msg::Welcome {
                        peers: peers.iter().map(SocketAddr::to_string).collect(),
                        identity: identity.clone(),
                    }
                    .encode();
                    let r = s
                        .set_write_timeout(Some(Duration::from_secs(5)))
                        .and_then(|_| s.write_all(&welcome))
                        .and_then(|_| s.flush());
                    if let Err(e) = r {
                        warn!("rendezvous: answering late rank {rank} failed: {e}");
                    }
                }
                Err(Refusal::Silent(why)) => warn!("rendezvous: refused {from}: {why}"),
                Err(Refusal::Answer(why)) => {
                    warn!("rendezvous: refused {from}: {why}");
                    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
                    let _ = s.write_all(&Msg::Reject(why).encode());
                }
            }
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// The rendezvous of `world` ranks (see [`serve`]); returns the addresses it published.
fn form(
    listener: &TcpListener,
    world: usize,
    identity: &RunIdentity,
    cfg: &RendezvousConfig,
) -> Result<Vec<SocketAddr>, RendezvousError> {
    if world == 0 || world > MAX_WORLD {
        return Err(RendezvousError::Invalid(format!(
            "world size {world} out of range 1..={MAX_WORLD}"
        )));
    }
    check_token(&cfg.token)?;
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + cfg.timeout;
    let (tx, rx) = mpsc::channel::<Checked>();
    let mut joined: Vec<Option<(TcpStream, SocketAddr)>> = (0..world).map(|_| None).collect();
    let mut count = 0;
    while count < world {
        match listener.accept() {
            Ok((s, from)) => read_join(
                s,
                from,
                remaining(deadline).min(Duration::from_secs(10)),
                tx.clone(),
            ),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => warn!("rendezvous: accept failed: {e}"),
        }
        while let Ok((mut s, from, r)) = rx.try_recv() {
            match admit(r, from, world, &cfg.token, &joined) {
                Ok((rank, addr)) => {
                    joined[rank] = Some((s, addr));
                    count += 1;
                }
                Err(Refusal::Silent(why)) => warn!("rendezvous: refused {from}: {why}"),
                Err(Refusal::Answer(why)) => {
                    warn!("rendezvous: refused {from}: {why}");
                    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
                    let _ = s.write_all(&Msg::Reject(why).encode());
                }
            }
        }
        if count == world {
            break;
        }
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (0..world).filter(|&r| joined[r].is_none()).collect();
            let why = format!("rendezvous timed out; ranks that never joined: {missing:?}");
            for (s, _) in joined.iter_mut().flatten() {
                let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
                let _ = s.write_all(&Msg::Reject(why.clone()).encode());
            }
            return Err(RendezvousError::Timeout {
                missing,
                timeout: cfg.timeout,
            });
        }
        thread::sleep(Duration::from_millis(2));
    }
    let addrs: Vec<SocketAddr> = joined
        .iter()
        .map(|j| j.as_ref().expect("all joined").1)
        .collect();
    let peers: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
    let welcome = Msg::Welcome {
        peers,
        identity: identity.clone(),
    }
    .encode();
    for (rank, j) in joined.iter_mut().enumerate() {
        let (s, _) = j.as_mut().expect("all joined");
        let r = s
            .set_write_timeout(Some(remaining(deadline).max(Duration::from_secs(5))))
            .and_then(|_| s.write_all(&welcome))
            .and_then(|_| s.flush());
        if let Err(e) = r {
            warn!("rendezvous: answering rank {rank} failed: {e}");
        }
    }
    Ok(addrs)
}

enum Refusal {
    /// Not authenticated: close without an answer.
    Silent(String),
    /// Authenticated but invalid: tell the rank why.
    Answer(String),
}

/// Checks a join; returns the rank and its published data-plane address.
fn admit(
    r: Result<Msg, String>,
    from: SocketAddr,
    world: usize,
    token: &[u8],
    joined: &[Option<(TcpStream, SocketAddr)>],
) -> Result<(usize, SocketAddr), Refusal> {
    let m = r.map_err(Refusal::Silent)?;
    let Msg::Join {
        rank,
        world: w,
        token: t,
        addr,
    } = m
    else {
        return Err(Refusal::Silent("first message is not a join".into()));
    };
    if !tokens_equal(&t, token) {
        return Err(Refusal::Silent("wrong run token".into()));
    }
    let rank = rank as usize;
    if w as usize != world {
        return Err(Refusal::Answer(format!(
            "rank {rank} says the world size is {w}, the rendezvous expects {world}"
        )));
    }
    if rank >= world {
        return Err(Refusal::Answer(format!(
            "rank {rank} is out of range for world size {world}"
        )));
    }
    if let Some((_, a)) = &joined[rank] {
        return Err(Refusal::Answer(format!(
            "rank {rank} already joined (data address {a})"
        )));
    }
    let mut addr: SocketAddr = addr
        .parse()
        .map_err(|_| Refusal::Answer(format!("rank {rank}: {addr:?} is not a socket address")))?;
    if addr.ip().is_unspecified() {
        addr.set_ip(from.ip());
    }
    Ok((rank, addr))
}

/// Joins the rendezvous at `host` as `rank` of `world`, publishing `data_addr` (this rank's
/// bound data-plane socket). Retries connecting until the deadline (the host may start
/// later), then waits for the host's answer.
pub fn join(
    host: SocketAddr,
    rank: usize,
    world: usize,
    data_addr: SocketAddr,
    cfg: &RendezvousConfig,
) -> Result<Joined, RendezvousError> {
    check_token(&cfg.token)?;
    if world == 0 || world > MAX_WORLD || rank >= world {
        return Err(RendezvousError::Invalid(format!(
            "rank {rank} / world size {world} out of range (world 1..={MAX_WORLD})"
        )));
    }
    let deadline = Instant::now() + cfg.timeout;
    let mut s = loop {
        match TcpStream::connect_timeout(&host, remaining(deadline).min(Duration::from_secs(2))) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                return Err(RendezvousError::Unreachable {
                    addr: host,
                    detail: format!("{e} (gave up after {:?})", cfg.timeout),
                })
            }
        }
    };
    let _ = s.set_nodelay(true);
    let hello = Msg::Join {
        rank: rank as u32,
        world: world as u32,
        token: cfg.token.clone(),
        addr: data_addr.to_string(),
    };
    s.set_write_timeout(Some(remaining(deadline)))?;
    s.write_all(&hello.encode())
        .map_err(|e| RendezvousError::Unreachable {
            addr: host,
            detail: e.to_string(),
        })?;
    s.set_read_timeout(Some(remaining(deadline)))?;
    let protocol = |detail: String| RendezvousError::Protocol {
        peer: format!("host {host}"),
        detail,
    };
    match read_msg(&mut s, MAX_WELCOME).map_err(protocol)? {
        Some(Msg::Welcome { peers, identity }) => {
            if peers.len() != world {
                return Err(protocol(format!(
                    "welcome lists {} ranks, expected {world}",
                    peers.len()
                )));
            }
            let peers = peers
                .iter()
                .map(|p| {
                    p.parse::<SocketAddr>()
                        .map_err(|_| protocol(format!("{p:?} is not a socket address")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Joined {
                rank,
                world,
                peers,
                identity,
            })
        }
        Some(Msg::Reject(reason)) => Err(RendezvousError::Rejected {
            addr: host,
            rank,
            reason,
        }),
        Some(Msg::Join { .. }) => Err(protocol("host answered with a join".into())),
        None => Err(RendezvousError::Rejected {
            addr: host,
            rank,
            reason: "connection closed without an answer (wrong run token?)".into(),
        }),
    }
}

/// Where a rank's position in the run came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankSource {
    /// Command-line flags.
    Flags,
    /// Slurm: `SLURM_PROCID`, `SLURM_NTASKS`.
    Slurm,
    /// Open MPI's `mpirun`: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`.
    OpenMpi,
}

/// A rank's position in the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Where `rank` and `world` came from (flags win over the environment).
    pub source: RankSource,
}

const SCHEDULERS: [(RankSource, &str, &str); 2] = [
    (RankSource::Slurm, "SLURM_PROCID", "SLURM_NTASKS"),
    (
        RankSource::OpenMpi,
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
    ),
];

/// Determines rank and world size from flags and a scheduler environment (a pure function
/// over `env`; pass `std::env::vars().collect()` for the process environment).
///
/// Flags win; what they leave open comes from Slurm (`SLURM_PROCID`, `SLURM_NTASKS`) or,
/// failing that, Open MPI (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`). A scheduler
/// with only one of its two variables, a value that is not a number, a world size of 0 or
/// a rank outside the world is an error naming the variable or flag.
pub fn placement(
    flag_rank: Option<usize>,
    flag_world: Option<usize>,
    env: &HashMap<String, String>,
) -> Result<Placement, String> {
    let mut from_env = None;
    if flag_rank.is_none() || flag_world.is_none() {
        for (src, rv, wv) in SCHEDULERS {
            match (env.get(rv), env.get(wv)) {
                (None, None) => continue,
                (Some(r), Some(w)) => {
                    let num = |var: &str, v: &str| {
                        v.trim()
                            .parse::<usize>()
                            .map_err(|_| format!("{var}={v:?} is not a non-negative integer"))
                    };
                    from_env = Some((src, num(rv, r)?, num(wv, w)?, rv, wv));
                    break;
                }
                (Some(_), None) => return Err(format!("{rv} is set but {wv} is not")),
                (None, Some(_)) => return Err(format!("{wv} is set but {rv} is not")),
            }
        }
    }
    let (rank, rank_from) = match (flag_rank, &from_env) {
        (Some(r), _) => (r, "--rank"),
        (None, Some((_, r, _, rv, _))) => (*r, *rv),
        (None, None) => {
            return Err(
                "rank unknown: pass --rank, or run under Slurm (SLURM_PROCID) or \
                 Open MPI (OMPI_COMM_WORLD_RANK)"
                    .into(),
            )
        }
    };
    let (world, world_from) = match (flag_world, &from_env) {
        (Some(w), _) => (w, "--world"),
        (None, Some((_, _, w, _, wv))) => (*w, *wv),
        (None, None) => {
            return Err("world size unknown: pass --world, or run under Slurm \
                 (SLURM_NTASKS) or Open MPI (OMPI_COMM_WORLD_SIZE)"
                .into())
        }
    };
    if world == 0 {
        return Err(format!("{world_from}: world size must be at least 1"));
    }
    if rank >= world {
        return Err(format!(
            "{rank_from}: rank {rank} is out of range for world size {world} ({world_from})"
        ));
    }
    let source = match (flag_rank, flag_world, from_env) {
        (Some(_), Some(_), _) | (_, _, None) => RankSource::Flags,
        (_, _, Some((src, ..))) => src,
    };
    Ok(Placement {
        rank,
        world,
        source,
    })
}

/// A fresh random run token (32 hex characters from the OS random source).
pub fn random_token() -> Result<String, RendezvousError> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// The IP address to bind a data-plane socket on so that `host` (the rendezvous) can
/// reach it: loopback for a loopback rendezvous, otherwise unspecified (all interfaces;
/// the host publishes the address it saw the join come from).
pub fn bind_ip_for(host: SocketAddr) -> IpAddr {
    match host.ip() {
        IpAddr::V4(ip) if ip.is_loopback() => IpAddr::V4(ip),
        IpAddr::V6(ip) if ip.is_loopback() => IpAddr::V6(ip),
        IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn env(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn placement_from_flags_slurm_and_open_mpi() {
        let p = placement(Some(1), Some(4), &env(&[])).unwrap();
        assert_eq!((p.rank, p.world, p.source), (1, 4, RankSource::Flags));
        let slurm = env(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "8")]);
        let p = placement(None, None, &slurm).unwrap();
        assert_eq!((p.rank, p.world, p.source), (3, 8, RankSource::Slurm));
        let ompi = env(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")]);
        let p = placement(None, None, &ompi).unwrap();
        assert_eq!((p.rank, p.world, p.source), (0, 2, RankSource::OpenMpi));
        // Slurm wins over Open MPI; flags win over both (and need no environment).
        let both = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ]);
        assert_eq!(placement(None, None, &both).unwrap().rank, 5);
        let p = placement(Some(1), Some(2), &both).unwrap();
        assert_eq!((p.rank, p.world, p.source), (1, 2, RankSource::Flags));
        // A flag fills in one field; the other comes from the scheduler.
        let p = placement(Some(7), None, &slurm).unwrap();
        assert_eq!((p.rank, p.world, p.source), (7, 8, RankSource::Slurm));
    }

    #[test]
    fn placement_errors_name_the_variable() {
        let e = placement(None, None, &env(&[])).unwrap_err();
        assert!(e.contains("--rank") && e.contains("SLURM_PROCID"), "{e}");
        let e = placement(Some(0), None, &env(&[])).unwrap_err();
        assert!(e.contains("--world"), "{e}");
        let e = placement(None, None, &env(&[("SLURM_PROCID", "1")])).unwrap_err();
        assert!(e.contains("SLURM_NTASKS"), "{e}");
        let e = placement(None, None, &env(&[("OMPI_COMM_WORLD_SIZE", "1")])).unwrap_err();
        assert!(e.contains("OMPI_COMM_WORLD_RANK"), "{e}");
        let e = placement(
            None,
            None,
            &env(&[("SLURM_PROCID", "x"), ("SLURM_NTASKS", "2")]),
        )
        .unwrap_err();
        assert!(e.contains("SLURM_PROCID=\"x\""), "{e}");
        let e = placement(
            None,
            None,
            &env(&[("SLURM_PROCID", "2"), ("SLURM_NTASKS", "2")]),
        )
        .unwrap_err();
        assert!(
            e.contains("SLURM_PROCID") && e.contains("SLURM_NTASKS"),
            "{e}"
        );
        let e = placement(Some(0), Some(0), &env(&[])).unwrap_err();
        assert!(e.contains("--world"), "{e}");
    }

    #[test]
    fn messages_round_trip() {
        let msgs = [
            Msg::Join {
                rank: 3,
                world: 4,
                token: b"tok".to_vec(),
                addr: "127.0.0.1:5000".into(),
            },
            Msg::Welcome {
                peers: vec!["127.0.0.1:1".into(), "[::1]:2".into()],
                identity: RunIdentity {
                    cert_der: vec![1, 2, 3],
                    key_der: vec![4],
                },
            },
            Msg::Reject("no".into()),
        ];
        for m in msgs {
            let e = m.encode();
            let len = u32::from_le_bytes([e[0], e[1], e[2], e[3]]) as usize;
            assert_eq!(len, e.len() - 4);
            assert_eq!(Msg::decode(&e[4..]).unwrap(), m);
            for cut in 4..e.len() {
                assert!(Msg::decode(&e[4..cut]).is_err());
            }
        }
        assert!(
            Msg::Join {
                rank: 0,
                world: 1,
                token: vec![0; MAX_TOKEN_LEN],
                addr: "x".repeat(255),
            }
            .encode()
            .len()
                <= MAX_JOIN + 4
        );
    }

    proptest! {
        #[test]
        fn hostile_bytes_never_panic(mut bytes in proptest::collection::vec(any::<u8>(), 0..96), tag in 0u8..5) {
            if bytes.len() > 6 {
                bytes[..4].copy_from_slice(MAGIC);
                bytes[4] = VERSION;
                bytes[5] = tag;
            }
            let _ = Msg::decode(&bytes);
        }
    }
}
