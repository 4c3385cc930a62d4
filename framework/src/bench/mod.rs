//! Benchmarks behind `dtrain bench …`.

pub mod allreduce;
pub mod compress;
pub mod exchange;
pub mod gradient;
