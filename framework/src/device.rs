//! Where a worker computes: `[cluster] device`.
//!
//! * `"cpu"` (default): burn's `flex` CPU backend with autodiff.
//! * `"cuda"`: a CUDA GPU per worker, the one numbered by the worker's rank on its node
//!   (the usual one-process-per-GPU layout: `cluster.workers` = GPUs per node × nodes).
//! * `"cuda:N"`: every worker of this node on GPU `N`.
//! * `"wgpu"`, `"wgpu:N"`, `"wgpu:cpu"`: burn's wgpu backend on the best adapter wgpu finds,
//!   the N-th discrete GPU, or a software adapter (Mesa's lavapipe: how CI trains on the
//!   GPU code paths without a GPU). Every worker of the node on that adapter. Needs a
//!   `dtrain` built with the `wgpu-train` feature.
//!
//! CUDA needs a `dtrain` built with the `cuda` feature
//! (`cargo build --release -p dtrain-cli --features cuda`, offline, no CUDA toolkit needed to
//! build). A build without it refuses the setting at validation, naming the field, before
//! anything runs. At run time a CUDA worker needs the NVIDIA driver, NVRTC and the CUDA
//! headers; `dtrain run` checks them for every GPU of its node ([`check_available`]) before
//! it starts a worker, and says what is missing.
//!
//! A worker's rank on its node comes from [`LOCAL_RANK_ENV`] (set by `dtrain run` for the
//! workers it starts), Open MPI's `OMPI_COMM_WORLD_LOCAL_RANK` or Slurm's `SLURM_LOCALID`,
//! in that order; a process with none of them counts as alone on its node (its global rank).

use std::fmt;
use std::str::FromStr;

use dtrain_models::wgpu::Adapter;
use dtrain_models::Device;
use serde::{Deserialize, Serialize};

/// Environment variable carrying a worker's rank on its node (set by the launcher).
pub const LOCAL_RANK_ENV: &str = "DTRAIN_LOCAL_RANK";

/// Whether this build can place workers on CUDA GPUs (the `cuda` feature).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Whether this build can train on wgpu adapters (the `wgpu-train` feature).
pub const WGPU_TRAIN_BUILT: bool = cfg!(feature = "wgpu-train");

/// The error for `cluster.device = "wgpu…"` in a build without the `wgpu-train` feature.
pub const NO_WGPU_TRAIN: &str = "this dtrain was built without burn's wgpu backend; rebuild \
     it with `cargo build --release -p dtrain-cli --features wgpu-train` (builds offline; to \
     run, it needs a Vulkan, Metal or DX12 driver — Mesa's lavapipe without a GPU)";

/// The error for `cluster.device = "cuda…"` in a build without the `cuda` feature.
pub const NO_CUDA: &str = "this dtrain was built without CUDA support; rebuild it with \
     `cargo build --release -p dtrain-cli --features cuda` (builds offline; to run, it needs \
     the NVIDIA driver, NVRTC and the CUDA headers)";

/// `[cluster] device` (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceKind {
    /// burn's `flex` CPU backend (default).
    #[default]
    Cpu,
    /// A CUDA GPU: `None` = the worker's rank on its node, `Some(n)` = GPU `n`.
    Cuda(Option<usize>),
    /// A wgpu adapter (burn's wgpu backend), the same for every worker of the node.
    Wgpu(Adapter),
}

impl DeviceKind {
    /// The CUDA GPU ordinal a worker with rank `local_rank` on its node uses (`None` off
    /// CUDA).
    pub fn gpu_index(self, local_rank: usize) -> Option<usize> {
        match self {
            DeviceKind::Cpu | DeviceKind::Wgpu(_) => None,
            DeviceKind::Cuda(pinned) => Some(pinned.unwrap_or(local_rank)),
        }
    }
}

impl FromStr for DeviceKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("unknown device {s:?} (cpu, cuda, cuda:N, wgpu, wgpu:N, wgpu:cpu)");
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda(None)),
            _ if s == "wgpu" || s.starts_with("wgpu:") => {
                s.parse().map(DeviceKind::Wgpu).map_err(|_| bad())
            }
            _ => {
                let n = s.strip_prefix("cuda:").ok_or_else(bad)?;
                // Only plain decimal ordinals: "cuda:+1" or "cuda: 1" are typos.
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                n.parse()
                    .map(|i| DeviceKind::Cuda(Some(i)))
                    .map_err(|_| bad())
            }
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceKind::Cpu => f.write_str("cpu"),
            DeviceKind::Cuda(None) => f.write_str("cuda"),
            DeviceKind::Cuda(Some(n)) => write!(f, "cuda:{n}"),
            DeviceKind::Wgpu(a) => write!(f, "{a}"),
        }
    }
}

impl TryFrom<String> for DeviceKind {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<DeviceKind> for String {
    fn from(d: DeviceKind) -> String {
        d.to_string()
    }
}

/// `[compress] device`: where the compressed buckets are encoded (ARCHITECTURE.md §10;
/// `exchange::device`).
///
/// * `"host"` (default): the CPU codecs.
/// * `"auto"`: the worker's own GPU when it trains on one and this build has its device
///   codecs (`cluster.device = "cuda…"` in a build with `cuda`, `"wgpu…"` in a build with
///   `wgpu-train`); the host otherwise.
/// * `"wgpu"`, `"wgpu:N"`, `"wgpu:cpu"`, `"cuda:N"`: that device, whatever the worker trains
///   on (a CPU worker with a GPU for its codecs; `wgpu:cpu` is Mesa's lavapipe, how CI runs
///   the device path without a GPU).
///
/// The default stays the host until a GPU run has measured the device path against it (the
/// gradient still reaches the device through the host: issue #51).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CodecDevice {
    /// The CPU codecs.
    #[default]
    Host,
    /// The worker's own GPU where there are device codecs for it.
    Auto,
    /// The named device (`wgpu`, `wgpu:N`, `wgpu:cpu`, `cuda:N`).
    Named(String),
}

/// The device codec runtimes of this build (the `wgpu` and `cuda` features).
pub const CODEC_RUNTIMES: [(&str, bool); 2] = [
    ("wgpu", cfg!(feature = "wgpu")),
    ("cuda", cfg!(feature = "cuda")),
];

impl FromStr for CodecDevice {
    type Err = String;

    /// Reads the setting; refuses a device whose runtime this build lacks, saying how to
    /// build it.
    fn from_str(s: &str) -> Result<Self, String> {
        let forms = "host, auto, wgpu, wgpu:N, wgpu:cpu, cuda, cuda:N";
        match s {
            "host" => return Ok(CodecDevice::Host),
            "auto" => return Ok(CodecDevice::Auto),
            _ => {}
        }
        let (name, arg) = s.split_once(':').map_or((s, None), |(n, a)| (n, Some(a)));
        let arg_ok = match (name, arg) {
            (_, None) => true,
            ("wgpu", Some("cpu")) => true,
            (_, Some(a)) => !a.is_empty() && a.bytes().all(|b| b.is_ascii_digit()),
        };
        let Some(&(_, built)) = CODEC_RUNTIMES.iter().find(|(n, _)| *n == name) else {
            return Err(format!("unknown device {s:?} ({forms})"));
        };
        if !arg_ok {
            return Err(format!("unknown device {s:?} ({forms})"));
        }
        if !built {
            return Err(format!(
                "this dtrain was built without the {name} device codecs; rebuild it with \
                 `cargo build --release -p dtrain-cli --features {name}`"
            ));
        }
        Ok(CodecDevice::Named(s.to_string()))
    }
}

impl fmt::Display for CodecDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CodecDevice::Host => f.write_str("host"),
            CodecDevice::Auto => f.write_str("auto"),
            CodecDevice::Named(s) => f.write_str(s),
        }
    }
}

impl CodecDevice {
    /// The device a worker training on `worker` (its rank on its node `local_rank`) encodes
    /// on, as a `dtrain_device::DeviceSpec` string; `None`: the host.
    pub fn resolve(&self, worker: DeviceKind, local_rank: usize) -> Option<String> {
        match self {
            CodecDevice::Host => None,
            CodecDevice::Named(s) if s == "cuda" => Some(format!(
                "cuda:{}",
                worker.gpu_index(local_rank).unwrap_or(local_rank)
            )),
            CodecDevice::Named(s) => Some(s.clone()),
            CodecDevice::Auto => match worker {
                DeviceKind::Wgpu(a) => Some(a.to_string()),
                _ => match worker.gpu_index(local_rank) {
                    Some(i) if CUDA_BUILT => Some(format!("cuda:{i}")),
                    _ => None,
                },
            },
        }
    }
}

/// This process's rank on its node (see the [module docs](self)); `rank` when no launcher
/// or scheduler said.
pub fn local_rank(rank: usize) -> usize {
    local_rank_from(rank, |k| std::env::var(k).ok())
}

fn local_rank_from(rank: usize, var: impl Fn(&str) -> Option<String>) -> usize {
    [
        LOCAL_RANK_ENV,
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|k| var(k).and_then(|v| v.trim().parse().ok()))
    .unwrap_or(rank)
}

/// The device codecs' handle on the GPU a worker's model is on (`model`, which `spec`
/// names too), over burn's client for it, so that the codecs' kernels read the model's
/// gradient buffers where they lie and queue behind burn's work. `None` where the model is
/// not on a cubecl device, or where this build does not train on GPUs (the codecs then
/// open the device themselves).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) fn model_gpu(model: &Device, spec: &str) -> Result<Option<dtrain_device::Gpu>, String> {
    #[cfg(any(feature = "cuda", feature = "wgpu-train"))]
    if let Ok(client) = dtrain_models::cube::client_of(model) {
        let spec = spec.parse().map_err(|e| format!("{e}"))?;
        return Ok(Some(dtrain_device::Gpu::with_client(client, spec)));
    }
    let _ = (model, spec);
    Ok(None)
}

/// The autodiff device a worker trains on. A GPU is initialised here (a one-element
/// probe), so a missing driver or GPU is an error naming the device rather than a panic in
/// the first step.
pub fn worker_device(kind: DeviceKind, local_rank: usize) -> Result<Device, String> {
    let opened = match kind {
        DeviceKind::Cpu => return Ok(dtrain_models::cpu_device()),
        DeviceKind::Wgpu(adapter) => wgpu(adapter),
        DeviceKind::Cuda(_) => cuda(kind.gpu_index(local_rank).unwrap_or(local_rank)),
    };
    opened.map_err(|e| format!("cluster.device = \"{kind}\": {e}"))
}

/// Checks that the GPU of each of a node's `local_workers` is usable (driver, GPU, NVRTC,
/// headers: see `dtrain_models::cuda`), once per GPU, so that a launcher reports one clear
/// error before it starts any worker. Nothing to check for the CPU.
pub fn check_available(kind: DeviceKind, local_workers: usize) -> Result<(), String> {
    let mut gpus: Vec<usize> = (0..local_workers)
        .filter_map(|r| kind.gpu_index(r))
        .collect();
    gpus.sort_unstable();
    gpus.dedup();
    for index in gpus {
        cuda_missing(index).map_err(|e| format!("cluster.device = \"{kind}\": {e}"))?;
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn cuda_missing(index: usize) -> Result<(), String> {
    dtrain_models::cuda::missing(index).map_or(Ok(()), Err)
}

#[cfg(not(feature = "cuda"))]
fn cuda_missing(_index: usize) -> Result<(), String> {
    Err(NO_CUDA.into())
}

#[cfg(feature = "cuda")]
fn cuda(index: usize) -> Result<Device, String> {
    dtrain_models::cuda_device(index)
}

#[cfg(not(feature = "cuda"))]
fn cuda(_index: usize) -> Result<Device, String> {
    Err(NO_CUDA.into())
}

#[cfg(feature = "wgpu-train")]
fn wgpu(adapter: Adapter) -> Result<Device, String> {
    dtrain_models::wgpu_device(adapter)
}

#[cfg(not(feature = "wgpu-train"))]
fn wgpu(_adapter: Adapter) -> Result<Device, String> {
    Err(NO_WGPU_TRAIN.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_devices_parse_resolve_and_name_the_feature_a_build_lacks() {
        assert_eq!("host".parse::<CodecDevice>().unwrap(), CodecDevice::Host);
        assert_eq!("auto".parse::<CodecDevice>().unwrap(), CodecDevice::Auto);
        for bad in ["", "gpu", "wgpu:", "wgpu:x", "cuda:+1", "host:0", "Wgpu"] {
            let e = bad.parse::<CodecDevice>().unwrap_err();
            assert!(e.contains("unknown device"), "{bad:?}: {e}");
        }
        for (name, built) in CODEC_RUNTIMES {
            for form in [name.to_string(), format!("{name}:1")] {
                match form.parse::<CodecDevice>() {
                    Ok(d) => {
                        assert!(built, "{form}");
                        assert_eq!(d.to_string(), form);
                    }
                    Err(e) => {
                        assert!(!built, "{form}: {e}");
                        assert!(e.contains(&format!("--features {name}")), "{e}");
                    }
                }
            }
        }
        assert_eq!(CodecDevice::Host.resolve(DeviceKind::Cuda(None), 1), None);
        assert_eq!(CodecDevice::Auto.resolve(DeviceKind::Cpu, 1), None);
        assert_eq!(
            CodecDevice::Auto.resolve(DeviceKind::Cuda(None), 1),
            CUDA_BUILT.then(|| "cuda:1".to_string())
        );
        assert_eq!(
            CodecDevice::Auto
                .resolve(DeviceKind::Wgpu(Adapter::Cpu), 1)
                .unwrap(),
            "wgpu:cpu"
        );
        let named = |s: &str| CodecDevice::Named(s.into());
        assert_eq!(
            named("cuda").resolve(DeviceKind::Cuda(Some(3)), 1).unwrap(),
            "cuda:3"
        );
        assert_eq!(named("cuda").resolve(DeviceKind::Cpu, 1).unwrap(), "cuda:1");
        assert_eq!(
            named("wgpu:cpu").resolve(DeviceKind::Cpu, 0).unwrap(),
            "wgpu:cpu"
        );
    }

    #[test]
    fn parses_and_prints_every_form() {
        for (text, kind) in [
            ("cpu", DeviceKind::Cpu),
            ("cuda", DeviceKind::Cuda(None)),
            ("cuda:0", DeviceKind::Cuda(Some(0))),
            ("cuda:3", DeviceKind::Cuda(Some(3))),
            ("wgpu", DeviceKind::Wgpu(Adapter::Default)),
            ("wgpu:1", DeviceKind::Wgpu(Adapter::Discrete(1))),
            ("wgpu:cpu", DeviceKind::Wgpu(Adapter::Cpu)),
        ] {
            assert_eq!(text.parse::<DeviceKind>().unwrap(), kind);
            assert_eq!(kind.to_string(), text);
        }
        for bad in [
            "", "gpu", "cuda:", "cuda:x", "cuda:+1", "cuda: 1", "CPU", "cuda:0:1", "wgpu:",
            "wgpu:gpu", "wgpu:-1",
        ] {
            let e = bad.parse::<DeviceKind>().unwrap_err();
            assert!(e.contains("cpu, cuda, cuda:N, wgpu"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn each_worker_gets_the_gpu_of_its_local_rank_unless_one_is_pinned() {
        assert_eq!(DeviceKind::Cpu.gpu_index(2), None);
        assert_eq!(DeviceKind::Cuda(None).gpu_index(2), Some(2));
        assert_eq!(DeviceKind::Cuda(Some(1)).gpu_index(2), Some(1));
        assert_eq!(DeviceKind::Wgpu(Adapter::Discrete(1)).gpu_index(2), None);
    }

    #[test]
    fn local_rank_prefers_the_launcher_then_mpi_then_slurm() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(local_rank_from(5, env(&[])), 5);
        assert_eq!(local_rank_from(5, env(&[("SLURM_LOCALID", "1")])), 1);
        assert_eq!(
            local_rank_from(
                5,
                env(&[("SLURM_LOCALID", "1"), ("OMPI_COMM_WORLD_LOCAL_RANK", "2")])
            ),
            2
        );
        assert_eq!(
            local_rank_from(
                5,
                env(&[(LOCAL_RANK_ENV, "3"), ("OMPI_COMM_WORLD_LOCAL_RANK", "2")])
            ),
            3
        );
        // Garbage in one variable falls through to the next.
        assert_eq!(
            local_rank_from(5, env(&[(LOCAL_RANK_ENV, "x"), ("SLURM_LOCALID", "4")])),
            4
        );
    }

    #[test]
    fn the_cpu_device_needs_no_feature_and_a_gpu_without_its_feature_is_a_clear_error() {
        assert!(worker_device(DeviceKind::Cpu, 0).is_ok());
        assert!(check_available(DeviceKind::Cpu, 4).is_ok());
        if !CUDA_BUILT {
            let e = check_available(DeviceKind::Cuda(None), 2).unwrap_err();
            assert!(e.starts_with("cluster.device = \"cuda\": "), "{e}");
            let e = worker_device(DeviceKind::Cuda(Some(1)), 0).unwrap_err();
            assert!(e.starts_with("cluster.device = \"cuda:1\": "), "{e}");
            assert!(e.contains("--features cuda"), "{e}");
        }
        if !WGPU_TRAIN_BUILT {
            let e = worker_device(DeviceKind::Wgpu(Adapter::Cpu), 0).unwrap_err();
            assert!(e.starts_with("cluster.device = \"wgpu:cpu\": "), "{e}");
            assert!(e.contains("--features wgpu-train"), "{e}");
        }
    }
}
