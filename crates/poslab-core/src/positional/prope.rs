//! p-RoPE (Barbero et al., ICLR 2025, "Round and Round We Go! What makes Rotary Positional
//! Encodings useful?"): RoPE with its lowest frequencies removed.
//!
//! The frequencies are RoPE's over the whole head, `w_i = base^(-2i/d_head)` for
//! `i < d_head/2`; only the `K = floor(keep · d_head/2)` highest (`i < K`) rotate, and the other
//! pairs are left as they are (angle 0):
//!
//! ```text
//! keep = 1      RoPE, bit for bit
//! keep = 0.75   the paper's 0.75-RoPE: the slowest quarter of the pairs carry no position
//! K = 0         refused: that is `none`
//! ```
//!
//! This is not `rope`'s `fraction` (transformers' `partial_rotary_factor`), which rotates the
//! first `fraction · d_head` coordinates with frequencies recomputed over that narrower width,
//! so its slowest frequency stays near `1/base`. p-RoPE keeps the fast frequencies of the whole
//! head and drops the slow ones, which the paper finds act as a content channel that drifts
//! over long contexts. The pairing acts over the whole head: under `half`, the rotated
//! coordinates are `x[i]` and `x[i + d_head/2]` for `i < K`.
//!
//! Options: `base`, `pairing` and `keep`. p-RoPE does not combine with `fraction` (both decide
//! which coordinates rotate, in two different ways) nor with the RoPE scalings (which stretch
//! the slow frequencies p-RoPE removes); both are refused with the reason.

use super::{Bench, Describe, Named, Portray, ScoreMemory};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::rope_scaling::rope_frequencies;
use super::scheme::check_base;
use super::{
    Knobs, Measure, Placement, Portrait, PositionalConfig, PositionalModule, Rope, RopePairing,
    Scheme, SchemeShape, DEFAULT_BASE,
};
use crate::error::Result;

fn default_base() -> f64 {
    DEFAULT_BASE
}

fn default_keep() -> f64 {
    0.75
}

/// An option read only to be refused with a reason (any value).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Refused;

impl<'de> Deserialize<'de> for Refused {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(d).map(|_| Refused)
    }
}

/// Options of `prope`: the base and pairing of RoPE, and `keep`, the share of the head's
/// frequency pairs that rotate (the fastest ones; default 0.75, the paper's 0.75-RoPE).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PropeOptions {
    /// The base of the frequencies (default 10,000).
    #[serde(default = "default_base")]
    pub base: f64,
    /// Which coordinates rotate together (default `interleaved`).
    #[serde(default)]
    pub pairing: RopePairing,
    /// The share of the frequency pairs that rotate, in (0, 1] (default 0.75): the fastest ones.
    #[serde(default = "default_keep")]
    pub keep: f64,
    /// Refused: `rope`'s partial rotation is another scheme.
    #[serde(default, skip_serializing)]
    pub fraction: Option<Refused>,
    /// Refused: the scalings stretch the slow frequencies p-RoPE removes.
    #[serde(default, skip_serializing)]
    pub scaling: Option<Refused>,
}

impl Default for PropeOptions {
    fn default() -> Self {
        Self {
            base: DEFAULT_BASE,
            pairing: RopePairing::default(),
            keep: default_keep(),
            fraction: None,
            scaling: None,
        }
    }
}

impl PropeOptions {
    /// p-RoPE with `keep` and RoPE's defaults otherwise.
    pub fn keep(keep: f64) -> Self {
        Self {
            keep,
            ..Self::default()
        }
    }

    /// How many frequency pairs rotate in a head of `head_dim`: `floor(keep · head_dim / 2)`.
    pub fn kept_pairs(&self, head_dim: usize) -> usize {
        // The reference's `floor(keep * pairs + 1e-9)`: a keep written in decimal (0.3 of 10
        // pairs) keeps the pairs it says.
        let pairs = (head_dim / 2) as f64;
        let k = (self.keep * pairs + 1e-9).floor();
        if k.is_finite() && k > 0.0 {
            (k as usize).min(head_dim / 2)
        } else {
            0
        }
    }

    /// The frequencies of a head of `head_dim`: RoPE's, `base^(-2i/head_dim)`, with every pair
    /// from [`PropeOptions::kept_pairs`] on set to 0 (not rotated).
    pub fn frequencies(&self, head_dim: usize) -> Vec<f64> {
        let (mut inv_freq, _) = rope_frequencies(head_dim, self.base, None, 0);
        let kept = self.kept_pairs(head_dim);
        for w in inv_freq.iter_mut().skip(kept) {
            *w = 0.0;
        }
        inv_freq
    }
}

impl Named for PropeOptions {
    fn name(&self) -> &'static str {
        "prope"
    }
}

impl Scheme for PropeOptions {
    fn with_base(&self, base: f64) -> Option<super::PositionalConfig> {
        Some(super::PositionalConfig::Prope(Self {
            base,
            ..self.clone()
        }))
    }

    fn placement(&self) -> Placement {
        Placement::Rotation
    }

    fn check(&self, shape: &SchemeShape) -> std::result::Result<(), String> {
        if self.fraction.is_some() {
            return Err(
                "prope: `fraction` is rope's partial rotation (transformers' \
                        partial_rotary_factor), which recomputes the frequencies over a narrower \
                        width; p-RoPE's `keep` already chooses which frequencies rotate: drop \
                        fraction, or use kind = \"rope\" for a partial rotation"
                    .into(),
            );
        }
        if self.scaling.is_some() {
            return Err(
                "prope: the RoPE scalings stretch the slowest frequencies, the ones \
                        p-RoPE removes: drop scaling, or use kind = \"rope\" with scaling"
                    .into(),
            );
        }
        check_base("prope", self.base)?;
        if !(self.keep.is_finite() && self.keep > 0.0 && self.keep <= 1.0) {
            return Err(format!(
                "prope: keep = {} must be in (0, 1]: the share of each head's frequency pairs \
                 that rotate (1 is RoPE; 0.75 is the paper's)",
                self.keep
            ));
        }
        let head_dim = shape.head_dim();
        if !head_dim.is_multiple_of(2) {
            return Err(format!(
                "prope rotates pairs of coordinates, so the head width must be even, but d_model \
                 / n_heads = {head_dim} is odd: change d_model or n_heads"
            ));
        }
        if self.kept_pairs(head_dim) == 0 {
            return Err(format!(
                "prope: keep = {} of a head's {} frequency pairs keeps none (floor({} x {}) = \
                 0), which is `none`: raise keep to at least {}, or use kind = \"none\"",
                self.keep,
                head_dim / 2,
                self.keep,
                head_dim / 2,
                1.0 / (head_dim / 2).max(1) as f64
            ));
        }
        Ok(())
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        Ok(PositionalModule::Rotation(Rope::with_frequencies(
            self.frequencies(shape.head_dim()),
            self.pairing,
            self.base,
            shape.max_len,
            vb.dtype(),
            vb.device(),
        )?))
    }
}

impl Describe for PropeOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        let dh = shape.head_dim();
        format!(
            "attention side: q and k rotated in every layer by the {} fastest of RoPE's {} \
             frequency pairs (keep {}; head {dh}, base {}, {} pairing); the slowest {} pairs \
             are not rotated",
            self.kept_pairs(dh),
            dh / 2,
            self.keep,
            self.base,
            self.pairing,
            dh / 2 - self.kept_pairs(dh)
        )
    }

    fn label(&self) -> String {
        format!("prope (keep {})", self.keep)
    }
}

impl Portray for PropeOptions {
    fn without_model(&self, knobs: &Knobs) -> std::result::Result<Portrait, String> {
        let options = Self {
            base: knobs.base,
            keep: knobs.keep,
            ..Default::default()
        };
        Ok(Portrait::Spectrum {
            base: options.base,
            keep: options.keep,
            config: PositionalConfig::Prope(options),
        })
    }

    fn measure(&self) -> Option<Measure> {
        Some(Measure::Spectrum {
            base: self.base,
            keep: self.keep,
        })
    }
}

impl Bench for PropeOptions {}

impl ScoreMemory for PropeOptions {}
