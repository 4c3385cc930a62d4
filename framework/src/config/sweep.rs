//! Sweep files: a base configuration plus `[[sweep]]` variants.

use std::path::Path;

use super::overrides::one_line;
use super::{read_config, ConfigError};

/// One `[[sweep]]` entry of a configuration file: a labelled set of replacements.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepEntry {
    /// The variant's label (`label = "..."`): letters, digits, `-`, `_`, `.`; unique.
    pub label: String,
    /// `(dotted key, value)` pairs, applied in key order; each replaces the whole value at
    /// its path (`compress = { kind = "none" }` replaces the `[compress]` table).
    pub sets: Vec<(String, toml::Value)>,
}

/// The `[[sweep]]` entries of a configuration file (empty when it is not a sweep).
///
/// A sweep file is a base configuration plus entries such as
///
/// ```toml
/// [[sweep]]
/// label = "none"
/// compress = { kind = "none" }
///
/// [[sweep]]
/// label = "fft-100mbit"
/// "network.bandwidth" = "100Mbit"
/// ```
///
/// `dtrain run` runs every variant (or those named with `--variant`) one after the other,
/// each as its own run `<name>-<label>`, and reports them together.
pub fn sweep_entries(path: &Path) -> Result<Vec<SweepEntry>, ConfigError> {
    let (file, text) = read_config(path)?;
    let mut tree: toml::Table = text.parse().map_err(|e: toml::de::Error| ConfigError {
        file: file.clone(),
        field: "-".into(),
        message: one_line(&e.to_string()),
    })?;
    split_sweep(&mut tree, &file)
}

/// Removes `sweep` from `tree` and checks its entries.
pub(super) fn split_sweep(
    tree: &mut toml::Table,
    file: &str,
) -> Result<Vec<SweepEntry>, ConfigError> {
    let err = |field: String, message: String| ConfigError {
        file: file.to_string(),
        field,
        message,
    };
    let Some(v) = tree.remove("sweep") else {
        return Ok(Vec::new());
    };
    let toml::Value::Array(items) = v else {
        return Err(err(
            "sweep".into(),
            "must be an array of tables ([[sweep]])".into(),
        ));
    };
    let mut out: Vec<SweepEntry> = Vec::new();
    for (i, item) in items.into_iter().enumerate() {
        let toml::Value::Table(mut t) = item else {
            return Err(err(format!("sweep[{i}]"), "must be a table".into()));
        };
        let label = match t.remove("label") {
            Some(toml::Value::String(l))
                if !l.is_empty()
                    && !l.starts_with('.')
                    && l.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) =>
            {
                l
            }
            Some(other) => {
                return Err(err(
                    format!("sweep[{i}].label"),
                    format!("{other} must be a non-empty string of letters, digits, '-', '_', '.'"),
                ))
            }
            None => return Err(err(format!("sweep[{i}].label"), "is required".into())),
        };
        if out.iter().any(|e| e.label == label) {
            return Err(err(
                format!("sweep[{i}].label"),
                format!("{label:?} is used twice"),
            ));
        }
        if t.is_empty() {
            return Err(err(
                format!("sweep[{i}]"),
                format!("variant {label:?} changes nothing"),
            ));
        }
        // `compress = { kind = "none" }` is one replacement of the whole table; a quoted
        // dotted key (`"network.bandwidth" = "1Gbit"`) addresses a nested value.
        let sets = t.into_iter().collect();
        out.push(SweepEntry { label, sets });
    }
    Ok(out)
}
