//! One node's worker processes, supervised: started, watched, stopped on a signal, and
//! restarted from the newest intact checkpoint after a failure (`--max-restarts`) — or,
//! under live membership over tcp, each lost worker replaced by a newcomer that joins the
//! running group (on one node or several).

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dtrain_records::Restart;

use super::supervise::{kill_all, watch_replacing, Ended, Replace, Watch};
use super::{host_rendezvous, LaunchError, RunOptions, RENDEZVOUS_TIMEOUT, TOKEN_ENV};
use crate::config::Plan;
use crate::signals;
use crate::trainer::RunDir;

/// How long the other workers have, after one failed, to notice and name the lost peer
/// before they are stopped.
const PEERS_GRACE: Duration = Duration::from_secs(5);

/// What the workers of this node are started with.
pub(super) struct Node<'a> {
    pub opts: &'a RunOptions,
    pub plan: &'a Plan,
    pub dir: &'a RunDir,
    pub exe: &'a Path,
    pub worker_cmd: &'a [&'a str],
    pub token: &'a str,
    /// The ranks this node runs.
    pub ranks: Vec<usize>,
    /// The rendezvous address: hosted here (node 0, port 0 for any) or node 0's.
    pub rendezvous: SocketAddr,
    /// Whether this node hosts the rendezvous.
    pub hosts: bool,
    /// This node's `--node-rank` when the run has several nodes: its workers group by it
    /// ([`super::hosts`]).
    pub node: Option<usize>,
    /// `--join`: the workers start as newcomers in a running group.
    pub join: bool,
}

impl Node<'_> {
    /// Whether the run has live membership.
    fn live(&self) -> bool {
        self.plan.config.live_membership()
    }

    /// Starts one worker process per rank of this node; `resume` adds `--resume`; with
    /// `--join` they start as newcomers.
    fn spawn(&self, rdv: SocketAddr, resume: bool) -> Result<Vec<(usize, Child)>, String> {
        let mut children: Vec<(usize, Child)> = Vec::new();
        for &rank in &self.ranks {
            match self.spawn_one(rdv, rank, resume, self.join) {
                Ok(c) => children.push((rank, c)),
                Err(e) => {
                    kill_all(&mut children);
                    return Err(e);
                }
            }
        }
        Ok(children)
    }

    /// Starts the worker process of `rank`; `resume` adds `--resume`, `join` `--join` (a
    /// newcomer taking a lost worker's place in the running group).
    fn spawn_one(
        &self,
        rdv: SocketAddr,
        rank: usize,
        resume: bool,
        join: bool,
    ) -> Result<Child, String> {
        let world = self.plan.config.cluster.workers;
        let threads = self.plan.config.cluster.threads.to_string();
        let launcher = std::process::id().to_string();
        let mut cmd = Command::new(self.exe);
        cmd.args(self.worker_cmd)
            .arg("--run-dir")
            .arg(&self.dir.root)
            .arg("--rendezvous")
            .arg(rdv.to_string())
            .arg("--rank")
            .arg(rank.to_string())
            .arg("--world")
            .arg(world.to_string())
            .env(TOKEN_ENV, self.token)
            .env("RAYON_NUM_THREADS", &threads)
            .env(
                crate::device::LOCAL_RANK_ENV,
                (rank - self.ranks[0]).to_string(),
            )
            .env(signals::LAUNCHER_PID_ENV, &launcher)
            .stdin(Stdio::null());
        // Its own process group: a terminal's Ctrl-C reaches the launcher only, which
        // forwards it once (see crate::signals).
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        if let Some(node) = self.node {
            cmd.env(super::hosts::NODE_ENV, node.to_string());
        }
        if resume {
            cmd.arg("--resume");
        }
        if join {
            cmd.arg("--join");
        }
        // A newcomer never leads (it joins after the members), so only the first worker 0
        // shows its progress.
        if rank != 0 || join {
            cmd.stdout(Stdio::null());
        }
        cmd.spawn()
            .map_err(|e| format!("starting worker {rank}: {e}"))
    }

    /// Runs the workers to the end: restarted after a failure up to `--max-restarts`
    /// times, stopped on SIGTERM / SIGINT. Returns the restarts made.
    pub(super) fn run(&self, log: &mut dyn FnMut(&str)) -> Result<Vec<Restart>, LaunchError> {
        // From here until the workers are gone, a signal to this process is theirs.
        let _caught = signals::catch(false)
            .map_err(|e| format!("catching SIGTERM / SIGINT for the workers: {e}"))?;
        let grace = Duration::from_secs_f64(self.plan.config.checkpoint.grace_s);
        let mut restarts = Vec::new();
        let mut resume = self.opts.resume.is_some();
        loop {
            let host = if self.hosts {
                Some(host_rendezvous(
                    self.rendezvous,
                    self.plan.config.cluster.workers,
                    self.plan.config.cluster.transport,
                    self.token,
                    RENDEZVOUS_TIMEOUT,
                    self.live(),
                )?)
            } else {
                None
            };
            let rdv = host.as_ref().map_or(self.rendezvous, |h| h.addr());
            let started = Instant::now();
            let mut children = self.spawn(rdv, resume)?;
            let watch_how = Watch {
                deadline: None,
                grace: PEERS_GRACE,
                on_signal: Some(grace),
                live: self.live(),
            };
            // Live membership: --max-restarts replaces lost workers by newcomers (tcp, hybrid).
            let budget = self.opts.max_restarts.saturating_sub(restarts.len());
            let replaces =
                self.live() && budget > 0 && self.plan.config.cluster.transport.takes_newcomers();
            let mut start = |rank: usize| self.spawn_one(rdv, rank, false, true);
            let ended = watch_replacing(
                &mut children,
                watch_how,
                replaces.then_some((&mut start as Replace<'_>, budget)),
            );
            let (rank, cause) = match ended {
                Ended::Survived {
                    lost,
                    replaced,
                    not_joined,
                } => {
                    for (r, st) in &lost {
                        log(&format!(
                            "worker {r} was lost ({st}); the others went on without it \
                             (cluster.membership = \"live\": summary.json's membership)"
                        ));
                    }
                    for r in &replaced {
                        log(&format!(
                            "worker {r}: a newcomer took its place (--max-restarts under \
                             live membership)"
                        ));
                    }
                    for r in &not_joined {
                        log(&format!(
                            "worker {r}: its newcomer could not join (its log says why: the \
                             run had ended, say)"
                        ));
                    }
                    if let Some(h) = host {
                        h.wait().map_err(|e| e.to_string())?;
                    }
                    return Ok(restarts);
                }
                Ended::Done => {
                    if let Some(h) = host {
                        h.wait().map_err(|e| e.to_string())?;
                    }
                    return Ok(restarts);
                }
                Ended::Stopped { signal, note } => {
                    return Err(LaunchError::Stopped {
                        signal,
                        message: stopped(signal, &note, self.dir),
                    })
                }
                Ended::Failed { rank, cause } => (rank, cause),
            };
            let what = match rank {
                Some(r) => format!("worker {r} failed ({cause})"),
                None => cause.clone(),
            };
            // Several nodes cannot restart everyone together (only replace workers).
            if restarts.len() >= self.opts.max_restarts || self.node.is_some() {
                let after = match self.opts.max_restarts {
                    0 => String::new(),
                    n => format!(" (after {n} restart(s), the most --max-restarts allows)"),
                };
                return Err(format!("{}{after}", run_failure(&what, started, self.dir)).into());
            }
            // The rendezvous of the failed attempt is abandoned (its thread ends at its
            // timeout); the next attempt has its own.
            drop(host);
            // What the failed attempt had done, read before its records are pruned.
            let done = read_steps(&self.dir.root.join("metrics.jsonl"));
            let (best, skipped) = self.dir.newest_intact();
            for s in &skipped {
                log(&format!(
                    "restart: skipping checkpoint {}: {}",
                    s.dir.display(),
                    s.reason
                ));
            }
            let step = match &best {
                Some(c) => {
                    self.dir.set_latest(&c.dir).map_err(|e| e.to_string())?;
                    c.step
                }
                None => {
                    // Nothing to resume from: the run starts over, and the failed attempt's
                    // records go.
                    for f in ["metrics.jsonl", "eval.jsonl"] {
                        let _ = std::fs::remove_file(self.dir.root.join(f));
                    }
                    0
                }
            };
            resume = best.is_some();
            let lost = lost_work(&done, step);
            restarts.push(Restart {
                rank,
                cause: cause.clone(),
                step,
                after_s: started.elapsed().as_secs_f64(),
                reached: lost.reached,
                steps_lost: lost.reached - step,
                lost_s: lost.seconds,
            });
            log(&format!(
                "{what} after {:.1} s ({} step(s), {:.1} s of training lost): restart {} of {} {}",
                started.elapsed().as_secs_f64(),
                lost.reached - step,
                lost.seconds,
                restarts.len(),
                self.opts.max_restarts,
                match &best {
                    Some(c) => format!("from checkpoint {} (step {step})", c.dir.display()),
                    None => "from the start (no checkpoint is intact on every rank)".into(),
                }
            ));
        }
    }
}

/// `(step, step_s)` of every line of the run's `metrics.jsonl` (none when it is missing;
/// a line that does not parse, e.g. the one a killed worker was writing, is skipped).
fn read_steps(path: &std::path::Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<dtrain_records::StepRecord>(l).ok())
        .map(|r| (r.step, r.time.step_s))
        .collect()
}

/// The work a restart from `step` redoes.
struct Lost {
    /// Steps the failed attempt completed (newest logged step + 1), at least `step`.
    reached: u64,
    /// Their training time.
    seconds: f64,
}

/// What restarting from `step` loses of the attempt whose logged steps are `done`: the
/// steps from `step` to the newest logged one, and their time (the mean logged step time
/// over the steps lost, so that `output.log_every` > 1 still counts every step).
fn lost_work(done: &[(u64, f64)], step: u64) -> Lost {
    let after: Vec<&(u64, f64)> = done.iter().filter(|(s, _)| *s >= step).collect();
    let reached = after
        .iter()
        .map(|(s, _)| s + 1)
        .max()
        .unwrap_or(step)
        .max(step);
    let seconds = if after.is_empty() {
        0.0
    } else {
        let mean = after.iter().map(|(_, t)| t).sum::<f64>() / after.len() as f64;
        mean * (reached - step) as f64
    };
    Lost { reached, seconds }
}

/// The newest checkpoint intact on every rank, as a phrase, and how to continue from it;
/// or that there is none, and the run directory.
fn newest_intact_phrase(dir: &RunDir) -> String {
    match dir.newest_intact().0 {
        Some(c) => format!(
            "newest intact checkpoint: {} (step {}; continue with --resume {})",
            c.dir.display(),
            c.step,
            dir.root.display()
        ),
        None => format!(
            "no checkpoint is intact on every rank; run directory {}",
            dir.root.display()
        ),
    }
}

/// Why a run stopped (`failure`, after the time since `started`) and where its state is:
/// the newest intact checkpoint and how to continue from it, or the run directory.
pub(super) fn run_failure(failure: &str, started: Instant, dir: &RunDir) -> String {
    format!(
        "{failure} after {:.1} s; {}",
        started.elapsed().as_secs_f64(),
        newest_intact_phrase(dir)
    )
}

/// What the launcher says when a signal stopped the run.
pub(super) fn stopped(signal: i32, note: &str, dir: &RunDir) -> String {
    format!(
        "stopped by {} ({note}); {}",
        signals::signal_name(signal),
        newest_intact_phrase(dir)
    )
}

#[cfg(test)]
mod lost_tests {
    use super::*;

    #[test]
    fn the_steps_after_the_checkpoint_are_lost_with_their_time() {
        let done: Vec<(u64, f64)> = (0..40).map(|s| (s, 0.5)).collect();
        let l = lost_work(&done, 25);
        assert_eq!(l.reached, 40);
        assert!((l.seconds - 7.5).abs() < 1e-12);
        // Every 10th step logged: the mean step time counts the ones left out.
        let sparse: Vec<(u64, f64)> = (0..4).map(|i| (i * 10, 0.5)).collect();
        let l = lost_work(&sparse, 0);
        assert_eq!((l.reached, l.seconds), (31, 15.5));
        // Nothing logged after the checkpoint: nothing lost.
        let l = lost_work(&done[..20], 25);
        assert_eq!((l.reached, l.seconds), (25, 0.0));
    }
}
