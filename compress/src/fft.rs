//! `fft`: FFT-domain gradient sparsification with range-float quantization (Wang et al.,
//! ALGORITHMS.md §1).
//!
//! Per segment (or per chunk of `chunk` elements), of length `n`:
//! 1. `X = rfft(x)`, `m = n/2 + 1` bins, weights `w_k = 1` for DC and (even `n`) Nyquist,
//!    else 2; bin energy `E_k = w_k|X_k|²` (so `Σ E_k / n = ‖x‖²`).
//! 2. Keep `K = m − ⌊θm⌋` bins: the `K` largest energies (ties → smaller `k`, exact O(m)
//!    selection by [`crate::select`]), or with `select = "lowpass"` bins `0..K`.
//! 3. Send the kept coefficients **normalised by `1/n`** (`Y_k = X_k/n`, bounded by
//!    `max|x|`), so the receiver's inverse is the plain unnormalised C2R transform and no
//!    value can overflow; `(Re Y_k, Im Y_k)` per kept bin in ascending `k`, RF-quantized
//!    (§2, round to nearest) under one `Emax` per chunk, or as raw `f32`.
//!
//! **DC and Nyquist**: their imaginary parts are identically zero and the inverse ignores
//! them. They keep their slot in the value stream but the slot is always written as exact
//! zero (RF code 0 / `0.0f32`) and the decoder rejects anything else. This costs at most
//! `2b` bits per chunk and makes the size a function of `n` and the configuration only
//! (instead of depending on whether DC/Nyquist were selected), so [`Compressor::segment_bits`]
//! is exact; nothing is quantized on those parts, so the error identity of §1.3 #11 holds.
//!
//! ## Body (one per chunk; chunks of a segment are consecutive)
//! ```text
//! u8   layout    0 = u32 index list, 1 = bitmap of m bits, 2 = prefix 0..K (lowpass)
//! u8   e         RF exponent bits (0: raw f32 values)
//! u8   q         RF mantissa bits (0 for f32)
//! u32  K         bins kept (≤ m)
//! index part     list: K × u32 ascending; bitmap: ⌈m/8⌉ bytes LSB-first; prefix: nothing
//! values         RF: i8 Emax, ⌈2K·b/8⌉ bytes of b-bit codes; f32: 2K × f32
//! ```
//! `index_coding = "auto"` takes the bitmap when `8⌈m/8⌉ < 32K` (density above 1/32).
//! Bits of a chunk: `56 + index + (8 + 2Kb | 64K)`; [`Fft::segment_bits`] sums the chunks
//! (each chunk but the last byte-aligned). With a bitmap that is ≈ `0.5 + (1−θ)·b`
//! bits/element (a bitmap over `m ≈ n/2` bins, two values per kept bin): ≈ 1.3 at θ = 0.9,
//! b = 8, as in §1.2.
//!
//! Deterministic and **biased** (an orthogonal projection when `quantize = false`).
//! Aggregation: all-gather (pattern B); receivers may sum spectra and run one inverse FFT
//! ([`FftSum`], the linearity shortcut of §0.4). Default memory: none, and θ is fixed by
//! default — so the defaults have neither of the two things that make a biased compressor
//! converge: the paper's guarantee needs a **diminishing θ** (set `theta_schedule`, evaluated
//! from `ctx.step` in [`Compressor::begin`], see [`crate::schedule`], or call
//! [`Fft::set_theta`] between steps), and error feedback (`error_feedback = true`) is the
//! other. Measured on LeNet-5 / Fashion-MNIST (experiments/README.md, "Equal accuracy"): the
//! defaults end 1.5 points under fp32, error feedback brings them within 0.2 at the same
//! bytes.
//!
//! Limits: the decoder refuses (with [`WireError::Invalid`]) a reconstruction that is not
//! finite, which honest payloads only produce for inputs near `f32::MAX / n`.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Mutex;

use realfft::num_complex::Complex;
use realfft::{ComplexToReal, RealFftPlanner};
use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, MethodId};
use crate::error::{ConfigError, WireError};
use crate::memory::AdoptedResidual;
use crate::put::Put;
use crate::rangefloat::{default_exp_bits, default_mantissa_bits, RfDecoder, RfFormat};
use crate::registry::{Collective, Method, RunFacts, RunUse};
use crate::rng::Rng;
use crate::schedule::ThetaSchedule;
use crate::simd::vector_dispatch;
use crate::wire::{bytes_for_bits, f32_at, u32_at, Reader, Writer};

mod encode;
mod feedback;
pub mod parts;
mod sum;

use encode::{encode_parallel, EncScratch, Encoding, Job};
use feedback::unpack_residual;
pub use sum::FftSum;

/// Which bins are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Select {
    /// The `K` bins of largest energy `w_k|X_k|²` (ties → smaller `k`).
    #[default]
    EnergyTopk,
    /// Bins `0..K` (no index part on the wire).
    Lowpass,
}

/// How the kept bin set is written (ignored by `lowpass`, which sends no indices).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IndexCoding {
    /// Whichever of bitmap and list is smaller.
    #[default]
    Auto,
    /// A bitmap of `m` bits.
    Bitmap,
    /// Ascending `u32` bin indices.
    List,
}

/// Where a device codec takes the FFT method's forward transforms ([`FftConfig::transform`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TransformAt {
    /// On the device, with its own kernels: spectra within rounding (~1e-6 of a chunk's
    /// largest bin) of the host's, so where two bins' energies nearly tie the device may
    /// keep another one than the host would.
    #[default]
    Device,
    /// On the host: the bucket is read back and transformed as the host codec does, so the
    /// device's payloads are the host codec's byte for byte.
    Host,
}

/// Configuration of [`Fft`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FftConfig {
    /// Drop ratio θ ∈ [0, 1): the fraction of the `m` bins set to zero. Default 0.9.
    #[serde(default = "default_theta")]
    pub theta: f64,
    /// RF exponent bits (1..=8). Default 4.
    #[serde(default = "default_exp_bits")]
    pub exp_bits: u8,
    /// RF mantissa bits (0..=23). Default 3.
    #[serde(default = "default_mantissa_bits")]
    pub mantissa_bits: u8,
    /// RF-quantize the kept coefficients (default true); false sends `f32`.
    #[serde(default = "default_true")]
    pub quantize: bool,
    /// `energy-topk` (default) or `lowpass`.
    #[serde(default)]
    pub select: Select,
    /// `auto` (default), `bitmap` or `list`.
    #[serde(default)]
    pub index_coding: IndexCoding,
    /// Transform length: `None` (default) = one transform per segment, else chunks of at
    /// most this many elements.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk: Option<usize>,
    /// Optional θ schedule evaluated at every [`Compressor::begin`] from `ctx.step` (it
    /// then overrides `theta`), e.g. `theta_schedule = { kind = "inv", theta0 = 0.9,
    /// tau = 1000 }`. Default none (θ fixed, or driven by [`Fft::set_theta`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub theta_schedule: Option<ThetaSchedule>,
    /// Optimizer steps per epoch, for schedules with epoch milestones (`step`): epoch =
    /// `step / steps_per_epoch`. Required (> 0) with a `step` schedule. Default 0.
    #[serde(default)]
    pub steps_per_epoch: u64,
    /// With classic residual error feedback (`error_feedback = true`), keep the residual as
    /// spectra (default true): the compensated spectrum is the gradient's plus the residual's,
    /// and the residual is what the quantized kept bins left out, so a step needs one
    /// forward transform and no inverse one of its own payload. Equal to the residual kept
    /// over the signal (false: the generic memory, as before) up to float rounding.
    #[serde(default = "default_true")]
    pub spectral_feedback: bool,
    /// Where a device codec (`[compress] device`) takes the forward transforms: `device`
    /// (default) or `host` ([`TransformAt`]). The host codec ignores it.
    #[serde(default)]
    pub transform: TransformAt,
}

fn default_theta() -> f64 {
    0.9
}
fn default_true() -> bool {
    true
}

impl Default for FftConfig {
    fn default() -> Self {
        FftConfig {
            theta: default_theta(),
            exp_bits: default_exp_bits(),
            mantissa_bits: default_mantissa_bits(),
            quantize: true,
            select: Select::EnergyTopk,
            index_coding: IndexCoding::Auto,
            chunk: None,
            theta_schedule: None,
            steps_per_epoch: 0,
            spectral_feedback: true,
            transform: TransformAt::Device,
        }
    }
}

fn check_theta(theta: f64) -> Result<(), ConfigError> {
    if !(0.0..1.0).contains(&theta) {
        return Err(ConfigError::new(
            "theta",
            format!("must be in [0, 1), got {theta}"),
        ));
    }
    Ok(())
}

impl Method for FftConfig {
    const NAME: &'static str = "fft";
    const ABOUT: &'static str =
        "FFT sparsification: keep the (1-theta) highest-energy rfft bins, RF-quantized";
    const ID: MethodId = MethodId(12);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()?))
    }

    /// The θ schedule counts epochs: `steps_per_epoch` comes from the run when unset.
    fn resolve(&mut self, run: &RunFacts) {
        if self.steps_per_epoch == 0 {
            self.steps_per_epoch = run.steps_per_epoch;
        }
    }

    /// A sparse all-reduce would carry FFT's dense reconstruction densely.
    fn check(&self, run: &RunUse<'_>) -> Result<(), ConfigError> {
        if run.collective == Collective::SparseAllReduce {
            return Err(ConfigError::new(
                "collective",
                "fft reconstructs a dense gradient, so a sparse all-reduce would carry it \
                 densely; fft payloads are gathered and decoded with one inverse transform \
                 (collective = \"allgather\")",
            ));
        }
        Ok(())
    }
}

impl FftConfig {
    /// Checks the parameters and builds the compressor.
    pub fn init(&self) -> Result<Fft, ConfigError> {
        check_theta(self.theta)?;
        let fmt = RfFormat::new(self.exp_bits, self.mantissa_bits)?;
        if self.chunk == Some(0) {
            return Err(ConfigError::new("chunk", "must be at least 1"));
        }
        if let Some(s) = &self.theta_schedule {
            s.validate()?;
            if matches!(s, ThetaSchedule::Step { .. }) && self.steps_per_epoch == 0 {
                return Err(ConfigError::new(
                    "steps_per_epoch",
                    "must be set (> 0) with a `step` theta schedule",
                ));
            }
        }
        let theta = self
            .theta_schedule
            .as_ref()
            .map_or(self.theta, |s| s.theta(0, 0));
        Ok(Fft {
            theta,
            base: theta,
            scale: 1.0,
            schedule: self.theta_schedule.clone(),
            steps_per_epoch: self.steps_per_epoch,
            fmt: self.quantize.then_some(fmt),
            select: self.select,
            coding: self.index_coding,
            chunk: self.chunk,
            spectral_feedback: self.spectral_feedback,
            feedback: None,
            enc: EncScratch::default(),
            jobs: Vec::new(),
            pool: Mutex::new(Vec::new()),
            inv_pool: Mutex::new(Vec::new()),
            shared: Mutex::new(Shared {
                planner: RealFftPlanner::new(),
                dec: DecScratch::default(),
            }),
        })
    }
}

#[derive(Default)]
struct DecScratch {
    spec: Vec<Complex<f32>>,
    inv: InvScratch,
    keep: Vec<u32>,
    vals: Vec<f32>,
    /// [`FftSum`]'s summed spectra, kept between sums so that a step allocates nothing.
    sum: Vec<Complex<f32>>,
}

/// The buffers of one inverse transform.
#[derive(Default)]
struct InvScratch {
    real: Vec<f32>,
    fft_scratch: Vec<Complex<f32>>,
}

/// A reconstruction added into the output, unscaled.
const ADD: Put = Put::Add { scale: None };

/// The error of a reconstruction with a NaN or an infinity.
const NOT_FINITE: WireError = WireError::Invalid("fft reconstruction is not finite");

impl InvScratch {
    /// Inverse transform of `spec` with `plan` (of length `out.len()`), then into `out` as
    /// `put` says ([`Put`]), after checking that the reconstruction is finite (an error if
    /// not). Returns whether a scaled result holds a NaN or an infinity (scaling up could).
    fn inverse_into(
        &mut self,
        plan: &dyn ComplexToReal<f32>,
        spec: &mut [Complex<f32>],
        out: &mut [f32],
        put: Put,
    ) -> Result<bool, WireError> {
        let real = grown(&mut self.real, out.len());
        let scratch = grown(&mut self.fft_scratch, plan.get_scratch_len());
        // DC/Nyquist imaginary parts were validated as zero; sums of zeros stay zero.
        plan.process_with_scratch(spec, real, scratch)
            .map_err(|_| WireError::Invalid("fft inverse transform refused the spectrum"))?;
        match put {
            // A mean written in one pass (the receivers'): the product is checked as it is
            // written; only when it is non-finite is the reconstruction looked at again.
            Put::Write { scale } => {
                let k = scale.unwrap_or(1.0);
                let bad = crate::finite::zero_add_scale_into_has_non_finite(out, real, k);
                if bad && crate::finite::first_non_finite(real).is_some() {
                    return Err(NOT_FINITE);
                }
                Ok(bad)
            }
            Put::Add { scale } => {
                if crate::finite::first_non_finite(real).is_some() {
                    return Err(NOT_FINITE);
                }
                add_into(out, real);
                Ok(scale.is_some_and(|k| crate::finite::scale_has_non_finite(out, k)))
            }
        }
    }
}

/// The first `n` elements of a buffer that only grows: the tensors of a bucket have
/// different lengths, and resizing the transforms' buffers to each would zero-fill them on
/// every growth (the transforms overwrite what they use).
fn grown<T: Clone + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::default());
    }
    &mut v[..n]
}

vector_dispatch! {
    /// `out[i] += v[i]` (equal lengths), with the widest vectors the CPU has.
    fn add_into(out: &mut [f32], v: &[f32]) = add_into_lanes;
}

#[inline(always)]
fn add_into_lanes(out: &mut [f32], v: &[f32]) {
    for (o, &v) in out.iter_mut().zip(v) {
        *o += v;
    }
}

/// Plans (cached per length by the planner) and decode buffers, behind a lock because
/// decoding takes `&self`.
struct Shared {
    planner: RealFftPlanner<f32>,
    dec: DecScratch,
}

/// The FFT sparsifier. Holds cached FFT plans and reused scratch buffers.
pub struct Fft {
    /// θ in effect: `base × scale`, clamped into `[0, 1)`.
    theta: f64,
    /// θ before the recover scale: the configured value, the schedule's value at the last
    /// `begin`, or the last [`Fft::set_theta`].
    base: f64,
    /// Product of the factors of [`Compressor::scale_theta`] (1 initially).
    scale: f64,
    schedule: Option<ThetaSchedule>,
    steps_per_epoch: u64,
    fmt: Option<RfFormat>,
    select: Select,
    coding: IndexCoding,
    chunk: Option<usize>,
    /// Whether to take classic residual error feedback over ([`FftConfig::spectral_feedback`]).
    spectral_feedback: bool,
    /// The adopted residual, once taken over.
    feedback: Option<AdoptedResidual>,
    enc: EncScratch,
    /// The chunks of the last parallel encoding, their bytes kept for the next one.
    jobs: Vec<Job>,
    /// Scratch for the threads of a parallel encoding (about one per thread).
    pool: Mutex<Vec<EncScratch>>,
    /// Scratch for the threads of a parallel joint decode ([`FftSum::finish`]).
    inv_pool: Mutex<Vec<InvScratch>>,
    shared: Mutex<Shared>,
}

impl std::fmt::Debug for Fft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fft")
            .field("theta", &self.theta)
            .field("theta_scale", &self.scale)
            .field("fmt", &self.fmt)
            .field("select", &self.select)
            .field("coding", &self.coding)
            .field("chunk", &self.chunk)
            .finish_non_exhaustive()
    }
}

/// Fewest elements in a bucket for [`Compressor::encode_segments`] to spread its chunks over
/// threads (below it the hand-off costs more than it saves).
pub const PARALLEL_MIN: usize = 1 << 16;

const LIST: u8 = 0;
const BITMAP: u8 = 1;
const PREFIX: u8 = 2;

/// Number of rfft bins of a length-`n` transform, `n/2 + 1`.
pub fn bins(n: usize) -> usize {
    n / 2 + 1
}

/// Bins kept out of `m` at drop ratio θ: `K = m − ⌊θm⌋` (≥ 1 for θ < 1).
pub fn kept_bins(m: usize, theta: f64) -> usize {
    let d = ((theta * m as f64).floor() as usize).min(m.saturating_sub(1));
    m - d
}

/// Hermitian multiplicity of bin `k` of a length-`n` transform.
#[inline]
pub fn bin_weight(n: usize, k: usize) -> f32 {
    if k == 0 || (n.is_multiple_of(2) && k == n / 2) {
        1.0
    } else {
        2.0
    }
}

fn lock(m: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Fft {
    /// The drop ratio θ in effect: the base θ (configured, scheduled or set) times the
    /// recover scale ([`Fft::theta_scale`]), clamped into `[0, 1)`.
    pub fn theta(&self) -> f64 {
        self.theta
    }

    /// The product of every [`Compressor::scale_theta`] factor so far (1 initially).
    pub fn theta_scale(&self) -> f64 {
        self.scale
    }

    /// Sets the base θ for the following steps (driven by a [`crate::schedule`]); the
    /// recover scale still applies on top. A configured `theta_schedule` overrides it again
    /// at the next step. Payloads carry `K`, so receivers need not know θ.
    pub fn set_theta(&mut self, theta: f64) -> Result<(), ConfigError> {
        check_theta(theta)?;
        self.base = theta;
        self.apply_scale();
        Ok(())
    }

    /// Recomputes the effective θ from the base and the scale (always from these two, never
    /// incrementally, so a restored state gives the same θ bit for bit).
    fn apply_scale(&mut self) {
        self.theta = (self.base * self.scale).clamp(0.0, 1.0 - f64::EPSILON);
    }

    /// The settings a chunk's encoding reads.
    fn encoding(&self) -> Encoding {
        Encoding {
            theta: self.theta,
            fmt: self.fmt,
            select: self.select,
            coding: self.coding,
        }
    }

    fn layout(&self, m: usize, k: usize) -> u8 {
        self.encoding().layout(m, k)
    }

    /// The chunks of every segment of a buffer, as ranges of the buffer, in order.
    fn chunk_ranges<'s>(
        &self,
        segments: &'s [Range<usize>],
    ) -> impl Iterator<Item = Range<usize>> + use<'s> {
        let chunk = self.chunk;
        segments.iter().flat_map(move |s| {
            chunk_spans(chunk, s.len()).map(move |c| s.start + c.start..s.start + c.end)
        })
    }

    /// Whether `chunks` chunks of a buffer of `n` elements are transformed side by side:
    /// several threads, several chunks, at least [`PARALLEL_MIN`] elements.
    fn side_by_side(chunks: usize, n: usize) -> bool {
        rayon::current_num_threads() >= 2 && chunks >= 2 && n >= PARALLEL_MIN
    }

    /// Chunk ranges (relative to the segment) of a segment of `n` elements.
    fn chunks(&self, n: usize) -> impl Iterator<Item = Range<usize>> + use<> {
        chunk_spans(self.chunk, n)
    }

    /// Exact bits of one chunk body of length `n` at the current θ.
    pub fn chunk_bits(&self, n: usize) -> u64 {
        let m = bins(n);
        let k = kept_bins(m, self.theta) as u64;
        let idx = match self.layout(m, k as usize) {
            LIST => 32 * k,
            BITMAP => 8 * m.div_ceil(8) as u64,
            _ => 0,
        };
        let vals = match self.fmt {
            Some(f) => f.block_bits(2 * k as usize),
            None => 64 * k,
        };
        56 + idx + vals
    }

    /// The bins this compressor keeps for `x` (one chunk), ascending. For diagnostics/tests.
    pub fn select_bins(&mut self, x: &[f32]) -> Vec<u32> {
        let plan = lock(&self.shared).planner.plan_fft_forward(x.len());
        let cfg = self.encoding();
        self.enc.forward(&*plan, x);
        self.enc.choose(&cfg, x.len(), 1.0);
        self.enc.keep.clone()
    }

    /// Encodes one chunk into `w`, through the adopted residual when there is one.
    fn encode_chunk(&mut self, x: &[f32], w: &mut Writer<'_>) {
        let n = x.len();
        let cfg = self.encoding();
        let plan = lock(&self.shared).planner.plan_fft_forward(n);
        let residual = self.feedback.as_mut().map(|fb| fb.claim(n));
        self.enc.encode_chunk(&cfg, &*plan, x, residual, w);
    }

    /// Reads one chunk body of length `n` and adds its coefficients into `spec` (`m` bins),
    /// or, with `fill`, writes them over `spec`, every other bin zero: bit for bit zeroing
    /// `spec` first and adding (each kept value written as `0 + v`), in one pass.
    fn decode_chunk_into(
        &self,
        r: &mut Reader<'_>,
        n: usize,
        spec: &mut [Complex<f32>],
        fill: bool,
        keep: &mut Vec<u32>,
        vals: &mut Vec<f32>,
    ) -> Result<(), WireError> {
        let m = bins(n);
        debug_assert_eq!(spec.len(), m);
        let layout = r.u8("fft layout")?;
        let e = r.u8("fft exponent bits")?;
        let q = r.u8("fft mantissa bits")?;
        let k = r.u32("fft kept bins")? as usize;
        let expect = match self.fmt {
            Some(f) => (f.exp_bits() as u8, f.mantissa_bits() as u8),
            None => (0, 0),
        };
        if (e, q) != expect {
            return Err(WireError::Invalid(
                "fft value format differs from the configuration",
            ));
        }
        if k > m {
            return Err(WireError::Invalid("fft keeps more bins than exist"));
        }
        keep.clear();
        match layout {
            LIST => {
                let idx = r.take_items(k, 4, "fft bin list")?;
                let mut prev: i64 = -1;
                for j in 0..k {
                    let i = u32_at(idx, j);
                    if i as usize >= m {
                        return Err(WireError::IndexOutOfRange {
                            index: i as u64,
                            len: m,
                        });
                    }
                    if i as i64 <= prev {
                        return Err(WireError::Invalid("fft bin list is not ascending"));
                    }
                    prev = i as i64;
                    keep.push(i);
                }
            }
            BITMAP => {
                let bm = r.take(m.div_ceil(8), "fft bin bitmap")?;
                let set: usize = bm.iter().map(|b| b.count_ones() as usize).sum();
                if set != k {
                    return Err(WireError::Invalid("fft bitmap population differs from K"));
                }
                if !m.is_multiple_of(8) && (bm[bm.len() - 1] >> (m % 8)) != 0 {
                    return Err(WireError::Invalid("fft bitmap has bits past the last bin"));
                }
                bitmap_positions(bm, k, keep);
            }
            PREFIX => keep.extend(0..k as u32),
            _ => return Err(WireError::Invalid("unknown fft layout")),
        }
        vals.clear();
        match self.fmt {
            Some(f) => {
                let emax = r.u8("fft Emax")? as i8;
                let bytes = r.take(
                    bytes_for_bits(2 * k as u64 * f.bits() as u64),
                    "fft value codes",
                )?;
                vals.resize(2 * k, 0.0);
                RfDecoder::new(f, emax, 2 * k).decode(bytes, vals)?;
            }
            None => {
                let bytes = r.take_items(2 * k, 4, "fft values")?;
                vals.resize(2 * k, 0.0);
                for (j, v) in vals.iter_mut().enumerate() {
                    *v = f32_at(bytes, j);
                    if !v.is_finite() {
                        return Err(WireError::Invalid("non-finite fft value"));
                    }
                }
            }
        }
        let nyq = if n.is_multiple_of(2) {
            n / 2
        } else {
            usize::MAX
        };
        let dc_nyquist = |b: usize, im: f32| {
            if (b == 0 || b == nyq) && im != 0.0 {
                Err(WireError::Invalid(
                    "fft imaginary part of DC/Nyquist is not zero",
                ))
            } else {
                Ok(())
            }
        };
        if fill {
            // The bins are ascending (the list is checked so, the bitmap and the prefix are
            // so by construction): the zeros between them, then each value.
            let zero = Complex::new(0.0, 0.0);
            let mut next = 0;
            for (&b, v) in keep.iter().zip(vals.chunks_exact(2)) {
                let b = b as usize;
                dc_nyquist(b, v[1])?;
                spec[next..b].fill(zero);
                spec[b] = Complex::new(0.0 + v[0], 0.0 + v[1]);
                next = b + 1;
            }
            spec[next..].fill(zero);
        } else {
            for (&b, v) in keep.iter().zip(vals.chunks_exact(2)) {
                let b = b as usize;
                dc_nyquist(b, v[1])?;
                spec[b].re += v[0];
                spec[b].im += v[1];
            }
        }
        Ok(())
    }

    /// Inverse transform of `spec` (length `out.len()`) into `out` as `put` says
    /// ([`InvScratch::inverse_into`]).
    fn inverse_into(
        shared: &mut Shared,
        spec: &mut [Complex<f32>],
        out: &mut [f32],
        put: Put,
    ) -> Result<bool, WireError> {
        let plan = shared.planner.plan_fft_inverse(out.len());
        shared.dec.inv.inverse_into(&*plan, spec, out, put)
    }

    /// A receiver-side accumulator for `n`-element buffers: decode several workers'
    /// payloads into one summed spectrum and run one inverse FFT per chunk (§0.4).
    pub fn sum(&self, n: usize) -> FftSum<'_> {
        FftSum::new(self, n)
    }

    /// The joint decode of `payloads` into `out` as `put` says ([`FftSum`]); whether the
    /// written values hold a NaN or an infinity. An error names the payload.
    fn joint(
        &self,
        payloads: &[&[u8]],
        out: &mut [f32],
        put: Put,
    ) -> Result<bool, (usize, WireError)> {
        let mut sum = self.sum(out.len());
        for (i, p) in payloads.iter().enumerate() {
            sum.add_payload(p).map_err(|e| (i, e))?;
        }
        sum.emit(out, put).map_err(|e| {
            // Only a non-finite reconstruction fails here: find the payload that has one
            // (decoding it alone), or blame the sum of them all (the last payload).
            let culprit = payloads
                .iter()
                .position(|p| {
                    let mut probe = vec![0.0; out.len()];
                    crate::compressor::decompress_add(self, p, &mut probe).is_err()
                })
                .unwrap_or(payloads.len().saturating_sub(1));
            (culprit, e)
        })
    }
}

/// The positions of the set bits of each byte value, in ascending order (the rest 0).
const BYTE_POSITIONS: [[u8; 8]; 256] = {
    let mut t = [[0u8; 8]; 256];
    let mut b = 0;
    while b < 256 {
        let (mut bit, mut at) = (0, 0);
        while bit < 8 {
            if b >> bit & 1 == 1 {
                t[b][at] = bit as u8;
                at += 1;
            }
            bit += 1;
        }
        b += 1;
    }
    t
};

/// The ascending positions of the `k` set bits of `bm` (LSB first in each byte) into `keep`
/// (cleared first); `k` is the bitmap's population (checked by the caller). Branch-free:
/// each byte writes its eight table positions and the cursor advances by its population —
/// at 10 % density (FFT's θ = 0.9) a loop over the set bits mispredicted on most bytes.
fn bitmap_positions(bm: &[u8], k: usize, keep: &mut Vec<u32>) {
    keep.clear();
    // Eight spare entries: the last bytes write past the `k`-th.
    keep.resize(k + 8, 0);
    let mut at = 0usize;
    for (bi, &b) in bm.iter().enumerate() {
        let base = (bi * 8) as u32;
        let row = &BYTE_POSITIONS[b as usize];
        // `at` ≤ k: the populations of the bytes before sum to at most k.
        let dst = &mut keep[at..at + 8];
        for (d, &p) in dst.iter_mut().zip(row) {
            *d = base + p as u32;
        }
        at += b.count_ones() as usize;
    }
    debug_assert_eq!(at, k);
    keep.truncate(k);
}

/// The chunks of `chunk` elements (the whole of it for `None`) of a segment of `n`.
fn chunk_spans(chunk: Option<usize>, n: usize) -> impl Iterator<Item = Range<usize>> {
    let c = chunk.unwrap_or(n).max(1);
    (0..n.div_ceil(c)).map(move |i| i * c..((i + 1) * c).min(n))
}

#[inline]
fn emax_of_bits(abs_bits: u32) -> i32 {
    crate::rangefloat::emax_of_abs_bits(abs_bits) as i32
}

fn pow2_f64(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

fn pow2_f32(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

impl Compressor for Fft {
    fn method(&self) -> MethodId {
        FftConfig::ID
    }
    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }
    fn begin(&mut self, _grad: &[f32], ctx: &crate::compressor::Ctx<'_>) {
        if let Some(fb) = &mut self.feedback {
            fb.begin(ctx.bucket);
        }
        if let Some(s) = &self.schedule {
            let epoch = ctx.step.checked_div(self.steps_per_epoch).unwrap_or(0);
            self.base = s.theta(ctx.step, epoch);
            self.apply_scale();
        }
    }
    fn ratio_metric(&self) -> Option<(&'static str, f64)> {
        Some(("theta", self.theta))
    }
    /// The residual as spectra, `n` reals per `n`-element transform (see
    /// [`FftConfig::spectral_feedback`]).
    fn adopt_error_feedback(&mut self) -> Option<&'static str> {
        if !self.spectral_feedback {
            return None;
        }
        self.feedback.get_or_insert_with(AdoptedResidual::default);
        Some("spectra")
    }
    fn feedback_offset(&mut self, offset: usize) {
        if let Some(fb) = &mut self.feedback {
            fb.set_offset(offset);
        }
    }
    fn export_feedback(&self) -> BTreeMap<u64, Vec<f32>> {
        self.feedback
            .as_ref()
            .map(|fb| fb.residuals.clone())
            .unwrap_or_default()
    }
    fn feedback_signal(&self, key: u64, segments: &[Range<usize>], out: &mut [f32]) -> bool {
        let Some(e) = self.feedback.as_ref().and_then(|fb| fb.residuals.get(&key)) else {
            return false;
        };
        let Ok(segs) = crate::compressor::effective_segments(out.len(), segments) else {
            return false;
        };
        if e.len() != out.len() {
            return false;
        }
        out.fill(0.0);
        let mut guard = lock(&self.shared);
        let mut spec = Vec::new();
        for range in self.chunk_ranges(&segs) {
            spec.clear();
            spec.resize(bins(range.len()), Complex::default());
            unpack_residual(&mut spec, &e[range.clone()]);
            if Self::inverse_into(&mut guard, &mut spec, &mut out[range], ADD).is_err() {
                return false;
            }
        }
        true
    }
    fn import_feedback(&mut self, state: BTreeMap<u64, Vec<f32>>) {
        if let Some(fb) = &mut self.feedback {
            fb.residuals = state;
        }
    }
    fn scale_theta(&mut self, factor: f64) -> bool {
        crate::compressor::check_factor(factor);
        self.scale *= factor;
        self.apply_scale();
        true
    }
    /// `theta_base` (θ before the scale, which [`Fft::set_theta`] may have changed) and
    /// `theta_scale`; with a schedule the base is re-derived at the next step anyway.
    fn export_state(&self) -> BTreeMap<String, f64> {
        BTreeMap::from([
            ("theta_base".to_string(), self.base),
            ("theta_scale".to_string(), self.scale),
        ])
    }
    fn import_state(&mut self, state: &BTreeMap<String, f64>) -> Result<(), String> {
        let mut base = self.base;
        let mut scale = self.scale;
        for (k, &v) in state {
            match k.as_str() {
                "theta_base" if (0.0..1.0).contains(&v) => base = v,
                "theta_scale" if v.is_finite() && v >= 0.0 => scale = v,
                "theta_base" | "theta_scale" => {
                    return Err(format!("fft state {k:?} = {v} is out of range"))
                }
                _ => return Err(format!("fft carries no state named {k:?}")),
            }
        }
        self.base = base;
        self.scale = scale;
        self.apply_scale();
        Ok(())
    }
    /// The chunks of every segment side by side on rayon's threads when there are several
    /// threads, several chunks and at least [`PARALLEL_MIN`] elements (the same bytes and
    /// residual as one after the other); else one after the other.
    fn encode_segments(
        &mut self,
        x: &[f32],
        segments: &[Range<usize>],
        rng: &mut Rng,
        w: &mut Writer<'_>,
    ) {
        if !Self::side_by_side(self.chunk_ranges(segments).count(), x.len()) {
            for s in segments {
                self.encode_segment(&x[s.clone()], rng, w);
            }
            return;
        }
        let cfg = self.encoding();
        {
            let mut sh = lock(&self.shared);
            let mut i = 0;
            for range in self.chunk_ranges(segments) {
                let plan = sh.planner.plan_fft_forward(range.len());
                match self.jobs.get_mut(i) {
                    Some(j) => {
                        j.range = range;
                        j.plan = plan;
                    }
                    None => self.jobs.push(Job {
                        range,
                        plan,
                        out: Vec::new(),
                    }),
                }
                i += 1;
            }
            self.jobs.truncate(i);
        }
        let residual = self.feedback.as_mut().map(|fb| fb.claim(x.len()));
        encode_parallel(&cfg, x, &mut self.jobs, residual, &self.pool);
        for j in &self.jobs {
            w.bytes(&j.out);
        }
    }
    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        let chunks: Vec<Range<usize>> = self.chunks(x.len()).collect();
        for c in chunks {
            self.encode_chunk(&x[c], w);
        }
    }
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        let mut guard = lock(&self.shared);
        let sh = &mut *guard;
        for c in self.chunks(out.len()) {
            let n = c.len();
            let mut spec = std::mem::take(&mut sh.dec.spec);
            let mut keep = std::mem::take(&mut sh.dec.keep);
            let mut vals = std::mem::take(&mut sh.dec.vals);
            // Every bin is written by the decode.
            spec.resize(bins(n), Complex::default());
            let res = self
                .decode_chunk_into(r, n, &mut spec, true, &mut keep, &mut vals)
                .and_then(|()| Self::inverse_into(sh, &mut spec, &mut out[c], ADD).map(drop));
            sh.dec.spec = spec;
            sh.dec.keep = keep;
            sh.dec.vals = vals;
            res?;
        }
        Ok(())
    }
    /// The linearity shortcut (ALGORITHMS.md §0.4): the P sparse spectra are summed and
    /// inverse-transformed once per chunk instead of P times. The result differs from
    /// decoding each payload only by float rounding (tested), and is the same on every rank.
    fn joint_decompress_add(
        &self,
        payloads: &[&[u8]],
        out: &mut [f32],
    ) -> Option<Result<(), (usize, WireError)>> {
        Some(self.joint(payloads, out, ADD).map(drop))
    }
    /// The same sum, written as the mean straight from each inverse transform: one pass
    /// over the output instead of a zero fill, an addition and a scaling.
    fn joint_decompress_mean(
        &self,
        payloads: &[&[u8]],
        inv: f32,
        out: &mut [f32],
    ) -> Option<Result<bool, (usize, WireError)>> {
        Some(self.joint(payloads, out, Put::Write { scale: Some(inv) }))
    }
    fn segment_bits(&self, n: usize) -> Option<u64> {
        let chunks: Vec<usize> = self.chunks(n).map(|c| c.len()).collect();
        let mut bits = 0;
        for (i, &l) in chunks.iter().enumerate() {
            let b = self.chunk_bits(l);
            bits += if i + 1 < chunks.len() {
                b.div_ceil(8) * 8
            } else {
                b
            };
        }
        Some(bits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress_new, decompress, payload_bits, Ctx};

    /// The branch-free bitmap expansion lists the set bits in order, at every density and
    /// for bitmaps whose last bytes are full or empty.
    #[test]
    fn bitmap_positions_are_the_set_bits_in_order() {
        let mut rng = crate::rng::Rng::seed_from_u64(29);
        let mut keep = vec![99u32; 5];
        for len in [0usize, 1, 2, 7, 8, 9, 100, 1000] {
            for density in [0u64, 1, 10, 50, 100] {
                let bm: Vec<u8> = (0..len)
                    .map(|_| {
                        (0..8).fold(0u8, |b, bit| b | u8::from(rng.below(100) < density) << bit)
                    })
                    .collect();
                let want: Vec<u32> = (0..len * 8)
                    .filter(|&i| bm[i / 8] >> (i % 8) & 1 == 1)
                    .map(|i| i as u32)
                    .collect();
                bitmap_positions(&bm, want.len(), &mut keep);
                assert_eq!(keep, want, "len {len}, density {density} %");
            }
        }
    }

    /// Naive f64 DFT bins `0..m` of `x` (independent reference, O(n²)).
    fn dft(x: &[f32]) -> Vec<(f64, f64)> {
        let n = x.len();
        (0..bins(n))
            .map(|k| {
                let (mut re, mut im) = (0f64, 0f64);
                for (j, &v) in x.iter().enumerate() {
                    let a = -2.0 * std::f64::consts::PI * ((j * k) % n) as f64 / n as f64;
                    re += v as f64 * a.cos();
                    im += v as f64 * a.sin();
                }
                (re, im)
            })
            .collect()
    }

    fn energies(x: &[f32]) -> Vec<f64> {
        let n = x.len();
        dft(x)
            .iter()
            .enumerate()
            .map(|(k, &(re, im))| bin_weight(n, k) as f64 * (re * re + im * im))
            .collect()
    }

    fn norm2(x: &[f32]) -> f64 {
        x.iter().map(|&v| v as f64 * v as f64).sum()
    }

    fn diff2(a: &[f32], b: &[f32]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
            .sum()
    }

    fn fft(theta: f64, quantize: bool) -> Fft {
        FftConfig {
            theta,
            quantize,
            ..FftConfig::default()
        }
        .init()
        .unwrap()
    }

    fn roundtrip(c: &mut Fft, x: &[f32]) -> Vec<f32> {
        let mut rng = Rng::seed_from_u64(0);
        let p = compress_new(c, x, &Ctx::default(), &mut rng).unwrap();
        assert_eq!(
            p.encoded_len() as u64 * 8,
            payload_bits(c, &[x.len()]).unwrap(),
            "wire size, n = {}",
            x.len()
        );
        let mut out = vec![0f32; x.len()];
        decompress(c, p.as_bytes(), &mut out).unwrap();
        assert!(out.iter().all(|v| v.is_finite()));
        out
    }

    /// A compressor of θ `theta` and `chunk`, and `count` payloads of Gaussian gradients
    /// of `n` elements with layers `segs`.
    fn gauss_payloads(
        theta: f64,
        chunk: Option<usize>,
        segs: &[Range<usize>],
        n: usize,
        count: usize,
        rng: &mut Rng,
    ) -> (Fft, Vec<crate::Payload>) {
        let mut c = FftConfig {
            theta,
            chunk,
            ..FftConfig::default()
        }
        .init()
        .unwrap();
        let ctx = Ctx {
            segments: segs,
            ..Ctx::default()
        };
        let payloads = (0..count)
            .map(|_| {
                let x = gauss(rng, n);
                compress_new(&mut c, &x, &ctx, rng).unwrap()
            })
            .collect();
        (c, payloads)
    }

    fn gauss(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u = rng.next_f64().max(1e-300);
                let v = rng.next_f64();
                ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
            })
            .collect()
    }

    const SIZES: [usize; 12] = [1, 2, 3, 4, 5, 7, 8, 16, 33, 64, 127, 250];

    #[test]
    fn parseval_in_the_compressors_spectrum_and_the_reference() {
        let mut rng = Rng::seed_from_u64(1);
        let mut c = fft(0.5, false);
        for n in SIZES {
            let x = gauss(&mut rng, n);
            let nx = norm2(&x);
            let e: f64 = energies(&x).iter().sum::<f64>() / n as f64;
            assert!((e - nx).abs() <= 1e-9 * nx, "n {n}: {e} vs {nx}");
            let plan = lock(&c.shared).planner.plan_fft_forward(n);
            let post = c.enc.forward(&*plan, &x) as f64;
            let ef: f64 = c
                .enc
                .spec
                .iter()
                .enumerate()
                .map(|(k, z)| {
                    let (re, im) = (z.re as f64 * post, z.im as f64 * post);
                    bin_weight(n, k) as f64 * (re * re + im * im)
                })
                .sum::<f64>()
                * n as f64;
            assert!((ef - nx).abs() <= 1e-5 * nx, "f32 fft n {n}: {ef} vs {nx}");
        }
    }

    #[test]
    fn dropped_energy_identity_and_theta_bound_without_quantization() {
        let mut rng = Rng::seed_from_u64(2);
        for n in SIZES {
            for theta in [0.0, 0.3, 0.5, 0.9, 0.99] {
                let x = gauss(&mut rng, n);
                let mut c = fft(theta, false);
                let keep = c.select_bins(&x);
                let m = bins(n);
                assert_eq!(keep.len(), kept_bins(m, theta));
                let e = energies(&x);
                let dropped: f64 = (0..m)
                    .filter(|k| !keep.contains(&(*k as u32)))
                    .map(|k| e[k])
                    .sum::<f64>()
                    / n as f64;
                let y = roundtrip(&mut c, &x);
                let err = diff2(&x, &y);
                let nx = norm2(&x);
                assert!(
                    (err - dropped).abs() <= 2e-5 * nx,
                    "n {n} θ {theta}: err {err} dropped {dropped}"
                );
                let d = m - keep.len();
                assert!(err <= (d as f64 / m as f64) * nx + 2e-5 * nx);
                assert!(err <= theta * nx + 2e-5 * nx);
            }
        }
    }

    #[test]
    fn error_is_monotone_in_theta_and_theta_zero_is_lossless() {
        let mut rng = Rng::seed_from_u64(3);
        for n in [1usize, 2, 3, 10, 101, 512] {
            let x = gauss(&mut rng, n);
            let nx = norm2(&x);
            let mut prev = -1.0;
            for i in 0..20 {
                let theta = i as f64 * 0.05;
                let y = roundtrip(&mut fft(theta, false), &x);
                let err = diff2(&x, &y);
                assert!(err >= prev - 1e-6 * nx, "n {n} θ {theta}: {err} < {prev}");
                prev = err;
                if i == 0 {
                    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                    for (a, b) in x.iter().zip(&y) {
                        assert!((a - b).abs() <= 1e-5 * amax.max(1e-30), "θ=0: {a} {b}");
                    }
                }
            }
        }
    }

    #[test]
    fn selected_bins_are_optimal_by_brute_force() {
        let mut rng = Rng::seed_from_u64(4);
        for n in 1..=16usize {
            for trial in 0..6 {
                let x = if trial == 5 {
                    // Smooth input: energy concentrated in low bins.
                    (0..n).map(|j| (j as f32 * 0.3).sin() + 0.1).collect()
                } else {
                    gauss(&mut rng, n)
                };
                let e = energies(&x);
                let m = bins(n);
                for theta in [0.0, 0.2, 0.45, 0.7, 0.95] {
                    let mut c = fft(theta, true);
                    let keep = c.select_bins(&x);
                    let k = kept_bins(m, theta);
                    let got: f64 = keep.iter().map(|&b| e[b as usize]).sum();
                    let mut best = 0f64;
                    for mask in 0u32..(1 << m) {
                        if mask.count_ones() as usize == k {
                            let s: f64 = (0..m).filter(|b| mask >> b & 1 == 1).map(|b| e[b]).sum();
                            best = best.max(s);
                        }
                    }
                    let total: f64 = e.iter().sum();
                    assert!(
                        got >= best - 1e-5 * total,
                        "n {n} θ {theta}: {got} < {best}"
                    );
                }
            }
        }
        // Ties go to the smaller bin: an impulse has |X_k| = 1 everywhere, so the weight-2
        // bins tie and the first ones win.
        let mut x = vec![0f32; 8];
        x[0] = 1.0;
        let mut c = fft(0.6, false); // m = 5, K = 5 − 3 = 2
        assert_eq!(c.select_bins(&x), vec![1, 2]);
    }

    #[test]
    fn large_selection_matches_a_full_sort_of_the_energies() {
        // Large enough for the sampled-threshold path of `select::top_k`.
        let mut rng = Rng::seed_from_u64(11);
        for n in [40_000usize, 40_001] {
            let x: Vec<f32> = gauss(&mut rng, n)
                .iter()
                .enumerate()
                .map(|(j, v)| v + (j as f32 * 0.01).sin() * 3.0)
                .collect();
            for theta in [0.5, 0.9, 0.999] {
                let mut c = fft(theta, true);
                let keep = c.select_bins(&x);
                let e: Vec<f32> = c
                    .enc
                    .spec
                    .iter()
                    .enumerate()
                    .map(|(k, z)| bin_weight(n, k) * (z.re * z.re + z.im * z.im))
                    .collect();
                let mut order: Vec<u32> = (0..e.len() as u32).collect();
                order.sort_by(|&a, &b| e[b as usize].total_cmp(&e[a as usize]).then(a.cmp(&b)));
                order.truncate(kept_bins(bins(n), theta));
                order.sort_unstable();
                assert_eq!(keep, order, "n {n} θ {theta}");
            }
        }
    }

    #[test]
    fn projection_is_idempotent_and_orthogonal() {
        let mut rng = Rng::seed_from_u64(5);
        for n in SIZES {
            let x = gauss(&mut rng, n);
            let mut c = fft(0.6, false);
            let y = roundtrip(&mut c, &x);
            let z = roundtrip(&mut c, &y);
            let nx = norm2(&x);
            assert!(diff2(&y, &z) <= 1e-9 * nx, "n {n}: not idempotent");
            let inner: f64 = x
                .iter()
                .zip(&y)
                .map(|(&a, &b)| (a as f64 - b as f64) * b as f64)
                .sum();
            assert!(inner.abs() <= 1e-5 * nx, "n {n}: <x-x̂, x̂> = {inner}");
        }
    }

    #[test]
    fn band_limited_inputs_are_exact() {
        for n in [4usize, 5, 9, 16, 31, 100, 257] {
            for k0 in [1, n / 3, (n - 1) / 2] {
                if k0 == 0 {
                    continue;
                }
                let x: Vec<f32> = (0..n)
                    .map(|j| {
                        let a = 2.0 * std::f64::consts::PI * (k0 * j) as f64 / n as f64;
                        (0.7 + 1.9 * a.cos()) as f32
                    })
                    .collect();
                // K ≥ 2 at θ where ⌊θm⌋ ≤ m − 2.
                let m = bins(n);
                let theta = (m - 2) as f64 / m as f64;
                let mut c = fft(theta, false);
                assert!(kept_bins(m, theta) >= 2);
                let y = roundtrip(&mut c, &x);
                for (a, b) in x.iter().zip(&y) {
                    assert!((a - b).abs() <= 1e-5 * 2.6, "n {n} k0 {k0}: {a} vs {b}");
                }
                // Lowpass with K = k0 + 1 keeps the same two bins.
                let theta = (m - k0 - 1) as f64 / m as f64;
                let mut c = FftConfig {
                    theta,
                    quantize: false,
                    select: Select::Lowpass,
                    ..FftConfig::default()
                }
                .init()
                .unwrap();
                let y = roundtrip(&mut c, &x);
                assert!(diff2(&x, &y) <= 1e-9 * norm2(&x), "lowpass n {n} k0 {k0}");
            }
        }
    }

    #[test]
    fn summed_spectra_equal_summed_reconstructions() {
        let mut rng = Rng::seed_from_u64(6);
        for (n, segs, chunk) in [
            (1usize, vec![], None),
            (3, vec![], None),
            (1000, vec![], None),
            (1000, vec![0..300, 300..301, 301..1000], None),
            (999, vec![0..500, 500..999], Some(128)),
        ] {
            let (c, payloads) = gauss_payloads(0.7, chunk, &segs, n, 4, &mut rng);
            let mut direct = vec![0f32; n];
            for p in &payloads {
                crate::compressor::decompress_add(&c, p.as_bytes(), &mut direct).unwrap();
            }
            let mut sum = c.sum(n);
            for p in &payloads {
                sum.add_payload(p.as_bytes()).unwrap();
            }
            assert_eq!(sum.payloads(), 4);
            let mut via = vec![0f32; n];
            sum.finish(&mut via).unwrap();
            let scale = norm2(&direct).max(1e-30);
            assert!(diff2(&direct, &via) <= 1e-10 * scale, "n {n}");
            // A payload of another length or a broken one is refused.
            let mut bad = c.sum(n + 1);
            assert!(bad.add_payload(payloads[0].as_bytes()).is_err());
            assert!(bad.finish(&mut vec![0f32; n + 1]).is_err());
        }
    }

    /// The first payload's decode writes every bin of the chunk's spectrum (zeros between
    /// the kept bins, `0 + v` at them): bit for bit a zero fill followed by the adding
    /// decode, whatever the spectrum held, for every index layout and value format, with a
    /// kept value of −0 among them (which the adding decode turns into +0).
    #[test]
    fn the_writing_decode_is_the_zero_fill_and_the_adding_one() {
        let mut rng = Rng::seed_from_u64(17);
        let (mut keep, mut vals) = (Vec::new(), Vec::new());
        let layouts = [
            (Select::EnergyTopk, IndexCoding::Bitmap),
            (Select::EnergyTopk, IndexCoding::List),
            (Select::Lowpass, IndexCoding::Auto),
        ];
        for (select, index_coding) in layouts {
            for quantize in [true, false] {
                for n in [1usize, 2, 7, 64, 1001, 4096] {
                    let mut c = FftConfig {
                        theta: 0.7,
                        quantize,
                        select,
                        index_coding,
                        ..FftConfig::default()
                    }
                    .init()
                    .unwrap();
                    let mut x = gauss(&mut rng, n);
                    if n == 7 {
                        x.fill(0.0);
                    }
                    let mut bytes = Vec::new();
                    c.encode_chunk(&x, &mut Writer::new(&mut bytes));
                    if !quantize {
                        // The last value sent (f32s end the body) made −0.
                        let at = bytes.len() - 4;
                        bytes[at..].copy_from_slice(&(-0.0f32).to_le_bytes());
                    }
                    let m = bins(n);
                    let mut want = vec![Complex::new(0.0f32, 0.0); m];
                    c.decode_chunk_into(
                        &mut Reader::new(&bytes),
                        n,
                        &mut want,
                        false,
                        &mut keep,
                        &mut vals,
                    )
                    .unwrap();
                    let mut got = vec![Complex::new(f32::NAN, -1.0); m];
                    c.decode_chunk_into(
                        &mut Reader::new(&bytes),
                        n,
                        &mut got,
                        true,
                        &mut keep,
                        &mut vals,
                    )
                    .unwrap();
                    let bits = |s: &[Complex<f32>]| -> Vec<(u32, u32)> {
                        s.iter().map(|c| (c.re.to_bits(), c.im.to_bits())).collect()
                    };
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{select:?} {index_coding:?}, quantize {quantize}, n = {n}"
                    );
                }
            }
        }
    }

    /// The joint decoder's mean, written in one pass from each inverse transform, is bit
    /// for bit the zero fill, the joint sum and the scaling — whatever `out` held before,
    /// with whole or chunked tensors, one thread or chunks side by side, and with no
    /// payload (zeros).
    #[test]
    fn the_written_mean_is_the_filled_summed_and_scaled_one() {
        let mut rng = Rng::seed_from_u64(11);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let n = PARALLEL_MIN + 999;
        let segs = vec![0..40_000, 40_000..40_001, 40_001..n];
        for (chunk, threads) in [(None, 1), (Some(4096), 1), (Some(4096), 3), (None, 3)] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let (c, payloads) = gauss_payloads(0.9, chunk, &segs, n, 3, &mut rng);
                let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_bytes()).collect();
                for k in [0, 1, 3] {
                    let mut want = vec![0f32; n];
                    crate::compressor::decompress_sum_add(&c, &refs[..k], &mut want).unwrap();
                    want.iter_mut().for_each(|v| *v *= 1.0 / 3.0);
                    let mut out = vec![f32::NAN; n];
                    let mut touched = crate::Touched::default();
                    let bad = crate::compressor::decompress_mean(
                        &c,
                        &refs[..k],
                        1.0 / 3.0,
                        &mut out,
                        &mut touched,
                    )
                    .unwrap();
                    assert!(!bad);
                    assert!(
                        bits(&out) == bits(&want),
                        "chunk {chunk:?}, {threads} threads, {k} payloads"
                    );
                }
            });
        }
    }

    #[test]
    fn wire_size_matches_formula_for_every_option() {
        let mut rng = Rng::seed_from_u64(7);
        for quantize in [true, false] {
            for select in [Select::EnergyTopk, Select::Lowpass] {
                for index_coding in [IndexCoding::Auto, IndexCoding::Bitmap, IndexCoding::List] {
                    for chunk in [None, Some(1), Some(7), Some(64)] {
                        for (e, q) in [(4u8, 3u8), (3, 4), (5, 10), (2, 0)] {
                            let cfg = FftConfig {
                                theta: 0.8,
                                exp_bits: e,
                                mantissa_bits: q,
                                quantize,
                                select,
                                index_coding,
                                chunk,
                                ..FftConfig::default()
                            };
                            let mut c = cfg.init().unwrap();
                            for n in [1usize, 2, 3, 8, 65, 130] {
                                let x = gauss(&mut rng, n);
                                roundtrip(&mut c, &x);
                            }
                            let segs = [0..50, 50..51, 51..130];
                            let x = gauss(&mut rng, 130);
                            let ctx = Ctx {
                                segments: &segs,
                                ..Ctx::default()
                            };
                            let p = compress_new(&mut c, &x, &ctx, &mut rng).unwrap();
                            assert_eq!(
                                p.encoded_len() as u64 * 8,
                                payload_bits(&c, &[50, 1, 79]).unwrap()
                            );
                        }
                    }
                }
            }
        }
        // The §1.2 formula by hand: n = 4096, θ = 0.9, b = 8: m = 2049, K = 205, bitmap.
        let c = fft(0.9, true);
        assert_eq!(c.segment_bits(4096), Some(56 + 8 * 257 + 8 + 2 * 205 * 8));
        // ≈ 0.5 + (1−θ)·b bits per element.
        let bpe = c.segment_bits(1 << 20).unwrap() as f64 / (1 << 20) as f64;
        assert!((bpe - 1.3).abs() < 0.01, "{bpe}");
    }

    #[test]
    fn rf_error_identity_end_to_end() {
        let mut rng = Rng::seed_from_u64(8);
        for (e, q) in [(4u8, 3u8), (3, 4), (5, 10)] {
            for n in [2usize, 3, 64, 101, 256] {
                let x = gauss(&mut rng, n);
                let mut c = FftConfig {
                    theta: 0.5,
                    exp_bits: e,
                    mantissa_bits: q,
                    ..FftConfig::default()
                }
                .init()
                .unwrap();
                let keep = c.select_bins(&x);
                let y = roundtrip(&mut c, &x);
                let xs = dft(&x);
                let ys = dft(&y);
                let nf = n as f64;
                // Y_k = X_k / n is what was quantized.
                let kept_y: Vec<(f64, f64)> = keep
                    .iter()
                    .map(|&b| (xs[b as usize].0 / nf, xs[b as usize].1 / nf))
                    .collect();
                let amax = kept_y
                    .iter()
                    .fold(0f64, |a, &(r, i)| a.max(r.abs()).max(i.abs()));
                let emax = amax.log2().floor() as i32;
                let emin = emax - (1 << e) + 2;
                let nx = norm2(&x);
                let mut identity = 0f64;
                for k in 0..bins(n) {
                    let w = bin_weight(n, k) as f64;
                    let (tr, ti) = (xs[k].0 / nf, xs[k].1 / nf);
                    let (dr, di) = (ys[k].0 / nf, ys[k].1 / nf);
                    if keep.contains(&(k as u32)) {
                        for (t, d) in [(tr, dr), (ti, di)] {
                            let bound =
                                (2f64.powi(-(q as i32 + 1)) * t.abs()).max(2f64.powi(emin - 1));
                            assert!(
                                (t - d).abs() <= bound + 1e-5 * amax,
                                "({e},{q}) n {n} bin {k}: {t} vs {d}"
                            );
                        }
                        identity += w * ((tr - dr).powi(2) + (ti - di).powi(2));
                    } else {
                        assert!(dr.abs() + di.abs() <= 1e-5 * amax.max(1e-30));
                        identity += w * (tr * tr + ti * ti);
                    }
                }
                let err = diff2(&x, &y);
                assert!(
                    (err - identity * nf).abs() <= 1e-5 * nx,
                    "({e},{q}) n {n}: {err} vs {}",
                    identity * nf
                );
            }
        }
    }

    #[test]
    fn dc_or_nyquist_imaginary_part_is_rejected() {
        let mut c = FftConfig {
            theta: 0.0,
            quantize: false,
            select: Select::Lowpass,
            ..FftConfig::default()
        }
        .init()
        .unwrap();
        let x = [1.0f32, 2.0, -1.0, 0.5];
        let p = compress_new(&mut c, &x, &Ctx::default(), &mut Rng::seed_from_u64(0)).unwrap();
        let mut out = [0f32; 4];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        // Frame header 12 bytes, chunk header 7, then (Re, Im) of bin 0: Im at 23..27.
        for at in [23usize, 23 + 16] {
            let mut b = p.as_bytes().to_vec();
            assert_eq!(&b[at..at + 4], &[0, 0, 0, 0]);
            b[at..at + 4].copy_from_slice(&1.0f32.to_le_bytes());
            assert!(decompress(&c, &b, &mut out).is_err(), "offset {at}");
        }
    }

    #[test]
    fn random_and_mutated_payloads_never_panic() {
        let mut rng = Rng::seed_from_u64(9);
        for (quantize, select, index_coding, chunk) in [
            (true, Select::EnergyTopk, IndexCoding::Auto, None),
            (true, Select::EnergyTopk, IndexCoding::List, Some(50)),
            (false, Select::EnergyTopk, IndexCoding::Bitmap, None),
            (true, Select::Lowpass, IndexCoding::Auto, Some(33)),
        ] {
            let mut c = FftConfig {
                theta: 0.5,
                quantize,
                select,
                index_coding,
                chunk,
                ..FftConfig::default()
            }
            .init()
            .unwrap();
            let x = gauss(&mut rng, 200);
            let p = compress_new(&mut c, &x, &Ctx::default(), &mut rng).unwrap();
            crate::rangefloat::tests::fuzz_decoder(&c, p.as_bytes(), 200, 10);
            let mut sum = c.sum(200);
            let mut b = p.as_bytes().to_vec();
            b.truncate(b.len() - 1);
            assert!(sum.add_payload(&b).is_err());
        }
    }

    #[test]
    fn theta_schedule_in_the_config_drives_theta_per_step() {
        let cfg: FftConfig = toml::from_str(
            "theta_schedule = { kind = \"step\", theta0 = 0.8, milestones = [1, 2] }\nsteps_per_epoch = 10",
        )
        .unwrap();
        let mut c = cfg.init().unwrap();
        assert_eq!(c.theta(), 0.8);
        let x = vec![1f32; 64];
        let mut rng = Rng::seed_from_u64(0);
        let mut sizes = Vec::new();
        for (step, want) in [(0u64, 0.8), (9, 0.8), (10, 0.4), (25, 0.2)] {
            let ctx = Ctx {
                step,
                ..Ctx::default()
            };
            let p = compress_new(&mut c, &x, &ctx, &mut rng).unwrap();
            assert_eq!(c.theta(), want, "step {step}");
            sizes.push(p.encoded_len());
        }
        assert!(sizes[3] > sizes[2] && sizes[2] > sizes[1], "{sizes:?}");
        let bad: FftConfig =
            toml::from_str("theta_schedule = { kind = \"step\", theta0 = 0.8, milestones = [1] }")
                .unwrap();
        assert_eq!(bad.init().unwrap_err().field, "steps_per_epoch");
        let bad: FftConfig =
            toml::from_str("theta_schedule = { kind = \"inv\", theta0 = 0.8, tau = 0 }").unwrap();
        assert!(bad.init().is_err());
    }

    #[test]
    fn config_validation_and_set_theta() {
        assert!(FftConfig {
            theta: 1.0,
            ..FftConfig::default()
        }
        .init()
        .is_err());
        assert!(FftConfig {
            theta: -0.1,
            ..FftConfig::default()
        }
        .init()
        .is_err());
        assert!(FftConfig {
            chunk: Some(0),
            ..FftConfig::default()
        }
        .init()
        .is_err());
        let mut c = fft(0.9, true);
        let before = c.segment_bits(1000).unwrap();
        c.set_theta(0.5).unwrap();
        assert_eq!(c.theta(), 0.5);
        assert!(c.segment_bits(1000).unwrap() > before);
        assert!(c.set_theta(1.0).is_err());
        assert_eq!(c.theta(), 0.5);
    }

    #[test]
    fn theta_scale_applies_on_top_of_the_schedule_and_round_trips() {
        let sched = ThetaSchedule::Inv {
            theta0: 0.8,
            tau: 3.0,
        };
        let cfg = FftConfig {
            theta_schedule: Some(sched.clone()),
            ..FftConfig::default()
        };
        let mut f = cfg.init().unwrap();
        let x: Vec<f32> = (0..500).map(|i| ((i * 37) % 101) as f32 - 50.0).collect();
        let at = |step: u64| Ctx {
            step,
            ..Ctx::default()
        };
        let mut rng = Rng::seed_from_u64(0);
        compress_new(&mut f, &x, &at(2), &mut rng).unwrap();
        assert_eq!(f.ratio_metric(), Some(("theta", sched.theta(2, 0))));
        assert!(f.scale_theta(0.5));
        assert_eq!(f.theta(), sched.theta(2, 0) * 0.5);
        let scaled = compress_new(&mut f, &x, &at(3), &mut rng).unwrap();
        assert_eq!(f.theta(), sched.theta(3, 0) * 0.5);
        assert_eq!(f.theta_scale(), 0.5);
        let mut plain = cfg.init().unwrap();
        let unscaled = compress_new(&mut plain, &x, &at(3), &mut rng).unwrap();
        assert!(scaled.encoded_len() > unscaled.encoded_len());
        // A restored compressor compresses the next step identically.
        let state = f.export_state();
        assert!(plain.import_state(&state).is_ok());
        assert_eq!(plain.theta_scale(), 0.5);
        assert_eq!(
            compress_new(&mut plain, &x, &at(4), &mut rng).unwrap(),
            compress_new(&mut f, &x, &at(4), &mut rng).unwrap()
        );
        // Bad states are refused and change nothing.
        let mut fresh = cfg.init().unwrap();
        for bad in [
            BTreeMap::from([("theta_scale".to_string(), -1.0)]),
            BTreeMap::from([("theta_base".to_string(), 1.0)]),
            BTreeMap::from([("theta_scale".to_string(), 0.5), ("what".to_string(), 0.0)]),
        ] {
            assert!(fresh.import_state(&bad).is_err(), "{bad:?}");
            assert_eq!(fresh.theta_scale(), 1.0);
        }
        // Without a schedule the scale applies to `theta` and to later `set_theta` values.
        let mut f = FftConfig::default().init().unwrap();
        assert!(f.scale_theta(0.5));
        assert_eq!(f.theta(), 0.45);
        f.set_theta(0.6).unwrap();
        assert_eq!(f.theta(), 0.3);
        assert!(f.scale_theta(10.0));
        assert!(f.theta() < 1.0, "θ stays in [0, 1)");
    }

    #[test]
    #[should_panic(expected = "theta scale factor")]
    fn a_negative_theta_scale_factor_panics() {
        FftConfig::default().init().unwrap().scale_theta(-0.5);
    }
}
