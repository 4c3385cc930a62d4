//! Records the commit and cargo profile the trainer is built from (`DTRAIN_COMMIT`,
//! `DTRAIN_PROFILE`), for each run's provenance (`framework/src/provenance.rs`).
//!
//! The script reruns when the checkout's HEAD moves or any workspace member's sources
//! change, so that `-dirty` follows edits. It asks git not to take optional locks, so it
//! never rewrites the index it would otherwise watch.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .env("GIT_OPTIONAL_LOCKS", "0")
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let commit = git(&["rev-parse", "--short=9", "HEAD"]).unwrap_or_default();
    let dirty = !commit.is_empty()
        && git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    let suffix = if dirty { "-dirty" } else { "" };
    println!("cargo:rustc-env=DTRAIN_COMMIT={commit}{suffix}");
    let profile = std::env::var("PROFILE").unwrap_or_default();
    println!("cargo:rustc-env=DTRAIN_PROFILE={profile}");

    let mut watch = vec!["build.rs".to_string()];
    for member in [
        "compress",
        "comms",
        "models",
        "datasets",
        "records",
        "framework",
        "cli",
        "report",
    ] {
        for part in ["src", "Cargo.toml"] {
            watch.push(format!("../{member}/{part}"));
        }
    }
    watch.push("../Cargo.toml".into());
    watch.push("../Cargo.lock".into());
    // HEAD, the branch it names and the packed refs (a commit moves one of them).
    let branch = git(&["symbolic-ref", "-q", "HEAD"]);
    for dir in [
        git(&["rev-parse", "--git-dir"]),
        git(&["rev-parse", "--git-common-dir"]),
    ]
    .into_iter()
    .flatten()
    {
        watch.push(format!("{dir}/HEAD"));
        watch.push(format!("{dir}/packed-refs"));
        if let Some(r) = &branch {
            watch.push(format!("{dir}/{r}"));
        }
    }
    for w in watch {
        if Path::new(&w).exists() {
            println!("cargo:rerun-if-changed={w}");
        }
    }
}
