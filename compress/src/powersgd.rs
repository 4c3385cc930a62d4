//! `powersgd`: rank-r PowerSGD (Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank
//! Gradient Compression for Distributed Optimization", NeurIPS 2019), with the semantics of
//! PyTorch's `powerSGD_hook` (checked against its source and GRACE's `powersgd`).
//!
//! Each tensor of two or more dimensions is viewed as a matrix `M` of `m` rows (its first
//! dimension) and `c = numel / m` columns (a conv weight `out × in·kh·kw`). One step of
//! power iteration with the previous step's `Q` (`c × r`, warm start) gives its rank-r
//! approximation, with two all-reduces of small matrices instead of one of `M`:
//! ```text
//! Q ← orthogonalize(Q)       (as the hook does before every use)
//! P = Σ_w M_w·Q              all-reduced: the summed agreement (m × r)
//! P̂ = orthogonalize(P)       Gram-Schmidt on the columns, every rank alike
//! Q_w = M_wᵀ·P̂               the payload's value lane (c × r), all-reduced
//! update = P̂·(Σ_w Q_w)ᵀ / W  the mean of the rank-r approximations
//! Q ← (Σ_w Q_w) / W          warm start of the next step
//! e_w = M_w − P̂·Q̄ᵀ           error feedback (residual memory, on by default) from the
//!                            aggregate, as in PyTorch and GRACE
//! ```
//! `Q` starts as a Gaussian matrix from the configured seed, the bucket and the tensor (the
//! same on every rank). A test checks the first two steps and the warm-started `Q` against
//! golden values of PyTorch 2.1.2's hook for a given initial `Q` (the script is in it). Tensors of one dimension, and matrices for which
//! `m·c ≤ min_compression_rate · r·(m + c)` (PyTorch's rule; the default rate 1 sends a
//! tensor dense exactly when the factors would not be smaller), are sent dense inside the
//! payload and summed as they are; so are all tensors before `start_step` (PyTorch's
//! `start_powerSGD_iter`; default 0, the paper's). The matrix is the tensor's row-major
//! layout, so a burn `Linear` weight (`[d_in, d_out]`) is the transpose of PyTorch's view
//! of the same layer (`[out, in]`): the same approximation with P and Q swapped.
//!
//! Without a multi-rank driver (one process, `dtrain bench`, a parameter server's push)
//! the method compresses alone: `P̂` comes from the worker's own `M`, and its error feedback
//! from its own approximation.
//!
//! ## Body, per segment
//! ```text
//! u8 mode                  0 dense, 1 low rank; + 2 when the lane is bfloat16
//! dense:     n × L         the values (the value lane)
//! low rank:  u32 m, u32 c, u8 r        m·c = n, 1 ≤ r ≤ min(m, c)
//!            m·r × L       P̂, row-major (identical on every rank; not a lane)
//!            c·r × L       Q_w, row-major (the value lane)
//! ```
//! `L` is a little-endian `f32`, or with `bf16 = true` a bfloat16 (rounded to nearest even;
//! the summed agreement `P` then travels and is summed as bfloat16 too, [`LaneFormat`], and
//! the payload's `P̂` is rounded alike: the decode is `round(P̂)·round(Q)ᵀ`).
//! The payload is self-contained (a receiver needs no state to decode it): `r·(m + c)`
//! values per matrix, of which the all-reduces move `m·r` (the agreement) and `c·r` (the
//! lane).

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::compressor::{summable_lanes, Aggregation, Compressor, Ctx, LaneFormat, MethodId};
use crate::error::{CompressError, ConfigError, WireError};
use crate::memory::MemoryConfig;
use crate::registry::{Method, RunUse};
use crate::rng::Rng;
use crate::wire::{Reader, Writer};

/// Configuration of [`PowerSgd`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PowerSgdConfig {
    /// Rank `r` of the approximation, 1..=64. Default 1.
    #[serde(default = "one")]
    pub rank: usize,
    /// Steps before which every tensor is sent dense (PyTorch's `start_powerSGD_iter`).
    /// Default 0.
    #[serde(default)]
    pub start_step: u64,
    /// A matrix is compressed only when `m·c > min_compression_rate · r·(m + c)`; ≥ 1.
    /// Default 1 (PyTorch's default is 2).
    #[serde(default = "one_f64")]
    pub min_compression_rate: f64,
    /// Keep `Q` from step to step (PyTorch's `warm_start`). Default true.
    #[serde(default = "yes")]
    pub warm_start: bool,
    /// Seed of the initial `Q` (the same on every rank). Default 0.
    #[serde(default)]
    pub seed: u64,
    /// Send `P` and `Q` (and the dense tensors) as bfloat16, rounded to nearest even, and
    /// sum them in bfloat16 (PyTorch's `bf16_compress_wrapper(powerSGD_hook)`): half the
    /// bytes. The power iteration itself runs in `f32` (PyTorch's wrapper casts the whole
    /// bucket, so its matrix products run in bfloat16 too). Default false.
    #[serde(default)]
    pub bf16: bool,
}

fn one() -> usize {
    1
}
fn one_f64() -> f64 {
    1.0
}
fn yes() -> bool {
    true
}

impl Default for PowerSgdConfig {
    fn default() -> Self {
        PowerSgdConfig {
            rank: 1,
            start_step: 0,
            min_compression_rate: 1.0,
            warm_start: true,
            seed: 0,
            bf16: false,
        }
    }
}

impl Method for PowerSgdConfig {
    const NAME: &'static str = "powersgd";
    const ABOUT: &'static str =
        "PowerSGD: rank-r power iteration per matrix, P and Q all-reduced, warm start, EF";
    const ID: MethodId = MethodId(22);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        if !(1..=64).contains(&self.rank) {
            return Err(ConfigError::new(
                "rank",
                format!("must be in 1..=64, got {}", self.rank),
            ));
        }
        if !(self.min_compression_rate.is_finite() && self.min_compression_rate >= 1.0) {
            return Err(ConfigError::new(
                "min_compression_rate",
                format!("must be at least 1, got {}", self.min_compression_rate),
            ));
        }
        Ok(Box::new(PowerSgd::new(self.clone())))
    }

    /// A low-rank approximation is biased: error feedback (PyTorch's default) is on.
    fn default_memory(&self) -> MemoryConfig {
        MemoryConfig::RESIDUAL
    }

    /// P and Q are all-reduced between the workers; a parameter server has no such step.
    fn check(&self, run: &RunUse<'_>) -> Result<(), ConfigError> {
        if run.parameter_server {
            return Err(ConfigError::new(
                "kind",
                "powersgd all-reduces its factors between the workers; use mode = \"allreduce\"",
            ));
        }
        Ok(())
    }
}

const DENSE: u8 = 0;
const LOW_RANK: u8 = 1;
/// Added to the mode when the value lane is bfloat16 ([`PowerSgdConfig::bf16`]).
const BF16_LANE: u8 = 2;

/// A segment's mode byte: its kind and its lane format.
fn split_mode(mode: u8) -> Result<(u8, LaneFormat), WireError> {
    let fmt = if mode & BF16_LANE != 0 {
        LaneFormat::Bf16
    } else {
        LaneFormat::F32
    };
    match mode & !BF16_LANE {
        kind @ (DENSE | LOW_RANK) => Ok((kind, fmt)),
        _ => Err(WireError::Invalid("powersgd: unknown segment mode")),
    }
}

/// Reads `n` lane values of `fmt` into `out` (cleared), refusing a non-finite one.
fn read_lane(
    r: &mut Reader<'_>,
    n: usize,
    fmt: LaneFormat,
    what: &'static str,
    out: &mut Vec<f32>,
) -> Result<(), WireError> {
    out.clear();
    fmt.read(r.take_items(n, fmt.bytes(), what)?, out);
    if out.iter().any(|v| !v.is_finite()) {
        return Err(WireError::Invalid("powersgd: non-finite value"));
    }
    Ok(())
}

/// One tensor of the bucket as PowerSGD sees it.
#[derive(Debug, Clone, PartialEq)]
enum Plan {
    /// Sent dense (one dimension, or factors not smaller).
    Dense,
    /// A matrix of `m` rows and `c` columns.
    LowRank { m: usize, c: usize },
}

/// The PowerSGD compressor of one bucket (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct PowerSgd {
    cfg: PowerSgdConfig,
    /// Per segment, from [`Compressor::set_segment_shapes`] (none known: all dense).
    plans: Vec<Plan>,
    /// Per segment: `Q` (`c × r`, row-major), empty for dense segments or before the first
    /// low-rank step.
    q: Vec<Vec<f32>>,
    /// Per segment: `P̂` (`m × r`) of the step in `installed`.
    p_hat: Vec<Vec<f32>>,
    /// The step (and bucket) whose `P̂` is installed.
    installed: Option<(u64, u64)>,
    /// Ranks exchanging (the mean of the lanes divides by it).
    world: usize,
    /// The next segment [`Compressor::encode_segment`] writes.
    next: usize,
    /// Whether the buffer being encoded is compressed (set by [`Compressor::begin`]).
    low_rank_now: bool,
    /// The standalone path's `P`, reused from step to step.
    scratch: Vec<f32>,
}

impl PowerSgd {
    /// A compressor with configuration `cfg` (validated by [`PowerSgdConfig::build`]).
    pub fn new(cfg: PowerSgdConfig) -> Self {
        PowerSgd {
            cfg,
            plans: Vec::new(),
            q: Vec::new(),
            p_hat: Vec::new(),
            installed: None,
            world: 1,
            next: 0,
            low_rank_now: false,
            scratch: Vec::new(),
        }
    }

    fn rank(&self) -> usize {
        self.cfg.rank
    }

    /// Whether step `step` compresses at all.
    fn active(&self, step: u64) -> bool {
        step >= self.cfg.start_step && self.plans.iter().any(|p| *p != Plan::Dense)
    }

    /// The segment ranges of `ctx` over a buffer of `n` elements (one covering it all when
    /// `ctx` names none), without allocating.
    fn segments<'c>(ctx: &'c Ctx<'_>, n: usize) -> impl Iterator<Item = Range<usize>> + 'c {
        let whole = ctx.segments.is_empty().then_some(0..n);
        ctx.segments.iter().cloned().chain(whole)
    }

    /// How many segments `ctx` has.
    fn segment_count(ctx: &Ctx<'_>) -> usize {
        ctx.segments.len().max(1)
    }

    /// `Q` of segment `s` (`c × r`) for `step`, orthogonalized: initialised on first use
    /// (and every step without warm start) as a Gaussian matrix from the seed, the bucket
    /// and the segment (and the step, without warm start); the same on every rank.
    fn q_of(&mut self, s: usize, c: usize, bucket: u64, step: u64) {
        let r = self.rank();
        if self.q.len() <= s {
            self.q.resize(s + 1, Vec::new());
        }
        if self.q[s].len() != c * r || !self.cfg.warm_start {
            let draw = if self.cfg.warm_start { 0 } else { step };
            let mut rng = Rng::for_step(self.cfg.seed, draw, bucket, s as u64);
            let q = &mut self.q[s];
            q.clear();
            q.extend((0..c * r).map(|_| gaussian(&mut rng)));
        }
        // Orthogonalized before every use, drawn or warm-started (PyTorch's hook does both).
        orthogonalize(&mut self.q[s], c, r);
    }

    /// `P = M·Q` of every low-rank segment of `buf`, appended to `out`.
    fn p_of(&mut self, buf: &[f32], ctx: &Ctx<'_>, out: &mut Vec<f32>) {
        let r = self.rank();
        for (s, range) in Self::segments(ctx, buf.len()).enumerate() {
            if let Some(&Plan::LowRank { m, c }) = self.plans.get(s) {
                self.q_of(s, c, ctx.bucket, ctx.step);
                let start = out.len();
                out.resize(start + m * r, 0.0);
                mat_mul(&buf[range], m, c, &self.q[s], r, &mut out[start..]);
            }
        }
    }

    /// Installs `P̂` from the (summed) `p` of every low-rank segment, in order.
    fn install(&mut self, p: &[f32], ctx: &Ctx<'_>) {
        let r = self.rank();
        self.p_hat.resize(self.plans.len(), Vec::new());
        let mut at = 0;
        for (s, plan) in self.plans.iter().enumerate() {
            if let Plan::LowRank { m, .. } = *plan {
                let ph = &mut self.p_hat[s];
                ph.clear();
                ph.extend_from_slice(&p[at..at + m * r]);
                orthogonalize(ph, m, r);
                at += m * r;
            }
        }
        self.installed = Some((ctx.step, ctx.bucket));
    }

    /// The length of the agreement message: `Σ m·r` over the low-rank segments.
    fn message_len(&self) -> usize {
        self.plans
            .iter()
            .map(|p| match p {
                Plan::LowRank { m, .. } => m * self.rank(),
                Plan::Dense => 0,
            })
            .sum()
    }
}

/// The parts of the encoder a device codec drives (`dtrain-device`'s `powersgd`): it
/// computes the products `P = M·Q` and `Q_w = Mᵀ·P̂` where the bucket lies and leaves the
/// rest — the plans, `Q`'s draw and orthogonalization, `P̂`'s Gram–Schmidt (on `m × r`
/// values), the payload's writing and the state — to this codec, so that both write the
/// same bytes.
impl PowerSgd {
    /// The start of an encode of the buffer of `ctx` (what [`Compressor::begin`] does but
    /// the products): fixes the plans against `ctx`'s segments and says whether this step
    /// compresses with no agreement installed for it, so that the caller must compute
    /// `P` ([`PowerSgd::q_for`]) and [`PowerSgd::install_p`] it first.
    pub fn begin_plans(&mut self, ctx: &Ctx<'_>) -> bool {
        self.next = 0;
        let n_segs = Self::segment_count(ctx);
        if n_segs != self.plans.len() {
            // Shapes unknown or not this buffer's: every segment dense.
            self.plans = vec![Plan::Dense; n_segs];
        }
        self.low_rank_now = self.active(ctx.step);
        self.low_rank_now && self.installed != Some((ctx.step, ctx.bucket))
    }

    /// Segment `s`'s matrix `(m, c)` when it is sent low-rank at the step begun
    /// ([`PowerSgd::begin_plans`]); `None`: sent dense.
    pub fn low_rank_shape(&self, s: usize) -> Option<(usize, usize)> {
        match self.plans.get(s) {
            Some(&Plan::LowRank { m, c }) if self.low_rank_now => Some((m, c)),
            _ => None,
        }
    }

    /// The rank `r`.
    pub fn rank_r(&self) -> usize {
        self.rank()
    }

    /// How many segments the plans cover (the tensor shapes told, or the segments of the
    /// last buffer begun).
    pub fn plan_count(&self) -> usize {
        self.plans.len()
    }

    /// `Q` of low-rank segment `s` (`c × r`, row-major) for the buffer of `ctx`, drawn or
    /// warm-started and orthogonalized, as the host's `P = M·Q` uses it.
    pub fn q_for(&mut self, s: usize, c: usize, ctx: &Ctx<'_>) -> &[f32] {
        self.q_of(s, c, ctx.bucket, ctx.step);
        &self.q[s]
    }

    /// Installs `P̂` from `p`, the `P` of every low-rank segment in order (`Σ m·r`
    /// values): Gram–Schmidt of each.
    pub fn install_p(&mut self, p: &[f32], ctx: &Ctx<'_>) {
        self.install(p, ctx);
    }

    /// `P̂` of low-rank segment `s` (`m × r`), installed.
    pub fn p_hat_of(&self, s: usize) -> &[f32] {
        &self.p_hat[s]
    }

    /// Writes low-rank segment `s` of the next segment's body: its header, the installed
    /// `P̂` and `q` (`Q_w = Mᵀ·P̂`, `c × r`), in the lane's format; `q` becomes the kept `Q`
    /// (alone, the next step starts from it; a multi-rank driver replaces it with the
    /// mean, [`Compressor::absorb_aggregate`]; without warm start the next step draws
    /// another anyway). Advances to the next segment.
    pub fn write_low_rank(&mut self, s: usize, q: Vec<f32>, w: &mut Writer<'_>) {
        let Plan::LowRank { m, c } = self.plans[s] else {
            panic!("segment {s} is not low-rank");
        };
        let r = self.rank();
        debug_assert_eq!(q.len(), c * r);
        let fmt = self.lane_format();
        let tag = if fmt == LaneFormat::Bf16 {
            BF16_LANE
        } else {
            0
        };
        w.u8(LOW_RANK | tag);
        w.u32(m as u32);
        w.u32(c as u32);
        w.u8(r as u8);
        // P̂ in the lane's format: what the agreement's all-reduce moved.
        let p_hat = &self.p_hat[s];
        fmt.write(
            &mut p_hat.iter().copied(),
            w.zeroed(p_hat.len() * fmt.bytes()),
        );
        fmt.write(&mut q.iter().copied(), w.zeroed(q.len() * fmt.bytes()));
        self.q[s] = q;
        self.next = s + 1;
    }

    /// Writes segment `s` dense: `x`, its values. Advances to the next segment.
    pub fn write_dense(&mut self, s: usize, x: &[f32], w: &mut Writer<'_>) {
        let fmt = self.lane_format();
        let tag = if fmt == LaneFormat::Bf16 {
            BF16_LANE
        } else {
            0
        };
        w.u8(DENSE | tag);
        fmt.write(&mut x.iter().copied(), w.zeroed(x.len() * fmt.bytes()));
        self.next = s + 1;
    }
}

/// One segment of a PowerSGD payload as read by [`read_segment`].
#[derive(Debug, Clone, PartialEq)]
pub enum Segment {
    /// The values, sent dense.
    Dense(Vec<f32>),
    /// A rank-`rank` approximation `P·Qᵀ` of an `m × c` matrix (both row-major).
    LowRank {
        /// Rows.
        m: usize,
        /// Columns.
        c: usize,
        /// The rank.
        rank: usize,
        /// `P̂`, `m × rank`.
        p: Vec<f32>,
        /// `Q`, `c × rank`.
        q: Vec<f32>,
    },
}

/// Reads the body of one segment of `n` elements: the host decoder's reading and its
/// errors (a device decoder adds what it says on the device).
pub fn read_segment(r: &mut Reader<'_>, n: usize) -> Result<Segment, WireError> {
    let (kind, fmt) = split_mode(r.u8("powersgd mode")?)?;
    let mut v = Vec::new();
    if kind == DENSE {
        read_lane(r, n, fmt, "powersgd dense values", &mut v)?;
        return Ok(Segment::Dense(v));
    }
    let (m, c, rank) = read_dims(r, n)?;
    let mut p = Vec::new();
    read_lane(r, m * rank, fmt, "powersgd P", &mut p)?;
    read_lane(r, c * rank, fmt, "powersgd Q", &mut v)?;
    Ok(Segment::LowRank {
        m,
        c,
        rank,
        p,
        q: v,
    })
}

/// Standard normal by Box–Muller.
fn gaussian(rng: &mut Rng) -> f32 {
    let u = rng.next_f64().max(1e-300);
    let v = rng.next_f64();
    ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
}

/// `out (rows × r) = A (rows × cols, row-major) · B (cols × r, row-major)`.
fn mat_mul(a: &[f32], rows: usize, cols: usize, b: &[f32], r: usize, out: &mut [f32]) {
    match r {
        1 => mat_mul_r::<1>(a, rows, cols, b, out),
        2 => mat_mul_r::<2>(a, rows, cols, b, out),
        4 => mat_mul_r::<4>(a, rows, cols, b, out),
        8 => mat_mul_r::<8>(a, rows, cols, b, out),
        _ => {
            for (i, o) in out.chunks_exact_mut(r).enumerate().take(rows) {
                o.fill(0.0);
                let row = &a[i * cols..(i + 1) * cols];
                for (&x, bj) in row.iter().zip(b.chunks_exact(r)) {
                    for (ok, &bk) in o.iter_mut().zip(bj) {
                        *ok += x * bk;
                    }
                }
            }
        }
    }
}

/// [`mat_mul`] for a rank known at compile time: the `R` sums of a row stay in registers.
fn mat_mul_r<const R: usize>(a: &[f32], rows: usize, cols: usize, b: &[f32], out: &mut [f32]) {
    let b = &b[..cols * R];
    for (i, o) in out.chunks_exact_mut(R).enumerate().take(rows) {
        let row = &a[i * cols..(i + 1) * cols];
        let mut acc = [0f32; R];
        for (&x, bj) in row.iter().zip(b.chunks_exact(R)) {
            for k in 0..R {
                acc[k] += x * bj[k];
            }
        }
        o.copy_from_slice(&acc);
    }
}

/// `out (cols × r) = Aᵀ · B`, with `A` `rows × cols` and `B` `rows × r` (row-major).
fn mat_t_mul(a: &[f32], rows: usize, cols: usize, b: &[f32], r: usize, out: &mut [f32]) {
    match r {
        1 => mat_t_mul_r::<1>(a, rows, cols, b, out),
        2 => mat_t_mul_r::<2>(a, rows, cols, b, out),
        4 => mat_t_mul_r::<4>(a, rows, cols, b, out),
        8 => mat_t_mul_r::<8>(a, rows, cols, b, out),
        _ => {
            out.fill(0.0);
            for i in 0..rows {
                let row = &a[i * cols..(i + 1) * cols];
                let bi = &b[i * r..(i + 1) * r];
                for (&x, oj) in row.iter().zip(out.chunks_exact_mut(r)) {
                    for (o, &bk) in oj.iter_mut().zip(bi) {
                        *o += x * bk;
                    }
                }
            }
        }
    }
}

/// [`mat_t_mul`] for a rank known at compile time.
fn mat_t_mul_r<const R: usize>(a: &[f32], rows: usize, cols: usize, b: &[f32], out: &mut [f32]) {
    let out = &mut out[..cols * R];
    out.fill(0.0);
    for i in 0..rows {
        let row = &a[i * cols..(i + 1) * cols];
        let mut bi = [0f32; R];
        bi.copy_from_slice(&b[i * R..(i + 1) * R]);
        for (&x, oj) in row.iter().zip(out.chunks_exact_mut(R)) {
            for k in 0..R {
                oj[k] += x * bi[k];
            }
        }
    }
}

/// `out (rows × c) += P (rows × r) · Qᵀ (Q: c × r)`, all row-major.
fn add_outer(p: &[f32], q: &[f32], r: usize, c: usize, out: &mut [f32]) {
    match r {
        1 => add_outer_r::<1>(p, q, c, out),
        2 => add_outer_r::<2>(p, q, c, out),
        4 => add_outer_r::<4>(p, q, c, out),
        8 => add_outer_r::<8>(p, q, c, out),
        _ => {
            for (row, pi) in out.chunks_exact_mut(c).zip(p.chunks_exact(r)) {
                for (o, qj) in row.iter_mut().zip(q.chunks_exact(r)) {
                    *o += pi.iter().zip(qj).map(|(a, b)| a * b).sum::<f32>();
                }
            }
        }
    }
}

/// [`add_outer`] for a rank known at compile time.
fn add_outer_r<const R: usize>(p: &[f32], q: &[f32], c: usize, out: &mut [f32]) {
    let q = &q[..c * R];
    for (row, pi) in out.chunks_exact_mut(c).zip(p.chunks_exact(R)) {
        let mut a = [0f32; R];
        a.copy_from_slice(pi);
        for (o, qj) in row.iter_mut().zip(q.chunks_exact(R)) {
            let mut sum = 0f32;
            for k in 0..R {
                sum += a[k] * qj[k];
            }
            *o += sum;
        }
    }
}

/// Gram-Schmidt on the `r` columns of `a` (`rows × r`, row-major), in place, as PyTorch's
/// `_orthogonalize` (each column normalized, then removed from the later ones); sums in
/// `f64`. A column of norm 0 stays 0 (PyTorch's ε = 0 would divide by zero).
fn orthogonalize(a: &mut [f32], rows: usize, r: usize) {
    for k in 0..r {
        let norm = (0..rows)
            .map(|i| f64::from(a[i * r + k]).powi(2))
            .sum::<f64>()
            .sqrt();
        if norm > 0.0 {
            let inv = (1.0 / norm) as f32;
            for i in 0..rows {
                a[i * r + k] *= inv;
            }
        }
        for l in k + 1..r {
            let dot = (0..rows)
                .map(|i| f64::from(a[i * r + k]) * f64::from(a[i * r + l]))
                .sum::<f64>() as f32;
            for i in 0..rows {
                a[i * r + l] -= dot * a[i * r + k];
            }
        }
    }
}

impl Compressor for PowerSgd {
    fn method(&self) -> MethodId {
        PowerSgdConfig::ID
    }

    fn aggregation(&self) -> Aggregation {
        Aggregation::Summable
    }

    fn set_segment_shapes(&mut self, shapes: &[Vec<usize>]) {
        let r = self.rank() as f64;
        self.plans = shapes
            .iter()
            .map(|s| {
                let n: usize = s.iter().product();
                match s.first() {
                    Some(&m) if s.len() >= 2 && m > 0 && n > 0 => {
                        let c = n / m;
                        let (mf, cf) = (m as f64, c as f64);
                        if mf * cf > self.cfg.min_compression_rate * r * (mf + cf)
                            && self.rank() <= m.min(c)
                        {
                            Plan::LowRank { m, c }
                        } else {
                            Plan::Dense
                        }
                    }
                    _ => Plan::Dense,
                }
            })
            .collect();
        self.q.clear();
        self.p_hat.clear();
        self.installed = None;
    }

    fn set_world_size(&mut self, world: usize) {
        self.world = world.max(1);
    }

    fn begin(&mut self, grad: &[f32], ctx: &Ctx<'_>) {
        if self.begin_plans(ctx) {
            // No agreement for this step: compress alone (P̂ from this worker's M).
            let mut p = std::mem::take(&mut self.scratch);
            p.clear();
            self.p_of(grad, ctx, &mut p);
            self.install(&p, ctx);
            self.scratch = p;
        }
    }

    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        let s = self.next;
        match self.plans.get(s) {
            Some(&Plan::LowRank { m, c }) if self.low_rank_now && x.len() == m * c => {
                let r = self.rank();
                // Q_w goes into the kept Q (see `write_low_rank`).
                let mut q = std::mem::take(&mut self.q[s]);
                q.resize(c * r, 0.0);
                mat_t_mul(x, m, c, &self.p_hat[s], r, &mut q);
                self.write_low_rank(s, q, w);
            }
            _ => self.write_dense(s, x, w),
        }
    }

    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        match read_segment(r, out.len())? {
            Segment::Dense(v) => {
                for (o, x) in out.iter_mut().zip(&v) {
                    *o += x;
                }
            }
            Segment::LowRank { c, rank, p, q, .. } => add_outer(&p, &q, rank, c, out),
        }
        Ok(())
    }

    fn segment_bits(&self, _n: usize) -> Option<u64> {
        // Depends on the tensor's shape, not only on its length.
        None
    }

    fn segment_lane(&self, r: &mut Reader<'_>, n: usize) -> Result<Range<usize>, WireError> {
        let (kind, fmt) = split_mode(r.u8("powersgd mode")?)?;
        if fmt != self.lane_format() {
            return Err(WireError::Invalid(
                "powersgd: the lane's format is not this compressor's (bf16 differs)",
            ));
        }
        let len = if kind == DENSE {
            n
        } else {
            let (m, c, rank) = read_dims(r, n)?;
            r.take_items(m * rank, fmt.bytes(), "powersgd P")?;
            c * rank
        };
        let start = r.position();
        r.take_items(len, fmt.bytes(), "powersgd lane")?;
        Ok(start..r.position())
    }

    fn lane_format(&self) -> LaneFormat {
        if self.cfg.bf16 {
            LaneFormat::Bf16
        } else {
            LaneFormat::F32
        }
    }

    fn summed_agreement(&self, ctx: &Ctx<'_>) -> Option<usize> {
        self.active(ctx.step).then(|| self.message_len())
    }

    fn sum_message(
        &mut self,
        compensated: &[f32],
        ctx: &Ctx<'_>,
        out: &mut Vec<f32>,
    ) -> Result<(), CompressError> {
        let n_segs = Self::segment_count(ctx);
        if n_segs != self.plans.len() {
            return Err(CompressError::Agreement(format!(
                "powersgd: {n_segs} segments, {} tensor shapes",
                self.plans.len()
            )));
        }
        out.clear();
        self.p_of(compensated, ctx, out);
        Ok(())
    }

    fn install_sum(
        &mut self,
        summed: &[f32],
        _n: usize,
        ctx: &Ctx<'_>,
    ) -> Result<(), CompressError> {
        if summed.len() != self.message_len() {
            return Err(CompressError::Agreement(format!(
                "powersgd: summed P has {} values, the bucket's matrices {}",
                summed.len(),
                self.message_len()
            )));
        }
        if let Some(i) = summed.iter().position(|v| !v.is_finite()) {
            return Err(CompressError::Agreement(format!(
                "powersgd: summed P is not finite at {i}"
            )));
        }
        self.install(summed, ctx);
        Ok(())
    }

    fn absorbs_aggregate(&self, ctx: &Ctx<'_>) -> bool {
        self.cfg.warm_start && self.active(ctx.step)
    }

    fn absorb_aggregate(&mut self, summed: &[u8], ctx: &Ctx<'_>) {
        if !self.absorbs_aggregate(ctx) {
            return;
        }
        // The lanes of the summed payload: Σ_w Q_w for the low-rank segments.
        let Ok(lanes) = summable_lanes(self, summed) else {
            return;
        };
        let inv = 1.0 / self.world as f32;
        let fmt = self.lane_format();
        let mut sum = Vec::new();
        for (s, lane) in lanes.into_iter().enumerate() {
            if let Some(Plan::LowRank { .. }) = self.plans.get(s) {
                let b = &summed[lane];
                if self
                    .q
                    .get(s)
                    .is_some_and(|q| q.len() * fmt.bytes() == b.len())
                {
                    sum.clear();
                    fmt.read(b, &mut sum);
                    for (q, &v) in self.q[s].iter_mut().zip(&sum) {
                        *q = v * inv;
                    }
                }
            }
        }
    }

    fn feedback_from_aggregate(&self) -> bool {
        true
    }

    /// The warm-started `Q` of every low-rank segment (`q/<segment>/<index>`), so that a
    /// resumed run continues from it.
    fn export_state(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for (s, q) in self.q.iter().enumerate() {
            for (i, &v) in q.iter().enumerate() {
                out.insert(format!("q/{s}/{i}"), f64::from(v));
            }
        }
        out
    }

    fn import_state(&mut self, state: &BTreeMap<String, f64>) -> Result<(), String> {
        let r = self.rank();
        let mut q: Vec<Vec<f32>> = vec![Vec::new(); self.plans.len()];
        for (k, &v) in state {
            let bad = || format!("powersgd state: unexpected entry {k:?}");
            let mut parts = k.strip_prefix("q/").ok_or_else(bad)?.split('/');
            let s: usize = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
            let i: usize = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
            let Some(&Plan::LowRank { c, .. }) = self.plans.get(s) else {
                return Err(format!(
                    "powersgd state: segment {s} is not a low-rank matrix"
                ));
            };
            if i >= c * r || !v.is_finite() {
                return Err(bad());
            }
            q[s].resize(c * r, f32::NAN);
            q[s][i] = v as f32;
        }
        if let Some(s) = q.iter().position(|v| v.iter().any(|x| x.is_nan())) {
            return Err(format!("powersgd state: Q of segment {s} is incomplete"));
        }
        self.q = q;
        Ok(())
    }
}

/// Reads and checks a low-rank segment's dimensions against its length `n`.
fn read_dims(r: &mut Reader<'_>, n: usize) -> Result<(usize, usize, usize), WireError> {
    let m = r.u32("powersgd rows")? as usize;
    let c = r.u32("powersgd columns")? as usize;
    let rank = r.u8("powersgd rank")? as usize;
    if m == 0 || c == 0 || m.checked_mul(c) != Some(n) {
        return Err(WireError::Invalid(
            "powersgd: matrix shape does not fit the tensor",
        ));
    }
    if rank == 0 || rank > m.min(c) {
        return Err(WireError::Invalid("powersgd: bad rank"));
    }
    Ok((m, c, rank))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, sum_lanes, Payload};

    /// `m × c` with singular values `σ_k = 0.5^k`, k < `rank`, and orthonormal factors.
    fn decaying(m: usize, c: usize, rank: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::seed_from_u64(seed);
        let mut u: Vec<f32> = (0..m * rank).map(|_| gaussian(&mut rng)).collect();
        let mut v: Vec<f32> = (0..c * rank).map(|_| gaussian(&mut rng)).collect();
        orthogonalize(&mut u, m, rank);
        orthogonalize(&mut v, c, rank);
        let mut a = vec![0f32; m * c];
        for i in 0..m {
            for j in 0..c {
                a[i * c + j] = (0..rank)
                    .map(|k| 0.5f32.powi(k as i32) * u[i * rank + k] * v[j * rank + k])
                    .sum();
            }
        }
        a
    }

    fn rel_err(a: &[f32], b: &[f32]) -> f64 {
        let d: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
        let n: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
        (d / n).sqrt()
    }

    /// `bf16 = true`: the lanes (Q_w, dense tensors) travel as bfloat16 — half the lane
    /// bytes — and decode to the f32 path's values rounded to bfloat16; their sums are
    /// rounded too; a lane of the other format is refused; random bodies never panic.
    #[test]
    fn bf16_lanes_halve_the_lane_bytes_and_round_to_bfloat16() {
        let (m, c, r) = (16usize, 12usize, 2usize);
        let shapes = [vec![m, c], vec![5]];
        let mk = |bf16| {
            let mut k = PowerSgd::new(PowerSgdConfig {
                rank: r,
                bf16,
                ..PowerSgdConfig::default()
            });
            k.set_segment_shapes(&shapes);
            k
        };
        let (mut a, mut b) = (mk(false), mk(true));
        assert_eq!(
            (a.lane_format(), b.lane_format()),
            (LaneFormat::F32, LaneFormat::Bf16)
        );
        let mut g = decaying(m, c, r, 3);
        g.extend([0.1f32, -2.5, 3.25, 1e-3, 7.0]);
        let segs = [0..m * c, m * c..m * c + 5];
        let ctx = Ctx {
            segments: &segs,
            ..Ctx::default()
        };
        let pa = compress_new(&mut a, &g, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        let pb = compress_new(&mut b, &g, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        let lane_bytes = |k: &PowerSgd, p: &Payload| -> usize {
            summable_lanes(k, p.as_bytes())
                .unwrap()
                .iter()
                .map(|l| l.len())
                .sum()
        };
        assert_eq!(lane_bytes(&a, &pa), 4 * (c * r + 5));
        assert_eq!(lane_bytes(&b, &pb), 2 * (c * r + 5));
        // The bf16 decode is round(P̂)·round(Q)ᵀ and round(bias): the f32 one, rounded.
        let (mut da, mut db) = (vec![0f32; g.len()], vec![0f32; g.len()]);
        decompress(&a, pa.as_bytes(), &mut da).unwrap();
        decompress(&b, pb.as_bytes(), &mut db).unwrap();
        let mut want = vec![0f32; m * c];
        let round =
            |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| LaneFormat::Bf16.round(x)).collect() };
        add_outer(&round(&a.p_hat[0]), &round(&a.q[0]), r, c, &mut want);
        assert_eq!(&db[..m * c], &want[..]);
        for i in 0..5 {
            assert_eq!(db[m * c + i], LaneFormat::Bf16.round(g[m * c + i]));
        }
        assert!(da != db, "the f32 path should differ from the rounded one");
        // Summing two bf16 payloads rounds the sums to bfloat16.
        let mut acc = pb.as_bytes().to_vec();
        sum_lanes(&b, &mut acc, pb.as_bytes()).unwrap();
        let mut twice = vec![0f32; g.len()];
        decompress(&b, &acc, &mut twice).unwrap();
        for i in 0..5 {
            let one = LaneFormat::Bf16.round(g[m * c + i]);
            assert_eq!(twice[m * c + i], LaneFormat::Bf16.round(one + one));
        }
        // A payload of the other format has no lanes for this compressor.
        assert!(summable_lanes(&b, pa.as_bytes()).is_err());
        assert!(summable_lanes(&a, pb.as_bytes()).is_err());
        // Unknown modes and arbitrary bytes are refused without a panic.
        let mut out = vec![0f32; 20];
        assert!(b
            .decode_segment_add(&mut Reader::new(&[4, 0, 0]), &mut out)
            .is_err());
        let mut rng = Rng::seed_from_u64(5);
        for len in 0..200 {
            let body: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            let _ = b.decode_segment_add(&mut Reader::new(&body), &mut out);
            let _ = b.segment_lane(&mut Reader::new(&body), 20);
        }
    }

    fn compressor(rank: usize, shape: &[usize]) -> PowerSgd {
        let mut c = PowerSgd::new(PowerSgdConfig {
            rank,
            ..PowerSgdConfig::default()
        });
        c.set_segment_shapes(&[shape.to_vec()]);
        c
    }

    // Golden values from PyTorch 2.1.2's `powerSGD_hook`, generated by this script (python3,
    // `pip install torch==2.1.2`):
    // # Golden values for compress/src/powersgd.rs: PyTorch 2.1.2's powerSGD_hook through DDP on
    // # two gloo ranks with the same gradient M (so the mean is that of one worker), rank 2,
    // # start_powerSGD_iter 2, error feedback and warm start on, the initial Q given.
    // import os, struct, torch, torch.distributed as dist, torch.multiprocessing as mp, torch.nn as nn
    // from torch.nn.parallel import DistributedDataParallel as DDP
    // from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
    //
    // def f32_repr(x):
    //     # The shortest decimal that reads back as the same f32.
    //     for digits in range(1, 10):
    //         t = f"{x:.{digits}g}"
    //         if struct.unpack("f", struct.pack("f", float(t)))[0] == x:
    //             return t if ("." in t or "e" in t) else t + ".0"
    //     return repr(x)
    //
    // def run(rank):
    //     os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = "29533"
    //     dist.init_process_group("gloo", rank=rank, world_size=2)
    //     m, c, r = 12, 10, 2
    //     M = torch.tensor([[((i * 7 + j * 3) % 11 - 5) / 4 for j in range(c)] for i in range(m)])
    //     Q0 = torch.tensor([[((j * 5 + k * 3) % 7 - 3) / 2 for k in range(r)] for j in range(c)])
    //     lin = nn.Linear(c, m, bias=False)
    //     model = DDP(lin)
    //     state = ph.PowerSGDState(process_group=None, matrix_approximation_rank=r,
    //                              start_powerSGD_iter=2, min_compression_rate=2,
    //                              use_error_feedback=True, warm_start=True)
    //     model.register_comm_hook(state, ph.powerSGD_hook)
    //     out = []
    //     for it in range(4):
    //         if it == 2:
    //             # Warm-start state present: the hook orthogonalizes this Q instead of drawing one.
    //             state.p_memory_dict[0] = torch.zeros(m * r)
    //             state.q_memory_dict[0] = Q0.clone().reshape(-1)
    //         model.zero_grad()
    //         # model(I) = Wᵀ, so d/dW of sum(Wᵀ ∘ Mᵀ) is M (DDP syncs only after its forward).
    //         (model(torch.eye(c)) * M.t()).sum().backward()
    //         out.append(lin.weight.grad.clone().reshape(-1))
    //     if rank == 0:
    //         for name, v in (("STEP2", out[2]), ("STEP3", out[3]), ("Q_AFTER", state.q_memory_dict[0])):
    //             print(f"const {name}: [f32; {v.numel()}] = [" + ", ".join(f32_repr(float(x)) for x in v) + "];")
    //     dist.destroy_process_group()
    //
    // if __name__ == "__main__":
    //     mp.spawn(run, nprocs=2)
    #[rustfmt::skip]
    const STEP2: [f32; 120] = [
        -0.018768415, -0.7146096, 0.2578933, 0.6442737, -0.49778444, -0.48474145, 0.4739649,
        0.5661881, -0.7189572, -0.06167555, 0.40486482, 0.4891341, -0.63260734, -0.22664067,
        0.52631724, 0.21142447, -0.6120832, 0.019203603, 0.5940983, -0.35810477, -0.7726596,
        0.0866338, 0.8703164, -0.5018304, -0.30653352, 0.29671183, 0.51119125, -0.87268984,
        -0.11444807, 0.79882324, 0.5736356, -1.1544212, -0.28604314, 1.3710307, -0.51821613,
        -0.96852475, 0.3224847, 1.5412985, -1.0043181, -0.71637964, 0.92830396, 0.96316934,
        -1.3981798, -0.37461698, 1.0984418, 0.37607664, -1.3014535, 0.17381066, 1.2039577,
        -0.8390029, -0.7688046, 0.10965103, 0.8582281, -0.5208048, -0.28896126, 0.31132704,
        0.4935398, -0.8875538, -0.09044516, 0.7974904, 0.22753073, -0.5696612, -0.07653911,
        0.64618325, -0.28201166, -0.4608763, 0.19988583, 0.7029476, -0.51003957, -0.29679313,
        0.21639203, 0.689445, -0.4795016, -0.5131667, 0.57413, 0.4067878, -0.60277665,
        -0.34051597, 0.74522567, -0.14298002, -0.61117244, -0.27479813, 0.80182976, -0.08248331,
        -0.4773529, -0.00095814094, 0.6254452, -0.4089223, -0.43359637, 0.59302855, 0.31619778,
        -0.040263504, -0.35457328, 0.20977128, 0.12215282, -0.12472589, -0.2060987, 0.36107558,
        0.04202944, -0.32744893, -0.49551982, 0.41572052, 0.4391766, -0.6517163, 0.04981813,
        0.4374989, 0.09590018, -0.85484236, 0.28649354, 0.55304277, -0.018768415, -0.7146096,
        0.2578933, 0.6442737, -0.49778444, -0.48474145, 0.4739649, 0.5661881, -0.7189572,
        -0.06167555,
    ];
    #[rustfmt::skip]
    const STEP3: [f32; 120] = [
        -0.943315, -0.853035, 0.47410944, 1.152297, -1.0175467, -0.38949662, 1.0256938,
        0.6706199, -1.0832846, -0.18783888, 1.4378848, -0.01320903, -0.9759772, -0.05855846,
        1.6281692, -0.94972515, -0.9895064, 0.3951104, 0.9281387, -0.848392, -0.96770287,
        0.5440683, 0.7600431, -0.6523902, -1.1271935, 1.2680409, 0.43208706, -0.8434025,
        -0.3300138, 1.0333109, -0.2987408, -0.63277453, 0.08021678, 0.83367187, -0.30095425,
        -0.54945976, 0.4832844, 0.6036753, -0.542701, -0.37275773, 0.6407567, 0.47099084,
        -0.34295633, -0.6425318, 0.69754755, 0.1371426, -0.64932775, -0.33850965, 0.67613274,
        0.033908576, -1.0426023, 0.46012565, 0.79456127, -0.5399417, -1.207035, 1.2180653,
        0.5206112, -0.772662, -0.42495164, 1.0043914, 0.7009632, -0.8526119, -0.6389646,
        1.0652605, 0.8434175, -1.4572983, -0.11263135, 1.1056883, -0.013372719, -1.144594,
        0.47713035, 0.82476443, -0.1639601, -1.0912316, 0.4915804, 0.6591602, -0.6906557,
        -0.7635939, 0.7644464, 0.4347782, -1.0707378, -0.26976678, 0.67285305, 0.40503603,
        -1.1960157, 0.37867117, 0.8590248, 0.0074857473, -0.8450771, 0.39021674, 1.215186,
        -0.47716963, -0.914685, 0.5528957, 1.4033654, -1.3502218, -0.63262296, 0.83676624,
        0.5278422, -1.1195751, -0.14882238, 0.7986174, 0.25475967, -1.0245073, -0.21533543,
        1.0351214, -0.24595702, -0.9011777, 0.34284073, 0.7765517, -0.943315, -0.853035,
        0.47410944, 1.152297, -1.0175467, -0.38949662, 1.0256938, 0.6706199, -1.0832846,
        -0.18783888,
    ];
    #[rustfmt::skip]
    const Q_AFTER: [f32; 20] = [
        0.52729064, -3.0751836, 2.2087448, 0.22881962, 0.068974726, 2.125987, -2.8828766,
        -0.13402888, 0.46707755, -3.4939206, 2.252843, 2.2668467, -1.330129, 2.028601, -2.24371,
        -1.0614443, 1.5589898, -1.8745788, 1.6011972, 1.9877154,
    ];

    #[test]
    fn matches_pytorchs_hook_from_a_given_initial_q() {
        let (m, c, r) = (12usize, 10usize, 2usize);
        let g: Vec<f32> = (0..m * c)
            .map(|k| ((k / c * 7 + k % c * 3) % 11) as f32 / 4.0 - 1.25)
            .collect();
        let cfg = PowerSgdConfig {
            rank: r,
            min_compression_rate: 2.0,
            ..PowerSgdConfig::default()
        };
        let mut comp = PowerSgd::new(cfg.clone());
        comp.set_segment_shapes(&[vec![m, c]]);
        // The given Q: row-major c × r, as the hook's flattened `q_memory_dict`.
        let q0: BTreeMap<String, f64> = (0..c * r)
            .map(|i| {
                let (j, k) = (i / r, i % r);
                (format!("q/0/{i}"), ((j * 5 + k * 3) % 7) as f64 / 2.0 - 1.5)
            })
            .collect();
        comp.import_state(&q0).unwrap();
        let mut pipe = crate::Pipeline::new(
            Box::new(comp),
            Method::default_memory(&cfg).build().unwrap(),
        );
        let close = |got: &[f32], want: &[f32], what: &str| {
            for (i, (a, b)) in got.iter().zip(want).enumerate() {
                assert!(
                    (a - b).abs() <= 2e-5 * (1.0 + b.abs()),
                    "{what} [{i}]: {a} vs {b}"
                );
            }
        };
        // PyTorch's steps 2 and 3 are its first two PowerSGD steps (after two dense ones).
        for (step, want) in [(0u64, &STEP2[..]), (1, &STEP3[..])] {
            let ctx = Ctx {
                step,
                ..Ctx::default()
            };
            let mut p = Payload::new();
            pipe.compress(&g, &ctx, &mut Rng::seed_from_u64(0), &mut p)
                .unwrap();
            let mut out = vec![0f32; m * c];
            pipe.decompress_add(p.as_bytes(), &mut out).unwrap();
            close(&out, want, &format!("step {step}"));
        }
        let q: Vec<f32> = (0..c * r)
            .map(|i| pipe.compressor().export_state()[&format!("q/0/{i}")] as f32)
            .collect();
        close(&q, &Q_AFTER, "warm-started Q");
    }

    #[test]
    fn the_matrix_kernels_equal_the_textbook_products_for_every_rank() {
        let mut rng = Rng::seed_from_u64(9);
        let (rows, cols) = (13, 11);
        let a: Vec<f32> = (0..rows * cols).map(|_| gaussian(&mut rng)).collect();
        for r in [1usize, 2, 3, 4, 5, 8] {
            let b: Vec<f32> = (0..cols * r).map(|_| gaussian(&mut rng)).collect();
            let mut out = vec![f32::NAN; rows * r];
            mat_mul(&a, rows, cols, &b, r, &mut out);
            let p: Vec<f32> = (0..rows * r).map(|_| gaussian(&mut rng)).collect();
            let mut outt = vec![f32::NAN; cols * r];
            mat_t_mul(&a, rows, cols, &p, r, &mut outt);
            for i in 0..rows {
                for k in 0..r {
                    let want: f64 = (0..cols)
                        .map(|j| f64::from(a[i * cols + j]) * f64::from(b[j * r + k]))
                        .sum();
                    assert!((f64::from(out[i * r + k]) - want).abs() < 1e-4, "r {r}");
                }
            }
            for j in 0..cols {
                for k in 0..r {
                    let want: f64 = (0..rows)
                        .map(|i| f64::from(a[i * cols + j]) * f64::from(p[i * r + k]))
                        .sum();
                    assert!((f64::from(outt[j * r + k]) - want).abs() < 1e-4, "r {r}");
                }
            }
        }
    }

    #[test]
    fn warm_started_rounds_reach_the_best_rank_r_error() {
        let (m, c, full) = (64, 48, 12);
        let a = decaying(m, c, full, 1);
        for r in [1usize, 2, 4] {
            // Best rank-r error: the singular values left out.
            let tail: f64 = (r..full).map(|k| 0.25f64.powi(k as i32)).sum();
            let all: f64 = (0..full).map(|k| 0.25f64.powi(k as i32)).sum();
            let best = (tail / all).sqrt();
            let mut comp = compressor(r, &[m, c]);
            let mut err = f64::INFINITY;
            for step in 0..6 {
                let ctx = Ctx {
                    step,
                    ..Ctx::default()
                };
                let p = compress_new(&mut comp, &a, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
                // r·(m + c) floats, a 10-byte segment head and the frame.
                let body = 4 * r * (m + c);
                assert!((body..body + 64).contains(&p.as_bytes().len()));
                let mut out = vec![0f32; m * c];
                decompress(&comp, p.as_bytes(), &mut out).unwrap();
                err = rel_err(&a, &out);
            }
            assert!(err <= 1.05 * best, "rank {r}: error {err}, best {best}");
        }
    }

    #[test]
    fn the_summed_agreement_gives_the_mean_of_the_rank_r_approximations() {
        // Three ranks, one 40 × 30 matrix and a bias: the hooks a multi-rank driver calls.
        let (m, c, r, world) = (40usize, 30usize, 2usize, 3usize);
        let shapes = [vec![m, c], vec![7]];
        let segs = [0..m * c, m * c..m * c + 7];
        let grads: Vec<Vec<f32>> = (0..world)
            .map(|w| {
                let mut g = decaying(m, c, 6, 10 + w as u64);
                g.extend((0..7).map(|i| (i + w) as f32));
                g
            })
            .collect();
        let mut comps: Vec<PowerSgd> = (0..world)
            .map(|_| {
                let mut k = PowerSgd::new(PowerSgdConfig {
                    rank: r,
                    ..PowerSgdConfig::default()
                });
                k.set_segment_shapes(&shapes);
                k.set_world_size(world);
                k
            })
            .collect();
        for step in 0..3u64 {
            let ctx = Ctx {
                step,
                segments: &segs,
                ..Ctx::default()
            };
            let len = comps[0].summed_agreement(&ctx).unwrap();
            assert_eq!(len, m * r);
            let mut summed = vec![0f32; len];
            for (k, g) in comps.iter_mut().zip(&grads) {
                let mut msg = Vec::new();
                k.sum_message(g, &ctx, &mut msg).unwrap();
                summed.iter_mut().zip(&msg).for_each(|(s, v)| *s += v);
            }
            let mut payloads: Vec<Payload> = Vec::new();
            for (k, g) in comps.iter_mut().zip(&grads) {
                k.install_sum(&summed, g.len(), &ctx).unwrap();
                payloads.push(compress_new(k, g, &ctx, &mut Rng::seed_from_u64(0)).unwrap());
            }
            let mut acc = payloads[0].as_bytes().to_vec();
            for p in &payloads[1..] {
                sum_lanes(&comps[0], &mut acc, p.as_bytes()).unwrap();
            }
            let mut mean = vec![0f32; m * c + 7];
            decompress(&comps[0], &acc, &mut mean).unwrap();
            mean.iter_mut().for_each(|v| *v /= world as f32);
            // Reference in f64: P̂ from the summed P, then P̂·Q̄ᵀ; the bias is the mean.
            let p_hat = &comps[0].p_hat[0];
            for i in 0..m {
                for j in 0..c {
                    let want: f64 = (0..r)
                        .map(|k| {
                            let qbar: f64 = (0..world)
                                .map(|w| {
                                    (0..m)
                                        .map(|ii| {
                                            f64::from(grads[w][ii * c + j])
                                                * f64::from(p_hat[ii * r + k])
                                        })
                                        .sum::<f64>()
                                })
                                .sum::<f64>()
                                / world as f64;
                            f64::from(p_hat[i * r + k]) * qbar
                        })
                        .sum();
                    let got = f64::from(mean[i * c + j]);
                    assert!(
                        (got - want).abs() < 1e-4,
                        "step {step} ({i}, {j}): {got} vs {want}"
                    );
                }
            }
            for b in 0..7 {
                let want = (0..world).map(|w| (b + w) as f32).sum::<f32>() / world as f32;
                assert!((mean[m * c + b] - want).abs() < 1e-5);
            }
            // Every rank warm-starts from the same mean Q.
            for k in comps.iter_mut() {
                k.absorb_aggregate(&acc, &ctx);
            }
            assert!(comps.iter().all(|k| k.q == comps[0].q));
        }
    }

    #[test]
    fn dense_before_start_step_for_vectors_and_for_matrices_too_small_to_gain() {
        let mut k = PowerSgd::new(PowerSgdConfig {
            rank: 2,
            start_step: 2,
            ..PowerSgdConfig::default()
        });
        // 3 × 3 at rank 2: 2·(3 + 3) = 12 ≥ 9, dense; 16 × 16: 64 < 256, low rank.
        k.set_segment_shapes(&[vec![16], vec![3, 3], vec![16, 16]]);
        assert_eq!(
            k.plans,
            [Plan::Dense, Plan::Dense, Plan::LowRank { m: 16, c: 16 }]
        );
        let segs = [0..16, 16..25, 25..281];
        let g: Vec<f32> = (0..281).map(|i| (i as f32 * 0.37).sin()).collect();
        for step in 0..3 {
            let ctx = Ctx {
                step,
                segments: &segs,
                ..Ctx::default()
            };
            assert_eq!(k.summed_agreement(&ctx).is_some(), step >= 2);
            let p = compress_new(&mut k, &g, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
            let mut out = vec![0f32; 281];
            decompress(&k, p.as_bytes(), &mut out).unwrap();
            assert_eq!(out[..25], g[..25], "dense tensors are exact");
            assert_eq!(out[25..] == g[25..], step < 2, "step {step}");
        }
    }

    #[test]
    fn malformed_bodies_are_refused_and_the_state_round_trips() {
        let k = compressor(1, &[4, 4]);
        let mut out = [0f32; 16];
        let good = |m: u32, c: u32, r: u8| {
            let mut b = vec![LOW_RANK];
            b.extend(m.to_le_bytes());
            b.extend(c.to_le_bytes());
            b.push(r);
            b.extend(std::iter::repeat_n(
                0u8,
                4 * (m as usize + c as usize) * r as usize,
            ));
            b
        };
        k.decode_segment_add(&mut Reader::new(&good(4, 4, 1)), &mut out)
            .unwrap();
        for body in [
            good(2, 4, 1),
            good(4, 4, 0),
            good(4, 4, 5),
            good(0, 16, 1),
            vec![7],
            good(4, 4, 1)[..20].to_vec(),
            [vec![DENSE], f32::NAN.to_le_bytes().repeat(16)].concat(),
        ] {
            assert!(k
                .decode_segment_add(&mut Reader::new(&body), &mut out)
                .is_err());
        }
        let mut a = compressor(2, &[8, 6]);
        let g = decaying(8, 6, 3, 4);
        compress_new(&mut a, &g, &Ctx::default(), &mut Rng::seed_from_u64(0)).unwrap();
        let st = a.export_state();
        assert_eq!(st.len(), 12);
        let mut b = compressor(2, &[8, 6]);
        b.import_state(&st).unwrap();
        assert_eq!(b.q, a.q);
        let mut wrong = st.clone();
        wrong.insert("q/0/99".into(), 1.0);
        assert!(b.import_state(&wrong).is_err());
        assert!(compressor(2, &[8]).import_state(&st).is_err());
    }
}
