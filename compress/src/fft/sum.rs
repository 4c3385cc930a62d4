//! [`FftSum`]: the joint decoder of several workers' FFT payloads (ALGORITHMS.md §0.4).

use std::ops::Range;

use realfft::num_complex::Complex;

use rayon::prelude::*;

use super::encode::Lease;
use super::{bins, lock, Fft, FftConfig, ADD};
use crate::compressor::read_frame;
use crate::error::WireError;
use crate::put::Put;
use crate::registry::Method;

/// Sums the spectra of several [`Fft`] payloads of the same buffer layout, then runs one
/// inverse FFT per chunk ([`FftSum::finish`]): equal, up to round-off, to summing the
/// individual decompressions, at the cost of one inverse transform instead of `P`.
pub struct FftSum<'a> {
    fft: &'a Fft,
    n: usize,
    segs: Option<Vec<Range<usize>>>,
    spectra: Vec<Complex<f32>>,
    payloads: usize,
    failed: bool,
    keep: Vec<u32>,
    vals: Vec<f32>,
}

impl<'a> FftSum<'a> {
    /// An empty sum for `n`-element buffers ([`Fft::sum`]).
    pub(super) fn new(fft: &'a Fft, n: usize) -> Self {
        FftSum {
            fft,
            n,
            segs: None,
            spectra: Vec::new(),
            payloads: 0,
            failed: false,
            keep: Vec::new(),
            vals: Vec::new(),
        }
    }

    /// Number of payloads added so far.
    pub fn payloads(&self) -> usize {
        self.payloads
    }

    /// Decodes one full payload (as produced by [`crate::compress`] with this
    /// configuration) into the running spectrum sum. All payloads must have the same
    /// segment layout. After an error the accumulator is unusable: [`FftSum::finish`] then
    /// fails too.
    pub fn add_payload(&mut self, bytes: &[u8]) -> Result<(), WireError> {
        let res = self.add_inner(bytes);
        if res.is_err() {
            self.failed = true;
        }
        res
    }

    fn add_inner(&mut self, bytes: &[u8]) -> Result<(), WireError> {
        if self.failed {
            return Err(WireError::Invalid("fft sum already failed"));
        }
        let (mut r, segs) = read_frame(FftConfig::ID, bytes, self.n)?;
        match &self.segs {
            None => {
                let total: usize = self.fft.chunk_ranges(&segs).map(|c| bins(c.len())).sum();
                // No zero fill: the first payload's decode writes every bin.
                self.spectra = std::mem::take(&mut lock(&self.fft.shared).dec.sum);
                self.spectra.resize(total, Complex::default());
                self.segs = Some(segs.clone());
            }
            Some(s) if *s != segs => {
                return Err(WireError::BadSegments(
                    "payloads of one sum disagree on segments",
                ))
            }
            Some(_) => {}
        }
        let mut at = 0;
        for c in self.fft.chunk_ranges(&segs) {
            let m = bins(c.len());
            self.fft.decode_chunk_into(
                &mut r,
                c.len(),
                &mut self.spectra[at..at + m],
                self.payloads == 0,
                &mut self.keep,
                &mut self.vals,
            )?;
            at += m;
        }
        if r.remaining() != 0 {
            return Err(WireError::TrailingBytes(r.remaining()));
        }
        self.payloads += 1;
        Ok(())
    }

    /// Inverse-transforms the summed spectra and **adds** the result into `out`
    /// (`out.len()` must be `n`). With no payload added, `out` is unchanged.
    pub fn finish(self, out: &mut [f32]) -> Result<(), WireError> {
        self.emit(out, ADD).map(drop)
    }

    /// Inverse-transforms the summed spectra and **writes** their mean, times `inv` (1/P),
    /// into `out` (`out.len()` must be `n`): bit for bit zeroing `out`, [`FftSum::finish`]
    /// and multiplying by `inv`, in one pass over `out`. With no payload added, `out` is
    /// zeroed. Returns whether the mean holds a NaN or an infinity.
    pub fn finish_mean(self, inv: f32, out: &mut [f32]) -> Result<bool, WireError> {
        self.emit(out, Put::Write { scale: Some(inv) })
    }

    /// The summed spectra's inverse transforms put into `out` as `put` says ([`Put`]:
    /// [`FftSum::finish`] adds, [`FftSum::finish_mean`] writes and scales); whether a scaled
    /// result holds a NaN or an infinity.
    pub(super) fn emit(mut self, out: &mut [f32], put: Put) -> Result<bool, WireError> {
        if self.failed {
            return Err(WireError::Invalid("fft sum had a malformed payload"));
        }
        if out.len() != self.n {
            return Err(WireError::LengthMismatch {
                payload: self.n,
                buffer: out.len(),
            });
        }
        let Some(segs) = self.segs.take() else {
            // No payload: nothing to add, then the scaling as asked.
            if let Put::Write { .. } = put {
                out.fill(0.0);
            }
            return Ok(put
                .scale()
                .is_some_and(|k| crate::finite::scale_has_non_finite(out, k)));
        };
        let ranges: Vec<Range<usize>> = self.fft.chunk_ranges(&segs).collect();
        if !Fft::side_by_side(ranges.len(), self.n) {
            let mut guard = lock(&self.fft.shared);
            let (mut at, mut bad) = (0, false);
            for range in ranges {
                let m = bins(range.len());
                let spec = &mut self.spectra[at..at + m];
                bad |= Fft::inverse_into(&mut guard, spec, &mut out[range], put)?;
                at += m;
            }
            return Ok(bad);
        }
        // Side by side: each chunk's spectrum and output are disjoint pieces, each inverse
        // transform the same arithmetic as one after the other.
        let plans: Vec<_> = {
            let mut sh = lock(&self.fft.shared);
            ranges
                .iter()
                .map(|r| sh.planner.plan_fft_inverse(r.len()))
                .collect()
        };
        let mut jobs = Vec::with_capacity(ranges.len());
        let (mut spec, mut rest) = (&mut self.spectra[..], out);
        for (range, plan) in ranges.iter().zip(plans) {
            let (s, s_tail) = std::mem::take(&mut spec).split_at_mut(bins(range.len()));
            let (o, o_tail) = std::mem::take(&mut rest).split_at_mut(range.len());
            jobs.push((s, o, plan));
            spec = s_tail;
            rest = o_tail;
        }
        let pool = &self.fft.inv_pool;
        jobs.into_par_iter()
            .map_init(
                || Lease::take(pool),
                |lease, (s, o, plan)| lease.get().inverse_into(&*plan, s, o, put),
            )
            .try_reduce(|| false, |a, b| Ok(a | b))
    }
}

impl Drop for FftSum<'_> {
    /// Hands the spectra buffer back to the compressor for the next sum.
    fn drop(&mut self) {
        if self.spectra.capacity() > 0 {
            lock(&self.fft.shared).dec.sum = std::mem::take(&mut self.spectra);
        }
    }
}
