//! `mipd`: layer-wise adaptive sparsification by parameter significance, a per-layer
//! distribution-fitted code-book, and the parameter server's exponential smoothing with
//! alternating-half updates (ALGORITHMS.md §14; Zhang & Wang, TPDS 2022).
//!
//! Only the abstract of the paper is verified; everything below is the template of §14
//! with each `[U]` choice made explicit and configurable.
//!
//! # Worker side ([`Mipd`], configured by [`MipdConfig`])
//! Per layer `l` (a contiguous range of the flat buffer, given by the caller):
//! 1. **Significance** ([`Significance`]): `s_j = |w_j·g_j|` (first-order Taylor saliency,
//!    the default) or `s_j = |g_j|`. The worker therefore needs the layer's *parameters*
//!    as well as its gradient: [`Mipd::encode`] takes both. A layer whose Taylor mass is
//!    zero while its gradient is not (e.g. freshly zero-initialised biases) falls back to
//!    `|g_j|`, otherwise it could never be selected.
//! 2. **Adaptive keep ratio ρ_l** ([`keep_count`]): the smallest `k` whose `k` most
//!    significant entries hold at least `mass · Σ_j s_j`, clamped to
//!    `[max(1, ⌈ρ_min·n⌉), max(that, ⌈ρ_max·n⌉)]`; `ρ_l = k/n`. A layer of all-zero scores
//!    keeps the lower bound. The `k` entries of largest score are kept (ties → smaller
//!    index, [`crate::select::top_k`]).
//! 3. **Code-book** ([`fit_codebook`]): the kept values are quantized to at most `2^b`
//!    levels by Lloyd-Max iterations on the sorted values (cells are contiguous runs, so an
//!    iteration costs `O(L log k)` with prefix sums). Lloyd-Max is run twice, initialised
//!    at the quantiles `(i+½)/L` and at the uniform grid over `[min, max]`, and the
//!    code-book of lower mean-squared error is kept — so it is never worse than the
//!    uniform quantizer with the same number of levels. If the kept values have at most
//!    `2^b` distinct values they are the code-book (lossless).
//! 4. **Index encoding**: the kept (ascending) indices as Elias-gamma coded gaps, or as a
//!    bitmap, whichever takes fewer bytes.
//!
//! The generic [`Compressor`] seam sees gradients only; [`Mipd`] implements it anyway so
//! that its payloads decode through [`crate::decompress_add`] and share the framing, fuzz
//! suite and `Gather` aggregation of the other methods. Through that seam (no parameters)
//! the significance is always `|g_j|`; the parameter-aware entry point is [`Mipd::encode`],
//! which writes the very same framing.
//!
//! **Error feedback**: MIPD does not build EF in. The template compensates dropped
//! coordinates on the server ([`MipdServer`]'s smoothing) instead; a caller that also
//! wants worker-side EF wraps [`Mipd::encode`] in a [`crate::memory::Residual`] memory
//! (compensate, encode, decode its own payload, update) like any biased compressor.
//!
//! # Wire format (body of one layer of `n` elements, little-endian)
//! The payload is the shared framing of [`crate::compressor`] (12-byte header with method
//! id [`MipdConfig::ID`](crate::Method::ID), segment table when there is more than one layer), then per layer:
//! ```text
//! u32 k                  kept entries, 0..=n; nothing follows when k = 0
//! u8  index layout       0 = Elias-gamma gaps, 1 = bitmap
//! u32 m                  index bytes (bitmap: exactly ⌈n/8⌉)
//! m bytes                gaps: k codes of (i_0 + 1), (i_1 − i_0), …, LSB-first, zero-padded
//!                        bitmap: bit i set ⇔ i kept, LSB-first, no bits past n
//! u32 L                  code-book levels, 1 ≤ L ≤ min(k, 65536)
//! L × f32                levels, finite, strictly ascending
//! ⌈k·w/8⌉ bytes          codes, w = ⌈log2 L⌉ bits each (0 when L = 1), LSB-first, each < L,
//!                        in ascending index order
//! ```
//! Bits per layer: `32 + [k>0]·(72 + min(8·gap_bytes, 8⌈n/8⌉) + 32L + 8⌈k·w/8⌉)`, with
//! `w ≤ b` and Elias-gamma gaps costing about `2·log2(1/ρ_l) + 1` bits per kept entry.
//!
//! # Server side ([`MipdServer`], configured by [`MipdServerConfig`])
//! One server state per shard. At step `t` it decodes the pushes of every worker (checking
//! each one completely before any state changes), sums them in worker order into a carry
//! buffer and marks the received coordinates; then, for the coordinates of the half
//! `H_{t mod 2}` ([`Halves`]) only:
//! ```text
//! ĝ_t[j] = carry[j]            if j was received since its half was last updated
//!          λ·ĝ_{t−2}[j]         otherwise (exponential smoothing of dropped entries)
//! ```
//! and resets their carry. Coordinates of the other half keep accumulating, so nothing
//! pushed is lost: a gradient received at step `t` for a coordinate of the other half is
//! applied at step `t + 1`. With [`Halves::Off`] every coordinate is updated every step and
//! `ĝ_{t−1}` replaces `ĝ_{t−2}` above (the template literally). The dense work per step
//! (smoothing, output) is over half the coordinates; decoding is over the pushes only.
//!
//! The result is the **sum** over workers (divide by the worker count for a mean). The
//! pull payload ([`decode_pull`]) carries the values of `H_t` only:
//! ```text
//! u8  0x4D ('M')   u8 version 1   u8 half (0, 1; 2 = all)   u8 layout (0 dense, 1 sparse)
//! u64 step
//! u32 m            coordinates of the half
//! dense:  m × f32 (the half's values in ascending index order)
//! sparse: ⌈m/8⌉ bitmap bytes (bit i ⇔ the i-th value of the half is non-zero, i.e. has
//!         non-zero bits), then one f32 per set bit
//! ```
//! The smaller layout is chosen: sparse when `8⌈m/8⌉ + 32·nnz < 32·m`. With `λ = 0` the
//! half is as sparse as the pushes; with `λ > 0` it fills up and the dense half is sent —
//! still half the bytes of a dense pull.
//!
//! # Files
//! [`MipdConfig`] and the shard helper [`layers_in`] live here; the code-book fit in
//! `codebook.rs`, the worker encoder and its wire body in `worker.rs`, the server state,
//! smoothing, halves and pull payload in `server.rs`. Everything is re-exported here.
//!
//! [`Compressor`]: crate::Compressor

mod codebook;
mod server;
mod sharded;
mod worker;

pub use crate::sharded::layers_in;
pub use codebook::{code_width, fit_codebook, quantization_mse, MAX_LEVELS};
pub use server::{
    decode_pull, Halves, MipdServer, MipdServerConfig, MipdServerError, MipdServerState, PullInfo,
};
pub use sharded::{MipdShardServer, MipdShardWorker, MIPD_REDUCTION};
pub use worker::{decode_layer, keep_count, significance, LayerStats, Mipd, Significance};

use serde::{Deserialize, Serialize};

use crate::compressor::{Compressor, MethodId};
use crate::error::ConfigError;
use crate::memory::MemoryConfig;
use crate::registry::{Method, RunUse};
use server::default_lambda;

/// Configuration of the MIPD worker side ([`Mipd`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MipdConfig {
    /// Significance score. Default `taylor`.
    #[serde(default)]
    pub significance: Significance,
    /// Target share of a layer's significance mass the kept entries must hold, in (0, 1].
    /// Default 0.5.
    #[serde(default = "default_mass")]
    pub mass: f64,
    /// ρ_min: the least fraction of each layer kept, in (0, 1]. Default 0.001.
    #[serde(default = "default_min_ratio")]
    pub min_ratio: f64,
    /// ρ_max: the largest fraction of each layer kept, in [ρ_min, 1]. Default 0.05.
    #[serde(default = "default_max_ratio")]
    pub max_ratio: f64,
    /// Code bits `b`: at most `2^b` code-book levels per layer, 1..=16. Default 4.
    #[serde(default = "default_bits")]
    pub bits: u32,
    /// Lloyd-Max iterations per code-book fit, 0..=1000 (0: the initial grids). Default 10.
    #[serde(default = "default_lloyd_iters")]
    pub lloyd_iters: u32,
    /// Server side (parameter-server mode): smoothing factor λ of [`MipdServerConfig`].
    /// Default 0.5.
    #[serde(default = "default_lambda")]
    pub lambda: f64,
    /// Server side (parameter-server mode): the alternating-half rule. Default `blocked`.
    #[serde(default)]
    pub halves: Halves,
}

fn default_mass() -> f64 {
    0.5
}
fn default_min_ratio() -> f64 {
    0.001
}
fn default_max_ratio() -> f64 {
    0.05
}
fn default_bits() -> u32 {
    4
}
fn default_lloyd_iters() -> u32 {
    10
}

impl Default for MipdConfig {
    fn default() -> Self {
        MipdConfig {
            significance: Significance::default(),
            mass: default_mass(),
            min_ratio: default_min_ratio(),
            max_ratio: default_max_ratio(),
            bits: default_bits(),
            lloyd_iters: default_lloyd_iters(),
            lambda: default_lambda(),
            halves: Halves::default(),
        }
    }
}

fn check_unit(field: &'static str, v: f64) -> Result<(), ConfigError> {
    if !(v > 0.0 && v <= 1.0) {
        return Err(ConfigError::new(
            field,
            format!("must be in (0, 1], got {v}"),
        ));
    }
    Ok(())
}

impl Method for MipdConfig {
    const NAME: &'static str = "mipd";
    const ABOUT: &'static str = "MIPD: per-layer adaptive significance sparsification + Lloyd-Max code-book (PS: smoothing, halves)";
    const ID: MethodId = MethodId(15);

    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        self.server().validate()?;
        Ok(Box::new(self.init()?))
    }

    fn sharded(&self) -> Option<&dyn crate::sharded::ShardedMethod> {
        Some(self)
    }

    /// On the parameter server the worker's error feedback is MIPD's residual only.
    fn check(&self, run: &RunUse<'_>) -> Result<(), ConfigError> {
        if run.parameter_server
            && !matches!(
                run.memory,
                MemoryConfig::None | MemoryConfig::Residual { .. }
            )
        {
            return Err(ConfigError::new(
                "memory",
                "MIPD on the parameter server supports error_feedback = true (its residual) only",
            ));
        }
        Ok(())
    }
}

impl MipdConfig {
    /// The servers' configuration (λ and the half rule) carried by this method config.
    pub fn server(&self) -> MipdServerConfig {
        MipdServerConfig {
            lambda: self.lambda,
            halves: self.halves,
        }
    }

    /// Checks the parameters and builds the worker-side encoder.
    pub fn init(&self) -> Result<Mipd, ConfigError> {
        check_unit("mass", self.mass)?;
        check_unit("min_ratio", self.min_ratio)?;
        check_unit("max_ratio", self.max_ratio)?;
        if self.max_ratio < self.min_ratio {
            return Err(ConfigError::new(
                "max_ratio",
                format!(
                    "must be at least min_ratio ({}), got {}",
                    self.min_ratio, self.max_ratio
                ),
            ));
        }
        if !(1..=16).contains(&self.bits) {
            return Err(ConfigError::new(
                "bits",
                format!("must be in 1..=16, got {}", self.bits),
            ));
        }
        if self.lloyd_iters > 1000 {
            return Err(ConfigError::new(
                "lloyd_iters",
                format!("must be at most 1000, got {}", self.lloyd_iters),
            ));
        }
        Ok(Mipd::new(self.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::{decompress, decompress_add};
    use crate::error::CompressError;
    use crate::rng::Rng;
    use crate::wire::Reader;
    use proptest::prelude::{any, prop_assert, prop_assert_eq, proptest, ProptestConfig};

    /// Standard normal by Box–Muller.
    fn gauss(rng: &mut Rng) -> f32 {
        let u = rng.next_f64().max(1e-300);
        let v = rng.next_f64();
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }

    /// Laplace(0, 1) by inversion.
    fn laplace(rng: &mut Rng) -> f32 {
        let u = rng.next_f64() - 0.5;
        (-(u.signum()) * (1.0 - 2.0 * u.abs()).max(1e-300).ln()) as f32
    }

    /// Student-t with 2 degrees of freedom (heavy tails, infinite variance).
    fn student2(rng: &mut Rng) -> f32 {
        let z = gauss(rng) as f64;
        let c: f64 = (0..2).map(|_| (gauss(rng) as f64).powi(2)).sum();
        (z / (c / 2.0).max(1e-12).sqrt()) as f32
    }

    /// `n` draws of distribution `dist` (0 normal, 1 Laplace, else Student-t 2) times `scale`,
    /// seeded: the test data of every file of the module.
    pub(super) fn sample(dist: usize, n: usize, scale: f32, seed: u64) -> Vec<f32> {
        let mut rng = Rng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                scale
                    * match dist {
                        0 => gauss(&mut rng),
                        1 => laplace(&mut rng),
                        _ => student2(&mut rng),
                    }
            })
            .collect()
    }

    #[test]
    fn bad_config_and_bad_input_are_errors() {
        let ok = MipdConfig::default();
        ok.init().unwrap();
        let bad = [
            MipdConfig {
                bits: 0,
                ..ok.clone()
            },
            MipdConfig {
                bits: 17,
                ..ok.clone()
            },
            MipdConfig {
                mass: 0.0,
                ..ok.clone()
            },
            MipdConfig {
                mass: 1.5,
                ..ok.clone()
            },
            MipdConfig {
                mass: f64::NAN,
                ..ok.clone()
            },
            MipdConfig {
                min_ratio: 0.0,
                ..ok.clone()
            },
            MipdConfig {
                min_ratio: f64::NAN,
                ..ok.clone()
            },
            MipdConfig {
                max_ratio: 1.01,
                ..ok.clone()
            },
            MipdConfig {
                max_ratio: f64::NAN,
                ..ok.clone()
            },
            MipdConfig {
                min_ratio: 0.5,
                max_ratio: 0.1,
                ..ok.clone()
            },
            MipdConfig {
                lloyd_iters: 1001,
                ..ok.clone()
            },
        ];
        for b in bad {
            let e = b.init().unwrap_err();
            assert!(!e.reason.is_empty(), "{b:?}");
        }
        for lambda in [-0.1, 1.1, f64::NAN, f64::INFINITY] {
            let s = MipdServerConfig {
                lambda,
                ..MipdServerConfig::default()
            };
            assert_eq!(s.init(4, &[]).unwrap_err().field, "lambda");
        }
        assert!(MipdServerConfig::default().init(4, &[0..2, 3..4]).is_err());
        let cfg: MipdConfig = toml::from_str("significance = \"gradient\"\nbits = 8").unwrap();
        assert_eq!(
            (cfg.significance, cfg.bits, cfg.mass),
            (Significance::Gradient, 8, 0.5)
        );
        assert!(toml::from_str::<MipdConfig>("bitz = 3").is_err());
        let s: MipdServerConfig = toml::from_str("lambda = 0.9\nhalves = \"interleaved\"").unwrap();
        assert_eq!(s.halves, Halves::Interleaved);

        let mut c = ok.init().unwrap();
        let mut out = Vec::new();
        assert!(c.encode(&[1.0], &[1.0, 2.0], &[], &mut out).is_err());
        assert!(matches!(
            c.encode(&[1.0, f32::NAN], &[1.0, 2.0], &[], &mut out),
            Err(CompressError::NonFinite { index: 1, .. })
        ));
        assert!(c
            .encode(&[1.0, 1.0], &[f32::INFINITY, 2.0], &[], &mut out)
            .is_err());
        assert!(c
            .encode(
                &[1.0, 1.0],
                &[1.0, 2.0],
                std::slice::from_ref(&(0..1)),
                &mut out
            )
            .is_err());
        c.encode(&[], &[], &[], &mut out).unwrap();
        decompress(&c, &out, &mut []).unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

        #[test]
        fn decoders_survive_arbitrary_bytes(
            body in proptest::collection::vec(any::<u8>(), 0..400),
            n in 0usize..300,
            segs in 0u32..4,
        ) {
            let c = MipdConfig::default().init().unwrap();
            // Arbitrary bytes, and arbitrary bodies behind a valid header.
            let mut out = vec![0f32; n];
            let _ = decompress_add(&c, &body, &mut out);
            let mut framed = vec![
                crate::compressor::MAGIC,
                crate::compressor::VERSION,
                MipdConfig::ID.0,
                0,
            ];
            framed.extend_from_slice(&(n as u32).to_le_bytes());
            framed.extend_from_slice(&(if n == 0 { 0 } else { segs.clamp(1, n as u32) }).to_le_bytes());
            framed.extend_from_slice(&body);
            if decompress_add(&c, &framed, &mut out).is_ok() {
                prop_assert!(out.iter().all(|v| v.is_finite()));
            }
            let mut r = Reader::new(&body);
            let mut seen = Vec::new();
            if decode_layer(&mut r, n, |i, v| seen.push((i, v))).is_ok() {
                prop_assert!(seen.windows(2).all(|p| p[0].0 < p[1].0));
                prop_assert!(seen.iter().all(|&(i, v)| i < n && v.is_finite()));
            }
            // The server, and pulls.
            let mut server = MipdServerConfig::default().init(n, &[]).unwrap();
            let mut pull = Vec::new();
            if server.aggregate(0, &[&framed], &mut pull).is_err() {
                prop_assert_eq!(server.next_step(), 0);
            }
            for halves in [Halves::Off, Halves::Blocked, Halves::Interleaved] {
                let _ = decode_pull(halves, &[], &body, &mut out);
            }
        }
    }
}
