//! What an exchanger carries across steps, for checkpoints, and its exact serde.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::bucket::Bucket;
use super::{ExchangeError, Exchanger, GatherCollective, Route};

/// Shape of one bucket, as recorded in an [`ExchangerState`] (a state only fits the plan
/// it was taken under).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketShape {
    /// Bucket id.
    pub id: u64,
    /// Whether the bucket is compressed.
    pub compressed: bool,
    /// Indices of its parameters in the model's listing.
    pub params: Vec<usize>,
    /// Its segment (parameter) lengths.
    pub segments: Vec<usize>,
}

impl BucketShape {
    fn of(b: &Bucket) -> Self {
        BucketShape {
            id: b.id,
            compressed: b.compressed,
            params: b.params.clone(),
            segments: b.segments.iter().map(|s| s.len()).collect(),
        }
    }
}

/// Everything an [`Exchanger`] carries from one step to the next, for checkpoints: a run
/// stopped after step `k` and resumed from this state (with the same configuration and
/// seed) continues bit for bit.
///
/// What is **not** in here because it is a pure function of (configuration, step, rank,
/// bucket): RNG streams ([`Rng::for_step`](dtrain_compress::Rng::for_step)), θ schedules (FFT), DGC's warm-up density,
/// random-k's index streams, ScaleCom's leader and index sets (chosen afresh each step),
/// TernGrad's / QSGD's / the threshold methods' per-call scratch. What is: every
/// error-feedback memory (residual, DGC momentum + velocity, ScaleCom low-pass), every
/// compressor's [`Compressor::export_state`](dtrain_compress::Compressor::export_state) (FFT: base θ and recover scale), and the
/// exchanger's θ scale.
///
/// Floating-point fields are serialized as their IEEE-754 bit patterns (`u32` / `u64`), so
/// any serde format (JSON included) round-trips them exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExchangerState {
    /// Format version, [`ExchangerState::VERSION`].
    pub version: u32,
    /// The compression method's `kind` ([`CompressorConfig::name`](dtrain_compress::CompressorConfig::name)).
    pub method: String,
    /// The error-feedback memory's `kind` (`none`, `residual`, `dgc-momentum`, `low-pass`).
    pub memory_kind: String,
    /// The bucket plan the state was taken under.
    pub plan: Vec<BucketShape>,
    /// [`Exchanger::theta_scale`].
    #[serde(with = "bits::f64_bits")]
    pub theta_scale: f64,
    /// Error-feedback memory per compressed bucket, keyed by bucket id.
    #[serde(with = "bits::memory_bits")]
    pub memory: BTreeMap<u64, Vec<f32>>,
    /// [`Compressor::export_state`](dtrain_compress::Compressor::export_state) per compressed bucket, for buckets whose compressor
    /// carries any.
    #[serde(with = "bits::state_bits")]
    pub compressors: BTreeMap<u64, BTreeMap<String, f64>>,
    /// DLCP error feedback per dense bucket (values the last round completed without),
    /// keyed by bucket id; empty without DLCP.
    #[serde(default, with = "bits::memory_bits")]
    pub lossy_residual: BTreeMap<u64, Vec<f32>>,
    /// The compressed all-reduce's server residual per compressed bucket (this rank's range
    /// of it), keyed by bucket id; empty without that collective or without error feedback.
    #[serde(default, with = "bits::memory_bits")]
    pub server_memory: BTreeMap<u64, Vec<f32>>,
    /// The route of every bucket, in bucket order ([`Route::name`]), as the automatic
    /// choice ([`GatherCollective::Auto`](super::GatherCollective::Auto)) made it: a run
    /// resumed from this state takes the same routes instead of measuring again, so it
    /// continues bit for bit. Empty with a fixed collective, or before the choice.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<String>,
}

impl ExchangerState {
    /// The format version this build writes. It reads this one and version 1, written
    /// before `compress.collective = "auto"` existed (and became the default): a run
    /// resumed from such a state keeps the all-gather it was started with.
    pub const VERSION: u32 = 2;
}

/// Exact serde for floats: IEEE bit patterns.
pub(crate) mod bits {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub mod f64_bits {
        use super::*;
        pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_u64(v.to_bits())
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
            u64::deserialize(d).map(f64::from_bits)
        }
    }

    pub mod memory_bits {
        use super::*;
        pub fn serialize<S: Serializer>(
            v: &BTreeMap<u64, Vec<f32>>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            let b: BTreeMap<u64, Vec<u32>> = v
                .iter()
                .map(|(&k, x)| (k, x.iter().map(|f| f.to_bits()).collect()))
                .collect();
            b.serialize(s)
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<BTreeMap<u64, Vec<f32>>, D::Error> {
            let b = BTreeMap::<u64, Vec<u32>>::deserialize(d)?;
            Ok(b.into_iter()
                .map(|(k, x)| (k, x.into_iter().map(f32::from_bits).collect()))
                .collect())
        }
    }

    pub mod state_bits {
        use super::*;
        type State = BTreeMap<u64, BTreeMap<String, f64>>;
        pub fn serialize<S: Serializer>(v: &State, s: S) -> Result<S::Ok, S::Error> {
            let b: BTreeMap<u64, BTreeMap<&str, u64>> = v
                .iter()
                .map(|(&k, m)| {
                    (
                        k,
                        m.iter().map(|(n, f)| (n.as_str(), f.to_bits())).collect(),
                    )
                })
                .collect();
            b.serialize(s)
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<State, D::Error> {
            let b = BTreeMap::<u64, BTreeMap<String, u64>>::deserialize(d)?;
            Ok(b.into_iter()
                .map(|(k, m)| {
                    (
                        k,
                        m.into_iter().map(|(n, f)| (n, f64::from_bits(f))).collect(),
                    )
                })
                .collect())
        }
    }
}

impl Exchanger {
    /// The memory kind a checkpoint records: the configured memory's, or
    /// `residual/<domain>` where the method keeps the residual itself in a domain of its own
    /// ([`Pipeline::adopted_feedback`](dtrain_compress::Pipeline::adopted_feedback)), so that
    /// a residual of the other domain is refused rather than misread.
    fn memory_kind(&self) -> String {
        match self.pipes().find_map(|p| p.adopted_feedback()) {
            Some(domain) => format!("{}/{domain}", self.memory.kind()),
            None => self.memory.kind().to_string(),
        }
    }

    /// Error-feedback state of every compressed bucket (part of [`Exchanger::export_state`]).
    fn export_memory(&self) -> Result<BTreeMap<u64, Vec<f32>>, String> {
        let mut all = BTreeMap::new();
        for s in &self.slots {
            match (&s.device, &s.pipe) {
                (Some(d), _) => {
                    all.extend(d.export_memory().map_err(|e| {
                        format!("bucket {}'s memory on the device: {e}", s.bucket.id)
                    })?)
                }
                (None, Some(p)) => all.extend(p.export_memory()),
                (None, None) => {}
            }
        }
        Ok(all)
    }

    /// Restores state written by `export_memory`, without the plan checks of
    /// [`Exchanger::import_state`] (which calls it after checking).
    fn import_memory(&mut self, mut state: BTreeMap<u64, Vec<f32>>) {
        for s in &mut self.slots {
            if let Some(p) = &mut s.pipe {
                let mine: BTreeMap<u64, Vec<f32>> = state
                    .remove(&s.bucket.id)
                    .map(|v| BTreeMap::from([(s.bucket.id, v)]))
                    .unwrap_or_default();
                // Both: a bucket moved back to the host by its restored route
                // (`settle_devices`) carries on from the host's copy.
                if let Some(d) = &mut s.device {
                    d.import_memory(&mine);
                }
                p.import_memory(mine);
            }
        }
    }

    /// Empties every error-feedback memory: the workers', the compressed all-reduce's
    /// server residuals and DLCP's. What they held was owed to a kind of buffer the caller
    /// no longer exchanges (post-local SGD's switch from gradients to parameter changes).
    pub fn clear_memories(&mut self) {
        self.import_memory(BTreeMap::new());
        self.lossy_residual.import(BTreeMap::new());
        self.server_state.clear();
        for s in &mut self.slots {
            if let Some(owner) = &mut s.server {
                owner.pipe.import_memory(BTreeMap::new());
            }
        }
    }

    /// Everything this exchanger carries across steps (see [`ExchangerState`]); an error
    /// where a memory held on a device cannot be read back.
    pub fn export_state(&self) -> Result<ExchangerState, ExchangeError> {
        let mut compressors = BTreeMap::new();
        for s in &self.slots {
            if let Some(p) = &s.pipe {
                // A device codec that keeps its own state (PowerSGD's Q) holds the newest.
                let c = s
                    .device
                    .as_ref()
                    .and_then(|d| d.export_state())
                    .unwrap_or_else(|| p.compressor().export_state());
                if !c.is_empty() {
                    compressors.insert(s.bucket.id, c);
                }
            }
        }
        Ok(ExchangerState {
            version: ExchangerState::VERSION,
            method: self.method.to_string(),
            memory_kind: self.memory_kind(),
            plan: self
                .slots
                .iter()
                .map(|s| BucketShape::of(&s.bucket))
                .collect(),
            theta_scale: self.theta_scale,
            memory: self.export_memory().map_err(ExchangeError::State)?,
            compressors,
            lossy_residual: self.lossy_residual.export(),
            server_memory: self.export_server_memory(),
            routes: if self.gather == GatherCollective::Auto && !self.auto_pending {
                self.slots
                    .iter()
                    .map(|s| s.route.name().to_string())
                    .collect()
            } else {
                Vec::new()
            },
        })
    }

    /// The owners' server residuals: those of the built owner pipelines, or, before the
    /// first exchange after a restore, the restored ones still waiting to be installed.
    fn export_server_memory(&self) -> BTreeMap<u64, Vec<f32>> {
        let mut all = self.server_state.clone();
        for s in &self.slots {
            if let Some(owner) = &s.server {
                all.extend(owner.pipe.export_memory());
            }
        }
        all
    }

    /// Restores [`Exchanger::export_state`]. Refuses, with a message saying what differs and
    /// changing nothing, a state of another version, method, memory kind or bucket plan, or
    /// one whose buffers do not fit the buckets.
    pub fn import_state(&mut self, state: ExchangerState) -> Result<(), String> {
        if !(1..=ExchangerState::VERSION).contains(&state.version) {
            return Err(format!(
                "exchanger state version {} is not supported (this build reads 1 to {})",
                state.version,
                ExchangerState::VERSION
            ));
        }
        if state.method != self.method {
            return Err(format!(
                "exchanger state is for method {:?}, this run compresses with {:?}",
                state.method, self.method
            ));
        }
        let kind = self.memory_kind();
        if state.memory_kind != kind {
            return Err(format!(
                "exchanger state holds {:?} memory, this run uses {kind:?}",
                state.memory_kind
            ));
        }
        let plan: Vec<BucketShape> = self
            .slots
            .iter()
            .map(|s| BucketShape::of(&s.bucket))
            .collect();
        if state.plan != plan {
            let what = if state.plan.len() != plan.len() {
                format!("{} buckets, this run has {}", state.plan.len(), plan.len())
            } else {
                let (a, b) = state
                    .plan
                    .iter()
                    .zip(&plan)
                    .find(|(a, b)| a != b)
                    .expect("plans differ");
                format!("bucket {} was {a:?}, here it is {b:?}", a.id)
            };
            return Err(format!(
                "exchanger state was taken under another bucket plan ({what}); resume with \
                 the same model and bucket policy"
            ));
        }
        let routes = if state.version == 1 && self.gather == GatherCollective::Auto {
            // Written when the all-gather was the default: the run keeps it.
            Some(
                self.slots
                    .iter()
                    .map(|s| match s.pipe {
                        Some(_) => Route::Compressed(GatherCollective::AllGather),
                        None => Route::Dense,
                    })
                    .collect(),
            )
        } else {
            self.restored_routes(&state.routes)?
        };
        let words = self.memory.words_per_element();
        let len_of = |id: u64| -> Option<usize> {
            self.slots
                .iter()
                .find(|s| s.bucket.id == id && s.pipe.is_some())
                .map(|s| s.bucket.len())
        };
        for (&id, m) in &state.memory {
            match len_of(id) {
                Some(n) if m.len() == words * n => {}
                Some(n) => {
                    return Err(format!(
                        "memory of bucket {id} has {} values, {kind} memory of a {n}-element \
                         bucket has {}",
                        m.len(),
                        words * n
                    ))
                }
                None => return Err(format!("memory for bucket {id}, which is not compressed")),
            }
        }
        for (&id, r) in &state.lossy_residual {
            match self
                .slots
                .iter()
                .find(|s| s.bucket.id == id && s.pipe.is_none())
            {
                Some(s) if s.bucket.len() == r.len() => {}
                Some(s) => {
                    return Err(format!(
                        "DLCP residual of bucket {id} has {} values, the bucket {}",
                        r.len(),
                        s.bucket.len()
                    ))
                }
                None => {
                    return Err(format!(
                        "DLCP residual for bucket {id}, which is compressed"
                    ))
                }
            }
        }
        // A server residual's length depends on the world size, which this exchanger
        // learns at its first exchange: checked there (`ensure_servers`).
        if let Some(id) = state.server_memory.keys().find(|&&id| len_of(id).is_none()) {
            return Err(format!(
                "server residual for bucket {id}, which is not compressed"
            ));
        }
        if let Some(id) = state.compressors.keys().find(|&&id| len_of(id).is_none()) {
            return Err(format!(
                "compressor state for bucket {id}, which is not compressed"
            ));
        }
        // Compressor imports can fail (each leaves its compressor unchanged): undo the ones
        // done so far, so a refused state changes nothing.
        let mut done: Vec<(usize, BTreeMap<String, f64>)> = Vec::new();
        let empty = BTreeMap::new();
        for i in 0..self.slots.len() {
            let id = self.slots[i].bucket.id;
            let Some(p) = self.slots[i].pipe.as_mut() else {
                continue;
            };
            let old = p.compressor().export_state();
            let new = state.compressors.get(&id).unwrap_or(&empty);
            if let Err(e) = p.compressor_mut().import_state(new) {
                for (j, old) in done {
                    if let Some(p) = self.slots[j].pipe.as_mut() {
                        p.compressor_mut()
                            .import_state(&old)
                            .expect("a state just exported imports");
                    }
                }
                return Err(format!("compressor state of bucket {id}: {e}"));
            }
            done.push((i, old));
        }
        // The device codecs take the restored state too (PowerSGD's Q).
        for s in &mut self.slots {
            if let (Some(d), Some(p)) = (&mut s.device, &s.pipe) {
                d.import_state(p.compressor())
                    .map_err(|e| format!("compressor state of bucket {}: {e}", s.bucket.id))?;
            }
        }
        self.import_memory(state.memory);
        self.lossy_residual.import(state.lossy_residual);
        // The owners' pipelines are rebuilt at the next exchange, with these residuals.
        for s in &mut self.slots {
            s.server = None;
        }
        self.server_state = state.server_memory;
        self.theta_scale = state.theta_scale;
        if let Some(routes) = routes {
            for (s, r) in self.slots.iter_mut().zip(routes) {
                s.route = r;
            }
            self.auto_pending = false;
            self.auto_report = None;
        }
        Ok(())
    }

    /// The routes a state recorded, checked against this exchanger (`None` when it
    /// recorded none).
    fn restored_routes(&self, names: &[String]) -> Result<Option<Vec<Route>>, String> {
        if names.is_empty() {
            return Ok(None);
        }
        if self.gather != GatherCollective::Auto {
            return Err(format!(
                "exchanger state holds the routes of compress.collective = \"auto\", this run \
                 asks for {:?}",
                self.gather.name()
            ));
        }
        if names.len() != self.slots.len() {
            return Err(format!(
                "exchanger state holds {} routes for {} buckets",
                names.len(),
                self.slots.len()
            ));
        }
        let mut routes = Vec::with_capacity(names.len());
        for (s, name) in self.slots.iter().zip(names) {
            let r =
                Route::parse(name).map_err(|e| format!("route of bucket {}: {e}", s.bucket.id))?;
            if s.pipe.is_none() && r != Route::Dense {
                return Err(format!(
                    "route {name:?} for bucket {}, which is not compressed",
                    s.bucket.id
                ));
            }
            routes.push(r);
        }
        Ok(Some(routes))
    }
}
