//! `sinusoidal_add`: the sinusoid of Vaswani et al. (2017, "Attention Is All You Need"), as
//! wide as the model, added to the token embeddings:
//!
//! ```text
//! h_0[t] = embed_scale · E[x_t] + PE[p_t]
//! PE[p, 2i] = sin(p · w_i),  PE[p, 2i + 1] = cos(p · w_i),  w_i = base^(-2i/d_model)
//! ```
//!
//! (`layout = "half"` puts every sine first, then every cosine). Nothing is learned, and any
//! position has a row: the table extends itself past `max_len`.

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

/// Options of `sinusoidal_add`: the table is as wide as the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinusoidalOptions {
    /// The base of the frequencies (default 10,000).
    #[serde(default = "default_base")]
    pub base: f64,
    /// The order of sines and cosines in a row (default `interleaved`).
    #[serde(default)]
    pub layout: TableLayout,
}

impl Default for SinusoidalOptions {
    fn default() -> Self {
        Self {
            base: DEFAULT_BASE,
            layout: TableLayout::default(),
        }
    }
}

impl Named for SinusoidalOptions {
    fn name(&self) -> &'static str {
        "sinusoidal_add"
    }
}

impl Scheme for SinusoidalOptions {
    fn placement(&self) -> Placement {
        Placement::Input
    }

    fn check(&self, shape: &SchemeShape) -> std::result::Result<(), String> {
        check_base("sinusoidal_add", self.base)?;
        let d_model = shape.d_model;
        if !d_model.is_multiple_of(2) {
            return Err(format!(
                "sinusoidal_add needs an even width for its (sin, cos) pairs, but d_model = \
                 {d_model} is odd: use an even width such as {}",
                d_model + 1
            ));
        }
        Ok(())
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        Ok(PositionalModule::Input(InputPositions::Add(
            InputPositions::sinusoid(shape.d_model, self.base, self.layout, shape.max_len, &vb)?,
        )))
    }
}

impl Describe for SinusoidalOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        format!(
            "input side: tokens + sinusoid ({} wide, base {}, {} layout)",
            shape.d_model, self.base, self.layout
        )
    }
}

impl Portray for SinusoidalOptions {
    fn fixed_table(&self, d_model: usize, _head_dim: usize) -> Option<FixedTable> {
        Some(FixedTable::Sinusoidal {
            dim: d_model,
            base: self.base,
            layout: self.layout,
        })
    }

    fn without_model(&self, knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Ok(Portrait::Table(knobs.sinusoidal_table()))
    }
}

impl Bench for SinusoidalOptions {
    fn benchmarked(&self) -> Option<Vec<(String, PositionalConfig)>> {
        Some(vec![(
            "sin_add".into(),
            PositionalConfig::SinusoidalAdd(self.clone()),
        )])
    }
}

impl ScoreMemory for SinusoidalOptions {}
