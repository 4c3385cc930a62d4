//! The `[compress]` section: the method's table, the trainer's keys beside it, and how the
//! method resolves against the run.

use dtrain_compress::{Collective, CompressorConfig, MemoryConfig, RunFacts, RunUse};
use serde::Deserialize;

use super::overrides::one_line;
use super::validate::error;
use super::{ClusterMode, ConfigError, DlcpSettings, RunConfig};
use crate::device::CodecDevice;
use crate::exchange::bucket::BucketPolicy;
use crate::exchange::GatherCollective;
use crate::optim::{OptimizerConfig, OptimizerKind};

/// `[compress]` split into its parts ([`RunConfig::validate`]'s input).
struct CompressSection {
    method: CompressorConfig,
    /// An explicit memory, if any.
    memory: Option<MemoryConfig>,
    policy: BucketPolicy,
    /// `collective`, when given.
    collective: Option<GatherCollective>,
    dlcp: Option<DlcpSettings>,
    server_error_feedback: Option<bool>,
    /// `device`: where the compressed buckets are encoded.
    device: CodecDevice,
}

/// The trainer's keys inside `[compress]`.
const TRAINER_KEYS: [&str; 9] = [
    "error_feedback",
    "memory",
    "bucket_mb",
    "dense_below",
    "dense_1d",
    "collective",
    "dlcp",
    "server_error_feedback",
    "device",
];

/// The compression part of a [`Plan`](super::Plan).
pub(super) struct Compression {
    /// The method, with its derived values resolved.
    pub(super) method: CompressorConfig,
    /// Its error-feedback memory.
    pub(super) memory: MemoryConfig,
    /// Bucketing.
    pub(super) buckets: BucketPolicy,
    /// The collective of gathered payloads.
    pub(super) collective: GatherCollective,
    /// DLCP of the dense gradient, if chosen.
    pub(super) dlcp: Option<DlcpSettings>,
    /// The compressed all-reduce's server residual, if set explicitly.
    pub(super) server_error_feedback: Option<bool>,
    /// Where the compressed buckets are encoded.
    pub(super) codec_device: CodecDevice,
}

impl RunConfig {
    /// `[compress]`: the method resolved against the run, its memory (DGC's momentum
    /// moved there from `opt`, and `train.clip_norm` into DGC's local clipping), and the
    /// combinations the method and the collectives allow.
    pub(super) fn compression(
        &self,
        file: &str,
        steps_per_epoch: u64,
        opt: &mut OptimizerConfig,
    ) -> Result<Compression, ConfigError> {
        let err = |field: &str, message: String| error(file, field, message);
        let (c, t) = (&self.cluster, &self.train);
        let CompressSection {
            mut method,
            memory,
            policy: buckets,
            collective,
            dlcp,
            server_error_feedback,
            device: codec_device,
        } = self.compress_section(file)?;
        if codec_device != CodecDevice::Host && c.mode == ClusterMode::Ps {
            return Err(err(
                "compress.device",
                "encodes the collectives' buckets on a device; mode = \"ps\" pushes through \
                 its servers' codecs (use device = \"host\")"
                    .into(),
            ));
        }
        // The compressed optimizers exchange their momentum compressed: with [compress] left
        // at the uncompressed default, by DeepSpeed's 1-bit scaled sign, through the
        // compressed all-reduce (worker and server residuals, as DeepSpeed's backend).
        let compressed_opt = t.optimizer.is_compressed();
        if compressed_opt && method.passthrough() {
            method = dtrain_compress::one_bit_momentum();
        }
        let collective = collective.unwrap_or(if compressed_opt {
            GatherCollective::CompressedAllReduce
        } else {
            GatherCollective::default()
        });
        let memory = match memory {
            Some(m) => m,
            None => method.default_memory(),
        };
        let mut memory = memory;
        method.resolve(&RunFacts {
            workers: c.workers,
            steps_per_epoch,
        });
        if compressed_opt {
            self.check_compressed_optimizer(file, &method, dlcp.is_some())?;
        }
        if memory.owns_momentum() {
            if t.optimizer != OptimizerKind::Sgd {
                return Err(err(
                    "train.optimizer",
                    "the dgc-momentum memory applies the momentum itself and needs \
                     optimizer = \"sgd\" (ALGORITHMS.md §10)"
                        .into(),
                ));
            }
            if t.dampening != 0.0 {
                return Err(err(
                    "train.dampening",
                    "is not supported with the dgc-momentum memory".into(),
                ));
            }
            // The momentum moves into the memory; the optimizer steps plain SGD.
            if let MemoryConfig::DgcMomentum {
                momentum, nesterov, ..
            } = &mut memory
            {
                if t.momentum > 0.0 {
                    *momentum = t.momentum;
                    *nesterov = t.nesterov;
                }
            }
            // The weight-decay term is the same on every worker and is not sent: it keeps
            // its momentum in the optimizer (as in the DGC authors' optimizer), so that the
            // decay is as strong as in the momentum-SGD baseline. Without decay the
            // optimizer is plain SGD.
            if opt.weight_decay > 0.0 {
                opt.decay_momentum_only = true;
            } else {
                opt.momentum = 0.0;
                opt.nesterov = false;
            }
            // Clipping moves too: DGC clips each worker's gradient before accumulation.
            if let (Some(max_norm), MemoryConfig::DgcMomentum { clip, .. }) =
                (t.clip_norm, &mut memory)
            {
                if *clip != dtrain_compress::dgc::Clip::None {
                    return Err(err(
                        "train.clip_norm",
                        "with the dgc-momentum memory clipping is DGC's local clipping; \
                         set either train.clip_norm or compress.memory.clip, not both"
                            .into(),
                    ));
                }
                *clip = dtrain_compress::dgc::Clip::Norm {
                    max_norm,
                    workers: c.workers as u32,
                };
            }
        }
        memory
            .build()
            .map_err(|e| err(&format!("compress.memory.{}", e.field), e.reason.clone()))?;
        // `auto` takes only the collectives the method accepts: checked as the method's own.
        method
            .check(&RunUse {
                collective: match &dlcp {
                    Some(_) => Collective::Dlcp,
                    None => collective.fixed().unwrap_or(Collective::AllGather),
                },
                parameter_server: c.mode == ClusterMode::Ps,
                memory: &memory,
            })
            .map_err(|e| err(&format!("compress.{}", e.field), e.reason.clone()))?;
        // 1-bit Adam's aggregating side keeps its own residual (DeepSpeed's server error).
        let server_error_feedback = server_error_feedback.or((compressed_opt
            && collective == GatherCollective::CompressedAllReduce
            && memory != MemoryConfig::None)
            .then_some(true));
        if let Some(on) = server_error_feedback {
            if !matches!(
                collective,
                GatherCollective::CompressedAllReduce | GatherCollective::Auto
            ) || dlcp.is_some()
            {
                return Err(err(
                    "compress.server_error_feedback",
                    "applies to collective = \"compressed-allreduce\" (or \"auto\", where a \
                     bucket may take it) only"
                        .into(),
                ));
            }
            let combine = method
                .combine()
                .map_err(|e| err(&format!("compress.{}", e.field), e.reason.clone()))?;
            if on && combine != dtrain_compress::Combine::Mean {
                return Err(err(
                    "compress.server_error_feedback",
                    format!(
                        "{:?} combines payloads by a vote: its owners re-encode the plain sum \
                         (which is the vote), so there is no server residual to keep",
                        method.name()
                    ),
                ));
            }
        }
        if collective == GatherCollective::CompressedAllReduce && c.mode == ClusterMode::Ps {
            return Err(err(
                "compress.collective",
                "\"compressed-allreduce\" is a collective; mode = \"ps\" pushes to servers, \
                 which decode and average there"
                    .into(),
            ));
        }
        if let Some(d) = &dlcp {
            if c.mode == ClusterMode::Ps {
                return Err(err(
                    "compress.collective",
                    "\"dlcp\" is a collective; mode = \"ps\" pushes to servers".into(),
                ));
            }
            d.to_config(1, self.seed)
                .map_err(|(field, m)| err(&field, m))?;
        }
        Ok(Compression {
            method,
            memory,
            buckets,
            collective,
            dlcp,
            server_error_feedback,
            codec_device,
        })
    }

    /// Splits `[compress]` into the method, an explicit memory (if any) and the bucket
    /// policy.
    fn compress_section(&self, file: &str) -> Result<CompressSection, ConfigError> {
        let err = |field: &str, message: String| error(file, field, message);
        let mut table = self.compress.clone();
        let mut extract = |k: &str| table.remove(k);
        let ef = extract("error_feedback");
        let mem = extract("memory");
        let bucket_mb = extract("bucket_mb");
        let dense_below = extract("dense_below");
        let dense_1d = extract("dense_1d");
        let collective = extract("collective");
        let dlcp = extract("dlcp");
        let server_ef = extract("server_error_feedback");
        let device = extract("device");
        if !table.contains_key("kind") {
            return Err(err(
                "compress.kind",
                "is required (see `dtrain list` for the methods)".into(),
            ));
        }
        let method = CompressorConfig::deserialize(toml::Value::Table(table)).map_err(|e| {
            let m = one_line(&e.to_string());
            let hint = if m.contains("unknown field") {
                format!(
                    " (besides the method's own keys, [compress] takes the trainer keys {})",
                    TRAINER_KEYS.join(", ")
                )
            } else {
                String::new()
            };
            err("compress", format!("{m}{hint}"))
        })?;
        let memory = match (ef, mem) {
            (Some(_), Some(_)) => {
                return Err(err(
                    "compress.error_feedback",
                    "give either error_feedback or memory, not both".into(),
                ))
            }
            (Some(toml::Value::Boolean(true)), None) => Some(match method.default_memory() {
                MemoryConfig::None => MemoryConfig::RESIDUAL,
                m => m,
            }),
            (Some(toml::Value::Boolean(false)), None) => Some(MemoryConfig::None),
            (Some(v), None) => {
                return Err(err(
                    "compress.error_feedback",
                    format!("must be true or false, got {v}"),
                ))
            }
            (None, Some(v)) => Some(
                MemoryConfig::deserialize(v)
                    .map_err(|e| err("compress.memory", one_line(&e.to_string())))?,
            ),
            (None, None) => None,
        };
        let mut policy = BucketPolicy::default();
        if let Some(v) = bucket_mb {
            let mb = v
                .as_float()
                .or_else(|| v.as_integer().map(|i| i as f64))
                .filter(|m| m.is_finite() && *m > 0.0 && *m <= 4096.0)
                .ok_or_else(|| {
                    err(
                        "compress.bucket_mb",
                        format!("must be in (0, 4096], got {v}"),
                    )
                })?;
            policy.bucket_bytes = ((mb * (1u64 << 20) as f64) as usize).max(4);
        }
        if let Some(v) = dense_below {
            policy.dense_below = v.as_integer().filter(|&i| i >= 0).ok_or_else(|| {
                err(
                    "compress.dense_below",
                    format!("must be an integer >= 0, got {v}"),
                )
            })? as usize;
        }
        if let Some(v) = dense_1d {
            policy.dense_1d = v.as_bool().ok_or_else(|| {
                err(
                    "compress.dense_1d",
                    format!("must be true or false, got {v}"),
                )
            })?;
        }
        let is_dlcp = collective.as_ref().and_then(|v| v.as_str()) == Some("dlcp");
        let collective = match collective {
            None => None,
            Some(_) if is_dlcp => Some(GatherCollective::default()),
            Some(v) => Some(GatherCollective::deserialize(v).map_err(|e| {
                err(
                    "compress.collective",
                    format!("{} (or \"dlcp\")", one_line(&e.to_string())),
                )
            })?),
        };
        let dlcp = match (is_dlcp, dlcp) {
            (false, None) => None,
            (false, Some(_)) => {
                return Err(err(
                    "compress.dlcp",
                    "applies to collective = \"dlcp\" only".into(),
                ))
            }
            (true, None) => Some(DlcpSettings::default()),
            (true, Some(v)) => Some(
                DlcpSettings::deserialize(v)
                    .map_err(|e| err("compress.dlcp", one_line(&e.to_string())))?,
            ),
        };
        let server_error_feedback = match server_ef {
            None => None,
            Some(toml::Value::Boolean(b)) => Some(b),
            Some(v) => {
                return Err(err(
                    "compress.server_error_feedback",
                    format!("must be true or false, got {v}"),
                ))
            }
        };
        let device = match device {
            None => CodecDevice::Host,
            Some(toml::Value::String(s)) => s.parse().map_err(|m| err("compress.device", m))?,
            Some(v) => {
                return Err(err(
                    "compress.device",
                    format!("must be a string (\"host\", \"auto\", \"wgpu\", …), got {v}"),
                ))
            }
        };
        Ok(CompressSection {
            method,
            memory,
            policy,
            collective,
            dlcp,
            server_error_feedback,
            device,
        })
    }

    /// What a compressed optimizer (`train.optimizer = "onebit-adam"` / `"zeroone-adam"`)
    /// does not combine with: the parameter server (its servers apply gradients, not a
    /// momentum), DLCP (a dense, lossy collective), a method that votes (the momentum needs
    /// the workers' average), and a periodic `[sync]` (0/1 Adam has its own local steps).
    fn check_compressed_optimizer(
        &self,
        file: &str,
        method: &CompressorConfig,
        dlcp: bool,
    ) -> Result<(), ConfigError> {
        let err = |field: &str, message: String| error(file, field, message);
        let opt = self.train.optimizer.name();
        if self.cluster.mode == ClusterMode::Ps {
            return Err(err(
                "train.optimizer",
                format!(
                    "{opt:?} exchanges its momentum through collectives; cluster.mode = \"ps\" \
                     pushes gradients to servers (use mode = \"allreduce\")"
                ),
            ));
        }
        if dlcp {
            return Err(err(
                "compress.collective",
                format!(
                    "\"dlcp\" carries dense gradients; train.optimizer = {opt:?} exchanges its \
                     momentum compressed"
                ),
            ));
        }
        let combine = method
            .combine()
            .map_err(|e| err(&format!("compress.{}", e.field), e.reason.clone()))?;
        if combine != dtrain_compress::Combine::Mean {
            return Err(err(
                "compress.kind",
                format!(
                    "{:?} combines the workers' payloads by a vote; train.optimizer = {opt:?} \
                     needs the average of their momenta (leave [compress] out for the 1-bit \
                     scaled sign, or choose a method that averages)",
                    method.name()
                ),
            ));
        }
        if let Some(h) = self.sync.period() {
            return Err(err(
                "sync.kind",
                format!(
                    "{:?} (every {h} steps) cannot wrap train.optimizer = {opt:?}, which \
                     decides itself when the workers synchronise",
                    self.sync.name()
                ),
            ));
        }
        Ok(())
    }
}
