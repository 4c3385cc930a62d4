//! DLCP: bounded-loss, priority-dropping gradient exchange (ALGORITHMS.md §13).
//!
//! SGD tolerates losing a bounded fraction of a gradient. DLCP uses that to cut the *tail*
//! of a round: instead of waiting for the last straggling or lost packet (or its
//! retransmission), a receiver closes the round at a deadline once at most `p_max` of each
//! tensor's packets are missing, and treats the missing ones as zeros. Which packets go
//! missing is steered by priority: every packet carries one, the sender transmits in strict
//! priority order and, under a capacity limit, drops the least important first.
//!
//! This module emulates that in software, over any [`crate::Transport`]:
//!
//! * [`packet`]: the self-describing packet format (round, tensor, layer, offset, count,
//!   slot index, priority, sender, owner; [`packet::decode`] never panics), the packet plan
//!   of a segment ([`Layout`]) and order-independent reassembly ([`Reassembler`]).
//! * [`Priority`]: how a packet's priority is computed (layer position × magnitude by
//!   default, or any function).
//! * [`LossModel`]: the emulated network — seeded, deterministic packet drops and a tail
//!   injector that delays a fraction of packets. **It lives in the DLCP sender**, not in the
//!   link emulation ([`crate::shaping`]): the machine decides each packet's fate when it
//!   hands the packet out, drops it (never sent) or holds it back and sends it `delay`
//!   later. Bandwidth and latency still come from the transport's link emulation, so the
//!   delayed packets queue behind the rest on the shaped link. (No `netem` on this kernel.)
//! * [`machine::DlcpAllReduce`]: the collective, an IO-free state machine with timers,
//!   driven by [`crate::Communicator::dlcp_all_reduce`].
//!
//! # The collective
//! The flat buffer of `n` elements is split into `P` segments ([`crate::segment_range`]);
//! rank `q` owns segment `q`. The caller describes the buffer as consecutive tensors
//! ([`DlcpTensor`]: range and layer).
//!
//! 1. **Lossy reduce-scatter.** Every rank cuts its contribution to every other owner's
//!    segment into packets ([`Layout`]: per tensor, at most `mtu / 4` elements each), gives
//!    each a priority, sorts all of them by priority (strict priority queue: highest first,
//!    ties by slot then owner), drops the tail beyond [`DlcpConfig::budget_bytes`] (the
//!    emulated switch queue), and hands the rest to the [`LossModel`] and then the transport.
//! 2. **Round rule at each owner.** After its last first transmission to an owner, a
//!    sender sends it an end-of-transmission marker (reliable, and behind the data on the
//!    link, which the [`crate::Transport`] keeps in order): once it is in, whatever of that
//!    sender's packets is missing was lost, delayed or dropped by the budget, not merely in
//!    flight. The owner's round is complete as soon as every packet from every peer arrived.
//!    Otherwise it decides at the first **decision point** — every peer's marker arrived, or
//!    [`DlcpConfig::deadline`] (from the owner's start of the round) passed: if for *each
//!    tensor* the owner's segment touches at most `⌊p_max · expected⌋` of its packets (over
//!    all senders) are missing, it completes without them; else it NACKs those tensors'
//!    missing packets to the senders whose marker arrived (never a packet that may still be
//!    in flight), again every [`DlcpConfig::retransmit_interval`] while the bound is
//!    exceeded, and completes as soon as the bound holds. So a drop fraction ≤ p_max
//!    completes without retransmission and > p_max retransmits; `p_max = 0` is a reliable
//!    transport with NACK-based fast retransmission. The deadline is what cuts a straggler:
//!    a sender whose marker is late (a slow link, a late start, held-back packets ahead of
//!    it do not delay it) is left out of the round at the deadline as far as the bound
//!    allows. Retransmissions go through the loss model again (they may be lost too) but not
//!    through the capacity budget. (The marker is the one addition to ALGORITHMS.md §13's
//!    rule; without it an owner cannot tell a lost packet from one in flight, and would
//!    either always wait for the deadline or NACK packets still on their way.)
//! 3. **Reduce.** The owner sums its segment in **rank order** 0..P−1 from `+0.0`, each
//!    rank's contribution as reassembled (missing packets are zeros; the owner's own
//!    contribution never crosses the network and is always complete). Packets that arrive
//!    after this are ignored.
//! 4. **Reliable all-gather.** The owner sends every peer the bitmap of which packets of
//!    which sender it used, then its reduced segment. Every rank thus ends with bit-identical
//!    results (the owner's bits are copied), and every sender learns which of its packets
//!    were not used: the [`DlcpReport::dropped`] ranges and [`DlcpReport::dropped_values`] of
//!    its own contribution, which the trainer adds back into its error-feedback residual
//!    ([`DlcpReport::add_dropped_to`]).
//!
//! With no loss the result is exactly the rank-order sum of the inputs, which equals
//! [`crate::Communicator::all_reduce_sum`] up to float summation order (the ring sums in a
//! rotating order).
//!
//! Late packets: a duplicate (a retransmission racing a delayed original) is ignored; a
//! packet of an earlier round is ignored by the machine and by the driver (a DLCP message
//! with an older sequence number is legal, unlike for the other collectives). Packets held
//! back by the tail injector when this rank's round completes are discarded: they would only
//! arrive late and be ignored.
//!
//! Ranks are assumed to enter a round at about the same time (synchronous data
//! parallelism): the deadline counts from the owner's own start, so it should cover the
//! usual skew plus the transfer time; a shorter one leaves out (up to the bound) packets of
//! senders that were merely slow. The bound is per tensor and per owner segment, so a small
//! tensor may allow no loss at all (`⌊p_max · expected⌋ = 0`): with 3 senders and 20
//! packets each, `p_max = 0.01` is reliable for that tensor.

pub mod machine;
pub mod packet;

use std::ops::Range;
use std::time::Duration;

pub use machine::DlcpAllReduce;
pub use packet::{DlcpTensor, Layout, Reassembler, Slot};

use crate::transport::ByteCount;

/// How a packet's priority is computed (larger = more important, sent first, dropped last).
#[derive(Debug, Clone, Copy)]
pub enum Priority {
    /// `prio = L1(values) · (1 + layer_weight · (L − 1 − layer) / (L − 1))`: the packet's
    /// gradient mass (the sum of absolute values: what dropping it loses), boosted for layers
    /// near the input (layer 0 gets `1 + layer_weight`, the last layer 1), since the next
    /// forward pass needs them first. `L` is `num_layers`, or, if 0, one more than the largest
    /// layer in the call. Non-finite values give the highest priority (`f32::MAX`), so they
    /// are never dropped silently.
    LayerMagnitude {
        /// Boost of layer 0 over the last layer (0 = magnitude only).
        layer_weight: f32,
        /// Number of layers of the model (0 = from the call's tensors).
        num_layers: u32,
    },
    /// Any function of `(layer, num_layers, values)`; a non-finite result is taken as
    /// `f32::MAX`.
    Custom(fn(u32, u32, &[f32]) -> f32),
}

impl Default for Priority {
    fn default() -> Self {
        Priority::LayerMagnitude {
            layer_weight: 1.0,
            num_layers: 0,
        }
    }
}

impl Priority {
    /// The priority of a packet of `layer` (of `num_layers`, the value resolved for the
    /// call) with `values`.
    pub fn of(&self, layer: u32, num_layers: u32, values: &[f32]) -> f32 {
        let p = match *self {
            Priority::LayerMagnitude {
                layer_weight,
                num_layers: l,
            } => {
                let l = if l == 0 { num_layers } else { l };
                let l1: f64 = values.iter().map(|v| f64::from(v.abs())).sum();
                let depth = if l > 1 {
                    f64::from(l.saturating_sub(1).saturating_sub(layer)) / f64::from(l - 1)
                } else {
                    0.0
                };
                (l1 * (1.0 + f64::from(layer_weight) * depth)) as f32
            }
            Priority::Custom(f) => f(layer, num_layers, values),
        };
        if p.is_finite() {
            p
        } else {
            f32::MAX
        }
    }
}

/// What the emulated network does to one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Sent now.
    Deliver,
    /// Lost: never sent.
    Drop,
    /// Sent after the given delay (a straggling packet).
    Delay(Duration),
}

/// Emulated packet loss and tail latency, applied by the DLCP sender to every data packet
/// it transmits (first transmissions and retransmissions; control messages — NACKs, bitmaps,
/// reduced segments — are reliable). Each packet's fate is a pure function of
/// `(seed, round, sender, owner, slot, attempt)`, so runs are reproducible and independent
/// of timing. The default loses and delays nothing.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LossModel {
    /// Probability that a packet is lost.
    pub drop_prob: f64,
    /// Probability that a (not lost) packet is held back by [`LossModel::delay`].
    pub delay_prob: f64,
    /// How long a delayed packet is held.
    pub delay: Duration,
    /// Seed of the fates.
    pub seed: u64,
}

impl LossModel {
    /// The fate of one transmission of a packet.
    pub fn fate(&self, round: u64, sender: usize, owner: usize, slot: usize, attempt: u32) -> Fate {
        if self.drop_prob <= 0.0 && self.delay_prob <= 0.0 {
            return Fate::Deliver;
        }
        let mut s = self.seed ^ 0x6A09_E667_F3BC_C908;
        for x in [
            round,
            sender as u64,
            owner as u64,
            slot as u64,
            u64::from(attempt),
        ] {
            s ^= splitmix(&mut s).wrapping_add(x);
        }
        let u = (splitmix(&mut s) >> 11) as f64 / (1u64 << 53) as f64;
        if u < self.drop_prob {
            Fate::Drop
        } else if u < self.drop_prob + self.delay_prob {
            Fate::Delay(self.delay)
        } else {
            Fate::Deliver
        }
    }

    /// Whether this model loses or delays anything.
    pub fn is_active(&self) -> bool {
        self.drop_prob > 0.0 || self.delay_prob > 0.0
    }
}

/// SplitMix64 step.
pub(crate) fn splitmix(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Configuration of a DLCP all-reduce. All ranks must use the same `mtu` (it fixes the
/// packet plan; a difference is reported as a mismatch); the other fields may differ.
#[derive(Debug, Clone)]
pub struct DlcpConfig {
    /// Largest fraction of each tensor's packets (per owner segment, over all senders) a
    /// round may complete without, in `[0, 1)`. 0 = reliable. Default 0.01.
    pub p_max: f64,
    /// Packet body size in bytes (a multiple of 4 is best; `mtu / 4` f32 per packet).
    /// Default 1400 (350 f32).
    pub mtu: usize,
    /// Time after the start of the round at which an owner applies the loss bound (and
    /// NACKs if it is exceeded). Default 20 ms.
    pub deadline: Duration,
    /// After the deadline, how often an owner NACKs packets that are still missing while
    /// the bound is exceeded. Default 10 ms.
    pub retransmit_interval: Duration,
    /// Byte budget of this rank's first transmissions in one round (packet header + body,
    /// the emulated switch queue): packets beyond it, lowest priority first, are dropped
    /// before sending. `None` (default) = unlimited.
    pub budget_bytes: Option<usize>,
    /// Packet priority. Default [`Priority::LayerMagnitude`] with weight 1.
    pub priority: Priority,
    /// Emulated loss and tail latency. Default none.
    pub loss: LossModel,
}

impl Default for DlcpConfig {
    fn default() -> Self {
        DlcpConfig {
            p_max: 0.01,
            mtu: 1400,
            deadline: Duration::from_millis(20),
            retransmit_interval: Duration::from_millis(10),
            budget_bytes: None,
            priority: Priority::default(),
            loss: LossModel::default(),
        }
    }
}

impl DlcpConfig {
    /// Packet body in f32 elements.
    pub fn mtu_elems(&self) -> usize {
        (self.mtu / 4).max(1)
    }

    /// Checks the ranges of the fields; an error names the field.
    pub fn validate(&self) -> Result<(), DlcpConfigError> {
        let bad = |field: &'static str, reason: String| Err(DlcpConfigError { field, reason });
        if !(0.0..1.0).contains(&self.p_max) {
            return bad("p_max", format!("{} is not in [0, 1)", self.p_max));
        }
        if self.mtu < 4 || self.mtu > 1 << 20 {
            return bad("mtu", format!("{} is not in [4, 1 MiB]", self.mtu));
        }
        if self.retransmit_interval.is_zero() {
            return bad("retransmit_interval", "must be positive".into());
        }
        let l = &self.loss;
        for (field, p) in [
            ("loss.drop_prob", l.drop_prob),
            ("loss.delay_prob", l.delay_prob),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return bad(field, format!("{p} is not in [0, 1]"));
            }
        }
        if l.drop_prob + l.delay_prob > 1.0 {
            return bad(
                "loss.delay_prob",
                format!(
                    "drop_prob + delay_prob = {} exceeds 1",
                    l.drop_prob + l.delay_prob
                ),
            );
        }
        Ok(())
    }
}

/// A [`DlcpConfig`] field out of range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DlcpConfigError {
    /// The field (`p_max`, `mtu`, `retransmit_interval`, `loss.drop_prob`,
    /// `loss.delay_prob`).
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl std::fmt::Display for DlcpConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DLCP {}: {}", self.field, self.reason)
    }
}

impl std::error::Error for DlcpConfigError {}

/// What one DLCP all-reduce did, as seen by one rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DlcpReport {
    /// Data packets of this rank's contribution to its peers' segments.
    pub packets: usize,
    /// Of those, dropped by the capacity budget before sending.
    pub capacity_dropped: usize,
    /// Transmissions (first and retransmitted) lost by the loss model.
    pub lost: usize,
    /// Transmissions held back by the tail injector.
    pub delayed: usize,
    /// Held-back transmissions discarded because the round completed first.
    pub delayed_discarded: usize,
    /// Transmissions handed to the transport (first, retransmitted, and delayed ones sent).
    pub sent: usize,
    /// Retransmissions (NACKed packets sent again, or lost again).
    pub retransmitted: usize,
    /// NACK messages this rank sent as an owner.
    pub nacks_sent: usize,
    /// NACK rounds of this rank's own segment (0 = completed without retransmission).
    pub nack_rounds: usize,
    /// Whether this rank's segment was reduced with packets missing (within the bound).
    pub completed_with_loss: bool,
    /// Duplicate or late packets this rank received and ignored (this round).
    pub ignored: usize,
    /// Packets (all senders, all segments) the owners did not use, from the bitmaps: the
    /// same on every rank.
    pub dropped_packets_all: usize,
    /// Packets crossing the network in all (all senders, all segments).
    pub packets_all: usize,
    /// Elements the owners did not use, over all senders (same on every rank).
    pub dropped_elems_all: usize,
    /// Elements crossing the network in all (`(P−1) · n`).
    pub elems_all: usize,
    /// The ranges of this rank's contribution that no owner used, in buffer order, adjacent
    /// ones merged.
    pub dropped: Vec<Range<usize>>,
    /// This rank's values at [`DlcpReport::dropped`], concatenated in order.
    pub dropped_values: Vec<f32>,
    /// Bytes of the call, framing included (set by the communicator).
    pub bytes: ByteCount,
}

impl DlcpReport {
    /// Adds the values of this rank's contribution that were dropped into `residual` (the
    /// flat error-feedback buffer of the call's data): the error-feedback option, so that the
    /// dropped mass is sent with the next step.
    ///
    /// # Panics
    /// If `residual` is shorter than the call's buffer.
    pub fn add_dropped_to(&self, residual: &mut [f32]) {
        let mut vals = self.dropped_values.iter();
        for r in &self.dropped {
            for (d, v) in residual[r.clone()].iter_mut().zip(&mut vals) {
                *d += v;
            }
        }
    }

    /// Fraction of the elements crossing the network that were dropped (all ranks).
    pub fn dropped_fraction(&self) -> f64 {
        if self.elems_all == 0 {
            0.0
        } else {
            self.dropped_elems_all as f64 / self.elems_all as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_prefers_input_layers_and_large_magnitude() {
        let p = Priority::default();
        let v = [1.0f32, -2.0, 0.5];
        // Same values: the layer nearer the input wins; layer 0 of 5 gets twice the weight.
        assert!(p.of(0, 5, &v) > p.of(3, 5, &v));
        assert_eq!(p.of(0, 5, &v), 2.0 * p.of(4, 5, &v));
        assert_eq!(p.of(4, 5, &v), 3.5);
        // Same layer: larger L1 wins.
        assert!(p.of(2, 5, &[3.0]) > p.of(2, 5, &[-1.0, 1.0]));
        assert_eq!(p.of(0, 1, &[f32::NAN]), f32::MAX);
        let custom = Priority::Custom(|layer, _, _| -(layer as f32));
        assert!(custom.of(0, 9, &[0.0]) > custom.of(1, 9, &[100.0]));
        let fixed = Priority::LayerMagnitude {
            layer_weight: 3.0,
            num_layers: 3,
        };
        assert_eq!(fixed.of(0, 99, &[1.0]), 4.0);
    }

    #[test]
    fn loss_model_is_deterministic_and_has_the_right_rates() {
        let m = LossModel {
            drop_prob: 0.1,
            delay_prob: 0.2,
            delay: Duration::from_millis(5),
            seed: 42,
        };
        let n = 20_000;
        let fates: Vec<Fate> = (0..n).map(|k| m.fate(3, 1, 2, k, 0)).collect();
        let again: Vec<Fate> = (0..n).map(|k| m.fate(3, 1, 2, k, 0)).collect();
        assert_eq!(fates, again);
        let drops = fates.iter().filter(|f| **f == Fate::Drop).count() as f64 / n as f64;
        let delays = fates.iter().filter(|f| matches!(f, Fate::Delay(_))).count() as f64 / n as f64;
        // 5 standard errors.
        assert!(
            (drops - 0.1).abs() < 5.0 * (0.1f64 * 0.9 / n as f64).sqrt(),
            "{drops}"
        );
        assert!(
            (delays - 0.2).abs() < 5.0 * (0.2f64 * 0.8 / n as f64).sqrt(),
            "{delays}"
        );
        // Another attempt of the same packet has an independent fate.
        let differ = (0..n)
            .filter(|&k| m.fate(3, 1, 2, k, 0) != m.fate(3, 1, 2, k, 1))
            .count();
        assert!(differ > n / 10);
        assert_eq!(LossModel::default().fate(0, 0, 1, 0, 0), Fate::Deliver);
    }

    #[test]
    fn report_restores_dropped_values() {
        let r = DlcpReport {
            dropped: vec![1..3, 5..6],
            dropped_values: vec![1.0, 2.0, 3.0],
            ..DlcpReport::default()
        };
        let mut e = vec![10.0f32; 7];
        r.add_dropped_to(&mut e);
        assert_eq!(e, vec![10.0, 11.0, 12.0, 10.0, 10.0, 13.0, 10.0]);
    }

    #[test]
    fn config_validation() {
        assert!(DlcpConfig::default().validate().is_ok());
        let bad = DlcpConfig {
            p_max: 1.0,
            ..DlcpConfig::default()
        };
        assert!(bad.validate().is_err());
        let mut bad = DlcpConfig::default();
        bad.loss.drop_prob = 0.7;
        bad.loss.delay_prob = 0.7;
        assert!(bad.validate().is_err());
        assert_eq!(DlcpConfig::default().mtu_elems(), 350);
    }
}
