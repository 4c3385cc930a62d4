//! `dtrain bench models`: the training step of each model (forward with the loss, backward
//! with the gradients copied out flat, as the trainer runs it; no optimizer) on the CPU or a
//! GPU, and, with a reference device, the same step there from the same weights and batch:
//! both timings side by side and the relative error of the loss and the gradients.
//!
//! The reference comparison is how a device back end is checked (`scripts/gpu-check`):
//! the model is built on the reference device, its parameters and buffers are copied to the
//! device under test, dropout is turned off where the family has it (its masks are random
//! per device), and one batch of deterministic synthetic data goes through both. The error
//! is `‖x − x_ref‖₂ / ‖x_ref‖₂` over the loss and over the whole flat gradient; the worst
//! single tensor is reported beside it.
//!
//! On a device that multiplies f32 matrices in TF32 (found before the models run: see
//! [`Precision`]), the reference step runs twice more on the CPU with every product's
//! operands converted to TF32, rounded and truncated ([`dtrain_models::precision`]): how far
//! TF32 alone moves the model's loss and gradients. For the families whose products that
//! emulation covers, the device passes within [`Options::tf32_factor`] times the larger of
//! those errors: the error TF32 explains, measured per model and batch, rather than one flat
//! tolerance.
//!
//! Timings are medians over `steps` steps after `warmup` steps; the first step is reported
//! apart (on a GPU it includes compiling the kernels).

use std::time::Instant;

use dtrain_models::pool::on_pool_for;
use dtrain_models::precision::{self, Tf32};
use dtrain_models::{Batch, InputSpec, Model, ModelSpec, SyntheticBatch};
use serde::Serialize;

use crate::device::{worker_device, DeviceKind};

/// One model of each family at the size the experiments use.
pub const DEFAULT_MODELS: &[&str] = &[
    "mlp/mnist",
    "lenet/lenet5",
    "alexnet/cifar",
    "vgg/vgg11",
    "resnet/resnet20",
    "lstm/word",
    "gpt/mini",
];

/// Vocabulary of a language model whose spec names none (the word-level SOTU corpus has
/// 6,858 words at the experiments' `min_count`; a round 10,000 is the usual PTB size).
const DEFAULT_VOCAB: usize = 10_000;

/// Benchmark options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Models, each `kind/variant` or `kind/variant:key=value,key=value` (the family's spec
    /// keys, TOML values); empty means [`DEFAULT_MODELS`].
    pub models: Vec<String>,
    /// The device measured.
    pub device: DeviceKind,
    /// The reference device: when set, the step is also run and timed there from the same
    /// weights and batch, and the two results are compared.
    pub reference: Option<DeviceKind>,
    /// Examples per batch; `None`: 32 images, or 20 sequences.
    pub batch: Option<usize>,
    /// Tokens per sequence for language models.
    pub seq_len: usize,
    /// Untimed steps before the timed ones (the first step included).
    pub warmup: usize,
    /// Timed steps.
    pub steps: usize,
    /// The largest relative error of the loss and of the gradients that passes.
    pub tolerance: f64,
    /// On a device that multiplies f32 matrices in TF32 (found by
    /// [`dtrain_models::matmul_rel_err`] before the models run), the tolerance of the
    /// families whose products the TF32 emulation does not cover (the LSTM, the GPT: see
    /// [`dtrain_models::precision`]); `None`: `tolerance`.
    pub tf32_tolerance: Option<f64>,
    /// Whether the reference step is also run with TF32 emulated: `None`, when the device
    /// multiplies in TF32; `Some(true)` always (with a reference; e.g. to see on a CPU what
    /// TF32 does to each model), `Some(false)` never.
    pub tf32_emulation: Option<bool>,
    /// On a TF32 device, a family the emulation covers passes when its errors are at most
    /// this many times the emulated references' larger error (and always within
    /// `tolerance`).
    pub tf32_factor: f64,
    /// Seed of the synthetic batch and of the initial weights (drawn on the reference device
    /// when there is one), so that a run repeats.
    pub seed: u64,
    /// On a device that multiplies in f32, a model passes within this many times the change
    /// one rounding of its weights makes to the reference's step ([`Check::perturbed`]; at
    /// least `tolerance`): a model that amplifies rounding (ResNet-20's BatchNorms: ~1e-3
    /// from weights moved by 2⁻²⁴, where the other families move ~1e-7) differs from the
    /// reference by more than 1e-3 in f32 arithmetic that merely rounds differently. 0:
    /// `tolerance` alone.
    pub perturb_factor: f64,
    /// Whether the device may multiply f32 matrices in TF32 (`cluster.allow_tf32`; set for
    /// the process by [`run`] before the first product).
    pub allow_tf32: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            models: Vec::new(),
            device: DeviceKind::Cpu,
            reference: None,
            batch: None,
            seq_len: 35,
            warmup: 2,
            steps: 10,
            tolerance: 1e-3,
            tf32_tolerance: None,
            tf32_emulation: None,
            tf32_factor: 2.0,
            seed: 7,
            perturb_factor: 4.0,
            allow_tf32: true,
        }
    }
}

/// Step times on one device, milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    /// The device.
    pub device: String,
    /// The first step (on a GPU: with kernel compilation and autotuning).
    pub first_ms: f64,
    /// Median forward + loss + backward + gradient copy.
    pub step_ms: f64,
    /// Median forward with the loss (and its metrics read back).
    pub forward_ms: f64,
    /// Median backward with the flat gradient copied to the host.
    pub backward_ms: f64,
}

/// The device against the reference on one step.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// The loss on the device.
    pub loss: f64,
    /// The loss on the reference device.
    pub reference_loss: f64,
    /// `|loss − reference| / |reference|`.
    pub loss_rel_err: f64,
    /// `‖g − g_ref‖₂ / ‖g_ref‖₂` over every gradient.
    pub grad_rel_err: f64,
    /// The tensor with the largest relative gradient error.
    pub worst_tensor: String,
    /// Its relative error.
    pub worst_tensor_rel_err: f64,
    /// The reference with TF32 emulated against the reference, when it ran.
    pub tf32_emulated: Option<Emulated>,
    /// The reference's step from its weights perturbed by one rounding (each times
    /// `1 ± 2⁻²⁴`) against the reference: how far f32 arithmetic that merely rounds
    /// differently moves the model's step (see [`tolerance_for`]).
    pub perturbed: Option<Errors>,
    /// The tolerance applied (see [`tolerance_for`]).
    pub tolerance: f64,
    /// Both errors finite and within the tolerance.
    pub passed: bool,
}

/// The reference step with every product's operands converted to TF32, against the
/// reference step: what TF32 alone does to the model (see [`dtrain_models::precision`]).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Emulated {
    /// Operands rounded to nearest.
    pub nearest: Errors,
    /// Operands truncated.
    pub truncated: Errors,
    /// Whether every product of the model went through the emulation; when not, the errors
    /// are those of the products it covers only, and do not set the tolerance.
    pub covers_every_product: bool,
}

impl Emulated {
    /// The largest of the four errors (NaN when one is).
    pub fn max(&self) -> f64 {
        let (n, t) = (self.nearest, self.truncated);
        max_or_nan([
            n.loss_rel_err,
            n.grad_rel_err,
            t.loss_rel_err,
            t.grad_rel_err,
        ])
    }

    /// The larger gradient error of the two conversions (NaN when one is).
    pub fn grad_rel_err(&self) -> f64 {
        max_or_nan([self.nearest.grad_rel_err, self.truncated.grad_rel_err])
    }
}

/// The largest of `errors` (at least 0), NaN when one is: `f64::max` would drop a NaN.
fn max_or_nan(errors: impl IntoIterator<Item = f64>) -> f64 {
    errors.into_iter().fold(0.0, |m, e| {
        if m.is_nan() || e.is_nan() {
            f64::NAN
        } else {
            m.max(e)
        }
    })
}

/// One step's errors against the reference step.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Errors {
    /// Relative error of the loss.
    pub loss_rel_err: f64,
    /// `‖g − g_ref‖₂ / ‖g_ref‖₂` over every gradient.
    pub grad_rel_err: f64,
}

/// The tolerance of one model's comparison: on a device that multiplies in f32,
/// `opts.tolerance`, or `opts.perturb_factor` times the change one rounding of the weights
/// makes to the reference's step where that is larger; on a TF32 device, `opts.tf32_factor`
/// times the emulated references' largest error ([`Emulated::max`]; at least
/// `opts.tolerance`) for a family the emulation covers, else `opts.tf32_tolerance` (or
/// `opts.tolerance`).
pub fn tolerance_for(
    opts: &Options,
    tf32_device: bool,
    emulated: Option<&Emulated>,
    perturbed: Option<&Errors>,
) -> f64 {
    if !tf32_device {
        // NaN (a non-finite perturbed step) falls back to `tolerance` under `max`.
        return match perturbed {
            Some(p) if opts.perturb_factor > 0.0 => opts
                .tolerance
                .max(opts.perturb_factor * max_or_nan([p.loss_rel_err, p.grad_rel_err])),
            _ => opts.tolerance,
        };
    }
    match emulated {
        Some(e) if e.covers_every_product => {
            // NaN (a non-finite emulated step) falls back to `tolerance` under `max`.
            let explained = opts.tf32_factor * e.max();
            opts.tolerance.max(explained)
        }
        _ => opts.tf32_tolerance.unwrap_or(opts.tolerance),
    }
}

/// Sets the TF32 emulation for as long as it lives; what it was comes back when it is
/// dropped (also on an early return or a panic).
struct EmulatingTf32(Tf32);

impl EmulatingTf32 {
    fn start(mode: Tf32) -> Self {
        EmulatingTf32(precision::set_tf32_emulation(mode))
    }
}

impl Drop for EmulatingTf32 {
    fn drop(&mut self) {
        precision::set_tf32_emulation(self.0);
    }
}

/// What the device's f32 matrix products are, from [`dtrain_models::matmul_rel_err`] against the reference.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Precision {
    /// Relative error of a 512 × 512 × 512 product against the reference device.
    pub matmul_rel_err: f64,
    /// Whether that error says TF32 (operands rounded to 10 mantissa bits): above 1e-5, where
    /// f32 arithmetic in another summation order stays near 1e-7 and TF32 near 3e-4.
    pub tf32: bool,
}

impl Precision {
    /// Measures `device` against `reference`.
    pub fn measure(device: DeviceKind, reference: DeviceKind) -> Result<Self, String> {
        let on = |k| worker_device(k, 0);
        let e = dtrain_models::matmul_rel_err_between(&on(device)?, &on(reference)?, 512);
        Ok(Precision {
            matmul_rel_err: e,
            // NaN (no product read back) counts as not f32.
            tf32: e.is_nan() || e > 1e-5,
        })
    }
}

/// One model's result.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The model as given.
    pub model: String,
    /// Trainable parameters.
    pub params: usize,
    /// The batch's shape, e.g. `32x3x32x32` or `20x35` tokens.
    pub batch: String,
    /// Whether dropout was turned off (reference runs; families that have it).
    pub dropout_off: bool,
    /// Times on the measured device.
    pub timing: Timing,
    /// Times on the reference device.
    pub reference: Option<Timing>,
    /// The comparison with the reference device.
    pub check: Option<Check>,
}

impl Row {
    /// False only when a comparison ran and failed.
    pub fn passed(&self) -> bool {
        self.check.as_ref().is_none_or(|c| c.passed)
    }
}

/// The model spec for `name` (`kind/variant[:key=value,…]`), with dropout set to 0 when
/// `dropout_off` and the family has the key. Returns the spec and whether dropout was set.
pub fn parse_model(name: &str, dropout_off: bool) -> Result<(ModelSpec, bool), String> {
    let (id, params) = super::spec::split(name);
    let (kind, variant) = match id.split_once('/') {
        Some((k, v)) => (k.trim(), Some(v.trim())),
        None => (id, None),
    };
    if !dtrain_models::MODELS.iter().any(|m| m.kind == kind) {
        let known = dtrain_models::model_names().join(", ");
        return Err(format!("unknown model {id:?}; known: {known}"));
    }
    let mut doc = format!("kind = {kind:?}\n");
    if let Some(v) = variant {
        doc.push_str(&format!("variant = {v:?}\n"));
    }
    let user = super::spec::params_toml(name, params)?;
    let given = |key: &str| user.lines().any(|l| l.starts_with(&format!("{key} =")));
    doc.push_str(&user);
    // A language model without a corpus gets a vocabulary unless one is given.
    let parse = |d: &str| {
        let mut spec = toml::from_str::<ModelSpec>(d).map_err(|e| format!("{name}: {e}"))?;
        if spec.is_language_model() && spec.vocab().is_none() {
            spec.set_vocab(DEFAULT_VOCAB);
        }
        Ok::<_, String>(spec)
    };
    if dropout_off && !given("dropout") {
        // Families without a `dropout` key refuse it (unknown field): then they have none.
        if let Ok(spec) = parse(&format!("{doc}dropout = 0.0\n")) {
            return Ok((spec, true));
        }
    }
    Ok((parse(&doc)?, false))
}

/// One training step: the loss (mean, as the model reports it) and the time of each half.
/// On the CPU each half runs on rayon's pool, as the trainer runs them ([`on_pool_for`]).
fn step(model: &mut dyn Model, batch: Batch, grads: &mut [f32]) -> Result<(f64, f64, f64), String> {
    let device = model.device().clone();
    let t0 = Instant::now();
    let out = on_pool_for(&device, || model.forward_loss(batch)).map_err(|e| e.to_string())?;
    let t1 = Instant::now();
    on_pool_for(&device, || model.backward_into(out.loss, grads));
    let t2 = Instant::now();
    let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
    Ok((out.metrics.loss, ms(t0, t1), ms(t1, t2)))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// Times `model` on `host` after its first step (which `first` already ran and timed).
fn time_steps(
    model: &mut dyn Model,
    host: &SyntheticBatch,
    grads: &mut [f32],
    first_ms: f64,
    device: String,
    opts: &Options,
) -> Result<Timing, String> {
    let on = model.device().clone();
    for _ in 1..opts.warmup {
        step(model, host.on(&on), grads)?;
    }
    let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
    for _ in 0..opts.steps.max(1) {
        let batch = host.on(&on);
        let (_, f, b) = step(model, batch, grads)?;
        fwd.push(f);
        bwd.push(b);
    }
    let total: Vec<f64> = fwd.iter().zip(&bwd).map(|(f, b)| f + b).collect();
    Ok(Timing {
        device,
        first_ms,
        step_ms: median(total),
        forward_ms: median(fwd),
        backward_ms: median(bwd),
    })
}

/// `‖a − b‖₂ / ‖b‖₂` in f64 (`‖a − b‖₂` when `b` is zero; NaN when anything is not finite).
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64, y as f64);
        d += (x - y) * (x - y);
        n += y * y;
    }
    let r = if n > 0.0 { (d / n).sqrt() } else { d.sqrt() };
    if r.is_finite() {
        r
    } else {
        f64::NAN
    }
}

/// The label of a device in tables.
fn device_name(kind: DeviceKind) -> String {
    match (kind, kind.gpu_index(0)) {
        (DeviceKind::Wgpu(a), _) => a.to_string(),
        (_, None) => "cpu".into(),
        (_, Some(i)) => format!("cuda:{i}"),
    }
}

/// The device's loss and gradients against the reference's (`(rloss, rgrads)`).
fn compare(
    model: &dyn Model,
    loss: f64,
    grads: &[f32],
    (rloss, rgrads): (f64, &[f32]),
    tf32_emulated: Option<Emulated>,
    perturbed: Option<Errors>,
    tolerance: f64,
) -> Check {
    let loss_rel_err = rel_err(&[loss as f32], &[rloss as f32]);
    let grad_rel_err = rel_err(grads, rgrads);
    let (worst_tensor, worst_tensor_rel_err) = model
        .table()
        .params()
        .map(|e| {
            let r = e.offset..e.offset + e.numel;
            (e.name.clone(), rel_err(&grads[r.clone()], &rgrads[r]))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or_default();
    // NaN compares false, so a non-finite error fails.
    let passed = loss_rel_err <= tolerance && grad_rel_err <= tolerance;
    Check {
        loss,
        reference_loss: rloss,
        loss_rel_err,
        grad_rel_err,
        worst_tensor,
        worst_tensor_rel_err,
        tf32_emulated,
        perturbed,
        tolerance,
        passed,
    }
}

/// Copies `from`'s parameters and BatchNorm buffers into `to`.
fn copy_state(from: &dyn Model, to: &mut dyn Model) {
    let mut params = vec![0.0f32; from.table().num_params()];
    from.read_params(&mut params);
    to.write_params(&params);
    let mut bufs = vec![0.0f32; from.table().num_buffers()];
    from.read_buffers(&mut bufs);
    to.write_buffers(&bufs);
}

/// A copy of `r` (parameters and buffers) on its device.
fn replica(spec: &ModelSpec, r: &dyn Model) -> Result<Box<dyn Model>, String> {
    let mut copy = spec.build(r.device()).map_err(|e| e.to_string())?;
    copy_state(r, copy.as_mut());
    Ok(copy)
}

/// A [`replica`] of `r` whose weights are each moved by one rounding: times `1 + 2⁻²⁴` or
/// `1 − 2⁻²⁴`, the sign drawn from `seed` (half an f32 ulp: what one rounding of a product
/// or a sum can do to a value).
fn perturbed_replica(spec: &ModelSpec, r: &dyn Model, seed: u64) -> Result<Box<dyn Model>, String> {
    let mut copy = replica(spec, r)?;
    let mut w = vec![0f32; copy.table().num_params()];
    copy.read_params(&mut w);
    let mut rng = dtrain_models::synthetic::SynthRng::new(seed ^ 0x9e37_79b9_7f4a_7c15);
    for v in &mut w {
        let up = rng.next_u64() & 1 == 0;
        *v *= if up {
            1.0 + f32::EPSILON / 2.0
        } else {
            1.0 - f32::EPSILON / 2.0
        };
    }
    copy.write_params(&w);
    Ok(copy)
}

/// The reference step again with TF32 emulated as `mode` says, on `e` (a [`replica`] of the
/// reference from before its step) and the same batch, against the reference's loss and
/// gradients.
fn emulated_step(
    mut e: Box<dyn Model>,
    mode: Tf32,
    host: &SyntheticBatch,
    (rloss, rgrads): (f64, &[f32]),
) -> Result<Errors, String> {
    let mut grads = vec![0.0f32; rgrads.len()];
    let on = e.device().clone();
    let loss = {
        let _tf32 = EmulatingTf32::start(mode);
        step(e.as_mut(), host.on(&on), &mut grads)?.0
    };
    Ok(Errors {
        loss_rel_err: rel_err(&[loss as f32], &[rloss as f32]),
        grad_rel_err: rel_err(&grads, rgrads),
    })
}

/// Runs one model; `tf32_device` says whether the device multiplies in TF32 (see
/// [`tolerance_for`]).
fn run_one(name: &str, opts: &Options, tf32_device: bool) -> Result<Row, String> {
    let (spec, dropout_off) = parse_model(name, opts.reference.is_some())?;
    let device = worker_device(opts.device, 0)?;
    device.seed(opts.seed);
    let mut model = spec.build(&device).map_err(|e| format!("{name}: {e}"))?;
    let n = model.table().num_params();
    let input = model.input();
    let batch = opts.batch.unwrap_or(match input {
        InputSpec::Images { .. } => 32,
        InputSpec::Tokens { .. } => 20,
    });
    let host = SyntheticBatch::new(input, batch, opts.seq_len, opts.seed);
    let mut grads = vec![0.0f32; n];

    let mut reference = match opts.reference {
        None => None,
        Some(kind) => {
            let rdev = worker_device(kind, 0)?;
            rdev.seed(opts.seed);
            let r = spec.build(&rdev).map_err(|e| format!("{name}: {e}"))?;
            // The device under test gets the reference's weights and buffers.
            copy_state(r.as_ref(), model.as_mut());
            Some((kind, r))
        }
    };

    // The first step of each side, from the same weights and batch, is the comparison.
    let (loss, f, b) = step(model.as_mut(), host.on(&device), &mut grads)
        .map_err(|e| format!("{name} on {}: {e}", device_name(opts.device)))?;
    let timing = |model: &mut dyn Model, grads: &mut [f32], first_ms, kind| {
        time_steps(model, &host, grads, first_ms, device_name(kind), opts)
    };
    let (reference, check) = match reference.as_mut() {
        None => (None, None),
        Some((kind, r)) => {
            let mut rgrads = vec![0.0f32; n];
            let on = r.device().clone();
            // The copies for the emulated steps are taken before the reference's step, which
            // updates BatchNorm's running statistics.
            let tf32 = |e: String| format!("{name} with TF32 emulated: {e}");
            // And one for the step from perturbed weights (f32 devices' tolerance).
            let perturb = |e: String| format!("{name} with its weights perturbed: {e}");
            let perturb_copy = match (tf32_device, opts.perturb_factor > 0.0) {
                (false, true) => {
                    Some(perturbed_replica(&spec, r.as_ref(), opts.seed).map_err(perturb)?)
                }
                _ => None,
            };
            let copies = match opts.tf32_emulation.unwrap_or(tf32_device) {
                true => Some([
                    replica(&spec, r.as_ref()).map_err(tf32)?,
                    replica(&spec, r.as_ref()).map_err(tf32)?,
                ]),
                false => None,
            };
            let (rloss, rf, rb) = step(r.as_mut(), host.on(&on), &mut rgrads)
                .map_err(|e| format!("{name} on {}: {e}", device_name(*kind)))?;
            let emulated = match copies {
                None => None,
                Some([a, b]) => {
                    let reference = (rloss, rgrads.as_slice());
                    Some(Emulated {
                        nearest: emulated_step(a, Tf32::Nearest, &host, reference).map_err(tf32)?,
                        truncated: emulated_step(b, Tf32::Truncated, &host, reference)
                            .map_err(tf32)?,
                        covers_every_product: precision::covers_every_product(&spec),
                    })
                }
            };
            let perturbed = match perturb_copy {
                None => None,
                Some(e) => Some(
                    emulated_step(e, Tf32::Off, &host, (rloss, rgrads.as_slice()))
                        .map_err(perturb)?,
                ),
            };
            let tolerance = tolerance_for(opts, tf32_device, emulated.as_ref(), perturbed.as_ref());
            let check = compare(
                model.as_ref(),
                loss,
                &grads,
                (rloss, &rgrads),
                emulated,
                perturbed,
                tolerance,
            );
            let rtiming = timing(r.as_mut(), &mut rgrads, rf + rb, *kind)?;
            (Some(rtiming), Some(check))
        }
    };
    let timing = timing(model.as_mut(), &mut grads, f + b, opts.device)?;
    Ok(Row {
        model: name.to_string(),
        params: n,
        batch: host.describe(),
        dropout_off,
        timing,
        reference,
        check,
    })
}

/// Runs every model of `opts`, calling `each` with each row as it is measured. With a
/// reference device, the device's matrix-product precision is measured first and given to
/// `precision` (it chooses the tolerance: see [`Options::tf32_tolerance`]).
pub fn run(
    opts: &Options,
    mut precision: impl FnMut(&Precision),
    mut each: impl FnMut(&Row),
) -> Result<Vec<Row>, String> {
    let names: Vec<String> = if opts.models.is_empty() {
        DEFAULT_MODELS.iter().map(|s| s.to_string()).collect()
    } else {
        opts.models.clone()
    };
    // Every name is checked before the first (possibly long) measurement.
    for name in &names {
        parse_model(name, false)?;
    }
    // Before the precision probe, the first product.
    dtrain_models::precision::set_allow_tf32(opts.allow_tf32);
    let mut tf32_device = false;
    if let Some(reference) = opts.reference {
        let p = Precision::measure(opts.device, reference)?;
        tf32_device = p.tf32;
        precision(&p);
    }
    let mut rows = Vec::new();
    for name in &names {
        let row = run_one(name, opts, tf32_device)?;
        each(&row);
        rows.push(row);
    }
    Ok(rows)
}

/// The header of [`table_row`]'s lines.
pub fn table_header(reference: bool) -> String {
    let mut s = format!(
        "{:<18} {:>10} {:>16} {:>7} {:>10} {:>9} {:>8} {:>8}",
        "model", "params", "batch", "device", "first ms", "step ms", "fwd ms", "bwd ms"
    );
    if reference {
        s.push_str(&format!(
            " {:>7} {:>9} {:>8} {:>9} {:>9} {:>9} {:>8} {:>6}  worst tensor",
            "ref", "ref ms", "speed-up", "loss err", "grad err", "tf32 err", "tol", "check"
        ));
    }
    s.push('\n');
    s
}

/// One fixed-width line.
pub fn table_row(r: &Row) -> String {
    let t = &r.timing;
    let mut s = format!(
        "{:<18} {:>10} {:>16} {:>7} {:>10.1} {:>9.2} {:>8.2} {:>8.2}",
        r.model, r.params, r.batch, t.device, t.first_ms, t.step_ms, t.forward_ms, t.backward_ms
    );
    if let (Some(rt), Some(c)) = (&r.reference, &r.check) {
        // The emulated references' larger gradient error; `*` where they cover only some
        // products.
        let tf32 = c.tf32_emulated.map_or("-".to_string(), |e| {
            let partial = if e.covers_every_product { "" } else { "*" };
            format!("{:.1e}{partial}", e.grad_rel_err())
        });
        s.push_str(&format!(
            " {:>7} {:>9.2} {:>7.1}x {:>9.1e} {:>9.1e} {:>9} {:>8.1e} {:>6}  {} ({:.1e})",
            rt.device,
            rt.step_ms,
            rt.step_ms / t.step_ms,
            c.loss_rel_err,
            c.grad_rel_err,
            tf32,
            c.tolerance,
            if c.passed { "ok" } else { "FAIL" },
            c.worst_tensor,
            c.worst_tensor_rel_err
        ));
    }
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_resolve_with_dropout_off_only_where_the_family_has_it() {
        let (spec, off) = parse_model("alexnet/cifar", true).unwrap();
        assert!(off);
        assert_eq!(spec.kind(), "alexnet");
        let (_, off) = parse_model("resnet/resnet20", true).unwrap();
        assert!(!off, "resnet has no dropout key");
        let (_, off) = parse_model("mlp/mnist", false).unwrap();
        assert!(!off);
        // A language model gets a vocabulary unless one is given; a given one is kept.
        let (spec, _) = parse_model("lstm/char:vocab=77", false).unwrap();
        assert!(format!("{spec:?}").contains("77"), "{spec:?}");
        assert!(parse_model("lstm/word", false).is_ok());
        let (spec, off) = parse_model("gpt/mini", true).unwrap();
        assert_eq!(spec.vocab(), Some(DEFAULT_VOCAB));
        assert!(off, "the GPT has dropout");
        for bad in ["nope/x", "resnet/resnet21", "mlp/mnist:hidden"] {
            assert!(parse_model(bad, false).is_err(), "{bad}");
        }
    }

    #[test]
    fn rel_err_is_relative_to_the_reference_and_nan_when_not_finite() {
        assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_err(&[3.0, 4.0], &[0.0, 5.0]) - (10.0f64).sqrt() / 5.0).abs() < 1e-12);
        assert_eq!(rel_err(&[0.5], &[0.0]), 0.5);
        assert!(rel_err(&[f32::NAN], &[1.0]).is_nan());
    }

    #[test]
    fn a_tf32_device_is_held_to_what_tf32_explains_where_the_emulation_covers_the_model() {
        let opts = Options {
            tf32_tolerance: Some(5e-2),
            ..Options::default()
        };
        let errors = |loss, grad| Errors {
            loss_rel_err: loss,
            grad_rel_err: grad,
        };
        let emulated = |nearest, truncated, covers| Emulated {
            nearest: errors(1e-7, nearest),
            truncated: errors(2e-7, truncated),
            covers_every_product: covers,
        };
        let covered = emulated(1e-2, 3e-2, true);
        assert_eq!(covered.max(), 3e-2);
        assert_eq!(covered.grad_rel_err(), 3e-2);
        // An f32 device: the tolerance, whatever the emulation says.
        assert_eq!(tolerance_for(&opts, false, Some(&covered), None), 1e-3);
        assert_eq!(tolerance_for(&opts, false, None, None), 1e-3);
        // An f32 device: the factor times what one rounding of the weights does, where
        // larger.
        let loud = errors(1e-5, 4e-4);
        assert_eq!(tolerance_for(&opts, false, None, Some(&loud)), 4.0 * 4e-4);
        assert_eq!(
            tolerance_for(&opts, false, None, Some(&errors(1e-7, 2e-5))),
            1e-3
        );
        let off = Options {
            perturb_factor: 0.0,
            ..opts.clone()
        };
        assert_eq!(tolerance_for(&off, false, None, Some(&loud)), 1e-3);
        assert_eq!(
            tolerance_for(&opts, false, None, Some(&errors(f64::NAN, 1.0))),
            1e-3
        );
        // Under TF32 the emulation decides, not the perturbation.
        assert_eq!(tolerance_for(&opts, true, None, Some(&loud)), 5e-2);
        // TF32, covered: the factor times the larger error, never below the tolerance.
        assert_eq!(tolerance_for(&opts, true, Some(&covered), None), 2.0 * 3e-2);
        assert_eq!(
            tolerance_for(&opts, true, Some(&emulated(1e-5, 2e-5, true)), None),
            1e-3
        );
        // The loss counts too.
        let mut loud_loss = emulated(1e-5, 2e-5, true);
        loud_loss.truncated.loss_rel_err = 4e-3;
        assert_eq!(tolerance_for(&opts, true, Some(&loud_loss), None), 8e-3);
        // Not covered, or not emulated: the flat TF32 tolerance, else the tolerance.
        assert_eq!(
            tolerance_for(&opts, true, Some(&emulated(1e-2, 3e-2, false)), None),
            5e-2
        );
        assert_eq!(tolerance_for(&opts, true, None, None), 5e-2);
        let no_flat = Options::default();
        assert_eq!(tolerance_for(&no_flat, true, None, None), 1e-3);
        // A non-finite emulated step explains nothing.
        let nan = emulated(f64::NAN, 3e-2, true);
        assert!(nan.max().is_nan() && nan.grad_rel_err().is_nan());
        assert_eq!(tolerance_for(&opts, true, Some(&nan), None), 1e-3);
    }

    #[test]
    fn cpu_against_cpu_agrees_and_reports_every_column() {
        // The comparison path end to end on the one device CI has: identical weights and
        // batch on two CPU instances must agree to rounding, whatever the model.
        let opts = Options {
            models: vec![
                "lenet/lenet5".into(),
                "lstm/word:vocab=50,hidden=16,embed=16".into(),
            ],
            reference: Some(DeviceKind::Cpu),
            batch: Some(4),
            seq_len: 5,
            warmup: 1,
            steps: 1,
            ..Options::default()
        };
        let mut seen = 0;
        let mut measured = None;
        let rows = run(&opts, |p| measured = Some(*p), |_| seen += 1).unwrap();
        let p = measured.expect("a reference run measures the precision");
        assert_eq!(p.matmul_rel_err, 0.0);
        assert!(!p.tf32);
        assert_eq!(seen, 2);
        for r in &rows {
            let c = r.check.as_ref().unwrap();
            assert!(c.passed, "{r:?}");
            assert_eq!(c.tolerance, 1e-3);
            assert!(c.tf32_emulated.is_none(), "f32 on both sides: no emulation");
            assert!(c.grad_rel_err < 1e-6 && c.loss_rel_err < 1e-6, "{r:?}");
            assert!(c.loss.is_finite() && c.loss > 0.0);
            assert!(r.timing.step_ms > 0.0 && r.reference.as_ref().unwrap().step_ms > 0.0);
            assert!(table_row(r).contains(" ok "), "{}", table_row(r));
        }
        assert!(
            rows[1].dropout_off,
            "the LSTM has dropout, turned off for the comparison"
        );
        assert_eq!(rows[0].batch, "4x1x28x28");
    }

    #[test]
    fn a_wrong_weight_is_caught() {
        // The check can fail: the same step with one perturbed weight on the device side
        // is far from the reference.
        let (spec, _) = parse_model("mlp/mnist", true).unwrap();
        let dev = dtrain_models::cpu_device();
        let mut a = spec.build(&dev).unwrap();
        let mut b = spec.build(&dev).unwrap();
        let n = a.table().num_params();
        let mut p = vec![0.0f32; n];
        a.read_params(&mut p);
        p[0] += 0.5;
        p[1] -= 0.5;
        b.write_params(&p);
        let host = SyntheticBatch::new(a.input(), 8, 1, 1);
        let (mut ga, mut gb) = (vec![0.0; n], vec![0.0; n]);
        step(a.as_mut(), host.on(&dev), &mut ga).unwrap();
        step(b.as_mut(), host.on(&dev), &mut gb).unwrap();
        assert!(rel_err(&gb, &ga) > 1e-3, "{}", rel_err(&gb, &ga));
    }
}
