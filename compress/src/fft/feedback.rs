//! The FFT method's own error feedback: the residual kept as spectra
//! ([`FftConfig::spectral_feedback`](super::FftConfig::spectral_feedback)).
//!
//! With classic residual error feedback a step compensates `p = g + e`, sends `C(p)` and keeps
//! `e = p − D(C(p))`. Kept over the signal (the generic memory) that needs the inverse
//! transform of the method's own payload every step. The transform is linear, so the same
//! residual can be kept as its spectrum `E`: the compensated spectrum is `Y_g + E` (one forward
//! transform of `g`), and the new residual is that spectrum with the sent, quantized values
//! taken off the kept bins — no inverse transform. Equal to the signal residual up to float
//! rounding (the property suite checks `D(C(p)) + e = g + e_old` over the signal).
//!
//! Per bucket ([`AdoptedResidual`](crate::memory::AdoptedResidual)), the residual spectrum
//! `E = Y_p − T` of every chunk (in `Y = X/n` units) is packed as exactly `n` reals for an
//! `n`-element chunk — `Re E_0`, then `Re E_k, Im E_k` for `0 < k < n/2`, then `Re E_{n/2}`
//! for even `n` (the imaginary parts of DC and Nyquist are zero for a real signal) — so a
//! bucket's residual has one `f32` per element, like the generic memory's.

use realfft::num_complex::Complex;

use super::{bins, emax_of_bits, pow2_f32};
use crate::simd::vector_dispatch;

// The passes over a chunk's spectrum, with the widest vectors the CPU has (the same source
// per tier, so the same bits; the FFT tests run the method on every tier).
vector_dispatch! {
    /// `spec ← post·spec + E` for the packed residual `e` of an `e.len()`-element chunk (see
    /// the module docs; the imaginary parts of DC and Nyquist are set to zero), and `e ←` the
    /// packed result: the new residual before the sent values are taken off
    /// ([`take_off_sent`]). One pass for what was the compensation, the residual's copy and
    /// the energy scale's read; returns the [`energy_scale`] of the result.
    pub(super) fn compensate_spectrum(spec: &mut [Complex<f32>], post: f32, e: &mut [f32]) -> f32 =
        compensate_spectrum_lanes;
}

/// The sent values `T` (two per kept bin, in `keep` order) taken off the kept bins of the
/// packed residual `e` of an `e.len()`-element chunk, which holds `Y_p` packed
/// ([`compensate_spectrum`]): then `e` is `Y_p − T`. Touches only the kept bins.
pub(super) fn take_off_sent(keep: &[u32], sent: &[f32], e: &mut [f32]) {
    let n = e.len();
    let pairs = if n.is_multiple_of(2) { n / 2 } else { bins(n) };
    for (&b, t) in keep.iter().zip(sent.chunks_exact(2)) {
        let b = b as usize;
        if b == 0 {
            e[0] -= t[0];
        } else if b < pairs {
            e[2 * b - 1] -= t[0];
            e[2 * b] -= t[1];
        } else {
            e[n - 1] -= t[0];
        }
    }
}

/// The spectrum of the packed residual `e` (see the module docs) written into `spec`
/// (`bins(e.len())` bins): what the inverse transform of the residual reads.
pub(super) fn unpack_residual(spec: &mut [Complex<f32>], e: &[f32]) {
    let n = e.len();
    let m = spec.len();
    debug_assert_eq!(m, bins(n));
    spec[0] = Complex::new(e[0], 0.0);
    let pairs = if n.is_multiple_of(2) { m - 1 } else { m };
    for (c, e) in spec[1..pairs].iter_mut().zip(e[1..].chunks_exact(2)) {
        *c = Complex::new(e[0], e[1]);
    }
    if n.is_multiple_of(2) && m > 1 {
        spec[m - 1] = Complex::new(e[n - 1], 0.0);
    }
}

/// A power of two that brings the largest magnitude, given as its bits `amax` (sign
/// cleared), into `[1, 2)` (1 for zero), so that energies neither overflow nor underflow.
pub(super) fn energy_scale(amax: u32) -> f32 {
    if amax == 0 {
        1.0
    } else {
        pow2_f32(-emax_of_bits(amax).clamp(-100, 100))
    }
}

/// A spectrum's bins as their interleaved real and imaginary parts.
fn interleaved(spec: &mut [Complex<f32>]) -> &mut [f32] {
    let len = spec.len() * 2;
    // SAFETY: `Complex<f32>` is `#[repr(C)]` {re, im} (num-complex documents it), so a
    // slice of `len / 2` of them is `len` consecutive `f32`s with the same borrow.
    unsafe { std::slice::from_raw_parts_mut(spec.as_mut_ptr().cast::<f32>(), len) }
}

/// The sign-cleared bits of `v`: their order is the order of the magnitudes.
#[inline(always)]
fn magnitude_bits(v: f32) -> u32 {
    v.to_bits() & 0x7FFF_FFFF
}

#[inline(always)]
fn compensate_spectrum_lanes(spec: &mut [Complex<f32>], post: f32, e: &mut [f32]) -> f32 {
    const L: usize = 16;
    let n = e.len();
    let m = spec.len();
    debug_assert_eq!(m, bins(n));
    let dc = spec[0].re * post + e[0];
    spec[0] = Complex::new(dc, 0.0);
    e[0] = dc;
    let mut amax = magnitude_bits(dc);
    let pairs = if n.is_multiple_of(2) { m - 1 } else { m };
    // Bins 1..pairs are the reals e[1..2·pairs − 1], in the same interleaved order.
    let flat = interleaved(&mut spec[1..pairs]);
    let ev = &mut e[1..2 * pairs - 1];
    let mut lanes = [0u32; L];
    let mut fs = flat.chunks_exact_mut(L);
    let mut es = ev.chunks_exact_mut(L);
    for (s, r) in (&mut fs).zip(&mut es) {
        for k in 0..L {
            let v = s[k] * post + r[k];
            s[k] = v;
            r[k] = v;
            lanes[k] = lanes[k].max(magnitude_bits(v));
        }
    }
    for (s, r) in fs.into_remainder().iter_mut().zip(es.into_remainder()) {
        let v = *s * post + *r;
        *s = v;
        *r = v;
        amax = amax.max(magnitude_bits(v));
    }
    amax = lanes.iter().fold(amax, |a, &l| a.max(l));
    if n.is_multiple_of(2) && m > 1 {
        let ny = spec[m - 1].re * post + e[n - 1];
        spec[m - 1] = Complex::new(ny, 0.0);
        e[n - 1] = ny;
        amax = amax.max(magnitude_bits(ny));
    }
    energy_scale(amax)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::ops::Range;

    use super::*;
    use crate::compressor::{Ctx, Payload};
    use crate::fft::FftConfig;
    use crate::memory::MemoryConfig;
    use crate::pipeline::Pipeline;
    use crate::rng::Rng;

    fn signal(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect()
    }

    #[test]
    fn packing_keeps_exactly_n_reals_and_round_trips() {
        for n in [1usize, 2, 3, 4, 7, 8, 33, 64] {
            let m = bins(n);
            let e = signal(n, n as u64);
            // Unpack onto a zero spectrum, then pack with nothing sent: the same reals.
            let mut spec = vec![Complex::new(f32::NAN, f32::NAN); m];
            unpack_residual(&mut spec, &e);
            assert_eq!(spec[0].im, 0.0, "n = {n}: DC has no imaginary part");
            if n % 2 == 0 {
                assert_eq!(spec[m - 1].im, 0.0, "n = {n}: Nyquist has none either");
            }
            // Compensating a zero spectrum packs the same reals back, and the unpacked
            // spectrum is the compensated one.
            let mut comp = vec![Complex::new(0.0f32, 0.0); m];
            let mut back = e.clone();
            compensate_spectrum(&mut comp, 1.0, &mut back);
            assert_eq!(back, e, "n = {n}");
            assert_eq!(comp, spec, "n = {n}");
            // Every bin sent exactly: nothing is left.
            let keep: Vec<u32> = (0..m as u32).collect();
            let sent: Vec<f32> = spec.iter().flat_map(|c| [c.re, c.im]).collect();
            take_off_sent(&keep, &sent, &mut back);
            assert!(back.iter().all(|&v| v == 0.0), "n = {n}: {back:?}");
        }
    }

    #[test]
    fn energy_scale_brings_the_largest_component_into_one_to_two() {
        for big in [1e-30f32, 3e-5, 1.0, 7.5e20] {
            // The largest component anywhere (here an imaginary part mid-spectrum) sets
            // the compensation's scale.
            let mut spec = [
                Complex::new(0.0, 0.0),
                Complex::new(0.5 * big, -big),
                Complex::new(0.25 * big, 0.0),
                Complex::new(0.0, 0.0),
            ];
            let s = compensate_spectrum(&mut spec, 1.0, &mut [0.0; 6]);
            let top = big * s;
            assert!((1.0..2.0).contains(&top), "{big}: {top}");
        }
        assert_eq!(energy_scale(0), 1.0);
    }

    fn pipeline(spectral: bool) -> Pipeline {
        let cfg = FftConfig {
            theta: 0.8,
            spectral_feedback: spectral,
            ..FftConfig::default()
        };
        Pipeline::new(
            Box::new(cfg.init().unwrap()),
            MemoryConfig::RESIDUAL.build().unwrap(),
        )
    }

    #[test]
    fn adopted_only_for_classic_residual_and_when_configured() {
        assert_eq!(pipeline(true).adopted_feedback(), Some("spectra"));
        assert_eq!(pipeline(false).adopted_feedback(), None);
        let damped = MemoryConfig::Residual {
            beta: 0.5,
            gamma: 1.0,
        };
        let p = Pipeline::new(
            Box::new(FftConfig::default().init().unwrap()),
            damped.build().unwrap(),
        );
        assert_eq!(p.adopted_feedback(), None);
        assert!(p.memory().is_active());
    }

    /// Compresses `g` as bucket 9 at `step`, with that step's generator.
    fn compress_step(
        p: &mut Pipeline,
        g: &[f32],
        step: u64,
        segs: &[Range<usize>],
        out: &mut Payload,
    ) {
        let ctx = Ctx {
            step,
            rank: 0,
            bucket: 9,
            segments: segs,
        };
        p.compress(g, &ctx, &mut Rng::seed_from_u64(step), out)
            .unwrap();
    }

    /// The method's dispatched passes (the forward scaling, compensation, energy scale,
    /// residual, selection, the receiver's sum) give the same payloads, residuals and
    /// decodes on every vector tier, with spectral and signal feedback.
    #[test]
    fn payloads_residuals_and_decodes_are_the_same_on_every_tier() {
        let segs = [0..300, 300..301, 301..4000];
        let n = 4000;
        for spectral in [true, false] {
            crate::simd::assert_same_on_every_tier("fft", || {
                let mut p = pipeline(spectral);
                let mut payload = Payload::new();
                let mut seen = Vec::new();
                for step in 0..3 {
                    let g = signal(n, 200 + step);
                    compress_step(&mut p, &g, step, &segs, &mut payload);
                    let mut d = vec![0.5f32; n];
                    p.decompress_add(payload.as_bytes(), &mut d).unwrap();
                    seen.push(payload.as_bytes().to_vec());
                    seen.push(d.iter().flat_map(|v| v.to_le_bytes()).collect());
                    let mem = p.export_memory();
                    seen.push(mem[&9].iter().flat_map(|v| v.to_le_bytes()).collect());
                }
                seen
            });
        }
    }

    /// The spectral residual and the signal residual are the same error feedback: the sum
    /// of what was sent plus the residual is the sum of the gradients, over the signal.
    #[test]
    fn sent_plus_residual_telescopes_to_the_gradients_like_the_signal_memory() {
        let segs = [0..300, 300..301, 301..1000];
        let n = 1000;
        for spectral in [true, false] {
            let mut p = pipeline(spectral);
            let (mut sent, mut grads) = (vec![0f64; n], vec![0f64; n]);
            let mut payload = Payload::new();
            for step in 0..6 {
                let g = signal(n, 100 + step);
                compress_step(&mut p, &g, step, &segs, &mut payload);
                let mut d = vec![0f32; n];
                p.decompress_add(payload.as_bytes(), &mut d).unwrap();
                for i in 0..n {
                    sent[i] += d[i] as f64;
                    grads[i] += g[i] as f64;
                }
            }
            let e = p.residual_signal(9, &segs, n).unwrap();
            let worst = (0..n)
                .map(|i| (sent[i] + e[i] as f64 - grads[i]).abs())
                .fold(0.0, f64::max);
            assert!(worst < 1e-4, "spectral = {spectral}: off by {worst}");
            assert!(e.iter().any(|&v| v != 0.0), "something was left out");
        }
    }

    /// Exact resume: the exported residual, imported into a fresh pipeline, gives the same
    /// payloads bit for bit; the offsets of the compressed all-reduce's ranges address the
    /// same residual as one call over the whole bucket.
    #[test]
    fn export_import_is_exact_and_ranges_address_the_bucket() {
        let segs = [0..500, 500..1200];
        let n = 1200;
        let run = |p: &mut Pipeline, step: u64| {
            let g = signal(n, step);
            let ctx = Ctx {
                step,
                rank: 0,
                bucket: 3,
                segments: &segs,
            };
            let mut out = Payload::new();
            p.compress(&g, &ctx, &mut Rng::seed_from_u64(0), &mut out)
                .unwrap();
            out
        };
        let mut a = pipeline(true);
        run(&mut a, 0);
        run(&mut a, 1);
        let state = a.export_memory();
        assert_eq!(state[&3].len(), n, "one f32 per bucket element");
        let mut b = pipeline(true);
        b.import_memory(state.clone());
        for step in 2..5 {
            assert_eq!(run(&mut a, step), run(&mut b, step), "step {step}");
        }
        // Ranges: the same bucket in two payloads (cut at a layer boundary, so each range
        // holds whole layers) equals the one-call encoding's two layers.
        let mut whole = pipeline(true);
        let mut split = pipeline(true);
        whole.import_memory(state.clone());
        split.import_memory(state);
        let g = signal(n, 7);
        let ctx = Ctx {
            step: 2,
            rank: 0,
            bucket: 3,
            segments: &segs,
        };
        let mut one = Payload::new();
        whole
            .compress(&g, &ctx, &mut Rng::seed_from_u64(0), &mut one)
            .unwrap();
        let mut parts = Vec::new();
        split
            .compress_chunks(
                &g,
                &ctx,
                &[0..500, 500..1200],
                &mut Rng::seed_from_u64(0),
                &mut parts,
            )
            .unwrap();
        let (mut d1, mut d2) = (vec![0f32; n], vec![0f32; n]);
        whole.decompress_add(one.as_bytes(), &mut d1).unwrap();
        split
            .decompress_add(parts[0].as_bytes(), &mut d2[..500])
            .unwrap();
        split
            .decompress_add(parts[1].as_bytes(), &mut d2[500..])
            .unwrap();
        assert_eq!(d1, d2);
        assert_eq!(whole.export_memory(), split.export_memory());
        // Clearing empties it.
        split.import_memory(BTreeMap::new());
        assert!(split.export_memory().is_empty());
        assert!(split.compressor().export_feedback().is_empty());
    }
}
