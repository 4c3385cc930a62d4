//! The FFT codec's encoder in the parts a device encoder reuses (`dtrain-device`): the
//! chunks of a bucket with their kept-bin counts and index layouts at the θ in effect
//! ([`Fft::chunk_plans`]), the forward transform as the encoder scales it
//! ([`Fft::spectrum_into`]), and a chunk body written from its kept bins and value codes
//! ([`write_chunk`]). A device encoder computes the energies, the selection and the codes
//! with kernels of its own and hands them to these, so its payload is this codec's by
//! construction wherever its arithmetic is (tested byte for byte there).
//!
//! The device's arithmetic, written out (the host encoder's, in `encode.rs` and
//! `feedback.rs`): for a chunk of `n` elements and its spectrum `S` as [`Fft::spectrum_into`]
//! returns it with the factor `post`,
//! * without adopted feedback the energies are `w_k · (Re S_k² + Im S_k²)` and the values
//!   `post · S_k`;
//! * with it, `S_k ← post · S_k + E_k` (the packed residual, see `feedback.rs`; DC's and
//!   Nyquist's imaginary parts zero), the energies of `s · S_k` with `s` =
//!   [`energy_scale`] of the largest component, and the values `S_k`;
//! * the `K` = [`ChunkPlan::kept`] largest energies are kept, ties to the smaller bin; each
//!   kept bin sends `(Re, Im)` clamped into `±f32::MAX`, DC's and Nyquist's `Im` as 0;
//! * with a value format, one `Emax` = [`emax_of`](crate::rangefloat::emax_of) of the
//!   values and round-to-nearest codes ([`crate::rangefloat::RfEncoder`]);
//! * the residual then loses the decoded sent values on the kept bins.

use std::ops::Range;

use realfft::num_complex::Complex;

use super::encode::write_head;
use super::{bins, chunk_spans, lock, Fft, Select, BITMAP, LIST, PREFIX};
use crate::rangefloat::RfFormat;
use crate::registry::Method;
use crate::wire::Writer;

/// How a chunk writes its kept bins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkLayout {
    /// `K` ascending `u32` bin indices.
    List,
    /// A bitmap of `m` bits.
    Bitmap,
    /// Bins `0..K` (low-pass selection), nothing written.
    Prefix,
}

impl ChunkLayout {
    fn byte(self) -> u8 {
        match self {
            ChunkLayout::List => LIST,
            ChunkLayout::Bitmap => BITMAP,
            ChunkLayout::Prefix => PREFIX,
        }
    }

    fn of_byte(b: u8) -> Self {
        match b {
            LIST => ChunkLayout::List,
            BITMAP => ChunkLayout::Bitmap,
            _ => ChunkLayout::Prefix,
        }
    }
}

/// One chunk of a bucket at the θ in effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkPlan {
    /// Its elements in the bucket.
    pub range: Range<usize>,
    /// rfft bins, `m = n/2 + 1`.
    pub bins: usize,
    /// Bins kept, `K = m − ⌊θm⌋`.
    pub kept: usize,
    /// How the kept bins are written.
    pub layout: ChunkLayout,
}

/// A chunk's kept values as the wire carries them.
#[derive(Debug, Clone, Copy)]
pub enum ChunkValues<'a> {
    /// Range-float codes under one `Emax`, packed LSB-first (`⌈2K·b/8⌉` bytes).
    Codes {
        /// The block's `Emax`.
        emax: i8,
        /// The packed codes.
        codes: &'a [u8],
    },
    /// The `2K` values as `f32` (`quantize = false`).
    Raw(&'a [f32]),
}

/// The power of two that brings the largest magnitude of a compensated spectrum (its bits
/// `amax`, sign cleared) into `[1, 2)` (1 for zero): the factor its energies are taken at.
pub fn energy_scale(amax: u32) -> f32 {
    super::feedback::energy_scale(amax)
}

/// The scales of a chunk's forward transform as the encoder takes it: the power of two `pre`
/// the chunk of `n` elements is multiplied by (bringing its largest magnitude, given as its
/// sign-cleared bits `amax`, into `[1, 2)`; 1 for zeros) and the factor `post` that turns the
/// transform of the scaled chunk into `Y = X/n` — what [`Fft::spectrum_into`] applies, for a
/// transform computed elsewhere.
pub fn forward_scales(amax: u32, n: usize) -> (f32, f32) {
    super::encode::forward_scales(amax, n)
}

impl Fft {
    /// The chunks of a buffer with these (effective) segments, in order, at the θ in effect.
    pub fn chunk_plans(&self, segments: &[Range<usize>]) -> Vec<ChunkPlan> {
        let cfg = self.encoding();
        segments
            .iter()
            .flat_map(|s| {
                chunk_spans(self.chunk, s.len()).map(move |c| s.start + c.start..s.start + c.end)
            })
            .map(|range| {
                let m = bins(range.len());
                let kept = super::kept_bins(m, self.theta);
                ChunkPlan {
                    range,
                    bins: m,
                    kept,
                    layout: ChunkLayout::of_byte(cfg.layout(m, kept)),
                }
            })
            .collect()
    }

    /// The value format (`None`: raw `f32`).
    pub fn value_format(&self) -> Option<RfFormat> {
        self.fmt
    }

    /// Whether bins are kept by energy (else `0..K`, low-pass).
    pub fn selects_by_energy(&self) -> bool {
        self.select == Select::EnergyTopk
    }

    /// Whether the codec keeps classic residual error feedback as spectra when offered
    /// ([`FftConfig::spectral_feedback`](super::FftConfig::spectral_feedback)).
    pub fn keeps_spectral_feedback(&self) -> bool {
        self.spectral_feedback
    }

    /// The forward transform of the chunk `x` as the encoder takes it — `x` scaled by a
    /// power of two that brings its largest magnitude into `[1, 2)` — written into `out`
    /// (`2·bins(n)` floats, real and imaginary parts interleaved); returns the factor
    /// `post` that turns it into `Y = X/n`.
    ///
    /// # Panics
    /// If `out` is not `2·bins(x.len())` long.
    pub fn spectrum_into(&mut self, x: &[f32], out: &mut [f32]) -> f32 {
        let n = x.len();
        assert_eq!(out.len(), 2 * bins(n), "spectrum_into: wrong output length");
        let plan = lock(&self.shared).planner.plan_fft_forward(n);
        let post = self.enc.forward(&*plan, x);
        for (o, c) in out.chunks_exact_mut(2).zip(&self.enc.spec) {
            o[0] = c.re;
            o[1] = c.im;
        }
        post
    }

    /// Reads a payload of an `n`-element buffer with the host decoder's checks and errors,
    /// keeping what a device decoder adds: each chunk's kept bins and values.
    pub fn read_payload(&self, bytes: &[u8], n: usize) -> Result<ReadPayload, crate::WireError> {
        let (mut r, segs) = crate::compressor::read_frame(super::FftConfig::ID, bytes, n)?;
        let mut chunks = Vec::new();
        let mut scratch: Vec<Complex<f32>> = Vec::new();
        for c in self.chunk_ranges(&segs) {
            let m = bins(c.len());
            if scratch.len() < m {
                scratch.resize(m, Complex::default());
            }
            let (mut keep, mut vals) = (Vec::new(), Vec::new());
            self.decode_chunk_into(
                &mut r,
                c.len(),
                &mut scratch[..m],
                false,
                &mut keep,
                &mut vals,
            )?;
            chunks.push((keep, vals));
        }
        if r.remaining() != 0 {
            return Err(crate::WireError::TrailingBytes(r.remaining()));
        }
        Ok(ReadPayload {
            segments: segs,
            chunks,
        })
    }

    /// The inverse transform (unnormalised, as the decoder's) of the interleaved spectrum
    /// `spec` (`2·bins(out.len())` floats; DC's and Nyquist's imaginary parts ignored)
    /// added into `out`; an error where the result is not finite.
    pub fn inverse_add(&self, spec: &[f32], out: &mut [f32]) -> Result<(), crate::WireError> {
        let mut s: Vec<Complex<f32>> = spec
            .chunks_exact(2)
            .map(|c| Complex::new(c[0], c[1]))
            .collect();
        if s.len() != bins(out.len()) {
            return Err(crate::WireError::Invalid(
                "fft spectrum of the wrong length",
            ));
        }
        s[0].im = 0.0;
        if out.len().is_multiple_of(2) {
            let last = s.len() - 1;
            s[last].im = 0.0;
        }
        Self::inverse_into(&mut lock(&self.shared), &mut s, out, super::ADD).map(|_| ())
    }
}

/// One payload's kept bins, read and checked by the host decoder ([`Fft::read_payload`]).
#[derive(Debug, Clone, Default)]
pub struct ReadPayload {
    /// The payload's segments (its layer boundaries).
    pub segments: Vec<Range<usize>>,
    /// Per chunk, in order: its kept bins (ascending) and their decoded values, two per bin
    /// (DC's and Nyquist's imaginary parts checked to be zero).
    pub chunks: Vec<(Vec<u32>, Vec<f32>)>,
}

/// Writes one chunk body (module docs of [`super`]): the plan's layout, the value format,
/// the kept bins `keep` (ascending, `plan.kept` of them) and their values.
///
/// # Panics
/// If `keep` is not `plan.kept` long, or the values do not fit it and `fmt`.
pub fn write_chunk(
    w: &mut Writer<'_>,
    plan: &ChunkPlan,
    fmt: Option<RfFormat>,
    keep: &[u32],
    values: ChunkValues<'_>,
) {
    assert_eq!(keep.len(), plan.kept, "write_chunk: kept bins");
    write_head(w, plan.layout.byte(), fmt, plan.bins, keep);
    match (fmt, values) {
        (Some(f), ChunkValues::Codes { emax, codes }) => {
            assert_eq!(
                codes.len(),
                crate::wire::bytes_for_bits(2 * keep.len() as u64 * f.bits() as u64),
                "write_chunk: code bytes"
            );
            w.u8(emax as u8);
            w.bytes(codes);
        }
        (None, ChunkValues::Raw(v)) => {
            assert_eq!(v.len(), 2 * keep.len(), "write_chunk: values");
            w.f32_slice(v);
        }
        _ => panic!("write_chunk: values of another format than the codec's"),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::compressor::{effective_segments, write_frame_header, Compressor, Ctx, Payload};
    use crate::fft::{bin_weight, FftConfig, IndexCoding, Select};
    use crate::memory::MemoryConfig;
    use crate::pipeline::Pipeline;
    use crate::rangefloat::{emax_of, RfDecoder, RfEncoder, Rounding};
    use crate::rng::Rng;
    use crate::select::{top_k_keys, Scratch};
    use crate::Method;

    /// An encoder built from this module's parts and the arithmetic its docs write out —
    /// what a device encoder does — keeping its own packed residual when `feedback`.
    struct Outside {
        fft: Fft,
        feedback: bool,
        residual: BTreeMap<u64, Vec<f32>>,
    }

    impl Outside {
        fn encode(&mut self, x: &[f32], ctx: &Ctx<'_>, out: &mut Vec<u8>) {
            self.fft.begin(x, ctx);
            let segs = effective_segments(x.len(), ctx.segments).unwrap();
            out.clear();
            let mut w = Writer::new(out);
            write_frame_header(&mut w, FftConfig::ID, x.len(), &segs);
            let fmt = self.fft.value_format();
            let e_all = self
                .residual
                .entry(ctx.bucket)
                .or_insert_with(|| vec![0.0; x.len()]);
            for plan in self.fft.chunk_plans(&segs) {
                let (n, m) = (plan.range.len(), plan.bins);
                let mut s = vec![0f32; 2 * m];
                let mut post = self.fft.spectrum_into(&x[plan.range.clone()], &mut s);
                let e = &mut e_all[plan.range.clone()];
                let pairs = if n % 2 == 0 { n / 2 } else { m };
                // The packed residual's place of bin b's (re, im), None for a zero part.
                let place = |b: usize| -> (usize, Option<usize>) {
                    if b == 0 {
                        (0, None)
                    } else if b < pairs {
                        (2 * b - 1, Some(2 * b))
                    } else {
                        (n - 1, None)
                    }
                };
                let mut scale = 1.0;
                if self.feedback {
                    let mut amax = 0u32;
                    for b in 0..m {
                        let (r, i) = place(b);
                        s[2 * b] = s[2 * b] * post + e[r];
                        e[r] = s[2 * b];
                        s[2 * b + 1] = match i {
                            Some(i) => {
                                let v = s[2 * b + 1] * post + e[i];
                                e[i] = v;
                                v
                            }
                            None => 0.0,
                        };
                        amax = amax.max(s[2 * b].to_bits() & 0x7FFF_FFFF);
                        amax = amax.max(s[2 * b + 1].to_bits() & 0x7FFF_FFFF);
                    }
                    scale = energy_scale(amax);
                    post = 1.0;
                }
                let mut keep = Vec::new();
                if self.fft.selects_by_energy() {
                    let keys: Vec<u32> = (0..m)
                        .map(|b| {
                            let (re, im) = (s[2 * b] * scale, s[2 * b + 1] * scale);
                            (bin_weight(n, b) * (re * re + im * im)).to_bits()
                        })
                        .collect();
                    top_k_keys(&keys, plan.kept, &mut Scratch::default(), &mut keep);
                } else {
                    keep.extend(0..plan.kept as u32);
                }
                let mut vals = Vec::new();
                for &b in &keep {
                    let b = b as usize;
                    let zero_im = b == 0 || (n % 2 == 0 && b == n / 2);
                    vals.push((s[2 * b] * post).clamp(-f32::MAX, f32::MAX));
                    let im = if zero_im { 0.0 } else { s[2 * b + 1] * post };
                    vals.push(im.clamp(-f32::MAX, f32::MAX));
                }
                let mut sent = vals.clone();
                match fmt {
                    Some(f) => {
                        let emax = emax_of(&vals);
                        let mut codes =
                            vec![
                                0u8;
                                crate::wire::bytes_for_bits(vals.len() as u64 * f.bits() as u64)
                            ];
                        RfEncoder::new(f, emax).encode(
                            &vals,
                            Rounding::Nearest,
                            &mut Rng::seed_from_u64(0),
                            &mut codes,
                        );
                        RfDecoder::new(f, emax, vals.len())
                            .decode(&codes, &mut sent)
                            .unwrap();
                        write_chunk(
                            &mut w,
                            &plan,
                            fmt,
                            &keep,
                            ChunkValues::Codes {
                                emax,
                                codes: &codes,
                            },
                        );
                    }
                    None => write_chunk(&mut w, &plan, fmt, &keep, ChunkValues::Raw(&vals)),
                }
                if self.feedback {
                    for (&b, t) in keep.iter().zip(sent.chunks_exact(2)) {
                        let (r, i) = place(b as usize);
                        e[r] -= t[0];
                        if let Some(i) = i {
                            e[i] -= t[1];
                        }
                    }
                }
            }
        }
    }

    /// The parts and the arithmetic the module docs write out give the codec's own bytes
    /// and its own residual, for every layout, value format, chunking and θ schedule, with
    /// and without the spectral residual — the contract a device encoder builds on.
    #[test]
    fn the_parts_encode_what_the_codec_encodes() {
        let segs = vec![0..1, 1..2, 2..1002, 1002..1003, 1003..4003, 4003..4100];
        let n = 4100;
        let mut rng = Rng::seed_from_u64(3);
        let grads: Vec<Vec<f32>> = (0..4)
            .map(|_| (0..n).map(|_| (rng.next_f32() - 0.5) * 1e-3).collect())
            .collect();
        let variants = [
            FftConfig::default(),
            FftConfig {
                theta: 0.5,
                index_coding: IndexCoding::List,
                chunk: Some(300),
                ..FftConfig::default()
            },
            FftConfig {
                quantize: false,
                select: Select::Lowpass,
                ..FftConfig::default()
            },
            FftConfig {
                exp_bits: 8,
                mantissa_bits: 7,
                theta_schedule: Some(crate::schedule::ThetaSchedule::Inv {
                    theta0: 0.95,
                    tau: 2.0,
                }),
                ..FftConfig::default()
            },
        ];
        for cfg in variants {
            for feedback in [false, true] {
                let memory = if feedback {
                    MemoryConfig::RESIDUAL
                } else {
                    MemoryConfig::None
                };
                let mut pipe =
                    Pipeline::new(Box::new(cfg.init().unwrap()), memory.build().unwrap());
                let mut outside = Outside {
                    fft: cfg.init().unwrap(),
                    feedback,
                    residual: BTreeMap::new(),
                };
                for (step, g) in grads.iter().enumerate() {
                    let ctx = Ctx {
                        step: step as u64,
                        rank: 0,
                        bucket: 7,
                        segments: &segs,
                    };
                    let mut want = Payload::new();
                    pipe.compress(g, &ctx, &mut Rng::seed_from_u64(0), &mut want)
                        .unwrap();
                    let mut got = Vec::new();
                    outside.encode(g, &ctx, &mut got);
                    assert!(
                        got == want.as_bytes(),
                        "{cfg:?}, feedback {feedback}, step {step}"
                    );
                }
                if feedback {
                    assert_eq!(pipe.export_memory(), outside.residual, "{cfg:?}");
                }
            }
        }
    }

    /// The inverse transform of `post · S`, `S` from [`Fft::spectrum_into`], is the chunk.
    #[test]
    fn the_inverse_of_the_spectrum_is_the_chunk() {
        let mut fft = FftConfig::default().init().unwrap();
        for n in [1usize, 2, 7, 64, 1001] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.25)
                .collect();
            let mut s = vec![0f32; 2 * bins(n)];
            let post = fft.spectrum_into(&x, &mut s);
            let y: Vec<f32> = s.iter().map(|v| v * post).collect();
            let mut back = vec![0f32; n];
            fft.inverse_add(&y, &mut back).unwrap();
            for (a, b) in back.iter().zip(&x) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "n = {n}: {a} vs {b}"
                );
            }
        }
    }
}
