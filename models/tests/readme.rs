//! The README's "adding a model" example is this test's module, verbatim, and it trains.

mod common;
mod readme_example;

use dtrain_models::{Model, ModelFamily};
use readme_example::TinyCnnSpec;

#[test]
fn readme_shows_the_example_verbatim() {
    let readme = include_str!("../README.md");
    let example = include_str!("readme_example/mod.rs");
    let start = readme.find("```rust\n").expect("README has a rust block") + "```rust\n".len();
    let len = readme[start..].find("```").expect("closed block");
    assert_eq!(readme[start..start + len].trim(), example.trim());
}

#[test]
fn readme_example_builds_from_toml_and_trains_one_step() {
    let spec: TinyCnnSpec = toml::from_str("width = 8\nnum_classes = 4\n").unwrap();
    assert!(toml::from_str::<TinyCnnSpec>("widht = 8\n").is_err());
    let mut model: Box<dyn Model> = common::seeded(1, |device| {
        let model = spec.build(device).unwrap();
        let mut params = vec![0.0f32; model.table().num_params()];
        model.read_params(&mut params); // lazy init while the RNG is seeded
        model
    });
    assert_eq!(model.name(), "tinycnn");
    assert_eq!(
        model.table().num_params(),
        (3 * 8 * 9 + 8) + (8 * 8 * 9 + 8) + (8 * 4 + 4)
    );
    let batch = common::random_batch(model.as_ref(), 4, 0, 3);
    let (before, after) = common::sgd_step(model.as_mut(), batch, 0.1);
    assert!(after < before, "{before} → {after}");
}
