//! The pieces of the 2026 schemes against `reference_2026_schemes.py`'s tables
//! (`schemes_2026.safetensors`): stick-breaking's weights and remainders, GRAPE-M's rotation and
//! scores, GRAPE-AP's edges and bias; and what the specification checks of them.

use candle::{DType, Device, Tensor};
use poslab::positional::stick_breaking_weights;
use poslab::{Encoder, NormPlacement, ParamStore, PositionalConfig};

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

#[test]
fn stick_breakings_fused_kernel_matches_its_composition_forward_and_backward() {
    // Logits uniform in (-4, 4), 4 heads (two of each direction), 2 sequences of 23 tokens, the second
    // padded after 15; both masks, with and without the query's own key: the weights, the
    // remainders and d(Σ weights · r + Σ remainders)/dz of the fused kernel (the default
    // backend on the CPU) against the composition (the reference backend), in f64 to 1e-12
    // and f32 to 2e-6. The kernel fails these without the G term of its backward.
    use poslab::nn::Backend;
    let (b, h, t) = (2, 4, 23);
    let mask = Tensor::from_vec(
        (0..b * t)
            .map(|n| f64::from(u8::from(n < t || n % t < 15)))
            .collect::<Vec<_>>(),
        (b, t),
        &Device::Cpu,
    )
    .unwrap();
    let z0 = (projection(&[b, h, t, t], 5) * 4.0).unwrap();
    let r = projection(z0.dims(), 9);
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-6)] {
        let r = r.to_dtype(dtype).unwrap();
        for causal in [false, true] {
            for current in [false, true] {
                let ok = allowed(&mask, causal, dtype);
                let run = |backend: Backend| {
                    let z = candle::Var::from_tensor(&z0.to_dtype(dtype).unwrap()).unwrap();
                    let (w, rem) =
                        stick_breaking_weights(z.as_tensor(), &ok, current, backend).unwrap();
                    let loss =
                        (w.mul(&r).unwrap().sum_all().unwrap() + rem.sum_all().unwrap()).unwrap();
                    let g = loss.backward().unwrap().get(z.as_tensor()).unwrap().clone();
                    (values(&w), values(&rem), values(&g))
                };
                let (fused, reference) = (run(Backend::default()), run(Backend::reference()));
                let case = format!("{dtype:?} causal {causal} current {current}");
                for (what, a, b) in [
                    ("weights", &fused.0, &reference.0),
                    ("remainders", &fused.1, &reference.1),
                    ("gradient", &fused.2, &reference.2),
                ] {
                    let err = max_abs(a, b);
                    assert!(err < tol, "{case} {what}: {err:e}");
                }
                assert!(fused.2.iter().map(|v| v.abs()).fold(0.0, f64::max) > 1e-2);
            }
        }
    }
}

#[test]
fn grape_m_rotations_and_scores_match_the_reference() {
    // Two heads of width 8, positions 0..6 and uneven up to 30, a learned spectrum far from
    // RoPE's: f32 at 1e-5, f64 at 1e-6 (the stored tables are f32: their rounding).
    use poslab::positional::{grape_rotate, grape_tables, GrapeM};
    let fx = load_fixture("schemes_2026.safetensors");
    let positions = poslab::Positions::from_tensor(&fx["grape_m.positions"]).unwrap();
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-6)] {
        let module = GrapeM {
            log_freq_scale: 16.0,
            log_freqs: vec![Some(fx["grape_m.log_freq"].to_dtype(dtype).unwrap())],
        };
        let freqs = module.frequencies(0).unwrap().unwrap();
        let err = max_abs(&values(&freqs), &values(&fx["grape_m.freq"]));
        assert!(err < tol * 1e-2, "{dtype:?} frequencies: {err:e}");
        let (cos, neg_sin) = grape_tables(&positions, &freqs).unwrap();
        let q = grape_rotate(&fx["grape_m.q"].to_dtype(dtype).unwrap(), &cos, &neg_sin).unwrap();
        let k = grape_rotate(&fx["grape_m.k"].to_dtype(dtype).unwrap(), &cos, &neg_sin).unwrap();
        for (name, got) in [("q_rot", &q), ("k_rot", &k)] {
            let err = max_abs(&values(got), &values(&fx[&format!("grape_m.{name}")]));
            assert!(err < tol, "{dtype:?} {name}: {err:e}");
        }
        let logits = (q.matmul(&k.t().unwrap()).unwrap() / 8f64.sqrt()).unwrap();
        let err = max_abs(&values(&logits), &values(&fx["grape_m.logits"]));
        assert!(err < tol, "{dtype:?} logits: {err:e}");
        // RoPE's own direction misses: the planes turn the other way.
        let (cos, sin) = (cos.clone(), neg_sin.neg().unwrap());
        let wrong = grape_rotate(&fx["grape_m.q"].to_dtype(dtype).unwrap(), &cos, &sin).unwrap();
        assert!(max_abs(&values(&wrong), &values(&fx["grape_m.q_rot"])) > 1e-2);
    }
}

/// A tiny f64 encoder of `positional` from seed 5, and its store.
fn seeded(positional: PositionalConfig) -> (Encoder, ParamStore) {
    let store = ParamStore::new(5);
    let config = tiny_config(positional, NormPlacement::Pre);
    let encoder = Encoder::new(&config, store.var_builder(DType::F64, &Device::Cpu)).unwrap();
    (encoder, store)
}

#[test]
fn an_untrained_grape_m_is_rope_at_negated_positions() {
    // GRAPE-M starts at RoPE's spectrum and turns the other way, so with the same weights it is
    // RoPE (half pairing) at positions C - p, to 1e-12 in f64; at p itself it is not.
    use poslab::positional::{GrapeMOptions, RopeOptions};
    use poslab::RopePairing;
    let (grape, store) = seeded(PositionalConfig::GrapeM(GrapeMOptions {
        base: 500.0,
        ..Default::default()
    }));
    let (rope, rope_store) = seeded(PositionalConfig::Rope(RopeOptions {
        base: 500.0,
        pairing: RopePairing::Half,
        ..Default::default()
    }));
    let shared: std::collections::HashMap<String, Tensor> = store
        .params()
        .into_iter()
        .filter(|(name, _)| !name.contains("grape"))
        .collect();
    assert_eq!(shared.len(), rope_store.params().len());
    rope_store
        .assign(&shared, std::path::Path::new("grape_m"))
        .unwrap();
    let rows = [
        vec![0usize, 1, 3, 4, 8, 9, 12, 20],
        vec![2, 3, 4, 5, 6, 7, 8, 9],
    ];
    let negated: Vec<Vec<usize>> = rows
        .iter()
        .map(|r| r.iter().map(|p| 20 - p).collect())
        .collect();
    let at = |p: &[Vec<usize>]| poslab::Positions::from_rows(p).unwrap();
    let (ids, mask) = padded_batch(2, 8, 40);
    let hidden =
        |e: &Encoder, p: &[Vec<usize>]| e.forward_with(&ids, &mask, &at(p), false).unwrap();
    let g = hidden(&grape, &rows);
    let err = max_abs_diff_real(&g, &hidden(&rope, &negated), &mask);
    assert!(err < 1e-12, "GRAPE-M at init vs RoPE at C - p: {err:e}");
    let err = max_abs_diff_real(&g, &hidden(&rope, &rows), &mask);
    assert!(err > 1e-3, "RoPE at p matches too: {err:e}");
}

#[test]
fn grape_m_frequencies_get_the_gradient_finite_differences_give() {
    // f64: d(Σ hidden · r)/d log_freq of layer 0 by central differences, every component.
    let (encoder, store) = seeded(PositionalConfig::GrapeM(Default::default()));
    let (ids, mask) = padded_batch(2, 9, 40);
    let name = "layers.0.attn.grape.log_freq";
    let var = store.get(name).unwrap();
    let r = projection(&[2, 9, 16], 3);
    let loss = || -> Tensor {
        let h = encoder.forward_t(&ids, &mask, false).unwrap();
        h.mul(&r.to_dtype(DType::F64).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
    };
    let g = values(loss().backward().unwrap().get(var.as_tensor()).unwrap());
    let start = values(var.as_tensor());
    assert_eq!(g.len(), 4);
    for c in 0..g.len() {
        let at = |delta: f64| {
            let mut v = start.clone();
            v[c] += delta;
            var.set(&Tensor::from_vec(v, 4, &Device::Cpu).unwrap())
                .unwrap();
            loss().to_scalar::<f64>().unwrap()
        };
        let numeric = (at(1e-5) - at(-1e-5)) / 2e-5;
        var.set(&Tensor::from_vec(start.clone(), 4, &Device::Cpu).unwrap())
            .unwrap();
        assert!(
            (numeric - g[c]).abs() < 1e-6 * g[c].abs().max(1e-2),
            "log_freq[{c}]: analytic {} vs {numeric}",
            g[c]
        );
    }
    assert!(g.iter().any(|v| v.abs() > 1e-4), "{g:?}");
}

#[test]
fn grape_a_edges_and_bias_match_the_reference() {
    // Four heads of p_dim 4 on d 16, positions 0..7 and uneven up to 21, both sides: f32 at
    // 1e-5, f64 at 1e-6 (the stored tables are f32: their rounding).
    use poslab::nn::Linear;
    use poslab::positional::{grape_a_bias, grape_a_edges, GrapeAFrame, GrapeALayer};
    let fx = load_fixture("schemes_2026.safetensors");
    let positions = poslab::Positions::from_tensor(&fx["grape_a.positions"]).unwrap();
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-6)] {
        let linear = |key: &str| Linear::new(fx[key].to_dtype(dtype).unwrap(), None);
        let layer = GrapeALayer {
            left: linear("grape_a.p.weight"),
            right: Some(linear("grape_a.p_right.weight")),
        };
        let frame = GrapeAFrame::new(&positions, 4, 4, dtype, &Device::Cpu).unwrap();
        let x = fx["grape_a.x"].to_dtype(dtype).unwrap();
        let backend = poslab::nn::Backend::default();
        for (key, p) in [
            ("psi", &layer.left),
            ("psi_right", layer.right.as_ref().unwrap()),
        ] {
            let psi = grape_a_edges(&x, p, &frame, 4, backend).unwrap();
            let err = max_abs(&values(&psi), &values(&fx[&format!("grape_a.{key}")]));
            assert!(err < tol, "{dtype:?} {key}: {err:e}");
            assert!(
                values(&psi).iter().all(|v| *v <= 0.0),
                "{key}: an edge above 0"
            );
        }
        let bias = grape_a_bias(&x, &layer, &frame, 4, backend).unwrap();
        let want = values(&fx["grape_a.bias"]);
        let err = max_abs(&values(&bias), &want);
        assert!(err < tol, "{dtype:?} bias: {err:e}");
        // Without the right projection the bias is the left side alone: the keys before the
        // query as the reference's, 0 after it.
        let left_only = GrapeALayer {
            right: None,
            ..layer.clone()
        };
        let b = values(&grape_a_bias(&x, &left_only, &frame, 4, backend).unwrap());
        for (n, (got, want)) in b.iter().zip(&want).enumerate() {
            let (i, j) = (n / 8 % 8, n % 8);
            let want = if j <= i { *want } else { 0.0 };
            assert!((got - want).abs() < tol, "{dtype:?} left only ({i}, {j})");
        }
    }
}

#[test]
fn trained_grape_and_dape_models_are_analysed_with_what_they_learned() {
    // 20 steps of each, encoder and causal, then `analyze --run`: GRAPE-M's learned
    // frequencies, GRAPE-AP's projections, and under DAPE the scheme's own bias with the MLP's
    // notes beside it.
    let cases = [
        ("kind = \"grape_m\"", false, "learned frequencies per plane"),
        ("kind = \"grape_m\"", true, "learned frequencies per plane"),
        (
            "kind = \"grape_a\"\np_dim = 4",
            false,
            "edge projection norms",
        ),
        (
            "kind = \"grape_a\"\np_dim = 4",
            true,
            "edge projection norm ",
        ),
        (
            "kind = \"alibi\"\nadaptive = { width = 8 }",
            false,
            "DAPE MLP weight norms",
        ),
        (
            "kind = \"fire\"\nthreshold = 10\nadaptive = {}",
            true,
            "DAPE MLP weight norms",
        ),
    ];
    for (positional, causal, needle) in cases {
        let root = tempfile::tempdir().unwrap();
        let (stdout, _) = crate::causal::trained_and_analysed(positional, causal, root.path());
        assert!(
            stdout.contains(needle),
            "{positional} causal {causal}: {needle:?} not in {stdout}"
        );
    }
}

#[test]
fn dape_terms_match_the_reference() {
    // Four heads, width 8, the logits and ALiBi's bias at uneven positions up to 100: b + MLP
    // of the reference (poslab's scores less the logits), whose output bias c2 poslab leaves
    // out (the softmax cancels it), to 1e-5 in f32 and 1e-6 in f64 (the stored tables are f32).
    use poslab::nn::Linear;
    use poslab::positional::{Alibi, DapeMlp};
    let fx = load_fixture("schemes_2026.safetensors");
    let positions = poslab::Positions::from_tensor(&fx["dape.positions"]).unwrap();
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-6)] {
        let t = |key: &str| fx[key].to_dtype(dtype).unwrap();
        let bias = Alibi::new(4).bias(&positions, dtype, &Device::Cpu).unwrap();
        let err = max_abs(&values(&bias), &values(&fx["dape.alibi_bias"]));
        assert!(err < tol, "{dtype:?} ALiBi's bias: {err:e}");
        let mlp = DapeMlp {
            mlp1: Linear::new(t("dape.mlp1.weight"), Some(t("dape.mlp1.bias"))),
            mlp2: Linear::new(t("dape.mlp2.weight"), None),
        };
        let scores = t("dape.scores");
        let term = (mlp.scores(&scores, &bias, Default::default()).unwrap() - &scores).unwrap();
        let c2 = t("dape.mlp2.bias").reshape((1, 4, 1, 1)).unwrap();
        let with_c2 = term.broadcast_add(&c2).unwrap();
        let err = max_abs(&values(&with_c2), &values(&fx["dape.bias_out"]));
        assert!(err < tol, "{dtype:?} b + MLP([s, b]): {err:e}");
        // With a zero output layer the term is the scheme's bias: DAPE off.
        let off = DapeMlp {
            mlp2: Linear::new(mlp.mlp2.weight().zeros_like().unwrap(), None),
            ..mlp.clone()
        };
        let plain = off.scores(&scores, &bias, Default::default()).unwrap();
        let b = scores.broadcast_add(&bias).unwrap();
        assert_eq!(values(&plain), values(&b));
        assert!(max_abs(&values(&term), &values(&b)) > 1e-2);
    }
}
