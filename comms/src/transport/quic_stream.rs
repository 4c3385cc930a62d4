//! The QUIC driver's per-connection tasks: the reader parses frames from a quinn stream into
//! the rank's inbox and reports a closed or broken stream as [`super::Event::Closed`]; the
//! writer drains an unbounded queue of [`Outgoing`] frames into a quinn stream, sleeping
//! until each frame's release time when the link is emulated.

use std::sync::mpsc;
use std::time::Instant;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::warn;

use super::stream::Outgoing;
use super::{Event, TransportError};
use crate::frame::{self, Frame, FrameError, FRAME_HEADER_LEN};
use crate::pool;

/// Data frames at least this large are read straight into their own, exactly sized
/// buffer (saves a copy); smaller ones go through the shared read buffer.
const DIRECT_READ: usize = 64 << 10;

/// Delivers the data frames of one QUIC stream to the inbox (dropping heartbeats); reports
/// the end of the stream (clean or not) as the event `end` returns then. (TCP moves data
/// on threads, `threaded.rs`.)
///
/// Handing the body over as the `Bytes` pieces quinn decrypted it into, joined later by the
/// receiving thread, was measured slower than this copy (0.49 against 0.66 × TCP at 64 MB).
pub(crate) async fn reader(
    peer: usize,
    mut rd: quinn::RecvStream,
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
                    AsyncReadExt::read_exact(&mut rd, &mut body[have..]).await?;
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

/// A pooled message handed to quinn without copying; its buffer returns to the pool when
/// quinn has no further use for it (every byte acknowledged).
struct Pooled(Vec<u8>);

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        pool::put(std::mem::take(&mut self.0));
    }
}

/// Messages at least this large are handed to quinn as their own chunk (no copy); smaller
/// ones are copied behind their prefix into one chunk (one STREAM frame, one allocation).
const OWN_CHUNK: usize = 16 << 10;

/// Writes queued frames to one QUIC stream until the queue closes, then finishes the stream
/// and returns it (`None` if writing failed). Frames with a release time are written no
/// earlier than that.
///
/// quinn's `write` copies what it is given into its send buffer; large messages are instead
/// handed over as `Bytes` owning the message (`write_all_chunks`), which saves that copy on
/// the I/O thread, where QUIC's encryption already takes most of the time.
pub(crate) async fn writer(
    peer: usize,
    mut w: quinn::SendStream,
    mut rx: UnboundedReceiver<Outgoing>,
) -> Option<quinn::SendStream> {
    while let Some(o) = rx.recv().await {
        if let Some(at) = o.release {
            if Instant::now() < at {
                tokio::time::sleep_until(at.into()).await;
            }
        }
        let prefix = frame::data_prefix(o.msg.len());
        let r = if o.msg.len() >= OWN_CHUNK {
            let mut chunks = [
                Bytes::copy_from_slice(&prefix),
                Bytes::from_owner(Pooled(o.msg)),
            ];
            w.write_all_chunks(&mut chunks).await
        } else {
            let mut one = Vec::with_capacity(FRAME_HEADER_LEN + o.msg.len());
            one.extend_from_slice(&prefix);
            one.extend_from_slice(&o.msg);
            w.write_all_chunks(&mut [Bytes::from(one)]).await
        };
        if let Err(e) = r {
            warn!("sending to rank {peer} failed: {e}");
            return None;
        }
    }
    w.finish().ok().map(|()| w)
}
