//! One training job: a model built from a seed on a prepared task, trained, tested, saved and
//! summarised. `poslab compare` runs one per cell ([`super::compare`]), `poslab train` one per run
//! ([`crate::runs::train_run`]); what differs between them (progress, kill points, checkpoints, a
//! pretrained start) is what they pass in.

use std::path::Path;

use candle::{DType, Device};
use indicatif::ProgressBar;

use super::prepare::Prepared;
use super::results::TrainSummary;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::TaskModel;
use crate::nn::Backend;
use crate::params::ParamStore;
use crate::saved::{self, SavedConfig};
use crate::train::{TrainConfig, TrainOutcome, Trainer};

/// At most this many points per loss curve.
const CURVE_POINTS: usize = 200;

/// A loss per step as at most [`CURVE_POINTS`] `(step, mean loss)` points, each the mean of a
/// window of steps.
pub(crate) fn downsample(losses: &[f64]) -> Vec<[f64; 2]> {
    let window = losses.len().div_ceil(CURVE_POINTS).max(1);
    losses
        .chunks(window)
        .enumerate()
        .map(|(i, w)| {
            let step = (i * window + w.len()) as f64;
            [step, w.iter().sum::<f64>() / w.len() as f64]
        })
        .collect()
}

/// What a job's caller does around the training steps.
pub(crate) trait Steps {
    /// Once, before the first step: what the caller restores into the trainer (a checkpoint),
    /// and the bar the steps advance.
    fn begin(&mut self, trainer: &mut Trainer<'_>, params: &ParamStore) -> Result<ProgressBar>;
    /// After each step: `Ok(false)` stops the job there (it ends [`JobEnd::Stopped`]).
    fn after_step(&mut self, trainer: &Trainer<'_>, params: &ParamStore) -> Result<bool>;
    /// After the last step, before the tests.
    fn testing(&mut self, bar: &ProgressBar);
}

/// What writes a start's weights over the seeded ones (a pretrained encoder's).
pub(crate) type Start<'a> = &'a dyn Fn(&ParamStore) -> Result<()>;

/// One model to train on a prepared task.
pub(crate) struct Job<'a> {
    /// The task, prepared once for all its models.
    pub task: &'a Prepared<'a>,
    /// The model to build.
    pub model: &'a ModelConfig,
    /// How to train it.
    pub train: &'a TrainConfig,
    /// Seeds the weights, the data order and dropout.
    pub seed: u64,
    /// The training set, where the seed draws its own; `None`: the task's.
    pub train_set: Option<&'a crate::data::Dataset>,
    /// The batch size of the tests.
    pub eval_batch: usize,
    /// Where the model is built.
    pub device: &'a Device,
    /// The kernels and instruction sets it computes with.
    pub backend: Backend,
}

/// A trained and tested model.
pub(crate) struct Trained {
    /// Its weights (the kept step's).
    pub params: ParamStore,
    /// How training went.
    pub outcome: TrainOutcome,
    /// The record's shared part: training and test scores.
    pub summary: TrainSummary,
}

/// How a job ended.
pub(crate) enum JobEnd {
    /// Trained and tested.
    Trained(Box<Trained>),
    /// Stopped by the caller after `step`.
    Stopped {
        /// The last step done.
        step: usize,
    },
}

impl Job<'_> {
    /// Builds the model from the seed (with `start` writing its weights over the seeded ones,
    /// if given), trains it with `steps` around each step, and tests it.
    pub(crate) fn run(&self, start: Option<Start>, steps: &mut dyn Steps) -> Result<JobEnd> {
        let params = ParamStore::new(self.seed);
        let mut model = TaskModel::new(
            self.model,
            &self.task.head,
            params.var_builder(DType::F32, self.device),
        )?
        .with_backend(self.backend);
        // One variable a layer, as the fused layer kernel reads it (names and values unchanged).
        model.pack(&params)?;
        // Bounds first: a start's weights are checked against them (Trainer::new holds the
        // bounds and the decay exemptions for the optimizer).
        params.constrain(&model.encoder().constraints())?;
        if let Some(start) = start {
            start(&params)?;
        }
        let data = match self.train_set {
            Some(set) => self.task.train_data_on(set),
            None => self.task.train_data(),
        };
        let mut trainer = Trainer::new(&model, &params, &data, self.train, self.seed)?;
        let bar = steps.begin(&mut trainer, &params)?;
        while !trainer.finished() {
            trainer.step(&bar)?;
            if !steps.after_step(&trainer, &params)? && !trainer.finished() {
                return Ok(JobEnd::Stopped {
                    step: trainer.state().steps,
                });
            }
        }
        steps.testing(&bar);
        let outcome = trainer.finish()?;
        let evaluations = self.task.evaluate(&model, self.eval_batch)?;
        let summary = TrainSummary {
            params: params.num_params(),
            d_model: self.model.d_model,
            max_len: self.model.max_len,
            steps: outcome.steps,
            tokens: outcome.tokens,
            kept_step: outcome.kept_step,
            stopped_early: outcome.stopped_early,
            final_train_loss: outcome.final_loss(),
            loss_curve: downsample(&outcome.losses),
            validation: outcome
                .validation
                .iter()
                .map(|(s, v)| [*s as f64, v.accuracy])
                .collect(),
            evaluations,
        };
        Ok(JobEnd::Trained(Box::new(Trained {
            params,
            outcome,
            summary,
        })))
    }

    /// Saves the trained model as a folder `predict`, `embed` and `analyze` load: `init` names
    /// the pretrained model it started from, whose special tokens frame every text.
    pub(crate) fn save(&self, dir: &Path, trained: &Trained, init: Option<String>) -> Result<()> {
        let special_tokens = init.is_some();
        saved::save(
            dir,
            &trained.params,
            &self.task.data.tokenizer,
            &SavedConfig {
                format: saved::FORMAT.into(),
                model: self.model.clone(),
                head: self.task.head.clone(),
                objective: self.task.data.objective.clone(),
                task: self.task.spec.name.clone(),
                seed: self.seed,
                task_spec: Some(self.task.spec.clone()),
                init,
                special_tokens,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curves_keep_their_mean_and_length() {
        let losses: Vec<f64> = (0..1000).map(|i| i as f64).collect();
        let d = downsample(&losses);
        assert_eq!(d.len(), 200);
        assert_eq!(d[0], [5.0, 2.0]);
        assert_eq!(d[199], [1000.0, 997.0]);
        assert_eq!(downsample(&[1.0, 3.0]), vec![[1.0, 1.0], [2.0, 3.0]]);
    }
}
