//! Rendezvous over 127.0.0.1: ranks learn the world and every address, then mesh (TCP and
//! QUIC); wrong tokens, duplicate ranks, wrong world sizes and missing ranks are refused
//! with errors naming them.

#![cfg(feature = "tcp")]

use std::net::{SocketAddr, TcpListener};
use std::thread;
use std::time::{Duration, Instant};

use dtrain_comms::rendezvous::{self, Host, RendezvousConfig, RendezvousError, RunIdentity};
use dtrain_comms::{CommConfig, Communicator, TcpConfig, TcpTransport};

const TOKEN: &[u8] = b"rendezvous-test-token";

fn cfg(token: &[u8], timeout_ms: u64) -> RendezvousConfig {
    RendezvousConfig {
        timeout: Duration::from_millis(timeout_ms),
        ..RendezvousConfig::new(token.to_vec())
    }
}

fn host(world: usize, identity: RunIdentity, timeout_ms: u64) -> Host {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    Host::spawn(l, world, identity, cfg(TOKEN, timeout_ms)).unwrap()
}

#[test]
fn ranks_learn_every_address_and_form_a_tcp_mesh() {
    let world = 3;
    let id = RunIdentity {
        cert_der: vec![1, 2, 3],
        key_der: vec![4, 5],
    };
    let h = host(world, id.clone(), 10_000);
    let at = h.addr();
    // Ranks join in reverse order; one binds 0.0.0.0 and is published with 127.0.0.1.
    let ranks: Vec<_> = (0..world)
        .rev()
        .map(|rank| {
            thread::spawn(move || {
                let bind = if rank == 1 {
                    "0.0.0.0:0"
                } else {
                    "127.0.0.1:0"
                };
                let l = TcpListener::bind(bind).unwrap();
                let me = l.local_addr().unwrap();
                let j = rendezvous::join(at, rank, world, me, &cfg(TOKEN, 10_000)).unwrap();
                let t = TcpTransport::connect(rank, &j.peers, l, TcpConfig::new(TOKEN)).unwrap();
                let mut c = Communicator::new(t, CommConfig::default());
                let mut v = vec![rank as f32; 10];
                c.all_reduce_sum(&mut v).unwrap();
                (j, me, v)
            })
        })
        .collect();
    let out: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    h.wait().unwrap();
    let peers = out[0].0.peers.clone();
    for (j, me, v) in &out {
        assert_eq!(j.world, world);
        assert_eq!(j.peers, peers, "every rank sees the same address list");
        assert_eq!(j.identity, id);
        assert_eq!(j.peers[j.rank].port(), me.port());
        assert!(j.peers[j.rank].ip().is_loopback(), "{:?}", j.peers[j.rank]);
        assert_eq!(v, &vec![3.0; 10]);
    }
}

#[cfg(feature = "quic")]
#[test]
fn quic_mesh_uses_the_identity_handed_out_at_rendezvous() {
    use dtrain_comms::{QuicConfig, QuicTransport};
    let world = 2;
    let h = host(world, RunIdentity::generate().unwrap(), 10_000);
    let at = h.addr();
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            thread::spawn(move || {
                let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
                let me = s.local_addr().unwrap();
                let j = rendezvous::join(at, rank, world, me, &cfg(TOKEN, 10_000)).unwrap();
                let t =
                    QuicTransport::connect(rank, &j.peers, s, QuicConfig::new(TOKEN, j.identity))
                        .unwrap();
                let mut c = Communicator::new(t, CommConfig::default());
                let mut v = vec![1.0f32 + rank as f32; 100_000];
                c.all_reduce_sum(&mut v).unwrap();
                v[0]
            })
        })
        .collect();
    for r in ranks {
        assert_eq!(r.join().unwrap(), 3.0);
    }
    h.wait().unwrap();
}

#[test]
fn wrong_token_duplicate_rank_and_wrong_world_are_refused() {
    let h = host(2, RunIdentity::default(), 3_000);
    let at = h.addr();
    let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
    // Wrong token: closed without an answer.
    let e = rendezvous::join(at, 0, 2, addr, &cfg(b"guess", 3_000)).unwrap_err();
    match &e {
        RendezvousError::Rejected {
            rank: 0, reason, ..
        } => {
            assert!(reason.contains("token"), "{reason}")
        }
        other => panic!("{other}"),
    }
    // Wrong world size: told why.
    let e = rendezvous::join(at, 1, 3, addr, &cfg(TOKEN, 3_000)).unwrap_err();
    match &e {
        RendezvousError::Rejected {
            rank: 1, reason, ..
        } => {
            assert!(reason.contains("world size is 3"), "{reason}")
        }
        other => panic!("{other}"),
    }
    // Rank 0 joins and waits; a second rank 0 is refused naming the rank; rank 1 completes.
    let first = thread::spawn(move || rendezvous::join(at, 0, 2, addr, &cfg(TOKEN, 3_000)));
    thread::sleep(Duration::from_millis(200));
    let e = rendezvous::join(at, 0, 2, addr, &cfg(TOKEN, 3_000)).unwrap_err();
    match &e {
        RendezvousError::Rejected {
            rank: 0, reason, ..
        } => {
            assert!(reason.contains("rank 0 already joined"), "{reason}")
        }
        other => panic!("{other}"),
    }
    let second = rendezvous::join(at, 1, 2, addr, &cfg(TOKEN, 3_000)).unwrap();
    assert_eq!(first.join().unwrap().unwrap().peers, second.peers);
    h.wait().unwrap();
}

#[test]
fn missing_ranks_are_named_by_host_and_joiners() {
    let h = host(3, RunIdentity::default(), 600);
    let at = h.addr();
    let start = Instant::now();
    let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let e = rendezvous::join(at, 1, 3, addr, &cfg(TOKEN, 5_000)).unwrap_err();
    match &e {
        RendezvousError::Rejected {
            rank: 1, reason, ..
        } => {
            assert!(reason.contains("[0, 2]"), "{reason}")
        }
        other => panic!("{other}"),
    }
    match h.wait().unwrap_err() {
        RendezvousError::Timeout { missing, .. } => assert_eq!(missing, vec![0, 2]),
        other => panic!("{other}"),
    }
    assert!(start.elapsed() < Duration::from_secs(3));
    // Nobody hosting: a joiner gives up at its deadline, naming the address.
    let free = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let e = rendezvous::join(free, 0, 2, addr, &cfg(TOKEN, 300)).unwrap_err();
    assert!(
        matches!(e, RendezvousError::Unreachable { addr, .. } if addr == free),
        "{e}"
    );
}

/// A live host answers late joins: a newcomer taking rank 1's place learns every rank's
/// address with its own in rank 1's slot, and joins the running TCP mesh; a wrong token
/// is still refused. `wait` ends the late joins.
#[test]
fn a_live_host_answers_a_newcomer_with_the_current_addresses() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let h = Host::spawn_live(l, 2, RunIdentity::default(), cfg(TOKEN, 10_000)).unwrap();
    let at = h.addr();
    let member = thread::spawn(move || {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let me = l.local_addr().unwrap();
        let j = rendezvous::join(at, 0, 2, me, &cfg(TOKEN, 10_000)).unwrap();
        let tcp = TcpConfig {
            accept_joiners: true,
            ..TcpConfig::new(TOKEN)
        };
        let t = TcpTransport::connect(0, &j.peers, l, tcp).unwrap();
        let mut c = Communicator::new(t, CommConfig::default());
        let mut v = vec![1.0f32; 4];
        c.all_reduce_sum(&mut v).unwrap();
        let e = c.all_reduce_sum(&mut v).unwrap_err();
        c.regroup(&e.failed_ranks()).unwrap();
        let m = loop {
            if let Some(m) = c.admit().unwrap() {
                break m;
            }
            thread::sleep(Duration::from_millis(20));
        };
        let mut v = vec![1.0f32; 4];
        c.all_reduce_sum(&mut v).unwrap();
        (m.epoch, v[0])
    });
    let first = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let me = l.local_addr().unwrap();
        let j = rendezvous::join(at, 1, 2, me, &cfg(TOKEN, 10_000)).unwrap();
        let t = TcpTransport::connect(1, &j.peers, l, TcpConfig::new(TOKEN)).unwrap();
        let mut c = Communicator::new(t, CommConfig::default());
        let mut v = vec![1.0f32; 4];
        c.all_reduce_sum(&mut v).unwrap();
        j.peers
    };
    // Rank 1 is gone (its transport dropped). A stranger, then the newcomer.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let me = l.local_addr().unwrap();
    let e = rendezvous::join(at, 1, 2, me, &cfg(b"wrong", 2_000)).unwrap_err();
    assert!(e.to_string().contains("without an answer"), "{e}");
    let j = rendezvous::join(at, 1, 2, me, &cfg(TOKEN, 10_000)).unwrap();
    assert_eq!(j.peers[0], first[0]);
    assert_eq!(j.peers[1], me);
    let t = TcpTransport::join(1, &j.peers, l, TcpConfig::new(TOKEN)).unwrap();
    let mut c = Communicator::new(t, CommConfig::default());
    c.join(Duration::from_secs(20)).unwrap();
    let mut v = vec![1.0f32; 4];
    c.all_reduce_sum(&mut v).unwrap();
    assert_eq!(v[0], 2.0);
    assert_eq!(member.join().unwrap(), (2, 2.0));
    h.wait().unwrap();
}
