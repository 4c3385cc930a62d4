//! The (index, value) body shared by sparsifiers: an ascending index set as either a `u32`
//! list or a bitmap, whichever is smaller, followed by the values.
//!
//! ```text
//! u8  layout   0 = list, 1 = bitmap
//! u32 k
//! list:   k × u32 index (strictly ascending), k × f32 value
//! bitmap: ⌈n/8⌉ bytes, k × f32 value
//! ```

use crate::error::WireError;
use crate::wire::{f32_at, u32_at, Reader, Writer};

const LIST: u8 = 0;
const BITMAP: u8 = 1;

fn use_bitmap(n: usize, k: usize) -> bool {
    // bitmap + values < list + values  ⇔  8⌈n/8⌉ < 32k
    (n.div_ceil(8) as u64) * 8 < 32 * k as u64
}

/// Bits of a body with `k` entries out of `n`.
pub fn indexed_bits(n: usize, k: usize) -> u64 {
    let idx = if use_bitmap(n, k) {
        8 * n.div_ceil(8) as u64
    } else {
        32 * k as u64
    };
    8 + 32 + idx + 32 * k as u64
}

/// Writes the ascending indices `idx` of a segment of length `n` and `value(i)` for each.
pub fn write_indexed(n: usize, idx: &[u32], value: impl Fn(u32) -> f32, w: &mut Writer<'_>) {
    let k = idx.len();
    if use_bitmap(n, k) {
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
    let vals = w.zeroed(4 * k);
    for (o, &i) in vals.chunks_exact_mut(4).zip(idx) {
        o.copy_from_slice(&value(i).to_le_bytes());
    }
}

/// Reads a body written by [`write_indexed`] and adds the values into `out`.
pub fn read_indexed_add(r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
    let n = out.len();
    let layout = r.u8("sparse layout")?;
    let k = r.u32("sparse count")? as usize;
    if k > n {
        return Err(WireError::Invalid("more sparse entries than elements"));
    }
    match layout {
        LIST => {
            let idx = r.take_items(k, 4, "sparse indices")?;
            let vals = r.take_items(k, 4, "sparse values")?;
            for j in 0..k {
                let i = u32_at(idx, j) as usize;
                let v = f32_at(vals, j);
                if i >= n {
                    return Err(WireError::IndexOutOfRange {
                        index: i as u64,
                        len: n,
                    });
                }
                if !v.is_finite() {
                    return Err(WireError::Invalid("non-finite sparse value"));
                }
                out[i] += v;
            }
        }
        BITMAP => {
            let bm = r.take(n.div_ceil(8), "sparse bitmap")?;
            let vals = r.take_items(k, 4, "sparse values")?;
            let set: usize = bm.iter().map(|b| b.count_ones() as usize).sum();
            if set != k {
                return Err(WireError::Invalid("bitmap population differs from count"));
            }
            if n % 8 != 0 && (bm[bm.len() - 1] >> (n % 8)) != 0 {
                return Err(WireError::Invalid("bitmap has bits past the segment end"));
            }
            let mut j = 0;
            for (byte_i, &b) in bm.iter().enumerate() {
                let mut b = b;
                while b != 0 {
                    let bit = b.trailing_zeros() as usize;
                    b &= b - 1;
                    let v = f32_at(vals, j);
                    if !v.is_finite() {
                        return Err(WireError::Invalid("non-finite sparse value"));
                    }
                    out[byte_i * 8 + bit] += v;
                    j += 1;
                }
            }
        }
        _ => return Err(WireError::Invalid("unknown sparse layout")),
    }
    Ok(())
}
