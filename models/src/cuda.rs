//! Opening a CUDA device (the `cuda` feature) with errors a user can act on.
//!
//! burn-cuda reaches the GPU through cudarc, which loads `libcuda.so.1` (the driver) and
//! `libnvrtc` (the run-time CUDA C++ compiler that builds dtrain's kernels) on first use and
//! panics, inside burn's device thread, when either is missing; the panic then surfaces as
//! an unrelated burn message. So everything a CUDA worker needs is checked here first, in
//! the order a user fixes it: the driver library, the driver's CUDA version, a GPU with that
//! index, NVRTC, and the CUDA headers NVRTC compiles against. Each failure names what to
//! install or set.

use burn::prelude::*;
use cudarc::driver::{result as driver, sys as driver_sys};

/// The CUDA API version cudarc's bindings were built for (`13000` is 13.0).
const API: i32 = driver_sys::CUDA_VERSION as i32;
// cubecl-cuda 0.11 needs CUDA 12 or newer; a CUDARC_CUDA_VERSION below that fails here.
const _: () = assert!(API >= 12_000, "CUDARC_CUDA_VERSION must be 12000 or newer");

fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// What is missing for CUDA device `index`, or `None` when everything is there.
pub fn missing(index: usize) -> Option<String> {
    // SAFETY: only loads the library to see that it exists (cudarc's own probe).
    if !unsafe { driver_sys::is_culib_present() } {
        return Some(
            "libcuda.so.1 not found (is the NVIDIA driver installed? searched LD_LIBRARY_PATH \
             and the system library folders)"
                .into(),
        );
    }
    let mut driver_version = 0;
    // SAFETY: one out-parameter, written by the driver.
    let got = unsafe { driver_sys::cuDriverGetVersion(&mut driver_version) };
    if got != driver_sys::CUresult::CUDA_SUCCESS {
        return Some(format!(
            "the NVIDIA driver does not report its version ({got:?})"
        ));
    }
    if driver_version < API {
        return Some(format!(
            "the NVIDIA driver supports CUDA {}, older than the CUDA {} this dtrain was built \
             for: update the driver, or rebuild dtrain with CUDARC_CUDA_VERSION={}{:02}0 set",
            version_text(driver_version),
            version_text(API),
            driver_version / 1000,
            (driver_version % 1000) / 10,
        ));
    }
    if let Err(e) = driver::init() {
        return Some(format!("the CUDA driver did not start: {e:?}"));
    }
    match driver::device::get_count() {
        Err(e) => return Some(format!("the CUDA driver lists no GPU: {e:?}")),
        Ok(0) => return Some("the CUDA driver sees no GPU on this machine".into()),
        Ok(n) if index >= n as usize => {
            return Some(format!(
                "GPU {index} does not exist: this machine has {n} (numbered from 0)"
            ))
        }
        Ok(_) => {}
    }
    // SAFETY: as for the driver library above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Some(format!(
            "libnvrtc.so.{major} not found: dtrain compiles its CUDA kernels at run time with \
             NVRTC; install the CUDA {major} NVRTC library (the CUDA toolkit, or the \
             nvidia-cuda-nvrtc wheel) and add its folder to LD_LIBRARY_PATH",
            major = API / 1000
        ));
    }
    match cubecl_cuda::install::cuda_path() {
        None => {
            return Some(
                "the CUDA headers were not found: NVRTC compiles dtrain's kernels against them; \
                 install the CUDA toolkit or set CUDA_PATH to the folder holding \
                 include/cuda_fp16.h (looked in CUDA_PATH, /usr/local/cuda, /opt/cuda, /usr)"
                    .into(),
            )
        }
        Some(p) if !p.join("include").join("cuda_fp16.h").exists() => {
            return Some(format!(
                "{}/include/cuda_fp16.h not found: NVRTC compiles dtrain's kernels against the \
                 CUDA headers; set CUDA_PATH to the CUDA toolkit's folder",
                p.display()
            ))
        }
        Some(_) => {}
    }
    None
}

/// Whether a file cubecl reads its configuration from (its own `cubecl.toml`, or a `[cubecl]`
/// section of `burn.toml`: the names cubecl lists) is in `dir` or a folder above it.
fn cubecl_config_above(dir: &std::path::Path) -> bool {
    use cubecl_runtime::config::{CubeClRuntimeConfig, RuntimeConfig};
    let sections = CubeClRuntimeConfig::section_file_names()
        .iter()
        .map(|(f, _)| f);
    let names: Vec<&str> = CubeClRuntimeConfig::file_names()
        .iter()
        .chain(sections)
        .copied()
        .collect();
    dir.ancestors()
        .any(|d| names.iter().any(|f| d.join(f).is_file()))
}

/// Turns on cubecl's persistent cache of compiled kernels, which is off by default.
///
/// Every kernel is CUDA C++ compiled by NVRTC on first use, one at a time: 1.5 to 8 minutes
/// per model on an H100 (README "GPUs"), again in every new process. With the cache on, a
/// process reads the kernels an earlier one compiled (a second run of a model started in
/// 0.5 to 7 s on the H100). The cache lives where cubecl keeps its autotune results: the
/// workspace's `target/environment` inside a Cargo workspace, the user cache folder
/// (`~/.cache/cubecl`) elsewhere. Left alone when a cubecl configuration file is in the
/// working directory or above it (its settings win, as cubecl's own loading would have it),
/// when `DTRAIN_KERNEL_CACHE=0`, or when cubecl's configuration was already read. Returns
/// whether it turned the cache on.
pub fn enable_kernel_cache() -> bool {
    use cubecl_runtime::config::{CubeClRuntimeConfig, RuntimeConfig};
    if std::env::var("DTRAIN_KERNEL_CACHE").is_ok_and(|v| v == "0") {
        return false;
    }
    if std::env::current_dir().is_ok_and(|d| cubecl_config_above(&d)) {
        return false;
    }
    // What cubecl would load by itself (its defaults, its environment variables), plus the
    // cache.
    let mut config = CubeClRuntimeConfig::default().override_from_env();
    config.compilation.cache = true;
    CubeClRuntimeConfig::try_set(config)
}

/// CUDA GPU `index` with autodiff, initialised with a one-element probe so that a failure
/// comes back as an error rather than a panic in the first training step.
pub fn cuda_device(index: usize) -> Result<Device, String> {
    if let Some(why) = missing(index) {
        return Err(why);
    }
    enable_kernel_cache();
    crate::probe::opened(
        Device::cuda(index).autodiff(),
        &format!("CUDA device {index}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cubecl_config_file_above_the_working_directory_is_found() {
        if cubecl_config_above(&std::env::temp_dir()) {
            return; // a configuration above the temporary folder would answer for every test
        }
        let root = std::env::temp_dir().join(format!("dtrain-cubecl-{}", std::process::id()));
        let deep = root.join("a/b");
        std::fs::create_dir_all(&deep).unwrap();
        assert!(!cubecl_config_above(&deep));
        std::fs::write(root.join("a/cubecl.toml"), "").unwrap();
        assert!(cubecl_config_above(&deep));
        assert!(!cubecl_config_above(&root));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_kernel_cache_is_turned_on_once() {
        use cubecl_runtime::config::{CubeClRuntimeConfig, RuntimeConfig};
        let here = std::env::current_dir().unwrap();
        if cubecl_config_above(&here) || std::env::var_os("DTRAIN_KERNEL_CACHE").is_some() {
            return;
        }
        // Nothing in this binary reads cubecl's configuration before a device opens, and no
        // other test opens one: this call sets it.
        assert!(enable_kernel_cache());
        assert!(CubeClRuntimeConfig::get().compilation.cache);
        // Set once per process: a second call changes nothing.
        assert!(!enable_kernel_cache());
    }

    #[test]
    fn kernels_compile_through_nvrtc_not_llvm() {
        // The stand-in cubecl-llvm refuses every kernel: the NVRTC back end must be the one
        // cubecl-cuda selects, or every GPU step would fail.
        assert_eq!(
            cubecl_cuda::compiler::CudaBackend::default(),
            cubecl_cuda::compiler::CudaBackend::Cpp
        );
    }

    #[test]
    fn a_machine_without_the_driver_gets_the_error_naming_it() {
        // SAFETY: as in `missing`.
        if unsafe { driver_sys::is_culib_present() } {
            // A GPU machine: the last index is refused by number, never by a panic.
            let e = cuda_device(1 << 20).unwrap_err();
            assert!(e.contains("does not exist") || e.contains("no GPU"), "{e}");
        } else {
            let e = cuda_device(0).unwrap_err();
            assert!(e.starts_with("libcuda.so.1 not found"), "{e}");
            assert!(e.contains("NVIDIA driver"), "{e}");
        }
    }

    #[test]
    fn versions_print_as_major_dot_minor() {
        assert_eq!(version_text(13000), "13.0");
        assert_eq!(version_text(12080), "12.8");
    }
}
