//! The receiving side from one peer: reassembles the frames of its ring into pooled
//! message buffers, and reports the peer's close once the ring is drained.

use std::sync::Arc;

use tracing::warn;

use super::segment::Ring;
use super::sys::Process;
use crate::frame::{FRAME_HEADER_LEN, TAG_DATA};
use crate::pool;

/// Frame reassembly state of one inbound ring.
#[derive(Debug)]
enum Partial {
    /// Reading the frame prefix.
    Prefix([u8; FRAME_HEADER_LEN], usize),
    /// Reading a message of `buf.len()` bytes, `have` so far.
    Body(Vec<u8>, usize),
}

/// The receiving side from one peer.
#[derive(Debug)]
pub(super) struct Inbound {
    pub(super) ring: Ring,
    pub(super) process: Arc<Process>,
    partial: Partial,
    /// The peer's process exited (checked by [`ShmTransport::check_liveness`]).
    ///
    /// [`ShmTransport::check_liveness`]: super::ShmTransport::check_liveness
    pub(super) dead: bool,
    /// The close was reported.
    pub(super) reported: bool,
}

/// What polling one inbound ring gave.
pub(super) enum Polled {
    Msg(Vec<u8>),
    Closed,
    Nothing,
}

impl Inbound {
    /// The receiving side of `ring`, written by the peer whose process is `process`.
    pub(super) fn new(ring: Ring, process: Arc<Process>) -> Self {
        Inbound {
            ring,
            process,
            partial: Partial::Prefix([0; FRAME_HEADER_LEN], 0),
            dead: false,
            reported: false,
        }
    }

    /// Takes what the ring holds: a whole message, the peer's close (once the ring is
    /// drained), or nothing yet.
    pub(super) fn poll(&mut self, from: usize, max_frame: usize) -> Polled {
        loop {
            let avail = self.ring.readable();
            if avail == 0 {
                // The closed flag is set after the last byte: check the ring again after it.
                if (self.dead || self.ring.producer_closed()) && self.ring.readable() == 0 {
                    if let Partial::Body(b, _) = std::mem::replace(
                        &mut self.partial,
                        Partial::Prefix([0; FRAME_HEADER_LEN], 0),
                    ) {
                        pool::put(b);
                    }
                    return Polled::Closed;
                }
                if avail == self.ring.readable() {
                    return Polled::Nothing;
                }
                continue;
            }
            match &mut self.partial {
                Partial::Prefix(p, have) => {
                    let n = (FRAME_HEADER_LEN - *have).min(avail);
                    self.ring.copy_out(0, &mut p[*have..*have + n]);
                    self.ring.consume(n);
                    *have += n;
                    if *have < FRAME_HEADER_LEN {
                        continue;
                    }
                    let len = u32::from_le_bytes(p[..4].try_into().expect("4 bytes")) as usize;
                    if len == 0 || p[4] != TAG_DATA || len - 1 > max_frame {
                        warn!(
                            "shared-memory ring from rank {from}: malformed frame \
                             (length {len}, tag {}); treating the peer as closed",
                            p[4]
                        );
                        self.dead = true;
                        self.partial = Partial::Prefix([0; FRAME_HEADER_LEN], 0);
                        return Polled::Closed;
                    }
                    self.partial = Partial::Body(pool::take_filled(len - 1), 0);
                }
                Partial::Body(b, have) => {
                    let n = (b.len() - *have).min(avail);
                    self.ring.copy_out(0, &mut b[*have..*have + n]);
                    self.ring.consume(n);
                    *have += n;
                }
            }
            if let Partial::Body(b, have) = &self.partial {
                if *have == b.len() {
                    let Partial::Body(b, _) = std::mem::replace(
                        &mut self.partial,
                        Partial::Prefix([0; FRAME_HEADER_LEN], 0),
                    ) else {
                        unreachable!("checked above")
                    };
                    return Polled::Msg(b);
                }
            }
        }
    }
}
