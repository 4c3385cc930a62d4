//! The TCP data path: one blocking reader thread and one blocking writer thread per
//! connection, over `std::net::TcpStream`, sharing a pool of large message buffers.
//!
//! Why threads rather than the tokio tasks of [`super::stream`]: a ring step sends a chunk
//! to one neighbour while it receives one from the other, and with one runtime thread the
//! reads and writes of a rank (each a kernel copy of the chunk) ran one after the other.
//! A thread per direction lets the copies in and out of the kernel run in parallel with
//! each other and with the reduction on the caller's thread, and a blocking `read` /
//! `write` of a whole chunk costs one system call instead of a readiness round trip per
//! socket-buffer-full.
//!
//! Buffers: the reader reads every large frame straight into its own buffer (no copy
//! through a read buffer), taken from the crate's buffer pool (`pool.rs`); the writer
//! sends the frame prefix and the message in one vectored write and gives the message's
//! buffer back to the pool.
//! In a ring the same few chunk-sized buffers then circulate — received, reduced into,
//! forwarded, written, reused — instead of being freshly allocated (and page-faulted and
//! zeroed) for every chunk. Small frames go through a read buffer and are coalesced into
//! one write, as before.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use tracing::warn;

use super::stream::Outgoing;
use super::{Event, TransportError};
use crate::frame::{self, Frame, FrameError, FRAME_HEADER_LEN};
use crate::pool;

/// Data frames at least this large are read straight into their own buffer and written
/// without staging; smaller ones go through the read buffer / the write stage.
pub(crate) const DIRECT: usize = 64 << 10;
/// Size of the reader's buffer for small frames (holds any frame below [`DIRECT`]).
const READ_BUF: usize = 2 * DIRECT;
/// Small frames are coalesced into writes of up to this many bytes.
const STAGE: usize = 256 << 10;
/// Reads the frames of one connection into the inbox until the stream ends; reports the
/// end (clean or not) as [`Event::Closed`]. `pending` holds bytes already read from the
/// stream during the handshake.
pub(crate) fn read_loop(
    peer: usize,
    mut s: TcpStream,
    pending: &[u8],
    tx: Sender<Event>,
    max: usize,
) {
    let r = read_frames(peer, &mut s, pending, &tx, max);
    if let Err(e) = r {
        warn!("connection to rank {peer} failed: {e}");
    }
    let _ = tx.send(Event::Closed(peer));
}

fn read_frames(
    peer: usize,
    s: &mut TcpStream,
    pending: &[u8],
    tx: &Sender<Event>,
    max: usize,
) -> Result<(), TransportError> {
    let mut buf = vec![0u8; READ_BUF.max(pending.len())];
    buf[..pending.len()].copy_from_slice(pending);
    let (mut lo, mut hi) = (0, pending.len());
    loop {
        match frame::parse(&buf[lo..hi], max) {
            Ok((Frame::Data(b), used)) => {
                lo += used;
                if tx.send(Event::Msg(peer, b)).is_err() {
                    return Ok(());
                }
            }
            Ok((Frame::Hello(_), _)) => {
                return Err(FrameError::Malformed("second hello on a connection").into())
            }
            Err(FrameError::Incomplete { needed })
                if needed >= DIRECT
                    && hi - lo >= FRAME_HEADER_LEN
                    && buf[lo + 4] == frame::TAG_DATA =>
            {
                // `needed` passed the size check in `parse`, so this is bounded by `max`.
                let mut body = pool::take_filled(needed - FRAME_HEADER_LEN);
                let have = hi - lo - FRAME_HEADER_LEN;
                body[..have].copy_from_slice(&buf[lo + FRAME_HEADER_LEN..hi]);
                (lo, hi) = (0, 0);
                s.read_exact(&mut body[have..])?;
                if tx.send(Event::Msg(peer, body)).is_err() {
                    return Ok(());
                }
            }
            Err(FrameError::Incomplete { .. }) => {
                // Either a frame smaller than `DIRECT` (it fits the buffer once moved to
                // the front) or a header still incomplete.
                if lo > 0 {
                    buf.copy_within(lo..hi, 0);
                    (lo, hi) = (0, hi - lo);
                }
                if hi == buf.len() {
                    return Err(
                        FrameError::Malformed("large frame that is not a data frame").into(),
                    );
                }
                let n = match s.read(&mut buf[hi..]) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e.into()),
                };
                if n == 0 {
                    if hi == 0 {
                        return Ok(());
                    }
                    return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
                }
                hi += n;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Writes queued frames to one connection until the queue closes or a write fails, then
/// shuts the sending direction down. Frames with a release time are written no earlier
/// than that (what was staged before is written first). `done` is dropped on return.
pub(crate) fn write_loop(peer: usize, mut s: TcpStream, rx: Receiver<Outgoing>, done: Sender<()>) {
    if let Err(e) = write_frames(&mut s, &rx) {
        warn!("sending to rank {peer} failed: {e}");
    }
    let _ = s.shutdown(Shutdown::Write);
    drop(done);
}

fn write_frames(s: &mut TcpStream, rx: &Receiver<Outgoing>) -> io::Result<()> {
    let mut stage: Vec<u8> = Vec::with_capacity(STAGE);
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        while let Some(o) = next {
            if let Some(at) = o.release {
                let now = Instant::now();
                if now < at {
                    s.write_all(&stage)?;
                    stage.clear();
                    std::thread::sleep(at - now);
                }
            }
            let prefix = frame::data_prefix(o.msg.len());
            if o.msg.len() < DIRECT && stage.len() + FRAME_HEADER_LEN + o.msg.len() <= STAGE {
                stage.extend_from_slice(&prefix);
                stage.extend_from_slice(&o.msg);
            } else {
                write_all_vectored(
                    s,
                    &mut [
                        IoSlice::new(&stage),
                        IoSlice::new(&prefix),
                        IoSlice::new(&o.msg),
                    ],
                )?;
                stage.clear();
                pool::put(o.msg);
            }
            next = rx.try_recv().ok();
        }
        s.write_all(&stage)?;
        stage.clear();
    }
    Ok(())
}

fn write_all_vectored(s: &mut impl Write, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match s.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectored_write_survives_partial_writes() {
        struct Dribble(Vec<u8>);
        impl Write for Dribble {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                let n = b.len().min(3);
                self.0.extend_from_slice(&b[..n]);
                Ok(n)
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut d = Dribble(Vec::new());
        write_all_vectored(
            &mut d,
            &mut [
                IoSlice::new(b""),
                IoSlice::new(b"abcde"),
                IoSlice::new(b""),
                IoSlice::new(b"fghijkl"),
            ],
        )
        .unwrap();
        assert_eq!(d.0, b"abcdefghijkl");
    }
}
