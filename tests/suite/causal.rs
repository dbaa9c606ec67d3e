//! `causal = true`: every scheme with a decoder's mask, on every path. The causal forms of the
//! earlier schemes against the float64 reference (`reference_2026_schemes.py`: T5's decoder
//! buckets and FIRE's query-normalised inputs, and whole encoders), and the property that makes
//! a model causal: a prefix's outputs do not depend on what follows it.

use std::collections::HashMap;

use candle::{DType, Device, IndexOp, Tensor};
use poslab::nn::Kernels;
use poslab::positional::{BiasBatch, Fire, FireOptions};
use poslab::{Encoder, NormPlacement, ParamStore, Positions};

use crate::common::*;

/// Largest absolute difference between two equally long value lists.
fn max_abs(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn t5_decoder_buckets_match_the_reference_exactly() {
    let fx = load_fixture("schemes_2026.safetensors");
    let rel: Vec<i64> = fx["t5.causal.rel"].to_vec1().unwrap();
    assert_eq!((rel[0], rel[rel.len() - 1]), (-300, 300));
    for (n, max) in [(32usize, 128usize), (16, 64), (8, 20)] {
        let expected: Vec<i64> = fx[&format!("t5.causal.bucket.n{n}.max{max}")]
            .to_vec1()
            .unwrap();
        let ours: Vec<i64> = rel
            .iter()
            .map(|&r| poslab::positional::t5_bucket_causal(r, n, max) as i64)
            .collect();
        assert_eq!(ours, expected, "decoder buckets n{n} max{max}");
        // Every bucket serves the left side: all of them are used within 300 tokens.
        assert_eq!(*ours.iter().max().unwrap() as usize, n - 1);
    }
}

/// A FIRE module of 4 heads holding the causal fixture's weights (less its output bias), in
/// f64, causal or not.
fn fixture_fire(fx: &HashMap<String, Tensor>, threshold: f64, causal: bool) -> Fire {
    let store = ParamStore::new(0);
    let fire = Fire::new(
        &FireOptions::threshold(threshold),
        4,
        store.var_builder(DType::F64, &Device::Cpu).pp("fire"),
    )
    .unwrap()
    .with_causal(causal);
    let weights: HashMap<String, Tensor> = ["mlp1.weight", "mlp1.bias", "mlp2.weight", "c"]
        .into_iter()
        .chain(["l_multiplier"])
        .map(|k| (format!("fire.{k}"), fx[&format!("fire.causal.{k}")].clone()))
        .collect();
    store
        .assign(&weights, std::path::Path::new("schemes_2026"))
        .unwrap();
    fire
}

#[test]
fn causal_fire_inputs_and_biases_match_the_reference() {
    // Uneven positions up to 100 and a row starting at 3: inputs normalised by the query's
    // position (not the span), unsigned, 0 above the diagonal.
    const TOL: f64 = 1e-5;
    let fx = load_fixture("schemes_2026.safetensors");
    let positions = Positions::from_tensor(&fx["fire.causal.positions"]).unwrap();
    for threshold in [512.0, 8.0] {
        let fire = fixture_fire(&fx, threshold, true);
        let batch = BiasBatch {
            positions: &positions,
            mask: None,
            dtype: DType::F64,
            device: &Device::Cpu,
            backend: poslab::nn::Backend::default(),
        };
        let key = format!("fire.causal.threshold{}", threshold as u32);
        let inputs = values(&fire.inputs(&batch).unwrap());
        let err = max_abs(&inputs, &values(&fx[&format!("{key}.inputs")]));
        assert!(err < TOL, "{key} inputs: {err:e}");
        // The reference's bias less its output bias b2 (per head), which poslab leaves out.
        let b2 = Tensor::from_vec(
            values(&fx["fire.causal.mlp2.bias"]),
            (1, 4, 1, 1),
            &Device::Cpu,
        )
        .unwrap();
        let reference = fx[&format!("{key}.bias")]
            .to_dtype(DType::F64)
            .unwrap()
            .broadcast_sub(&b2)
            .unwrap();
        let bias = values(&fire.bias(&batch).unwrap());
        let err = max_abs(&bias, &values(&reference));
        assert!(err < TOL, "{key} bias: {err:e}");
        // The encoder's inputs are another thing: signed, over the span.
        let encoder = fixture_fire(&fx, threshold, false);
        let encoder_inputs = values(&encoder.inputs(&batch).unwrap());
        assert!(max_abs(&encoder_inputs, &inputs) > 0.1, "{key}");
    }
}

/// The causal whole-encoder fixtures.
fn causal_fixtures() -> Vec<String> {
    let names: Vec<String> = encoder_fixture_names()
        .into_iter()
        .filter(|n| n.starts_with("encoder_causal_"))
        .collect();
    assert_eq!(names.len(), 16, "{names:?}");
    names
}

#[test]
fn causal_encoders_match_the_reference_on_every_path() {
    // f32 at 1e-4, as every earlier fixture, on the composition, the fused per-op kernels, the
    // fused layers and the device path's CPU twin.
    for name in causal_fixtures() {
        let fx = load_encoder_fixture(&name);
        assert!(fx.config.causal, "{name}");
        let (mut encoder, _) = fx.encoder(DType::F32);
        for (what, backend) in Kernels::ALL
            .map(|k| (k.name(), on(k)))
            .into_iter()
            .chain([("device twin", twin(Kernels::Layer))])
        {
            encoder.set_backend(backend);
            let err = max_abs_diff_real(&fx.hidden(&encoder), &fx.expected, &fx.attention_mask);
            assert!(err <= 1e-4, "{name} on {what}: {err:e}");
        }
        // The same weights without the mask miss the reference: the fixture tells them apart.
        let mut config = fx.config.clone();
        config.causal = false;
        let store = ParamStore::new(0);
        let plain = Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
        let mut weights = fx.weights.clone();
        // The right side's variables the causal fixture has none of: zeros.
        if let Some((right, left)) = right_side(config.positional.name()) {
            for i in 0..config.n_layers {
                let zeros = weights[&format!("layers.{i}.attn.{left}")]
                    .zeros_like()
                    .unwrap();
                weights.insert(format!("layers.{i}.attn.{right}"), zeros);
            }
        }
        store.assign(&weights, std::path::Path::new(&name)).unwrap();
        let err = max_abs_diff_real(&fx.hidden(&plain), &fx.expected, &fx.attention_mask);
        assert!(err > 1e-2, "{name}: the encoder form matches too ({err:e})");
    }
}

/// Every scheme's tiny config, causal; dynamic-NTK RoPE left out (its base grows with the
/// batch's largest position, so a prefix sees another base, as the reference notes).
fn causal_configs() -> Vec<poslab::ModelConfig> {
    all_schemes()
        .into_iter()
        .filter(|p| !depends_on_batch_length(p))
        .map(|p| tiny_config(p, NormPlacement::Pre).with_causal(true))
        .collect()
}

/// `(b, t)` ids of a fixed pattern, every token real.
fn unpadded(b: usize, t: usize) -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..b * t).map(|n| ((n * 11 + 5) % 40) as u32).collect();
    (
        Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap(),
        Tensor::ones((b, t), DType::U32, &Device::Cpu).unwrap(),
    )
}

/// The largest change of the first `cut` outputs between the whole input and its prefix.
fn prefix_change(encoder: &Encoder, cut: usize) -> f64 {
    let (ids, mask) = unpadded(2, 12);
    let whole = encoder.forward_t(&ids, &mask, false).unwrap();
    let (pids, pmask) = (ids.i((.., ..cut)).unwrap(), mask.i((.., ..cut)).unwrap());
    let prefix = encoder.forward_t(&pids, &pmask, false).unwrap();
    max_abs_diff(&whole.i((.., ..cut)).unwrap(), &prefix)
}

#[test]
fn a_causal_prefix_ignores_what_follows_on_every_path() {
    for config in causal_configs() {
        let name = format!("{:?}", config.positional);
        for plan in [None, Some("global"), Some("local")] {
            let mut config = config.clone();
            if let Some(kind) = plan {
                // A plan of a global and a local layer (window 4), or global only.
                let text = match kind {
                    "local" => "pattern = [\"global\", \"local\"]\nlocal_window = 4",
                    _ => "pattern = [\"global\"]",
                };
                config = config.with_layer_plan(toml::from_str(text).unwrap());
            }
            let store = ParamStore::new(7);
            let mut encoder =
                Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
            liven(&store);
            for (what, backend) in Kernels::ALL
                .map(|k| (k.name(), on(k)))
                .into_iter()
                .chain([("device twin", twin(Kernels::Layer))])
            {
                encoder.set_backend(backend);
                for cut in [1, 5, 11] {
                    let change = prefix_change(&encoder, cut);
                    assert!(
                        change < 2e-5,
                        "{name} {plan:?} on {what}: the first {cut} outputs moved by {change:e}"
                    );
                }
            }
        }
        // Without the mask the same model reads what follows: the check can fail.
        let store = ParamStore::new(7);
        let encoder = Encoder::new(
            &config.clone().with_causal(false),
            store.var_builder(DType::F32, &Device::Cpu),
        )
        .unwrap();
        liven(&store);
        assert!(prefix_change(&encoder, 5) > 1e-3, "{name}: an encoder too");
    }
}

#[test]
fn causal_models_train_every_variable_on_every_path() {
    // One backward in training mode: every variable gets a finite, non-zero gradient, on the
    // composition, the fused kernels and the device twin, and the paths agree.
    for config in causal_configs() {
        let name = format!("{:?}", config.positional);
        let mut by_path = Vec::new();
        for backend in [
            on(Kernels::Reference),
            on(Kernels::Layer),
            twin(Kernels::Layer),
        ] {
            let grads = training_gradients_on(&config, &Device::Cpu, &name, backend);
            by_path.push(grads);
        }
        // Relative to the largest gradient of the model: some variables' gradients are tiny
        // (FIRE's at distances far below its threshold), and f32 noise is the model's.
        let top = by_path[0]
            .iter()
            .flat_map(|(_, _, g)| g)
            .fold(0.0f64, |m, v| m.max(v.abs()));
        for (reference, other) in by_path[0]
            .iter()
            .zip(&by_path[1])
            .chain(by_path[0].iter().zip(&by_path[2]))
        {
            assert_eq!(reference.0, other.0);
            let err = max_abs(&reference.2, &other.2) / top;
            assert!(
                err < 1e-4,
                "{name} `{}`: paths differ by {err:e}",
                reference.0
            );
        }
    }
}

#[test]
fn a_causal_cope_has_no_right_table_and_counts_its_parameters() {
    let config = tiny_config(
        poslab::PositionalConfig::Cope(poslab::positional::CopeOptions { npos: 4 }),
        NormPlacement::Pre,
    );
    for causal in [false, true] {
        let config = config.clone().with_causal(causal);
        let store = ParamStore::new(0);
        Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
        let built: usize = store.vars().iter().map(|(_, v)| v.elem_count()).sum();
        assert_eq!(built as u128, config.param_count(), "causal {causal}");
        let right = store.vars().iter().any(|(n, _)| n.contains("cope.right"));
        assert_eq!(right, !causal);
    }
}

#[test]
fn the_last_token_readout_reads_each_sequences_last_real_token() {
    use poslab::model::{HeadConfig, Pooling, TaskModel};
    let config = tiny_config(
        poslab::PositionalConfig::Alibi(Default::default()),
        NormPlacement::Pre,
    )
    .with_causal(true);
    let head = HeadConfig::Classify {
        classes: 3,
        pooling: Pooling::Last,
    };
    let store = ParamStore::new(1);
    let model =
        TaskModel::new(&config, &head, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
    let (ids, mask) = padded_batch(4, 9, 40);
    let hidden = model.encoder().forward_t(&ids, &mask, false).unwrap();
    let pooled = model.pool(&hidden, &mask).unwrap();
    let lengths: Vec<u32> = mask.sum(1).unwrap().to_vec1().unwrap();
    assert!(lengths.iter().any(|&n| n < 9), "some rows are padded");
    for (row, &n) in lengths.iter().enumerate() {
        let want = hidden.i((row, n as usize - 1)).unwrap();
        assert_eq!(bits(&pooled.i(row).unwrap()), bits(&want), "row {row}");
    }
    // Its gradient reaches every variable: under the mask the last token has seen them all.
    let logits = model
        .logits(&ids, &mask, &Positions::range(0, 9).unwrap(), false)
        .unwrap();
    let grads = logits.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    check_all_gradients(&store, &grads, "last-token readout");
    // The first token under a causal mask has seen only itself: refused, naming the fix.
    let first = HeadConfig::Classify {
        classes: 3,
        pooling: Pooling::First,
    };
    let store = ParamStore::new(1);
    assert_error_mentions(
        TaskModel::new(&config, &first, store.var_builder(DType::F32, &Device::Cpu)),
        &["pooling = \"first\"", "causal = true", "pooling = \"last\""],
    );
}

#[test]
fn causal_t5_checks_its_options_against_the_decoders_buckets() {
    let t5 = |buckets, max_distance| {
        tiny_config(
            poslab::PositionalConfig::T5(poslab::positional::T5Options {
                buckets,
                max_distance,
                ..Default::default()
            }),
            NormPlacement::Pre,
        )
    };
    // Exact below buckets / 2 in a decoder: max_distance must reach past it.
    assert_error_mentions(
        t5(8, 4).with_causal(true).validate(),
        &["max_distance = 4", "buckets / 2"],
    );
    t5(8, 4).validate().unwrap();
    t5(8, 5).with_causal(true).validate().unwrap();
    t5(2, 3).with_causal(true).validate().unwrap();
}

/// A tiny model of `positional` (a TOML table's body) trained 20 steps on word order, then
/// `analyze --run` of it: its stdout, and the folder the analysis wrote.
pub(crate) fn trained_and_analysed(
    positional: &str,
    causal: bool,
    root: &std::path::Path,
) -> (String, std::path::PathBuf) {
    use poslab::runs::train_run::{start, TrainRunConfig};
    let run = root.join("run");
    let config = TrainRunConfig::from_toml_str(&format!(
        "name = \"c\"\ncheckpoint_every = 0\n\
         [model]\nd_model = 16\nn_heads = 2\nn_layers = 2\nffn_dim = 32\ndropout = 0.0\n\
         attention_dropout = 0.0\npooling = \"last\"\ncausal = {causal}\n\
         [positional]\n{positional}\n\
         [train]\nbudget = {{ steps = 20 }}\nbatch_size = 16\nlr = 3e-3\neval_every = 20\n\
         [task]\nkind = \"word_order\"\nlengths = [5, 10]\ntrain_examples = 200\neval_examples = 40\n",
    ))
    .unwrap();
    start(&config, &options(&run, None)).unwrap();
    let out = root.join("analysis");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_poslab"))
        .args(["analyze", "--run", run.to_str().unwrap(), "--texts", "8"])
        .args(["--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    (String::from_utf8_lossy(&output.stdout).into_owned(), out)
}

#[test]
fn a_trained_causal_model_is_analysed_saying_what_it_never_reads() {
    let root = tempfile::tempdir().unwrap();
    let (stdout, out) = trained_and_analysed("kind = \"cope\"\nnpos = 8", true, root.path());
    for needle in [
        "causal model: every query reads the keys at or before it only",
        "no right table: keys after the query are masked (causal)",
    ] {
        assert!(stdout.contains(needle), "{needle:?} not in {stdout}");
    }
    assert!(out.join("cope_counts.csv").exists());
}

#[test]
fn a_trained_stick_breaking_model_shows_each_heads_weight_by_offset() {
    // Encoder form: even heads break the stick left first, odd heads right first, so at the
    // nearest offsets the two directions' heads weigh the sides the other way round.
    let root = tempfile::tempdir().unwrap();
    let (stdout, out) = trained_and_analysed("kind = \"stick_breaking\"", false, root.path());
    assert!(
        stdout.contains("stick-breaking: the mean weight by offset"),
        "{stdout}"
    );
    let csv = std::fs::read_to_string(out.join("stick_weights.csv")).unwrap();
    assert!(csv.lines().count() > 4, "{csv}");
    let at = |head: &str, offset: &str| -> f64 {
        let line = stdout
            .lines()
            .find(|l| l.contains(&format!("layer 0 {head}:")))
            .unwrap_or_else(|| panic!("no line for {head} in {stdout}"));
        let after = line.split(&format!("{offset} ")).nth(1).unwrap();
        after.split(',').next().unwrap().trim().parse().unwrap()
    };
    assert!(at("head 0", "-1") > at("head 0", "+1"), "{stdout}");
    assert!(at("head 1", "+1") > at("head 1", "-1"), "{stdout}");
}

#[test]
fn a_pretrained_encoder_refuses_a_causal_mask_naming_why() {
    // Refused as the config is read, before any run folder exists.
    let bert = fixture_path("pretrained/tiny-bert");
    let config = |causal: bool| {
        poslab::runs::train_run::TrainRunConfig::from_toml_str(&format!(
            "name = \"ft\"\ninit = {{ model = {:?}, causal = {causal} }}\n\
             [train]\nbudget = {{ steps = 2 }}\n[task]\nkind = \"classify\"\ntrain = \"d.tsv\"\n",
            bert.display().to_string(),
        ))
    };
    assert_error_mentions(
        config(true),
        &[
            "causal = true",
            "seeing both sides",
            "[model] causal = true",
        ],
    );
    config(false).unwrap();
}

/// An experiment of next-token prediction (`lm`) on the built-in corpus: `causal` or not.
fn lm_experiment(causal: bool) -> String {
    format!(
        "name = \"lm\"\nseeds = 1\n\
         [model]\nd_model = 32\nn_heads = 2\nn_layers = 2\nffn_dim = 64\ncausal = {causal}\n\
         [train]\nbudget = {{ steps = 150 }}\nbatch_size = 32\nlr = 3e-3\n\
         [[tasks]]\nkind = \"lm\"\nlengths = [8, 16]\ntrain_examples = 1000\neval_examples = 60\n\
         [[variants]]\nname = \"rope\"\npositional = {{ kind = \"rope\" }}\n"
    )
}

/// Each test set of `lm_experiment`'s cell scored at its own lengths (1x 8-16, 2x, 4x), at
/// more than four of them, with a perplexity between 2 and `most`: below 2 would be a model
/// that reads the tokens it predicts, since the corpus's choices (which adjective, which of the
/// cast, active or passive) are random.
fn assert_perplexity_by_length(cell: &poslab::runs::results::CellResult, most: f64) {
    use poslab::runs::results::Outcome;
    for (test, lengths) in [("1x", 8..=16), ("2x", 16..=32), ("4x", 32..=64)] {
        let Outcome::Scored {
            loss, by_length, ..
        } = cell.evaluation(test).unwrap()
        else {
            panic!("{test} was not scored");
        };
        assert!(by_length.iter().all(|s| lengths.contains(&s.length)));
        assert!(by_length.len() > 4, "{test}: {} lengths", by_length.len());
        let perplexity = loss.exp();
        assert!(
            perplexity > 2.0 && perplexity < most,
            "{test}: {perplexity}"
        );
    }
}

#[test]
fn next_token_prediction_is_refused_without_a_causal_mask() {
    let err = poslab::runs::ExperimentConfig::from_toml_str(&lm_experiment(false))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("causal = true") && err.contains("kind = \"lm\""),
        "{err}"
    );
}

#[test]
fn a_causal_model_learns_the_corpus_and_reports_perplexity_by_length() {
    use poslab::runs::compare::{run, RunOptions};
    let config = poslab::runs::ExperimentConfig::from_toml_str(&lm_experiment(true)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let results = run(&config, &RunOptions::new(Device::Cpu, dir.path()), &|_| {})
        .unwrap()
        .results;
    // The corpus's unigram perplexity is about 27 (the `lm` unit tests), and a model that reads
    // the document so far is far below it at the training lengths and past them.
    assert_perplexity_by_length(&results.cells[0], 9.0);
    let report = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(report.contains("next-token accuracy"), "{report}");
    assert!(
        report.contains("Perplexity (exp of the mean next-token loss"),
        "{report}"
    );
}

#[test]
fn a_causal_model_learns_a_users_text_file_and_reports_perplexity_past_its_lengths() {
    use poslab::runs::compare::{run, RunOptions};
    // The built-in corpus's documents written as a user's file, one per line: the same
    // grammar, now read word by word from the file, cut into parts, with its own labels.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("documents.txt");
    let lm = poslab::tasks::lm::Lm::default();
    let mut rng = poslab::rng::stream(5, "a user's documents");
    let text: String = (0..150)
        .map(|_| lm.document(&mut rng, 90).join(" ") + "\n")
        .collect();
    std::fs::write(&path, text).unwrap();
    let toml = lm_experiment(true).replace(
        "kind = \"lm\"\n",
        &format!(
            "kind = \"lm\"\ntext_file = {:?}\n",
            path.display().to_string()
        ),
    );
    let config = poslab::runs::ExperimentConfig::from_toml_str(&toml).unwrap();
    let out = dir.path().join("run");
    let results = run(&config, &RunOptions::new(Device::Cpu, &out), &|_| {})
        .unwrap()
        .results;
    // The file's last 10% (1,365 words) holds the test tapes at 1x, 2x and 4x the training
    // lengths; the grammar's perplexity there is the built-in corpus's, far below its unigram
    // 27 at every length.
    assert_perplexity_by_length(&results.cells[0], 10.0);
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(report.contains("Perplexity"), "{report}");
}

#[test]
fn an_experiment_of_both_modes_runs_next_token_prediction_on_its_causal_variants_only() {
    use poslab::runs::compare::{run, RunOptions};
    use poslab::runs::Selection;
    let toml = "name = \"modes\"\nseeds = 2\n\
        [model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
        [train]\nbudget = { steps = 20 }\nbatch_size = 16\n\
        [[tasks]]\nkind = \"prev_token\"\nlengths = [4, 8]\ntrain_examples = 100\neval_examples = 20\n\
        [[tasks]]\nkind = \"lm\"\nlengths = [4, 8]\ntrain_examples = 100\neval_examples = 20\n\
        [[variants]]\nname = \"rope\"\npositional = { kind = \"rope\" }\n\
        [[variants]]\nname = \"rope_causal\"\npositional = { kind = \"rope\" }\ncausal = true\n\
        [[variants]]\nname = \"none_causal\"\npositional = { kind = \"none\" }\ncausal = true\n";
    let config = poslab::runs::ExperimentConfig::from_toml_str(toml).unwrap();
    // prev_token: 3 variants; lm: the 2 causal ones; 2 seeds each.
    let cells = config.cells(&Selection::default()).unwrap();
    assert_eq!(cells.len(), (3 + 2) * 2);
    assert!(!cells.iter().any(|&(t, v, _)| t == 1 && v == 0));
    let dir = tempfile::tempdir().unwrap();
    let results = run(&config, &RunOptions::new(Device::Cpu, dir.path()), &|_| {})
        .unwrap()
        .results;
    // Each row against the first: on prev_token both comparisons have estimates; on lm the
    // encoder's pairs are no comparison at all (neither a verdict nor a skipped one).
    let on = |task: &str| {
        results
            .comparisons
            .iter()
            .filter(|c| c.task == task)
            .map(|c| (c.a.clone(), c.b.clone()))
            .collect::<std::collections::BTreeSet<_>>()
    };
    assert_eq!(on("prev_token").len(), 2);
    assert!(on("lm").is_empty());
    assert!(!results.comparisons_skipped.iter().any(|k| k.task == "lm"));
    let report = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(
        report.contains("causal variants only: rope has no cells here"),
        "{report}"
    );
    assert!(!report.contains("hold no cell of"), "{report}");
    // A task no variant runs is still refused.
    let encoders_only = toml.replace("causal = true", "causal = false");
    let err = poslab::runs::ExperimentConfig::from_toml_str(&encoders_only)
        .unwrap_err()
        .to_string();
    assert!(err.contains("causal = true"), "{err}");
    // So is a variant that runs no task: an encoder beside next-token prediction alone.
    let lm_only = toml.replace(
        "[[tasks]]\nkind = \"prev_token\"\nlengths = [4, 8]\ntrain_examples = 100\neval_examples = 20\n",
        "",
    );
    assert_ne!(lm_only, toml);
    let err = poslab::runs::ExperimentConfig::from_toml_str(&lm_only)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("variant `rope` runs none of the tasks"),
        "{err}"
    );
}
