//! # dtrain-comms
//!
//! Collective communication for dtrain's data-parallel training: all-reduce (sum, max),
//! all-gather of variable-size buffers, broadcast, reduce-scatter, barrier and a sparse
//! all-reduce over `f32` slices, sparse vectors and bytes, with deterministic (bit-identical
//! across ranks) reductions, byte accounting per call, and failures that name the culprit
//! rank instead of hanging.
//!
//! The collective algorithms are written once, as IO-free state machines ([`algo`]): they
//! are fed received messages and polled for messages to send, and never touch a socket or
//! the clock (the quinn-proto / quinn split). Transport drivers ([`transport`]) only move
//! framed bytes between ranks; the blocking [`Communicator`] drives a machine over a
//! transport and owns timeouts and failure propagation.
//!
//! This crate is **not** a training framework: it knows nothing of tensors, models, burn or
//! compression — it takes `&[f32]` and bytes. It does not launch processes; the
//! `rendezvous` module (feature `tcp`) lets ranks that were launched (by `dtrain`, Slurm or `mpirun`) find each
//! other. MPI and the parameter-server mode are later additions that fit the same seams (an
//! MPI driver is another [`Transport`]; a parameter server is another [`algo::Machine`]).
//!
//! ```no_run
//! use std::net::TcpListener;
//! use dtrain_comms::rendezvous::{self, Host, RendezvousConfig, RunIdentity};
//! use dtrain_comms::{CommConfig, Communicator, TcpConfig, TcpTransport};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (rank, world) = (0, 2); // or rendezvous::placement(flags, Slurm / Open MPI env)
//! let token = b"per-run secret".to_vec();
//! let rcfg = RendezvousConfig::new(token.clone());
//! // Rank 0 hosts the rendezvous; every rank (0 included) joins it.
//! let rdv = TcpListener::bind("127.0.0.1:29500")?;
//! let host = Host::spawn(rdv, world, RunIdentity::default(), rcfg.clone())?;
//! let listener = TcpListener::bind("127.0.0.1:0")?;
//! let joined = rendezvous::join(host.addr(), rank, world, listener.local_addr()?, &rcfg)?;
//! let mut cfg = TcpConfig::new(token);
//! cfg.link = dtrain_comms::shaping::LinkSpec::parse(Some("1Gbit"), Some("100us"))?;
//! let t = TcpTransport::connect(rank, &joined.peers, listener, cfg)?;
//! let mut comm = Communicator::new(t, CommConfig::default());
//! let mut grad = vec![1.0f32; 1 << 20];
//! comm.all_reduce_sum(&mut grad)?;
//! # Ok(()) }
//! ```
//!
//! ## Layout
//! * [`algo`]: the [`algo::Machine`] trait and one file per algorithm: [`algo::ring`]
//!   (all-reduce, reduce-scatter), [`algo::recursive_doubling`] (small all-reduce),
//!   [`algo::allgather`] (all-gatherv), [`algo::broadcast`], [`algo::barrier`],
//!   [`algo::sparse_allreduce`] (sum of sparse vectors: owners reduce their segment, then
//!   send it to everyone; each chunk as (index, value) pairs or dense, whichever is smaller),
//!   [`algo::compressed_allreduce`] (owners decode, sum and re-encode through the driver's
//!   codec), [`algo::hierarchical`] (reduce on each host, all-reduce among one leader per
//!   host, broadcast on each host).
//! * [`topology`]: which ranks share a host ([`topology::Topology`]), from the launcher's
//!   nodes or from host names exchanged at start-up.
//! * [`cost`]: the α–β cost of each collective per bucket, shared by `dtrain simulate` and
//!   the trainer's automatic choice of collective.
//! * [`sparse`]: [`sparse::SparseSlice`] / [`sparse::SparseVec`] (sorted unique `u32`
//!   indices with `f32` values) and the sparse chunk encoding on the wire.
//! * [`wire`]: the message header every machine speaks (sequence number, kind, sizes), so
//!   mismatched collectives are detected.
//! * [`transport`]: the [`Transport`] seam, [`ByteCount`], and the drivers:
//!   [`transport::channel`] (in-process), `transport::tcp` (feature `tcp`, on by
//!   default: tokio, TCP_NODELAY, one connection per rank pair, run-token handshake) and
//!   `transport::quic` (feature `quic`, on by default: quinn + rustls/ring, TLS 1.3 with the
//!   pinned per-run certificate, plus the run token on the stream) and `transport::shm`
//!   (feature `shm`, on by default, Linux: ranks on one host exchange frames through byte
//!   rings in `/dev/shm` mappings, waiting on process-shared futexes).
//! * `rendezvous` (feature `tcp`): rank 0 or a given address hosts it; ranks join with the
//!   run token and learn the world, every peer's address and the run certificate;
//!   `rendezvous::placement` reads ranks from flags, Slurm or Open MPI.
//! * [`frame`]: length-prefixed stream framing with a cursor parser (`Incomplete` until a
//!   whole, size-bounded frame is buffered).
//! * [`comm`]: the blocking [`Communicator`] facade, [`CommConfig`], [`CommError`].
//! * [`dlcp`]: DLCP, bounded-loss gradient exchange: self-describing prioritized packets,
//!   order-independent reassembly, a deadline/NACK round rule, emulated loss and tail
//!   latency, and the lossy reduce-scatter + reliable all-gather behind
//!   [`Communicator::dlcp_all_reduce`].
//! * [`ps`]: the parameter-server mode (push / pull, sharded servers, synchronous or
//!   bounded-staleness), as IO-free worker and server machines plus the [`ps::PsNode`] facade.
//! * `transport::mpi` (feature `mpi`): [`Transport`] over MPI point-to-point, and MPI's
//!   native collectives (`MpiCollectives`).
//! * [`shaping`]: the α–β link model used for bandwidth/latency emulation (sans-IO),
//!   [`shaping::LinkSpec`] (`bandwidth = "1Gbit"`, `latency = "100us"`) applied per worker
//!   by the TCP and QUIC drivers, and the α–β predictions emulated runs are checked against.

pub mod algo;
pub mod comm;
pub mod cost;
pub mod dlcp;
pub mod frame;
pub(crate) mod pool;
pub mod ps;
#[cfg(feature = "tcp")]
pub mod rendezvous;
pub mod shaping;
pub mod sparse;
pub mod topology;
pub mod transport;
pub mod wire;

pub use algo::{segment_range, ReduceOp};
pub use comm::{CommConfig, CommError, Communicator, Membership};
pub use sparse::{SparseSlice, SparseVec};
pub use transport::channel::{channel_mesh, ChannelSlots, ChannelTransport};
#[cfg(feature = "mpi")]
pub use transport::mpi::{MpiCollectives, MpiTransport};
pub use transport::mux::{split_ps, split_tagged, Lane};
#[cfg(feature = "quic")]
pub use transport::quic::{QuicConfig, QuicTransport};
#[cfg(all(feature = "shm", target_os = "linux"))]
pub use transport::shm::{shm_mesh, ShmConfig, ShmTransport};
#[cfg(feature = "tcp")]
pub use transport::tcp::{TcpConfig, TcpTransport};
pub use transport::{ByteCount, Transport, TransportError};
