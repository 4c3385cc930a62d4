mod base;
mod kernel;
mod launch;

pub use base::{CpuGemmBlueprint, CpuGemmRoutine, CpuGemmStrategy, InstructionShape, PlaneGrid};
pub use launch::launch_ref;
