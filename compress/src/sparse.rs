//! The (index, value) body shared by sparsifiers: an ascending index set as a `u32` list, a
//! bitmap, or Golomb–Rice-coded gaps — whichever is smallest for the set at hand — followed
//! by the values.
//!
//! ```text
//! u8  layout   0 = list, 1 = bitmap, 2 = rice
//! u32 k
//! list:   k × u32 index (strictly ascending)
//! bitmap: ⌈n/8⌉ bytes (bit i of byte i/8, LSB first)
//! rice:   u8 b (≤ 31) | u32 bytes | that many bytes of bits, LSB first: for each gap
//!         g (the first index, then index − previous index − 1), g >> b ones, a zero,
//!         and the low b bits of g
//! then k × f32 value
//! ```
//!
//! Top-k style index sets have roughly geometric gaps, for which a Rice code with the
//! parameter near log₂(mean gap · ln 2) is within a few percent of the entropy: at a
//! density of 0.1 % an index costs about 12 bits instead of 32, so an (index, value) pair
//! shrinks from 8 to about 5.5 bytes. The encoder tries the parameters around that estimate
//! and keeps the smallest exact size; the sizes are therefore data-dependent.

use crate::error::WireError;
use crate::touched::Touched;
use crate::wire::{f32_at, u32_at, BitReader, BitWriter, Reader, Writer};

const LIST: u8 = 0;
const BITMAP: u8 = 1;
const RICE: u8 = 2;

/// Gaps between the strictly ascending indices: the first index, then each index minus
/// the previous one minus one.
fn gaps(idx: &[u32]) -> impl Iterator<Item = u32> + '_ {
    let mut next = 0u32;
    idx.iter().map(move |&i| {
        let g = i - next;
        next = i + 1;
        g
    })
}

/// Bits of the Rice code of `idx`'s gaps with parameter `b`.
fn rice_bits(idx: &[u32], b: u32) -> u64 {
    gaps(idx).map(|g| (g >> b) as u64 + 1 + b as u64).sum()
}

/// The Rice parameter giving the fewest bits for `idx` in a segment of length `n`, and
/// that many bits.
fn rice_choice(n: usize, idx: &[u32]) -> (u32, u64) {
    let k = idx.len().max(1) as f64;
    let mean_gap = (n as f64 - k).max(0.0) / k;
    let guess = (mean_gap * std::f64::consts::LN_2).max(1.0).log2().floor() as i64;
    (guess - 1..=guess + 1)
        .filter(|b| (0..=31).contains(b))
        .map(|b| (b as u32, rice_bits(idx, b as u32)))
        .min_by_key(|&(b, bits)| (bits, b))
        .unwrap_or((0, rice_bits(idx, 0)))
}

/// Bytes of the index part (after layout and count) of each layout.
fn index_bytes(n: usize, idx: &[u32]) -> (u64, u64, (u32, u64)) {
    let list = 4 * idx.len() as u64;
    let bitmap = n.div_ceil(8) as u64;
    let (b, bits) = rice_choice(n, idx);
    (list, bitmap, (b, 1 + 4 + bits.div_ceil(8)))
}

/// Bytes [`write_indexed`] writes for the ascending indices `idx` of a segment of length
/// `n`.
pub fn indexed_len(n: usize, idx: &[u32]) -> usize {
    let (list, bitmap, (_, rice)) = index_bytes(n, idx);
    1 + 4 + list.min(bitmap).min(rice) as usize + 4 * idx.len()
}

/// Writes the ascending indices `idx` of a segment of length `n` and `value(i)` for each,
/// in the smallest layout.
pub fn write_indexed(n: usize, idx: &[u32], value: impl Fn(u32) -> f32, w: &mut Writer<'_>) {
    write_indices(n, idx, w);
    let vals = w.zeroed(4 * idx.len());
    for (o, &i) in vals.chunks_exact_mut(4).zip(idx) {
        o.copy_from_slice(&value(i).to_le_bytes());
    }
}

/// Writes only the index part of a body — layout, count and the ascending indices `idx` of
/// a segment of length `n`, in the smallest layout — for messages that carry an index set
/// without values (ScaleCom's leader broadcast). [`read_indices`] reads it back.
pub fn write_indices(n: usize, idx: &[u32], w: &mut Writer<'_>) {
    let k = idx.len();
    let (list, bitmap, (b, rice)) = index_bytes(n, idx);
    if rice < list.min(bitmap) {
        w.u8(RICE);
        w.u32(k as u32);
        w.u8(b as u8);
        let nbytes = (rice - 5) as usize;
        w.u32(nbytes as u32);
        write_rice(idx, b, w.zeroed(nbytes));
    } else if bitmap < list {
        w.u8(BITMAP);
        w.u32(k as u32);
        let bm = w.zeroed(n.div_ceil(8));
        for &i in idx {
            bm[(i >> 3) as usize] |= 1 << (i & 7);
        }
    } else {
        w.u8(LIST);
        w.u32(k as u32);
        w.u32_slice(idx);
    }
}

/// Writes the Rice code of `idx`'s gaps with parameter `b` into `out` (at least
/// [`rice_bits`]`(idx, b)` bits, zeroed).
fn write_rice(idx: &[u32], b: u32, out: &mut [u8]) {
    let mut bw = BitWriter::new(out);
    for g in gaps(idx) {
        let mut q = g >> b;
        while q > 0 {
            let c = q.min(32);
            bw.put(u32::MAX >> (32 - c), c);
            q -= c;
        }
        bw.put(0, 1);
        if b > 0 {
            bw.put(g & (u32::MAX >> (32 - b)), b);
        }
    }
    bw.finish();
}

/// The index part of a body, located and size-checked but not yet decoded.
enum IndexPart<'a> {
    List(&'a [u8]),
    Bitmap(&'a [u8]),
    Rice { b: u32, bits: &'a [u8] },
}

/// Reads the layout, the count `k` and the index part of a body of a segment of length `n`,
/// leaving `r` at the values. Everything that needs no decoding is checked here (the
/// count against `n` and against the bytes present, the bitmap's population and tail), so
/// `k` never asks for more memory than the message holds.
fn index_part<'a>(r: &mut Reader<'a>, n: usize) -> Result<(usize, IndexPart<'a>), WireError> {
    let layout = r.u8("sparse layout")?;
    let k = r.u32("sparse count")? as usize;
    if k > n {
        return Err(WireError::Invalid("more sparse entries than elements"));
    }
    let part = match layout {
        LIST => IndexPart::List(r.take_items(k, 4, "sparse indices")?),
        BITMAP => {
            let bm = r.take(n.div_ceil(8), "sparse bitmap")?;
            if !n.is_multiple_of(8) && (bm[bm.len() - 1] >> (n % 8)) != 0 {
                return Err(WireError::Invalid("bitmap has bits past the segment end"));
            }
            let set: usize = bm.iter().map(|b| b.count_ones() as usize).sum();
            if set != k {
                return Err(WireError::Invalid("bitmap population differs from count"));
            }
            IndexPart::Bitmap(bm)
        }
        RICE => {
            let b = r.u8("rice parameter")? as u32;
            if b > 31 {
                return Err(WireError::Invalid("rice parameter above 31"));
            }
            let nbytes = r.u32("rice byte count")? as usize;
            let bits = r.take(nbytes, "rice bits")?;
            // Every code takes at least one bit.
            if k as u64 > 8 * bits.len() as u64 {
                return Err(WireError::Invalid("rice code shorter than its count"));
            }
            IndexPart::Rice { b, bits }
        }
        _ => return Err(WireError::Invalid("unknown sparse layout")),
    };
    Ok((k, part))
}

impl IndexPart<'_> {
    /// Decodes the `k` indices in ascending order, calling `each(j, index)`; every index is
    /// checked to be below `n` and the list strictly ascending. Stops at the first bad
    /// index (the calls before it have happened).
    fn for_each(
        &self,
        k: usize,
        n: usize,
        mut each: impl FnMut(usize, usize),
    ) -> Result<(), WireError> {
        match *self {
            IndexPart::List(raw) => {
                let mut next = 0u64;
                for j in 0..k {
                    let i = u32_at(raw, j) as u64;
                    if i >= n as u64 {
                        return Err(WireError::IndexOutOfRange { index: i, len: n });
                    }
                    if i < next {
                        return Err(WireError::Invalid("indices not strictly ascending"));
                    }
                    each(j, i as usize);
                    next = i + 1;
                }
            }
            IndexPart::Bitmap(bm) => {
                let mut j = 0;
                for (byte_i, &b) in bm.iter().enumerate() {
                    let mut b = b;
                    while b != 0 {
                        each(j, byte_i * 8 + b.trailing_zeros() as usize);
                        b &= b - 1;
                        j += 1;
                    }
                }
            }
            IndexPart::Rice { b, bits } => read_rice(bits, b, k, n, each)?,
        }
        Ok(())
    }
}

/// Reads an index part written by [`write_indices`] for a segment of length `n`, appending
/// the indices to `out`; returns how many. Every index is checked to be below `n` and the
/// list strictly ascending.
pub fn read_indices(r: &mut Reader<'_>, n: usize, out: &mut Vec<u32>) -> Result<usize, WireError> {
    let (k, part) = index_part(r, n)?;
    out.reserve(k);
    part.for_each(k, n, |_, i| out.push(i as u32))?;
    Ok(k)
}

/// Decodes the Rice-coded gaps of `k` indices (a segment of length `n`) from `bits`,
/// calling `each(j, index)` in order. Every index is checked against `n`.
fn read_rice(
    bits: &[u8],
    b: u32,
    k: usize,
    n: usize,
    mut each: impl FnMut(usize, usize),
) -> Result<(), WireError> {
    let avail = 8 * bits.len() as u64;
    let mut r = BitReader::new(bits);
    let mut next = 0u64;
    for j in 0..k {
        let mut q = 0u64;
        loop {
            let (run, ends) = r.ones();
            q += run as u64;
            if run > 0 && ((q << b) >= n as u64 || r.bits_read() > avail) {
                return Err(WireError::Invalid("rice gap past the segment end"));
            }
            if ends {
                r.get(1);
                break;
            }
        }
        let low = if b > 0 { r.get(b) as u64 } else { 0 };
        if r.bits_read() > avail {
            return Err(WireError::Invalid("rice code runs past its bytes"));
        }
        let i = next + ((q << b) | low);
        if i >= n as u64 {
            return Err(WireError::IndexOutOfRange { index: i, len: n });
        }
        each(j, i as usize);
        next = i + 1;
    }
    // Only zero padding may follow the last code.
    if avail - r.bits_read() >= 8 {
        return Err(WireError::Invalid("rice code has trailing bytes"));
    }
    Ok(())
}

/// Skips the index part of a body of a segment of length `len` (after reading its layout
/// and count, which it returns as `k`), leaving `r` at the values.
pub fn skip_indices(r: &mut Reader<'_>, len: usize) -> Result<usize, WireError> {
    index_part(r, len).map(|(k, _)| k)
}

/// Reads a body written by [`write_indexed`] and adds the values into `out`. The values are
/// checked first; an index past the end stops the decode with the entries before it added.
pub fn read_indexed_add(r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
    read_indexed_add_marking(r, out, |_| {})
}

/// Reads an indexed body of a segment of `n` elements and calls `each(index, value)` for
/// each entry in index order, with [`read_indexed_add`]'s checks in its order and its
/// errors: for decoders that add elsewhere (the device codecs of `dtrain-device`).
pub fn read_indexed(
    r: &mut Reader<'_>,
    n: usize,
    mut each: impl FnMut(u32, f32),
) -> Result<(), WireError> {
    let (k, part) = index_part(r, n)?;
    let vals = r.take_items(k, 4, "sparse values")?;
    if (0..k).any(|j| !f32_at(vals, j).is_finite()) {
        return Err(WireError::Invalid("non-finite sparse value"));
    }
    part.for_each(k, n, |j, i| each(i as u32, f32_at(vals, j)))
}

/// [`read_indexed_add`], also marking in `touched` the indices it adds at
/// ([`crate::Compressor::decode_segment_add_touched`] of a sparsifier).
pub fn read_indexed_add_touched(
    r: &mut Reader<'_>,
    out: &mut [f32],
    touched: &mut Touched,
) -> Result<(), WireError> {
    read_indexed_add_marking(r, out, |i| touched.mark(i))
}

/// [`read_indexed_add`], calling `mark` with each index it adds at.
fn read_indexed_add_marking(
    r: &mut Reader<'_>,
    out: &mut [f32],
    mut mark: impl FnMut(usize),
) -> Result<(), WireError> {
    let n = out.len();
    let (k, part) = index_part(r, n)?;
    let vals = r.take_items(k, 4, "sparse values")?;
    if (0..k).any(|j| !f32_at(vals, j).is_finite()) {
        return Err(WireError::Invalid("non-finite sparse value"));
    }
    // Indices are decoded a block ahead of the adds: the adds of a block are then
    // independent loads and stores into `out`, which the CPU overlaps, where one add behind
    // each decoded index waits on that index's cache miss (a 1 % index set touches a new
    // cache line per entry; decoding 2 × 42 k entries into a 16.8 MB buffer took ~3.7 ms a
    // payload inside a training step before).
    const AHEAD: usize = 256;
    let mut block = [0u32; AHEAD];
    let (mut filled, mut first) = (0usize, 0usize);
    let mut add_block = |block: &[u32], first: usize| {
        for (t, &i) in block.iter().enumerate() {
            out[i as usize] += f32_at(vals, first + t);
            mark(i as usize);
        }
    };
    part.for_each(k, n, |j, i| {
        block[filled] = i as u32;
        filled += 1;
        if filled == AHEAD {
            add_block(&block, first);
            first = j + 1;
            filled = 0;
        }
    })?;
    add_block(&block[..filled], first);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// A random strictly ascending index set of about `density · n` entries.
    fn random_set(rng: &mut Rng, n: usize, density: f64) -> Vec<u32> {
        let scale = 1u64 << 32;
        let cut = (density * scale as f64) as u64;
        (0..n as u32).filter(|_| rng.below(scale) < cut).collect()
    }

    /// `read_rice` as it was, one bit of the unary part at a time: the oracle for the
    /// word-at-a-time version.
    fn read_rice_bitwise(bits: &[u8], b: u32, k: usize, n: usize) -> Result<Vec<usize>, WireError> {
        let avail = 8 * bits.len() as u64;
        let mut r = BitReader::new(bits);
        let (mut next, mut out) = (0u64, Vec::new());
        for _ in 0..k {
            let mut q = 0u64;
            while r.bit() {
                q += 1;
                if (q << b) >= n as u64 || r.bits_read() > avail {
                    return Err(WireError::Invalid("rice gap past the segment end"));
                }
            }
            let low = if b > 0 { r.get(b) as u64 } else { 0 };
            if r.bits_read() > avail {
                return Err(WireError::Invalid("rice code runs past its bytes"));
            }
            let i = next + ((q << b) | low);
            if i >= n as u64 {
                return Err(WireError::IndexOutOfRange { index: i, len: n });
            }
            out.push(i as usize);
            next = i + 1;
        }
        if avail - r.bits_read() >= 8 {
            return Err(WireError::Invalid("rice code has trailing bytes"));
        }
        Ok(out)
    }

    /// On random bits (long runs of ones included), valid codes and their truncations, the
    /// unary part read a word at a time gives the bit-at-a-time reader's indices or error.
    #[test]
    fn rice_reads_as_the_bitwise_reader_did() {
        let mut rng = Rng::seed_from_u64(5);
        for case in 0..4000 {
            let n = 1 + rng.below(1 << (4 + case % 20)) as usize;
            let b = rng.below(12) as u32;
            let k = rng.below(40) as usize;
            let mut bits: Vec<u8> = (0..rng.below(48)).map(|_| rng.next_u64() as u8).collect();
            match case % 4 {
                // Mostly ones: unary runs across words and past the end.
                0 => bits
                    .iter_mut()
                    .for_each(|x| *x |= rng.next_u64() as u8 | 0xEF),
                // A valid code of a random set, maybe cut short.
                1 => {
                    let idx = random_set(&mut rng, n.min(5000), 0.05);
                    let mut buf = vec![0u8; rice_bits(&idx, b).div_ceil(8) as usize];
                    write_rice(&idx, b, &mut buf);
                    bits = buf;
                    let cut = rng.below(bits.len() as u64 + 1) as usize;
                    if case % 8 == 1 {
                        bits.truncate(cut);
                    }
                }
                _ => {}
            }
            let mut got = Vec::new();
            let res = read_rice(&bits, b, k, n, |_, i| got.push(i));
            match read_rice_bitwise(&bits, b, k, n) {
                Ok(want) => {
                    assert!(res.is_ok(), "case {case}: {res:?}");
                    assert_eq!(got, want, "case {case}");
                }
                Err(e) => assert_eq!(res.unwrap_err().to_string(), e.to_string(), "case {case}"),
            }
        }
    }

    fn encode(n: usize, idx: &[u32]) -> Vec<u8> {
        let mut buf = Vec::new();
        let mut w = Writer::new(&mut buf);
        write_indexed(n, idx, |i| i as f32 + 0.5, &mut w);
        buf
    }

    #[test]
    fn every_layout_round_trips_and_the_smallest_is_chosen() {
        let mut rng = Rng::seed_from_u64(5);
        let mut seen = [false; 3];
        for &(n, density) in &[
            (0usize, 0.5),
            (1, 1.0),
            (37, 0.0),
            (1000, 0.001),
            (1000, 0.01),
            (4096, 0.03),
            (4096, 0.2),
            (4096, 0.9),
            (100_000, 0.001),
            (100_000, 0.05),
        ] {
            for _ in 0..4 {
                let idx = random_set(&mut rng, n, density);
                let buf = encode(n, &idx);
                assert_eq!(buf.len(), indexed_len(n, &idx), "n {n} k {}", idx.len());
                let (list, bitmap, (_, rice)) = index_bytes(n, &idx);
                assert_eq!(
                    buf.len() - 5 - 4 * idx.len(),
                    list.min(bitmap).min(rice) as usize
                );
                seen[buf[0] as usize] = true;
                let mut out = vec![0f32; n];
                let mut r = Reader::new(&buf);
                read_indexed_add(&mut r, &mut out).unwrap();
                assert_eq!(r.remaining(), 0);
                let mut want = vec![0f32; n];
                for &i in &idx {
                    want[i as usize] = i as f32 + 0.5;
                }
                assert_eq!(out, want);
                let mut r = Reader::new(&buf);
                assert_eq!(skip_indices(&mut r, n).unwrap(), idx.len());
                assert_eq!(r.remaining(), 4 * idx.len());
                // The index part alone reads back to the same set.
                let mut got = vec![7u32];
                let mut r = Reader::new(&buf);
                assert_eq!(read_indices(&mut r, n, &mut got).unwrap(), idx.len());
                assert_eq!(got[1..], idx[..]);
                assert_eq!(r.remaining(), 4 * idx.len());
            }
        }
        assert_eq!(seen, [true; 3], "each layout was chosen somewhere");
    }

    #[test]
    fn index_lists_must_ascend_and_counts_cannot_outgrow_their_bytes() {
        let list = |idx: &[u32]| {
            let mut buf = vec![LIST];
            buf.extend((idx.len() as u32).to_le_bytes());
            idx.iter().for_each(|i| buf.extend(i.to_le_bytes()));
            buf
        };
        let read = |b: &[u8]| read_indices(&mut Reader::new(b), 100, &mut Vec::new());
        assert_eq!(read(&list(&[1, 5, 99])), Ok(3));
        assert!(read(&list(&[5, 5])).is_err());
        assert!(read(&list(&[6, 5])).is_err());
        assert!(read(&list(&[100])).is_err());
        // A Rice count of 80 in one byte of bits, and a list count without its bytes.
        let rice = [RICE, 80, 0, 0, 0, 0, 1, 0, 0, 0, 0];
        assert!(read(&rice).is_err());
        assert!(read(&[LIST, 90, 0, 0, 0]).is_err());
    }

    #[test]
    fn damaged_rice_sections_are_errors() {
        let n = 50_000;
        let idx = random_set(&mut Rng::seed_from_u64(8), n, 0.002);
        let buf = encode(n, &idx);
        assert_eq!(buf[0], RICE);
        let decode = |b: &[u8], len: usize| {
            let mut out = vec![0f32; len];
            read_indexed_add(&mut Reader::new(b), &mut out)
        };
        assert!(decode(&buf, n).is_ok());
        // A shorter segment: some index lands past its end.
        assert!(decode(&buf, idx[idx.len() - 1] as usize).is_err());
        // Parameter out of range; one byte fewer or more of bits; a count the bits lack.
        let mut bad = buf.clone();
        bad[5] = 32;
        assert!(decode(&bad, n).is_err());
        for delta in [-1i64, 1] {
            let mut bad = buf.clone();
            let nbytes = u32::from_le_bytes(bad[6..10].try_into().unwrap()) as i64 + delta;
            bad[6..10].copy_from_slice(&(nbytes as u32).to_le_bytes());
            assert!(decode(&bad, n).is_err(), "byte count {delta:+}");
        }
        let mut bad = buf.clone();
        bad[1..5].copy_from_slice(&(idx.len() as u32 + 1).to_le_bytes());
        assert!(decode(&bad, n).is_err());
        // All-ones bits: unary runs past the segment end.
        let mut bad = buf.clone();
        let nbytes = u32::from_le_bytes(bad[6..10].try_into().unwrap()) as usize;
        bad[10..10 + nbytes].fill(0xFF);
        assert!(decode(&bad, n).is_err());
        // Every truncation and every single-byte change: an error or a valid decode, never a
        // panic.
        for cut in 0..buf.len() {
            let _ = decode(&buf[..cut], n);
        }
        for at in 0..buf.len().min(400) {
            let mut b = buf.clone();
            b[at] ^= 0x5A;
            let _ = decode(&b, n);
        }
    }
}
