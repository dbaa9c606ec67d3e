//! `poslab compare --dry-run`: an experiment checked as a run checks it (every task generated,
//! every variant built against it, every batch held to the memory limit), and each cell's cost
//! estimated from its model, its steps and its lengths, before a single job is submitted.

use super::run::prepare_checked;
use super::{ExperimentConfig, Selection};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::HeadConfig;
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
}

/// Forward FLOPs per token of a sequence of `t` tokens, as `poslab bench` counts them: two per
/// multiply-add of each layer's projections and feed-forward, `4 t d` per layer for the two
/// attention products, and the output layer where every token is scored.
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
    2.0 * l * (4.0 * d * d + 2.0 * d * f) + 4.0 * l * t * d + 2.0 * d * out
}

/// Checks the selected cells of `config` as [`super::run::run`] would before training them
/// `jobs` at a time, and estimates each one's cost.
pub fn estimate(config: &ExperimentConfig, selection: &Selection, jobs: usize) -> Result<Estimate> {
    config.validate()?;
    let cells = config.cells(selection)?;
    let experiment_cells = config.cells(&Selection::default())?.len();
    let jobs = jobs.clamp(1, cells.len().max(1));
    let (task_ids, prepared) = prepare_checked(config, &cells, jobs)?;
    let mut out = Vec::with_capacity(cells.len());
    for &(t, v, seed) in &cells {
        let task = &prepared[task_ids.iter().position(|&x| x == t).expect("prepared")];
        let variant = &config.variants[v];
        let model =
            config.model_config(variant, task.data.tokenizer.vocab_size(), task.table_rows());
        let per_token =
            |len: usize| len as f64 * forward_flop_per_token(&model, &task.head, len as f64);
        let lengths = task.train.lengths();
        let mean_len = lengths.iter().sum::<usize>() as f64 / lengths.len().max(1) as f64;
        let steps = planned_steps(&config.train, &task.train);
        let tokens_per_step = config.train.batch_size.min(lengths.len().max(1)) as f64 * mean_len;
        // Batches hold sequences of similar lengths: the mean length stands for each.
        let train_flop = 3.0
            * steps as f64
            * tokens_per_step
            * forward_flop_per_token(&model, &task.head, mean_len);
        let (tests, valid) = task.eval_lengths();
        let rescorings = match variant.positional {
            crate::positional::PositionalConfig::Rope(_) => config.eval.rope_scaling.len(),
            _ => 0,
        };
        let validations = (steps / config.train.eval_every + 1) as f64;
        let eval_flop = validations * valid.iter().map(|&l| per_token(l)).sum::<f64>()
            + (1 + rescorings) as f64 * tests.iter().map(|&l| per_token(l)).sum::<f64>();
        out.push(CellEstimate {
            name: config.cell_name((t, v, seed)),
            params: model.param_count(),
            steps,
            tokens_per_step,
            train_flop,
            eval_flop,
        });
    }
    Ok(Estimate {
        cells: out,
        experiment_cells,
    })
}
