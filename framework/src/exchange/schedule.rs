//! The static bucket schedule of a compressed (or DLCP) exchange: per bucket gather,
//! compress, collective, decompress, average.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use dtrain_comms::algo::compressed_allreduce::SegmentReduce;
use dtrain_comms::topology::Topology;
use dtrain_comms::{segment_range, Communicator, Transport};
use dtrain_compress::compressor;
use dtrain_compress::memory::DlcpResidual;
use dtrain_compress::{
    chunk_segments, summable_lanes, Aggregation, Combine, Ctx, LaneFormat, Payload, Pipeline,
    ReduceError, Rng, Touched,
};

use super::bucket::{self, Bucket};
use super::device::{DecodeFailure, DeviceGradient, OnDevice};
use super::link::{comm_thread, Comms, Link, Op, Reply};
use super::{ExchangeError, ExchangeStats, Exchanger, GatherCollective, Lossy};

mod on_device;

pub(super) struct Slot {
    pub(super) bucket: Bucket,
    pub(super) pipe: Option<Pipeline>,
    /// The compressed all-reduce's owner side (its pipeline's memory: the server
    /// residual), while it is not travelling with a collective; kept with its buffers from
    /// step to step.
    pub(super) server: Option<Box<OwnerReduce>>,
    /// The bucket's range of the flat gradient when it is one ([`contiguous`]), fixed by
    /// the plan: an uncompressed bucket is then averaged in place.
    pub(super) range: Option<Range<usize>>,
    /// The shapes of the bucket's parameters (what its compressors were told).
    pub(super) shapes: Vec<Vec<usize>>,
    /// How the bucket travels.
    pub(super) route: Route,
    /// The bucket's encoder on a device ([`super::device`]), which then holds its memory;
    /// `None`: the host pipeline encodes.
    pub(super) device: Option<OnDevice>,
}

impl Slot {
    /// Whether an exchange of a device gradient encodes this bucket from it where it lies
    /// (`Exchanger::exchange_device`): a compressed route with a device encoder (only
    /// one-phase methods have one), and the bucket one range of the gradient.
    pub(super) fn reads_device(&self) -> bool {
        self.device.is_some()
            && self.pipe.is_some()
            && self.range.is_some()
            && matches!(self.route, Route::Compressed(_))
    }
}

/// How one bucket travels in an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// As dense f32 values: the all-reduce (hierarchical over several hosts), or DLCP.
    /// Uncompressed buckets always; a compressed one when the automatic choice found
    /// compressing it not worth its cost.
    Dense,
    /// Compressed by the method, its payloads through this collective (never
    /// [`GatherCollective::Auto`]; the method's aggregation has the last word, see
    /// [`dtrain_compress::Collective::of`]).
    Compressed(GatherCollective),
}

impl Route {
    /// A bucket's route before (or without) the automatic choice: a compressed bucket's
    /// payloads through `collective` (the all-gather for [`GatherCollective::Auto`], until
    /// it has chosen), an uncompressed bucket dense.
    pub(super) fn fixed(compressed: bool, collective: GatherCollective) -> Route {
        match (compressed, collective) {
            (false, _) => Route::Dense,
            (true, GatherCollective::Auto) => Route::Compressed(GatherCollective::AllGather),
            (true, g) => Route::Compressed(g),
        }
    }

    /// `dense`, or the collective's config spelling (as checkpoints record the route).
    pub fn name(self) -> &'static str {
        match self {
            Route::Dense => "dense",
            Route::Compressed(g) => g.name(),
        }
    }

    /// The route named `s` (see [`Route::name`]).
    pub fn parse(s: &str) -> Result<Route, String> {
        match s {
            "dense" => Ok(Route::Dense),
            _ => match s.parse::<GatherCollective>()? {
                GatherCollective::Auto => Err("\"auto\" is not a route".into()),
                g => Ok(Route::Compressed(g)),
            },
        }
    }
}

/// One bucket in flight: its buffers travel with it (and to the communication thread and
/// back); they return to a pool afterwards, so a steady-state step allocates little.
#[derive(Default)]
pub(super) struct Flight {
    /// The gathered gradient; then what goes into / comes out of a dense all-reduce.
    pub(super) buf: Vec<f32>,
    /// Sparse all-reduce input: indices of the decoded payload's non-zeros.
    pub(super) idx: Vec<u32>,
    /// Sparse all-reduce input: their values.
    pub(super) vals: Vec<f32>,
    /// `Summable`: the value lanes (f32) being all-reduced.
    pub(super) lane: Vec<f32>,
    /// The byte ranges of the lanes in `payload`.
    pub(super) lanes: Vec<Range<usize>>,
    pub(super) payload: Payload,
    /// A two-phase method's agreement message.
    pub(super) msg: Vec<u8>,
    /// Compressed all-reduce: this rank's payload of each owner's range.
    pub(super) shares: Vec<Payload>,
    /// Compressed all-reduce: the owners' ranges of the bucket, in rank order.
    pub(super) ranges: Vec<Range<usize>>,
    /// Payloads decoded in place as the mean (gathered, or a summable method's summed
    /// lanes): the elements their decodes added to.
    pub(super) touched: Touched,
    /// Whether this bucket's summed agreement runs on its device (PowerSGD's products
    /// there): its aggregate is then decoded and learnt from there too.
    pub(super) agreed_on_device: bool,
}

/// RNG stream bit of the compressed all-reduce's owner side (the workers' streams use the
/// bucket id alone).
const SERVER_STREAM: u64 = 1 << 63;

/// The owner's side of one bucket's compressed all-reduce, as it travels to the
/// communication thread and back: decode the P shares of this rank's range, sum, re-encode
/// with the server pipeline ([`Pipeline::reduce_shares`]).
pub(super) struct OwnerReduce {
    pub(super) pipe: Pipeline,
    /// Elements of this rank's range.
    len: usize,
    /// Its layer boundaries.
    segs: Vec<Range<usize>>,
    step: u64,
    rank: usize,
    bucket: u64,
    seed: u64,
    out: Payload,
}

impl OwnerReduce {
    /// The owner side of bucket `bucket` with pipeline `pipe` (run seed `seed`).
    pub(super) fn new(pipe: Pipeline, bucket: u64, seed: u64) -> Self {
        OwnerReduce {
            pipe,
            len: 0,
            segs: Vec::new(),
            step: 0,
            rank: 0,
            bucket,
            seed,
            out: Payload::new(),
        }
    }

    /// Prepares the reduction of `step` on `rank`, which owns `range` of a bucket whose
    /// layer boundaries are `segments`.
    fn prepare(&mut self, step: u64, rank: usize, range: Range<usize>, segments: &[Range<usize>]) {
        self.step = step;
        self.rank = rank;
        self.len = range.len();
        chunk_segments(segments, range, &mut self.segs);
    }
}

impl SegmentReduce for OwnerReduce {
    fn reduce(&mut self, shares: &[&[u8]]) -> Result<Vec<u8>, (usize, String)> {
        let ctx = Ctx {
            step: self.step,
            rank: self.rank as u32,
            bucket: self.bucket,
            segments: &self.segs,
        };
        let stream = self.bucket | SERVER_STREAM;
        let mut rng = Rng::for_step(self.seed, self.step, self.rank as u64, stream);
        let (bucket, rank) = (self.bucket, self.rank);
        self.pipe
            .reduce_shares(shares, self.len, &ctx, &mut rng, &mut self.out)
            .map_err(|e| match e {
                ReduceError::Share(q, w) => (
                    q,
                    format!(
                        "bucket {bucket}: its payload of rank {rank}'s range does not decode: {w}"
                    ),
                ),
                ReduceError::Compress(c) => (
                    rank,
                    format!("bucket {bucket}: the sum of rank {rank}'s range: {c}"),
                ),
            })?;
        Ok(self.out.as_bytes().to_vec())
    }
}

impl Exchanger {
    /// The compressed (or DLCP) exchange: per bucket gather, compress, collective,
    /// decompress, average, with the collectives on a second thread when overlapping.
    pub(super) fn pipelined<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        grad: &mut [f32],
        on_device: Option<&DeviceGradient>,
        step: u64,
        st: &mut ExchangeStats,
    ) -> Result<(), ExchangeError> {
        let (world, rank) = (comm.world_size(), comm.rank());
        let job = Job {
            slots: &mut self.slots,
            spare: &mut self.spare,
            lossy: self.lossy.as_ref(),
            lossy_residual: &mut self.lossy_residual,
            on_device,
            mean_on_device: self.mean_on_device,
            decoded_on_device: &mut self.decoded_on_device,
            hosts: self.hosts.clone(),
            seed: self.seed,
            step,
            rank,
            world,
            inv: 1.0 / world as f32,
        };
        // Overlap needs something to overlap with: two buckets and a peer.
        let (res, blocked, busy) = if self.overlap && job.slots.len() > 1 && world > 1 {
            let (jobs_tx, jobs_rx) = mpsc::channel();
            let (done_tx, done_rx) = mpsc::channel();
            std::thread::scope(|s| {
                let c = &mut *comm;
                s.spawn(move || comm_thread(c, jobs_rx, done_tx));
                let mut comms = Comms::<'_, T> {
                    link: Link::Thread {
                        jobs: jobs_tx,
                        done: done_rx,
                    },
                    blocked: 0.0,
                    busy: 0.0,
                };
                let res = job.run(&mut comms, grad, st);
                // Dropping the link closes the job channel: the thread finishes what was
                // submitted (on an error) and ends; the scope joins it.
                (res, comms.blocked, comms.busy)
            })
        } else {
            let mut comms = Comms {
                link: Link::Inline {
                    comm: &mut *comm,
                    done: VecDeque::new(),
                },
                blocked: 0.0,
                busy: 0.0,
            };
            let res = job.run(&mut comms, grad, st);
            (res, comms.blocked, comms.busy)
        };
        res?;
        st.wait_s = blocked;
        st.communicate_s = busy;
        Ok(())
    }
}

/// One exchange's compute side: the static bucket schedule.
struct Job<'a> {
    slots: &'a mut [Slot],
    spare: &'a mut Vec<Flight>,
    lossy: Option<&'a Lossy>,
    lossy_residual: &'a mut DlcpResidual,
    /// The gradient on the device, which the buckets that [`Slot::reads_device`] encode
    /// from (the host's `grad` holds the other buckets' ranges).
    on_device: Option<&'a DeviceGradient>,
    /// Whether the device buckets' averages are decoded into `on_device`, and which
    /// buckets were (by slot).
    mean_on_device: bool,
    decoded_on_device: &'a mut Vec<bool>,
    /// The hosts of a hierarchical dense all-reduce (`None`: flat).
    hosts: Option<Arc<Topology>>,
    seed: u64,
    step: u64,
    rank: usize,
    world: usize,
    inv: f32,
}

/// What the next collective result of a bucket is for.
enum Stage {
    /// Uncompressed bucket, or a `Dense` method: a dense sum.
    Dense,
    /// A two-phase method's agreement broadcast.
    Agreement,
    /// The all-reduce of the value lanes.
    Lanes,
    /// The all-gather of the payloads.
    Gathered,
    /// The sparse all-reduce of the decoded payloads.
    SparseSum,
    /// DLCP's bounded-loss all-reduce of a dense bucket.
    Lossy,
    /// The compressed all-reduce of the bucket's ranges.
    Compressed,
}

impl Job<'_> {
    fn run<T: Transport>(
        mut self,
        comms: &mut Comms<'_, T>,
        grad: &mut [f32],
        st: &mut ExchangeStats,
    ) -> Result<(), ExchangeError> {
        let n = self.slots.len();
        self.decoded_on_device.clear();
        self.decoded_on_device.resize(n, false);
        let mut flights: VecDeque<(Flight, Stage)> = VecDeque::new();
        if n > 0 {
            flights.push_back(self.start(0, comms, grad, st)?);
        }
        for i in 0..n {
            if matches!(flights[0].1, Stage::Agreement) {
                let (f, _) = flights.pop_front().expect("bucket i in flight");
                let next = self.agree(i, f, comms, st)?;
                flights.push_front(next);
            }
            if i + 1 < n {
                let next = self.start(i + 1, comms, grad, st)?;
                flights.push_back(next);
            }
            let (f, stage) = flights.pop_front().expect("bucket i in flight");
            self.finish(i, f, stage, comms, grad, st)?;
        }
        Ok(())
    }

    /// Phase one of bucket `i`: gather, then compress and submit its collective (or, for a
    /// two-phase method, compensate and submit the agreement broadcast).
    fn start<T: Transport>(
        &mut self,
        i: usize,
        comms: &mut Comms<'_, T>,
        grad: &[f32],
        st: &mut ExchangeStats,
    ) -> Result<(Flight, Stage), ExchangeError> {
        let t0 = Instant::now();
        let b0 = comms.blocked;
        let (step, rank, seed) = (self.step, self.rank, self.seed);
        let mut f = self.spare.pop().unwrap_or_default();
        let from_device = self.on_device.filter(|_| self.slots[i].reads_device());
        // A sparse all-reduce's sum of a bucket whose average is made on the device stays
        // sparse: its entries go up, not the dense bucket.
        let sum_to_device = from_device.is_some() && self.mean_on_device;
        let world = self.world;
        let Slot {
            bucket,
            pipe,
            server,
            route,
            range,
            device,
            ..
        } = &mut self.slots[i];
        let id = bucket.id;
        let gather = match *route {
            Route::Compressed(g) => Some(g),
            Route::Dense => None,
        };
        let pipe = pipe.as_mut().filter(|_| gather.is_some());
        // A compressed bucket that is one range of the gradient is compressed straight from
        // it (the compressors only read their input); the rest are gathered first.
        let input: &[f32] = match range.clone().filter(|_| pipe.is_some()) {
            Some(r) => &grad[r],
            None => {
                bucket::gather(bucket, grad, &mut f.buf);
                &f.buf
            }
        };
        let ctx = Ctx {
            step,
            rank: rank as u32,
            bucket: id,
            segments: &bucket.segments,
        };
        let compress_err = |source| ExchangeError::Compress { bucket: id, source };
        let stage = match pipe {
            None if self.lossy.is_some() => {
                let lossy = self.lossy.expect("checked");
                if lossy.error_feedback {
                    self.lossy_residual.add_back(id, &mut f.buf);
                }
                st.payload_bytes += 4 * f.buf.len() as u64;
                comms.submit(Op::Lossy(
                    std::mem::take(&mut f.buf),
                    lossy.tensors[&id].clone(),
                    lossy.cfg.clone(),
                ));
                Stage::Lossy
            }
            None => {
                st.payload_bytes += 4 * f.buf.len() as u64;
                let v = std::mem::take(&mut f.buf);
                comms.submit(match &self.hosts {
                    Some(h) => Op::HierarchicalSum(v, h.clone()),
                    None => Op::Sum(v),
                });
                Stage::Dense
            }
            Some(pipe) if pipe.summed_agreement(&ctx).is_some() => {
                // A summed agreement (PowerSGD's P): every rank's message, all-reduced. Its
                // size is not added to the payload bytes: the payload carries the agreed
                // factor again (it is self-contained), and that copy is what is counted.
                f.lane.clear();
                f.agreed_on_device = device.is_some();
                match device.as_mut() {
                    Some(d) => {
                        let from = from_device.zip(range.clone());
                        d.sum_message(input, from, world, &ctx, &mut f.lane)
                            .map_err(|reason| ExchangeError::Device { bucket: id, reason })?;
                    }
                    None => {
                        pipe.compensate(input, &ctx);
                        pipe.sum_message(&ctx, &mut f.lane).map_err(compress_err)?;
                    }
                }
                comms.submit(sum_in(
                    pipe.compressor().lane_format(),
                    std::mem::take(&mut f.lane),
                ));
                Stage::Agreement
            }
            Some(pipe) => match pipe.broadcast_root(&ctx) {
                Some(root) => {
                    pipe.compensate(input, &ctx);
                    f.msg.clear();
                    if root == rank {
                        pipe.broadcast_message(&ctx, &mut f.msg)
                            .map_err(compress_err)?;
                        st.payload_bytes += f.msg.len() as u64;
                    }
                    comms.submit(Op::Broadcast(std::mem::take(&mut f.msg), root));
                    Stage::Agreement
                }
                None if gather == Some(GatherCollective::CompressedAllReduce)
                    && server.is_some() =>
                {
                    let n = bucket.len();
                    f.ranges.clear();
                    f.ranges
                        .extend((0..self.world).map(|q| segment_range(n, self.world, q)));
                    let mut rng = Rng::for_step(seed, step, rank as u64, id);
                    match device.as_mut() {
                        Some(d) => d
                            .compress_chunks(
                                pipe.compressor(),
                                input,
                                from_device.zip(range.clone()),
                                &ctx,
                                &f.ranges,
                                &mut rng,
                                &mut f.shares,
                            )
                            .map_err(|reason| ExchangeError::Device { bucket: id, reason })?,
                        None => pipe
                            .compress_chunks(input, &ctx, &f.ranges, &mut rng, &mut f.shares)
                            .map_err(compress_err)?,
                    }
                    st.payload_bytes +=
                        f.shares.iter().map(|p| p.encoded_len() as u64).sum::<u64>();
                    let mut owner = server.take().expect("checked above");
                    owner.prepare(step, rank, f.ranges[rank].clone(), &bucket.segments);
                    comms.submit(Op::Compressed(
                        std::mem::take(&mut f.shares),
                        n as u32,
                        owner,
                    ));
                    Stage::Compressed
                }
                None => {
                    let mut rng = Rng::for_step(seed, step, rank as u64, id);
                    let device_err = |reason| ExchangeError::Device { bucket: id, reason };
                    match (device, from_device, range) {
                        (Some(d), Some(g), Some(r)) => d
                            .compress_range(
                                pipe.compressor(),
                                g,
                                r.clone(),
                                &ctx,
                                &mut rng,
                                &mut f.payload,
                            )
                            .map_err(device_err)?,
                        (Some(d), _, _) => d
                            .compress(pipe.compressor(), input, &ctx, &mut rng, &mut f.payload)
                            .map_err(device_err)?,
                        (None, _, _) => pipe
                            .compress(input, &ctx, &mut rng, &mut f.payload)
                            .map_err(compress_err)?,
                    }
                    let gather = gather.expect("a compressed route");
                    submit_payload(pipe, bucket, rank, gather, sum_to_device, &mut f, comms, st)?
                }
            },
        };
        st.compress_s += t0.elapsed().as_secs_f64() - (comms.blocked - b0);
        Ok((f, stage))
    }

    /// Phase two of a two-phase bucket: install the broadcast agreement, compress under it
    /// and submit the payload's collective.
    fn agree<T: Transport>(
        &mut self,
        i: usize,
        mut f: Flight,
        comms: &mut Comms<'_, T>,
        st: &mut ExchangeStats,
    ) -> Result<(Flight, Stage), ExchangeError> {
        let Slot {
            bucket,
            pipe,
            route,
            device,
            ..
        } = &mut self.slots[i];
        let Route::Compressed(gather) = *route else {
            unreachable!("only compressed buckets agree before compressing")
        };
        let id = bucket.id;
        let reply = match comms.wait() {
            Ok(r @ (Reply::Broadcast(_) | Reply::Sum(_))) => r,
            Ok(_) => unreachable!("replies come in submission order"),
            Err(source) => return Err(ExchangeError::Comm { bucket: id, source }),
        };
        let t0 = Instant::now();
        let b0 = comms.blocked;
        let mut rng = Rng::for_step(self.seed, self.step, self.rank as u64, id);
        let pipe = pipe.as_mut().expect("two-phase buckets are compressed");
        let ctx = Ctx {
            step: self.step,
            rank: self.rank as u32,
            bucket: id,
            segments: &bucket.segments,
        };
        let compress_err = |source| ExchangeError::Compress { bucket: id, source };
        match reply {
            Reply::Broadcast(msg) => {
                pipe.install_broadcast(&msg, &ctx).map_err(compress_err)?;
                f.msg = msg;
            }
            Reply::Sum(summed) if f.agreed_on_device => {
                let d = device.as_mut().expect("agreed on the bucket's device");
                d.encode_agreed(&summed, &ctx, &mut rng, &mut f.payload)
                    .map_err(|reason| ExchangeError::Device { bucket: id, reason })?;
                f.lane = summed;
            }
            Reply::Sum(summed) => {
                pipe.install_sum(&summed, &ctx).map_err(compress_err)?;
                f.lane = summed;
            }
            _ => unreachable!("matched above"),
        }
        if !f.agreed_on_device {
            pipe.compress_compensated(&ctx, &mut rng, &mut f.payload)
                .map_err(compress_err)?;
        }
        let stage = submit_payload(pipe, bucket, self.rank, gather, false, &mut f, comms, st)?;
        st.compress_s += t0.elapsed().as_secs_f64() - (comms.blocked - b0);
        Ok((f, stage))
    }

    /// Waits for bucket `i`'s last collective, decodes, averages and scatters into `grad`.
    fn finish<T: Transport>(
        &mut self,
        i: usize,
        f: Flight,
        stage: Stage,
        comms: &mut Comms<'_, T>,
        grad: &mut [f32],
        st: &mut ExchangeStats,
    ) -> Result<(), ExchangeError> {
        let id = self.slots[i].bucket.id;
        let reply = comms
            .wait()
            .map_err(|source| ExchangeError::Comm { bucket: id, source })?;
        let t0 = Instant::now();
        // The ends that stay on the device (`on_device.rs`).
        let Some((mut f, reply)) = self.finish_on_device(i, f, &stage, reply, grad, st, t0)? else {
            return Ok(());
        };
        let Slot {
            bucket,
            pipe,
            server,
            route,
            range,
            device,
            ..
        } = &mut self.slots[i];
        // A compressed bucket sent dense is averaged like an uncompressed one.
        let mut pipe = pipe.as_mut().filter(|_| *route != Route::Dense);
        let ctx = Ctx {
            step: self.step,
            rank: self.rank as u32,
            bucket: id,
            segments: &bucket.segments,
        };
        let combine = pipe
            .as_ref()
            .map_or(Combine::Mean, |p| p.compressor().combine());
        let absorbs = pipe.as_ref().is_some_and(|p| p.absorbs_aggregate(&ctx));
        // Decoded payloads of a bucket that is one range of the gradient, averaged by the
        // mean, are summed straight into that range and scaled there: no bucket-sized
        // buffer to zero, fill and copy back. (The same operations in the same order: the
        // result is bit for bit the buffered path's.)
        let in_place = range.clone().filter(|_| {
            combine == Combine::Mean
                && !absorbs
                && pipe.is_some()
                && matches!(stage, Stage::Compressed | Stage::Gathered | Stage::Lanes)
        });
        // Whether the in-place mean, when the decode wrote it already, is non-finite.
        let mut averaged = None;
        // Whether `f.buf` holds the mean already (not the sum).
        let mut buf_is_mean = false;
        let decode_err = |r: usize| {
            move |source| ExchangeError::Decode {
                rank: r,
                bucket: id,
                source,
            }
        };
        match (stage, reply, pipe.as_deref_mut()) {
            (Stage::Dense, Reply::Sum(v), _) => f.buf = v,
            (Stage::Lossy, Reply::Lossy(v, report), _) => {
                f.buf = v;
                st.lossy_dropped += report.dropped_elems_all as u64;
                st.lossy_elems += report.elems_all as u64;
                st.retransmitted += report.retransmitted as u64;
                if self.lossy.is_some_and(|l| l.error_feedback) && !report.dropped.is_empty() {
                    report.add_dropped_to(self.lossy_residual.dropped_mut(id, bucket.len()));
                }
            }
            (Stage::SparseSum, Reply::Sparse(v, idx, vals), _) => {
                f.buf = v;
                f.idx = idx;
                f.vals = vals;
            }
            (Stage::SparseSum, Reply::SparseKept(idx, vals), _) => {
                // (Kept sparse for a device that then did not take it: made dense here.)
                f.buf.clear();
                f.buf.resize(bucket.len(), 0.0);
                for (&i, &v) in idx.iter().zip(&vals) {
                    f.buf[i as usize] = v;
                }
                f.idx = idx;
                f.vals = vals;
            }
            (Stage::Lanes, Reply::Sum(v), Some(pipe)) => {
                let fmt = pipe.compressor().lane_format();
                let bytes = f.payload.bytes_mut();
                let mut vals = v.iter().copied();
                for l in &f.lanes {
                    fmt.write(&mut vals, &mut bytes[l.clone()]);
                }
                f.lane = v;
                if let Some(r) = &in_place {
                    // The summed payload's decode written as the mean where it lies:
                    // random-k's lanes touch 1 % of the range, so only that is scaled.
                    let out = &mut grad[r.clone()];
                    let one = [f.payload.as_bytes()];
                    let bad = pipe
                        .decompress_mean(&one, self.inv, out, &mut f.touched)
                        .map_err(|(_, e)| decode_err(self.rank)(e))?;
                    averaged = Some(bad);
                } else {
                    f.buf.clear();
                    f.buf.resize(bucket.len(), 0.0);
                    pipe.decompress_add(f.payload.as_bytes(), &mut f.buf)
                        .map_err(decode_err(self.rank))?;
                }
            }
            (Stage::Compressed, Reply::Compressed(sums, shares, owner), Some(pipe)) => {
                *server = Some(owner);
                f.shares = shares;
                let out = zeroed(in_place.as_ref(), bucket.len(), &mut f.buf, grad);
                for (q, (sum, range)) in sums.iter().zip(&f.ranges).enumerate() {
                    pipe.decompress_add(sum, &mut out[range.clone()])
                        .map_err(decode_err(q))?;
                }
            }
            (Stage::Gathered, Reply::Gather(all), Some(pipe)) => {
                // Rank order; a method with a joint decoder (FFT: one inverse transform of
                // the summed spectra) uses it — on the bucket's device where it has one
                // there (`[compress] device`: FFT's inverse transforms).
                let refs: Vec<&[u8]> = all.iter().map(Vec::as_slice).collect();
                let on_device = device
                    .as_mut()
                    .filter(|_| combine == Combine::Mean && !absorbs);
                let joint = on_device.and_then(|d| {
                    let out: &mut [f32] = match &in_place {
                        Some(r) => &mut grad[r.clone()],
                        None => {
                            f.buf.resize(bucket.len(), 0.0);
                            &mut f.buf
                        }
                    };
                    d.decode_mean(&refs, self.inv, out)
                });
                if let Some(done) = joint {
                    // A finite mean (a non-finite one is decoded again on the host below).
                    done.map_err(|e| match e {
                        DecodeFailure::Wire(r, w) => decode_err(r)(w),
                        DecodeFailure::Device(reason) => {
                            ExchangeError::Device { bucket: id, reason }
                        }
                    })?;
                    if in_place.is_some() {
                        averaged = Some(false);
                    } else {
                        buf_is_mean = true;
                    }
                } else if let Some(r) = &in_place {
                    // Written as the mean, scaling only what the decodes added to (a
                    // sparsifier's entries, not the whole range): bit for bit the zero
                    // fill, sum and scaling pass below.
                    let out = &mut grad[r.clone()];
                    let bad = pipe
                        .decompress_mean(&refs, self.inv, out, &mut f.touched)
                        .map_err(|(r, e)| decode_err(r)(e))?;
                    averaged = Some(bad);
                } else {
                    // The mean written into the buffer as it is where the bucket lies (in
                    // one pass by a joint or a dense decoder, no zero fill); the copy back
                    // below then does not scale again (its finiteness check stands for the
                    // mean's). Bit for bit the zero fill, the sum and the scaling copy.
                    f.buf.resize(bucket.len(), 0.0);
                    if combine == Combine::Mean && !absorbs {
                        pipe.decompress_mean(&refs, self.inv, &mut f.buf, &mut f.touched)
                            .map_err(|(r, e)| decode_err(r)(e))?;
                        buf_is_mean = true;
                    } else {
                        let out = zeroed(None, bucket.len(), &mut f.buf, grad);
                        pipe.decompress_sum_add(&refs, out)
                            .map_err(|(r, e)| decode_err(r)(e))?;
                    }
                }
            }
            _ => unreachable!("replies come in submission order"),
        }
        let bad = match (in_place, pipe) {
            // The sum is already where the average goes.
            (Some(r), _) => {
                averaged.unwrap_or_else(|| compressor::scale_has_non_finite(&mut grad[r], self.inv))
            }
            (None, Some(p)) if combine != Combine::Mean || absorbs => {
                f.buf.iter_mut().for_each(|v| *v *= self.inv);
                combine.finish(&mut f.buf);
                if absorbs {
                    // PowerSGD: the summed payload (its lanes rewritten with the sums)
                    // warm-starts the next step; its memory learns from the mean.
                    p.absorb_aggregate(f.payload.as_bytes(), &f.buf, &ctx);
                }
                bucket::scatter(bucket, &f.buf, 1.0, grad)
            }
            // Averaging fused into the copy back: one pass over the bucket instead of two.
            (None, _) => {
                let k = if buf_is_mean { 1.0 } else { self.inv };
                bucket::scatter(bucket, &f.buf, k, grad)
            }
        };
        // Every bucket passes here: the average's finiteness, checked as it is written, so
        // that the caller need not scan the gradient again ([`ExchangeStats::non_finite`]).
        st.non_finite = Some(st.non_finite.unwrap_or(false) | bad);
        self.spare.push(f);
        st.decompress_s += t0.elapsed().as_secs_f64();
        Ok(())
    }
}

/// A payload of rank `rank` in bucket `bucket` that did not decode.
fn decode_err_of(bucket: u64, rank: usize, source: dtrain_compress::WireError) -> ExchangeError {
    ExchangeError::Decode {
        rank,
        bucket,
        source,
    }
}

/// Where a bucket's decodes are summed: its range of `grad` when it is one (`in_place`),
/// else `buf` (`len` elements); zeroed.
fn zeroed<'a>(
    in_place: Option<&Range<usize>>,
    len: usize,
    buf: &'a mut Vec<f32>,
    grad: &'a mut [f32],
) -> &'a mut [f32] {
    match in_place {
        Some(r) => {
            let out = &mut grad[r.clone()];
            out.fill(0.0);
            out
        }
        None => {
            buf.clear();
            buf.resize(len, 0.0);
            buf
        }
    }
}

/// Submits the collective for the compressed payload in `f` by the method's aggregation.
#[allow(clippy::too_many_arguments)]
fn submit_payload<T: Transport>(
    pipe: &Pipeline,
    bucket: &Bucket,
    rank: usize,
    gather: GatherCollective,
    sum_to_device: bool,
    f: &mut Flight,
    comms: &mut Comms<'_, T>,
    st: &mut ExchangeStats,
) -> Result<Stage, ExchangeError> {
    st.payload_bytes += f.payload.encoded_len() as u64;
    let id = bucket.id;
    let own = |source| ExchangeError::Decode {
        rank,
        bucket: id,
        source,
    };
    Ok(match pipe.compressor().aggregation() {
        Aggregation::Dense => {
            // (A bucket compressed straight from the gradient left `f.buf` as it was.)
            f.buf.clear();
            f.buf.resize(bucket.len(), 0.0);
            pipe.decompress_add(f.payload.as_bytes(), &mut f.buf)
                .map_err(own)?;
            comms.submit(Op::Sum(std::mem::take(&mut f.buf)));
            Stage::Dense
        }
        Aggregation::Summable => {
            f.lanes = summable_lanes(pipe.compressor(), f.payload.as_bytes()).map_err(own)?;
            f.lane.clear();
            let fmt = pipe.compressor().lane_format();
            let bytes = f.payload.as_bytes();
            for l in &f.lanes {
                fmt.read(&bytes[l.clone()], &mut f.lane);
            }
            comms.submit(sum_in(fmt, std::mem::take(&mut f.lane)));
            Stage::Lanes
        }
        Aggregation::Gather if gather == GatherCollective::SparseAllReduce => {
            // Decode our own payload and hand its non-zeros (bitwise: −0.0 is kept, so the
            // sum is exactly the gathered path's) to the sparse all-reduce.
            // (A bucket compressed straight from the gradient left `f.buf` as it was.)
            f.buf.clear();
            f.buf.resize(bucket.len(), 0.0);
            pipe.decompress_add(f.payload.as_bytes(), &mut f.buf)
                .map_err(own)?;
            f.idx.clear();
            f.vals.clear();
            for (i, &v) in f.buf.iter().enumerate() {
                if v.to_bits() != 0 {
                    f.idx.push(i as u32);
                    f.vals.push(v);
                }
            }
            let (idx, vals) = (std::mem::take(&mut f.idx), std::mem::take(&mut f.vals));
            comms.submit(
                if sum_to_device && pipe.compressor().combine() == Combine::Mean {
                    Op::SparseKept(idx, vals, bucket.len())
                } else {
                    Op::Sparse(idx, vals, std::mem::take(&mut f.buf))
                },
            );
            Stage::SparseSum
        }
        Aggregation::Gather => {
            comms.submit(Op::Gather(f.payload.as_bytes().to_vec()));
            Stage::Gathered
        }
    })
}

/// The all-reduce that sums values of `fmt`: in `f32`, or in bfloat16.
fn sum_in(fmt: LaneFormat, v: Vec<f32>) -> Op {
    match fmt {
        LaneFormat::F32 => Op::Sum(v),
        LaneFormat::Bf16 => Op::SumBf16(v),
    }
}
