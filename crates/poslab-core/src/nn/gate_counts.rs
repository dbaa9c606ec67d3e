//! Attention scores with positions counted by gates: each query counts the keys between itself
//! and a key with sigmoid gates of its content scores, and adds its product with a table row
//! read at that (fractional) count, from a left table for keys at or before it and a right table
//! for keys after it.
//!
//! ```text
//! a_ij  = c q_i · k_j                              the scaled content score
//! g_ij  = σ(a_ij)                                  the gate; 0 for a padded key
//! p_ij  = Σ_{t=j..i} g_it      (j <= i)            a fractional count, from the key to the query
//!       = Σ_{t=i..j} g_it      (j > i)
//! p'    = min(p_ij, npos - 1),  f = ⌊p'⌋,  e = ⌈p'⌉,  w = p' - f
//! z_ij  = (1 - w) q_i · E[f] + w q_i · E[e]        E the left table (j <= i), the right (j > i)
//! score_ij = a_ij + z_ij                            (the term is not scaled)
//! ```
//!
//! The tables are given stacked, `[E_left; E_right]` `(2 npos, d_head)`, shared by a layer's
//! heads and differentiable. The composition here ([`GateCounts::parts`]) is the specification; the
//! fused CPU kernels compute the same scores inside the attention node, a query's row at a time
//! (`O(t²)` a head, no `(b, h, t, t)` tensor held for the counts), with a hand-written backward
//! ([`super::QkScores::counts`]).

use candle::{DType, Tensor, D};

/// Gate-counted scores' tables and the keys that count.
#[derive(Clone, Debug)]
pub struct GateCounts {
    /// `(2 npos, d_head)`: the left table's rows, then the right one's.
    tables: Tensor,
    /// `(b, t)`, 1 for a real token; `None`: all real.
    mask: Option<Tensor>,
}

/// The parts of gate-counted scores, for tests and analysis.
#[derive(Clone, Debug)]
pub struct CountParts {
    /// `(b, h, t, t)`: the gates, 0 at padded keys.
    pub gates: Tensor,
    /// `(b, h, t, t)`: the counts before the clamp.
    pub counts: Tensor,
    /// `(b, h, t, t)`: the added term `z`.
    pub term: Tensor,
    /// `(b, h, t, t)`: scaled content + term.
    pub scores: Tensor,
}

impl GateCounts {
    /// # Shapes
    /// - `left`, `right`: `(npos, d_head)`; `mask`: `(b, t)`, 1 for a real token
    pub fn new(left: &Tensor, right: &Tensor, mask: Option<&Tensor>) -> crate::Result<Self> {
        if left.dims() != right.dims() || left.rank() != 2 || left.dim(0)? < 2 {
            return Err(crate::Error::Config(format!(
                "counted scores: tables {:?} and {:?} must be the same (npos, d_head), npos >= 2",
                left.dims(),
                right.dims()
            )));
        }
        Ok(Self {
            tables: Tensor::cat(&[left, right], 0)?,
            mask: mask.cloned(),
        })
    }

    /// The stacked tables `[E_left; E_right]`, `(2 npos, d_head)`.
    pub fn tables(&self) -> &Tensor {
        &self.tables
    }

    /// The tables and the mask as the fused kernels take them.
    pub fn spec(&self) -> crate::kernels::spec::CountTables {
        crate::kernels::spec::CountTables {
            tables: self.tables.clone(),
            mask: self.mask.clone(),
        }
    }

    /// The rows of each table.
    pub fn npos(&self) -> usize {
        self.tables.dims()[0] / 2
    }

    /// The key mask `(b, t)`, if some keys are padding.
    pub fn mask(&self) -> Option<&Tensor> {
        self.mask.as_ref()
    }

    /// The scores and their parts, composed of tensor ops, in the tables' dtype.
    ///
    /// # Shapes
    /// - `q`, `k`: `(b, h, t, d_head)`
    pub fn parts(
        &self,
        q: &Tensor,
        k: &Tensor,
        scale: f64,
        backend: super::Backend,
    ) -> crate::Result<CountParts> {
        let dtype = self.tables.dtype();
        let (q, k) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?);
        let (b, h, t, _) = q.dims4()?;
        let npos = self.npos();
        let device = q.device();
        let content = (super::matmul(&q, &k.t()?.contiguous()?)? * scale)?; // (b, h, t, t)
        let per_row = q.broadcast_matmul(&self.tables.t()?.contiguous()?)?; // (b, h, t, 2 npos)
        let mut gates = super::log_sigmoid(&content, backend)?.exp()?;
        if let Some(mask) = &self.mask {
            let keys = mask.to_dtype(dtype)?.reshape((b, 1, 1, t))?;
            gates = gates.broadcast_mul(&keys)?;
        }
        // Left counts: p_ij = Σ_{t' >= j} g_it' [t' <= i]; right: Σ_{t' <= j} g_it' [t' >= i].
        let low = Tensor::tril2(t, dtype, device)?; // [j <= i]; as (t', j): [j <= t']
        let high = low.t()?.contiguous()?; // [j >= i]; as (t', j): [t' <= j]
        let left = gates.broadcast_mul(&low)?.broadcast_matmul(&low)?;
        let right = gates.broadcast_mul(&high)?.broadcast_matmul(&high)?;
        let up = (1.0 - &low)?; // [j > i]
        let counts = (left.broadcast_mul(&low)? + right.broadcast_mul(&up)?)?;
        // Interpolated rows of [E_left; E_right]: right keys read rows npos.. of the stack.
        let clamped = counts.minimum((npos - 1) as f64)?;
        let floor = clamped.detach().floor()?;
        let ceil = clamped.detach().ceil()?;
        let w = (&clamped - &floor)?;
        let side = (up.broadcast_as((b, h, t, t))? * npos as f64)?;
        let index = |rows: &Tensor| -> crate::Result<Tensor> {
            Ok((rows + &side)?.to_dtype(DType::U32)?.contiguous()?)
        };
        let z_lo = per_row.gather(&index(&floor)?, D::Minus1)?;
        let z_hi = per_row.gather(&index(&ceil)?, D::Minus1)?;
        let term = (&z_lo + (z_hi - &z_lo)?.mul(&w)?)?;
        Ok(CountParts {
            scores: (&content + &term)?,
            gates,
            counts,
            term,
        })
    }

    /// The scores, content + term, composed of tensor ops ([`GateCounts::parts`]).
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
        Ok(self.parts(q, k, scale, backend)?.scores)
    }
}
