//! Training must really train: after one backward every trainable variable has a finite,
//! non-zero gradient, and central finite differences agree with the analytic gradient (f64).
//!
//! This guards against candle-nn 0.11's fused softmax, LayerNorm and RoPE, which have no backward
//! pass: with them, most variables would silently get no gradient at all.

use candle::{DType, Device, Tensor, Var};
use poslab::NormPlacement;

use crate::common::*;

fn scalar(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
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
        let l = loss_at(
            &encoder,
            &fx.input_ids,
            &fx.attention_mask,
            &fx.positions,
            &r,
            false,
        );
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
                let plus = scalar(&loss_at(
                    &encoder,
                    &fx.input_ids,
                    &fx.attention_mask,
                    &fx.positions,
                    &r,
                    false,
                ));
                set_element(&var, &w, index, w[index] - H);
                let minus = scalar(&loss_at(
                    &encoder,
                    &fx.input_ids,
                    &fx.attention_mask,
                    &fx.positions,
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
            let config = tiny_dropout_config(positional.clone(), norm);
            let checked = training_gradients(&config, &Device::Cpu, &what);
            // Per layer: q, k, v, o, up, down weights; q, v, o, up, down biases; two norms of
            // two; a key bias where q and k are read (rope, prope, pope, cope, path,
            // stick_breaking, grape_m) only;
            // KERPLE's r1 and r2; FoX's gate weight and bias; PoPE's delta; CoPE's two tables;
            // PaTH's w, conv, beta weight and beta bias.
            let name = positional.name();
            let rotated = positional.reads_keys();
            let adaptive = positional.scheme().label().contains("adaptive");
            let per_layer = 6
                + 5
                + 4
                + usize::from(rotated)
                + 2 * usize::from(name == "kerple")
                + 2 * usize::from(name == "fox")
                + usize::from(name == "pope")
                + 2 * usize::from(name == "cope")
                + match &positional {
                    poslab::PositionalConfig::Path(o) => 3 + usize::from(o.conv_size > 0),
                    // The remainder's vector.
                    poslab::PositionalConfig::StickBreaking(o) => {
                        usize::from(o.remainder == poslab::positional::Remainder::Bias)
                    }
                    // GRAPE-M's log-frequencies; GRAPE-AP's left and right projections.
                    poslab::PositionalConfig::GrapeM(_) => 1,
                    poslab::PositionalConfig::GrapeA(_) => 2,
                    _ => 0,
                }
                // DAPE's MLP: two weights and the hidden bias; FIRE's output bias beside it.
                + 3 * usize::from(adaptive);
            let expected = 1
                + per_layer * config.n_layers
                + usize::from(norm == NormPlacement::Pre) * 2
                + usize::from(positional.has_learned_table())
                + 2 * usize::from(matches!(
                    &positional,
                    poslab::PositionalConfig::SinusoidalConcat(o) if o.project
                ))
                + usize::from(name == "t5")
                + 2 * usize::from(name == "untied")
                // FIRE's MLP (two weights, the hidden bias), c and l_multiplier.
                + 5 * usize::from(name == "fire")
                + usize::from(name == "fire" && adaptive);
            assert_eq!(checked.len(), expected, "{what}: trainable variables");
        }
    }
}

#[test]
fn relu_feed_forward_layers_train_every_variable() {
    // ReLU zeroes half its inputs' gradients; every weight still gets one, through the units
    // that are on.
    for positional in [
        poslab::PositionalConfig::Learned(Default::default()),
        poslab::PositionalConfig::T5(Default::default()),
    ] {
        let mut config = tiny_dropout_config(positional.clone(), NormPlacement::Post);
        config.activation = poslab::nn::Activation::Relu;
        let checked = training_gradients(
            &config,
            &Device::Cpu,
            &format!("relu {}", positional.name()),
        );
        let names: Vec<&str> = checked.iter().map(|(n, _, _)| n.as_str()).collect();
        assert!(
            names.iter().any(|n| n.contains("ffn.up.weight")),
            "{names:?}"
        );
    }
}

#[test]
fn embedding_extras_train_every_variable() {
    // The BERT-family extras: a token-type table (row 0 is what every token reads) and an
    // embedding LayerNorm; both get gradients, and so does everything below them.
    let mut config = tiny_dropout_config(
        poslab::PositionalConfig::Learned(Default::default()),
        NormPlacement::Post,
    );
    config.embeddings = poslab::config::EmbeddingExtras {
        token_types: 2,
        norm: true,
        first_position: 2,
    };
    let checked = training_gradients(&config, &Device::Cpu, "embedding extras");
    let names: Vec<&str> = checked.iter().map(|(n, _, _)| n.as_str()).collect();
    for expected in [
        "type_emb.weight",
        "embed_norm.weight",
        "embed_norm.bias",
        "pos_emb.weight",
    ] {
        assert!(
            names.contains(&expected),
            "{expected} not checked: {names:?}"
        );
    }
}
