//! What a comparison records, and its aggregation over seeds.
//!
//! [`Results`] holds everything that is a function of the config and the seeds, so the same run
//! twice on the same machine writes the same `results.json`, byte for byte. Wall-clock
//! measurements live apart in [`Timing`] (`timing.json`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::verdict::{Comparison, ExampleOutcomes, Skipped};
use crate::positional::PositionalConfig;
use crate::tasks::OrderBlindCeiling;
pub use crate::train::LengthScore;

/// A test set of a task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TestInfo {
    /// Column name: `1x`, `2x`, ... for factors of the training lengths, `41-100` for ranges.
    pub name: String,
    /// The multiple of the training lengths; absent for a range of `test_lengths`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<usize>,
    /// Inclusive range of the lengths tested (in words, or the length suite's input lengths):
    /// the shortest and the longest example of the test set.
    pub lengths: [usize; 2],
    /// How many examples the test set has (the shuffle and shift tests run on the first test
    /// set's examples). `0` in records made before poslab counted them.
    #[serde(default)]
    pub examples: usize,
    /// Every example's length, in the test set's order, where its outcomes do not say it
    /// themselves (the length suite's do, by stratum): packed as [`Examples`] packs outcomes.
    /// What the curves by length read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub example_lengths: Option<String>,
}

impl TestInfo {
    /// Packs the lengths of a test set's examples, in order, for [`TestInfo::example_lengths`].
    pub fn pack_lengths(lengths: impl Iterator<Item = usize>) -> String {
        pack_varints(lengths.map(|l| u32::try_from(l).unwrap_or(u32::MAX)))
    }

    /// Each example's length, in order, checked against the test's size and its range; `None`
    /// where they are not recorded.
    pub fn lengths_of_examples(&self) -> std::result::Result<Option<Vec<usize>>, String> {
        let Some(packed) = &self.example_lengths else {
            return Ok(None);
        };
        if self.examples == 0 || self.examples > MAX_EXAMPLES {
            return Err(format!(
                "test `{}`: example lengths for {} examples (1 to {MAX_EXAMPLES} are recorded)",
                self.name, self.examples
            ));
        }
        let lengths = unpack_varints(packed, self.examples, "example lengths")
            .map_err(|e| format!("test `{}`: {e}", self.name))?;
        let [lo, hi] = self.lengths;
        match lengths
            .iter()
            .find(|&&l| (l as usize) < lo || (l as usize) > hi)
        {
            Some(l) => Err(format!(
                "test `{}`: an example of length {l} outside its lengths {lo}-{hi}",
                self.name
            )),
            None => Ok(Some(lengths.into_iter().map(|l| l as usize).collect())),
        }
    }
}

/// A task as the results record it: what it measures, at which lengths, and which columns it has.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskInfo {
    /// The task's name in the experiment config.
    pub name: String,
    /// Its kind: a built-in task's name, `classify_file`, a length-suite task's name, ...
    pub kind: String,
    /// What `accuracy` counts: per sentence, per token, per masked token or per output.
    pub metric: String,
    /// Inclusive range of the training lengths (words, or the length suite's input lengths).
    pub train_lengths: [usize; 2],
    /// The test sets, in report order.
    pub tests: Vec<TestInfo>,
    /// The shift test's offset, `None` where it is not run.
    pub shift: Option<usize>,
    /// Whether the shuffle test applies (sentence labels only).
    pub shuffle_test: bool,
    /// The best accuracy a model blind to word order could reach, where the task defines one.
    pub order_blind_ceiling: Option<OrderBlindCeiling>,
    /// The size of the task's vocabulary (its tokenizer's).
    pub vocab_size: usize,
    /// What was done to the data (truncation), for the report.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// The length suite's [`SCORE`] column: the mean accuracy over every test length above this
    /// one, the longest trained on (Ruoss et al. 2023). `None` for other tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score_above: Option<usize>,
}

impl TaskInfo {
    /// Whether only a causal variant runs the task: next-token prediction.
    pub fn needs_causal(&self) -> bool {
        self.kind == crate::tasks::TaskKind::Lm(Default::default()).name()
    }

    /// The test set the shuffle and shift tests run on: the one at the training lengths (the
    /// first of a range list).
    pub fn base_test(&self) -> Option<&TestInfo> {
        let i = base_test_index(self.tests.iter().map(|t| t.factor));
        self.tests.get(i)
    }

    /// The test set evaluation column `name` runs on: its own for a test set, the base test
    /// ([`TaskInfo::base_test`]) for the shuffle and shift tests, `None` for the length suite's
    /// score (which gathers several).
    pub fn test_of(&self, name: &str) -> Option<&TestInfo> {
        match self.tests.iter().find(|t| t.name == name) {
            Some(t) => Some(t),
            None if name == SCORE => None,
            None => self.base_test(),
        }
    }

    /// Every evaluation column, in report order.
    pub fn columns(&self) -> Vec<String> {
        let mut cols: Vec<String> = self.tests.iter().map(|t| t.name.clone()).collect();
        if self.score_above.is_some() {
            cols.push(SCORE.into());
        }
        if self.shuffle_test {
            cols.push(SHUFFLED.into());
        }
        if let Some(s) = self.shift {
            cols.push(shift_column(s));
        }
        cols
    }
}

/// Which of the test sets, with these factors in order, the shuffle and shift tests run on:
/// the one at the training lengths (factor 1), else the first.
pub fn base_test_index(factors: impl Iterator<Item = Option<usize>>) -> usize {
    factors.into_iter().position(|f| f == Some(1)).unwrap_or(0)
}

/// The shuffle test's column: accuracy on test sentences with their words shuffled.
pub const SHUFFLED: &str = "shuffled";

/// The length suite's score column: mean accuracy over every test length past training.
pub const SCORE: &str = "score";

/// The shift test's column name for an offset: `shift+N`.
pub fn shift_column(shift: usize) -> String {
    format!("shift+{shift}")
}

/// A variant as the results record it: its scheme and the widths it gives the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VariantInfo {
    /// The variant's name in the experiment config.
    pub name: String,
    /// Its positional scheme, with every option spelled out.
    pub positional: PositionalConfig,
    /// `nowhere`, `input`, `attention` or `attention bias`, then `, random N` with randomized
    /// positions drawn from `[0, N)`, and `, causal` in a causal model.
    pub placement: String,
    /// The model width.
    pub d_model: usize,
    /// The width of the token embedding (below `d_model` when positions are concatenated).
    pub token_dim: usize,
    /// How the width is made: `64`, `64 = 48+16` (concatenated), `64+16->64` (projected).
    pub width: String,
    /// Randomized positions drawn from `[0, N)`, if the variant uses them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub random_positions: Option<usize>,
    /// What each layer does, if the variant has a `[layers]` plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<crate::layers::LayerPlan>,
    /// Whether the model is causal (a decoder's mask).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub causal: bool,
}

/// A score, or why there is none.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Accuracy and loss on a test set.
    Scored {
        /// The share of counted outputs that are right (see [`TaskInfo::metric`]).
        accuracy: f64,
        /// The mean cross-entropy over counted outputs.
        loss: f64,
        /// Length-suite tests: the share of examples whose every counted output is right (the
        /// mean over lengths, as `accuracy`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sequence_accuracy: Option<f64>,
        /// Length-suite tests: the scores at each input length; `accuracy`, `loss` and
        /// `sequence_accuracy` are their means over lengths.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        by_length: Vec<LengthScore>,
    },
    /// The test could not run for this cell.
    Unavailable {
        /// Why, in words (for example: lengths beyond a learned table).
        reason: String,
    },
}

impl Outcome {
    /// A plain score: accuracy and loss.
    pub fn scored(accuracy: f64, loss: f64) -> Self {
        Self::Scored {
            accuracy,
            loss,
            sequence_accuracy: None,
            by_length: Vec::new(),
        }
    }

    /// Scores by length, summarised by their means over lengths (each length weighs the same,
    /// however many examples it has, as in the DeepMind evaluation).
    pub fn by_length(by_length: Vec<LengthScore>) -> Self {
        let n = by_length.len().max(1) as f64;
        let mean = |f: fn(&LengthScore) -> f64| by_length.iter().map(f).sum::<f64>() / n;
        Self::Scored {
            accuracy: mean(|s| s.accuracy),
            loss: mean(|s| s.loss),
            sequence_accuracy: Some(mean(|s| s.sequence_accuracy)),
            by_length,
        }
    }
}

/// One test set's outcome for one cell.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    /// The column: a test set's name, [`SCORE`], [`SHUFFLED`] or a [`shift_column`].
    pub name: String,
    /// The score, or why there is none.
    pub outcome: Outcome,
    /// Every example's outcome, when scored: what comparisons pair across variants and seeds
    /// (see [`super::verdict`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub examples: Option<Examples>,
}

/// The most examples one evaluation records (a record claiming more is refused before it is
/// unpacked).
pub const MAX_EXAMPLES: usize = 50_000_000;

/// Every example's outcome of one evaluation, packed: in the test set's order within each
/// stratum (the length suite's input lengths, in increasing order; one stratum, labelled 0,
/// elsewhere), each example's counted outputs right and counted outputs.
///
/// `right` and `counted` are unsigned LEB128 varints, one per example, in base64 (standard
/// alphabet, padded): a sentence task's 500 examples take 668 characters. `counted` is absent
/// when every example counts one output (a sentence label).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Examples {
    /// `[stratum, examples]`, in order.
    pub strata: Vec<[usize; 2]>,
    /// Each example's right outputs.
    pub right: String,
    /// Each example's counted outputs; absent when all are 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counted: Option<String>,
}

impl Examples {
    /// Packs `(stratum, examples' (right, counted))` in order.
    pub fn pack(strata: &[(usize, Vec<(u32, u32)>)]) -> Self {
        let all = || strata.iter().flat_map(|(_, e)| e.iter());
        let all_one = all().all(|(_, c)| *c == 1);
        Self {
            strata: strata.iter().map(|(k, e)| [*k, e.len()]).collect(),
            right: pack_varints(all().map(|e| e.0)),
            counted: (!all_one).then(|| pack_varints(all().map(|e| e.1))),
        }
    }

    /// Examples in all (as the strata say).
    pub fn len(&self) -> usize {
        self.strata
            .iter()
            .map(|[_, n]| *n)
            .fold(0, usize::saturating_add)
    }

    /// Whether there is no example.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The outcomes back, checked: as many as the strata say, none right beyond its counted
    /// outputs, strata in increasing order; else what is wrong.
    pub fn unpack(&self) -> std::result::Result<super::verdict::ExampleOutcomes, String> {
        let n = self.len();
        if n == 0 || n > MAX_EXAMPLES {
            return Err(format!("{n} examples (1 to {MAX_EXAMPLES} are recorded)"));
        }
        if self.strata.windows(2).any(|w| w[0][0] >= w[1][0]) {
            return Err("strata out of order".into());
        }
        let right = unpack_varints(&self.right, n, "right outputs")?;
        let counted = match &self.counted {
            Some(c) => unpack_varints(c, n, "counted outputs")?,
            None => vec![1; n],
        };
        if let Some(i) = (0..n).find(|&i| right[i] > counted[i] || counted[i] == 0) {
            return Err(format!(
                "example {i}: {} right of {} counted outputs",
                right[i], counted[i]
            ));
        }
        let mut at = 0;
        let strata = self
            .strata
            .iter()
            .map(|[_, len]| {
                let part = (at..at + len).map(|i| (right[i], counted[i])).collect();
                at += len;
                part
            })
            .collect();
        Ok(super::verdict::ExampleOutcomes { strata })
    }
}

/// `values` as unsigned LEB128 varints, in base64 (standard alphabet, padded).
fn pack_varints(values: impl Iterator<Item = u32>) -> String {
    use base64::Engine as _;
    let mut bytes = Vec::new();
    for mut v in values {
        loop {
            let low = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                bytes.push(low);
                break;
            }
            bytes.push(low | 0x80);
        }
    }
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The `n` values [`pack_varints`] packed into `s`, checked; `what` names them in an error.
fn unpack_varints(s: &str, n: usize, what: &str) -> std::result::Result<Vec<u32>, String> {
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| format!("{what}: not base64 ({e})"))?;
    let mut out = Vec::with_capacity(n.min(bytes.len()));
    let (mut v, mut shift) = (0u64, 0u32);
    for b in bytes {
        v |= u64::from(b & 0x7f) << shift;
        shift += 7;
        if shift > 35 || v > u64::from(u32::MAX) {
            return Err(format!("{what}: a value beyond 32 bits"));
        }
        if b & 0x80 == 0 {
            out.push(v as u32);
            (v, shift) = (0, 0);
        }
    }
    if shift != 0 || out.len() != n {
        return Err(format!(
            "{what}: {} values for {n} examples{}",
            out.len(),
            if shift != 0 { " and a cut one" } else { "" }
        ));
    }
    Ok(out)
}

/// What training and testing one model came to: the part a cell's record (`results.json`) and
/// a `poslab train` run's `metrics.json` share.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainSummary {
    /// Trainable parameters of the model (encoder, scheme and head).
    pub params: usize,
    /// The model width.
    pub d_model: usize,
    /// The longest input the model was built for, in tokens.
    pub max_len: usize,
    /// Optimizer steps taken.
    pub steps: usize,
    /// Tokens seen in training, padding excluded.
    pub tokens: usize,
    /// The step whose weights were kept and tested (the best validation step).
    pub kept_step: usize,
    /// Whether early stopping ended training before its last step.
    pub stopped_early: bool,
    /// The mean training loss over the last window of steps.
    pub final_train_loss: f64,
    /// `(step, mean training loss)` over windows of steps.
    pub loss_curve: Vec<[f64; 2]>,
    /// `(step, validation accuracy)`.
    pub validation: Vec<[f64; 2]>,
    /// One outcome per column of the task, in report order: by length, shuffled, shifted.
    pub evaluations: Vec<Evaluation>,
}

/// One trained model: a task, a variant and a seed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CellResult {
    /// The task's name.
    pub task: String,
    /// The variant's name.
    pub variant: String,
    /// The seed: the cell's (`seed<N>`), which pairs it with the other variants' cells of that
    /// seed. It trained with this seed plus its variant's `seed_offset`.
    pub seed: u64,
    /// The fingerprint of the config that made the cell: the SHA-256 of the parts of the
    /// experiment's config that shape cells (its `run.json`'s `config_sha256`), which resumes
    /// and merges check.
    #[serde(default)]
    pub config_sha256: String,
    /// Training and test scores.
    #[serde(flatten)]
    pub summary: TrainSummary,
    /// The saved model, relative to the run folder.
    pub model_dir: String,
}

/// A cell's name in messages and logs: `task/variant/seedN`.
pub fn cell_name(task: &str, variant: &str, seed: u64) -> String {
    format!("{task}/{variant}/seed{seed}")
}

impl CellResult {
    /// `task/variant/seedN`.
    pub fn name(&self) -> String {
        cell_name(&self.task, &self.variant, self.seed)
    }

    /// The key cells are sorted, merged and matched by: `(task, variant, seed)`.
    pub fn key(&self) -> (String, String, u64) {
        (self.task.clone(), self.variant.clone(), self.seed)
    }

    /// The outcome in column `name`, if the cell has that column.
    pub fn evaluation(&self, name: &str) -> Option<&Outcome> {
        self.summary
            .evaluations
            .iter()
            .find(|e| e.name == name)
            .map(|e| &e.outcome)
    }
}

/// Wall-clock measurements of one cell.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// The task's name.
    pub task: String,
    /// The variant's name.
    pub variant: String,
    /// The seed.
    pub seed: u64,
    /// The device it ran on and its threads, as `device_name (threads)`.
    pub device: String,
    /// Seconds spent in training steps.
    pub train_seconds: f64,
    /// Training tokens per second of `train_seconds`.
    pub tokens_per_second: f64,
    /// Training, evaluation and saving.
    pub wall_seconds: f64,
}

/// Mean, sample standard deviation, min and max over seeds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stat {
    /// How many values.
    pub n: usize,
    /// Their mean.
    pub mean: f64,
    /// Their sample standard deviation (0 for one value).
    pub std: f64,
    /// The smallest.
    pub min: f64,
    /// The largest.
    pub max: f64,
}

impl Stat {
    /// The statistics of `values`; `None` when there are none.
    pub fn of(values: &[f64]) -> Option<Stat> {
        let n = values.len();
        if n == 0 {
            return None;
        }
        let mean = values.iter().sum::<f64>() / n as f64;
        let var = if n > 1 {
            values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64
        } else {
            0.0
        };
        Some(Stat {
            n,
            mean,
            std: var.sqrt(),
            min: values.iter().copied().fold(f64::INFINITY, f64::min),
            max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        })
    }
}

/// An aggregated column: statistics over the seeds that could run it, and the reason the others
/// could not.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Aggregate {
    /// The column's name.
    pub name: String,
    /// Accuracy over the seeds that scored it.
    pub accuracy: Option<Stat>,
    /// Loss over the seeds that scored it.
    pub loss: Option<Stat>,
    /// Length-suite columns: whole-sequence accuracy over seeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence_accuracy: Option<Stat>,
    /// Why the column is missing for some seeds, if it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

/// A task x variant row over seeds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SummaryRow {
    /// The task's name.
    pub task: String,
    /// The variant's name.
    pub variant: String,
    /// The seeds aggregated.
    pub seeds: Vec<u64>,
    /// Trainable parameters (the same for every seed).
    pub params: usize,
    /// The model width.
    pub d_model: usize,
    /// The final training loss over seeds.
    pub final_train_loss: Stat,
    /// One aggregate per column of the task, in report order.
    pub columns: Vec<Aggregate>,
}

/// What a partial merge lacks (`poslab report --allow-partial`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Partial {
    /// Cells merged, of the `of` the experiment has.
    pub cells: usize,
    /// Cells the experiment has.
    pub of: usize,
    /// The missing cells, `task/variant/seedN`.
    pub missing: Vec<String>,
}

impl std::fmt::Display for Partial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "partial: {} of {} cells", self.cells, self.of)
    }
}

/// Everything deterministic a comparison produced.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Results {
    /// The experiment's name.
    pub experiment: String,
    /// Set when the results lack cells of the experiment (a partial merge); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial: Option<Partial>,
    /// The tasks, in config order.
    pub tasks: Vec<TaskInfo>,
    /// The variants, in config order (re-scorings after the variant they score).
    pub variants: Vec<VariantInfo>,
    /// Every cell, in task order, then variant order, then seed.
    pub cells: Vec<CellResult>,
    /// One row per task and variant.
    pub summary: Vec<SummaryRow>,
    /// Verdicts: each comparison of the config on each task and evaluation (see
    /// [`super::verdict`]).
    #[serde(default)]
    pub comparisons: Vec<Comparison>,
    /// Comparisons that could not be made, with the reason (a variant could not run a test).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub comparisons_skipped: Vec<Skipped>,
    /// What a seed drew: the initialisation, batch order and dropout, and under `per_seed`
    /// the training set (the experiment's `data_seed`).
    #[serde(default)]
    pub data_seed: super::DataScope,
}

/// The comparisons a report states: the planned family (fixed before the run, sharing Holm's
/// correction) and the exploratory pairs (chosen after it began: never a verdict).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ComparisonPlan {
    /// `(a, b)` pairs planned before the run.
    pub planned: Vec<(String, String)>,
    /// `(a, b)` pairs chosen afterwards, not already planned.
    pub exploratory: Vec<(String, String)>,
}

impl ComparisonPlan {
    /// Only planned pairs.
    pub fn planned(planned: Vec<(String, String)>) -> Self {
        Self {
            planned,
            exploratory: Vec::new(),
        }
    }

    /// `planned` as a run recorded it at its start, with the pairs of `now` (a config's, or a
    /// report's request) that are not among them as exploratory, each once.
    pub fn of(planned: Vec<(String, String)>, now: &[(String, String)]) -> Self {
        let mut exploratory: Vec<(String, String)> = Vec::new();
        for pair in now {
            if !planned.contains(pair) && !exploratory.contains(pair) {
                exploratory.push(pair.clone());
            }
        }
        Self {
            planned,
            exploratory,
        }
    }
}

impl Results {
    /// Whether row `row` runs `task` at all: every row runs every task but next-token
    /// prediction, which an encoder's rows do not (the experiment has no cell of them).
    pub fn runs(&self, task: &TaskInfo, row: &str) -> bool {
        !task.needs_causal()
            || self
                .variants
                .iter()
                .find(|v| v.name == row)
                .is_none_or(|v| v.causal)
    }

    /// Whether the results hold a cell of `row` on `task` (a run of some of the variants holds
    /// none of the others).
    pub fn has_cells(&self, task: &str, row: &str) -> bool {
        self.cells
            .iter()
            .any(|c| c.task == task && c.variant == row)
    }

    /// Puts tasks and variants in the order `config` lists them (a variant's re-scorings right
    /// after it), then [`Results::finish`]es and states the comparisons of `plan`: the same
    /// cells give the same `results.json` however they were split across runs.
    pub fn order_as(&mut self, config: &super::ExperimentConfig, plan: &ComparisonPlan) {
        let tasks: Vec<&str> = config.tasks.iter().map(|t| t.name.as_str()).collect();
        let rows = config.variant_rows();
        let rank = |all: &[&str], name: &str| all.iter().position(|n| *n == name);
        self.tasks
            .sort_by_key(|t| rank(&tasks, &t.name).unwrap_or(usize::MAX));
        let rows: Vec<&str> = rows.iter().map(String::as_str).collect();
        self.variants
            .sort_by_key(|v| rank(&rows, &v.name).unwrap_or(usize::MAX));
        self.data_seed = config.data_seed;
        self.finish();
        self.compare(plan);
    }

    /// States the verdicts of `plan` on every task and evaluation column
    /// ([`Results::comparisons`], [`Results::comparisons_skipped`]).
    pub fn compare(&mut self, plan: &ComparisonPlan) {
        let (comparisons, skipped) = compare(self, plan);
        self.comparisons = comparisons;
        self.comparisons_skipped = skipped;
    }

    /// The pairs these results were compared by (stated or skipped), in order, by family.
    pub fn compared_pairs(&self) -> ComparisonPlan {
        let mut plan = ComparisonPlan::default();
        let all = self
            .comparisons
            .iter()
            .map(|c| (&c.a, &c.b, c.family))
            .chain(
                self.comparisons_skipped
                    .iter()
                    .map(|k| (&k.a, &k.b, k.family)),
            );
        for (a, b, family) in all {
            let pairs = match family {
                super::verdict::Family::Planned => &mut plan.planned,
                super::verdict::Family::Exploratory => &mut plan.exploratory,
            };
            if !pairs.iter().any(|(x, y)| x == a && y == b) {
                pairs.push((a.clone(), b.clone()));
            }
        }
        plan
    }

    /// Sorts cells (task order, then variant order, then seed) and recomputes the summary.
    pub fn finish(&mut self) {
        let task_pos: BTreeMap<&str, usize> = self
            .tasks
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.as_str(), i))
            .collect();
        let var_pos: BTreeMap<&str, usize> = self
            .variants
            .iter()
            .enumerate()
            .map(|(i, v)| (v.name.as_str(), i))
            .collect();
        let order = |c: &CellResult| {
            (
                task_pos.get(c.task.as_str()).copied().unwrap_or(usize::MAX),
                var_pos
                    .get(c.variant.as_str())
                    .copied()
                    .unwrap_or(usize::MAX),
                c.seed,
            )
        };
        self.cells.sort_by_key(|c| order(c));
        let mut summary = Vec::new();
        for task in &self.tasks {
            for variant in &self.variants {
                let cells: Vec<&CellResult> = self
                    .cells
                    .iter()
                    .filter(|c| c.task == task.name && c.variant == variant.name)
                    .collect();
                if cells.is_empty() {
                    continue;
                }
                let columns = task
                    .columns()
                    .into_iter()
                    .map(|name| {
                        let (mut acc, mut loss, mut reason) = (Vec::new(), Vec::new(), None);
                        let mut seq = Vec::new();
                        for c in &cells {
                            match c.evaluation(&name) {
                                Some(Outcome::Scored {
                                    accuracy,
                                    loss: l,
                                    sequence_accuracy,
                                    ..
                                }) => {
                                    acc.push(*accuracy);
                                    loss.push(*l);
                                    seq.extend(*sequence_accuracy);
                                }
                                Some(Outcome::Unavailable { reason: r }) => {
                                    reason = Some(r.clone())
                                }
                                None => {}
                            }
                        }
                        Aggregate {
                            name,
                            accuracy: Stat::of(&acc),
                            loss: Stat::of(&loss),
                            sequence_accuracy: Stat::of(&seq),
                            unavailable: reason,
                        }
                    })
                    .collect();
                let losses: Vec<f64> = cells.iter().map(|c| c.summary.final_train_loss).collect();
                summary.push(SummaryRow {
                    task: task.name.clone(),
                    variant: variant.name.clone(),
                    seeds: cells.iter().map(|c| c.seed).collect(),
                    params: cells[0].summary.params,
                    d_model: cells[0].summary.d_model,
                    final_train_loss: Stat::of(&losses).expect("at least one cell"),
                    columns,
                });
            }
        }
        self.summary = summary;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_use_the_sample_standard_deviation() {
        let s = Stat::of(&[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!((s.n, s.mean, s.min, s.max), (4, 2.5, 1.0, 4.0));
        assert!((s.std - (5.0f64 / 3.0).sqrt()).abs() < 1e-15);
        assert_eq!(Stat::of(&[7.0]).unwrap().std, 0.0);
        assert!(Stat::of(&[]).is_none());
    }
}

/// Every comparison of `plan` on every task and evaluation column of `results`, with Holm's
/// correction over each family (the planned, the exploratory); and those that could not be
/// made, with the reason.
fn compare(results: &Results, plan: &ComparisonPlan) -> (Vec<Comparison>, Vec<Skipped>) {
    use super::verdict::{comparison, estimate, holm, Family};
    let mut comparisons = Vec::new();
    let mut skipped = Vec::new();
    for (family, pairs) in [
        (Family::Planned, &plan.planned),
        (Family::Exploratory, &plan.exploratory),
    ] {
        // Each comparison's place, estimate, seeds and examples, until Holm's p is known.
        let mut estimates = Vec::new();
        for task in &results.tasks {
            for column in task.columns() {
                // A pair one side of which does not run the task is no comparison.
                for (a, b) in pairs
                    .iter()
                    .filter(|(a, b)| results.runs(task, a) && results.runs(task, b))
                {
                    let skip = |reason: String| Skipped {
                        task: task.name.clone(),
                        evaluation: column.clone(),
                        a: a.clone(),
                        b: b.clone(),
                        reason,
                        family,
                    };
                    let seeds = match paired_outcomes(results, &task.name, &column, (a, b)) {
                        Ok(seeds) => seeds,
                        Err(reason) => {
                            skipped.push(skip(reason));
                            continue;
                        }
                    };
                    let examples = seeds[0].0.len();
                    match estimate(&seeds) {
                        Ok(Ok(e)) => estimates.push((
                            (&task.name, column.clone(), (a, b)),
                            e,
                            (seeds.len(), examples),
                        )),
                        Ok(Err(no_verdict)) => skipped.push(skip(no_verdict)),
                        Err(e) => skipped.push(skip(e.to_string())),
                    }
                }
            }
        }
        let adjusted = holm(&estimates.iter().map(|(_, e, _)| e.p).collect::<Vec<_>>());
        let size = estimates.len();
        comparisons.extend(estimates.into_iter().zip(adjusted).map(
            |(((task, column, (a, b)), e, counts), p_holm)| {
                comparison((task, &column), (a, b), &e, (p_holm, family, size), counts)
            },
        ));
    }
    (comparisons, skipped)
}

/// Each seed's outcomes of `a` and `b` on `task`'s `column`, over the seeds that have both
/// cells; or why there are none to compare: a row without cells, a test a variant cannot run,
/// or a cell whose per-example outcomes are missing or damaged (named: a verdict over the
/// other seeds would say nothing of it).
fn paired_outcomes(
    results: &Results,
    task: &str,
    column: &str,
    (a, b): (&str, &str),
) -> std::result::Result<Vec<(ExampleOutcomes, ExampleOutcomes)>, String> {
    let cells = |v: &str| {
        results
            .cells
            .iter()
            .filter(|c| c.task == task && c.variant == v)
            .collect::<Vec<_>>()
    };
    let (cells_a, cells_b) = (cells(a), cells(b));
    if cells_a.is_empty() || cells_b.is_empty() {
        let missing = if cells_a.is_empty() { a } else { b };
        return Err(format!("no cell of `{missing}` in these results"));
    }
    let mut seeds = Vec::new();
    for ca in &cells_a {
        let Some(cb) = cells_b.iter().find(|c| c.seed == ca.seed) else {
            continue;
        };
        let mut sides = Vec::with_capacity(2);
        for (cell, row) in [(ca, a), (cb, b)] {
            let Some(e) = cell.summary.evaluations.iter().find(|e| e.name == column) else {
                return Err(format!("cell {} lacks the column", cell.name()));
            };
            if let Outcome::Unavailable { reason } = &e.outcome {
                return Err(format!("`{row}` cannot run it: {reason}"));
            }
            let Some(examples) = &e.examples else {
                return Err(format!(
                    "cell {} records no per-example outcomes (made by an older poslab): run \
                     it again",
                    cell.name()
                ));
            };
            let unpacked = examples
                .unpack()
                .map_err(|e| format!("cell {}: damaged per-example outcomes: {e}", cell.name()))?;
            sides.push(unpacked);
        }
        let ob = sides.pop().expect("two sides");
        let oa = sides.pop().expect("two sides");
        seeds.push((oa, ob));
    }
    if seeds.is_empty() {
        return Err("no seed has both variants' cells".into());
    }
    Ok(seeds)
}

/// Whether a scored test's per-example outcomes are there and give its score (what a verdict
/// pairs across seeds): a record without them, or with damaged ones, cannot be compared.
pub(crate) fn check_examples(
    outcome: &Outcome,
    examples: Option<&Examples>,
) -> std::result::Result<(), String> {
    let (
        Outcome::Scored {
            accuracy,
            by_length,
            ..
        },
        Some(examples),
    ) = (outcome, examples)
    else {
        return match (outcome, examples) {
            (Outcome::Unavailable { .. }, Some(_)) => {
                Err("example outcomes of a test it could not run".into())
            }
            (Outcome::Scored { .. }, None) => Err(
                "no per-example outcomes (a record of an older poslab): the verdicts pair every \
                 example across seeds, so it cannot be compared"
                    .into(),
            ),
            _ => Ok(()),
        };
    };
    let unpacked = examples
        .unpack()
        .map_err(|e| format!("its example outcomes are damaged: {e}"))?;
    let score = unpacked.score();
    if (score - accuracy).abs() > 1e-9 {
        return Err(format!(
            "accuracy {accuracy}, but its example outcomes give {score}"
        ));
    }
    if !by_length.is_empty() {
        let strata: Vec<[usize; 2]> = by_length.iter().map(|s| [s.length, s.examples]).collect();
        if strata != examples.strata {
            return Err("its example outcomes are not of its lengths and their examples".into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod example_tests {
    use super::*;

    #[test]
    fn example_outcomes_pack_compactly_and_unpack_to_what_was_packed() {
        let strata = vec![
            (5, vec![(1, 1), (0, 1), (3, 4)]),
            (9, vec![(200, 300), (0, 7)]),
        ];
        let packed = Examples::pack(&strata);
        assert_eq!(packed.strata, vec![[5, 3], [9, 2]]);
        assert!(packed.counted.is_some());
        let back = packed.unpack().unwrap();
        let expected: Vec<Vec<(u32, u32)>> = strata.into_iter().map(|(_, e)| e).collect();
        assert_eq!(back.strata, expected);
        // Sentence labels: counted left out, 500 examples in 668 characters.
        let labels: Vec<(u32, u32)> = (0..500).map(|i| (i % 3 % 2, 1)).collect();
        let packed = Examples::pack(&[(0, labels.clone())]);
        assert!(packed.counted.is_none());
        assert_eq!(packed.right.len(), 668);
        assert_eq!(packed.unpack().unwrap().strata, vec![labels]);
    }

    #[test]
    fn damaged_example_outcomes_say_what_is_wrong() {
        let good = Examples::pack(&[(0, vec![(1, 2), (2, 2)])]);
        let damaged = |f: &dyn Fn(&mut Examples)| {
            let mut e = good.clone();
            f(&mut e);
            e.unpack().unwrap_err()
        };
        let err = damaged(&|e| e.right = "not base64!".into());
        assert!(err.contains("not base64"), "{err}");
        let err = damaged(&|e| e.strata = vec![[0, 3]]);
        assert!(err.contains("2 values for 3 examples"), "{err}");
        // right beyond counted
        let err = damaged(&|e| e.right = Examples::pack(&[(0, vec![(3, 1), (2, 2)])]).right);
        assert!(err.contains("3 right of 2 counted"), "{err}");
        // a varint cut short: 0x80 continues into nothing
        let err = damaged(&|e| {
            use base64::Engine as _;
            e.right = base64::engine::general_purpose::STANDARD.encode([1u8, 0x80]);
        });
        assert!(err.contains("a cut one"), "{err}");
        let err = damaged(&|e| e.strata = vec![[0, MAX_EXAMPLES + 1]]);
        assert!(err.contains("examples (1 to"), "{err}");
        let err = damaged(&|e| e.strata = vec![[7, 1], [3, 1]]);
        assert!(err.contains("out of order"), "{err}");
    }
}
