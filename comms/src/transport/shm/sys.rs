//! The system calls of the shared-memory driver, each behind a safe wrapper: shared
//! mappings, `posix_fallocate`, `statvfs`, process-shared futex waits and wakes, and peer liveness
//! (pidfd, or `kill(pid, 0)` where pidfds are unavailable).
//!
//! Every `unsafe` block of the driver is in this file.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::mem::{align_of, size_of};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// A shared, read-write mapping of a file, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value until drop; every access from
// several threads goes through atomics or through raw-pointer copies of ring bytes whose
// ownership the ring protocol (acquire/release on head and tail) hands from one side to
// the other, so sharing and sending the handle between threads is sound.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`.
unsafe impl Sync for Mapping {}

/// Types that may be viewed in shared memory: `repr(C)`, made of atomics only (so any bit
/// pattern, zeros included, is a valid value and every access is race-free), and `Sync`.
///
/// # Safety
/// Implementors must be `repr(C)` structs whose fields are all atomics (or arrays or
/// `repr(C)` structs of them), with no padding that is ever read.
pub(crate) unsafe trait Shared: Sync {}

impl Mapping {
    /// Maps `len` bytes of `file` from `offset` (a multiple of the page size), shared and
    /// read-write, with the page tables populated up front.
    pub(crate) fn map(file: &File, offset: usize, len: usize) -> io::Result<Mapping> {
        if len == 0 || !offset.is_multiple_of(page_size()) {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let off = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a fresh mapping chosen by the kernel (null hint) aliases no Rust object;
        // the file descriptor is valid for the duration of the call.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                file.as_raw_fd(),
                off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Mapping { ptr, len })
    }

    /// The first byte (for raw-pointer copies within `0..len`).
    pub(crate) fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The `T` at byte `offset`.
    ///
    /// # Panics
    /// If `T` does not fit at `offset` or would be misaligned there.
    pub(crate) fn at<T: Shared>(&self, offset: usize) -> &T {
        assert!(
            offset + size_of::<T>() <= self.len,
            "shared struct out of bounds"
        );
        let p = self.ptr.as_ptr().wrapping_add(offset);
        assert_eq!(p as usize % align_of::<T>(), 0, "misaligned shared struct");
        // SAFETY: in bounds and aligned (checked above); `T: Shared` is valid for any bit
        // pattern and only ever accessed through atomics, so a shared reference is sound
        // even while other processes write it; the mapping outlives the borrow of `self`.
        unsafe { &*p.cast::<T>() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is a mapping this value created and nobody borrows any
        // more (references from `at` borrow `self`).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// Copies `src` to `dst` (raw shared memory).
///
/// # Safety
/// `dst..dst+src.len()` must lie in a live mapping and belong to the caller under the ring
/// protocol (no other party reads or writes it during the copy).
pub(crate) unsafe fn copy_to_shared(src: &[u8], dst: *mut u8) {
    // SAFETY: the caller guarantees the destination; `src` is a valid slice and cannot
    // overlap shared ring memory (it is process-private).
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
}

/// Copies shared memory at `src` into `dst`.
///
/// # Safety
/// `src..src+dst.len()` must lie in a live mapping and hold bytes published to the caller
/// under the ring protocol (the producer does not write them during the copy).
pub(crate) unsafe fn copy_from_shared(src: *const u8, dst: &mut [u8]) {
    // SAFETY: the caller guarantees the source; `dst` is a valid, private slice.
    unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
}

/// The system page size.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

/// Reserves `len` bytes of backing store for `file` (on tmpfs: the pages), so that running
/// out of space fails here with `ENOSPC` instead of a `SIGBUS` on first touch.
pub(crate) fn allocate(file: &File, len: usize) -> io::Result<()> {
    let len =
        libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: no memory is passed; the descriptor is valid for the call.
    let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Available bytes of the file system holding `dir` (`statvfs`).
pub(crate) fn free_bytes(dir: &Path) -> io::Result<u64> {
    let c = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: an all-zero statvfs is a valid value of the plain C struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-pointer for the call.
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// The effective user id of this process.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Sleeps while `*word == expected`, for at most `timeout` (process-shared futex; returns
/// early on a wake, a signal or a changed word).
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call (the borrow keeps
    // its mapping alive) and `ts` a valid timespec; FUTEX_WAIT only reads them.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every waiter sleeping on `word` (in any process).
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call; FUTEX_WAKE does
    // not access it beyond identifying the futex.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// A peer process, watched for exit: through a pidfd (readable once the process has
/// exited, zombies included, and immune to pid reuse) where the kernel offers one, else
/// `kill(pid, 0)`. This process itself (ranks as threads) is always alive.
#[derive(Debug)]
pub(crate) struct Process {
    pid: u32,
    fd: Option<OwnedFd>,
    me: bool,
}

impl Process {
    /// Watches `pid` (0 = unknown: always reported alive).
    pub(crate) fn new(pid: u32) -> Process {
        let me = pid == 0 || pid == std::process::id();
        let fd = if me { None } else { pidfd_open(pid) };
        Process { pid, fd, me }
    }

    /// Whether the process still runs.
    pub(crate) fn is_alive(&self) -> bool {
        if self.me {
            return true;
        }
        if let Some(fd) = &self.fd {
            let mut p = libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, zero timeout.
            let r = unsafe { libc::poll(&mut p, 1, 0) };
            return r <= 0;
        }
        let Ok(pid) = libc::pid_t::try_from(self.pid) else {
            return true;
        };
        // SAFETY: signal 0 only checks for existence; no memory is involved.
        let r = unsafe { libc::kill(pid, 0) };
        r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
    }
}

fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes no pointers.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0u32) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the kernel just returned this descriptor; nobody else owns it.
    Some(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::time::Instant;

    #[test]
    fn futex_wait_times_out_and_skips_a_changed_word() {
        let w = AtomicU32::new(5);
        let t = Instant::now();
        futex_wait(&w, 4, Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(1), "word differed");
        futex_wait(&w, 5, Duration::from_millis(20));
        assert!(t.elapsed() >= Duration::from_millis(15));
        w.store(6, Ordering::SeqCst);
        futex_wake(&w);
    }

    #[test]
    fn free_bytes_of_a_directory_and_of_a_missing_one() {
        assert!(free_bytes(Path::new("/tmp")).expect("statvfs /tmp") > 0);
        assert!(free_bytes(Path::new("/nonexistent/dtrain")).is_err());
        assert!(free_bytes(Path::new("nul\0in path")).is_err());
    }

    #[test]
    fn own_process_and_exited_child() {
        assert!(Process::new(std::process::id()).is_alive());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let p = Process::new(child.id());
        // Reaped or not, the exit is seen.
        let t = Instant::now();
        while p.is_alive() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!p.is_alive());
        child.wait().unwrap();
    }
}
