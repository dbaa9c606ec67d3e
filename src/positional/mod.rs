//! Positional schemes: what each one is, its options, and where it acts.
//!
//! There are three places a transformer encoder can learn order, and the types keep them apart
//! ([`Placement`], and one module each in [`PositionalModule`]):
//! - **input side** ([`InputPositions`]): positions join the token embeddings before the first
//!   layer, by addition (`sinusoidal_add`, `learned`) or by concatenation (`sinusoidal_concat`);
//!   `none` is the bag-of-words control;
//! - **rotation inside attention** ([`Rope`]): q and k are rotated by position in every layer;
//! - **a bias on the attention scores** ([`ScoreBias`]): every layer adds a term of the two
//!   tokens' positions to its scores: a fixed distance penalty (`alibi`), a learned table of
//!   distance buckets (`t5`), a learned kernel of the distance (`kerple`), or the correlation of
//!   two learned or sinusoidal absolute positions (`untied`, TUPE).
//!
//! Every scheme reads each token's position from [`Positions`] (by default `0..t`; randomized
//! positions draw them, see [`random_positions`]). One configuration enum,
//! [`PositionalConfig`], names the choice; each variant carries only the options that make sense
//! for it, so an invalid combination cannot be written down. The layers below (`crate::nn`) know
//! no scheme: attention takes rotation tables and a score bias as plain tensors, built here.

mod alibi;
mod input;
mod kerple;
mod positions;
mod rope;
mod rope_scaling;
mod score_bias;
pub(crate) mod sinusoidal;
mod t5;
mod table;
mod untied;

pub use alibi::{alibi_slopes, Alibi};
pub use input::{InputPositions, LearnedPositions};
pub use kerple::{Kerple, KERPLE_MIN};
pub use positions::{random_batch_positions, random_positions, Positions, MAX_POSITION};
pub use rope::Rope;
pub use rope_scaling::{rope_frequencies, rotary_dim, Factor, RopeScaling};
pub use score_bias::{LayerBiases, ScoreBias};
pub use sinusoidal::{inverse_frequencies, sinusoidal_table};
pub use t5::{t5_bucket, T5Bias};
pub use table::{PositionTable, MAX_TABLE_VALUES};
pub use untied::{Untied, UntiedRows};

use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::error::Result;

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

fn default_fraction() -> f64 {
    1.0
}

fn is_one(v: &f64) -> bool {
    *v == 1.0
}

/// Options of `rope`: the base and pairing; `fraction`, the share of each head rotated (its
/// first `int(d_head · fraction)` coordinates, an even number; the rest pass through); and
/// `scaling`, how frequencies are stretched past the training length (see [`RopeScaling`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeOptions {
    #[serde(default = "default_base")]
    pub base: f64,
    #[serde(default)]
    pub pairing: RopePairing,
    #[serde(default = "default_fraction", skip_serializing_if = "is_one")]
    pub fraction: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling: Option<RopeScaling>,
}

impl RopeOptions {
    /// The rotated width of a head of `head_dim`.
    pub fn rotary_dim(&self, head_dim: usize) -> usize {
        rotary_dim(head_dim, self.fraction)
    }
}

impl Default for RopeOptions {
    fn default() -> Self {
        Self {
            base: DEFAULT_BASE,
            pairing: RopePairing::default(),
            fraction: 1.0,
            scaling: None,
        }
    }
}

/// `none`, `alibi` and `kerple` take no options; the empty struct exists so that stray options
/// are refused.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoOptions {}

fn default_t5_buckets() -> usize {
    32
}

fn default_t5_max_distance() -> usize {
    128
}

/// Options of `t5`: T5's bidirectional relative-position buckets (see [`t5_bucket`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct T5Options {
    /// Buckets in all (half for keys after the query, half for keys before it).
    #[serde(default = "default_t5_buckets")]
    pub buckets: usize,
    /// Distances from here on share the last bucket of their side.
    #[serde(default = "default_t5_max_distance")]
    pub max_distance: usize,
}

impl Default for T5Options {
    fn default() -> Self {
        Self {
            buckets: default_t5_buckets(),
            max_distance: default_t5_max_distance(),
        }
    }
}

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
    #[serde(default)]
    pub source: UntiedSource,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<TableLayout>,
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
    /// ALiBi: `-slope_h |p_i - p_j|` on the scores (symmetric, for an encoder), Press et al.'s
    /// slopes; no weights.
    Alibi(NoOptions),
    /// T5's relative buckets: a learned `(buckets, heads)` table shared by all layers, indexed by
    /// the bucket of `p_j - p_i`.
    T5(T5Options),
    /// KERPLE (logarithmic): `-r1_h ln(1 + r2_h |p_i - p_j|)`, `r1, r2 > 0` learned per head and
    /// layer.
    Kerple(NoOptions),
    /// TUPE's untied positions: nothing joins the input; every layer adds
    /// `(p_i U_q)_h · (p_j U_k)_h / sqrt(2 d_head)` and scales its content scores by
    /// `1/sqrt(2 d_head)`.
    Untied(UntiedOptions),
}

/// Where a positional scheme acts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// No positional information anywhere.
    Nowhere,
    /// Joined with the token embeddings before the first layer.
    Input,
    /// A rotation of q and k inside every attention layer.
    Attention,
    /// A bias added to the attention scores of every layer.
    AttentionBias,
}

impl Placement {
    /// As `inspect` and reports write it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Nowhere => "nowhere",
            Self::Input => "input",
            Self::Attention => "attention",
            Self::AttentionBias => "attention bias",
        }
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
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
            Self::Alibi(_) => "alibi",
            Self::T5(_) => "t5",
            Self::Kerple(_) => "kerple",
            Self::Untied(_) => "untied",
        }
    }

    /// Every scheme's name, in the order of the enum.
    pub const NAMES: [&'static str; 9] = [
        "none",
        "sinusoidal_add",
        "sinusoidal_concat",
        "learned",
        "rope",
        "alibi",
        "t5",
        "kerple",
        "untied",
    ];

    pub fn placement(&self) -> Placement {
        match self {
            Self::None(_) => Placement::Nowhere,
            Self::SinusoidalAdd(_) | Self::SinusoidalConcat(_) | Self::Learned(_) => {
                Placement::Input
            }
            Self::Rope(_) => Placement::Attention,
            Self::Alibi(_) | Self::T5(_) | Self::Kerple(_) | Self::Untied(_) => {
                Placement::AttentionBias
            }
        }
    }

    /// What attention multiplies `q kᵀ` by, where a scheme changes it: `1/sqrt(2 d_head)` for
    /// `untied`, whose positional term is a second score of the same size (TUPE). `None` is the
    /// usual `1/sqrt(d_head)`.
    pub fn score_scale(&self, head_dim: usize) -> Option<f64> {
        match self {
            Self::Untied(_) => Some(1.0 / (2.0 * head_dim as f64).sqrt()),
            _ => None,
        }
    }

    /// Whether the scheme has a learned table of `max_len` rows (which bounds the positions a
    /// model can read).
    pub fn has_learned_table(&self) -> bool {
        matches!(self, Self::Learned(_))
            || matches!(self, Self::Untied(o) if o.source == UntiedSource::Learned)
    }

    /// Width of the token embedding table: narrower than the model only for concatenation
    /// without projection.
    pub fn token_dim(&self, d_model: usize) -> usize {
        match self {
            Self::SinusoidalConcat(o) if !o.project => d_model.saturating_sub(o.pos_dim),
            _ => d_model,
        }
    }

    /// Checks the options against a model's width and head width (what `ModelConfig::validate`
    /// runs), for callers that build a scheme's parts without a whole model.
    pub fn validate_options(
        &self,
        d_model: usize,
        head_dim: usize,
    ) -> std::result::Result<(), String> {
        self.validate(d_model, head_dim)
    }

    /// Checks the options against the model's width and head width. Returns a message naming the
    /// offending option and a fix.
    pub(crate) fn validate(
        &self,
        d_model: usize,
        head_dim: usize,
    ) -> std::result::Result<(), String> {
        fn check_base(kind: &str, base: f64) -> std::result::Result<(), String> {
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
                if !(o.fraction.is_finite() && o.fraction > 0.0 && o.fraction <= 1.0) {
                    return Err(format!(
                        "rope: fraction = {} must be in (0, 1]: the share of each head's \
                         coordinates that is rotated",
                        o.fraction
                    ));
                }
                let rd = o.rotary_dim(head_dim);
                if o.fraction == 1.0 && head_dim % 2 != 0 {
                    return Err(format!(
                        "rope rotates pairs of coordinates, so the head width must be even, but \
                         d_model / n_heads = {head_dim} is odd: change d_model or n_heads"
                    ));
                }
                if rd == 0 || rd % 2 != 0 {
                    return Err(format!(
                        "rope rotates pairs of coordinates, so the rotated width \
                         int({head_dim} x {}) = {rd} must be even and positive: change \
                         fraction (or d_model, n_heads)",
                        o.fraction
                    ));
                }
                if let Some(s) = &o.scaling {
                    s.check(rd, false)?;
                }
                Ok(())
            }
            Self::Alibi(_) | Self::Kerple(_) => Ok(()),
            Self::T5(o) => {
                if o.buckets < 4 {
                    return Err(format!(
                        "t5: buckets = {} must be at least 4 (half the buckets for each side, \
                         and exact buckets for the nearest distances in each half); 32 is T5's",
                        o.buckets
                    ));
                }
                let max_exact = o.buckets / 4;
                if o.max_distance <= max_exact {
                    return Err(format!(
                        "t5: max_distance = {} must be above {max_exact} (buckets / 4, the \
                         distances that get a bucket each); 128 is T5's",
                        o.max_distance
                    ));
                }
                Ok(())
            }
            Self::Untied(o) => match o.source {
                UntiedSource::Learned => {
                    if o.base.is_some() || o.layout.is_some() {
                        return Err(
                            "untied: base and layout belong to source = \"sinusoidal\"; a \
                             learned source takes only init_std: drop them, or set source = \
                             \"sinusoidal\""
                                .into(),
                        );
                    }
                    let std = o.init_std();
                    if !std.is_finite() || std < 0.0 {
                        return Err(format!(
                            "untied: init_std = {std} must be a finite, non-negative number"
                        ));
                    }
                    Ok(())
                }
                UntiedSource::Sinusoidal => {
                    if o.init_std.is_some() {
                        return Err("untied: init_std belongs to source = \"learned\"; a \
                                    sinusoidal source is fixed: drop init_std"
                            .into());
                    }
                    check_base("untied", o.base())?;
                    if d_model % 2 != 0 {
                        return Err(format!(
                            "untied with source = \"sinusoidal\" needs an even width for its \
                             (sin, cos) pairs, but d_model = {d_model} is odd: use an even \
                             width such as {}, or source = \"learned\"",
                            d_model + 1
                        ));
                    }
                    Ok(())
                }
            },
        }
    }
}

/// Where constrained variables must stay: the lowest value of a variable, by name, that an
/// optimizer projects it back to after each step (KERPLE's `r1`, `r2`).
pub fn lower_bound(name: &str) -> Option<f64> {
    kerple::lower_bound(name)
}

/// The sizes a scheme's modules are built for.
#[derive(Clone, Copy, Debug)]
pub struct SchemeShape {
    pub d_model: usize,
    pub n_heads: usize,
    pub n_layers: usize,
    /// Rows of a learned table; the initial rows of fixed ones.
    pub max_len: usize,
}

/// An encoder's positional module, in the one place its scheme acts.
#[derive(Debug)]
pub enum PositionalModule {
    /// Joined with the token embeddings (the `none` control joins nothing).
    Input(InputPositions),
    /// Rotates q and k in every attention layer.
    Rotation(Rope),
    /// Added to the attention scores of every layer.
    ScoreBias(ScoreBias),
}

impl PositionalModule {
    /// Builds the module of `config` under `vb` (weight names: `pos_emb.weight`, `pos_proj.*`,
    /// `rel_bias.weight`, `layers.{i}.attn.kerple.{r1,r2}`, `pos_attn.{q,k}.weight`).
    pub fn new(config: &PositionalConfig, shape: SchemeShape, vb: VarBuilder) -> Result<Self> {
        Ok(match config.placement() {
            Placement::Nowhere | Placement::Input => Self::Input(InputPositions::new(
                config,
                shape.d_model,
                shape.max_len,
                vb,
            )?),
            Placement::Attention => match config {
                PositionalConfig::Rope(options) => Self::Rotation(Rope::new(
                    options,
                    shape.d_model / shape.n_heads.max(1),
                    shape.max_len,
                    vb.dtype(),
                    vb.device(),
                )?),
                _ => unreachable!("only rope acts by rotation"),
            },
            Placement::AttentionBias => Self::ScoreBias(ScoreBias::new(config, shape, vb)?),
        })
    }

    /// The longest position (plus one) the module can read, where there is a limit (a learned
    /// table).
    pub fn max_positions(&self) -> Option<usize> {
        match self {
            Self::Input(input) => input.max_positions(),
            Self::ScoreBias(bias) => bias.max_positions(),
            Self::Rotation(_) => None,
        }
    }
}
