//! `lm`: next-token prediction, the decoder's task, on a generated corpus or on the user's
//! text file. Valid only in a causal model (`[model] causal = true`): without the mask each
//! position reads the token it is asked for.
//!
//! # The corpus
//! A document is a run of `word_order` sentences ([`grammar`]), each of 5 to 12 words (drawn
//! uniformly) and closed by `.`, cut to the example's length plus one. Its sentences draw their
//! two entities from a cast of `cast` of the eight, chosen per document: which entities come
//! next is predictable only from the document's earlier sentences, so a model that reads its
//! context lowers its perplexity as the document goes on. Within a sentence the grammar binds
//! the words to each other (a passive's `was` then its participle then `by`; an adjective
//! before its noun), and its position in the sentence decides what can come.
//!
//! # The tape
//! An example of length `L` is the document's first `L` words, each labelled with the word
//! after it ([`Label::Outputs`] with every position an output): the loss and the accuracy
//! cover all `L`, and the scores come by length like the length suite's. Perplexity is the
//! exponential of the loss: at the training lengths and, on the test sets at 2x and 4x them,
//! past them, the standard extrapolation curve.
//!
//! # A text file
//! With `text_file`, the tapes are windows of the file's words ([`Corpus`]): one document per
//! line, each closed by [`DOCUMENT_END`], punctuation split off as the word-level tokenizer
//! splits it. The words in file order are cut into a training part (the first 80%), a
//! validation part (the next 10%) and a test part (the last 10%), the standard contiguous split
//! of a language-modelling corpus; every window lies within one part, so no test word was ever
//! a training target. The labels are the training part's words (those the tokenizer's
//! `min_frequency` and `max_vocab` keep, most frequent first), then [`DOCUMENT_END`], then
//! `[UNK]`, which every other word is predicted as.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::seq::index::sample;
use rand::Rng as _;
use serde::{Deserialize, Serialize};

use super::files::{read_records, DataFormat, RecordKind, Source};
use super::{
    grammar, Example, Generator, Label, Objective, Part, Splits, TaskSpec, MAX_TASK_VOCABULARY,
};
use crate::error::{Error, Result};
use crate::rng::Rng;
use crate::text::{split_punctuation, TextTokenizer, TokenizerSpec, SEP, UNK};

/// The word that closes a sentence.
pub const STOP: &str = ".";

/// The shortest and longest sentence of the corpus, in words (without its `.`).
const SENTENCE_WORDS: [usize; 2] = [grammar::SHORTEST, 12];

fn default_cast() -> usize {
    3
}

/// Next-token prediction on generated documents (see the module).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lm {
    /// The entities a document's sentences draw from, 2 to 8 (default 3).
    #[serde(default = "default_cast")]
    pub cast: usize,
    /// A text file to model instead of the generated corpus: one document per line (see the
    /// module).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_file: Option<PathBuf>,
}

impl Default for Lm {
    fn default() -> Self {
        Self {
            cast: default_cast(),
            text_file: None,
        }
    }
}

impl Lm {
    /// The first `n` words of a document.
    pub fn document(&self, rng: &mut Rng, n: usize) -> Vec<&'static str> {
        let mut cast: Vec<usize> = sample(rng, grammar::ENTITIES.len(), self.cast).into_vec();
        cast.sort_unstable();
        let mut words = Vec::with_capacity(n + SENTENCE_WORDS[1] + 1);
        while words.len() < n {
            let len = rng.random_range(SENTENCE_WORDS[0]..=SENTENCE_WORDS[1]);
            words.extend(grammar::sentence_among(rng, len, &cast).0);
            words.push(STOP);
        }
        words.truncate(n);
        words
    }

    /// Every word of the corpus, in a fixed order: the labels, and the vocabulary.
    fn words() -> Vec<String> {
        let mut words = grammar::vocabulary();
        words.push(STOP.into());
        words
    }
}

impl Generator for Lm {
    fn check(&self, shortest: usize, _longest: usize) -> std::result::Result<(), String> {
        if self.text_file.is_some() && self.cast != default_cast() {
            return Err(format!(
                "lm: cast = {} chooses the generated corpus's entities, and a text_file has its \
                 own words: remove cast, or text_file",
                self.cast
            ));
        }
        if !(2..=grammar::ENTITIES.len()).contains(&self.cast) {
            return Err(format!(
                "lm: cast = {} must be 2 to {} (the entities a document draws from)",
                self.cast,
                grammar::ENTITIES.len()
            ));
        }
        if shortest == 0 {
            return Err("lm: lengths start at 1: an example predicts at least one token".into());
        }
        Ok(())
    }

    fn objective(&self) -> (Objective, Vec<String>) {
        let words = Self::words();
        (
            Objective::Lm {
                labels: words.clone(),
            },
            words,
        )
    }

    fn example(&self, rng: &mut Rng, len: usize) -> Example {
        let words = self.document(rng, len + 1);
        let labels = Self::words();
        let index = |w: &str| {
            labels
                .iter()
                .position(|l| l == w)
                .expect("the corpus's words are its labels")
        };
        let targets = words[1..].iter().map(|w| index(w)).collect();
        Example::new(
            words[..len].iter().map(|w| w.to_string()).collect(),
            Label::Outputs {
                length: len,
                targets,
                counted: len,
            },
        )
    }
}

/// The word that closes each document of a text file: the tokenizer's separator, one token
/// whatever the tokenizer's other options.
pub const DOCUMENT_END: &str = SEP;

/// The share of a text file's words, in file order, that its training part and then its
/// validation part take; the test part is the rest.
const PARTS: [f64; 2] = [0.8, 0.1];

/// A text file read for next-token prediction: its words in file order, as ids into the
/// distinct words, each with its label and line, and the three parts (see the module).
pub struct Corpus {
    path: Arc<Path>,
    /// The distinct words, in order of first use.
    words: Vec<String>,
    /// The file's words as ids into `words`.
    stream: Vec<u32>,
    /// The line each word of `stream` is on.
    lines: Vec<u32>,
    /// Each distinct word's label (an index into `labels`).
    label_of: Vec<u32>,
    /// The label names: the kept words, [`DOCUMENT_END`], then `[UNK]`.
    labels: Vec<String>,
    /// The training, validation and test parts of `stream`.
    parts: [Range<usize>; 3],
}

impl Corpus {
    /// Reads `path` (one document per line), its words split as `tokenizer` splits a text, and
    /// keeps the labels `tokenizer`'s options choose from the training part.
    pub fn read(path: &Path, tokenizer: &TokenizerSpec) -> Result<Self> {
        let TokenizerSpec::WordLevel {
            min_frequency,
            max_vocab,
            lowercase,
        } = *tokenizer
        else {
            return Err(Error::Config(LM_TOKENIZER.into()));
        };
        let records = read_records(path, DataFormat::Text, RecordKind::Text, "text", "label")?;
        let mut ids = std::collections::HashMap::new();
        let mut corpus = Self {
            path: Arc::from(path),
            words: Vec::new(),
            stream: Vec::new(),
            lines: Vec::new(),
            label_of: Vec::new(),
            labels: Vec::new(),
            parts: [0..0, 0..0, 0..0],
        };
        let mut push = |corpus: &mut Self, word: String, line: usize| {
            let next = corpus.words.len() as u32;
            let id = *ids.entry(word).or_insert_with_key(|w| {
                corpus.words.push(w.clone());
                next
            });
            corpus.stream.push(id);
            corpus.lines.push(line.min(u32::MAX as usize) as u32);
        };
        for record in records {
            for word in &record.words {
                let word = if lowercase {
                    word.to_lowercase()
                } else {
                    word.clone()
                };
                if word.chars().all(char::is_alphanumeric) {
                    push(&mut corpus, word, record.source.line);
                } else {
                    for piece in split_punctuation(&word) {
                        push(&mut corpus, piece, record.source.line);
                    }
                }
            }
            push(&mut corpus, DOCUMENT_END.into(), record.source.line);
        }
        if corpus.words.len() > u32::MAX as usize / 2 {
            return Err(corpus.error("holds more distinct words than a task takes".into()));
        }
        let n = corpus.stream.len();
        let [train_end, valid_end] =
            [PARTS[0], PARTS[0] + PARTS[1]].map(|f| (n as f64 * f) as usize);
        corpus.parts = [0..train_end, train_end..valid_end, valid_end..n];
        corpus.keep_labels(min_frequency, max_vocab)?;
        Ok(corpus)
    }

    fn error(&self, message: String) -> Error {
        Error::Data {
            path: self.path.to_path_buf(),
            line: None,
            message,
        }
    }

    /// The labels: the training part's words seen at least `min_frequency` times, most frequent
    /// first (ties in order of first use), at most `max_vocab` of them; then [`DOCUMENT_END`]
    /// and `[UNK]`.
    fn keep_labels(&mut self, min_frequency: usize, max_vocab: Option<usize>) -> Result<()> {
        let mut counts = vec![0usize; self.words.len()];
        for &id in &self.stream[self.parts[0].clone()] {
            counts[id as usize] += 1;
        }
        let mut kept: Vec<usize> = (0..self.words.len())
            .filter(|&i| counts[i] >= min_frequency.max(1) && self.words[i] != DOCUMENT_END)
            .filter(|&i| self.words[i] != UNK)
            .collect();
        kept.sort_by_key(|&i| std::cmp::Reverse(counts[i])); // stable: ties keep first use
        kept.truncate(max_vocab.unwrap_or(usize::MAX));
        if kept.len() > MAX_TASK_VOCABULARY {
            return Err(self.error(format!(
                "its training part has {} distinct words, more labels than a task takes \
                 ({MAX_TASK_VOCABULARY}): set max_vocab (or raise min_frequency) in the task's \
                 tokenizer = {{ kind = \"word_level\", ... }}",
                kept.len()
            )));
        }
        let unknown = kept.len() as u32 + 1;
        self.label_of = vec![unknown; self.words.len()];
        for (label, &i) in kept.iter().enumerate() {
            self.label_of[i] = label as u32;
        }
        self.labels = kept.iter().map(|&i| self.words[i].clone()).collect();
        if let Some(end) = self.words.iter().position(|w| w == DOCUMENT_END) {
            self.label_of[end] = unknown - 1;
        }
        self.labels.push(DOCUMENT_END.into());
        self.labels.push(UNK.into());
        Ok(())
    }

    /// The label names, in class-id order.
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// The words of each part: training, validation, test.
    pub fn part_words(&self) -> [usize; 3] {
        self.parts.clone().map(|r| r.len())
    }

    /// Refuses lengths a part cannot hold a window of: a tape of `L` words needs `L + 1`, its
    /// last the target of its last.
    fn check_lengths(&self, train: usize, tests: usize) -> Result<()> {
        let names = [
            "training part (the first 80%)",
            "validation part (the next 10%)",
            "test part (the last 10%)",
        ];
        for (p, longest) in [train, train, tests].into_iter().enumerate() {
            let have = self.parts[p].len();
            if have < longest + 1 {
                return Err(self.error(format!(
                    "its {} holds {have} words, and a tape of {longest} needs {} (its words and \
                     the next): use a longer file, or shorter lengths or eval_factors",
                    names[p],
                    longest + 1
                )));
            }
        }
        Ok(())
    }

    /// A tape of `len` words from `part`, at a start drawn from `rng`.
    fn window(&self, part: Part, rng: &mut Rng, len: usize) -> Example {
        let range = &self.parts[part as usize];
        let start = rng.random_range(range.start..=range.end - len - 1);
        let word = |&id: &u32| self.words[id as usize].clone();
        Example {
            words: self.stream[start..start + len].iter().map(word).collect(),
            label: Label::Outputs {
                length: len,
                targets: self.stream[start + 1..=start + len]
                    .iter()
                    .map(|&id| self.label_of[id as usize] as usize)
                    .collect(),
                counted: len,
            },
            source: Some(Source {
                path: self.path.clone(),
                line: self.lines[start] as usize,
            }),
        }
    }

    /// The word-level tokenizer of the labels' words (one token per word, `[UNK]` for the
    /// rest), lowercasing as the file was read.
    fn tokenizer(&self, lowercase: bool) -> Result<TextTokenizer> {
        let words = &self.labels[..self.labels.len() - 2];
        TextTokenizer::word_level_split(words, lowercase)
    }
}

/// Why a text file's tapes need the word-level tokenizer.
const LM_TOKENIZER: &str = "lm on a text_file predicts each next word, one label a word: use \
    tokenizer = { kind = \"word_level\" } (its min_frequency, max_vocab and lowercase choose the \
    words; the rest are predicted as [UNK])";

impl Lm {
    /// Checks a text file's options that do not need the file: the tokenizer.
    pub(super) fn check_text(&self, tokenizer: &TokenizerSpec) -> std::result::Result<(), String> {
        match tokenizer {
            TokenizerSpec::WordLevel { .. } => Ok(()),
            _ => Err(LM_TOKENIZER.into()),
        }
    }

    /// The splits of `text_file`: windows of each part at the lengths `spec` asks for (the
    /// first `caps` of each split), the labels and the tokenizer.
    pub(super) fn text_splits(
        &self,
        path: &Path,
        spec: &TaskSpec,
        caps: [usize; 2],
    ) -> Result<Splits> {
        let corpus = Corpus::read(path, &spec.tokenizer)?;
        let [_, hi] = spec.lengths.expect("validated: lm has lengths");
        let longest = spec.test_ranges().iter().map(|r| r[1]).max().unwrap_or(hi);
        corpus.check_lengths(hi, longest)?;
        let (train, valid, tests) =
            spec.drawn(&|part, rng, len| corpus.window(part, rng, len), caps);
        let lowercase = matches!(
            spec.tokenizer,
            TokenizerSpec::WordLevel {
                lowercase: true,
                ..
            }
        );
        Ok(Splits {
            train,
            valid,
            tests,
            objective: Objective::Lm {
                labels: corpus.labels.clone(),
            },
            vocabulary: None,
            tokenizer: Some(corpus.tokenizer(lowercase)?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_position_is_labelled_with_the_word_after_it() {
        let lm = Lm::default();
        let labels = Lm::words();
        let mut a = crate::rng::stream(3, "lm test");
        let mut b = crate::rng::stream(3, "lm test");
        for len in [1, 5, 13, 40, 97] {
            let example = lm.example(&mut a, len);
            let document = lm.document(&mut b, len + 1);
            assert_eq!(example.words, document[..len]);
            let Label::Outputs {
                length,
                targets,
                counted,
            } = &example.label
            else {
                panic!("an lm example is a tape");
            };
            assert_eq!((*length, *counted, targets.len()), (len, len, len));
            for (i, t) in targets.iter().enumerate() {
                assert_eq!(labels[*t], document[i + 1]);
            }
        }
    }

    #[test]
    fn documents_are_sentences_of_a_cast_closed_by_stops() {
        let lm = Lm {
            cast: 2,
            ..Lm::default()
        };
        let mut rng = crate::rng::stream(0, "lm test");
        for _ in 0..50 {
            let words = lm.document(&mut rng, 200);
            assert_eq!(words.len(), 200);
            let named: std::collections::BTreeSet<&str> = words
                .iter()
                .copied()
                .filter(|w| grammar::ENTITIES.contains(w))
                .collect();
            assert_eq!(named.len(), 2, "{words:?}");
            // Sentences of 5 to 12 words between the stops.
            let stops: Vec<usize> = (0..words.len()).filter(|&i| words[i] == STOP).collect();
            let mut start = 0;
            for s in stops {
                assert!((5..=12).contains(&(s - start)), "{words:?}");
                start = s + 1;
            }
        }
    }

    #[test]
    fn the_corpus_is_far_from_one_word_at_a_time() {
        // The unigram perplexity, which a model blind to context reaches at best: measured
        // 26.8 over 20,000 words at the default cast.
        let lm = Lm::default();
        let mut rng = crate::rng::stream(1, "lm test");
        let mut counts = std::collections::HashMap::new();
        for _ in 0..200 {
            for w in lm.document(&mut rng, 100) {
                *counts.entry(w).or_insert(0usize) += 1;
            }
        }
        let n = counts.values().sum::<usize>() as f64;
        let entropy: f64 = counts
            .values()
            .map(|&c| -(c as f64 / n) * (c as f64 / n).ln())
            .sum();
        let perplexity = entropy.exp();
        assert!(perplexity > 15.0, "unigram perplexity {perplexity}");
    }

    #[test]
    fn bad_options_are_refused_naming_them() {
        for cast in [1, 9] {
            let lm = Lm {
                cast,
                ..Lm::default()
            };
            let err = lm.check(1, 10).unwrap_err();
            assert!(err.contains(&format!("cast = {cast}")), "{err}");
        }
        assert!(Lm::default().check(0, 10).unwrap_err().contains("lengths"));
        assert!(Lm::default().check(1, 10).is_ok());
    }

    /// A file holding `contents`, in a temporary folder kept alive by the returned guard.
    fn text_file(contents: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("corpus.txt");
        std::fs::write(&path, contents).unwrap();
        (dir, path)
    }

    fn lm_spec(path: &Path, extra: &str) -> TaskSpec {
        #[derive(Deserialize)]
        struct W {
            tasks: Vec<TaskSpec>,
        }
        let text = format!(
            "[[tasks]]\nkind = \"lm\"\ntext_file = {:?}\nlengths = [4, 8]\n\
             train_examples = 200\neval_examples = 40\n{extra}",
            path.display().to_string()
        );
        toml::from_str::<W>(&text).unwrap().tasks.remove(0)
    }

    #[test]
    fn a_text_files_tapes_are_its_words_in_order_within_their_part() {
        // Words numbered by their place in the file: line i holds words "i-0 i-1 ...", so a
        // window's words must run on consecutively.
        let mut text = String::new();
        for line in 0..60 {
            let words: Vec<String> = (0..9).map(|j| format!("w{line}x{j}")).collect();
            text += &words.join(" ");
            text += "\n\n";
        }
        let (_dir, path) = text_file(&text);
        let spec = lm_spec(&path, "");
        spec.validate().unwrap();
        let data = spec.generate().unwrap();
        let Objective::Lm { labels } = &data.objective else {
            panic!("an lm objective");
        };
        // 60 documents of 9 words and an end: 600 words, 480 (48 documents) for training.
        assert_eq!(labels.len(), 432 + 2);
        assert_eq!(labels[labels.len() - 2..], [DOCUMENT_END, "[UNK]"]);
        let corpus = Corpus::read(&path, &spec.tokenizer).unwrap();
        assert_eq!(corpus.part_words(), [480, 60, 60]);
        // The place in the file of a word ("w{line}x{j}" is word line*10 + j; an end is the
        // line's tenth).
        let place = |w: &str| -> Option<usize> {
            let (line, j) = w.strip_prefix('w')?.split_once('x')?;
            Some(line.parse::<usize>().ok()? * 10 + j.parse::<usize>().ok()?)
        };
        let check = |examples: &[Example], part: std::ops::Range<usize>, lengths: [usize; 2]| {
            for e in examples {
                let Label::Outputs {
                    length,
                    targets,
                    counted,
                } = &e.label
                else {
                    panic!("a tape");
                };
                assert!((lengths[0]..=lengths[1]).contains(length));
                assert_eq!(
                    (e.words.len(), targets.len(), *counted),
                    (*length, *length, *length)
                );
                // The first word's place, from a numbered word or the end before it.
                let first = e.words.iter().position(|w| w != DOCUMENT_END).unwrap();
                let start = place(&e.words[first]).unwrap() - first;
                assert!(
                    part.contains(&start) && part.contains(&(start + length)),
                    "{e:?}"
                );
                for (i, w) in e.words.iter().enumerate() {
                    match place(w) {
                        Some(p) => assert_eq!(p, start + i),
                        None => assert_eq!((w.as_str(), (start + i) % 10), (DOCUMENT_END, 9)),
                    }
                    // Each target is the label of the word after.
                    let next = labels[targets[i]].as_str();
                    match place(next) {
                        Some(p) => assert_eq!(p, start + i + 1),
                        None if (start + i + 1) % 10 == 9 => assert_eq!(next, DOCUMENT_END),
                        // A word the training part never had.
                        None => assert!(start + i + 1 >= 480 && next == "[UNK]", "{next}"),
                    }
                }
                // Its source is the file and the first word's line (1-based, blank lines
                // between the documents).
                let source = e.source.as_ref().unwrap();
                assert_eq!(source.line, 2 * (start / 10) + 1);
            }
        };
        check(&data.train, 0..480, [4, 8]);
        check(&data.valid, 480..540, [4, 8]);
        for (test, f) in data.tests.iter().zip([1, 2, 4]) {
            check(&test.examples, 540..600, [4 * f, 8 * f]);
        }
        // Test words the training part lacks are [UNK] inputs too: one token per word.
        let tape = &data.tests[2].examples[0];
        let ids = data.tokenizer.encode_words(&tape.words).unwrap().ids;
        assert_eq!(ids.len(), tape.words.len());
        let unk = data.tokenizer.unk_id().unwrap();
        assert!(ids.iter().filter(|&&i| i == unk).count() >= tape.words.len() - 4);
    }

    #[test]
    fn a_text_file_splits_punctuation_and_keeps_the_words_its_tokenizer_asks_for() {
        let (_dir, path) = text_file(&"The cat sat. The dog ran, the cat sat!\n".repeat(40));
        let spec = lm_spec(
            &path,
            "tokenizer = { kind = \"word_level\", lowercase = true, max_vocab = 3 }\n",
        );
        let data = spec.generate().unwrap();
        let Objective::Lm { labels } = &data.objective else {
            panic!("an lm objective");
        };
        // "the" 3 a line, "cat" and "sat" 2: the three most frequent, then the ends.
        assert_eq!(labels, &["the", "cat", "sat", DOCUMENT_END, "[UNK]"]);
        let tape = &data.train[0];
        assert!(tape
            .words
            .iter()
            .all(|w| w.to_lowercase() == *w || w == DOCUMENT_END));
        assert!(tape.words.iter().any(|w| w == "." || w == "," || w == "!"));
        // The tokenizer splits a raw text's punctuation off and lowercases it, as the file was
        // read: what predict gives it.
        let ids = data.tokenizer.encode("The cat sat.").unwrap().ids;
        assert_eq!(ids.len(), 4);
    }

    #[test]
    fn a_text_file_too_short_or_with_the_wrong_options_is_refused_naming_the_fix() {
        let (_dir, path) = text_file(&"one two three four five six seven\n".repeat(25));
        // 200 words: a test part of 20, and a tape of 32 (4x) needs 33.
        let err = lm_spec(&path, "").generate().unwrap_err().to_string();
        assert!(
            err.contains("corpus.txt") && err.contains("test part") && err.contains("33"),
            "{err}"
        );
        let err = lm_spec(
            &path,
            "tokenizer = { kind = \"train\", model = \"bpe\", vocab_size = 50 }\n",
        )
        .validate()
        .unwrap_err()
        .to_string();
        assert!(err.contains("word_level"), "{err}");
        let err = lm_spec(&path, "cast = 4\n")
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cast = 4") && err.contains("text_file"),
            "{err}"
        );
        let err = lm_spec(&path.with_file_name("absent.txt"), "")
            .generate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("absent.txt"), "{err}");
    }
}
