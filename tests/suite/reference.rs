//! Every fixture of the float64 NumPy reference (`shared/reference/reference_encoder.py` and
//! `reference_schemes.py`), reproduced: positional tables and RoPE to 1e-5 absolute, ALiBi
//! slopes and the ALiBi / KERPLE biases to 1e-6, T5 buckets exactly, whole encoders (at their
//! `position_ids`) to 1e-4 at real positions. `POSLAB_FIXTURES=DIR` holds poslab to every
//! `encoder_*.safetensors` in `DIR` as well.

use candle::{DType, Device, Tensor};
use poslab::positional::{sinusoidal_table, PositionTable, Rope, RopeOptions};
use poslab::{RopePairing, TableLayout};

use crate::common::*;

const TABLE_TOL: f64 = 1e-5;
const ENCODER_TOL: f64 = 1e-4;

fn parse_layout(s: &str) -> TableLayout {
    serde_json::from_value(serde_json::Value::String(s.into())).unwrap()
}

/// `sinusoidal.{layout}.d{dim}.base{base}[.start{start}]`
fn parse_sinusoidal_key(key: &str) -> (TableLayout, usize, f64, usize) {
    let parts: Vec<&str> = key.split('.').collect();
    let layout = parse_layout(parts[1]);
    let dim = parts[2].strip_prefix('d').unwrap().parse().unwrap();
    let base = parts[3].strip_prefix("base").unwrap().parse().unwrap();
    let start = parts
        .get(4)
        .map(|s| s.strip_prefix("start").unwrap().parse().unwrap())
        .unwrap_or(0);
    (layout, dim, base, start)
}

#[test]
fn sinusoidal_tables_match_reference() {
    let fixture = load_fixture("positional.safetensors");
    let mut checked = 0;
    for (key, expected) in fixture.iter().filter(|(k, _)| k.starts_with("sinusoidal.")) {
        let (layout, dim, base, start) = parse_sinusoidal_key(key);
        let rows = expected.dim(0).unwrap();
        let ours = Tensor::from_vec(
            sinusoidal_table(start, rows, dim, base, layout),
            (rows, dim),
            &Device::Cpu,
        )
        .unwrap();
        let err = max_abs_diff(&ours, expected);
        assert!(
            err <= TABLE_TOL,
            "{key}: max abs error {err:e} > {TABLE_TOL:e}"
        );

        // The cached model-side table, built small so that this request makes it grow, gives
        // the same rows in the model's dtype.
        let table = PositionTable::new(dim, 4, DType::F32, &Device::Cpu, move |n| {
            sinusoidal_table(0, n, dim, base, layout)
        })
        .unwrap();
        let cached = table.rows(start, rows).unwrap();
        let err = max_abs_diff(&cached, expected);
        assert!(
            err <= TABLE_TOL,
            "{key} (cached f32): max abs error {err:e}"
        );
        checked += 1;
    }
    // Layouts x widths at base 1e4, two other bases, one start offset.
    assert_eq!(checked, 6 + 2 + 1, "sinusoidal fixtures checked");
}

#[test]
fn rope_matches_reference_for_both_pairings_and_bases() {
    let fixture = load_fixture("positional.safetensors");
    let input = &fixture["rope.input"]; // (2, 3, 40, 16)
    let mut checked = 0;
    for (key, expected) in fixture
        .iter()
        .filter(|(k, _)| k.starts_with("rope.") && *k != "rope.input")
    {
        let parts: Vec<&str> = key.split('.').collect();
        let pairing: RopePairing =
            serde_json::from_value(serde_json::Value::String(parts[1].into())).unwrap();
        let base: f64 = parts[2].strip_prefix("base").unwrap().parse().unwrap();
        for dtype in [DType::F32, DType::F64] {
            // Initial length 8 < 40 positions: the tables grow on the first call.
            let rope = Rope::new(
                &RopeOptions {
                    base,
                    pairing,
                    ..Default::default()
                },
                16,
                8,
                dtype,
                &Device::Cpu,
            )
            .unwrap();
            let input = input.to_dtype(dtype).unwrap();
            let out = rope
                .apply(&input, 0, poslab::nn::Backend::default())
                .unwrap();
            let err = max_abs_diff(&out, expected);
            assert!(
                err <= TABLE_TOL,
                "{key} {dtype:?}: max abs error {err:e} > {TABLE_TOL:e}"
            );
        }
        checked += 1;
    }
    assert_eq!(checked, 4, "rope fixtures checked (2 pairings x 2 bases)");
}

/// Checks one whole-encoder fixture in f32 and f64; returns the worst error at real positions,
/// or why it failed.
fn check_encoder_fixture(path: &std::path::Path) -> Result<f64, String> {
    let fx = load_encoder_fixture_from(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut worst = 0.0f64;
    for dtype in [DType::F32, DType::F64] {
        let (encoder, _) = fx.encoder(dtype);
        let hidden = fx.hidden(&encoder);
        if hidden.dims() != fx.expected.dims() {
            return Err(format!(
                "{}: hidden states {:?}, expected {:?}",
                fx.name,
                hidden.dims(),
                fx.expected.dims()
            ));
        }
        let err = max_abs_diff_real(&hidden, &fx.expected, &fx.attention_mask);
        eprintln!(
            "{} {dtype:?}: max abs error at real positions {err:.2e}",
            fx.name
        );
        if err.is_nan() || err > ENCODER_TOL {
            return Err(format!(
                "{} {dtype:?}: max abs error {err:e} > {ENCODER_TOL:e}",
                fx.name
            ));
        }
        worst = worst.max(err);
    }
    Ok(worst)
}

/// Checks every `encoder_*.safetensors` in `dir`; the failures, one line each.
fn check_fixture_folder(dir: &std::path::Path) -> Result<usize, String> {
    let paths = encoder_fixtures_in(dir);
    if paths.is_empty() {
        return Err(format!("no encoder_*.safetensors in {}", dir.display()));
    }
    let failures: Vec<String> = paths
        .iter()
        .filter_map(|p| check_encoder_fixture(p).err())
        .collect();
    if failures.is_empty() {
        Ok(paths.len())
    } else {
        Err(failures.join("\n"))
    }
}

#[test]
fn every_encoder_fixture_reproduces_expected_hidden_states() {
    let names = encoder_fixture_names();
    // 10 of the first five schemes; 7 of the attention biases and untied positions; 4 with
    // randomized positions; 3 of partial and scaled RoPE; 8 of p-RoPE, FIRE and FoX (2 of them
    // with randomized positions); 6 of PoPE, CoPE and PaTH; 10 causal forms of the earlier
    // schemes; 5 of stick-breaking (2 of them causal); 6 of GRAPE-M and GRAPE-AP (2 causal, 2
    // with randomized positions); 6 with DAPE's MLP on ALiBi, KERPLE, FIRE and T5 (2 causal).
    assert_eq!(names.len(), 65, "whole-encoder fixtures: {names:?}");
    let n = check_fixture_folder(&fixture_path("")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(n, names.len());
}

#[test]
fn reference_fixtures_in_the_poslab_fixtures_folder() {
    // POSLAB_FIXTURES=DIR: every encoder_*.safetensors there, however many, must match.
    match std::env::var_os("POSLAB_FIXTURES") {
        None => eprintln!("POSLAB_FIXTURES is not set: only tests/fixtures was checked"),
        Some(dir) => {
            let dir = std::path::PathBuf::from(dir);
            let n = check_fixture_folder(&dir).unwrap_or_else(|e| panic!("{e}"));
            eprintln!(
                "POSLAB_FIXTURES: {n} encoder fixtures in {} match",
                dir.display()
            );
        }
    }
}

#[test]
fn reference_check_fails_on_a_fixture_that_is_off() {
    // The folder check must catch a fixture whose expected_hidden is wrong at a real position.
    let dir = tempfile::tempdir().unwrap();
    let source = fixture_path("encoder_alibi_pre.safetensors");
    let meta = poslab::params::read_metadata(&source).unwrap();
    let mut tensors = load_fixture("encoder_alibi_pre.safetensors");
    std::fs::copy(&source, dir.path().join("encoder_good.safetensors")).unwrap();
    assert_eq!(check_fixture_folder(dir.path()), Ok(1));
    let expected = &tensors["expected_hidden"];
    let mut v = values(expected);
    v[5] += 1e-3; // sequence 0, token 0: a real position
    tensors.insert(
        "expected_hidden".into(),
        Tensor::from_vec(v, expected.dims(), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap(),
    );
    poslab::params::save_tensors(
        &dir.path().join("encoder_off.safetensors"),
        tensors.into_iter().collect(),
        meta,
    )
    .unwrap();
    let err = check_fixture_folder(dir.path()).unwrap_err();
    assert!(
        err.contains("encoder_off.safetensors") && !err.contains("encoder_good"),
        "{err}"
    );
    // A folder without fixtures is an error too, not a silent pass.
    let empty = tempfile::tempdir().unwrap();
    assert!(check_fixture_folder(empty.path())
        .unwrap_err()
        .contains("no encoder_"));
}

#[test]
fn alibi_slopes_and_bias_match_reference() {
    let fx = load_fixture("schemes.safetensors");
    for h in [1usize, 2, 3, 4, 6, 8, 12, 16] {
        let expected = values(&fx[&format!("alibi.slopes.h{h}")]);
        let ours = poslab::positional::alibi_slopes(h);
        assert_eq!(ours.len(), h);
        for (a, b) in ours.iter().zip(&expected) {
            assert!((a - b).abs() <= 1e-6, "h{h}: slope {a} vs {b}");
        }
    }
    let positions = poslab::Positions::from_tensor(&fx["alibi.pos"]).unwrap();
    let bias = poslab::positional::Alibi::new(4)
        .bias(&positions, DType::F64, &Device::Cpu)
        .unwrap();
    let err = max_abs_diff(&bias, &fx["alibi.bias.h4"]);
    assert!(err <= 1e-6, "alibi bias h4: {err:e}");
}

#[test]
fn t5_buckets_match_reference_exactly() {
    let fx = load_fixture("schemes.safetensors");
    let rel: Vec<i64> = fx["t5.rel"].to_vec1().unwrap();
    assert_eq!((rel[0], rel[rel.len() - 1]), (-300, 300));
    for (n, max) in [(32usize, 128usize), (16, 64), (8, 20)] {
        let expected: Vec<i64> = fx[&format!("t5.bucket.n{n}.max{max}")].to_vec1().unwrap();
        let ours: Vec<i64> = rel
            .iter()
            .map(|&r| poslab::positional::t5_bucket(r, n, max) as i64)
            .collect();
        assert_eq!(ours, expected, "buckets n{n} max{max}");
    }
}

#[test]
fn kerple_bias_matches_reference() {
    let fx = load_fixture("schemes.safetensors");
    let positions = poslab::Positions::from_tensor(&fx["kerple.pos"]).unwrap();
    let (r, t) = (positions.rows(), positions.len());
    let distances = Tensor::from_vec(positions.distances(), (r, 1, t, t), &Device::Cpu).unwrap();
    let kerple = poslab::positional::Kerple::from_tensors(
        fx["kerple.r1"].to_dtype(DType::F64).unwrap(),
        fx["kerple.r2"].to_dtype(DType::F64).unwrap(),
    );
    let bias = kerple.bias(&distances).unwrap();
    let err = max_abs_diff(&bias, &fx["kerple.bias"]);
    assert!(err <= 1e-6, "kerple bias: {err:e}");
}

#[test]
fn key_bias_is_inert_without_rope_and_kept_with_it() {
    // The reference computed every fixture with non-zero key biases. Outside rope poslab has
    // none, and `every_encoder_fixture_reproduces_expected_hidden_states` still matches: softmax
    // cancels a per-query constant. Under rope the bias is rotated by position and matters.
    for name in encoder_fixture_names() {
        let fx = load_encoder_fixture(&name);
        if fx.config.positional.reads_keys() {
            assert!(fx.dropped_key_biases.is_empty());
            let (encoder, store) = fx.encoder(DType::F64);
            let key_bias = store.get("layers.0.attn.k.bias").unwrap();
            let before = fx.hidden(&encoder);
            key_bias.set(&key_bias.zeros_like().unwrap()).unwrap();
            let after = fx.hidden(&encoder);
            let change = max_abs_diff_real(&before, &after, &fx.attention_mask);
            assert!(
                change > 1e-3,
                "{name}: rope key bias had no effect ({change:e})"
            );
        } else {
            assert_eq!(fx.dropped_key_biases.len(), fx.config.n_layers, "{name}");
            for b in &fx.dropped_key_biases {
                let norm = b
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(
                    norm > 1e-3,
                    "{name}: the reference key bias is zero, proving nothing"
                );
            }
        }
    }
}

#[test]
fn encoder_fixtures_cover_every_scheme_and_both_norms() {
    let mut seen = std::collections::BTreeSet::new();
    for name in encoder_fixture_names() {
        let fx = load_encoder_fixture(&name);
        seen.insert((fx.config.positional.name(), format!("{:?}", fx.config.norm)));
    }
    let schemes: std::collections::BTreeSet<_> = seen.iter().map(|(s, _)| *s).collect();
    let mut all = poslab::PositionalConfig::names();
    all.sort();
    assert_eq!(schemes.into_iter().collect::<Vec<_>>(), all);
    assert!(seen.iter().any(|(_, n)| n == "Post"));
}

#[test]
fn table_layouts_are_permutations_of_each_other() {
    // Same values, different column order: half[:, i] = interleaved[:, 2i] and
    // half[:, d/2 + i] = interleaved[:, 2i + 1].
    let (n, d) = (50, 12);
    let il = sinusoidal_table(0, n, d, 10_000.0, TableLayout::Interleaved);
    let hf = sinusoidal_table(0, n, d, 10_000.0, TableLayout::Half);
    for p in 0..n {
        for i in 0..d / 2 {
            assert_eq!(hf[p * d + i], il[p * d + 2 * i]);
            assert_eq!(hf[p * d + d / 2 + i], il[p * d + 2 * i + 1]);
        }
    }
}

#[test]
fn fixtures_tell_the_conventions_apart() {
    // The tolerance must not hide a swapped convention: the wrong RoPE pairing, the wrong table
    // layout and the wrong norm placement each miss their fixture by far more than 1e-4.
    let mut rope = load_encoder_fixture("encoder_rope_half_pre.safetensors");
    if let poslab::PositionalConfig::Rope(o) = &mut rope.config.positional {
        o.pairing = RopePairing::Interleaved;
    }
    let mut table = load_encoder_fixture("encoder_sinusoidal_add_half_pre.safetensors");
    if let poslab::PositionalConfig::SinusoidalAdd(o) = &mut table.config.positional {
        o.layout = TableLayout::Interleaved;
    }
    let mut norm = load_encoder_fixture("encoder_rope_interleaved_pre.safetensors");
    norm.config.norm = poslab::NormPlacement::Post;
    norm.weights.retain(|k, _| !k.starts_with("final_norm"));
    for fx in [rope, table, norm] {
        let (encoder, _) = fx.encoder(DType::F64);
        let hidden = fx.hidden(&encoder);
        let err = max_abs_diff_real(&hidden, &fx.expected, &fx.attention_mask);
        assert!(
            err > 1e-2,
            "{}: a wrong convention still matched (error {err:e})",
            fx.name
        );
    }
}
