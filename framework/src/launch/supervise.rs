//! Watching worker processes: failures, deadlines, and the stop signals the launcher
//! forwards (see [`crate::signals`]).

use std::os::unix::process::ExitStatusExt;
use std::process::Child;
use std::time::{Duration, Instant};

use crate::signals;

/// How a group of worker processes ended (all of them are gone when it is returned).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Ended {
    /// Every worker exited successfully.
    Done,
    /// Under live membership (`Watch::live`): some workers failed, and the others went on
    /// without them and exited successfully.
    Survived {
        /// The workers that failed, with their exit status, in the order they ended.
        lost: Vec<(usize, String)>,
        /// The ranks a newcomer was started for (see [`watch_replacing`]), in order.
        replaced: Vec<usize>,
        /// The ranks whose newcomer could not join (the run had ended, say).
        not_joined: Vec<usize>,
    },
    /// A worker failed, or the deadline passed; the others were given their grace to
    /// name the failure and then stopped.
    Failed {
        /// The worker that failed first (`None`: the deadline passed).
        rank: Option<usize>,
        /// Its exit status, or what the supervisor saw.
        cause: String,
    },
    /// A stop signal (to the launcher, or one a worker stopped for and exited with
    /// 128 + signal) was forwarded to every worker.
    Stopped {
        /// The signal.
        signal: i32,
        /// What became of the workers (stopped in time, or killed).
        note: String,
    },
}

/// How [`watch`] supervises.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Watch {
    /// Stop everything at this instant (a benchmark's limit).
    pub deadline: Option<Instant>,
    /// After a failure, how long the others may take to exit on their own (so that they
    /// can report the lost peer) before they are killed.
    pub grace: Duration,
    /// `Some(grace_s)`: react to the stop signals caught by [`signals::catch`] (which the
    /// caller installed): forward the first to every worker as SIGTERM, give them this
    /// long to checkpoint and exit, kill them at a second signal or at the end of it.
    pub on_signal: Option<Duration>,
    /// Live membership (`cluster.membership = "live"`): a worker that fails does not stop
    /// the others, which go on without it; the group has failed only when none of them
    /// exits successfully.
    pub live: bool,
}

/// Stops and reaps every child.
pub(crate) fn kill_all(children: &mut [(usize, Child)]) {
    for (_, c) in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// The signal a worker stopped for, from its exit status `128 + signal` (what a worker
/// that honoured a stop request exits with).
fn stopped_for(st: &std::process::ExitStatus) -> Option<i32> {
    let code = st.code()?;
    signals::STOP_SIGNALS.into_iter().find(|&s| code == 128 + s)
}

/// Starts a newcomer for a lost worker's rank (live membership's replacements).
pub(crate) type Replace<'a> = &'a mut dyn FnMut(usize) -> Result<Child, String>;

/// Waits for every worker process `(rank, child)` and says how they ended (see [`Ended`]).
pub(crate) fn watch(children: &mut [(usize, Child)], w: Watch) -> Ended {
    watch_replacing(children, w, None)
}

/// [`watch`], where under live membership ([`Watch::live`]) a worker that fails is
/// replaced by a newcomer for its rank, started by `replace.0`, while the budget
/// `replace.1` lasts (`--max-restarts`): the newcomer takes the lost worker's place in
/// the running group. A newcomer that cannot be started counts as lost.
pub(crate) fn watch_replacing(
    children: &mut [(usize, Child)],
    w: Watch,
    mut replace: Option<(Replace<'_>, usize)>,
) -> Ended {
    let mut replaced: Vec<usize> = Vec::new();
    // Newcomers that could not join (they exited with NOT_JOINED_EXIT).
    let mut not_joined: Vec<usize> = Vec::new();
    let mut done = vec![false; children.len()];
    // Live membership: the workers that failed while others went on, and how many ended
    // successfully.
    let mut lost: Vec<(usize, String)> = Vec::new();
    let mut succeeded = 0usize;
    // The signal being honoured and when its grace ends.
    let mut stopping: Option<(i32, Instant)> = None;
    loop {
        if let Some(grace) = w.on_signal {
            let (sig, count) = signals::received();
            if let Some(sig) = sig {
                if count >= 2 {
                    kill_all(children);
                    return Ended::Stopped {
                        signal: sig,
                        note: "a second signal: the workers were killed at once".into(),
                    };
                }
                if stopping.is_none() {
                    stopping = Some((sig, forward(children, &done, grace)));
                }
            }
        }
        let mut failure: Option<Culprit> = None;
        for (i, (rank, c)) in children.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            match c.try_wait() {
                Ok(Some(st)) => {
                    done[i] = true;
                    if st.success() {
                        succeeded += 1;
                        continue;
                    }
                    if stopping.is_some() {
                        continue;
                    }
                    if w.live && st.code() == Some(super::NOT_JOINED_EXIT as i32) {
                        // A newcomer that could not join (the run ended, say): it never
                        // entered, so nothing was lost, and no other is started for it.
                        not_joined.push(*rank);
                        continue;
                    }
                    match (stopped_for(&st), w.on_signal) {
                        // A worker stopped by a signal of its own (the ranks agree on
                        // stopping): the run stops, it did not fail.
                        (Some(sig), Some(grace)) => {
                            stopping = Some((sig, Instant::now() + grace));
                        }
                        _ if w.live => {
                            lost.push((*rank, format!("{st}")));
                            // Once a worker finished, the run is complete: nothing to join.
                            let wanted = succeeded == 0;
                            if let Some((start, budget)) =
                                replace.as_mut().filter(|r| r.1 > 0 && wanted)
                            {
                                *budget -= 1;
                                match start(*rank) {
                                    Ok(newcomer) => {
                                        *c = newcomer;
                                        done[i] = false;
                                        replaced.push(*rank);
                                    }
                                    Err(e) => lost.push((*rank, format!("its newcomer: {e}"))),
                                }
                            }
                        }
                        _ => note_failure(&mut failure, *rank, &st),
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    done[i] = true;
                    failure.get_or_insert(Culprit {
                        rank: Some(*rank),
                        cause: format!("waiting for it: {e}"),
                        killed: false,
                    });
                }
            }
        }
        let running: Vec<usize> = children
            .iter()
            .zip(&done)
            .filter(|(_, d)| !**d)
            .map(|((r, _), _)| *r)
            .collect();
        if let Some((signal, until)) = stopping {
            if running.is_empty() {
                return Ended::Stopped {
                    signal,
                    note: "every worker stopped".into(),
                };
            }
            if Instant::now() >= until {
                kill_all(children);
                return Ended::Stopped {
                    signal,
                    note: format!(
                        "workers {running:?} had not stopped within checkpoint.grace_s and \
                         were killed"
                    ),
                };
            }
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        if running.is_empty() && failure.is_none() {
            return match (lost.first(), succeeded) {
                (None, _) => Ended::Done,
                (Some(_), 1..) => Ended::Survived {
                    lost,
                    replaced,
                    not_joined,
                },
                // Nobody went on: the first loss is the run's failure.
                (Some((rank, cause)), 0) => Ended::Failed {
                    rank: Some(*rank),
                    cause: cause.clone(),
                },
            };
        }
        if failure.is_none() && w.deadline.is_some_and(|d| Instant::now() >= d) {
            failure = Some(Culprit {
                rank: None,
                cause: format!("workers {running:?} were still running at the deadline"),
                killed: false,
            });
        }
        if let Some(mut culprit) = failure {
            // The others get their grace to exit on their own. One that was killed meanwhile
            // is the likelier cause than one that exited naming a lost peer (the two often
            // end within one poll of each other).
            let until = Instant::now() + w.grace;
            loop {
                for (i, (rank, c)) in children.iter_mut().enumerate() {
                    if !done[i] {
                        if let Ok(Some(st)) = c.try_wait() {
                            done[i] = true;
                            if !culprit.killed && st.signal().is_some() {
                                culprit = Culprit {
                                    rank: Some(*rank),
                                    cause: format!("{st}"),
                                    killed: true,
                                };
                            }
                        }
                    }
                }
                if done.iter().all(|d| *d)
                    || Instant::now() >= until
                    || (w.on_signal.is_some() && signals::received().1 > 0)
                {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            kill_all(children);
            return Ended::Failed {
                rank: culprit.rank,
                cause: culprit.cause,
            };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The worker a failure is blamed on.
#[derive(Debug)]
struct Culprit {
    rank: Option<usize>,
    cause: String,
    /// Whether it was killed by a signal (rather than exiting with an error).
    killed: bool,
}

/// Records that worker `rank` ended unsuccessfully with `st`: the first failure, unless a
/// worker killed by a signal comes after workers that exited with an error (a killed
/// worker is the likelier cause; the others report losing it).
fn note_failure(failure: &mut Option<Culprit>, rank: usize, st: &std::process::ExitStatus) {
    let killed = st.signal().is_some();
    if failure.as_ref().is_none_or(|f| killed && !f.killed) {
        *failure = Some(Culprit {
            rank: Some(rank),
            cause: format!("{st}"),
            killed,
        });
    }
}

/// Sends SIGTERM to every worker still running; returns when their grace ends.
fn forward(children: &[(usize, Child)], done: &[bool], grace: Duration) -> Instant {
    for ((_, c), d) in children.iter().zip(done) {
        if !*d {
            // A worker that is already gone cannot be told; it is reaped as usual.
            let _ = signals::send(c.id(), signals::SIGTERM);
        }
    }
    Instant::now() + grace
}

/// Waits for every worker process `(rank, child)`. On the first failure, or at `deadline`,
/// the others get `grace` to exit on their own (so they can report the lost peer) and are
/// then killed; the error names the rank(s).
pub(crate) fn supervise(
    children: &mut [(usize, Child)],
    deadline: Option<Instant>,
    grace: Duration,
) -> Result<(), String> {
    let w = Watch {
        deadline,
        grace,
        on_signal: None,
        live: false,
    };
    match watch(children, w) {
        Ended::Done | Ended::Survived { .. } => Ok(()),
        Ended::Failed {
            rank: Some(rank),
            cause,
        } => Err(format!("worker {rank} failed ({cause})")),
        Ended::Failed { rank: None, cause } => Err(cause),
        Ended::Stopped { signal, note } => Err(format!(
            "stopped by {}: {note}",
            signals::signal_name(signal)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn sh(script: &str) -> Child {
        Command::new("sh").arg("-c").arg(script).spawn().unwrap()
    }

    #[test]
    fn under_live_membership_the_others_go_on_and_only_a_total_loss_fails() {
        let live = Watch {
            deadline: None,
            grace: Duration::from_millis(200),
            on_signal: None,
            live: true,
        };
        // Worker 1 fails first; 0 and 2 are not stopped, and end well.
        let mut children = vec![
            (0, sh("sleep 0.5; exit 0")),
            (1, sh("exit 5")),
            (2, sh("sleep 0.7; exit 0")),
        ];
        match watch(&mut children, live) {
            Ended::Survived { lost, .. } => {
                assert_eq!(lost.len(), 1);
                assert_eq!(lost[0].0, 1);
                assert!(lost[0].1.contains('5'), "{lost:?}");
            }
            other => panic!("{other:?}"),
        }
        // Nobody ends well: the first loss is the failure.
        let mut children = vec![(0, sh("sleep 0.3; exit 4")), (1, sh("exit 5"))];
        match watch(&mut children, live) {
            Ended::Failed {
                rank: Some(1),
                cause,
            } => assert!(cause.contains('5'), "{cause}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn under_live_membership_lost_workers_are_replaced_until_the_run_is_complete() {
        let live = Watch {
            deadline: None,
            grace: Duration::from_millis(200),
            on_signal: None,
            live: true,
        };
        // Worker 1 fails; its newcomer runs and ends well. Worker 2 fails after worker 0
        // finished: the run is complete, nothing to replace it for.
        let mut children = vec![
            (0, sh("sleep 0.6; exit 0")),
            (1, sh("exit 1")),
            (2, sh("sleep 0.9; exit 1")),
        ];
        let mut started = Vec::new();
        let mut start = |rank: usize| -> Result<Child, String> {
            started.push(rank);
            Ok(sh("sleep 0.2; exit 0"))
        };
        match watch_replacing(&mut children, live, Some((&mut start, 5))) {
            Ended::Survived { lost, replaced, .. } => {
                assert_eq!(lost.iter().map(|l| l.0).collect::<Vec<_>>(), vec![1, 2]);
                assert_eq!(replaced, vec![1]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(started, vec![1]);
        // A newcomer that could not join: neither lost nor replaced.
        let mut children = vec![(0, sh("sleep 0.3; exit 0")), (1, sh("exit 3"))];
        let mut start = |_: usize| -> Result<Child, String> { panic!("no newcomer wanted") };
        assert_eq!(
            watch_replacing(&mut children, live, Some((&mut start, 5))),
            Ended::Done
        );
    }

    #[test]
    fn a_failure_names_the_rank_and_stops_the_others() {
        let mut children = vec![(0, sh("sleep 30")), (1, sh("exit 3"))];
        let t = Instant::now();
        let w = Watch {
            deadline: None,
            grace: Duration::from_millis(200),
            on_signal: None,
            live: false,
        };
        match watch(&mut children, w) {
            Ended::Failed {
                rank: Some(1),
                cause,
            } => assert!(cause.contains('3'), "{cause}"),
            other => panic!("{other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(10));
        // Every child is reaped.
        for (_, c) in &mut children {
            assert!(c.try_wait().unwrap().is_some());
        }
        // A worker killed by a signal is blamed over one that exited with an error first
        // (a survivor reporting the lost peer).
        let mut children = vec![
            (0, sh("exit 1")),
            (1, sh("sleep 0.3; kill -9 $$")),
            (2, sh("sleep 30")),
        ];
        match watch(
            &mut children,
            Watch {
                grace: Duration::from_secs(2),
                ..w
            },
        ) {
            Ended::Failed {
                rank: Some(1),
                cause,
            } => assert!(cause.contains("SIGKILL"), "{cause}"),
            other => panic!("{other:?}"),
        }
        let mut ok = vec![(0, sh("exit 0")), (1, sh("exit 0"))];
        assert_eq!(watch(&mut ok, w), Ended::Done);
        let mut late = vec![(0, sh("sleep 30"))];
        let w = Watch {
            deadline: Some(Instant::now() + Duration::from_millis(100)),
            ..w
        };
        assert!(matches!(
            watch(&mut late, w),
            Ended::Failed { rank: None, .. }
        ));
    }

    #[test]
    fn a_worker_that_stopped_for_a_signal_stops_the_run_instead_of_failing_it() {
        let _g = signals::TEST_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        // Exit status 128 + SIGTERM: a worker that honoured a stop request.
        let code = 128 + signals::SIGTERM;
        let mut children = vec![(0, sh(&format!("exit {code}"))), (1, sh("sleep 0.2"))];
        let w = Watch {
            deadline: None,
            grace: Duration::ZERO,
            on_signal: Some(Duration::from_secs(10)),
            live: false,
        };
        match watch(&mut children, w) {
            Ended::Stopped { signal, note } => {
                assert_eq!(signal, signals::SIGTERM);
                assert!(note.contains("every worker stopped"), "{note}");
            }
            other => panic!("{other:?}"),
        }
        // Without signal handling, it is an ordinary failure.
        let mut children = vec![(0, sh(&format!("exit {code}")))];
        let w = Watch {
            on_signal: None,
            ..w
        };
        assert!(matches!(
            watch(&mut children, w),
            Ended::Failed { rank: Some(0), .. }
        ));
    }
}
