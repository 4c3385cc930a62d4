//! `dtrain bench compress`: throughput, bits per element and reconstruction error of every
//! compressor on one input vector, single thread.
//!
//! Throughput is GB/s of f32 *input* (4 bytes per element) — for decompression too, so the
//! two columns are comparable. Each timing is the best of `repeat` runs after one warm-up.

use std::ops::Range;
use std::time::Instant;

use dtrain_compress::{
    compress, decompress, Aggregation, CompressorConfig, Ctx, Payload, Rng, METHODS,
};
use serde::Serialize;

use super::gradient::{layer_lengths, synthesize, Shape};

/// Benchmark options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Methods to run, each `name` or `name:key=value,key=value` (TOML values).
    /// Empty means every registered method with its defaults.
    pub methods: Vec<String>,
    /// Timed repetitions per phase (best is reported).
    pub repeat: usize,
    /// Treat the input as the layered vector's layers (per-tensor statistics) instead of
    /// one tensor.
    pub per_layer: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            methods: Vec::new(),
            repeat: 5,
            per_layer: false,
        }
    }
}

/// One row of the result table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Method name as given (with parameters, if any).
    pub method: String,
    /// The resolved configuration.
    pub config: serde_json::Value,
    /// How payloads combine across workers.
    pub aggregation: Aggregation,
    /// Elements in the input.
    pub elements: usize,
    /// Encoded payload size in bytes (header included).
    pub payload_bytes: usize,
    /// `8 · payload_bytes / elements`.
    pub bits_per_element: f64,
    /// `32 / bits_per_element`.
    pub compression_ratio: f64,
    /// Compression throughput, GB/s of f32 input.
    pub compress_gbps: f64,
    /// Decompression (decode + add) throughput, GB/s of f32 output.
    pub decompress_gbps: f64,
    /// Best compression time, milliseconds.
    pub compress_ms: f64,
    /// Best decompression time, milliseconds.
    pub decompress_ms: f64,
    /// `‖g − D(C(g))‖ / ‖g‖`.
    pub rel_error: f64,
}

/// Parses `name` or `name:key=value,key=value` into a method config.
pub fn parse_method(spec: &str) -> Result<CompressorConfig, String> {
    let (name, params) = match spec.split_once(':') {
        Some((n, p)) => (n.trim(), p),
        None => (spec.trim(), ""),
    };
    if !METHODS.iter().any(|m| m.name == name) {
        let known: Vec<&str> = METHODS.iter().map(|m| m.name).collect();
        return Err(format!(
            "unknown method {name:?}; known: {}",
            known.join(", ")
        ));
    }
    let mut doc = format!("kind = {name:?}\n");
    for kv in params.split(',').filter(|s| !s.trim().is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("{spec}: parameter {kv:?} is not key=value"))?;
        let v = v.trim();
        // Bare words become strings; numbers, booleans and quoted strings pass through.
        let is_literal = v.parse::<f64>().is_ok()
            || v == "true"
            || v == "false"
            || v.starts_with('"')
            || v.starts_with('[');
        if is_literal {
            doc.push_str(&format!("{} = {}\n", k.trim(), v));
        } else {
            doc.push_str(&format!("{} = {:?}\n", k.trim(), v));
        }
    }
    toml::from_str(&doc).map_err(|e| format!("{spec}: {e}"))
}

fn segments_of(lens: &[usize]) -> Vec<Range<usize>> {
    let mut at = 0;
    lens.iter()
        .map(|&l| {
            let r = at..at + l;
            at += l;
            r
        })
        .collect()
}

/// Runs the benchmark on `input`.
pub fn run(input: &[f32], opts: &Options) -> Result<Vec<Row>, String> {
    let specs: Vec<String> = if opts.methods.is_empty() {
        METHODS.iter().map(|m| m.name.to_string()).collect()
    } else {
        opts.methods.clone()
    };
    let n = input.len();
    let segs = if opts.per_layer {
        segments_of(&layer_lengths(n))
    } else {
        Vec::new()
    };
    let ctx = Ctx {
        step: 1,
        rank: 0,
        bucket: 0,
        segments: &segs,
    };
    let norm: f64 = input
        .iter()
        .map(|&v| (v as f64) * (v as f64))
        .sum::<f64>()
        .sqrt();
    let repeat = opts.repeat.max(1);
    let mut rows = Vec::new();
    for spec in specs {
        let cfg = parse_method(&spec)?;
        let mut c = cfg.build().map_err(|e| format!("{spec}: {e}"))?;
        let mut payload = Payload::new();
        let mut out = vec![0f32; n];
        let mut best_c = f64::INFINITY;
        for i in 0..=repeat {
            let mut rng = Rng::for_step(0, 1, 0, 0);
            let t = Instant::now();
            compress(c.as_mut(), input, &ctx, &mut rng, &mut payload)
                .map_err(|e| format!("{spec}: {e}"))?;
            let dt = t.elapsed().as_secs_f64();
            if i > 0 {
                best_c = best_c.min(dt);
            }
        }
        let mut best_d = f64::INFINITY;
        for i in 0..=repeat {
            let t = Instant::now();
            decompress(c.as_ref(), payload.as_bytes(), &mut out)
                .map_err(|e| format!("{spec}: {e}"))?;
            let dt = t.elapsed().as_secs_f64();
            if i > 0 {
                best_d = best_d.min(dt);
            }
        }
        let err: f64 = input
            .iter()
            .zip(&out)
            .map(|(&a, &b)| {
                let d = a as f64 - b as f64;
                d * d
            })
            .sum::<f64>()
            .sqrt();
        let bytes = payload.encoded_len();
        let bpe = 8.0 * bytes as f64 / n.max(1) as f64;
        let gb = 4.0 * n as f64 / 1e9;
        rows.push(Row {
            method: spec.clone(),
            config: serde_json::to_value(&cfg).unwrap_or(serde_json::Value::Null),
            aggregation: c.aggregation(),
            elements: n,
            payload_bytes: bytes,
            bits_per_element: bpe,
            compression_ratio: if bpe > 0.0 { 32.0 / bpe } else { 0.0 },
            compress_gbps: gb / best_c,
            decompress_gbps: gb / best_d,
            compress_ms: best_c * 1e3,
            decompress_ms: best_d * 1e3,
            rel_error: if norm > 0.0 { err / norm } else { 0.0 },
        });
    }
    Ok(rows)
}

/// Runs on a synthetic input of `n` elements.
pub fn run_synthetic(shape: Shape, n: usize, opts: &Options) -> Result<Vec<Row>, String> {
    run(&synthesize(shape, n, 42), opts)
}

/// Renders rows as a fixed-width text table.
pub fn table(rows: &[Row]) -> String {
    let w = rows
        .iter()
        .map(|r| r.method.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let mut s = format!(
        "{:<w$}  {:>9}  {:>8}  {:>10}  {:>12}  {:>9}  {:>10}\n",
        "method", "bits/elem", "ratio", "comp GB/s", "decomp GB/s", "rel err", "aggregation"
    );
    for r in rows {
        s.push_str(&format!(
            "{:<w$}  {:>9.3}  {:>7.1}x  {:>10.3}  {:>12.3}  {:>9.4}  {:>10}\n",
            r.method,
            r.bits_per_element,
            r.compression_ratio,
            r.compress_gbps,
            r.decompress_gbps,
            r.rel_error,
            format!("{:?}", r.aggregation).to_lowercase(),
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_method_runs_and_reports_sane_numbers() {
        let opts = Options {
            repeat: 1,
            ..Options::default()
        };
        let rows = run_synthetic(Shape::Layered, 20_000, &opts).unwrap();
        assert_eq!(rows.len(), METHODS.len());
        for r in &rows {
            assert!(
                r.compress_gbps > 0.0 && r.decompress_gbps > 0.0,
                "{}",
                r.method
            );
            assert!(r.rel_error.is_finite() && r.rel_error >= 0.0);
            assert!(r.bits_per_element > 0.0);
        }
        let none = rows.iter().find(|r| r.method == "none").unwrap();
        assert_eq!(none.rel_error, 0.0);
        assert!((none.bits_per_element - 32.0).abs() < 0.01);
        let json = serde_json::to_string(&rows).unwrap();
        let back: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(back.as_array().unwrap().len(), rows.len());
    }

    #[test]
    fn method_specs_parse_with_parameters() {
        let c = parse_method("topk:ratio=0.001").unwrap();
        assert_eq!(c.name(), "topk");
        assert!(parse_method("topk:ratoi=0.1")
            .unwrap_err()
            .contains("ratoi"));
        assert!(parse_method("nope").unwrap_err().contains("known"));
        assert!(parse_method("topk:ratio").is_err());
    }
}
