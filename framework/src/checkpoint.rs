//! Checkpoint container and atomic file writes.
//!
//! A checkpoint is a set of named sections (model parameters, optimizer state, every
//! error-feedback memory, schedules, RNG state, data position), written as one file:
//!
//! ```text
//! "DTCKPT01"                       8-byte magic + format version
//! u32 section count
//! per section: u32 name length, name (UTF-8), u64 byte length, bytes
//! u64 checksum of everything above (word-wise multiplicative hash)
//! ```
//! All integers little-endian. Writing goes to a temporary file in the same directory,
//! which is flushed and `fsync`ed and then renamed over the target, so a crash leaves
//! either the old or the new checkpoint, never a torn one. Reading checks every length
//! against the file size before allocating, and the checksum before returning anything.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use thiserror::Error;

const MAGIC: &[u8; 8] = b"DTCKPT01";
const MAX_NAME: usize = 4096;

/// Why a checkpoint could not be written or read.
#[derive(Debug, Error)]
pub enum CheckpointError {
    /// Filesystem error, with the path.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The file is not a valid checkpoint.
    #[error("{path}: corrupt checkpoint: {what}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// A section the caller needs is absent or has the wrong form.
    #[error("checkpoint section {name:?}: {what}")]
    Section {
        /// Section name.
        name: String,
        /// What is wrong.
        what: String,
    },
}

/// Named byte sections.
#[derive(Debug, Clone, Default)]
pub struct Checkpoint {
    sections: BTreeMap<String, Vec<u8>>,
    /// The sections of a checkpoint this one was made from ([`Checkpoint::recycle`]),
    /// whose buffers [`Checkpoint::put_f32`] overwrites in place: not part of the contents.
    spare: BTreeMap<String, Vec<u8>>,
}

/// Equal contents: the same sections, byte for byte (buffers kept for reuse do not count).
impl PartialEq for Checkpoint {
    fn eq(&self, other: &Self) -> bool {
        self.sections == other.sections
    }
}

impl Eq for Checkpoint {}

/// 64-bit checksum: FNV-style multiply-xor over 8-byte words (corruption detection, not
/// security).
pub fn checksum(data: &[u8]) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325 ^ data.len() as u64;
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        h = (h ^ w).wrapping_mul(0x0000_0100_0000_01B3).rotate_left(29);
    }
    for &b in chunks.remainder() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3);
    }
    h ^ (h >> 31)
}

impl Checkpoint {
    /// An empty checkpoint.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty checkpoint that reuses this one's buffers: each [`Checkpoint::put_f32`]
    /// of a section this one held overwrites that section's buffer in place (no
    /// allocation, no zeroing) — live membership keeps the whole state before every step,
    /// and the copy is the cost. [`Checkpoint::release_spare`] frees what was not reused.
    pub fn recycle(self) -> Self {
        Checkpoint {
            sections: BTreeMap::new(),
            spare: self.sections,
        }
    }

    /// Frees the buffers of [`Checkpoint::recycle`] that no section took.
    pub fn release_spare(&mut self) {
        self.spare.clear();
    }

    /// Stores raw bytes under `name`.
    pub fn put_bytes(&mut self, name: &str, bytes: Vec<u8>) {
        self.sections.insert(name.to_string(), bytes);
    }

    /// Stores an `f32` array (little-endian).
    pub fn put_f32(&mut self, name: &str, v: &[f32]) {
        // Into a buffer of the final length — a recycled one of that length as it is — 4
        // bytes at a time: a loop the compiler turns into wide copies (pushing each value's
        // bytes checked the capacity every time).
        let mut b = self.spare.remove(name).unwrap_or_default();
        if b.len() != v.len() * 4 {
            b.clear();
            b.resize(v.len() * 4, 0);
        }
        for (c, x) in b.chunks_exact_mut(4).zip(v) {
            c.copy_from_slice(&x.to_le_bytes());
        }
        self.put_bytes(name, b);
    }

    /// Stores a serde value as JSON.
    pub fn put_json<T: serde::Serialize>(&mut self, name: &str, v: &T) {
        let b = serde_json::to_vec(v).expect("checkpoint metadata serialises");
        self.put_bytes(name, b);
    }

    /// Takes section `name` out, returning its bytes (`None` if there is none).
    pub fn remove(&mut self, name: &str) -> Option<Vec<u8>> {
        self.sections.remove(name)
    }

    /// The section names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.sections.keys().map(|s| s.as_str())
    }

    /// Raw bytes of `name`.
    pub fn bytes(&self, name: &str) -> Result<&[u8], CheckpointError> {
        self.sections
            .get(name)
            .map(|v| v.as_slice())
            .ok_or_else(|| CheckpointError::Section {
                name: name.into(),
                what: "missing".into(),
            })
    }

    /// An `f32` array stored with [`Checkpoint::put_f32`].
    pub fn f32(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        let b = self.bytes(name)?;
        if b.len() % 4 != 0 {
            return Err(CheckpointError::Section {
                name: name.into(),
                what: "length is not a multiple of 4".into(),
            });
        }
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// A JSON section.
    pub fn json<T: serde::de::DeserializeOwned>(&self, name: &str) -> Result<T, CheckpointError> {
        serde_json::from_slice(self.bytes(name)?).map_err(|e| CheckpointError::Section {
            name: name.into(),
            what: e.to_string(),
        })
    }

    /// Serialises to bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let total: usize = self
            .sections
            .iter()
            .map(|(k, v)| 12 + k.len() + v.len())
            .sum();
        let mut out = Vec::with_capacity(20 + total);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(self.sections.len() as u32).to_le_bytes());
        for (k, v) in &self.sections {
            out.extend_from_slice(&(k.len() as u32).to_le_bytes());
            out.extend_from_slice(k.as_bytes());
            out.extend_from_slice(&(v.len() as u64).to_le_bytes());
            out.extend_from_slice(v);
        }
        let h = checksum(&out);
        out.extend_from_slice(&h.to_le_bytes());
        out
    }

    /// Parses bytes written by [`Checkpoint::to_bytes`]; `path` is only used in errors.
    pub fn from_bytes(data: &[u8], path: &Path) -> Result<Self, CheckpointError> {
        let corrupt = |what: &str| CheckpointError::Corrupt {
            path: path.to_path_buf(),
            what: what.to_string(),
        };
        if data.len() < 8 + 4 + 8 || &data[..8] != MAGIC {
            return Err(corrupt("not a dtrain checkpoint (bad magic or too short)"));
        }
        let (body, tail) = data.split_at(data.len() - 8);
        let want = u64::from_le_bytes(tail.try_into().expect("8 bytes"));
        if checksum(body) != want {
            return Err(corrupt("checksum mismatch (truncated or damaged file)"));
        }
        let mut pos = 8;
        let mut take = |n: usize| -> Result<&[u8], CheckpointError> {
            if n > body.len() - pos {
                return Err(corrupt("section runs past the end of the file"));
            }
            let s = &body[pos..pos + n];
            pos += n;
            Ok(s)
        };
        let count = u32::from_le_bytes(take(4)?.try_into().expect("4")) as usize;
        let mut sections = BTreeMap::new();
        for _ in 0..count {
            let nl = u32::from_le_bytes(take(4)?.try_into().expect("4")) as usize;
            if nl > MAX_NAME {
                return Err(corrupt("section name too long"));
            }
            let name = std::str::from_utf8(take(nl)?)
                .map_err(|_| corrupt("section name is not UTF-8"))?
                .to_string();
            let len = u64::from_le_bytes(take(8)?.try_into().expect("8"));
            let len = usize::try_from(len).map_err(|_| corrupt("section too large"))?;
            let bytes = take(len)?.to_vec();
            if sections.insert(name, bytes).is_some() {
                return Err(corrupt("duplicate section"));
            }
        }
        if pos != body.len() {
            return Err(corrupt("trailing bytes after the last section"));
        }
        Ok(Checkpoint {
            sections,
            spare: BTreeMap::new(),
        })
    }

    /// Writes atomically to `path` (temp file + fsync + rename + directory fsync).
    pub fn save(&self, path: &Path) -> Result<(), CheckpointError> {
        write_atomic(path, &self.to_bytes())
    }

    /// Reads and verifies `path`.
    pub fn load(path: &Path) -> Result<Self, CheckpointError> {
        let data = fs::read(path).map_err(|source| CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_bytes(&data, path)
    }
}

/// Writes `data` to `path` atomically: a reader sees the old file or the new one, never a
/// partial write.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<(), CheckpointError> {
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| CheckpointError::Io { path: p, source }
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io(dir))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let res = (|| {
        let mut f = fs::File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(data).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        drop(f);
        fs::rename(&tmp, path).map_err(io(path))?;
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("dtrain-ckpt-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn round_trip_and_atomic_replace() {
        let d = tmpdir("rt");
        let path = d.join("ckpt.bin");
        let mut c = Checkpoint::new();
        c.put_f32("model", &[1.0, -2.5, 3.25]);
        c.put_json("meta", &serde_json::json!({"step": 7}));
        c.save(&path).unwrap();
        let back = Checkpoint::load(&path).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.f32("model").unwrap(), vec![1.0, -2.5, 3.25]);
        let meta: serde_json::Value = back.json("meta").unwrap();
        assert_eq!(meta["step"], 7);
        c.put_f32("model", &[0.0]);
        c.save(&path).unwrap();
        assert_eq!(
            Checkpoint::load(&path).unwrap().f32("model").unwrap(),
            vec![0.0]
        );
        // No temp files left behind.
        assert_eq!(fs::read_dir(&d).unwrap().count(), 1);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_recycled_checkpoint_holds_only_what_was_put_into_it_again() {
        let mut old = Checkpoint::new();
        old.put_f32("params", &[1.0, 2.0, 3.0]);
        old.put_f32("mem/1", &[4.0; 4]);
        old.put_f32("gone", &[5.0]);
        old.put_json("meta", &7);
        let at = old.bytes("params").unwrap().as_ptr();
        let mut c = old.recycle();
        c.put_f32("params", &[-1.0, -2.0, -3.0]);
        c.put_f32("mem/1", &[6.0; 2]);
        c.put_json("meta", &8);
        c.release_spare();
        // The buffer of the same length was written in place.
        assert_eq!(c.bytes("params").unwrap().as_ptr(), at);
        let mut fresh = Checkpoint::new();
        fresh.put_f32("params", &[-1.0, -2.0, -3.0]);
        fresh.put_f32("mem/1", &[6.0; 2]);
        fresh.put_json("meta", &8);
        assert_eq!(c, fresh);
        assert_eq!(c.to_bytes(), fresh.to_bytes());
        assert_eq!(c.names().collect::<Vec<_>>(), ["mem/1", "meta", "params"]);
    }

    #[test]
    fn damage_is_detected_with_the_path_in_the_error() {
        let mut c = Checkpoint::new();
        c.put_f32("model", &[1.0; 100]);
        let bytes = c.to_bytes();
        let p = Path::new("runs/x/ckpt.bin");
        for cut in [0, 7, 20, bytes.len() - 1] {
            let e = Checkpoint::from_bytes(&bytes[..cut], p).unwrap_err();
            assert!(e.to_string().contains("runs/x/ckpt.bin"), "{e}");
        }
        for i in [9, 30, bytes.len() - 3] {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(Checkpoint::from_bytes(&b, p).is_err());
        }
        assert!(matches!(
            c.f32("nope"),
            Err(CheckpointError::Section { .. })
        ));
        // A hostile length field cannot make the reader allocate.
        let mut evil = Vec::from(&MAGIC[..]);
        evil.extend_from_slice(&1u32.to_le_bytes());
        evil.extend_from_slice(&1u32.to_le_bytes());
        evil.push(b'a');
        evil.extend_from_slice(&u64::MAX.to_le_bytes());
        let h = checksum(&evil);
        evil.extend_from_slice(&h.to_le_bytes());
        assert!(Checkpoint::from_bytes(&evil, p).is_err());
    }
}
