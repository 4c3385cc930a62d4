//! What the byte-stream drivers (TCP, QUIC) share: hello exchange, the per-connection
//! reader and writer tasks over [`crate::frame`], and egress shaping ([`Shaper`]).
//!
//! The reader parses frames into the rank's inbox and reports a closed or broken stream as
//! [`super::Event::Closed`]; the writer drains an unbounded queue of [`Outgoing`] frames,
//! sleeping until each frame's release time when the link is emulated.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::warn;

use super::{Event, TransportError};
use crate::frame::{self, Frame, FrameError, Hello, FRAME_HEADER_LEN};
use crate::pool;
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

/// Data frames at least this large are read straight into their own, exactly sized
/// buffer (saves a copy); smaller ones go through the shared read buffer.
#[cfg_attr(not(feature = "quic"), allow(dead_code))]
const DIRECT_READ: usize = 64 << 10;

/// Delivers the data frames of one connection to the inbox (dropping heartbeats); reports
/// the end of the stream (clean or not) as the event `end` returns then. (QUIC; TCP moves
/// data on threads, `threaded.rs`.)
#[cfg_attr(not(feature = "quic"), allow(dead_code))]
pub(crate) async fn reader<R: AsyncRead + Unpin>(
    peer: usize,
    mut rd: R,
    mut buf: BytesMut,
    tx: mpsc::Sender<Event>,
    max: usize,
    end: impl FnOnce() -> Event,
) {
    let r: Result<(), TransportError> = async {
        loop {
            match frame::parse(&buf, max) {
                Ok((Frame::Data(b), used)) => {
                    buf.advance(used);
                    if tx.send(Event::Msg(peer, b)).is_err() {
                        return Ok(());
                    }
                }
                Ok((Frame::Heartbeat, used)) => buf.advance(used),
                Ok((Frame::Hello(_), _)) => {
                    return Err(FrameError::Malformed("second hello on a connection").into())
                }
                Err(FrameError::Incomplete { needed })
                    if needed >= DIRECT_READ
                        && buf.len() >= FRAME_HEADER_LEN
                        && buf[4] == frame::TAG_DATA =>
                {
                    // `needed` passed the size check in `parse`, so this is bounded by `max`.
                    // A pooled buffer: no fresh pages to fault in and zero per chunk.
                    let mut body = pool::take_filled(needed - FRAME_HEADER_LEN);
                    let have = buf.len() - FRAME_HEADER_LEN;
                    body[..have].copy_from_slice(&buf[FRAME_HEADER_LEN..]);
                    buf.clear();
                    rd.read_exact(&mut body[have..]).await?;
                    if tx.send(Event::Msg(peer, body)).is_err() {
                        return Ok(());
                    }
                }
                Err(FrameError::Incomplete { needed }) => {
                    buf.reserve(needed.saturating_sub(buf.len()).max(8 << 10));
                    if rd.read_buf(&mut buf).await? == 0 {
                        if buf.is_empty() {
                            return Ok(());
                        }
                        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    .await;
    if let Err(e) = r {
        warn!("connection to rank {peer} failed: {e}");
    }
    let _ = tx.send(end());
}

/// Writes queued frames to one connection until the queue closes, then shuts the stream
/// down and returns it (`None` if writing failed). Frames with a release time are written
/// no earlier than that (what was buffered before is flushed first).
#[cfg_attr(not(feature = "quic"), allow(dead_code))]
pub(crate) async fn writer<W: AsyncWrite + Unpin>(
    peer: usize,
    wr: W,
    mut rx: UnboundedReceiver<Outgoing>,
) -> Option<W> {
    let mut w = BufWriter::with_capacity(256 << 10, wr);
    async fn put<W: AsyncWrite + Unpin>(w: &mut BufWriter<W>, o: Outgoing) -> std::io::Result<()> {
        if let Some(at) = o.release {
            if Instant::now() < at {
                w.flush().await?;
                tokio::time::sleep_until(at.into()).await;
            }
        }
        w.write_all(&frame::data_prefix(o.msg.len())).await?;
        w.write_all(&o.msg).await?;
        pool::put(o.msg);
        Ok(())
    }
    while let Some(m) = rx.recv().await {
        let mut r = put(&mut w, m).await;
        while r.is_ok() {
            match rx.try_recv() {
                Ok(m) => r = put(&mut w, m).await,
                Err(_) => break,
            }
        }
        if let Err(e) = async {
            r?;
            w.flush().await
        }
        .await
        {
            warn!("sending to rank {peer} failed: {e}");
            return None;
        }
    }
    match w.shutdown().await {
        Ok(()) => Some(w.into_inner()),
        Err(_) => None,
    }
}
