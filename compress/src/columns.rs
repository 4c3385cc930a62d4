//! `columns`: lossless column-sparse encoding, for the weight gradients meProp produces
//! (ALGORITHMS.md §11).
//!
//! With unified meProp only `k` output columns of a linear layer's `dW` (`[in, out]`,
//! row-major, burn's layout) are non-zero. Sent as columns, that is `k` column indices and
//! `in·k` values — `32k/out + 32k/(in·out)` bits per element — instead of `in·out` values or
//! an index per value.
//!
//! The encoder needs each segment's row width: the trainer hands it the shapes of a bucket's
//! parameters once ([`Compressor::set_segment_shapes`]); a segment whose shape is not 2-D, or
//! whose non-zero columns would not make the columns form smaller, is sent densely. The
//! decoder needs nothing but the payload. Lossless in both forms (a column counts as
//! non-zero when any of its entries has a non-zero bit pattern, `−0.0` included).
//!
//! # Segment body
//! ```text
//! dense:    u8 = 0 | n × f32
//! columns:  u8 = 1 | u32 width | u32 k | k × u32 column (strictly increasing, < width)
//!           | (n / width) × k × f32 (row by row, the kept columns in order)
//! ```
//! Aggregation: gathered (workers keep different columns).

use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Compressor, Ctx, MethodId};
use crate::error::ConfigError;
use crate::error::WireError;
use crate::registry::{Method, RunUse};
use crate::rng::Rng;
use crate::wire::{f32_at, u32_at, Reader, Writer};

const DENSE: u8 = 0;
const COLUMNS: u8 = 1;

/// Configuration of [`Columns`] (no parameters).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ColumnsConfig {}

impl Method for ColumnsConfig {
    const NAME: &'static str = "columns";
    const ABOUT: &'static str =
        "lossless column-sparse encoding of 2-D gradients (meProp's dW: k columns + in×k values)";
    const ID: MethodId = MethodId(16);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(Box::new(self.init()))
    }

    /// The codec needs each segment to be a whole matrix (its row width comes from the
    /// tensor's shape); the compressed all-reduce cuts buckets into ranges.
    fn check(&self, run: &RunUse<'_>) -> Result<(), ConfigError> {
        run.needs_whole_tensors("columns encodes whole matrices")
    }
}

impl ColumnsConfig {
    /// Builds the compressor.
    pub fn init(&self) -> Columns {
        Columns::default()
    }
}

/// The column-sparse codec (see the [module docs](self)).
#[derive(Debug, Clone, Default)]
pub struct Columns {
    /// Row width of each segment of the bucket (0: not a matrix).
    widths: Vec<usize>,
    /// Index of the next segment `encode_segment` sees.
    next: usize,
    /// Scratch: the kept columns.
    keep: Vec<u32>,
}

impl Columns {
    /// The non-zero columns of `x` seen as rows of `width`, into `self.keep`.
    fn nonzero_columns(&mut self, x: &[f32], width: usize) {
        let mut any = vec![false; width];
        for row in x.chunks_exact(width) {
            for (a, v) in any.iter_mut().zip(row) {
                *a |= v.to_bits() != 0;
            }
        }
        self.keep.clear();
        self.keep
            .extend((0..width as u32).filter(|&c| any[c as usize]));
    }
}

impl Compressor for Columns {
    fn method(&self) -> MethodId {
        ColumnsConfig::ID
    }

    fn aggregation(&self) -> Aggregation {
        Aggregation::Gather
    }

    fn unbiased(&self) -> bool {
        true
    }

    fn set_segment_shapes(&mut self, shapes: &[Vec<usize>]) {
        self.widths = shapes
            .iter()
            .map(|s| if s.len() == 2 { s[1] } else { 0 })
            .collect();
    }

    fn begin(&mut self, _grad: &[f32], _ctx: &Ctx<'_>) {
        self.next = 0;
    }

    fn encode_segment(&mut self, x: &[f32], _rng: &mut Rng, w: &mut Writer<'_>) {
        let width = self.widths.get(self.next).copied().unwrap_or(0);
        self.next += 1;
        if width >= 2 && x.len().is_multiple_of(width) && u32::try_from(width).is_ok() {
            self.nonzero_columns(x, width);
            let rows = x.len() / width;
            let k = self.keep.len();
            // Columns form: 8 + 4k + 4·rows·k bytes against 4n.
            if 8 + 4 * k + 4 * rows * k < 4 * x.len() {
                w.u8(COLUMNS);
                w.u32(width as u32);
                w.u32(k as u32);
                for &c in &self.keep {
                    w.u32(c);
                }
                for row in x.chunks_exact(width) {
                    for &c in &self.keep {
                        w.f32(row[c as usize]);
                    }
                }
                return;
            }
        }
        w.u8(DENSE);
        w.f32_slice(x);
    }

    fn decode_segment_add(&self, r: &mut Reader<'_>, out: &mut [f32]) -> Result<(), WireError> {
        match r.u8("columns form")? {
            DENSE => {
                let b = r.take_items(out.len(), 4, "dense values")?;
                finite(b, out.len())?;
                for (i, o) in out.iter_mut().enumerate() {
                    *o += f32_at(b, i);
                }
                Ok(())
            }
            COLUMNS => {
                let width = r.u32("row width")? as usize;
                if width == 0 || !out.len().is_multiple_of(width) {
                    return Err(WireError::Invalid("row width does not divide the segment"));
                }
                let k = r.u32("column count")? as usize;
                if k > width {
                    return Err(WireError::Invalid("more columns than the row width"));
                }
                let cols = r.take_items(k, 4, "column indices")?;
                let mut prev: Option<u32> = None;
                for i in 0..k {
                    let c = u32_at(cols, i);
                    if c as usize >= width || prev.is_some_and(|p| p >= c) {
                        return Err(WireError::Invalid(
                            "column indices not increasing below the width",
                        ));
                    }
                    prev = Some(c);
                }
                let rows = out.len() / width;
                let vals = r.take_items(rows.saturating_mul(k), 4, "column values")?;
                finite(vals, rows * k)?;
                for (row, o) in out.chunks_exact_mut(width).enumerate() {
                    for i in 0..k {
                        o[u32_at(cols, i) as usize] += f32_at(vals, row * k + i);
                    }
                }
                Ok(())
            }
            _ => Err(WireError::Invalid("unknown columns form")),
        }
    }

    fn segment_bits(&self, _n: usize) -> Option<u64> {
        None
    }
}

/// Refuses a payload whose `n` little-endian f32 values in `b` are not all finite: the
/// encoder never sends one (the trainer skips a step with a non-finite gradient before it
/// compresses), so one on the wire is damage.
fn finite(b: &[u8], n: usize) -> Result<(), WireError> {
    if (0..n).all(|i| f32_at(b, i).is_finite()) {
        Ok(())
    } else {
        Err(WireError::Invalid("a non-finite value"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{compress, decompress, Payload};

    fn ctx(segments: &[std::ops::Range<usize>]) -> Ctx<'_> {
        Ctx {
            step: 0,
            rank: 0,
            bucket: 0,
            segments,
        }
    }

    /// A bucket of a [6 × 10] weight with columns 2, 5, 7 non-zero, and a bias of 10.
    fn bucket() -> (Vec<f32>, Vec<std::ops::Range<usize>>, Vec<Vec<usize>>) {
        let mut g = vec![0f32; 70];
        for r in 0..6 {
            for c in [2, 5, 7] {
                g[r * 10 + c] = (r * 10 + c) as f32 * 0.25 - 3.0;
            }
        }
        g[12] = -0.0; // a −0.0 still marks its column (already kept) and survives
        for (i, v) in g[60..].iter_mut().enumerate() {
            *v = i as f32 - 4.5;
        }
        (g, vec![0..60, 60..70], vec![vec![6, 10], vec![10]])
    }

    #[test]
    fn column_sparse_weights_go_as_columns_and_decode_exactly() {
        let (g, segs, shapes) = bucket();
        let mut c = ColumnsConfig::default().init();
        c.set_segment_shapes(&shapes);
        let mut p = Payload::new();
        compress(&mut c, &g, &ctx(&segs), &mut Rng::seed_from_u64(1), &mut p).unwrap();
        let mut out = vec![0f32; 70];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        for (a, b) in out.iter().zip(&g) {
            assert_eq!(a, b);
        }
        // The weight: 1 + 8 + 3·4 + 6·3·4 bytes; the bias dense: 1 + 40; plus framing.
        let dense = {
            let mut d = ColumnsConfig::default().init();
            let mut q = Payload::new();
            compress(&mut d, &g, &ctx(&segs), &mut Rng::seed_from_u64(1), &mut q).unwrap();
            q.encoded_len()
        };
        assert_eq!(dense - p.encoded_len(), (1 + 240) - (1 + 8 + 12 + 72));
        // Twice in a row (begin resets the segment counter).
        let mut q = Payload::new();
        compress(&mut c, &g, &ctx(&segs), &mut Rng::seed_from_u64(1), &mut q).unwrap();
        assert_eq!(q, p);
    }

    #[test]
    fn dense_data_and_unknown_shapes_fall_back_to_dense() {
        let g: Vec<f32> = (0..60).map(|i| i as f32 + 1.0).collect();
        let mut c = ColumnsConfig::default().init();
        c.set_segment_shapes(&[vec![6, 10]]);
        let mut p = Payload::new();
        compress(&mut c, &g, &ctx(&[]), &mut Rng::seed_from_u64(1), &mut p).unwrap();
        let mut out = vec![0f32; 60];
        decompress(&c, p.as_bytes(), &mut out).unwrap();
        assert_eq!(out, g);
    }

    #[test]
    fn malformed_bodies_are_errors() {
        let c = ColumnsConfig::default().init();
        let body = |b: &[u8]| {
            let mut out = vec![0f32; 6];
            let mut r = Reader::new(b);
            c.decode_segment_add(&mut r, &mut out)
        };
        let mut ok = vec![COLUMNS];
        ok.extend(3u32.to_le_bytes());
        ok.extend(1u32.to_le_bytes());
        ok.extend(2u32.to_le_bytes());
        ok.extend([0u8; 8]);
        assert!(body(&ok).is_ok());
        for (what, bad) in [
            (
                "width 0",
                [&[COLUMNS][..], &0u32.to_le_bytes(), &0u32.to_le_bytes()].concat(),
            ),
            (
                "width 4 ∤ 6",
                [&[COLUMNS][..], &4u32.to_le_bytes(), &0u32.to_le_bytes()].concat(),
            ),
            (
                "k > width",
                [&[COLUMNS][..], &3u32.to_le_bytes(), &4u32.to_le_bytes()].concat(),
            ),
            (
                "column ≥ width",
                [
                    &[COLUMNS][..],
                    &3u32.to_le_bytes(),
                    &1u32.to_le_bytes(),
                    &3u32.to_le_bytes(),
                    &[0u8; 8],
                ]
                .concat(),
            ),
            ("truncated values", ok[..ok.len() - 1].to_vec()),
            ("unknown form", vec![7]),
        ] {
            assert!(body(&bad).is_err(), "{what}");
        }
    }
}
