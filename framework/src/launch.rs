//! `dtrain run`: validate, prepare the run directory, start the workers, supervise them.
//!
//! * **Standalone** (default): this process hosts the rendezvous on loopback and spawns
//!   `cluster.workers` worker processes (`dtrain worker …`), like `torchrun --standalone`.
//! * **Multi-node**: `--nnodes M --node-rank i --rendezvous HOST:PORT` on every node; node 0
//!   hosts the rendezvous at `HOST:PORT`; node `i` runs ranks `i·k … (i+1)·k − 1` with
//!   `k = workers / M`. All nodes must share the run token (`DTRAIN_RUN_TOKEN`).
//! * **Under a scheduler**: with `SLURM_PROCID`/`SLURM_NTASKS` or `OMPI_COMM_WORLD_RANK`/
//!   `OMPI_COMM_WORLD_SIZE` set and `--rendezvous HOST:PORT`, this process *is* one rank
//!   (rank 0 hosts the rendezvous); give `--run-dir` so all ranks share one directory.
//!
//! Everything that can be checked is checked before anything is started or written: the
//! configuration (every field), the data (opened, or fetched when missing and fetchable),
//! and on `--resume` the checkpoint: every rank's file of the newest one is verified, and
//! the run falls back to the newest checkpoint intact on every rank, saying what it
//! skipped.
//!
//! **The launcher is a supervisor** (`node`, `supervise`). A worker that fails stops the
//! run: the supervisor reports the rank and its exit status, stops the others, and names
//! the newest intact checkpoint — or, with `--max-restarts N`, restarts every worker of the
//! node from it, up to N times, recording each restart in `summary.json`. SIGTERM / SIGINT
//! are forwarded to the workers, which checkpoint and exit within `checkpoint.grace_s`; a
//! second signal kills them; the launcher exits with 128 + signal ([`LaunchError`]).
//! Workers die with their launcher ([`crate::signals`]).

pub mod hosts;
mod node;
mod supervise;
mod worker;

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dtrain_comms::rendezvous::{self, Host, RendezvousConfig, RunIdentity};
use dtrain_comms::ShmConfig;

use crate::config::{Plan, RunConfig, TransportKind};
use crate::data::TrainData;
use crate::signals;
use crate::trainer::{Observer, RunDir, Summary};

pub(crate) use supervise::{kill_all, supervise};
pub use worker::{connect, worker, WorkerArgs, REJOINS};

// Defined in `config` (next to the `[cluster]` fields it is built from), so that `config`
// need not import this module; kept here at its old path.
pub use crate::config::Liveness;

/// The environment variable carrying the run token to the workers.
pub const TOKEN_ENV: &str = "DTRAIN_RUN_TOKEN";

/// How long a rendezvous waits for every rank of a training run (workers load their data
/// before joining).
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(120);

/// What `dtrain run` was asked.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// The TOML file.
    pub config: PathBuf,
    /// `--set key=value` overrides.
    pub overrides: Vec<String>,
    /// `--resume RUN_DIR`.
    pub resume: Option<PathBuf>,
    /// `--nnodes`.
    pub nnodes: Option<usize>,
    /// `--node-rank`.
    pub node_rank: Option<usize>,
    /// `--rendezvous HOST:PORT`.
    pub rendezvous: Option<SocketAddr>,
    /// `--run-dir` (scheduler mode, or to choose the directory).
    pub run_dir: Option<PathBuf>,
    /// Do not fetch missing data.
    pub no_fetch: bool,
    /// The `[[sweep]]` variant of the file to run (its label); `None`: the base
    /// configuration.
    pub variant: Option<String>,
    /// `--max-restarts N`: after a worker fails, restart every worker from the newest
    /// intact checkpoint, at most this many times (default 0: a failure ends the run);
    /// under live membership over tcp, replace up to N lost workers by newcomers.
    pub max_restarts: usize,
    /// `--join`: this node (not node 0) joins a running multi-node run, its workers taking
    /// the places of the node's lost ones (live membership over tcp).
    pub join: bool,
}

/// Why `dtrain run` (or one of its ranks) did not finish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchError {
    /// It could not start, or it failed: the message says why and where its state is.
    Failed(String),
    /// A signal stopped it (after the workers checkpointed, when they could).
    Stopped {
        /// The signal (SIGTERM, SIGINT).
        signal: i32,
        /// What happened, and the checkpoint to continue from.
        message: String,
    },
    /// A newcomer could not join the running group (none of its workers answered, they all
    /// left — the run ended — or the rendezvous was gone): it never entered, so the run did
    /// not fail for it, and the launcher does not start another in its place.
    NotJoined(String),
}

/// The exit status of a newcomer that could not join ([`LaunchError::NotJoined`]).
pub const NOT_JOINED_EXIT: u8 = 3;

impl LaunchError {
    /// The process exit status that reports it: 1 for a failure, 128 + signal for a stop
    /// (what a shell reports for a process ended by that signal), [`NOT_JOINED_EXIT`] for
    /// a newcomer that could not join.
    pub fn exit_code(&self) -> u8 {
        match self {
            LaunchError::Failed(_) => 1,
            LaunchError::Stopped { signal, .. } => u8::try_from(128 + signal).unwrap_or(255),
            LaunchError::NotJoined(_) => NOT_JOINED_EXIT,
        }
    }
}

impl std::fmt::Display for LaunchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LaunchError::Failed(m)
            | LaunchError::Stopped { message: m, .. }
            | LaunchError::NotJoined(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for LaunchError {}

impl From<String> for LaunchError {
    fn from(m: String) -> Self {
        LaunchError::Failed(m)
    }
}

impl From<&str> for LaunchError {
    fn from(m: &str) -> Self {
        LaunchError::Failed(m.to_string())
    }
}

/// Loads and validates `opts.config` with its data (fetching data when allowed). Returns the
/// plan. Writes nothing except fetched data.
pub fn check(opts: &RunOptions, log: &mut dyn FnMut(&str)) -> Result<Plan, String> {
    let file = opts.config.display().to_string();
    let mut cfg = RunConfig::load_variant(&opts.config, opts.variant.as_deref(), &opts.overrides)
        .map_err(|e| e.to_string())?;
    // Ranges and combinations first (cheap, no data needed) …
    cfg.validate(&file, None).map_err(|e| e.to_string())?;
    // … then the data, fetched if missing.
    let data = match TrainData::open(&cfg, 0, cfg.cluster.workers) {
        Ok(d) => d,
        Err(e) => {
            let fetchable = cfg.data.path.is_none()
                && cfg
                    .data
                    .kind
                    .fetch_name()
                    .is_some_and(|n| dtrain_datasets::fetch::source(n).is_ok());
            if !fetchable || opts.no_fetch {
                return Err(format!("{file}: data: {e}"));
            }
            let name = cfg.data.kind.fetch_name().expect("fetchable");
            let root = crate::config::default_data_root();
            log(&format!(
                "data {name} missing under {}: fetching it (dtrain data fetch {name})",
                root.display()
            ));
            let src = dtrain_datasets::fetch::source(name).map_err(|e| e.to_string())?;
            dtrain_datasets::fetch::fetch(src, &root)
                .map_err(|e| format!("{file}: data: fetching {name} failed: {e}"))?;
            TrainData::open(&cfg, 0, cfg.cluster.workers)
                .map_err(|e| format!("{file}: data: {e}"))?
        }
    };
    // A language model's vocabulary: the corpus's when unset, refused when it differs.
    cfg.resolve_vocab(&file, data.vocab())
        .map_err(|e| e.to_string())?;
    let plan = cfg
        .validate(&file, Some(data.train_examples()))
        .map_err(|e| e.to_string())?;
    // The weights to start from fit the model (every tensor by name, shape and dtype).
    if let Some(path) = &cfg.model.init_from {
        crate::export::check_init_from(&cfg.model, path)
            .map_err(|e| format!("{file}: model.init_from: {e}"))?;
    }
    Ok(plan)
}

/// `runs/<name>/<UTC timestamp>`.
fn new_run_dir(cfg: &RunConfig) -> Result<PathBuf, String> {
    let base = cfg.output.dir.join(&cfg.name);
    let stamp = utc_stamp(std::time::SystemTime::now());
    let mut dir = base.join(&stamp);
    let mut k = 1;
    while dir.exists() {
        dir = base.join(format!("{stamp}-{k}"));
        k += 1;
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    Ok(dir)
}

/// `YYYYmmdd-HHMMSS` in UTC.
pub fn utc_stamp(t: std::time::SystemTime) -> String {
    let (y, m, d, hh, mm, ss) = utc_civil(t);
    format!("{y:04}{m:02}{d:02}-{hh:02}{mm:02}{ss:02}")
}

/// `t` in UTC as (year, month, day, hour, minute, second); times before 1970 as 1970.
pub fn utc_civil(t: std::time::SystemTime) -> (i64, i64, i64, u64, u64, u64) {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    (y, m, d, rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Keys that may differ between a run and its resumption (they do not change the
/// trajectory up to the checkpoint).
const RESUMABLE_CHANGES: [&str; 6] = [
    "train.epochs",
    "train.max_steps",
    "data.test_limit (evaluation only: a finished run can be re-evaluated on more samples)",
    "checkpoint",
    "output",
    "cluster (a different worker count is checked against the checkpoint)",
];

fn compare_for_resume(old: &RunConfig, new: &RunConfig) -> Result<(), String> {
    let norm = |c: &RunConfig| {
        let mut v = toml::Value::try_from(c).map_err(|e| e.to_string())?;
        let t = v.as_table_mut().expect("table");
        t.remove("checkpoint");
        t.remove("output");
        t.remove("cluster");
        if let Some(tr) = t.get_mut("train").and_then(|x| x.as_table_mut()) {
            tr.remove("epochs");
            tr.remove("max_steps");
        }
        if let Some(d) = t.get_mut("data").and_then(|x| x.as_table_mut()) {
            d.remove("test_limit");
        }
        Ok::<_, String>(v)
    };
    let (a, b) = (norm(old)?, norm(new)?);
    if a != b {
        let (ta, tb) = (a.as_table().expect("t"), b.as_table().expect("t"));
        let mut diff: Vec<String> = ta
            .iter()
            .filter(|(k, v)| tb.get(*k) != Some(*v))
            .map(|(k, _)| k.clone())
            .collect();
        diff.extend(tb.keys().filter(|k| !ta.contains_key(*k)).cloned());
        return Err(format!(
            "the configuration differs from the run's config.toml in [{}]; only {} may change \
             on resume",
            diff.join(", "),
            RESUMABLE_CHANGES.join(", ")
        ));
    }
    Ok(())
}

/// Prepares the run directory: a new one, or the `--resume` one after checking that the
/// configuration is compatible and choosing the checkpoint ([`choose_checkpoint`]). Writes
/// `config.toml`.
pub fn prepare_dir(
    opts: &RunOptions,
    plan: &Plan,
    log: &mut dyn FnMut(&str),
) -> Result<RunDir, String> {
    let cfg = &plan.config;
    let root = if let Some(r) = &opts.resume {
        let old_path = r.join("config.toml");
        let old = RunConfig::load(&old_path, &[])
            .map_err(|e| format!("--resume {}: not a run directory ({e})", r.display()))?;
        compare_for_resume(&old, cfg).map_err(|e| format!("--resume {}: {e}", r.display()))?;
        choose_checkpoint(&RunDir { root: r.clone() }, log)?;
        r.clone()
    } else if let Some(d) = &opts.run_dir {
        std::fs::create_dir_all(d).map_err(|e| format!("creating {}: {e}", d.display()))?;
        d.clone()
    } else {
        new_run_dir(cfg)?
    };
    let p = root.join("config.toml");
    crate::checkpoint::write_atomic(&p, cfg.to_toml().as_bytes()).map_err(|e| e.to_string())?;
    Ok(RunDir { root })
}

/// `--resume`: verifies every rank's file of the newest checkpoint and falls back to the
/// newest one intact on every rank ([`RunDir::newest_intact`]), logging each one skipped and
/// why; points `checkpoints/LATEST` at the one chosen (the workers resume from LATEST).
/// The error, when none is intact, lists what is wrong with each.
pub fn choose_checkpoint(
    dir: &RunDir,
    log: &mut dyn FnMut(&str),
) -> Result<crate::trainer::IntactCheckpoint, String> {
    let r = dir.root.display();
    let (best, skipped) = dir.newest_intact();
    for s in &skipped {
        log(&format!(
            "--resume {r}: skipping checkpoint {}: {}",
            s.dir.display(),
            s.reason
        ));
    }
    let Some(best) = best else {
        let why: Vec<String> = skipped
            .iter()
            .map(|s| format!("{}: {}", s.dir.display(), s.reason))
            .collect();
        return Err(if why.is_empty() {
            format!("--resume {r}: no checkpoint to resume from (checkpoints/ holds none)")
        } else {
            format!(
                "--resume {r}: no checkpoint is intact on every rank ({})",
                why.join("; ")
            )
        });
    };
    if dir.latest().as_deref() != Some(best.dir.as_path()) {
        dir.set_latest(&best.dir).map_err(|e| e.to_string())?;
    }
    if !skipped.is_empty() {
        log(&format!(
            "--resume {r}: continuing from {} (step {}), the newest checkpoint intact on every \
             rank",
            best.dir.display(),
            best.step
        ));
    }
    Ok(best)
}

/// What `cluster.transport = "auto"` becomes for a run of `world` ranks, and why (one line
/// for the launch log); any other kind is returned as it is, with no reason.
///
/// `nodes` is the number of node launchers whose workers the ranks are (`Some(1)`: a
/// standalone `dtrain run`; `Some(M)`: `--nnodes M`), `None` for ranks started by a
/// scheduler. On one node the run uses `shm` — on one host it is 2–5× faster than loopback
/// TCP (`dtrain bench allreduce`) — provided the shared-memory file system has room for the
/// rings with a quarter to spare; on Docker's default 64 MiB `/dev/shm` that is up to 4
/// workers. On several nodes with several workers each it uses `hybrid`: shared memory
/// among each node's workers (the hierarchical all-reduce's host-local stages), TCP
/// between nodes; every node launcher makes the same choice from the same numbers, and a
/// node whose `/dev/shm` lacks room falls back to TCP inside the driver, where its ranks
/// agree on it. Otherwise (one worker per node, ranks started by a scheduler — which may
/// give ranks on one machine separate `/dev/shm`s —, one worker, or too little room on one
/// node) the run uses `tcp`. `newcomers`: the launcher replaces lost workers by
/// newcomers (live membership with `--max-restarts`); newcomers cannot join over shared
/// memory, so one node's ranks then use `tcp` too.
pub fn resolve_transport(
    kind: TransportKind,
    world: usize,
    nodes: Option<usize>,
    newcomers: bool,
) -> (TransportKind, Option<String>) {
    if kind != TransportKind::Auto {
        return (kind, None);
    }
    let (k, why) = match nodes {
        Some(0 | 1) if world > 1 && newcomers => (
            TransportKind::Tcp,
            "--max-restarts under live membership replaces lost workers by newcomers, which \
             join over tcp, not over shared memory"
                .into(),
        ),
        None => (
            TransportKind::Tcp,
            "ranks started by a scheduler may be on several hosts".into(),
        ),
        Some(_) if world <= 1 => (TransportKind::Tcp, "one worker: nothing to connect".into()),
        Some(0 | 1) => {
            let cfg = ShmConfig::new(Vec::new(), Vec::new());
            let free = dtrain_comms::transport::shm::free_bytes(&cfg.dir);
            shm_if_room(world, cfg.mesh_bytes(world), &cfg.dir, free)
        }
        Some(n) if world / n <= 1 => (
            TransportKind::Tcp,
            format!("{n} nodes of one worker each: no two ranks share a host"),
        ),
        Some(n) => (
            TransportKind::Hybrid,
            format!(
                "{n} nodes of {} workers: shared memory among each node's workers (where its \
                 /dev/shm has room for the rings), tcp between the nodes",
                world / n
            ),
        ),
    };
    (
        k,
        Some(format!("cluster.transport = \"auto\": {k} ({why})")),
    )
}

/// The choice of [`resolve_transport`] for two or more ranks on one host, given the bytes
/// their rings need in `dir` and what `statvfs` said is free there.
fn shm_if_room(
    world: usize,
    need: u64,
    dir: &Path,
    free: std::io::Result<u64>,
) -> (TransportKind, String) {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let want = need.saturating_add(need / 4);
    match free {
        Ok(free) if free >= want => (
            TransportKind::Shm,
            format!(
                "{world} workers on this host; their rings take {:.1} MiB of {}, {:.1} MiB free",
                mib(need),
                dir.display(),
                mib(free)
            ),
        ),
        Ok(free) => (
            TransportKind::Tcp,
            format!(
                "the shared-memory rings of {world} workers need {:.1} MiB of {} and only \
                 {:.1} MiB are free; enlarge it (e.g. docker run --shm-size=1g) for the faster \
                 \"shm\"",
                mib(want),
                dir.display(),
                mib(free)
            ),
        ),
        Err(e) => (
            TransportKind::Tcp,
            format!("{} is not usable for shared memory: {e}", dir.display()),
        ),
    }
}

/// Hosts the rendezvous of `world` ranks on `addr` (with the run's TLS identity for QUIC),
/// waiting at most `timeout` for them; `live`: and then serves late joins (newcomers
/// taking a lost rank's place, [`Host::spawn_live`]) until the host is waited for.
pub(crate) fn host_rendezvous(
    addr: SocketAddr,
    world: usize,
    kind: TransportKind,
    token: &str,
    timeout: Duration,
    live: bool,
) -> Result<Host, String> {
    let identity = match kind {
        TransportKind::Quic => RunIdentity::generate().map_err(|e| e.to_string())?,
        TransportKind::Tcp
        | TransportKind::Shm
        | TransportKind::Hybrid
        | TransportKind::Mpi
        | TransportKind::Auto => RunIdentity::default(),
    };
    let listener =
        TcpListener::bind(addr).map_err(|e| format!("rendezvous: binding {addr}: {e}"))?;
    let rcfg = RendezvousConfig {
        timeout,
        ..RendezvousConfig::new(token.as_bytes().to_vec())
    };
    if live {
        Host::spawn_live(listener, world, identity, rcfg)
    } else {
        Host::spawn(listener, world, identity, rcfg)
    }
    .map_err(|e| e.to_string())
}

/// What [`launch`] did.
#[derive(Debug)]
pub struct Launched {
    /// The run directory.
    pub run_dir: PathBuf,
    /// Rank 0's summary (read back from `summary.json`), when this node ran rank 0.
    pub summary: Option<Summary>,
}

/// Validates, prepares the run directory and runs the workers of this node to the end
/// (supervised: see the [module docs](self)). `exe` is the `dtrain` binary, `worker_cmd`
/// the arguments that select its worker mode.
pub fn launch(
    opts: &RunOptions,
    exe: &Path,
    worker_cmd: &[&str],
    log: &mut dyn FnMut(&str),
) -> Result<Launched, LaunchError> {
    let plan = check(opts, log)?;
    let world = plan.config.cluster.workers;
    let (nnodes, node_rank) = (opts.nnodes.unwrap_or(1), opts.node_rank.unwrap_or(0));
    if nnodes == 0 || node_rank >= nnodes {
        return Err(format!("--node-rank {node_rank} must be below --nnodes {nnodes}").into());
    }
    if world % nnodes != 0 {
        return Err(
            format!("cluster.workers = {world} is not divisible by --nnodes {nnodes}").into(),
        );
    }
    if nnodes > 1 && opts.rendezvous.is_none() {
        return Err("--nnodes > 1 needs --rendezvous HOST:PORT (node 0's address)".into());
    }
    let newcomers = plan.config.live_membership() && opts.max_restarts > 0;
    let replaces = plan.config.live_membership()
        && resolve_transport(
            plan.config.cluster.transport,
            world,
            Some(nnodes),
            newcomers,
        )
        .0
        .takes_newcomers();
    if nnodes > 1 && opts.max_restarts > 0 && !replaces {
        return Err(
            "--max-restarts restarts the workers of one node; with --nnodes > 1 the \
                    node launchers would have to agree on every restart, which they do not \
                    yet: restart the run with --resume on every node (or run with \
                    cluster.membership = \"live\" and transport \"tcp\", \"quic\" or \"hybrid\", \
                    where each node replaces its lost workers by newcomers)"
                .into(),
        );
    }
    // Before any worker or run directory exists: a missing driver is one error, here.
    crate::device::check_available(plan.config.cluster.device, world / nnodes)?;
    let token = match std::env::var(TOKEN_ENV) {
        Ok(t) if !t.is_empty() => t,
        _ if nnodes > 1 => {
            return Err(format!(
                "multi-node runs need the same run token on every node: set {TOKEN_ENV}"
            )
            .into())
        }
        _ => rendezvous::random_token().map_err(|e| e.to_string())?,
    };
    // Resolved before the run directory is written: its config.toml names the transport
    // the workers use.
    let mut plan = plan;
    let (kind, why) = resolve_transport(
        plan.config.cluster.transport,
        world,
        Some(nnodes),
        newcomers,
    );
    plan.config.cluster.transport = kind;
    if let Some(why) = why {
        log(&why);
    }
    if newcomers && !kind.takes_newcomers() && kind != TransportKind::Mpi {
        log(&format!(
            "--max-restarts: newcomers cannot join over transport {kind}; a lost worker is \
             dropped and the others go on without it (cluster.transport \"tcp\", \"quic\" \
             or \"hybrid\" replace it)"
        ));
    }
    if kind == TransportKind::Mpi {
        if nnodes > 1 {
            return Err(
                "transport mpi: start multi-node runs with your own mpirun (or srun) \
                        around `dtrain run … --rendezvous HOST:PORT --run-dir DIR`"
                    .into(),
            );
        }
        if opts.max_restarts > 0 {
            return Err(
                "transport mpi: --max-restarts is not supported (mpirun owns the \
                        worker processes); restart with --resume"
                    .into(),
            );
        }
    }
    let dir = prepare_dir(opts, &plan, log)?;
    if kind == TransportKind::Mpi {
        return launch_mpi(opts, &plan, &dir, exe, worker_cmd, &token);
    }
    let per_node = world / nnodes;
    let ranks: Vec<usize> = (node_rank * per_node..(node_rank + 1) * per_node).collect();
    if opts.join {
        if nnodes < 2 || node_rank == 0 {
            return Err(
                "--join: only a node other than node 0 (which hosts the rendezvous) \
                        can join a running run (--nnodes, --node-rank)"
                    .into(),
            );
        }
        if !plan.config.live_membership() || !kind.takes_newcomers() {
            return Err(
                "--join needs cluster.membership = \"live\" and cluster.transport \
                        \"tcp\", \"quic\" or \"hybrid\""
                    .into(),
            );
        }
    }
    let node = node::Node {
        opts,
        plan: &plan,
        dir: &dir,
        exe,
        worker_cmd,
        token: &token,
        ranks: ranks.clone(),
        rendezvous: opts
            .rendezvous
            .unwrap_or_else(|| "127.0.0.1:0".parse().expect("addr")),
        hosts: node_rank == 0,
        node: (nnodes > 1).then_some(node_rank),
        join: opts.join,
    };
    let restarts = node.run(log)?;
    let summary = if ranks.contains(&0) {
        let p = dir.root.join("summary.json");
        let text = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        let mut s: Summary =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))?;
        if !restarts.is_empty() {
            s.restarts = Some(restarts);
            let text = serde_json::to_string_pretty(&s).map_err(|e| e.to_string())?;
            crate::checkpoint::write_atomic(&p, text.as_bytes()).map_err(|e| e.to_string())?;
        }
        Some(s)
    } else {
        None
    };
    Ok(Launched {
        run_dir: dir.root,
        summary,
    })
}

/// [`launch`] for `cluster.transport = "mpi"` on one node: one `mpirun` starts every worker
/// (each learns its rank from MPI).
fn launch_mpi(
    opts: &RunOptions,
    plan: &Plan,
    dir: &RunDir,
    exe: &Path,
    worker_cmd: &[&str],
    token: &str,
) -> Result<Launched, LaunchError> {
    let world = plan.config.cluster.workers;
    let mut args: Vec<String> = worker_cmd.iter().map(|s| s.to_string()).collect();
    args.extend([
        "--run-dir".into(),
        dir.root.display().to_string(),
        // Unused with MPI (every rank learns its rank and peers from MPI).
        "--rendezvous".into(),
        "127.0.0.1:1".into(),
        "--rank".into(),
        "0".into(),
        "--world".into(),
        world.to_string(),
    ]);
    if opts.resume.is_some() {
        args.push("--resume".into());
    }
    let mut cmd = crate::mpi_env::mpirun_command(world, exe, &args);
    cmd.env(TOKEN_ENV, token)
        .env("RAYON_NUM_THREADS", plan.config.cluster.threads.to_string());
    // A signal to this process is forwarded to mpirun, which passes it on to the ranks.
    let _caught =
        signals::catch(false).map_err(|e| format!("catching SIGTERM / SIGINT for mpirun: {e}"))?;
    let child = cmd.spawn().map_err(|e| {
        format!(
            "transport mpi: starting {:?}: {e} (is Open MPI installed? set {} to its mpirun)",
            cmd.get_program(),
            crate::mpi_env::MPIRUN_ENV
        )
    })?;
    let mut children = vec![(0, child)];
    let started = Instant::now();
    let w = supervise::Watch {
        deadline: None,
        grace: Duration::from_secs(5),
        on_signal: Some(Duration::from_secs_f64(plan.config.checkpoint.grace_s)),
        // An MPI world cannot shrink (live membership is refused with it).
        live: false,
    };
    match supervise::watch(&mut children, w) {
        supervise::Ended::Done | supervise::Ended::Survived { .. } => {}
        supervise::Ended::Failed { cause, .. } => {
            return Err(format!(
                "mpirun: {}",
                node::run_failure(&format!("mpirun failed ({cause})"), started, dir)
            )
            .into())
        }
        supervise::Ended::Stopped { signal, note } => {
            return Err(LaunchError::Stopped {
                signal,
                message: format!("mpirun: {}", node::stopped(signal, &note, dir)),
            })
        }
    }
    let p = dir.root.join("summary.json");
    let text = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
    let summary = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))?;
    Ok(Launched {
        run_dir: dir.root.clone(),
        summary: Some(summary),
    })
}

/// This process's rank and world size when it was started by Slurm or Open MPI's
/// `mpirun` (`None` when neither set its variables).
pub fn scheduler_placement() -> Option<Result<rendezvous::Placement, String>> {
    let env: std::collections::HashMap<String, String> = std::env::vars().collect();
    if !(env.contains_key("SLURM_PROCID") || env.contains_key("OMPI_COMM_WORLD_RANK")) {
        return None;
    }
    Some(rendezvous::placement(None, None, &env))
}

/// Scheduler mode: this process is rank `rank` of `world` (from Slurm / Open MPI), rank 0
/// hosts the rendezvous at `opts.rendezvous`. Rank 0 prepares `--run-dir` (and on
/// `--resume` chooses the checkpoint; the ranks check that they all restored the same step).
pub fn run_as_rank(
    opts: &RunOptions,
    rank: usize,
    world: usize,
    obs: &mut dyn Observer,
    log: &mut dyn FnMut(&str),
) -> Result<Summary, LaunchError> {
    if opts.max_restarts > 0 {
        return Err(
            "--max-restarts needs the launcher (`dtrain run` starting its workers); \
                    under a scheduler, use its own requeue and --resume"
                .into(),
        );
    }
    let run_dir = opts
        .run_dir
        .clone()
        .ok_or("under a scheduler, --run-dir (shared by all ranks) is required")?;
    let token = std::env::var(TOKEN_ENV)
        .map_err(|_| format!("under a scheduler, set {TOKEN_ENV} to the same value on every rank"));
    let plan = check(opts, log)?;
    if plan.config.cluster.workers != world {
        return Err(format!(
            "cluster.workers = {} but the scheduler started {world} ranks",
            plan.config.cluster.workers
        )
        .into());
    }
    let mut plan = plan;
    let (kind, why) = resolve_transport(plan.config.cluster.transport, world, None, false);
    plan.config.cluster.transport = kind;
    if let (Some(why), 0) = (why, rank) {
        log(&why);
    }
    let mpi = kind == TransportKind::Mpi;
    // With MPI the connections are MPI's; the address is not used.
    let rdv = match (opts.rendezvous, mpi) {
        (Some(a), _) => a,
        (None, true) => "127.0.0.1:1".parse().expect("address"),
        (None, false) => {
            return Err(
                "under a scheduler, --rendezvous HOST:PORT (rank 0's host) is required".into(),
            )
        }
    };
    if !mpi {
        token.as_ref().map_err(Clone::clone)?;
    }
    let host = if rank == 0 && mpi {
        prepare_dir(opts, &plan, log)?;
        None
    } else if rank == 0 {
        prepare_dir(opts, &plan, log)?;
        Some(host_rendezvous(
            rdv,
            world,
            plan.config.cluster.transport,
            &token?,
            RENDEZVOUS_TIMEOUT,
            plan.config.live_membership(),
        )?)
    } else {
        // Wait for rank 0's config.toml.
        let p = run_dir.join("config.toml");
        let t = Instant::now();
        while !p.exists() {
            if t.elapsed() > Duration::from_secs(120) {
                return Err(format!("{} did not appear (rank 0 not started?)", p.display()).into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    };
    let a = WorkerArgs {
        run_dir,
        rendezvous: rdv,
        rank,
        world,
        resume: opts.resume.is_some(),
        join: false,
    };
    let s = worker(&a, obs)?;
    if let Some(h) = host {
        h.wait().map_err(|e| e.to_string())?;
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dtrain_comms::shaping::LinkSpec;

    #[test]
    fn auto_transport_is_shm_only_on_one_host_with_room_for_the_rings() {
        let dir = Path::new("/dev/shm");
        let need = 8 << 20;
        let ok = |free: u64| Ok(free);
        // Room with a quarter to spare: shared memory.
        let (k, why) = shm_if_room(2, need, dir, ok(10 << 20));
        assert_eq!(k, TransportKind::Shm, "{why}");
        assert!(why.contains("8.0 MiB of /dev/shm"), "{why}");
        // Enough for the rings but not the spare quarter, or too little: tcp, saying why.
        for free in [(9 << 20) + (1 << 19), 1 << 20, 0] {
            let (k, why) = shm_if_room(2, need, dir, ok(free));
            assert_eq!(k, TransportKind::Tcp);
            assert!(why.contains("need 10.0 MiB of /dev/shm"), "{why}");
            assert!(why.contains("--shm-size"), "{why}");
        }
        let gone = Err(std::io::Error::from(std::io::ErrorKind::NotFound));
        let (k, why) = shm_if_room(2, need, dir, gone);
        assert_eq!(k, TransportKind::Tcp);
        assert!(why.contains("/dev/shm is not usable"), "{why}");
        // A scheduler's ranks, one worker, one worker per node: tcp without looking.
        for (world, nodes) in [(4, None), (1, Some(1)), (3, Some(3))] {
            let (k, why) = resolve_transport(TransportKind::Auto, world, nodes, false);
            assert_eq!(k, TransportKind::Tcp, "{why:?}");
        }
        // Several nodes of several workers: hybrid, decided from the numbers alone (every
        // node launcher must choose alike).
        let (k, why) = resolve_transport(TransportKind::Auto, 8, Some(2), false);
        assert_eq!(k, TransportKind::Hybrid);
        assert!(why.unwrap().contains("2 nodes of 4 workers"));
        // Hybrid takes newcomers; one node's shared memory does not: tcp there.
        let (k, _) = resolve_transport(TransportKind::Auto, 8, Some(2), true);
        assert_eq!(k, TransportKind::Hybrid);
        let (k, why) = resolve_transport(TransportKind::Auto, 4, Some(1), true);
        assert_eq!(k, TransportKind::Tcp);
        assert!(why.unwrap().contains("--max-restarts"));
        // Other kinds pass through untouched, with nothing to log.
        for k in [
            TransportKind::Tcp,
            TransportKind::Quic,
            TransportKind::Shm,
            TransportKind::Hybrid,
            TransportKind::Mpi,
        ] {
            assert_eq!(resolve_transport(k, 4, Some(1), true), (k, None));
        }
        // The real lookup names what it chose.
        let (k, why) = resolve_transport(TransportKind::Auto, 2, None, false);
        assert_eq!(k, TransportKind::Tcp);
        assert_eq!(
            why.as_deref(),
            Some(
                "cluster.transport = \"auto\": tcp (ranks started by a scheduler may be on \
                 several hosts)"
            )
        );
    }

    #[test]
    fn a_worker_refuses_an_unresolved_auto_transport() {
        let e = connect(
            TransportKind::Auto,
            "127.0.0.1:1".parse().unwrap(),
            0,
            2,
            LinkSpec::default(),
            "t",
            Duration::from_millis(10),
            Liveness::default(),
            false,
        )
        .err()
        .expect("auto cannot connect");
        assert!(e.contains("resolved by the launcher"), "{e}");
    }

    #[test]
    fn utc_stamps_are_civil_dates() {
        let t = std::time::UNIX_EPOCH + Duration::from_secs(1_795_000_000);
        assert_eq!(utc_stamp(t), "20261118-110640");
        assert_eq!(utc_stamp(std::time::UNIX_EPOCH), "19700101-000000");
        let leap = std::time::UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(utc_stamp(leap), "20000229-000000");
    }

    #[test]
    fn resume_allows_only_changes_that_keep_the_trajectory() {
        let base = "name = \"r\"\n[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\n\
                    batch_size = 8\n[train]\nepochs = 1\nlr = 0.1\n";
        let cfg = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            RunConfig::parse(base, "r.toml", &sets).unwrap()
        };
        let old = cfg(&[]);
        for ok in ["train.epochs=3", "data.test_limit=100", "cluster.workers=2"] {
            compare_for_resume(&old, &cfg(&[ok])).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        let e = compare_for_resume(&old, &cfg(&["train.lr=0.5"])).unwrap_err();
        assert!(e.contains("[train]"), "{e}");
        let e = compare_for_resume(&old, &cfg(&["data.batch_size=4"])).unwrap_err();
        assert!(e.contains("[data]"), "{e}");
    }
}
