//! TCP driver (tokio): one connection per rank pair, TCP_NODELAY, length-prefixed frames
//! ([`crate::frame`]) with a bounded size, authenticated by the run token.
//!
//! # Set-up
//! [`TcpTransport::connect`] takes this rank's already-bound listener and every rank's
//! address. Rank `r` dials every lower rank and accepts every higher one. The dialer sends
//! a [`Hello`](crate::frame::Hello) (rank, world size, run token); the acceptor checks it and answers with its
//! own hello, which the dialer checks in turn. A connection with a wrong token, an
//! unexpected rank or world size, or no hello before the deadline is refused (closed) and
//! logged with `tracing::warn!`; set-up continues until every expected peer is connected or
//! [`TcpConfig::connect_timeout`] passes.
//!
//! # Data path
//! Each connection has a reader task (parses frames into the rank's inbox; a closed or
//! broken connection becomes [`TransportError::Closed`]) and a writer task fed by an
//! unbounded queue, so [`Transport::send`] never blocks on the peer (see [`Transport`]).
//! With [`TcpConfig::link`] set, `send` stamps every frame with its release time on this
//! rank's emulated egress link ([`crate::shaping`]) and the writer holds it until then.
//! Dropping the transport flushes queued frames (for up to [`TcpConfig::linger`]) and
//! closes the connections.
//!
//! The runtime lives inside the transport: create and drop it outside any async context
//! (creating or dropping it inside a tokio runtime panics).

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio::task::{JoinHandle, JoinSet};
use tracing::warn;

use super::stream::{read_frame, reader, write_hello, writer, Outgoing, Shaper};
use super::{check_peer, ByteCount, Inbox, Transport, TransportError};
use crate::frame::{Frame, FRAME_HEADER_LEN, MAX_HELLO_FRAME, MAX_TOKEN_LEN};
use crate::shaping::LinkSpec;

/// Configuration of a [`TcpTransport`].
#[derive(Clone, PartialEq)]
pub struct TcpConfig {
    /// The run token every connection must present (at most [`MAX_TOKEN_LEN`] bytes).
    pub token: Vec<u8>,
    /// Largest frame accepted or sent, in bytes after the length prefix. Default 64 MiB.
    pub max_frame: usize,
    /// How long set-up may take. Default 30 s.
    pub connect_timeout: Duration,
    /// Runtime worker threads for the connection tasks. Default 1.
    pub io_threads: usize,
    /// How long dropping the transport waits to flush queued frames. Default 10 s.
    pub linger: Duration,
    /// Egress link emulation of this rank (see [`crate::shaping`]). Default unshaped.
    pub link: LinkSpec,
}

impl std::fmt::Debug for TcpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpConfig")
            .field("token", &"<redacted>")
            .field("max_frame", &self.max_frame)
            .field("connect_timeout", &self.connect_timeout)
            .field("io_threads", &self.io_threads)
            .field("linger", &self.linger)
            .field("link", &self.link)
            .finish()
    }
}

impl TcpConfig {
    /// Defaults with the given run token.
    pub fn new(token: impl Into<Vec<u8>>) -> Self {
        TcpConfig {
            token: token.into(),
            max_frame: 64 << 20,
            connect_timeout: Duration::from_secs(30),
            io_threads: 1,
            linger: Duration::from_secs(10),
            link: LinkSpec::default(),
        }
    }
}

/// One rank of a TCP mesh (see the [module docs](self)).
#[derive(Debug)]
pub struct TcpTransport {
    rank: usize,
    world: usize,
    max_frame: usize,
    linger: Duration,
    writers: Vec<Option<UnboundedSender<Outgoing>>>,
    writer_tasks: Vec<JoinHandle<()>>,
    inbox: Inbox,
    sent: u64,
    shaper: Option<Shaper>,
    rt: Option<Runtime>,
}

type Conn = (usize, TcpStream, BytesMut);

impl TcpTransport {
    /// Connects rank `rank` to every other rank: `peers[i]` is rank `i`'s listening
    /// address (`peers[rank]` is not used), `listener` is this rank's bound listener.
    /// Blocks until every peer is connected and authenticated, or fails after
    /// `cfg.connect_timeout` naming the missing ranks.
    pub fn connect(
        rank: usize,
        peers: &[SocketAddr],
        listener: std::net::TcpListener,
        cfg: TcpConfig,
    ) -> Result<Self, TransportError> {
        let world = peers.len();
        if rank >= world {
            return Err(TransportError::InvalidRank { rank, world });
        }
        if cfg.token.len() > MAX_TOKEN_LEN {
            return Err(TransportError::Handshake {
                peer: "config".into(),
                detail: format!("run token longer than {MAX_TOKEN_LEN} bytes"),
            });
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.io_threads.max(1))
            .thread_name("dtrain-comms-tcp")
            .enable_io()
            .enable_time()
            .build()?;
        listener.set_nonblocking(true)?;
        let conns = rt.block_on(mesh(rank, world, peers.to_vec(), listener, cfg.clone()))?;
        let (tx, rx) = mpsc::channel();
        let mut writers: Vec<Option<UnboundedSender<Outgoing>>> =
            (0..world).map(|_| None).collect();
        let mut writer_tasks = Vec::new();
        for (peer, stream, buf) in conns {
            let (rd, wr) = stream.into_split();
            rt.spawn(reader(peer, rd, buf, tx.clone(), cfg.max_frame));
            let (wtx, wrx) = unbounded_channel();
            writer_tasks.push(rt.spawn(async move {
                writer(peer, wr, wrx).await;
            }));
            writers[peer] = Some(wtx);
        }
        Ok(TcpTransport {
            rank,
            world,
            max_frame: cfg.max_frame,
            linger: cfg.linger,
            writers,
            writer_tasks,
            inbox: Inbox::new(rx, tx, world, FRAME_HEADER_LEN as u64),
            sent: 0,
            shaper: Shaper::new(&cfg.link),
            rt: Some(rt),
        })
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn send(&mut self, to: usize, msg: Vec<u8>) -> Result<(), TransportError> {
        check_peer(to, self.rank, self.world)?;
        if msg.len() + 1 > self.max_frame {
            return Err(TransportError::TooLarge {
                len: msg.len() + 1,
                max: self.max_frame,
            });
        }
        let len = msg.len() + FRAME_HEADER_LEN;
        let w = self.writers[to]
            .as_ref()
            .ok_or(TransportError::Closed { rank: to })?;
        let release = self.shaper.as_mut().map(|s| s.release(Instant::now(), len));
        w.send(Outgoing { release, msg })
            .map_err(|_| TransportError::Closed { rank: to })?;
        self.sent += len as u64;
        Ok(())
    }

    fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
        self.inbox.recv(deadline)
    }

    fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError> {
        check_peer(from, self.rank, self.world)?;
        self.inbox.recv_from(from, deadline)
    }

    fn bytes(&self) -> ByteCount {
        ByteCount {
            sent: self.sent,
            received: self.inbox.received(),
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // Closing the queues lets each writer flush what is queued and shut its half down.
        self.writers.clear();
        let tasks = std::mem::take(&mut self.writer_tasks);
        if let Some(rt) = self.rt.take() {
            let deadline = tokio::time::Instant::now() + self.linger;
            rt.block_on(async move {
                for t in tasks {
                    let _ = tokio::time::timeout_at(deadline, t).await;
                }
            });
            rt.shutdown_timeout(Duration::from_millis(100));
        }
    }
}

/// Builds every connection of `rank`.
async fn mesh(
    rank: usize,
    world: usize,
    peers: Vec<SocketAddr>,
    listener: std::net::TcpListener,
    cfg: TcpConfig,
) -> Result<Vec<Conn>, TransportError> {
    let listener = TcpListener::from_std(listener)?;
    let deadline = tokio::time::Instant::now() + cfg.connect_timeout;
    let mut conns: Vec<Option<(TcpStream, BytesMut)>> = (0..world).map(|_| None).collect();
    let mut dials = JoinSet::new();
    for (p, addr) in peers.iter().enumerate().take(rank) {
        dials.spawn(dial(rank, world, p, *addr, cfg.token.clone(), deadline));
    }
    let mut accepts: JoinSet<Result<Conn, String>> = JoinSet::new();
    let mut missing = world - 1;
    while missing > 0 {
        let accepting = conns[rank + 1..].iter().any(|c| c.is_none());
        tokio::select! {
            r = listener.accept(), if accepting => match r {
                Ok((s, addr)) => {
                    accepts.spawn(accept_one(s, addr, rank, world, cfg.token.clone(), deadline));
                }
                Err(e) => warn!("rank {rank}: accept failed: {e}"),
            },
            Some(r) = accepts.join_next(), if !accepts.is_empty() => match r {
                Ok(Ok((p, s, buf))) => {
                    if conns[p].is_some() {
                        warn!("rank {rank}: refused a second connection claiming rank {p}");
                    } else {
                        write_hello_or_warn(rank, world, &cfg.token, p, s, buf, &mut conns).await;
                        if conns[p].is_some() {
                            missing -= 1;
                        }
                    }
                }
                Ok(Err(e)) => warn!("rank {rank}: refused connection: {e}"),
                Err(e) => warn!("rank {rank}: handshake task failed: {e}"),
            },
            Some(r) = dials.join_next(), if !dials.is_empty() => match r {
                Ok(Ok((p, s, buf))) => {
                    conns[p] = Some((s, buf));
                    missing -= 1;
                }
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(TransportError::Handshake { peer: "?".into(), detail: e.to_string() }),
            },
            _ = tokio::time::sleep_until(deadline) => {
                let absent: Vec<usize> = (0..world).filter(|&p| p != rank && conns[p].is_none()).collect();
                return Err(TransportError::Handshake {
                    peer: format!("ranks {absent:?}"),
                    detail: format!("not connected within {:?}", cfg.connect_timeout),
                });
            }
        }
    }
    Ok(conns
        .into_iter()
        .enumerate()
        .filter_map(|(p, c)| c.map(|(s, b)| (p, s, b)))
        .collect())
}

/// Answers an authenticated dialer with our hello and records the connection.
async fn write_hello_or_warn(
    rank: usize,
    world: usize,
    token: &[u8],
    p: usize,
    mut s: TcpStream,
    buf: BytesMut,
    conns: &mut [Option<(TcpStream, BytesMut)>],
) {
    match write_hello(&mut s, rank, world, token).await {
        Ok(()) => conns[p] = Some((s, buf)),
        Err(e) => warn!("rank {rank}: answering rank {p}'s hello failed: {e}"),
    }
}

/// Checks an incoming connection's hello.
async fn accept_one(
    s: TcpStream,
    addr: SocketAddr,
    rank: usize,
    world: usize,
    token: Vec<u8>,
    deadline: tokio::time::Instant,
) -> Result<Conn, String> {
    let mut s = s;
    s.set_nodelay(true).map_err(|e| format!("{addr}: {e}"))?;
    let mut buf = BytesMut::new();
    let f = tokio::time::timeout_at(deadline, read_frame(&mut s, &mut buf, MAX_HELLO_FRAME))
        .await
        .map_err(|_| format!("{addr}: no hello before the deadline"))?
        .map_err(|e| format!("{addr}: {e}"))?;
    let Some(Frame::Hello(h)) = f else {
        return Err(format!("{addr}: first frame is not a hello"));
    };
    if !h.token_matches(&token) {
        return Err(format!("{addr}: wrong run token"));
    }
    let p = h.rank as usize;
    if h.world as usize != world || p <= rank || p >= world {
        return Err(format!(
            "{addr}: unexpected rank {p} / world {} (this is rank {rank} of {world})",
            h.world
        ));
    }
    Ok((p, s, buf))
}

/// Connects to `p` (retrying until the deadline) and authenticates both ways.
async fn dial(
    rank: usize,
    world: usize,
    p: usize,
    addr: SocketAddr,
    token: Vec<u8>,
    deadline: tokio::time::Instant,
) -> Result<Conn, TransportError> {
    let fail = |detail: String| TransportError::Handshake {
        peer: format!("rank {p} at {addr}"),
        detail,
    };
    let mut s = loop {
        match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => break s,
            Ok(Err(e)) if tokio::time::Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(Err(e)) => return Err(fail(e.to_string())),
            Err(_) => return Err(fail("connect timed out".into())),
        }
    };
    s.set_nodelay(true)?;
    write_hello(&mut s, rank, world, &token).await?;
    let mut buf = BytesMut::new();
    let f = tokio::time::timeout_at(deadline, read_frame(&mut s, &mut buf, MAX_HELLO_FRAME))
        .await
        .map_err(|_| fail("no answer to our hello".into()))?;
    match f {
        Ok(Some(Frame::Hello(h)))
            if h.token_matches(&token) && h.rank as usize == p && h.world as usize == world =>
        {
            Ok((p, s, buf))
        }
        Ok(Some(Frame::Hello(_))) => Err(fail(
            "peer answered with a different token, rank or world size".into(),
        )),
        Ok(_) | Err(_) => Err(fail(
            "connection refused by the peer (wrong run token?)".into(),
        )),
    }
}
