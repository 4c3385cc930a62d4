//! Background assembly of the next training batch of images: while the model computes on
//! batch `j`, a thread draws, augments and normalises the items of batch `j + 1` into host
//! buffers, so the step's data phase is only the copy into a tensor.
//!
//! Nothing about the batches changes: an item is a pure function of the source, the epoch and
//! its index ([module docs](super)), and a prepared batch is used only when it holds exactly
//! the items (and epoch) asked for; anything else is assembled on the caller's thread as
//! before.

use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use super::{fill_images, Source};

/// One batch's host data: the items asked for and, once assembled, their values.
#[derive(Default)]
struct Prepared {
    epoch: u64,
    items: Vec<usize>,
    data: Vec<f32>,
    labels: Vec<i64>,
    /// `[c, h, w]` of every item.
    shape: [usize; 3],
}

/// The prefetch thread and its one batch in flight.
pub(super) struct Prefetch {
    jobs: Option<mpsc::Sender<Prepared>>,
    done: mpsc::Receiver<Prepared>,
    /// A batch was asked for and not yet taken.
    pending: bool,
    /// Buffers of a batch taken, for the next request.
    spare: Prepared,
    thread: Option<JoinHandle<()>>,
}

impl Prefetch {
    /// Starts the thread, which assembles training batches of `src`.
    pub(super) fn start(src: Arc<Source>) -> std::io::Result<Self> {
        let (jobs, rx) = mpsc::channel::<Prepared>();
        let (tx, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("dtrain-prefetch".into())
            .spawn(move || {
                for mut p in rx {
                    p.shape =
                        fill_images(&src, &p.items, Some(p.epoch), &mut p.data, &mut p.labels);
                    if tx.send(p).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Prefetch {
            jobs: Some(jobs),
            done,
            pending: false,
            spare: Prepared::default(),
            thread: Some(thread),
        })
    }

    /// Asks for the items `items` of `epoch` (dropping a batch asked for before and not
    /// taken).
    pub(super) fn request(&mut self, epoch: u64, items: &[usize]) {
        if self.pending {
            // At most one in flight: wait for the stale one (its buffers are reused).
            match self.done.recv() {
                Ok(p) => self.spare = p,
                Err(_) => return self.stop(),
            }
        }
        let mut p = std::mem::take(&mut self.spare);
        p.epoch = epoch;
        p.items.clear();
        p.items.extend_from_slice(items);
        match self.jobs.as_ref().map(|j| j.send(p)) {
            Some(Ok(())) => self.pending = true,
            _ => self.stop(),
        }
    }

    /// When the batch asked for last is `items` of `epoch`: swaps its values into `data` and
    /// its labels into `labels` (their old buffers serve the next request) and returns the
    /// `[c, h, w]` of an item. `None` otherwise (or when the thread has ended): the caller
    /// then assembles the batch itself.
    pub(super) fn take_into(
        &mut self,
        epoch: u64,
        items: &[usize],
        data: &mut Vec<f32>,
        labels: &mut Vec<i64>,
    ) -> Option<[usize; 3]> {
        if !std::mem::take(&mut self.pending) {
            return None;
        }
        let Ok(p) = self.done.recv() else {
            // The thread ended (it panicked on an item): the caller's own assembly says why.
            self.stop();
            return None;
        };
        let hit = p.epoch == epoch && p.items == items;
        self.spare = p;
        hit.then(|| {
            std::mem::swap(&mut self.spare.data, data);
            std::mem::swap(&mut self.spare.labels, labels);
            self.spare.shape
        })
    }

    fn stop(&mut self) {
        self.pending = false;
        self.jobs = None;
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        // Closing the job channel ends the thread after the batch it is assembling.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
