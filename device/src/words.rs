//! What every kernel of this crate shares: the launch geometry of a grid-stride loop, and
//! byte streams (payload bodies) held on the device as little-endian `u32` words, so that a
//! unit writes whole words and no two units share one.

use cubecl::prelude::*;

/// Units per cube of every kernel here.
pub(crate) const UNITS: u32 = 256;

/// Cubes in the x dimension a launch may use (the least maximum of the runtimes: wgpu's
/// limit is 65 535 per dimension); larger jobs loop, each unit striding by the grid.
const MAX_CUBES: usize = 65_535;

/// The cube count and dimension for `items` independent units of work, each unit looping
/// over `i, i + grid, …` (see [`grid_stride`]).
pub(crate) fn geometry(items: usize) -> (CubeCount, CubeDim) {
    let cubes = items.div_ceil(UNITS as usize).clamp(1, MAX_CUBES) as u32;
    (CubeCount::Static(cubes, 1, 1), CubeDim::new_1d(UNITS))
}

/// The stride of a grid-stride loop: every unit of the launch.
#[cube]
pub(crate) fn grid_stride() -> usize {
    CUBE_COUNT * CUBE_DIM as usize
}

/// Words holding `bytes` bytes.
pub(crate) fn words_for(bytes: usize) -> usize {
    bytes.div_ceil(4)
}

/// `bytes` packed into little-endian words, the last one padded with zeros.
pub(crate) fn to_words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect()
}

/// The segment of a sorted table of starts that `i` falls in: the largest `s` with
/// `starts[s] <= i`, for `starts[0] = 0 <= i < starts[last]` (binary search).
#[cube]
pub(crate) fn segment_of(starts: &[u32], i: u32) -> u32 {
    let mut lo = 0u32;
    let mut hi = starts.len() as u32 - 1;
    // Invariant: starts[lo] <= i < starts[hi].
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if starts[mid as usize] <= i {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}
