//! The MIPD parameter-server side (see the [module docs](crate::mipd)): per-shard state,
//! smoothing of dropped coordinates, alternating halves and the pull payload.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::worker::decode_layer;
use super::MipdConfig;
use crate::compressor::{effective_segments, read_frame};
use crate::error::{ConfigError, WireError};
use crate::registry::Method;
use crate::wire::{f32_at, Reader, Writer};

/// Which half of each layer the server updates at step `t` (`H_{t mod 2}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Halves {
    /// Every coordinate, every step (no alternation).
    Off,
    /// `H_0` = the first `⌈n_l/2⌉` coordinates of each layer, `H_1` = the rest. Contiguous,
    /// so the per-step work really touches half the memory. Default.
    #[default]
    Blocked,
    /// `H_0` = even offsets within each layer, `H_1` = odd offsets.
    Interleaved,
}

impl Halves {
    /// The half updated at `step`: `Some(step mod 2)`, or `None` for [`Halves::Off`].
    pub fn half(self, step: u64) -> Option<u8> {
        match self {
            Halves::Off => None,
            _ => Some((step % 2) as u8),
        }
    }

    /// Calls `f(j)` for every coordinate `j` (relative to the buffer the layers tile) of
    /// half `half` (`None`: all), in ascending order.
    pub fn for_each(self, layers: &[Range<usize>], half: Option<u8>, mut f: impl FnMut(usize)) {
        self.for_each_run(layers, half, |r, stride| r.step_by(stride).for_each(&mut f));
    }

    /// Calls `f(run, stride)` for the runs making up half `half` (`None`: all) of the
    /// layers, in ascending order: the coordinates `run.start, run.start + stride, …` below
    /// `run.end` (stride 1 or 2; `run` non-empty).
    pub fn for_each_run(
        self,
        layers: &[Range<usize>],
        half: Option<u8>,
        mut f: impl FnMut(Range<usize>, usize),
    ) {
        for l in layers {
            let (run, stride) = match (self, half) {
                (Halves::Off, _) | (_, None) => (l.clone(), 1),
                (Halves::Blocked, Some(h)) => {
                    let mid = l.start + l.len().div_ceil(2);
                    (if h == 0 { l.start..mid } else { mid..l.end }, 1)
                }
                (Halves::Interleaved, Some(h)) => (l.start + h as usize..l.end, 2),
            };
            if run.start < run.end {
                f(run, stride);
            }
        }
    }

    /// Coordinates in half `half` (`None`: all) of the layers.
    pub fn count(self, layers: &[Range<usize>], half: Option<u8>) -> usize {
        layers
            .iter()
            .map(|l| match (self, half) {
                (Halves::Off, _) | (_, None) => l.len(),
                (_, Some(0)) => l.len().div_ceil(2),
                (_, Some(_)) => l.len() / 2,
            })
            .sum()
    }
}

/// Configuration of the MIPD server side ([`MipdServer`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MipdServerConfig {
    /// Smoothing factor λ in [0, 1] for coordinates nobody sent: `ĝ ← λ·ĝ`. 0 degenerates
    /// to plain sparsification. Default 0.5.
    #[serde(default = "default_lambda")]
    pub lambda: f64,
    /// Which half is updated at each step. Default `blocked`.
    #[serde(default)]
    pub halves: Halves,
}

pub(super) fn default_lambda() -> f64 {
    0.5
}

impl Default for MipdServerConfig {
    fn default() -> Self {
        MipdServerConfig {
            lambda: default_lambda(),
            halves: Halves::default(),
        }
    }
}

impl MipdServerConfig {
    /// Checks λ.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&self.lambda) {
            return Err(ConfigError::new(
                "lambda",
                format!("must be in [0, 1], got {}", self.lambda),
            ));
        }
        Ok(())
    }

    /// Builds the server state of a shard of `len` elements laid out in `layers`
    /// (contiguous, in order, tiling `0..len`; empty means one layer), starting at step 0.
    pub fn init(&self, len: usize, layers: &[Range<usize>]) -> Result<MipdServer, ConfigError> {
        self.validate()?;
        let layers = effective_segments(len, layers)
            .map_err(|e| ConfigError::new("layers", e.to_string()))?;
        Ok(MipdServer {
            lambda: self.lambda as f32,
            halves: self.halves,
            layers,
            smoothed: vec![0.0; len],
            carry: vec![0.0; len],
            received: vec![false; len],
            next_step: 0,
            scratch: Vec::new(),
            bounds: Vec::new(),
            values: Vec::new(),
        })
    }
}

/// Why a [`MipdServer`] could not aggregate a step. The state is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MipdServerError {
    /// A push is malformed or does not fit the shard.
    #[error("push {index}: {source}")]
    Push {
        /// Position of the push in the list (worker order).
        index: usize,
        /// What was wrong.
        source: WireError,
    },
    /// Steps must be aggregated in order 0, 1, 2, …
    #[error("step {got} aggregated, expected step {expected}")]
    OutOfOrder {
        /// The step the server expected.
        expected: u64,
        /// The step it was given.
        got: u64,
    },
}

/// The server state of one shard (see the [module docs](crate::mipd)): smoothed aggregate ĝ,
/// carry of received gradients not yet applied, received marks, the next step.
#[derive(Debug, Clone)]
pub struct MipdServer {
    lambda: f32,
    halves: Halves,
    layers: Vec<Range<usize>>,
    smoothed: Vec<f32>,
    carry: Vec<f32>,
    received: Vec<bool>,
    next_step: u64,
    /// Decoded (index, value) pairs of the current step's pushes.
    scratch: Vec<(u32, f32)>,
    /// Where each push's pairs end in `scratch`.
    bounds: Vec<usize>,
    /// The half's values of the current output.
    values: Vec<f32>,
}

/// What a checkpoint must hold of a [`MipdServer`] ([`MipdServer::export_state`]): the
/// smoothed aggregate, the carry of gradients pushed but not yet sent back, the received
/// marks and the next step. The configuration (λ, halves, layers) is not part of it: it
/// comes from the run's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct MipdServerState {
    /// The next step to aggregate.
    pub next_step: u64,
    /// The smoothed aggregate ĝ.
    pub smoothed: Vec<f32>,
    /// Received gradients not yet emitted (their half comes later).
    pub carry: Vec<f32>,
    /// Which coordinates were pushed since their half was last emitted.
    pub received: Vec<bool>,
}

/// Header of a decoded pull payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullInfo {
    /// Step of the aggregate.
    pub step: u64,
    /// The half it updates (`None`: every coordinate).
    pub half: Option<u8>,
}

const PULL_MAGIC: u8 = 0x4D;
const PULL_VERSION: u8 = 1;
const PULL_DENSE: u8 = 0;
const PULL_SPARSE: u8 = 1;

impl MipdServer {
    /// Elements of the shard.
    pub fn len(&self) -> usize {
        self.smoothed.len()
    }

    /// Whether the shard is empty.
    pub fn is_empty(&self) -> bool {
        self.smoothed.is_empty()
    }

    /// The shard's layers.
    pub fn layers(&self) -> &[Range<usize>] {
        &self.layers
    }

    /// The next step to aggregate.
    pub fn next_step(&self) -> u64 {
        self.next_step
    }

    /// The smoothed aggregate ĝ as last updated (per coordinate, at its half's last step).
    pub fn smoothed(&self) -> &[f32] {
        &self.smoothed
    }

    /// The state a checkpoint must hold (see [`MipdServerState`]).
    pub fn export_state(&self) -> MipdServerState {
        MipdServerState {
            next_step: self.next_step,
            smoothed: self.smoothed.clone(),
            carry: self.carry.clone(),
            received: self.received.clone(),
        }
    }

    /// Restores [`MipdServer::export_state`] into a server of the same shard length; the
    /// next aggregated step must then be `state.next_step`. On error nothing changes.
    pub fn import_state(&mut self, state: MipdServerState) -> Result<(), ConfigError> {
        let n = self.len();
        for (what, len) in [
            ("smoothed", state.smoothed.len()),
            ("carry", state.carry.len()),
            ("received", state.received.len()),
        ] {
            if len != n {
                return Err(ConfigError::new(
                    "state",
                    format!("{what} has {len} values, the shard has {n}"),
                ));
            }
        }
        self.next_step = state.next_step;
        self.smoothed = state.smoothed;
        self.carry = state.carry;
        self.received = state.received;
        Ok(())
    }

    /// Aggregates `step` from the workers' pushes (payloads of [`Mipd`], in worker order)
    /// and writes the pull payload into `out` (cleared). Every push is decoded and checked
    /// (method, length, the shard's layer table, body) before any state changes.
    ///
    /// [`Mipd`]: crate::mipd::Mipd
    pub fn aggregate(
        &mut self,
        step: u64,
        pushes: &[&[u8]],
        out: &mut Vec<u8>,
    ) -> Result<(), MipdServerError> {
        if step != self.next_step {
            return Err(MipdServerError::OutOfOrder {
                expected: self.next_step,
                got: step,
            });
        }
        let n = self.len();
        self.scratch.clear();
        self.bounds.clear();
        for (index, p) in pushes.iter().enumerate() {
            self.decode_push(p, n)
                .map_err(|source| MipdServerError::Push { index, source })?;
            self.bounds.push(self.scratch.len());
        }
        // Commit: sum in worker order into the carry.
        for &(i, v) in &self.scratch {
            let i = i as usize;
            self.carry[i] += v;
            self.received[i] = true;
        }
        // Smooth and emit the half.
        let half = self.halves.half(step);
        let lambda = self.lambda;
        let (smoothed, carry, received, values) = (
            &mut self.smoothed,
            &mut self.carry,
            &mut self.received,
            &mut self.values,
        );
        values.clear();
        values.resize(self.halves.count(&self.layers, half), 0.0);
        let mut at = 0;
        self.halves.for_each_run(&self.layers, half, |run, stride| {
            let len = run.len().div_ceil(stride);
            let out = &mut values[at..at + len];
            at += len;
            let (s, c, r) = (
                &mut smoothed[run.clone()],
                &mut carry[run.clone()],
                &mut received[run],
            );
            if stride == 1 {
                smooth_run(s.iter_mut(), c.iter_mut(), r.iter_mut(), out, lambda);
            } else {
                let (s, c, r) = (
                    s.iter_mut().step_by(stride),
                    c.iter_mut().step_by(stride),
                    r.iter_mut().step_by(stride),
                );
                smooth_run(s, c, r, out, lambda);
            }
        });
        encode_pull(step, half, &self.values, out);
        self.next_step += 1;
        Ok(())
    }

    fn decode_push(&mut self, bytes: &[u8], n: usize) -> Result<(), WireError> {
        let (mut r, segs) = read_frame(MipdConfig::ID, bytes, n)?;
        let expected: &[Range<usize>] = if n == 0 { &[] } else { &self.layers };
        if segs != expected {
            return Err(WireError::BadSegments(
                "push layers differ from the shard's layers",
            ));
        }
        for s in &segs {
            let base = s.start;
            let scratch = &mut self.scratch;
            decode_layer(&mut r, s.len(), |i, v| scratch.push(((base + i) as u32, v)))?;
        }
        if r.remaining() != 0 {
            return Err(WireError::TrailingBytes(r.remaining()));
        }
        Ok(())
    }
}

/// The smoothing rule over one run: `ĝ = carry` where received, else `λ·ĝ` (`+ 0.0`, so
/// that λ = 0 gives +0 rather than −0 and the rule stays branch-free); carry and marks are
/// reset. Carry is 0 wherever nothing was received, so it is reset unconditionally.
#[inline(always)]
fn smooth_run<'a>(
    s: impl Iterator<Item = &'a mut f32>,
    c: impl Iterator<Item = &'a mut f32>,
    r: impl Iterator<Item = &'a mut bool>,
    out: &mut [f32],
    lambda: f32,
) {
    for (((s, c), r), o) in s.zip(c).zip(r).zip(out) {
        let g = if *r { *c } else { lambda * *s + 0.0 };
        *s = g;
        *c = 0.0;
        *r = false;
        *o = g;
    }
}

fn encode_pull(step: u64, half: Option<u8>, values: &[f32], out: &mut Vec<u8>) {
    out.clear();
    let m = values.len();
    let nnz = values.iter().filter(|v| v.to_bits() != 0).count();
    let sparse = 8 * m.div_ceil(8) as u64 + 32 * (nnz as u64) < 32 * m as u64;
    let mut w = Writer::new(out);
    w.u8(PULL_MAGIC);
    w.u8(PULL_VERSION);
    w.u8(half.unwrap_or(2));
    w.u8(if sparse { PULL_SPARSE } else { PULL_DENSE });
    w.u64(step);
    w.u32(m as u32);
    if sparse {
        // Branch-free: the bitmap a byte at a time, the values by compaction (every value
        // is written, the cursor advances only past non-zero ones; 4 bytes of slack).
        let bm = w.zeroed(m.div_ceil(8));
        for (byte, chunk) in bm.iter_mut().zip(values.chunks(8)) {
            let mut b = 0u8;
            for (i, v) in chunk.iter().enumerate() {
                b |= u8::from(v.to_bits() != 0) << i;
            }
            *byte = b;
        }
        let vals = w.zeroed(4 * nnz + 4);
        let mut at = 0;
        for v in values {
            vals[at..at + 4].copy_from_slice(&v.to_le_bytes());
            at += 4 * usize::from(v.to_bits() != 0);
        }
        debug_assert_eq!(at, 4 * nnz);
        out.truncate(out.len() - 4);
    } else {
        let b = w.zeroed(4 * m);
        for (o, v) in b.chunks_exact_mut(4).zip(values) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// Decodes a pull payload of [`MipdServer::aggregate`] for a shard laid out in `layers`
/// (the server's, tiling `0..out.len()`) with half rule `halves`, **overwriting** `out`:
/// the updated half gets its values, every other coordinate 0 (not updated this step).
/// Validates everything; never panics.
pub fn decode_pull(
    halves: Halves,
    layers: &[Range<usize>],
    bytes: &[u8],
    out: &mut [f32],
) -> Result<PullInfo, WireError> {
    let n = out.len();
    let layers = effective_segments(n, layers)
        .map_err(|_| WireError::BadSegments("layers do not tile the output"))?;
    let mut r = Reader::new(bytes);
    if r.u8("pull magic")? != PULL_MAGIC {
        return Err(WireError::Invalid("not a mipd pull payload"));
    }
    let v = r.u8("pull version")?;
    if v != PULL_VERSION {
        return Err(WireError::UnsupportedVersion(v));
    }
    let half = match r.u8("pull half")? {
        h @ (0 | 1) => Some(h),
        2 => None,
        _ => return Err(WireError::Invalid("mipd pull: bad half")),
    };
    let layout = r.u8("pull layout")?;
    let step = r.u64("pull step")?;
    if half != halves.half(step) {
        return Err(WireError::Invalid(
            "mipd pull: half does not match the step",
        ));
    }
    let m = r.u32("pull value count")? as usize;
    if m != halves.count(&layers, half) {
        return Err(WireError::LengthMismatch {
            payload: m,
            buffer: halves.count(&layers, half),
        });
    }
    let mut next_value: Box<dyn FnMut() -> Result<f32, WireError>> = match layout {
        PULL_DENSE => {
            let vals = r.take_items(m, 4, "pull values")?;
            let mut i = 0;
            Box::new(move || {
                let v = f32_at(vals, i);
                i += 1;
                Ok(v)
            })
        }
        PULL_SPARSE => {
            let bm = r.take(m.div_ceil(8), "pull bitmap")?;
            if !m.is_multiple_of(8) && (bm[bm.len() - 1] >> (m % 8)) != 0 {
                return Err(WireError::Invalid("mipd pull: bitmap bits past the end"));
            }
            let nnz: usize = bm.iter().map(|b| b.count_ones() as usize).sum();
            let vals = r.take_items(nnz, 4, "pull values")?;
            let (mut i, mut j) = (0usize, 0usize);
            Box::new(move || {
                let set = bm[i >> 3] >> (i & 7) & 1 == 1;
                i += 1;
                if set {
                    let v = f32_at(vals, j);
                    j += 1;
                    if v.to_bits() == 0 {
                        return Err(WireError::Invalid("mipd pull: explicit zero value"));
                    }
                    Ok(v)
                } else {
                    Ok(0.0)
                }
            })
        }
        _ => return Err(WireError::Invalid("mipd pull: unknown layout")),
    };
    if r.remaining() != 0 {
        return Err(WireError::TrailingBytes(r.remaining()));
    }
    out.fill(0.0);
    let mut err = None;
    halves.for_each(&layers, half, |j| {
        if err.is_none() {
            match next_value() {
                Ok(v) if v.is_finite() => out[j] = v,
                Ok(_) => err = Some(WireError::Invalid("mipd pull: non-finite value")),
                Err(e) => err = Some(e),
            }
        }
    });
    match err {
        Some(e) => Err(e),
        None => Ok(PullInfo { step, half }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::decompress_add;
    use crate::mipd::tests::sample;
    use crate::mipd::{Mipd, MipdConfig};
    use proptest::prelude::{
        any, prop, prop_assert, prop_assert_eq, prop_oneof, proptest, Just, ProptestConfig,
    };

    /// Encodes worker `wk`'s push of `step` for a model of `n` elements.
    fn push(c: &mut Mipd, n: usize, layers: &[Range<usize>], step: u64, wk: u64) -> Vec<u8> {
        let w = sample(0, n, 0.1, 1000 + wk);
        let g = sample((step + wk) as usize % 3, n, 0.01, step * 31 + wk);
        let mut bytes = Vec::new();
        c.encode(&w, &g, layers, &mut bytes).unwrap();
        bytes
    }

    #[test]
    fn smoothing_with_lambda_zero_is_plain_sparsification() {
        let (n, layers) = (1500usize, vec![0..1000, 1000..1001, 1001..1500]);
        for halves in [Halves::Off, Halves::Blocked, Halves::Interleaved] {
            let mut c = MipdConfig {
                max_ratio: 0.2,
                ..MipdConfig::default()
            }
            .init()
            .unwrap();
            let mut server = MipdServerConfig {
                lambda: 0.0,
                halves,
            }
            .init(n, &layers)
            .unwrap();
            let mut prev: Vec<Vec<u8>> = Vec::new();
            let mut pull = Vec::new();
            for step in 0..6u64 {
                let pushes: Vec<Vec<u8>> = (0..3)
                    .map(|wk| push(&mut c, n, &layers, step, wk))
                    .collect();
                let refs: Vec<&[u8]> = pushes.iter().map(Vec::as_slice).collect();
                server.aggregate(step, &refs, &mut pull).unwrap();
                let mut got = vec![f32::NAN; n];
                let info = decode_pull(halves, &layers, &pull, &mut got).unwrap();
                assert_eq!(
                    info,
                    PullInfo {
                        step,
                        half: halves.half(step)
                    }
                );
                // Reference: the sparse pushes summed in worker order (with halves: the
                // previous step's too, which the other half deferred), restricted to H_t.
                let mut want = vec![0f32; n];
                if halves != Halves::Off {
                    for p in &prev {
                        decompress_add(&c, p, &mut want).unwrap();
                    }
                }
                for p in &pushes {
                    decompress_add(&c, p, &mut want).unwrap();
                }
                let mut masked = vec![0f32; n];
                halves.for_each(&layers, halves.half(step), |j| masked[j] = want[j]);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&masked), "{halves:?} step {step}");
                prev = pushes;
            }
            // λ = 0 pulls are as sparse as the pushes.
            assert_eq!(pull[3], PULL_SPARSE);
        }
    }

    #[test]
    fn smoothing_decays_dropped_coordinates() {
        // One layer of 4; worker sends entry 1 at step 0 only, entry 0 at every step.
        let cfg = MipdConfig {
            min_ratio: 0.25,
            max_ratio: 0.5,
            mass: 1.0,
            ..MipdConfig::default()
        };
        let mut c = cfg.init().unwrap();
        let mut server = MipdServerConfig {
            lambda: 0.5,
            halves: Halves::Off,
        }
        .init(4, &[])
        .unwrap();
        let w = [1.0f32; 4];
        let mut pull = Vec::new();
        let mut got = [0f32; 4];
        let mut bytes = Vec::new();
        c.encode(&w, &[3.0, 2.0, 0.0, 0.0], &[], &mut bytes)
            .unwrap();
        server.aggregate(0, &[&bytes], &mut pull).unwrap();
        decode_pull(Halves::Off, &[], &pull, &mut got).unwrap();
        assert_eq!(got, [3.0, 2.0, 0.0, 0.0]);
        c.encode(&w, &[1.0, 0.0, 0.0, 0.0], &[], &mut bytes)
            .unwrap();
        server.aggregate(1, &[&bytes], &mut pull).unwrap();
        decode_pull(Halves::Off, &[], &pull, &mut got).unwrap();
        assert_eq!(got, [1.0, 1.0, 0.0, 0.0]);
        server.aggregate(2, &[&bytes], &mut pull).unwrap();
        decode_pull(Halves::Off, &[], &pull, &mut got).unwrap();
        assert_eq!(got, [1.0, 0.5, 0.0, 0.0]);
        assert_eq!(server.smoothed(), &got);
        // Halves: coordinate 3 (second half) received at step 0 is applied at step 1.
        let mut server = MipdServerConfig {
            lambda: 0.5,
            halves: Halves::Blocked,
        }
        .init(4, &[])
        .unwrap();
        c.encode(&w, &[0.0, 0.0, 0.0, 5.0], &[], &mut bytes)
            .unwrap();
        server.aggregate(0, &[&bytes], &mut pull).unwrap();
        decode_pull(Halves::Blocked, &[], &pull, &mut got).unwrap();
        assert_eq!(got, [0.0; 4]);
        c.encode(&w, &[0.0, 0.0, 0.0, 0.0], &[], &mut bytes)
            .unwrap();
        server.aggregate(1, &[&bytes], &mut pull).unwrap();
        decode_pull(Halves::Blocked, &[], &pull, &mut got).unwrap();
        assert_eq!(got, [0.0, 0.0, 0.0, 5.0]);
        server.aggregate(2, &[&bytes], &mut pull).unwrap();
        server.aggregate(3, &[&bytes], &mut pull).unwrap();
        decode_pull(Halves::Blocked, &[], &pull, &mut got).unwrap();
        assert_eq!(got, [0.0, 0.0, 0.0, 2.5]);
    }

    #[test]
    fn alternating_halves_cover_every_parameter_once_every_two_steps() {
        let layer_sets: [&[Range<usize>]; 4] = [
            std::slice::from_ref(&(0..1)),
            std::slice::from_ref(&(0..7)),
            &[0..4, 4..5, 5..12, 12..13],
            &[0..1000, 1000..1001, 1001..1502],
        ];
        for layers in layer_sets {
            let n = layers.last().unwrap().end;
            for halves in [Halves::Blocked, Halves::Interleaved] {
                for t in 0..4u64 {
                    let mut hits = vec![0u32; n];
                    for s in [t, t + 1] {
                        let h = halves.half(s);
                        assert_eq!(h, Some((s % 2) as u8));
                        let mut count = 0;
                        let mut last = None;
                        halves.for_each(layers, h, |j| {
                            hits[j] += 1;
                            count += 1;
                            assert!(last < Some(j), "ascending");
                            last = Some(j);
                        });
                        assert_eq!(count, halves.count(layers, h));
                    }
                    assert!(hits.iter().all(|&c| c == 1), "{halves:?} {layers:?} t {t}");
                }
                // Each half is about half of every layer.
                for l in layers {
                    let mut c0 = 0;
                    halves.for_each(std::slice::from_ref(l), Some(0), |_| c0 += 1);
                    assert_eq!(c0, l.len().div_ceil(2));
                }
            }
            let mut all = 0;
            Halves::Off.for_each(layers, Halves::Off.half(3), |_| all += 1);
            assert_eq!(all, n);
        }
    }

    #[test]
    fn server_rejects_bad_pushes_without_changing_state() {
        let layers = vec![0..60, 60..100];
        let mut c = MipdConfig::default().init().unwrap();
        let mut server = MipdServerConfig::default().init(100, &layers).unwrap();
        let good = push(&mut c, 100, &layers, 0, 0);
        let mut pull = Vec::new();
        let other_layers = push(&mut c, 100, &[0..50, 50..100], 0, 1);
        let e = server
            .aggregate(0, &[&good, &other_layers], &mut pull)
            .unwrap_err();
        assert!(matches!(e, MipdServerError::Push { index: 1, .. }), "{e}");
        let short = push(&mut c, 99, &[0..60, 60..99], 0, 1);
        assert!(server.aggregate(0, &[&good, &short], &mut pull).is_err());
        let mut wrong_method = good.clone();
        wrong_method[2] = <crate::topk::TopKConfig as Method>::ID.0;
        assert!(server.aggregate(0, &[&wrong_method], &mut pull).is_err());
        assert_eq!(
            server.aggregate(1, &[&good], &mut pull).unwrap_err(),
            MipdServerError::OutOfOrder {
                expected: 0,
                got: 1
            }
        );
        assert_eq!(server.next_step(), 0);
        assert!(server.smoothed().iter().all(|&x| x == 0.0));
        // A fresh server fed only the good push agrees bit for bit with the one that saw
        // the rejected steps.
        server.aggregate(0, &[&good], &mut pull).unwrap();
        let mut fresh = MipdServerConfig::default().init(100, &layers).unwrap();
        let mut pull2 = Vec::new();
        fresh.aggregate(0, &[&good], &mut pull2).unwrap();
        assert_eq!(pull, pull2);
        // Pulls for another layout or half are rejected.
        let mut out = vec![0f32; 100];
        assert!(decode_pull(Halves::Interleaved, &[0..31, 31..100], &pull, &mut out).is_err());
        assert!(decode_pull(Halves::Off, &layers, &pull, &mut out).is_err());
        assert!(decode_pull(Halves::Blocked, &layers, &pull, &mut out[..99]).is_err());
        decode_pull(Halves::Blocked, &layers, &pull, &mut out).unwrap();
    }

    #[test]
    fn a_restored_server_continues_bit_for_bit() {
        let (n, layers) = (200usize, vec![0..120, 120..200]);
        let cfg = MipdServerConfig {
            lambda: 0.5,
            halves: Halves::Interleaved,
        };
        let mut c = MipdConfig {
            max_ratio: 0.3,
            ..MipdConfig::default()
        }
        .init()
        .unwrap();
        let pushes: Vec<Vec<Vec<u8>>> = (0..7u64)
            .map(|t| (0..2).map(|wk| push(&mut c, n, &layers, t, wk)).collect())
            .collect();
        let run = |server: &mut MipdServer, steps: std::ops::Range<u64>| -> Vec<Vec<u8>> {
            steps
                .map(|t| {
                    let p: Vec<&[u8]> = pushes[t as usize].iter().map(Vec::as_slice).collect();
                    let mut out = Vec::new();
                    server.aggregate(t, &p, &mut out).unwrap();
                    out
                })
                .collect()
        };
        let mut straight = cfg.init(n, &layers).unwrap();
        let all = run(&mut straight, 0..7);
        // Stop after an odd number of steps: the carry holds the half not yet emitted.
        let mut first = cfg.init(n, &layers).unwrap();
        let mut pulls = run(&mut first, 0..3);
        let state = first.export_state();
        assert_eq!(state.next_step, 3);
        assert!(state.received.iter().any(|&r| r), "nothing carried over");
        let mut resumed = cfg.init(n, &layers).unwrap();
        resumed.import_state(state.clone()).unwrap();
        pulls.extend(run(&mut resumed, 3..7));
        assert_eq!(pulls, all);
        assert_eq!(resumed.export_state(), straight.export_state());
        // A state of another shard length is refused and changes nothing.
        let mut other = cfg.init(n + 1, &[0..120, 120..201]).unwrap();
        let e = other.import_state(state).unwrap_err();
        assert!(e.to_string().contains("the shard has 201"), "{e}");
        assert_eq!(other.next_step(), 0);
    }

    fn valid_pull(halves: Halves, lambda: f64, step: u64) -> Vec<u8> {
        let layers = [0..30, 30..45];
        let mut c = MipdConfig {
            max_ratio: 0.5,
            ..MipdConfig::default()
        }
        .init()
        .unwrap();
        let mut s = MipdServerConfig { lambda, halves }
            .init(45, &layers)
            .unwrap();
        let mut pull = Vec::new();
        for t in 0..=step {
            let p = push(&mut c, 45, &layers, t, 0);
            s.aggregate(t, &[&p], &mut pull).unwrap();
        }
        pull
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

        #[test]
        fn pulls_survive_mutation_and_round_trip(
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
            lambda in prop_oneof![Just(0.0), 0.0f64..=1.0],
            step in 0u64..4,
        ) {
            for halves in [Halves::Off, Halves::Blocked, Halves::Interleaved] {
                let mut pull = valid_pull(halves, lambda, step);
                let mut out = vec![0f32; 45];
                let info = decode_pull(halves, &[0..30, 30..45], &pull, &mut out).unwrap();
                prop_assert_eq!(info.step, step);
                for (at, b) in &flips {
                    let i = at.index(pull.len());
                    pull[i] = *b;
                }
                if decode_pull(halves, &[0..30, 30..45], &pull, &mut out).is_ok() {
                    prop_assert!(out.iter().all(|v| v.is_finite()));
                }
            }
        }
    }
}
