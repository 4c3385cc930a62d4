//! Benchmarks behind `dtrain bench …`.

pub mod compress;
pub mod gradient;
