//! One CUDA kernel per forward op, with poslab's own backward passes.
//!
//! candle-nn 0.11's fused `softmax_last_dim` and `layer_norm` each run one CUDA kernel but have
//! no backward, nor do its `rope` / `rope_i`. The ops here launch the same kernels from
//! candle's kernel library (`candle_kernels::REDUCE`: `softmax_<dtype>`, `layernorm_<dtype>`,
//! `rope_<dtype>`, `rope_i_<dtype>`; GELU through candle's unary `gelu_erf`), and give each a
//! backward pass composed of differentiable tensor ops (RoPE's: the opposite rotation). A
//! composition of primitive ops costs a kernel launch and a pass over memory per op: the
//! softmax over `(b, h, t, t)` scores is 5 kernels forward and about 10 backward, LayerNorm
//! 10 forward. These cut the forward passes to one kernel each.
//!
//! On the CPU the same ops compute in plain loops, so the tests hold them to the reference
//! compositions, forward and backward, without a GPU; the layers use them on CUDA only (the
//! CPU has its own fused kernels, [`super::cpu`]). Softmax, LayerNorm and RoPE take f32 or
//! f64 (half-precision activations are cast up first, as everywhere: statistics and rotations
//! stay f32).
//!
//! **Backward passes compute from detached inputs.** candle's backward detaches the gradient
//! of every node it passes through, but not a variable's: a gradient an op hands straight to
//! a variable (LayerNorm's weight and bias) keeps the graph of whatever it was computed from.
//! Built from the tracked input, it held the whole step's forward graph, and an optimizer
//! moment made from it held it across steps: on a GPU this leaked memory every step until it
//! ran out (the book's performance page, "Measurements behind the code's choices"). Detached inputs give gradients with no graph.
//!
//! Selected by the core's `nn::Kernels`: on CUDA, `layer` (the default) and `ops` use these;
//! `reference` keeps the compositions.

use std::ops::Range;

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor, D};

thread_local! {
    /// Forward passes of these ops on this thread (a counter for tests: the core's
    /// `nn::cuda_op_calls`).
    static CALLS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn count() {
    CALLS.with(|c| c.set(c.get() + 1));
}

/// Forward passes of these ops run on this thread so far.
pub fn calls() -> usize {
    CALLS.with(std::cell::Cell::get)
}

/// Rows of the last axis: `(rows, width)` of a contiguous layout, and the span of its storage
/// that it covers.
fn rows(layout: &Layout, what: &str) -> Result<(usize, usize, Range<usize>)> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle::bail!(
            "{what}: input of shape {:?} is not contiguous",
            layout.dims()
        )
    };
    let width = layout.dims().last().copied().unwrap_or(1);
    let n = layout.shape().elem_count();
    Ok((n / width.max(1), width, start..end))
}

/// The span of its storage a contiguous layout covers.
fn span(layout: &Layout, what: &str) -> Result<Range<usize>> {
    rows(layout, what).map(|(_, _, span)| span)
}

/// The error of a three-input op whose `inputs` (`"layer_norm: input, weight and bias"`) are
/// not of one dtype, f32 or f64.
fn mixed_dtypes(inputs: &str, [a, b, c]: [DType; 3]) -> candle::Error {
    candle::Error::Msg(format!(
        "{inputs} must share a dtype, f32 or f64; got {a:?}, {b:?}, {c:?}"
    ))
}

/// The one dtype, f32 or f64, of a three-input op's `inputs`.
#[cfg(feature = "cuda")]
fn one_dtype(inputs: &str, dtypes: [DType; 3]) -> Result<DType> {
    match dtypes {
        [d @ (DType::F32 | DType::F64), b, c] if b == d && c == d => Ok(d),
        _ => Err(mixed_dtypes(inputs, dtypes)),
    }
}

// ---------------------------------------------------------------------------------------------
// Softmax over the last axis.

struct SoftmaxLastDim;

impl CustomOp1 for SoftmaxLastDim {
    fn name(&self) -> &'static str {
        "poslab-softmax-last-dim"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T>(src: &[T], layout: &Layout) -> Result<CpuStorage>
        where
            T: candle::WithDType + num_traits::Float + std::ops::AddAssign + std::ops::DivAssign,
        {
            let (_, width, span) = rows(layout, "softmax")?;
            let mut dst = src[span].to_vec();
            for row in dst.chunks_mut(width) {
                let max = row
                    .iter()
                    .copied()
                    .fold(T::neg_infinity(), num_traits::Float::max);
                let mut sum = T::zero();
                for v in row.iter_mut() {
                    *v = (*v - max).exp();
                    sum += *v;
                }
                for v in row.iter_mut() {
                    *v /= sum;
                }
            }
            Ok(candle::WithDType::to_cpu_storage_owned(dst))
        }
        let out = match storage {
            CpuStorage::F32(s) => run(s, layout)?,
            CpuStorage::F64(s) => run(s, layout)?,
            other => candle::bail!("softmax: f32 or f64 input, got {:?}", other.dtype()),
        };
        Ok((out, layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        let (n_rows, width, span) = rows(layout, "softmax")?;
        let device = storage.device();
        let out = match storage.dtype() {
            DType::F32 => {
                let src = storage.as_cuda_slice::<f32>()?.slice(span);
                cuda::softmax(device, src, n_rows, width)?
            }
            DType::F64 => {
                let src = storage.as_cuda_slice::<f64>()?.slice(span);
                cuda::softmax(device, src, n_rows, width)?
            }
            other => candle::bail!("softmax: f32 or f64 input, got {other:?}"),
        };
        Ok((out, layout.shape().clone()))
    }

    /// `dx = y * (dy - sum(dy * y))` along the last axis.
    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let res = &res.detach(); // see the module's note on backward passes
        let dot = (grad_res * res)?.sum_keepdim(D::Minus1)?;
        Ok(Some((grad_res.broadcast_sub(&dot)? * res)?))
    }
}

/// Softmax over the last axis in one kernel, differentiable. f32 or f64.
pub fn softmax_last_dim(xs: &Tensor) -> Result<Tensor> {
    count();
    xs.contiguous()?.apply_op1(SoftmaxLastDim)
}

// ---------------------------------------------------------------------------------------------
// GELU (exact, erf).

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "poslab-gelu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((
            storage.unary_impl::<candle::op::GeluErf>(layout)?,
            layout.shape().clone(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        Ok((
            storage.unary_impl::<candle::op::GeluErf>(layout)?,
            layout.shape().clone(),
        ))
    }

    /// `d/dx x Phi(x) = Phi(x) + x phi(x)`, with the exact constants (candle's own `gelu_erf`
    /// backward rounds 1/sqrt(2 pi) to 0.398942).
    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        use std::f64::consts::{FRAC_1_SQRT_2, PI};
        let arg = &arg.detach(); // see the module's note on backward passes
        let cdf = (arg * FRAC_1_SQRT_2)?.erf()?.affine(0.5, 0.5)?;
        let pdf = arg
            .sqr()?
            .affine(-0.5, 0.0)?
            .exp()?
            .affine(1.0 / (2.0 * PI).sqrt(), 0.0)?;
        Ok(Some((grad_res * (cdf + (arg * pdf)?)?)?))
    }
}

/// `x Phi(x)` (exact GELU) in one kernel, differentiable. Any float dtype.
pub fn gelu(xs: &Tensor) -> Result<Tensor> {
    count();
    xs.apply_op1(Gelu)
}

// ---------------------------------------------------------------------------------------------
// LayerNorm over the last axis.

struct LayerNormOp {
    eps: f64,
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "poslab-layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: candle::WithDType + num_traits::Float>(
            x: &[T],
            lx: &Layout,
            w: &[T],
            lw: &Layout,
            b: &[T],
            lb: &Layout,
            eps: f64,
        ) -> Result<CpuStorage> {
            let (_, width, span_x) = rows(lx, "layer_norm")?;
            let w = &w[span(lw, "layer_norm weight")?];
            let b = &b[span(lb, "layer_norm bias")?];
            let n = T::from(width).unwrap_or_else(T::one);
            let eps = T::from(eps).unwrap_or_else(T::zero);
            let mut dst = x[span_x].to_vec();
            for row in dst.chunks_mut(width) {
                let mean = row.iter().fold(T::zero(), |a, &v| a + v) / n;
                let var = row
                    .iter()
                    .fold(T::zero(), |a, &v| a + (v - mean) * (v - mean))
                    / n;
                let inv_std = (var + eps).sqrt().recip();
                for (i, v) in row.iter_mut().enumerate() {
                    *v = (*v - mean) * inv_std * w[i] + b[i];
                }
            }
            Ok(candle::WithDType::to_cpu_storage_owned(dst))
        }
        let out = match (x, w, b) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(b)) => {
                run(x, lx, w, lw, b, lb, self.eps)?
            }
            (CpuStorage::F64(x), CpuStorage::F64(w), CpuStorage::F64(b)) => {
                run(x, lx, w, lw, b, lb, self.eps)?
            }
            _ => {
                return Err(mixed_dtypes(
                    "layer_norm: input, weight and bias",
                    [x.dtype(), w.dtype(), b.dtype()],
                ))
            }
        };
        Ok((out, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle::CudaStorage,
        lx: &Layout,
        w: &candle::CudaStorage,
        lw: &Layout,
        b: &candle::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        let (n_rows, width, span_x) = rows(lx, "layer_norm")?;
        let args = [
            (x, span_x),
            (w, span(lw, "layer_norm weight")?),
            (b, span(lb, "layer_norm bias")?),
        ];
        let eps = self.eps as f32;
        let out = match one_dtype(
            "layer_norm: input, weight and bias",
            [x.dtype(), w.dtype(), b.dtype()],
        )? {
            DType::F32 => {
                cuda::layer_norm(x.device(), cuda::views::<f32>(&args)?, n_rows, width, eps)?
            }
            _ => cuda::layer_norm(x.device(), cuda::views::<f64>(&args)?, n_rows, width, eps)?,
        };
        Ok((out, lx.shape().clone()))
    }

    /// With `xhat = (x - mean) * inv_std` recomputed from `x`: `dbias = sum(dy)`,
    /// `dweight = sum(dy * xhat)` over the rows, and
    /// `dx = inv_std * (g - mean(g) - xhat * mean(g * xhat))` with `g = dy * weight`.
    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The weight and bias are variables, whose gradients are not detached by candle's
        // backward: built from tracked tensors they would hold this step's graph for as long as
        // anything holds them (see the module's note on backward passes).
        let (x, weight) = (&x.detach(), &weight.detach());
        let width = x.dim(D::Minus1)?;
        let centered = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
        let inv_std = (centered.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?
            .sqrt()?
            .recip()?;
        let xhat = centered.broadcast_mul(&inv_std)?;
        let flat = |t: &Tensor| t.reshape(((), width));
        let d_bias = flat(grad_res)?.sum(0)?;
        let d_weight = flat(&(grad_res * &xhat)?)?.sum(0)?;
        let g = grad_res.broadcast_mul(weight)?;
        let d_x = ((g.broadcast_sub(&g.mean_keepdim(D::Minus1)?))?
            - xhat.broadcast_mul(&(&g * &xhat)?.mean_keepdim(D::Minus1)?)?)?
        .broadcast_mul(&inv_std)?;
        Ok((Some(d_x), Some(d_weight), Some(d_bias)))
    }
}

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last axis in one kernel,
/// differentiable in all three. f32 or f64, one dtype for all three.
///
/// # Shapes
/// - `xs`: `(..., d)`; `weight`, `bias`: `(d,)`; returns the shape of `xs`
pub fn layer_norm(xs: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let d = xs.dim(D::Minus1)?;
    if weight.dims() != [d] || bias.dims() != [d] {
        candle::bail!(
            "layer_norm: input {:?} needs weight and bias of shape [{d}], got {:?} and {:?}",
            xs.dims(),
            weight.dims(),
            bias.dims()
        );
    }
    count();
    xs.contiguous()?.apply_op3(
        &weight.contiguous()?,
        &bias.contiguous()?,
        LayerNormOp { eps },
    )
}

// ---------------------------------------------------------------------------------------------
// RoPE's rotation of whole heads, from half-width tables.

/// Rotates every `(b, h, t, d)` head by `(r, t, d/2)` tables (`r` 1 or `b`), the pairing
/// `interleaved` (`(x[2i], x[2i+1])`) or half (`(x[i], x[i + d/2])`): each pair `(a, c)` of angle
/// index `i` becomes `(a cos_i - c sin_i, a sin_i + c cos_i)`.
struct RopeOp {
    interleaved: bool,
}

impl RopeOp {
    /// `(b, h, t, d)` and `r` from the layouts, checked.
    fn dims(&self, x: &Layout, cos: &Layout, sin: &Layout) -> Result<[usize; 5]> {
        let (b, h, t, d) = x.shape().dims4()?;
        let (r, tt, half) = cos.shape().dims3()?;
        if sin.dims() != cos.dims() || tt != t || 2 * half != d || !(r == 1 || r == b) {
            candle::bail!(
                "rope: x {:?} needs cos and sin of shape (1 or {b}, {t}, {}), got {:?} and {:?}",
                x.dims(),
                d / 2,
                cos.dims(),
                sin.dims()
            );
        }
        Ok([b, h, t, d, r])
    }
}

impl CustomOp3 for RopeOp {
    fn name(&self) -> &'static str {
        "poslab-rope"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        cos: &CpuStorage,
        lc: &Layout,
        sin: &CpuStorage,
        ls: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let [b, h, t, d, r] = self.dims(lx, lc, ls)?;
        let interleaved = self.interleaved;
        let run = |x: &[f64], cos: &[f64], sin: &[f64]| -> Vec<f64> {
            let half = d / 2;
            let mut out = x.to_vec();
            for bi in 0..b {
                for hi in 0..h {
                    for ti in 0..t {
                        let base = ((bi * h + hi) * t + ti) * d;
                        let table = ((if r == 1 { 0 } else { bi }) * t + ti) * half;
                        for i in 0..half {
                            let (i1, i2) = if interleaved {
                                (base + 2 * i, base + 2 * i + 1)
                            } else {
                                (base + i, base + i + half)
                            };
                            let (c, s) = (cos[table + i], sin[table + i]);
                            out[i1] = x[i1] * c - x[i2] * s;
                            out[i2] = x[i1] * s + x[i2] * c;
                        }
                    }
                }
            }
            out
        };
        let (rx, rc, rs) = (
            span(lx, "rope")?,
            span(lc, "rope cos")?,
            span(ls, "rope sin")?,
        );
        let out = match (x, cos, sin) {
            (CpuStorage::F64(x), CpuStorage::F64(c), CpuStorage::F64(s)) => {
                CpuStorage::F64(run(&x[rx], &c[rc], &s[rs]))
            }
            (CpuStorage::F32(x), CpuStorage::F32(c), CpuStorage::F32(s)) => {
                let up = |v: &[f32]| v.iter().map(|&v| f64::from(v)).collect::<Vec<_>>();
                let out = run(&up(&x[rx]), &up(&c[rc]), &up(&s[rs]));
                CpuStorage::F32(out.into_iter().map(|v| v as f32).collect())
            }
            _ => {
                return Err(mixed_dtypes(
                    "rope: x, cos and sin",
                    [x.dtype(), cos.dtype(), sin.dtype()],
                ))
            }
        };
        Ok((out, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle::CudaStorage,
        lx: &Layout,
        cos: &candle::CudaStorage,
        lc: &Layout,
        sin: &candle::CudaStorage,
        ls: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        let [b, h, t, d, r] = self.dims(lx, lc, ls)?;
        let args = [
            (x, span(lx, "rope")?),
            (cos, span(lc, "rope cos")?),
            (sin, span(ls, "rope sin")?),
        ];
        let shape = cuda::RopeShape {
            bh: b * h,
            td: t * d,
            d,
            stride_b: if r == 1 { 0 } else { h * t * d },
            interleaved: self.interleaved,
        };
        let out = match one_dtype(
            "rope: x, cos and sin",
            [x.dtype(), cos.dtype(), sin.dtype()],
        )? {
            DType::F32 => cuda::rope(x.device(), cuda::views::<f32>(&args)?, shape)?,
            _ => cuda::rope(x.device(), cuda::views::<f64>(&args)?, shape)?,
        };
        Ok((out, lx.shape().clone()))
    }

    /// A rotation's transpose is the rotation by the opposite angles: `dx = rope(dy, cos,
    /// -sin)`. The tables are computed, not trained: no gradient.
    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = grad_res.contiguous()?.apply_op3(
            cos,
            &sin.neg()?,
            RopeOp {
                interleaved: self.interleaved,
            },
        )?;
        Ok((Some(dx), None, None))
    }
}

/// RoPE's rotation of whole heads in one kernel, differentiable in `x`.
///
/// # Shapes
/// - `x`: `(b, h, t, d)`; `cos`, `sin`: `(r, t, d/2)`, one entry per pair, `r` 1 or `b`
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Tensor> {
    count();
    x.contiguous()?.apply_op3(
        &cos.contiguous()?,
        &sin.contiguous()?,
        RopeOp { interleaved },
    )
}

/// The half-width tables [`rope`] takes, from full-width ones `(r, t, w)` laid out by the
/// pairing (`[c0, c0, c1, c1, ...]` interleaved, `[c0, c1, ..., c0, c1, ...]` half).
pub fn half_table(table: &Tensor, interleaved: bool) -> Result<Tensor> {
    let (r, t, w) = table.dims3()?;
    if interleaved {
        table
            .reshape((r, t, w / 2, 2))?
            .narrow(D::Minus1, 0, 1)?
            .reshape((r, t, w / 2))?
            .contiguous()
    } else {
        table.narrow(D::Minus1, 0, w / 2)?.contiguous()
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! Launches of candle's own kernels (`candle_kernels::REDUCE`), with the launch shapes
    //! those kernels are written for: softmax one warp per row (block `(1, 32, 1)`), LayerNorm
    //! one block per row of 32 threads below 1024 columns and 1024 from there.

    use candle::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
    use candle::cuda_backend::{kernel_name, kernels, CudaDType, CudaDevice, CudaStorage, WrapErr};
    use candle::{Result, WithDType};

    /// The spans of three inputs' storages as views of `T` (the caller has checked the dtype).
    pub fn views<'a, T: CudaDType>(
        [(a, ra), (b, rb), (c, rc)]: &[(&'a CudaStorage, std::ops::Range<usize>); 3],
    ) -> Result<[CudaView<'a, T>; 3]> {
        Ok([
            a.as_cuda_slice::<T>()?.slice(ra.clone()),
            b.as_cuda_slice::<T>()?.slice(rb.clone()),
            c.as_cuda_slice::<T>()?.slice(rc.clone()),
        ])
    }

    fn grid(n_rows: usize) -> Result<u32> {
        u32::try_from(n_rows).map_err(|_| {
            candle::Error::Msg(format!("{n_rows} rows are more than one CUDA launch takes"))
        })
    }

    /// `softmax_<dtype>(src, dst, ncols)`.
    pub fn softmax<T: DeviceRepr + WithDType + CudaDType>(
        device: &CudaDevice,
        src: CudaView<'_, T>,
        n_rows: usize,
        width: usize,
    ) -> Result<CudaStorage> {
        let func = device.get_or_load_func(&kernel_name::<T>("softmax"), &kernels::REDUCE)?;
        // SAFETY: the kernel writes every element.
        let dst = unsafe { device.alloc::<T>(n_rows * width)? };
        let cols = width as i32;
        let cfg = LaunchConfig {
            grid_dim: (grid(n_rows)?, 1, 1),
            block_dim: (1, 32, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = func.builder();
        builder.arg(&src);
        builder.arg(&dst);
        builder.arg(&cols);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(dst, device.clone()))
    }

    /// The sizes the rope kernels take.
    pub struct RopeShape {
        pub bh: usize,
        pub td: usize,
        pub d: usize,
        /// Elements of `x` per batch row when the tables have one row per sequence, else 0.
        pub stride_b: usize,
        pub interleaved: bool,
    }

    /// `rope_i_<dtype>(src, cos, sin, dst, bh, td, stride_b)` or
    /// `rope_<dtype>(src, cos, sin, dst, bh, td, d, stride_b)`: one thread per pair.
    pub fn rope<T: DeviceRepr + WithDType + CudaDType>(
        device: &CudaDevice,
        [x, cos, sin]: [CudaView<'_, T>; 3],
        shape: RopeShape,
    ) -> Result<CudaStorage> {
        let n = shape.bh * shape.td;
        let narrow = |v: usize| {
            u32::try_from(v).map_err(|_| {
                candle::Error::Msg(format!("rope: {v} elements are more than a launch takes"))
            })
        };
        let (bh, td, d, stride_b) = (
            narrow(shape.bh)?,
            narrow(shape.td)?,
            narrow(shape.d)?,
            narrow(shape.stride_b)?,
        );
        let name = if shape.interleaved { "rope_i" } else { "rope" };
        let func = device.get_or_load_func(&kernel_name::<T>(name), &kernels::REDUCE)?;
        // SAFETY: the kernel writes every element (each thread both of its pair).
        let dst = unsafe { device.alloc::<T>(n)? };
        let cfg = LaunchConfig::for_num_elems(narrow(n / 2)?);
        let mut builder = func.builder();
        builder.arg(&x);
        builder.arg(&cos);
        builder.arg(&sin);
        builder.arg(&dst);
        builder.arg(&bh);
        builder.arg(&td);
        if !shape.interleaved {
            builder.arg(&d);
        }
        builder.arg(&stride_b);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(dst, device.clone()))
    }

    /// `layernorm_<dtype>(src, dst, alpha, beta, ncols, block_size, eps)`.
    pub fn layer_norm<T: DeviceRepr + WithDType + CudaDType>(
        device: &CudaDevice,
        [x, w, b]: [CudaView<'_, T>; 3],
        n_rows: usize,
        width: usize,
        eps: f32,
    ) -> Result<CudaStorage> {
        let func = device.get_or_load_func(&kernel_name::<T>("layernorm"), &kernels::REDUCE)?;
        // SAFETY: the kernel writes every element.
        let dst = unsafe { device.alloc::<T>(n_rows * width)? };
        let block: u32 = if width < 1024 { 32 } else { 1024 };
        let (cols, block_size) = (width as i32, block as i32);
        let cfg = LaunchConfig {
            grid_dim: (grid(n_rows)?, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = func.builder();
        builder.arg(&x);
        builder.arg(&dst);
        builder.arg(&w);
        builder.arg(&b);
        builder.arg(&cols);
        builder.arg(&block_size);
        builder.arg(&eps);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(dst, device.clone()))
    }
}
