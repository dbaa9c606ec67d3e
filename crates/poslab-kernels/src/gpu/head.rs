//! A task head and its loss on the device path, as one candle node: what a training step does
//! after the encoder, from its output to the loss.
//!
//! As compositions of candle ops, pooling, the head's linear map and the cross-entropy made 32
//! tensors forward and 77 backward (each op's gradient, and candle's zero-filled sum for every
//! gradient a node receives; counted by `poslab bench --launches`), most of them a kernel
//! launch on a GPU: at the default compare's shape, over a third of a step's launches. Here
//! they are 10 device operations ([`head_loss`]):
//!
//! ```text
//! forward:  f = pool(h)                    pool_mean (mean), a strided view (first), h (tokens)
//!           L = f Wᵀ                       gemm
//!           L += b; lse; nll = lse - L[y]  xent
//!           loss = scale Σ w nll           weighted_sum
//! backward: dL = g scale w (softmax(L) - onehot(y))     xent_back, in place of L
//!           db = 1ᵀ dL; dW = dLᵀ f; df = dL W           fill, 3 gemm
//!           dh = unpool(df)                pool_mean back (mean), fill + the product into the
//!                                          first tokens' rows (first), df itself (tokens)
//! ```
//!
//! `scale` is `1 / rows` (the mean) or `1 / total` (the count of scored labels, counted where
//! the batch was built), `w` the 0/1 weights of token labels. The forward keeps the logits, each
//! row's log-sum-exp and the pooled rows for the backward, as the composition keeps its log
//! probabilities. Values are those of the composition to rounding
//! (`device_path_heads_give_the_compositions_loss_and_gradients`).

use std::sync::Mutex;

use candle::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::*;

/// What the head reads of the encoder's output `(b, t, d)`.
#[derive(Clone, Debug)]
pub enum Readout {
    /// The mean over each sequence's real tokens, by its attention mask `(b, t)` (u32).
    Mean(Tensor),
    /// The first token of each sequence.
    First,
    /// Every token: a label per token.
    Tokens,
}

/// The head's cross-entropy: the mean of the rows' negative log-likelihoods, or with weights
/// `(b, t)` (f32, 0 or 1) their weighted sum over `total`.
///
/// # Shapes
/// - `hidden`: `(b, t, d)`, f32 or f64; `weight`: `(c, d)`; `bias`: `(c)`, of `hidden`'s dtype
/// - `targets`: `(b)` (a pooled readout) or `(b, t)` ([`Readout::Tokens`]), u32
/// - returns the loss, a scalar of `hidden`'s dtype
pub fn head_loss(
    hidden: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    readout: Readout,
    targets: &Tensor,
    weights: Option<(&Tensor, f64)>,
) -> Result<Tensor> {
    let (b, t, d) = hidden.dims3()?;
    let (c, dw) = weight.dims2()?;
    let rows = match readout {
        Readout::Tokens => b * t,
        _ => b,
    };
    let dtype = hidden.dtype();
    if weight.dtype() != dtype || bias.dtype() != dtype {
        candle::bail!(
            "device path: a head of {:?} over {dtype:?} features",
            weight.dtype()
        )
    }
    if dw != d || bias.dims() != [c] || c == 0 {
        candle::bail!(
            "device path: a head of {:?} and bias {:?} over {d} features",
            weight.dims(),
            bias.dims()
        )
    }
    if targets.elem_count() != rows || targets.dtype() != candle::DType::U32 {
        candle::bail!(
            "device path: {} {:?} targets for {rows} rows (u32 needed)",
            targets.elem_count(),
            targets.dtype()
        )
    }
    if let Readout::Mean(mask) = &readout {
        if mask.dims() != [b, t] || mask.dtype() != candle::DType::U32 {
            candle::bail!(
                "device path: a {:?} mask for ({b}, {t}) tokens",
                mask.dims()
            )
        }
    }
    let scale = match weights {
        None => 1.0 / rows as f64,
        Some((w, total)) => {
            if w.elem_count() != rows || w.dtype() != candle::DType::F32 {
                candle::bail!(
                    "device path: {} weights for {rows} rows (f32)",
                    w.elem_count()
                )
            }
            if total <= 0.0 {
                candle::bail!("device path: a loss over no scored label")
            }
            1.0 / total
        }
    };
    let op = HeadLoss {
        readout,
        targets: targets.flatten_all()?.contiguous()?,
        weights: weights
            .map(|(w, _)| w.flatten_all()?.contiguous())
            .transpose()?,
        scale,
        dims: Dims { b, t, d, c, rows },
        saved: Mutex::new(None),
    };
    hidden
        .contiguous()?
        .apply_op3(&weight.contiguous()?, &bias.contiguous()?, op)
}

#[derive(Clone, Copy, Debug)]
struct Dims {
    b: usize,
    t: usize,
    d: usize,
    c: usize,
    rows: usize,
}

/// What the forward keeps: the logits, each row's log-sum-exp, and the pooled rows (mean).
struct Saved {
    logits: Buf,
    lse: Buf,
    pooled: Option<Buf>,
}

/// The head and its loss as a candle op on `(hidden, weight, bias)`.
struct HeadLoss {
    readout: Readout,
    /// `(rows)` u32
    targets: Tensor,
    /// `(rows)` f32
    weights: Option<Tensor>,
    scale: f64,
    dims: Dims,
    saved: Mutex<Option<Saved>>,
}

/// Read guards on the op's fixed inputs: targets, weights and mask.
struct Fixed<'a> {
    targets: Held<'a>,
    weights: Option<Held<'a>>,
    mask: Option<Held<'a>>,
}

impl HeadLoss {
    fn held(&self) -> Fixed<'_> {
        Fixed {
            targets: Held::of(&self.targets),
            weights: self.weights.as_ref().map(Held::of),
            mask: match &self.readout {
                Readout::Mean(m) => Some(Held::of(m)),
                _ => None,
            },
        }
    }

    /// The rows the head reads (`(rows, d)`): the pooled rows, or the first tokens' rows (a
    /// stride of `t d`), or every token's.
    fn features(&self, h: Mem, pooled: Option<&Buf>) -> Result<Mat> {
        let Dims { t, d, .. } = self.dims;
        Ok(match (&self.readout, pooled) {
            (Readout::Mean(_), Some(p)) => Mat::rows(p.mem(), d),
            (Readout::Mean(_), None) => candle::bail!("device path: a mean with no pooled rows"),
            (Readout::First, _) => Mat::rows(h, t * d),
            (Readout::Tokens, _) => Mat::rows(h, d),
        })
    }

    fn xent(&self, fixed: &Fixed<'_>, saved: &Saved) -> Result<Xent> {
        Ok(Xent {
            logits: saved.logits.mem(),
            rows: self.dims.rows,
            classes: self.dims.c,
            targets: fixed.targets.mem()?,
            weights: fixed.weights.as_ref().map(Held::mem).transpose()?,
            lse: saved.lse.mem(),
        })
    }

    /// The loss (one value) and what the backward needs.
    fn forward(&self, s: &dyn Stream, h: Mem, w: Mem, bias: Mem) -> Result<(Buf, Saved)> {
        let Dims { b, t, d, c, rows } = self.dims;
        let dt = h.dtype;
        let fixed = self.held();
        let pooled = match &fixed.mask {
            Some(mask) => {
                let p = s.alloc(dt, b * d)?;
                s.pool_mean(h, mask.mem()?, (b, t, d), p.mem(), false)?;
                Some(p)
            }
            None => None,
        };
        let logits = s.alloc(dt, rows * c)?;
        s.gemm(&Gemm::one(
            rows,
            c,
            d,
            self.features(h, pooled.as_ref())?,
            Mat::t(w, d),
            Mat::rows(logits.mem(), c),
        ))?;
        let saved = Saved {
            logits,
            lse: s.alloc(compute_dtype(dt), rows)?,
            pooled,
        };
        let x = self.xent(&fixed, &saved)?;
        let nll = s.alloc(dt, rows)?;
        s.xent(&x, bias, nll.mem())?;
        let loss = s.alloc(dt, 1)?;
        s.weighted_sum(nll.mem(), x.weights, self.scale, loss.mem())?;
        Ok((loss, saved))
    }

    /// `[dh | dW | db]` from the loss's gradient `g` (one value).
    fn backward(&self, s: &dyn Stream, h: Mem, w: Mem, g: Mem, saved: Saved) -> Result<Buf> {
        let Dims { b, t, d, c, rows } = self.dims;
        let dt = h.dtype;
        let fixed = self.held();
        let x = self.xent(&fixed, &saved)?;
        s.xent_back(&x, g, self.scale)?;
        let dl = saved.logits.mem();
        let n = b * t * d;
        let out = s.alloc(dt, n + c * d + c)?;
        let (dh, dw, db) = (out.at(0, n)?, out.at(n, c * d)?, out.at(n + c * d, c)?);
        let ones = s.alloc(dt, rows)?;
        s.fill(ones.mem(), 1.0)?;
        colsum(s, ones.mem(), dl, rows, c, db)?;
        let features = self.features(h, saved.pooled.as_ref())?;
        s.gemm(&Gemm::one(
            c,
            d,
            rows,
            Mat::t(dl, c),
            features,
            Mat::rows(dw, d),
        ))?;
        let d_features = |into: Mat| Gemm::one(rows, d, c, Mat::rows(dl, c), Mat::rows(w, d), into);
        match (&self.readout, &fixed.mask) {
            (Readout::Mean(_), Some(mask)) => {
                let dp = s.alloc(dt, b * d)?;
                s.gemm(&d_features(Mat::rows(dp.mem(), d)))?;
                s.pool_mean(dp.mem(), mask.mem()?, (b, t, d), dh, true)?;
            }
            (Readout::Mean(_), None) => candle::bail!("device path: a mean with no mask"),
            (Readout::First, _) => {
                s.fill(dh, 0.0)?;
                s.gemm(&d_features(Mat::rows(dh, t * d)))?;
            }
            (Readout::Tokens, _) => s.gemm(&d_features(Mat::rows(dh, d)))?,
        }
        Ok(out)
    }

    /// The forward, keeping what the backward needs: the loss.
    fn start(&self, s: &dyn Stream, [h, w, bias]: [Mem; 3]) -> Result<Buf> {
        let (loss, saved) = self.forward(s, h, w, bias)?;
        *self.saved.lock().expect("head activations lock poisoned") = Some(saved);
        Ok(loss)
    }

    fn check_dims(&self, l1: &Layout) -> Result<()> {
        let Dims { b, t, d, .. } = self.dims;
        if l1.dims() != [b, t, d] {
            candle::bail!(
                "device path: a head built for ({b}, {t}, {d}) given {:?}",
                l1.dims()
            )
        }
        Ok(())
    }
}

impl CustomOp3 for HeadLoss {
    fn name(&self) -> &'static str {
        "poslab-head-loss"
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
        self.check_dims(l1)?;
        let (loss, _) = on_twin([(s1, l1), (s2, l2), (s3, l3)], |s, m| self.start(s, m))?;
        Ok((loss, Shape::from(())))
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
        self.check_dims(l1)?;
        let (loss, _) = on_cuda([(s1, l1), (s2, l2), (s3, l3)], |s, m| self.start(s, m))?;
        Ok((loss, Shape::from(())))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _loss: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let saved = self
            .saved
            .lock()
            .expect("head activations lock poisoned")
            .take();
        let grads = hidden.apply_op3_no_bwd(
            weight,
            &g,
            &HeadGrad {
                head: self,
                bias,
                saved: Mutex::new(saved),
            },
        )?;
        let Dims { c, d, .. } = self.dims;
        let n = hidden.elem_count();
        Ok((
            Some(grads.narrow(0, 0, n)?.reshape(hidden.shape())?),
            Some(grads.narrow(0, n, c * d)?.reshape((c, d))?),
            Some(grads.narrow(0, n + c * d, c)?),
        ))
    }
}

/// The backward of [`HeadLoss`] as a no-gradient op on `(hidden, weight, g)`: `[dh | dW | db]`.
struct HeadGrad<'a> {
    head: &'a HeadLoss,
    /// The forward's bias, for a backward that recomputes the forward.
    bias: &'a Tensor,
    saved: Mutex<Option<Saved>>,
}

impl HeadGrad<'_> {
    fn run(&self, s: &dyn Stream, [h, w, g]: [Mem; 3]) -> Result<Buf> {
        let saved = self
            .saved
            .lock()
            .expect("head activations lock poisoned")
            .take();
        let saved = match saved {
            Some(saved) => saved,
            // A second backward of one forward: the forward again.
            None => {
                let bias = Held::of(self.bias);
                self.head.forward(s, h, w, bias.mem()?)?.1
            }
        };
        self.head.backward(s, h, w, g, saved)
    }
}

impl CustomOp3 for HeadGrad<'_> {
    fn name(&self) -> &'static str {
        "poslab-head-loss-grad"
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
        self.head.check_dims(l1)?;
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
        self.head.check_dims(l1)?;
        let (out, len) = on_cuda([(s1, l1), (s2, l2), (s3, l3)], |s, m| self.run(s, m))?;
        Ok((out, Shape::from(len)))
    }
}
