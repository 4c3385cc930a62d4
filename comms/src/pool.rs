//! A process-wide pool of large message buffers.
//!
//! A chunked collective moves the same few chunk-sized buffers over and over: a message
//! is built (or received), reduced into, forwarded, written to a socket, dropped. Left to
//! the allocator, every chunk-sized buffer is a fresh allocation that the kernel must
//! page-fault and zero (glibc returns large freed blocks to the kernel), which cost as
//! much CPU as the reduction itself. Instead, dropped [`crate::wire::Message`]s and the
//! buffers the TCP writers have finished with are kept here (bounded by
//! [`MAX_BUFS`] buffers and [`MAX_BYTES`] bytes), and message building and the TCP readers
//! take from here first. Buffers below [`MIN_BYTES`] are left to the allocator.
//!
//! Contents of a taken buffer are unspecified (stale bytes of an earlier message), never
//! uninitialised: every pooled buffer keeps its initialised length.

use std::sync::Mutex;

/// Smallest buffer capacity worth pooling.
pub const MIN_BYTES: usize = 64 << 10;
/// Most buffers the pool keeps.
pub const MAX_BUFS: usize = 32;
/// Most bytes (capacity) the pool keeps.
pub const MAX_BYTES: usize = 64 << 20;

static POOL: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

fn lock() -> std::sync::MutexGuard<'static, Vec<Vec<u8>>> {
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a pooled buffer of capacity `cap` suits a request for `n` bytes (large enough,
/// and not wastefully larger).
fn fits(cap: usize, n: usize) -> bool {
    cap >= n && cap <= 2 * n.max(MIN_BYTES)
}

/// Keeps `buf` for reuse if it is large enough and the pool has room; drops it otherwise.
pub(crate) fn put(buf: Vec<u8>) {
    if buf.capacity() < MIN_BYTES || buf.len() < buf.capacity() / 2 {
        return;
    }
    let mut p = lock();
    let held: usize = p.iter().map(Vec::capacity).sum();
    if p.len() < MAX_BUFS && held + buf.capacity() <= MAX_BYTES {
        p.push(buf);
    }
}

fn take(n: usize) -> Option<Vec<u8>> {
    if n < MIN_BYTES / 2 {
        return None;
    }
    let mut p = lock();
    let i = p.iter().rposition(|b| fits(b.capacity(), n))?;
    Some(p.swap_remove(i))
}

/// An empty buffer with capacity for at least `n` bytes.
pub(crate) fn take_empty(n: usize) -> Vec<u8> {
    match take(n) {
        Some(mut b) => {
            b.clear();
            b
        }
        None => Vec::with_capacity(n),
    }
}

/// A buffer of exactly `n` initialised bytes (contents unspecified).
#[cfg_attr(not(any(feature = "tcp", feature = "shm")), allow(dead_code))]
pub(crate) fn take_filled(n: usize) -> Vec<u8> {
    match take(n) {
        Some(mut b) => {
            // Only bytes beyond the buffer's initialised length are zero-filled.
            b.resize(n, 0);
            b
        }
        None => vec![0; n],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_large_buffers_and_bounds_what_it_keeps() {
        // The pool is process-wide and other tests use it concurrently: use a size of our
        // own so that only our buffers fit, and check properties rather than exact counts.
        let n = MIN_BYTES * 3 + 12_345;
        put(vec![9; 100]);
        let mut b = vec![7u8; n];
        b[0] = 42;
        let ptr = b.as_ptr();
        put(b);
        let got = take_filled(n - 5);
        assert_eq!(got.len(), n - 5);
        if got.as_ptr() == ptr {
            assert_eq!(got[0], 42, "reused with its stale contents");
        }
        put(got);
        let e = take_empty(n - 5);
        assert!(e.is_empty() && e.capacity() >= n - 5);
        assert!(take_empty(10).capacity() >= 10);
        for _ in 0..MAX_BUFS + 4 {
            put(vec![0; MIN_BYTES]);
        }
        let p = lock();
        assert!(p.len() <= MAX_BUFS);
        assert!(p.iter().map(Vec::capacity).sum::<usize>() <= MAX_BYTES);
        assert!(p.iter().all(|b| b.capacity() >= MIN_BYTES));
    }
}
