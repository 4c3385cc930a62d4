mod optional_stage;
mod stage_family;
mod stage_memory;
mod strided_stage_family;

pub use stage_family::*;
pub use stage_memory::*;
pub use strided_stage_family::*;
