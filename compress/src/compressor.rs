//! The `Compressor` seam, the payload container and the framing shared by every method.
//!
//! A compressor sees one **segment** (one layer's tensor) at a time; the framing in
//! [`compress`] / [`decompress_add`] splits a bucket into the segments the caller names,
//! writes the header and the segment table, and checks everything on the way back in.
//! Per-tensor statistics (norms, scalers, thresholds) are therefore per segment by
//! construction, which is what the papers specify (ALGORITHMS.md §0.2).
//!
//! ## Wire layout (version 1, little-endian)
//! ```text
//! offset size field
//! 0      1    magic 0xD7
//! 1      1    version (1)
//! 2      1    method id (see [`MethodId`])
//! 3      1    reserved, 0
//! 4      4    n: u32, elements in the whole buffer
//! 8      4    s: u32, number of segments (0 iff n == 0)
//! 12     4·s  segment lengths (only when s > 1)
//! ...         one body per segment, in order, each of the method's own format
//! ```
//! The fixed header costs [`HEADER_BITS`] = 96 bits per payload (plus 32 bits per segment
//! when there is more than one); bits-per-element formulas in ALGORITHMS.md count the
//! bodies only, and [`Compressor::segment_bits`] is tested against the encoded length.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::error::{CompressError, WireError};
pub use crate::lanes::{sum_lanes, summable_lanes, LaneFormat};
use crate::put::Put;
use crate::rng::Rng;
pub use crate::touched::Touched;
use crate::wire::{Reader, Writer};

pub use crate::finite::{
    first_non_finite, scale_has_non_finite, scale_into_has_non_finite, FirstNonFinite,
};

/// First byte of every payload.
pub const MAGIC: u8 = 0xD7;
/// Wire-format version written by this crate.
pub const VERSION: u8 = 1;
/// Size of the fixed payload header in bits.
pub const HEADER_BITS: u64 = 96;
/// Largest buffer a payload can describe (indices are `u32`; sign-tagged words use 31 bits).
pub const MAX_ELEMS: usize = u32::MAX as usize;

/// How the payloads of P workers are combined (ALGORITHMS.md §0.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregation {
    /// Decode locally, then sum the dense f32 buffers with an all-reduce (pattern A).
    Dense,
    /// The payloads of all workers share their layout and their value lanes can be summed
    /// element-wise with an all-reduce (pattern C), e.g. shared-seed random-k.
    Summable,
    /// All-gather every worker's payload; each receiver decodes and sums (pattern B).
    Gather,
}

/// How the workers' decoded payloads become the step's update, once summed and scaled by
/// `1/P` (the exchanger's mean, [`Combine::finish`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Combine {
    /// The mean itself: every method but the voting ones.
    #[default]
    Mean,
    /// The sign of the mean, i.e. of the sum: signSGD's majority vote (Bernstein et al.,
    /// ICLR 2019) when each payload decodes to `±1`. A tie (an even number of workers split
    /// evenly) gives 0, as `torch.sign` of the summed signs does in the authors' code; a
    /// NaN stays NaN, so the trainer's non-finite check still sees it.
    MajorityVote,
}

impl Combine {
    /// Turns the mean `avg` (the sum of the decoded payloads times `1/P`) into the update,
    /// in place.
    pub fn finish(self, avg: &mut [f32]) {
        match self {
            Combine::Mean => {}
            Combine::MajorityVote => {
                for v in avg {
                    if *v > 0.0 {
                        *v = 1.0;
                    } else if *v < 0.0 {
                        *v = -1.0;
                    } else if *v == 0.0 {
                        *v = 0.0;
                    }
                }
            }
        }
    }
}

/// A method's stable one-byte identifier, written into every payload header. Each method
/// declares its own ([`crate::Method::ID`]); the registry's tests check that no two
/// registered methods share one, and 0 is never used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MethodId(pub u8);

impl std::fmt::Display for MethodId {
    /// The registered method's name and the byte, e.g. `topk (id 3)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match crate::MethodInfo::by_id(*self) {
            Some(m) => write!(f, "{} (id {})", m.name, self.0),
            None => write!(f, "unregistered method id {}", self.0),
        }
    }
}

/// Per-call context: where this buffer sits in the training run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ctx<'a> {
    /// Global step (iteration) number.
    pub step: u64,
    /// This worker's rank.
    pub rank: u32,
    /// Stable id of the bucket (used for per-bucket state and RNG streams).
    pub bucket: u64,
    /// Layer boundaries inside the buffer; empty means one segment covering everything.
    /// Segments must be non-empty, contiguous, in order and cover the whole buffer.
    pub segments: &'a [Range<usize>],
}

/// A compressed buffer: exactly the bytes that go on the wire.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Payload {
    bytes: Vec<u8>,
}

impl Payload {
    /// An empty payload whose buffer can be reused across steps.
    pub fn new() -> Self {
        Self::default()
    }

    /// The encoded bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Encoded length in bytes (what the transport sends).
    pub fn encoded_len(&self) -> usize {
        self.bytes.len()
    }

    /// Takes the bytes out.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// Wraps received bytes after checking the fixed header (magic, version, lengths).
    /// Method-specific bodies are validated by [`decompress_add`].
    pub fn decode(bytes: Vec<u8>) -> Result<Self, WireError> {
        Header::parse(&mut Reader::new(&bytes))?;
        Ok(Payload { bytes })
    }

    /// The header fields.
    pub fn header(&self) -> Result<Header, WireError> {
        Header::parse(&mut Reader::new(&self.bytes))
    }

    /// Mutable access to the bytes (used by summable aggregation).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }

    /// The byte buffer itself (cleared by the caller), for encoders outside this crate that
    /// write a payload in place: the device codecs of `dtrain-device` write the framing with
    /// [`write_frame_header`] and append the bodies their kernels produced. The caller owns
    /// the format; [`decompress_add`] checks it on the way back in.
    pub fn buffer_mut(&mut self) -> &mut Vec<u8> {
        &mut self.bytes
    }
}

/// The fixed part of a payload header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Method id byte.
    pub method: u8,
    /// Elements in the buffer.
    pub n: usize,
    /// Number of segments.
    pub segments: usize,
}

impl Header {
    pub(crate) fn parse(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let magic = r.u8("magic")?;
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let version = r.u8("version")?;
        if version != VERSION {
            return Err(WireError::UnsupportedVersion(version));
        }
        let method = r.u8("method id")?;
        let reserved = r.u8("reserved")?;
        if reserved != 0 {
            return Err(WireError::Invalid("reserved header byte is not zero"));
        }
        let n = r.u32("element count")? as usize;
        let segments = r.u32("segment count")? as usize;
        if (n == 0) != (segments == 0) {
            return Err(WireError::BadSegments("segment count must be 0 iff n is 0"));
        }
        if segments > n {
            return Err(WireError::BadSegments("more segments than elements"));
        }
        Ok(Header {
            method,
            n,
            segments,
        })
    }
}

/// A gradient compressor working on one segment (tensor) at a time.
///
/// # Why this shape
/// * Compressors see `&[f32]`, never framework tensors, so they build and test in seconds
///   and can be reused outside dtrain.
/// * Randomness is an explicit argument ([`Rng`]) so every run is reproducible and tests can
///   average over seeds.
/// * Error feedback is *not* in here: it is the [`crate::memory::Memory`] seam, applied by
///   the caller around `compress`. Methods whose papers build EF in (1-bit SGD, Strom,
///   Dryden) are plain deterministic quantizers here and are configured with residual
///   memory by default.
/// * Compressors may keep state across steps (`&mut self`), keyed by the bucket id in
///   [`Ctx`]; that state must be exportable for checkpoints.
pub trait Compressor: Send {
    /// The method's id byte.
    fn method(&self) -> MethodId;

    /// How payloads of several workers combine.
    fn aggregation(&self) -> Aggregation;

    /// How the mean of the workers' decoded payloads becomes the update ([`Combine`]).
    /// Default: the mean itself.
    fn combine(&self) -> Combine {
        Combine::Mean
    }

    /// Whether `E[D(C(g))] == g` (given the method's own documented conditions).
    fn unbiased(&self) -> bool {
        false
    }

    /// Longest segment this method's wire format can describe. [`compress`] fails with
    /// [`CompressError::TooLarge`] when a segment is longer. Default: [`MAX_ELEMS`]; methods
    /// that pack an index with a flag bit into a `u32` word lower it to `2^31`.
    fn max_segment_len(&self) -> usize {
        MAX_ELEMS
    }

    /// Called once when the compressor is set up for a bucket, with the shapes of the
    /// bucket's segments in order (the parameter tensors, burn layout: a `Linear` weight is
    /// `[d_in, d_out]`). Methods that exploit a tensor's structure keep them; the default
    /// ignores them.
    fn set_segment_shapes(&mut self, _shapes: &[Vec<usize>]) {}

    /// Called once per buffer before its segments are encoded; lets a method compute a
    /// statistic over the whole buffer (e.g. a global threshold). Default: nothing.
    fn begin(&mut self, _grad: &[f32], _ctx: &Ctx<'_>) {}

    /// Encodes one segment's body. `x` is finite (the framing checks that first), unless the
    /// method finds non-finite input itself ([`Compressor::finds_non_finite`]).
    fn encode_segment(&mut self, x: &[f32], rng: &mut Rng, w: &mut Writer<'_>);

    /// Whether this method's encoder detects non-finite input in passes it makes anyway (a
    /// statistic that a NaN or an infinity poisons, a selection that always keeps them) and
    /// reports the first one through [`Compressor::take_non_finite`]. [`compress`] then
    /// skips its own scan of the input, a whole pass over memory. Default false.
    ///
    /// A method that answers true must find **every** non-finite input, report the lowest
    /// index (counted from the start of the buffer, over all segments of the call), and
    /// keep no state of a failed call that a following call would see: [`compress`] then
    /// discards the bytes written and restores the generator.
    fn finds_non_finite(&self) -> bool {
        false
    }

    /// For a method that [finds non-finite input](Compressor::finds_non_finite): the first
    /// non-finite element of the buffer encoded since [`Compressor::begin`] (its index in
    /// the buffer and its value), or `None`. Default `None`.
    fn take_non_finite(&mut self) -> Option<(usize, f32)> {
        None
    }

    /// Encodes the bodies of all `segments` of `x` (tiling it, in order), as [`compress`]
    /// does after [`Compressor::begin`]. Default: [`Compressor::encode_segment`] on each in
    /// turn. A method may encode them side by side (the FFT method on several threads) if it
    /// writes the same bytes and keeps the same state as the default would.
    fn encode_segments(
        &mut self,
        x: &[f32],
        segments: &[Range<usize>],
        rng: &mut Rng,
        w: &mut Writer<'_>,
    ) {
        for s in segments {
            self.encode_segment(&x[s.clone()], rng, w);
        }
    }

    /// Decodes one segment's body from `r` and **adds** it into `out` (`out.len()` is the
    /// segment length). Must validate everything it reads; must not panic on any input.
    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError>;

    /// [`Compressor::decode_segment_add`], also marking in `touched` every element of `out`
    /// it adds to (indices relative to `out`), for [`decompress_mean`]. The default marks the
    /// whole segment, which is right for any method; a method whose body lists the indices
    /// it adds at (the sparsifiers) marks those alone, so that the mean scales them alone.
    /// An element left unmarked must be left unchanged.
    fn decode_segment_add_touched(
        &self,
        r: &mut Reader<'_>,
        out: &mut [f32],
        touched: &mut Touched,
    ) -> Result<(), WireError> {
        self.decode_segment_add(r, out)?;
        touched.mark_range(0..out.len());
        Ok(())
    }

    /// Whether this method's decode reaches every element of a segment (QSGD's fixed-width
    /// codes, TernGrad), so that [`decompress_mean`] has it put each value where the mean
    /// goes in one pass per payload ([`Compressor::decode_segment_dense`]) — no zero fill
    /// first, the scaling by `1/P` fused into the last payload's decode (in place of a
    /// joint decoder's sum, [`Compressor::joint_decompress_add`]). Default false.
    fn decodes_densely(&self) -> bool {
        false
    }

    /// Decodes one segment's body from `r` and puts every element's value `v` into `out` as
    /// `put` says ([`Put`]), returning whether a scaled result is a NaN or an infinity: bit
    /// for bit a zero fill (for [`Put::Write`]), [`Compressor::decode_segment_add`] and, with
    /// a scale, [`scale_has_non_finite`]. The default takes those passes one by one
    /// ([`dense_by_passes`](crate::put::dense_by_passes)); a method that [decodes densely](Compressor::decodes_densely)
    /// does it in one. After an error `out` may hold anything.
    fn decode_segment_dense(
        &self,
        r: &mut Reader<'_>,
        out: &mut [f32],
        put: Put,
    ) -> Result<bool, WireError> {
        crate::put::dense_by_passes(self, r, out, put)
    }

    /// Exact encoded size in bits of one segment body of `n` elements, when it depends only
    /// on `n` and the configuration; `None` for data-dependent sizes (thresholds).
    fn segment_bits(&self, n: usize) -> Option<u64>;

    /// For [`Aggregation::Summable`] methods: skips one segment body of `len` elements and
    /// returns the byte range (relative to the reader's buffer) of its value lane, the part
    /// an all-reduce sums element-wise, in [`Compressor::lane_format`]. Other methods keep the
    /// default, which refuses.
    fn segment_lane(&self, _r: &mut Reader<'_>, _len: usize) -> Result<Range<usize>, WireError> {
        Err(WireError::Invalid("method has no summable value lane"))
    }

    /// For [`Aggregation::Summable`] methods: how the value lanes (and a summed agreement's
    /// message, [`Compressor::summed_agreement`]) hold their numbers, and so in which
    /// precision the all-reduce that sums them moves and adds them. Default
    /// [`LaneFormat::F32`].
    fn lane_format(&self) -> LaneFormat {
        LaneFormat::F32
    }

    // ---- Hooks for a multi-rank driver (the framework's exchanger). Every one defaults to
    // ---- "not applicable", so a one-phase, stateless method implements none of them.

    /// Tells the compressor how many ranks exchange its payloads. The framework's exchanger
    /// calls this before every step with the communicator's world size, so it **overrides**
    /// any world size in the method's configuration. Default: ignored. ScaleCom rotates its
    /// leader over this many ranks.
    fn set_world_size(&mut self, _world: usize) {}

    /// Two-phase methods: the rank whose [`Compressor::broadcast_message`] every rank must
    /// install before compressing the buffer of `ctx` (the same answer on every rank), or
    /// `None` (the default) for a one-phase method.
    ///
    /// # The agreement protocol
    /// Some methods need the ranks to agree, before anyone compresses, on something one rank
    /// decides from its own data: ScaleCom's CLT-k index set is the top-k of the step's
    /// leader. Per step and bucket, with `p` the memory-compensated buffer:
    /// 1. `root = broadcast_root(ctx)`; if `None`, compress as usual;
    /// 2. on `root`: `broadcast_message(p, ctx, &mut msg)`;
    /// 3. broadcast `msg` from `root`;
    /// 4. on every rank, `root` included: `install_broadcast(&msg, p.len(), ctx)`;
    /// 5. on every rank: [`compress`]`(p, ctx, …)` encodes under the installed agreement.
    ///
    /// The hook is generic (rather than the driver downcasting to the concrete type) so that
    /// [`crate::Pipeline`] keeps the memory composition (compensate → compress → update) in
    /// one place and a driver holding `Box<dyn Compressor>` can run any such method.
    fn broadcast_root(&self, _ctx: &Ctx<'_>) -> Option<usize> {
        None
    }

    /// Two-phase methods, on the root only: encodes into `out` (cleared) the agreement
    /// message for the compensated buffer `compensated`. Default: an error (one-phase
    /// methods have no message).
    fn broadcast_message(
        &mut self,
        _compensated: &[f32],
        _ctx: &Ctx<'_>,
        _out: &mut Vec<u8>,
    ) -> Result<(), CompressError> {
        Err(CompressError::Agreement(
            "method has no pre-compression broadcast".into(),
        ))
    }

    /// Two-phase methods, on every rank: validates and installs the root's message for the
    /// buffer of `n` elements of `ctx`; the next [`compress`] of that bucket at that step
    /// uses it. A message that does not fit (other step, bucket or layout; malformed bytes)
    /// is an error. Default: an error.
    fn install_broadcast(
        &mut self,
        _message: &[u8],
        _n: usize,
        _ctx: &Ctx<'_>,
    ) -> Result<(), CompressError> {
        Err(CompressError::Agreement(
            "method has no pre-compression broadcast".into(),
        ))
    }

    /// Two-phase methods whose agreement is a **sum** over the ranks rather than a root's
    /// message (PowerSGD's `P = Σ_w M_w·Q`): `Some(len)`, the length of the `f32` message
    /// every rank contributes for the buffer of `ctx` (the same on every rank); `None` (the
    /// default) otherwise. The protocol is the broadcast's with an all-reduce in its place,
    /// per step and bucket, with `p` the memory-compensated buffer:
    /// 1. on every rank: `sum_message(p, ctx, &mut msg)`;
    /// 2. all-reduce (sum) `msg`;
    /// 3. on every rank: `install_sum(&summed, p.len(), ctx)`;
    /// 4. on every rank: [`compress`]`(p, ctx, …)` encodes under the installed agreement.
    fn summed_agreement(&self, _ctx: &Ctx<'_>) -> Option<usize> {
        None
    }

    /// Summed-agreement methods: writes this rank's message for the compensated buffer into
    /// `out` (cleared). Default: an error.
    fn sum_message(
        &mut self,
        _compensated: &[f32],
        _ctx: &Ctx<'_>,
        _out: &mut Vec<f32>,
    ) -> Result<(), CompressError> {
        Err(CompressError::Agreement(
            "method has no summed agreement".into(),
        ))
    }

    /// Summed-agreement methods: validates and installs the summed messages for the buffer
    /// of `n` elements of `ctx`. Default: an error.
    fn install_sum(
        &mut self,
        _summed: &[f32],
        _n: usize,
        _ctx: &Ctx<'_>,
    ) -> Result<(), CompressError> {
        Err(CompressError::Agreement(
            "method has no summed agreement".into(),
        ))
    }

    /// Whether the method must see the step's aggregate ([`Compressor::absorb_aggregate`]):
    /// PowerSGD warm-starts the next step from it. Default: false.
    fn absorbs_aggregate(&self, _ctx: &Ctx<'_>) -> bool {
        false
    }

    /// The step's aggregate for the buffer of `ctx`: `summed`, this method's payload with
    /// its value lanes summed over the ranks. Called by a multi-rank driver after the
    /// collective, on every rank alike. Default: nothing.
    fn absorb_aggregate(&mut self, _summed: &[u8], _ctx: &Ctx<'_>) {}

    /// Whether, after a summed agreement, the error-feedback memory is to be updated with
    /// the mean of the aggregate rather than with this rank's own decoded payload
    /// (PyTorch's PowerSGD: `e = p − P̂·Q̄ᵀ`). Without a multi-rank driver (one process, a
    /// parameter server) the own payload is used. Default: false.
    fn feedback_from_aggregate(&self) -> bool {
        false
    }

    /// Whether the compressed all-reduce's owners keep a server residual for this method
    /// when the workers have error feedback: two-way error feedback (Tang et al. 2021), the
    /// owner re-encoding its range's sum plus what its earlier encodings left out. Default:
    /// true. The deterministic sign quantizers say no: where the workers' signs disagree the
    /// sum is near zero, its re-encoding is a full-magnitude ±value, and the residual then
    /// flips sign from step to step; on LeNet-5 / MNIST (4 workers, one epoch) 1-bit SGD and
    /// EF-signSGD lost 7–9 accuracy points with it and matched the all-gather without it
    /// (experiments/README.md, "Compressed all-reduce"). `[compress]
    /// server_error_feedback` overrides this.
    fn owner_error_feedback(&self) -> bool {
        true
    }

    /// Takes over classic residual error feedback (`e ← p − D(C(p))`, β = γ = 1) and keeps
    /// the residual itself, in a domain of its own where that is cheaper than the generic
    /// [`Memory`](crate::memory::Memory), which needs the decode of the method's own payload
    /// every step. The FFT method keeps its residual as spectra: compensating is a spectral
    /// add after its forward transform, and the update needs no inverse transform.
    ///
    /// Called once by [`Pipeline::new`](crate::Pipeline::new) when its memory is that
    /// residual. `Some(name)` accepts: the pipeline then drops its memory, [`compress`]
    /// encodes `g + e` and updates `e` inside the method, and the residual is exported and
    /// imported through [`Compressor::export_feedback`] / [`Compressor::import_feedback`],
    /// with `name` in the checkpoint's memory kind (`residual/<name>`) so that a residual of
    /// the other domain is refused, not misread. `None` (the default): the generic memory.
    fn adopt_error_feedback(&mut self) -> Option<&'static str> {
        None
    }

    /// With adopted error feedback: the next [`compress`] call encodes the bucket's elements
    /// from `offset` on (the compressed all-reduce encodes a bucket as one payload per
    /// owner's range); the call after it starts at 0 again. Default: nothing.
    fn feedback_offset(&mut self, _offset: usize) {}

    /// The adopted residuals, one buffer per bucket key with one `f32` per bucket element
    /// (in the method's own domain). Empty by default.
    fn export_feedback(&self) -> BTreeMap<u64, Vec<f32>> {
        BTreeMap::new()
    }

    /// Restores [`Compressor::export_feedback`] (an empty map clears every residual).
    fn import_feedback(&mut self, _state: BTreeMap<u64, Vec<f32>>) {}

    /// The adopted residual of bucket `key` as a signal (what the generic memory would hold),
    /// for a bucket with these layer boundaries ([`Ctx::segments`]), written into `out` (the
    /// bucket's length). `false` where there is none (the default; no bucket `key`).
    fn feedback_signal(&self, _key: u64, _segments: &[Range<usize>], _out: &mut [f32]) -> bool {
        false
    }

    /// Decodes the payloads of several workers jointly and adds their sum into `out`, when
    /// the method has a cheaper way than decoding each (FFT: sum the sparse spectra, then
    /// one inverse transform per chunk — the linearity shortcut of ALGORITHMS.md §0.4).
    /// `None` (the default): no joint decoder; [`decompress_sum_add`] then decodes the
    /// payloads one by one. An error names the index of the offending payload.
    fn joint_decompress_add(
        &self,
        _payloads: &[&[u8]],
        _out: &mut [f32],
    ) -> Option<Result<(), (usize, WireError)>> {
        None
    }

    /// The joint decoder's mean written straight into `out` (overwriting it), where the
    /// method can do that in fewer passes than [`decompress_mean`]'s zero fill,
    /// [`Compressor::joint_decompress_add`] and scaling by `inv` (1/P) — and bit for bit
    /// the same. Returns whether the mean holds a NaN or an infinity. `None` (the default):
    /// [`decompress_mean`] takes those three steps.
    fn joint_decompress_mean(
        &self,
        _payloads: &[&[u8]],
        _inv: f32,
        _out: &mut [f32],
    ) -> Option<Result<bool, (usize, WireError)>> {
        None
    }

    /// The compression knob a trainer logs each step: `("theta", θ)` for a drop ratio (FFT,
    /// after its schedule and [`Compressor::scale_theta`]), `("density", ρ)` for a sparsifier
    /// with a known kept fraction (top-k, random-k, ScaleCom, gradient dropping, DGC's
    /// warm-up density), `None` (the default) where no single number describes it. Values
    /// that follow a schedule are those of the most recent [`compress`] call (schedules are
    /// evaluated in [`Compressor::begin`]), or the configured starting value before any.
    fn ratio_metric(&self) -> Option<(&'static str, f64)> {
        None
    }

    /// Multiplies the drop ratio θ by `factor` (the "recover" rule,
    /// [`crate::schedule::Recover`]). The scale persists: it applies on top of any θ
    /// schedule at every later step, and several calls multiply. Returns `false` (and does
    /// nothing) for methods without a θ (the default).
    ///
    /// # Panics
    /// If `factor` is negative or not finite.
    fn scale_theta(&mut self, factor: f64) -> bool {
        check_factor(factor);
        false
    }

    /// State the compressor carries across steps that is **not** a pure function of its
    /// configuration and the step: what a checkpoint must hold, besides the error-feedback
    /// memory, for a resumed run to continue bit for bit. Named scalars; empty (the default)
    /// for methods whose state is pure scratch or re-derived from `ctx` in
    /// [`Compressor::begin`].
    fn export_state(&self) -> BTreeMap<String, f64> {
        BTreeMap::new()
    }

    /// Restores [`Compressor::export_state`]; an unknown name or an out-of-range value is an
    /// error and leaves the compressor unchanged. Default: accepts only an empty state.
    fn import_state(&mut self, state: &BTreeMap<String, f64>) -> Result<(), String> {
        match state.keys().next() {
            None => Ok(()),
            Some(k) => Err(format!(
                "method {} carries no state, but the checkpoint has {k:?}",
                self.method()
            )),
        }
    }
}

/// Whether `c` runs an agreement phase (a [`Compressor::broadcast_root`] or a
/// [`Compressor::summed_agreement`]) at any step: judged at the first step and at a late
/// one, because a method may start late — PowerSGD with `start_step` sends its first steps
/// dense and agrees on `P` from then on. Routes and error-feedback keepers chosen once for
/// a run must fit its later steps, not only its first.
pub fn two_phase(c: &dyn Compressor) -> bool {
    [0, u64::MAX].into_iter().any(|step| {
        let at = Ctx {
            step,
            ..Ctx::default()
        };
        c.broadcast_root(&at).is_some() || c.summed_agreement(&at).is_some()
    })
}

/// Panics unless `factor` is a valid θ scale factor (finite, ≥ 0); see
/// [`Compressor::scale_theta`].
pub fn check_factor(factor: f64) {
    assert!(
        factor.is_finite() && factor >= 0.0,
        "theta scale factor must be finite and >= 0, got {factor}"
    );
}

/// Validates `segments` against a buffer of length `n` and returns the effective list.
pub fn effective_segments(
    n: usize,
    segments: &[Range<usize>],
) -> Result<Vec<Range<usize>>, CompressError> {
    if n == 0 {
        if segments.iter().any(|s| !s.is_empty()) {
            return Err(CompressError::BadSegments(
                "segments on an empty buffer".into(),
            ));
        }
        return Ok(Vec::new());
    }
    if segments.is_empty() {
        return Ok(std::iter::once(0..n).collect());
    }
    let mut at = 0;
    for s in segments {
        if s.start != at || s.end <= s.start {
            return Err(CompressError::BadSegments(format!(
                "segment {s:?} does not start at {at} or is empty"
            )));
        }
        at = s.end;
    }
    if at != n {
        return Err(CompressError::BadSegments(format!(
            "segments cover {at} of {n} elements"
        )));
    }
    Ok(segments.to_vec())
}

/// Parses and validates the framing of `bytes` (header and segment table) for a decoder of
/// method `method` and an output of `n` elements, returning a reader positioned at the first
/// segment body and the segment ranges. For receivers that decode bodies themselves (e.g.
/// summing several spectra before one inverse transform); [`decompress_add`] performs the
/// same checks.
pub fn read_frame(
    method: MethodId,
    bytes: &[u8],
    n: usize,
) -> Result<(Reader<'_>, Vec<Range<usize>>), WireError> {
    let mut r = Reader::new(bytes);
    let h = Header::parse(&mut r)?;
    if h.method != method.0 {
        return Err(WireError::WrongMethod {
            expected: method.0,
            found: h.method,
        });
    }
    if h.n != n {
        return Err(WireError::LengthMismatch {
            payload: h.n,
            buffer: n,
        });
    }
    let mut segs = Vec::new();
    if h.segments == 1 {
        segs.push(0..n);
    } else if h.segments > 1 {
        let table = r.take_items(h.segments, 4, "segment table")?;
        let mut at = 0usize;
        for i in 0..h.segments {
            let len = crate::wire::u32_at(table, i) as usize;
            if len == 0 {
                return Err(WireError::BadSegments("empty segment"));
            }
            let end = at
                .checked_add(len)
                .filter(|&e| e <= h.n)
                .ok_or(WireError::BadSegments("segments exceed n"))?;
            segs.push(at..end);
            at = end;
        }
        if at != h.n {
            return Err(WireError::BadSegments("segments do not cover n"));
        }
    }
    Ok((r, segs))
}

/// Writes the framing every payload starts with: magic, version, method id, a reserved
/// byte, the element count, the segment count and (for more than one segment) the segment
/// lengths. The segment bodies follow. Public for encoders that produce the bodies
/// elsewhere (the device codecs of `dtrain-device`), so every payload's framing is written
/// here once.
pub fn write_frame_header(w: &mut Writer<'_>, method: MethodId, n: usize, segs: &[Range<usize>]) {
    w.u8(MAGIC);
    w.u8(VERSION);
    w.u8(method.0);
    w.u8(0);
    w.u32(n as u32);
    w.u32(segs.len() as u32);
    if segs.len() > 1 {
        for s in segs {
            w.u32(s.len() as u32);
        }
    }
}

/// Compresses `grad` into `out` (cleared first; its allocation is reused).
///
/// Fails on non-finite input, on buffers over [`MAX_ELEMS`], on segments longer than
/// [`Compressor::max_segment_len`], and on segment lists that do not tile the buffer.
pub fn compress(
    c: &mut dyn Compressor,
    grad: &[f32],
    ctx: &Ctx<'_>,
    rng: &mut Rng,
    out: &mut Payload,
) -> Result<(), CompressError> {
    compress_scanning(c, grad, ctx, rng, out, true)
}

/// [`compress`], scanning `grad` for non-finite values only when `scan`: a caller that has
/// just checked `grad` itself passes false (the trainer scans the whole gradient before a
/// compressed exchange; a second pass over it here cost ~6 % of a top-k step on a
/// 4 M-parameter MLP). A non-finite value in an unscanned `grad` is encoded as the method's
/// arithmetic makes it, and the decoded average shows it. The other checks remain.
///
/// For a method that [finds non-finite input](Compressor::finds_non_finite) itself, the
/// scan is its own: the same error (first index, its value), no separate pass; on that
/// error `out` is left empty and `rng` as it was.
pub fn compress_scanning(
    c: &mut dyn Compressor,
    grad: &[f32],
    ctx: &Ctx<'_>,
    rng: &mut Rng,
    out: &mut Payload,
    scan: bool,
) -> Result<(), CompressError> {
    let n = grad.len();
    if n > MAX_ELEMS {
        return Err(CompressError::TooLarge(n));
    }
    // A method that finds non-finite input in its own passes is asked afterwards instead.
    let fused = scan && c.finds_non_finite();
    if let Some((index, value)) = (scan && !fused).then(|| first_non_finite(grad)).flatten() {
        return Err(CompressError::NonFinite { index, value });
    }
    let segs = effective_segments(n, ctx.segments)?;
    if let Some(s) = segs.iter().find(|s| s.len() > c.max_segment_len()) {
        return Err(CompressError::TooLarge(s.len()));
    }
    // A failed fused call leaves the generator where it was, as the scan before would have.
    let saved = fused.then(|| rng.clone());
    c.begin(grad, ctx);
    out.bytes.clear();
    let mut w = Writer::new(&mut out.bytes);
    write_frame_header(&mut w, c.method(), n, &segs);
    c.encode_segments(grad, &segs, rng, &mut w);
    let found = c.take_non_finite();
    if let (Some((index, value)), Some(saved)) = (found, saved) {
        out.bytes.clear();
        *rng = saved;
        return Err(CompressError::NonFinite { index, value });
    }
    Ok(())
}

/// Convenience: compress into a fresh payload.
pub fn compress_new(
    c: &mut dyn Compressor,
    grad: &[f32],
    ctx: &Ctx<'_>,
    rng: &mut Rng,
) -> Result<Payload, CompressError> {
    let mut p = Payload::new();
    compress(c, grad, ctx, rng, &mut p)?;
    Ok(p)
}

/// Decodes the payloads of several workers (in rank order) and adds their sum into `out`:
/// the method's joint decoder where it has one ([`Compressor::joint_decompress_add`]), else
/// [`decompress_add`] of each in turn. On a malformed payload the error carries its index
/// (and `out` may hold a partial sum).
pub fn decompress_sum_add(
    c: &dyn Compressor,
    payloads: &[&[u8]],
    out: &mut [f32],
) -> Result<(), (usize, WireError)> {
    if let Some(res) = c.joint_decompress_add(payloads, out) {
        return res;
    }
    for (i, p) in payloads.iter().enumerate() {
        decompress_add(c, p, out).map_err(|e| (i, e))?;
    }
    Ok(())
}

/// Decodes `bytes` (as produced by [`compress`] with the same configuration) and adds the
/// reconstruction into `out`. Never panics; any malformed input is a [`WireError`], and
/// `out` may then hold a partial sum.
pub fn decompress_add(c: &dyn Compressor, bytes: &[u8], out: &mut [f32]) -> Result<(), WireError> {
    decode_frame(c, bytes, out.len(), |r, seg| {
        c.decode_segment_add(r, &mut out[seg])
    })
}

/// [`decompress_add`], also marking in `touched` the elements the decode added to
/// ([`Compressor::decode_segment_add_touched`]); the marks of earlier calls stay, so that
/// several payloads' decodes into one buffer mark their union. A `touched` of another length
/// than `out` is reset for it first.
pub fn decompress_add_touched(
    c: &dyn Compressor,
    bytes: &[u8],
    out: &mut [f32],
    touched: &mut Touched,
) -> Result<(), WireError> {
    if touched.len() != out.len() {
        touched.reset(out.len());
    }
    decode_frame(c, bytes, out.len(), |r, seg| {
        touched.set_base(seg.start);
        c.decode_segment_add_touched(r, &mut out[seg], touched)
    })
}

/// The mean of several workers' payloads (in rank order) written into `out` (overwriting
/// it): zero, add each decode, multiply by `inv` (`1/P`). Returns whether the mean holds a
/// NaN or an infinity. Bit for bit [`decompress_sum_add`] into a zeroed `out` followed by
/// [`scale_has_non_finite`], but only the elements the decodes added to are scaled
/// ([`Touched`]; `touched` is scratch, reused across calls): a sparsifier's mean then
/// costs the zero fill and its entries, not a second pass over the buffer. `inv` must be
/// positive. A method that [decodes densely](Compressor::decodes_densely) puts each
/// payload's values where the mean goes ([`Compressor::decode_segment_dense`]): no zero
/// fill, the scaling fused into the last decode. A method with a joint decoder uses it and
/// scales the whole buffer — in one pass where it writes the mean itself
/// ([`Compressor::joint_decompress_mean`]). On return
/// `touched` marks what was scaled. On a malformed payload the error carries its index, and
/// `out` may hold anything.
pub fn decompress_mean(
    c: &dyn Compressor,
    payloads: &[&[u8]],
    inv: f32,
    out: &mut [f32],
    touched: &mut Touched,
) -> Result<bool, (usize, WireError)> {
    debug_assert!(inv > 0.0 && inv.is_finite());
    touched.reset(out.len());
    if let Some(res) = c.joint_decompress_mean(payloads, inv, out) {
        touched.mark_range(0..out.len());
        return res;
    }
    if c.decodes_densely() {
        // Each payload's decode puts its values where the mean goes: the first writes the
        // buffer, the last scales what it leaves.
        let Some(last) = payloads.len().checked_sub(1) else {
            out.fill(0.0);
            return Ok(false);
        };
        let mut bad = false;
        for (i, p) in payloads.iter().enumerate() {
            let put = match (i == 0, i == last) {
                (true, true) => Put::Write { scale: Some(inv) },
                (true, false) => Put::Write { scale: None },
                (false, true) => Put::Add { scale: Some(inv) },
                (false, false) => Put::Add { scale: None },
            };
            decode_frame(c, p, out.len(), |r, seg| {
                bad |= c.decode_segment_dense(r, &mut out[seg], put)?;
                Ok(())
            })
            .map_err(|e| (i, e))?;
        }
        touched.mark_range(0..out.len());
        return Ok(bad);
    }
    out.fill(0.0);
    if let Some(res) = c.joint_decompress_add(payloads, out) {
        res?;
        touched.mark_range(0..out.len());
        return Ok(scale_has_non_finite(out, inv));
    }
    for (i, p) in payloads.iter().enumerate() {
        decompress_add_touched(c, p, out, touched).map_err(|e| (i, e))?;
    }
    Ok(touched.scale(out, inv))
}

/// Checks the frame of `bytes` (header, method, length `n`, segment table, no trailing
/// bytes) and calls `body` with the reader at each segment's body and that segment's range
/// of the buffer, in order.
pub(crate) fn decode_frame(
    c: &dyn Compressor,
    bytes: &[u8],
    n: usize,
    mut body: impl FnMut(&mut Reader<'_>, Range<usize>) -> Result<(), WireError>,
) -> Result<(), WireError> {
    let mut r = Reader::new(bytes);
    let h = Header::parse(&mut r)?;
    if h.method != c.method().0 {
        return Err(WireError::WrongMethod {
            expected: c.method().0,
            found: h.method,
        });
    }
    if h.n != n {
        return Err(WireError::LengthMismatch {
            payload: h.n,
            buffer: n,
        });
    }
    if h.segments <= 1 {
        if h.n > 0 {
            body(&mut r, 0..n)?;
        }
    } else {
        let table = r.take_items(h.segments, 4, "segment table")?;
        let mut at = 0usize;
        for i in 0..h.segments {
            let len = crate::wire::u32_at(table, i) as usize;
            if len == 0 {
                return Err(WireError::BadSegments("empty segment"));
            }
            let end = at
                .checked_add(len)
                .filter(|&e| e <= h.n)
                .ok_or(WireError::BadSegments("segments exceed n"))?;
            at = end;
        }
        if at != h.n {
            return Err(WireError::BadSegments("segments do not cover n"));
        }
        let mut at = 0usize;
        for i in 0..h.segments {
            let len = crate::wire::u32_at(table, i) as usize;
            body(&mut r, at..at + len)?;
            at += len;
        }
    }
    if r.remaining() != 0 {
        return Err(WireError::TrailingBytes(r.remaining()));
    }
    Ok(())
}

/// Decodes into `out`, overwriting it.
pub fn decompress(c: &dyn Compressor, bytes: &[u8], out: &mut [f32]) -> Result<(), WireError> {
    out.fill(0.0);
    decompress_add(c, bytes, out)
}

/// Exact payload size in bits for a buffer with the given segment lengths, when the method's
/// size is data-independent.
pub fn payload_bits(c: &dyn Compressor, segment_lens: &[usize]) -> Option<u64> {
    let table = if segment_lens.len() > 1 {
        32 * segment_lens.len() as u64
    } else {
        0
    };
    let mut bits = HEADER_BITS + table;
    for &l in segment_lens {
        // Each body is byte-aligned.
        bits += c.segment_bits(l)?.div_ceil(8) * 8;
    }
    Some(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The identity compressor (the baseline, built through the registry so that this file
    /// imports no method) with a tiny segment limit, to exercise the framing's check.
    struct Limited(Box<dyn Compressor>);

    impl Compressor for Limited {
        fn method(&self) -> MethodId {
            self.0.method()
        }
        fn aggregation(&self) -> Aggregation {
            self.0.aggregation()
        }
        fn encode_segment(&mut self, x: &[f32], rng: &mut Rng, w: &mut Writer<'_>) {
            self.0.encode_segment(x, rng, w)
        }
        fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
            self.0.decode_segment_add(r, out)
        }
        fn segment_bits(&self, n: usize) -> Option<u64> {
            self.0.segment_bits(n)
        }
        fn max_segment_len(&self) -> usize {
            4
        }
    }

    #[test]
    fn segments_longer_than_the_method_limit_are_refused() {
        let mut c = Limited(
            crate::CompressorConfig::default_for(crate::BASELINE)
                .unwrap()
                .build()
                .unwrap(),
        );
        let g = [1.0f32; 8];
        let mut rng = Rng::seed_from_u64(0);
        let one = Ctx::default();
        assert_eq!(
            compress_new(&mut c, &g, &one, &mut rng),
            Err(CompressError::TooLarge(8))
        );
        let segs = [0..4, 4..8];
        let two = Ctx {
            segments: &segs,
            ..Ctx::default()
        };
        let p = compress_new(&mut c, &g, &two, &mut rng).unwrap();
        let mut out = [0f32; 8];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        assert_eq!(out, g);
        let segs = [0..3, 3..8];
        let uneven = Ctx {
            segments: &segs,
            ..Ctx::default()
        };
        assert_eq!(
            compress_new(&mut c, &g, &uneven, &mut rng),
            Err(CompressError::TooLarge(5))
        );
    }

    #[test]
    fn exchanger_hooks_default_to_not_applicable() {
        for m in crate::METHODS {
            let mut c = (m.default)().build().unwrap();
            let ctx = Ctx::default();
            let two_phase = m.name == "scalecom";
            assert_eq!(c.broadcast_root(&ctx).is_some(), two_phase, "{}", m.name);
            if !two_phase {
                let mut msg = Vec::new();
                assert!(c.broadcast_message(&[1.0], &ctx, &mut msg).is_err());
                assert!(c.install_broadcast(&[], 1, &ctx).is_err());
            }
            assert_eq!(c.scale_theta(1.0), m.name == "fft", "{}", m.name);
            let state = c.export_state();
            assert_eq!(state.is_empty(), m.name != "fft", "{}", m.name);
            c.import_state(&state).unwrap();
            let unknown = BTreeMap::from([("unknown".to_string(), 1.0)]);
            assert!(c.import_state(&unknown).is_err(), "{}", m.name);
            if let Some((name, v)) = c.ratio_metric() {
                assert!(["theta", "density"].contains(&name), "{}", m.name);
                assert!((0.0..=1.0).contains(&v), "{}", m.name);
            }
            c.set_world_size(3);
        }
    }
}
