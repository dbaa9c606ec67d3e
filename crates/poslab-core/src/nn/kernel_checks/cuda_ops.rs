//! The cuda ops kernels held to their reference compositions.
use crate::kernels::cuda_ops::*;
use candle::{DType, Device, Tensor, Var, D};

fn random(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    use rand::Rng as _;
    let mut rng = crate::rng::stream(seed, "gpu ops test");
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Forward and every input's gradient of `fused` and `reference` on the same inputs,
/// under a loss that weighs each output element differently.
fn compare(
    inputs: &[Tensor],
    fused: &dyn Fn(&[Tensor]) -> Tensor,
    reference: &dyn Fn(&[Tensor]) -> Tensor,
    tol: f64,
    what: &str,
) {
    let run = |f: &dyn Fn(&[Tensor]) -> Tensor| {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(t).unwrap())
            .collect();
        let xs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&xs);
        let weights = random(y.dims(), 99, y.dtype());
        let grads = (&y * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g: Vec<Tensor> = vars
            .iter()
            .map(|v| grads.get(v.as_tensor()).expect("a gradient").clone())
            .collect();
        (y, g)
    };
    let (y1, g1) = run(fused);
    // Every input here is a variable, whose gradient candle does not detach: the op's
    // backward must hand back gradients with no graph (see the module's note).
    for (i, g) in g1.iter().enumerate() {
        assert!(!g.track_op(), "{what}: gradient {i} carries a graph");
    }
    let (y2, g2) = run(reference);
    assert_eq!(y1.dims(), y2.dims(), "{what}");
    let e = max_diff(&y1, &y2);
    assert!(e < tol, "{what}: forward differs by {e:e}");
    for (i, (a, b)) in g1.iter().zip(&g2).enumerate() {
        assert_eq!(a.dims(), b.dims(), "{what}: gradient {i}");
        let e = max_diff(a, b);
        assert!(e < tol, "{what}: gradient {i} differs by {e:e}");
    }
}

#[test]
fn softmax_matches_the_composition_forward_and_backward() {
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-6)] {
        // Masked keys (a large negative bias) included, as attention sends them.
        let x = random(&[2, 3, 5, 7], 1, dtype);
        let mask = Tensor::from_vec(
            vec![0.0, 0.0, 0.0, 0.0, -1e9, -1e9, 0.0],
            (1, 1, 1, 7),
            &Device::Cpu,
        )
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
        let masked = x.broadcast_add(&mask).unwrap();
        compare(
            &[masked],
            &|t| softmax_last_dim(&t[0]).unwrap(),
            &|t| crate::nn::softmax_last_dim(&t[0]).unwrap(),
            tol,
            &format!("softmax {dtype:?}"),
        );
    }
    // A transposed (non-contiguous) input is made contiguous first.
    let x = random(&[4, 6], 2, DType::F64);
    let a = softmax_last_dim(&x.t().unwrap()).unwrap();
    let b = crate::nn::softmax_last_dim(&x.t().unwrap()).unwrap();
    assert!(max_diff(&a, &b) < 1e-12);
}

#[test]
fn gelu_matches_the_exact_composition_forward_and_backward() {
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-6)] {
        compare(
            &[random(&[3, 11], 3, dtype)],
            &|t| gelu(&t[0]).unwrap(),
            &|t| {
                let x = &t[0];
                let cdf = ((x * std::f64::consts::FRAC_1_SQRT_2)
                    .unwrap()
                    .erf()
                    .unwrap()
                    + 1.0)
                    .unwrap()
                    * 0.5;
                (x * cdf.unwrap()).unwrap()
            },
            tol,
            &format!("gelu {dtype:?}"),
        );
    }
}

#[test]
fn rope_matches_the_composition_in_both_pairings_forward_and_backward() {
    for interleaved in [false, true] {
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-6)] {
            // Tables per sequence (r = b = 2), and shared by the batch (r = 1).
            for r in [2, 1] {
                let x = random(&[2, 3, 5, 8], 10, dtype);
                let angles = random(&[r, 5, 4], 11, DType::F64);
                // Full-width tables in the pairing's layout, scaled (YaRN's factor).
                let full = |f: fn(&Tensor) -> candle::Result<Tensor>| {
                    let v = (f(&angles).unwrap() * 1.2).unwrap();
                    let v = if interleaved {
                        Tensor::stack(&[&v, &v], D::Minus1)
                            .unwrap()
                            .reshape((r, 5, 8))
                            .unwrap()
                    } else {
                        Tensor::cat(&[&v, &v], D::Minus1).unwrap()
                    };
                    v.to_dtype(dtype).unwrap()
                };
                let (cos, sin) = (full(Tensor::cos), full(Tensor::sin));
                let (hc, hs) = (
                    half_table(&cos, interleaved).unwrap(),
                    half_table(&sin, interleaved).unwrap(),
                );
                compare(
                    &[x],
                    &|t| rope(&t[0], &hc, &hs, interleaved).unwrap(),
                    &|t| crate::nn::rope_rotate_reference(&t[0], &cos, &sin, interleaved).unwrap(),
                    tol,
                    &format!("rope interleaved={interleaved} {dtype:?} r={r}"),
                );
            }
        }
    }
    let x = random(&[2, 3, 5, 8], 12, DType::F32);
    let e = rope(
        &x,
        &random(&[3, 5, 4], 13, DType::F32),
        &random(&[3, 5, 4], 13, DType::F32),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("[2, 3, 5, 8]") && e.contains("(1 or 2, 5, 4)"),
        "{e}"
    );
}

#[test]
fn layer_norm_matches_the_composition_forward_and_backward() {
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
        let x = random(&[2, 5, 16], 4, dtype);
        // Rows far from zero mean too, where a one-pass variance would lose digits.
        let x = x.broadcast_add(&random(&[2, 5, 1], 5, dtype)).unwrap();
        let w = random(&[16], 6, dtype);
        let b = random(&[16], 7, dtype);
        let eps = 1e-5;
        compare(
            &[x, w, b],
            &|t| layer_norm(&t[0], &t[1], &t[2], eps).unwrap(),
            &|t| {
                let (x, w, b) = (&t[0], &t[1], &t[2]);
                let centered = x
                    .broadcast_sub(&x.mean_keepdim(D::Minus1).unwrap())
                    .unwrap();
                let var = centered.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
                let inv = (var + eps).unwrap().sqrt().unwrap().recip().unwrap();
                centered
                    .broadcast_mul(&inv)
                    .unwrap()
                    .broadcast_mul(w)
                    .unwrap()
                    .broadcast_add(b)
                    .unwrap()
            },
            tol,
            &format!("layer_norm {dtype:?}"),
        );
    }
    let x = random(&[2, 4], 8, DType::F32);
    let e = layer_norm(
        &x,
        &random(&[3], 9, DType::F32),
        &random(&[4], 9, DType::F32),
        1e-5,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("[2, 4]") && e.contains("[4]") && e.contains("[3]"),
        "{e}"
    );
}
