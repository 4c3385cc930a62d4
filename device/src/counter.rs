//! The counter-based draws on the device: `dtrain_compress::rng::counter_bits` in cube code
//! (32-bit operations only), for the codecs' `draws = "counter"` mode.

use cubecl::prelude::*;

/// Wellons' `lowbias32`: a bijective 32-bit mix (the host's round, constant for constant).
#[cube]
fn lowbias32(x: u32) -> u32 {
    let mut h = x;
    h ^= h >> 16;
    h *= 0x7feb_352d;
    h ^= h >> 15;
    h *= 0x846c_a68b;
    h ^= h >> 16;
    h
}

/// The 32 random bits of element `j` under the key `k1 << 32 | k0`: the host's
/// `counter_bits(key, j)`.
#[cube]
pub(crate) fn counter_bits(k0: u32, k1: u32, j: u32) -> u32 {
    lowbias32(lowbias32(j ^ k0) + k1)
}
