//! Untied absolute positions (TUPE, Ke et al. 2021): positions are not added to the tokens;
//! every layer adds their correlation to its scores instead,
//!
//! ```text
//! bias[h, i, j] = (p_i U_qᵀ)_h · (p_j U_kᵀ)_h / sqrt(2 d_head)
//! ```
//!
//! where `p` is the position's row of a learned table (`pos_emb.weight`) or of the
//! `d_model`-wide sinusoid, and `U_q`, `U_k` (`pos_attn.{q,k}.weight`, `(d, d)`, no bias) are
//! shared by every layer. The content scores are scaled by `1/sqrt(2 d_head)` too (see
//! [`super::PositionalConfig::score_scale`]), so the two terms enter with equal weight: TUPE's
//! answer to "add or concatenate" is to concatenate inside attention.

use candle::{DType, Module, Tensor};
use candle_nn::VarBuilder;

use super::{
    sinusoidal_table, LearnedPositions, PositionTable, Positions, UntiedOptions, UntiedSource,
};
use crate::error::Result;
use crate::nn::{linear_no_bias, Linear};

/// Where the position vectors come from.
#[derive(Debug)]
pub enum UntiedRows {
    Learned(LearnedPositions),
    Sinusoidal(PositionTable),
}

/// TUPE's positional term.
#[derive(Debug)]
pub struct Untied {
    rows: UntiedRows,
    uq: Linear,
    uk: Linear,
    heads: usize,
}

impl Untied {
    pub fn new(
        options: &UntiedOptions,
        d_model: usize,
        heads: usize,
        max_len: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        let rows = match options.source {
            UntiedSource::Learned => UntiedRows::Learned(LearnedPositions::new(
                max_len,
                d_model,
                options.init_std(),
                vb.pp("pos_emb"),
            )?),
            UntiedSource::Sinusoidal => {
                let (base, layout) = (options.base(), options.layout());
                UntiedRows::Sinusoidal(PositionTable::new(
                    d_model,
                    max_len,
                    vb.dtype(),
                    vb.device(),
                    move |n| sinusoidal_table(0, n, d_model, base, layout),
                )?)
            }
        };
        Ok(Self {
            rows,
            uq: linear_no_bias(d_model, d_model, vb.pp("pos_attn.q"))?,
            uk: linear_no_bias(d_model, d_model, vb.pp("pos_attn.k"))?,
            heads,
        })
    }

    pub fn rows(&self) -> &UntiedRows {
        &self.rows
    }

    /// The rows of a learned table, if that is the source.
    pub fn max_positions(&self) -> Option<usize> {
        match &self.rows {
            UntiedRows::Learned(l) => Some(l.max_len()),
            UntiedRows::Sinusoidal(_) => None,
        }
    }

    /// The position vectors of `positions`, `(r, t, d_model)`.
    pub fn vectors(&self, positions: &Positions) -> Result<Tensor> {
        match &self.rows {
            UntiedRows::Learned(l) => l.at(positions),
            UntiedRows::Sinusoidal(table) => table.at(positions),
        }
    }

    /// # Shapes
    /// - returns `(r, h, t, t)` for positions `(r, t)`; differentiable in `U_q`, `U_k` and a
    ///   learned table
    pub fn bias(&self, positions: &Positions, dtype: DType) -> Result<Tensor> {
        let p = self.vectors(positions)?.to_dtype(dtype)?; // (r, t, d)
        let (r, t, d) = p.dims3()?;
        let dh = d / self.heads;
        let heads = |y: Tensor| -> candle::Result<Tensor> {
            y.reshape((r, t, self.heads, dh))?
                .transpose(1, 2)?
                .contiguous() // (r, h, t, dh)
        };
        let pq = heads(self.uq.forward(&p)?)?;
        let pk = heads(self.uk.forward(&p)?)?;
        Ok((pq.matmul(&pk.t()?)? * (1.0 / (2.0 * dh as f64).sqrt()))?)
    }
}
