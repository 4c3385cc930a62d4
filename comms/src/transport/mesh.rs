//! What the connection-oriented drivers (TCP, QUIC) share: building the mesh of one rank,
//! and the send side of a built one. What they differ in — how a connection is dialed,
//! accepted and opened (TCP's socket options, QUIC's TLS with the pinned run certificate) —
//! is a [`Link`], implemented in each driver's file; how data moves on an open connection
//! (TCP: threads, `threaded.rs`; QUIC: tasks, `quic_stream.rs`) stays with the driver too.
//!
//! # Set-up
//! [`mesh`] connects rank `r` to every other rank: it dials every lower rank (retrying until
//! the deadline) and accepts every higher one. The dialer sends a [`Hello`](crate::frame::Hello)
//! (rank, world size, run token); the acceptor checks it and answers with its own, which
//! the dialer checks in turn. An incoming connection with a wrong token, an unexpected rank
//! or world size, a rank that is already connected, or no hello before the deadline is
//! refused and logged with `tracing::warn!`, and set-up goes on. A dial that fails fails
//! set-up with an error naming the peer (`rank p at addr`); when the deadline passes,
//! set-up fails naming the ranks still missing.
//!
//! # Send side
//! [`Peers`] is a built rank's [`Transport`] minus the driver: one unbounded queue per
//! peer (a [`Queue`]: the writer thread's or task's), frame-size checks, egress shaping,
//! byte counts and the [`Inbox`]. `send` never waits for the peer (see [`Transport`]).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::runtime::Runtime;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use super::stream::{check_liveness, read_frame, write_hello, Outgoing, Shaper};
use super::{check_frame, check_peer, ByteCount, Inbox, Transport, TransportError};
use crate::frame::{Frame, FRAME_HEADER_LEN, MAX_HELLO_FRAME, MAX_TOKEN_LEN};
use crate::shaping::LinkSpec;

/// Pause between two dials of a peer that is not listening yet.
const REDIAL: Duration = Duration::from_millis(20);

/// A connection-oriented link between ranks: what [`mesh`] needs of a driver.
///
/// Design: the mesh logic — who dials whom, the hello both ways, refusing strangers,
/// deadlines, naming the peer in errors — is the same for every such driver and lives in
/// [`mesh`]; a link only makes connections and opens a byte stream on them, so a driver's
/// set-up is its socket or TLS configuration and nothing else.
pub(crate) trait Link: Send + Sync + 'static {
    /// A connection handed over by the listening side, not yet authenticated.
    type Incoming: Send + 'static;
    /// A dialed connection, before its stream is open.
    type Dialed: Send + 'static;
    /// An open connection: the byte stream both ways (and whatever the driver keeps of the
    /// connection).
    type Stream: Send + 'static;
    /// The receiving half of a [`Link::Stream`].
    type Rd: AsyncRead + Unpin + Send;
    /// The sending half of a [`Link::Stream`].
    type Wr: AsyncWrite + Unpin + Send;

    /// Whether an I/O failure of the dialer once connected (opening the stream, sending
    /// the hello) is reported as a refusal by the peer — QUIC, where a peer's close shows
    /// up as a stream error — rather than as the I/O error it is (TCP).
    const IO_FAILURE_IS_REFUSAL: bool;

    /// The next incoming connection. [`Failed::Retry`]: this one failed (logged, and the
    /// mesh keeps accepting); [`Failed::Final`]: the listening side is gone.
    fn accept(&self) -> impl Future<Output = Result<Self::Incoming, Failed>> + Send;

    /// Completes an incoming connection up to its open stream, by `deadline`; the error
    /// (refused and logged by [`mesh`]) names the remote address.
    fn open_incoming(
        inc: Self::Incoming,
        deadline: tokio::time::Instant,
    ) -> impl Future<Output = Result<(SocketAddr, Self::Stream), String>> + Send;

    /// One attempt at connecting to `addr`. [`Failed::Retry`]: tried again until the
    /// deadline (the peer may not listen yet); [`Failed::Final`]: set-up fails.
    fn dial(&self, addr: SocketAddr) -> impl Future<Output = Result<Self::Dialed, Failed>> + Send;

    /// Opens the stream of a dialed connection.
    fn open_dialed(d: Self::Dialed) -> impl Future<Output = std::io::Result<Self::Stream>> + Send;

    /// The receiving half of `s`.
    fn reader(s: &mut Self::Stream) -> &mut Self::Rd;

    /// The sending half of `s`.
    fn writer(s: &mut Self::Stream) -> &mut Self::Wr;

    /// Refuses an open connection, telling the peer `why` where the protocol can (QUIC
    /// closes it with an application error; a TCP connection is closed when dropped).
    fn refuse(s: &Self::Stream, why: &'static [u8]);
}

/// A failed attempt of a [`Link`], and whether to go on.
#[derive(Debug)]
pub(crate) enum Failed {
    /// Transient: try again.
    Retry(String),
    /// Final: set-up fails with this detail. (Only QUIC has final failures: TLS.)
    #[cfg_attr(not(feature = "quic"), allow(dead_code))]
    Final(String),
}

/// An open, authenticated connection to rank `.0`, with the bytes read past the hello.
pub(crate) type Conn<L> = (usize, <L as Link>::Stream, BytesMut);

/// The checks every connection-oriented driver makes before set-up: `rank` is in the
/// world, the run token fits a hello, the liveness settings leave room for heartbeats.
pub(crate) fn check_setup(
    rank: usize,
    world: usize,
    token: &[u8],
    heartbeat: Option<Duration>,
    peer_timeout: Option<Duration>,
) -> Result<(), TransportError> {
    if rank >= world {
        return Err(TransportError::InvalidRank { rank, world });
    }
    if token.len() > MAX_TOKEN_LEN {
        return Err(TransportError::Handshake {
            peer: "config".into(),
            detail: format!("run token longer than {MAX_TOKEN_LEN} bytes"),
        });
    }
    check_liveness(heartbeat, peer_timeout)
}

/// The tokio runtime a driver builds its mesh on: `threads` workers named `name`.
pub(crate) fn runtime(threads: usize, name: &str) -> std::io::Result<Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name(name)
        .enable_io()
        .enable_time()
        .build()
}

/// Builds every connection of `rank` (see the [module docs](self)): `peers[i]` is rank
/// `i`'s address; returns the connections in rank order.
pub(crate) async fn mesh<L: Link>(
    link: Arc<L>,
    rank: usize,
    peers: &[SocketAddr],
    token: &[u8],
    connect_timeout: Duration,
) -> Result<Vec<Conn<L>>, TransportError> {
    let world = peers.len();
    let deadline = tokio::time::Instant::now() + connect_timeout;
    let mut conns: Vec<Option<(L::Stream, BytesMut)>> = (0..world).map(|_| None).collect();
    let mut dials = dial_all(&link, rank, peers, 0..rank, token, deadline);
    let mut accepts: JoinSet<Result<Conn<L>, String>> = JoinSet::new();
    let mut missing = world - 1;
    while missing > 0 {
        let accepting = conns[rank + 1..].iter().any(|c| c.is_none());
        tokio::select! {
            r = link.accept(), if accepting => match r {
                Ok(inc) => {
                    accepts.spawn(accept_one::<L>(inc, rank, world, token.to_vec(), deadline, false));
                }
                Err(Failed::Retry(e)) => warn!("rank {rank}: accept failed: {e}"),
                Err(Failed::Final(detail)) => {
                    return Err(TransportError::Handshake { peer: "config".into(), detail })
                }
            },
            Some(r) = accepts.join_next(), if !accepts.is_empty() => match r {
                Ok(Ok((p, mut s, buf))) => {
                    if conns[p].is_some() {
                        warn!("rank {rank}: refused a second connection claiming rank {p}");
                        L::refuse(&s, b"duplicate rank");
                    } else {
                        match write_hello(L::writer(&mut s), rank, world, token).await {
                            Ok(()) => {
                                conns[p] = Some((s, buf));
                                missing -= 1;
                            }
                            Err(e) => warn!("rank {rank}: answering rank {p}'s hello failed: {e}"),
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
                    detail: format!("not connected within {connect_timeout:?}"),
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

/// Dials ranks `to` of `peers` (each by `deadline`) as rank `rank`, each in a task of
/// its own.
fn dial_all<L: Link>(
    link: &Arc<L>,
    rank: usize,
    peers: &[SocketAddr],
    to: impl Iterator<Item = usize>,
    token: &[u8],
    deadline: tokio::time::Instant,
) -> JoinSet<Result<Conn<L>, TransportError>> {
    let mut dials = JoinSet::new();
    for p in to {
        dials.spawn(dial(
            link.clone(),
            rank,
            peers.len(),
            p,
            peers[p],
            token.to_vec(),
            deadline,
        ));
    }
    dials
}

/// A newcomer's connections, taking rank `rank`'s place in a running mesh: it dials every
/// other rank, each within `per_peer` (a lost rank's address refuses, or a frozen one does
/// not answer its hello: such ranks are left out and logged). Returns the connections
/// made, in rank order.
pub(crate) async fn join_mesh<L: Link>(
    link: Arc<L>,
    rank: usize,
    peers: &[SocketAddr],
    token: &[u8],
    per_peer: Duration,
) -> Vec<Conn<L>> {
    let world = peers.len();
    let deadline = tokio::time::Instant::now() + per_peer;
    let mut dials = dial_all(
        &link,
        rank,
        peers,
        (0..world).filter(|&p| p != rank),
        token,
        deadline,
    );
    let mut conns = Vec::new();
    while let Some(r) = dials.join_next().await {
        match r {
            Ok(Ok(c)) => conns.push(c),
            Ok(Err(e)) => debug!("rank {rank} (joining): left out: {e}"),
            Err(e) => warn!("rank {rank} (joining): a dial failed: {e}"),
        }
    }
    conns.sort_by_key(|c| c.0);
    conns
}

/// How long a newcomer's dial of one rank may take, hello and answer included.
pub(crate) const JOIN_HELLO: Duration = Duration::from_secs(5);

/// A newcomer's connection as a driver keeps it: the rank it claims, the stream made ready
/// for the driver's data path, and the bytes read past its hello.
pub(crate) type Newcomer<S> = (usize, S, BytesMut);

/// Accepts newcomers on `link` for the life of the transport (live membership): each one
/// whose hello checks out (the run token, another rank of this world) is answered with
/// this rank's hello, made ready by `ready` and handed over through `tx`; the others are
/// refused and logged. Ends when the link stops listening.
pub(crate) async fn accept_newcomers<L: Link, S: Send + 'static>(
    link: Arc<L>,
    rank: usize,
    world: usize,
    token: Vec<u8>,
    tx: std::sync::mpsc::Sender<Newcomer<S>>,
    ready: fn(L::Stream) -> std::io::Result<S>,
) {
    loop {
        let inc = match link.accept().await {
            Ok(inc) => inc,
            Err(Failed::Retry(e)) => {
                warn!("rank {rank}: accepting a newcomer failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            Err(Failed::Final(e)) => {
                debug!("rank {rank}: no more newcomers: {e}");
                return;
            }
        };
        let (tx, token) = (tx.clone(), token.clone());
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + JOIN_HELLO;
            let (p, mut s, buf) =
                match accept_one::<L>(inc, rank, world, token.clone(), deadline, true).await {
                    Ok(c) => c,
                    Err(e) => return warn!("rank {rank}: refused a newcomer: {e}"),
                };
            if let Err(e) = write_hello(L::writer(&mut s), rank, world, &token).await {
                return warn!("rank {rank}: answering the newcomer for rank {p} failed: {e}");
            }
            match ready(s) {
                Ok(s) => {
                    info!("rank {rank}: a newcomer for rank {p} connected");
                    let _ = tx.send((p, s, buf));
                }
                Err(e) => warn!("rank {rank}: the newcomer for rank {p}: {e}"),
            }
        });
    }
}

/// The newcomers of a driver that accepts them (live membership): those its accept loop
/// ([`accept_newcomers`]) handed over, the latest waiting per rank, and — on a rank that
/// is a newcomer itself — the ranks it dialed. The drivers keep the connections; this is
/// the book-keeping of [`Transport::joiners`] and [`Transport::admit`] they share.
#[derive(Debug)]
pub(crate) struct Newcomers<S> {
    arrived: std::sync::mpsc::Receiver<Newcomer<S>>,
    /// The latest newcomer per rank.
    waiting: std::collections::BTreeMap<usize, (S, BytesMut)>,
    /// Per rank: this rank, itself a newcomer, dialed the connection it has to it, not yet
    /// admitted. One to a rank that is no member is a newcomer this one reached: reported
    /// by [`Newcomers::joiners`] while it is open.
    pub(crate) dialed: Vec<bool>,
}

/// What admitting a rank comes to ([`Newcomers::admission`]).
pub(crate) enum Admission<S> {
    /// The connection this rank has to it stays the link.
    Keep,
    /// Its newcomer's connection (and the bytes read past its hello) replaces it.
    Switch(S, BytesMut),
}

impl<S> Newcomers<S> {
    /// No newcomer yet, in a world of `world` ranks; they arrive on `arrived`.
    pub(crate) fn new(arrived: std::sync::mpsc::Receiver<Newcomer<S>>, world: usize) -> Self {
        Newcomers {
            arrived,
            waiting: std::collections::BTreeMap::new(),
            dialed: vec![false; world],
        }
    }

    /// The ranks a newcomer waits for: those that arrived (one that came again replaces
    /// its earlier connection, handed to `drop`), and those this rank dialed whose
    /// connection `open` says is open.
    pub(crate) fn joiners(&mut self, open: impl Fn(usize) -> bool, drop: impl Fn(S)) -> Vec<usize> {
        while let Ok((p, s, buf)) = self.arrived.try_recv() {
            if let Some((old, _)) = self.waiting.insert(p, (s, buf)) {
                drop(old);
            }
        }
        let mut w: Vec<usize> = self.waiting.keys().copied().collect();
        w.extend((0..self.dialed.len()).filter(|&p| self.dialed[p] && open(p)));
        w.sort_unstable();
        w.dedup();
        w
    }

    /// Admitting `rank` on rank `me`, whose own dial to it is open when `mine`: the
    /// waiting newcomer's connection replaces the link — or, where both exist (the new
    /// listener took the old address), the higher rank's dial is the link, on both sides;
    /// the other connection goes to `drop`. Fails when no newcomer waits for `rank`.
    pub(crate) fn admission(
        &mut self,
        rank: usize,
        me: usize,
        mine: bool,
        drop: impl Fn(S),
    ) -> Result<Admission<S>, TransportError> {
        self.dialed[rank] = false;
        match (self.waiting.remove(&rank), mine) {
            (Some((theirs, _)), true) if me > rank => {
                drop(theirs);
                Ok(Admission::Keep)
            }
            (Some((s, buf)), _) => Ok(Admission::Switch(s, buf)),
            (None, true) => Ok(Admission::Keep),
            (None, false) => Err(TransportError::Handshake {
                peer: format!("rank {rank}"),
                detail: "no newcomer is waiting for this rank".into(),
            }),
        }
    }

    /// The connections of the newcomers waiting.
    pub(crate) fn waiting(&self) -> impl Iterator<Item = &S> {
        self.waiting.values().map(|(s, _)| s)
    }
}

/// [`Transport::link_member`] of a driver that accepts newcomers: the link to each member
/// is the connection this newcomer dialed to it (`linked`), or — to a member that was a
/// newcomer itself and dialed this one, which knew only its predecessor's address — the
/// one it was dialed on, waited for until `deadline` (which wins where both exist, as in
/// [`Newcomers::admission`]).
pub(crate) fn link_member<T: Transport + ?Sized>(
    t: &mut T,
    rank: usize,
    deadline: Instant,
    linked: impl Fn(&T) -> bool,
) -> Result<(), TransportError> {
    check_peer(rank, t.rank(), t.world_size())?;
    loop {
        if t.joiners().contains(&rank) {
            return t.admit(rank);
        }
        if linked(t) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(TransportError::Handshake {
                peer: format!("rank {rank}"),
                detail: "no connection to this member: it did not reach this newcomer".into(),
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A newcomer's dials on `rt` ([`join_mesh`]: each other rank for at most `timeout` or
/// [`JOIN_HELLO`], whichever is shorter); fails when it reaches no rank at all.
pub(crate) fn join_on<L: Link>(
    rt: &Runtime,
    link: &Arc<L>,
    rank: usize,
    peers: &[SocketAddr],
    token: &[u8],
    timeout: Duration,
) -> Result<Vec<Conn<L>>, TransportError> {
    let per_peer = timeout.min(JOIN_HELLO);
    let conns = rt.block_on(join_mesh(link.clone(), rank, peers, token, per_peer));
    if conns.is_empty() && peers.len() > 1 {
        return Err(TransportError::Handshake {
            peer: format!("every rank of {peers:?}"),
            detail: format!("joining as rank {rank}: none answered within {per_peer:?}"),
        });
    }
    Ok(conns)
}

/// Opens an incoming connection and checks its hello; refuses it on any failure. A
/// `joining` dialer (a newcomer taking a lost rank's place) may claim any other rank; at
/// set-up only higher ranks dial.
pub(crate) async fn accept_one<L: Link>(
    inc: L::Incoming,
    rank: usize,
    world: usize,
    token: Vec<u8>,
    deadline: tokio::time::Instant,
    joining: bool,
) -> Result<Conn<L>, String> {
    let (addr, mut s) = L::open_incoming(inc, deadline).await?;
    let mut buf = BytesMut::new();
    let hello = check_hello::<L>(
        &mut s, &mut buf, addr, rank, world, &token, deadline, joining,
    );
    match hello.await {
        Ok(p) => Ok((p, s, buf)),
        Err(why) => {
            L::refuse(&s, b"refused");
            Err(why)
        }
    }
}

/// Reads the dialer's hello from `s` and checks it: the run token, and a higher rank of
/// this world (any other rank of it when `joining`). Returns the dialer's rank.
#[allow(clippy::too_many_arguments)]
async fn check_hello<L: Link>(
    s: &mut L::Stream,
    buf: &mut BytesMut,
    addr: SocketAddr,
    rank: usize,
    world: usize,
    token: &[u8],
    deadline: tokio::time::Instant,
    joining: bool,
) -> Result<usize, String> {
    let f = tokio::time::timeout_at(deadline, read_frame(L::reader(s), buf, MAX_HELLO_FRAME))
        .await
        .map_err(|_| format!("{addr}: no hello before the deadline"))?
        .map_err(|e| format!("{addr}: {e}"))?;
    let Some(Frame::Hello(h)) = f else {
        return Err(format!("{addr}: first frame is not a hello"));
    };
    if !h.token_matches(token) {
        return Err(format!("{addr}: wrong run token"));
    }
    let p = h.rank as usize;
    let lower = if joining { p == rank } else { p <= rank };
    if h.world as usize != world || lower || p >= world {
        return Err(format!(
            "{addr}: unexpected rank {p} / world {} (this is rank {rank} of {world})",
            h.world
        ));
    }
    Ok(p)
}

/// Connects to rank `p` at `addr` (retrying until the deadline) and authenticates both
/// ways; every error names the peer.
async fn dial<L: Link>(
    link: Arc<L>,
    rank: usize,
    world: usize,
    p: usize,
    addr: SocketAddr,
    token: Vec<u8>,
    deadline: tokio::time::Instant,
) -> Result<Conn<L>, TransportError> {
    let fail = |detail: String| TransportError::Handshake {
        peer: format!("rank {p} at {addr}"),
        detail,
    };
    let dialed = loop {
        match tokio::time::timeout_at(deadline, link.dial(addr)).await {
            Ok(Ok(d)) => break d,
            Ok(Err(Failed::Retry(e))) if tokio::time::Instant::now() < deadline => {
                debug!("rank {rank}: dialing rank {p} failed ({e}); retrying");
                tokio::time::sleep(REDIAL).await;
            }
            Ok(Err(Failed::Retry(e) | Failed::Final(e))) => return Err(fail(e)),
            Err(_) => return Err(fail("connect timed out".into())),
        }
    };
    let refused = || fail("connection refused by the peer (wrong run token?)".into());
    let io_error = |e: std::io::Error| {
        if L::IO_FAILURE_IS_REFUSAL {
            refused()
        } else {
            e.into()
        }
    };
    let mut s = L::open_dialed(dialed).await.map_err(io_error)?;
    write_hello(L::writer(&mut s), rank, world, &token)
        .await
        .map_err(io_error)?;
    let mut buf = BytesMut::new();
    let f = tokio::time::timeout_at(
        deadline,
        read_frame(L::reader(&mut s), &mut buf, MAX_HELLO_FRAME),
    )
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
        Ok(_) | Err(_) => Err(refused()),
    }
}

/// The queue feeding one connection's writer (a thread or a task).
pub(crate) trait Queue: Send {
    /// Queues `o`; `false` if the writer is gone.
    fn push(&self, o: Outgoing) -> bool;
}

impl Queue for std::sync::mpsc::Sender<Outgoing> {
    fn push(&self, o: Outgoing) -> bool {
        self.send(o).is_ok()
    }
}

impl Queue for tokio::sync::mpsc::UnboundedSender<Outgoing> {
    fn push(&self, o: Outgoing) -> bool {
        self.send(o).is_ok()
    }
}

/// The [`Transport`] side of a built mesh, shared by the connection-oriented drivers: one
/// writer queue per peer, the frame-size limit, egress shaping, byte counts and the inbox
/// its connections' readers fill. The driver keeps its threads or tasks and their shutdown.
#[derive(Debug)]
pub(crate) struct Peers<Q> {
    rank: usize,
    world: usize,
    max_frame: usize,
    queues: Vec<Option<Q>>,
    inbox: Inbox,
    sent: u64,
    shaper: Option<Shaper>,
}

impl<Q: Queue> Peers<Q> {
    /// No peer connected yet; frames of at most `max_frame` bytes, egress shaped by `link`.
    pub(crate) fn new(
        rank: usize,
        world: usize,
        max_frame: usize,
        link: &LinkSpec,
        inbox: Inbox,
    ) -> Self {
        Peers {
            rank,
            world,
            max_frame,
            queues: (0..world).map(|_| None).collect(),
            inbox,
            sent: 0,
            shaper: Shaper::new(link),
        }
    }

    /// Sends to `peer` through `queue` from now on.
    pub(crate) fn connect(&mut self, peer: usize, queue: Q) {
        self.queues[peer] = Some(queue);
    }

    /// Rank `peer`'s connection is being replaced by a newcomer's (see
    /// [`Transport::admit`]): its old queue is closed, and what its old connection
    /// delivered is dropped ([`Inbox::admit`]). Call it once the old connection's reader
    /// has ended, and before the new one's starts.
    pub(crate) fn replace(&mut self, peer: usize) {
        self.queues[peer] = None;
        self.inbox.admit(peer);
    }

    /// Rank `peer` could not be reached (a newcomer's transport): reported closed.
    pub(crate) fn unreachable(&mut self, peer: usize) {
        self.queues[peer] = None;
        self.inbox.closed(peer);
    }

    /// Closes every queue: each writer sends what is queued and then finishes.
    pub(crate) fn close(&mut self) {
        self.queues.clear();
    }
}

impl<Q: Queue> Transport for Peers<Q> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn send(&mut self, to: usize, msg: Vec<u8>) -> Result<(), TransportError> {
        check_peer(to, self.rank, self.world)?;
        check_frame(msg.len(), self.max_frame)?;
        let len = msg.len() + FRAME_HEADER_LEN;
        let q = self.queues[to]
            .as_ref()
            .ok_or(TransportError::Closed { rank: to })?;
        let release = self.shaper.as_mut().map(|s| s.release(Instant::now(), len));
        if !q.push(Outgoing { release, msg }) {
            return Err(TransportError::Closed { rank: to });
        }
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

/// The [`Transport`] methods of a driver that hand every call to its [`Peers`] field
/// `$field`: written inside the driver's `impl Transport` block, beside its own
/// newcomer methods.
macro_rules! via_peers {
    ($field:ident) => {
        fn rank(&self) -> usize {
            self.$field.rank()
        }
        fn world_size(&self) -> usize {
            self.$field.world_size()
        }
        fn send(&mut self, to: usize, msg: Vec<u8>) -> Result<(), TransportError> {
            self.$field.send(to, msg)
        }
        fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
            self.$field.recv(deadline)
        }
        fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError> {
            self.$field.recv_from(from, deadline)
        }
        fn bytes(&self) -> ByteCount {
            self.$field.bytes()
        }
    };
}
pub(crate) use via_peers;
