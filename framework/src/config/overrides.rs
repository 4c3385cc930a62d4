//! `--set key=value` overrides on the TOML tree, and turning serde's messages into
//! errors that name the field.

use super::ConfigError;

/// Turns a `train.x must …` message into a [`ConfigError`] on field `train.x`.
pub(super) fn split_field(file: &str, msg: &str) -> ConfigError {
    let (field, rest) = match msg.split_once(' ') {
        Some((f, r)) if f.contains('.') => (f.trim_end_matches(':').to_string(), r.to_string()),
        _ => ("train".to_string(), msg.to_string()),
    };
    ConfigError {
        file: file.to_string(),
        field,
        message: rest,
    }
}

pub(super) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Picks the section a serde message is about (`unknown field `x`` inside `[train]` …).
pub(super) fn guess_field(msg: &str) -> String {
    // "... in `cluster.workers`" names the key exactly.
    if let Some(i) = msg.rfind(" in `") {
        let rest = &msg[i + 5..];
        if let Some(end) = rest.find('`') {
            let key = &rest[..end];
            if let Some(f) = msg.find("unknown field `") {
                let name = &msg[f + 15..];
                if let Some(e) = name.find('`') {
                    return format!("{key}.{}", &name[..e]);
                }
            }
            return key.to_string();
        }
    }
    // toml messages read "... in `train` ..." or carry the key in backticks.
    for sec in [
        "model",
        "data",
        "train",
        "cluster",
        "network",
        "compress",
        "sync",
        "checkpoint",
        "failure",
        "output",
    ] {
        if msg.contains(&format!("`{sec}`")) || msg.contains(&format!("{sec}.")) {
            return sec.to_string();
        }
    }
    if let Some(start) = msg.find('`') {
        if let Some(len) = msg[start + 1..].find('`') {
            return msg[start + 1..start + 1 + len].to_string();
        }
    }
    "-".to_string()
}

/// Applies `a.b.c=value` to the TOML tree (creating tables on the way).
pub fn apply_override(tree: &mut toml::Table, spec: &str) -> Result<(), String> {
    let (key, value) = spec
        .split_once('=')
        .ok_or_else(|| format!("--set {spec:?}: expected key=value"))?;
    let key = key.trim();
    let value = value.trim();
    let parsed: toml::Value = match format!("v = {value}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").unwrap_or(toml::Value::String(value.into())),
        Err(_) => toml::Value::String(value.to_string()),
    };
    set_path(tree, key, parsed).map_err(|m| format!("--set {spec:?}: {m}"))
}

/// Replaces the value at the dotted path `key` (creating tables on the way).
pub(super) fn set_path(
    tree: &mut toml::Table,
    key: &str,
    value: toml::Value,
) -> Result<(), String> {
    if key.is_empty() || key.split('.').any(|p| p.is_empty()) {
        return Err(format!("bad key {key:?}"));
    }
    let parts: Vec<&str> = key.split('.').collect();
    let mut cur = tree;
    for p in &parts[..parts.len() - 1] {
        let entry = cur
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry
            .as_table_mut()
            .ok_or_else(|| format!("`{p}` is not a table"))?;
    }
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}
