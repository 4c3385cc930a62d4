//! A global allocator that keeps large freed blocks for reuse: [`ReuseAlloc`].
//!
//! # Why
//!
//! A training step allocates the same large buffers every time: burn's backward pass hands
//! out a fresh gradient tensor per parameter (67 MB for the first fully connected layer of
//! AlexNet-CIFAR-FC), activations, and their gradients. glibc serves blocks above its mmap
//! threshold (at most 32 MB) with a fresh `mmap` and returns them with `munmap` on free, and
//! gives the top of its heap back to the kernel above the trim threshold. Every step then
//! pays a page fault per 4 KiB page on first touch and a `munmap` (TLB shoot-down) on free.
//! Measured with `framework/examples/flat_bench.rs` on AlexNet-CIFAR-FC (23.3 M parameters,
//! batch 32, one core): backward 136 → 79 ms and gradient extraction 20.7 → 6.0 ms per step
//! once freed memory is kept (the measurement was taken with glibc tunables; this allocator
//! gives the same effect from code, without relying on the environment).
//!
//! # What it does
//!
//! Blocks of at least [`ReuseAlloc::MIN_BLOCK`] bytes are not returned to the system on free
//! but parked in a small table (at most [`ReuseAlloc::SLOTS`] blocks and a byte limit,
//! [`ReuseAlloc::DEFAULT_LIMIT`] unless [`ReuseAlloc::set_limit`] says otherwise). An
//! allocation of exactly the same size and alignment takes a parked block back — training
//! steps repeat their sizes, so the hit rate in the steady state is close to 100%. When the
//! table is full or over its limit, the oldest parked blocks are freed. Everything else goes
//! straight to [`System`]. Blocks handed out come from `System` and may be passed to
//! `System::realloc` / `System::dealloc` unchanged.
//!
//! The cost: up to the limit of memory stays resident after a peak. `DTRAIN_ALLOC_CACHE_MB`
//! (read by the `dtrain` binary at start-up) changes the limit; `0` turns the reuse off,
//! and with it [`keep_freed_memory`], which the binary otherwise applies to glibc for the
//! smaller blocks.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// One parked block (`ptr == 0`: empty slot).
#[derive(Clone, Copy)]
struct Slot {
    ptr: usize,
    size: usize,
    align: usize,
    /// Insertion order; the smallest is evicted first.
    age: u64,
}

const EMPTY: Slot = Slot {
    ptr: 0,
    size: 0,
    align: 0,
    age: 0,
};

struct Table {
    slots: [Slot; ReuseAlloc::SLOTS],
    bytes: usize,
    clock: u64,
}

/// A [`GlobalAlloc`] that parks large freed blocks and hands them back to the next
/// allocation of the same layout (see the [module docs](self)). Install it with
/// `#[global_allocator] static A: ReuseAlloc = ReuseAlloc::new();`.
pub struct ReuseAlloc {
    table: Mutex<Table>,
    limit: AtomicUsize,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl Default for ReuseAlloc {
    fn default() -> Self {
        Self::new()
    }
}

impl ReuseAlloc {
    /// Smallest block that is parked instead of freed (1 MiB; smaller blocks are served well
    /// by the system allocator's own free lists).
    pub const MIN_BLOCK: usize = 1 << 20;
    /// Most blocks parked at once.
    pub const SLOTS: usize = 128;
    /// Default limit on parked bytes (2 GiB).
    pub const DEFAULT_LIMIT: usize = 2 << 30;

    /// An allocator with the default limit.
    pub const fn new() -> Self {
        ReuseAlloc {
            table: Mutex::new(Table {
                slots: [EMPTY; Self::SLOTS],
                bytes: 0,
                clock: 0,
            }),
            limit: AtomicUsize::new(Self::DEFAULT_LIMIT),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// Sets the most bytes kept parked; `0` turns parking off. Blocks already parked above the
    /// new limit are freed.
    pub fn set_limit(&self, bytes: usize) {
        self.limit.store(bytes, Ordering::Relaxed);
        let mut t = self.lock();
        evict_until(&mut t, 0, bytes);
    }

    /// The current limit on parked bytes.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Bytes parked now.
    pub fn parked_bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Large allocations served from a parked block, and those that went to the system,
    /// since start.
    pub fn hits_misses(&self) -> (u64, u64) {
        (
            self.hits.load(Ordering::Relaxed),
            self.misses.load(Ordering::Relaxed),
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        // Nothing panics while the lock is held; a poisoned table is still consistent.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A parked block of exactly `layout`, if any.
    fn take(&self, layout: Layout) -> Option<*mut u8> {
        if layout.size() < Self::MIN_BLOCK || self.limit() == 0 {
            return None;
        }
        let mut t = self.lock();
        let found = t
            .slots
            .iter()
            .position(|s| s.ptr != 0 && s.size == layout.size() && s.align == layout.align());
        match found {
            Some(i) => {
                let s = std::mem::replace(&mut t.slots[i], EMPTY);
                t.bytes -= s.size;
                self.hits.fetch_add(1, Ordering::Relaxed);
                Some(s.ptr as *mut u8)
            }
            None => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Parks `ptr` if it is large and fits; returns whether it was parked.
    fn park(&self, ptr: *mut u8, layout: Layout) -> bool {
        let limit = self.limit();
        if layout.size() < Self::MIN_BLOCK || layout.size() > limit {
            return false;
        }
        let mut t = self.lock();
        evict_until(&mut t, layout.size(), limit);
        let Some(i) = t.slots.iter().position(|s| s.ptr == 0) else {
            return false;
        };
        t.clock += 1;
        let age = t.clock;
        t.slots[i] = Slot {
            ptr: ptr as usize,
            size: layout.size(),
            align: layout.align(),
            age,
        };
        t.bytes += layout.size();
        true
    }
}

/// Frees the oldest parked blocks until `incoming` more bytes fit under `limit` and a slot is
/// free.
fn evict_until(t: &mut Table, incoming: usize, limit: usize) {
    loop {
        let full = t.slots.iter().all(|s| s.ptr != 0);
        if !full && t.bytes + incoming <= limit {
            return;
        }
        let Some(i) = t
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.ptr != 0)
            .min_by_key(|(_, s)| s.age)
            .map(|(i, _)| i)
        else {
            return;
        };
        let s = std::mem::replace(&mut t.slots[i], EMPTY);
        t.bytes -= s.size;
        // SAFETY: the block came from `System` with exactly this size and alignment and was
        // parked (not in use) until now.
        unsafe {
            System.dealloc(
                s.ptr as *mut u8,
                Layout::from_size_align_unchecked(s.size, s.align),
            )
        };
    }
}

/// Keeps glibc's own allocator from giving freed memory back to the kernel, for the blocks
/// [`ReuseAlloc`] does not park (under [`ReuseAlloc::MIN_BLOCK`], or of a size that changes
/// from step to step: FFT payloads as θ diminishes, received messages). glibc serves blocks
/// above its mmap threshold (128 KiB at start, raised as blocks are freed) by `mmap` and
/// returns them by `munmap`, and trims the top of its heaps above the trim threshold, so
/// such blocks pay a page fault per 4 KiB page every step: on `dtrain run
/// experiments/alexnet_fft.toml` the kernel's page clearing (`clear_page_erms`) was 20 % of
/// the samples of a profile of both workers, and none with this setting. It fixes the mmap
/// threshold at 32 MiB (glibc's largest) and the trim threshold at 1 GiB: what a step frees
/// below 32 MiB stays in the process for the next step. Returns whether glibc accepted both;
/// a no-op returning `false` where the C library is not glibc.
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; called before other threads
        // allocate (at start-up), and glibc serialises it with allocations regardless.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

// SAFETY: every block handed out is either a fresh `System` block or a parked `System` block
// of exactly the requested size and alignment, which nothing else references while parked.
unsafe impl GlobalAlloc for ReuseAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match self.take(layout) {
            Some(p) => p,
            // SAFETY: forwarded with the caller's (non-zero-size) layout.
            None => unsafe { System.alloc(layout) },
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match self.take(layout) {
            Some(p) => {
                // SAFETY: `p` is a live block of `layout.size()` bytes owned by the caller now.
                unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
                p
            }
            // SAFETY: forwarded with the caller's layout.
            None => unsafe { System.alloc_zeroed(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !self.park(ptr, layout) {
            // SAFETY: `ptr` is a `System` block of `layout` (see the impl's safety note).
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: every block is a `System` block of `layout`; the caller upholds the rest.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn big(n: usize) -> Layout {
        Layout::from_size_align(n, 64).unwrap()
    }

    #[test]
    fn glibc_takes_the_thresholds() {
        // Where the C library is glibc, both settings are accepted.
        assert_eq!(
            keep_freed_memory(),
            cfg!(all(target_os = "linux", target_env = "gnu"))
        );
    }

    #[test]
    fn a_freed_large_block_is_handed_back_for_the_same_layout_only() {
        let a = ReuseAlloc::new();
        unsafe {
            let p = a.alloc(big(3 << 20));
            p.write_bytes(7, 3 << 20);
            a.dealloc(p, big(3 << 20));
            assert_eq!(a.parked_bytes(), 3 << 20);
            // Another size misses and leaves the parked block alone.
            let q = a.alloc(big(2 << 20));
            assert_ne!(q, p);
            assert_eq!(a.parked_bytes(), 3 << 20);
            // The same layout gets it back.
            let r = a.alloc(big(3 << 20));
            assert_eq!(r, p);
            assert_eq!(a.parked_bytes(), 0);
            assert_eq!(a.hits_misses(), (1, 2)); // the first 3 MiB and the 2 MiB went to the system
            a.dealloc(q, big(2 << 20));
            a.dealloc(r, big(3 << 20));
            a.set_limit(0);
            assert_eq!(a.parked_bytes(), 0);
        }
    }

    #[test]
    fn zeroed_allocations_are_zero_even_when_reused() {
        let a = ReuseAlloc::new();
        let l = big(ReuseAlloc::MIN_BLOCK);
        unsafe {
            let p = a.alloc(l);
            p.write_bytes(0xAB, l.size());
            a.dealloc(p, l);
            let z = a.alloc_zeroed(l);
            assert_eq!(z, p);
            let s = std::slice::from_raw_parts(z, l.size());
            assert!(s.iter().all(|&b| b == 0));
            a.dealloc(z, l);
            a.set_limit(0);
        }
    }

    #[test]
    fn small_blocks_and_blocks_over_the_limit_are_not_parked() {
        let a = ReuseAlloc::new();
        a.set_limit(4 << 20);
        unsafe {
            let s = a.alloc(big(4096));
            a.dealloc(s, big(4096));
            assert_eq!(a.parked_bytes(), 0);
            let p = a.alloc(big(8 << 20));
            a.dealloc(p, big(8 << 20));
            assert_eq!(a.parked_bytes(), 0);
        }
    }

    #[test]
    fn the_limit_evicts_oldest_first_and_zero_turns_parking_off() {
        let a = ReuseAlloc::new();
        a.set_limit(5 << 20);
        unsafe {
            let p1 = a.alloc(big(2 << 20));
            let p2 = a.alloc(big(2 << 20));
            let p3 = a.alloc(big(2 << 20));
            a.dealloc(p1, big(2 << 20));
            a.dealloc(p2, big(2 << 20));
            assert_eq!(a.parked_bytes(), 4 << 20);
            // Parking p3 would exceed 5 MiB: p1 (oldest) is freed.
            a.dealloc(p3, big(2 << 20));
            assert_eq!(a.parked_bytes(), 4 << 20);
            let x = a.alloc(big(2 << 20));
            let y = a.alloc(big(2 << 20));
            assert!([p2, p3].contains(&x) && [p2, p3].contains(&y) && x != y);
            a.set_limit(0);
            a.dealloc(x, big(2 << 20));
            assert_eq!(a.parked_bytes(), 0);
            a.dealloc(y, big(2 << 20));
        }
    }

    #[test]
    fn the_slot_table_never_overflows() {
        let a = ReuseAlloc::new();
        let l = big(ReuseAlloc::MIN_BLOCK);
        unsafe {
            let ps: Vec<_> = (0..ReuseAlloc::SLOTS + 10).map(|_| a.alloc(l)).collect();
            for p in ps {
                a.dealloc(p, l);
            }
            assert_eq!(a.parked_bytes(), ReuseAlloc::SLOTS * l.size());
            a.set_limit(0);
            assert_eq!(a.parked_bytes(), 0);
        }
    }

    #[test]
    fn realloc_of_a_reused_block_keeps_its_contents() {
        let a = ReuseAlloc::new();
        let l = big(2 << 20);
        unsafe {
            let p = a.alloc(l);
            a.dealloc(p, l);
            let q = a.alloc(l);
            q.write_bytes(5, l.size());
            let r = a.realloc(q, l, 6 << 20);
            assert!(std::slice::from_raw_parts(r, 2 << 20)
                .iter()
                .all(|&b| b == 5));
            a.dealloc(r, big(6 << 20));
            a.set_limit(0);
        }
    }
}
