//! `none`: token embeddings only, the bag-of-words control. An encoder without positions sees
//! a set of tokens: every permutation of the input permutes its outputs the same way.
//!
//! ```text
//! h_0[t] = embed_scale · E[x_t]
//! ```
//!
//! Decoders learn order without positions through the causal mask (Haviv et al. 2022,
//! "Transformer Language Models without Positional Encodings Still Learn Positional
//! Information"; Kazemnejad et al. 2023, "NoPE"); a bidirectional encoder cannot, which is what
//! this control shows.

use super::{Bench, Describe, Named, Portray, ScoreMemory};
use candle_nn::VarBuilder;

use super::{InputPositions, Knobs, Placement, Portrait, PositionalModule, Scheme, SchemeShape};
use crate::error::Result;

/// The `none` scheme (its options are [`super::NoOptions`]).
#[derive(Clone, Copy, Debug)]
pub struct NoneScheme;

impl Named for NoneScheme {
    fn name(&self) -> &'static str {
        "none"
    }
}

impl Scheme for NoneScheme {
    fn placement(&self) -> Placement {
        Placement::Nowhere
    }

    fn check_random_positions(&self, range: usize) -> std::result::Result<(), String> {
        Err(format!(
            "random_positions = {range} with positional `none`: a model without positions has \
             none to randomize, so this would be the plain model under another name; remove \
             random_positions"
        ))
    }

    fn build(&self, _shape: &SchemeShape, _vb: VarBuilder) -> Result<PositionalModule> {
        Ok(PositionalModule::Input(InputPositions::None))
    }
}

impl Describe for NoneScheme {
    fn describe(&self, _shape: &SchemeShape) -> String {
        "no positions (the bag-of-words control)".into()
    }
}

impl Portray for NoneScheme {
    fn without_model(&self, _knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Err("none: the bag-of-words control has no positions to draw".into())
    }
}

impl Bench for NoneScheme {}

impl ScoreMemory for NoneScheme {}
