//! The replicas stay identical: every `cluster.check_replicas_every` steps (at the first
//! step from there where they must be identical) the workers compare a hash of their
//! parameters (issue 53, scope 3). One all-reduce of four floats
//! per worker tells every rank every rank's hash; a mismatch stops the run naming the
//! ranks, their hashes and the step — never a silent divergence.

use dtrain_comms::Transport;

use super::{TrainError, Trainer};

/// A 64-bit hash of the bit patterns of `params` (and their count): equal for bit-identical
/// replicas, different (but for a 2⁻⁶⁴ chance) otherwise. Not cryptographic.
pub(crate) fn param_hash(params: &[f32]) -> u64 {
    let mut h = 0x243F_6A88_85A3_08D3u64 ^ params.len() as u64;
    for pair in params.chunks(2) {
        let lo = pair[0].to_bits() as u64;
        let hi = pair.get(1).map_or(0, |x| x.to_bits()) as u64;
        h = (h ^ (lo | hi << 32))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }
    // Final avalanche (SplitMix64's), so that nearby inputs give unrelated hashes.
    h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 31)
}

/// `hash` as four 16-bit pieces, each exact in an f32 (and in a sum with zeros).
fn pieces(hash: u64) -> [f32; 4] {
    std::array::from_fn(|i| ((hash >> (16 * i)) & 0xFFFF) as f32)
}

fn from_pieces(p: &[f32]) -> u64 {
    p.iter()
        .enumerate()
        .map(|(i, &x)| (x as u64 & 0xFFFF) << (16 * i))
        .fold(0, |a, b| a | b)
}

/// What differs, grouped by hash (the group holding rank 0 first): `rank 0, 2: 0123…;
/// rank 1: 4567…`.
fn describe(hashes: &[u64]) -> String {
    let mut groups: Vec<(u64, Vec<usize>)> = Vec::new();
    for (r, &h) in hashes.iter().enumerate() {
        match groups.iter_mut().find(|g| g.0 == h) {
            Some(g) => g.1.push(r),
            None => groups.push((h, vec![r])),
        }
    }
    groups
        .iter()
        .map(|(h, ranks)| {
            let ranks: Vec<String> = ranks.iter().map(usize::to_string).collect();
            let word = if ranks.len() == 1 { "rank" } else { "ranks" };
            format!("{word} {}: {h:016x}", ranks.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

impl<T: Transport> Trainer<T> {
    /// Whether the replicas are compared after `step`: the first step, at or after each
    /// multiple of `check_replicas_every` steps, where they must be identical (a periodic
    /// `[sync]`'s round may end between two multiples).
    pub(super) fn replica_check_due(&self, step: u64) -> bool {
        let every = self.plan.config.cluster.check_replicas_every;
        every > 0
            && (step + 1) / every > self.replicas_checked_at / every
            && self.sync.lockstep()
            && self.sync.identical()
    }

    /// Compares the replicas' parameters after `step`; this rank's hash as written into
    /// `metrics.jsonl`, or the error naming the ranks that differ.
    pub(super) fn check_replicas(&mut self, step: u64) -> Result<String, TrainError> {
        self.replicas_checked_at = step + 1;
        let own = param_hash(&self.params());
        if self.world > 1 {
            let mut all = vec![0.0f32; 4 * self.world];
            all[4 * self.rank..4 * self.rank + 4].copy_from_slice(&pieces(own));
            self.comm
                .all_reduce_sum(&mut all)
                .map_err(|source| TrainError::Comm { step, source })?;
            let hashes: Vec<u64> = all.chunks(4).map(from_pieces).collect();
            if hashes.iter().any(|&h| h != hashes[0]) {
                return Err(TrainError::Sync {
                    step,
                    reason: format!(
                        "the replicas' parameters differ after this step \
                         (cluster.check_replicas_every = {}): {}",
                        self.plan.config.cluster.check_replicas_every,
                        describe(&hashes)
                    ),
                });
            }
        }
        Ok(format!("{own:016x}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_sees_every_bit_and_the_length() {
        let a = vec![0.5f32, -1.25, 3.0];
        let h = param_hash(&a);
        assert_eq!(h, param_hash(&a.clone()));
        for i in 0..a.len() {
            for bit in [0, 13, 31] {
                let mut b = a.clone();
                b[i] = f32::from_bits(b[i].to_bits() ^ (1 << bit));
                assert_ne!(param_hash(&b), h, "value {i}, bit {bit}");
            }
        }
        // +0 and −0 are different bit patterns: replicas must be bit-identical.
        assert_ne!(param_hash(&[0.0]), param_hash(&[-0.0]));
        assert_ne!(param_hash(&[0.0]), param_hash(&[0.0, 0.0]));
        assert_ne!(param_hash(&[1.0, 2.0]), param_hash(&[2.0, 1.0]));
    }

    #[test]
    fn hashes_cross_an_f32_sum_exactly() {
        for h in [0u64, 1, u64::MAX, 0x0123_4567_89AB_CDEF] {
            let p = pieces(h);
            let zeros = [0.0f32; 4];
            let summed: Vec<f32> = p.iter().zip(&zeros).map(|(a, b)| a + b).collect();
            assert_eq!(from_pieces(&summed), h);
        }
    }

    #[test]
    fn a_mismatch_names_the_groups_of_ranks() {
        assert_eq!(
            describe(&[7, 9, 7]),
            "ranks 0, 2: 0000000000000007; rank 1: 0000000000000009"
        );
    }
}
