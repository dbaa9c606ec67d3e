//! The block options ModernBERT needs, as options of poslab's own encoder: no biases in linear
//! layers and LayerNorms, a GeGLU feed-forward, no attention norm in layer 0.

use candle::{DType, Device, Tensor};
use poslab::{Activation, Encoder, ModelConfig, NormPlacement, ParamStore, PositionalConfig};

use crate::common::*;

fn modern(positional: PositionalConfig) -> ModelConfig {
    ModelConfig {
        bias: false,
        activation: Activation::Geglu,
        first_attn_norm: false,
        ..tiny_dropout_config(positional, NormPlacement::Pre)
    }
}

#[test]
fn every_variable_gets_a_gradient_and_the_count_is_exact() {
    for positional in all_schemes() {
        let config = modern(positional.clone());
        let what = positional.name();
        let grads = training_gradients(&config, &Device::Cpu, what);
        let names: Vec<&str> = grads.iter().map(|(n, _, _)| n.as_str()).collect();
        // The blocks' biases are gone; a scheme's own (the concat projection, FIRE's MLP, FoX's
        // gates) are the scheme's.
        let block_bias = |n: &&str| {
            n.ends_with("norm.bias")
                || [".attn.q.", ".attn.k.", ".attn.v.", ".attn.o.", ".ffn."]
                    .iter()
                    .any(|p| n.contains(p) && n.ends_with(".bias"))
        };
        assert!(!names.iter().any(block_bias), "{what}: {names:?}");
        assert!(!names.contains(&"layers.0.attn_norm.weight"), "{what}");
        assert!(names.contains(&"layers.1.attn_norm.weight"), "{what}");
        let store = ParamStore::new(3);
        Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
        assert_eq!(
            config.param_count(),
            store.num_params() as u128,
            "{what}: the count without biases and with GeGLU's wider up projection"
        );
    }
}

#[test]
fn geglu_is_gelu_of_the_input_half_times_the_gate_half() {
    // The up projection's first ffn_dim outputs are the input, the next ffn_dim the gate
    // (transformers' `input, gate = Wi(x).chunk(2, dim=-1)`), checked on the activation alone.
    let x = Tensor::new(&[[0.5f64, -1.0, 2.0, 3.0]], &Device::Cpu).unwrap();
    let y = values(
        &Activation::Geglu
            .apply(&x, poslab::nn::Backend::default())
            .unwrap(),
    );
    let gelu = |v: f64| 0.5 * v * (1.0 + libm_erf(v / std::f64::consts::SQRT_2));
    let expected = [gelu(0.5) * 2.0, gelu(-1.0) * 3.0];
    for (a, b) in y.iter().zip(expected) {
        assert!((a - b).abs() < 1e-12, "{y:?} against {expected:?}");
    }
}

/// erf by its series (|x| <= 3 here): 60 terms are exact to f64 rounding.
fn libm_erf(x: f64) -> f64 {
    let mut sum = 0.0;
    let mut term = x;
    for n in 0..60 {
        sum += term / (2 * n + 1) as f64;
        term *= -x * x / (n + 1) as f64;
    }
    2.0 / std::f64::consts::PI.sqrt() * sum
}

#[test]
fn no_first_norm_under_post_norm_is_refused() {
    let config = ModelConfig {
        first_attn_norm: false,
        ..tiny_config(
            PositionalConfig::None(Default::default()),
            NormPlacement::Post,
        )
    };
    assert_error_mentions(
        config.validate(),
        &["first_attn_norm = false", "norm = \"pre\""],
    );
    let toml = "vocab_size = 50\nd_model = 16\nn_heads = 2\nn_layers = 2\nffn_dim = 24\n\
                max_len = 12\nbias = false\nactivation = \"geglu\"\nfirst_attn_norm = false\n\
                [positional]\nkind = \"rope\"\n";
    let config = ModelConfig::from_toml_str(toml).unwrap();
    assert_eq!(
        (config.bias, config.activation, config.first_attn_norm),
        (false, Activation::Geglu, false)
    );
    assert_eq!(
        ModelConfig::from_toml_str(&config.to_toml()).unwrap(),
        config
    );
}
