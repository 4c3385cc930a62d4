//! # dtrain-comms
//!
//! Collective communication for dtrain's data-parallel training: all-reduce (sum, max),
//! all-gather of variable-size buffers, broadcast, reduce-scatter and barrier over `f32`
//! slices and bytes, with deterministic (bit-identical across ranks) reductions, byte
//! accounting per call, and failures that name the culprit rank instead of hanging.
//!
//! The collective algorithms are written once, as IO-free state machines ([`algo`]): they
//! are fed received messages and polled for messages to send, and never touch a socket or
//! the clock (the quinn-proto / quinn split). Transport drivers ([`transport`]) only move
//! framed bytes between ranks; the blocking [`Communicator`] drives a machine over a
//! transport and owns timeouts and failure propagation.
//!
//! This crate is **not** a training framework: it knows nothing of tensors, models, burn or
//! compression — it takes `&[f32]` and bytes. It does not launch processes or discover
//! peers (the TCP driver takes a list of addresses); rendezvous, QUIC, MPI, link emulation
//! and the parameter-server mode are later additions that fit the same seams (a QUIC or MPI
//! driver is another [`Transport`]; a parameter server is another [`algo::Machine`]).
//!
//! ## Layout
//! * [`algo`]: the [`algo::Machine`] trait and one file per algorithm: [`algo::ring`]
//!   (all-reduce, reduce-scatter), [`algo::recursive_doubling`] (small all-reduce),
//!   [`algo::allgather`] (all-gatherv), [`algo::broadcast`], [`algo::barrier`].
//! * [`wire`]: the message header every machine speaks (sequence number, kind, sizes), so
//!   mismatched collectives are detected.
//! * [`transport`]: the [`Transport`] seam, [`ByteCount`], and the drivers:
//!   [`transport::channel`] (in-process) and `transport::tcp` (feature `tcp`, on by
//!   default: tokio, TCP_NODELAY, one connection per rank pair, run-token handshake).
//! * [`frame`]: length-prefixed stream framing with a cursor parser (`Incomplete` until a
//!   whole, size-bounded frame is buffered).
//! * [`comm`]: the blocking [`Communicator`] facade, [`CommConfig`], [`CommError`].
//! * [`ps`]: the parameter-server mode (push / pull, sharded servers, synchronous or
//!   bounded-staleness), as IO-free worker and server machines plus the [`ps::PsNode`] facade.
//! * `transport::mpi` (feature `mpi`): [`Transport`] over MPI point-to-point, and MPI's
//!   native collectives (`MpiCollectives`).
//! * [`shaping`]: the α–β link model used for bandwidth/latency emulation (sans-IO; the
//!   drivers do not apply it yet).

pub mod algo;
pub mod comm;
pub mod frame;
pub mod ps;
pub mod shaping;
pub mod transport;
pub mod wire;

pub use algo::{segment_range, ReduceOp};
pub use comm::{CommConfig, CommError, Communicator};
pub use transport::channel::{channel_mesh, ChannelTransport};
#[cfg(feature = "mpi")]
pub use transport::mpi::{MpiCollectives, MpiTransport};
#[cfg(feature = "tcp")]
pub use transport::tcp::{TcpConfig, TcpTransport};
pub use transport::{ByteCount, Transport, TransportError};
