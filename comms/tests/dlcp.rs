//! `Communicator::dlcp_all_reduce` over the in-process transport: agreement between ranks,
//! equality with the ordinary sum without loss, error feedback across steps, late packets,
//! and bad input from a peer.

use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use dtrain_comms::dlcp::{DlcpConfig, DlcpReport, DlcpTensor, LossModel};
use dtrain_comms::wire::{Algo, Header, Kind, Message};
use dtrain_comms::{
    channel_mesh, ByteCount, ChannelTransport, CommConfig, CommError, Communicator, Transport,
    TransportError,
};

/// Rank `r`'s gradient of step `step`: deterministic, varied magnitudes.
fn grad(n: usize, r: usize, step: u64) -> Vec<f32> {
    let mut s = (r as u64 + 1) * 0x9E37_79B9 + step * 0x85EB_CA6B;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect()
}

fn layers(n: usize) -> Vec<DlcpTensor> {
    DlcpTensor::from_ends(&[n / 10, n / 3, n * 2 / 3, n], 0)
}

fn rank_order_sum(inputs: &[Vec<f32>]) -> Vec<f32> {
    (0..inputs[0].len())
        .map(|i| inputs.iter().fold(0.0f32, |acc, x| acc + x[i]))
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Runs `f` on every rank of an in-process mesh, one thread each.
fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(Communicator<ChannelTransport>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let hs: Vec<_> = channel_mesh(world)
        .into_iter()
        .map(|t| {
            let f = f.clone();
            thread::spawn(move || f(Communicator::new(t, CommConfig::default())))
        })
        .collect();
    hs.into_iter().map(|h| h.join().expect("rank")).collect()
}

#[test]
fn without_loss_every_rank_gets_the_rank_order_sum_and_all_reduce_agrees() {
    for world in 1..=6 {
        let n = 5_000;
        let out = on_ranks(world, move |mut c| {
            let mut g = grad(n, c.rank(), 0);
            let mut dense = g.clone();
            let cfg = DlcpConfig::default();
            let rep = c.dlcp_all_reduce(&mut g, &layers(n), &cfg).expect("dlcp");
            c.all_reduce_sum(&mut dense).expect("all-reduce");
            (g, dense, rep)
        });
        let want = rank_order_sum(&(0..world).map(|r| grad(n, r, 0)).collect::<Vec<_>>());
        for (r, (g, dense, rep)) in out.iter().enumerate() {
            assert_eq!(bits(g), bits(&want), "world {world} rank {r}");
            // The ring sums in another order: equal up to rounding.
            for (a, b) in g.iter().zip(dense) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
            }
            assert!(rep.dropped.is_empty() && rep.retransmitted == 0 && rep.lost == 0);
            assert_eq!(rep.packets_all, out[0].2.packets_all);
            if world > 1 {
                assert!(rep.bytes.sent > 0 && rep.sent == rep.packets);
            }
        }
    }
}

fn lossy(p_max: f64, seed: u64) -> DlcpConfig {
    DlcpConfig {
        p_max,
        mtu: 400,
        deadline: Duration::from_millis(30),
        retransmit_interval: Duration::from_millis(15),
        loss: LossModel {
            drop_prob: 0.03,
            delay_prob: 0.02,
            delay: Duration::from_millis(60),
            seed,
        },
        ..DlcpConfig::default()
    }
}

#[test]
fn with_loss_ranks_agree_the_drops_stay_bounded_and_reliable_mode_is_exact() {
    let (world, n) = (4, 20_000);
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| grad(n, r, 1)).collect();
    for p_max in [0.0, 0.1] {
        let out = on_ranks(world, move |mut c| {
            let mut g = grad(n, c.rank(), 1);
            let rep = c
                .dlcp_all_reduce(&mut g, &layers(n), &lossy(p_max, 7))
                .expect("dlcp");
            (g, rep)
        });
        for (g, _) in &out {
            assert_eq!(bits(g), bits(&out[0].0), "p_max {p_max}: replicas differ");
        }
        let lost: usize = out.iter().map(|(_, r)| r.lost + r.delayed).sum();
        assert!(lost > 0, "the loss model did nothing");
        // The result is the sum of the inputs with exactly the reported ranges zeroed.
        let mut zeroed = inputs.clone();
        for (r, (_, rep)) in out.iter().enumerate() {
            for range in &rep.dropped {
                zeroed[r][range.clone()].fill(0.0);
            }
        }
        assert_eq!(bits(&out[0].0), bits(&rank_order_sum(&zeroed)));
        let frac = out[0].1.dropped_fraction();
        if p_max == 0.0 {
            assert_eq!(frac, 0.0);
            assert!(out.iter().any(|(_, r)| r.retransmitted > 0));
        } else {
            assert!(frac > 0.0 && frac <= p_max, "dropped fraction {frac}");
        }
    }
}

#[test]
fn error_feedback_carries_the_dropped_mass_into_the_next_step() {
    let (world, n) = (3, 12_000);
    let out = on_ranks(world, move |mut c| {
        let r = c.rank();
        let mut residual = vec![0.0f32; n];
        let mut sums = Vec::new();
        let mut reps: Vec<DlcpReport> = Vec::new();
        for step in 0..2u64 {
            // Step 0 is lossy, step 1 is not: EF must deliver step 0's drops in step 1.
            let cfg = if step == 0 {
                lossy(0.2, 3)
            } else {
                DlcpConfig::default()
            };
            let mut g: Vec<f32> = grad(n, r, step)
                .iter()
                .zip(&residual)
                .map(|(a, b)| a + b)
                .collect();
            residual.fill(0.0);
            let rep = c.dlcp_all_reduce(&mut g, &layers(n), &cfg).expect("dlcp");
            rep.add_dropped_to(&mut residual);
            sums.push(g);
            reps.push(rep);
        }
        (sums, reps)
    });
    let (sums, reps) = &out[0];
    assert!(reps[0].dropped_fraction() > 0.0, "step 0 dropped nothing");
    assert_eq!(reps[1].dropped_fraction(), 0.0);
    let total: Vec<Vec<f32>> = (0..world)
        .map(|r| {
            grad(n, r, 0)
                .iter()
                .zip(grad(n, r, 1))
                .map(|(a, b)| a + b)
                .collect()
        })
        .collect();
    let want = rank_order_sum(&total);
    let step0_only = rank_order_sum(&(0..world).map(|r| grad(n, r, 0)).collect::<Vec<_>>());
    let mut max_err = 0.0f32;
    let mut max_lost = 0.0f32;
    for i in 0..n {
        max_err = max_err.max((sums[0][i] + sums[1][i] - want[i]).abs());
        max_lost = max_lost.max((sums[0][i] - step0_only[i]).abs());
    }
    assert!(max_lost > 0.1, "step 0 lost mass");
    assert!(
        max_err < 1e-5,
        "after step 1 the mass is restored (error {max_err})"
    );
}

/// Messages a test queues for a [`Tap`] to send, as (to, bytes).
type Injector = Arc<Mutex<Vec<(usize, Vec<u8>)>>>;

/// A transport that first sends whatever the test queued (to inject messages between or
/// before collectives).
struct Tap {
    inner: ChannelTransport,
    inject: Injector,
}

impl Tap {
    fn flush(&mut self) -> Result<(), TransportError> {
        let pending: Vec<_> = std::mem::take(&mut *self.inject.lock().unwrap());
        for (to, b) in pending {
            self.inner.send(to, b)?;
        }
        Ok(())
    }
}

impl Transport for Tap {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn send(&mut self, to: usize, msg: Vec<u8>) -> Result<(), TransportError> {
        self.flush()?;
        self.inner.send(to, msg)
    }
    fn recv(&mut self, deadline: Instant) -> Result<(usize, Vec<u8>), TransportError> {
        self.inner.recv(deadline)
    }
    fn recv_from(&mut self, from: usize, deadline: Instant) -> Result<Vec<u8>, TransportError> {
        self.inner.recv_from(from, deadline)
    }
    fn bytes(&self) -> ByteCount {
        self.inner.bytes()
    }
}

fn tapped(world: usize) -> Vec<(Communicator<Tap>, Injector)> {
    channel_mesh(world)
        .into_iter()
        .map(|t| {
            let inject: Injector = Arc::default();
            let tap = Tap {
                inner: t,
                inject: inject.clone(),
            };
            let cfg = CommConfig {
                timeout: Duration::from_secs(5),
                ..CommConfig::default()
            };
            (Communicator::new(tap, cfg), inject)
        })
        .collect()
}

/// A DLCP message (header only, `payload` after it) of collective `seq`.
fn dlcp_msg(seq: u64, phase: u8, n: usize, root: u32, payload: &[u8]) -> Vec<u8> {
    let h = Header {
        phase,
        step: 350,
        count: n as u64,
        root,
        ..Header::new(Kind::Dlcp, Algo::Direct, seq)
    };
    Message::new(h, payload).into_bytes()
}

#[test]
fn late_packets_of_an_earlier_round_are_ignored_by_later_collectives() {
    let n = 3_000;
    let hs: Vec<_> = tapped(3)
        .into_iter()
        .map(|(mut c, inject)| {
            thread::spawn(move || {
                let r = c.rank();
                let mut g = grad(n, r, 0);
                c.dlcp_all_reduce(&mut g, &layers(n), &DlcpConfig::default())
                    .expect("dlcp");
                if r == 1 {
                    // A (garbage) packet of round 0 arrives during collectives 1 and 2.
                    inject
                        .lock()
                        .unwrap()
                        .push((0, dlcp_msg(0, 0, n, 0, &[1, 2, 3])));
                }
                let mut v = vec![r as f32; 10];
                c.all_reduce_sum(&mut v)
                    .expect("all-reduce after a late DLCP packet");
                if r == 2 {
                    inject.lock().unwrap().push((0, dlcp_msg(0, 0, n, 0, &[])));
                }
                let mut g2 = grad(n, r, 1);
                c.dlcp_all_reduce(&mut g2, &layers(n), &DlcpConfig::default())
                    .expect("second dlcp");
                (v, g2)
            })
        })
        .collect();
    let want = rank_order_sum(&(0..3).map(|r| grad(n, r, 1)).collect::<Vec<_>>());
    for h in hs {
        let (v, g2) = h.join().unwrap();
        assert_eq!(v, vec![3.0; 10]);
        assert_eq!(bits(&g2), bits(&want));
    }
}

#[test]
fn a_corrupt_packet_is_reported_by_every_rank_naming_its_sender() {
    let n = 3_000;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("short packet", dlcp_msg(0, 0, n, 0, &[7; 10])),
        // A valid-looking header whose slot is out of range (36-byte packet, no body).
        ("slot out of range", {
            let mut p = vec![0u8; 36];
            p[24..28].copy_from_slice(&100_000u32.to_le_bytes());
            p[32..34].copy_from_slice(&1u16.to_le_bytes());
            dlcp_msg(0, 0, n, 0, &p)
        }),
        ("wrong round", {
            let mut p = vec![0u8; 36];
            p[0] = 9;
            dlcp_msg(0, 0, n, 0, &p)
        }),
        (
            "NACK out of range",
            dlcp_msg(0, 1, n, 1, &u32::MAX.to_le_bytes()),
        ),
    ];
    for (what, bad) in cases {
        let hs: Vec<_> = tapped(3)
            .into_iter()
            .map(|(mut c, inject)| {
                let bad = bad.clone();
                thread::spawn(move || {
                    if c.rank() == 1 {
                        inject.lock().unwrap().push((0, bad));
                    }
                    let mut g = grad(n, c.rank(), 0);
                    let start = Instant::now();
                    let r = c.dlcp_all_reduce(&mut g, &layers(n), &DlcpConfig::default());
                    (r, start.elapsed())
                })
            })
            .collect();
        for (r, h) in hs.into_iter().enumerate() {
            let (res, took) = h.join().unwrap();
            match res {
                Err(e @ (CommError::Protocol { .. } | CommError::Mismatch { .. })) => {
                    assert_eq!(e.failed_ranks(), vec![1], "{what}, rank {r}: {e}")
                }
                // Rank 1 itself may finish its part before the abort reaches it.
                Ok(_) if r == 1 => {}
                other => panic!("{what}, rank {r}: {other:?}"),
            }
            assert!(took < Duration::from_secs(4), "{what}: rank {r} hung");
        }
    }
}

#[test]
fn invalid_arguments_are_rejected_before_sending() {
    let out = on_ranks(2, |mut c| {
        let mut g = vec![1.0f32; 100];
        let gap = vec![
            DlcpTensor {
                range: 0..50,
                layer: 0,
            },
            DlcpTensor {
                range: 60..100,
                layer: 1,
            },
        ];
        let e1 = c.dlcp_all_reduce(&mut g, &gap, &DlcpConfig::default());
        let bad = DlcpConfig {
            p_max: -0.1,
            ..DlcpConfig::default()
        };
        let e2 = c.dlcp_all_reduce(&mut g, &[], &bad);
        // The communicator is still usable.
        let ok = c.dlcp_all_reduce(&mut g, &[], &DlcpConfig::default());
        (e1, e2, ok.map(|_| g[0]))
    });
    for (e1, e2, ok) in out {
        assert!(matches!(e1, Err(CommError::InvalidArgument(_))));
        assert!(matches!(e2, Err(CommError::InvalidArgument(_))));
        assert_eq!(ok.unwrap(), 2.0);
    }
}

/// The same over TCP on 127.0.0.1 with a shaped link: the timers (deadline, held packets,
/// NACK interval) run in real time and replicas still agree bit for bit.
#[cfg(feature = "tcp")]
#[test]
fn over_shaped_tcp_replicas_agree_and_the_drops_reconstruct_the_result() {
    use dtrain_comms::shaping::LinkSpec;
    use dtrain_comms::{TcpConfig, TcpTransport};
    use std::net::TcpListener;

    let (world, n) = (3, 30_000);
    let ls: Vec<TcpListener> = (0..world)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<_> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    let hs: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let addrs = addrs.clone();
            thread::spawn(move || {
                let mut cfg = TcpConfig::new(b"dlcp-test".to_vec());
                cfg.link = LinkSpec::parse(Some("1Gbit"), Some("200us")).unwrap();
                let t = TcpTransport::connect(r, &addrs, l, cfg).unwrap();
                let mut c = Communicator::new(t, CommConfig::default());
                let mut out = Vec::new();
                for (step, p_max) in [(2u64, 0.05), (3, 0.0)] {
                    let mut g = grad(n, r, step);
                    let rep = c
                        .dlcp_all_reduce(&mut g, &layers(n), &lossy(p_max, step))
                        .expect("dlcp over tcp");
                    out.push((g, rep));
                }
                out
            })
        })
        .collect();
    let per_rank: Vec<Vec<(Vec<f32>, DlcpReport)>> =
        hs.into_iter().map(|h| h.join().unwrap()).collect();
    for (i, step) in [2u64, 3].into_iter().enumerate() {
        let mut zeroed: Vec<Vec<f32>> = (0..world).map(|r| grad(n, r, step)).collect();
        for (r, runs) in per_rank.iter().enumerate() {
            assert_eq!(
                bits(&runs[i].0),
                bits(&per_rank[0][i].0),
                "step {step} rank {r}"
            );
            for range in &runs[i].1.dropped {
                zeroed[r][range.clone()].fill(0.0);
            }
        }
        assert_eq!(bits(&per_rank[0][i].0), bits(&rank_order_sum(&zeroed)));
    }
    // The reliable step lost packets and still delivered everything.
    let reliable = &per_rank[0][1].1;
    assert_eq!(reliable.dropped_fraction(), 0.0);
    assert!(
        per_rank
            .iter()
            .map(|r| r[1].1.lost + r[1].1.delayed)
            .sum::<usize>()
            > 0
    );
}
