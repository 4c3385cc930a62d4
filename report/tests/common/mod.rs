//! Synthetic run directories, written the way the trainer writes them.

#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::json;

/// Per-step phase times (seconds), constant over the run.
#[derive(Clone, Copy)]
pub struct Times {
    pub data: f64,
    pub forward: f64,
    pub backward: f64,
    pub compress: f64,
    pub communicate: f64,
    pub decompress: f64,
    pub wait: f64,
    pub optimizer: f64,
    pub step: f64,
}

impl Times {
    /// A step of `step` seconds: compute 60 %, compress 5 %, decompress 5 %, waiting 30 %.
    pub fn split(step: f64) -> Times {
        Times {
            data: 0.1 * step,
            forward: 0.2 * step,
            backward: 0.25 * step,
            compress: 0.05 * step,
            communicate: 0.3 * step,
            decompress: 0.05 * step,
            wait: 0.3 * step,
            optimizer: 0.05 * step,
            step,
        }
    }

    pub fn json(&self) -> serde_json::Value {
        json!({
            "data_s": self.data, "forward_s": self.forward, "backward_s": self.backward,
            "compress_s": self.compress, "communicate_s": self.communicate,
            "decompress_s": self.decompress, "wait_s": self.wait,
            "optimizer_s": self.optimizer, "step_s": self.step,
        })
    }
}

/// What to write.
#[derive(Clone)]
pub struct Spec {
    pub name: String,
    pub model: String,
    pub method: String,
    pub workers: usize,
    pub network: Option<(String, String)>,
    pub steps: u64,
    pub times: Times,
    pub params: u64,
    pub payload: u64,
    pub bytes_sent: u64,
    pub summary: bool,
    /// `(epoch, step, loss, accuracy, perplexity)`.
    pub evals: Vec<(u64, u64, f64, f64, f64)>,
    /// Extra `[compress]` lines.
    pub compress_extra: String,
}

impl Spec {
    /// A complete 10-step mlp run of `method` on 2 workers with 1e6 parameters.
    pub fn new(name: &str, method: &str) -> Spec {
        Spec {
            name: name.into(),
            model: "mlp".into(),
            method: method.into(),
            workers: 2,
            network: None,
            steps: 10,
            times: Times::split(0.010),
            params: 1_000_000,
            payload: 4_000_000,
            bytes_sent: 4_000_100,
            summary: true,
            evals: vec![(0, 5, 0.9, 0.7, 2.46), (1, 10, 0.5, 0.85, 1.65)],
            compress_extra: String::new(),
        }
    }

    pub fn workers(mut self, p: usize) -> Spec {
        self.workers = p;
        self
    }

    pub fn step_s(mut self, s: f64) -> Spec {
        self.times = Times::split(s);
        self
    }

    pub fn payload(mut self, payload: u64, sent: u64) -> Spec {
        self.payload = payload;
        self.bytes_sent = sent;
        self
    }

    pub fn network(mut self, bw: &str, lat: &str) -> Spec {
        self.network = Some((bw.into(), lat.into()));
        self
    }

    pub fn no_summary(mut self) -> Spec {
        self.summary = false;
        self
    }

    fn loss(step: u64) -> f64 {
        2.3 / (1.0 + step as f64 * 0.1)
    }

    pub fn step_line(&self, step: u64, loss: f64, times: &Times) -> String {
        json!({
            "step": step, "epoch": step / 5, "loss": loss, "accuracy": 0.5, "lr": 0.05,
            "ratio_name": null, "ratio": null,
            "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_sent,
            "payload_bytes": self.payload, "skipped": false, "samples": 64 * self.workers,
            "time": times.json(),
            "some_future_field": [1, 2, 3],
        })
        .to_string()
    }

    pub fn config(&self) -> String {
        let mut s = format!(
            "name = \"{}\"\nseed = 1\n\n[model]\nkind = \"{}\"\n\n[data]\nkind = \"synthetic\"\nbatch_size = 64\n\n\
             [train]\nepochs = 2\n\n[cluster]\nworkers = {}\ntransport = \"tcp\"\n\n[network]\n",
            self.name, self.model, self.workers
        );
        if let Some((bw, lat)) = &self.network {
            s += &format!("bandwidth = \"{bw}\"\nlatency = \"{lat}\"\n");
        }
        s += &format!(
            "\n[compress]\nkind = \"{}\"\n{}\n[output]\ndir = \"runs\"\n",
            self.method, self.compress_extra
        );
        s
    }

    pub fn summary_json(&self) -> serde_json::Value {
        let fe = self.evals.last().map(|&(e, s, l, a, p)| {
            json!({"epoch": e, "step": s, "loss": l, "accuracy": a, "perplexity": p, "count": 1000})
        });
        json!({
            "name": self.name, "model": self.model, "method": self.method,
            "workers": self.workers, "steps": self.steps, "steps_this_session": self.steps,
            "resumed_from": 0, "final_eval": fe, "final_train_loss": Spec::loss(self.steps - 1),
            "mean_step": self.times.json(),
            "bytes_sent_per_step": self.bytes_sent as f64,
            "payload_bytes_per_step": self.payload as f64,
            "params": self.params,
            "compression_ratio": 4.0 * self.params as f64 / self.payload as f64,
            "samples_per_s": 64.0 * self.workers as f64 / self.times.step,
            "wall_s": self.times.step * self.steps as f64,
            "skipped_steps": 0, "recoveries": 0, "theta_scale": 1.0,
            "new_summary_field": "ignored",
        })
    }

    /// Writes the run into `root/rel` and returns that directory.
    pub fn write(&self, root: &Path, rel: &str) -> PathBuf {
        let dir = root.join(rel);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("config.toml"), self.config()).unwrap();
        let mut m = String::new();
        for s in 0..self.steps {
            m += &self.step_line(s, Spec::loss(s), &self.times);
            m.push('\n');
        }
        fs::write(dir.join("metrics.jsonl"), m).unwrap();
        let mut e = String::new();
        for &(ep, st, l, a, p) in &self.evals {
            e += &json!({"epoch": ep, "step": st, "loss": l, "accuracy": a, "perplexity": p, "count": 1000})
                .to_string();
            e.push('\n');
        }
        fs::write(dir.join("eval.jsonl"), e).unwrap();
        if self.summary {
            fs::write(
                dir.join("summary.json"),
                serde_json::to_string_pretty(&self.summary_json()).unwrap(),
            )
            .unwrap();
        }
        dir
    }
}

/// Rewrites every step record of `dir/metrics.jsonl` with `edit(step, record)`.
pub fn edit_steps(dir: &Path, edit: impl Fn(u64, &mut serde_json::Value)) {
    let path = dir.join("metrics.jsonl");
    let lines: Vec<String> = fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let step = v["step"].as_u64().unwrap();
            edit(step, &mut v);
            v.to_string()
        })
        .collect();
    fs::write(&path, lines.join("\n") + "\n").unwrap();
}

/// Checks a PNG file: signature, and it decodes to a non-empty image.
pub fn check_png(path: &Path) {
    let bytes = fs::read(path).unwrap();
    assert!(
        bytes.starts_with(&[0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n']),
        "{} is not a PNG",
        path.display()
    );
    let img = image::load_from_memory_with_format(&bytes, image::ImageFormat::Png)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(img.width() > 100 && img.height() > 100);
    // Something was drawn: not a single colour.
    let rgb = img.to_rgb8();
    let first = *rgb.get_pixel(0, 0);
    assert!(
        rgb.pixels().any(|p| *p != first),
        "{} is blank",
        path.display()
    );
}

/// Checks an SVG file: an `<svg` element, closed, with some text drawn.
pub fn check_svg(path: &Path) {
    let s = fs::read_to_string(path).unwrap();
    let start = s
        .find("<svg")
        .unwrap_or_else(|| panic!("{}: no <svg", path.display()));
    assert!(s[..start].trim().is_empty() || s[..start].trim_start().starts_with("<?xml"));
    assert!(
        s.trim_end().ends_with("</svg>"),
        "{}: not closed",
        path.display()
    );
    assert!(s.contains("<text"), "{}: no text", path.display());
    assert_eq!(s.matches("<svg").count(), s.matches("</svg>").count());
}

/// Checks every plot in `files` (`.svg` / `.png`), and that they come in pairs.
pub fn check_plots(files: &[PathBuf]) {
    let svgs: Vec<_> = files
        .iter()
        .filter(|p| p.extension().unwrap() == "svg")
        .collect();
    let pngs: Vec<_> = files
        .iter()
        .filter(|p| p.extension().unwrap() == "png")
        .collect();
    assert_eq!(svgs.len(), pngs.len());
    for s in svgs {
        check_svg(s);
        assert!(pngs.contains(&&s.with_extension("png")));
    }
    for p in pngs {
        check_png(p);
    }
}

/// The file names (not paths) in `files`.
pub fn names(files: &[PathBuf]) -> Vec<String> {
    files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}
