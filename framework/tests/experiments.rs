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
