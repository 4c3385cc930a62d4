//! Runtime dispatch of hot loops to wider vector units.
//!
//! The crate is built for the baseline x86-64 target (SSE2), so that one binary runs on any
//! x86-64 machine. A loop wrapped in [`avx2_dispatch!`] is compiled twice, once as is and
//! once with AVX2 enabled, and the CPU picks (`is_x86_feature_detected!`, which std caches
//! after the first call). Both copies are the same source and Rust never contracts or
//! reorders floating-point operations, so they compute the same bits; only the width of
//! the vector instructions differs. Off x86-64 the macro is the plain function.

/// Defines `fn $name(args) -> R` running `$body(args)` (an `#[inline(always)]` function, so
/// that it is compiled into each copy) with AVX2 when the CPU has it.
macro_rules! avx2_dispatch {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                unsafe fn wide($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU executes AVX2, checked on the line above.
                    return unsafe { wide($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

pub(crate) use avx2_dispatch;
