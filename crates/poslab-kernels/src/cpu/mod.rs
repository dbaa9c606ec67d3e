//! Fused CPU kernels with hand-written backward passes: LayerNorm, softmax with a key-padding
//! bias, exact GELU and RoPE.
//!
//! Each is a candle custom op whose `bwd` returns the exact gradient, itself computed by a fused
//! kernel, so training through them is as correct as through the compositions in the core's `nn` ops
//! (which the tests compare them with, forward and backward, in f32 and f64) and much faster: one
//! pass over memory instead of a dozen temporary tensors. They run on the CPU in f32 and f64;
//! other devices and dtypes use the compositions.
//!
//! Every kernel works a row at a time, each row on one thread, and sums across rows (the
//! LayerNorm parameter gradients) over fixed chunks in a fixed order, so results do not depend
//! on the number of threads. Inner loops are written to auto-vectorise and compiled again for
//! AVX2 and AVX-512, chosen at run time.

use candle::{CpuStorage, DType, Layout, Result, Tensor, WithDType};

mod buffers;
mod rows;

use super::real::{cdf_pdf, sigmoid};
pub use super::Real;
pub use super::SimdLevel;
use buffers::{
    assume_written, par_written, par_written_parts, rows_per_task, uninit, written, zeros,
};
use rows::{batch_sum, dots, maxes, sums, whole_blocks, FOLD_ROWS};

mod adamw;
mod attention;
mod channel_mlp;
mod differences;
mod gelu;
mod layer;
mod layer_norm;
mod linear;
mod log_sigmoid;
mod pointwise;
mod reflections;
mod rope;
mod running_sums;
mod softmax;
mod stack;
mod stick_breaking;

pub use channel_mlp::channel_mlp;
pub use differences::sided_differences;
use linear::by_dtype;

pub use super::spec::{AttentionDropout, LayerMasks, LayerShape, SeededDropout, TransportShape};
pub use adamw::adamw_step;
pub use attention::{attention, Attention};
pub use attention::{head_product_gflops, HeadProduct};
pub use gelu::{activation_par, activation_with_grad_par, gelu, times_grad_summed_par};
pub use layer_norm::layer_norm;
pub use linear::linear;
pub use linear::{linear_pass_gflops, matmul_gflops, LinearPass};
pub use log_sigmoid::log_sigmoid;
pub use reflections::reflections;
pub use rope::{rope, Rotation};
pub use running_sums::{
    group_channels as running_sums_channels, in_order as running_sums_in_order, running_sums,
};
pub use softmax::masked_softmax;
pub use stack::{encoder_stack, StackLayer};
pub use stick_breaking::stick_breaking;

/// An operand for the timing functions ([`matmul_gflops`] and its kin): `len` small f32 values
/// in a fixed pattern, one per `seed`.
pub(super) fn timing_operand(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + seed) % 13) as f32 * 0.01 - 0.06)
        .collect()
}

/// The rate, in GFLOP/s, of `gflop` at the fastest of `reps` (at least one) runs of `run`.
pub(super) fn best_rate(gflop: f64, reps: usize, mut run: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let start = std::time::Instant::now();
        run();
        best = best.min(start.elapsed().as_secs_f64());
    }
    gflop / best
}

fn contiguous<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<T>()?[a..b]),
        None => candle::bail!(
            "fused {what}: the input must be contiguous, got strides {:?}",
            l.stride()
        ),
    }
}

fn unsupported(what: &str, dtype: DType) -> candle::Error {
    candle::Error::Msg(format!("fused {what} runs on f32 and f64, not {dtype:?}"))
}

/// One encoder layer as one node (see `layer`).
///
/// # Shapes
/// - `x`: `(b, t, d)`; `params`: the packed vector of [`LayerShape`]
/// - `inputs`: the attention's key bias `(b, t)`, rotary tables `(r, t, w)` and additive score
///   bias `(r, h, t, t)` (see [`Attention::new`])
/// - `device`: on the device path (CUDA, or its CPU twin: a stack of one layer,
///   [`encoder_stack`]), else the CPU's kernels
/// - returns `(b, t, d)`
#[allow(clippy::too_many_arguments)]
pub fn encoder_layer(
    x: &Tensor,
    params: &Tensor,
    shape: LayerShape,
    attention: Attention,
    masks: LayerMasks,
    keep_activations: bool,
    reflections: Option<crate::spec::ReflectionInputs>,
    device: bool,
) -> Result<Tensor> {
    if shape.gates != 0 && shape.gates != 2 * attention.head_count() {
        candle::bail!(
            "the fused layer's forget gates have {} channels, not 2 x {} heads",
            shape.gates,
            attention.head_count()
        );
    }
    if shape.gates != 0 && shape.transport.is_some() {
        candle::bail!("the fused layer computes forget gates or a transport, not both");
    }
    // A transport's reflections, made inside from the attention input: CPU kernels only.
    let reflections = match (reflections, shape.transport) {
        (None, None) => None,
        (Some(r), Some(tr)) if !device => {
            if r.taps != tr.taps || tr.heads != attention.head_count() {
                candle::bail!(
                    "the fused layer's transport: {tr:?}, for reflections with {} taps over {} \
                     heads",
                    r.taps,
                    attention.head_count()
                );
            }
            Some(reflections::Reflections::new(tr.heads, r.eps, r.mask)?)
        }
        _ => candle::bail!(
            "the fused layer makes a transport's reflections on the CPU's kernels, given both \
             their weights and their conv width"
        ),
    };
    if device {
        // The device path: the layer as a stack of one.
        let layer = stack::StackLayer {
            shape,
            attention,
            masks,
        };
        return stack::encoder_stack(x, params, vec![layer], keep_activations);
    }
    let attention = attention.without_offsets()?;
    let bias = attention.score_bias_input(x)?;
    let op = layer::LayerOp::new(shape, attention, masks, keep_activations)
        .with_reflections(reflections);
    x.contiguous()?.apply_op3(&params.contiguous()?, &bias, op)
}

#[cfg(test)]
mod tests {
    use super::layer_norm::{ln_forward, ln_grad_input, ln_grad_params};
    use super::softmax::{softmax_grad_rows, softmax_rows};
    use super::*;

    /// Values whose sums depend on the order they are taken in: both signs, magnitudes from
    /// `spread`^-3 to `spread`^3, and masked entries (-inf) now and then when `masked`.
    fn values<T: Real>(n: usize, seed: u64, spread: f64, masked: bool) -> Vec<T> {
        crate::testing::uniform(n, seed)
            .enumerate()
            .map(|(i, u)| {
                if masked && i % 23 == 7 {
                    T::neg_infinity()
                } else {
                    T::lit((u - 0.5) * spread.powi((i % 7) as i32 - 3))
                }
            })
            .collect()
    }

    fn bits<T: Real>(v: &[T]) -> Vec<u64> {
        v.iter().map(|x| WithDType::to_f64(*x).to_bits()).collect()
    }

    /// Every row-wise kernel, over `rows` rows of `t`, against itself one row at a time (the
    /// single-row path, [`FOLD_ROWS`] rows never folded together), at `level`.
    fn blocks_against_single_rows<T: Real>(level: SimdLevel, rows: usize, t: usize) -> Vec<u64> {
        let n = rows * t;
        let x = values::<T>(n, 1 + n as u64, 10.0, false);
        let g = values::<T>(n, 2 + n as u64, 10.0, false);
        let w = values::<T>(t, 3, 10.0, false);
        let b = values::<T>(t, 4, 10.0, false);
        // scores: exponentials of comparable size, so their sum depends on its order
        let scores = values::<T>(n, 5 + n as u64, 1.5, false);
        let key_bias = values::<T>(t, 6, 1.0, true);
        let eps = T::lit(1e-5);
        let one_by_one = |f: &mut dyn FnMut(std::ops::Range<usize>)| {
            for r in 0..rows {
                f(r * t..(r + 1) * t);
            }
        };
        let mut all = Vec::new();
        // softmax
        let mut y = vec![T::zero(); n];
        // SAFETY (all `uninit`): the kernels write values only.
        softmax_rows(level, &scores, &key_bias, unsafe { uninit(&mut y) });
        let mut want = vec![T::zero(); n];
        one_by_one(&mut |r| {
            softmax_rows(level, &scores[r.clone()], &key_bias, unsafe {
                uninit(&mut want[r])
            })
        });
        assert!(bits(&y) == bits(&want), "softmax, {rows} rows of {t}");
        all.extend(bits(&y));
        // its gradient
        let mut dx = vec![T::zero(); n];
        softmax_grad_rows(level, &y, &g, t, &mut dx);
        one_by_one(&mut |r| {
            softmax_grad_rows(level, &y[r.clone()], &g[r.clone()], t, &mut want[r])
        });
        assert!(
            bits(&dx) == bits(&want),
            "softmax gradient, {rows} rows of {t}"
        );
        all.extend(bits(&dx));
        // LayerNorm forward, input gradient and parameter gradients (summed over the rows)
        ln_forward(level, &x, &w, &b, eps, unsafe { uninit(&mut y) });
        one_by_one(&mut |r| {
            ln_forward(level, &x[r.clone()], &w, &b, eps, unsafe {
                uninit(&mut want[r])
            })
        });
        assert!(bits(&y) == bits(&want), "layer norm, {rows} rows of {t}");
        all.extend(bits(&y));
        ln_grad_input(level, (&x, &w, &g), eps, unsafe { uninit(&mut dx) }, None);
        one_by_one(&mut |r| {
            let o = unsafe { uninit(&mut want[r.clone()]) };
            ln_grad_input(level, (&x[r.clone()], &w, &g[r]), eps, o, None)
        });
        assert!(
            bits(&dx) == bits(&want),
            "layer norm gradient, {rows} rows of {t}"
        );
        all.extend(bits(&dx));
        let mut params = vec![T::zero(); 2 * t];
        ln_grad_params(level, &x, &g, t, eps, &mut params);
        let mut want_params = vec![T::zero(); 2 * t];
        one_by_one(&mut |r| ln_grad_params(level, &x[r.clone()], &g[r], t, eps, &mut want_params));
        assert!(
            bits(&params) == bits(&want_params),
            "layer norm parameters, {rows} rows of {t}"
        );
        // both gradients in one pass: each with its own kernel's bits
        let mut both = vec![T::zero(); 2 * t];
        ln_grad_input(
            level,
            (&x, &w, &g),
            eps,
            unsafe { uninit(&mut want) },
            Some(&mut both),
        );
        assert!(
            bits(&want) == bits(&dx) && bits(&both) == bits(&params),
            "layer norm gradients in one pass, {rows} rows of {t}"
        );
        all.extend(bits(&params));
        all
    }

    fn rows_in_blocks<T: Real>() {
        let levels: Vec<SimdLevel> = [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512]
            .into_iter()
            .filter(|l| *l <= SimdLevel::detected())
            .collect();
        // Whole blocks and rows left over, rows of whole lane chunks and ragged ones.
        for (rows, t) in [
            (37, 64),
            (2 * FOLD_ROWS, 17),
            (FOLD_ROWS + 3, 5),
            (3, 1),
            (40, 33),
        ] {
            let first = blocks_against_single_rows::<T>(levels[0], rows, t);
            for &level in &levels[1..] {
                let other = blocks_against_single_rows::<T>(level, rows, t);
                assert!(
                    other == first,
                    "{level:?} against {:?}, {rows} rows of {t}",
                    levels[0]
                );
            }
        }
    }

    /// The fused layer's LayerNorm backward ([`LayerNormGrad`]) against the two ops it stands
    /// for, over more rows than a chunk of the parameter sums and a ragged last chunk.
    fn layer_norm_grads_in_one_pass<T: Real>() {
        use super::layer_norm::{LayerNormGrad, LayerNormGradInput, LayerNormGradParams};
        for (rows, d) in [(200, 40), (64, 64), (7, 5)] {
            let x = values::<T>(rows * d, 11, 10.0, false);
            let g = values::<T>(rows * d, 12, 10.0, false);
            let w = values::<T>(d, 13, 10.0, false);
            for simd in [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512] {
                let (dx, params) = LayerNormGrad { eps: 1e-5, simd }.run(&x, &w, &g);
                let want_dx = LayerNormGradInput { eps: 1e-5, simd }.run(&x, &w, &g);
                let want_params = LayerNormGradParams { eps: 1e-5, simd }.run(&x, &g, d);
                assert!(bits(&dx) == bits(&want_dx), "dx, {rows} x {d}, {simd:?}");
                assert!(
                    bits(&params) == bits(&want_params),
                    "params, {rows} x {d}, {simd:?}"
                );
            }
        }
    }

    #[test]
    fn layer_norm_gradients_in_one_pass_have_each_ops_bits() {
        layer_norm_grads_in_one_pass::<f32>();
        layer_norm_grads_in_one_pass::<f64>();
    }

    #[test]
    fn rows_reduced_in_blocks_keep_each_rows_own_bits_at_every_level() {
        rows_in_blocks::<f32>();
        rows_in_blocks::<f64>();
    }
}
