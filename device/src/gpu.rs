//! Which device, and the flat `f32` buffers the codecs read and write on it.

use std::fmt;
use std::str::FromStr;

use cubecl::client::Client;
use cubecl::device::{DeviceUnavailable, WgpuDeviceKind};
use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::Device;

use crate::error::DeviceError;

/// A device named in a config or on the command line: `wgpu` (the best adapter wgpu finds),
/// `wgpu:N` (the N-th discrete GPU), `wgpu:cpu` (a software adapter such as Mesa's
/// lavapipe), `cuda` (GPU 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// A wgpu adapter (Vulkan, Metal, DX12).
    Wgpu(WgpuKind),
    /// The CUDA GPU with this index.
    Cuda(usize),
}

/// Which wgpu adapter a [`DeviceSpec::Wgpu`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WgpuKind {
    /// The best adapter wgpu finds (cubecl's default; `CUBECL_WGPU_DEFAULT_DEVICE` overrides
    /// it).
    Default,
    /// The N-th discrete GPU.
    Discrete(usize),
    /// A software adapter (lavapipe, llvmpipe, WARP).
    Cpu,
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, DeviceError> {
        let bad = |reason| DeviceError::BadSpec {
            spec: s.to_string(),
            reason,
        };
        let (name, arg) = match s.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (s, None),
        };
        let index = |a: &str| {
            a.parse::<usize>()
                .map_err(|_| bad("the index is not a number"))
        };
        match (name, arg) {
            ("wgpu", None) => Ok(DeviceSpec::Wgpu(WgpuKind::Default)),
            ("wgpu", Some("cpu")) => Ok(DeviceSpec::Wgpu(WgpuKind::Cpu)),
            ("wgpu", Some(a)) => Ok(DeviceSpec::Wgpu(WgpuKind::Discrete(index(a)?))),
            ("cuda", None) => Ok(DeviceSpec::Cuda(0)),
            ("cuda", Some(a)) => Ok(DeviceSpec::Cuda(index(a)?)),
            _ => Err(bad("unknown device")),
        }
    }
}

impl fmt::Display for DeviceSpec {
    /// The form [`DeviceSpec::from_str`] reads.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Wgpu(WgpuKind::Default) => write!(f, "wgpu"),
            DeviceSpec::Wgpu(WgpuKind::Discrete(i)) => write!(f, "wgpu:{i}"),
            DeviceSpec::Wgpu(WgpuKind::Cpu) => write!(f, "wgpu:cpu"),
            DeviceSpec::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// An opened device: the cubecl client every kernel of this crate launches on.
#[derive(Clone)]
pub struct Gpu {
    client: Client,
    spec: DeviceSpec,
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gpu({self})")
    }
}

impl fmt::Display for Gpu {
    /// The spec and the runtime, e.g. `wgpu:cpu (wgpu)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.spec, self.client.name())
    }
}

impl Gpu {
    /// Opens the device `spec` names: an error (never a panic) where this build lacks its
    /// runtime or the machine lacks the device.
    pub fn open(spec: DeviceSpec) -> Result<Gpu, DeviceError> {
        let device = match spec {
            DeviceSpec::Wgpu(kind) => Device::wgpu(match kind {
                WgpuKind::Default => WgpuDeviceKind::DefaultDevice,
                WgpuKind::Discrete(i) => WgpuDeviceKind::DiscreteGpu(i),
                WgpuKind::Cpu => WgpuDeviceKind::Cpu,
            }),
            DeviceSpec::Cuda(i) => Device::cuda(i),
        }
        .map_err(|e| DeviceError::Unavailable {
            spec: spec.to_string(),
            reason: match e {
                DeviceUnavailable::NotLinked(_) => format!(
                    "this build has no {} runtime: build it with --features {}",
                    match spec {
                        DeviceSpec::Wgpu(_) => "wgpu",
                        DeviceSpec::Cuda(_) => "CUDA",
                    },
                    match spec {
                        DeviceSpec::Wgpu(_) => "wgpu",
                        DeviceSpec::Cuda(_) => "cuda",
                    }
                ),
                other => other.to_string(),
            },
        })?;
        Ok(Gpu {
            client: device.client(),
            spec,
        })
    }

    /// The device `spec` names, over `client`: a client that burn opened for a model on
    /// that device (`dtrain_models::cube`), so that the codecs' kernels read burn's buffers
    /// and queue behind burn's work on one device. `spec` only names it in messages.
    pub fn with_client(client: Client, spec: DeviceSpec) -> Gpu {
        Gpu { client, spec }
    }

    /// The device this was opened as.
    pub fn spec(&self) -> DeviceSpec {
        self.spec
    }

    /// The cubecl client (for launching kernels).
    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    /// A server error on this device, as a [`DeviceError`].
    pub(crate) fn server_error(&self, what: &'static str, e: impl fmt::Display) -> DeviceError {
        DeviceError::Server {
            device: self.to_string(),
            what,
            reason: e.to_string(),
        }
    }

    /// Waits for every kernel launched on this device so far (a timing boundary; the
    /// codecs' own reads already wait for what they read).
    pub fn sync(&self) -> Result<(), DeviceError> {
        cubecl::future::block_on(self.client.sync()).map_err(|e| self.server_error("sync", e))
    }

    /// A device buffer holding a copy of `values`.
    pub fn upload(&self, values: &[f32]) -> GpuBuffer {
        // At least one element's memory: a kernel argument covers `max(len, 1)`.
        let bytes = if values.is_empty() { &[0.0f32][..] } else { values };
        GpuBuffer {
            handle: self.client.create_from_slice(f32::as_bytes(bytes)),
            len: values.len(),
        }
    }

    /// `len` contiguous `f32`s at the start of `handle`, a buffer on this device (a burn
    /// tensor's, through `dtrain_models::cube`): no copy; the buffer is shared, as a clone
    /// of a [`GpuBuffer`] is. An error where `handle` belongs to another device (its memory
    /// means nothing here) or holds fewer than `len` `f32`s.
    pub fn adopt(&self, handle: Handle, len: usize) -> Result<GpuBuffer, DeviceError> {
        if handle.service != self.client.service_id() {
            return Err(self.server_error(
                "adopting a buffer",
                "the buffer belongs to another device (another cubecl client)",
            ));
        }
        if handle.size_in_used() < 4 * len as u64 {
            return Err(self.server_error(
                "adopting a buffer",
                format!(
                    "it holds {} bytes, fewer than {len} f32s",
                    handle.size_in_used()
                ),
            ));
        }
        // Kernels bound to a buffer see all of it (a loop to `x.len()` would run past
        // `len`): the handle is cut to the `len` elements.
        let spare = handle.size_in_used() - 4 * len as u64;
        let handle = if spare > 0 {
            handle.offset_end(spare)
        } else {
            handle
        };
        Ok(GpuBuffer { handle, len })
    }

    /// A copy of `len` elements of `src` from element `start`, in a buffer of its own (one
    /// kernel; a bucket's range of a flat gradient that stays on the device).
    pub fn copy_range(&self, src: &GpuBuffer, start: usize, len: usize) -> GpuBuffer {
        assert!(start + len <= src.len, "range {start}+{len} past {}", src.len);
        let dst = self.empty(len);
        if len > 0 {
            let (count, dim) = crate::words::geometry(len);
            copy_range::launch(
                &self.client,
                count,
                dim,
                src.arg(),
                dst.arg(),
                start as u32,
            );
        }
        dst
    }

    /// Writes `src` into `dst` from element `start` (one kernel): a bucket's decoded mean
    /// put in its place in a flat buffer.
    pub fn copy_into(&self, src: &GpuBuffer, dst: &GpuBuffer, start: usize) {
        assert!(
            start + src.len <= dst.len,
            "range {start}+{} past {}",
            src.len,
            dst.len
        );
        if src.len > 0 {
            let (count, dim) = crate::words::geometry(src.len);
            copy_into::launch(
                &self.client,
                count,
                dim,
                src.arg(),
                dst.arg(),
                start as u32,
            );
        }
    }

    /// Writes a sparse sum's mean into `dst[start..start + len]`: zeros there, then
    /// `vals[i] · k` at `start + idx[i]` (two kernels; the host's `v · k` over a dense `v`
    /// that is zero off the indices, bit for bit). Only the indices and values cross. An
    /// error where an index is not below `len`, the lists' lengths differ, or the range is
    /// past `dst`'s end.
    pub fn scatter_scaled(
        &self,
        dst: &GpuBuffer,
        start: usize,
        len: usize,
        idx: &[u32],
        vals: &[f32],
        k: f32,
    ) -> Result<(), DeviceError> {
        if start + len > dst.len {
            return Err(DeviceError::Length {
                what: "a sparse mean's range",
                expected: dst.len,
                found: start + len,
            });
        }
        if idx.len() != vals.len() {
            return Err(DeviceError::Length {
                what: "a sparse mean's values against its indices",
                expected: idx.len(),
                found: vals.len(),
            });
        }
        if let Some(&i) = idx.iter().find(|&&i| i as usize >= len) {
            return Err(DeviceError::Length {
                what: "a sparse mean's index against its range",
                expected: len,
                found: i as usize + 1,
            });
        }
        if len == 0 {
            return Ok(());
        }
        let (count, dim) = crate::words::geometry(len);
        fill_zero_range::launch(&self.client, count, dim, dst.arg(), start as u32, len as u32);
        if !idx.is_empty() {
            let idx_words = self.client.create_from_slice(u32::as_bytes(idx));
            let (count, dim) = crate::words::geometry(idx.len());
            // SAFETY: `idx_words` holds `idx.len()` words.
            unsafe {
                scatter_scaled::launch(
                    &self.client,
                    count,
                    dim,
                    BufferArg::from_raw_parts(idx_words, idx.len()),
                    self.upload(vals).arg(),
                    dst.arg(),
                    start as u32,
                    k,
                );
            }
        }
        Ok(())
    }

    /// Multiplies `buf[start..start + len]` by `k` (one kernel): a bucket's sum made its mean
    /// where it lies.
    pub fn scale_range(&self, buf: &GpuBuffer, start: usize, len: usize, k: f32) {
        assert!(start + len <= buf.len, "range {start}+{len} past {}", buf.len);
        if len > 0 {
            let (count, dim) = crate::words::geometry(len);
            scale_range::launch(&self.client, count, dim, buf.arg(), start as u32, len as u32, k);
        }
    }

    /// `len` elements of `buf` from element `start`, copied to the host (one kernel and one
    /// read of just that range: what a bucket the host encodes needs of a gradient that
    /// stays on the device).
    pub fn download_range(
        &self,
        buf: &GpuBuffer,
        start: usize,
        len: usize,
    ) -> Result<Vec<f32>, DeviceError> {
        if start == 0 && len == buf.len {
            return self.download(buf);
        }
        self.download(&self.copy_range(buf, start, len))
    }

    /// The first element of `buf` that is a NaN or an infinity, with its value (`None`
    /// when every element is finite): one pass on the device and one word read back, the
    /// host's `first_non_finite` for a buffer that stays on the device.
    pub fn first_non_finite(&self, buf: &GpuBuffer) -> Result<Option<(usize, f32)>, DeviceError> {
        if buf.len == 0 {
            return Ok(None);
        }
        let first_bad = self.words(1, u32::MAX);
        let (count, dim) = crate::words::geometry(buf.len);
        // SAFETY: `first_bad` holds one word.
        unsafe {
            first_non_finite::launch(
                &self.client,
                count,
                dim,
                buf.arg(),
                BufferArg::from_raw_parts(first_bad.clone(), 1),
            );
        }
        let read = self.read_words(vec![first_bad], "scanning for non-finite values")?;
        let at = u32::from_le_bytes(read[0][..4].try_into().expect("one word"));
        if at == u32::MAX {
            return Ok(None);
        }
        let at = at as usize;
        let value = self.download_range(buf, at, 1)?[0];
        Ok(Some((at, value)))
    }

    /// Whether `buf` lives on this device (a buffer of another client means nothing to
    /// this one's kernels).
    pub fn holds(&self, buf: &GpuBuffer) -> bool {
        buf.handle.service == self.client.service_id()
    }

    /// A device buffer of `len` elements whose values are unspecified: for an output a kernel
    /// writes whole (no zeros uploaded on a step's path).
    pub(crate) fn empty(&self, len: usize) -> GpuBuffer {
        GpuBuffer {
            handle: self.client.empty(4 * len.max(1)),
            len,
        }
    }

    /// A device buffer of `len` zeros: allocated and zeroed on the device (one kernel), with
    /// no host buffer and no upload (a step's scratch buffers come from here).
    pub fn zeros(&self, len: usize) -> GpuBuffer {
        let buf = self.empty(len);
        self.fill_zero(&buf);
        buf
    }

    /// Sets every element of `buf` to zero.
    pub fn fill_zero(&self, buf: &GpuBuffer) {
        let (count, dim) = crate::words::geometry(buf.len());
        fill_zero::launch(&self.client, count, dim, buf.arg());
    }

    /// The values of `buf`, copied to the host (waits for the kernels writing it).
    pub fn download(&self, buf: &GpuBuffer) -> Result<Vec<f32>, DeviceError> {
        if buf.len == 0 {
            return Ok(Vec::new());
        }
        let bytes = self
            .client
            .read_one(buf.handle.clone())
            .map_err(|e| self.server_error("reading a buffer", e))?;
        Ok(f32::from_bytes(&bytes)[..buf.len].to_vec())
    }

    /// A device buffer of `words` `u32`s, every one `fill`.
    pub(crate) fn words(&self, words: usize, fill: u32) -> Handle {
        self.client
            .create_from_slice(u32::as_bytes(&vec![fill; words.max(1)]))
    }

    /// `words` `u32`s read back from `handle` (as little-endian bytes).
    pub(crate) fn read_words(
        &self,
        handles: Vec<Handle>,
        what: &'static str,
    ) -> Result<Vec<Vec<u8>>, DeviceError> {
        let out = self
            .client
            .read(handles)
            .map_err(|e| self.server_error(what, e))?;
        Ok(out.into_iter().map(|b| b.to_vec()).collect())
    }
}

/// `x = 0`.
#[cube(launch)]
fn fill_zero(x: &mut [f32]) {
    let mut i = ABSOLUTE_POS;
    while i < x.len() {
        x[i] = 0.0;
        i += crate::words::grid_stride();
    }
}

/// Lowers `first_bad` to the index of every element of `x` that is a NaN or an infinity
/// (exponent bits all ones).
#[cube(launch)]
fn first_non_finite(x: &[f32], first_bad: &[Atomic<u32>]) {
    let mut i = ABSOLUTE_POS;
    while i < x.len() {
        if (u32::reinterpret(x[i]) >> 23) & 0xFF == 0xFF {
            first_bad[0].fetch_min(i as u32);
        }
        i += crate::words::grid_stride();
    }
}

/// `x[start..start + len] *= k`.
#[cube(launch)]
fn scale_range(x: &mut [f32], start: u32, len: u32, k: f32) {
    let mut i = ABSOLUTE_POS;
    while i < len as usize {
        x[start as usize + i] *= k;
        i += crate::words::grid_stride();
    }
}

/// `x[start..start + len] = 0`.
#[cube(launch)]
fn fill_zero_range(x: &mut [f32], start: u32, len: u32) {
    let mut i = ABSOLUTE_POS;
    while i < len as usize {
        x[start as usize + i] = 0.0;
        i += crate::words::grid_stride();
    }
}

/// `dst[start + idx[i]] = vals[i] · k`.
#[cube(launch)]
fn scatter_scaled(idx: &[u32], vals: &[f32], dst: &mut [f32], start: u32, k: f32) {
    let mut i = ABSOLUTE_POS;
    while i < idx.len() {
        dst[start as usize + idx[i] as usize] = vals[i] * k;
        i += crate::words::grid_stride();
    }
}

/// `dst[start + i] = src[i]`.
#[cube(launch)]
fn copy_into(src: &[f32], dst: &mut [f32], start: u32) {
    let mut i = ABSOLUTE_POS;
    while i < src.len() {
        dst[i + start as usize] = src[i];
        i += crate::words::grid_stride();
    }
}

/// `dst[i] = src[start + i]`.
#[cube(launch)]
fn copy_range(src: &[f32], dst: &mut [f32], start: u32) {
    let mut i = ABSOLUTE_POS;
    while i < dst.len() {
        dst[i] = src[i + start as usize];
        i += crate::words::grid_stride();
    }
}

/// A flat buffer of `f32` on a device (a bucket of gradients, an error-feedback memory, a
/// decoded mean). Cloning shares the memory.
#[derive(Clone, Debug)]
pub struct GpuBuffer {
    pub(crate) handle: Handle,
    pub(crate) len: usize,
}

impl GpuBuffer {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The cubecl buffer itself (shared: a clone of the handle is the same memory), for
    /// [`Gpu::adopt`] or for handing it to burn on the same client.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// The kernel argument reading or writing the whole buffer.
    pub(crate) fn arg(&self) -> BufferArg {
        // SAFETY: the handle was created with at least `len` f32s (upload / zeros).
        unsafe { BufferArg::from_raw_parts(self.handle.clone(), self.len.max(1)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A runtime left out of the build is named with the feature that brings it.
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_runtime_not_built_says_which_feature_brings_it() {
        let e = Gpu::open(DeviceSpec::Cuda(0)).unwrap_err().to_string();
        assert!(e.contains("cuda:0") && e.contains("--features cuda"), "{e}");
    }

    #[test]
    fn specs_round_trip_and_bad_ones_name_themselves() {
        for s in ["wgpu", "wgpu:cpu", "wgpu:1", "cuda:0", "cuda:3"] {
            assert_eq!(s.parse::<DeviceSpec>().unwrap().to_string(), s);
        }
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        for s in ["gpu", "wgpu:x", "cuda:-1", ""] {
            let e = s.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(e.contains(&format!("{s:?}")), "{e}");
        }
    }
}
