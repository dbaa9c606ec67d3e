//! Small differentiable functions shared by the layers.

use candle::{Result, Tensor, D};
use candle_nn::{Init, VarBuilder};

use super::Backend;
#[cfg(feature = "kernels")]
use super::Path;

/// A linear layer `y = x Wᵀ + b` on the last axis, `W` of shape `(out, in)` as in PyTorch.
///
/// On the CPU it is one fused node (poslab's CPU kernels); elsewhere a matrix multiply and an add.
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// A linear map `x Wᵀ + b` with weight `(out, in)` and optional bias `(out,)`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    /// The bias, or zeros `(out,)` (not a variable) for a layer without one: what a fused
    /// kernel that always adds a bias reads.
    pub fn bias_or_zeros(&self) -> Result<Tensor> {
        match &self.bias {
            Some(b) => Ok(b.clone()),
            None => Tensor::zeros(
                self.weight.dim(0)?,
                self.weight.dtype(),
                self.weight.device(),
            ),
        }
    }

    /// `(out, in)`
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// `(out)`
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// What weight decay leaves alone: the bias.
    pub fn undecayed(&self) -> Vec<Tensor> {
        self.bias.iter().cloned().collect()
    }

    /// The weight and the bias, to be replaced by views of a packed variable
    /// ([`crate::ParamStore::pack`]).
    pub(crate) fn params_mut(&mut self) -> (&mut Tensor, Option<&mut Tensor>) {
        (&mut self.weight, self.bias.as_mut())
    }
}

impl Linear {
    /// `xs Wᵀ + b`, computed where `backend` says.
    ///
    /// # Shapes
    /// - `xs`: `(..., in)`; returns `(..., out)`
    pub fn forward(&self, xs: &Tensor, backend: Backend) -> Result<Tensor> {
        match backend.path(xs) {
            #[cfg(feature = "kernels")]
            Path::Fused => crate::kernels::cpu::linear(xs, &self.weight, self.bias.as_ref()),
            _ => self.forward_reference(xs),
        }
    }

    /// The composition: a matrix multiply and an add.
    pub fn forward_reference(&self, xs: &Tensor) -> Result<Tensor> {
        let mut dims = xs.dims().to_vec();
        let last = dims.pop().unwrap_or(0);
        let rows = xs.contiguous()?.reshape(((), last))?; // (n, in)

        // Mixed precision: the weights meet the activations' dtype here (`to_dtype` is a no-op
        // when they already do), so the f32 variables get their gradients through the cast.
        let weight = self.weight.to_dtype(xs.dtype())?;
        let y = super::matmul(&rows, &weight.t()?)?; // (n, out)
        let y = match &self.bias {
            Some(b) => y.broadcast_add(&b.to_dtype(xs.dtype())?)?,
            None => y,
        };
        dims.push(self.weight.dim(0)?);
        y.reshape(dims)
    }
}

/// [`linear`] with a bias, or [`linear_no_bias`] without one (`bias = false` models).
pub fn linear_with_bias(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: VarBuilder,
) -> Result<Linear> {
    match bias {
        true => linear(in_dim, out_dim, vb),
        false => linear_no_bias(in_dim, out_dim, vb),
    }
}

/// A [`Linear`] layer initialised like PyTorch's `nn.Linear`: weight and bias uniform in
/// `±1/sqrt(in)`.
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let weight = vb.get_with_hints((out_dim, in_dim), "weight", linear_init(in_dim))?;
    let bias = vb.get_with_hints(out_dim, "bias", linear_init(in_dim))?;
    Ok(Linear::new(weight, Some(bias)))
}

/// As [`linear`], without the bias.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let weight = vb.get_with_hints((out_dim, in_dim), "weight", linear_init(in_dim))?;
    Ok(Linear::new(weight, None))
}

fn linear_init(in_dim: usize) -> Init {
    let bound = 1.0 / (in_dim as f64).sqrt();
    Init::Uniform {
        lo: -bound,
        up: bound,
    }
}

/// Softmax over the last axis, `exp(x - max) / sum(exp(x - max))`.
///
/// The max is detached: subtracting it changes no value of the result, so no gradient is owed
/// through it, and skipping it saves a backward pass through the reduction.
pub fn softmax_last_dim(xs: &Tensor) -> Result<Tensor> {
    let max = xs.max_keepdim(D::Minus1)?.detach();
    let exp = xs.broadcast_sub(&max)?.exp()?;
    let sum = exp.sum_keepdim(D::Minus1)?;
    exp.broadcast_div(&sum)
}

/// Log-softmax over the last axis, `x - max - log(sum(exp(x - max)))`, the max detached as in
/// [`softmax_last_dim`].
pub fn log_softmax_last_dim(xs: &Tensor) -> Result<Tensor> {
    let max = xs.max_keepdim(D::Minus1)?.detach();
    let shifted = xs.broadcast_sub(&max)?;
    let log_sum = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&log_sum)
}

/// `softmax(scores + bias)` over the last axis, where the key bias `(b, t)` (0 for real keys,
/// a large negative score for padded ones) is added to every row of batch element `b`.
///
/// # Shapes
/// - `scores`: `(b, h, t_q, t)`, `key_bias`: `(b, t)` or `(1, t)` (every batch element's);
///   returns `(b, h, t_q, t)`. Other shapes, and scores with no element, are an error.
pub fn masked_softmax(scores: &Tensor, key_bias: &Tensor, backend: Backend) -> Result<Tensor> {
    let (b, h, tq, t) = scores.dims4()?;
    let (kb, kt) = key_bias.dims2()?;
    if (kb != b && kb != 1) || kt != t {
        candle::bail!(
            "masked_softmax: a key bias of shape {:?} does not fit scores of shape {:?}: it is \
             (b, t) = ({b}, {t}), or (1, {t}) for every batch element",
            key_bias.dims(),
            scores.dims()
        );
    }
    if b == 0 || h == 0 || tq == 0 || t == 0 {
        candle::bail!(
            "masked_softmax: scores of shape {:?} hold no score: a softmax needs at least one \
             key in at least one row",
            scores.dims()
        );
    }
    if kb != b {
        let key_bias = key_bias.broadcast_as((b, t))?.contiguous()?;
        return masked_softmax(scores, &key_bias, backend);
    }
    if super::is_half(scores.dtype()) {
        // Half-precision scores: the softmax runs in f32 and its weights are rounded back.
        let f32 = candle::DType::F32;
        let weights = masked_softmax(&scores.to_dtype(f32)?, &key_bias.to_dtype(f32)?, backend)?;
        return weights.to_dtype(scores.dtype());
    }
    let biased = || scores.broadcast_add(&key_bias.reshape((b, 1, 1, t))?);
    match backend.path(scores) {
        #[cfg(feature = "kernels")]
        Path::Fused => crate::kernels::cpu::masked_softmax(scores, key_bias, backend.simd),
        #[cfg(feature = "kernels")]
        Path::Device => crate::kernels::cuda_ops::softmax_last_dim(&biased()?),
        _ => softmax_last_dim(&biased()?),
    }
}

/// RoPE's rotation `x * cos + rotate(x) * sin` of the first `w` coordinates of every head, by
/// `(r, t, w)` tables laid out by the pairing (`interleaved` pairs `(x[2i], x[2i+1])`, else
/// `(x[i], x[i + w/2])`); coordinates past `w` pass through (see [`super::Rotary`]).
///
/// # Shapes
/// - `x`: `(b, h, t, d_head)`, `cos`, `sin`: `(r, t, w)` with `r` 1 or `b`, `w <= d_head`
/// - returns the shape of `x`
pub fn rope_rotate(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    interleaved: bool,
    backend: Backend,
) -> Result<Tensor> {
    super::rotary::check(x, cos)?;
    if super::is_half(x.dtype()) && !super::is_half(cos.dtype()) {
        // Half-precision q or k: rotated in the tables' dtype (f32) and rounded back once.
        let rotated = rope_rotate(&x.to_dtype(cos.dtype())?, cos, sin, interleaved, backend)?;
        return rotated.to_dtype(x.dtype());
    }
    match backend.path(x) {
        #[cfg(feature = "kernels")]
        Path::Fused => crate::kernels::cpu::rope(x, cos, sin, interleaved, backend.simd),
        _ => rope_rotate_reference(x, cos, sin, interleaved),
    }
}

/// [`rope_rotate`]'s composition.
pub fn rope_rotate_reference(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    interleaved: bool,
) -> Result<Tensor> {
    let (d, w) = (x.dim(D::Minus1)?, cos.dim(D::Minus1)?);
    let xr = if w == d {
        x.clone()
    } else {
        x.narrow(D::Minus1, 0, w)?
    };
    let half = w / 2;
    let rotated = if interleaved {
        let mut pair_shape = xr.dims().to_vec();
        pair_shape.pop();
        pair_shape.extend([half, 2]);
        let pairs = xr.reshape(pair_shape)?; // (..., w/2, 2)
        let even = pairs.narrow(D::Minus1, 0, 1)?;
        let odd = pairs.narrow(D::Minus1, 1, 1)?;
        Tensor::cat(&[&odd.neg()?, &even], D::Minus1)?.reshape(xr.shape())?
    } else {
        let first = xr.narrow(D::Minus1, 0, half)?;
        let second = xr.narrow(D::Minus1, half, half)?;
        Tensor::cat(&[&second.neg()?, &first], D::Minus1)?
    };
    let (cos, sin) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?); // (r, 1, t, w)
    let out = (xr.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?;
    if w == d {
        Ok(out)
    } else {
        Tensor::cat(&[&out, &x.narrow(D::Minus1, w, d - w)?], D::Minus1)
    }
}

/// `x + y + W2 leaky_relu(W1 [x; y] + c1)`: two maps of `h` channels summed with an MLP over
/// their channels at every position, LeakyReLU slope `slope`. One fused node with its backward
/// where the fused kernels run (neither `[x; y]` nor the hidden layer is stored), else
/// [`channel_mlp_reference`].
///
/// # Shapes
/// - `x`: `(n, h, p)`; `y`: `(n, h, p)` or `(1, h, p)`, broadcast over `n`
/// - `w1`: `(w, 2h)`; `c1`: `(w)`; `w2`: `(h, w)`, all of `x`'s dtype
/// - returns `(n, h, p)`
pub fn channel_mlp(
    x: &Tensor,
    y: &Tensor,
    (w1, c1, w2): (&Tensor, &Tensor, &Tensor),
    slope: f64,
    backend: Backend,
) -> Result<Tensor> {
    match backend.path(x) {
        #[cfg(feature = "kernels")]
        Path::Fused => {
            let packed = Tensor::cat(&[&w1.flatten_all()?, c1, &w2.flatten_all()?], 0)?;
            crate::kernels::cpu::channel_mlp(x, y, &packed, w1.dim(0)?, slope, backend.simd)
        }
        _ => channel_mlp_reference(x, y, (w1, c1, w2), slope),
    }
}

/// [`channel_mlp`]'s composition.
pub fn channel_mlp_reference(
    x: &Tensor,
    y: &Tensor,
    (w1, c1, w2): (&Tensor, &Tensor, &Tensor),
    slope: f64,
) -> Result<Tensor> {
    let u = Tensor::cat(&[x, &y.broadcast_as(x.shape())?], 1)?;
    let z = w1
        .broadcast_matmul(&u)?
        .broadcast_add(&c1.reshape((1, c1.dim(0)?, 1))?)?; // (n, w, p)
    let a = (z.relu()? - (z.neg()?.relu()? * slope)?)?;
    x.broadcast_add(y)? + w2.broadcast_matmul(&a)?
}

/// `log σ(z) = -(max(-z, 0) + ln(1 + e^(-|z|)))`, exact for any `z` (never above 0), fused
/// where the fused kernels run.
///
/// # Shapes
/// Any shape; the output has the input's.
pub fn log_sigmoid(z: &Tensor, backend: Backend) -> Result<Tensor> {
    match backend.path(z) {
        #[cfg(feature = "kernels")]
        Path::Fused => crate::kernels::cpu::log_sigmoid(z, backend.simd),
        _ => log_sigmoid_reference(z),
    }
}

/// [`log_sigmoid`]'s composition.
pub fn log_sigmoid_reference(z: &Tensor) -> Result<Tensor> {
    let soft = (z.abs()?.neg()?.exp()? + 1.0)?.log()?;
    (z.neg()?.relu()? + soft)?.neg()
}

/// Running sums along the tokens, laid out group by group: `out[s, b, c, i]` is the sum of
/// `x[b, j, s · C + c]` over the tokens `j <= i` (FoX's gates, forward and backward, are two
/// groups of `heads` channels). Fused where the fused kernels run and give the composition's
/// bits (all but the smallest and the longest: see `fused::running_sums`).
///
/// # Shapes
/// - `x`: `(b, t, groups · C)`; returns `(groups, b, C, t)`
pub fn running_sums(x: &Tensor, groups: usize, backend: Backend) -> Result<Tensor> {
    match backend.path(x) {
        #[cfg(feature = "kernels")]
        Path::Fused if crate::kernels::cpu::running_sums_in_order(x.dims3()?) => {
            crate::kernels::cpu::running_sums(x, groups)
        }
        _ => running_sums_reference(x, groups),
    }
}

/// [`running_sums`]' composition.
pub fn running_sums_reference(x: &Tensor, groups: usize) -> Result<Tensor> {
    let (b, t, width) = x.dims3()?;
    let channels = crate::kernels::spec::group_channels(width, groups)?;
    let sums = x.transpose(1, 2)?.contiguous()?.cumsum(candle::D::Minus1)?; // (b, S C, t)
    sums.reshape((b, groups, channels, t))?
        .transpose(0, 1)?
        .contiguous()
}

/// Two-sided differences: `out[n, i, j] = f[n, i] - f[n, j]` for `j <= i` and
/// `g[n, j] - g[n, i]` for `j > i` (of running sums, the sum between token `j` and token `i`,
/// taken from `f` to the left of `i` and from `g` to its right).
///
/// # Shapes
/// - `f`, `g`: `(n, t)`, the same shape; returns `(n, t, t)` (empty where `n` or `t` is 0).
pub fn sided_differences(f: &Tensor, g: &Tensor, backend: Backend) -> Result<Tensor> {
    let (n, t) = f.dims2()?;
    if g.dims() != f.dims() {
        candle::bail!(
            "sided_differences: f {:?} and g {:?} differ in shape: both are (n, t)",
            f.dims(),
            g.dims()
        );
    }
    if n == 0 || t == 0 {
        return Tensor::zeros((n, t, t), f.dtype(), f.device());
    }
    match backend.path(f) {
        #[cfg(feature = "kernels")]
        Path::Fused => crate::kernels::cpu::sided_differences(f, g, backend.simd),
        _ => sided_differences_reference(f, g),
    }
}

/// [`sided_differences`]' composition, of inputs already checked.
fn sided_differences_reference(f: &Tensor, g: &Tensor) -> Result<Tensor> {
    let (_, t) = f.dims2()?;
    let before = f.unsqueeze(2)?.broadcast_sub(&f.unsqueeze(1)?)?; // f[i] - f[j]
    let after = g.unsqueeze(1)?.broadcast_sub(&g.unsqueeze(2)?)?; // g[j] - g[i]
    let lower: Vec<u8> = (0..t * t).map(|n| u8::from(n % t <= n / t)).collect();
    let lower = Tensor::from_vec(lower, (t, t), f.device())?.broadcast_as(before.shape())?;
    lower.where_cond(&before, &after)
}

/// GELU, `x · Φ(x)` in its exact (erf) form, fused where the fused kernels run.
///
/// The composition uses `erf` rather than candle's `gelu_erf`, whose backward hard-codes
/// `1/sqrt(2 pi)` as 0.398942: its gradients are off by up to about 5e-7 relative, which the
/// f64 finite-difference test sees (1.7e-9 with this form).
///
/// # Shapes
/// Any shape; the output has the input's.
pub fn gelu(xs: &Tensor, backend: Backend) -> Result<Tensor> {
    match backend.path(xs) {
        #[cfg(feature = "kernels")]
        Path::Fused => crate::kernels::cpu::gelu(xs, backend.simd),
        #[cfg(feature = "kernels")]
        Path::Device => crate::kernels::cuda_ops::gelu(xs),
        _ => gelu_reference(xs),
    }
}

/// [`gelu`]'s composition.
pub fn gelu_reference(xs: &Tensor) -> Result<Tensor> {
    let cdf = ((xs * std::f64::consts::FRAC_1_SQRT_2)?.erf()? + 1.0)? * 0.5;
    xs * cdf?
}
