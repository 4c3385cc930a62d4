//! Opening a GPU device without a panic in the first training step.

use burn::prelude::*;

/// `device`, once a one-element tensor made on it has come back: burn's GPU backends start
/// their device on first use and panic (inside burn's device thread) when that fails, so the
/// failure is caught here and returned as an error starting with `what` (`CUDA device 0`).
pub(crate) fn opened(device: Device, what: &str) -> Result<Device, String> {
    let probe = std::panic::catch_unwind(move || {
        let zero = burn::tensor::Tensor::<1>::zeros([1], &device);
        zero.into_data()
            .try_to_vec::<f32>()
            .map(|_| device)
            .map_err(|e| format!("{e:?}"))
    });
    match probe {
        Ok(r) => r.map_err(|e| format!("{what}: {e}")),
        Err(panic) => {
            let text = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "initialisation failed".into());
            Err(format!("{what}: {text}"))
        }
    }
}
