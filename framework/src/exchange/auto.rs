//! `[compress] collective = "auto"` (the default): per compressed bucket, the cheapest way
//! to exchange it by the α–β model of [`dtrain_comms::cost`] — the model `dtrain simulate`
//! projects runs with and validates against emulated links.
//!
//! # The candidates
//! For a bucket of `n` elements on P ranks:
//!
//! | route | seconds predicted |
//! |---|---|
//! | dense (the bucket is not compressed) | the dense all-reduce of `4n` bytes — hierarchical over several hosts |
//! | all-gather | `all_gather(c)` + compress + decoding the P payloads into their sum |
//! | sparse all-reduce | `sparse_all_reduce(k, n, u = 1)` + compress + decompress + its own work (measured): a bucket's + per entry × `2(k + s)(P−1)/P` |
//! | compressed all-reduce | `compressed_all_reduce(c′)` + encode the P ranges + an owner's reduction of its range + decoding the P ranges' sums |
//! | the method's own collective where it is neither (summable lanes, a `Dense` method's all-reduce of the decoded values) | its cost + compress + decompress |
//!
//! `c` is the method's payload of the bucket, `c′` the sum of its P range payloads, `k` the
//! non-zeros of its decode (the sparse all-reduce's entries, with independent index sets:
//! the model's upper bound), `s = min(P·k, n)` the entries of the sum — all measured at
//! start-up on a synthetic gradient of the bucket's size and layer shapes (Gaussian,
//! σ = [`GRAD_SCALE`], as `dtrain bench allreduce --compress` uses), with a fresh compressor
//! of the method and the run's error-feedback memory (so "compress" includes decoding what
//! was sent into the residual); "compress" and "decompress" are the times that took (the
//! fastest of [`CODEC_RUNS`] runs).
//! "Decoding the P payloads" is timed too, on P copies of the payload, because a method with
//! a joint decoder (FFT: one inverse transform of the summed spectra) decodes P payloads in
//! far less than P times one. The compressed all-reduce's owner work is timed as it runs:
//! an owner's reduction of its range ([`Pipeline::reduce_shares`] on P shares: the joint
//! decode, the sum and the re-encoding with its own residual), and the decode of the P
//! range payloads into their ranges that every rank does with the owners' sums — the ranges
//! cut tensors into pieces, which a transform method pays for on both sides. The sparse all-reduce spends CPU on every entry
//! (delta-coding, merging the shares) that no byte count shows — on a fast link it costs more than the
//! bytes it saves — so its per-entry cost is measured too, by running two ranks' machines
//! in process on the decode's non-zeros and on none ([`sparse_seconds`]). A route the method
//! refuses (its config's check for that
//! collective) is not a candidate; two-phase methods (ScaleCom's agreement, PowerSGD's
//! summed factors) keep their own collective. The dense route is a candidate only for a
//! method that averages (not a vote) and whose memory does not own the optimizer's momentum
//! (DGC's): for those, sending a bucket uncompressed trains exactly like the uncompressed
//! run — "compress or not", per bucket.
//!
//! # The link
//! The run's emulated link (`[network]`, [`Exchanger::set_link`]) when it has one, else a
//! short probe: the ring all-reduce of two sizes (just above the recursive-doubling limit,
//! and 4 MiB), timed [`PROBE_RUNS`] times each after a warm-up, the fastest of each on every rank,
//! the slowest rank's figure of each agreed by an all-reduce (max); α and β follow from the
//! ring's model through the two points.
//!
//! # Identical on every rank
//! Every measured figure (link times, codec times, payload sizes, non-zeros) is agreed by
//! one all-reduce (max) before anything is predicted, so every rank computes the same
//! predictions from the same numbers and makes the same choice. The choice is kept in
//! checkpoints ([`ExchangerState::routes`](super::ExchangerState::routes)) and a resumed run
//! uses it instead of choosing again, so it continues bit for bit. With one rank there is
//! nothing to exchange: every bucket is compressed as configured (through the method's own
//! collective).

use std::collections::VecDeque;
use std::fmt;
use std::time::Instant;

use dtrain_comms::algo::sparse_allreduce::SparseAllReduce;
use dtrain_comms::algo::Machine;
use dtrain_comms::shaping::LinkSpec;
use dtrain_comms::wire::Message;
use dtrain_comms::{cost, CommError, Communicator, SparseVec, Transport};
use dtrain_compress::compressor::{decompress_add, decompress_sum_add};
use dtrain_compress::{Aggregation, Collective, Combine, Ctx, Payload, Pipeline, Rng, RunUse};

use super::schedule::Route;
use super::{ExchangeError, Exchanger, GatherCollective};
use crate::bench::exchange::GRAD_SCALE;
use crate::bench::gradient::{synthesize, Shape};

/// The compressed routes auto may take, in the order ties are broken.
const COMPRESSED: [GatherCollective; 3] = [
    GatherCollective::AllGather,
    GatherCollective::SparseAllReduce,
    GatherCollective::CompressedAllReduce,
];

/// Runs of the codec per bucket at start-up, the fastest counting. Where workers share
/// cores, each run lands in whatever time slices the scheduler gives it, and the fastest of
/// two was not steady: issue #22's loopback table (4 workers on 2 cores) measured one
/// bucket's all-gather at 9.3–13.4 ms over three start-ups, which flipped the choice.
pub const CODEC_RUNS: usize = 4;

/// Timed ring all-reduces per size of the link probe (after a warm-up), the fastest counting.
pub const PROBE_RUNS: usize = 5;

/// One way of exchanging a bucket and its predicted seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// How the bucket would travel.
    pub route: Route,
    /// The collective that is.
    pub collective: Collective,
    /// Predicted seconds of the bucket's exchange (communication and codec).
    pub seconds: f64,
}

/// What the automatic choice found for one compressed bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketChoice {
    /// Bucket id.
    pub bucket: u64,
    /// Its elements.
    pub elems: usize,
    /// The method's payload of the bucket in bytes (agreed over the ranks; 0 when not
    /// measured: one candidate).
    pub payload_bytes: f64,
    /// Every candidate, the chosen one first.
    pub candidates: Vec<Candidate>,
}

impl Candidate {
    /// The collective's name, marked `(uncompressed)` for the dense route of a compressed
    /// bucket.
    pub fn label(&self) -> String {
        match self.route {
            Route::Dense => format!("{} (uncompressed)", self.collective),
            Route::Compressed(_) => self.collective.to_string(),
        }
    }
}

impl BucketChoice {
    /// The candidate taken.
    pub fn chosen(&self) -> &Candidate {
        &self.candidates[0]
    }
}

/// The automatic choice of a run: the link it modelled and each compressed bucket's choice.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoReport {
    /// Ranks.
    pub world: usize,
    /// The link modelled.
    pub link: LinkSpec,
    /// Where it came from (`[network]`, or the probe's figures).
    pub link_source: String,
    /// The hierarchical all-reduce's hosts, when the dense route is hierarchical.
    pub hosts: Option<usize>,
    /// Per compressed bucket, in bucket order.
    pub buckets: Vec<BucketChoice>,
}

fn ms(s: f64) -> String {
    format!("{:.3} ms", s * 1e3)
}

impl fmt::Display for AutoReport {
    /// One line for the link, then one per bucket: `bucket 3 (1200000 elements, payload
    /// 600000 B): compressed-allreduce 1.310 ms (allgather 2.500 ms, allreduce 4.100 ms)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "compress.collective = \"auto\" on {} workers{}, link {}",
            self.world,
            self.hosts
                .map_or(String::new(), |h| format!(" ({h} hosts)")),
            self.link_source
        )?;
        for b in &self.buckets {
            let c = b.chosen();
            write!(
                f,
                "\n  bucket {} ({} elements, payload {:.0} B): {} {}",
                b.bucket,
                b.elems,
                b.payload_bytes,
                c.label(),
                ms(c.seconds)
            )?;
            let others: Vec<String> = b.candidates[1..]
                .iter()
                .map(|o| format!("{} {}", o.label(), ms(o.seconds)))
                .collect();
            if !others.is_empty() {
                write!(f, " ({})", others.join(", "))?;
            }
        }
        Ok(())
    }
}

/// What was measured of the method on one bucket (seconds and bytes; agreed over ranks).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Measured {
    /// Compressing the bucket.
    pub compress_s: f64,
    /// Decoding one payload of it.
    pub decompress_s: f64,
    /// Decoding P payloads of it into their sum, as the all-gather's receivers do (with the
    /// method's joint decoder where it has one).
    pub gather_decode_s: f64,
    /// The payload's bytes.
    pub payload: f64,
    /// Compressing it as P range payloads (the compressed all-reduce's worker side);
    /// infinite where the method could not.
    pub chunks_s: f64,
    /// Their bytes together.
    pub chunks_payload: f64,
    /// Non-zeros of the payload's decode.
    pub nonzeros: f64,
    /// The compressed all-reduce's owner side: reducing one range's P shares
    /// ([`Pipeline::reduce_shares`]); infinite where the method could not.
    pub owner_s: f64,
    /// Decoding the P range payloads into their ranges (what every rank does with the
    /// owners' sums); infinite where the method could not.
    pub ranges_decode_s: f64,
    /// Seconds a rank spends in the sparse all-reduce's own work on a bucket whatever its
    /// entries, and per entry (encoding and decoding them, merging shares): what the byte
    /// model does not see ([`sparse_seconds`]); infinite where it could not be measured.
    pub sparse_base_s: f64,
    /// See [`Measured::sparse_base_s`].
    pub sparse_entry_s: f64,
}

impl Measured {
    const FIELDS: usize = 11;

    fn to_f32s(self) -> [f32; Self::FIELDS] {
        [
            self.compress_s,
            self.decompress_s,
            self.gather_decode_s,
            self.payload,
            self.chunks_s,
            self.chunks_payload,
            self.nonzeros,
            self.sparse_base_s,
            self.sparse_entry_s,
            self.owner_s,
            self.ranges_decode_s,
        ]
        .map(|x| x as f32)
    }

    fn from_f32s(v: &[f32]) -> Self {
        Measured {
            compress_s: v[0] as f64,
            decompress_s: v[1] as f64,
            gather_decode_s: v[2] as f64,
            payload: v[3] as f64,
            chunks_s: v[4] as f64,
            chunks_payload: v[5] as f64,
            nonzeros: v[6] as f64,
            sparse_base_s: v[7] as f64,
            sparse_entry_s: v[8] as f64,
            owner_s: v[9] as f64,
            ranges_decode_s: v[10] as f64,
        }
    }
}

/// Where the dense route goes: flat over `world` ranks, or among `hosts` leaders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Ranks.
    pub world: usize,
    /// Hosts of the hierarchical all-reduce (`None`: flat).
    pub hosts: Option<usize>,
}

/// Predicted seconds of exchanging a bucket of `elems` elements as `collective` on `link`
/// (see the [module docs](self) for the terms).
pub fn predict(
    collective: Collective,
    m: &Measured,
    elems: usize,
    link: &LinkSpec,
    layout: Layout,
) -> f64 {
    let p = layout.world;
    let pf = p as f64;
    let dense = 4.0 * elems as f64;
    let codec = m.compress_s + m.decompress_s;
    match collective {
        Collective::AllReduce | Collective::HierarchicalAllReduce | Collective::Dlcp => {
            match layout.hosts {
                Some(h) => cost::hierarchical_all_reduce(link, dense, h),
                None => cost::dense_all_reduce(link, dense, p),
            }
        }
        Collective::AllGather => {
            cost::all_gather(link, m.payload, p) + m.compress_s + m.gather_decode_s
        }
        Collective::SparseAllReduce => {
            // With independent index sets (the bytes' upper bound too): the sum has
            // `min(P·k, n)` entries; a rank encodes and decodes its shares and the reduced
            // ranges, `2(k + s)(P−1)/P` entries.
            let (k, n) = (m.nonzeros, elems as f64);
            let sum = (k * pf).min(n);
            let work = 2.0 * (k + sum) * (pf - 1.0) / pf;
            cost::sparse_all_reduce(link, k, n, 1.0, p)
                + codec
                + m.sparse_base_s
                + m.sparse_entry_s * work
        }
        Collective::CompressedAllReduce => {
            cost::compressed_all_reduce(link, m.chunks_payload, p)
                + m.chunks_s
                + m.owner_s
                + m.ranges_decode_s
        }
        Collective::Lanes => cost::dense_all_reduce(link, m.payload, p) + codec,
        Collective::BroadcastAllReduce => cost::broadcast_all_reduce(link, m.payload, p) + codec,
        Collective::ParameterServer => link.predict_parameter_server(m.payload, p, p) + codec,
    }
}

/// Orders `candidates` by predicted seconds, the cheapest first; ties keep their order.
pub fn rank_candidates(candidates: &mut [Candidate]) {
    candidates.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
}

/// Measures the ring all-reduce of two sizes and fits α and β (see the [module
/// docs](self)); every rank gets the same link.
pub fn probe_link<T: Transport>(
    comm: &mut Communicator<T>,
) -> Result<(LinkSpec, String), CommError> {
    let p = comm.world_size();
    let small = (comm.config().small_all_reduce_bytes / 4 + 1).max(1 << 12);
    let large = (1usize << 20).max(2 * small);
    let mut times = [0f32; 2];
    for (t, n) in times.iter_mut().zip([small, large]) {
        let mut v = vec![0f32; n];
        comm.all_reduce_sum(&mut v)?;
        let mut best = f64::INFINITY;
        for _ in 0..PROBE_RUNS {
            let t0 = Instant::now();
            comm.all_reduce_sum(&mut v)?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        *t = best as f32;
    }
    comm.all_reduce_max(&mut times)?;
    let (ta, tb) = (times[0] as f64, times[1] as f64);
    let steps = 2.0 * (p as f64 - 1.0);
    let share = steps / p as f64;
    let (a, b) = (4.0 * small as f64, 4.0 * large as f64);
    let bandwidth = (tb > ta).then(|| share * (b - a) / (tb - ta));
    let serial = bandwidth.map_or(0.0, |bw| share * a / bw);
    let alpha = ((ta - serial) / steps).max(0.0);
    let link = LinkSpec {
        bandwidth,
        latency: std::time::Duration::from_secs_f64(alpha),
    };
    let source = format!(
        "measured {} GB/s, {:.1} µs (ring all-reduce of {a:.0} B in {:.3} ms and {b:.0} B in \
         {:.3} ms)",
        bandwidth.map_or("unlimited".into(), |bw| format!("{:.3}", bw / 1e9)),
        alpha * 1e6,
        ta * 1e3,
        tb * 1e3
    );
    Ok((link, source))
}

/// The sparse all-reduce's own work on this machine, as `(base, per entry)` seconds of one
/// rank: the machines of two ranks run to completion in process (no transport, FIFO
/// delivery), once on an empty input of `dense`'s dimension (`base`: what a bucket costs
/// whatever its entries — chunk bookkeeping, the dense result) and once on the non-zeros of
/// `dense`; at P = 2 with equal index sets each rank encodes and decodes `2k` entries, so the
/// per-entry cost is the difference over `4k`. Infinite when it cannot be measured (a bucket
/// beyond the sparse vectors' dimension).
pub fn sparse_seconds(dense: &[f32], chunk_elems: usize) -> (f64, f64) {
    let unmeasured = (f64::INFINITY, f64::INFINITY);
    let (Ok(v), Ok(empty)) = (
        SparseVec::from_dense(dense),
        SparseVec::new(dense.len(), Vec::new(), Vec::new()),
    ) else {
        return unmeasured;
    };
    let run = |input: &SparseVec| -> Option<f64> {
        let t0 = Instant::now();
        let mut ms = [0, 1].map(|r| SparseAllReduce::new(r, 2, 0, input.as_slice(), chunk_elems));
        let mut queue: VecDeque<(usize, usize, Message)> = VecDeque::new();
        loop {
            for (from, m) in ms.iter_mut().enumerate() {
                while let Some((to, msg)) = m.poll_transmit() {
                    queue.push_back((from, to, msg));
                }
            }
            let Some((from, to, msg)) = queue.pop_front() else {
                break;
            };
            ms[to].handle(from, msg).ok()?;
        }
        let mut out = vec![0f32; input.dim()];
        for m in &ms {
            if !m.is_done() {
                return None;
            }
            m.write_dense(&mut out);
        }
        Some(t0.elapsed().as_secs_f64())
    };
    match (run(&empty), run(&v)) {
        (Some(t0), Some(t1)) => {
            let per_entry = match v.nnz() {
                0 => 0.0,
                k => (t1 - t0).max(0.0) / (4 * k) as f64,
            };
            (t0 / 2.0, per_entry)
        }
        _ => unmeasured,
    }
}

/// The figures of `pipe`'s method on a synthetic gradient of one bucket (`shapes` its
/// parameters, `segments` their ranges), with a fresh compressor of the method and the run's
/// error-feedback memory built by `build`; `world` ranks. The memory is part of the cost:
/// it decodes what was sent, and for the compressed all-reduce that is P range payloads,
/// whose pieces of tensors (cut at the ranges' boundaries) can cost a transform method far
/// more than the whole tensors.
fn measure_codec(
    build: &dyn Fn() -> Result<Pipeline, ExchangeError>,
    id: u64,
    shapes: &[Vec<usize>],
    segments: &[std::ops::Range<usize>],
    (world, chunk_elems): (usize, usize),
    seed: u64,
) -> Result<Measured, ExchangeError> {
    let n: usize = segments.iter().map(|s| s.len()).sum();
    let mut grad = synthesize(Shape::Gaussian, n, seed ^ id.wrapping_mul(0x9e37_79b9));
    grad.iter_mut().for_each(|g| *g *= GRAD_SCALE);
    let ctx = Ctx {
        step: 0,
        rank: 0,
        bucket: id,
        segments,
    };
    let err = |source| ExchangeError::Compress { bucket: id, source };
    let mut pipe = build()?;
    pipe.compressor_mut().set_segment_shapes(shapes);
    pipe.compressor_mut().set_world_size(world);
    let mut payload = Payload::new();
    let mut out = vec![0f32; n];
    let mut m = Measured {
        compress_s: f64::INFINITY,
        decompress_s: f64::INFINITY,
        gather_decode_s: f64::INFINITY,
        chunks_s: f64::INFINITY,
        owner_s: f64::INFINITY,
        ranges_decode_s: f64::INFINITY,
        ..Measured::default()
    };
    let ranges: Vec<_> = (0..world)
        .map(|q| dtrain_comms::segment_range(n, world, q))
        .collect();
    let mut shares = Vec::new();
    // Built as the exchanger builds its owners' pipelines (with the workers' memory here).
    let mut owner = build()?;
    let mut owner_segs = Vec::new();
    dtrain_compress::chunk_segments(segments, ranges[0].clone(), &mut owner_segs);
    let mut owner_out = Payload::new();
    let mut ranges_out = Vec::new();
    if Collective::chunkable(pipe.compressor()) {
        ranges_out.resize(n, 0.0);
    }
    // The fastest of CODEC_RUNS runs counts (the first also warms caches and allocations).
    for _ in 0..CODEC_RUNS {
        let mut rng = Rng::for_step(seed, 0, 0, id);
        let t0 = Instant::now();
        pipe.compress(&grad, &ctx, &mut rng, &mut payload)
            .map_err(err)?;
        m.compress_s = m.compress_s.min(t0.elapsed().as_secs_f64());
        out.fill(0.0);
        let t0 = Instant::now();
        decompress_add(pipe.compressor(), payload.as_bytes(), &mut out).map_err(|source| {
            ExchangeError::Decode {
                rank: 0,
                bucket: id,
                source,
            }
        })?;
        m.decompress_s = m.decompress_s.min(t0.elapsed().as_secs_f64());
        out.fill(0.0);
        let all = vec![payload.as_bytes(); world];
        let t0 = Instant::now();
        decompress_sum_add(pipe.compressor(), &all, &mut out).map_err(|(rank, source)| {
            ExchangeError::Decode {
                rank,
                bucket: id,
                source,
            }
        })?;
        m.gather_decode_s = m.gather_decode_s.min(t0.elapsed().as_secs_f64());
        if Collective::chunkable(pipe.compressor()) {
            let t0 = Instant::now();
            // A method that cannot encode these ranges cannot take the compressed
            // all-reduce here: its cost stays infinite (alike on every rank: the data and
            // the ranges are).
            let chunked = pipe.compress_chunks(&grad, &ctx, &ranges, &mut rng, &mut shares);
            if chunked.is_ok() {
                m.chunks_s = m.chunks_s.min(t0.elapsed().as_secs_f64());
                // The owner of range 0 with P shares of it (this rank's, P times).
                let all = vec![shares[0].as_bytes(); world];
                let owner_ctx = Ctx {
                    segments: &owner_segs,
                    ..ctx
                };
                let t0 = Instant::now();
                let reduced = owner.reduce_shares(
                    &all,
                    ranges[0].len(),
                    &owner_ctx,
                    &mut rng,
                    &mut owner_out,
                );
                if reduced.is_ok() {
                    m.owner_s = m.owner_s.min(t0.elapsed().as_secs_f64());
                }
                // The P sums, stood in for by the P shares: each decoded into its range.
                ranges_out.fill(0.0);
                let t0 = Instant::now();
                let decoded = shares.iter().zip(&ranges).try_for_each(|(sh, r)| {
                    decompress_add(pipe.compressor(), sh.as_bytes(), &mut ranges_out[r.clone()])
                });
                if decoded.is_ok() {
                    m.ranges_decode_s = m.ranges_decode_s.min(t0.elapsed().as_secs_f64());
                }
            }
        }
    }
    m.payload = payload.encoded_len() as f64;
    m.chunks_payload = shares
        .iter()
        .map(|s: &Payload| s.encoded_len() as f64)
        .sum();
    m.nonzeros = out.iter().filter(|v| v.to_bits() != 0).count() as f64;
    (m.sparse_base_s, m.sparse_entry_s) = match pipe.compressor().aggregation() {
        Aggregation::Gather => sparse_seconds(&out, chunk_elems),
        _ => (f64::INFINITY, f64::INFINITY),
    };
    Ok(m)
}

impl Exchanger {
    /// The routes a compressed bucket may take under [`GatherCollective::Auto`] (see the
    /// [module docs](self)), each with its collective; the method's own collective first.
    fn auto_routes(&self, pipe: &Pipeline) -> Vec<(Route, Collective)> {
        let c = pipe.compressor();
        let two_phase = dtrain_compress::two_phase(c);
        let mut out: Vec<(Route, Collective)> = Vec::new();
        for g in COMPRESSED {
            let requested = g.fixed().expect("a fixed collective");
            let allowed = self
                .method_cfg
                .check(&RunUse {
                    collective: requested,
                    parameter_server: false,
                    memory: &self.memory,
                })
                .is_ok();
            let collective = Collective::of(c, requested);
            if allowed && !out.iter().any(|(_, k)| *k == collective) {
                out.push((Route::Compressed(g), collective));
            }
            if two_phase {
                break;
            }
        }
        if !two_phase && c.combine() == Combine::Mean && !self.memory.owns_momentum() {
            out.push((Route::Dense, self.collective_of(None, Route::Dense)));
        }
        out
    }

    /// Chooses every compressed bucket's route (see the [module docs](self)); every rank
    /// must call it at the same point of its sequence of collectives (the first exchange
    /// does, when the choice is still to be made). Returns what it measured and chose,
    /// which [`Exchanger::auto_report`] keeps.
    pub fn choose_collectives<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
    ) -> Result<AutoReport, ExchangeError> {
        let world = comm.world_size();
        let comm_err = |source| ExchangeError::Comm { bucket: 0, source };
        let layout = Layout {
            world,
            hosts: self.hierarchical_hosts(),
        };
        // Per compressed bucket: its routes (a choice to measure for when there are two).
        let plans: Vec<(usize, Vec<(Route, Collective)>)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.pipe.as_ref().map(|p| (i, self.auto_routes(p))))
            .collect();
        let choosing = world > 1 && plans.iter().any(|(_, r)| r.len() > 1);
        let (link, link_source) = match (self.link, choosing) {
            (_, false) if world == 1 => (LinkSpec::default(), "none (one worker)".to_string()),
            (_, false) => (
                LinkSpec::default(),
                "not needed (nothing to choose)".to_string(),
            ),
            (Some(l), true) => (l, "[network] (emulated)".to_string()),
            (None, true) => probe_link(comm).map_err(comm_err)?,
        };
        let (method, memory) = (self.method_cfg.clone(), self.memory);
        let build = || -> Result<Pipeline, ExchangeError> {
            let c = method
                .build()
                .map_err(|e| ExchangeError::State(format!("compress.{}: {}", e.field, e.reason)))?;
            let m = memory.build().map_err(|e| {
                ExchangeError::State(format!("compress.memory.{}: {}", e.field, e.reason))
            })?;
            Ok(Pipeline::new(c, m))
        };
        let chunk_elems = (comm.config().chunk_bytes / 4).max(1);
        let mut figures: Vec<f32> = Vec::new();
        for (i, routes) in &plans {
            if world > 1 && routes.len() > 1 {
                let s = &self.slots[*i];
                let m = measure_codec(
                    &build,
                    s.bucket.id,
                    &s.shapes,
                    &s.bucket.segments,
                    (world, chunk_elems),
                    self.seed,
                )?;
                figures.extend(m.to_f32s());
            }
        }
        if !figures.is_empty() {
            comm.all_reduce_max(&mut figures).map_err(comm_err)?;
        }
        let mut figures = figures.chunks_exact(Measured::FIELDS);
        let mut buckets = Vec::new();
        for (i, routes) in plans {
            let s = &mut self.slots[i];
            let (id, elems) = (s.bucket.id, s.bucket.len());
            let (measured, mut candidates) = if world > 1 && routes.len() > 1 {
                let m = Measured::from_f32s(figures.next().expect("one set per bucket"));
                let c: Vec<Candidate> = routes
                    .iter()
                    .map(|&(route, collective)| Candidate {
                        route,
                        collective,
                        seconds: predict(collective, &m, elems, &link, layout),
                    })
                    .collect();
                (m, c)
            } else {
                let (route, collective) = routes[0];
                let c = Candidate {
                    route,
                    collective,
                    seconds: 0.0,
                };
                (Measured::default(), vec![c])
            };
            rank_candidates(&mut candidates);
            s.route = candidates[0].route;
            buckets.push(BucketChoice {
                bucket: id,
                elems,
                payload_bytes: measured.payload,
                candidates,
            });
        }
        self.auto_pending = false;
        let report = AutoReport {
            world,
            link,
            link_source,
            hosts: layout.hosts,
            buckets,
        };
        self.auto_report = Some(report.clone());
        Ok(report)
    }

    /// What the automatic choice measured and chose, once it was made in this process
    /// (`None` before, with a fixed collective, or after a restore brought the choice).
    pub fn auto_report(&self) -> Option<&AutoReport> {
        self.auto_report.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(payload: f64) -> Measured {
        Measured {
            compress_s: 2e-3,
            decompress_s: 1e-3,
            gather_decode_s: 2e-3,
            payload,
            chunks_s: 2e-3,
            chunks_payload: payload,
            nonzeros: 4e6,
            sparse_base_s: 1e-3,
            sparse_entry_s: 1e-8,
            owner_s: 1.5e-3,
            ranges_decode_s: 1e-3,
        }
    }

    fn best(link: &LinkSpec, m: &Measured, world: usize) -> Collective {
        let mut c: Vec<Candidate> = [
            Collective::AllGather,
            Collective::CompressedAllReduce,
            Collective::SparseAllReduce,
            Collective::AllReduce,
        ]
        .iter()
        .map(|&collective| Candidate {
            route: Route::Dense,
            collective,
            seconds: predict(
                collective,
                m,
                4_000_000,
                link,
                Layout { world, hosts: None },
            ),
        })
        .collect();
        rank_candidates(&mut c);
        c[0].collective
    }

    #[test]
    fn a_slow_link_compresses_a_fast_one_sends_dense() {
        // 4-bit QSGD of 4 M elements: 2 MB against 16 MB dense.
        let m = measured(2e6);
        let slow = LinkSpec::parse(Some("100Mbit"), Some("100us")).unwrap();
        // P = 2: one round of the all-gather beats two of the compressed all-reduce.
        assert_eq!(best(&slow, &m, 2), Collective::AllGather);
        // P = 8: the all-gather's 7 payloads lose to about 2.
        assert_eq!(best(&slow, &m, 8), Collective::CompressedAllReduce);
        // A link where 16 MB take less than the codec's 3 ms: compressing does not pay.
        let fast = LinkSpec::parse(Some("200Gbit"), Some("1us")).unwrap();
        assert_eq!(best(&fast, &m, 8), Collective::AllReduce);
    }

    #[test]
    fn the_all_gather_is_charged_its_measured_decode_of_p_payloads() {
        // FFT decodes P payloads with one inverse transform: its all-gather is charged what
        // that took, not P separate decodes (which favoured the compressed all-reduce).
        let link = LinkSpec::parse(Some("100Mbit"), Some("100us")).unwrap();
        let layout = Layout {
            world: 4,
            hosts: None,
        };
        let at = |gather_decode_s| {
            let m = Measured {
                gather_decode_s,
                ..measured(1e6)
            };
            predict(Collective::AllGather, &m, 4_000_000, &link, layout)
        };
        let (joint, separate) = (at(12e-3), at(40e-3));
        assert!(
            (separate - joint - 28e-3).abs() < 1e-9,
            "{joint} {separate}"
        );
    }

    #[test]
    fn the_dense_route_is_hierarchical_over_several_hosts() {
        let link = LinkSpec::parse(Some("1Gbit"), Some("50us")).unwrap();
        let dense = |hosts| {
            let layout = Layout { world: 8, hosts };
            predict(
                Collective::AllReduce,
                &Measured::default(),
                1 << 20,
                &link,
                layout,
            )
        };
        let bytes = 4.0 * (1 << 20) as f64;
        assert_eq!(dense(None), link.predict_all_reduce(bytes, 8));
        assert_eq!(dense(Some(2)), link.predict_all_reduce(bytes, 2));
        assert!(dense(Some(2)) < dense(None));
    }

    #[test]
    fn the_sparse_all_reduce_pays_for_its_entries() {
        // 1 % of 1 M elements on two ranks: the base cost and the per-entry cost are both
        // there, and more entries cost more.
        let sparse: Vec<f32> = (0..1 << 20)
            .map(|i| if i % 100 == 0 { 1.0 } else { 0.0 })
            .collect();
        let (base, per_entry) = sparse_seconds(&sparse, 1 << 18);
        assert!(
            base.is_finite() && base >= 0.0 && per_entry.is_finite(),
            "{base} {per_entry}"
        );
        let m = |sparse_entry_s| Measured {
            sparse_entry_s,
            ..measured(2e6)
        };
        let link = LinkSpec::parse(Some("10Gbit"), Some("10us")).unwrap();
        let layout = Layout {
            world: 8,
            hosts: None,
        };
        let cheap = predict(Collective::SparseAllReduce, &m(0.0), 1 << 22, &link, layout);
        let dear = predict(
            Collective::SparseAllReduce,
            &m(1e-7),
            1 << 22,
            &link,
            layout,
        );
        // 4·10⁶ entries per rank, a sum as dense as the bucket: 2(k + n)(P − 1)/P entries.
        let work = 2.0 * (4e6 + (1u64 << 22) as f64) * 7.0 / 8.0;
        assert!((dear - cheap - 1e-7 * work).abs() < 1e-9, "{cheap} {dear}");
    }

    #[test]
    fn ties_keep_the_listed_order() {
        let mut c = vec![
            Candidate {
                route: Route::Compressed(GatherCollective::AllGather),
                collective: Collective::AllGather,
                seconds: 1.0,
            },
            Candidate {
                route: Route::Dense,
                collective: Collective::AllReduce,
                seconds: 1.0,
            },
        ];
        rank_candidates(&mut c);
        assert_eq!(c[0].collective, Collective::AllGather);
    }
}
