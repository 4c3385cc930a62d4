//! Checkpoints: what a rank writes, and exact (or elastic) resume from them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dtrain_comms::Transport;
use serde::{Deserialize, Serialize};

use super::{RunDir, TrainError, Trainer};
use crate::checkpoint::{self, Checkpoint, CheckpointError};
use crate::optim::GroupState;
use crate::sync::{PeriodicState, SyncError, PERIODIC_SECTION};

/// What every rank's checkpoint file says about itself (section `meta`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(super) struct Meta {
    pub(super) step: u64,
    pub(super) world: usize,
    pub(super) rank: usize,
    pub(super) seed: u64,
    pub(super) params: usize,
    pub(super) buffers: usize,
    pub(super) method: String,
    pub(super) optimizer_steps: BTreeMap<u64, u64>,
    /// Buckets whose error-feedback memory is stored as `mem/<id>`.
    pub(super) memory_keys: Vec<u64>,
    pub(super) skipped: u64,
    pub(super) recoveries: u64,
    /// Stored as IEEE bits so that JSON cannot round it.
    pub(super) best_loss_bits: Option<u64>,
    /// Steps per epoch of the run that wrote it (maps the step to an epoch on an elastic
    /// resume).
    #[serde(default)]
    pub(super) steps_per_epoch: u64,
    /// The step count of the last comparison of the replicas' hashes (when the next is
    /// due): every worker of a group must agree on it, a newcomer and the survivors that
    /// run a step again included.
    #[serde(default)]
    pub(super) replicas_checked_at: u64,
}

impl<T: Transport> Trainer<T> {
    /// Restores the state of checkpoint directory `dir` (this rank's file in it).
    ///
    /// A checkpoint written by another worker count resumes by the rule of
    /// [`super::elastic`]: replicated state from rank 0's file, per-rank state (error-feedback
    /// memories, BatchNorm statistics) as the mean over every rank's file, and the data
    /// position in samples. Refused, with the reason: parameter-server state, compressor
    /// state that differs between ranks, and language-model data mid-epoch.
    pub fn resume_from(&mut self, dir: &Path) -> Result<(), TrainError> {
        let bad_at = |path: &Path, reason: String| TrainError::Resume {
            path: path.display().to_string(),
            reason,
        };
        // Normally this rank's own file is the only one read; every rank's file is read
        // when the worker count changed (this rank's is missing, or names another world).
        let own = dir.join(format!("rank-{}.ckpt", self.rank));
        let mut loaded = if own.exists() {
            let ck = Checkpoint::load(&own)?;
            let world = ck.json::<Meta>("meta")?.world;
            (world == self.world).then_some((own, ck))
        } else {
            None
        };
        let elastic = loaded.is_none();
        if elastic {
            let rank0 = dir.join("rank-0.ckpt");
            if !rank0.exists() {
                return Err(bad_at(&rank0, "missing (incomplete checkpoint?)".into()));
            }
            let ck0 = Checkpoint::load(&rank0)?;
            let meta0: Meta = ck0.json("meta")?;
            let mid_epoch =
                meta0.steps_per_epoch == 0 || !meta0.step.is_multiple_of(meta0.steps_per_epoch);
            let why = if ck0.names().any(|n| n.starts_with("ps/") && n != "ps/state") {
                Some(
                    "its parameter-server state is per rank and per shard, and no rule \
                      redistributes it"
                        .to_string(),
                )
            } else if let Some(st) = ck0
                .json::<PeriodicState>(PERIODIC_SECTION)
                .ok()
                .filter(|st| !st.identical)
            {
                Some(format!(
                    "it was written between two synchronisations of sync.kind = {:?}: each \
                     rank's parameters are its own there, and no rule redistributes them \
                     (resume at the same worker count, or from a checkpoint at a \
                     synchronisation)",
                    st.kind
                ))
            } else if meta0.steps_per_epoch == 0 {
                Some("it does not record its steps per epoch (written by an older trainer)".into())
            } else if mid_epoch && self.plan.config.data.kind.is_text() {
                Some(format!(
                    "it was written at step {} inside an epoch, and language-model data is cut \
                     into BPTT rows per rank (resume at the same worker count, or from an \
                     epoch-boundary checkpoint)",
                    meta0.step
                ))
            } else {
                None
            };
            let refuse = |why: String| {
                bad_at(
                    dir,
                    format!(
                        "written by {} workers, this run has {}: {why}",
                        meta0.world, self.world
                    ),
                )
            };
            if let Some(why) = why {
                return Err(refuse(why));
            }
            let ck = super::elastic::combine(
                dir,
                &meta0,
                &ck0,
                self.plan.method.name(),
                (self.rank, self.world),
            )
            .map_err(refuse)?;
            loaded = Some((rank0, ck));
        }
        let (path, ck) = loaded.expect("a checkpoint file was loaded");
        let bad = |reason: String| bad_at(&path, reason);
        let meta = self.restore_state(&ck, &bad, elastic)?;
        self.step = if elastic {
            let (step, shift) = super::elastic::position(
                &meta,
                // Samples per worker per optimizer step.
                self.plan.config.data.batch_size as u64 * self.plan.config.train.accumulate,
                self.world as u64,
                self.plan.steps_per_epoch,
            );
            if let Some((epoch, delta)) = shift {
                self.data.shift_epoch(epoch, delta);
            }
            step
        } else {
            meta.step
        };
        self.start_step = self.step;
        let step = self.step;
        self.sync.start_at(step).map_err(|e| self.step_error(e))?;
        self.skipped = meta.skipped;
        self.recoveries = meta.recoveries;
        self.best_loss = meta.best_loss_bits.map(f64::from_bits);
        self.replicas_checked_at = meta.replicas_checked_at.min(self.step);
        self.last_checkpoint = Some(dir.to_path_buf());
        self.resumed_step = Some(meta.step);
        self.agree_on_step(dir)
    }

    /// Restores the state `ck` holds (this rank's, or on an elastic resume the combined
    /// one): parameters, buffers, optimizer, the synchronisation's state, a recurrent
    /// model's carried state unless `elastic`. Returns its metadata; the step and the
    /// counters are the caller's to set. `bad` makes the error for a state that does not fit.
    pub(super) fn restore_state(
        &mut self,
        ck: &Checkpoint,
        bad: &dyn Fn(String) -> TrainError,
        elastic: bool,
    ) -> Result<Meta, TrainError> {
        let meta: Meta = ck.json("meta")?;
        if meta.params != self.num_params() || meta.buffers != self.buffers.len() {
            return Err(bad(format!(
                "the checkpoint's model has {} parameters / {} buffers, this one {} / {}",
                meta.params,
                meta.buffers,
                self.num_params(),
                self.buffers.len()
            )));
        }
        // A compressed optimizer keeps its moments and residuals in sections of its own.
        let ours = self.plan.config.train.optimizer;
        let theirs = crate::sync::written_by(ck);
        if theirs.as_deref() != ours.is_compressed().then(|| ours.name()) {
            return Err(bad(format!(
                "written with train.optimizer = {:?}, this run has {:?}",
                theirs.as_deref().unwrap_or("sgd, adam or adamw"),
                ours.name()
            )));
        }
        if meta.method != self.plan.method.name() {
            return Err(bad(format!(
                "written with compress.kind = {:?}, this run uses {:?}",
                meta.method,
                self.plan.method.name()
            )));
        }
        if meta.seed != self.plan.config.seed {
            return Err(bad(format!(
                "written with seed {}, this run has seed {} (data order would differ)",
                meta.seed, self.plan.config.seed
            )));
        }
        let params = ck.f32("params")?;
        let buffers = ck.f32("buffers")?;
        if params.len() != self.num_params() || buffers.len() != self.buffers.len() {
            return Err(bad(format!(
                "its parameter sections hold {} + {} values, this model has {} + {}",
                params.len(),
                buffers.len(),
                self.num_params(),
                self.buffers.len()
            )));
        }
        self.buffers = buffers;
        let mut opt = BTreeMap::new();
        for (&key, &steps) in &meta.optimizer_steps {
            opt.insert(
                key,
                GroupState {
                    step: steps,
                    m: ck.f32(&format!("opt/{key}/m"))?,
                    v: ck.f32(&format!("opt/{key}/v"))?,
                },
            );
        }
        self.optimizer.import(opt);
        if let Some(moments) = &mut self.device_moments {
            moments.reset();
        }
        self.sync
            .restore(ck, &meta.memory_keys, meta.step)
            .map_err(|e| match e {
                SyncError::State(reason) => bad(reason),
                e => self.step_error(e),
            })?;
        self.model.write_params(&params);
        if !self.buffers.is_empty() {
            self.model.write_buffers(&self.buffers);
        }
        self.model.reset_state();
        // A recurrent model's carried state (per rank, its own batch rows) continues where it
        // was; after an elastic resume the shards changed, so it starts afresh.
        if !elastic && ck.names().any(|n| n == "model_state") {
            let state = ck.f32("model_state")?;
            self.model
                .set_carried_state(&state)
                .map_err(|e| bad(e.to_string()))?;
        }
        Ok(meta)
    }

    /// Writes this rank's checkpoint for the current step; rank 0 then points
    /// `checkpoints/LATEST` at it (after a barrier, so LATEST only ever names complete
    /// checkpoints) and prunes old ones.
    pub fn save_checkpoint(&mut self) -> Result<Option<PathBuf>, TrainError> {
        self.drain()?;
        let Some(out) = self.out.clone() else {
            return Ok(None);
        };
        let dir = out.checkpoints().join(checkpoint_dir_name(self.step));
        std::fs::create_dir_all(&dir).map_err(|source| TrainError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        let mut ck = self.state()?;
        ck.put_bytes("config.toml", self.plan.config.to_toml().into_bytes());
        ck.save(&dir.join(format!("rank-{}.ckpt", self.rank)))?;
        let step = self.step;
        self.comm
            .barrier()
            .map_err(|source| TrainError::Comm { step, source })?;
        if self.rank == 0 {
            out.set_latest(&dir)?;
            self.prune(&out)?;
        }
        self.last_checkpoint = Some(dir.clone());
        Ok(Some(dir))
    }

    /// This rank's state at the current step, as its checkpoint file holds it (without
    /// the configuration): what [`Trainer::save_checkpoint`] writes, and what live
    /// membership keeps in memory to run a step again over a new group.
    pub(super) fn state(&mut self) -> Result<Checkpoint, TrainError> {
        self.state_in(Checkpoint::new())
    }

    /// [`Trainer::state`] written into `ck` (a [`Checkpoint::recycle`]d one: its buffers
    /// are overwritten in place).
    pub(super) fn state_in(&mut self, mut ck: Checkpoint) -> Result<Checkpoint, TrainError> {
        if let Some(moments) = &self.device_moments {
            // The moments of the steps run on the device, into the state written here.
            moments.settle(&mut self.optimizer);
        }
        let memory_keys = self.sync.save(&mut ck).map_err(|e| self.step_error(e))?;
        let meta = Meta {
            step: self.step,
            world: self.world,
            rank: self.rank,
            seed: self.plan.config.seed,
            params: self.num_params(),
            buffers: self.buffers.len(),
            method: self.plan.method.name().to_string(),
            optimizer_steps: self
                .optimizer
                .groups()
                .iter()
                .map(|(k, g)| (*k, g.step))
                .collect(),
            memory_keys,
            skipped: self.skipped,
            recoveries: self.recoveries,
            best_loss_bits: self.best_loss.map(f64::to_bits),
            steps_per_epoch: self.plan.steps_per_epoch,
            replicas_checked_at: self.replicas_checked_at,
        };
        ck.put_json("meta", &meta);
        // Read into live membership's scratch when it keeps one (no new zeroed vector).
        let mut params = self
            .live
            .as_mut()
            .map(|l| std::mem::take(&mut l.params))
            .unwrap_or_default();
        params.resize(self.num_params(), 0.0);
        self.model.read_params(&mut params);
        ck.put_f32("params", &params);
        if let Some(l) = &mut self.live {
            l.params = params;
        }
        let carried = self.model.carried_state();
        if !carried.is_empty() {
            ck.put_f32("model_state", &carried);
        }
        if !self.buffers.is_empty() {
            self.model.read_buffers(&mut self.buffers);
        }
        ck.put_f32("buffers", &self.buffers);
        for (k, g) in self.optimizer.groups() {
            ck.put_f32(&format!("opt/{k}/m"), &g.m);
            ck.put_f32(&format!("opt/{k}/v"), &g.v);
        }
        Ok(ck)
    }

    /// Checkpoint retention (`checkpoint.keep`), run by rank 0 once the checkpoint of the
    /// current step is complete on every rank: see [`retained`].
    fn prune(&self, out: &RunDir) -> Result<(), TrainError> {
        let dirs = out.checkpoint_dirs();
        for d in retained(&dirs, self.step, self.plan.config.checkpoint.keep).1 {
            let _ = std::fs::remove_dir_all(d);
        }
        Ok(())
    }

    /// Checks that every rank restored the same step (ranks that resumed from different
    /// checkpoints would train different models in lock-step): rank 0's step is broadcast,
    /// and every rank learns whether any differs.
    fn agree_on_step(&mut self, dir: &Path) -> Result<(), TrainError> {
        if self.world == 1 {
            return Ok(());
        }
        let step = self.step;
        let comm_err = |source| TrainError::Comm { step, source };
        let mut bytes = if self.rank == 0 {
            step.to_le_bytes().to_vec()
        } else {
            Vec::new()
        };
        self.comm.broadcast(&mut bytes, 0).map_err(comm_err)?;
        let first = <[u8; 8]>::try_from(bytes.as_slice())
            .map(u64::from_le_bytes)
            .unwrap_or(u64::MAX);
        let mut differ = [(first != step) as u8 as f32];
        self.comm.all_reduce_sum(&mut differ).map_err(comm_err)?;
        if differ[0] > 0.0 {
            return Err(TrainError::Resume {
                path: dir.display().to_string(),
                reason: format!(
                    "the ranks restored different steps (rank 0: {first}, rank {}: {step}; {} \
                     rank(s) differ from rank 0): they must resume from the same checkpoint",
                    self.rank, differ[0]
                ),
            });
        }
        Ok(())
    }
}

/// The name of the directory of the checkpoint at `step` (`step-0000000450`).
pub fn checkpoint_dir_name(step: u64) -> String {
    format!("step-{step:010}")
}

/// The step of a checkpoint directory named by [`checkpoint_dir_name`]; `None` for any other
/// name (`LATEST`, a temporary file, a directory set aside by hand).
pub fn checkpoint_step(dir: &Path) -> Option<u64> {
    let name = dir.file_name()?.to_str()?;
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The retention rule of `checkpoint.keep`, applied after the checkpoint of step `current`
/// was written by every rank: of `dirs` (`(step, dir)`), returns those kept and those
/// deleted.
///
/// * Kept: the `keep` newest checkpoints at or before `current` (`keep` of 0 counts as 1).
///   `current`'s own checkpoint is the newest of them and complete on every rank, so the
///   last intact checkpoint is never deleted, whatever happened to the others.
/// * Deleted: the older ones, and every checkpoint *after* `current`: those belong to a
///   trajectory the run abandoned (a rollback of the recover policy, or a resume that fell
///   back past a damaged checkpoint), and a later resume must not pick them.
pub fn retained(
    dirs: &[(u64, PathBuf)],
    current: u64,
    keep: usize,
) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut older: Vec<&(u64, PathBuf)> = dirs.iter().filter(|(s, _)| *s <= current).collect();
    older.sort_by_key(|d| std::cmp::Reverse(d.0));
    let keep = keep.max(1);
    let kept: Vec<PathBuf> = older.iter().take(keep).map(|(_, d)| d.clone()).collect();
    let mut deleted: Vec<PathBuf> = older.iter().skip(keep).map(|(_, d)| d.clone()).collect();
    deleted.extend(
        dirs.iter()
            .filter(|(s, _)| *s > current)
            .map(|(_, d)| d.clone()),
    );
    (kept, deleted)
}

/// A checkpoint whose every rank's file was read and verified ([`verify_checkpoint`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntactCheckpoint {
    /// Its directory (`checkpoints/step-…`).
    pub dir: PathBuf,
    /// The step it was written at.
    pub step: u64,
    /// The worker count that wrote it (one file per rank).
    pub world: usize,
}

/// A checkpoint passed over by [`RunDir::newest_intact`], and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedCheckpoint {
    /// Its directory.
    pub dir: PathBuf,
    /// What is wrong with it (names the rank's file).
    pub reason: String,
}

/// Reads every rank's file of the checkpoint in `dir` and checks it: present, its checksum,
/// and its metadata (the step of the directory's name, the worker count of rank 0's file,
/// its own rank). Returns the first problem found, naming the file.
pub fn verify_checkpoint(dir: &Path) -> Result<IntactCheckpoint, String> {
    let step = checkpoint_step(dir)
        .ok_or_else(|| format!("{}: not a checkpoint directory name", dir.display()))?;
    let meta_of = |rank: usize| -> Result<Meta, String> {
        let p = dir.join(format!("rank-{rank}.ckpt"));
        if !p.is_file() {
            return Err(format!(
                "{}: missing (the checkpoint was not completed)",
                p.display()
            ));
        }
        let ck = Checkpoint::load(&p).map_err(|e| e.to_string())?;
        let meta: Meta = ck
            .json("meta")
            .map_err(|e| format!("{}: {e}", p.display()))?;
        if meta.step != step || meta.rank != rank {
            return Err(format!(
                "{}: holds rank {} at step {}, not rank {rank} at step {step}",
                p.display(),
                meta.rank,
                meta.step
            ));
        }
        Ok(meta)
    };
    let world = meta_of(0)?.world;
    for rank in 1..world {
        let meta = meta_of(rank)?;
        if meta.world != world {
            return Err(format!(
                "{}: written by a run of {} workers, rank 0's by one of {world}",
                dir.join(format!("rank-{rank}.ckpt")).display(),
                meta.world
            ));
        }
    }
    Ok(IntactCheckpoint {
        dir: dir.to_path_buf(),
        step,
        world,
    })
}

impl RunDir {
    /// The checkpoint directories (`checkpoints/step-…`) with their steps, newest first.
    pub fn checkpoint_dirs(&self) -> Vec<(u64, PathBuf)> {
        let mut dirs: Vec<(u64, PathBuf)> = std::fs::read_dir(self.checkpoints())
            .map(|d| {
                d.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.is_dir())
                    .filter_map(|p| checkpoint_step(&p).map(|s| (s, p)))
                    .collect()
            })
            .unwrap_or_default();
        dirs.sort_by_key(|d| std::cmp::Reverse(d.0));
        dirs
    }

    /// The step `checkpoints/LATEST` names, if it names a checkpoint directory.
    pub fn latest_step(&self) -> Option<u64> {
        let name = std::fs::read_to_string(self.checkpoints().join("LATEST")).ok()?;
        checkpoint_step(Path::new(name.trim()))
    }

    /// The newest checkpoint that is intact on every rank ([`verify_checkpoint`]), and the
    /// newer ones passed over on the way, newest first, with the reason.
    ///
    /// Only checkpoints up to the one `checkpoints/LATEST` names are candidates (newer ones
    /// belong to a trajectory the run abandoned, e.g. by a rollback); without a readable
    /// LATEST, every checkpoint is.
    pub fn newest_intact(&self) -> (Option<IntactCheckpoint>, Vec<SkippedCheckpoint>) {
        let bound = self.latest_step().unwrap_or(u64::MAX);
        let mut skipped = Vec::new();
        for (_, dir) in self
            .checkpoint_dirs()
            .into_iter()
            .filter(|(s, _)| *s <= bound)
        {
            match verify_checkpoint(&dir) {
                Ok(c) => return (Some(c), skipped),
                Err(reason) => skipped.push(SkippedCheckpoint { dir, reason }),
            }
        }
        (None, skipped)
    }

    /// Points `checkpoints/LATEST` at `dir` (atomically).
    pub fn set_latest(&self, dir: &Path) -> Result<(), CheckpointError> {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        checkpoint::write_atomic(&self.checkpoints().join("LATEST"), name.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dirs(steps: &[u64]) -> Vec<(u64, PathBuf)> {
        steps
            .iter()
            .map(|&s| (s, PathBuf::from(checkpoint_dir_name(s))))
            .collect()
    }

    fn names(v: &[PathBuf]) -> Vec<String> {
        v.iter().map(|p| p.display().to_string()).collect()
    }

    #[test]
    fn retention_keeps_the_newest_up_to_the_current_step_and_drops_abandoned_ones() {
        // Written 10 … 40, then the recover policy rolled back to 20 and wrote 30 again:
        // 40 belongs to the abandoned trajectory.
        let (kept, gone) = retained(&dirs(&[40, 30, 20, 10]), 30, 2);
        assert_eq!(names(&kept), ["step-0000000030", "step-0000000020"]);
        assert_eq!(names(&gone), ["step-0000000010", "step-0000000040"]);
        // keep = 0 is read as 1: the checkpoint just written always stays.
        let (kept, gone) = retained(&dirs(&[20, 10]), 20, 0);
        assert_eq!(names(&kept), ["step-0000000020"]);
        assert_eq!(names(&gone), ["step-0000000010"]);
        let (kept, gone) = retained(&dirs(&[5]), 5, 3);
        assert_eq!((kept.len(), gone.len()), (1, 0));
    }

    #[test]
    fn only_checkpoint_directory_names_have_a_step() {
        assert_eq!(checkpoint_step(Path::new("a/step-0000000450")), Some(450));
        assert_eq!(checkpoint_dir_name(450), "step-0000000450");
        for bad in ["LATEST", "step-", "step-12x", "step-0000000450.old", "x-1"] {
            assert_eq!(checkpoint_step(Path::new(bad)), None, "{bad}");
        }
        let e = verify_checkpoint(Path::new("/nonexistent/step-0000000007")).unwrap_err();
        assert!(e.contains("rank-0.ckpt") && e.contains("missing"), "{e}");
    }
}
