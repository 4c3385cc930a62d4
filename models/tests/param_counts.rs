//! Parameter counts against the published ones (within 0.5%) and, where torchvision defines
//! the same architecture, exactly.
//!
//! Counted from the parameter table of freshly built modules: burn initializes parameters
//! lazily and the table reads declared shapes, so the 138 M-parameter VGG-16 costs nothing.

mod common;

use dtrain_models::{
    AlexNetConfig, LeNet5Config, MlpConfig, ParamTable, ResNetConfig, Shortcut, VggConfig,
};

fn within(count: usize, published: f64) {
    let rel = (count as f64 - published).abs() / published;
    assert!(
        rel <= 0.005,
        "{count} is {:.2}% from the published {published}",
        rel * 100.0
    );
}

#[test]
fn alexnet_imagenet_has_61_1_m() {
    let d = common::device(0);
    let n = ParamTable::of(&AlexNetConfig::imagenet().init(&d)).num_params();
    within(n, 61.1e6);
    assert_eq!(n, 61_100_840); // torchvision alexnet
    let lrn = ParamTable::of(&AlexNetConfig::imagenet().with_lrn(true).init(&d)).num_params();
    assert_eq!(lrn, n, "LRN has no parameters");
}

#[test]
fn vgg16_has_138_4_m() {
    let d = common::device(0);
    let n = ParamTable::of(&VggConfig::vgg16().init(&d)).num_params();
    within(n, 138.4e6);
    assert_eq!(n, 138_357_544); // torchvision vgg16
                                // With BatchNorm: +2 per channel, and no convolution biases (they precede a BatchNorm).
    let bn = ParamTable::of(&VggConfig::vgg16_bn().init(&d));
    assert_eq!(bn.num_params(), 138_357_544 + 4224 * 2 - 4224);
    assert_eq!(bn.num_buffers(), 4224 * 2);
}

#[test]
fn resnet50_has_25_6_m() {
    let d = common::device(0);
    let n = ParamTable::of(&ResNetConfig::resnet50().init(&d)).num_params();
    within(n, 25.6e6);
    assert_eq!(n, 25_557_032); // torchvision resnet50
}

#[test]
fn resnet18_and_34_match_torchvision() {
    let d = common::device(0);
    assert_eq!(
        ParamTable::of(&ResNetConfig::resnet18().init(&d)).num_params(),
        11_689_512
    );
    assert_eq!(
        ParamTable::of(&ResNetConfig::resnet34().init(&d)).num_params(),
        21_797_672
    );
}

#[test]
fn resnet20_has_0_27_m() {
    let d = common::device(0);
    let a = ParamTable::of(&ResNetConfig::resnet20().init(&d)).num_params();
    within(a, 0.27e6);
    assert_eq!(a, 269_722); // option A: parameter-free shortcuts
    let b = ResNetConfig::resnet20().with_shortcut(Shortcut::B);
    let b = ParamTable::of(&b.init(&d)).num_params();
    // Two 1×1 projections (16→32, 32→64) with BatchNorm.
    assert_eq!(b, a + 16 * 32 + 32 * 64 + 2 * (32 + 64));
}

#[test]
fn deeper_cifar_resnets_follow_6n_plus_2() {
    let d = common::device(0);
    // Published (He et al. 2016, Table 6): 0.46 M, 0.85 M, 1.7 M.
    for (cfg, published) in [
        (ResNetConfig::resnet32(), 0.46e6),
        (ResNetConfig::resnet56(), 0.85e6),
        (ResNetConfig::resnet110(), 1.7e6),
    ] {
        let n = ParamTable::of(&cfg.init(&d)).num_params();
        let rel = (n as f64 - published).abs() / published;
        assert!(rel < 0.02, "{n} vs {published}");
    }
}

#[test]
fn small_models_have_their_textbook_counts() {
    let d = common::device(0);
    assert_eq!(
        ParamTable::of(&LeNet5Config::mnist().init(&d)).num_params(),
        61_706
    );
    assert_eq!(
        ParamTable::of(&MlpConfig::mnist().init(&d)).num_params(),
        535_818
    );
    let cifar = ParamTable::of(&AlexNetConfig::cifar().init(&d)).num_params();
    assert_eq!(cifar, 2_472_266);
    let fc = ParamTable::of(&AlexNetConfig::cifar_fc().init(&d)).num_params();
    within(fc, 23.3e6);
}
