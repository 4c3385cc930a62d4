//! `terngrad`: stochastic ternarization of Wen et al. (ALGORITHMS.md §5).
//!
//! Per segment (layer) `g` of `n` elements:
//! ```text
//! if c > 0 and σ > 0:  σ = std(g) (population, f64, two passes);  g ← clamp(g, −cσ, +cσ)
//! s   = max_j |g_j|                           (the scaler; or the shared one, see below)
//! b_j ~ Bernoulli(|g_j| / s)                  (drawn with the encoder's Rng)
//! t_j = s · sign(g_j) · b_j ∈ {−s, 0, +s}
//! ```
//! `E[t] = clip(g)` (unbiased with respect to the *clipped* gradient; clipping makes it
//! biased with respect to `g`), and `Var t_j = |g_j|(s − |g_j|)`.
//!
//! ## Body, per segment of `n` elements
//! ```text
//! f32        s (finite, ≥ 0)
//! ⌈n/4⌉ B    symbols t/s + 1 ∈ {0, 1, 2} (code 3 is invalid), 2 bits each, 4 per byte
//!            LSB-first; the unused bits of the last byte are zero. When s = 0 every
//!            symbol is 1.                                      bits: 32 + 8⌈n/4⌉
//! ```
//! 2 bits per element plus 32 per segment. Randomness: four draws of the encoder's Rng per
//! segment seed four xoshiro256++ lanes ([`LaneRng`]), which give element `8j + 2l` the low
//! and element `8j + 2l + 1` the high half of lane `l`'s `j`-th draw; each Bernoulli trial
//! uses the top 24 bits of its word.
//!
//! ## Configuration
//! `clip = c` (default 2.5); `clip = 0` disables clipping (TOML has no null). Clipping is
//! also skipped for a segment whose standard deviation is 0 (a constant segment, e.g. a
//! one-element bias): clamping to ±0 would erase the whole segment.
//!
//! ## Scaler sharing (pattern C, §5.2/§5.4)
//! Before compressing, each worker computes its per-segment scalers with
//! [`TernGrad::local_scales`], a caller all-reduces them with MAX, and every worker hands
//! the result to [`TernGrad::set_shared_scales`]. The next [`crate::compress`] call encodes
//! every segment with the shared scaler, so the payloads of all workers carry the same `s`
//! and their symbols can be summed as integers ([`sum_symbols`]), decoding to
//! `s · Σ_i t_i/s`. This is the API for it; **dtrain's exchanger does not call it**: each
//! worker ternarizes with its own scaler and the payloads are all-gathered (GRACE does the
//! same; the authors' TensorFlow code shares the MAX scaler). A worker's own scaler is at
//! most the shared one, so its variance `|g|(s − |g|)` is at most the shared scaler's.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::compressor::{
    effective_segments, first_non_finite, Aggregation, Compressor, Ctx, FirstNonFinite, MethodId,
    Payload,
};
use crate::error::{CompressError, ConfigError, WireError};
pub use crate::exact::Sum;
use crate::exact::{std_dev_of_sums, ExactSquares, ExactSum};
use crate::put::{put, put_mode, with_put_mode, Put};
use crate::registry::Method;
pub use crate::rng::Draws;
use crate::rng::{counter_bits, LaneRng, Rng};
use crate::simd::{max_magnitude_bits, vector_dispatch};
use crate::wire::{Reader, Writer};

/// Configuration of [`TernGrad`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TernGradConfig {
    /// Clip factor `c`: each segment is clamped to `±c·σ` before ternarizing. `0` disables
    /// clipping. Default 2.5 (the authors' `--clip_factor`).
    #[serde(default = "default_clip")]
    pub clip: f32,
    /// Where the Bernoulli trials' random bits come from: `lanes` (the default: four
    /// xoshiro256++ lanes seeded from the encoder's Rng, the fastest on a CPU) or
    /// `counter` (element `j` of a segment draws [`counter_bits`]`(key, j)`, the key one draw
    /// of the encoder's Rng per segment: the mode a device codec computes identically, so its
    /// payload can be checked byte for byte against the host's).
    #[serde(default, skip_serializing_if = "Draws::is_lanes")]
    pub draws: Draws,
    /// How the clipping's σ is accumulated: `f64` (the default: the two-pass formula in
    /// `f64`, in the host's order) or `exact` (σ from the segment's exact `Σx` and `Σx²`,
    /// [`std_dev_of_sums`]: order-free, the mode a device codec computes identically).
    #[serde(default, skip_serializing_if = "Sum::is_f64")]
    pub sum: Sum,
}

fn default_clip() -> f32 {
    2.5
}

impl Default for TernGradConfig {
    fn default() -> Self {
        TernGradConfig {
            clip: default_clip(),
            draws: Draws::Lanes,
            sum: Sum::F64,
        }
    }
}

impl Method for TernGradConfig {
    const NAME: &'static str = "terngrad";
    const ABOUT: &'static str =
        "TernGrad: per-layer scaler, clip to ±cσ, stochastic {-1,0,1} (2 bits/element)";
    const ID: MethodId = MethodId(9);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()?))
    }
}

impl TernGradConfig {
    /// Checks the parameters and builds the compressor.
    pub fn init(&self) -> Result<TernGrad, ConfigError> {
        if !(self.clip.is_finite() && self.clip >= 0.0) {
            return Err(ConfigError::new(
                "clip",
                format!("must be finite and >= 0 (0 disables), got {}", self.clip),
            ));
        }
        Ok(TernGrad {
            clip: self.clip,
            draws: self.draws,
            sum: self.sum,
            pending: None,
            active: None,
            segment: 0,
            non_finite: FirstNonFinite::default(),
        })
    }
}

/// TernGrad ternarizer.
#[derive(Debug, Clone)]
pub struct TernGrad {
    clip: f32,
    draws: Draws,
    sum: Sum,
    /// Shared scalers for the next `compress` call.
    pending: Option<Vec<f32>>,
    /// Shared scalers of the call in progress.
    active: Option<Vec<f32>>,
    /// Index of the next segment of the call in progress.
    segment: usize,
    non_finite: FirstNonFinite,
}

vector_dispatch! {
    /// `Σ x` in `f64` (eight lanes, then the tail) and `max |x|`, in one pass over `x`.
    fn sum_and_max_abs(x: &[f32]) -> (f64, f32) = sum_and_max_abs_lanes;
}

#[inline(always)]
fn sum_and_max_abs_lanes(x: &[f32]) -> (f64, f32) {
    let mut acc = [0f64; 8];
    let mut m = [0f32; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for k in 0..8 {
            acc[k] += c[k] as f64;
            let a = c[k].abs();
            m[k] = if a > m[k] { a } else { m[k] };
        }
    }
    let rest = it.remainder();
    let sum = acc.iter().sum::<f64>() + rest.iter().map(|&v| v as f64).sum::<f64>();
    let mut r = rest.iter().fold(0f32, |m, v| m.max(v.abs()));
    for v in m {
        r = r.max(v);
    }
    (sum, r)
}

vector_dispatch! {
    /// Population standard deviation of `x` given `sum = Σ x` from [`sum_and_max_abs`]: the
    /// second pass of the two-pass formula, in `f64`.
    fn std_dev_from_sum(x: &[f32], sum: f64) -> f64 = std_dev_lanes;
}

#[inline(always)]
fn std_dev_lanes(x: &[f32], sum: f64) -> f64 {
    let n = x.len() as f64;
    let mean = sum / n;
    let mut acc = [0f64; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for k in 0..8 {
            let d = c[k] as f64 - mean;
            acc[k] += d * d;
        }
    }
    let ss: f64 = acc.iter().sum::<f64>()
        + it.remainder()
            .iter()
            .map(|&v| (v as f64 - mean) * (v as f64 - mean))
            .sum::<f64>();
    (ss / n).sqrt()
}

/// The population standard deviation of finite `x` from its exact sums
/// ([`std_dev_of_sums`]).
pub fn exact_std_dev(x: &[f32]) -> f64 {
    let (mut pos, mut neg) = (ExactSum::default(), ExactSum::default());
    for &v in x {
        // The sign bit decides, as the device's classes do (−0.0 adds 0 either way).
        if v.is_sign_negative() {
            neg.add_abs(v);
        } else {
            pos.add_abs(v);
        }
    }
    std_dev_of_sums(&pos, &neg, &ExactSquares::of(x), x.len())
}

/// `max |x|`, as the largest magnitude's bits ([`max_magnitude_bits`]): non-finite exactly
/// when `x` holds a NaN or ±∞.
fn max_abs(x: &[f32]) -> f32 {
    f32::from_bits(max_magnitude_bits(x))
}

impl TernGrad {
    /// The clipping bound `c·σ` of a segment as `f32` (`f32::INFINITY` when not clipping).
    pub fn clip_bound(&self, x: &[f32]) -> f32 {
        self.bound_and_scale(x).0
    }

    /// This worker's scaler for one segment: `max|clip(x)|`; NaN when `x` holds a NaN or an
    /// infinity (which [`TernGrad::set_shared_scales`] refuses).
    pub fn local_scale(&self, x: &[f32]) -> f32 {
        self.bound_and_scale(x).1
    }

    /// The clipping bound and the local scaler `max|clip(x)|` of a segment, in two passes
    /// over `x` when clipping (`Σx` and `max|x|` together, then `Σ(x − mean)²`), one when not.
    fn bound_and_scale(&self, x: &[f32]) -> (f32, f32) {
        self.checked_bound_and_scale(x)
            .unwrap_or((f32::INFINITY, f32::NAN))
    }

    /// [`TernGrad::bound_and_scale`], or `None` when `x` holds a NaN or an infinity: the
    /// first pass finds it at no cost (a sum of finite `f32` values cannot overflow `f64`,
    /// so `Σx` is finite exactly when every element is; unclipped, `max|x|` is non-finite
    /// exactly then, see [`max_abs`]).
    fn checked_bound_and_scale(&self, x: &[f32]) -> Option<(f32, f32)> {
        if self.clip == 0.0 || x.is_empty() {
            let m = max_abs(x);
            return m.is_finite().then_some((f32::INFINITY, m));
        }
        let sd = match self.sum {
            Sum::F64 => {
                let (sum, m) = sum_and_max_abs(x);
                if !sum.is_finite() {
                    return None;
                }
                (std_dev_from_sum(x, sum), m)
            }
            Sum::Exact => {
                let m = max_abs(x);
                if !m.is_finite() {
                    return None;
                }
                (exact_std_dev(x), m)
            }
        };
        let (sd, m) = sd;
        let b = (self.clip as f64 * sd) as f32;
        let bound = if b > 0.0 { b } else { f32::INFINITY };
        Some((bound, m.min(bound)))
    }

    /// This worker's scalers for every segment of `grad` (`segments` as in [`Ctx`]; empty
    /// means one segment). These are what a caller sharing scalers all-reduces with MAX
    /// before calling [`TernGrad::set_shared_scales`] (see "Scaler sharing" above).
    pub fn local_scales(
        &self,
        grad: &[f32],
        segments: &[Range<usize>],
    ) -> Result<Vec<f32>, CompressError> {
        let segs = effective_segments(grad.len(), segments)?;
        Ok(segs
            .iter()
            .map(|s| self.local_scale(&grad[s.clone()]))
            .collect())
    }

    /// Sets the shared per-segment scalers used by the **next** compress call only (one per
    /// segment, in order). A segment whose local `max|clip(g)|` exceeds the shared scaler
    /// is clamped to it (never the case when the shared value is the all-reduced MAX of
    /// [`TernGrad::local_scales`]); segments beyond the list use their local scaler.
    pub fn set_shared_scales(&mut self, scales: Vec<f32>) -> Result<(), ConfigError> {
        if let Some(bad) = scales.iter().find(|s| !(s.is_finite() && **s >= 0.0)) {
            return Err(ConfigError::new(
                "shared_scales",
                format!("scalers must be finite and >= 0, got {bad}"),
            ));
        }
        self.pending = Some(scales);
        Ok(())
    }
}

const U24: f32 = 1.0 / (1u32 << 24) as f32;
/// Elements per block of random draws (a multiple of 4, so blocks fill whole bytes).
const BLOCK: usize = 256;

vector_dispatch! {
    /// Ternarizes `x` (clamped to `±bound`) with scaler `s > 0` into `out` (`⌈len/4⌉`
    /// bytes).
    fn ternarize(x: &[f32], bound: f32, s: f32, rng: &mut Rng, out: &mut [u8]) = ternarize_lanes;
}

#[inline(always)]
fn ternarize_lanes(x: &[f32], bound: f32, s: f32, rng: &mut Rng, out: &mut [u8]) {
    let inv = 1.0 / s;
    let mut lanes = LaneRng::from_rng(rng);
    let mut rnd = [0u32; BLOCK];
    let mut sym = [0u8; BLOCK];
    for (xb, ob) in x.chunks(BLOCK).zip(out.chunks_mut(BLOCK / 4)) {
        let m = xb.len();
        lanes.fill_u32(&mut rnd[..m]);
        for ((t, &v), &bits) in sym.iter_mut().zip(xb).zip(&rnd[..m]) {
            let a = v.abs().min(bound);
            let p = if a >= s { 1.0 } else { a * inv };
            let u = ((bits >> 8) as i32) as f32 * U24;
            let b = (u < p) as u8;
            let neg = (v < 0.0) as u8;
            // 1 + b·sign: +1 → 2, −1 → 0, not sent → 1.
            *t = 1 + b - 2 * (b & neg);
        }
        sym[m..].fill(0);
        for (o, q) in ob.iter_mut().zip(sym.chunks_exact(4)) {
            *o = q[0] | (q[1] << 2) | (q[2] << 4) | (q[3] << 6);
        }
    }
}

/// [`ternarize`] with the counter-based draws of [`Draws::Counter`]: element `j`'s trial
/// uses the top 24 bits of [`counter_bits`]`(key, j)`, the rest is the same arithmetic
/// (`p = min(|x|, bound) · (1/s)`, 1 where `|x| ≥ s`; sent iff `u < p`).
fn ternarize_counter(x: &[f32], bound: f32, s: f32, key: u64, out: &mut [u8]) {
    let inv = 1.0 / s;
    for (k, (o, q)) in out.iter_mut().zip(x.chunks(4)).enumerate() {
        let mut byte = 0u8;
        for (l, &v) in q.iter().enumerate() {
            let a = v.abs().min(bound);
            let p = if a >= s { 1.0 } else { a * inv };
            let bits = counter_bits(key, (4 * k + l) as u32);
            let u = ((bits >> 8) as i32) as f32 * U24;
            let b = (u < p) as u8;
            let neg = (v < 0.0) as u8;
            byte |= (1 + b - 2 * (b & neg)) << (2 * l);
        }
        *o = byte;
    }
}

/// Reads and validates one segment body of `n` elements: the scaler and the symbol bytes
/// (public for decoders that check the body here and add the values elsewhere: the device
/// codec of `dtrain-device`).
pub fn read_segment<'a>(r: &mut Reader<'a>, n: usize) -> Result<(f32, &'a [u8]), WireError> {
    let s = r.f32("terngrad scaler")?;
    if !(s.is_finite() && s.is_sign_positive()) {
        return Err(WireError::Invalid(
            "terngrad scaler is negative or not finite",
        ));
    }
    let bytes = r.take(n.div_ceil(4), "terngrad symbols")?;
    let tail = n % 4;
    let last = bytes.last().copied().unwrap_or(0);
    if tail != 0 && last >> (2 * tail) != 0 {
        return Err(WireError::Invalid("terngrad padding bits are not zero"));
    }
    let mut bad = 0u8;
    for &b in bytes {
        bad |= b & (b >> 1) & 0x55;
    }
    if bad != 0 {
        return Err(WireError::Invalid("terngrad symbol 3 is invalid"));
    }
    if s == 0.0 {
        let full = &bytes[..n / 4];
        let last_ok = tail == 0 || last == 0x55 & ((1u8 << (2 * tail)) - 1);
        if !last_ok || full.iter().any(|&b| b != 0x55) {
            return Err(WireError::Invalid(
                "terngrad non-zero symbol with a zero scaler",
            ));
        }
    }
    Ok((s, bytes))
}

impl Compressor for TernGrad {
    fn method(&self) -> MethodId {
        TernGradConfig::ID
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }
    fn unbiased(&self) -> bool {
        // Unbiased with respect to the clipped gradient; with respect to the raw gradient
        // only when clipping is off.
        self.clip == 0.0
    }
    fn begin(&mut self, _grad: &[f32], _ctx: &Ctx<'_>) {
        self.active = self.pending.take();
        self.segment = 0;
        self.non_finite.reset();
    }
    fn encode_segment(&mut self, x: &[f32], rng: &mut Rng, w: &mut Writer<'_>) {
        let n = x.len();
        let stats = self.checked_bound_and_scale(x);
        let shared = self
            .active
            .as_ref()
            .and_then(|v| v.get(self.segment).copied());
        self.segment += 1;
        let at = self.non_finite.segment(n);
        let Some((bound, local)) = stats else {
            // Non-finite input: noted for `compress`, which discards these bytes.
            self.non_finite.note(at, first_non_finite(x));
            w.f32(0.0);
            w.zeroed(n.div_ceil(4)).fill(0);
            return;
        };
        let s = shared.unwrap_or(local);
        w.f32(s);
        let out = w.zeroed(n.div_ceil(4));
        // Counter mode draws its segment key whatever the scaler, so a device encoder knows
        // the stream's position without the scalers.
        let key = (self.draws == Draws::Counter).then(|| rng.next_u64());
        if s == 0.0 {
            out.fill(0x55);
            if !n.is_multiple_of(4) {
                out[n / 4] = 0x55 & ((1u8 << (2 * (n % 4))) - 1);
            }
            return;
        }
        match key {
            Some(key) => ternarize_counter(x, bound, s, key, out),
            None => ternarize(x, bound, s, rng, out),
        }
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        decode::<{ put_mode::ADD }>(r, out, 1.0).map(drop)
    }
    /// Every element has a symbol.
    fn decodes_densely(&self) -> bool {
        true
    }
    fn decode_segment_dense(
        &self,
        r: &mut Reader<'_>,
        out: &mut [f32],
        put: Put,
    ) -> Result<bool, WireError> {
        with_put_mode!(put, |M, k| decode::<M>(r, out, k))
    }
    fn segment_bits(&self, n: usize) -> Option<u64> {
        Some(32 + 8 * n.div_ceil(4) as u64)
    }
    /// The scaler's first pass finds every NaN and infinity: a sum of finite `f32` values
    /// cannot overflow `f64`, so `Σx` is finite exactly when the input is (unclipped,
    /// `max|x|` over the magnitudes' bits is non-finite exactly then).
    fn finds_non_finite(&self) -> bool {
        true
    }
    fn take_non_finite(&mut self) -> Option<(usize, f32)> {
        self.non_finite.take()
    }
}

/// One segment's body decoded into `out`, each value put there as the mode `M` says, with
/// factor `k` ([`put`]); whether a scaled value is non-finite.
fn decode<const M: u8>(r: &mut Reader<'_>, out: &mut [f32], k: f32) -> Result<bool, WireError> {
    let (s, bytes) = read_segment(r, out.len())?;
    let vals = [-s, 0.0, s, 0.0];
    let mut non_finite = false;
    let mut it = out.chunks_exact_mut(4);
    for (o, &b) in (&mut it).zip(bytes) {
        non_finite |= put::<M>(&mut o[0], vals[(b & 3) as usize], k);
        non_finite |= put::<M>(&mut o[1], vals[((b >> 2) & 3) as usize], k);
        non_finite |= put::<M>(&mut o[2], vals[((b >> 4) & 3) as usize], k);
        non_finite |= put::<M>(&mut o[3], vals[(b >> 6) as usize], k);
    }
    let rest = it.into_remainder();
    if !rest.is_empty() {
        // A partial group exists only when n % 4 ≠ 0, so the last byte is there.
        let b = bytes[bytes.len() - 1];
        for (j, o) in rest.iter_mut().enumerate() {
            non_finite |= put::<M>(o, vals[((b >> (2 * j)) & 3) as usize], k);
        }
    }
    Ok(non_finite)
}

/// The element-wise integer sum of the ternary symbols of several TernGrad payloads that
/// share their per-segment scalers (what an integer all-reduce on the symbol lanes yields).
#[derive(Debug, Clone, PartialEq)]
pub struct TernarySum {
    /// The shared scaler of each segment.
    pub scales: Vec<f32>,
    /// The length of each segment.
    pub segment_lens: Vec<usize>,
    /// `Σ_i t_i/s` per element, in `[−P, P]`.
    pub counts: Vec<i32>,
}

impl TernarySum {
    /// Adds `s · count` into `out` (the sum of the workers' decoded gradients).
    pub fn add_to(&self, out: &mut [f32]) -> Result<(), WireError> {
        if out.len() != self.counts.len() {
            return Err(WireError::LengthMismatch {
                payload: self.counts.len(),
                buffer: out.len(),
            });
        }
        let mut at = 0;
        for (&s, &len) in self.scales.iter().zip(&self.segment_lens) {
            for (o, &c) in out[at..at + len].iter_mut().zip(&self.counts[at..at + len]) {
                *o += s * c as f32;
            }
            at += len;
        }
        Ok(())
    }
}

/// Reads a TernGrad payload's header and segment lengths.
fn segment_lens(r: &mut Reader<'_>, bytes: &[u8]) -> Result<(usize, Vec<usize>), WireError> {
    let h = Payload::decode(bytes.to_vec())?.header()?;
    if h.method != TernGradConfig::ID.0 {
        return Err(WireError::WrongMethod {
            expected: TernGradConfig::ID.0,
            found: h.method,
        });
    }
    r.take(12, "header")?;
    let lens = if h.segments > 1 {
        let t = r.take_items(h.segments, 4, "segment table")?;
        let lens: Vec<usize> = (0..h.segments)
            .map(|i| crate::wire::u32_at(t, i) as usize)
            .collect();
        let mut total = 0usize;
        for &l in &lens {
            if l == 0 {
                return Err(WireError::BadSegments("empty segment"));
            }
            total = total
                .checked_add(l)
                .filter(|&t| t <= h.n)
                .ok_or(WireError::BadSegments("segments exceed n"))?;
        }
        if total != h.n {
            return Err(WireError::BadSegments("segments do not cover n"));
        }
        lens
    } else if h.n > 0 {
        vec![h.n]
    } else {
        Vec::new()
    };
    Ok((h.n, lens))
}

/// Sums the ternary symbols of `payloads` (pattern C with a shared scaler). Every payload
/// must be a valid TernGrad payload with the same length, segment layout and per-segment
/// scalers (bit for bit); anything else is a [`WireError`].
pub fn sum_symbols(payloads: &[&[u8]]) -> Result<TernarySum, WireError> {
    let mut result: Option<TernarySum> = None;
    for &bytes in payloads {
        let mut r = Reader::new(bytes);
        let (n, lens) = segment_lens(&mut r, bytes)?;
        let mut scales = Vec::with_capacity(lens.len());
        let acc = match &mut result {
            None => result.insert(TernarySum {
                scales: Vec::new(),
                segment_lens: lens.clone(),
                counts: vec![0; n],
            }),
            Some(acc) => {
                if acc.segment_lens != lens {
                    return Err(WireError::Invalid(
                        "payloads have different segment layouts",
                    ));
                }
                acc
            }
        };
        let mut at = 0;
        for &len in &lens {
            let (s, sym) = read_segment(&mut r, len)?;
            scales.push(s);
            for (k, c) in acc.counts[at..at + len].iter_mut().enumerate() {
                *c += ((sym[k / 4] >> (2 * (k % 4))) & 3) as i32 - 1;
            }
            at += len;
        }
        if r.remaining() != 0 {
            return Err(WireError::TrailingBytes(r.remaining()));
        }
        if acc.scales.is_empty() {
            acc.scales = scales;
        } else if acc
            .scales
            .iter()
            .zip(&scales)
            .any(|(a, b)| a.to_bits() != b.to_bits())
        {
            return Err(WireError::Invalid(
                "payloads were encoded with different scalers",
            ));
        }
    }
    result.ok_or(WireError::Invalid("no payloads to sum"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress, compress_new, decompress, decompress_add, payload_bits};
    use crate::test_util::{fuzz_decoder, test_vector};

    fn tern(clip: f32) -> TernGrad {
        TernGradConfig {
            clip,
            ..TernGradConfig::default()
        }
        .init()
        .unwrap()
    }

    /// Counter mode: the mean of many decodes (one key each) is the input (unbiased, clip
    /// off), every symbol depends only on its own element and the key (so a segment's
    /// encoding does not change when its neighbours do), and one draw of the Rng is used
    /// per segment, zero scalers included.
    #[test]
    fn counter_draws_are_unbiased_per_element_and_use_one_draw_per_segment() {
        use crate::compressor::{compress_new, decompress_add};
        let cfg = TernGradConfig {
            clip: 0.0,
            draws: Draws::Counter,
            ..TernGradConfig::default()
        };
        let mut c = cfg.init().unwrap();
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) / 17.0).collect();
        let (rounds, mut mean) = (4000, vec![0f64; x.len()]);
        for k in 0..rounds {
            let p = compress_new(&mut c, &x, &Ctx::default(), &mut Rng::seed_from_u64(k)).unwrap();
            let mut out = vec![0f32; x.len()];
            decompress_add(&c, p.as_bytes(), &mut out).unwrap();
            for (m, o) in mean.iter_mut().zip(&out) {
                *m += f64::from(*o) / rounds as f64;
            }
        }
        let s = x.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        for (m, &v) in mean.iter().zip(&x) {
            // Four standard errors of a ±s Bernoulli mean.
            assert!(
                (m - v as f64).abs() <= 4.0 * s / (rounds as f64).sqrt(),
                "{m} vs {v}"
            );
        }
        // Element j's symbol is a function of x_j and the key alone.
        let mut y = x.clone();
        y[5] = 0.01;
        let mut encode =
            |v: &[f32]| compress_new(&mut c, v, &Ctx::default(), &mut Rng::seed_from_u64(9));
        let (px, py) = (encode(&x).unwrap(), encode(&y).unwrap());
        let body = |p: &Payload| p.as_bytes()[16..].to_vec();
        let (bx, by) = (body(&px), body(&py));
        for j in (0..64).filter(|&j| j != 5) {
            assert_eq!(
                bx[j / 4] >> (2 * (j % 4)) & 3,
                by[j / 4] >> (2 * (j % 4)) & 3,
                "{j}"
            );
        }
        // Two segments, the first all zeros (scaler 0): two draws.
        let z = [0.0f32, 0.0, 1.0, -2.0];
        let segs = [0..2, 2..4];
        let mut rng = Rng::seed_from_u64(3);
        let ctx = Ctx {
            segments: &segs,
            ..Ctx::default()
        };
        compress_new(&mut c, &z, &ctx, &mut rng).unwrap();
        let mut two = Rng::seed_from_u64(3);
        two.next_u64();
        two.next_u64();
        assert_eq!(rng.next_u64(), two.next_u64());
    }

    /// The scaler's pass is the finiteness check, with and without clipping, and `max|x|`
    /// over the magnitudes' bits is the float maximum for finite input (signed zeros and
    /// subnormals included).
    #[test]
    fn every_vector_tier_computes_the_same_bits() {
        use crate::simd::assert_same_on_every_tier as same;
        let mut rng = Rng::seed_from_u64(11);
        for n in [0usize, 1, 7, 8, 9, 255, 256, 257, 1000, 4099] {
            let mut x: Vec<f32> = (0..n).map(|_| (rng.next_f32() - 0.5) * 0.02).collect();
            for (i, v) in [(3, -0.0), (5, f32::from_bits(1)), (6, 0.5), (n / 2, -0.3)] {
                if i < n {
                    x[i] = v;
                }
            }
            same("sum and max", || {
                let (s, m) = sum_and_max_abs(&x);
                (s.to_bits(), m.to_bits())
            });
            same("std dev", || std_dev_from_sum(&x, 0.123).to_bits());
            same("max abs", || max_abs(&x).to_bits());
            same("ternarize", || {
                let mut r = Rng::seed_from_u64(3);
                let mut out = vec![0u8; n.div_ceil(4)];
                ternarize(&x, 0.008, 0.007, &mut r, &mut out);
                (out, r)
            });
        }
    }

    #[test]
    fn scaler_pass_finds_non_finite_input_and_max_abs_is_the_float_maximum() {
        let segs = [0..700, 700..701, 701..5000];
        let ctx = Ctx {
            segments: &segs,
            ..Ctx::default()
        };
        let clean = test_vector(5000, 1.0, 2);
        for clip in [0.0, 2.5] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for at in [0, 699, 700, 701, 4999] {
                    let mut g = clean.clone();
                    g[at] = bad;
                    g[4999] = bad;
                    let e = compress_new(&mut tern(clip), &g, &ctx, &mut Rng::seed_from_u64(1));
                    assert!(
                        matches!(e, Err(CompressError::NonFinite { index, .. }) if index == at),
                        "clip {clip}, {bad} at {at}: {e:?}"
                    );
                }
            }
        }
        let mut x = test_vector(1001, 1.0, 3);
        x[3] = -0.0;
        x[10] = 1e-42;
        x[11] = -3e-41;
        for len in [0, 1, 7, 8, 9, 1001] {
            let want = x[..len].iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(max_abs(&x[..len]).to_bits(), want.to_bits(), "len {len}");
        }
        assert_eq!(
            max_abs(&[-0.0, 1e-42, -3e-41]).to_bits(),
            3e-41f32.to_bits()
        );
    }

    /// The clipped vector and the scaler, computed independently of the encoder.
    fn reference(g: &[f32], c: f32) -> (Vec<f32>, f32) {
        let n = g.len() as f64;
        let mean = g.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = g.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        let b = (c as f64 * var.sqrt()) as f32;
        let clipped: Vec<f32> = if c > 0.0 && b > 0.0 {
            g.iter().map(|&v| v.clamp(-b, b)).collect()
        } else {
            g.to_vec()
        };
        let s = clipped.iter().fold(0f32, |m, v| m.max(v.abs()));
        (clipped, s)
    }

    /// A vector with a few outliers so that clipping at 2.5σ binds.
    fn spiky(n: usize, seed: u64) -> Vec<f32> {
        let mut g = test_vector(n, 1.0, seed);
        g[1] = 9.0;
        g[n / 2] = -7.5;
        g
    }

    fn decode(c: &TernGrad, p: &Payload, n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n];
        decompress(c, p.as_bytes(), &mut out).unwrap();
        out
    }

    #[test]
    fn terngrad_values_are_ternary_and_scaler_is_max_of_clipped() {
        for (clip, n) in [(2.5f32, 1000usize), (1.0, 333), (0.0, 257)] {
            let g = spiky(n, n as u64);
            let (clipped, s_ref) = reference(&g, clip);
            let mut c = tern(clip);
            let p = compress_new(&mut c, &g, &Ctx::default(), &mut Rng::seed_from_u64(1)).unwrap();
            let s = f32::from_le_bytes(p.as_bytes()[12..16].try_into().unwrap());
            assert!(
                (s - s_ref).abs() <= 1e-6 * s_ref,
                "clip {clip}: s {s} vs {s_ref}"
            );
            if clip == 0.0 {
                assert_eq!(s, 9.0, "no clipping: s = max|g|");
            } else {
                assert!(s < 9.0, "clipping at {clip}σ binds on the outlier");
            }
            let q = decode(&c, &p, n);
            for (j, (&t, &v)) in q.iter().zip(&clipped).enumerate() {
                assert!(
                    t == 0.0 || t == s || t == -s,
                    "coord {j}: {t} not in {{0, ±{s}}}"
                );
                if t != 0.0 {
                    assert_eq!(t.is_sign_negative(), v.is_sign_negative());
                }
            }
        }
    }

    #[test]
    fn terngrad_monte_carlo_mean_is_the_clipped_gradient() {
        let n = 100;
        let g = spiky(n, 3);
        let (clipped, s) = reference(&g, 2.5);
        let mut c = tern(2.5);
        let t = 10_000;
        let mut sum = vec![0f64; n];
        let mut rng = Rng::seed_from_u64(5);
        let mut p = Payload::new();
        let mut out = vec![0f32; n];
        for _ in 0..t {
            compress(&mut c, &g, &Ctx::default(), &mut rng, &mut p).unwrap();
            decompress(&c, p.as_bytes(), &mut out).unwrap();
            for (a, &x) in sum.iter_mut().zip(&out) {
                *a += x as f64;
            }
        }
        let s = s as f64;
        for j in 0..n {
            let m = sum[j] / t as f64;
            let a = (clipped[j] as f64).abs();
            let se = (a * (s - a) / t as f64).sqrt();
            assert!(
                (m - clipped[j] as f64).abs() <= 5.0 * se + 1e-6 * s,
                "coord {j}: mean {m} vs clip(g) {}",
                clipped[j]
            );
        }
        // Biased with respect to the raw gradient on the clipped coordinates.
        let raw_err = (sum[1] / t as f64 - g[1] as f64).abs();
        assert!(
            raw_err > 1.0,
            "the outlier's mean stays at the clip bound, not at 9"
        );
    }

    #[test]
    fn terngrad_per_coordinate_variance_is_a_times_s_minus_a() {
        let n = 64;
        let g = test_vector(n, 1.0, 8);
        let (clipped, s) = reference(&g, 0.0);
        let mut c = tern(0.0);
        let t = 10_000;
        let (mut s1, mut s2) = (vec![0f64; n], vec![0f64; n]);
        let mut rng = Rng::seed_from_u64(6);
        let mut p = Payload::new();
        let mut out = vec![0f32; n];
        for _ in 0..t {
            compress(&mut c, &g, &Ctx::default(), &mut rng, &mut p).unwrap();
            decompress(&c, p.as_bytes(), &mut out).unwrap();
            for j in 0..n {
                s1[j] += out[j] as f64;
                s2[j] += (out[j] as f64).powi(2);
            }
        }
        let s = s as f64;
        for j in 0..n {
            let a = (clipped[j] as f64).abs();
            let want = a * (s - a);
            let mean = s1[j] / t as f64;
            let var = s2[j] / t as f64 - mean * mean;
            // Standard error of a sample variance: sqrt((μ4 − σ⁴)/T), with the Bernoulli
            // fourth central moment μ4 = s⁴ p(1−p)(1 − 3p + 3p²), p = a/s.
            let pr = a / s;
            let mu4 = s.powi(4) * pr * (1.0 - pr) * (1.0 - 3.0 * pr + 3.0 * pr * pr);
            let se = ((mu4 - want * want).max(0.0) / t as f64).sqrt();
            assert!(
                (var - want).abs() <= 5.0 * se + 1e-6 * s * s,
                "coord {j}: var {var} vs |g|(s−|g|) {want}"
            );
            assert!(want <= s * s / 4.0 + 1e-12);
        }
    }

    #[test]
    fn terngrad_packing_round_trips_with_padding() {
        // Deterministic symbols: with clip off and values in {−s, 0, +s}, p ∈ {0, 1}.
        let mut c = tern(0.0);
        for n in 1..=13usize {
            let g: Vec<f32> = (0..n).map(|i| [2.0f32, 0.0, -2.0][i % 3]).collect();
            let p = compress_new(&mut c, &g, &Ctx::default(), &mut Rng::seed_from_u64(0)).unwrap();
            let body = &p.as_bytes()[12..];
            assert_eq!(body.len(), 4 + n.div_ceil(4));
            assert_eq!(f32::from_le_bytes(body[..4].try_into().unwrap()), 2.0);
            for (i, &v) in g.iter().enumerate() {
                let sym = (body[4 + i / 4] >> (2 * (i % 4))) & 3;
                assert_eq!(sym, (v / 2.0 + 1.0) as u8, "n {n} element {i}");
            }
            if n % 4 != 0 {
                assert_eq!(body[body.len() - 1] >> (2 * (n % 4)), 0, "padding is zero");
            }
            assert_eq!(decode(&c, &p, n), g);
            assert_eq!(c.segment_bits(n), Some(32 + 8 * n.div_ceil(4) as u64));
            assert_eq!(payload_bits(&c, &[n]), Some(8 * p.encoded_len() as u64));
        }
        // All-zero segment: scaler 0, every symbol 1.
        let p = compress_new(
            &mut c,
            &[0.0; 6],
            &Ctx::default(),
            &mut Rng::seed_from_u64(0),
        )
        .unwrap();
        assert_eq!(&p.as_bytes()[12..], &[0, 0, 0, 0, 0x55, 0x05]);
        // Several segments: the formula holds per segment.
        let g = test_vector(1003, 1.0, 2);
        let segs = [0..3, 3..500, 500..1003];
        let ctx = Ctx {
            segments: &segs,
            ..Ctx::default()
        };
        let p = compress_new(&mut tern(2.5), &g, &ctx, &mut Rng::seed_from_u64(0)).unwrap();
        assert_eq!(
            payload_bits(&c, &[3, 497, 503]),
            Some(8 * p.encoded_len() as u64)
        );
    }

    #[test]
    fn terngrad_decoder_rejects_invalid_symbols_scalers_and_padding() {
        let mut c = tern(2.5);
        let g = test_vector(7, 1.0, 1);
        let base = compress_new(&mut c, &g, &Ctx::default(), &mut Rng::seed_from_u64(0))
            .unwrap()
            .into_bytes();
        let mut out = vec![0f32; 7];
        assert!(decompress(&c, &base, &mut out).is_ok());
        let mut bad = base.clone();
        bad[16] |= 3; // symbol 3
        assert!(decompress(&c, &bad, &mut out).is_err());
        let mut bad = base.clone();
        bad[17] |= 0x40; // padding of the last byte (7 = 4 + 3 symbols)
        assert!(decompress(&c, &bad, &mut out).is_err());
        for s in [f32::NAN, f32::INFINITY, -1.0] {
            let mut bad = base.clone();
            bad[12..16].copy_from_slice(&s.to_le_bytes());
            assert!(decompress(&c, &bad, &mut out).is_err(), "scaler {s}");
        }
        let mut bad = base.clone();
        bad[12..16].copy_from_slice(&0f32.to_le_bytes());
        bad[16] = 0x56; // a +1 symbol under a zero scaler
        assert!(decompress(&c, &bad, &mut out).is_err());
    }

    #[test]
    fn terngrad_shared_scaler_integer_sum_decodes_to_sum_of_decoded() {
        let p_workers = 4usize;
        let n = 1500;
        let segs = [0..700, 700..701, 701..1500];
        let grads: Vec<Vec<f32>> = (0..p_workers)
            .map(|i| {
                spiky(n, 40 + i as u64)
                    .iter()
                    .map(|v| v * (1.0 + i as f32))
                    .collect()
            })
            .collect();
        let mut workers: Vec<TernGrad> = (0..p_workers).map(|_| tern(2.5)).collect();
        // Each worker's local scalers, then the all-reduce MAX.
        let locals: Vec<Vec<f32>> = workers
            .iter()
            .zip(&grads)
            .map(|(w, g)| w.local_scales(g, &segs).unwrap())
            .collect();
        let shared: Vec<f32> = (0..segs.len())
            .map(|k| locals.iter().map(|l| l[k]).fold(0f32, f32::max))
            .collect();
        let mut payloads = Vec::new();
        for (rank, (w, g)) in workers.iter_mut().zip(&grads).enumerate() {
            w.set_shared_scales(shared.clone()).unwrap();
            let ctx = Ctx {
                rank: rank as u32,
                segments: &segs,
                ..Ctx::default()
            };
            let mut rng = Rng::for_step(7, 0, rank as u64, 0);
            payloads.push(compress_new(w, g, &ctx, &mut rng).unwrap().into_bytes());
        }
        let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_slice()).collect();
        let sum = sum_symbols(&refs).unwrap();
        assert_eq!(sum.scales, shared);
        assert!(sum.counts.iter().all(|c| c.abs() <= p_workers as i32));
        assert!(
            sum.counts.iter().any(|c| c.abs() >= 2),
            "symbols really add up"
        );
        let mut from_ints = vec![0f32; n];
        sum.add_to(&mut from_ints).unwrap();
        let mut from_decoded = vec![0f32; n];
        for p in &payloads {
            decompress_add(&workers[0], p, &mut from_decoded).unwrap();
        }
        for (k, r) in segs.iter().enumerate() {
            for i in r.clone() {
                let tol = 4.0 * f32::EPSILON * shared[k] * p_workers as f32;
                assert!(
                    (from_ints[i] - from_decoded[i]).abs() <= tol,
                    "element {i}: {} vs {}",
                    from_ints[i],
                    from_decoded[i]
                );
            }
        }
        // The shared scalers are one-shot: the next call uses local scalers again, and
        // payloads with different scalers are refused by the integer sum.
        let ctx = Ctx {
            segments: &segs,
            ..Ctx::default()
        };
        let local = compress_new(&mut workers[0], &grads[0], &ctx, &mut Rng::seed_from_u64(1))
            .unwrap()
            .into_bytes();
        assert!(sum_symbols(&[&local, &payloads[1]]).is_err());
        assert!(sum_symbols(&[&local]).is_ok());
        assert!(workers[0].set_shared_scales(vec![f32::NAN]).is_err());
    }

    #[test]
    fn terngrad_decoders_never_panic() {
        let mut c = tern(2.5);
        let mut valid = Vec::new();
        for n in [1usize, 3, 4, 9, 100] {
            let g = spiky(n.max(3), n as u64)[..n].to_vec();
            let segs = [0..n / 2, n / 2..n];
            let ctx = Ctx {
                segments: if n > 1 { &segs } else { &[] },
                ..Ctx::default()
            };
            let p = compress_new(&mut c, &g, &ctx, &mut Rng::seed_from_u64(n as u64)).unwrap();
            valid.push((p.into_bytes(), n));
        }
        fuzz_decoder(&c, &valid, 5000, 17);
        // The integer-sum helper parses the same bytes and must not panic either.
        let mut rng = Rng::seed_from_u64(3);
        for i in 0..2000 {
            let (base, _) = &valid[i % valid.len()];
            let mut b = base.clone();
            let at = rng.below(b.len() as u64) as usize;
            b[at] ^= 1 << rng.below(8);
            let _ = sum_symbols(&[&b, base]);
        }
    }

    /// `sum = "exact"`: the clipping bound from the exact sums — σ the two-pass formula's to
    /// rounding, the bound the same whatever the order of the elements — and the encoding
    /// otherwise the default's.
    #[test]
    fn exact_sums_give_the_clipping_bound_in_any_order() {
        let exact = TernGradConfig {
            sum: Sum::Exact,
            ..TernGradConfig::default()
        }
        .init()
        .unwrap();
        let plain = tern(2.5);
        let mut r = Rng::seed_from_u64(8);
        let mut x: Vec<f32> = (0..3000).map(|_| (r.next_f32() - 0.45) * 3.0).collect();
        x[7] = 40.0; // an outlier the bound clips
        let b = exact.clip_bound(&x);
        assert!(b < 40.0);
        assert!((b - plain.clip_bound(&x)).abs() <= 1e-6 * b, "{b}");
        x.reverse();
        assert_eq!(exact.clip_bound(&x).to_bits(), b.to_bits());
        assert_eq!(exact.local_scale(&x), b);
        // A constant segment (σ = 0) is not clipped; non-finite input has no bound.
        assert_eq!(exact.clip_bound(&[3.0; 5]), f32::INFINITY);
        assert!(exact.local_scale(&[1.0, f32::NAN]).is_nan());
    }

    #[test]
    fn terngrad_config_parses_and_validates() {
        let cfg: crate::CompressorConfig = toml::from_str("kind = \"terngrad\"\nclip = 0").unwrap();
        assert_eq!(
            cfg,
            crate::CompressorConfig::TernGrad(TernGradConfig {
                clip: 0.0,
                ..TernGradConfig::default()
            })
        );
        let bad: crate::CompressorConfig =
            toml::from_str("kind = \"terngrad\"\nclip = -1.0").unwrap();
        assert_eq!(bad.build().err().unwrap().field, "clip");
    }
}
