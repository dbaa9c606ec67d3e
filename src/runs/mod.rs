//! Every run: controlled comparisons (`poslab compare`: every variant trained on the same data,
//! seeds and budget) and single training runs (`poslab train`, [`train_run`]), both through one
//! training [`job`], in crash-safe run folders ([`folder`]).
//!
//! An experiment config names the tasks, the shared model shape, the training recipe, the seeds
//! and the variants (a positional choice with its options, and optionally its own width or
//! embedding scale). [`compare::run`] trains every selected cell (task x variant x seed) and
//! [`report`] turns the records into tables, files and plots.

pub mod charts;
pub mod compare;
pub mod curves;
pub mod estimate;
pub mod folder;
pub mod job;
pub mod merge;
pub mod prepare;
pub mod report;
pub mod report_page;
pub mod results;
pub mod student;
pub mod suite;
pub mod suite_plot;
pub mod train_run;
pub mod verdict;

use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::{Choices, ModelConfig, ModelShape, Scale};
use crate::error::{Error, Result};
use crate::positional::PositionalConfig;
use crate::tasks::TaskSpec;
use crate::train::TrainConfig;

/// The embedded default experiment, `configs/compare.toml`.
pub const DEFAULT_CONFIG: &str = include_str!("../../configs/compare.toml");

fn d_seeds() -> u64 {
    3
}
fn d_shift() -> usize {
    16
}

/// A variant, `[[variants]]`: a name, a positional choice, and where it departs from the shared
/// shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VariantSpec {
    /// The variant's name: a column of the report.
    pub name: String,
    /// The positional scheme and its options.
    pub positional: PositionalConfig,
    /// Encoder width, if not the shared `d_model` (a wider concatenation, say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub d_model: Option<usize>,
    /// Token embedding scale, if not the shared one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embed_scale: Option<Scale>,
    /// Token initialisation's standard deviation, if not the shared one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_init_std: Option<Scale>,
    /// Rows of a learned table; default: the longest training input (or `random_positions`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_len: Option<usize>,
    /// Randomized positions drawn from `[0, N)` (Ruoss et al. 2023), on any scheme.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub random_positions: Option<usize>,
    /// What each layer does (see [`crate::layers`]): `layers = { pattern = ["global",
    /// "none"] }` for NoPE every other layer, `local` entries with a `local_window`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<crate::layers::LayerPlan>,
    /// Trains this variant's seed `s` with training seed `s + seed_offset`: another draw of
    /// everything a seed draws, paired with the other variants' seed `s`. Two variants alike
    /// but for this are an A/A check: equal in distribution, so any difference found between
    /// them is a false finding. Default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed_offset: Option<u64>,
    /// A causal (decoder) mask, if not the `[model]` table's: `causal = true` beside an
    /// encoder variant of the same scheme asks how it behaves when it sees one side only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causal: Option<bool>,
}

impl VariantSpec {
    /// The training seed of this variant's seed `seed` (see [`VariantSpec::seed_offset`]).
    pub fn training_seed(&self, seed: u64) -> u64 {
        seed.wrapping_add(self.seed_offset.unwrap_or(0))
    }

    /// What this variant chooses beyond the shared `[model]` shape.
    pub fn choices(&self) -> Choices<'_> {
        Choices {
            positional: &self.positional,
            d_model: self.d_model,
            embed_scale: self.embed_scale,
            token_init_std: self.token_init_std,
            max_len: self.max_len,
            random_positions: self.random_positions,
            layers: self.layers.as_ref(),
            causal: self.causal,
        }
    }
}

/// What a seed draws besides the weights' initialisation, the batch order and dropout, which
/// every seed draws: `data_seed` at the top of an experiment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataScope {
    /// Every seed trains on the task's one training set (drawn by the task's `data_seed`): the
    /// verdicts speak of that training set.
    #[default]
    Fixed,
    /// Every seed draws its own training set (a generated task's generated afresh, a file
    /// task's resampled with replacement): the verdicts cover training-data variation too.
    /// The validation and test sets stay the task's, so variants still pair example by
    /// example.
    PerSeed,
}

impl DataScope {
    fn is_fixed(&self) -> bool {
        *self == DataScope::Fixed
    }

    /// What a seed varies under this scope, in words.
    pub fn seed_varies(&self) -> &'static str {
        match self {
            DataScope::Fixed => {
                "the initial weights, the order of the training batches and dropout; every seed \
                 trained on the same training set and was tested on the same test sets \
                 (data_seed = \"fixed\"), so the verdicts speak of that training set"
            }
            DataScope::PerSeed => {
                "the initial weights, the order of the training batches, dropout and the \
                 training set itself, drawn afresh for each seed (data_seed = \"per_seed\"); \
                 the test sets are every seed's"
            }
        }
    }
}

/// `[eval]`: how trained models are tested.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalConfig {
    /// The shift test moves every position by this many.
    #[serde(default = "d_shift")]
    pub shift: usize,
    /// Evaluation batch size; default twice the training batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<usize>,
    /// RoPE scalings each trained `rope` variant is re-scored under, at every test, without
    /// retraining: each becomes a row of its own (`rope + yarn`). `factor = "auto"` is the
    /// test's longest input over the training's longest (at least 1); `original_max_len`
    /// defaults to the training's longest input.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rope_scaling: Vec<crate::positional::RopeScaling>,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            shift: d_shift(),
            batch_size: None,
            rope_scaling: Vec::new(),
        }
    }
}

/// An experiment, as read from TOML.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentConfig {
    /// Names the run folder `runs/compare-<name>-<timestamp>` (`runs/compare-<timestamp>` for
    /// the name `compare`).
    pub name: String,
    /// What the experiment asks, in words (for the report).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    /// How many seeds: `first_seed .. first_seed + seeds`.
    #[serde(default = "d_seeds")]
    pub seeds: u64,
    /// The first seed.
    #[serde(default)]
    pub first_seed: u64,
    /// What a seed draws: `"fixed"` (default), the initialisation, batch order and dropout;
    /// `"per_seed"`, each seed its own training set as well ([`DataScope`]).
    #[serde(default, skip_serializing_if = "DataScope::is_fixed")]
    pub data_seed: DataScope,
    /// The shape every variant shares, `[model]`.
    pub model: ModelShape,
    /// How each cell trains, `[train]`.
    pub train: TrainConfig,
    /// How cells are tested, `[eval]`.
    #[serde(default)]
    pub eval: EvalConfig,
    /// The tasks, `[[tasks]]`.
    pub tasks: Vec<TaskSpec>,
    /// The variants, `[[variants]]`.
    pub variants: Vec<VariantSpec>,
    /// The pairs of variants (rows) the report states verdicts on, `[[comparisons]]`; without
    /// any, each row against the first (see [`ExperimentConfig::comparison_pairs`]). They
    /// shape no cell: a run may be reported with other comparisons.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub comparisons: Vec<ComparisonSpec>,
}

/// `[[comparisons]]`: is `b` better than `a`? Differences are reported as `b - a`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComparisonSpec {
    /// The baseline row (a variant's name, or a re-scoring's, `rope + yarn`).
    pub a: String,
    /// The row compared with it.
    pub b: String,
}

/// Which cells of an experiment to run; empty lists mean all.
#[derive(Clone, Debug, Default)]
pub struct Selection {
    /// Task names to run; empty: all.
    pub tasks: Vec<String>,
    /// Variant names to run; empty: all.
    pub variants: Vec<String>,
    /// Seeds to run; empty: all.
    pub seeds: Vec<u64>,
    /// One deterministic slice of the selected cells, for a cluster array.
    pub shard: Option<Shard>,
}

/// The `index`-th (from 0) of `count` slices of an experiment's cells: in report order (task,
/// seed, variant), cell `i` belongs to slice `i % count`, so every slice gets a share of every
/// task. The slices of one config are disjoint, cover every cell, and do not depend on the
/// machine; `poslab report` merges their run folders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// Which slice, from 0.
    pub index: usize,
    /// How many slices.
    pub count: usize,
}

impl Shard {
    /// Whether cell `i` (in report order) is in this slice.
    pub fn holds(self, i: usize) -> bool {
        i % self.count == self.index
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl std::str::FromStr for Shard {
    type Err = Error;

    /// `K/N` with `0 <= K < N`: a Slurm array's `$SLURM_ARRAY_TASK_ID/N` (with
    /// `--array=0-(N-1)`; N the submission's own count, never `$SLURM_ARRAY_TASK_COUNT`, which is
    /// 1 in a re-run of one task), or a Kubernetes Indexed Job's `$JOB_COMPLETION_INDEX/N`.
    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::Config(format!(
                "--shard {s:?}: {why}; write K/N, the K-th of N slices counting from 0 (0/4, 1/4, \
                 2/4, 3/4)"
            ))
        };
        let (k, n) = s.split_once('/').ok_or_else(|| bad("no `/`"))?;
        let index: usize = k.trim().parse().map_err(|_| bad("K is not a number"))?;
        let count: usize = n.trim().parse().map_err(|_| bad("N is not a number"))?;
        if count == 0 {
            return Err(bad("N must be at least 1"));
        }
        if index >= count {
            return Err(bad(&format!(
                "K = {index} must be below N = {count} (slices count from 0)"
            )));
        }
        Ok(Self { index, count })
    }
}

/// Refuses a name that could not safely name a folder: empty, `.` or `..`, or anything but
/// letters, digits, `_`, `-` and `.` (no `/`, so no way out of the folder it is made in).
pub(crate) fn check_name(kind: &str, name: &str) -> Result<()> {
    if name.is_empty()
        || name == "."
        || name == ".."
        || name.len() > 128
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        return Err(Error::Config(format!(
            "{kind} name {name:?} must use only letters, digits, `_`, `-` and `.`, be at most \
             128 characters, and not be `.` or `..`: it names a folder"
        )));
    }
    Ok(())
}

impl ExperimentConfig {
    /// Parses and validates an experiment from TOML text.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let config: Self = crate::io::parse_toml(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Reads and validates an experiment file. Its tasks' relative paths resolve against the
    /// file's folder.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = crate::io::read_text_bounded(path, crate::io::MAX_CONFIG_BYTES, "config")?;
        let mut config = Self::from_toml_str(&text).map_err(|e| match e {
            Error::ConfigParse { message, .. } if ModelConfig::from_toml_str(&text).is_ok() => Error::ConfigParse {
                path: path.into(),
                message: format!(
                    "this is a model config (for `poslab inspect`), not an experiment: an experiment \
                     has `name`, `[model]`, `[train]`, `[[tasks]]` and `[[variants]]` (see \
                     configs/compare.toml)\n{message}"
                ),
            },
            Error::ConfigParse { message, .. } if crate::io::toml_has_key(&text, "task") => {
                Error::ConfigParse {
                    path: path.into(),
                    message: format!(
                        "this is a `poslab train` config (one [task] and one [positional]), not \
                         an experiment: run it with `poslab train --config {}`\n{message}",
                        path.display()
                    ),
                }
            }
            Error::ConfigParse { message, .. } if message.contains("unknown field `seed`") => {
                Error::ConfigParse {
                    path: path.into(),
                    message: format!(
                        "an experiment trains every cell under several seeds: `seeds = N` runs N \
                         of them, from `first_seed` (default 0); `seed = N` is a `poslab train` \
                         config's one seed\n{message}"
                    ),
                }
            }
            other => other.in_file(path),
        })?;
        for task in &mut config.tasks {
            task.resolve_from(path.parent().unwrap_or(Path::new(".")));
        }
        Ok(config)
    }

    /// The experiment without its `[[comparisons]]`: what shapes its cells (comparisons are the
    /// report's; its fingerprint and a merge's check read this).
    pub fn shaping_cells(&self) -> Self {
        Self {
            comparisons: Vec::new(),
            ..self.clone()
        }
    }

    /// The experiment as TOML, the form a run folder keeps.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("an experiment config serializes")
    }

    /// The seeds, `first_seed .. first_seed + seeds`.
    pub fn seed_list(&self) -> Vec<u64> {
        (self.first_seed..self.first_seed + self.seeds).collect()
    }

    /// The model config of `variant` for a task whose tokenizer has `vocab_size` ids and whose
    /// inputs need a learned table of `table_rows` rows.
    pub fn model_config(
        &self,
        variant: &VariantSpec,
        vocab_size: usize,
        table_rows: usize,
    ) -> ModelConfig {
        self.model
            .model_config(&variant.choices(), vocab_size, table_rows)
    }

    /// Refuses tasks whose generated words, or variants whose parameters, pass `limits`
    /// (before anything is generated or built; each variant at a placeholder vocabulary, as
    /// [`ExperimentConfig::validate`] checks it).
    pub fn check_limits(&self, limits: &crate::limits::Limits) -> Result<()> {
        for task in &self.tasks {
            task.check_limits(limits)?;
        }
        for variant in &self.variants {
            self.model_config(variant, 8, variant.max_len.unwrap_or(1))
                .check_limits(limits)
                .map_err(|e| Error::Config(format!("variant `{}`: {e}", variant.name)))?;
        }
        Ok(())
    }

    /// Checks everything that can be checked before data exists (its sizes against a run's
    /// limits are [`ExperimentConfig::check_limits`]).
    pub fn validate(&self) -> Result<()> {
        check_name("experiment", &self.name)?;
        if self.seeds == 0 {
            return Err(Error::Config("seeds = 0: run at least one seed".into()));
        }
        if self.tasks.is_empty() || self.variants.is_empty() {
            return Err(Error::Config(
                "an experiment needs at least one [[tasks]] and one [[variants]] entry".into(),
            ));
        }
        self.train.validate()?;
        if self.eval.shift > crate::positional::MAX_POSITION {
            return Err(Error::Config(format!(
                "[eval] shift = {} moves positions past the largest supported, {}: use a \
                 shift of at most a few times the longest input",
                self.eval.shift,
                crate::positional::MAX_POSITION
            )));
        }
        if self.eval.batch_size == Some(0) {
            return Err(Error::Config(
                "[eval] batch_size = 0, but it must be at least 1".into(),
            ));
        }
        let mut labels = HashSet::new();
        for scaling in &self.eval.rope_scaling {
            scaling
                .check(usize::MAX, true)
                .map_err(|e| Error::Config(format!("[eval] {e}")))?;
            if !labels.insert(scaling.label()) {
                return Err(Error::Config(format!(
                    "[eval] rope_scaling lists `{}` twice: give each once",
                    scaling.label()
                )));
            }
        }
        let mut names = HashSet::new();
        for task in &self.tasks {
            check_name("task", &task.name)?;
            if task.name == "suite" {
                return Err(Error::Config(
                    "a task named `suite` would draw its plot (plots/length_suite.png) over the \
                     length suite's overview of the same name: give it another `name`"
                        .into(),
                ));
            }
            if !names.insert(task.name.clone()) {
                return Err(Error::Config(format!(
                    "two tasks are named `{}`: give one a `name`",
                    task.name
                )));
            }
            task.validate()?;
        }
        let mut names = HashSet::new();
        for variant in &self.variants {
            check_name("variant", &variant.name)?;
            if !names.insert(variant.name.clone()) {
                return Err(Error::Config(format!(
                    "two variants are named `{}`",
                    variant.name
                )));
            }
            // Placeholder vocabulary and length: everything else is as it will run.
            let model = self.model_config(variant, 8, variant.max_len.unwrap_or(1));
            model
                .validate()
                .map_err(|e| Error::Config(format!("variant `{}`: {e}", variant.name)))?;
        }
        // A task a variant cannot run (next-token prediction without a causal mask) has no
        // cell of it; a task no variant runs, or a variant that runs no task, is refused.
        // Why none of `pairs` runs, if none does.
        let none_runs = |pairs: &mut dyn Iterator<Item = (&TaskSpec, &VariantSpec)>| {
            pairs
                .map(|(t, v)| t.check_causal(self.is_causal(v)))
                .reduce(|a, b| a.or(b))
                .and_then(|r| r.err())
        };
        for task in &self.tasks {
            if let Some(e) = none_runs(&mut self.variants.iter().map(|v| (task, v))) {
                return Err(Error::Config(format!(
                    "{e} (no variant of this experiment has one)"
                )));
            }
        }
        for variant in &self.variants {
            if let Some(e) = none_runs(&mut self.tasks.iter().map(|t| (t, variant))) {
                return Err(Error::Config(format!(
                    "variant `{}` runs none of the tasks: {e}",
                    variant.name
                )));
            }
        }
        let rows = self.variant_rows();
        let mut pairs = HashSet::new();
        for (i, c) in self.comparisons.iter().enumerate() {
            for name in [&c.a, &c.b] {
                if !rows.contains(name) {
                    return Err(Error::Config(format!(
                        "[[comparisons]] {}: `{name}` is not a variant of this experiment \
                         (its rows: {})",
                        i + 1,
                        rows.join(", ")
                    )));
                }
            }
            if c.a == c.b {
                return Err(Error::Config(format!(
                    "[[comparisons]] {}: a and b are both `{}`: compare two different variants",
                    i + 1,
                    c.a
                )));
            }
            if !pairs.insert((c.a.clone(), c.b.clone())) {
                return Err(Error::Config(format!(
                    "[[comparisons]] lists `{}` against `{}` twice",
                    c.b, c.a
                )));
            }
        }
        Ok(())
    }

    /// The comparisons `(a, b)` the report states verdicts on: `[[comparisons]]`, or each row
    /// against the first.
    pub fn comparison_pairs(&self) -> Vec<(String, String)> {
        if !self.comparisons.is_empty() {
            return self
                .comparisons
                .iter()
                .map(|c| (c.a.clone(), c.b.clone()))
                .collect();
        }
        let rows = self.variant_rows();
        rows.iter()
            .skip(1)
            .map(|b| (rows[0].clone(), b.clone()))
            .collect()
    }

    /// The rows a run of this config reports, in order: each variant, followed (for `rope`
    /// variants) by its re-scoring under each `[eval] rope_scaling` (`rope + yarn`).
    pub fn variant_rows(&self) -> Vec<String> {
        let mut rows = Vec::new();
        for v in &self.variants {
            rows.push(v.name.clone());
            if v.positional.rescales() {
                rows.extend(
                    self.eval
                        .rope_scaling
                        .iter()
                        .map(|s| format!("{} + {}", v.name, s.label())),
                );
            }
        }
        rows
    }

    /// The name of a cell as [`ExperimentConfig::cells`] gives it: `task/variant/seedN`.
    pub fn cell_name(&self, (t, v, seed): (usize, usize, u64)) -> String {
        results::cell_name(&self.tasks[t].name, &self.variants[v].name, seed)
    }

    /// The selected cells in report order (task, seed, variant), as indices into `tasks` and
    /// `variants`, with their seeds; only the shard's when the selection names one. A shard
    /// with no cell is refused (more shards than cells).
    pub fn cells(&self, selection: &Selection) -> Result<Vec<(usize, usize, u64)>> {
        let (tasks, variants, seeds) = self.select(selection)?;
        let index_of = |name: &str, all: &[String]| all.iter().position(|n| n == name);
        let task_names: Vec<String> = self.tasks.iter().map(|t| t.name.clone()).collect();
        let variant_names: Vec<String> = self.variants.iter().map(|v| v.name.clone()).collect();
        let mut cells = Vec::new();
        for t in &tasks {
            let ti = index_of(&t.name, &task_names).expect("selected from the config");
            for &seed in &seeds {
                for v in variants.iter().filter(|v| self.runs(t, v)) {
                    let vi = index_of(&v.name, &variant_names).expect("selected from the config");
                    cells.push((ti, vi, seed));
                }
            }
        }
        let total = cells.len();
        if let Some(shard) = selection.shard {
            cells = cells
                .into_iter()
                .enumerate()
                .filter(|(i, _)| shard.holds(*i))
                .map(|(_, c)| c)
                .collect();
            if cells.is_empty() {
                return Err(Error::Config(format!(
                    "--shard {shard} holds no cell: the selection has {total} cells, so use at \
                     most {total} shards"
                )));
            }
        }
        Ok(cells)
    }

    /// Whether `variant` has a causal mask (its own `causal`, or the `[model]` table's).
    pub fn is_causal(&self, variant: &VariantSpec) -> bool {
        variant.causal.unwrap_or(self.model.causal)
    }

    /// Whether `variant` runs `task`: every variant runs every task, but next-token
    /// prediction, which only a causal variant can learn (an encoder reads the token asked
    /// for). The experiment has no cell of a pair that does not run.
    pub fn runs(&self, task: &TaskSpec, variant: &VariantSpec) -> bool {
        task.check_causal(self.is_causal(variant)).is_ok()
    }

    /// The selected tasks, variants and seeds, refusing names that do not exist.
    pub fn select(
        &self,
        selection: &Selection,
    ) -> Result<(Vec<&TaskSpec>, Vec<&VariantSpec>, Vec<u64>)> {
        fn pick<'a, T>(
            all: &'a [T],
            wanted: &[String],
            name: impl Fn(&T) -> &str,
            what: &str,
        ) -> Result<Vec<&'a T>> {
            if wanted.is_empty() {
                return Ok(all.iter().collect());
            }
            wanted
                .iter()
                .map(|w| {
                    all.iter().find(|t| name(t) == w).ok_or_else(|| {
                        let known: Vec<&str> = all.iter().map(&name).collect();
                        Error::Config(format!(
                            "no {what} named `{w}`; this experiment has: {}",
                            known.join(", ")
                        ))
                    })
                })
                .collect()
        }
        let tasks = pick(&self.tasks, &selection.tasks, |t| t.name.as_str(), "task")?;
        let variants = pick(
            &self.variants,
            &selection.variants,
            |v| v.name.as_str(),
            "variant",
        )?;
        let all_seeds = self.seed_list();
        let seeds = if selection.seeds.is_empty() {
            all_seeds
        } else {
            for s in &selection.seeds {
                if !all_seeds.contains(s) {
                    return Err(Error::Config(format!(
                        "seed {s} is not among this experiment's seeds {all_seeds:?}"
                    )));
                }
            }
            selection.seeds.clone()
        };
        Ok((tasks, variants, seeds))
    }
}
