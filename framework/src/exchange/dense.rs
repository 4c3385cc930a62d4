//! The dense fast path: every bucket uncompressed, summed in place where it lies.

use std::ops::Range;
use std::time::Instant;

use dtrain_comms::topology::Topology;
use dtrain_comms::{CommError, Communicator, Transport};

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
/// flat gradient when the bucket is contiguous there), with two ranks or more: the
/// average, bit for bit the pipelined path's gather, sum and scatter times `1/P` (the same
/// sum, then the same product), without its two copies. The collective takes the product
/// and the finiteness check: flat, on its own passes over each chunk
/// ([`Communicator::all_reduce_mean`]; on issue #25's 4.2 M-parameter MLP a separate
/// averaging pass was 3 ms of a 73 ms step); hierarchically over `hosts`, in one pass
/// after the sum. Sets `st.non_finite` to `Some(true)` on a NaN or an infinity (a sum can
/// overflow even when every rank's gradient is finite).
pub(super) fn average_in_place<T: Transport>(
    comm: &mut Communicator<T>,
    data: &mut [f32],
    hosts: Option<&Topology>,
    st: &mut ExchangeStats,
) -> Result<(), CommError> {
    let t0 = Instant::now();
    let non_finite = match hosts {
        Some(h) => comm.hierarchical_all_reduce_mean(data, h)?,
        None => comm.all_reduce_mean(data)?,
    };
    if non_finite {
        st.non_finite = Some(true);
    }
    let comm_s = t0.elapsed().as_secs_f64();
    st.communicate_s += comm_s;
    st.wait_s += comm_s;
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
