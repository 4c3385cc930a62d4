//! All-reduce bandwidth, nccl-tests style, side by side in one run: native `MPI_Allreduce`,
//! dtrain's ring driven over [`MpiTransport`] (MPI point-to-point), and dtrain's ring over
//! TCP and over QUIC on 127.0.0.1 (addresses and the QUIC run certificate exchanged through
//! MPI). All four all-reduce the same buffer on the same processes, one after the other,
//! for every size.
//!
//! ```text
//! cargo build --release -p dtrain-comms --features mpi --example mpi_allreduce
//! mpirun --oversubscribe --bind-to none -n 4 target/release/examples/mpi_allreduce \
//!     [SIZES] [ITERS] [IMPLS]
//! ```
//!
//! SIZES is a comma-separated list of buffer sizes in bytes of f32, with an optional K / M
//! suffix (default `64M`); ITERS the number of timed calls per size and implementation
//! (default 5, after one warm-up call); IMPLS which to run, of `mpi,ring,tcp,quic` (default
//! all four; for profiling one alone). Prints, on rank 0, the time per call (the slowest
//! rank's mean), algbw = bytes / time, busbw = algbw · 2(N−1)/N, and the CPU time per call
//! summed over all ranks (every thread of every process: busy-polling shows up here).

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::time::{Duration, Instant};

use dtrain_comms::rendezvous::RunIdentity;
use dtrain_comms::{
    CommConfig, Communicator, MpiCollectives, MpiTransport, QuicConfig, QuicTransport, TcpConfig,
    TcpTransport,
};
use mpi::collective::CommunicatorCollectives;
use mpi::environment::Threading;
use mpi::topology::{Communicator as _, SimpleCommunicator};

mod common;
use common::{fmt_size, parse_size};

/// CPU time used so far by this process's live threads (from `/proc`; 0 elsewhere).
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

/// Mean wall time and CPU time per call of `f` on this rank (after one warm-up call).
fn time<F: FnMut()>(world: &SimpleCommunicator, iters: usize, mut f: F) -> (f64, f64) {
    f();
    world.barrier();
    let (start, cpu0) = (Instant::now(), cpu_time());
    for _ in 0..iters {
        f();
    }
    let wall = start.elapsed().as_secs_f64() / iters as f64;
    let cpu = cpu_time().saturating_sub(cpu0).as_secs_f64() / iters as f64;
    world.barrier();
    (wall, cpu)
}

/// Every rank's address of a socket bound on 127.0.0.1, exchanged through MPI.
fn addresses(native: &mut MpiCollectives, me: SocketAddr) -> Vec<SocketAddr> {
    native
        .all_gather(me.to_string().as_bytes())
        .expect("all-gather")
        .iter()
        .map(|a| String::from_utf8_lossy(a).parse().expect("address"))
        .collect()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let sizes: Vec<usize> = args
        .next()
        .map_or(vec![64 << 20], |a| a.split(',').map(parse_size).collect());
    let iters: usize = args.next().map_or(5, |a| a.parse().expect("ITERS"));
    let impls = args.next().unwrap_or_else(|| "mpi,ring,tcp,quic".into());
    let run = |name: &str| impls.split(',').any(|i| i == name);
    let (universe, _) =
        mpi::initialize_with_threading(Threading::Serialized).expect("MPI initialises");
    let world = universe.world();
    let (rank, n) = (world.rank() as usize, world.size() as usize);
    let mut native = MpiCollectives::new(&world).expect("MPI collectives");
    let cfg = CommConfig {
        chunk_bytes: 4 << 20,
        ..CommConfig::default()
    };
    let mut ring = Communicator::new(
        MpiTransport::new(&world).expect("MPI transport"),
        cfg.clone(),
    );

    let token = b"mpi-allreduce-bench".to_vec();
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addrs = addresses(&mut native, listener.local_addr().expect("address"));
    let t = TcpTransport::connect(rank, &addrs, listener, TcpConfig::new(token.clone()))
        .expect("TCP mesh");
    let mut tcp = Communicator::new(t, cfg.clone());

    // QUIC: rank 0 creates the run certificate and sends it to everyone.
    let mut cert = Vec::new();
    let mut key = Vec::new();
    if rank == 0 {
        let id = RunIdentity::generate().expect("certificate");
        (cert, key) = (id.cert_der, id.key_der);
    }
    native.broadcast(&mut cert, 0).expect("broadcast");
    native.broadcast(&mut key, 0).expect("broadcast");
    let identity = RunIdentity {
        cert_der: cert,
        key_der: key,
    };
    let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");
    let addrs = addresses(&mut native, socket.local_addr().expect("address"));
    let t = QuicTransport::connect(rank, &addrs, socket, QuicConfig::new(token, identity))
        .expect("QUIC mesh");
    let mut quic = Communicator::new(t, cfg);

    if rank == 0 {
        println!("# all-reduce f32 sum, {n} ranks, mean of {iters} calls after a warm-up");
        println!(
            "{:>6} {:>26} {:>10} {:>10} {:>10} {:>10}",
            "size", "implementation", "time (ms)", "algbw GB/s", "busbw GB/s", "cpu (ms)"
        );
    }
    let factor = 2.0 * (n as f64 - 1.0) / n as f64;
    for &bytes in &sizes {
        let mut data: Vec<f32> = (0..bytes / 4).map(|i| (i % 1000) as f32 * 1e-3).collect();
        let mut rows = Vec::new();
        native.barrier().expect("barrier");
        if run("mpi") {
            rows.push((
                "MPI_Allreduce (native)",
                time(&world, iters, || native.all_reduce_sum_unchecked(&mut data)),
            ));
        }
        if run("ring") {
            rows.push((
                "dtrain ring over MPI p2p",
                time(&world, iters, || {
                    ring.all_reduce_sum(&mut data).expect("all-reduce")
                }),
            ));
        }
        if run("tcp") {
            rows.push((
                "dtrain ring over TCP",
                time(&world, iters, || {
                    tcp.all_reduce_sum(&mut data).expect("all-reduce")
                }),
            ));
        }
        if run("quic") {
            rows.push((
                "dtrain ring over QUIC",
                time(&world, iters, || {
                    quic.all_reduce_sum(&mut data).expect("all-reduce")
                }),
            ));
        }
        for (name, (wall, cpu)) in rows {
            // The slowest rank's time, and the CPU time of all ranks.
            let mut both = wall.to_le_bytes().to_vec();
            both.extend_from_slice(&cpu.to_le_bytes());
            let all = native.all_gather(&both).expect("all-gather");
            let get = |b: &[u8], i: usize| f64::from_le_bytes(b[i..i + 8].try_into().unwrap());
            let wall = all.iter().map(|b| get(b, 0)).fold(0.0, f64::max);
            let cpu: f64 = all.iter().map(|b| get(b, 8)).sum();
            if rank == 0 {
                let algbw = bytes as f64 / wall / 1e9;
                println!(
                    "{:>6} {name:>26} {:>10.2} {algbw:>10.3} {:>10.3} {:>10.1}",
                    fmt_size(bytes),
                    wall * 1e3,
                    algbw * factor,
                    cpu * 1e3
                );
            }
        }
    }
    native.barrier().expect("barrier");
}
