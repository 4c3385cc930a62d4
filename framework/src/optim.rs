//! Optimizers on flat `f32` parameter buffers, with PyTorch's semantics.
//!
//! The trainer owns the gradient path as flat buckets, so the optimizer works on the same
//! flat buffers: it needs no framework tensors, its state is a few `Vec<f32>` per parameter
//! group (exact to checkpoint and restore), and DGC's coupling — the gradient's momentum
//! lives in the DGC memory and the optimizer keeps only the weight-decay term's — is a
//! configuration, not a special case.
//!
//! Semantics (checked by the tests against a direct f64 transcription of the formulas):
//! * SGD: `d = g + λp`; with momentum `b = μb + (1−τ)d` (`b = d` on the first step);
//!   Nesterov `d = d + μb`, otherwise `d = b`; `p −= η·d`. Dampening τ defaults to 0
//!   (PyTorch's default; burn's `MomentumConfig` defaults to 0.1 — we do not).
//! * SGD with [`OptimizerConfig::decay_momentum_only`] (DGC's coupling): the momentum above
//!   runs on the weight-decay term alone, `d = λp`, and the gradient is added after it:
//!   `p −= η·(g + b)` (Nesterov `p −= η·(g + λp + μb)`). The gradient arrives already
//!   momentum-accumulated from the DGC memory; the decay term is identical on every worker,
//!   so it never crosses the network and keeps its momentum locally, as the DGC authors'
//!   optimizer does. By linearity, DGC at density 1 without masking is then exactly
//!   momentum SGD with weight decay.
//! * Adam: L2 `g += λp`; `m = β₁m + (1−β₁)g`; `v = β₂v + (1−β₂)g²`;
//!   `p −= η·m̂/(√v̂ + ε)` with bias corrections; ε defaults to 1e-8 (PyTorch).
//! * AdamW: decoupled decay `p ← p(1 − ηλ)` then the Adam step without L2.
//! * The compressed Adams (`onebit-adam`, `zeroone-adam`): their moments live in their
//!   gradient synchronisation (`crate::sync`), which exchanges the momentum compressed and
//!   hands the optimizer the direction `d = m/(√v + ε)`; the optimizer applies
//!   `p ← p − η(d + λp)` (decoupled decay, as DeepSpeed's `OnebitAdam` and `ZeroOneAdam` add
//!   `weight_decay · p` to the update). See [`CompressedOptimizer`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Which update rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// Stochastic gradient descent, optionally with (Nesterov) momentum.
    #[default]
    Sgd,
    /// Adam with L2 weight decay.
    Adam,
    /// Adam with decoupled weight decay.
    Adamw,
    /// 1-bit Adam (Tang et al. 2021): dense Adam for `freeze_step` steps, then the variance
    /// is frozen and the momentum is exchanged 1-bit compressed with error feedback on the
    /// worker and the aggregating side.
    #[serde(rename = "onebit-adam")]
    OnebitAdam,
    /// 0/1 Adam (Lu et al. 2022): adaptive variance freezing, 1-bit synchronisation and
    /// local steps.
    #[serde(rename = "zeroone-adam")]
    ZerooneAdam,
}

impl OptimizerKind {
    /// The config's spelling (`sgd`, `adam`, `adamw`, `onebit-adam`, `zeroone-adam`).
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adam => "adam",
            OptimizerKind::Adamw => "adamw",
            OptimizerKind::OnebitAdam => "onebit-adam",
            OptimizerKind::ZerooneAdam => "zeroone-adam",
        }
    }

    /// Whether this is a compressed optimizer: its moments live in the gradient
    /// synchronisation, which hands the optimizer a direction to apply.
    pub fn is_compressed(self) -> bool {
        matches!(self, OptimizerKind::OnebitAdam | OptimizerKind::ZerooneAdam)
    }

    /// Whether the optimizer keeps Adam's moments itself.
    fn has_moments(self) -> bool {
        matches!(self, OptimizerKind::Adam | OptimizerKind::Adamw)
    }
}

/// The schedule of a compressed optimizer (`train.optimizer = "onebit-adam"` or
/// `"zeroone-adam"`), resolved against the run: what its synchronisation needs besides the
/// moments' β₁, β₂, ε of [`OptimizerConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum CompressedOptimizer {
    /// 1-bit Adam: steps `0..freeze_step` are the dense warm-up (the variance is updated),
    /// every later step exchanges the compressed momentum against the frozen variance.
    OnebitAdam {
        /// The warm-up's length in optimizer steps (`train.freeze_step`).
        freeze_step: u64,
    },
    /// 0/1 Adam, with DeepSpeed's `ZeroOneAdam` parameters (their names).
    ZerooneAdam {
        /// The last step (counted from 1) whose gradient may update the variance
        /// (`train.var_freeze_step`).
        var_freeze_step: u64,
        /// κ: variance updates at one interval before the interval doubles
        /// (`train.var_update_scaler`).
        var_update_scaler: u64,
        /// Steps after the freeze before the local-step interval doubles
        /// (`train.local_step_scaler`).
        local_step_scaler: u64,
        /// H: the largest local-step interval (`train.local_step_clipper`).
        local_step_clipper: u64,
    },
}

/// Optimizer hyper-parameters (the learning rate comes from the schedule each step).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Update rule. Default `sgd`.
    #[serde(default)]
    pub kind: OptimizerKind,
    /// SGD momentum μ (0 disables). Default 0.
    #[serde(default)]
    pub momentum: f32,
    /// SGD dampening τ. Default 0.
    #[serde(default)]
    pub dampening: f32,
    /// Nesterov momentum. Default false.
    #[serde(default)]
    pub nesterov: bool,
    /// Weight decay λ. Default 0.
    #[serde(default)]
    pub weight_decay: f32,
    /// SGD only: apply the momentum to the weight-decay term alone and add the gradient
    /// after it (the gradient is momentum-accumulated elsewhere: DGC's memory). Default
    /// false.
    #[serde(default)]
    pub decay_momentum_only: bool,
    /// Adam β₁. Default 0.9.
    #[serde(default = "beta1")]
    pub beta1: f32,
    /// Adam β₂. Default 0.999.
    #[serde(default = "beta2")]
    pub beta2: f32,
    /// Adam ε. Default 1e-8.
    #[serde(default = "eps")]
    pub eps: f32,
}

fn beta1() -> f32 {
    0.9
}
fn beta2() -> f32 {
    0.999
}
fn eps() -> f32 {
    1e-8
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            kind: OptimizerKind::Sgd,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            decay_momentum_only: false,
            beta1: beta1(),
            beta2: beta2(),
            eps: eps(),
        }
    }
}

impl OptimizerConfig {
    /// Checks ranges; the error names the offending field.
    pub fn validate(&self) -> Result<(), String> {
        let unit = |name: &str, v: f32| {
            if v.is_finite() && (0.0..1.0).contains(&v) {
                Ok(())
            } else {
                Err(format!("train.{name} must be in [0, 1), got {v}"))
            }
        };
        unit("momentum", self.momentum)?;
        unit("dampening", self.dampening)?;
        unit("beta1", self.beta1)?;
        unit("beta2", self.beta2)?;
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(format!(
                "train.weight_decay must be >= 0, got {}",
                self.weight_decay
            ));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(format!("train.eps must be > 0, got {}", self.eps));
        }
        if self.nesterov && (self.momentum == 0.0 || self.dampening != 0.0) {
            return Err("train.nesterov needs momentum > 0 and dampening = 0".into());
        }
        if self.kind != OptimizerKind::Sgd && (self.momentum != 0.0 || self.nesterov) {
            return Err(format!(
                "train.momentum/nesterov apply to sgd only ({} has beta1)",
                self.kind.name()
            ));
        }
        if self.decay_momentum_only && (self.kind != OptimizerKind::Sgd || self.dampening != 0.0) {
            return Err(
                "train.optimizer: momentum on the decay term alone needs sgd without dampening"
                    .into(),
            );
        }
        Ok(())
    }

    /// Builds the optimizer.
    pub fn build(&self) -> Result<Optimizer, String> {
        self.validate()?;
        Ok(Optimizer {
            cfg: self.clone(),
            state: BTreeMap::new(),
        })
    }
}

/// Per-parameter-group state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupState {
    /// Steps taken on this group.
    pub step: u64,
    /// Momentum buffer (SGD) or first moment (Adam).
    pub m: Vec<f32>,
    /// Second moment (Adam).
    pub v: Vec<f32>,
}

/// A flat-buffer optimizer. Parameter groups are keyed by a stable id (e.g. the bucket id).
#[derive(Debug, Clone)]
pub struct Optimizer {
    cfg: OptimizerConfig,
    state: BTreeMap<u64, GroupState>,
}

impl Optimizer {
    /// The configuration.
    pub fn config(&self) -> &OptimizerConfig {
        &self.cfg
    }

    /// Applies one update to the group `key`: `params` and `grads` have equal lengths.
    /// Equivalent to [`Optimizer::begin`] followed by one [`Optimizer::apply`] at offset 0.
    ///
    /// # Panics
    /// If the lengths differ or change between steps for the same key (a trainer bug).
    pub fn step(&mut self, key: u64, params: &mut [f32], grads: &[f32], lr: f32) {
        assert_eq!(params.len(), grads.len(), "optimizer: params/grads length");
        self.begin(key, params.len());
        self.apply(key, 0, params, grads, lr);
    }

    /// Starts one step of the group `key` of `len` elements: counts the step (Adam's bias
    /// correction) and sizes the state. The update itself is then applied piecewise by
    /// [`Optimizer::apply`], e.g. one parameter tensor at a time, in place.
    ///
    /// # Panics
    /// If `len` changed since an earlier step of the same key (a trainer bug).
    pub fn begin(&mut self, key: u64, len: usize) {
        let c = &self.cfg;
        let st = self.state.entry(key).or_default();
        st.step += 1;
        let needs_m = c.kind.has_moments() || c.momentum != 0.0;
        let needs_v = c.kind.has_moments();
        if needs_m && st.m.is_empty() {
            st.m.resize(len, 0.0);
        }
        if needs_v && st.v.is_empty() {
            st.v.resize(len, 0.0);
        }
        assert!(
            (!needs_m || st.m.len() == len) && (!needs_v || st.v.len() == len),
            "optimizer: group {key} changed size"
        );
    }

    /// Applies the step begun by [`Optimizer::begin`] to the elements
    /// `offset..offset + params.len()` of group `key`. Every element of the group must be
    /// applied exactly once per step; the pieces may come in any order.
    ///
    /// # Panics
    /// If the lengths differ, the range is outside the group, or `begin` was not called.
    pub fn apply(&mut self, key: u64, offset: usize, params: &mut [f32], grads: &[f32], lr: f32) {
        assert_eq!(params.len(), grads.len(), "optimizer: params/grads length");
        let c = &self.cfg;
        let st = self
            .state
            .get_mut(&key)
            .expect("optimizer: apply before begin");
        let range = offset..offset + params.len();
        let wd = c.weight_decay;
        match c.kind {
            // The compressed Adams hand over their direction `m/(√v + ε)`: applied with
            // decoupled decay, which is SGD's update without momentum.
            OptimizerKind::Sgd | OptimizerKind::OnebitAdam | OptimizerKind::ZerooneAdam => {
                if c.momentum == 0.0 {
                    for (p, &g) in params.iter_mut().zip(grads) {
                        *p -= lr * (g + wd * *p);
                    }
                    return;
                }
                // PyTorch: the buffer starts as the first step's gradient.
                let first = st.step == 1;
                let (mu, damp) = (c.momentum, c.dampening);
                if c.decay_momentum_only {
                    for ((p, &g), b) in params.iter_mut().zip(grads).zip(&mut st.m[range]) {
                        let d = wd * *p;
                        *b = if first { d } else { mu * *b + d };
                        let upd = if c.nesterov { d + mu * *b } else { *b };
                        *p -= lr * (g + upd);
                    }
                    return;
                }
                for ((p, &g), b) in params.iter_mut().zip(grads).zip(&mut st.m[range]) {
                    let d = g + wd * *p;
                    *b = if first { d } else { mu * *b + (1.0 - damp) * d };
                    let upd = if c.nesterov { d + mu * *b } else { *b };
                    *p -= lr * upd;
                }
            }
            OptimizerKind::Adam | OptimizerKind::Adamw => {
                let (b1, b2) = (c.beta1, c.beta2);
                let t = st.step as i32;
                let bc1 = 1.0 - (b1 as f64).powi(t);
                let bc2 = 1.0 - (b2 as f64).powi(t);
                let step_size = (lr as f64 / bc1) as f32;
                let inv_sqrt_bc2 = (1.0 / bc2.sqrt()) as f32;
                let decoupled = c.kind == OptimizerKind::Adamw;
                for (((p, &g), m), v) in params
                    .iter_mut()
                    .zip(grads)
                    .zip(&mut st.m[range.clone()])
                    .zip(&mut st.v[range])
                {
                    let g = if decoupled {
                        *p *= 1.0 - lr * wd;
                        g
                    } else {
                        g + wd * *p
                    };
                    *m = b1 * *m + (1.0 - b1) * g;
                    *v = b2 * *v + (1.0 - b2) * g * g;
                    let denom = v.sqrt() * inv_sqrt_bc2 + c.eps;
                    *p -= step_size * *m / denom;
                }
            }
        }
    }

    /// State for a checkpoint.
    pub fn export(&self) -> BTreeMap<u64, GroupState> {
        self.state.clone()
    }

    /// The state of each parameter group, borrowed (what [`Optimizer::export`] copies).
    pub fn groups(&self) -> &BTreeMap<u64, GroupState> {
        &self.state
    }

    /// The state of group `key`, to write into (the device optimizer's moments brought back,
    /// [`crate::optim_device`]).
    pub fn group_mut(&mut self, key: u64) -> Option<&mut GroupState> {
        self.state.get_mut(&key)
    }

    /// Restores state written by [`Optimizer::export`].
    pub fn import(&mut self, state: BTreeMap<u64, GroupState>) {
        self.state = state;
    }
}

/// Scales `g` to L2 norm at most `max` (`train.clip_norm`; the norm is accumulated in f64
/// in index order, so every rank computes the same factor).
pub(crate) fn clip_to_norm(g: &mut [f32], max: f32) {
    let norm = g
        .iter()
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt();
    if norm > max as f64 {
        let scale = (max as f64 / norm) as f32;
        g.iter_mut().for_each(|x| *x *= scale);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Independent f64 transcription of PyTorch's `torch.optim.SGD` update.
    #[allow(clippy::too_many_arguments)]
    fn sgd_ref(
        p: &mut [f64],
        b: &mut Option<Vec<f64>>,
        g: &[f64],
        lr: f64,
        mu: f64,
        damp: f64,
        wd: f64,
        nest: bool,
    ) {
        let d: Vec<f64> = p.iter().zip(g).map(|(p, g)| g + wd * p).collect();
        let upd: Vec<f64> = if mu != 0.0 {
            let nb: Vec<f64> = match b {
                None => d.clone(),
                Some(b) => b
                    .iter()
                    .zip(&d)
                    .map(|(b, d)| mu * b + (1.0 - damp) * d)
                    .collect(),
            };
            *b = Some(nb.clone());
            if nest {
                d.iter().zip(&nb).map(|(d, b)| d + mu * b).collect()
            } else {
                nb
            }
        } else {
            d
        };
        for (p, u) in p.iter_mut().zip(upd) {
            *p -= lr * u;
        }
    }

    fn grads(t: usize) -> Vec<f32> {
        (0..5)
            .map(|i| ((i * 7 + t * 3) % 11) as f32 / 5.0 - 1.0)
            .collect()
    }

    #[test]
    fn sgd_variants_match_reference() {
        for (mu, damp, wd, nest) in [
            (0.0, 0.0, 0.0, false),
            (0.9, 0.0, 5e-4, false),
            (0.9, 0.0, 1e-2, true),
            (0.5, 0.1, 0.0, false),
        ] {
            let cfg = OptimizerConfig {
                momentum: mu,
                dampening: damp,
                weight_decay: wd,
                nesterov: nest,
                ..Default::default()
            };
            let mut opt = cfg.build().unwrap();
            let mut p: Vec<f32> = vec![0.5, -1.0, 2.0, 0.0, 3.0];
            let mut pr: Vec<f64> = p.iter().map(|&x| x as f64).collect();
            let mut br = None;
            for t in 0..20 {
                let g = grads(t);
                opt.step(1, &mut p, &g, 0.05);
                let gd: Vec<f64> = g.iter().map(|&x| x as f64).collect();
                sgd_ref(
                    &mut pr,
                    &mut br,
                    &gd,
                    0.05,
                    mu as f64,
                    damp as f64,
                    wd as f64,
                    nest,
                );
            }
            for (a, b) in p.iter().zip(&pr) {
                assert!(
                    (*a as f64 - b).abs() < 1e-5,
                    "mu {mu} nest {nest}: {a} vs {b}"
                );
            }
        }
    }

    /// DGC's coupling: a gradient already momentum-accumulated elsewhere (`u = μu + g`, the
    /// Nesterov form `u + g` with `u = μ(u + g)`), plus momentum on the decay term alone, is
    /// momentum SGD with weight decay on `g` (linearity), up to float rounding.
    #[test]
    fn decay_momentum_only_plus_accumulated_gradient_is_momentum_sgd() {
        let (mu, wd, lr) = (0.9f32, 1e-2f32, 0.05f32);
        let p0: Vec<f32> = vec![0.5, -1.0, 2.0, 0.0, 3.0];
        // 25 steps of `cfg` fed what a DGC memory at density 1 sends for `grads(t)`.
        let fed_accumulated = |cfg: OptimizerConfig, nest: bool| {
            let mut opt = cfg.build().unwrap();
            let (mut p, mut u) = (p0.clone(), vec![0f32; 5]);
            for t in 0..25 {
                let sent: Vec<f32> = grads(t)
                    .iter()
                    .zip(&mut u)
                    .map(|(&g, u)| {
                        if nest {
                            *u = mu * (*u + g);
                            *u + g
                        } else {
                            *u = mu * *u + g;
                            *u
                        }
                    })
                    .collect();
                opt.step(2, &mut p, &sent, lr);
            }
            p
        };
        for nest in [false, true] {
            let full = OptimizerConfig {
                momentum: mu,
                weight_decay: wd,
                nesterov: nest,
                ..Default::default()
            };
            let mut a = full.build().unwrap();
            let mut pa = p0.clone();
            for t in 0..25 {
                a.step(2, &mut pa, &grads(t), lr);
            }
            let split = OptimizerConfig {
                decay_momentum_only: true,
                ..full.clone()
            };
            let pb = fed_accumulated(split, nest);
            for (x, y) in pa.iter().zip(&pb) {
                assert!((x - y).abs() < 1e-5, "nesterov {nest}: {x} vs {y}");
            }
            // Without the decay-term momentum the two drift apart: the test can fail.
            let plain = OptimizerConfig {
                momentum: 0.0,
                nesterov: false,
                ..full.clone()
            };
            let pc = fed_accumulated(plain, false);
            let drift = pa
                .iter()
                .zip(&pc)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(drift > 1e-3, "decay without momentum only drifted {drift}");
        }
    }

    #[test]
    fn adam_and_adamw_match_reference() {
        for kind in [OptimizerKind::Adam, OptimizerKind::Adamw] {
            let cfg = OptimizerConfig {
                kind,
                weight_decay: 0.01,
                ..Default::default()
            };
            let mut opt = cfg.build().unwrap();
            let mut p: Vec<f32> = vec![0.5, -1.0, 2.0, 0.0, 3.0];
            let mut pr: Vec<f64> = p.iter().map(|&x| x as f64).collect();
            let (mut m, mut v) = (vec![0f64; 5], vec![0f64; 5]);
            let (b1, b2, eps, lr, wd) = (0.9f64, 0.999f64, 1e-8f64, 0.01f64, 0.01f64);
            for t in 1..=30 {
                let g = grads(t);
                opt.step(3, &mut p, &g, lr as f32);
                for i in 0..5 {
                    let mut gi = g[i] as f64;
                    if kind == OptimizerKind::Adamw {
                        pr[i] *= 1.0 - lr * wd;
                    } else {
                        gi += wd * pr[i];
                    }
                    m[i] = b1 * m[i] + (1.0 - b1) * gi;
                    v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                    let mh = m[i] / (1.0 - b1.powi(t as i32));
                    let vh = v[i] / (1.0 - b2.powi(t as i32));
                    pr[i] -= lr * mh / (vh.sqrt() + eps);
                }
            }
            for (a, b) in p.iter().zip(&pr) {
                assert!((*a as f64 - b).abs() < 1e-4, "{kind:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn state_round_trips_and_resume_is_exact() {
        let cfg = OptimizerConfig {
            kind: OptimizerKind::Adam,
            ..Default::default()
        };
        let mut a = cfg.build().unwrap();
        let mut pa = vec![1.0f32; 5];
        for t in 0..5 {
            a.step(0, &mut pa, &grads(t), 0.01);
        }
        let mut b = cfg.build().unwrap();
        b.import(a.export());
        let mut pb = pa.clone();
        for t in 5..10 {
            a.step(0, &mut pa, &grads(t), 0.01);
            b.step(0, &mut pb, &grads(t), 0.01);
        }
        assert_eq!(pa, pb);
    }

    #[test]
    fn piecewise_apply_in_any_order_equals_one_step() {
        let kinds = [
            OptimizerConfig::default(),
            OptimizerConfig {
                momentum: 0.9,
                weight_decay: 1e-3,
                nesterov: true,
                ..Default::default()
            },
            OptimizerConfig {
                kind: OptimizerKind::Adamw,
                weight_decay: 1e-2,
                ..Default::default()
            },
            OptimizerConfig {
                momentum: 0.9,
                weight_decay: 1e-3,
                decay_momentum_only: true,
                ..Default::default()
            },
        ];
        for cfg in kinds {
            let (mut a, mut b) = (cfg.build().unwrap(), cfg.build().unwrap());
            let mut pa: Vec<f32> = (0..10).map(|i| i as f32 / 7.0 - 0.5).collect();
            let mut pb = pa.clone();
            for t in 0..4 {
                let g: Vec<f32> = (0..10)
                    .map(|i| ((i * 5 + t * 3) % 7) as f32 - 3.0)
                    .collect();
                a.step(3, &mut pa, &g, 0.1);
                b.begin(3, 10);
                // Three pieces, last first.
                for r in [7..10, 0..3, 3..7] {
                    b.apply(3, r.start, &mut pb[r.clone()], &g[r], 0.1);
                }
            }
            assert_eq!(pa, pb, "{:?}", cfg.kind);
            assert_eq!(a.export(), b.export());
        }
    }

    #[test]
    fn invalid_configs_name_the_field() {
        let e = OptimizerConfig {
            momentum: 1.5,
            ..Default::default()
        }
        .build()
        .unwrap_err();
        assert!(e.contains("train.momentum"), "{e}");
        let e = OptimizerConfig {
            nesterov: true,
            ..Default::default()
        }
        .build()
        .unwrap_err();
        assert!(e.contains("nesterov"), "{e}");
        let e = OptimizerConfig {
            kind: OptimizerKind::Adam,
            momentum: 0.9,
            ..Default::default()
        }
        .build()
        .unwrap_err();
        assert!(e.contains("sgd only"), "{e}");
    }
}
