//! The parameter-server wire format: [`PsMsg`] and its 16-byte header, the
//! [`Reduction`] code a push carries, and the little-endian f32 payloads of [`DenseF32`].
//!
//! [`DenseF32`]: super::DenseF32

/// First byte of every parameter-server message (collective messages start with
/// [`crate::wire::WIRE_VERSION`], so the two are never confused).
pub const PS_MAGIC: u8 = 0xD5;
/// Length of the parameter-server message header.
pub const PS_HEADER_LEN: usize = 16;

use crate::wire::AbortReason;

/// Which reduction a server applies to the pushes of one step and shard (one byte on the
/// wire). Codes below 16 are reserved for dtrain; [`DenseF32`] implements
/// [`Reduction::SUM`] and [`Reduction::MEAN`]. All workers must push the same reduction
/// for a step and shard.
///
/// [`DenseF32`]: super::DenseF32
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Reduction(pub u8);

impl Reduction {
    /// Element-wise f32 sum, in worker order.
    pub const SUM: Reduction = Reduction(0);
    /// Element-wise f32 sum in worker order, then divided by the number of workers.
    pub const MEAN: Reduction = Reduction(1);
}

/// A parameter-server message (wire layout: magic, type, reduction or reason, 0,
/// shard u32, step u64, payload; little-endian).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PsMsg {
    /// Worker → server: the worker's payload of `step` for `shard`.
    Push {
        /// Shard index.
        shard: u32,
        /// Step.
        step: u64,
        /// Reduction to apply.
        aggregation: Reduction,
        /// Opaque payload.
        payload: Vec<u8>,
    },
    /// Server → worker: the aggregate of `step` for `shard`.
    Aggregate {
        /// Shard index.
        shard: u32,
        /// Step.
        step: u64,
        /// The aggregator's output.
        payload: Vec<u8>,
    },
    /// Worker → server: the worker is done after `steps` steps.
    Leave {
        /// Steps the worker pushed.
        steps: u64,
    },
    /// Any → any: the sender gave up; the run fails with this error everywhere.
    Abort {
        /// Why (the collectives' reason codes, [`crate::wire::AbortInfo`]).
        reason: AbortReason,
        /// The ranks blamed.
        culprits: Vec<u32>,
        /// Human-readable detail (at most 512 bytes on the wire).
        detail: String,
    },
}

const T_PUSH: u8 = 1;
const T_AGGREGATE: u8 = 2;
const T_LEAVE: u8 = 3;
const T_ABORT: u8 = 4;
const MAX_DETAIL: usize = 512;

impl PsMsg {
    /// Encodes the message.
    pub fn encode(&self) -> Vec<u8> {
        let (ty, b2, shard, step, payload): (u8, u8, u32, u64, &[u8]) = match self {
            PsMsg::Push {
                shard,
                step,
                aggregation,
                payload,
            } => (T_PUSH, aggregation.0, *shard, *step, payload),
            PsMsg::Aggregate {
                shard,
                step,
                payload,
            } => (T_AGGREGATE, 0, *shard, *step, payload),
            PsMsg::Leave { steps } => (T_LEAVE, 0, 0, *steps, &[]),
            PsMsg::Abort { .. } => (T_ABORT, 0, 0, 0, &[]),
        };
        let mut out = Vec::with_capacity(PS_HEADER_LEN + payload.len());
        out.extend_from_slice(&[PS_MAGIC, ty, b2, 0]);
        out.extend_from_slice(&shard.to_le_bytes());
        out.extend_from_slice(&step.to_le_bytes());
        out.extend_from_slice(payload);
        if let PsMsg::Abort {
            reason,
            culprits,
            detail,
        } = self
        {
            out[2] = *reason as u8;
            out.extend_from_slice(&(culprits.len() as u32).to_le_bytes());
            for c in culprits {
                out.extend_from_slice(&c.to_le_bytes());
            }
            let mut cut = detail.len().min(MAX_DETAIL);
            while !detail.is_char_boundary(cut) {
                cut -= 1;
            }
            out.extend_from_slice(&detail.as_bytes()[..cut]);
        }
        out
    }

    /// Decodes a message; never panics on hostile bytes.
    pub fn decode(mut b: Vec<u8>) -> Result<PsMsg, String> {
        if b.len() < PS_HEADER_LEN {
            return Err(format!("parameter-server message of {} bytes", b.len()));
        }
        if b[0] != PS_MAGIC {
            return Err(format!(
                "not a parameter-server message (first byte {})",
                b[0]
            ));
        }
        let shard = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let mut s = [0u8; 8];
        s.copy_from_slice(&b[8..16]);
        let step = u64::from_le_bytes(s);
        let (ty, b2) = (b[1], b[2]);
        let payload = b.split_off(PS_HEADER_LEN);
        Ok(match ty {
            T_PUSH => PsMsg::Push {
                shard,
                step,
                aggregation: Reduction(b2),
                payload,
            },
            T_AGGREGATE => PsMsg::Aggregate {
                shard,
                step,
                payload,
            },
            T_LEAVE => PsMsg::Leave { steps: step },
            T_ABORT => {
                let reason = AbortReason::from_code(b2)
                    .ok_or_else(|| format!("unknown abort reason {b2}"))?;
                if payload.len() < 4 {
                    return Err("short abort payload".into());
                }
                let n = u32::from_le_bytes([payload[0], payload[1], payload[2], payload[3]]);
                let n = n as usize;
                if n > (payload.len() - 4) / 4 {
                    return Err("abort culprit list longer than the message".into());
                }
                let culprits = payload[4..4 + 4 * n]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let detail = String::from_utf8_lossy(&payload[4 + 4 * n..]).into_owned();
                PsMsg::Abort {
                    reason,
                    culprits,
                    detail,
                }
            }
            t => return Err(format!("unknown parameter-server message type {t}")),
        })
    }
}

/// Encodes f32 values as the little-endian bytes [`DenseF32`] expects.
///
/// [`DenseF32`]: super::DenseF32
pub fn f32_payload(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Decodes little-endian f32 bytes (a trailing partial value is ignored).
pub fn f32_values(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_hostile_bytes_are_errors() {
        let msgs = [
            PsMsg::Push {
                shard: 3,
                step: 1 << 40,
                aggregation: Reduction(77),
                payload: vec![1, 2, 3],
            },
            PsMsg::Aggregate {
                shard: 1,
                step: 9,
                payload: vec![],
            },
            PsMsg::Leave { steps: 12 },
            PsMsg::Abort {
                reason: AbortReason::Timeout,
                culprits: vec![2, 5],
                detail: "slow".into(),
            },
        ];
        for m in msgs {
            assert_eq!(PsMsg::decode(m.encode()).unwrap(), m);
        }
        assert!(PsMsg::decode(vec![PS_MAGIC; 3]).is_err());
        assert!(PsMsg::decode(vec![1; 40]).is_err());
        let mut b = PsMsg::Leave { steps: 1 }.encode();
        b[1] = 99;
        assert!(PsMsg::decode(b).is_err());
        let mut b = PsMsg::Abort {
            reason: AbortReason::PeerLost,
            culprits: vec![1],
            detail: String::new(),
        }
        .encode();
        b[PS_HEADER_LEN] = 200; // claims 200 culprits
        assert!(PsMsg::decode(b).is_err());
    }
}
