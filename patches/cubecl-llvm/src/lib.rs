//! dtrain's offline stand-in for `cubecl-llvm` 0.11.3.
//!
//! `cubecl-cuda` 0.11.3 depends on `cubecl-llvm` (feature `nvptx`) unconditionally, and the
//! real crate's build script downloads an LLVM bundle, so a CUDA build of dtrain could not be
//! made offline. `cubecl-cuda` has two kernel back ends, CUDA C++ through NVRTC (its `cpp`
//! feature, which dtrain turns on) and LLVM; with `cpp` on, the LLVM one is named in its code
//! but never selected. This crate provides exactly the names `cubecl-cuda` uses:
//!
//! * [`nvptx::ptx_version::PtxVersion`]: the newest PTX ISA version a CUDA driver loads,
//!   from NVIDIA's published table (used by `cubecl-cuda` for its kernel-cache namespace);
//! * [`shared::lowered_features`]: narrowing a device's advertised features to what the
//!   LLVM back end lowers. Here that back end lowers nothing, so the matrix-multiply
//!   features are withdrawn;
//! * [`PlironCompiler`] and its options, artifact and module types, whose `compile` returns
//!   an error naming the cause instead of emitting PTX.
//!
//! Written for dtrain from the interface `cubecl-cuda` 0.11.3 calls; no code of the real
//! crate is in it. README.md beside this file says what to do at the next burn upgrade.

use core::fmt;

use cubecl_environment::backtrace::BackTrace;
use cubecl_runtime::compiler::{CompilationError, Compiler};
use cubecl_runtime::kernel::{BufferIOAttr, KernelDefinition};

/// The sentence every refusal of this crate carries.
pub const NO_LLVM: &str = "this build has no LLVM kernel back end (dtrain replaces cubecl-llvm \
    with an offline stand-in); CUDA kernels compile through NVRTC, which needs cubecl-cuda's \
    `cpp` feature: build dtrain with `--features cuda`, which turns it on";

/// NVIDIA PTX items.
pub mod nvptx {
    /// The PTX ISA version a driver loads.
    pub mod ptx_version {
        use core::fmt;

        /// A PTX ISA version, major × 10 + minor (ISA 8.7 is `87`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct PtxVersion(u32);

        /// `(first CUDA driver version, PTX ISA)`, newest first: the PTX ISA version each CUDA
        /// release introduced, from NVIDIA's PTX ISA release notes. A driver loads the PTX of
        /// its own release and every older one.
        const FIRST_DRIVER: &[(i32, u32)] = &[
            (13_010, 91),
            (13_000, 90),
            (12_090, 88),
            (12_080, 87),
            (12_070, 86),
            (12_050, 85),
            (12_040, 84),
            (12_030, 83),
            (12_020, 82),
            (12_010, 81),
            (12_000, 80),
            (11_080, 78),
            (11_070, 77),
            (11_060, 76),
            (11_050, 75),
            (11_040, 74),
            (11_030, 73),
            (11_020, 72),
            (11_010, 71),
            (11_000, 70),
            (10_020, 65),
            (10_010, 64),
            (10_000, 63),
        ];

        impl PtxVersion {
            /// The newest PTX ISA a driver of CUDA version `driver` loads, in
            /// `cuDriverGetVersion`'s encoding (CUDA 12.8 is `12080`); `None` before CUDA 10.0.
            /// A driver newer than the table gets the newest entry.
            pub fn for_driver(driver: i32) -> Option<Self> {
                FIRST_DRIVER
                    .iter()
                    .find(|&&(first, _)| driver >= first)
                    .map(|&(_, isa)| PtxVersion(isa))
            }

            /// Major × 10 + minor.
            pub fn number(self) -> u32 {
                self.0
            }
        }

        /// As the NVPTX target feature names it: `ptx87`.
        impl fmt::Display for PtxVersion {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "ptx{}", self.0)
            }
        }

        #[cfg(test)]
        mod tests {
            use super::*;

            #[test]
            fn follows_the_driver() {
                assert_eq!(PtxVersion::for_driver(9_020), None);
                assert_eq!(PtxVersion::for_driver(10_000).unwrap().number(), 63);
                assert_eq!(PtxVersion::for_driver(12_060).unwrap().number(), 85);
                assert_eq!(PtxVersion::for_driver(12_080).unwrap().number(), 87);
                assert_eq!(PtxVersion::for_driver(13_000).unwrap().to_string(), "ptx90");
                assert_eq!(PtxVersion::for_driver(99_000).unwrap().number(), 91);
                // Newest first and strictly decreasing, or `find` picks the wrong row.
                assert!(FIRST_DRIVER
                    .windows(2)
                    .all(|w| w[0].0 > w[1].0 && w[0].1 > w[1].1));
            }
        }
    }
}

/// Items shared by the LLVM targets.
pub mod shared {
    /// What the LLVM back end can lower, per GPU target.
    pub mod lowered_features {
        use cubecl_core::ir::DeviceProperties;

        /// A GPU target of the LLVM back end.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum GpuTarget {
            /// NVIDIA PTX.
            Nvptx,
        }

        /// Narrows `props` to what the LLVM back end lowers for `target`. Without LLVM it
        /// lowers nothing, so no matrix-multiply instruction form (cmma, mma, scaled mma,
        /// cube mma) is advertised: a kernel that would need one takes the generic path.
        /// `cubecl-cuda` calls this only when LLVM is its selected back end.
        pub fn restrict_features(props: &mut DeviceProperties, target: GpuTarget) {
            match target {
                GpuTarget::Nvptx => props.features.matmul = Default::default(),
            }
        }
    }
}

/// The LLVM target a [`PlironCompiler`] emits for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LlvmTarget {
    /// The host CPU.
    #[default]
    Cpu,
    /// NVIDIA PTX.
    Nvptx,
}

/// An AMD GPU architecture (`gfx…`); carried in [`PlironOptions`] for the interface only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GfxArch(pub u32);

/// Options of a [`PlironCompiler`] compilation, as `cubecl-cuda` fills them.
#[derive(Clone, Debug, Default)]
pub struct PlironOptions {
    /// AMD GPU architecture, `None` for other targets.
    pub arch: Option<GfxArch>,
    /// NVIDIA architecture, `None` for other targets.
    pub sm_arch: Option<cubecl_core::ir::nvidia::SmArch>,
    /// PTX ISA version to emit.
    pub ptx_version: Option<nvptx::ptx_version::PtxVersion>,
    /// Scalars and static metadata in the kernel parameter block.
    pub grid_constants: bool,
}

/// A compiled PTX module, as `cubecl-cuda` loads it.
#[derive(Clone, Debug)]
pub struct NvptxModule {
    /// NUL-terminated PTX text.
    pub ptx: Vec<core::ffi::c_char>,
    /// Kernel entry point symbol.
    pub entrypoint: String,
    /// Intermediate representation, for logs.
    pub ir: String,
    /// Dynamic shared memory per launch, bytes.
    pub shared_memory_size: usize,
    /// How the kernel uses each buffer binding, in binding order.
    pub io: Vec<BufferIOAttr>,
}

/// What a [`PlironCompiler`] produces.
#[derive(Clone, Debug)]
pub enum PlironArtifact {
    /// A PTX module.
    NvptxCode(NvptxModule),
}

impl fmt::Display for PlironArtifact {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlironArtifact::NvptxCode(module) => f.write_str(&module.ir),
        }
    }
}

/// The LLVM kernel compiler's name and target; every compilation is refused with
/// [`NO_LLVM`].
#[derive(Clone, Debug, Default)]
pub struct PlironCompiler {
    /// The target it would emit for.
    pub target: LlvmTarget,
}

impl Compiler for PlironCompiler {
    type Representation = PlironArtifact;
    type CompilationOptions = PlironOptions;

    fn compile(
        &mut self,
        _kernel: KernelDefinition,
        _options: &PlironOptions,
    ) -> Result<PlironArtifact, CompilationError> {
        Err(CompilationError::Generic {
            reason: NO_LLVM.to_string(),
            backtrace: BackTrace::capture(),
        })
    }

    fn extension(&self) -> &'static str {
        "ll"
    }

    fn lang_tag(&self) -> &'static str {
        match self.target {
            LlvmTarget::Cpu => "mlir",
            LlvmTarget::Nvptx => "llvm",
        }
    }
}
