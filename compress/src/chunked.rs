//! Chunk-wise Top-k with indices sized to the chunk: the segment body SparseLoCo
//! ([`crate::sparseloco`]) and DeMo ([`crate::demo`]) share.
//!
//! A segment of `n` values is cut into chunks of `C` values (the last one shorter when `C`
//! does not divide `n`); each chunk keeps its `k_c` largest magnitudes, `k_c = k` for a full
//! chunk and `⌈k·L/C⌉` (at least 1, at most `L`) for a last chunk of `L < C` values, so the
//! density is `k/C` everywhere. An index is its position inside its chunk, in
//! `w = ⌈log₂ C⌉` bits (12 bits for SparseLoCo's 4 096-value chunks, 12 for DeMo's 64 × 64
//! tiles), instead of a 32-bit position in the tensor.
//!
//! # Body
//! ```text
//! u32 C          chunk length (≥ 1)
//! u32 k          kept per full chunk (1 ≤ k ≤ C)
//! u8  coding     0 = f32 values, 1 = 2-bit codes, 2 = signs
//! coding 1:      4 × f32 the value each code decodes to (finite)
//! coding 2:      f32 the magnitude every sign decodes to (finite, ≥ 0)
//! ⌈K·w/8⌉ bytes  the K = Σ k_c indices, chunk by chunk, strictly increasing inside a
//!                chunk, each w bits, LSB-first
//! values         coding 0: K × f32 (finite); coding 1: ⌈2K/8⌉ bytes of 2-bit codes;
//!                coding 2: ⌈K/8⌉ bytes of sign bits (1 = non-negative), LSB-first
//! ```
//! Its size depends on `n`, `C`, `k` and the coding alone ([`body_bits`]).
//!
//! # The 2-bit quantizer
//! SparseLoCo sends the kept values in two bits each. The codes here split the kept values
//! of a segment around their mean `μ` in bins of width `s = R·σ/4` (σ their standard
//! deviation, `R` the span in standard deviations, 6 by default): code
//! `clamp(⌊(v − μ)/s⌋ + 2, 0, 3)`, so the two outer bins take every value beyond `μ ± s`;
//! each code decodes to the mean of the values it holds (its centroid; the table is sent),
//! which removes the bias a bin's midpoint would add. [`Quant2Rule::Templar`] cuts the bins
//! as Templar's trainer does instead (nearest of four centres, asymmetric about the mean,
//! sample σ); the body is the same. Top-k values are large of either
//! sign, so with `μ ≈ 0` the four codes amount to a sign and a magnitude bit. What is not
//! represented stays in the error feedback. This follows the statistical quantizer of the
//! SparseLoCo authors' code as documented (bins over a span in σ around the mean, a
//! look-up table of the values per bin), not its code.

use serde::{Deserialize, Serialize};

use crate::error::WireError;
use crate::select::{top_k_abs, Scratch};
use crate::wire::{bytes_for_bits, f32_at, BitReader, BitWriter, Reader, Writer};

/// How the kept values travel (the body's `coding` byte).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Coding {
    /// Each value as an f32 (exact).
    F32,
    /// Two bits each, decoding to the centroid of their bin (see the module docs).
    Quant2 {
        /// The span of the four bins in standard deviations of the kept values.
        range: f32,
        /// Where the bins' edges sit ([`Quant2Rule`]).
        rule: Quant2Rule,
    },
    /// One bit each (the sign), decoding to ± the mean magnitude of the kept values.
    Sign,
}

/// How the 2-bit quantizer cuts the kept values into its four bins (step `s = R·σ/4`
/// around their mean `μ`). The decoder does not need to know: every code decodes to its
/// bin's centroid, which the table carries, so the rule changes the encoder alone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Quant2Rule {
    /// Floor into bins whose edges sit at `μ − s`, `μ`, `μ + s` (symmetric about the mean:
    /// two bins each side), σ the population deviation (÷ n). The default.
    #[default]
    Symmetric,
    /// The rule of Templar's trainer (`tplr-ai/templar`, `_quantize_values`: read, not
    /// copied): round half to even to the nearest of the centres `μ − 2s`, `μ − s`, `μ`,
    /// `μ + s`, so the edges sit at `μ − 1.5s`, `μ − 0.5s`, `μ + 0.5s` (asymmetric: one bin
    /// around the mean, two below it, one catch-all above `μ + 0.5s`), σ the sample
    /// deviation (÷ n − 1).
    Templar,
}

impl Coding {
    fn tag(self) -> u8 {
        match self {
            Coding::F32 => 0,
            Coding::Quant2 { .. } => 1,
            Coding::Sign => 2,
        }
    }

    /// Bytes of the table that follows the coding byte.
    fn table_bytes(tag: u8) -> usize {
        match tag {
            1 => 16,
            2 => 4,
            _ => 0,
        }
    }

    /// Bits of one value.
    fn value_bits(tag: u8) -> u64 {
        match tag {
            0 => 32,
            1 => 2,
            _ => 1,
        }
    }
}

/// Index width for chunks of `c` values: `⌈log₂ c⌉` bits (0 for `c = 1`).
pub fn index_bits(c: usize) -> u32 {
    usize::BITS - c.saturating_sub(1).leading_zeros()
}

/// Values kept in a chunk of `len` values when a full chunk of `c` keeps `k`.
pub fn kept_in(len: usize, c: usize, k: usize) -> usize {
    if len == 0 {
        return 0;
    }
    if len >= c {
        return k.min(len);
    }
    (k * len).div_ceil(c).clamp(1, len)
}

/// Values kept in a segment of `n` values: `Σ k_c` over its chunks.
pub fn kept_total(n: usize, c: usize, k: usize) -> usize {
    let full = n / c;
    full * k.min(c) + kept_in(n % c, c, k)
}

/// Bits of a body for `n` values (the layout in the module docs).
pub fn body_bits(n: usize, c: usize, k: usize, coding: Coding) -> u64 {
    let tag = coding.tag();
    let kk = kept_total(n, c, k) as u64;
    let head = 9 + Coding::table_bytes(tag) as u64;
    8 * (head
        + bytes_for_bits(kk * index_bits(c) as u64) as u64
        + bytes_for_bits(kk * Coding::value_bits(tag)) as u64)
}

/// Reusable buffers of the encoder.
#[derive(Debug, Clone, Default)]
pub struct Encoder {
    scratch: Scratch,
    idx: Vec<u32>,
    /// Every kept index (within its chunk), chunk by chunk.
    kept: Vec<u32>,
    /// The kept values in the same order.
    values: Vec<f32>,
    /// The 2-bit code of each kept value (only with [`Coding::Quant2`]).
    codes: Vec<u8>,
}

impl Encoder {
    /// Selects the chunk-wise Top-k of `x` (chunks of `c`, `k` per full chunk; `1 ≤ k ≤ c`)
    /// and writes the body with `coding`.
    pub fn write(&mut self, x: &[f32], c: usize, k: usize, coding: Coding, w: &mut Writer<'_>) {
        debug_assert!(c >= 1 && (1..=c).contains(&k));
        self.kept.clear();
        self.values.clear();
        for chunk in x.chunks(c) {
            top_k_abs(
                chunk,
                kept_in(chunk.len(), c, k),
                &mut self.scratch,
                &mut self.idx,
            );
            self.kept.extend_from_slice(&self.idx);
            self.values
                .extend(self.idx.iter().map(|&i| chunk[i as usize]));
        }
        w.u32(c as u32);
        w.u32(k as u32);
        w.u8(coding.tag());
        let kk = self.kept.len() as u64;
        match coding {
            Coding::F32 => {}
            Coding::Quant2 { range, rule } => {
                let table = quantize2(&self.values, range, rule, &mut self.codes);
                for v in table {
                    w.f32(v);
                }
            }
            Coding::Sign => w.f32(mean_abs(&self.values)),
        }
        let width = index_bits(c);
        let mut bw = BitWriter::new(w.zeroed(bytes_for_bits(kk * width as u64)));
        for &i in &self.kept {
            bw.put(i, width);
        }
        bw.finish();
        match coding {
            Coding::F32 => w.f32_slice(&self.values),
            Coding::Quant2 { .. } => {
                let mut bw = BitWriter::new(w.zeroed(bytes_for_bits(2 * kk)));
                for &code in &self.codes {
                    bw.put(u32::from(code), 2);
                }
                bw.finish();
            }
            Coding::Sign => w.sign_bits(&self.values),
        }
    }
}

/// The mean magnitude of `v` (0 when empty), accumulated in f64.
fn mean_abs(v: &[f32]) -> f32 {
    if v.is_empty() {
        return 0.0;
    }
    (v.iter().map(|x| x.abs() as f64).sum::<f64>() / v.len() as f64) as f32
}

/// The 2-bit quantization of `v` (module docs) under `rule`: returns the four centroids and
/// leaves each value's code in `codes` (one pass to code, one to average).
fn quantize2(v: &[f32], range: f32, rule: Quant2Rule, codes: &mut Vec<u8>) -> [f32; 4] {
    let n = v.len().max(1) as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let squares = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>();
    let var = match rule {
        Quant2Rule::Symmetric => squares / n,
        Quant2Rule::Templar => squares / (n - 1.0).max(1.0),
    };
    let step = range as f64 * var.sqrt() / 4.0;
    let code = |x: f32| -> u8 {
        if !(step > 0.0 && step.is_finite()) {
            return 0;
        }
        let z = (x as f64 - mean) / step;
        let bin = match rule {
            Quant2Rule::Symmetric => z.floor(),
            Quant2Rule::Templar => z.round_ties_even(),
        };
        ((bin + 2.0).clamp(0.0, 3.0)) as u8
    };
    codes.clear();
    codes.extend(v.iter().map(|&x| code(x)));
    let (mut sum, mut count) = ([0f64; 4], [0u64; 4]);
    for (&x, &c) in v.iter().zip(codes.iter()) {
        sum[c as usize] += x as f64;
        count[c as usize] += 1;
    }
    let mut table = [0f32; 4];
    for ((t, s), c) in table.iter_mut().zip(sum).zip(count) {
        if c > 0 {
            *t = (s / c as f64) as f32;
        }
    }
    table
}

/// Reads a body for a segment of `n` values and calls `add(position, value)` for every kept
/// value, in increasing position. Validates everything it reads: the chunk and `k`, the
/// coding, a finite table, indices inside and increasing within their chunk, finite values.
pub fn read(
    r: &mut Reader<'_>,
    n: usize,
    mut add: impl FnMut(usize, f32),
) -> Result<(), WireError> {
    let c = r.u32("chunk length")? as usize;
    let k = r.u32("kept per chunk")? as usize;
    if c == 0 || k == 0 || k > c {
        return Err(WireError::Invalid(
            "chunk length and kept per chunk out of range",
        ));
    }
    let tag = r.u8("value coding")?;
    if tag > 2 {
        return Err(WireError::Invalid("unknown value coding"));
    }
    let mut table = [0f32; 4];
    match tag {
        1 => {
            for t in &mut table {
                *t = r.finite_f32("2-bit code table")?;
            }
        }
        2 => {
            let s = r.finite_f32("sign magnitude")?;
            if s < 0.0 {
                return Err(WireError::Invalid("a negative sign magnitude"));
            }
            table[0] = s;
        }
        _ => {}
    }
    let kk = kept_total(n, c, k);
    let width = index_bits(c);
    let idx = r.take(bytes_for_bits(kk as u64 * width as u64), "chunk indices")?;
    let vals = r.take(
        bytes_for_bits(kk as u64 * Coding::value_bits(tag)),
        "kept values",
    )?;
    let mut ir = BitReader::new(idx);
    let mut vr = BitReader::new(vals);
    let mut at = 0;
    let mut j = 0;
    while at < n {
        let len = c.min(n - at);
        let mut prev: Option<usize> = None;
        for _ in 0..kept_in(len, c, k) {
            let i = ir.get(width) as usize;
            if i >= len || prev.is_some_and(|p| p >= i) {
                return Err(WireError::Invalid(
                    "chunk indices not increasing inside their chunk",
                ));
            }
            prev = Some(i);
            let v = match tag {
                0 => {
                    let v = f32_at(vals, j);
                    if !v.is_finite() {
                        return Err(WireError::Invalid("a non-finite value"));
                    }
                    v
                }
                1 => table[vr.get(2) as usize],
                _ => {
                    if vr.bit() {
                        table[0]
                    } else {
                        -table[0]
                    }
                }
            };
            add(at + i, v);
            j += 1;
        }
        at += len;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(x: &[f32], c: usize, k: usize, coding: Coding) -> (Vec<f32>, usize) {
        let mut buf = Vec::new();
        let mut w = Writer::new(&mut buf);
        Encoder::default().write(x, c, k, coding, &mut w);
        let mut out = vec![0f32; x.len()];
        let mut r = Reader::new(&buf);
        read(&mut r, x.len(), |i, v| out[i] += v).unwrap();
        assert_eq!(r.remaining(), 0);
        assert_eq!(buf.len() as u64 * 8, body_bits(x.len(), c, k, coding));
        (out, buf.len())
    }

    fn signal(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 % 1009) as f32 - 504.0) / 97.0)
            .collect()
    }

    #[test]
    fn index_widths_and_counts() {
        assert_eq!(index_bits(1), 0);
        assert_eq!(index_bits(2), 1);
        assert_eq!(index_bits(4096), 12);
        assert_eq!(index_bits(4097), 13);
        assert_eq!(kept_in(4096, 4096, 64), 64);
        assert_eq!(kept_in(100, 4096, 64), 2);
        assert_eq!(kept_in(1, 4096, 64), 1);
        // 10 000 = 2 full chunks and 1 808 values: ⌈64 · 1 808 / 4 096⌉ = 29.
        assert_eq!(kept_total(10_000, 4096, 64), 64 + 64 + 29);
    }

    #[test]
    fn f32_coding_keeps_each_chunks_largest_exactly() {
        let x = signal(1000);
        let (out, _) = round_trip(&x, 128, 5, Coding::F32);
        for (ci, (xc, oc)) in x.chunks(128).zip(out.chunks(128)).enumerate() {
            let kept: Vec<usize> = (0..xc.len()).filter(|&i| oc[i] != 0.0).collect();
            assert_eq!(kept.len(), kept_in(xc.len(), 128, 5), "chunk {ci}");
            let min_kept = kept.iter().map(|&i| xc[i].abs()).fold(f32::MAX, f32::min);
            for i in 0..xc.len() {
                if oc[i] == 0.0 {
                    assert!(xc[i].abs() <= min_kept);
                } else {
                    assert_eq!(oc[i], xc[i]);
                }
            }
        }
    }

    #[test]
    fn two_bit_codes_decode_to_their_bins_means() {
        let x = signal(4096);
        for rule in [Quant2Rule::Symmetric, Quant2Rule::Templar] {
            let coding = Coding::Quant2 { range: 6.0, rule };
            let (out, bytes) = round_trip(&x, 4096, 64, coding);
            // 9 + 16 bytes of head, 64 × 12 bits of indices, 64 × 2 bits of codes.
            assert_eq!(bytes, 9 + 16 + 96 + 16);
            let kept: Vec<(f32, f32)> = (0..x.len())
                .filter(|&i| out[i] != 0.0)
                .map(|i| (x[i], out[i]))
                .collect();
            assert_eq!(kept.len(), 64);
            // Every decoded value is the mean of the originals decoding to it; under the
            // symmetric rule the signs of these large values survive too (two bins a side).
            let mut groups: Vec<(f32, f64, usize)> = Vec::new();
            for &(v, d) in &kept {
                if rule == Quant2Rule::Symmetric {
                    assert_eq!(v.signum(), d.signum(), "{v} decoded to {d}");
                }
                match groups.iter_mut().find(|g| g.0 == d) {
                    Some(g) => {
                        g.1 += v as f64;
                        g.2 += 1;
                    }
                    None => groups.push((d, v as f64, 1)),
                }
            }
            for (d, s, c) in groups {
                assert!(
                    (d as f64 - s / c as f64).abs() < 1e-5,
                    "{rule:?}: {d} vs {}",
                    s / c as f64
                );
            }
        }
    }

    #[test]
    fn the_two_rules_cut_the_bins_where_they_say() {
        // Values in ± pairs (mean exactly 0); each rule's own σ gives the step s = 6σ/4, and
        // the probes sit at known multiples of it on either side of every edge.
        let zs = [-2.4, -1.6, -1.4, -0.6, -0.4, 0.4, 0.6, 1.4];
        let base: Vec<f32> = (1..=24).map(|i| i as f32 * 0.25).collect();
        let v: Vec<f32> = base.iter().flat_map(|&b| [b, -b]).collect();
        let n = v.len() + 2 * zs.len();
        let population = |sigma2: f64| sigma2 / n as f64;
        let sample = |sigma2: f64| sigma2 / (n - 1) as f64;
        for (rule, var_of, want) in [
            // floor(z) + 2, clamped: edges at −s, 0, +s.
            (
                Quant2Rule::Symmetric,
                &population as &dyn Fn(f64) -> f64,
                [0u8, 0, 0, 1, 1, 2, 2, 3],
            ),
            // round-half-even(z) + 2, clamped: edges at −1.5s, −0.5s, +0.5s.
            (Quant2Rule::Templar, &sample, [0, 0, 1, 1, 2, 2, 3, 3]),
        ] {
            // The probes go in as ± pairs too, so the mean stays 0 whatever the scale; the
            // scale is found by fixed point (σ depends on the probes themselves).
            let mut step = 1.0f64;
            let mut vals = v.clone();
            for _ in 0..200 {
                vals = v.clone();
                for &z in &zs {
                    vals.push((z * step) as f32);
                    vals.push((-z * step) as f32);
                }
                let ss: f64 = vals.iter().map(|&x| (x as f64).powi(2)).sum();
                step = 6.0 * var_of(ss).sqrt() / 4.0;
            }
            let mut codes = Vec::new();
            let table = quantize2(&vals, 6.0, rule, &mut codes);
            let probes = &codes[2 * base.len()..];
            let got: Vec<u8> = probes.iter().step_by(2).copied().collect();
            assert_eq!(got, want, "{rule:?}");
            // Every code decodes to the mean of its values.
            for c in 0..4u8 {
                let mine: Vec<f64> = vals
                    .iter()
                    .zip(&codes)
                    .filter(|(_, &k)| k == c)
                    .map(|(&x, _)| x as f64)
                    .collect();
                if !mine.is_empty() {
                    let mean = mine.iter().sum::<f64>() / mine.len() as f64;
                    assert!(
                        (table[c as usize] as f64 - mean).abs() < 1e-5,
                        "{rule:?} code {c}"
                    );
                }
            }
        }
    }

    #[test]
    fn sign_coding_decodes_to_the_mean_magnitude() {
        let x = signal(300);
        let (out, _) = round_trip(&x, 300, 10, Coding::Sign);
        let kept: Vec<usize> = (0..300).filter(|&i| out[i] != 0.0).collect();
        let m = kept.iter().map(|&i| x[i].abs() as f64).sum::<f64>() / 10.0;
        for i in kept {
            assert_eq!(out[i].signum(), x[i].signum());
            assert!((out[i].abs() as f64 - m).abs() < 1e-5);
        }
    }

    #[test]
    fn identical_values_quantize_to_themselves() {
        let x = vec![0.5f32; 64];
        let (out, _) = round_trip(
            &x,
            64,
            4,
            Coding::Quant2 {
                range: 6.0,
                rule: Quant2Rule::Symmetric,
            },
        );
        assert_eq!(out.iter().filter(|&&v| v == 0.5).count(), 4);
    }

    #[test]
    fn damaged_bodies_are_refused() {
        let x = signal(200);
        let mut buf = Vec::new();
        Encoder::default().write(&x, 64, 3, Coding::F32, &mut Writer::new(&mut buf));
        let read_all = |b: &[u8]| read(&mut Reader::new(b), 200, |_, _| {});
        assert!(read_all(&buf).is_ok());
        for (at, v) in [(0usize, 0u8), (4, 0), (4, 65), (8, 3)] {
            let mut b = buf.clone();
            b[at] = v;
            if at == 4 {
                b[5..8].fill(0);
            }
            assert!(read_all(&b).is_err(), "byte {at} = {v}");
        }
        assert!(read_all(&buf[..buf.len() - 1]).is_err());
        // Two equal indices in the first chunk.
        let mut b = buf.clone();
        b[9] = 0;
        b[10] = 0;
        assert!(read_all(&b).is_err());
    }
}
