//! A training loop in code: a model, the store of its variables and AdamW, one call per step.
//!
//! ```
//! use poslab::prelude::*;
//!
//! let device = Device::Cpu;
//! let config = ModelConfig::default().with_vocab_size(16);
//! let head = HeadConfig::Classify { classes: 2, pooling: Pooling::Mean };
//! let mut learner = Learner::new(&config, &head, 7, &device)?;
//! let ids = Tensor::new(&[[5u32, 8, 13, 0], [3, 1, 4, 1]], &device)?;
//! let mask = Tensor::new(&[[1u32, 1, 1, 0], [1, 1, 1, 1]], &device)?;
//! let labels = Tensor::new(&[0u32, 1], &device)?;
//! let first = learner.step(&ids, &mask, &labels)?;
//! for _ in 0..20 {
//!     learner.step(&ids, &mask, &labels)?;
//! }
//! assert!(learner.step(&ids, &mask, &labels)? < first);
//! # Ok::<(), poslab::Error>(())
//! ```

use candle::{Device, Tensor};

use super::optim::{AdamW, AdamWConfig};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::{cross_entropy, HeadConfig, TaskModel};
use crate::params::ParamStore;
use crate::positional::Positions;

/// A model with a head, its variables and an AdamW optimizer at a constant learning rate.
///
/// Positions are `0..t` unless given ([`Learner::step_at`]); with `random_positions` in the
/// config, [`Learner::step`] draws them from the model's seed and the step, as training does.
pub struct Learner {
    model: TaskModel,
    params: ParamStore,
    optimizer: AdamW,
    lr: f64,
    seed: u64,
}

impl Learner {
    /// A model of `config` with `head`, its weights drawn from `seed` (the same seed, the same
    /// weights, bit for bit), AdamW with its defaults at a learning rate of 1e-3.
    pub fn new(
        config: &ModelConfig,
        head: &HeadConfig,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        let params = ParamStore::new(seed);
        let mut model =
            TaskModel::new(config, head, params.var_builder(candle::DType::F32, device))?;
        // One variable a layer, as the fused layer kernel reads it (names and values unchanged).
        model.pack(&params)?;
        params.constrain(&model.encoder().constraints())?;
        params.exempt_from_decay(&model.undecayed());
        let optimizer = AdamW::from_store(&params, AdamWConfig::default())?;
        Ok(Self {
            model,
            params,
            optimizer,
            lr: 1e-3,
            seed,
        })
    }

    /// AdamW with `config` at learning rate `lr` (its moments start again from zero).
    pub fn with_optimizer(mut self, config: AdamWConfig, lr: f64) -> Result<Self> {
        self.optimizer = AdamW::from_store(&self.params, config)?;
        self.lr = lr;
        Ok(self)
    }

    /// This learner computing with `backend`: its model's forward passes and its optimizer's
    /// updates (by default [`crate::nn::Backend::default`]).
    pub fn with_backend(mut self, backend: crate::nn::Backend) -> Self {
        self.model.set_backend(backend);
        self.optimizer.set_backend(backend);
        self
    }

    /// The model being trained.
    pub fn model(&self) -> &TaskModel {
        &self.model
    }

    /// The model's variables (save them with [`ParamStore::save`]).
    pub fn params(&self) -> &ParamStore {
        &self.params
    }

    /// One AdamW step on the cross-entropy of `targets`; returns the loss before the step.
    ///
    /// # Shapes
    /// - `ids`, `mask`: `(b, t)`; `targets`: `(b)` u32 for a sentence head, `(b, t)` for a
    ///   token head (padded positions are not scored)
    pub fn step(&mut self, ids: &Tensor, mask: &Tensor, targets: &Tensor) -> Result<f64> {
        let t = ids.dim(1)?;
        let positions = match self.model.encoder().config().random_positions {
            Some(range) => {
                let lengths: Vec<usize> = mask
                    .to_dtype(candle::DType::F64)?
                    .to_vec2::<f64>()?
                    .iter()
                    .map(|row| row.iter().filter(|&&m| m != 0.0).count())
                    .collect();
                let step = self.optimizer.steps_taken();
                let mut rng = crate::rng::stream(self.seed, &format!("learner positions {step}"));
                crate::positional::random_batch_positions(&lengths, t, range, &mut rng)?
            }
            None => Positions::range(0, t)?,
        };
        self.step_at(ids, mask, &positions, targets)
    }

    /// [`Learner::step`] with every token at its given position.
    ///
    /// # Shapes
    /// - `positions`: `(1 or b, t)`
    pub fn step_at(
        &mut self,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Positions,
        targets: &Tensor,
    ) -> Result<f64> {
        // The model's backend for the whole step: forward, backward and the optimizer.
        self.optimizer.set_backend(self.model.encoder().backend());
        self.check_targets(ids, targets)?;
        let step = self.optimizer.steps_taken();
        self.model
            .encoder()
            .set_dropout_seed(crate::rng::stable_hash(
                format!("{} {step}", self.seed).as_bytes(),
            ));
        let loss = match self.model.head_is_one_node() {
            // On the device path the head and its loss are one node, as in `train`.
            true => self.head_loss(ids, mask, positions, targets)?,
            false => {
                let logits = self.model.logits(ids, mask, positions, true)?;
                // Token heads score real tokens only.
                let weights = match logits.rank() {
                    3 => Some(mask.to_dtype(logits.dtype())?),
                    _ => None,
                };
                cross_entropy(&logits, targets, weights.as_ref())?
            }
        };
        let value = loss.to_dtype(candle::DType::F64)?.to_scalar::<f64>()?;
        self.optimizer.step(&loss.backward()?, self.lr, 1.0)?;
        Ok(value)
    }

    /// The loss of [`Learner::step_at`] with the head and its loss as one node
    /// ([`TaskModel::head_loss`]): token heads score real tokens only.
    fn head_loss(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Positions,
        targets: &Tensor,
    ) -> Result<Tensor> {
        let hidden = self
            .model
            .encoder()
            .forward_with(ids, mask, positions, true)?;
        let weights = match self.model.head_config() {
            HeadConfig::Classify { .. } => None,
            HeadConfig::Tag { .. } | HeadConfig::Mlm => {
                let w = mask.to_dtype(candle::DType::F32)?;
                let total = w
                    .sum_all()?
                    .to_dtype(candle::DType::F64)?
                    .to_scalar::<f64>()?;
                Some((w, total))
            }
        };
        self.model.head_loss(
            &hidden,
            &mask.to_dtype(candle::DType::U32)?,
            &targets.to_dtype(candle::DType::U32)?,
            weights.as_ref().map(|(w, total)| (w, *total)),
        )
    }

    /// Refuses labels the head cannot score, naming the label and the fix: of the head's shape
    /// (`(b)` for a sentence head, `(b, t)` for a token head), unsigned integers, each below the
    /// head's classes.
    fn check_targets(&self, ids: &Tensor, targets: &Tensor) -> Result<()> {
        let (b, t) = ids.dims2().map_err(|_| {
            Error::Input(format!(
                "input ids must be (batch, seq_len), got {:?}",
                ids.shape()
            ))
        })?;
        let (classes, shape, what) = match self.model.head_config() {
            HeadConfig::Classify { classes, .. } => (*classes, vec![b], "(batch)"),
            HeadConfig::Tag { classes } => (*classes, vec![b, t], "(batch, seq_len)"),
            HeadConfig::Mlm => (
                self.model.encoder().config().vocab_size,
                vec![b, t],
                "(batch, seq_len)",
            ),
        };
        if targets.dims() != shape.as_slice() {
            return Err(Error::Input(format!(
                "labels of shape {:?} for this head, which takes {what} = {shape:?}",
                targets.shape()
            )));
        }
        if !matches!(targets.dtype(), candle::DType::U8 | candle::DType::U32) {
            return Err(Error::Input(format!(
                "labels must be unsigned integers (u32), got {:?}: a label is a class index \
                 from 0 to {}",
                targets.dtype(),
                classes.saturating_sub(1)
            )));
        }
        let values = targets
            .flatten_all()?
            .to_dtype(candle::DType::U32)?
            .to_vec1::<u32>()?;
        if let Some((i, v)) = values
            .iter()
            .enumerate()
            .find(|(_, v)| **v as usize >= classes)
        {
            return Err(Error::Input(format!(
                "label {v} at flat index {i} is not a class of this head, which has {classes} \
                 (0 to {})",
                classes - 1
            )));
        }
        Ok(())
    }
}
