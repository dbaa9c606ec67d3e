//! Rotary position embedding (Su et al., RoFormer), the attention-side scheme.
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
//! ([`crate::nn::Rotary`]: a fused kernel with its backward on the CPU, a composition of
//! differentiable ops elsewhere; candle-nn's fused `rope`/`rope_i` have no backward and q/k
//! projections upstream of them would silently never learn).

use candle::{DType, Device, Tensor, D};

use super::sinusoidal::{angle_table, pair_slots};
use super::{PositionTable, Positions, RopeOptions, RopePairing};
use crate::error::{Error, Result};
use crate::nn::Rotary;

/// The rotary tables of one model, computed once (f64 on the host, rounded once to the model's
/// dtype) and shared by every attention layer through the per-batch [`Rotary`] tables.
#[derive(Debug)]
pub struct Rope {
    pairing: RopePairing,
    head_dim: usize,
    base: f64,
    cos: PositionTable,
    sin: PositionTable,
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

    /// The rotation of a batch whose tokens sit at `positions`: `(r, t, d_head)` tables.
    pub fn rotary(&self, positions: &Positions) -> Result<Rotary> {
        Ok(Rotary::new(
            self.cos.at(positions)?,
            self.sin.at(positions)?,
            self.pairing == RopePairing::Interleaved,
        )?)
    }

    /// Rotates `x` of shape `(b, h, t, d_head)`, position `start + j` at index `j` of axis 2.
    pub fn apply(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let t = x.dim(D::Minus2)?;
        Ok(self.rotary(&Positions::range(start, t)?)?.apply(x)?)
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
