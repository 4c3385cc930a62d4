//! Streaming DiLoCo (`[sync] kind = "streaming-diloco"`; Douillard et al., "Streaming
//! DiLoCo with overlapping communication", arXiv 2501.18512): DiLoCo whose model is
//! synchronised in F fragments at staggered steps, so that a round's bytes are spread over
//! the round instead of all crossing the link at one step.
//!
//! ```text
//! fragment p (its own anchor θ₀ᵖ, outer momentum vᵖ and exchanger), local step s = step − start:
//!   after s with (s + 1) mod H = (p + 1)·H/F mod H:
//!     Δᵖ = mean_i(θ₀ᵖ − θᵢᵖ)                 through the fragment's exchanger (any compressor)
//!     vᵖ ← μ·vᵖ + Δᵖ;  θ₀ᵖ ← θ₀ᵖ − η·(Δᵖ + μ·vᵖ)  Nesterov, as DiLoCo
//!   after s + τ (the overlap):
//!     θᵢᵖ ← α·θᵢᵖ + (1 − α)·θ₀ᵖ               the merge; α = 0, τ = 0 is DiLoCo per fragment
//! ```
//!
//! # Defaults and the reference implementation
//! The schedule follows PyTorch's torchft (`torchft/local_sgd.py`, `DiLoCo` with model
//! fragments; read, not copied): fragment `p` is prepared at the steps `⌊(p + 1)·H/F⌋ mod H`
//! and merged `fragment_sync_delay` (τ) steps later, where the local fragment is *replaced*
//! by the outer-stepped global one — α = 0; torchft refuses any other `fragment_update_alpha`
//! as not supported yet, bounds τ below `H/F`, and defaults to τ = 0. dtrain's defaults
//! (τ = 1, α = 0.5) are the paper's as we recall them (its code is not public), unverified;
//! τ may reach `H − 1` here, as each fragment's pending merge is kept on its own. With
//! `overlap = 0, mixing = 0` a fragment's round is torchft's, and with one fragment DiLoCo's
//! (tested bit for bit).
//!
//! # Fragments
//! The paper fragments a deep transformer by blocks, strided (fragment p holds blocks p,
//! p + F, …), which also balances the fragments. A small model is dominated by one tensor
//! (the 2-block GPT of `experiments/low_comm_gpt.toml` keeps 69 % of its values in the tied
//! embedding), so whole blocks cannot give every fragment 1/F of the values. dtrain keeps
//! the striding and the balance: the parameter vector (tensor order, input to output) is
//! cut at tensor rows into `F·stripes` pieces of (nearly) equal size, and piece `j` goes to
//! fragment `j mod F` — each fragment spans the depth of the model and holds about 1/F of
//! it. A piece's parts are sub-tensors `[rows, …]` to the compressors, so shape-aware
//! methods (PowerSGD, DeMo, columns) see matrices.
//!
//! # The overlap
//! The merge happens τ inner steps after the exchange began, as in the paper, so the
//! trained model is the overlapped one. The exchange itself still runs when the fragment's
//! round ends, blocking the step: dtrain's transports have no collective left in flight
//! across steps yet, so the wall time measured on an emulated link is that of a blocking
//! exchange; `dtrain simulate` projects the overlapped schedule.
//!
//! Checkpoints hold every fragment's anchor, momentum, pending merge and exchanger state
//! (under `sync/stream/<p>/`), and each rank's own parameters: a resume is exact; the
//! replicas differ between merges, so a checkpoint cannot move to another worker count.

use std::ops::Range;

use dtrain_comms::{Communicator, Transport};
use dtrain_compress::Collective;
use dtrain_models::Model;
use serde::{Deserialize, Serialize};

use super::periodic::outer_step;
use super::PERIODIC_SECTION;
use super::{average_params, Collectives, GradientSync, PeriodicState, SyncError, Update};
use crate::checkpoint::Checkpoint;
use crate::exchange::bucket::ParamInfo;
use dtrain_records::StepRecord;

/// The kind's name in `[sync]` and in checkpoints.
const KIND: &str = "streaming-diloco";

/// One fragment: where its values lie in the parameter vector and the tensors its
/// exchanger sees.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FragmentLayout {
    /// Ranges of the parameter vector, in order; the fragment's vector is their
    /// concatenation.
    pub(crate) ranges: Vec<Range<usize>>,
    /// The sub-tensors of those ranges (`name[rows a..b]` where a tensor is cut).
    pub(crate) infos: Vec<ParamInfo>,
}

impl FragmentLayout {
    /// Number of values.
    pub(crate) fn len(&self) -> usize {
        self.ranges.iter().map(|r| r.len()).sum()
    }
}

/// Cuts the parameters `infos` (in vector order) into `fragments` fragments of
/// `fragments·stripes` pieces, cut at tensor rows (see the [module docs](self)). An error
/// when a fragment would be empty (more pieces than rows).
pub(crate) fn layout(
    infos: &[ParamInfo],
    fragments: usize,
    stripes: usize,
) -> Result<Vec<FragmentLayout>, String> {
    let n: usize = infos.iter().map(ParamInfo::numel).sum();
    let pieces = fragments * stripes.max(1);
    // Tensor offsets.
    let mut starts = Vec::with_capacity(infos.len());
    let mut at = 0;
    for p in infos {
        starts.push(at);
        at += p.numel();
    }
    // Cut points: the j-th target moved up to the next row boundary of its tensor.
    let row_len = |p: &ParamInfo| -> usize {
        match p.shape.first() {
            Some(&r) if r > 0 => p.numel() / r,
            _ => p.numel().max(1),
        }
    };
    let mut cuts = vec![0usize];
    for j in 1..pieces {
        let target = (j as u128 * n as u128 / pieces as u128) as usize;
        let t = starts.partition_point(|&s| s <= target).saturating_sub(1);
        let (s, len) = (starts[t], infos[t].numel());
        let rl = row_len(&infos[t]).max(1);
        let cut = (s + (target - s).div_ceil(rl) * rl).min(s + len);
        if cut > *cuts.last().unwrap_or(&0) && cut < n {
            cuts.push(cut);
        }
    }
    cuts.push(n);
    let mut frags: Vec<FragmentLayout> = (0..fragments)
        .map(|_| FragmentLayout {
            ranges: Vec::new(),
            infos: Vec::new(),
        })
        .collect();
    for (j, w) in cuts.windows(2).enumerate() {
        let (lo, hi) = (w[0], w[1]);
        let f = &mut frags[j % fragments];
        f.ranges.push(lo..hi);
        // The tensors the piece overlaps, each cut to its rows inside the piece.
        let first = starts.partition_point(|&s| s <= lo).saturating_sub(1);
        for (t, p) in infos.iter().enumerate().skip(first) {
            let (s, e) = (starts[t], starts[t] + p.numel());
            if s >= hi {
                break;
            }
            let (a, b) = (lo.max(s), hi.min(e));
            if a >= b {
                continue;
            }
            if (a, b) == (s, e) {
                f.infos.push(p.clone());
                continue;
            }
            let rl = row_len(p).max(1);
            let (r0, r1) = ((a - s) / rl, (b - s).div_ceil(rl));
            let mut shape = p.shape.clone();
            match shape.first_mut() {
                Some(r) => *r = r1 - r0,
                None => shape = vec![b - a],
            }
            f.infos.push(ParamInfo {
                name: format!("{}[rows {r0}..{r1}]", p.name),
                shape,
            });
        }
    }
    if let Some(p) = frags.iter().position(|f| f.ranges.is_empty()) {
        return Err(format!(
            "fragment {p} of {fragments} is empty: the model's {n} parameters have too few \
             rows for {pieces} pieces (lower sync.fragments or sync.stripes)"
        ));
    }
    Ok(frags)
}

/// A merge waiting for its step.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Pending {
    /// The local step after which it is applied.
    at: u64,
}

/// What each fragment writes into a checkpoint besides its vectors.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct FragmentState {
    pending: Option<Pending>,
    /// The fragment's ranges of the parameter vector (checked on restore: the same count
    /// of values cut another way would not line up with the anchor).
    ranges: Vec<(usize, usize)>,
}

/// A fragment's synchronisation state.
struct Fragment {
    layout: FragmentLayout,
    ex: Collectives,
    /// θ₀ᵖ (empty before the first local step).
    anchor: Vec<f32>,
    /// vᵖ (empty until the first outer step with μ > 0).
    velocity: Vec<f32>,
    /// The merge of the last exchange, if not yet applied.
    pending: Option<Pending>,
}

impl Fragment {
    /// Copies the fragment's values out of the full vector `full` into `out`.
    fn gather(&self, full: &[f32], out: &mut Vec<f32>) {
        out.clear();
        for r in &self.layout.ranges {
            out.extend_from_slice(&full[r.clone()]);
        }
    }

    /// Writes `part` (the fragment's vector) into the full vector `full`.
    fn scatter(&self, part: &[f32], full: &mut [f32]) {
        let mut at = 0;
        for r in &self.layout.ranges {
            full[r.clone()].copy_from_slice(&part[at..at + r.len()]);
            at += r.len();
        }
    }
}

/// Streaming DiLoCo (see the [module docs](self)).
pub(crate) struct Streaming {
    /// The every-step exchange before `start` (the whole model).
    inner: Collectives,
    frags: Vec<Fragment>,
    period: u64,
    start: u64,
    outer_lr: f32,
    outer_momentum: f32,
    overlap: u64,
    mixing: f32,
    num_params: usize,
    /// Scratch: the parameters.
    params: Vec<f32>,
    /// Scratch: a fragment's vector.
    part: Vec<f32>,
    identical: bool,
}

/// The settings of [`Streaming`] (from `[sync]`).
pub(crate) struct StreamingSettings {
    pub(crate) period: u64,
    pub(crate) start: u64,
    pub(crate) outer_lr: f32,
    pub(crate) outer_momentum: f32,
    pub(crate) overlap: u64,
    pub(crate) mixing: f32,
}

impl Streaming {
    /// Streaming DiLoCo over `fragments` (each with its exchanger), exchanging every step's
    /// gradient through `inner` before `settings.start`.
    pub(crate) fn new(
        inner: Collectives,
        fragments: Vec<(FragmentLayout, Collectives)>,
        settings: StreamingSettings,
        num_params: usize,
    ) -> Streaming {
        Streaming {
            inner,
            frags: fragments
                .into_iter()
                .map(|(layout, ex)| Fragment {
                    layout,
                    ex,
                    anchor: Vec::new(),
                    velocity: Vec::new(),
                    pending: None,
                })
                .collect(),
            period: settings.period.max(1),
            start: settings.start,
            outer_lr: settings.outer_lr,
            outer_momentum: settings.outer_momentum,
            overlap: settings.overlap,
            mixing: settings.mixing,
            num_params,
            params: Vec::new(),
            part: Vec::new(),
            identical: true,
        }
    }

    /// The fragment whose round ends after local step `s` (at most one: F ≤ H).
    fn due(&self, s: u64) -> Option<usize> {
        let (h, f) = (self.period, self.frags.len() as u64);
        (0..f)
            .find(|&p| (s + 1) % h == ((p + 1) * h / f) % h)
            .map(|p| p as usize)
    }

    /// Exchanges fragment `p`'s change, takes the outer step and schedules (or, with
    /// τ = 0, applies) its merge. The full parameters are in `self.params`.
    fn exchange<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        p: usize,
        s: u64,
        record: &mut StepRecord,
    ) -> Result<bool, SyncError> {
        let (lr, mu) = (self.outer_lr, self.outer_momentum);
        let frag = &mut self.frags[p];
        let mut delta = std::mem::take(&mut self.part);
        frag.gather(&self.params, &mut delta);
        for (d, &a) in delta.iter_mut().zip(&frag.anchor) {
            *d = a - *d;
        }
        let non_finite = frag.ex.exchange(comm, &mut delta, s + self.start, record)?;
        if non_finite {
            // The round is discarded alike on every rank: the fragment returns to its
            // anchor now.
            frag.pending = None;
            frag.scatter(&frag.anchor, &mut self.params);
        } else {
            outer_step(&mut frag.anchor, &mut frag.velocity, &delta, lr, mu);
            frag.pending = Some(Pending {
                at: s + self.overlap,
            });
        }
        self.part = delta;
        Ok(non_finite)
    }

    /// Applies fragment `p`'s merge to `self.params`.
    fn merge(&mut self, p: usize) {
        let alpha = self.mixing;
        let frag = &mut self.frags[p];
        frag.pending = None;
        let mut local = std::mem::take(&mut self.part);
        frag.gather(&self.params, &mut local);
        for (l, &g) in local.iter_mut().zip(&frag.anchor) {
            *l = alpha * *l + (1.0 - alpha) * g;
        }
        frag.scatter(&local, &mut self.params);
        self.part = local;
    }
}

impl<T: Transport> GradientSync<T> for Streaming {
    fn lockstep(&self) -> bool {
        true
    }

    fn scans_gradient(&self) -> bool {
        true
    }

    fn sync(
        &mut self,
        comm: &mut Communicator<T>,
        model: &dyn Model,
        grads: &mut [f32],
        step: u64,
        lr: f64,
        record: &mut StepRecord,
    ) -> Result<Update, SyncError> {
        if step < self.start {
            return GradientSync::<T>::sync(&mut self.inner, comm, model, grads, step, lr, record);
        }
        if self.frags.iter().any(|f| f.anchor.is_empty()) {
            // The first local step: the replicas are identical here; every anchor is taken.
            self.params.resize(self.num_params, 0.0);
            model.read_params(&mut self.params);
            for f in &mut self.frags {
                let mut a = Vec::new();
                f.gather(&self.params, &mut a);
                f.anchor = a;
            }
            if self.start > 0 {
                self.inner.clear_memories();
            }
        }
        self.identical = false;
        Ok(Update::Local)
    }

    fn after_update(
        &mut self,
        comm: &mut Communicator<T>,
        model: &mut dyn Model,
        step: u64,
        record: &mut StepRecord,
    ) -> Result<bool, SyncError> {
        if step < self.start {
            return Ok(false);
        }
        let s = step - self.start;
        let merges: Vec<usize> = (0..self.frags.len())
            .filter(|&p| self.frags[p].pending.as_ref().is_some_and(|m| m.at == s))
            .collect();
        let due = self.due(s);
        if merges.is_empty() && due.is_none() {
            return Ok(false);
        }
        self.params.resize(self.num_params, 0.0);
        model.read_params(&mut self.params);
        // Merges first: a fragment's merge precedes its next exchange (τ < H).
        for p in merges {
            self.merge(p);
        }
        let mut non_finite = false;
        if let Some(p) = due {
            non_finite = self.exchange(comm, p, s, record)?;
            if self.overlap == 0 && !non_finite {
                self.merge(p);
            }
        }
        model.write_params(&self.params);
        Ok(non_finite)
    }

    fn consensus(
        &mut self,
        comm: &mut Communicator<T>,
        model: &dyn Model,
    ) -> Result<Option<Vec<f32>>, SyncError> {
        if self.identical {
            return Ok(None);
        }
        average_params(comm, model).map(Some)
    }

    fn collectives(&self) -> (Collective, Vec<Collective>) {
        match self.frags.first() {
            Some(f) => GradientSync::<T>::collectives(&f.ex),
            None => GradientSync::<T>::collectives(&self.inner),
        }
    }

    fn theta_scale(&self) -> f64 {
        GradientSync::<T>::theta_scale(&self.inner)
    }

    fn scale_theta(&mut self, factor: f64) {
        GradientSync::<T>::scale_theta(&mut self.inner, factor);
        for f in &mut self.frags {
            GradientSync::<T>::scale_theta(&mut f.ex, factor);
        }
    }

    /// The whole-model exchanger's memories keep their keys; fragment `p`'s are
    /// `(p + 1)·2⁴⁸ + key`, its sections under `sync/stream/<p>/`.
    fn save(&self, ck: &mut Checkpoint) -> Result<Vec<u64>, SyncError> {
        let mut keys = GradientSync::<T>::save(&self.inner, ck)?;
        for (p, f) in self.frags.iter().enumerate() {
            let prefix = fragment_prefix(p);
            for k in f.ex.save_in(ck, &prefix)? {
                keys.push(fragment_key(p, k));
            }
            ck.put_json(
                &format!("{prefix}state"),
                &FragmentState {
                    pending: f.pending.clone(),
                    ranges: f.layout.ranges.iter().map(|r| (r.start, r.end)).collect(),
                },
            );
            ck.put_f32(&format!("{prefix}anchor"), &f.anchor);
            ck.put_f32(&format!("{prefix}velocity"), &f.velocity);
        }
        ck.put_json(
            PERIODIC_SECTION,
            &PeriodicState {
                kind: KIND.to_string(),
                identical: self.identical,
            },
        );
        Ok(keys)
    }

    fn restore(
        &mut self,
        ck: &Checkpoint,
        memory_keys: &[u64],
        _step: u64,
    ) -> Result<(), SyncError> {
        let (whole, by_frag): (Vec<u64>, Vec<u64>) =
            memory_keys.iter().partition(|&&k| k >> 48 == 0);
        self.inner.restore_exchanger(ck, &whole)?;
        let fresh = |s: &mut Streaming| {
            for f in &mut s.frags {
                f.anchor.clear();
                f.velocity.clear();
                f.pending = None;
            }
            s.identical = true;
        };
        if !ck.names().any(|n| n == PERIODIC_SECTION) {
            // An every-step checkpoint: identical replicas, anchors taken at the next step.
            fresh(self);
            return Ok(());
        }
        let st: PeriodicState = ck.json(PERIODIC_SECTION)?;
        if st.kind != KIND {
            if !st.identical {
                return Err(SyncError::State(format!(
                    "it was written between two synchronisations of sync.kind = {:?}; this \
                     run has {KIND:?} (resume with the same kind, or from a checkpoint at a \
                     synchronisation)",
                    st.kind
                )));
            }
            fresh(self);
            return Ok(());
        }
        for p in 0..self.frags.len() {
            let prefix = fragment_prefix(p);
            let state: FragmentState = ck.json(&format!("{prefix}state")).map_err(|_| {
                SyncError::State(format!(
                    "it holds no state for fragment {p} of sync.fragments = {} (was it written \
                     with fewer fragments?)",
                    self.frags.len()
                ))
            })?;
            let layout = &self.frags[p].layout;
            let len = layout.len();
            let anchor = ck.f32(&format!("{prefix}anchor"))?;
            let velocity = ck.f32(&format!("{prefix}velocity"))?;
            let same = state.ranges.len() == layout.ranges.len()
                && state
                    .ranges
                    .iter()
                    .zip(&layout.ranges)
                    .all(|(&(a, b), r)| (a, b) == (r.start, r.end));
            if !same
                || !anchor.is_empty() && anchor.len() != len
                || !velocity.is_empty() && velocity.len() != len
            {
                let held: usize = state.ranges.iter().map(|(a, b)| b.saturating_sub(*a)).sum();
                return Err(SyncError::State(format!(
                    "its fragment {p} holds {held} values in {} pieces, this run's {len} in {} \
                     (resume with the same model, sync.fragments and sync.stripes)",
                    state.ranges.len(),
                    layout.ranges.len()
                )));
            }
            let keys: Vec<u64> = by_frag
                .iter()
                .filter(|&&k| k >> 48 == p as u64 + 1)
                .map(|&k| k & ((1 << 48) - 1))
                .collect();
            let f = &mut self.frags[p];
            f.ex.restore_in(ck, &prefix, &keys)?;
            f.anchor = anchor;
            f.velocity = velocity;
            f.pending = state.pending;
        }
        if ck
            .names()
            .any(|n| n == fragment_prefix(self.frags.len()) + "state")
        {
            return Err(SyncError::State(format!(
                "it was written with more than sync.fragments = {} fragments",
                self.frags.len()
            )));
        }
        self.identical = st.identical;
        Ok(())
    }
}

/// The checkpoint sections of fragment `p`.
fn fragment_prefix(p: usize) -> String {
    format!("sync/stream/{p}/")
}

/// The checkpoint key of fragment `p`'s memory `key`.
fn fragment_key(p: usize, key: u64) -> u64 {
    ((p as u64 + 1) << 48) | key
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, shape: &[usize]) -> ParamInfo {
        ParamInfo {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn fragments_are_balanced_strided_and_cover_every_value_once() {
        // An embedding that outweighs the blocks, as in the small GPT.
        let infos = vec![
            info("emb", &[700, 10]),
            info("b0.w", &[10, 10]),
            info("b0.b", &[10]),
            info("b1.w", &[100, 10]),
            info("b1.b", &[10]),
            info("head.b", &[7]),
        ];
        let n: usize = infos.iter().map(ParamInfo::numel).sum();
        let frags = layout(&infos, 4, 2).unwrap();
        assert_eq!(frags.len(), 4);
        let mut seen = vec![0u8; n];
        for f in &frags {
            // Balanced: within a row of 1/F (two pieces, each cut up to one row late).
            assert!(f.len().abs_diff(n / 4) <= 20, "{} of {n}", f.len());
            // Strided: one piece in each half of the vector.
            assert_eq!(f.ranges.len(), 2);
            assert!(f.ranges[0].start < n / 2 && f.ranges[1].start >= n / 2 - 10);
            // The sub-tensors cover exactly the ranges.
            let covered: usize = f.infos.iter().map(ParamInfo::numel).sum();
            assert_eq!(covered, f.len());
            for r in &f.ranges {
                for i in r.clone() {
                    seen[i] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
        // Cut at rows: the embedding's pieces are whole rows of 10.
        assert!(frags[0].infos[0].name.starts_with("emb[rows 0.."));
        assert_eq!(frags[0].infos[0].shape[1], 10);
    }

    #[test]
    fn too_few_rows_is_an_error_naming_the_settings() {
        let infos = vec![info("w", &[2, 50])];
        let e = layout(&infos, 4, 2).unwrap_err();
        assert!(e.contains("sync.fragments"), "{e}");
        assert_eq!(layout(&infos, 2, 1).unwrap().len(), 2);
    }

    #[test]
    fn one_fragment_is_the_whole_model() {
        let infos = vec![info("a", &[3, 4]), info("b", &[5])];
        let f = layout(&infos, 1, 1).unwrap();
        assert_eq!(f[0].ranges, vec![0..17]);
        assert_eq!(f[0].infos, infos);
    }
}
