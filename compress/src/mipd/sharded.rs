//! MIPD's parameter-server protocol ([`crate::sharded`]): per shard, the worker encodes
//! its gradient (with the parameters in view for the Taylor significance) and the server
//! smooths what nobody sent and returns the step's alternating half.

use std::collections::BTreeMap;

use super::{decode_pull, Halves, Mipd, MipdConfig, MipdServer, MipdServerError, MipdServerState};
use crate::compressor::decompress;
use crate::memory::{Memory, Residual};
use crate::sharded::{
    ServerState, Shard, ShardServer, ShardServerError, ShardWorker, ShardedMethod,
};
use crate::{CompressError, ConfigError, WireError};

/// The reduction code of MIPD pushes: the first one above the parameter server's own.
pub const MIPD_REDUCTION: u8 = 16;

impl ShardedMethod for MipdConfig {
    fn reduction(&self) -> u8 {
        MIPD_REDUCTION
    }

    fn worker(
        &self,
        shards: &[Shard],
        error_feedback: bool,
    ) -> Result<Box<dyn ShardWorker>, ConfigError> {
        let server = self.server();
        server.validate()?;
        Ok(Box::new(MipdShardWorker {
            shards: shards.to_vec(),
            halves: server.halves,
            encoder: self.init()?,
            // Residual error feedback with β = γ = 1: `p = e + g`, `e ← p − D(C(p))`.
            memory: error_feedback.then(|| Residual::new(1.0, 1.0)),
            compensated: Vec::new(),
            transmitted: Vec::new(),
        }))
    }

    fn server(&self, shard: &Shard) -> Result<Box<dyn ShardServer>, ConfigError> {
        Ok(Box::new(MipdShardServer(
            self.server().init(shard.range.len(), &shard.pieces)?,
        )))
    }
}

/// The worker side of MIPD on a parameter server.
#[derive(Debug, Clone)]
pub struct MipdShardWorker {
    shards: Vec<Shard>,
    halves: Halves,
    encoder: Mipd,
    /// Worker-side error feedback (residual memory keyed by shard), if enabled.
    memory: Option<Residual>,
    /// Scratch: compensated gradient and the decoded own payload of one shard.
    compensated: Vec<f32>,
    transmitted: Vec<f32>,
}

impl MipdShardWorker {
    /// The encoder (its [`Mipd::last_stats`] describe the last shard encoded).
    pub fn encoder(&self) -> &Mipd {
        &self.encoder
    }
}

impl ShardWorker for MipdShardWorker {
    fn needs_params(&self) -> bool {
        true
    }

    fn encode(
        &mut self,
        shard: usize,
        params: &[f32],
        grad: &[f32],
        out: &mut Vec<u8>,
    ) -> Result<(), CompressError> {
        let pieces = &self
            .shards
            .get(shard)
            .ok_or_else(|| CompressError::BadSegments(format!("no shard {shard}")))?
            .pieces;
        out.clear();
        match &mut self.memory {
            None => self.encoder.encode(params, grad, pieces, out),
            Some(mem) => {
                self.compensated.resize(grad.len(), 0.0);
                self.transmitted.resize(grad.len(), 0.0);
                mem.compensate(shard as u64, grad, &mut self.compensated);
                self.encoder
                    .encode(params, &self.compensated, pieces, out)?;
                decompress(&self.encoder, out, &mut self.transmitted)
                    .expect("a payload this encoder just wrote decodes");
                mem.update(shard as u64, &self.compensated, &self.transmitted, &[]);
                Ok(())
            }
        }
    }

    fn decode_pull(
        &self,
        step: u64,
        shard: usize,
        bytes: &[u8],
        out: &mut [f32],
    ) -> Result<(), WireError> {
        let s = self
            .shards
            .get(shard)
            .ok_or(WireError::BadSegments("no such shard"))?;
        if out.len() != s.range.len() {
            return Err(WireError::LengthMismatch {
                payload: s.range.len(),
                buffer: out.len(),
            });
        }
        let info = decode_pull(self.halves, &s.pieces, bytes, out)?;
        if info.step != step {
            return Err(WireError::Invalid("MIPD pull of another step"));
        }
        Ok(())
    }

    fn export_memory(&self) -> BTreeMap<u64, Vec<f32>> {
        self.memory.as_ref().map(|m| m.export()).unwrap_or_default()
    }

    fn import_memory(&mut self, memory: BTreeMap<u64, Vec<f32>>) -> Result<(), String> {
        match &mut self.memory {
            Some(m) => {
                m.import(memory);
                Ok(())
            }
            None if memory.is_empty() => Ok(()),
            None => Err(
                "the checkpoint holds MIPD's worker residual; this run has error \
                         feedback off"
                    .into(),
            ),
        }
    }
}

/// The server of one shard of MIPD on a parameter server: a [`MipdServer`].
#[derive(Debug)]
pub struct MipdShardServer(pub MipdServer);

impl ShardServer for MipdShardServer {
    fn aggregate(
        &mut self,
        step: u64,
        pushes: &[&[u8]],
        out: &mut Vec<u8>,
    ) -> Result<(), ShardServerError> {
        self.0
            .aggregate(step, pushes, out)
            .map_err(|e| ShardServerError {
                push: match e {
                    MipdServerError::Push { index, .. } => Some(index),
                    MipdServerError::OutOfOrder { .. } => None,
                },
                detail: format!("MIPD: {e}"),
            })
    }

    fn export_state(&self) -> ServerState {
        let s = self.0.export_state();
        let mut out = ServerState {
            next_step: s.next_step,
            ..ServerState::default()
        };
        out.put_f32("smoothed", &s.smoothed);
        out.put_f32("carry", &s.carry);
        out.sections.insert(
            "received".to_string(),
            s.received.iter().map(|&r| r as u8).collect(),
        );
        out
    }

    fn import_state(&mut self, mut state: ServerState) -> Result<(), String> {
        let received = state.take_bytes("received")?;
        if let Some(b) = received.iter().find(|&&b| b > 1) {
            return Err(format!("received holds {b}, not 0 or 1"));
        }
        let s = MipdServerState {
            next_step: state.next_step,
            smoothed: state.take_f32("smoothed")?,
            carry: state.take_f32("carry")?,
            received: received.iter().map(|&b| b == 1).collect(),
        };
        self.0.import_state(s).map_err(|e| e.to_string())
    }
}
