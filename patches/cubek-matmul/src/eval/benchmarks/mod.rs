//! Benchmark catalogues that compare both architectures on one table. The
//! single-architecture catalogues live under [`crate::tiled::eval`] and
//! [`crate::multi_level::eval`].

pub mod gemm;
pub mod gemm_cpu;
