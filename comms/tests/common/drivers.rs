//! The drivers under the conformance suite (`tests/conformance.rs`) as [`Driver`]s, and the
//! scenarios that need more of a driver than a ready mesh: its configuration (frame limit,
//! run token, set-up deadline, link emulation, heartbeats) or a peer in another process.

use std::thread;
use std::time::{Duration, Instant};

use dtrain_comms::shaping::LinkSpec;
use dtrain_comms::{CommConfig, CommError, Communicator, Transport, TransportError};

use super::Mesh;

/// A driver whose ranks are each set up from a config (every driver but the in-process
/// channels).
pub trait Driver: Mesh<T: std::fmt::Debug> {
    type Config: Clone + Send + 'static;
    /// A fresh config for one mesh: the test token, its own run identity or run id, 10 s
    /// set-up.
    fn config(&self) -> Self::Config;
    /// Sets up one rank per config, concurrently; each rank's result in rank order.
    fn try_mesh(&self, cfgs: Vec<Self::Config>) -> Vec<Result<Self::T, TransportError>>;
    /// A working mesh of `world` ranks, all with `cfg`.
    fn mesh_with(&self, world: usize, cfg: Self::Config) -> Vec<Self::T> {
        self.try_mesh(vec![cfg; world])
            .into_iter()
            .map(|t| t.expect("mesh set-up"))
            .collect()
    }
    fn set_token(cfg: &mut Self::Config, token: &[u8]);
    fn set_connect_timeout(cfg: &mut Self::Config, t: Duration);
    fn set_max_frame(cfg: &mut Self::Config, max: usize);
    fn set_link(cfg: &mut Self::Config, link: LinkSpec);
}

/// A driver with heartbeats and a peer timeout (TCP, QUIC).
pub trait Heartbeats: Driver {
    fn set_liveness(cfg: &mut Self::Config, beat: Option<Duration>, quiet: Option<Duration>);
}

/// A driver whose last rank can be another process (this test binary re-run for one test).
pub trait Spawned: Driver {
    /// Parent side of a 3-rank mesh whose rank 2 is a child process: what the child needs
    /// to know (handed over in [`CHILD_ENV`]), and the set-up of ranks 0 and 1.
    #[allow(clippy::type_complexity)]
    fn survivors(&self, cfg: Self::Config) -> (String, Vec<Box<dyn FnOnce() -> Self::T + Send>>);
    /// Child side: rank 2, from the parent's `spec`, with `tune` applied to its config.
    fn child(&self, spec: &str, tune: &dyn Fn(&mut Self::Config)) -> Self::T;
}

/// The environment variable that makes a test its own child process.
pub const CHILD_ENV: &str = "DTRAIN_COMMS_CHILD";

/// A message one byte over the frame limit is refused at `send`; one at the limit goes
/// through and is counted with its 5-byte frame prefix on both sides.
pub fn check_oversized_message<D: Driver>(d: &D) {
    let mut cfg = d.config();
    D::set_max_frame(&mut cfg, 1024);
    let mut ts = d.mesh_with(2, cfg);
    assert!(matches!(
        ts[0].send(1, vec![0; 1024]),
        Err(TransportError::TooLarge {
            len: 1025,
            max: 1024
        })
    ));
    ts[0].send(1, vec![7; 1023]).unwrap();
    let got = ts[1]
        .recv_from(0, Instant::now() + Duration::from_secs(5))
        .unwrap();
    assert_eq!(got, vec![7; 1023]);
    assert_eq!(ts[0].bytes().sent, 1023 + 5);
    assert_eq!(ts[1].bytes().received, 1023 + 5);
}

/// Rank 1 dials rank 0 with the wrong run token: rank 0 closes the connection, so rank 1's
/// set-up fails as refused, and rank 0 gives up after `setup` naming rank 1.
pub fn check_wrong_token_is_refused<D: Driver>(d: &D, setup: Duration) {
    let mut good = d.config();
    D::set_connect_timeout(&mut good, setup);
    let mut bad = good.clone();
    D::set_token(&mut bad, b"not-the-token");
    let r = d.try_mesh(vec![good, bad]);
    match &r[1] {
        Err(TransportError::Handshake { detail, .. }) => {
            assert!(detail.contains("refused"), "{detail}")
        }
        other => panic!("rank 1: expected a refused handshake, got {other:?}"),
    }
    // Rank 0 never gets an authenticated rank 1 and gives up naming it.
    match &r[0] {
        Err(TransportError::Handshake { peer, .. }) => assert!(peer.contains("[1]"), "{peer}"),
        other => panic!("rank 0: expected a handshake timeout, got {other:?}"),
    }
}

/// A peer timeout must leave room for two heartbeats, and needs heartbeats; zero is no
/// interval: such configs fail before set-up, blaming the config. Heartbeats without a
/// peer timeout are fine (the peers may check them).
pub fn check_peer_timeout_leaves_room_for_heartbeats<D: Heartbeats>(d: &D) {
    for (beat, quiet) in [
        (Some(500), Some(900)),
        (Some(600), Some(1000)),
        (None, Some(1000)),
        (Some(0), None),
        (Some(100), Some(0)),
    ] {
        let mut cfg = d.config();
        D::set_liveness(
            &mut cfg,
            beat.map(Duration::from_millis),
            quiet.map(Duration::from_millis),
        );
        let r = d.try_mesh(vec![cfg]).pop().unwrap();
        assert!(
            matches!(r, Err(TransportError::Handshake { ref peer, .. }) if peer == "config"),
            "{beat:?} {quiet:?}: {r:?}"
        );
    }
    let mut cfg = d.config();
    D::set_liveness(&mut cfg, Some(Duration::from_secs(1)), None);
    assert!(d.try_mesh(vec![cfg]).pop().unwrap().is_ok());
}

/// 2.4 MB per rank over 3 ranks: ring frames of ~800 KB (TCP reads them straight into
/// their own buffers; QUIC carries them in many packets), then small frames on the same
/// connections; exact.
pub fn check_large_frames<M: Mesh>(mesh: &M, seed: u64) {
    use super::{bits, ring_reference, run_ranks, Rng};
    use dtrain_comms::ReduceOp;
    let world = 3;
    let n = 600_000;
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| Rng(seed + r as u64).f32s(n)).collect();
    let want = ring_reference(&inputs, ReduceOp::Sum);
    let ins = inputs.clone();
    let out = run_ranks(mesh.make(world), CommConfig::default(), move |c| {
        let mut v = ins[c.rank()].clone();
        c.all_reduce_sum(&mut v).unwrap();
        let g = c.all_gather(&[c.rank() as u8; 3]).unwrap();
        (v, g)
    });
    for (v, g) in &out {
        assert_eq!(bits(v), bits(&want));
        assert_eq!(g, &vec![vec![0u8; 3], vec![1; 3], vec![2; 3]]);
    }
}

/// How the child process of [`check_fault_in_child_process`] is struck.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Fault {
    /// SIGKILL: its kernel closes its TCP connections; over UDP nothing tells the peers.
    Kill,
    /// SIGSTOP: frozen, connections open and silent.
    Stop,
}

/// What [`check_fault_in_child_process`] expects of the survivors.
pub struct Expect {
    /// Both fail within this long of the fault.
    pub within: Duration,
    /// The error says the peer sent no heartbeat (it was given up on for its silence).
    pub silent: bool,
}

/// Rank 2 is a separate process (this test binary re-run as `test`, the test's full path,
/// with [`CHILD_ENV`] set) struck by `fault` while ranks 0 and 1 wait for it inside an
/// all-reduce whose inactivity timeout (20 s) is far away: both must fail with
/// [`CommError::PeerLost`] naming rank 2 as `expect` says. Every rank has heartbeats every
/// `beat` and a peer timeout of `quiet`.
pub fn check_fault_in_child_process<D: Spawned + Heartbeats>(
    d: &D,
    test: &str,
    fault: Fault,
    (beat, quiet): (Duration, Duration),
    expect: Expect,
) {
    use std::process::{Command, Stdio};
    use std::sync::mpsc;

    let tune = move |cfg: &mut D::Config| D::set_liveness(cfg, Some(beat), Some(quiet));
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        let t = d.child(&spec, &tune);
        let mut c = Communicator::new(t, CommConfig::default());
        c.barrier().unwrap();
        thread::sleep(Duration::from_secs(20));
        return;
    }
    let mut cfg = d.config();
    tune(&mut cfg);
    let (spec, survivors) = d.survivors(cfg);
    // The test's path inside this binary: without the crate's name.
    let test = test.split_once("::").map_or(test, |(_, t)| t);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--test-threads=1"])
        .env(CHILD_ENV, spec)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (ready_tx, ready_rx) = mpsc::channel();
    let survivors: Vec<_> = survivors
        .into_iter()
        .map(|connect| {
            let ready = ready_tx.clone();
            thread::spawn(move || {
                let cfg = CommConfig {
                    timeout: Duration::from_secs(20),
                    ..CommConfig::default()
                };
                let mut c = Communicator::new(connect(), cfg);
                c.barrier().unwrap();
                ready.send(()).unwrap();
                let mut v = vec![1.0f32; 100_000];
                (c.all_reduce_sum(&mut v).unwrap_err(), Instant::now())
            })
        })
        .collect();
    for _ in 0..2 {
        ready_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("mesh with the child process");
    }
    thread::sleep(Duration::from_millis(200));
    let struck = Instant::now();
    match fault {
        Fault::Kill => {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        Fault::Stop => {
            let ok = Command::new("kill")
                .args(["-STOP", &child.id().to_string()])
                .status()
                .unwrap();
            assert!(ok.success(), "kill -STOP");
        }
    }
    let results: Vec<_> = survivors.into_iter().map(|h| h.join().unwrap()).collect();
    // SIGKILL also ends a stopped process.
    let _ = child.kill();
    let _ = child.wait();
    for (r, (e, at)) in results.into_iter().enumerate() {
        assert!(
            matches!(e, CommError::PeerLost { rank: 2, .. }),
            "rank {r}: {e}"
        );
        if expect.silent {
            assert!(e.to_string().contains("heartbeat"), "rank {r}: {e}");
        }
        let took = at.duration_since(struck);
        assert!(took < expect.within, "rank {r} took {took:?}");
    }
}

/// The TCP driver over 127.0.0.1 (ephemeral ports).
#[cfg(feature = "tcp")]
pub struct Tcp;

#[cfg(feature = "tcp")]
mod tcp_driver {
    use super::*;
    use crate::common::tcp::{config, listeners, mesh, try_mesh, TOKEN};
    use dtrain_comms::{TcpConfig, TcpTransport};
    use std::net::SocketAddr;

    impl Mesh for Tcp {
        type T = TcpTransport;
        fn make(&self, world: usize) -> Vec<TcpTransport> {
            mesh(world)
        }
    }

    impl Driver for Tcp {
        type Config = TcpConfig;
        fn config(&self) -> TcpConfig {
            config(TOKEN)
        }
        fn try_mesh(&self, cfgs: Vec<TcpConfig>) -> Vec<Result<TcpTransport, TransportError>> {
            try_mesh(cfgs)
        }
        fn set_token(cfg: &mut TcpConfig, token: &[u8]) {
            cfg.token = token.to_vec();
        }
        fn set_connect_timeout(cfg: &mut TcpConfig, t: Duration) {
            cfg.connect_timeout = t;
        }
        fn set_max_frame(cfg: &mut TcpConfig, max: usize) {
            cfg.max_frame = max;
        }
        fn set_link(cfg: &mut TcpConfig, link: LinkSpec) {
            cfg.link = link;
        }
    }

    impl Heartbeats for Tcp {
        fn set_liveness(cfg: &mut TcpConfig, beat: Option<Duration>, quiet: Option<Duration>) {
            cfg.heartbeat_interval = beat;
            cfg.peer_timeout = quiet;
        }
    }

    /// The spec is the addresses of ranks 0 and 1; the child, the highest rank, only dials,
    /// so nobody needs its address.
    impl Spawned for Tcp {
        fn survivors(
            &self,
            cfg: TcpConfig,
        ) -> (String, Vec<Box<dyn FnOnce() -> TcpTransport + Send>>) {
            let (ls, addrs) = listeners(3);
            let spec = format!("{},{}", addrs[0], addrs[1]);
            let ranks = ls
                .into_iter()
                .take(2)
                .enumerate()
                .map(|(r, l)| {
                    let (addrs, cfg) = (addrs.clone(), cfg.clone());
                    Box::new(move || TcpTransport::connect(r, &addrs, l, cfg).unwrap())
                        as Box<dyn FnOnce() -> TcpTransport + Send>
                })
                .collect();
            (spec, ranks)
        }

        fn child(&self, spec: &str, tune: &dyn Fn(&mut TcpConfig)) -> TcpTransport {
            let mut addrs: Vec<SocketAddr> = spec.split(',').map(|a| a.parse().unwrap()).collect();
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            addrs.push(l.local_addr().unwrap());
            let mut cfg = config(TOKEN);
            tune(&mut cfg);
            TcpTransport::connect(2, &addrs, l, cfg).unwrap()
        }
    }
}

/// The QUIC driver over 127.0.0.1 (ephemeral UDP ports), one run identity per mesh.
#[cfg(feature = "quic")]
pub struct Quic;

#[cfg(feature = "quic")]
mod quic_driver {
    use super::*;
    use crate::common::quic::{config, mesh, sockets, try_mesh, TOKEN};
    use dtrain_comms::rendezvous::RunIdentity;
    use dtrain_comms::{QuicConfig, QuicTransport};
    use std::net::{SocketAddr, UdpSocket};

    impl Mesh for Quic {
        type T = QuicTransport;
        fn make(&self, world: usize) -> Vec<QuicTransport> {
            mesh(world)
        }
    }

    impl Driver for Quic {
        type Config = QuicConfig;
        fn config(&self) -> QuicConfig {
            config(TOKEN, RunIdentity::generate().unwrap())
        }
        fn try_mesh(&self, cfgs: Vec<QuicConfig>) -> Vec<Result<QuicTransport, TransportError>> {
            try_mesh(cfgs)
        }
        fn set_token(cfg: &mut QuicConfig, token: &[u8]) {
            cfg.token = token.to_vec();
        }
        fn set_connect_timeout(cfg: &mut QuicConfig, t: Duration) {
            cfg.connect_timeout = t;
        }
        fn set_max_frame(cfg: &mut QuicConfig, max: usize) {
            cfg.max_frame = max;
        }
        fn set_link(cfg: &mut QuicConfig, link: LinkSpec) {
            cfg.link = link;
        }
    }

    impl Heartbeats for Quic {
        fn set_liveness(cfg: &mut QuicConfig, beat: Option<Duration>, quiet: Option<Duration>) {
            cfg.heartbeat_interval = beat;
            cfg.peer_timeout = quiet;
        }
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The spec is the addresses of ranks 0 and 1 and the run identity; the child's address
    /// is learnt from its connection (the highest rank only dials).
    impl Spawned for Quic {
        fn survivors(
            &self,
            cfg: QuicConfig,
        ) -> (String, Vec<Box<dyn FnOnce() -> QuicTransport + Send>>) {
            let (ss, addrs) = sockets(2);
            let id = &cfg.identity;
            let spec = format!(
                "{},{};{};{}",
                addrs[0],
                addrs[1],
                hex(&id.cert_der),
                hex(&id.key_der)
            );
            let ranks = ss
                .into_iter()
                .enumerate()
                .map(|(r, s)| {
                    // Rank 2's address is only used by ranks that dial it (none).
                    let mut all = addrs.clone();
                    all.push("127.0.0.1:9".parse().unwrap());
                    let cfg = cfg.clone();
                    Box::new(move || QuicTransport::connect(r, &all, s, cfg).unwrap())
                        as Box<dyn FnOnce() -> QuicTransport + Send>
                })
                .collect();
            (spec, ranks)
        }

        fn child(&self, spec: &str, tune: &dyn Fn(&mut QuicConfig)) -> QuicTransport {
            let parts: Vec<&str> = spec.split(';').collect();
            let mut addrs: Vec<SocketAddr> =
                parts[0].split(',').map(|a| a.parse().unwrap()).collect();
            let id = RunIdentity {
                cert_der: unhex(parts[1]),
                key_der: unhex(parts[2]),
            };
            let s = UdpSocket::bind("127.0.0.1:0").unwrap();
            addrs.push(s.local_addr().unwrap());
            let mut cfg = config(TOKEN, id);
            tune(&mut cfg);
            QuicTransport::connect(2, &addrs, s, cfg).unwrap()
        }
    }
}

/// The shared-memory driver (ranks as threads), one fresh run id per mesh; every mesh
/// built by [`Mesh::make`] or [`Driver::mesh_with`] is checked to leave no segment file.
#[cfg(all(feature = "shm", target_os = "linux"))]
pub struct Shm;

#[cfg(all(feature = "shm", target_os = "linux"))]
mod shm_driver {
    use super::*;
    use crate::common::shm::{config, mesh, mesh_with, try_mesh, TOKEN};
    use dtrain_comms::{ShmConfig, ShmTransport};

    impl Mesh for Shm {
        type T = ShmTransport;
        fn make(&self, world: usize) -> Vec<ShmTransport> {
            mesh(world)
        }
    }

    impl Driver for Shm {
        type Config = ShmConfig;
        fn config(&self) -> ShmConfig {
            config(TOKEN)
        }
        fn try_mesh(&self, cfgs: Vec<ShmConfig>) -> Vec<Result<ShmTransport, TransportError>> {
            try_mesh(cfgs)
        }
        fn mesh_with(&self, world: usize, cfg: ShmConfig) -> Vec<ShmTransport> {
            mesh_with(world, cfg)
        }
        fn set_token(cfg: &mut ShmConfig, token: &[u8]) {
            cfg.token = token.to_vec();
        }
        fn set_connect_timeout(cfg: &mut ShmConfig, t: Duration) {
            cfg.connect_timeout = t;
        }
        fn set_max_frame(cfg: &mut ShmConfig, max: usize) {
            cfg.max_frame = max;
        }
        fn set_link(cfg: &mut ShmConfig, link: LinkSpec) {
            cfg.link = link;
        }
    }
}

/// The hybrid driver: hosts of two consecutive ranks (shared memory between them, TCP over
/// 127.0.0.1 to the others).
#[cfg(all(feature = "tcp", feature = "shm", target_os = "linux"))]
pub struct Hybrid;

#[cfg(all(feature = "tcp", feature = "shm", target_os = "linux"))]
impl Mesh for Hybrid {
    type T = dtrain_comms::transport::hybrid::HybridTransport;
    fn make(&self, world: usize) -> Vec<Self::T> {
        crate::common::hybrid::mesh(world, 2)
    }
}
