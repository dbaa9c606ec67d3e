//! The pieces of the 2026 schemes against `reference_2026_schemes.py`'s tables
//! (`schemes_2026.safetensors`): stick-breaking's weights and remainders.

use candle::{DType, Device, Tensor};
use poslab::positional::stick_breaking_weights;

use crate::common::*;

/// `allowed` `(b, 1, t, t)` from a key mask `(b, t)`: real keys, at or before the query when
/// `causal`.
fn allowed(mask: &Tensor, causal: bool, dtype: DType) -> Tensor {
    let (b, t) = mask.dims2().unwrap();
    let keys: Vec<f64> = values(mask);
    let v: Vec<f64> = (0..b * t * t)
        .map(|n| {
            let (row, i, j) = (n / (t * t), n / t % t, n % t);
            let seen = keys[row * t + j] > 0.0 && (!causal || j <= i);
            f64::from(u8::from(seen))
        })
        .collect();
    Tensor::from_vec(v, (b, 1, t, t), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn max_abs(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn stick_breaking_weights_and_remainders_match_the_reference() {
    // Four heads (two of each direction), a padded row; both masks, with and without the
    // query's own key; f32 at 1e-5 and f64 at 1e-7 (the stored logits are f32).
    let fx = load_fixture("schemes_2026.safetensors");
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-7)] {
        let z = fx["sb.z"].to_dtype(dtype).unwrap();
        for causal in [false, true] {
            for current in [false, true] {
                let name = format!(
                    "sb.{}.{}",
                    if causal { "causal" } else { "bidirectional" },
                    if current { "current" } else { "nocurrent" }
                );
                let ok = allowed(&fx["sb.mask"], causal, dtype);
                let backend = poslab::nn::Backend::default();
                let (w, rem) = stick_breaking_weights(&z, &ok, current, backend).unwrap();
                let err = max_abs(&values(&w), &values(&fx[&format!("{name}.weights")]));
                assert!(err < tol, "{name} {dtype:?} weights: {err:e}");
                let err = max_abs(&values(&rem), &values(&fx[&format!("{name}.rem")]));
                assert!(err < tol, "{name} {dtype:?} remainders: {err:e}");
                // Each row's weights and remainder make the whole stick.
                let total = (w.sum(3).unwrap() + &rem).unwrap();
                assert!(
                    values(&total).iter().all(|v| (v - 1.0).abs() < tol),
                    "{name}"
                );
            }
        }
        // Left first and right first differ: the heads' directions are told apart.
        let ok = allowed(&fx["sb.mask"], false, dtype);
        let swapped = z.index_select(&Tensor::new(&[1u32, 0, 3, 2], &Device::Cpu).unwrap(), 1);
        let (a, _) =
            stick_breaking_weights(&z, &ok, false, poslab::nn::Backend::default()).unwrap();
        let (b, _) =
            stick_breaking_weights(&swapped.unwrap(), &ok, false, Default::default()).unwrap();
        assert!(max_abs(&values(&a), &values(&b)) > 1e-2);
    }
}

#[test]
fn stick_breaking_gives_every_logit_a_gradient_that_finite_differences_confirm() {
    // f64, the bidirectional form with the query's own key: d(Σ weights · r)/dz by central
    // differences at the largest analytic entry and one more.
    let fx = load_fixture("schemes_2026.safetensors");
    let z = candle::Var::from_tensor(&fx["sb.z"].to_dtype(DType::F64).unwrap()).unwrap();
    let ok = allowed(&fx["sb.mask"], false, DType::F64);
    let r = projection(z.dims(), 4);
    let loss = |z: &Tensor| -> f64 {
        let (w, rem) = stick_breaking_weights(z, &ok, true, Default::default()).unwrap();
        let l = (w.mul(&r).unwrap().sum_all().unwrap() + rem.sum_all().unwrap()).unwrap();
        l.to_scalar::<f64>().unwrap()
    };
    let (w, rem) = stick_breaking_weights(z.as_tensor(), &ok, true, Default::default()).unwrap();
    let l = (w.mul(&r).unwrap().sum_all().unwrap() + rem.sum_all().unwrap()).unwrap();
    let g = values(l.backward().unwrap().get(z.as_tensor()).unwrap());
    let flat = values(z.as_tensor());
    let largest = (0..g.len())
        .max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
        .unwrap();
    for index in [largest, 37] {
        let at = |delta: f64| {
            let mut v = flat.clone();
            v[index] += delta;
            loss(&Tensor::from_vec(v, z.dims(), &Device::Cpu).unwrap())
        };
        let numeric = (at(1e-6) - at(-1e-6)) / 2e-6;
        assert!(
            (numeric - g[index]).abs() < 1e-6 * g[index].abs().max(1.0),
            "z[{index}]: analytic {} vs {numeric}",
            g[index]
        );
    }
    assert!(g[largest].abs() > 1e-3);
}
