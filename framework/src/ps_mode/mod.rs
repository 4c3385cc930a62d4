//! The trainer's parameter-server mode (`[cluster] mode = "ps"`): gradients go to servers
//! co-located with the workers instead of through an all-reduce.
//!
//! * Every rank is a worker; the first `cluster.servers` ranks (default: all) also serve one
//!   contiguous shard of the flat gradient each ([`dtrain_comms::ps`]).
//! * A step pushes the worker's gradient, one f32 shard per server; a server averages the
//!   workers' shards of a step in worker order ([`DenseF32`], mean) and every worker pulls the
//!   aggregate. Every worker applies **every** step's aggregate exactly once, in step order,
//!   with the learning rate of that step — so the replicas stay identical even when they run
//!   at different speeds; staleness only delays when a worker sees an aggregate.
//! * With `cluster.staleness = s > 0` (stale-synchronous parallel) a worker may push step `t`
//!   once the aggregates of every step `< t − s` have arrived, and applies whatever aggregates
//!   are ready after each push; its gradient may therefore be computed on parameters up to
//!   `s` updates old. The lock-step per-step control all-reduce is skipped (the step records
//!   carry the worker's own loss and accuracy), and a worker whose gradient is not finite
//!   pushes zeros for that step (counted as skipped) so that the servers' step clock goes on.
//! * Asynchrony acts like extra momentum (Mitliagkas et al., "Asynchrony begets momentum",
//!   2016): settings tuned for synchronous SGD with momentum 0.9 can diverge at staleness
//!   3 and more. Measured on the MNIST MLP (2 workers, lr 0.05, 50 steps): with momentum 0.9,
//!   s = 0 reaches 90.8 % and s = 1 diverges (35 %); without momentum s = 0 / 1 / 3 reach
//!   81.8 / 82.4 / 68.1 %. Lower the momentum (or the learning rate) as `s` grows.
//! * A method with a parameter-server protocol of its own ([`dtrain_compress::Method::sharded`],
//!   [`sharded`]) pushes its payloads and runs its servers: MIPD (ALGORITHMS.md §14) pushes
//!   per layer the most significant coordinates (`|w·g|` by default, so the push carries
//!   the parameters' view too) quantized with a Lloyd-Max code-book; each server smooths
//!   the coordinates nobody sent (`λ`) and returns only the step's alternating half of
//!   every layer. Coordinates outside the half get a zero gradient that step (with momentum
//!   they still move by their velocity). `error_feedback = true` adds the method's
//!   worker-side residual.
//! * Every other method except ScaleCom (whose leader-chosen indices need a broadcast
//!   among the workers) pushes its own payloads ([`COMPRESSED_MEAN`]): each worker runs the
//!   method's pipeline (its error-feedback memory included: residual, DGC's momentum
//!   correction, …) on each shard of its gradient, one bucket per shard, and the server
//!   decodes the workers' payloads of its shard with the method's decoder (the joint one
//!   where the method has it), sums them in worker order and returns the mean as f32. The
//!   push is compressed; the pull is dense. The memories and compressor states are part of
//!   the checkpoint, so a synchronous run resumes bit-identically.
//! * Each step record carries the seconds this rank's server spent aggregating.
//! * Checkpoints hold the replicas, the optimizer, the data position and every rank's
//!   parameter-server state: the compressed pushes' memories and compressor states; with a
//!   protocol of its own, the method's worker residual and the server state of the rank's
//!   shard (MIPD: smoothed values, the pushed gradients of the half not yet sent, the
//!   received marks). The servers' clock
//!   counts trainer steps, so a resumed run restarts it at the checkpoint's step and MIPD's
//!   alternating halves continue where they stopped: a synchronous run resumes
//!   bit-identically with every method.
//! * The parameter-server messages share the connections of the collectives
//!   ([`dtrain_comms::split_ps`]). Before an evaluation, a checkpoint and at the end of the run
//!   every worker drains the server — waits for and applies the aggregates
//!   of every step it pushed — so that the collectives there see identical replicas and no
//!   parameter-server traffic is in flight.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dtrain_comms::ps::{
    Aggregate, AggregateError, Aggregator, DenseF32, PsConfig, PsLayout, PsNode, Reduction,
    ShardPushes,
};
use dtrain_comms::{CommError, Transport};
use dtrain_compress::{
    decompress_sum_add, Compressor, CompressorConfig, Ctx, MemoryConfig, Payload, Pipeline, Rng,
};

use crate::config::ClusterConfig;
use dtrain_compress::sharded::{layers_in, ServerState};
use sharded::{ShardedAggregator, ShardedWorker};

pub mod sharded;

/// The servers' aggregator, timing itself (nanoseconds spent aggregating, for the metrics).
pub(crate) struct ServerAggregator {
    kind: ServerKind,
    spent_ns: Arc<AtomicU64>,
}

enum ServerKind {
    /// Mean of dense f32 shards.
    Dense(DenseF32),
    /// A method with its own protocol: its server of the shard (MIPD: decode, sum, smooth
    /// the dropped coordinates, send the step's half).
    Sharded(Box<ShardedAggregator>),
    /// Any other method: decode each worker's payload of the shard, mean as f32. Payloads
    /// are self-describing, so one decoder serves every shard.
    Compressed(Box<dyn Compressor>),
}

/// Reduction code of compressed pushes (any method but none, ScaleCom and those with a
/// protocol of their own): a
/// payload of the run's compression method per worker; the server decodes, sums in worker
/// order and returns the mean as f32.
pub const COMPRESSED_MEAN: Reduction = Reduction(17);

/// The mean of the workers' compressed payloads of one shard (see [`COMPRESSED_MEAN`]).
fn compressed_mean(c: &dyn Compressor, input: &ShardPushes<'_>) -> Result<Vec<u8>, AggregateError> {
    if input.aggregation != COMPRESSED_MEAN {
        return Err(AggregateError::unsupported(
            input,
            "a server of compressed pushes (expects COMPRESSED_MEAN)",
        ));
    }
    let mut acc = vec![0f32; input.range.len()];
    let payloads: Vec<&[u8]> = input.pushes.iter().map(|p| p.1).collect();
    decompress_sum_add(c, &payloads, &mut acc).map_err(|(i, e)| AggregateError {
        worker: input.pushes[i].0,
        detail: format!("shard {} payload: {e}", input.shard),
    })?;
    let inv = 1.0 / input.pushes.len().max(1) as f32;
    acc.iter_mut().for_each(|v| *v *= inv);
    c.combine().finish(&mut acc);
    Ok(dtrain_comms::ps::f32_payload(&acc))
}

impl Aggregator for ServerAggregator {
    fn aggregate(&mut self, input: &ShardPushes<'_>) -> Result<Vec<u8>, AggregateError> {
        let t = Instant::now();
        let r = match &mut self.kind {
            ServerKind::Dense(a) => a.aggregate(input),
            ServerKind::Sharded(a) => a.aggregate(input),
            ServerKind::Compressed(d) => compressed_mean(d.as_ref(), input),
        };
        self.spent_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }
}

/// How a worker encodes its pushes and decodes its pulls.
enum Codec {
    /// f32 shards, mean on the server.
    Dense,
    /// A method's own protocol (MIPD's payloads need the parameters: significance
    /// `|w·g|`); the pull is the sum over workers.
    Sharded {
        worker: Box<ShardedWorker>,
        /// The parameters a step's gradient was computed at, reused across steps.
        params: Vec<f32>,
    },
    /// The method's pipeline per shard (bucket id = shard index); the pull is the mean.
    Compressed {
        pipes: Vec<Pipeline>,
        /// Per shard: its tensors' boundaries, relative to the shard.
        segments: Vec<Vec<Range<usize>>>,
        seed: u64,
        rank: u32,
    },
}

/// The domain the shards' pipelines keep an adopted residual in (one method: all alike).
fn adopted_domain(pipes: &[Pipeline]) -> Option<String> {
    pipes
        .iter()
        .find_map(|p| p.adopted_feedback())
        .map(str::to_string)
}

/// A rank's parameter-server state for checkpoints ([`PsState::export_state`]). The
/// compressor states serialize exactly (IEEE bits, as the exchanger's); the memories and
/// MIPD's server vectors are large and travel as raw checkpoint sections instead.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct PsCodecState {
    /// Error-feedback memory per shard (keyed by shard index): the compressed pushes'
    /// pipelines, or MIPD's worker-side residual.
    #[serde(skip)]
    pub memory: BTreeMap<u64, Vec<f32>>,
    /// Compressor state per shard, where the compressor carries any.
    #[serde(with = "crate::exchange::bits::state_bits")]
    pub compressors: BTreeMap<u64, BTreeMap<String, f64>>,
    /// The domain of `memory` where the method keeps its residual itself
    /// ([`Pipeline::adopted_feedback`]: FFT's `spectra`); `None` for a signal residual, and
    /// in checkpoints written before the field existed, which held signal residuals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feedback_domain: Option<String>,
    /// A method with its own protocol: the shard this rank serves and its server state.
    #[serde(skip)]
    pub server: Option<(usize, ServerState)>,
}

/// One applied-or-to-apply aggregate: the mean gradient of a step.
#[derive(Debug)]
pub(crate) struct Ready {
    /// The trainer step whose gradients it averages.
    pub step: u64,
    /// The mean gradient (the whole model).
    pub grad: Vec<f32>,
}

/// Time and bytes of one push + pull.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct PsStats {
    /// Seconds encoding the gradient into shard payloads.
    pub encode_s: f64,
    /// Seconds inside the parameter server (push, serving, waiting for aggregates).
    pub communicate_s: f64,
    /// Seconds decoding the aggregates.
    pub decode_s: f64,
    /// Bytes sent meanwhile.
    pub bytes_sent: u64,
    /// Bytes received meanwhile.
    pub bytes_received: u64,
    /// Payload bytes this worker pushed.
    pub payload_bytes: u64,
    /// Seconds this rank's server spent aggregating since the previous step.
    pub server_s: f64,
}

/// A worker's parameter-server state (see the [module docs](self)).
pub(crate) struct PsState<T: Transport> {
    node: PsNode<T, ServerAggregator>,
    codec: Codec,
    workers: usize,
    server_ns: Arc<AtomicU64>,
    staleness: u64,
    /// The method's `kind`, for messages.
    method: &'static str,
}

impl<T: Transport> PsState<T> {
    /// Joins the parameter server of a run over `transport` (the parameter-server lane of
    /// the rank's connections) for a model whose parameter tensors lie at `layers` of the
    /// flat buffer, pushing with `method`: `none` pushes dense f32; a method with its own
    /// protocol ([`dtrain_compress::Method::sharded`]) its payloads (with a residual
    /// `memory`, its worker-side error feedback); any other method its
    /// own payloads through a pipeline with `memory` per shard, its RNG streams seeded by
    /// `seed`.
    pub fn new(
        transport: T,
        cluster: &ClusterConfig,
        method: &CompressorConfig,
        memory: &MemoryConfig,
        layers: Vec<Range<usize>>,
        seed: u64,
    ) -> Result<Self, CommError> {
        let world = transport.world_size();
        let len = layers.last().map_or(0, |l| l.end);
        let servers = cluster.servers.unwrap_or(world).clamp(1, world);
        let layout = PsLayout::new(world, (0..world).collect(), (0..servers).collect(), len)?;
        let cfg = PsConfig {
            timeout: Duration::from_secs_f64(cluster.timeout_s),
            staleness: cluster.staleness,
            ..PsConfig::default()
        };
        let bad = |e: dtrain_compress::ConfigError| {
            CommError::InvalidArgument(format!("compress.{}: {}", e.field, e.reason))
        };
        let (kind, codec) = match method {
            _ if method.sharded().is_some() => {
                let error_feedback = !matches!(memory, MemoryConfig::None);
                let w =
                    ShardedWorker::new(&layout, &layers, method, error_feedback).map_err(bad)?;
                let a = ShardedAggregator::new(&layout, layers.clone(), method).map_err(bad)?;
                (
                    ServerKind::Sharded(Box::new(a)),
                    Codec::Sharded {
                        worker: Box::new(w),
                        params: vec![0.0; len],
                    },
                )
            }
            _ if method.passthrough() => (ServerKind::Dense(DenseF32), Codec::Dense),
            _ => {
                let shards = layout.num_shards();
                let mut pipes = Vec::with_capacity(shards);
                for _ in 0..shards {
                    let mut c = method.build().map_err(bad)?;
                    c.set_world_size(world);
                    pipes.push(Pipeline::new(c, memory.build().map_err(bad)?));
                }
                // The tensors overlapping each shard, cut to it: per-tensor statistics.
                let segments = (0..shards)
                    .map(|j| layers_in(&layers, layout.shard_range(j)))
                    .collect();
                let mut decoder = method.build().map_err(bad)?;
                decoder.set_world_size(world);
                (
                    ServerKind::Compressed(decoder),
                    Codec::Compressed {
                        pipes,
                        segments,
                        seed,
                        rank: transport.rank() as u32,
                    },
                )
            }
        };
        let server_ns = Arc::new(AtomicU64::new(0));
        let agg = ServerAggregator {
            kind,
            spent_ns: server_ns.clone(),
        };
        let node = PsNode::new(transport, layout, cfg, agg)?;
        Ok(PsState {
            node,
            codec,
            workers: world,
            server_ns,
            staleness: cluster.staleness,
            method: method.name(),
        })
    }

    /// The method's `kind` (its own sections of a checkpoint are `ps/<kind>/…`).
    pub fn method(&self) -> &'static str {
        self.method
    }

    /// The staleness bound.
    pub fn staleness(&self) -> u64 {
        self.staleness
    }

    /// Restarts the parameter server's clock at trainer step `step` on this rank (a run
    /// resumed from a checkpoint of that step; every rank does the same before its first
    /// push). The servers' step numbers are the trainer's, so MIPD's alternating halves
    /// continue where they stopped.
    pub fn start_at(&mut self, step: u64) -> Result<(), CommError> {
        self.node.start_at(step)
    }

    /// What a checkpoint must hold of this rank's parameter-server state: per shard, the
    /// error-feedback memory and the compressor's state of compressed pushes; MIPD's
    /// worker residual and the server state of the shard this rank serves. Empty for dense
    /// pushes.
    pub fn export_state(&self) -> PsCodecState {
        let mut st = PsCodecState::default();
        match &self.codec {
            Codec::Compressed { pipes, .. } => {
                st.feedback_domain = adopted_domain(pipes);
                for (j, p) in pipes.iter().enumerate() {
                    st.memory.extend(p.export_memory());
                    let c = p.compressor().export_state();
                    if !c.is_empty() {
                        st.compressors.insert(j as u64, c);
                    }
                }
            }
            Codec::Sharded { worker, .. } => {
                st.memory = worker.export_memory();
                if let Some(ServerAggregator {
                    kind: ServerKind::Sharded(a),
                    ..
                }) = self.node.aggregator()
                {
                    st.server = a.export_state();
                }
            }
            Codec::Dense => {}
        }
        st
    }

    /// Restores [`PsState::export_state`] (same method and shard layout), before the first
    /// step.
    pub fn import_state(&mut self, mut st: PsCodecState) -> Result<(), String> {
        let shards = self.node.layout().num_shards();
        if let Some(k) =
            (st.memory.keys().chain(st.compressors.keys())).find(|&&k| k >= shards as u64)
        {
            return Err(format!(
                "the checkpoint has state for shard {k}, this run has {shards} shards"
            ));
        }
        match &mut self.codec {
            Codec::Compressed { pipes, .. } => {
                if st.server.is_some() {
                    return Err(format!(
                        "the checkpoint holds a parameter server's own state; this run \
                         pushes compressed payloads of {}",
                        self.method
                    ));
                }
                let ours = adopted_domain(pipes);
                if !st.memory.is_empty() && st.feedback_domain != ours {
                    let name = |d: &Option<String>| d.clone().unwrap_or_else(|| "signal".into());
                    return Err(format!(
                        "its error-feedback residuals of {} are kept as {}, this run keeps \
                         them as {} (compress.spectral_feedback selects FFT's domain): they \
                         would be misread",
                        self.method,
                        name(&st.feedback_domain),
                        name(&ours)
                    ));
                }
                for (j, p) in pipes.iter_mut().enumerate() {
                    let key = j as u64;
                    if let Some(m) = st.memory.remove(&key) {
                        p.import_memory(BTreeMap::from([(key, m)]));
                    }
                    if let Some(c) = st.compressors.remove(&key) {
                        p.compressor_mut()
                            .import_state(&c)
                            .map_err(|e| format!("shard {j} compressor state: {e}"))?;
                    }
                }
            }
            Codec::Sharded { worker, .. } => {
                if !st.compressors.is_empty() {
                    return Err(format!(
                        "the checkpoint holds compressor state of compressed pushes; this \
                         run pushes {}",
                        self.method
                    ));
                }
                worker.import_memory(std::mem::take(&mut st.memory))?;
                if let Some((shard, server)) = st.server.take() {
                    match self.node.aggregator_mut() {
                        Some(ServerAggregator {
                            kind: ServerKind::Sharded(a),
                            ..
                        }) => a.import_state(shard, server)?,
                        _ => {
                            return Err(format!(
                                "the checkpoint holds the {} server of shard {shard}; this \
                                 rank serves none",
                                self.method
                            ))
                        }
                    }
                }
            }
            Codec::Dense => {
                if !st.memory.is_empty() || !st.compressors.is_empty() || st.server.is_some() {
                    return Err(
                        "the checkpoint holds compressed-push state; this run pushes dense".into(),
                    );
                }
            }
        }
        Ok(())
    }

    fn ready(&self, aggs: Vec<Aggregate>) -> Result<Vec<Ready>, CommError> {
        aggs.into_iter()
            .map(|a| {
                let grad = match &self.codec {
                    Codec::Dense | Codec::Compressed { .. } => a.dense(),
                    Codec::Sharded { worker: w, .. } => {
                        let mut g = vec![0.0; self.node.layout().len()];
                        w.apply(&a, &mut g).map_err(|e| {
                            CommError::InvalidArgument(format!(
                                "{} aggregate of step {}: {e}",
                                self.method, a.step
                            ))
                        })?;
                        // The pull is the sum over workers; the trainer applies means.
                        let inv = 1.0 / self.workers as f32;
                        g.iter_mut().for_each(|v| *v *= inv);
                        g
                    }
                };
                Ok(Ready { step: a.step, grad })
            })
            .collect()
    }

    /// Pushes the gradient of trainer step `step` and returns the aggregates that are ready
    /// (exactly this step's when the bound is 0), in step order. `read_params` fills a
    /// buffer with the parameters the gradient was computed at; it is called only when the
    /// codec needs them (MIPD's significance).
    pub fn step(
        &mut self,
        step: u64,
        read_params: impl FnOnce(&mut [f32]),
        grad: &[f32],
    ) -> Result<(Vec<Ready>, PsStats), CommError> {
        let pushed = self.node.pushed();
        if pushed != step {
            return Err(CommError::InvalidArgument(format!(
                "parameter server at step {pushed} but the trainer pushes step {step}"
            )));
        }
        let before = self.node.transport().bytes();
        let t0 = Instant::now();
        let layout = self.node.layout().clone();
        let (payloads, aggregation): (Vec<Vec<u8>>, Reduction) = match &mut self.codec {
            Codec::Dense => (
                (0..layout.num_shards())
                    .map(|j| dtrain_comms::ps::f32_payload(&grad[layout.shard_range(j)]))
                    .collect(),
                Reduction::MEAN,
            ),
            Codec::Sharded { worker: w, params } => {
                if w.needs_params() {
                    read_params(params);
                }
                let p = w.payloads(params, grad).map_err(|e| {
                    CommError::InvalidArgument(format!("{} encode: {e}", self.method))
                })?;
                (p, w.reduction())
            }
            Codec::Compressed {
                pipes,
                segments,
                seed,
                rank,
            } => {
                let mut out = Vec::with_capacity(pipes.len());
                for (j, pipe) in pipes.iter_mut().enumerate() {
                    let ctx = Ctx {
                        step,
                        rank: *rank,
                        bucket: j as u64,
                        segments: &segments[j],
                    };
                    let mut rng = Rng::for_step(*seed, step, *rank as u64, j as u64);
                    let mut p = Payload::new();
                    pipe.compress(&grad[layout.shard_range(j)], &ctx, &mut rng, &mut p)
                        .map_err(|e| {
                            CommError::InvalidArgument(format!("compressing shard {j}: {e}"))
                        })?;
                    out.push(p.into_bytes());
                }
                (out, COMPRESSED_MEAN)
            }
        };
        let payload_bytes = payloads.iter().map(|p| p.len() as u64).sum();
        let t1 = Instant::now();
        let aggs = self.node.step(payloads, aggregation)?;
        let t2 = Instant::now();
        let ready = self.ready(aggs)?;
        let after = self.node.transport().bytes();
        Ok((
            ready,
            PsStats {
                encode_s: (t1 - t0).as_secs_f64(),
                communicate_s: (t2 - t1).as_secs_f64(),
                decode_s: t2.elapsed().as_secs_f64(),
                bytes_sent: after.sent - before.sent,
                bytes_received: after.received - before.received,
                payload_bytes,
                server_s: self.server_ns.swap(0, Ordering::Relaxed) as f64 * 1e-9,
            },
        ))
    }

    /// Waits for the aggregates of every step pushed so far (serving meanwhile) and returns
    /// those not returned before.
    pub fn drain(&mut self) -> Result<Vec<Ready>, CommError> {
        let pushed = self.node.pushed();
        if pushed == 0 {
            return Ok(Vec::new());
        }
        let aggs = self.node.pull(pushed - 1)?;
        self.ready(aggs)
    }

    /// Leaves the parameter server: returns the last aggregates and serves until every
    /// worker has left.
    pub fn finish(&mut self) -> Result<Vec<Ready>, CommError> {
        let aggs = self.node.finish()?;
        self.ready(aggs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::compress::parse_method;

    fn worker(method: &str) -> PsState<dtrain_comms::ChannelTransport> {
        let t = dtrain_comms::channel_mesh(1).pop().unwrap();
        let method = parse_method(method).unwrap();
        let layers = vec![0..3000, 3000..8192];
        PsState::new(
            t,
            &ClusterConfig::default(),
            &method,
            &MemoryConfig::RESIDUAL,
            layers,
            1,
        )
        .unwrap()
    }

    /// FFT keeps its residual as spectra: a parameter-server checkpoint holding signal
    /// residuals (written before the domain was recorded, or with `spectral_feedback =
    /// false`) is refused, not misread, and the other way round; each imports into its own.
    #[test]
    fn a_residual_of_the_other_domain_is_refused() {
        let (mut spectral, mut signal) = (worker("fft"), worker("fft:spectral_feedback=false"));
        let with_memory = |w: &PsState<_>| {
            let mut st = w.export_state();
            st.memory
                .insert(0, vec![0.25; w.node.layout().shard_range(0).len()]);
            st
        };
        let (a, b) = (with_memory(&spectral), with_memory(&signal));
        assert_eq!(a.feedback_domain.as_deref(), Some("spectra"));
        assert_eq!(b.feedback_domain, None);
        // An older checkpoint's JSON has no field: it reads as the signal domain.
        let old: PsCodecState = serde_json::from_str(r#"{"compressors":{}}"#).unwrap();
        assert_eq!(old.feedback_domain, None);
        let e = spectral.import_state(b.clone()).unwrap_err();
        assert!(
            e.contains("kept as signal") && e.contains("as spectra"),
            "{e}"
        );
        let e = signal.import_state(a.clone()).unwrap_err();
        assert!(e.contains("kept as spectra"), "{e}");
        spectral.import_state(a).unwrap();
        signal.import_state(b).unwrap();
    }
}
