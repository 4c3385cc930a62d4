//! Runtime dispatch of hot loops to wider vector units.
//!
//! The crate is built for the baseline x86-64 target (SSE2), so that one binary runs on any
//! x86-64 machine. A loop wrapped in [`vector_dispatch!`] is compiled three times: as is,
//! with AVX2 enabled, and with AVX-512 (F, BW, DQ, VL) enabled; the CPU picks the widest it
//! executes (`is_x86_feature_detected!`, which std caches after the first call). The copies
//! are the same source and Rust never contracts or reorders floating-point operations, so
//! they compute the same bits; only the width of the vector instructions differs. Off
//! x86-64 the macro is the plain function.

#[cfg(test)]
thread_local! {
    /// The widest tier the dispatch may pick on this thread (tests: [`each_tier`]).
    static LIMIT: std::cell::Cell<u8> = const { std::cell::Cell::new(2) };
}

/// Whether the dispatch may use tier `tier` (1: AVX2, 2: AVX-512). Always, outside the
/// crate's tests, which narrow it to hold every copy to the same bits ([`each_tier`]).
#[inline(always)]
pub(crate) fn allows(tier: u8) -> bool {
    #[cfg(test)]
    let limit = LIMIT.with(std::cell::Cell::get);
    #[cfg(not(test))]
    let limit = u8::MAX;
    tier <= limit
}

/// `f()` with the dispatch limited to baseline x86-64, then AVX2, then AVX-512 (each as
/// far as the CPU goes): the results, narrowest first.
#[cfg(test)]
pub(crate) fn each_tier<R>(mut f: impl FnMut() -> R) -> Vec<R> {
    (0..=2)
        .map(|tier| {
            LIMIT.with(|l| l.set(tier));
            let r = f();
            LIMIT.with(|l| l.set(2));
            r
        })
        .collect()
}

/// Asserts that `f()` gives the same result on every tier ([`each_tier`]).
#[cfg(test)]
pub(crate) fn assert_same_on_every_tier<R: PartialEq + std::fmt::Debug>(
    what: &str,
    f: impl FnMut() -> R,
) {
    let all = each_tier(f);
    for (tier, r) in all.iter().enumerate().skip(1) {
        assert_eq!(r, &all[0], "{what}: tier {tier} against the baseline copy");
    }
}

/// Whether the CPU executes the AVX-512 subsets the wide copies are compiled for (F, BW,
/// DQ, VL: every AVX-512 CPU since Skylake-SP and Zen 4).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

/// The widest vector units a hand-written kernel may use: what the CPU executes, within
/// the tests' limit ([`allows`]).
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tier {
    /// Baseline x86-64.
    Sse2,
    /// AVX2.
    Avx2,
    /// AVX-512 F, BW, DQ and VL ([`has_avx512`]).
    Avx512,
}

/// The [`Tier`] dispatched code runs at on this CPU (std caches the detection). AVX-512
/// is named only with AVX2 beside it (every such CPU has both), so a kernel may fall back
/// from the one to the other.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn widest() -> Tier {
    let avx2 = || std::arch::is_x86_feature_detected!("avx2");
    if allows(2) && has_avx512() && avx2() {
        Tier::Avx512
    } else if allows(1) && avx2() {
        Tier::Avx2
    } else {
        Tier::Sse2
    }
}

/// Defines `fn $name(args) -> R` running `$body(args)` (an `#[inline(always)]` function, so
/// that it is compiled into each copy) with AVX-512 or AVX2 when the CPU has it. A leading
/// `avx2_only;` leaves the AVX-512 copy out, for a loop that measured slower with it.
macro_rules! vector_dispatch {
    (avx2_only; $($f:tt)*) => {
        $crate::simd::vector_dispatch!(@emit false; $($f)*);
    };
    (@emit $avx512:literal; $(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
                unsafe fn widest($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                unsafe fn wide($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                match $crate::simd::widest() {
                    // SAFETY: `widest` names AVX-512 only when the CPU executes these
                    // subsets.
                    $crate::simd::Tier::Avx512 if $avx512 => return unsafe { widest($($arg),*) },
                    // SAFETY: `widest` names AVX-512 only with AVX2 beside it.
                    $crate::simd::Tier::Avx512 | $crate::simd::Tier::Avx2 => {
                        return unsafe { wide($($arg),*) }
                    }
                    $crate::simd::Tier::Sse2 => {}
                }
            }
            $body($($arg),*)
        }
    };
    ($($f:tt)*) => {
        $crate::simd::vector_dispatch!(@emit true; $($f)*);
    };
}

pub(crate) use vector_dispatch;

vector_dispatch! {
    /// The largest magnitude of `x` as bits (each value's bits with the sign cleared; 0 for
    /// an empty `x`). For finite values the order of the bits is the order of the
    /// magnitudes, and a NaN's bits are above an infinity's, which are above every finite
    /// value's. TernGrad's scaler, range-float's Emax and FFT's pre-scaling read it.
    pub(crate) fn max_magnitude_bits(x: &[f32]) -> u32 = max_magnitude_bits_lanes;
}

#[inline(always)]
fn max_magnitude_bits_lanes(x: &[f32]) -> u32 {
    let mut m = [0u32; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for k in 0..8 {
            m[k] = m[k].max(c[k].to_bits() & 0x7FFF_FFFF);
        }
    }
    let rest = it.remainder().iter();
    let r = rest.fold(0u32, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF));
    m.iter().fold(r, |r, &v| r.max(v))
}
