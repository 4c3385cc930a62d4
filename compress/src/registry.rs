//! The method registry: every compression method is one file plus one line of the
//! `methods!` invocation in `lib.rs` (beside the file's `mod` line).
//!
//! A method's file defines its config type (serde, `deny_unknown_fields`, documented
//! defaults) and implements [`Method`] for it: the method's `kind` name, one-line
//! description, wire id, builder, default error-feedback memory, and how it resolves
//! against the run it is configured for (values derived from the run, and which ways of
//! moving its payloads it accepts). Everything the rest of the workspace needs to know of a
//! method comes from there; `framework` and `report` hold no per-method arms.
//!
//! The registry line generates the variant of [`CompressorConfig`] (a TOML `[compress]`
//! table tagged by `kind`), its entry in [`METHODS`] (what `dtrain list`, `dtrain bench
//! compress`, the property suite and the wire fuzz test iterate over), and the dispatch of
//! every [`CompressorConfig`] method. Unknown kinds and unknown fields are rejected.
//!
//! ```
//! use dtrain_compress::{CompressorConfig, Method, RunFacts};
//! use dtrain_compress::dgc::DgcConfig;
//! let mut cfg: CompressorConfig = toml::from_str("kind = \"dgc\"").unwrap();
//! assert_eq!(cfg.name(), DgcConfig::NAME);
//! cfg.resolve(&RunFacts { workers: 4, steps_per_epoch: 390 });
//! assert_eq!(cfg, CompressorConfig::from(DgcConfig { steps_per_epoch: 390, ..DgcConfig::default() }));
//! ```

use std::fmt::Debug;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::compressor::{Aggregation, Combine, Compressor, Ctx, MethodId};
use crate::error::ConfigError;
use crate::memory::MemoryConfig;
use crate::sharded::ShardedMethod;
use crate::{CompressorConfig, METHODS};

/// What a method learns of the run it is configured for, before it is built
/// ([`Method::resolve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RunFacts {
    /// Worker processes exchanging gradients.
    pub workers: usize,
    /// Optimizer steps per epoch (0 when unknown, e.g. in a benchmark).
    pub steps_per_epoch: u64,
}

/// How one exchange moves a bucket's gradient between the workers: what a run records per
/// bucket (`summary.json`) and what `dtrain report` / `dtrain simulate` model.
///
/// It follows from the method ([`Collective::of`]) and from what the run asked for
/// (`[compress] collective`, `[cluster] mode`); it is never guessed from a method's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Collective {
    /// Ring (or recursive-doubling) all-reduce of dense f32 values: uncompressed buckets and
    /// [`Aggregation::Dense`] methods (decoded before the sum).
    #[serde(rename = "allreduce")]
    AllReduce,
    /// All-reduce of the payloads' f32 value lanes ([`Aggregation::Summable`]).
    #[serde(rename = "lanes")]
    Lanes,
    /// A root's agreement message broadcast, then the all-reduce of the value lanes
    /// (two-phase summable methods: ScaleCom's leader-chosen index set).
    #[serde(rename = "broadcast-allreduce")]
    BroadcastAllReduce,
    /// All-gather(v) of every worker's payload; each receiver decodes and sums
    /// ([`Aggregation::Gather`]).
    #[serde(rename = "allgather")]
    AllGather,
    /// Sparse all-reduce of each worker's decoded non-zeros (`[compress] collective =
    /// "sparse-allreduce"`, gathered methods only).
    #[serde(rename = "sparse-allreduce")]
    SparseAllReduce,
    /// DLCP's bounded-loss all-reduce of dense f32 values (`[compress] collective =
    /// "dlcp"`, uncompressed buckets only).
    #[serde(rename = "dlcp")]
    Dlcp,
    /// The compressed all-reduce (`[compress] collective = "compressed-allreduce"`): each
    /// worker's payload of each owner's range goes to that owner, which decodes, sums and
    /// re-encodes it (with its own error-feedback residual when the run has error
    /// feedback), and the encoded sums go to every worker. Bytes per worker stay about
    /// twice one payload, whatever the worker count. For `Dense` and `Gather` methods
    /// whose payloads can be cut into ranges.
    #[serde(rename = "compressed-allreduce")]
    CompressedAllReduce,
    /// Push to parameter servers and pull the aggregate (`[cluster] mode = "ps"`).
    #[serde(rename = "ps")]
    ParameterServer,
    /// The hierarchical all-reduce of dense f32 values: each host's ranks reduce to its
    /// leader, the leaders all-reduce across hosts, each leader broadcasts on its host. What
    /// the dense all-reduce becomes when the ranks are on several hosts, some with several
    /// ranks (dtrain-comms' `algo::hierarchical`).
    #[serde(rename = "hierarchical-allreduce")]
    HierarchicalAllReduce,
}

impl Collective {
    /// The collective that carries the payloads of `compressor` when the run asked for
    /// `requested` (one of [`Collective::AllGather`] — the default —,
    /// [`Collective::SparseAllReduce`], [`Collective::Dlcp`] or
    /// [`Collective::ParameterServer`]): the method's [`Aggregation`] decides, a
    /// sparse all-reduce replaces the all-gather of a gathered method, and a parameter
    /// server replaces every collective. A summable method with a
    /// [`Compressor::broadcast_root`] is two-phase.
    pub fn of(compressor: &dyn Compressor, requested: Collective) -> Collective {
        if requested == Collective::ParameterServer {
            return Collective::ParameterServer;
        }
        if requested == Collective::CompressedAllReduce && Self::chunkable(compressor) {
            return Collective::CompressedAllReduce;
        }
        match compressor.aggregation() {
            Aggregation::Dense => Collective::AllReduce,
            Aggregation::Summable if compressor.broadcast_root(&Ctx::default()).is_some() => {
                Collective::BroadcastAllReduce
            }
            Aggregation::Summable => Collective::Lanes,
            Aggregation::Gather if requested == Collective::SparseAllReduce => {
                Collective::SparseAllReduce
            }
            Aggregation::Gather => Collective::AllGather,
        }
    }

    /// Whether `compressor`'s buckets can go through the compressed all-reduce: a one-phase
    /// method whose payloads are decoded to dense values and summed (`Dense`, `Gather`).
    /// Summable methods already all-reduce their value lanes, and two-phase methods agree
    /// on the whole buffer first.
    pub fn chunkable(compressor: &dyn Compressor) -> bool {
        compressor.aggregation() != Aggregation::Summable && !crate::two_phase(compressor)
    }

    /// Whether this collective moves the bucket as dense f32 values (no compression on the
    /// wire): the all-reduce, its hierarchical form, and DLCP.
    pub fn is_dense(self) -> bool {
        matches!(
            self,
            Collective::AllReduce | Collective::HierarchicalAllReduce | Collective::Dlcp
        )
    }

    /// The name written to `summary.json` (the serde name).
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::Lanes => "lanes",
            Collective::BroadcastAllReduce => "broadcast-allreduce",
            Collective::AllGather => "allgather",
            Collective::SparseAllReduce => "sparse-allreduce",
            Collective::Dlcp => "dlcp",
            Collective::CompressedAllReduce => "compressed-allreduce",
            Collective::ParameterServer => "ps",
            Collective::HierarchicalAllReduce => "hierarchical-allreduce",
        }
    }
}

impl std::fmt::Display for Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How a run uses a method: what [`Method::check`] is asked to accept.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunUse<'a> {
    /// The collective the run asked for (`[compress] collective`):
    /// [`Collective::AllGather`] (the default), [`Collective::SparseAllReduce`] or
    /// [`Collective::Dlcp`].
    pub collective: Collective,
    /// Whether the run pushes to parameter servers (`[cluster] mode = "ps"`) instead.
    pub parameter_server: bool,
    /// The error-feedback memory the run configured (explicit or the method's default).
    pub memory: &'a MemoryConfig,
}

impl RunUse<'_> {
    /// Refuses the compressed all-reduce, which cuts buckets into ranges, for a method whose
    /// codec needs each segment whole (`why`: what it does with a tensor, e.g. "columns
    /// encodes whole matrices"), naming the `collective` field.
    pub fn needs_whole_tensors(&self, why: &str) -> Result<(), ConfigError> {
        if self.collective == Collective::CompressedAllReduce {
            return Err(ConfigError::new(
                "collective",
                format!(
                    "\"compressed-allreduce\" cuts buckets into ranges, and {why}; use \
                     \"allgather\" or \"sparse-allreduce\""
                ),
            ));
        }
        Ok(())
    }

    /// Refuses the collectives that sum payloads on the way (the sparse and the compressed
    /// all-reduce), for a method whose decoder needs every worker's payload as it was sent
    /// (`why`: what it does with them, e.g. "mean = \"senders\" averages each coordinate
    /// over the workers that sent it"), naming the `collective` field.
    pub fn needs_every_payload(&self, why: &str) -> Result<(), ConfigError> {
        if matches!(
            self.collective,
            Collective::SparseAllReduce | Collective::CompressedAllReduce
        ) {
            return Err(ConfigError::new(
                "collective",
                format!(
                    "{:?} sums the payloads on the way, and {why}; use \"allgather\"",
                    self.collective.name()
                ),
            ));
        }
        Ok(())
    }
}

/// A registered compression method, implemented by its config type.
///
/// # Why a trait on the config
/// The config is what a user writes and what a run records; making it the one place that
/// knows the method's name, wire id, default memory and constraints means adding a method
/// edits no other file than its own (and one registry line). Constraints that hold for
/// every method of a kind ("a sparse all-reduce needs a gathered method") are checked once,
/// by [`CompressorConfig::check`], from the built compressor's [`Aggregation`]; only what
/// is particular to a method goes in its [`Method::check`].
pub trait Method:
    Serialize + DeserializeOwned + Default + Clone + PartialEq + Debug + Send + Sync + 'static
{
    /// The `kind` string of configs and of the command line (`dtrain list`).
    const NAME: &'static str;
    /// One line for `dtrain list`.
    const ABOUT: &'static str;
    /// The id byte written into every payload header; distinct per method (tested).
    const ID: MethodId;

    /// Builds the compressor, validating the parameters.
    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError>;

    /// The error-feedback memory the method uses unless the user says otherwise: residual
    /// for biased methods, none (the default) for unbiased and near-lossless ones.
    fn default_memory(&self) -> MemoryConfig {
        MemoryConfig::None
    }

    /// Fills values the method derives from the run (steps per epoch, worker count) where
    /// the user left them unset. Default: nothing.
    fn resolve(&mut self, _run: &RunFacts) {}

    /// Refuses a way of using the method that it cannot support, naming the `[compress]`
    /// field at fault (`collective`, `kind`, `memory`). Default: accepts everything.
    fn check(&self, _run: &RunUse<'_>) -> Result<(), ConfigError> {
        Ok(())
    }

    /// Whether the method leaves gradients as they are (dense f32): the trainer then skips
    /// compression altogether and may use dense-only collectives (DLCP). Default: false.
    fn passthrough(&self) -> bool {
        false
    }

    /// The method's own parameter-server protocol, when its servers do more than decode
    /// and average its payloads (MIPD's smoothing; see [`crate::sharded`]). Default: none
    /// (the servers decode the workers' payloads and return their mean).
    fn sharded(&self) -> Option<&dyn ShardedMethod> {
        None
    }
}

/// One registry entry, for listings and lookups by name.
#[derive(Clone, Copy)]
pub struct MethodInfo {
    /// The `kind` string used in configs and on the command line.
    pub name: &'static str,
    /// One line for `dtrain list`.
    pub about: &'static str,
    /// The wire id byte.
    pub id: MethodId,
    /// The method's config with every parameter at its default.
    pub default: fn() -> CompressorConfig,
    /// Deserializes the method's own keys (a `[compress]` table without `kind`).
    parse: fn(toml::Table) -> Result<CompressorConfig, toml::de::Error>,
}

impl Debug for MethodInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MethodInfo")
            .field("name", &self.name)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl MethodInfo {
    /// The entry of method type `M`.
    pub const fn of<M: Method + Into<CompressorConfig>>() -> MethodInfo {
        MethodInfo {
            name: M::NAME,
            about: M::ABOUT,
            id: M::ID,
            default: default_of::<M>,
            parse: parse_as::<M>,
        }
    }

    /// The registered method called `name`.
    pub fn find(name: &str) -> Option<&'static MethodInfo> {
        METHODS.iter().find(|m| m.name == name)
    }

    /// The registered method with wire id `id`.
    pub fn by_id(id: MethodId) -> Option<&'static MethodInfo> {
        METHODS.iter().find(|m| m.id == id)
    }
}

fn default_of<M: Method + Into<CompressorConfig>>() -> CompressorConfig {
    M::default().into()
}

fn parse_as<M: Method + Into<CompressorConfig>>(
    t: toml::Table,
) -> Result<CompressorConfig, toml::de::Error> {
    M::deserialize(toml::Value::Table(t)).map(Into::into)
}

/// The object-safe face of [`Method`] that [`CompressorConfig`] dispatches to.
pub(crate) trait DynMethod {
    fn name(&self) -> &'static str;
    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError>;
    fn default_memory(&self) -> MemoryConfig;
    fn resolve(&mut self, run: &RunFacts);
    fn check(&self, run: &RunUse<'_>) -> Result<(), ConfigError>;
    fn passthrough(&self) -> bool;
    fn sharded(&self) -> Option<&dyn ShardedMethod>;
    fn to_table(&self) -> Result<toml::Table, String>;
}

impl<M: Method> DynMethod for M {
    fn name(&self) -> &'static str {
        M::NAME
    }
    fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        Method::build(self)
    }
    fn default_memory(&self) -> MemoryConfig {
        Method::default_memory(self)
    }
    fn resolve(&mut self, run: &RunFacts) {
        Method::resolve(self, run)
    }
    fn check(&self, run: &RunUse<'_>) -> Result<(), ConfigError> {
        Method::check(self, run)
    }
    fn passthrough(&self) -> bool {
        Method::passthrough(self)
    }
    fn sharded(&self) -> Option<&dyn ShardedMethod> {
        Method::sharded(self)
    }
    fn to_table(&self) -> Result<toml::Table, String> {
        match toml::Value::try_from(self).map_err(|e| e.to_string())? {
            toml::Value::Table(t) => Ok(t),
            other => Err(format!(
                "a method config serialized to a {}",
                other.type_str()
            )),
        }
    }
}

/// Generates [`CompressorConfig`], its dispatch and [`METHODS`] from one line per method:
/// `Variant(module::MethodConfig),`. Invoked once, in `lib.rs`.
macro_rules! methods {
    ($($variant:ident($cfg:ty),)*) => {
        /// Every compression method's config, tagged by `kind` in TOML (see
        /// [`registry`](crate::registry)). Each variant holds that method's own config.
        #[derive(Debug, Clone, PartialEq)]
        pub enum CompressorConfig {
            $(
                #[doc = concat!("The method configured by [`", stringify!($cfg), "`].")]
                $variant($cfg),
            )*
        }

        $(
            impl From<$cfg> for CompressorConfig {
                fn from(c: $cfg) -> Self {
                    CompressorConfig::$variant(c)
                }
            }
        )*

        /// Every registered method, in registry order (what `dtrain list` prints).
        pub const METHODS: &[crate::registry::MethodInfo] = &[
            $(crate::registry::MethodInfo::of::<$cfg>(),)*
        ];

        /// The `kind` names of [`METHODS`], for error messages.
        const METHOD_NAMES: &[&str] = &[$(<$cfg as crate::registry::Method>::NAME,)*];

        impl CompressorConfig {
            pub(crate) fn method(&self) -> &dyn crate::registry::DynMethod {
                match self {
                    $(CompressorConfig::$variant(c) => c,)*
                }
            }

            pub(crate) fn method_mut(&mut self) -> &mut dyn crate::registry::DynMethod {
                match self {
                    $(CompressorConfig::$variant(c) => c,)*
                }
            }

            pub(crate) fn method_names() -> &'static [&'static str] {
                METHOD_NAMES
            }
        }
    };
}

impl CompressorConfig {
    /// The config of method `name` with default parameters.
    pub fn default_for(name: &str) -> Option<Self> {
        MethodInfo::find(name).map(|m| (m.default)())
    }

    /// The method's `kind` name.
    pub fn name(&self) -> &'static str {
        self.method().name()
    }

    /// Builds the compressor, validating the parameters.
    pub fn build(&self) -> Result<Box<dyn Compressor>, ConfigError> {
        self.method().build()
    }

    /// The error-feedback memory this method uses unless the user says otherwise
    /// ([`Method::default_memory`]).
    pub fn default_memory(&self) -> MemoryConfig {
        self.method().default_memory()
    }

    /// Fills the values the method derives from the run ([`Method::resolve`]).
    pub fn resolve(&mut self, run: &RunFacts) {
        self.method_mut().resolve(run)
    }

    /// How the method turns the mean of the decoded payloads into the update
    /// ([`Compressor::combine`]: the mean itself, or a majority vote); builds the
    /// compressor.
    pub fn combine(&self) -> Result<Combine, ConfigError> {
        Ok(self.build()?.combine())
    }

    /// Whether gradients pass through uncompressed ([`Method::passthrough`]).
    pub fn passthrough(&self) -> bool {
        self.method().passthrough()
    }

    /// The method's own parameter-server protocol, if it has one ([`Method::sharded`]).
    pub fn sharded(&self) -> Option<&dyn ShardedMethod> {
        self.method().sharded()
    }

    /// Checks that the run may use the method as `run` says: the rules every method obeys
    /// (a sparse all-reduce carries gathered payloads; DLCP carries uncompressed
    /// gradients), then the method's own [`Method::check`]. Builds the compressor to learn
    /// its aggregation, so a config that does not build is refused here too.
    pub fn check(&self, run: &RunUse<'_>) -> Result<(), ConfigError> {
        let built = self.build()?;
        self.method().check(run)?;
        match run.collective {
            Collective::SparseAllReduce if built.aggregation() != Aggregation::Gather => {
                Err(ConfigError::new(
                    "collective",
                    format!(
                        "\"sparse-allreduce\" carries gathered payloads ({}); {:?} payloads are \
                         {:?}-aggregated",
                        gathered_names().join(", "),
                        self.name(),
                        built.aggregation()
                    ),
                ))
            }
            Collective::CompressedAllReduce
                if !self.passthrough() && !Collective::chunkable(built.as_ref()) =>
            {
                Err(ConfigError::new(
                    "collective",
                    format!(
                        "\"compressed-allreduce\" re-encodes each owner's sum of decoded payloads; \
                         {:?} {}",
                        self.name(),
                        if built.aggregation() == Aggregation::Summable {
                            "payloads are summable lanes, whose all-reduce already sends the \
                             same bytes whatever the worker count"
                        } else {
                            "agrees on the whole buffer before compressing (two-phase)"
                        }
                    ),
                ))
            }
            Collective::Dlcp if !self.passthrough() => Err(ConfigError::new(
                "collective",
                format!(
                    "\"dlcp\" is the bounded-loss all-reduce of dense f32 gradients (kind = \
                     \"{}\"); {:?} payloads have their own collective",
                    passthrough_name(),
                    self.name()
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The collective that carries this method's compressed buckets when the run asked for
    /// `requested` ([`Collective::of`]); uncompressed methods use the dense all-reduce (or
    /// DLCP when asked for).
    pub fn collective(&self, requested: Collective) -> Result<Collective, ConfigError> {
        if self.passthrough() {
            return Ok(match requested {
                Collective::Dlcp | Collective::ParameterServer => requested,
                _ => Collective::AllReduce,
            });
        }
        Ok(Collective::of(self.build()?.as_ref(), requested))
    }
}

/// The names of the registered gathered methods, for messages.
fn gathered_names() -> Vec<&'static str> {
    METHODS
        .iter()
        .filter(|m| {
            (m.default)()
                .build()
                .is_ok_and(|c| c.aggregation() == Aggregation::Gather)
        })
        .map(|m| m.name)
        .collect()
}

/// The name of the (first) registered pass-through method, for messages.
fn passthrough_name() -> &'static str {
    METHODS
        .iter()
        .find(|m| (m.default)().passthrough())
        .map_or(crate::BASELINE, |m| m.name)
}

impl Serialize for CompressorConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{Error, SerializeMap};
        let table = self.method().to_table().map_err(S::Error::custom)?;
        let mut map = s.serialize_map(Some(table.len() + 1))?;
        map.serialize_entry("kind", self.name())?;
        for (k, v) in &table {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for CompressorConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{Error, Unexpected};
        let mut table = toml::Table::deserialize(d)?;
        let kind = match table.remove("kind") {
            Some(toml::Value::String(s)) => s,
            Some(other) => {
                return Err(D::Error::invalid_type(
                    Unexpected::Other(other.type_str()),
                    &"a method name (string)",
                ))
            }
            None => return Err(D::Error::missing_field("kind")),
        };
        let info = MethodInfo::find(&kind)
            .ok_or_else(|| D::Error::unknown_variant(&kind, CompressorConfig::method_names()))?;
        (info.parse)(table).map_err(|e| D::Error::custom(e.to_string().trim_end()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_registered_method_builds_and_round_trips_through_toml() {
        for m in METHODS {
            let cfg = (m.default)();
            assert_eq!(cfg.name(), m.name);
            let c = cfg.build().unwrap_or_else(|e| panic!("{}: {e}", m.name));
            assert_eq!(c.method(), m.id, "{}", m.name);
            let _ = c.aggregation();
            let text = toml::to_string(&cfg).unwrap();
            assert!(
                text.starts_with(&format!("kind = \"{}\"", m.name)),
                "{text}"
            );
            let back: CompressorConfig = toml::from_str(&text).unwrap();
            assert_eq!(back, cfg, "{}", m.name);
            let minimal: CompressorConfig =
                toml::from_str(&format!("kind = \"{}\"", m.name)).unwrap();
            assert_eq!(minimal, cfg, "defaults of {}", m.name);
            let json = serde_json::to_string(&cfg).unwrap();
            let back: CompressorConfig = serde_json::from_str(&json).unwrap();
            assert_eq!(back, cfg, "json of {}", m.name);
        }
    }

    #[test]
    fn names_and_wire_ids_are_distinct() {
        let names: HashSet<_> = METHODS.iter().map(|m| m.name).collect();
        assert_eq!(names.len(), METHODS.len());
        let ids: HashSet<_> = METHODS.iter().map(|m| m.id).collect();
        assert_eq!(ids.len(), METHODS.len());
        assert!(METHODS.iter().all(|m| m.id.0 != 0), "id 0 is reserved");
        for m in METHODS {
            assert_eq!(MethodInfo::by_id(m.id).unwrap().name, m.name);
            assert_eq!(MethodInfo::find(m.name).unwrap().id, m.id);
        }
    }

    #[test]
    fn unknown_fields_and_kinds_are_rejected() {
        let e = toml::from_str::<CompressorConfig>("kind = \"topk\"\nratoi = 0.1").unwrap_err();
        assert!(e.to_string().contains("ratoi"), "{e}");
        let e = toml::from_str::<CompressorConfig>("kind = \"nope\"").unwrap_err();
        assert!(e.to_string().contains("unknown variant `nope`"), "{e}");
        assert!(e.to_string().contains("`topk`"), "{e}");
        let e = toml::from_str::<CompressorConfig>("ratio = 0.1").unwrap_err();
        assert!(e.to_string().contains("missing field `kind`"), "{e}");
        let e = toml::from_str::<CompressorConfig>("kind = 3").unwrap_err();
        assert!(e.to_string().contains("method name"), "{e}");
        let bad: CompressorConfig = toml::from_str("kind = \"topk\"\nratio = 1.5").unwrap();
        let err = bad.build().err().unwrap();
        assert_eq!(err.field, "ratio");
    }

    #[test]
    fn generic_rules_follow_the_aggregation_not_the_name() {
        let none = MemoryConfig::None;
        let ask = |collective| RunUse {
            collective,
            parameter_server: false,
            memory: &none,
        };
        for m in METHODS {
            let cfg = (m.default)();
            let agg = cfg.build().unwrap().aggregation();
            let sparse = cfg.check(&ask(Collective::SparseAllReduce));
            if agg != Aggregation::Gather {
                assert_eq!(sparse.unwrap_err().field, "collective", "{}", m.name);
            }
            let dlcp = cfg.check(&ask(Collective::Dlcp));
            assert_eq!(dlcp.is_ok(), cfg.passthrough(), "{}", m.name);
            // The collective follows from the aggregation.
            let c = cfg.collective(Collective::AllGather).unwrap();
            let expected = match agg {
                _ if cfg.passthrough() => Collective::AllReduce,
                Aggregation::Dense => Collective::AllReduce,
                Aggregation::Summable => c, // lanes or broadcast: checked below
                Aggregation::Gather => Collective::AllGather,
            };
            assert_eq!(c, expected, "{}", m.name);
            assert_eq!(
                cfg.collective(Collective::ParameterServer).unwrap(),
                Collective::ParameterServer
            );
        }
        let scalecom = CompressorConfig::default_for("scalecom").unwrap();
        assert_eq!(
            scalecom.collective(Collective::AllGather).unwrap(),
            Collective::BroadcastAllReduce
        );
        let randomk = CompressorConfig::default_for("randomk").unwrap();
        assert_eq!(
            randomk.collective(Collective::AllGather).unwrap(),
            Collective::Lanes
        );
        let topk = CompressorConfig::default_for("topk").unwrap();
        assert_eq!(
            topk.collective(Collective::SparseAllReduce).unwrap(),
            Collective::SparseAllReduce
        );
        let none = CompressorConfig::default_for("none").unwrap();
        assert_eq!(none.collective(Collective::Dlcp).unwrap(), Collective::Dlcp);
    }

    #[test]
    fn collective_names_round_trip() {
        for c in [
            Collective::AllReduce,
            Collective::Lanes,
            Collective::BroadcastAllReduce,
            Collective::AllGather,
            Collective::SparseAllReduce,
            Collective::Dlcp,
            Collective::ParameterServer,
        ] {
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(json, format!("\"{}\"", c.name()));
            assert_eq!(serde_json::from_str::<Collective>(&json).unwrap(), c);
        }
    }
}
