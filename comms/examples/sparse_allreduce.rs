//! Sparse all-reduce against an all-gather of (index, value) payloads, over TCP on
//! 127.0.0.1 (one thread per rank, each with its own `TcpTransport`).
//!
//! ```text
//! cargo run --release -p dtrain-comms --example sparse_allreduce --
//!     [--n 4M] [--ranks 2,3,4,5,6,7,8] [--densities 0.01,0.001] [--overlaps 0,0.5,0.9]
//!     [--iters 5]
//! ```
//!
//! Every rank holds `density · n` entries; a fraction `overlap` of them lies on indices
//! shared by all ranks (as for Top-k of correlated gradients), the rest is drawn
//! independently. Both contenders deliver the dense sum on every rank:
//! * **all-gather**: `Communicator::all_gather` of each rank's 8-byte (u32 index, f32 value)
//!   pairs, then every rank decodes and adds the P payloads into a dense buffer;
//! * **sparse all-reduce**: `Communicator::sparse_all_reduce_dense`.
//!
//! Printed per world size, density and overlap (a markdown table): entries per rank, entries
//! of the sum, bytes received per worker (mean over ranks of `last_bytes().received`,
//! framing included) and wall time per call (mean over `--iters` calls after one warm-up,
//! between barriers, so the slowest rank counts).

use std::net::{SocketAddr, TcpListener};
use std::thread;
use std::time::Instant;

use dtrain_comms::{CommConfig, Communicator, SparseSlice, TcpConfig, TcpTransport};

mod common;
use common::parse_size;

#[derive(Clone)]
struct Opts {
    n: usize,
    ranks: Vec<usize>,
    densities: Vec<f64>,
    overlaps: Vec<f64>,
    iters: usize,
}

fn list<T: std::str::FromStr>(s: &str) -> Vec<T> {
    s.split(',')
        .map(|x| x.trim().parse().ok().expect("list element"))
        .collect()
}

fn parse_opts() -> Opts {
    let mut o = Opts {
        n: 4 << 20,
        ranks: (2..=8).collect(),
        densities: vec![0.01, 0.001],
        overlaps: vec![0.0, 0.5, 0.9],
        iters: 5,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let v = it.next().expect("option value");
        match a.as_str() {
            "--n" => o.n = parse_size(v),
            "--ranks" => o.ranks = list(v),
            "--densities" => o.densities = list(v),
            "--overlaps" => o.overlaps = list(v),
            "--iters" => o.iters = v.parse().expect("iters"),
            other => panic!("unknown option {other}"),
        }
    }
    o
}

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> u32 {
        (self.next() % n as u64) as u32
    }
}

/// Rank `rank`'s input: `density · n` entries, `overlap` of them on shared indices.
fn input(n: usize, density: f64, overlap: f64, rank: usize, seed: u64) -> (Vec<u32>, Vec<f32>) {
    let k = (density * n as f64) as usize;
    let shared = (overlap * k as f64) as usize;
    let mut common = Rng(seed);
    let mut own = Rng(seed ^ (rank as u64 + 1).wrapping_mul(0xA076_1D64_78BD_642F));
    let mut idx: Vec<u32> = (0..shared).map(|_| common.below(n)).collect();
    idx.extend((shared..k).map(|_| own.below(n)));
    idx.sort_unstable();
    idx.dedup();
    let vals = idx
        .iter()
        .map(|_| (own.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .collect();
    (idx, vals)
}

/// One rank's measurements of one configuration.
struct Row {
    nnz: usize,
    sum_nnz: usize,
    ag_bytes: u64,
    sar_bytes: u64,
    ag_ms: f64,
    sar_ms: f64,
}

/// Mean wall time per call of `f` over `iters` calls after one warm-up, between barriers.
fn time(
    c: &mut Communicator<TcpTransport>,
    iters: usize,
    mut f: impl FnMut(&mut Communicator<TcpTransport>),
) -> f64 {
    f(c);
    c.barrier().expect("barrier");
    let t = Instant::now();
    for _ in 0..iters {
        f(c);
    }
    c.barrier().expect("barrier");
    t.elapsed().as_secs_f64() * 1e3 / iters as f64
}

fn rank_main(c: &mut Communicator<TcpTransport>, o: &Opts) -> Vec<Row> {
    let (n, r) = (o.n, c.rank());
    let mut dense = vec![0.0f32; n];
    let mut rows = Vec::new();
    for (di, &density) in o.densities.iter().enumerate() {
        for (oi, &overlap) in o.overlaps.iter().enumerate() {
            let (idx, vals) = input(n, density, overlap, r, (di * 31 + oi) as u64);
            let x = SparseSlice::new(n, &idx, &vals).expect("valid input");
            let mut payload = Vec::with_capacity(8 * idx.len());
            for (i, v) in idx.iter().zip(&vals) {
                payload.extend_from_slice(&i.to_le_bytes());
                payload.extend_from_slice(&v.to_le_bytes());
            }
            let ag_ms = time(c, o.iters, |c| {
                let blocks = c.all_gather(&payload).expect("all-gather");
                dense.fill(0.0);
                for b in &blocks {
                    for e in b.chunks_exact(8) {
                        let i = u32::from_le_bytes([e[0], e[1], e[2], e[3]]);
                        dense[i as usize] += f32::from_le_bytes([e[4], e[5], e[6], e[7]]);
                    }
                }
            });
            c.all_gather(&payload).expect("all-gather");
            let ag_bytes = c.last_bytes().received;
            let sar_ms = time(c, o.iters, |c| {
                c.sparse_all_reduce_dense(x, &mut dense)
                    .expect("sparse all-reduce");
            });
            let sum = c.sparse_all_reduce(x).expect("sparse all-reduce");
            rows.push(Row {
                nnz: idx.len(),
                sum_nnz: sum.nnz(),
                ag_bytes,
                sar_bytes: c.last_bytes().received,
                ag_ms,
                sar_ms,
            });
        }
    }
    rows
}

fn mesh(world: usize) -> Vec<(TcpListener, Vec<SocketAddr>)> {
    let ls: Vec<TcpListener> = (0..world)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    let addrs: Vec<SocketAddr> = ls.iter().map(|l| l.local_addr().expect("addr")).collect();
    ls.into_iter().map(|l| (l, addrs.clone())).collect()
}

fn kib(b: f64) -> String {
    format!("{:.0}", b / 1024.0)
}

fn main() {
    let o = parse_opts();
    println!(
        "n = {} ({} MiB dense f32), TCP on 127.0.0.1, one thread per rank, {} calls per cell\n",
        o.n,
        (o.n * 4) >> 20,
        o.iters
    );
    println!(
        "| P | density | overlap | nnz/rank | nnz(sum) | all-gather KiB recv/worker | \
         sparse AR KiB recv/worker | bytes ratio | all-gather ms | sparse AR ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for &world in &o.ranks {
        let hs: Vec<_> = mesh(world)
            .into_iter()
            .enumerate()
            .map(|(r, (l, addrs))| {
                let o = o.clone();
                thread::spawn(move || {
                    let t = TcpTransport::connect(r, &addrs, l, TcpConfig::new(b"ex".to_vec()))
                        .expect("mesh");
                    let mut c = Communicator::new(t, CommConfig::default());
                    rank_main(&mut c, &o)
                })
            })
            .collect();
        let per_rank: Vec<Vec<Row>> = hs.into_iter().map(|h| h.join().expect("rank")).collect();
        let mut k = 0;
        for &density in &o.densities {
            for &overlap in &o.overlaps {
                let rows: Vec<&Row> = per_rank.iter().map(|rs| &rs[k]).collect();
                k += 1;
                let mean =
                    |f: &dyn Fn(&Row) -> f64| rows.iter().map(|r| f(r)).sum::<f64>() / world as f64;
                let (ag, sar) = (mean(&|r| r.ag_bytes as f64), mean(&|r| r.sar_bytes as f64));
                println!(
                    "| {world} | {}% | {overlap} | {:.0} | {} | {} | {} | {:.2} | {:.2} | {:.2} |",
                    density * 100.0,
                    mean(&|r| r.nnz as f64),
                    rows[0].sum_nnz,
                    kib(ag),
                    kib(sar),
                    sar / ag,
                    // Every rank waits for the slowest between barriers: rank 0's view.
                    rows[0].ag_ms,
                    rows[0].sar_ms,
                );
            }
        }
    }
}
