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

use super::{Bench, Describe, Named, Portray, ScoreMemory};
use candle::{DType, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::scheme::{check_base, check_init_std};
use super::{
    sinusoidal_table, BiasBatch, BiasModule, FixedTable, LayerBiases, LearnedPositions, Placement,
    PositionTable, PositionalModule, Positions, Scheme, SchemeShape, ScoreBias, TableLayout,
    DEFAULT_BASE, DEFAULT_LEARNED_INIT_STD,
};
use crate::error::Result;
use crate::nn::{linear_no_bias, Linear};

/// Where `untied` (TUPE) takes its absolute position vectors from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UntiedSource {
    /// A trained `max_len x d_model` table, `pos_emb.weight`.
    #[default]
    Learned,
    /// The `d_model`-wide sinusoid (with `base` and `layout`).
    Sinusoidal,
}

/// Options of `untied`: `source` and, for a sinusoidal source, its `base` and `layout`; for a
/// learned one, its `init_std`. Options of the other source are refused.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UntiedOptions {
    /// Where the position vectors come from: `learned` (default) or `sinusoidal`.
    #[serde(default)]
    pub source: UntiedSource,
    /// A sinusoidal source's base (default 10,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<f64>,
    /// A sinusoidal source's layout (default `interleaved`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<TableLayout>,
    /// A learned source's initial standard deviation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_std: Option<f64>,
}

impl UntiedOptions {
    /// The sinusoid's base (sinusoidal source).
    pub fn base(&self) -> f64 {
        self.base.unwrap_or(DEFAULT_BASE)
    }

    /// The sinusoid's layout (sinusoidal source).
    pub fn layout(&self) -> TableLayout {
        self.layout.unwrap_or_default()
    }

    /// The learned table's initialisation (learned source).
    pub fn init_std(&self) -> f64 {
        self.init_std.unwrap_or(DEFAULT_LEARNED_INIT_STD)
    }
}

impl Named for UntiedOptions {
    fn name(&self) -> &'static str {
        "untied"
    }
}

impl Scheme for UntiedOptions {
    fn placement(&self) -> Placement {
        Placement::ScoreBias
    }

    fn check(&self, shape: &SchemeShape) -> std::result::Result<(), String> {
        let d_model = shape.d_model;
        match self.source {
            UntiedSource::Learned => {
                if self.base.is_some() || self.layout.is_some() {
                    return Err(
                        "untied: base and layout belong to source = \"sinusoidal\"; a learned \
                         source takes only init_std: drop them, or set source = \"sinusoidal\""
                            .into(),
                    );
                }
                check_init_std("untied", self.init_std())
            }
            UntiedSource::Sinusoidal => {
                if self.init_std.is_some() {
                    return Err("untied: init_std belongs to source = \"learned\"; a \
                                sinusoidal source is fixed: drop init_std"
                        .into());
                }
                check_base("untied", self.base())?;
                if !d_model.is_multiple_of(2) {
                    return Err(format!(
                        "untied with source = \"sinusoidal\" needs an even width for its (sin, \
                         cos) pairs, but d_model = {d_model} is odd: use an even width such as \
                         {}, or source = \"learned\"",
                        d_model + 1
                    ));
                }
                Ok(())
            }
        }
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        let (d, t) = (shape.d_model as u128, shape.max_len as u128);
        2 * d * d + if self.has_learned_table() { t * d } else { 0 }
    }

    fn has_learned_table(&self) -> bool {
        self.source == UntiedSource::Learned
    }

    /// TUPE's positional term is a second score of the same size: both are scaled by
    /// `1/sqrt(2 d_head)`.
    fn score_scale(&self, head_dim: usize) -> Option<f64> {
        Some(1.0 / (2.0 * head_dim as f64).sqrt())
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        Ok(PositionalModule::ScoreBias(ScoreBias::new(Untied::new(
            self,
            shape.d_model,
            shape.n_heads,
            shape.max_len,
            vb,
        )?)))
    }
}

impl Describe for UntiedOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        let (d, dh) = (shape.d_model, shape.head_dim());
        format!(
            "attention bias: (p_i U_q)_h . (p_j U_k)_h / sqrt(2 x {dh}) in every layer, content \
             scores scaled by 1/sqrt(2 x {dh}); p from {}, U_q and U_k ({d} x {d}) shared by all \
             layers",
            match self.source {
                UntiedSource::Learned => format!("a learned table ({} x {d})", shape.max_len),
                UntiedSource::Sinusoidal => format!(
                    "the sinusoid ({d} wide, base {}, {} layout)",
                    self.base(),
                    self.layout()
                ),
            }
        )
    }

    fn label(&self) -> String {
        match self.source {
            UntiedSource::Learned => "untied (learned)".into(),
            UntiedSource::Sinusoidal => "untied (sinusoidal)".into(),
        }
    }
}

impl Portray for UntiedOptions {
    fn fixed_table(&self, d_model: usize, _head_dim: usize) -> Option<FixedTable> {
        (self.source == UntiedSource::Sinusoidal).then(|| FixedTable::Sinusoidal {
            dim: d_model,
            base: self.base(),
            layout: self.layout(),
        })
    }
}

impl Bench for UntiedOptions {
    /// TUPE's term, once per forward (the positions are shared by the batch): `U_q` and `U_k` on
    /// `seq` position rows, and the heads' `seq x seq` product.
    fn forward_flops(&self, shape: &SchemeShape, _batch: usize, seq: usize) -> f64 {
        let (d, t) = (shape.d_model as f64, seq as f64);
        2.0 * (2.0 * t * d * d) + 2.0 * t * t * d
    }
}

impl ScoreMemory for UntiedOptions {}

/// Where the position vectors come from.
#[derive(Debug)]
pub enum UntiedRows {
    /// A trained table, `pos_emb.weight`.
    Learned(LearnedPositions),
    /// A fixed sinusoid.
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
    /// TUPE's term for `heads` heads: the position rows and their own query and key maps
    /// (`pos_attn.q`, `pos_attn.k`) under `vb`.
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

    /// Where the position vectors come from.
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
    pub fn bias(
        &self,
        positions: &Positions,
        dtype: DType,
        backend: crate::nn::Backend,
    ) -> Result<Tensor> {
        let p = self.vectors(positions)?.to_dtype(dtype)?; // (r, t, d)
        let (r, t, d) = p.dims3()?;
        let dh = d / self.heads;
        let heads = |y: Tensor| -> candle::Result<Tensor> {
            y.reshape((r, t, self.heads, dh))?
                .transpose(1, 2)?
                .contiguous() // (r, h, t, dh)
        };
        let pq = heads(self.uq.forward(&p, backend)?)?;
        let pk = heads(self.uk.forward(&p, backend)?)?;
        Ok((pq.matmul(&pk.t()?)? * (1.0 / (2.0 * dh as f64).sqrt()))?)
    }
}

impl BiasModule for Untied {
    fn layer_biases(&self, batch: &BiasBatch) -> Result<LayerBiases> {
        Ok(LayerBiases::Shared(self.bias(
            batch.positions,
            batch.dtype,
            batch.backend,
        )?))
    }

    fn max_positions(&self) -> Option<usize> {
        Untied::max_positions(self)
    }

    fn absolute(&self) -> bool {
        true
    }

    fn notes(&self) -> Result<Vec<String>> {
        Ok(vec![
            "TUPE's position-to-position term (p_i U_q)·(p_j U_k)/sqrt(2 d_head): absolute; the \
             offset share says how much of it depends on j - i alone"
                .into(),
        ])
    }

    fn parameters(&self) -> Vec<Tensor> {
        let mut out = vec![self.uq.weight().clone(), self.uk.weight().clone()];
        if let UntiedRows::Learned(l) = &self.rows {
            out.push(l.weight().clone());
        }
        out
    }

    fn learned_table(&self) -> Option<&Tensor> {
        match &self.rows {
            UntiedRows::Learned(l) => Some(l.weight()),
            UntiedRows::Sinusoidal(_) => None,
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
