//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::Mutex;

use burn::prelude::*;
use dtrain_models::{Batch, Model, ModelSpec, SyntheticBatch};

/// burn's CPU RNG is global; tests run in parallel threads, so seeding and initializing
/// happen under this lock to make every test's initial weights reproducible.
static INIT: Mutex<()> = Mutex::new(());

/// The autodiff flex device, seeded.
pub fn device(seed: u64) -> Device {
    let device = Device::flex().autodiff();
    device.seed(seed);
    device
}

/// Runs `init` with burn's RNG seeded with `seed` and no other test drawing from it.
pub fn seeded<T>(seed: u64, init: impl FnOnce(&Device) -> T) -> T {
    let _guard = INIT.lock().unwrap_or_else(|e| e.into_inner());
    let device = device(seed);
    init(&device)
}

/// Builds a registry model from JSON without initializing its parameters (burn initializes
/// lazily; the table only needs declared shapes).
pub fn build_lazy(json: &str) -> Box<dyn Model> {
    let spec: ModelSpec = serde_json::from_str(json).unwrap_or_else(|e| panic!("{json}: {e}"));
    spec.build(&device(0)).unwrap()
}

/// Builds a registry model from JSON with reproducible initial weights.
pub fn build(json: &str, seed: u64) -> Box<dyn Model> {
    let spec: ModelSpec = serde_json::from_str(json).unwrap_or_else(|e| panic!("{json}: {e}"));
    seeded(seed, |device| {
        let model = spec.build(device).unwrap();
        // Parameters are initialized lazily: force it while the RNG is ours.
        let mut params = vec![0.0f32; model.table().num_params()];
        model.read_params(&mut params);
        model
    })
}

/// A random batch that fits `model`: `batch` images, or `batch × seq` tokens (from
/// `dtrain_models::synthetic`'s generator, not burn's global RNG).
pub fn random_batch(model: &dyn Model, batch: usize, seq: usize, seed: u64) -> Batch {
    SyntheticBatch::new(model.input(), batch, seq, seed).on(model.device())
}

/// Loss of `batch` in training mode without keeping gradients.
pub fn train_loss(model: &mut dyn Model, batch: Batch) -> f64 {
    model.reset_state();
    let out = model.forward_loss(batch).unwrap();
    out.metrics.loss
}

/// One plain SGD step through the flat buffers; returns (loss before, loss after) on the
/// same batch, both in training mode from a reset recurrent state.
pub fn sgd_step(model: &mut dyn Model, batch: Batch, lr: f32) -> (f64, f64) {
    let n = model.table().num_params();
    let mut grads = vec![0.0f32; n];
    let mut params = vec![0.0f32; n];
    model.reset_state();
    let before = model.forward_backward(batch.clone(), &mut grads).unwrap();
    assert!(grads.iter().all(|g| g.is_finite()), "non-finite gradient");
    assert!(grads.iter().any(|g| *g != 0.0), "all-zero gradient");
    model.read_params(&mut params);
    for (p, g) in params.iter_mut().zip(&grads) {
        *p -= lr * g;
    }
    model.write_params(&params);
    let after = train_loss(model, batch);
    (before.loss, after)
}
