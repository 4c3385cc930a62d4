//! Signum's momentum (Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex
//! Problems", ICML 2018, Algorithm 3): each worker compresses its running momentum instead
//! of its gradient,
//! ```text
//! p = β·m + (1 − β)·g      compensate
//! m ← p                    update (whatever was transmitted)
//! ```
//! so that `sign(p)` is the sign of the momentum. It is not error feedback (nothing of what
//! the compressor dropped is kept), which is why it is a memory of its own; GRACE's
//! `signum` keeps the same buffer inside its compressor.

use std::collections::BTreeMap;
use std::ops::Range;

use super::Memory;

/// The worker momentum of Signum (`p = β·m + (1 − β)·g; m ← p`), per bucket key.
#[derive(Debug, Clone)]
pub struct Momentum {
    beta: f32,
    momenta: BTreeMap<u64, Vec<f32>>,
}

impl Momentum {
    /// A momentum memory with factor `beta` in [0, 1) (0: the gradient itself).
    pub fn new(beta: f32) -> Self {
        Momentum {
            beta,
            momenta: BTreeMap::new(),
        }
    }
}

impl Memory for Momentum {
    fn compensate(&mut self, key: u64, grad: &[f32], out: &mut [f32]) {
        let b = self.beta;
        match self.momenta.get(&key) {
            Some(m) if m.len() == grad.len() => {
                for ((o, &g), &m) in out.iter_mut().zip(grad).zip(m) {
                    *o = b * m + (1.0 - b) * g;
                }
            }
            // The first step: m₀ = 0.
            _ => {
                for (o, &g) in out.iter_mut().zip(grad) {
                    *o = (1.0 - b) * g;
                }
            }
        }
    }

    fn update(&mut self, key: u64, compensated: &[f32], _: &[f32], _: &[Range<usize>]) {
        let m = self.momenta.entry(key).or_default();
        m.clear();
        m.extend_from_slice(compensated);
    }

    fn export(&self) -> BTreeMap<u64, Vec<f32>> {
        self.momenta.clone()
    }

    fn import(&mut self, state: BTreeMap<u64, Vec<f32>>) {
        self.momenta = state;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compensated_buffer_is_the_exponential_moving_average_of_the_gradients() {
        let mut m = Momentum::new(0.5);
        let mut p = [0f32; 2];
        let mut want = [0f64; 2];
        for (t, g) in [[2.0f32, -4.0], [4.0, 0.0], [-8.0, 2.0]].iter().enumerate() {
            m.compensate(7, g, &mut p);
            for j in 0..2 {
                want[j] = 0.5 * want[j] + 0.5 * f64::from(g[j]);
                assert_eq!(f64::from(p[j]), want[j], "step {t} element {j}");
            }
            // What was transmitted does not matter.
            m.update(7, &p, &[1e9, -1e9], &[]);
        }
        assert_eq!(m.export()[&7], vec![-2.75, 0.5]);
        // Another key starts from zero; state round-trips.
        m.compensate(8, &[2.0, 2.0], &mut p);
        assert_eq!(p, [1.0, 1.0]);
        let mut back = Momentum::new(0.5);
        back.import(m.export());
        assert_eq!(back.export(), m.export());
    }
}
