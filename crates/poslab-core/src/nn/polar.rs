//! Attention scores of queries and keys in polar form: each of a head's `d_head` coordinates is
//! one complex number whose magnitude the content sets and whose phase the position sets.
//!
//! ```text
//! μ(z)      = softplus(z) = ln(1 + e^z)
//! q'_i      = [μ(q_i) ⊙ cos φ_i        | μ(q_i) ⊙ sin φ_i]              (2 d_head)
//! k'_j      = [μ(k_j) ⊙ cos(φ_j + δ_h) | μ(k_j) ⊙ sin(φ_j + δ_h)]
//! score_ij  = c q'_i · k'_j = c Σ_m μ(q_im) μ(k_jm) cos(φ_im - φ_jm - δ_hm)
//! ```
//!
//! `φ` `(r, t, d_head)` are phase tables the caller makes (`r` 1, shared by the batch, or `b`),
//! given as their cosines and sines; `δ` `(h, d_head)` are per-head offsets of the keys' phases,
//! differentiable. The composition here is the specification; the fused CPU kernels compute the
//! same scores inside the attention node ([`super::QkScores::polar`]).

use candle::{Tensor, D};

/// Polar scores' tables: the phases' cosines and sines and the keys' phase offsets.
#[derive(Clone, Debug)]
pub struct Polar {
    /// `(r, 1, t, d_head)`
    cos: Tensor,
    sin: Tensor,
    /// `(h, d_head)`
    offsets: Tensor,
}

impl Polar {
    /// # Shapes
    /// - `cos`, `sin`: `(r, 1, t, d_head)`, `r` 1 or the batch; `offsets`: `(h, d_head)`
    pub fn new(cos: Tensor, sin: Tensor, offsets: Tensor) -> Self {
        Self { cos, sin, offsets }
    }

    /// The phases' cosines and sines, `(r, 1, t, d_head)`.
    pub fn tables(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// The tables and offsets as the fused kernels take them.
    pub fn spec(&self) -> crate::kernels::spec::PolarTables {
        crate::kernels::spec::PolarTables {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            offsets: self.offsets.clone(),
        }
    }

    /// The keys' phase offsets `δ`, `(h, d_head)`.
    pub fn offsets(&self) -> &Tensor {
        &self.offsets
    }

    /// The polar form `[μ cos φ | μ sin φ]` of q or k, given `cos` and `sin` of the phase.
    ///
    /// # Shapes
    /// - `x`: `(b, h, t, d_head)`; `cos`, `sin`: broadcast to it; returns `(b, h, t, 2 d_head)`
    pub fn form(
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        backend: super::Backend,
    ) -> crate::Result<Tensor> {
        // softplus(x) = -log σ(-x), exact for any x.
        let mu = super::log_sigmoid(&x.neg()?, backend)?.neg()?;
        Ok(Tensor::cat(
            &[&mu.broadcast_mul(cos)?, &mu.broadcast_mul(sin)?],
            D::Minus1,
        )?)
    }

    /// The scores `c q' k'ᵀ`, composed of tensor ops, in the offsets' dtype.
    ///
    /// # Shapes
    /// - `q`, `k`: `(b, h, t, d_head)`; returns `(b, h, t, t)`
    pub fn scores(
        &self,
        q: &Tensor,
        k: &Tensor,
        scale: f64,
        backend: super::Backend,
    ) -> crate::Result<Tensor> {
        let dtype = self.offsets.dtype();
        let (q, k) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?);
        let (b, h, t, hd) = q.dims4()?;
        // The (r, 1, t, d_head) tables, r 1 or b, spread over the batch first: δ's gradient is
        // then summed over the heads' broadcast alone, in the order the results were made with.
        let rows = |x: &Tensor| x.broadcast_as((b, 1, t, hd));
        let (cos, sin) = (&rows(&self.cos)?, &rows(&self.sin)?);
        // Keys' phase φ + δ: cos(φ + δ) = cos φ cos δ - sin φ sin δ (the tables stay exact).
        let delta = self.offsets.reshape((1, h, 1, hd))?;
        let (cd, sd) = (delta.cos()?, delta.sin()?);
        let cos_k = (cos.broadcast_mul(&cd)? - sin.broadcast_mul(&sd)?)?;
        let sin_k = (sin.broadcast_mul(&cd)? + cos.broadcast_mul(&sd)?)?;
        let qp = Self::form(&q, cos, sin, backend)?; // (b, h, t, 2 d_head)
        let kp = Self::form(&k, &cos_k, &sin_k, backend)?;
        Ok((super::matmul(&qp, &kp.t()?.contiguous()?)? * scale)?)
    }
}
