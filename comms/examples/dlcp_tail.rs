//! DLCP tail latency: per-round time of `Communicator::dlcp_all_reduce` for several loss
//! bounds `p_max` under emulated bandwidth, packet loss and straggling packets, over TCP on
//! 127.0.0.1 (one thread per rank, each with its own `TcpTransport`).
//!
//! ```text
//! cargo run --release -p dtrain-comms --example dlcp_tail --
//!     [--ranks 4] [--n 64K] [--layers 8] [--rounds 100] [--bandwidth 1Gbit] [--latency 500us]
//!     [--drop 0.0002] [--tail-prob 0.0002] [--tail-delay 50ms] [--deadline 8ms]
//!     [--retransmit 4ms] [--mtu 1400] [--p-max 0,0.01,0.05] [--seed 1]
//! ```
//!
//! Emulation: bandwidth and latency shape every rank's egress in the TCP driver
//! (`TcpConfig::link`, see `dtrain_comms::shaping`); loss and tail are DLCP's
//! `LossModel`, applied by each sender to every data packet it transmits: a packet is lost
//! with probability `--drop`, or held back by `--tail-delay` with probability
//! `--tail-prob` (a straggling packet). Fates are seeded and depend on the round, sender,
//! owner, slot and attempt, so every `p_max` sees the same first-transmission fates (each
//! `p_max` runs on a fresh mesh, rounds numbered alike).
//!
//! Each round: a barrier, then every rank times one `dlcp_all_reduce` of an `n`-element
//! gradient cut into `--layers` equal layers; the round's time is the slowest rank's (the
//! step waits for it). Printed: p50 / p95 / p99 / max / mean of the round time, the mean
//! fraction of gradient elements dropped (over all ranks' contributions), retransmitted
//! packets and NACK rounds per round, and bytes sent per rank per round. A ring
//! `all_reduce_sum` over the same shaped links (no loss: TCP is reliable) is the reference
//! row. `p_max = 0` is DLCP as a reliable transport: it waits for every packet, NACKing
//! what is missing at the deadline and every `--retransmit` after.

use std::net::{SocketAddr, TcpListener};
use std::thread;
use std::time::{Duration, Instant};

use dtrain_comms::dlcp::{DlcpConfig, DlcpTensor, LossModel};
use dtrain_comms::shaping::{parse_duration, LinkSpec};
use dtrain_comms::{CommConfig, Communicator, TcpConfig, TcpTransport};

mod common;
use common::parse_size;

#[derive(Clone)]
struct Opts {
    ranks: usize,
    n: usize,
    layers: usize,
    rounds: usize,
    bandwidth: String,
    latency: String,
    drop: f64,
    tail_prob: f64,
    tail_delay: Duration,
    deadline: Duration,
    retransmit: Duration,
    mtu: usize,
    p_max: Vec<f64>,
    seed: u64,
}

fn parse_opts() -> Opts {
    let mut o = Opts {
        ranks: 4,
        n: 64 << 10,
        layers: 8,
        rounds: 100,
        bandwidth: "1Gbit".into(),
        latency: "500us".into(),
        drop: 0.0002,
        tail_prob: 0.0002,
        tail_delay: Duration::from_millis(50),
        deadline: Duration::from_millis(8),
        retransmit: Duration::from_millis(4),
        mtu: 1400,
        p_max: vec![0.0, 0.01, 0.05],
        seed: 1,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    let dur = |v: &str| parse_duration(v).expect("duration");
    while let Some(a) = it.next() {
        let v = it.next().expect("option value");
        match a.as_str() {
            "--ranks" => o.ranks = v.parse().expect("ranks"),
            "--n" => o.n = parse_size(v),
            "--layers" => o.layers = v.parse().expect("layers"),
            "--rounds" => o.rounds = v.parse().expect("rounds"),
            "--bandwidth" => o.bandwidth = v.clone(),
            "--latency" => o.latency = v.clone(),
            "--drop" => o.drop = v.parse().expect("drop"),
            "--tail-prob" => o.tail_prob = v.parse().expect("tail-prob"),
            "--tail-delay" => o.tail_delay = dur(v),
            "--deadline" => o.deadline = dur(v),
            "--retransmit" => o.retransmit = dur(v),
            "--mtu" => o.mtu = v.parse().expect("mtu"),
            "--p-max" => o.p_max = v.split(',').map(|x| x.parse().expect("p_max")).collect(),
            "--seed" => o.seed = v.parse().expect("seed"),
            other => panic!("unknown option {other}"),
        }
    }
    o
}

/// Rank `r`'s gradient of round `round`: layer `l` has magnitudes around `1 / (l + 1)`.
fn gradient(o: &Opts, r: usize, round: usize, out: &mut [f32]) {
    let mut s = (r as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (round as u64 + 7);
    let per = o.n.div_ceil(o.layers);
    for (i, v) in out.iter_mut().enumerate() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        *v = u / (i / per + 1) as f32;
    }
}

/// One rank's measurements of one round.
#[derive(Clone, Copy, Default)]
struct Round {
    secs: f64,
    dropped_elems: usize,
    elems: usize,
    retransmitted: usize,
    nack_rounds: usize,
    sent_bytes: u64,
}

/// `None` = the ring all-reduce reference.
fn rank_main(c: &mut Communicator<TcpTransport>, o: &Opts, p_max: Option<f64>) -> Vec<Round> {
    let r = c.rank();
    let ends: Vec<usize> = (1..=o.layers)
        .map(|l| (l * o.n.div_ceil(o.layers)).min(o.n))
        .collect();
    let tensors = DlcpTensor::from_ends(&ends, 0);
    let cfg = DlcpConfig {
        p_max: p_max.unwrap_or(0.0),
        mtu: o.mtu,
        deadline: o.deadline,
        retransmit_interval: o.retransmit,
        loss: LossModel {
            drop_prob: o.drop,
            delay_prob: o.tail_prob,
            delay: o.tail_delay,
            seed: o.seed,
        },
        ..DlcpConfig::default()
    };
    let mut g = vec![0.0f32; o.n];
    let mut out = Vec::with_capacity(o.rounds);
    // One warm-up round, not recorded.
    for round in 0..=o.rounds {
        gradient(o, r, round, &mut g);
        c.barrier().expect("barrier");
        let t = Instant::now();
        let row = match p_max {
            Some(_) => {
                let rep = c.dlcp_all_reduce(&mut g, &tensors, &cfg).expect("dlcp");
                Round {
                    secs: t.elapsed().as_secs_f64(),
                    dropped_elems: rep.dropped_elems_all,
                    elems: rep.elems_all,
                    retransmitted: rep.retransmitted,
                    nack_rounds: rep.nack_rounds,
                    sent_bytes: rep.bytes.sent,
                }
            }
            None => {
                c.all_reduce_sum(&mut g).expect("all-reduce");
                Round {
                    secs: t.elapsed().as_secs_f64(),
                    sent_bytes: c.last_bytes().sent,
                    ..Round::default()
                }
            }
        };
        if round > 0 {
            out.push(row);
        }
    }
    out
}

fn run(o: &Opts, link: LinkSpec, p_max: Option<f64>) -> Vec<Vec<Round>> {
    let ls: Vec<TcpListener> = (0..o.ranks)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    let addrs: Vec<SocketAddr> = ls.iter().map(|l| l.local_addr().expect("addr")).collect();
    let hs: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let (o, addrs) = (o.clone(), addrs.clone());
            thread::spawn(move || {
                let mut cfg = TcpConfig::new(b"dlcp-tail".to_vec());
                cfg.link = link;
                let t = TcpTransport::connect(r, &addrs, l, cfg).expect("mesh");
                let mut c = Communicator::new(t, CommConfig::default());
                rank_main(&mut c, &o, p_max)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().expect("rank")).collect()
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i]
}

fn main() {
    let o = parse_opts();
    let link = LinkSpec::parse(Some(&o.bandwidth), Some(&o.latency)).expect("link");
    println!(
        "P = {}, n = {} f32 ({} KiB) in {} layers, {} rounds (+1 warm-up), TCP on 127.0.0.1 \
         shaped to {} / {} per rank; loss {} , straggling packets {} delayed by {:?}; \
         deadline {:?}, NACK every {:?}, mtu {} B\n",
        o.ranks,
        o.n,
        o.n * 4 / 1024,
        o.layers,
        o.rounds,
        o.bandwidth,
        o.latency,
        o.drop,
        o.tail_prob,
        o.tail_delay,
        o.deadline,
        o.retransmit,
        o.mtu
    );
    println!(
        "| collective | p50 ms | p95 ms | p99 ms | max ms | mean ms | dropped % | \
         retransmitted pkts/round | NACK rounds/round | KiB sent/rank/round |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let modes: Vec<Option<f64>> = std::iter::once(None)
        .chain(o.p_max.iter().map(|&p| Some(p)))
        .collect();
    for p_max in modes {
        let per_rank = run(&o, link, p_max);
        let rounds = per_rank[0].len();
        let mut times: Vec<f64> = (0..rounds)
            .map(|i| per_rank.iter().map(|rs| rs[i].secs).fold(0.0, f64::max) * 1e3)
            .collect();
        let mean = times.iter().sum::<f64>() / rounds as f64;
        times.sort_by(f64::total_cmp);
        let sum =
            |f: &dyn Fn(&Round) -> f64| -> f64 { per_rank.iter().flatten().map(f).sum::<f64>() };
        // Every rank reports the same global drop counts: use rank 0's.
        let dropped: f64 = per_rank[0].iter().map(|r| r.dropped_elems as f64).sum();
        let elems: f64 = per_rank[0].iter().map(|r| r.elems as f64).sum();
        let name = match p_max {
            None => "ring all_reduce_sum (reliable TCP, no loss)".to_string(),
            Some(p) => format!("dlcp p_max = {p}"),
        };
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.3} | {:.1} | {:.2} | {:.0} |",
            pct(&times, 50.0),
            pct(&times, 95.0),
            pct(&times, 99.0),
            times[rounds - 1],
            mean,
            if elems > 0.0 {
                100.0 * dropped / elems
            } else {
                0.0
            },
            sum(&|r| r.retransmitted as f64) / rounds as f64,
            // NACK rounds are counted by the owners: sum over ranks.
            sum(&|r| r.nack_rounds as f64) / rounds as f64,
            sum(&|r| r.sent_bytes as f64) / (rounds * o.ranks) as f64 / 1024.0,
        );
    }
}
