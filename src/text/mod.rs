//! Text in: a Hugging Face `tokenizers` tokenizer and the special tokens poslab needs from it.
//!
//! A tokenizer comes from a [`TokenizerSpec`]: a word-level vocabulary built from the data, a
//! `tokenizer.json` on disk, one from the Hugging Face Hub ([`hub`]), or WordPiece / BPE trained
//! on the training texts. Text is split on whitespace into words first and encoded as
//! pre-tokenized input, so per-word labels align with tokens whatever the tokenizer does inside
//! a word.

pub mod hub;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::models::wordpiece::{WordPiece, WordPieceTrainer};
use tokenizers::models::{ModelWrapper, TrainerWrapper};
use tokenizers::normalizers::{BertNormalizer, Lowercase};
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::{Error, Result};
pub use hub::{HubSource, RepoRef};

/// Special tokens of the built-in word-level tokenizers, in id order.
pub const PAD: &str = "[PAD]";
/// The unknown token.
pub const UNK: &str = "[UNK]";
/// The classification token, first in a sequence.
pub const CLS: &str = "[CLS]";
/// The separator token.
pub const SEP: &str = "[SEP]";
/// The mask token of MLM.
pub const MASK: &str = "[MASK]";

/// A tokenizer and the ids of its special tokens, looked up by name in the tokenizer itself
/// (BERT's `[PAD]`, RoBERTa's `<pad>`, ...), never hard-coded.
#[derive(Clone, Debug)]
pub struct TextTokenizer {
    inner: Tokenizer,
    pad: u32,
    unk: Option<u32>,
    cls: Option<u32>,
    mask: Option<u32>,
}

/// A text's token ids and, for each token, the index of the whitespace-separated word it came
/// from (`None` for tokens no word produced).
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    /// The token ids.
    pub ids: Vec<u32>,
    /// Each token's word index.
    pub word_ids: Vec<Option<u32>>,
}

impl From<tokenizers::Encoding> for Encoded {
    fn from(enc: tokenizers::Encoding) -> Self {
        Self {
            ids: enc.get_ids().to_vec(),
            word_ids: enc.get_word_ids().to_vec(),
        }
    }
}

fn first_present(tok: &Tokenizer, names: &[&str]) -> Option<u32> {
    names.iter().find_map(|n| tok.token_to_id(n))
}

fn default_min_frequency() -> usize {
    1
}
fn default_subword_min_frequency() -> u64 {
    2
}
fn default_true() -> bool {
    true
}

/// Which subword model to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SubwordModel {
    /// BERT's WordPiece, with BERT's normalizer and pre-tokenizer.
    Wordpiece,
    /// Byte-pair encoding over whitespace- and punctuation-split words.
    Bpe,
}

/// Where a task's tokenizer comes from, `tokenizer = { kind = ..., ... }` in a task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TokenizerSpec {
    /// One id per whitespace-separated word: a built-in task's own vocabulary, or the training
    /// texts' words seen at least `min_frequency` times, most frequent first, at most
    /// `max_vocab` of them (the rest map to `[UNK]`).
    WordLevel {
        /// Words seen fewer times in training get `[UNK]` (default 1).
        #[serde(default = "default_min_frequency")]
        min_frequency: usize,
        /// The most words kept, most frequent first.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_vocab: Option<usize>,
        /// Whether words are lowercased first (default false).
        #[serde(default)]
        lowercase: bool,
    },
    /// A `tokenizer.json` file.
    File {
        /// The file.
        path: PathBuf,
    },
    /// `tokenizer.json` of a Hub model: `org/name` or `org/name@revision`.
    Hub {
        /// `org/name` or `org/name@revision`.
        repo: String,
    },
    /// A subword tokenizer trained on the training texts (saved with every run).
    Train {
        /// The subword algorithm.
        model: SubwordModel,
        /// The vocabulary size to train to.
        vocab_size: usize,
        /// Pairs or pieces seen fewer times are not merged (default 2).
        #[serde(default = "default_subword_min_frequency")]
        min_frequency: u64,
        /// Whether texts are lowercased first (default true).
        #[serde(default = "default_true")]
        lowercase: bool,
    },
}

impl Default for TokenizerSpec {
    fn default() -> Self {
        Self::WordLevel {
            min_frequency: 1,
            max_vocab: None,
            lowercase: false,
        }
    }
}

impl TokenizerSpec {
    /// Checks the options; the error names the bad one.
    pub fn validate(&self) -> Result<()> {
        match self {
            Self::WordLevel {
                min_frequency: 0, ..
            } => Err(Error::Config(
                "tokenizer: min_frequency must be at least 1".into(),
            )),
            Self::WordLevel {
                max_vocab: Some(0), ..
            } => Err(Error::Config(
                "tokenizer: max_vocab must be at least 1".into(),
            )),
            Self::Hub { repo } => RepoRef::parse(repo).map(|_| ()),
            Self::Train { vocab_size, .. } if *vocab_size < 16 => Err(Error::Config(format!(
                "tokenizer: vocab_size = {vocab_size} is too small to train a subword tokenizer \
                 (use at least 16; a few thousand is usual)"
            ))),
            _ => Ok(()),
        }
    }

    /// Builds the tokenizer. `vocabulary` is a built-in task's own word list (used by
    /// `word_level` instead of counting); `texts` are the training texts as words.
    pub fn build(
        &self,
        vocabulary: Option<&[String]>,
        texts: &[Vec<String>],
        hub: &HubSource,
    ) -> Result<TextTokenizer> {
        self.validate()?;
        match self {
            Self::WordLevel {
                min_frequency,
                max_vocab,
                lowercase,
            } => {
                // A task's own vocabulary is split on whitespace only (its words are whole, like
                // "twenty-one"); words counted from a user's texts have punctuation split off,
                // so "Kemal." is "Kemal" and ".", not one unknown word.
                match vocabulary {
                    Some(v) => TextTokenizer::word_level_with(v.to_vec(), *lowercase),
                    None => TextTokenizer::word_level_split(
                        count_words(texts, *lowercase, *min_frequency, *max_vocab),
                        *lowercase,
                    ),
                }
            }
            Self::File { path } => TextTokenizer::from_file(path),
            Self::Hub { repo } => {
                let repo = RepoRef::parse(repo)?;
                TextTokenizer::from_file(hub.fetch(&repo, "tokenizer.json")?)
            }
            Self::Train {
                model,
                vocab_size,
                min_frequency,
                lowercase,
            } => TextTokenizer::train(*model, *vocab_size, *min_frequency, *lowercase, texts),
        }
    }
}

/// A word split as BERT's pre-tokenizer splits it: every punctuation character its own piece
/// (`"Kemal."` is `"Kemal"`, `"."`), the rest kept together.
pub fn split_punctuation(word: &str) -> Vec<String> {
    use tokenizers::PreTokenizer as _;
    let mut pre = tokenizers::PreTokenizedString::from(word);
    match BertPreTokenizer.pre_tokenize(&mut pre) {
        Ok(()) => pre
            .get_splits(
                tokenizers::OffsetReferential::Original,
                tokenizers::OffsetType::Byte,
            )
            .into_iter()
            .map(|(s, _, _)| s.to_string())
            .collect(),
        Err(_) => vec![word.to_string()],
    }
}

/// Words of `texts` seen at least `min_frequency` times, most frequent first (ties in order of
/// first use), at most `max_vocab`.
fn count_words(
    texts: &[Vec<String>],
    lowercase: bool,
    min_frequency: usize,
    max_vocab: Option<usize>,
) -> Vec<String> {
    let mut counts: Vec<(String, usize)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    // The pieces the tokenizer will see: punctuation split off as BERT's pre-tokenizer does.
    let pieces = texts.iter().flatten().flat_map(|w| split_punctuation(w));
    for word in pieces {
        let word = if lowercase { word.to_lowercase() } else { word };
        let i = *index.entry(word.clone()).or_insert_with(|| {
            counts.push((word, 0));
            counts.len() - 1
        });
        counts[i].1 += 1;
    }
    counts.sort_by_key(|c| std::cmp::Reverse(c.1)); // stable: ties keep first use
    counts
        .into_iter()
        .filter(|c| c.1 >= min_frequency)
        .take(max_vocab.unwrap_or(usize::MAX))
        .map(|c| c.0)
        .collect()
}

impl TextTokenizer {
    /// Wraps a tokenizer; it must have a padding token. Truncation and padding configured in the
    /// tokenizer are turned off: poslab pads its own batches and never cuts text silently.
    pub fn new(mut inner: Tokenizer) -> Result<Self> {
        inner.with_truncation(None).map_err(|e| {
            Error::Input(format!("cannot turn off the tokenizer's truncation: {e}"))
        })?;
        inner.with_padding(None);
        let pad = first_present(&inner, &[PAD, "<pad>", "<|pad|>", "[pad]"]).ok_or_else(|| {
            Error::Input(
                "the tokenizer has no padding token ([PAD] or <pad>): add one to its \
                 special tokens"
                    .into(),
            )
        })?;
        Ok(Self {
            unk: first_present(&inner, &[UNK, "<unk>"]),
            cls: first_present(&inner, &[CLS, "<s>", "<cls>"]),
            mask: first_present(&inner, &[MASK, "<mask>"]),
            pad,
            inner,
        })
    }

    /// A word-level tokenizer over `words` (split on whitespace), with the special tokens
    /// `[PAD] [UNK] [CLS] [SEP] [MASK]` as ids 0..5 and the words after them in the given order.
    pub fn word_level<S: AsRef<str>>(words: impl IntoIterator<Item = S>) -> Result<Self> {
        Self::word_level_with(words, false)
    }

    /// As [`TextTokenizer::word_level`], lowercasing text first when asked.
    pub fn word_level_with<S: AsRef<str>>(
        words: impl IntoIterator<Item = S>,
        lowercase: bool,
    ) -> Result<Self> {
        Self::word_level_built(words, lowercase, false)
    }

    /// As [`TextTokenizer::word_level_with`], with punctuation split off words as BERT's
    /// pre-tokenizer does (the vocabulary must hold the pieces; see [`split_punctuation`]).
    pub fn word_level_split<S: AsRef<str>>(
        words: impl IntoIterator<Item = S>,
        lowercase: bool,
    ) -> Result<Self> {
        Self::word_level_built(words, lowercase, true)
    }

    fn word_level_built<S: AsRef<str>>(
        words: impl IntoIterator<Item = S>,
        lowercase: bool,
        split_punctuation: bool,
    ) -> Result<Self> {
        let specials = [PAD, UNK, CLS, SEP, MASK];
        let mut vocab = ahash::AHashMap::new();
        for (i, s) in specials.iter().enumerate() {
            vocab.insert(s.to_string(), i as u32);
        }
        for word in words {
            let word = word.as_ref();
            if word.is_empty() || word.chars().any(char::is_whitespace) {
                return Err(Error::Input(format!(
                    "vocabulary entry {word:?} is empty or contains whitespace"
                )));
            }
            let next = vocab.len() as u32;
            vocab.entry(word.to_string()).or_insert(next);
        }
        let model = WordLevel::builder()
            .vocab(vocab)
            .unk_token(UNK.into())
            .build()
            .map_err(|e| Error::Input(format!("cannot build a word-level tokenizer: {e}")))?;
        let mut tok = Tokenizer::new(model);
        if split_punctuation {
            tok.with_pre_tokenizer(Some(BertPreTokenizer));
        } else {
            tok.with_pre_tokenizer(Some(WhitespaceSplit));
        }
        if lowercase {
            tok.with_normalizer(Some(Lowercase))
                .map_err(|e| Error::Input(format!("cannot set the normalizer: {e}")))?;
        }
        tok.add_special_tokens(specials.iter().map(|s| AddedToken::from(*s, true)))
            .map_err(|e| Error::Input(format!("cannot add special tokens: {e}")))?;
        Self::new(tok)
    }

    /// WordPiece or BPE trained on `texts`, with the special tokens `[PAD] [UNK] [CLS] [SEP]
    /// [MASK]` first. Training is deterministic for the same texts.
    pub fn train(
        model: SubwordModel,
        vocab_size: usize,
        min_frequency: u64,
        lowercase: bool,
        texts: &[Vec<String>],
    ) -> Result<Self> {
        let specials: Vec<AddedToken> = [PAD, UNK, CLS, SEP, MASK]
            .iter()
            .map(|s| AddedToken::from(*s, true))
            .collect();
        let fail = |e: tokenizers::Error| Error::Input(format!("cannot train the tokenizer: {e}"));
        let (model_w, mut trainer): (ModelWrapper, TrainerWrapper) = match model {
            SubwordModel::Wordpiece => (
                WordPiece::builder()
                    .unk_token(UNK.into())
                    .build()
                    .map_err(fail)?
                    .into(),
                WordPieceTrainer::builder()
                    .vocab_size(vocab_size)
                    .min_frequency(min_frequency)
                    .special_tokens(specials)
                    .show_progress(false)
                    .build()
                    .into(),
            ),
            SubwordModel::Bpe => (
                BPE::builder()
                    .unk_token(UNK.into())
                    .build()
                    .map_err(fail)?
                    .into(),
                BpeTrainer::builder()
                    .vocab_size(vocab_size)
                    .min_frequency(min_frequency)
                    .special_tokens(specials)
                    .show_progress(false)
                    .build()
                    .into(),
            ),
        };
        let mut tok = Tokenizer::new(model_w);
        tok.with_normalizer(Some(BertNormalizer::new(
            true,
            true,
            Some(lowercase),
            lowercase,
        )))
        .map_err(fail)?;
        tok.with_pre_tokenizer(Some(BertPreTokenizer));
        let lines: Vec<String> = texts.iter().map(|w| w.join(" ")).collect();
        tok.train(&mut trainer, lines.iter()).map_err(fail)?;
        Self::new(tok)
    }

    /// Loads a `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = crate::io::read_bounded(path, crate::io::MAX_CONFIG_BYTES, "tokenizer")?;
        let inner = Tokenizer::from_bytes(&bytes).map_err(|e| {
            Error::Input(format!(
            "{}: not a valid tokenizer.json ({e}); re-save it from the `tokenizers` library or \
             point to the right file",
            path.display()
        ))
        })?;
        Self::new(inner)
    }

    /// Writes `tokenizer.json`, atomically.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let json = self
            .inner
            .to_string(true)
            .map_err(|e| Error::Input(format!("cannot serialize the tokenizer: {e}")))?;
        crate::io::write_atomic(path.as_ref(), json.as_bytes())
    }

    /// The `tokenizers` tokenizer inside.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// Number of ids, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The padding token's id.
    pub fn pad_id(&self) -> u32 {
        self.pad
    }

    /// The unknown token's id, if the tokenizer has one.
    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }

    /// The classification token's id (`[CLS]`, `<s>`), if there is one.
    pub fn cls_id(&self) -> Option<u32> {
        self.cls
    }

    /// The mask token's id (`[MASK]`, `<mask>`), if there is one.
    pub fn mask_id(&self) -> Option<u32> {
        self.mask
    }

    /// The id of `token`, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token of `id`, if the vocabulary has it.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Token ids of `text` split on whitespace, without added special tokens, and each token's
    /// word index.
    pub fn encode(&self, text: &str) -> Result<Encoded> {
        let words: Vec<&str> = text.split_whitespace().collect();
        self.encode_words(&words)
    }

    /// Token ids of `text` as the tokenizer's own pipeline makes them for its model: its
    /// normalizer and pre-tokenizer, and its template's special tokens (`[CLS] ... [SEP]`,
    /// `<s> ... </s>`): what transformers' tokenizer gives a pretrained encoder.
    /// `word_ids` are the tokenizer's words (its pre-tokenizer's pieces), `None` for the
    /// special tokens.
    pub fn encode_with_specials(&self, text: &str) -> Result<Encoded> {
        self.inner
            .encode(text, true)
            .map(Encoded::from)
            .map_err(|e| Error::Input(format!("cannot tokenize {:?}: {e}", quote(text))))
    }

    /// [`TextTokenizer::encode_with_specials`] reading no more of `text` than `max` tokens
    /// need: growing prefixes, cut at whitespace so no word is split, until one holds more than
    /// `max` tokens or the text ends (or the prefix reaches 1 KiB per token: no text needs
    /// more). A 100 MB line costs about what `max` tokens do. Returns the encoding, whose first
    /// `max` tokens are those of the whole text, and whether it is the whole text's.
    pub fn encode_with_specials_at_most(&self, text: &str, max: usize) -> Result<(Encoded, bool)> {
        let cap = max.saturating_mul(1024).max(1 << 20);
        let mut len = max.saturating_mul(16).max(4096);
        loop {
            if len >= text.len() {
                return Ok((self.encode_with_specials(text)?, true));
            }
            let mut end = len.min(cap);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            let cut = text[..end]
                .rfind(char::is_whitespace)
                .filter(|&i| i > 0)
                .unwrap_or(end);
            let e = self.encode_with_specials(&text[..cut])?;
            if e.ids.len() > max || len >= cap {
                return Ok((e, false));
            }
            len = len.saturating_mul(2);
        }
    }

    /// Token ids of pre-split `words`; `word_ids` index `words`.
    pub fn encode_words<S: AsRef<str>>(&self, words: &[S]) -> Result<Encoded> {
        self.encode_pretokenized(words, false)
    }

    /// As [`TextTokenizer::encode_words`], framed by the tokenizer's template's special tokens
    /// (`[CLS] ... [SEP]`), whose `word_ids` are `None`.
    pub fn encode_words_with_specials<S: AsRef<str>>(&self, words: &[S]) -> Result<Encoded> {
        self.encode_pretokenized(words, true)
    }

    /// The token type of each token of a one-word text framed by the template: what a BERT
    /// reads as its segment.
    pub fn single_text_type_ids(&self) -> Result<Vec<u32>> {
        self.inner
            .encode(["a"].as_slice(), true)
            .map(|e| e.get_type_ids().to_vec())
            .map_err(|e| Error::Input(format!("cannot tokenize a one-word text: {e}")))
    }

    fn encode_pretokenized<S: AsRef<str>>(&self, words: &[S], specials: bool) -> Result<Encoded> {
        let words: Vec<&str> = words.iter().map(AsRef::as_ref).collect();
        self.inner
            .encode(words.as_slice(), specials)
            .map(Encoded::from)
            .map_err(|e| {
                let text = words.iter().take(20).copied().collect::<Vec<_>>().join(" ");
                Error::Input(format!("cannot tokenize {:?}: {e}", quote(&text)))
            })
    }

    /// The text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Input(format!("cannot decode {ids:?}: {e}")))
    }
}

/// The first 60 characters of `text`, for a message (`...` when there are more).
fn quote(text: &str) -> String {
    match text.char_indices().nth(60) {
        Some((i, _)) => format!("{}...", &text[..i]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_level_round_trips_through_tokenizer_json() {
        let tok = TextTokenizer::word_level(["the", "fox", "dog", "fox"]).unwrap();
        assert_eq!(tok.vocab_size(), 5 + 3);
        assert_eq!(
            (tok.pad_id(), tok.unk_id(), tok.cls_id(), tok.mask_id()),
            (0, Some(1), Some(2), Some(4))
        );
        let enc = tok.encode("the fox  chased the dog").unwrap();
        assert_eq!(enc.ids, vec![5, 6, 1, 5, 7]);
        assert_eq!(
            enc.word_ids,
            vec![Some(0), Some(1), Some(2), Some(3), Some(4)]
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        tok.save(&path).unwrap();
        let back = TextTokenizer::from_file(&path).unwrap();
        assert_eq!(back.encode("the fox chased the dog").unwrap(), enc);
        assert_eq!(back.token_to_id(MASK), Some(4));
    }

    #[test]
    fn broken_tokenizer_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, "{\"model\": 3}").unwrap();
        let err = TextTokenizer::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("not a valid tokenizer.json"), "{err}");
    }
}
