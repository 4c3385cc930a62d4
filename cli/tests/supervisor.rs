//! Issue #24 through the real binary: `dtrain run` as a supervisor. SIGTERM stops the
//! workers with a checkpoint that resumes bit-exactly; workers die with their launcher; a
//! killed worker ends the run (or, with `--max-restarts`, is restarted); a damaged newest
//! checkpoint is skipped on `--resume`; and (with `DTRAIN_E2E=1`) a bounded chaos test.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use dtrain_framework::checkpoint::Checkpoint;

fn config(out: &Path, workers: usize) -> String {
    format!(
        r#"
name = "sup"
seed = 7
[model]
kind = "mlp"
in_channels = 1
image_size = 8
hidden = [16]
[data]
kind = "synthetic"
shape = [1, 8, 8]
train_len = 2048
test_len = 128
batch_size = 8
[train]
lr = 0.05
momentum = 0.9
epochs = 10
[cluster]
workers = {workers}
transport = "tcp"
heartbeat_s = 0.2
peer_timeout_s = 2.0
# A failure stops the run, or restarts every worker (the tests of live membership, the
# default, set it back to "auto" or "live").
membership = "fixed"
[compress]
kind = "topk"
ratio = 0.1
# Pinned: "auto" picks each bucket's collective from timings taken at start-up, so a
# straight run and a stopped one could route (and round) differently on a loaded machine.
collective = "allgather"
[checkpoint]
every_steps = 25
every_epochs = 0
grace_s = 20
[output]
dir = "{}"
"#,
        out.display()
    )
}

/// A `dtrain run` in the background, its output in files.
struct Launcher {
    child: Child,
    dir: PathBuf,
    stderr: PathBuf,
}

impl Launcher {
    fn start(cfg: &Path, dir: &Path, args: &[&str]) -> Launcher {
        let stderr = dir.with_extension("stderr");
        let child = Command::new(env!("CARGO_BIN_EXE_dtrain"))
            .arg("run")
            .arg(cfg)
            .arg("--run-dir")
            .arg(dir)
            .args(args)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(dir.with_extension("stdout")).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        Launcher {
            child,
            dir: dir.to_path_buf(),
            stderr,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits at most `limit` for the launcher to exit.
    fn wait(&mut self, limit: Duration) -> (ExitStatus, Duration, String) {
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return (st, t.elapsed(), self.log());
            }
            if t.elapsed() > limit {
                let _ = self.child.kill();
                panic!("dtrain run did not end within {limit:?}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Waits until `metrics.jsonl` holds at least `n` steps.
    fn wait_for_steps(&mut self, n: usize) {
        let t = Instant::now();
        while steps_logged(&self.dir) < n {
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!("the run ended ({st}) before step {n}:\n{}", self.log());
            }
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "no step {n} in 120 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Whatever a failed test left behind.
        for pid in processes_of(&self.dir) {
            signal(pid, "KILL");
        }
    }
}

fn steps_logged(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

fn signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {pid}");
}

/// The processes whose command line names `dir` (the launcher and its workers).
fn processes_of(dir: &Path) -> Vec<u32> {
    let needle = dir.to_string_lossy().to_string();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        // A zombie has an empty command line.
        if cmd.contains(&needle) && !cmd.is_empty() {
            out.push(pid);
        }
    }
    out
}

/// The pid of worker `rank` of the run in `dir`.
fn worker_pid(dir: &Path, rank: usize) -> u32 {
    let t = Instant::now();
    loop {
        for pid in processes_of(dir) {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<String> = cmd
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).to_string())
                .collect();
            let is = |i: usize, s: &str| args.get(i).is_some_and(|a| a == s);
            if let Some(i) = args.iter().position(|a| a == "--rank") {
                if is(1, "worker") && is(i + 1, &rank.to_string()) {
                    return pid;
                }
            }
        }
        assert!(t.elapsed() < Duration::from_secs(30), "no worker {rank}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Asserts that no process of the run in `dir` is left, waiting at most `limit`.
fn assert_none_left(dir: &Path, limit: Duration) {
    let t = Instant::now();
    loop {
        let left = processes_of(dir);
        if left.is_empty() {
            return;
        }
        assert!(
            t.elapsed() < limit,
            "processes left after {limit:?}: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The run's final parameters: rank 0's file of the checkpoint LATEST names.
fn final_params(dir: &Path) -> Vec<f32> {
    let latest = std::fs::read_to_string(dir.join("checkpoints/LATEST")).unwrap();
    Checkpoint::load(
        &dir.join("checkpoints")
            .join(latest.trim())
            .join("rank-0.ckpt"),
    )
    .unwrap()
    .f32("params")
    .unwrap()
}

fn latest_step(dir: &Path) -> u64 {
    let latest = std::fs::read_to_string(dir.join("checkpoints/LATEST")).unwrap();
    latest.trim().trim_start_matches("step-").parse().unwrap()
}

/// `(step, loss as written)` of every line of `metrics.jsonl`.
fn losses(dir: &Path) -> Vec<(u64, String)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].to_string())
        })
        .collect()
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

fn setup(workers: usize) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("sup.toml");
    std::fs::write(&cfg, config(&tmp.path().join("runs"), workers)).unwrap();
    (tmp, cfg)
}

/// Issue #24, acceptance: SIGTERM to the launcher leaves no `dtrain worker` after 10 s,
/// writes a checkpoint at the stopping step, and `--resume` continues bit-exactly from it.
#[test]
fn sigterm_stops_the_workers_with_a_checkpoint_that_resumes_bit_exactly() {
    let (tmp, cfg) = setup(2);
    let steps = "train.max_steps=200";
    let straight = tmp.path().join("straight");
    let (st, _, log) =
        Launcher::start(&cfg, &straight, &["--set", steps]).wait(Duration::from_secs(120));
    assert!(st.success(), "{log}");

    let dir = tmp.path().join("stopped");
    let mut run = Launcher::start(&cfg, &dir, &["--set", steps]);
    run.wait_for_steps(30);
    signal(run.pid(), "TERM");
    let sent = Instant::now();
    let (st, _, log) = run.wait(Duration::from_secs(30));
    assert_eq!(st.code(), Some(128 + 15), "{log}");
    assert_none_left(&dir, Duration::from_secs(10).saturating_sub(sent.elapsed()));
    assert!(log.contains("stopped by SIGTERM"), "{log}");
    // The checkpoint is at the stopping step: every logged step is in it.
    let stop = latest_step(&dir);
    assert!((30..200).contains(&stop), "stopped at {stop}:\n{log}");
    assert_eq!(steps_logged(&dir) as u64, stop, "{log}");
    assert!(
        log.contains(&format!("step {stop}; continue with --resume")),
        "{log}"
    );
    assert!(!dir.join("summary.json").exists());

    let (st, _, log) = Launcher::start(
        &cfg,
        &dir,
        &["--set", steps, "--resume", dir.to_str().unwrap()],
    )
    .wait(Duration::from_secs(120));
    assert!(st.success(), "{log}");
    assert_eq!(summary(&dir)["resumed_from"], stop);
    let (a, b) = (final_params(&straight), final_params(&dir));
    assert!(
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
        "the resumed run's parameters differ from the uninterrupted run's"
    );
    assert_eq!(losses(&dir), losses(&straight));
}

/// SIGKILL to the launcher (nothing can forward it): the workers die with it.
#[test]
fn workers_die_with_their_launcher() {
    let (tmp, cfg) = setup(2);
    let dir = tmp.path().join("orphans");
    let mut run = Launcher::start(&cfg, &dir, &["--set", "train.epochs=100"]);
    run.wait_for_steps(5);
    let workers = [worker_pid(&dir, 0), worker_pid(&dir, 1)];
    signal(run.pid(), "KILL");
    let _ = run.wait(Duration::from_secs(10));
    assert_none_left(&dir, Duration::from_secs(5));
    for w in workers {
        assert!(
            !Path::new(&format!("/proc/{w}/cmdline")).exists() || {
                // Reaped by init by now, or a zombie with an empty command line.
                std::fs::read(format!("/proc/{w}/cmdline"))
                    .unwrap_or_default()
                    .is_empty()
            }
        );
    }
}

/// A second signal does not wait for the checkpoint: the workers are killed at once.
#[test]
fn a_second_signal_stops_at_once() {
    let (tmp, cfg) = setup(2);
    let dir = tmp.path().join("twice");
    let mut run = Launcher::start(&cfg, &dir, &["--set", "train.epochs=100"]);
    run.wait_for_steps(5);
    signal(run.pid(), "TERM");
    signal(run.pid(), "INT");
    let (st, took, log) = run.wait(Duration::from_secs(20));
    assert!(
        st.code() == Some(128 + 2) || st.code() == Some(128 + 15),
        "{st}\n{log}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert_none_left(&dir, Duration::from_secs(5));
    assert!(log.contains("stopped by SIG"), "{log}");
}

/// Issue #24, acceptance: SIGKILL of one worker ends the run non-zero within 30 s with no
/// process left; with `--max-restarts 1` it completes and `summary.json` records the
/// restart.
#[test]
fn a_killed_worker_ends_the_run_or_is_restarted_from_the_newest_intact_checkpoint() {
    let (tmp, cfg) = setup(2);
    let dir = tmp.path().join("killed");
    let mut run = Launcher::start(&cfg, &dir, &["--set", "train.epochs=100"]);
    run.wait_for_steps(60);
    signal(worker_pid(&dir, 1), "KILL");
    let (st, took, log) = run.wait(Duration::from_secs(30));
    assert_eq!(st.code(), Some(1), "{log}");
    assert!(took < Duration::from_secs(30));
    assert_none_left(&dir, Duration::from_secs(1));
    assert!(
        log.contains("worker 1 failed") && log.contains("SIGKILL"),
        "{log}"
    );
    assert!(log.contains("newest intact checkpoint"), "{log}");

    let dir = tmp.path().join("restarted");
    let steps = "train.max_steps=300";
    let mut run = Launcher::start(&cfg, &dir, &["--set", steps, "--max-restarts", "1"]);
    run.wait_for_steps(60);
    signal(worker_pid(&dir, 1), "KILL");
    let (st, _, log) = run.wait(Duration::from_secs(120));
    assert!(st.success(), "{log}");
    assert!(log.contains("restart 1 of 1 from checkpoint"), "{log}");
    let s = summary(&dir);
    let r = &s["restarts"];
    assert_eq!(r.as_array().map(Vec::len), Some(1), "{s}");
    assert_eq!(r[0]["rank"], 1);
    assert!(r[0]["cause"].as_str().unwrap().contains("SIGKILL"), "{s}");
    assert!(r[0]["step"].as_u64().unwrap() >= 50, "{s}");
    // The work lost: the steps from the checkpoint to where the kill found the run (60 or
    // more were logged), and their time.
    let (from, reached) = (
        r[0]["step"].as_u64().unwrap(),
        r[0]["reached"].as_u64().unwrap(),
    );
    assert!(reached >= 60 && reached >= from, "{s}");
    assert_eq!(r[0]["steps_lost"].as_u64(), Some(reached - from), "{s}");
    let lost_s = r[0]["lost_s"].as_f64().unwrap();
    assert!(lost_s >= 0.0 && (reached == from) == (lost_s == 0.0), "{s}");
    assert!(log.contains("of training lost): restart 1 of 1"), "{log}");
    assert_eq!(s["steps"], 300);
    // Each step is recorded once, in order, though some ran twice.
    let steps: Vec<u64> = losses(&dir).iter().map(|l| l.0).collect();
    assert_eq!(steps, (0..300).collect::<Vec<_>>());
    assert_none_left(&dir, Duration::from_secs(1));
}

/// Issue #53, acceptance: with live membership (the default, `cluster.membership =
/// "auto"`), a 3-worker run whose worker is SIGKILLed mid-run exits 0 with every step done,
/// the other two worker processes alive from start to end (the same pids: not restarted),
/// and the change in `summary.json`. Worker 0 is killed — the one that writes the logs — so the new leader
/// takes them over: every step is logged once.
#[test]
fn under_live_membership_a_killed_worker_is_dropped_and_the_others_finish() {
    let (tmp, cfg) = setup(3);
    let dir = tmp.path().join("live");
    // Long enough that the kill lands mid-run on a loaded machine (the run takes ~2 s).
    let steps = "train.max_steps=2400";
    let mut run = Launcher::start(
        &cfg,
        &dir,
        &[
            "--set",
            steps,
            "--set",
            "train.epochs=100",
            "--set",
            "cluster.membership=\"auto\"",
        ],
    );
    let survivors = [worker_pid(&dir, 1), worker_pid(&dir, 2)];
    run.wait_for_steps(60);
    let killed = worker_pid(&dir, 0);
    signal(killed, "KILL");
    // The survivors are the same processes throughout: no other worker process appears
    // (the killed one may linger for a moment before it is reaped).
    let t = Instant::now();
    while run.child.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(120) {
        for pid in processes_of(&dir) {
            if pid != run.pid() && pid != killed {
                assert!(survivors.contains(&pid), "a new worker {pid}: restarted?");
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (st, _, log) = run.wait(Duration::from_secs(5));
    assert!(st.success(), "{log}");
    assert!(log.contains("worker 0 was lost"), "{log}");
    let s = summary(&dir);
    assert_eq!(s["steps"], 2400, "{s}");
    let m = s["membership"].as_array().expect("membership recorded");
    assert_eq!(m.len(), 1, "{s}");
    assert_eq!(m[0]["removed"], serde_json::json!([0]));
    assert_eq!(m[0]["members"], serde_json::json!([1, 2]));
    assert!(m[0]["step"].as_u64().unwrap() >= 60, "{s}");
    assert!(m[0]["cause"].as_str().unwrap().contains("rank 0"), "{s}");
    let steps: Vec<u64> = losses(&dir).iter().map(|l| l.0).collect();
    assert_eq!(steps, (0..2400).collect::<Vec<_>>());
    assert!(final_params(&dir).iter().all(|x| x.is_finite()));
    assert_none_left(&dir, Duration::from_secs(1));
}

/// Issue #53: under live membership, `--max-restarts 1` replaces a SIGKILLed worker by a
/// newcomer, over TCP and over QUIC: it joins the running group (the late rendezvous, the
/// driver's join, the members' state handed over) and trains with the others to the end,
/// the replicas' hashes agreeing at every check; the two survivors are never restarted;
/// summary.json has the loss and the entry.
#[test]
fn under_live_membership_a_lost_worker_is_replaced_by_a_newcomer() {
    let (tmp, cfg) = setup(3);
    // The default settings (membership and transport "auto": live, and tcp rather than
    // shared memory, where newcomers cannot join), and QUIC, where a SIGKILLed worker sends
    // no close: the survivors drop it at the step deadline (its floor, 10 s).
    for transport in ["auto", "quic"] {
        let dir = tmp.path().join(format!("replaced-{transport}"));
        let transport_set = format!("cluster.transport=\"{transport}\"");
        let mut run = Launcher::start(
            &cfg,
            &dir,
            &[
                "--max-restarts",
                "1",
                "--set",
                "train.max_steps=6000",
                "--set",
                "train.epochs=100",
                "--set",
                "cluster.membership=\"auto\"",
                "--set",
                &transport_set,
                "--set",
                "cluster.check_replicas_every=25",
            ],
        );
        let survivors = [worker_pid(&dir, 0), worker_pid(&dir, 1)];
        run.wait_for_steps(60);
        let killed = worker_pid(&dir, 2);
        signal(killed, "KILL");
        // Throughout: the survivors, and at most one newcomer, started with --join.
        let t = Instant::now();
        let mut newcomer = None;
        while run.child.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(180) {
            for pid in processes_of(&dir) {
                if pid == run.pid() || pid == killed || survivors.contains(&pid) {
                    continue;
                }
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                if cmd.is_empty() {
                    continue;
                }
                assert!(
                    cmd.contains("--join"),
                    "a new worker {pid} ({cmd}): restarted?"
                );
                assert_eq!(*newcomer.get_or_insert(pid), pid, "a second newcomer");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(newcomer.is_some(), "no newcomer was seen");
        let (st, _, log) = run.wait(Duration::from_secs(5));
        assert!(st.success(), "{log}");
        assert!(log.contains("worker 2 was lost"), "{log}");
        assert!(log.contains("worker 2: a newcomer took its place"), "{log}");
        if transport == "auto" {
            assert!(
                log.contains("tcp (--max-restarts under live membership"),
                "{log}"
            );
        }
        let s = summary(&dir);
        assert_eq!(s["steps"], 6000, "{s}");
        let m = s["membership"].as_array().expect("membership recorded");
        assert_eq!(m.len(), 2, "{s}");
        assert_eq!(m[0]["removed"], serde_json::json!([2]));
        assert_eq!(m[1]["added"], serde_json::json!([2]));
        assert_eq!(m[1]["members"], serde_json::json!([0, 1, 2]));
        let entered = m[1]["step"].as_u64().unwrap();
        assert!(
            entered > m[0]["step"].as_u64().unwrap() && entered < 6000,
            "{s}"
        );
        let steps: Vec<u64> = losses(&dir).iter().map(|l| l.0).collect();
        assert_eq!(steps, (0..6000).collect::<Vec<_>>());
        // Rank 0 logged every check of the replicas' hashes, the newcomer's included.
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        let hashes = text.lines().filter(|l| l.contains("param_hash")).count();
        assert!(hashes >= 6000 / 25 - 1, "{hashes} checks");
        assert_none_left(&dir, Duration::from_secs(1));
    }
}

/// Issue #53, acceptance: under live membership a worker stopped (SIGSTOP) for less than
/// the step deadline is waited for, not dropped; one stopped for longer is dropped, the
/// others go on, and when it is continued it learns so and comes back as a newcomer (the
/// same process joins the running group again, over tcp) instead of training on alone.
/// The transports' own peer timeout (2 s here) does not drop it first.
#[test]
fn under_live_membership_a_stopped_worker_is_dropped_only_past_the_deadline() {
    let (tmp, cfg) = setup(3);
    let live = [
        "--set",
        "train.epochs=100",
        "--set",
        "cluster.membership=\"live\"",
        "--set",
        "cluster.transport=\"tcp\"",
        "--set",
        "cluster.deadline_floor_s=4",
        "--set",
        "cluster.timeout_s=30",
    ];
    // Long enough for the stopped worker to come back before the end (the survivors' steps
    // take ~0.5 ms). When it failed here (ae3dae2's CI, and 2 of 3 runs of this file under
    // its own load), the continued worker had been stopped inside its gradient exchange,
    // not its control all-reduce, and did not know the error as its exclusion, so it
    // stopped instead of coming back (`TrainError::comm_error`).
    for (name, pause, dropped, steps) in [
        ("paused", 1.5, false, 4000u64),
        ("stopped", 7.0, true, 20000),
    ] {
        let dir = tmp.path().join(name);
        let mut args: Vec<String> = live.iter().map(|s| s.to_string()).collect();
        args.extend(["--set".into(), format!("train.max_steps={steps}")]);
        args.extend(["--set".into(), format!("train.epochs={}", steps / 40)]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut run = Launcher::start(&cfg, &dir, &args);
        run.wait_for_steps(60);
        let victim = worker_pid(&dir, 2);
        signal(victim, "STOP");
        std::thread::sleep(Duration::from_secs_f64(pause));
        signal(victim, "CONT");
        let (st, _, log) = run.wait(Duration::from_secs(120));
        assert!(st.success(), "{name}: {log}");
        let s = summary(&dir);
        assert_eq!(s["steps"], steps, "{name}: {s}");
        match (dropped, s["membership"].as_array()) {
            (false, None) => {}
            (true, Some(m)) => {
                assert_eq!(m[0]["removed"], serde_json::json!([2]), "{s}");
                let lost = m[0]["lost_s"].as_f64().unwrap();
                assert!((3.0..7.0).contains(&lost), "{s}");
                // Back as a newcomer: the same process (the launcher starts none here).
                assert_eq!(m.len(), 2, "{s}\n{log}");
                assert_eq!(m[1]["added"], serde_json::json!([2]), "{s}\n{log}");
                assert!(!log.contains("worker 2 was lost"), "{log}");
            }
            (d, m) => panic!("{name}: dropped {d}, membership {m:?}: {log}"),
        }
        assert_none_left(&dir, Duration::from_secs(1));
    }
}

/// Issue #24, acceptance: the newest checkpoint damaged (one byte of rank-0.ckpt):
/// `--resume` continues from the previous intact checkpoint and says so.
#[test]
fn resume_skips_a_damaged_newest_checkpoint_and_says_so() {
    let (tmp, cfg) = setup(2);
    let dir = tmp.path().join("damaged");
    let (st, _, log) = Launcher::start(&cfg, &dir, &["--set", "train.max_steps=75"])
        .wait(Duration::from_secs(120));
    assert!(st.success(), "{log}");
    let newest = dir.join("checkpoints/step-0000000075/rank-0.ckpt");
    let mut b = std::fs::read(&newest).unwrap();
    b[100] ^= 1;
    std::fs::write(&newest, b).unwrap();
    let (st, _, log) = Launcher::start(
        &cfg,
        &dir,
        &[
            "--set",
            "train.max_steps=100",
            "--resume",
            dir.to_str().unwrap(),
        ],
    )
    .wait(Duration::from_secs(120));
    assert!(st.success(), "{log}");
    assert!(
        log.contains("skipping checkpoint")
            && log.contains("step-0000000075/rank-0.ckpt")
            && log.contains("checksum"),
        "{log}"
    );
    assert!(
        log.contains("continuing from") && log.contains("step-0000000050"),
        "{log}"
    );
    let s = summary(&dir);
    assert_eq!(
        (s["resumed_from"].as_u64(), s["steps"].as_u64()),
        (Some(50), Some(100))
    );
}

/// A small deterministic generator for the chaos trials (seeded, printed, repeatable).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

/// Issue #24, scope 6 (bounded form; CI runs it with `DTRAIN_E2E=1`): trials of a short
/// 3-worker run where a random worker gets SIGKILL or SIGSTOP at a random step. Without
/// `--max-restarts` each ends non-zero within `peer_timeout_s + 10 s` with no process
/// left; with `--max-restarts 1` each completes with finite parameters and an accuracy
/// within noise of an undisturbed run. `DTRAIN_CHAOS_TRIALS` (default 2 of each) and
/// `DTRAIN_CHAOS_SEED` make it longer or repeat one.
#[test]
fn chaos_trials_end_cleanly_or_complete_with_a_restart() {
    if std::env::var("DTRAIN_E2E").as_deref() != Ok("1") {
        eprintln!("skipped: set DTRAIN_E2E=1 to run the chaos trials");
        return;
    }
    let trials: usize = std::env::var("DTRAIN_CHAOS_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let seed = std::env::var("DTRAIN_CHAOS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("chaos: {trials} trials of each kind, DTRAIN_CHAOS_SEED={seed}");
    let mut rng = Lcg(seed);
    let (tmp, cfg) = setup(3);
    let steps = "train.max_steps=240";
    let reference = tmp.path().join("reference");
    let (st, _, log) =
        Launcher::start(&cfg, &reference, &["--set", steps]).wait(Duration::from_secs(120));
    assert!(st.success(), "{log}");
    let accuracy = |dir: &Path| summary(dir)["final_eval"]["accuracy"].as_f64().unwrap();
    let want = accuracy(&reference);
    // peer_timeout_s of the configuration.
    let peer_timeout = Duration::from_secs(2);
    for trial in 0..2 * trials {
        let restart = trial % 2 == 1;
        let rank = rng.below(3) as usize;
        let at = 10 + rng.below(150) as usize;
        let sig = if rng.below(2) == 0 { "KILL" } else { "STOP" };
        let what = format!(
            "trial {trial}: SIG{sig} to worker {rank} at step {at}{}",
            if restart { ", --max-restarts 1" } else { "" }
        );
        eprintln!("chaos: {what}");
        let dir = tmp.path().join(format!("trial-{trial}"));
        let mut args = vec!["--set", steps];
        if restart {
            args.extend(["--max-restarts", "1"]);
        }
        let mut run = Launcher::start(&cfg, &dir, &args);
        run.wait_for_steps(at);
        signal(worker_pid(&dir, rank), sig);
        if restart {
            let (st, _, log) = run.wait(Duration::from_secs(180));
            assert!(st.success(), "{what}:\n{log}");
            let s = summary(&dir);
            assert_eq!(
                s["restarts"].as_array().map(Vec::len),
                Some(1),
                "{what}: {s}"
            );
            assert!(
                final_params(&dir).iter().all(|x| x.is_finite()),
                "{what}: non-finite parameters"
            );
            let got = accuracy(&dir);
            assert!(
                (got - want).abs() <= 0.05,
                "{what}: accuracy {got} vs {want} undisturbed"
            );
        } else {
            let (st, took, log) = run.wait(peer_timeout + Duration::from_secs(30));
            assert!(!st.success(), "{what}: succeeded:\n{log}");
            assert!(
                took <= peer_timeout + Duration::from_secs(10),
                "{what}: took {took:?}:\n{log}"
            );
        }
        assert_none_left(&dir, Duration::from_secs(2));
    }
}

/// A worker failing before the first checkpoint: `--max-restarts` starts the run over, and
/// the failed attempt's records go.
#[test]
fn a_restart_before_any_checkpoint_starts_over() {
    let (tmp, cfg) = setup(2);
    let dir = tmp.path().join("early");
    // A step takes about 0.1 ms here: the first checkpoint is far enough away (8,000 steps,
    // the best part of a second) that the kill, sent a few steps in, always comes before it.
    let mut run = Launcher::start(
        &cfg,
        &dir,
        &[
            "--set",
            "train.epochs=100",
            "--set",
            "train.max_steps=10000",
            "--set",
            "checkpoint.every_steps=8000",
            "--max-restarts",
            "1",
        ],
    );
    run.wait_for_steps(3);
    assert!(
        !dir.join("checkpoints/LATEST").exists(),
        "a checkpoint came first"
    );
    signal(worker_pid(&dir, 0), "KILL");
    let (st, _, log) = run.wait(Duration::from_secs(120));
    assert!(st.success(), "{log}");
    assert!(log.contains("restart 1 of 1 from the start"), "{log}");
    let s = summary(&dir);
    assert_eq!(
        (
            s["restarts"][0]["rank"].as_u64(),
            s["restarts"][0]["step"].as_u64()
        ),
        (Some(0), Some(0))
    );
    let steps: Vec<u64> = losses(&dir).iter().map(|l| l.0).collect();
    assert!(
        steps.iter().copied().eq(0..10000),
        "steps logged: {} from {:?} to {:?}",
        steps.len(),
        steps.first(),
        steps.last()
    );
}

/// What `--max-restarts` cannot do is refused before anything starts, naming why; a worker
/// whose launcher is not its parent refuses to start.
#[test]
fn unsupported_restarts_and_orphaned_workers_are_refused() {
    let (tmp, cfg) = setup(2);
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dtrain"));
        c.arg("run").arg(&cfg).args(args);
        for (k, v) in env {
            c.env(k, v);
        }
        let o = c.output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    let e = run(
        &[
            "--max-restarts",
            "1",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--rendezvous",
            "127.0.0.1:1",
        ],
        &[],
    );
    assert!(
        e.contains("--max-restarts") && e.contains("--nnodes"),
        "{e}"
    );
    let e = run(
        &["--max-restarts", "1", "--set", "cluster.transport=\"mpi\""],
        &[],
    );
    assert!(e.contains("--max-restarts") && e.contains("mpi"), "{e}");
    let dir = tmp.path().join("slurm");
    let e = run(
        &["--max-restarts", "1", "--run-dir", dir.to_str().unwrap()],
        &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")],
    );
    assert!(e.contains("--max-restarts needs the launcher"), "{e}");
    assert!(
        !tmp.path().join("runs").exists(),
        "a refused run wrote its directory"
    );

    // A worker started with a launcher pid that is not its parent (the launcher died
    // before the worker could ask to die with it) does not start.
    let o = Command::new(env!("CARGO_BIN_EXE_dtrain"))
        .args([
            "worker",
            "--run-dir",
            "/nonexistent",
            "--rendezvous",
            "127.0.0.1:1",
        ])
        .args(["--rank", "0", "--world", "1"])
        .env("DTRAIN_LAUNCHER_PID", "1")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(e.contains("the launcher (pid 1) is gone"), "{e}");
}
