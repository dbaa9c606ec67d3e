//! `learned`: a trained `max_len x d_model` table added to the token embeddings, as in BERT
//! (Devlin et al. 2019) and GPT (Radford et al. 2018):
//!
//! ```text
//! h_0[t] = embed_scale · E[x_t] + P[p_t],  P: (max_len, d_model), P ~ N(0, init_std²)
//! ```
//!
//! Positions at or past `max_len` have no row: longer inputs are refused (or, with randomized
//! positions, the table has `N` rows and any length up to `N` reads trained rows).

use super::{Bench, Describe, Named, Portray, ScoreMemory};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::scheme::check_init_std;
use super::{
    InputPositions, LearnedPositions, Placement, PositionalModule, Scheme, SchemeShape,
    DEFAULT_LEARNED_INIT_STD,
};
use crate::error::Result;

fn default_learned_init_std() -> f64 {
    DEFAULT_LEARNED_INIT_STD
}

/// Options of `learned`: a trained `max_len x d_model` table added to the token embeddings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LearnedOptions {
    /// Standard deviation of the normal initialisation (default `1/sqrt(2)`, the sinusoid's own).
    #[serde(default = "default_learned_init_std")]
    pub init_std: f64,
}

impl Default for LearnedOptions {
    fn default() -> Self {
        Self {
            init_std: DEFAULT_LEARNED_INIT_STD,
        }
    }
}

impl Named for LearnedOptions {
    fn name(&self) -> &'static str {
        "learned"
    }
}

impl Scheme for LearnedOptions {
    fn placement(&self) -> Placement {
        Placement::Input
    }

    fn check(&self, _shape: &SchemeShape) -> std::result::Result<(), String> {
        check_init_std("learned", self.init_std)
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        shape.max_len as u128 * shape.d_model as u128
    }

    fn has_learned_table(&self) -> bool {
        true
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        Ok(PositionalModule::Input(InputPositions::Learned(
            LearnedPositions::new(
                shape.max_len,
                shape.d_model,
                self.init_std,
                vb.pp("pos_emb"),
            )?,
        )))
    }
}

impl Describe for LearnedOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        format!(
            "input side: tokens + learned table ({} x {}, init N(0, {:.4}))",
            shape.max_len, shape.d_model, self.init_std
        )
    }
}

impl Portray for LearnedOptions {}

impl Bench for LearnedOptions {}

impl ScoreMemory for LearnedOptions {}
