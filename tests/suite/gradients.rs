//! Training must really train: after one backward every trainable variable has a finite,
//! non-zero gradient, and central finite differences agree with the analytic gradient (f64).
//!
//! This guards against candle-nn 0.11's fused softmax, LayerNorm and RoPE, which have no backward
//! pass: with them, most variables would silently get no gradient at all.

use candle::{DType, Device, Tensor, Var};
use poslab::{Encoder, NormPlacement, ParamStore};

use crate::common::*;

/// A fixed random projection of the hidden states at real positions: a scalar that depends on
/// every output coordinate.
fn projection(dims: &[usize], seed: u64) -> Tensor {
    use rand::Rng as _;
    let mut rng = poslab::rng::stream(seed, "loss projection");
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn loss(encoder: &Encoder, ids: &Tensor, mask: &Tensor, r: &Tensor, train: bool) -> Tensor {
    let hidden = encoder.forward_t(ids, mask, train).unwrap();
    let real = mask.to_dtype(hidden.dtype()).unwrap().unsqueeze(2).unwrap();
    hidden
        .mul(&r.to_dtype(hidden.dtype()).unwrap())
        .unwrap()
        .broadcast_mul(&real)
        .unwrap()
        .sum_all()
        .unwrap()
}

fn scalar(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

/// Asserts every variable of `store` got a finite gradient with some non-zero entry; returns
/// the gradients as flat f64 vectors.
fn check_all_gradients(
    store: &ParamStore,
    grads: &candle::backprop::GradStore,
    what: &str,
) -> Vec<(String, Var, Vec<f64>)> {
    let vars = store.vars();
    assert!(!vars.is_empty());
    vars.into_iter()
        .map(|(name, var)| {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{what}: `{name}` received no gradient"));
            let g: Vec<f64> = g
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!(
                g.iter().all(|v| v.is_finite()),
                "{what}: `{name}` has a non-finite gradient"
            );
            let max = g.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            assert!(max > 1e-12, "{what}: `{name}` has an all-zero gradient");
            (name, var, g)
        })
        .collect()
}

fn set_element(var: &Var, flat: &[f64], index: usize, value: f64) {
    let mut v = flat.to_vec();
    v[index] = value;
    var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap())
        .unwrap();
}

#[test]
fn every_variable_gets_a_gradient_and_finite_differences_agree() {
    const H: f64 = 1e-5;
    let mut worst = 0.0f64;
    let mut compared = 0;
    for name in encoder_fixture_names() {
        let fx = load_encoder_fixture(&name);
        let (encoder, store) = fx.encoder(DType::F64);
        let r = projection(fx.expected.dims(), 1);
        let l = loss(&encoder, &fx.input_ids, &fx.attention_mask, &r, false);
        let grads = l.backward().unwrap();
        for (pname, var, g) in check_all_gradients(&store, &grads, &name) {
            let w: Vec<f64> = var.flatten_all().unwrap().to_vec1().unwrap();
            // The element with the largest gradient, and one more spread by the name's hash.
            let largest = (0..g.len())
                .max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
                .unwrap();
            let other = (poslab::rng::stable_hash(pname.as_bytes()) as usize) % g.len();
            for index in [largest, other] {
                set_element(&var, &w, index, w[index] + H);
                let plus = scalar(&loss(
                    &encoder,
                    &fx.input_ids,
                    &fx.attention_mask,
                    &r,
                    false,
                ));
                set_element(&var, &w, index, w[index] - H);
                let minus = scalar(&loss(
                    &encoder,
                    &fx.input_ids,
                    &fx.attention_mask,
                    &r,
                    false,
                ));
                set_element(&var, &w, index, w[index]);
                let numeric = (plus - minus) / (2.0 * H);
                let err = (numeric - g[index]).abs() / g[index].abs().max(1.0);
                worst = worst.max(err);
                compared += 1;
                assert!(
                    err < 1e-7,
                    "{name} `{pname}`[{index}]: analytic {} vs finite difference {numeric} \
                     (relative error {err:e})",
                    g[index]
                );
            }
        }
    }
    eprintln!("finite differences: {compared} elements, worst relative error {worst:.2e}");
}

#[test]
fn gradients_flow_in_training_mode_with_dropout_for_every_scheme() {
    for positional in all_schemes() {
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            let what = format!("{} {norm:?}", positional.name());
            let mut config = tiny_config(positional.clone(), norm);
            config.dropout = 0.1;
            config.attention_dropout = 0.1;
            let store = ParamStore::new(3);
            let encoder =
                Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
            encoder.set_dropout_seed(5);
            let (ids, mask) = padded_batch(4, 12, 40);
            let r = projection(&[4, 12, 16], 2);
            let l = loss(&encoder, &ids, &mask, &r, true);
            let grads = l.backward().unwrap();
            let checked = check_all_gradients(&store, &grads, &what);
            // Per layer: q, k, v, o, up, down weights; q, v, o, up, down biases; two norms of
            // two; a key bias under rope only.
            let per_layer = 6 + 5 + 4 + usize::from(positional.name() == "rope");
            let expected = 1
                + per_layer * config.n_layers
                + usize::from(norm == NormPlacement::Pre) * 2
                + usize::from(positional.name() == "learned")
                + 2 * usize::from(matches!(
                    &positional,
                    poslab::PositionalConfig::SinusoidalConcat(o) if o.project
                ));
            assert_eq!(checked.len(), expected, "{what}: trainable variables");
        }
    }
}
