//! MNIST / Fashion-MNIST: the IDX format (raw or gzip-compressed).
//!
//! An IDX file is a big-endian header — two zero bytes, an element-type byte, the number
//! of dimensions, then one `u32` per dimension — followed by the elements. Only unsigned
//! bytes (type `0x08`), which is what MNIST and Fashion-MNIST use, are supported.
//! Sizes are checked against the header before any data-sized buffer is allocated.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;

use crate::error::{DataError, Result};
use crate::sample::{ImageSet, Split};

/// A decoded IDX array of unsigned bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    /// Dimensions, outermost first (e.g. `[60000, 28, 28]`).
    pub dims: Vec<usize>,
    /// The elements, row-major.
    pub data: Vec<u8>,
}

const UBYTE: u8 = 0x08;
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Reads an IDX file, raw or gzip-compressed (detected by its magic bytes).
///
/// Errors name the file: bad magic, unsupported element type, zero or too many
/// dimensions, a data section shorter or longer than the header declares, a corrupt
/// gzip stream.
pub fn read_idx(path: impl AsRef<Path>) -> Result<IdxArray> {
    let path = path.as_ref();
    let mut file = File::open(path).map_err(|e| DataError::io(path, "open", e))?;
    let file_len = file
        .metadata()
        .map_err(|e| DataError::io(path, "stat", e))?
        .len();
    let mut head = [0u8; 2];
    let n = read_up_to(&mut file, &mut head).map_err(|e| DataError::io(path, "read", e))?;
    let rest = std::io::Cursor::new(head[..n].to_vec()).chain(file);
    if n == 2 && head == GZIP_MAGIC {
        let mut dec = MultiGzDecoder::new(rest);
        read_idx_stream(path, &mut dec, None)
    } else {
        let mut rest = rest;
        read_idx_stream(path, &mut rest, Some(file_len))
    }
}

/// Parses IDX from `r`; `raw_len` is the file size when the stream is not compressed.
fn read_idx_stream(path: &Path, r: &mut dyn Read, raw_len: Option<u64>) -> Result<IdxArray> {
    let gz = if raw_len.is_none() { " (gzip)" } else { "" };
    let io = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::InvalidInput
            || e.kind() == std::io::ErrorKind::InvalidData
        {
            DataError::format(path, format!("corrupt gzip stream: {e}"))
        } else {
            DataError::io(path, "read", e)
        }
    };
    let mut magic = [0u8; 4];
    let n = read_up_to(r, &mut magic).map_err(io)?;
    if n < 4 {
        return Err(DataError::format(
            path,
            format!("truncated{gz}: {n} bytes, shorter than the 4-byte IDX magic"),
        ));
    }
    if magic[0] != 0 || magic[1] != 0 {
        return Err(DataError::format(
            path,
            format!(
                "bad IDX magic {:02x}{:02x}{:02x}{:02x}{gz}: expected 0000 then type and rank",
                magic[0], magic[1], magic[2], magic[3]
            ),
        ));
    }
    if magic[2] != UBYTE {
        return Err(DataError::format(
            path,
            format!(
                "unsupported IDX element type 0x{:02x}: only unsigned byte (0x08) is supported",
                magic[2]
            ),
        ));
    }
    let rank = magic[3] as usize;
    if !(1..=4).contains(&rank) {
        return Err(DataError::format(
            path,
            format!("IDX header declares {rank} dimensions (expected 1 to 4)"),
        ));
    }
    let mut dims_raw = vec![0u8; 4 * rank];
    let n = read_up_to(r, &mut dims_raw).map_err(io)?;
    if n < dims_raw.len() {
        return Err(DataError::format(
            path,
            format!("truncated{gz}: header ends inside the {rank} dimension sizes"),
        ));
    }
    let dims: Vec<usize> = dims_raw
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let expected = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .filter(|&e| e <= isize::MAX as usize)
        .ok_or_else(|| DataError::format(path, format!("IDX dimensions {dims:?} overflow")))?;
    let header = 4 + 4 * rank;
    if let Some(len) = raw_len {
        let have = len.saturating_sub(header as u64);
        if have != expected as u64 {
            let what = if have < expected as u64 {
                "truncated"
            } else {
                "trailing bytes"
            };
            return Err(DataError::format(
                path,
                format!(
                    "{what}: header declares dimensions {dims:?} = {expected} bytes of data, \
                     file holds {have}"
                ),
            ));
        }
    }
    // For gzip the decompressed size is unknown: grow the buffer only as data arrives,
    // and read at most one byte past what the header declares.
    let mut data = Vec::with_capacity(expected.min(64 << 20));
    r.take(expected as u64 + 1)
        .read_to_end(&mut data)
        .map_err(io)?;
    if data.len() != expected {
        let what = if data.len() < expected {
            "truncated"
        } else {
            "trailing bytes"
        };
        let held = if data.len() > expected {
            "more".to_string()
        } else {
            data.len().to_string()
        };
        return Err(DataError::format(
            path,
            format!(
                "{what}{gz}: header declares dimensions {dims:?} = {expected} bytes of data, \
                 stream holds {held}"
            ),
        ));
    }
    Ok(IdxArray { dims, data })
}

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn read_up_to(r: &mut dyn Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Loads an image file (`[n, rows, cols]`) and its label file (`[n]`, labels < `num_classes`)
/// into an [`ImageSet`] of shape `[1, rows, cols]`.
pub fn load_idx_pair(
    images: impl AsRef<Path>,
    labels: impl AsRef<Path>,
    num_classes: usize,
) -> Result<ImageSet> {
    let (ip, lp) = (images.as_ref(), labels.as_ref());
    let img = read_idx(ip)?;
    if img.dims.len() != 3 {
        return Err(DataError::format(
            ip,
            format!(
                "expected 3 dimensions [n, rows, cols] for images, found {:?}",
                img.dims
            ),
        ));
    }
    let lab = read_idx(lp)?;
    if lab.dims.len() != 1 {
        return Err(DataError::format(
            lp,
            format!("expected 1 dimension [n] for labels, found {:?}", lab.dims),
        ));
    }
    if lab.dims[0] != img.dims[0] {
        return Err(DataError::format(
            lp,
            format!(
                "{} labels for {} images in {}",
                lab.dims[0],
                img.dims[0],
                ip.display()
            ),
        ));
    }
    if let Some((i, &l)) = lab
        .data
        .iter()
        .enumerate()
        .find(|(_, &l)| l as usize >= num_classes)
    {
        return Err(DataError::format(
            lp,
            format!("label {l} of item {i} is not below {num_classes}"),
        ));
    }
    let labels = lab.data.into_iter().map(u16::from).collect();
    ImageSet::new([1, img.dims[1], img.dims[2]], img.data, labels, num_classes)
}

/// Finds `stem` in `dir` under the usual spellings: `train-images-idx3-ubyte`,
/// `train-images.idx3-ubyte`, each optionally with `.gz`.
fn find_idx(dir: &Path, stem: &str) -> Result<PathBuf> {
    let dotted = stem.replacen("-idx", ".idx", 1);
    for name in [stem, dotted.as_str()] {
        for ext in ["", ".gz"] {
            let p = dir.join(format!("{name}{ext}"));
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    Err(DataError::format(
        dir,
        format!("no {stem} or {stem}.gz in this directory (run `dtrain data fetch`?)"),
    ))
}

/// Loads MNIST or Fashion-MNIST (10 classes, `[1, 28, 28]`) from a directory holding the
/// four official IDX files, raw or `.gz` (as `dtrain data fetch mnist` / `fashion-mnist`
/// leave them).
pub fn load_mnist_dir(dir: impl AsRef<Path>, split: Split) -> Result<ImageSet> {
    let dir = dir.as_ref();
    let prefix = match split {
        Split::Train => "train",
        Split::Test => "t10k",
    };
    let images = find_idx(dir, &format!("{prefix}-images-idx3-ubyte"))?;
    let labels = find_idx(dir, &format!("{prefix}-labels-idx1-ubyte"))?;
    load_idx_pair(images, labels, 10)
}

/// Encodes an unsigned-byte IDX array (the inverse of [`read_idx`]; used for fixtures and
/// exports).
///
/// # Panics
/// Panics if `dims` is empty, has more than 4 entries, a dimension exceeds `u32::MAX`, or
/// `data.len()` is not their product.
pub fn encode_idx(dims: &[usize], data: &[u8]) -> Vec<u8> {
    assert!((1..=4).contains(&dims.len()), "IDX rank must be 1..=4");
    assert_eq!(
        dims.iter().product::<usize>(),
        data.len(),
        "IDX data length"
    );
    let mut out = vec![0, 0, UBYTE, dims.len() as u8];
    for &d in dims {
        out.extend_from_slice(&u32::try_from(d).expect("IDX dim fits u32").to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::{write::GzEncoder, Compression};
    use std::io::Write;

    fn gz(bytes: &[u8]) -> Vec<u8> {
        let mut e = GzEncoder::new(Vec::new(), Compression::fast());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn fixture(n: usize) -> (Vec<u8>, Vec<u8>) {
        let pixels: Vec<u8> = (0..n * 28 * 28).map(|i| (i * 7 % 251) as u8).collect();
        let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
        (encode_idx(&[n, 28, 28], &pixels), encode_idx(&[n], &labels))
    }

    #[test]
    fn raw_and_gz_load_identically() {
        let t = tempfile::tempdir().unwrap();
        let (img, lab) = fixture(5);
        let raw_dir = t.path().join("raw");
        let gz_dir = t.path().join("gz");
        std::fs::create_dir_all(&raw_dir).unwrap();
        std::fs::create_dir_all(&gz_dir).unwrap();
        write(&raw_dir, "t10k-images-idx3-ubyte", &img);
        write(&raw_dir, "t10k-labels-idx1-ubyte", &lab);
        write(&gz_dir, "t10k-images-idx3-ubyte.gz", &gz(&img));
        write(&gz_dir, "t10k-labels-idx1-ubyte.gz", &gz(&lab));
        let a = load_mnist_dir(&raw_dir, Split::Test).unwrap();
        let b = load_mnist_dir(&gz_dir, Split::Test).unwrap();
        assert_eq!(a.len(), 5);
        assert_eq!(a.shape(), [1, 28, 28]);
        assert_eq!(a.label(3), 3);
        assert_eq!(a.pixels(1)[0], (784 * 7 % 251) as u8);
        for i in 0..5 {
            assert_eq!(a.pixels(i), b.pixels(i));
            assert_eq!(a.label(i), b.label(i));
        }
        let missing = load_mnist_dir(&raw_dir, Split::Train).unwrap_err();
        assert!(missing.to_string().contains("train-images-idx3-ubyte"));
    }

    #[test]
    fn bad_magic_is_named() {
        let t = tempfile::tempdir().unwrap();
        let (mut img, _) = fixture(2);
        img[0] = 0x12;
        let p = write(t.path(), "bad-magic", &img);
        let e = read_idx(&p).unwrap_err().to_string();
        assert!(
            e.contains("bad-magic") && e.contains("bad IDX magic"),
            "{e}"
        );
        let p = write(t.path(), "bad-gz-magic.gz", &gz(&img));
        let e = read_idx(&p).unwrap_err().to_string();
        assert!(
            e.contains("bad-gz-magic.gz") && e.contains("bad IDX magic"),
            "{e}"
        );
    }

    #[test]
    fn unsupported_type_and_rank() {
        let t = tempfile::tempdir().unwrap();
        let p = write(t.path(), "f32", &[0, 0, 0x0d, 1, 0, 0, 0, 1, 0, 0, 0, 0]);
        assert!(read_idx(&p)
            .unwrap_err()
            .to_string()
            .contains("element type 0x0d"));
        let p = write(t.path(), "rank0", &[0, 0, 8, 0]);
        assert!(read_idx(&p)
            .unwrap_err()
            .to_string()
            .contains("0 dimensions"));
    }

    #[test]
    fn truncated_and_trailing_are_detected_before_reading() {
        let t = tempfile::tempdir().unwrap();
        let (img, _) = fixture(3);
        let p = write(t.path(), "short", &img[..img.len() - 1]);
        let e = read_idx(&p).unwrap_err().to_string();
        assert!(e.contains("short: truncated"), "{e}");
        let mut long = img.clone();
        long.push(0);
        let p = write(t.path(), "long", &long);
        assert!(read_idx(&p)
            .unwrap_err()
            .to_string()
            .contains("trailing bytes"));
        let p = write(t.path(), "short.gz", &gz(&img[..img.len() - 10]));
        let e = read_idx(&p).unwrap_err().to_string();
        assert!(e.contains("short.gz: truncated (gzip)"), "{e}");
        // A header declaring ~4 GB in a tiny file must fail without allocating it.
        let p = write(
            t.path(),
            "huge",
            &[0, 0, 8, 1, 0xff, 0xff, 0xff, 0xff, 1, 2],
        );
        assert!(read_idx(&p).unwrap_err().to_string().contains("truncated"));
        let p = write(t.path(), "empty", &[]);
        assert!(read_idx(&p)
            .unwrap_err()
            .to_string()
            .contains("empty: truncated"));
    }

    #[test]
    fn corrupt_gzip_is_a_format_error() {
        let t = tempfile::tempdir().unwrap();
        let (img, _) = fixture(2);
        let mut z = gz(&img);
        let mid = z.len() / 2;
        for b in &mut z[mid..mid + 8] {
            *b ^= 0xff;
        }
        let p = write(t.path(), "corrupt.gz", &z);
        let e = read_idx(&p).unwrap_err();
        assert!(e.to_string().contains("corrupt.gz"), "{e}");
    }

    #[test]
    fn label_file_mismatches() {
        let t = tempfile::tempdir().unwrap();
        let (img, _) = fixture(3);
        let ip = write(t.path(), "img", &img);
        let lp = write(t.path(), "lab", &encode_idx(&[2], &[0, 1]));
        let e = load_idx_pair(&ip, &lp, 10).unwrap_err().to_string();
        assert!(e.contains("lab: 2 labels for 3 images"), "{e}");
        let lp = write(t.path(), "lab2", &encode_idx(&[3], &[0, 1, 12]));
        let e = load_idx_pair(&ip, &lp, 10).unwrap_err().to_string();
        assert!(e.contains("lab2: label 12 of item 2"), "{e}");
        let e = load_idx_pair(&lp, &lp, 10).unwrap_err().to_string();
        assert!(e.contains("expected 3 dimensions"), "{e}");
    }
}
