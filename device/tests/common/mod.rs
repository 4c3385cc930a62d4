//! What the device tests share: the device they run on.

use dtrain_device::{DeviceSpec, Gpu};

/// The device named by `DTRAIN_TEST_DEVICE`, by default `wgpu` where the build has it
/// (Mesa's lavapipe in CI) and `cuda` otherwise. A missing device fails the test: these
/// tests run only where a device was asked for (a runtime feature).
pub fn open_test_device() -> Gpu {
    let default = if cfg!(feature = "wgpu") {
        "wgpu"
    } else {
        "cuda"
    };
    let spec = std::env::var("DTRAIN_TEST_DEVICE").unwrap_or_else(|_| default.into());
    let spec: DeviceSpec = spec.parse().expect("DTRAIN_TEST_DEVICE");
    Gpu::open(spec).unwrap_or_else(|e| panic!("the device tests need a device: {e}"))
}
