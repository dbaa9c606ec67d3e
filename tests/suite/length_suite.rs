//! The length-generalization suite: the 15 task generators (hand-checked examples, shapes,
//! seeds, and agreement with an independent solver), scoring over output positions only, the
//! shipped configs, sharding (`--shard` slices merged by `report` give the unsharded
//! `results.json`, byte for byte) and the cluster examples.

use std::path::{Path, PathBuf};
use std::process::Command;

use poslab::data::{Dataset, Sample, TapeInfo, Target};
use poslab::runs::{ExperimentConfig, Selection, Shard};
use poslab::tasks::algorithmic::{Algorithmic, Level, Tape, BLANK, END};
use poslab::tasks::{Label, TaskKind, TaskSpec};
use poslab::train::{scores_by_length, tape_results};

fn words(s: &str) -> Vec<&str> {
    s.split_whitespace().collect()
}

/// The answer of `task` to `input` (space-separated symbols), as output symbols, and the count
/// of outputs that score.
fn solve(task: Algorithmic, input: &str) -> (String, usize) {
    let tape = task
        .solve(&words(input))
        .unwrap_or_else(|| panic!("{}: {input:?} is not an input", task.name()));
    let out: Vec<&str> = tape
        .output
        .iter()
        .map(|&o| task.output_symbols()[o])
        .collect();
    (out.join(" "), tape.counted)
}

#[test]
fn every_task_answers_hand_checked_inputs() {
    use Algorithmic::*;
    // (task, input, output, counted outputs); most from the DeepMind tasks' docstrings.
    let cases: &[(Algorithmic, &str, &str, usize)] = &[
        // 001110: one 01, one 10; 0101001: three 01, two 10.
        (EvenPairs, "0 0 1 1 1 0", "0", 1),
        (EvenPairs, "0 1 0 1 0 0 1", "1", 1),
        (ParityCheck, "1 0 1 0 1 0 0", "1", 1),
        (ParityCheck, "0 1 1 1 1", "0", 1),
        // +1 -1 0 -1 -1 = -2 = 3 on a cycle of 5.
        (CycleNavigation, "right left stay left left", "3", 1),
        (CycleNavigation, "right right right left", "2", 1),
        (ModularArithmetic, "1 + 2 * 3", "2", 1),
        (ModularArithmetic, "1 - 1 - 1", "4", 1),
        (ModularArithmetic, "0 * 1 + 4 * 3 - 2", "0", 1),
        (ModularArithmetic, "2 - 3 * 4", "0", 1),
        (ReverseString, "0 1 1 0", "0 1 1 0", 4),
        (ReverseString, "0 1 1 0 1 0", "0 1 0 1 1 0", 6),
        // Stack 0110 (bottom first), push 1, pop, pop: 011, read top first.
        (
            StackManipulation,
            "0 1 1 0 push1 pop pop",
            "1 1 0 end 0 0 0 0",
            4,
        ),
        (StackManipulation, "1 1 0 pop pop pop", "end 0 0 0 0 0 0", 1),
        (StackManipulation, "1", "1 end", 2),
        (ModularArithmeticBrackets, "( 1 + ( 2 * 3 ) )", "2", 1),
        (ModularArithmeticBrackets, "( - 2 )", "3", 1),
        (ModularArithmeticBrackets, "( ( 3 - 4 ) * - 2 )", "2", 1),
        (ModularArithmeticBrackets, "- 0", "0", 1),
        (SolveEquation, "( x + 2 ) = 4", "2", 1),
        (SolveEquation, "( 3 - x ) = 4", "4", 1),
        (SolveEquation, "x = 3", "3", 1),
        (SolveEquation, "0 0", "0", 1),
        (DuplicateString, "1 0 1", "1 0 1 1 0 1", 6),
        // 0110 twice with one bit replaced; 101 twice with one replaced, padded to odd length.
        (MissingDuplicateString, "0 1 1 0 0 ? 1 0", "1", 1),
        (MissingDuplicateString, "1 0 1 1 ? 1 #", "0", 1),
        // The DeepMind code (not its docstring): odd 0-based indices first.
        (OddsFirst, "0 0 1 1 0 1 0 1", "0 1 1 1 0 1 0 0", 8),
        (OddsFirst, "1 1 0", "1 1 0", 3),
        // Little-endian 001 + 01101 = 4 + 22 = 26 = 01011, then end and zeros to L + 1.
        (
            BinaryAddition,
            "0 0 1 + 0 1 1 0 1",
            "0 1 0 1 1 end 0 0 0 0",
            6,
        ),
        (
            BinaryAddition,
            "1 0 0 1 + 0 0 0 0 0 1",
            "1 0 0 1 0 1 end 0 0 0 0 0",
            7,
        ),
        (BinaryAddition, "0 1", "0 1 end", 3),
        (BinaryAddition, "0", "0 end", 2),
        // 4 * 22 = 88 = 0001101; 9 * 32 = 288 = 000001001.
        (
            BinaryMultiplication,
            "0 0 1 * 0 1 1 0 1",
            "0 0 0 1 1 0 1 end 0",
            8,
        ),
        (
            BinaryMultiplication,
            "1 0 0 1 * 0 0 0 0 0 1",
            "0 0 0 0 0 1 0 0 1 end 0",
            10,
        ),
        (BinaryMultiplication, "1", "end", 1),
        // 37 -> 6 = 110; 7 -> 2 = 10; big-endian, ceil(L / 2) bits.
        (ComputeSqrt, "1 0 0 1 0 1", "1 1 0", 3),
        (ComputeSqrt, "1 1 1", "1 0", 2),
        (ComputeSqrt, "0 0 0 0 0 0 0 1", "0 0 0 1", 4),
        (BucketSort, "1 0 2 0 4 1 1 2", "0 0 1 1 1 2 2 4", 8),
    ];
    for &(task, input, output, counted) in cases {
        assert_eq!(
            solve(task, input),
            (output.to_string(), counted),
            "{} of {input:?}",
            task.name()
        );
    }
    // Not inputs of their task: refused, not answered.
    for (task, input) in [
        (ReverseString, "0 2 1"),
        (ModularArithmetic, "1 + + 2"),
        (ModularArithmeticBrackets, "( 1 + 2"),
        (StackManipulation, "pop 1"),
        (MissingDuplicateString, "0 1 1 1"),
        (BinaryAddition, "0 1 1 0"),
        (SolveEquation, "( 1 + 2 ) = 3"),
    ] {
        assert!(
            task.solve(&words(input)).is_none(),
            "{} {input}",
            task.name()
        );
    }
}

fn rng(seed: u64) -> poslab::rng::Rng {
    poslab::rng::stream(seed, "length suite test")
}

#[test]
fn generated_tapes_have_the_right_shapes_and_agree_with_the_solver() {
    let mut checked = 0;
    for task in Algorithmic::ALL {
        let mut r = rng(task as u64);
        for length in (1..=45).chain([64, 101, 200]) {
            for _ in 0..if length <= 45 { 12 } else { 2 } {
                let tape = task.sample(&mut r, length);
                let expected_input = match task {
                    Algorithmic::ModularArithmetic if length % 2 == 0 => length - 1,
                    _ => length,
                };
                let what = format!("{} at length {length}: {tape:?}", task.name());
                assert_eq!(tape.input.len(), expected_input, "{what}");
                assert_eq!(tape.output.len(), task.output_length(length), "{what}");
                assert_eq!(
                    tape.input.len() + tape.output.len(),
                    task.tape_len(length),
                    "{what}"
                );
                assert!(
                    tape.input.iter().all(|w| task.input_symbols().contains(w)),
                    "{what}"
                );
                assert!(
                    tape.output.iter().all(|&o| o < task.output_symbols().len()),
                    "{what}"
                );
                assert!(
                    tape.counted >= 1 && tape.counted <= tape.output.len(),
                    "{what}"
                );
                // An ended answer: `end` where counting stops, nowhere before, zeros after.
                if task.output_symbols().contains(&END) {
                    let end = task
                        .output_symbols()
                        .iter()
                        .position(|s| *s == END)
                        .unwrap();
                    assert_eq!(tape.output[tape.counted - 1], end, "{what}");
                    assert!(!tape.output[..tape.counted - 1].contains(&end), "{what}");
                    assert!(
                        tape.output[tape.counted..].iter().all(|&o| o == 0),
                        "{what}"
                    );
                } else {
                    assert_eq!(tape.counted, tape.output.len(), "{what}");
                }
                // What generation computed, the independent solver computes from the input.
                let solved: Tape = task.solve(&tape.input).expect(&what);
                assert_eq!(solved, tape, "{what}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 15 * (45 * 12 + 3 * 2));
}

#[test]
fn the_distributions_are_deepminds() {
    let mut r = rng(7);
    let n = 4000;
    // Labels of the binary classification tasks are balanced.
    for task in [Algorithmic::EvenPairs, Algorithmic::ParityCheck] {
        let ones: usize = (0..n).map(|_| task.sample(&mut r, 17).output[0]).sum();
        assert!(
            (1800..2200).contains(&ones),
            "{}: {ones} of {n}",
            task.name()
        );
    }
    // Operators of modular_arithmetic are uniform over + * -.
    let mut counts = std::collections::HashMap::new();
    for _ in 0..1000 {
        for w in Algorithmic::ModularArithmetic.sample(&mut r, 21).input {
            *counts.entry(w).or_insert(0) += 1;
        }
    }
    for op in ["+", "-", "*"] {
        assert!((3000..3700).contains(&counts[op]), "{op}: {}", counts[op]);
    }
    // binary_addition splits L - 1 bits between the numbers uniformly: the `+` sits at every
    // index 1 ..= L - 2 about equally often.
    let mut at = vec![0usize; 10];
    for _ in 0..n {
        let tape = Algorithmic::BinaryAddition.sample(&mut r, 10);
        at[tape.input.iter().position(|w| *w == "+").unwrap()] += 1;
    }
    assert_eq!((at[0], at[9]), (0, 0));
    assert!(at[1..9].iter().all(|&c| (400..600).contains(&c)), "{at:?}");
    // The stack holds 1 to L - 1 bits before its actions.
    for _ in 0..200 {
        let tape = Algorithmic::StackManipulation.sample(&mut r, 12);
        let bits = tape
            .input
            .iter()
            .take_while(|w| **w == "0" || **w == "1")
            .count();
        assert!((1..12).contains(&bits), "{tape:?}");
    }
    // Numbers are nonzero (DeepMind draws them from [1, 2^len - 1]): compute_sqrt's input.
    for _ in 0..200 {
        let tape = Algorithmic::ComputeSqrt.sample(&mut r, 3);
        assert!(tape.input.contains(&"1"), "{tape:?}");
    }
    assert_eq!(Algorithmic::EvenPairs.level(), Level::Regular);
}

fn suite_task(kind: &str, extra: &str) -> TaskSpec {
    let text = format!(
        "[[tasks]]\nkind = \"{kind}\"\nlengths = [1, 12]\ntest_lengths = [[13, 20], [21, 30]]\n\
         train_examples = 300\neval_examples = 40\n{extra}"
    );
    #[derive(serde::Deserialize)]
    struct W {
        tasks: Vec<TaskSpec>,
    }
    let w: W = toml::from_str(&text).unwrap();
    w.tasks.into_iter().next().unwrap()
}

#[test]
fn suite_tasks_generate_the_same_tapes_from_the_same_seed() {
    for task in Algorithmic::ALL {
        let spec = suite_task(task.name(), "");
        assert_eq!(spec.kind, TaskKind::Algorithmic(task));
        let (a, b) = (spec.generate().unwrap(), spec.generate().unwrap());
        assert_eq!(a.train, b.train, "{}", task.name());
        assert_eq!(a.tests[2].examples, b.tests[2].examples);
        let other = suite_task(task.name(), "data_seed = 1").generate().unwrap();
        assert_ne!(
            a.train,
            other.train,
            "{}: data_seed changes the data",
            task.name()
        );
        // The training range, then each test range, every length equally often.
        let names: Vec<&str> = a.tests.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["1-12", "13-20", "21-30"]);
        for (set, range) in a.tests.iter().zip([[1, 12], [13, 20], [21, 30]]) {
            assert_eq!(set.lengths, range);
            let mut per_length = std::collections::BTreeMap::new();
            for e in &set.examples {
                let Label::Outputs {
                    length, targets, ..
                } = &e.label
                else {
                    panic!("{}: a tape", task.name())
                };
                *per_length.entry(*length).or_insert(0) += 1;
                // Inputs, then one blank per output.
                assert_eq!(e.words.len(), task.tape_len(*length));
                let blanks = e.words.iter().rev().take_while(|w| *w == BLANK).count();
                assert!(blanks >= targets.len());
                assert!(!e.words[..e.words.len() - targets.len()].contains(&BLANK.to_string()));
            }
            let counts: Vec<usize> = per_length.values().copied().collect();
            assert_eq!(per_length.len(), range[1] - range[0] + 1, "{}", task.name());
            assert!(counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1);
        }
        // Training lengths are drawn uniformly from the range.
        let lengths: std::collections::BTreeSet<usize> = a
            .train
            .iter()
            .map(|e| match &e.label {
                Label::Outputs { length, .. } => *length,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(lengths.len(), 12, "{}", task.name());
    }
}

#[test]
fn suite_task_tables_refuse_what_they_cannot_mean() {
    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct W {
        tasks: Vec<TaskSpec>,
    }
    let err = |text: &str| -> String {
        match toml::from_str::<W>(text) {
            Err(e) => e.to_string(),
            Ok(w) => {
                let task = &w.tasks[0];
                let limits = poslab::limits::Limits::default();
                let checked = task.validate().and_then(|()| task.check_limits(&limits));
                checked.unwrap_err().to_string()
            }
        }
    };
    let e = err("[[tasks]]\nkind = \"reverse_string\"\nlengths = [1, 4]\nk = 2\n");
    assert!(
        e.contains("unknown field `k`") && e.contains("no options"),
        "{e}"
    );
    let e = err("[[tasks]]\nkind = \"reverse_strings\"\nlengths = [1, 4]\n");
    assert!(
        e.contains("reverse_string") && e.contains("length suite"),
        "{e}"
    );
    let e = err(
        "[[tasks]]\nkind = \"parity_check\"\nlengths = [1, 4]\neval_factors = [1, 2]\n\
         test_lengths = [[5, 9]]\n",
    );
    assert!(e.contains("not both"), "{e}");
    let e = err("[[tasks]]\nkind = \"parity_check\"\nlengths = [1, 4]\ntest_lengths = [[9, 5]]\n");
    assert!(e.contains("test_lengths[0] = [9, 5]"), "{e}");
    let e = err("[[tasks]]\nkind = \"parity_check\"\nlengths = [1, 4]\n\
         test_lengths = [[5, 9], [9, 12]]\n");
    assert!(e.contains("without overlap"), "{e}");
    let e = err(
        "[[tasks]]\nkind = \"duplicate_string\"\nlengths = [1, 40]\ntest_lengths = [[41, 90000]]\n\
         eval_examples = 100000\n",
    );
    assert!(
        e.contains("generated words") && e.contains("POSLAB_MAX_MEMORY"),
        "{e}"
    );
    // A suite task round-trips through its TOML table.
    let spec = suite_task("binary_addition", "");
    let text = toml::to_string(&serde_json::json!({ "tasks": [spec.clone()] })).unwrap();
    assert!(text.contains("kind = \"binary_addition\""), "{text}");
    assert!(!text.contains("eval_factors"), "{text}");
    let back: W = toml::from_str(&text).unwrap();
    assert_eq!(back.tasks[0], spec);
}

/// A one-row batch of `task`'s tape for `input`, as a dataset would hold it.
fn tape_sample(task: Algorithmic, input: &str) -> (Dataset, Tape) {
    let tape = task.solve(&words(input)).unwrap();
    let spec = suite_task(task.name(), "");
    let data = spec.generate().unwrap();
    let example = poslab::tasks::Example::new(
        tape.input
            .iter()
            .copied()
            .chain(std::iter::repeat_n(BLANK, tape.output.len()))
            .map(String::from)
            .collect(),
        Label::Outputs {
            length: tape.input.len(),
            targets: tape.output.clone(),
            counted: tape.counted,
        },
    );
    let ds = Dataset::encode(&[example], &data.tokenizer, None, Default::default()).unwrap();
    (ds, tape)
}

#[test]
fn accuracy_counts_the_outputs_only() {
    // 001 + 01101: 9 input tokens, then 10 outputs of which 6 count (to `end`).
    let (ds, tape) = tape_sample(Algorithmic::BinaryAddition, "0 0 1 + 0 1 1 0 1");
    let sample: &Sample = &ds.samples[0];
    assert_eq!(
        sample.tape,
        Some(TapeInfo {
            length: 9,
            first_output: 9,
            counted: 6
        })
    );
    let Target::Tags(tags) = &sample.target else {
        panic!()
    };
    assert!(tags[..9].iter().all(|&t| t == poslab::data::NOT_SCORED));
    assert_eq!(
        tags[9..].to_vec(),
        tape.output.iter().map(|&o| o as i64).collect::<Vec<_>>()
    );
    let t = sample.ids.len();
    let targets: Vec<u32> = tags.iter().map(|&t| t.max(0) as u32).collect();
    let nll = vec![0.5; t];
    let score = |predicted: &[u32]| {
        let r = tape_results(&[sample], t, predicted, &targets, &nll).unwrap();
        scores_by_length(&r)[0]
    };
    // Right everywhere but at the outputs: 0.
    let mut wrong_outputs = targets.clone();
    for p in &mut wrong_outputs[9..] {
        *p = (*p + 1) % 3;
    }
    let s = score(&wrong_outputs);
    assert_eq!((s.accuracy, s.sequence_accuracy), (0.0, 0.0));
    // Right at the counted outputs, wrong everywhere else (inputs, padding after `end`): 1.
    let mut right_outputs: Vec<u32> = targets.iter().map(|&t| (t + 1) % 3).collect();
    right_outputs[9..15].copy_from_slice(&targets[9..15]);
    let s = score(&right_outputs);
    assert_eq!((s.length, s.examples), (9, 1));
    assert_eq!((s.accuracy, s.sequence_accuracy), (1.0, 1.0));
    // One counted output wrong: 5 of 6, and the sequence is wrong. The loss is over all 10
    // outputs, the inputs' excluded.
    let mut one_wrong = targets.clone();
    one_wrong[11] = (one_wrong[11] + 1) % 3;
    let s = score(&one_wrong);
    assert_eq!((s.accuracy, s.sequence_accuracy), (5.0 / 6.0, 0.0));
    assert!((s.loss - 0.5).abs() < 1e-12);

    // The batch's accuracy weights are the counted outputs; its loss weights every output.
    let refs: Vec<&Sample> = ds.samples.iter().collect();
    let batch = poslab::data::make_batch(&refs, 0, None, &candle::Device::Cpu).unwrap();
    let row = |t: &candle::Tensor| t.to_vec2::<f32>().unwrap().remove(0);
    let counted = row(batch.counted.as_ref().unwrap());
    let weights = row(batch.weights.as_ref().unwrap());
    assert_eq!(counted.iter().sum::<f32>(), 6.0);
    assert_eq!(counted[9..15], [1.0; 6]);
    assert_eq!(weights.iter().sum::<f32>(), 10.0);
    assert_eq!(weights[..9], [0.0; 9]);
}

#[test]
fn shards_are_disjoint_and_cover_every_cell() {
    let config = ExperimentConfig::load(repo("configs/length_suite.toml")).unwrap();
    let all = config.cells(&Selection::default()).unwrap();
    assert_eq!(all.len(), 15 * 17 * 10);
    for n in [1, 7, 110, 2550] {
        let mut union = Vec::new();
        for k in 0..n {
            let selection = Selection {
                shard: Some(Shard { index: k, count: n }),
                ..Default::default()
            };
            let cells = config.cells(&selection).unwrap();
            // Balanced: every shard within one cell of the others.
            assert!(cells.len() == all.len() / n || cells.len() == all.len().div_ceil(n));
            union.extend(cells);
        }
        union.sort_unstable();
        let mut expected = all.clone();
        expected.sort_unstable();
        assert_eq!(union, expected, "{n} shards");
    }
    let e = config
        .cells(&Selection {
            shard: Some(Shard {
                index: 2550,
                count: 2551,
            }),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("holds no cell") && e.contains("at most 2550 shards"),
        "{e}"
    );
    for (text, why) in [
        ("3/3", "must be below N = 3"),
        ("0/0", "at least 1"),
        ("a/3", "K is not a number"),
        ("1-3", "no `/`"),
    ] {
        let e = text.parse::<Shard>().unwrap_err().to_string();
        assert!(
            e.contains(why) && e.contains("counting from 0"),
            "{text}: {e}"
        );
    }
    assert_eq!(
        " 2 / 5".parse::<Shard>().unwrap(),
        Shard { index: 2, count: 5 }
    );
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

#[test]
fn the_shipped_suites_run_the_protocol() {
    let full = ExperimentConfig::load(repo("configs/length_suite.toml")).unwrap();
    let names: Vec<&str> = full.tasks.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, Algorithmic::ALL.map(Algorithmic::name));
    for t in &full.tasks {
        assert_eq!(t.lengths, Some([1, 40]));
        assert_eq!(t.test_lengths, [[41, 100], [101, 200], [201, 500]]);
    }
    // The paper's model and recipe.
    let m = &full.model;
    assert_eq!(
        (m.d_model, m.n_heads, m.n_layers, m.ffn_dim),
        (64, 8, 5, 256)
    );
    assert_eq!(m.activation, poslab::nn::Activation::Relu);
    assert_eq!(m.norm, poslab::NormPlacement::Post);
    assert_eq!((m.dropout, m.attention_dropout), (0.1, 0.0));
    assert_eq!(m.embed_scale, poslab::Scale::SqrtDModel);
    let t = &full.train;
    assert_eq!(t.budget, poslab::train::Budget::Steps(10_000));
    assert_eq!((t.batch_size, t.lr, t.grad_clip), (128, 1e-3, 1.0));
    assert_eq!((t.weight_decay, t.warmup, t.min_lr_ratio), (0.0, 0.0, 1.0));
    // Every scheme plain and with randomized positions from [0, 2048); `none` has no
    // positions to randomize, nor have PaTH and CoPE, which read none.
    let small = ExperimentConfig::load(repo("configs/length_suite_small.toml")).unwrap();
    for config in [&full, &small] {
        let plain: Vec<&str> = config
            .variants
            .iter()
            .filter(|v| v.random_positions.is_none())
            .map(|v| v.positional.name())
            .collect();
        assert_eq!(
            plain,
            [
                "none",
                "sinusoidal_add",
                "learned",
                "rope",
                "alibi",
                "t5",
                "fire",
                "prope",
                "path",
                "cope"
            ]
        );
        for v in config
            .variants
            .iter()
            .filter(|v| v.random_positions.is_some())
        {
            assert_eq!(v.random_positions, Some(2048));
            // The same scheme (FIRE's threshold follows the positions' range).
            assert!(config.variants.iter().any(|p| p.random_positions.is_none()
                && p.positional.name() == v.positional.name()
                && p.name == v.name.trim_end_matches("_random")));
        }
        assert_eq!(config.variants.len(), 17);
        // FIRE's threshold is the training length, and the drawn range under randomized
        // positions.
        for v in &config.variants {
            if let poslab::PositionalConfig::Fire(o) = &v.positional {
                let expected = if v.random_positions.is_some() {
                    2048.0
                } else {
                    40.0
                };
                assert_eq!(o.threshold, expected, "{}", v.name);
            }
        }
    }
    // The small suite: the binary-string tasks and bucket_sort, tested up to 200.
    let names: Vec<&str> = small.tasks.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "even_pairs",
            "parity_check",
            "reverse_string",
            "duplicate_string",
            "missing_duplicate_string",
            "odds_first",
            "binary_addition",
            "bucket_sort"
        ]
    );
    assert!(small
        .tasks
        .iter()
        .all(|t| t.test_lengths.iter().all(|r| r[1] <= 200)));
    assert!(small.seeds >= 2);
    // The longer run the README quotes: the small suite's model and settings, ten times the
    // steps, one pass over its training set.
    let longer = ExperimentConfig::load(repo("configs/length_suite_longer.toml")).unwrap();
    assert_eq!(longer.model, small.model);
    let (l, s) = (&longer.train, &small.train);
    assert_eq!(s.budget, poslab::train::Budget::Steps(400));
    assert_eq!(l.budget, poslab::train::Budget::Steps(4000));
    assert_eq!(
        (
            l.batch_size,
            l.lr,
            l.grad_clip,
            l.weight_decay,
            l.warmup,
            l.min_lr_ratio
        ),
        (
            s.batch_size,
            s.lr,
            s.grad_clip,
            s.weight_decay,
            s.warmup,
            s.min_lr_ratio
        )
    );
    for t in &longer.tasks {
        assert_eq!(t.train_examples, Some(4000 * l.batch_size), "{}", t.name);
        assert!(small
            .tasks
            .iter()
            .any(|u| u.name == t.name && u.lengths == t.lengths));
    }
    // The laptop suite: tasks of all three classes at the protocol's lengths, tested up to 200,
    // one pass over its training set, and each scheme plain and with randomized positions from
    // the protocol's range.
    let laptop = ExperimentConfig::load(repo("configs/length_suite_laptop.toml")).unwrap();
    let names: Vec<&str> = laptop.tasks.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "even_pairs",
            "cycle_navigation",
            "reverse_string",
            "stack_manipulation",
            "duplicate_string",
            "bucket_sort"
        ]
    );
    let steps = match laptop.train.budget {
        poslab::train::Budget::Steps(n) => n,
        other => panic!("{other:?}"),
    };
    for t in &laptop.tasks {
        assert_eq!(t.lengths, Some([1, 40]), "{}", t.name);
        assert_eq!(t.test_lengths, [[41, 100], [101, 200]], "{}", t.name);
        assert_eq!(t.train_examples, Some(steps * laptop.train.batch_size));
    }
    assert_eq!(laptop.model.norm, poslab::NormPlacement::Post);
    assert_eq!(laptop.model.embed_scale, poslab::Scale::SqrtDModel);
    let randomized: Vec<&str> = laptop
        .variants
        .iter()
        .filter(|v| v.random_positions == Some(2048))
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(randomized, ["sinusoidal_add_random", "rope_random"]);
    for v in &laptop.variants {
        let plain = v.name.trim_end_matches("_random");
        assert!(laptop.variants.iter().any(|p| p.name == plain
            && p.random_positions.is_none()
            && p.positional.name() == v.positional.name()));
    }
}

/// A tiny suite: 2 tasks x 2 variants x 2 seeds, a few steps.
const TINY: &str = include_str!("../fixtures/tiny_suite.toml");

/// `poslab args` in `dir`: its exit status and its stderr then stdout.
fn poslab_status(dir: &Path, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_poslab"))
        .args(args)
        .current_dir(dir)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout),
    )
}

fn poslab(dir: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_poslab"))
        .args(args)
        .current_dir(dir)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout),
    )
}

/// Recomputes, from the per-length scores each cell recorded, every cell's `score` (the mean
/// over each length above the training lengths, 7-9 in `TINY`) and the summary's gains of
/// randomized positions (mean over tasks of the seeds' means, and of the best seeds).
fn scores_and_gains_follow_from_the_cells(results: &poslab::runs::results::Results) {
    use poslab::runs::results::{Outcome, SCORE};
    let accuracy_of = |o: &Outcome| match o {
        Outcome::Scored { accuracy, .. } => *accuracy,
        Outcome::Unavailable { reason } => panic!("unscored: {reason}"),
    };
    // cell score by (task, variant), one per seed
    let mut scores: Vec<(String, String, f64)> = Vec::new();
    for cell in &results.cells {
        let mut above = Vec::new();
        for e in cell.summary.evaluations.iter().filter(|e| e.name != SCORE) {
            if let Outcome::Scored {
                accuracy,
                sequence_accuracy,
                by_length,
                ..
            } = &e.outcome
            {
                for s in by_length {
                    assert!(
                        (0.0..=1.0).contains(&s.accuracy)
                            && s.sequence_accuracy <= s.accuracy + 1e-12
                            && s.examples > 0,
                        "{s:?}"
                    );
                }
                if !by_length.is_empty() {
                    let mean =
                        by_length.iter().map(|s| s.accuracy).sum::<f64>() / by_length.len() as f64;
                    assert!(
                        (mean - accuracy).abs() < 1e-12,
                        "{}: {mean} {accuracy}",
                        e.name
                    );
                    let seq = by_length.iter().map(|s| s.sequence_accuracy).sum::<f64>()
                        / by_length.len() as f64;
                    assert!((seq - sequence_accuracy.unwrap()).abs() < 1e-12);
                }
                if e.name.starts_with("shift") {
                    continue;
                }
                above.extend(by_length.iter().filter(|s| s.length > 6).copied());
            }
        }
        let mut lengths: Vec<usize> = above.iter().map(|s| s.length).collect();
        lengths.sort_unstable();
        assert_eq!(lengths, [7, 8, 9], "{}/{}", cell.task, cell.variant);
        let expected = above.iter().map(|s| s.accuracy).sum::<f64>() / 3.0;
        let score = cell
            .summary
            .evaluations
            .iter()
            .find(|e| e.name == SCORE)
            .unwrap();
        let got = accuracy_of(&score.outcome);
        assert!((got - expected).abs() < 1e-12, "{got} {expected}");
        scores.push((cell.task.clone(), cell.variant.clone(), got));
    }
    let over_seeds = |task: &str, variant: &str| -> (f64, f64) {
        let s: Vec<f64> = scores
            .iter()
            .filter(|(t, v, _)| t == task && v == variant)
            .map(|x| x.2)
            .collect();
        assert_eq!(s.len(), 2, "two seeds");
        (s.iter().sum::<f64>() / 2.0, s[0].max(s[1]))
    };
    let summary = poslab::runs::suite::summarize(results).unwrap();
    assert_eq!(summary.tasks, ["reverse_string", "binary_addition"]);
    assert_eq!(summary.gains.len(), 1);
    let g = &summary.gains[0];
    assert_eq!(
        (g.plain.as_str(), g.random.as_str()),
        ("rope", "rope_random")
    );
    let diffs: Vec<(f64, f64)> = summary
        .tasks
        .iter()
        .map(|t| {
            let (pm, pb) = over_seeds(t, "rope");
            let (rm, rb) = over_seeds(t, "rope_random");
            (100.0 * (rm - pm), 100.0 * (rb - pb))
        })
        .collect();
    let mean = (diffs[0].0 + diffs[1].0) / 2.0;
    let best = (diffs[0].1 + diffs[1].1) / 2.0;
    assert!(
        (g.mean - mean).abs() < 1e-9 && (g.best - best).abs() < 1e-9,
        "{g:?}"
    );
    assert!((g.min - diffs[0].0.min(diffs[1].0)).abs() < 1e-9);
    assert!((g.max - diffs[0].0.max(diffs[1].0)).abs() < 1e-9);
    assert_eq!(
        g.better + g.worse,
        diffs.iter().filter(|d| d.0 != 0.0).count()
    );
    let (all_mean, all_best) = summary.overall_gain().unwrap();
    assert!((all_mean - mean).abs() < 1e-9 && (all_best - best).abs() < 1e-9);
    // A randomized variant whose options are not its plain one's (FIRE's threshold follows the
    // range) pairs with the one plain variant of its scheme and width; with two, with neither.
    let rope = |base: f64| {
        poslab::PositionalConfig::Rope(poslab::positional::RopeOptions {
            base,
            ..Default::default()
        })
    };
    let mut other = results.clone();
    let random = other.variants.iter_mut().find(|v| v.name == "rope_random");
    random.unwrap().positional = rope(500.0);
    let paired = poslab::runs::suite::summarize(&other).unwrap();
    assert_eq!(paired.gains, summary.gains);
    let mut twin = other
        .variants
        .iter()
        .find(|v| v.name == "rope")
        .unwrap()
        .clone();
    (twin.name, twin.positional) = ("rope_base".into(), rope(20000.0));
    other.variants.push(twin);
    assert!(poslab::runs::suite::summarize(&other)
        .unwrap()
        .gains
        .is_empty());
}

#[test]
fn merged_shards_are_the_unsharded_run_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("tiny.toml"), TINY).unwrap();
    let (ok, log) = poslab(d, &["compare", "tiny.toml", "--out", "whole", "-q"]);
    assert!(ok, "{log}");
    for k in 0..3 {
        let shard = format!("{k}/3");
        let out = format!("shard-{k}");
        let (ok, log) = poslab(
            d,
            &[
                "compare",
                "tiny.toml",
                "--shard",
                &shard,
                "--out",
                &out,
                "-q",
            ],
        );
        assert!(ok && log.contains("this is shard"), "{log}");
    }
    // A shard holds only its cells: 8 cells, 3 shards of 3, 3 and 2.
    let cells = |p: &str| -> usize {
        let r: poslab::runs::results::Results =
            serde_json::from_str(&std::fs::read_to_string(d.join(p)).unwrap()).unwrap();
        r.cells.len()
    };
    assert_eq!(
        [0, 1, 2].map(|k| cells(&format!("shard-{k}/results.json"))),
        [3, 3, 2]
    );
    let (ok, log) = poslab(
        d,
        &["report", "shard-2", "shard-0", "shard-1", "--out", "merged"],
    );
    assert!(ok && !log.contains("note:"), "{log}");
    let whole = std::fs::read(d.join("whole/results.json")).unwrap();
    let merged = std::fs::read(d.join("merged/results.json")).unwrap();
    assert!(
        whole == merged,
        "merged shards differ from the unsharded run"
    );
    // The run records scores by length and the suite's score, and the summary's numbers are
    // what the cells say.
    let results: poslab::runs::results::Results = serde_json::from_slice(&whole).unwrap();
    scores_and_gains_follow_from_the_cells(&results);
    let report = std::fs::read_to_string(d.join("merged/report.md")).unwrap();
    assert!(report.contains("## Length suite") && report.contains("Ruoss et al. 2023"));
    assert!(d.join("merged/plots/length_suite.png").exists());

    // Two shards only: refused, naming the missing shard; merged with --allow-partial, which
    // says so in report.md, results.json, on stderr and in the exit status (3).
    let (code, log) = poslab_status(d, &["report", "shard-0", "shard-1", "--out", "partial"]);
    assert!(
        code == Some(1)
            && log.contains("2 of the experiment's 8 cells are in none of these folders")
            && log.contains("shard 2/3 is not among the folders")
            && log.contains("--allow-partial"),
        "{log}"
    );
    assert!(!d.join("partial").exists(), "nothing written");
    let partial = [
        "report",
        "shard-0",
        "shard-1",
        "--out",
        "partial",
        "--allow-partial",
    ];
    let (code, log) = poslab_status(d, &partial);
    assert!(
        code == Some(3) && log.contains("partial: 6 of 8 cells: missing"),
        "{log}"
    );
    let md = std::fs::read_to_string(d.join("partial/report.md")).unwrap();
    assert!(md.contains("**partial: 6 of 8 cells**"), "{md}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("partial/results.json")).unwrap()).unwrap();
    assert_eq!(json["partial"]["cells"], 6);
    assert_eq!(json["partial"]["of"], 8);
    assert_eq!(json["partial"]["missing"].as_array().unwrap().len(), 2);

    // A folder that holds a report is not written over without --overwrite, and a folder
    // being merged never (its own results would be replaced by the merge's).
    let (code, log) = poslab_status(d, &partial);
    assert!(
        code == Some(1) && log.contains("already holds a report") && log.contains("--overwrite"),
        "{log}"
    );
    let mut again = partial.to_vec();
    again.push("--overwrite");
    let (code, log) = poslab_status(d, &again);
    assert_eq!(code, Some(3), "{log}");
    // The partial merge completed by the missing shard: whole again, and no longer partial.
    let (code, log) = poslab_status(d, &["report", "partial", "shard-2", "--out", "completed"]);
    assert_eq!(code, Some(0), "{log}");
    assert!(std::fs::read(d.join("completed/results.json")).unwrap() == whole);
    let before = std::fs::read(d.join("shard-0/results.json")).unwrap();
    let (ok, log) = poslab(
        d,
        &[
            "report",
            "shard-0",
            "shard-1",
            "--out",
            "shard-0/",
            "--overwrite",
        ],
    );
    assert!(
        !ok && log.contains("one of the run folders being merged"),
        "{log}"
    );
    assert_eq!(
        std::fs::read(d.join("shard-0/results.json")).unwrap(),
        before
    );

    // A shard run with another learning rate is another experiment: refused by name.
    std::fs::write(d.join("other.toml"), TINY.replace("lr = 1e-3", "lr = 2e-3")).unwrap();
    let (ok, log) = poslab(
        d,
        &[
            "compare",
            "other.toml",
            "--shard",
            "2/3",
            "--out",
            "odd",
            "-q",
        ],
    );
    assert!(ok, "{log}");
    let (ok, log) = poslab(d, &["report", "shard-0", "shard-1", "odd", "--out", "bad"]);
    assert!(
        !ok && log.contains("different configs") && log.contains("train.lr"),
        "{log}"
    );
}

#[test]
fn the_cluster_examples_shard_and_merge() {
    let sbatch = repo("examples/cluster/length_suite.sbatch");
    let k8s = repo("examples/cluster/k8s");
    for (shell, script) in [
        ("bash", sbatch.clone()),
        ("sh", k8s.join("shard.sh")),
        ("sh", k8s.join("merge.sh")),
    ] {
        let status = Command::new(shell).arg("-n").arg(&script).status().unwrap();
        assert!(status.success(), "{shell} -n {}", script.display());
    }
    // Kubernetes: the image named once, with a pinned tag; the shard Job indexed, as many
    // completions as SHARDS, the merge Job one pod with the same SHARDS.
    let text = |f: &str| std::fs::read_to_string(k8s.join(f)).unwrap();
    let (shards_yaml, merge_yaml, kustomization) = (
        text("shards.yaml"),
        text("merge.yaml"),
        text("kustomization.yaml"),
    );
    let value = |yaml: &str, key: &str| -> String {
        let line = yaml
            .lines()
            .find(|l| l.trim_start().starts_with(key))
            .unwrap_or_else(|| panic!("no `{key}` in the YAML"));
        line.split_once(':')
            .unwrap()
            .1
            .trim()
            .trim_matches('"')
            .to_string()
    };
    assert_eq!(value(&shards_yaml, "completionMode"), "Indexed");
    assert_eq!(value(&merge_yaml, "parallelism"), "1");
    let shards: usize = value(&shards_yaml, "completions").parse().unwrap();
    for yaml in [&shards_yaml, &merge_yaml] {
        assert!(yaml.contains(&format!("{{ name: SHARDS, value: \"{shards}\" }}")));
        assert_eq!(
            value(yaml, "image"),
            "poslab",
            "the image is named in kustomization.yaml"
        );
    }
    let tag = value(&kustomization, "newTag");
    assert!(!tag.is_empty() && tag != "latest", "tag {tag}");
    assert!(
        kustomization.contains(&format!("poslab:{tag}")),
        "the build line uses the tag"
    );
    let dockerignore = std::fs::read_to_string(repo(".dockerignore")).unwrap();
    assert!(["target/", "runs/", ".git/"]
        .iter()
        .all(|p| dockerignore.contains(p)));
    let config = ExperimentConfig::load(repo("configs/length_suite.toml")).unwrap();
    assert!(shards <= config.cells(&Selection::default()).unwrap().len());

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("tiny.toml"), TINY).unwrap();
    let poslab_bin = env!("CARGO_BIN_EXE_poslab");
    let (ok, log) = poslab(d, &["compare", "tiny.toml", "--out", "whole", "-q"]);
    assert!(ok, "{log}");

    // Slurm's commands stubbed: sbatch records its arguments and answers job ids.
    let bin = d.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(
        bin.join("sbatch"),
        "#!/bin/sh\necho \"$*\" >> \"$SBATCH_LOG\"\nn=$(wc -l < \"$SBATCH_LOG\")\necho $((100 + n))\n",
    )
    .unwrap();
    // A poslab that records what it is asked to do.
    std::fs::write(
        bin.join("fake-poslab"),
        "#!/bin/sh\necho \"$*\" >> \"$FAKE_POSLAB_LOG\"\n",
    )
    .unwrap();
    for f in ["sbatch", "fake-poslab"] {
        let p = bin.join(f);
        let mut perm = std::fs::metadata(&p).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
        std::fs::set_permissions(&p, perm).unwrap();
    }
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let script = sbatch.to_str().unwrap();
    let run = |cwd: &Path, args: &[&str], envs: &[(&str, &str)]| -> (Option<i32>, String) {
        let out = Command::new("bash")
            .arg(script)
            .args(args)
            .current_dir(cwd)
            .env("PATH", &path)
            .env("SBATCH_LOG", d.join("sbatch.log"))
            .env("FAKE_POSLAB_LOG", d.join("poslab.log"))
            .env("RAYON_NUM_THREADS", "1")
            .envs(envs.iter().copied())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned()
                + &String::from_utf8_lossy(&out.stdout),
        )
    };
    let abs = |p: &str| d.join(p).canonicalize().unwrap().display().to_string();

    // Submit (relative paths, made absolute), then run each array task as Slurm would: from
    // another folder, with SLURM_ARRAY_TASK_COUNT as Slurm sets it.
    let settings = [
        ("SHARDS", "3"),
        ("CONFIG", "tiny.toml"),
        ("RUNS", "slurm"),
        ("POSLAB", poslab_bin),
        ("CPUS", "2"),
    ];
    let (code, log) = run(d, &["submit"], &settings);
    assert_eq!(code, Some(0), "{log}");
    let submitted = std::fs::read_to_string(d.join("sbatch.log")).unwrap();
    let lines: Vec<&str> = submitted.lines().collect();
    let runs = abs("slurm");
    assert!(
        lines[0].contains("--array=0-2")
            && lines[0].contains("--cpus-per-task=2")
            && lines[0].contains(&format!("--output={runs}/logs/shard-%a.out"))
            && lines[0].ends_with(" shard"),
        "{submitted}"
    );
    assert!(
        lines[1].contains("--dependency=afterok:101")
            && lines[1].contains("--kill-on-invalid-dep=yes")
            && lines[1].ends_with(" merge"),
        "{submitted}"
    );
    let env = std::fs::read_to_string(d.join("slurm/slurm.env")).unwrap();
    for line in [
        format!("RUNS={runs}"),
        format!("CONFIG={}", abs("tiny.toml")),
        format!(
            "POSLAB={}",
            Path::new(poslab_bin).canonicalize().unwrap().display()
        ),
    ] {
        assert!(env.contains(&line), "{line} in {env}");
    }
    let elsewhere = Path::new("/");
    let task = |k: &str, count: &str| {
        run(
            elsewhere,
            &["shard"],
            &[
                ("SLURM_ARRAY_TASK_ID", k),
                ("SLURM_ARRAY_TASK_COUNT", count),
                ("SLURM_CPUS_PER_TASK", "1"),
                ("RUNS", &runs),
            ],
        )
    };
    for k in ["0", "1"] {
        let (code, log) = task(k, "3");
        assert_eq!(code, Some(0), "{log}");
    }
    // The merge refuses while shard 2 is missing, naming it.
    let (code, log) = run(elsewhere, &["merge"], &[("RUNS", &runs)]);
    assert!(
        code == Some(1) && log.contains(&format!("shard 2 ({runs}/shard-2) of 3 never started")),
        "{log}"
    );
    let (code, log) = run(elsewhere, &["status"], &[("RUNS", &runs)]);
    assert!(
        code == Some(0)
            && log.contains("shard 0/3: done")
            && log.contains("shard 2/3: not started")
            && log.contains("rerun 2"),
        "{log}"
    );
    // Shard 2 as a one-task re-run: SLURM_ARRAY_TASK_COUNT is 1, the shard still 2/3.
    let (code, log) = task("2", "1");
    assert_eq!(code, Some(0), "{log}");
    let (code, log) = run(elsewhere, &["merge"], &[("RUNS", &runs)]);
    assert_eq!(code, Some(0), "{log}");
    let whole = std::fs::read(d.join("whole/results.json")).unwrap();
    let slurm = std::fs::read(d.join("slurm/merged/results.json")).unwrap();
    assert!(
        whole == slurm,
        "the Slurm merge differs from the unsharded run"
    );

    // `rerun 1` of 4 shards: an array of one task, and the task runs shard 1/4.
    let fake = bin.join("fake-poslab");
    let fake = fake.to_str().unwrap();
    std::fs::write(d.join("sbatch.log"), "").unwrap();
    let (code, log) = run(
        d,
        &["submit"],
        &[
            ("SHARDS", "4"),
            ("CONFIG", "tiny.toml"),
            ("RUNS", "four"),
            ("POSLAB", fake),
        ],
    );
    assert_eq!(code, Some(0), "{log}");
    let four = abs("four");
    let (code, log) = run(d, &["rerun", "1"], &[("RUNS", &four)]);
    assert_eq!(code, Some(0), "{log}");
    let submitted = std::fs::read_to_string(d.join("sbatch.log")).unwrap();
    let rerun: Vec<&str> = submitted.lines().skip(2).collect();
    assert!(
        rerun[0].contains("--array=1 ") && rerun[1].contains("--dependency=afterok:103"),
        "{submitted}"
    );
    let (code, log) = run(
        elsewhere,
        &["shard"],
        &[
            ("SLURM_ARRAY_TASK_ID", "1"),
            ("SLURM_ARRAY_TASK_COUNT", "1"),
            ("SLURM_CPUS_PER_TASK", "3"),
            ("RUNS", &four),
        ],
    );
    assert_eq!(code, Some(0), "{log}");
    let asked = std::fs::read_to_string(d.join("poslab.log")).unwrap();
    let shard_call = asked.lines().last().unwrap();
    assert_eq!(
        shard_call,
        format!(
            "compare {} --shard 1/4 --out {four}/shard-1 --jobs 3",
            abs("tiny.toml")
        )
    );
    let (code, log) = run(d, &["rerun", "4"], &[("RUNS", &four)]);
    assert!(
        code == Some(1) && log.contains("4 is not a shard of 4"),
        "{log}"
    );
    let (code, log) = run(elsewhere, &["merge"], &[("RUNS", &four)]);
    assert!(code == Some(1) && log.contains("shard 0 ("), "{log}");
    let (code, _) = run(d, &["nonsense"], &[]);
    assert_eq!(code, Some(2));

    // The Kubernetes pods' scripts: each index a shard; the one merge waits for them all.
    let pod = |script: &str, envs: &[(&str, &str)]| -> (Option<i32>, String) {
        let out = Command::new("sh")
            .arg(k8s.join(script))
            .current_dir(d)
            .env("SHARDS", "3")
            .env("CONFIG", "tiny.toml")
            .env("RUNS", "k8s")
            .env("POSLAB", poslab_bin)
            .env("RAYON_NUM_THREADS", "1")
            .envs(envs.iter().copied())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for k in ["0", "1"] {
        let (code, log) = pod("shard.sh", &[("JOB_COMPLETION_INDEX", k)]);
        assert_eq!(code, Some(0), "{log}");
    }
    let (code, log) = pod("merge.sh", &[("MERGE_WAIT", "0")]);
    assert!(
        code == Some(1) && log.contains("shard(s) 2 of 3 have not finished"),
        "{log}"
    );
    let (code, log) = pod("merge.sh", &[("MERGE_WAIT", "0"), ("ALLOW_PARTIAL", "1")]);
    assert!(
        code == Some(0) && log.contains("partial: 6 of 8 cells"),
        "{log}"
    );
    // A retried pod continues its shard; an index past SHARDS is refused.
    let (code, log) = pod("shard.sh", &[("JOB_COMPLETION_INDEX", "1")]);
    assert!(
        code == Some(0) && log.contains("3 of 3 cells were done before"),
        "{log}"
    );
    let (code, log) = pod("shard.sh", &[("JOB_COMPLETION_INDEX", "3")]);
    assert!(
        code == Some(1) && log.contains("completions and SHARDS"),
        "{log}"
    );
    let (code, log) = pod("shard.sh", &[("JOB_COMPLETION_INDEX", "2")]);
    assert_eq!(code, Some(0), "{log}");
    let (code, log) = pod("merge.sh", &[("MERGE_WAIT", "0")]);
    assert_eq!(code, Some(0), "{log}");
    let k8s_merged = std::fs::read(d.join("k8s/merged/results.json")).unwrap();
    assert!(
        k8s_merged == whole,
        "the Kubernetes merge differs from the unsharded run"
    );
    // A merge again replaces its own report; never another experiment's.
    let (code, log) = pod("merge.sh", &[("MERGE_WAIT", "0")]);
    assert_eq!(code, Some(0), "{log}");
    std::fs::write(d.join("other.toml"), TINY.replace("lr = 1e-3", "lr = 2e-3")).unwrap();
    let (ok, log) = poslab(
        d,
        &[
            "report",
            "k8s/shard-0",
            "--out",
            "k8s/merged",
            "--overwrite",
            "--allow-partial",
        ],
    );
    assert!(ok || log.contains("partial"), "{log}");
    let (ok, log) = poslab(d, &["compare", "other.toml", "--out", "odd2", "-q"]);
    assert!(ok, "{log}");
    let (ok, log) = poslab(d, &["report", "odd2", "--out", "k8s/merged", "--overwrite"]);
    assert!(
        !ok && log.contains("of another experiment config") && log.contains("train.lr"),
        "{log}"
    );
}

/// With `eval_factors` the tests overlap (2x: 2-8 and 4x: 4-16 of lengths 1-4): the score
/// counts each length above training once, from the first test that has it, so the folder
/// merges (`report` checks the lengths are in order, each once; before, it refused the folder
/// compare had just written).
#[test]
fn overlapping_factor_tests_score_each_length_once_and_merge() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let config = TINY.split("[[tasks]]").next().unwrap().to_string()
        + "[[tasks]]\nkind = \"parity_check\"\nlengths = [1, 4]\neval_factors = [1, 2, 4]\n\
           train_examples = 64\neval_examples = 12\n\n[[variants]]\nname = \"rope\"\n\
           positional = { kind = \"rope\" }\n";
    std::fs::write(d.join("factors.toml"), config).unwrap();
    let (ok, log) = poslab(d, &["compare", "factors.toml", "--out", "run", "-q"]);
    assert!(ok, "{log}");
    let (ok, log) = poslab(d, &["report", "run", "--out", "merged"]);
    assert!(ok, "{log}");
    let results: poslab::runs::results::Results =
        serde_json::from_str(&std::fs::read_to_string(d.join("run/results.json")).unwrap())
            .unwrap();
    for cell in &results.cells {
        let Some(poslab::runs::results::Outcome::Scored { by_length, .. }) =
            cell.evaluation(poslab::runs::results::SCORE)
        else {
            panic!("{}: no score", cell.name())
        };
        let lengths: Vec<usize> = by_length.iter().map(|s| s.length).collect();
        assert!(
            lengths.windows(2).all(|w| w[0] < w[1]) && lengths[0] >= 5 && lengths.len() > 4,
            "{}: {lengths:?}",
            cell.name()
        );
    }
}
