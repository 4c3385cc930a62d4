//! Training on a GPU that wgpu reaches (opening one needs the `wgpu` feature): burn's wgpu backend on Vulkan,
//! Metal or DX12 — AMD, Intel and Apple GPUs as well as NVIDIA's — or, without a GPU, on a
//! software adapter such as Mesa's lavapipe (how CI runs the GPU code paths).
//!
//! The adapters are named as dtrain's device codecs name them (`dtrain-device`'s
//! `DeviceSpec`), so a worker that trains on `wgpu:cpu` and encodes on `wgpu:cpu` uses one
//! device: cubecl keeps one client per device, and burn's tensors and the codecs' buffers
//! live in the same memory.

use std::fmt;
use std::str::FromStr;

#[cfg(feature = "wgpu")]
use burn::prelude::*;

/// Which wgpu adapter: `wgpu` (the best one wgpu finds; `CUBECL_WGPU_DEFAULT_DEVICE`
/// overrides it), `wgpu:N` (the N-th discrete GPU) or `wgpu:cpu` (a software adapter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Adapter {
    /// The best adapter wgpu finds.
    #[default]
    Default,
    /// The N-th discrete GPU.
    Discrete(usize),
    /// A software adapter (lavapipe, llvmpipe, WARP).
    Cpu,
}

impl FromStr for Adapter {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("unknown wgpu adapter {s:?} (wgpu, wgpu:N, wgpu:cpu)");
        match s {
            "wgpu" => Ok(Adapter::Default),
            "wgpu:cpu" => Ok(Adapter::Cpu),
            _ => {
                let n = s.strip_prefix("wgpu:").ok_or_else(bad)?;
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                n.parse().map(Adapter::Discrete).map_err(|_| bad())
            }
        }
    }
}

impl fmt::Display for Adapter {
    /// The form [`Adapter::from_str`] reads.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Adapter::Default => f.write_str("wgpu"),
            Adapter::Discrete(i) => write!(f, "wgpu:{i}"),
            Adapter::Cpu => f.write_str("wgpu:cpu"),
        }
    }
}

/// The adapter with autodiff (the `wgpu` feature), opened with a one-element probe so that a missing adapter or
/// driver comes back as an error naming it rather than a panic in the first step.
#[cfg(feature = "wgpu")]
pub fn wgpu_device(adapter: Adapter) -> Result<Device, String> {
    let kind = match adapter {
        Adapter::Default => DeviceKind::DefaultDevice,
        Adapter::Discrete(i) => DeviceKind::DiscreteGpu(i),
        Adapter::Cpu => DeviceKind::Cpu,
    };
    crate::probe::opened(Device::wgpu(kind).autodiff(), &format!("{adapter}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapters_round_trip_and_bad_ones_name_themselves() {
        for s in ["wgpu", "wgpu:cpu", "wgpu:0", "wgpu:3"] {
            assert_eq!(s.parse::<Adapter>().unwrap().to_string(), s);
        }
        for s in ["", "wgpu:", "wgpu:x", "wgpu:+1", "gpu", "cuda:0"] {
            let e = s.parse::<Adapter>().unwrap_err();
            assert!(e.contains(&format!("{s:?}")), "{e}");
        }
    }
}
