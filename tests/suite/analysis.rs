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
        let a = analyze(&t, &Options::default()).unwrap();
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
    let c = analyze(&random, &Options::default())
        .unwrap()
        .consecutive_l2;
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
        let a = analyze(t, &Options::default()).unwrap();
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
            .unwrap()
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

/// A local layer's terms are averaged over the pairs it reads (keys within its window), and the
/// layer after it reads what the window made: window 2 and window 1000 give other terms there.
#[test]
fn attention_terms_apply_each_layers_window() {
    let config = |window: usize| {
        let mut c = tiny_config(
            PositionalConfig::SinusoidalAdd(Default::default()),
            NormPlacement::Pre,
        );
        c.layers = Some(poslab::LayerPlan {
            local_window: Some(window),
            ..poslab::LayerPlan::new(vec![poslab::LayerKind::Local, poslab::LayerKind::Global])
        });
        c
    };
    let (ids, mask) = padded_batch(3, 9, 40);
    let terms_of = |window: usize| {
        let store = ParamStore::new(3);
        let encoder =
            Encoder::new(&config(window), store.var_builder(DType::F64, &Device::Cpu)).unwrap();
        let split = encoder.score_terms(&ids, &mask).unwrap();
        let terms = poslab::analysis::terms::attention_terms(&encoder, &ids, &mask).unwrap();
        (split, terms)
    };
    let (split, narrow) = terms_of(2);
    let (_, wide) = terms_of(1000);
    assert_eq!(split[0].window, poslab::nn::Window::new(Some(1), false));
    assert_eq!(split[1].window, poslab::nn::Window::ALL);
    // Layer 0, head 0, content·content by hand: the mean |term| over real pairs with |i-j| <= 1.
    let cc: Vec<Vec<Vec<Vec<f64>>>> = (0..3)
        .map(|b| split[0].terms[0].get(b).unwrap().to_vec3::<f64>().unwrap())
        .collect();
    let real: Vec<Vec<f64>> = mask.to_dtype(DType::F64).unwrap().to_vec2().unwrap();
    let (mut sum, mut count) = (0.0, 0.0);
    for (b, rows) in real.iter().enumerate() {
        for i in 0..9 {
            for j in 0..9 {
                if rows[i] > 0.0 && rows[j] > 0.0 && i.abs_diff(j) <= 1 {
                    sum += cc[b][0][i][j].abs();
                    count += 1.0;
                }
            }
        }
    }
    let head0 = narrow.iter().find(|h| h.layer == 0 && h.head == 0).unwrap();
    assert!(
        (head0.mean_abs[0] - sum / count).abs() < 1e-12,
        "{} vs {}",
        head0.mean_abs[0],
        sum / count
    );
    // The global layer after it: other inputs, other terms.
    let layer1 = |terms: &[poslab::analysis::terms::HeadTerms]| -> Vec<f64> {
        terms
            .iter()
            .filter(|h| h.layer == 1)
            .flat_map(|h| h.mean_abs)
            .collect()
    };
    let (a, b) = (layer1(&narrow), layer1(&wide));
    let gap = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    assert!(
        gap > 1e-3,
        "layer 1's terms do not depend on layer 0's window: {a:?}"
    );
}

#[test]
fn attention_terms_rebuild_the_scores_exactly() {
    // BERT's embedding extras (a token-type row, an embedding LayerNorm, RoBERTa's offset) are
    // split too: the LayerNorm's parts share the sum's standard deviation.
    let bert_like = poslab::config::EmbeddingExtras {
        token_types: 2,
        norm: true,
        first_position: 2,
    };
    for (positional, extras) in [
        (
            PositionalConfig::SinusoidalAdd(Default::default()),
            Default::default(),
        ),
        (
            PositionalConfig::Learned(Default::default()),
            Default::default(),
        ),
        (
            PositionalConfig::Learned(Default::default()),
            bert_like.clone(),
        ),
        (
            PositionalConfig::SinusoidalAdd(Default::default()),
            bert_like,
        ),
        // Concatenation: [x ; PE] = [x ; 0] + [0 ; PE], q = W_qx x + W_qp PE (issue 48), and
        // through its projection.
        (
            PositionalConfig::SinusoidalConcat(poslab::positional::ConcatOptions {
                pos_dim: 4,
                ..Default::default()
            }),
            Default::default(),
        ),
        (
            PositionalConfig::SinusoidalConcat(poslab::positional::ConcatOptions {
                pos_dim: 4,
                project: true,
                ..Default::default()
            }),
            Default::default(),
        ),
    ] {
        // Plain layers, and a local layer (keys within 1) before a global one: each layer runs
        // as the model runs it, so the second layer's scores are the model's too.
        let windowed = poslab::LayerPlan {
            local_window: Some(2),
            ..poslab::LayerPlan::new(vec![poslab::LayerKind::Local, poslab::LayerKind::Global])
        };
        for (norm, layers) in [
            (NormPlacement::Pre, None),
            (NormPlacement::Post, None),
            (NormPlacement::Pre, Some(windowed)),
        ] {
            let store = ParamStore::new(3);
            let mut config = tiny_config(positional.clone(), norm);
            config.embeddings = extras.clone();
            config.layers = layers;
            let encoder =
                Encoder::new(&config, store.var_builder(DType::F64, &Device::Cpu)).unwrap();
            let (ids, mask) = padded_batch(3, 9, 40);
            let layers = encoder.score_terms(&ids, &mask).unwrap();
            assert_eq!(
                layers.len(),
                if norm == NormPlacement::Pre { 2 } else { 1 },
                "{norm:?}"
            );
            // The scores the terms rebuild are the model's own: q·k / sqrt(d_head) of the
            // queries and keys its forward pass computes.
            let qk = encoder.queries_keys(&ids, &mask).unwrap();
            let scale = 1.0 / (config.head_dim() as f64).sqrt();
            for poslab::encoder::ScoreTerms {
                layer: i,
                scores,
                terms,
                ..
            } in layers
            {
                let sum = terms
                    .iter()
                    .skip(1)
                    .fold(terms[0].clone(), |a, t| (a + t).unwrap());
                let err = max_abs_diff(&sum, &scores);
                assert!(err < 1e-10, "layer {i}: {err:e}");
                let (q, k) = &qk[i];
                let forward = (q.matmul(&k.t().unwrap()).unwrap() * scale).unwrap();
                let err = max_abs_diff(&forward, &scores);
                assert!(
                    err < 1e-10,
                    "layer {i} {extras:?}: {err:e} from the forward pass"
                );
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
        e.contains("sinusoidal_add, sinusoidal_concat or learned") && e.contains("`rope`"),
        "{e}"
    );
    assert!(!rope.has_position_terms());
}

/// Asserts that a PNG has dark (text) pixels in a horizontal band: its title or axis labels.
fn has_text(path: &Path, band: std::ops::Range<u32>) -> bool {
    let mut reader = png::Decoder::new(std::fs::File::open(path).unwrap())
        .read_info()
        .unwrap();
    let mut rgb = vec![0; reader.output_buffer_size()];
    let frame = reader.next_frame(&mut rgb).unwrap();
    assert_eq!(
        (frame.color_type, frame.bit_depth),
        (png::ColorType::Rgb, png::BitDepth::Eight)
    );
    let w = frame.width;
    // Rec. 709 luma of pixel (x, y).
    let luma = |x: u32, y: u32| {
        let i = 3 * (y * w + x) as usize;
        0.2126 * f64::from(rgb[i]) + 0.7152 * f64::from(rgb[i + 1]) + 0.0722 * f64::from(rgb[i + 2])
    };
    band.flat_map(|y| (w / 5..4 * w / 5).map(move |x| (x, y)))
        .filter(|&(x, y)| luma(x, y) < 90.0)
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
fn long_tables_are_pictured_at_every_kth_position() {
    // 2000 positions: the distance matrices hold every 2nd (at most 1024 positions each way),
    // labelled with the positions they hold; table.csv and the measures keep every row.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("long");
    let (ok, stdout, stderr) = poslab(&[
        "analyze",
        "sinusoidal",
        "--dim",
        "8",
        "--positions",
        "2000",
        "--start",
        "5",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("2000 positions from 5"), "{stdout}");
    let csv = std::fs::read_to_string(out.join("distance_l2.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    assert_eq!(header.len(), 1 + 1000);
    assert_eq!(&header[..4], ["position", "p5", "p7", "p9"]);
    assert_eq!(header[1000], "p2003");
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 1000);
    assert!(rows[1].starts_with("7,"));
    // Row "7" against column "p9": the L2 distance of positions 7 and 9 of the table.
    let table = Table::sinusoidal(8, 1e4, TableLayout::Interleaved, 2000, 5);
    let expected: f64 = table
        .row(2)
        .iter()
        .zip(table.row(4))
        .map(|(a, b)| (a - b).powi(2))
        .sum::<f64>()
        .sqrt();
    let got: f64 = rows[1].split(',').nth(3).unwrap().parse().unwrap();
    assert!((got - expected).abs() < 1e-12, "{got} vs {expected}");
    let table_csv = std::fs::read_to_string(out.join("table.csv")).unwrap();
    assert_eq!(table_csv.lines().count(), 1 + 2000);
    assert!(has_text(&out.join("distance_l2.png"), 0..40));
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
        "rows.csv",
        "norms.png",
        "pca.png",
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
        !ok && stderr.contains("invalid value 'spiral'")
            && stderr.contains("possible values: interleaved, half"),
        "{stderr}"
    );
}

#[test]
fn a_learned_table_from_a_trained_run_loads_and_analyses() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("run");
    let config = poslab::runs::train_run::TrainRunConfig::from_toml_str(
        "name = \"t\"\ncheckpoint_every = 0\nmax_len = 24\n\
         [model]\nd_model = 16\nn_heads = 2\nn_layers = 2\nffn_dim = 32\ndropout = 0.0\nattention_dropout = 0.0\n\
         [positional]\nkind = \"learned\"\n\
         [train]\nbudget = { steps = 60 }\nbatch_size = 16\nlr = 3e-3\neval_every = 30\n\
         [task]\nkind = \"word_order\"\nlengths = [5, 10]\ntrain_examples = 400\neval_examples = 40\n",
    )
    .unwrap();
    let options = poslab::runs::train_run::TrainOptions {
        dir: run.clone(),
        device: Device::Cpu,
        progress: poslab::progress::Progress::Quiet,
        stop_after: None,
        hub: poslab::text::HubSource::from_vars(None, None, Some("1")),
        threads: None,
        backend: Default::default(),
        limits: Default::default(),
    };
    poslab::runs::train_run::start(&config, &options).unwrap();
    // `analyze --run` into `out`, with `threads` if given.
    let analyze = |out: &Path, threads: Option<&str>| {
        let mut args = vec!["analyze", "--run", run.to_str().unwrap()];
        args.extend(["--out", out.to_str().unwrap(), "--texts", "16"]);
        args.extend(threads.map(|n| ["--threads", n]).into_iter().flatten());
        poslab(&args)
    };
    let out = root.path().join("analysis");
    let (ok, stdout, stderr) = analyze(&out, None);
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
    // The same files on one thread and on three: the logits' terms do not depend on the pool.
    for threads in ["1", "3"] {
        let again = root.path().join(format!("analysis-{threads}"));
        let (ok, _, stderr) = analyze(&again, Some(threads));
        assert!(ok, "{stderr}");
        for f in ["attention_terms.csv", "table.csv", "distance_l2.csv"] {
            assert_eq!(
                std::fs::read(again.join(f)).unwrap(),
                std::fs::read(out.join(f)).unwrap(),
                "{f} on {threads} threads"
            );
        }
    }
    let _ = Tensor::zeros(1, DType::F32, &Device::Cpu);
}

/// Trains a tiny model of `positional` (TOML inline table) into `dir` and returns it.
fn train_tiny(dir: &Path, positional: &str, max_len: Option<usize>) -> std::path::PathBuf {
    let run = dir.join("run");
    let config = poslab::runs::train_run::TrainRunConfig::from_toml_str(&format!(
        "name = \"t\"\ncheckpoint_every = 0\n{}\
         [model]\nd_model = 16\nn_heads = 2\nn_layers = 2\nffn_dim = 32\ndropout = 0.0\nattention_dropout = 0.0\n\
         [positional]\n{positional}\n\
         [train]\nbudget = {{ steps = 40 }}\nbatch_size = 16\nlr = 3e-3\neval_every = 40\n\
         [task]\nkind = \"prev_token\"\nk = 1\nlengths = [4, 10]\ntrain_examples = 300\neval_examples = 40\n",
        max_len.map_or(String::new(), |m| format!("max_len = {m}\n"))
    ))
    .unwrap();
    let options = poslab::runs::train_run::TrainOptions {
        dir: run.clone(),
        device: Device::Cpu,
        progress: poslab::progress::Progress::Quiet,
        stop_after: None,
        hub: poslab::text::HubSource::from_vars(None, None, Some("1")),
        threads: None,
        backend: Default::default(),
        limits: Default::default(),
    };
    poslab::runs::train_run::start(&config, &options).unwrap();
    run
}

/// `bias_by_offset.csv` as (offset, one value per head or layer-head).
fn offset_csv(path: &Path) -> Vec<(i64, Vec<f64>)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| {
            let mut cells = l.split(',');
            let offset = cells.next().unwrap().parse().unwrap();
            (offset, cells.map(|v| v.parse().unwrap()).collect())
        })
        .collect()
}

#[test]
fn attention_biases_by_name_are_their_formulas() {
    let dir = tempfile::tempdir().unwrap();
    // ALiBi: -slope_h |offset|, Press et al.'s slopes, for 6 heads.
    let out = dir.path().join("alibi");
    let (ok, stdout, stderr) = poslab(&[
        "analyze",
        "alibi",
        "--heads",
        "6",
        "--positions",
        "20",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("100.0%") && stdout.contains("slopes per head"),
        "{stdout}"
    );
    let slopes = poslab::positional::alibi_slopes(6);
    for (offset, values) in offset_csv(&out.join("bias_by_offset.csv")) {
        for (h, v) in values.iter().enumerate() {
            assert!((v + slopes[h] * offset.abs() as f64).abs() < 1e-12);
        }
    }
    assert!(has_text(&out.join("bias_by_offset.png"), 5..30), "title");
    // T5: the bucket of each offset.
    let out = dir.path().join("t5");
    let (ok, _, stderr) = poslab(&[
        "analyze",
        "t5",
        "--buckets",
        "16",
        "--max-distance",
        "30",
        "--positions",
        "40",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    for (offset, values) in offset_csv(&out.join("bias_by_offset.csv")) {
        assert_eq!(
            values[0],
            poslab::positional::t5_bucket(offset, 16, 30) as f64
        );
    }
    // Bad options name the fix.
    let (ok, _, stderr) = poslab(&["analyze", "t5", "--buckets", "2"]);
    assert!(
        !ok && stderr.contains("buckets = 2 must be at least 4"),
        "{stderr}"
    );
    let (ok, _, stderr) = poslab(&["analyze", "alibi", "--positions", "100000"]);
    assert!(!ok && stderr.contains("between 2 and 8192"), "{stderr}");
}

#[test]
fn trained_biases_are_read_from_the_model() {
    // KERPLE: one curve per layer and head, -r1 ln(1 + r2 |offset|) with the trained values.
    let dir = tempfile::tempdir().unwrap();
    let run = train_tiny(dir.path(), "kind = \"kerple\"", None);
    let out = dir.path().join("kerple");
    let (ok, stdout, stderr) = poslab(&[
        "analyze",
        "--run",
        run.to_str().unwrap(),
        "--positions",
        "16",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("layer 1: r1 = ["), "{stdout}");
    let loaded = poslab::saved::load(&run, DType::F64, &Device::Cpu).unwrap();
    let r = |name: &str| values(loaded.params.get(name).unwrap().as_tensor());
    let (r1, r2) = (r("layers.1.attn.kerple.r1"), r("layers.1.attn.kerple.r2"));
    let rows = offset_csv(&out.join("bias_by_offset.csv"));
    assert_eq!(rows[0].1.len(), 4, "2 layers x 2 heads");
    for (offset, values) in rows {
        for h in 0..2 {
            let expected = -r1[h] * (1.0 + r2[h] * offset.abs() as f64).ln();
            assert!(
                (values[2 + h] - expected).abs() < 1e-5,
                "{offset}: {} vs {expected}",
                values[2 + h]
            );
        }
    }
    // TUPE's learned untied term: a table analysis of pos_emb.weight, heatmaps of the term, and
    // its offset share below 100% (it is absolute).
    let dir = tempfile::tempdir().unwrap();
    let run = train_tiny(dir.path(), "kind = \"untied\"", Some(12));
    let out = dir.path().join("untied");
    let (ok, stdout, stderr) = poslab(&[
        "analyze",
        "--run",
        run.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("learned table of") && stdout.contains("untied"),
        "{stdout}"
    );
    for f in [
        "table.csv",
        "bias_by_offset.png",
        "bias_H0.png",
        "bias_H1.csv",
    ] {
        assert!(out.join(f).is_file(), "{f}");
    }
    let share: f64 = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("H0 "))
        .and_then(|l| l.split_whitespace().last())
        .map(|s| s.trim_end_matches('%').parse().unwrap())
        .unwrap();
    assert!(share < 100.0, "an absolute term is not all offset: {share}");
}

#[test]
fn rope_analysis_shows_scaled_wavelengths_and_pair_energy() {
    let dir = tempfile::tempdir().unwrap();
    let run = train_tiny(dir.path(), "kind = \"rope\"\nfraction = 0.5", None);
    let out = dir.path().join("rope");
    let (ok, stdout, stderr) = poslab(&[
        "analyze",
        "--run",
        run.to_str().unwrap(),
        "--rope-scaling",
        "yarn:4",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("slowest quarter") && stdout.contains("yarn x4"),
        "{stdout}"
    );
    for f in [
        "rope_scaling_wavelengths.png",
        "rope_energy_layer0.png",
        "rope_energy_layer1.png",
    ] {
        assert!(out.join(f).is_file(), "{f}");
    }
    // Shares per (layer, head, side) sum to 1 over the rotated width's 2 pairs (heads of 8,
    // half rotated).
    let csv = std::fs::read_to_string(out.join("rope_energy.csv")).unwrap();
    let rows: Vec<Vec<String>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').map(String::from).collect())
        .collect();
    assert_eq!(rows.len(), 2 * 2 * 2 * 2, "layers x heads x sides x pairs");
    for group in rows.chunks(2) {
        let sum: f64 = group.iter().map(|r| r[4].parse::<f64>().unwrap()).sum();
        assert!((sum - 1.0).abs() < 1e-9);
    }
    // Wavelengths: linear x4 is four times the unscaled at every pair.
    let w = std::fs::read_to_string(out.join("rope_scaling_wavelengths.csv")).unwrap();
    let header: Vec<&str> = w.lines().next().unwrap().split(',').collect();
    assert_eq!(
        header,
        [
            "pair",
            "none",
            "linear_x4",
            "ntk_x4",
            "dynamic_ntk_x4",
            "yarn_x4"
        ]
    );
    for line in w.lines().skip(1) {
        let v: Vec<f64> = line.split(',').map(|x| x.parse().unwrap()).collect();
        assert!((v[2] / v[1] - 4.0).abs() < 1e-9);
    }
    // --rope-scaling on a model that is not rope is refused.
    let (ok, _, stderr) = poslab(&[
        "predict",
        "--run",
        run.to_str().unwrap(),
        "--rope-scaling",
        "spin:2",
        "a",
    ]);
    assert!(!ok && stderr.contains("unknown scaling `spin`"), "{stderr}");
}

#[test]
fn the_recent_schemes_are_analysed_by_name_and_in_trained_models() {
    let dir = tempfile::tempdir().unwrap();
    // FIRE by name: with the threshold at the short sequence's span (15), the long curve is the
    // short one stretched over its span: the ends (offsets ±span) agree.
    let out = dir.path().join("fire");
    let (ok, stdout, stderr) = poslab(&[
        "analyze",
        "fire",
        "--heads",
        "3",
        "--positions",
        "16",
        "--threshold",
        "15",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("length 64"), "{stdout}");
    let csv = std::fs::read_to_string(out.join("fire_by_offset.csv")).unwrap();
    let rows: Vec<Vec<f64>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').map(|v| v.parse().unwrap()).collect())
        .collect();
    let at = |n: f64, offset: f64| rows.iter().find(|r| r[0] == n && r[1] == offset).unwrap();
    for h in 0..3 {
        // Both inputs are 1 but for the 1e-6 in the normaliser.
        assert!((at(16.0, 15.0)[3 + h] - at(64.0, 63.0)[3 + h]).abs() < 1e-5);
        assert!((at(16.0, -15.0)[3 + h] - at(64.0, -63.0)[3 + h]).abs() < 1e-5);
    }
    assert!(out.join("fire_by_relative_offset.png").is_file());
    // p-RoPE by name: its spectrum beside RoPE's and fraction's, the differences in the CSV.
    let out = dir.path().join("prope");
    let (ok, stdout, stderr) = poslab(&[
        "analyze",
        "prope",
        "--dim",
        "16",
        "--keep",
        "0.5",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("4 pairs rotated"), "{stdout}");
    let csv = std::fs::read_to_string(out.join("spectrum.csv")).unwrap();
    let pair3: Vec<f64> = csv
        .lines()
        .nth(4)
        .unwrap()
        .split(',')
        .map(|v| v.parse().unwrap())
        .collect();
    // Pair 3: RoPE's base^(-6/16), the same in p-RoPE, and base^(-6/8) under fraction 0.5.
    assert!((pair3[1] - 10_000f64.powf(-6.0 / 16.0)).abs() < 1e-12);
    assert_eq!(pair3[1], pair3[2]);
    assert!((pair3[3] - 10_000f64.powf(-6.0 / 8.0)).abs() < 1e-12);
    let (ok, _, stderr) = poslab(&["analyze", "prope", "--dim", "16", "--keep", "0.1"]);
    assert!(!ok && stderr.contains("keeps none"), "{stderr}");
    let (ok, _, stderr) = poslab(&["analyze", "fox"]);
    assert!(!ok && stderr.contains("--run"), "{stderr}");

    // A trained FIRE model: the learned curve at the training length and 4x.
    let run = train_tiny(dir.path(), "kind = \"fire\"\nthreshold = 10", Some(10));
    let out = dir.path().join("fire_run");
    let (ok, stdout, stderr) = poslab(&[
        "analyze",
        "--run",
        run.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("length 10") && stdout.contains("length 40"),
        "{stdout}"
    );
    assert!(out.join("fire_by_offset.png").is_file());

    // A trained FoX model: gates per token, and the decay from one query.
    let dir = tempfile::tempdir().unwrap();
    let run = train_tiny(dir.path(), "kind = \"fox\"", None);
    let out = dir.path().join("fox_run");
    let (ok, stdout, stderr) = poslab(&[
        "analyze",
        "--run",
        run.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("most forgetting"), "{stdout}");
    let decay = std::fs::read_to_string(out.join("fox_decay.csv")).unwrap();
    let values: Vec<f64> = decay
        .lines()
        .skip(1)
        .map(|l| l.rsplit(',').next().unwrap().parse().unwrap())
        .collect();
    assert!(
        !values.is_empty() && values.iter().all(|&v| v <= 0.0),
        "{decay}"
    );
    assert!(values.contains(&0.0), "the query itself is not decayed");
    let gates = std::fs::read_to_string(out.join("fox_gates.csv")).unwrap();
    assert!(gates.lines().count() > 3, "{gates}");
    // Tokens are quoted where they hold a comma or a quote: read the file as CSV.
    for record in csv::Reader::from_reader(gates.as_bytes()).records() {
        let record = record.unwrap();
        let g: f64 = record[3].parse().unwrap();
        assert!((0.0..=1.0).contains(&g), "{record:?}");
    }
}

#[test]
fn every_scheme_of_the_catalog_is_drawn_by_name_or_refused_naming_the_fix() {
    use poslab::analysis::command::{scheme_names, Request};
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str| {
        Request {
            scheme: Some(name.into()),
            positions: 16,
            dim: 16,
            heads: 2,
            out: Some(dir.path().join(name)),
            ..Request::default()
        }
        .run()
    };
    // The names come from the catalog, with `sinusoidal` for the sinusoidal table first.
    let names = scheme_names();
    assert_eq!(names[0], "sinusoidal");
    assert_eq!(&names[1..], PositionalConfig::names().as_slice());
    let drawn = [
        ("sinusoidal", "table.csv"),
        ("sinusoidal_add", "table.csv"),
        ("sinusoidal_concat", "table.csv"),
        ("rope", "rope_scaling_wavelengths.csv"),
        ("prope", "spectrum.csv"),
        ("alibi", "bias_by_offset.csv"),
        ("t5", "bias_by_offset.csv"),
        ("kerple", "bias_by_offset.csv"),
        ("fire", "fire_by_offset.csv"),
    ];
    for name in names {
        match drawn.iter().find(|(n, _)| *n == name) {
            Some((_, file)) => {
                let report = run(name).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(
                    report.files.iter().any(|f| f == file),
                    "{name}: {:?}",
                    report.files
                );
            }
            None => {
                let e = run(name).expect_err(name).to_string();
                assert!(
                    e.starts_with(&format!("invalid input: {name}:"))
                        && (e.contains("give --run DIR") || e.contains("no positions")),
                    "{e}"
                );
            }
        }
    }
    // `sinusoidal` is `sinusoidal_add`'s table, value for value.
    let table = |name: &str| std::fs::read(dir.path().join(name).join("table.csv")).unwrap();
    assert_eq!(table("sinusoidal"), table("sinusoidal_add"));
    // T5 by name is its bucket index, by offset (32 buckets, max_distance 128 by default).
    let csv = std::fs::read_to_string(dir.path().join("t5").join("bias_by_offset.csv")).unwrap();
    let row = |offset: &str| {
        csv.lines()
            .find(|l| l.split(',').next() == Some(offset))
            .unwrap_or_else(|| panic!("offset {offset}: {csv}"))
            .split(',')
            .nth(1)
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    assert_eq!(row("0"), 0.0);
    for offset in -15i64..=15 {
        let bucket = poslab::positional::t5_bucket(offset, 32, 128) as f64;
        assert_eq!(row(&offset.to_string()), bucket, "offset {offset}");
    }
    let e = run("xpos").unwrap_err().to_string();
    assert!(
        e.contains("not a scheme") && e.contains("sinusoidal_concat"),
        "{e}"
    );
}

#[test]
fn analyze_report_html_draws_its_pictures_in_a_real_browser() {
    let Some(browser) = crate::common::headless_browser() else {
        return;
    };
    let root = tempfile::tempdir().unwrap();
    let profile = root.path().join("profile");

    // By name: the sinusoid at its base and at the two other bases of --bases.
    let out = root.path().join("sinusoidal");
    let (ok, _, stderr) = poslab(&["analyze", "sinusoidal", "--out", out.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    let page = out.join("report.html");
    let dom = crate::common::drawn_page(&browser, &profile, &page);
    assert_eq!(
        dom.matches("<option value=").count(),
        3 + 3,
        "three tables (bases 10000, 100, 1e8) and three metrics to choose from"
    );
    for id in ["heatmap", "clock", "offset-metric", "clock-pair"] {
        assert!(dom.contains(&format!("id=\"{id}\"")), "no #{id}");
    }
    // The clock: a point per position; the offsets (two lines) and wavelengths (three bases).
    assert_eq!(dom.matches("<circle").count(), 128);
    assert_eq!(dom.matches("<polyline").count(), 1 + 2 + 3);
    let pixels = crate::common::screenshot(&browser, &profile, &page, root.path());
    // The heatmap's reds and blues.
    for rgb in [(178, 24, 43), (33, 102, 172)] {
        let n = pixels
            .iter()
            .filter(|p| crate::common::near(p, rgb))
            .count();
        assert!(n > 2000, "the heatmap's {rgb:?} covers only {n} pixels");
    }

    // A trained model: its learned table, and the four terms of each head's logits.
    let run = train_tiny(root.path(), "kind = \"sinusoidal_add\"", None);
    let out = root.path().join("trained");
    let (ok, _, stderr) = poslab(&[
        "analyze",
        "--run",
        run.to_str().unwrap(),
        "--texts",
        "8",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let dom = crate::common::drawn_page(&browser, &profile, &out.join("report.html"));
    assert!(dom.contains("id=\"terms\""), "no terms chart");
    // 2 layers x 2 heads, four terms each, each bar titled with its share.
    assert_eq!(dom.matches("<title>layer ").count(), 4 * 4);
    assert!(dom.contains("layer 0, head 1: content·content"), "{dom}");
}
