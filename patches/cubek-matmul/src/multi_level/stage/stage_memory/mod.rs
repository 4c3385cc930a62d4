mod config;
mod layout;
mod memory;
mod swizzle;

pub use config::StageMemoryConfig;
pub use layout::*;
pub use memory::*;
pub use swizzle::*;
