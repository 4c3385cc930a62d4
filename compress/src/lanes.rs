//! The value lanes of a summable method's payload (pattern C of ALGORITHMS.md §0.4):
//! their number format, where they lie in a payload, and their element-wise sum — what the
//! all-reduce of a summable method adds up in place.

use std::ops::Range;

use crate::compressor::{Compressor, Header};
use crate::error::WireError;
use crate::wire::Reader;

/// The number format of a summable method's value lanes ([`Compressor::lane_format`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LaneFormat {
    /// Little-endian `f32`, summed in `f32`.
    #[default]
    F32,
    /// Little-endian bfloat16, rounded to nearest even: the all-reduce moves bfloat16 and
    /// rounds each sum it forwards to bfloat16 (PyTorch's `bf16_compress_wrapper` around a
    /// hook all-reduces the bfloat16 tensors themselves).
    Bf16,
}

impl LaneFormat {
    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            LaneFormat::F32 => 4,
            LaneFormat::Bf16 => 2,
        }
    }

    /// Appends the values of `lane` (whole values of this format) to `out`.
    pub fn read(self, lane: &[u8], out: &mut Vec<f32>) {
        match self {
            LaneFormat::F32 => out.extend(
                lane.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
            LaneFormat::Bf16 => out.extend(
                lane.chunks_exact(2)
                    .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
            ),
        }
    }

    /// Writes `values` over `lane` (room for exactly as many), rounding to the format.
    ///
    /// # Panics
    /// If `values` runs out before `lane` is filled.
    pub fn write(self, values: &mut impl Iterator<Item = f32>, lane: &mut [u8]) {
        let mut next = || values.next().expect("lane length");
        match self {
            LaneFormat::F32 => {
                for c in lane.chunks_exact_mut(4) {
                    c.copy_from_slice(&next().to_le_bytes());
                }
            }
            LaneFormat::Bf16 => {
                for c in lane.chunks_exact_mut(2) {
                    c.copy_from_slice(&half::bf16::from_f32(next()).to_bits().to_le_bytes());
                }
            }
        }
    }

    /// `x` rounded to this format (what a value becomes once written and read back).
    pub fn round(self, x: f32) -> f32 {
        match self {
            LaneFormat::F32 => x,
            LaneFormat::Bf16 => half::bf16::from_f32(x).to_f32(),
        }
    }
}

/// The `f32` value lanes of a payload from a [`Aggregation::Summable`](crate::Aggregation::Summable) method, one byte
/// range per segment. Payloads of all ranks have identical lanes (that is what summable
/// means), so an all-reduce can sum these ranges in place and any rank can then decode the
/// summed payload once.
pub fn summable_lanes(c: &dyn Compressor, bytes: &[u8]) -> Result<Vec<Range<usize>>, WireError> {
    let mut r = Reader::new(bytes);
    let h = Header::parse(&mut r)?;
    if h.method != c.method().0 {
        return Err(WireError::WrongMethod {
            expected: c.method().0,
            found: h.method,
        });
    }
    let lens: Vec<usize> = if h.segments > 1 {
        let t = r.take_items(h.segments, 4, "segment table")?;
        (0..h.segments)
            .map(|i| crate::wire::u32_at(t, i) as usize)
            .collect()
    } else if h.n > 0 {
        vec![h.n]
    } else {
        Vec::new()
    };
    if lens.iter().try_fold(0usize, |a, &l| a.checked_add(l)) != Some(h.n) {
        return Err(WireError::BadSegments("segments do not cover n"));
    }
    let mut lanes = Vec::with_capacity(lens.len());
    for len in lens {
        let lane = c.segment_lane(&mut r, len)?;
        if lane.len() % c.lane_format().bytes() != 0 {
            return Err(WireError::Invalid("lane is not whole values of its format"));
        }
        lanes.push(lane);
    }
    if r.remaining() != 0 {
        return Err(WireError::TrailingBytes(r.remaining()));
    }
    Ok(lanes)
}

/// Adds the value lanes of `other` into those of `acc` (both from the same summable method
/// with identical lanes), as one all-reduce step would.
pub fn sum_lanes(c: &dyn Compressor, acc: &mut [u8], other: &[u8]) -> Result<(), WireError> {
    let la = summable_lanes(c, acc)?;
    let lb = summable_lanes(c, other)?;
    if la != lb {
        return Err(WireError::Invalid("payloads have different summable lanes"));
    }
    let fmt = c.lane_format();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for lane in la {
        a.clear();
        b.clear();
        fmt.read(&acc[lane.clone()], &mut a);
        fmt.read(&other[lane.clone()], &mut b);
        fmt.write(&mut a.iter().zip(&b).map(|(x, y)| x + y), &mut acc[lane]);
    }
    Ok(())
}
