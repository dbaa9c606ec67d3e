//! RoPE's frequencies: partial rotation and the scalings that stretch a model past its training
//! length without retraining (semantics of Hugging Face transformers' `modeling_rope_utils`,
//! computed here in f64).
//!
//! Over the rotated width `d` (the first `int(d_head * fraction)` coordinates of a head), pair
//! `i` turns by `p · w_i` at position `p`:
//!
//! ```text
//! none          w_i = base^(-2i/d)
//! linear        w_i = base^(-2i/d) / factor                       (position interpolation)
//! ntk           w_i = base'^(-2i/d),  base' = base · factor^(d/(d-2))        (NTK-aware)
//! dynamic_ntk   as ntk, base' = base · (factor L / L0 - (factor - 1))^(d/(d-2)),
//!               L = max(largest position in the batch + 1, L0)
//! yarn          w_i = (1 - ramp_i) · w_i^extrapolated + ramp_i · w_i^interpolated ... (see
//!               [`rope_frequencies`]); cos and sin are multiplied by 0.1 ln(factor) + 1
//! ```
//!
//! with `L0 = original_max_len`, the length the model was trained at.

use serde::{Deserialize, Serialize};

/// A scaling factor: a number (at least 1), or `"auto"`, the longest input being read over the
/// training's longest (at least 1). `"auto"` is resolved where the inputs are known
/// (`[eval] rope_scaling`, `--rope-scaling`); a model's own config holds numbers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Factor {
    /// A number, at least 1.
    Value(f64),
    /// The longest input over the training's longest, resolved where the inputs are known.
    Auto,
}

impl Factor {
    /// The number, with `auto` standing for `auto`.
    pub fn or(self, auto: f64) -> f64 {
        match self {
            Self::Value(v) => v,
            Self::Auto => auto,
        }
    }
}

impl std::fmt::Display for Factor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Value(v) => write!(f, "{v}"),
            Self::Auto => f.write_str("auto"),
        }
    }
}

impl Serialize for Factor {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Self::Value(v) => s.serialize_f64(*v),
            Self::Auto => s.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for Factor {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Factor;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number (at least 1) or \"auto\"")
            }
            fn visit_f64<E>(self, v: f64) -> std::result::Result<Factor, E> {
                Ok(Factor::Value(v))
            }
            fn visit_i64<E>(self, v: i64) -> std::result::Result<Factor, E> {
                Ok(Factor::Value(v as f64))
            }
            fn visit_u64<E>(self, v: u64) -> std::result::Result<Factor, E> {
                Ok(Factor::Value(v as f64))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<Factor, E> {
                match v {
                    "auto" => Ok(Factor::Auto),
                    other => Err(E::invalid_value(serde::de::Unexpected::Str(other), &self)),
                }
            }
        }
        d.deserialize_any(Visitor)
    }
}

fn default_beta_fast() -> f64 {
    32.0
}

fn default_beta_slow() -> f64 {
    1.0
}

/// How RoPE's frequencies are rescaled, written as a table tagged by `kind`:
/// `scaling = { kind = "yarn", factor = 4, original_max_len = 64 }`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum RopeScaling {
    /// Position interpolation (Chen et al. 2023): every frequency divided by `factor`.
    Linear {
        /// Every frequency is divided by it.
        factor: Factor,
    },
    /// NTK-aware scaling: the base raised to `base · factor^(d/(d-2))`.
    Ntk {
        /// The length ratio the base is raised for.
        factor: Factor,
    },
    /// NTK-aware scaling whose base grows with the length read (the batch's largest position
    /// plus one), from `original_max_len` on.
    DynamicNtk {
        /// The length ratio.
        factor: Factor,
        /// Default: the training's longest input (a model's `max_len`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        original_max_len: Option<usize>,
    },
    /// YaRN (Peng et al. 2023): a per-frequency ramp between interpolation and extrapolation,
    /// and cos and sin multiplied by `0.1 ln(factor) + 1`.
    Yarn {
        /// The length ratio.
        factor: Factor,
        /// Default: the training's longest input (a model's `max_len`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        original_max_len: Option<usize>,
        /// Frequencies making more than this many turns over the original length keep their values
        /// (default 32).
        #[serde(default = "default_beta_fast")]
        beta_fast: f64,
        /// Frequencies making fewer than this many turns are fully interpolated (default 1).
        #[serde(default = "default_beta_slow")]
        beta_slow: f64,
    },
}

impl RopeScaling {
    /// Every kind's name.
    pub const KINDS: [&'static str; 4] = ["linear", "ntk", "dynamic_ntk", "yarn"];

    /// The kind's name, as configs write it.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Linear { .. } => "linear",
            Self::Ntk { .. } => "ntk",
            Self::DynamicNtk { .. } => "dynamic_ntk",
            Self::Yarn { .. } => "yarn",
        }
    }

    /// The factor.
    pub fn factor(&self) -> Factor {
        match self {
            Self::Linear { factor }
            | Self::Ntk { factor }
            | Self::DynamicNtk { factor, .. }
            | Self::Yarn { factor, .. } => *factor,
        }
    }

    fn factor_mut(&mut self) -> &mut Factor {
        match self {
            Self::Linear { factor }
            | Self::Ntk { factor }
            | Self::DynamicNtk { factor, .. }
            | Self::Yarn { factor, .. } => factor,
        }
    }

    /// The original length, for the kinds that have one.
    pub fn original_max_len(&self) -> Option<usize> {
        match self {
            Self::DynamicNtk {
                original_max_len, ..
            }
            | Self::Yarn {
                original_max_len, ..
            } => *original_max_len,
            _ => None,
        }
    }

    /// As reports name it: `yarn` for an automatic factor, `yarn x4` for a fixed one.
    pub fn label(&self) -> String {
        match self.factor() {
            Factor::Auto => self.kind().to_string(),
            Factor::Value(v) => format!("{} x{v}", self.kind()),
        }
    }

    /// With numbers in place of `auto` and of a missing `original_max_len`.
    pub fn resolved(&self, auto_factor: f64, original_max_len: usize) -> Self {
        let mut out = self.clone();
        if out.factor() == Factor::Auto {
            *out.factor_mut() = Factor::Value(auto_factor.max(1.0));
        }
        match &mut out {
            Self::DynamicNtk {
                original_max_len: o,
                ..
            }
            | Self::Yarn {
                original_max_len: o,
                ..
            } => {
                o.get_or_insert(original_max_len);
            }
            _ => {}
        }
        out
    }

    /// Parses `KIND[:FACTOR]` (the `--rope-scaling` flag): `yarn`, `ntk:4`, `linear:auto`. A
    /// missing factor is `auto`.
    pub fn parse_spec(spec: &str) -> std::result::Result<Self, String> {
        let (kind, factor) = match spec.split_once(':') {
            Some((k, f)) => (k, f),
            None => (spec, "auto"),
        };
        let factor = match factor {
            "auto" => Factor::Auto,
            f => Factor::Value(f.parse::<f64>().map_err(|_| {
                format!("--rope-scaling {spec}: factor `{f}` is not a number or `auto`")
            })?),
        };
        let scaling = match kind {
            "linear" => Self::Linear { factor },
            "ntk" => Self::Ntk { factor },
            "dynamic_ntk" => Self::DynamicNtk {
                factor,
                original_max_len: None,
            },
            "yarn" => Self::Yarn {
                factor,
                original_max_len: None,
                beta_fast: default_beta_fast(),
                beta_slow: default_beta_slow(),
            },
            other => {
                return Err(format!(
                    "--rope-scaling {spec}: unknown scaling `{other}`: use one of {} (as \
                     KIND or KIND:FACTOR)",
                    Self::KINDS.join(", ")
                ))
            }
        };
        scaling.check(usize::MAX, true)?;
        Ok(scaling)
    }

    /// Checks the options for a rotated width `rotary_dim`; `auto` is allowed only where it can
    /// be resolved (`allow_auto`). The message names the option and the fix.
    pub fn check(&self, rotary_dim: usize, allow_auto: bool) -> std::result::Result<(), String> {
        match self.factor() {
            Factor::Auto if !allow_auto => {
                return Err(format!(
                    "rope scaling {}: factor = \"auto\" is resolved from the inputs being read, \
                     so it belongs to [eval] rope_scaling and --rope-scaling; a model trained \
                     with scaling needs a number (at least 1)",
                    self.kind()
                ))
            }
            Factor::Value(v) if !v.is_finite() || v < 1.0 => {
                return Err(format!(
                    "rope scaling {}: factor = {v} must be a finite number of at least 1 (how \
                     many times the training length to reach)",
                    self.kind()
                ))
            }
            _ => {}
        }
        if self.original_max_len() == Some(0) {
            return Err(format!(
                "rope scaling {}: original_max_len = 0; it is the length the model was trained \
                 at: leave it out to use the training's longest input",
                self.kind()
            ));
        }
        if let Self::Yarn {
            beta_fast,
            beta_slow,
            ..
        } = self
        {
            if !(beta_slow.is_finite()
                && beta_fast.is_finite()
                && *beta_slow > 0.0
                && beta_fast > beta_slow)
            {
                return Err(format!(
                    "rope scaling yarn: beta_fast = {beta_fast} and beta_slow = {beta_slow} must \
                     be finite with beta_fast > beta_slow > 0 (32 and 1 are YaRN's)"
                ));
            }
        }
        if matches!(self, Self::Ntk { .. } | Self::DynamicNtk { .. }) && rotary_dim < 4 {
            return Err(format!(
                "rope scaling {}: the rotated width is {rotary_dim}, but NTK scaling raises the \
                 base to the power d/(d-2), which needs a width of at least 4",
                self.kind()
            ));
        }
        Ok(())
    }
}

/// The rotated width of a head: `int(head_dim · fraction)`, as transformers computes it.
pub fn rotary_dim(head_dim: usize, fraction: f64) -> usize {
    (head_dim as f64 * fraction) as usize
}

/// RoPE's inverse frequencies `w_i` (`rotary_dim / 2` of them) and the factor on cos and sin,
/// for a rotated width `rotary_dim`, `base`, a resolved `scaling` (numbers, not `auto`), and
/// (dynamic NTK) `seq_len`, the largest position read plus one.
///
/// YaRN, with `L0 = original_max_len`: the correction dimension of `r` rotations is
/// `cd(r) = d ln(L0 / (2π r)) / (2 ln base)`; `low = max(⌊cd(beta_fast)⌋, 0)`,
/// `high = min(⌈cd(beta_slow)⌉, d - 1)` (`high + 0.001` if they meet); pair `i` takes
/// `ramp_i = clamp((i - low) / (high - low), 0, 1)` of the interpolated frequency
/// `base^(-2i/d) / factor` and the rest of the extrapolated one `base^(-2i/d)`.
pub fn rope_frequencies(
    rotary_dim: usize,
    base: f64,
    scaling: Option<&RopeScaling>,
    seq_len: usize,
) -> (Vec<f64>, f64) {
    let d = rotary_dim as f64;
    let plain = |b: f64| -> Vec<f64> {
        (0..rotary_dim / 2)
            .map(|i| b.powf(-((2 * i) as f64) / d))
            .collect()
    };
    let Some(scaling) = scaling else {
        return (plain(base), 1.0);
    };
    let factor = scaling.factor().or(1.0);
    let original = scaling.original_max_len().unwrap_or(seq_len).max(1) as f64;
    match scaling {
        RopeScaling::Linear { .. } => (plain(base).into_iter().map(|w| w / factor).collect(), 1.0),
        RopeScaling::Ntk { .. } => (plain(base * factor.powf(d / (d - 2.0))), 1.0),
        RopeScaling::DynamicNtk { .. } => {
            let len = (seq_len as f64).max(original);
            let grown = base * (factor * len / original - (factor - 1.0)).powf(d / (d - 2.0));
            (plain(grown), 1.0)
        }
        RopeScaling::Yarn {
            beta_fast,
            beta_slow,
            ..
        } => {
            let correction =
                |r: f64| d * (original / (r * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
            let low = correction(*beta_fast).floor().max(0.0);
            let mut high = correction(*beta_slow).ceil().min(d - 1.0);
            if low == high {
                high += 0.001;
            }
            let inv = (0..rotary_dim / 2)
                .map(|i| {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    let pos_freq = base.powf((2 * i) as f64 / d);
                    (1.0 / (factor * pos_freq)) * (1.0 - extrapolation)
                        + (1.0 / pos_freq) * extrapolation
                })
                .collect();
            let attention = if factor > 1.0 {
                0.1 * factor.ln() + 1.0
            } else {
                1.0
            };
            (inv, attention)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_name_the_fix() {
        assert_eq!(
            RopeScaling::parse_spec("ntk:4").unwrap(),
            RopeScaling::Ntk {
                factor: Factor::Value(4.0)
            }
        );
        assert_eq!(
            RopeScaling::parse_spec("yarn").unwrap().factor(),
            Factor::Auto
        );
        assert!(RopeScaling::parse_spec("rotate:2")
            .unwrap_err()
            .contains("linear, ntk, dynamic_ntk, yarn"));
        assert!(RopeScaling::parse_spec("linear:0.5")
            .unwrap_err()
            .contains("at least 1"));
        assert!(RopeScaling::parse_spec("linear:x")
            .unwrap_err()
            .contains("not a number"));
    }

    #[test]
    fn no_scaling_and_factor_one_are_plain_rope() {
        let (plain, af) = rope_frequencies(16, 10_000.0, None, 10);
        assert_eq!(af, 1.0);
        assert_eq!(plain, crate::positional::inverse_frequencies(16, 10_000.0));
        let linear1 = RopeScaling::Linear {
            factor: Factor::Value(1.0),
        };
        assert_eq!(rope_frequencies(16, 10_000.0, Some(&linear1), 10).0, plain);
    }
}
