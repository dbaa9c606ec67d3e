//! The fused attention with a scheme's own scores held to their compositions.

use candle::Tensor;

use crate::kernels::cpu::{attention, Attention};
use crate::kernels::{Real, SimdLevel};
use crate::nn::{GateCounts, Polar, Transport, Window};

/// Values in [-1, 1) from a fixed linear congruential sequence.
fn values<T: Real>(len: usize, seed: u64) -> Vec<T> {
    crate::kernels::testing::uniform(len, seed)
        .map(|u| T::lit(u * 2.0 - 1.0))
        .collect()
}

/// `len` values of [`values`] (`seed`) as a CPU tensor of `dims` in `dtype`.
fn tensor(len: usize, seed: u64, dims: &[usize], dtype: candle::DType) -> Tensor {
    crate::kernels::testing::tensor(len, seed, dims, dtype).unwrap()
}

/// A scheme's own scores of q and k, as the tests draw them.
#[derive(Clone, Copy, Debug)]
enum Own {
    /// Polar scores with phase tables of `rows` blocks (1 or b).
    Polar { rows: usize },
    /// Gate-counted scores with tables of `npos` rows, at a score scale.
    Counts { npos: usize, scale: f64 },
    /// Scores through a transport with strengths `β` in `[0, top)`, at a score scale.
    Transport { top: f64, scale: f64 },
}

/// The attention core with a scheme's own scores, fused or composed of ops
/// ([`Polar::scores`], [`GateCounts::scores`]): the output and the gradients of qkv and of
/// the scores' parameters (the polar offsets; the count tables, left then right), from
/// `(b, t, h, d_head)`, with padded keys, a window and dropout when asked.
fn own_scores_attention(
    dtype: candle::DType,
    fused: bool,
    (b, t, h, dh): (usize, usize, usize, usize),
    (own, window, dropout): (Own, Window, bool),
    backend: crate::nn::Backend,
) -> [Vec<f64>; 3] {
    use candle::{Var, D};
    let d = h * dh;
    let qkv = Var::from_tensor(
        &tensor(b * t * 3 * d, 71, &[b, t, 3 * d], dtype)
            .affine(3.0, 0.0)
            .unwrap(),
    )
    .unwrap();
    let padded = |i: usize| i / t == b - 1 && i % t >= t - 2;
    let real: Vec<f64> = (0..b * t)
        .map(|i| f64::from(u8::from(!padded(i))))
        .collect();
    let real = Tensor::from_vec(real, (b, t), &candle::Device::Cpu).unwrap();
    let key_bias = crate::nn::key_padding_bias(&real, dtype).unwrap();
    // The parameters the gradient is asked of, and the scores they make.
    let mut transport = None;
    let (params, polar, counts) = match own {
        Own::Polar { rows } => {
            let angles = tensor(rows * t * dh, 72, &[rows, 1, t, dh], dtype)
                .affine(7.0, 0.0)
                .unwrap();
            let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
            let offsets = Var::from_tensor(
                &tensor(h * dh, 73, &[h, dh], dtype)
                    .affine(3.0, -3.0)
                    .unwrap(),
            )
            .unwrap();
            let polar = Polar::new(cos, sin, offsets.as_tensor().clone());
            (vec![offsets], Some(polar), None)
        }
        Own::Counts { npos, .. } => {
            let table =
                |seed| Var::from_tensor(&tensor(npos * dh, seed, &[npos, dh], dtype)).unwrap();
            let (left, right) = (table(76), table(77));
            let counts = GateCounts::new(left.as_tensor(), right.as_tensor(), Some(&real)).unwrap();
            (vec![left, right], None, Some(counts))
        }
        Own::Transport { top, .. } => {
            // Vectors near unit length (not exactly: the transport does not need it), and
            // strengths across [0, top).
            let w = tensor(b * h * t * dh, 78, &[b, h, t, dh], dtype)
                .affine(1.7 / (dh as f64).sqrt(), 0.0)
                .unwrap();
            let beta = tensor(b * h * t, 79, &[b, h, t], dtype)
                .affine(top / 2.0, top / 2.0)
                .unwrap();
            let (w, beta) = (
                Var::from_tensor(&w).unwrap(),
                Var::from_tensor(&beta).unwrap(),
            );
            transport = Some(Transport::new(w.as_tensor(), beta.as_tensor()).unwrap());
            (vec![w, beta], None, None)
        }
    };
    let mask = dropout.then(|| {
        let m: Vec<f64> = values::<f64>(b * h * t * t, 74)
            .iter()
            .map(|u| if *u > 0.0 { 2.0 } else { 0.0 })
            .collect();
        Tensor::from_vec(m, (b, h, t, t), &candle::Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    });
    let scale = match own {
        Own::Counts { scale, .. } | Own::Transport { scale, .. } => scale,
        Own::Polar { .. } => 0.37,
    };
    let out = if fused {
        let op = Attention::new(h, scale, &key_bias, None, None, window, backend.simd)
            .with_polar(polar.as_ref().map(Polar::spec))
            .with_counts(counts.as_ref().map(GateCounts::spec))
            .with_transport(transport.as_ref().map(Transport::spec));
        attention(qkv.as_tensor(), op, mask.as_ref()).unwrap()
    } else {
        let heads = |at: usize| {
            qkv.as_tensor()
                .narrow(D::Minus1, at * d, d)
                .unwrap()
                .reshape((b, t, h, dh))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let (q, k, v) = (heads(0), heads(1), heads(2));
        let mut s = match (&polar, &counts, &transport) {
            (Some(polar), _, _) => polar.scores(&q, &k, scale, backend).unwrap(),
            (_, Some(counts), _) => counts.scores(&q, &k, scale, backend).unwrap(),
            (_, _, Some(transport)) => transport.scores(&q, &k, scale).unwrap(),
            _ => unreachable!("a form is drawn"),
        };
        if let Some(w) = crate::nn::window_bias(t, window, dtype, &candle::Device::Cpu).unwrap() {
            s = s.broadcast_add(&w).unwrap();
        }
        let mut p = crate::nn::masked_softmax(&s, &key_bias, backend).unwrap();
        if let Some(m) = &mask {
            p = (p * m).unwrap();
        }
        p.matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, t, d))
            .unwrap()
    };
    let weights = tensor(b * t * d, 75, &[b, t, d], dtype);
    let grads = (&out * &weights)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let flat = |x: &Tensor| {
        x.flatten_all()
            .unwrap()
            .to_dtype(candle::DType::F64)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
    };
    let param_grads = params
        .iter()
        .flat_map(|p| flat(grads.get(p.as_tensor()).unwrap()))
        .collect();
    [
        flat(&out),
        flat(grads.get(qkv.as_tensor()).unwrap()),
        param_grads,
    ]
}

/// A case of [`own_scores_attention`]: `(b, t, h, d_head)`, the scores, a window, dropout.
type OwnCase = ((usize, usize, usize, usize), Own, Window, bool);

/// Each result of the fused attention within each dtype's `tol` of the composition's,
/// relative to the largest value of each, and none all zero: every case at every
/// instruction set level.
fn assert_own_scores_match(
    tolerances: [(candle::DType, f64); 2],
    cases: &[OwnCase],
    names: [&str; 3],
) {
    use crate::nn::Backend;
    for (dtype, tol) in tolerances {
        for level in [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512] {
            for &(shape, own, window, dropout) in cases {
                let case = (own, window, dropout);
                let backend = Backend::default().with_simd(level);
                let (fused, composed) = (
                    own_scores_attention(dtype, true, shape, case, backend),
                    own_scores_attention(dtype, false, shape, case, backend),
                );
                for (i, what) in names.iter().enumerate() {
                    let top = composed[i].iter().fold(0.0f64, |m, v| m.max(v.abs()));
                    assert!(top > 1e-3, "{what}: all zero");
                    let err = fused[i]
                        .iter()
                        .zip(&composed[i])
                        .map(|(a, c)| (a - c).abs())
                        .fold(0.0, f64::max)
                        / top;
                    assert!(
                        err < tol,
                        "{dtype:?} {level:?} {shape:?} {case:?}: {what} differs by {err:e}"
                    );
                }
            }
        }
    }
}

#[test]
fn polar_scores_match_their_composition_forward_and_backward() {
    // Softplus magnitudes both sides of 0, keys' phase offsets across [-2 pi, 0], padded
    // keys, tables shared by the batch or per row, a window, a causal mask, dropout; every instruction set
    // level, f32 and f64. Relative to the largest value of each result.
    let polar = |rows| Own::Polar { rows };
    assert_own_scores_match(
        [(candle::DType::F64, 1e-12), (candle::DType::F32, 2e-5)],
        &[
            ((2, 9, 2, 4), polar(1), Window::ALL, false),
            ((3, 13, 3, 8), polar(3), Window::new(Some(4), false), false),
            ((2, 33, 2, 16), polar(2), Window::ALL, true),
            ((2, 17, 2, 8), polar(2), Window::new(None, true), true),
            ((3, 13, 3, 8), polar(1), Window::new(Some(3), true), false),
        ],
        ["output", "d(qkv)", "d(offsets)"],
    );
}

#[test]
fn transported_scores_match_their_composition_forward_and_backward() {
    // Strengths across [0, 2) (reflections, projections at 1) and across [0, 1.2); padded
    // keys, a window, a causal mask, dropout; lengths that are not powers of two (the composition pads its
    // inverses); every instruction set level, f32 and f64; heads 4 and 8 wide (the walk both
    // ways), 16 and 20 (the walk forward, blocks backward) and 32 (blocks both ways, over two
    // whole blocks and a short one). Relative to the largest value of each result: the
    // output, d(qkv), and the gradients of w and beta, in that order.
    let carried = |top, scale| Own::Transport { top, scale };
    assert_own_scores_match(
        [(candle::DType::F64, 1e-11), (candle::DType::F32, 5e-5)],
        &[
            ((2, 9, 2, 4), carried(2.0, 1.0), Window::ALL, false),
            (
                (3, 13, 3, 8),
                carried(1.2, 0.35),
                Window::new(Some(4), false),
                false,
            ),
            ((2, 33, 2, 16), carried(2.0, 0.25), Window::ALL, true),
            (
                (1, 40, 2, 20),
                carried(1.9, 0.2),
                Window::new(Some(7), false),
                true,
            ),
            (
                (2, 37, 2, 32),
                carried(2.0, 0.18),
                Window::new(Some(9), false),
                true,
            ),
            (
                (2, 13, 2, 8),
                carried(1.5, 0.35),
                Window::new(None, true),
                false,
            ),
            (
                (2, 37, 2, 32),
                carried(2.0, 0.18),
                Window::new(None, true),
                true,
            ),
        ],
        ["output", "d(qkv)", "d(w; beta)"],
    );
}

#[test]
fn gate_counted_scores_match_their_composition_forward_and_backward() {
    // Padded keys; counts past the tables' last row (npos 3 over up to 33 tokens) and below
    // it; scores large enough that some gates round to exactly 1 (integer counts, the
    // clamp's edge); a window, a causal mask, dropout; every instruction set level, f32 and f64. Relative
    // to the largest value of each result.
    let counted = |npos, scale| Own::Counts { npos, scale };
    assert_own_scores_match(
        [(candle::DType::F64, 1e-12), (candle::DType::F32, 2e-5)],
        &[
            ((2, 9, 2, 4), counted(3, 1.0), Window::ALL, false),
            (
                (3, 13, 3, 8),
                counted(9, 0.35),
                Window::new(Some(4), false),
                false,
            ),
            ((2, 33, 2, 16), counted(16, 4.0), Window::ALL, true),
            (
                (2, 33, 2, 16),
                counted(3, 0.2),
                Window::new(Some(7), false),
                true,
            ),
            (
                (2, 33, 2, 16),
                counted(5, 0.3),
                Window::new(None, true),
                true,
            ),
            (
                (3, 13, 3, 8),
                counted(9, 0.35),
                Window::new(Some(4), true),
                false,
            ),
        ],
        ["output", "d(qkv)", "d(left; right)"],
    );
}
