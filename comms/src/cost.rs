//! The α–β cost of one bucket's collective: seconds on a link of bandwidth β (bytes/s) and
//! per-message latency α, for P ranks. One set of formulas, used by `dtrain simulate` (to
//! project measured runs onto other fabrics and worker counts) and by the trainer's
//! automatic choice of collective per bucket (`[compress] collective = "auto"`), so that
//! what the simulator validates against emulated runs is what the choice is made with.
//!
//! | collective | bytes a rank sends | seconds |
//! |---|---|---|
//! | dense all-reduce, ring ([`dense_all_reduce`]) | `2(P−1)/P · n` | `2(P−1)/P · n/β + 2(P−1)·α` |
//! | dense all-reduce, recursive doubling (`n` ≤ [`SMALL_ALL_REDUCE_BYTES`]) | `⌈log2 P⌉ · n` | `rounds · (n/β + α)` |
//! | hierarchical all-reduce over `M` hosts ([`hierarchical_all_reduce`]) | leaders: the dense all-reduce's among `M` | the dense all-reduce among `M` leaders |
//! | all-gather of payloads ([`all_gather`]) | `(P−1) · c` | `(P−1) · c/β + (P−1)·α` |
//! | chain broadcast + all-reduce of lanes ([`broadcast_all_reduce`]) | `c/2` + the ring's on `c/2` | `c/2/β + (P−1)·α` + the dense all-reduce of `c/2` |
//! | sparse all-reduce ([`sparse_all_reduce`]) | `(P−1)/P · (min(k·e(k/n), 4n) + min(s·e(s/n), 4n))` | those bytes`/β + 2α` |
//! | compressed all-reduce ([`compressed_all_reduce`]) | `2(P−1)/P · c` | `2(P−1)/P · c/β + 2α` |
//!
//! `n` is the bucket's dense f32 bytes (or element count where stated), `c` one rank's
//! encoded payload of the bucket, `k` its non-zero entries, `s` the entries of the sum and
//! `e(d)` the bytes of one delta-coded entry at density `d` ([`entry_bytes`]). The ring's
//! and the all-gather's formulas are [`LinkSpec`]'s `predict_*`, which the link emulation is
//! checked against.
//!
//! What the model leaves out: contention, switch hops and software overheads beyond α (each
//! rank has a full-duplex link of its own); the direct collectives' `P − 1` messages of a
//! round are charged one α (they go out together). The hierarchical all-reduce's host-local
//! stages are not charged: they move bytes within a host (memory copies over shared
//! memory, or the loopback), which the network link does not carry.

use crate::shaping::LinkSpec;

/// All-reduces of at most this many bytes use recursive doubling in
/// [`crate::Communicator::all_reduce_sum`] with the default
/// [`CommConfig::small_all_reduce_bytes`](crate::CommConfig::small_all_reduce_bytes).
pub const SMALL_ALL_REDUCE_BYTES: f64 = (64 << 10) as f64;

fn serialise(link: &LinkSpec, bytes: f64) -> f64 {
    link.bandwidth.map_or(0.0, |bw| bytes / bw)
}

/// Seconds of a dense all-reduce of `bytes` on `p` ranks: recursive doubling up to
/// [`SMALL_ALL_REDUCE_BYTES`], the ring above.
pub fn dense_all_reduce(link: &LinkSpec, bytes: f64, p: usize) -> f64 {
    if bytes <= SMALL_ALL_REDUCE_BYTES {
        link.predict_recursive_doubling(bytes, p)
    } else {
        link.predict_all_reduce(bytes, p)
    }
}

/// Seconds of a hierarchical all-reduce of `bytes` over `hosts` hosts: the dense
/// all-reduce among the hosts' leaders (the host-local stages are not charged).
pub fn hierarchical_all_reduce(link: &LinkSpec, bytes: f64, hosts: usize) -> f64 {
    dense_all_reduce(link, bytes, hosts)
}

/// Seconds of an all-gather of one `payload`-byte block from each of `p` ranks.
pub fn all_gather(link: &LinkSpec, payload: f64, p: usize) -> f64 {
    link.predict_all_gather(p as f64 * payload, p)
}

/// Seconds of a two-phase summable exchange of `payload` bytes (ScaleCom): a chain
/// broadcast of the leader's half, then the dense all-reduce of the value lanes' half.
pub fn broadcast_all_reduce(link: &LinkSpec, payload: f64, p: usize) -> f64 {
    let half = payload / 2.0;
    link.predict_broadcast(half, p) + dense_all_reduce(link, half, p)
}

/// Seconds of a sparse all-reduce on `p` ranks of `entries` non-zeros per rank in a bucket
/// of `elems` elements, where a fraction `new_fraction` ∈ [0, 1] of another rank's entries
/// is new to the sum (1: independent index sets, the upper bound). Phase 1 brings each
/// owner the shares of its range, phase 2 the reduced ranges, each sparse or dense (4 bytes an
/// element), whichever is smaller.
pub fn sparse_all_reduce(
    link: &LinkSpec,
    entries: f64,
    elems: f64,
    new_fraction: f64,
    p: usize,
) -> f64 {
    if p < 2 {
        return 0.0;
    }
    let pf = p as f64;
    let n = elems.max(1.0);
    let sum = (entries * (1.0 + new_fraction.clamp(0.0, 1.0) * (pf - 1.0))).min(elems);
    let share = (entries * entry_bytes(entries / n)).min(elems * 4.0);
    let reduced = (sum * entry_bytes(sum / n)).min(elems * 4.0);
    let bytes = (pf - 1.0) / pf * (share + reduced);
    2.0 * link.latency.as_secs_f64() + serialise(link, bytes)
}

/// Seconds of a compressed all-reduce of a `payload`-byte encoding on `p` ranks: every
/// owner receives its range's `P − 1` shares and sends its re-encoded sum to `P − 1` ranks.
pub fn compressed_all_reduce(link: &LinkSpec, payload: f64, p: usize) -> f64 {
    if p < 2 {
        return 0.0;
    }
    let pf = p as f64;
    2.0 * link.latency.as_secs_f64() + serialise(link, 2.0 * (pf - 1.0) / pf * payload)
}

/// Expected wire bytes of one sparse all-reduce entry in a range of density `d` (entries per
/// element): a 4-byte value and a LEB128 gap, whose length is 1 byte plus one for each of
/// 2⁷, 2¹⁴, 2²¹, 2²⁸ the gap reaches, with gaps geometric (`P(gap ≥ g) = (1 − d)^g`); never
/// more than the 8 bytes of a (u32, f32) pair, which the encoder falls back to.
pub fn entry_bytes(d: f64) -> f64 {
    let d = d.clamp(0.0, 1.0);
    if d == 0.0 {
        return 8.0;
    }
    let q = (1.0 - d).ln();
    let gap: f64 = 1.0
        + [7, 14, 21, 28]
            .iter()
            .map(|&e| (q * 2f64.powi(e)).exp())
            .sum::<f64>();
    (4.0 + gap).min(8.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link() -> LinkSpec {
        LinkSpec::parse(Some("10Gbit"), Some("10us")).unwrap()
    }

    #[test]
    fn entry_bytes_follow_the_gap_length() {
        // 1 %: mean gap 100, a quarter of the gaps need a second byte.
        let e = entry_bytes(0.01);
        assert!((5.2..5.35).contains(&e), "{e}");
        // Dense ranges: one-byte gaps.
        assert!((entry_bytes(0.5) - 5.0).abs() < 1e-9);
        // Very sparse: capped at a pair.
        assert_eq!(entry_bytes(1e-12), 8.0);
        assert_eq!(entry_bytes(0.0), 8.0);
    }

    #[test]
    fn dense_all_reduce_switches_to_recursive_doubling_for_small_buckets() {
        let l = link();
        assert_eq!(
            dense_all_reduce(&l, 1024.0, 8),
            l.predict_recursive_doubling(1024.0, 8)
        );
        assert_eq!(dense_all_reduce(&l, 1e6, 8), l.predict_all_reduce(1e6, 8));
        // The hierarchy pays the leaders' all-reduce only.
        assert_eq!(
            hierarchical_all_reduce(&l, 1e6, 2),
            l.predict_all_reduce(1e6, 2)
        );
    }

    #[test]
    fn compressed_all_reduce_stays_flat_and_all_gather_grows_with_the_ranks() {
        let l = link();
        let c = 1e6;
        // 2(P−1)/P of a payload each way: under twice a payload's serialisation.
        for p in [2usize, 8, 64, 256] {
            assert!(compressed_all_reduce(&l, c, p) < 2.0 * c / 1.25e9 + 2e-5 + 1e-12);
        }
        assert!(all_gather(&l, c, 64) > 30.0 * all_gather(&l, c, 2));
        assert_eq!(compressed_all_reduce(&l, c, 1), 0.0);
        assert_eq!(sparse_all_reduce(&l, 100.0, 1e4, 1.0, 1), 0.0);
    }

    #[test]
    fn sparse_all_reduce_of_overlapping_sets_beats_the_all_gather() {
        let l = link();
        // 1 % of 4 M elements as (index, value) pairs.
        let (k, n) = (40_000.0, 4e6);
        for p in [4usize, 16, 64] {
            let shared = sparse_all_reduce(&l, k, n, 0.1, p);
            assert!(shared < all_gather(&l, 8.0 * k, p), "P={p}");
        }
        // Once the sum is dense its cost stops growing.
        let (a, b) = (
            sparse_all_reduce(&l, k, n, 1.0, 128),
            sparse_all_reduce(&l, k, n, 1.0, 256),
        );
        assert!(b < 1.01 * a, "{a} {b}");
    }
}
