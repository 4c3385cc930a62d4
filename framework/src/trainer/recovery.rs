//! What the survivors of a lost worker go on from (live membership, see
//! [`super::membership`]): one decision for every synchronisation, step by step.
//!
//! ```text
//! before each step s, each rank asks the synchronisation what kind of step s is:
//!   an every-step exchange (GradientSync::every_step_exchange): the replicas are identical
//!     before and after it, its update follows its last exchange      ─► no copy kept
//!   a local step a rank can run alone (GradientSync::runs_alone)     ─► no copy kept
//!   a round's end whose exchange can run again (reruns_round: 0/1 Adam's synchronisations)
//!                                                                    ─► no copy kept
//!   any other (a round's end of local SGD / DiLoCo, a fragment's exchange) ─► state kept
//! after a regroup: all-gather each survivor's standing — the step it was in and that
//!   step's kind, the steps it finished, whether a collective cut it part-way, its newest
//!   kept state, its shared state's manifest ([`Standing`]); every survivor decides alike:
//!   nobody lags and nobody was cut                ─► each goes on from its own state
//!   the step that decides (the one the laggards or the cut were in) is an every-step
//!   exchange, or a round that can run again and one finished it
//!                                                 ─► roll forward: those that lag (or whose
//!       compressor state a cut exchange left half updated) take the shared state
//!   it is a round that can run again, nobody finished it
//!                                                 ─► its exchange runs again over the group
//!   every laggard can run its step alone, none cut ─► the laggards run it alone
//!   otherwise                                     ─► back to the oldest newest kept state
//! ```
//!
//! **Rolling forward.** A survivor can be one step ahead of another: it finished step `s`
//! (every message it needed had arrived before the peer died) while another fails in the
//! last collective of `s`. No survivor is more than one step ahead (the control all-reduce
//! of each step needs every member). The one behind did send all of its part of `s` (the
//! one ahead could not have finished otherwise), so its error-feedback memory already holds
//! what the step's update did not take: it takes the parameters, the optimizer's and the
//! compressor's state of step `s + 1` from those that finished, and keeps its memories. When
//! nobody finished `s`, nobody applied its update (the update comes after the step's last
//! exchange collective), and the group runs `s` again; a compressor state that the cut
//! exchange left half updated on some survivors (PowerSGD's Q of one bucket, say) is made
//! the first survivor's on all. **What that costs:** a survivor whose exchange of `s` was
//! cut had folded the step's gradient, less what it had sent, into its memory; running `s`
//! again folds it in once more — one step of one worker's gradient counted twice, of the
//! order of what the lost worker's memory takes with it. The compressed all-reduce's server
//! residuals start afresh (each covers a range of the old group).
//!
//! **The periodic synchronisations** (local SGD, post-local SGD, DiLoCo, Streaming DiLoCo,
//! 0/1 Adam) cannot take a survivor's state from another between rounds: each replica
//! trains on its own. Their every-step phases (before `switch_step`; 0/1 Adam's variance
//! phase) roll forward as above. A local step that ends no round has no collective but the
//! control all-reduce, so a survivor that lags it (the others got past that all-reduce)
//! runs it **alone** (`train_step(…, solo)`: without the control all-reduce) and the group
//! goes on together. A synchronisation of 0/1 Adam's frozen phase changes nothing but the
//! exchanging ranks' own residuals until its exchange completes, and leaves the replicas
//! identical: cut with nobody through it, each survivor goes on from where its update left
//! it and the exchange runs again over the group (`Decision::Rerun`; a survivor that had
//! not got past the step's control all-reduce runs the step alone up to the exchange and
//! joins it; a compressor state shared between ranks that the cut left half updated, such
//! as PowerSGD's Q, is made the first survivor's on all); cut with one through it, the
//! others take its state. Before any other step (a round's end of local SGD or DiLoCo,
//! whose inner optimizers stay each replica's own, or a Streaming DiLoCo fragment's
//! exchange, whose merges change the fragments before it) each keeps its state (the
//! checkpoint's contents, in memory, into the buffers of the copy it replaces:
//! `Checkpoint::recycle`; the two newest, because a survivor can be a step ahead); when a
//! failure cut a survivor part-way through such a step (its exchange may have changed
//! memories, its update may be applied), the survivors go back to the oldest of their
//! newest kept states and run from there: the update is applied everywhere or nowhere. The
//! copy is what a step record's `time.keep_s` shows.
//!
//! **Deciding alike.** What kind a step is depends on the synchronisation's state (0/1
//! Adam's local-step interval doubles as the run goes on), and a survivor a step ahead
//! holds the state of the next step: so each survivor says the kind of the step it was in,
//! as it saw it when the step began, and the group reads the kind of the step that decides
//! from a survivor that was in it.

use dtrain_comms::{Membership, Transport};
use dtrain_records::StepRecord;
use serde::{Deserialize, Serialize};

use super::handover::{self, Entry};
use super::membership::Progress;
use super::step::StepOutcome;
use super::{TrainError, Trainer};

/// What kind of step a step is, as the synchronisation says before it runs (see the
/// [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct StepKind {
    /// The step.
    pub(super) step: u64,
    /// An every-step exchange ([`crate::sync::GradientSync::every_step_exchange`]).
    pub(super) rolls: bool,
    /// A local step a rank can run alone ([`crate::sync::GradientSync::runs_alone`]).
    pub(super) alone: bool,
    /// A round's end whose exchange can run again
    /// ([`crate::sync::GradientSync::reruns_round`]).
    pub(super) reruns: bool,
}

impl StepKind {
    /// Whether a copy of the state is kept before this step.
    pub(super) fn keeps_copy(&self) -> bool {
        !self.rolls && !self.alone && !self.reruns
    }
}

/// What a survivor says of itself after a regroup.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Standing {
    /// The step it was in (or was about to begin), and its kind.
    pub(super) kind: StepKind,
    /// The steps it finished.
    pub(super) done: u64,
    /// A collective of step `done` cut it part-way (past its control all-reduce): its
    /// exchange may have changed memories and compressor state, its update may be applied.
    pub(super) cut: bool,
    /// Its newest kept state's step.
    pub(super) kept: Option<u64>,
    /// Whether the evaluation and checkpoint due after `done` steps are done.
    pub(super) post_done: bool,
    /// Its shared state's manifest ([`handover::shared_view`]).
    pub(super) manifest: Vec<Entry>,
    /// Its records of the last steps that `metrics.jsonl` gets.
    pub(super) records: Vec<StepRecord>,
}

/// What the survivors do, decided alike by each from every [`Standing`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Decision {
    /// Go on from step `top`: each from its own state, a survivor a step behind after
    /// running that (local) step alone.
    Own {
        /// The most steps any survivor finished.
        top: u64,
    },
    /// Roll forward to step `top`: those that lag, or whose shared state differs, take it.
    Forward {
        /// The most steps any survivor finished.
        top: u64,
    },
    /// Finish step `step` together: its round exchange runs again over the survivors, each
    /// from where its update left it (one that had not got past the step's control
    /// all-reduce runs the step alone up to that exchange).
    Rerun {
        /// The step whose round exchange was cut.
        step: u64,
    },
    /// Go back to the state every survivor kept before step `from`.
    Back {
        /// The oldest of the survivors' newest kept states.
        from: u64,
    },
}

/// How far a survivor in step `reached` of kind `kind` got, from its last [`Progress`]:
/// the steps it finished, and whether a collective cut it part-way. An update applied in
/// an every-step exchange finishes the step (nothing is exchanged after it); in any other
/// step the round's exchange may follow.
pub(super) fn standing_of(
    reached: u64,
    kind: StepKind,
    progress: Option<(u64, Progress)>,
) -> (u64, bool) {
    match progress {
        Some((s, Progress::Exchanged)) if s == reached => (s + 1, false),
        Some((s, Progress::Applied)) if s == reached && kind.rolls => (s + 1, false),
        Some((s, _)) if s == reached => (s, true),
        _ => (reached, false),
    }
}

/// The decision (see the [module docs](self)); an error when the survivors cannot go on
/// (one must go back and kept no state, or none was in the step that decides).
pub(super) fn decide(all: &[Standing]) -> Result<Decision, String> {
    let top = all.iter().map(|s| s.done).max().unwrap_or(0);
    let lags = all.iter().any(|s| s.done < top);
    let cut = all.iter().any(|s| s.cut);
    if !lags && !cut {
        return Ok(Decision::Own { top });
    }
    // The step that decides: the one the laggards were in, else the one the cut were in.
    let at = if lags { top - 1 } else { top };
    let kind = all
        .iter()
        .map(|s| s.kind)
        .find(|k| k.step == at)
        .ok_or_else(|| format!("no survivor says what kind of step step {at} was"))?;
    if kind.rolls || (kind.reruns && lags) {
        // After a round that can run again the replicas share their state: one that lags
        // it takes the state of those that finished it.
        return Ok(Decision::Forward { top });
    }
    if kind.reruns {
        return Ok(Decision::Rerun { step: top });
    }
    let catches_up = |s: &Standing| s.done == top || (s.kind.step == s.done && s.kind.alone);
    if !cut && all.iter().all(catches_up) {
        return Ok(Decision::Own { top });
    }
    match all.iter().map(|s| s.kept).min().flatten() {
        Some(from) => Ok(Decision::Back { from }),
        None => Err(format!(
            "a survivor was cut part-way through step {at}, which ends a round or exchanges, \
             and one kept no state to go back to"
        )),
    }
}

impl<T: Transport> Trainer<T> {
    /// The kind of step `self.step`, from the synchronisation's state now.
    pub(super) fn step_kind(&self) -> StepKind {
        StepKind {
            step: self.step,
            rolls: self.sync.every_step_exchange(self.step),
            alone: self.sync.runs_alone(self.step),
            reruns: self.sync.reruns_round(self.step),
        }
    }

    /// After a regroup into `membership`: the survivors all-gather their [`Standing`]s and
    /// go on as [`decide`] says. `post_pending`: the failure came while the evaluation and
    /// checkpoint due after the step just finished were being made. Returns the step the
    /// group goes on from, whether the evaluation and checkpoint due there are to be made,
    /// and the set-up's notes.
    pub(super) fn recover(
        &mut self,
        membership: &Membership,
        post_pending: bool,
    ) -> Result<(u64, bool, Vec<String>), TrainError> {
        let reached = self.step;
        let comm_err = |source| TrainError::Comm {
            step: reached,
            source,
        };
        // The kind the step had when it began: its state may have moved on since.
        let now = self.step_kind();
        let l = self.live.as_mut().expect("live");
        let kind = l.kind.filter(|k| k.step == reached).unwrap_or(now);
        let progress = l.progress.take();
        let (done, cut) = standing_of(reached, kind, progress);
        // The record of a step whose round exchange can run again, as its update left it.
        let applied = l
            .applied
            .take()
            .filter(|(s, _)| matches!(progress, Some((p, Progress::Applied)) if p == *s));
        let records: Vec<_> = l.finished.iter().cloned().collect();
        let kept = l.kept.back().map(|(s, _)| *s);
        self.step = done;
        let own = self.state()?;
        let shared = handover::shared_view(&own).map_err(|reason| TrainError::Sync {
            step: reached,
            reason: format!("live membership: this survivor's state: {reason}"),
        })?;
        let mine = Standing {
            kind,
            done,
            cut,
            kept,
            post_done: !(post_pending || done > reached),
            manifest: handover::manifest_of(&shared),
            records,
        };
        let all: Vec<Standing> =
            handover::gather_standings(&mut self.comm, &mine).map_err(comm_err)?;
        let decision = decide(&all).map_err(|reason| TrainError::Sync {
            step: reached,
            reason: format!("live membership: {reason}"),
        })?;
        match decision {
            Decision::Back { from } => {
                self.step = reached;
                let mut notes = self.go_back(membership, from)?;
                notes.push(format!(
                    "live membership: a survivor was cut part-way through a step that ends a \
                     round or exchanges: the group goes back to the state kept before step \
                     {from}"
                ));
                Ok((from, false, notes))
            }
            Decision::Own { top } => self.go_on_own(membership, &all, top, own),
            Decision::Rerun { step } => self.rerun_round(membership, &all, step, own, applied),
            Decision::Forward { top } => self.roll_forward(membership, all, top, shared, own),
        }
    }

    /// Every survivor goes on from its own state; one a step behind, a local step, runs it
    /// alone first.
    fn go_on_own(
        &mut self,
        membership: &Membership,
        all: &[Standing],
        top: u64,
        own: crate::checkpoint::Checkpoint,
    ) -> Result<(u64, bool, Vec<String>), TrainError> {
        let done = self.step;
        let bad = |reason: String| TrainError::Sync {
            step: done,
            reason: format!("live membership: going on from step {done}: {reason}"),
        };
        let (_, mut notes) = self.rebuild_with(membership, own, done, &bad)?;
        if done < top {
            // The step the others finished: a local one, run alone.
            let per_epoch = self.plan.steps_per_epoch;
            let (epoch, j) = (done / per_epoch, (done % per_epoch) as usize);
            match self.train_step(epoch, j, true)? {
                StepOutcome::Done(_) => self.step += 1,
                StepOutcome::RolledBack => {
                    return Err(bad(
                        "the step run alone to catch up rolled the run back".into()
                    ))
                }
            }
        }
        let behind: Vec<usize> = (0..all.len()).filter(|&r| all[r].done < top).collect();
        if !behind.is_empty() {
            notes.push(format!(
                "live membership: group rank(s) {behind:?} ran step {} alone to catch up \
                 (a local step)",
                top - 1
            ));
        }
        let redo_post = all.iter().any(|s| s.done < top || !s.post_done);
        let records = all.iter().flat_map(|s| s.records.iter().cloned());
        self.settle_records(top, redo_post, handover::by_step(records));
        Ok((top, redo_post, notes))
    }

    /// The survivors finish step `step` together (see [`Decision::Rerun`]): each goes on
    /// from its own state, its exchanger's state shared between ranks made one survivor's
    /// on all ([`handover::agree_exchangers`]); one whose update was applied (its record
    /// then was `applied`) runs the step's round exchange again, one that had not got past
    /// the control all-reduce runs the step alone up to it and joins the exchange.
    fn rerun_round(
        &mut self,
        membership: &Membership,
        all: &[Standing],
        step: u64,
        own: crate::checkpoint::Checkpoint,
        applied: Option<(u64, Box<StepRecord>)>,
    ) -> Result<(u64, bool, Vec<String>), TrainError> {
        let bad = |reason: String| TrainError::Sync {
            step,
            reason: format!("live membership: finishing step {step} again: {reason}"),
        };
        let mine = &all[self.comm.rank()];
        if mine.cut && applied.is_none() {
            return Err(bad(
                "this survivor was cut between the step's control all-reduce and its update".into(),
            ));
        }
        let own = handover::agree_exchangers(&mut self.comm, own)
            .map_err(|source| TrainError::Comm { step, source })?;
        let (_, mut notes) = self.rebuild_with(membership, own, step, &bad)?;
        let outcome = match applied {
            Some((_, record)) => self.end_step(step, record, std::time::Instant::now())?,
            None => {
                notes.push(format!(
                    "live membership: this survivor had not got past the control all-reduce \
                     of step {step}: it ran the step alone up to its round exchange"
                ));
                let per_epoch = self.plan.steps_per_epoch;
                let (epoch, j) = (step / per_epoch, (step % per_epoch) as usize);
                self.train_step(epoch, j, true)?
            }
        };
        let StepOutcome::Done(record) = outcome else {
            return Err(bad("the step rolled the run back".into()));
        };
        self.step = step + 1;
        let records = all.iter().flat_map(|s| s.records.iter().cloned());
        self.settle_records(step + 1, true, handover::by_step(records));
        // Its record goes to the logs (the leader writes those its log lacks).
        if step.is_multiple_of(self.plan.config.output.log_every.max(1)) {
            self.keep_record(&record);
        }
        notes.push(format!(
            "live membership: the survivors ran the round exchange of step {step} again \
             (a synchronisation that a lost worker cut; nothing was copied before it)"
        ));
        Ok((step + 1, true, notes))
    }

    /// The survivors roll forward to step `top` (see the [module docs](self)): those that
    /// lag, or whose shared state differs from the first that finished it, take it from
    /// those that match ([`handover::take_shared`]).
    fn roll_forward(
        &mut self,
        membership: &Membership,
        all: Vec<Standing>,
        top: u64,
        shared: crate::checkpoint::Checkpoint,
        own: crate::checkpoint::Checkpoint,
    ) -> Result<(u64, bool, Vec<String>), TrainError> {
        let reached = self.step;
        let done: Vec<u64> = all.iter().map(|s| s.done).collect();
        let redo_post = all.iter().any(|s| s.done < top || !s.post_done);
        let (manifests, records): (Vec<_>, Vec<_>) =
            all.into_iter().map(|s| (s.manifest, s.records)).unzip();
        let (state, receivers) =
            handover::take_shared(&mut self.comm, top, &done, &manifests, &shared, &own).map_err(
                |source| TrainError::Comm {
                    step: reached,
                    source,
                },
            )?;
        let bad = |reason: String| TrainError::Sync {
            step: top,
            reason: format!("live membership: going on from step {top}: {reason}"),
        };
        let lagged = state.is_some();
        let ck = state.unwrap_or(own);
        let (meta, mut notes) = self.rebuild_with(membership, ck, top, &bad)?;
        if meta.step != top {
            return Err(bad(format!("the state taken is of step {}", meta.step)));
        }
        if lagged {
            self.skipped = meta.skipped;
            self.recoveries = meta.recoveries;
            self.best_loss = meta.best_loss_bits.map(f64::from_bits);
        }
        self.settle_records(
            top,
            redo_post,
            handover::by_step(records.into_iter().flatten()),
        );
        if !receivers.is_empty() {
            notes.push(format!(
                "live membership: group rank(s) {receivers:?} took the state of step {top} \
                 from the others (they had not finished it, or their compressor state was cut \
                 mid-step)"
            ));
        }
        Ok((top, redo_post, notes))
    }

    /// The survivors go back to step `from`, the oldest of their newest kept states:
    /// returns the set-up's notes.
    fn go_back(&mut self, membership: &Membership, from: u64) -> Result<Vec<String>, TrainError> {
        let reached = self.step;
        let l = self.live.as_mut().expect("live");
        l.kept.retain(|(s, _)| *s <= from);
        l.finished.retain(|r| r.step < from);
        // An evaluation after `from` is of a state the group reaches again.
        self.evals.retain(|e| e.step <= from);
        // Taken, not copied: the run loop keeps the state of `from` again before it runs it.
        let Some((_, ck)) = l.kept.pop_back().filter(|(s, _)| *s == from) else {
            return Err(TrainError::Sync {
                step: reached,
                reason: format!(
                    "live membership: the group goes on from step {from}, and this rank \
                     kept no state of it (it kept {:?})",
                    l.kept.iter().map(|(s, _)| *s).collect::<Vec<_>>()
                ),
            });
        };
        // The synchronisation over the new group, then the state of step `from` into it.
        let bad = |reason: String| TrainError::Sync {
            step: from,
            reason: format!("live membership: restoring the state of step {from}: {reason}"),
        };
        let (_, notes) = self.rebuild_with(membership, ck, from, &bad)?;
        Ok(notes)
    }

    /// After survivors went on to step `from`: this rank's records of the last steps
    /// become the newest of `records` (every survivor's, one a step in step order,
    /// [`handover::by_step`]: the leader writes those its log lacks), and an evaluation at
    /// `from` that is made again (`redo_post`) goes from the ones it holds.
    fn settle_records(&mut self, from: u64, redo_post: bool, records: Vec<StepRecord>) {
        let l = self.live.as_mut().expect("live");
        l.finished = records.into_iter().filter(|r| r.step < from).collect();
        while l.finished.len() > 2 {
            l.finished.pop_front();
        }
        if redo_post {
            self.evals.retain(|e| e.step < from);
        } else {
            self.evals.retain(|e| e.step <= from);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(step: u64, rolls: bool, alone: bool) -> StepKind {
        StepKind {
            step,
            rolls,
            alone,
            reruns: false,
        }
    }

    /// A survivor in step `reached` of kind `k`, with its progress.
    fn survivor(reached: u64, k: StepKind, p: Option<Progress>, kept: Option<u64>) -> Standing {
        let (done, cut) = standing_of(reached, k, p.map(|p| (reached, p)));
        Standing {
            kind: k,
            done,
            cut,
            kept,
            post_done: true,
            manifest: Vec::new(),
            records: Vec::new(),
        }
    }

    #[test]
    fn an_update_applied_finishes_only_an_every_step_exchange() {
        let every = kind(7, true, false);
        let round = kind(7, false, false);
        assert_eq!(
            standing_of(7, every, Some((7, Progress::Applied))),
            (8, false)
        );
        assert_eq!(
            standing_of(7, round, Some((7, Progress::Applied))),
            (7, true)
        );
        assert_eq!(
            standing_of(7, round, Some((7, Progress::Exchanged))),
            (8, false)
        );
        assert_eq!(
            standing_of(7, every, Some((7, Progress::Controlled))),
            (7, true)
        );
        // Progress of an earlier step: this step had not begun its exchange.
        assert_eq!(
            standing_of(7, every, Some((6, Progress::Exchanged))),
            (7, false)
        );
        assert_eq!(standing_of(7, every, None), (7, false));
    }

    /// A failure in an every-step exchange rolls forward, whether one finished it or
    /// nobody did, with no copy kept anywhere.
    #[test]
    fn every_step_exchanges_roll_forward_without_copies() {
        let k = kind(4, true, false);
        let next = kind(5, false, false);
        let ahead = survivor(5, next, None, Some(5));
        let behind = survivor(4, k, Some(Progress::Controlled), None);
        assert_eq!(
            decide(&[ahead.clone(), behind.clone()]),
            Ok(Decision::Forward { top: 5 })
        );
        let cut = survivor(4, k, Some(Progress::Controlled), None);
        let not_past = survivor(4, k, None, None);
        assert_eq!(decide(&[cut, not_past]), Ok(Decision::Forward { top: 4 }));
        // The last step of the every-step phase decides for a survivor already in the next.
        assert_eq!(decide(&[behind, ahead]), Ok(Decision::Forward { top: 5 }));
    }

    /// A local step: a laggard runs it alone, with no copy; a round's end cut part-way
    /// goes back to the state kept before it.
    #[test]
    fn local_steps_catch_up_alone_and_cut_rounds_go_back() {
        let local = kind(9, false, true);
        let ahead = survivor(10, kind(10, false, false), None, Some(10));
        let behind = survivor(9, local, None, Some(7));
        assert_eq!(decide(&[ahead, behind]), Ok(Decision::Own { top: 10 }));
        let round = kind(10, false, false);
        let finished = survivor(10, round, Some(Progress::Exchanged), Some(10));
        let cut = survivor(10, round, Some(Progress::Applied), Some(10));
        assert_eq!(
            decide(&[finished.clone(), cut.clone()]),
            Ok(Decision::Back { from: 10 })
        );
        let mut none_kept = cut;
        none_kept.kept = None;
        assert!(decide(&[finished, none_kept]).is_err());
        // Nobody lags, nobody was cut: each goes on from its own state.
        let a = survivor(3, kind(3, false, false), None, Some(3));
        assert_eq!(decide(&[a.clone(), a]), Ok(Decision::Own { top: 3 }));
    }

    /// 0/1 Adam's local-step interval doubles: a survivor a step ahead holds the next
    /// interval, so the laggard's own word on its step decides. Here the laggard's step
    /// ended an interval (a synchronisation), not a local step, though the one ahead
    /// would now call it local.
    #[test]
    fn the_laggards_own_kind_of_its_step_decides() {
        let sync_step = kind(15, false, false);
        let ahead = survivor(16, kind(16, false, true), None, Some(15));
        let behind = survivor(15, sync_step, None, Some(15));
        assert_eq!(decide(&[ahead, behind]), Ok(Decision::Back { from: 15 }));
    }

    /// A synchronisation whose exchange can run again: cut with nobody through it, the
    /// survivors finish it together from where they stand; cut with one through it, the
    /// others take the state it holds. No copy is kept before it.
    #[test]
    fn a_cut_round_that_can_run_again_is_finished_together() {
        let sync = StepKind {
            reruns: true,
            ..kind(6, false, false)
        };
        assert!(!sync.keeps_copy());
        let cut = survivor(6, sync, Some(Progress::Applied), None);
        let not_past = survivor(6, sync, None, None);
        assert_eq!(
            decide(&[cut.clone(), not_past]),
            Ok(Decision::Rerun { step: 6 })
        );
        let through = survivor(6, sync, Some(Progress::Exchanged), None);
        assert_eq!(decide(&[through, cut]), Ok(Decision::Forward { top: 7 }));
    }
}
