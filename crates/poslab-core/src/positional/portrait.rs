//! What `analyze` draws of a scheme, as each scheme's file states it through the [`Scheme`]
//! hooks [`Portray::fixed_table`], [`Portray::without_model`], [`Portray::offset_index`] and
//! [`Portray::measure`]. The analysis
//! (the lab's `analysis`) matches on these kinds of picture, never on a scheme.
//!
//! [`Scheme`]: super::Scheme
//! [`Portray::fixed_table`]: super::Portray::fixed_table
//! [`Portray::without_model`]: super::Portray::without_model
//! [`Portray::offset_index`]: super::Portray::offset_index
//! [`Portray::measure`]: super::Portray::measure

use super::{PositionalConfig, RopePairing, TableLayout};

/// A table of positions a scheme computes (rather than learns), row `p` for position `p`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FixedTable {
    /// Sines and cosines of `dim` columns on the ladder of `base` (the sinusoidal tables).
    Sinusoidal {
        /// Its columns.
        dim: usize,
        /// The base of its frequencies.
        base: f64,
        /// Where the sines and cosines lie.
        layout: TableLayout,
    },
    /// The angles' sines and cosines of a rotation of `dim` coordinates of a head (RoPE's).
    Rotation {
        /// The coordinates rotated.
        dim: usize,
        /// The base of its frequencies.
        base: f64,
        /// Which coordinates turn together.
        pairing: RopePairing,
    },
}

/// The settings `analyze SCHEME` gives a scheme drawn by name, without a model (the command's
/// flags); each scheme takes those it has.
#[derive(Clone, Debug)]
pub struct Knobs {
    /// Width of a table, or of a head.
    pub dim: usize,
    /// The base of a sinusoid's or rotation's frequencies.
    pub base: f64,
    /// A sinusoidal table's layout.
    pub layout: TableLayout,
    /// A rotation's pairing.
    pub pairing: RopePairing,
    /// The share of a head rotated.
    pub fraction: f64,
    /// The share of a head's frequency pairs that rotate (the fastest).
    pub keep: f64,
    /// Buckets of a bucketed offset.
    pub buckets: usize,
    /// The distance from which offsets share the last bucket.
    pub max_distance: usize,
    /// A length from which distances are measured relative to the span (the command's default:
    /// the length drawn).
    pub threshold: f64,
    /// Heads of a bias.
    pub heads: usize,
}

impl Knobs {
    /// The sinusoidal table the settings describe: `dim` columns, their base and layout (both
    /// sinusoidal schemes draw it by name).
    pub fn sinusoidal_table(&self) -> FixedTable {
        FixedTable::Sinusoidal {
            dim: self.dim,
            base: self.base,
            layout: self.layout,
        }
    }
}

/// A function of the offset `j - i` that indexes a scheme's learned values (T5's bucket).
#[derive(Clone, Debug)]
pub struct OffsetIndex {
    /// The drawing's title.
    pub title: String,
    /// What a value is (the head's label in the drawing).
    pub label: String,
    /// How to read it.
    pub notes: Vec<String>,
    /// The index of query `i` and key `j`, row-major `(positions, positions)`.
    pub values: Vec<f64>,
}

/// What `analyze SCHEME` draws of a scheme by name, without a model.
#[derive(Clone, Debug)]
pub enum Portrait {
    /// Its table of positions, with the distances, offsets, probes and wavelengths of a table.
    Table(FixedTable),
    /// Its bias on the scores by offset, per head: fixed, or at initialisation (seed 0).
    Bias(PositionalConfig),
    /// The offset index its learned values are read by ([`Portray::offset_index`]; the values
    /// exist only in a trained model), of the scheme with the settings' options.
    ///
    /// [`Portray::offset_index`]: super::Portray::offset_index
    Index(PositionalConfig),
    /// Its learned bias at initialisation (seed 0) at a length and at 4 times as many: how it
    /// interpolates.
    Interpolation {
        /// The scheme with the settings' options.
        config: PositionalConfig,
        /// The drawing's title.
        title: String,
        /// How its inputs are formed, for the drawing's notes.
        note: String,
    },
    /// Its rotation's spectrum beside RoPE's and `fraction`'s at the same share.
    Spectrum {
        /// The scheme with the settings' options.
        config: PositionalConfig,
        /// The base of its frequencies.
        base: f64,
        /// The share of the frequency pairs kept.
        keep: f64,
    },
}

impl Portrait {
    /// The scheme drawn, where the portrait was built from its options (all but a table, whose
    /// settings the command checks itself).
    pub fn config(&self) -> Option<&PositionalConfig> {
        match self {
            Self::Table(_) => None,
            Self::Bias(config)
            | Self::Index(config)
            | Self::Interpolation { config, .. }
            | Self::Spectrum { config, .. } => Some(config),
        }
    }
}

/// What `analyze --run` draws of a trained model's scheme beyond what every model gets (its
/// table, its score biases, the split of its logits).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Measure {
    /// Its learned bias at the training length and at 4x (FIRE).
    Interpolation,
    /// Its rotation's spectrum beside RoPE's and `fraction`'s (p-RoPE).
    Spectrum {
        /// The base of its frequencies.
        base: f64,
        /// The share of the frequency pairs kept.
        keep: f64,
    },
    /// Its forget gates on the evaluation text (FoX).
    Gates,
    /// Its score against the offset for a fixed pair of magnitudes (PoPE).
    PolarScores,
    /// Its mean count against the offset, on the evaluation text (CoPE).
    Counts,
    /// How far its transport turns a key with distance, on the evaluation text (PaTH).
    Turning,
    /// Its mean attention weight against the offset, on the evaluation text (stick-breaking).
    Weights,
}

impl Measure {
    /// Whether it reads the evaluation text.
    pub fn reads_text(self) -> bool {
        matches!(
            self,
            Self::Gates | Self::Counts | Self::Turning | Self::Weights
        )
    }
}
