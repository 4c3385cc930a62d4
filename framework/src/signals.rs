//! Signals: how `dtrain run` and its workers stop on SIGTERM / SIGINT, and why a worker
//! never outlives its launcher.
//!
//! * **The launcher** ([`crate::launch`]) catches SIGTERM and SIGINT while its workers run
//!   ([`catch`]). The first is forwarded to every worker as SIGTERM; the workers then have
//!   `checkpoint.grace_s` to finish the current step, write a checkpoint and exit, after
//!   which the ones left are killed. A second signal kills them at once. Either way the
//!   launcher exits with 128 + the signal and names the newest intact checkpoint.
//! * **A worker** catches both as a [`StopRequest`]. The trainer carries the request in the
//!   step's control all-reduce, so every rank learns of it in the same step (whichever rank
//!   got the signal), finishes that step, checkpoints and stops. Workers run in their own
//!   process group, so a terminal's Ctrl-C reaches only the launcher, which forwards it once.
//!   A rank started by a scheduler (no launcher) stops at once on a second signal.
//! * **No orphans**: a worker asks the kernel to kill it when its launcher dies
//!   ([`die_with_launcher`]: Linux `PR_SET_PDEATHSIG`), and checks at start-up that the
//!   launcher is still its parent (the launcher may have died before the request was made).
//!
//! The handlers only store into atomics (async-signal-safe); everything else polls them.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};
use std::sync::Arc;

/// The environment variable carrying the launcher's process id to its workers.
pub const LAUNCHER_PID_ENV: &str = "DTRAIN_LAUNCHER_PID";

/// The signals that stop a run: SIGTERM (Slurm, Kubernetes, `kill`) and SIGINT (Ctrl-C).
pub const STOP_SIGNALS: [i32; 2] = [libc::SIGTERM, libc::SIGINT];

/// SIGTERM's number.
pub const SIGTERM: i32 = libc::SIGTERM;

/// The last stop signal this process received (0: none).
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// How many stop signals this process received since [`catch`].
static COUNT: AtomicU32 = AtomicU32::new(0);
/// Whether a second signal ends the process at once (a rank without a launcher).
static ESCALATE: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    let before = COUNT.fetch_add(1, Ordering::SeqCst);
    SIGNAL.store(sig, Ordering::SeqCst);
    if before > 0 && ESCALATE.load(Ordering::SeqCst) {
        // SAFETY: `_exit` is async-signal-safe; nothing else runs here.
        unsafe { libc::_exit(128 + sig) }
    }
}

/// The handlers [`catch`] installed; dropping this puts the previous ones back (so a
/// signal after the run, e.g. during a sweep's report, has its default effect again).
pub struct Caught {
    previous: Vec<(libc::c_int, libc::sigaction)>,
}

impl std::fmt::Debug for Caught {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caught")
            .field(
                "signals",
                &self.previous.iter().map(|p| p.0).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Drop for Caught {
    fn drop(&mut self) {
        for (sig, old) in &self.previous {
            // SAFETY: `old` is the action `sigaction` returned for `sig`.
            unsafe {
                libc::sigaction(*sig, old, std::ptr::null_mut());
            }
        }
        COUNT.store(0, Ordering::SeqCst);
        SIGNAL.store(0, Ordering::SeqCst);
        ESCALATE.store(false, Ordering::SeqCst);
    }
}

/// Serialises the unit tests that read or raise this process's signals.
#[cfg(test)]
pub(crate) static TEST_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Catches SIGTERM and SIGINT for this process, from now until the result is dropped, and
/// forgets the signals received before. With `escalate`, a second signal ends the process
/// at once with status 128 + signal (for a rank that has no launcher to do it).
pub fn catch(escalate: bool) -> std::io::Result<Caught> {
    COUNT.store(0, Ordering::SeqCst);
    SIGNAL.store(0, Ordering::SeqCst);
    ESCALATE.store(escalate, Ordering::SeqCst);
    let mut caught = Caught {
        previous: Vec::new(),
    };
    for sig in STOP_SIGNALS {
        // SAFETY: a zeroed `sigaction` is a valid value (no flags, empty mask); the handler
        // only touches atomics.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            // Restart interrupted system calls: a socket read must not fail with EINTR.
            act.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut act.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, &act, &mut old) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            caught.previous.push((sig, old));
        }
    }
    Ok(caught)
}

/// What this process received since [`catch`]: the last stop signal and how many.
pub fn received() -> (Option<i32>, u32) {
    let s = SIGNAL.load(Ordering::SeqCst);
    ((s != 0).then_some(s), COUNT.load(Ordering::SeqCst))
}

/// `SIGTERM`, `SIGINT`, …, or `signal N`.
pub fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGINT => "SIGINT".into(),
        libc::SIGKILL => "SIGKILL".into(),
        libc::SIGHUP => "SIGHUP".into(),
        libc::SIGSTOP => "SIGSTOP".into(),
        n => format!("signal {n}"),
    }
}

/// Sends `sig` to process `pid`; an error when it could not be sent (the process is gone).
pub fn send(pid: u32, sig: i32) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "pid out of range"))?;
    // SAFETY: plain system call on integers.
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A request to stop training after the current step: from this process's SIGTERM / SIGINT
/// ([`StopRequest::process`], once [`catch`] installed the handlers), or raised by hand
/// ([`StopRequest::manual`], for tests and embedders that run several trainers in one
/// process).
#[derive(Debug, Clone)]
pub struct StopRequest(Option<Arc<AtomicI32>>);

impl StopRequest {
    /// The signals this process receives.
    pub fn process() -> Self {
        StopRequest(None)
    }

    /// A request of its own, raised only by [`StopRequest::request`].
    pub fn manual() -> Self {
        StopRequest(Some(Arc::new(AtomicI32::new(0))))
    }

    /// Raises the request as if `signal` had been received.
    pub fn request(&self, signal: i32) {
        match &self.0 {
            Some(flag) => flag.store(signal, Ordering::SeqCst),
            None => SIGNAL.store(signal, Ordering::SeqCst),
        }
    }

    /// The signal that asked to stop, if any did.
    pub fn signal(&self) -> Option<i32> {
        let s = match &self.0 {
            Some(flag) => flag.load(Ordering::SeqCst),
            None => SIGNAL.load(Ordering::SeqCst),
        };
        (s != 0).then_some(s)
    }
}

/// For a worker started by `dtrain run` ([`LAUNCHER_PID_ENV`] set): asks the kernel to kill
/// this process when its parent dies (Linux `PR_SET_PDEATHSIG` with SIGKILL), then checks
/// that the parent is still the launcher — it may have died before the request was made,
/// and then nobody would send the signal. Does nothing without the variable (a rank started
/// by a scheduler or by `mpirun`).
///
/// The kernel sends the signal when the launcher's *thread* that spawned the worker ends;
/// the launcher spawns and waits on one thread.
pub fn die_with_launcher() -> Result<(), String> {
    let Ok(v) = std::env::var(LAUNCHER_PID_ENV) else {
        return Ok(());
    };
    let launcher: u32 = v
        .trim()
        .parse()
        .map_err(|_| format!("{LAUNCHER_PID_ENV}={v:?} is not a process id"))?;
    #[cfg(target_os = "linux")]
    {
        // SAFETY: prctl with integer arguments only.
        let r = unsafe {
            libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            )
        };
        if r != 0 {
            return Err(format!(
                "asking to be stopped with the launcher (PR_SET_PDEATHSIG): {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    let parent = std::os::unix::process::parent_id();
    if parent != launcher {
        return Err(format!(
            "the launcher (pid {launcher}) is gone (this worker's parent is now pid {parent}): \
             not starting"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_request_is_its_own_and_names_the_signal() {
        let a = StopRequest::manual();
        let b = StopRequest::manual();
        assert_eq!(a.signal(), None);
        a.request(SIGTERM);
        assert_eq!(a.signal(), Some(SIGTERM));
        assert_eq!(b.signal(), None);
        assert_eq!(
            a.clone().signal(),
            Some(SIGTERM),
            "clones share the request"
        );
        assert_eq!(signal_name(SIGTERM), "SIGTERM");
        assert_eq!(signal_name(libc::SIGINT), "SIGINT");
        assert_eq!(signal_name(64), "signal 64");
    }

    #[test]
    fn a_caught_signal_is_counted_and_the_old_handler_comes_back() {
        let _g = TEST_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        // SIGINT to this very process, caught: counted, the process lives on.
        let caught = catch(false).unwrap();
        assert_eq!(received(), (None, 0));
        // SAFETY: raise on integers.
        unsafe { libc::raise(libc::SIGINT) };
        assert_eq!(received(), (Some(libc::SIGINT), 1));
        assert_eq!(StopRequest::process().signal(), Some(libc::SIGINT));
        unsafe { libc::raise(libc::SIGINT) };
        assert_eq!(received().1, 2, "no escalation asked: still alive");
        drop(caught);
        // The previous action is back: read it without changing it.
        // SAFETY: querying with a null new action.
        let handler = unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGINT, std::ptr::null(), &mut old);
            old.sa_sigaction
        };
        assert_ne!(
            handler,
            on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t
        );
        assert_eq!(received(), (None, 0), "forgotten with the handlers");
    }

    #[test]
    fn without_a_launcher_nothing_is_asked_and_a_wrong_one_is_refused() {
        // The test harness does not set the variable for this process.
        if std::env::var_os(LAUNCHER_PID_ENV).is_none() {
            assert_eq!(die_with_launcher(), Ok(()));
        }
        assert!(send(u32::MAX, 0).is_err());
        assert!(send(std::process::id(), 0).is_ok(), "signal 0 only checks");
    }
}
