//! KERPLE, logarithmic variant (Chi et al. 2022): every layer adds
//!
//! ```text
//! bias[h, i, j] = -r1_h · ln(1 + r2_h · |p_i - p_j|)
//! ```
//!
//! to its scores, with `r1, r2 > 0` learned per head and per layer
//! (`layers.{i}.attn.kerple.{r1,r2}`).
//!
//! Parametrisation: the variables are `r1` and `r2` themselves, kept at or above
//! [`KERPLE_MIN`] by projection: after every optimizer step, values below it are set to it
//! (what KERPLE's own code does by clamping the parameters before each forward). They start
//! uniform in `[KERPLE_MIN, 2]` (`r1`) and `[KERPLE_MIN, 1]` (`r2`), KERPLE's `U(0, 2)` and
//! `U(0, 1)` above its clamp, drawn from the seeded generator; they are not weight-decayed.

use candle::Tensor;
use candle_nn::{Init, VarBuilder};

use crate::error::Result;

/// The least value of `r1` and `r2` (KERPLE's clamp).
pub const KERPLE_MIN: f64 = 1e-2;

/// The projection bound of a variable named `name`, if it is a KERPLE parameter.
pub(super) fn lower_bound(name: &str) -> Option<f64> {
    (name.ends_with(".kerple.r1") || name.ends_with(".kerple.r2")).then_some(KERPLE_MIN)
}

/// One layer's KERPLE parameters.
#[derive(Clone, Debug)]
pub struct Kerple {
    /// `(h)`
    r1: Tensor,
    /// `(h)`
    r2: Tensor,
}

impl Kerple {
    /// `r1`, `r2` under `vb` (a layer's `attn.kerple`).
    pub fn new(heads: usize, vb: VarBuilder) -> Result<Self> {
        let uniform = |up: f64| Init::Uniform { lo: KERPLE_MIN, up };
        Ok(Self {
            r1: vb.get_with_hints(heads, "r1", uniform(2.0))?,
            r2: vb.get_with_hints(heads, "r2", uniform(1.0))?,
        })
    }

    /// From given `r1` and `r2`, each `(h)` (for analysis and tests).
    pub fn from_tensors(r1: Tensor, r2: Tensor) -> Self {
        Self { r1, r2 }
    }

    /// `(r1, r2)`, each `(h)`.
    pub fn params(&self) -> (&Tensor, &Tensor) {
        (&self.r1, &self.r2)
    }

    /// # Shapes
    /// - `distances`: `(r, 1, t, t)` of `|p_i - p_j|` in the parameters' dtype
    /// - returns `(r, h, t, t)`; differentiable in `r1` and `r2`
    pub fn bias(&self, distances: &Tensor) -> Result<Tensor> {
        let h = self.r1.dim(0)?;
        let r1 = self.r1.reshape((1, h, 1, 1))?;
        let r2 = self.r2.reshape((1, h, 1, 1))?;
        let log = (distances.broadcast_mul(&r2)? + 1.0)?.log()?;
        Ok(log.broadcast_mul(&r1)?.neg()?)
    }
}
