//! A tensor on one of burn's cubecl devices (CUDA, wgpu) as the cubecl buffer it lives in:
//! how a GPU worker's gradient reaches dtrain's device codecs (`dtrain-device`, cubecl
//! kernels on the same client) with no copy through the host (ARCHITECTURE.md §10).
//!
//! burn queues operations lazily (its fusion layer): resolving a tensor runs what is queued
//! for it, and the buffer returned is then ready for kernels launched on its client, which
//! serialises them after burn's.

use burn::prelude::*;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{Cube, CubeBackend};
use burn_fusion::stream::StreamId;
use burn_fusion::{FusionTensor, NoOp};
use burn_ir::{BackendIr, InitOperationIr, OperationIr};
use cubecl::client::Client;
use cubecl::server::Handle;

/// A flat `f32` tensor's buffer on its cubecl device.
pub struct CubeBuffer {
    /// The client of the device the buffer lives on (burn's, shared by cubecl kernels).
    pub client: Client,
    /// The buffer: `len` contiguous `f32`s from its start.
    pub handle: Handle,
    /// Elements.
    pub len: usize,
}

/// The buffer of `tensor` (a flat `f32` tensor on a cubecl device, without autodiff), made
/// contiguous if it was a view. An error naming the tensor's device where it is not on a
/// cubecl device, or not `f32`.
pub fn cube_buffer(tensor: Tensor<1>) -> Result<CubeBuffer, String> {
    if tensor.dtype() != burn::tensor::DType::F32 {
        return Err(format!(
            "a {:?} tensor on {:?}: the device codecs read f32",
            tensor.dtype(),
            tensor.device()
        ));
    }
    let len = tensor.dims()[0];
    let device = tensor.device();
    let fused: FusionTensor<FusionCubeRuntime> = tensor
        .try_into_primitive::<Cube>()
        .map_err(|e| format!("a tensor on {device:?} is not on a cubecl device: {e:?}"))?;
    let client = fused.client.clone();
    let mut cube: CubeTensor = client.resolve_tensor_float::<CubeBackend>(fused);
    if !cube.is_contiguous_buffer() {
        cube = burn_cubecl::kernel::into_contiguous(cube);
    }
    Ok(CubeBuffer {
        client: cube.client.clone(),
        handle: cube.handle.clone(),
        len,
    })
}

/// The cubecl client of `device` (a CUDA or wgpu device of burn's), for kernels that work
/// on its tensors' buffers: one element is made there to reach it. An error where `device`
/// is not a cubecl device.
pub fn client_of(device: &crate::Device) -> Result<Client, String> {
    let device = device.clone().without_autodiff();
    Ok(cube_buffer(Tensor::<1>::zeros([1], &device))?.client)
}

/// A flat `f32` tensor on `device` (a cubecl device of burn's; the tensor without autodiff)
/// over the first `len` `f32`s of `handle`, a buffer of that device's client — what the
/// device codecs wrote (an averaged gradient decoded there): no copy. burn's fusion layer
/// registers it as it registers a tensor made from data. Nothing else may write the buffer
/// afterwards. An error where `device` is not a cubecl device, the buffer is another
/// client's, or it holds fewer than `len` values.
pub fn tensor_over(
    device: &crate::Device,
    handle: Handle,
    len: usize,
) -> Result<Tensor<1>, String> {
    let device = device.clone().without_autodiff();
    let fused: FusionTensor<FusionCubeRuntime> = Tensor::<1>::zeros([1], &device)
        .try_into_primitive::<Cube>()
        .map_err(|e| format!("{device:?} is not a cubecl device: {e:?}"))?;
    let client = fused.client.clone();
    let probe: CubeTensor = client.resolve_tensor_float::<CubeBackend>(fused);
    if handle.service != probe.client.service_id() {
        return Err(format!("the buffer is not on {device:?}"));
    }
    if handle.size_in_used() < 4 * len as u64 {
        return Err(format!(
            "the buffer holds {} bytes, fewer than {len} f32s",
            handle.size_in_used()
        ));
    }
    let shape = burn::tensor::Shape::new([len]);
    let cube = CubeTensor::new_contiguous(
        probe.client.clone(),
        probe.device.clone(),
        shape.clone(),
        handle,
        burn::tensor::DType::F32,
    );
    let registered = <CubeBackend as BackendIr>::float_tensor_handle(cube);
    let init = InitOperationIr::create(shape, burn::tensor::DType::F32, || {
        client.register_tensor_handle(registered)
    });
    let out = client
        .register(
            StreamId::current(),
            OperationIr::Init(init),
            NoOp::<CubeBackend>::new(),
        )
        .into_iter()
        .next()
        .expect("an init operation has one output");
    Ok(Tensor::<1>::from_primitive::<Cube>(out))
}
