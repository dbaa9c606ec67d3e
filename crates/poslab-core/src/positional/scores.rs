//! The fourth place a scheme acts: the attention scores themselves. A scheme here computes each
//! layer's scores from its queries and keys (and, for a contextual one, the layer's input) in
//! place of `q kᵀ / sqrt(d_head)`: PoPE's polar product, CoPE's counted positions, PaTH's
//! transport of keys through Householder reflections.
//!
//! For each batch the module gives every layer an [`crate::nn::QkScores`], which attention
//! calls with the layer's q and k; attention then adds the window and the padding and takes the
//! softmax, as for any scores. Such a layer runs as a composition of differentiable ops, except
//! where its scores are a polar form of q and k ([`crate::nn::Polar`], PoPE's): the fused CPU
//! kernels compute those inside the layer node.

use std::any::Any;

use candle::Tensor;

use super::{BiasBatch, ScoreBias};
use crate::error::Result;
use crate::nn::QkScores;
use crate::params::LowerBound;

/// A scores scheme's module.
pub trait ScoreModule: std::fmt::Debug + Send + Sync {
    /// Every layer's scores for a batch, one entry a layer (`None` for a layer without
    /// positions).
    fn batch_scores<'a>(&'a self, batch: &BiasBatch)
        -> Result<Vec<Option<Box<dyn QkScores + 'a>>>>;

    /// Lines of scheme facts for an analysis: its learned parameters, summarised.
    fn notes(&self) -> Result<Vec<String>>;

    /// The trainable tensors the module holds.
    fn parameters(&self) -> Vec<Tensor>;

    /// Its variables that weight decay leaves alone (biases, offsets and tables).
    fn undecayed(&self) -> Vec<Tensor> {
        Vec::new()
    }

    /// Bounds its variables must stay within, applied by the optimizer after every step.
    fn constraints(&self) -> Vec<LowerBound> {
        Vec::new()
    }

    /// The score bias these scores add to `q kᵀ` through more than a sum (DAPE's scheme under
    /// its MLP), for an analysis of the bias itself.
    fn base_bias(&self) -> Option<&ScoreBias> {
        None
    }

    /// For an analysis that draws what only this scheme has.
    fn as_any(&self) -> &dyn Any;
}

/// The module of a scores scheme.
#[derive(Debug)]
pub struct ScoreFunction(Box<dyn ScoreModule>);

impl ScoreFunction {
    /// Wraps a scheme's scores module.
    pub fn new(module: impl ScoreModule + 'static) -> Self {
        Self(Box::new(module))
    }

    /// The scheme's module as its own type, if it is `T`.
    pub fn downcast<T: 'static>(&self) -> Option<&T> {
        self.0.as_any().downcast_ref::<T>()
    }
}

impl std::ops::Deref for ScoreFunction {
    type Target = dyn ScoreModule;
    fn deref(&self) -> &Self::Target {
        self.0.as_ref()
    }
}
