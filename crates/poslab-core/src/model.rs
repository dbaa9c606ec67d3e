//! An encoder with a task head: what `train`, `compare` and `predict` run.

use candle::{DType, IndexOp, Tensor, D};
use candle_nn::VarBuilder;

use crate::nn::Linear;
use serde::{Deserialize, Serialize};

pub use crate::config::Pooling;

use crate::batch::Batch;
use crate::config::ModelConfig;
use crate::encoder::Encoder;
use crate::error::{Error, Result};
use crate::nn::{linear, log_softmax_last_dim};
use crate::positional::Positions;

/// The head on top of the encoder, named `head.{weight,bias}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum HeadConfig {
    /// A pooled vector to `classes` logits.
    Classify {
        /// Number of classes.
        classes: usize,
        /// How the sequence is pooled to one vector.
        pooling: Pooling,
    },
    /// Every token to `classes` logits.
    Tag {
        /// Number of tags.
        classes: usize,
    },
    /// Every token to logits over the vocabulary.
    Mlm,
}

impl HeadConfig {
    /// Whether the head reads the first token (first-token pooling): its texts start with a
    /// `[CLS]` (the lab's `data::Framing::of`).
    pub fn reads_first_token(&self) -> bool {
        matches!(
            self,
            Self::Classify {
                pooling: Pooling::First,
                ..
            }
        )
    }

    /// The head's parameters on top of `model`: a linear layer from the width to each class
    /// (or each token of the vocabulary, for masked-LM), with its bias.
    pub fn param_count(&self, model: &ModelConfig) -> u128 {
        let out = match self {
            Self::Classify { classes, .. } | Self::Tag { classes } => *classes,
            Self::Mlm => model.vocab_size,
        } as u128;
        (model.d_model as u128 + 1) * out
    }
}

/// Encoder and head.
#[derive(Debug)]
pub struct TaskModel {
    encoder: Encoder,
    head: Linear,
    config: HeadConfig,
}

impl TaskModel {
    /// The encoder of `model` with `head` on top, its variables taken from `vb`; an error for a
    /// head with no class.
    pub fn new(model: &ModelConfig, head: &HeadConfig, vb: VarBuilder) -> Result<Self> {
        let out = match head {
            HeadConfig::Classify { classes, .. } | HeadConfig::Tag { classes } => *classes,
            HeadConfig::Mlm => model.vocab_size,
        };
        if out == 0 {
            return Err(Error::Config("the head needs at least one class".into()));
        }
        if model.causal && head.reads_first_token() {
            return Err(Error::Config(
                "pooling = \"first\" reads the first token, which under causal = true has \
                 seen only itself: use pooling = \"last\" (the last real token, which has seen \
                 the whole input) or \"mean\""
                    .into(),
            ));
        }
        Ok(Self {
            encoder: Encoder::new(model, vb.clone())?,
            head: linear(model.d_model, out, vb.pp("head"))?,
            config: head.clone(),
        })
    }

    /// This model computing with `backend` (see [`Encoder::with_backend`]).
    pub fn with_backend(mut self, backend: crate::nn::Backend) -> Self {
        self.set_backend(backend);
        self
    }

    /// Computes with `backend` from now on (see [`Encoder::with_backend`]).
    pub fn set_backend(&mut self, backend: crate::nn::Backend) {
        self.encoder.set_backend(backend);
    }

    /// Packs the encoder's layers in `store` for training ([`Encoder::pack`]).
    pub fn pack(&mut self, store: &crate::ParamStore) -> Result<()> {
        self.encoder.pack(store)
    }

    /// The variables weight decay leaves alone: the encoder's and the head's bias.
    pub fn undecayed(&self) -> Vec<Tensor> {
        let mut out = self.encoder.undecayed();
        out.extend(self.head.undecayed());
        out
    }

    /// The encoder under the head.
    pub fn encoder(&self) -> &Encoder {
        &self.encoder
    }

    /// The head's config.
    pub fn head_config(&self) -> &HeadConfig {
        &self.config
    }

    /// Mean over real tokens, the first token or the last real one, as configured.
    ///
    /// # Shapes
    /// - `hidden`: `(b, t, d)`, `mask`: `(b, t)`; returns `(b, d)`
    pub fn pool(&self, hidden: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let pooling = match self.config {
            HeadConfig::Classify { pooling, .. } => pooling,
            _ => Pooling::Mean,
        };
        Ok(match pooling {
            Pooling::First => hidden.i((.., 0))?,
            Pooling::Last => {
                // The last real token of each row: the largest index the mask keeps.
                let (b, t, d) = hidden.dims3()?;
                let at = Tensor::arange(0u32, t as u32, hidden.device())?
                    .broadcast_mul(&mask.to_dtype(DType::U32)?)?
                    .max(1)?; // (b)
                let at = at
                    .reshape((b, 1, 1))?
                    .broadcast_as((b, 1, d))?
                    .contiguous()?;
                hidden.contiguous()?.gather(&at, 1)?.squeeze(1)?
            }
            Pooling::Mean => {
                let m = mask.to_dtype(hidden.dtype())?.unsqueeze(2)?; // (b, t, 1)
                hidden
                    .broadcast_mul(&m)?
                    .sum(1)?
                    .broadcast_div(&m.sum(1)?)?
            }
        })
    }

    /// Logits of the head over the encoder's output, every token at its `positions`.
    ///
    /// # Shapes
    /// - `ids`, `mask`: `(b, t)`; `positions`: `(1 or b, t)`
    /// - returns `(b, classes)` for sentence labels, `(b, t, classes)` for token labels and
    ///   `(b, t, vocab_size)` for MLM
    pub fn logits(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Positions,
        train: bool,
    ) -> Result<Tensor> {
        let hidden = self.encoder.forward_with(ids, mask, positions, train)?; // (b, t, d)
        let features = match self.config {
            HeadConfig::Classify { .. } => self.pool(&hidden, mask)?, // (b, d)
            HeadConfig::Tag { .. } | HeadConfig::Mlm => hidden,
        };
        Ok(self.head.forward(&features, self.encoder.backend())?)
    }

    /// Mean cross-entropy over the scored labels of `batch`, and the logits; positions are the
    /// batch's (see [`Batch::positions`]), moved by `shift`.
    pub fn loss(&self, batch: &Batch, shift: usize, train: bool) -> Result<(Tensor, Tensor)> {
        let positions = batch.positions(shift)?;
        // The batch was built on the host, where its ids and mask were known: the encoder's
        // check takes them from there, and the loss its count of scored labels, so a step on a
        // GPU reads nothing back before its loss.
        let hidden = self.encoder.forward_built(batch, &positions, train)?; // (b, t, d)
        let features = match self.config {
            HeadConfig::Classify { .. } => self.pool(&hidden, &batch.mask)?, // (b, d)
            HeadConfig::Tag { .. } | HeadConfig::Mlm => hidden,
        };
        let logits = self.head.forward(&features, self.encoder.backend())?;
        let loss = weighted_cross_entropy(
            &logits,
            &batch.targets,
            batch.weights.as_ref().map(|w| (w, batch.scored)),
        )?;
        Ok((loss, logits))
    }
}

impl TaskModel {
    /// The loss of a training step on `batch` (positions from 0, dropout on): that of
    /// [`TaskModel::loss`], without the logits. On the device path (CUDA under the `layer`
    /// kernels) the head and its loss run as one node from the encoder's output
    /// (`poslab-kernels/src/gpu/head.rs`), in place of about 110 of candle's tensors; elsewhere this is
    /// [`TaskModel::loss`].
    pub fn training_loss(&self, batch: &Batch) -> Result<Tensor> {
        #[cfg(feature = "kernels")]
        if self.head_is_one_node() {
            if batch.weights.is_some() && batch.scored == 0 {
                return Err(Error::Input("a batch with no scored labels".into()));
            }
            let positions = batch.positions(0)?;
            let hidden = self.encoder.forward_built(batch, &positions, true)?; // (b, t, d)
            let weights = batch.weights.as_ref().map(|w| (w, batch.scored as f64));
            return self.head_loss(&hidden, &batch.mask, &batch.targets, weights);
        }
        Ok(self.loss(batch, 0, true)?.0)
    }

    /// Whether the head and its loss run as one node ([`TaskModel::head_loss`]): on the device
    /// path, for a head with a bias and weights of f32 or f64 that reads every token, their
    /// mean or the first (the last token's readout runs as ops).
    pub fn head_is_one_node(&self) -> bool {
        let (weight, backend) = (self.head.weight(), self.encoder.backend());
        let last = matches!(
            self.config,
            HeadConfig::Classify {
                pooling: Pooling::Last,
                ..
            }
        );
        cfg!(feature = "kernels")
            && backend.device_layer(weight)
            && matches!(weight.dtype(), DType::F32 | DType::F64)
            && self.head.bias().is_some()
            && !last
    }

    /// The head's cross-entropy over the encoder's output `hidden` as one node on the device
    /// path (where [`TaskModel::head_is_one_node`]): the mean over the rows, or with `weights`
    /// their weighted sum over the given total (the scored labels).
    ///
    /// # Shapes
    /// - `hidden`: `(b, t, d)`; `mask`: `(b, t)` u32; `targets`: `(b)` for a sentence head,
    ///   `(b, t)` for a token head, u32; `weights`: `(b, t)` f32
    #[cfg(feature = "kernels")]
    pub fn head_loss(
        &self,
        hidden: &Tensor,
        mask: &Tensor,
        targets: &Tensor,
        weights: Option<(&Tensor, f64)>,
    ) -> Result<Tensor> {
        use crate::kernels::gpu::head::{head_loss, Readout};
        let Some(bias) = self.head.bias() else {
            return Err(Error::Config(
                "the head's loss as one node needs its bias".into(),
            ));
        };
        let readout = match self.config {
            HeadConfig::Classify {
                pooling: Pooling::Mean,
                ..
            } => Readout::Mean(mask.clone()),
            HeadConfig::Classify {
                pooling: Pooling::First,
                ..
            } => Readout::First,
            HeadConfig::Classify {
                pooling: Pooling::Last,
                ..
            } => {
                return Err(Error::Config(
                    "the last token's readout runs as ops: its loss is not one node".into(),
                ))
            }
            HeadConfig::Tag { .. } | HeadConfig::Mlm => Readout::Tokens,
        };
        Ok(head_loss(
            hidden,
            self.head.weight(),
            bias,
            readout,
            targets,
            weights,
        )?)
    }
}

/// Mean negative log-likelihood of `targets`, over the entries with weight 1.
///
/// # Shapes
/// - `logits`: `(..., c)`; `targets`: `(...)` u32; `weights`: `(...)`, or `None` for all 1
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    weights: Option<&Tensor>,
) -> Result<Tensor> {
    let total = match weights {
        Some(w) => Some((w, w.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?)),
        None => None,
    };
    cross_entropy_over(logits, targets, total)
}

/// [`cross_entropy`] with 0/1 weights whose sum (the scored labels) the caller counted where
/// it built them: nothing is read back from the device.
fn weighted_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    weights: Option<(&Tensor, usize)>,
) -> Result<Tensor> {
    cross_entropy_over(logits, targets, weights.map(|(w, n)| (w, n as f64)))
}

/// The cross-entropy, weighted by `weights` over their total when given.
fn cross_entropy_over(
    logits: &Tensor,
    targets: &Tensor,
    weights: Option<(&Tensor, f64)>,
) -> Result<Tensor> {
    let c = logits.dim(D::Minus1)?;
    let logp = log_softmax_last_dim(&logits.reshape(((), c))?)?; // (n, c)
    let targets = targets.flatten_all()?;
    let nll = logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?.neg()?; // (n,)
    Ok(match weights {
        None => nll.mean_all()?,
        Some((w, total)) => {
            if total == 0.0 {
                return Err(Error::Input("a batch with no scored labels".into()));
            }
            let w = w.flatten_all()?.to_dtype(nll.dtype())?;
            ((nll * w)?.sum_all()? / total)?
        }
    })
}

/// The negative log-likelihood of every target.
///
/// # Shapes
/// - `logits`: `(..., c)`; `targets`: `(...)` u32; returns `(n,)` over the flattened targets
pub fn token_nll(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let c = logits.dim(D::Minus1)?;
    let logp = log_softmax_last_dim(&logits.reshape(((), c))?)?; // (n, c)
    Ok(logp
        .gather(&targets.flatten_all()?.unsqueeze(1)?, 1)?
        .squeeze(1)?
        .neg()?)
}

/// Correct predictions and scored labels in `logits` against `targets`.
pub fn count_correct(
    logits: &Tensor,
    targets: &Tensor,
    weights: Option<&Tensor>,
) -> Result<(usize, usize)> {
    let rows = count_correct_by_row(logits, targets, weights, 1)?;
    Ok(rows.iter().fold((0, 0), |(c, n), (rc, rn)| {
        (c + *rc as usize, n + *rn as usize)
    }))
}

/// [`count_correct`] for each of `rows` rows of the flattened targets (a batch's examples):
/// each row's `(correct, scored)`.
pub fn count_correct_by_row(
    logits: &Tensor,
    targets: &Tensor,
    weights: Option<&Tensor>,
    rows: usize,
) -> Result<Vec<(u32, u32)>> {
    let predicted = logits.argmax(D::Minus1)?.flatten_all()?.to_vec1::<u32>()?;
    let targets = targets.flatten_all()?.to_vec1::<u32>()?;
    let weights = match weights {
        Some(w) => w.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?,
        None => vec![1.0; targets.len()],
    };
    let rows = rows.max(1);
    if !targets.len().is_multiple_of(rows) || weights.len() != targets.len() {
        return Err(Error::Input(format!(
            "{} targets and {} weights do not split into {rows} examples",
            targets.len(),
            weights.len()
        )));
    }
    let per = targets.len() / rows;
    let mut out = vec![(0u32, 0u32); rows];
    for (i, ((p, t), w)) in predicted.iter().zip(&targets).zip(&weights).enumerate() {
        if *w > 0.0 {
            let row = &mut out[i / per.max(1)];
            row.1 += 1;
            row.0 += u32::from(p == t);
        }
    }
    Ok(out)
}
