//! The dense fast path: every bucket uncompressed, summed in place where it lies.

use std::ops::Range;
use std::time::Instant;

use dtrain_comms::topology::Topology;
use dtrain_comms::{CommError, Communicator, Transport};
use dtrain_compress::compressor::scale_has_non_finite;

use super::bucket::{self, Bucket};
use super::{ExchangeError, ExchangeStats, Exchanger};

/// The bucket's range of the flat gradient, if its parameters are consecutive there (always
/// so in [`bucket::plan`]'s buckets unless dense bypasses are interleaved with them).
pub(super) fn contiguous(b: &Bucket) -> Option<Range<usize>> {
    let r = &b.flat_ranges;
    let (first, last) = (r.first()?, r.last()?);
    r.windows(2)
        .all(|w| w[0].end == w[1].start)
        .then_some(first.start..last.end)
}

/// An uncompressed bucket's exchange on `data` where it lies (the bucket's own range of the
/// flat gradient when the bucket is contiguous there), with two ranks or more: the sum
/// all-reduce in place — hierarchically over `hosts` when given —, then the average. Bit-identical to the pipelined path's gather, sum
/// and scatter times `1/P` (the same sum, then the same product), without its two copies:
/// on the 535 k-parameter MLP they were ~0.3 ms of a 5–7 ms step. The averaging pass also
/// checks finiteness (a sum can overflow even when every rank's gradient is finite) and
/// sets `st.non_finite` to `Some(true)` on a NaN or an infinity.
pub(super) fn average_in_place<T: Transport>(
    comm: &mut Communicator<T>,
    data: &mut [f32],
    hosts: Option<&Topology>,
    st: &mut ExchangeStats,
) -> Result<(), CommError> {
    let t0 = Instant::now();
    match hosts {
        Some(h) => comm.hierarchical_all_reduce_sum(data, h)?,
        None => comm.all_reduce_sum(data)?,
    }
    let t1 = Instant::now();
    if scale_has_non_finite(data, 1.0 / comm.world_size() as f32) {
        st.non_finite = Some(true);
    }
    let comm_s = (t1 - t0).as_secs_f64();
    st.communicate_s += comm_s;
    st.wait_s += comm_s;
    st.decompress_s += t1.elapsed().as_secs_f64();
    Ok(())
}

impl Exchanger {
    /// Every bucket dense (uncompressed, or sent uncompressed by the automatic choice):
    /// nothing to overlap the collectives with, so no pipeline,
    /// no second thread, and a bucket that is one range of the flat gradient is summed and
    /// averaged right there (one rank: the gradient is already its average).
    pub(super) fn average_dense<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        grad: &mut [f32],
        st: &mut ExchangeStats,
    ) -> Result<(), ExchangeError> {
        st.payload_bytes += 4 * self.total as u64;
        if comm.world_size() == 1 {
            return Ok(());
        }
        st.non_finite = Some(false);
        let mut buf = self.spare.pop().unwrap_or_default();
        let hosts = self.hosts.as_deref();
        for slot in &self.slots {
            let b = &slot.bucket;
            let res = match &slot.range {
                Some(r) => average_in_place(comm, &mut grad[r.clone()], hosts, st),
                None => {
                    let t0 = Instant::now();
                    bucket::gather(b, grad, &mut buf.buf);
                    st.compress_s += t0.elapsed().as_secs_f64();
                    let res = average_in_place(comm, &mut buf.buf, hosts, st);
                    let t1 = Instant::now();
                    // (The average's finiteness was checked as it was made.)
                    let _ = bucket::scatter(b, &buf.buf, 1.0, grad);
                    st.decompress_s += t1.elapsed().as_secs_f64();
                    res
                }
            };
            res.map_err(|source| ExchangeError::Comm {
                bucket: b.id,
                source,
            })?;
        }
        self.spare.push(buf);
        Ok(())
    }
}
