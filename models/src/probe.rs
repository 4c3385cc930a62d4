//! Opening a GPU device without a panic in the first training step.

use std::sync::{Arc, Mutex};

use burn::prelude::*;

/// `device`, once a one-element tensor made on it has come back: burn's GPU backends start
/// their device on first use and panic (inside burn's device thread) when that fails, so the
/// failure is caught here and returned as an error starting with `what` (`CUDA device 0`).
///
/// The device thread's panic is the cause (`No Discrete GPU device found, adapters […]`);
/// the caller's own panic only says that the thread went away. While the probe runs, panics
/// are recorded instead of printed, and the first one is the error's text.
pub(crate) fn opened(device: Device, what: &str) -> Result<Device, String> {
    // The panic hook is the process's: probes on several threads at once (in-process ranks)
    // would each take the one another set and restore it, leaving a recorder in place of
    // the real hook for good. One probe at a time.
    static PROBING: Mutex<()> = Mutex::new(());
    let _one = PROBING.lock().unwrap_or_else(|e| e.into_inner());
    let first: Arc<Mutex<Option<String>>> = Arc::default();
    let seen = first.clone();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let mut slot = seen.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert_with(|| panic_text(info.payload()));
    }));
    let probe = std::panic::catch_unwind(move || {
        let zero = burn::tensor::Tensor::<1>::zeros([1], &device);
        zero.into_data()
            .try_to_vec::<f32>()
            .map(|_| device)
            .map_err(|e| format!("{e:?}"))
    });
    std::panic::set_hook(previous);
    match probe {
        Ok(r) => r.map_err(|e| format!("{what}: {e}")),
        Err(panic) => {
            let first = first.lock().unwrap_or_else(|e| e.into_inner()).take();
            Err(format!(
                "{what}: {}",
                first.unwrap_or_else(|| panic_text(panic.as_ref()))
            ))
        }
    }
}

/// A panic's message (`initialisation failed` when it carries none).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "initialisation failed".into())
}
