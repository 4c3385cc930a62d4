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
//! The merge happens τ inner steps after the exchange began, as in the paper. With
//! `in_flight = true` (the default) the exchange runs on its own thread over a second lane
//! of the run's connections ([`super::InFlight`]) while those τ steps compute, and the
//! merge's step waits only for what is left of it (recorded as that step's communication
//! time; its bytes are recorded at that step too). The outer step is taken when the average
//! arrives; the trained model is the same as with `in_flight = false`, where the exchange
//! blocks the step that starts it (tested bit for bit). A round whose average is not finite
//! is discarded alike on every rank: at its merge the fragment returns to its anchor.
//!
//! # Eager outer steps
//! `eager = true` (Kale, Douillard & Donchev, "Eager updates for overlapped communication
//! and computation in DiLoCo", arXiv 2502.12996) lets a fragment's exchange overlap its
//! whole next round (τ = H) without the replica waiting for the average: at the end of
//! round t each replica i takes its outer step at once on
//!
//! ```text
//!   Δ̃ᵢ⁽ᵗ⁾ = Δᵢ⁽ᵗ⁾/M + (Δ̄⁽ᵗ⁻¹⁾ − Δᵢ⁽ᵗ⁻¹⁾/M)      its own change now, the others' one round late
//! ```
//!
//! (Δ̄⁽ᵗ⁻¹⁾ the average of round t − 1, arrived during round t; nothing of it before the
//! second round), restarts its round from its outer-stepped anchor (α = 0), and sends
//! Δᵢ⁽ᵗ⁾. Over two rounds each worker's change enters every replica once, as it went over
//! the wire (under a lossy compressor the replica's own term is its exact change, and the
//! next round's correction is taken with the exact change too, so the two sum to what it
//! sent). The paper's summaries describe the rule as a mix of the current local outer
//! gradient with the delayed average of the other replicas'; the paper's pseudo-code could
//! not be read here, and the weights above (1/M each) are our reading of it. The replicas
//! differ from the first round on (each has its own anchor and outer momentum); evaluation
//! averages them. A round whose average is not finite drops the others' share of it: the
//! replica's own share, applied already, stays.
//!
//! Checkpoints hold every fragment's anchor, momentum, pending merge and exchanger state
//! (under `sync/stream/<p>/`), and each rank's own parameters: a resume is exact; the
//! replicas differ between merges, so a checkpoint cannot move to another worker count.

use std::ops::Range;

use std::time::Instant;

use dtrain_comms::{Communicator, Transport};
use dtrain_compress::Collective;
use dtrain_models::Model;
use serde::{Deserialize, Serialize};

use super::in_flight::{Done, Job};
use super::periodic::outer_step;
use super::PERIODIC_SECTION;
use super::{
    average_params, Collectives, GradientSync, InFlight, PeriodicState, SyncError, Update,
};
use crate::checkpoint::Checkpoint;
use crate::exchange::bucket::ParamInfo;
use crate::exchange::DeviceGradient;
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
    /// The round's average was not finite: the merge returns the fragment to its anchor.
    #[serde(default)]
    discard: bool,
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
    /// Its exchanger (`None` while an exchange of it is in flight).
    ex: Option<Collectives>,
    /// θ₀ᵖ (empty before the first local step).
    anchor: Vec<f32>,
    /// vᵖ (empty until the first outer step with μ > 0).
    velocity: Vec<f32>,
    /// The merge of the last exchange, if not yet applied.
    pending: Option<Pending>,
    /// `eager`: the last round's average, arrived and not yet applied (empty: none).
    arrived: Vec<f32>,
    /// `eager`: this replica's change of the last round, as applied on its own (empty:
    /// none).
    own: Vec<f32>,
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
    eager: bool,
    total_steps: u64,
    num_params: usize,
    /// Scratch: the parameters.
    params: Vec<f32>,
    /// Scratch: a fragment's vector.
    part: Vec<f32>,
    /// Scratch: the eager outer step's change.
    eager_step: Vec<f32>,
    identical: bool,
    /// The thread of the exchanges in flight (`in_flight = true` with τ ≥ 1).
    background: Option<InFlight>,
    /// What finished exchanges left for the next step's record.
    late: Late,
}

/// Figures of exchanges in flight, added to the record of the step that takes them back.
#[derive(Default)]
struct Late {
    bytes_sent: u64,
    bytes_received: u64,
    payload_bytes: u64,
    /// Seconds the main thread waited for them.
    wait_s: f64,
    /// Seconds they ran on their thread.
    in_flight_s: f64,
    ratio: Option<(String, f64)>,
}

impl Late {
    fn is_empty(&self) -> bool {
        self.bytes_sent == 0 && self.bytes_received == 0 && self.wait_s == 0.0
    }
}

/// The settings of [`Streaming`] (from `[sync]`).
pub(crate) struct StreamingSettings {
    pub(crate) period: u64,
    pub(crate) start: u64,
    pub(crate) outer_lr: f32,
    pub(crate) outer_momentum: f32,
    pub(crate) overlap: u64,
    pub(crate) mixing: f32,
    /// The eager outer step (see the [module docs](self#eager-outer-steps)).
    pub(crate) eager: bool,
    /// The run's steps: the exchanges still in flight at its last step are taken back
    /// there, so that their bytes are in its record.
    pub(crate) total_steps: u64,
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
                    ex: Some(ex),
                    anchor: Vec::new(),
                    velocity: Vec::new(),
                    pending: None,
                    arrived: Vec::new(),
                    own: Vec::new(),
                })
                .collect(),
            period: settings.period.max(1),
            start: settings.start,
            outer_lr: settings.outer_lr,
            outer_momentum: settings.outer_momentum,
            overlap: settings.overlap,
            mixing: settings.mixing,
            eager: settings.eager,
            total_steps: settings.total_steps,
            num_params,
            params: Vec::new(),
            part: Vec::new(),
            eager_step: Vec::new(),
            identical: true,
            background: None,
            late: Late::default(),
        }
    }

    /// The fragment whose round ends after local step `s` (at most one: F ≤ H).
    fn due(&self, s: u64) -> Option<usize> {
        let (h, f) = (self.period, self.frags.len() as u64);
        (0..f)
            .find(|&p| (s + 1) % h == ((p + 1) * h / f) % h)
            .map(|p| p as usize)
    }

    /// Starts fragment `p`'s exchange of its change after local step `s` and schedules its
    /// merge: on the thread of the exchanges in flight when there is one (and τ ≥ 1), the
    /// outer step following when it is taken back; else here, with the outer step now.
    /// The full parameters are in `self.params`.
    fn exchange<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        p: usize,
        s: u64,
        record: &mut StepRecord,
    ) -> Result<(), SyncError> {
        let frag = &mut self.frags[p];
        let mut delta = std::mem::take(&mut self.part);
        frag.gather(&self.params, &mut delta);
        for (d, &a) in delta.iter_mut().zip(&frag.anchor) {
            *d = a - *d;
        }
        if self.eager {
            let mut step = std::mem::take(&mut self.eager_step);
            eager_change(
                &delta,
                &frag.arrived,
                &frag.own,
                comm.world_size(),
                &mut step,
            );
            let (lr, mu) = (self.outer_lr, self.outer_momentum);
            outer_step(&mut frag.anchor, &mut frag.velocity, &step, lr, mu);
            self.eager_step = step;
            frag.arrived.clear();
            frag.own.clone_from(&delta);
            // The next round starts from the outer-stepped anchor (α = 0).
            frag.scatter(&frag.anchor, &mut self.params);
        }
        frag.pending = Some(Pending {
            at: s + self.overlap,
            discard: false,
        });
        let mut ex = frag.ex.take().ok_or_else(|| in_flight_error(p))?;
        match &mut self.background {
            Some(bg) if self.overlap > 0 => bg.start(Job {
                id: p,
                ex,
                buf: delta,
                step: s + self.start,
            }),
            _ => {
                let non_finite = ex.exchange(comm, &mut delta, s + self.start, record);
                self.frags[p].ex = Some(ex);
                let non_finite = non_finite?;
                self.settle(p, &delta, non_finite);
                self.part = delta;
                Ok(())
            }
        }
    }

    /// The outer step of fragment `p`'s round, whose average is `delta` (or, when it is
    /// not finite, the discarding of the round at its merge).
    fn settle(&mut self, p: usize, delta: &[f32], non_finite: bool) {
        let (lr, mu) = (self.outer_lr, self.outer_momentum);
        let frag = &mut self.frags[p];
        if self.eager {
            // Applied at the fragment's next round end; a non-finite round's others' share
            // is dropped (the own share, applied already, stays).
            frag.arrived.clear();
            if non_finite {
                frag.own.clear();
                if let Some(m) = &mut frag.pending {
                    m.discard = true;
                }
            } else {
                frag.arrived.extend_from_slice(delta);
            }
            return;
        }
        if non_finite {
            if let Some(m) = &mut frag.pending {
                m.discard = true;
            }
        } else {
            outer_step(&mut frag.anchor, &mut frag.velocity, delta, lr, mu);
        }
    }

    /// Takes back the oldest exchange in flight: its exchanger, figures and outer step.
    fn take_back(&mut self) -> Result<bool, SyncError> {
        let Some(bg) = &mut self.background else {
            return Ok(false);
        };
        let t = Instant::now();
        let Some(Done {
            id,
            ex,
            buf,
            result,
            record,
            took_s,
        }) = bg.next()?
        else {
            return Ok(false);
        };
        self.late.wait_s += t.elapsed().as_secs_f64();
        self.late.in_flight_s += took_s;
        self.frags[id].ex = Some(ex);
        let non_finite = result?;
        self.late.bytes_sent += record.bytes_sent;
        self.late.bytes_received += record.bytes_received;
        self.late.payload_bytes += record.payload_bytes;
        if let (Some(n), Some(v)) = (record.ratio_name, record.ratio) {
            self.late.ratio = Some((n, v));
        }
        self.settle(id, &buf, non_finite);
        self.part = buf;
        Ok(true)
    }

    /// Takes back every exchange in flight up to fragment `p`'s.
    fn take_back_until(&mut self, p: usize) -> Result<(), SyncError> {
        while self.background.as_ref().is_some_and(|b| b.is_open(p)) {
            self.take_back()?;
        }
        Ok(())
    }

    /// Applies fragment `p`'s merge to `self.params`; whether its round was discarded.
    fn merge(&mut self, p: usize) -> bool {
        let alpha = self.mixing;
        let frag = &mut self.frags[p];
        let discard = frag.pending.take().is_some_and(|m| m.discard);
        if self.eager {
            // The average waits in `arrived` for the round's end, this same step (a
            // non-finite one was dropped when it came back; the step reports it).
            return discard;
        }
        if discard {
            frag.scatter(&frag.anchor, &mut self.params);
            return true;
        }
        let mut local = std::mem::take(&mut self.part);
        frag.gather(&self.params, &mut local);
        for (l, &g) in local.iter_mut().zip(&frag.anchor) {
            *l = alpha * *l + (1.0 - alpha) * g;
        }
        frag.scatter(&local, &mut self.params);
        self.part = local;
        false
    }

    /// Adds what exchanges taken back left to `record`.
    fn flush_late(&mut self, record: &mut StepRecord) {
        let late = std::mem::take(&mut self.late);
        record.bytes_sent += late.bytes_sent;
        record.bytes_received += late.bytes_received;
        record.payload_bytes += late.payload_bytes;
        record.time.communicate_s += late.wait_s;
        record.time.in_flight_s += late.in_flight_s;
        if let Some((n, v)) = late.ratio {
            record.ratio_name = Some(n);
            record.ratio = Some(v);
        }
    }

    /// The fragments' exchangers, none in flight (for a checkpoint).
    fn exchangers(&self) -> Result<Vec<&Collectives>, SyncError> {
        self.frags
            .iter()
            .enumerate()
            .map(|(p, f)| f.ex.as_ref().ok_or_else(|| in_flight_error(p)))
            .collect()
    }
}

/// The eager outer step's change into `out`: `delta/M + (arrived − own/M)`, where an empty
/// `arrived` or `own` counts as zeros (see the [module docs](self#eager-outer-steps)). With
/// one worker and a lossless exchange `arrived` equals `own`, and the step is `delta`
/// exactly: DiLoCo's.
fn eager_change(delta: &[f32], arrived: &[f32], own: &[f32], workers: usize, out: &mut Vec<f32>) {
    fn padded(v: &[f32]) -> impl Iterator<Item = f32> + '_ {
        v.iter().copied().chain(std::iter::repeat(0.0))
    }
    let m = workers.max(1) as f32;
    out.clear();
    out.extend(
        delta
            .iter()
            .zip(padded(arrived))
            .zip(padded(own))
            .map(|((&d, a), w)| d / m + (a - w / m)),
    );
}

/// The error for fragment `p`'s exchanger wanted while its exchange is in flight (the
/// trainer takes every exchange back before a checkpoint).
fn in_flight_error(p: usize) -> SyncError {
    SyncError::Background(format!(
        "fragment {p}'s exchange is still in flight (not taken back before it was needed)"
    ))
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

    /// A local step applies the gradient where it lies: nothing to read.
    fn reads_device_gradient(&self) -> bool {
        true
    }

    /// A local step: nothing crosses (the trainer applies the gradient on the device). A
    /// step before `start`: the inner every-step synchronisation's.
    fn sync_device(
        &mut self,
        comm: &mut Communicator<T>,
        model: &dyn Model,
        grads: &mut [f32],
        on_device: &DeviceGradient,
        mean_to_device: bool,
        step: u64,
        lr: f64,
        record: &mut StepRecord,
    ) -> Result<Update, SyncError> {
        if step < self.start {
            return super::inner_sync_device(
                &mut self.inner,
                comm,
                model,
                grads,
                on_device,
                mean_to_device,
                step,
                lr,
                record,
            );
        }
        super::update_from_device(grads, on_device, mean_to_device)?;
        GradientSync::<T>::sync(self, comm, model, grads, step, lr, record)
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
        let last = step + 1 >= self.total_steps;
        if merges.is_empty() && due.is_none() && self.late.is_empty() && !last {
            return Ok(false);
        }
        // The exchanges that merge now come back first (their wait is this step's
        // communication).
        for &p in &merges {
            self.take_back_until(p)?;
        }
        self.params.resize(self.num_params, 0.0);
        model.read_params(&mut self.params);
        // Merges first: a fragment's merge precedes its next exchange (τ < H).
        let mut discarded = false;
        for p in merges {
            discarded |= self.merge(p);
        }
        if let Some(p) = due {
            self.exchange(comm, p, s, record)?;
            if self.overlap == 0 {
                discarded |= self.merge(p);
            }
        }
        if last {
            // Nothing merges after the run's last step; what is in flight is recorded here.
            while self.take_back()? {}
        }
        self.flush_late(record);
        model.write_params(&self.params);
        Ok(discarded)
    }

    fn drain(&mut self) -> Result<Vec<crate::ps_mode::Ready>, SyncError> {
        while self.take_back()? {}
        Ok(Vec::new())
    }

    fn finish(&mut self) -> Result<Vec<crate::ps_mode::Ready>, SyncError> {
        GradientSync::<T>::drain(self)
    }

    fn attach_background(&mut self, comm: Communicator<T>) -> bool
    where
        T: 'static,
    {
        self.background = Some(InFlight::spawn(comm));
        true
    }

    fn identical(&self) -> bool {
        self.identical
    }

    /// The every-step phase before `switch_step`.
    fn every_step_exchange(&self, step: u64) -> bool {
        step < self.start
    }

    /// A local step at which no fragment's round ends, unless exchanges run in flight
    /// (their thread may be in a collective at any step).
    fn runs_alone(&self, step: u64) -> bool {
        step >= self.start && self.background.is_none() && self.due(step - self.start).is_none()
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
        match self.frags.iter().find_map(|f| f.ex.as_ref()) {
            Some(ex) => GradientSync::<T>::collectives(ex),
            None => GradientSync::<T>::collectives(&self.inner),
        }
    }

    fn theta_scale(&self) -> f64 {
        GradientSync::<T>::theta_scale(&self.inner)
    }

    fn scale_theta(&mut self, factor: f64) {
        GradientSync::<T>::scale_theta(&mut self.inner, factor);
        // The recover policy scales θ right after a restore, which takes every exchange
        // back: no exchanger is in flight here.
        for ex in self.frags.iter_mut().filter_map(|f| f.ex.as_mut()) {
            ex.scale_exchanger_theta(factor);
        }
    }

    /// The whole-model exchanger's memories keep their keys; fragment `p`'s are
    /// `(p + 1)·2⁴⁸ + key`, its sections under `sync/stream/<p>/`.
    fn save(&self, ck: &mut Checkpoint) -> Result<Vec<u64>, SyncError> {
        let mut keys = GradientSync::<T>::save(&self.inner, ck)?;
        let exchangers = self.exchangers()?;
        for (p, (f, ex)) in self.frags.iter().zip(exchangers).enumerate() {
            let prefix = fragment_prefix(p);
            for k in ex.save_in(ck, &prefix)? {
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
            if self.eager {
                ck.put_f32(&format!("{prefix}arrived"), &f.arrived);
                ck.put_f32(&format!("{prefix}own"), &f.own);
            }
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
        // A roll-back (the recover policy) may come with exchanges in flight: their
        // exchangers come back first, and what they did is replaced below.
        while self.take_back()? {}
        self.late = Late::default();
        let (whole, by_frag): (Vec<u64>, Vec<u64>) =
            memory_keys.iter().partition(|&&k| k >> 48 == 0);
        self.inner.restore_exchanger(ck, &whole)?;
        let fresh = |s: &mut Streaming| {
            for f in &mut s.frags {
                f.anchor.clear();
                f.velocity.clear();
                f.pending = None;
                f.arrived.clear();
                f.own.clear();
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
            // The eager rule's vectors (absent from a checkpoint written without it: a
            // round started then has no own share applied ahead).
            let optional = |name: &str| -> Result<Vec<f32>, SyncError> {
                let name = format!("{prefix}{name}");
                if ck.names().any(|n| n == name) {
                    Ok(ck.f32(&name)?)
                } else {
                    Ok(Vec::new())
                }
            };
            let (arrived, own) = if self.eager {
                (optional("arrived")?, optional("own")?)
            } else {
                (Vec::new(), Vec::new())
            };
            let same = state.ranges.len() == layout.ranges.len()
                && state
                    .ranges
                    .iter()
                    .zip(&layout.ranges)
                    .all(|(&(a, b), r)| (a, b) == (r.start, r.end));
            if !same
                || !anchor.is_empty() && anchor.len() != len
                || !velocity.is_empty() && velocity.len() != len
                || !arrived.is_empty() && arrived.len() != len
                || !own.is_empty() && own.len() != len
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
            f.ex.as_mut()
                .ok_or_else(|| in_flight_error(p))?
                .restore_in(ck, &prefix, &keys)?;
            f.anchor = anchor;
            f.velocity = velocity;
            f.pending = state.pending;
            f.arrived = arrived;
            f.own = own;
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

    /// `Δ/M + (arrived − own/M)`, each missing vector counting as zeros; with one worker
    /// and `arrived = own` the change itself, bit for bit.
    #[test]
    fn the_eager_change_is_the_own_share_now_and_the_others_of_the_last_round() {
        let mut out = Vec::new();
        let delta = [4.0, -8.0, 0.3];
        eager_change(&delta, &[], &[], 4, &mut out);
        assert_eq!(out, [1.0, -2.0, 0.075]);
        eager_change(&delta, &[1.0, 1.0, 1.0], &[], 4, &mut out);
        assert_eq!(out, [2.0, -1.0, 1.075]);
        eager_change(&delta, &[], &[4.0, 4.0, 4.0], 4, &mut out);
        assert_eq!(out, [0.0, -3.0, 0.075 - 1.0]);
        eager_change(&delta, &[3.0, 2.0, 1.0], &[4.0, 4.0, 4.0], 4, &mut out);
        assert_eq!(out, [1.0 + 2.0, -2.0 + 1.0, 0.075 + 0.0]);
        let own = [0.1f32, 1e-7, -3.3];
        eager_change(&delta, &own, &own, 1, &mut out);
        assert_eq!(out, delta);
    }

    #[test]
    fn one_fragment_is_the_whole_model() {
        let infos = vec![info("a", &[3, 4]), info("b", &[5])];
        let f = layout(&infos, 1, 1).unwrap();
        assert_eq!(f[0].ranges, vec![0..17]);
        assert_eq!(f[0].infos, infos);
    }
}
