//! TensorBoard event files, written as the run goes (`[output] tensorboard = true`).
//!
//! Rank 0 writes one file per session, `events.out.tfevents.<unix seconds>.<host>.dtrain`,
//! in the run directory, so `tensorboard --logdir runs` finds every run (and every variant
//! of a sweep) side by side. Per logged step (the steps `metrics.jsonl` gets, at
//! `output.log_every`): `train/loss`, `train/accuracy`, `train/lr`, `train/<theta|density>`,
//! `train/bytes_sent`, `train/payload_bytes` and `time/<phase>_s` for each phase of
//! [`Phases`]; per evaluation: `eval/loss`, `eval/accuracy` and, for a language model,
//! `eval/perplexity`; once per session the resolved configuration as the text summary
//! `config`. Values are those of `metrics.jsonl` / `eval.jsonl` rounded to `f32` (TensorBoard
//! scalars are `float`); a non-finite loss is written as it is. A resumed session first
//! writes a `SessionLog START` at its first step, which makes TensorBoard drop what the
//! previous session logged from that step on (as `metrics.jsonl` is trimmed), and then the
//! evaluation of the checkpoint's step again (`eval.jsonl` keeps it).
//!
//! # Why the format is written here
//!
//! An event file is a TFRecord stream (`u64` length, masked CRC-32C of it, the bytes,
//! masked CRC-32C of them) of `Event` protocol buffers. The Rust crates that write it pull in
//! a protobuf code generator or a tensor library; the four messages dtrain writes take ~100
//! lines of hand encoding, and the CRC-32C (Castagnoli) a table. CI reads the files back
//! with TensorBoard's own `EventAccumulator` and compares every point with `metrics.jsonl`.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use dtrain_records::{EvalRecord, Phases, StepRecord};

/// An open event file.
#[derive(Debug)]
pub struct EventWriter {
    file: File,
    path: PathBuf,
}

impl EventWriter {
    /// Creates a new event file in `dir` and writes its header (`file_version`).
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        let now = wall_time();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty() && !h.contains('/'))
            .unwrap_or_else(|| "localhost".into());
        let mut n = 0;
        let (path, file) = loop {
            // Two sessions in one second (a quick resume) get two files.
            let suffix = if n == 0 {
                String::new()
            } else {
                format!(".{n}")
            };
            let path = dir.join(format!(
                "events.out.tfevents.{}.{host}.dtrain{suffix}",
                now as u64
            ));
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(f) => break (path, f),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 100 => n += 1,
                Err(e) => return Err(e),
            }
        };
        let mut w = EventWriter { file, path };
        let mut event = event_head(now, 0);
        string_field(&mut event, 3, "brain.Event:2");
        w.record(&event)?;
        Ok(w)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Marks a session starting at `step` (`SessionLog { status: START }`): TensorBoard
    /// discards the points at `step` and later that an earlier session wrote.
    pub fn session_start(&mut self, step: u64) -> std::io::Result<()> {
        let mut event = event_head(wall_time(), step);
        // SessionLog { status = START (1) }, Event field 7.
        let session_log = [0x08, 0x01];
        bytes_field(&mut event, 7, &session_log);
        self.record(&event)
    }

    /// Writes scalars `(tag, value)` at `step` in one event.
    pub fn scalars(&mut self, step: u64, values: &[(String, f64)]) -> std::io::Result<()> {
        let mut summary = Vec::new();
        for (tag, v) in values {
            let mut value = Vec::new();
            string_field(&mut value, 1, tag);
            // simple_value: field 2, fixed32 float.
            value.push((2 << 3) | 5);
            value.extend_from_slice(&(*v as f32).to_le_bytes());
            bytes_field(&mut summary, 1, &value);
        }
        let mut event = event_head(wall_time(), step);
        bytes_field(&mut event, 5, &summary);
        self.record(&event)
    }

    /// Writes `text` as the text plugin's summary `tag` at `step` (shown in the Text tab).
    pub fn text(&mut self, step: u64, tag: &str, text: &str) -> std::io::Result<()> {
        // SummaryMetadata { plugin_data { plugin_name: "text" } }
        let mut plugin = Vec::new();
        string_field(&mut plugin, 1, "text");
        let mut metadata = Vec::new();
        bytes_field(&mut metadata, 1, &plugin);
        // TensorProto { dtype: DT_STRING (7), tensor_shape: {} (a scalar), string_val }
        let mut tensor = vec![0x08, 7];
        bytes_field(&mut tensor, 2, &[]);
        bytes_field(&mut tensor, 8, text.as_bytes());
        let mut value = Vec::new();
        string_field(&mut value, 1, tag);
        bytes_field(&mut value, 8, &tensor);
        bytes_field(&mut value, 9, &metadata);
        let mut summary = Vec::new();
        bytes_field(&mut summary, 1, &value);
        let mut event = event_head(wall_time(), step);
        bytes_field(&mut event, 5, &summary);
        self.record(&event)
    }

    /// The scalars of a training step (see the module docs for the tags).
    pub fn step(&mut self, r: &StepRecord) -> std::io::Result<()> {
        let mut v: Vec<(String, f64)> = Vec::new();
        let mut put = |tag: &str, x: Option<f64>| {
            if let Some(x) = x {
                v.push((tag.to_string(), x));
            }
        };
        put("train/loss", r.loss);
        put("train/accuracy", r.accuracy);
        put("train/lr", r.lr);
        if let Some(name) = &r.ratio_name {
            put(&format!("train/{name}"), r.ratio);
        }
        put("train/bytes_sent", Some(r.bytes_sent as f64));
        put("train/payload_bytes", Some(r.payload_bytes as f64));
        for (name, x) in phases(&r.time) {
            put(&format!("time/{name}"), Some(x));
        }
        self.scalars(r.step, &v)
    }

    /// The scalars of an evaluation, at its step.
    pub fn eval(&mut self, e: &EvalRecord) -> std::io::Result<()> {
        let v: Vec<(String, f64)> = [
            ("eval/loss", e.loss),
            ("eval/accuracy", e.accuracy),
            ("eval/perplexity", e.perplexity),
        ]
        .into_iter()
        .filter_map(|(t, x)| x.map(|x| (t.to_string(), x)))
        .collect();
        self.scalars(e.step, &v)
    }

    /// Appends one TFRecord and flushes it to the file (so a live TensorBoard sees it).
    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(data.len() + 16);
        rec.extend_from_slice(&len);
        rec.extend_from_slice(&masked_crc(&len).to_le_bytes());
        rec.extend_from_slice(data);
        rec.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.file.write_all(&rec)?;
        self.file.flush()
    }
}

/// Each phase of [`Phases`] with its `metrics.jsonl` name — `in_flight_s` and `keep_s` only
/// when they are not zero, as `metrics.jsonl` writes them (time an exchange ran on its
/// background thread: Streaming DiLoCo's in-flight rounds; live membership's copy of the
/// state).
pub fn phases(p: &Phases) -> Vec<(&'static str, f64)> {
    let mut v = vec![
        ("data_s", p.data_s),
        ("forward_s", p.forward_s),
        ("backward_s", p.backward_s),
        ("compress_s", p.compress_s),
        ("communicate_s", p.communicate_s),
        ("decompress_s", p.decompress_s),
        ("wait_s", p.wait_s),
        ("sync_s", p.sync_s),
        ("optimizer_s", p.optimizer_s),
        ("step_s", p.step_s),
    ];
    if p.in_flight_s != 0.0 {
        v.push(("in_flight_s", p.in_flight_s));
    }
    if p.keep_s != 0.0 {
        v.push(("keep_s", p.keep_s));
    }
    v
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `Event { wall_time (1, double), step (2, int64) }`.
fn event_head(wall_time: f64, step: u64) -> Vec<u8> {
    let mut e = vec![(1 << 3) | 1];
    e.extend_from_slice(&wall_time.to_le_bytes());
    e.push(2 << 3);
    varint(&mut e, step);
    e
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn string_field(out: &mut Vec<u8>, field: u64, s: &str) {
    bytes_field(out, field, s.as_bytes());
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78).
fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ b as u32) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masked CRC: rotated right by 15 and offset, so that a CRC of data holding
/// CRCs is not degenerate.
fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xA282_EAD8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC catalogue's check value of CRC-32C over "123456789".
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn records_are_framed_and_checksummed() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(300, &[("train/loss".into(), 0.5)]).unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let mut at = 0;
        let mut events = Vec::new();
        while at < bytes.len() {
            let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(len_crc, masked_crc(&bytes[at..at + 8]));
            let data = &bytes[at + 12..at + 12 + len];
            let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc(data));
            events.push(data.to_vec());
            at += 16 + len;
        }
        assert_eq!(events.len(), 2);
        assert!(events[0].ends_with(b"\x1a\x0dbrain.Event:2"));
        // step 300 as a varint, then the summary with the float 0.5.
        assert_eq!(&events[1][9..12], &[0x10, 0xAC, 0x02]);
        assert!(events[1].ends_with(&[0x15, 0, 0, 0, 0x3F]));
    }

    #[test]
    fn phases_name_every_field_and_in_flight_time_only_when_it_ran() {
        // Every phase the record serialises, under the same name, so that the TensorBoard
        // series and `metrics.jsonl` agree (the interop check compares them point by point).
        let mut p = Phases {
            step_s: 0.5,
            ..Phases::default()
        };
        let names = |p: &Phases| phases(p).iter().map(|&(n, _)| n).collect::<Vec<_>>();
        let json = |p: &Phases| {
            let v = serde_json::to_value(p).unwrap();
            let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            k.sort();
            k
        };
        let sorted = |mut v: Vec<&str>| {
            v.sort_unstable();
            v.into_iter().map(String::from).collect::<Vec<_>>()
        };
        assert_eq!(sorted(names(&p)), json(&p));
        assert!(!names(&p).contains(&"in_flight_s"));
        p.in_flight_s = 0.25;
        assert_eq!(sorted(names(&p)), json(&p));
        assert!(phases(&p).contains(&("in_flight_s", 0.25)));
        assert!(!names(&p).contains(&"keep_s"));
        p.keep_s = 0.125;
        assert_eq!(sorted(names(&p)), json(&p));
        assert!(phases(&p).contains(&("keep_s", 0.125)));
    }
}
