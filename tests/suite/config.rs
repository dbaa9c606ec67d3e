//! Configs parse from TOML and JSON, and every bad config or input is refused with a message
//! that names the problem and the fix, never a panic.

use candle::{DType, Device, Tensor};
use poslab::{Encoder, Error, ModelConfig, NormPlacement, ParamStore, PositionalConfig};

use crate::common::*;

const SHAPE: &str =
    "vocab_size = 50\nd_model = 16\nn_heads = 2\nn_layers = 2\nffn_dim = 32\nmax_len = 32\n";

fn parse(extra: &str, positional: &str) -> poslab::Result<ModelConfig> {
    ModelConfig::from_toml_str(&format!("{SHAPE}{extra}\n[positional]\n{positional}\n"))
}

/// The error's message, which must contain every one of `needles`.
fn assert_error(result: poslab::Result<ModelConfig>, needles: &[&str]) {
    assert_error_mentions(result, needles);
}

#[test]
fn every_scheme_parses_with_its_options_and_round_trips() {
    let cases = [
        ("kind = \"none\"", "none"),
        (
            "kind = \"sinusoidal_add\"\nbase = 100.0\nlayout = \"half\"",
            "sinusoidal_add",
        ),
        (
            "kind = \"sinusoidal_concat\"\npos_dim = 6",
            "sinusoidal_concat",
        ),
        ("kind = \"learned\"\ninit_std = 0.02", "learned"),
        (
            "kind = \"rope\"\nbase = 500000.0\npairing = \"half\"",
            "rope",
        ),
    ];
    for (text, name) in cases {
        let config = parse("norm = \"post\"", text).unwrap();
        assert_eq!(config.positional.name(), name);
        assert_eq!(config.norm, NormPlacement::Post);
        assert_eq!(
            ModelConfig::from_json_str(&config.to_json()).unwrap(),
            config
        );
        assert_eq!(
            ModelConfig::from_toml_str(&config.to_toml()).unwrap(),
            config
        );
    }
    // Defaults: base 1e4, interleaved, pre-norm, dropout 0.1, eps 1e-5, embed_scale 1.
    let config = parse("", "kind = \"sinusoidal_add\"").unwrap();
    assert_eq!(config.norm, NormPlacement::Pre);
    assert_eq!((config.dropout, config.attention_dropout), (0.1, 0.1));
    assert_eq!(config.layer_norm_eps, 1e-5);
    assert_eq!(config.embed_scale, poslab::Scale::Value(1.0));
    assert_eq!(config.token_init_std, poslab::Scale::Value(1.0));
    // The paper's setting by name; a wrong name lists the choices.
    let paper = parse(
        "embed_scale = \"sqrt_d_model\"\ntoken_init_std = \"inv_sqrt_d_model\"",
        "kind = \"sinusoidal_add\"",
    )
    .unwrap();
    assert_eq!(paper.embed_scale.value(16), 4.0);
    assert_eq!(paper.token_init_std.value(16), 0.25);
    assert_eq!(ModelConfig::from_toml_str(&paper.to_toml()).unwrap(), paper);
    assert_error(
        parse("embed_scale = \"sqrt_d\"", "kind = \"none\""),
        &["sqrt_d", "\"sqrt_d_model\""],
    );
    match config.positional {
        PositionalConfig::SinusoidalAdd(o) => {
            assert_eq!(o.base, 10_000.0);
            assert_eq!(o.layout, poslab::TableLayout::Interleaved);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_widths_and_shapes_are_refused_with_the_fix() {
    // Odd width for a sinusoid added to the residual stream.
    assert_error(
        ModelConfig::from_toml_str(
            "vocab_size = 50\nd_model = 15\nn_heads = 3\nn_layers = 2\nffn_dim = 32\nmax_len = 32\n\
             [positional]\nkind = \"sinusoidal_add\"\n",
        ),
        &["sinusoidal_add", "even", "d_model = 15", "16"],
    );
    // Odd RoPE head width: 12 / 4 = 3.
    assert_error(
        ModelConfig::from_toml_str(
            "vocab_size = 50\nd_model = 12\nn_heads = 4\nn_layers = 2\nffn_dim = 32\nmax_len = 32\n\
             [positional]\nkind = \"rope\"\n",
        ),
        &["rope", "head width must be even", "= 3"],
    );
    // Heads not dividing the width: the message lists the heads that would.
    assert_error(
        ModelConfig::from_toml_str(
            "vocab_size = 50\nd_model = 16\nn_heads = 3\nn_layers = 2\nffn_dim = 32\nmax_len = 32\n\
             [positional]\nkind = \"none\"\n",
        ),
        &["n_heads = 3 does not divide d_model = 16", "{1, 2, 4, 8, 16}"],
    );
    // Concat with no room left for token embeddings, or an odd table.
    assert_error(
        parse("", "kind = \"sinusoidal_concat\"\npos_dim = 16"),
        &["pos_dim = 16", "less than d_model = 16"],
    );
    assert_error(
        parse("", "kind = \"sinusoidal_concat\"\npos_dim = 5"),
        &["pos_dim = 5 is odd", "4 or 6"],
    );
    assert_error(
        ModelConfig::from_toml_str(&SHAPE.replace("n_layers = 2", "n_layers = 0").replace(
            "max_len = 32\n",
            "max_len = 32\n[positional]\nkind = \"none\"\n",
        )),
        &["n_layers = 0", "at least one layer"],
    );
    assert_error(
        parse("dropout = 1.0", "kind = \"none\""),
        &["dropout = 1", "[0, 1)"],
    );
    assert_error(
        parse("", "kind = \"rope\"\nbase = 1.0"),
        &["rope", "base = 1", "greater than 1"],
    );
    assert_error(
        parse("embed_scale = -2.0", "kind = \"none\""),
        &["embed_scale = -2"],
    );
    assert_error(
        parse("", "kind = \"learned\"\ninit_std = -1.0"),
        &["learned", "init_std = -1"],
    );
}

#[test]
fn unknown_names_and_options_are_refused_with_the_choices() {
    assert_error(
        parse("", "kind = \"sinusoid\""),
        &["unknown variant `sinusoid`", "`sinusoidal_add`", "`rope`"],
    );
    assert_error(
        parse("", "kind = \"rope\"\nlayout = \"half\""),
        &[
            "unknown field `layout`",
            "`base`, `pairing`, `fraction`, `scaling`",
        ],
    );
    assert_error(
        parse("", "kind = \"none\"\nbase = 3.0"),
        &["unknown field `base`"],
    );
    assert_error(
        parse("", "kind = \"sinusoidal_add\"\nlayout = \"alternating\""),
        &["unknown variant `alternating`", "`interleaved` or `half`"],
    );
    // Concatenation without its width takes the stated default, 16 (a quarter of the default
    // d_model); a model too narrow for it says so, naming the value and the fix.
    let concat = ModelConfig::from_toml_str(&format!(
        "{}[positional]\nkind = \"sinusoidal_concat\"\n",
        SHAPE.replace("d_model = 16", "d_model = 64")
    ))
    .unwrap();
    assert_eq!(
        concat.positional,
        PositionalConfig::SinusoidalConcat(poslab::prelude::ConcatOptions::default())
    );
    match &concat.positional {
        PositionalConfig::SinusoidalConcat(o) => assert_eq!(o.pos_dim, 16),
        other => panic!("{other:?}"),
    }
    assert_error(
        parse("", "kind = \"sinusoidal_concat\"").and_then(|c| c.validate().map(|_| c)),
        &["pos_dim = 16", "less than d_model = 16", "project = true"],
    );
    assert_error(parse("", "base = 3.0"), &["missing field `kind`"]);
    assert_error(
        parse("n_head = 2", "kind = \"none\""),
        &["unknown field `n_head`", "`n_heads`"],
    );
    assert_error(
        parse("norm = \"sandwich\"", "kind = \"none\""),
        &["`pre` or `post`"],
    );
    assert_error(
        ModelConfig::from_json_str(
            r#"{"vocab_size":50,"d_model":16,"n_heads":2,"n_layers":2,"ffn_dim":32,
                "max_len":32,"positional":{"kind":"rope","pos_dim":4}}"#,
        ),
        &["unknown field `pos_dim`", "line 2"],
    );
}

#[test]
fn config_files_name_their_path_in_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        format!("{SHAPE}[positional]\nkind = \"rope\"\npairing = \"diagonal\"\n"),
    )
    .unwrap();
    let message = ModelConfig::load(&bad).unwrap_err().to_string();
    assert!(
        message.contains("bad.toml") && message.contains("diagonal"),
        "{message}"
    );

    let invalid = dir.path().join("invalid.json");
    std::fs::write(
        &invalid,
        r#"{"vocab_size":50,"d_model":16,"n_heads":5,"n_layers":2,"ffn_dim":32,"max_len":32,"positional":{"kind":"none"}}"#,
    )
    .unwrap();
    let message = ModelConfig::load(&invalid).unwrap_err().to_string();
    assert!(
        message.contains("invalid.json") && message.contains("n_heads = 5"),
        "{message}"
    );

    let yaml = dir.path().join("model.yaml");
    std::fs::write(&yaml, "d_model: 16").unwrap();
    let message = ModelConfig::load(&yaml).unwrap_err().to_string();
    assert!(message.contains("*.toml or *.json"), "{message}");

    let missing = ModelConfig::load(dir.path().join("nope.toml")).unwrap_err();
    assert!(matches!(missing, Error::Io { .. }) && missing.to_string().contains("nope.toml"));
}

#[test]
fn shipped_configs_are_valid() {
    // Experiments (with [[variants]]) and model configs; each must load and validate.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let (mut models, mut experiments, mut trains) = (0, Vec::new(), Vec::new());
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let table: toml::Table = std::fs::read_to_string(&path).unwrap().parse().unwrap();
        if table.contains_key("task") {
            poslab::runs::train_run::TrainRunConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
            trains.push(path.file_name().unwrap().to_string_lossy().into_owned());
        } else if table.contains_key("variants") {
            poslab::runs::ExperimentConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
            experiments.push(path.file_name().unwrap().to_string_lossy().into_owned());
        } else {
            ModelConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
            models += 1;
        }
    }
    experiments.sort();
    assert_eq!(
        experiments,
        [
            "add_vs_concat.toml",
            "causal.toml",
            "compare.toml",
            "compare_reviews.toml",
            "layers.toml",
            "length_generalization.toml",
            "length_suite.toml",
            "length_suite_laptop.toml",
            "length_suite_longer.toml",
            "length_suite_small.toml",
            "prope.toml",
            "recall.toml",
            "rope_extension.toml",
            "schemes.toml"
        ]
    );
    assert!(models > 0, "no model configs found in configs/");
    trains.sort();
    assert_eq!(trains, ["finetune_minilm.toml", "train_reviews.toml"]);
    // The embedded default is the shipped file.
    let shipped = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/compare.toml"),
    )
    .unwrap();
    assert_eq!(poslab::runs::DEFAULT_CONFIG, shipped);
}

fn tiny(positional: PositionalConfig) -> Encoder {
    let store = ParamStore::new(0);
    Encoder::new(
        &tiny_config(positional, NormPlacement::Pre),
        store.var_builder(DType::F32, &Device::Cpu),
    )
    .unwrap()
}

fn input_error(encoder: &Encoder, ids: &Tensor, mask: &Tensor, start: usize, needles: &[&str]) {
    assert_error_mentions(
        encoder
            .forward_at(ids, mask, start, false)
            .map(|t| t.dims().to_vec()),
        needles,
    );
}

#[test]
fn a_sequence_longer_than_the_learned_table_is_refused_and_fixed_tables_extend() {
    let learned = tiny(PositionalConfig::Learned(Default::default()));
    let (ids, mask) = padded_batch(2, 33, 40); // max_len is 32
    input_error(
        &learned,
        &ids,
        &mask,
        0,
        &["33 tokens", "max_len = 32", "truncate"],
    );
    let (ids, mask) = padded_batch(2, 10, 40);
    input_error(
        &learned,
        &ids,
        &mask,
        30,
        &["positions 30..40", "max_len = 32"],
    );
    assert!(
        learned.forward_at(&ids, &mask, 22, false).is_ok(),
        "22 + 10 fits 32"
    );

    // Sinusoids and RoPE extrapolate: a length past max_len grows their tables.
    for positional in [
        PositionalConfig::SinusoidalAdd(Default::default()),
        PositionalConfig::Rope(Default::default()),
    ] {
        let encoder = tiny(positional);
        let (ids, mask) = padded_batch(2, 100, 40);
        let out = encoder.forward_t(&ids, &mask, false).unwrap();
        assert_eq!(out.dims(), &[2, 100, 16]);
    }
}

#[test]
fn malformed_batches_are_refused() {
    let encoder = tiny(PositionalConfig::SinusoidalAdd(Default::default()));
    let (ids, mask) = padded_batch(2, 6, 40);
    let dev = &Device::Cpu;

    let too_big = Tensor::new(&[[1u32, 2, 40]], dev).unwrap();
    let ones = Tensor::ones((1, 3), DType::U32, dev).unwrap();
    input_error(
        &encoder,
        &too_big,
        &ones,
        0,
        &["token id 40", "position 2", "vocabulary of 40"],
    );

    let short_mask = Tensor::ones((2, 5), DType::U32, dev).unwrap();
    input_error(
        &encoder,
        &ids,
        &short_mask,
        0,
        &["attention_mask has shape [2, 5]", "[2, 6]"],
    );

    let mut rows = mask.to_vec2::<u32>().unwrap();
    rows[1] = vec![0; 6];
    let empty_row = Tensor::new(rows, dev).unwrap();
    input_error(
        &encoder,
        &ids,
        &empty_row,
        0,
        &["sequence 1", "no real tokens"],
    );

    let twos = (mask.clone() * 2.0).unwrap();
    input_error(
        &encoder,
        &ids,
        &twos,
        0,
        &["attention_mask holds 2", "1 for real tokens"],
    );

    let float_ids = ids.to_dtype(DType::F32).unwrap();
    input_error(&encoder, &float_ids, &mask, 0, &["integer ids", "F32"]);

    let flat = ids.flatten_all().unwrap();
    input_error(&encoder, &flat, &flat, 0, &["(batch, seq_len)", "[12]"]);
}

/// `seed` in an experiment and `seeds` in a train config (each the other's word) are refused
/// with what each means there.
#[test]
fn seed_and_seeds_are_refused_with_what_each_config_means() {
    let dir = tempfile::tempdir().unwrap();
    let experiment = dir.path().join("e.toml");
    std::fs::write(
        &experiment,
        "name = \"x\"\nseed = 3\n[[tasks]]\nkind = \"word_order\"\n[[variants]]\nname = \"r\"\npositional = { kind = \"rope\" }\n",
    )
    .unwrap();
    assert_error_mentions(
        poslab::runs::ExperimentConfig::load(&experiment),
        &["`seeds = N` runs N", "`first_seed`", "unknown field `seed`"],
    );
    let train = dir.path().join("t.toml");
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/train_reviews.toml"),
    )
    .unwrap()
    .replace("seed = 0", "seeds = 2");
    std::fs::write(&train, text).unwrap();
    assert_error_mentions(
        poslab::runs::train_run::TrainRunConfig::load(&train),
        &["one seed: `seed = N`", "unknown field `seeds`"],
    );
}

/// Every key an experiment's or a train run's `[model]` takes, each away from its default.
const EVERY_SHAPE_KEY: &str = "d_model = 24\nn_heads = 3\nn_layers = 3\nffn_dim = 40\n\
    activation = \"relu\"\nnorm = \"post\"\ndropout = 0.25\nattention_dropout = 0.3\n\
    embed_scale = \"sqrt_d_model\"\ntoken_init_std = \"inv_sqrt_d_model\"\n\
    layer_norm_eps = 1e-6\ndtype = \"bf16\"\n";

#[test]
fn a_shared_model_shape_means_what_the_same_keys_mean_in_a_model_config() {
    use poslab::{Choices, ModelShape};
    let rope = PositionalConfig::Rope(Default::default());
    let model = |keys: &str| {
        ModelConfig::from_toml_str(&format!(
            "vocab_size = 50\nmax_len = 32\n{keys}[positional]\nkind = \"rope\"\n"
        ))
        .unwrap()
    };
    // The defaults and every key (away from its default) as a ModelConfig reads them.
    let least = "d_model = 16\nn_heads = 2\nn_layers = 2\nffn_dim = 32\n";
    for keys in [least, EVERY_SHAPE_KEY] {
        let shape: ModelShape = toml::from_str(keys).unwrap();
        assert_eq!(
            shape.model_config(&Choices::of(&rope), 50, 32),
            model(keys),
            "{keys}"
        );
    }
    let pooled: ModelShape = toml::from_str(&format!("{least}pooling = \"first\"")).unwrap();
    assert_eq!(pooled.pooling, poslab::Pooling::First);
    assert_error_mentions(
        toml::from_str::<ModelShape>(&format!("{least}max_len = 8")),
        &["unknown field `max_len`", "`d_model`", "`pooling`"],
    );
    // The default model is the default shape with the sinusoid, 1000 ids and 512 rows.
    let sinusoid = PositionalConfig::SinusoidalAdd(Default::default());
    assert_eq!(
        ModelConfig::default(),
        ModelShape::default().model_config(&Choices::of(&sinusoid), 1000, 512)
    );
    assert_eq!(
        ModelConfig::default(),
        ModelConfig::from_toml_str(
            "vocab_size = 1000\nd_model = 64\nn_heads = 4\nn_layers = 2\nffn_dim = 256\n\
             max_len = 512\n[positional]\nkind = \"sinusoidal_add\"\n"
        )
        .unwrap()
    );
}

#[test]
fn a_models_own_choices_override_the_shape_it_shares() {
    use poslab::{Choices, LayerPlan, ModelShape, Scale};
    let shape: ModelShape = toml::from_str(EVERY_SHAPE_KEY).unwrap();
    let alibi = PositionalConfig::Alibi(Default::default());
    let plan: LayerPlan = toml::from_str("pattern = [\"global\", \"none\", \"global\"]").unwrap();
    let plain = shape.model_config(&Choices::of(&alibi), 50, 32);
    // Table rows: the data's, or randomized positions' range when larger, or the chosen.
    assert_eq!(plain.max_len, 32);
    for (random, max_len, rows) in [
        (Some(100), None, 100),
        (Some(8), None, 32),
        (Some(100), Some(7), 7),
    ] {
        let choices = Choices {
            random_positions: random,
            max_len,
            ..Choices::of(&alibi)
        };
        let config = shape.model_config(&choices, 50, 32);
        assert_eq!((config.max_len, config.random_positions), (rows, random));
    }
    let chosen = Choices {
        positional: &alibi,
        d_model: Some(30),
        embed_scale: Some(Scale::Value(2.0)),
        token_init_std: Some(Scale::Value(0.5)),
        max_len: Some(64),
        random_positions: Some(64),
        layers: Some(&plan),
        causal: None,
    };
    let config = shape.model_config(&chosen, 50, 32);
    let expected = ModelConfig {
        d_model: 30,
        embed_scale: Scale::Value(2.0),
        token_init_std: Scale::Value(0.5),
        max_len: 64,
        random_positions: Some(64),
        layers: Some(plan.clone()),
        ..plain.clone()
    };
    assert_eq!(config, expected);
    assert_ne!(plain, expected);
}

#[test]
fn counted_parameters_are_the_built_models_for_every_scheme_and_head() {
    // What the dry run and the limits count (ModelConfig::param_count and the head's) against
    // the variables a built TaskModel holds: every scheme, with and without biases, causal,
    // without positions in layer 1 (a per-layer plan), and each kind of head.
    use poslab::model::{HeadConfig, TaskModel};
    use poslab::{LayerKind, LayerPlan, Pooling};
    let heads = [
        HeadConfig::Classify {
            classes: 7,
            pooling: Pooling::Mean,
        },
        HeadConfig::Tag { classes: 11 },
        HeadConfig::Mlm,
    ];
    let mut checked = 0;
    for positional in all_schemes() {
        for (bias, causal, plan) in [
            (true, false, false),
            (false, true, false),
            (true, false, true),
        ] {
            let mut config = tiny_config(positional.clone(), NormPlacement::Pre);
            config.bias = bias;
            config.causal = causal;
            if plan {
                config.layers = Some(LayerPlan::new(vec![LayerKind::Global, LayerKind::None]));
            }
            if config.validate().is_err() {
                continue;
            }
            for head in &heads {
                let store = ParamStore::new(0);
                TaskModel::new(&config, head, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
                assert_eq!(
                    config.param_count() + head.param_count(&config),
                    store.num_params() as u128,
                    "{positional:?} (bias {bias}, causal {causal}, plan {plan}), {head:?}"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 3 * 3 * 20, "{checked} checked");
}
