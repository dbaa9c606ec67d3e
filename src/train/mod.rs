//! Training: AdamW, linear warm-up then cosine decay, gradient clipping, a step or token
//! budget, periodic evaluation and optional early stopping.

mod learner;
pub mod optim;

pub use learner::Learner;

use std::time::Instant;

use candle::{DType, Tensor};

use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};

use crate::config::Precision;
use crate::data::{epoch_batches, eval_batches, make_batch, Dataset, MlmMasking, Sample};
use crate::error::{Error, Result};
use crate::model::{count_correct_by_row, token_nll, TaskModel};
use crate::params::ParamStore;
use crate::rng::{self, derive_seed};
use optim::{grad_norm_with, AdamW, AdamWConfig};

/// How long to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Budget {
    /// Optimizer steps.
    Steps(usize),
    /// Real (unpadded) training tokens.
    Tokens(usize),
}

/// Stop when validation accuracy has not improved by `min_delta` for `patience` evaluations,
/// and keep the best weights.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopping {
    /// Evaluations without improvement before training stops.
    pub patience: usize,
    /// The least rise in validation accuracy that counts as an improvement (default 0).
    #[serde(default)]
    pub min_delta: f64,
}

fn d_batch_size() -> usize {
    32
}
fn d_lr() -> f64 {
    1e-3
}
fn d_weight_decay() -> f64 {
    0.01
}
fn d_betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn d_adam_eps() -> f64 {
    1e-8
}
fn d_warmup() -> f64 {
    0.1
}
fn d_min_lr_ratio() -> f64 {
    0.1
}
fn d_grad_clip() -> f64 {
    1.0
}
fn d_eval_every() -> usize {
    100
}

/// The optimisation recipe, `[train]` in an experiment config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// `{ steps = N }` or `{ tokens = N }`.
    pub budget: Budget,
    /// Sequences per step (default 32).
    #[serde(default = "d_batch_size")]
    pub batch_size: usize,
    /// Peak learning rate.
    #[serde(default = "d_lr")]
    pub lr: f64,
    /// AdamW's decoupled weight decay (default 0.01).
    #[serde(default = "d_weight_decay")]
    pub weight_decay: f64,
    /// AdamW's `β1, β2` (default `[0.9, 0.999]`).
    #[serde(default = "d_betas")]
    pub betas: [f64; 2],
    /// AdamW's epsilon (default 1e-8).
    #[serde(default = "d_adam_eps")]
    pub adam_eps: f64,
    /// Fraction of the planned steps spent warming up linearly from 0 to `lr`.
    #[serde(default = "d_warmup")]
    pub warmup: f64,
    /// The cosine decays to `lr * min_lr_ratio` at the last planned step.
    #[serde(default = "d_min_lr_ratio")]
    pub min_lr_ratio: f64,
    /// Gradients are rescaled to this global L2 norm when above it; 0 turns clipping off.
    #[serde(default = "d_grad_clip")]
    pub grad_clip: f64,
    /// Steps between validation evaluations (and one at the end).
    #[serde(default = "d_eval_every")]
    pub eval_every: usize,
    /// Stop when validation stops improving, and keep the best weights; `None`: train the whole
    /// budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopping>,
}

impl TrainConfig {
    /// Checks every field; the error names the field and its allowed range.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(format!("[train] {m}")));
        match self.budget {
            Budget::Steps(0) | Budget::Tokens(0) => return bad("budget must be positive".into()),
            _ => {}
        }
        if self.batch_size == 0 {
            return bad("batch_size = 0, but it must be at least 1".into());
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad(format!("lr = {} must be a positive number", self.lr));
        }
        // Every float is checked to be finite and in range: NaN fails every comparison, so
        // `x < 0.0` alone would let it through and it would then act as 0 (or be blamed on lr).
        if !(0.0..1.0).contains(&self.warmup) {
            return bad(format!(
                "warmup = {} must be in [0, 1): the fraction of steps warming up",
                self.warmup
            ));
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return bad(format!(
                "min_lr_ratio = {} must be in [0, 1]: the final learning rate over lr",
                self.min_lr_ratio
            ));
        }
        if self.betas.iter().any(|b| !(0.0..1.0).contains(b)) {
            return bad(format!(
                "betas = {:?} must both lie in [0, 1) ([0.9, 0.999] is usual)",
                self.betas
            ));
        }
        if !(self.adam_eps.is_finite() && self.adam_eps > 0.0) {
            return bad(format!(
                "adam_eps = {} must be a finite, positive number (1e-8 is usual)",
                self.adam_eps
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight_decay = {} must be a finite number, at least 0 (0.01 is usual)",
                self.weight_decay
            ));
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return bad(format!(
                "grad_clip = {} must be a finite number, at least 0 (0 turns clipping off)",
                self.grad_clip
            ));
        }
        if self.eval_every == 0 {
            return bad("eval_every = 0, but it must be at least 1".into());
        }
        if let Some(rule) = self.early_stopping {
            if rule.patience == 0 || !(rule.min_delta.is_finite() && rule.min_delta >= 0.0) {
                return bad(format!(
                    "early_stopping = {{ patience = {}, min_delta = {} }}: patience must be at \
                     least 1 and min_delta a finite number, at least 0",
                    rule.patience, rule.min_delta
                ));
            }
        }
        Ok(())
    }

    /// The learning rate at `step` (0-based) of `planned` steps.
    pub fn lr_at(&self, step: usize, planned: usize) -> f64 {
        let planned = planned.max(1);
        let warmup = (self.warmup * planned as f64).round() as usize;
        if step < warmup {
            return self.lr * (step + 1) as f64 / warmup as f64;
        }
        let span = (planned - warmup).max(1) as f64;
        let progress = ((step - warmup) as f64 / span).min(1.0);
        let min = self.lr * self.min_lr_ratio;
        min + (self.lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

/// What a model trains and validates on.
pub struct TrainData<'a> {
    /// The training examples.
    pub train: &'a Dataset,
    /// The validation examples.
    pub valid: &'a Dataset,
    /// The padding token's id.
    pub pad_id: u32,
    /// For MLM.
    pub masking: Option<&'a MlmMasking>,
}

impl TrainData<'_> {
    /// Refuses data a run cannot train and validate on.
    pub fn check(&self) -> Result<()> {
        if self.train.is_empty() || self.valid.is_empty() {
            return Err(Error::Input(
                "training needs non-empty train and validation sets".into(),
            ));
        }
        Ok(())
    }
}

/// Loss and accuracy over a dataset.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// Mean cross-entropy over scored labels.
    pub loss: f64,
    /// The share of scored labels predicted right.
    pub accuracy: f64,
    /// Labels scored.
    pub scored: usize,
}

/// The record of a training run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainOutcome {
    /// Optimizer steps taken.
    pub steps: usize,
    /// Real tokens trained on.
    pub tokens: usize,
    /// Seconds spent in training steps (evaluation excluded).
    pub train_seconds: f64,
    /// Loss of every step.
    pub losses: Vec<f64>,
    /// `(step, validation score)` after every `eval_every` steps and at the end.
    pub validation: Vec<(usize, Score)>,
    /// The step whose weights were kept (the last, or the best under early stopping).
    pub kept_step: usize,
    /// Whether early stopping ended the run.
    pub stopped_early: bool,
}

impl TrainOutcome {
    /// Mean loss of the last 10% of steps (at least one).
    pub fn final_loss(&self) -> f64 {
        let n = (self.losses.len() / 10).max(1).min(self.losses.len());
        self.losses[self.losses.len() - n..].iter().sum::<f64>() / n.max(1) as f64
    }

    /// Training tokens per second of the time spent in training steps.
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.train_seconds.max(1e-9)
    }
}

fn scalar(t: &candle::Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?)
}

/// Scores `model` on `data`, positions moved by `start`. MLM masks (and a model's randomized
/// positions) are drawn from `mask_seed`, so every model is scored on the same masks (and
/// positions).
pub fn evaluate(
    model: &TaskModel,
    data: &Dataset,
    pad_id: u32,
    masking: Option<&MlmMasking>,
    mask_seed: u64,
    batch_size: usize,
    start: usize,
) -> Result<Score> {
    evaluate_examples(model, data, pad_id, masking, mask_seed, batch_size, start).map(|(s, _)| s)
}

/// [`evaluate`], with each example's labels predicted right and labels scored, in the data
/// set's order.
pub fn evaluate_examples(
    model: &TaskModel,
    data: &Dataset,
    pad_id: u32,
    masking: Option<&MlmMasking>,
    mask_seed: u64,
    batch_size: usize,
    start: usize,
) -> Result<(Score, Vec<(u32, u32)>)> {
    let device = model.encoder().device().clone();
    let mut mask_rng = rng::stream(mask_seed, "eval masks");
    let mut position_rng = rng::stream(mask_seed, "eval positions");
    let random_positions = model.encoder().config().random_positions;
    let (mut loss_sum, mut correct, mut scored) = (0.0, 0, 0);
    let mut examples = vec![(0u32, 0u32); data.len()];
    for idx in eval_batches(&data.lengths(), batch_size) {
        let samples: Vec<&Sample> = idx.iter().map(|&i| &data.samples[i]).collect();
        let mut batch = make_batch(
            &samples,
            pad_id,
            masking.map(|m| (m, &mut mask_rng)),
            &device,
        )?;
        if let Some(n) = random_positions {
            batch.randomize_positions(n, &mut position_rng)?;
        }
        let (loss, logits) = model.loss(&batch, start, false)?;
        // The loss is over the scored labels; the accuracy over those that count (a tape's
        // answer up to its end token).
        let weights = batch.counted.as_ref().or(batch.weights.as_ref());
        let rows = count_correct_by_row(&logits, &batch.targets, weights, idx.len())?;
        let (c, n) = rows.iter().fold((0, 0), |(c, n), (rc, rn)| {
            (c + *rc as usize, n + *rn as usize)
        });
        for (&i, row) in idx.iter().zip(rows) {
            examples[i] = row;
        }
        loss_sum += scalar(&loss)? * n as f64;
        correct += c;
        scored += n;
    }
    if scored == 0 {
        return Err(Error::Input(
            "nothing to score: the evaluation set has no labels".into(),
        ));
    }
    Ok((
        Score {
            loss: loss_sum / scored as f64,
            accuracy: correct as f64 / scored as f64,
            scored,
        },
        examples,
    ))
}

/// A length-suite test's scores at one input length.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LengthScore {
    /// The input length.
    pub length: usize,
    /// Examples of that length.
    pub examples: usize,
    /// Counted outputs right, over counted outputs.
    pub accuracy: f64,
    /// Examples with every counted output right.
    pub sequence_accuracy: f64,
    /// Mean cross-entropy over every output.
    pub loss: f64,
}

/// One length-suite example's result: its counted outputs right, and its loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TapeResult {
    /// The task's input length.
    pub length: usize,
    /// Counted outputs predicted right, of `counted`.
    pub right: usize,
    /// Outputs the accuracy counts.
    pub counted: usize,
    /// Cross-entropy summed over every output (counted or not), of `outputs`.
    pub nll: f64,
    /// Every output of the tape.
    pub outputs: usize,
}

/// The result of every tape of a batch from its predictions, targets and per-token
/// cross-entropies (each `(b * t)`, row-major): only a tape's outputs are looked at, the first
/// `counted` for accuracy and all for the loss.
pub fn tape_results(
    samples: &[&Sample],
    t: usize,
    predicted: &[u32],
    targets: &[u32],
    nll: &[f64],
) -> Result<Vec<TapeResult>> {
    samples
        .iter()
        .enumerate()
        .map(|(row, sample)| {
            let tape = sample
                .tape
                .ok_or_else(|| Error::Input("scoring by length needs length-suite tapes".into()))?;
            let from = row * t + tape.first_output;
            let end = row * t + sample.ids.len();
            if sample.ids.len() > t || end > predicted.len() || end > nll.len() {
                return Err(Error::Input(format!(
                    "tape results: a sample of {} tokens in rows of {t}",
                    sample.ids.len()
                )));
            }
            Ok(TapeResult {
                length: tape.length,
                right: (from..from + tape.counted)
                    .filter(|&j| predicted[j] == targets[j])
                    .count(),
                counted: tape.counted,
                nll: nll[from..end].iter().sum(),
                outputs: end - from,
            })
        })
        .collect()
}

/// Scores by input length: at each length the share of counted outputs right (pooled over its
/// examples, as DeepMind's per-batch accuracy), the share of examples with all of them right,
/// and the mean cross-entropy over every output.
pub fn scores_by_length(results: &[TapeResult]) -> Vec<LengthScore> {
    let mut by_length: std::collections::BTreeMap<usize, Vec<&TapeResult>> = Default::default();
    for r in results {
        by_length.entry(r.length).or_default().push(r);
    }
    by_length
        .into_iter()
        .map(|(length, rs)| {
            let sum = |f: fn(&TapeResult) -> usize| rs.iter().map(|r| f(r)).sum::<usize>();
            LengthScore {
                length,
                examples: rs.len(),
                accuracy: sum(|r| r.right) as f64 / sum(|r| r.counted).max(1) as f64,
                sequence_accuracy: rs.iter().filter(|r| r.right == r.counted).count() as f64
                    / rs.len() as f64,
                loss: rs.iter().map(|r| r.nll).sum::<f64>() / sum(|r| r.outputs).max(1) as f64,
            }
        })
        .collect()
}

/// Scores `model` on the length-suite tapes of `data` by input length ([`scores_by_length`]),
/// positions moved by `start`. Randomized positions are drawn from `seed`, the same for every
/// model.
pub fn evaluate_by_length(
    model: &TaskModel,
    data: &Dataset,
    pad_id: u32,
    seed: u64,
    batch_size: usize,
    start: usize,
) -> Result<Vec<LengthScore>> {
    evaluate_tapes(model, data, pad_id, seed, batch_size, start).map(|(scores, _)| scores)
}

/// [`evaluate_by_length`], with every example's result, in the data set's order.
pub fn evaluate_tapes(
    model: &TaskModel,
    data: &Dataset,
    pad_id: u32,
    seed: u64,
    batch_size: usize,
    start: usize,
) -> Result<(Vec<LengthScore>, Vec<TapeResult>)> {
    let device = model.encoder().device().clone();
    let mut position_rng = rng::stream(seed, "eval positions");
    let random_positions = model.encoder().config().random_positions;
    let mut results: Vec<Option<TapeResult>> = vec![None; data.len()];
    for idx in eval_batches(&data.lengths(), batch_size) {
        let samples: Vec<&Sample> = idx.iter().map(|&i| &data.samples[i]).collect();
        let mut batch = make_batch(&samples, pad_id, None, &device)?;
        if let Some(n) = random_positions {
            batch.randomize_positions(n, &mut position_rng)?;
        }
        let positions = batch.positions(start)?;
        let logits = model.logits(&batch.ids, &batch.mask, &positions, false)?; // (b, t, c)
        let t = batch.ids.dim(1)?;
        let predicted = logits
            .argmax(candle::D::Minus1)?
            .flatten_all()?
            .to_vec1::<u32>()?;
        let targets = batch.targets.flatten_all()?.to_vec1::<u32>()?;
        let nll = token_nll(&logits, &batch.targets)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        let tapes = tape_results(&samples, t, &predicted, &targets, &nll)?;
        for (&i, tape) in idx.iter().zip(tapes) {
            results[i] = Some(tape);
        }
    }
    let results: Vec<TapeResult> = results.into_iter().flatten().collect();
    if results.is_empty() || results.len() != data.len() {
        return Err(Error::Input(
            "nothing to score: the test set is empty, or holds examples without answers".into(),
        ));
    }
    Ok((scores_by_length(&results), results))
}

/// Everything besides the weights and the optimizer's moments that a run needs to continue
/// exactly where it stopped.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps taken.
    pub steps: usize,
    /// Real tokens trained on.
    pub tokens: usize,
    /// Seconds spent in training steps.
    pub train_seconds: f64,
    /// Loss of every step.
    pub losses: Vec<f64>,
    /// `(step, validation score)` of every evaluation so far.
    pub validation: Vec<(usize, Score)>,
    /// Position in the batch order: the epoch and the next batch in it.
    pub epoch: u64,
    /// The next batch of the epoch.
    pub cursor: usize,
    /// Early stopping: the best validation accuracy and its step, evaluations since.
    pub best: Option<(f64, usize)>,
    /// Evaluations since the best.
    pub since_best: usize,
    /// Whether early stopping ended the run.
    pub stopped_early: bool,
    /// The dynamic loss scale of a model computing in f16; none otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<LossScale>,
}

/// f16's dynamic loss scale: gradients too small for f16 (below about 6e-8) would flush to
/// zero, so the loss is multiplied by `scale` before the backward pass and the gradients divided
/// by it after. A step whose gradients overflow (inf or NaN) is skipped and the scale halved;
/// after [`LossScale::GROWTH_INTERVAL`] good steps in a row it doubles. (PyTorch's `GradScaler`
/// with its defaults.)
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScale {
    /// The factor the loss is multiplied by.
    pub scale: f64,
    /// Good steps since the scale last changed.
    pub good_steps: usize,
    /// Steps skipped because their gradients overflowed.
    pub skipped: usize,
}

impl LossScale {
    /// The first scale, 2^16.
    pub const INITIAL: f64 = 65536.0;
    /// Good steps in a row after which the scale doubles.
    pub const GROWTH_INTERVAL: usize = 2000;
    /// Below this the overflow is not the scale's doing: the run stops as an f32 run would.
    pub const MIN: f64 = 1.0;

    fn new() -> Self {
        Self {
            scale: Self::INITIAL,
            good_steps: 0,
            skipped: 0,
        }
    }

    /// Records a step with finite gradients.
    fn good(&mut self) {
        self.good_steps += 1;
        if self.good_steps == Self::GROWTH_INTERVAL {
            self.scale *= 2.0;
            self.good_steps = 0;
        }
    }

    /// Records an overflow; false when the scale cannot shrink further.
    fn overflow(&mut self) -> bool {
        if self.scale / 2.0 < Self::MIN {
            return false;
        }
        self.scale /= 2.0;
        self.good_steps = 0;
        self.skipped += 1;
        true
    }
}

/// A resumable snapshot of a run: its state, the optimizer's moments and step, and the weights
/// early stopping would restore. The model's own weights are saved beside it.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// The run's state.
    pub state: TrainState,
    /// AdamW's moments, by variable name.
    pub optimizer: std::collections::HashMap<String, candle::Tensor>,
    /// AdamW's step count (its bias corrections depend on it).
    pub optimizer_step: u64,
    /// The best weights so far under early stopping.
    pub best_weights: Option<std::collections::HashMap<String, candle::Tensor>>,
}

/// A training run that advances one step at a time and can be checkpointed and restored.
///
/// `seed` fixes the batch order (per epoch), the dropout masks and the MLM masks (per step),
/// so a run restored from a [`Checkpoint`] (with the weights saved beside it) continues bit for
/// bit as if it had never stopped.
pub struct Trainer<'a> {
    model: &'a TaskModel,
    data: &'a TrainData<'a>,
    config: &'a TrainConfig,
    seed: u64,
    /// The model's parameters (the gradient norm, early stopping's best weights).
    params: ParamStore,
    optimizer: AdamW,
    planned: usize,
    lengths: Vec<usize>,
    batches: Vec<Vec<usize>>,
    state: TrainState,
    /// Early stopping's best weights so far, by name.
    best_weights: Option<Vec<(String, candle::Tensor)>>,
}

impl<'a> Trainer<'a> {
    /// A run of `model`, whose trainable variables are `params`.
    pub fn new(
        model: &'a TaskModel,
        params: &ParamStore,
        data: &'a TrainData<'a>,
        config: &'a TrainConfig,
        seed: u64,
    ) -> Result<Self> {
        config.validate()?;
        data.check()?;
        let lengths = data.train.lengths();
        let planned = planned_steps(config, data.train);
        let [beta1, beta2] = config.betas;
        params.constrain(&model.encoder().constraints())?;
        params.exempt_from_decay(&model.undecayed());
        let optimizer = AdamW::from_store(
            params,
            AdamWConfig {
                beta1,
                beta2,
                eps: config.adam_eps,
                weight_decay: config.weight_decay,
            },
        )?;
        let batches = epoch_batches(&lengths, config.batch_size, &mut Self::epoch_rng(seed, 0));
        Ok(Self {
            model,
            data,
            config,
            seed,
            params: params.clone(),
            optimizer,
            planned,
            lengths,
            batches,
            state: TrainState {
                steps: 0,
                tokens: 0,
                train_seconds: 0.0,
                losses: Vec::with_capacity(planned),
                validation: Vec::new(),
                epoch: 0,
                cursor: 0,
                best: None,
                since_best: 0,
                stopped_early: false,
                loss_scale: (model.encoder().config().dtype == Precision::F16).then(LossScale::new),
            },
            best_weights: None,
        })
    }

    fn epoch_rng(seed: u64, epoch: u64) -> rng::Rng {
        rng::stream(derive_seed(seed, "batches", epoch), "epoch")
    }

    /// Where the run stands.
    pub fn state(&self) -> &TrainState {
        &self.state
    }

    /// Steps the schedule is planned for.
    pub fn planned_steps(&self) -> usize {
        self.planned
    }

    /// Whether the budget is spent or early stopping ended the run.
    pub fn finished(&self) -> bool {
        self.state.stopped_early
            || match self.config.budget {
                Budget::Steps(n) => self.state.steps >= n,
                Budget::Tokens(n) => self.state.tokens >= n,
            }
    }

    /// One optimizer step, and a validation evaluation when one is due.
    pub fn step(&mut self, progress: &ProgressBar) -> Result<()> {
        // The model's backend for the whole step: forward, backward and the optimizer.
        let backend = self.model.encoder().backend();
        self.optimizer.set_backend(backend);
        let device = self.model.encoder().device().clone();
        if self.state.cursor == self.batches.len() {
            self.state.epoch += 1;
            self.state.cursor = 0;
            self.batches = epoch_batches(
                &self.lengths,
                self.config.batch_size,
                &mut Self::epoch_rng(self.seed, self.state.epoch),
            );
        }
        let step = self.state.steps;
        let started = Instant::now();
        let samples: Vec<&Sample> = self.batches[self.state.cursor]
            .iter()
            .map(|&i| &self.data.train.samples[i])
            .collect();
        self.state.cursor += 1;
        let mut mask_rng = rng::stream(derive_seed(self.seed, "mlm masks", step as u64), "step");
        let mut batch = make_batch(
            &samples,
            self.data.pad_id,
            self.data.masking.map(|m| (m, &mut mask_rng)),
            &device,
        )?;
        if let Some(n) = self.model.encoder().config().random_positions {
            // Randomized positions (Ruoss et al. 2023), from a stream of their own: a run
            // without them draws nothing else differently.
            let mut rng = rng::stream(derive_seed(self.seed, "positions", step as u64), "step");
            batch.randomize_positions(n, &mut rng)?;
        }
        self.model
            .encoder()
            .set_dropout_seed(derive_seed(self.seed, "dropout", step as u64));
        let lr = self.config.lr_at(step, self.planned);
        let loss = self.model.training_loss(&batch)?;
        let loss_scale = self.state.loss_scale.as_ref().map_or(1.0, |s| s.scale);
        let grads = if loss_scale == 1.0 {
            loss.backward()?
        } else {
            (&loss * loss_scale)?.backward()?
        };
        // Parameter by parameter in the order of their names, whether packed or not: the same
        // sum, in the same order, either way.
        let gradients: Vec<Tensor> = self
            .params
            .gradients(&grads)?
            .into_iter()
            .map(|(_, g)| g)
            .collect();
        // The norm and the loss in one read, which waits for the backward: on a GPU the step's
        // one wait (reading the loss first would hold the backward's launches until the
        // forward ran).
        let (norm, loss_value) =
            grad_norm_with(&gradients, Some(&loss), self.model.encoder().backend())?;
        let norm = norm / loss_scale;
        let loss_value = match loss_value {
            Some(v) => v,
            None => scalar(&loss)?,
        };
        if !loss_value.is_finite() {
            return Err(Error::Training(format!(
                "the loss became {loss_value} at step {step} (learning rate {lr:.3e}): lower lr, \
                 lengthen the warm-up, or keep grad_clip on"
            )));
        }
        let overflow_skipped = !norm.is_finite()
            && self
                .state
                .loss_scale
                .as_mut()
                .is_some_and(LossScale::overflow);
        if !norm.is_finite() && !overflow_skipped {
            return Err(Error::Training(format!(
                "the gradient norm became {norm} at step {step} (loss {loss_value:.4}, learning \
                 rate {lr:.3e}): lower lr or keep grad_clip on"
            )));
        }
        if !overflow_skipped {
            if let Some(s) = self.state.loss_scale.as_mut() {
                s.good();
            }
            let clip = if self.config.grad_clip > 0.0 && norm > self.config.grad_clip {
                self.config.grad_clip / norm
            } else {
                1.0
            };
            // The optimizer multiplies the gradients by this: unscale, then clip.
            self.optimizer.step(&grads, lr, clip / loss_scale)?;
        }
        self.state.train_seconds += started.elapsed().as_secs_f64();
        self.state.steps += 1;
        self.state.tokens += batch.real_tokens;
        self.state.losses.push(loss_value);
        progress.inc(1);

        if self.state.steps.is_multiple_of(self.config.eval_every) || self.finished() {
            self.validate(loss_value, progress)?;
        }
        Ok(())
    }

    fn validate(&mut self, loss_value: f64, progress: &ProgressBar) -> Result<()> {
        let mask_seed = derive_seed(self.seed, "validation masks", 0);
        let score = evaluate(
            self.model,
            self.data.valid,
            self.data.pad_id,
            self.data.masking,
            mask_seed,
            self.config.batch_size * 2,
            0,
        )?;
        progress.set_message(format!(
            "loss {loss_value:.3} valid {:.1}%",
            100.0 * score.accuracy
        ));
        self.state.validation.push((self.state.steps, score));
        if let Some(rule) = self.config.early_stopping {
            let improved = self
                .state
                .best
                .is_none_or(|(acc, _)| score.accuracy > acc + rule.min_delta);
            if improved {
                let snapshot = self
                    .params
                    .params()
                    .into_iter()
                    .map(|(name, t)| Ok((name, t.detach().copy()?)))
                    .collect::<Result<Vec<_>>>()?;
                self.best_weights = Some(snapshot);
                self.state.best = Some((score.accuracy, self.state.steps));
                self.state.since_best = 0;
            } else {
                self.state.since_best += 1;
                self.state.stopped_early = self.state.since_best >= rule.patience;
            }
        }
        Ok(())
    }

    /// A snapshot to save beside the weights.
    pub fn checkpoint(&self) -> Checkpoint {
        let (optimizer, optimizer_step) = self.optimizer.state();
        Checkpoint {
            state: self.state.clone(),
            optimizer,
            optimizer_step,
            best_weights: self
                .best_weights
                .as_ref()
                .map(|w| w.iter().cloned().collect()),
        }
    }

    /// Continues from `checkpoint`; the model's weights must already hold the weights saved
    /// with it.
    pub fn restore(&mut self, checkpoint: &Checkpoint) -> Result<()> {
        self.optimizer
            .load_state(&checkpoint.optimizer, checkpoint.optimizer_step)?;
        self.best_weights = match &checkpoint.best_weights {
            None => None,
            Some(map) => Some(
                self.params
                    .params()
                    .into_iter()
                    .map(|(name, value)| {
                        let t = map.get(&name).ok_or_else(|| {
                            Error::Input(format!("the checkpoint's best weights lack `{name}`"))
                        })?;
                        let t = t.to_dtype(value.dtype())?.to_device(value.device())?;
                        Ok((name, t))
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
        };
        self.state = checkpoint.state.clone();
        self.batches = epoch_batches(
            &self.lengths,
            self.config.batch_size,
            &mut Self::epoch_rng(self.seed, self.state.epoch),
        );
        Ok(())
    }

    /// Ends the run: under early stopping the best weights are put back.
    pub fn finish(self) -> Result<TrainOutcome> {
        let mut kept_step = self.state.steps;
        if let (Some(weights), Some((_, step))) = (self.best_weights, self.state.best) {
            for (name, value) in &weights {
                self.params.set(name, value)?;
            }
            kept_step = step;
        }
        let state = self.state;
        Ok(TrainOutcome {
            steps: state.steps,
            tokens: state.tokens,
            train_seconds: state.train_seconds,
            losses: state.losses,
            validation: state.validation,
            kept_step,
            stopped_early: state.stopped_early,
        })
    }
}

/// The steps a run of `config` on `train` is planned for: its step budget, or its token budget
/// over the mean batch.
pub fn planned_steps(config: &TrainConfig, train: &Dataset) -> usize {
    let lengths = train.lengths();
    let mean_len = lengths.iter().sum::<usize>() as f64 / lengths.len().max(1) as f64;
    match config.budget {
        Budget::Steps(n) => n,
        Budget::Tokens(n) => {
            (n as f64 / (mean_len.max(1.0) * config.batch_size as f64)).ceil() as usize
        }
    }
}

/// Trains `model` (whose variables are `params`) on `data` under `config` from start to end.
pub fn train(
    model: &TaskModel,
    params: &ParamStore,
    data: &TrainData,
    config: &TrainConfig,
    seed: u64,
    progress: &ProgressBar,
) -> Result<TrainOutcome> {
    let mut trainer = Trainer::new(model, params, data, config, seed)?;
    progress.set_length(trainer.planned_steps() as u64);
    while !trainer.finished() {
        trainer.step(progress)?;
    }
    trainer.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_scale_halves_on_overflow_and_doubles_after_a_clean_stretch() {
        let mut s = LossScale::new();
        assert_eq!(s.scale, 65536.0);
        for _ in 0..LossScale::GROWTH_INTERVAL - 1 {
            s.good();
        }
        assert_eq!(s.scale, 65536.0);
        s.good();
        assert_eq!((s.scale, s.good_steps), (131072.0, 0));
        s.good();
        assert!(s.overflow());
        assert_eq!((s.scale, s.good_steps, s.skipped), (65536.0, 0, 1));
        // Down to 1 and no further: an overflow at scale 1 is the run's, not the scale's.
        while s.scale > 1.0 {
            assert!(s.overflow());
        }
        assert_eq!((s.scale, s.skipped), (1.0, 17));
        assert!(!s.overflow());
        assert_eq!(s.scale, 1.0);
    }

    #[test]
    fn warmup_then_cosine_to_the_floor() {
        let cfg: TrainConfig =
            toml::from_str("budget = { steps = 100 }\nlr = 1.0\nwarmup = 0.1\nmin_lr_ratio = 0.1")
                .unwrap();
        assert!((cfg.lr_at(0, 100) - 0.1).abs() < 1e-12);
        assert!((cfg.lr_at(9, 100) - 1.0).abs() < 1e-12);
        assert!((cfg.lr_at(10, 100) - 1.0).abs() < 1e-12);
        assert!(
            (cfg.lr_at(55, 100) - 0.55).abs() < 1e-12,
            "halfway down the cosine"
        );
        assert!((cfg.lr_at(100, 100) - 0.1).abs() < 1e-12);
        assert!(
            (cfg.lr_at(500, 100) - 0.1).abs() < 1e-12,
            "stays at the floor past the plan"
        );
        let e = toml::from_str::<TrainConfig>("budget = { epochs = 3 }")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown variant `epochs`"), "{e}");
    }
}
