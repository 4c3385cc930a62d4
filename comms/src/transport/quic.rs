//! QUIC driver (quinn + rustls with the ring provider, TLS 1.3): one connection per rank
//! pair, one bidirectional stream per connection carrying the same length-prefixed frames
//! as TCP ([`crate::frame`]).
//!
//! # Authentication
//! Every run has its own self-signed certificate ([`RunIdentity::generate`], created by the
//! rendezvous host and handed to every rank, see [`crate::rendezvous`]). Every rank
//! presents it on both sides of mutual TLS, and accepts a peer — server or client — only if
//! the peer's certificate is byte-for-byte that certificate (a custom rustls verifier
//! comparing the DER; the TLS 1.3 handshake signature is still verified, so presenting the
//! certificate without its key fails). On
//! top of TLS, the dialer opens the stream with a [`crate::frame::Hello`] carrying the run
//! token, rank and world size; the acceptor checks it and answers with its own, as over
//! TCP (the mesh set-up is the one TCP uses, `mesh.rs`). A connection with a different
//! certificate, a wrong token, an unexpected rank or no hello before the deadline is
//! refused (closed) and logged. Once the mesh is complete the endpoint stops accepting
//! connections, unless it accepts newcomers (below).
//!
//! # Newcomers
//! With [`QuicConfig::accept_joiners`] (live membership) the endpoint keeps accepting after
//! set-up, as TCP's listener does (`tcp.rs`; the accept loop and the book-keeping are
//! shared, `mesh.rs`): a newcomer taking a lost rank's place ([`QuicTransport::join`])
//! presents the run's certificate like any rank, dials every rank, says hello claiming the
//! lost rank, and waits to be admitted ([`Transport::admit`]: the predecessor's connection
//! is closed, its reader task ended, and the newcomer's reader and writer take over). A
//! killed predecessor sends no close over UDP: the group drops it at the step deadline.
//!
//! # Tuning
//! * UDP socket buffers are raised to [`QuicConfig::socket_buffer`] (16 MiB; the kernel
//!   caps the value at `net.core.{r,w}mem_max` unless running privileged).
//! * MTU: quinn's default initial MTU is 1200 bytes with discovery up to 1452. On a mesh
//!   whose peers are all loopback addresses the driver uses [`LOOPBACK_MTU`] (60 000 bytes)
//!   instead: per-packet work (packet building, header protection, acknowledgements, one
//!   system call per batch) is most of quinn's cost besides AES-GCM and copies.
//!   `EndpointConfig::max_udp_payload_size` is raised on every endpoint before the larger
//!   `initial_mtu` is used (a peer whose limit is lower would drop the packets). Two quinn
//!   limits otherwise stall MTUs above ~6.5 kB, and both are lifted for a raised MTU:
//!   - quinn puts up to 10 segments in one GSO send whatever their size, and a send over
//!     64 KiB is refused, so every full batch is lost: a wrapper around quinn's socket caps
//!     the segments per send at 65 000 bytes;
//!   - Cubic's fixed 14 720-byte initial window: quinn sends only if the window has room
//!     for the packet being built and one more full packet, so above ~7 kB sending waits
//!     for loss timers, and from ~12 kB the handshake never completes. The initial window
//!     is 10 packets instead.
//! * Default flow-control windows.
//!
//! # Liveness
//! QUIC's own keep-alives are the heartbeats: an idle connection sends one every
//! [`QuicConfig::heartbeat_interval`] (1 s), and a connection that hears nothing for
//! [`QuicConfig::peer_timeout`] (10 s; QUIC's idle timeout, negotiated down to the lower
//! of the two ends' values) is closed and its peer reported as
//! [`TransportError::PeerSilent`]. This is how a killed peer (which sends no close over
//! UDP), a frozen one or an unreachable one is noticed, also between collectives.
//! Keep-alives are QUIC packets, not frames: they never reach the inbox and are not
//! counted in [`ByteCount`].
//!
//! # Data path
//! As for TCP ([`super::tcp`]): a reader task per connection into the rank's inbox, a
//! writer task per connection fed by an unbounded queue, optional egress shaping
//! ([`QuicConfig::link`]). Dropping the transport finishes every stream, waits (up to
//! [`QuicConfig::linger`]) until the peers acknowledged all data, then closes.
//!
//! The runtime lives inside the transport: create and drop it outside any async context.
//!
//! [`ByteCount`]: super::ByteCount

use std::net::{SocketAddr, UdpSocket};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use bytes::BytesMut;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, RecvStream, SendStream};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use tokio::runtime::Runtime;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::mesh::{
    accept_newcomers, check_setup, join_on, link_member, mesh, runtime, via_peers, Admission, Conn,
    Failed, Link, Newcomer, Newcomers, Peers,
};
use super::quic_stream::{reader, writer};
use super::stream::Outgoing;
use super::{check_peer, ByteCount, Event, Inbox, Transport, TransportError};
use crate::frame::FRAME_HEADER_LEN;
use crate::rendezvous::RunIdentity;
use crate::shaping::LinkSpec;

/// Server name in the run certificate (not used for verification: the certificate is pinned).
const SERVER_NAME: &str = "dtrain";
/// ALPN protocol of the dtrain mesh.
const ALPN: &[u8] = b"dtrain/1";
/// MTU used when every peer is a loopback address.
pub const LOOPBACK_MTU: u16 = 60_000;
/// Application error code of a refused connection.
const REFUSED: u32 = 1;
/// Application error code of a normal close.
const DONE: u32 = 0;

impl RunIdentity {
    /// A fresh self-signed certificate (ECDSA P-256, subject alternative name `dtrain`) and
    /// its key, for one run.
    pub fn generate() -> Result<RunIdentity, TransportError> {
        let ck =
            rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()]).map_err(|e| {
                TransportError::Handshake {
                    peer: "config".into(),
                    detail: format!("creating the run certificate failed: {e}"),
                }
            })?;
        Ok(RunIdentity {
            cert_der: ck.cert.der().to_vec(),
            key_der: ck.key_pair.serialize_der(),
        })
    }
}

/// Configuration of a [`QuicTransport`].
#[derive(Clone, PartialEq)]
pub struct QuicConfig {
    /// The run token every connection must present (at most
    /// [`MAX_TOKEN_LEN`](crate::frame::MAX_TOKEN_LEN) bytes).
    pub token: Vec<u8>,
    /// The run's certificate and key: served by this rank, pinned for every peer.
    pub identity: RunIdentity,
    /// Largest frame accepted or sent, in bytes after the length prefix. Default 64 MiB.
    pub max_frame: usize,
    /// How long set-up may take. Default 30 s.
    pub connect_timeout: Duration,
    /// Runtime worker threads. Default 1.
    pub io_threads: usize,
    /// How long dropping the transport waits for queued data to be acknowledged. Default 10 s.
    pub linger: Duration,
    /// Egress link emulation of this rank (see [`crate::shaping`]). Default unshaped.
    pub link: LinkSpec,
    /// Initial MTU (UDP payload bytes). `None`: [`LOOPBACK_MTU`] if every peer is a loopback
    /// address, else quinn's default (1200, discovered up to 1452).
    pub mtu: Option<u16>,
    /// An idle connection sends a QUIC keep-alive this often. `None`: never. Default 1 s.
    /// Must be well below every peer's [`QuicConfig::peer_timeout`].
    pub heartbeat_interval: Option<Duration>,
    /// A connection that hears nothing (not even keep-alives) for this long is closed and
    /// its peer reported as [`TransportError::PeerSilent`] (QUIC's idle timeout; the lower
    /// of the two ends' values applies). `None`: never (then a killed peer is only noticed
    /// by the collectives' timeout). Default 10 s; at least twice
    /// [`QuicConfig::heartbeat_interval`].
    pub peer_timeout: Option<Duration>,
    /// UDP send and receive buffer size requested from the kernel. Default 16 MiB.
    pub socket_buffer: usize,
    /// Keep accepting newcomers that take a lost peer's place after set-up (live
    /// membership; see [`QuicTransport::join`]). Default false: the endpoint stops
    /// accepting once the mesh is complete.
    pub accept_joiners: bool,
}

impl std::fmt::Debug for QuicConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicConfig")
            .field("token", &"<redacted>")
            .field("identity", &self.identity)
            .field("max_frame", &self.max_frame)
            .field("connect_timeout", &self.connect_timeout)
            .field("io_threads", &self.io_threads)
            .field("linger", &self.linger)
            .field("link", &self.link)
            .field("mtu", &self.mtu)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("peer_timeout", &self.peer_timeout)
            .field("socket_buffer", &self.socket_buffer)
            .field("accept_joiners", &self.accept_joiners)
            .finish()
    }
}

impl QuicConfig {
    /// Defaults with the given run token and identity.
    pub fn new(token: impl Into<Vec<u8>>, identity: RunIdentity) -> Self {
        QuicConfig {
            token: token.into(),
            identity,
            max_frame: 64 << 20,
            connect_timeout: Duration::from_secs(30),
            io_threads: 1,
            linger: Duration::from_secs(10),
            link: LinkSpec::default(),
            mtu: None,
            heartbeat_interval: Some(Duration::from_secs(1)),
            peer_timeout: Some(Duration::from_secs(10)),
            socket_buffer: 16 << 20,
            accept_joiners: false,
        }
    }
}

/// One rank of a QUIC mesh (see the [module docs](self)).
#[derive(Debug)]
pub struct QuicTransport {
    peers: Peers<UnboundedSender<Outgoing>>,
    linger: Duration,
    writer_tasks: Vec<JoinHandle<()>>,
    /// Per rank: its connection, and the task reading it.
    conns: Vec<Option<Connection>>,
    readers: Vec<Option<JoinHandle<()>>>,
    /// The readers' way into the inbox.
    events: mpsc::Sender<Event>,
    max_frame: usize,
    peer_timeout: Option<Duration>,
    /// Newcomers (live membership): `None` when the transport accepts none.
    joining: Option<Newcomers<QuicStream>>,
    endpoint: Option<Endpoint>,
    rt: Option<Runtime>,
}

fn config_error(detail: impl std::fmt::Display) -> TransportError {
    TransportError::Handshake {
        peer: "config".into(),
        detail: detail.to_string(),
    }
}

/// ring's provider restricted to TLS 1.3 with AES-128-GCM: every run is between our own
/// peers, so there is nothing to negotiate, and AES-128 (10 rounds) costs less CPU per packet
/// than the AES-256 suite rustls would otherwise pick first (14 rounds). QUIC's Initial
/// packets use AES-128-GCM in any case.
fn provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = vec![rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256];
    Arc::new(p)
}

/// Accepts exactly the pinned certificate (as a client verifying the server, and as a
/// server verifying the client), and checks the handshake signature with it.
#[derive(Debug)]
struct Pinned {
    cert: Vec<u8>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if intermediates.is_empty() && end_entity.as_ref() == self.cert.as_slice() {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "peer presented a certificate other than this run's".into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2 is not allowed".into()))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

impl ClientCertVerifier for Pinned {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        if intermediates.is_empty() && end_entity.as_ref() == self.cert.as_slice() {
            Ok(ClientCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "peer presented a certificate other than this run's".into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2 is not allowed".into()))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

fn transport_config(
    cfg: &QuicConfig,
    mtu: Option<u16>,
) -> Result<quinn::TransportConfig, TransportError> {
    let mut t = quinn::TransportConfig::default();
    let idle = cfg
        .peer_timeout
        .map(quinn::IdleTimeout::try_from)
        .transpose()
        .map_err(config_error)?;
    t.max_idle_timeout(idle)
        .keep_alive_interval(cfg.heartbeat_interval);
    if let Some(m) = mtu {
        t.initial_mtu(m);
        let mut d = quinn::MtuDiscoveryConfig::default();
        d.upper_bound(m);
        t.mtu_discovery_config(Some(d));
        let mut cc = quinn::congestion::CubicConfig::default();
        cc.initial_window(10 * u64::from(m));
        t.congestion_controller_factory(Arc::new(cc));
    }
    Ok(t)
}

/// The rustls server side: serves `identity`, and requires the client to present the
/// certificate `pin` (mutual TLS).
fn server_crypto(identity: &RunIdentity, pin: &[u8]) -> Result<QuicServerConfig, TransportError> {
    let provider = provider();
    let cert = CertificateDer::from(identity.cert_der.clone());
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(identity.key_der.clone()));
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(config_error)?
        .with_client_cert_verifier(Arc::new(Pinned {
            cert: pin.to_vec(),
            provider,
        }))
        .with_single_cert(vec![cert], key)
        .map_err(|e| config_error(format!("run certificate: {e}")))?;
    server.alpn_protocols = vec![ALPN.to_vec()];
    server.max_early_data_size = 0;
    QuicServerConfig::try_from(server).map_err(config_error)
}

/// The rustls client side: accepts only a server presenting `pin`, and presents `identity`.
fn client_crypto(identity: &RunIdentity, pin: &[u8]) -> Result<QuicClientConfig, TransportError> {
    let provider = provider();
    let cert = CertificateDer::from(identity.cert_der.clone());
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(identity.key_der.clone()));
    let mut client = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(config_error)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Pinned {
            cert: pin.to_vec(),
            provider,
        }))
        .with_client_auth_cert(vec![cert], key)
        .map_err(|e| config_error(format!("run certificate: {e}")))?;
    client.alpn_protocols = vec![ALPN.to_vec()];
    QuicClientConfig::try_from(client).map_err(config_error)
}

/// Largest number of bytes one GSO send may carry: the segments of a batch travel as one
/// UDP datagram until the kernel splits them, so their total must fit a datagram (64 KiB
/// minus headers). quinn batches up to 10 segments whatever their size, which stops working
/// above ~6.5 kB segments (every full batch is refused: the transfer stalls).
const MAX_GSO_BATCH: usize = 65_000;

/// quinn's UDP socket with the number of segments per send capped so that a batch stays
/// within [`MAX_GSO_BATCH`] bytes, which lets the MTU go beyond ~6.5 kB.
#[derive(Debug)]
struct SegmentCap {
    inner: Arc<dyn quinn::AsyncUdpSocket>,
    max: usize,
}

impl quinn::AsyncUdpSocket for SegmentCap {
    fn create_io_poller(self: Arc<Self>) -> std::pin::Pin<Box<dyn quinn::UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &quinn::udp::Transmit) -> std::io::Result<()> {
        self.inner.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut std::task::Context,
        bufs: &mut [std::io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments().min(self.max).max(1)
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

/// Builds this rank's endpoint around `socket` (server side `server`) and the client
/// config for dialing (client side `client`), with the socket and MTU tuning.
fn endpoint(
    socket: UdpSocket,
    cfg: &QuicConfig,
    mtu: Option<u16>,
    server: QuicServerConfig,
    client: QuicClientConfig,
) -> Result<(Endpoint, quinn::ClientConfig), TransportError> {
    let sock = socket2::SockRef::from(&socket);
    let _ = sock.set_send_buffer_size(cfg.socket_buffer);
    let _ = sock.set_recv_buffer_size(cfg.socket_buffer);
    debug!(
        "QUIC socket buffers: send {:?}, recv {:?}",
        sock.send_buffer_size(),
        sock.recv_buffer_size()
    );
    let transport = Arc::new(transport_config(cfg, mtu)?);
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server));
    server.transport_config(transport.clone());
    server.migration(false);
    let mut client = quinn::ClientConfig::new(Arc::new(client));
    client.transport_config(transport);
    let mut ecfg = quinn::EndpointConfig::default();
    if let Some(m) = mtu {
        ecfg.max_udp_payload_size(m.max(1200))
            .map_err(config_error)?;
    }
    let runtime = Arc::new(quinn::TokioRuntime);
    // No datagram is larger than the endpoint's payload limit, so no batch of this many
    // exceeds MAX_GSO_BATCH.
    let socket = Arc::new(SegmentCap {
        max: (MAX_GSO_BATCH as u64 / ecfg.get_max_udp_payload_size()) as usize,
        inner: quinn::Runtime::wrap_udp_socket(&*runtime, socket)?,
    });
    let ep = Endpoint::new_with_abstract_socket(ecfg, Some(server), socket, runtime)?;
    Ok((ep, client))
}

impl QuicTransport {
    /// Connects rank `rank` to every other rank: `peers[i]` is rank `i`'s UDP address
    /// (`peers[rank]` is not used), `socket` is this rank's bound UDP socket. Blocks until
    /// every peer is connected and authenticated, or fails after `cfg.connect_timeout`
    /// naming the missing ranks.
    pub fn connect(
        rank: usize,
        peers: &[SocketAddr],
        socket: UdpSocket,
        cfg: QuicConfig,
    ) -> Result<Self, TransportError> {
        let (rt, link) = Self::set_up(rank, peers, socket, &cfg)?;
        let conns = rt.block_on(mesh(
            link.clone(),
            rank,
            peers,
            &cfg.token,
            cfg.connect_timeout,
        ));
        let conns = match conns {
            Ok(c) => c,
            Err(e) => {
                link.ep.close(REFUSED.into(), b"set-up failed");
                rt.shutdown_timeout(Duration::from_millis(100));
                return Err(e);
            }
        };
        Self::build(rank, peers.len(), rt, link, conns, cfg, None)
    }

    /// A newcomer taking rank `rank`'s place in a running mesh (its predecessor lost):
    /// dials every other rank at `peers` (each within a few seconds; the ranks that do not
    /// answer are reported closed), and waits to be admitted by the ranks it reached,
    /// which must run with [`QuicConfig::accept_joiners`] (see
    /// [`crate::Communicator::join`]). Fails when it reaches no rank at all.
    pub fn join(
        rank: usize,
        peers: &[SocketAddr],
        socket: UdpSocket,
        cfg: QuicConfig,
    ) -> Result<Self, TransportError> {
        let world = peers.len();
        let (rt, link) = Self::set_up(rank, peers, socket, &cfg)?;
        // Another newcomer may dial this one while it still dials the others: answered
        // from the start, and kept waiting.
        let arrived = cfg
            .accept_joiners
            .then(|| Self::accept_on(&rt, &link, rank, world, &cfg.token));
        let conns = match join_on(&rt, &link, rank, peers, &cfg.token, cfg.connect_timeout) {
            Ok(c) => c,
            Err(e) => {
                link.ep.close(REFUSED.into(), b"set-up failed");
                rt.shutdown_timeout(Duration::from_millis(100));
                return Err(e);
            }
        };
        let mut t = Self::build(rank, world, rt, link, conns, cfg, arrived)?;
        if let Some(j) = &mut t.joining {
            for (p, d) in j.dialed.iter_mut().enumerate() {
                *d = t.conns[p].is_some();
            }
        }
        Ok(t)
    }

    /// The checks before set-up, the runtime, and the endpoint over `socket`.
    fn set_up(
        rank: usize,
        peers: &[SocketAddr],
        socket: UdpSocket,
        cfg: &QuicConfig,
    ) -> Result<(Runtime, Arc<QuicLink>), TransportError> {
        check_setup(
            rank,
            peers.len(),
            &cfg.token,
            cfg.heartbeat_interval,
            cfg.peer_timeout,
        )?;
        let mtu = cfg.mtu.or_else(|| {
            peers
                .iter()
                .all(|a| a.ip().is_loopback())
                .then_some(LOOPBACK_MTU)
        });
        let rt = runtime(cfg.io_threads, "dtrain-comms-quic")?;
        socket.set_nonblocking(true)?;
        let pin = &cfg.identity.cert_der;
        let server = server_crypto(&cfg.identity, pin)?;
        let client = client_crypto(&cfg.identity, pin)?;
        let (ep, client) = {
            let _guard = rt.enter();
            endpoint(socket, cfg, mtu, server, client)?
        };
        Ok((rt, Arc::new(QuicLink { ep, client })))
    }

    /// Starts accepting newcomers on `link` ([`accept_newcomers`]); they arrive on the
    /// receiver returned.
    fn accept_on(
        rt: &Runtime,
        link: &Arc<QuicLink>,
        rank: usize,
        world: usize,
        token: &[u8],
    ) -> mpsc::Receiver<Newcomer<QuicStream>> {
        let (tx, arrived) = mpsc::channel();
        rt.spawn(accept_newcomers::<QuicLink, QuicStream>(
            link.clone(),
            rank,
            world,
            token.to_vec(),
            tx,
            Ok,
        ));
        arrived
    }

    /// The transport over the connections `conns` made on `rt`. The endpoint keeps
    /// accepting newcomers when the transport accepts them (`arrived`: the newcomers of
    /// an accept loop started already) and stops accepting otherwise. Ranks without a
    /// connection are reported closed.
    fn build(
        rank: usize,
        world: usize,
        rt: Runtime,
        link: Arc<QuicLink>,
        conns: Vec<Conn<QuicLink>>,
        cfg: QuicConfig,
        arrived: Option<mpsc::Receiver<Newcomer<QuicStream>>>,
    ) -> Result<Self, TransportError> {
        let joining = if cfg.accept_joiners {
            let arrived =
                arrived.unwrap_or_else(|| Self::accept_on(&rt, &link, rank, world, &cfg.token));
            Some(Newcomers::new(arrived, world))
        } else {
            // The mesh is complete: no further connections are accepted.
            link.ep.set_server_config(None);
            None
        };
        let (tx, rx) = mpsc::channel();
        let inbox = Inbox::new(rx, tx.clone(), world, FRAME_HEADER_LEN as u64);
        let mut t = QuicTransport {
            peers: Peers::new(rank, world, cfg.max_frame, &cfg.link, inbox),
            linger: cfg.linger,
            writer_tasks: Vec::new(),
            conns: (0..world).map(|_| None).collect(),
            readers: (0..world).map(|_| None).collect(),
            events: tx,
            max_frame: cfg.max_frame,
            peer_timeout: cfg.peer_timeout,
            joining,
            endpoint: Some(link.ep.clone()),
            rt: Some(rt),
        };
        let mut connected = vec![false; world];
        for (peer, stream, buf) in conns {
            connected[peer] = true;
            t.start(peer, stream, buf);
        }
        for p in (0..world).filter(|&p| p != rank && !connected[p]) {
            t.peers.unreachable(p);
        }
        Ok(t)
    }

    /// Starts the reader and writer tasks of `peer`'s connection `s` (`buf`: bytes read
    /// past its hello) and sends to `peer` through it from now on.
    fn start(&mut self, peer: usize, s: QuicStream, buf: BytesMut) {
        let QuicStream { conn, send, recv } = s;
        let rt = self
            .rt
            .as_ref()
            .expect("the runtime lives as long as the transport");
        let quiet = self.peer_timeout;
        let c = conn.clone();
        let end = move || match (c.close_reason(), quiet) {
            (Some(quinn::ConnectionError::TimedOut), Some(t)) => {
                warn!("rank {peer} sent nothing, not even a keep-alive, for {t:?}");
                Event::Silent(peer, t)
            }
            _ => Event::Closed(peer),
        };
        self.readers[peer] = Some(rt.spawn(reader(
            peer,
            recv,
            buf,
            self.events.clone(),
            self.max_frame,
            end,
        )));
        let (wtx, wrx) = unbounded_channel();
        let linger = self.linger;
        self.writer_tasks.push(rt.spawn(async move {
            if let Some(send) = writer(peer, send, wrx).await {
                // Finished: wait until the peer has acknowledged everything, so that
                // closing the connection loses nothing.
                let _ = tokio::time::timeout(linger, send.stopped()).await;
            }
        }));
        self.peers.connect(peer, wtx);
        self.conns[peer] = Some(conn);
    }

    /// Whether this rank, as a newcomer, dialed its connection to `rank` and it is open
    /// (its reader runs), not yet admitted.
    fn dialed_open(&self, rank: usize) -> bool {
        self.joining.as_ref().is_some_and(|j| j.dialed[rank])
            && self.readers[rank]
                .as_ref()
                .is_some_and(|r| !r.is_finished())
    }
}

impl Transport for QuicTransport {
    via_peers!(peers);

    fn joiners(&mut self) -> Vec<usize> {
        let readers = &self.readers;
        let Some(j) = &mut self.joining else {
            return Vec::new();
        };
        j.joiners(
            |p| readers[p].as_ref().is_some_and(|r| !r.is_finished()),
            |old| old.conn.close(REFUSED.into(), b"replaced"),
        )
    }

    /// Switches to the newcomer's connection for `rank` — or, on a rank that joined
    /// itself, keeps the one it dialed to that rank. Where both exist, the higher rank's
    /// dial is the link, on both sides (as over TCP).
    fn admit(&mut self, rank: usize) -> Result<(), TransportError> {
        check_peer(rank, self.rank(), self.peers.world_size())?;
        self.joiners();
        let (me, mine) = (self.rank(), self.dialed_open(rank));
        let Some(j) = &mut self.joining else {
            return Err(TransportError::Handshake {
                peer: format!("rank {rank}"),
                detail: "no newcomer is waiting for this rank".into(),
            });
        };
        let refuse = |s: QuicStream| s.conn.close(REFUSED.into(), b"duplicate");
        let Admission::Switch(stream, buf) = j.admission(rank, me, mine, refuse)? else {
            return Ok(());
        };
        // The predecessor's connection ends (if it had not), and its reader with it: all
        // it delivered is queued before the marker, and the newcomer's reader starts after.
        if let Some(old) = self.conns[rank].take() {
            old.close(DONE.into(), b"replaced");
        }
        if let Some(r) = self.readers[rank].take() {
            r.abort();
            let rt = self
                .rt
                .as_ref()
                .expect("the runtime lives as long as the transport");
            let _ = rt.block_on(r);
        }
        self.peers.replace(rank);
        self.start(rank, stream, buf);
        Ok(())
    }

    /// As over TCP (`mesh::link_member`): the link to each member is the connection this
    /// newcomer dialed to it, or the one a member that was a newcomer itself dialed to this one.
    fn link_member(&mut self, rank: usize, deadline: Instant) -> Result<(), TransportError> {
        link_member(self, rank, deadline, |t| {
            t.conns[rank].is_some() || t.joining.is_none()
        })
    }
}

impl Drop for QuicTransport {
    fn drop(&mut self) {
        self.peers.close();
        let tasks = std::mem::take(&mut self.writer_tasks);
        let conns: Vec<Connection> = std::mem::take(&mut self.conns)
            .into_iter()
            .flatten()
            .collect();
        let ep = self.endpoint.take();
        if let Some(rt) = self.rt.take() {
            let deadline = tokio::time::Instant::now() + self.linger;
            rt.block_on(async move {
                for t in tasks {
                    let _ = tokio::time::timeout_at(deadline, t).await;
                }
                for c in &conns {
                    c.close(DONE.into(), b"done");
                }
                // Give the endpoint a moment to send the CONNECTION_CLOSE frames; the full
                // draining period is not needed: every stream was finished and acknowledged,
                // so the peers already read the end of our data.
                if let Some(ep) = ep {
                    let _ = tokio::time::timeout(Duration::from_millis(25), ep.wait_idle()).await;
                }
            });
            rt.shutdown_timeout(Duration::from_millis(100));
        }
    }
}

/// An open QUIC connection for [`mesh`]: the connection and its one bidirectional stream.
#[derive(Debug)]
struct QuicStream {
    conn: Connection,
    send: SendStream,
    recv: RecvStream,
}

/// QUIC connections for [`mesh`]: this rank's endpoint and the client side of its mutual
/// TLS with the pinned run certificate.
struct QuicLink {
    ep: Endpoint,
    client: quinn::ClientConfig,
}

impl Link for QuicLink {
    type Incoming = quinn::Incoming;
    type Dialed = Connection;
    type Stream = QuicStream;
    type Rd = RecvStream;
    type Wr = SendStream;
    const IO_FAILURE_IS_REFUSAL: bool = true;

    async fn accept(&self) -> Result<quinn::Incoming, Failed> {
        self.ep
            .accept()
            .await
            .ok_or_else(|| Failed::Final("endpoint closed during set-up".into()))
    }

    /// Completes the TLS handshake and accepts the dialer's stream.
    async fn open_incoming(
        inc: quinn::Incoming,
        deadline: tokio::time::Instant,
    ) -> Result<(SocketAddr, QuicStream), String> {
        let addr = inc.remote_address();
        let conn = tokio::time::timeout_at(deadline, inc)
            .await
            .map_err(|_| format!("{addr}: TLS handshake not done before the deadline"))?
            .map_err(|e| format!("{addr}: TLS handshake failed: {e}"))?;
        let refuse = |why: String| {
            conn.close(REFUSED.into(), b"refused");
            why
        };
        let (send, recv) = match tokio::time::timeout_at(deadline, conn.accept_bi()).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(refuse(format!("{addr}: no stream: {e}"))),
            Err(_) => return Err(refuse(format!("{addr}: no stream before the deadline"))),
        };
        Ok((addr, QuicStream { conn, send, recv }))
    }

    /// A TLS failure (wrong certificate) is final; anything else is retried.
    async fn dial(&self, addr: SocketAddr) -> Result<Connection, Failed> {
        let connecting = self
            .ep
            .connect_with(self.client.clone(), addr, SERVER_NAME)
            .map_err(|e| Failed::Final(e.to_string()))?;
        match connecting.await {
            Ok(c) => Ok(c),
            Err(quinn::ConnectionError::TransportError(e)) => {
                Err(Failed::Final(format!("TLS handshake failed: {e}")))
            }
            Err(e) => Err(Failed::Retry(e.to_string())),
        }
    }

    async fn open_dialed(conn: Connection) -> std::io::Result<QuicStream> {
        let (send, recv) = conn.open_bi().await?;
        Ok(QuicStream { conn, send, recv })
    }

    fn reader(s: &mut QuicStream) -> &mut RecvStream {
        &mut s.recv
    }

    fn writer(s: &mut QuicStream) -> &mut SendStream {
        &mut s.send
    }

    fn refuse(s: &QuicStream, why: &'static [u8]) {
        s.conn.close(REFUSED.into(), why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Server side of mutual TLS: a client that pins the right server certificate but
    /// presents another one of its own is refused by the server.
    #[test]
    fn server_refuses_a_client_with_another_certificate() {
        let run = RunIdentity::generate().unwrap();
        let other = RunIdentity::generate().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let cfg = QuicConfig::new(b"t".to_vec(), run.clone());
        let (server_ep, client_ep, client, addr) = {
            let _g = rt.enter();
            let ss = UdpSocket::bind("127.0.0.1:0").unwrap();
            let addr = ss.local_addr().unwrap();
            let pin = &run.cert_der;
            let (server_ep, _) = endpoint(
                ss,
                &cfg,
                None,
                server_crypto(&run, pin).unwrap(),
                client_crypto(&run, pin).unwrap(),
            )
            .unwrap();
            let (client_ep, client) = endpoint(
                UdpSocket::bind("127.0.0.1:0").unwrap(),
                &cfg,
                None,
                server_crypto(&other, &other.cert_der).unwrap(),
                client_crypto(&other, pin).unwrap(),
            )
            .unwrap();
            (server_ep, client_ep, client, addr)
        };
        rt.block_on(async move {
            let acc = tokio::spawn(async move {
                let inc = server_ep.accept().await.expect("an incoming connection");
                inc.await.map(|_| ())
            });
            let dial = client_ep
                .connect_with(client, addr, SERVER_NAME)
                .unwrap()
                .await;
            let server = tokio::time::timeout(Duration::from_secs(5), acc)
                .await
                .expect("server decided in time")
                .unwrap();
            let e = server.expect_err("server accepted a client with another certificate");
            assert!(e.to_string().contains("certificate"), "{e}");
            // The client learns it was refused: its connection (if the handshake got that
            // far on its side) is closed.
            if let Ok(conn) = dial {
                let closed = tokio::time::timeout(Duration::from_secs(5), conn.closed()).await;
                assert!(closed.is_ok(), "client connection not closed");
            }
        });
    }
}
