//! Input-side schemes: positions joined with the token embeddings before the first layer.
//! The learned table here is also what `untied` (TUPE) reads its position vectors from.

use candle::{Tensor, D};
use candle_nn::{Init, VarBuilder};

use crate::nn::Linear;

use super::{sinusoidal_table, PositionTable, Positions, TableLayout};
use crate::error::{Error, Result};

/// How positions join the token embeddings. RoPE and the attention biases act elsewhere (inside
/// attention), so for them and for the `none` control this is [`InputPositions::None`].
#[derive(Debug)]
pub enum InputPositions {
    /// Token embeddings pass through unchanged.
    None,
    /// `x + PE`, the table `d_model` wide.
    Add(PositionTable),
    /// `[x ; PE]`, the table `pos_dim` wide; tokens `d_model - pos_dim` wide, or `d_model` wide
    /// with `projection` (`pos_proj`) mapping the `d_model + pos_dim` concatenation back.
    Concat {
        /// The sinusoid, `pos_dim` wide.
        table: PositionTable,
        /// `pos_proj`, mapping `d_model + pos_dim` back to `d_model`, with `project = true`.
        projection: Option<Linear>,
    },
    /// `x + P`, a trained `max_len x d_model` table.
    Learned(LearnedPositions),
}

/// A trained position table, `pos_emb.weight` of shape `(max_len, d_model)`.
#[derive(Debug, Clone)]
pub struct LearnedPositions {
    weight: Tensor,
}

impl LearnedPositions {
    /// A `(max_len, d_model)` table drawn from a normal of standard deviation `init_std`, under
    /// `vb` (`weight`).
    pub fn new(max_len: usize, d_model: usize, init_std: f64, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints(
            (max_len, d_model),
            "weight",
            Init::Randn {
                mean: 0.0,
                stdev: init_std,
            },
        )?;
        Ok(Self { weight })
    }

    /// `(max_len, d_model)`
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The rows the table holds: the longest position it has plus one.
    pub fn max_len(&self) -> usize {
        self.weight.dim(0).unwrap_or(0)
    }

    /// The rows of `positions`, `(r, t, d_model)`: a view for a shared range, else gathered
    /// (both differentiable).
    pub fn at(&self, positions: &Positions) -> Result<Tensor> {
        let max_len = self.max_len();
        let t = positions.len();
        if positions.max() >= max_len {
            let what = match positions.as_range() {
                Some(0) => format!("a sequence of {t} tokens"),
                Some(start) => format!("positions {start}..{}", start + t),
                None => format!("position {}", positions.max()),
            };
            return Err(Error::Input(format!(
                "{what} does not fit the learned position table of max_len = {max_len} rows: \
                 shorten or truncate the input, or train a model with a larger max_len"
            )));
        }
        Ok(match positions.as_range() {
            Some(start) => self.weight.narrow(0, start, t)?.unsqueeze(0)?,
            None => {
                let idx = positions.flat_tensor(self.weight.device())?;
                self.weight.index_select(&idx, 0)?.reshape((
                    positions.rows(),
                    t,
                    self.weight.dim(1)?,
                ))?
            }
        })
    }
}

impl InputPositions {
    /// A fixed sinusoid `width` wide (for `initial_rows` positions to start with).
    pub fn sinusoid(
        width: usize,
        base: f64,
        layout: TableLayout,
        initial_rows: usize,
        vb: &VarBuilder,
    ) -> Result<PositionTable> {
        PositionTable::new(width, initial_rows, vb.dtype(), vb.device(), move |n| {
            sinusoidal_table(0, n, width, base, layout)
        })
    }

    /// The trainable tensors: a learned table, the concatenation's projection.
    pub fn parameters(&self) -> Vec<Tensor> {
        match self {
            Self::Learned(l) => vec![l.weight().clone()],
            Self::Concat {
                projection: Some(p),
                ..
            } => {
                let mut v = vec![p.weight().clone()];
                v.extend(p.bias().cloned());
                v
            }
            Self::None | Self::Add(_) | Self::Concat { .. } => Vec::new(),
        }
    }

    /// Its variables that weight decay leaves alone: the concatenation projection's bias.
    pub fn undecayed(&self) -> Vec<Tensor> {
        match self {
            Self::Concat {
                projection: Some(p),
                ..
            } => p.undecayed(),
            _ => Vec::new(),
        }
    }

    /// The learned table `(max_len, d_model)`, for a `learned` scheme.
    pub fn learned_table(&self) -> Option<&Tensor> {
        match self {
            Self::Learned(l) => Some(l.weight()),
            _ => None,
        }
    }

    /// The longest input this scheme can take, where there is a limit (a learned table).
    pub fn max_positions(&self) -> Option<usize> {
        match self {
            Self::Learned(l) => Some(l.max_len()),
            _ => None,
        }
    }

    /// Whether [`InputPositions::split`] can part the joined embedding into content and
    /// positions: the added and the concatenated schemes (not the `none` control).
    pub fn splits(&self) -> bool {
        !matches!(self, Self::None)
    }

    /// The joined embedding of [`InputPositions::join`] as a sum `content + positions`, the
    /// positions' part linear in their vectors, so that attention's logits split into four
    /// terms. Addition: the tokens and the added vectors. Concatenation: `[x ; 0]` and
    /// `[0 ; PE]`, each through the projection where there is one (its bias with the
    /// content). `None` for the `none` control.
    ///
    /// # Shapes
    /// - `tokens`: as [`InputPositions::join`]'s; `positions`: `(1 or b, t)`
    /// - returns `(b, t, d_model)` content and `(1 or b, t, d_model)` positions (a concatenation's
    ///   `b`)
    pub fn split(
        &self,
        tokens: &Tensor,
        positions: &Positions,
        backend: crate::nn::Backend,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let (b, t, d_tok) = tokens.dims3()?;
        Ok(match self {
            Self::None => None,
            Self::Add(table) => Some((tokens.clone(), table.at(positions)?)),
            Self::Learned(learned) => Some((tokens.clone(), learned.at(positions)?)),
            Self::Concat { table, projection } => {
                let pos_dim = table.width();
                let pe = table
                    .at(positions)?
                    .broadcast_as((b, t, pos_dim))?
                    .contiguous()?; // (b, t, pos_dim)
                let content = Tensor::cat(&[tokens, &pe.zeros_like()?], D::Minus1)?;
                let place = Tensor::zeros((b, t, d_tok), pe.dtype(), pe.device())?;
                let placed = Tensor::cat(&[&place, &pe], D::Minus1)?; // (b, t, d_tok + pos_dim)
                Some(match projection {
                    Some(proj) => {
                        let content = proj.forward(&content, backend)?; // its bias with the content
                        let weight = proj.weight(); // (d_model, d_tok + pos_dim)
                        (content, placed.broadcast_matmul(&weight.t()?)?)
                    }
                    None => (content, placed),
                })
            }
        })
    }

    /// Joins the token embeddings with the vectors of their `positions`.
    ///
    /// # Shapes
    /// - `tokens`: `(b, t, d_tok)`, `d_tok = d_model - pos_dim` for concat without projection,
    ///   else `d_model`; `positions`: `(1 or b, t)`
    /// - returns `(b, t, d_model)`
    pub fn join(
        &self,
        tokens: &Tensor,
        positions: &Positions,
        backend: crate::nn::Backend,
    ) -> Result<Tensor> {
        let (b, t, _) = tokens.dims3()?;
        Ok(match self {
            Self::None => tokens.clone(),
            Self::Add(table) => tokens.broadcast_add(&table.at(positions)?)?,
            Self::Learned(learned) => tokens.broadcast_add(&learned.at(positions)?)?,
            Self::Concat { table, projection } => {
                let pe = table
                    .at(positions)?
                    .broadcast_as((b, t, table.width()))?
                    .contiguous()?; // (b, t, pos_dim)
                let joined = Tensor::cat(&[tokens, &pe], D::Minus1)?; // (b, t, d_tok + pos_dim)
                match projection {
                    Some(proj) => proj.forward(&joined, backend)?, // (b, t, d_model)
                    None => joined,
                }
            }
        })
    }
}
