mod matmul;
mod setup;

pub use matmul::*;
pub use setup::DoubleBufferingMatmulFamily;
