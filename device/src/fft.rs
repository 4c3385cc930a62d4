//! `fft` on the device: the FFT method's selection, range-float quantization and spectral
//! residual as kernels, with the host codec's exact wire format (`dtrain_compress::fft`).
//!
//! Per chunk (the host's [`ChunkPlan`]s at the θ in effect, θ's schedule and scale kept by
//! a host `Fft` this codec holds): the spectrum — compensated by the spectral residual when
//! the codec keeps one ([`DeviceCodec::adopt_error_feedback`]) — gives its bins' energies
//! (one kernel over every chunk), the `K` largest are selected by the radix select and the
//! ordered compaction of `select` (ties to the smaller bin), the kept bins' values are
//! gathered with their largest magnitude (one atomic maximum: the block's `Emax`), coded
//! round-to-nearest (`rangefloat`), and the residual loses the decoded sent values. The
//! host writes each chunk's head and index part from the kept bins (`O(K)`, with the host's
//! own writer) and the codes after it. The arithmetic is the host encoder's, operation for
//! operation, as `dtrain_compress::fft::parts` writes it out.
//!
//! **The transform** (`transform` in the method's config): by default on the device
//! ([`Rfft`]: cuFFT on a CUDA device where the library loads, else dtrain's own cubecl
//! kernels, the same on CUDA and wgpu — which one is said once on stderr; spectra within
//! rounding of the host's, so where two bins' energies nearly tie the device may keep
//! another bin than the host would); with `transform = "host"` the bucket is read back, each chunk transformed by
//! the host codec's own planner and scaling ([`Fft::spectrum_into`]) and the spectra
//! uploaded — then the payloads are the host's byte for byte on every device (what the
//! byte-for-byte tests and `--verify` use). `DeviceCodec::host_parts` says what runs where.
//!
//! **Decoding**: the receivers' mean ([`DeviceCodec::decode_mean`]) is the host's joint
//! decode on the device — each payload read and checked by the host decoder (`O(K)`), its
//! kept values added into one summed spectrum on the device in rank order, one inverse
//! transform per chunk ([`Rfft::inverse`]) — within rounding of the host's mean. A single
//! payload's `decode_add` runs the host decoder on a copy of the buffer.
//!
//! Where a compiler fuses `post·S + E` into one multiply-add (CUDA's NVRTC may), the
//! compensated spectrum can differ from the host's in the last bit; lavapipe rounds each
//! operation (tested).

use std::collections::BTreeMap;
use std::sync::Mutex;
use cubecl::prelude::*;
use dtrain_compress::fft::parts::{
    energy_scale, write_chunk, ChunkPlan, ChunkValues, ReadPayload,
};
use dtrain_compress::fft::{Fft, FftConfig, TransformAt};
use dtrain_compress::rangefloat::{emax_of_abs_bits, RfDecoder, RfEncoder, Rounding};
use dtrain_compress::wire::{bytes_for_bits, Writer};
use dtrain_compress::{
    read_frame, Compressor, CompressError, ConfigError, Ctx, Method, MethodId, Payload, Rng,
    WireError,
};

use crate::codec::{begin_payload, host_decode_add, u32_bytes, upload_tables, DeviceCodec};
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::rangefloat;
use crate::select::{select, word, Rule};
use crate::transform::Rfft;
use crate::words::{geometry, grid_stride, segment_of};

/// The place of bin `b`'s real part in a chunk's packed residual (module docs of
/// `dtrain_compress::fft::feedback`): `Re E_0` first, then `(Re, Im)` of bins `1..pairs`,
/// then `Re` of Nyquist last.
#[cube]
fn re_place(b: u32, n: u32, pairs: u32) -> u32 {
    let mut at = n - 1;
    if b == 0 {
        at = 0;
    } else if b < pairs {
        at = 2 * b - 1;
    }
    at
}

/// The bins of the chunk `c` that has an imaginary part in the packed residual: `1..pairs`,
/// `pairs` = `n/2` for even `n`, else `m`.
#[cube]
fn pairs_of(n: u32, m: u32) -> u32 {
    let mut p = m;
    if (n & 1) == 0 {
        p = n / 2;
    }
    p
}

/// `S ← post·S + E` over every bin of every chunk, `E ←` the result packed, and each chunk's
/// largest magnitude into `amax`. Per chunk `c`: its first bin `bin_starts[c]`, its first
/// element `elem_starts[c]`, its length `lens[c]`, its `post` (bits) `posts[c]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn compensate(
    spec: &mut [f32],
    e: &mut [f32],
    bin_starts: &[u32],
    elem_starts: &[u32],
    lens: &[u32],
    posts: &[u32],
    amax: &[Atomic<u32>],
) {
    let total = bin_starts[bin_starts.len() - 1];
    let mut g = ABSOLUTE_POS as u32;
    while g < total {
        let c = segment_of(bin_starts, g) as usize;
        let b = g - bin_starts[c];
        let n = lens[c];
        let m = bin_starts[c + 1] - bin_starts[c];
        let pairs = pairs_of(n, m);
        let post = f32::reinterpret(posts[c]);
        let es = elem_starts[c];
        let r = (es + re_place(b, n, pairs)) as usize;
        let re = spec[2 * g as usize] * post + e[r];
        spec[2 * g as usize] = re;
        e[r] = re;
        let mut top = u32::reinterpret(re) & 0x7FFF_FFFF;
        let mut im = 0.0f32;
        if b > 0 && b < pairs {
            let i = r + 1;
            im = spec[2 * g as usize + 1] * post + e[i];
            e[i] = im;
            top = max(top, u32::reinterpret(im) & 0x7FFF_FFFF);
        }
        spec[2 * g as usize + 1] = im;
        amax[c].fetch_max(top);
        g += grid_stride() as u32;
    }
}

/// The energy `w_b·((s·Re)² + (s·Im)²)` of every bin of every chunk (`w_b` = 1 for DC and
/// an even length's Nyquist, else 2; `s` the chunk's scale, bits, in `scales`).
#[cube(launch)]
fn energies(spec: &[f32], bin_starts: &[u32], lens: &[u32], scales: &[u32], out: &mut [f32]) {
    let total = bin_starts[bin_starts.len() - 1];
    let mut g = ABSOLUTE_POS as u32;
    while g < total {
        let c = segment_of(bin_starts, g) as usize;
        let b = g - bin_starts[c];
        let n = lens[c];
        let s = f32::reinterpret(scales[c]);
        let re = spec[2 * g as usize] * s;
        let im = spec[2 * g as usize + 1] * s;
        let mut w = 2.0f32;
        if b == 0 || ((n & 1) == 0 && b == n / 2) {
            w = 1.0f32;
        }
        let sq = re * re + im * im;
        out[g as usize] = w * sq;
        g += grid_stride() as u32;
    }
}

/// The kept bins' values `post·(Re, Im)` of one chunk (bins from `first_bin`, length `n`),
/// DC's and Nyquist's imaginary parts as 0, clamped into `±f32::MAX`, into `vals` (two per
/// kept bin), and their largest magnitude into `amax[slot]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gather(
    spec: &[f32],
    first_bin: u32,
    n: u32,
    post: f32,
    keep: &[u32],
    vals: &mut [f32],
    amax: &[Atomic<u32>],
    slot: u32,
) {
    let mut j = ABSOLUTE_POS;
    while j < keep.len() {
        let b = keep[j];
        let at = 2 * (first_bin + b) as usize;
        let big = f32::reinterpret(0x7F7F_FFFFu32);
        let re = f32::max(f32::min(spec[at] * post, big), -big);
        let mut im = 0.0f32;
        if !(b == 0 || ((n & 1) == 0 && b == n / 2)) {
            im = f32::max(f32::min(spec[at + 1] * post, big), -big);
        }
        vals[2 * j] = re;
        vals[2 * j + 1] = im;
        amax[slot as usize].fetch_max(max(u32::reinterpret(re) & 0x7FFF_FFFF, u32::reinterpret(im) & 0x7FFF_FFFF));
        j += grid_stride();
    }
}

/// The sent values `sent` (two per kept bin) taken off the kept bins of one chunk's packed
/// residual (elements from `first`, length `n`, `m` bins).
#[cube(launch)]
fn take_off(e: &mut [f32], first: u32, n: u32, m: u32, keep: &[u32], sent: &[f32]) {
    let pairs = pairs_of(n, m);
    let mut j = ABSOLUTE_POS;
    while j < keep.len() {
        let b = keep[j];
        let r = (first + re_place(b, n, pairs)) as usize;
        e[r] -= sent[2 * j];
        if b > 0 && b < pairs {
            e[r + 1] -= sent[2 * j + 1];
        }
        j += grid_stride();
    }
}

/// The `fft` device codec.
pub struct FftCodec {
    /// The host codec: θ (its schedule and scale), the chunk plans, the transform, the
    /// decoder.
    host: Fft,
    /// The spectral residual of each bucket (packed, `n` reals for `n` elements), when the
    /// codec keeps the error feedback.
    residual: Option<BTreeMap<u64, GpuBuffer>>,
    /// The device's transforms (`transform = "device"`), or `None`: the host's.
    rfft: Option<Rfft>,
    /// The inverse transforms of the joint decode ([`DeviceCodec::decode_mean`]).
    decoder: Mutex<Rfft>,
}

impl std::fmt::Debug for FftCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FftCodec")
            .field("host", &self.host)
            .field("keeps_residual", &self.residual.is_some())
            .field("device_transform", &self.rfft.is_some())
            .finish()
    }
}

/// One chunk's work in flight: its plan, its kept bins and its codes (or raw values).
struct Pending {
    plan: ChunkPlan,
    keep: Vec<u32>,
    values: Values,
}

enum Values {
    /// Codes on the device under `emax`.
    Device { emax: i8, codes: rangefloat::Codes },
    /// Codes made on the host (a window below the normal range).
    Host { emax: i8, codes: Vec<u8> },
    /// Raw `f32` values on the device.
    Raw(GpuBuffer),
}

impl FftCodec {
    /// The codec of a checked config.
    pub fn for_config(cfg: &FftConfig) -> Result<Self, ConfigError> {
        Ok(FftCodec {
            host: cfg.init()?,
            residual: None,
            rfft: (cfg.transform == TransformAt::Device).then(Rfft::new),
            decoder: Mutex::new(Rfft::new()),
        })
    }

    /// Every chunk's spectrum, on the device (`2·Σm` floats), and its `post` factors: the
    /// bucket read back and transformed by the host codec.
    fn spectra(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        plans: &[ChunkPlan],
        out: &mut Payload,
    ) -> Result<(GpuBuffer, Vec<f32>), DeviceError> {
        let x = gpu.download(grad)?;
        if let Some(index) = x.iter().position(|v| !v.is_finite()) {
            out.buffer_mut().clear();
            return Err(CompressError::NonFinite {
                index,
                value: x[index],
            }
            .into());
        }
        let bins: usize = plans.iter().map(|p| p.bins).sum();
        let mut spec = vec![0f32; 2 * bins];
        let mut posts = Vec::with_capacity(plans.len());
        let mut at = 0;
        for p in plans {
            let s = &mut spec[2 * at..2 * (at + p.bins)];
            posts.push(self.host.spectrum_into(&x[p.range.clone()], s));
            at += p.bins;
        }
        Ok((gpu.upload(&spec), posts))
    }
}

/// The tables of chunk starts: each chunk's first bin (and the total, `C + 1` words), first
/// element, length.
fn chunk_tables(plans: &[ChunkPlan]) -> [Vec<u32>; 3] {
    let mut bin_starts = vec![0u32];
    for p in plans {
        bin_starts.push(bin_starts.last().copied().unwrap_or(0) + p.bins as u32);
    }
    [
        bin_starts,
        plans.iter().map(|p| p.range.start as u32).collect(),
        plans.iter().map(|p| p.range.len() as u32).collect(),
    ]
}

impl DeviceCodec for FftCodec {
    fn method(&self) -> MethodId {
        FftConfig::ID
    }

    fn ratio_metric(&self) -> Option<(&'static str, f64)> {
        Some(("theta", self.host.theta()))
    }

    fn host_parts(&self) -> Option<&'static str> {
        Some(match self.rfft {
            Some(_) => {
                "a single payload's decode_add (the transforms — by cuFFT on CUDA where it \
                 loads, as stderr says, else by dtrain's kernels — selection, quantization, \
                 packing, the spectral residual and the receivers' joint decode run on the \
                 device)"
            }
            None => {
                "the forward transform (transform = \"host\") and a single payload's \
                 decode_add (selection, quantization, packing, the spectral residual and the \
                 receivers' joint decode run on the device)"
            }
        })
    }

    fn adopt_error_feedback(&mut self) -> bool {
        if self.host.keeps_spectral_feedback() {
            self.residual.get_or_insert_with(BTreeMap::new);
        }
        self.residual.is_some()
    }

    fn export_feedback(&self, gpu: &Gpu) -> Result<BTreeMap<u64, Vec<f32>>, DeviceError> {
        let mut out = BTreeMap::new();
        for (&k, e) in self.residual.iter().flatten() {
            out.insert(k, gpu.download(e)?);
        }
        Ok(out)
    }

    fn import_feedback(&mut self, gpu: &Gpu, state: &BTreeMap<u64, Vec<f32>>) {
        if let Some(r) = &mut self.residual {
            *r = state.iter().map(|(&k, e)| (k, gpu.upload(e))).collect();
        }
    }

    fn import_state(&mut self, state: &BTreeMap<String, f64>) -> Result<(), DeviceError> {
        self.host
            .import_state(state)
            .map_err(|e| DeviceError::Config(ConfigError::new("state", e)))
    }

    fn encode(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        _rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        self.host.begin(&[], ctx);
        let segs = begin_payload(FftConfig::ID, grad.len(), ctx.segments, out)?;
        if segs.is_empty() {
            return Ok(());
        }
        let plans = self.host.chunk_plans(&segs);
        let (spec, mut posts) = match &mut self.rfft {
            Some(rfft) => {
                let ranges: Vec<_> = plans.iter().map(|p| p.range.clone()).collect();
                rfft.forward(gpu, grad, &ranges, out)?
            }
            None => self.spectra(gpu, grad, &plans, out)?,
        };
        let [bin_starts, elem_starts, lens] = chunk_tables(&plans);
        let total = *bin_starts.last().expect("one entry") as usize;
        let chunks = plans.len();
        let [(t_bins, nb), (t_elems, ne), (t_lens, nl)] =
            upload_tables(gpu, [bin_starts.clone(), elem_starts, lens]);
        let (count, dim) = geometry(total);
        let residual = match &mut self.residual {
            Some(r) => {
                if !matches!(r.get(&ctx.bucket), Some(e) if e.len() == grad.len()) {
                    r.insert(ctx.bucket, gpu.zeros(grad.len()));
                }
                r.get(&ctx.bucket).cloned()
            }
            None => None,
        };
        let mut scales = vec![1f32; chunks];
        if let Some(e) = &residual {
            let amax = gpu.words(chunks, 0);
            let post_bits: Vec<u32> = posts.iter().map(|p| p.to_bits()).collect();
            let [(t_posts, np)] = upload_tables(gpu, [post_bits]);
            // SAFETY: the tables hold C + 1 (bins) or C words, `amax` C, the spectrum
            // 2·total floats, the residual the bucket's elements.
            unsafe {
                compensate::launch(
                    gpu.client(),
                    count.clone(),
                    dim,
                    spec.arg(),
                    e.arg(),
                    BufferArg::from_raw_parts(t_bins.clone(), nb),
                    BufferArg::from_raw_parts(t_elems, ne),
                    BufferArg::from_raw_parts(t_lens.clone(), nl),
                    BufferArg::from_raw_parts(t_posts, np),
                    BufferArg::from_raw_parts(amax.clone(), chunks),
                );
            }
            let read = gpu.read_words(vec![amax], "reading the spectra's maxima")?;
            for (c, s) in scales.iter_mut().enumerate() {
                *s = energy_scale(word(&read[0], c));
            }
            posts.fill(1.0);
        }
        let energy = if self.host.selects_by_energy() {
            // Every bin's energy is written.
            let buf = gpu.empty(total);
            let scale_bits: Vec<u32> = scales.iter().map(|s| s.to_bits()).collect();
            let [(t_scales, ns)] = upload_tables(gpu, [scale_bits]);
            // SAFETY: as above; `buf` holds `total` floats.
            unsafe {
                energies::launch(
                    gpu.client(),
                    count,
                    dim,
                    spec.arg(),
                    BufferArg::from_raw_parts(t_bins, nb),
                    BufferArg::from_raw_parts(t_lens, nl),
                    BufferArg::from_raw_parts(t_scales, ns),
                    buf.arg(),
                );
            }
            Some(buf)
        } else {
            None
        };
        let fmt = self.host.value_format();
        // Every chunk's kept bins: one selection over all chunks' energies.
        let mut kept = match &energy {
            Some(en) => {
                let jobs: Vec<_> = plans
                    .iter()
                    .zip(&bin_starts)
                    .map(|(p, &at)| {
                        let at = at as usize;
                        (at..at + p.bins, Rule::TopK(p.kept))
                    })
                    .collect();
                select(gpu, en, &jobs, out)?
                    .into_iter()
                    .map(|k| k.idx)
                    .collect()
            }
            None => plans.iter().map(|p| (0..p.kept as u32).collect()).collect::<Vec<Vec<u32>>>(),
        };
        // Every chunk's kept values gathered, their maxima read back at once.
        let amax = gpu.words(chunks, 0);
        let mut gathered = Vec::with_capacity(chunks);
        for (c, plan) in plans.iter().enumerate() {
            let keep = std::mem::take(&mut kept[c]);
            let k = keep.len();
            // Written whole by the gather.
            let vals = gpu.empty(2 * k);
            let keep_dev = gpu.client().create_from_slice(u32_bytes(&keep));
            if k > 0 {
                let (count, dim) = geometry(k);
                // SAFETY: `keep` holds k bins of the chunk, `vals` 2k floats, `amax` a word a
                // chunk.
                unsafe {
                    gather::launch(
                        gpu.client(),
                        count,
                        dim,
                        spec.arg(),
                        bin_starts[c],
                        plan.range.len() as u32,
                        posts[c],
                        BufferArg::from_raw_parts(keep_dev.clone(), k),
                        vals.arg(),
                        BufferArg::from_raw_parts(amax.clone(), chunks),
                        c as u32,
                    );
                }
            }
            gathered.push((keep, keep_dev, vals));
        }
        let maxima = match fmt {
            Some(_) => gpu.read_words(vec![amax], "reading the chunks' maxima")?.remove(0),
            None => Vec::new(),
        };
        let mut pending = Vec::with_capacity(chunks);
        for ((c, plan), (keep, keep_dev, vals)) in plans.into_iter().enumerate().zip(gathered) {
            let k = keep.len();
            let (values, sent) = match fmt {
                None => (Values::Raw(vals.clone()), vals),
                Some(f) => {
                    let emax = emax_of_abs_bits(word(&maxima, c));
                    let enc = RfEncoder::new(f, emax);
                    match enc.nearest_normal() {
                        Some(rule) => {
                            let codes = rangefloat::encode(gpu, &vals, f, &rule);
                            let sent = if residual.is_some() {
                                let s = gpu.empty(2 * k);
                                rangefloat::decode(gpu, &codes, f, f.emin(emax), &s);
                                s
                            } else {
                                vals
                            };
                            (Values::Device { emax, codes }, sent)
                        }
                        None => {
                            // A window below f32's normal range: the host's exact path.
                            let v = gpu.download(&vals)?;
                            let mut codes = vec![0u8; bytes_for_bits(v.len() as u64 * f.bits() as u64)];
                            enc.encode(&v, Rounding::Nearest, &mut Rng::seed_from_u64(0), &mut codes);
                            let mut sent = vec![0f32; v.len()];
                            RfDecoder::new(f, emax, v.len()).decode(&codes, &mut sent)?;
                            (Values::Host { emax, codes }, gpu.upload(&sent))
                        }
                    }
                }
            };
            if let (Some(e), true) = (&residual, k > 0) {
                let (count, dim) = geometry(k);
                // SAFETY: `keep` holds k bins of the chunk, `sent` 2k floats.
                unsafe {
                    take_off::launch(
                        gpu.client(),
                        count,
                        dim,
                        e.arg(),
                        plan.range.start as u32,
                        plan.range.len() as u32,
                        plan.bins as u32,
                        BufferArg::from_raw_parts(keep_dev, k),
                        sent.arg(),
                    );
                }
            }
            pending.push(Pending { plan, keep, values });
        }
        write_chunks(gpu, fmt, pending, out)
    }

    fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError> {
        host_decode_add(gpu, &self.host as &dyn Compressor, payload, out)
    }

    /// The host's joint decode on the device: each payload read and checked by the host
    /// decoder (`O(K)`: its kept bins and values), the values added into one summed
    /// spectrum on the device in rank order, then one inverse transform per chunk, times
    /// `inv`. Within rounding of the host's mean (another transform), not bit for bit.
    fn decode_mean(
        &self,
        gpu: &Gpu,
        payloads: &[&[u8]],
        inv: f32,
        out: &GpuBuffer,
    ) -> Option<Result<(), (usize, DeviceError)>> {
        Some(self.joint_mean(gpu, payloads, inv, out))
    }
}

impl FftCodec {
    /// [`DeviceCodec::decode_mean`].
    fn joint_mean(
        &self,
        gpu: &Gpu,
        payloads: &[&[u8]],
        inv: f32,
        out: &GpuBuffer,
    ) -> Result<(), (usize, DeviceError)> {
        let mut reads: Vec<ReadPayload> = Vec::with_capacity(payloads.len());
        for (i, p) in payloads.iter().enumerate() {
            if let Some(first) = reads.first() {
                // The host's order: the frame, then the segments against the first
                // payload's, and only then the chunks (read under those segments).
                let (_, segs) =
                    read_frame(FftConfig::ID, p, out.len()).map_err(|e| (i, e.into()))?;
                if first.segments != segs {
                    let e = WireError::BadSegments("payloads of one sum disagree on segments");
                    return Err((i, e.into()));
                }
            }
            let read = self.host.read_payload(p, out.len()).map_err(|e| (i, e.into()))?;
            reads.push(read);
        }
        let Some(first) = reads.first() else {
            gpu.fill_zero(out);
            return Ok(());
        };
        let ranges: Vec<_> = self
            .host
            .chunk_plans(&first.segments)
            .into_iter()
            .map(|p| p.range)
            .collect();
        let mut bin_starts = Vec::with_capacity(ranges.len());
        let mut total = 0u32;
        for r in &ranges {
            bin_starts.push(total);
            total += (r.len() / 2 + 1) as u32;
        }
        let spec = gpu.zeros(2 * total as usize);
        for read in &reads {
            let mut bins = Vec::new();
            let mut vals = Vec::new();
            for ((keep, v), &at) in read.chunks.iter().zip(&bin_starts) {
                bins.extend(keep.iter().map(|&b| at + b));
                vals.extend_from_slice(v);
            }
            if bins.is_empty() {
                continue;
            }
            let k = bins.len();
            let [(t_bins, nb)] = upload_tables(gpu, [bins]);
            let (count, dim) = geometry(k);
            // SAFETY: `bins` holds k distinct bins of the spectra, `vals` 2k floats.
            unsafe {
                add_bins::launch(
                    gpu.client(),
                    count,
                    dim,
                    spec.arg(),
                    BufferArg::from_raw_parts(t_bins, nb),
                    gpu.upload(&vals).arg(),
                );
            }
        }
        let mut rfft = self.decoder.lock().unwrap_or_else(|e| e.into_inner());
        // A device error, no payload's: callers name a rank for wire errors only.
        rfft.inverse(gpu, &spec, &ranges, inv, out)
            .map_err(|e| (0, e))
    }
}

/// `spec[b] += (v[2j], v[2j+1])` for the kept bins `b = bins[j]` of one payload (distinct).
#[cube(launch)]
fn add_bins(spec: &mut [f32], bins: &[u32], vals: &[f32]) {
    let mut j = ABSOLUTE_POS;
    while j < bins.len() {
        let b = bins[j] as usize;
        spec[2 * b] += vals[2 * j];
        spec[2 * b + 1] += vals[2 * j + 1];
        j += grid_stride();
    }
}

/// Reads every chunk's codes back (one read) and writes the chunk bodies after the framing.
fn write_chunks(
    gpu: &Gpu,
    fmt: Option<dtrain_compress::rangefloat::RfFormat>,
    pending: Vec<Pending>,
    out: &mut Payload,
) -> Result<(), DeviceError> {
    let handles: Vec<_> = pending
        .iter()
        .filter_map(|p| match &p.values {
            Values::Device { codes, .. } => Some(codes.words.clone()),
            Values::Raw(v) => Some(v.handle.clone()),
            Values::Host { .. } => None,
        })
        .collect();
    let mut read = gpu.read_words(handles, "reading a payload")?.into_iter();
    let mut w = Writer::new(out.buffer_mut());
    for p in &pending {
        match &p.values {
            Values::Device { emax, codes } => {
                let bytes = read.next().expect("one read a chunk");
                let codes = &bytes[..codes.bytes];
                write_chunk(&mut w, &p.plan, fmt, &p.keep, ChunkValues::Codes { emax: *emax, codes });
            }
            Values::Host { emax, codes } => {
                write_chunk(&mut w, &p.plan, fmt, &p.keep, ChunkValues::Codes { emax: *emax, codes });
            }
            Values::Raw(v) => {
                let bytes = read.next().expect("one read a chunk");
                let vals: Vec<f32> = (0..v.len()).map(|j| f32::from_bits(word(&bytes, j))).collect();
                write_chunk(&mut w, &p.plan, fmt, &p.keep, ChunkValues::Raw(&vals));
            }
        }
    }
    Ok(())
}
