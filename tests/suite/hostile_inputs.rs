//! Bad input as a hostile user would give it, and runs interrupted, raced and damaged: each
//! answered with an error that names the problem and the fix, never a panic, an abort, a hang
//! or a silently wrong result.

use std::path::{Path, PathBuf};

use candle::Device;
use poslab::runs::train_run::{self, TrainEnd, TrainRunConfig};
use poslab::runs::ExperimentConfig;
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
        train_run::start(&missing, &options(&run, None)),
        &["missing.tsv"],
    );
    assert!(
        !run.join("train.toml").exists(),
        "a failed start must not look started"
    );
    // --resume says there is nothing to resume; a fresh start with a good config runs.
    assert_error_mentions(
        train_run::resume(&options(&run, None)),
        &["holds no started run", "--config"],
    );
    let good = train_config(WORD_ORDER);
    assert_eq!(
        train_run::start(&good, &options(&run, Some(5))).unwrap(),
        TrainEnd::Stopped { step: 5 }
    );
    // A second start into it is refused, resume continues it.
    assert_error_mentions(
        train_run::start(&good, &options(&run, None)),
        &["already holds a run", "--resume"],
    );
    assert!(matches!(
        train_run::resume(&options(&run, None)).unwrap(),
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
    let message = assert_error_mentions(train_run::start(&config, &options(&run, None)), &busy);
    assert!(message.contains(&run.display().to_string()), "{message}");
    assert_error_mentions(train_run::resume(&options(&run, None)), &busy);
    drop(lock);
    assert!(matches!(
        train_run::start(&config, &options(&run, Some(5))).unwrap(),
        TrainEnd::Stopped { .. }
    ));
}

#[test]
fn resume_survives_a_damaged_checkpoint_and_refuses_edits_and_escapes() {
    let root = tempfile::tempdir().unwrap();
    let config = train_config(WORD_ORDER);
    let whole = root.path().join("whole");
    let TrainEnd::Finished(_) = train_run::start(&config, &options(&whole, None)).unwrap() else {
        panic!("not finished")
    };
    let bytes = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();

    // Stop at 10 (checkpoints 5 and 10 kept), truncate the latest: resume falls back to 5 and
    // still ends with the uninterrupted run's weights.
    let run = root.path().join("run");
    train_run::start(&config, &options(&run, Some(10))).unwrap();
    let latest = run.join("checkpoints/step-00000010/model.safetensors");
    let full = std::fs::read(&latest).unwrap();
    std::fs::write(&latest, &full[..full.len() / 2]).unwrap();
    // Leftovers of a killed run are cleaned at the next start.
    let leftover = run.join("checkpoints/.step-00000015.999.tmp");
    std::fs::create_dir_all(&leftover).unwrap();
    assert!(matches!(
        train_run::resume(&options(&run, None)).unwrap(),
        TrainEnd::Finished(_)
    ));
    assert_eq!(bytes(&whole), bytes(&run));
    assert!(!leftover.exists());

    // An edited train.toml is refused, naming the setting.
    let edited = root.path().join("edited");
    train_run::start(&config, &options(&edited, Some(5))).unwrap();
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
        train_run::resume(&options(&edited, None)),
        &["edited", "train.lr: 0.001 vs 0.01"],
    );
    std::fs::write(edited.join("train.toml"), &toml).unwrap();

    // `latest` naming a folder outside the run is refused.
    std::fs::write(edited.join("checkpoints/latest"), "../../elsewhere").unwrap();
    assert_error_mentions(
        train_run::resume(&options(&edited, None)),
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
    // A task whose plot would overwrite the length suite's overview (issue 49, 15).
    let named_suite = ExperimentConfig::from_toml_str(&format!(
        "name = \"e\"\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
         [train]\nbudget = {{ steps = 2 }}\n[[tasks]]\nname = \"suite\"\n{WORD_ORDER}\n\
         [[variants]]\nname = \"v\"\npositional = {{ kind = \"rope\" }}\n"
    ));
    assert_error_mentions(
        named_suite,
        &["named `suite`", "plots/length_suite.png", "another `name`"],
    );
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
fn task_options_that_are_not_finite_are_refused_with_their_range() {
    // A task table's numbers reach the task's own checks as written: NaN and the infinities
    // were turned into "absent" on the way (flip_flop's `ignore` then took its default, and
    // vanished from the recorded config) or into an error naming neither key nor value.
    for (task, needle) in [
        (
            "kind = \"flip_flop\"\nignore = nan",
            "ignore = NaN must be in [0, 1)",
        ),
        (
            "kind = \"flip_flop\"\nignore = inf",
            "ignore = inf must be in [0, 1)",
        ),
        (
            "kind = \"flip_flop\"\nignore = -inf",
            "ignore = -inf must be in [0, 1)",
        ),
        (
            "kind = \"mqar\"\nqueries = nan",
            "queries = NaN must be in (0, 1]",
        ),
        ("kind = \"mlm\"\nmask_prob = nan", "mask_prob = NaN"),
    ] {
        let text = format!(
            "name = \"h\"\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
             [train]\nbudget = {{ steps = 2 }}\n[[tasks]]\n{task}\nlengths = [8, 12]\n\
             [[variants]]\nname = \"rope\"\npositional = {{ kind = \"rope\" }}\n"
        );
        assert_error_mentions(ExperimentConfig::from_toml_str(&text), &[needle]);
    }
    // A finite value in range is kept, and recorded as given.
    let text = "name = \"h\"\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
                [train]\nbudget = { steps = 2 }\n[[tasks]]\nkind = \"flip_flop\"\nignore = 0.5\n\
                lengths = [8, 12]\n[[variants]]\nname = \"rope\"\npositional = { kind = \"rope\" }\n";
    let config = ExperimentConfig::from_toml_str(text).unwrap();
    assert!(
        config.to_toml().contains("ignore = 0.5"),
        "{}",
        config.to_toml()
    );
}

#[test]
fn public_library_ops_refuse_what_they_cannot_compute_on_every_path() {
    use candle::{DType, Tensor};
    use poslab::nn::{masked_softmax, sided_differences, Kernels, Projections, Transport};
    let cpu = Device::Cpu;
    let ones = |dims: &[usize]| Tensor::ones(dims, DType::F32, &cpu).unwrap();
    let scores = ones(&[2, 3, 4, 4]);
    // Each path: the reference compositions, the fused per-op kernels, and the CUDA ops'
    // CPU forms. A panic fails the test as surely as a wrong answer.
    let paths = [
        ("reference", on(Kernels::Reference)),
        ("ops", on(Kernels::Ops)),
        ("gpu ops on the cpu", twin(Kernels::Ops)),
    ];
    for (path, backend) in paths {
        {
            for (bias, why) in [
                (ones(&[3, 4]), "does not fit"),
                (ones(&[2, 5]), "does not fit"),
                (ones(&[8]), "rank"),
            ] {
                let err = masked_softmax(&scores, &bias, backend)
                    .unwrap_err()
                    .to_string();
                assert!(err.contains(why), "{path}: {err}");
            }
            let err = masked_softmax(&ones(&[2, 3, 0, 0]), &ones(&[2, 0]), backend)
                .unwrap_err()
                .to_string();
            assert!(err.contains("hold no score"), "{path}: {err}");
            // One bias row for every batch element: what the composition broadcasts, on every
            // path, and the same as the bias given per element.
            let row = Tensor::new(&[[0f32, 0.0, -1e9, 0.0]], &cpu).unwrap();
            let shared = masked_softmax(&scores, &row, backend).unwrap();
            let each = masked_softmax(
                &scores,
                &row.broadcast_as((2, 4)).unwrap().contiguous().unwrap(),
                backend,
            )
            .unwrap();
            assert_eq!(shared.dims(), [2, 3, 4, 4], "{path}");
            assert_eq!(values(&shared), values(&each), "{path}");
            // Differences of two running sums: g of another shape, or empty inputs.
            let f = ones(&[2, 5]);
            for g in [ones(&[2, 4]), ones(&[1, 5]), ones(&[10])] {
                assert!(
                    sided_differences(&f, &g, backend).is_err(),
                    "{path}: g {:?}",
                    g.dims()
                );
            }
            let empty = sided_differences(&ones(&[0, 5]), &ones(&[0, 5]), backend).unwrap();
            assert_eq!(empty.dims(), [0, 5, 5], "{path}");
            let empty = sided_differences(&ones(&[2, 0]), &ones(&[2, 0]), backend).unwrap();
            assert_eq!(empty.dims(), [2, 0, 0], "{path}");
            // PaTH's transport: no heads, no tokens, or a z of other heads.
            let (u, z) = (ones(&[1, 3, 4]), ones(&[1, 3, 2]));
            let p = |u: &Tensor, z: &Tensor, heads: usize| {
                let p = Projections {
                    u,
                    conv: None,
                    z,
                    mask: None,
                    heads,
                    eps: 1e-6,
                };
                (
                    Transport::from_projections(p, backend)
                        .map(|_| ())
                        .map_err(|e| e.to_string()),
                    Transport::compose(p, backend)
                        .map(|_| ())
                        .map_err(|e| e.to_string()),
                )
            };
            for (u, z, heads, why) in [
                (&u, &ones(&[1, 3, 0]), 0, "heads = 0"),
                (&ones(&[1, 0, 4]), &ones(&[1, 0, 2]), 2, "empty"),
                (&u, &ones(&[1, 3, 1]), 2, "is not (b, t, heads)"),
                (&u, &z, 3, "does not split"),
            ] {
                let (fused, composed) = p(u, z, heads);
                for got in [fused, composed] {
                    let err = got.unwrap_err();
                    assert!(err.contains(why), "{path}: {err}");
                }
            }
            let (fused, composed) = p(&u, &z, 2);
            assert!(fused.is_ok() && composed.is_ok(), "{path}");
        }
    }
}

#[test]
fn sizes_are_bounded_before_anything_is_allocated() {
    // A config is checked against the limits a run, a predictor or a benchmark holds (the
    // command line's from POSLAB_MAX_PARAMS), after its fields.
    let limits = poslab::limits::Limits::default();
    let shape = |fields: &str| {
        ModelConfig::from_toml_str(&format!("{fields}\n[positional]\nkind = \"learned\"\n"))
            .and_then(|c| c.check_limits(&limits).map(|()| c))
    };
    let base = |d: u64, vocab: u64, ffn: u64, layers: u64, max_len: u64| {
        format!(
            "vocab_size = {vocab}\nd_model = {d}\nn_heads = 2\nn_layers = {layers}\nffn_dim = {ffn}\nmax_len = {max_len}"
        )
    };
    for (fields, needle) in [
        (base(1_000_000_000, 100, 32, 1, 16), "d_model = 1000000000"),
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
    // Raised limits admit a model the defaults refuse; building it is still held to the
    // machine's memory, whatever the caller's limits.
    let huge = ModelConfig::from_toml_str(&format!(
        "{}\n[positional]\nkind = \"learned\"\n",
        base(16, 100_000_000_000, 32, 1, 16)
    ))
    .unwrap();
    let raised = poslab::limits::Limits {
        max_params: u64::MAX,
        ..limits
    };
    huge.check_limits(&raised).unwrap();
    let store = poslab::ParamStore::new(0);
    assert_error_mentions(
        poslab::Encoder::new(&huge, store.var_builder(candle::DType::F32, &Device::Cpu))
            .map(|_| ()),
        &[
            "parameters",
            "more than the memory this process may use",
            "vocab_size",
        ],
    );
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
        train_run::start(&config, &options(&run, None)),
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
    assert_error_mentions(
        poslab::params::load_tensors(&fake, 1 << 20),
        &["not a regular file"],
    );
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
        train_run::start(&config, &options(&root.path().join("r"), None)),
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
    use poslab::runs::compare::{run, RunOptions};
    use poslab::runs::merge::merge_runs;
    use poslab::runs::Selection;
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
        train_run::start(&train_config(WORD_ORDER), &options(&run, None)).unwrap()
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
    let stat = poslab::runs::results::Stat::of(&[0.5]).unwrap();
    assert_eq!(poslab::runs::report::fmt_stat(&stat, 100.0, 1), "50.0");
}

// Round 3: pretrained folders, weight files, analyze flags, resumes and the environment.

/// A copy of a pretrained fixture folder, to break.
fn pretrained_copy(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture_path("pretrained").join(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    dir
}

/// A safetensors tensor as stored: dtype, shape, bytes.
type Stored = (String, Vec<usize>, Vec<u8>);

/// Rewrites every tensor of a safetensors file through `f` (its name and what it stores; a new
/// dtype, shape and bytes, or `None` to keep it), keeping the metadata.
fn rewrite_safetensors(path: &Path, f: impl Fn(&str, &Stored) -> Option<Stored>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out_header = serde_json::Map::new();
    let mut out_data = Vec::new();
    let mut names: Vec<&String> = header.keys().collect();
    names.sort_by_key(|k| header[*k]["data_offsets"][0].as_u64().unwrap_or(0));
    for name in names {
        let v = &header[name];
        if name == "__metadata__" {
            out_header.insert(name.clone(), v.clone());
            continue;
        }
        let [a, b] = [0, 1].map(|i| v["data_offsets"][i].as_u64().unwrap() as usize);
        let stored: Stored = (
            v["dtype"].as_str().unwrap().to_string(),
            serde_json::from_value(v["shape"].clone()).unwrap(),
            data[a..b].to_vec(),
        );
        let (dtype, shape, bytes) = f(name, &stored).unwrap_or(stored);
        let begin = out_data.len();
        out_data.extend_from_slice(&bytes);
        out_header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, out_data.len()]}),
        );
    }
    let header = serde_json::to_vec(&out_header).unwrap();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.extend_from_slice(&out_data);
    std::fs::write(path, file).unwrap();
}

/// `poslab args` with at most 8 GiB of address space and 120 s: a hang or an abort fails the
/// test instead of stalling it. Returns the exit status, stdout and stderr.
fn poslab_bounded(args: &[&str], envs: &[(&str, &str)]) -> (Option<i32>, String, String) {
    use std::io::Read as _;
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 8388608 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_poslab"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env("RAYON_NUM_THREADS", "1")
        .envs(envs.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut pipes = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = pipes.0.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = pipes.1.read_to_string(&mut s);
        s
    });
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > std::time::Duration::from_secs(120) {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("poslab {args:?} hung (killed after 120 s)");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    assert!(
        !err.contains("panicked") && !err.contains("memory allocation of"),
        "poslab {args:?}: {err}"
    );
    (status.code(), out, err)
}

/// Stores `tensor` of a safetensors file as `dtype` (zero bytes of that dtype's size: the
/// values do not matter to a refusal).
fn retype(path: &Path, tensor: &str, dtype: &str) {
    rewrite_safetensors(path, |name, (_, shape, _)| {
        (name == tensor).then(|| {
            let n = shape.iter().product();
            (dtype.to_string(), shape.clone(), bytes_of(dtype, n))
        })
    });
}

/// `count` zero values as `dtype`'s bytes.
fn bytes_of(dtype: &str, count: usize) -> Vec<u8> {
    let size = match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        _ => 8,
    };
    vec![0u8; count * size]
}

/// A ModernBERT or BERT folder that lacks a tensor its config needs is refused naming the
/// tensor, not only by its count of values.
#[test]
fn a_missing_tensor_is_named() {
    for (folder, missing) in [
        ("tiny-modernbert", "model.layers.1.mlp.Wi.weight"),
        (
            "tiny-bert",
            "bert.encoder.layer.0.attention.self.query.weight",
        ),
    ] {
        let dir = pretrained_copy(folder);
        let path = dir.path().join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        // Its bytes stay in the file, unlisted: only the header changes.
        assert!(header.remove(missing).is_some(), "{folder} holds {missing}");
        let header = serde_json::to_vec(&header).unwrap();
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(&header);
        file.extend_from_slice(&bytes[8 + n..]);
        std::fs::write(&path, file).unwrap();
        let err = match poslab::pretrained::Pretrained::load(dir.path(), &Device::Cpu) {
            Ok(_) => panic!("{folder} without {missing} loaded"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains(missing) && !err.contains("values"),
            "{folder}: {err}"
        );
    }
}

/// A BERT tokenizer whose template types a single text 1 is refused: poslab adds row 0 of the
/// token-type table to every token, and would read such a text as a segment it is not. Type 0
/// throughout (BERT's own template) loads.
#[test]
fn a_template_that_types_single_texts_other_than_zero_is_refused() {
    let dir = pretrained_copy("tiny-bert");
    let path = dir.path().join("tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let single = json["post_processor"]["single"].as_array_mut().unwrap();
    assert_eq!(single.len(), 3);
    single[1]["Sequence"]["type_id"] = 1.into();
    single[2]["SpecialToken"]["type_id"] = 1.into();
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    let err = match poslab::pretrained::Pretrained::load(dir.path(), &Device::Cpu) {
        Ok(_) => panic!("a template of type 1 loaded"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("tokenizer.json")
            && err.contains("gives a single text token type 1")
            && err.contains("[0, 1, 1]")
            && err.contains("\"type_id\": 0"),
        "{err}"
    );
    assert!(poslab::pretrained::Pretrained::load(
        &fixture_path("pretrained/tiny-bert"),
        &Device::Cpu
    )
    .is_ok());
}

#[test]
fn weights_of_a_dtype_poslab_does_not_load_are_refused_by_name() {
    // One tensor of the tiny BERT in each dtype poslab does not load: refused, naming the
    // tensor and its dtype, and what is accepted (an F8 tensor used to loop for ever).
    let table = "bert.embeddings.word_embeddings.weight";
    for dtype in [
        "F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8", "BOOL", "I16", "U16", "I32", "U32", "I64",
        "U64", "C64",
    ] {
        let dir = pretrained_copy("tiny-bert");
        retype(&dir.path().join("model.safetensors"), table, dtype);
        let err = match poslab::pretrained::Pretrained::load(dir.path(), &Device::Cpu) {
            Ok(_) => panic!("{dtype} loaded"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains(&format!("tensor `{table}` is stored as {dtype}"))
                && err.contains("F32, F16, BF16, F64"),
            "{dtype}: {err}"
        );
    }
    // The F8 file through every command that reads weights, under a time limit.
    let dir = pretrained_copy("tiny-bert");
    retype(&dir.path().join("model.safetensors"), table, "F8_E4M3");
    let d = dir.path().to_str().unwrap();
    for args in [
        vec!["embed", "--model", d, "a cat"],
        vec!["inspect", "--model", d],
        vec!["predict", "--model", d, "the [MASK] sat"],
    ] {
        let (code, _, err) = poslab_bounded(&args, &[]);
        assert!(
            code == Some(1) && err.contains("is stored as F8_E4M3"),
            "{args:?}: {err}"
        );
    }
    // train with init = { model = ... }: refused before the run folder is started.
    let root = tempfile::tempdir().unwrap();
    let data = write(
        root.path(),
        "d.tsv",
        b"the cat sat\ta\nthe dog ran\tb\n".repeat(20).as_slice(),
    );
    let config = TrainRunConfig::from_toml_str(&format!(
        "name = \"ft\"\ninit = {{ model = {d:?} }}\n[train]\nbudget = {{ steps = 2 }}\n\
         [task]\nkind = \"classify\"\ntrain = {:?}\n",
        data.display().to_string()
    ))
    .unwrap();
    let run = root.path().join("run");
    assert_error_mentions(
        train_run::start(&config, &options(&run, None)),
        &["F8_E4M3"],
    );
    assert!(!run.join("train.toml").exists());
    // A poslab model folder with an F8 tensor: predict --run refuses it too.
    let model = root.path().join("m");
    let TrainEnd::Finished(_) =
        train_run::start(&train_config(WORD_ORDER), &options(&model, None)).unwrap()
    else {
        panic!("not finished")
    };
    retype(
        &model.join("model.safetensors"),
        "tok_emb.weight",
        "F8_E5M2",
    );
    let (code, _, err) = poslab_bounded(
        &["predict", "--run", model.to_str().unwrap(), "the dog"],
        &[],
    );
    assert!(
        code == Some(1) && err.contains("`tok_emb.weight` is stored as F8_E5M2"),
        "{err}"
    );
    // The dtypes poslab does load: BF16 weights load, within BF16's rounding of the F32 ones.
    let bf16 = pretrained_copy("tiny-bert");
    rewrite_safetensors(
        &bf16.path().join("model.safetensors"),
        |_, (dtype, shape, bytes)| {
            (dtype == "F32").then(|| {
                // Truncation to the upper 16 bits of each f32 is a valid bfloat16.
                let b: Vec<u8> = bytes.chunks(4).flat_map(|c| [c[2], c[3]]).collect();
                ("BF16".to_string(), shape.clone(), b)
            })
        },
    );
    let a =
        poslab::pretrained::Pretrained::load(&fixture_path("pretrained/tiny-bert"), &Device::Cpu)
            .unwrap();
    let b = poslab::pretrained::Pretrained::load(bf16.path(), &Device::Cpu).unwrap();
    let w = |m: &poslab::pretrained::Pretrained| m.params.get("tok_emb.weight").unwrap();
    assert!(max_abs_diff(&w(&a), &w(&b)) < 1e-2);
}

#[test]
fn weight_files_never_cost_more_memory_than_their_tensors() {
    // A sparse 30 GiB model.safetensors (under the 64 GiB file limit), all zeros: a header of
    // length 0, refused without reading the file (it used to allocate 30 GiB and abort).
    // The file made 30 GiB long, sparse: its bytes kept, or none of them.
    let sparse = |keep: bool| {
        let dir = pretrained_copy("tiny-bert");
        let file = std::fs::OpenOptions::new()
            .write(true)
            .truncate(!keep)
            .open(dir.path().join("model.safetensors"))
            .unwrap();
        file.set_len(30 << 30).unwrap();
        dir
    };
    let dir = sparse(false);
    let d = dir.path().to_str().unwrap();
    let (code, _, err) = poslab_bounded(&["embed", "--model", d, "a cat"], &[]);
    assert!(
        code == Some(1) && err.contains("not a readable safetensors file"),
        "{err}"
    );
    // The real tensors followed by 30 GiB of sparse zeros: only the tensors are read.
    let dir = sparse(true);
    let d = dir.path().to_str().unwrap();
    let (code, out, err) = poslab_bounded(&["embed", "--model", d, "a cat"], &[]);
    assert!(code == Some(0) && out.contains("embedding"), "{err}");
    // A config.json claiming a vocabulary of 60,000,000 over small weights: refused against
    // the file's header before the encoder is built at that size (it used to abort).
    let dir = pretrained_copy("tiny-bert");
    let path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("\"vocab_size\": 36", "\"vocab_size\": 60000000"),
    )
    .unwrap();
    let d = dir.path().to_str().unwrap();
    let (code, _, err) = poslab_bounded(&["inspect", "--model", d], &[]);
    assert!(
        code == Some(1)
            && err.contains("but config.json describes a model of")
            && err.contains("do not belong together"),
        "{err}"
    );
    // The same of a poslab model folder.
    let root = tempfile::tempdir().unwrap();
    let model = root.path().join("m");
    let TrainEnd::Finished(_) =
        train_run::start(&train_config(WORD_ORDER), &options(&model, None)).unwrap()
    else {
        panic!("not finished")
    };
    let path = model.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["model"]["vocab_size"] = 60_000_000.into();
    std::fs::write(&path, config.to_string()).unwrap();
    let (code, _, err) =
        poslab_bounded(&["embed", "--run", model.to_str().unwrap(), "the dog"], &[]);
    assert!(code == Some(1) && err.contains("vocab_size"), "{err}");
    // A header that promises more bytes than the file holds.
    let dir = pretrained_copy("tiny-bert");
    let weights = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() - 100]).unwrap();
    let (code, _, err) = poslab_bounded(&["inspect", "--model", dir.path().to_str().unwrap()], &[]);
    assert!(
        code == Some(1) && err.contains("are not inside the"),
        "{err}"
    );
}

#[test]
fn a_hundred_megabyte_line_costs_what_the_model_reads() {
    let root = tempfile::tempdir().unwrap();
    let line = "the cat sat on the mat ".repeat(100 << 20 >> 5);
    let input = write(root.path(), "long.txt", format!("{line}\n").as_bytes());
    let input = input.to_str().unwrap();
    let model = fixture_path("pretrained/tiny-bert");
    let model = model.to_str().unwrap();
    let (code, _, err) = poslab_bounded(&["embed", "--model", model, "--input", input], &[]);
    assert!(
        code == Some(1) && err.contains("more than 64 tokens") && err.contains("--truncate"),
        "{err}"
    );
    let (code, out, err) = poslab_bounded(
        &["embed", "--model", model, "--input", input, "--truncate"],
        &[],
    );
    assert!(code == Some(0), "{err}");
    // The cut text is read as the first 64 tokens of the whole one.
    let (_, short, _) = poslab_bounded(
        &[
            "embed",
            "--model",
            model,
            "--truncate",
            &"the cat sat on the mat ".repeat(40),
        ],
        &[],
    );
    let embedding = |s: &str| -> serde_json::Value {
        serde_json::from_str::<serde_json::Value>(s.trim()).unwrap()["embedding"].clone()
    };
    assert_eq!(embedding(&out), embedding(&short));
}

#[test]
fn analyze_flags_are_bounded() {
    for (args, expected) in [
        (vec!["--dim", "1000000000"], "--dim 1000000000"),
        (
            vec!["--dim", "1000000", "--positions", "8192"],
            "--dim 1000000",
        ),
        (
            vec!["--dim", "8192", "--positions", "8192"],
            "values in all",
        ),
        (
            vec!["--dim", "4611686018427387904"],
            "--dim 4611686018427387904",
        ),
        (
            vec!["--start", "18446744073709551615"],
            "--start 18446744073709551615",
        ),
        (vec!["--texts", "0"], "--texts 0"),
    ] {
        for scheme in ["sinusoidal", "rope"] {
            let mut a = vec!["analyze", scheme, "--out", "/nonexistent/never-written"];
            a.extend(&args);
            let (code, _, err) = poslab_bounded(&a, &[]);
            assert!(code == Some(1) && err.contains(expected), "{a:?}: {err}");
        }
    }
    // --model: --texts 0 names the flag (it used to blame reviews.tsv); a reference row past
    // the table is refused (it used to read the last row instead).
    let model = fixture_path("pretrained/tiny-bert");
    let model = model.to_str().unwrap();
    let out = tempfile::tempdir().unwrap();
    let o = out.path().to_str().unwrap();
    let (code, _, err) = poslab_bounded(
        &["analyze", "--model", model, "--texts", "0", "--out", o],
        &[],
    );
    assert!(
        code == Some(1) && err.contains("--texts 0") && !err.contains("reviews"),
        "{err}"
    );
    let (code, _, err) = poslab_bounded(
        &[
            "analyze",
            "--model",
            model,
            "--reference",
            "100",
            "--positions",
            "128",
            "--out",
            o,
        ],
        &[],
    );
    assert!(
        code == Some(1) && err.contains("--reference 100 is not among the 64 rows"),
        "{err}"
    );
    // One row: nothing to measure, said so (it used to print inf and -inf).
    let dir = pretrained_copy("tiny-bert");
    let path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace(
            "\"max_position_embeddings\": 64",
            "\"max_position_embeddings\": 1",
        ),
    )
    .unwrap();
    rewrite_safetensors(
        &dir.path().join("model.safetensors"),
        |name, (dtype, shape, bytes)| {
            name.ends_with("position_embeddings.weight").then(|| {
                (
                    dtype.clone(),
                    vec![1, shape[1]],
                    bytes[..4 * shape[1]].to_vec(),
                )
            })
        },
    );
    let (code, _, err) = poslab_bounded(
        &[
            "analyze",
            "--model",
            dir.path().to_str().unwrap(),
            "--out",
            o,
        ],
        &[],
    );
    assert!(code == Some(1) && err.contains("1 row: distances"), "{err}");
    // The linear-map summary compares each offset with a random table's at the same offset.
    let (code, out, err) = poslab_bounded(&["analyze", "--model", model, "--out", o], &[]);
    assert!(code == Some(0), "{err}");
    let line = out.lines().find(|l| l.contains("best linear map")).unwrap();
    assert!(
        line.contains("below a random table's") && !line.contains("at least"),
        "{line}"
    );
}

#[test]
fn a_start_that_fails_a_check_leaves_no_run_behind() {
    let root = tempfile::tempdir().unwrap();
    // An own model whose randomized positions cannot cover its inputs: refused before
    // train.toml is written; fixed, the same folder starts.
    let run = root.path().join("r");
    let mut bad = train_config(WORD_ORDER);
    bad.random_positions = Some(4);
    assert_error_mentions(
        train_run::start(&bad, &options(&run, None)),
        &["random_positions = 4"],
    );
    assert!(!run.join("train.toml").exists() && !run.join("tokenizer.json").exists());
    assert_error_mentions(
        train_run::resume(&options(&run, None)),
        &["holds no started run"],
    );
    bad.random_positions = Some(64);
    assert!(matches!(
        train_run::start(&bad, &options(&run, Some(5))).unwrap(),
        TrainEnd::Stopped { step: 5 }
    ));
    // A RoBERTa start whose texts exceed max_tokens: the error says truncate = true, and
    // with it the same folder starts.
    let data = write(
        root.path(),
        "d.tsv",
        b"the cat sat on the mat\ta\nthe dog ran to the tree\tb\n"
            .repeat(20)
            .as_slice(),
    );
    let roberta = fixture_path("pretrained/tiny-roberta");
    let config = |extra: &str| {
        TrainRunConfig::from_toml_str(&format!(
            "name = \"rb\"\ninit = {{ model = {:?} }}\n[train]\nbudget = {{ steps = 2 }}\n\
             [task]\nkind = \"classify\"\ntrain = {:?}\nmax_tokens = 4\n{extra}\n",
            roberta.display().to_string(),
            data.display().to_string()
        ))
        .unwrap()
    };
    let run = root.path().join("rb");
    assert_error_mentions(
        train_run::start(&config(""), &options(&run, None)),
        &["truncate = true"],
    );
    assert!(!run.join("train.toml").exists());
    assert!(matches!(
        train_run::start(&config("truncate = true"), &options(&run, None)).unwrap(),
        TrainEnd::Finished(_)
    ));
}

#[test]
fn ids_in_a_config_must_name_rows_of_their_tables() {
    let dir = pretrained_copy("tiny-roberta");
    let path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    for (pad, rows, expected) in [
        (
            "18446744073709551615",
            "66",
            "pad_token_id = 18446744073709551615 is not an id",
        ),
        ("36", "66", "pad_token_id = 36 is not an id"),
        ("35", "30", "max_position_embeddings = 30 rows"),
    ] {
        let edited = text
            .replace("\"pad_token_id\": 1", &format!("\"pad_token_id\": {pad}"))
            .replace(
                "\"max_position_embeddings\": 66",
                &format!("\"max_position_embeddings\": {rows}"),
            );
        std::fs::write(&path, edited).unwrap();
        let (code, out, err) =
            poslab_bounded(&["inspect", "--model", dir.path().to_str().unwrap()], &[]);
        assert!(
            code == Some(1) && err.contains(expected) && !out.contains("positions: from 0"),
            "{pad}: {err}"
        );
    }
}

#[test]
fn a_resume_reads_the_inputs_the_run_started_with() {
    let root = tempfile::tempdir().unwrap();
    let rows = b"the cat sat on the mat\ta\nthe dog ran to the tree\tb\n".repeat(30);
    let data = write(root.path(), "d.tsv", &rows);
    let config = train_config(&format!(
        "kind = \"classify\"\ntrain = {:?}",
        data.display().to_string()
    ));
    let run = root.path().join("r");
    train_run::start(&config, &options(&run, Some(5))).unwrap();
    // The labels flipped between the stop and the resume: refused, naming the file.
    let flipped = String::from_utf8(rows.clone())
        .unwrap()
        .replace("\ta", "\tx")
        .replace("\tb", "\ta")
        .replace("\tx", "\tb");
    std::fs::write(&data, flipped).unwrap();
    assert_error_mentions(
        train_run::resume(&options(&run, None)),
        &["d.tsv changed since the run started", "restore the file"],
    );
    std::fs::write(&data, &rows).unwrap();
    assert!(matches!(
        train_run::resume(&options(&run, None)).unwrap(),
        TrainEnd::Finished(_)
    ));
    // The pretrained folder's weights replaced before the first checkpoint: refused too.
    let bert = pretrained_copy("tiny-bert");
    let config = TrainRunConfig::from_toml_str(&format!(
        "name = \"ft\"\ncheckpoint_every = 5\ninit = {{ model = {:?} }}\n[train]\nbudget = {{ steps = 12 }}\n\
         [task]\nkind = \"classify\"\ntrain = {:?}\n",
        bert.path().display().to_string(),
        data.display().to_string()
    ))
    .unwrap();
    let run = root.path().join("ft");
    train_run::start(&config, &options(&run, Some(3))).unwrap();
    rewrite_safetensors(
        &bert.path().join("model.safetensors"),
        |name, (dtype, shape, bytes)| {
            (name == "bert.embeddings.word_embeddings.weight").then(|| {
                let mut b = bytes.clone();
                b[0] ^= 1;
                (dtype.clone(), shape.clone(), b)
            })
        },
    );
    assert_error_mentions(
        train_run::resume(&options(&run, None)),
        &["model.safetensors changed since the run started"],
    );
}

#[test]
fn every_poslab_variable_is_read_as_set_or_refused() {
    for name in ["POSLAB_MAX_MEMORY", "POSLAB_MAX_PARAMS"] {
        for value in [
            "1.5G",
            "0.05M",
            "1e9",
            "0x100",
            "-5",
            "lots",
            "99999999999999999999999",
            "20000000T",
            "0",
            "",
        ] {
            let (code, _, err) = poslab_bounded(&["inspect"], &[(name, value)]);
            assert!(
                code == Some(1)
                    && err.contains(&format!("{name}={value:?} cannot be read"))
                    && err.contains("such as"),
                "{name}={value}: {err}"
            );
        }
        let (code, out, err) = poslab_bounded(&["inspect"], &[(name, "8G")]);
        assert!(code == Some(0) && out.contains("valid"), "{err}");
    }
    for (name, value) in [
        ("POSLAB_KERNELS", "fast"),
        ("POSLAB_DEFAULT_ALLOCATOR", "yes"),
    ] {
        let (code, _, err) = poslab_bounded(&["inspect"], &[(name, value)]);
        assert!(
            code == Some(1) && err.contains("cannot be read"),
            "{name}: {err}"
        );
    }
    // A name poslab does not read (a typo): said, not silently ignored.
    let (code, _, err) = poslab_bounded(&["inspect"], &[("POSLAB_MAX_MEMROY", "8G")]);
    assert!(
        code == Some(0) && err.contains("POSLAB_MAX_MEMROY is not a variable poslab reads"),
        "{err}"
    );
}

#[test]
fn predictions_name_real_tokens_and_count_words_one_way() {
    // A tokenizer with fewer ids (30) than the model's table (36): no fill without a label.
    let dir = pretrained_copy("tiny-bert");
    let path = dir.path().join("tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    vocab.retain(|_, id| id.as_u64().unwrap() < 30);
    std::fs::write(&path, tok.to_string()).unwrap();
    // The dropped ids made the likeliest fills.
    rewrite_safetensors(
        &dir.path().join("model.safetensors"),
        |name, (dtype, shape, bytes)| {
            (name == "cls.predictions.bias").then(|| {
                let mut b = bytes.clone();
                for id in 30..36 {
                    b[4 * id..4 * id + 4].copy_from_slice(&50f32.to_le_bytes());
                }
                (dtype.clone(), shape.clone(), b)
            })
        },
    );
    let d = dir.path().to_str().unwrap();
    let (code, out, err) = poslab_bounded(
        &[
            "predict",
            "--model",
            d,
            "--top-k",
            "40",
            "--json",
            "the cat [MASK] on the mat",
        ],
        &[],
    );
    assert!(code == Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let fills = v["masks"][0]["fills"].as_array().unwrap();
    assert!(
        !fills.is_empty() && fills.len() <= 25,
        "{} fills",
        fills.len()
    );
    assert!(
        fills
            .iter()
            .all(|f| !f["label"].as_str().unwrap().trim().is_empty()),
        "{fills:?}"
    );
    // --top-k 0 is refused, not read as 1.
    let (code, _, err) = poslab_bounded(
        &["predict", "--model", d, "--top-k", "0", "the [MASK]"],
        &[],
    );
    assert!(code == Some(1) && err.contains("--top-k 0"), "{err}");
    // The text output numbers a mask's word as --json does.
    let model = fixture_path("pretrained/tiny-bert");
    let m = model.to_str().unwrap();
    let (_, text, _) = poslab_bounded(&["predict", "--model", m, "the cat [MASK] on the mat"], &[]);
    let (_, json, _) = poslab_bounded(
        &[
            "predict",
            "--model",
            m,
            "--json",
            "the cat [MASK] on the mat",
        ],
        &[],
    );
    let v: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
    let word = v["masks"][0]["word"].as_u64().unwrap();
    assert_eq!(word, 2);
    assert!(text.contains(&format!("  word {word}: ")), "{text}");
}

#[test]
fn errors_name_what_is_really_wrong() {
    // model.safetensors a link to /dev/zero, or to a FIFO: not "no model.safetensors".
    let dir = pretrained_copy("tiny-bert");
    let weights = dir.path().join("model.safetensors");
    std::fs::remove_file(&weights).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &weights).unwrap();
    let d = dir.path().to_str().unwrap();
    let (code, _, err) = poslab_bounded(&["embed", "--model", d, "a cat"], &[]);
    assert!(
        code == Some(1) && err.contains("not a regular file"),
        "{err}"
    );
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo reads a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    std::fs::remove_file(&weights).unwrap();
    std::os::unix::fs::symlink(&fifo, &weights).unwrap();
    let (code, _, err) = poslab_bounded(&["embed", "--model", d, "a cat"], &[]);
    assert!(
        code == Some(1) && err.contains("not a regular file"),
        "{err}"
    );
    // The same inside a Hugging Face cache: not "not in the cache".
    let cache = tempfile::tempdir().unwrap();
    let repo = poslab::text::RepoRef::parse("acme/tiny").unwrap();
    let commit = "0123456789abcdef0123456789abcdef01234567";
    for f in ["config.json", "tokenizer.json"] {
        let bytes = std::fs::read(fixture_path("pretrained/tiny-bert").join(f)).unwrap();
        poslab::text::hub::place_in_cache(cache.path(), &repo, commit, f, &bytes).unwrap();
    }
    let snapshot = cache
        .path()
        .join("models--acme--tiny/snapshots")
        .join(commit);
    std::os::unix::fs::symlink("/dev/zero", snapshot.join("model.safetensors")).unwrap();
    let (code, _, err) = poslab_bounded(
        &["embed", "--model", "acme/tiny", "a cat"],
        &[
            ("HF_HOME", cache.path().parent().unwrap().to_str().unwrap()),
            ("HF_HUB_CACHE", cache.path().to_str().unwrap()),
        ],
    );
    assert!(
        code == Some(1) && err.contains("not a regular file") && !err.contains("not in the"),
        "{err}"
    );
    // bench --torch /dev/zero: not "no such file".
    let (code, _, err) = poslab_bounded(&["bench", "--torch", "/dev/zero"], &[]);
    assert!(
        code == Some(1) && err.contains("not a regular file"),
        "{err}"
    );
}

#[test]
fn threads_are_bounded() {
    for command in [
        &["bench"][..],
        &["compare", "--dry-run"],
        &["train", "--config", "absent.toml"],
        &["predict", "--run", "absent", "a text"],
        &["embed", "--run", "absent", "a text"],
        &["analyze", "--run", "absent"],
    ] {
        for n in ["0", "100000"] {
            let args: Vec<&str> = command.iter().copied().chain(["--threads", n]).collect();
            let (code, _, err) = poslab_bounded(&args, &[]);
            assert!(
                code == Some(1) && err.contains(&format!("--threads {n}")),
                "{args:?}: {err}"
            );
        }
        // The variable, when set, is held to the same bounds.
        let (code, _, err) = poslab_bounded(command, &[("RAYON_NUM_THREADS", "100000")]);
        assert!(
            code == Some(1) && err.contains("RAYON_NUM_THREADS 100000"),
            "{command:?}: {err}"
        );
    }
}

/// A bench whose shape no variant fits, or whose repetitions measure nothing or never end, is
/// refused before it runs, naming the flag: not an empty table and exit status 0.
#[test]
fn bench_refuses_shapes_and_repetitions_that_measure_nothing() {
    for (args, says) in [
        (&["--seq", "0"][..], "--seq 0"),
        (&["--batch", "0"], "--batch 0"),
        (&["--heads", "0"], "n_heads = 0"),
        (
            &["--d-model", "7", "--heads", "2"],
            "does not divide d_model = 7",
        ),
        (&["--layers", "0"], "n_layers = 0"),
        (&["--ffn", "0"], "ffn_dim = 0"),
        (&["--vocab", "0"], "vocab_size = 0"),
        (&["--rounds", "0"], "--rounds 0"),
        (&["--rounds", "1000"], "--rounds 1000"),
        (&["--warmup", "1000000000"], "--warmup 1000000000"),
        (&["--train-reps", "1000000000"], "--train-reps 1000000000"),
        (
            &["--forward-reps", "0", "--train-reps", "0"],
            "nothing to measure",
        ),
        (
            &["--products", "--train-reps", "0"],
            "--products --train-reps 0",
        ),
        // A named variant that does not fit the shape is refused before any other runs.
        (
            &[
                "--d-model",
                "64",
                "--heads",
                "8",
                "--variants",
                "sin_add,sin_concat",
            ],
            "bench variant `sin_concat`: sinusoidal_concat: pos_dim = 64",
        ),
    ] {
        let args: Vec<&str> = ["bench"].into_iter().chain(args.iter().copied()).collect();
        let (code, out, err) = poslab_bounded(&args, &[]);
        assert!(
            code == Some(1) && err.contains(says) && out.is_empty(),
            "{args:?}: {code:?} {out} {err}"
        );
        assert!(
            !err.contains("tok/s"),
            "{args:?} ran before its refusal: {err}"
        );
    }
}

// Round 4 (issue 49): the ModernBERT loader.

/// A ModernBERT config that leaves the local layers' base out gets transformers' default for
/// them, 10000, not the global layers' 160000 (7); a base of the wrong type is refused by key
/// (9); a fused Wqkv or a stored decoder of the wrong shape is refused, naming the tensor and
/// the shape the config describes (8, 10).
#[test]
fn modernbert_folders_are_read_as_transformers_reads_them_or_refused_by_name() {
    use poslab::pretrained::Folder;
    let local_base = |config: serde_json::Value| -> Result<Option<f64>, String> {
        let dir = pretrained_copy("tiny-modernbert");
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        Folder::read(dir.path())
            .map(|f| f.config.layers.unwrap().rope_base.unwrap().local)
            .map_err(|e| e.to_string())
    };
    let v4: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture_path("pretrained/tiny-modernbert/config_v4.json"))
            .unwrap(),
    )
    .unwrap();
    let mut without_local = v4.clone();
    without_local
        .as_object_mut()
        .unwrap()
        .remove("local_rope_theta");
    assert!(without_local.get("global_rope_theta").is_some());
    assert_eq!(local_base(without_local).unwrap(), Some(10_000.0));
    // transformers 5's form with only the global layers' parameters.
    let mut v5 = v4.clone();
    let o = v5.as_object_mut().unwrap();
    for k in ["local_rope_theta", "global_rope_theta"] {
        o.remove(k);
    }
    o.insert(
        "rope_parameters".into(),
        serde_json::json!({"full_attention": {"rope_theta": 160000.0, "rope_type": "default"}}),
    );
    assert_eq!(local_base(v5.clone()).unwrap(), Some(10_000.0));
    // A string where a number goes.
    v5["rope_parameters"]["full_attention"]["rope_theta"] = "5000.0".into();
    let err = local_base(v5).unwrap_err();
    assert!(
        err.contains("rope_parameters.full_attention.rope_theta = \"5000.0\"")
            && err.contains("number"),
        "{err}"
    );
    let mut typed = v4.clone();
    typed["global_rope_theta"] = "5000.0".into();
    let err = local_base(typed).unwrap_err();
    assert!(
        err.contains("key `global_rope_theta`") && err.contains("string"),
        "{err}"
    );

    // Tensors of shapes the config does not describe (hidden 32: Wqkv is 96 x 32).
    for (tensor, rows, says) in [
        (
            "model.layers.0.attn.Wqkv.weight",
            97,
            "[97, 32], but the config describes [96, 32]",
        ),
        (
            "model.layers.1.attn.Wqkv.weight",
            128,
            "[128, 32], but the config describes [96, 32]",
        ),
        (
            "model.layers.0.attn.Wqkv.weight",
            95,
            "[95, 32], but the config describes [96, 32]",
        ),
    ] {
        let dir = pretrained_copy("tiny-modernbert");
        rewrite_safetensors(
            &dir.path().join("model.safetensors"),
            |name, (dtype, shape, bytes)| {
                (name == tensor).then(|| {
                    let row = bytes.len() / shape[0];
                    let mut b = bytes.clone();
                    b.resize(rows * row, 0);
                    (dtype.clone(), vec![rows, shape[1]], b)
                })
            },
        );
        let err = Folder::read(dir.path())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains(tensor) && err.contains(says),
            "{tensor} {rows}: {err}"
        );
    }
    let dir = pretrained_copy("tiny-modernbert");
    let path = dir.path().join("model.safetensors");
    // Add a stored decoder of the wrong shape beside the tied embeddings.
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let end = bytes.len() - 8 - n;
    header.insert(
        "decoder.weight".into(),
        serde_json::json!({"dtype": "F32", "shape": [7, 3], "data_offsets": [end, end + 84]}),
    );
    let header = serde_json::to_vec(&header).unwrap();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.extend_from_slice(&bytes[8 + n..]);
    file.extend_from_slice(&[0u8; 84]);
    std::fs::write(&path, file).unwrap();
    let err = Folder::read(dir.path())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("`decoder.weight` has shape [7, 3]")
            && err.contains("tied to the token embeddings"),
        "{err}"
    );
}

/// A user's `fn main() -> poslab::Result<()>` can use `?` on its own I/O errors; the message is
/// the operating system's, with no empty path before it.
#[test]
fn io_errors_convert_with_question_mark() {
    fn read(path: &Path) -> poslab::Result<String> {
        Ok(std::fs::read_to_string(path)?)
    }
    let dir = tempfile::tempdir().unwrap();
    let err = read(&dir.path().join("absent.txt")).unwrap_err();
    assert!(matches!(err, poslab::Error::Io { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.starts_with("No such file or directory"), "{text}");
}
