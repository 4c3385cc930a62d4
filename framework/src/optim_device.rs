//! The optimizer step where the model is (issue #51, ARCHITECTURE.md §10): on a GPU the
//! host optimizer ([`Optimizer`]) reads every parameter back, updates it on the host and
//! writes it again — two dense copies across PCIe and a host pass every step. Here the same
//! rules run as tensor operations on the model's device ([`Model::update_params_on_device`]):
//! the averaged gradient is there already (made there by the exchange,
//! [`DeviceMoments::step_tensor`]) or goes up once ([`DeviceMoments::step`]); the
//! parameters and the moments never leave.
//!
//! The formulas are [`Optimizer::apply`]'s, operation for operation (SGD with momentum,
//! dampening, Nesterov and PyTorch's first-step buffer; weight decay coupled or on the
//! momentum only; Adam and AdamW with the same bias corrections), so on the CPU backend the
//! parameters are the host optimizer's bit for bit (tested), and on a GPU within the
//! rounding of its fused kernels. The host [`Optimizer`] stays the state's owner for
//! checkpoints, hand-overs and the step count: [`DeviceMoments::settle`] copies the
//! moments back into it before anything reads them, and [`DeviceMoments::reset`] drops
//! the device copies after its state was replaced (a resume, a newcomer's entry), so the
//! next step takes them from the host again.

use std::collections::BTreeMap;

use dtrain_models::flat::{download, upload};
use dtrain_models::{FlatTensor, Model};

use crate::optim::{Optimizer, OptimizerConfig, OptimizerKind};

/// The group every parameter of a model belongs to (the trainer's one group).
const GROUP: u64 = 0;

/// The optimizer's moments on the model's device, one tensor per parameter (by its offset
/// in the flat layout). Empty until the first step on the device.
#[derive(Default)]
pub struct DeviceMoments {
    /// Momentum buffer (SGD) or first moment (Adam).
    m: BTreeMap<usize, FlatTensor>,
    /// Second moment (Adam).
    v: BTreeMap<usize, FlatTensor>,
    /// Whether the tensors here are the state (the host optimizer's copies may be older).
    /// When not, `m` and `v` are empty ([`DeviceMoments::reset`]).
    live: bool,
}

impl DeviceMoments {
    /// Applies one step of `opt` to every parameter of `model` with the averaged gradient
    /// `grads` (the flat layout, on the host) and learning rate `lr`: the host optimizer
    /// counts the step; the update runs on the model's device.
    pub fn step(&mut self, opt: &mut Optimizer, model: &mut dyn Model, grads: &[f32], lr: f32) {
        let g_all = upload(grads, model.device());
        self.step_tensor(opt, model, g_all, lr);
    }

    /// [`DeviceMoments::step`] with the averaged gradient `g_all` on the model's device
    /// already (the flat layout, without autodiff).
    pub fn step_tensor(
        &mut self,
        opt: &mut Optimizer,
        model: &mut dyn Model,
        g_all: FlatTensor,
        lr: f32,
    ) {
        let n = g_all.dims()[0];
        opt.begin(GROUP, n);
        let cfg = opt.config().clone();
        let group = opt.groups().get(&GROUP).expect("begun");
        let t = group.step;
        let device = model.device().clone();
        // The first step here, or the first since the host's state was replaced (the maps
        // are empty then): the moments so far are the host's (zeros on a fresh run, as
        // `begin` made them).
        let host = (!self.live).then_some(group);
        let (m_map, v_map) = (&mut self.m, &mut self.v);
        model.update_params_on_device(&mut |offset, p| {
            let len = p.dims()[0];
            let g = g_all.clone().narrow(0, offset, len);
            let take = |map: &mut BTreeMap<usize, FlatTensor>, host: Option<&[f32]>| {
                map.remove(&offset).or_else(|| {
                    host.filter(|h| !h.is_empty())
                        .map(|h| upload(&h[offset..offset + len], &device))
                })
            };
            let m = take(m_map, host.map(|h| h.m.as_slice()));
            let v = take(v_map, host.map(|h| h.v.as_slice()));
            let (p, m, v) = update(&cfg, t, lr, p, g, m, v);
            if let Some(m) = m {
                m_map.insert(offset, m);
            }
            if let Some(v) = v {
                v_map.insert(offset, v);
            }
            p
        });
        self.live = true;
    }

    /// Copies the moments into the host optimizer's state (before a checkpoint or a
    /// hand-over reads it). A no-op when no step ran on the device since the last reset.
    pub fn settle(&self, opt: &mut Optimizer) {
        if !self.live {
            return;
        }
        let Some(group) = opt.group_mut(GROUP) else {
            return;
        };
        for (map, host) in [(&self.m, &mut group.m), (&self.v, &mut group.v)] {
            for (&offset, t) in map {
                let values = download(t.clone());
                host[offset..offset + values.len()].copy_from_slice(&values);
            }
        }
    }

    /// Forgets the device's moments: the host optimizer's state was replaced, and the next
    /// step takes its moments from there.
    pub fn reset(&mut self) {
        self.m.clear();
        self.v.clear();
        self.live = false;
    }
}

/// One parameter's step `t` (counted from 1) of the rule `cfg`: the new parameter and
/// moments, from the parameter `p`, its averaged gradient `g` and its moments `m`, `v`
/// (`None` before the first step: PyTorch's momentum buffer starts as the first step's
/// direction; Adam's moments start at zero). [`Optimizer::apply`]'s formulas, operation
/// for operation.
fn update(
    cfg: &OptimizerConfig,
    t: u64,
    lr: f32,
    p: FlatTensor,
    g: FlatTensor,
    m: Option<FlatTensor>,
    v: Option<FlatTensor>,
) -> (FlatTensor, Option<FlatTensor>, Option<FlatTensor>) {
    let wd = cfg.weight_decay;
    match cfg.kind {
        OptimizerKind::Sgd | OptimizerKind::OnebitAdam | OptimizerKind::ZerooneAdam => {
            if cfg.momentum == 0.0 {
                // p −= lr·(g + wd·p)
                let step = g.add(p.clone().mul_scalar(wd)).mul_scalar(lr);
                return (p.sub(step), None, None);
            }
            let first = t == 1 || m.is_none();
            let (mu, damp) = (cfg.momentum, cfg.dampening);
            if cfg.decay_momentum_only {
                let d = p.clone().mul_scalar(wd);
                let b = match m.filter(|_| !first) {
                    None => d.clone(),
                    Some(b) => b.mul_scalar(mu).add(d.clone()),
                };
                let upd = if cfg.nesterov {
                    d.add(b.clone().mul_scalar(mu))
                } else {
                    b.clone()
                };
                let p = p.sub(g.add(upd).mul_scalar(lr));
                return (p, Some(b), None);
            }
            let d = g.add(p.clone().mul_scalar(wd));
            let b = match m.filter(|_| !first) {
                None => d.clone(),
                Some(b) => b.mul_scalar(mu).add(d.clone().mul_scalar(1.0 - damp)),
            };
            let upd = if cfg.nesterov {
                d.add(b.clone().mul_scalar(mu))
            } else {
                b.clone()
            };
            (p.sub(upd.mul_scalar(lr)), Some(b), None)
        }
        OptimizerKind::Adam | OptimizerKind::Adamw => {
            let (b1, b2) = (cfg.beta1, cfg.beta2);
            let ti = t as i32;
            let bc1 = 1.0 - (b1 as f64).powi(ti);
            let bc2 = 1.0 - (b2 as f64).powi(ti);
            let step_size = (lr as f64 / bc1) as f32;
            let inv_sqrt_bc2 = (1.0 / bc2.sqrt()) as f32;
            let (p, g) = if cfg.kind == OptimizerKind::Adamw {
                (p.mul_scalar(1.0 - lr * wd), g)
            } else {
                let g = g.add(p.clone().mul_scalar(wd));
                (p, g)
            };
            let zeros = || g.zeros_like();
            let m = m
                .unwrap_or_else(zeros)
                .mul_scalar(b1)
                .add(g.clone().mul_scalar(1.0 - b1));
            let v = v
                .unwrap_or_else(zeros)
                .mul_scalar(b2)
                .add(g.clone().mul_scalar(1.0 - b2).mul(g.clone()));
            let denom = v
                .clone()
                .sqrt()
                .mul_scalar(inv_sqrt_bc2)
                .add_scalar(cfg.eps);
            let p = p.sub(m.clone().mul_scalar(step_size).div(denom));
            (p, Some(m), Some(v))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dtrain_compress::Rng;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut r = Rng::seed_from_u64(seed);
        (0..n).map(|_| r.next_f32() * 2.0 - 1.0).collect()
    }

    /// A model's step through `DeviceMoments` (its parameters replaced through
    /// `Model::update_params_on_device`) is the host optimizer's over `update_params`, bit for
    /// bit on the CPU backend; the moments settle into the host state; the parameters still
    /// train (their gradients tracked) afterwards.
    #[test]
    fn a_models_step_on_its_device_is_the_host_step_and_its_moments_settle() {
        use dtrain_models::synthetic::SyntheticBatch;
        use dtrain_models::ModelSpec;
        let spec: ModelSpec = serde_json::from_str(r#"{"kind": "lenet"}"#).unwrap();
        let device = dtrain_models::cpu_device();
        let mut on_host = spec.build(&device).unwrap();
        let mut on_device = spec.build(&device).unwrap();
        let n = on_host.table().num_params();
        let mut params = vec![0.0; n];
        on_host.read_params(&mut params);
        on_device.write_params(&params);
        let cfg = OptimizerConfig {
            momentum: 0.9,
            nesterov: true,
            weight_decay: 5e-4,
            ..OptimizerConfig::default()
        };
        let (mut host_opt, mut dev_opt) = (cfg.build().unwrap(), cfg.build().unwrap());
        let mut moments = DeviceMoments::default();
        let batch = SyntheticBatch::new(on_host.input(), 4, 0, 3);
        for t in 0..3u64 {
            let mut g = vec![0.0; n];
            let out = on_host.forward_loss(batch.on(&device)).unwrap();
            on_host.backward_into(out.loss, &mut g);
            assert!(
                g.iter().any(|v| *v != 0.0),
                "step {t}: the gradient is tracked"
            );
            let lr = 0.1;
            host_opt.begin(GROUP, n);
            on_host.update_params(&mut |offset, p| {
                host_opt.apply(GROUP, offset, p, &g[offset..offset + p.len()], lr)
            });
            moments.step(&mut dev_opt, on_device.as_mut(), &g, lr);
            let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
            on_host.read_params(&mut a);
            on_device.read_params(&mut b);
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "step {t}: parameters differ"
            );
        }
        // The device model still trains: its parameters require gradients.
        let mut g = vec![0.0; n];
        let out = on_device.forward_loss(batch.on(&device)).unwrap();
        on_device.backward_into(out.loss, &mut g);
        assert!(
            g.iter().any(|v| *v != 0.0),
            "no gradient after the device steps"
        );
        // Before settling, the host state holds `begin`'s zeros; after, the device's moments.
        assert!(dev_opt.groups()[&GROUP].m.iter().all(|v| *v == 0.0));
        moments.settle(&mut dev_opt);
        assert_eq!(dev_opt.groups()[&GROUP], host_opt.groups()[&GROUP]);
    }

    /// Every rule, three steps on the CPU backend: the host optimizer's parameters and
    /// moments bit for bit, through `update`.
    #[test]
    fn every_rule_is_the_host_optimizers_bit_for_bit() {
        let base = OptimizerConfig::default();
        let sgd =
            |momentum, dampening, nesterov, decay_momentum_only, weight_decay| OptimizerConfig {
                kind: OptimizerKind::Sgd,
                momentum,
                dampening,
                nesterov,
                decay_momentum_only,
                weight_decay,
                ..base.clone()
            };
        let adam = |kind, weight_decay| OptimizerConfig {
            kind,
            weight_decay,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            ..base.clone()
        };
        let rules = [
            sgd(0.0, 0.0, false, false, 0.0),
            sgd(0.0, 0.0, false, false, 5e-4),
            sgd(0.9, 0.0, false, false, 5e-4),
            sgd(0.9, 0.1, false, false, 1e-4),
            sgd(0.9, 0.0, true, false, 5e-4),
            sgd(0.9, 0.0, false, true, 5e-4),
            sgd(0.9, 0.0, true, true, 5e-4),
            adam(OptimizerKind::Adam, 0.0),
            adam(OptimizerKind::Adam, 1e-2),
            adam(OptimizerKind::Adamw, 1e-2),
        ];
        let device = dtrain_models::cpu_device();
        let n = 1000;
        for cfg in rules {
            let mut host = cfg.build().unwrap();
            let mut params = values(n, 1);
            let mut on_device = upload(&params, &device);
            let (mut m, mut v) = (None, None);
            for t in 1..=3u64 {
                let g = values(n, 10 + t);
                let lr = 0.05 / t as f32;
                host.step(GROUP, &mut params, &g, lr);
                let (p, m2, v2) = update(&cfg, t, lr, on_device, upload(&g, &device), m, v);
                (on_device, m, v) = (p, m2, v2);
                let got = download(on_device.clone());
                let what = format!("{cfg:?}, step {t}");
                for (i, (a, b)) in got.iter().zip(&params).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{what}: parameter {i}: {a} vs {b}"
                    );
                }
                let st = &host.groups()[&GROUP];
                if let Some(m) = &m {
                    assert_eq!(download(m.clone()), st.m, "{what}: first moment");
                }
                if let Some(v) = &v {
                    assert_eq!(download(v.clone()), st.v, "{what}: second moment");
                }
            }
        }
    }
}
