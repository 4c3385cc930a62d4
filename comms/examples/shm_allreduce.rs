//! All-reduce over the shared-memory transport next to TCP on 127.0.0.1, one process per
//! rank, in one run.
//!
//! ```text
//! cargo build --release -p dtrain-comms --example shm_allreduce
//! target/release/examples/shm_allreduce [--ranks 2,4] [--sizes 1K,64K,1M,2M,16M,64M]
//!     [--secs 0.3] [--chunk 1M] [--ring 4M] [--spin-us N] [--transports shm,tcp]
//! ```
//!
//! No launcher is needed: the parent re-runs this binary once per rank (environment
//! variable `DTRAIN_SHM_BENCH_CHILD=rank,world,run-id`). Each child binds a loopback TCP
//! listener and prints its address; the parent hands every child the full list on stdin;
//! the children then build both meshes — TCP through the listeners, shared memory through
//! the run id — and time the all-reduce on each, size by size, one transport after the
//! other.
//!
//! Per world size, message size and transport, rank 0 prints the mean time per call after
//! one warm-up call (at least 3 calls and about `--secs` seconds, ended by a barrier),
//! the median of rank 0's per-call times, `busbw = bytes / time · 2(N−1)/N` as
//! nccl-tests reports it for all-reduce, and `cpu_ms`: CPU time per call summed over all
//! ranks' processes (every thread), which holds up on a loaded machine where wall time
//! does not.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dtrain_comms::{
    CommConfig, Communicator, ShmConfig, ShmTransport, TcpConfig, TcpTransport, Transport,
};

mod common;
use common::{fmt_size, parse_size};

const CHILD: &str = "DTRAIN_SHM_BENCH_CHILD";
const TOKEN: &[u8] = b"bench";

#[derive(Clone)]
struct Opts {
    ranks: Vec<usize>,
    sizes: Vec<usize>,
    secs: f64,
    chunk: usize,
    ring: usize,
    spin_us: Option<u64>,
    transports: Vec<String>,
}

fn parse_opts(args: &[String]) -> Opts {
    let mut o = Opts {
        ranks: vec![2, 4],
        sizes: [
            "1K", "4K", "16K", "64K", "256K", "1M", "2M", "4M", "16M", "64M",
        ]
        .iter()
        .map(|s| parse_size(s))
        .collect(),
        secs: 0.3,
        chunk: CommConfig::default().chunk_bytes,
        ring: ShmConfig::new(TOKEN, "").ring_bytes,
        spin_us: None,
        transports: vec!["shm".into(), "tcp".into()],
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().expect("option value").clone();
        match a.as_str() {
            "--ranks" => o.ranks = v().split(',').map(|s| s.parse().expect("rank")).collect(),
            "--sizes" => o.sizes = v().split(',').map(parse_size).collect(),
            "--secs" => o.secs = v().parse().expect("secs"),
            "--chunk" => o.chunk = parse_size(&v()),
            "--ring" => o.ring = parse_size(&v()),
            "--spin-us" => o.spin_us = Some(v().parse().expect("spin")),
            "--transports" => o.transports = v().split(',').map(str::to_owned).collect(),
            other => panic!("unknown option {other}"),
        }
    }
    o
}

fn opts_to_args(o: &Opts) -> Vec<String> {
    let join = |v: Vec<String>| v.join(",");
    vec![
        "--ranks".into(),
        join(o.ranks.iter().map(|r| r.to_string()).collect()),
        "--sizes".into(),
        join(o.sizes.iter().map(|s| s.to_string()).collect()),
        "--secs".into(),
        o.secs.to_string(),
        "--chunk".into(),
        o.chunk.to_string(),
        "--ring".into(),
        o.ring.to_string(),
        "--transports".into(),
        o.transports.join(","),
    ]
    .into_iter()
    .chain(
        o.spin_us
            .iter()
            .flat_map(|s| ["--spin-us".into(), s.to_string()]),
    )
    .collect()
}

/// CPU time used so far by this process's live threads (from `/proc`).
fn cpu_time() -> Duration {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    let ns: u64 = tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    Duration::from_nanos(ns)
}

/// One measurement: mean wall time per call (loop ended by a barrier), median of rank 0's
/// per-call times, CPU time per call summed over all ranks.
struct Timing {
    mean: Duration,
    median: Duration,
    cpu: f64,
}

/// Times `f` after one warm-up call: at least 3 calls and about `secs` seconds; rank 0
/// decides the count and broadcasts it, so that all ranks run the same number.
fn time<T: Transport>(
    c: &mut Communicator<T>,
    secs: f64,
    mut f: impl FnMut(&mut Communicator<T>),
) -> Timing {
    f(c);
    c.barrier().expect("barrier");
    let start = Instant::now();
    f(c);
    let one = start.elapsed().as_secs_f64();
    let mut n = vec![0u8; 8];
    if c.rank() == 0 {
        let iters = ((secs / one.max(1e-6)) as u64).clamp(3, 5000);
        n = iters.to_le_bytes().to_vec();
    }
    c.broadcast(&mut n, 0).expect("broadcast");
    let iters = u64::from_le_bytes(n.try_into().expect("8 bytes"));
    c.barrier().expect("barrier");
    let mut each = Vec::with_capacity(iters as usize);
    let (start, cpu0) = (Instant::now(), cpu_time());
    for _ in 0..iters {
        let t = Instant::now();
        f(c);
        each.push(t.elapsed());
    }
    c.barrier().expect("barrier");
    let (wall, cpu) = (start.elapsed(), cpu_time().saturating_sub(cpu0));
    let all = c
        .all_gather(&cpu.as_secs_f64().to_le_bytes())
        .expect("all-gather");
    let total: f64 = all
        .iter()
        .map(|b| f64::from_le_bytes(b[..8].try_into().expect("8 bytes")))
        .sum();
    each.sort();
    Timing {
        mean: wall / iters as u32,
        median: each[each.len() / 2],
        cpu: total / iters as f64,
    }
}

fn all_reduce<T: Transport>(c: &mut Communicator<T>, bytes: usize, secs: f64) -> Timing {
    let rank = c.rank();
    let mut data: Vec<f32> = (0..bytes / 4)
        .map(|i| ((i + rank) % 1000) as f32 * 1e-3)
        .collect();
    // Summing in place again and again only grows the values (timing is unaffected).
    time(c, secs, |c| {
        c.all_reduce_sum(&mut data).expect("all-reduce")
    })
}

fn child(spec: &str, opts: &Opts) {
    let mut p = spec.splitn(3, ',');
    let rank: usize = p.next().expect("rank").parse().expect("rank");
    let world: usize = p.next().expect("world").parse().expect("world");
    let run_id = p.next().expect("run id").to_owned();
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    println!("{}", listener.local_addr().expect("address"));
    std::io::stdout().flush().expect("flush");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("addresses");
    let addrs: Vec<SocketAddr> = line
        .trim()
        .split(',')
        .map(|a| a.parse().expect("address"))
        .collect();
    let cfg = CommConfig {
        chunk_bytes: opts.chunk,
        ..CommConfig::default()
    };
    let tcp = TcpTransport::connect(rank, &addrs, listener, TcpConfig::new(TOKEN)).expect("tcp");
    let shm_cfg = ShmConfig {
        ring_bytes: opts.ring,
        spin: opts.spin_us.map(Duration::from_micros),
        ..ShmConfig::new(TOKEN, run_id)
    };
    let shm = ShmTransport::connect(rank, world, shm_cfg).expect("shm");
    let mut tcp = Communicator::new(tcp, cfg.clone());
    let mut shm = Communicator::new(shm, cfg);
    let factor = 2.0 * (world as f64 - 1.0) / world as f64;
    for &bytes in &opts.sizes {
        let mut cols = Vec::new();
        for tr in &opts.transports {
            let t = match tr.as_str() {
                "shm" => all_reduce(&mut shm, bytes, opts.secs),
                "tcp" => all_reduce(&mut tcp, bytes, opts.secs),
                other => panic!("unknown transport {other}"),
            };
            cols.push(t);
        }
        if rank == 0 {
            let mut line = format!("{world:>5} {:>6}", fmt_size(bytes));
            for t in &cols {
                let bus = bytes as f64 / t.mean.as_secs_f64() / 1e9 * factor;
                line += &format!(
                    " | {:>9.3} {:>9.3} {:>7.3} {:>8.3}",
                    t.mean.as_secs_f64() * 1e3,
                    t.median.as_secs_f64() * 1e3,
                    bus,
                    t.cpu * 1e3
                );
            }
            if cols.len() == 2 {
                line += &format!(
                    " | {:>6.1}x",
                    cols[1].mean.as_secs_f64() / cols[0].mean.as_secs_f64()
                );
            }
            println!("{line}");
            std::io::stdout().flush().expect("flush");
        }
    }
    shm.barrier().expect("final barrier");
    tcp.barrier().expect("final barrier");
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = parse_opts(&args);
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec, &opts);
        return;
    }
    let spin = match opts.spin_us {
        Some(us) => format!("{us} us"),
        None => "auto".into(),
    };
    println!(
        "# all-reduce (f32 sum), one process per rank, chunk {}, shm ring {}, spin {spin}",
        fmt_size(opts.chunk),
        fmt_size(opts.ring),
    );
    let mut head = format!("{:>5} {:>6}", "ranks", "size");
    for tr in &opts.transports {
        head += &format!(
            " | {:>9} {:>9} {:>7} {:>8}",
            format!("{tr}_ms"),
            "p50_ms",
            "busbw",
            "cpu_ms"
        );
    }
    if opts.transports.len() == 2 {
        head += &format!(" | {:>7}", "speedup");
    }
    println!("{head}");
    for &world in &opts.ranks {
        let exe = std::env::current_exe().expect("exe");
        let run_id = format!(
            "bench-{}-{world}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        );
        let mut kids: Vec<_> = (0..world)
            .map(|r| {
                Command::new(&exe)
                    .args(opts_to_args(&opts))
                    .env(CHILD, format!("{r},{world},{run_id}"))
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("spawn rank")
            })
            .collect();
        let mut outs: Vec<_> = kids
            .iter_mut()
            .map(|k| BufReader::new(k.stdout.take().expect("stdout")))
            .collect();
        let addrs: Vec<String> = outs
            .iter_mut()
            .map(|o| {
                let mut l = String::new();
                o.read_line(&mut l).expect("child address");
                l.trim().to_owned()
            })
            .collect();
        for k in &mut kids {
            let mut stdin = k.stdin.take().expect("stdin");
            writeln!(stdin, "{}", addrs.join(",")).expect("send addresses");
        }
        for l in outs.remove(0).lines() {
            println!("{}", l.expect("rank 0 output"));
        }
        for mut k in kids {
            assert!(k.wait().expect("wait").success(), "a rank failed");
        }
    }
}
