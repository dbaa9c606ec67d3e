//! What each layer of an encoder does with positions: a pattern of layer kinds repeated over
//! the stack, `[layers]` in a model config.
//!
//! ```toml
//! [positional]
//! kind = "rope"
//! [layers]
//! pattern = ["global", "local", "local"]   # layer i is pattern[i % 3]: ModernBERT's stack
//! local_window = 128                       # a local layer's query sees keys |i - j| <= 64
//! rope_base = { global = 160000, local = 10000 }
//! ```
//!
//! An entry is one of:
//! - `global`: the scheme as configured, every key visible (what every layer is without
//!   `[layers]`);
//! - `local`: the scheme, and keys further than `local_window / 2` from the query get no weight
//!   (a sliding window, as in ModernBERT and Longformer);
//! - `none`: no positions in this layer (NoPE), every key visible: `["global", "global",
//!   "global", "none"]` is RoPE with NoPE every 4th layer (Yang et al. 2025, "Rope to Nope and
//!   Back Again");
//! - `local_none`: no positions, a sliding window (the window alone is then the layer's only
//!   position signal).
//!
//! `none` entries need a scheme that acts inside attention (a rotation or a score bias): a
//! scheme added to the input reaches every layer through the residual stream and cannot be
//! switched off in one. `rope_base` needs a rotation with a base (`rope`, `prope`).

use serde::{Deserialize, Serialize};

/// The most entries a pattern may have (a pattern repeats, so 64 is plenty for any stack).
pub const MAX_PATTERN: usize = 64;

/// One entry of a layer pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// The scheme, every key visible.
    Global,
    /// The scheme, keys within `local_window / 2` of the query.
    Local,
    /// No positions, every key visible (NoPE).
    None,
    /// No positions, keys within `local_window / 2` of the query.
    LocalNone,
}

impl LayerKind {
    /// Whether the layer applies the positional scheme.
    pub fn has_positions(self) -> bool {
        matches!(self, Self::Global | Self::Local)
    }

    /// Whether the layer attends through a sliding window.
    pub fn is_local(self) -> bool {
        matches!(self, Self::Local | Self::LocalNone)
    }

    /// The name a config writes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Global => "global",
            Self::Local => "local",
            Self::None => "none",
            Self::LocalNone => "local_none",
        }
    }
}

/// The base of a rotation in global and in local layers (ModernBERT: 160,000 and 10,000).
/// Either may be left out: the scheme's own `base` then holds for that kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeBases {
    /// The base in `global` layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global: Option<f64>,
    /// The base in `local` layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<f64>,
}

/// `[layers]`: a pattern of layer kinds repeated over the stack, the window of its local
/// layers, and a rotation's base per kind. See the [module documentation](self).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerPlan {
    /// Layer `i` is `pattern[i % pattern.len()]`.
    pub pattern: Vec<LayerKind>,
    /// The width of a local layer's window: keys with `|i - j| <= local_window / 2` are seen.
    /// Even, at least 2; required when the pattern has a local entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_window: Option<usize>,
    /// The rotation's base per kind of layer (`rope`, `prope`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_base: Option<RopeBases>,
}

impl LayerPlan {
    /// A plan of `pattern` with no window and no bases (add them with the fields).
    pub fn new(pattern: Vec<LayerKind>) -> Self {
        Self {
            pattern,
            local_window: None,
            rope_base: None,
        }
    }

    /// Layer `i`'s kind; `global` for every layer of an empty pattern (which
    /// [`LayerPlan::check`] refuses).
    pub fn kind(&self, i: usize) -> LayerKind {
        match self.pattern.len() {
            0 => LayerKind::Global,
            n => self.pattern[i % n],
        }
    }

    /// Checks what does not depend on the scheme: a pattern of 1 to [`MAX_PATTERN`] entries, a
    /// window exactly when a local entry needs one, even and at least 2, and bases that are
    /// numbers above 1. Messages name the layer or the key, and the fix.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.pattern.is_empty() {
            return Err(
                "[layers] pattern = []: give at least one entry (global, local, none or \
                        local_none), or leave [layers] out for a plain stack"
                    .into(),
            );
        }
        if self.pattern.len() > MAX_PATTERN {
            return Err(format!(
                "[layers] pattern has {} entries; at most {MAX_PATTERN} (a pattern repeats over \
                 the layers, so a short one describes any stack)",
                self.pattern.len()
            ));
        }
        let first_local = self.pattern.iter().position(|k| k.is_local());
        match (first_local, self.local_window) {
            (Some(i), None) => {
                return Err(format!(
                    "[layers] layer {i} is `{}` but local_window is not set: give the window's \
                     width (ModernBERT uses 128)",
                    self.pattern[i].name()
                ))
            }
            (None, Some(w)) => {
                return Err(format!(
                    "[layers] local_window = {w} but no layer is local: add a `local` entry to \
                     the pattern or remove local_window"
                ))
            }
            (Some(_), Some(w)) if w < 2 || w % 2 == 1 => {
                return Err(format!(
                    "[layers] local_window = {w}: it must be even and at least 2 (a query sees \
                     keys up to local_window / 2 away on either side; {w} would see {})",
                    if w < 2 {
                        "only itself".to_string()
                    } else {
                        format!("{} on one side and {} on the other", w / 2, w / 2 + 1)
                    }
                ))
            }
            _ => {}
        }
        if let Some(bases) = &self.rope_base {
            for (key, base) in [("global", bases.global), ("local", bases.local)] {
                if let Some(b) = base {
                    if !b.is_finite() || b <= 1.0 {
                        return Err(format!(
                            "[layers] rope_base.{key} = {b} must be a finite number above 1"
                        ));
                    }
                }
            }
            if bases.local.is_some() && first_local.is_none() {
                return Err(
                    "[layers] rope_base.local is set but no layer is local: add a \
                            `local` entry or remove rope_base.local"
                        .into(),
                );
            }
            // A base applies to the layers of its kind that rotate: none of a kind whose every
            // layer is position-free.
            let has = |kind: LayerKind| self.pattern.contains(&kind);
            if bases.local.is_some() && !has(LayerKind::Local) {
                return Err(
                    "[layers] rope_base.local is set but every local layer is `local_none` \
                     (without positions, nothing to rotate): make one `local`, or remove \
                     rope_base.local"
                        .into(),
                );
            }
            if bases.global.is_some() && !has(LayerKind::Global) {
                return Err(
                    "[layers] rope_base.global is set but no layer is `global` (the others are \
                     local or without positions): add a `global` entry, or remove \
                     rope_base.global"
                        .into(),
                );
            }
        }
        Ok(())
    }

    /// The first layer (of `n_layers`) without positions, if there is one.
    pub fn first_without_positions(&self, n_layers: usize) -> Option<usize> {
        (0..n_layers).find(|&i| !self.kind(i).has_positions())
    }

    /// The layers that apply the scheme.
    pub fn positional_layers(&self) -> LayerSet {
        LayerSet::of(self)
    }
}

/// Which layers of a stack apply the positional scheme: every layer, or those whose pattern
/// entry has positions. A small `Copy` value, so that a scheme's shape can carry it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSet {
    /// Bit `k` set: entry `k` of the pattern has positions.
    mask: u64,
    /// The pattern's length (1 with every bit set: every layer).
    period: usize,
}

impl LayerSet {
    /// Every layer.
    pub const ALL: Self = Self { mask: 1, period: 1 };

    /// The layers of `plan` that have positions.
    pub fn of(plan: &LayerPlan) -> Self {
        let period = plan.pattern.len().clamp(1, MAX_PATTERN);
        let mask = plan
            .pattern
            .iter()
            .take(MAX_PATTERN)
            .enumerate()
            .filter(|(_, k)| k.has_positions())
            .fold(0u64, |m, (i, _)| m | (1 << i));
        Self { mask, period }
    }

    /// Whether layer `i` applies the scheme.
    pub fn contains(self, i: usize) -> bool {
        self.mask >> (i % self.period) & 1 == 1
    }

    /// How many of `n_layers` layers apply the scheme.
    pub fn count(self, n_layers: usize) -> usize {
        (0..n_layers).filter(|&i| self.contains(i)).count()
    }
}

impl Default for LayerSet {
    fn default() -> Self {
        Self::ALL
    }
}

/// What one layer does, resolved from a plan (or the plain stack).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerSpec {
    /// Whether the layer applies the positional scheme.
    pub positions: bool,
    /// The sliding window's width, for a local layer.
    pub window: Option<usize>,
    /// Whether the layer's rotation uses the local base.
    pub local_base: bool,
    /// Whether a query sees no key after it (the model's `causal`, in every layer).
    pub causal: bool,
}

impl LayerSpec {
    /// A plain layer: the scheme, every key visible.
    pub const GLOBAL: Self = Self {
        positions: true,
        window: None,
        local_base: false,
        causal: false,
    };

    /// How far a query reads: keys at most this far away (`None`: every key).
    pub fn max_offset(&self) -> Option<usize> {
        self.window.map(|w| w / 2)
    }

    /// The keys each query reads: within [`LayerSpec::max_offset`], and none after it when
    /// causal.
    pub fn keys(&self) -> crate::nn::Window {
        crate::nn::Window::new(self.max_offset(), self.causal)
    }

    /// The layer in words, for analyses: `global`, `local, keys within 4`, `no positions`, ...
    /// (`, causal` after it in a causal model).
    pub fn describe(&self) -> String {
        let plain = self.describe_keys();
        match self.causal {
            true => format!("{plain}, causal"),
            false => plain,
        }
    }

    fn describe_keys(&self) -> String {
        let positions = match self.positions {
            true => "",
            false => "no positions",
        };
        match (self.window, self.positions) {
            (None, true) => "global".into(),
            (None, false) => positions.into(),
            (Some(_), true) => format!("local, keys within {}", self.max_offset().unwrap_or(0)),
            (Some(_), false) => format!(
                "{positions}, keys within {}",
                self.max_offset().unwrap_or(0)
            ),
        }
    }

    /// Layer `i` of `plan`.
    pub fn of(plan: &LayerPlan, i: usize) -> Self {
        let kind = plan.kind(i);
        Self {
            positions: kind.has_positions(),
            window: kind.is_local().then_some(plan.local_window).flatten(),
            local_base: kind.is_local(),
            causal: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(text: &str) -> std::result::Result<LayerPlan, String> {
        let plan: LayerPlan = toml::from_str(text).map_err(|e| e.to_string())?;
        plan.check().map(|()| plan)
    }

    #[test]
    fn a_pattern_repeats_and_its_set_says_which_layers_have_positions() {
        let p = plan("pattern = [\"global\", \"local\", \"local\", \"none\"]\nlocal_window = 8")
            .unwrap();
        let kinds: Vec<&str> = (0..6).map(|i| p.kind(i).name()).collect();
        assert_eq!(
            kinds,
            ["global", "local", "local", "none", "global", "local"]
        );
        let set = p.positional_layers();
        assert_eq!(
            (0..8).map(|i| set.contains(i)).collect::<Vec<_>>(),
            [true, true, true, false, true, true, true, false]
        );
        assert_eq!(set.count(8), 6);
        assert_eq!(p.first_without_positions(8), Some(3));
        assert_eq!(LayerSpec::of(&p, 1).window, Some(8));
        assert_eq!(LayerSpec::of(&p, 3).window, None);
        assert!(LayerSet::ALL.contains(63) && LayerSet::ALL.contains(64));
    }

    #[test]
    fn bad_plans_are_refused_naming_the_layer_or_key() {
        let refused = [
            ("pattern = []", "at least one entry"),
            ("pattern = [\"global\", \"sideways\"]", "sideways"),
            ("pattern = [\"global\", \"local\"]", "layer 1 is `local`"),
            (
                "pattern = [\"local\"]\nlocal_window = 0",
                "even and at least 2",
            ),
            ("pattern = [\"local\"]\nlocal_window = 1", "only itself"),
            (
                "pattern = [\"local\"]\nlocal_window = 7",
                "3 on one side and 4",
            ),
            (
                "pattern = [\"global\"]\nlocal_window = 8",
                "no layer is local",
            ),
            (
                "pattern = [\"global\"]\nrope_base = { global = 1.0 }",
                "rope_base.global = 1",
            ),
            (
                "pattern = [\"global\"]\nrope_base = { local = 10000.0 }",
                "rope_base.local is set",
            ),
            (
                "pattern = [\"global\"]\nwindow = 8",
                "unknown field `window`",
            ),
        ];
        for (text, expected) in refused {
            let e = plan(text).unwrap_err();
            assert!(e.contains(expected), "{text}: {e}");
        }
        let long = format!("pattern = [{}]", vec!["\"global\""; 65].join(", "));
        assert!(plan(&long).unwrap_err().contains("at most 64"));
    }
}
