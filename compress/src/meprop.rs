//! meProp-ready helper (ALGORITHMS.md §11): top-k **column** selection on a row-major
//! `[rows × cols]` matrix.
//!
//! In unified meProp one index set per minibatch is chosen from `Σ_examples |∂L/∂y|`: call
//! [`top_k_columns`] on `dy` (`rows` = batch, `cols` = output features); only those columns
//! of `dW = xᵀ·dy` are then non-zero ([`mask_columns`] zeroes the others). The same selector
//! applied to a weight gradient `dW` (`[in × out]`) picks the `k` output columns with the
//! largest L1 mass.

/// L1 score of each column: `score[c] = Σ_r |m[r·cols + c]|`, accumulated in f64.
///
/// # Panics
/// If `m.len() != rows · cols`.
pub fn column_scores(m: &[f32], rows: usize, cols: usize) -> Vec<f64> {
    assert_eq!(m.len(), rows * cols, "matrix is not rows × cols");
    let mut score = vec![0f64; cols];
    for row in m.chunks_exact(cols.max(1)).take(rows) {
        for (s, &x) in score.iter_mut().zip(row) {
            *s += x.abs() as f64;
        }
    }
    score
}

/// Writes into `out` (cleared first) the ascending indices of the `k` columns with the
/// largest L1 score, ties broken towards the smaller index. `k` is capped at `cols`.
///
/// # Panics
/// If `m.len() != rows · cols`, or if `m` holds NaN.
pub fn top_k_columns(m: &[f32], rows: usize, cols: usize, k: usize, out: &mut Vec<u32>) {
    let score = column_scores(m, rows, cols);
    out.clear();
    let k = k.min(cols);
    if k == 0 {
        return;
    }
    let mut order: Vec<u32> = (0..cols as u32).collect();
    let cmp = |a: &u32, b: &u32| {
        score[*b as usize]
            .partial_cmp(&score[*a as usize])
            .expect("column scores are not NaN")
            .then(a.cmp(b))
    };
    if k < cols {
        order.select_nth_unstable_by(k - 1, cmp);
    }
    out.extend_from_slice(&order[..k]);
    out.sort_unstable();
}

/// Zeroes every column of the row-major `[rows × cols]` matrix `m` not listed in `keep`
/// (ascending column indices, each `< cols`).
///
/// # Panics
/// If `m.len() != rows · cols` or an index is out of range.
pub fn mask_columns(m: &mut [f32], rows: usize, cols: usize, keep: &[u32]) {
    assert_eq!(m.len(), rows * cols, "matrix is not rows × cols");
    let mut mask = vec![false; cols];
    for &c in keep {
        mask[c as usize] = true;
    }
    for row in m.chunks_exact_mut(cols.max(1)).take(rows) {
        for (x, &keep) in row.iter_mut().zip(&mask) {
            if !keep {
                *x = 0.0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn brute(m: &[f32], rows: usize, cols: usize, k: usize) -> Vec<u32> {
        let s = column_scores(m, rows, cols);
        let mut idx: Vec<u32> = (0..cols as u32).collect();
        idx.sort_by(|&a, &b| {
            s[b as usize]
                .partial_cmp(&s[a as usize])
                .unwrap()
                .then(a.cmp(&b))
        });
        idx.truncate(k);
        idx.sort();
        idx
    }

    #[test]
    fn selects_the_k_heaviest_columns() {
        let mut rng = Rng::seed_from_u64(11);
        let mut out = Vec::new();
        for &(rows, cols) in &[(1usize, 1usize), (3, 7), (16, 50), (5, 500)] {
            for distinct in [3u64, 1 << 20] {
                let m: Vec<f32> = (0..rows * cols)
                    .map(|_| rng.below(distinct) as f32 - (distinct / 2) as f32)
                    .collect();
                for k in [0, 1, cols / 3, cols, cols + 5] {
                    top_k_columns(&m, rows, cols, k, &mut out);
                    assert_eq!(
                        out,
                        brute(&m, rows, cols, k.min(cols)),
                        "{rows}x{cols} k {k}"
                    );
                }
            }
        }
    }

    #[test]
    fn unified_meprop_dw_has_exactly_k_nonzero_columns() {
        // dW = xᵀ·dy with dy masked to the top-k columns of Σ_batch |dy|.
        let (batch, inp, outp, k) = (8usize, 6usize, 20usize, 4usize);
        let mut rng = Rng::seed_from_u64(5);
        let x: Vec<f32> = (0..batch * inp).map(|_| rng.next_f32() + 0.1).collect();
        let dy: Vec<f32> = (0..batch * outp).map(|_| rng.next_f32() - 0.5).collect();
        let mut cols = Vec::new();
        top_k_columns(&dy, batch, outp, k, &mut cols);
        let mut dyk = dy.clone();
        mask_columns(&mut dyk, batch, outp, &cols);
        let matmul = |d: &[f32]| {
            let mut w = vec![0f32; inp * outp];
            for b in 0..batch {
                for i in 0..inp {
                    for o in 0..outp {
                        w[i * outp + o] += x[b * inp + i] * d[b * outp + o];
                    }
                }
            }
            w
        };
        let dw = matmul(&dyk);
        let dense = matmul(&dy);
        let nz: Vec<u32> = (0..outp as u32)
            .filter(|&o| (0..inp).any(|i| dw[i * outp + o as usize] != 0.0))
            .collect();
        assert_eq!(nz, cols);
        for i in 0..inp {
            for &o in &cols {
                assert_eq!(dw[i * outp + o as usize], dense[i * outp + o as usize]);
            }
        }
        // k = out reproduces standard backprop.
        top_k_columns(&dy, batch, outp, outp, &mut cols);
        let mut all = dy.clone();
        mask_columns(&mut all, batch, outp, &cols);
        assert_eq!(matmul(&all), dense);
    }
}
