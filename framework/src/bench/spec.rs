//! Command-line specs of the form `name:key=value,key=value`, shared by
//! `dtrain bench compress --methods` and `dtrain bench models --models`: the parameters
//! become TOML lines that the item's own serde table then reads (and validates).

/// Splits `name:params` at the first `:` (no `:`: no parameters).
pub(crate) fn split(spec: &str) -> (&str, &str) {
    match spec.split_once(':') {
        Some((n, p)) => (n.trim(), p),
        None => (spec.trim(), ""),
    }
}

/// `key=value,key=value` as TOML lines. Bare words become strings; numbers, booleans, quoted
/// strings and arrays pass through. `spec` names the whole item in errors.
pub(crate) fn params_toml(spec: &str, params: &str) -> Result<String, String> {
    let mut doc = String::new();
    for kv in params.split(',').filter(|s| !s.trim().is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("{spec}: parameter {kv:?} is not key=value"))?;
        let v = v.trim();
        let is_literal = v.parse::<f64>().is_ok()
            || v == "true"
            || v == "false"
            || v.starts_with('"')
            || v.starts_with('[');
        if is_literal {
            doc.push_str(&format!("{} = {}\n", k.trim(), v));
        } else {
            doc.push_str(&format!("{} = {:?}\n", k.trim(), v));
        }
    }
    Ok(doc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_pass_through_and_bare_words_are_quoted() {
        assert_eq!(split("topk"), ("topk", ""));
        assert_eq!(split(" qsgd :levels=7"), ("qsgd", "levels=7"));
        let doc = params_toml("x", "a=1,b").unwrap_err();
        assert!(doc.contains("is not key=value"), "{doc}");
        let doc = params_toml("x", "a=1.5, b=true,c=word,d=\"q\"").unwrap();
        assert_eq!(doc, "a = 1.5\nb = true\nc = \"word\"\nd = \"q\"\n");
    }
}
