//! `[model]`: a registry model ([`ModelSpec`]) and the weights it may start from.

use std::ops::{Deref, DerefMut};
use std::path::PathBuf;

use dtrain_models::ModelSpec;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `[model]`: the registry's keys (`kind`, `variant`, the family's options; unknown keys
/// are refused by the family's spec) plus `init_from`. Dereferences to the [`ModelSpec`].
///
/// ```toml
/// [model]
/// kind = "lenet"
/// init_from = "lenet.safetensors"   # optional: PyTorch-named weights (`dtrain export`)
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSection {
    /// The model.
    pub spec: ModelSpec,
    /// A safetensors file with PyTorch's names for this architecture (what `dtrain export`
    /// writes; see `models/README.md`) whose values replace the seeded initial weights on
    /// every rank, BatchNorm statistics included. Every tensor must match by name, shape
    /// and dtype (checked by `dtrain check` / `dtrain run` before any worker starts).
    /// Relative paths are relative to the working directory; every worker reads the file, so
    /// on several nodes each needs it at that path.
    pub init_from: Option<PathBuf>,
}

impl From<ModelSpec> for ModelSection {
    fn from(spec: ModelSpec) -> Self {
        ModelSection {
            spec,
            init_from: None,
        }
    }
}

impl Deref for ModelSection {
    type Target = ModelSpec;
    fn deref(&self) -> &ModelSpec {
        &self.spec
    }
}

impl DerefMut for ModelSection {
    fn deref_mut(&mut self) -> &mut ModelSpec {
        &mut self.spec
    }
}

impl Serialize for ModelSection {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let mut table = match toml::Value::try_from(&self.spec).map_err(S::Error::custom)? {
            toml::Value::Table(t) => t,
            other => return other.serialize(s),
        };
        if let Some(p) = &self.init_from {
            table.insert(
                "init_from".into(),
                toml::Value::String(p.to_string_lossy().into_owned()),
            );
        }
        table.serialize(s)
    }
}

impl<'de> Deserialize<'de> for ModelSection {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut table = toml::Table::deserialize(d)?;
        let init_from = match table.remove("init_from") {
            None => None,
            Some(toml::Value::String(p)) if !p.is_empty() => Some(PathBuf::from(p)),
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "init_from must be a file name (a non-empty string), got {other}"
                )))
            }
        };
        let spec = ModelSpec::deserialize(toml::Value::Table(table)).map_err(D::Error::custom)?;
        Ok(ModelSection { spec, init_from })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_from_is_taken_out_before_the_family_reads_its_keys() {
        let m: ModelSection =
            toml::from_str("kind = \"lenet\"\ninit_from = \"w.safetensors\"\n").unwrap();
        assert_eq!(m.init_from, Some(PathBuf::from("w.safetensors")));
        assert_eq!(m.kind(), "lenet");
        let back: ModelSection = toml::from_str(&toml::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
        let json: ModelSection = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(json, m);
        // The family still refuses unknown keys; a bad init_from is refused.
        assert!(toml::from_str::<ModelSection>("kind = \"lenet\"\ninit_frm = \"w\"\n").is_err());
        assert!(toml::from_str::<ModelSection>("kind = \"lenet\"\ninit_from = 3\n").is_err());
        let plain: ModelSection = toml::from_str("kind = \"mlp\"\n").unwrap();
        assert_eq!(plain.init_from, None);
    }
}
