//! Live membership (`cluster.membership = "live"`): a worker lost during the run is
//! dropped, and the others go on without a restart.
//!
//! ```text
//! a collective of step s (or of the evaluation / checkpoint after it) fails naming ranks
//!   ─► Communicator::regroup: the survivors agree on the group without them (new epoch)
//!   ─► all-gather: where each survivor stands (the step it was in and that step's kind,
//!      the steps it finished, its replicated sections' checksums)
//!   ─► every survivor decides alike (super::recovery): roll forward from the most steps
//!      any finished (a survivor whose replicated state differs takes it, in slices from
//!      all that match, and keeps its own memories), catch a local step up alone, or go
//!      back to a copy kept before a step that ends a round
//!   ─► the synchronisation is built again over the group; the evaluation and checkpoint
//!      due at that step are made again where a survivor had not finished them
//! ```
//!
//! **Going on.** What the survivors go on from — rolling forward from one that finished
//! the step, a laggard running a local step alone, or going back to a copy kept before a
//! step that ends a round — is decided alike by every survivor, step by step, in
//! [`super::recovery`]. In every step that exchanges as an every-step synchronisation does
//! nothing is copied before the step: there the per-step cost of live membership is the
//! step deadline's bookkeeping. The periodic synchronisations keep a copy only before a
//! step that ends a round of local SGD or DiLoCo, or exchanges a Streaming DiLoCo
//! fragment: once a round, beside the round's exchange (0/1 Adam's synchronisations run
//! their cut exchange again instead). On the main job's state the copy took 7–8 ms,
//! about 9 % of the step, when every run kept it before every step (README "Stopping,
//! failures and resuming"); a step record's `time.keep_s` shows it.
//!
//! **What a step over fewer workers means.** The step's mean is over the survivors, so its
//! effective batch is theirs (`P′ · batch_size`); the learning rate stays the one of the
//! configured worker count. Every worker keeps its own data shard (its rank at the start
//! names it): no sample is read twice, and the lost worker's shard is not read while its
//! place is empty. Each survivor keeps its own error-feedback memories; the lost worker's
//! — the part of its gradients it had yet to send — is lost with it. Replicated state
//! (parameters, optimizer, compressor and `[sync]` state) is identical on the survivors.
//!
//! **Newcomers.** A worker may take a lost worker's place (`Trainer::join`; the launcher's
//! replacement under `--max-restarts`, `dtrain worker --join`, or a worker the group dropped
//! while it was alive, joining again): its transport connects to
//! the members, and each member that sees it waiting says so in the next step's control
//! all-reduce. Before the following step (for a periodic `[sync]` kind: before the first
//! step at which the replicas are identical, a round's end) the members admit it
//! (`Communicator::admit`: epoch + 1, the newcomer appended to the group), build the
//! synchronisation over the larger group, and hand it their state of that step in slices
//! (`handover`); it restores it and runs the step with them. It reads the shard of the rank
//! it took, from that step on: what that shard held between the loss and the entry is not
//! read this epoch. Its error-feedback memory starts at zero.

use std::collections::VecDeque;
use std::time::Instant;

use dtrain_comms::{CommError, Membership, Transport};
use dtrain_records::MembershipChange;

use super::recovery::StepKind;
use super::{build_sync, handover, BuiltSync, Observer, TrainError, Trainer};
use crate::checkpoint::Checkpoint;

/// How far a rank got in a step (live membership: what a failure cut).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Progress {
    /// Past the step's control all-reduce: its exchange may have changed memories and
    /// compressor state.
    Controlled,
    /// Its update applied (a periodic synchronisation's round exchange still to come).
    Applied,
    /// Its exchanges done: only the comparison of the replicas may follow.
    Exchanged,
}

/// Live membership's state in a [`Trainer`].
#[derive(Default)]
pub(super) struct Live {
    /// This rank's state before each of the last two steps it began that keep one,
    /// oldest first ([`StepKind::keeps_copy`]).
    pub(super) kept: VecDeque<(u64, Checkpoint)>,
    /// How far this rank got in the step it runs (see [`Progress`]).
    pub(super) progress: Option<(u64, Progress)>,
    /// The kind of the step it began last, as the synchronisation said then.
    pub(super) kind: Option<StepKind>,
    /// The record of a step whose round exchange can run again
    /// ([`StepKind::reruns`]), as it stood when the step's update was applied: a survivor
    /// of a cut in that exchange finishes the step from it.
    pub(super) applied: Option<(u64, Box<dtrain_records::StepRecord>)>,
    /// The parameters' scratch of [`Trainer::state_in`], kept between steps.
    pub(super) params: Vec<f32>,
    /// The changes so far (`summary.json`).
    pub(super) changes: Vec<MembershipChange>,
    /// When the session began (for [`MembershipChange::after_s`]).
    started: Option<Instant>,
    /// When the current step (or evaluation, checkpoint) began.
    began: Option<Instant>,
    /// Steps timed so far (the first, with its warm-up, is not).
    timed: u64,
    /// The mean of their step times, in seconds.
    mean_step_s: f64,
    /// A member saw a newcomer waiting (the last step's control all-reduce said so).
    pub(super) newcomer_waiting: bool,
    /// The records of the last steps this rank finished that `metrics.jsonl` gets, oldest
    /// first: a rank that takes the logs over writes those the lost leader finished but
    /// had not written when it was killed (see [`Trainer::reopen_logs`]).
    pub(super) finished: VecDeque<dtrain_records::StepRecord>,
}

impl<T: Transport> Trainer<T> {
    /// The session begins at `t`, unless it began already (a newcomer's, as it asked to be
    /// admitted).
    pub(super) fn live_session(&mut self, t: Instant) {
        if let Some(l) = &mut self.live {
            l.started.get_or_insert(t);
        }
    }

    /// After a step that took `step_s`: the step deadline becomes `deadline_factor` times
    /// the mean step time, within `[deadline_floor_s, timeout_s]` (see
    /// [`crate::config::ClusterConfig::deadline_factor`]).
    pub(super) fn adapt_deadline(&mut self, step_s: f64) {
        let Some(l) = &mut self.live else {
            return;
        };
        l.timed += 1;
        if l.timed == 1 {
            return;
        }
        let n = (l.timed - 1) as f64;
        l.mean_step_s += (step_s - l.mean_step_s) / n;
        let d = self.deadline_s();
        self.comm.set_timeout(std::time::Duration::from_secs_f64(d));
    }

    /// The step deadline now, in seconds.
    fn deadline_s(&self) -> f64 {
        let c = &self.plan.config.cluster;
        match &self.live {
            Some(l) if l.timed > 1 => (c.deadline_factor * l.mean_step_s)
                .max(c.deadline_floor_s)
                .min(c.timeout_s),
            _ => c.timeout_s,
        }
    }

    /// Step `r.step` is done and `metrics.jsonl` gets its record: kept (the newest two), in
    /// case this rank takes the logs over from a leader killed before it wrote it.
    pub(super) fn keep_record(&mut self, r: &dtrain_records::StepRecord) {
        if let Some(l) = &mut self.live {
            while l.finished.len() >= 2 {
                l.finished.pop_front();
            }
            l.finished.push_back(r.clone());
        }
    }

    /// Before step `self.step`: notes when it began and its kind, and, where a failure in
    /// it could send the group back ([`StepKind::keeps_copy`]), keeps this rank's state
    /// (the newest two). Returns the seconds the copy took (the step record's `keep_s`; 0
    /// without one).
    pub(super) fn begin_step(&mut self) -> Result<f64, TrainError> {
        let now = Instant::now();
        let kind = self.step_kind();
        let Some(l) = &mut self.live else {
            return Ok(0.0);
        };
        l.began = Some(now);
        l.progress = None;
        l.applied = None;
        l.kind = Some(kind);
        let step = self.step;
        if !kind.keeps_copy() {
            if kind.rolls {
                // Only a laggard of the step before may still need its copy.
                l.kept.retain(|(s, _)| s + 1 >= step);
            }
            return Ok(0.0);
        }
        l.kept.retain(|(s, _)| *s < step);
        // The oldest kept state's buffers take this one (no allocation, no zeroing).
        let mut spare = None;
        while l.kept.len() >= 2 {
            spare = l.kept.pop_front().map(|(_, ck)| ck);
        }
        let mut ck = self.state_in(spare.map_or_else(Checkpoint::new, Checkpoint::recycle))?;
        ck.release_spare();
        let l = self.live.as_mut().expect("live");
        l.kept.push_back((step, ck));
        Ok(now.elapsed().as_secs_f64())
    }

    /// Under live membership: this rank applied the update of step `step`, whose record so
    /// far is `r` (kept where the step's round exchange can run again).
    pub(super) fn applied(&mut self, step: u64, r: &dtrain_records::StepRecord) {
        self.progressed(step, Progress::Applied);
        if let Some(l) = &mut self.live {
            l.applied = l
                .kind
                .filter(|k| k.step == step && k.reruns)
                .map(|_| (step, Box::new(r.clone())));
        }
    }

    /// Under live membership: this rank got as far as `p` in step `step`.
    pub(super) fn progressed(&mut self, step: u64, p: Progress) {
        if let Some(l) = &mut self.live {
            l.progress = Some((step, p));
        }
    }

    /// Step `step`'s exchanges are done, and the comparison of the replicas after it failed
    /// with the step's record `r` unwritten: `r` is kept for the logs, as a logged step's
    /// is (the survivors go on past the step).
    pub(super) fn keep_unlogged(&mut self, step: u64, r: &dtrain_records::StepRecord) {
        if step.is_multiple_of(self.plan.config.output.log_every.max(1)) {
            self.keep_record(r);
        }
    }

    /// The failure `e` happened under live membership: when it names lost members, the
    /// survivors agree on the group without them and go on from the state the group
    /// settles on (see the [module docs](self)); the run loop then goes on from its step.
    /// `post_pending`: the failure came while the evaluation and checkpoint due after the
    /// step just finished were being made. Returns whether they are to be made (again)
    /// before the next step. Any other error, or one the group cannot survive, is returned.
    pub(super) fn survive(
        &mut self,
        e: TrainError,
        obs: &mut dyn Observer,
        post_pending: bool,
    ) -> Result<bool, TrainError> {
        let (step, source) = match (&e, e.comm_error()) {
            (TrainError::Comm { step, .. } | TrainError::Exchange { step, .. }, Some(source)) => {
                (step, source)
            }
            _ => return Err(e),
        };
        let blamed = source.failed_ranks();
        if self.live.is_none() || blamed.is_empty() {
            return Err(e);
        }
        let failed_at = Instant::now();
        let deadline_s = self.deadline_s();
        // The error names group ranks; after a change they are not the workers' own.
        let members = self.comm.members();
        let cause = if members.iter().enumerate().all(|(i, &p)| i == p) {
            format!("step {step}: {source}")
        } else {
            format!("step {step}: {source} (ranks of the group {members:?})")
        };
        let membership = self
            .comm
            .regroup(&blamed)
            .map_err(|source| TrainError::Comm {
                step: *step,
                source: match source {
                    // Kept as it is: a worker dropped while alive may come back as a newcomer.
                    CommError::Excluded { detail } => CommError::Excluded {
                        detail: format!("{cause}; then, regrouping: {detail}"),
                    },
                    source => CommError::Poisoned(format!("{cause}; then, regrouping: {source}")),
                },
            })?;
        let reached = self.step;
        let was_rank0 = self.rank == 0;
        let (from, redo_post, notes) = self.recover(&membership, post_pending)?;
        if self.rank == 0 {
            self.reopen_logs(from, was_rank0, redo_post)?;
        }
        obs.on_rank(self.rank, from);
        let l = self.live.as_mut().expect("live");
        let change = MembershipChange {
            epoch: membership.epoch,
            removed: membership.removed.clone(),
            added: Vec::new(),
            members: membership.members.clone(),
            cause,
            step: from,
            after_s: l.started.map_or(0.0, |t| (failed_at - t).as_secs_f64()),
            steps_lost: reached.saturating_sub(from),
            lost_s: l.began.map_or(0.0, |t| t.elapsed().as_secs_f64()),
            deadline_s: Some(deadline_s),
        };
        obs.on_message(&format!(
            "membership epoch {}: worker(s) {:?} lost ({}); {} worker(s) {:?} go on from step {from} \
             ({:.2} s lost; step deadline {:.1} s)",
            change.epoch,
            change.removed,
            change.cause,
            change.members.len(),
            change.members,
            change.lost_s,
            deadline_s
        ));
        for n in notes {
            obs.on_message(&n);
        }
        l.changes.push(change);
        Ok(redo_post)
    }

    /// Builds the synchronisation over `membership`'s group and restores state `ck` into
    /// it, as of step `from` (the server residuals dropped: their ranges belong to the old
    /// group): what every way of going on after a change of the group ends with. Returns
    /// the state's metadata and the set-up's notes.
    pub(super) fn rebuild_with(
        &mut self,
        membership: &Membership,
        mut ck: Checkpoint,
        from: u64,
        bad: &dyn Fn(String) -> TrainError,
    ) -> Result<(super::checkpointing::Meta, Vec<String>), TrainError> {
        let notes = self.regroup_sync(membership)?;
        handover::drop_server_residuals(&mut ck).map_err(bad)?;
        let meta = self.restore_state(&ck, bad, false)?;
        self.step = from;
        // When the next comparison of the replicas is due is the state's (a survivor that
        // had compared them after the step runs it again with the others).
        self.replicas_checked_at = meta.replicas_checked_at;
        self.sync.start_at(from).map_err(|e| self.step_error(e))?;
        self.left_exchange = None;
        Ok((meta, notes))
    }

    /// Sets this worker's rank and world to `membership`'s and builds the synchronisation
    /// over its group (a collective of the group); returns what the set-up says for the log.
    fn regroup_sync(&mut self, membership: &Membership) -> Result<Vec<String>, TrainError> {
        let infos = super::param_infos(self.model.as_ref());
        self.rank = membership.rank;
        self.world = membership.members.len();
        let BuiltSync {
            sync,
            notes,
            hosts,
            codec_device,
            ..
        } = build_sync(&self.plan, &infos, &mut self.comm, self.model.device())?;
        self.sync = sync;
        self.hosts = hosts;
        self.codec_device = codec_device;
        Ok(notes)
    }

    /// Before step `self.step`, when a member saw a newcomer waiting (and the replicas are
    /// identical): the members admit the newcomers all of them have, rebuild the
    /// synchronisation over the larger group, and hand the newcomers their state (see the
    /// [module docs](self)). Every member calls it at the same step (the flag came from a
    /// control all-reduce).
    pub(super) fn admit_newcomers(&mut self, obs: &mut dyn Observer) -> Result<(), TrainError> {
        let Some(l) = &mut self.live else {
            return Ok(());
        };
        if !l.newcomer_waiting || !self.sync.identical() {
            return Ok(());
        }
        l.newcomer_waiting = false;
        let began = Instant::now();
        let step = self.step;
        let comm_err = |source| TrainError::Comm { step, source };
        let Some(m) = self.comm.admit().map_err(comm_err)? else {
            return Ok(());
        };
        let ck = self.state()?;
        let donors = m.members.len() - m.added.len();
        let bad = |reason: String| TrainError::Sync {
            step,
            reason: format!("live membership: admitting workers {:?}: {reason}", m.added),
        };
        let mut given = handover::for_newcomer(&ck, donors, m.members.len()).map_err(bad)?;
        let history = &self.live.as_ref().expect("live").changes;
        given.put_json(handover::HISTORY, history);
        // The state back into the synchronisation first: should a member be lost while
        // handing it over, the survivors go on from the state as it stands.
        let (_, notes) = self.rebuild_with(&m, ck, step, &bad)?;
        handover::hand_over(&mut self.comm, donors, Some(&given)).map_err(comm_err)?;
        let l = self.live.as_mut().expect("live");
        let change = MembershipChange {
            epoch: m.epoch,
            removed: Vec::new(),
            added: m.added.clone(),
            members: m.members.clone(),
            cause: format!("worker(s) {:?} joined", m.added),
            step,
            after_s: l.started.map_or(0.0, |t| (began - t).as_secs_f64()),
            steps_lost: 0,
            lost_s: began.elapsed().as_secs_f64(),
            deadline_s: None,
        };
        obs.on_message(&format!(
            "membership epoch {}: worker(s) {:?} joined before step {step}; {} worker(s) {:?} \
             ({:.2} s to admit them and hand over the state)",
            change.epoch,
            change.added,
            change.members.len(),
            change.members,
            change.lost_s
        ));
        for n in notes {
            obs.on_message(&n);
        }
        l.changes.push(change);
        Ok(())
    }

    /// A newcomer admitted into `membership` (by [`Trainer::join`], its synchronisation
    /// built over the group): receives the members' state and takes it.
    pub(super) fn enter(&mut self, membership: &Membership) -> Result<(), TrainError> {
        let donors = membership.members.len() - membership.added.len();
        let comm_err = |source| TrainError::Comm { step: 0, source };
        let began = Instant::now();
        let (mut ck, from_leader) = handover::hand_over(&mut self.comm, donors, None)
            .map_err(comm_err)?
            .expect("a newcomer receives the state");
        let bad = |reason: String| TrainError::Sync {
            step: 0,
            reason: format!("live membership: entering the group: {reason}"),
        };
        let history: Vec<MembershipChange> = match ck.remove(handover::HISTORY) {
            Some(b) => serde_json::from_slice(&b)
                .map_err(|e| bad(format!("the group's membership history: {e}")))?,
            None => Vec::new(),
        };
        let meta = self.restore_state(&ck, &bad, false)?;
        self.step = meta.step;
        self.start_step = meta.step;
        self.skipped = meta.skipped;
        self.recoveries = meta.recoveries;
        self.best_loss = meta.best_loss_bits.map(f64::from_bits);
        self.replicas_checked_at = meta.replicas_checked_at;
        self.sync
            .start_at(meta.step)
            .map_err(|e| self.step_error(e))?;
        // What this worker now holds is what it received, section by section: its state
        // as it would hand it over equals the state handed to it.
        let own = handover::for_newcomer(&self.state()?, donors, self.world).map_err(bad)?;
        if let Some(name) = handover::first_difference(&own, &ck) {
            // A metadata section is short: show both.
            let shown = |c: &Checkpoint| match c.bytes(&name) {
                Ok(b) if name == "meta" => String::from_utf8_lossy(b).into_owned(),
                Ok(b) => format!("{} bytes", b.len()),
                Err(_) => "missing".into(),
            };
            return Err(bad(format!(
                "section {name:?} of the restored state differs from what the members sent \
                 (restored: {}; sent: {})",
                shown(&own),
                shown(&ck)
            )));
        }
        if let Some(l) = &mut self.live {
            l.changes = history;
            l.changes.push(MembershipChange {
                epoch: membership.epoch,
                removed: Vec::new(),
                added: membership.added.clone(),
                members: membership.members.clone(),
                cause: format!("worker(s) {:?} joined", membership.added),
                step: meta.step,
                // From the newcomer's own start: what asking and waiting took.
                after_s: l.started.map_or(0.0, |t| (began - t).as_secs_f64()),
                steps_lost: 0,
                lost_s: began.elapsed().as_secs_f64(),
                deadline_s: None,
            });
        }
        self.notes.push(format!(
            "joined the group as worker {} (membership epoch {}, members {:?}) before step {}; \
             the state came from {donors} member(s){}",
            self.comm.members()[self.rank],
            membership.epoch,
            membership.members,
            meta.step,
            if from_leader.is_empty() {
                String::new()
            } else {
                format!(", the leader's alone for {}", from_leader.join(", "))
            }
        ));
        Ok(())
    }

    /// This rank leads the group now: its logs drop the records of the steps the group
    /// runs again (from `from` on); it opens them (and TensorBoard's) if the lost leader
    /// held them.
    fn reopen_logs(
        &mut self,
        from: u64,
        was_rank0: bool,
        redo_post: bool,
    ) -> Result<(), TrainError> {
        let Some(out) = self.out.clone() else {
            return Ok(());
        };
        // Closed before the files are rewritten (trimming replaces them).
        self.metrics_file = None;
        self.eval_file = None;
        super::metrics::trim_records(&out, from, !redo_post)?;
        if was_rank0 {
            let open = |name: &str| super::metrics::open_log(&out, name);
            self.metrics_file = Some(open("metrics.jsonl")?);
            self.eval_file = Some(open("eval.jsonl")?);
        } else {
            self.open_logs()?;
        }
        // The lost leader may have been killed after it finished a step the group does not
        // run again (this rank went on past it) and before it wrote the step's record, or
        // this rank lagged a step the others finished: a survivor's record of it is
        // written instead (the loss and accuracy are the group's; the times and bytes that
        // survivor's).
        let last = super::metrics::last_step(&out.root.join("metrics.jsonl"));
        let missing: Vec<_> = self
            .live
            .as_ref()
            .map(|l| {
                l.finished
                    .iter()
                    .filter(|r| r.step < from && last.is_none_or(|s| r.step > s))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        for r in &missing {
            Self::log_line(&mut self.metrics_file, Some(&out), "metrics.jsonl", r)?;
            self.log_tensorboard(|tb| tb.step(r))?;
        }
        // The same for an evaluation (every rank has the group's result).
        let last = super::metrics::last_step(&out.root.join("eval.jsonl"));
        let missing: Vec<_> = self
            .evals
            .iter()
            .filter(|e| last.is_none_or(|s| e.step > s))
            .cloned()
            .collect();
        for e in &missing {
            Self::log_line(&mut self.eval_file, Some(&out), "eval.jsonl", e)?;
            self.log_tensorboard(|tb| tb.eval(e))?;
        }
        Ok(())
    }
}
