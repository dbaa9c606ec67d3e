//! Positional schemes: what each one is, its options, and where it acts.
//!
//! There are three places a transformer encoder can learn order, and the types keep them apart
//! ([`Placement`], and one module each in [`PositionalModule`]):
//! - **input side** ([`InputPositions`]): positions join the token embeddings before the first
//!   layer, by addition (`sinusoidal_add`, `learned`) or by concatenation (`sinusoidal_concat`);
//!   `none` is the bag-of-words control;
//! - **rotation inside attention** ([`Rope`]): q and k are rotated by position in every layer
//!   (`rope`, and `prope`, which rotates only RoPE's fastest frequencies);
//! - **a bias on the attention scores** ([`ScoreBias`]): every layer adds a term to its scores:
//!   a fixed distance penalty (`alibi`), a learned table of distance buckets (`t5`), a learned
//!   kernel of the distance (`kerple`), a learned function of the normalised distance (`fire`),
//!   the correlation of two absolute positions (`untied`, TUPE), or a decay each token sets from
//!   its content (`fox`);
//! - **the scores themselves** ([`ScoreFunction`]): every layer computes its scores from q and k
//!   its own way: a polar product whose phase is the position (`pope`), positions counted by
//!   gates the queries set (`cope`), or keys carried to the query through the Householder
//!   reflections of the tokens between them (`path`).
//!
//! Every scheme lives in its own file, which owns its options, their checks, its parameter
//! count, its description, its module and its variables' constraints ([`Scheme`]).
//! [`PositionalConfig`] names the choice, one variant per scheme carrying only the options that
//! make sense for it, and dispatches to the scheme's file; nothing else matches on schemes.
//! Every scheme reads each token's position from [`Positions`] (by default `0..t`; randomized
//! positions draw them, see [`random_positions`]). The layers below (`crate::nn`) know no
//! scheme: attention takes rotation tables and a score bias as plain tensors, built here.

mod adaptive;
mod alibi;
mod cope;
mod fire;
mod fox;
mod grape_a;
mod grape_m;
mod input;
mod kerple;
mod learned;
mod none;
mod path;
mod pope;
mod portrait;
mod positions;
mod prope;
mod rope;
mod rope_scaling;
mod scheme;
mod score_bias;
mod scores;
pub mod sinusoidal;
mod sinusoidal_add;
mod sinusoidal_concat;
mod stick_breaking;
mod t5;
mod table;
mod untied;

pub use adaptive::{Adaptive, Dape, DapeMlp, DAPE_SLOPE, MAX_DAPE_WIDTH};
pub use alibi::{alibi_slopes, Alibi, AlibiOptions};
pub use cope::{Cope, CopeOptions, CopeParts, CopeTables, MAX_COPE_POSITIONS};
pub use fire::{Fire, FireOptions, MAX_FIRE_WIDTH};
pub use fox::{Fox, FoxGates, FOX_GATE_BIAS};
pub use grape_a::{
    grape_a_bias, grape_a_edges, GrapeA, GrapeAFrame, GrapeALayer, GrapeAOptions, GRAPE_RMS_EPS,
    MAX_GRAPE_P_DIM,
};
pub use grape_m::{grape_rotate, grape_tables, GrapeM, GrapeMOptions};
pub use input::{InputPositions, LearnedPositions};
pub use kerple::{Kerple, KerpleLayers, KerpleOptions, KERPLE_MIN};
pub use learned::LearnedOptions;
pub use path::{
    transport_inverse, transport_scores, Path, PathLayer, PathOptions, Reflections, MAX_PATH_CONV,
    PATH_EPS,
};
pub use pope::{pope_frequencies, DeltaInit, Pope, PopeOptions};
pub use portrait::{FixedTable, Knobs, Measure, OffsetIndex, Portrait};
pub use positions::{random_batch_positions, random_positions, Positions, MAX_POSITION};
pub use prope::{PropeOptions, Refused};
pub use rope::{Rope, RopeOptions};
pub use rope_scaling::{rope_frequencies, rotary_dim, Factor, RopeScaling};
pub use scheme::{Bench, Describe, Named, Portray, Scheme, SchemeShape, ScoreMemory};
pub use score_bias::{BiasBatch, BiasModule, LayerBiases, ScoreBias};
pub use scores::{ScoreFunction, ScoreModule};
pub use sinusoidal::{inverse_frequencies, sinusoidal_table};
pub use sinusoidal_add::SinusoidalOptions;
pub use sinusoidal_concat::ConcatOptions;
pub use stick_breaking::{
    stick_breaking_reference, stick_breaking_weights, Remainder, SbLayer, StickBreaking,
    StickBreakingOptions,
};
pub use t5::{t5_bucket, t5_bucket_causal, T5Bias, T5Options};
pub use table::{PositionTable, MAX_TABLE_VALUES};
pub use untied::{Untied, UntiedOptions, UntiedRows, UntiedSource};

use candle::Tensor;
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::params::LowerBound;

/// The default base of the sinusoid's geometric frequency ladder (Vaswani et al., 2017).
pub const DEFAULT_BASE: f64 = 10_000.0;

/// The standard deviation of a sinusoid entry over positions, `1/sqrt(2)`: a learned table starts
/// at this scale so it joins the token embeddings with the same energy as the fixed table.
pub const DEFAULT_LEARNED_INIT_STD: f64 = std::f64::consts::FRAC_1_SQRT_2;

/// How the (sin, cos) pairs of a sinusoidal table are laid out along the width.
///
/// With `w_i = base^(-2i/d)` and `i` in `0..d/2`:
/// - `interleaved`: `[sin w0 p, cos w0 p, sin w1 p, cos w1 p, ...]`, as in the paper;
/// - `half`: `[sin w0 p, ..., sin w(d/2-1) p, cos w0 p, ..., cos w(d/2-1) p]`, as in
///   tensor2tensor and fairseq.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TableLayout {
    /// Sine and cosine of each frequency side by side (the default).
    #[default]
    Interleaved,
    /// Every sine, then every cosine.
    Half,
}

/// Which coordinates of a head RoPE rotates together, by angle `t * w_i`,
/// `w_i = base^(-2i/d_head)`.
/// - `interleaved`: pairs `(x[2i], x[2i+1])`, as in RoFormer;
/// - `half`: pairs `(x[i], x[i + d_head/2])`, the "rotate-half" form of GPT-NeoX and LLaMA.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopePairing {
    /// Pairs `(x[2i], x[2i+1])` (the default).
    #[default]
    Interleaved,
    /// Pairs `(x[i], x[i + d_head/2])`.
    Half,
}

impl TableLayout {
    /// Every layout, the default first.
    pub const ALL: [TableLayout; 2] = [TableLayout::Interleaved, TableLayout::Half];

    /// The name configs use: `interleaved` or `half`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Interleaved => "interleaved",
            Self::Half => "half",
        }
    }
}

impl RopePairing {
    /// Every pairing, the default first.
    pub const ALL: [RopePairing; 2] = [RopePairing::Interleaved, RopePairing::Half];

    /// The name configs use: `interleaved` or `half`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Interleaved => "interleaved",
            Self::Half => "half",
        }
    }
}

impl std::fmt::Display for TableLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::fmt::Display for RopePairing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `none`, `alibi`, `kerple` and `fox` take no options; the empty struct exists so that stray
/// options are refused.
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
///
/// Each variant's scheme, options and module live in the file the variant names. An option of
/// the wrong type is refused naming its key (`keyed.rs`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self")]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PositionalConfig {
    /// Token embeddings only: the bag-of-words control (`none.rs`).
    None(NoOptions),
    /// The sinusoidal table added to the token embeddings (`sinusoidal_add.rs`).
    SinusoidalAdd(SinusoidalOptions),
    /// The sinusoidal table concatenated after narrower token embeddings
    /// (`sinusoidal_concat.rs`).
    SinusoidalConcat(ConcatOptions),
    /// A trained table added to the token embeddings (`learned.rs`).
    Learned(LearnedOptions),
    /// Rotary embedding of q and k inside every attention layer (`rope.rs`).
    Rope(RopeOptions),
    /// p-RoPE: RoPE's fastest frequencies only (`prope.rs`).
    Prope(PropeOptions),
    /// ALiBi: `-slope_h |p_i - p_j|` on the scores (symmetric, for an encoder), Press et al.'s
    /// slopes; no weights (`alibi.rs`).
    Alibi(AlibiOptions),
    /// T5's relative buckets: a learned `(buckets, heads)` table shared by all layers, indexed by
    /// the bucket of `p_j - p_i` (`t5.rs`).
    T5(T5Options),
    /// KERPLE (logarithmic): `-r1_h ln(1 + r2_h |p_i - p_j|)`, `r1, r2 > 0` learned per head and
    /// layer (`kerple.rs`).
    Kerple(KerpleOptions),
    /// FIRE: a learned MLP of the log distance over the sequence's span, shared by all layers
    /// (`fire.rs`).
    Fire(FireOptions),
    /// TUPE's untied positions: nothing joins the input; every layer adds
    /// `(p_i U_q)_h · (p_j U_k)_h / sqrt(2 d_head)` and scales its content scores by
    /// `1/sqrt(2 d_head)` (`untied.rs`).
    Untied(UntiedOptions),
    /// FoX's data-dependent decay: forget gates from each layer's input, summed between query
    /// and key (`fox.rs`).
    Fox(NoOptions),
    /// PoPE: polar q and k, content in the magnitudes and position in the phases (`pope.rs`).
    Pope(PopeOptions),
    /// CoPE: positions counted by gates the queries set, read from a left and a right table
    /// (`cope.rs`).
    Cope(CopeOptions),
    /// PaTH: keys carried to the query through the Householder reflections of the tokens
    /// between them (`path.rs`).
    Path(PathOptions),
    /// Stick-breaking attention: weights from the order in which the keys break a stick, in
    /// place of the softmax (`stick_breaking.rs`).
    StickBreaking(StickBreakingOptions),
    /// GRAPE-M: q and k turned in RoPE's planes by learned frequencies (`grape_m.rs`).
    GrapeM(GrapeMOptions),
    /// GRAPE-AP: a bias summed over the edges between query and key, each set by the query and
    /// the edge token's content and position (`grape_a.rs`).
    GrapeA(GrapeAOptions),
}

impl Serialize for PositionalConfig {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        // The derived (remote = "Self") serializer: `kind`, then the options.
        PositionalConfig::serialize(self, serializer)
    }
}

impl<'de> Deserialize<'de> for PositionalConfig {
    fn deserialize<D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> std::result::Result<Self, D::Error> {
        crate::keyed::deserialize_naming_key(deserializer, PositionalConfig::deserialize)
    }
}

/// Where a positional scheme acts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// No positional information anywhere.
    Nowhere,
    /// Joined with the token embeddings before the first layer.
    Input,
    /// A rotation of q and k inside every attention layer.
    Rotation,
    /// A bias added to the attention scores of every layer.
    ScoreBias,
    /// The attention scores themselves, computed from q and k by the scheme in every layer.
    Scores,
    /// The attention weights, made from the scores by the scheme in place of the softmax.
    Weights,
}

impl Placement {
    /// As `inspect` and reports write it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Nowhere => "nowhere",
            Self::Input => "input",
            Self::Rotation => "attention",
            Self::ScoreBias => "attention bias",
            Self::Scores => "attention scores",
            Self::Weights => "attention weights",
        }
    }

    /// Whether the scheme reads q and k themselves (a rotation, or scores of its own), which
    /// makes a key bias a real parameter: elsewhere it adds `q_i · b_k` to every score of query
    /// `i`, which softmax cancels.
    pub fn reads_keys(self) -> bool {
        matches!(self, Self::Rotation | Self::Scores | Self::Weights)
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl PositionalConfig {
    /// The scheme of this choice, with its options: every question about the scheme goes to
    /// its own file from here.
    pub fn scheme(&self) -> &dyn Scheme {
        match self {
            Self::None(_) => &none::NoneScheme,
            Self::SinusoidalAdd(o) => o,
            Self::SinusoidalConcat(o) => o,
            Self::Learned(o) => o,
            Self::Rope(o) => o,
            Self::Prope(o) => o,
            Self::Alibi(o) => o,
            Self::T5(o) => o,
            Self::Kerple(o) => o,
            Self::Fire(o) => o,
            Self::Untied(o) => o,
            Self::Fox(_) => &fox::FoxScheme,
            Self::Pope(o) => o,
            Self::Cope(o) => o,
            Self::Path(o) => o,
            Self::StickBreaking(o) => o,
            Self::GrapeM(o) => o,
            Self::GrapeA(o) => o,
        }
    }

    /// Every scheme with its default options (and both forms where a switch makes two
    /// different models: concatenation with and without projection, TUPE's two sources), in
    /// the order of the enum; `pos_dim` is the concatenation's width.
    pub fn catalog(pos_dim: usize) -> Vec<Self> {
        let concat = |project| {
            Self::SinusoidalConcat(ConcatOptions {
                pos_dim,
                base: DEFAULT_BASE,
                layout: TableLayout::default(),
                project,
            })
        };
        vec![
            Self::None(NoOptions {}),
            Self::SinusoidalAdd(SinusoidalOptions::default()),
            concat(false),
            concat(true),
            Self::Learned(LearnedOptions::default()),
            Self::Rope(RopeOptions::default()),
            Self::Prope(PropeOptions::default()),
            Self::Alibi(AlibiOptions::default()),
            Self::T5(T5Options::default()),
            Self::Kerple(KerpleOptions::default()),
            Self::Fire(FireOptions::default()),
            Self::Untied(UntiedOptions::default()),
            Self::Untied(UntiedOptions {
                source: UntiedSource::Sinusoidal,
                ..Default::default()
            }),
            Self::Fox(NoOptions {}),
            Self::Pope(PopeOptions::default()),
            Self::Cope(CopeOptions::default()),
            Self::Path(PathOptions::default()),
            Self::StickBreaking(StickBreakingOptions::default()),
            Self::GrapeM(GrapeMOptions::default()),
            Self::GrapeA(GrapeAOptions::default()),
        ]
    }

    /// Every scheme's name, in the order of the enum.
    pub fn names() -> Vec<&'static str> {
        let mut names: Vec<&'static str> = Self::catalog(2).iter().map(|c| c.name()).collect();
        names.dedup();
        names
    }

    /// The first scheme of the [`catalog`](Self::catalog) named `name`, with its default
    /// options.
    pub fn named(name: &str, pos_dim: usize) -> Option<Self> {
        Self::catalog(pos_dim)
            .into_iter()
            .find(|c| c.name() == name)
    }

    /// The same scheme with its frequencies rescaled by `scaling` (`None`: as trained), where
    /// they rescale (see [`Scheme::with_scaling`]).
    pub fn with_scaling(&self, scaling: Option<RopeScaling>) -> Option<PositionalConfig> {
        self.scheme().with_scaling(scaling)
    }

    /// Whether the scheme's frequencies rescale (`[eval] rope_scaling`, `--rope-scaling`).
    pub fn rescales(&self) -> bool {
        self.with_scaling(None).is_some()
    }

    /// The name used in configs and reports.
    pub fn name(&self) -> &'static str {
        self.scheme().name()
    }

    /// The same scheme with its rotation's base set to `base`, where it has one (see
    /// [`Scheme::with_base`]).
    pub fn with_base(&self, base: f64) -> Option<PositionalConfig> {
        self.scheme().with_base(base)
    }

    /// Where the scheme acts: the input, a rotation inside attention, or a bias on the scores.
    pub fn placement(&self) -> Placement {
        self.scheme().placement()
    }

    /// Whether the scores read q and k through more than their dot product, which makes a key
    /// bias a real parameter (see [`Scheme::reads_keys`]).
    pub fn reads_keys(&self) -> bool {
        self.scheme().reads_keys()
    }

    /// What attention multiplies `q kᵀ` by, where a scheme changes it: `1/sqrt(2 d_head)` for
    /// `untied`, whose positional term is a second score of the same size (TUPE). `None` is the
    /// usual `1/sqrt(d_head)`.
    pub fn score_scale(&self, head_dim: usize) -> Option<f64> {
        self.scheme().score_scale(head_dim)
    }

    /// Whether the scheme has a learned table of `max_len` rows (which bounds the positions a
    /// model can read).
    pub fn has_learned_table(&self) -> bool {
        self.scheme().has_learned_table()
    }

    /// Width of the token embedding table: narrower than the model only for concatenation
    /// without projection.
    pub fn token_dim(&self, d_model: usize) -> usize {
        self.scheme().token_dim(d_model)
    }

    /// The trainable values the scheme adds to an encoder of `shape`.
    pub fn param_count(&self, shape: &SchemeShape) -> u128 {
        self.scheme().param_count(shape)
    }

    /// Checks the options against a model's width and head width, for callers that build a
    /// scheme's parts without a whole model.
    pub fn validate_options(
        &self,
        d_model: usize,
        head_dim: usize,
    ) -> std::result::Result<(), String> {
        self.validate(&SchemeShape {
            d_model,
            n_heads: d_model / head_dim.max(1),
            n_layers: 1,
            max_len: 1,
            layers: crate::layers::LayerSet::ALL,
            causal: false,
        })
    }

    /// Checks the options against the model's sizes. Returns a message naming the offending
    /// option and a fix.
    pub fn validate(&self, shape: &SchemeShape) -> std::result::Result<(), String> {
        self.scheme().check(shape)
    }
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
    /// Computes the attention scores of every layer from q and k.
    Scores(ScoreFunction),
}

impl PositionalModule {
    /// Its variables that weight decay leaves alone (biases).
    pub fn undecayed(&self) -> Vec<Tensor> {
        match self {
            Self::Input(input) => input.undecayed(),
            Self::ScoreBias(bias) => bias.undecayed(),
            Self::Scores(scores) => scores.undecayed(),
            Self::Rotation(_) => Vec::new(),
        }
    }

    /// Every layer's forget gates by layer (`None` for a layer without; empty when the scheme
    /// has none), where the scheme computes its bias as gates a fused layer runs inside itself
    /// (FoX's): to be packed with the layers ([`crate::Encoder::pack`]).
    pub fn input_gates_mut(&mut self) -> Vec<Option<&mut crate::nn::ForgetGates>> {
        match self {
            Self::ScoreBias(bias) => bias.input_gates_mut(),
            Self::Input(_) | Self::Rotation(_) | Self::Scores(_) => Vec::new(),
        }
    }

    /// The learned position table `(max_len, d_model)` of a `learned` or `untied` scheme.
    pub fn learned_table(&self) -> Option<&Tensor> {
        match self {
            Self::Input(input) => input.learned_table(),
            Self::ScoreBias(bias) => bias.learned_table(),
            Self::Rotation(_) | Self::Scores(_) => None,
        }
    }

    /// Builds the module of `config` under `vb` (each scheme names its own weights: see its
    /// file).
    pub fn new(config: &PositionalConfig, shape: SchemeShape, vb: VarBuilder) -> Result<Self> {
        config.scheme().build(&shape, vb)
    }

    /// The longest position (plus one) the module can read, where there is a limit (a learned
    /// table).
    pub fn max_positions(&self) -> Option<usize> {
        match self {
            Self::Input(input) => input.max_positions(),
            Self::ScoreBias(bias) => bias.max_positions(),
            Self::Rotation(_) | Self::Scores(_) => None,
        }
    }

    /// The trainable tensors of the scheme.
    pub fn parameters(&self) -> Vec<Tensor> {
        match self {
            Self::Input(input) => input.parameters(),
            Self::ScoreBias(bias) => bias.parameters(),
            Self::Scores(scores) => scores.parameters(),
            Self::Rotation(_) => Vec::new(),
        }
    }

    /// Bounds the scheme's variables must stay within (KERPLE's), applied by the optimizer.
    pub fn constraints(&self) -> Vec<LowerBound> {
        match self {
            Self::ScoreBias(bias) => bias.constraints(),
            Self::Scores(scores) => scores.constraints(),
            Self::Input(_) | Self::Rotation(_) => Vec::new(),
        }
    }

    /// What its learned parameters hold, in lines for `analyze`: its bias's or its scores'
    /// notes (none for a scheme on the input or a rotation).
    pub fn notes(&self) -> Result<Vec<String>> {
        match self {
            Self::ScoreBias(bias) => bias.notes(),
            Self::Scores(scores) => scores.notes(),
            Self::Input(_) | Self::Rotation(_) => Ok(Vec::new()),
        }
    }

    /// The scheme's score bias: its module, or the one its scores add through more than a sum
    /// (DAPE's MLP); `None` for a scheme without one.
    pub fn score_bias(&self) -> Option<&ScoreBias> {
        match self {
            Self::ScoreBias(bias) => Some(bias),
            Self::Scores(scores) => scores.base_bias(),
            Self::Input(_) | Self::Rotation(_) => None,
        }
    }
}

/// The Frobenius norm of a weight, in f64, for a line of notes.
pub(crate) fn weight_norm(w: &Tensor) -> Result<f64> {
    Ok(w.to_dtype(candle::DType::F64)?
        .sqr()?
        .sum_all()?
        .sqrt()?
        .to_scalar::<f64>()?)
}

/// Numbers for a line of notes, 4 decimals each.
pub(crate) fn list(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.4}"))
        .collect::<Vec<_>>()
        .join(", ")
}
