//! Rotation tables for rotary attention, as attention takes them: plain cos and sin tensors.
//!
//! `nn` knows no positional scheme. Whoever builds these (RoPE in `positional`) decides the
//! angles; attention only rotates q and k by them:
//!
//! ```text
//! rotate(x) = x * cos + pair_swap(x) * sin      on the first `width` coordinates of a head
//! ```
//!
//! where `pair_swap` turns every pair `(a, b)` into `(-b, a)`, and the coordinates past `width`
//! pass through unchanged (partial rotation). The pairing convention says which coordinates
//! form a pair, inside the rotated width `w`:
//! - `interleaved` (RoFormer): `(x[2i], x[2i+1])`; tables laid out `[c0, c0, c1, c1, ...]`;
//! - `half` (GPT-NeoX / LLaMA "rotate-half"): `(x[i], x[i + w/2])`; tables
//!   `[c0, c1, ..., c0, c1, ...]`.
//!
//! A factor on the rotation (YaRN's attention factor) is part of the tables: `cos` and `sin`
//! may be scaled together.

use std::sync::OnceLock;

use candle::{Result, Tensor};

use super::Backend;
#[cfg(feature = "kernels")]
use super::Path;

/// The cos and sin of one batch's rotation angles.
#[derive(Clone, Debug)]
pub struct Rotary {
    /// `(r, t, width)`: `r = 1` when every sequence has the same positions, else `r = b`.
    cos: Tensor,
    /// `(r, t, width)`
    sin: Tensor,
    interleaved: bool,
    /// `(r, t, width/2)` cos and sin, one entry per pair, for the CUDA kernel (`cuda_ops::rope`):
    /// made at the first layer that needs them, shared by the rest.
    #[cfg_attr(not(feature = "kernels"), allow(dead_code))]
    half: OnceLock<(Tensor, Tensor)>,
}

impl Rotary {
    /// # Shapes
    /// - `cos`, `sin`: `(r, t, width)`, `width` even; `r` is 1 (shared by the batch) or the
    ///   batch size
    pub fn new(cos: Tensor, sin: Tensor, interleaved: bool) -> Result<Self> {
        let (_, _, w) = cos.dims3().map_err(|_| {
            candle::Error::Msg(format!(
                "rotary tables must be (rows, t, width), got {:?}",
                cos.shape()
            ))
        })?;
        if sin.dims() != cos.dims() || w % 2 != 0 || w == 0 {
            candle::bail!(
                "rotary tables: cos {:?} and sin {:?} must have one shape (rows, t, width) with \
                 an even, positive width",
                cos.shape(),
                sin.shape()
            );
        }
        Ok(Self {
            cos,
            sin,
            interleaved,
            half: OnceLock::new(),
        })
    }

    /// `(r, t, width)` cos and sin, and whether the pairing is interleaved.
    pub fn tables(&self) -> (&Tensor, &Tensor, bool) {
        (&self.cos, &self.sin, self.interleaved)
    }

    /// The tables as the fused kernels take them.
    pub fn spec(&self) -> crate::kernels::spec::RopeTables {
        crate::kernels::spec::RopeTables {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            interleaved: self.interleaved,
        }
    }

    /// How many leading coordinates of a head are rotated.
    pub fn width(&self) -> usize {
        self.cos.dims()[2]
    }

    /// Rotates q or k.
    ///
    /// # Shapes
    /// - `x`: `(b, h, t, d_head)` with `d_head >= width`; the tables' rows `r` must be 1 or `b`
    /// - returns the shape of `x`
    pub fn apply(&self, x: &Tensor, backend: Backend) -> Result<Tensor> {
        check(x, &self.cos)?;
        match backend.path(x) {
            #[cfg(feature = "kernels")]
            Path::Device => self.apply_on_gpu(x),
            _ => super::rope_rotate(x, &self.cos, &self.sin, self.interleaved, backend),
        }
    }

    #[cfg(feature = "kernels")]
    /// [`Rotary::apply`] with one CUDA kernel for the rotated width (half precision rotated in
    /// the tables' f32, as everywhere).
    fn apply_on_gpu(&self, x: &Tensor) -> Result<Tensor> {
        if super::is_half(x.dtype()) && !super::is_half(self.cos.dtype()) {
            return self
                .apply_on_gpu(&x.to_dtype(self.cos.dtype())?)?
                .to_dtype(x.dtype());
        }
        let half = match self.half.get() {
            Some(half) => half,
            None => {
                let half = (
                    crate::kernels::cuda_ops::half_table(&self.cos, self.interleaved)?,
                    crate::kernels::cuda_ops::half_table(&self.sin, self.interleaved)?,
                );
                self.half.get_or_init(|| half)
            }
        };
        let (d, w) = (x.dim(candle::D::Minus1)?, self.width());
        if w == d {
            return crate::kernels::cuda_ops::rope(x, &half.0, &half.1, self.interleaved);
        }
        let rotated = crate::kernels::cuda_ops::rope(
            &x.narrow(candle::D::Minus1, 0, w)?,
            &half.0,
            &half.1,
            self.interleaved,
        )?;
        Tensor::cat(
            &[&rotated, &x.narrow(candle::D::Minus1, w, d - w)?],
            candle::D::Minus1,
        )
    }
}

/// Checks `x` `(b, h, t, d_head)` against tables `(r, t, w)`.
pub(crate) fn check(x: &Tensor, cos: &Tensor) -> Result<()> {
    let (r, t, w) = cos.dims3()?;
    match x.dims() {
        &[b, _, xt, d] if xt == t && d >= w && (r == 1 || r == b) => Ok(()),
        dims => candle::bail!(
            "rotary: x must be (b, h, t, d_head) with t = {t}, d_head >= {w} and b = {r} or \
             tables shared by the batch; got {dims:?} against tables {:?}",
            cos.shape()
        ),
    }
}
