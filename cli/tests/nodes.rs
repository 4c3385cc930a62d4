//! Issue #22: a run over two "hosts" on this machine — two `dtrain run --nnodes 2
//! --node-rank i` launchers on loopback with 2 workers each — takes the hierarchical
//! all-reduce for its dense buckets, says so, records it, and trains as the flat run does
//! up to f32 rounding (the two sum in different orders: `dtrain_comms::algo::hierarchical`);
//! over `cluster.transport = "tcp"`, and over the `hybrid` driver that `auto` picks for it
//! (shared memory within a node, TCP between), bit for bit alike. A tiny MLP for 8 steps:
//! about a second a run, most of it starting the worker processes.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

fn dtrain() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dtrain"))
}

fn config(out: &Path, transport: &str) -> String {
    format!(
        r#"
name = "nodes"
seed = 11
[model]
kind = "mlp"
in_channels = 1
image_size = 8
hidden = [32, 16]
[data]
kind = "synthetic"
shape = [1, 8, 8]
train_len = 512
test_len = 64
batch_size = 8
[train]
lr = 0.05
momentum = 0.9
epochs = 1
max_steps = 8
[cluster]
workers = 4
transport = "{transport}"
[compress]
kind = "none"
[checkpoint]
every_epochs = 0
[output]
dir = "{}"
"#,
        out.display()
    )
}

fn ok(o: &Output, what: &str) -> String {
    let log = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{what} failed:\n{log}");
    log
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

/// A free loopback rendezvous address.
fn free_rendezvous() -> String {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// Starts node launcher `node` of 2 for the config at `cfg` over loopback, into `dir`,
/// with `extra` arguments, its output piped.
fn spawn_node(
    cfg: &Path,
    dir: &Path,
    rdv: &str,
    token: &str,
    node: usize,
    extra: &[&str],
) -> Child {
    dtrain()
        .arg("run")
        .arg(cfg)
        .args(["--nnodes", "2", "--node-rank", &node.to_string()])
        .args(["--rendezvous", rdv])
        .args(extra)
        .arg("--run-dir")
        .arg(dir)
        .env("DTRAIN_RUN_TOKEN", token)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Starts the config at `cfg` on two node launchers of 2 workers each over loopback, into
/// `dir`, their output piped.
fn spawn_two_nodes(cfg: &Path, dir: &Path, token: &str) -> (Child, Child) {
    let rdv = free_rendezvous();
    (
        spawn_node(cfg, dir, &rdv, token, 0, &[]),
        spawn_node(cfg, dir, &rdv, token, 1, &[]),
    )
}

/// Runs the config at `cfg` on two node launchers of 2 workers each over loopback, into
/// `dir`; returns node 0's log.
fn two_nodes(cfg: &Path, dir: &Path, token: &str) -> String {
    let (n0, n1) = spawn_two_nodes(cfg, dir, token);
    let (o0, o1) = (
        n0.wait_with_output().unwrap(),
        n1.wait_with_output().unwrap(),
    );
    let log = ok(&o0, "node 0");
    ok(&o1, "node 1");
    log
}

#[test]
fn two_node_launchers_on_loopback_take_the_hierarchical_all_reduce() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("nodes.toml");
    std::fs::write(&cfg, config(&tmp.path().join("runs"), "tcp")).unwrap();
    let dir = tmp.path().join("two-nodes");
    let log = two_nodes(&cfg, &dir, "two-nodes-on-loopback");
    assert!(
        log.contains("hierarchical all-reduce over 2 hosts × 2 ranks (leaders [0, 2])"),
        "{log}"
    );
    let s = summary(&dir);
    assert_eq!(s["collective"], "hierarchical-allreduce", "{s}");
    assert_eq!(s["hosts"], 2, "{s}");
    assert_eq!(s["workers"], 4, "{s}");

    // `auto` takes the hybrid driver for two nodes of two workers: the same algorithm over
    // shared memory within each node, so the same bits.
    let auto_cfg = tmp.path().join("nodes-auto.toml");
    std::fs::write(&auto_cfg, config(&tmp.path().join("runs"), "auto")).unwrap();
    let hybrid_dir = tmp.path().join("two-nodes-hybrid");
    let log = two_nodes(&auto_cfg, &hybrid_dir, "two-hybrid-nodes-on-loopback");
    assert!(
        log.contains("cluster.transport = \"auto\": hybrid (2 nodes of 2 workers"),
        "{log}"
    );
    let written = std::fs::read_to_string(hybrid_dir.join("config.toml")).unwrap();
    assert!(written.contains("transport = \"hybrid\""), "{written}");
    let h = summary(&hybrid_dir);
    assert_eq!(h["collective"], "hierarchical-allreduce", "{h}");
    assert_eq!(
        h["final_train_loss"].as_f64().unwrap().to_bits(),
        s["final_train_loss"].as_f64().unwrap().to_bits(),
        "hybrid {h} vs tcp {s}"
    );

    // The same run on one launcher: the flat all-reduce, the same model up to rounding.
    let flat_dir = tmp.path().join("one-node");
    let o = dtrain()
        .arg("run")
        .arg(&cfg)
        .arg("--run-dir")
        .arg(&flat_dir)
        .output()
        .unwrap();
    ok(&o, "the one-node run");
    let f = summary(&flat_dir);
    assert_eq!(f["collective"], "allreduce", "{f}");
    assert!(f.get("hosts").is_none(), "{f}");
    let (lh, lf) = (
        s["final_train_loss"].as_f64().unwrap(),
        f["final_train_loss"].as_f64().unwrap(),
    );
    assert!(
        (lh - lf).abs() <= 1e-4 * lf.abs(),
        "hierarchical {lh} vs flat {lf}"
    );
}

/// The pid of worker `rank` of the run in `dir` (its command line names both).
fn worker_pid(dir: &Path, rank: usize) -> u32 {
    let needle = dir.to_string_lossy().to_string();
    let t = std::time::Instant::now();
    loop {
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let args: Vec<String> = cmd
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).to_string())
                .collect();
            let at = args.iter().position(|a| a == "--rank");
            if args.get(1).is_some_and(|a| a == "worker")
                && args.iter().any(|a| a.contains(&needle))
                && at.is_some_and(|i| args.get(i + 1) == Some(&rank.to_string()))
            {
                return pid;
            }
        }
        assert!(t.elapsed().as_secs() < 30, "no worker {rank}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Issue #53 across node launchers: two launchers of 2 workers each with live membership;
/// worker 3 (node 1's second) is killed mid-run: both launchers exit 0, the three others
/// finish every step with the hierarchical all-reduce re-formed over the hosts they are
/// on, and `summary.json` records the change.
#[test]
fn two_node_launchers_go_on_without_a_killed_worker() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("nodes-live.toml");
    let text = config(&tmp.path().join("runs"), "tcp")
        .replace(
            "epochs = 1\nmax_steps = 8",
            "epochs = 100\nmax_steps = 1600",
        )
        .replace("[cluster]\n", "[cluster]\nmembership = \"live\"\n");
    std::fs::write(&cfg, text).unwrap();
    let dir = tmp.path().join("two-nodes-live");
    let (n0, n1) = spawn_two_nodes(&cfg, &dir, "two-live-nodes");
    // Some steps in, worker 3 dies.
    let t = std::time::Instant::now();
    while std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |m| m.lines().count()) < 50 {
        assert!(t.elapsed().as_secs() < 60, "no 50 steps in 60 s");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let st = Command::new("kill")
        .args(["-KILL", &worker_pid(&dir, 3).to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let (o0, o1) = (
        n0.wait_with_output().unwrap(),
        n1.wait_with_output().unwrap(),
    );
    ok(&o0, "node 0");
    let log1 = ok(&o1, "node 1");
    assert!(log1.contains("worker 3 was lost"), "{log1}");
    let s = summary(&dir);
    assert_eq!(s["steps"], 1600, "{s}");
    let m = &s["membership"][0];
    assert_eq!(m["removed"], serde_json::json!([3]), "{s}");
    assert_eq!(m["members"], serde_json::json!([0, 1, 2]), "{s}");
    // Two hosts still: {0, 1} and {2}.
    assert_eq!(s["collective"], "hierarchical-allreduce", "{s}");
}

/// The number of step records in the run's metrics.jsonl.
fn steps_logged(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |m| m.lines().count())
}

/// Waits until the run in `dir` has logged `n` steps.
fn wait_for_steps(dir: &Path, n: usize) {
    let t = std::time::Instant::now();
    while steps_logged(dir) < n {
        assert!(t.elapsed().as_secs() < 120, "no {n} steps in 120 s");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

fn signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {pid}");
}

/// Issue #53's chaos test, short (the long one: experiments/chaos/README.md): 4 workers on
/// two node launchers over an emulated 100 Mbit/s link with live membership; during the
/// run worker 3 is SIGKILLed (its launcher starts a newcomer in its place), worker 1 is
/// SIGSTOPped past the step deadline (dropped; continued, it joins again by itself), and
/// worker 0 — the leader, writing the logs — is SIGKILLed (replaced too). The run
/// completes every step without restarting a survivor, the replicas' hashes agree at every
/// check (a mismatch fails the run), each loss costs at most the deadline plus a step, and
/// summary.json holds the six changes, ending with four workers.
#[test]
fn chaos_across_two_node_launchers() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("chaos.toml");
    let steps = 5000;
    let text = config(&tmp.path().join("runs"), "tcp")
        .replace(
            "epochs = 1\nmax_steps = 8",
            &format!("epochs = 400\nmax_steps = {steps}"),
        )
        .replace(
            "[cluster]\n",
            "[network]\nbandwidth = \"100Mbit\"\n[cluster]\nmembership = \"live\"\n\
             deadline_floor_s = 2.0\ntimeout_s = 30\ncheck_replicas_every = 10\n",
        );
    std::fs::write(&cfg, text).unwrap();
    let dir = tmp.path().join("chaos");
    let rdv = free_rendezvous();
    let node = |i: usize| spawn_node(&cfg, &dir, &rdv, "chaos", i, &["--max-restarts", "2"]);
    let (n0, n1) = (node(0), node(1));
    wait_for_steps(&dir, 50);
    let first = [0, 1, 2].map(|r| worker_pid(&dir, r));
    signal(worker_pid(&dir, 3), "KILL");
    wait_for_steps(&dir, 400);
    signal(first[1], "STOP");
    std::thread::sleep(std::time::Duration::from_millis(3500));
    signal(first[1], "CONT");
    wait_for_steps(&dir, 1200);
    assert_eq!(worker_pid(&dir, 2), first[2], "worker 2 was restarted");
    signal(first[0], "KILL");
    let (o0, o1) = (
        n0.wait_with_output().unwrap(),
        n1.wait_with_output().unwrap(),
    );
    let log0 = ok(&o0, "node 0");
    let log1 = ok(&o1, "node 1");
    assert!(
        log1.contains("worker 3: a newcomer took its place"),
        "{log1}"
    );
    assert!(
        log0.contains("worker 0: a newcomer took its place"),
        "{log0}"
    );
    let s = summary(&dir);
    assert_eq!(s["steps"], steps, "{s}");
    let m = s["membership"].as_array().expect("membership recorded");
    let removed: Vec<u64> = m
        .iter()
        .filter_map(|c| c["removed"].as_array().filter(|r| !r.is_empty()))
        .map(|r| r[0].as_u64().unwrap())
        .collect();
    let added: Vec<u64> = m
        .iter()
        .filter_map(|c| c["added"].as_array())
        .map(|r| r[0].as_u64().unwrap())
        .collect();
    assert_eq!(removed, vec![3, 1, 0], "{s}");
    let mut sorted = added.clone();
    sorted.sort();
    assert_eq!(sorted, vec![0, 1, 3], "{s}");
    assert_eq!(
        m.last().unwrap()["members"].as_array().unwrap().len(),
        4,
        "{s}"
    );
    let step_s = s["mean_step"]["step_s"].as_f64().unwrap();
    for c in m.iter().filter(|c| c["deadline_s"].is_number()) {
        let (lost, deadline) = (
            c["lost_s"].as_f64().unwrap(),
            c["deadline_s"].as_f64().unwrap(),
        );
        assert!(lost <= deadline + step_s + 0.5, "lost {lost} s: {c}");
    }
    // Every step logged once (the leader was replaced), and the hashes checked throughout.
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let logged: Vec<u64> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(logged, (0..steps).collect::<Vec<_>>());
    let hashes = text.lines().filter(|l| l.contains("param_hash")).count() as u64;
    assert!(hashes >= steps / 10 - 5, "{hashes} checks");
}

/// Issue #53, scope 4: a node launcher rejoins after its host went (here: the launcher
/// SIGKILLed, its workers dying with it). Node 0's two workers go on (every lost connection
/// closed: dead for certain, so half the group may continue); node 1 started again with
/// `--join` brings two newcomers into the running group through node 0's rendezvous, and
/// both launchers finish the run.
#[test]
fn a_node_launcher_rejoins_after_its_host_went() {
    node_rejoins("tcp");
}

/// The same over the hybrid driver (shared memory within each node, TCP between): the
/// newcomers talk over TCP alone, to each other too, and node 0's workers keep their rings.
#[test]
fn a_node_launcher_rejoins_over_the_hybrid_driver() {
    node_rejoins("hybrid");
}

fn node_rejoins(transport: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("rejoin.toml");
    let steps = 4000;
    let text = config(&tmp.path().join("runs"), transport)
        .replace(
            "epochs = 1\nmax_steps = 8",
            &format!("epochs = 400\nmax_steps = {steps}"),
        )
        .replace(
            "[cluster]\n",
            "[cluster]\nmembership = \"live\"\ncheck_replicas_every = 10\n",
        );
    std::fs::write(&cfg, text).unwrap();
    let dir = tmp.path().join("rejoin");
    let rdv = free_rendezvous();
    let node = |i: usize, join: bool| {
        let extra: &[&str] = if join { &["--join"] } else { &[] };
        spawn_node(&cfg, &dir, &rdv, "rejoin", i, extra)
    };
    let n0 = node(0, false);
    let mut n1 = node(1, false);
    wait_for_steps(&dir, 50);
    n1.kill().unwrap();
    n1.wait().unwrap();
    // The two left go on as a group of two.
    let at = steps_logged(&dir);
    wait_for_steps(&dir, at + 200);
    let n1 = node(1, true);
    let (o0, o1) = (
        n0.wait_with_output().unwrap(),
        n1.wait_with_output().unwrap(),
    );
    ok(&o0, "node 0");
    ok(&o1, "node 1 (joined)");
    let s = summary(&dir);
    assert_eq!(s["steps"], steps, "{s}");
    let m = s["membership"].as_array().expect("membership recorded");
    let removed: Vec<u64> = m
        .iter()
        .flat_map(|c| c["removed"].as_array().unwrap().clone())
        .map(|r| r.as_u64().unwrap())
        .collect();
    let mut added: Vec<u64> = m
        .iter()
        .filter_map(|c| c["added"].as_array())
        .flat_map(|a| a.clone())
        .map(|r| r.as_u64().unwrap())
        .collect();
    added.sort();
    let mut removed = removed;
    removed.sort();
    assert_eq!((removed, added), (vec![2, 3], vec![2, 3]), "{s}");
    assert_eq!(
        m.last().unwrap()["members"].as_array().unwrap().len(),
        4,
        "{s}"
    );
}
