//! How a decoder puts each element's value into the buffer ([`Put`]): added or written,
//! then scaled or not — the one-pass forms [`decompress_mean`](crate::decompress_mean)
//! asks of a method that [decodes densely](crate::Compressor::decodes_densely), their
//! definition as separate passes ([`dense_by_passes`]), and the inner-loop helpers the
//! methods' decoders share.

use crate::compressor::Compressor;
use crate::error::WireError;
use crate::finite::scale_has_non_finite;
use crate::wire::Reader;

/// How a decode puts each element's value `v` into the buffer
/// ([`Compressor::decode_segment_dense`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Put {
    /// `o + v`, then times `scale` if there is one.
    Add {
        /// The factor the result is multiplied by (`1/P` for the last payload of a mean).
        scale: Option<f32>,
    },
    /// `0 + v` over whatever the element held (bit for bit adding into a zeroed buffer:
    /// `0 + −0` is `+0`), then times `scale` if there is one.
    Write {
        /// The factor the result is multiplied by (`1/P` for a mean of one payload).
        scale: Option<f32>,
    },
}

impl Put {
    /// The factor, if any.
    pub fn scale(self) -> Option<f32> {
        match self {
            Put::Add { scale } | Put::Write { scale } => scale,
        }
    }
}

/// [`Compressor::decode_segment_dense`] as separate passes: the zero fill (for
/// [`Put::Write`]), [`Compressor::decode_segment_add`], the scaling — the definition a
/// one-pass implementation must equal, and the default.
pub fn dense_by_passes<C: Compressor + ?Sized>(
    c: &C,
    r: &mut Reader<'_>,
    out: &mut [f32],
    put: Put,
) -> Result<bool, WireError> {
    if let Put::Write { .. } = put {
        out.fill(0.0);
    }
    c.decode_segment_add(r, out)?;
    Ok(put.scale().is_some_and(|k| scale_has_non_finite(out, k)))
}

/// The one-pass forms of [`Put`] as a const parameter of a decoder's inner loop ([`put`]).
pub(crate) mod put_mode {
    /// The bit that says write (`0 + v`) rather than add (`o + v`).
    pub const WRITE_BIT: u8 = 1;
    /// The bit that says the result is then scaled.
    pub const SCALE_BIT: u8 = 2;
    /// `o + v`.
    pub const ADD: u8 = 0;
    /// `0 + v`.
    pub const WRITE: u8 = WRITE_BIT;
    /// `(o + v) · k`.
    pub const ADD_SCALE: u8 = SCALE_BIT;
    /// `(0 + v) · k`.
    pub const WRITE_SCALE: u8 = WRITE_BIT | SCALE_BIT;
}

/// Puts `v` into `o` as the mode `M` ([`put_mode`]) says, with factor `k` for the scaling
/// modes; whether the scaled result is a NaN or an infinity.
#[inline(always)]
pub(crate) fn put<const M: u8>(o: &mut f32, v: f32, k: f32) -> bool {
    let sum = if M & put_mode::WRITE_BIT != 0 {
        0.0
    } else {
        *o
    } + v;
    if M & put_mode::SCALE_BIT != 0 {
        let r = sum * k;
        *o = r;
        crate::finite::exponent_all_ones(r)
    } else {
        *o = sum;
        false
    }
}

/// An element a decode has no value for (a zero-norm bucket's): what [`put`] leaves there
/// when nothing is added — untouched, zero, or scaled.
#[inline(always)]
pub(crate) fn put_nothing<const M: u8>(o: &mut f32, k: f32) -> bool {
    if M & put_mode::WRITE_BIT != 0 {
        *o = 0.0;
    }
    if M & put_mode::SCALE_BIT != 0 {
        let r = *o * k;
        *o = r;
        crate::finite::exponent_all_ones(r)
    } else {
        false
    }
}

/// Evaluates `body` with the mode of `put` as the const `M` ([`put_mode`]) and its factor as
/// `k` (1 where it has none): `with_put_mode!(put, |M, k| decode::<M>(r, out, k))`.
macro_rules! with_put_mode {
    ($put:expr, |$m:ident, $k:ident| $body:expr) => {{
        use $crate::put::{put_mode, Put};
        match $put {
            Put::Add { scale: None } => {
                const $m: u8 = put_mode::ADD;
                let $k = 1.0f32;
                $body
            }
            Put::Write { scale: None } => {
                const $m: u8 = put_mode::WRITE;
                let $k = 1.0f32;
                $body
            }
            Put::Add { scale: Some($k) } => {
                const $m: u8 = put_mode::ADD_SCALE;
                $body
            }
            Put::Write { scale: Some($k) } => {
                const $m: u8 = put_mode::WRITE_SCALE;
                $body
            }
        }
    }};
}
pub(crate) use with_put_mode;
