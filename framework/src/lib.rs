//! # dtrain-framework
//!
//! The data-parallel trainer and the tools around it. This crate is the only one that sees
//! every other dtrain crate (`compress`, `comms`, `models`, `datasets`); the `dtrain` binary
//! is a thin shell over it.
//!
//! ## Layout
//! * [`alloc`]: [`alloc::ReuseAlloc`], the global allocator of the `dtrain` binary: large freed
//!   blocks are kept for the next step instead of being unmapped and faulted in again.
//! * [`bench`](mod@bench): the benchmarks behind `dtrain bench …` (compression throughput, error and
//!   bits per element).
//! * [`checkpoint`]: checksummed checkpoint container, atomic writes.
//! * [`exchange`]: one step's gradient exchange (compress → collective → decompress →
//!   average) for every aggregation kind, with its layer-aligned buckets
//!   ([`exchange::bucket`]), schedule, communication thread and checkpoint state.
//! * [`export`]: weights out and in as safetensors with PyTorch's names (`dtrain export`,
//!   `[model] init_from`).
//! * [`optim`]: SGD / momentum / Nesterov / Adam / AdamW on flat buffers (PyTorch semantics).
//! * [`lr`]: learning-rate schedules (step, cosine, gradual warm-up, linear scaling rule).
//! * [`config`]: the run configuration (TOML, two-stage validation into a [`config::Plan`]).
//! * [`device`]: `[cluster] device` — the CPU, or a CUDA GPU per worker (`cuda` feature).
//! * [`data`]: per-rank training / evaluation batches addressed by `(epoch, index)`.
//! * `sync`: the gradient-synchronisation seam — how a step's gradients become the update
//!   every replica applies: collectives (the exchanger) or the parameter server ([`ps_mode`]).
//! * [`trainer`]: one worker of a data-parallel run — the step, evaluation, checkpoints,
//!   exact resume, failure policies, metrics.
//! * [`launch`]: `dtrain run` — validation, run directory, worker processes, multi-node and
//!   scheduler placement, supervision (signals forwarded, restarts after a failure).
//! * [`provenance`]: the commit, build and machine each run records in its summary.
//! * [`tensorboard`]: TensorBoard event files written live (`[output] tensorboard = true`).
//! * [`signals`]: SIGTERM / SIGINT for the launcher and its workers (a stop request the
//!   trainer honours at a step boundary), and workers that die with their launcher.

pub mod alloc;
pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod device;
pub mod exchange;
pub mod export;
pub mod launch;
pub mod lr;
pub mod mpi_env;
pub mod optim;
pub mod optim_device;
pub mod provenance;
pub mod ps_mode;
pub mod signals;
pub(crate) mod sync;
pub mod tensorboard;
pub mod trainer;
