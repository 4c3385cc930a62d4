//! The dtrain half of the PyTorch round trip (`experiments/vs_pytorch/roundtrip.py`):
//! writes a model's seeded initial weights as safetensors with PyTorch's names, or loads
//! such a file and prints the evaluation loss of dtrain's synthetic batch (the batch
//! `dtrain bench models` draws, which `models.py` mirrors).
//!
//! ```text
//! cargo run -p dtrain-framework --example safetensors_eval -- MODEL init OUT.safetensors
//! cargo run -p dtrain-framework --example safetensors_eval -- MODEL eval IN.safetensors [BATCH] [SEQ_LEN]
//! ```
//! `MODEL` is a `dtrain bench models` name (`lenet/lenet5`, `resnet/resnet20`,
//! `alexnet/cifar`, `gpt/mini`); weights and batch are drawn from seed 7. `eval` prints one
//! JSON line: `{"model": …, "loss": …, "count": …}` (evaluation mode: no dropout, BatchNorm
//! on its running statistics).

use std::path::Path;
use std::process::ExitCode;

use dtrain_framework::bench::models::parse_model;
use dtrain_framework::export::{load_into, write_weights};
use dtrain_models::{cpu_device, SyntheticBatch};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("safetensors_eval: error: {e}");
            ExitCode::from(1)
        }
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [name, mode, file, rest @ ..] = args.as_slice() else {
        return Err("usage: safetensors_eval MODEL (init|eval) FILE [BATCH] [SEQ_LEN]".into());
    };
    let number = |i: usize, default: usize| -> Result<usize, String> {
        rest.get(i).map_or(Ok(default), |s| {
            s.parse().map_err(|e| format!("{s:?}: {e}"))
        })
    };
    let (spec, _) = parse_model(name, false)?;
    let device = cpu_device();
    device.seed(7);
    let mut model = spec.build(&device).map_err(|e| e.to_string())?;
    let table = model.table().clone();
    let mut params = vec![0.0; table.num_params()];
    let mut buffers = vec![0.0; table.num_buffers()];
    model.read_params(&mut params);
    model.read_buffers(&mut buffers);
    match mode.as_str() {
        "init" => {
            write_weights(&spec, &table, &params, &buffers, 0, Path::new(file))
                .map_err(|e| e.to_string())?;
        }
        "eval" => {
            load_into(&spec, model.as_mut(), Path::new(file)).map_err(|e| e.to_string())?;
            let lm = spec.is_language_model();
            let batch = number(0, if lm { 20 } else { 32 })?;
            let seq_len = number(1, 35)?;
            let b = SyntheticBatch::new(model.input(), batch, seq_len, 7);
            model.reset_state();
            let m = model.evaluate(b.on(&device)).map_err(|e| e.to_string())?;
            println!(
                "{}",
                serde_json::json!({"model": name, "loss": m.loss, "count": m.count})
            );
        }
        other => return Err(format!("unknown mode {other:?} (init or eval)")),
    }
    Ok(())
}
