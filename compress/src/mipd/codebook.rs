//! The per-layer code-book of MIPD (step 3 of the [worker side](crate::mipd)): Lloyd-Max
//! on the sorted kept values, from two initial grids, the better one kept.

/// Largest code-book size (`b ≤ 16`).
pub const MAX_LEVELS: usize = 1 << 16;

/// Width in bits of a code for `levels` levels: `⌈log2 levels⌉`.
pub fn code_width(levels: usize) -> u32 {
    if levels <= 1 {
        0
    } else {
        usize::BITS - (levels - 1).leading_zeros()
    }
}

/// Index of the level nearest `v` in the ascending `levels` (ties → the upper level).
#[inline]
pub(super) fn nearest(levels: &[f32], v: f32) -> usize {
    // Number of midpoints ≤ v.
    let (mut lo, mut hi) = (0usize, levels.len() - 1);
    while lo < hi {
        let m = (lo + hi) / 2;
        let mid = levels[m] + (levels[m + 1] - levels[m]) * 0.5;
        if mid <= v {
            lo = m + 1;
        } else {
            hi = m;
        }
    }
    lo
}

/// Mean-squared error of quantizing the ascending `sorted` values to the nearest of
/// `levels` (ascending).
pub fn quantization_mse(sorted: &[f32], levels: &[f32]) -> f64 {
    if sorted.is_empty() || levels.is_empty() {
        return 0.0;
    }
    let se: f64 = sorted
        .iter()
        .map(|&v| {
            let q = levels[nearest(levels, v)];
            ((v - q) as f64).powi(2)
        })
        .sum();
    se / sorted.len() as f64
}

/// Lloyd-Max on ascending `sorted` from `init` (ascending), `iters` iterations at most.
fn lloyd(sorted: &[f32], prefix: &[f64], mut lv: Vec<f64>, iters: u32) -> Vec<f32> {
    let l = lv.len();
    for _ in 0..iters {
        let mut changed = false;
        let mut start = 0usize;
        for i in 0..l {
            let end = if i + 1 == l {
                sorted.len()
            } else {
                let b = (lv[i] + lv[i + 1]) * 0.5;
                start + sorted[start..].partition_point(|&v| (v as f64) < b)
            };
            if end > start {
                let m = (prefix[end] - prefix[start]) / (end - start) as f64;
                if m != lv[i] {
                    lv[i] = m;
                    changed = true;
                }
            }
            start = end;
        }
        if !changed {
            break;
        }
    }
    let mut out: Vec<f32> = lv.iter().map(|&x| x as f32).collect();
    out.sort_unstable_by(f32::total_cmp);
    out.dedup();
    out
}

/// Fits the code-book of at most `max_levels` levels to the ascending finite values
/// `sorted` (see the [module docs](crate::mipd)): the distinct values if there are at most
/// `max_levels` of them; otherwise the better (lower MSE) of Lloyd-Max from the quantile
/// grid and Lloyd-Max from the uniform grid. The result is finite, strictly ascending and
/// non-empty unless `sorted` is empty.
pub fn fit_codebook(sorted: &[f32], max_levels: usize, iters: u32) -> Vec<f32> {
    let k = sorted.len();
    if k == 0 || max_levels == 0 {
        return Vec::new();
    }
    let mut distinct: Vec<f32> = Vec::new();
    for &v in sorted {
        if distinct.last() != Some(&v) {
            if distinct.len() == max_levels {
                distinct.clear();
                break;
            }
            distinct.push(v);
        }
    }
    if !distinct.is_empty() {
        return distinct;
    }
    let l = max_levels;
    let mut prefix = Vec::with_capacity(k + 1);
    prefix.push(0f64);
    let mut acc = 0f64;
    for &v in sorted {
        acc += v as f64;
        prefix.push(acc);
    }
    let quant: Vec<f64> = (0..l)
        .map(|i| sorted[(((2 * i + 1) * k) / (2 * l)).min(k - 1)] as f64)
        .collect();
    let (lo, hi) = (sorted[0] as f64, sorted[k - 1] as f64);
    let step = (hi - lo) / l as f64;
    let uniform: Vec<f64> = (0..l).map(|i| lo + (i as f64 + 0.5) * step).collect();
    let a = lloyd(sorted, &prefix, quant, iters);
    let b = lloyd(sorted, &prefix, uniform, iters);
    if quantization_mse(sorted, &b) < quantization_mse(sorted, &a) {
        b
    } else {
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::decompress;
    use crate::mipd::tests::sample;
    use crate::mipd::MipdConfig;

    /// MSE of the uniform mid-rise quantizer with `l` levels on `[min, max]`.
    fn uniform_mse(sorted: &[f32], l: usize) -> f64 {
        let (lo, hi) = (sorted[0] as f64, sorted[sorted.len() - 1] as f64);
        let step = (hi - lo) / l as f64;
        let se: f64 = sorted
            .iter()
            .map(|&v| {
                let cell = (((v as f64 - lo) / step).floor() as usize).min(l - 1);
                let q = (lo + (cell as f64 + 0.5) * step) as f32;
                ((v - q) as f64).powi(2)
            })
            .sum();
        se / sorted.len() as f64
    }

    #[test]
    fn codebook_mse_is_at_most_the_uniform_quantizers() {
        for dist in 0..3 {
            for bits in 1..=6u32 {
                let mut v = sample(dist, 5000, 0.01, 7 + dist as u64);
                v.sort_unstable_by(f32::total_cmp);
                let l = 1usize << bits;
                let cb = fit_codebook(&v, l, 10);
                assert!(cb.len() <= l && !cb.is_empty());
                assert!(cb.windows(2).all(|p| p[0] < p[1]), "strictly ascending");
                let ours = quantization_mse(&v, &cb);
                let uni = uniform_mse(&v, l);
                assert!(
                    ours <= uni * (1.0 + 1e-6),
                    "dist {dist} bits {bits}: code-book {ours} vs uniform {uni}"
                );
                // On heavy tails the fitted code-book wins by a wide margin.
                if dist == 2 && bits >= 3 {
                    assert!(
                        ours < 0.75 * uni,
                        "dist {dist} bits {bits}: {ours} vs {uni}"
                    );
                }
            }
        }
        // End to end: the decoded values of a fully kept layer carry that error.
        let g = sample(1, 3000, 0.02, 99);
        let mut c = MipdConfig {
            mass: 1.0,
            min_ratio: 1.0,
            max_ratio: 1.0,
            bits: 3,
            ..MipdConfig::default()
        }
        .init()
        .unwrap();
        let mut bytes = Vec::new();
        c.encode(&vec![1.0; g.len()], &g, &[], &mut bytes).unwrap();
        let mut out = vec![0f32; g.len()];
        decompress(&c, &bytes, &mut out).unwrap();
        let mse: f64 = g
            .iter()
            .zip(&out)
            .map(|(&a, &b)| ((a - b) as f64).powi(2))
            .sum::<f64>()
            / g.len() as f64;
        let mut sorted = g.clone();
        sorted.sort_unstable_by(f32::total_cmp);
        assert!(mse <= uniform_mse(&sorted, 8) * (1.0 + 1e-6));
        let mut distinct = out.clone();
        distinct.sort_unstable_by(f32::total_cmp);
        distinct.dedup();
        assert!(distinct.len() <= 8);
    }
}
