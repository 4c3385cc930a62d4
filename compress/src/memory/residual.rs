//! No memory, and residual error feedback `p = β·e + γ·g` (GRACE's `ResidualMemory`).

use std::collections::BTreeMap;
use std::ops::Range;

use super::Memory;

/// No memory: `p = g`, nothing is remembered.
#[derive(Debug, Default, Clone)]
pub struct NoMemory;

impl Memory for NoMemory {
    fn compensate(&mut self, _key: u64, grad: &[f32], out: &mut [f32]) {
        out.copy_from_slice(grad);
    }
    fn update(&mut self, _key: u64, _p: &[f32], _t: &[f32], _segments: &[Range<usize>]) {}
    fn is_active(&self) -> bool {
        false
    }
    fn export(&self) -> BTreeMap<u64, Vec<f32>> {
        BTreeMap::new()
    }
    fn import(&mut self, _state: BTreeMap<u64, Vec<f32>>) {}
}

/// Residual memory with decay `β` and gradient gain `γ` (GRACE's `ResidualMemory`).
#[derive(Debug, Clone)]
pub struct Residual {
    beta: f32,
    gamma: f32,
    residuals: BTreeMap<u64, Vec<f32>>,
}

impl Residual {
    /// A residual memory; `β = γ = 1` is classic error feedback.
    pub fn new(beta: f32, gamma: f32) -> Self {
        Residual {
            beta,
            gamma,
            residuals: BTreeMap::new(),
        }
    }

    /// The current residual of bucket `key`, if any.
    pub fn residual(&self, key: u64) -> Option<&[f32]> {
        self.residuals.get(&key).map(|v| v.as_slice())
    }
}

impl Memory for Residual {
    fn compensate(&mut self, key: u64, grad: &[f32], out: &mut [f32]) {
        let (beta, gamma) = (self.beta, self.gamma);
        match self.residuals.get(&key) {
            Some(e) if e.len() == grad.len() => {
                for ((o, &g), &e) in out.iter_mut().zip(grad).zip(e) {
                    *o = beta * e + gamma * g;
                }
            }
            _ => {
                for (o, &g) in out.iter_mut().zip(grad) {
                    *o = gamma * g;
                }
            }
        }
    }

    fn update(&mut self, key: u64, compensated: &[f32], transmitted: &[f32], _: &[Range<usize>]) {
        let e = self.residuals.entry(key).or_default();
        e.resize(compensated.len(), 0.0);
        for ((e, &p), &t) in e.iter_mut().zip(compensated).zip(transmitted) {
            *e = p - t;
        }
    }

    fn is_classic_residual(&self) -> bool {
        self.beta == 1.0 && self.gamma == 1.0
    }

    fn export(&self) -> BTreeMap<u64, Vec<f32>> {
        self.residuals.clone()
    }

    fn import(&mut self, state: BTreeMap<u64, Vec<f32>>) {
        self.residuals = state;
    }
}
