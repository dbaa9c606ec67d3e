//! `poslab compare` end to end: files, determinism, merging split runs, saved models, and the
//! word-order result the product exists to show.

use std::path::Path;

use candle::{DType, Device};
use poslab::data::Dataset;
use poslab::runs::compare::{run, RunOptions};
use poslab::runs::merge::{load_run, merge};
use poslab::runs::results::{Outcome, Results};
use poslab::runs::{ExperimentConfig, Selection};
use poslab::train::evaluate;

fn experiment(variants: &[&str], seeds: u64, steps: usize, d_model: usize) -> ExperimentConfig {
    let mut text = format!(
        "name = \"tiny\"\nseeds = {seeds}\n\
         [model]\nd_model = {d_model}\nn_heads = 2\nn_layers = 2\nffn_dim = {}\ndropout = 0.1\nattention_dropout = 0.0\n\
         [train]\nbudget = {{ steps = {steps} }}\nbatch_size = 32\nlr = 3e-3\neval_every = 50\n\
         [eval]\nshift = 8\n\
         [[tasks]]\nkind = \"word_order\"\nlengths = [5, 10]\ntrain_examples = 2000\neval_examples = 400\n",
        2 * d_model
    );
    for v in variants {
        text.push_str(&format!(
            "[[variants]]\nname = \"{v}\"\npositional = {{ kind = \"{v}\" }}\n"
        ));
    }
    ExperimentConfig::from_toml_str(&text).unwrap()
}

fn run_into(config: &ExperimentConfig, dir: &Path, selection: Selection) -> Results {
    run(
        config,
        &RunOptions {
            selection,
            jobs: 2,
            ..RunOptions::new(Device::Cpu, dir)
        },
        &|_| {},
    )
    .unwrap()
    .results
}

fn accuracy(results: &Results, variant: &str, seed: u64, eval: &str) -> f64 {
    let cell = results
        .cells
        .iter()
        .find(|c| c.variant == variant && c.seed == seed)
        .unwrap();
    match cell.evaluation(eval).unwrap() {
        Outcome::Scored { accuracy, .. } => *accuracy,
        Outcome::Unavailable { reason } => panic!("{variant} {eval}: {reason}"),
    }
}

#[test]
fn a_tiny_compare_writes_every_file_reproducibly_and_merges_from_parts() {
    let config = experiment(&["sinusoidal_add", "learned"], 1, 40, 16);
    let root = tempfile::tempdir().unwrap();
    let full = root.path().join("full");
    let results = run_into(&config, &full, Selection::default());

    for file in [
        "report.md",
        "results.csv",
        "summary.csv",
        "results.json",
        "timing.json",
        "plots/loss_word_order.png",
        "plots/length_word_order.png",
    ] {
        let len = std::fs::metadata(full.join(file))
            .map(|m| m.len())
            .unwrap_or(0);
        assert!(len > 100, "{file}: {len} bytes");
    }
    for variant in ["sinusoidal_add", "learned"] {
        for file in ["model.safetensors", "config.json", "tokenizer.json"] {
            let path = full
                .join("models/word_order")
                .join(variant)
                .join("seed0")
                .join(file);
            assert!(path.is_file(), "{}", path.display());
        }
    }
    // Where a learned table is too short, the cell says so and why; sinusoids run every length.
    let learned = results
        .cells
        .iter()
        .find(|c| c.variant == "learned")
        .unwrap();
    match learned.evaluation("2x").unwrap() {
        Outcome::Unavailable { reason } => {
            assert!(reason.contains("learned table has 10 rows"), "{reason}")
        }
        other => panic!("learned ran 2x: {other:?}"),
    }
    assert!(matches!(
        learned.evaluation("1x"),
        Some(Outcome::Scored { .. })
    ));
    assert!(accuracy(&results, "sinusoidal_add", 0, "4x") >= 0.0);
    let md = std::fs::read_to_string(full.join("report.md")).unwrap();
    assert!(
        md.contains("order-blind ceiling 50.0%") && md.contains("n/a [1]"),
        "{md}"
    );
    assert!(md.contains("the learned table has 10 rows"), "{md}");
    let csv = std::fs::read_to_string(full.join("results.csv")).unwrap();
    assert_eq!(
        csv.lines().count(),
        1 + 2 * 5,
        "a row per cell and evaluation"
    );

    // The same config and seeds again: the same results.json, byte for byte.
    let again = root.path().join("again");
    run_into(&config, &again, Selection::default());
    let bytes = |d: &Path| std::fs::read(d.join("results.json")).unwrap();
    assert_eq!(
        bytes(&full),
        bytes(&again),
        "results.json differs between identical runs"
    );

    // Split by variant across two "machines", then merged: the same results as one run.
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    for (dir, variant) in [(&a, "sinusoidal_add"), (&b, "learned")] {
        run_into(
            &config,
            dir,
            Selection {
                variants: vec![variant.into()],
                ..Default::default()
            },
        );
    }
    let parts = [a, b].map(|d| {
        let (r, t) = load_run(&d).unwrap();
        (d, r, t)
    });
    let (merged, timings) = merge(parts.to_vec()).unwrap();
    assert_eq!(merged, results);
    assert_eq!(timings.len(), 2);
    // Merging runs of different experiments is refused.
    let (mut other, t) = load_run(&full).unwrap();
    other.experiment = "something_else".into();
    let err = merge(vec![
        (full.clone(), results.clone(), vec![]),
        (root.path().join("x"), other, t),
    ])
    .unwrap_err();
    assert!(
        err.to_string().contains("not runs of the same experiment"),
        "{err}"
    );
}

#[test]
fn saved_models_reload_and_score_what_the_report_says() {
    let config = experiment(&["rope"], 1, 30, 16);
    let dir = tempfile::tempdir().unwrap();
    let results = run_into(&config, dir.path(), Selection::default());
    let cell = &results.cells[0];
    let loaded =
        poslab::saved::load(&dir.path().join(&cell.model_dir), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(loaded.config.task, "word_order");
    let data = config.tasks[0].generate().unwrap();
    let test = Dataset::encode(
        &data.tests[0].examples,
        &loaded.tokenizer,
        None,
        Default::default(),
    )
    .unwrap();
    let score = evaluate(
        &loaded.model,
        &test,
        loaded.tokenizer.pad_id(),
        None,
        0,
        64,
        0,
    )
    .unwrap();
    match cell.evaluation("1x").unwrap() {
        Outcome::Scored { accuracy, loss, .. } => {
            assert_eq!(score.accuracy, *accuracy);
            assert_eq!(score.loss, *loss);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn cells_that_do_not_exist_are_refused_by_name() {
    let config = experiment(&["none", "rope"], 2, 10, 16);
    let err = config
        .select(&Selection {
            variants: vec!["sinusoidal".into()],
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no variant named `sinusoidal`") && err.contains("none, rope"),
        "{err}"
    );
    let err = config
        .select(&Selection {
            seeds: vec![5],
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("seed 5") && err.contains("[0, 1]"), "{err}");
}

#[test]
fn word_order_separates_positions_from_the_bag_of_words() {
    // A small budget already shows it, seed after seed: without positions the model sits near
    // the 50% ceiling an order-blind model cannot beat; with sinusoids added it is far above;
    // shuffling a sentence's words sends it back to chance.
    let config = experiment(&["none", "sinusoidal_add"], 4, 300, 32);
    let dir = tempfile::tempdir().unwrap();
    let results = run_into(&config, dir.path(), Selection::default());
    for seed in 0..4 {
        let none = accuracy(&results, "none", seed, "1x");
        let add = accuracy(&results, "sinusoidal_add", seed, "1x");
        let shuffled = accuracy(&results, "sinusoidal_add", seed, "shuffled");
        eprintln!("seed {seed}: none {none:.3}, sinusoidal_add {add:.3}, shuffled {shuffled:.3}");
        // 400 test sentences: a binomial standard error of 2.5 points at 50%.
        assert!((0.40..=0.60).contains(&none), "seed {seed}: none at {none}");
        assert!(add >= 0.85, "seed {seed}: sinusoidal_add at {add}");
        assert!(
            shuffled <= 0.62 && add - shuffled >= 0.25,
            "seed {seed}: shuffled {shuffled} vs {add}"
        );
        // The bag-of-words model does not care about order, so shuffling changes nothing.
        let none_shuffled = accuracy(&results, "none", seed, "shuffled");
        assert!(
            (none - none_shuffled).abs() <= 0.01,
            "seed {seed}: {none} vs {none_shuffled}"
        );
    }
    let ceiling = results.tasks[0].order_blind_ceiling.as_ref().unwrap();
    assert_eq!(ceiling.accuracy, 0.5);
}

/// A compare states its answer: the report and the terminal lead with the verdicts, each
/// comparison's difference is the mean over seeds of the reported accuracies' difference, its
/// interval holds it, the p-values are Holm-corrected upward, a test a variant cannot run is
/// left out with the reason, and a merge of the run split by seed states the same verdicts.
#[test]
fn a_compare_leads_with_verdicts_that_agree_with_its_scores() {
    let mut config = experiment(&["sinusoidal_add", "learned", "none"], 2, 40, 16);
    config.comparisons = vec![poslab::runs::ComparisonSpec {
        a: "none".into(),
        b: "sinusoidal_add".into(),
    }];
    config.comparisons.push(poslab::runs::ComparisonSpec {
        a: "sinusoidal_add".into(),
        b: "learned".into(),
    });
    config.validate().unwrap();
    let root = tempfile::tempdir().unwrap();
    let full = root.path().join("full");
    let results = run_into(&config, &full, Selection::default());
    let columns = ["1x", "2x", "4x", "shuffled", "shift+8"];
    // none vs add: every column; add vs learned: 1x and shuffled (learned's table is too short
    // for the rest, which are left out with the reason).
    assert_eq!(results.comparisons.len(), columns.len() + 2);
    assert_eq!(results.comparisons_skipped.len(), 3);
    for k in &results.comparisons_skipped {
        assert!(k.reason.contains("`learned` cannot run it"), "{k:?}");
    }
    for c in &results.comparisons {
        let mean_diff = (0..2)
            .map(|s| {
                accuracy(&results, &c.b, s, &c.evaluation)
                    - accuracy(&results, &c.a, s, &c.evaluation)
            })
            .sum::<f64>()
            / 2.0;
        assert!((c.diff - 100.0 * mean_diff).abs() < 1e-9, "{c:?}");
        assert!(c.ci_low <= c.diff && c.diff <= c.ci_high, "{c:?}");
        assert!(c.p_holm >= c.p && c.p_holm <= 1.0, "{c:?}");
        assert_eq!((c.seeds, c.examples), (2, 400), "{c:?}");
        assert!(!c.verdict.is_empty());
    }
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(full.join("results.json")).unwrap()).unwrap();
    let first = &json["comparisons"][0];
    for field in [
        "task",
        "evaluation",
        "a",
        "b",
        "diff",
        "ci_low",
        "ci_high",
        "p",
        "p_holm",
        "verdict",
        "seeds",
        "examples",
    ] {
        assert!(
            !first[field].is_null(),
            "results.json comparisons lack `{field}`"
        );
    }
    let md = std::fs::read_to_string(full.join("report.md")).unwrap();
    let verdicts = md
        .find("## Verdicts")
        .expect("report.md has a Verdicts section");
    let first_task = md.find("## word_order").unwrap();
    assert!(verdicts < first_task, "the verdicts lead report.md");
    assert!(
        md.contains("**word_order**, `sinusoidal_add` − `none`: 1x"),
        "{md}"
    );
    assert!(md.contains("## Comparisons in full"), "{md}");

    // Seeds split over two folders, merged: the same verdicts, bit for bit.
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    for (dir, seed) in [(&a, 0), (&b, 1)] {
        run_into(
            &config,
            dir,
            Selection {
                seeds: vec![seed],
                ..Default::default()
            },
        );
    }
    let parts = [a, b].map(|d| {
        let (r, t) = load_run(&d).unwrap();
        (d, r, t)
    });
    let (merged, _) = merge(parts.to_vec()).unwrap();
    assert_eq!(merged.comparisons, results.comparisons);
    // A part alone has one seed: no verdicts, each comparison saying why.
    assert!(parts[0].1.comparisons.is_empty());
    assert!(!parts[0].1.comparisons_skipped.is_empty());
    assert!(parts[0]
        .1
        .comparisons_skipped
        .iter()
        .all(|k| k.reason.contains("no verdict: 1 seed")
            || k.reason.contains("`learned` cannot run it")));
}

#[test]
fn comparisons_name_two_different_variants_of_the_experiment() {
    let config = experiment(&["none", "rope"], 1, 10, 16);
    let with = |a: &str, b: &str| {
        let mut c = config.clone();
        c.comparisons = vec![poslab::runs::ComparisonSpec {
            a: a.into(),
            b: b.into(),
        }];
        c.validate().map(|_| ()).map_err(|e| e.to_string())
    };
    assert!(with("none", "rope").is_ok());
    let err = with("none", "alibi").unwrap_err();
    assert!(
        err.contains("`alibi` is not a variant") && err.contains("none, rope"),
        "{err}"
    );
    let err = with("rope", "rope").unwrap_err();
    assert!(err.contains("both `rope`"), "{err}");
    let mut twice = config.clone();
    twice.comparisons = vec![
        poslab::runs::ComparisonSpec {
            a: "none".into(),
            b: "rope".into(),
        };
        2
    ];
    let err = twice.validate().unwrap_err().to_string();
    assert!(err.contains("twice"), "{err}");
    // Without [[comparisons]], each variant against the first.
    assert_eq!(
        config.comparison_pairs(),
        vec![("none".to_string(), "rope".to_string())]
    );
    // A config file names them in TOML.
    let text = format!(
        "{}\n[[comparisons]]\na = \"rope\"\nb = \"none\"\n",
        config.to_toml()
    );
    let parsed = ExperimentConfig::from_toml_str(&text).unwrap();
    assert_eq!(
        parsed.comparison_pairs(),
        vec![("rope".to_string(), "none".to_string())]
    );
}

/// The text of the first `<td class="{class}">` after `from` in `dom`.
fn cell_text<'a>(dom: &'a str, from: usize, class: &str) -> &'a str {
    let open = format!("<td class=\"{class}\">");
    let at = from + dom[from..].find(&open).expect("the row has the cell") + open.len();
    &dom[at..at + dom[at..].find("</td>").unwrap()]
}

#[test]
fn report_html_shows_the_verdicts_of_results_json_in_a_real_browser() {
    let Some(browser) = crate::common::headless_browser() else {
        return;
    };
    let mut config = experiment(&["none", "sinusoidal_add", "rope"], 2, 40, 16);
    config.comparisons = vec![
        poslab::runs::ComparisonSpec {
            a: "none".into(),
            b: "sinusoidal_add".into(),
        },
        poslab::runs::ComparisonSpec {
            a: "sinusoidal_add".into(),
            b: "rope".into(),
        },
    ];
    config.validate().unwrap();
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("run");
    run_into(&config, &dir, Selection::default());
    let page = dir.join("report.html");
    let html = std::fs::read_to_string(&page).unwrap();
    for remote in ["http://", "https://", "//cdn", "src=\""] {
        assert!(
            !html.contains(remote) || remote == "http://" && only_svg_namespace(&html),
            "report.html must fetch nothing, but holds `{remote}`"
        );
    }

    // The page as the browser draws it: no console message, drawn to the end, and every
    // comparison of results.json in the verdict table with results.json's numbers.
    let profile = root.path().join("profile");
    let dom = crate::common::drawn_page(&browser, &profile, &page);
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("results.json")).unwrap()).unwrap();
    let comparisons = json["comparisons"].as_array().unwrap();
    assert_eq!(
        comparisons.len(),
        2 * 5,
        "two comparisons on five evaluations"
    );
    assert_eq!(
        dom.matches("<tr class=\"verdict").count(),
        comparisons.len()
    );
    for c in comparisons {
        let s = |k: &str| c[k].as_str().unwrap().to_string();
        let f = |k: &str| c[k].as_f64().unwrap();
        let row = format!(
            "data-task=\"{}\" data-evaluation=\"{}\" data-a=\"{}\" data-b=\"{}\"",
            s("task"),
            s("evaluation"),
            s("a"),
            s("b")
        );
        let at = dom
            .find(&row)
            .unwrap_or_else(|| panic!("no verdict row {row}"));
        assert_eq!(
            cell_text(&dom, at, "num diff"),
            format!("{:+.1}", f("diff"))
        );
        assert_eq!(
            cell_text(&dom, at, "num ci"),
            format!("{:+.1} to {:+.1}", f("ci_low"), f("ci_high"))
        );
        assert_eq!(
            cell_text(&dom, at, "num p-holm"),
            poslab::runs::verdict::format_p(f("p_holm")).replace('<', "&lt;")
        );
        assert_eq!(cell_text(&dom, at, "verdict"), s("verdict"));
    }
    // The opening paragraph in words, and the verdicts filtered by pair as well as by test.
    let opening = dom
        .find("<p id=\"findings\">")
        .expect("the page opens with its findings");
    assert!(opening < dom.find("id=\"verdict-table\"").unwrap());
    assert!(
        dom[opening..].contains("planned comparisons, which share Holm's correction at 0.05"),
        "{}",
        &dom[opening..opening + 400]
    );
    let pairs = dom
        .find("<select id=\"verdict-pair\">")
        .expect("a pair filter");
    let options = &dom[pairs..pairs + dom[pairs..].find("</select>").unwrap()];
    for pair in [
        "every pair",
        "sinusoidal_add − none",
        "rope − sinusoidal_add",
    ] {
        assert!(options.contains(&format!(">{pair}</option>")), "{options}");
    }
    // Its curves: one chart by length and one of loss for the task, a line per variant.
    assert_eq!(dom.matches("<div class=\"chart\">").count(), 2);
    assert_eq!(dom.matches("<polyline").count(), 2 * 3);

    // A screenshot that is not blank: the variants' colours drawn over many pixels (their
    // lines, not only the toggles' swatches).
    let pixels = crate::common::screenshot(&browser, &profile, &page, root.path());
    let near = crate::common::near;
    // Tableau's first three colours: none, sinusoidal_add, rope.
    for (variant, rgb) in [
        ("none", (31, 119, 180)),
        ("sinusoidal_add", (255, 127, 14)),
        ("rope", (44, 160, 44)),
    ] {
        let n = pixels.iter().filter(|p| near(p, rgb)).count();
        assert!(
            n > 600,
            "{variant}'s colour covers only {n} pixels: its curves are not drawn"
        );
    }
}

/// Whether every `http://` in `html` is the SVG namespace the script names.
fn only_svg_namespace(html: &str) -> bool {
    html.matches("http://").count() == html.matches("http://www.w3.org/2000/svg").count()
}

#[test]
fn a_length_plot_is_drawn_only_where_the_test_lengths_vary() {
    let root = tempfile::tempdir().unwrap();
    // A file whose sentences are all three words long: its test lengths do not vary, and a
    // length plot would be one column of dots. Beside it, one of 2 to 7 words.
    let words = ["red", "blue", "cat", "dog", "sat", "ran", "big", "old"];
    let mut same = String::from("text\tlabel\n");
    let mut varied = String::from("text\tlabel\n");
    for i in 0..240usize {
        let w = |k: usize| words[(i * 7 + k * 3) % words.len()];
        let label = if i % 2 == 0 { "a" } else { "b" };
        same.push_str(&format!("{} {} {}\t{label}\n", w(0), w(1), w(2)));
        let n = 2 + i % 6;
        let text: Vec<&str> = (0..n).map(w).collect();
        varied.push_str(&format!("{}\t{label}\n", text.join(" ")));
    }
    let report_of = |name: &str, tsv: &str| {
        let file = root.path().join(format!("{name}.tsv"));
        std::fs::write(&file, tsv).unwrap();
        let text = format!(
            "name = \"{name}\"\nseeds = 1\n\
             [model]\nd_model = 16\nn_heads = 2\nn_layers = 1\nffn_dim = 32\n\
             [train]\nbudget = {{ steps = 10 }}\nbatch_size = 16\neval_every = 10\n\
             [[tasks]]\nkind = \"classify\"\nname = \"{name}\"\ntrain = {file:?}\n\
             [[variants]]\nname = \"none\"\npositional = {{ kind = \"none\" }}\n\
             [[variants]]\nname = \"rope\"\npositional = {{ kind = \"rope\" }}\n"
        );
        let config = ExperimentConfig::from_toml_str(&text).unwrap();
        let out = root.path().join(format!("run-{name}"));
        run_into(&config, &out, Selection::default());
        let md = std::fs::read_to_string(out.join("report.md")).unwrap();
        let plot = out.join(format!("plots/length_{name}.png")).exists();
        assert!(out.join(format!("plots/loss_{name}.png")).exists());
        (plot, md.contains(&format!("plots/length_{name}.png")))
    };
    assert_eq!(report_of("same", &same), (false, false));
    assert_eq!(report_of("varied", &varied), (true, true));
}
