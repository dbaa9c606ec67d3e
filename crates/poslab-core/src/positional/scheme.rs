//! What every positional scheme provides. [`super::PositionalConfig`] holds one variant per
//! scheme and dispatches each question to the scheme's own file through [`Scheme`]: its
//! placement, the checks of its options, its parameter count, how `inspect` describes it, and
//! the module it builds, what `analyze` draws of it, how `bench` names it, and whether its
//! frequencies rescale. Nothing outside a scheme's file matches on the scheme (a test in
//! `tests/suite/layout.rs` holds this).

use candle_nn::VarBuilder;

use super::portrait::{FixedTable, Knobs, Measure, OffsetIndex, Portrait};
use super::{Placement, PositionalConfig, PositionalModule, RopeScaling};
use crate::error::Result;
use crate::layers::LayerSet;

/// The sizes a scheme's modules are built for.
#[derive(Clone, Copy, Debug)]
pub struct SchemeShape {
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads per layer.
    pub n_heads: usize,
    /// Encoder layers.
    pub n_layers: usize,
    /// Rows of a learned table; the initial rows of fixed ones.
    pub max_len: usize,
    /// The layers that apply the scheme (all but a plan's `none` entries): a scheme with
    /// parameters per layer makes them for these only.
    pub layers: LayerSet,
    /// Whether every query sees no key after it (the model's `causal`): a scheme whose
    /// published causal form is not its masked encoder form builds that form.
    pub causal: bool,
}

impl SchemeShape {
    /// The width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads.max(1)
    }
}

/// One positional scheme: its name, where it acts, the checks of its options, its parameters
/// and the module it builds, with what the model's shapes read of it. What `inspect`,
/// `analyze`, `bench` and the memory bound want of a scheme are the extension traits
/// [`Describe`], [`Portray`], [`Bench`] and [`ScoreMemory`], implemented in the scheme's file.
pub trait Scheme: Named + Describe + Portray + Bench + ScoreMemory + Sync {
    /// Where it acts: the input, a rotation of q and k, or a bias on the scores.
    fn placement(&self) -> Placement;

    /// Whether the scores read q and k through more than `q . k` plus terms that do not depend
    /// on the key's content, which makes a key bias a real parameter: elsewhere it adds
    /// `q_i . b_k` to every score of query `i`, which the softmax cancels, and the key
    /// projection has none. By default where the scheme acts says ([`Placement::reads_keys`]).
    fn reads_keys(&self) -> bool {
        self.placement().reads_keys()
    }

    /// Checks the options against the model's sizes; the message names the option and a fix.
    fn check(&self, _shape: &SchemeShape) -> std::result::Result<(), String> {
        Ok(())
    }

    /// A refusal of randomized positions, where they make no sense for the scheme.
    fn check_random_positions(&self, _range: usize) -> std::result::Result<(), String> {
        Ok(())
    }

    /// The number of trainable values the scheme adds to an encoder of `shape`.
    fn param_count(&self, _shape: &SchemeShape) -> u128 {
        0
    }

    /// Width of the token embedding table (narrower than the model for concatenation).
    fn token_dim(&self, d_model: usize) -> usize {
        d_model
    }

    /// Whether the scheme has a learned table of `max_len` rows (which bounds the positions).
    fn has_learned_table(&self) -> bool {
        false
    }

    /// What attention multiplies `q kᵀ` by, where the scheme changes it (`None`: `1/sqrt(d_head)`).
    fn score_scale(&self, _head_dim: usize) -> Option<f64> {
        None
    }

    /// The same scheme with its rotation's base set to `base`, for a scheme that has one
    /// (`[layers] rope_base`: another base in global and local layers); `None` otherwise.
    fn with_base(&self, _base: f64) -> Option<PositionalConfig> {
        None
    }

    /// The same scheme with its rotation's frequencies rescaled by `scaling` (`None`: as
    /// trained), to read past the training length; `None` for a scheme whose frequencies do not
    /// rescale.
    fn with_scaling(&self, _scaling: Option<RopeScaling>) -> Option<PositionalConfig> {
        None
    }

    /// The width of the positions where the scheme sets it apart from the model's (a
    /// concatenation's `pos_dim`).
    fn pos_dim(&self) -> Option<usize> {
        None
    }

    /// The scheme's module for an encoder of `shape`, its variables under `vb`.
    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule>;
}

/// A scheme's name, which every view of it reads.
pub trait Named {
    /// The name used in configs and reports (`kind = "..."`).
    fn name(&self) -> &'static str;
}

/// How `inspect` and the reports name and describe a scheme.
pub trait Describe: Named {
    /// One line for `inspect`: where it acts and what with.
    fn describe(&self, shape: &SchemeShape) -> String;

    /// A row label that tells apart the variants of the scheme in a table of schemes.
    fn label(&self) -> String {
        self.name().to_string()
    }

    /// The model width as a results table shows it (`d = tokens + positions` for concatenation).
    fn width(&self, d_model: usize) -> String {
        d_model.to_string()
    }
}

/// What `analyze` draws of a scheme (`positional::portrait`): its tables, its bias by name, the index of its learned values and what a trained model's scheme shows beyond them.
pub trait Portray: Named {
    /// The table of positions the scheme computes for a model of `d_model` (head width
    /// `head_dim`), where it has one; a learned table is read from the weights instead.
    fn fixed_table(&self, _d_model: usize, _head_dim: usize) -> Option<FixedTable> {
        None
    }

    /// What `analyze SCHEME` draws of the scheme without a model, its options set from the
    /// command's `knobs` where it has them; else why it cannot, and what to give instead.
    fn without_model(&self, _knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Err(format!(
            "{name}: its positions are learned, so they exist only in a trained model: give --run \
             DIR of a model trained with `{name}`",
            name = self.name()
        ))
    }

    /// The function of the offset that indexes the scheme's learned values, for `positions`
    /// queries and keys, where it has one (T5's bucket).
    fn offset_index(&self, _positions: usize) -> Option<OffsetIndex> {
        None
    }

    /// What `analyze --run` draws of a trained model's scheme beyond its table, its score
    /// biases and the split of its logits.
    fn measure(&self) -> Option<Measure> {
        None
    }
}

/// What `bench` counts and measures of a scheme.
pub trait Bench {
    /// The FLOPs the scheme adds to a forward pass of `batch` sequences of `seq` tokens through
    /// an encoder of `shape`, beyond the encoder's own matrix products: 2 per multiply-add of its
    /// own products, as `bench` and the PyTorch reference count them (element-wise work is not
    /// counted).
    fn forward_flops(&self, _shape: &SchemeShape, _batch: usize, _seq: usize) -> f64 {
        0.0
    }

    /// The forms `bench` measures of the scheme, named (the PyTorch reference's names where it
    /// has the scheme); `None`: the scheme itself, under its name.
    fn benchmarked(&self) -> Option<Vec<(String, PositionalConfig)>> {
        None
    }
}

/// What a scheme holds of the attention tables, for the memory bound checked before a batch is built.
pub trait ScoreMemory {
    /// How many `(b, h, t, t)` values of f32 a layer of the scheme holds at its peak, in units
    /// of one attention table, in a training step (`training`) or a forward pass, for the memory
    /// bound before a batch is built ([`crate::limits::activation_bytes`]); `fused`: whether
    /// poslab's fused CPU kernels compute the layer ([`crate::nn::Backend::fused_on`]). 1 where attention
    /// is the usual one. A scheme whose scores are a composition of ops holds more there; its
    /// file states the measured peaks they are set from.
    fn score_tensors(&self, _training: bool, _fused: bool) -> usize {
        1
    }
}

/// Refuses a base that is not a finite number above 1.
pub(crate) fn check_base(kind: &str, base: f64) -> std::result::Result<(), String> {
    if !base.is_finite() || base <= 1.0 {
        return Err(format!(
            "{kind}: base = {base} must be a finite number greater than 1 (10000 is the usual \
             choice)"
        ));
    }
    Ok(())
}

/// Refuses an initial standard deviation that is not a finite, non-negative number.
pub(crate) fn check_init_std(kind: &str, std: f64) -> std::result::Result<(), String> {
    if !std.is_finite() || std < 0.0 {
        return Err(format!(
            "{kind}: init_std = {std} must be a finite, non-negative number"
        ));
    }
    Ok(())
}
