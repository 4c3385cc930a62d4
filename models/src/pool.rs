//! Running a model's passes on rayon's pool instead of handing it every operation.
//!
//! Every parallel operation of the `Flex` backend and of this crate's kernels
//! ([`crate::gemm_conv`], [`crate::batch_norm`]) is a rayon call. Made from a thread outside
//! rayon's pool (the trainer's, the benchmark's), each one injects a job into the pool, wakes
//! a pool thread through a futex and puts the calling thread to sleep until the job is done:
//! two context switches per operation, hundreds of operations per step. With one rayon thread
//! (the setting when several workers share the cores) that is all they do. A sampling profile
//! of ResNet-20's step at one thread put 10 % of the time in `futex_wake` alone
//! (`perf record` on `dtrain bench models --models resnet/resnet20`). Called from a pool
//! thread, the same operations run in place (one thread) or split with work stealing
//! (several), as PyTorch's OpenMP regions run on the calling thread.
//!
//! [`on_pool`] moves a whole pass — a forward, a backward, an evaluation — onto the pool:
//! one hand-off per pass instead of one per operation. Results are the same bits: what runs
//! where does not change the order of any sum (the kernels' partitions are fixed by their
//! sizes, not by the thread that runs them). [`on_pool_for`] does it for `Flex` devices only.

use burn::prelude::Device;

/// [`on_pool`] for a pass on `device` when that is burn's `Flex` CPU backend (with autodiff
/// or without), else `f()` in place: a GPU backend does not compute on rayon's pool, and
/// cubecl queues each thread's work on a stream of that thread's own.
pub fn on_pool_for<R: Send>(device: &Device, f: impl FnOnce() -> R + Send) -> R {
    // Device equality is the hardware's: autodiff does not count.
    if *device == Device::flex() {
        on_pool(f)
    } else {
        f()
    }
}

/// Runs `f` on a thread of rayon's global pool and returns what it returns; in place when
/// the caller already is one. A panic in `f` resumes in the caller.
///
/// # Examples
///
/// ```
/// let inside = dtrain_models::pool::on_pool(|| rayon::current_thread_index().is_some());
/// assert!(inside);
/// ```
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_on_the_pool_in_place_when_nested_and_returns_the_result() {
        assert!(rayon::current_thread_index().is_none());
        let (index, nested) = on_pool(|| {
            let here = rayon::current_thread_index();
            (here, on_pool(rayon::current_thread_index))
        });
        assert!(index.is_some());
        assert_eq!(index, nested, "a nested call runs on the same thread");
        let mut v = vec![1, 2, 3];
        on_pool(|| v.push(4));
        assert_eq!(v, [1, 2, 3, 4]);
    }

    #[test]
    fn only_flex_passes_go_to_the_pool() {
        let on = |d: &Device| on_pool_for(d, || rayon::current_thread_index().is_some());
        assert!(on(&Device::flex()));
        assert!(on(&Device::flex().autodiff()));
        // Comparing devices touches no GPU: this runs on a machine without one too.
        #[cfg(feature = "cuda")]
        assert!(!on(&Device::cuda(0).autodiff()));
        #[cfg(feature = "wgpu")]
        assert!(!on(&Device::wgpu(burn::tensor::DeviceKind::Cpu).autodiff()));
    }

    #[test]
    fn a_panic_reaches_the_caller() {
        let r = std::panic::catch_unwind(|| on_pool(|| panic!("inside the pool")));
        let msg = r.unwrap_err();
        assert_eq!(msg.downcast_ref::<&str>(), Some(&"inside the pool"));
    }
}
