//! Command-line specs of the form `name:key=value,key=value`, shared by
//! `dtrain bench compress --methods` and `dtrain bench models --models`: the parameters
//! become TOML lines that the item's own serde table then reads (and validates).
//! Commas inside brackets or quotes belong to the value (`hidden=[2048,1024]`).

/// Splits `name:params` at the first `:` (no `:`: no parameters).
pub(crate) fn split(spec: &str) -> (&str, &str) {
    match spec.split_once(':') {
        Some((n, p)) => (n.trim(), p),
        None => (spec.trim(), ""),
    }
}

/// Splits `s` at each `sep` that is outside brackets and double quotes, so that an array or a
/// quoted string is one value: `a,b=[1,2],c="x,y"` → `a`, `b=[1,2]`, `c="x,y"`.
pub fn split_top_level(s: &str, sep: char) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut quoted, mut start) = (0usize, false, 0);
    for (i, c) in s.char_indices() {
        match c {
            '"' => quoted = !quoted,
            '[' if !quoted => depth += 1,
            ']' if !quoted => depth = depth.saturating_sub(1),
            c if c == sep && !quoted && depth == 0 => {
                parts.push(&s[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

/// `key=value,key=value` as TOML lines. Bare words become strings; numbers, booleans, quoted
/// strings and arrays pass through. `spec` names the whole item in errors.
pub(crate) fn params_toml(spec: &str, params: &str) -> Result<String, String> {
    let mut doc = String::new();
    for kv in split_top_level(params, ',')
        .into_iter()
        .filter(|s| !s.trim().is_empty())
    {
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

    #[test]
    fn commas_inside_arrays_and_quotes_stay_with_their_value() {
        assert_eq!(
            split_top_level("a,b=[1,[2,3]],c=\"x,y\",", ','),
            vec!["a", "b=[1,[2,3]]", "c=\"x,y\"", ""]
        );
        assert_eq!(split_top_level("", ','), vec![""]);
        let doc = params_toml("mlp", "image_size=32,hidden=[2048, 1024]").unwrap();
        assert_eq!(doc, "image_size = 32\nhidden = [2048, 1024]\n");
    }
}
