//! Methods with a server-side algorithm of their own, for a parameter server
//! (`[cluster] mode = "ps"`).
//!
//! Most methods need nothing of the server but a decoder: it decodes the workers' payloads
//! of its shard, averages them and returns dense values. A method declares a protocol of
//! its own ([`Method::sharded`](crate::Method::sharded)) when its servers keep state and
//! answer with something else: MIPD smooths the coordinates nobody sent and returns only
//! the step's alternating half. The trainer's parameter-server mode runs such a method
//! through the three traits here and knows nothing else of it:
//!
//! * [`ShardedMethod`]: builds the two sides for a model cut into shards;
//! * [`ShardWorker`]: a worker's per-shard encoder (which may want the parameters) and its
//!   pull decoder, with the error-feedback memory a checkpoint holds;
//! * [`ShardServer`]: the server of one shard, with the state a checkpoint holds
//!   ([`ServerState`]).
//!
//! Everything here is on plain buffers: no transport, no layout type (`dtrain-comms`
//! shards the model; `dtrain-framework` glues the two).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::Range;

use crate::{CompressError, ConfigError, WireError};

/// One shard of the flat model: its element range and its layer pieces (the model's layers
/// cut to the range, relative to its start, tiling `0..range.len()`; empty: one layer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The shard's elements of the flat model.
    pub range: Range<usize>,
    /// Its layer pieces, relative to `range.start`.
    pub pieces: Vec<Range<usize>>,
}

/// A method's parameter-server protocol (see the [module docs](self)).
pub trait ShardedMethod: Debug + Send + Sync {
    /// The reduction code its pushes carry, 16 or above (codes below 16 are the parameter
    /// server's own); distinct per method.
    fn reduction(&self) -> u8;

    /// A worker's side for a model cut into `shards`, with its own error feedback when
    /// `error_feedback` (the run's `[compress]` asked for a residual memory).
    fn worker(
        &self,
        shards: &[Shard],
        error_feedback: bool,
    ) -> Result<Box<dyn ShardWorker>, ConfigError>;

    /// The server of `shard`.
    fn server(&self, shard: &Shard) -> Result<Box<dyn ShardServer>, ConfigError>;
}

/// A worker's side of a [`ShardedMethod`].
pub trait ShardWorker: Debug + Send {
    /// Whether [`ShardWorker::encode`] reads the parameters (they are copied out of the
    /// model only when it does).
    fn needs_params(&self) -> bool;

    /// Writes the push of shard `shard` into `out` (cleared), from the shard's parameters
    /// `params` and gradient `grad`.
    fn encode(
        &mut self,
        shard: usize,
        params: &[f32],
        grad: &[f32],
        out: &mut Vec<u8>,
    ) -> Result<(), CompressError>;

    /// Decodes the pull of shard `shard` for step `step` into `out` (the shard's elements),
    /// **overwriting** it: the **sum** over the workers of what the server applies this
    /// step (the trainer divides by the worker count). Validates everything; never panics.
    fn decode_pull(
        &self,
        step: u64,
        shard: usize,
        bytes: &[u8],
        out: &mut [f32],
    ) -> Result<(), WireError>;

    /// The error-feedback memory per shard (keyed by shard index), for checkpoints; empty
    /// without error feedback.
    fn export_memory(&self) -> BTreeMap<u64, Vec<f32>>;

    /// Restores [`ShardWorker::export_memory`]; refuses a memory this worker cannot hold.
    fn import_memory(&mut self, memory: BTreeMap<u64, Vec<f32>>) -> Result<(), String>;
}

/// Why a [`ShardServer`] refused a step.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardServerError {
    /// The push at fault (its index among the step's pushes), when one is.
    pub push: Option<usize>,
    /// What is wrong.
    pub detail: String,
}

/// The server of one shard of a [`ShardedMethod`].
pub trait ShardServer: Debug + Send {
    /// Aggregates `step` from the workers' pushes (in worker order) and writes the pull
    /// into `out` (cleared). Checks every push before any state changes.
    fn aggregate(
        &mut self,
        step: u64,
        pushes: &[&[u8]],
        out: &mut Vec<u8>,
    ) -> Result<(), ShardServerError>;

    /// What a checkpoint must hold.
    fn export_state(&self) -> ServerState;

    /// Restores [`ShardServer::export_state`]; on error nothing changes.
    fn import_state(&mut self, state: ServerState) -> Result<(), String>;
}

/// A [`ShardServer`]'s checkpointed state: the next step it aggregates and named raw
/// sections (the checkpoint stores each as its own section, `ps/<method>/<name>`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServerState {
    /// The next step to aggregate (the checkpoint's step, which the parameter server's
    /// clock restarts at).
    pub next_step: u64,
    /// Sections by name: bytes, or `f32` little-endian ([`ServerState::put_f32`]).
    pub sections: BTreeMap<String, Vec<u8>>,
}

impl ServerState {
    /// Stores `v` as section `name`, little-endian.
    pub fn put_f32(&mut self, name: &str, v: &[f32]) {
        let b = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.sections.insert(name.to_string(), b);
    }

    /// Removes the `f32` section `name`, or says why it cannot.
    pub fn take_f32(&mut self, name: &str) -> Result<Vec<f32>, String> {
        let b = self.take_bytes(name)?;
        if b.len() % 4 != 0 {
            return Err(format!(
                "server state section {name:?} has {} bytes, not a multiple of 4",
                b.len()
            ));
        }
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Removes the byte section `name`, or says it is missing.
    pub fn take_bytes(&mut self, name: &str) -> Result<Vec<u8>, String> {
        self.sections
            .remove(name)
            .ok_or_else(|| format!("server state has no {name:?} section"))
    }
}

impl Shard {
    /// The shards of a flat model laid out in `layers` (tiling `0..len`; empty: one layer)
    /// when it is cut at `ranges`.
    pub fn cut(
        layers: &[Range<usize>],
        ranges: impl IntoIterator<Item = Range<usize>>,
    ) -> Vec<Shard> {
        ranges
            .into_iter()
            .map(|r| Shard {
                pieces: layers_in(layers, r.clone()),
                range: r,
            })
            .collect()
    }
}

/// The layers of a flat model (`layers`, tiling `0..len`) that fall into `range` (a shard),
/// clipped to it and made relative to `range.start`: the layer list a shard's encoder and
/// server use. Pieces are non-empty and tile `0..range.len()`.
pub fn layers_in(layers: &[Range<usize>], range: Range<usize>) -> Vec<Range<usize>> {
    layers
        .iter()
        .filter_map(|l| {
            let s = l.start.max(range.start);
            let e = l.end.min(range.end);
            (s < e).then(|| s - range.start..e - range.start)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_state_sections_round_trip_and_name_what_is_missing() {
        let mut s = ServerState::default();
        s.put_f32("a", &[1.0, -0.5, f32::MIN_POSITIVE]);
        s.sections.insert("b".into(), vec![1, 2, 3]);
        assert_eq!(s.take_f32("a").unwrap(), vec![1.0, -0.5, f32::MIN_POSITIVE]);
        assert!(s.take_f32("b").unwrap_err().contains("multiple of 4"));
        assert!(s.take_bytes("a").unwrap_err().contains("\"a\""));
    }

    #[test]
    fn shards_cut_layers_into_relative_pieces() {
        let layers = [0..5, 5..12, 12..20];
        let s = Shard::cut(&layers, [0..8, 8..20]);
        assert_eq!(s[0].pieces, vec![0..5, 5..8]);
        assert_eq!(s[1].pieces, vec![0..4, 4..12]);
        assert_eq!(s[1].range, 8..20);
        assert!(Shard::cut(&[], std::iter::once(0..4))[0].pieces.is_empty());
    }
}
