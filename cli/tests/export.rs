//! `dtrain export` and `[model] init_from` through the real binary (issue #54): a short run
//! with TensorBoard on, its export, a run started from the export, and bad input (a
//! truncated file, another architecture, an unknown step) as one error line and exit 1.
//! CI's `experiments/vs_pytorch/interop_check.py` reads the same files with TensorBoard's and
//! safetensors' own Python readers.

use std::path::Path;
use std::process::{Command, Output};

fn dtrain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dtrain"))
        .args(args)
        .output()
        .unwrap()
}

const CONFIG: &str = r#"
name = "export_smoke"
seed = 5
[model]
kind = "mlp"
in_channels = 1
image_size = 8
hidden = [16]
[data]
kind = "synthetic"
shape = [1, 8, 8]
train_len = 64
test_len = 32
batch_size = 8
[train]
lr = 0.05
epochs = 1
[cluster]
workers = 1
[output]
tensorboard = true
"#;

/// The safetensors header: tensor name → shape (the JSON after the 8-byte length).
fn header(path: &Path) -> serde_json::Map<String, serde_json::Value> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let v: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    v.as_object().unwrap().clone()
}

fn one_error_line(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(
        errors[0].contains(needle),
        "{:?} lacks {needle:?}",
        errors[0]
    );
}

#[test]
fn export_writes_pytorch_names_and_init_from_reads_them_back() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("c.toml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let run = tmp.path().join("run");
    let (cfg_s, run_s) = (cfg.to_str().unwrap(), run.to_str().unwrap());
    let out = dtrain(&["run", cfg_s, "--run-dir", run_s]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let events: Vec<_> = std::fs::read_dir(&run)
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("events.out.tfevents.")
        })
        .collect();
    assert_eq!(events.len(), 1, "one TensorBoard event file");

    let file = tmp.path().join("mlp.safetensors");
    let file_s = file.to_str().unwrap();
    let out = dtrain(&["export", run_s, "--out", file_s]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let h = header(&file);
    // The twin's names; Linear weights in PyTorch's [out, in].
    assert_eq!(h["layers.0.weight"]["shape"], serde_json::json!([16, 64]));
    assert_eq!(h["layers.1.weight"]["shape"], serde_json::json!([10, 16]));
    assert_eq!(h["layers.1.bias"]["dtype"], "F32");
    assert_eq!(h["__metadata__"]["format"], "pt");

    let init = format!("model.init_from={file_s:?}");
    let out = dtrain(&["check", cfg_s, "--set", &init]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let cut = tmp.path().join("cut.safetensors");
    std::fs::write(&cut, &std::fs::read(&file).unwrap()[..100]).unwrap();
    let cut_set = format!("model.init_from={:?}", cut.to_str().unwrap());
    one_error_line(
        &dtrain(&["run", cfg_s, "--set", &cut_set]),
        "cut.safetensors: not a readable safetensors file",
    );
    one_error_line(
        &dtrain(&["check", cfg_s, "--set", &init, "--set", "model.hidden=[32]"]),
        "tensor \"layers.0.weight\" has shape [16, 64], this model's is [32, 64]",
    );
    one_error_line(
        &dtrain(&["export", run_s, "--step", "3", "--out", file_s]),
        "no checkpoint at step 3",
    );
    one_error_line(
        &dtrain(&["export", tmp.path().to_str().unwrap(), "--out", file_s]),
        "no checkpoint",
    );
}
