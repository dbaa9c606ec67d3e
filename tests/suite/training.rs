//! The training loop: budgets, early stopping, divergence, and heads that learn.

use candle::{DType, Device};
use indicatif::ProgressBar;
use poslab::data::{Dataset, MlmMasking};
use poslab::model::{HeadConfig, Pooling, TaskModel};
use poslab::tasks::{Objective, TaskData, TaskSpec};
use poslab::train::{train, Budget, TrainConfig, TrainData, TrainOutcome};
use poslab::{ModelConfig, NormPlacement, ParamStore, PositionalConfig, Precision};

use crate::common::{on, tiny_config, twin};

pub fn task(toml_table: &str) -> TaskSpec {
    #[derive(serde::Deserialize)]
    struct W {
        tasks: Vec<TaskSpec>,
    }
    let w: W = toml::from_str(&format!("[[tasks]]\n{toml_table}")).unwrap();
    w.tasks.into_iter().next().unwrap()
}

/// A recipe: batches of 16, validation every 10 steps, the learning rate 3e-3 unless `extra`
/// sets one.
pub fn recipe(extra: &str) -> TrainConfig {
    let lr = if extra.contains("lr =") {
        ""
    } else {
        "lr = 3e-3\n"
    };
    toml::from_str(&format!("batch_size = 16\neval_every = 10\n{lr}{extra}")).unwrap()
}

pub struct Setup {
    data: TaskData,
    train: Dataset,
    valid: Dataset,
    masking: Option<MlmMasking>,
}

pub fn setup(spec: &TaskSpec) -> Setup {
    let data = spec.generate().unwrap();
    let masking = match data.objective {
        Objective::Mlm { mask_prob } => Some(MlmMasking::new(mask_prob, &data.tokenizer).unwrap()),
        _ => None,
    };
    Setup {
        train: Dataset::encode(&data.train, &data.tokenizer, None, Default::default()).unwrap(),
        valid: Dataset::encode(&data.valid, &data.tokenizer, None, Default::default()).unwrap(),
        masking,
        data,
    }
}

pub fn model_config(s: &Setup, positional: PositionalConfig) -> ModelConfig {
    ModelConfig {
        vocab_size: s.data.tokenizer.vocab_size(),
        max_len: s.train.max_len(),
        ..tiny_config(positional, NormPlacement::Pre)
    }
}

fn head(s: &Setup) -> HeadConfig {
    s.data.objective.head(Pooling::Mean)
}

fn run(
    s: &Setup,
    config: &ModelConfig,
    recipe: &TrainConfig,
    seed: u64,
) -> poslab::Result<(TrainOutcome, TaskModel)> {
    run_on(s, config, recipe, seed, &Device::Cpu)
}

/// [`run`] with the model on `device`.
pub fn run_on(
    s: &Setup,
    config: &ModelConfig,
    recipe: &TrainConfig,
    seed: u64,
    device: &Device,
) -> poslab::Result<(TrainOutcome, TaskModel)> {
    let params = ParamStore::new(seed);
    let model = TaskModel::new(config, &head(s), params.var_builder(DType::F32, device))?;
    let data = TrainData {
        train: &s.train,
        valid: &s.valid,
        pad_id: s.data.tokenizer.pad_id(),
        masking: s.masking.as_ref(),
    };
    let outcome = train(&model, &params, &data, recipe, seed, &ProgressBar::hidden())?;
    Ok((outcome, model))
}

#[test]
fn budgets_stop_where_they_say() {
    let s = setup(&task(
        "kind = \"prev_token\"\nlengths = [4, 8]\ntrain_examples = 200\neval_examples = 40",
    ));
    let config = model_config(&s, PositionalConfig::Rope(Default::default()));
    let (by_steps, _) = run(&s, &config, &recipe("budget = { steps = 23 }"), 0).unwrap();
    assert_eq!((by_steps.steps, by_steps.losses.len()), (23, 23));
    // Validation every 10 steps and at the end.
    let at: Vec<usize> = by_steps.validation.iter().map(|v| v.0).collect();
    assert_eq!(at, vec![10, 20, 23]);

    let (by_tokens, _) = run(&s, &config, &recipe("budget = { tokens = 1500 }"), 0).unwrap();
    assert!(by_tokens.tokens >= 1500, "{} tokens", by_tokens.tokens);
    // The step before the last was still under budget: at most 16 sequences of 8 tokens over.
    assert!(
        by_tokens.tokens < 1500 + 16 * 8,
        "{} tokens",
        by_tokens.tokens
    );
}

#[test]
fn early_stopping_keeps_the_best_weights() {
    let s = setup(&task(
        "kind = \"word_order\"\nlengths = [5, 8]\ntrain_examples = 200\neval_examples = 50",
    ));
    let config = model_config(&s, PositionalConfig::SinusoidalAdd(Default::default()));
    // No later evaluation can beat the first by 2.0 (accuracy is at most 1), so the run stops
    // after `patience` more evaluations and restores the weights of step 10.
    let rule = "budget = { steps = 200 }\nearly_stopping = { patience = 2, min_delta = 2.0 }";
    let (outcome, model) = run(&s, &config, &recipe(rule), 0).unwrap();
    assert!(outcome.stopped_early);
    assert_eq!(outcome.steps, 30);
    assert_eq!(outcome.kept_step, 10);
    let at = |step: usize| outcome.validation.iter().find(|v| v.0 == step).unwrap().1;
    assert_ne!(at(10).loss, at(30).loss, "training moved the weights");
    let pad = s.data.tokenizer.pad_id();
    let seed = poslab::rng::derive_seed(0, "validation masks", 0);
    let now = poslab::train::evaluate(&model, &s.valid, pad, None, seed, 32, 0).unwrap();
    assert_eq!(now.loss, at(10).loss, "the restored weights are step 10's");
}

#[test]
fn a_diverging_run_stops_with_a_clear_message() {
    let s = setup(&task(
        "kind = \"word_order\"\nlengths = [5, 8]\ntrain_examples = 100\neval_examples = 20",
    ));
    let config = model_config(&s, PositionalConfig::Learned(Default::default()));
    let err = run(
        &s,
        &config,
        &recipe("budget = { steps = 50 }\nlr = 1e30\nwarmup = 0.0\ngrad_clip = 0.0"),
        0,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("training stopped"), "{err}");
    assert!(err.contains("became") && err.contains("lower lr"), "{err}");
}

#[test]
fn training_is_reproducible_and_heads_learn_every_objective() {
    let cases = [
        // Chance: 1/16 symbols, 1/4 residues, about 1/60 words.
        ("kind = \"prev_token\"\nk = 1\nlengths = [4, 8]\ntrain_examples = 600\neval_examples = 100", 0.3),
        ("kind = \"position_index\"\nlengths = [4, 8]\ntrain_examples = 600\neval_examples = 100", 0.6),
        ("kind = \"mlm\"\nlengths = [5, 8]\ntrain_examples = 600\neval_examples = 100", 0.2),
    ];
    for (spec, floor) in cases {
        let s = setup(&task(spec));
        let mut config = model_config(&s, PositionalConfig::SinusoidalAdd(Default::default()));
        config.dropout = 0.1;
        let recipe = recipe("budget = { steps = 200 }\nlr = 1e-2");
        let (a, _) = run(&s, &config, &recipe, 4).unwrap();
        let (b, _) = run(&s, &config, &recipe, 4).unwrap();
        assert_eq!(a.losses, b.losses, "{spec}: same seed, same losses");
        assert_eq!(a.validation, b.validation);
        let first = a.losses[..10].iter().sum::<f64>() / 10.0;
        assert!(
            a.final_loss() < 0.7 * first,
            "{spec}: loss {first} -> {}",
            a.final_loss()
        );
        let last = a.validation.last().unwrap().1.accuracy;
        assert!(last > floor, "{spec}: validation accuracy {last}");
        assert!(matches!(recipe.budget, Budget::Steps(200)));
    }
}

#[test]
fn half_precision_trains_like_f32() {
    let s = setup(&task(
        "kind = \"prev_token\"\nk = 1\nlengths = [4, 8]\ntrain_examples = 600\neval_examples = 100",
    ));
    let recipe = recipe("budget = { steps = 150 }\nlr = 1e-2");
    let mut accuracy = Vec::new();
    for precision in [Precision::F32, Precision::Bf16, Precision::F16] {
        let mut config = model_config(&s, PositionalConfig::Rope(Default::default()));
        config.dtype = precision;
        let (a, _) = run(&s, &config, &recipe, 2).unwrap();
        let (b, _) = run(&s, &config, &recipe, 2).unwrap();
        assert_eq!(a.losses, b.losses, "{precision}: same seed, same losses");
        let first = a.losses[..10].iter().sum::<f64>() / 10.0;
        assert!(
            a.final_loss() < 0.7 * first,
            "{precision}: loss {first} -> {}",
            a.final_loss()
        );
        accuracy.push(a.validation.last().unwrap().1.accuracy);
    }
    eprintln!("prev_token validation accuracy f32 / bf16 / f16: {accuracy:?}");
    for (precision, acc) in [("bf16", accuracy[1]), ("f16", accuracy[2])] {
        assert!(
            acc > 0.3 && (acc - accuracy[0]).abs() < 0.1,
            "{precision}: accuracy {acc} against f32's {}",
            accuracy[0]
        );
    }
}

#[test]
fn mlm_reads_a_text_file_and_refuses_bad_ones() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("corpus.txt");
    let lines: Vec<String> = (0..60)
        .map(|i| {
            format!(
                "the cat {} on the mat number {}",
                ["sat", "slept", "ran"][i % 3],
                i % 7
            )
        })
        .collect();
    std::fs::write(&good, lines.join("\n") + "\n\n").unwrap();
    let spec = task(&format!(
        "kind = \"mlm\"\ntext_file = {:?}\ntrain_examples = 1000\neval_examples = 10",
        good.display().to_string()
    ));
    let data = spec.generate().unwrap();
    assert_eq!(
        (
            data.train.len(),
            data.valid.len(),
            data.tests[0].examples.len()
        ),
        (40, 10, 10)
    );
    // The vocabulary is the training split's words, most frequent first, after the specials.
    assert_eq!(data.tokenizer.id_to_token(5).as_deref(), Some("the"));
    assert!(data.tokenizer.token_to_id("slept").is_some());
    let s = Setup {
        train: Dataset::encode(&data.train, &data.tokenizer, None, Default::default()).unwrap(),
        valid: Dataset::encode(&data.valid, &data.tokenizer, None, Default::default()).unwrap(),
        masking: Some(MlmMasking::new(0.15, &data.tokenizer).unwrap()),
        data,
    };
    let config = model_config(&s, PositionalConfig::Rope(Default::default()));
    let (outcome, _) = run(&s, &config, &recipe("budget = { steps = 20 }"), 0).unwrap();
    assert!(outcome.losses.iter().all(|l| l.is_finite()));

    let spec_for = |name: &str, bytes: &[u8], extra: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        task(&format!(
            "kind = \"mlm\"\ntext_file = {:?}\n{extra}",
            path.display().to_string()
        ))
    };
    let e = spec_for("empty.txt", b"\n \n", "")
        .generate()
        .unwrap_err()
        .to_string();
    assert!(e.contains("empty.txt") && e.contains("no examples"), "{e}");
    let e = spec_for("latin1.txt", b"caf\xe9 au lait\n", "")
        .generate()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("latin1.txt:1") && e.contains("invalid UTF-8"),
        "{e}"
    );
    // A line longer than max_tokens: refused with its file and line, or cut when asked.
    let long = b"a b\nc d\ne f\ng h\ni j\nk l\nm n\na b c d e f\n";
    let everything = |data: &poslab::tasks::TaskData| -> Vec<poslab::tasks::Example> {
        data.train
            .iter()
            .chain(&data.valid)
            .chain(&data.tests[0].examples)
            .cloned()
            .collect()
    };
    let data = spec_for("long.txt", long, "max_tokens = 4\neval_examples = 1")
        .generate()
        .unwrap();
    let e = Dataset::encode(&everything(&data), &data.tokenizer, None, data.limit)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("long.txt:8: 6 tokens, more than max_tokens = 4")
            && e.contains("truncate = true"),
        "{e}"
    );
    let data = spec_for(
        "long2.txt",
        long,
        "max_tokens = 4\ntruncate = true\neval_examples = 1",
    )
    .generate()
    .unwrap();
    let cut = Dataset::encode(&everything(&data), &data.tokenizer, None, data.limit).unwrap();
    assert_eq!((cut.truncated, cut.max_len()), (1, 4));
    let e = spec_for("bad.txt", b"x\n", "lengths = [1, 4]")
        .validate()
        .unwrap_err()
        .to_string();
    assert!(e.contains("`lengths` is for generated tasks"), "{e}");
}

#[test]
fn first_token_pooling_reads_a_prepended_cls() {
    let spec =
        task("kind = \"word_order\"\nlengths = [5, 8]\ntrain_examples = 300\neval_examples = 50");
    let data = spec.generate().unwrap();
    let cls = data.tokenizer.cls_id().unwrap();
    let train_set =
        Dataset::encode(&data.train, &data.tokenizer, Some(cls), Default::default()).unwrap();
    assert!(train_set.samples.iter().all(|s| s.ids[0] == cls));
    assert_eq!(
        train_set.samples[0].ids.len(),
        data.train[0].words.len() + 1
    );
    let s = Setup {
        valid: Dataset::encode(&data.valid, &data.tokenizer, Some(cls), Default::default())
            .unwrap(),
        train: train_set,
        masking: None,
        data,
    };
    let config = model_config(&s, PositionalConfig::SinusoidalAdd(Default::default()));
    let params = ParamStore::new(1);
    let head = HeadConfig::Classify {
        classes: 8,
        pooling: Pooling::First,
    };
    let model =
        TaskModel::new(&config, &head, params.var_builder(DType::F32, &Device::Cpu)).unwrap();
    // The pooled vector is the [CLS] position's hidden state.
    let ids = candle::Tensor::new(&[[cls, 7, 9, 11]], &Device::Cpu).unwrap();
    let mask = candle::Tensor::ones((1, 4), DType::U32, &Device::Cpu).unwrap();
    let hidden = model.encoder().forward_t(&ids, &mask, false).unwrap();
    let pooled = model.pool(&hidden, &mask).unwrap();
    let first = hidden.narrow(1, 0, 1).unwrap().squeeze(1).unwrap();
    assert_eq!(
        pooled.to_vec2::<f32>().unwrap(),
        first.to_vec2::<f32>().unwrap()
    );
    let data = TrainData {
        train: &s.train,
        valid: &s.valid,
        pad_id: 0,
        masking: None,
    };
    let outcome = train(
        &model,
        &params,
        &data,
        &recipe("budget = { steps = 60 }"),
        1,
        &ProgressBar::hidden(),
    )
    .unwrap();
    let first = outcome.losses[..5].iter().sum::<f64>() / 5.0;
    assert!(
        outcome.final_loss() < first,
        "loss {first} -> {}",
        outcome.final_loss()
    );
}

#[test]
fn the_learner_trains_any_scheme_with_its_bounds_and_repeats_itself() {
    use crate::common::{padded_batch, values};
    use poslab::prelude::*;
    let device = Device::Cpu;
    let (ids, mask) = padded_batch(4, 9, 30);
    // Tag every token with its id's parity: a token head, padded positions not scored.
    let targets = (ids.to_dtype(DType::F64).unwrap() / 2.0)
        .unwrap()
        .floor()
        .unwrap()
        .affine(-2.0, 0.0)
        .unwrap()
        .add(&ids.to_dtype(DType::F64).unwrap())
        .unwrap()
        .to_dtype(DType::U32)
        .unwrap();
    let head = HeadConfig::Tag { classes: 2 };
    let run = |positional: PositionalConfig, random: Option<usize>| {
        let mut config = ModelConfig::default()
            .with_vocab_size(30)
            .with_width(16, 2)
            .with_ffn(32, poslab::Activation::Gelu)
            .with_positional(positional);
        if let Some(n) = random {
            config = config.with_random_positions(n);
        }
        let mut learner = Learner::new(&config, &head, 3, &device)
            .unwrap()
            .with_optimizer(poslab::train::optim::AdamWConfig::default(), 1e-2)
            .unwrap();
        let losses: Vec<f64> = (0..25)
            .map(|_| learner.step(&ids, &mask, &targets).unwrap())
            .collect();
        (losses, learner)
    };
    for (positional, random) in [
        (PositionalConfig::Kerple(Default::default()), None),
        (PositionalConfig::Rope(RopeOptions::default()), Some(64)),
        (PositionalConfig::Fire(FireOptions::threshold(9.0)), None),
    ] {
        let name = positional.name();
        let (losses, learner) = run(positional.clone(), random);
        assert!(
            losses[24] < 0.5 * losses[0],
            "{name}: {:.3} -> {:.3}",
            losses[0],
            losses[24]
        );
        // The same seed, the same losses, bit for bit.
        assert_eq!(run(positional, random).0, losses, "{name}");
        if name == "kerple" {
            // The bounds the module declared hold: r1, r2 at or above their least value.
            for (n, var) in learner.params().vars() {
                if let Some(lo) = learner.params().bound(&n) {
                    assert!(values(var.as_tensor())
                        .iter()
                        .all(|&v| v >= lo as f32 as f64));
                }
            }
            assert!(learner.params().bound("layers.0.attn.kerple.r1").is_some());
        }
    }
}

/// A training batch is checked where it was built (its largest id and its lengths, counted on
/// the host) instead of by reading its ids and mask back from the device: the loss is the same
/// bits as the encoder's own checked path, token labels included, and a batch whose counts are
/// wrong is refused with what is wrong.
#[test]
fn batches_are_checked_from_what_was_counted_where_they_were_built() {
    use candle::Tensor;
    use poslab::data::Batch;
    let config = tiny_config(
        PositionalConfig::Rope(Default::default()),
        NormPlacement::Pre,
    );
    let store = poslab::ParamStore::new(3);
    let head = HeadConfig::Tag { classes: 5 };
    let model =
        TaskModel::new(&config, &head, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
    let (b, t) = (3, 6);
    let lengths = vec![6, 4, 1];
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 % 39) as u32).collect();
    let mask: Vec<u32> = (0..b * t)
        .map(|i| u32::from(i % t < lengths[i / t]))
        .collect();
    let weights: Vec<f32> = mask.iter().map(|&m| m as f32).collect();
    let targets: Vec<u32> = (0..b * t).map(|i| (i % 5) as u32).collect();
    let scored = weights.iter().filter(|&&w| w > 0.0).count();
    let batch = |max_id: u32, lengths: Vec<usize>| Batch {
        ids: Tensor::from_vec(ids.clone(), (b, t), &Device::Cpu).unwrap(),
        mask: Tensor::from_vec(mask.clone(), (b, t), &Device::Cpu).unwrap(),
        targets: Tensor::from_vec(targets.clone(), (b, t), &Device::Cpu).unwrap(),
        weights: Some(Tensor::from_vec(weights.clone(), (b, t), &Device::Cpu).unwrap()),
        counted: None,
        real_tokens: scored,
        lengths,
        positions: None,
        scored,
        max_id,
    };
    let good = batch(*ids.iter().max().unwrap(), lengths.clone());
    let (loss, _) = model.loss(&good, 0, false).unwrap();
    // The encoder's own path: ids and mask read back and checked, the weights summed.
    let positions = good.positions(0).unwrap();
    let logits = model
        .logits(&good.ids, &good.mask, &positions, false)
        .unwrap();
    let expected =
        poslab::model::cross_entropy(&logits, &good.targets, good.weights.as_ref()).unwrap();
    assert_eq!(
        loss.to_scalar::<f32>().unwrap().to_bits(),
        expected.to_scalar::<f32>().unwrap().to_bits()
    );
    for (bad, lengths, says) in [
        (
            40,
            lengths.clone(),
            "token id 40 is outside the vocabulary of 40",
        ),
        (
            38,
            vec![6, 4, 0],
            "every sequence needs from 1 to 6 real tokens",
        ),
        (38, vec![6, 4], "a batch of 3 sequences"),
    ] {
        let err = model
            .loss(&batch(bad, lengths), 0, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains(says), "{err}");
    }
}

/// The library's inputs answered with what is wrong, never a panic or a silent loss (issue 49,
/// 16-19): a VarBuilder of integers, labels outside the head's classes or of the wrong type or
/// shape, and pooling a sequence with no real token.
#[test]
fn the_library_refuses_what_it_cannot_compute_with_the_fix() {
    use candle::Tensor;
    use poslab::train::Learner;
    let config = tiny_config(
        PositionalConfig::Rope(Default::default()),
        NormPlacement::Pre,
    );
    // Weights of u32: refused where the encoder is built (candle panicked in the forward).
    let store = ParamStore::new(1);
    let err = poslab::Encoder::new(&config, store.var_builder(DType::U32, &Device::Cpu))
        .unwrap_err()
        .to_string();
    assert!(err.contains("U32") && err.contains("DType::F32"), "{err}");

    let head = HeadConfig::Classify {
        classes: 3,
        pooling: Pooling::Mean,
    };
    let mut learner = Learner::new(&config, &head, 3, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu).unwrap();
    let mask = Tensor::ones((2, 3), DType::U32, &Device::Cpu).unwrap();
    let labels = |v: Vec<u32>| Tensor::new(v, &Device::Cpu).unwrap();
    let weights = |l: &Learner| -> Vec<f32> {
        l.params()
            .vars()
            .iter()
            .flat_map(|(_, v)| v.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect()
    };
    let before = weights(&learner);
    for (targets, says) in [
        (
            labels(vec![0, u32::MAX]),
            "label 4294967295 at flat index 1",
        ),
        (
            labels(vec![3, 0]),
            "label 3 at flat index 0 is not a class of this head, which has 3",
        ),
        (labels(vec![0, 1, 2]), "labels of shape [3]"),
        (
            Tensor::new(&[0i64, -1], &Device::Cpu).unwrap(),
            "labels must be unsigned integers",
        ),
    ] {
        let err = learner.step(&ids, &mask, &targets).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    }
    // Nothing was trained on them.
    assert_eq!(weights(&learner), before);
    assert!(learner
        .step(&ids, &mask, &labels(vec![2, 0]))
        .unwrap()
        .is_finite());

    // Mean pooling over a sequence with no real token: refused, not NaN.
    let hidden = Tensor::ones((2, 3, 4), DType::F32, &Device::Cpu).unwrap();
    let empty = Tensor::new(&[[1u32, 1, 0], [0, 0, 0]], &Device::Cpu).unwrap();
    let err = poslab::pretrained::mean_pool(&hidden, &empty, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("sequence 1") && err.contains("no real tokens"),
        "{err}"
    );
}

/// A store whose layers are packed into one variable each (what training does) trains, saves
/// and loads to the bits of one that is not: three AdamW steps with weight decay, its
/// exemptions (norms, biases), a bound (KERPLE's) and gradient clipping by the norm of every
/// named gradient, through the fused CPU update, the composed one (the reference kernels) and
/// the device path's multi-tensor update (its CPU twin). The weights, the optimizer's state by
/// name, the hidden states after training and the saved file's bytes all agree; the zeros
/// packed for missing biases stay zeros; a packed store loads what an unpacked one saved.
#[test]
fn packed_and_unpacked_stores_train_save_and_load_to_the_same_bits() {
    use crate::common::{padded_batch, projection, values};
    use poslab::nn::Kernels;
    use poslab::train::optim::{grad_norm, AdamW, AdamWConfig};
    use poslab::Encoder;
    let dir = tempfile::tempdir().unwrap();
    struct Trained {
        params: Vec<(String, Vec<f64>)>,
        state: Vec<(String, Vec<f64>)>,
        hidden: Vec<f64>,
        file: Vec<u8>,
    }
    let train = |positional: PositionalConfig, bias: bool, (kernels, device), pack: bool| {
        let mut config = tiny_config(positional, NormPlacement::Pre);
        config.bias = bias;
        config.dropout = 0.1;
        let backend = match device {
            true => twin(kernels),
            false => on(kernels),
        };
        {
            {
                let store = ParamStore::new(5);
                let mut encoder =
                    Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu))
                        .unwrap()
                        .with_backend(backend);
                store.constrain(&encoder.constraints()).unwrap();
                store.exempt_from_decay(&encoder.undecayed());
                if pack {
                    encoder.pack(&store).unwrap();
                }
                let mut optimizer = AdamW::from_store(
                    &store,
                    AdamWConfig {
                        weight_decay: 0.1,
                        ..AdamWConfig::default()
                    },
                )
                .unwrap()
                .with_backend(backend);
                let (ids, mask) = padded_batch(4, 9, config.vocab_size as u32);
                for step in 0..3u64 {
                    encoder.set_dropout_seed(step);
                    let hidden = encoder.forward_t(&ids, &mask, true).unwrap();
                    let loss = hidden
                        .mul(&projection(hidden.dims(), 2).to_dtype(DType::F32).unwrap())
                        .unwrap()
                        .sum_all()
                        .unwrap();
                    let grads = loss.backward().unwrap();
                    let gradients: Vec<_> = store
                        .gradients(&grads)
                        .unwrap()
                        .into_iter()
                        .map(|(_, g)| g)
                        .collect();
                    let norm = grad_norm(&gradients, backend).unwrap();
                    optimizer.step(&grads, 1e-2, (0.5 / norm).min(1.0)).unwrap();
                }
                let hidden = values(&encoder.forward_t(&ids, &mask, false).unwrap());
                let path = dir.path().join(format!("{pack}.safetensors"));
                store.save(&path, Default::default()).unwrap();
                let file = std::fs::read(&path).unwrap();
                let mut state: Vec<(String, Vec<f64>)> = optimizer
                    .state()
                    .0
                    .into_iter()
                    .map(|(n, t)| (n, values(&t)))
                    .collect();
                state.sort_by(|a, b| a.0.cmp(&b.0));
                let params = store
                    .params()
                    .into_iter()
                    .map(|(n, t)| (n, values(&t)))
                    .collect();
                Trained {
                    params,
                    state,
                    hidden,
                    file,
                }
            }
        }
    };
    for positional in [
        PositionalConfig::SinusoidalAdd(Default::default()),
        PositionalConfig::Kerple(Default::default()),
        PositionalConfig::Fox(poslab::positional::NoOptions {}),
    ] {
        for bias in [true, false] {
            for kernels in [
                (Kernels::Reference, false),
                (Kernels::Layer, false),
                (Kernels::Layer, true),
            ] {
                let what = format!("{} bias {bias} {kernels:?}", positional.name());
                let (plain, packed) = (
                    train(positional.clone(), bias, kernels, false),
                    train(positional.clone(), bias, kernels, true),
                );
                assert_eq!(plain.params.len(), packed.params.len(), "{what}");
                for ((name, a), (other, b)) in plain.params.iter().zip(&packed.params) {
                    assert_eq!(name, other);
                    assert_eq!(a, b, "{what}: `{name}` after training");
                }
                assert_eq!(plain.state, packed.state, "{what}: optimizer state");
                assert_eq!(plain.hidden, packed.hidden, "{what}: hidden states");
                assert!(plain.file == packed.file, "{what}: the saved files differ");
            }
        }
    }
    // A packed store loads an unpacked one's file, every parameter, by name.
    let config = tiny_config(
        PositionalConfig::SinusoidalAdd(Default::default()),
        NormPlacement::Post,
    );
    let saved = ParamStore::new(1);
    Encoder::new(&config, saved.var_builder(DType::F32, &Device::Cpu)).unwrap();
    let path = dir.path().join("unpacked.safetensors");
    saved.save(&path, Default::default()).unwrap();
    let store = ParamStore::new(2);
    let mut encoder = Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
    encoder.pack(&store).unwrap();
    assert!(store.get("layers.0.attn.q.weight").is_none(), "packed");
    store.load(&path).unwrap();
    for (name, value) in saved.params() {
        assert_eq!(
            values(&store.value(&name).unwrap()),
            values(&value),
            "`{name}` loaded"
        );
    }
}
