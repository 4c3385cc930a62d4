//! What only the shared-memory driver has: large messages through small rings, token
//! checks, clean-up of the segment files, and a SIGKILLed peer process (detected by its
//! pid, even as a zombie). Everything it shares with the other drivers is in the
//! conformance suite (`conformance.rs`).

#![cfg(all(feature = "shm", target_os = "linux"))]

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::shm::{config, mesh, mesh_with, run_id, try_mesh, TOKEN};
use common::*;
use dtrain_comms::transport::shm::leftover_segments;
use dtrain_comms::{
    CommConfig, CommError, Communicator, ReduceOp, ShmConfig, ShmTransport, Transport,
    TransportError,
};

fn secs(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

#[test]
fn close_is_reported_after_the_last_message_and_recv_from_keeps_others() {
    let mut m = mesh(3);
    let t2 = m.pop().unwrap();
    let mut t1 = m.pop().unwrap();
    let mut t0 = m.pop().unwrap();
    let mut t2 = t2;
    t2.send(0, vec![2]).unwrap();
    t1.send(0, vec![1]).unwrap();
    t1.send(0, vec![11; 30_000]).unwrap();
    drop(t1);
    assert_eq!(t0.recv_from(1, secs(5)).unwrap(), vec![1]);
    assert_eq!(t0.recv_from(1, secs(5)).unwrap(), vec![11; 30_000]);
    assert!(matches!(
        t0.recv_from(1, secs(5)),
        Err(TransportError::Closed { rank: 1 })
    ));
    // Asked again, still closed; rank 2's message waited in its ring.
    assert!(matches!(
        t0.recv_from(1, secs(5)),
        Err(TransportError::Closed { rank: 1 })
    ));
    assert_eq!(t0.recv(secs(5)).unwrap(), (2, vec![2]));
    assert!(matches!(
        t0.send(1, vec![0]),
        Err(TransportError::Closed { rank: 1 })
    ));
    assert!(matches!(
        t0.send(0, vec![0]),
        Err(TransportError::InvalidRank { .. })
    ));
    let short = Instant::now() + Duration::from_millis(20);
    assert!(matches!(t0.recv(short), Err(TransportError::Timeout)));
    // Framing as on TCP: 5 bytes per message.
    assert_eq!(t0.bytes().received, (1 + 5) + (30_000 + 5) + (1 + 5));
    assert_eq!(t2.bytes().sent, 1 + 5);
}

/// A rank dropped with a frame only half in the ring (the peer does not read) waits for
/// `linger`, then gives up: the peer gets what was before it, then the close.
#[test]
fn drop_gives_up_after_linger_on_a_peer_that_does_not_read() {
    let cfg = ShmConfig {
        linger: Duration::from_millis(300),
        ..config(TOKEN)
    };
    let mut m = mesh_with(2, cfg);
    let mut t1 = m.pop().unwrap();
    let mut t0 = m.pop().unwrap();
    t1.send(0, vec![1]).unwrap();
    t1.send(0, vec![2; 200_000]).unwrap();
    let t = Instant::now();
    drop(t1);
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(290), "{took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert_eq!(t0.recv(secs(5)).unwrap(), (1, vec![1]));
    assert!(matches!(
        t0.recv(secs(5)),
        Err(TransportError::Closed { rank: 1 })
    ));
}

/// 64 MB messages both ways at once through 1 MiB rings, with small messages before and
/// after on the same rings: streamed in pieces, exact, in order, and `send` never waits.
#[test]
fn large_messages_stream_through_small_rings() {
    let cfg = ShmConfig {
        ring_bytes: 1 << 20,
        max_frame: 128 << 20,
        ..config(TOKEN)
    };
    let mut m = mesh_with(2, cfg);
    let mut t1 = m.pop().unwrap();
    let mut t0 = m.pop().unwrap();
    let n = 64 << 20;
    let big = move |seed: u8| -> Vec<u8> {
        (0..n)
            .map(|i: usize| (i ^ (i >> 8) ^ (i >> 16)) as u8 ^ seed)
            .collect()
    };
    let h = thread::spawn(move || {
        let t = Instant::now();
        t1.send(0, vec![1, 2, 3]).unwrap();
        t1.send(0, big(0x5a)).unwrap();
        t1.send(0, vec![4]).unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "send waited on the peer"
        );
        assert_eq!(t1.recv_from(0, secs(30)).unwrap(), vec![9]);
        let got = t1.recv_from(0, secs(30)).unwrap();
        assert!(got == big(0xa5), "rank 1 got a corrupted 64 MB message");
        assert_eq!(t1.recv_from(0, secs(30)).unwrap(), vec![8; 7]);
        t1
    });
    t0.send(1, vec![9]).unwrap();
    t0.send(1, big(0xa5)).unwrap();
    t0.send(1, vec![8; 7]).unwrap();
    assert_eq!(t0.recv(secs(30)).unwrap(), (1, vec![1, 2, 3]));
    let (from, got) = t0.recv(secs(30)).unwrap();
    assert_eq!(from, 1);
    assert!(got == big(0x5a), "rank 0 got a corrupted 64 MB message");
    assert_eq!(t0.recv(secs(30)).unwrap(), (1, vec![4]));
    let t1 = h.join().unwrap();
    assert_eq!(t0.bytes().sent, t1.bytes().received);
    assert_eq!(t1.bytes().sent, t0.bytes().received);
}

/// Many odd-sized messages through the smallest ring (4 KiB) from three senders: frame
/// prefixes and bodies split at every possible place around the wrap.
#[test]
fn odd_sizes_wrap_around_the_smallest_ring() {
    let cfg = ShmConfig {
        ring_bytes: 1,
        ..config(TOKEN)
    };
    let mut m = mesh_with(4, cfg);
    assert_eq!(m[0].ring_bytes(), 4096);
    let mut t0 = m.remove(0);
    let senders: Vec<_> = m
        .into_iter()
        .map(|mut t| {
            thread::spawn(move || {
                let r = t.rank();
                let mut rng = Rng(r as u64);
                for i in 0..400u32 {
                    let n = [0, 1, 3, 4091, 4096, 4097, 9000][rng.below(7)] + rng.below(7);
                    let mut msg = Rng(r as u64 * 1000 + i as u64).bytes(n);
                    if n >= 4 {
                        msg[..4].copy_from_slice(&i.to_le_bytes());
                    }
                    t.send(0, msg).unwrap();
                }
                t
            })
        })
        .collect();
    let mut counts = [0u32; 4];
    let mut rngs: Vec<Rng> = (0..4).map(|r| Rng(r as u64)).collect();
    for _ in 0..3 * 400 {
        let (from, msg) = t0.recv(secs(30)).unwrap();
        let i = counts[from];
        let n = [0, 1, 3, 4091, 4096, 4097, 9000][rngs[from].below(7)] + rngs[from].below(7);
        let mut want = Rng(from as u64 * 1000 + i as u64).bytes(n);
        if n >= 4 {
            want[..4].copy_from_slice(&i.to_le_bytes());
        }
        assert!(msg == want, "message {i} from rank {from} differs");
        counts[from] += 1;
    }
    assert_eq!(&counts[1..], &[400, 400, 400]);
    for h in senders {
        drop(h.join().unwrap());
    }
}

#[test]
fn all_reduce_of_64_mb_in_one_chunk_through_small_rings() {
    let world = 3;
    let n = 16 << 20; // 64 MiB of f32
    let cfg = ShmConfig {
        ring_bytes: 1 << 20,
        ..config(TOKEN)
    };
    let comm = CommConfig {
        chunk_bytes: 64 << 20,
        ..CommConfig::default()
    };
    let out = run_ranks(mesh_with(world, cfg), comm, move |c| {
        let mut v: Vec<f32> = (0..n)
            .map(|i| (i % 1000) as f32 + c.rank() as f32)
            .collect();
        c.all_reduce_sum(&mut v).unwrap();
        (0..n)
            .step_by(4099)
            .all(|i| v[i] == 3.0 * (i % 1000) as f32 + 3.0)
    });
    assert!(out.iter().all(|&ok| ok));
}

#[test]
fn all_reduce_exact_with_default_rings_and_chunks() {
    let world = 4;
    let n = 700_001;
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| Rng(31 + r as u64).f32s(n)).collect();
    let want = ring_reference(&inputs, ReduceOp::Sum);
    let ins = inputs.clone();
    let cfg = ShmConfig::new(TOKEN.to_vec(), run_id());
    let out = run_ranks(mesh_with(world, cfg), CommConfig::default(), move |c| {
        let mut v = ins[c.rank()].clone();
        for _ in 0..3 {
            v.copy_from_slice(&ins[c.rank()]);
            c.all_reduce_sum(&mut v).unwrap();
        }
        v
    });
    for v in &out {
        assert_eq!(bits(v), bits(&want));
    }
}

#[test]
fn rank_with_wrong_token_is_refused_and_nothing_is_left() {
    let mut good = config(TOKEN);
    good.connect_timeout = Duration::from_millis(1500);
    let bad = ShmConfig {
        token: b"not-the-token".to_vec(),
        ..good.clone()
    };
    let start = Instant::now();
    let r = try_mesh(vec![good.clone(), bad]);
    for (me, peer) in [(0, 1), (1, 0)] {
        match &r[me] {
            Err(TransportError::Handshake { peer: p, detail }) => {
                assert!(p.contains(&peer.to_string()), "rank {me}: {p}: {detail}")
            }
            other => panic!("rank {me}: expected a refused handshake, got {other:?}"),
        }
    }
    // At least one side saw the other's segment and refused it by its token at once.
    let refused = r.iter().any(|x| {
        matches!(x, Err(TransportError::Handshake { detail, .. }) if detail.contains("different run token"))
    });
    assert!(refused, "{r:?}");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(leftover_segments(&good, 2).is_empty());
}

#[test]
fn missing_rank_is_named_and_nothing_is_left() {
    let mut cfg = config(TOKEN);
    cfg.connect_timeout = Duration::from_millis(300);
    // Ranks 0 and 1 of 3 start; rank 2 never does.
    let hs: Vec<_> = (0..2)
        .map(|r| {
            let cfg = cfg.clone();
            thread::spawn(move || ShmTransport::connect(r, 3, cfg))
        })
        .collect();
    for (r, h) in hs.into_iter().enumerate() {
        match h.join().unwrap() {
            Err(TransportError::Handshake { peer, .. }) => {
                assert!(peer.contains('2'), "rank {r}: {peer}")
            }
            other => panic!("rank {r}: expected a handshake timeout, got {other:?}"),
        }
    }
    assert!(leftover_segments(&cfg, 3).is_empty());
}

#[test]
fn a_segment_of_another_user_or_mode_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let mut cfg = config(TOKEN);
    cfg.connect_timeout = Duration::from_millis(500);
    // A stranger (here: a file with group/other access) squats rank 1's name.
    let squat = cfg.segment_path(1);
    std::fs::write(&squat, vec![0u8; 8192]).unwrap();
    std::fs::set_permissions(&squat, std::fs::Permissions::from_mode(0o644)).unwrap();
    let r = ShmTransport::connect(0, 2, cfg.clone());
    std::fs::remove_file(&squat).unwrap();
    match r {
        Err(TransportError::Handshake { peer, detail }) => {
            assert_eq!(peer, "rank 1");
            assert!(detail.contains("mode"), "{detail}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(leftover_segments(&cfg, 2).is_empty());
}

/// Rank 2 is a separate process (this test binary re-run with `DTRAIN_SHM_CHILD` set),
/// SIGKILLed while ranks 0 and 1 wait for it inside an all-reduce: both must fail fast with
/// an error naming rank 2.
#[test]
fn killed_process_is_named_by_every_survivor() {
    use std::process::{Command, Stdio};
    use std::sync::mpsc;

    if let Ok(id) = std::env::var("DTRAIN_SHM_CHILD") {
        let cfg = ShmConfig {
            connect_timeout: Duration::from_secs(20),
            ..ShmConfig::new(TOKEN.to_vec(), id)
        };
        let t = ShmTransport::connect(2, 3, cfg).unwrap();
        let mut c = Communicator::new(t, CommConfig::default());
        c.barrier().unwrap();
        thread::sleep(Duration::from_secs(20));
        return;
    }
    let id = run_id();
    let cfg = ShmConfig {
        connect_timeout: Duration::from_secs(20),
        ..ShmConfig::new(TOKEN.to_vec(), id.clone())
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "killed_process_is_named_by_every_survivor",
            "--test-threads=1",
        ])
        .env("DTRAIN_SHM_CHILD", &id)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (ready_tx, ready_rx) = mpsc::channel();
    let survivors: Vec<_> = (0..2)
        .map(|r| {
            let ready = ready_tx.clone();
            let cfg = cfg.clone();
            thread::spawn(move || {
                let t = ShmTransport::connect(r, 3, cfg).unwrap();
                let comm = CommConfig {
                    timeout: Duration::from_secs(10),
                    ..CommConfig::default()
                };
                let mut c = Communicator::new(t, comm);
                c.barrier().unwrap();
                ready.send(()).unwrap();
                let mut v = vec![1.0f32; 100_000];
                (c.all_reduce_sum(&mut v).unwrap_err(), Instant::now())
            })
        })
        .collect();
    for _ in 0..2 {
        ready_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("mesh with the child process");
    }
    assert!(leftover_segments(&cfg, 3).is_empty());
    thread::sleep(Duration::from_millis(200));
    child.kill().unwrap();
    let killed = Instant::now();
    // Reap late: a zombie must count as dead too.
    let mut outcomes = Vec::new();
    for (r, h) in survivors.into_iter().enumerate() {
        let (e, at) = h.join().unwrap();
        assert!(
            matches!(e, CommError::PeerLost { rank: 2, .. }),
            "rank {r}: {e}"
        );
        outcomes.push(at.duration_since(killed));
    }
    child.wait().unwrap();
    for (r, took) in outcomes.into_iter().enumerate() {
        assert!(took < Duration::from_secs(1), "rank {r} took {took:?}");
    }
}

/// Rank 1 is a separate process SIGKILLed during set-up (rank 2 never starts): rank 0
/// fails fast naming rank 1, and the dead rank's segment file is removed for it.
#[test]
fn process_killed_during_set_up_is_named_and_its_segment_removed() {
    use std::process::{Command, Stdio};

    if let Ok(id) = std::env::var("DTRAIN_SHM_SETUP_CHILD") {
        let cfg = ShmConfig {
            connect_timeout: Duration::from_secs(30),
            ..ShmConfig::new(TOKEN.to_vec(), id)
        };
        let _ = ShmTransport::connect(1, 3, cfg);
        return;
    }
    let id = run_id();
    let cfg = ShmConfig {
        connect_timeout: Duration::from_secs(20),
        ..ShmConfig::new(TOKEN.to_vec(), id.clone())
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "process_killed_during_set_up_is_named_and_its_segment_removed",
            "--test-threads=1",
        ])
        .env("DTRAIN_SHM_SETUP_CHILD", &id)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let c = cfg.clone();
    let rank0 = thread::spawn(move || {
        let r = ShmTransport::connect(0, 3, c);
        (r, Instant::now())
    });
    let t = Instant::now();
    while !cfg.segment_path(1).exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "child never started");
        thread::sleep(Duration::from_millis(5));
    }
    thread::sleep(Duration::from_millis(100));
    child.kill().unwrap();
    let killed = Instant::now();
    let (r, at) = rank0.join().unwrap();
    child.wait().unwrap();
    match r {
        Err(TransportError::Handshake { peer, detail }) => {
            assert_eq!(peer, "rank 1", "{detail}");
            assert!(detail.contains("exited"), "{detail}");
        }
        other => panic!("expected a handshake error naming rank 1, got {other:?}"),
    }
    assert!(at.duration_since(killed) < Duration::from_secs(2));
    assert!(leftover_segments(&cfg, 3).is_empty());
}

/// After a rendezvous: every rank derives the same run id from what it received, checks
/// that all ranks are on one host, and forms a shared-memory mesh.
#[cfg(feature = "tcp")]
#[test]
fn mesh_after_a_rendezvous() {
    use dtrain_comms::rendezvous::{self, Host, RendezvousConfig, RunIdentity};
    use dtrain_comms::transport::shm::same_host;
    use std::net::TcpListener;

    let world = 3;
    let rcfg = RendezvousConfig {
        timeout: Duration::from_secs(10),
        ..RendezvousConfig::new(TOKEN.to_vec())
    };
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let h = Host::spawn(l, world, RunIdentity::default(), rcfg.clone()).unwrap();
    let at = h.addr();
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let rcfg = rcfg.clone();
            thread::spawn(move || {
                let l = TcpListener::bind("127.0.0.1:0").unwrap();
                let j = rendezvous::join(at, rank, world, l.local_addr().unwrap(), &rcfg).unwrap();
                assert!(same_host(&j.peers));
                let cfg = ShmConfig::from_joined(TOKEN.to_vec(), &j);
                let t = ShmTransport::connect(j.rank, j.world, cfg.clone()).unwrap();
                let mut c = Communicator::new(t, CommConfig::default());
                let mut v = vec![rank as f32 + 1.0; 100_000];
                c.all_reduce_sum(&mut v).unwrap();
                (cfg, v)
            })
        })
        .collect();
    let out: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    h.wait().unwrap();
    for (cfg, v) in &out {
        assert_eq!(cfg.run_id, out[0].0.run_id);
        assert!(v.iter().all(|&x| x == 6.0));
    }
    assert!(leftover_segments(&out[0].0, world).is_empty());
}

/// Frames that did not fit the ring, or wait for their emulated release time, reach the
/// peer while the sender is busy elsewhere (not in the transport): the writer thread
/// delivers them.
#[test]
fn queued_frames_are_delivered_while_the_sender_is_away() {
    for link in [
        dtrain_comms::shaping::LinkSpec::default(),
        dtrain_comms::shaping::LinkSpec::parse(Some("1Gbit"), Some("2ms")).unwrap(),
    ] {
        let cfg = ShmConfig {
            link,
            ..config(TOKEN)
        };
        let mut m = mesh_with(2, cfg);
        let mut t1 = m.pop().unwrap();
        let mut t0 = m.pop().unwrap();
        for i in 0..8u8 {
            t0.send(1, vec![i; 300_000]).unwrap();
        }
        let away = thread::spawn(move || {
            // The sender computes for a while without touching its transport.
            thread::sleep(Duration::from_secs(1));
            t0
        });
        let t = Instant::now();
        for i in 0..8u8 {
            assert_eq!(t1.recv_from(0, secs(10)).unwrap(), vec![i; 300_000]);
        }
        assert!(
            t.elapsed() < Duration::from_millis(800),
            "{:?}",
            t.elapsed()
        );
        drop(away.join().unwrap());
    }
}
