//! `poslab analyze`: known values, the relative-shift property at rounding level (and not for
//! a random table), the attention-term split, a learned table from a trained run, and pictures
//! with their text rendered.

use std::path::Path;
use std::process::Command;

use candle::{DType, Device, Tensor};
use poslab::analysis::{analyze, wavelengths, Options, Table};
use poslab::{Encoder, NormPlacement, ParamStore, PositionalConfig, RopePairing, TableLayout};

use crate::common::*;

#[test]
fn consecutive_positions_of_a_sinusoid_are_equally_far_apart() {
    for layout in [TableLayout::Interleaved, TableLayout::Half] {
        let t = Table::sinusoidal(512, 10_000.0, layout, 128, 0);
        let a = analyze(&t, &Options::default());
        let c = a.consecutive_l2;
        assert!(c.max - c.min < 1e-9, "{layout:?}: {c:?}");
        // Each pair contributes |e^{i w}| - 1 in L2: sum_i 2 - 2 cos(w_i).
        let expected: f64 = poslab::positional::inverse_frequencies(512, 10_000.0)
            .iter()
            .map(|w| 2.0 - 2.0 * w.cos())
            .sum::<f64>()
            .sqrt();
        assert!((c.mean - expected).abs() < 1e-9, "{} vs {expected}", c.mean);
        assert!(a.values.min >= -1.0 && a.values.max <= 1.0);
    }
    // A learned-like random table is nothing of the kind.
    let mut rng = poslab::rng::stream(0, "test");
    use rand::Rng as _;
    let random = Table {
        title: "random".into(),
        start: 0,
        rows: 64,
        dim: 32,
        values: (0..64 * 32).map(|_| rng.random_range(-1.0..1.0)).collect(),
        pairs: None,
    };
    let c = analyze(&random, &Options::default()).consecutive_l2;
    assert!(c.max - c.min > 0.5, "{c:?}");
}

#[test]
fn the_shift_is_a_rotation_for_sinusoids_and_rope_and_not_for_a_random_table() {
    let tables = [
        Table::sinusoidal(64, 10_000.0, TableLayout::Interleaved, 200, 0),
        Table::sinusoidal(64, 100.0, TableLayout::Half, 200, 1_000),
        Table::rope(32, 10_000.0, RopePairing::Interleaved, 200),
        Table::rope(32, 500_000.0, RopePairing::Half, 200),
    ];
    for t in &tables {
        let a = analyze(t, &Options::default());
        let rotation = a.rotation_error().unwrap();
        assert!(rotation < 1e-12, "{}: rotation error {rotation:e}", t.title);
        let (fit, random) = a.linear_residuals();
        assert!(fit < 1e-4, "{}: linear residual {fit:e}", t.title);
        assert!(random > 0.5, "{}: random baseline {random}", t.title);
        assert_eq!(a.shift.first().unwrap().k, 1);
        // Position reads back exactly from these tables, and not from a random one.
        assert_eq!(a.probe.exact, 1.0, "{}", t.title);
        assert!(
            a.probe.random_mae > 10.0,
            "{}: {}",
            t.title,
            a.probe.random_mae
        );
    }
    // Break one entry: the rotation no longer holds.
    let mut broken = tables[0].clone();
    broken.values[10 * 64 + 3] += 0.5;
    assert!(
        analyze(&broken, &Options::default())
            .rotation_error()
            .unwrap()
            > 0.4
    );
}

#[test]
fn wavelengths_and_first_wraps_are_the_closed_form() {
    let w = wavelengths(64, 10_000.0);
    assert!((w.wavelength[0] - std::f64::consts::TAU).abs() < 1e-12);
    assert_eq!(w.first_wrap[0], 7); // 2 pi = 6.28...: the angle passes it at position 7
    assert!((w.wavelength[31] - std::f64::consts::TAU * 10_000f64.powf(62.0 / 64.0)).abs() < 1e-6);
    assert!(w.wavelength.windows(2).all(|p| p[1] > p[0]));
}

#[test]
fn attention_terms_rebuild_the_scores_exactly() {
    for positional in [
        PositionalConfig::SinusoidalAdd(Default::default()),
        PositionalConfig::Learned(Default::default()),
    ] {
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            let store = ParamStore::new(3);
            let encoder = Encoder::new(
                &tiny_config(positional.clone(), norm),
                store.var_builder(DType::F64, &Device::Cpu),
            )
            .unwrap();
            let (ids, mask) = padded_batch(3, 9, 40);
            let layers = encoder.score_terms(&ids, &mask).unwrap();
            assert_eq!(
                layers.len(),
                if norm == NormPlacement::Pre { 2 } else { 1 },
                "{norm:?}"
            );
            for (i, scores, terms) in layers {
                let sum = terms
                    .iter()
                    .skip(1)
                    .fold(terms[0].clone(), |a, t| (a + t).unwrap());
                let err = max_abs_diff(&sum, &scores);
                assert!(err < 1e-10, "layer {i}: {err:e}");
                // The position·position term is not zero: positions matter in these models.
                assert!(
                    terms[3]
                        .abs()
                        .unwrap()
                        .max_all()
                        .unwrap()
                        .to_scalar::<f64>()
                        .unwrap()
                        > 1e-3
                );
            }
        }
    }
    // Not defined where positions are not added to the tokens.
    let store = ParamStore::new(3);
    let rope = Encoder::new(
        &tiny_config(
            PositionalConfig::Rope(Default::default()),
            NormPlacement::Pre,
        ),
        store.var_builder(DType::F64, &Device::Cpu),
    )
    .unwrap();
    let (ids, mask) = padded_batch(2, 5, 40);
    let e = rope.score_terms(&ids, &mask).unwrap_err().to_string();
    assert!(
        e.contains("sinusoidal_add or learned") && e.contains("`rope`"),
        "{e}"
    );
}

/// Asserts that a PNG has dark (text) pixels in a horizontal band: its title or axis labels.
fn has_text(path: &Path, band: std::ops::Range<u32>) -> bool {
    let img = image::open(path).unwrap().to_luma8();
    let (w, _) = img.dimensions();
    band.flat_map(|y| (w / 5..4 * w / 5).map(move |x| (x, y)))
        .filter(|&(x, y)| img.get_pixel(x, y)[0] < 90)
        .count()
        > 30
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
fn the_command_writes_files_and_pictures_with_their_text() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("rope");
    let (ok, stdout, stderr) = poslab(&[
        "analyze",
        "rope",
        "--dim",
        "16",
        "--pairing",
        "half",
        "--positions",
        "64",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("consecutive L2 distance")
            && stdout.contains("(constant)")
            && stdout.contains("rope q·k"),
        "{stdout}"
    );
    for f in [
        "table.csv",
        "table.png",
        "distance_cosine.png",
        "distance_l2.csv",
        "offset_l2.png",
        "clock.png",
        "wavelengths.png",
        "rope_decay.png",
        "summary.json",
    ] {
        let len = std::fs::metadata(out.join(f)).map(|m| m.len()).unwrap_or(0);
        assert!(len > 200, "{f}: {len} bytes");
    }
    // Titles at the top and axis labels at the bottom are drawn (the font is embedded).
    assert!(has_text(&out.join("table.png"), 5..30), "table title");
    assert!(
        has_text(&out.join("table.png"), 770..800),
        "table axis label"
    );
    assert!(has_text(&out.join("offset_l2.png"), 8..32), "offset title");
    let csv = std::fs::read_to_string(out.join("table.csv")).unwrap();
    assert_eq!(csv.lines().count(), 65);
    assert!(csv.starts_with("position,d0,d1"));

    let (ok, _, stderr) = poslab(&["analyze", "sinusoidal", "--dim", "15"]);
    assert!(!ok && stderr.contains("must be even"), "{stderr}");
    let (ok, _, stderr) = poslab(&["analyze", "sinusoidal", "--layout", "spiral"]);
    assert!(
        !ok && stderr.contains("unknown variant `spiral`"),
        "{stderr}"
    );
}

#[test]
fn a_learned_table_from_a_trained_run_loads_and_analyses() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("run");
    let config = poslab::experiment::single::TrainRunConfig::from_toml_str(
        "name = \"t\"\ncheckpoint_every = 0\nmax_len = 24\n\
         [model]\nd_model = 16\nn_heads = 2\nn_layers = 2\nffn_dim = 32\ndropout = 0.0\nattention_dropout = 0.0\n\
         [positional]\nkind = \"learned\"\n\
         [train]\nbudget = { steps = 60 }\nbatch_size = 16\nlr = 3e-3\neval_every = 30\n\
         [task]\nkind = \"word_order\"\nlengths = [5, 10]\ntrain_examples = 400\neval_examples = 40\n",
    )
    .unwrap();
    let options = poslab::experiment::single::TrainOptions {
        dir: run.clone(),
        device: Device::Cpu,
        progress: false,
        stop_after: None,
        hub: poslab::text::HubSource::from_vars(None, None, Some("1")),
    };
    poslab::experiment::single::start(&config, &options).unwrap();
    let out = root.path().join("analysis");
    let (ok, stdout, stderr) = poslab(&[
        "analyze",
        "--run",
        run.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--texts",
        "16",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("learned table of") && stdout.contains("24 positions from 0, 16 wide"),
        "{stdout}"
    );
    assert!(
        stdout.contains("attention logits") && stdout.contains("layer 1:"),
        "{stdout}"
    );
    // The table written is the model's pos_emb.weight.
    let loaded = poslab::saved::load(&run, DType::F32, &Device::Cpu).unwrap();
    let weight = loaded.params.get("pos_emb.weight").unwrap();
    let first: Vec<f64> = std::fs::read_to_string(out.join("table.csv"))
        .unwrap()
        .lines()
        .nth(1)
        .unwrap()
        .split(',')
        .skip(1)
        .map(|v| v.parse().unwrap())
        .collect();
    let expected: Vec<f64> = weight
        .get(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(first, expected);
    for f in [
        "attention_terms.csv",
        "attention_terms.png",
        "distance_dot.png",
        "summary.txt",
    ] {
        assert!(out.join(f).is_file(), "{f}");
    }
    // The four shares per head sum to 1 and the terms rebuild the logits.
    let csv = std::fs::read_to_string(out.join("attention_terms.csv")).unwrap();
    let rows: Vec<Vec<&str>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    assert_eq!(rows.len(), 2 * 2 * 4, "layers x heads x terms");
    for head in rows.chunks(4) {
        let share: f64 = head.iter().map(|r| r[4].parse::<f64>().unwrap()).sum();
        assert!((share - 1.0).abs() < 1e-9);
        assert!(
            head[0][5].parse::<f64>().unwrap() < 1e-4,
            "reconstruction error {}",
            head[0][5]
        );
    }
    let _ = Tensor::zeros(1, DType::F32, &Device::Cpu);
}
