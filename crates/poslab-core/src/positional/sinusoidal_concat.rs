//! `sinusoidal_concat`: a `pos_dim`-wide sinusoid concatenated after the token embeddings,
//! which are narrower by as much (or as wide as the model, with a trained projection back):
//!
//! ```text
//! h_0[t] = [embed_scale · E[x_t] ; PE[p_t]]                  (project = false)
//! h_0[t] = W_proj [embed_scale · E[x_t] ; PE[p_t]] + b_proj  (project = true)
//! ```
//!
//! with `PE` Vaswani et al.'s sinusoid (see `sinusoidal_add`) at width `pos_dim`. Concatenation
//! keeps content and position in separate coordinates, where addition mixes them (the
//! comparison of Ke et al. 2021, "Rethinking Positional Encoding in Language Pre-training", and
//! of Wang & Chen 2020, "What Do Position Embeddings Learn?").

use super::{Bench, Describe, Named, Portray, ScoreMemory};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::scheme::check_base;
use super::{
    FixedTable, InputPositions, Knobs, Placement, Portrait, PositionalConfig, PositionalModule,
    Scheme, SchemeShape, TableLayout, DEFAULT_BASE,
};
use crate::error::Result;

fn default_base() -> f64 {
    DEFAULT_BASE
}

/// The sinusoid's width when a config does not say: a quarter of the default `d_model` (64).
pub const DEFAULT_POS_DIM: usize = 16;

fn default_pos_dim() -> usize {
    DEFAULT_POS_DIM
}

/// Options of `sinusoidal_concat`: a `pos_dim` wide sinusoid appended after the token embeddings.
///
/// - `project = false` (default): token embeddings `d_model - pos_dim` wide, so the concatenation
///   is `d_model` wide with no extra parameters;
/// - `project = true`: token embeddings `d_model` wide, the `d_model + pos_dim` concatenation
///   mapped back to `d_model` by a trained linear layer `pos_proj`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConcatOptions {
    /// The sinusoid's width (even, below `d_model` unless projected; default 16, a quarter of
    /// the default `d_model`).
    #[serde(default = "default_pos_dim")]
    pub pos_dim: usize,
    /// The base of the frequencies (default 10,000).
    #[serde(default = "default_base")]
    pub base: f64,
    /// The order of sines and cosines in a row (default `interleaved`).
    #[serde(default)]
    pub layout: TableLayout,
    /// Whether a trained layer maps the wider concatenation back to `d_model` (default false).
    #[serde(default)]
    pub project: bool,
}

impl Default for ConcatOptions {
    /// A 16-wide interleaved sinusoid of base 10,000, not projected.
    fn default() -> Self {
        Self {
            pos_dim: DEFAULT_POS_DIM,
            base: DEFAULT_BASE,
            layout: TableLayout::default(),
            project: false,
        }
    }
}

impl Named for ConcatOptions {
    fn name(&self) -> &'static str {
        "sinusoidal_concat"
    }
}

impl Scheme for ConcatOptions {
    fn placement(&self) -> Placement {
        Placement::Input
    }

    fn check(&self, shape: &SchemeShape) -> std::result::Result<(), String> {
        check_base("sinusoidal_concat", self.base)?;
        let d_model = shape.d_model;
        if self.pos_dim < 2 || (!self.project && self.pos_dim >= d_model) {
            return Err(format!(
                "sinusoidal_concat: pos_dim = {} must be at least 2 and, without projection, less \
                 than d_model = {d_model}, so the token embedding (d_model - pos_dim wide) keeps \
                 some width; or set project = true to keep tokens d_model wide and project the \
                 concatenation back",
                self.pos_dim
            ));
        }
        if !self.pos_dim.is_multiple_of(2) {
            return Err(format!(
                "sinusoidal_concat: pos_dim = {} is odd, but a sinusoidal table needs an even \
                 width for its (sin, cos) pairs: use {} or {}",
                self.pos_dim,
                self.pos_dim - 1,
                self.pos_dim + 1
            ));
        }
        Ok(())
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        let d = shape.d_model as u128;
        match self.project {
            true => (d + self.pos_dim as u128) * d + d,
            false => 0,
        }
    }

    fn token_dim(&self, d_model: usize) -> usize {
        match self.project {
            true => d_model,
            false => d_model.saturating_sub(self.pos_dim),
        }
    }

    fn pos_dim(&self) -> Option<usize> {
        Some(self.pos_dim)
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        let d_model = shape.d_model;
        Ok(PositionalModule::Input(InputPositions::Concat {
            table: InputPositions::sinusoid(
                self.pos_dim,
                self.base,
                self.layout,
                shape.max_len,
                &vb,
            )?,
            projection: match self.project {
                true => Some(crate::nn::linear(
                    d_model + self.pos_dim,
                    d_model,
                    vb.pp("pos_proj"),
                )?),
                false => None,
            },
        }))
    }
}

impl Describe for ConcatOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        let d = shape.d_model;
        match self.project {
            true => format!(
                "input side: [tokens {d} ; sinusoid {}] projected back to {d} (base {}, {} layout)",
                self.pos_dim, self.base, self.layout
            ),
            false => format!(
                "input side: [tokens {} ; sinusoid {}] = {d} (base {}, {} layout)",
                d - self.pos_dim,
                self.pos_dim,
                self.base,
                self.layout
            ),
        }
    }

    fn label(&self) -> String {
        match self.project {
            true => format!("sinusoidal_concat (pos_dim {}, project)", self.pos_dim),
            false => format!("sinusoidal_concat (pos_dim {})", self.pos_dim),
        }
    }

    fn width(&self, d_model: usize) -> String {
        let tokens = self.token_dim(d_model);
        match self.project {
            true => format!("{tokens}+{}->{d_model}", self.pos_dim),
            false => format!("{d_model} = {tokens}+{}", self.pos_dim),
        }
    }
}

impl Portray for ConcatOptions {
    fn fixed_table(&self, _d_model: usize, _head_dim: usize) -> Option<FixedTable> {
        Some(FixedTable::Sinusoidal {
            dim: self.pos_dim,
            base: self.base,
            layout: self.layout,
        })
    }

    fn without_model(&self, knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Ok(Portrait::Table(knobs.sinusoidal_table()))
    }
}

impl Bench for ConcatOptions {
    fn benchmarked(&self) -> Option<Vec<(String, PositionalConfig)>> {
        let name = match self.project {
            true => "sin_concat_proj",
            false => "sin_concat",
        };
        Some(vec![(
            name.into(),
            PositionalConfig::SinusoidalConcat(self.clone()),
        )])
    }

    /// The projection of `[tokens ; positions]` back to the model's width, where there is one.
    fn forward_flops(&self, shape: &SchemeShape, batch: usize, seq: usize) -> f64 {
        let d = shape.d_model as f64;
        match self.project {
            true => 2.0 * (d + self.pos_dim as f64) * d * (batch * seq) as f64,
            false => 0.0,
        }
    }
}

impl ScoreMemory for ConcatOptions {}
