//! All-reduce bandwidth, nccl-tests style, side by side in one run: native `MPI_Allreduce`,
//! dtrain's ring driven over [`MpiTransport`] (MPI point-to-point), and dtrain's ring over
//! TCP on 127.0.0.1 (addresses exchanged through MPI). The three all-reduce the same
//! buffer on the same processes, one after the other.
//!
//! ```text
//! cargo build --release -p dtrain-comms --features mpi --example mpi_allreduce
//! mpirun --oversubscribe -n 4 target/release/examples/mpi_allreduce [BYTES] [ITERS]
//! ```
//!
//! BYTES defaults to 64 MiB (f32), ITERS to 5 (after one warm-up call). Prints, on rank 0,
//! the mean time per call, algbw = bytes / time and busbw = algbw · 2(N−1)/N.

use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use dtrain_comms::{
    CommConfig, Communicator, MpiCollectives, MpiTransport, TcpConfig, TcpTransport,
};
use mpi::environment::Threading;
use mpi::topology::Communicator as _;

fn time<F: FnMut()>(iters: usize, mut f: F) -> Duration {
    f(); // warm-up
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    start.elapsed() / iters as u32
}

fn main() {
    let mut args = std::env::args().skip(1);
    let bytes: usize = args.next().map_or(64 << 20, |a| a.parse().expect("BYTES"));
    let iters: usize = args.next().map_or(5, |a| a.parse().expect("ITERS"));
    let (universe, _) =
        mpi::initialize_with_threading(Threading::Serialized).expect("MPI initialises");
    let world = universe.world();
    let (rank, n) = (world.rank() as usize, world.size() as usize);
    let elems = bytes / 4;
    let mut data: Vec<f32> = (0..elems).map(|i| (i % 1000) as f32 * 1e-3).collect();

    let mut native = MpiCollectives::new(&world).expect("MPI collectives");
    native.barrier().unwrap();
    let t_mpi = time(iters, || native.all_reduce_sum_unchecked(&mut data));

    let cfg = CommConfig {
        chunk_bytes: 4 << 20,
        ..CommConfig::default()
    };
    let t = MpiTransport::new(&world).expect("MPI transport");
    let mut ring = Communicator::new(t, cfg.clone());
    native.barrier().unwrap();
    let t_ring = time(iters, || {
        ring.all_reduce_sum(&mut data).expect("all-reduce")
    });

    // TCP: every rank listens on an ephemeral loopback port; addresses go through MPI.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let me = listener.local_addr().expect("address").to_string();
    let addrs: Vec<SocketAddr> = native
        .all_gather(me.as_bytes())
        .expect("all-gather")
        .iter()
        .map(|a| String::from_utf8_lossy(a).parse().expect("address"))
        .collect();
    let tcp_cfg = TcpConfig::new(b"mpi-allreduce-bench".to_vec());
    let t = TcpTransport::connect(rank, &addrs, listener, tcp_cfg).expect("TCP mesh");
    let mut tcp = Communicator::new(t, cfg);
    native.barrier().unwrap();
    let t_tcp = time(iters, || tcp.all_reduce_sum(&mut data).expect("all-reduce"));
    native.barrier().unwrap();

    if rank == 0 {
        let factor = 2.0 * (n as f64 - 1.0) / n as f64;
        println!("# all-reduce f32 sum, {n} ranks, {bytes} bytes, mean of {iters} calls");
        println!(
            "{:>28} {:>12} {:>12} {:>12}",
            "implementation", "time (ms)", "algbw GB/s", "busbw GB/s"
        );
        for (name, t) in [
            ("MPI_Allreduce (native)", t_mpi),
            ("dtrain ring over MPI p2p", t_ring),
            ("dtrain ring over TCP", t_tcp),
        ] {
            let algbw = bytes as f64 / t.as_secs_f64() / 1e9;
            println!(
                "{name:>28} {:>12.2} {:>12.3} {:>12.3}",
                t.as_secs_f64() * 1e3,
                algbw,
                algbw * factor
            );
        }
    }
}
