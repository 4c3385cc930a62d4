//! Parameter-server mode: workers push per-shard payloads, servers aggregate them and every
//! worker pulls the aggregate — synchronously or with bounded staleness (stale-synchronous
//! parallel, SSP).
//!
//! # Model
//! * A [`PsLayout`] names the worker ranks and the server ranks of a run (a rank may be
//!   both: co-located) and shards a model of `len` elements across the servers by
//!   contiguous ranges ([`PsLayout::shard_range`], the same split as
//!   [`crate::segment_range`]). Server `j` (the `j`-th rank of the server list) owns shard `j`.
//! * Every worker pushes, for each step, one payload per shard — opaque bytes (a dense
//!   f32 slice, or a compressed encoding of the shard) plus the [`Reduction`] the server
//!   must apply. Workers push steps 0, 1, 2, … in order — or, for a run resumed from a
//!   checkpoint, from [`PsConfig::first_step`] on, so that step numbers stay global.
//! * A server aggregates step `t` of its shard once every worker has pushed it, in worker
//!   order (deterministic: every worker receives the same bytes), with a pluggable
//!   [`Aggregator`] (default [`DenseF32`]: sum or mean of f32 slices; compressed
//!   decode-and-sum or MIPD's smoothing plug in here), and sends the result to every worker.
//! * **Staleness bound `s`** ([`PsConfig::staleness`]): a worker may push step `t` only once
//!   the aggregates of every step `< t − s` arrived (all workers pushed them). Its clock
//!   (steps pushed) is therefore never more than `s` ahead of the slowest worker's:
//!   `s = 0` is synchronous (push `t`, wait for aggregate `t`), `s = u64::MAX` fully
//!   asynchronous (Project Adam). Servers check the bound too and reject a worker that
//!   breaks it. A step's aggregate always contains every worker's push of that step (SSP
//!   with per-step aggregation: staleness delays when a worker *sees* an aggregate, never
//!   what is in it).
//!
//! # Layers
//! [`ServerMachine`] and [`WorkerMachine`] are IO-free state machines like [`crate::algo`]:
//! feed them decoded [`PsMsg`]s with `handle`, drain `poll_transmit`. [`PsNode`] is the
//! blocking facade over any [`Transport`]: it runs the worker and/or server machine of its
//! rank, owns timeouts and failure propagation, and reports failures as [`CommError`]s
//! naming the culprit rank:
//! * a peer whose transport closed while still needed → [`CommError::PeerLost`] on the
//!   rank that saw it, which broadcasts an abort so every other rank of the run fails with
//!   the same error within moments;
//! * no progress for [`PsConfig::timeout`] → a server names the workers whose push of the
//!   oldest incomplete step is missing ([`CommError::Timeout`]), and aborts everyone.
//!   Workers wait `timeout + abort_grace` before blaming the servers themselves, so a
//!   stalled worker is named by the servers' abort rather than a server being blamed.
//! * protocol violations (out-of-order or duplicate pushes, a broken staleness bound, a
//!   payload the aggregator rejects, different reductions for one step) →
//!   [`CommError::Protocol`] / [`CommError::Mismatch`] naming the worker.
//!
//! A rank that is only a server calls [`PsNode::serve`]; a worker calls [`PsNode::step`]
//! (or [`PsNode::push`] and [`PsNode::pull`]) and finally [`PsNode::finish`], which on a
//! co-located rank keeps serving until every worker has finished. Note that a co-located
//! server makes progress only while its rank is inside a `PsNode` call: with `s > 0`, a
//! co-located rank busy computing delays the aggregates of its shard by up to one of its
//! steps (use separate server ranks, e.g. threads with their own transport, to avoid it).
//!
//! # Files
//! * `wire.rs`: [`PsMsg`], its header ([`PS_MAGIC`], [`PS_HEADER_LEN`]), [`Reduction`]
//!   codes and the f32 payloads of [`DenseF32`] ([`f32_payload`], [`f32_values`]).
//! * `layout.rs`: [`PsLayout`] (roles and shards) and the staleness bound.
//! * `server.rs`: the [`Aggregator`] seam, [`DenseF32`] and [`ServerMachine`].
//! * `worker.rs`: [`WorkerMachine`] and the [`Aggregate`] it hands out.
//! * `driver.rs`: [`PsNode`] and [`PsConfig`].
//!
//! [`Transport`]: crate::Transport
//! [`CommError`]: crate::CommError
//! [`CommError::PeerLost`]: crate::CommError::PeerLost
//! [`CommError::Timeout`]: crate::CommError::Timeout
//! [`CommError::Protocol`]: crate::CommError::Protocol
//! [`CommError::Mismatch`]: crate::CommError::Mismatch

mod driver;
mod layout;
mod server;
mod wire;
mod worker;

/// The reason code of a [`PsMsg::Abort`]: the collectives' own.
pub use crate::wire::AbortReason;
pub use driver::{PsConfig, PsNode};
pub use layout::PsLayout;
pub use server::{AggregateError, Aggregator, DenseF32, ServerMachine, ShardPushes};
pub use wire::{f32_payload, f32_values, PsMsg, Reduction, PS_HEADER_LEN, PS_MAGIC};
pub use worker::{Aggregate, WorkerMachine};
