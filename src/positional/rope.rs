//! Rotary position embedding (Su et al., RoFormer), the attention-side scheme.
//!
//! For pair `i` of a head at position `t` the angle is `t * w_i`, `w_i = base^(-2i/d_head)`, and
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
//! The rotation is [`crate::nn::rope_rotate`] (a fused kernel with its backward on the CPU, a
//! composition of differentiable ops elsewhere; candle-nn's fused `rope`/`rope_i` have no backward
//! and q/k projections upstream of them would silently never learn); inside the fused attention
//! kernel it is applied while q and k are gathered per head.

use candle::{DType, Device, Tensor, D};

use super::sinusoidal::{angle_table, pair_slots};
use super::{PositionTable, RopeOptions, RopePairing};
use crate::error::{Error, Result};

/// The rotary tables of one model, computed once (f64 on the host, rounded once to the model's
/// dtype) and shared by every attention layer through the per-batch [`RopeAngles`].
#[derive(Debug)]
pub struct Rope {
    pairing: RopePairing,
    head_dim: usize,
    base: f64,
    cos: PositionTable,
    sin: PositionTable,
}

/// The cos/sin rows of one batch's positions, ready to rotate q and k.
#[derive(Clone, Debug)]
pub struct RopeAngles {
    pairing: RopePairing,
    /// (t, d_head)
    cos: Tensor,
    /// (t, d_head)
    sin: Tensor,
}

impl Rope {
    /// `head_dim` must be even (configs are validated at load).
    pub fn new(
        options: &RopeOptions,
        head_dim: usize,
        initial_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if head_dim % 2 != 0 {
            return Err(Error::Config(format!(
                "rope needs an even head width, got {head_dim}"
            )));
        }
        let table = |f: fn(f64) -> f64| {
            let (base, pairing) = (options.base, options.pairing);
            move |n: usize| expanded_table(n, head_dim, base, pairing, f)
        };
        Ok(Self {
            pairing: options.pairing,
            head_dim,
            base: options.base,
            cos: PositionTable::new(head_dim, initial_len, dtype, device, table(f64::cos))?,
            sin: PositionTable::new(head_dim, initial_len, dtype, device, table(f64::sin))?,
        })
    }

    pub fn pairing(&self) -> RopePairing {
        self.pairing
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    pub fn base(&self) -> f64 {
        self.base
    }

    /// The angles for positions `start..start + len`.
    pub fn angles(&self, start: usize, len: usize) -> Result<RopeAngles> {
        Ok(RopeAngles {
            pairing: self.pairing,
            cos: self.cos.rows(start, len)?,
            sin: self.sin.rows(start, len)?,
        })
    }

    /// Rotates `x` of shape `(b, h, t, d_head)`, position `start + j` at index `j` of axis 2.
    pub fn apply(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let t = x.dim(D::Minus2)?;
        self.angles(start, t)?.apply(x)
    }
}

impl RopeAngles {
    /// The `(t, d_head)` cos and sin tables, and whether the pairing is interleaved.
    pub(crate) fn tables(&self) -> (&Tensor, &Tensor, bool) {
        (
            &self.cos,
            &self.sin,
            self.pairing == RopePairing::Interleaved,
        )
    }

    /// # Shapes
    /// - `x`: `(b, h, t, d_head)`, or any shape ending in `(t, d_head)`
    /// - returns the same shape
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (t, d) = self.cos.dims2()?;
        let dims = x.dims();
        if dims.len() < 2 || dims[dims.len() - 2] != t || dims[dims.len() - 1] != d {
            return Err(Error::Input(format!(
                "rope expects (..., t, d_head) = (..., {t}, {d}), got {:?}",
                x.shape()
            )));
        }
        Ok(crate::nn::rope_rotate(
            x,
            &self.cos,
            &self.sin,
            self.pairing == RopePairing::Interleaved,
        )?)
    }
}

/// Rows `0..n` of `f(t * w_i)` laid out over a head of width `d` by the pairing convention.
fn expanded_table(
    n: usize,
    d: usize,
    base: f64,
    pairing: RopePairing,
    f: fn(f64) -> f64,
) -> Vec<f64> {
    let interleaved = pairing == RopePairing::Interleaved;
    angle_table(0, n, d, base, |row, i, angle| {
        let (a, b) = pair_slots(interleaved, i, d);
        row[a] = f(angle);
        row[b] = row[a];
    })
}
