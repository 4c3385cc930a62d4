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
//! # Newcomers
//! With [`TcpConfig::accept_joiners`] (live membership) the listener stays open after
//! set-up, on the set-up runtime, which is kept for it: a newcomer taking a lost rank's
//! place ([`TcpTransport::join`]) dials every rank, says hello claiming the lost rank (any
//! rank but the acceptor's), and is answered and kept waiting — reported by
//! [`Transport::joiners`] — until the group admits it ([`Transport::admit`]: the
//! predecessor's connection is shut down, its reader joined, and the newcomer's reader and
//! writer take over). A rank the newcomer cannot reach within a few seconds (lost, frozen)
//! is reported closed to it.
//!
//! # Data path
//! Set-up runs on a small tokio runtime that is shut down once the mesh is built (kept
//! for the listener when the transport accepts newcomers). Each
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
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;

use super::mesh::{
    accept_newcomers, check_setup, join_on, link_member, mesh, runtime, via_peers, Admission, Conn,
    Failed, Link, Newcomers, Peers,
};
use super::stream::Outgoing;
use super::threaded::{read_loop, write_loop};
use super::{check_peer, ByteCount, Event, Inbox, OnEvent, Transport, TransportError};
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
    /// (5 bytes, not counted in [`ByteCount`]). `None`: never. Default
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
    /// Keep the listener open after set-up and accept newcomers that take a lost rank's
    /// place ([`TcpTransport::join`]; reported by [`Transport::joiners`], switched to by
    /// [`Transport::admit`]): live membership. Default `false`.
    pub accept_joiners: bool,
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
            .field("accept_joiners", &self.accept_joiners)
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
            accept_joiners: false,
        }
    }
}

/// One rank of a TCP mesh (see the [module docs](self)).
#[derive(Debug)]
pub struct TcpTransport {
    rank: usize,
    peers: Peers<mpsc::Sender<Outgoing>>,
    linger: Duration,
    /// Disconnects once every writer thread has returned.
    writers_done: mpsc::Receiver<()>,
    /// The writers' side of `writers_done` for the writers of newcomers (dropped first on
    /// drop, so that the last writer's return disconnects it).
    done_tx: Option<mpsc::Sender<()>>,
    /// The inbox's sender, for the readers of newcomers.
    events: mpsc::Sender<Event>,
    /// Per peer: its connection's reader thread.
    readers: Vec<Option<JoinHandle<()>>>,
    writer_threads: Vec<JoinHandle<()>>,
    /// Per peer: a handle of its connection, to shut it down on drop or when replaced.
    streams: Vec<Option<std::net::TcpStream>>,
    max_frame: usize,
    peer_timeout: Option<Duration>,
    heartbeat: Option<Duration>,
    on_event: Option<OnEvent>,
    /// Newcomers (with [`TcpConfig::accept_joiners`]).
    joining: Option<Joining>,
}

/// The listener kept open for newcomers, and the newcomers waiting to be admitted.
#[derive(Debug)]
struct Joining {
    /// Runs the accept loop ([`accept_newcomers`]).
    _rt: Runtime,
    book: Newcomers<std::net::TcpStream>,
}

/// An authenticated newcomer's connection: the rank it claims, the socket, and the bytes
/// read past its hello.
type Newcomer = super::mesh::Newcomer<std::net::TcpStream>;

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
        let (rt, link) = Self::set_up(rank, peers.len(), listener, &cfg)?;
        let conns = rt.block_on(mesh(
            link.clone(),
            rank,
            peers,
            &cfg.token,
            cfg.connect_timeout,
        ))?;
        Self::build(rank, peers.len(), rt, link, conns, cfg, None)
    }

    /// A newcomer taking rank `rank`'s place in a running mesh (its predecessor lost):
    /// dials every other rank at `peers` (each within a few seconds; the ranks that do not
    /// answer — lost ones, frozen ones — are reported closed), and waits to be admitted
    /// by the ranks it reached, which must run with [`TcpConfig::accept_joiners`] (see
    /// [`crate::Communicator::join`]). Fails when it reaches no rank at all.
    pub fn join(
        rank: usize,
        peers: &[SocketAddr],
        listener: std::net::TcpListener,
        cfg: TcpConfig,
    ) -> Result<Self, TransportError> {
        let world = peers.len();
        let (rt, link) = Self::set_up(rank, world, listener, &cfg)?;
        // Another newcomer may dial this one while it still dials the others (a node's
        // workers come back together): answered from the start, and kept waiting.
        let arrived = cfg
            .accept_joiners
            .then(|| Self::accept_on(&rt, &link, rank, world, &cfg.token));
        let conns = join_on(&rt, &link, rank, peers, &cfg.token, cfg.connect_timeout)?;
        let mut t = Self::build(rank, world, rt, link, conns, cfg, arrived)?;
        if let Some(j) = &mut t.joining {
            for (p, d) in j.book.dialed.iter_mut().enumerate() {
                *d = t.streams[p].is_some();
            }
        }
        Ok(t)
    }

    /// Starts accepting newcomers on `link` (see [`accept_newcomers`]); they arrive on the
    /// receiver returned.
    fn accept_on(
        rt: &Runtime,
        link: &Arc<TcpLink>,
        rank: usize,
        world: usize,
        token: &[u8],
    ) -> mpsc::Receiver<Newcomer> {
        let (tx, arrived) = mpsc::channel();
        rt.spawn(accept_newcomers::<TcpLink, std::net::TcpStream>(
            link.clone(),
            rank,
            world,
            token.to_vec(),
            tx,
            |s| {
                let s = s.into_std()?;
                s.set_nonblocking(false)?;
                Ok(s)
            },
        ));
        arrived
    }

    /// The checks before set-up, the set-up runtime, and the link over `listener`.
    fn set_up(
        rank: usize,
        world: usize,
        listener: std::net::TcpListener,
        cfg: &TcpConfig,
    ) -> Result<(Runtime, Arc<TcpLink>), TransportError> {
        check_setup(
            rank,
            world,
            &cfg.token,
            cfg.heartbeat_interval,
            cfg.peer_timeout,
        )?;
        let rt = runtime(cfg.io_threads, "dtrain-comms-tcp")?;
        listener.set_nonblocking(true)?;
        let listener = {
            let _rt = rt.enter();
            TcpListener::from_std(listener)?
        };
        Ok((rt, Arc::new(TcpLink { listener })))
    }

    /// The transport over the connections `conns` made on `rt` (kept, with the listener of
    /// `link`, when the transport accepts newcomers; shut down otherwise). Ranks without a
    /// connection are reported closed. `arrived`: the newcomers of an accept loop started
    /// already ([`TcpTransport::accept_on`]).
    fn build(
        rank: usize,
        world: usize,
        rt: Runtime,
        link: Arc<TcpLink>,
        conns: Vec<Conn<TcpLink>>,
        cfg: TcpConfig,
        arrived: Option<mpsc::Receiver<Newcomer>>,
    ) -> Result<Self, TransportError> {
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
        let joining = if cfg.accept_joiners {
            let arrived =
                arrived.unwrap_or_else(|| Self::accept_on(&rt, &link, rank, world, &cfg.token));
            drop(link);
            Some(Joining {
                _rt: rt,
                book: Newcomers::new(arrived, world),
            })
        } else {
            drop(link);
            rt.shutdown_background();
            None
        };
        let (tx, rx) = mpsc::channel();
        let (done_tx, writers_done) = mpsc::channel();
        let inbox = Inbox::new(rx, tx.clone(), world, FRAME_HEADER_LEN as u64);
        let mut t = TcpTransport {
            rank,
            peers: Peers::new(rank, world, cfg.max_frame, &cfg.link, inbox),
            linger: cfg.linger,
            writers_done,
            done_tx: Some(done_tx),
            events: tx,
            readers: (0..world).map(|_| None).collect(),
            writer_threads: Vec::new(),
            streams: (0..world).map(|_| None).collect(),
            max_frame: cfg.max_frame,
            peer_timeout: cfg.peer_timeout,
            heartbeat: cfg.heartbeat_interval,
            on_event: cfg.on_event,
            joining,
        };
        let mut connected = vec![false; world];
        for (peer, stream, buf) in conns {
            connected[peer] = true;
            t.start(peer, stream, buf)?;
        }
        for p in (0..world).filter(|&p| p != rank && !connected[p]) {
            t.peers.unreachable(p);
        }
        Ok(t)
    }

    /// Starts the reader and writer threads of `peer`'s connection `stream` (`buf`: bytes
    /// read past its hello) and sends to `peer` through it from now on.
    fn start(
        &mut self,
        peer: usize,
        stream: std::net::TcpStream,
        buf: BytesMut,
    ) -> Result<(), TransportError> {
        let (rd, wr) = (stream.try_clone()?, stream.try_clone()?);
        self.streams[peer] = Some(stream);
        let (tx, max, quiet) = (self.events.clone(), self.max_frame, self.peer_timeout);
        let on_event = self.on_event.clone();
        self.readers[peer] = Some(
            std::thread::Builder::new()
                .name(format!("dtrain-tcp-rd{peer}"))
                .spawn(move || read_loop(peer, rd, &buf, tx, on_event, max, quiet))?,
        );
        let (wtx, wrx) = mpsc::channel();
        let done = self.done_tx.clone().expect("not dropped yet");
        let beat = self.heartbeat;
        self.writer_threads.push(
            std::thread::Builder::new()
                .name(format!("dtrain-tcp-wr{peer}"))
                .spawn(move || write_loop(peer, wr, wrx, done, beat))?,
        );
        self.peers.connect(peer, wtx);
        Ok(())
    }
}

impl Transport for TcpTransport {
    via_peers!(peers);

    fn joiners(&mut self) -> Vec<usize> {
        let readers = &self.readers;
        let Some(j) = &mut self.joining else {
            return Vec::new();
        };
        j.book.joiners(
            |p| readers[p].as_ref().is_some_and(|r| !r.is_finished()),
            |old| {
                let _ = old.shutdown(Shutdown::Both);
            },
        )
    }

    /// Switches to the newcomer's connection for `rank` — or, on a rank that joined
    /// itself, keeps the one it dialed to that rank (a newcomer it reached, admitted
    /// now; see [`TcpTransport::link_member`]). Where both exist (the new listener took
    /// the old port), the higher rank's dial is the link, on both sides.
    fn admit(&mut self, rank: usize) -> Result<(), TransportError> {
        check_peer(rank, self.rank, self.peers.world_size())?;
        self.joiners();
        let mine = self.dialed_open(rank);
        let Some(j) = &mut self.joining else {
            return Err(TransportError::Handshake {
                peer: format!("rank {rank}"),
                detail: "no newcomer is waiting for this rank".into(),
            });
        };
        let shut = |s: std::net::TcpStream| {
            let _ = s.shutdown(Shutdown::Both);
        };
        let Admission::Switch(stream, buf) = j.book.admission(rank, self.rank, mine, shut)? else {
            return Ok(());
        };
        // The predecessor's connection ends (if it had not), and its reader with it: all
        // it delivered is queued before the marker, and the newcomer's reader starts after.
        if let Some(old) = self.streams[rank].take() {
            let _ = old.shutdown(Shutdown::Both);
        }
        if let Some(r) = self.readers[rank].take() {
            let _ = r.join();
        }
        self.peers.replace(rank);
        self.start(rank, stream, buf)
    }

    /// See `mesh::link_member`: the link to each member is the
    /// connection this newcomer dialed to it, or the one a member that was a newcomer
    /// itself dialed to this one.
    fn link_member(&mut self, rank: usize, deadline: Instant) -> Result<(), TransportError> {
        link_member(self, rank, deadline, |t| {
            t.streams[rank].is_some() || t.joining.is_none()
        })
    }
}

impl TcpTransport {
    /// Whether this rank, as a newcomer, dialed its connection to `rank` and it is open
    /// (its reader runs), not yet admitted.
    fn dialed_open(&self, rank: usize) -> bool {
        self.joining.as_ref().is_some_and(|j| j.book.dialed[rank])
            && self.readers[rank]
                .as_ref()
                .is_some_and(|r| !r.is_finished())
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // Closing the queues lets each writer flush what is queued and shut its direction
        // down; wait for that (up to the linger time), then close the connections, which
        // also ends the readers (and any writer still stuck on a peer that stopped reading).
        self.peers.close();
        self.done_tx = None;
        // Nothing is ever sent on `writers_done`: it disconnects when the last writer returns.
        let _ = self.writers_done.recv_timeout(self.linger);
        for s in self.streams.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(j) = &self.joining {
            for s in j.book.waiting() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        for t in self.readers.iter_mut().filter_map(Option::take) {
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
