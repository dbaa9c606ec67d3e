//! Text in: a Hugging Face `tokenizers` tokenizer and the special tokens poslab needs from it.

use std::path::Path;

use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::{Error, Result};

/// Special tokens of the built-in word-level tokenizers, in id order.
pub const PAD: &str = "[PAD]";
pub const UNK: &str = "[UNK]";
pub const CLS: &str = "[CLS]";
pub const SEP: &str = "[SEP]";
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
    pub ids: Vec<u32>,
    pub word_ids: Vec<Option<u32>>,
}

fn first_present(tok: &Tokenizer, names: &[&str]) -> Option<u32> {
    names.iter().find_map(|n| tok.token_to_id(n))
}

impl TextTokenizer {
    /// Wraps a tokenizer; it must have a padding token.
    pub fn new(inner: Tokenizer) -> Result<Self> {
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
        tok.with_pre_tokenizer(Some(WhitespaceSplit));
        tok.add_special_tokens(specials.iter().map(|s| AddedToken::from(*s, true)))
            .map_err(|e| Error::Input(format!("cannot add special tokens: {e}")))?;
        Self::new(tok)
    }

    /// Loads a `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
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

    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// Number of ids, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn pad_id(&self) -> u32 {
        self.pad
    }

    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }

    pub fn cls_id(&self) -> Option<u32> {
        self.cls
    }

    pub fn mask_id(&self) -> Option<u32> {
        self.mask
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Token ids of `text`, without added special tokens, and each token's word index.
    pub fn encode(&self, text: &str) -> Result<Encoded> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Input(format!("cannot tokenize {text:?}: {e}")))?;
        Ok(Encoded {
            ids: enc.get_ids().to_vec(),
            word_ids: enc.get_word_ids().to_vec(),
        })
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
