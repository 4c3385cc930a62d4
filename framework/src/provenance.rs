//! What a run was measured with and on ([`dtrain_records::Provenance`]): the commit and
//! profile the binary was built from (recorded by `build.rs`), the session's start, the
//! CPU and its x86-64 level.

use std::time::SystemTime;

pub use dtrain_records::Provenance;

/// The commit this binary was built from, `-dirty` appended when tracked files differed
/// from it; `None` outside a git checkout.
pub fn build_commit() -> Option<&'static str> {
    Some(env!("DTRAIN_COMMIT")).filter(|c| !c.is_empty())
}

/// The provenance of a session that started at `started`, on this machine.
pub fn provenance(started: SystemTime) -> Provenance {
    let (y, m, d, hh, mm, ss) = crate::launch::utc_civil(started);
    Provenance {
        commit: build_commit().map(str::to_string),
        profile: Some(env!("DTRAIN_PROFILE").to_string()).filter(|p| !p.is_empty()),
        started_utc: Some(format!("{y:04}-{m:02}-{d:02} {hh:02}:{mm:02}:{ss:02}")),
        cpu: cpu_model(),
        cpu_level: x86_64_level().map(str::to_string),
        cpus: std::thread::available_parallelism().ok().map(|n| n.get()),
    }
}

/// The first `model name` of `/proc/cpuinfo` (Linux), whitespace collapsed.
fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == "model name").then(|| v.split_whitespace().collect::<Vec<_>>().join(" "))
        })
        .filter(|s| !s.is_empty())
}

/// The highest x86-64 microarchitecture level (psABI) whose features this CPU has.
#[cfg(target_arch = "x86_64")]
pub fn x86_64_level() -> Option<&'static str> {
    use std::arch::is_x86_feature_detected as has;
    let v2 = has!("cmpxchg16b")
        && has!("popcnt")
        && has!("sse3")
        && has!("sse4.1")
        && has!("sse4.2")
        && has!("ssse3");
    let v3 = v2
        && has!("avx")
        && has!("avx2")
        && has!("bmi1")
        && has!("bmi2")
        && has!("f16c")
        && has!("fma")
        && has!("lzcnt")
        && has!("movbe")
        && has!("xsave");
    let v4 = v3
        && has!("avx512f")
        && has!("avx512bw")
        && has!("avx512cd")
        && has!("avx512dq")
        && has!("avx512vl");
    Some(match (v2, v3, v4) {
        (_, _, true) => "x86-64-v4",
        (_, true, _) => "x86-64-v3",
        (true, _, _) => "x86-64-v2",
        _ => "x86-64",
    })
}

/// The highest x86-64 microarchitecture level: none on other architectures.
#[cfg(not(target_arch = "x86_64"))]
pub fn x86_64_level() -> Option<&'static str> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_provenance_names_the_start_and_the_machine() {
        // 2026-11-28 12:20:17 UTC.
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_795_868_417);
        let p = provenance(t);
        assert_eq!(p.started_utc.as_deref(), Some("2026-11-28 12:20:17"));
        assert!(p.cpus.is_some_and(|n| n >= 1));
        if cfg!(target_arch = "x86_64") {
            assert!(p
                .cpu_level
                .as_deref()
                .is_some_and(|l| l.starts_with("x86-64")));
        }
        let line = p.line();
        assert!(line.contains("2026-11-28 12:20:17 UTC"), "{line}");
        if let Some(c) = &p.commit {
            assert!(line.starts_with(&format!("commit {c}")), "{line}");
        }
    }
}
