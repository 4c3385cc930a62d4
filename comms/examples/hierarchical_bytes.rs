//! Bytes that cross between hosts in one all-reduce: the flat ring against the hierarchical
//! all-reduce, for ranks laid out `hosts × per_host` (consecutive ranks on a host, as
//! `dtrain run --nnodes` places them). The state machines run in process over a FIFO
//! network that counts the bytes of every message (its 36-byte header and payload, before
//! any transport's framing); nothing is timed, so the figures are exact and repeatable.
//!
//! ```text
//! cargo run --release -p dtrain-comms --example hierarchical_bytes --
//!     [--n 4M] [--layouts 2x2,2x4,4x2,4x4,8x4] [--chunk 1M]
//! ```
//!
//! Printed per layout (a markdown table): the bytes crossing between hosts per all-reduce
//! in total and at the busiest host's network link (sent), for the flat ring and for the
//! hierarchy, and the bytes one leader sends in a flat all-reduce among the `hosts` leaders
//! (which the hierarchy's crossing bytes equal, leader by leader).

use std::collections::VecDeque;

use dtrain_comms::algo::hierarchical::Hierarchical;
use dtrain_comms::algo::ring::Ring;
use dtrain_comms::algo::Machine;
use dtrain_comms::topology::Topology;
use dtrain_comms::ReduceOp;

mod common;
use common::{fmt_size, parse_size};

/// Runs the machines to completion over FIFO links; returns the bytes sent on each link,
/// at index `from · P + to`.
fn run(machines: &mut [Box<dyn Machine + '_>]) -> Vec<u64> {
    let p = machines.len();
    let mut links: Vec<VecDeque<dtrain_comms::wire::Message>> =
        (0..p * p).map(|_| VecDeque::new()).collect();
    let mut sent = vec![0u64; p * p];
    loop {
        for (from, m) in machines.iter_mut().enumerate() {
            while let Some((to, msg)) = m.poll_transmit() {
                sent[from * p + to] += msg.len() as u64;
                links[from * p + to].push_back(msg);
            }
        }
        let Some(l) = (0..p * p).find(|&l| !links[l].is_empty()) else {
            assert!(
                machines.iter().all(|m| m.is_done()),
                "network quiet, not done"
            );
            return sent;
        };
        while let Some(msg) = links[l].pop_front() {
            machines[l % p].handle(l / p, msg).expect("a valid message");
        }
    }
}

/// A flat ring all-reduce over `bufs`, one machine per buffer.
fn rings(bufs: &mut [Vec<f32>], chunk_elems: usize) -> Vec<Box<dyn Machine + '_>> {
    let p = bufs.len();
    bufs.iter_mut()
        .enumerate()
        .map(|(r, b)| -> Box<dyn Machine + '_> {
            Box::new(Ring::all_reduce(r, p, 0, ReduceOp::Sum, b, chunk_elems))
        })
        .collect()
}

/// (total, busiest host's sent) bytes crossing between hosts.
fn crossing(sent: &[u64], topo: &Topology) -> (u64, u64) {
    let p = topo.world();
    let mut per_host = vec![0u64; topo.hosts()];
    for a in 0..p {
        for b in 0..p {
            if topo.host_of(a) != topo.host_of(b) {
                per_host[topo.host_of(a)] += sent[a * p + b];
            }
        }
    }
    (
        per_host.iter().sum(),
        per_host.into_iter().max().unwrap_or(0),
    )
}

fn main() {
    let (mut n, mut chunk) = (4usize << 20, 1usize << 20);
    let mut layouts = vec![(2, 2), (2, 4), (4, 2), (4, 4), (8, 4)];
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let v = it.next().expect("option value");
        match a.as_str() {
            "--n" => n = parse_size(v),
            "--chunk" => chunk = parse_size(v),
            "--layouts" => {
                layouts = v
                    .split(',')
                    .map(|l| {
                        let (h, k) = l.split_once('x').expect("HOSTSxPER_HOST");
                        (h.parse().expect("hosts"), k.parse().expect("per host"))
                    })
                    .collect()
            }
            other => panic!("unknown option {other}"),
        }
    }
    let chunk_elems = (chunk / 4).max(1);
    println!(
        "all-reduce of {} f32 ({} B), chunks of {} B; bytes crossing between hosts per call\n",
        fmt_size(n),
        4 * n,
        fmt_size(chunk)
    );
    println!(
        "| hosts × per host | P | flat ring: total | flat ring: busiest host | hierarchical: total | hierarchical: busiest host | one leader's flat all-reduce among the hosts |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (hosts, per) in layouts {
        let p = hosts * per;
        let topo = Topology::from_nodes(p, hosts).expect("layout");
        let mut bufs = vec![vec![1.0f32; n]; p];
        let flat = run(&mut rings(&mut bufs, chunk_elems));
        let (flat_total, flat_max) = crossing(&flat, &topo);
        let mut bufs = vec![vec![1.0f32; n]; p];
        let mut hier: Vec<Box<dyn Machine + '_>> = bufs
            .iter_mut()
            .enumerate()
            .map(|(r, b)| -> Box<dyn Machine + '_> {
                Box::new(Hierarchical::new(r, &topo, 0, b, chunk_elems, false))
            })
            .collect();
        let (hier_total, hier_max) = crossing(&run(&mut hier), &topo);
        drop(hier);
        let mut bufs = vec![vec![1.0f32; n]; hosts];
        let one_leader = run(&mut rings(&mut bufs, chunk_elems))[..hosts]
            .iter()
            .sum::<u64>();
        println!(
            "| {hosts} × {per} | {p} | {flat_total} | {flat_max} | {hier_total} | {hier_max} | {one_leader} |"
        );
    }
}
