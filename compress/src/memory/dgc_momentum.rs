//! DGC's momentum-corrected error-feedback memory (Lin et al., ICLR 2018; ALGORITHMS.md
//! §10.2): local momentum `u`, local velocity accumulation `v`, optional Nesterov form,
//! momentum-factor masking and local gradient clipping ([`Clip`]). It is the default memory
//! of the `dgc` compressor, whose module docs say how the trainer's optimizer must pair
//! with it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Memory;
use crate::error::ConfigError;

/// Local gradient clipping applied by [`DgcMemory`] before accumulation (ALGORITHMS.md §10.2).
/// The statistic is taken over the whole buffer passed to [`Memory::compensate`] (one
/// bucket; use one bucket per tensor for per-tensor clipping).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Clip {
    /// No clipping.
    #[default]
    None,
    /// The paper's rule: scale the local gradient to norm at most `max_norm / √workers`.
    Norm {
        /// The global clip norm `Gmax`.
        max_norm: f32,
        /// Number of workers `N` (default 1).
        #[serde(default = "one_u32")]
        workers: u32,
    },
    /// Clip each element to `[−max, max]` (the by-value variant of GRACE and the authors'
    /// code). Those codes set `max = sqrt(mean over workers of Σg²)`, which needs an
    /// all-reduce; [`reference_clip_value`] computes it from the workers' sums of squares.
    Value {
        /// The clip value `c > 0`.
        max: f32,
    },
}

/// The reference codes' by-value clip threshold: `sqrt(mean_k Σ g_k²)` from each worker's
/// local sum of squares (0 for an empty list).
pub fn reference_clip_value(sum_sq_per_worker: &[f64]) -> f32 {
    if sum_sq_per_worker.is_empty() {
        return 0.0;
    }
    (sum_sq_per_worker.iter().sum::<f64>() / sum_sq_per_worker.len() as f64).sqrt() as f32
}

fn one_u32() -> u32 {
    1
}

impl Clip {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        match *self {
            Clip::Norm { max_norm, workers } => {
                if !(max_norm.is_finite() && max_norm > 0.0) {
                    return Err(ConfigError::new("memory.clip.max_norm", "must be > 0"));
                }
                if workers == 0 {
                    return Err(ConfigError::new("memory.clip.workers", "must be >= 1"));
                }
            }
            Clip::Value { max: m } if !(m.is_finite() && m > 0.0) => {
                return Err(ConfigError::new("memory.clip.max", "must be > 0"));
            }
            _ => {}
        }
        Ok(())
    }
}

/// The momentum-corrected memory of one bucket.
#[derive(Debug, Clone, Default)]
struct DgcState {
    u: Vec<f32>,
    v: Vec<f32>,
}

/// DGC's momentum-correction memory (ALGORITHMS.md §10.2):
/// ```text
/// g ← clip(g)
/// u ← m·u + g            (Nesterov: u ← m·(u + g); v ← v + u + g)
/// v ← v + u              compensate returns p = v
/// v ← p − D(C(p))        update: keep what was not sent (zero at sent coordinates)
/// u[j] ← 0 where sent    momentum-factor masking (if enabled), in segments that held
///                        something back (see `update`)
/// ```
/// A coordinate counts as *sent* when its transmitted value is non-zero (DGC transmits the
/// exact `v[j]`, and a selected `v[j] == 0` leaves `v` unchanged anyway).
#[derive(Debug, Clone)]
pub struct DgcMemory {
    momentum: f32,
    nesterov: bool,
    masking: bool,
    clip: Clip,
    state: BTreeMap<u64, DgcState>,
}

impl DgcMemory {
    /// A memory with momentum `m`, the Nesterov form on or off, masking on or off and the
    /// given clipping.
    pub fn new(momentum: f32, nesterov: bool, masking: bool, clip: Clip) -> Self {
        DgcMemory {
            momentum,
            nesterov,
            masking,
            clip,
            state: BTreeMap::new(),
        }
    }

    /// The local momentum `u` of bucket `key`.
    pub fn momentum_of(&self, key: u64) -> Option<&[f32]> {
        self.state.get(&key).map(|s| s.u.as_slice())
    }

    /// The accumulated velocity `v` of bucket `key`.
    pub fn velocity_of(&self, key: u64) -> Option<&[f32]> {
        self.state.get(&key).map(|s| s.v.as_slice())
    }
}

/// `sqrt(Σ g²)` accumulated in f64.
fn l2_norm(g: &[f32]) -> f64 {
    g.iter()
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt()
}

impl Memory for DgcMemory {
    fn compensate(&mut self, key: u64, grad: &[f32], out: &mut [f32]) {
        let n = grad.len();
        let st = self.state.entry(key).or_default();
        if st.u.len() != n || st.v.len() != n {
            st.u.clear();
            st.u.resize(n, 0.0);
            st.v.clear();
            st.v.resize(n, 0.0);
        }
        let (scale, cap) = match self.clip {
            Clip::None => (1.0f32, f32::INFINITY),
            Clip::Norm { max_norm, workers } => {
                let limit = max_norm as f64 / (workers as f64).sqrt();
                let norm = l2_norm(grad);
                if norm > limit {
                    ((limit / norm) as f32, f32::INFINITY)
                } else {
                    (1.0, f32::INFINITY)
                }
            }
            Clip::Value { max } => (1.0, max),
        };
        let m = self.momentum;
        let it = grad
            .iter()
            .zip(st.u.iter_mut())
            .zip(st.v.iter_mut())
            .zip(out.iter_mut());
        for (((&g, u), v), o) in it {
            let g = if scale != 1.0 { g * scale } else { g };
            let g = g.clamp(-cap, cap);
            if self.nesterov {
                *u = m * (*u + g);
                *v += *u + g;
            } else {
                *u = m * *u + g;
                *v += *u;
            }
            *o = *v;
        }
    }

    /// Keeps `v = p − D(C(p))` and masks the momentum of the sent coordinates of every
    /// segment that held something back. A segment sent in full (`D(C(p)) == p`: a dense
    /// bias or BN segment, or density 1) delayed nothing, so it carries no stale momentum to
    /// stop; masking it would only turn its momentum SGD into plain SGD. The authors' code
    /// likewise applies plain momentum to the tensors it sends dense.
    fn update(
        &mut self,
        key: u64,
        compensated: &[f32],
        transmitted: &[f32],
        segments: &[std::ops::Range<usize>],
    ) {
        let n = compensated.len();
        let st = self.state.entry(key).or_default();
        if st.u.len() != n {
            st.u.clear();
            st.u.resize(n, 0.0);
        }
        st.v.resize(n, 0.0);
        let whole = 0..n;
        let segments = if segments.is_empty() {
            std::slice::from_ref(&whole)
        } else {
            segments
        };
        for r in segments {
            let (p, t) = (&compensated[r.clone()], &transmitted[r.clone()]);
            let held_back = p.iter().zip(t).any(|(p, t)| p != t);
            let mask = self.masking && held_back;
            for (((v, u), &p), &t) in st.v[r.clone()]
                .iter_mut()
                .zip(st.u[r.clone()].iter_mut())
                .zip(p)
                .zip(t)
            {
                *v = p - t;
                if mask && t != 0.0 {
                    *u = 0.0;
                }
            }
        }
    }

    /// One buffer per bucket: `u` followed by `v` (length `2n`).
    fn export(&self) -> BTreeMap<u64, Vec<f32>> {
        self.state
            .iter()
            .map(|(&k, s)| {
                let mut b = Vec::with_capacity(s.u.len() + s.v.len());
                b.extend_from_slice(&s.u);
                b.extend_from_slice(&s.v);
                (k, b)
            })
            .collect()
    }

    /// Restores [`Memory::export`]'s layout; a buffer of odd length is not a DGC state
    /// and is skipped.
    fn import(&mut self, state: BTreeMap<u64, Vec<f32>>) {
        self.state.clear();
        for (k, b) in state {
            if b.len() % 2 != 0 {
                continue;
            }
            let (u, v) = b.split_at(b.len() / 2);
            self.state.insert(
                k,
                DgcState {
                    u: u.to_vec(),
                    v: v.to_vec(),
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::outlier_vector as data;

    #[test]
    fn clipping_scales_as_specified() {
        let n = 1000;
        let g: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let norm = l2_norm(&g);
        let mut p = vec![0f32; n];
        // By norm: Gmax / √N.
        let (gmax, workers) = (norm as f32, 4u32);
        let mut m = DgcMemory::new(
            0.9,
            false,
            true,
            Clip::Norm {
                max_norm: gmax,
                workers,
            },
        );
        m.compensate(0, &g, &mut p);
        let clipped = l2_norm(&p);
        let limit = gmax as f64 / 2.0;
        assert!(clipped <= limit * (1.0 + 1e-6) && clipped >= limit * (1.0 - 1e-6));
        for (a, b) in p.iter().zip(&g) {
            assert!((a - b * 0.5).abs() <= 1e-6, "direction kept");
        }
        // Below the limit nothing changes.
        let mut m = DgcMemory::new(
            0.9,
            false,
            true,
            Clip::Norm {
                max_norm: 10.0 * gmax,
                workers: 1,
            },
        );
        m.compensate(0, &g, &mut p);
        assert_eq!(p, g);
        // By value.
        let mut m = DgcMemory::new(0.9, false, true, Clip::Value { max: 0.25 });
        m.compensate(0, &g, &mut p);
        for (a, b) in p.iter().zip(&g) {
            assert_eq!(*a, b.clamp(-0.25, 0.25));
        }
        assert_eq!(reference_clip_value(&[4.0, 12.0]), 8f32.sqrt());
    }

    #[test]
    fn memory_config_parses_and_validates() {
        use crate::memory::MemoryConfig;
        let text = "kind = \"dgc-momentum\"\nnesterov = true\n[clip]\nkind = \"norm\"\nmax_norm = 5.0\nworkers = 8\n";
        let parsed: MemoryConfig = toml::from_str(text).unwrap();
        let want = MemoryConfig::DgcMomentum {
            momentum: 0.9,
            nesterov: true,
            masking: true,
            clip: Clip::Norm {
                max_norm: 5.0,
                workers: 8,
            },
        };
        assert_eq!(parsed, want);
        assert!(parsed.owns_momentum() && !MemoryConfig::RESIDUAL.owns_momentum());
        assert!(parsed.build().is_ok());
        let back: MemoryConfig = toml::from_str(&toml::to_string(&want).unwrap()).unwrap();
        assert_eq!(back, want);
        let bad_workers = MemoryConfig::DgcMomentum {
            momentum: 0.9,
            nesterov: false,
            masking: true,
            clip: Clip::Norm {
                max_norm: 1.0,
                workers: 0,
            },
        };
        assert!(bad_workers.build().is_err());
        let bad_m = MemoryConfig::DgcMomentum {
            momentum: 1.0,
            nesterov: false,
            masking: true,
            clip: Clip::None,
        };
        assert!(bad_m.build().is_err());
    }

    #[test]
    fn memory_state_round_trips_through_export() {
        let mut m = DgcMemory::new(0.9, true, true, Clip::None);
        let g = data(300, 9);
        let mut p = vec![0f32; 300];
        m.compensate(3, &g, &mut p);
        m.compensate(5, &g[..100], &mut p[..100]);
        let state = m.export();
        assert_eq!(state[&3].len(), 600);
        let mut m2 = DgcMemory::new(0.9, true, true, Clip::None);
        m2.import(state);
        let (mut a, mut b) = (vec![0f32; 300], vec![0f32; 300]);
        m.compensate(3, &g, &mut a);
        m2.compensate(3, &g, &mut b);
        assert_eq!(a, b);
        assert_eq!(m2.momentum_of(5).unwrap(), m.momentum_of(5).unwrap());
    }
}
