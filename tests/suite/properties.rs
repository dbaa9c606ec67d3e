//! Properties the schemes must have whatever the weights: bounded tables independent of length,
//! the relative-shift rotation, RoPE scores depending on m - n only, padding that changes nothing.

use candle::{DType, Device, IndexOp, Tensor};
use poslab::positional::{inverse_frequencies, sinusoidal_table, PositionTable, Rope, RopeOptions};
use poslab::{Encoder, NormPlacement, ParamStore, PositionalConfig, RopePairing, TableLayout};

use crate::common::*;

const LAYOUTS: [TableLayout; 2] = [TableLayout::Interleaved, TableLayout::Half];

#[test]
fn sinusoidal_table_is_bounded_by_one() {
    for layout in LAYOUTS {
        for (dim, base) in [(8, 10_000.0), (64, 100.0), (512, 10_000.0), (64, 1e8)] {
            let t = sinusoidal_table(0, 10_000, dim, base, layout);
            let (lo, hi) = t
                .iter()
                .fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            assert!(
                lo >= -1.0 && hi <= 1.0,
                "{layout:?} d{dim} base {base}: range [{lo}, {hi}]"
            );
            // Each (sin, cos) pair lies on the unit circle.
            let half = dim / 2;
            for row in t.chunks_exact(dim).step_by(97) {
                for i in 0..half {
                    let (s, c) = match layout {
                        TableLayout::Interleaved => (row[2 * i], row[2 * i + 1]),
                        TableLayout::Half => (row[i], row[half + i]),
                    };
                    assert!((s * s + c * c - 1.0).abs() < 1e-12);
                }
            }
        }
    }
}

#[test]
fn table_rows_do_not_depend_on_table_length() {
    for layout in LAYOUTS {
        let short = sinusoidal_table(0, 10, 64, 10_000.0, layout);
        let long = sinusoidal_table(0, 10_000, 64, 10_000.0, layout);
        assert_eq!(short[..], long[..short.len()], "{layout:?}");
        // A start offset gives exactly the rows of the longer table.
        let offset = sinusoidal_table(5_000, 10, 64, 10_000.0, layout);
        assert_eq!(
            offset[..],
            long[5_000 * 64..5_010 * 64],
            "{layout:?} start 5000"
        );
    }
    // The cached table: growing from 16 to 16 384 rows leaves the first rows bit for bit.
    let table = PositionTable::new(64, 16, DType::F32, &Device::Cpu, |n| {
        sinusoidal_table(0, n, 64, 10_000.0, TableLayout::Interleaved)
    })
    .unwrap();
    let before = table.rows(0, 10).unwrap().to_vec2::<f32>().unwrap();
    let far = table.rows(9_990, 10).unwrap();
    assert_eq!(table.capacity(), 16_384);
    let after = table.rows(0, 10).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(before, after);
    let direct: Vec<f32> = sinusoidal_table(9_990, 10, 64, 10_000.0, TableLayout::Interleaved)
        .into_iter()
        .map(|v| v as f32)
        .collect();
    assert_eq!(far.flatten_all().unwrap().to_vec1::<f32>().unwrap(), direct);
}

/// The block rotation `M(k)` with `PE(p + k) = M(k) PE(p)`, built from `k` alone: for pair `i`,
/// angle `phi = k w_i`, `sin(a + phi) = sin a cos phi + cos a sin phi` and
/// `cos(a + phi) = cos a cos phi - sin a sin phi`. Dense `d x d`, row-major.
fn shift_matrix(k: f64, dim: usize, base: f64, layout: TableLayout) -> Vec<f64> {
    let mut m = vec![0.0; dim * dim];
    for (i, w) in inverse_frequencies(dim, base).into_iter().enumerate() {
        let (s_idx, c_idx) = match layout {
            TableLayout::Interleaved => (2 * i, 2 * i + 1),
            TableLayout::Half => (i, dim / 2 + i),
        };
        let (sp, cp) = (k * w).sin_cos();
        m[s_idx * dim + s_idx] = cp;
        m[s_idx * dim + c_idx] = sp;
        m[c_idx * dim + s_idx] = -sp;
        m[c_idx * dim + c_idx] = cp;
    }
    m
}

#[test]
fn shifting_a_sinusoidal_table_is_a_rotation_that_depends_on_the_offset_only() {
    let (dim, base) = (64, 10_000.0);
    for layout in LAYOUTS {
        let table = sinusoidal_table(0, 600, dim, base, layout);
        let row = |p: usize| &table[p * dim..(p + 1) * dim];
        for k in [1usize, 2, 7, 50, 333] {
            let m = shift_matrix(k as f64, dim, base, layout);
            // M(k) is orthogonal: a rotation, norms are kept.
            for a in 0..dim {
                for b in 0..dim {
                    let dot: f64 = (0..dim).map(|j| m[a * dim + j] * m[b * dim + j]).sum();
                    let want = if a == b { 1.0 } else { 0.0 };
                    assert!((dot - want).abs() < 1e-12);
                }
            }
            for p in (0..600 - k).step_by(13) {
                let rotated: Vec<f64> = (0..dim)
                    .map(|a| (0..dim).map(|j| m[a * dim + j] * row(p)[j]).sum())
                    .collect();
                let err = rotated
                    .iter()
                    .zip(row(p + k))
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f64::max);
                assert!(err < 1e-9, "{layout:?} p {p} k {k}: error {err:e}");
            }
        }
    }
    // The property is not a tautology of the check: a random table does not satisfy it.
    let mut rng = poslab::rng::stream(1, "random table");
    use rand::Rng as _;
    let random: Vec<f64> = (0..2 * dim).map(|_| rng.random_range(-1.0..1.0)).collect();
    let m = shift_matrix(1.0, dim, base, TableLayout::Interleaved);
    let err = (0..dim)
        .map(|a| {
            let r: f64 = (0..dim).map(|j| m[a * dim + j] * random[j]).sum();
            (r - random[dim + a]).abs()
        })
        .fold(0.0, f64::max);
    assert!(err > 0.1, "a random table passed the shift check ({err})");
}

#[test]
fn rope_score_depends_only_on_relative_distance() {
    let d = 16;
    let mut rng = poslab::rng::stream(3, "rope vectors");
    use rand::Rng as _;
    let mut vector = || {
        let v: Vec<f64> = (0..d).map(|_| rng.random_range(-1.0..1.0)).collect();
        Tensor::from_vec(v, (1, 1, 1, d), &Device::Cpu).unwrap()
    };
    let (q, k) = (vector(), vector());
    for pairing in [RopePairing::Interleaved, RopePairing::Half] {
        let rope = Rope::new(
            &RopeOptions {
                base: 10_000.0,
                pairing,
                ..Default::default()
            },
            d,
            8,
            DType::F64,
            &Device::Cpu,
        )
        .unwrap();
        let score = |m: usize, n: usize| -> f64 {
            let qm = rope.apply(&q, m, poslab::nn::Backend::default()).unwrap();
            let kn = rope.apply(&k, n, poslab::nn::Backend::default()).unwrap();
            (qm * kn)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        for delta in [0usize, 1, 5, 31] {
            let reference = score(delta, 0);
            for n in [1usize, 7, 100, 1_000, 4_097] {
                let s = score(n + delta, n);
                assert!(
                    (s - reference).abs() < 1e-9,
                    "{pairing:?} m - n = {delta}, n = {n}: {s} vs {reference}"
                );
            }
        }
        // And it does depend on the distance.
        assert!((score(0, 0) - score(3, 0)).abs() > 1e-3);
    }
}

fn encoder(positional: PositionalConfig, norm: NormPlacement, dtype: DType, seed: u64) -> Encoder {
    let store = ParamStore::new(seed);
    Encoder::new(
        &tiny_config(positional, norm),
        store.var_builder(dtype, &Device::Cpu),
    )
    .unwrap()
}

#[test]
fn relative_schemes_ignore_a_constant_position_offset_and_absolute_ones_do_not() {
    let (ids, mask) = padded_batch(3, 10, 40);
    for positional in all_schemes() {
        let name = positional.name();
        let model = encoder(positional, NormPlacement::Pre, DType::F64, 11);
        let at0 = model.forward_at(&ids, &mask, 0, false).unwrap();
        let at17 = model.forward_at(&ids, &mask, 17, false).unwrap();
        let diff = max_abs_diff_real(&at0, &at17, &mask);
        let dynamic = matches!(
            &positional_of(&model),
            PositionalConfig::Rope(o) if matches!(o.scaling, Some(poslab::positional::RopeScaling::DynamicNtk { .. }))
        );
        match name {
            "none" => assert_eq!(diff, 0.0, "none must not see positions at all"),
            // Dynamic NTK's base grows with the largest position read: relative only within
            // one batch length.
            "rope" if dynamic => assert!(diff > 1e-6, "dynamic NTK ignored the batch length"),
            // Relative by construction: a rotation by the distance, a bias of it, or PoPE's
            // phase of it, GRAPE-M's learned rotation by it; FoX, CoPE, PaTH and stick-breaking
            // read no position at all, only the content and the order of the tokens.
            "rope" | "prope" | "alibi" | "t5" | "kerple" | "fire" | "fox" | "pope" | "cope"
            | "path" | "stick_breaking" | "grape_m" => assert!(
                diff < 1e-9,
                "{name} shifted by 17 changed outputs by {diff:e}"
            ),
            _ => assert!(diff > 1e-3, "{name}: a shift changed nothing ({diff:e})"),
        }
    }
}

#[test]
fn padded_ids_change_nothing_at_real_positions() {
    for positional in all_schemes() {
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            let name = positional.name();
            let model = encoder(positional.clone(), norm, DType::F32, 5);
            let (ids, mask) = padded_batch(4, 9, 40);
            let out = model.forward_t(&ids, &mask, false).unwrap();
            // Replace every padded id by another id.
            let ids_v = ids.to_vec2::<u32>().unwrap();
            let mask_v = mask.to_vec2::<u32>().unwrap();
            let changed: Vec<u32> = ids_v
                .iter()
                .zip(&mask_v)
                .flat_map(|(r, m)| {
                    r.iter()
                        .zip(m)
                        .map(|(&i, &m)| if m == 1 { i } else { (i + 17) % 40 })
                })
                .collect();
            let changed = Tensor::from_vec(changed, ids.dims(), &Device::Cpu).unwrap();
            assert_ne!(changed.to_vec2::<u32>().unwrap(), ids_v);
            let out2 = model.forward_t(&changed, &mask, false).unwrap();
            assert_eq!(
                max_abs_diff_real(&out, &out2, &mask),
                0.0,
                "{name} {norm:?}: padded ids leaked into real positions"
            );
        }
    }
}

#[test]
fn a_sequence_encodes_the_same_alone_as_inside_a_padded_batch() {
    // Dynamic NTK reads the batch's length by definition (see `depends_on_batch_length`).
    for positional in all_schemes()
        .into_iter()
        .filter(|p| !depends_on_batch_length(p))
    {
        let name = positional.name();
        let model = encoder(positional, NormPlacement::Pre, DType::F32, 9);
        let (ids, mask) = padded_batch(4, 9, 40);
        let batch = model.forward_t(&ids, &mask, false).unwrap();
        for i in 0..4 {
            let real = mask
                .i(i)
                .unwrap()
                .to_vec1::<u32>()
                .unwrap()
                .iter()
                .sum::<u32>() as usize;
            let alone_ids = ids.i((i..i + 1, 0..real)).unwrap();
            let alone_mask = Tensor::ones((1, real), DType::U32, &Device::Cpu).unwrap();
            let alone = model.forward_t(&alone_ids, &alone_mask, false).unwrap();
            let in_batch = batch.i((i..i + 1, 0..real)).unwrap();
            let err = max_abs_diff(&alone, &in_batch);
            assert!(err < 1e-5, "{name} sequence {i}: {err:e}");
        }
    }
}

#[test]
fn same_seed_same_weights_and_shared_parts_match_across_schemes() {
    let build = |positional: PositionalConfig, seed: u64| {
        let store = ParamStore::new(seed);
        Encoder::new(
            &tiny_config(positional, NormPlacement::Pre),
            store.var_builder(DType::F32, &Device::Cpu),
        )
        .unwrap();
        store
    };
    let schemes = all_schemes();
    assert_eq!((schemes[5].name(), schemes[6].name()), ("learned", "rope"));
    let a = build(schemes[1].clone(), 42);
    let b = build(schemes[1].clone(), 42);
    let c = build(schemes[1].clone(), 43);
    let bits = |s: &ParamStore, name: &str| bits(&s.get(name).unwrap());
    for (name, _) in a.vars() {
        assert_eq!(
            bits(&a, &name),
            bits(&b, &name),
            "{name} differs under the same seed"
        );
    }
    // LayerNorm weights are constant; every random variable must differ with the seed.
    assert_ne!(
        bits(&a, "layers.0.attn.q.weight"),
        bits(&c, "layers.0.attn.q.weight")
    );
    assert_ne!(bits(&a, "tok_emb.weight"), bits(&c, "tok_emb.weight"));
    // Shared parts: the layers of every scheme, the token table where shapes agree.
    let rope = build(schemes[6].clone(), 42);
    let learned = build(schemes[5].clone(), 42);
    for name in [
        "layers.0.attn.q.weight",
        "layers.1.ffn.down.bias",
        "tok_emb.weight",
    ] {
        assert_eq!(bits(&a, name), bits(&rope, name), "{name}: add vs rope");
        assert_eq!(
            bits(&a, name),
            bits(&learned, name),
            "{name}: add vs learned"
        );
    }
    assert!(learned.get("pos_emb.weight").is_some() && a.get("pos_emb.weight").is_none());
}

#[test]
fn dropout_is_seeded_and_only_active_in_training() {
    let mut config = tiny_config(
        PositionalConfig::Rope(RopeOptions::default()),
        NormPlacement::Pre,
    );
    config.dropout = 0.2;
    config.attention_dropout = 0.2;
    let store = ParamStore::new(1);
    let model = Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
    let (ids, mask) = padded_batch(2, 8, 40);
    let eval1 = model.forward_t(&ids, &mask, false).unwrap();
    let eval2 = model.forward_t(&ids, &mask, false).unwrap();
    assert_eq!(max_abs_diff(&eval1, &eval2), 0.0);
    model.set_dropout_seed(7);
    let train1 = model.forward_t(&ids, &mask, true).unwrap();
    let train1b = model.forward_t(&ids, &mask, true).unwrap();
    model.set_dropout_seed(7);
    let train2 = model.forward_t(&ids, &mask, true).unwrap();
    model.set_dropout_seed(8);
    let train3 = model.forward_t(&ids, &mask, true).unwrap();
    assert_eq!(
        max_abs_diff(&train1, &train2),
        0.0,
        "same dropout seed, same masks"
    );
    assert!(
        max_abs_diff(&train1, &train1b) > 1e-3,
        "masks advance between calls"
    );
    assert!(
        max_abs_diff(&train1, &train3) > 1e-3,
        "another seed, other masks"
    );
    assert!(
        max_abs_diff(&train1, &eval1) > 1e-3,
        "dropout active in training"
    );
}

#[test]
fn dropout_zeroes_the_requested_fraction_and_keeps_the_mean() {
    use candle::ModuleT;
    use std::sync::{Arc, Mutex};
    let rng = Arc::new(Mutex::new(poslab::rng::stream(0, "dropout test")));
    let n = 200_000;
    let x = Tensor::ones(n, DType::F32, &Device::Cpu).unwrap();
    for p in [0.1, 0.5] {
        let y = poslab::nn::Dropout::new(p, rng.clone())
            .forward_t(&x, true)
            .unwrap();
        let v = y.to_vec1::<f32>().unwrap();
        let zeros = v.iter().filter(|&&e| e == 0.0).count() as f64 / n as f64;
        let mean = v.iter().map(|&e| f64::from(e)).sum::<f64>() / n as f64;
        // Binomial standard error is at most 0.0012 here: 0.01 is about 9 of them.
        assert!((zeros - p).abs() < 0.01, "p = {p}: zeroed {zeros}");
        assert!((mean - 1.0).abs() < 0.02, "p = {p}: mean {mean}");
        let kept = 1.0 / (1.0 - p) as f32;
        assert!(v.iter().all(|&e| e == 0.0 || (e - kept).abs() < 1e-6));
    }
}

fn positional_of(encoder: &Encoder) -> PositionalConfig {
    encoder.config().positional.clone()
}
