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
//! [`TcpConfig::connect_timeout`] passes. This set-up is shared with QUIC (`mesh.rs`);
//! what is TCP's own is the connection: a plain socket with `TCP_NODELAY`.
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
//!
//! [`ByteCount`]: super::ByteCount
//! [`Transport`]: super::Transport
//! [`Transport::send`]: super::Transport::send

use std::net::{Shutdown, SocketAddr};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

use super::mesh::{check_setup, mesh, runtime, transport_via_peers, Failed, Link, Peers};
use super::stream::Outgoing;
use super::threaded::{read_loop, write_loop};
use super::{Inbox, OnEvent, TransportError};
use crate::frame::FRAME_HEADER_LEN;
use crate::shaping::LinkSpec;

/// Configuration of a [`TcpTransport`].
#[derive(Clone, PartialEq)]
pub struct TcpConfig {
    /// The run token every connection must present (at most
    /// [`MAX_TOKEN_LEN`](crate::frame::MAX_TOKEN_LEN) bytes).
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
    /// (5 bytes, not counted in [`ByteCount`](super::ByteCount)). `None`: never. Default
    /// 1 s. Must be well below every peer's [`TcpConfig::peer_timeout`].
    pub heartbeat_interval: Option<Duration>,
    /// A peer from which nothing — no data, no heartbeat — arrives for this long is taken
    /// as lost: its connection is dropped and reported as [`TransportError::PeerSilent`],
    /// which a [`crate::Communicator`] turns into [`crate::CommError::PeerLost`] naming it.
    /// This catches a frozen (`SIGSTOP`, swapping) or vanished (host down, network cut)
    /// peer, whose connection stays open, even between collectives. `None`: never.
    /// Default 10 s; at least twice [`TcpConfig::heartbeat_interval`].
    pub peer_timeout: Option<Duration>,
    /// Called by the reader threads after each event they queue for this rank (see
    /// [`OnEvent`]). Default `None`.
    pub on_event: Option<OnEvent>,
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
            .field("on_event", &self.on_event)
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
            on_event: None,
        }
    }
}

/// One rank of a TCP mesh (see the [module docs](self)).
#[derive(Debug)]
pub struct TcpTransport {
    peers: Peers<mpsc::Sender<Outgoing>>,
    linger: Duration,
    /// Disconnects once every writer thread has returned.
    writers_done: mpsc::Receiver<()>,
    readers: Vec<JoinHandle<()>>,
    writer_threads: Vec<JoinHandle<()>>,
    /// One handle per connection, to shut it down on drop.
    streams: Vec<std::net::TcpStream>,
}

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
        check_setup(
            rank,
            world,
            &cfg.token,
            cfg.heartbeat_interval,
            cfg.peer_timeout,
        )?;
        let rt = runtime(cfg.io_threads, "dtrain-comms-tcp")?;
        listener.set_nonblocking(true)?;
        let conns = rt.block_on(async {
            let link = Arc::new(TcpLink {
                listener: TcpListener::from_std(listener)?,
            });
            mesh(link, rank, peers, &cfg.token, cfg.connect_timeout).await
        })?;
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
        let inbox = Inbox::new(rx, tx.clone(), world, FRAME_HEADER_LEN as u64);
        let mut mesh = Peers::new(rank, world, cfg.max_frame, &cfg.link, inbox);
        let (mut readers, mut writer_threads) = (Vec::new(), Vec::new());
        let mut streams = Vec::new();
        for (peer, stream, buf) in conns {
            let (rd, wr) = (stream.try_clone()?, stream.try_clone()?);
            streams.push(stream);
            let (tx, max, quiet) = (tx.clone(), cfg.max_frame, cfg.peer_timeout);
            let on_event = cfg.on_event.clone();
            readers.push(
                std::thread::Builder::new()
                    .name(format!("dtrain-tcp-rd{peer}"))
                    .spawn(move || read_loop(peer, rd, &buf, tx, on_event, max, quiet))?,
            );
            let (wtx, wrx) = mpsc::channel();
            let (done, beat) = (done_tx.clone(), cfg.heartbeat_interval);
            writer_threads.push(
                std::thread::Builder::new()
                    .name(format!("dtrain-tcp-wr{peer}"))
                    .spawn(move || write_loop(peer, wr, wrx, done, beat))?,
            );
            mesh.connect(peer, wtx);
        }
        Ok(TcpTransport {
            peers: mesh,
            linger: cfg.linger,
            writers_done,
            readers,
            writer_threads,
            streams,
        })
    }
}

transport_via_peers!(TcpTransport, peers);

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // Closing the queues lets each writer flush what is queued and shut its direction
        // down; wait for that (up to the linger time), then close the connections, which
        // also ends the readers (and any writer still stuck on a peer that stopped reading).
        self.peers.close();
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

/// TCP connections for [`mesh`]: plain sockets with `TCP_NODELAY`.
struct TcpLink {
    listener: TcpListener,
}

impl Link for TcpLink {
    type Incoming = (TcpStream, SocketAddr);
    type Dialed = TcpStream;
    type Stream = TcpStream;
    type Rd = TcpStream;
    type Wr = TcpStream;
    const IO_FAILURE_IS_REFUSAL: bool = false;

    async fn accept(&self) -> Result<Self::Incoming, Failed> {
        self.listener
            .accept()
            .await
            .map_err(|e| Failed::Retry(e.to_string()))
    }

    async fn open_incoming(
        (s, addr): Self::Incoming,
        _deadline: tokio::time::Instant,
    ) -> Result<(SocketAddr, TcpStream), String> {
        s.set_nodelay(true).map_err(|e| format!("{addr}: {e}"))?;
        Ok((addr, s))
    }

    async fn dial(&self, addr: SocketAddr) -> Result<TcpStream, Failed> {
        TcpStream::connect(addr)
            .await
            .map_err(|e| Failed::Retry(e.to_string()))
    }

    async fn open_dialed(s: TcpStream) -> std::io::Result<TcpStream> {
        s.set_nodelay(true)?;
        Ok(s)
    }

    fn reader(s: &mut TcpStream) -> &mut TcpStream {
        s
    }

    fn writer(s: &mut TcpStream) -> &mut TcpStream {
        s
    }

    fn refuse(_: &TcpStream, _: &'static [u8]) {}
}
