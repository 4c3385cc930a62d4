//! The bookkeeping of error feedback a compressor keeps itself
//! ([`Compressor::adopt_error_feedback`](crate::Compressor::adopt_error_feedback)): one
//! residual buffer per bucket, one `f32` per bucket element, and the position inside the
//! bucket that the next segment's residual starts at.
//!
//! What the buffer holds is the method's business: the FFT method keeps the residual's
//! spectra ([`crate::fft`]), the sparsifiers that send their kept values exactly (Top-k)
//! keep the residual over the signal itself, which is then the very state the generic
//! [`Residual`](super::Residual) memory would hold.

use std::collections::BTreeMap;

/// The name of the domain of a residual kept over the signal: the generic memory's state,
/// so [`Pipeline::adopted_feedback`](crate::Pipeline::adopted_feedback) reports no domain of
/// its own for it and checkpoints of either keeper are interchangeable.
pub const SIGNAL_DOMAIN: &str = "signal";

/// Per bucket, the residual a compressor keeps; see the module docs.
#[derive(Debug, Default, Clone)]
pub(crate) struct AdoptedResidual {
    /// The residual of every bucket seen, keyed by bucket id.
    pub(crate) residuals: BTreeMap<u64, Vec<f32>>,
    /// The bucket being compressed (from [`AdoptedResidual::begin`]).
    bucket: u64,
    /// Where the next segment starts in that bucket.
    at: usize,
    /// Where the next compress call starts ([`AdoptedResidual::set_offset`]).
    next: usize,
}

impl AdoptedResidual {
    /// A compress call for `bucket` begins (from [`Compressor::begin`](crate::Compressor::begin)):
    /// its first segment starts at the offset last set, or at 0.
    pub(crate) fn begin(&mut self, bucket: u64) {
        self.bucket = bucket;
        self.at = std::mem::take(&mut self.next);
    }

    /// The next compress call encodes the bucket's elements from `offset` on
    /// ([`Compressor::feedback_offset`](crate::Compressor::feedback_offset)).
    pub(crate) fn set_offset(&mut self, offset: usize) {
        self.next = offset;
    }

    /// The residual of the next `n` elements of the current bucket, advancing past them,
    /// and how many of them (a prefix) held a residual before; the others are new zeros.
    pub(crate) fn claim_known(&mut self, n: usize) -> (&mut [f32], usize) {
        let at = self.at;
        self.at += n;
        let e = self.residuals.entry(self.bucket).or_default();
        let known = e.len().saturating_sub(at).min(n);
        if e.len() < at + n {
            e.resize(at + n, 0.0);
        }
        (&mut e[at..at + n], known)
    }

    /// [`AdoptedResidual::claim_known`] without the count.
    pub(crate) fn claim(&mut self, n: usize) -> &mut [f32] {
        self.claim_known(n).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_claim_consecutive_ranges_from_the_offset() {
        let mut a = AdoptedResidual::default();
        a.begin(4);
        let (e, known) = a.claim_known(3);
        assert_eq!(known, 0);
        e.copy_from_slice(&[1.0, 2.0, 3.0]);
        a.claim(2)[1] = 5.0;
        assert_eq!(a.residuals[&4], [1.0, 2.0, 3.0, 0.0, 5.0]);
        // A range of the bucket: the offset holds for one call only.
        a.set_offset(3);
        a.begin(4);
        let (e, known) = a.claim_known(2);
        assert_eq!(known, 2);
        assert_eq!(e, [0.0, 5.0]);
        a.begin(4);
        assert_eq!(a.claim(1), [1.0]);
        // Another bucket has its own residual.
        a.begin(5);
        assert_eq!(a.claim_known(2).1, 0);
        assert_eq!(a.residuals.len(), 2);
        // A claim past the end of what is known: the known prefix is counted.
        a.set_offset(4);
        a.begin(4);
        assert_eq!(a.claim_known(3), (&mut [5.0, 0.0, 0.0][..], 1));
    }
}
