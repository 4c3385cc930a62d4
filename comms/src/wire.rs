//! The collective message: a fixed 36-byte little-endian header followed by a payload.
//!
//! Every message a collective state machine emits carries the collective's sequence number,
//! its kind and algorithm, and the operation's size parameters, so a rank that receives a
//! message from a different collective (another kind, another length, another root) can
//! name the peer instead of silently mixing data.
//!
//! ```text
//! offset  size  field
//!      0     1  version (= WIRE_VERSION)
//!      1     1  kind    (Kind)
//!      2     1  algo    (Algo)
//!      3     1  phase   (algorithm-specific sub-phase)
//!      4     4  step    (u32, algorithm-specific step)
//!      8     8  seq     (u64, collective sequence number of the sender)
//!     16     8  count   (u64, element count / total byte length)
//!     24     8  offset  (u64, element or byte offset of the payload)
//!     32     4  root    (u32, broadcast root / all-gather block owner)
//!     36     …  payload
//! ```

use thiserror::Error;

/// Length of the encoded [`Header`] in bytes.
pub const HEADER_LEN: usize = 36;
/// Version byte written into every header; other versions are rejected.
pub const WIRE_VERSION: u8 = 1;

/// Errors decoding a message. Decoding never panics and never allocates from a length field.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum WireError {
    /// Fewer bytes than a header.
    #[error("message of {len} bytes is shorter than the {HEADER_LEN}-byte header")]
    Short {
        /// Bytes received.
        len: usize,
    },
    /// Unknown version byte.
    #[error("unsupported wire version {0}")]
    Version(u8),
    /// Unknown kind byte.
    #[error("unknown collective kind {0}")]
    Kind(u8),
    /// Unknown algorithm byte.
    #[error("unknown collective algorithm {0}")]
    Algo(u8),
    /// The payload does not have the shape the header or kind requires.
    #[error("malformed payload: {0}")]
    Payload(&'static str),
}

/// Which collective a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// All-reduce with f32 sum.
    AllReduceSum = 1,
    /// All-reduce with f32 max.
    AllReduceMax = 2,
    /// All-gather of variable-size byte buffers.
    AllGather = 3,
    /// Broadcast of a byte buffer from a root.
    Broadcast = 4,
    /// Reduce-scatter with f32 sum.
    ReduceScatter = 5,
    /// Barrier.
    Barrier = 6,
    /// A rank gave up on the current collective; the payload says why (see [`AbortInfo`]).
    Abort = 7,
    /// Sparse all-reduce with f32 sum (payloads are sparse chunks, see
    /// [`crate::algo::sparse_allreduce`]).
    SparseAllReduce = 8,
    /// DLCP lossy all-reduce (packets, NACKs, reduced segments and used-bitmaps, see
    /// [`crate::dlcp`]). Late messages of an earlier DLCP round are legal and ignored.
    Dlcp = 9,
    /// Compressed all-reduce (encoded shares to each segment's owner, encoded reduced
    /// segments to every rank, see [`crate::algo::compressed_allreduce`]).
    CompressedAllReduce = 10,
    /// The group admitted a newcomer: its new epoch and members (see [`Welcome`] and
    /// [`crate::Communicator::admit`]).
    Welcome = 11,
}

impl Kind {
    fn from_u8(b: u8) -> Result<Self, WireError> {
        Ok(match b {
            1 => Kind::AllReduceSum,
            2 => Kind::AllReduceMax,
            3 => Kind::AllGather,
            4 => Kind::Broadcast,
            5 => Kind::ReduceScatter,
            6 => Kind::Barrier,
            7 => Kind::Abort,
            8 => Kind::SparseAllReduce,
            9 => Kind::Dlcp,
            10 => Kind::CompressedAllReduce,
            11 => Kind::Welcome,
            other => return Err(WireError::Kind(other)),
        })
    }
}

/// Which algorithm produced a message (ranks must agree on it, so it is checked too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Algo {
    /// No algorithm (abort messages).
    None = 0,
    /// Ring reduce-scatter / all-gather.
    Ring = 1,
    /// Recursive doubling (small all-reduce).
    RecursiveDoubling = 2,
    /// Pipelined chain from the root (broadcast).
    Chain = 3,
    /// Dissemination (barrier).
    Dissemination = 4,
    /// Direct exchange with every peer (sparse all-reduce: each rank sends every owner its
    /// share of the owner's segment, and each owner sends its reduced segment to everyone).
    Direct = 5,
    /// The host-local stages of the hierarchical all-reduce (the reduce towards each host's
    /// leader and the broadcast from it, see [`crate::algo::hierarchical`]); its leaders'
    /// stage speaks [`Algo::Ring`] or [`Algo::RecursiveDoubling`].
    Hierarchical = 6,
}

impl Algo {
    fn from_u8(b: u8) -> Result<Self, WireError> {
        Ok(match b {
            0 => Algo::None,
            1 => Algo::Ring,
            2 => Algo::RecursiveDoubling,
            3 => Algo::Chain,
            4 => Algo::Dissemination,
            5 => Algo::Direct,
            6 => Algo::Hierarchical,
            other => return Err(WireError::Algo(other)),
        })
    }
}

/// The fixed header of every collective message (layout in the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Collective kind.
    pub kind: Kind,
    /// Algorithm.
    pub algo: Algo,
    /// Algorithm-specific sub-phase.
    pub phase: u8,
    /// Algorithm-specific step.
    pub step: u32,
    /// Collective sequence number of the sender.
    pub seq: u64,
    /// Element count (reductions) or total byte length (byte collectives).
    pub count: u64,
    /// Element or byte offset of the payload.
    pub offset: u64,
    /// Broadcast root, or owner of an all-gather block.
    pub root: u32,
}

impl Header {
    /// A header with the given kind, algorithm and sequence number and all other fields 0.
    pub fn new(kind: Kind, algo: Algo, seq: u64) -> Self {
        Header {
            kind,
            algo,
            phase: 0,
            step: 0,
            seq,
            count: 0,
            offset: 0,
            root: 0,
        }
    }

    fn write(&self, out: &mut [u8]) {
        out[0] = WIRE_VERSION;
        out[1] = self.kind as u8;
        out[2] = self.algo as u8;
        out[3] = self.phase;
        out[4..8].copy_from_slice(&self.step.to_le_bytes());
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..24].copy_from_slice(&self.count.to_le_bytes());
        out[24..32].copy_from_slice(&self.offset.to_le_bytes());
        out[32..36].copy_from_slice(&self.root.to_le_bytes());
    }

    /// Decodes a header from the first [`HEADER_LEN`] bytes of `b`.
    pub fn read(b: &[u8]) -> Result<Self, WireError> {
        if b.len() < HEADER_LEN {
            return Err(WireError::Short { len: b.len() });
        }
        if b[0] != WIRE_VERSION {
            return Err(WireError::Version(b[0]));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        Ok(Header {
            kind: Kind::from_u8(b[1])?,
            algo: Algo::from_u8(b[2])?,
            phase: b[3],
            step: u32_at(4),
            seq: u64_at(8),
            count: u64_at(16),
            offset: u64_at(24),
            root: u32_at(32),
        })
    }
}

/// One encoded collective message: header plus payload in a single buffer, so that
/// transports move it without copying and forwarding rewrites only the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    header: Header,
    buf: Vec<u8>,
}

impl Message {
    /// A message with a byte payload.
    pub fn new(header: Header, payload: &[u8]) -> Self {
        Self::build(header, payload.len(), |out| out.extend_from_slice(payload))
    }

    /// A message whose payload is `vals` as little-endian f32.
    pub fn from_f32(header: Header, vals: &[f32]) -> Self {
        Self::build(header, vals.len() * 4, |out| extend_f32_le(out, vals))
    }

    /// A message whose payload of `payload_len` bytes is appended by `fill`.
    ///
    /// # Panics
    /// If `fill` appends a number of bytes other than `payload_len` (a bug in the caller).
    pub fn build(header: Header, payload_len: usize, fill: impl FnOnce(&mut Vec<u8>)) -> Self {
        let mut buf = crate::pool::take_empty(HEADER_LEN + payload_len);
        buf.resize(HEADER_LEN, 0);
        header.write(&mut buf);
        fill(&mut buf);
        assert_eq!(buf.len(), HEADER_LEN + payload_len, "payload length");
        Message { header, buf }
    }

    /// Decodes a received buffer (header validated; the payload is checked by the machine).
    pub fn decode(buf: Vec<u8>) -> Result<Self, WireError> {
        let header = Header::read(&buf)?;
        Ok(Message { header, buf })
    }

    /// The header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        &self.buf[HEADER_LEN..]
    }

    /// The payload bytes, mutable (lets a machine reduce into a received message and
    /// forward it without allocating).
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buf[HEADER_LEN..]
    }

    /// Replaces the header in place (used to forward a payload without copying it).
    pub fn with_header(mut self, header: Header) -> Self {
        header.write(&mut self.buf);
        self.header = header;
        self
    }

    /// The encoded message (header + payload).
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    /// The encoded message, consumed.
    pub fn into_bytes(mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    /// Encoded length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Always false: a message holds at least a header. Present for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// Iterates a payload as little-endian f32 values.
///
/// Returns an error if the payload length is not a multiple of 4.
pub fn f32s(payload: &[u8]) -> Result<impl Iterator<Item = f32> + '_, WireError> {
    if !payload.len().is_multiple_of(4) {
        return Err(WireError::Payload(
            "f32 payload length is not a multiple of 4",
        ));
    }
    Ok(payload
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
}

/// A dropped message gives its buffer back to the crate's buffer pool, so that the
/// next chunk-sized message reuses it instead of page-faulting in a fresh one.
impl Drop for Message {
    fn drop(&mut self) {
        crate::pool::put(std::mem::take(&mut self.buf));
    }
}

/// Appends `vals` to `out` as little-endian f32 (one `memcpy` on little-endian targets).
pub(crate) fn extend_f32_le(out: &mut Vec<u8>, vals: &[f32]) {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: `f32` has no padding and every byte of it is initialised, `u8` has
        // alignment 1, and the byte slice covers exactly the `vals.len() * 4` bytes of
        // `vals`, borrowed immutably for the duration of the copy. On a little-endian target
        // the in-memory bytes of an `f32` are its little-endian encoding.
        let bytes =
            unsafe { std::slice::from_raw_parts(vals.as_ptr().cast::<u8>(), size_of_val(vals)) };
        out.extend_from_slice(bytes);
    }
    #[cfg(not(target_endian = "little"))]
    out.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
}

/// Overwrites `dst` with the little-endian f32 values of `payload` (a `memcpy` on
/// little-endian targets).
///
/// # Panics
/// If `payload.len() != 4 * dst.len()` (callers check the length first).
pub(crate) fn copy_f32_le(dst: &mut [f32], payload: &[u8]) {
    assert_eq!(payload.len(), size_of_val(dst), "payload length");
    #[cfg(target_endian = "little")]
    {
        // SAFETY: as in `extend_f32_le`; in addition every bit pattern is a valid `f32`,
        // so writing arbitrary bytes through the byte view cannot create an invalid value,
        // and `dst` is borrowed mutably (exclusively) for the duration of the copy.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), size_of_val(dst))
        };
        bytes.copy_from_slice(payload);
    }
    #[cfg(not(target_endian = "little"))]
    for (d, c) in dst.iter_mut().zip(payload.chunks_exact(4)) {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// Whether `x` holds a NaN or an infinity: a branch-free OR over the exponent bits, which
/// vectorises.
pub(crate) fn has_non_finite(x: &[f32]) -> bool {
    const EXP: u32 = 0x7F80_0000;
    let mut bad = false;
    for v in x {
        bad |= (v.to_bits() & EXP) == EXP;
    }
    bad
}

/// Multiplies every element of `x` by `k` and returns whether the result holds a NaN or an
/// infinity, checking each block while it is still in L1: one pass over memory.
pub(crate) fn scale_non_finite(x: &mut [f32], k: f32) -> bool {
    let mut bad = false;
    for block in x.chunks_mut(1024) {
        block.iter_mut().for_each(|v| *v *= k);
        bad |= has_non_finite(block);
    }
    bad
}

/// [`copy_f32_le`], then whether the copied values hold a NaN or an infinity, checked
/// block by block while each block is still in L1 (no pass of its own over memory).
///
/// # Panics
/// If `payload.len() != 4 * dst.len()`.
pub(crate) fn copy_f32_le_non_finite(dst: &mut [f32], payload: &[u8]) -> bool {
    assert_eq!(payload.len(), size_of_val(dst), "payload length");
    let mut bad = false;
    for (d, p) in dst.chunks_mut(1024).zip(payload.chunks(4096)) {
        copy_f32_le(d, p);
        bad |= has_non_finite(d);
    }
    bad
}

/// `payload[i] = f(payload[i], own[i])` over little-endian f32 values, in place: the
/// received operand comes first, as the summation order requires. Written as a plain
/// loop over fixed-size chunks so that it vectorises.
///
/// # Panics
/// If `payload.len() != 4 * own.len()` (callers check the length first).
pub(crate) fn combine_f32_le(payload: &mut [u8], own: &[f32], f: impl Fn(f32, f32) -> f32) {
    assert_eq!(payload.len(), size_of_val(own), "payload length");
    for (d, x) in payload.chunks_exact_mut(4).zip(own) {
        let v = f32::from_le_bytes([d[0], d[1], d[2], d[3]]);
        d.copy_from_slice(&f(v, *x).to_le_bytes());
    }
}

/// Why a rank aborted a collective: the payload of a [`Kind::Abort`] message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbortInfo {
    /// The reason.
    pub reason: AbortReason,
    /// The rank the aborting rank blames ([`AbortInfo::NO_CULPRIT`] if it cannot tell).
    pub culprit: u32,
    /// Human-readable detail (at most [`AbortInfo::MAX_DETAIL`] bytes on the wire).
    pub detail: String,
}

/// Why a rank gave up: the reason code (one byte on the wire) of an [`AbortInfo`] and of a
/// parameter-server abort ([`crate::ps::PsMsg::Abort`]). Both protocols use the same codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum AbortReason {
    /// The culprit's connection closed.
    PeerLost = 1,
    /// The culprit ran a different collective (parameter server: pushed another reduction
    /// or another number of steps).
    Mismatch = 2,
    /// The aborting rank timed out waiting (for the culprit).
    Timeout = 3,
    /// The culprit sent a malformed or unexpected message.
    Protocol = 4,
    /// The receiver was dropped from the group while it was alive
    /// ([`crate::Communicator::regroup`]); the culprit field is unused.
    Excluded = 5,
}

impl AbortReason {
    /// The reason of wire code `code`; `None` for an unknown code.
    pub fn from_code(code: u8) -> Option<AbortReason> {
        Some(match code {
            1 => AbortReason::PeerLost,
            2 => AbortReason::Mismatch,
            3 => AbortReason::Timeout,
            4 => AbortReason::Protocol,
            5 => AbortReason::Excluded,
            _ => return None,
        })
    }
}

impl AbortInfo {
    /// The culprit of an abort whose sender blames no particular rank (a timeout while
    /// every awaited peer had already sent part of the collective).
    pub const NO_CULPRIT: u32 = u32::MAX;

    /// Longest detail string carried on the wire (longer ones are truncated).
    pub const MAX_DETAIL: usize = 512;

    /// Encodes as an abort message with sequence number `seq`.
    pub fn to_message(&self, seq: u64) -> Message {
        let mut d = self.detail.as_bytes();
        if d.len() > Self::MAX_DETAIL {
            let mut cut = Self::MAX_DETAIL;
            while !self.detail.is_char_boundary(cut) {
                cut -= 1;
            }
            d = &d[..cut];
        }
        let mut payload = Vec::with_capacity(5 + d.len());
        payload.push(self.reason as u8);
        payload.extend_from_slice(&self.culprit.to_le_bytes());
        payload.extend_from_slice(d);
        Message::new(Header::new(Kind::Abort, Algo::None, seq), &payload)
    }

    /// Decodes the payload of an abort message.
    pub fn from_payload(p: &[u8]) -> Result<Self, WireError> {
        if p.len() < 5 || p.len() > 5 + Self::MAX_DETAIL {
            return Err(WireError::Payload("abort payload length"));
        }
        let reason = AbortReason::from_code(p[0]).ok_or(WireError::Payload("abort reason"))?;
        Ok(AbortInfo {
            reason,
            culprit: u32::from_le_bytes([p[1], p[2], p[3], p[4]]),
            detail: String::from_utf8_lossy(&p[5..]).into_owned(),
        })
    }
}

/// What a group tells the newcomer it admitted: the payload of a [`Kind::Welcome`]
/// message (`epoch u64 | joined u32 | count u32 | count × member u32`, little-endian).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    /// The membership epoch the newcomer enters.
    pub epoch: u64,
    /// How many of the members, at the end, are the newcomers admitted with it (itself
    /// included); at most the member count.
    pub joined: u32,
    /// The members' transport ranks, in group order (distinct).
    pub members: Vec<u32>,
}

impl Welcome {
    /// Most members a welcome may name.
    pub const MAX_MEMBERS: usize = 1 << 20;

    /// Encodes as a welcome message with sequence number `seq`.
    pub fn to_message(&self, seq: u64) -> Message {
        let mut payload = Vec::with_capacity(16 + 4 * self.members.len());
        payload.extend_from_slice(&self.epoch.to_le_bytes());
        payload.extend_from_slice(&self.joined.to_le_bytes());
        payload.extend_from_slice(&(self.members.len() as u32).to_le_bytes());
        for m in &self.members {
            payload.extend_from_slice(&m.to_le_bytes());
        }
        Message::new(Header::new(Kind::Welcome, Algo::None, seq), &payload)
    }

    /// Decodes the payload of a welcome message: its length must match its count, which
    /// is at most [`Welcome::MAX_MEMBERS`], no member may repeat, and the newcomers are
    /// at most the members.
    pub fn from_payload(p: &[u8]) -> Result<Self, WireError> {
        if p.len() < 16 {
            return Err(WireError::Payload("welcome payload length"));
        }
        let epoch = u64::from_le_bytes(p[..8].try_into().expect("8 bytes"));
        let joined = u32::from_le_bytes(p[8..12].try_into().expect("4 bytes"));
        let n = u32::from_le_bytes(p[12..16].try_into().expect("4 bytes")) as usize;
        if n > Self::MAX_MEMBERS || p.len() != 16 + 4 * n {
            return Err(WireError::Payload("welcome member count"));
        }
        if joined as usize > n {
            return Err(WireError::Payload("welcome joined count"));
        }
        let members: Vec<u32> = p[16..]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let distinct: std::collections::BTreeSet<u32> = members.iter().copied().collect();
        if distinct.len() != members.len() {
            return Err(WireError::Payload("welcome names a member twice"));
        }
        Ok(Welcome {
            epoch,
            joined,
            members,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any bytes decode to a welcome or to an error, never a panic; what decodes
        /// encodes back to the same bytes.
        #[test]
        fn welcome_decoding_takes_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(w) = Welcome::from_payload(&bytes) {
                let m = w.to_message(0);
                prop_assert_eq!(m.payload(), &bytes[..]);
            }
        }

        #[test]
        fn welcome_round_trips(epoch in any::<u64>(), members in proptest::collection::btree_set(any::<u32>(), 0..20), joined in any::<u32>()) {
            let members: Vec<u32> = members.into_iter().collect();
            let joined = joined % (members.len() as u32 + 1);
            let w = Welcome { epoch, joined, members };
            prop_assert_eq!(Welcome::from_payload(w.to_message(3).payload()).unwrap(), w);
        }
    }

    #[test]
    fn header_round_trips_and_forwarding_keeps_payload() {
        let h = Header {
            kind: Kind::AllGather,
            algo: Algo::Ring,
            phase: 1,
            step: 7,
            seq: u64::MAX - 3,
            count: 1 << 40,
            offset: 12345,
            root: 9,
        };
        let m = Message::new(h, b"abc");
        assert_eq!(m.len(), HEADER_LEN + 3);
        let d = Message::decode(m.clone().into_bytes()).unwrap();
        assert_eq!(d, m);
        let h2 = Header { step: 8, ..h };
        let f = d.with_header(h2);
        assert_eq!(Message::decode(f.into_bytes()).unwrap().header().step, 8);
    }

    #[test]
    fn decode_rejects_hostile_bytes_without_panicking() {
        assert_eq!(
            Message::decode(vec![1; 10]).unwrap_err(),
            WireError::Short { len: 10 }
        );
        let mut b =
            Message::new(Header::new(Kind::Barrier, Algo::Dissemination, 0), &[]).into_bytes();
        b[0] = 99;
        assert_eq!(
            Message::decode(b.clone()).unwrap_err(),
            WireError::Version(99)
        );
        b[0] = WIRE_VERSION;
        b[1] = 0;
        assert_eq!(Message::decode(b.clone()).unwrap_err(), WireError::Kind(0));
        b[1] = 1;
        b[2] = 200;
        assert_eq!(Message::decode(b).unwrap_err(), WireError::Algo(200));
        assert!(f32s(&[0u8; 5]).is_err());
        assert!(AbortInfo::from_payload(&[9, 0, 0, 0, 0]).is_err());
        assert!(AbortInfo::from_payload(&[1, 0]).is_err());
        assert!(Welcome::from_payload(&[0; 15]).is_err());
        let mut twice = vec![0u8; 16];
        twice[12] = 2;
        twice.extend([7, 0, 0, 0, 7, 0, 0, 0]);
        assert!(Welcome::from_payload(&twice).is_err());
        twice[20] = 8;
        assert!(Welcome::from_payload(&twice).is_ok());
        twice[8] = 3;
        assert!(Welcome::from_payload(&twice).is_err());
    }

    /// The reason codes are wire bytes shared by the collectives and the parameter server:
    /// they never change.
    #[test]
    fn abort_reason_codes_are_fixed() {
        let codes = [
            (AbortReason::PeerLost, 1u8),
            (AbortReason::Mismatch, 2),
            (AbortReason::Timeout, 3),
            (AbortReason::Protocol, 4),
            (AbortReason::Excluded, 5),
        ];
        for (r, c) in codes {
            assert_eq!(r as u8, c);
            assert_eq!(AbortReason::from_code(c), Some(r));
        }
        assert_eq!(AbortReason::from_code(0), None);
        assert_eq!(AbortReason::from_code(6), None);
    }

    #[test]
    fn abort_round_trips_and_truncates_detail() {
        let a = AbortInfo {
            reason: AbortReason::Mismatch,
            culprit: 3,
            detail: "é".repeat(400),
        };
        let m = a.to_message(5);
        let b = AbortInfo::from_payload(m.payload()).unwrap();
        assert_eq!(b.reason, AbortReason::Mismatch);
        assert_eq!(b.culprit, 3);
        assert_eq!(b.detail.len(), AbortInfo::MAX_DETAIL);
    }
}
