//! Positional schemes: what each one is, its options, and where it acts.
//!
//! There are two places a transformer encoder can learn order, and the types keep them apart:
//! - **input side** ([`InputPositions`]): positions join the token embeddings before the first
//!   layer, by addition (`sinusoidal_add`, `learned`) or by concatenation (`sinusoidal_concat`);
//!   `none` is the bag-of-words control;
//! - **attention side** ([`Rope`]): q and k are rotated by position inside every attention layer.
//!
//! One configuration enum, [`PositionalConfig`], names the choice; each variant carries only the
//! options that make sense for it, so an invalid combination cannot be written down.

mod input;
mod rope;
pub(crate) mod sinusoidal;
mod table;

pub use input::{InputPositions, LearnedPositions};
pub use rope::{Rope, RopeAngles};
pub use sinusoidal::{inverse_frequencies, sinusoidal_table};
pub use table::PositionTable;

use serde::{Deserialize, Serialize};

/// The default base of the sinusoid's geometric frequency ladder (Vaswani et al., 2017).
pub const DEFAULT_BASE: f64 = 10_000.0;

/// The standard deviation of a sinusoid entry over positions, `1/sqrt(2)`: a learned table starts
/// at this scale so it joins the token embeddings with the same energy as the fixed table.
pub const DEFAULT_LEARNED_INIT_STD: f64 = std::f64::consts::FRAC_1_SQRT_2;

fn default_base() -> f64 {
    DEFAULT_BASE
}

fn default_learned_init_std() -> f64 {
    DEFAULT_LEARNED_INIT_STD
}

/// How the (sin, cos) pairs of a sinusoidal table are laid out along the width.
///
/// With `w_i = base^(-2i/d)` and `i` in `0..d/2`:
/// - `interleaved`: `[sin w0 p, cos w0 p, sin w1 p, cos w1 p, ...]`, as in the paper;
/// - `half`: `[sin w0 p, ..., sin w(d/2-1) p, cos w0 p, ..., cos w(d/2-1) p]`, as in
///   tensor2tensor and fairseq.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TableLayout {
    #[default]
    Interleaved,
    Half,
}

/// Which coordinates of a head RoPE rotates together, by angle `t * w_i`, `w_i = base^(-2i/d_head)`.
/// - `interleaved`: pairs `(x[2i], x[2i+1])`, as in RoFormer;
/// - `half`: pairs `(x[i], x[i + d_head/2])`, the "rotate-half" form of GPT-NeoX and LLaMA.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopePairing {
    #[default]
    Interleaved,
    Half,
}

impl std::fmt::Display for TableLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Interleaved => "interleaved",
            Self::Half => "half",
        })
    }
}

impl std::fmt::Display for RopePairing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Interleaved => "interleaved",
            Self::Half => "half",
        })
    }
}

/// Options of `sinusoidal_add`: the table is as wide as the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinusoidalOptions {
    #[serde(default = "default_base")]
    pub base: f64,
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

/// Options of `sinusoidal_concat`: a `pos_dim` wide sinusoid appended after the token embeddings.
///
/// - `project = false` (default): token embeddings `d_model - pos_dim` wide, so the concatenation
///   is `d_model` wide with no extra parameters;
/// - `project = true`: token embeddings `d_model` wide, the `d_model + pos_dim` concatenation
///   mapped back to `d_model` by a trained linear layer `pos_proj`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConcatOptions {
    pub pos_dim: usize,
    #[serde(default = "default_base")]
    pub base: f64,
    #[serde(default)]
    pub layout: TableLayout,
    #[serde(default)]
    pub project: bool,
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

/// Options of `rope`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeOptions {
    #[serde(default = "default_base")]
    pub base: f64,
    #[serde(default)]
    pub pairing: RopePairing,
}

impl Default for RopeOptions {
    fn default() -> Self {
        Self {
            base: DEFAULT_BASE,
            pairing: RopePairing::default(),
        }
    }
}

/// `none` takes no options; the empty struct exists so that stray options are refused.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoOptions {}

/// The positional choice, written in config as a table tagged by `kind`:
///
/// ```toml
/// [positional]
/// kind = "sinusoidal_concat"
/// pos_dim = 64
/// base = 10000.0
/// layout = "interleaved"
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PositionalConfig {
    /// Token embeddings only: the bag-of-words control.
    None(NoOptions),
    /// The sinusoidal table added to the token embeddings.
    SinusoidalAdd(SinusoidalOptions),
    /// The sinusoidal table concatenated after narrower token embeddings.
    SinusoidalConcat(ConcatOptions),
    /// A trained table added to the token embeddings.
    Learned(LearnedOptions),
    /// Rotary embedding of q and k inside every attention layer.
    Rope(RopeOptions),
}

/// Where a positional scheme acts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// No positional information anywhere.
    Nowhere,
    /// Joined with the token embeddings before the first layer.
    Input,
    /// Applied to q and k inside every attention layer.
    Attention,
}

impl PositionalConfig {
    /// The name used in configs and reports.
    pub fn name(&self) -> &'static str {
        match self {
            Self::None(_) => "none",
            Self::SinusoidalAdd(_) => "sinusoidal_add",
            Self::SinusoidalConcat(_) => "sinusoidal_concat",
            Self::Learned(_) => "learned",
            Self::Rope(_) => "rope",
        }
    }

    pub fn placement(&self) -> Placement {
        match self {
            Self::None(_) => Placement::Nowhere,
            Self::SinusoidalAdd(_) | Self::SinusoidalConcat(_) | Self::Learned(_) => {
                Placement::Input
            }
            Self::Rope(_) => Placement::Attention,
        }
    }

    /// Width of the token embedding table: narrower than the model only for concatenation
    /// without projection.
    pub fn token_dim(&self, d_model: usize) -> usize {
        match self {
            Self::SinusoidalConcat(o) if !o.project => d_model.saturating_sub(o.pos_dim),
            _ => d_model,
        }
    }

    /// Checks the options against the model's width and head width. Returns a message naming the
    /// offending option and a fix.
    pub(crate) fn validate(&self, d_model: usize, head_dim: usize) -> Result<(), String> {
        fn check_base(kind: &str, base: f64) -> Result<(), String> {
            if !base.is_finite() || base <= 1.0 {
                return Err(format!(
                    "{kind}: base = {base} must be a finite number greater than 1 \
                     (10000 is the usual choice)"
                ));
            }
            Ok(())
        }
        match self {
            Self::None(_) => Ok(()),
            Self::SinusoidalAdd(o) => {
                check_base("sinusoidal_add", o.base)?;
                if d_model % 2 != 0 {
                    return Err(format!(
                        "sinusoidal_add needs an even width for its (sin, cos) pairs, \
                         but d_model = {d_model} is odd: use an even width such as {}",
                        d_model + 1
                    ));
                }
                Ok(())
            }
            Self::SinusoidalConcat(o) => {
                check_base("sinusoidal_concat", o.base)?;
                if o.pos_dim < 2 || (!o.project && o.pos_dim >= d_model) {
                    return Err(format!(
                        "sinusoidal_concat: pos_dim = {} must be at least 2 and, without \
                         projection, less than d_model = {d_model}, so the token embedding (d_model - pos_dim wide) \
                         keeps some width; or set project = true to keep tokens d_model wide \
                         and project the concatenation back",
                        o.pos_dim
                    ));
                }
                if o.pos_dim % 2 != 0 {
                    return Err(format!(
                        "sinusoidal_concat: pos_dim = {} is odd, but a sinusoidal table needs \
                         an even width for its (sin, cos) pairs: use {} or {}",
                        o.pos_dim,
                        o.pos_dim - 1,
                        o.pos_dim + 1
                    ));
                }
                Ok(())
            }
            Self::Learned(o) => {
                if !o.init_std.is_finite() || o.init_std < 0.0 {
                    return Err(format!(
                        "learned: init_std = {} must be a finite, non-negative number",
                        o.init_std
                    ));
                }
                Ok(())
            }
            Self::Rope(o) => {
                check_base("rope", o.base)?;
                if head_dim % 2 != 0 {
                    return Err(format!(
                        "rope rotates pairs of coordinates, so the head width must be even, but \
                         d_model / n_heads = {head_dim} is odd: change d_model or n_heads"
                    ));
                }
                Ok(())
            }
        }
    }
}
