//! The progress display of rank 0: one indicatif bar per epoch with loss, throughput,
//! bytes per step and ETA; evaluations and notices printed above the bar. Every worker
//! has one ([`Leading`]), shown while the worker leads its group: the first rank 0, and
//! under live membership whichever worker leads after it was lost.

use dtrain_framework::trainer::{EvalRecord, Observer, StepRecord};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Draws progress on stderr (hidden when stderr is not a terminal, where a line per
/// epoch is printed instead).
pub struct Progress {
    bar: Option<ProgressBar>,
    per_epoch: u64,
    total: u64,
    epoch: u64,
    loss: f64,
    bytes: f64,
    samples: f64,
    seconds: f64,
    n: u64,
    tty: bool,
}

impl Progress {
    /// A display; `tty` decides between a live bar and plain lines.
    pub fn new() -> Self {
        Progress {
            bar: None,
            per_epoch: 1,
            total: 0,
            epoch: u64::MAX,
            loss: 0.0,
            bytes: 0.0,
            samples: 0.0,
            seconds: 0.0,
            n: 0,
            tty: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        }
    }

    fn start_epoch(&mut self, epoch: u64, first_step: u64) {
        if let Some(b) = self.bar.take() {
            b.finish();
        }
        self.epoch = epoch;
        self.loss = 0.0;
        self.bytes = 0.0;
        self.samples = 0.0;
        self.seconds = 0.0;
        self.n = 0;
        let epochs = self.total.div_ceil(self.per_epoch);
        let len = self.per_epoch.min(self.total - epoch * self.per_epoch);
        let bar = ProgressBar::with_draw_target(
            Some(len),
            if self.tty {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        bar.set_style(
            ProgressStyle::with_template("epoch {prefix} [{bar:30}] {pos}/{len} {msg} ETA {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(format!("{}/{epochs}", epoch + 1));
        bar.set_position(first_step - epoch * self.per_epoch);
        self.bar = Some(bar);
    }

    fn line(&self) -> String {
        let n = self.n.max(1) as f64;
        format!(
            "loss {:.4}  {:.0} samples/s  {}/step",
            self.loss / n,
            if self.seconds > 0.0 {
                self.samples / self.seconds
            } else {
                0.0
            },
            human_bytes(self.bytes / n)
        )
    }
}

/// A [`Progress`] shown only while this worker leads its group ([`Observer::on_rank`]).
pub struct Leading {
    inner: Progress,
    leading: bool,
    total: u64,
    per_epoch: u64,
}

impl Leading {
    /// A display for a worker of rank `rank` at the start.
    pub fn new(rank: usize) -> Self {
        Leading {
            inner: Progress::new(),
            leading: rank == 0,
            total: 0,
            per_epoch: 1,
        }
    }
}

impl Observer for Leading {
    fn on_rank(&mut self, rank: usize, step: u64) {
        let was = self.leading;
        self.leading = rank == 0;
        if self.leading && !was && self.total > 0 {
            // Took over from a lost leader: the display goes on from here.
            eprintln!("this worker leads the group from step {step} on");
            self.inner.per_epoch = self.per_epoch.max(1);
            self.inner.total = self.total;
            if step < self.total {
                self.inner.start_epoch(step / self.inner.per_epoch, step);
            }
        }
    }
    fn on_start(&mut self, step: u64, total: u64, per_epoch: u64) {
        (self.total, self.per_epoch) = (total, per_epoch);
        if self.leading {
            self.inner.on_start(step, total, per_epoch);
        }
    }
    fn on_step(&mut self, r: &StepRecord) {
        if self.leading {
            self.inner.on_step(r);
        }
    }
    fn on_eval(&mut self, r: &EvalRecord) {
        if self.leading {
            self.inner.on_eval(r);
        }
    }
    fn on_message(&mut self, msg: &str) {
        if self.leading {
            self.inner.on_message(msg);
        }
    }
}

fn human_bytes(b: f64) -> String {
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{b:.0} B")
    }
}

impl Observer for Progress {
    fn on_start(&mut self, step: u64, total: u64, per_epoch: u64) {
        self.per_epoch = per_epoch.max(1);
        self.total = total;
        if step > 0 {
            eprintln!("resuming at step {step} of {total}");
        }
        if step < total {
            self.start_epoch(step / self.per_epoch, step);
        }
    }

    fn on_step(&mut self, r: &StepRecord) {
        if r.epoch != self.epoch {
            self.start_epoch(r.epoch, r.step);
        }
        if let Some(l) = r.loss {
            self.loss += l;
        }
        self.bytes += r.bytes_sent as f64;
        self.samples += r.samples as f64;
        self.seconds += r.time.step_s;
        self.n += 1;
        if let Some(b) = &self.bar {
            b.set_message(self.line());
            b.inc(1);
        }
        let end_of_epoch = (r.step + 1).is_multiple_of(self.per_epoch) || r.step + 1 == self.total;
        if !self.tty && end_of_epoch {
            eprintln!("epoch {}: {}", r.epoch + 1, self.line());
        }
    }

    fn on_eval(&mut self, r: &EvalRecord) {
        let msg = format!(
            "eval after epoch {} (step {}): {}",
            r.epoch,
            r.step,
            crate::eval_line(r)
        );
        match &self.bar {
            Some(b) if self.tty => b.println(msg),
            _ => eprintln!("{msg}"),
        }
    }

    fn on_message(&mut self, msg: &str) {
        match &self.bar {
            Some(b) if self.tty => b.println(msg),
            _ => eprintln!("{msg}"),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish();
        }
    }
}
