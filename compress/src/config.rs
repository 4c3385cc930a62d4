//! The registry: one serde enum naming every method, tagged by `kind`.
//!
//! A TOML `[compress]` table such as
//! ```toml
//! kind = "topk"
//! ratio = 0.001
//! ```
//! deserialises into [`CompressorConfig::TopK`]; [`CompressorConfig::build`] makes the
//! compressor. Unknown fields are rejected.

use serde::{Deserialize, Serialize};

use crate::adaptive::AdaptiveThresholdConfig;
use crate::compressor::Compressor;
use crate::dgc::DgcConfig;
use crate::dropping::GradientDroppingConfig;
use crate::error::ConfigError;
use crate::fft::FftConfig;
use crate::fp16::Fp16Config;
use crate::memory::MemoryConfig;
use crate::none::NoneConfig;
use crate::randomk::RandomKConfig;
use crate::rangefloat::RangeFloatConfig;
use crate::scalecom::ScaleComConfig;
use crate::threshold::ThresholdConfig;
use crate::topk::TopKConfig;

use crate::onebit::OneBitConfig;
use crate::qsgd::QsgdConfig;
use crate::terngrad::TernGradConfig;

/// Every compression method, by name. Each variant holds that method's own config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", deny_unknown_fields)]
pub enum CompressorConfig {
    /// Uncompressed fp32.
    #[serde(rename = "none")]
    None(NoneConfig),
    /// IEEE half precision.
    #[serde(rename = "fp16")]
    Fp16(Fp16Config),
    /// Exact Top-k.
    #[serde(rename = "topk")]
    TopK(TopKConfig),
    /// Seeded Random-k.
    #[serde(rename = "randomk")]
    RandomK(RandomKConfig),
    /// QSGD stochastic multi-level quantization.
    #[serde(rename = "qsgd")]
    Qsgd(QsgdConfig),
    /// TernGrad stochastic ternarization.
    #[serde(rename = "terngrad")]
    TernGrad(TernGradConfig),
    /// 1-bit quantization with per-column means (use with error feedback).
    #[serde(rename = "onebit")]
    OneBit(OneBitConfig),
    /// Strom's fixed threshold ±τ.
    #[serde(rename = "threshold")]
    Threshold(ThresholdConfig),
    /// Dryden's adaptive threshold (keep 1 in π per sign, reconstruct the means).
    #[serde(rename = "adaptive-threshold")]
    AdaptiveThreshold(AdaptiveThresholdConfig),
    /// Aji & Heafield's gradient dropping (drop the fraction R of smallest magnitudes).
    #[serde(rename = "gradient-dropping")]
    GradientDropping(GradientDroppingConfig),
    /// Deep Gradient Compression: sampled-threshold top-k with warm-up (pair with the
    /// `dgc-momentum` memory, its default).
    #[serde(rename = "dgc")]
    Dgc(DgcConfig),
    /// ScaleCom cyclic local top-k: a shared, leader-chosen index set (summable).
    #[serde(rename = "scalecom")]
    ScaleCom(ScaleComConfig),
    /// Range-based float quantizer (dense).
    #[serde(rename = "range-float")]
    RangeFloat(RangeFloatConfig),
    /// FFT-domain sparsification with range-float quantization.
    #[serde(rename = "fft")]
    Fft(FftConfig),
    /// MIPD: layer-wise significance sparsification with per-layer Lloyd-Max code-books;
    /// with `[cluster] mode = "ps"` the servers smooth dropped coordinates and update
    /// alternating halves (ALGORITHMS.md §14).
    #[serde(rename = "mipd")]
    Mipd(crate::mipd::MipdConfig),
    /// Lossless column-sparse encoding of 2-D gradients (meProp's `dW`), dense otherwise.
    #[serde(rename = "columns")]
    Columns(crate::columns::ColumnsConfig),
}

/// One registry entry: the `kind` name, a one-line description, and its default config.
pub struct MethodInfo {
    /// The `kind` string used in configs and on the command line.
    pub name: &'static str,
    /// One line for `dtrain list`.
    pub about: &'static str,
    /// The method's config with every parameter at its default.
    pub default: fn() -> CompressorConfig,
}

/// The static list of methods (what `dtrain list compressors` prints).
pub const METHODS: &[MethodInfo] = &[
    MethodInfo {
        name: "none",
        about: "uncompressed fp32 (32 bits/element)",
        default: || CompressorConfig::None(NoneConfig::default()),
    },
    MethodInfo {
        name: "fp16",
        about: "IEEE half precision (16 bits/element)",
        default: || CompressorConfig::Fp16(Fp16Config::default()),
    },
    MethodInfo {
        name: "topk",
        about: "exact Top-k sparsification, index list or bitmap (ratio = density)",
        default: || CompressorConfig::TopK(TopKConfig::default()),
    },
    MethodInfo {
        name: "randomk",
        about: "seeded unbiased Random-k; indices regenerated from the seed, not sent",
        default: || CompressorConfig::RandomK(RandomKConfig::default()),
    },
    MethodInfo {
        name: "qsgd",
        about: "QSGD unbiased stochastic quantization, s levels per bucket norm (fixed or Elias)",
        default: || CompressorConfig::Qsgd(QsgdConfig::default()),
    },
    MethodInfo {
        name: "terngrad",
        about: "TernGrad: per-layer scaler, clip to ±cσ, stochastic {-1,0,1} (2 bits/element)",
        default: || CompressorConfig::TernGrad(TernGradConfig::default()),
    },
    MethodInfo {
        name: "onebit",
        about: "1-bit SGD: sign bit + per-column means (1 + 64/c bits/element), error feedback",
        default: || CompressorConfig::OneBit(OneBitConfig::default()),
    },
    MethodInfo {
        name: "threshold",
        about: "Strom's fixed threshold: send (index, sign) of |p| >= tau, reconstruct ±tau",
        default: || CompressorConfig::Threshold(ThresholdConfig::default()),
    },
    MethodInfo {
        name: "adaptive-threshold",
        about: "Dryden's adaptive threshold: top 1/proportion of each sign, sent as sign words, reconstructed as per-sign means",
        default: || CompressorConfig::AdaptiveThreshold(AdaptiveThresholdConfig::default()),
    },
    MethodInfo {
        name: "gradient-dropping",
        about: "Aji & Heafield gradient dropping: drop the drop_ratio smallest |p| (sampled or exact threshold, per tensor or global)",
        default: || CompressorConfig::GradientDropping(GradientDroppingConfig::default()),
    },
    MethodInfo {
        name: "dgc",
        about: "DGC: sampled-threshold top-k, momentum-corrected memory, warm-up schedule",
        default: || CompressorConfig::Dgc(DgcConfig::default()),
    },
    MethodInfo {
        name: "scalecom",
        about: "ScaleCom cyclic local top-k: leader-chosen shared indices, all-reduce summable",
        default: || CompressorConfig::ScaleCom(ScaleComConfig::default()),
    },
    MethodInfo {
        name: "range-float",
        about: "range-based float: 1+e+q-bit codes under one per-tensor Emax (default 8 bits)",
        default: || CompressorConfig::RangeFloat(RangeFloatConfig::default()),
    },
    MethodInfo {
        name: "fft",
        about: "FFT sparsification: keep the (1-theta) highest-energy rfft bins, RF-quantized",
        default: || CompressorConfig::Fft(FftConfig::default()),
    },
    MethodInfo {
        name: "mipd",
        about: "MIPD: per-layer adaptive significance sparsification + Lloyd-Max code-book (PS: smoothing, halves)",
        default: || CompressorConfig::Mipd(crate::mipd::MipdConfig::default()),
    },
    MethodInfo {
        name: "columns",
        about: "lossless column-sparse encoding of 2-D gradients (meProp's dW: k columns + in×k values)",
        default: || CompressorConfig::Columns(crate::columns::ColumnsConfig::default()),
    },
];

impl CompressorConfig {
    /// The config of method `name` with default parameters.
    pub fn default_for(name: &str) -> Option<Self> {
        METHODS
            .iter()
            .find(|m| m.name == name)
            .map(|m| (m.default)())
    }

    /// The method's `kind` name.
    pub fn name(&self) -> &'static str {
        match self {
            CompressorConfig::None(_) => "none",
            CompressorConfig::Fp16(_) => "fp16",
            CompressorConfig::TopK(_) => "topk",
            CompressorConfig::RandomK(_) => "randomk",
            CompressorConfig::Qsgd(_) => "qsgd",
            CompressorConfig::TernGrad(_) => "terngrad",
            CompressorConfig::OneBit(_) => "onebit",
            CompressorConfig::Threshold(_) => "threshold",
            CompressorConfig::AdaptiveThreshold(_) => "adaptive-threshold",
            CompressorConfig::GradientDropping(_) => "gradient-dropping",
            CompressorConfig::Dgc(_) => "dgc",
            CompressorConfig::ScaleCom(_) => "scalecom",
            CompressorConfig::RangeFloat(_) => "range-float",
            CompressorConfig::Fft(_) => "fft",
            CompressorConfig::Mipd(_) => "mipd",
            CompressorConfig::Columns(_) => "columns",
        }
    }

    /// Builds the compressor, validating the parameters.
    pub fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Ok(match self {
            CompressorConfig::None(c) => Box::new(c.init()),
            CompressorConfig::Fp16(c) => Box::new(c.init()),
            CompressorConfig::TopK(c) => Box::new(c.init()?),
            CompressorConfig::RandomK(c) => Box::new(c.init()?),
            CompressorConfig::Qsgd(c) => Box::new(c.init()?),
            CompressorConfig::TernGrad(c) => Box::new(c.init()?),
            CompressorConfig::OneBit(c) => Box::new(c.init()?),
            CompressorConfig::Threshold(c) => Box::new(c.init()?),
            CompressorConfig::AdaptiveThreshold(c) => Box::new(c.init()?),
            CompressorConfig::GradientDropping(c) => Box::new(c.init()?),
            CompressorConfig::Dgc(c) => Box::new(c.init()?),
            CompressorConfig::ScaleCom(c) => Box::new(c.init()?),
            CompressorConfig::RangeFloat(c) => Box::new(c.init()?),
            CompressorConfig::Fft(c) => Box::new(c.init()?),
            CompressorConfig::Mipd(c) => {
                c.server().validate()?;
                Box::new(c.init()?)
            }
            CompressorConfig::Columns(c) => Box::new(c.init()),
        })
    }

    /// The error-feedback memory this method should use unless the user says otherwise:
    /// residual for biased methods, none for unbiased and near-lossless ones.
    pub fn default_memory(&self) -> MemoryConfig {
        match self {
            CompressorConfig::None(_)
            | CompressorConfig::Fp16(_)
            | CompressorConfig::RandomK(_) => MemoryConfig::None,
            CompressorConfig::TopK(_) => MemoryConfig::RESIDUAL,
            CompressorConfig::Qsgd(_) => MemoryConfig::None,
            CompressorConfig::TernGrad(_) => MemoryConfig::None,
            CompressorConfig::OneBit(_) => MemoryConfig::RESIDUAL,
            CompressorConfig::Threshold(_) => MemoryConfig::RESIDUAL,
            CompressorConfig::AdaptiveThreshold(_) => MemoryConfig::RESIDUAL,
            CompressorConfig::GradientDropping(_) => MemoryConfig::RESIDUAL,
            CompressorConfig::Dgc(_) => MemoryConfig::DgcMomentum {
                momentum: 0.9,
                nesterov: false,
                masking: true,
                clip: crate::dgc::Clip::None,
            },
            CompressorConfig::ScaleCom(_) => MemoryConfig::LowPass { beta: 1.0 },
            // Round-to-nearest is biased (and zeroes values below the window): residual;
            // stochastic rounding is unbiased inside the window: none.
            CompressorConfig::RangeFloat(c) => match c.rounding {
                crate::rangefloat::Rounding::Nearest => MemoryConfig::RESIDUAL,
                crate::rangefloat::Rounding::Stochastic => MemoryConfig::None,
            },
            // The paper relies on a diminishing θ rather than EF (ALGORITHMS.md §1.2).
            CompressorConfig::Fft(_) => MemoryConfig::None,
            // The template compensates on the server (smoothing); worker EF is opt-in.
            CompressorConfig::Mipd(_) => MemoryConfig::None,
            // Lossless.
            CompressorConfig::Columns(_) => MemoryConfig::None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_registered_method_builds_and_round_trips_through_toml() {
        for m in METHODS {
            let cfg = (m.default)();
            assert_eq!(cfg.name(), m.name);
            let c = cfg.build().unwrap_or_else(|e| panic!("{}: {e}", m.name));
            let _ = c.aggregation();
            let text = toml::to_string(&cfg).unwrap();
            let back: CompressorConfig = toml::from_str(&text).unwrap();
            assert_eq!(back, cfg, "{}", m.name);
            let minimal: CompressorConfig =
                toml::from_str(&format!("kind = \"{}\"", m.name)).unwrap();
            assert_eq!(minimal, cfg, "defaults of {}", m.name);
        }
    }

    #[test]
    fn unknown_fields_and_kinds_are_rejected() {
        let e = toml::from_str::<CompressorConfig>("kind = \"topk\"\nratoi = 0.1").unwrap_err();
        assert!(e.to_string().contains("ratoi"), "{e}");
        assert!(toml::from_str::<CompressorConfig>("kind = \"nope\"").is_err());
        let bad: CompressorConfig = toml::from_str("kind = \"topk\"\nratio = 1.5").unwrap();
        let err = bad.build().err().unwrap();
        assert_eq!(err.field, "ratio");
    }
}
