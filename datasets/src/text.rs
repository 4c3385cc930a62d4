//! Text corpora for language models: character- or word-level vocabularies, token-id
//! streams, and truncated-BPTT batching with carried position.
//!
//! Word level follows the Penn Treebank convention: words are split on whitespace and
//! every line ends with an `<eos>` token. Id 0 is always the unknown token (`<unk>` for
//! words, U+FFFD for characters), so text with unseen tokens still encodes.

use std::collections::HashMap;
use std::path::Path;

use crate::error::{read_file, DataError, Result};

/// Tokenisation granularity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Level {
    /// One token per Unicode scalar value (newlines included).
    Char,
    /// Whitespace-separated words, plus `<eos>` at each line end.
    Word,
}

/// The unknown word.
pub const UNK: &str = "<unk>";
/// The end-of-line token of word-level corpora.
pub const EOS: &str = "<eos>";

/// A token ↔ id mapping, built from a text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vocab {
    level: Level,
    tokens: Vec<String>,
    index: HashMap<String, u32>,
}

fn tokens_of(text: &str, level: Level) -> Box<dyn Iterator<Item = &str> + '_> {
    match level {
        Level::Char => Box::new(
            text.char_indices()
                .map(move |(i, c)| &text[i..i + c.len_utf8()]),
        ),
        Level::Word => Box::new(
            text.lines()
                .flat_map(|l| l.split_whitespace().chain(std::iter::once(EOS))),
        ),
    }
}

impl Vocab {
    /// Builds a vocabulary from `text`. Tokens seen fewer than `min_count` times map to
    /// the unknown id; `max_size` (if any) keeps only the most frequent tokens (counting
    /// the reserved ones). Order: reserved tokens, then by decreasing count, ties broken
    /// by the token's bytes, so the same text always gives the same ids.
    pub fn build(text: &str, level: Level, min_count: usize, max_size: Option<usize>) -> Self {
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for t in tokens_of(text, level) {
            *counts.entry(t).or_default() += 1;
        }
        let reserved: Vec<&str> = match level {
            Level::Char => vec!["\u{fffd}"],
            Level::Word => vec![UNK, EOS],
        };
        let mut by_count: Vec<(&str, usize)> = counts
            .into_iter()
            .filter(|(t, c)| *c >= min_count.max(1) && !reserved.contains(t))
            .collect();
        by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        let mut tokens: Vec<String> = reserved.iter().map(|s| s.to_string()).collect();
        tokens.extend(by_count.into_iter().map(|(t, _)| t.to_string()));
        if let Some(m) = max_size {
            tokens.truncate(m.max(reserved.len()));
        }
        let index = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        Self {
            level,
            tokens,
            index,
        }
    }

    /// The granularity.
    pub fn level(&self) -> Level {
        self.level
    }

    /// Number of tokens, including the reserved ones.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Never true: the unknown token is always present.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The id of `token`, if it is in the vocabulary.
    pub fn id(&self, token: &str) -> Option<u32> {
        self.index.get(token).copied()
    }

    /// The token of `id`, if any.
    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(|s| s.as_str())
    }

    /// Encodes `text`; unseen tokens become id 0.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        tokens_of(text, self.level)
            .map(|t| self.id(t).unwrap_or(0))
            .collect()
    }

    /// Decodes ids back to text (words joined by spaces, `<eos>` as a newline).
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut out = String::new();
        for &id in ids {
            let t = self.token(id).unwrap_or(match self.level {
                Level::Char => "\u{fffd}",
                Level::Word => UNK,
            });
            match self.level {
                Level::Char => out.push_str(t),
                Level::Word if t == EOS => out.push('\n'),
                Level::Word => {
                    if !out.is_empty() && !out.ends_with('\n') {
                        out.push(' ');
                    }
                    out.push_str(t);
                }
            }
        }
        out
    }
}

/// A text encoded with its vocabulary.
#[derive(Debug, Clone)]
pub struct Corpus {
    /// The vocabulary built from the text.
    pub vocab: Vocab,
    /// The whole text as token ids.
    pub ids: Vec<u32>,
}

impl Corpus {
    /// Builds the vocabulary (every token seen at least `min_count` times) and encodes `text`.
    pub fn from_text(text: &str, level: Level, min_count: usize) -> Self {
        let vocab = Vocab::build(text, level, min_count, None);
        let ids = vocab.encode(text);
        Self { vocab, ids }
    }

    /// Reads a UTF-8 text file (an error names the file and the byte offset of invalid UTF-8).
    pub fn from_file(path: impl AsRef<Path>, level: Level, min_count: usize) -> Result<Self> {
        let path = path.as_ref();
        let text = read_text(path)?;
        if text.trim().is_empty() {
            return Err(DataError::format(path, "empty text corpus"));
        }
        Ok(Self::from_text(&text, level, min_count))
    }

    /// Splits the id stream into consecutive train / validation / test parts with the
    /// given fractions for validation and test (e.g. `0.05, 0.05`).
    ///
    /// # Panics
    /// Panics unless `0 <= valid`, `0 <= test` and `valid + test < 1`.
    pub fn split(&self, valid: f64, test: f64) -> (&[u32], &[u32], &[u32]) {
        assert!(
            valid >= 0.0 && test >= 0.0 && valid + test < 1.0,
            "bad split fractions"
        );
        let n = self.ids.len();
        let n_test = (n as f64 * test) as usize;
        let n_valid = (n as f64 * valid) as usize;
        let a = n - n_test - n_valid;
        (
            &self.ids[..a],
            &self.ids[a..a + n_valid],
            &self.ids[a + n_valid..],
        )
    }
}

/// Reads a UTF-8 file, naming it in any error.
pub fn read_text(path: &Path) -> Result<String> {
    String::from_utf8(read_file(path)?).map_err(|e| {
        DataError::format(
            path,
            format!("not UTF-8 (at byte {})", e.utf8_error().valid_up_to()),
        )
    })
}

/// The contiguous part of a token stream that `rank` of `world_size` trains on: the
/// stream is cut into `world_size` equal consecutive pieces (the remainder, fewer than
/// `world_size` tokens, is dropped), so pieces are disjoint and equally long.
///
/// # Panics
/// Panics if `world_size == 0` or `rank >= world_size`.
pub fn shard_tokens(ids: &[u32], rank: usize, world_size: usize) -> &[u32] {
    assert!(rank < world_size, "rank {rank} >= world_size {world_size}");
    let per = ids.len() / world_size;
    &ids[rank * per..(rank + 1) * per]
}

/// One truncated-BPTT batch, batch-major: element `[b][t]` is at `b * seq_len + t`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BpttBatch {
    /// Input ids, `[batch, seq_len]`.
    pub inputs: Vec<u32>,
    /// Next-token targets, `[batch, seq_len]`: `targets[b][t]` follows `inputs[b][t]`.
    pub targets: Vec<u32>,
    /// Rows (parallel streams).
    pub batch: usize,
    /// Time steps in this batch (the last batch of an epoch may be shorter).
    pub seq_len: usize,
    /// True for the first batch of an epoch: the model should reset its hidden state.
    pub first: bool,
}

/// Truncated-BPTT batcher: the stream is cut into `batch` equal consecutive rows (as in
/// the classic `batchify`), and successive batches walk along the rows, so row `b` of
/// one batch continues exactly where row `b` of the previous batch stopped. The hidden
/// state can therefore be carried (detached) from batch to batch.
#[derive(Debug, Clone)]
pub struct Bptt {
    rows: Vec<u32>,
    batch: usize,
    row_len: usize,
    seq_len: usize,
    pos: usize,
}

impl Bptt {
    /// A batcher over `ids` with `batch` rows and up to `seq_len` steps per batch.
    ///
    /// Errors when the stream is too short to give every row at least two tokens.
    ///
    /// # Panics
    /// Panics if `batch == 0` or `seq_len == 0`.
    pub fn new(ids: &[u32], batch: usize, seq_len: usize) -> Result<Self> {
        assert!(
            batch > 0 && seq_len > 0,
            "batch and seq_len must be positive"
        );
        let row_len = ids.len() / batch;
        if row_len < 2 {
            return Err(DataError::Invalid(format!(
                "BPTT: {} tokens cannot fill {batch} rows of at least 2 tokens",
                ids.len()
            )));
        }
        Ok(Self {
            rows: ids[..row_len * batch].to_vec(),
            batch,
            row_len,
            seq_len,
            pos: 0,
        })
    }

    /// Batches per epoch.
    pub fn num_batches(&self) -> usize {
        (self.row_len - 1).div_ceil(self.seq_len)
    }

    /// The current position along the rows (tokens consumed this epoch per row).
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Starts a new epoch.
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// The next batch of this epoch, or `None` when the rows are used up.
    pub fn next_batch(&mut self) -> Option<BpttBatch> {
        if self.pos + 1 >= self.row_len {
            return None;
        }
        let seq = self.seq_len.min(self.row_len - 1 - self.pos);
        let mut inputs = Vec::with_capacity(self.batch * seq);
        let mut targets = Vec::with_capacity(self.batch * seq);
        for b in 0..self.batch {
            let row = &self.rows[b * self.row_len..(b + 1) * self.row_len];
            inputs.extend_from_slice(&row[self.pos..self.pos + seq]);
            targets.extend_from_slice(&row[self.pos + 1..self.pos + 1 + seq]);
        }
        let first = self.pos == 0;
        self.pos += seq;
        Some(BpttBatch {
            inputs,
            targets,
            batch: self.batch,
            seq_len: seq,
            first,
        })
    }
}

impl Iterator for Bptt {
    type Item = BpttBatch;

    fn next(&mut self) -> Option<BpttBatch> {
        self.next_batch()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_vocab_is_deterministic_and_round_trips() {
        let text = "the cat sat\non the mat\nthe end\n";
        let c = Corpus::from_text(text, Level::Word, 1);
        assert_eq!(c.vocab.token(0), Some(UNK));
        assert_eq!(c.vocab.token(1), Some(EOS));
        assert_eq!(c.vocab.token(2), Some("the")); // most frequent
        assert_eq!(c.ids.len(), 8 + 3);
        assert_eq!(c.vocab.decode(&c.ids), text);
        assert_eq!(c.vocab.encode("the dog"), vec![2, 0, 1]);
        let c2 = Corpus::from_text(text, Level::Word, 2);
        assert_eq!(c2.vocab.len(), 3); // <unk>, <eos>, the
    }

    #[test]
    fn char_vocab() {
        let c = Corpus::from_text("abca\né", Level::Char, 1);
        assert_eq!(c.vocab.token(1), Some("a"));
        assert_eq!(c.ids.len(), 6);
        assert_eq!(c.vocab.decode(&c.ids), "abca\né");
        assert_eq!(c.vocab.encode("z")[0], 0);
    }

    #[test]
    fn bptt_shapes_and_continuity() {
        let ids: Vec<u32> = (0..103).collect();
        let mut b = Bptt::new(&ids, 4, 7).unwrap();
        // 103 / 4 = 25 tokens per row; 24 prediction steps → 7 + 7 + 7 + 3.
        assert_eq!(b.num_batches(), 4);
        let batches: Vec<BpttBatch> = b.by_ref().collect();
        assert_eq!(batches.len(), 4);
        assert_eq!(
            batches.iter().map(|x| x.seq_len).collect::<Vec<_>>(),
            [7, 7, 7, 3]
        );
        assert!(batches[0].first && !batches[1].first);
        for x in &batches {
            assert_eq!(x.inputs.len(), x.batch * x.seq_len);
            assert_eq!(x.targets.len(), x.batch * x.seq_len);
            for r in 0..4 {
                for t in 0..x.seq_len {
                    // Targets are the next token of the same row.
                    assert_eq!(
                        x.targets[r * x.seq_len + t],
                        x.inputs[r * x.seq_len + t] + 1
                    );
                }
            }
        }
        for w in batches.windows(2) {
            for r in 0..4 {
                let last_target = w[0].targets[r * w[0].seq_len + w[0].seq_len - 1];
                assert_eq!(w[1].inputs[r * w[1].seq_len], last_target);
            }
        }
        // Row starts: 0, 25, 50, 75; every input token of the epoch appears once.
        assert_eq!(batches[0].inputs[7], 25);
        let mut seen: Vec<u32> = batches.iter().flat_map(|x| x.inputs.clone()).collect();
        seen.sort();
        let expected: Vec<u32> = (0..4).flat_map(|r| r * 25..r * 25 + 24).collect();
        assert_eq!(seen, expected);
        assert!(b.next_batch().is_none());
        b.reset();
        assert_eq!(b.next_batch().unwrap(), batches[0]);
        assert!(Bptt::new(&ids[..7], 4, 3).is_err());
    }

    #[test]
    fn token_shards_are_disjoint_and_equal() {
        let ids: Vec<u32> = (0..10).collect();
        assert_eq!(shard_tokens(&ids, 0, 3), &[0, 1, 2]);
        assert_eq!(shard_tokens(&ids, 2, 3), &[6, 7, 8]);
    }

    #[test]
    fn invalid_utf8_names_the_file() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("bad.txt");
        std::fs::write(&p, b"ok \xff\xfe").unwrap();
        let e = Corpus::from_file(&p, Level::Char, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad.txt: not UTF-8 (at byte 3)"), "{e}");
        std::fs::write(&p, b"  \n").unwrap();
        assert!(Corpus::from_file(&p, Level::Word, 1).is_err());
    }
}
