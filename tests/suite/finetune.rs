//! Fine-tuning a pretrained encoder (`init = { model = ... }` in a train config): the tiny BERT
//! of `tests/fixtures/pretrained/` learns a small order task from its own tokenizer's ids, the
//! saved model reloads and scores what its metrics say, a stopped run resumes bit for bit, and
//! configs that mix a pretrained start with poslab's own shape are refused with the fix.

use std::path::{Path, PathBuf};

use candle::{DType, Device};
use poslab::runs::results::Outcome;
use poslab::runs::train_run::{self, Metrics, TrainEnd, TrainRunConfig};

use crate::common::{bits, fixture_path, options};

/// Who chased whom: the label is the first animal named, so a bag of words is right half the
/// time at best (both animals are in every sentence), and chance is 1 in 5.
fn order_task(dir: &Path) -> PathBuf {
    let animals = ["cat", "dog", "fox", "bird", "fish"];
    let adjectives = ["", "big ", "small ", "red ", "quick ", "brown ", "lazy "];
    let mut rows = vec!["text\tlabel".to_string()];
    let mut n = 0usize;
    for (i, a) in animals.iter().enumerate() {
        for (j, b) in animals.iter().enumerate() {
            if i == j {
                continue;
            }
            for verb in ["chased", "saw"] {
                for x in adjectives {
                    for y in adjectives {
                        // Every third sentence, in an order that mixes the labels.
                        n += 1;
                        if n.is_multiple_of(3) {
                            rows.push(format!("the {x}{a} {verb} the {y}{b}\t{a}"));
                        }
                    }
                }
            }
        }
    }
    let path = dir.join("chase.tsv");
    std::fs::write(&path, rows.join("\n") + "\n").unwrap();
    path
}

fn config(data: &Path, init: &str, extra: &str) -> String {
    format!(
        "name = \"chase\"\nseed = 3\ncheckpoint_every = 0\n{init}\n{extra}\n\
         [train]\nbudget = {{ steps = 240 }}\nbatch_size = 16\nlr = 3e-3\neval_every = 80\n\
         [task]\nkind = \"classify\"\ntrain = {:?}\n",
        data.display().to_string()
    )
}

fn tiny_bert() -> String {
    format!(
        "init = {{ model = {:?} }}",
        fixture_path("pretrained/tiny-bert").display().to_string()
    )
}

fn finished(end: TrainEnd) -> Metrics {
    match end {
        TrainEnd::Finished(m) => *m,
        other => panic!("{other:?}"),
    }
}

/// The test score a run's metrics report: `(accuracy, loss)`.
fn test_score(metrics: &Metrics) -> (f64, f64) {
    match &metrics.summary.evaluations[0].outcome {
        Outcome::Scored { accuracy, loss, .. } => (*accuracy, *loss),
        other => panic!("{other:?}"),
    }
}

/// The saved model of `dir` on its task's test set, remade from its config and framed as in
/// training: the encoded set and `(accuracy, loss)`.
fn rescore(loaded: &poslab::saved::Loaded, dir: &Path) -> (poslab::data::Dataset, (f64, f64)) {
    let framing = loaded.config.framing(&loaded.tokenizer).unwrap();
    let spec = loaded.config.task_spec.clone().unwrap();
    let mut task = spec
        .generate_with(&options(dir, None).hub, Some(loaded.tokenizer.clone()))
        .unwrap();
    task.limit.max_tokens = Some(64);
    let set = poslab::data::Dataset::encode(
        &task.tests[0].examples,
        &loaded.tokenizer,
        framing,
        task.limit,
    )
    .unwrap();
    let score = poslab::train::evaluate(
        &loaded.model,
        &set,
        loaded.tokenizer.pad_id(),
        None,
        0,
        32,
        0,
    )
    .unwrap();
    (set, (score.accuracy, score.loss))
}

/// Asserts two saved runs hold the same weights, bit for bit.
fn assert_same_weights(a: &Path, b: &Path) {
    let a = poslab::saved::load(a, DType::F32, &Device::Cpu).unwrap();
    let b = poslab::saved::load(b, DType::F32, &Device::Cpu).unwrap();
    for (name, var) in a.params.vars() {
        let other = b.params.get(&name).unwrap();
        assert_eq!(bits(var.as_tensor()), bits(&other), "{name}");
    }
}

#[test]
fn fine_tuning_tiny_bert_learns_and_the_saved_model_scores_what_its_report_says() {
    let root = tempfile::tempdir().unwrap();
    let data = order_task(root.path());
    let config = TrainRunConfig::from_toml_str(&config(&data, &tiny_bert(), "")).unwrap();
    let dir = root.path().join("run");
    let metrics = finished(train_run::start(&config, &options(&dir, None)).unwrap());

    // The loss falls from ln 5 = 1.61 (a fresh head's near-uniform guess over five labels).
    let first = metrics.summary.validation.first().unwrap()[1];
    let test = test_score(&metrics);
    eprintln!(
        "tiny BERT fine-tuned: final train loss {:.3}, validation {:?}, test accuracy {:.3}",
        metrics.summary.final_train_loss, metrics.summary.validation, test.0
    );
    assert!(
        metrics.summary.final_train_loss < 0.9 * 5f64.ln(),
        "the loss did not fall: {}",
        metrics.summary.final_train_loss
    );
    assert!(test.0 > 0.5, "test accuracy {} (chance 0.2)", test.0);
    assert!(metrics.summary.validation.last().unwrap()[1] >= first);
    // The model's own learned table and the tokenizer's template were used.
    assert_eq!(metrics.positional.name(), "learned");

    // The saved folder reloads, frames texts as in training ([CLS] ... [SEP]) and scores the
    // test set exactly as the report says.
    let loaded = poslab::saved::load(&dir, DType::F32, &Device::Cpu).unwrap();
    assert!(loaded.config.special_tokens);
    assert_eq!(
        loaded.config.init.as_deref(),
        Some(fixture_path("pretrained/tiny-bert").to_str().unwrap())
    );
    let framing = loaded.config.framing(&loaded.tokenizer).unwrap();
    assert_eq!(
        framing,
        poslab::data::Framing::Template { front: 1, back: 1 }
    );
    let (set, score) = rescore(&loaded, &dir);
    assert_eq!(set.samples[0].ids[0], 2, "[CLS] first");
    assert_eq!(*set.samples[0].ids.last().unwrap(), 3, "[SEP] last");
    assert_eq!(score, test);

    // predict --run reads a text the same way.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_poslab"))
        .args([
            "predict",
            "--run",
            dir.to_str().unwrap(),
            "the big fox chased the dog",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        ["cat", "dog", "fox", "bird", "fish"]
            .iter()
            .any(|a| stdout.contains(a)),
        "{stdout}"
    );
    // On a pool of one thread or of three, predict and embed print the same bytes.
    for command in ["predict", "embed"] {
        let at = |threads: &str| {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_poslab"))
                .args([
                    command,
                    "--run",
                    dir.to_str().unwrap(),
                    "--threads",
                    threads,
                ])
                .args(["the big fox chased the dog", "a dog"])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{command} --threads {threads}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            out.stdout
        };
        let one = at("1");
        assert!(!one.is_empty(), "{command}");
        assert!(one == at("3"), "{command}");
    }
}

#[test]
fn the_encoder_starts_from_the_folders_weights_and_the_head_from_the_seed() {
    let root = tempfile::tempdir().unwrap();
    let data = order_task(root.path());
    // Embeddings (word, position, token types where the family has them, norm weight and
    // bias), 2 layers of 15 tensors (the key bias is left out: it adds the same to every score
    // of a query, which softmax ignores).
    for (name, tensors) in [
        ("tiny-bert", 5 + 2 * 15),
        ("tiny-roberta", 5 + 2 * 15),
        ("tiny-distilbert", 4 + 2 * 15),
    ] {
        let path = fixture_path(&format!("pretrained/{name}"));
        let init = format!("init = {{ model = {:?} }}", path.display().to_string());
        // One step at a learning rate of 1e-9: AdamW moves every weight by about 1e-9.
        let text = config(&data, &init, "")
            .replace("steps = 240", "steps = 1")
            .replace("lr = 3e-3", "lr = 1e-9");
        let config = TrainRunConfig::from_toml_str(&text).unwrap();
        let dir = root.path().join(name);
        finished(train_run::start(&config, &options(&dir, None)).unwrap());
        let saved = poslab::saved::load(&dir, DType::F32, &Device::Cpu).unwrap();
        let folder = poslab::pretrained::Folder::read(&path).unwrap();
        let mut compared = 0;
        for (var_name, var) in saved.params.vars() {
            if var_name.starts_with("head.") {
                continue;
            }
            let diff = crate::common::max_abs_diff(var.as_tensor(), &folder.tensors[&var_name]);
            assert!(
                diff < 1e-6,
                "{name}: {var_name} moved {diff} from the folder's"
            );
            compared += 1;
        }
        assert_eq!(compared, tensors, "{name}");
        let head = saved.params.get("head.weight").unwrap();
        assert_eq!(head.dims(), &[5, 32]);
        assert!(
            head.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                > 0.0
        );
        // The texts are framed by the family's template: [CLS] ... [SEP] or <s> ... </s>.
        let framing = saved.config.framing(&saved.tokenizer).unwrap();
        assert_eq!(
            framing,
            poslab::data::Framing::Template { front: 1, back: 1 },
            "{name}"
        );
    }
}

#[test]
fn a_stopped_fine_tuning_resumes_bit_for_bit() {
    let root = tempfile::tempdir().unwrap();
    let data = order_task(root.path());
    let text = config(&data, &tiny_bert(), "").replace("steps = 240", "steps = 30");
    let config = TrainRunConfig::from_toml_str(&text).unwrap();
    let whole = root.path().join("whole");
    finished(train_run::start(&config, &options(&whole, None)).unwrap());
    // Stopped before any checkpoint (the pretrained weights are read again), then after one.
    let parts = root.path().join("parts");
    assert!(matches!(
        train_run::start(&config, &options(&parts, Some(7))).unwrap(),
        TrainEnd::Stopped { step: 7 }
    ));
    assert!(matches!(
        train_run::resume(&options(&parts, Some(19))).unwrap(),
        TrainEnd::Stopped { step: 19 }
    ));
    finished(train_run::resume(&options(&parts, None)).unwrap());
    assert_same_weights(&whole, &parts);
}

#[test]
fn pretrained_starts_that_cannot_work_are_refused_with_the_fix() {
    let root = tempfile::tempdir().unwrap();
    let data = order_task(root.path());
    let refused = |init: &str, extra: &str| -> String {
        let text = config(&data, init, extra);
        match TrainRunConfig::from_toml_str(&text) {
            Err(e) => e.to_string(),
            Ok(config) => train_run::start(&config, &options(&root.path().join("r"), None))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_else(|| panic!("{text} trained")),
        }
    };
    let bert = tiny_bert();
    for (extra, expected) in [
        (
            "[model]\nd_model = 32\nn_heads = 4\nn_layers = 2\nffn_dim = 37",
            "remove [model] and [positional]",
        ),
        ("max_len = 128", "remove max_len"),
        ("random_positions = 100", "remove random_positions"),
    ] {
        let e = refused(&bert, extra);
        assert!(e.contains(expected), "{extra}: {e}");
    }
    let e = refused("", "");
    assert!(e.contains("needs [model] and [positional], or init"), "{e}");
    // The task's own tokenizer, and texts past the table.
    let text =
        config(&data, &bert, "") + "tokenizer = { kind = \"word_level\", lowercase = true }\n";
    let e = TrainRunConfig::from_toml_str(&text)
        .unwrap_err()
        .to_string();
    assert!(e.contains("remove [task] tokenizer"), "{e}");
    let text = config(&data, &bert, "") + "max_tokens = 65\n";
    let config_ = TrainRunConfig::from_toml_str(&text).unwrap();
    let e = train_run::start(&config_, &options(&root.path().join("long"), None))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("max_tokens = 65") && e.contains("at most 64"),
        "{e}"
    );
    // A folder that is not a supported model.
    let gpt = root.path().join("gpt");
    std::fs::create_dir_all(&gpt).unwrap();
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        std::fs::copy(fixture_path("pretrained/tiny-bert").join(f), gpt.join(f)).unwrap();
    }
    let cfg = std::fs::read_to_string(gpt.join("config.json")).unwrap();
    std::fs::write(gpt.join("config.json"), cfg.replace("\"bert\"", "\"gpt2\"")).unwrap();
    let e = refused(
        &format!("init = {{ model = {:?} }}", gpt.display().to_string()),
        "",
    );
    assert!(e.contains("model_type `gpt2` is not supported"), "{e}");
}

fn tiny_modernbert() -> String {
    format!(
        "init = {{ model = {:?} }}",
        fixture_path("pretrained/tiny-modernbert")
            .display()
            .to_string()
    )
}

/// The tiny ModernBERT (RoPE, windows, GeGLU, no biases) fine-tunes as the BERT does: the loss
/// falls, the saved model scores its test set exactly as its report says, and a stopped run
/// resumes bit for bit.
#[test]
fn fine_tuning_tiny_modernbert_learns_saves_and_resumes_bit_for_bit() {
    let root = tempfile::tempdir().unwrap();
    let data = order_task(root.path());
    let config = TrainRunConfig::from_toml_str(&config(&data, &tiny_modernbert(), "")).unwrap();
    let dir = root.path().join("run");
    let metrics = finished(train_run::start(&config, &options(&dir, None)).unwrap());
    let test = test_score(&metrics);
    eprintln!(
        "tiny ModernBERT fine-tuned: final train loss {:.3}, validation {:?}, test accuracy {:.3}",
        metrics.summary.final_train_loss, metrics.summary.validation, test.0
    );
    assert!(
        metrics.summary.final_train_loss < 0.9 * 5f64.ln(),
        "the loss did not fall: {}",
        metrics.summary.final_train_loss
    );
    assert_eq!(metrics.positional.name(), "rope");
    let loaded = poslab::saved::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let model = &loaded.config.model;
    assert!(!model.bias && !model.first_attn_norm);
    assert_eq!(model.layers.as_ref().unwrap().local_window, Some(6));
    assert_eq!(rescore(&loaded, &dir).1, test);

    // Stopped after a checkpoint, resumed: the same weights as the run above, bit for bit.
    let text = self::config(&data, &tiny_modernbert(), "")
        .replace("checkpoint_every = 0", "checkpoint_every = 50");
    let config = TrainRunConfig::from_toml_str(&text).unwrap();
    let whole = root.path().join("whole");
    finished(train_run::start(&config, &options(&whole, None)).unwrap());
    let parts = root.path().join("parts");
    assert!(matches!(
        train_run::start(&config, &options(&parts, Some(60))).unwrap(),
        TrainEnd::Stopped { step: 60 }
    ));
    finished(train_run::resume(&options(&parts, None)).unwrap());
    assert_same_weights(&whole, &parts);
}
