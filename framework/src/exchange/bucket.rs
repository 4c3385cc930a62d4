//! Gradient bucketing: how the flat gradient is cut into the units that are compressed and
//! communicated.
//!
//! Buckets are **layer-aligned** (a parameter is never split across buckets, so per-tensor
//! statistics stay per tensor: each parameter is one segment of its bucket), filled in
//! model order up to a byte budget (PyTorch DDP's 25 MB default), and deterministic: every
//! rank computes the same plan from the same parameter listing. Small and 1-D tensors
//! (biases, BatchNorm scales) can bypass compression: they go to separate dense buckets,
//! as DGC and PowerSGD do.

use std::ops::Range;

use dtrain_compress::compressor::scale_into_has_non_finite;

/// One trainable parameter, as listed by the model in a stable order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamInfo {
    /// Hierarchical name (`features.0.weight`).
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
}

impl ParamInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Bucketing policy.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketPolicy {
    /// Target bucket size in bytes of f32 (default 25 MiB).
    pub bucket_bytes: usize,
    /// Parameters with fewer elements than this are sent uncompressed (default 0 = none).
    pub dense_below: usize,
    /// Send 1-D parameters (biases, norms) uncompressed (default false).
    pub dense_1d: bool,
}

impl Default for BucketPolicy {
    fn default() -> Self {
        BucketPolicy {
            bucket_bytes: 25 << 20,
            dense_below: 0,
            dense_1d: false,
        }
    }
}

/// One bucket of the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Stable id (its position in the plan); keys error-feedback state and RNG streams.
    pub id: u64,
    /// Whether the bucket goes through the configured compressor (else dense fp32).
    pub compressed: bool,
    /// Indices of the parameters in the bucket (into the listing).
    pub params: Vec<usize>,
    /// For each parameter, its range inside the model's flat gradient.
    pub flat_ranges: Vec<Range<usize>>,
    /// The same parameters as contiguous segments of the bucket's own buffer.
    pub segments: Vec<Range<usize>>,
}

impl Bucket {
    /// Elements in the bucket.
    pub fn len(&self) -> usize {
        self.segments.last().map_or(0, |s| s.end)
    }

    /// Whether the bucket is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Cuts `params` (in model order; their flat ranges are consecutive in that order) into
/// buckets.
pub fn plan(params: &[ParamInfo], policy: &BucketPolicy) -> Vec<Bucket> {
    let cap = (policy.bucket_bytes / 4).max(1);
    let mut offsets = Vec::with_capacity(params.len());
    let mut at = 0;
    for p in params {
        offsets.push(at..at + p.numel());
        at += p.numel();
    }
    let dense =
        |p: &ParamInfo| p.numel() < policy.dense_below || (policy.dense_1d && p.shape.len() <= 1);
    let mut buckets: Vec<Bucket> = Vec::new();
    for compressed in [true, false] {
        let mut cur: Option<Bucket> = None;
        for (i, p) in params.iter().enumerate() {
            if dense(p) == compressed || p.numel() == 0 {
                continue;
            }
            let n = p.numel();
            if let Some(b) = &cur {
                if b.len() + n > cap {
                    buckets.push(cur.take().expect("bucket"));
                }
            }
            let b = cur.get_or_insert_with(|| Bucket {
                id: 0,
                compressed,
                params: Vec::new(),
                flat_ranges: Vec::new(),
                segments: Vec::new(),
            });
            let start = b.len();
            b.params.push(i);
            b.flat_ranges.push(offsets[i].clone());
            b.segments.push(start..start + n);
        }
        if let Some(b) = cur {
            buckets.push(b);
        }
    }
    for (i, b) in buckets.iter_mut().enumerate() {
        b.id = i as u64;
    }
    buckets
}

/// Copies the bucket's parameters out of the model's flat gradient into `buf`.
pub fn gather(bucket: &Bucket, flat: &[f32], buf: &mut Vec<f32>) {
    buf.clear();
    for r in &bucket.flat_ranges {
        buf.extend_from_slice(&flat[r.clone()]);
    }
}

/// Writes a bucket buffer back into the model's flat gradient, every value multiplied by
/// `k` on the way (the exchange's averaging, fused into the copy; `k = 1` copies exactly).
/// Returns whether a written value is a NaN or an infinity (checked in the same pass).
#[must_use = "the written values' finiteness is the exchange's non-finite check"]
pub fn scatter(bucket: &Bucket, buf: &[f32], k: f32, flat: &mut [f32]) -> bool {
    let mut bad = false;
    for (r, s) in bucket.flat_ranges.iter().zip(&bucket.segments) {
        bad |= scale_into_has_non_finite(&mut flat[r.clone()], &buf[s.clone()], k);
    }
    bad
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(name: &str, shape: &[usize]) -> ParamInfo {
        ParamInfo {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn buckets_are_layer_aligned_cover_everything_once_and_respect_the_cap() {
        let params = vec![
            p("c1.w", &[16, 3, 3, 3]),
            p("c1.b", &[16]),
            p("c2.w", &[32, 16, 3, 3]),
            p("c2.b", &[32]),
            p("fc.w", &[512, 10]),
            p("fc.b", &[10]),
        ];
        let total: usize = params.iter().map(|x| x.numel()).sum();
        let policy = BucketPolicy {
            bucket_bytes: 4 * 5000,
            dense_below: 0,
            dense_1d: true,
        };
        let plan = super::plan(&params, &policy);
        let mut seen = vec![0u8; total];
        for b in &plan {
            assert!(b.len() <= 5000 || b.params.len() == 1);
            for (i, r) in b.params.iter().zip(&b.flat_ranges) {
                assert_eq!(r.len(), params[*i].numel());
                for j in r.clone() {
                    seen[j] += 1;
                }
                assert_eq!(b.compressed, params[*i].shape.len() > 1);
            }
        }
        assert!(seen.iter().all(|&s| s == 1));
        assert_eq!(
            plan.iter().map(|b| b.id).collect::<Vec<_>>(),
            (0..plan.len() as u64).collect::<Vec<_>>()
        );
        // Oversized parameter gets a bucket of its own.
        let big = super::plan(
            &[p("a", &[10]), p("b", &[100_000]), p("c", &[10])],
            &BucketPolicy {
                bucket_bytes: 400,
                ..Default::default()
            },
        );
        assert_eq!(big.len(), 3);
    }

    #[test]
    fn gather_scatter_round_trip() {
        let params = vec![p("a", &[3]), p("b", &[2, 2]), p("c", &[5])];
        let plan = plan(
            &params,
            &BucketPolicy {
                dense_1d: true,
                ..Default::default()
            },
        );
        let flat: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let mut back = vec![0f32; 12];
        let mut buf = Vec::new();
        for b in &plan {
            gather(b, &flat, &mut buf);
            assert_eq!(buf.len(), b.len());
            assert!(!scatter(b, &buf, 1.0, &mut back));
        }
        assert_eq!(back, flat);
        let mut halves = vec![0f32; 12];
        for b in &plan {
            gather(b, &flat, &mut buf);
            assert!(!scatter(b, &buf, 0.5, &mut halves));
        }
        let want: Vec<f32> = flat.iter().map(|v| v * 0.5).collect();
        assert_eq!(halves, want);
    }
}
