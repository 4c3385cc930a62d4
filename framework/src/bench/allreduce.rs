//! `dtrain bench allreduce`: collective bandwidth over real worker processes, printed like
//! nccl-tests.
//!
//! The launcher ([`launch`]) hosts a rendezvous on 127.0.0.1, starts `workers` copies of
//! the current executable in worker mode (rank, world size and rendezvous address as
//! arguments, the run token in the `DTRAIN_RUN_TOKEN` environment variable), and collects
//! the results that rank 0 prints. Each worker ([`worker`]) joins the rendezvous, builds
//! its TCP or QUIC mesh (optionally with an emulated egress link), and times every size:
//! a barrier, then `iters` back-to-back collectives; the reported time per call is the
//! maximum over ranks (the collective is done when the slowest rank is done).
//!
//! Bandwidths follow nccl-tests: `algbw = size / time`, and
//! `busbw = algbw · factor` with factor `2(N−1)/N` for all-reduce, `(N−1)/N` for all-gather
//! (where `size` is the gathered total, each rank contributing `size/N`) and 1 for
//! broadcast. With link emulation on, each row also carries the α–β prediction
//! ([`dtrain_comms::shaping::LinkSpec`]).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dtrain_comms::rendezvous;
use dtrain_comms::shaping::LinkSpec;
use dtrain_comms::{CommConfig, Communicator, Transport};

pub use crate::launch::TOKEN_ENV;
/// Prefix of the line on which rank 0 prints its results (JSON).
const ROWS_PREFIX: &str = "DTRAIN_BENCH_ROWS ";

pub use crate::config::TransportKind;

pub use super::common::{Op, Options, Row};

// Kept here rather than with `Options` in `common`: it calls `exchange::validate`, and
// `common` imports neither benchmark.
impl Options {
    /// Checks the options at the launcher, before any process starts.
    fn validate(&self) -> Result<(), String> {
        if self.workers == 0 {
            return Err("--workers must be at least 1".into());
        }
        if self.sizes.is_empty() {
            return Err("no sizes to measure".into());
        }
        if self.transport == TransportKind::Auto {
            return Err(
                "--transport auto is for training runs; a benchmark names its transport \
                 (tcp, quic, shm, hybrid or mpi)"
                    .into(),
            );
        }
        super::exchange::validate(self)?;
        self.link().map(|_| ())
    }
}

/// Parses a size such as `1K`, `64M`, `1G`, `4096` (binary multiples).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 1usize << 10),
        Some((i, 'M' | 'm')) => (&t[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    let v: usize = num
        .trim()
        .parse()
        .map_err(|_| format!("size {s:?} is not a number with an optional K, M or G"))?;
    v.checked_mul(mult)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("size {s:?} is out of range"))
}

/// Parses `1K..256M` (every power-of-two multiple from the first to the last, like
/// nccl-tests' `-b 1K -e 256M -f 2`), or a comma-separated list (`1K,64M`).
pub fn parse_sizes(s: &str) -> Result<Vec<usize>, String> {
    if let Some((a, b)) = s.split_once("..") {
        let (lo, hi) = (parse_size(a)?, parse_size(b)?);
        if lo > hi {
            return Err(format!("size range {s:?} is empty"));
        }
        let mut out = Vec::new();
        let mut v = lo;
        while v <= hi {
            out.push(v);
            match v.checked_mul(2) {
                Some(n) => v = n,
                None => break,
            }
        }
        Ok(out)
    } else {
        s.split(',')
            .filter(|x| !x.trim().is_empty())
            .map(parse_size)
            .collect()
    }
}

/// Runs the benchmark: hosts the rendezvous, starts `opts.workers` processes with
/// `exe args… --rank r …` (`args` selects the worker mode of the executable, whose
/// arguments must be parsed into [`WorkerArgs`]), and returns rank 0's rows.
pub fn launch(opts: &Options, exe: &Path, args: &[&str]) -> Result<Vec<Row>, String> {
    opts.validate()?;
    if opts.transport == TransportKind::Mpi {
        return launch_mpi(opts, exe, args);
    }
    let token = rendezvous::random_token().map_err(|e| e.to_string())?;
    let host = crate::launch::host_rendezvous(
        "127.0.0.1:0".parse().expect("loopback address"),
        opts.workers,
        opts.transport,
        &token,
        Duration::from_secs(60).min(opts.timeout),
        false,
    )?;
    let mut children: Vec<(usize, Child)> = Vec::new();
    for rank in 0..opts.workers {
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .args(worker_args(opts, &host.addr().to_string(), rank))
            .env(TOKEN_ENV, &token)
            .stdin(Stdio::null())
            .stdout(if rank == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            });
        match cmd.spawn() {
            Ok(c) => children.push((rank, c)),
            Err(e) => {
                crate::launch::kill_all(&mut children);
                return Err(format!("starting worker {rank}: {e}"));
            }
        }
    }
    let out = children[0].1.stdout.take().expect("rank 0 stdout is piped");
    let reader = std::thread::spawn(move || read_rows(out));
    let deadline = Instant::now() + opts.timeout;
    crate::launch::supervise(&mut children, Some(deadline), Duration::ZERO).map_err(|f| {
        format!(
            "benchmark stopped (limit {:?}): {f}; see the workers' messages above",
            opts.timeout
        )
    })?;
    host.wait().map_err(|e| e.to_string())?;
    match reader.join() {
        Ok(Some(rows)) => rows,
        _ => Err("rank 0 printed no results".into()),
    }
}

/// The worker arguments shared by every rank (`--rank` and `--rendezvous` included, which
/// MPI ranks ignore).
fn worker_args(opts: &Options, rendezvous: &str, rank: usize) -> Vec<String> {
    let sizes: Vec<String> = opts.sizes.iter().map(|s| s.to_string()).collect();
    let mut v: Vec<String> = vec![
        "--rendezvous".into(),
        rendezvous.into(),
        "--rank".into(),
        rank.to_string(),
        "--world".into(),
        opts.workers.to_string(),
        "--transport".into(),
        opts.transport.to_string(),
        "--op".into(),
        opts.op.to_string(),
        "--sizes".into(),
        sizes.join(","),
        "--iters".into(),
        opts.iters.to_string(),
        "--warmup".into(),
        opts.warmup.to_string(),
    ];
    if let Some(b) = &opts.bandwidth {
        v.extend(["--bandwidth".into(), b.clone()]);
    }
    if let Some(l) = &opts.latency {
        v.extend(["--latency".into(), l.clone()]);
    }
    for m in &opts.methods {
        // One method per flag; `;` keeps its parameters together through the CLI's split.
        v.extend(["--compress".into(), m.replace(',', ";")]);
    }
    if let Some(c) = opts.collective {
        v.extend(["--collective".into(), c.to_string()]);
    }
    v
}

/// [`launch`] for `--transport mpi`: one `mpirun` starts every worker; MPI rank 0 prints
/// the rows (mpirun forwards every rank's output; only rank 0 prints the results line).
fn launch_mpi(opts: &Options, exe: &Path, args: &[&str]) -> Result<Vec<Row>, String> {
    if opts.bandwidth.is_some() || opts.latency.is_some() {
        return Err(
            "--bandwidth / --latency are emulated by the tcp, quic and shm transports, not by mpi"
                .into(),
        );
    }
    let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    all.extend(worker_args(opts, "127.0.0.1:1", 0));
    let mut cmd = crate::mpi_env::mpirun_command(opts.workers, exe, &all);
    cmd.stdout(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| {
        format!(
            "starting {:?}: {e} (is Open MPI installed? set {} to its mpirun)",
            cmd.get_program(),
            crate::mpi_env::MPIRUN_ENV
        )
    })?;
    let out = child.stdout.take().expect("stdout is piped");
    let reader = std::thread::spawn(move || read_rows(out));
    let mut children = vec![(0, child)];
    let deadline = Instant::now() + opts.timeout;
    crate::launch::supervise(&mut children, Some(deadline), Duration::ZERO).map_err(|f| {
        format!(
            "benchmark stopped (limit {:?}): mpirun: {f}; see the workers' messages above",
            opts.timeout
        )
    })?;
    match reader.join() {
        Ok(Some(rows)) => rows,
        _ => Err("MPI rank 0 printed no results".into()),
    }
}

/// The rows on a worker's output, if it printed them.
fn read_rows(out: impl std::io::Read) -> Option<Result<Vec<Row>, String>> {
    let mut rows = None;
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        if let Some(j) = line.strip_prefix(ROWS_PREFIX) {
            rows = Some(serde_json::from_str::<Vec<Row>>(j).map_err(|e| e.to_string()));
        }
    }
    rows
}

/// A worker's arguments (what [`launch`] passes).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerArgs {
    /// The rendezvous host.
    pub rendezvous: SocketAddr,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Transport, collective, sizes and link as for the launcher (`workers` = `world`).
    pub opts: Options,
}

/// Runs one worker: joins the rendezvous, builds the mesh, measures every size; rank 0
/// prints the rows for the launcher. The token comes from [`TOKEN_ENV`].
pub fn worker(a: &WorkerArgs) -> Result<(), String> {
    let link = a.opts.link()?;
    // MPI ranks learn their rank from MPI; the environment outlives the communicator.
    let mpi = match a.opts.transport {
        TransportKind::Mpi => Some(crate::mpi_env::MpiEnv::init_for(a.world)?),
        _ => None,
    };
    let rank = mpi.as_ref().map_or(a.rank, crate::mpi_env::MpiEnv::rank);
    let transport = match &mpi {
        Some(env) => env.transport()?,
        None => {
            let token = std::env::var(TOKEN_ENV).map_err(|_| format!("{TOKEN_ENV} is not set"))?;
            crate::launch::connect(
                a.opts.transport,
                a.rendezvous,
                a.rank,
                a.world,
                link,
                &token,
                Duration::from_secs(60),
                crate::launch::Liveness::default(),
                false,
            )?
        }
    };
    let cfg = CommConfig {
        timeout: Duration::from_secs(60),
        ..CommConfig::default()
    };
    let mut c = Communicator::new(transport, cfg);
    let rows = if a.opts.methods.is_empty() {
        measure(&mut c, &a.opts, &link).map_err(|e| e.to_string())?
    } else {
        super::exchange::measure(&mut c, &a.opts)?
    };
    drop(c);
    drop(mpi);
    if rank == 0 {
        let j = serde_json::to_string(&rows).map_err(|e| e.to_string())?;
        println!("{ROWS_PREFIX}{j}");
    }
    Ok(())
}

/// One call of the measured collective on a communicator.
type Call<T> = Box<dyn FnMut(&mut Communicator<T>) -> Result<(), dtrain_comms::CommError>>;

/// Measures every size of `opts` on a connected communicator (all ranks call this).
pub fn measure<T: Transport>(
    c: &mut Communicator<T>,
    opts: &Options,
    link: &LinkSpec,
) -> Result<Vec<Row>, dtrain_comms::CommError> {
    let world = c.world_size();
    let rank = c.rank();
    let mut rows = Vec::new();
    for &bytes in &opts.sizes {
        let iters = opts.iters_for(bytes);
        let (count, mut call): (usize, Call<T>) = match opts.op {
            Op::AllReduce => {
                let n = bytes / 4;
                let mut v: Vec<f32> = (0..n).map(|i| (i % 97) as f32 + rank as f32).collect();
                (
                    n,
                    Box::new(move |c: &mut Communicator<T>| c.all_reduce_sum(&mut v)),
                )
            }
            Op::AllGather => {
                let mine = vec![rank as u8; bytes / world];
                (
                    bytes,
                    Box::new(move |c: &mut Communicator<T>| c.all_gather(&mine).map(|_| ())),
                )
            }
            Op::Broadcast => {
                let mut v = vec![7u8; bytes];
                (
                    bytes,
                    Box::new(move |c: &mut Communicator<T>| {
                        if c.rank() != 0 {
                            v.resize(bytes, 0);
                        }
                        c.broadcast(&mut v, 0)
                    }),
                )
            }
        };
        for _ in 0..opts.warmup {
            call(c)?;
        }
        c.barrier()?;
        let t0 = Instant::now();
        let before = c.total_bytes();
        for _ in 0..iters {
            call(c)?;
        }
        let mut el = [t0.elapsed().as_secs_f32() / iters as f32];
        let sent = (c.total_bytes().sent - before.sent) / iters as u64;
        c.all_reduce_max(&mut el)?;
        let time = el[0] as f64;
        let algbw = bytes as f64 / time / 1e9;
        rows.push(Row {
            bytes,
            count,
            iters,
            time_us: time * 1e6,
            algbw_gbs: algbw,
            busbw_gbs: algbw * opts.op.bus_factor(world),
            predicted_us: link
                .is_shaped()
                .then(|| opts.op.predict(link, bytes, world) * 1e6),
            sent_per_call: sent,
            method: None,
            breakdown: None,
            collective: None,
        });
    }
    Ok(rows)
}

/// Formats rows as an nccl-tests-style table.
pub fn table(opts: &Options, rows: &[Row]) -> String {
    if !opts.methods.is_empty() {
        return super::exchange::table(opts, rows);
    }
    let shaped = rows.iter().any(|r| r.predicted_us.is_some());
    let mut s = format!(
        "# dtrain bench {}: transport {}, {} worker processes on 127.0.0.1{}\n",
        opts.op,
        opts.transport,
        opts.workers,
        opts.link_note()
    );
    s += &format!(
        "# {:>12} {:>12} {:>6} {:>12} {:>11} {:>11}",
        "size(B)", "count", "iters", "time(us)", "algbw(GB/s)", "busbw(GB/s)"
    );
    if shaped {
        s += &format!(" {:>12} {:>9}", "pred(us)", "time/pred");
    }
    s += "\n";
    for r in rows {
        s += &format!(
            "  {:>12} {:>12} {:>6} {:>12.1} {:>11.3} {:>11.3}",
            r.bytes, r.count, r.iters, r.time_us, r.algbw_gbs, r.busbw_gbs
        );
        if let Some(p) = r.predicted_us {
            s += &format!(" {:>12.1} {:>9.3}", p, r.time_us / p);
        }
        s += "\n";
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_nccl_tests() {
        assert_eq!(parse_size("1K").unwrap(), 1024);
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("0").is_err() && parse_size("1X").is_err());
        assert_eq!(parse_sizes("1K..8K").unwrap(), vec![1024, 2048, 4096, 8192]);
        assert_eq!(parse_sizes("1K..1K").unwrap(), vec![1024]);
        assert_eq!(parse_sizes("1K,64M").unwrap(), vec![1024, 64 << 20]);
        assert!(parse_sizes("8K..1K").is_err());
        assert_eq!(parse_sizes("1K..256M").unwrap().len(), 19);
    }

    #[test]
    fn bus_factors_follow_nccl_tests() {
        assert_eq!(Op::AllReduce.bus_factor(2), 1.0);
        assert_eq!(Op::AllReduce.bus_factor(4), 1.5);
        assert_eq!(Op::AllGather.bus_factor(4), 0.75);
        assert_eq!(Op::Broadcast.bus_factor(4), 1.0);
        assert_eq!("mpi".parse::<TransportKind>().unwrap(), TransportKind::Mpi);
        assert!("udp".parse::<TransportKind>().is_err());
        assert_eq!(
            "quic".parse::<TransportKind>().unwrap(),
            TransportKind::Quic
        );
        assert_eq!("allgather".parse::<Op>().unwrap(), Op::AllGather);
    }

    fn opts(op: Op) -> Options {
        Options {
            transport: TransportKind::Tcp,
            workers: 3,
            // Above the 64 KiB recursive-doubling threshold: the all-reduce is the ring.
            sizes: vec![128 << 10, 192 << 10],
            op,
            bandwidth: None,
            latency: None,
            iters: 2,
            warmup: 1,
            timeout: Duration::from_secs(30),
            methods: Vec::new(),
            collective: None,
        }
    }

    /// `measure` over in-process channels: one row per size, consistent bandwidths,
    /// byte counts that match the collective's traffic.
    #[test]
    fn measure_reports_consistent_rows() {
        for op in [Op::AllReduce, Op::AllGather, Op::Broadcast] {
            let o = opts(op);
            let oc = o.clone();
            let rows: Vec<Vec<Row>> = super::super::on_channel_mesh(3, move |c| {
                measure(c, &oc, &LinkSpec::default()).unwrap()
            });
            for (rank, rs) in rows.iter().enumerate() {
                assert_eq!(rs.len(), 2);
                for (r, &bytes) in rs.iter().zip(&o.sizes) {
                    assert_eq!(r.bytes, bytes);
                    assert!(r.time_us > 0.0);
                    let algbw = bytes as f64 / (r.time_us * 1e-6) / 1e9;
                    assert!((r.algbw_gbs - algbw).abs() <= 1e-6 * algbw);
                    assert!((r.busbw_gbs - algbw * op.bus_factor(3)).abs() <= 1e-6 * algbw);
                    assert!(r.predicted_us.is_none());
                    if op == Op::AllReduce {
                        // Ring: 2(N−1)/N of the buffer leaves every rank (plus headers).
                        assert!(r.sent_per_call >= (bytes * 4 / 3) as u64, "{r:?}");
                    }
                    if op == Op::Broadcast && rank == 2 {
                        // The chain's last rank forwards nothing.
                        assert_eq!(r.sent_per_call, 0, "{r:?}");
                    }
                }
                // The time is the maximum over ranks: identical everywhere.
                for (r, r0) in rs.iter().zip(&rows[0]) {
                    assert_eq!(r.time_us, r0.time_us);
                }
            }
        }
        let t = table(&opts(Op::AllReduce), &[]);
        assert!(t.contains("busbw(GB/s)") && !t.contains("pred(us)"));
    }
}
