mod base;
mod reader;
mod writer;

pub use base::*;
pub use reader::*;
pub use writer::*;
