//! Methods with a parameter-server protocol of their own ([`dtrain_compress::sharded`],
//! MIPD's smoothing servers) over the push / pull machinery of [`dtrain_comms::ps`]: the
//! glue between the two, which know nothing of each other. Nothing here names a method.
//!
//! * [`ShardedAggregator`]: the server side, a [`dtrain_comms::ps::Aggregator`] that runs
//!   the method's [`ShardServer`] for the shard its rank serves. Pushes must carry the
//!   method's reduction code.
//! * [`ShardedWorker`]: the worker side for a trainer with a flat parameter buffer, a flat
//!   gradient buffer and known layer boundaries: one payload per shard
//!   ([`ShardedWorker::payloads`]), and the pulled aggregate decoded back into a flat
//!   buffer ([`ShardedWorker::apply`]).
//!
//! # Layers and shards
//! The PS shards the flat model into contiguous ranges ([`PsLayout::shard_range`]). A
//! layer that straddles two shards is split: each shard's encoder and server work on
//! `layers ∩ shard` ([`Shard::cut`]), so per-layer statistics (MIPD's code-books, keep
//! ratios, alternating halves) are per *piece* of a layer. Worker and server derive the
//! pieces from the same layer list and layout, so they always agree.
//!
//! # What a pull means
//! The aggregate of step `t` is the **sum** over workers of what the servers apply at
//! step `t` ([`ShardWorker::decode_pull`]); [`ShardedWorker::apply`] writes it into a flat
//! buffer. A trainer applies `params -= lr/P · agg`.

use std::collections::BTreeMap;
use std::ops::Range;

use dtrain_comms::ps::{
    Aggregate, AggregateError, Aggregator, PsLayout, PsNode, Reduction, ShardPushes,
};
use dtrain_comms::{CommError, Transport};
use dtrain_compress::compressor::effective_segments;
use dtrain_compress::sharded::{ServerState, Shard, ShardServer, ShardWorker, ShardedMethod};
use dtrain_compress::{CompressError, CompressorConfig, ConfigError, WireError};

fn check_layers(layout: &PsLayout, layers: &[Range<usize>]) -> Result<(), ConfigError> {
    effective_segments(layout.len(), layers)
        .map(|_| ())
        .map_err(|e| ConfigError::new("layers", e.to_string()))
}

/// The method's protocol, or an error naming the method that has none.
fn protocol(method: &CompressorConfig) -> Result<&dyn ShardedMethod, ConfigError> {
    method.sharded().ok_or_else(|| {
        ConfigError::new(
            "kind",
            format!(
                "{:?} has no parameter-server protocol of its own",
                method.name()
            ),
        )
    })
}

/// The shards of `layout` with the pieces of `layers`.
fn shards(layout: &PsLayout, layers: &[Range<usize>]) -> Vec<Shard> {
    Shard::cut(
        layers,
        (0..layout.num_shards()).map(|j| layout.shard_range(j)),
    )
}

/// The server of one shard of a method with its own protocol, as a PS [`Aggregator`] (see
/// the [module docs](self)). Its [`ShardServer`] is built on the first step, for the shard
/// the PS hands it.
#[derive(Debug)]
pub struct ShardedAggregator {
    layout: PsLayout,
    layers: Vec<Range<usize>>,
    method: CompressorConfig,
    reduction: Reduction,
    server: Option<(usize, Box<dyn ShardServer>)>,
    out: Vec<u8>,
}

impl ShardedAggregator {
    /// An aggregator for a model laid out in `layers` (contiguous, in order, tiling
    /// `0..layout.len()`; empty means one layer), running `method`'s servers. Errors when
    /// the method has no protocol of its own or its server configuration is invalid.
    pub fn new(
        layout: &PsLayout,
        layers: Vec<Range<usize>>,
        method: &CompressorConfig,
    ) -> Result<Self, ConfigError> {
        check_layers(layout, &layers)?;
        let p = protocol(method)?;
        // Build one server now, so that a bad configuration fails here, not mid-run.
        if let Some(s) = shards(layout, &layers).first() {
            p.server(s)?;
        }
        Ok(ShardedAggregator {
            layout: layout.clone(),
            reduction: Reduction(p.reduction()),
            layers,
            method: method.clone(),
            server: None,
            out: Vec::new(),
        })
    }

    /// The reduction code the pushes must carry.
    pub fn reduction(&self) -> Reduction {
        self.reduction
    }

    /// What a checkpoint must hold: the shard served and its server state (`None` before
    /// the first step).
    pub fn export_state(&self) -> Option<(usize, ServerState)> {
        self.server.as_ref().map(|(j, s)| (*j, s.export_state()))
    }

    /// Builds the server of `shard`.
    fn build(&self, shard: usize) -> Result<Box<dyn ShardServer>, String> {
        let s = Shard::cut(&self.layers, [self.layout.shard_range(shard)]).remove(0);
        protocol(&self.method)
            .and_then(|p| p.server(&s))
            .map_err(|e| e.to_string())
    }

    /// Restores [`ShardedAggregator::export_state`]: the server of `shard` continues from
    /// `state` (its next step is `state.next_step`, which the parameter server's clock must
    /// match). Errors if the shard does not exist or the state does not fit it.
    pub fn import_state(&mut self, shard: usize, state: ServerState) -> Result<(), String> {
        if shard >= self.layout.num_shards() {
            return Err(format!(
                "{} server state of shard {shard}; this run has {} shards",
                self.method.name(),
                self.layout.num_shards()
            ));
        }
        let mut server = self.build(shard)?;
        server
            .import_state(state)
            .map_err(|e| format!("{} server of shard {shard}: {e}", self.method.name()))?;
        self.server = Some((shard, server));
        Ok(())
    }
}

impl Aggregator for ShardedAggregator {
    fn aggregate(&mut self, input: &ShardPushes<'_>) -> Result<Vec<u8>, AggregateError> {
        let first = input.pushes.first().map_or(0, |p| p.0);
        if input.aggregation != self.reduction {
            return Err(AggregateError::unsupported(
                input,
                &format!(
                    "the {} server (expects {:?})",
                    self.method.name(),
                    self.reduction
                ),
            ));
        }
        if self.server.is_none() {
            let server = self.build(input.shard).map_err(|detail| AggregateError {
                worker: first,
                detail,
            })?;
            self.server = Some((input.shard, server));
        }
        let (shard, server) = self.server.as_mut().expect("built above");
        if *shard != input.shard {
            return Err(AggregateError {
                worker: first,
                detail: format!(
                    "{} server of shard {shard} was handed shard {}",
                    self.method.name(),
                    input.shard
                ),
            });
        }
        let payloads: Vec<&[u8]> = input.pushes.iter().map(|p| p.1).collect();
        server
            .aggregate(input.step, &payloads, &mut self.out)
            .map_err(|e| AggregateError {
                worker: e.push.map_or(first, |i| input.pushes[i].0),
                detail: e.detail,
            })?;
        Ok(std::mem::take(&mut self.out))
    }
}

/// The worker side of a method with its own parameter-server protocol (see the
/// [module docs](self)).
#[derive(Debug)]
pub struct ShardedWorker {
    layout: PsLayout,
    reduction: Reduction,
    inner: Box<dyn ShardWorker>,
}

impl ShardedWorker {
    /// A worker for `layout` and a model laid out in `layers` (as for
    /// [`ShardedAggregator::new`]), encoding with `method`, with the method's worker-side
    /// error feedback when `error_feedback`.
    pub fn new(
        layout: &PsLayout,
        layers: &[Range<usize>],
        method: &CompressorConfig,
        error_feedback: bool,
    ) -> Result<Self, ConfigError> {
        check_layers(layout, layers)?;
        let p = protocol(method)?;
        Ok(ShardedWorker {
            layout: layout.clone(),
            reduction: Reduction(p.reduction()),
            inner: p.worker(&shards(layout, layers), error_feedback)?,
        })
    }

    /// The reduction code its pushes carry.
    pub fn reduction(&self) -> Reduction {
        self.reduction
    }

    /// Whether [`ShardedWorker::payloads`] reads the parameters.
    pub fn needs_params(&self) -> bool {
        self.inner.needs_params()
    }

    /// The error-feedback memory per shard (empty without error feedback).
    pub fn export_memory(&self) -> BTreeMap<u64, Vec<f32>> {
        self.inner.export_memory()
    }

    /// Restores [`ShardedWorker::export_memory`].
    pub fn import_memory(&mut self, memory: BTreeMap<u64, Vec<f32>>) -> Result<(), String> {
        self.inner.import_memory(memory)
    }

    /// One payload per shard for the flat `params` and `grads` of the whole model.
    pub fn payloads(
        &mut self,
        params: &[f32],
        grads: &[f32],
    ) -> Result<Vec<Vec<u8>>, CompressError> {
        let n = self.layout.len();
        if params.len() != n || grads.len() != n {
            return Err(CompressError::BadSegments(format!(
                "{} parameters and {} gradients for a model of {n}",
                params.len(),
                grads.len()
            )));
        }
        (0..self.layout.num_shards())
            .map(|j| {
                let r = self.layout.shard_range(j);
                let mut out = Vec::new();
                self.inner
                    .encode(j, &params[r.clone()], &grads[r], &mut out)?;
                Ok(out)
            })
            .collect()
    }

    /// Pushes this step's payloads through `node` and returns the aggregates that arrived
    /// ([`PsNode::step`], with the method's reduction code).
    pub fn step<T: Transport, A: Aggregator>(
        &mut self,
        node: &mut PsNode<T, A>,
        params: &[f32],
        grads: &[f32],
    ) -> Result<Vec<Aggregate>, CommError> {
        let payloads = self
            .payloads(params, grads)
            .map_err(|e| CommError::InvalidArgument(e.to_string()))?;
        node.step(payloads, self.reduction)
    }

    /// Decodes a pulled aggregate into the flat buffer `out` (the whole model),
    /// **overwriting** it with the sum over workers of what the servers apply this step.
    pub fn apply(&self, agg: &Aggregate, out: &mut [f32]) -> Result<(), WireError> {
        if out.len() != self.layout.len() {
            return Err(WireError::LengthMismatch {
                payload: self.layout.len(),
                buffer: out.len(),
            });
        }
        if agg.shards.len() != self.layout.num_shards() {
            return Err(WireError::BadSegments(
                "aggregate has the wrong number of shards",
            ));
        }
        for (j, bytes) in agg.shards.iter().enumerate() {
            let r = self.layout.shard_range(j);
            self.inner.decode_pull(agg.step, j, bytes, &mut out[r])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dtrain_compress::decompress;
    use dtrain_compress::mipd::{layers_in, Halves, MipdConfig, MipdServerConfig};

    fn layout() -> PsLayout {
        PsLayout::new(4, vec![0, 1], vec![2, 3], 1000).unwrap()
    }

    #[test]
    fn aggregator_equals_the_shard_server_and_names_bad_workers() {
        let l = layout();
        let layers = vec![0..300, 300..310, 310..1000];
        let mcfg = MipdConfig {
            lambda: 0.7,
            halves: Halves::Interleaved,
            ..MipdConfig::default()
        };
        let scfg: MipdServerConfig = mcfg.server();
        let method = CompressorConfig::from(mcfg.clone());
        let mut w = ShardedWorker::new(&l, &layers, &method, false).unwrap();
        let mut agg = ShardedAggregator::new(&l, layers.clone(), &method).unwrap();
        let code = agg.reduction();
        assert_eq!(code, w.reduction());
        let r = l.shard_range(1);
        let mut reference = scfg.init(r.len(), &layers_in(&layers, r.clone())).unwrap();
        let params: Vec<f32> = (0..1000)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        for step in 0..4u64 {
            let pushes: Vec<Vec<Vec<u8>>> = (0..2)
                .map(|wk| {
                    let g: Vec<f32> = (0..1000)
                        .map(|i| {
                            (((i + 13 * wk + 7 * step as usize) * 7919) % 1009) as f32 / 1e4 - 0.05
                        })
                        .collect();
                    w.payloads(&params, &g).unwrap()
                })
                .collect();
            let input: Vec<(usize, &[u8])> = pushes
                .iter()
                .enumerate()
                .map(|(wk, p)| (wk, p[1].as_slice()))
                .collect();
            let got = agg
                .aggregate(&ShardPushes {
                    shard: 1,
                    range: r.clone(),
                    step,
                    aggregation: code,
                    pushes: &input,
                })
                .unwrap();
            let mut want = Vec::new();
            let refs: Vec<&[u8]> = input.iter().map(|p| p.1).collect();
            reference.aggregate(step, &refs, &mut want).unwrap();
            assert_eq!(got, want, "step {step}");
        }
        // Wrong aggregation code, a malformed push, another shard.
        let bad = [(0usize, &[1u8, 2, 3][..]), (1, &[9u8][..])];
        let mk = |aggregation, shard, pushes| ShardPushes {
            shard,
            range: if shard == 1 {
                r.clone()
            } else {
                l.shard_range(0)
            },
            step: 4,
            aggregation,
            pushes,
        };
        let e = agg.aggregate(&mk(Reduction::SUM, 1, &bad)).unwrap_err();
        assert_eq!(e.worker, 0);
        let e = agg.aggregate(&mk(code, 1, &bad)).unwrap_err();
        assert_eq!(e.worker, 0);
        let ok = w.payloads(&params, &params).unwrap();
        let half_bad = [(0usize, ok[1].as_slice()), (1, &[9u8][..])];
        let e = agg.aggregate(&mk(code, 1, &half_bad)).unwrap_err();
        assert_eq!(e.worker, 1, "{}", e.detail);
        let e = agg.aggregate(&mk(code, 0, &half_bad)).unwrap_err();
        assert!(e.detail.contains("shard"), "{}", e.detail);
        // Bad configurations, and a method without a protocol of its own.
        assert!(ShardedAggregator::new(&l, vec![0..10, 10..20], &method).is_err());
        let nan = CompressorConfig::from(MipdConfig {
            lambda: f64::NAN,
            ..mcfg.clone()
        });
        assert!(ShardedAggregator::new(&l, layers.clone(), &nan).is_err());
        assert!(ShardedWorker::new(&l, &layers, &nan, false).is_err());
        let b0 = CompressorConfig::from(MipdConfig {
            bits: 0,
            ..mcfg.clone()
        });
        assert!(ShardedWorker::new(&l, &layers, &b0, false).is_err());
        let topk = CompressorConfig::default_for("topk").unwrap();
        let e = ShardedWorker::new(&l, &layers, &topk, false).unwrap_err();
        assert!(e.to_string().contains("topk"), "{e}");
        assert!(w.payloads(&params[1..], &params).is_err());
    }

    #[test]
    fn error_feedback_keeps_what_the_payloads_did_not_carry() {
        let l = PsLayout::new(2, vec![0], vec![1], 500).unwrap();
        let layers = vec![0..400, 400..500];
        let method = CompressorConfig::from(MipdConfig::default());
        let mut w = ShardedWorker::new(&l, &layers, &method, true).unwrap();
        let decoder = MipdConfig::default().init().unwrap();
        let params = vec![1.0f32; 500];
        let g: Vec<f32> = (0..500)
            .map(|i| ((i * 7919) % 997) as f32 / 997.0 - 0.5)
            .collect();
        let mut sent = vec![0f32; 500];
        for step in 0..3 {
            let p = w.payloads(&params, &g).unwrap();
            let mut t = vec![0f32; 500];
            decompress(&decoder, &p[0], &mut t).unwrap();
            sent.iter_mut().zip(&t).for_each(|(s, t)| *s += t);
            // Invariant of residual EF: everything pushed so far plus the residual is
            // exactly the sum of the gradients.
            let e = &w.export_memory()[&0];
            for i in 0..500 {
                let want = g[i] * (step + 1) as f32;
                assert!((sent[i] + e[i] - want).abs() < 1e-5, "step {step} i {i}");
            }
        }
        let off = ShardedWorker::new(&l, &layers, &method, false).unwrap();
        assert!(off.export_memory().is_empty());
    }
}
