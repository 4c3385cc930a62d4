//! DLCP packets: the self-describing wire format, the deterministic packet plan of a
//! segment ([`Layout`]), and order-independent reassembly ([`Reassembler`]).
//!
//! # Packet wire format (little-endian)
//! ```text
//! offset  size  field
//!      0     8  round    (u64: the collective's sequence number)
//!      8     4  tensor   (u32: index of the tensor in the call's tensor list)
//!     12     4  layer    (u32: the tensor's layer, 0 = nearest the input)
//!     16     4  offset   (u32: first element, relative to the tensor's start)
//!     20     4  count    (u32: f32 values in the body)
//!     24     4  index    (u32: the packet's slot in the owner segment's [`Layout`])
//!     28     4  prio     (f32, finite: larger = more important)
//!     32     2  sender   (u16: the rank whose contribution this is)
//!     34     2  owner    (u16: the rank that reduces this segment)
//!     36     …  body     (count × f32)
//! ```
//! [`decode`] checks only what the bytes alone can tell (length, body size, a finite
//! priority) and never panics; [`Reassembler::insert`] checks the packet against the plan.

use std::ops::Range;
use std::sync::Arc;

use thiserror::Error;

/// Length of an encoded [`PacketHeader`].
pub const PACKET_HEADER_LEN: usize = 36;

/// Errors decoding or placing a packet. Never a panic, never an allocation sized by a field.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PacketError {
    /// Fewer bytes than a header.
    #[error("packet of {len} bytes is shorter than the {PACKET_HEADER_LEN}-byte header")]
    Short {
        /// Bytes received.
        len: usize,
    },
    /// The body is not `count` f32 values.
    #[error("packet declares {count} values but carries {body} body bytes")]
    BodyLength {
        /// The header's count.
        count: u32,
        /// Body bytes present.
        body: usize,
    },
    /// The priority is NaN or infinite.
    #[error("packet priority is not finite")]
    Priority,
    /// The packet is of a later round than the receiver's.
    #[error("packet of round {got} while this receiver is at round {expected}")]
    FutureRound {
        /// The packet's round.
        got: u64,
        /// The receiver's round.
        expected: u64,
    },
    /// The packet does not match the plan (index out of range, wrong tensor / offset /
    /// count / layer, wrong sender or owner).
    #[error("packet does not match the plan: {0}")]
    Plan(String),
}

/// The header of one packet (layout in the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PacketHeader {
    /// The round (collective sequence number).
    pub round: u64,
    /// Index of the tensor in the call's tensor list.
    pub tensor: u32,
    /// The tensor's layer (0 = nearest the input).
    pub layer: u32,
    /// First element, relative to the tensor's start.
    pub offset: u32,
    /// Number of f32 values in the body.
    pub count: u32,
    /// The packet's slot in the owner segment's [`Layout`].
    pub index: u32,
    /// Priority (larger = more important; finite).
    pub prio: f32,
    /// The contributing rank.
    pub sender: u16,
    /// The rank that reduces the packet's segment.
    pub owner: u16,
}

impl PacketHeader {
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.round.to_le_bytes());
        out.extend_from_slice(&self.tensor.to_le_bytes());
        out.extend_from_slice(&self.layer.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.count.to_le_bytes());
        out.extend_from_slice(&self.index.to_le_bytes());
        out.extend_from_slice(&self.prio.to_le_bytes());
        out.extend_from_slice(&self.sender.to_le_bytes());
        out.extend_from_slice(&self.owner.to_le_bytes());
    }
}

/// Appends the encoding of a packet with `header` (whose `count` must be `values.len()`)
/// and body `values` to `out`.
///
/// # Panics
/// If `header.count != values.len()` (a bug in the caller).
pub fn encode(header: &PacketHeader, values: &[f32], out: &mut Vec<u8>) {
    assert_eq!(header.count as usize, values.len(), "packet count");
    out.reserve(PACKET_HEADER_LEN + 4 * values.len());
    header.write(out);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Encoded length of a packet of `count` values.
pub fn encoded_len(count: usize) -> usize {
    PACKET_HEADER_LEN + 4 * count
}

/// Decodes a packet: its header and its body (`count` little-endian f32, see
/// [`body_values`]). Never panics.
pub fn decode(b: &[u8]) -> Result<(PacketHeader, &[u8]), PacketError> {
    if b.len() < PACKET_HEADER_LEN {
        return Err(PacketError::Short { len: b.len() });
    }
    let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let mut r = [0u8; 8];
    r.copy_from_slice(&b[0..8]);
    let h = PacketHeader {
        round: u64::from_le_bytes(r),
        tensor: u32_at(8),
        layer: u32_at(12),
        offset: u32_at(16),
        count: u32_at(20),
        index: u32_at(24),
        prio: f32::from_bits(u32_at(28)),
        sender: u16_at(32),
        owner: u16_at(34),
    };
    let body = &b[PACKET_HEADER_LEN..];
    if !body.len().is_multiple_of(4) || (body.len() / 4) as u64 != u64::from(h.count) {
        return Err(PacketError::BodyLength {
            count: h.count,
            body: body.len(),
        });
    }
    if !h.prio.is_finite() {
        return Err(PacketError::Priority);
    }
    Ok((h, body))
}

/// The values of a decoded body.
pub fn body_values(body: &[u8]) -> impl Iterator<Item = f32> + '_ {
    body.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// One tensor of the flat buffer a DLCP all-reduce exchanges: its element range and its
/// layer (0 = the layer nearest the input, which the next forward pass needs first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DlcpTensor {
    /// Elements of the flat buffer.
    pub range: Range<usize>,
    /// Layer position (0 = input side).
    pub layer: u32,
}

impl DlcpTensor {
    /// Tensors for a flat buffer whose consecutive layers end at `ends` (layer `i` is
    /// `ends[i-1]..ends[i]`, starting at 0), numbered from `first_layer` — the shape a
    /// trainer's bucket has.
    ///
    /// ```
    /// use dtrain_comms::dlcp::DlcpTensor;
    /// let t = DlcpTensor::from_ends(&[3, 10], 4);
    /// assert_eq!(t[1], DlcpTensor { range: 3..10, layer: 5 });
    /// ```
    pub fn from_ends(ends: &[usize], first_layer: u32) -> Vec<DlcpTensor> {
        let mut start = 0;
        ends.iter()
            .enumerate()
            .map(|(i, &end)| {
                let t = DlcpTensor {
                    range: start..end,
                    layer: first_layer.saturating_add(i as u32),
                };
                start = end;
                t
            })
            .collect()
    }
}

impl DlcpTensor {
    /// Tensors for the given consecutive ranges (a bucket's layer boundaries, as the
    /// `segments: &[Range<usize>]` of ALGORITHMS.md §0.2), numbered from `first_layer`.
    ///
    /// ```
    /// use dtrain_comms::dlcp::DlcpTensor;
    /// let t = DlcpTensor::from_segments(&[0..3, 3..10], 2);
    /// assert_eq!(t, DlcpTensor::from_ends(&[3, 10], 2));
    /// ```
    pub fn from_segments(segments: &[Range<usize>], first_layer: u32) -> Vec<DlcpTensor> {
        segments
            .iter()
            .enumerate()
            .map(|(i, r)| DlcpTensor {
                range: r.clone(),
                layer: first_layer.saturating_add(i as u32),
            })
            .collect()
    }
}

/// Checks that `tensors` tile `0..n` in order (each starts where the previous ended, the
/// first at 0, the last ends at `n`), with at most `u32::MAX` tensors and elements each.
pub fn check_tensors(n: usize, tensors: &[DlcpTensor]) -> Result<(), String> {
    if u32::try_from(tensors.len()).is_err() {
        return Err(format!("{} tensors (at most u32::MAX)", tensors.len()));
    }
    let mut next = 0;
    for (i, t) in tensors.iter().enumerate() {
        if t.range.start != next || t.range.end < t.range.start {
            return Err(format!(
                "tensor {i} is {:?}; tensors must tile the buffer in order (expected start {next})",
                t.range
            ));
        }
        if u32::try_from(t.range.len()).is_err() {
            return Err(format!("tensor {i} has more than u32::MAX elements"));
        }
        next = t.range.end;
    }
    if next != n {
        return Err(format!(
            "tensors cover 0..{next}, the buffer has {n} elements"
        ));
    }
    Ok(())
}

/// One packet of a [`Layout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Index of the tensor in the call's list.
    pub tensor: u32,
    /// The tensor's layer.
    pub layer: u32,
    /// First element relative to the tensor's start.
    pub offset: u32,
    /// First element in the flat buffer.
    pub start: usize,
    /// Number of elements.
    pub count: u32,
}

impl Slot {
    /// The slot's range in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.count as usize
    }
}

/// The packet plan of one segment of the flat buffer: each tensor's part of the segment is
/// cut into packets of at most `mtu_elems` elements, in buffer order. Every rank computes
/// the same plan, so a packet is named by its slot index alone, and a receiver checks each
/// packet against its slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    range: Range<usize>,
    slots: Vec<Slot>,
    /// Per slot: index of its tensor among the tensors this segment touches.
    local_tensor: Vec<u32>,
    /// Per touched tensor: its slot count.
    tensor_slots: Vec<usize>,
}

impl Layout {
    /// The plan of `range` (within the tensors, which must pass [`check_tensors`]) for
    /// packets of at most `mtu_elems` elements (0 is taken as 1).
    pub fn new(tensors: &[DlcpTensor], range: Range<usize>, mtu_elems: usize) -> Self {
        let mtu = mtu_elems.max(1);
        let mut slots = Vec::new();
        let mut local_tensor = Vec::new();
        let mut tensor_slots = Vec::new();
        let first = tensors.partition_point(|t| t.range.end <= range.start);
        for (ti, t) in tensors.iter().enumerate().skip(first) {
            if t.range.start >= range.end {
                break;
            }
            let lo = t.range.start.max(range.start);
            let hi = t.range.end.min(range.end);
            if lo >= hi {
                continue;
            }
            let local = tensor_slots.len() as u32;
            let mut s = lo;
            let mut count = 0;
            while s < hi {
                let e = (s + mtu).min(hi);
                slots.push(Slot {
                    tensor: ti as u32,
                    layer: t.layer,
                    offset: (s - t.range.start) as u32,
                    start: s,
                    count: (e - s) as u32,
                });
                local_tensor.push(local);
                count += 1;
                s = e;
            }
            tensor_slots.push(count);
        }
        Layout {
            range,
            slots,
            local_tensor,
            tensor_slots,
        }
    }

    /// The segment planned.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The packets.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Number of packets.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the segment has no packets (it is empty).
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Number of tensors the segment touches.
    pub fn tensors(&self) -> usize {
        self.tensor_slots.len()
    }

    /// Slot `k`'s tensor, numbered among the tensors this segment touches.
    pub fn local_tensor(&self, k: usize) -> usize {
        self.local_tensor[k] as usize
    }

    /// Packets of the `t`-th tensor this segment touches.
    pub fn tensor_slots(&self, t: usize) -> usize {
        self.tensor_slots[t]
    }

    /// Checks a decoded header against slot `h.index`; returns the slot index.
    pub fn check(&self, h: &PacketHeader) -> Result<usize, PacketError> {
        let k = h.index as usize;
        let s = self.slots.get(k).ok_or_else(|| {
            PacketError::Plan(format!(
                "packet index {k} out of range ({} packets in segment {:?})",
                self.slots.len(),
                self.range
            ))
        })?;
        if (h.tensor, h.layer, h.offset, h.count) != (s.tensor, s.layer, s.offset, s.count) {
            return Err(PacketError::Plan(format!(
                "packet {k} claims tensor {} layer {} offset {} count {}, the plan has \
                 tensor {} layer {} offset {} count {}",
                h.tensor, h.layer, h.offset, h.count, s.tensor, s.layer, s.offset, s.count
            )));
        }
        Ok(k)
    }
}

/// What [`Reassembler::insert`] did with a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    /// A new packet: its values are placed.
    New(usize),
    /// A packet already received (a retransmission, or a delayed copy): ignored.
    Duplicate(usize),
    /// A packet of an earlier round: ignored.
    Stale,
}

/// Rebuilds one sender's contribution to one segment from its packets, in any order:
/// values land at their slot's place, so any permutation of the packets gives bit-identical
/// values; slots never received stay `0.0`; duplicates and packets of earlier rounds are
/// ignored; anything else that does not match the plan is an error.
#[derive(Debug, Clone)]
pub struct Reassembler {
    round: u64,
    sender: u16,
    owner: u16,
    layout: Arc<Layout>,
    values: Vec<f32>,
    arrived: Vec<bool>,
    count: usize,
}

impl Reassembler {
    /// A receiver of `sender`'s packets for `owner`'s segment planned by `layout`, at `round`.
    pub fn new(round: u64, sender: u16, owner: u16, layout: Arc<Layout>) -> Self {
        let len = layout.range().len();
        let k = layout.len();
        Reassembler {
            round,
            sender,
            owner,
            layout,
            values: vec![0.0; len],
            arrived: vec![false; k],
            count: 0,
        }
    }

    /// Decodes `bytes` and places the packet.
    pub fn insert(&mut self, bytes: &[u8]) -> Result<Inserted, PacketError> {
        let (h, body) = decode(bytes)?;
        self.insert_decoded(&h, body)
    }

    /// Places a decoded packet (see [`decode`]).
    pub fn insert_decoded(
        &mut self,
        h: &PacketHeader,
        body: &[u8],
    ) -> Result<Inserted, PacketError> {
        if h.round < self.round {
            return Ok(Inserted::Stale);
        }
        if h.round > self.round {
            return Err(PacketError::FutureRound {
                got: h.round,
                expected: self.round,
            });
        }
        if h.sender != self.sender || h.owner != self.owner {
            return Err(PacketError::Plan(format!(
                "packet from sender {} for owner {}, expected sender {} for owner {}",
                h.sender, h.owner, self.sender, self.owner
            )));
        }
        let k = self.layout.check(h)?;
        if self.arrived[k] {
            return Ok(Inserted::Duplicate(k));
        }
        let s = self.layout.slots()[k];
        let base = s.start - self.layout.range().start;
        for (dst, v) in self.values[base..base + s.count as usize]
            .iter_mut()
            .zip(body_values(body))
        {
            *dst = v;
        }
        self.arrived[k] = true;
        self.count += 1;
        Ok(Inserted::New(k))
    }

    /// The reassembled values of the segment (missing packets as `0.0`).
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// Whether slot `k` arrived.
    pub fn arrived(&self, k: usize) -> bool {
        self.arrived[k]
    }

    /// Number of distinct packets received.
    pub fn received(&self) -> usize {
        self.count
    }

    /// Whether every packet arrived.
    pub fn is_complete(&self) -> bool {
        self.count == self.arrived.len()
    }

    /// The slots not received yet, in order.
    pub fn missing(&self) -> impl Iterator<Item = usize> + '_ {
        self.arrived
            .iter()
            .enumerate()
            .filter(|(_, &a)| !a)
            .map(|(k, _)| k)
    }
}

/// Encodes every packet of `data`'s part of a segment (the values at each slot's flat
/// range) as `sender`'s contribution to `owner`, with priority `prio(slot, values)`.
pub fn packetize(
    round: u64,
    sender: u16,
    owner: u16,
    layout: &Layout,
    data: &[f32],
    mut prio: impl FnMut(&Slot, &[f32]) -> f32,
) -> Vec<Vec<u8>> {
    layout
        .slots()
        .iter()
        .enumerate()
        .map(|(k, s)| {
            let vals = &data[s.range()];
            let h = header_for(round, sender, owner, k, s, prio(s, vals));
            let mut out = Vec::with_capacity(encoded_len(vals.len()));
            encode(&h, vals, &mut out);
            out
        })
        .collect()
}

/// The header of slot `k`.
pub(crate) fn header_for(
    round: u64,
    sender: u16,
    owner: u16,
    k: usize,
    s: &Slot,
    prio: f32,
) -> PacketHeader {
    PacketHeader {
        round,
        tensor: s.tensor,
        layer: s.layer,
        offset: s.offset,
        count: s.count,
        index: k as u32,
        prio,
        sender,
        owner,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tensors() -> Vec<DlcpTensor> {
        DlcpTensor::from_ends(&[5, 5, 23, 40], 0)
    }

    #[test]
    fn layout_cuts_tensors_and_segments() {
        let t = tensors();
        check_tensors(40, &t).unwrap();
        let l = Layout::new(&t, 3..30, 4);
        let got: Vec<_> = l.slots().iter().map(|s| (s.tensor, s.range())).collect();
        assert_eq!(
            got,
            vec![
                (0, 3..5),
                (2, 5..9),
                (2, 9..13),
                (2, 13..17),
                (2, 17..21),
                (2, 21..23),
                (3, 23..27),
                (3, 27..30)
            ]
        );
        assert_eq!(l.tensors(), 3);
        assert_eq!(
            (l.tensor_slots(0), l.tensor_slots(1), l.tensor_slots(2)),
            (1, 5, 2)
        );
        assert_eq!(l.slots()[6].offset, 0);
        assert_eq!(l.slots()[7].offset, 4);
        assert!(Layout::new(&t, 7..7, 4).is_empty());
    }

    #[test]
    fn check_tensors_rejects_gaps_and_short_cover() {
        assert!(check_tensors(10, &DlcpTensor::from_ends(&[4, 10], 0)).is_ok());
        let gap = vec![
            DlcpTensor {
                range: 0..4,
                layer: 0,
            },
            DlcpTensor {
                range: 5..10,
                layer: 1,
            },
        ];
        assert!(check_tensors(10, &gap).is_err());
        assert!(check_tensors(11, &DlcpTensor::from_ends(&[4, 10], 0)).is_err());
    }

    #[test]
    fn reassembler_rejects_what_does_not_match_the_plan() {
        let t = tensors();
        let l = Arc::new(Layout::new(&t, 0..40, 8));
        let data: Vec<f32> = (0..40).map(|i| i as f32).collect();
        let pk = packetize(7, 1, 0, &l, &data, |_, _| 1.0);
        let mut r = Reassembler::new(7, 1, 0, l.clone());
        // Wrong sender.
        let mut wrong = Reassembler::new(7, 2, 0, l.clone());
        assert!(matches!(wrong.insert(&pk[0]), Err(PacketError::Plan(_))));
        // Future and stale rounds.
        let mut later = Reassembler::new(6, 1, 0, l.clone());
        assert!(matches!(
            later.insert(&pk[0]),
            Err(PacketError::FutureRound { .. })
        ));
        let mut earlier = Reassembler::new(8, 1, 0, l.clone());
        assert_eq!(earlier.insert(&pk[0]), Ok(Inserted::Stale));
        // Out-of-range index and wrong offset.
        let (mut h, body) = decode(&pk[1]).unwrap();
        let vals: Vec<f32> = body_values(body).collect();
        h.index = 1000;
        let mut b = Vec::new();
        encode(&h, &vals, &mut b);
        assert!(matches!(r.insert(&b), Err(PacketError::Plan(_))));
        h.index = 1;
        h.offset += 1;
        b.clear();
        encode(&h, &vals, &mut b);
        assert!(matches!(r.insert(&b), Err(PacketError::Plan(_))));
        // Truncated body.
        assert!(matches!(
            r.insert(&pk[1][..pk[1].len() - 2]),
            Err(PacketError::BodyLength { .. })
        ));
        // Duplicates are ignored; nothing above was placed.
        assert_eq!(r.received(), 0);
        assert_eq!(r.insert(&pk[1]), Ok(Inserted::New(1)));
        assert_eq!(r.insert(&pk[1]), Ok(Inserted::Duplicate(1)));
        assert_eq!(r.received(), 1);
    }

    #[test]
    fn non_finite_priority_is_rejected() {
        let h = PacketHeader {
            round: 0,
            tensor: 0,
            layer: 0,
            offset: 0,
            count: 0,
            index: 0,
            prio: f32::NAN,
            sender: 0,
            owner: 0,
        };
        let mut b = Vec::new();
        encode(&h, &[], &mut b);
        assert_eq!(decode(&b), Err(PacketError::Priority));
    }

    fn arb_header() -> impl Strategy<Value = (PacketHeader, Vec<f32>)> {
        (
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            -1e30f32..1e30,
            any::<u16>(),
            any::<u16>(),
            prop::collection::vec(any::<u32>(), 0..40),
        )
            .prop_map(
                |(round, tensor, layer, offset, index, prio, sender, owner, bits)| {
                    let vals: Vec<f32> = bits.into_iter().map(f32::from_bits).collect();
                    let h = PacketHeader {
                        round,
                        tensor,
                        layer,
                        offset,
                        count: vals.len() as u32,
                        index,
                        prio,
                        sender,
                        owner,
                    };
                    (h, vals)
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn decode_never_panics_on_arbitrary_bytes(b in prop::collection::vec(any::<u8>(), 0..200)) {
            if let Ok((h, body)) = decode(&b) {
                prop_assert_eq!(body.len(), 4 * h.count as usize);
                prop_assert!(h.prio.is_finite());
            }
            let l = Arc::new(Layout::new(&tensors(), 0..40, 8));
            let mut r = Reassembler::new(3, 1, 0, l);
            let _ = r.insert(&b);
        }

        #[test]
        fn encode_decode_round_trip((h, vals) in arb_header()) {
            let mut b = Vec::new();
            encode(&h, &vals, &mut b);
            prop_assert_eq!(b.len(), encoded_len(vals.len()));
            let (h2, body) = decode(&b).unwrap();
            prop_assert_eq!(h2, h);
            let back: Vec<u32> = body_values(body).map(f32::to_bits).collect();
            let orig: Vec<u32> = vals.iter().map(|v| v.to_bits()).collect();
            prop_assert_eq!(back, orig);
        }

        /// Any permutation of a segment's packets, with duplicates, rebuilds bit-identical
        /// values; and any subset rebuilds the original with the missing packets zeroed.
        #[test]
        fn any_permutation_reassembles_bit_identically(
            bits in prop::collection::vec(any::<u32>(), 40),
            mtu in 1usize..12,
            perm_seed in any::<u64>(),
            keep in prop::collection::vec(any::<bool>(), 40),
        ) {
            let data: Vec<f32> = bits.into_iter().map(f32::from_bits).collect();
            let l = Arc::new(Layout::new(&tensors(), 0..40, mtu));
            let pk = packetize(9, 2, 1, &l, &data, |_, _| 0.0);
            // Fisher–Yates with a SplitMix64 stream.
            let mut order: Vec<usize> = (0..pk.len()).collect();
            let mut s = perm_seed;
            for i in (1..order.len()).rev() {
                let j = (super::super::splitmix(&mut s) % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
            let mut r = Reassembler::new(9, 2, 1, l.clone());
            for &k in &order {
                r.insert(&pk[k]).unwrap();
                r.insert(&pk[order[0]]).unwrap();
            }
            prop_assert!(r.is_complete());
            let got: Vec<u32> = r.values().iter().map(|v| v.to_bits()).collect();
            let want: Vec<u32> = data.iter().map(|v| v.to_bits()).collect();
            prop_assert_eq!(got, want);

            // A subset: the kept packets' values, zeros elsewhere.
            let mut sub = Reassembler::new(9, 2, 1, l.clone());
            for &k in order.iter().rev() {
                if keep[k] {
                    sub.insert(&pk[k]).unwrap();
                }
            }
            let mut want = [0.0f32; 40];
            for (k, s) in l.slots().iter().enumerate() {
                if keep[k] {
                    want[s.range()].copy_from_slice(&data[s.range()]);
                }
            }
            let got: Vec<u32> = sub.values().iter().map(|v| v.to_bits()).collect();
            let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
            prop_assert_eq!(got, want);
            prop_assert_eq!(sub.missing().count(), keep[..pk.len()].iter().filter(|&&k| !k).count());
        }
    }
}
