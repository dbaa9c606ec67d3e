//! CoPE, contextual position encoding (Golovneva, Wang, Weston, Sukhbaatar 2024, "Contextual
//! Position Encoding: Learning to Count What's Important"), in a bidirectional form for an
//! encoder. A **contextual** scheme: positions are counted by gates the queries set, and no
//! position id is read.
//!
//! ```text
//! a_ij  = q_i · k_j / sqrt(d_head)                 the scaled content score
//! g_ij  = σ(a_ij)                                  the gate; 0 for a padded key
//! p_ij  = Σ_{t=j..i} g_it      (j <= i)            a fractional count, from the key to the query
//!       = Σ_{t=i..j} g_it      (j > i)
//! p'    = min(p_ij, npos - 1),  f = ⌊p'⌋,  c = ⌈p'⌉,  w = p' - f
//! z_ij  = (1 - w) q_i · E[f] + w q_i · E[c]        E = layers.{l}.attn.cope.left  (j <= i)
//!                                                    = layers.{l}.attn.cope.right (j > i)
//! score_ij = a_ij + z_ij                            (the term is not divided by sqrt(d_head))
//! ```
//!
//! Restricted to `j <= i` this is the paper's causal CoPE exactly: under a causal mask its
//! reverse running sum of the gates is the left count here, and its table is the left table.
//! Keys after the query count the other way and read their own table, so a key three counts to
//! the right is told from one three counts to the left. The tables `[npos, d_head]` are shared
//! by a layer's heads and start at zero (the paper's, RAM's and x-transformers' init). A count
//! reaches at most the sequence's length, so `npos` past the longest test length buys nothing;
//! counts past `npos - 1` read its last row. Under a causal mask (`causal = true`) no key after
//! the query is seen, and the right table is zeros, not a variable. Reference:
//! `reference_2025_schemes.py`, fixtures `encoder_cope_pre`, `encoder_cope_npos6_post`, and
//! `reference_2026_schemes.py`'s `encoder_causal_cope_pre`.
//!
//! The scores are [`GateCounts`] of q and k. Cost: in the composition
//! ([`GateCounts::parts`], the specification) the counts are two running sums over the keys of
//! each query's gates, computed as products with a `(t, t)` triangle, `O(t³)` a head beside
//! `q kᵀ`'s `O(t² d_head)`. On the CPU (f32, f64) the fused attention computes the scores in
//! its node instead: a query's gates, counts and interpolation are one pass over its row,
//! forward and backward, `O(t²)` a head, and no `(b, h, t, t)` tensor is held. CUDA, half
//! precision and `--kernels reference` keep the composition.

use super::{Bench, Describe, Named, Portray, ScoreMemory};
use candle::{DType, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::{
    BiasBatch, Knobs, Measure, Placement, Portrait, PositionalModule, Scheme, SchemeShape,
    ScoreFunction, ScoreModule,
};
use crate::error::{Error, Result};
use crate::nn::{GateCounts, QkScores};

/// The most rows a CoPE table may have: counts never pass the sequence's length, and the
/// longest sequence poslab reads is far shorter.
pub const MAX_COPE_POSITIONS: usize = 65_536;

fn default_npos() -> usize {
    64
}

/// Options of `cope`: the rows of each table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CopeOptions {
    /// Rows of each table (default 64): counts from 0 to `npos - 1`, larger counts read the
    /// last row. RAM sets it to the block size + 1.
    #[serde(default = "default_npos")]
    pub npos: usize,
}

impl Default for CopeOptions {
    fn default() -> Self {
        Self {
            npos: default_npos(),
        }
    }
}

impl Named for CopeOptions {
    fn name(&self) -> &'static str {
        "cope"
    }
}

impl Scheme for CopeOptions {
    fn placement(&self) -> Placement {
        Placement::Scores
    }

    fn check(&self, _shape: &SchemeShape) -> std::result::Result<(), String> {
        if !(2..=MAX_COPE_POSITIONS).contains(&self.npos) {
            return Err(format!(
                "cope: npos = {} must be from 2 to {MAX_COPE_POSITIONS}: the rows of the count \
                 tables (counts past npos - 1 read the last row); the longest sequence + 1 is \
                 enough, 64 is the default",
                self.npos
            ));
        }
        Ok(())
    }

    fn check_random_positions(&self, range: usize) -> std::result::Result<(), String> {
        Err(format!(
            "random_positions = {range} with positional `cope`: CoPE counts positions with \
             gates set by the queries and reads no position ids, so randomizing them would \
             change nothing; remove random_positions"
        ))
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        let tables = if shape.causal { 1 } else { 2 };
        tables * (self.npos * shape.head_dim()) as u128 * shape.layers.count(shape.n_layers) as u128
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        let hd = shape.head_dim();
        let layers = (0..shape.n_layers)
            .map(|i| {
                shape
                    .layers
                    .contains(i)
                    .then(|| -> candle::Result<_> {
                        let vb = vb.pp(format!("layers.{i}.attn.cope"));
                        // Under a causal mask no key after the query is ever seen: the right
                        // table is zeros, not a variable (it could never learn).
                        let right = match shape.causal {
                            true => Tensor::zeros((self.npos, hd), vb.dtype(), vb.device())?,
                            false => {
                                vb.get_with_hints((self.npos, hd), "right", Init::Const(0.0))?
                            }
                        };
                        Ok(CopeTables {
                            left: vb.get_with_hints((self.npos, hd), "left", Init::Const(0.0))?,
                            right,
                        })
                    })
                    .transpose()
            })
            .collect::<candle::Result<_>>()?;
        Ok(PositionalModule::Scores(ScoreFunction::new(Cope {
            layers,
            causal: shape.causal,
        })))
    }
}

impl Describe for CopeOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        format!(
            "attention scores: content + q . E[p], p the count of gates sigmoid(q . k / sqrt(d)) \
             between key and query, E {} of {} x {} per layer (start at zero); no position ids",
            match shape.causal {
                true => "a left table (causal)",
                false => "a left and a right table",
            },
            self.npos,
            shape.head_dim()
        )
    }

    fn label(&self) -> String {
        match self.npos == default_npos() {
            true => "cope".into(),
            false => format!("cope (npos {})", self.npos),
        }
    }
}

impl Portray for CopeOptions {
    fn measure(&self) -> Option<Measure> {
        Some(Measure::Counts)
    }

    fn without_model(&self, _knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Err(
            "cope: its positions are counted by gates the content sets, so they exist only in \
             a trained model: give --run DIR of a cope model"
                .into(),
        )
    }
}

impl Bench for CopeOptions {
    fn forward_flops(&self, shape: &SchemeShape, batch: usize, seq: usize) -> f64 {
        // Each head's queries times its left and right tables, `(t, d_head) x (d_head, npos)`
        // twice: `4 t d npos` a layer. The gates read the encoder's own `q kᵀ`; the counts and
        // their interpolation are element-wise.
        let (d, t) = (shape.d_model as f64, seq as f64);
        let layers = shape.layers.count(shape.n_layers) as f64;
        4.0 * t * d * self.npos as f64 * batch as f64 * layers
    }
}

impl ScoreMemory for CopeOptions {
    fn score_tensors(&self, training: bool, fused: bool) -> usize {
        // The composition holds the composed attention around the term and its gradients,
        // about 7 and 59 attention tables a layer more than `sin_add`; the fused CPU layer what
        // `sin_add` holds, and in a training step a second table for the content scores it keeps
        // beside the weights while they are small (measured: the book's performance page, "Measurements behind the code's choices").
        match (fused, training) {
            (true, false) => 1,
            (true, true) => 2,
            (false, false) => 8,
            (false, true) => 64,
        }
    }
}

/// One layer's two tables `(npos, d_head)`.
#[derive(Clone, Debug)]
pub struct CopeTables {
    /// Read by keys at or before the query.
    pub left: Tensor,
    /// Read by keys after it.
    pub right: Tensor,
}

/// The parts of CoPE's scores ([`crate::nn::CountParts`]), for tests and analysis.
pub type CopeParts = crate::nn::CountParts;

impl CopeTables {
    /// The layer's scores as [`GateCounts`]: its two tables stacked, and the key mask.
    ///
    /// # Shapes
    /// - `mask`: `(b, t)`, 1 for a real token (`None`: all real)
    pub fn counts(&self, mask: Option<&Tensor>) -> Result<GateCounts> {
        GateCounts::new(&self.left, &self.right, mask)
    }

    /// CoPE's scores and their parts, from q and k: the composition ([`GateCounts::parts`]).
    ///
    /// # Shapes
    /// - `q`, `k`: `(b, h, t, d_head)`; `mask`: `(b, t)`, 1 for a real token (`None`: all real)
    pub fn parts(
        &self,
        q: &Tensor,
        k: &Tensor,
        mask: Option<&Tensor>,
        scale: f64,
        backend: crate::nn::Backend,
    ) -> Result<CopeParts> {
        self.counts(mask)?.parts(q, k, scale, backend)
    }
}

/// Every layer's tables (`None` for a layer without positions), and whether the model is
/// causal (its right tables are then zeros that no query reads, not variables).
#[derive(Clone, Debug)]
pub struct Cope {
    /// Each layer's tables.
    pub layers: Vec<Option<CopeTables>>,
    /// Whether keys after the query are masked.
    pub causal: bool,
}

impl ScoreModule for Cope {
    fn batch_scores<'a>(
        &'a self,
        batch: &BiasBatch,
    ) -> Result<Vec<Option<Box<dyn QkScores + 'a>>>> {
        self.layers
            .iter()
            .map(|layer| {
                layer
                    .as_ref()
                    .map(|tables| -> Result<Box<dyn QkScores + 'a>> {
                        Ok(Box::new(CopeScores(tables.counts(batch.mask)?)))
                    })
                    .transpose()
            })
            .collect()
    }

    fn notes(&self) -> Result<Vec<String>> {
        self.layers
            .iter()
            .enumerate()
            .map(|(l, t)| {
                let Some(t) = t else {
                    return Ok(format!("layer {l}: no positions"));
                };
                let norms = |e: &Tensor| -> Result<Vec<f64>> {
                    Ok(e.to_dtype(DType::F64)?
                        .sqr()?
                        .sum(1)?
                        .sqrt()?
                        .to_vec1::<f64>()?)
                };
                let show = |v: &[f64]| super::list(&v[..v.len().min(8)]);
                let left = show(&norms(&t.left)?);
                Ok(match self.causal {
                    true => format!(
                        "layer {l}: row norms of the left table [{left}] (first 8 counts); no \
                         right table: keys after the query are masked (causal)"
                    ),
                    false => format!(
                        "layer {l}: row norms of the left table [{left}], of the right table \
                         [{}] (first 8 counts)",
                        show(&norms(&t.right)?)
                    ),
                })
            })
            .collect()
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.layers
            .iter()
            .flatten()
            .flat_map(|t| {
                let right = (!self.causal).then(|| t.right.clone());
                std::iter::once(t.left.clone()).chain(right)
            })
            .collect()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// One layer's CoPE for one batch: its tables and the batch's key mask.
#[derive(Debug)]
struct CopeScores(GateCounts);

impl QkScores for CopeScores {
    fn scores(
        &self,
        q: &Tensor,
        k: &Tensor,
        _x: &Tensor,
        scale: f64,
        backend: crate::nn::Backend,
    ) -> Result<Tensor> {
        let width = self.0.tables().dim(1)?;
        if q.dim(3)? != width {
            return Err(Error::Config(format!(
                "cope: tables of width {width} for heads of width {}",
                q.dim(3)?
            )));
        }
        self.0.scores(q, k, scale, backend)
    }

    fn counts(&self) -> Option<&GateCounts> {
        Some(&self.0)
    }
}
