//! CIFAR-10 and CIFAR-100 in their official binary formats.
//!
//! CIFAR-10 (`data_batch_1.bin` … `data_batch_5.bin`, `test_batch.bin`): records of 3073
//! bytes — a label byte (0–9), then 1024 red, 1024 green and 1024 blue bytes of a 32×32
//! image, rows top to bottom. CIFAR-100 (`train.bin`, `test.bin`): 3074-byte records, a
//! coarse label (0–19) and a fine label (0–99), then the same 3072 pixel bytes.

use std::path::{Path, PathBuf};

use crate::error::{read_file, DataError, Result};
use crate::sample::{ImageSet, Split};

/// Pixel bytes per CIFAR image (3 × 32 × 32).
pub const CIFAR_PIXELS: usize = 3 * 32 * 32;

/// Which CIFAR record layout, and for CIFAR-100 which label to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CifarKind {
    /// CIFAR-10: one label byte, 10 classes.
    Cifar10,
    /// CIFAR-100 with its 20 coarse (superclass) labels.
    Cifar100Coarse,
    /// CIFAR-100 with its 100 fine labels.
    Cifar100Fine,
}

impl CifarKind {
    /// Bytes per record: 3073 for CIFAR-10, 3074 for CIFAR-100.
    pub fn record_len(self) -> usize {
        match self {
            CifarKind::Cifar10 => 1 + CIFAR_PIXELS,
            _ => 2 + CIFAR_PIXELS,
        }
    }

    /// Number of classes of the kept label.
    pub fn num_classes(self) -> usize {
        match self {
            CifarKind::Cifar10 => 10,
            CifarKind::Cifar100Coarse => 20,
            CifarKind::Cifar100Fine => 100,
        }
    }
}

/// Appends the records of one CIFAR binary file to `pixels` / `labels`.
///
/// Errors name the file: empty, a length that is not a whole number of records
/// (a short last record), a label out of range.
pub fn read_cifar_file(
    path: impl AsRef<Path>,
    kind: CifarKind,
    pixels: &mut Vec<u8>,
    labels: &mut Vec<u16>,
) -> Result<usize> {
    let path = path.as_ref();
    let rec = kind.record_len();
    let len = std::fs::metadata(path)
        .map_err(|e| DataError::io(path, "stat", e))?
        .len();
    if len == 0 || len % rec as u64 != 0 {
        return Err(DataError::format(
            path,
            format!(
                "{len} bytes is not a whole number of {rec}-byte {kind:?} records \
                 (last record short by {} bytes)",
                (rec as u64 - len % rec as u64) % rec as u64
            ),
        ));
    }
    let bytes = read_file(path)?;
    if bytes.len() as u64 != len {
        return Err(DataError::format(path, "file changed while being read"));
    }
    let n = bytes.len() / rec;
    pixels.reserve(n * CIFAR_PIXELS);
    labels.reserve(n);
    let classes = kind.num_classes();
    for (i, r) in bytes.chunks_exact(rec).enumerate() {
        let label = match kind {
            CifarKind::Cifar10 | CifarKind::Cifar100Coarse => r[0],
            CifarKind::Cifar100Fine => r[1],
        };
        if label as usize >= classes {
            return Err(DataError::format(
                path,
                format!("record {i}: label {label} is not below {classes} ({kind:?})"),
            ));
        }
        labels.push(label as u16);
        pixels.extend_from_slice(&r[rec - CIFAR_PIXELS..]);
    }
    Ok(n)
}

/// Reads CIFAR binary files into one [`ImageSet`] of shape `[3, 32, 32]`.
pub fn read_cifar_files<P: AsRef<Path>>(files: &[P], kind: CifarKind) -> Result<ImageSet> {
    let (mut pixels, mut labels) = (Vec::new(), Vec::new());
    for f in files {
        read_cifar_file(f, kind, &mut pixels, &mut labels)?;
    }
    ImageSet::new([3, 32, 32], pixels, labels, kind.num_classes())
}

fn locate(dir: &Path, sub: &str, names: &[String]) -> Result<Vec<PathBuf>> {
    let base = if dir.join(sub).is_dir() {
        dir.join(sub)
    } else {
        dir.to_path_buf()
    };
    names
        .iter()
        .map(|n| {
            let p = base.join(n);
            if p.is_file() {
                Ok(p)
            } else {
                Err(DataError::format(
                    &base,
                    format!("no {n} in this directory (import the official archive with `dtrain data fetch cifar10 --from FILE`)"),
                ))
            }
        })
        .collect()
}

/// Loads CIFAR-10 from a directory holding the official binary batches (either the
/// directory itself or its `cifar-10-batches-bin/` subdirectory).
pub fn load_cifar10_dir(dir: impl AsRef<Path>, split: Split) -> Result<ImageSet> {
    let names: Vec<String> = match split {
        Split::Train => (1..=5).map(|i| format!("data_batch_{i}.bin")).collect(),
        Split::Test => vec!["test_batch.bin".into()],
    };
    let files = locate(dir.as_ref(), "cifar-10-batches-bin", &names)?;
    read_cifar_files(&files, CifarKind::Cifar10)
}

/// Loads CIFAR-100 (`train.bin` / `test.bin`, directly or under `cifar-100-binary/`).
///
/// # Panics
/// Panics if `kind` is [`CifarKind::Cifar10`].
pub fn load_cifar100_dir(dir: impl AsRef<Path>, split: Split, kind: CifarKind) -> Result<ImageSet> {
    assert_ne!(
        kind,
        CifarKind::Cifar10,
        "load_cifar100_dir needs a CIFAR-100 kind"
    );
    let name = match split {
        Split::Train => "train.bin",
        Split::Test => "test.bin",
    };
    let files = locate(dir.as_ref(), "cifar-100-binary", &[name.to_string()])?;
    read_cifar_files(&files, kind)
}

/// Encodes images and labels as CIFAR records (for fixtures and exports). For CIFAR-100
/// kinds, `labels` are `(coarse, fine)` pairs; for CIFAR-10 the second is ignored.
///
/// # Panics
/// Panics if an image is not [`CIFAR_PIXELS`] bytes.
pub fn encode_cifar(kind: CifarKind, images: &[&[u8]], labels: &[(u8, u8)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(images.len() * kind.record_len());
    for (img, &(a, b)) in images.iter().zip(labels) {
        assert_eq!(img.len(), CIFAR_PIXELS, "CIFAR image size");
        out.push(a);
        if kind != CifarKind::Cifar10 {
            out.push(b);
        }
        out.extend_from_slice(img);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn img(seed: u8) -> Vec<u8> {
        (0..CIFAR_PIXELS)
            .map(|i| (i as u8).wrapping_mul(3).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn cifar10_dir_round_trip() {
        let t = tempfile::tempdir().unwrap();
        let sub = t.path().join("cifar-10-batches-bin");
        std::fs::create_dir(&sub).unwrap();
        let imgs: Vec<Vec<u8>> = (0..12).map(img).collect();
        for b in 1..=5u8 {
            let refs: Vec<&[u8]> = imgs[..2].iter().map(|v| v.as_slice()).collect();
            let bytes = encode_cifar(CifarKind::Cifar10, &refs, &[(b, 0), (9, 0)]);
            assert_eq!(bytes.len(), 2 * 3073);
            std::fs::write(sub.join(format!("data_batch_{b}.bin")), bytes).unwrap();
        }
        let refs: Vec<&[u8]> = imgs[2..5].iter().map(|v| v.as_slice()).collect();
        std::fs::write(
            sub.join("test_batch.bin"),
            encode_cifar(CifarKind::Cifar10, &refs, &[(0, 0), (1, 0), (2, 0)]),
        )
        .unwrap();
        let train = load_cifar10_dir(t.path(), Split::Train).unwrap();
        assert_eq!(train.len(), 10);
        assert_eq!(train.label(4), 3);
        assert_eq!(train.label(5), 9);
        let test = load_cifar10_dir(&sub, Split::Test).unwrap();
        assert_eq!(test.len(), 3);
        assert_eq!(test.pixels(1), imgs[3].as_slice());
        assert_eq!(test.shape(), [3, 32, 32]);
    }

    #[test]
    fn cifar100_fine_and_coarse() {
        let t = tempfile::tempdir().unwrap();
        let a = img(1);
        let bytes = encode_cifar(CifarKind::Cifar100Fine, &[&a, &a], &[(19, 99), (3, 42)]);
        assert_eq!(bytes.len(), 2 * 3074);
        std::fs::write(t.path().join("test.bin"), &bytes).unwrap();
        let fine = load_cifar100_dir(t.path(), Split::Test, CifarKind::Cifar100Fine).unwrap();
        assert_eq!((fine.label(0), fine.label(1)), (99, 42));
        assert_eq!(fine.num_classes(), 100);
        let coarse = load_cifar100_dir(t.path(), Split::Test, CifarKind::Cifar100Coarse).unwrap();
        assert_eq!((coarse.label(0), coarse.label(1)), (19, 3));
        assert_eq!(fine.pixels(1), a.as_slice());
        // The same file read as CIFAR-10 is not a whole number of 3073-byte records.
        let e = read_cifar_files(&[t.path().join("test.bin")], CifarKind::Cifar10).unwrap_err();
        assert!(e.to_string().contains("3073-byte"), "{e}");
    }

    #[test]
    fn short_record_and_bad_label_are_named() {
        let t = tempfile::tempdir().unwrap();
        let a = img(0);
        let mut bytes = encode_cifar(CifarKind::Cifar10, &[&a, &a], &[(1, 0), (2, 0)]);
        bytes.truncate(bytes.len() - 100);
        let p = t.path().join("data_batch_1.bin");
        std::fs::write(&p, &bytes).unwrap();
        let e = read_cifar_files(&[&p], CifarKind::Cifar10)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("data_batch_1.bin") && e.contains("last record short by 100 bytes"),
            "{e}"
        );
        let bytes = encode_cifar(CifarKind::Cifar10, &[&a], &[(10, 0)]);
        std::fs::write(&p, &bytes).unwrap();
        let e = read_cifar_files(&[&p], CifarKind::Cifar10)
            .unwrap_err()
            .to_string();
        assert!(e.contains("record 0: label 10"), "{e}");
        std::fs::write(&p, []).unwrap();
        assert!(read_cifar_files(&[&p], CifarKind::Cifar10).is_err());
        let e = load_cifar10_dir(t.path().join("nope"), Split::Test).unwrap_err();
        assert!(e.to_string().contains("test_batch.bin"), "{e}");
    }
}
