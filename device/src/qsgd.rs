//! `qsgd` on the device, in its counter mode (`draws = "counter"`, max-norm buckets, fixed
//! codes): the host codec `dtrain_compress::qsgd` with
//! [`counter_bits`](dtrain_compress::rng::counter_bits) computed on the device, so the payload
//! is the host's byte for byte.
//!
//! Encoding: one pass finds each bucket's norm `N = max|x|` (an atomic maximum of the
//! magnitudes' bits: exact, order-free) and any non-finite input; the norms come back to the
//! host, which draws each segment's key from the encoder's Rng as the host codec does and
//! works out each bucket's arithmetic — the factor, `N'` and `s/N'` of
//! [`counter_bucket_scale`] — so that no division runs on the device (a GPU's `f32` division
//! need not round as the host's does); a second pass writes the body, four bytes to a unit,
//! each byte finding its segment by a binary search and taking the bits of the norms or of
//! the codes that cross it. Each code is the host's `f32` rule, operation for operation. A
//! compiler that contracts `|x|·(s/N') + 2²³` into a fused multiply-add (CUDA's NVRTC may)
//! would round differently; `gpu-check`'s `--verify` is where that shows.
//!
//! Decoding runs the host decoder (its checks and its errors, in its order) on a copy of the
//! output and writes it back: exact, and `O(n)` on the host with two transfers — the
//! receivers' side stays on the host in training for now (`[compress] device` encodes on
//! the device and decodes on the host), and a device decoder of its own is future work.
//!
//! Not here: the default `lanes` draws (one sequential Rng stream), the `l2` norm (an `f64`
//! sum in the host's order), the Elias coding (a data-dependent bit stream); those
//! configurations have no device codec ([`Qsgd::for_config`]).

use std::ops::Range;

use cubecl::prelude::*;
use cubecl::server::Handle;
use dtrain_compress::qsgd::{code_width, counter_bucket_scale, QsgdCoding, QsgdConfig, QsgdNorm};
use dtrain_compress::rng::Draws;
use dtrain_compress::{Compressor, Ctx, Method, MethodId, Payload, Rng};

use crate::codec::{
    begin_payload, body_starts, element_starts, host_decode_add, refuse_non_finite, upload_tables, DeviceCodec,
};
use crate::counter::counter_bits;
use crate::error::DeviceError;
use crate::gpu::{Gpu, GpuBuffer};
use crate::words::{geometry, grid_stride, segment_of, words_for};

/// The `qsgd` device codec (counter draws, max norm, fixed codes).
#[derive(Debug, Clone)]
pub struct Qsgd {
    cfg: QsgdConfig,
    /// The host codec, whose decoder validates and decodes received payloads.
    host: dtrain_compress::qsgd::Qsgd,
}

impl Qsgd {
    /// The device codec of `cfg`, where it has one: counter draws, the max norm and the
    /// fixed coding (a config the host refuses has none either).
    pub fn for_config(cfg: &QsgdConfig) -> Option<Qsgd> {
        let fits = cfg.draws == Draws::Counter
            && cfg.norm == QsgdNorm::Max
            && cfg.coding == QsgdCoding::Fixed;
        Some(Qsgd {
            cfg: cfg.clone(),
            host: cfg.init().ok().filter(|_| fits)?,
        })
    }

    /// Body bytes of a segment of `n` elements: its bucket norms, then its codes.
    fn segment_len(&self, n: usize) -> usize {
        let w = code_width(self.cfg.levels) as usize;
        4 * n.div_ceil(self.cfg.bucket) + (w * n).div_ceil(8)
    }
}

/// `max |x|` of each bucket, as bits, into `max_bits`; non-finite input lowers
/// `first_bad`. `buckets[s]` is segment `s`'s first bucket.
#[cube(launch)]
fn bucket_max(
    x: &[f32],
    starts: &[u32],
    buckets: &[u32],
    d: u32,
    max_bits: &[Atomic<u32>],
    first_bad: &[Atomic<u32>],
) {
    let mut i = ABSOLUTE_POS;
    while i < x.len() {
        let key = u32::reinterpret(x[i]) & 0x7FFF_FFFF;
        if key >= 0x7F80_0000 {
            first_bad[0].fetch_min(i as u32);
        }
        let seg = segment_of(starts, i as u32) as usize;
        let b = buckets[seg] + (i as u32 - starts[seg]) / d;
        max_bits[b as usize].fetch_max(key);
        i += grid_stride();
    }
}

/// The host's `fast_code` of one element: `v` already times the bucket's factor, `n2` and
/// `scale` the bucket's `N'` and `s/N'`, `bits` the counter draw, `s` the levels.
#[cube]
fn code(v: f32, n2: f32, scale: f32, bits: u32, s: u32) -> u32 {
    let sf = f32::cast_from(s);
    let a = f32::reinterpret(u32::reinterpret(v) & 0x7FFF_FFFF);
    let mut r = sf;
    if a < n2 {
        r = a * scale;
    }
    // ⌊r⌋ and the fraction τ: the values the host's 2²³ trick computes (0 ≤ r < 2²³, so
    // the conversion truncates exactly and r − ⌊r⌋ is exact). The trick itself is not
    // written here: a shader compiler may fold (r + 2²³) − 2²³ into r (lavapipe did).
    let l = u32::cast_from(r);
    let tau = r - f32::cast_from(l);
    let u = f32::cast_from(bits >> 8) * 5.960_464_5e-8;
    let mut level = l;
    if u < tau {
        level += 1;
    }
    level = min(level, s);
    let mut sign = 0u32;
    if level != 0 {
        sign = u32::reinterpret(v) >> 31;
    }
    (level << 1) | sign
}

/// Writes the bodies, four body bytes to a word of `out`: per segment its bucket norms
/// (`params[4b]`, the payload's bits) and its `w`-bit codes packed LSB-first. `params` holds
/// per bucket the norm, the factor, `N'` and `s/N'` (bits); `keys` per segment two words.
#[cube(launch)]
fn encode(
    x: &[f32],
    starts: &[u32],
    body_starts: &[u32],
    buckets: &[u32],
    params: &[u32],
    keys: &[u32],
    out: &mut [u32],
    d: u32,
    w: u32,
    s: u32,
) {
    let len = body_starts[body_starts.len() - 1];
    let mut word_at = ABSOLUTE_POS;
    while word_at < out.len() {
        let mut word = 0u32;
        for q in 0..4u32 {
            let b = 4 * word_at as u32 + q;
            if b < len {
                let seg = segment_of(body_starts, b) as usize;
                let off = b - body_starts[seg];
                let first = buckets[seg];
                let nb = buckets[seg + 1] - first;
                let mut byte = 0u32;
                if off < 4 * nb {
                    byte = (params[(4 * (first + off / 4)) as usize] >> (8 * (off % 4))) & 0xFF;
                } else {
                    let n = starts[seg + 1] - starts[seg];
                    let o = 8 * (off - 4 * nb);
                    // The codes crossing bits o..o+8 of the segment's code stream.
                    let mut j = o / w;
                    while j < n && w * j < o + 8 {
                        let bk = (first + j / d) as usize;
                        let nrm = params[4 * bk];
                        let mut c = 0u32;
                        if nrm != 0 {
                            let v = x[(starts[seg] + j) as usize]
                                * f32::reinterpret(params[4 * bk + 1]);
                            let bits = counter_bits(keys[2 * seg], keys[2 * seg + 1], j);
                            c = code(
                                v,
                                f32::reinterpret(params[4 * bk + 2]),
                                f32::reinterpret(params[4 * bk + 3]),
                                bits,
                                s,
                            );
                        }
                        let at = w * j;
                        if at >= o {
                            byte |= c << (at - o);
                        } else {
                            byte |= c >> (o - at);
                        }
                        j += 1;
                    }
                    byte &= 0xFF;
                }
                word |= byte << (8 * q);
            }
        }
        out[word_at] = word;
        word_at += grid_stride();
    }
}

/// Reads one word of a read-back buffer.
fn word(bytes: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("a word"))
}

impl Qsgd {
    /// The segment tables on the device: first elements, first body bytes, first buckets.
    fn tables(&self, gpu: &Gpu, segs: &[Range<usize>]) -> ([(Handle, usize); 3], Vec<u32>) {
        let mut buckets = vec![0u32];
        for s in segs {
            let last = *buckets.last().expect("one entry");
            buckets.push(last + s.len().div_ceil(self.cfg.bucket) as u32);
        }
        let tables = upload_tables(
            gpu,
            [
                element_starts(segs),
                body_starts(segs, |n| self.segment_len(n)),
                buckets.clone(),
            ],
        );
        (tables, buckets)
    }
}

impl DeviceCodec for Qsgd {
    fn method(&self) -> MethodId {
        QsgdConfig::ID
    }

    fn encode(
        &mut self,
        gpu: &Gpu,
        grad: &GpuBuffer,
        ctx: &Ctx<'_>,
        rng: &mut Rng,
        out: &mut Payload,
    ) -> Result<(), DeviceError> {
        let segs = begin_payload(QsgdConfig::ID, grad.len(), ctx.segments, out)?;
        if segs.is_empty() {
            return Ok(());
        }
        let client = gpu.client();
        let d = self.cfg.bucket as u32;
        let ([(starts, ns), (body_starts, nbs), (buckets, nbk)], table) = self.tables(gpu, &segs);
        let nb = *table.last().expect("one entry") as usize;
        let max_bits = gpu.words(nb, 0);
        let first_bad = gpu.words(1, u32::MAX);
        let (count, dim) = geometry(grad.len());
        // SAFETY: the tables hold S + 1 words, `max_bits` one a bucket, `first_bad` one.
        unsafe {
            bucket_max::launch(
                client,
                count,
                dim,
                grad.arg(),
                BufferArg::from_raw_parts(starts.clone(), ns),
                BufferArg::from_raw_parts(buckets.clone(), nbk),
                d,
                BufferArg::from_raw_parts(max_bits.clone(), nb),
                BufferArg::from_raw_parts(first_bad.clone(), 1),
            );
        }
        let read = gpu.read_words(vec![max_bits, first_bad], "reading the bucket norms")?;
        refuse_non_finite(gpu, grad, &read[1], out)?;
        // The host codec's draws (one key per segment, in order) and each bucket's
        // arithmetic, from the norms.
        let s = self.cfg.levels;
        let keys: Vec<u32> = segs
            .iter()
            .flat_map(|_| {
                let k = rng.next_u64();
                [k as u32, (k >> 32) as u32]
            })
            .collect();
        let mut params = Vec::with_capacity(4 * nb);
        for b in 0..nb {
            let nrm = f32::from_bits(word(&read[0], b));
            let (factor, n2, scale) = if nrm == 0.0 {
                (0.0, 0.0, 0.0)
            } else {
                counter_bucket_scale(nrm, s)
            };
            params.extend([nrm, factor, n2, scale].map(f32::to_bits));
        }
        let len: usize = segs.iter().map(|r| self.segment_len(r.len())).sum();
        let words = words_for(len);
        let body = gpu.words(words, 0);
        let [(params, np), (keys, nk)] = upload_tables(gpu, [params, keys]);
        let (count, dim) = geometry(words);
        // SAFETY: the tables hold S + 1 words each, `params` 4 a bucket, `keys` 2·S,
        // `body` ⌈len/4⌉.
        unsafe {
            encode::launch(
                client,
                count,
                dim,
                grad.arg(),
                BufferArg::from_raw_parts(starts, ns),
                BufferArg::from_raw_parts(body_starts, nbs),
                BufferArg::from_raw_parts(buckets, nbk),
                BufferArg::from_raw_parts(params, np),
                BufferArg::from_raw_parts(keys, nk),
                BufferArg::from_raw_parts(body.clone(), words),
                d,
                code_width(s),
                s,
            );
        }
        let read = gpu.read_words(vec![body], "reading a payload")?;
        out.buffer_mut().extend_from_slice(&read[0][..len]);
        Ok(())
    }

    fn decode_add(&self, gpu: &Gpu, payload: &[u8], out: &GpuBuffer) -> Result<(), DeviceError> {
        host_decode_add(gpu, &self.host as &dyn Compressor, payload, out)
    }
}
