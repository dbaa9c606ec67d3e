//! A LayerNorm outside the encoder layers on the device path, as one candle node: the
//! pre-norm encoder's final norm, and any other `nn::LayerNorm` (the core's) a model runs there.
//!
//! As `cuda_ops`' node, its forward was one kernel but its backward a composition of candle
//! ops: 41 tensors at the default compare's shape (the statistics recomputed, three reductions,
//! the broadcasts, and candle's zero-filled sum for every gradient), most of them a kernel
//! launch on a GPU. Here it is the layer's own two kernels and one product:
//!
//! ```text
//! forward:  y = (x - mean) rstd ⊙ w + b; [mean, rstd] by row      layer_norm
//! backward: dx = rstd (g⊙w - mean(g⊙w) - x̂ mean(g⊙w⊙x̂));
//!           rows [g ⊙ x̂ | g]                                       norm_back
//!           [dw | db] = 1ᵀ rows                                    fill, gemm
//! ```
//!
//! The forward keeps each row's mean and reciprocal standard deviation (two values a row, in the
//! compute dtype), as the layer's own norms do. Values are the composition's to rounding
//! (`device_path_layer_norm_gives_the_compositions_values_and_gradients`).

use std::sync::Mutex;

use candle::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::*;

/// `(x - mean) / sqrt(var + eps) ⊙ weight + bias` over the last axis, as one node.
///
/// # Shapes
/// - `x`: `(..., d)`; `weight`, `bias`: `(d)`; all of one dtype the device path holds (f64, f32,
///   bf16 or f16)
/// - returns the shape of `x`
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let d = x.dim(candle::D::Minus1)?;
    if weight.dims() != [d] || bias.dims() != [d] || d == 0 {
        candle::bail!(
            "device path: a LayerNorm of weight {:?} and bias {:?} over {:?}",
            weight.dims(),
            bias.dims(),
            x.dims()
        )
    }
    let dtype = x.dtype();
    if weight.dtype() != dtype || bias.dtype() != dtype || !supports(dtype) {
        candle::bail!(
            "device path: a LayerNorm of {:?} weights over {dtype:?} values",
            weight.dtype()
        )
    }
    let op = NormOp {
        rows: x.elem_count() / d,
        width: d,
        eps,
        saved: Mutex::new(None),
    };
    x.contiguous()?
        .apply_op3(&weight.contiguous()?, &bias.contiguous()?, op)
}

/// The LayerNorm as a candle op on `(x, weight, bias)`.
struct NormOp {
    rows: usize,
    width: usize,
    eps: f64,
    /// Each row's `[mean, rstd]`, from the forward.
    saved: Mutex<Option<Buf>>,
}

impl NormOp {
    /// `y` and the rows' statistics.
    fn forward(&self, s: &dyn Stream, x: Mem, w: Mem, b: Mem) -> Result<(Buf, Buf)> {
        let (n, d) = (self.rows, self.width);
        let y = s.alloc(x.dtype, n * d)?;
        let stats = s.alloc(compute_dtype(x.dtype), 2 * n)?;
        let norm = Norm {
            w,
            b,
            eps: self.eps,
            out: y.mem(),
            stats: stats.mem(),
        };
        s.layer_norm(x, n, d, &norm)?;
        Ok((y, stats))
    }

    /// `[dx | dw | db]` from the output's gradient `g`.
    fn backward(&self, s: &dyn Stream, x: Mem, w: Mem, g: Mem, stats: Buf) -> Result<Buf> {
        let (n, d) = (self.rows, self.width);
        let dt = x.dtype;
        let out = s.alloc(dt, n * d + 2 * d)?;
        let rows = s.alloc(dt, n * 2 * d)?;
        s.norm_back(&NormBack {
            rows: n,
            width: d,
            x,
            stats: stats.mem(),
            w,
            g,
            add: None,
            out: out.at(0, n * d)?,
            mask: None,
            params: rows.mem(),
        })?;
        drop(stats);
        let ones = s.alloc(dt, n)?;
        s.fill(ones.mem(), 1.0)?;
        colsum(s, ones.mem(), rows.mem(), n, 2 * d, out.at(n * d, 2 * d)?)?;
        Ok(out)
    }

    /// The forward, keeping the statistics for the backward: `y`.
    fn start(&self, s: &dyn Stream, [x, w, b]: [Mem; 3]) -> Result<Buf> {
        let (y, stats) = self.forward(s, x, w, b)?;
        *self
            .saved
            .lock()
            .expect("layer norm statistics lock poisoned") = Some(stats);
        Ok(y)
    }

    fn check(&self, x: &Layout, w: &Layout) -> Result<()> {
        let (n, d) = (self.rows, self.width);
        if x.shape().elem_count() != n * d || w.shape().elem_count() != d {
            candle::bail!(
                "device path: a LayerNorm built for {n} rows of {d} given {:?} and a weight of {:?}",
                x.dims(),
                w.dims()
            )
        }
        Ok(())
    }
}

impl CustomOp3 for NormOp {
    fn name(&self) -> &'static str {
        "poslab-device-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.check(l1, l2)?;
        let (y, _) = on_twin([(s1, l1), (s2, l2), (s3, l3)], |s, m| self.start(s, m))?;
        Ok((y, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
        s3: &candle::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        self.check(l1, l2)?;
        let (y, _) = on_cuda([(s1, l1), (s2, l2), (s3, l3)], |s, m| self.start(s, m))?;
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let saved = self
            .saved
            .lock()
            .expect("layer norm statistics lock poisoned")
            .take();
        let grads = x.apply_op3_no_bwd(
            weight,
            &g,
            &NormGrad {
                norm: self,
                bias,
                saved: Mutex::new(saved),
            },
        )?;
        let (n, d) = (x.elem_count(), self.width);
        // A fixed part (ModernBERT's bias of zeros) gets no gradient, which candle would
        // otherwise add into a zero-filled tensor that nothing reads.
        let owed = |t: &Tensor, at: usize| -> Result<Option<Tensor>> {
            Ok(match t.track_op() {
                true => Some(grads.narrow(0, at, d)?),
                false => None,
            })
        };
        Ok((
            Some(grads.narrow(0, 0, n)?.reshape(x.shape())?),
            owed(weight, n)?,
            owed(bias, n + d)?,
        ))
    }
}

/// The backward of [`NormOp`] as a no-gradient op on `(x, weight, g)`: `[dx | dw | db]`.
struct NormGrad<'a> {
    norm: &'a NormOp,
    /// The forward's bias, for a backward that recomputes the statistics.
    bias: &'a Tensor,
    saved: Mutex<Option<Buf>>,
}

impl NormGrad<'_> {
    fn run(&self, s: &dyn Stream, [x, w, g]: [Mem; 3]) -> Result<Buf> {
        let saved = self
            .saved
            .lock()
            .expect("layer norm statistics lock poisoned")
            .take();
        let stats = match saved {
            Some(stats) => stats,
            // A second backward of one forward: the statistics again.
            None => {
                let bias = Held::of(self.bias);
                self.norm.forward(s, x, w, bias.mem()?)?.1
            }
        };
        self.norm.backward(s, x, w, g, stats)
    }
}

impl CustomOp3 for NormGrad<'_> {
    fn name(&self) -> &'static str {
        "poslab-device-layer-norm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.norm.check(l1, l2)?;
        let (out, len) = on_twin([(s1, l1), (s2, l2), (s3, l3)], |s, m| self.run(s, m))?;
        Ok((out, Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
        s3: &candle::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        self.norm.check(l1, l2)?;
        let (out, len) = on_cuda([(s1, l1), (s2, l2), (s3, l3)], |s, m| self.run(s, m))?;
        Ok((out, Shape::from(len)))
    }
}
