//! Truncated BPTT: the LSTM LM carries its detached hidden state from batch to batch.

mod common;

use dtrain_models::{Batch, LmModel, LstmLmConfig, Model};

fn model() -> LmModel<dtrain_models::LstmLm> {
    common::seeded(3, build)
}

fn build(device: &burn::prelude::Device) -> LmModel<dtrain_models::LstmLm> {
    let config = LstmLmConfig {
        dropout: 0.0,
        ..LstmLmConfig::char(12)
    };
    let config = LstmLmConfig {
        embed: 8,
        hidden: 16,
        ..config
    };
    let m = LmModel::new("lstm-char", config.init(device), 12, device);
    let mut params = vec![0.0f32; m.table().num_params()];
    m.read_params(&mut params);
    m
}

fn batch(model: &dyn Model, seed: u64, b: usize) -> Batch {
    common::random_batch(model, b, 5, seed)
}

#[test]
fn hidden_state_is_carried_and_detached() {
    let mut m = model();
    let n = m.table().num_params();
    let mut grads = vec![0.0f32; n];
    let (first, second) = (batch(&m, 1, 3), batch(&m, 2, 3));

    assert!(!m.carries_state());
    m.forward_backward(first.clone(), &mut grads).unwrap();
    assert!(m.carries_state());
    // The second chunk starts from the first chunk's state ...
    let carried = m.forward_backward(second.clone(), &mut grads).unwrap();
    // ... and backpropagates only through itself (the state is detached): the same gradient
    // comes out when the carried state is replayed.
    let grads_carried = grads.clone();
    m.reset_state();
    m.forward_loss(first.clone()).unwrap();
    m.forward_backward(second.clone(), &mut grads).unwrap();
    assert_eq!(grads, grads_carried);

    m.reset_state();
    assert!(!m.carries_state());
    let fresh = m.forward_backward(second, &mut grads).unwrap();
    assert_ne!(
        carried.loss, fresh.loss,
        "the carried state changes the loss"
    );
}

#[test]
fn a_new_batch_size_starts_from_a_fresh_state() {
    let mut m = model();
    let mut grads = vec![0.0f32; m.table().num_params()];
    m.forward_backward(batch(&m, 1, 3), &mut grads).unwrap();
    let other = batch(&m, 2, 2);
    let carried_over = m.forward_backward(other.clone(), &mut grads).unwrap();
    m.reset_state();
    let fresh = m.forward_backward(other, &mut grads).unwrap();
    assert_eq!(carried_over.loss, fresh.loss);
}

#[test]
fn evaluation_carries_its_own_state() {
    let mut m = model();
    let (a, b) = (batch(&m, 1, 2), batch(&m, 2, 2));
    let fresh = m.evaluate(b.clone()).unwrap();
    m.reset_state();
    m.evaluate(a.clone()).unwrap();
    let carried = m.evaluate(b.clone()).unwrap();
    assert_ne!(fresh.loss, carried.loss);
    // Training does not disturb the evaluation state.
    m.reset_state();
    m.evaluate(a).unwrap();
    let mut grads = vec![0.0f32; m.table().num_params()];
    m.forward_backward(batch(&m, 9, 2), &mut grads).unwrap();
    assert_eq!(m.evaluate(b).unwrap(), carried);
    assert_eq!(fresh.count, 10);
    assert!(fresh.perplexity() > 1.0);
}
