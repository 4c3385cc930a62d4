//! MIPD over the parameter server (ALGORITHMS.md §14): the glue between the pure MIPD
//! encoder / server state of [`dtrain_compress::mipd`] and the push / pull machinery of
//! [`dtrain_comms::ps`], which know nothing of each other.
//!
//! * [`MipdAggregator`]: the server side, a [`dtrain_comms::ps::Aggregator`] that runs one
//!   [`MipdServer`] for the shard its rank serves. Pushes must carry
//!   [`MIPD_AGGREGATION`].
//! * [`MipdWorker`]: the worker side for a trainer with a flat parameter buffer, a flat
//!   gradient buffer and known layer boundaries: one MIPD payload per shard
//!   ([`MipdWorker::payloads`]), and the pulled aggregate decoded back into a flat buffer
//!   ([`MipdWorker::apply`]).
//!
//! # Layers and shards
//! The PS shards the flat model into contiguous ranges ([`PsLayout::shard_range`]). A
//! layer that straddles two shards is split: each shard's encoder and server work on
//! `layers ∩ shard` ([`layers_in`]), so a code-book, a keep ratio and an alternating half
//! are per *piece* of a layer. Worker and server derive the pieces from the same layer
//! list and layout, so they always agree (the server checks every push's layer table).
//!
//! # What a pull means
//! The aggregate of step `t` is the **sum** over workers of the smoothed sparse gradients,
//! on the half `H_{t mod 2}` of every layer piece; [`MipdWorker::apply`] writes it into a
//! flat buffer with zeros on the other half. A trainer applies `params -= lr/P · agg` —
//! coordinates outside `H_t` are simply not updated at step `t` (their pushed gradients
//! wait in the server's carry until `t + 1`).

use std::ops::Range;

use dtrain_comms::ps::{
    Aggregate, AggregateError, Aggregator, PsLayout, PsNode, Reduction, ShardPushes,
};
use dtrain_comms::{CommError, Transport};
use dtrain_compress::compressor::effective_segments;
use dtrain_compress::memory::Residual;
use dtrain_compress::mipd::{
    decode_pull, layers_in, Mipd, MipdConfig, MipdServer, MipdServerConfig, MipdServerError,
    MipdServerState, PullInfo,
};
use dtrain_compress::{decompress, CompressError, ConfigError, Memory, WireError};

/// The PS reduction code of MIPD pushes. Codes below 16 are reserved for dtrain's own
/// reductions in [`dtrain_comms::ps`] (which must not depend on compress), so MIPD takes
/// the first code above them.
pub const MIPD_AGGREGATION: Reduction = Reduction(16);

fn check_layers(layout: &PsLayout, layers: &[Range<usize>]) -> Result<(), ConfigError> {
    effective_segments(layout.len(), layers)
        .map(|_| ())
        .map_err(|e| ConfigError::new("layers", e.to_string()))
}

/// The MIPD server of one shard, as a PS [`Aggregator`] (see the [module docs](self)).
/// Its [`MipdServer`] is built on the first step, for the shard the PS hands it.
#[derive(Debug)]
pub struct MipdAggregator {
    layout: PsLayout,
    layers: Vec<Range<usize>>,
    cfg: MipdServerConfig,
    server: Option<(usize, MipdServer)>,
    out: Vec<u8>,
}

impl MipdAggregator {
    /// An aggregator for a model laid out in `layers` (contiguous, in order, tiling
    /// `0..layout.len()`; empty means one layer), with server configuration `cfg`.
    pub fn new(
        layout: &PsLayout,
        layers: Vec<Range<usize>>,
        cfg: MipdServerConfig,
    ) -> Result<Self, ConfigError> {
        check_layers(layout, &layers)?;
        cfg.validate()?;
        Ok(MipdAggregator {
            layout: layout.clone(),
            layers,
            cfg,
            server: None,
            out: Vec::new(),
        })
    }

    /// The server state, once the first step was aggregated (or a state was restored).
    pub fn server(&self) -> Option<&MipdServer> {
        self.server.as_ref().map(|(_, s)| s)
    }

    /// What a checkpoint must hold: the shard served and its server state (`None` before
    /// the first step).
    pub fn export_state(&self) -> Option<(usize, MipdServerState)> {
        self.server.as_ref().map(|(j, s)| (*j, s.export_state()))
    }

    /// Restores [`MipdAggregator::export_state`]: the server of `shard` continues from
    /// `state` (its next step is `state.next_step`, which the parameter server's clock must
    /// match). Errors if the shard does not exist or the state does not fit it.
    pub fn import_state(&mut self, shard: usize, state: MipdServerState) -> Result<(), String> {
        if shard >= self.layout.num_shards() {
            return Err(format!(
                "MIPD server state of shard {shard}; this run has {} shards",
                self.layout.num_shards()
            ));
        }
        let range = self.layout.shard_range(shard);
        let pieces = layers_in(&self.layers, range.clone());
        let mut server = self
            .cfg
            .init(range.len(), &pieces)
            .map_err(|e| e.to_string())?;
        server
            .import_state(state)
            .map_err(|e| format!("MIPD server of shard {shard}: {e}"))?;
        self.server = Some((shard, server));
        Ok(())
    }
}

impl Aggregator for MipdAggregator {
    fn aggregate(&mut self, input: &ShardPushes<'_>) -> Result<Vec<u8>, AggregateError> {
        let first = input.pushes.first().map_or(0, |p| p.0);
        if input.aggregation != MIPD_AGGREGATION {
            return Err(AggregateError::unsupported(
                input,
                &format!("the MIPD server (expects {MIPD_AGGREGATION:?})"),
            ));
        }
        if self.server.is_none() {
            let pieces = layers_in(&self.layers, input.range.clone());
            let server = self
                .cfg
                .init(input.range.len(), &pieces)
                .map_err(|e| AggregateError {
                    worker: first,
                    detail: e.to_string(),
                })?;
            self.server = Some((input.shard, server));
        }
        let (shard, server) = self.server.as_mut().expect("built above");
        if *shard != input.shard {
            return Err(AggregateError {
                worker: first,
                detail: format!(
                    "MIPD server of shard {shard} was handed shard {}",
                    input.shard
                ),
            });
        }
        let payloads: Vec<&[u8]> = input.pushes.iter().map(|p| p.1).collect();
        server
            .aggregate(input.step, &payloads, &mut self.out)
            .map_err(|e| AggregateError {
                worker: match e {
                    MipdServerError::Push { index, .. } => input.pushes[index].0,
                    MipdServerError::OutOfOrder { .. } => first,
                },
                detail: format!("MIPD: {e}"),
            })?;
        Ok(std::mem::take(&mut self.out))
    }
}

/// The worker side of MIPD over a PS (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct MipdWorker {
    layout: PsLayout,
    /// Per shard: its element range and its layer pieces (relative to the range).
    shards: Vec<(Range<usize>, Vec<Range<usize>>)>,
    halves: dtrain_compress::mipd::Halves,
    encoder: Mipd,
    /// Worker-side error feedback (residual memory keyed by shard), if enabled.
    memory: Option<Residual>,
    /// Scratch: compensated gradient and the decoded own payload of one shard.
    compensated: Vec<f32>,
    transmitted: Vec<f32>,
}

impl MipdWorker {
    /// A worker for `layout`, a model laid out in `layers` (as for [`MipdAggregator::new`]),
    /// encoding with `cfg`; `server` must be the servers' configuration (its half rule
    /// decides how pulls decode).
    pub fn new(
        layout: &PsLayout,
        layers: &[Range<usize>],
        cfg: &MipdConfig,
        server: &MipdServerConfig,
    ) -> Result<Self, ConfigError> {
        check_layers(layout, layers)?;
        server.validate()?;
        // An empty layer list stays empty per shard: one layer per shard.
        let shards = (0..layout.num_shards())
            .map(|j| {
                let r = layout.shard_range(j);
                let pieces = layers_in(layers, r.clone());
                (r, pieces)
            })
            .collect();
        Ok(MipdWorker {
            layout: layout.clone(),
            shards,
            halves: server.halves,
            encoder: cfg.init()?,
            memory: None,
            compensated: Vec::new(),
            transmitted: Vec::new(),
        })
    }

    /// The encoder (its [`Mipd::last_stats`] describe the last shard encoded).
    pub fn encoder(&self) -> &Mipd {
        &self.encoder
    }

    /// Turns worker-side error feedback on or off (default off). On, each shard's gradient
    /// is compensated with the residual of what earlier payloads did not carry (dropped
    /// entries and quantization error: `p = e + g`, `e ← p − D(C(p))`, the
    /// [`Residual`] memory with β = γ = 1), in addition to the server's smoothing. Turning
    /// it off clears the residuals.
    pub fn set_error_feedback(&mut self, on: bool) {
        self.memory = on.then(|| Residual::new(1.0, 1.0));
    }

    /// The error-feedback memory, when enabled (its state is what a checkpoint must hold).
    pub fn memory(&self) -> Option<&Residual> {
        self.memory.as_ref()
    }

    /// The error-feedback memory, mutably (to restore it from a checkpoint).
    pub fn memory_mut(&mut self) -> Option<&mut Residual> {
        self.memory.as_mut()
    }

    /// One MIPD payload per shard for the flat `params` and `grads` of the whole model.
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
        let mut payloads = Vec::with_capacity(self.shards.len());
        for (j, (r, pieces)) in self.shards.iter().enumerate() {
            let mut out = Vec::new();
            let (w, g) = (&params[r.clone()], &grads[r.clone()]);
            match &mut self.memory {
                None => self.encoder.encode(w, g, pieces, &mut out)?,
                Some(mem) => {
                    self.compensated.resize(g.len(), 0.0);
                    self.transmitted.resize(g.len(), 0.0);
                    mem.compensate(j as u64, g, &mut self.compensated);
                    self.encoder
                        .encode(w, &self.compensated, pieces, &mut out)?;
                    decompress(&self.encoder, &out, &mut self.transmitted)
                        .expect("a payload this encoder just wrote decodes");
                    mem.update(j as u64, &self.compensated, &self.transmitted, &[]);
                }
            }
            payloads.push(out);
        }
        Ok(payloads)
    }

    /// Pushes this step's payloads through `node` and returns the aggregates that arrived
    /// ([`PsNode::step`], with [`MIPD_AGGREGATION`]).
    pub fn step<T: Transport, A: Aggregator>(
        &mut self,
        node: &mut PsNode<T, A>,
        params: &[f32],
        grads: &[f32],
    ) -> Result<Vec<Aggregate>, CommError> {
        let payloads = self
            .payloads(params, grads)
            .map_err(|e| CommError::InvalidArgument(e.to_string()))?;
        node.step(payloads, MIPD_AGGREGATION)
    }

    /// Decodes a pulled aggregate into the flat buffer `out` (the whole model),
    /// **overwriting** it: the step's half gets the summed smoothed gradient, every other
    /// coordinate 0.
    pub fn apply(&self, agg: &Aggregate, out: &mut [f32]) -> Result<PullInfo, WireError> {
        if out.len() != self.layout.len() {
            return Err(WireError::LengthMismatch {
                payload: self.layout.len(),
                buffer: out.len(),
            });
        }
        if agg.shards.len() != self.shards.len() {
            return Err(WireError::BadSegments(
                "aggregate has the wrong number of shards",
            ));
        }
        let mut info = None;
        for ((r, pieces), bytes) in self.shards.iter().zip(&agg.shards) {
            let i = decode_pull(self.halves, pieces, bytes, &mut out[r.clone()])?;
            if i.step != agg.step || info.is_some_and(|p| p != i) {
                return Err(WireError::Invalid("MIPD pull of another step"));
            }
            info = Some(i);
        }
        Ok(info.unwrap_or(PullInfo {
            step: agg.step,
            half: self.halves.half(agg.step),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dtrain_compress::mipd::Halves;

    fn layout() -> PsLayout {
        PsLayout::new(4, vec![0, 1], vec![2, 3], 1000).unwrap()
    }

    #[test]
    fn aggregator_equals_the_shard_server_and_names_bad_workers() {
        let l = layout();
        let layers = vec![0..300, 300..310, 310..1000];
        let scfg = MipdServerConfig {
            lambda: 0.7,
            halves: Halves::Interleaved,
        };
        let mut w = MipdWorker::new(&l, &layers, &MipdConfig::default(), &scfg).unwrap();
        let mut agg = MipdAggregator::new(&l, layers.clone(), scfg.clone()).unwrap();
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
                    aggregation: MIPD_AGGREGATION,
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
        let e = agg.aggregate(&mk(MIPD_AGGREGATION, 1, &bad)).unwrap_err();
        assert_eq!(e.worker, 0);
        let ok = w.payloads(&params, &params).unwrap();
        let half_bad = [(0usize, ok[1].as_slice()), (1, &[9u8][..])];
        let e = agg
            .aggregate(&mk(MIPD_AGGREGATION, 1, &half_bad))
            .unwrap_err();
        assert_eq!(e.worker, 1, "{}", e.detail);
        let e = agg
            .aggregate(&mk(MIPD_AGGREGATION, 0, &half_bad))
            .unwrap_err();
        assert!(e.detail.contains("shard"), "{}", e.detail);
        // Bad configurations.
        assert!(MipdAggregator::new(&l, vec![0..10, 10..20], scfg.clone()).is_err());
        let nan = MipdServerConfig {
            lambda: f64::NAN,
            ..scfg.clone()
        };
        assert!(MipdAggregator::new(&l, layers.clone(), nan.clone()).is_err());
        assert!(MipdWorker::new(&l, &layers, &MipdConfig::default(), &nan).is_err());
        let b0 = MipdConfig {
            bits: 0,
            ..MipdConfig::default()
        };
        assert!(MipdWorker::new(&l, &layers, &b0, &scfg).is_err());
        assert!(w.payloads(&params[1..], &params).is_err());
    }

    #[test]
    fn error_feedback_keeps_what_the_payloads_did_not_carry() {
        let l = PsLayout::new(2, vec![0], vec![1], 500).unwrap();
        let layers = vec![0..400, 400..500];
        let scfg = MipdServerConfig::default();
        let mut w = MipdWorker::new(&l, &layers, &MipdConfig::default(), &scfg).unwrap();
        w.set_error_feedback(true);
        let params = vec![1.0f32; 500];
        let g: Vec<f32> = (0..500)
            .map(|i| ((i * 7919) % 997) as f32 / 997.0 - 0.5)
            .collect();
        let mut sent = vec![0f32; 500];
        for step in 0..3 {
            let p = w.payloads(&params, &g).unwrap();
            let mut t = vec![0f32; 500];
            decompress(w.encoder(), &p[0], &mut t).unwrap();
            sent.iter_mut().zip(&t).for_each(|(s, t)| *s += t);
            // Invariant of residual EF: everything pushed so far plus the residual is
            // exactly the sum of the gradients.
            let e = w.memory().unwrap().residual(0).unwrap();
            for i in 0..500 {
                let want = g[i] * (step + 1) as f32;
                assert!((sent[i] + e[i] - want).abs() < 1e-5, "step {step} i {i}");
            }
        }
        w.set_error_feedback(false);
        assert!(w.memory().is_none());
    }
}
