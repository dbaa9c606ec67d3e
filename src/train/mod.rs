//! Training: AdamW, linear warm-up then cosine decay, gradient clipping, a step or token
//! budget, periodic evaluation and optional early stopping.

pub mod optim;

use std::time::Instant;

use candle::{DType, Var};
use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};

use crate::data::{epoch_batches, eval_batches, make_batch, Dataset, MlmMasking, Sample};
use crate::error::{Error, Result};
use crate::model::{count_correct, TaskModel};
use crate::params::ParamStore;
use crate::rng::{self, derive_seed};
use optim::{global_grad_norm, AdamW, AdamWConfig};

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
    pub patience: usize,
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
    #[serde(default = "d_batch_size")]
    pub batch_size: usize,
    /// Peak learning rate.
    #[serde(default = "d_lr")]
    pub lr: f64,
    #[serde(default = "d_weight_decay")]
    pub weight_decay: f64,
    #[serde(default = "d_betas")]
    pub betas: [f64; 2],
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopping>,
}

impl TrainConfig {
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
        if !(0.0..1.0).contains(&self.warmup) || !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return bad(format!(
                "warmup = {} must be in [0, 1) and min_lr_ratio = {} in [0, 1]",
                self.warmup, self.min_lr_ratio
            ));
        }
        if self.betas.iter().any(|b| !(0.0..1.0).contains(b)) || self.adam_eps <= 0.0 {
            return bad(format!(
                "betas = {:?} must lie in [0, 1) and adam_eps be positive",
                self.betas
            ));
        }
        if self.weight_decay < 0.0 || self.grad_clip < 0.0 {
            return bad("weight_decay and grad_clip must not be negative".into());
        }
        if self.eval_every == 0 {
            return bad("eval_every = 0, but it must be at least 1".into());
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
    pub train: &'a Dataset,
    pub valid: &'a Dataset,
    pub pad_id: u32,
    /// For MLM.
    pub masking: Option<&'a MlmMasking>,
}

/// Loss and accuracy over a dataset.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Score {
    pub loss: f64,
    pub accuracy: f64,
    /// Labels scored.
    pub scored: usize,
}

/// The record of a training run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainOutcome {
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
    pub stopped_early: bool,
}

impl TrainOutcome {
    /// Mean loss of the last 10% of steps (at least one).
    pub fn final_loss(&self) -> f64 {
        let n = (self.losses.len() / 10).max(1).min(self.losses.len());
        self.losses[self.losses.len() - n..].iter().sum::<f64>() / n.max(1) as f64
    }
}

fn scalar(t: &candle::Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?)
}

/// Scores `model` on `data`, positions starting at `start`. MLM masks are drawn from
/// `mask_seed`, so every model is scored on the same masks.
pub fn evaluate(
    model: &TaskModel,
    data: &Dataset,
    pad_id: u32,
    masking: Option<&MlmMasking>,
    mask_seed: u64,
    batch_size: usize,
    start: usize,
) -> Result<Score> {
    let device = model.encoder().device().clone();
    let mut mask_rng = rng::stream(mask_seed, "eval masks");
    let (mut loss_sum, mut correct, mut scored) = (0.0, 0, 0);
    for idx in eval_batches(&data.lengths(), batch_size) {
        let samples: Vec<&Sample> = idx.iter().map(|&i| &data.samples[i]).collect();
        let batch = make_batch(
            &samples,
            pad_id,
            masking.map(|m| (m, &mut mask_rng)),
            &device,
        )?;
        let (loss, logits) = model.loss(&batch, start, false)?;
        let (c, n) = count_correct(&logits, &batch.targets, batch.weights.as_ref())?;
        loss_sum += scalar(&loss)? * n as f64;
        correct += c;
        scored += n;
    }
    if scored == 0 {
        return Err(Error::Input(
            "nothing to score: the evaluation set has no labels".into(),
        ));
    }
    Ok(Score {
        loss: loss_sum / scored as f64,
        accuracy: correct as f64 / scored as f64,
        scored,
    })
}

/// Trains `model` (whose variables are `params`) on `data` under `config`. `seed` fixes the
/// batch order, dropout masks and MLM masks; each comes from a stream derived from the step, so
/// a run can be resumed exactly.
pub fn train(
    model: &TaskModel,
    params: &ParamStore,
    data: &TrainData,
    config: &TrainConfig,
    seed: u64,
    progress: &ProgressBar,
) -> Result<TrainOutcome> {
    config.validate()?;
    if data.train.is_empty() || data.valid.is_empty() {
        return Err(Error::Input(
            "training needs non-empty train and validation sets".into(),
        ));
    }
    let device = model.encoder().device().clone();
    let lengths = data.train.lengths();
    let mean_len = lengths.iter().sum::<usize>() as f64 / lengths.len() as f64;
    let planned = match config.budget {
        Budget::Steps(n) => n,
        Budget::Tokens(n) => (n as f64 / (mean_len * config.batch_size as f64)).ceil() as usize,
    };
    progress.set_length(planned as u64);
    let vars: Vec<Var> = params.all_vars();
    let [beta1, beta2] = config.betas;
    let mut optimizer = AdamW::new(
        params.vars(),
        AdamWConfig {
            beta1,
            beta2,
            eps: config.adam_eps,
            weight_decay: config.weight_decay,
        },
    )?;

    let mut outcome = TrainOutcome {
        steps: 0,
        tokens: 0,
        train_seconds: 0.0,
        losses: Vec::with_capacity(planned),
        validation: Vec::new(),
        kept_step: 0,
        stopped_early: false,
    };
    let eval_batch = config.batch_size * 2;
    let mask_seed = derive_seed(seed, "validation masks", 0);
    let mut best: Option<(f64, usize, Vec<candle::Tensor>)> = None;
    let mut since_best = 0;
    let (mut epoch, mut cursor) = (0u64, 0usize);
    let mut batches = epoch_batches(
        &lengths,
        config.batch_size,
        &mut rng::stream(derive_seed(seed, "batches", epoch), "epoch"),
    );

    loop {
        let done = match config.budget {
            Budget::Steps(n) => outcome.steps >= n,
            Budget::Tokens(n) => outcome.tokens >= n,
        };
        if done {
            break;
        }
        if cursor == batches.len() {
            epoch += 1;
            cursor = 0;
            batches = epoch_batches(
                &lengths,
                config.batch_size,
                &mut rng::stream(derive_seed(seed, "batches", epoch), "epoch"),
            );
        }
        let step = outcome.steps;
        let started = Instant::now();
        let samples: Vec<&Sample> = batches[cursor]
            .iter()
            .map(|&i| &data.train.samples[i])
            .collect();
        cursor += 1;
        let mut mask_rng = rng::stream(derive_seed(seed, "mlm masks", step as u64), "step");
        let batch = make_batch(
            &samples,
            data.pad_id,
            data.masking.map(|m| (m, &mut mask_rng)),
            &device,
        )?;
        model
            .encoder()
            .set_dropout_seed(derive_seed(seed, "dropout", step as u64));
        let lr = config.lr_at(step, planned);
        let (loss, _) = model.loss(&batch, 0, true)?;
        let loss_value = scalar(&loss)?;
        if !loss_value.is_finite() {
            return Err(Error::Training(format!(
                "the loss became {loss_value} at step {step} (learning rate {lr:.3e}): lower lr, \
                 lengthen the warm-up, or keep grad_clip on"
            )));
        }
        let grads = loss.backward()?;
        let norm = global_grad_norm(&grads, &vars)?;
        if !norm.is_finite() {
            return Err(Error::Training(format!(
                "the gradient norm became {norm} at step {step} (loss {loss_value:.4}, learning \
                 rate {lr:.3e}): lower lr or keep grad_clip on"
            )));
        }
        let scale = if config.grad_clip > 0.0 && norm > config.grad_clip {
            config.grad_clip / norm
        } else {
            1.0
        };
        optimizer.step(&grads, lr, scale)?;
        outcome.train_seconds += started.elapsed().as_secs_f64();
        outcome.steps += 1;
        outcome.tokens += batch.real_tokens;
        outcome.losses.push(loss_value);
        outcome.kept_step = outcome.steps;
        progress.inc(1);

        let finished = match config.budget {
            Budget::Steps(n) => outcome.steps >= n,
            Budget::Tokens(n) => outcome.tokens >= n,
        };
        if outcome.steps % config.eval_every == 0 || finished {
            let score = evaluate(
                model,
                data.valid,
                data.pad_id,
                data.masking,
                mask_seed,
                eval_batch,
                0,
            )?;
            progress.set_message(format!(
                "loss {loss_value:.3} valid {:.1}%",
                100.0 * score.accuracy
            ));
            outcome.validation.push((outcome.steps, score));
            if let Some(rule) = config.early_stopping {
                let improved = best
                    .as_ref()
                    .is_none_or(|(acc, _, _)| score.accuracy > acc + rule.min_delta);
                if improved {
                    let snapshot = vars
                        .iter()
                        .map(|v| v.as_detached_tensor().copy())
                        .collect::<candle::Result<Vec<_>>>()?;
                    best = Some((score.accuracy, outcome.steps, snapshot));
                    since_best = 0;
                } else {
                    since_best += 1;
                    if since_best >= rule.patience {
                        outcome.stopped_early = true;
                        break;
                    }
                }
            }
        }
    }
    if let Some((_, step, snapshot)) = best {
        for (var, value) in vars.iter().zip(snapshot) {
            var.set(&value)?;
        }
        outcome.kept_step = step;
    }
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

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
