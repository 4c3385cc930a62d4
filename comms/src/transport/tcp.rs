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
//! Set-up runs on a small tokio runtime that is shut down once the mesh is built. Each
//! connection then has a blocking reader thread (parses frames into the rank's inbox; a
//! closed or broken connection becomes [`TransportError::Closed`]) and a blocking writer
//! thread fed by an unbounded queue, so [`Transport::send`] never blocks on the peer (see
//! [`Transport`]) and a rank sends and receives at the same time. Large frames are read
//! straight into their own buffers and written with the frame prefix in one vectored
//! write; message buffers circulate through the crate's buffer pool (details in
//! `threaded.rs`). With [`TcpConfig::link`] set, `send` stamps every frame with its
//! release time on this rank's emulated egress link ([`crate::shaping`]) and the writer
//! holds it until then. Dropping the transport flushes queued frames (for up to
//! [`TcpConfig::linger`]) and closes the connections.
//!
//! # Liveness
//! A killed process's connections are closed by its kernel, which the reader sees at once.
//! A frozen process (`SIGSTOP`, a debugger, swapping) or a host or network that vanished
//! closes nothing: its connections stay open and silent. So every idle connection writes
//! a heartbeat frame every [`TcpConfig::heartbeat_interval`] (1 s), and a reader that
//! receives no byte for [`TcpConfig::peer_timeout`] (10 s) drops the connection and
//! reports the peer as [`TransportError::PeerSilent`]. The heartbeats are sent by the
//! writer threads, not by the thread calling collectives, so a rank that is merely busy
//! between collectives stays alive; whether it takes part in time is the
//! [`crate::Communicator`]'s timeout's business. Heartbeats are neither delivered nor
//! counted in [`ByteCount`].
//!
//! Create the transport outside any async context (set-up blocks on its own runtime,
//! which panics inside another one).

use std::net::{Shutdown, SocketAddr};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tracing::warn;

use super::stream::{check_liveness, read_frame, write_hello, Outgoing, Shaper};
use super::threaded::{read_loop, write_loop};
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
    /// Runtime worker threads for connection set-up (data moves on dedicated threads, one
    /// reader and one writer per connection). Default 1.
    pub io_threads: usize,
    /// How long dropping the transport waits to flush queued frames. Default 10 s.
    pub linger: Duration,
    /// Egress link emulation of this rank (see [`crate::shaping`]). Default unshaped.
    /// Heartbeats are not shaped.
    pub link: LinkSpec,
    /// A connection that has written nothing for this long writes a heartbeat frame
    /// (5 bytes, not counted in [`ByteCount`]). `None`: never. Default 1 s. Must be well
    /// below every peer's [`TcpConfig::peer_timeout`].
    pub heartbeat_interval: Option<Duration>,
    /// A peer from which nothing — no data, no heartbeat — arrives for this long is taken
    /// as lost: its connection is dropped and reported as [`TransportError::PeerSilent`],
    /// which a [`crate::Communicator`] turns into [`crate::CommError::PeerLost`] naming it.
    /// This catches a frozen (`SIGSTOP`, swapping) or vanished (host down, network cut)
    /// peer, whose connection stays open, even between collectives. `None`: never.
    /// Default 10 s; at least twice [`TcpConfig::heartbeat_interval`].
    pub peer_timeout: Option<Duration>,
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
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("peer_timeout", &self.peer_timeout)
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
            heartbeat_interval: Some(Duration::from_secs(1)),
            peer_timeout: Some(Duration::from_secs(10)),
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
    writers: Vec<Option<mpsc::Sender<Outgoing>>>,
    /// Disconnects once every writer thread has returned.
    writers_done: mpsc::Receiver<()>,
    readers: Vec<JoinHandle<()>>,
    writer_threads: Vec<JoinHandle<()>>,
    /// One handle per connection, to shut it down on drop.
    streams: Vec<std::net::TcpStream>,
    inbox: Inbox,
    sent: u64,
    shaper: Option<Shaper>,
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
        check_liveness(cfg.heartbeat_interval, cfg.peer_timeout)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.io_threads.max(1))
            .thread_name("dtrain-comms-tcp")
            .enable_io()
            .enable_time()
            .build()?;
        listener.set_nonblocking(true)?;
        let conns = rt.block_on(mesh(rank, world, peers.to_vec(), listener, cfg.clone()))?;
        let conns = {
            let _rt = rt.enter();
            conns
                .into_iter()
                .map(|(p, s, buf)| {
                    let s = s.into_std()?;
                    s.set_nonblocking(false)?;
                    Ok((p, s, buf))
                })
                .collect::<Result<Vec<_>, std::io::Error>>()?
        };
        rt.shutdown_background();
        let (tx, rx) = mpsc::channel();
        let (done_tx, writers_done) = mpsc::channel();
        let mut writers: Vec<Option<mpsc::Sender<Outgoing>>> = (0..world).map(|_| None).collect();
        let (mut readers, mut writer_threads) = (Vec::new(), Vec::new());
        let mut streams = Vec::new();
        for (peer, stream, buf) in conns {
            let (rd, wr) = (stream.try_clone()?, stream.try_clone()?);
            streams.push(stream);
            let (tx, max, quiet) = (tx.clone(), cfg.max_frame, cfg.peer_timeout);
            readers.push(
                std::thread::Builder::new()
                    .name(format!("dtrain-tcp-rd{peer}"))
                    .spawn(move || read_loop(peer, rd, &buf, tx, max, quiet))?,
            );
            let (wtx, wrx) = mpsc::channel();
            let (done, beat) = (done_tx.clone(), cfg.heartbeat_interval);
            writer_threads.push(
                std::thread::Builder::new()
                    .name(format!("dtrain-tcp-wr{peer}"))
                    .spawn(move || write_loop(peer, wr, wrx, done, beat))?,
            );
            writers[peer] = Some(wtx);
        }
        Ok(TcpTransport {
            rank,
            world,
            max_frame: cfg.max_frame,
            linger: cfg.linger,
            writers,
            writers_done,
            readers,
            writer_threads,
            streams,
            inbox: Inbox::new(rx, tx, world, FRAME_HEADER_LEN as u64),
            sent: 0,
            shaper: Shaper::new(&cfg.link),
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
        // Closing the queues lets each writer flush what is queued and shut its direction
        // down; wait for that (up to the linger time), then close the connections, which
        // also ends the readers (and any writer still stuck on a peer that stopped reading).
        self.writers.clear();
        // Nothing is ever sent on `writers_done`: it disconnects when the last writer returns.
        let _ = self.writers_done.recv_timeout(self.linger);
        for s in &self.streams {
            let _ = s.shutdown(Shutdown::Both);
        }
        for t in self.readers.drain(..) {
            let _ = t.join();
        }
        // A writer may still sleep until an emulated release time: join only finished ones.
        for t in self.writer_threads.drain(..) {
            if t.is_finished() {
                let _ = t.join();
            }
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
