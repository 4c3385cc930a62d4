use cubecl::prelude::*;

use crate::multi_level::tile::StridedTile;
use cubek_std::as_cmma_layout;

/// Writer using the cmma store function.
#[derive(CubeType)]
pub struct CmmaStageWriter {}

#[cube]
impl CmmaStageWriter {
    pub fn store_fragment<E: Numeric, V: Numeric, N: Size>(
        tile: &mut StridedTile<V, N>,
        fragment: &cmma::Matrix<E>,
    ) {
        let layout = as_cmma_layout(tile.layout);
        let stride = tile.unvectorized_stride();
        let slice = tile.as_slice_mut();
        cmma::store(slice, fragment, stride, layout);
    }
}
