//! Built-in tasks, generated deterministically from a seed: no download, no data files.
//!
//! | task | objective | what it needs from positions |
//! | --- | --- | --- |
//! | `word_order` | classify the agent of a sentence | order of entities around the verb |
//! | `sorted` | is a sequence of number words ascending | relative order of neighbours |
//! | `prev_token` | tag each token with the token `k` before it | relative position |
//! | `position_index` | tag each token with its position modulo `m` | absolute position |
//! | `mlm` | fill masked tokens of generated sentences or a text file | context order |
//!
//! Every task yields text (space-separated words) with labels per sentence or per word, so it
//! runs through a real tokenizer like user data does.

pub mod grammar;

use std::path::PathBuf;

use rand::seq::SliceRandom;
use rand::Rng as _;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::rng::{self, Rng};
use crate::text::TextTokenizer;

fn default_train_examples() -> usize {
    4000
}
fn default_eval_examples() -> usize {
    500
}
fn default_eval_factors() -> Vec<usize> {
    vec![1, 2, 4]
}
fn default_k() -> usize {
    1
}
fn default_modulus() -> usize {
    4
}
fn default_symbols() -> usize {
    16
}
fn default_max_number() -> usize {
    64
}
fn default_mask_prob() -> f64 {
    0.15
}

/// What to generate, with the options of each task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TaskKind {
    /// Sentences from the [`grammar`]; the label is the entity that did the action.
    WordOrder {},
    /// Number words below `max_number`; label 1 if ascending. Half the negatives differ from a
    /// sorted sequence by one adjacent swap.
    Sorted {
        #[serde(default = "default_max_number")]
        max_number: usize,
    },
    /// Random symbols; each token is tagged with the symbol `k` positions before it.
    PrevToken {
        #[serde(default = "default_k")]
        k: usize,
        #[serde(default = "default_symbols")]
        symbols: usize,
    },
    /// Random symbols; each token is tagged with its position modulo `modulus`.
    PositionIndex {
        #[serde(default = "default_modulus")]
        modulus: usize,
        #[serde(default = "default_symbols")]
        symbols: usize,
    },
    /// Masked language modelling on generated sentences, or on `text_file` (one document per
    /// line, words split on whitespace).
    Mlm {
        #[serde(default = "default_mask_prob")]
        mask_prob: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        text_file: Option<PathBuf>,
    },
}

impl TaskKind {
    pub fn name(&self) -> &'static str {
        match self {
            Self::WordOrder {} => "word_order",
            Self::Sorted { .. } => "sorted",
            Self::PrevToken { .. } => "prev_token",
            Self::PositionIndex { .. } => "position_index",
            Self::Mlm { .. } => "mlm",
        }
    }
}

/// The fields every task takes, next to its `kind` and options in one flat table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskCommon {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    lengths: [usize; 2],
    #[serde(default = "default_train_examples")]
    train_examples: usize,
    #[serde(default = "default_eval_examples")]
    eval_examples: usize,
    #[serde(default = "default_eval_factors")]
    eval_factors: Vec<usize>,
    #[serde(default)]
    data_seed: u64,
}

const COMMON_FIELDS: [&str; 6] = [
    "name",
    "lengths",
    "train_examples",
    "eval_examples",
    "eval_factors",
    "data_seed",
];

/// A task of an experiment, written as one flat TOML table:
///
/// ```toml
/// [[tasks]]
/// kind = "prev_token"        # word_order | sorted | prev_token | position_index | mlm
/// k = 2                      # the kind's own options
/// lengths = [4, 12]          # training lengths in words, inclusive
/// train_examples = 4000
/// eval_examples = 500        # validation, and each test set
/// eval_factors = [1, 2, 4]   # test sets at lengths [f * min, f * max]
/// data_seed = 0              # the examples; training order comes from the run's seed
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct TaskSpec {
    pub name: String,
    pub kind: TaskKind,
    pub lengths: [usize; 2],
    pub train_examples: usize,
    pub eval_examples: usize,
    pub eval_factors: Vec<usize>,
    pub data_seed: u64,
}

impl<'de> Deserialize<'de> for TaskSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let table = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        let (common, own): (serde_json::Map<_, _>, serde_json::Map<_, _>) = table
            .into_iter()
            .partition(|(k, _)| COMMON_FIELDS.contains(&k.as_str()));
        let kind: TaskKind = serde_json::from_value(own.into()).map_err(|e| {
            D::Error::custom(format!(
                "{e} (fields every task takes: {})",
                COMMON_FIELDS.join(", ")
            ))
        })?;
        let common: TaskCommon = serde_json::from_value(common.into())
            .map_err(|e| D::Error::custom(format!("task `{}`: {e}", kind.name())))?;
        Ok(TaskSpec {
            name: common.name.unwrap_or_else(|| kind.name().to_string()),
            kind,
            lengths: common.lengths,
            train_examples: common.train_examples,
            eval_examples: common.eval_examples,
            eval_factors: common.eval_factors,
            data_seed: common.data_seed,
        })
    }
}

impl Serialize for TaskSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let common = TaskCommon {
            name: Some(self.name.clone()),
            lengths: self.lengths,
            train_examples: self.train_examples,
            eval_examples: self.eval_examples,
            eval_factors: self.eval_factors.clone(),
            data_seed: self.data_seed,
        };
        let mut table = match serde_json::to_value(&self.kind).map_err(S::Error::custom)? {
            serde_json::Value::Object(m) => m,
            _ => unreachable!("a tagged enum serializes to a table"),
        };
        if let serde_json::Value::Object(m) =
            serde_json::to_value(common).map_err(S::Error::custom)?
        {
            table.extend(m);
        }
        table.serialize(s)
    }
}

/// What the model is trained to predict.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Objective {
    /// One label per sentence.
    Classify { labels: Vec<String> },
    /// One label per word (sub-word tokens after a word's first are not scored).
    Tag { labels: Vec<String> },
    /// Masked tokens predicted over the vocabulary.
    Mlm { mask_prob: f64 },
}

impl Objective {
    /// The name of the score reported for this objective.
    pub fn metric(&self) -> &'static str {
        match self {
            Self::Classify { .. } => "accuracy",
            Self::Tag { .. } => "token accuracy",
            Self::Mlm { .. } => "masked-token accuracy",
        }
    }
}

/// An example: words, and labels per sentence or per word.
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    pub words: Vec<String>,
    pub label: Label,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Label {
    Class(usize),
    /// Per word; `None` is not scored.
    Tags(Vec<Option<usize>>),
    /// MLM targets are drawn when batches are made.
    Masked,
}

impl Example {
    pub fn text(&self) -> String {
        self.words.join(" ")
    }
}

/// A test set at a multiple of the training lengths.
#[derive(Clone, Debug)]
pub struct TestSet {
    /// `lengths` of the training set times this.
    pub factor: usize,
    /// Inclusive range of lengths in words.
    pub lengths: [usize; 2],
    pub examples: Vec<Example>,
}

/// A task, generated: tokenizer, objective and every split.
#[derive(Clone, Debug)]
pub struct TaskData {
    pub name: String,
    pub kind: TaskKind,
    pub objective: Objective,
    pub tokenizer: TextTokenizer,
    pub train: Vec<Example>,
    /// Same distribution as `train`: periodic evaluation and early stopping.
    pub valid: Vec<Example>,
    pub tests: Vec<TestSet>,
    /// The best accuracy any order-blind model can reach, where the task makes that a number.
    pub order_blind_ceiling: Option<OrderBlindCeiling>,
}

/// The accuracy a model that sees only the bag of words cannot beat, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OrderBlindCeiling {
    pub accuracy: f64,
    pub reason: String,
}

impl TaskSpec {
    /// Checks the spec; the message names the field and the fix.
    pub fn validate(&self) -> Result<()> {
        let err = |m: String| Err(Error::Config(format!("task `{}`: {m}", self.name)));
        let [lo, hi] = self.lengths;
        if lo == 0 || lo > hi {
            return err(format!(
                "lengths = [{lo}, {hi}] must be a range [min, max] with 1 <= min <= max"
            ));
        }
        if self.train_examples == 0 || self.eval_examples == 0 {
            return err("train_examples and eval_examples must be at least 1".into());
        }
        if self.eval_factors.is_empty() || self.eval_factors.contains(&0) {
            return err(format!(
                "eval_factors = {:?} must list positive multiples of the training lengths, such as [1, 2, 4]",
                self.eval_factors
            ));
        }
        let longest = hi * self.eval_factors.iter().max().copied().unwrap_or(1);
        match &self.kind {
            TaskKind::WordOrder {} if lo < grammar::SHORTEST => err(format!(
                "word_order sentences have at least {} words: lengths[0] = {lo} is too short",
                grammar::SHORTEST
            )),
            TaskKind::Sorted { max_number } if *max_number < longest.max(2) || *max_number > NUMBER_WORDS_LIMIT => err(format!(
                "sorted draws distinct numbers, so max_number = {max_number} must be at least the \
                 longest test length {longest} (and at most {NUMBER_WORDS_LIMIT})"
            )),
            TaskKind::Sorted { .. } if lo < 2 => err("sorted needs sequences of at least 2 numbers".into()),
            TaskKind::PrevToken { k, symbols } if *k == 0 || *k >= lo || *symbols < 2 => err(format!(
                "prev_token needs 1 <= k < lengths[0] (k = {k}, lengths[0] = {lo}) and at least 2 symbols"
            )),
            TaskKind::PositionIndex { modulus, symbols } if *modulus < 2 || *symbols < 1 => err(format!(
                "position_index needs modulus >= 2 (got {modulus}) and at least 1 symbol"
            )),
            TaskKind::Mlm { mask_prob, .. } if !(*mask_prob > 0.0 && *mask_prob < 1.0) => {
                err(format!("mlm: mask_prob = {mask_prob} must be in (0, 1)"))
            }
            _ => Ok(()),
        }
    }

    /// Generates the tokenizer and every split from `data_seed`.
    pub fn generate(&self) -> Result<TaskData> {
        self.validate()?;
        let stream =
            |split: &str| rng::stream(self.data_seed, &format!("task/{}/{split}", self.name));
        let [lo, hi] = self.lengths;
        let make = |split: &str, n: usize, lengths: [usize; 2]| -> Result<Vec<Example>> {
            let mut rng = stream(split);
            (0..n)
                .map(|_| {
                    let len = rng.random_range(lengths[0]..=lengths[1]);
                    self.example(&mut rng, len)
                })
                .collect()
        };
        let (train, valid, tests) = match &self.kind {
            TaskKind::Mlm {
                text_file: Some(path),
                ..
            } => self.split_text_file(path)?,
            _ => {
                let tests = self
                    .eval_factors
                    .iter()
                    .map(|&f| {
                        let lengths = [lo * f, hi * f];
                        Ok(TestSet {
                            factor: f,
                            lengths,
                            examples: make(&format!("test{f}x"), self.eval_examples, lengths)?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                (
                    make("train", self.train_examples, self.lengths)?,
                    make("valid", self.eval_examples, self.lengths)?,
                    tests,
                )
            }
        };
        let (objective, vocabulary) = self.objective_and_vocabulary(&train)?;
        let tokenizer = TextTokenizer::word_level(vocabulary)?;
        let order_blind_ceiling = match self.kind {
            TaskKind::WordOrder {} => Some(OrderBlindCeiling {
                accuracy: 0.5,
                reason: "every sentence has an equally likely twin with the same words and the \
                         roles swapped"
                    .into(),
            }),
            TaskKind::Sorted { .. } => Some(OrderBlindCeiling {
                accuracy: 0.5,
                reason: "each set of numbers is ascending in half the examples and shuffled or \
                         swapped in the other half"
                    .into(),
            }),
            _ => None,
        };
        Ok(TaskData {
            name: self.name.clone(),
            kind: self.kind.clone(),
            objective,
            tokenizer,
            train,
            valid,
            tests,
            order_blind_ceiling,
        })
    }

    fn objective_and_vocabulary(&self, train: &[Example]) -> Result<(Objective, Vec<String>)> {
        Ok(match &self.kind {
            TaskKind::WordOrder {} => (
                Objective::Classify {
                    labels: grammar::ENTITIES.iter().map(|s| s.to_string()).collect(),
                },
                grammar::vocabulary(),
            ),
            TaskKind::Sorted { max_number } => (
                Objective::Classify {
                    labels: vec!["not_ascending".into(), "ascending".into()],
                },
                (0..*max_number).map(number_word).collect(),
            ),
            TaskKind::PrevToken { symbols, .. } => (
                Objective::Tag {
                    labels: symbol_words(*symbols),
                },
                symbol_words(*symbols),
            ),
            TaskKind::PositionIndex { modulus, symbols } => (
                Objective::Tag {
                    labels: (0..*modulus).map(|m| m.to_string()).collect(),
                },
                symbol_words(*symbols),
            ),
            TaskKind::Mlm {
                mask_prob,
                text_file,
            } => {
                let vocabulary = match text_file {
                    None => grammar::vocabulary(),
                    Some(_) => {
                        // Words of the training split, most frequent first, ties by first use.
                        let mut counts: Vec<(String, usize)> = Vec::new();
                        let mut index = std::collections::HashMap::new();
                        for w in train.iter().flat_map(|e| &e.words) {
                            let i = *index.entry(w.clone()).or_insert_with(|| {
                                counts.push((w.clone(), 0));
                                counts.len() - 1
                            });
                            counts[i].1 += 1;
                        }
                        counts.sort_by_key(|c| std::cmp::Reverse(c.1));
                        counts.into_iter().map(|(w, _)| w).collect()
                    }
                };
                (
                    Objective::Mlm {
                        mask_prob: *mask_prob,
                    },
                    vocabulary,
                )
            }
        })
    }

    /// One example of `len` words.
    fn example(&self, rng: &mut Rng, len: usize) -> Result<Example> {
        Ok(match &self.kind {
            TaskKind::WordOrder {} => {
                let (words, agent) = grammar::sentence(rng, len);
                Example {
                    words: words.into_iter().map(String::from).collect(),
                    label: Label::Class(agent),
                }
            }
            TaskKind::Sorted { max_number } => {
                let mut numbers: Vec<usize> =
                    rand::seq::index::sample(rng, *max_number, len).into_vec();
                numbers.sort_unstable();
                let ascending = rng.random_bool(0.5);
                if !ascending {
                    if rng.random_bool(0.5) {
                        // Hard negative: one adjacent pair swapped.
                        let i = rng.random_range(0..len - 1);
                        numbers.swap(i, i + 1);
                    } else {
                        while numbers.windows(2).all(|w| w[0] < w[1]) {
                            numbers.shuffle(rng);
                        }
                    }
                }
                Example {
                    words: numbers.into_iter().map(number_word).collect(),
                    label: Label::Class(usize::from(ascending)),
                }
            }
            TaskKind::PrevToken { k, symbols } => {
                let ids: Vec<usize> = (0..len).map(|_| rng.random_range(0..*symbols)).collect();
                let tags = (0..len)
                    .map(|i| i.checked_sub(*k).map(|j| ids[j]))
                    .collect();
                Example {
                    words: ids.iter().map(|&i| symbol_word(i)).collect(),
                    label: Label::Tags(tags),
                }
            }
            TaskKind::PositionIndex { modulus, symbols } => Example {
                words: (0..len)
                    .map(|_| symbol_word(rng.random_range(0..*symbols)))
                    .collect(),
                label: Label::Tags((0..len).map(|i| Some(i % modulus)).collect()),
            },
            TaskKind::Mlm { .. } => {
                let (words, _) = grammar::sentence(rng, len.max(grammar::SHORTEST));
                Example {
                    words: words.into_iter().map(String::from).collect(),
                    label: Label::Masked,
                }
            }
        })
    }

    /// A user's text file for MLM: lines shuffled by `data_seed`, then split train / valid /
    /// test. Its own lengths stand; `lengths` only bounds them (longer lines are an error).
    fn split_text_file(
        &self,
        path: &PathBuf,
    ) -> Result<(Vec<Example>, Vec<Example>, Vec<TestSet>)> {
        let text = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let text = String::from_utf8(text)
            .map_err(|e| Error::Input(format!("{}: not valid UTF-8 ({e})", path.display())))?;
        let mut lines = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let words: Vec<String> = line.split_whitespace().map(String::from).collect();
            if words.is_empty() {
                continue;
            }
            if words.len() > self.lengths[1] {
                return Err(Error::Input(format!(
                    "{}:{}: {} words, longer than lengths[1] = {}: raise lengths[1] or split the line",
                    path.display(),
                    n + 1,
                    words.len(),
                    self.lengths[1]
                )));
            }
            lines.push(Example {
                words,
                label: Label::Masked,
            });
        }
        let needed = 3; // one line each for train, valid and test
        if lines.len() < needed {
            return Err(Error::Input(format!(
                "{}: {} non-empty lines; an MLM split needs at least {needed}",
                path.display(),
                lines.len()
            )));
        }
        lines.shuffle(&mut rng::stream(self.data_seed, "task/text_file/shuffle"));
        let n_eval = self.eval_examples.min(lines.len() / 5).max(1);
        let test = lines.split_off(lines.len() - n_eval);
        let valid = lines.split_off(lines.len() - n_eval);
        let longest = test.iter().map(|e| e.words.len()).max().unwrap_or(1);
        let shortest = test.iter().map(|e| e.words.len()).min().unwrap_or(1);
        lines.truncate(self.train_examples);
        Ok((
            lines,
            valid,
            vec![TestSet {
                factor: 1,
                lengths: [shortest, longest],
                examples: test,
            }],
        ))
    }
}

const NUMBER_WORDS_LIMIT: usize = 1000;

/// English number words with underscores: `twenty_one`, `one_hundred_five`.
pub fn number_word(n: usize) -> String {
    const ONES: [&str; 20] = [
        "zero",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
        "thirteen",
        "fourteen",
        "fifteen",
        "sixteen",
        "seventeen",
        "eighteen",
        "nineteen",
    ];
    const TENS: [&str; 10] = [
        "", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
    ];
    match n {
        0..=19 => ONES[n].to_string(),
        20..=99 if n % 10 == 0 => TENS[n / 10].to_string(),
        20..=99 => format!("{}_{}", TENS[n / 10], ONES[n % 10]),
        _ if n % 100 == 0 => format!("{}_hundred", ONES[n / 100]),
        _ => format!("{}_hundred_{}", ONES[n / 100], number_word(n % 100)),
    }
}

fn symbol_word(i: usize) -> String {
    format!("s{i}")
}

fn symbol_words(n: usize) -> Vec<String> {
    (0..n).map(symbol_word).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(toml_text: &str) -> Result<TaskSpec> {
        #[derive(Deserialize)]
        struct W {
            tasks: Vec<TaskSpec>,
        }
        let w: W = toml::from_str(toml_text).map_err(|e| Error::Config(e.to_string()))?;
        let t = w.tasks.into_iter().next().unwrap();
        t.validate()?;
        Ok(t)
    }

    #[test]
    fn flat_task_tables_parse_round_trip_and_refuse_strays() {
        let t = spec("[[tasks]]\nkind = \"prev_token\"\nk = 2\nlengths = [4, 9]\n").unwrap();
        assert_eq!(t.kind, TaskKind::PrevToken { k: 2, symbols: 16 });
        assert_eq!(
            (t.name.as_str(), t.eval_factors.as_slice()),
            ("prev_token", &[1, 2, 4][..])
        );
        let text = toml::to_string(&serde_json::json!({"tasks": [t.clone()]})).unwrap();
        assert_eq!(spec(&text).unwrap(), t);

        let e = spec("[[tasks]]\nkind = \"word_order\"\nk = 2\nlengths = [5, 9]\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown field `k`") && e.contains("fields every task takes"),
            "{e}"
        );
        let e = spec("[[tasks]]\nkind = \"sorted\"\nlength = [5, 9]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `length`"), "{e}");
        let e = spec("[[tasks]]\nkind = \"sorted\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field `lengths`"), "{e}");
        let e = spec("[[tasks]]\nkind = \"prev_token\"\nk = 4\nlengths = [4, 9]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 <= k < lengths[0]"), "{e}");
        let e = spec("[[tasks]]\nkind = \"word_order\"\nlengths = [3, 9]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 5 words"), "{e}");
        let e = spec("[[tasks]]\nkind = \"sorted\"\nmax_number = 20\nlengths = [4, 8]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("longest test length 32"), "{e}");
    }

    #[test]
    fn generation_is_deterministic_and_labels_are_right() {
        let t = spec("[[tasks]]\nkind = \"sorted\"\nlengths = [3, 6]\ntrain_examples = 300\neval_examples = 50\n").unwrap();
        let a = t.generate().unwrap();
        let b = t.generate().unwrap();
        assert_eq!(a.train, b.train);
        assert_eq!(a.tests.len(), 3);
        assert_eq!(a.tests[2].lengths, [12, 24]);
        for set in &a.tests {
            assert!(set
                .examples
                .iter()
                .all(|e| (set.lengths[0]..=set.lengths[1]).contains(&e.words.len())));
        }
        let value = |w: &str| (0..64).find(|&n| number_word(n) == w).unwrap();
        let mut positives = 0;
        for e in &a.train {
            let v: Vec<usize> = e.words.iter().map(|w| value(w)).collect();
            let ascending = v.windows(2).all(|w| w[0] < w[1]);
            assert_eq!(e.label, Label::Class(usize::from(ascending)));
            positives += usize::from(ascending);
        }
        assert!(
            (120..180).contains(&positives),
            "{positives} of 300 ascending"
        );

        let p = spec("[[tasks]]\nkind = \"prev_token\"\nk = 2\nlengths = [4, 6]\n")
            .unwrap()
            .generate()
            .unwrap();
        for e in p.train.iter().take(50) {
            let Label::Tags(tags) = &e.label else {
                panic!()
            };
            assert_eq!(tags[..2], [None, None]);
            for (tag, earlier) in tags[2..].iter().zip(&e.words) {
                assert_eq!(&symbol_word(tag.unwrap()), earlier);
            }
        }
        assert_eq!(number_word(21), "twenty_one");
        assert_eq!(number_word(305), "three_hundred_five");
    }
}
