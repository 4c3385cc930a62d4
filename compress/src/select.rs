//! Exact selection of the `k` largest keys in O(n) average time.
//!
//! Used by Top-k, Dryden's adaptive threshold and exact-threshold gradient dropping. The
//! approach is the one that makes sparsifiers fast on CPUs: estimate a threshold from a
//! small deterministic sample, gather the (few) candidates above it in one branch-light
//! pass, then run an exact `select_nth_unstable` on the candidates only. The result is
//! identical to a full sort: the `k` largest keys, ties broken towards the smaller index,
//! returned in ascending index order.
//!
//! Keys are `u32` so that comparisons are integer comparisons: for a finite `f32`,
//! `(x.to_bits() & 0x7FFF_FFFF)` orders by `|x|`. A key of 0 marks an element that must
//! never be selected (see [`abs_key`]).

/// Order-preserving key of `|x|` for finite `x`, shifted by one so that 0 stays reserved
/// for "not a member".
#[inline(always)]
pub fn abs_key(x: f32) -> u32 {
    (x.to_bits() & 0x7FFF_FFFF) + 1
}

/// Reusable buffers for [`top_k`].
#[derive(Debug, Default, Clone)]
pub struct Scratch {
    cand: Vec<u32>,
    keys: Vec<u32>,
    sample: Vec<u32>,
}

const SAMPLE: usize = 2048;

/// Writes into `out` (cleared first) the ascending indices of the `k` elements of
/// `0..len` with the largest non-zero `key(i)`, ties broken by smaller index.
///
/// If fewer than `k` elements have a non-zero key, all of them are returned.
pub fn top_k(
    len: usize,
    k: usize,
    key: impl Fn(usize) -> u32,
    s: &mut Scratch,
    out: &mut Vec<u32>,
) {
    out.clear();
    if k == 0 || len == 0 {
        return;
    }
    // Threshold estimate from a strided sample with a fixed odd step (deterministic).
    let mut t: u32 = 1;
    if len > 4 * SAMPLE && k < len / 4 {
        s.sample.clear();
        let step = len / SAMPLE;
        for j in 0..SAMPLE {
            // Spread the sample point inside each stride to avoid aliasing with layer
            // structure (multiplicative hash of j).
            let off = (j.wrapping_mul(0x9E37_79B1) >> 7) % step;
            s.sample.push(key(j * step + off));
        }
        // Expected candidates above sample rank r: r/SAMPLE·len. Aim for ~1.5k + slack.
        let want = ((k as f64 * 1.5 / len as f64) * SAMPLE as f64).ceil() as usize + 8;
        if want < SAMPLE {
            let r = want;
            s.sample.select_nth_unstable_by(r, |a, b| b.cmp(a));
            t = s.sample[r].max(1);
        }
    }
    loop {
        s.cand.clear();
        for i in 0..len {
            if key(i) >= t {
                s.cand.push(i as u32);
            }
        }
        if s.cand.len() >= k || t == 1 {
            break;
        }
        // Under-estimated: retry from a threshold at most half as large.
        t = (t / 2).max(1);
    }
    if s.cand.len() <= k {
        out.extend_from_slice(&s.cand);
        return;
    }
    // Exact k-th largest key among the candidates.
    s.keys.clear();
    s.keys.extend(s.cand.iter().map(|&i| key(i as usize)));
    let (_, &mut kth, _) = s.keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    let above = s.keys.iter().filter(|&&x| x > kth).count();
    let mut ties = k - above;
    out.reserve(k);
    for &i in &s.cand {
        let kv = key(i as usize);
        if kv > kth {
            out.push(i);
        } else if kv == kth && ties > 0 {
            out.push(i);
            ties -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn brute(v: &[u32], k: usize) -> Vec<u32> {
        let mut idx: Vec<u32> = (0..v.len() as u32).filter(|&i| v[i as usize] > 0).collect();
        idx.sort_by(|&a, &b| v[b as usize].cmp(&v[a as usize]).then(a.cmp(&b)));
        idx.truncate(k);
        idx.sort();
        idx
    }

    #[test]
    fn matches_brute_force() {
        let mut rng = Rng::seed_from_u64(3);
        let mut s = Scratch::default();
        let mut out = Vec::new();
        for &len in &[1usize, 2, 7, 100, 5000, 40_000] {
            for &k in &[0usize, 1, 3, len / 100 + 1, len / 3, len] {
                for distinct in [4u64, 1 << 20] {
                    let v: Vec<u32> = (0..len).map(|_| rng.below(distinct) as u32).collect();
                    top_k(len, k, |i| v[i], &mut s, &mut out);
                    assert_eq!(out, brute(&v, k), "len {len} k {k} distinct {distinct}");
                }
            }
        }
    }

    #[test]
    fn adversarial_sample_miss() {
        // Large values hidden where the strided sample never looks: estimate too high.
        let len = 100_000;
        let mut v = vec![1u32; len];
        for i in (0..len).step_by(97) {
            v[i] = 1000 + i as u32;
        }
        let mut s = Scratch::default();
        let mut out = Vec::new();
        top_k(len, 2000, |i| v[i], &mut s, &mut out);
        assert_eq!(out, brute(&v, 2000));
    }
}
