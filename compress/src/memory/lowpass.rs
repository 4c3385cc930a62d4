//! ScaleCom's low-pass-filtered error-feedback memory (Chen et al., NeurIPS 2020;
//! ALGORITHMS.md §12.2), the default memory of the `scalecom` compressor.

use std::collections::BTreeMap;
use std::ops::Range;

use super::Memory;

/// ScaleCom's low-pass-filtered error-feedback memory (ALGORITHMS.md §12.2):
/// ```text
/// p = m + g                              compensate
/// m ← (1 − β)·m + β·(p − D(C(p)))        update (β = 1: plain error feedback)
/// ```
#[derive(Debug, Clone)]
pub struct LowPass {
    beta: f32,
    mem: BTreeMap<u64, Vec<f32>>,
}

impl LowPass {
    /// A low-pass memory with coefficient β in (0, 1].
    pub fn new(beta: f32) -> Self {
        LowPass {
            beta,
            mem: BTreeMap::new(),
        }
    }

    /// The memory of bucket `key`, if any.
    pub fn memory_of(&self, key: u64) -> Option<&[f32]> {
        self.mem.get(&key).map(|v| v.as_slice())
    }
}

impl Memory for LowPass {
    fn compensate(&mut self, key: u64, grad: &[f32], out: &mut [f32]) {
        match self.mem.get(&key) {
            Some(m) if m.len() == grad.len() => {
                for ((o, &g), &m) in out.iter_mut().zip(grad).zip(m) {
                    *o = m + g;
                }
            }
            _ => out.copy_from_slice(grad),
        }
    }

    fn update(&mut self, key: u64, compensated: &[f32], transmitted: &[f32], _: &[Range<usize>]) {
        let m = self.mem.entry(key).or_default();
        if m.len() != compensated.len() {
            m.clear();
            m.resize(compensated.len(), 0.0);
        }
        let b = self.beta;
        if b == 1.0 {
            for ((m, &p), &t) in m.iter_mut().zip(compensated).zip(transmitted) {
                *m = p - t;
            }
        } else {
            for ((m, &p), &t) in m.iter_mut().zip(compensated).zip(transmitted) {
                *m = (1.0 - b) * *m + b * (p - t);
            }
        }
    }

    fn export(&self) -> BTreeMap<u64, Vec<f32>> {
        self.mem.clone()
    }

    fn import(&mut self, state: BTreeMap<u64, Vec<f32>>) {
        self.mem = state;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn low_pass_filter_matches_its_closed_form() {
        // With a constant residual r = p − D(C(p)), m_t = (1 − (1 − β)^t)·r.
        let r = [0.5f32, -2.0, 3.0, 0.0];
        for beta in [0.5f32, 0.1] {
            let mut m = LowPass::new(beta);
            let g = [1.0f32, 1.0, -1.0, 2.0];
            let mut p = [0f32; 4];
            for t in 1..=40 {
                m.compensate(0, &g, &mut p);
                let before = m.memory_of(0).map(|x| x.to_vec()).unwrap_or(vec![0.0; 4]);
                let sent: Vec<f32> = p.iter().zip(&r).map(|(p, r)| p - r).collect();
                m.update(0, &p, &sent, &[]);
                let now = m.memory_of(0).unwrap();
                let f = 1.0 - (1.0 - beta as f64).powi(t);
                for j in 0..4 {
                    let want = f * r[j] as f64;
                    assert!((now[j] as f64 - want).abs() < 1e-5, "β {beta} t {t}");
                    // Equivalent form: m ← m + β·(g − c).
                    let alt = before[j] + beta * (g[j] - sent[j]);
                    assert!((now[j] - alt).abs() < 1e-5);
                }
            }
        }
    }
}
