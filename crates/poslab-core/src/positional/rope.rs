//! Rotary position embedding (Su et al., RoFormer), the attention-side scheme, with partial
//! rotation and frequency scaling (see [`super::rope_scaling`]).
//!
//! For pair `i` of a head at position `t` (each token's own, see [`Positions`]) the angle is
//! `t * w_i`, `w_i = base^(-2i/d_head)`, and
//!
//! ```text
//! rope(x) = x * cos + rotate(x) * sin
//! ```
//!
//! where `cos`/`sin` hold each pair's angle in both of its coordinates, and `rotate` turns every
//! pair `(a, b)` into `(-b, a)`. The pairing convention decides which coordinates form a pair:
//! - `interleaved` (RoFormer): `(x[2i], x[2i+1])`; tables `[c0, c0, c1, c1, ...]`;
//! - `half` (GPT-NeoX / LLaMA rotate-half): `(x[i], x[i + d/2])`; tables `[c0, c1, ..., c0, c1, ...]`.
//!
//! This module computes the angles and lays out the tables; attention rotates by them
//! ([`crate::nn::Rotary`]: a fused kernel with its backward on the CPU, candle's `rope` /
//! `rope_i` CUDA kernels with poslab's backward on a GPU, a composition of differentiable ops
//! elsewhere; candle-nn's own fused `rope`/`rope_i` have no backward and q/k projections upstream
//! of them would silently never learn).

use super::{Bench, Describe, Named, Portray, ScoreMemory};
use candle::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::rope_scaling::{rope_frequencies, rotary_dim};
use super::scheme::check_base;
use super::sinusoidal::{angles_at, pair_slots};
use super::{
    FixedTable, Knobs, Placement, Portrait, PositionTable, PositionalConfig, PositionalModule,
    Positions, RopePairing, RopeScaling, Scheme, SchemeShape, DEFAULT_BASE,
};
use crate::error::{Error, Result};
use crate::nn::Rotary;

fn default_base() -> f64 {
    DEFAULT_BASE
}

fn default_fraction() -> f64 {
    1.0
}

fn is_one(v: &f64) -> bool {
    *v == 1.0
}

/// Options of `rope`: the base and pairing; `fraction`, the share of each head rotated (its
/// first `int(d_head · fraction)` coordinates, an even number, with frequencies recomputed over
/// that width: transformers' `partial_rotary_factor`; the rest pass through); and `scaling`, how
/// frequencies are stretched past the training length (see [`RopeScaling`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeOptions {
    /// The base of the frequencies (default 10,000).
    #[serde(default = "default_base")]
    pub base: f64,
    /// Which coordinates rotate together (default `interleaved`).
    #[serde(default)]
    pub pairing: RopePairing,
    /// The share of each head that rotates, in (0, 1] (default 1).
    #[serde(default = "default_fraction", skip_serializing_if = "is_one")]
    pub fraction: f64,
    /// How frequencies are rescaled for lengths past training; `None`: as trained.
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

impl Named for RopeOptions {
    fn name(&self) -> &'static str {
        "rope"
    }
}

impl Scheme for RopeOptions {
    fn with_base(&self, base: f64) -> Option<super::PositionalConfig> {
        Some(super::PositionalConfig::Rope(Self {
            base,
            ..self.clone()
        }))
    }

    fn placement(&self) -> Placement {
        Placement::Rotation
    }

    fn check(&self, shape: &SchemeShape) -> std::result::Result<(), String> {
        check_base("rope", self.base)?;
        if !(self.fraction.is_finite() && self.fraction > 0.0 && self.fraction <= 1.0) {
            return Err(format!(
                "rope: fraction = {} must be in (0, 1]: the share of each head's coordinates \
                 that is rotated",
                self.fraction
            ));
        }
        let head_dim = shape.head_dim();
        let rd = self.rotary_dim(head_dim);
        if self.fraction == 1.0 && !head_dim.is_multiple_of(2) {
            return Err(format!(
                "rope rotates pairs of coordinates, so the head width must be even, but d_model \
                 / n_heads = {head_dim} is odd: change d_model or n_heads"
            ));
        }
        if rd == 0 || !rd.is_multiple_of(2) {
            return Err(format!(
                "rope rotates pairs of coordinates, so the rotated width int({head_dim} x {}) = \
                 {rd} must be even and positive: change fraction (or d_model, n_heads)",
                self.fraction
            ));
        }
        if let Some(s) = &self.scaling {
            s.check(rd, false)?;
        }
        Ok(())
    }

    fn with_scaling(&self, scaling: Option<RopeScaling>) -> Option<PositionalConfig> {
        Some(PositionalConfig::Rope(Self {
            scaling,
            ..self.clone()
        }))
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        Ok(PositionalModule::Rotation(Rope::new(
            self,
            shape.head_dim(),
            shape.max_len,
            vb.dtype(),
            vb.device(),
        )?))
    }
}

impl Describe for RopeOptions {
    fn describe(&self, shape: &SchemeShape) -> String {
        let dh = shape.head_dim();
        let rotated = match self.fraction {
            1.0 => String::new(),
            _ => format!(", first {} of {dh} coordinates", self.rotary_dim(dh)),
        };
        let scaled = match &self.scaling {
            Some(s) => format!(", scaling {}", s.label()),
            None => String::new(),
        };
        format!(
            "attention side: q and k rotated in every layer (head {dh}, base {}, {} \
             pairing{rotated}{scaled})",
            self.base, self.pairing
        )
    }
}

impl Portray for RopeOptions {
    fn fixed_table(&self, _d_model: usize, head_dim: usize) -> Option<FixedTable> {
        Some(FixedTable::Rotation {
            dim: self.rotary_dim(head_dim),
            base: self.base,
            pairing: self.pairing,
        })
    }

    fn without_model(&self, knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Ok(Portrait::Table(FixedTable::Rotation {
            dim: rotary_dim(knobs.dim, knobs.fraction),
            base: knobs.base,
            pairing: knobs.pairing,
        }))
    }
}

impl Bench for RopeOptions {
    /// The PyTorch reference's RoPE, which rotates halves (GPT-NeoX / LLaMA), and the same on
    /// half of each head (GPT-NeoX's `rotary_pct`, Phi's `partial_rotary_factor`).
    fn benchmarked(&self) -> Option<Vec<(String, PositionalConfig)>> {
        let half = Self {
            pairing: RopePairing::Half,
            ..self.clone()
        };
        Some(vec![
            ("rope".into(), PositionalConfig::Rope(half.clone())),
            (
                "rope_partial".into(),
                PositionalConfig::Rope(Self {
                    fraction: 0.5,
                    ..half
                }),
            ),
        ])
    }
}

impl ScoreMemory for RopeOptions {}

/// The rotary tables of one model, computed once (f64 on the host, rounded once to the model's
/// dtype) and shared by every attention layer through the per-batch [`Rotary`] tables. Under
/// dynamic NTK scaling the frequencies depend on the batch, and its tables are computed per
/// batch instead.
#[derive(Debug)]
pub struct Rope {
    pairing: RopePairing,
    head_dim: usize,
    rotary_dim: usize,
    base: f64,
    /// Resolved: numbers, with `original_max_len` filled in.
    scaling: Option<RopeScaling>,
    /// Frequencies given outright (p-RoPE's, with the removed ones at 0), not from `base`.
    given: Option<Vec<f64>>,
    /// `(cos, sin)` of every position, for frequencies that do not depend on the batch.
    tables: Option<(PositionTable, PositionTable)>,
    dtype: DType,
    device: Device,
}

impl Rope {
    /// `head_dim` and the options must be valid (configs are validated at load). A scaling
    /// without `original_max_len` takes `initial_len` (a model's `max_len`, its training's
    /// longest input), which is also how many rows the tables start with.
    pub fn new(
        options: &RopeOptions,
        head_dim: usize,
        initial_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let rotary_dim = options.rotary_dim(head_dim);
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
            return Err(Error::Config(format!(
                "rope rotates an even, positive number of coordinates per head, at most \
                 {head_dim}; got {rotary_dim}"
            )));
        }
        let scaling = options
            .scaling
            .as_ref()
            .map(|s| s.resolved(1.0, initial_len.max(1)));
        if let Some(s) = &scaling {
            s.check(rotary_dim, false).map_err(Error::Config)?;
        }
        let tables = match &scaling {
            Some(RopeScaling::DynamicNtk { .. }) => None,
            _ => {
                let (inv_freq, factor) =
                    rope_frequencies(rotary_dim, options.base, scaling.as_ref(), 0);
                Some(tables(
                    inv_freq,
                    factor,
                    options.pairing,
                    initial_len,
                    dtype,
                    device,
                )?)
            }
        };
        Ok(Self {
            pairing: options.pairing,
            head_dim,
            rotary_dim,
            base: options.base,
            scaling,
            given: None,
            tables,
            dtype,
            device: device.clone(),
        })
    }

    /// A rotation of the whole head by the given frequencies, `head_dim / 2` of them (a pair
    /// whose frequency is 0 is not rotated): p-RoPE's.
    pub fn with_frequencies(
        inv_freq: Vec<f64>,
        pairing: RopePairing,
        base: f64,
        initial_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let head_dim = 2 * inv_freq.len();
        if head_dim == 0 {
            return Err(Error::Config(
                "a rotation needs at least one pair of coordinates".into(),
            ));
        }
        Ok(Self {
            pairing,
            head_dim,
            rotary_dim: head_dim,
            base,
            scaling: None,
            tables: Some(tables(
                inv_freq.clone(),
                1.0,
                pairing,
                initial_len,
                dtype,
                device,
            )?),
            given: Some(inv_freq),
            dtype,
            device: device.clone(),
        })
    }

    /// Which coordinates rotate together.
    pub fn pairing(&self) -> RopePairing {
        self.pairing
    }

    /// The width of one head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// How many leading coordinates of each head are rotated.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// The base of the frequencies.
    pub fn base(&self) -> f64 {
        self.base
    }

    /// The scaling in force, resolved.
    pub fn scaling(&self) -> Option<&RopeScaling> {
        self.scaling.as_ref()
    }

    /// The inverse frequencies and the factor on cos and sin for a batch whose largest position
    /// is `max_position` (only dynamic NTK depends on it).
    pub fn frequencies(&self, max_position: usize) -> (Vec<f64>, f64) {
        if let Some(given) = &self.given {
            return (given.clone(), 1.0);
        }
        rope_frequencies(
            self.rotary_dim,
            self.base,
            self.scaling.as_ref(),
            max_position + 1,
        )
    }

    /// The rotation of a batch whose tokens sit at `positions`: `(r, t, rotary_dim)` tables.
    pub fn rotary(&self, positions: &Positions) -> Result<Rotary> {
        let interleaved = self.pairing == RopePairing::Interleaved;
        if let Some((cos, sin)) = &self.tables {
            return Ok(Rotary::new(
                cos.at(positions)?,
                sin.at(positions)?,
                interleaved,
            )?);
        }
        // Dynamic NTK: frequencies from this batch's length, tables for its positions only.
        let (inv_freq, factor) = self.frequencies(positions.max());
        let flat: Vec<usize> = positions.as_slice().iter().map(|&p| p as usize).collect();
        let shape = (positions.rows(), positions.len(), self.rotary_dim);
        let table = |f: fn(f64) -> f64| -> Result<Tensor> {
            let values = expanded(&flat, &inv_freq, factor, self.pairing, f);
            Ok(Tensor::from_vec(values, shape, &Device::Cpu)?
                .to_dtype(self.dtype)?
                .to_device(&self.device)?)
        };
        Ok(Rotary::new(
            table(f64::cos)?,
            table(f64::sin)?,
            interleaved,
        )?)
    }

    /// Rotates `x` of shape `(b, h, t, d_head)`, position `start + j` at index `j` of axis 2.
    pub fn apply(&self, x: &Tensor, start: usize, backend: crate::nn::Backend) -> Result<Tensor> {
        let t = x.dim(D::Minus2)?;
        Ok(self
            .rotary(&Positions::range(start, t)?)?
            .apply(x, backend)?)
    }
}

/// The `(cos, sin)` tables of fixed frequencies, `2 · inv_freq.len()` wide.
fn tables(
    inv_freq: Vec<f64>,
    factor: f64,
    pairing: RopePairing,
    initial_len: usize,
    dtype: DType,
    device: &Device,
) -> Result<(PositionTable, PositionTable)> {
    let width = 2 * inv_freq.len();
    let table = |f: fn(f64) -> f64| {
        let inv_freq = inv_freq.clone();
        move |n: usize| {
            let positions: Vec<usize> = (0..n).collect();
            expanded(&positions, &inv_freq, factor, pairing, f)
        }
    };
    Ok((
        PositionTable::new(width, initial_len, dtype, device, table(f64::cos))?,
        PositionTable::new(width, initial_len, dtype, device, table(f64::sin))?,
    ))
}

/// Rows of `factor · f(p · w_i)` for `positions`, laid out over the rotated width
/// (`2 · inv_freq.len()`) by the pairing convention.
fn expanded(
    positions: &[usize],
    inv_freq: &[f64],
    factor: f64,
    pairing: RopePairing,
    f: fn(f64) -> f64,
) -> Vec<f64> {
    let interleaved = pairing == RopePairing::Interleaved;
    let width = 2 * inv_freq.len();
    angles_at(positions, width, inv_freq, |row, i, angle| {
        let (a, b) = pair_slots(interleaved, i, width);
        // `factor` is 1 but under YaRN; multiplying by 1 changes no bit.
        row[a] = f(angle) * factor;
        row[b] = row[a];
    })
}
