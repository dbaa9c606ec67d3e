//! Tasks: built-in ones generated from a seed (no download, no data files), and the user's own
//! data read from files.
//!
//! | task | objective | what it needs from positions |
//! | --- | --- | --- |
//! | `word_order` | classify the agent of a sentence | order of entities around the verb |
//! | `sorted` | is a sequence of number words ascending | relative order of neighbours |
//! | `prev_token` | tag each token with the token `k` before it | relative position |
//! | `position_index` | tag each token with its position modulo `m` | absolute position |
//! | `mqar` | tag each query with the value that followed its key | recall by content and order |
//! | `flip_flop` | tag each read with the last bit written before it | which write came last |
//! | `mlm` | fill masked tokens of generated sentences or a text file | context order |
//! | `classify` | sentence labels from TSV, CSV or JSONL files | the user's question |
//! | `tag` | per-word labels from JSONL files | the user's question |
//! | `reverse_string`, `binary_addition`, ... | the length suite's 15 algorithmic tasks ([`algorithmic`]) | order, counting, memory |
//!
//! Every task yields words with labels per sentence or per word, tokenized by the task's
//! tokenizer ([`TokenizerSpec`]) the same way whatever the source.

pub mod algorithmic;
pub mod files;
pub mod grammar;
mod labelled;
pub mod lm;
pub mod mlm;
pub mod recall;
pub mod sorted;
pub mod symbols;
pub mod word_order;

use std::path::{Path, PathBuf};

pub use crate::io::PathBase;

use rand::Rng as _;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::rng::{self, Rng};
use crate::text::{HubSource, TextTokenizer, TokenizerSpec};
use algorithmic::Algorithmic;
use files::{FileOptions, RecordKind, Source};
use lm::Lm;
use mlm::Mlm;
use recall::{FlipFlop, Mqar};
use sorted::Sorted;
use symbols::{PositionIndex, PrevToken};
use word_order::WordOrder;

const DEFAULT_TRAIN_EXAMPLES: usize = 4000;
const DEFAULT_EVAL_EXAMPLES: usize = 500;

/// What to generate or read, with the options of each task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TaskKind {
    /// Which entity of a generated sentence did the action ([`word_order`]).
    WordOrder(WordOrder),
    /// Is a sequence of number words ascending ([`sorted`]).
    Sorted(Sorted),
    /// Each symbol tagged with the one `k` before it ([`symbols`]).
    PrevToken(PrevToken),
    /// Each symbol tagged with its position modulo `modulus` ([`symbols`]).
    PositionIndex(PositionIndex),
    /// Multi-query associative recall: each query tagged with its key's value ([`recall`]).
    Mqar(Mqar),
    /// Flip-flop: each read tagged with the last bit written before it ([`recall`]).
    FlipFlop(FlipFlop),
    /// Masked language modelling on generated sentences or a text file ([`mlm`]).
    Mlm(Mlm),
    /// Next-token prediction on a generated corpus or a text file, for causal models ([`lm`]).
    Lm(Lm),
    /// Sentence labels from the user's files: TSV, CSV with a header, or JSONL.
    Classify(FileOptions),
    /// Per-word labels from the user's JSONL files.
    Tag(FileOptions),
    /// One of the length suite's algorithmic tasks, written `kind = "<its name>"` with no
    /// options (see [`algorithmic`]); read and written by [`TaskSpec`]'s own serde.
    #[serde(skip)]
    Algorithmic(Algorithmic),
}

impl TaskKind {
    /// The name configs write in `kind`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::WordOrder(_) => "word_order",
            Self::Sorted(_) => "sorted",
            Self::PrevToken(_) => "prev_token",
            Self::PositionIndex(_) => "position_index",
            Self::Mqar(_) => "mqar",
            Self::FlipFlop(_) => "flip_flop",
            Self::Mlm(_) => "mlm",
            Self::Lm(_) => "lm",
            Self::Classify(_) => "classify",
            Self::Tag(_) => "tag",
            Self::Algorithmic(a) => a.name(),
        }
    }

    /// Whether the examples come from files at their own lengths (without `lengths`), rather
    /// than a generator or windows of a text file cut to the lengths asked for.
    pub fn from_files(&self) -> bool {
        self.generator().is_none() && self.text_windows().is_none()
    }

    /// The text file a task cuts its examples from at the lengths asked for (`lm` with a
    /// `text_file`).
    pub fn text_windows(&self) -> Option<(&Lm, &std::path::Path)> {
        match self {
            Self::Lm(l) => l.text_file.as_deref().map(|p| (l, p)),
            _ => None,
        }
    }

    /// The generator of a built-in task (`None` for one read from files).
    pub fn generator(&self) -> Option<&dyn Generator> {
        match self {
            Self::WordOrder(g) => Some(g),
            Self::Sorted(g) => Some(g),
            Self::PrevToken(g) => Some(g),
            Self::PositionIndex(g) => Some(g),
            Self::Mqar(g) => Some(g),
            Self::FlipFlop(g) => Some(g),
            Self::Mlm(g) if g.text_file.is_none() => Some(g),
            Self::Lm(g) if g.text_file.is_none() => Some(g),
            Self::Algorithmic(g) => Some(g),
            Self::Mlm(_) | Self::Lm(_) | Self::Classify(_) | Self::Tag(_) => None,
        }
    }
}

/// A built-in task generated from a seed. Each lives in a file of its own, with its options;
/// [`TaskSpec`] does what they share (lengths, test sets, splits, the tokenizer).
pub trait Generator {
    /// Checks the options against the lengths the task is generated at, `shortest` to
    /// `longest` (training and test); the message names the option and the fix.
    fn check(&self, shortest: usize, longest: usize) -> std::result::Result<(), String>;
    /// What the model predicts, and every word the examples use (a word-level vocabulary).
    fn objective(&self) -> (Objective, Vec<String>);
    /// One example of length `len`, drawn from `rng`.
    fn example(&self, rng: &mut Rng, len: usize) -> Example;
    /// The words of an example of length `len` (a length-suite tape holds its blanks too).
    fn words_at(&self, len: usize) -> usize {
        len
    }
    /// The best accuracy a model blind to order can reach, where the task makes that a number.
    fn order_blind_ceiling(&self) -> Option<OrderBlindCeiling> {
        None
    }
}

/// The fields every task takes, next to its `kind` and options in one flat table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskCommon {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lengths: Option<[usize; 2]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    train_examples: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    eval_examples: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    eval_factors: Option<Vec<usize>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    test_lengths: Option<Vec<[usize; 2]>>,
    #[serde(default)]
    data_seed: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tokenizer: Option<TokenizerSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_tokens: Option<usize>,
    #[serde(default)]
    truncate: bool,
}

const COMMON_FIELDS: [&str; 10] = [
    "name",
    "lengths",
    "train_examples",
    "eval_examples",
    "eval_factors",
    "test_lengths",
    "data_seed",
    "tokenizer",
    "max_tokens",
    "truncate",
];

/// A task, written as one flat TOML table:
///
/// ```toml
/// [[tasks]]
/// kind = "prev_token"        # word_order | sorted | prev_token | position_index | mlm | lm | classify | tag
/// k = 2                      # the kind's own options
/// lengths = [4, 12]          # generated tasks: training lengths in words, inclusive
/// train_examples = 4000      # generated: how many; files: at most this many (default all)
/// eval_examples = 500        # validation, and each test set
/// eval_factors = [1, 2, 4]   # generated: test sets at lengths [f * min, f * max]
/// # test_lengths = [[41, 100], [101, 200]]  # or: the training lengths and these ranges, each
/// #                                         # length equally often (instead of eval_factors)
/// data_seed = 0              # the examples and splits; training order comes from the run's seed
/// tokenizer = { kind = "word_level" }   # or file / hub / train
/// max_tokens = 256           # longer inputs are an error, or cut when truncate = true
/// truncate = false
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct TaskSpec {
    /// The task's name: a row of the report.
    pub name: String,
    /// What the task is, with its options.
    pub kind: TaskKind,
    /// Generated tasks only.
    pub lengths: Option<[usize; 2]>,
    /// Training examples (generated tasks; a built-in default otherwise).
    pub train_examples: Option<usize>,
    /// Examples per validation and test set (generated tasks).
    pub eval_examples: Option<usize>,
    /// Test sets at multiples of `lengths` (empty when `test_lengths` names them).
    pub eval_factors: Vec<usize>,
    /// Test sets by explicit inclusive length ranges, after one at the training lengths; every
    /// length of a range equally often. Empty when `eval_factors` names them.
    pub test_lengths: Vec<[usize; 2]>,
    /// The seed the examples are generated and split with.
    pub data_seed: u64,
    /// How texts become token ids.
    pub tokenizer: TokenizerSpec,
    /// What to do with inputs that are too long.
    pub limit: TokenLimit,
    /// Where the task's relative paths resolve from (not part of the task).
    pub base: PathBase,
}

/// What to do with inputs longer than a model should take.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenLimit {
    /// The most tokens an input may have; `None`: no limit of the task's own.
    pub max_tokens: Option<usize>,
    /// Keep the first `max_tokens` tokens instead of refusing (the run says how many were cut).
    pub truncate: bool,
}

impl<'de> Deserialize<'de> for TaskSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        // Through TOML's value, which holds every float a config can (JSON's turns NaN and the
        // infinities into null, which an option then took for absent): each option's own check
        // meets the number as written.
        let table = toml::Table::deserialize(d)?;
        let (common, own): (toml::Table, toml::Table) = table
            .into_iter()
            .partition(|(k, _)| COMMON_FIELDS.contains(&k.as_str()));
        let algorithmic = own
            .get("kind")
            .and_then(|k| k.as_str())
            .and_then(Algorithmic::from_name);
        let kind = match algorithmic {
            Some(a) => {
                if let Some(stray) = own.keys().find(|k| *k != "kind") {
                    return Err(D::Error::custom(format!(
                        "task `{}`: unknown field `{stray}`: the length suite's tasks take no \
                         options of their own (fields every task takes: {})",
                        a.name(),
                        COMMON_FIELDS.join(", ")
                    )));
                }
                TaskKind::Algorithmic(a)
            }
            None => toml::Value::Table(own)
                .try_into()
                .map_err(|e: toml::de::Error| {
                    let e = e.to_string().trim_end().to_string();
                    let suite = if e.contains("unknown variant") {
                        format!(
                            "; or a task of the length suite: {}",
                            Algorithmic::ALL.map(Algorithmic::name).join(", ")
                        )
                    } else {
                        String::new()
                    };
                    D::Error::custom(format!(
                        "{e}{suite} (fields every task takes: {})",
                        COMMON_FIELDS.join(", ")
                    ))
                })?,
        };
        let common: TaskCommon =
            toml::Value::Table(common)
                .try_into()
                .map_err(|e: toml::de::Error| {
                    D::Error::custom(format!(
                        "task `{}`: {}",
                        kind.name(),
                        e.to_string().trim_end()
                    ))
                })?;
        let generated = !kind.from_files();
        if common.test_lengths.is_some() && common.eval_factors.is_some() {
            return Err(D::Error::custom(format!(
                "task `{}`: give test sets by eval_factors or by test_lengths, not both",
                kind.name()
            )));
        }
        let test_lengths = common.test_lengths.unwrap_or_default();
        Ok(TaskSpec {
            name: common.name.unwrap_or_else(|| kind.name().to_string()),
            lengths: common.lengths,
            train_examples: common
                .train_examples
                .or(generated.then_some(DEFAULT_TRAIN_EXAMPLES)),
            eval_examples: common
                .eval_examples
                .or(generated.then_some(DEFAULT_EVAL_EXAMPLES)),
            eval_factors: common.eval_factors.unwrap_or_else(|| {
                if !test_lengths.is_empty() {
                    Vec::new()
                } else if generated {
                    vec![1, 2, 4]
                } else {
                    vec![1]
                }
            }),
            test_lengths,
            data_seed: common.data_seed,
            tokenizer: common.tokenizer.unwrap_or_default(),
            limit: TokenLimit {
                max_tokens: common.max_tokens,
                truncate: common.truncate,
            },
            kind,
            base: PathBase::default(),
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
            eval_factors: (!self.eval_factors.is_empty()).then(|| self.eval_factors.clone()),
            test_lengths: (!self.test_lengths.is_empty()).then(|| self.test_lengths.clone()),
            data_seed: self.data_seed,
            tokenizer: Some(self.tokenizer.clone()),
            max_tokens: self.limit.max_tokens,
            truncate: self.limit.truncate,
        };
        let mut table = match &self.kind {
            TaskKind::Algorithmic(a) => {
                serde_json::Map::from_iter([("kind".to_string(), a.name().into())])
            }
            kind => match serde_json::to_value(kind).map_err(S::Error::custom)? {
                serde_json::Value::Object(m) => m,
                _ => unreachable!("a tagged enum serializes to a table"),
            },
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
    Classify {
        /// The label names, in class-id order.
        labels: Vec<String>,
    },
    /// One label per word (sub-word tokens after a word's first are not scored).
    Tag {
        /// The tag names, in class-id order.
        labels: Vec<String>,
    },
    /// Masked tokens predicted over the vocabulary.
    Mlm {
        /// The share of tokens masked.
        mask_prob: f64,
    },
    /// The next word predicted at every position (a causal model's task).
    Lm {
        /// The words predicted, in class-id order.
        labels: Vec<String>,
    },
}

impl Objective {
    /// The head the objective needs; `pooling` reads a sentence label.
    pub fn head(&self, pooling: crate::model::Pooling) -> crate::model::HeadConfig {
        use crate::model::HeadConfig;
        match self {
            Self::Classify { labels } => HeadConfig::Classify {
                classes: labels.len(),
                pooling,
            },
            Self::Tag { labels } | Self::Lm { labels } => HeadConfig::Tag {
                classes: labels.len(),
            },
            Self::Mlm { .. } => HeadConfig::Mlm,
        }
    }

    /// The name of the score reported for this objective.
    pub fn metric(&self) -> &'static str {
        match self {
            Self::Classify { .. } => "accuracy",
            Self::Tag { .. } => "token accuracy",
            Self::Mlm { .. } => "masked-token accuracy",
            Self::Lm { .. } => "next-token accuracy",
        }
    }
}

/// An example: words, labels per sentence or per word, and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    /// The words.
    pub words: Vec<String>,
    /// What the words are labelled with.
    pub label: Label,
    /// File and line, for examples read from files.
    pub source: Option<Source>,
}

/// An example's label.
#[derive(Clone, Debug, PartialEq)]
pub enum Label {
    /// A class id for the sentence.
    Class(usize),
    /// Per word; `None` is not scored.
    Tags(Vec<Option<usize>>),
    /// MLM targets are drawn when batches are made.
    Masked,
    /// A length-suite tape ([`algorithmic`]): the last `targets.len()` words are blanks, each
    /// labelled with its target; the loss covers them all, the accuracy the first `counted`.
    /// `length` is the task's input length (what scores are reported by).
    Outputs {
        /// The task's input length.
        length: usize,
        /// One target per blank.
        targets: Vec<usize>,
        /// How many leading blanks the accuracy counts.
        counted: usize,
    },
}

impl Example {
    /// An example not read from a file.
    pub fn new(words: Vec<String>, label: Label) -> Self {
        Self {
            words,
            label,
            source: None,
        }
    }

    /// The words joined by spaces.
    pub fn text(&self) -> String {
        self.words.join(" ")
    }

    /// The length a test reports it at: a length-suite tape's input length, otherwise its
    /// words.
    pub fn length(&self) -> usize {
        match self.label {
            Label::Outputs { length, .. } => length,
            _ => self.words.len(),
        }
    }
}

impl TestSet {
    /// The one test set of a task read from files, at the lengths its examples have.
    fn of_file(examples: Vec<Example>) -> Self {
        let lengths = length_range(&examples);
        Self {
            name: "1x".into(),
            factor: Some(1),
            lengths,
            examples,
        }
    }

    /// The shortest and longest length actually tested (`lengths` names what was asked for).
    pub fn tested_lengths(&self) -> [usize; 2] {
        let lengths = self.examples.iter().map(Example::length);
        match (lengths.clone().min(), lengths.max()) {
            (Some(lo), Some(hi)) => [lo, hi],
            _ => self.lengths,
        }
    }
}

/// A test set: at a multiple of the training lengths, or over a range of lengths.
#[derive(Clone, Debug)]
pub struct TestSet {
    /// The column it fills: `2x` for a factor, `41-100` for a range.
    pub name: String,
    /// `lengths` of the training set times this (1 for files); `None` for a range of
    /// `test_lengths` (or the training range beside them).
    pub factor: Option<usize>,
    /// Inclusive range of lengths in words.
    pub lengths: [usize; 2],
    /// The examples.
    pub examples: Vec<Example>,
}

/// A task, generated or read: tokenizer, objective and every split.
#[derive(Clone, Debug)]
pub struct TaskData {
    /// The task's name.
    pub name: String,
    /// What the task is.
    pub kind: TaskKind,
    /// What the model predicts, with the label names.
    pub objective: Objective,
    /// The tokenizer the task's texts are read with.
    pub tokenizer: TextTokenizer,
    /// The training examples.
    pub train: Vec<Example>,
    /// Same distribution as `train`: periodic evaluation and early stopping.
    pub valid: Vec<Example>,
    /// The test sets, in report order.
    pub tests: Vec<TestSet>,
    /// The best accuracy any order-blind model can reach, where the task makes that a number.
    pub order_blind_ceiling: Option<OrderBlindCeiling>,
    /// What to do with inputs that are too long.
    pub limit: TokenLimit,
}

impl TaskData {
    /// The range of training lengths in words.
    pub fn train_lengths(&self) -> [usize; 2] {
        length_range(&self.train)
    }
}

/// The accuracy a model that sees only the bag of words cannot beat, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OrderBlindCeiling {
    /// The ceiling, in [0, 1].
    pub accuracy: f64,
    /// Why no order-blind model beats it.
    pub reason: String,
}

/// The shortest and longest example, in words.
fn length_range(examples: &[Example]) -> [usize; 2] {
    let lens = examples.iter().map(|e| e.words.len());
    [lens.clone().min().unwrap_or(0), lens.max().unwrap_or(0)]
}

/// The longest length a generated task takes, in words (or a length-suite input length).
pub const MAX_GENERATED_LENGTH: usize = 100_000;

/// The most distinct words (or labels) a generated task's option may ask for: its word-level
/// vocabulary is built in memory, and each word is a row of the embedding table.
pub const MAX_TASK_VOCABULARY: usize = 100_000;

/// Checks a vocabulary-sized option of a generated task against [`MAX_TASK_VOCABULARY`].
pub(crate) fn check_vocabulary(
    task: &str,
    option: &str,
    value: usize,
) -> std::result::Result<(), String> {
    if value > MAX_TASK_VOCABULARY {
        return Err(format!(
            "{task}: {option} = {value} asks for more distinct words than a generated task takes \
             ({MAX_TASK_VOCABULARY}): lower {option}"
        ));
    }
    Ok(())
}

/// A task's examples split for training and testing, what they are scored on, and the task's
/// own vocabulary (for a word-level tokenizer) or its own tokenizer.
struct Splits {
    train: Vec<Example>,
    valid: Vec<Example>,
    tests: Vec<TestSet>,
    objective: Objective,
    vocabulary: Option<Vec<String>>,
    tokenizer: Option<TextTokenizer>,
}

/// The split an example is drawn for: a generator draws every split alike, a text file's
/// windows come from its own part for each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Train = 0,
    Valid = 1,
    Test = 2,
}

impl TaskSpec {
    /// A task from one TOML table, as a config's `[[tasks]]` writes it (checked as a run
    /// checks it): the way to make a built-in task from code.
    ///
    /// ```
    /// use poslab::data::{make_batch, Dataset, Framing};
    /// use poslab::prelude::*;
    /// use poslab::tasks::TaskSpec;
    ///
    /// // Which entity of a generated sentence did the action: 8 classes, 5 to 12 words.
    /// let spec = TaskSpec::from_toml_str(
    ///     "kind = \"word_order\"\nlengths = [5, 12]\ntrain_examples = 64\neval_examples = 16",
    /// )?;
    /// let task = spec.generate()?; // every split, the objective and a word-level tokenizer
    /// assert_eq!((task.train.len(), task.valid.len()), (64, 16));
    /// assert_eq!(task.tests.len(), 3); // at 1x, 2x and 4x the training lengths
    ///
    /// // Token ids, then a padded batch of the first 32 examples, then one training step.
    /// let train = Dataset::encode(&task.train, &task.tokenizer, Framing::Plain, task.limit)?;
    /// let samples: Vec<_> = train.samples.iter().take(32).collect();
    /// let batch = make_batch(&samples, task.tokenizer.pad_id(), None, &Device::Cpu)?;
    /// let head = task.objective.head(Pooling::Mean);
    /// let config = ModelConfig::default()
    ///     .with_vocab_size(task.tokenizer.vocab_size())
    ///     .with_positional(PositionalConfig::Rope(RopeOptions::default()));
    /// let mut learner = Learner::new(&config, &head, 0, &Device::Cpu)?;
    /// let loss = learner.step(&batch.ids, &batch.mask, &batch.targets)?;
    /// assert!(loss > 1.0); // about ln 8 before any training
    /// # Ok::<(), poslab::Error>(())
    /// ```
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let spec: Self = toml::from_str(text).map_err(|e| Error::Config(e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    /// The length ranges of a generated task's test sets, in order: `lengths` times each
    /// factor, or the training range and then each of `test_lengths`.
    pub fn test_ranges(&self) -> Vec<[usize; 2]> {
        let Some([lo, hi]) = self.lengths else {
            return Vec::new();
        };
        if self.test_lengths.is_empty() {
            self.eval_factors
                .iter()
                .map(|&f| [lo.saturating_mul(f), hi.saturating_mul(f)])
                .collect()
        } else {
            std::iter::once([lo, hi])
                .chain(self.test_lengths.iter().copied())
                .collect()
        }
    }

    /// From now on the task's relative paths resolve against `dir`: the folder of the config
    /// file it was read from (made absolute, so that a later change of directory keeps it).
    pub fn resolve_from(&mut self, dir: &Path) {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        self.base = PathBase(Some(
            dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf()),
        ));
    }

    /// The task with each of its paths as it is read ([`PathBase::join`]), each checked to
    /// exist: a missing one is refused with where it was looked for.
    pub fn resolved(&self) -> Result<std::borrow::Cow<'_, Self>> {
        let mut task = self.clone();
        let paths = task.paths_mut();
        if paths.is_empty() {
            return Ok(std::borrow::Cow::Borrowed(self));
        }
        for (key, path) in paths {
            *path = self
                .base
                .existing(key, path)
                .map_err(|e| Error::Config(format!("task `{}`: {e}", self.name)))?;
        }
        Ok(std::borrow::Cow::Owned(task))
    }

    /// The paths the task holds, by their keys.
    fn paths_mut(&mut self) -> Vec<(&'static str, &mut PathBuf)> {
        let mut paths = Vec::new();
        match &mut self.kind {
            TaskKind::Classify(o) | TaskKind::Tag(o) => {
                paths.push(("train", &mut o.train));
                paths.extend(o.valid.as_mut().map(|p| ("valid", p)));
                paths.extend(o.test.as_mut().map(|p| ("test", p)));
            }
            TaskKind::Mlm(Mlm { text_file, .. }) | TaskKind::Lm(Lm { text_file, .. }) => {
                paths.extend(text_file.as_mut().map(|p| ("text_file", p)));
            }
            _ => {}
        }
        if let TokenizerSpec::File { path } = &mut self.tokenizer {
            paths.push(("tokenizer.path", path));
        }
        paths
    }

    /// The files the task reads its examples from (none for a generated task).
    pub fn input_files(&self) -> Vec<PathBuf> {
        let mut task = self.clone();
        task.paths_mut()
            .into_iter()
            .filter(|(key, _)| *key != "tokenizer.path")
            .map(|(_, p)| self.base.join(p))
            .collect()
    }

    /// Words of an example of length `len`: a length-suite tape holds its blanks too.
    fn words_at(&self, len: usize) -> usize {
        self.kind.generator().map_or(len, |g| g.words_at(len))
    }

    /// The most words the splits of a generated task can hold (0 for files).
    fn max_words(&self) -> u128 {
        let Some([_, hi]) = self.lengths else {
            return 0;
        };
        let n_eval = self.eval_examples.unwrap_or(DEFAULT_EVAL_EXAMPLES) as u128;
        let n_train = self.train_examples.unwrap_or(DEFAULT_TRAIN_EXAMPLES) as u128;
        let tests: u128 = self
            .test_ranges()
            .iter()
            .map(|r| self.words_at(r[1]) as u128)
            .sum();
        (n_train + n_eval) * self.words_at(hi) as u128 + n_eval * tests
    }

    /// Refuses a generated task whose words would take more memory than `limits` allow
    /// (checked before anything is generated).
    pub fn check_limits(&self, limits: &crate::limits::Limits) -> Result<()> {
        limits
            .check_generated(self.max_words(), &format!("task `{}`", self.name))
            .map_err(|m| Error::Config(format!("task `{}`: {m}", self.name)))
    }

    /// Checks the spec; the message names the field and the fix (its size against a run's
    /// limits is [`TaskSpec::check_limits`]).
    pub fn validate(&self) -> Result<()> {
        let err = |m: String| Err(Error::Config(format!("task `{}`: {m}", self.name)));
        self.tokenizer
            .validate()
            .map_err(|e| Error::Config(format!("task `{}`: {e}", self.name)))?;
        if self.limit.max_tokens == Some(0) {
            return err("max_tokens = 0, but it must be at least 1".into());
        }
        if self.limit.truncate && self.limit.max_tokens.is_none() {
            return err("truncate = true needs max_tokens, the length to cut to".into());
        }
        if self.train_examples == Some(0) || self.eval_examples == Some(0) {
            return err("train_examples and eval_examples must be at least 1".into());
        }
        if self.test_lengths.is_empty()
            && (self.eval_factors.is_empty() || self.eval_factors.contains(&0))
        {
            return err(format!(
                "eval_factors = {:?} must list positive multiples of the training lengths, such as [1, 2, 4]",
                self.eval_factors
            ));
        }
        if !self.test_lengths.is_empty() && self.kind.from_files() {
            return err(
                "test_lengths is for generated tasks: files are tested at their own lengths".into(),
            );
        }
        self.check_test_lengths().or_else(err)?;
        if self.kind.from_files() {
            return self.check_files().or_else(err);
        }
        let Some([lo, hi]) = self.lengths else {
            return err(
                "missing field `lengths`: a generated task needs lengths = [min, max] in words"
                    .into(),
            );
        };
        if lo == 0 || lo > hi || hi > MAX_GENERATED_LENGTH {
            return err(format!(
                "lengths = [{lo}, {hi}] must be a range [min, max] with 1 <= min <= max <= \
                 {MAX_GENERATED_LENGTH}"
            ));
        }
        let longest = self.test_ranges().iter().map(|r| r[1]).max().unwrap_or(hi);
        if longest > MAX_GENERATED_LENGTH {
            return err(format!(
                "eval_factors = {:?} make test lengths up to {longest}, more than \
                 {MAX_GENERATED_LENGTH}: use smaller factors",
                self.eval_factors
            ));
        }
        // A range of test_lengths is tested at every length it names (its examples go through
        // its lengths in turn), so it needs at least as many examples as lengths; so does the
        // training range, tested beside them.
        if !self.test_lengths.is_empty() {
            let n_eval = self.eval_examples.unwrap_or(DEFAULT_EVAL_EXAMPLES);
            let widest = self
                .test_ranges()
                .into_iter()
                .max_by_key(|[a, b]| b - a)
                .expect("a range");
            let width = widest[1] - widest[0] + 1;
            if n_eval < width {
                return err(format!(
                    "eval_examples = {n_eval} cannot test every length of the range {}-{} ({width} \
                     lengths; each test set has eval_examples examples, one length after \
                     another): set eval_examples to at least {width}, or narrow the range",
                    widest[0], widest[1]
                ));
            }
        }
        let shortest = self.test_ranges().iter().map(|r| r[0]).min().unwrap_or(lo);
        let lo = lo.min(shortest);
        if let Some((lm, _)) = self.kind.text_windows() {
            lm.check_text(&self.tokenizer).or_else(err)?;
            return lm.check(lo, longest).or_else(err);
        }
        match self.kind.generator() {
            Some(g) => g.check(lo, longest).or_else(err),
            None => Ok(()),
        }
    }

    /// Checks `test_lengths`: ranges within bounds, ascending, without overlap.
    fn check_test_lengths(&self) -> std::result::Result<(), String> {
        for (i, &[a, b]) in self.test_lengths.iter().enumerate() {
            if a == 0 || a > b || b > MAX_GENERATED_LENGTH {
                return Err(format!(
                    "test_lengths[{i}] = [{a}, {b}] must be a range [min, max] with 1 <= min <= \
                     max <= {MAX_GENERATED_LENGTH}"
                ));
            }
            if let Some(&[_, prev]) = i.checked_sub(1).map(|j| &self.test_lengths[j]) {
                if a <= prev {
                    return Err(format!(
                        "test_lengths[{i}] = [{a}, {b}] starts at or before the end of the range \
                         before it ({prev}): list the ranges in ascending order, without overlap"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks a task read from files: no generated-task fields, its own options.
    fn check_files(&self) -> std::result::Result<(), String> {
        if self.lengths.is_some() {
            return Err(
                "`lengths` is for generated tasks; a file's examples have their own \
                        lengths (bound them with max_tokens)"
                    .into(),
            );
        }
        if self.eval_factors != [1] {
            return Err(
                "eval_factors is for generated tasks: files are tested at their own lengths".into(),
            );
        }
        match &self.kind {
            TaskKind::Classify(o) | TaskKind::Tag(o) => o.validate(),
            TaskKind::Mlm(m) => m.check_options(),
            _ => Ok(()),
        }
    }

    /// Refuses next-token prediction (`lm`) for a model without a causal mask, which would read
    /// at each position the token it is asked for.
    pub fn check_causal(&self, causal: bool) -> std::result::Result<(), String> {
        if matches!(self.kind, TaskKind::Lm(_)) && !causal {
            return Err(format!(
                "task `{}`: kind = \"lm\" predicts each next token, which a model without a \
                 causal mask reads at the next position: set causal = true in [model] (or on the \
                 variant), or use kind = \"mlm\", the encoder's counterpart",
                self.name
            ));
        }
        Ok(())
    }

    /// Generates or reads every split and builds the tokenizer, Hub files through the
    /// environment's cache settings.
    pub fn generate(&self) -> Result<TaskData> {
        self.generate_with(&HubSource::from_env(), None)
    }

    /// As [`TaskSpec::generate`], with Hub files looked up in `hub`, and `tokenizer` used as it
    /// is when given (a resumed run reuses the one it saved) instead of being built.
    pub fn generate_with(
        &self,
        hub: &HubSource,
        tokenizer: Option<TextTokenizer>,
    ) -> Result<TaskData> {
        self.generate_sampled(hub, tokenizer, None)
    }

    /// What a dry run counts from: as [`TaskSpec::generate`], but a generated task's training
    /// split holds at most `train` examples and each other split at most `eval`: the first of
    /// the split [`TaskSpec::generate`] makes (the same streams, cut short; a test range's
    /// lengths are taken in turn, and whole turns of them, so each length weighs the same). A
    /// task read from files, or whose tokenizer is trained on its texts, is made whole. The
    /// sizes of the whole splits are [`TaskSpec::generated_sizes`].
    pub fn generate_sample(&self, train: usize, eval: usize) -> Result<TaskData> {
        self.generate_sampled(
            &HubSource::from_env(),
            None,
            Some([train, eval].map(|c| c.max(1))),
        )
    }

    /// The sizes of a generated task's whole splits (or a text file's windows): training
    /// examples, and the examples of the validation set and of each test set; `None` for a
    /// task read from files at their own lengths.
    pub fn generated_sizes(&self) -> Option<(usize, usize)> {
        (!self.kind.from_files()).then(|| {
            (
                self.train_examples.unwrap_or(DEFAULT_TRAIN_EXAMPLES),
                self.eval_examples.unwrap_or(DEFAULT_EVAL_EXAMPLES),
            )
        })
    }

    fn generate_sampled(
        &self,
        hub: &HubSource,
        tokenizer: Option<TextTokenizer>,
        caps: Option<[usize; 2]>,
    ) -> Result<TaskData> {
        self.validate()?;
        self.resolved()?.generate_resolved(hub, tokenizer, caps)
    }

    /// As [`TaskSpec::generate_sampled`], every path the task holds as it is read.
    fn generate_resolved(
        &self,
        hub: &HubSource,
        tokenizer: Option<TextTokenizer>,
        caps: Option<[usize; 2]>,
    ) -> Result<TaskData> {
        // A tokenizer trained on the training texts is that of the whole split: no sample then.
        let caps = caps.filter(|_| !matches!(self.tokenizer, TokenizerSpec::Train { .. }));
        let Splits {
            train,
            valid,
            tests,
            objective,
            vocabulary,
            tokenizer: own_tokenizer,
        } = match (&self.kind, self.kind.generator()) {
            (_, Some(g)) => self.generated(g, caps.unwrap_or([usize::MAX; 2]))?,
            (TaskKind::Lm(l), None) => {
                let path = l
                    .text_file
                    .as_deref()
                    .expect("an lm task without a generator reads a file");
                l.text_splits(path, self, caps.unwrap_or([usize::MAX; 2]))?
            }
            (TaskKind::Classify(o), _) => {
                labelled::splits(o, RecordKind::Class, self.data_seed, self.train_examples)?
            }
            (TaskKind::Tag(o), _) => {
                labelled::splits(o, RecordKind::Tags, self.data_seed, self.train_examples)?
            }
            (TaskKind::Mlm(m), _) => {
                let path = m
                    .text_file
                    .as_deref()
                    .expect("an MLM task without a generator reads a file");
                m.split_text_file(
                    path,
                    self.data_seed,
                    self.eval_examples.unwrap_or(DEFAULT_EVAL_EXAMPLES),
                    self.train_examples,
                )?
            }
            (kind, None) => unreachable!("`{}` is generated", kind.name()),
        };
        let texts: Vec<Vec<String>> = train.iter().map(|e| e.words.clone()).collect();
        let vocabulary = match self.tokenizer {
            TokenizerSpec::WordLevel { .. } => vocabulary,
            _ => None,
        };
        let tokenizer = match tokenizer.or(own_tokenizer) {
            Some(t) => t,
            None => self
                .tokenizer
                .build(vocabulary.as_deref(), &texts, hub)
                .map_err(|e| Error::Config(format!("task `{}`: {e}", self.name)))?,
        };
        let order_blind_ceiling = self.kind.generator().and_then(|g| g.order_blind_ceiling());
        Ok(TaskData {
            name: self.name.clone(),
            kind: self.kind.clone(),
            objective,
            tokenizer,
            train,
            valid,
            tests,
            order_blind_ceiling,
            limit: self.limit,
        })
    }

    /// A training set of its own for the training seed `seed`, for experiments whose seeds
    /// draw their training data (`data_seed = "per_seed"`): a generated task's training split
    /// generated afresh from a stream of the seed's (as many examples, the same lengths); a
    /// task read from files, which has one training split, resampled from it with replacement
    /// (a bootstrap of as many examples, Bouthillier et al. 2021). `data` is the task as
    /// [`TaskSpec::generate`] made it; its validation and test sets are every seed's.
    pub fn training_draw(&self, data: &TaskData, seed: u64) -> Result<Vec<Example>> {
        let label = format!("task/{}/train/seed{seed}", self.name);
        let mut rng = rng::stream(self.data_seed, &label);
        if let Some(g) = self.kind.generator() {
            let [lo, hi] = self
                .lengths
                .expect("validated: generated tasks have lengths");
            let n = data.train.len();
            return Ok((0..n)
                .map(|_| {
                    let len = rng.random_range(lo..=hi);
                    g.example(&mut rng, len)
                })
                .collect());
        }
        if data.train.is_empty() {
            return Err(Error::Config(format!(
                "task `{}` has no training examples to draw from",
                self.name
            )));
        }
        Ok((0..data.train.len())
            .map(|_| data.train[rng.random_range(0..data.train.len())].clone())
            .collect())
    }

    /// The splits of a generated task (cut to their first `train_cap` and `eval_cap` examples),
    /// its objective and its own vocabulary.
    fn generated(&self, g: &dyn Generator, caps: [usize; 2]) -> Result<Splits> {
        let (train, valid, tests) = self.drawn(&|_, rng, len| g.example(rng, len), caps);
        let (objective, vocabulary) = g.objective();
        Ok(Splits {
            train,
            valid,
            tests,
            objective,
            vocabulary: Some(vocabulary),
            tokenizer: None,
        })
    }

    /// The training examples, the validation examples and the test sets at the lengths the
    /// spec asks for (cut to their first `train_cap` and `eval_cap` examples), each drawn by
    /// `draw` for its part.
    fn drawn(
        &self,
        draw: &dyn Fn(Part, &mut Rng, usize) -> Example,
        [train_cap, cap]: [usize; 2],
    ) -> (Vec<Example>, Vec<Example>, Vec<TestSet>) {
        let [lo, hi] = self
            .lengths
            .expect("validated: generated tasks have lengths");
        // The first `n` examples of a split, lengths drawn at random.
        let make = |split: &str, part: Part, n: usize, lengths: [usize; 2]| -> Vec<Example> {
            let mut rng = rng::stream(self.data_seed, &format!("task/{}/{split}", self.name));
            (0..n)
                .map(|_| {
                    let len = rng.random_range(lengths[0]..=lengths[1]);
                    draw(part, &mut rng, len)
                })
                .collect()
        };
        // A range's lengths in turn, so each is tested equally often (its score is then the
        // mean over lengths, as the length suite reports it).
        let make_even = |split: &str, n: usize, [a, b]: [usize; 2]| -> Vec<Example> {
            let mut rng = rng::stream(self.data_seed, &format!("task/{}/{split}", self.name));
            // A sample holds whole turns of the range, so that every length weighs the same.
            let width = b - a + 1;
            let n = match n > cap {
                true => cap.div_ceil(width).saturating_mul(width).min(n),
                false => n,
            };
            (0..n)
                .map(|i| draw(Part::Test, &mut rng, a + i % width))
                .collect()
        };
        let n_eval = self.eval_examples.unwrap_or(DEFAULT_EVAL_EXAMPLES);
        let tests = if self.test_lengths.is_empty() {
            self.eval_factors
                .iter()
                .map(|&f| {
                    let lengths = [lo * f, hi * f];
                    TestSet {
                        name: format!("{f}x"),
                        factor: Some(f),
                        lengths,
                        examples: make(&format!("test{f}x"), Part::Test, n_eval.min(cap), lengths),
                    }
                })
                .collect()
        } else {
            self.test_ranges()
                .into_iter()
                .map(|lengths| {
                    let name = format!("{}-{}", lengths[0], lengths[1]);
                    TestSet {
                        examples: make_even(&format!("test{name}"), n_eval, lengths),
                        name,
                        factor: None,
                        lengths,
                    }
                })
                .collect()
        };
        let n_train = self.train_examples.unwrap_or(DEFAULT_TRAIN_EXAMPLES);
        let train = make("train", Part::Train, n_train.min(train_cap), [lo, hi]);
        let valid = make("valid", Part::Valid, n_eval.min(cap), [lo, hi]);
        (train, valid, tests)
    }
}

#[cfg(test)]
mod tests {
    use super::sorted::number_word;
    use super::symbols::symbol_word;
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
        assert_eq!(t.kind, TaskKind::PrevToken(PrevToken { k: 2, symbols: 16 }));
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
        assert!(e.contains("1 <= k < the shortest length"), "{e}");
        let e = spec("[[tasks]]\nkind = \"word_order\"\nlengths = [3, 9]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 5 words"), "{e}");
        let e = spec("[[tasks]]\nkind = \"sorted\"\nmax_number = 20\nlengths = [4, 8]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("longest test length 32"), "{e}");
    }

    /// An option that asks for billions of distinct words is refused by name before the
    /// vocabulary is built (it was an allocation of 96 GB, and an abort).
    #[test]
    fn a_vocabulary_past_the_bound_is_refused_before_it_is_built() {
        for (kind, options, option) in [
            ("prev_token", "k = 1\nsymbols = 4000000000", "symbols"),
            ("position_index", "symbols = 100001", "symbols"),
            ("position_index", "modulus = 4000000000", "modulus"),
            ("mqar", "values = 200000", "values"),
        ] {
            let e = spec(&format!(
                "[[tasks]]\nkind = \"{kind}\"\n{options}\nlengths = [4, 8]\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(
                e.contains(&format!("{option} = ")) && e.contains(&format!("lower {option}")),
                "{e}"
            );
        }
        spec("[[tasks]]\nkind = \"prev_token\"\nk = 1\nsymbols = 100000\nlengths = [4, 8]\n")
            .unwrap();
    }

    #[test]
    fn every_generator_makes_examples_of_the_words_it_promises() {
        let kinds: Vec<TaskKind> = [
            TaskKind::WordOrder(WordOrder {}),
            TaskKind::Sorted(Sorted { max_number: 64 }),
            TaskKind::PrevToken(PrevToken { k: 2, symbols: 5 }),
            TaskKind::PositionIndex(PositionIndex {
                modulus: 3,
                symbols: 5,
            }),
            TaskKind::Mlm(Mlm {
                mask_prob: 0.15,
                text_file: None,
            }),
            TaskKind::Mqar(Mqar {
                keys: 8,
                values: 8,
                queries: 0.5,
            }),
            TaskKind::FlipFlop(FlipFlop::default()),
            TaskKind::Lm(Lm::default()),
        ]
        .into_iter()
        .chain(Algorithmic::ALL.map(TaskKind::Algorithmic))
        .collect();
        let mut rng = rng::stream(7, "generators");
        for kind in &kinds {
            let g = kind.generator().expect("built in");
            assert!(!kind.from_files());
            let (objective, vocabulary) = g.objective();
            let classes = match &objective {
                Objective::Classify { labels }
                | Objective::Tag { labels }
                | Objective::Lm { labels } => labels.len(),
                Objective::Mlm { .. } => usize::MAX,
            };
            for len in [5, 8, 13] {
                g.check(len, len).unwrap();
                let e = g.example(&mut rng, len);
                assert_eq!(e.words.len(), g.words_at(len), "{} at {len}", kind.name());
                assert!(
                    e.words.iter().all(|w| vocabulary.contains(w)),
                    "{}: a word outside its vocabulary",
                    kind.name()
                );
                let ids: Vec<usize> = match &e.label {
                    Label::Class(c) => vec![*c],
                    Label::Tags(t) => t.iter().flatten().copied().collect(),
                    Label::Outputs { targets, .. } => targets.clone(),
                    Label::Masked => Vec::new(),
                };
                assert!(ids.iter().all(|&i| i < classes), "{}", kind.name());
            }
        }
        let files = TaskKind::Mlm(Mlm {
            mask_prob: 0.15,
            text_file: Some("lines.txt".into()),
        });
        assert!(files.from_files() && files.generator().is_none());
    }

    /// A dry run's sample is the start of each split the run makes, a test range's sample whole
    /// turns of its lengths; a tokenizer trained on the texts gets every example.
    #[test]
    fn a_sample_is_the_start_of_each_split() {
        let t = spec(
            "[[tasks]]\nkind = \"reverse_string\"\nlengths = [1, 10]\ntest_lengths = [[11, 17], [18, 40]]\ntrain_examples = 500\neval_examples = 100\n",
        )
        .unwrap();
        let whole = t.generate().unwrap();
        let sample = t.generate_sample(120, 30).unwrap();
        assert_eq!(sample.train, whole.train[..120]);
        assert_eq!(sample.valid, whole.valid[..30]);
        // The training range's test first: 30 of [1, 10] is 3 whole turns; 30 of [11, 17] (7
        // lengths) rounds up to 5 turns, 35; of [18, 40] (23), to 46.
        let sizes: Vec<usize> = sample.tests.iter().map(|t| t.examples.len()).collect();
        assert_eq!(sizes, [30, 35, 46]);
        for (s, w) in sample.tests.iter().zip(&whole.tests) {
            assert_eq!(s.examples, w.examples[..s.examples.len()]);
        }
        assert_eq!(t.generated_sizes(), Some((500, 100)));
        // A cap above a split's size takes the whole split.
        let all = t.generate_sample(10_000, 10_000).unwrap();
        assert_eq!(all.train, whole.train);
        assert!(all
            .tests
            .iter()
            .zip(&whole.tests)
            .all(|(a, b)| a.examples == b.examples));
        let trained = spec(
            "[[tasks]]\nkind = \"sorted\"\nlengths = [3, 6]\ntrain_examples = 300\ntokenizer = { kind = \"train\", model = \"wordpiece\", vocab_size = 80 }\n",
        )
        .unwrap();
        assert_eq!(trained.generate_sample(10, 10).unwrap().train.len(), 300);
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
