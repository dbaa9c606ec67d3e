//! Positions per layer (`[layers]`): a pattern of global, local (sliding-window) and
//! position-free layers, and a rotation's base per kind of layer.

use candle::{DType, Device, Tensor};
use poslab::nn::Kernels;
use poslab::{
    Encoder, LayerKind, LayerPlan, ModelConfig, NormPlacement, ParamStore, PositionalConfig,
    RopeBases, RopeOptions,
};

use crate::common::*;

fn plan(pattern: &[LayerKind], window: Option<usize>) -> LayerPlan {
    LayerPlan {
        local_window: window,
        ..LayerPlan::new(pattern.to_vec())
    }
}

/// The hidden states of a seeded f32 encoder on a padded `(3, t)` batch.
fn hidden(config: &ModelConfig, kernels: Kernels, t: usize) -> Tensor {
    let (encoder, _) = Encoder::seeded(config, 5, &Device::Cpu).unwrap();
    let encoder = encoder.with_backend(on(kernels));
    let (ids, mask) = padded_batch(3, t, config.vocab_size as u32);
    encoder.forward_t(&ids, &mask, false).unwrap()
}

fn schemes() -> Vec<PositionalConfig> {
    [
        "rope", "prope", "alibi", "t5", "kerple", "fire", "untied", "fox", "none",
    ]
    .into_iter()
    .map(|name| {
        all_schemes()
            .into_iter()
            .find(|p| p.name() == name)
            .unwrap_or_else(|| panic!("{name} is one of all_schemes()"))
    })
    .collect()
}

#[test]
fn global_layers_and_a_window_wider_than_the_input_are_the_plain_encoder_bit_for_bit() {
    let t = 11;
    for positional in schemes() {
        let plain = tiny_config(positional.clone(), NormPlacement::Pre);
        let mut plans = vec![
            plan(&[LayerKind::Global], None),
            // |i - j| <= 10 holds every key of 11 tokens.
            plan(&[LayerKind::Local], Some(2 * (t - 1))),
            plan(&[LayerKind::Global, LayerKind::Local], Some(64)),
        ];
        if positional.with_base(10_000.0).is_some() {
            let mut p = plan(&[LayerKind::Global, LayerKind::Local], Some(64));
            p.rope_base = Some(RopeBases {
                global: Some(10_000.0),
                local: Some(10_000.0),
            });
            plans.push(p);
        }
        for kernels in [Kernels::Reference, Kernels::Ops, Kernels::Layer] {
            let expected = bits(&hidden(&plain, kernels, t));
            for p in &plans {
                let config = plain.clone().with_layer_plan(p.clone());
                assert_eq!(
                    bits(&hidden(&config, kernels, t)),
                    expected,
                    "{} {} {p:?}",
                    positional.name(),
                    kernels.name()
                );
            }
        }
    }
}

#[test]
fn no_positions_in_every_layer_is_the_none_encoder_bit_for_bit() {
    // Position-free layers drop the scheme and its parameters (RoPE's key bias, KERPLE's r1
    // and r2, FoX's gates): what is left draws the same weights by name as `none`.
    let none = tiny_config(
        PositionalConfig::None(Default::default()),
        NormPlacement::Pre,
    );
    for kernels in [Kernels::Reference, Kernels::Layer] {
        let expected = bits(&hidden(&none, kernels, 9));
        for positional in schemes() {
            let config = tiny_config(positional.clone(), NormPlacement::Pre)
                .with_layer_plan(plan(&[LayerKind::None], None));
            if ["t5", "fire", "untied"].contains(&positional.name()) {
                // Parameters shared by the layers would never be used: refused.
                assert_error_mentions(
                    config.validate(),
                    &["no layer has positions", "kind = \"none\""],
                );
                continue;
            }
            let (_, store) = Encoder::seeded(&config, 5, &Device::Cpu).unwrap();
            let (_, none_store) = Encoder::seeded(&none, 5, &Device::Cpu).unwrap();
            assert_eq!(
                store.num_params(),
                none_store.num_params(),
                "{}",
                positional.name()
            );
            assert_eq!(
                bits(&hidden(&config, kernels, 9)),
                expected,
                "{} {}",
                positional.name(),
                kernels.name()
            );
        }
    }
}

#[test]
fn a_local_layer_sees_only_keys_within_half_its_window() {
    // One layer, window 4: the output at position i depends on tokens i-2 ..= i+2 only.
    let t = 10;
    for positional in schemes() {
        let config = ModelConfig {
            n_layers: 1,
            ..tiny_config(positional.clone(), NormPlacement::Pre)
        }
        .with_layer_plan(plan(&[LayerKind::Local], Some(4)));
        for kernels in [Kernels::Reference, Kernels::Layer] {
            let run = |last: u32| {
                let (encoder, _) = Encoder::seeded(&config, 5, &Device::Cpu).unwrap();
                let encoder = encoder.with_backend(on(kernels));
                let ids: Vec<u32> = (0..t as u32)
                    .map(|i| if i == 9 { last } else { i + 1 })
                    .collect();
                let ids = Tensor::new(ids.as_slice(), &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap();
                let mask = Tensor::ones((1, t), DType::U32, &Device::Cpu).unwrap();
                encoder
                    .forward_t(&ids, &mask, false)
                    .unwrap()
                    .squeeze(0)
                    .unwrap()
            };
            let (a, b) = (run(20), run(30));
            for i in 0..t {
                let moved = max_abs_diff(&a.get(i).unwrap(), &b.get(i).unwrap());
                let what = format!(
                    "{} {} position {i}: {moved:e}",
                    positional.name(),
                    kernels.name()
                );
                if i + 2 < 9 {
                    assert_eq!(moved, 0.0, "{what}");
                } else {
                    assert!(moved > 1e-4, "{what}");
                }
            }
        }
    }
}

#[test]
fn a_local_base_changes_local_layers_only() {
    let rope = PositionalConfig::Rope(RopeOptions::default());
    let base = |local: f64| {
        let mut p = plan(&[LayerKind::Global, LayerKind::Local], Some(64));
        p.rope_base = Some(RopeBases {
            global: None,
            local: Some(local),
        });
        tiny_config(rope.clone(), NormPlacement::Pre).with_layer_plan(p)
    };
    let same = hidden(&base(10_000.0), Kernels::Layer, 12);
    let other = hidden(&base(50.0), Kernels::Layer, 12);
    let moved = max_abs_diff(&same, &other);
    assert!(
        moved > 1e-3,
        "a local base of 50 moved the outputs by {moved:e} only"
    );
    // Every layer global: the local base is never read.
    let global = |local: f64| {
        let mut c = base(local);
        c.layers.as_mut().unwrap().pattern = vec![LayerKind::Global];
        c.layers.as_mut().unwrap().local_window = None;
        c.layers.as_mut().unwrap().rope_base = Some(RopeBases {
            global: Some(10_000.0),
            local: None,
        });
        c
    };
    assert_eq!(
        bits(&hidden(&global(50.0), Kernels::Layer, 12)),
        bits(&hidden(
            &tiny_config(rope.clone(), NormPlacement::Pre),
            Kernels::Layer,
            12
        ))
    );
}

#[test]
fn every_variable_of_a_mixed_stack_gets_a_gradient() {
    for positional in schemes() {
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            let config = ModelConfig {
                n_layers: 3,
                ..tiny_dropout_config(positional.clone(), norm)
            }
            .with_layer_plan(plan(
                &[LayerKind::Global, LayerKind::Local, LayerKind::None],
                Some(4),
            ));
            let what = format!("{} {norm:?}", positional.name());
            let grads = training_gradients(&config, &Device::Cpu, &what);
            // Layer 2 has no positions: no key bias, no KERPLE or FoX parameters of its own.
            for (name, _, _) in &grads {
                assert!(
                    !(name.starts_with("layers.2.attn.k.bias")
                        || name.starts_with("layers.2.attn.kerple")
                        || name.starts_with("layers.2.attn.fox")),
                    "{what}: `{name}` exists in a layer without positions"
                );
            }
            // The scheme's parameters are counted as built.
            let store = ParamStore::new(3);
            Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
            let scheme: usize = store
                .vars()
                .iter()
                .filter(|(n, _)| {
                    n.contains("kerple")
                        || n.contains("attn.fox")
                        || n.starts_with("rel_bias")
                        || n.starts_with("fire")
                        || n.starts_with("pos_")
                })
                .map(|(_, v)| v.elem_count())
                .sum();
            assert_eq!(
                scheme as u128,
                positional.param_count(&config.scheme_shape()),
                "{what}: the scheme's parameter count"
            );
        }
    }
}

#[test]
fn plans_that_cannot_work_are_refused_naming_the_layer_or_key() {
    let model = |positional: &str, layers: &str| {
        ModelConfig::from_toml_str(&format!(
            "vocab_size = 50\nd_model = 16\nn_heads = 2\nn_layers = 4\nffn_dim = 24\nmax_len = 12\n\
             [positional]\n{positional}\n[layers]\n{layers}\n"
        ))
    };
    let rope = "kind = \"rope\"";
    let refused: [(&str, &str, &[&str]); 11] = [
        (rope, "pattern = []", &["at least one entry"]),
        (
            rope,
            "pattern = [\"global\", \"sideways\"]",
            &["sideways", "global"],
        ),
        (
            rope,
            "pattern = [\"local\"]\nlocal_window = 0",
            &["local_window = 0", "even and at least 2"],
        ),
        (
            rope,
            "pattern = [\"local\"]\nlocal_window = 1",
            &["local_window = 1", "only itself"],
        ),
        (
            rope,
            "pattern = [\"global\", \"local\"]",
            &["layer 1 is `local`", "local_window"],
        ),
        (
            "kind = \"sinusoidal_add\"",
            "pattern = [\"global\", \"global\", \"global\", \"none\"]",
            &["layer 3 is `none`", "acts on the input", "residual stream"],
        ),
        (
            "kind = \"learned\"",
            "pattern = [\"local_none\"]\nlocal_window = 4",
            &["layer 0", "acts on the input"],
        ),
        (
            "kind = \"alibi\"",
            "pattern = [\"global\"]\nrope_base = { global = 160000.0 }",
            &["rope_base", "`alibi` has no rotation base"],
        ),
        (
            rope,
            "pattern = [\"global\"]\nrope_base = { global = 0.5 }",
            &["rope_base.global = 0.5"],
        ),
        // A base for a kind of layer none of which rotates (issue 49, 12).
        (
            rope,
            "pattern = [\"global\", \"local_none\"]\nlocal_window = 4\nrope_base = { local = 5000.0 }",
            &["rope_base.local", "every local layer is `local_none`"],
        ),
        (
            rope,
            "pattern = [\"local\", \"none\"]\nlocal_window = 4\nrope_base = { global = 5000.0 }",
            &["rope_base.global", "no layer is `global`"],
        ),
    ];
    for (positional, layers, needles) in refused {
        assert_error_mentions(model(positional, layers), needles);
    }
    // What is accepted reads back the same.
    let config = model(
        rope,
        "pattern = [\"global\", \"local\", \"local\", \"none\"]\nlocal_window = 8\n\
         rope_base = { global = 160000, local = 10000 }",
    )
    .unwrap();
    assert_eq!(
        ModelConfig::from_toml_str(&config.to_toml()).unwrap(),
        config
    );
    let plan = config.layers.as_ref().unwrap();
    assert_eq!(
        (0..6).map(|i| plan.kind(i)).collect::<Vec<_>>(),
        [
            LayerKind::Global,
            LayerKind::Local,
            LayerKind::Local,
            LayerKind::None,
            LayerKind::Global,
            LayerKind::Local
        ]
    );
}

/// The library's plan and config answer an empty pattern without panicking (issue 49, 16): every
/// layer global, as the plain stack; the config refuses the plan, naming the fix.
#[test]
fn an_empty_pattern_is_answered_not_a_panic() {
    let empty = LayerPlan::new(vec![]);
    assert_eq!(empty.kind(0), LayerKind::Global);
    assert_eq!(empty.kind(7), LayerKind::Global);
    let config = tiny_config(
        PositionalConfig::Rope(Default::default()),
        NormPlacement::Pre,
    )
    .with_layer_plan(empty);
    assert_eq!(config.layer_spec(0), poslab::layers::LayerSpec::GLOBAL);
    let err = config.validate().unwrap_err().to_string();
    assert!(
        err.contains("pattern = []") && err.contains("at least one entry"),
        "{err}"
    );
}

#[test]
fn the_rotation_split_is_zero_in_position_free_layers_and_labels_each_layer() {
    let config = ModelConfig {
        n_layers: 3,
        ..tiny_config(
            PositionalConfig::Rope(RopeOptions::default()),
            NormPlacement::Pre,
        )
    }
    .with_layer_plan(plan(
        &[LayerKind::Global, LayerKind::Local, LayerKind::None],
        Some(4),
    ));
    let (encoder, _) = Encoder::seeded(&config, 5, &Device::Cpu).unwrap();
    let (ids, mask) = padded_batch(3, 10, 40);
    let terms = poslab::analysis::terms::rotation_terms(&encoder, &ids, &mask).unwrap();
    assert_eq!(terms.len(), 3 * config.n_heads);
    for t in &terms {
        let expected = ["global", "local, keys within 2", "no positions"][t.layer];
        assert_eq!(t.plan, expected);
        match t.layer {
            2 => assert_eq!((t.rotation, t.share), (0.0, 0.0), "{t:?}"),
            _ => assert!(t.share > 0.01 && t.share < 1.0, "{t:?}"),
        }
        assert!(t.content > 0.0, "{t:?}");
    }
}
