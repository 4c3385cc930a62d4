mod full_reader;
mod partial_reader;
mod shared;

pub use full_reader::*;
pub use partial_reader::*;
pub use shared::*;
