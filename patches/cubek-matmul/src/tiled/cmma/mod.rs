mod base;
mod kernel;
mod launch;

pub use base::{CmmaBlueprint, CmmaDelivery, CmmaRoutine, CmmaStrategy, Partition, StoredTiles};
pub use launch::launch_ref;
