//! The attention-bias schemes (ALiBi, T5, KERPLE), untied positions (TUPE) and randomized
//! positions: their properties, their configs (and the bad ones), training end to end, and
//! KERPLE's positivity.

use candle::{DType, Device, Tensor};
use poslab::positional::{random_batch_positions, random_positions, KERPLE_MIN};
use poslab::runs::compare::{run, RunOptions};
use poslab::runs::results::Outcome;
use poslab::runs::ExperimentConfig;
use poslab::{Encoder, ModelConfig, NormPlacement, ParamStore, PositionalConfig, Positions};

use crate::common::*;

fn relative_schemes() -> Vec<PositionalConfig> {
    all_schemes()
        .into_iter()
        .filter(|p| matches!(p.name(), "alibi" | "t5" | "kerple" | "fire"))
        .collect()
}

fn bias_values(encoder: &Encoder, positions: &Positions) -> Vec<Vec<f64>> {
    (0..encoder.config().n_layers)
        .map(|l| values(&encoder.score_bias(l, positions).unwrap().unwrap()))
        .collect()
}

#[test]
fn relative_biases_depend_only_on_the_offset() {
    // Arbitrary, unsorted, repeated-gap positions for two sequences: every pair of tokens with
    // the same p_j - p_i gets the same bias, in every layer and head.
    let rows = vec![
        vec![0, 3, 4, 9, 17, 40, 41, 100],
        vec![250, 7, 8, 64, 65, 3, 300, 12],
    ];
    let positions = Positions::from_rows(&rows).unwrap();
    let t = 8;
    for positional in relative_schemes() {
        let name = positional.name();
        let encoder = {
            let store = ParamStore::new(9);
            let config = tiny_config(positional.clone(), NormPlacement::Pre);
            Encoder::new(&config, store.var_builder(DType::F64, &Device::Cpu)).unwrap()
        };
        let heads = encoder.config().n_heads;
        for layer in bias_values(&encoder, &positions) {
            // (r, h, t, t): remember the first value seen for each (head, offset).
            let mut seen = std::collections::HashMap::new();
            let mut distinct = std::collections::HashSet::new();
            for (r, row) in rows.iter().enumerate() {
                for h in 0..heads {
                    for i in 0..t {
                        for j in 0..t {
                            let v = layer[((r * heads + h) * t + i) * t + j];
                            let offset = row[j] as i64 - row[i] as i64;
                            // FIRE normalises by each sequence's span (above its threshold):
                            // a function of the offset within a sequence.
                            let seq = if name == "fire" { r } else { 0 };
                            let first = *seen.entry((seq, h, offset)).or_insert(v);
                            assert!(
                                (v - first).abs() < 1e-12,
                                "{name}: head {h}, offset {offset}: {v} vs {first}"
                            );
                            distinct.insert(v.to_bits());
                        }
                    }
                }
            }
            assert!(distinct.len() > heads, "{name}: the bias is constant");
        }
        // And the whole encoder is unmoved by moving every position by the same amount.
        let (ids, mask) = padded_batch(2, t, 40);
        let a = encoder
            .forward_with(&ids, &mask, &positions, false)
            .unwrap();
        let b = encoder
            .forward_with(&ids, &mask, &positions.shifted(1000).unwrap(), false)
            .unwrap();
        let diff = max_abs_diff_real(&a, &b, &mask);
        assert!(
            diff < 1e-9,
            "{name}: a shift of 1000 changed outputs by {diff:e}"
        );
    }
}

#[test]
fn untied_is_absolute_and_reads_its_positions() {
    for positional in all_schemes().into_iter().filter(|p| p.name() == "untied") {
        let store = ParamStore::new(4);
        let config = tiny_config(positional, NormPlacement::Post);
        let encoder = Encoder::new(&config, store.var_builder(DType::F64, &Device::Cpu)).unwrap();
        let (ids, mask) = padded_batch(2, 8, 40);
        let p0 = Positions::range(0, 8).unwrap();
        let a = encoder.forward_with(&ids, &mask, &p0, false).unwrap();
        let b = encoder
            .forward_with(&ids, &mask, &p0.shifted(5).unwrap(), false)
            .unwrap();
        assert!(
            max_abs_diff_real(&a, &b, &mask) > 1e-3,
            "a shift changed nothing"
        );
        // The term is TUPE's: (p_i U_q)_h . (p_j U_k)_h / sqrt(2 d_head), from the stored U_q, U_k.
        let bias = encoder.score_bias(0, &p0).unwrap().unwrap(); // (1, h, t, t)
        let uq = store.get("pos_attn.q.weight").unwrap();
        let uk = store.get("pos_attn.k.weight").unwrap();
        let rows = match encoder.positional() {
            poslab::positional::PositionalModule::ScoreBias(bias) => bias
                .downcast::<poslab::positional::Untied>()
                .unwrap()
                .vectors(&p0)
                .unwrap()
                .squeeze(0)
                .unwrap(), // (t, d)
            _ => unreachable!(),
        };
        let pq = rows.matmul(&uq.as_tensor().t().unwrap()).unwrap();
        let pk = rows.matmul(&uk.as_tensor().t().unwrap()).unwrap();
        let (h, dh) = (config.n_heads, config.head_dim());
        for head in 0..h {
            let q = pq.narrow(1, head * dh, dh).unwrap();
            let k = pk.narrow(1, head * dh, dh).unwrap();
            let expected = (q.matmul(&k.t().unwrap()).unwrap() / (2.0 * dh as f64).sqrt()).unwrap();
            let ours = bias.get(0).unwrap().get(head).unwrap();
            assert!(max_abs_diff(&ours, &expected) < 1e-12);
        }
    }
}

#[test]
fn randomized_positions_are_sorted_distinct_bounded_and_seeded() {
    for (len, n) in [(1usize, 1usize), (5, 5), (40, 2048), (300, 512)] {
        let draw = |seed| random_positions(len, n, &mut poslab::rng::stream(seed, "test")).unwrap();
        let a = draw(3);
        assert_eq!(a.len(), len);
        assert!(
            a.windows(2).all(|w| w[0] < w[1]),
            "sorted and distinct: {a:?}"
        );
        assert!(a.iter().all(|&p| p < n));
        assert_eq!(a, draw(3), "the same seed draws the same positions");
        if len < n {
            assert_ne!(a, draw(4), "another seed draws others");
        }
    }
    // Every position of [0, n) gets drawn: uniform, not stuck at the start.
    let mut hit = [false; 64];
    for seed in 0..200 {
        for p in random_positions(8, 64, &mut poslab::rng::stream(seed, "cover")).unwrap() {
            hit[p] = true;
        }
    }
    assert!(hit.iter().all(|&h| h));
    let err = random_positions(9, 8, &mut poslab::rng::stream(0, "x")).unwrap_err();
    assert!(
        err.to_string()
            .contains("raise random_positions to at least 9"),
        "{err}"
    );
}

#[test]
fn padding_changes_nothing_at_real_positions_under_randomized_positions() {
    // A sequence alone, and inside a batch padded to 12 whose padded slots hold other ids and
    // positions: its real outputs are the same for every scheme.
    let mut rng = poslab::rng::stream(1, "padding");
    // Dynamic NTK reads the batch's largest position by definition.
    for positional in all_schemes()
        .into_iter()
        .filter(|p| !depends_on_batch_length(p))
    {
        let name = positional.name();
        let mut config = tiny_config(positional, NormPlacement::Pre);
        config.max_len = 64;
        let store = ParamStore::new(2);
        let encoder = Encoder::new(&config, store.var_builder(DType::F64, &Device::Cpu)).unwrap();
        let batch = random_batch_positions(&[7, 12], 12, 64, &mut rng).unwrap();
        let (ids, _) = padded_batch(2, 12, 40);
        let mask = Tensor::from_vec(
            (0..24)
                .map(|i| u32::from(!(7..12).contains(&i)))
                .collect::<Vec<u32>>(),
            (2, 12),
            &Device::Cpu,
        )
        .unwrap();
        let together = encoder.forward_with(&ids, &mask, &batch, false).unwrap();
        let alone_ids = ids.narrow(0, 0, 1).unwrap().narrow(1, 0, 7).unwrap();
        let alone_pos =
            Positions::from_rows(&[batch.row(0)[..7].iter().map(|&p| p as usize).collect()])
                .unwrap();
        let alone = encoder
            .forward_with(
                &alone_ids,
                &Tensor::ones((1, 7), DType::U32, &Device::Cpu).unwrap(),
                &alone_pos,
                false,
            )
            .unwrap();
        let first = together.narrow(0, 0, 1).unwrap().narrow(1, 0, 7).unwrap();
        let diff = max_abs_diff(&alone, &first);
        assert!(
            diff < 1e-12,
            "{name}: padding changed real outputs by {diff:e}"
        );
    }
}

#[test]
fn new_scheme_configs_parse_round_trip_and_say_where_they_act() {
    const SHAPE: &str =
        "vocab_size = 50\nd_model = 16\nn_heads = 2\nn_layers = 2\nffn_dim = 32\nmax_len = 32\n";
    for (text, name) in [
        ("kind = \"alibi\"", "alibi"),
        ("kind = \"t5\"\nbuckets = 16\nmax_distance = 40", "t5"),
        ("kind = \"kerple\"", "kerple"),
        ("kind = \"untied\"", "untied"),
        (
            "kind = \"untied\"\nsource = \"learned\"\ninit_std = 0.1",
            "untied",
        ),
        (
            "kind = \"untied\"\nsource = \"sinusoidal\"\nbase = 100.0\nlayout = \"half\"",
            "untied",
        ),
    ] {
        let config = ModelConfig::from_toml_str(&format!(
            "{SHAPE}random_positions = 256\n[positional]\n{text}\n"
        ));
        let config = match (config, name) {
            // A learned table must hold the randomized positions.
            (Err(e), "untied") if text.contains("learned") || !text.contains("source") => {
                assert!(e.to_string().contains("max_len to at least 256"), "{e}");
                ModelConfig::from_toml_str(&format!(
                    "{}random_positions = 256\n[positional]\n{text}\n",
                    SHAPE.replace("max_len = 32", "max_len = 256")
                ))
                .unwrap()
            }
            (c, _) => c.unwrap(),
        };
        assert_eq!(config.positional.name(), name);
        assert_eq!(config.random_positions, Some(256));
        assert_eq!(config.positional.placement().name(), "attention bias");
        assert_eq!(
            ModelConfig::from_toml_str(&config.to_toml()).unwrap(),
            config
        );
        assert_eq!(
            ModelConfig::from_json_str(&config.to_json()).unwrap(),
            config
        );
    }
}

#[test]
fn bad_scheme_options_are_refused_with_the_fix() {
    let parse = |shape: &str, positional: &str| {
        ModelConfig::from_toml_str(&format!(
            "vocab_size = 50\nn_layers = 2\nffn_dim = 32\nmax_len = 32\n{shape}\n[positional]\n{positional}\n"
        ))
    };
    let ok = "d_model = 16\nn_heads = 2";
    // Unknown options, by name, with the valid ones listed.
    assert_error_mentions(
        parse(ok, "kind = \"alibi\"\nslopes = 2"),
        &["unknown field `slopes`"],
    );
    assert_error_mentions(
        parse(ok, "kind = \"t5\"\nbucket = 32"),
        &["unknown field `bucket`", "buckets", "max_distance"],
    );
    assert_error_mentions(
        parse(ok, "kind = \"kerple\"\nr1 = 1"),
        &["unknown field `r1`"],
    );
    assert_error_mentions(
        parse(ok, "kind = \"untied\"\nsource = \"table\""),
        &["learned", "sinusoidal"],
    );
    assert_error_mentions(
        parse(ok, "kind = \"alibis\""),
        &["alibi", "t5", "kerple", "untied"],
    );
    // Too few buckets, and a max_distance inside the exact range.
    for b in [0, 1, 2, 3] {
        assert_error_mentions(
            parse(ok, &format!("kind = \"t5\"\nbuckets = {b}")),
            &[&format!("buckets = {b}"), "at least 4"],
        );
    }
    assert_error_mentions(
        parse(ok, "kind = \"t5\"\nbuckets = 32\nmax_distance = 8"),
        &["max_distance = 8", "above 8"],
    );
    // Untied: an odd sinusoid width, and options of the other source.
    assert_error_mentions(
        parse(
            "d_model = 15\nn_heads = 3",
            "kind = \"untied\"\nsource = \"sinusoidal\"",
        ),
        &["d_model = 15 is odd", "even width", "source = \"learned\""],
    );
    parse("d_model = 15\nn_heads = 3", "kind = \"untied\"").unwrap();
    assert_error_mentions(
        parse(ok, "kind = \"untied\"\nbase = 100.0"),
        &["base and layout belong to source = \"sinusoidal\""],
    );
    assert_error_mentions(
        parse(
            ok,
            "kind = \"untied\"\nsource = \"sinusoidal\"\ninit_std = 0.1",
        ),
        &["init_std belongs to source = \"learned\""],
    );
    // Randomized positions: zero, and a learned table shorter than the range.
    assert_error_mentions(
        parse(&format!("{ok}\nrandom_positions = 0"), "kind = \"rope\""),
        &["random_positions = 0"],
    );
    assert_error_mentions(
        parse(
            &format!("{ok}\nrandom_positions = 64"),
            "kind = \"learned\"",
        ),
        &["max_len = 32", "at least 64"],
    );
}

fn tiny_experiment(variants: &str) -> ExperimentConfig {
    ExperimentConfig::from_toml_str(&format!(
        "name = \"tiny\"\nseeds = 1\n\
         [model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\ndropout = 0.0\nattention_dropout = 0.0\n\
         [train]\nbudget = {{ steps = 30 }}\nbatch_size = 16\nlr = 3e-3\neval_every = 30\n\
         [eval]\nshift = 4\n\
         [[tasks]]\nkind = \"prev_token\"\nk = 1\nlengths = [4, 8]\ntrain_examples = 300\neval_examples = 60\neval_factors = [1, 2]\n\
         {variants}"
    ))
    .unwrap()
}

fn run_tiny(config: &ExperimentConfig) -> poslab::Result<poslab::runs::results::Results> {
    let dir = tempfile::tempdir().unwrap();
    run(
        config,
        &RunOptions {
            jobs: 2,
            ..RunOptions::new(Device::Cpu, dir.path())
        },
        &|_| {},
    )
    .map(|o| o.results)
}

#[test]
fn randomized_and_bias_variants_train_test_and_reproduce_in_compare() {
    let config = tiny_experiment(
        "[[variants]]\nname = \"t5_random\"\npositional = { kind = \"t5\" }\nrandom_positions = 40\n\
         [[variants]]\nname = \"learned_random\"\npositional = { kind = \"learned\" }\nrandom_positions = 40\n\
         [[variants]]\nname = \"kerple\"\npositional = { kind = \"kerple\" }\n",
    );
    let a = run_tiny(&config).unwrap();
    let b = run_tiny(&config).unwrap();
    let scores = |r: &poslab::runs::results::Results| -> Vec<String> {
        r.cells
            .iter()
            .flat_map(|c| {
                c.summary
                    .evaluations
                    .iter()
                    .map(|e| format!("{}/{}: {:?}", c.variant, e.name, e.outcome))
            })
            .collect()
    };
    assert_eq!(scores(&a), scores(&b), "same config and seed, same scores");
    let where_ = |v: &str| {
        a.variants
            .iter()
            .find(|x| x.name == v)
            .unwrap()
            .placement
            .clone()
    };
    assert_eq!(where_("t5_random"), "attention bias, random 40");
    assert_eq!(where_("kerple"), "attention bias");
    let cell = |v: &str| a.cells.iter().find(|c| c.variant == v).unwrap();
    // A learned table of 40 rows, every one of them reachable in training.
    assert_eq!(cell("learned_random").summary.max_len, 40);
    for v in ["t5_random", "learned_random", "kerple"] {
        let two_x = cell(v).evaluation("2x").unwrap();
        assert!(matches!(two_x, Outcome::Scored { .. }), "{v} 2x: {two_x:?}");
    }
    // The shift test of a randomized learned table could reach past its rows: said, not run.
    match cell("learned_random").evaluation("shift+4").unwrap() {
        Outcome::Unavailable { reason } => assert!(reason.contains("40 rows"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn random_positions_fewer_than_the_longest_input_are_refused_before_training() {
    // Tests reach 2 x 8 = 16 tokens.
    let config = tiny_experiment(
        "[[variants]]\nname = \"rope_random\"\npositional = { kind = \"rope\" }\nrandom_positions = 12\n",
    );
    let err = run_tiny(&config).unwrap_err().to_string();
    assert!(
        err.contains("variant `rope_random`")
            && err.contains("random_positions = 12")
            && err.contains("at least 16"),
        "{err}"
    );
}

#[test]
fn kerple_parameters_stay_positive_in_training_and_unusable_files_are_refused() {
    use poslab::train::optim::{AdamW, AdamWConfig};
    let store = ParamStore::new(1);
    let config = tiny_config(
        PositionalConfig::Kerple(Default::default()),
        NormPlacement::Pre,
    );
    let encoder = Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
    let r1 = store.get("layers.0.attn.kerple.r1").unwrap();
    let initial = values(r1.as_tensor());
    assert!(
        initial.iter().all(|&v| (KERPLE_MIN..=2.0).contains(&v)),
        "{initial:?}"
    );
    // The bounds are declared by the module that created r1 and r2, not found by name.
    let bounds = encoder.constraints();
    assert_eq!(bounds.len(), 2 * config.n_layers);
    assert!(bounds.iter().all(|b| b.min == KERPLE_MIN));
    // Without them an optimizer does not bound anything; with them it does.
    store.constrain(&bounds).unwrap();
    assert_eq!(store.bound("layers.0.attn.kerple.r1"), Some(KERPLE_MIN));
    assert_eq!(store.bound("layers.0.attn.q.weight"), None);
    // A gradient that pushes every r down hard: AdamW moves them by lr, the projection stops
    // them at KERPLE_MIN. They are not weight-decayed either.
    let mut opt = AdamW::from_store(
        &store,
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        },
    )
    .unwrap();
    let (ids, mask) = padded_batch(2, 6, 40);
    for _ in 0..3 {
        let hidden = encoder.forward_t(&ids, &mask, true).unwrap();
        // loss = sum(hidden) + 100 * sum(r1 + r2) over every layer: d/dr = 100 > 0.
        let mut loss = hidden.sum_all().unwrap();
        for (name, var) in store.vars() {
            if name.contains(".kerple.") {
                loss = (loss + (var.as_tensor().sum_all().unwrap() * 100.0).unwrap()).unwrap();
            }
        }
        opt.step(&loss.backward().unwrap(), 5.0, 1.0).unwrap();
    }
    for (name, var) in store.vars() {
        if name.contains(".kerple.") {
            let v = values(var.as_tensor());
            assert!(
                v.iter().all(|&x| x == KERPLE_MIN as f32 as f64),
                "{name}: {v:?}"
            );
        }
    }
    // Files: a non-positive r, and a NaN anywhere, are refused naming the tensor.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let tensors = |name: &str, value: f32| -> Vec<(String, Tensor)> {
        store
            .vars()
            .into_iter()
            .map(|(n, v)| {
                let t = if n == name {
                    Tensor::full(value, v.dims(), &Device::Cpu).unwrap()
                } else {
                    v.as_tensor().clone()
                };
                (n, t)
            })
            .collect()
    };
    let other = ParamStore::new(2);
    let built = Encoder::new(&config, other.var_builder(DType::F32, &Device::Cpu)).unwrap();
    other.constrain(&built.constraints()).unwrap();
    for (name, value, needle) in [
        ("layers.1.attn.kerple.r2", -0.5, "below its least value"),
        ("layers.0.ffn.up.weight", f32::NAN, "NaN"),
        ("tok_emb.weight", f32::INFINITY, "inf"),
    ] {
        poslab::params::save_tensors(&path, tensors(name, value), Default::default()).unwrap();
        let before = values(other.get(name).unwrap().as_tensor());
        assert_error_mentions(other.load(&path), &[name, needle]);
        // Nothing was half-loaded.
        assert_eq!(values(other.get(name).unwrap().as_tensor()), before);
    }
}

#[test]
fn weight_decay_skips_what_the_modules_declare_and_only_that() {
    // The modules that make biases and LayerNorm parameters declare them; the optimizer reads
    // that from the store, never a variable's name. Over every scheme, with and without biases,
    // pre and post norm, a task head on top, the declared set is exactly biases and norms (what
    // a name rule would pick), and bounded variables (KERPLE's r1, r2) are not decayed either.
    use poslab::model::{HeadConfig, Pooling, TaskModel};
    let mut models = 0;
    for positional in PositionalConfig::catalog(8) {
        for (bias, norm) in [(true, NormPlacement::Pre), (false, NormPlacement::Post)] {
            let config = ModelConfig {
                vocab_size: 30,
                d_model: 32,
                n_heads: 4,
                n_layers: 2,
                ffn_dim: 48,
                max_len: 16,
                norm,
                bias,
                positional: positional.clone(),
                ..ModelConfig::default()
            };
            if config.validate().is_err() {
                continue;
            }
            let store = ParamStore::new(3);
            let head = HeadConfig::Classify {
                classes: 3,
                pooling: Pooling::Mean,
            };
            let model = TaskModel::new(&config, &head, store.var_builder(DType::F32, &Device::Cpu))
                .unwrap();
            store.constrain(&model.encoder().constraints()).unwrap();
            store.exempt_from_decay(&model.undecayed());
            let mut exempt = 0;
            for (name, _) in store.vars() {
                // GRAPE-M's log-frequencies: a vector, which the original's optimizer never
                // decays (decay would pull every frequency toward 1 radian per position).
                let by_role = name.ends_with(".bias")
                    || name.contains("norm.")
                    || name.ends_with("grape.log_freq");
                let bounded = store.bound(&name).is_some();
                assert_eq!(
                    store.decays(&name),
                    !(by_role || bounded),
                    "{} (bias {bias}): `{name}`",
                    positional.name()
                );
                exempt += usize::from(!store.decays(&name));
            }
            // Norms (2 per layer, and a final one before the head under pre-norm) at least.
            assert!(exempt >= 2 * config.n_layers, "{}", positional.name());
            models += 1;
        }
    }
    assert!(models >= 24, "{models} models checked");
    // Without the declarations, everything would be decayed.
    let store = ParamStore::new(3);
    Encoder::new(
        &ModelConfig::default(),
        store.var_builder(DType::F32, &Device::Cpu),
    )
    .unwrap();
    assert!(store.vars().iter().all(|(name, _)| store.decays(name)));
}

#[test]
fn a_bias_built_from_its_offsets_equals_the_gathered_bias_and_its_gradients() {
    // Shared positions 0..t build T5's and FIRE's bias from the 2t - 1 offsets (a skew whose
    // gradient is a sum per diagonal); the same positions given once per sequence take the
    // general path (a gather per pair). Values agree exactly, gradients to rounding.
    let t = 9;
    for positional in relative_schemes()
        .into_iter()
        .filter(|p| matches!(p.name(), "t5" | "fire"))
    {
        let name = positional.name();
        let config = tiny_config(positional, NormPlacement::Pre);
        let store = ParamStore::new(5);
        let encoder = Encoder::new(&config, store.var_builder(DType::F64, &Device::Cpu)).unwrap();
        let range = Positions::range(0, t).unwrap();
        let rows = Positions::from_rows(&[(0..t).collect(), (0..t).collect()]).unwrap();
        let by_offset = encoder.score_bias(0, &range).unwrap().unwrap(); // (1, h, t, t)
        let gathered = encoder.score_bias(0, &rows).unwrap().unwrap(); // (2, h, t, t)
        assert_eq!(by_offset.dims()[0], 1, "{name}");
        assert_eq!(gathered.dims()[0], 2, "{name}");
        for k in 0..2 {
            let diff = (gathered.get(k).unwrap() - by_offset.get(0).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            assert_eq!(diff, 0.0, "{name}: row {k}");
        }
        let weights = Tensor::rand(-1.0f64, 1.0, by_offset.shape(), &Device::Cpu).unwrap();
        let loss = |bias: &Tensor| bias.broadcast_mul(&weights).unwrap().sum_all().unwrap();
        let g_offset = loss(&by_offset).backward().unwrap();
        let g_gather = loss(&gathered).backward().unwrap();
        let mut checked = 0;
        for (var, v) in store.vars() {
            let (Some(a), Some(b)) = (g_offset.get(&v), g_gather.get(&v)) else {
                continue;
            };
            // The gathered bias has two identical rows: twice the gradient.
            let a = (a * 2.0)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let b = b.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            let scale = b.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
            let err = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(
                    0.0f64,
                    |m, d| if d.is_nan() { f64::INFINITY } else { m.max(d) },
                );
            assert!(err <= 1e-12 * scale, "{name} {var}: {err:e} of {scale:e}");
            checked += usize::from(scale > 1e-6);
        }
        assert!(checked >= 1, "{name}: no variable has a gradient");
    }
}
