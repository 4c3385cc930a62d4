//! Every model trains: one plain SGD step (through the flat parameter and gradient buffers)
//! on a random batch lowers the loss on that batch. Tiny sizes; dropout off so the
//! training-mode loss is a deterministic function of the parameters.

mod common;

fn assert_trains(json: &str, batch: usize, seq: usize, lr: f32) {
    let mut model = common::build(json, 7);
    let b = common::random_batch(model.as_ref(), batch, seq, 11);
    let (before, after) = common::sgd_step(model.as_mut(), b, lr);
    assert!(
        after < before,
        "{}: loss {before} → {after} after one step",
        model.name()
    );
}

#[test]
fn mlp_trains() {
    assert_trains(
        r#"{"kind":"mlp","image_size":8,"hidden":[32,16]}"#,
        8,
        0,
        0.05,
    );
}

#[test]
fn lenet5_trains() {
    assert_trains(r#"{"kind":"lenet"}"#, 8, 0, 0.05);
}

#[test]
fn alexnet_cifar_trains_with_and_without_lrn() {
    assert_trains(
        r#"{"kind":"alexnet","variant":"cifar","dropout":0.0}"#,
        4,
        0,
        0.01,
    );
    assert_trains(
        r#"{"kind":"alexnet","variant":"cifar","lrn":true,"dropout":0.0}"#,
        4,
        0,
        0.01,
    );
}

#[test]
fn alexnet_cifar_fc_trains() {
    assert_trains(
        r#"{"kind":"alexnet","variant":"cifar-fc","dropout":0.0}"#,
        4,
        0,
        0.01,
    );
}

#[test]
fn alexnet_imagenet_architecture_trains_at_a_small_size() {
    // The ImageNet AlexNet's layer stack on 64×64 inputs with 10 classes (its 6×6 adaptive
    // pooling keeps the 9216-4096-4096 head, 57 M parameters).
    assert_trains(
        r#"{"kind":"alexnet","variant":"imagenet","image_size":64,"num_classes":10,"dropout":0.0}"#,
        2,
        0,
        0.01,
    );
}

#[test]
fn vgg11_trains_with_and_without_batch_norm() {
    assert_trains(r#"{"kind":"vgg","variant":"vgg11"}"#, 4, 0, 0.01);
    assert_trains(
        r#"{"kind":"vgg","variant":"vgg11","batch_norm":true}"#,
        4,
        0,
        0.01,
    );
}

#[test]
fn resnet20_trains_with_both_shortcuts() {
    assert_trains(r#"{"kind":"resnet","variant":"resnet20"}"#, 4, 0, 0.05);
    assert_trains(
        r#"{"kind":"resnet","variant":"resnet20","shortcut":"b"}"#,
        4,
        0,
        0.05,
    );
}

#[test]
fn resnet18_and_50_train_at_cifar_size() {
    assert_trains(
        r#"{"kind":"resnet","variant":"resnet18","image_size":32,"num_classes":10}"#,
        2,
        0,
        0.01,
    );
    // ResNet-50's last stage is 1×1 at this size: with 2 images its BatchNorms normalise 2
    // values a channel to ±1 whatever the input, the true gradient upstream of them is about
    // zero and what backward returns is rounding noise amplified by 1/√ε (norm ~1e9, its bits
    // depending on the kernels' summation order). 4 images make the gradient well defined.
    assert_trains(
        r#"{"kind":"resnet","variant":"resnet50","image_size":32,"num_classes":10}"#,
        4,
        0,
        0.01,
    );
}

#[test]
fn lstm_language_models_train() {
    assert_trains(
        r#"{"kind":"lstm","variant":"word","vocab":50,"embed":16,"hidden":16,"dropout":0.0}"#,
        4,
        6,
        0.5,
    );
    assert_trains(
        r#"{"kind":"lstm","variant":"char","vocab":30,"embed":8,"hidden":16,"layers":3,"dropout":0.0}"#,
        4,
        6,
        0.5,
    );
}

#[test]
fn gpt_language_model_trains() {
    assert_trains(
        r#"{"kind":"gpt","vocab":40,"layers":2,"d_model":16,"heads":2,"context":8,"dropout":0.0}"#,
        4,
        8,
        0.5,
    );
}

/// Number of columns of the `[rows, cols]` row-major `g` holding a non-zero.
fn nonzero_columns(g: &[f32], cols: usize) -> usize {
    (0..cols)
        .filter(|&c| g.iter().skip(c).step_by(cols).any(|&v| v != 0.0))
        .count()
}

#[test]
fn mlp_with_meprop_trains_and_its_weight_gradients_are_column_sparse() {
    let json = r#"{"kind":"mlp","image_size":8,"hidden":[32,16],"meprop_k":4}"#;
    assert_trains(json, 8, 0, 0.05);
    let mut model = common::build(json, 7);
    let b = common::random_batch(model.as_ref(), 8, 0, 11);
    let mut grads = vec![0f32; model.table().num_params()];
    model.forward_backward(b, &mut grads).unwrap();
    let weights: Vec<_> = model
        .table()
        .params()
        .filter(|e| e.name.ends_with("weight"))
        .cloned()
        .collect();
    assert_eq!(weights.len(), 3);
    for e in &weights {
        let g = &grads[e.offset..e.offset + e.numel];
        let cols = e.shape[1];
        let nz = nonzero_columns(g, cols);
        // Every layer (32, 16 and 10 outputs) is wider than k = 4 and keeps exactly k
        // columns (with random data none of the kept columns is all-zero).
        assert_eq!(
            nz,
            4.min(cols),
            "{}: {nz} non-zero columns of {cols}",
            e.name
        );
    }
}

#[test]
fn lstm_with_meprop_on_the_decoder_trains() {
    let json = r#"{"kind":"lstm","variant":"char","vocab":12,"embed":8,"hidden":16,"dropout":0.0,"meprop_k":3}"#;
    assert_trains(json, 4, 5, 0.5);
    let mut model = common::build(json, 7);
    let b = common::random_batch(model.as_ref(), 4, 5, 11);
    let mut grads = vec![0f32; model.table().num_params()];
    model.forward_backward(b, &mut grads).unwrap();
    let dec = model
        .table()
        .params()
        .find(|e| e.name == "decoder.weight")
        .cloned()
        .expect("an untied decoder");
    let g = &grads[dec.offset..dec.offset + dec.numel];
    assert_eq!(nonzero_columns(g, dec.shape[1]), 3);
}
