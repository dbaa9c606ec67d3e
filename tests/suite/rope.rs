//! RoPE as it is used now: partial rotation and frequency scaling (linear, NTK, dynamic NTK,
//! YaRN), against the float64 reference (`schemes.safetensors`: frequencies to 1e-9 relative,
//! attention factors to 1e-12, rotations to 1e-5 at positions up to 312), and their properties.

use candle::{DType, Device, Tensor};
use poslab::nn::Kernels;
use poslab::positional::{rope_frequencies, rotary_dim, Factor, Rope, RopeScaling};
use poslab::{ModelConfig, NormPlacement, PositionalConfig, Positions, RopeOptions, RopePairing};

use crate::common::*;

/// The reference's cases: name, fraction, scaling (numbers), seq_len, base.
fn cases() -> Vec<(String, f64, Option<RopeScaling>, usize, f64)> {
    let meta = poslab::params::read_metadata(fixture_path("schemes.safetensors")).unwrap();
    let cases: serde_json::Value = serde_json::from_str(&meta["rope_cases"]).unwrap();
    let mut out: Vec<_> = cases
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, c)| {
            let scaling = match &c["scaling"] {
                serde_json::Value::Null => None,
                s => Some(serde_json::from_value::<RopeScaling>(s.clone()).unwrap()),
            };
            (
                name.clone(),
                c["fraction"].as_f64().unwrap(),
                scaling,
                c["seq_len"].as_u64().unwrap() as usize,
                c["base"].as_f64().unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn rope_frequencies_and_attention_factors_match_reference() {
    let fx = load_fixture("schemes.safetensors");
    let cases = cases();
    assert_eq!(
        cases.len(),
        8,
        "full, two partials, linear, ntk, dynamic, two yarns"
    );
    for (name, fraction, scaling, seq_len, base) in &cases {
        let rd = rotary_dim(16, *fraction);
        let (inv, factor) = rope_frequencies(rd, *base, scaling.as_ref(), *seq_len);
        let expected: Vec<f64> = fx[&format!("rope.{name}.inv_freq")].to_vec1().unwrap();
        assert_eq!(inv.len(), expected.len(), "{name}");
        for (i, (a, b)) in inv.iter().zip(&expected).enumerate() {
            let rel = (a - b).abs() / b.abs();
            assert!(rel <= 1e-9, "{name} w_{i}: {a} vs {b} (relative {rel:e})");
        }
        let af: Vec<f64> = fx[&format!("rope.{name}.attention_factor")]
            .to_vec1()
            .unwrap();
        assert!(
            (factor - af[0]).abs() <= 1e-12,
            "{name}: attention factor {factor} vs {}",
            af[0]
        );
    }
}

#[test]
fn scaled_and_partial_rotations_match_reference_at_long_positions() {
    let fx = load_fixture("schemes.safetensors");
    let input = &fx["rope.input"]; // (2, 3, 40, 16)
    let positions = Positions::from_tensor(&fx["rope.long_positions"]).unwrap();
    assert_eq!(positions.max(), 312);
    let mut checked = 0;
    for (name, fraction, scaling, _, base) in cases() {
        for pairing in [RopePairing::Interleaved, RopePairing::Half] {
            let expected = &fx[&format!("rope.{name}.{pairing}")];
            let options = RopeOptions {
                base,
                pairing,
                fraction,
                scaling: scaling.clone(),
            };
            for dtype in [DType::F32, DType::F64] {
                // Tables start at 8 rows and grow; dynamic NTK computes them per batch.
                let rope = Rope::new(&options, 16, 8, dtype, &Device::Cpu).unwrap();
                for kernels in [Kernels::Reference, Kernels::Ops] {
                    let out = rope
                        .rotary(&positions)
                        .unwrap()
                        .apply(&input.to_dtype(dtype).unwrap(), on(kernels))
                        .unwrap();
                    let err = max_abs_diff(&out, expected);
                    assert!(
                        err <= 1e-5,
                        "{name} {pairing} {dtype:?} {}: max abs error {err:e}",
                        kernels.name()
                    );
                }
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 16);
}

#[test]
fn full_unscaled_rope_is_bit_identical_to_the_plain_tables() {
    // fraction = 1 and no scaling: the same f64 angles as before partial rotation and scaling
    // existed (w_i = base^(-2i/d), p w_i), rounded once, bit for bit.
    for pairing in [RopePairing::Interleaved, RopePairing::Half] {
        let rope = Rope::new(
            &RopeOptions {
                pairing,
                ..Default::default()
            },
            16,
            4,
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let rotary = rope.rotary(&Positions::range(0, 300).unwrap()).unwrap();
        let (cos, sin, _) = rotary.tables();
        let inv = poslab::positional::inverse_frequencies(16, 10_000.0);
        for (table, f) in [(cos, f64::cos as fn(f64) -> f64), (sin, f64::sin)] {
            let got = bits(&table.flatten_all().unwrap());
            for p in 0..300usize {
                for (i, w) in inv.iter().enumerate() {
                    let want = (f(p as f64 * w) as f32).to_bits();
                    let slots = match pairing {
                        RopePairing::Interleaved => [2 * i, 2 * i + 1],
                        RopePairing::Half => [i, 8 + i],
                    };
                    for s in slots {
                        assert_eq!(got[p * 16 + s], want, "{pairing} p {p} slot {s}");
                    }
                }
            }
        }
    }
}

#[test]
fn partial_rotation_leaves_the_pass_through_coordinates_untouched() {
    let x = {
        let v: Vec<f32> = (0..2 * 3 * 9 * 12)
            .map(|i| ((i * 37 % 101) as f32) / 50.0 - 1.0)
            .collect();
        Tensor::from_vec(v, (2, 3, 9, 12), &Device::Cpu).unwrap()
    };
    for pairing in [RopePairing::Interleaved, RopePairing::Half] {
        for fraction in [0.5, 1.0 / 3.0] {
            let rope = Rope::new(
                &RopeOptions {
                    pairing,
                    fraction,
                    scaling: Some(RopeScaling::Yarn {
                        factor: Factor::Value(4.0),
                        original_max_len: Some(4),
                        beta_fast: 32.0,
                        beta_slow: 1.0,
                    }),
                    ..Default::default()
                },
                12,
                4,
                DType::F32,
                &Device::Cpu,
            )
            .unwrap();
            let rd = rope.rotary_dim();
            assert_eq!(rd, if fraction == 0.5 { 6 } else { 4 });
            for kernels in [Kernels::Reference, Kernels::Ops] {
                let y = rope.apply(&x, 5, on(kernels)).unwrap();
                let pass =
                    |t: &Tensor| bits(&t.narrow(3, rd, 12 - rd).unwrap().contiguous().unwrap());
                assert_eq!(
                    pass(&y),
                    pass(&x),
                    "{pairing} {fraction} {}",
                    kernels.name()
                );
                let turned =
                    |t: &Tensor| values(&t.narrow(3, 0, rd).unwrap().contiguous().unwrap());
                assert_ne!(turned(&y), turned(&x));
            }
        }
    }
}

#[test]
fn scaled_rope_scores_depend_only_on_the_offset() {
    let (d, t) = (16usize, 48usize);
    let mut rng = poslab::rng::stream(8, "scaled rope");
    use rand::Rng as _;
    let mut v = || -> Vec<f64> { (0..d).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let (q, k) = (v(), v());
    let repeated = |x: &[f64]| Tensor::from_vec(x.repeat(t), (1, 1, t, d), &Device::Cpu).unwrap();
    let scalings = [
        RopeScaling::Linear {
            factor: Factor::Value(4.0),
        },
        RopeScaling::Ntk {
            factor: Factor::Value(4.0),
        },
        RopeScaling::DynamicNtk {
            factor: Factor::Value(2.0),
            original_max_len: Some(12),
        },
        RopeScaling::Yarn {
            factor: Factor::Value(8.0),
            original_max_len: Some(16),
            beta_fast: 32.0,
            beta_slow: 1.0,
        },
    ];
    for scaling in scalings {
        for fraction in [1.0, 0.5] {
            let rope = Rope::new(
                &RopeOptions {
                    pairing: RopePairing::Half,
                    fraction,
                    scaling: Some(scaling.clone()),
                    ..Default::default()
                },
                d,
                8,
                DType::F64,
                &Device::Cpu,
            )
            .unwrap();
            // One batch of positions 100..148 (dynamic NTK: one batch length, one base).
            let positions = Positions::range(100, t).unwrap();
            let rotary = rope.rotary(&positions).unwrap();
            let qr = rotary
                .apply(&repeated(&q), Default::default())
                .unwrap()
                .squeeze(0)
                .unwrap()
                .squeeze(0)
                .unwrap();
            let kr = rotary
                .apply(&repeated(&k), Default::default())
                .unwrap()
                .squeeze(0)
                .unwrap()
                .squeeze(0)
                .unwrap();
            let scores = qr
                .matmul(&kr.t().unwrap())
                .unwrap()
                .to_vec2::<f64>()
                .unwrap();
            for offset in [-30i64, -3, 0, 1, 17, 40] {
                let cells: Vec<f64> = (0..t as i64)
                    .filter(|i| (0..t as i64).contains(&(i + offset)))
                    .map(|i| scores[i as usize][(i + offset) as usize])
                    .collect();
                let spread = cells
                    .iter()
                    .fold(0.0f64, |m, c| m.max((c - cells[0]).abs()));
                assert!(
                    spread < 1e-9,
                    "{} fraction {fraction}, offset {offset}: spread {spread:e}",
                    scaling.label()
                );
            }
        }
    }
}

#[test]
fn dynamic_ntk_depends_on_the_batch_length_and_static_scalings_do_not() {
    let rope = |scaling| {
        Rope::new(
            &RopeOptions {
                scaling: Some(scaling),
                ..Default::default()
            },
            16,
            8,
            DType::F64,
            &Device::Cpu,
        )
        .unwrap()
    };
    let dynamic = rope(RopeScaling::DynamicNtk {
        factor: Factor::Value(2.0),
        original_max_len: Some(16),
    });
    let ntk = rope(RopeScaling::Ntk {
        factor: Factor::Value(2.0),
    });
    // Within the training length dynamic NTK is plain RoPE; past it the base grows.
    let (short, _) = dynamic.frequencies(10);
    assert_eq!(short, poslab::positional::inverse_frequencies(16, 10_000.0));
    let (long, _) = dynamic.frequencies(63);
    assert!(long[7] < short[7]);
    let row = |r: &Rope, len: usize| {
        values(
            &r.rotary(&Positions::range(0, len).unwrap())
                .unwrap()
                .tables()
                .0
                .narrow(1, 5, 1)
                .unwrap(),
        )
    };
    assert_ne!(
        row(&dynamic, 10),
        row(&dynamic, 64),
        "position 5 turns by another angle in a longer batch"
    );
    assert_eq!(row(&ntk, 10), row(&ntk, 64));
}

#[test]
fn bad_rope_options_are_refused_with_the_fix() {
    let parse = |shape: &str, rope: &str| {
        ModelConfig::from_toml_str(&format!(
            "vocab_size = 50\nn_layers = 2\nffn_dim = 32\nmax_len = 32\n{shape}\n[positional]\nkind = \"rope\"\n{rope}\n"
        ))
    };
    let ok = "d_model = 16\nn_heads = 2"; // heads of 8
    parse(
        ok,
        "fraction = 0.5\nscaling = { kind = \"yarn\", factor = 4, original_max_len = 16 }",
    )
    .unwrap();
    // An odd rotated width, and none at all.
    assert_error_mentions(
        parse("d_model = 20\nn_heads = 2", "fraction = 0.5"),
        &["int(10 x 0.5) = 5", "even and positive", "fraction"],
    );
    assert_error_mentions(
        parse(ok, "fraction = 0.1"),
        &["int(8 x 0.1) = 0", "even and positive"],
    );
    assert_error_mentions(parse(ok, "fraction = 1.5"), &["fraction = 1.5", "(0, 1]"]);
    // factor < 1, an unknown scaling, original_max_len = 0, auto in a model.
    assert_error_mentions(
        parse(ok, "scaling = { kind = \"linear\", factor = 0.5 }"),
        &["factor = 0.5", "at least 1"],
    );
    assert_error_mentions(
        parse(ok, "scaling = { kind = \"stretch\", factor = 2 }"),
        &["stretch", "linear", "ntk", "dynamic_ntk", "yarn"],
    );
    assert_error_mentions(
        parse(
            ok,
            "scaling = { kind = \"yarn\", factor = 2, original_max_len = 0 }",
        ),
        &["original_max_len = 0", "leave it out"],
    );
    assert_error_mentions(
        parse(ok, "scaling = { kind = \"ntk\", factor = \"auto\" }"),
        &["\"auto\"", "[eval] rope_scaling", "needs a number"],
    );
    assert_error_mentions(
        parse(ok, "scaling = { kind = \"ntk\", factr = 2 }"),
        &["unknown field `factr`"],
    );
    // NTK needs a rotated width of at least 4.
    assert_error_mentions(
        parse(
            ok,
            "fraction = 0.25\nscaling = { kind = \"ntk\", factor = 2 }",
        ),
        &["rotated width is 2", "at least 4"],
    );
}

#[test]
fn rope_configs_round_trip_with_fraction_and_scaling() {
    let config = ModelConfig {
        positional: PositionalConfig::Rope(RopeOptions {
            fraction: 0.5,
            scaling: Some(RopeScaling::DynamicNtk {
                factor: Factor::Value(2.0),
                original_max_len: None,
            }),
            ..Default::default()
        }),
        ..tiny_config(
            PositionalConfig::None(Default::default()),
            NormPlacement::Pre,
        )
    };
    config.validate().unwrap();
    assert_eq!(
        ModelConfig::from_toml_str(&config.to_toml()).unwrap(),
        config
    );
    assert_eq!(
        ModelConfig::from_json_str(&config.to_json()).unwrap(),
        config
    );
    // Full rotation without scaling writes nothing new: old configs and saved models read the same.
    let plain = ModelConfig {
        positional: PositionalConfig::Rope(RopeOptions::default()),
        ..config
    };
    assert!(!plain.to_json().contains("fraction") && !plain.to_json().contains("scaling"));
}

#[test]
fn eval_rope_scaling_rescores_every_rope_variant_as_its_own_row() {
    use poslab::runs::compare::{run, RunOptions};
    use poslab::runs::results::Outcome;
    use poslab::runs::ExperimentConfig;
    let config = ExperimentConfig::from_toml_str(
        "name = \"tiny\"\nseeds = 1\n\
         [model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\ndropout = 0.0\nattention_dropout = 0.0\n\
         [train]\nbudget = { steps = 40 }\nbatch_size = 16\nlr = 3e-3\neval_every = 40\n\
         [eval]\nshift = 4\nrope_scaling = [{ kind = \"linear\", factor = \"auto\" }, { kind = \"yarn\", factor = 2 }]\n\
         [[tasks]]\nkind = \"prev_token\"\nk = 1\nlengths = [4, 8]\ntrain_examples = 300\neval_examples = 60\neval_factors = [1, 2]\n\
         [[variants]]\nname = \"rope\"\npositional = { kind = \"rope\", fraction = 0.5 }\n\
         [[variants]]\nname = \"alibi\"\npositional = { kind = \"alibi\" }\n",
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let results = run(
        &config,
        &RunOptions {
            jobs: 1,
            ..RunOptions::new(Device::Cpu, dir.path())
        },
        &|_| {},
    )
    .unwrap()
    .results;
    let names: Vec<&str> = results.variants.iter().map(|v| v.name.as_str()).collect();
    // Only rope variants are re-scored; each scaling is a row, named by kind (and factor).
    assert_eq!(names, ["rope", "rope + linear", "rope + yarn x2", "alibi"]);
    let acc = |variant: &str, test: &str| match results
        .cells
        .iter()
        .find(|c| c.variant == variant)
        .unwrap()
        .evaluation(test)
        .unwrap()
    {
        Outcome::Scored { accuracy, .. } => *accuracy,
        other => panic!("{variant} {test}: {other:?}"),
    };
    // At the training lengths an automatic linear factor is 1: exactly the plain model.
    assert_eq!(acc("rope + linear", "1x"), acc("rope", "1x"));
    // Past them it rescales; a fixed factor rescales everywhere. The weights are the same
    // (same cell, same parameters and loss).
    assert_ne!(
        (acc("rope + linear", "2x"), acc("rope + yarn x2", "1x")),
        (acc("rope", "2x"), acc("rope", "1x"))
    );
    let cell = |v: &str| results.cells.iter().find(|c| c.variant == v).unwrap();
    assert_eq!(
        cell("rope + yarn x2").summary.final_train_loss,
        cell("rope").summary.final_train_loss
    );
    assert_eq!(cell("rope + yarn x2").model_dir, cell("rope").model_dir);
    // Scalings are checked at load: a bad one is refused before anything trains.
    let bad =
        ExperimentConfig::from_toml_str(&config.to_toml().replace("factor = 2.0", "factor = 0.5"));
    assert_error_mentions(bad, &["[eval]", "factor = 0.5", "at least 1"]);
}

#[test]
fn predict_and_embed_read_long_texts_with_rope_scaling() {
    use poslab::infer::Predictor;
    // Train a tiny rope classifier, save it, and embed a text 4x its training length.
    let dir = tempfile::tempdir().unwrap();
    let config = poslab::runs::train_run::TrainRunConfig::from_toml_str(
        "name = \"r\"\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
         [positional]\nkind = \"rope\"\n[train]\nbudget = { steps = 10 }\nbatch_size = 16\n\
         [task]\nkind = \"word_order\"\nlengths = [5, 8]\ntrain_examples = 200\neval_examples = 40\n",
    )
    .unwrap();
    poslab::runs::train_run::start(
        &config,
        &poslab::runs::train_run::TrainOptions {
            dir: dir.path().join("run"),
            device: Device::Cpu,
            progress: poslab::progress::Progress::Quiet,
            stop_after: None,
            hub: poslab::text::HubSource::from_env(),
            threads: None,
            backend: Default::default(),
            limits: Default::default(),
        },
    )
    .unwrap();
    let loaded = poslab::saved::load(&dir.path().join("run"), DType::F32, &Device::Cpu).unwrap();
    let long = ["the red fox chased the dog"; 5].join(" ");
    let texts = vec![long.clone()];
    let plain = Predictor::new(&loaded, false).embed(&texts).unwrap();
    let scaled = Predictor::new(&loaded, false)
        .with_rope_scaling(Some(RopeScaling::parse_spec("yarn").unwrap()))
        .unwrap()
        .embed(&texts)
        .unwrap();
    assert_ne!(plain[0].value.embedding, scaled[0].value.embedding);
    // A text within the training length reads the same under an automatic factor of 1 with
    // linear scaling (frequencies divided by 1).
    let short = vec!["the red fox chased the dog".to_string()];
    let a = Predictor::new(&loaded, false).embed(&short).unwrap();
    let b = Predictor::new(&loaded, false)
        .with_rope_scaling(Some(RopeScaling::parse_spec("linear").unwrap()))
        .unwrap()
        .embed(&short)
        .unwrap();
    assert_eq!(a[0].value.embedding, b[0].value.embedding);
}
