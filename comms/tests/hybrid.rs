//! What only the hybrid driver has (shared memory within a host, TCP across): which bytes
//! cross between hosts, the host keys of set-up, a receiver asleep on its rings woken by a
//! message from another host, and lost peers reported once, by whichever driver carries
//! them. The collectives themselves run in the conformance suite (`conformance.rs`, module
//! `hybrid`).

#![cfg(all(feature = "tcp", feature = "shm", target_os = "linux"))]

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::hybrid::{configs, mesh, try_mesh};
use common::*;
use dtrain_comms::topology::Topology;
use dtrain_comms::transport::hybrid::HybridTransport;
use dtrain_comms::{CommConfig, Communicator, Transport, TransportError};

fn secs(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

/// Runs `f` on every rank of `ts` (one thread each) and returns the ranks' results.
fn on_each<T: Send>(ts: Vec<HybridTransport>, f: impl Fn(HybridTransport) -> T + Sync) -> Vec<T> {
    thread::scope(|s| {
        let hs: Vec<_> = ts.into_iter().map(|t| s.spawn(|| f(t))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn every_rank_learns_the_hosts_from_the_keys() {
    let ts = mesh(5, 2);
    let want = Topology::from_keys(&["a", "a", "b", "b", "c"]);
    for t in &ts {
        assert_eq!(t.topology(), &want, "rank {}", t.rank());
    }
}

/// The hierarchical all-reduce over hosts {0, 1} and {2, 3}: the non-leaders send and
/// receive nothing over TCP, and each leader sends over TCP exactly what a two-rank flat
/// all-reduce of the same buffer sends; the host-local stages went through shared memory.
#[test]
fn only_the_leaders_all_reduce_crosses_between_hosts() {
    let n = 100_000;
    let inputs: Vec<Vec<f32>> = (0..4).map(|r| Rng(40 + r).f32s(n)).collect();
    let topo = Topology::from_nodes(4, 2).unwrap();
    let out = on_each(mesh(4, 2), |t| {
        let r = t.rank();
        let before = (t.network_bytes(), t.bytes());
        let mut c = Communicator::new(t, CommConfig::default());
        let mut v = inputs[r].clone();
        c.hierarchical_all_reduce_sum(&mut v, &topo).unwrap();
        let t = c.transport();
        (v, t.network_bytes() - before.0, t.bytes() - before.1)
    });
    let flat = {
        let ts = tcp::mesh(2);
        let sent: Vec<u64> = thread::scope(|s| {
            let hs: Vec<_> = ts
                .into_iter()
                .enumerate()
                .map(|(l, t)| {
                    let v = inputs[2 * l].clone();
                    s.spawn(move || {
                        let mut c = Communicator::new(t, CommConfig::default());
                        let mut v = v;
                        c.all_reduce_sum(&mut v).unwrap();
                        c.last_bytes().sent
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        sent
    };
    let want = hierarchical_reference(&inputs, &topo, false);
    for (r, (v, net, all)) in out.iter().enumerate() {
        assert_eq!(bits(v), bits(&want), "rank {r}");
        if r % 2 == 1 {
            assert_eq!(
                (net.sent, net.received),
                (0, 0),
                "rank {r} used the network"
            );
        } else {
            assert_eq!(net.sent, flat[r / 2], "leader {r}");
        }
        assert!(
            all.sent > net.sent,
            "rank {r}: nothing went through shared memory"
        );
    }
}

/// A receiver waiting on its rings (liveness checks a minute apart, so only the doorbell
/// can wake it early) gets a message from another host at once.
#[test]
fn a_message_from_another_host_wakes_a_receiver_asleep_on_shared_memory() {
    let cfgs = configs(4, 2)
        .into_iter()
        .map(|(t, mut s, k)| {
            s.liveness_interval = Duration::from_secs(60);
            s.spin = Some(Duration::ZERO);
            (t, s, k)
        })
        .collect();
    let ts: Vec<HybridTransport> = try_mesh(cfgs).into_iter().map(Result::unwrap).collect();
    let took = on_each(ts, |mut t| match t.rank() {
        0 => {
            let start = Instant::now();
            let (from, m) = t.recv(secs(30)).unwrap();
            assert_eq!((from, m), (2, b"across".to_vec()));
            let took = start.elapsed();
            // And one from the host mate, through the rings.
            assert_eq!(t.recv_from(1, secs(30)).unwrap(), b"beside".to_vec());
            Some(took)
        }
        1 => {
            thread::sleep(Duration::from_millis(1500));
            t.send(0, b"beside".to_vec()).unwrap();
            thread::sleep(Duration::from_millis(500));
            None
        }
        2 => {
            thread::sleep(Duration::from_millis(300));
            t.send(0, b"across".to_vec()).unwrap();
            thread::sleep(Duration::from_millis(2000));
            None
        }
        _ => {
            thread::sleep(Duration::from_millis(2000));
            None
        }
    });
    let took = took[0].unwrap();
    assert!(
        took < Duration::from_secs(5),
        "the TCP message waited {took:?} for a shared-memory wake-up"
    );
}

/// Rank 1 (host mate of rank 0) and rank 3 (the other host) leave: rank 0 hears of each
/// exactly once, after their last messages, in global ranks.
#[test]
fn lost_peers_are_reported_once_whichever_driver_carries_them() {
    let out = on_each(mesh(4, 2), |mut t| match t.rank() {
        0 => {
            let mut got = Vec::new();
            loop {
                match t.recv(secs(3)) {
                    Ok((from, m)) => got.push(format!("{from}: {}", String::from_utf8(m).unwrap())),
                    Err(TransportError::Timeout) => break,
                    Err(e) => got.push(format!("lost {}", e.lost_peer().unwrap().0)),
                }
            }
            let again = t.recv_from(1, secs(1)).unwrap_err();
            assert!(
                matches!(again, TransportError::Closed { rank: 1 }),
                "{again}"
            );
            got.sort();
            got
        }
        1 | 3 => {
            t.send(0, b"bye".to_vec()).unwrap();
            Vec::new()
        }
        _ => {
            thread::sleep(Duration::from_secs(4));
            Vec::new()
        }
    });
    assert_eq!(out[0], ["1: bye", "3: bye", "lost 1", "lost 3"]);
}

#[test]
fn a_rank_that_sends_no_host_key_is_named() {
    // Rank 1 is a plain TCP rank: its first message is not a host key.
    let (ls, addrs) = tcp::listeners(2);
    let mut ls = ls.into_iter();
    let (l0, l1) = (ls.next().unwrap(), ls.next().unwrap());
    let cfgs = configs(2, 2);
    let (tcfg, scfg, key) = cfgs[0].clone();
    let a0 = addrs.clone();
    let h0 = thread::spawn(move || HybridTransport::connect(0, &a0, l0, tcfg, scfg, &key));
    let mut plain =
        dtrain_comms::TcpTransport::connect(1, &addrs, l1, tcp::config(tcp::TOKEN)).unwrap();
    plain.send(0, b"hello".to_vec()).unwrap();
    let e = h0.join().unwrap().unwrap_err();
    let s = e.to_string();
    assert!(s.contains("rank 1") && s.contains("host key"), "{s}");
}

/// A shared-memory directory that cannot hold the rings: the hosts' ranks agree to talk
/// over TCP, and the collectives still work (everything crossed the network).
#[test]
fn without_room_for_the_rings_a_host_talks_over_tcp() {
    let cfgs = configs(4, 2)
        .into_iter()
        .map(|(t, mut s, k)| {
            s.dir = "/nonexistent/dtrain-hybrid-test".into();
            (t, s, k)
        })
        .collect();
    let ts: Vec<HybridTransport> = try_mesh(cfgs).into_iter().map(Result::unwrap).collect();
    let inputs: Vec<Vec<f32>> = (0..4).map(|r| Rng(90 + r).f32s(1000)).collect();
    let topo = Topology::from_nodes(4, 2).unwrap();
    let out = on_each(ts, |t| {
        let r = t.rank();
        let mut c = Communicator::new(t, CommConfig::default());
        let mut v = inputs[r].clone();
        c.hierarchical_all_reduce_sum(&mut v, &topo).unwrap();
        let t = c.transport();
        (v, t.network_bytes(), t.bytes())
    });
    let want = hierarchical_reference(&inputs, &topo, false);
    for (r, (v, net, all)) in out.iter().enumerate() {
        assert_eq!(bits(v), bits(&want), "rank {r}");
        assert_eq!(net, all, "rank {r} used shared memory");
    }
}

/// Live membership over the hybrid driver: of two hosts of two ranks, rank 3 is lost; a
/// newcomer takes its place over TCP alone (`HybridTransport::join`), the three admit it,
/// and its host mate, rank 2, reaches it over TCP now instead of the old rings: the four
/// run collectives again, and the newcomer's later loss is reported once, by TCP.
#[test]
fn a_newcomer_replaces_a_lost_host_mate_over_tcp() {
    let mut cfgs = configs(4, 2);
    for c in &mut cfgs {
        c.0.accept_joiners = true;
    }
    let (ls, addrs) = common::tcp::listeners(4);
    let ts: Vec<HybridTransport> = connect_each(ls, addrs.clone(), cfgs, |r, p, l, (t, s, k)| {
        HybridTransport::connect(r, p, l, t, s, &k)
    })
    .into_iter()
    .map(|t| t.expect("mesh set-up"))
    .collect();
    let cc = || CommConfig {
        timeout: Duration::from_secs(10),
        ..CommConfig::default()
    };
    let sums = |c: &mut Communicator<HybridTransport>| {
        let mut v = vec![c.members()[c.rank()] as f32 + 1.0; 20_000];
        c.all_reduce_sum(&mut v).map(|()| v[0])
    };
    let members: Vec<_> = ts
        .into_iter()
        .map(|t| {
            thread::spawn(move || {
                let mut c = Communicator::new(t, cc());
                assert_eq!(sums(&mut c).unwrap(), 10.0);
                if c.rank() == 3 {
                    return None;
                }
                let e = sums(&mut c).unwrap_err();
                c.regroup(&e.failed_ranks()).unwrap();
                assert_eq!(sums(&mut c).unwrap(), 6.0);
                let m = loop {
                    if let Some(m) = c.admit().unwrap() {
                        break m;
                    }
                    thread::sleep(Duration::from_millis(10));
                };
                let after = sums(&mut c).unwrap();
                // The newcomer leaves: its loss is TCP's, reported once.
                let gone = sums(&mut c).unwrap_err();
                Some((m.added, after, gone.failed_ranks()))
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(500));
    let (l, _) = common::tcp::listeners(1);
    let mut tcp = common::tcp::config(common::tcp::TOKEN);
    tcp.accept_joiners = true;
    let t = HybridTransport::join(3, &addrs, l.into_iter().next().unwrap(), tcp).unwrap();
    assert_eq!(t.topology(), &Topology::one_per_host(4));
    let mut c = Communicator::new(t, cc());
    let m = c.join(Duration::from_secs(20)).unwrap();
    assert_eq!((m.members, m.rank), (vec![0, 1, 2, 3], 3));
    assert_eq!(sums(&mut c).unwrap(), 10.0);
    drop(c);
    for h in members.into_iter().take(3) {
        assert_eq!(h.join().unwrap(), Some((vec![3], 10.0, vec![3])));
    }
}
