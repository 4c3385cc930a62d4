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
//! ```
//!
//! all little-endian, indices absolute (not relative to the chunk). The sender picks dense
//! once `nnz · 8 ≥ len · 4` bytes, i.e. once pairs would be at least as large (the Kylix
//! density switch). The encoding never changes the numeric result: a dense chunk carries
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

/// Whether a chunk of `len` elements with `nnz` entries is sent densely: once the pairs
/// (8 bytes each) would take at least as many bytes as the dense values (4 bytes each).
pub(crate) fn dense_is_cheaper(nnz: usize, len: usize) -> bool {
    nnz as u64 * 8 >= len as u64 * 4
}

/// Payload length of `nnz` pairs.
fn pairs_len(nnz: usize) -> usize {
    1 + 4 + 8 * nnz
}

/// Encodes the entries `(indices, values)`, all inside `range`, as one chunk message.
pub(crate) fn encode_entries(
    header: Header,
    range: &Range<usize>,
    indices: &[u32],
    values: &[f32],
) -> Message {
    if dense_is_cheaper(indices.len(), range.len()) {
        let mut dense = vec![0.0f32; range.len()];
        for (&i, &v) in indices.iter().zip(values) {
            dense[i as usize - range.start] = v;
        }
        dense_message(header, &dense)
    } else {
        pairs_message(header, indices, values)
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
    /// The chunk of a sum over `[base, base + sum.len())`, in the cheaper encoding; only
    /// entries that are not `+0.0` count (and are listed) as stored.
    pub(crate) fn from_sum(base: usize, sum: Vec<f32>) -> Chunk {
        let nnz = sum.iter().filter(|v| v.to_bits() != 0).count();
        if dense_is_cheaper(nnz, sum.len()) {
            return Chunk::Dense(sum);
        }
        let mut indices = Vec::with_capacity(nnz);
        let mut values = Vec::with_capacity(nnz);
        push_nonzero(&sum, base, &mut indices, &mut values);
        Chunk::Pairs { indices, values }
    }

    /// The chunk of the entries `(indices, values)` (all inside `range`, none `+0.0`) in the
    /// cheaper encoding: the same chunk [`Chunk::from_sum`] gives for their dense form.
    pub(crate) fn from_entries(range: &Range<usize>, indices: Vec<u32>, values: Vec<f32>) -> Chunk {
        if !dense_is_cheaper(indices.len(), range.len()) {
            return Chunk::Pairs { indices, values };
        }
        let mut dense = vec![0.0f32; range.len()];
        for (&i, &v) in indices.iter().zip(&values) {
            dense[i as usize - range.start] = v;
        }
        Chunk::Dense(dense)
    }

    /// The chunk as a message with `header`.
    pub(crate) fn to_message(&self, header: Header) -> Message {
        match self {
            Chunk::Pairs { indices, values } => pairs_message(header, indices, values),
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
        _ => Err(WireError::Payload("unknown sparse chunk encoding")),
    }
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
    fn encoding_switches_to_dense_at_half_density() {
        let range = 10..18; // 8 elements: dense once nnz >= 4
        let m = encode_entries(header(), &range, &[11, 12, 15], &[1.0, 2.0, 3.0]);
        assert_eq!(m.payload()[0], PAIRS);
        assert_eq!(m.payload().len(), pairs_len(3));
        let m4 = encode_entries(header(), &range, &[11, 12, 15, 17], &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(m4.payload()[0], DENSE);
        assert_eq!(m4.payload().len(), 1 + 8 * 4);
        // Both decode to the same dense values.
        for m in [m, m4] {
            let mut out = vec![9.0; 8];
            decode_chunk(m.payload(), &range)
                .unwrap()
                .write_dense(&mut out, 10);
            assert_eq!(out[1..4], [1.0, 2.0, 0.0]);
            assert_eq!(out[5], 3.0);
        }
        let c = Chunk::from_sum(10, vec![0.0, 1.0, 0.0, 0.0]);
        assert_eq!(
            c,
            Chunk::Pairs {
                indices: vec![11],
                values: vec![1.0]
            }
        );
        assert_eq!(
            decode_chunk(c.to_message(header()).payload(), &(10..14)),
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
            vec![3, 0, 0, 0, 0],
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
    }

    proptest! {
        #[test]
        fn hostile_chunks_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..80),
            tag in prop_oneof![Just(PAIRS), Just(DENSE), any::<u8>()],
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
        }
    }
}
