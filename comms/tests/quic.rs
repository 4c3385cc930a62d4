//! What only the QUIC driver has: MTUs beyond quinn's defaults, and the pinned run
//! certificate. Everything QUIC shares with the other drivers is in the conformance suite
//! (`conformance.rs`).

#![cfg(feature = "quic")]

mod common;

use std::net::UdpSocket;
use std::thread;
use std::time::{Duration, Instant};

use common::quic::{config, sockets, try_mesh, TOKEN};
use common::*;
use dtrain_comms::rendezvous::RunIdentity;
use dtrain_comms::{CommConfig, QuicTransport, ReduceOp, Transport, TransportError};

#[test]
fn large_mtus_connect_and_carry_large_frames() {
    // Above ~6.5 kB quinn's 10-segment GSO batches exceed a datagram and are lost, and from
    // ~12 kB its default initial congestion window lets no packet out: without the driver's
    // segment cap and initial window these stall (set-up or transfer time out).
    let n = 1 << 20;
    let inputs: Vec<Vec<f32>> = (0..2).map(|r| Rng(7 + r as u64).f32s(n)).collect();
    let want = ring_reference(&inputs, ReduceOp::Sum);
    for mtu in [8_000u16, 12_000, 30_000, 60_000] {
        let id = RunIdentity::generate().unwrap();
        let mut cfg = config(TOKEN, id);
        cfg.mtu = Some(mtu);
        cfg.connect_timeout = Duration::from_secs(5);
        let mesh: Vec<QuicTransport> = try_mesh(vec![cfg; 2])
            .into_iter()
            .map(|t| t.unwrap_or_else(|e| panic!("MTU {mtu}: set-up failed: {e}")))
            .collect();
        let ins = inputs.clone();
        let cc = CommConfig {
            timeout: Duration::from_secs(5),
            ..CommConfig::default()
        };
        let out = run_ranks(mesh, cc, move |c| {
            let mut v = ins[c.rank()].clone();
            for _ in 0..3 {
                v.copy_from_slice(&ins[c.rank()]);
                c.all_reduce_sum(&mut v)
                    .unwrap_or_else(|e| panic!("MTU {mtu}: {e}"));
            }
            v
        });
        for v in &out {
            assert_eq!(bits(v), bits(&want), "MTU {mtu}");
        }
    }
}

fn short(mut c: dtrain_comms::QuicConfig) -> dtrain_comms::QuicConfig {
    c.connect_timeout = Duration::from_millis(1500);
    c
}

#[test]
fn peer_with_a_different_certificate_is_refused() {
    // Right token, but rank 0 serves a certificate that is not the one rank 1 pins.
    let r = try_mesh(vec![
        short(config(TOKEN, RunIdentity::generate().unwrap())),
        short(config(TOKEN, RunIdentity::generate().unwrap())),
    ]);
    match &r[1] {
        Err(TransportError::Handshake { peer, detail }) => {
            assert!(peer.contains("rank 0"), "{peer}");
            assert!(detail.contains("TLS"), "{detail}");
        }
        other => panic!("rank 1: expected a TLS failure, got {other:?}"),
    }
    match &r[0] {
        Err(TransportError::Handshake { peer, .. }) => assert!(peer.contains("[1]"), "{peer}"),
        other => panic!("rank 0: expected a handshake timeout, got {other:?}"),
    }
}

#[test]
fn intruder_with_another_certificate_does_not_block_the_mesh() {
    // A stranger with its own certificate dials rank 0 while the real mesh forms: it is
    // refused (its hello never comes through TLS it cannot complete against our pin, and
    // rank 0 never counts it), and ranks 0 and 1 still connect and talk.
    let id = RunIdentity::generate().unwrap();
    let (mut ss, addrs) = sockets(2);
    let s1 = ss.pop().unwrap();
    let s0 = ss.pop().unwrap();
    let (a0, a1) = (addrs.clone(), addrs.clone());
    let c0 = config(TOKEN, id.clone());
    let h0 = thread::spawn(move || QuicTransport::connect(0, &a0, s0, c0));
    // The intruder claims rank 1 with the right token but its own certificate: as a client
    // it pins its own certificate, so the TLS handshake with rank 0 fails on its side.
    let intruder_sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let fake = vec![addrs[0], intruder_sock.local_addr().unwrap()];
    let mut ic = config(TOKEN, RunIdentity::generate().unwrap());
    ic.connect_timeout = Duration::from_millis(800);
    let intruder = QuicTransport::connect(1, &fake, intruder_sock, ic);
    assert!(intruder.is_err(), "the intruder connected");
    let mut t1 = QuicTransport::connect(1, &a1, s1, config(TOKEN, id)).unwrap();
    let mut t0 = h0.join().unwrap().unwrap();
    t1.send(0, b"hi".to_vec()).unwrap();
    let (from, msg) = t0.recv(Instant::now() + Duration::from_secs(5)).unwrap();
    assert_eq!((from, msg.as_slice()), (1, &b"hi"[..]));
}

/// Live membership over QUIC: rank 2 of 3 dies; the survivors regroup; a newcomer with a
/// socket of its own joins as rank 2 (dialing ranks 0 and 1, whose endpoints keep
/// accepting), is admitted and welcomed, and the three run collectives again. A stranger
/// with another certificate is refused by TLS and never offered as a joiner.
#[test]
fn a_newcomer_takes_a_lost_ranks_place_over_quic() {
    let id = RunIdentity::generate().unwrap();
    let (ss, addrs) = sockets(3);
    let live = |id: RunIdentity| dtrain_comms::QuicConfig {
        accept_joiners: true,
        connect_timeout: Duration::from_secs(2),
        ..config(TOKEN, id)
    };
    let members = ss
        .into_iter()
        .enumerate()
        .map(|(r, s)| {
            let (addrs, cfg) = (addrs.clone(), live(id.clone()));
            Box::new(move || QuicTransport::connect(r, &addrs, s, cfg).unwrap())
                as Box<dyn FnOnce() -> QuicTransport + Send>
        })
        .collect();
    let newcomer =
        |id| QuicTransport::join(2, &addrs, UdpSocket::bind("127.0.0.1:0").unwrap(), live(id));
    // A stranger with another certificate, claiming rank 2: TLS refuses it.
    let stranger = || {
        let other = RunIdentity::generate().unwrap();
        assert!(newcomer(other).is_err(), "a stranger joined");
    };
    a_newcomer_takes_a_lost_ranks_place(members, stranger, || newcomer(id).unwrap());
}
