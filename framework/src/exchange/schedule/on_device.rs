//! The ends of a bucket's exchange that stay on its device: the average decoded into the
//! device gradient (an all-gather's payloads, the compressed all-reduce's owner sums, the
//! sparse all-reduce's kept sum), and PowerSGD's agreement made on the device. Whatever
//! is not one of these ends on the host ([`Job::finish`]).

use std::time::Instant;

use dtrain_compress::{Combine, Ctx};

use super::{
    bucket, decode_err_of, DecodeFailure, ExchangeError, ExchangeStats, Flight, Job, Reply, Route,
    Slot, Stage,
};

/// A device decode's failure as the bucket `bucket`'s exchange error.
fn failed(bucket: u64) -> impl Fn(DecodeFailure) -> ExchangeError {
    move |e| match e {
        DecodeFailure::Wire(rank, w) => decode_err_of(bucket, rank, w),
        DecodeFailure::Device(reason) => ExchangeError::Device { bucket, reason },
    }
}

impl Job<'_> {
    /// Ends bucket `i`'s exchange (its flight `f`, the collective's `reply` for `stage`)
    /// on its device where it can, returning `None`; otherwise hands `f` and `reply` back
    /// for the host's end. `t0`: when the reply came (the decode time counts from there).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn finish_on_device(
        &mut self,
        i: usize,
        mut f: Flight,
        stage: &Stage,
        reply: Reply,
        grad: &mut [f32],
        st: &mut ExchangeStats,
        t0: Instant,
    ) -> Result<Option<(Flight, Reply)>, ExchangeError> {
        let Slot {
            bucket,
            pipe,
            server,
            route,
            range,
            device,
            ..
        } = &mut self.slots[i];
        let Some(d) = device.as_mut() else {
            return Ok(Some((f, reply)));
        };
        // A compressed bucket sent dense is averaged like an uncompressed one.
        let pipe = pipe.as_ref().filter(|_| *route != Route::Dense);
        let id = bucket.id;
        let ctx = Ctx {
            step: self.step,
            rank: self.rank as u32,
            bucket: id,
            segments: &bucket.segments,
        };
        let combine = pipe.map_or(Combine::Mean, |p| p.compressor().combine());
        let absorbs = pipe.is_some_and(|p| p.absorbs_aggregate(&ctx));
        // The average where it stays: the device gradient (with the mean there).
        let into = self.on_device.filter(|_| self.mean_on_device && !absorbs);
        let decoded = match (stage, reply) {
            // A summed agreement made on the device (PowerSGD): the summed lanes written
            // into this rank's payload, decoded there into the mean, which the codec's warm
            // start and the memory learn from; the mean goes into the device gradient (with
            // the mean there) or to the host.
            (Stage::Lanes, Reply::Sum(v)) if std::mem::take(&mut f.agreed_on_device) => {
                let p = pipe.expect("a device agreement has its pipeline");
                let fmt = p.compressor().lane_format();
                let bytes = f.payload.bytes_mut();
                let mut vals = v.iter().copied();
                for l in &f.lanes {
                    fmt.write(&mut vals, &mut bytes[l.clone()]);
                }
                f.lane = v;
                let to = self
                    .on_device
                    .filter(|_| self.mean_on_device)
                    .zip(range.clone());
                let on = to.is_some();
                let mean = d
                    .absorb_aggregate(f.payload.as_bytes(), self.inv, &ctx, bucket.len(), to)
                    .map_err(failed(id))?;
                if let (false, Some(mean)) = (on, mean) {
                    let bad = bucket::scatter(bucket, &mean, 1.0, grad);
                    st.non_finite = Some(st.non_finite.unwrap_or(false) | bad);
                }
                on
            }
            _ if f.agreed_on_device => {
                unreachable!("a device agreement ends with its summed lanes")
            }
            // The payloads of a bucket encoded from the device gradient, decoded into it.
            (Stage::Gathered, Reply::Gather(all)) if into.is_some() && range.is_some() => {
                let (g, r) = (into.expect("checked"), range.clone().expect("checked"));
                let refs: Vec<&[u8]> = all.iter().map(Vec::as_slice).collect();
                d.decode_mean_into(&refs, self.inv, g, r)
                    .map_err(failed(id))?;
                true
            }
            // The compressed all-reduce's owner sums, decoded into the bucket's range of
            // the device gradient and scaled there into the mean.
            (Stage::Compressed, Reply::Compressed(sums, shares, owner))
                if into.is_some() && range.is_some() && combine == Combine::Mean =>
            {
                let (g, r) = (into.expect("checked"), range.clone().expect("checked"));
                *server = Some(owner);
                f.shares = shares;
                d.decode_sums_into(&sums, &f.ranges, self.inv, g, r)
                    .map_err(failed(id))?;
                true
            }
            // A sparse all-reduce's sum kept sparse: its mean scattered into the bucket's
            // range of the device gradient (zeros elsewhere; the dense path's values bit
            // for bit).
            (_, Reply::SparseKept(idx, vals))
                if into.is_some() && range.is_some() && combine == Combine::Mean =>
            {
                let (g, r) = (into.expect("checked"), range.clone().expect("checked"));
                g.scatter_mean(r, &idx, &vals, self.inv)
                    .map_err(|reason| ExchangeError::Device { bucket: id, reason })?;
                true
            }
            (_, reply) => return Ok(Some((f, reply))),
        };
        if decoded {
            self.decoded_on_device[i] = true;
        }
        self.spare.push(f);
        st.decompress_s += t0.elapsed().as_secs_f64();
        Ok(None)
    }
}
