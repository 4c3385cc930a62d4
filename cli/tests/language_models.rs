//! Language models through the real binary: `model.vocab` defaults to the corpus vocabulary
//! (GPT and LSTM alike), `dtrain check` refuses a wrong one exactly as `dtrain run` does, and
//! a GPT's `data.seq_len` longer than its `model.context` is refused at validation. Needs the
//! Moby Dick corpus (`dtrain data fetch moby-dick` under `DTRAIN_DATA_DIR`, done by CI).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn dtrain() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dtrain"))
}

/// A one-worker, 3-step character-level run of `model` (the `[model]` table's lines).
fn config(out: &Path, model: &str) -> String {
    format!(
        r#"
name = "lm_vocab"
seed = 1
[model]
{model}
[data]
kind = "moby-dick"
batch_size = 4
seq_len = 16
train_limit = 4096
test_limit = 256
[train]
lr = 0.1
max_steps = 3
[cluster]
workers = 1
[checkpoint]
every_epochs = 0
[output]
dir = "{}"
"#,
        out.display()
    )
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn dtrain_on(cmd: &str, file: &Path) -> Output {
    dtrain()
        .args([cmd, file.to_str().unwrap(), "--no-fetch"])
        .output()
        .unwrap()
}

/// `cmd` on `file` fails with one line naming the file and `field`.
fn refused(cmd: &str, file: &Path, field: &str) {
    let o = dtrain_on(cmd, file);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{cmd} {}: succeeded", file.display());
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{cmd}: {err}");
    let name = file.file_name().unwrap().to_str().unwrap();
    assert!(
        lines[0].contains(name) && lines[0].contains(field),
        "{cmd}: {err}"
    );
}

#[test]
fn model_vocab_defaults_to_the_corpus_and_a_wrong_one_is_refused_by_check_and_run() {
    if std::env::var_os("DTRAIN_DATA_DIR").is_none() {
        eprintln!("skipped: DTRAIN_DATA_DIR is not set (CI sets it and fetches the corpus)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("runs");
    let gpt = "kind = \"gpt\"\nlayers = 1\nd_model = 16\nheads = 2\ncontext = 16";
    let lstm = "kind = \"lstm\"\nvariant = \"char\"\nembed = 8\nhidden = 16";

    // No vocab: `check` accepts it and `run` trains with the corpus's, which the run's
    // config.toml records.
    let p = write(tmp.path(), "gpt.toml", &config(&out, gpt));
    let o = dtrain_on("check", &p);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("ok: gpt"));
    let o = dtrain_on("run", &p);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let run = std::fs::read_dir(out.join("lm_vocab"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let written = std::fs::read_to_string(run.join("config.toml")).unwrap();
    let vocab: usize = written
        .lines()
        .find_map(|l| l.strip_prefix("vocab = "))
        .expect("config.toml records the vocabulary")
        .parse()
        .unwrap();
    assert!((30..200).contains(&vocab), "{vocab} characters");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["steps"], 3);
    assert_eq!(summary["model"], "gpt");

    // The right vocab given explicitly is accepted; a wrong one is refused by `check` (which
    // used to pass it) and by `run`, naming model.vocab, and nothing is written.
    let right = write(
        tmp.path(),
        "right.toml",
        &config(&out, &format!("{gpt}\nvocab = {vocab}")),
    );
    assert!(dtrain_on("check", &right).status.success());
    let out_bad = tmp.path().join("runs_bad");
    for (name, model) in [("gpt_wrong.toml", gpt), ("lstm_wrong.toml", lstm)] {
        let text = config(&out_bad, &format!("{model}\nvocab = {}", vocab + 1));
        let p = write(tmp.path(), name, &text);
        refused("check", &p, "model.vocab");
        refused("run", &p, "model.vocab");
    }
    assert!(
        !out_bad.exists(),
        "a refused run wrote {}",
        out_bad.display()
    );

    // The LSTM takes the default as well.
    let p = write(tmp.path(), "lstm.toml", &config(&out, lstm));
    let o = dtrain_on("check", &p);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // Sequences longer than the GPT's context: refused at validation, naming both keys.
    let long = config(&out, gpt).replace("seq_len = 16", "seq_len = 17");
    let p = write(tmp.path(), "long.toml", &long);
    refused("check", &p, "data.seq_len");
    let o = dtrain_on("check", &p);
    assert!(String::from_utf8_lossy(&o.stderr).contains("model.context = 16"));
}
