//! Exchanges left in flight across steps.
//!
//! [`InFlight`] owns a thread with its own [`Communicator`] — over the second lane of the
//! run's connections ([`dtrain_comms::split_tagged`]), so its collectives and the
//! trainer's (the control all-reduce of every step, an evaluation's average) cross the same
//! links without waiting for each other. The synchronisation hands it an exchanger and a
//! buffer ([`Job`]); the thread averages the buffer through the exchanger exactly as the
//! blocking path would, and hands both back ([`Done`]). Jobs run one at a time in the order
//! they were started, the same on every rank, so the ranks' background collectives pair up
//! as the foreground ones do.
//!
//! Streaming DiLoCo ([`super::Streaming`]) starts a fragment's exchange at the step that
//! ends its round and takes the result τ steps later, at its merge: the communication
//! overlaps those steps' computation, as the paper's schedule intends.

use std::collections::VecDeque;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::Instant;

use dtrain_comms::{Communicator, Transport};
use dtrain_records::StepRecord;

use super::{Collectives, SyncError};

/// An exchange to run: `buf` averaged through `ex` as the exchange of `step`.
pub(crate) struct Job {
    /// The caller's name for it (a fragment's index).
    pub(crate) id: usize,
    pub(crate) ex: Collectives,
    pub(crate) buf: Vec<f32>,
    pub(crate) step: u64,
}

/// A finished [`Job`]: the exchanger and the buffer back, and what the exchange gave.
pub(crate) struct Done {
    pub(crate) id: usize,
    pub(crate) ex: Collectives,
    /// The average (when `result` is `Ok`).
    pub(crate) buf: Vec<f32>,
    /// Whether the average is non-finite, as [`Collectives::exchange`] says.
    pub(crate) result: Result<bool, SyncError>,
    /// Its bytes, times and the method's figures.
    pub(crate) record: StepRecord,
    /// Seconds from the start of the job to its end on the thread.
    pub(crate) took_s: f64,
}

/// The thread running exchanges in the background (see the [module docs](self)).
pub(crate) struct InFlight {
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
    /// Ids started and not yet taken back, oldest first.
    open: VecDeque<usize>,
}

impl InFlight {
    /// Starts the thread; `comm` is its communicator.
    pub(crate) fn spawn<T: Transport + 'static>(mut comm: Communicator<T>) -> InFlight {
        let (jobs, rx) = channel::<Job>();
        let (tx, done) = channel::<Done>();
        let thread = std::thread::Builder::new()
            .name(format!("dtrain-in-flight-{}", comm.rank()))
            .spawn(move || {
                for mut job in rx {
                    let t = Instant::now();
                    let mut record = StepRecord::default();
                    let result = job
                        .ex
                        .exchange(&mut comm, &mut job.buf, job.step, &mut record);
                    let failed = result.is_err();
                    let d = Done {
                        id: job.id,
                        ex: job.ex,
                        buf: job.buf,
                        result,
                        record,
                        took_s: t.elapsed().as_secs_f64(),
                    };
                    if tx.send(d).is_err() || failed {
                        // Nobody waits for more, or the connections failed: the jobs still
                        // queued would fail alike.
                        break;
                    }
                }
            })
            .expect("spawning a thread");
        InFlight {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            open: VecDeque::new(),
        }
    }

    /// Hands `job` to the thread.
    pub(crate) fn start(&mut self, job: Job) -> Result<(), SyncError> {
        let id = job.id;
        let sent = self.jobs.as_ref().is_some_and(|j| j.send(job).is_ok());
        if !sent {
            return Err(self.gone());
        }
        self.open.push_back(id);
        Ok(())
    }

    /// Whether job `id` was started and not yet taken back.
    pub(crate) fn is_open(&self, id: usize) -> bool {
        self.open.contains(&id)
    }

    /// Waits for the oldest job in flight and takes it back (`None` when none is).
    pub(crate) fn next(&mut self) -> Result<Option<Done>, SyncError> {
        if self.open.is_empty() {
            return Ok(None);
        }
        match self.done.recv() {
            Ok(d) => {
                self.open.pop_front();
                Ok(Some(d))
            }
            Err(_) => Err(self.gone()),
        }
    }

    /// The error for a thread that ended before its jobs did (it panicked, or an earlier
    /// job's connections failed and that error was already taken).
    fn gone(&mut self) -> SyncError {
        self.jobs = None;
        let why = match self.thread.take().map(JoinHandle::join) {
            Some(Err(p)) => p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into()),
            _ => "an earlier exchange's failure".into(),
        };
        SyncError::Background(format!(
            "the thread of the exchanges in flight ended ({why}) with {} exchange(s) pending",
            self.open.len()
        ))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // Closing the queue ends the thread after the job it runs, if any (a job whose
        // peers are gone ends with the communicator's timeout).
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
