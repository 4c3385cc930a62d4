//! `mipd`: layer-wise adaptive sparsification by parameter significance, a per-layer
//! distribution-fitted code-book, and the parameter server's exponential smoothing with
//! alternating-half updates (ALGORITHMS.md §14; Zhang & Wang, TPDS 2022).
//!
//! Only the abstract of the paper is verified; everything below is the template of §14
//! with each `[U]` choice made explicit and configurable.
//!
//! # Worker side ([`Mipd`], configured by [`MipdConfig`])
//! Per layer `l` (a contiguous range of the flat buffer, given by the caller):
//! 1. **Significance** ([`Significance`]): `s_j = |w_j·g_j|` (first-order Taylor saliency,
//!    the default) or `s_j = |g_j|`. The worker therefore needs the layer's *parameters*
//!    as well as its gradient: [`Mipd::encode`] takes both. A layer whose Taylor mass is
//!    zero while its gradient is not (e.g. freshly zero-initialised biases) falls back to
//!    `|g_j|`, otherwise it could never be selected.
//! 2. **Adaptive keep ratio ρ_l** ([`keep_count`]): the smallest `k` whose `k` most
//!    significant entries hold at least `mass · Σ_j s_j`, clamped to
//!    `[max(1, ⌈ρ_min·n⌉), max(that, ⌈ρ_max·n⌉)]`; `ρ_l = k/n`. A layer of all-zero scores
//!    keeps the lower bound. The `k` entries of largest score are kept (ties → smaller
//!    index, [`crate::select::top_k`]).
//! 3. **Code-book** ([`fit_codebook`]): the kept values are quantized to at most `2^b`
//!    levels by Lloyd-Max iterations on the sorted values (cells are contiguous runs, so an
//!    iteration costs `O(L log k)` with prefix sums). Lloyd-Max is run twice, initialised
//!    at the quantiles `(i+½)/L` and at the uniform grid over `[min, max]`, and the
//!    code-book of lower mean-squared error is kept — so it is never worse than the
//!    uniform quantizer with the same number of levels. If the kept values have at most
//!    `2^b` distinct values they are the code-book (lossless).
//! 4. **Index encoding**: the kept (ascending) indices as Elias-gamma coded gaps, or as a
//!    bitmap, whichever takes fewer bytes.
//!
//! The generic [`Compressor`] seam sees gradients only; [`Mipd`] implements it anyway so
//! that its payloads decode through [`crate::decompress_add`] and share the framing, fuzz
//! suite and `Gather` aggregation of the other methods. Through that seam (no parameters)
//! the significance is always `|g_j|`; the parameter-aware entry point is [`Mipd::encode`],
//! which writes the very same framing.
//!
//! **Error feedback**: MIPD does not build EF in. The template compensates dropped
//! coordinates on the server ([`MipdServer`]'s smoothing) instead; a caller that also
//! wants worker-side EF wraps [`Mipd::encode`] in a [`crate::memory::Residual`] memory
//! (compensate, encode, decode its own payload, update) like any biased compressor.
//!
//! # Wire format (body of one layer of `n` elements, little-endian)
//! The payload is the shared framing of [`crate::compressor`] (12-byte header with method
//! id [`MethodId::Mipd`], segment table when there is more than one layer), then per layer:
//! ```text
//! u32 k                  kept entries, 0..=n; nothing follows when k = 0
//! u8  index layout       0 = Elias-gamma gaps, 1 = bitmap
//! u32 m                  index bytes (bitmap: exactly ⌈n/8⌉)
//! m bytes                gaps: k codes of (i_0 + 1), (i_1 − i_0), …, LSB-first, zero-padded
//!                        bitmap: bit i set ⇔ i kept, LSB-first, no bits past n
//! u32 L                  code-book levels, 1 ≤ L ≤ min(k, 65536)
//! L × f32                levels, finite, strictly ascending
//! ⌈k·w/8⌉ bytes          codes, w = ⌈log2 L⌉ bits each (0 when L = 1), LSB-first, each < L,
//!                        in ascending index order
//! ```
//! Bits per layer: `32 + [k>0]·(72 + min(8·gap_bytes, 8⌈n/8⌉) + 32L + 8⌈k·w/8⌉)`, with
//! `w ≤ b` and Elias-gamma gaps costing about `2·log2(1/ρ_l) + 1` bits per kept entry.
//!
//! # Server side ([`MipdServer`], configured by [`MipdServerConfig`])
//! One server state per shard. At step `t` it decodes the pushes of every worker (checking
//! each one completely before any state changes), sums them in worker order into a carry
//! buffer and marks the received coordinates; then, for the coordinates of the half
//! `H_{t mod 2}` ([`Halves`]) only:
//! ```text
//! ĝ_t[j] = carry[j]            if j was received since its half was last updated
//!          λ·ĝ_{t−2}[j]         otherwise (exponential smoothing of dropped entries)
//! ```
//! and resets their carry. Coordinates of the other half keep accumulating, so nothing
//! pushed is lost: a gradient received at step `t` for a coordinate of the other half is
//! applied at step `t + 1`. With [`Halves::Off`] every coordinate is updated every step and
//! `ĝ_{t−1}` replaces `ĝ_{t−2}` above (the template literally). The dense work per step
//! (smoothing, output) is over half the coordinates; decoding is over the pushes only.
//!
//! The result is the **sum** over workers (divide by the worker count for a mean). The
//! pull payload ([`decode_pull`]) carries the values of `H_t` only:
//! ```text
//! u8  0x4D ('M')   u8 version 1   u8 half (0, 1; 2 = all)   u8 layout (0 dense, 1 sparse)
//! u64 step
//! u32 m            coordinates of the half
//! dense:  m × f32 (the half's values in ascending index order)
//! sparse: ⌈m/8⌉ bitmap bytes (bit i ⇔ the i-th value of the half is non-zero, i.e. has
//!         non-zero bits), then one f32 per set bit
//! ```
//! The smaller layout is chosen: sparse when `8⌈m/8⌉ + 32·nnz < 32·m`. With `λ = 0` the
//! half is as sparse as the pushes; with `λ > 0` it fills up and the dense half is sent —
//! still half the bytes of a dense pull.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::compressor::{
    effective_segments, first_non_finite, read_frame, write_frame_header, Aggregation, Compressor,
    MethodId, MAX_ELEMS,
};
use crate::error::{CompressError, ConfigError, WireError};
use crate::rng::Rng;
use crate::select::{abs_key, top_k, Scratch};
use crate::wire::{
    bytes_for_bits, elias_gamma_len, elias_gamma_put, f32_at, BitReader, BitWriter, Reader, Writer,
};

/// Largest code-book size (`b ≤ 16`).
pub const MAX_LEVELS: usize = 1 << 16;
const GAPS: u8 = 0;
const BITMAP: u8 = 1;

/// How significant a coordinate is, i.e. which entries of a layer are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Significance {
    /// `|w_j · g_j|`: the first-order Taylor estimate of the loss change if the update of
    /// `w_j` were dropped (the template's placeholder). Default.
    ///
    /// Caveat (measured, `framework/examples/mipd_ps.rs`): a parameter at exactly zero
    /// scores zero and is never kept while anything else in its layer scores above zero,
    /// so it can never move away from zero. Softmax regression from a zero start stalls
    /// near 85 % test accuracy with it, where `|g|` matches the dense PS.
    #[default]
    Taylor,
    /// `|g_j|`: plain magnitude, as top-k uses (for comparison).
    Gradient,
}

/// Configuration of the MIPD worker side ([`Mipd`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MipdConfig {
    /// Significance score. Default `taylor`.
    #[serde(default)]
    pub significance: Significance,
    /// Target share of a layer's significance mass the kept entries must hold, in (0, 1].
    /// Default 0.5.
    #[serde(default = "default_mass")]
    pub mass: f64,
    /// ρ_min: the least fraction of each layer kept, in (0, 1]. Default 0.001.
    #[serde(default = "default_min_ratio")]
    pub min_ratio: f64,
    /// ρ_max: the largest fraction of each layer kept, in [ρ_min, 1]. Default 0.05.
    #[serde(default = "default_max_ratio")]
    pub max_ratio: f64,
    /// Code bits `b`: at most `2^b` code-book levels per layer, 1..=16. Default 4.
    #[serde(default = "default_bits")]
    pub bits: u32,
    /// Lloyd-Max iterations per code-book fit, 0..=1000 (0: the initial grids). Default 10.
    #[serde(default = "default_lloyd_iters")]
    pub lloyd_iters: u32,
    /// Server side (parameter-server mode): smoothing factor λ of [`MipdServerConfig`].
    /// Default 0.5.
    #[serde(default = "default_lambda")]
    pub lambda: f64,
    /// Server side (parameter-server mode): the alternating-half rule. Default `blocked`.
    #[serde(default)]
    pub halves: Halves,
}

fn default_mass() -> f64 {
    0.5
}
fn default_min_ratio() -> f64 {
    0.001
}
fn default_max_ratio() -> f64 {
    0.05
}
fn default_bits() -> u32 {
    4
}
fn default_lloyd_iters() -> u32 {
    10
}

impl Default for MipdConfig {
    fn default() -> Self {
        MipdConfig {
            significance: Significance::default(),
            mass: default_mass(),
            min_ratio: default_min_ratio(),
            max_ratio: default_max_ratio(),
            bits: default_bits(),
            lloyd_iters: default_lloyd_iters(),
            lambda: default_lambda(),
            halves: Halves::default(),
        }
    }
}

fn check_unit(field: &'static str, v: f64) -> Result<(), ConfigError> {
    if !(v > 0.0 && v <= 1.0) {
        return Err(ConfigError::new(
            field,
            format!("must be in (0, 1], got {v}"),
        ));
    }
    Ok(())
}

impl MipdConfig {
    /// The servers' configuration (λ and the half rule) carried by this method config.
    pub fn server(&self) -> MipdServerConfig {
        MipdServerConfig {
            lambda: self.lambda,
            halves: self.halves,
        }
    }

    /// Checks the parameters and builds the worker-side encoder.
    pub fn init(&self) -> Result<Mipd, ConfigError> {
        check_unit("mass", self.mass)?;
        check_unit("min_ratio", self.min_ratio)?;
        check_unit("max_ratio", self.max_ratio)?;
        if self.max_ratio < self.min_ratio {
            return Err(ConfigError::new(
                "max_ratio",
                format!(
                    "must be at least min_ratio ({}), got {}",
                    self.min_ratio, self.max_ratio
                ),
            ));
        }
        if !(1..=16).contains(&self.bits) {
            return Err(ConfigError::new(
                "bits",
                format!("must be in 1..=16, got {}", self.bits),
            ));
        }
        if self.lloyd_iters > 1000 {
            return Err(ConfigError::new(
                "lloyd_iters",
                format!("must be at most 1000, got {}", self.lloyd_iters),
            ));
        }
        Ok(Mipd {
            cfg: self.clone(),
            scores: Vec::new(),
            keys: Vec::new(),
            scratch: Scratch::default(),
            idx: Vec::new(),
            vals: Vec::new(),
            sorted: Vec::new(),
            stats: Vec::new(),
        })
    }
}

/// What the encoder did with one layer (for tests, logs and metrics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerStats {
    /// Elements in the layer.
    pub len: usize,
    /// Entries kept (`k = ρ_l·n`).
    pub kept: usize,
    /// Code-book levels sent.
    pub levels: usize,
    /// Whether the indices went as a bitmap (else as Elias-gamma gaps).
    pub bitmap: bool,
    /// Body bytes of the layer.
    pub bytes: usize,
}

impl LayerStats {
    /// The layer's keep ratio ρ_l = k/n.
    pub fn ratio(&self) -> f64 {
        if self.len == 0 {
            0.0
        } else {
            self.kept as f64 / self.len as f64
        }
    }
}

/// The MIPD worker-side encoder (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct Mipd {
    cfg: MipdConfig,
    scores: Vec<f32>,
    keys: Vec<u32>,
    scratch: Scratch,
    idx: Vec<u32>,
    vals: Vec<f32>,
    sorted: Vec<f32>,
    stats: Vec<LayerStats>,
}

/// Writes `significance(w_j, g_j)` into `out` (resized): `|w_j·g_j|` or `|g_j|`, as finite
/// non-negative values (an overflowing product saturates at `f32::MAX`). Without
/// parameters, or when every Taylor score is zero while some gradient is not, the scores
/// are `|g_j|` (see the [module docs](self)).
pub fn significance(kind: Significance, params: Option<&[f32]>, grads: &[f32], out: &mut Vec<f32>) {
    out.clear();
    if let (Significance::Taylor, Some(w)) = (kind, params) {
        out.extend(
            w.iter()
                .zip(grads)
                .map(|(&w, &g)| (w * g).abs().min(f32::MAX)),
        );
        if out.iter().any(|&s| s > 0.0) || grads.iter().all(|&g| g == 0.0) {
            return;
        }
        out.clear();
    }
    out.extend(grads.iter().map(|g| g.abs()));
}

/// The number of entries MIPD keeps of a layer with significance `scores` (finite, ≥ 0):
/// the smallest `k` whose `k` largest scores hold at least `mass · Σ scores`, clamped to
/// `[max(1, ⌈ρ_min·n⌉), max(that, ⌈ρ_max·n⌉)]` (capped at `n`); the lower bound when all
/// scores are zero. Sums are in f64. `keys` is scratch.
pub fn keep_count(scores: &[f32], cfg: &MipdConfig, keys: &mut Vec<u32>) -> usize {
    let n = scores.len();
    if n == 0 {
        return 0;
    }
    let k_min = ((cfg.min_ratio * n as f64).ceil() as usize).clamp(1, n);
    let k_max = ((cfg.max_ratio * n as f64).ceil() as usize).clamp(k_min, n);
    let total: f64 = scores.iter().map(|&s| s as f64).sum();
    if total <= 0.0 {
        return k_min;
    }
    // Non-negative finite f32 order like their bit patterns.
    keys.clear();
    keys.extend(scores.iter().map(|s| s.to_bits()));
    mass_count(keys, cfg.mass * total).clamp(k_min, k_max)
}

/// Smallest `k` such that the `k` largest of `v` (non-negative f32 bit patterns) sum to at
/// least `need`; `v.len()` if they never do. Quickselect on the mass: O(n) on average.
fn mass_count(v: &mut [u32], mut need: f64) -> usize {
    let val = |b: u32| f32::from_bits(b) as f64;
    let (mut lo, mut hi, mut acc) = (0usize, v.len(), 0usize);
    loop {
        let len = hi - lo;
        if len <= 64 {
            let s = &mut v[lo..hi];
            s.sort_unstable_by(|a, b| b.cmp(a));
            for (i, &x) in s.iter().enumerate() {
                need -= val(x);
                if need <= 0.0 {
                    return acc + i + 1;
                }
            }
            return acc + len;
        }
        let mid = len / 2;
        v[lo..hi].select_nth_unstable_by(mid, |a, b| b.cmp(a));
        let upper: f64 = v[lo..lo + mid].iter().map(|&x| val(x)).sum();
        if upper >= need {
            hi = lo + mid;
        } else {
            need -= upper;
            acc += mid;
            lo += mid;
        }
    }
}

/// Width in bits of a code for `levels` levels: `⌈log2 levels⌉`.
pub fn code_width(levels: usize) -> u32 {
    if levels <= 1 {
        0
    } else {
        usize::BITS - (levels - 1).leading_zeros()
    }
}

/// Index of the level nearest `v` in the ascending `levels` (ties → the upper level).
#[inline]
fn nearest(levels: &[f32], v: f32) -> usize {
    // Number of midpoints ≤ v.
    let (mut lo, mut hi) = (0usize, levels.len() - 1);
    while lo < hi {
        let m = (lo + hi) / 2;
        let mid = levels[m] + (levels[m + 1] - levels[m]) * 0.5;
        if mid <= v {
            lo = m + 1;
        } else {
            hi = m;
        }
    }
    lo
}

/// Mean-squared error of quantizing the ascending `sorted` values to the nearest of
/// `levels` (ascending).
pub fn quantization_mse(sorted: &[f32], levels: &[f32]) -> f64 {
    if sorted.is_empty() || levels.is_empty() {
        return 0.0;
    }
    let se: f64 = sorted
        .iter()
        .map(|&v| {
            let q = levels[nearest(levels, v)];
            ((v - q) as f64).powi(2)
        })
        .sum();
    se / sorted.len() as f64
}

/// Lloyd-Max on ascending `sorted` from `init` (ascending), `iters` iterations at most.
fn lloyd(sorted: &[f32], prefix: &[f64], mut lv: Vec<f64>, iters: u32) -> Vec<f32> {
    let l = lv.len();
    for _ in 0..iters {
        let mut changed = false;
        let mut start = 0usize;
        for i in 0..l {
            let end = if i + 1 == l {
                sorted.len()
            } else {
                let b = (lv[i] + lv[i + 1]) * 0.5;
                start + sorted[start..].partition_point(|&v| (v as f64) < b)
            };
            if end > start {
                let m = (prefix[end] - prefix[start]) / (end - start) as f64;
                if m != lv[i] {
                    lv[i] = m;
                    changed = true;
                }
            }
            start = end;
        }
        if !changed {
            break;
        }
    }
    let mut out: Vec<f32> = lv.iter().map(|&x| x as f32).collect();
    out.sort_unstable_by(f32::total_cmp);
    out.dedup();
    out
}

/// Fits the code-book of at most `max_levels` levels to the ascending finite values
/// `sorted` (see the [module docs](self)): the distinct values if there are at most
/// `max_levels` of them; otherwise the better (lower MSE) of Lloyd-Max from the quantile
/// grid and Lloyd-Max from the uniform grid. The result is finite, strictly ascending and
/// non-empty unless `sorted` is empty.
pub fn fit_codebook(sorted: &[f32], max_levels: usize, iters: u32) -> Vec<f32> {
    let k = sorted.len();
    if k == 0 || max_levels == 0 {
        return Vec::new();
    }
    let mut distinct: Vec<f32> = Vec::new();
    for &v in sorted {
        if distinct.last() != Some(&v) {
            if distinct.len() == max_levels {
                distinct.clear();
                break;
            }
            distinct.push(v);
        }
    }
    if !distinct.is_empty() {
        return distinct;
    }
    let l = max_levels;
    let mut prefix = Vec::with_capacity(k + 1);
    prefix.push(0f64);
    let mut acc = 0f64;
    for &v in sorted {
        acc += v as f64;
        prefix.push(acc);
    }
    let quant: Vec<f64> = (0..l)
        .map(|i| sorted[(((2 * i + 1) * k) / (2 * l)).min(k - 1)] as f64)
        .collect();
    let (lo, hi) = (sorted[0] as f64, sorted[k - 1] as f64);
    let step = (hi - lo) / l as f64;
    let uniform: Vec<f64> = (0..l).map(|i| lo + (i as f64 + 0.5) * step).collect();
    let a = lloyd(sorted, &prefix, quant, iters);
    let b = lloyd(sorted, &prefix, uniform, iters);
    if quantization_mse(sorted, &b) < quantization_mse(sorted, &a) {
        b
    } else {
        a
    }
}

impl Mipd {
    /// The configuration.
    pub fn config(&self) -> &MipdConfig {
        &self.cfg
    }

    /// Per-layer statistics of the last encode (one entry per layer, in order).
    pub fn last_stats(&self) -> &[LayerStats] {
        &self.stats
    }

    /// Encodes the gradient `grads` of a model (or shard) whose parameters are `params`,
    /// laid out in the layers `layers` (contiguous, in order, tiling the buffer; empty means
    /// one layer), into `out` (cleared first). The framing is the shared one of
    /// [`crate::compressor`]: decode with [`crate::decompress_add`] on a [`Mipd`] of any
    /// configuration.
    ///
    /// Fails on buffers of different lengths, non-finite values, buffers over the wire
    /// format's limit and layer lists that do not tile the buffer.
    pub fn encode(
        &mut self,
        params: &[f32],
        grads: &[f32],
        layers: &[Range<usize>],
        out: &mut Vec<u8>,
    ) -> Result<(), CompressError> {
        if params.len() != grads.len() {
            return Err(CompressError::BadSegments(format!(
                "{} parameters for {} gradient entries",
                params.len(),
                grads.len()
            )));
        }
        self.encode_inner(Some(params), grads, layers, out)
    }

    fn encode_inner(
        &mut self,
        params: Option<&[f32]>,
        grads: &[f32],
        layers: &[Range<usize>],
        out: &mut Vec<u8>,
    ) -> Result<(), CompressError> {
        let n = grads.len();
        if n > MAX_ELEMS {
            return Err(CompressError::TooLarge(n));
        }
        if let Some((index, value)) = first_non_finite(grads) {
            return Err(CompressError::NonFinite { index, value });
        }
        if let Some((index, value)) = params.and_then(first_non_finite) {
            return Err(CompressError::NonFinite { index, value });
        }
        let segs = effective_segments(n, layers)?;
        out.clear();
        self.stats.clear();
        let mut w = Writer::new(out);
        write_frame_header(&mut w, MethodId::Mipd, n, &segs);
        for s in &segs {
            let p = params.map(|p| &p[s.clone()]);
            self.encode_layer(p, &grads[s.clone()], &mut w);
        }
        Ok(())
    }

    /// Encodes one layer's body (gradient `g`, parameters `w` if known).
    fn encode_layer(&mut self, w: Option<&[f32]>, g: &[f32], out: &mut Writer<'_>) {
        let n = g.len();
        let start = out.len();
        significance(self.cfg.significance, w, g, &mut self.scores);
        let k = keep_count(&self.scores, &self.cfg, &mut self.keys);
        let scores = &self.scores;
        top_k(
            n,
            k,
            |i| abs_key(scores[i]),
            &mut self.scratch,
            &mut self.idx,
        );
        debug_assert_eq!(self.idx.len(), k);
        out.u32(k as u32);
        if k == 0 {
            self.stats.push(LayerStats {
                len: n,
                kept: 0,
                levels: 0,
                bitmap: false,
                bytes: out.len() - start,
            });
            return;
        }
        // Indices: Elias-gamma gaps or a bitmap, whichever is smaller.
        let mut prev = -1i64;
        let mut gap_bits = 0u64;
        for &i in &self.idx {
            gap_bits += elias_gamma_len((i as i64 - prev) as u32);
            prev = i as i64;
        }
        let gap_bytes = bytes_for_bits(gap_bits);
        let bitmap = n.div_ceil(8) < gap_bytes;
        if bitmap {
            out.u8(BITMAP);
            out.u32(n.div_ceil(8) as u32);
            let bm = out.zeroed(n.div_ceil(8));
            for &i in &self.idx {
                bm[(i >> 3) as usize] |= 1 << (i & 7);
            }
        } else {
            out.u8(GAPS);
            out.u32(gap_bytes as u32);
            let mut bw = BitWriter::new(out.zeroed(gap_bytes));
            let mut prev = -1i64;
            for &i in &self.idx {
                elias_gamma_put(&mut bw, (i as i64 - prev) as u32);
                prev = i as i64;
            }
            bw.finish();
        }
        // Values: code-book fitted to the kept values, then codes.
        self.vals.clear();
        self.vals.extend(self.idx.iter().map(|&i| g[i as usize]));
        self.sorted.clear();
        self.sorted.extend_from_slice(&self.vals);
        self.sorted.sort_unstable_by(f32::total_cmp);
        let levels = fit_codebook(&self.sorted, 1usize << self.cfg.bits, self.cfg.lloyd_iters);
        out.u32(levels.len() as u32);
        out.f32_slice(&levels);
        let width = code_width(levels.len());
        let mut bw = BitWriter::new(out.zeroed(bytes_for_bits(k as u64 * width as u64)));
        if width > 0 {
            for &v in &self.vals {
                bw.put(nearest(&levels, v) as u32, width);
            }
        }
        bw.finish();
        self.stats.push(LayerStats {
            len: n,
            kept: k,
            levels: levels.len(),
            bitmap,
            bytes: out.len() - start,
        });
    }
}

/// Reads one layer body of `n` elements and calls `visit(index, value)` for every kept
/// entry in ascending index order. Validates everything; never panics.
pub fn decode_layer(
    r: &mut Reader<'_>,
    n: usize,
    mut visit: impl FnMut(usize, f32),
) -> Result<(), WireError> {
    let k = r.u32("mipd kept count")? as usize;
    if k > n {
        return Err(WireError::Invalid("mipd: more kept entries than elements"));
    }
    if k == 0 {
        return Ok(());
    }
    let layout = r.u8("mipd index layout")?;
    let m = r.u32("mipd index bytes")? as usize;
    let idx = r.take(m, "mipd indices")?;
    let l = r.u32("mipd code-book size")? as usize;
    if l == 0 || l > k.min(MAX_LEVELS) {
        return Err(WireError::Invalid("mipd: code-book size out of range"));
    }
    let lv = r.take_items(l, 4, "mipd code-book")?;
    let mut prev = f32::NEG_INFINITY;
    for j in 0..l {
        let v = f32_at(lv, j);
        if !v.is_finite() || v <= prev {
            return Err(WireError::Invalid(
                "mipd: code-book not finite and strictly ascending",
            ));
        }
        prev = v;
    }
    let width = code_width(l);
    let codes = r.take(bytes_for_bits(k as u64 * width as u64), "mipd value codes")?;
    let mut cr = BitReader::new(codes);
    let mut code = || -> Result<f32, WireError> {
        let c = cr.get(width) as usize;
        if c >= l {
            return Err(WireError::Invalid("mipd: code outside the code-book"));
        }
        Ok(f32_at(lv, c))
    };
    match layout {
        GAPS => {
            let mut br = GammaReader { buf: idx, pos: 0 };
            let mut next = 0u64;
            for _ in 0..k {
                let gap = br
                    .get()
                    .ok_or(WireError::Invalid("mipd: malformed index gap"))?;
                if br.pos > 8 * m as u64 {
                    return Err(WireError::Invalid("mipd: index gaps overrun their bytes"));
                }
                let i = next + gap as u64 - 1;
                if i >= n as u64 {
                    return Err(WireError::IndexOutOfRange { index: i, len: n });
                }
                visit(i as usize, code()?);
                next = i + 1;
            }
            if bytes_for_bits(br.pos) != m {
                return Err(WireError::Invalid(
                    "mipd: index gaps do not fill their bytes",
                ));
            }
            let pad = (8 - br.pos % 8) % 8;
            if br.window() & ((1u64 << pad) - 1) != 0 {
                return Err(WireError::Invalid("mipd: index padding bits are not zero"));
            }
        }
        BITMAP => {
            if m != n.div_ceil(8) {
                return Err(WireError::Invalid("mipd: bitmap of the wrong length"));
            }
            let set: usize = idx.iter().map(|b| b.count_ones() as usize).sum();
            if set != k {
                return Err(WireError::Invalid(
                    "mipd: bitmap population differs from count",
                ));
            }
            if n % 8 != 0 && (idx[m - 1] >> (n % 8)) != 0 {
                return Err(WireError::Invalid(
                    "mipd: bitmap has bits past the layer end",
                ));
            }
            for (bi, &b) in idx.iter().enumerate() {
                let mut b = b;
                while b != 0 {
                    let bit = b.trailing_zeros() as usize;
                    b &= b - 1;
                    visit(bi * 8 + bit, code()?);
                }
            }
        }
        _ => return Err(WireError::Invalid("mipd: unknown index layout")),
    }
    let used = k as u64 * width as u64;
    let pad = (8 - used % 8) % 8;
    if pad > 0 && cr.get(pad as u32) != 0 {
        return Err(WireError::Invalid("mipd: code padding bits are not zero"));
    }
    Ok(())
}

/// Elias-gamma reader over an LSB-first bit stream (the layout of
/// [`crate::wire::elias_gamma_put`]) that decodes a code from one 64-bit window when its
/// gap is below 2^28 and falls back to a bit at a time for longer ones. Bits past the end
/// read as zero; `pos` counts the bits consumed, so the caller detects overruns.
struct GammaReader<'a> {
    buf: &'a [u8],
    pos: u64,
}

impl GammaReader<'_> {
    /// The next (at least 57) bits, LSB first.
    #[inline(always)]
    fn window(&self) -> u64 {
        let b = (self.pos >> 3) as usize;
        let w = match self.buf.get(b..b + 8) {
            Some(s) => u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]),
            None => {
                let mut a = [0u8; 8];
                if let Some(s) = self.buf.get(b..) {
                    a[..s.len()].copy_from_slice(s);
                }
                u64::from_le_bytes(a)
            }
        };
        w >> (self.pos & 7)
    }

    fn bit(&mut self) -> u32 {
        let v = (self.window() & 1) as u32;
        self.pos += 1;
        v
    }

    /// One code; `None` if it has more than 31 leading zeros.
    #[inline]
    fn get(&mut self) -> Option<u32> {
        let w = self.window();
        let z = w.trailing_zeros();
        if z <= 27 {
            let nb = z + 1;
            let x = ((w >> z) & ((1u64 << nb) - 1)) as u32;
            self.pos += u64::from(z + nb);
            return Some(x.reverse_bits() >> (32 - nb));
        }
        let mut zeros = 0u32;
        while self.bit() == 0 {
            zeros += 1;
            if zeros > 31 {
                return None;
            }
        }
        let mut v = 1u32;
        for _ in 0..zeros {
            v = (v << 1) | self.bit();
        }
        Some(v)
    }
}

impl Compressor for Mipd {
    fn method(&self) -> MethodId {
        MethodId::Mipd
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }
    fn begin(&mut self, _grad: &[f32], _ctx: &crate::compressor::Ctx<'_>) {
        self.stats.clear();
    }
    /// Through the generic seam the parameters are unknown: significance is `|g_j|`.
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        self.encode_layer(None, x, w);
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        decode_layer(r, out.len(), |i, v| out[i] += v)
    }
    fn segment_bits(&self, _n: usize) -> Option<u64> {
        None
    }
}

/// The layers of a flat model (`layers`, tiling `0..len`) that fall into `range` (a shard),
/// clipped to it and made relative to `range.start`: the layer list a shard's encoder and
/// server use. Pieces are non-empty and tile `0..range.len()`.
pub fn layers_in(layers: &[Range<usize>], range: Range<usize>) -> Vec<Range<usize>> {
    layers
        .iter()
        .filter_map(|l| {
            let s = l.start.max(range.start);
            let e = l.end.min(range.end);
            (s < e).then(|| s - range.start..e - range.start)
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Server side.

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

fn default_lambda() -> f64 {
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

/// The server state of one shard (see the [module docs](self)): smoothed aggregate ĝ,
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
        let (mut r, segs) = read_frame(MethodId::Mipd, bytes, n)?;
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
            if m % 8 != 0 && (bm[bm.len() - 1] >> (m % 8)) != 0 {
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
    use crate::compressor::{compress_new, decompress, decompress_add, Ctx};
    use crate::test_util::fuzz_decoder;
    use proptest::prelude::{
        any, prop, prop_assert, prop_assert_eq, prop_oneof, proptest, Just, ProptestConfig,
    };

    /// Standard normal by Box–Muller.
    fn gauss(rng: &mut Rng) -> f32 {
        let u = rng.next_f64().max(1e-300);
        let v = rng.next_f64();
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }

    /// Laplace(0, 1) by inversion.
    fn laplace(rng: &mut Rng) -> f32 {
        let u = rng.next_f64() - 0.5;
        (-(u.signum()) * (1.0 - 2.0 * u.abs()).max(1e-300).ln()) as f32
    }

    /// Student-t with 2 degrees of freedom (heavy tails, infinite variance).
    fn student2(rng: &mut Rng) -> f32 {
        let z = gauss(rng) as f64;
        let c: f64 = (0..2).map(|_| (gauss(rng) as f64).powi(2)).sum();
        (z / (c / 2.0).max(1e-12).sqrt()) as f32
    }

    fn sample(dist: usize, n: usize, scale: f32, seed: u64) -> Vec<f32> {
        let mut rng = Rng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                scale
                    * match dist {
                        0 => gauss(&mut rng),
                        1 => laplace(&mut rng),
                        _ => student2(&mut rng),
                    }
            })
            .collect()
    }

    /// Per layer of the payload: the (index, value) pairs it carries, via the decoder.
    fn kept_entries(bytes: &[u8], n: usize) -> Vec<Vec<(usize, f32)>> {
        let (mut r, segs) = read_frame(MethodId::Mipd, bytes, n).unwrap();
        let mut out = Vec::new();
        for s in segs {
            let mut v = Vec::new();
            decode_layer(&mut r, s.len(), |i, x| v.push((i, x))).unwrap();
            out.push(v);
        }
        assert_eq!(r.remaining(), 0);
        out
    }

    /// Independent reference of the keep rule: sort, accumulate, clamp.
    fn brute_keep(scores: &[f32], cfg: &MipdConfig) -> usize {
        let n = scores.len();
        let k_min = ((cfg.min_ratio * n as f64).ceil() as usize).clamp(1, n);
        let k_max = ((cfg.max_ratio * n as f64).ceil() as usize).clamp(k_min, n);
        let mut s: Vec<f64> = scores.iter().map(|&x| x as f64).collect();
        let total: f64 = s.iter().sum();
        if total == 0.0 {
            return k_min;
        }
        s.sort_by(|a, b| b.total_cmp(a));
        let mut acc = 0.0;
        let mut k = n;
        for (i, x) in s.iter().enumerate() {
            acc += x;
            if acc >= cfg.mass * total {
                k = i + 1;
                break;
            }
        }
        k.clamp(k_min, k_max)
    }

    /// A six-layer model: parameters and gradients of different distributions and scales.
    fn model(seed: u64) -> (Vec<f32>, Vec<f32>, Vec<Range<usize>>) {
        let sizes = [4000usize, 40, 2000, 25, 700, 3];
        let (mut w, mut g, mut layers, mut at) = (Vec::new(), Vec::new(), Vec::new(), 0);
        for (l, &n) in sizes.iter().enumerate() {
            let s = seed * 100 + l as u64;
            w.extend(sample(l % 3, n, 0.1 * (l + 1) as f32, s));
            g.extend(sample((l + 1) % 3, n, 0.01 / (l + 1) as f32, s + 50));
            layers.push(at..at + n);
            at += n;
        }
        (w, g, layers)
    }

    #[test]
    fn fast_gamma_reader_agrees_with_the_bitwise_decoder() {
        let vals: Vec<u32> = (1..3000u32)
            .chain([1 << 27, (1 << 28) - 1, 1 << 28, u32::MAX, 1 << 31, 5, 1])
            .collect();
        let bits: u64 = vals.iter().map(|&v| elias_gamma_len(v)).sum();
        let mut buf = vec![0u8; bytes_for_bits(bits)];
        let mut w = BitWriter::new(&mut buf);
        for &v in &vals {
            elias_gamma_put(&mut w, v);
        }
        w.finish();
        let mut fast = GammaReader { buf: &buf, pos: 0 };
        let mut slow = BitReader::new(&buf);
        for &v in &vals {
            assert_eq!(fast.get(), Some(v));
            assert_eq!(crate::wire::elias_gamma_get(&mut slow), Some(v));
            assert_eq!(fast.pos, slow.bits_read());
        }
        // 32+ zeros are malformed; reads past the end are zeros.
        let mut z = GammaReader {
            buf: &[0u8; 5],
            pos: 0,
        };
        assert_eq!(z.get(), None);
    }

    #[test]
    fn layer_keep_counts_match_the_adaptive_ratio() {
        for (mass, min_ratio, max_ratio, sig) in [
            (0.5, 0.001, 0.05, Significance::Taylor),
            (0.5, 0.001, 1.0, Significance::Taylor),
            (0.9, 0.01, 0.3, Significance::Gradient),
            (1.0, 0.2, 1.0, Significance::Taylor),
        ] {
            let cfg = MipdConfig {
                mass,
                min_ratio,
                max_ratio,
                significance: sig,
                ..MipdConfig::default()
            };
            let mut c = cfg.init().unwrap();
            for seed in 0..3 {
                let (w, g, layers) = model(seed);
                let mut bytes = Vec::new();
                c.encode(&w, &g, &layers, &mut bytes).unwrap();
                let kept = kept_entries(&bytes, g.len());
                let mut scores = Vec::new();
                for (l, r) in layers.iter().enumerate() {
                    significance(
                        cfg.significance,
                        Some(&w[r.clone()]),
                        &g[r.clone()],
                        &mut scores,
                    );
                    let k = brute_keep(&scores, &cfg);
                    let stats = c.last_stats()[l];
                    assert_eq!(stats.kept, k, "layer {l} cfg {cfg:?}");
                    assert_eq!(kept[l].len(), k, "layer {l}: payload carries ρ_l·n entries");
                    assert_eq!(stats.ratio(), k as f64 / r.len() as f64);
                    // The kept entries are the most significant ones.
                    let mut is_kept = vec![false; r.len()];
                    kept[l].iter().for_each(|&(i, _)| is_kept[i] = true);
                    let min_kept = (0..r.len())
                        .filter(|&i| is_kept[i])
                        .map(|i| scores[i])
                        .fold(f32::INFINITY, f32::min);
                    let max_dropped = (0..r.len())
                        .filter(|&i| !is_kept[i])
                        .map(|i| scores[i])
                        .fold(0.0, f32::max);
                    assert!(min_kept >= max_dropped, "layer {l}");
                }
            }
        }
    }

    #[test]
    fn keep_ratio_adapts_to_the_score_distribution() {
        let cfg = MipdConfig {
            mass: 0.5,
            min_ratio: 0.0001,
            max_ratio: 1.0,
            ..MipdConfig::default()
        };
        let mut keys = Vec::new();
        // Flat scores: half the entries hold half the mass.
        let flat = vec![1.0f32; 1000];
        assert_eq!(keep_count(&flat, &cfg, &mut keys), 500);
        // One dominant entry holds more than half the mass.
        let mut peaked = vec![0.001f32; 1000];
        peaked[123] = 10.0;
        assert_eq!(keep_count(&peaked, &cfg, &mut keys), 1);
        // All-zero scores keep the lower bound; the upper bound caps.
        assert_eq!(keep_count(&[0.0; 1000], &cfg, &mut keys), 1);
        let capped = MipdConfig {
            max_ratio: 0.1,
            ..cfg.clone()
        };
        assert_eq!(keep_count(&flat, &capped, &mut keys), 100);
        // Random layers: the quickselect agrees with the sorted reference.
        for seed in 0..20 {
            let s: Vec<f32> = sample(seed as usize % 3, 1 + 997 * seed as usize, 1.0, seed)
                .iter()
                .map(|x| x.abs())
                .collect();
            assert_eq!(
                keep_count(&s, &cfg, &mut keys),
                brute_keep(&s, &cfg),
                "seed {seed}"
            );
        }
    }

    #[test]
    fn taylor_significance_uses_the_parameters() {
        // Same gradients; the parameters decide which entries matter.
        let g = [1.0f32, 0.5, 0.25, 0.125];
        let w = [0.0f32, 0.0, 0.0, 100.0];
        let cfg = MipdConfig {
            mass: 0.5,
            min_ratio: 0.25,
            max_ratio: 0.25,
            ..MipdConfig::default()
        };
        let mut c = cfg.init().unwrap();
        let mut bytes = Vec::new();
        c.encode(&w, &g, &[], &mut bytes).unwrap();
        assert_eq!(kept_entries(&bytes, 4)[0], vec![(3, 0.125)]);
        let mut c = MipdConfig {
            significance: Significance::Gradient,
            ..cfg.clone()
        }
        .init()
        .unwrap();
        c.encode(&w, &g, &[], &mut bytes).unwrap();
        assert_eq!(kept_entries(&bytes, 4)[0], vec![(0, 1.0)]);
        // All-zero parameters (fresh biases): falls back to |g|.
        let mut c = cfg.init().unwrap();
        c.encode(&[0.0; 4], &g, &[], &mut bytes).unwrap();
        assert_eq!(kept_entries(&bytes, 4)[0], vec![(0, 1.0)]);
    }

    /// MSE of the uniform mid-rise quantizer with `l` levels on `[min, max]`.
    fn uniform_mse(sorted: &[f32], l: usize) -> f64 {
        let (lo, hi) = (sorted[0] as f64, sorted[sorted.len() - 1] as f64);
        let step = (hi - lo) / l as f64;
        let se: f64 = sorted
            .iter()
            .map(|&v| {
                let cell = (((v as f64 - lo) / step).floor() as usize).min(l - 1);
                let q = (lo + (cell as f64 + 0.5) * step) as f32;
                ((v - q) as f64).powi(2)
            })
            .sum();
        se / sorted.len() as f64
    }

    #[test]
    fn codebook_mse_is_at_most_the_uniform_quantizers() {
        for dist in 0..3 {
            for bits in 1..=6u32 {
                let mut v = sample(dist, 5000, 0.01, 7 + dist as u64);
                v.sort_unstable_by(f32::total_cmp);
                let l = 1usize << bits;
                let cb = fit_codebook(&v, l, 10);
                assert!(cb.len() <= l && !cb.is_empty());
                assert!(cb.windows(2).all(|p| p[0] < p[1]), "strictly ascending");
                let ours = quantization_mse(&v, &cb);
                let uni = uniform_mse(&v, l);
                assert!(
                    ours <= uni * (1.0 + 1e-6),
                    "dist {dist} bits {bits}: code-book {ours} vs uniform {uni}"
                );
                // On heavy tails the fitted code-book wins by a wide margin.
                if dist == 2 && bits >= 3 {
                    assert!(
                        ours < 0.75 * uni,
                        "dist {dist} bits {bits}: {ours} vs {uni}"
                    );
                }
            }
        }
        // End to end: the decoded values of a fully kept layer carry that error.
        let g = sample(1, 3000, 0.02, 99);
        let mut c = MipdConfig {
            mass: 1.0,
            min_ratio: 1.0,
            max_ratio: 1.0,
            bits: 3,
            ..MipdConfig::default()
        }
        .init()
        .unwrap();
        let mut bytes = Vec::new();
        c.encode(&vec![1.0; g.len()], &g, &[], &mut bytes).unwrap();
        let mut out = vec![0f32; g.len()];
        decompress(&c, &bytes, &mut out).unwrap();
        let mse: f64 = g
            .iter()
            .zip(&out)
            .map(|(&a, &b)| ((a - b) as f64).powi(2))
            .sum::<f64>()
            / g.len() as f64;
        let mut sorted = g.clone();
        sorted.sort_unstable_by(f32::total_cmp);
        assert!(mse <= uniform_mse(&sorted, 8) * (1.0 + 1e-6));
        let mut distinct = out.clone();
        distinct.sort_unstable_by(f32::total_cmp);
        distinct.dedup();
        assert!(distinct.len() <= 8);
    }

    #[test]
    fn round_trip_is_exact_for_indices_and_codes() {
        let mut rng = Rng::seed_from_u64(5);
        for (n, ratio, bits) in [
            (10_000usize, 0.01, 4u32),
            (10_000, 0.5, 2),
            (37, 0.2, 1),
            (1, 1.0, 16),
        ] {
            // Values from a set of 2^bits distinct values: the code-book is exact.
            let set: Vec<f32> = (0..1usize << bits.min(4))
                .map(|i| (i as f32 - 3.5) * 0.01)
                .collect();
            let g: Vec<f32> = (0..n)
                .map(|_| set[rng.below(set.len() as u64) as usize])
                .collect();
            let w: Vec<f32> = (0..n).map(|_| rng.next_f32() + 0.5).collect();
            let cfg = MipdConfig {
                min_ratio: ratio,
                max_ratio: ratio,
                bits,
                ..MipdConfig::default()
            };
            let mut c = cfg.init().unwrap();
            let mut bytes = Vec::new();
            c.encode(&w, &g, &[], &mut bytes).unwrap();
            let mut scores = Vec::new();
            significance(cfg.significance, Some(&w), &g, &mut scores);
            let k = crate::topk::k_for(n, ratio);
            let mut want = Vec::new();
            top_k(
                n,
                k,
                |i| abs_key(scores[i]),
                &mut Scratch::default(),
                &mut want,
            );
            let got = &kept_entries(&bytes, n)[0];
            let got_idx: Vec<u32> = got.iter().map(|&(i, _)| i as u32).collect();
            assert_eq!(got_idx, want, "indices exact (n {n} ratio {ratio})");
            for &(i, v) in got {
                assert_eq!(v.to_bits(), g[i].to_bits(), "value exact");
            }
            let s = c.last_stats()[0];
            assert_eq!(
                s.bitmap,
                ratio >= 0.5 && n > 8,
                "layout choice, n {n} ratio {ratio}"
            );
            assert_eq!(s.bytes + 12, bytes.len());
            // The same payload through the generic decoder.
            let mut out = vec![0f32; n];
            decompress(&c, &bytes, &mut out).unwrap();
            for &(i, v) in got {
                assert_eq!(out[i], v);
            }
        }
        // Through the generic Compressor seam (|g| significance).
        let g = sample(0, 500, 1.0, 3);
        let mut c = MipdConfig::default().init().unwrap();
        let segs = [0..200, 200..500];
        let ctx = Ctx {
            segments: &segs,
            ..Ctx::default()
        };
        let p = compress_new(&mut c, &g, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        let p2 = compress_new(&mut c, &g, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        assert_eq!((p.as_bytes(), c.last_stats().len()), (p2.as_bytes(), 2));
        let mut mine = MipdConfig {
            significance: Significance::Gradient,
            ..MipdConfig::default()
        }
        .init()
        .unwrap();
        let mut bytes = Vec::new();
        mine.encode(&vec![0.0; 500], &g, &segs, &mut bytes).unwrap();
        assert_eq!(p.as_bytes(), &bytes[..]);
    }

    #[test]
    fn bad_config_and_bad_input_are_errors() {
        let ok = MipdConfig::default();
        ok.init().unwrap();
        let bad = [
            MipdConfig {
                bits: 0,
                ..ok.clone()
            },
            MipdConfig {
                bits: 17,
                ..ok.clone()
            },
            MipdConfig {
                mass: 0.0,
                ..ok.clone()
            },
            MipdConfig {
                mass: 1.5,
                ..ok.clone()
            },
            MipdConfig {
                mass: f64::NAN,
                ..ok.clone()
            },
            MipdConfig {
                min_ratio: 0.0,
                ..ok.clone()
            },
            MipdConfig {
                min_ratio: f64::NAN,
                ..ok.clone()
            },
            MipdConfig {
                max_ratio: 1.01,
                ..ok.clone()
            },
            MipdConfig {
                max_ratio: f64::NAN,
                ..ok.clone()
            },
            MipdConfig {
                min_ratio: 0.5,
                max_ratio: 0.1,
                ..ok.clone()
            },
            MipdConfig {
                lloyd_iters: 1001,
                ..ok.clone()
            },
        ];
        for b in bad {
            let e = b.init().unwrap_err();
            assert!(!e.reason.is_empty(), "{b:?}");
        }
        for lambda in [-0.1, 1.1, f64::NAN, f64::INFINITY] {
            let s = MipdServerConfig {
                lambda,
                ..MipdServerConfig::default()
            };
            assert_eq!(s.init(4, &[]).unwrap_err().field, "lambda");
        }
        assert!(MipdServerConfig::default().init(4, &[0..2, 3..4]).is_err());
        let cfg: MipdConfig = toml::from_str("significance = \"gradient\"\nbits = 8").unwrap();
        assert_eq!(
            (cfg.significance, cfg.bits, cfg.mass),
            (Significance::Gradient, 8, 0.5)
        );
        assert!(toml::from_str::<MipdConfig>("bitz = 3").is_err());
        let s: MipdServerConfig = toml::from_str("lambda = 0.9\nhalves = \"interleaved\"").unwrap();
        assert_eq!(s.halves, Halves::Interleaved);

        let mut c = ok.init().unwrap();
        let mut out = Vec::new();
        assert!(c.encode(&[1.0], &[1.0, 2.0], &[], &mut out).is_err());
        assert!(matches!(
            c.encode(&[1.0, f32::NAN], &[1.0, 2.0], &[], &mut out),
            Err(CompressError::NonFinite { index: 1, .. })
        ));
        assert!(c
            .encode(&[1.0, 1.0], &[f32::INFINITY, 2.0], &[], &mut out)
            .is_err());
        assert!(c
            .encode(
                &[1.0, 1.0],
                &[1.0, 2.0],
                std::slice::from_ref(&(0..1)),
                &mut out
            )
            .is_err());
        c.encode(&[], &[], &[], &mut out).unwrap();
        decompress(&c, &out, &mut []).unwrap();
    }

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
        wrong_method[2] = MethodId::TopK as u8;
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

    #[test]
    fn decoder_survives_mutated_payloads() {
        let mut c = MipdConfig {
            max_ratio: 0.4,
            bits: 3,
            ..MipdConfig::default()
        }
        .init()
        .unwrap();
        let mut valid = Vec::new();
        for (n, layers) in [
            (300usize, vec![0..200, 200..300]),
            (40, vec![]),
            (1, vec![]),
        ] {
            let mut b = Vec::new();
            for dist in 0..3 {
                c.encode(
                    &sample(0, n, 1.0, 4),
                    &sample(dist, n, 0.1, dist as u64),
                    &layers,
                    &mut b,
                )
                .unwrap();
                valid.push((b.clone(), n));
            }
        }
        fuzz_decoder(&c, &valid, 4000, 17);
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
        fn decoders_survive_arbitrary_bytes(
            body in proptest::collection::vec(any::<u8>(), 0..400),
            n in 0usize..300,
            segs in 0u32..4,
        ) {
            let c = MipdConfig::default().init().unwrap();
            // Arbitrary bytes, and arbitrary bodies behind a valid header.
            let mut out = vec![0f32; n];
            let _ = decompress_add(&c, &body, &mut out);
            let mut framed = vec![
                crate::compressor::MAGIC,
                crate::compressor::VERSION,
                MethodId::Mipd as u8,
                0,
            ];
            framed.extend_from_slice(&(n as u32).to_le_bytes());
            framed.extend_from_slice(&(if n == 0 { 0 } else { segs.clamp(1, n as u32) }).to_le_bytes());
            framed.extend_from_slice(&body);
            if decompress_add(&c, &framed, &mut out).is_ok() {
                prop_assert!(out.iter().all(|v| v.is_finite()));
            }
            let mut r = Reader::new(&body);
            let mut seen = Vec::new();
            if decode_layer(&mut r, n, |i, v| seen.push((i, v))).is_ok() {
                prop_assert!(seen.windows(2).all(|p| p[0].0 < p[1].0));
                prop_assert!(seen.iter().all(|&(i, v)| i < n && v.is_finite()));
            }
            // The server, and pulls.
            let mut server = MipdServerConfig::default().init(n, &[]).unwrap();
            let mut pull = Vec::new();
            if server.aggregate(0, &[&framed], &mut pull).is_err() {
                prop_assert_eq!(server.next_step(), 0);
            }
            for halves in [Halves::Off, Halves::Blocked, Halves::Interleaved] {
                let _ = decode_pull(halves, &[], &body, &mut out);
            }
        }

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
