//! Collective bandwidth over the TCP transport on 127.0.0.1, one process per rank.
//!
//! ```text
//! cargo build --release -p dtrain-comms --example tcp_allreduce
//! target/release/examples/tcp_allreduce [--ranks 2,3,4] [--sizes 1M,2M,16M,64M]
//!     [--ops allreduce,allgather,allgather_into,broadcast] [--secs 0.5] [--chunk 1M]
//! ```
//!
//! The parent re-runs this binary once per rank (each child binds a loopback listener and
//! reports its address; the parent hands every child the full list) and prints, per world
//! size, message size and collective, the mean time per call after one warm-up call,
//! `algbw = bytes / time` and the bus bandwidth nccl-tests reports: `busbw = algbw ·
//! 2(N−1)/N` for all-reduce, `algbw · (N−1)/N` for all-gather (bytes = the gathered
//! total; `allgather_into` reuses its output buffers from call to call) and `algbw` for
//! broadcast. Each measurement runs at least 3 calls and about
//! `--secs` seconds. `cpu_ms` is the CPU time per call summed over all ranks' processes
//! (every thread: caller, socket threads), a measure of cost that holds up on a loaded
//! machine where wall time does not.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dtrain_comms::{CommConfig, Communicator, TcpConfig, TcpTransport};

mod common;
use common::{fmt_size, parse_size};

const CHILD: &str = "DTRAIN_TCP_BENCH_CHILD";

#[derive(Clone)]
struct Opts {
    ranks: Vec<usize>,
    sizes: Vec<usize>,
    ops: Vec<String>,
    secs: f64,
    chunk: usize,
}

fn parse_opts(args: &[String]) -> Opts {
    let mut o = Opts {
        ranks: vec![2, 3, 4],
        sizes: vec![1 << 20, 2 << 20, 16 << 20, 64 << 20],
        ops: vec!["allreduce".into()],
        secs: 0.5,
        chunk: CommConfig::default().chunk_bytes,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().expect("option value").clone();
        match a.as_str() {
            "--ranks" => o.ranks = v().split(',').map(|s| s.parse().expect("rank")).collect(),
            "--sizes" => o.sizes = v().split(',').map(parse_size).collect(),
            "--ops" => o.ops = v().split(',').map(str::to_owned).collect(),
            "--secs" => o.secs = v().parse().expect("secs"),
            "--chunk" => o.chunk = parse_size(&v()),
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
        "--ops".into(),
        o.ops.join(","),
        "--secs".into(),
        o.secs.to_string(),
        "--chunk".into(),
        o.chunk.to_string(),
    ]
}

/// CPU time used so far by this process's live threads (from `/proc`, Linux only; 0
/// elsewhere).
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

/// Times `f` (after one warm-up call): at least 3 calls and about `secs` seconds. All ranks
/// must run the same number of calls, so rank 0 decides and broadcasts the count. Returns
/// the wall time per call and the CPU time per call summed over all ranks.
fn time(
    c: &mut Communicator<TcpTransport>,
    secs: f64,
    mut f: impl FnMut(&mut Communicator<TcpTransport>),
) -> (Duration, f64) {
    f(c);
    c.barrier().expect("barrier");
    let start = Instant::now();
    f(c);
    let one = start.elapsed().as_secs_f64();
    let mut n = vec![0u8; 8];
    if c.rank() == 0 {
        let iters = ((secs / one.max(1e-6)) as u64).clamp(3, 1000);
        n = iters.to_le_bytes().to_vec();
    }
    c.broadcast(&mut n, 0).expect("broadcast");
    let iters = u64::from_le_bytes(n.try_into().expect("8 bytes"));
    c.barrier().expect("barrier");
    let (start, cpu0) = (Instant::now(), cpu_time());
    for _ in 0..iters {
        f(c);
    }
    // A broadcast root returns once its chunks are queued: time until every rank is done.
    c.barrier().expect("barrier");
    let (wall, cpu) = (start.elapsed(), cpu_time().saturating_sub(cpu0));
    let all = c
        .all_gather(&cpu.as_secs_f64().to_le_bytes())
        .expect("all-gather");
    let total: f64 = all
        .iter()
        .map(|b| f64::from_le_bytes(b[..8].try_into().expect("8 bytes")))
        .sum();
    (wall / iters as u32, total / iters as f64)
}

fn child(spec: &str, opts: &Opts) {
    let mut p = spec.split(',').map(|s| s.parse::<usize>().expect("spec"));
    let (rank, world) = (p.next().expect("rank"), p.next().expect("world"));
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
    let t = TcpTransport::connect(rank, &addrs, listener, TcpConfig::new(b"bench".to_vec()))
        .expect("mesh");
    let cfg = CommConfig {
        chunk_bytes: opts.chunk,
        ..CommConfig::default()
    };
    let mut c = Communicator::new(t, cfg);
    let n = world as f64;
    for &bytes in &opts.sizes {
        for op in &opts.ops {
            let ((dt, cpu), factor) = match op.as_str() {
                "allreduce" => {
                    let mut data: Vec<f32> = (0..bytes / 4)
                        .map(|i| ((i + rank) % 1000) as f32 * 1e-3)
                        .collect();
                    // Summing in place again and again only grows the values (timing is
                    // unaffected), so the inputs are not restored between calls.
                    let dt = time(&mut c, opts.secs, |c| {
                        c.all_reduce_sum(&mut data).expect("all-reduce");
                    });
                    (dt, 2.0 * (n - 1.0) / n)
                }
                "allgather" => {
                    let data = vec![rank as u8; bytes / world];
                    let dt = time(&mut c, opts.secs, |c| {
                        let _ = c.all_gather(&data).expect("all-gather");
                    });
                    (dt, (n - 1.0) / n)
                }
                "allgather_into" => {
                    let data = vec![rank as u8; bytes / world];
                    let mut out = Vec::new();
                    let dt = time(&mut c, opts.secs, |c| {
                        c.all_gather_into(&data, &mut out).expect("all-gather");
                    });
                    (dt, (n - 1.0) / n)
                }
                "broadcast" => {
                    let mut data = vec![7u8; bytes];
                    let dt = time(&mut c, opts.secs, |c| {
                        c.broadcast(&mut data, 0).expect("broadcast");
                    });
                    (dt, 1.0)
                }
                other => panic!("unknown op {other}"),
            };
            if rank == 0 {
                let alg = bytes as f64 / dt.as_secs_f64() / 1e9;
                println!(
                    "{world:>5} {:>6} {op:>10} {:>10.3} {alg:>8.3} {:>8.3} {:>9.3}",
                    fmt_size(bytes),
                    dt.as_secs_f64() * 1e3,
                    alg * factor,
                    cpu * 1e3
                );
                std::io::stdout().flush().expect("flush");
            }
        }
    }
    c.barrier().expect("final barrier");
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = parse_opts(&args);
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec, &opts);
        return;
    }
    println!(
        "# TCP transport on 127.0.0.1, one process per rank, chunk {}",
        fmt_size(opts.chunk)
    );
    println!(
        "{:>5} {:>6} {:>10} {:>10} {:>8} {:>8} {:>9}",
        "ranks", "size", "op", "ms", "algbw", "busbw", "cpu_ms"
    );
    for &world in &opts.ranks {
        let exe = std::env::current_exe().expect("exe");
        let mut kids: Vec<_> = (0..world)
            .map(|r| {
                Command::new(&exe)
                    .args(opts_to_args(&opts))
                    .env(CHILD, format!("{r},{world}"))
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
