//! `dtrain bench compress`: throughput, bits per element and reconstruction error of every
//! compressor on one input vector, single thread.
//!
//! Throughput is GB/s of f32 *input* (4 bytes per element) — for decompression too, so the
//! two columns are comparable. Each timing is the best of `repeat` runs after one warm-up.
//!
//! What a training step pays for the same gradient takes three options together: the model's
//! tensors as the segments ([`Options::layers`]: the FFT transforms each tensor, a per-tensor
//! method keeps per-tensor statistics, and one long segment of awkward length can cost far
//! more than the model's own), error feedback ([`Options::error_feedback`]: compressing then
//! includes compensating the gradient and updating the residual, which for a transform method
//! is a second, inverse transform), and the receivers' work ([`Options::workers`]: decoding P
//! payloads into their sum, with the method's joint decoder where it has one, as an all-gather
//! receiver does).
//!
//! Every row also carries the **single-pass read** of the same input on the same thread
//! ([`read_gbps`], timed in the same run): the speed of light of a compressor that reads its
//! input once, against which `comp/read` puts each method (issue #25's goal: at least 60 %
//! of it, or ten times GRACE's figure for the method).

use std::ops::Range;
use std::time::Instant;

use dtrain_compress::{
    Aggregation, CompressorConfig, Ctx, MemoryConfig, Payload, Pipeline, Rng, METHODS,
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
    /// Treat the input as one `rows × cols` matrix (methods that use a tensor's shape:
    /// PowerSGD, meProp's columns).
    pub shape: Option<(usize, usize)>,
    /// Compressions of the input, stateful methods keeping their state from one to the next
    /// (PowerSGD's warm-started `Q`); the error reported is the last one's. 0: `repeat + 1`
    /// (one warm-up, then the timed runs).
    pub rounds: usize,
    /// The input's tensors, by shape, in order (their sizes must add up to the input's): one
    /// segment each, the shapes told to the compressor. `None`: see `per_layer` / `shape`.
    pub layers: Option<Vec<Vec<usize>>>,
    /// Compress through the residual error-feedback memory (`compress.error_feedback`), so
    /// the compress time includes compensating and updating the residual. The error column
    /// is then the last payload's, which carries the residual of the rounds before.
    pub error_feedback: bool,
    /// Decompression decodes this many payloads into their sum (an all-gather receiver's
    /// work at this many workers); 1: one payload.
    pub workers: usize,
    /// Threads the methods may use (a rayon pool of this many runs them; the FFT method
    /// encodes its tensors side by side on them). 1 (the default): single-threaded.
    pub threads: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            methods: Vec::new(),
            repeat: 5,
            per_layer: false,
            shape: None,
            rounds: 0,
            layers: None,
            error_feedback: false,
            workers: 1,
            threads: 1,
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
    /// `‖g − D(C(g))‖ / ‖g‖` of the last compression.
    pub rel_error: f64,
    /// One pass reading the input on this thread, GB/s ([`read_gbps`], same run).
    pub read_gbps: f64,
    /// `compress_gbps / read_gbps`: the share of the single-pass limit the compressor runs at.
    pub compress_of_read: f64,
}

/// Reads `x` once (a sum in 16 independent lanes, which vectorises) and returns it so the
/// read cannot be optimised away.
fn read_once(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// The single-pass read bandwidth of `input` on this thread, GB/s: best of `repeat` timed
/// passes after one warm-up — the limit for a compressor that reads its input once.
pub fn read_gbps(input: &[f32], repeat: usize) -> f64 {
    let mut best = f64::INFINITY;
    for i in 0..=repeat.max(1) {
        let t = Instant::now();
        std::hint::black_box(read_once(std::hint::black_box(input)));
        let dt = t.elapsed().as_secs_f64();
        if i > 0 {
            best = best.min(dt);
        }
    }
    4.0 * input.len() as f64 / 1e9 / best.max(1e-12)
}

/// Parses `name` or `name:key=value,key=value` into a method config.
pub fn parse_method(spec: &str) -> Result<CompressorConfig, String> {
    let (name, params) = super::spec::split(spec);
    if !METHODS.iter().any(|m| m.name == name) {
        let known: Vec<&str> = METHODS.iter().map(|m| m.name).collect();
        return Err(format!(
            "unknown method {name:?}; known: {}",
            known.join(", ")
        ));
    }
    let doc = format!(
        "kind = {name:?}\n{}",
        super::spec::params_toml(spec, params)?
    );
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

/// The segments [`Options::layers`] or [`Options::per_layer`] make of an input of `n`
/// elements (none: one segment).
pub(crate) fn segments(n: usize, opts: &Options) -> Result<Vec<Range<usize>>, String> {
    Ok(match &opts.layers {
        Some(shapes) => {
            let lens: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
            let total: usize = lens.iter().sum();
            if total != n || lens.contains(&0) {
                return Err(format!(
                    "the layers hold {total} elements (none may be empty), the input {n}"
                ));
            }
            segments_of(&lens)
        }
        None if opts.per_layer && opts.shape.is_none() => segments_of(&layer_lengths(n)),
        None => Vec::new(),
    })
}

/// The tensor shapes [`Options::layers`] or [`Options::shape`] tell the compressors (`None`:
/// none, and PowerSGD sends everything dense).
pub(crate) fn segment_shapes(opts: &Options) -> Option<Vec<Vec<usize>>> {
    match (&opts.layers, opts.shape) {
        (Some(shapes), _) => Some(shapes.clone()),
        (None, Some((rows, cols))) => Some(vec![vec![rows, cols]]),
        (None, None) => None,
    }
}

/// Runs the benchmark on `input`, in a pool of [`Options::threads`] threads.
pub fn run(input: &[f32], opts: &Options) -> Result<Vec<Row>, String> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads.max(1))
        .build()
        .map_err(|e| format!("a pool of {} threads: {e}", opts.threads))?
        .install(|| run_in_pool(input, opts))
}

fn run_in_pool(input: &[f32], opts: &Options) -> Result<Vec<Row>, String> {
    let specs: Vec<String> = if opts.methods.is_empty() {
        METHODS.iter().map(|m| m.name.to_string()).collect()
    } else {
        opts.methods.clone()
    };
    let n = input.len();
    if let Some((rows, cols)) = opts.shape {
        if rows.checked_mul(cols) != Some(n) {
            return Err(format!(
                "--shape {rows}x{cols} is {} elements, the input has {n}",
                rows.saturating_mul(cols)
            ));
        }
    }
    let segs = segments(n, opts)?;
    let workers = opts.workers.max(1);
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
    let read = read_gbps(input, repeat);
    let mut rows = Vec::new();
    for spec in specs {
        let cfg = parse_method(&spec)?;
        let mut c = cfg.build().map_err(|e| format!("{spec}: {e}"))?;
        if let Some(shapes) = segment_shapes(opts) {
            c.set_segment_shapes(&shapes);
        }
        c.set_world_size(workers);
        let memory = if opts.error_feedback {
            MemoryConfig::RESIDUAL
        } else {
            MemoryConfig::None
        };
        let mut pipe = Pipeline::new(c, memory.build().map_err(|e| format!("{spec}: {e}"))?);
        let mut payload = Payload::new();
        let mut out = vec![0f32; n];
        let mut best_c = f64::INFINITY;
        let rounds = if opts.rounds > 0 {
            opts.rounds
        } else {
            repeat + 1
        };
        for i in 0..rounds {
            let mut rng = Rng::for_step(0, 1, 0, 0);
            let ctx = Ctx {
                step: ctx.step + i as u64,
                ..ctx
            };
            let t = Instant::now();
            pipe.compress(input, &ctx, &mut rng, &mut payload)
                .map_err(|e| format!("{spec}: {e}"))?;
            let dt = t.elapsed().as_secs_f64();
            // The first is a warm-up (unless it is the only one).
            if i > 0 || rounds == 1 {
                best_c = best_c.min(dt);
            }
        }
        let mut best_d = f64::INFINITY;
        let all = vec![payload.as_bytes(); workers];
        for i in 0..=repeat {
            let t = Instant::now();
            out.fill(0.0);
            pipe.decompress_sum_add(&all, &mut out)
                .map_err(|(_, e)| format!("{spec}: {e}"))?;
            let dt = t.elapsed().as_secs_f64();
            if i > 0 {
                best_d = best_d.min(dt);
            }
        }
        // The error is one payload's reconstruction's (with error feedback: of the last
        // payload, which carries the residual of the ones before, against the input).
        out.fill(0.0);
        pipe.decompress_add(payload.as_bytes(), &mut out)
            .map_err(|e| format!("{spec}: {e}"))?;
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
            aggregation: pipe.compressor().aggregation(),
            elements: n,
            payload_bytes: bytes,
            bits_per_element: bpe,
            compression_ratio: if bpe > 0.0 { 32.0 / bpe } else { 0.0 },
            compress_gbps: gb / best_c,
            decompress_gbps: gb / best_d,
            compress_ms: best_c * 1e3,
            decompress_ms: best_d * 1e3,
            rel_error: if norm > 0.0 { err / norm } else { 0.0 },
            read_gbps: read,
            compress_of_read: gb / best_c / read,
        });
    }
    Ok(rows)
}

/// Elements in tensors of these shapes together (the input size [`Options::layers`] needs).
pub fn elements(layers: &[Vec<usize>]) -> usize {
    layers.iter().map(|s| s.iter().product::<usize>()).sum()
}

/// The shapes of the parameter tensors of model `spec` (as `dtrain bench models` names
/// models: `kind/variant[:key=value;…]`), in the model's order: [`Options::layers`] for the
/// gradient a training step of that model compresses.
pub fn model_layers(spec: &str) -> Result<Vec<Vec<usize>>, String> {
    let (model, _) = super::models::parse_model(spec, false)?;
    let built = model
        .build(&dtrain_models::cpu_device())
        .map_err(|e| format!("{spec}: {e}"))?;
    Ok(built.table().params().map(|p| p.shape.clone()).collect())
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
        .max("(one-pass read)".len());
    let mut s = format!(
        "{:<w$}  {:>9}  {:>8}  {:>10}  {:>12}  {:>9}  {:>11}  {:>9}\n",
        "method",
        "bits/elem",
        "ratio",
        "comp GB/s",
        "decomp GB/s",
        "rel err",
        "aggregation",
        "comp/read"
    );
    if let Some(r) = rows.first() {
        s.push_str(&format!(
            "{:<w$}  {:>9}  {:>8}  {:>10.3}  {:>12}  {:>9}  {:>11}  {:>9}\n",
            "(one-pass read)", "—", "—", r.read_gbps, "—", "—", "—", "100 %"
        ));
    }
    for r in rows {
        s.push_str(&format!(
            "{:<w$}  {:>9.3}  {:>7.1}x  {:>10.3}  {:>12.3}  {:>9.4}  {:>11}  {:>7.0} %\n",
            r.method,
            r.bits_per_element,
            r.compression_ratio,
            r.compress_gbps,
            r.decompress_gbps,
            r.rel_error,
            format!("{:?}", r.aggregation).to_lowercase(),
            100.0 * r.compress_of_read,
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_matrix_shape_and_rounds_let_powersgd_warm_start() {
        // A rank-2 matrix plus a little noise: rank-2 PowerSGD's error falls with the
        // warm-started rounds to about the noise, rank 1 stays above the second direction.
        let (m, c) = (96, 80);
        let mut rng = dtrain_compress::Rng::seed_from_u64(3);
        let u: Vec<f32> = (0..2 * m).map(|_| rng.next_f32() - 0.5).collect();
        let v: Vec<f32> = (0..2 * c).map(|_| rng.next_f32() - 0.5).collect();
        let input: Vec<f32> = (0..m * c)
            .map(|k| {
                let (i, j) = (k / c, k % c);
                u[i] * v[j] + 0.5 * u[m + i] * v[c + j] + 1e-3 * (rng.next_f32() - 0.5)
            })
            .collect();
        let err = |method: &str, rounds| {
            let opts = Options {
                methods: vec![method.into()],
                repeat: 1,
                shape: Some((m, c)),
                rounds,
                ..Options::default()
            };
            run(&input, &opts).unwrap()[0].rel_error
        };
        let (one, many) = (err("powersgd:rank=2", 1), err("powersgd:rank=2", 8));
        assert!(
            many < 0.05 && many < one,
            "rank 2: {one} after 1 round, {many} after 8"
        );
        assert!(err("powersgd:rank=1", 8) > 0.1);
        let bad = Options {
            shape: Some((7, 7)),
            ..Options::default()
        };
        assert!(run(&input, &bad).unwrap_err().contains("49 elements"));
    }

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
        for r in &rows {
            assert!(r.read_gbps > 0.0 && r.read_gbps.is_finite(), "{}", r.method);
            let share = r.compress_gbps / r.read_gbps;
            assert!(
                (r.compress_of_read - share).abs() <= 1e-9 * share,
                "{}",
                r.method
            );
        }
        assert!(table(&rows).contains("(one-pass read)"));
        let none = rows.iter().find(|r| r.method == "none").unwrap();
        assert_eq!(none.rel_error, 0.0);
        assert!((none.bits_per_element - 32.0).abs() < 0.01);
        let json = serde_json::to_string(&rows).unwrap();
        let back: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(back.as_array().unwrap().len(), rows.len());
    }

    #[test]
    fn a_model_layout_error_feedback_and_several_receivers() {
        let layers = model_layers("lenet").unwrap();
        assert!(layers.len() >= 8, "{layers:?}");
        let n = elements(&layers);
        let input = synthesize(Shape::Layered, n, 7);
        let at = |error_feedback, workers| {
            let opts = Options {
                methods: vec!["fft".into(), "topk:ratio=0.01".into()],
                repeat: 1,
                rounds: 3,
                layers: Some(layers.clone()),
                error_feedback,
                workers,
                ..Options::default()
            };
            run(&input, &opts).unwrap()
        };
        for rows in [at(false, 1), at(true, 4)] {
            for r in &rows {
                assert_eq!(r.elements, n);
                assert!(r.compress_ms > 0.0 && r.decompress_ms > 0.0, "{}", r.method);
                assert!(r.rel_error.is_finite() && r.rel_error > 0.0, "{}", r.method);
            }
        }
        // With error feedback the third payload carries what the first two left out: its
        // reconstruction is further from the input than the one without the residual.
        let (plain, ef) = (at(false, 1), at(true, 1));
        assert!(ef[1].rel_error > plain[1].rel_error);
        // The layout must cover the input.
        let short = Options {
            layers: Some(vec![vec![3, 3]]),
            ..Options::default()
        };
        assert!(run(&input, &short).unwrap_err().contains("9 elements"));
        assert!(model_layers("nope").is_err());
    }

    #[test]
    fn the_one_pass_read_sums_every_element() {
        let x: Vec<f32> = (0..1003).map(|i| (i % 7) as f32).collect();
        assert_eq!(read_once(&x), x.iter().sum::<f32>());
        assert!(read_gbps(&x, 2) > 0.0);
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
