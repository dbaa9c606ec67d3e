//! Real text in and out: Hub tokenizers from a local cache, trained tokenizers, user data
//! files, `poslab train` with kill-and-resume, saved models, and the predict / embed commands.

use std::path::{Path, PathBuf};
use std::process::Command;

use candle::{DType, Device};
use poslab::data::Dataset;
use poslab::runs::results::Outcome;
use poslab::runs::train_run::{self, Metrics, TrainEnd, TrainRunConfig};
use poslab::text::hub::place_in_cache;
use poslab::text::{HubSource, RepoRef, SubwordModel, TextTokenizer, TokenizerSpec};

use crate::common::*;
use crate::training::task;

fn offline_cache(dir: &Path) -> HubSource {
    HubSource {
        cache_dir: dir.to_path_buf(),
        offline: true,
    }
}

#[test]
fn hub_tokenizers_load_from_the_cache_offline() {
    let cache = tempfile::tempdir().unwrap();
    let hub = offline_cache(cache.path());
    let made = TextTokenizer::word_level(["the", "fox", "ran"]).unwrap();
    let json = made.inner().to_string(false).unwrap();
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let repo = RepoRef::parse("acme/tiny-tok").unwrap();
    let path = place_in_cache(
        cache.path(),
        &repo,
        commit,
        "tokenizer.json",
        json.as_bytes(),
    )
    .unwrap();
    assert!(path.ends_with(format!(
        "models--acme--tiny-tok/snapshots/{commit}/tokenizer.json"
    )));
    assert_eq!(
        std::fs::read_to_string(cache.path().join("models--acme--tiny-tok/refs/main")).unwrap(),
        commit
    );

    // By branch (through refs/main) and pinned to the commit; no network is reachable here,
    // so a success proves none was needed.
    for spec in ["acme/tiny-tok", &format!("acme/tiny-tok@{commit}")] {
        let tok = TokenizerSpec::Hub {
            repo: spec.to_string(),
        }
        .build(None, &[], &hub)
        .unwrap();
        assert_eq!(
            tok.encode("the fox ran").unwrap(),
            made.encode("the fox ran").unwrap(),
            "{spec}"
        );
    }
    // The same through a task with its tokenizer from the Hub.
    let dir = tempfile::tempdir().unwrap();
    let tsv = dir.path().join("d.tsv");
    std::fs::write(
        &tsv,
        (0..30)
            .map(|i| format!("the fox ran\t{}\n", i % 2))
            .collect::<String>(),
    )
    .unwrap();
    let spec = task(&format!(
        "kind = \"classify\"\ntrain = {:?}\ntokenizer = {{ kind = \"hub\", repo = \"acme/tiny-tok\" }}",
        tsv.display().to_string()
    ));
    let data = spec.generate_with(&hub, None).unwrap();
    assert_eq!(data.tokenizer.vocab_size(), made.vocab_size());

    // Not cached and offline: the message says where it looked and what to do.
    let e = TokenizerSpec::Hub {
        repo: "acme/other@v2".into(),
    }
    .build(None, &[], &hub)
    .unwrap_err()
    .to_string();
    for needle in [
        "acme/other@v2",
        "HF_HUB_OFFLINE",
        "models--acme--other",
        "refs/v2",
    ] {
        assert!(e.contains(needle), "{e} lacks {needle}");
    }
    let e = TokenizerSpec::Hub {
        repo: "not a repo".into(),
    }
    .validate()
    .unwrap_err()
    .to_string();
    assert!(e.contains("org/name@revision"), "{e}");
}

#[test]
fn the_cache_location_and_offline_mode_follow_the_environment_rules() {
    let s = HubSource::from_vars(Some("/a/hub".into()), Some("/b".into()), Some("1"));
    assert_eq!((s.cache_dir, s.offline), (PathBuf::from("/a/hub"), true));
    let s = HubSource::from_vars(None, Some("/b".into()), Some("false"));
    assert_eq!((s.cache_dir, s.offline), (PathBuf::from("/b/hub"), false));
    let s = HubSource::from_vars(None, None, None);
    assert!(
        s.cache_dir.ends_with("huggingface/hub") && !s.offline,
        "{:?}",
        s.cache_dir
    );
    assert!(HubSource::from_vars(None, None, Some("TRUE")).offline);
}

#[test]
fn trained_tokenizers_align_words_round_trip_and_never_truncate() {
    let texts: Vec<Vec<String>> = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/reviews.tsv"),
    )
    .unwrap()
    .lines()
    .skip(1)
    .map(|l| {
        l.split('\t')
            .next()
            .unwrap()
            .split_whitespace()
            .map(String::from)
            .collect()
    })
    .collect();
    for model in [SubwordModel::Wordpiece, SubwordModel::Bpe] {
        // (The crate's trainers break ties by hash order, so two trainings may differ: runs
        // save and reuse their tokenizer instead of retraining it.)
        let a = TextTokenizer::train(model, 120, 2, true, &texts).unwrap();
        assert_eq!(
            (a.pad_id(), a.unk_id(), a.cls_id(), a.mask_id()),
            (0, Some(1), Some(2), Some(4))
        );
        assert!(
            a.vocab_size() <= 120 + 5 && a.vocab_size() > 20,
            "{}",
            a.vocab_size()
        );
        // Words the tokenizer splits still map back to their index in the text.
        let words = ["The", "Dessert,", "was", "unbelievably", "superb!"];
        let enc = a.encode_words(&words).unwrap();
        assert!(enc.ids.len() > words.len(), "{model:?}: {:?}", enc.ids);
        let mut seen: Vec<u32> = enc.word_ids.iter().flatten().copied().collect();
        seen.dedup();
        assert_eq!(seen, vec![0, 1, 2, 3, 4], "{model:?}");

        // A tokenizer.json that asks for truncation is loaded with it turned off.
        let mut json: serde_json::Value =
            serde_json::from_str(&a.inner().to_string(false).unwrap()).unwrap();
        json["truncation"] = serde_json::json!({"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0});
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json.to_string()).unwrap();
        let loaded = TextTokenizer::from_file(&path).unwrap();
        assert_eq!(
            loaded.encode_words(&words).unwrap(),
            enc,
            "{model:?}: truncation must be off"
        );
        // Saved and reloaded, it encodes every training text the same.
        a.save(dir.path().join("saved.json")).unwrap();
        let back = TextTokenizer::from_file(dir.path().join("saved.json")).unwrap();
        for t in texts.iter().take(200) {
            assert_eq!(back.encode_words(t).unwrap(), a.encode_words(t).unwrap());
        }
    }
}

#[test]
fn classification_files_split_map_labels_and_refuse_unknown_labels() {
    let dir = tempfile::tempdir().unwrap();
    let rows: String = (0..100)
        .map(|i| format!("{},\"text number {i}\"\n", ["b", "a", "c"][i % 3]))
        .collect();
    let csv = dir.path().join("train.csv");
    std::fs::write(&csv, format!("label,sentence\n{rows}")).unwrap();
    let spec = task(&format!(
        "kind = \"classify\"\ntrain = {:?}\ntext_field = \"sentence\"\nvalid_fraction = 0.2\ntest_fraction = 0.1\ndata_seed = 3",
        csv.display().to_string()
    ));
    let data = spec.generate().unwrap();
    assert_eq!(
        (
            data.train.len(),
            data.valid.len(),
            data.tests[0].examples.len()
        ),
        (70, 20, 10)
    );
    match &data.objective {
        poslab::tasks::Objective::Classify { labels } => assert_eq!(labels, &["a", "b", "c"]),
        other => panic!("{other:?}"),
    }
    // Every example keeps its file and line.
    let e = &data.train[0];
    let line = e.source.as_ref().unwrap().line;
    let expected = ["b", "a", "c"][(line - 2) % 3];
    assert_eq!(
        e.label,
        poslab::tasks::Label::Class(["a", "b", "c"].iter().position(|l| *l == expected).unwrap())
    );
    // The same split from the same seed; another seed, another split.
    assert_eq!(spec.generate().unwrap().train, data.train);

    let valid = dir.path().join("valid.jsonl");
    std::fs::write(
        &valid,
        "{\"sentence\": \"ok\", \"label\": \"a\"}\n{\"sentence\": \"new\", \"label\": \"zzz\"}\n",
    )
    .unwrap();
    let spec = task(&format!(
        "kind = \"classify\"\ntrain = {:?}\nvalid = {:?}\ntext_field = \"sentence\"",
        csv.display().to_string(),
        valid.display().to_string()
    ));
    let e = spec.generate().unwrap_err().to_string();
    assert!(
        e.contains("valid.jsonl:2")
            && e.contains("label `zzz` does not occur in the training data"),
        "{e}"
    );
}

fn train_config(task_table: &str, positional: &str, extra: &str) -> TrainRunConfig {
    TrainRunConfig::from_toml_str(&format!(
        "name = \"t\"\nseed = 5\n{extra}\n\
         [model]\nd_model = 16\nn_heads = 2\nn_layers = 2\nffn_dim = 32\ndropout = 0.1\nattention_dropout = 0.1\n\
         [positional]\n{positional}\n\
         [train]\nbudget = {{ steps = 45 }}\nbatch_size = 16\nlr = 3e-3\neval_every = 10\nearly_stopping = {{ patience = 50 }}\n\
         [task]\n{task_table}\n"
    ))
    .unwrap()
}

fn finished(end: TrainEnd) -> Metrics {
    match end {
        TrainEnd::Finished(m) => *m,
        other => panic!("{other:?}"),
    }
}

fn reviews_task() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/reviews.tsv");
    format!(
        "kind = \"classify\"\ntrain = {:?}\ntrain_examples = 600",
        path.display().to_string()
    )
}

#[test]
fn a_run_stopped_and_resumed_ends_with_the_weights_of_one_that_never_stopped() {
    let root = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mlm_file = dir.path().join("corpus.txt");
    let lines: String = (0..200)
        .map(|i| {
            format!(
                "the cat {} on mat {}\n",
                ["sat", "ran", "slept"][i % 3],
                i % 11
            )
        })
        .collect();
    std::fs::write(&mlm_file, lines).unwrap();
    // A trained WordPiece tokenizer, saved once and used by both runs (training one twice need
    // not give the same vocabulary).
    let texts: Vec<Vec<String>> = task(&reviews_task())
        .generate()
        .unwrap()
        .train
        .into_iter()
        .map(|e| e.words)
        .collect();
    let wordpiece = dir.path().join("wordpiece.json");
    TextTokenizer::train(SubwordModel::Wordpiece, 100, 2, true, &texts)
        .unwrap()
        .save(&wordpiece)
        .unwrap();
    let cases = [
        // Dropout, early-stopping bookkeeping and a subword tokenizer.
        train_config(
            &format!(
                "{}\ntokenizer = {{ kind = \"file\", path = {:?} }}",
                reviews_task(),
                wordpiece.display().to_string()
            ),
            "kind = \"rope\"",
            "checkpoint_every = 7",
        ),
        // MLM masks drawn per step.
        train_config(
            &format!(
                "kind = \"mlm\"\ntext_file = {:?}",
                mlm_file.display().to_string()
            ),
            "kind = \"learned\"",
            "checkpoint_every = 10",
        ),
    ];
    for (i, config) in cases.iter().enumerate() {
        let whole = root.path().join(format!("whole{i}"));
        let parts = root.path().join(format!("parts{i}"));
        let full = finished(train_run::start(config, &options(&whole, None)).unwrap());
        // Stop between checkpoints (23), resume, stop again at a checkpoint (30), resume to the end.
        assert_eq!(
            train_run::start(config, &options(&parts, Some(23))).unwrap(),
            TrainEnd::Stopped { step: 23 }
        );
        assert!(parts.join("checkpoints/step-00000023").is_dir());
        // Resumed with other kernels, it would not end as one that never stopped: refused.
        let mut other = options(&parts, Some(30));
        other.backend = other.backend.with_kernels(poslab::nn::Kernels::Reference);
        assert_error_mentions(
            train_run::resume(&other),
            &[
                "began on cpu with the layer kernels",
                "on cpu with the reference kernels",
                "--device cpu --kernels layer",
            ],
        );
        assert_eq!(
            train_run::resume(&options(&parts, Some(30))).unwrap(),
            TrainEnd::Stopped { step: 30 }
        );
        let resumed = finished(train_run::resume(&options(&parts, None)).unwrap());
        let bytes = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
        assert_eq!(
            bytes(&whole),
            bytes(&parts),
            "case {i}: the resumed weights differ"
        );
        assert_eq!(
            resumed.summary.evaluations, full.summary.evaluations,
            "case {i}"
        );
        assert_eq!(
            resumed.summary.validation, full.summary.validation,
            "case {i}"
        );
        assert_eq!(
            (
                resumed.summary.steps,
                resumed.summary.tokens,
                resumed.summary.final_train_loss
            ),
            (
                full.summary.steps,
                full.summary.tokens,
                full.summary.final_train_loss
            )
        );
        // Two checkpoints are kept at most.
        let kept = std::fs::read_dir(parts.join("checkpoints"))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("step-")
            })
            .count();
        assert!(kept <= 2, "{kept} checkpoints kept");
        // A finished run is not resumed, and a folder holding a run is not overwritten.
        assert!(train_run::resume(&options(&parts, None))
            .unwrap_err()
            .to_string()
            .contains("already finished"));
        assert!(train_run::start(config, &options(&parts, None))
            .unwrap_err()
            .to_string()
            .contains("--resume"));
    }
}

#[test]
fn saved_models_reload_bit_for_bit_and_corrupt_folders_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("run");
    let config = train_config(
        &reviews_task(),
        "kind = \"sinusoidal_concat\"\npos_dim = 6",
        "checkpoint_every = 0",
    );
    let metrics = finished(train_run::start(&config, &options(&dir, None)).unwrap());
    let loaded = poslab::saved::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let again = poslab::saved::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let data = config
        .task
        .generate_with(&options(&dir, None).hub, Some(loaded.tokenizer.clone()))
        .unwrap();
    let test =
        Dataset::encode(&data.tests[0].examples, &loaded.tokenizer, None, data.limit).unwrap();
    let score = poslab::train::evaluate(
        &loaded.model,
        &test,
        loaded.tokenizer.pad_id(),
        None,
        0,
        32,
        0,
    )
    .unwrap();
    match &metrics.summary.evaluations[0].outcome {
        Outcome::Scored { accuracy, loss, .. } => {
            assert_eq!((score.accuracy, score.loss), (*accuracy, *loss))
        }
        other => panic!("{other:?}"),
    }
    let (ids, mask) = padded_batch(2, 5, 20);
    let positions = poslab::Positions::range(0, ids.dim(1).unwrap()).unwrap();
    let a = loaded.model.logits(&ids, &mask, &positions, false).unwrap();
    let b = again.model.logits(&ids, &mask, &positions, false).unwrap();
    assert_eq!(bits(&a), bits(&b));

    let copy = |name: &str| {
        let d = root.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        for f in ["config.json", "model.safetensors", "tokenizer.json"] {
            std::fs::copy(dir.join(f), d.join(f)).unwrap();
        }
        d
    };
    let load_err = |d: &Path| {
        poslab::saved::load(d, DType::F32, &Device::Cpu)
            .err()
            .expect("refused")
            .to_string()
    };
    let truncated = copy("truncated");
    let weights = std::fs::read(truncated.join("model.safetensors")).unwrap();
    std::fs::write(
        truncated.join("model.safetensors"),
        &weights[..weights.len() / 2],
    )
    .unwrap();
    assert!(load_err(&truncated).contains("not a readable safetensors file"));

    // Weights of another model (a learned table, another token width): every mismatch listed.
    let other = root.path().join("other");
    finished(
        train_run::start(
            &train_config(
                &reviews_task(),
                "kind = \"learned\"",
                "checkpoint_every = 0",
            ),
            &options(&other, None),
        )
        .unwrap(),
    );
    let swapped = copy("swapped");
    std::fs::copy(
        other.join("model.safetensors"),
        swapped.join("model.safetensors"),
    )
    .unwrap();
    let e = load_err(&swapped);
    assert!(
        e.contains("tok_emb.weight") && e.contains("unexpected tensor `pos_emb.weight`"),
        "{e}"
    );

    let bad_tok = copy("bad_tokenizer");
    std::fs::write(bad_tok.join("tokenizer.json"), "{ not json").unwrap();
    assert!(load_err(&bad_tok).contains("not a valid tokenizer.json"));
    let bad_config = copy("bad_config");
    std::fs::write(
        bad_config.join("config.json"),
        "{\"format\": \"poslab-model/1\"}",
    )
    .unwrap();
    assert!(load_err(&bad_config).contains("config.json"));
}

fn poslab(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_poslab"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn the_cli_trains_predicts_tags_embeds_and_truncates_only_when_asked() {
    let root = tempfile::tempdir().unwrap();
    // A tagging model with a learned table of 8 rows, from JSONL.
    let tags = root.path().join("tags.jsonl");
    let lines: String = (0..120)
        .map(|i| {
            let words: Vec<String> = (0..3 + i % 5)
                .map(|j| ["ann", "bo", "ran", "sat", "home"][(i + j) % 5].to_string())
                .collect();
            let labels: Vec<&str> = words
                .iter()
                .map(|w| if w == "ann" || w == "bo" { "PER" } else { "O" })
                .collect();
            serde_json::json!({"words": words, "labels": labels}).to_string() + "\n"
        })
        .collect();
    std::fs::write(&tags, lines).unwrap();
    let config = root.path().join("train.toml");
    std::fs::write(
        &config,
        train_config(
            &format!(
                "kind = \"tag\"\ntrain = {:?}\nmax_tokens = 8",
                tags.display().to_string()
            ),
            "kind = \"learned\"",
            "checkpoint_every = 0",
        )
        .to_toml(),
    )
    .unwrap();
    let run = root.path().join("run");
    let (ok, stdout, stderr) = poslab(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--out",
        run.to_str().unwrap(),
        "--quiet",
        "--device",
        "cpu",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("test 1x") && stdout.contains("model folder"),
        "{stdout}"
    );

    let run_s = run.to_str().unwrap();
    let (ok, stdout, stderr) = poslab(&["predict", "--run", run_s, "ann ran home", "--json"]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        (v["type"].as_str(), v["words"].as_array().unwrap().len()),
        (Some("tags"), 3)
    );
    assert_eq!(v["tags"][0], "PER");

    let long = "ann bo ran sat home ann bo ran sat home";
    let (ok, _, stderr) = poslab(&["predict", "--run", run_s, long]);
    assert!(
        !ok && stderr.contains("10 tokens")
            && stderr.contains("learned position table holds 8")
            && stderr.contains("--truncate"),
        "{stderr}"
    );
    let (ok, stdout, stderr) = poslab(&["predict", "--run", run_s, long, "--truncate"]);
    assert!(
        ok && stderr.contains("cut to the first 8 of 10 tokens"),
        "{stderr}"
    );
    assert_eq!(stdout.split_whitespace().count(), 8, "{stdout}");

    let input = root.path().join("texts.txt");
    std::fs::write(&input, "ann sat\n\nbo ran home\n").unwrap();
    let (ok, stdout, stderr) =
        poslab(&["embed", "--run", run_s, "--input", input.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    let vectors: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(vectors.len(), 2);
    assert_eq!(vectors[1]["text"], "bo ran home");
    assert_eq!(vectors[0]["embedding"].as_array().unwrap().len(), 16);

    let (ok, _, stderr) = poslab(&["predict", "--run", run_s]);
    assert!(!ok && stderr.contains("no text given"), "{stderr}");
    let (ok, _, stderr) = poslab(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--out",
        run_s,
    ]);
    assert!(!ok && stderr.contains("already holds a run"), "{stderr}");

    // Mixed precision at inference: an f32-trained model run in bf16 tags as f32 does.
    let (ok, stdout, stderr) = poslab(&[
        "predict",
        "--run",
        run_s,
        "ann ran home",
        "--json",
        "--dtype",
        "bf16",
    ]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["tags"][0], "PER", "{stdout}");
    let (ok, _, stderr) = poslab(&["predict", "--run", run_s, "ann", "--dtype", "fp8"]);
    assert!(
        !ok && stderr.contains("fp8") && stderr.contains("f32, bf16, f16"),
        "{stderr}"
    );
    // A resumed run keeps the dtype it started with.
    let (ok, _, stderr) = poslab(&["train", "--resume", run_s, "--dtype", "bf16"]);
    assert!(
        !ok && stderr.contains("--dtype bf16 with --resume") && stderr.contains("drop --dtype"),
        "{stderr}"
    );
}

/// A run whose loss diverges says that resuming would stop at the same step (training is
/// deterministic). Before its first checkpoint it leaves no run behind, so the fixed config
/// starts in the same folder; after one, the run is kept and the advice is another folder.
#[test]
fn a_diverging_run_leaves_a_folder_the_fixed_config_can_use() {
    let root = tempfile::tempdir().unwrap();
    let config = |lr: &str, checkpoints: usize| {
        TrainRunConfig::from_toml_str(&format!(
            "name = \"t\"\ncheckpoint_every = {checkpoints}\n\
             [model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
             [positional]\nkind = \"rope\"\n\
             [train]\nbudget = {{ steps = 20 }}\nbatch_size = 16\nlr = {lr}\nwarmup = 0.0\n\
             grad_clip = 0.0\neval_every = 10\n\
             [task]\nkind = \"word_order\"\nlengths = [5, 8]\ntrain_examples = 200\neval_examples = 20\n"
        ))
        .unwrap()
    };
    let dir = root.path().join("run");
    let e = train_run::start(&config("1e30", 0), &options(&dir, None))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the loss became")
            && e.contains("stops here every time")
            && e.contains("holds no run now"),
        "{e}"
    );
    for f in ["train.toml", "inputs.json", "tokenizer.json"] {
        assert!(!dir.join(f).exists(), "{f} left behind");
    }
    let e = train_run::resume(&options(&dir, None))
        .unwrap_err()
        .to_string();
    assert!(e.contains("holds no started run"), "{e}");
    finished(train_run::start(&config("3e-3", 0), &options(&dir, None)).unwrap());

    // Checkpoints every step, and a rate that takes a few steps to blow up: the run is kept.
    let kept = root.path().join("kept");
    let e = train_run::start(&config("1e6", 1), &options(&kept, None))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("stops here every time")
            && e.contains("keeps the run, but --resume would stop here again")
            && e.contains("another --out"),
        "{e}"
    );
    assert!(kept.join("train.toml").is_file() && kept.join("checkpoints/latest").is_file());
    // The kept run records why it stopped: resuming it is refused, inspect says so, and
    // predict does not advise resuming it.
    let why = std::fs::read_to_string(kept.join("stopped.txt")).unwrap();
    assert!(why.contains("the loss became"), "{why}");
    let e = train_run::resume(&options(&kept, None))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("stopped for good: the loss became")
            && e.contains("--resume would stop at the same step")
            && e.contains("another --out"),
        "{e}"
    );
    let kept_s = kept.to_str().unwrap();
    let (ok, out, e) = poslab(&["inspect", kept_s]);
    assert!(ok, "{e}");
    assert!(
        out.contains("stopped for good: the loss became") && !out.contains("--resume"),
        "{out}"
    );
    let (ok, _, e) = poslab(&["predict", "--run", kept_s, "a text"]);
    assert!(
        !ok && e.contains("stopped for good") && !e.contains("--resume"),
        "{e}"
    );
    // Without the record, a resume runs again, stops at the same step, and records it again.
    std::fs::remove_file(kept.join("stopped.txt")).unwrap();
    let again = train_run::resume(&options(&kept, None))
        .unwrap_err()
        .to_string();
    assert!(again.contains("stops here every time"), "{again}");
    assert_eq!(
        std::fs::read_to_string(kept.join("stopped.txt")).unwrap(),
        why
    );
    // An unfinished run that did not stop holds no model either: predict says so, and how to
    // finish it.
    let unfinished = root.path().join("unfinished");
    std::fs::create_dir(&unfinished).unwrap();
    std::fs::copy(kept.join("train.toml"), unfinished.join("train.toml")).unwrap();
    let (ok, _, e) = poslab(&["predict", "--run", unfinished.to_str().unwrap(), "a text"]);
    assert!(
        !ok && e.contains("a `poslab train` run that has not finished")
            && e.contains("poslab train --resume"),
        "{e}"
    );
}
