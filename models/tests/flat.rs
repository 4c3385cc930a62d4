//! The flat views: round trips are exact, names are stable, gradients land at the right
//! offsets, unused parameters get zero gradients, buffers and records round-trip.

mod common;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use dtrain_models::{Batch, ImageClassifier, ImageModel, InputSpec, Model, ParamTable, TensorRole};

use common::build;

const RESNET: &str = r#"{"kind":"resnet","variant":"resnet20","shortcut":"b"}"#;
const VGG_BN: &str = r#"{"kind":"vgg","variant":"vgg11","batch_norm":true}"#;

#[test]
fn param_names_are_hierarchical_and_stable_across_inits() {
    for json in [
        RESNET,
        VGG_BN,
        r#"{"kind":"alexnet","variant":"imagenet","lrn":true}"#,
        r#"{"kind":"lstm","variant":"word","vocab":20,"embed":8,"hidden":8}"#,
        r#"{"kind":"lstm","variant":"char","vocab":20,"tied":false}"#,
        r#"{"kind":"gpt","vocab":20,"layers":2,"d_model":16,"heads":2,"context":8}"#,
    ] {
        let a = common::build_lazy(json);
        let b = common::build_lazy(json);
        assert_eq!(a.table(), b.table(), "{json}");
    }
    let alex = common::build_lazy(r#"{"kind":"alexnet","variant":"imagenet"}"#);
    let names: Vec<_> = alex.table().params().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names[..4],
        [
            "features.0.weight",
            "features.0.bias",
            "features.1.weight",
            "features.1.bias"
        ]
    );
    assert_eq!(names.last(), Some(&"classifier.2.bias"));
    assert_eq!(
        alex.table().get("classifier.0.weight").unwrap().shape,
        [9216, 4096]
    );

    let resnet = common::build_lazy(RESNET);
    let t = resnet.table();
    assert_eq!(t.get("conv1.weight").unwrap().shape, [16, 3, 3, 3]);
    assert_eq!(
        t.get("stages.1.0.downsample.conv.weight").unwrap().shape,
        [32, 16, 1, 1]
    );
    let rm = t.get("stages.2.2.bn2.running_mean").unwrap();
    assert_eq!(rm.role, TensorRole::Buffer);
    assert_eq!(
        t.get("stages.2.2.bn2.gamma").unwrap().role,
        TensorRole::Param
    );
    // Offsets tile each flat buffer in order.
    for role in [TensorRole::Param, TensorRole::Buffer] {
        let mut next = 0;
        for e in t.entries().iter().filter(|e| e.role == role) {
            assert_eq!(e.offset, next, "{}", e.name);
            assert_eq!(e.numel, e.shape.iter().product::<usize>());
            next += e.numel;
        }
        let total = match role {
            TensorRole::Param => t.num_params(),
            TensorRole::Buffer => t.num_buffers(),
        };
        assert_eq!(next, total);
    }

    let lm =
        common::build_lazy(r#"{"kind":"lstm","variant":"word","vocab":20,"embed":8,"hidden":8}"#);
    assert!(lm.table().get("embedding.weight").is_some());
    assert!(
        lm.table().get("decoder_bias").is_some(),
        "tied model has a decoder bias only"
    );
    assert!(lm.table().get("decoder.weight").is_none());
}

#[test]
fn flatten_inject_round_trip_is_exact() {
    let mut a = build(RESNET, 1);
    let mut b = build(RESNET, 2);
    let n = a.table().num_params();
    let (mut pa, mut pb) = (vec![0.0f32; n], vec![0.0f32; n]);
    a.read_params(&mut pa);
    b.read_params(&mut pb);
    assert_ne!(pa, pb, "two inits differ");
    b.write_params(&pa);
    b.read_params(&mut pb);
    assert_eq!(pa, pb, "broadcast is bit-exact");

    // Arbitrary values survive, repeatedly (the storage-recycling path).
    let mut rng = dtrain_models::synthetic::SynthRng::new(3);
    for _ in 0..3 {
        let v: Vec<f32> = (0..n).map(|_| rng.next_f32() * 0.1).collect();
        a.write_params(&v);
        a.read_params(&mut pa);
        assert_eq!(pa, v);
    }

    // The injected parameters are the ones the model computes with: identical outputs.
    b.write_params(&pa);
    let batch = common::random_batch(a.as_ref(), 2, 0, 5);
    let la = a.evaluate(batch.clone()).unwrap();
    let lb = b.evaluate(batch).unwrap();
    assert_eq!(la, lb);
}

#[test]
fn written_parameters_stay_trainable() {
    let mut model = build(RESNET, 1);
    let n = model.table().num_params();
    let mut params = vec![0.0f32; n];
    model.read_params(&mut params);
    model.write_params(&params);
    let mut grads = vec![0.0f32; n];
    let batch = common::random_batch(model.as_ref(), 2, 0, 9);
    model.forward_backward(batch, &mut grads).unwrap();
    for e in model.table().params() {
        let g = &grads[e.offset..e.offset + e.numel];
        assert!(g.iter().any(|x| *x != 0.0), "{} has no gradient", e.name);
    }
}

#[test]
fn gradients_land_at_their_parameters_offsets() {
    // Finite differences on a tiny MLP, for a few coordinates of every tensor.
    let mut model = build(r#"{"kind":"mlp","image_size":3,"hidden":[5]}"#, 4);
    let n = model.table().num_params();
    let batch = common::random_batch(model.as_ref(), 4, 0, 6);
    let mut grads = vec![0.0f32; n];
    model.forward_backward(batch.clone(), &mut grads).unwrap();
    let mut params = vec![0.0f32; n];
    model.read_params(&mut params);
    let entries: Vec<_> = model.table().params().cloned().collect();
    for e in &entries {
        for k in [0, e.numel / 2, e.numel - 1] {
            let i = e.offset + k;
            let h = 5e-3f32;
            let mut p = params.clone();
            p[i] += h;
            model.write_params(&p);
            let up = common::train_loss(model.as_mut(), batch.clone());
            p[i] -= 2.0 * h;
            model.write_params(&p);
            let down = common::train_loss(model.as_mut(), batch.clone());
            let numeric = (up - down) / (2.0 * h as f64);
            assert!(
                (numeric - grads[i] as f64).abs() < 2e-3 + 0.05 * numeric.abs(),
                "{}[{k}]: analytic {} numeric {numeric}",
                e.name,
                grads[i]
            );
        }
    }
}

/// A model with a layer its forward pass never uses.
#[derive(Module, Debug)]
struct Partial {
    used: Linear,
    unused: Linear,
}

impl ImageClassifier for Partial {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        self.used.forward(images.flatten::<2>(1, 3))
    }
}

#[test]
fn unused_parameters_get_zero_gradients() {
    let device = common::device(0);
    let module = Partial {
        used: LinearConfig::new(4, 3).init(&device),
        unused: LinearConfig::new(2, 2).init(&device),
    };
    let input = InputSpec::Images {
        channels: 1,
        height: 2,
        width: 2,
        num_classes: 3,
    };
    let mut model = ImageModel::new("partial", module, input, &device);
    let n = model.table().num_params();
    assert_eq!(n, 4 * 3 + 3 + 2 * 2 + 2);
    let mut grads = vec![f32::NAN; n];
    let batch = Batch::images_from_slice(&[0.5, -1.0, 2.0, 0.1], [1, 1, 2, 2], &[1], &device);
    model.forward_backward(batch, &mut grads).unwrap();
    let unused = model.table().get("unused.weight").unwrap().offset;
    assert!(grads[..unused].iter().all(|g| g.is_finite()));
    assert!(grads[..unused].iter().any(|g| *g != 0.0));
    assert!(grads[unused..].iter().all(|g| *g == 0.0));
}

#[test]
fn batch_norm_buffers_round_trip_and_are_used() {
    let mut a = build(VGG_BN, 1);
    let nb = a.table().num_buffers();
    assert_eq!(nb, 2 * (64 + 128 + 256 * 2 + 512 * 4));
    let mut initial = vec![0.0f32; nb];
    a.read_buffers(&mut initial);
    // A training step moves the running statistics.
    let mut grads = vec![0.0f32; a.table().num_params()];
    let batch = common::random_batch(a.as_ref(), 4, 0, 2);
    a.forward_backward(batch.clone(), &mut grads).unwrap();
    let mut after = vec![0.0f32; nb];
    a.read_buffers(&mut after);
    assert_ne!(
        initial, after,
        "running statistics updated by the forward pass"
    );

    // Into a second replica with the same parameters: evaluation matches only once the
    // buffers are copied too.
    let mut b = build(VGG_BN, 2);
    let mut params = vec![0.0f32; a.table().num_params()];
    a.read_params(&mut params);
    b.write_params(&params);
    let eval_a = a.evaluate(batch.clone()).unwrap();
    assert_ne!(b.evaluate(batch.clone()).unwrap(), eval_a);
    b.write_buffers(&after);
    let mut back = vec![0.0f32; nb];
    b.read_buffers(&mut back);
    assert_eq!(back, after);
    assert_eq!(b.evaluate(batch).unwrap(), eval_a);
}

#[test]
fn records_round_trip_through_bytes() {
    let mut a = build(VGG_BN, 1);
    let mut grads = vec![0.0f32; a.table().num_params()];
    let batch = common::random_batch(a.as_ref(), 2, 0, 4);
    a.forward_backward(batch.clone(), &mut grads).unwrap();
    let bytes = a.to_bytes().unwrap();

    let mut b = build(VGG_BN, 2);
    b.load_bytes(&bytes).unwrap();
    let read = |m: &dyn Model| {
        let mut p = vec![0.0f32; m.table().num_params()];
        let mut s = vec![0.0f32; m.table().num_buffers()];
        m.read_params(&mut p);
        m.read_buffers(&mut s);
        (p, s)
    };
    assert_eq!(read(a.as_ref()), read(b.as_ref()));
    assert_eq!(
        a.evaluate(batch.clone()).unwrap(),
        b.evaluate(batch).unwrap()
    );

    // Garbage is an error and leaves the model as it was.
    let before = read(b.as_ref());
    assert!(b.load_bytes(&bytes[..bytes.len() / 2]).is_err());
    assert!(b.load_bytes(b"not a record").is_err());
    assert_eq!(read(b.as_ref()), before);
    // A record of another architecture is refused.
    let other = build(RESNET, 1).to_bytes().unwrap();
    assert!(b.load_bytes(&other).is_err());
}

#[test]
fn table_of_a_plain_module_matches_the_model_table() {
    let device = common::device(0);
    let module = dtrain_models::ResNetConfig::resnet20().init(&device);
    let model = build(r#"{"kind":"resnet","variant":"resnet20"}"#, 0);
    assert_eq!(&ParamTable::of(&module), model.table());
}

#[test]
fn wrong_batches_are_errors() {
    let mut model = build(RESNET, 0);
    let device = model.device().clone();
    let tokens = Batch::tokens_from_slice(&[1, 2], &[2, 3], [1, 2], &device);
    assert!(model.forward_loss(tokens).is_err());
    let small = Batch::images_from_slice(&[0.0; 3 * 8 * 8], [1, 3, 8, 8], &[0], &device);
    assert!(model.forward_loss(small).is_err());
    let mut lm = build(r#"{"kind":"lstm","variant":"char","vocab":10}"#, 0);
    let images = Batch::images_from_slice(&[0.0; 4], [1, 1, 2, 2], &[0], &device);
    assert!(lm.evaluate(images).is_err());
}
