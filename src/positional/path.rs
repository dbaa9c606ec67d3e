//! PaTH attention (Yang, Shen, Wen, Tan, Mishra, Ren, Panda, Kim 2025, "PaTH Attention: Position
//! Encoding via Accumulating Householder Transformations"), as fla-org/flash-linear-attention
//! computes it, in a bidirectional form for an encoder. A **contextual** scheme: the position
//! signal is a product of reflections each token sets from its content; no position id is read.
//!
//! Every layer makes, from its attention input `x`, one unit vector `w_t` and one strength
//! `β_t ∈ (0, 2)` per token and head:
//!
//! ```text
//! u     = x W_wᵀ, zero at padded tokens                  W_w = layers.{l}.attn.path.w.weight
//! u'_t  = silu(Σ_s C[:, 0, s] u_{t-K+1+s})                a causal depthwise conv of width K
//!                                                         (C = ...path.conv.weight; K = 0: u'=u)
//! w_t   = u'_t / sqrt(|u'_t|² + 1e-6)                     per head, d_head wide
//! β_t   = 2 σ(x_t W_bᵀ + b_b), 0 at padding               ...path.beta.{weight,bias}
//! H_t   = I - β_t w_t w_tᵀ
//! score_ij = q_iᵀ H_i H_{i-1} ⋯ H_{j+1} k_j / sqrt(d_head)   j < i   (fla's causal PaTH)
//!          = q_iᵀ H_{i+1} ⋯ H_j k_j / sqrt(d_head)          j > i   (the transport back)
//!          = q_i · k_i / sqrt(d_head)                        j = i
//! ```
//!
//! **How it is computed: the UT transform** (the idea of fla's blockwise kernels). Applying
//! `H_{j+1}`, …, `H_i` to a vector `v` in turn subtracts `Σ_a w_a u_a`, where the coefficients
//! solve `(I + L) u = diag(β) W v` over the tokens `(j, i]`, with `L_ta = β_t w_t · w_a` for
//! `a < t`. `I + L` is unit lower triangular, so the inverse of any diagonal block of it is that
//! block of its inverse: one inverse `T = (I + L)⁻¹` over the whole sequence serves every pair,
//! and
//!
//! ```text
//! scores = Q Kᵀ - [Q Wᵀ]_{a <= i} T diag(β) [W Kᵀ]_{b > j} - [Q Wᵀ]_{a > i} T' diag(β) [W Kᵀ]_{b <= j}
//! ```
//!
//! with `T' = (I + U)⁻¹`, `U` the strictly upper `β_t w_t · w_a`, for keys after the query (each
//! bracket keeps the entries its subscript names; the triangles make each correction vanish on
//! the other side). The inverses come from doubling blocks, `[[A, 0], [C, D]]⁻¹ = [[A⁻¹, 0],
//! [-D⁻¹ C A⁻¹, D⁻¹]]`, which needs no division and stays bounded. Cost per head: about
//! `(2/3) t³` for each inverse and `4 t³` for the products, beside `q kᵀ`'s `2 t² d_head`; memory
//! a few `(t, t)` tensors per head, as attention's own. fla's kernels go further, chunking the
//! sequence so that the cost is `O(t² d_head)`; this composition keeps to tensor products every
//! device has, with a backward from autograd.
//!
//! Against fla's default layer: `W_w` is one `[d, d]` matrix (fla's `use_low_rank_w=False`),
//! there is no forget gate and no qk norm (both fla's defaults), and q, k, v and o carry
//! poslab's biases. The conv stays causal, as in fla, even in the encoder. Weights start as fla's:
//! every matrix N(0, 0.02), the β bias at zero (β = 1). Reference: `reference_2025_schemes.py`,
//! fixtures `encoder_path_pre`, `encoder_path_h4_post`.

use candle::{DType, Tensor, D};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::{
    BiasBatch, Placement, PositionalModule, Scheme, SchemeShape, ScoreFunction, ScoreModule,
};
use crate::error::Result;
use crate::nn::QkScores;

/// The widest short convolution `path` accepts.
pub const MAX_PATH_CONV: usize = 64;

/// The `eps` inside the root of `w`'s normalisation (fla's `l2_norm`).
pub const PATH_EPS: f64 = 1e-6;

fn default_conv_size() -> usize {
    3
}

/// Options of `path`: the width of the short convolution.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathOptions {
    /// Width `K` of the causal depthwise convolution before `w` (default 3, fla's; 0: no
    /// convolution and no silu, fla's `use_w_shortconv=False`).
    #[serde(default = "default_conv_size")]
    pub conv_size: usize,
}

impl Default for PathOptions {
    fn default() -> Self {
        Self {
            conv_size: default_conv_size(),
        }
    }
}

impl Scheme for PathOptions {
    fn name(&self) -> &'static str {
        "path"
    }

    fn placement(&self) -> Placement {
        Placement::Scores
    }

    fn check(&self, _shape: &SchemeShape) -> std::result::Result<(), String> {
        if self.conv_size > MAX_PATH_CONV {
            return Err(format!(
                "path: conv_size = {} is wider than {MAX_PATH_CONV}: the short convolution reads \
                 the token and the conv_size - 1 before it (fla uses 3; 0 turns it off)",
                self.conv_size
            ));
        }
        Ok(())
    }

    fn check_random_positions(&self, range: usize) -> std::result::Result<(), String> {
        Err(format!(
            "random_positions = {range} with positional `path`: PaTH's transport runs over the \
             tokens between query and key and reads no position ids, so randomizing them would \
             change nothing; remove random_positions"
        ))
    }

    fn score_tensors(&self, training: bool) -> usize {
        // Measured at 512 tokens (batch 4, 4 heads, 4 layers, f32, 2026-11-28): a forward pass
        // peaked at 257 MiB against `sin_add`'s 85, a training step at 4,225 against 340: the
        // transport's inverses and products and their gradients, about 5 and 58 attention
        // tables a layer more.
        match training {
            false => 8,
            true => 64,
        }
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        let (d, h, k) = (
            shape.d_model as u128,
            shape.n_heads as u128,
            self.conv_size as u128,
        );
        (d * d + d * k + h * d + h) * shape.layers.count(shape.n_layers) as u128
    }

    fn describe(&self, shape: &SchemeShape) -> String {
        let conv = match self.conv_size {
            0 => "no short conv".to_string(),
            k => format!("a causal short conv of width {k} and silu"),
        };
        format!(
            "attention scores: keys carried to the query through the Householder reflections \
             I - beta_t w_t w_t^T of the tokens between them; per layer w from x W_w^T ({d} x \
             {d}, {conv}), beta = 2 sigmoid(x W_b^T + b) per head ({h}); no position ids",
            d = shape.d_model,
            h = shape.n_heads,
        )
    }

    fn label(&self) -> String {
        match self.conv_size == default_conv_size() {
            true => "path".into(),
            false => format!("path (conv {})", self.conv_size),
        }
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        let (d, h, k) = (shape.d_model, shape.n_heads, self.conv_size);
        let normal = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let layers = (0..shape.n_layers)
            .map(|i| {
                shape
                    .layers
                    .contains(i)
                    .then(|| -> candle::Result<_> {
                        let vb = vb.pp(format!("layers.{i}.attn.path"));
                        Ok(PathLayer {
                            w: vb.get_with_hints((d, d), "w.weight", normal)?,
                            conv: match k {
                                0 => None,
                                k => Some(vb.get_with_hints((d, 1, k), "conv.weight", normal)?),
                            },
                            beta_weight: vb.get_with_hints((h, d), "beta.weight", normal)?,
                            beta_bias: vb.get_with_hints(h, "beta.bias", Init::Const(0.0))?,
                        })
                    })
                    .transpose()
            })
            .collect::<candle::Result<_>>()?;
        Ok(PositionalModule::Scores(ScoreFunction::new(Path(layers))))
    }
}

/// One layer's PaTH weights.
#[derive(Clone, Debug)]
pub struct PathLayer {
    /// `(d, d)`: `u = x W_wᵀ`.
    pub w: Tensor,
    /// `(d, 1, K)`: the depthwise short convolution (`None` when `K = 0`).
    pub conv: Option<Tensor>,
    /// `(h, d)` and `(h)`: `β = 2 σ(x W_bᵀ + b)`.
    pub beta_weight: Tensor,
    /// See `beta_weight`.
    pub beta_bias: Tensor,
}

/// What a layer's reflections are made of, for tests and analysis.
#[derive(Clone, Debug)]
pub struct Reflections {
    /// `(b, t, d)`: `silu(conv(x W_wᵀ))` before the per-head normalisation.
    pub u: Tensor,
    /// `(b, h, t, d_head)`: the unit vectors `w`.
    pub w: Tensor,
    /// `(b, h, t)`: the strengths `β`, 0 at padding.
    pub beta: Tensor,
}

impl PathLayer {
    /// The reflections of a layer's input.
    ///
    /// # Shapes
    /// - `x`: `(b, t, d)`; `mask`: `(b, t)`, 1 for a real token (`None`: all real)
    pub fn reflections(
        &self,
        x: &Tensor,
        mask: Option<&Tensor>,
        heads: usize,
    ) -> Result<Reflections> {
        let dtype = self.w.dtype();
        let x = x.to_dtype(dtype)?;
        let (b, t, d) = x.dims3()?;
        let real = match mask {
            Some(m) => Some(m.to_dtype(dtype)?.reshape((b, t, 1))?),
            None => None,
        };
        let mut u = x.broadcast_matmul(&self.w.t()?)?; // (b, t, d)
        if let Some(real) = &real {
            u = u.broadcast_mul(real)?;
        }
        if let Some(conv) = &self.conv {
            let k = conv.dim(2)?;
            let taps = conv.reshape((d, k))?;
            let padded = match k {
                1 => u.clone(),
                _ => Tensor::cat(&[&Tensor::zeros((b, k - 1, d), dtype, x.device())?, &u], 1)?,
            };
            let mut y = padded
                .narrow(1, 0, t)?
                .broadcast_mul(&taps.narrow(1, 0, 1)?.t()?)?;
            for s in 1..k {
                let tap = taps.narrow(1, s, 1)?.t()?; // (1, d)
                y = (y + padded.narrow(1, s, t)?.broadcast_mul(&tap)?)?;
            }
            u = y.silu()?;
        }
        let hd = d / heads;
        let uh = u
            .reshape((b, t, heads, hd))?
            .transpose(1, 2)?
            .contiguous()?; // (b, h, t, hd)
        let norm = (uh.sqr()?.sum_keepdim(D::Minus1)? + PATH_EPS)?.sqrt()?;
        let w = uh.broadcast_div(&norm)?;
        let z = x
            .broadcast_matmul(&self.beta_weight.t()?)?
            .broadcast_add(&self.beta_bias)?; // (b, t, h)
        let mut beta = (crate::nn::log_sigmoid(&z)?.exp()? * 2.0)?;
        if let Some(real) = &real {
            beta = beta.broadcast_mul(real)?;
        }
        Ok(Reflections {
            u,
            w,
            beta: beta.transpose(1, 2)?.contiguous()?,
        })
    }
}

/// `(I + L)⁻¹` for `L_ta = β_t w_t · w_a` strictly below the diagonal (`upper`: strictly above),
/// by doubling diagonal blocks: `[[A, 0], [C, D]]⁻¹ = [[A⁻¹, 0], [-D⁻¹ C A⁻¹, D⁻¹]]` (above:
/// `[[A, C], [0, D]]⁻¹ = [[A⁻¹, -A⁻¹ C D⁻¹], [0, D⁻¹]]`). The sequence is padded to a power of two
/// with `β = 0` (identity rows).
///
/// # Shapes
/// - `w`: `(n, t, d_head)`; `beta`: `(n, t)`; returns `(n, t, t)`
pub fn transport_inverse(w: &Tensor, beta: &Tensor, upper: bool) -> Result<Tensor> {
    let (n, t, hd) = w.dims3()?;
    let (dtype, device) = (w.dtype(), w.device());
    let size = t.next_power_of_two();
    let (w, beta) = match size - t {
        0 => (w.clone(), beta.clone()),
        pad => (
            Tensor::cat(&[w, &Tensor::zeros((n, pad, hd), dtype, device)?], 1)?,
            Tensor::cat(&[beta, &Tensor::zeros((n, pad), dtype, device)?], 1)?,
        ),
    };
    let mut blocks = Tensor::ones((n, size, 1, 1), dtype, device)?;
    let mut s = 1;
    while s < size {
        let m = size / (2 * s);
        let half = |x: &Tensor, i: usize| -> Result<Tensor> {
            Ok(x.narrow(2, i, 1)?.squeeze(2)?.contiguous()?)
        };
        let pairs = blocks.reshape((n, m, 2, s, s))?;
        let (a, d) = (half(&pairs, 0)?, half(&pairs, 1)?); // (n, m, s, s)
        let wp = w.reshape((n, m, 2, s, hd))?;
        let bp = beta.reshape((n, m, 2, s, 1))?;
        let (w0, w1) = (half(&wp, 0)?, half(&wp, 1)?); // (n, m, s, hd)
        let zeros = Tensor::zeros((n, m, s, s), dtype, device)?;
        let (top, bottom) = match upper {
            false => {
                let c = half(&bp, 1)?.broadcast_mul(&w1.matmul(&w0.t()?.contiguous()?)?)?;
                let x = d.matmul(&c)?.matmul(&a)?.neg()?;
                (Tensor::cat(&[&a, &zeros], 3)?, Tensor::cat(&[&x, &d], 3)?)
            }
            true => {
                let c = half(&bp, 0)?.broadcast_mul(&w0.matmul(&w1.t()?.contiguous()?)?)?;
                let x = a.matmul(&c)?.matmul(&d)?.neg()?;
                (Tensor::cat(&[&a, &x], 3)?, Tensor::cat(&[&zeros, &d], 3)?)
            }
        };
        blocks = Tensor::cat(&[&top, &bottom], 2)?; // (n, m, 2s, 2s)
        s *= 2;
    }
    let full = blocks.reshape((n, size, size))?;
    Ok(match size == t {
        true => full,
        false => full.narrow(1, 0, t)?.narrow(2, 0, t)?.contiguous()?,
    })
}

/// PaTH's scores before the scale: `q_iᵀ P_ij k_j`, `P_ij` the product of the reflections of
/// the tokens between query and key (see the module's notes).
///
/// # Shapes
/// - `q`, `k`, `w`: `(b, h, t, d_head)`; `beta`: `(b, h, t)`; returns `(b, h, t, t)`
pub fn transport_scores(q: &Tensor, k: &Tensor, w: &Tensor, beta: &Tensor) -> Result<Tensor> {
    let (b, h, t, hd) = q.dims4()?;
    let flat = |x: &Tensor| x.reshape((b * h, t, hd));
    let (q, k, w) = (flat(q)?, flat(k)?, flat(w)?);
    let beta = beta.reshape((b * h, t))?;
    let low = Tensor::tril2(t, q.dtype(), q.device())?; // [a <= i]
    let strict_low = (&low - Tensor::eye(t, q.dtype(), q.device())?)?; // [b > j]
    let strict_up = (1.0 - &low)?; // [a > i]
    let up = (1.0 - &strict_low)?; // [b <= j]
    let qk = q.matmul(&k.t()?.contiguous()?)?; // (n, t, t)
    let qw = q.matmul(&w.t()?.contiguous()?)?; // (n, t, t): q_i · w_a
    let wk = w
        .matmul(&k.t()?.contiguous()?)?
        .broadcast_mul(&beta.unsqueeze(2)?)?; // β_b w_b · k_j
    let left = qw
        .broadcast_mul(&low)?
        .matmul(&transport_inverse(&w, &beta, false)?)?
        .matmul(&wk.broadcast_mul(&strict_low)?)?;
    let right = qw
        .broadcast_mul(&strict_up)?
        .matmul(&transport_inverse(&w, &beta, true)?)?
        .matmul(&wk.broadcast_mul(&up)?)?;
    Ok(((qk - left)? - right)?.reshape((b, h, t, t))?)
}

/// Every layer's PaTH weights; `None` for a layer without positions.
#[derive(Clone, Debug)]
pub struct Path(pub Vec<Option<PathLayer>>);

impl ScoreModule for Path {
    fn batch_scores<'a>(
        &'a self,
        batch: &BiasBatch,
    ) -> Result<Vec<Option<Box<dyn QkScores + 'a>>>> {
        Ok(self
            .0
            .iter()
            .map(|layer| {
                layer.as_ref().map(|weights| {
                    Box::new(PathScores {
                        weights,
                        mask: batch.mask.cloned(),
                    }) as Box<dyn QkScores + 'a>
                })
            })
            .collect())
    }

    fn notes(&self) -> Result<Vec<String>> {
        self.0
            .iter()
            .enumerate()
            .map(|(l, p)| {
                let Some(p) = p else {
                    return Ok(format!("layer {l}: no positions"));
                };
                let bias = p.beta_bias.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                let beta: Vec<f64> = bias.iter().map(|z| 2.0 / (1.0 + (-z).exp())).collect();
                Ok(format!(
                    "layer {l}: beta at a zero input per head [{}] (2 sigmoid of the bias)",
                    super::list(&beta)
                ))
            })
            .collect()
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.0
            .iter()
            .flatten()
            .flat_map(|p| {
                [
                    Some(&p.w),
                    p.conv.as_ref(),
                    Some(&p.beta_weight),
                    Some(&p.beta_bias),
                ]
                .into_iter()
                .flatten()
                .cloned()
            })
            .collect()
    }

    fn undecayed(&self) -> Vec<Tensor> {
        self.0
            .iter()
            .flatten()
            .map(|p| p.beta_bias.clone())
            .collect()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// One layer's PaTH for one batch.
#[derive(Debug)]
struct PathScores<'a> {
    weights: &'a PathLayer,
    mask: Option<Tensor>,
}

impl QkScores for PathScores<'_> {
    fn scores(&self, q: &Tensor, k: &Tensor, x: &Tensor, scale: f64) -> Result<Tensor> {
        let dtype = self.weights.w.dtype();
        let r = self.weights.reflections(x, self.mask.as_ref(), q.dim(1)?)?;
        let scores = transport_scores(&q.to_dtype(dtype)?, &k.to_dtype(dtype)?, &r.w, &r.beta)?;
        Ok((scores * scale)?)
    }
}
