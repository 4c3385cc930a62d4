//! Conformance suite over the TCP driver on 127.0.0.1, N = 1..=4, plus authentication.

#![cfg(feature = "tcp")]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use common::tcp::{config, listeners, mesh, try_mesh, TOKEN};
use common::*;
use dtrain_comms::frame::Hello;
use dtrain_comms::{TcpConfig, TcpTransport, Transport, TransportError};

struct Tcp;

impl Mesh for Tcp {
    type T = TcpTransport;
    fn make(&self, world: usize) -> Vec<TcpTransport> {
        mesh(world)
    }
}

const WORLDS: std::ops::RangeInclusive<usize> = 1..=4;

#[test]
fn all_reduce_matches_reference_bit_for_bit() {
    for w in WORLDS {
        check_all_reduce(&Tcp, w);
    }
}

#[test]
fn all_gather_variable_sizes() {
    for w in WORLDS {
        check_all_gather(&Tcp, w);
    }
}

#[test]
fn all_gather_into_reuses_its_buffers() {
    for w in WORLDS {
        check_all_gather_into(&Tcp, w);
    }
}

#[test]
fn broadcast_from_every_root() {
    for w in WORLDS {
        check_broadcast(&Tcp, w);
    }
}

#[test]
fn reduce_scatter_matches_reference() {
    for w in WORLDS {
        check_reduce_scatter(&Tcp, w);
    }
}

#[test]
fn barrier_waits_for_everyone() {
    for w in WORLDS {
        check_barrier(&Tcp, w);
    }
}

#[test]
fn mixed_sequence_and_byte_counts() {
    for w in WORLDS {
        check_sequence_and_bytes(&Tcp, w);
    }
}

#[test]
fn dead_peer_is_named_by_every_survivor() {
    for w in 2..=4 {
        check_dead_peer(&Tcp, w);
    }
}

#[test]
fn stalled_peer_is_named_by_every_survivor() {
    for_worlds_concurrently(Tcp, &[2, 4], check_stalled_peer);
}

#[test]
fn mismatched_collectives_are_reported() {
    for w in 2..=4 {
        check_mismatch(&Tcp, w);
    }
}

#[test]
fn sparse_all_reduce_matches_reference_bit_for_bit() {
    for w in [2, 4] {
        check_sparse_all_reduce(&Tcp, w);
    }
}

#[test]
fn sparse_all_reduce_mismatches_are_reported() {
    for w in [2, 4] {
        check_sparse_mismatch(&Tcp, w);
    }
}

#[test]
fn emulated_link_follows_the_alpha_beta_model() {
    check_emulated_link(|world, link| {
        let mut cfg = config(TOKEN);
        cfg.link = link;
        try_mesh(vec![cfg; world])
            .into_iter()
            .map(|t| t.expect("mesh set-up"))
            .collect()
    });
}

#[test]
fn rank_with_wrong_token_is_refused() {
    let mut bad = config(b"not-the-token");
    bad.connect_timeout = Duration::from_millis(800);
    let mut good = config(TOKEN);
    good.connect_timeout = Duration::from_millis(800);
    let r = try_mesh(vec![good, bad]);
    // Rank 1 dials rank 0 with the wrong token: rank 0 closes the connection.
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

#[test]
fn intruders_are_refused_while_the_mesh_forms() {
    let (ls, addrs) = listeners(2);
    let a0 = addrs[0];
    let mut it = ls.into_iter();
    let (l0, l1) = (it.next().unwrap(), it.next().unwrap());
    let addrs0 = addrs.clone();
    let h0 = thread::spawn(move || TcpTransport::connect(0, &addrs0, l0, config(TOKEN)));
    // An intruder with the wrong token, and one sending garbage: both get closed without
    // an answer, and the real rank 1 still connects.
    let mut wrong = TcpStream::connect(a0).unwrap();
    let hello = Hello {
        rank: 1,
        world: 2,
        token: b"guess".to_vec(),
    };
    wrong.write_all(&hello.encode()).unwrap();
    let mut garbage = TcpStream::connect(a0).unwrap();
    garbage.write_all(&[0xff; 64]).unwrap();
    for s in [&mut wrong, &mut garbage] {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 16];
        let n = s.read(&mut buf).unwrap_or(0);
        assert_eq!(n, 0, "an unauthenticated connection got an answer");
    }
    let t1 = TcpTransport::connect(1, &addrs, l1, config(TOKEN)).unwrap();
    let mut t0 = h0.join().unwrap().unwrap();
    let mut t1 = t1;
    t1.send(0, b"hi".to_vec()).unwrap();
    let (from, msg) = t0.recv(Instant::now() + Duration::from_secs(5)).unwrap();
    assert_eq!((from, msg.as_slice()), (1, &b"hi"[..]));
}

#[test]
fn oversized_message_is_rejected_at_send() {
    let mut cfgs = vec![config(TOKEN); 2];
    for c in &mut cfgs {
        c.max_frame = 1024;
    }
    let mut ts: Vec<TcpTransport> = try_mesh(cfgs).into_iter().map(|t| t.unwrap()).collect();
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

#[test]
fn large_frames_take_the_direct_read_path_and_stay_exact() {
    use dtrain_comms::{CommConfig, ReduceOp};
    // 2.4 MB per rank: ring frames of ~800 KB (read straight into their own buffers),
    // followed by small frames on the same connections.
    let world = 3;
    let n = 600_000;
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| Rng(77 + r as u64).f32s(n)).collect();
    let want = ring_reference(&inputs, ReduceOp::Sum);
    let ins = inputs.clone();
    let out = run_ranks(mesh(world), CommConfig::default(), move |c| {
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

#[test]
fn messages_of_later_collectives_are_kept_and_counted_for_their_call() {
    for w in 2..=3 {
        check_run_ahead(&Tcp, w);
    }
}

/// How the child process of [`fault_in_child_process`] is struck.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// SIGKILL: its kernel closes its connections.
    Kill,
    /// SIGSTOP: frozen, connections open and silent.
    Stop,
}

/// Heartbeats and peer timeout of the child-process tests (1 s peer timeout).
fn liveness(mut c: TcpConfig) -> TcpConfig {
    c.heartbeat_interval = Some(Duration::from_millis(200));
    c.peer_timeout = Some(Duration::from_millis(1000));
    c
}

/// Rank 2 is a separate process (this test binary re-run as `test` with
/// `DTRAIN_COMMS_CHILD` set) struck by `fault` while ranks 0 and 1 wait for it inside an
/// all-reduce whose inactivity timeout (20 s) is far away: both must fail with
/// [`CommError::PeerLost`] naming rank 2 within `within` of the fault.
fn fault_in_child_process(test: &str, fault: Fault, within: Duration) {
    use dtrain_comms::{CommConfig, CommError, Communicator};
    use std::net::SocketAddr;
    use std::process::{Command, Stdio};
    use std::sync::mpsc;

    if let Ok(spec) = std::env::var("DTRAIN_COMMS_CHILD") {
        // Child role: the highest rank only dials, so it needs no known address of its own.
        let mut addrs: Vec<SocketAddr> = spec.split(',').map(|a| a.parse().unwrap()).collect();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        addrs.push(l.local_addr().unwrap());
        let t = TcpTransport::connect(2, &addrs, l, liveness(config(TOKEN))).unwrap();
        let mut c = Communicator::new(t, CommConfig::default());
        c.barrier().unwrap();
        thread::sleep(Duration::from_secs(20));
        return;
    }
    let (ls, addrs) = listeners(3);
    let spec = format!("{},{}", addrs[0], addrs[1]);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--test-threads=1"])
        .env("DTRAIN_COMMS_CHILD", spec)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (ready_tx, ready_rx) = mpsc::channel();
    let survivors: Vec<_> = ls
        .into_iter()
        .take(2)
        .enumerate()
        .map(|(r, l)| {
            let addrs = addrs.clone();
            let ready = ready_tx.clone();
            thread::spawn(move || {
                let t = TcpTransport::connect(r, &addrs, l, liveness(config(TOKEN))).unwrap();
                let cfg = CommConfig {
                    timeout: Duration::from_secs(20),
                    ..CommConfig::default()
                };
                let mut c = Communicator::new(t, cfg);
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
        if fault == Fault::Stop {
            assert!(e.to_string().contains("heartbeat"), "rank {r}: {e}");
        }
        let took = at.duration_since(struck);
        assert!(took < within, "rank {r} took {took:?}");
    }
}

/// A SIGKILLed peer's kernel closes its connections: the survivors fail fast.
#[test]
fn killed_process_is_named_by_every_survivor() {
    fault_in_child_process(
        "killed_process_is_named_by_every_survivor",
        Fault::Kill,
        Duration::from_secs(3),
    );
}

/// A SIGSTOPped peer keeps its connections open and sends nothing: the survivors' readers
/// give up on it after the 1 s peer timeout (its heartbeats stopped), long before the
/// collective's 20 s timeout.
#[test]
fn stopped_process_is_named_by_every_survivor() {
    fault_in_child_process(
        "stopped_process_is_named_by_every_survivor",
        Fault::Stop,
        Duration::from_millis(2500),
    );
}

/// A peer that completes the handshake and then never sends a byte (nor reads one) — what
/// a frozen process or a cut network looks like from the survivors — is named by both
/// survivors within the peer timeout (counted from its last byte, here the hello), even
/// though a collective without it went through in between.
#[test]
fn silent_peer_is_named_within_the_peer_timeout() {
    use dtrain_comms::{CommConfig, CommError, Communicator};
    let (mut ls, addrs) = listeners(3);
    drop(ls.pop());
    // Rank 2, by hand: dial ranks 0 and 1, say hello, then stay silent until released.
    let (release, released) = std::sync::mpsc::channel::<()>();
    let fake = thread::spawn({
        let addrs = addrs.clone();
        move || {
            let hello = Hello {
                rank: 2,
                world: 3,
                token: TOKEN.to_vec(),
            }
            .encode();
            let socks: Vec<TcpStream> = addrs[..2]
                .iter()
                .map(|a| {
                    let mut s = TcpStream::connect(a).unwrap();
                    s.write_all(&hello).unwrap();
                    s
                })
                .collect();
            let _ = released.recv_timeout(Duration::from_secs(8));
            drop(socks);
        }
    });
    let quiet = Duration::from_millis(800);
    let hs: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let addrs = addrs.clone();
            thread::spawn(move || {
                let mut cfg = config(TOKEN);
                cfg.heartbeat_interval = Some(Duration::from_millis(100));
                cfg.peer_timeout = Some(quiet);
                let t = TcpTransport::connect(r, &addrs, l, cfg).unwrap();
                let start = Instant::now();
                let cc = CommConfig {
                    timeout: Duration::from_secs(20),
                    ..CommConfig::default()
                };
                let mut c = Communicator::new(t, cc);
                // A chain broadcast from rank 0 needs nothing from rank 2 (the last link).
                c.broadcast(&mut vec![1u8; 10], 0).unwrap();
                let mut v = vec![1.0f32; 100_000];
                (c.all_reduce_sum(&mut v).unwrap_err(), start.elapsed())
            })
        })
        .collect();
    for (r, h) in hs.into_iter().enumerate() {
        let (e, took) = h.join().unwrap();
        assert!(
            matches!(e, CommError::PeerLost { rank: 2, .. }),
            "rank {r}: {e}"
        );
        assert!(e.to_string().contains("heartbeat"), "rank {r}: {e}");
        assert!(
            took >= quiet - Duration::from_millis(50),
            "rank {r}: {took:?}"
        );
        assert!(
            took < quiet + Duration::from_millis(1500),
            "rank {r}: {took:?}"
        );
    }
    release.send(()).unwrap();
    fake.join().unwrap();
}

#[test]
fn late_rank_is_named_by_every_rank() {
    for_worlds_concurrently(Tcp, &[2, 3], check_late_rank);
}

#[test]
fn heartbeats_keep_an_idle_mesh_alive_and_are_not_counted() {
    check_idle_heartbeats(|world, beat, quiet| {
        let mut cfg = config(TOKEN);
        cfg.heartbeat_interval = Some(beat);
        cfg.peer_timeout = Some(quiet);
        try_mesh(vec![cfg; world])
            .into_iter()
            .map(|t| t.expect("mesh set-up"))
            .collect()
    });
}

#[test]
fn peer_timeout_must_leave_room_for_heartbeats() {
    let (mut ls, addrs) = listeners(1);
    for (beat, quiet) in [
        (Some(500), Some(900)),
        (None, Some(1000)),
        (Some(0), None),
        (Some(100), Some(0)),
    ] {
        let mut cfg = config(TOKEN);
        cfg.heartbeat_interval = beat.map(Duration::from_millis);
        cfg.peer_timeout = quiet.map(Duration::from_millis);
        let l = ls
            .pop()
            .unwrap_or_else(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
        let r = TcpTransport::connect(0, &addrs, l, cfg);
        assert!(
            matches!(r, Err(TransportError::Handshake { ref peer, .. }) if peer == "config"),
            "{beat:?} {quiet:?}: {r:?}"
        );
    }
    // Heartbeats without a peer timeout are fine (the peers may check them).
    let mut cfg = config(TOKEN);
    cfg.peer_timeout = None;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = vec![l.local_addr().unwrap()];
    assert!(TcpTransport::connect(0, &a, l, cfg).is_ok());
}
