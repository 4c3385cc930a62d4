//! Sparse vectors over a dense length, and the chunk encoding the sparse all-reduce
//! ([`crate::algo::sparse_allreduce`]) puts on the wire.
//!
//! A sparse vector of dimension `dim` is a list of strictly increasing `u32` indices below
//! `dim`, each with one `f32` value; absent entries are `+0.0`. [`SparseSlice`] borrows one
//! (what the collectives take), [`SparseVec`] owns one (what they return). Both check the
//! invariants when built, so a collective never sees an unsorted or out-of-range index.
//!
//! # Chunk encoding
//! A sparse all-reduce message carries the entries of one *chunk*: a contiguous index range
//! `[start, start + len)` that both ends derive from the dense length, the world size and
//! the chunk size (the header names `start` in its `offset` field). The payload is one of
//!
//! ```text
//! pairs:  u8 = 1 | u32 nnz | nnz × u32 index (strictly increasing, inside the chunk) | nnz × f32 value
//! dense:  u8 = 2 | len × f32 value
//! delta:  u8 = 3 | u32 nnz | nnz × LEB128 gap | nnz × f32 value
//! ```
//!
//! all little-endian; `pairs` indices are absolute (not relative to the chunk). A `delta`
//! gap is the distance to the previous index minus one, the first one counted from the
//! chunk's start (`index₀ = start + gap₀`, `indexᵢ = indexᵢ₋₁ + 1 + gapᵢ`), as an unsigned
//! LEB128 varint (7 bits per byte, at most 5 bytes, no redundant trailing zero bytes): at 1 %
//! density a gap takes one or two bytes instead of four, and the merged partitions of the
//! reduction, denser still, take about one. The sender picks the smallest of the three
//! (ties: dense, then delta), so dense once its `4·len` bytes are no more than the sparse
//! forms (the Kylix density switch). The encoding never changes the numeric result: a dense chunk carries
//! `+0.0` for absent entries, and the sums these chunks feed start at `+0.0` and so are
//! never `−0.0`, which makes adding `+0.0` an exact no-op (see the summation order in
//! [`crate::algo::sparse_allreduce`]). Decoding checks the tag, the count against the chunk
//! length and the payload length, and every index (inside the chunk, strictly increasing);
//! it never panics and allocates only after the sizes are checked.

use std::ops::Range;

use thiserror::Error;

use crate::wire::{extend_f32_le, Header, Message, WireError};

/// Largest dimension a sparse vector may have: indices are `u32`.
pub const MAX_DIM: u64 = 1 << 32;

/// Tag of a chunk encoded as (index, value) pairs.
const PAIRS: u8 = 1;
/// Tag of a chunk encoded densely.
const DENSE: u8 = 2;
/// Tag of a chunk encoded as LEB128 index gaps and values.
const DELTA: u8 = 3;

/// Why a list of indices and values is not a valid sparse vector.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SparseError {
    /// Indices and values differ in number.
    #[error("{indices} indices but {values} values")]
    LengthMismatch {
        /// Number of indices.
        indices: usize,
        /// Number of values.
        values: usize,
    },
    /// An index is not below the dimension.
    #[error("index {index} at position {position} is out of range for dimension {dim}")]
    OutOfRange {
        /// Position in the index list.
        position: usize,
        /// The index.
        index: u32,
        /// The dimension.
        dim: usize,
    },
    /// An index is not larger than its predecessor (unsorted or duplicate).
    #[error("indices not strictly increasing at position {position}: {prev} then {index}")]
    NotIncreasing {
        /// Position of the offending index.
        position: usize,
        /// The index before it.
        prev: u32,
        /// The offending index.
        index: u32,
    },
    /// The dimension does not fit the `u32` index space ([`MAX_DIM`]).
    #[error("dimension {0} exceeds the u32 index space")]
    DimTooLarge(usize),
}

fn validate(dim: usize, indices: &[u32], values: &[f32]) -> Result<(), SparseError> {
    if dim as u64 > MAX_DIM {
        return Err(SparseError::DimTooLarge(dim));
    }
    if indices.len() != values.len() {
        return Err(SparseError::LengthMismatch {
            indices: indices.len(),
            values: values.len(),
        });
    }
    for (position, &index) in indices.iter().enumerate() {
        if index as usize >= dim {
            return Err(SparseError::OutOfRange {
                position,
                index,
                dim,
            });
        }
        if position > 0 && indices[position - 1] >= index {
            return Err(SparseError::NotIncreasing {
                position,
                prev: indices[position - 1],
                index,
            });
        }
    }
    Ok(())
}

fn densify(dim: usize, indices: &[u32], values: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; dim];
    for (&i, &v) in indices.iter().zip(values) {
        out[i as usize] = v;
    }
    out
}

/// A borrowed sparse vector: strictly increasing indices below [`dim`](Self::dim), one value
/// each (checked by [`SparseSlice::new`]).
///
/// ```
/// use dtrain_comms::sparse::SparseSlice;
/// let v = SparseSlice::new(5, &[1, 3], &[2.0, -1.0]).unwrap();
/// assert_eq!(v.to_dense(), vec![0.0, 2.0, 0.0, -1.0, 0.0]);
/// assert!(SparseSlice::new(5, &[3, 1], &[2.0, -1.0]).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SparseSlice<'a> {
    dim: usize,
    indices: &'a [u32],
    values: &'a [f32],
}

impl<'a> SparseSlice<'a> {
    /// Checks and wraps `indices` and `values` as a vector of dimension `dim`.
    pub fn new(dim: usize, indices: &'a [u32], values: &'a [f32]) -> Result<Self, SparseError> {
        validate(dim, indices, values)?;
        Ok(SparseSlice {
            dim,
            indices,
            values,
        })
    }

    /// The dense length.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Number of stored entries.
    pub fn nnz(&self) -> usize {
        self.indices.len()
    }

    /// The stored indices (strictly increasing).
    pub fn indices(&self) -> &'a [u32] {
        self.indices
    }

    /// The stored values, one per index.
    pub fn values(&self) -> &'a [f32] {
        self.values
    }

    /// The dense vector (absent entries `+0.0`).
    pub fn to_dense(&self) -> Vec<f32> {
        densify(self.dim, self.indices, self.values)
    }

    /// An owned copy.
    pub fn to_sparse_vec(&self) -> SparseVec {
        SparseVec {
            dim: self.dim,
            indices: self.indices.to_vec(),
            values: self.values.to_vec(),
        }
    }

    /// The stored entries whose index lies in `range` (a binary search on each end).
    pub(crate) fn entries_in(&self, range: &Range<usize>) -> (&'a [u32], &'a [f32]) {
        let lo = self
            .indices
            .partition_point(|&i| (i as usize) < range.start);
        let hi = self.indices.partition_point(|&i| (i as usize) < range.end);
        (&self.indices[lo..hi], &self.values[lo..hi])
    }
}

/// An owned sparse vector (same invariants as [`SparseSlice`]).
///
/// ```
/// use dtrain_comms::sparse::SparseVec;
/// let v = SparseVec::from_dense(&[0.0, 2.0, 0.0, -0.0]).unwrap();
/// assert_eq!(v.indices(), &[1, 3]); // only +0.0 is left out
/// assert_eq!(v.dim(), 4);
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SparseVec {
    dim: usize,
    indices: Vec<u32>,
    values: Vec<f32>,
}

impl SparseVec {
    /// Checks and wraps `indices` and `values` as a vector of dimension `dim`.
    pub fn new(dim: usize, indices: Vec<u32>, values: Vec<f32>) -> Result<Self, SparseError> {
        validate(dim, &indices, &values)?;
        Ok(SparseVec {
            dim,
            indices,
            values,
        })
    }

    /// The entries of `dense` that are not `+0.0` (bit pattern 0): `−0.0` and NaN are kept.
    pub fn from_dense(dense: &[f32]) -> Result<Self, SparseError> {
        if dense.len() as u64 > MAX_DIM {
            return Err(SparseError::DimTooLarge(dense.len()));
        }
        let mut v = SparseVec {
            dim: dense.len(),
            ..SparseVec::default()
        };
        push_nonzero(dense, 0, &mut v.indices, &mut v.values);
        Ok(v)
    }

    /// Borrows it as a [`SparseSlice`].
    pub fn as_slice(&self) -> SparseSlice<'_> {
        SparseSlice {
            dim: self.dim,
            indices: &self.indices,
            values: &self.values,
        }
    }

    /// The dense length.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Number of stored entries.
    pub fn nnz(&self) -> usize {
        self.indices.len()
    }

    /// The stored indices (strictly increasing).
    pub fn indices(&self) -> &[u32] {
        &self.indices
    }

    /// The stored values, one per index.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// The dense vector (absent entries `+0.0`).
    pub fn to_dense(&self) -> Vec<f32> {
        densify(self.dim, &self.indices, &self.values)
    }

    /// Wraps parts the caller guarantees to be valid (checked in debug builds only).
    pub(crate) fn from_valid_parts(dim: usize, indices: Vec<u32>, values: Vec<f32>) -> Self {
        debug_assert_eq!(validate(dim, &indices, &values), Ok(()));
        SparseVec {
            dim,
            indices,
            values,
        }
    }

    /// `(dim, indices, values)`.
    pub fn into_parts(self) -> (usize, Vec<u32>, Vec<f32>) {
        (self.dim, self.indices, self.values)
    }
}

/// Appends `(base + k, dense[k])` for every `dense[k]` that is not `+0.0`.
fn push_nonzero(dense: &[f32], base: usize, indices: &mut Vec<u32>, values: &mut Vec<f32>) {
    for (k, &v) in dense.iter().enumerate() {
        if v.to_bits() != 0 {
            // Callers keep `base + dense.len() <= MAX_DIM`.
            indices.push((base + k) as u32);
            values.push(v);
        }
    }
}

/// Bytes of `v` as an unsigned LEB128 varint.
fn varint_len(v: u32) -> usize {
    match v {
        0..=0x7f => 1,
        0x80..=0x3fff => 2,
        0x4000..=0x1f_ffff => 3,
        0x20_0000..=0xfff_ffff => 4,
        _ => 5,
    }
}

/// The gaps of the strictly increasing `indices` (all `≥ start`) as the delta encoding
/// defines them.
fn gaps(start: usize, indices: &[u32]) -> impl Iterator<Item = u32> + '_ {
    let mut next = start as u64;
    indices.iter().map(move |&i| {
        let gap = (i as u64 - next) as u32;
        next = i as u64 + 1;
        gap
    })
}

/// Payload length of `nnz` pairs.
fn pairs_len(nnz: usize) -> usize {
    1 + 4 + 8 * nnz
}

/// Which encoding a chunk is sent in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Pairs,
    Delta,
    Dense,
}

/// The smallest encoding of a chunk of `len` elements whose entries have the (strictly
/// increasing) `indices` from `start` on: dense if it is no larger than both sparse forms,
/// else delta unless pairs is strictly smaller (gaps of 2²⁸ and more).
fn choose(start: usize, len: usize, indices: &[u32]) -> Form {
    let dense = 1 + 4 * len as u64;
    let pairs = pairs_len(indices.len()) as u64;
    if dense <= pairs.min(1 + 4 + 5 * indices.len() as u64) {
        // Even one-byte gaps cannot beat dense.
        return Form::Dense;
    }
    let delta = 1
        + 4
        + 4 * indices.len() as u64
        + gaps(start, indices)
            .map(|g| varint_len(g) as u64)
            .sum::<u64>();
    if dense <= delta.min(pairs) {
        Form::Dense
    } else if pairs < delta {
        Form::Pairs
    } else {
        Form::Delta
    }
}

/// Encodes the entries `(indices, values)`, all inside `range`, as one chunk message in the
/// smallest encoding.
pub(crate) fn encode_entries(
    header: Header,
    range: &Range<usize>,
    indices: &[u32],
    values: &[f32],
) -> Message {
    match choose(range.start, range.len(), indices) {
        Form::Dense => {
            let mut dense = vec![0.0f32; range.len()];
            for (&i, &v) in indices.iter().zip(values) {
                dense[i as usize - range.start] = v;
            }
            dense_message(header, &dense)
        }
        Form::Pairs => pairs_message(header, indices, values),
        Form::Delta => delta_message(header, range.start, indices, values),
    }
}

fn dense_message(header: Header, values: &[f32]) -> Message {
    Message::build(header, 1 + 4 * values.len(), |out| {
        out.push(DENSE);
        extend_f32_le(out, values);
    })
}

fn pairs_message(header: Header, indices: &[u32], values: &[f32]) -> Message {
    Message::build(header, pairs_len(indices.len()), |out| {
        out.push(PAIRS);
        out.extend_from_slice(&(indices.len() as u32).to_le_bytes());
        for i in indices {
            out.extend_from_slice(&i.to_le_bytes());
        }
        extend_f32_le(out, values);
    })
}

fn delta_message(header: Header, start: usize, indices: &[u32], values: &[f32]) -> Message {
    let gap_bytes: usize = gaps(start, indices).map(varint_len).sum();
    Message::build(header, 1 + 4 + gap_bytes + 4 * values.len(), |out| {
        out.push(DELTA);
        out.extend_from_slice(&(indices.len() as u32).to_le_bytes());
        for mut g in gaps(start, indices) {
            while g >= 0x80 {
                out.push((g as u8 & 0x7f) | 0x80);
                g >>= 7;
            }
            out.push(g as u8);
        }
        extend_f32_le(out, values);
    })
}

/// A decoded chunk: the entries of one index range, in either encoding.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Chunk {
    /// Stored entries (strictly increasing absolute indices inside the chunk).
    Pairs {
        /// Absolute indices.
        indices: Vec<u32>,
        /// One value per index.
        values: Vec<f32>,
    },
    /// One value per element of the chunk (absent entries `+0.0`).
    Dense(Vec<f32>),
}

impl Chunk {
    /// The chunk of a sum over `[base, base + sum.len())`, stored densely when that is its
    /// smallest encoding; only entries that are not `+0.0` count (and are listed) as stored.
    pub(crate) fn from_sum(base: usize, sum: Vec<f32>) -> Chunk {
        let nnz = sum.iter().filter(|v| v.to_bits() != 0).count();
        // Even one-byte gaps (5 bytes an entry) cannot beat dense.
        if 4 * sum.len() <= 4 + 5 * nnz {
            return Chunk::Dense(sum);
        }
        let mut indices = Vec::with_capacity(nnz);
        let mut values = Vec::with_capacity(nnz);
        push_nonzero(&sum, base, &mut indices, &mut values);
        if choose(base, sum.len(), &indices) == Form::Dense {
            return Chunk::Dense(sum);
        }
        Chunk::Pairs { indices, values }
    }

    /// The chunk of the entries `(indices, values)` (all inside `range`, none `+0.0`), stored
    /// as [`Chunk::from_sum`] stores their dense form.
    pub(crate) fn from_entries(range: &Range<usize>, indices: Vec<u32>, values: Vec<f32>) -> Chunk {
        if choose(range.start, range.len(), &indices) != Form::Dense {
            return Chunk::Pairs { indices, values };
        }
        let mut dense = vec![0.0f32; range.len()];
        for (&i, &v) in indices.iter().zip(&values) {
            dense[i as usize - range.start] = v;
        }
        Chunk::Dense(dense)
    }

    /// The chunk, which covers `range`, as a message with `header` in its smallest encoding.
    pub(crate) fn to_message(&self, header: Header, range: &Range<usize>) -> Message {
        match self {
            Chunk::Pairs { indices, values } => encode_entries(header, range, indices, values),
            Chunk::Dense(values) => dense_message(header, values),
        }
    }

    /// `acc[i − base] += v` for every entry `(i, v)` (every element, for a dense chunk), in
    /// index order. `acc` must cover the chunk.
    pub(crate) fn add_to(&self, acc: &mut [f32], base: usize) {
        match self {
            Chunk::Pairs { indices, values } => {
                for (&i, &v) in indices.iter().zip(values) {
                    acc[i as usize - base] += v;
                }
            }
            Chunk::Dense(values) => {
                for (a, &v) in acc.iter_mut().zip(values) {
                    *a += v;
                }
            }
        }
    }

    /// Writes the chunk densely into `out`, which covers exactly the chunk starting at `base`.
    pub(crate) fn write_dense(&self, out: &mut [f32], base: usize) {
        match self {
            Chunk::Pairs { indices, values } => {
                out.fill(0.0);
                for (&i, &v) in indices.iter().zip(values) {
                    out[i as usize - base] = v;
                }
            }
            Chunk::Dense(values) => out.copy_from_slice(values),
        }
    }

    /// Appends the entries that are not `+0.0`, in index order.
    pub(crate) fn push_nonzero(&self, base: usize, idx: &mut Vec<u32>, vals: &mut Vec<f32>) {
        match self {
            Chunk::Pairs { indices, values } => {
                for (&i, &v) in indices.iter().zip(values) {
                    if v.to_bits() != 0 {
                        idx.push(i);
                        vals.push(v);
                    }
                }
            }
            Chunk::Dense(values) => push_nonzero(values, base, idx, vals),
        }
    }

    /// Upper bound on the entries [`Chunk::push_nonzero`] appends.
    pub(crate) fn stored(&self) -> usize {
        match self {
            Chunk::Pairs { indices, .. } => indices.len(),
            Chunk::Dense(values) => values.len(),
        }
    }
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// Decodes the payload of a chunk covering `range` (layout in the [module docs](self)).
/// Rejects, without panicking, anything but a well-formed chunk of exactly that range.
pub(crate) fn decode_chunk(payload: &[u8], range: &Range<usize>) -> Result<Chunk, WireError> {
    let Some((&tag, body)) = payload.split_first() else {
        return Err(WireError::Payload("empty sparse chunk"));
    };
    match tag {
        DENSE => {
            if body.len() as u64 != range.len() as u64 * 4 {
                return Err(WireError::Payload(
                    "dense sparse chunk length differs from the chunk's",
                ));
            }
            Ok(Chunk::Dense(
                body.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ))
        }
        PAIRS => {
            if body.len() < 4 {
                return Err(WireError::Payload("sparse chunk shorter than its count"));
            }
            let nnz = u32_at(body, 0) as usize;
            if nnz > range.len() {
                return Err(WireError::Payload(
                    "sparse chunk counts more entries than the chunk has elements",
                ));
            }
            // nnz <= range.len() <= MAX_DIM: no overflow on 64-bit targets; checked anyway.
            let want = nnz.checked_mul(8).and_then(|b| b.checked_add(4));
            if want != Some(body.len()) {
                return Err(WireError::Payload(
                    "sparse chunk length does not match its count",
                ));
            }
            let (ib, vb) = body[4..].split_at(4 * nnz);
            let mut indices = Vec::with_capacity(nnz);
            for c in ib.chunks_exact(4) {
                let i = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                if !range.contains(&(i as usize)) {
                    return Err(WireError::Payload("sparse chunk index outside the chunk"));
                }
                if indices.last().is_some_and(|&p| p >= i) {
                    return Err(WireError::Payload(
                        "sparse chunk indices not strictly increasing",
                    ));
                }
                indices.push(i);
            }
            let values = vb
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            Ok(Chunk::Pairs { indices, values })
        }
        DELTA => decode_delta(body, range),
        _ => Err(WireError::Payload("unknown sparse chunk encoding")),
    }
}

/// Decodes the body of a delta chunk (after the tag) covering `range`.
fn decode_delta(body: &[u8], range: &Range<usize>) -> Result<Chunk, WireError> {
    if body.len() < 4 {
        return Err(WireError::Payload("sparse chunk shorter than its count"));
    }
    let nnz = u32_at(body, 0) as usize;
    if nnz > range.len() {
        return Err(WireError::Payload(
            "sparse chunk counts more entries than the chunk has elements",
        ));
    }
    // Every gap takes at least one byte: the values start at or before len − 4·nnz.
    let Some(gap_end) = body.len().checked_sub(4 * nnz) else {
        return Err(WireError::Payload("delta chunk shorter than its values"));
    };
    if gap_end < 4 + nnz {
        return Err(WireError::Payload("delta chunk shorter than its gaps"));
    }
    let (gb, vb) = body[4..].split_at(gap_end - 4);
    let mut indices = Vec::with_capacity(nnz);
    let mut next = range.start as u64;
    let mut pos = 0;
    for _ in 0..nnz {
        let mut gap = 0u64;
        let mut shift = 0;
        loop {
            let Some(&b) = gb.get(pos) else {
                return Err(WireError::Payload("delta chunk gap runs past its gaps"));
            };
            pos += 1;
            if shift == 28 && b > 0x0f {
                return Err(WireError::Payload("delta chunk gap exceeds 32 bits"));
            }
            if shift > 0 && b == 0 {
                return Err(WireError::Payload(
                    "delta chunk gap has a redundant zero byte",
                ));
            }
            gap |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                break;
            }
            shift += 7;
        }
        let i = next + gap;
        if i >= range.end as u64 {
            return Err(WireError::Payload("sparse chunk index outside the chunk"));
        }
        indices.push(i as u32);
        next = i + 1;
    }
    if pos != gb.len() {
        return Err(WireError::Payload(
            "delta chunk length does not match its gaps and count",
        ));
    }
    let values = vb
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(Chunk::Pairs { indices, values })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Algo, Kind};
    use proptest::prelude::*;

    fn header() -> Header {
        Header::new(Kind::SparseAllReduce, Algo::Direct, 0)
    }

    #[test]
    fn slices_reject_bad_index_lists() {
        assert!(SparseSlice::new(3, &[0, 2], &[1.0, 2.0]).is_ok());
        assert!(SparseSlice::new(0, &[], &[]).is_ok());
        assert_eq!(
            SparseSlice::new(3, &[0, 3], &[1.0, 2.0]),
            Err(SparseError::OutOfRange {
                position: 1,
                index: 3,
                dim: 3
            })
        );
        assert!(matches!(
            SparseSlice::new(3, &[1, 1], &[1.0, 2.0]),
            Err(SparseError::NotIncreasing { position: 1, .. })
        ));
        assert!(matches!(
            SparseVec::new(3, vec![2, 1], vec![1.0, 2.0]),
            Err(SparseError::NotIncreasing { .. })
        ));
        assert!(matches!(
            SparseSlice::new(3, &[1], &[]),
            Err(SparseError::LengthMismatch { .. })
        ));
    }

    #[test]
    fn encoding_picks_the_smallest_form() {
        let range = 10..18; // 8 elements: dense is 33 bytes
        let m = encode_entries(header(), &range, &[11, 12, 15], &[1.0, 2.0, 3.0]);
        assert_eq!(m.payload()[0], DELTA);
        // tag, count, gaps 1, 0, 2 (one byte each), three values.
        assert_eq!(m.payload().len(), 1 + 4 + 3 + 12);
        assert_eq!(m.payload()[5..8], [1, 0, 2]);
        // 6 of 8: delta 1 + 4 + 6 + 24 = 35 > 33.
        let idx6 = [10, 11, 12, 14, 15, 17];
        let m6 = encode_entries(header(), &range, &idx6, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(m6.payload()[0], DENSE);
        assert_eq!(m6.payload().len(), 1 + 8 * 4);
        // Both decode to the same dense values as the entries.
        for (m, idx) in [(m, &[11u32, 12, 15][..]), (m6, &idx6[..])] {
            let mut out = vec![9.0; 8];
            decode_chunk(m.payload(), &range)
                .unwrap()
                .write_dense(&mut out, 10);
            let mut want = vec![0.0; 8];
            for (k, &i) in idx.iter().enumerate() {
                want[i as usize - 10] = k as f32 + 1.0;
            }
            assert_eq!(out, want);
        }
        // Gaps of 2^28 and more take 5 bytes: pairs are smaller there.
        let far = 0..(1usize << 30);
        let idx = [(1u32 << 28) + 5, (1 << 29) + 10];
        assert_eq!(choose(far.start, far.len(), &idx), Form::Pairs);
        let m = encode_entries(header(), &far, &idx, &[1.0, 2.0]);
        assert_eq!(m.payload()[0], PAIRS);
        assert_eq!(
            decode_chunk(m.payload(), &far),
            Ok(Chunk::Pairs {
                indices: idx.to_vec(),
                values: vec![1.0, 2.0]
            })
        );
        // Multi-byte gaps round-trip through delta.
        let idx = [3u32, 200, 20_000, 3_000_000, (1 << 28) - 1];
        let m = encode_entries(header(), &far, &idx, &[1.0; 5]);
        assert_eq!(m.payload()[0], DELTA);
        assert_eq!(m.payload().len(), 1 + 4 + (1 + 2 + 3 + 4 + 4) + 20);
        assert_eq!(
            decode_chunk(m.payload(), &far),
            Ok(Chunk::Pairs {
                indices: idx.to_vec(),
                values: vec![1.0; 5]
            })
        );
        let c = Chunk::from_sum(10, vec![0.0, 1.0, 0.0, 0.0]);
        assert_eq!(
            c,
            Chunk::Pairs {
                indices: vec![11],
                values: vec![1.0]
            }
        );
        assert_eq!(
            decode_chunk(c.to_message(header(), &(10..14)).payload(), &(10..14)),
            Ok(c)
        );
        assert!(matches!(
            Chunk::from_sum(0, vec![1.0, 0.0]),
            Chunk::Dense(_)
        ));
    }

    #[test]
    fn malformed_chunks_are_rejected() {
        let r = 4..8;
        let pairs = |n: u32, idx: &[u32]| {
            let mut b = vec![PAIRS];
            b.extend_from_slice(&n.to_le_bytes());
            for i in idx {
                b.extend_from_slice(&i.to_le_bytes());
            }
            b.extend(std::iter::repeat_n(0u8, 4 * idx.len()));
            b
        };
        assert!(decode_chunk(&pairs(2, &[4, 7]), &r).is_ok());
        for bad in [
            vec![],
            vec![PAIRS],
            vec![4, 0, 0, 0, 0], // unknown tag
            vec![DENSE, 0, 0, 0],
            pairs(2, &[4]),        // count says 2, one entry
            pairs(1, &[4, 5]),     // count says 1, two entries
            pairs(9, &[]),         // count over the chunk length
            pairs(2, &[5, 5]),     // duplicate
            pairs(2, &[6, 5]),     // unsorted
            pairs(1, &[8]),        // past the end
            pairs(1, &[3]),        // before the start
            pairs(u32::MAX, &[4]), // huge count
        ] {
            assert!(decode_chunk(&bad, &r).is_err(), "{bad:?}");
        }
        let mut truncated = pairs(2, &[4, 7]);
        truncated.pop();
        assert!(decode_chunk(&truncated, &r).is_err());
        let delta = |n: u32, gaps: &[u8], values: usize| {
            let mut b = vec![DELTA];
            b.extend_from_slice(&n.to_le_bytes());
            b.extend_from_slice(gaps);
            b.extend(std::iter::repeat_n(0u8, 4 * values));
            b
        };
        assert!(decode_chunk(&delta(2, &[0, 2], 2), &r).is_ok()); // 4, 7
        for bad in [
            delta(2, &[0, 3], 2),                         // 4, 8: past the end
            delta(2, &[0], 2),                            // one gap for two entries
            delta(1, &[0, 0], 1),                         // a gap byte left over
            delta(1, &[0x80], 1),                         // gap runs past the gaps
            delta(1, &[0x81, 0x00], 1),                   // redundant zero byte
            delta(1, &[0xff, 0xff, 0xff, 0xff, 0x1f], 1), // over 32 bits
            delta(5, &[0, 0, 0, 0, 0], 5),                // more entries than elements
            delta(2, &[0, 0], 1),                         // a value short
        ] {
            assert!(decode_chunk(&bad, &r).is_err(), "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn hostile_chunks_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..80),
            tag in prop_oneof![Just(PAIRS), Just(DENSE), Just(DELTA), any::<u8>()],
            nnz in prop_oneof![0u32..12, any::<u32>()],
            start in prop_oneof![0usize..20, Just(u32::MAX as usize - 40)],
            len in 0usize..20,
        ) {
            let range = start..start + len;
            let _ = decode_chunk(&bytes, &range);
            // Also with a well-formed prefix, so that the index checks are reached.
            let mut b = vec![tag];
            b.extend_from_slice(&nnz.to_le_bytes());
            b.extend_from_slice(&bytes);
            if let Ok(c) = decode_chunk(&b, &range) {
                // Whatever is accepted is usable without panicking.
                let mut acc = vec![0.0; len];
                c.add_to(&mut acc, start);
                c.write_dense(&mut acc, start);
                let (mut i, mut v) = (Vec::new(), Vec::new());
                c.push_nonzero(start, &mut i, &mut v);
                prop_assert!(SparseVec::new(start + len, i, v).is_ok());
            }
        }

        #[test]
        fn chunks_round_trip(
            len in 0usize..40,
            mask in any::<u64>(),
            start in 0usize..100,
        ) {
            let range = start..start + len;
            let indices: Vec<u32> = range.clone().filter(|i| mask >> (i % 64) & 1 == 1).map(|i| i as u32).collect();
            let values: Vec<f32> = indices.iter().map(|&i| i as f32 - 50.0).collect();
            let m = encode_entries(header(), &range, &indices, &values);
            let c = decode_chunk(m.payload(), &range).unwrap();
            let mut dense = vec![0.0; len];
            c.write_dense(&mut dense, start);
            let mut want = vec![0.0; len];
            for (&i, &v) in indices.iter().zip(&values) {
                want[i as usize - start] = v;
            }
            prop_assert_eq!(dense, want);
            prop_assert!(m.payload().len() <= 1 + 4 * len);
            prop_assert!(m.payload().len() <= pairs_len(indices.len()));
        }

        #[test]
        fn sparse_chunks_round_trip_exactly(
            start in 0usize..1000,
            gaps in proptest::collection::vec(prop_oneof![0u32..4, 0u32..300, 0u32..70_000, 0u32..(1 << 29)], 0..30),
        ) {
            // Indices with gaps of every varint width; the chunk ends one past the last.
            let mut indices = Vec::new();
            let mut next = start as u64;
            for g in gaps {
                let i = next + g as u64;
                if i >= u32::MAX as u64 { break; }
                indices.push(i as u32);
                next = i + 1;
            }
            let range = start..(next as usize).max(start);
            let values: Vec<f32> = (0..indices.len()).map(|k| k as f32 * 0.5 - 3.0).collect();
            let c = Chunk::from_entries(&range, indices.clone(), values.clone());
            let m = c.to_message(header(), &range);
            let back = decode_chunk(m.payload(), &range).unwrap();
            let (mut i, mut v) = (Vec::new(), Vec::new());
            back.push_nonzero(range.start, &mut i, &mut v);
            let (mut wi, mut wv) = (Vec::new(), Vec::new());
            for (&a, &b) in indices.iter().zip(&values) {
                if b.to_bits() != 0 { wi.push(a); wv.push(b); }
            }
            prop_assert_eq!(i, wi);
            prop_assert_eq!(v, wv);
        }
    }
}
