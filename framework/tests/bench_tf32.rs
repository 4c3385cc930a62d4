//! `dtrain bench models` with the TF32 emulation forced on, CPU against CPU: the emulated
//! reference steps run and report what TF32 does to each model. A test binary of its own:
//! the emulation is process-wide (`dtrain_models::precision`) and would change the products
//! of tests running beside it.

use dtrain_framework::bench::models::{run, table_row, Options};
use dtrain_framework::device::DeviceKind;
use dtrain_models::precision::{tf32_emulation, Tf32};

#[test]
fn the_emulated_references_say_what_tf32_does_to_each_model() {
    let opts = Options {
        models: vec![
            "lenet/lenet5".into(),
            "lstm/word:vocab=50,hidden=16,embed=16".into(),
        ],
        reference: Some(DeviceKind::Cpu),
        tf32_emulation: Some(true),
        batch: Some(4),
        seq_len: 5,
        warmup: 1,
        steps: 1,
        ..Options::default()
    };
    let rows = run(&opts, |p| assert!(!p.tf32), |_| ()).unwrap();
    assert_eq!(tf32_emulation(), Tf32::Off, "switched off after the model");
    for r in &rows {
        let c = r.check.as_ref().unwrap();
        // The device is the CPU: f32 against f32, so the tolerance is the plain one.
        assert!(c.passed && c.grad_rel_err == 0.0, "{r:?}");
        assert_eq!(c.tolerance, 1e-3);
        let e = c.tf32_emulated.expect("forced on");
        for (what, err) in [
            ("nearest", e.nearest.grad_rel_err),
            ("truncated", e.truncated.grad_rel_err),
        ] {
            // TF32 moves the gradients, by about its rounding and far less than all of them.
            assert!(err > 1e-6 && err < 0.5, "{}: {what} {err}", r.model);
        }
        let row = table_row(r);
        assert_eq!(row.contains('*'), r.model.starts_with("lstm"), "{row}");
    }
    let covers: Vec<bool> = rows
        .iter()
        .map(|r| {
            r.check
                .as_ref()
                .unwrap()
                .tf32_emulated
                .unwrap()
                .covers_every_product
        })
        .collect();
    assert_eq!(
        covers,
        [true, false],
        "LeNet-5's products all, the LSTM's not"
    );

    // Seeded: the same run gives the same numbers.
    let again = run(&opts, |_| (), |_| ()).unwrap();
    let grads = |rows: &[dtrain_framework::bench::models::Row]| {
        rows.iter()
            .map(|r| {
                let e = r.check.as_ref().unwrap().tf32_emulated.unwrap();
                (e.nearest.grad_rel_err, e.truncated.grad_rel_err)
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(grads(&rows), grads(&again));
}
