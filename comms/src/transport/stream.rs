//! What the byte-stream drivers (TCP, QUIC) share: the hello exchange over
//! [`crate::frame`], the queued [`Outgoing`] frame, liveness settings and egress shaping
//! ([`Shaper`]). The per-connection data paths differ: TCP moves data on threads
//! (`threaded.rs`), QUIC on tasks (`quic_stream.rs`).

use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::TransportError;
use crate::frame::{self, Frame, FrameError, Hello};
pub(crate) use crate::shaping::Shaper;

/// A frame queued for a connection's writer.
#[derive(Debug)]
pub(crate) struct Outgoing {
    /// When the emulated link delivers it (`None`: at once).
    pub(crate) release: Option<Instant>,
    /// The message (the writer adds the frame prefix).
    pub(crate) msg: Vec<u8>,
}

/// Checks that a peer timeout leaves room for at least two heartbeats (shared by the TCP
/// and QUIC configurations).
pub(crate) fn check_liveness(
    heartbeat: Option<Duration>,
    peer_timeout: Option<Duration>,
) -> Result<(), TransportError> {
    let bad = |detail: String| {
        Err(TransportError::Handshake {
            peer: "config".into(),
            detail,
        })
    };
    match (heartbeat, peer_timeout) {
        (Some(h), _) if h.is_zero() => bad("heartbeat interval of zero".into()),
        (_, Some(t)) if t.is_zero() => bad("peer timeout of zero".into()),
        (Some(h), Some(t)) if t < 2 * h => bad(format!(
            "peer timeout {t:?} shorter than two heartbeat intervals ({h:?})"
        )),
        (None, Some(_)) => bad("a peer timeout needs heartbeats (set a heartbeat interval)".into()),
        _ => Ok(()),
    }
}

/// Reads one frame of at most `max` bytes; `Ok(None)` on a clean end of stream.
pub(crate) async fn read_frame(
    rd: &mut (impl AsyncRead + Unpin),
    buf: &mut BytesMut,
    max: usize,
) -> Result<Option<Frame>, TransportError> {
    loop {
        match frame::parse(buf, max) {
            Ok((f, used)) => {
                buf.advance(used);
                return Ok(Some(f));
            }
            Err(FrameError::Incomplete { needed }) => {
                buf.reserve(needed.saturating_sub(buf.len()).max(8 << 10));
                if rd.read_buf(buf).await? == 0 {
                    if buf.is_empty() {
                        return Ok(None);
                    }
                    return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Writes and flushes a hello frame.
pub(crate) async fn write_hello(
    s: &mut (impl AsyncWrite + Unpin),
    rank: usize,
    world: usize,
    token: &[u8],
) -> std::io::Result<()> {
    let h = Hello {
        rank: rank as u32,
        world: world as u32,
        token: token.to_vec(),
    };
    s.write_all(&h.encode()).await?;
    s.flush().await
}
