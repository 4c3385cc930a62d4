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
//!
//! Liveness: a writer that has had nothing to write for the heartbeat interval writes a
//! heartbeat frame (also while it holds a frame back for an emulated link), and a reader
//! whose socket yields no byte for the peer timeout (`SO_RCVTIMEO`, so it applies to every
//! `read`, also in the middle of a large frame) reports the peer as
//! [`Event::Silent`] and shuts the connection down. Heartbeats are dropped by the reader:
//! they never reach the inbox and are not counted as bytes of any collective.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use tracing::warn;

use super::stream::Outgoing;
use super::{Event, OnEvent, TransportError};
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
/// stream during the handshake. With a `peer_timeout`, a connection on which nothing
/// arrives for that long is shut down and reported as [`Event::Silent`].
pub(crate) fn read_loop(
    peer: usize,
    mut s: TcpStream,
    pending: &[u8],
    tx: Sender<Event>,
    on_event: Option<OnEvent>,
    max: usize,
    peer_timeout: Option<Duration>,
) {
    let queue = Queue { tx, on_event };
    let r = match s.set_read_timeout(peer_timeout) {
        Ok(()) => read_frames(peer, &mut s, pending, &queue, max),
        Err(e) => Err(e.into()),
    };
    let end = match (r, peer_timeout) {
        (Err(TransportError::Io(e)), Some(t))
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            warn!("rank {peer} sent nothing, not even a heartbeat, for {t:?}: dropping it");
            // Also ends our writer to it, should it be stuck on a peer that stopped reading.
            let _ = s.shutdown(Shutdown::Both);
            Event::Silent(peer, t)
        }
        (Err(e), _) => {
            warn!("connection to rank {peer} failed: {e}");
            Event::Closed(peer)
        }
        (Ok(()), _) => Event::Closed(peer),
    };
    let _ = queue.send(end);
}

/// The rank's inbox queue, and who is told of each event queued there.
struct Queue {
    tx: Sender<Event>,
    on_event: Option<OnEvent>,
}

impl Queue {
    /// Queues `e`; `Err` when the transport is gone (nobody reads the queue any more).
    fn send(&self, e: Event) -> Result<(), ()> {
        self.tx.send(e).map_err(|_| ())?;
        if let Some(f) = &self.on_event {
            f.call();
        }
        Ok(())
    }
}

fn read_frames(
    peer: usize,
    s: &mut TcpStream,
    pending: &[u8],
    tx: &Queue,
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
            Ok((Frame::Heartbeat, used)) => lo += used,
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
/// than that (what was staged before is written first). With a `heartbeat` interval, a
/// heartbeat frame is written whenever nothing was written for that long. `done` is
/// dropped on return.
pub(crate) fn write_loop(
    peer: usize,
    mut s: TcpStream,
    rx: Receiver<Outgoing>,
    done: Sender<()>,
    heartbeat: Option<Duration>,
) {
    if let Err(e) = write_frames(&mut s, &rx, heartbeat) {
        warn!("sending to rank {peer} failed: {e}");
    }
    let _ = s.shutdown(Shutdown::Write);
    drop(done);
}

/// Sleeps until `at`, writing a heartbeat every `heartbeat` meanwhile.
fn wait_until(s: &mut impl Write, at: Instant, heartbeat: Option<Duration>) -> io::Result<()> {
    loop {
        let now = Instant::now();
        if now >= at {
            return Ok(());
        }
        match heartbeat {
            Some(h) if at - now > h => {
                std::thread::sleep(h);
                s.write_all(&frame::HEARTBEAT)?;
            }
            _ => std::thread::sleep(at - now),
        }
    }
}

fn write_frames(
    s: &mut TcpStream,
    rx: &Receiver<Outgoing>,
    heartbeat: Option<Duration>,
) -> io::Result<()> {
    let mut stage: Vec<u8> = Vec::with_capacity(STAGE);
    loop {
        let first = match heartbeat {
            None => match rx.recv() {
                Ok(o) => o,
                Err(_) => return Ok(()),
            },
            Some(h) => match rx.recv_timeout(h) {
                Ok(o) => o,
                Err(RecvTimeoutError::Timeout) => {
                    s.write_all(&frame::HEARTBEAT)?;
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            },
        };
        let mut next = Some(first);
        while let Some(o) = next {
            if let Some(at) = o.release {
                if Instant::now() < at {
                    s.write_all(&stage)?;
                    stage.clear();
                    wait_until(s, at, heartbeat)?;
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
    use std::net::TcpListener;
    use std::sync::mpsc;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn reader_drops_heartbeats_and_gives_up_on_a_silent_peer() {
        let (mut a, b) = pair();
        let (tx, rx) = mpsc::channel();
        let quiet = Duration::from_millis(300);
        let t = std::thread::spawn(move || read_loop(1, b, &[], tx, None, 1 << 20, Some(quiet)));
        // Heartbeats around a message, each well within the peer timeout: only the message
        // comes through.
        for _ in 0..3 {
            a.write_all(&frame::HEARTBEAT).unwrap();
            std::thread::sleep(Duration::from_millis(150));
        }
        a.write_all(&frame::data_prefix(1)).unwrap();
        a.write_all(b"x").unwrap();
        a.write_all(&frame::HEARTBEAT).unwrap();
        let start = Instant::now();
        match rx.recv_timeout(Duration::from_secs(5)).unwrap() {
            Event::Msg(1, b) => assert_eq!(b, b"x"),
            e => panic!("{e:?}"),
        }
        // Then silence: reported once the peer timeout passed, and the connection is
        // dropped (the peer reads the end of the stream).
        match rx.recv_timeout(Duration::from_secs(5)).unwrap() {
            Event::Silent(1, d) => assert_eq!(d, quiet),
            e => panic!("{e:?}"),
        }
        let waited = start.elapsed();
        assert!(waited >= quiet - Duration::from_millis(50), "{waited:?}");
        assert!(waited < quiet + Duration::from_secs(2), "{waited:?}");
        a.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(a.read(&mut [0u8; 8]).unwrap_or(0), 0);
        t.join().unwrap();
    }

    #[test]
    fn idle_writer_sends_heartbeats_and_then_its_frames() {
        let (a, mut b) = pair();
        let (tx, rx) = mpsc::channel();
        let (done, _done_rx) = mpsc::channel();
        let beat = Duration::from_millis(40);
        let t = std::thread::spawn(move || write_loop(0, a, rx, done, Some(beat)));
        std::thread::sleep(Duration::from_millis(300));
        tx.send(Outgoing {
            release: None,
            msg: b"hello".to_vec(),
        })
        .unwrap();
        drop(tx);
        t.join().unwrap();
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();
        let mut beats = 0;
        let mut rest = &got[..];
        while rest.starts_with(&frame::HEARTBEAT) {
            beats += 1;
            rest = &rest[frame::FRAME_HEADER_LEN..];
        }
        assert!((3..=10).contains(&beats), "{beats} heartbeats in 300 ms");
        let (f, used) = frame::parse(rest, 1 << 20).unwrap();
        assert_eq!(f, Frame::Data(b"hello".to_vec()));
        assert_eq!(used, rest.len());
    }

    #[test]
    fn writer_holding_a_frame_for_an_emulated_link_keeps_beating() {
        let (a, mut b) = pair();
        let (tx, rx) = mpsc::channel();
        let (done, _done_rx) = mpsc::channel();
        let t =
            std::thread::spawn(move || write_loop(0, a, rx, done, Some(Duration::from_millis(40))));
        tx.send(Outgoing {
            release: Some(Instant::now() + Duration::from_millis(300)),
            msg: b"late".to_vec(),
        })
        .unwrap();
        drop(tx);
        t.join().unwrap();
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();
        let n = got.len() - (frame::FRAME_HEADER_LEN + 4);
        assert!(n >= 3 * frame::FRAME_HEADER_LEN, "{got:?}");
        assert!(got[..n].chunks(5).all(|c| c == frame::HEARTBEAT));
        assert_eq!(&got[n + frame::FRAME_HEADER_LEN..], b"late");
    }

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
