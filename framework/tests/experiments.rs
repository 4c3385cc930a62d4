//! Every configuration under `experiments/` parses and validates, every variant of every
//! sweep included (without data: the data-dependent checks run in `dtrain check`).

use dtrain_framework::config::{sweep_entries, RunConfig};

#[test]
fn every_experiment_config_validates() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../experiments");
    let (mut files, mut variants) = (0, 0);
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            let file = p.display().to_string();
            let cfg = RunConfig::load(&p, &[]).unwrap_or_else(|e| panic!("{e}"));
            cfg.validate(&file, None).unwrap_or_else(|e| panic!("{e}"));
            // The fp32 baseline of every experiment is one override away.
            let none = RunConfig::load(&p, &["compress={ kind = \"none\" }".to_string()]).unwrap();
            none.validate("baseline", None).unwrap();
            for v in sweep_entries(&p).unwrap_or_else(|e| panic!("{e}")) {
                let cfg = RunConfig::load_variant(&p, Some(&v.label), &[])
                    .unwrap_or_else(|e| panic!("{e}"));
                cfg.validate(&format!("{file} [{}]", v.label), None)
                    .unwrap_or_else(|e| panic!("{e}"));
                variants += 1;
            }
            files += 1;
        }
    }
    assert!(files >= 5, "found only {files} experiment files");
    assert!(variants >= 5, "found only {variants} sweep variants");
}

/// Every claim of `experiments/claims/claims.toml` (the accuracies `experiments/check-claims`
/// re-runs) names a configuration, variant and overrides that load and validate, so the
/// check cannot fail on a stale claim only when CI reaches it.
#[test]
fn every_stated_claim_names_a_valid_run() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("experiments/claims/claims.toml")).unwrap();
    let doc: toml::Table = text.parse().unwrap_or_else(|e| panic!("claims.toml: {e}"));
    let claims = doc["claim"]
        .as_array()
        .expect("claims.toml: [[claim]] tables");
    let mut in_ci = 0;
    for c in claims {
        let name = c["name"].as_str().unwrap();
        let config = root.join(c["config"].as_str().unwrap());
        let sets: Vec<String> = c
            .get("set")
            .and_then(|s| s.as_array())
            .map(|a| a.iter().map(|v| v.as_str().unwrap().to_string()).collect())
            .unwrap_or_default();
        let variant = c.get("variant").and_then(|v| v.as_str());
        let cfg = RunConfig::load_variant(&config, variant, &sets)
            .unwrap_or_else(|e| panic!("claim {name}: {e}"));
        cfg.validate(name, None)
            .unwrap_or_else(|e| panic!("claim {name}: {e}"));
        assert!(
            c["stated"].as_float().is_some(),
            "claim {name}: stated is not a float"
        );
        in_ci += c.get("ci").and_then(|v| v.as_bool()).unwrap_or(false) as usize;
    }
    assert!(in_ci >= 3, "CI re-checks only {in_ci} claims");
}
