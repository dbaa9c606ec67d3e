//! Bad input as a hostile user would give it, and runs interrupted, raced and damaged: each
//! answered with an error that names the problem and the fix, never a panic, an abort, a hang
//! or a silently wrong result.

use std::path::{Path, PathBuf};

use candle::Device;
use poslab::experiment::single::{self, TrainEnd, TrainRunConfig};
use poslab::experiment::ExperimentConfig;
use poslab::text::HubSource;
use poslab::ModelConfig;

use crate::common::*;

fn train_config(task_table: &str) -> TrainRunConfig {
    TrainRunConfig::from_toml_str(&format!(
        "name = \"h\"\ncheckpoint_every = 5\n\
         [model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
         [positional]\nkind = \"rope\"\n\
         [train]\nbudget = {{ steps = 12 }}\nbatch_size = 16\neval_every = 6\n\
         [task]\n{task_table}\n"
    ))
    .unwrap()
}

const WORD_ORDER: &str =
    "kind = \"word_order\"\nlengths = [5, 8]\ntrain_examples = 200\neval_examples = 40";

fn write(dir: &Path, name: &str, text: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_failed_start_leaves_a_folder_a_fresh_start_takes_over() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("s");
    // The data file is missing: the start fails after the folder exists.
    let missing = train_config("kind = \"classify\"\ntrain = \"missing.tsv\"");
    assert_error_mentions(
        single::start(&missing, &options(&run, None)),
        &["missing.tsv"],
    );
    assert!(
        !run.join("train.toml").exists(),
        "a failed start must not look started"
    );
    // --resume says there is nothing to resume; a fresh start with a good config runs.
    assert_error_mentions(
        single::resume(&options(&run, None)),
        &["holds no started run", "--config"],
    );
    let good = train_config(WORD_ORDER);
    assert_eq!(
        single::start(&good, &options(&run, Some(5))).unwrap(),
        TrainEnd::Stopped { step: 5 }
    );
    // A second start into it is refused, resume continues it.
    assert_error_mentions(
        single::start(&good, &options(&run, None)),
        &["already holds a run", "--resume"],
    );
    assert!(matches!(
        single::resume(&options(&run, None)).unwrap(),
        TrainEnd::Finished(_)
    ));
}

#[test]
fn a_second_train_into_a_locked_folder_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("busy");
    std::fs::create_dir_all(&run).unwrap();
    // Another writer (here, this test) holds the run folder's lock.
    let lock = poslab::io::FolderLock::exclusive(&run, "poslab compare").unwrap();
    let config = train_config(WORD_ORDER);
    let busy = [
        "is being written by another poslab process",
        "(poslab compare)",
    ];
    let message = assert_error_mentions(single::start(&config, &options(&run, None)), &busy);
    assert!(message.contains(&run.display().to_string()), "{message}");
    assert_error_mentions(single::resume(&options(&run, None)), &busy);
    drop(lock);
    assert!(matches!(
        single::start(&config, &options(&run, Some(5))).unwrap(),
        TrainEnd::Stopped { .. }
    ));
}

#[test]
fn resume_survives_a_damaged_checkpoint_and_refuses_edits_and_escapes() {
    let root = tempfile::tempdir().unwrap();
    let config = train_config(WORD_ORDER);
    let whole = root.path().join("whole");
    let TrainEnd::Finished(_) = single::start(&config, &options(&whole, None)).unwrap() else {
        panic!("not finished")
    };
    let bytes = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();

    // Stop at 10 (checkpoints 5 and 10 kept), truncate the latest: resume falls back to 5 and
    // still ends with the uninterrupted run's weights.
    let run = root.path().join("run");
    single::start(&config, &options(&run, Some(10))).unwrap();
    let latest = run.join("checkpoints/step-00000010/model.safetensors");
    let full = std::fs::read(&latest).unwrap();
    std::fs::write(&latest, &full[..full.len() / 2]).unwrap();
    // Leftovers of a killed run are cleaned at the next start.
    let leftover = run.join("checkpoints/.step-00000015.999.tmp");
    std::fs::create_dir_all(&leftover).unwrap();
    assert!(matches!(
        single::resume(&options(&run, None)).unwrap(),
        TrainEnd::Finished(_)
    ));
    assert_eq!(bytes(&whole), bytes(&run));
    assert!(!leftover.exists());

    // An edited train.toml is refused, naming the setting.
    let edited = root.path().join("edited");
    single::start(&config, &options(&edited, Some(5))).unwrap();
    let toml = std::fs::read_to_string(edited.join("train.toml")).unwrap();
    std::fs::write(
        edited.join("train.toml"),
        toml.replace("lr = 0.001", "lr = 0.01"),
    )
    .unwrap();
    assert_ne!(
        toml,
        std::fs::read_to_string(edited.join("train.toml")).unwrap()
    );
    assert_error_mentions(
        single::resume(&options(&edited, None)),
        &["edited", "train.lr: 0.001 vs 0.01"],
    );
    std::fs::write(edited.join("train.toml"), &toml).unwrap();

    // `latest` naming a folder outside the run is refused.
    std::fs::write(edited.join("checkpoints/latest"), "../../elsewhere").unwrap();
    assert_error_mentions(
        single::resume(&options(&edited, None)),
        &["not a checkpoint of this run"],
    );
}

#[test]
fn names_that_would_escape_their_folders_are_refused() {
    for name in ["..", ".", "../../escaped", "/abs/path", "a/b", ""] {
        let text = format!(
            "name = {name:?}\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
             [positional]\nkind = \"rope\"\n[train]\nbudget = {{ steps = 2 }}\n[task]\n{WORD_ORDER}\n"
        );
        assert_error_mentions(
            TrainRunConfig::from_toml_str(&text),
            &["must use only letters"],
        );
    }
    let experiment = |variant: &str| {
        ExperimentConfig::from_toml_str(&format!(
            "name = \"e\"\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
             [train]\nbudget = {{ steps = 2 }}\n[[tasks]]\n{WORD_ORDER}\n\
             [[variants]]\nname = {variant:?}\npositional = {{ kind = \"rope\" }}\n"
        ))
    };
    assert_error_mentions(experiment(".."), &["variant name", "not be `.` or `..`"]);
    experiment("rope.v2").unwrap();
}

#[test]
fn float_settings_are_finite_and_in_range() {
    for (setting, needle) in [
        ("weight_decay = nan", "weight_decay = NaN"),
        ("grad_clip = nan", "grad_clip = NaN"),
        ("adam_eps = nan", "adam_eps = NaN"),
        ("lr = inf", "lr = inf"),
        ("warmup = nan", "warmup = NaN"),
        ("min_lr_ratio = -0.5", "min_lr_ratio = -0.5"),
        ("betas = [0.9, nan]", "betas"),
        (
            "early_stopping = { patience = 2, min_delta = nan }",
            "min_delta = NaN",
        ),
    ] {
        let text = format!(
            "name = \"h\"\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
             [positional]\nkind = \"rope\"\n[train]\nbudget = {{ steps = 2 }}\n{setting}\n\
             [task]\n{WORD_ORDER}\n"
        );
        assert_error_mentions(TrainRunConfig::from_toml_str(&text), &[needle]);
    }
}

#[test]
fn sizes_are_bounded_before_anything_is_allocated() {
    let shape = |fields: &str| {
        ModelConfig::from_toml_str(&format!("{fields}\n[positional]\nkind = \"learned\"\n"))
    };
    let base = |d: u64, vocab: u64, ffn: u64, layers: u64, max_len: u64| {
        format!(
            "vocab_size = {vocab}\nd_model = {d}\nn_heads = 2\nn_layers = {layers}\nffn_dim = {ffn}\nmax_len = {max_len}"
        )
    };
    for (fields, needle) in [
        (base(1_000_000_000, 100, 32, 1, 16), "parameters"),
        (base(16, 100_000_000_000, 32, 1, 16), "parameters"),
        (base(16, 100, 1_000_000_000_000, 1, 16), "parameters"),
        (base(16, 100, 32, 100_000_000, 16), "parameters"),
        (base(16, 100, 32, 1, 100_000_000_000), "max_len"),
    ] {
        let message = assert_error_mentions(shape(&fields), &[needle]);
        assert!(
            message.contains("POSLAB_MAX_PARAMS") || message.contains("lower max_len"),
            "{message}"
        );
    }
    // A shift past the largest position, in an experiment and in a train config.
    let text = format!(
        "name = \"e\"\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
         [train]\nbudget = {{ steps = 2 }}\n[eval]\nshift = 1000000000000\n[[tasks]]\n{WORD_ORDER}\n\
         [[variants]]\nname = \"r\"\npositional = {{ kind = \"rope\" }}\n"
    );
    assert_error_mentions(ExperimentConfig::from_toml_str(&text), &["[eval] shift"]);
    // A batch whose attention would not fit: refused before training, with the figure.
    let root = tempfile::tempdir().unwrap();
    let long = "w ".repeat(40_000);
    let short: String = (0..20)
        .map(|i| format!("short text {i}\t{}\n", ["a", "b"][i % 2]))
        .collect();
    let data = write(
        root.path(),
        "long.tsv",
        format!("{short}{long}\ta\n").as_bytes(),
    );
    // The long example is the training file's last line, and held-out rows are drawn from the
    // shuffled file: give explicit valid and test files so that it stays in training.
    let held = write(root.path(), "held.tsv", short.as_bytes());
    let config = train_config(&format!(
        "kind = \"classify\"\ntrain = {:?}\nvalid = {:?}\ntest = {:?}",
        data.display().to_string(),
        held.display().to_string(),
        held.display().to_string()
    ));
    let run = root.path().join("r");
    assert_error_mentions(
        single::start(&config, &options(&run, None)),
        &[
            "training: a batch of 16 x",
            "tokens needs about",
            "GiB",
            "POSLAB_MAX_MEMORY",
        ],
    );
}

#[test]
fn unbounded_and_unreadable_inputs_are_refused() {
    let root = tempfile::tempdir().unwrap();
    // A config that is a device would be read without end.
    assert_error_mentions(ModelConfig::load("/dev/urandom"), &["not a regular file"]);
    // Weights that point at /dev/zero.
    let fake = root.path().join("model.safetensors");
    std::os::unix::fs::symlink("/dev/zero", &fake).unwrap();
    assert_error_mentions(poslab::params::load_tensors(&fake), &["not a regular file"]);
    // A line far longer than any example.
    let line = "w".repeat(5 << 20);
    let data = write(
        root.path(),
        "one_line.tsv",
        format!("{line}\tx\n").as_bytes(),
    );
    let config = train_config(&format!(
        "kind = \"classify\"\ntrain = {:?}",
        data.display().to_string()
    ));
    assert_error_mentions(
        single::start(&config, &options(&root.path().join("r"), None)),
        &["one_line.tsv:1:", "more than the 4.0 MiB a line may be"],
    );
}

#[test]
fn data_files_are_read_as_written() {
    let root = tempfile::tempdir().unwrap();
    let rows: String = (0..40)
        .map(|i| format!("row {i} words here\t{}\n", ["pos", "neg"][i % 2]))
        .collect();
    // A byte-order mark before the header: the header is still the header.
    let bom = write(
        root.path(),
        "bom.tsv",
        &[b"\xEF\xBB\xBFtext\tlabel\n".as_slice(), rows.as_bytes()].concat(),
    );
    let spec = |path: &Path, extra: &str| -> poslab::tasks::TaskSpec {
        toml::from_str(&format!(
            "kind = \"classify\"\ntrain = {:?}\n{extra}",
            path.display().to_string()
        ))
        .unwrap()
    };
    let data = spec(&bom, "").generate().unwrap();
    match &data.objective {
        poslab::tasks::Objective::Classify { labels } => assert_eq!(labels, &["neg", "pos"]),
        other => panic!("{other:?}"),
    }
    // Three fields on a line is an error naming the line, not text "a b" with label "c".
    let three = write(
        root.path(),
        "three.tsv",
        format!("{rows}a\tb\tc\n").as_bytes(),
    );
    assert_error_mentions(spec(&three, "").generate(), &["three.tsv:41:", "3 fields"]);
    // One label only: nothing to learn.
    let one: String = (0..30).map(|i| format!("row {i}\tsame\n")).collect();
    let one = write(root.path(), "one.tsv", one.as_bytes());
    assert_error_mentions(
        spec(&one, "").generate(),
        &["1 label (`same`)", "at least two labels"],
    );
}

#[test]
fn punctuation_is_split_and_unknown_words_are_counted() {
    use poslab::text::TokenizerSpec;
    let texts = vec![
        vec![
            "Kemal.".to_string(),
            "said:".to_string(),
            "hello".to_string(),
        ],
        vec!["hello,".to_string(), "world".to_string()],
    ];
    let tok = TokenizerSpec::default()
        .build(None, &texts, &HubSource::from_vars(None, None, Some("1")))
        .unwrap();
    let enc = tok.encode_words(&["Kemal.", "hello!"]).unwrap();
    let unk = tok.unk_id().unwrap();
    // "Kemal" and "." are known pieces; "!" was never seen.
    assert_eq!(enc.ids.len(), 4, "{:?}", enc.ids);
    assert_eq!(enc.ids.iter().filter(|&&i| i == unk).count(), 1);
    assert_eq!(enc.word_ids, vec![Some(0), Some(0), Some(1), Some(1)]);
}

#[test]
fn report_refuses_runs_of_different_settings() {
    use poslab::experiment::report::merge_runs;
    use poslab::experiment::run::{run, RunOptions};
    use poslab::experiment::Selection;
    let root = tempfile::tempdir().unwrap();
    let make = |lr: &str, dir: &str, seed: u64| {
        let config = ExperimentConfig::from_toml_str(&format!(
            "name = \"same\"\nseeds = 2\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
             [train]\nbudget = {{ steps = 3 }}\nlr = {lr}\n[[tasks]]\n{WORD_ORDER}\n\
             [[variants]]\nname = \"r\"\npositional = {{ kind = \"rope\" }}\n"
        ))
        .unwrap();
        let dir = root.path().join(dir);
        run(
            &config,
            &RunOptions {
                selection: Selection {
                    seeds: vec![seed],
                    ..Default::default()
                },
                ..RunOptions::new(Device::Cpu, &dir)
            },
            &|_| {},
        )
        .unwrap();
        dir
    };
    let a = make("0.001", "a", 0);
    let b = make("0.001", "b", 1);
    let c = make("0.002", "c", 1);
    let merged = merge_runs(&[a.clone(), b], false).unwrap();
    assert_eq!(merged.results.cells.len(), 2);
    assert_eq!(merged.config.train.lr, 0.001);
    assert_error_mentions(
        merge_runs(&[a.clone(), c], false).map(|m| m.results),
        &["different configs", "train.lr: 0.001 vs 0.002"],
    );
    // A run folder without its config cannot be checked.
    std::fs::remove_file(a.join("config.toml")).unwrap();
    assert_error_mentions(
        merge_runs(std::slice::from_ref(&a), false).map(|m| m.results),
        &["no config.toml"],
    );
}

#[test]
fn a_hub_ref_with_a_trailing_newline_is_found() {
    use poslab::text::hub::place_in_cache;
    use poslab::text::RepoRef;
    let cache = tempfile::tempdir().unwrap();
    let repo = RepoRef::parse("acme/tok").unwrap();
    let commit = "0123456789abcdef0123456789abcdef01234567";
    place_in_cache(cache.path(), &repo, commit, "tokenizer.json", b"{}").unwrap();
    let refs = cache.path().join("models--acme--tok/refs/main");
    std::fs::write(&refs, format!("{commit}\n")).unwrap();
    let hub = HubSource {
        cache_dir: cache.path().to_path_buf(),
        offline: true,
    };
    assert!(hub.cached(&repo, "tokenizer.json").is_some());
}

#[test]
fn predictions_count_unknown_tokens_and_one_seed_is_one_value() {
    use poslab::infer::Predictor;
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("r");
    let TrainEnd::Finished(_) =
        single::start(&train_config(WORD_ORDER), &options(&run, None)).unwrap()
    else {
        panic!("not finished")
    };
    let loaded = poslab::saved::load(&run, candle::DType::F32, &Device::Cpu).unwrap();
    let texts = vec![
        "the red fox chased the dog".to_string(),
        "the zebra chased the dog !".to_string(),
    ];
    let out = Predictor::new(&loaded, false).predict(&texts, 1).unwrap();
    assert_eq!((out[0].unknown_tokens, out[1].unknown_tokens), (0, 2));
    let json = serde_json::to_string(&out[1]).unwrap();
    assert!(json.contains("\"unknown_tokens\":2"), "{json}");
    // A report over one seed prints one value per cell and says so.
    let stat = poslab::experiment::results::Stat::of(&[0.5]).unwrap();
    assert_eq!(
        poslab::experiment::report::fmt_stat(&stat, 100.0, 1),
        "50.0"
    );
}
