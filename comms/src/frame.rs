//! Stream framing for byte-stream transports (TCP): length-prefixed frames with a bounded
//! size, parsed from a byte cursor that answers [`FrameError::Incomplete`] until a whole
//! frame is buffered.
//!
//! ```text
//! frame  = len: u32 LE (bytes after this field, ≥ 1, ≤ max_frame) | tag: u8 | body
//! tag 1  = Hello: magic "DTRN" | version u8 | rank u32 | world u32 | token_len u16 | token
//! tag 2  = Data:  one collective message (opaque here)
//! tag 3  = Heartbeat: empty body; sent by an idle connection to show it is alive
//! ```
//!
//! Version 2 of the hello added the heartbeat frame (a version-1 peer would reject it), so
//! peers of different versions are refused at the hello instead of failing mid-run.
//!
//! The parser never panics on hostile bytes and allocates only the body of a complete,
//! size-checked frame.

use std::io::Cursor;

use thiserror::Error;

/// Bytes of framing before the body (length + tag).
pub const FRAME_HEADER_LEN: usize = 5;
/// Longest run token a hello may carry.
pub const MAX_TOKEN_LEN: usize = 256;
/// Largest possible hello frame (used as the size limit while authenticating).
pub const MAX_HELLO_FRAME: usize = FRAME_HEADER_LEN + 4 + 1 + 4 + 4 + 2 + MAX_TOKEN_LEN;
const MAGIC: &[u8; 4] = b"DTRN";
const VERSION: u8 = 2;
const TAG_HELLO: u8 = 1;
/// Tag byte of a data frame.
pub const TAG_DATA: u8 = 2;
/// Tag byte of a heartbeat frame.
pub const TAG_HEARTBEAT: u8 = 3;
/// A complete heartbeat frame (length 1, tag [`TAG_HEARTBEAT`], no body).
pub const HEARTBEAT: [u8; FRAME_HEADER_LEN] = [1, 0, 0, 0, TAG_HEARTBEAT];

/// Errors parsing a frame.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// Not enough bytes buffered yet; `needed` is the total the frame requires if known.
    #[error("incomplete frame: {needed} bytes needed")]
    Incomplete {
        /// Bytes the frame needs in total (at least the length prefix).
        needed: usize,
    },
    /// The length prefix exceeds the limit.
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The frame is structurally invalid.
    #[error("malformed frame: {0}")]
    Malformed(&'static str),
}

/// The connection-opening frame: who is connecting, and the run's token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The sender's rank.
    pub rank: u32,
    /// The sender's world size.
    pub world: u32,
    /// The run token.
    pub token: Vec<u8>,
}

impl Hello {
    /// Encodes as a complete frame.
    ///
    /// # Panics
    /// If the token is longer than [`MAX_TOKEN_LEN`] (validated when a transport is configured).
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.token.len() <= MAX_TOKEN_LEN, "token too long");
        let body = 4 + 1 + 4 + 4 + 2 + self.token.len();
        let mut out = Vec::with_capacity(FRAME_HEADER_LEN + body);
        out.extend_from_slice(&((body + 1) as u32).to_le_bytes());
        out.push(TAG_HELLO);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&self.rank.to_le_bytes());
        out.extend_from_slice(&self.world.to_le_bytes());
        out.extend_from_slice(&(self.token.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.token);
        out
    }

    /// Whether `token` equals this hello's token (compared without early exit).
    pub fn token_matches(&self, token: &[u8]) -> bool {
        self.token.len() == token.len()
            && self
                .token
                .iter()
                .zip(token)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

/// A parsed frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Connection opening.
    Hello(Hello),
    /// A message.
    Data(Vec<u8>),
    /// A liveness signal of an otherwise idle connection (carries nothing).
    Heartbeat,
}

/// The 5-byte prefix of a data frame carrying `body_len` bytes.
pub fn data_prefix(body_len: usize) -> [u8; FRAME_HEADER_LEN] {
    let mut p = [0u8; FRAME_HEADER_LEN];
    p[..4].copy_from_slice(&((body_len + 1) as u32).to_le_bytes());
    p[4] = TAG_DATA;
    p
}

fn get_u8(c: &mut Cursor<&[u8]>) -> Result<u8, FrameError> {
    let p = c.position() as usize;
    let b = *c
        .get_ref()
        .get(p)
        .ok_or(FrameError::Malformed("truncated field"))?;
    c.set_position(p as u64 + 1);
    Ok(b)
}

fn get_bytes<'a>(c: &mut Cursor<&'a [u8]>, n: usize) -> Result<&'a [u8], FrameError> {
    let p = c.position() as usize;
    let s: &'a [u8] = c.get_ref();
    let out = s
        .get(
            p..p.checked_add(n)
                .ok_or(FrameError::Malformed("length overflow"))?,
        )
        .ok_or(FrameError::Malformed("truncated field"))?;
    c.set_position((p + n) as u64);
    Ok(out)
}

fn get_u32(c: &mut Cursor<&[u8]>) -> Result<u32, FrameError> {
    let b = get_bytes(c, 4)?;
    Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Checks whether `buf` starts with a complete frame of at most `max_frame` bytes after the
/// length prefix, and returns that frame's total length (prefix included).
pub fn check(buf: &[u8], max_frame: usize) -> Result<usize, FrameError> {
    if buf.len() < 4 {
        return Err(FrameError::Incomplete { needed: 4 });
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len == 0 {
        return Err(FrameError::Malformed("empty frame"));
    }
    if len > max_frame {
        return Err(FrameError::TooLarge {
            len,
            max: max_frame,
        });
    }
    let total = 4 + len;
    if buf.len() < total {
        return Err(FrameError::Incomplete { needed: total });
    }
    Ok(total)
}

/// Parses the first frame of `buf`, returning it and the number of bytes it used.
pub fn parse(buf: &[u8], max_frame: usize) -> Result<(Frame, usize), FrameError> {
    let total = check(buf, max_frame)?;
    let mut c = Cursor::new(&buf[4..total]);
    let frame = match get_u8(&mut c)? {
        TAG_DATA => Frame::Data(buf[FRAME_HEADER_LEN..total].to_vec()),
        TAG_HEARTBEAT if total == FRAME_HEADER_LEN => Frame::Heartbeat,
        TAG_HEARTBEAT => return Err(FrameError::Malformed("heartbeat with a body")),
        TAG_HELLO => {
            if get_bytes(&mut c, 4)? != MAGIC {
                return Err(FrameError::Malformed("bad hello magic"));
            }
            if get_u8(&mut c)? != VERSION {
                return Err(FrameError::Malformed("unsupported hello version"));
            }
            let rank = get_u32(&mut c)?;
            let world = get_u32(&mut c)?;
            let tl = get_bytes(&mut c, 2)?;
            let tl = u16::from_le_bytes([tl[0], tl[1]]) as usize;
            if tl > MAX_TOKEN_LEN {
                return Err(FrameError::Malformed("token too long"));
            }
            let token = get_bytes(&mut c, tl)?.to_vec();
            if c.position() as usize != total - 4 {
                return Err(FrameError::Malformed("trailing bytes in hello"));
            }
            Frame::Hello(Hello { rank, world, token })
        }
        _ => return Err(FrameError::Malformed("unknown frame tag")),
    };
    Ok((frame, total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips_and_reports_incomplete() {
        let h = Hello {
            rank: 3,
            world: 4,
            token: b"secret".to_vec(),
        };
        let mut buf = h.encode();
        let mut data = data_prefix(3).to_vec();
        data.extend_from_slice(b"xyz");
        buf.extend_from_slice(&data);
        let (f, used) = parse(&buf, 1024).unwrap();
        assert_eq!(f, Frame::Hello(h.clone()));
        assert!(
            h.token_matches(b"secret") && !h.token_matches(b"secreT") && !h.token_matches(b"s")
        );
        let (f2, used2) = parse(&buf[used..], 1024).unwrap();
        assert_eq!(f2, Frame::Data(b"xyz".to_vec()));
        assert_eq!(used + used2, buf.len());
        assert_eq!(parse(&HEARTBEAT, 1024), Ok((Frame::Heartbeat, 5)));
        assert_eq!(
            parse(&[2, 0, 0, 0, TAG_HEARTBEAT, 0], 1024),
            Err(FrameError::Malformed("heartbeat with a body"))
        );
        for cut in 0..data.len() {
            assert!(matches!(
                parse(&data[..cut], 1024),
                Err(FrameError::Incomplete { .. })
            ));
        }
        assert_eq!(
            parse(&data[..6], 1024),
            Err(FrameError::Incomplete { needed: 8 })
        );
    }

    #[test]
    fn rejects_oversized_and_malformed_frames() {
        let huge = [0xff, 0xff, 0xff, 0x7f, 2];
        assert_eq!(
            parse(&huge, 1 << 20),
            Err(FrameError::TooLarge {
                len: 0x7fff_ffff,
                max: 1 << 20
            })
        );
        assert_eq!(
            parse(&[0, 0, 0, 0], 10),
            Err(FrameError::Malformed("empty frame"))
        );
        assert_eq!(
            parse(&[1, 0, 0, 0, 9], 10),
            Err(FrameError::Malformed("unknown frame tag"))
        );
        let mut h = Hello {
            rank: 0,
            world: 1,
            token: vec![],
        }
        .encode();
        h[5] = b'X';
        assert_eq!(
            parse(&h, 1024),
            Err(FrameError::Malformed("bad hello magic"))
        );
    }

    proptest! {
        #[test]
        fn hostile_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64), max in 0usize..80) {
            match parse(&bytes, max) {
                Ok((_, used)) => prop_assert!(used <= bytes.len() && used <= max + 4),
                Err(FrameError::Incomplete { needed }) => prop_assert!(needed > bytes.len() && needed <= max + 4 || needed == 4),
                Err(_) => {}
            }
        }

        #[test]
        fn hello_with_random_token_round_trips(rank: u32, world: u32, token in proptest::collection::vec(any::<u8>(), 0..=MAX_TOKEN_LEN)) {
            let h = Hello { rank, world, token };
            let enc = h.encode();
            prop_assert!(enc.len() <= MAX_HELLO_FRAME);
            prop_assert_eq!(parse(&enc, MAX_HELLO_FRAME).unwrap(), (Frame::Hello(h), enc.len()));
        }
    }
}
