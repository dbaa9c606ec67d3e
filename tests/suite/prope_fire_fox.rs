//! p-RoPE, FIRE and FoX against `reference_recent_schemes.py`'s building blocks, and their
//! properties and refusals. (Whole encoders: `reference.rs`, which checks every
//! `encoder_*.safetensors`; gradients, fused kernels and padding: the suites over
//! `all_schemes()`.)

use std::collections::HashMap;

use candle::{DType, Device, Tensor};
use poslab::positional::{
    BiasBatch, Fire, FireOptions, FoxGates, PositionalModule, PropeOptions, Rope, RopeOptions,
};
use poslab::{Encoder, NormPlacement, ParamStore, PositionalConfig, Positions, RopePairing};

use crate::common::*;

/// Building blocks are checked to this absolute error (the fixtures are f32).
const BLOCK_TOL: f64 = 1e-6;

fn max_abs(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn prope_frequencies_match_the_reference() {
    let fx = load_fixture("recent_schemes.safetensors");
    let meta = poslab::params::read_metadata(fixture_path("recent_schemes.safetensors")).unwrap();
    let cases: HashMap<String, serde_json::Value> =
        serde_json::from_str(&meta["prope_cases"]).unwrap();
    assert_eq!(cases.len(), 5);
    for (name, case) in &cases {
        let head_dim = case["head_dim"].as_u64().unwrap() as usize;
        let options = PropeOptions {
            base: case["base"].as_f64().unwrap(),
            keep: case["keep"].as_f64().unwrap(),
            ..Default::default()
        };
        let ours = options.frequencies(head_dim);
        let reference = values(&fx[&format!("prope.{name}.inv_freq")]);
        assert_eq!(ours.len(), reference.len(), "{name}");
        for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
            // Exact zeros where a pair is removed, 1e-9 relative elsewhere.
            assert!(
                (a - b).abs() <= 1e-9 * b.abs(),
                "{name} pair {i}: {a} vs {b}"
            );
        }
        let kept = reference.iter().filter(|&&w| w != 0.0).count();
        assert_eq!(options.kept_pairs(head_dim), kept, "{name}");
    }
}

#[test]
fn prope_rotations_match_the_reference_in_both_pairings() {
    let fx = load_fixture("recent_schemes.safetensors");
    let x = fx["prope.input"].to_dtype(DType::F64).unwrap(); // (2, 3, 40, 16)
    let positions = Positions::from_tensor(&fx["prope.positions"]).unwrap();
    let mut checked = 0;
    for keep in [0.75, 0.25, 1.0] {
        for pairing in [RopePairing::Interleaved, RopePairing::Half] {
            let options = PropeOptions {
                keep,
                pairing,
                ..Default::default()
            };
            let rope = Rope::with_frequencies(
                options.frequencies(16),
                pairing,
                options.base,
                8,
                DType::F64,
                &Device::Cpu,
            )
            .unwrap();
            let ours = rope
                .rotary(&positions)
                .unwrap()
                .apply(&x, poslab::nn::Backend::default())
                .unwrap();
            let key = format!("prope.hd16.keep{keep:?}.{pairing}");
            let err = max_abs(&values(&ours), &values(&fx[&key]));
            assert!(err < BLOCK_TOL, "{key}: {err:e}");
            checked += 1;
        }
    }
    assert_eq!(checked, 6);
}

/// A FIRE module holding the fixture's weights, in f64.
fn fixture_fire(fx: &HashMap<String, Tensor>, threshold: f64) -> Fire {
    let store = ParamStore::new(0);
    let options = FireOptions::threshold(threshold);
    let fire = Fire::new(
        &options,
        4,
        store.var_builder(DType::F64, &Device::Cpu).pp("fire"),
    )
    .unwrap();
    let weights: HashMap<String, Tensor> = fx
        .iter()
        .filter(|(k, _)| {
            k.starts_with("fire.") && !k.contains("threshold") && !k.contains("positions")
        })
        // The output bias is left out (see `fire_output_bias_is_inert`).
        .filter(|(k, _)| !matches!(k.as_str(), "fire.mask" | "fire.mlp2.bias"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    assert_eq!(weights.len(), 5, "{:?}", weights.keys());
    store
        .assign(&weights, std::path::Path::new("recent_schemes"))
        .unwrap();
    fire
}

#[test]
fn fire_inputs_and_biases_match_the_reference_for_padded_uneven_positions() {
    let fx = load_fixture("recent_schemes.safetensors");
    let positions = Positions::from_tensor(&fx["fire.positions"]).unwrap();
    let mask = &fx["fire.mask"];
    for threshold in [512.0, 8.0] {
        let fire = fixture_fire(&fx, threshold);
        let batch = BiasBatch {
            positions: &positions,
            mask: Some(mask),
            dtype: DType::F64,
            device: &Device::Cpu,
            backend: poslab::nn::Backend::default(),
        };
        let key = format!("fire.threshold{}", threshold as u32);
        let inputs = values(&fire.inputs(&batch).unwrap());
        let err = max_abs(&inputs, &values(&fx[&format!("{key}.inputs")]));
        assert!(err < BLOCK_TOL, "{key} inputs: {err:e}");
        // The reference's bias less its output bias b2 (per head), which poslab leaves out.
        let b2 = values(&fx["fire.mlp2.bias"]);
        let reference = fx[&format!("{key}.bias")].to_dtype(DType::F64).unwrap();
        let b2 = Tensor::from_vec(b2, (1, 4, 1, 1), &Device::Cpu).unwrap();
        let reference = reference.broadcast_sub(&b2).unwrap();
        let bias = values(&fire.bias(&batch).unwrap());
        let err = max_abs(&bias, &values(&reference));
        assert!(err < BLOCK_TOL, "{key} bias: {err:e}");
    }
}

#[test]
fn fire_output_bias_is_inert() {
    // The reference fixtures hold a non-zero b2, and the encoders match them without it
    // (`reference::every_encoder_fixture_reproduces_expected_hidden_states`): b2 adds a constant
    // to every score of a head, which softmax cancels.
    for name in [
        "encoder_fire_pre.safetensors",
        "encoder_fire_t8_post.safetensors",
    ] {
        let b2 = values(&load_fixture(name)["fire.mlp2.bias"]);
        assert!(
            b2.iter().map(|v| v.abs()).sum::<f64>() > 1e-2,
            "{name}: {b2:?}"
        );
        let fx = load_encoder_fixture(name);
        let (encoder, store) = fx.encoder(DType::F64);
        assert!(store.get("fire.mlp2.bias").is_none());
        let err = max_abs_diff_real(&fx.hidden(&encoder), &fx.expected, &fx.attention_mask);
        assert!(err < 1e-4, "{name}: {err:e}");
    }
}

#[test]
fn fox_bias_matches_the_reference() {
    let fx = load_fixture("recent_schemes.safetensors");
    let f64 = |k: &str| fx[k].to_dtype(DType::F64).unwrap();
    let gates = FoxGates::from_tensors(f64("fox.weight"), f64("fox.bias")).unwrap();
    let bias = gates
        .bias(&f64("fox.x"), poslab::nn::Backend::default())
        .unwrap();
    assert_eq!(bias.dims(), &[2, 4, 7, 7]);
    let err = max_abs(&values(&bias), &values(&fx["fox.out"]));
    assert!(err < BLOCK_TOL, "fox bias: {err:e}");
}

fn build(positional: PositionalConfig, seed: u64) -> Encoder {
    let store = ParamStore::new(seed);
    Encoder::new(
        &tiny_config(positional, NormPlacement::Pre),
        store.var_builder(DType::F64, &Device::Cpu),
    )
    .unwrap()
}

#[test]
fn prope_with_every_frequency_kept_is_rope_bit_for_bit() {
    let (ids, mask) = padded_batch(3, 11, 40);
    let positions = Positions::from_rows(&[
        vec![0, 2, 5, 9, 10, 30, 31, 40, 41, 50, 60],
        vec![3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
        vec![100, 101, 150, 151, 152, 200, 201, 300, 301, 302, 400],
    ])
    .unwrap();
    for pairing in [RopePairing::Interleaved, RopePairing::Half] {
        for dtype in [DType::F32, DType::F64] {
            let run = |positional: PositionalConfig| {
                let store = ParamStore::new(4);
                let encoder = Encoder::new(
                    &tiny_config(positional, NormPlacement::Pre),
                    store.var_builder(dtype, &Device::Cpu),
                )
                .unwrap();
                // Exact: f32 values widen to f64 without rounding.
                values(
                    &encoder
                        .forward_with(&ids, &mask, &positions, false)
                        .unwrap(),
                )
            };
            let rope = run(PositionalConfig::Rope(RopeOptions {
                pairing,
                ..Default::default()
            }));
            let prope = run(PositionalConfig::Prope(PropeOptions {
                pairing,
                keep: 1.0,
                ..Default::default()
            }));
            assert_eq!(rope, prope, "{pairing} {dtype:?}");
        }
    }
}

#[test]
fn prope_and_rope_fraction_at_the_same_share_are_different_schemes() {
    // Both rotate half of the head's coordinates: p-RoPE the fastest half of the whole head's
    // frequencies, `fraction` the first half of the coordinates with frequencies recomputed over
    // them. Their frequencies differ, so do their scores.
    let prope = PropeOptions::keep(0.5);
    let fraction = RopeOptions {
        fraction: 0.5,
        ..Default::default()
    };
    let head_dim = 8;
    let kept: Vec<f64> = prope
        .frequencies(head_dim)
        .into_iter()
        .filter(|&w| w != 0.0)
        .collect();
    let (partial, _) =
        poslab::positional::rope_frequencies(fraction.rotary_dim(head_dim), fraction.base, None, 0);
    assert_eq!(kept.len(), partial.len());
    assert_eq!(kept[0], partial[0]); // both keep the fastest, 1 radian per position
    assert!(
        (kept[1] - partial[1]).abs() > 0.05,
        "{kept:?} vs {partial:?}"
    );
    let (ids, mask) = padded_batch(2, 12, 40);
    let a = build(PositionalConfig::Prope(prope), 3);
    let b = build(PositionalConfig::Rope(fraction), 3);
    let diff = max_abs_diff_real(
        &a.forward_t(&ids, &mask, false).unwrap(),
        &b.forward_t(&ids, &mask, false).unwrap(),
        &mask,
    );
    assert!(
        diff > 1e-3,
        "p-RoPE and fraction gave the same outputs ({diff:e})"
    );
}

#[test]
fn fire_inputs_stay_within_one_for_any_span_and_threshold() {
    let fire = {
        let store = ParamStore::new(0);
        Fire::new(
            &FireOptions::threshold(4.0),
            2,
            store.var_builder(DType::F64, &Device::Cpu).pp("fire"),
        )
        .unwrap()
    };
    let mut rng = poslab::rng::stream(5, "fire spans");
    use rand::Rng as _;
    for _ in 0..40 {
        let t = rng.random_range(1..12);
        let mut row: Vec<usize> = (0..t).map(|_| rng.random_range(0..5000)).collect();
        row.sort();
        let positions = Positions::from_rows(&[row]).unwrap();
        let x = values(
            &fire
                .inputs(&BiasBatch {
                    positions: &positions,
                    mask: None,
                    dtype: DType::F64,
                    device: &Device::Cpu,
                    backend: poslab::nn::Backend::default(),
                })
                .unwrap(),
        );
        assert!(
            x.iter().all(|v| v.abs() <= 1.0),
            "an input left [-1, 1]: {x:?}"
        );
    }
}

#[test]
fn fox_bias_is_zero_on_the_diagonal_and_never_positive() {
    let encoder = build(PositionalConfig::Fox(Default::default()), 8);
    let PositionalModule::ScoreBias(module) = encoder.positional() else {
        panic!("fox is a score bias");
    };
    let x = Tensor::randn(0.0, 3.0, (2, 9, 16), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    // The layer hands attention the gates' running sums; their two-sided differences are the
    // bias.
    let sums = module
        .input_bias(1, &x, poslab::nn::Backend::default())
        .unwrap()
        .unwrap();
    assert!(matches!(sums, poslab::nn::LayerBias::SidedSums(_)));
    let bias = poslab::nn::AttentionBias::from(&sums)
        .table(poslab::nn::Backend::default())
        .unwrap();
    let (b, h, t, _) = bias.dims4().unwrap();
    let v = values(&bias);
    for n in 0..b * h {
        for i in 0..t {
            assert_eq!(v[(n * t + i) * t + i], 0.0);
            for j in 0..t {
                assert!(v[(n * t + i) * t + j] <= 0.0);
            }
        }
    }
    // And it forgets: farther keys decay more (each gate is below 1).
    assert!(v[t - 1] < v[1]);
}

#[test]
fn the_new_schemes_refuse_bad_options_with_the_fix() {
    let model = |positional: &str, extra: &str| {
        poslab::ModelConfig::from_toml_str(&format!(
            "vocab_size = 20\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 8\nmax_len = \
             16\n{extra}[positional]\n{positional}"
        ))
    };
    for (positional, extra, needles) in [
        (
            "kind = \"prope\"\nkeep = 0.0",
            "",
            &["keep = 0", "(0, 1]"][..],
        ),
        (
            "kind = \"prope\"\nkeep = 1.5",
            "",
            &["keep = 1.5", "(0, 1]"],
        ),
        ("kind = \"prope\"\nkeep = nan", "", &["keep = NaN"]),
        // A value of the wrong type names its key, not only the table (issue 49).
        (
            "kind = \"prope\"\nkeep = \"all\"",
            "",
            &["key `keep`: invalid type: string \"all\", expected f64"],
        ),
        (
            "kind = \"fire\"\nwidth = -1",
            "",
            &["key `width`: invalid value: integer `-1`"],
        ),
        // Heads of 8 have 4 pairs: 0.2 of them is none.
        (
            "kind = \"prope\"\nkeep = 0.2",
            "",
            &["keeps none", "at least 0.25", "kind = \"none\""],
        ),
        (
            "kind = \"prope\"\nfraction = 0.5",
            "",
            &["`fraction` is rope's partial rotation", "drop fraction"],
        ),
        (
            "kind = \"prope\"\n[positional.scaling]\nkind = \"linear\"\nfactor = 2.0",
            "",
            &["scalings stretch", "drop scaling"],
        ),
        (
            "kind = \"fire\"\nthreshold = 0",
            "",
            &["threshold = 0", "training length"],
        ),
        ("kind = \"fire\"\nthreshold = -3", "", &["threshold = -3"]),
        // Beyond f32's range it would train to a NaN at step 0 (issue 49, 13).
        (
            "kind = \"fire\"\nthreshold = 1e300",
            "",
            &["threshold = 1e300", "up to 16777216"],
        ),
        (
            "kind = \"fire\"\nwidth = 0",
            "",
            &["width = 0", "between 1 and"],
        ),
        (
            "kind = \"fox\"",
            "random_positions = 64\n",
            &[
                "random_positions = 64",
                "reads no position ids",
                "remove random_positions",
            ],
        ),
        ("kind = \"fox\"\nslope = 1", "", &["slope"]),
    ] {
        let err = model(positional, extra).unwrap_err().to_string();
        for needle in needles {
            assert!(err.contains(needle), "{positional}: {err}");
        }
    }
    // The accepted edges.
    model("kind = \"prope\"\nkeep = 0.25", "").unwrap();
    model("kind = \"fire\"\nthreshold = 0.5\nwidth = 1", "").unwrap();
    model("kind = \"fire\"", "random_positions = 64\n").unwrap();
}

#[test]
fn fire_and_fox_encoders_are_unmoved_by_a_shift_and_fire_by_its_threshold_below_the_span() {
    let (ids, mask) = padded_batch(3, 10, 40);
    for positional in [
        PositionalConfig::Fire(FireOptions::threshold(2.0)),
        PositionalConfig::Fire(Default::default()),
        PositionalConfig::Fox(Default::default()),
    ] {
        let encoder = build(positional.clone(), 12);
        let rows = vec![
            vec![0, 1, 2, 5, 9, 17, 40, 41, 60, 99],
            vec![7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
            vec![3, 30, 31, 32, 100, 101, 102, 103, 200, 201],
        ];
        let positions = Positions::from_rows(&rows).unwrap();
        let a = encoder
            .forward_with(&ids, &mask, &positions, false)
            .unwrap();
        let b = encoder
            .forward_with(&ids, &mask, &positions.shifted(777).unwrap(), false)
            .unwrap();
        let diff = max_abs_diff_real(&a, &b, &mask);
        assert!(
            diff < 1e-9,
            "{}: a shift moved outputs by {diff:e}",
            positional.name()
        );
    }
}

#[test]
fn fire_l_multiplier_learns_where_l_is_the_larger() {
    // L = |l_multiplier| x threshold normalises the inputs where it exceeds the span: a
    // threshold of 512 over spans of at most 11 (the training regime, threshold = training
    // length), then l_multiplier has a gradient; a threshold of 2 under every span, then
    // max(L, span) = span and the gradient is exactly zero.
    let (ids, mask) = padded_batch(3, 12, 40);
    for (threshold, active) in [(512.0, true), (2.0, false)] {
        let store = ParamStore::new(2);
        let config = tiny_config(
            PositionalConfig::Fire(FireOptions::threshold(threshold)),
            NormPlacement::Pre,
        );
        let encoder = Encoder::new(&config, store.var_builder(DType::F64, &Device::Cpu)).unwrap();
        let r = projection(&[3, 12, config.d_model], 4);
        let grads = loss(&encoder, &ids, &mask, &r, false).backward().unwrap();
        for name in [
            "fire.l_multiplier",
            "fire.c",
            "fire.mlp1.weight",
            "fire.mlp2.weight",
        ] {
            let g = values(grads.get(store.get(name).unwrap().as_tensor()).unwrap());
            let max = g.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            assert!(g.iter().all(|v| v.is_finite()), "{name}");
            if name == "fire.l_multiplier" && !active {
                assert_eq!(max, 0.0, "threshold {threshold}: {name}");
            } else {
                assert!(max > 1e-9, "threshold {threshold}: {name} {g:?}");
            }
        }
    }
}
