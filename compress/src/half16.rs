//! The 16-bit float casts of `fp16` and `bf16`, written once: blocked conversion through
//! the `half` crate's slice routines (vectorised where the CPU allows), saturation at the
//! format's largest finite value instead of infinity, and a decoder that refuses
//! non-finite values.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::error::WireError;
use crate::wire::{Reader, Writer};

/// Elements converted per block (a stack-sized scratch on decode).
const BLOCK: usize = 4096;

/// A 16-bit float format: [`f16`] or [`bf16`].
pub(crate) trait Half16: Copy + Default + 'static
where
    [Self]: HalfFloatSliceExt,
{
    /// The largest finite value.
    const MAX: Self;
    /// The most negative finite value.
    const MIN: Self;
    /// Its bits.
    fn bits(self) -> u16;
    /// From bits.
    fn from_bits(b: u16) -> Self;
    /// Whether it is ±∞.
    fn is_inf(self) -> bool;
    /// Whether the sign bit is set.
    fn is_negative(self) -> bool;
}

macro_rules! half16 {
    ($t:ty) => {
        impl Half16 for $t {
            const MAX: Self = <$t>::MAX;
            const MIN: Self = <$t>::MIN;
            fn bits(self) -> u16 {
                self.to_bits()
            }
            fn from_bits(b: u16) -> Self {
                <$t>::from_bits(b)
            }
            fn is_inf(self) -> bool {
                self.is_infinite()
            }
            fn is_negative(self) -> bool {
                self.is_sign_negative()
            }
        }
    };
}
half16!(f16);
half16!(bf16);

/// Writes `x` as little-endian `H` values (round to nearest even), an infinity saturated
/// to `H::MAX` / `H::MIN`; `buf` is scratch kept between calls.
pub(crate) fn encode<H: Half16>(x: &[f32], buf: &mut Vec<H>, w: &mut Writer<'_>)
where
    [H]: HalfFloatSliceExt,
{
    buf.resize(BLOCK.min(x.len()), H::default());
    let out = w.zeroed(2 * x.len());
    for (xs, os) in x.chunks(BLOCK).zip(out.chunks_mut(2 * BLOCK)) {
        let h = &mut buf[..xs.len()];
        h.convert_from_f32_slice(xs);
        for (&hv, o) in h.iter().zip(os.chunks_exact_mut(2)) {
            let v = match (hv.is_inf(), hv.is_negative()) {
                (true, true) => H::MIN,
                (true, false) => H::MAX,
                _ => hv,
            };
            o.copy_from_slice(&v.bits().to_le_bytes());
        }
    }
}

/// Reads `out.len()` little-endian `H` values and adds them into `out`; a non-finite value
/// is `Invalid(non_finite)`.
pub(crate) fn decode_add<H: Half16>(
    r: &mut Reader<'_>,
    out: &mut [f32],
    what: &'static str,
    non_finite: &'static str,
) -> Result<(), WireError>
where
    [H]: HalfFloatSliceExt,
{
    let b = r.take_items(out.len(), 2, what)?;
    let mut h = [H::default(); BLOCK];
    let mut f = [0f32; BLOCK];
    for (os, bs) in out.chunks_mut(BLOCK).zip(b.chunks(2 * BLOCK)) {
        let n = os.len();
        for (hv, c) in h[..n].iter_mut().zip(bs.chunks_exact(2)) {
            *hv = H::from_bits(u16::from_le_bytes([c[0], c[1]]));
        }
        h[..n].convert_to_f32_slice(&mut f[..n]);
        for (o, v) in os.iter_mut().zip(&f[..n]) {
            if !v.is_finite() {
                return Err(WireError::Invalid(non_finite));
            }
            *o += v;
        }
    }
    Ok(())
}
