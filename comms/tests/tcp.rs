//! What only the TCP driver has: strangers dialing while the mesh forms, and a peer that
//! says hello and then never a byte. Everything TCP shares with the other drivers is in
//! the conformance suite (`conformance.rs`).

#![cfg(feature = "tcp")]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use common::a_newcomer_takes_a_lost_ranks_place;
use common::tcp::{config, listeners, TOKEN};
use dtrain_comms::frame::Hello;
use dtrain_comms::{TcpTransport, Transport};

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

/// Live membership over TCP: rank 2 of 3 dies; the survivors regroup; a newcomer with a
/// listener of its own joins as rank 2 (dialing ranks 0 and 1, whose listeners stay open),
/// is admitted and welcomed, and the three run collectives again. A stranger claiming a
/// rank with the wrong token is refused and never offered as a joiner.
#[test]
fn a_newcomer_takes_a_lost_ranks_place_over_tcp() {
    let (ls, addrs) = listeners(3);
    let members = ls
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let addrs = addrs.clone();
            Box::new(move || {
                let mut cfg = config(TOKEN);
                cfg.accept_joiners = true;
                TcpTransport::connect(r, &addrs, l, cfg).unwrap()
            }) as Box<dyn FnOnce() -> TcpTransport + Send>
        })
        .collect();
    // A stranger with the wrong token claiming rank 2.
    let stranger = || {
        let mut wrong = TcpStream::connect(addrs[0]).unwrap();
        let hello = Hello {
            rank: 2,
            world: 3,
            token: b"guess".to_vec(),
        };
        wrong.write_all(&hello.encode()).unwrap();
    };
    let join = || {
        let (l, _) = listeners(1);
        let l = l.into_iter().next().unwrap();
        TcpTransport::join(2, &addrs, l, config(TOKEN)).unwrap()
    };
    a_newcomer_takes_a_lost_ranks_place(members, stranger, join);
}

/// The collectives' config of the live-membership tests below.
fn live_comm() -> dtrain_comms::CommConfig {
    dtrain_comms::CommConfig {
        timeout: Duration::from_secs(10),
        ..dtrain_comms::CommConfig::default()
    }
}

/// A TCP config that accepts newcomers, dialing each peer for at most 2 s.
fn live_tcp() -> dtrain_comms::TcpConfig {
    let mut cfg = config(TOKEN);
    cfg.accept_joiners = true;
    cfg.connect_timeout = Duration::from_secs(2);
    cfg
}

/// A member's result in the tests below: the newcomers of each admission, the sum after.
type Member = thread::JoinHandle<Option<(Vec<Vec<usize>>, f32)>>;

/// A 4-rank TCP mesh accepting newcomers whose ranks 2 and 3 leave after one all-reduce;
/// ranks 0 and 1 regroup, then run `then` (their result in the handles, by rank). The
/// mesh's addresses.
fn two_lost_of_four(
    then: fn(&mut dtrain_comms::Communicator<TcpTransport>, usize) -> Vec<Vec<usize>>,
) -> (Vec<std::net::SocketAddr>, Vec<Member>) {
    let (ls, addrs) = listeners(4);
    let hs = ls
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let addrs = addrs.clone();
            thread::spawn(move || {
                let t = TcpTransport::connect(r, &addrs, l, live_tcp()).unwrap();
                let mut c = dtrain_comms::Communicator::new(t, live_comm());
                let mut v = vec![1.0f32; 1000];
                c.all_reduce_sum(&mut v).unwrap();
                if r >= 2 {
                    return None;
                }
                let e = c.all_reduce_sum(&mut v).unwrap_err();
                c.regroup(&e.failed_ranks()).unwrap();
                let added = then(&mut c, r);
                Some((added, sum_of_ranks(&mut c)))
            })
        })
        .collect();
    (addrs, hs)
}

/// All-reduces (transport rank + 1) over the group; the sum.
fn sum_of_ranks(c: &mut dtrain_comms::Communicator<TcpTransport>) -> f32 {
    let mut v = vec![c.members()[c.rank()] as f32 + 1.0; 50_000];
    c.all_reduce_sum(&mut v).unwrap();
    assert_eq!(v[0], v[49_999]);
    v[0]
}

/// Two newcomers over TCP admitted together, as when a node's workers come back: the
/// earlier one (2) knew only rank 3's lost address, the later one (3) dialed 2's new one
/// while 2 was still dialing the dead address. On their welcome, 2 takes the connection 3
/// made (`Transport::link_member`), and the four run collectives again.
#[test]
fn two_newcomers_admitted_together_over_tcp_link_to_each_other() {
    let (addrs, hs) = two_lost_of_four(|c, _| {
        while c.waiting_joiners().len() < 2 {
            thread::sleep(Duration::from_millis(10));
        }
        vec![c.admit().unwrap().expect("both newcomers waiting").added]
    });
    thread::sleep(Duration::from_millis(500));
    let (l, new) = listeners(2);
    let mut now = addrs.clone();
    now[2] = new[0];
    let joiners: Vec<_> = l
        .into_iter()
        .zip([(2, addrs.clone()), (3, now)])
        .map(|(l, (r, peers))| {
            let h = thread::spawn(move || {
                let t = TcpTransport::join(r, &peers, l, live_tcp()).unwrap();
                let mut c = dtrain_comms::Communicator::new(t, live_comm());
                let m = c.join(Duration::from_secs(20)).unwrap();
                Some((vec![m.added], sum_of_ranks(&mut c)))
            });
            thread::sleep(Duration::from_millis(50));
            h
        })
        .collect();
    for h in hs.into_iter().take(2).chain(joiners) {
        assert_eq!(h.join().unwrap(), Some((vec![vec![2, 3]], 10.0)));
    }
}

/// A relay to `to` on loopback that lets each connection through only after `delay`: a
/// slow route to a member.
fn slow_relay(to: std::net::SocketAddr, delay: Duration) -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    thread::spawn(move || {
        for near in l.incoming().map_while(Result::ok) {
            thread::spawn(move || {
                thread::sleep(delay);
                let Ok(far) = TcpStream::connect(to) else {
                    return;
                };
                let pipe = |mut from: TcpStream, mut to: TcpStream| {
                    thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    })
                };
                pipe(near.try_clone().unwrap(), far.try_clone().unwrap());
                pipe(far, near);
            });
        }
    });
    at
}

/// Two newcomers, the later one (3) admitted first: the earlier one's (2) route to the
/// members is slow, so they see 3 first. 3 dialed 2 (it knew 2's new address; 2 knew only
/// 3's predecessor's), so 3, now a member, reports 2 as waiting over that connection, the
/// group admits 2, and 2 takes 3's connection as its link (`Transport::link_member`).
#[test]
fn a_newcomer_admitted_before_an_earlier_one_reports_it() {
    let (addrs, hs) = two_lost_of_four(|c, _| admit_all(c));
    thread::sleep(Duration::from_millis(500));
    let (l, new) = listeners(2);
    let mut l = l.into_iter();
    let mut slow = addrs.clone();
    slow[0] = slow_relay(addrs[0], Duration::from_millis(1500));
    slow[1] = slow_relay(addrs[1], Duration::from_millis(1500));
    let (l2, l3) = (l.next().unwrap(), l.next().unwrap());
    let join = |r: usize, peers: Vec<std::net::SocketAddr>, l| {
        let t = TcpTransport::join(r, &peers, l, live_tcp()).unwrap();
        let mut c = dtrain_comms::Communicator::new(t, live_comm());
        let m = c.join(Duration::from_secs(20)).unwrap();
        (c, m.added)
    };
    let earlier = thread::spawn(move || {
        let (mut c, added) = join(2, slow, l2);
        (added, sum_of_ranks(&mut c))
    });
    thread::sleep(Duration::from_millis(100));
    let mut now = addrs.clone();
    now[2] = new[0];
    let later = thread::spawn(move || {
        let (mut c, added) = join(3, now, l3);
        let then = admit_all(&mut c);
        (added, then, sum_of_ranks(&mut c))
    });
    assert_eq!(earlier.join().unwrap(), (vec![2], 10.0));
    assert_eq!(later.join().unwrap(), (vec![3], vec![vec![2]], 10.0));
    for h in hs.into_iter().take(2) {
        assert_eq!(h.join().unwrap(), Some((vec![vec![3], vec![2]], 10.0)));
    }
}

/// Admits until the group has all four, as one of its members; the newcomers of each
/// admission.
fn admit_all(c: &mut dtrain_comms::Communicator<TcpTransport>) -> Vec<Vec<usize>> {
    let t = Instant::now();
    let mut added = Vec::new();
    while c.members().len() < 4 {
        assert!(t.elapsed() < Duration::from_secs(20), "admitted {added:?}");
        match c.admit().unwrap() {
            Some(m) => added.push(m.added),
            None => thread::sleep(Duration::from_millis(10)),
        }
    }
    added
}
