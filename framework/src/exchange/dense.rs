//! The dense fast path: every bucket uncompressed, summed in place where it lies.

use std::ops::Range;
use std::time::Instant;

use dtrain_comms::topology::Topology;
use dtrain_comms::{CommError, Communicator, Transport};

use super::bucket::{self, Bucket, BucketPolicy, ParamInfo};
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
    /// nothing to overlap the collectives with, so no pipeline and no second thread. The
    /// gradient is averaged where it lies, range by range of the plan an uncompressed run
    /// with the same byte budget makes ([`dense_plan`]), not bucket by bucket: a run whose
    /// compressed buckets all went dense (their 1-D bypasses interleaved with them, so not
    /// contiguous) would otherwise copy them out and back — two passes over the gradient,
    /// 3–4 % of AlexNet-CIFAR's loopback step at 4 workers — and it now trains bit for bit
    /// as the uncompressed run. One rank: the gradient is already its average.
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
        let hosts = self.hosts.as_deref();
        for (id, r) in self.dense_plan.iter().enumerate() {
            average_in_place(comm, &mut grad[r.clone()], hosts, st).map_err(|source| {
                ExchangeError::Comm {
                    bucket: id as u64,
                    source,
                }
            })?;
        }
        Ok(())
    }
}

/// The ranges of the flat gradient that an uncompressed run's buckets cover: [`bucket::plan`]
/// with `policy`'s byte budget and no dense bypasses, whose buckets are runs of consecutive
/// parameters (each one range, in model order; bucket `i` of that plan is range `i`).
pub(super) fn dense_plan(params: &[ParamInfo], policy: &BucketPolicy) -> Vec<Range<usize>> {
    let uncompressed = BucketPolicy {
        dense_below: 0,
        dense_1d: false,
        ..policy.clone()
    };
    bucket::plan(params, &uncompressed)
        .iter()
        .map(|b| contiguous(b).expect("a plan without bypasses keeps its buckets contiguous"))
        .collect()
}
