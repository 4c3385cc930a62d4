//! DLCP's dropped-value residual: the error feedback of the bounded-loss all-reduce
//! (ARCHITECTURE.md §2).
//!
//! DLCP sends dense buckets through an all-reduce that may complete a round without some
//! of the packets. With error feedback on, the values of this worker that no owner used
//! are kept per bucket and added to the worker's gradient of that bucket at the next
//! exchange, so the dropped mass is sent late rather than lost:
//! ```text
//! g ← g + r;  r ← 0          before the bucket is sent  (DlcpResidual::add_back)
//! r ← r + dropped            after the round            (DlcpResidual::dropped_mut)
//! ```
//! It is not a [`Memory`](super::Memory): it works in place on the gradient, and what a
//! round lost is known only from the collective's report (which the caller adds into
//! [`DlcpResidual::dropped_mut`]), not from a decoded payload.

use std::collections::BTreeMap;

/// Per dense bucket, this worker's values that the last DLCP round completed without.
///
/// A bucket's buffer is created (zeros) the first time values are dropped from it and then
/// stays: [`DlcpResidual::add_back`] empties it to zeros rather than removing it, so the
/// exported state of a bucket that once dropped values always holds its buffer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DlcpResidual {
    dropped: BTreeMap<u64, Vec<f32>>,
}

impl DlcpResidual {
    /// An empty residual.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds bucket `key`'s stored values into `grad` and sets them to zero (nothing when the
    /// bucket has dropped nothing yet). Elements past the shorter of the two are untouched.
    pub fn add_back(&mut self, key: u64, grad: &mut [f32]) {
        if let Some(r) = self.dropped.get_mut(&key) {
            for (g, d) in grad.iter_mut().zip(r.iter_mut()) {
                *g += *d;
                *d = 0.0;
            }
        }
    }

    /// The buffer of bucket `key` to add this round's dropped values into, created as `len`
    /// zeros if the bucket has none (an existing buffer is returned as it is).
    pub fn dropped_mut(&mut self, key: u64, len: usize) -> &mut [f32] {
        self.dropped.entry(key).or_insert_with(|| vec![0.0; len])
    }

    /// The stored values of bucket `key`, if it has a buffer.
    pub fn get(&self, key: u64) -> Option<&[f32]> {
        self.dropped.get(&key).map(Vec::as_slice)
    }

    /// Forgets every bucket's values.
    pub fn clear(&mut self) {
        self.dropped.clear();
    }

    /// The state for a checkpoint: one buffer per bucket that has one, keyed by bucket id.
    pub fn export(&self) -> BTreeMap<u64, Vec<f32>> {
        self.dropped.clone()
    }

    /// Replaces the state with one written by [`DlcpResidual::export`]. The buffers are taken
    /// as they are: checking them against the buckets is the caller's part.
    pub fn import(&mut self, state: BTreeMap<u64, Vec<f32>>) {
        self.dropped = state;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_back_without_a_buffer_changes_nothing() {
        let mut r = DlcpResidual::new();
        let mut g = [1.0f32, -2.0, 3.0];
        r.add_back(4, &mut g);
        assert_eq!(g, [1.0, -2.0, 3.0]);
        assert!(r.get(4).is_none());
        assert!(r.export().is_empty());
    }

    #[test]
    fn dropped_values_return_once_and_the_buffer_stays() {
        let mut r = DlcpResidual::new();
        let buf = r.dropped_mut(2, 4);
        assert_eq!(buf, [0.0; 4]);
        buf[1] += 0.5;
        buf[3] += -1.25;
        // A second report of the same round accumulates.
        r.dropped_mut(2, 4)[1] += 0.25;
        assert_eq!(r.get(2).unwrap(), [0.0, 0.75, 0.0, -1.25]);

        let mut g = [1.0f32, 1.0, 1.0, 1.0];
        r.add_back(2, &mut g);
        assert_eq!(g, [1.0, 1.75, 1.0, -0.25]);
        // Emptied to zeros, not removed: it is still exported.
        assert_eq!(r.get(2).unwrap(), [0.0; 4]);
        assert_eq!(r.export(), BTreeMap::from([(2, vec![0.0; 4])]));
        // Nothing is added twice; other buckets are untouched.
        r.add_back(2, &mut g);
        r.add_back(3, &mut g);
        assert_eq!(g, [1.0, 1.75, 1.0, -0.25]);
    }

    #[test]
    fn an_existing_buffer_keeps_its_length() {
        let mut r = DlcpResidual::new();
        r.dropped_mut(0, 3)[2] = 1.0;
        assert_eq!(r.dropped_mut(0, 5), [0.0, 0.0, 1.0]);
        // A shorter gradient takes the prefix; the rest stays stored.
        let mut g = [0.0f32; 2];
        r.dropped_mut(0, 3)[0] = 2.0;
        r.add_back(0, &mut g);
        assert_eq!(g, [2.0, 0.0]);
        assert_eq!(r.get(0).unwrap(), [0.0, 0.0, 1.0]);
    }

    #[test]
    fn state_round_trips_through_export_and_clear_empties() {
        let mut r = DlcpResidual::new();
        r.dropped_mut(1, 2).copy_from_slice(&[0.5, -0.5]);
        r.dropped_mut(7, 3)
            .copy_from_slice(&[1.0, f32::MIN_POSITIVE, -0.0]);
        let state = r.export();
        let mut back = DlcpResidual::new();
        back.dropped_mut(9, 1)[0] = 3.0;
        back.import(state.clone());
        assert_eq!(back, r);
        assert!(back.get(9).is_none(), "import replaces the state");
        assert_eq!(
            back.get(7).unwrap()[2].to_bits(),
            (-0.0f32).to_bits(),
            "bit for bit"
        );
        back.clear();
        assert!(back.export().is_empty());
        assert_eq!(r.export(), state);
    }
}
