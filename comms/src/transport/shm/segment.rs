//! The shared segment of one receiving rank and the byte rings inside it.
//!
//! ```text
//! segment of rank j  (file <dir>/dtrain-<run hash>-<j>, mode 0600, created by j)
//!   0        header page: SegHeader (magic, version, world, rank, pid, ring size,
//!            token hash, closed flag; the doorbell futex on its own cache line)
//!   4096     ring of sender slot 0: RingCtl page (head | tail | space futex, each on
//!            its own 128-byte line), then `cap` data bytes
//!   …        one ring per sender, slot = sender rank, minus one above j
//! ```
//!
//! A ring is a single-producer single-consumer byte pipe: `head` and `tail` count bytes
//! written and consumed since creation (they never wrap; byte `n` lives at `n mod cap`),
//! the producer publishes with a release store of `head` after copying, the consumer
//! with a release store of `tail` after copying out. The bytes carry the stream drivers'
//! frames ([`crate::frame`]: length, tag, message), so a message larger than the ring
//! simply streams through it.
//!
//! Waking (both the doorbell and a ring's `space` word): the waker changes the word, then
//! wakes if the sleeper's flag is set; the sleeper reads the word *before* looking for
//! work, sets its flag, re-reads the word and only then sleeps on the value it first read
//! — so a change made after it looked is either seen or wakes it (all `SeqCst`).
//! Before setting its flag, a sleeper may spin on the word for a while
//! ([`spin_until_changed`]).

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::sys::{self, futex_wake, Mapping, Shared};
use crate::transport::TransportError;

/// "DTRSHM" + format generation, little-endian.
const MAGIC: u64 = u64::from_le_bytes(*b"DTRSHM\x00\x01");
/// Layout version; a peer with another one is refused.
pub(crate) const VERSION: u32 = 1;
/// Bytes of the header page and of each ring's control page.
pub(crate) const PAGE: usize = 4096;

/// A 128-byte line (two cache lines: adjacent-line prefetch would couple 64-byte ones).
#[repr(C, align(128))]
#[derive(Debug)]
pub(crate) struct Line<T>(pub(crate) T);

/// A futex word and the flag of the party that may sleep on it.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct Wake {
    /// Changed by every waker; the futex word.
    pub(crate) word: AtomicU32,
    /// Set while the sleeper is (about to be) asleep.
    pub(crate) sleeping: AtomicU32,
}

impl Wake {
    /// Signals the sleeper (a syscall only if it sleeps).
    pub(crate) fn notify(&self) {
        self.word.fetch_add(1, SeqCst);
        if self.sleeping.load(SeqCst) != 0 {
            futex_wake(&self.word);
        }
    }
}

/// Spins until `word` differs from `seen` or `spin` passes; returns whether it changed.
pub(crate) fn spin_until_changed(word: &AtomicU32, seen: u32, spin: Duration) -> bool {
    if spin.is_zero() {
        return false;
    }
    let end = Instant::now() + spin;
    loop {
        for _ in 0..64 {
            if word.load(Relaxed) != seen {
                return true;
            }
            std::hint::spin_loop();
        }
        if Instant::now() >= end {
            return false;
        }
    }
}

/// Fixed facts about a segment, written by its creator before `magic`.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct Meta {
    magic: AtomicU64,
    version: AtomicU32,
    world: AtomicU32,
    rank: AtomicU32,
    /// The creator's process id.
    pub(crate) pid: AtomicU32,
    ring_bytes: AtomicU64,
    token_hash: [AtomicU64; 4],
    /// Set when the owner dropped its transport (it reads nothing any more).
    pub(crate) closed: AtomicU32,
}

/// The header page.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct SegHeader {
    /// Fixed facts and the closed flag.
    pub(crate) meta: Line<Meta>,
    /// The owner's doorbell: every sender rings it after publishing bytes.
    pub(crate) bell: Line<Wake>,
}

/// The producer's line of a ring.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct Prod {
    /// Bytes published so far.
    pub(crate) head: AtomicU64,
    /// Set once the producer will write no more (after its last byte).
    pub(crate) closed: AtomicU32,
    /// Set by the producer once it has mapped the ring.
    pub(crate) attached: AtomicU32,
}

/// The control page of a ring.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RingCtl {
    /// Producer-written.
    pub(crate) prod: Line<Prod>,
    /// Consumer-written: bytes consumed so far.
    pub(crate) tail: Line<AtomicU64>,
    /// Rung by the consumer after consuming; the producer sleeps on it when full.
    pub(crate) space: Line<Wake>,
}

// SAFETY: repr(C) structs of atomics only (Line is a repr(C) wrapper; its alignment
// padding is never read).
unsafe impl Shared for SegHeader {}
// SAFETY: as above.
unsafe impl Shared for RingCtl {}

const _: () = assert!(std::mem::size_of::<SegHeader>() <= PAGE);
const _: () = assert!(std::mem::size_of::<RingCtl>() <= PAGE);

/// Ring slot of sender `from` in the segment of `to`.
pub(crate) fn slot(from: usize, to: usize) -> usize {
    if from < to {
        from
    } else {
        from - 1
    }
}

/// Byte offset of the control page of ring `slot`.
fn ring_offset(slot: usize, cap: usize) -> usize {
    PAGE + slot * (PAGE + cap)
}

/// Total bytes of a segment for `world` ranks and rings of `cap` bytes.
pub(crate) fn segment_len(world: usize, cap: usize) -> usize {
    ring_offset(world.saturating_sub(1), cap)
}

/// A mapped segment header.
#[derive(Debug, Clone)]
pub(crate) struct Header {
    map: Arc<Mapping>,
}

impl Header {
    pub(crate) fn get(&self) -> &SegHeader {
        self.map.at::<SegHeader>(0)
    }

    /// Whether the owner dropped its transport.
    pub(crate) fn owner_closed(&self) -> bool {
        self.get().meta.0.closed.load(Acquire) != 0
    }

    /// The owner's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.get().meta.0.pid.load(Relaxed)
    }
}

/// One ring of a mapped segment (either side).
#[derive(Debug, Clone)]
pub(crate) struct Ring {
    map: Arc<Mapping>,
    /// Offset of the control page in `map`.
    off: usize,
    cap: usize,
}

impl Ring {
    pub(crate) fn ctl(&self) -> &RingCtl {
        self.map.at::<RingCtl>(self.off)
    }

    fn data(&self) -> *mut u8 {
        // In bounds: the mapping holds the control page and `cap` bytes from `off`
        // (checked when the ring was made).
        self.map.base().wrapping_add(self.off + PAGE)
    }

    /// Capacity in bytes.
    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }

    // ---- producer side (one producer at a time) ----

    /// Writes the bytes of `parts` (concatenated) from offset `skip` on, as many as fit,
    /// publishes them and returns how many were written.
    pub(crate) fn write(&self, parts: [&[u8]; 2], mut skip: usize) -> usize {
        let c = self.ctl();
        let head = c.prod.0.head.load(Relaxed);
        let tail = c.tail.0.load(Acquire);
        let mut room = self.cap - (head - tail) as usize;
        let mut pos = head;
        for part in parts {
            if skip >= part.len() {
                skip -= part.len();
                continue;
            }
            let src = &part[skip..];
            skip = 0;
            let n = src.len().min(room);
            self.copy_in(pos, &src[..n]);
            pos += n as u64;
            room -= n;
            if room == 0 {
                break;
            }
        }
        if pos != head {
            c.prod.0.head.store(pos, Release);
        }
        (pos - head) as usize
    }

    /// Copies `src` to ring position `pos` (wrapping). Caller: the producer, with
    /// `src.len()` bytes free from `pos`.
    fn copy_in(&self, pos: u64, src: &[u8]) {
        let at = (pos % self.cap as u64) as usize;
        let first = src.len().min(self.cap - at);
        // SAFETY: `at + first <= cap` and `src.len() - first <= cap` stay inside the data
        // area; those bytes are free (not yet published, consumed by the reader), so under
        // the ring protocol only this producer touches them.
        unsafe {
            sys::copy_to_shared(&src[..first], self.data().add(at));
            sys::copy_to_shared(&src[first..], self.data());
        }
    }

    /// Marks the producer done (after its last byte) and rings the owner's doorbell.
    pub(crate) fn close_producer(&self, owner: &Header) {
        self.ctl().prod.0.closed.store(1, Release);
        owner.get().bell.0.notify();
    }

    // ---- consumer side (the owner's receiving thread) ----

    /// Bytes published and not yet consumed.
    pub(crate) fn readable(&self) -> usize {
        let c = self.ctl();
        let head = c.prod.0.head.load(Acquire);
        let tail = c.tail.0.load(Relaxed);
        (head - tail) as usize
    }

    /// Copies the readable bytes from `skip` on into `dst` (the caller checked that
    /// `skip + dst.len() <= readable()`).
    pub(crate) fn copy_out(&self, skip: usize, dst: &mut [u8]) {
        let pos = self.ctl().tail.0.load(Relaxed) + skip as u64;
        let at = (pos % self.cap as u64) as usize;
        let first = dst.len().min(self.cap - at);
        let (a, b) = dst.split_at_mut(first);
        // SAFETY: both ranges lie in the data area (`at + first <= cap`, `b.len() <= cap`)
        // and hold published, unconsumed bytes (caller's check against `readable`, whose
        // acquire load of `head` makes them visible); the producer does not write them
        // until `tail` passes them.
        unsafe {
            sys::copy_from_shared(self.data().add(at), a);
            sys::copy_from_shared(self.data(), b);
        }
    }

    /// Consumes `n` bytes and tells a producer waiting for space.
    pub(crate) fn consume(&self, n: usize) {
        let c = self.ctl();
        let tail = c.tail.0.load(Relaxed);
        c.tail.0.store(tail + n as u64, Release);
        c.space.0.notify();
    }

    /// Whether the producer closed (load before a final `readable` check).
    pub(crate) fn producer_closed(&self) -> bool {
        self.ctl().prod.0.closed.load(Acquire) != 0
    }
}

/// The part of a segment a rank maps: all of its own, or the header and one ring of a peer's.
#[derive(Debug)]
pub(crate) struct Segment {
    pub(crate) header: Header,
    /// Own segment: every ring by slot; peer's: this rank's ring only.
    pub(crate) rings: Vec<Ring>,
}

/// Removes the segment's name when dropped, unless disarmed.
#[derive(Debug)]
pub(crate) struct Unlink(Option<PathBuf>);

impl Unlink {
    /// Removes the name now.
    pub(crate) fn now(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for Unlink {
    fn drop(&mut self) {
        self.now();
    }
}

fn io_err(path: &Path, what: &str, e: io::Error) -> TransportError {
    TransportError::Io(io::Error::new(
        e.kind(),
        format!("{what} {}: {e}", path.display()),
    ))
}

/// Creates, sizes and initialises the segment of `rank`.
pub(crate) fn create(
    path: &Path,
    rank: usize,
    world: usize,
    cap: usize,
    token_hash: &[u64; 4],
) -> Result<(Segment, Unlink), TransportError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| {
            let hint = if e.kind() == io::ErrorKind::AlreadyExists {
                "create (left over by a crashed run with the same run id?)"
            } else {
                "create"
            };
            io_err(path, hint, e)
        })?;
    let unlink = Unlink(Some(path.to_path_buf()));
    let len = segment_len(world, cap);
    file.set_len(len as u64)
        .map_err(|e| io_err(path, "size", e))?;
    sys::allocate(&file, len).map_err(|e| io_err(path, "reserve memory for", e))?;
    let map = Arc::new(Mapping::map(&file, 0, len).map_err(|e| io_err(path, "map", e))?);
    let header = Header { map: map.clone() };
    let m = &header.get().meta.0;
    m.version.store(VERSION, Relaxed);
    m.world.store(world as u32, Relaxed);
    m.rank.store(rank as u32, Relaxed);
    m.pid.store(std::process::id(), Relaxed);
    m.ring_bytes.store(cap as u64, Relaxed);
    for (w, h) in m.token_hash.iter().zip(token_hash) {
        w.store(*h, Relaxed);
    }
    m.magic.store(MAGIC, Release);
    let rings = (0..world - 1)
        .map(|s| Ring {
            map: map.clone(),
            off: ring_offset(s, cap),
            cap,
        })
        .collect();
    Ok((Segment { header, rings }, unlink))
}

/// Opens the segment of `owner` and maps its header and the ring of sender `me`:
/// `Ok(None)` while it does not exist or is not initialised yet; an error if it belongs to
/// another user, another run token, layout version or world size.
pub(crate) fn open(
    path: &Path,
    owner: usize,
    me: usize,
    world: usize,
    token_hash: &[u64; 4],
) -> Result<Option<Segment>, TransportError> {
    let refuse = |detail: String| TransportError::Handshake {
        peer: format!("rank {owner}"),
        detail: format!("shared-memory segment {}: {detail}", path.display()),
    };
    let file = match OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(path, "open", e)),
    };
    let md = file.metadata().map_err(|e| io_err(path, "stat", e))?;
    if md.uid() != sys::euid() || md.mode() & 0o077 != 0 || !md.file_type().is_file() {
        return Err(refuse(format!(
            "owned by uid {} with mode {:o}, expected uid {} and mode 600",
            md.uid(),
            md.mode() & 0o7777,
            sys::euid()
        )));
    }
    if (md.len() as usize) < PAGE {
        return Ok(None);
    }
    let header = Header {
        map: Arc::new(Mapping::map(&file, 0, PAGE).map_err(|e| io_err(path, "map", e))?),
    };
    let m = &header.get().meta.0;
    if m.magic.load(Acquire) != MAGIC {
        return Ok(None);
    }
    let version = m.version.load(Relaxed);
    if version != VERSION {
        return Err(refuse(format!(
            "layout version {version}, this build speaks {VERSION}"
        )));
    }
    let hash: Vec<u64> = m.token_hash.iter().map(|h| h.load(Relaxed)).collect();
    if hash != token_hash {
        return Err(refuse("created with a different run token".into()));
    }
    let (w, r) = (
        m.world.load(Relaxed) as usize,
        m.rank.load(Relaxed) as usize,
    );
    if w != world || r != owner {
        return Err(refuse(format!(
            "created by rank {r} of {w}, expected rank {owner} of {world}"
        )));
    }
    let cap = m.ring_bytes.load(Relaxed) as usize;
    if !cap.is_power_of_two() || cap < PAGE || segment_len(world, cap) != md.len() as usize {
        return Err(refuse(format!(
            "ring size {cap} does not match the segment size {}",
            md.len()
        )));
    }
    let off = ring_offset(slot(me, owner), cap);
    let map = Mapping::map(&file, off, PAGE + cap).map_err(|e| io_err(path, "map", e))?;
    let ring = Ring {
        map: Arc::new(map),
        off: 0,
        cap,
    };
    Ok(Some(Segment {
        header,
        rings: vec![ring],
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_page_aligned() {
        assert_eq!(std::mem::align_of::<SegHeader>(), 128);
        assert_eq!(ring_offset(0, 8192), PAGE);
        assert_eq!(ring_offset(2, 8192) % PAGE, 0);
        assert_eq!(segment_len(1, 8192), PAGE);
        assert_eq!(segment_len(3, 8192), PAGE + 2 * (PAGE + 8192));
        assert_eq!((slot(0, 2), slot(1, 2), slot(3, 2)), (0, 1, 2));
    }
}
