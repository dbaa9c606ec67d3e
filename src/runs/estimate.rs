//! `poslab compare --dry-run`: an experiment checked as a run checks it (every task generated,
//! every variant built against it, every batch held to the memory limit), and each cell's cost
//! estimated from its model, its steps and its lengths, before a single job is submitted.
//!
//! A dry run generates a sample of each generated task, one task at a time: the first
//! examples of each split ([`DRY_RUN_SAMPLE`]), which the run generates first, with a test
//! range's every length. Its costs are scaled to the whole splits, within a few percent of
//! those counted from every example (`tests/suite/runs.rs` holds them to 5%; the parameters
//! and steps are the same). A task read from files, or whose tokenizer is trained on its
//! texts, is read or made whole.

use super::compare::{prepare_task_checked, tasks_and_variants};
use super::prepare::Prepared;
use super::{ExperimentConfig, Selection};
use crate::config::ModelConfig;
use crate::data::Dataset;
use crate::error::Result;
use crate::limits::Limits;
use crate::model::HeadConfig;
use crate::nn::Compute;
use crate::train::planned_steps;

/// One cell's estimated cost.
#[derive(Clone, Debug, PartialEq)]
pub struct CellEstimate {
    /// `task/variant/seedN`.
    pub name: String,
    /// The encoder's parameters (the head's are few).
    pub params: u128,
    /// Training steps planned.
    pub steps: usize,
    /// Real tokens of a training step (batch size x mean training length).
    pub tokens_per_step: f64,
    /// Floating-point operations of training (forward and backward, counted as three forwards).
    pub train_flop: f64,
    /// Of validation and every test (and each `[eval] rope_scaling` re-scoring).
    pub eval_flop: f64,
}

impl CellEstimate {
    /// Floating-point operations in all: training and evaluation.
    pub fn flop(&self) -> f64 {
        self.train_flop + self.eval_flop
    }
}

/// The selected cells of an experiment, checked, with their estimated costs.
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    /// In report order (task, seed, variant), as a run trains them.
    pub cells: Vec<CellEstimate>,
    /// Cells of the whole experiment.
    pub experiment_cells: usize,
    /// The tasks whose costs were scaled from a sample (the splits bigger than it).
    pub sampled: Vec<String>,
}

/// Forward FLOPs per token of a sequence of `t` tokens, as `poslab bench` counts them: two per
/// multiply-add of each layer's projections and feed-forward, `4 t d` per layer for the two
/// attention products, the scheme's own products ([`crate::positional::Bench::forward_flops`]
/// at the nearest whole length), and the output layer where every token is scored.
fn forward_flop_per_token(model: &ModelConfig, head: &HeadConfig, t: f64) -> f64 {
    let (d, f, l) = (
        model.d_model as f64,
        model.ffn_dim as f64,
        model.n_layers as f64,
    );
    let out = match head {
        HeadConfig::Classify { .. } => 0.0,
        HeadConfig::Tag { classes } => *classes as f64,
        HeadConfig::Mlm => model.vocab_size as f64,
    };
    let own = model
        .positional
        .scheme()
        .forward_flops(&model.scheme_shape(), 1, t.round() as usize)
        / t.max(1.0);
    2.0 * l * (4.0 * d * d + 2.0 * d * f) + 4.0 * l * t * d + own + 2.0 * d * out
}

/// How many examples of each generated split a dry run generates (see
/// [`crate::tasks::TaskSpec::generate_sample`]): of the training split, whose lengths are drawn
/// at random, enough for a mean length within about 1% (their standard error is 0.6% for the
/// length suite's uniform 1-40); of the others, enough for every length of a test range up to
/// 1,000 wide, taken in turn. The length suite's tasks, 256,000 training examples each, are
/// then sketched in seconds, not minutes and gigabytes.
pub const DRY_RUN_SAMPLE: [usize; 2] = [8000, 1000];

/// Checks the selected cells of `config` as [`super::compare::run`] would before training them
/// `jobs` at a time, and estimates each one's cost, from the first examples of each generated
/// split ([`DRY_RUN_SAMPLE`]), against `limits`.
pub fn estimate(
    config: &ExperimentConfig,
    selection: &Selection,
    jobs: usize,
    limits: &Limits,
    compute: Compute<'_>,
) -> Result<Estimate> {
    estimate_from(
        config,
        selection,
        jobs,
        Some(DRY_RUN_SAMPLE),
        limits,
        compute,
    )
}

/// As [`estimate`], from the first `sample[0]` examples of each generated training split and
/// `sample[1]` of each other split (`None`: from every example, as the run generates them).
/// Counts and costs are scaled from the sample to the whole splits.
pub fn estimate_from(
    config: &ExperimentConfig,
    selection: &Selection,
    jobs: usize,
    sample: Option<[usize; 2]>,
    limits: &Limits,
    compute: Compute<'_>,
) -> Result<Estimate> {
    config.validate()?;
    config.check_limits(limits)?;
    let cells = config.cells(selection)?;
    let experiment_cells = config.cells(&Selection::default())?.len();
    let jobs = jobs.clamp(1, cells.len().max(1));
    // One task at a time: a dry run holds one task's sample, never the experiment's data.
    let (task_ids, variants) = tasks_and_variants(config, &cells);
    let mut out: Vec<Option<CellEstimate>> = vec![None; cells.len()];
    let mut sampled = Vec::new();
    for &t in &task_ids {
        let task = prepare_task_checked(config, t, &variants, jobs, sample, limits, compute)?;
        if let Some((train, eval)) = task.spec.generated_sizes() {
            if task.train.samples.len() < train || task.valid.samples.len() < eval {
                sampled.push(task.spec.name.clone());
            }
        }
        for (i, &(_, v, seed)) in cells.iter().enumerate().filter(|(_, c)| c.0 == t) {
            out[i] = Some(cell_estimate(config, &task, (t, v, seed)));
        }
    }
    Ok(Estimate {
        cells: out.into_iter().flatten().collect(),
        experiment_cells,
        sampled,
    })
}

/// The cost of cell `(t, v, seed)` on its prepared task (a sample's examples each standing for
/// as many of the whole split as it holds).
fn cell_estimate(
    config: &ExperimentConfig,
    task: &Prepared,
    (t, v, seed): (usize, usize, u64),
) -> CellEstimate {
    let variant = &config.variants[v];
    let model = config.model_config(variant, task.data.tokenizer.vocab_size(), task.table_rows());
    let per_token =
        |len: usize| len as f64 * forward_flop_per_token(&model, &task.head, len as f64);
    let lengths = task.train.lengths();
    // The whole splits' sizes: a sample's examples each stand for as many of them.
    let (train_examples, eval_examples) = match task.spec.generated_sizes() {
        Some(sizes) => sizes,
        None => (lengths.len(), 0),
    };
    let cost = |set: &Dataset| {
        let weight = match eval_examples {
            0 => 1.0,
            n => n as f64 / set.samples.len().max(1) as f64,
        };
        weight * set.lengths().into_iter().map(per_token).sum::<f64>()
    };
    let mean_len = lengths.iter().sum::<usize>() as f64 / lengths.len().max(1) as f64;
    let steps = planned_steps(&config.train, &task.train);
    let tokens_per_step = config.train.batch_size.min(train_examples.max(1)) as f64 * mean_len;
    // Batches hold sequences of similar lengths: the mean length stands for each.
    let train_flop =
        3.0 * steps as f64 * tokens_per_step * forward_flop_per_token(&model, &task.head, mean_len);
    let (tests, valid) = task.eval_sets();
    let rescorings = match variant.positional.rescales() {
        true => config.eval.rope_scaling.len(),
        false => 0,
    };
    let validations = (steps / config.train.eval_every + 1) as f64;
    let eval_flop = validations * cost(valid)
        + (1 + rescorings) as f64 * tests.into_iter().map(cost).sum::<f64>();
    CellEstimate {
        name: config.cell_name((t, v, seed)),
        params: model.param_count() + task.head.param_count(&model),
        steps,
        tokens_per_step,
        train_flop,
        eval_flop,
    }
}
