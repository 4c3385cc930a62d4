//! Every configuration under `experiments/` parses and validates (without data: the
//! data-dependent checks run in `dtrain check`).

use dtrain_framework::config::RunConfig;

#[test]
fn every_experiment_config_validates() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../experiments");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            let cfg = RunConfig::load(&p, &[]).unwrap_or_else(|e| panic!("{e}"));
            cfg.validate(&p.display().to_string(), None)
                .unwrap_or_else(|e| panic!("{e}"));
            // The fp32 baseline of every experiment is one override away.
            let none = RunConfig::load(&p, &["compress={ kind = \"none\" }".to_string()]).unwrap();
            none.validate("baseline", None).unwrap();
            n += 1;
        }
    }
    assert!(n >= 4, "found only {n} experiment files");
}
