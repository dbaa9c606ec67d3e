//! PoPE, CoPE and PaTH against `reference_2025_schemes.py`'s building blocks
//! (`schemes_2025.safetensors`), PaTH's transport against a walk of Householder reflections at
//! lengths that are not powers of two, and the three schemes' properties and refusals. (Whole
//! encoders: `reference.rs`; gradients, the device path and padding: the suites over
//! `all_schemes()`.)

use std::collections::HashMap;

use candle::{DType, Device, Tensor};
use poslab::positional::{
    pope_frequencies, transport_inverse, transport_scores, BiasBatch, CopeOptions, CopeTables,
    PathLayer, PathOptions, Pope, PopeOptions, PositionalModule,
};
use poslab::{Encoder, NormPlacement, ParamStore, PositionalConfig, Positions};

use crate::common::*;

/// Building blocks are checked to this absolute error (the fixtures are f32, the inputs of
/// order 1).
const BLOCK_TOL: f64 = 1e-5;

fn max_abs(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn fixture() -> HashMap<String, Tensor> {
    load_fixture("schemes_2025.safetensors")
        .into_iter()
        .map(|(k, v)| (k, v.to_dtype(DType::F64).unwrap()))
        .collect()
}

fn check(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let err = max_abs(&values(got), &values(want));
    assert!(err < BLOCK_TOL, "{what}: max abs error {err:e}");
}

/// One layer's scores of a scores scheme's module for a batch.
fn layer_scores(
    module: &PositionalModule,
    positions: &Positions,
    mask: Option<&Tensor>,
    q: &Tensor,
    k: &Tensor,
    x: &Tensor,
) -> Tensor {
    let PositionalModule::Scores(scores) = module else {
        panic!("not a scores scheme")
    };
    let batch = BiasBatch {
        positions,
        mask,
        dtype: DType::F64,
        device: &Device::Cpu,
        backend: poslab::nn::Backend::default(),
    };
    let layer = scores.batch_scores(&batch).unwrap().remove(0).unwrap();
    let hd = q.dim(3).unwrap();
    layer
        .scores(
            q,
            k,
            x,
            1.0 / (hd as f64).sqrt(),
            poslab::nn::Backend::default(),
        )
        .unwrap()
}

#[test]
fn pope_frequencies_polar_forms_and_scores_match_the_reference() {
    let fx = fixture();
    let (q, k) = (&fx["pope.q"], &fx["pope.k"]);
    let raw = load_fixture("schemes_2025.safetensors");
    let positions = Positions::from_tensor(&raw["pope.positions"]).unwrap();
    for base in [10_000.0, 100.0] {
        let case = format!("pope.base{base}");
        let freqs = Tensor::new(pope_frequencies(8, base), &Device::Cpu).unwrap();
        check(
            &format!("{case}.freqs"),
            &freqs,
            &fx[&format!("{case}.freqs")],
        );
        let pope = Pope {
            base,
            deltas: vec![Some(fx["pope.bias"].clone())],
        };
        // The stored bias reaches outside [-2 pi, 0] on both sides; the clamp brings it in.
        check(
            "pope.delta",
            &pope.delta(0).unwrap().unwrap(),
            &fx["pope.delta"],
        );
        let (cos, sin) = pope
            .phases(&positions, 8, DType::F64, &Device::Cpu)
            .unwrap();
        let cos = cos.broadcast_as((2, 2, 7, 8)).unwrap();
        let sin = sin.broadcast_as((2, 2, 7, 8)).unwrap();
        check(
            &format!("{case}.q_polar"),
            &Pope::polar(q, &cos, &sin, poslab::nn::Backend::default()).unwrap(),
            &fx[&format!("{case}.q_polar")],
        );
        // Keys carry the phase offset: cos(φ + δ), sin(φ + δ).
        let delta = fx["pope.delta"].reshape((1, 2, 1, 8)).unwrap();
        let angle = |c: &Tensor, s: &Tensor| -> (Tensor, Tensor) {
            let (cd, sd) = (delta.cos().unwrap(), delta.sin().unwrap());
            (
                (c.broadcast_mul(&cd).unwrap() - s.broadcast_mul(&sd).unwrap()).unwrap(),
                (s.broadcast_mul(&cd).unwrap() + c.broadcast_mul(&sd).unwrap()).unwrap(),
            )
        };
        let (ck, sk) = angle(&cos, &sin);
        check(
            &format!("{case}.k_polar"),
            &Pope::polar(k, &ck, &sk, poslab::nn::Backend::default()).unwrap(),
            &fx[&format!("{case}.k_polar")],
        );
        let module = PositionalModule::Scores(poslab::positional::ScoreFunction::new(pope));
        let x = Tensor::zeros((2, 7, 16), DType::F64, &Device::Cpu).unwrap();
        let scores = layer_scores(&module, &positions, None, q, k, &x);
        check(
            &format!("{case}.logits"),
            &scores,
            &fx[&format!("{case}.logits")],
        );
    }
}

#[test]
fn cope_gates_counts_terms_and_scores_match_the_reference() {
    let fx = fixture();
    let (q, k, mask) = (&fx["cope.q"], &fx["cope.k"], &fx["cope.mask"]);
    for npos in [4, 9] {
        let case = format!("cope.npos{npos}");
        let tables = CopeTables {
            left: fx[&format!("{case}.left")].clone(),
            right: fx[&format!("{case}.right")].clone(),
        };
        let parts = tables
            .parts(
                q,
                k,
                Some(mask),
                1.0 / 8f64.sqrt(),
                poslab::nn::Backend::default(),
            )
            .unwrap();
        check("cope.gates", &parts.gates, &fx["cope.gates"]);
        check("cope.positions", &parts.counts, &fx["cope.positions"]);
        check(
            &format!("{case}.term"),
            &parts.term,
            &fx[&format!("{case}.term")],
        );
        check(
            &format!("{case}.logits"),
            &parts.scores,
            &fx[&format!("{case}.logits")],
        );
    }
    // npos 4 clamps counts the fixture holds above 3: the two cases differ.
    let counts = values(&fx["cope.positions"]);
    assert!(counts.iter().any(|&p| p > 3.0) && counts.iter().all(|&p| p < 8.0));
}

fn path_layer(fx: &HashMap<String, Tensor>) -> PathLayer {
    PathLayer {
        w: fx["path.w.weight"].clone(),
        conv: Some(fx["path.conv.weight"].clone()),
        beta_weight: fx["path.beta.weight"].clone(),
        beta_bias: fx["path.beta.bias"].clone(),
    }
}

#[test]
fn path_reflections_and_scores_match_the_reference() {
    let fx = fixture();
    let layer = path_layer(&fx);
    let (x, mask) = (&fx["path.x"], &fx["path.mask"]);
    let r = layer
        .reflections(x, Some(mask), 2, poslab::nn::Backend::default())
        .unwrap();
    check("path.u_conv", &r.u, &fx["path.u_conv"]);
    check("path.w_unit", &r.w, &fx["path.w_unit"]);
    check("path.beta_gate", &r.beta, &fx["path.beta_gate"]);
    let scores = (transport_scores(&fx["path.q"], &fx["path.k"], &r.w, &r.beta).unwrap()
        / 8f64.sqrt())
    .unwrap();
    check("path.logits", &scores, &fx["path.logits"]);
}

/// PaTH's scores by walking from the query: `r <- r - β_t w_t (w_t · r)` for each token passed,
/// then `r · k_j` (the reference's loop, in f64).
fn walked_scores(q: &[Vec<f64>], k: &[Vec<f64>], w: &[Vec<f64>], beta: &[f64]) -> Vec<f64> {
    let t = q.len();
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let reflect = |r: &mut Vec<f64>, s: usize| {
        let c = beta[s] * dot(&w[s], r);
        for (ri, wi) in r.iter_mut().zip(&w[s]) {
            *ri -= c * wi;
        }
    };
    let mut out = vec![0.0; t * t];
    for i in 0..t {
        out[i * t + i] = dot(&q[i], &k[i]);
        let mut r = q[i].clone();
        for j in (0..i).rev() {
            reflect(&mut r, j + 1);
            out[i * t + j] = dot(&r, &k[j]);
        }
        let mut r = q[i].clone();
        for j in i + 1..t {
            reflect(&mut r, j);
            out[i * t + j] = dot(&r, &k[j]);
        }
    }
    out
}

#[test]
fn path_transport_equals_the_walk_of_reflections_at_any_length() {
    use rand::Rng as _;
    let mut rng = poslab::rng::stream(3, "path walk");
    let hd = 5;
    for t in [1usize, 2, 3, 5, 8, 13, 33] {
        let mut draw = |n: usize, lo: f64, hi: f64| -> Vec<f64> {
            (0..n).map(|_| rng.random_range(lo..hi)).collect()
        };
        let rows = |v: &[f64]| -> Vec<Vec<f64>> { v.chunks(hd).map(<[f64]>::to_vec).collect() };
        let (q, k) = (draw(t * hd, -1.0, 1.0), draw(t * hd, -1.0, 1.0));
        let mut w = draw(t * hd, -1.0, 1.0);
        for row in w.chunks_mut(hd) {
            let n = row.iter().map(|x| x * x).sum::<f64>().sqrt();
            row.iter_mut().for_each(|x| *x /= n);
        }
        // β across (0, 2): reflections that shrink, flip and nearly vanish along w.
        let beta = draw(t, 0.0, 2.0);
        let want = walked_scores(&rows(&q), &rows(&k), &rows(&w), &beta);
        let tensor =
            |v: &[f64], dims: &[usize]| Tensor::from_vec(v.to_vec(), dims, &Device::Cpu).unwrap();
        let got = transport_scores(
            &tensor(&q, &[1, 1, t, hd]),
            &tensor(&k, &[1, 1, t, hd]),
            &tensor(&w, &[1, 1, t, hd]),
            &tensor(&beta, &[1, 1, t]),
        )
        .unwrap();
        let err = max_abs(&values(&got), &want);
        assert!(err < 1e-12, "t {t}: transport vs walk {err:e}");
        // And each inverse is one: (I + L) T = I.
        for upper in [false, true] {
            let inv = transport_inverse(&tensor(&w, &[1, t, hd]), &tensor(&beta, &[1, t]), upper)
                .unwrap();
            let inv = values(&inv);
            let wr = rows(&w);
            for i in 0..t {
                for j in 0..t {
                    let l = |a: usize, b: usize| -> f64 {
                        match (a == b, (b < a) != upper) {
                            (true, _) => 1.0,
                            (false, true) => {
                                beta[a] * wr[a].iter().zip(&wr[b]).map(|(x, y)| x * y).sum::<f64>()
                            }
                            (false, false) => 0.0,
                        }
                    };
                    let p: f64 = (0..t).map(|m| l(i, m) * inv[m * t + j]).sum();
                    let want = f64::from(u8::from(i == j));
                    assert!(
                        (p - want).abs() < 1e-12,
                        "t {t} upper {upper}: ({i}, {j}) {p}"
                    );
                }
            }
        }
    }
}

#[test]
fn path_without_reflections_is_plain_attention() {
    // β = 0 everywhere: every H_t is the identity and the scores are q · k.
    let (t, hd) = (7, 4);
    let q = Tensor::randn(0.0, 1.0, (2, 3, t, hd), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    let k = Tensor::randn(0.0, 1.0, (2, 3, t, hd), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    let w = Tensor::randn(0.0, 1.0, (2, 3, t, hd), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    let beta = Tensor::zeros((2, 3, t), DType::F64, &Device::Cpu).unwrap();
    let got = transport_scores(&q, &k, &w, &beta).unwrap();
    let want = q.matmul(&k.t().unwrap()).unwrap();
    assert!(max_abs(&values(&got), &values(&want)) < 1e-12);
}

fn build(positional: PositionalConfig, seed: u64) -> Encoder {
    let store = ParamStore::new(seed);
    let encoder = Encoder::new(
        &tiny_config(positional, NormPlacement::Pre),
        store.var_builder(DType::F64, &Device::Cpu),
    )
    .unwrap();
    liven(&store);
    encoder
}

#[test]
fn cope_and_path_read_token_order_not_position_ids_and_pope_reads_their_differences() {
    let (ids, mask) = padded_batch(3, 10, 40);
    let shuffled = Positions::from_rows(&[
        vec![3, 9, 1, 4, 0, 7, 2, 8, 6, 5],
        vec![0, 2, 4, 6, 8, 10, 12, 14, 16, 18],
        vec![9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
    ])
    .unwrap();
    for positional in [
        PositionalConfig::Cope(CopeOptions::default()),
        PositionalConfig::Path(PathOptions::default()),
        PositionalConfig::Pope(PopeOptions::default()),
    ] {
        let name = positional.name();
        let model = build(positional, 4);
        let plain = model.forward_t(&ids, &mask, false).unwrap();
        let moved = model.forward_with(&ids, &mask, &shuffled, false).unwrap();
        let diff = max_abs_diff_real(&plain, &moved, &mask);
        match name {
            "pope" => assert!(diff > 1e-3, "pope ignored its positions ({diff:e})"),
            _ => assert_eq!(diff, 0.0, "{name} read position ids"),
        }
        // Token order matters to all three: reversing the real tokens of a sequence moves
        // its outputs by more than a permutation.
        let reversed: Vec<u32> = values(&ids.get(0).unwrap())
            .iter()
            .rev()
            .map(|&v| v as u32)
            .collect();
        let rev = Tensor::new(reversed, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let one = Tensor::ones((1, 10), DType::U32, &Device::Cpu).unwrap();
        let a = model
            .forward_t(&ids.get(0).unwrap().unsqueeze(0).unwrap(), &one, false)
            .unwrap();
        let b = model.forward_t(&rev, &one, false).unwrap();
        let b_back: Vec<Tensor> = (0..10)
            .rev()
            .map(|i| b.get(0).unwrap().get(i).unwrap())
            .collect();
        let b_back = Tensor::stack(&b_back, 0).unwrap().unsqueeze(0).unwrap();
        let d = max_abs(&values(&a), &values(&b_back));
        assert!(
            d > 1e-3,
            "{name}: reversing the tokens permuted the outputs ({d:e})"
        );
    }
}

#[test]
fn the_2025_schemes_count_their_parameters_and_refuse_bad_options_with_the_fix() {
    let model = |positional: &str, extra: &str| {
        poslab::ModelConfig::from_toml_str(&format!(
            "vocab_size = 20\nd_model = 16\nn_heads = 2\nn_layers = 2\nffn_dim = 8\nmax_len = \
             16\n{extra}[positional]\n{positional}"
        ))
    };
    for (positional, extra, needles) in [
        (
            "kind = \"cope\"\nnpos = 1",
            "",
            &["npos = 1", "from 2 to"][..],
        ),
        (
            "kind = \"cope\"\nnpos = 100000000",
            "",
            &["npos = 100000000", "from 2 to 65536"],
        ),
        (
            "kind = \"path\"\nconv_size = 65",
            "",
            &["conv_size = 65", "wider than 64"],
        ),
        (
            "kind = \"pope\"\nbase = 1",
            "",
            &["pope: base = 1", "greater than 1"],
        ),
        (
            "kind = \"pope\"\ndelta_init = \"gaussian\"",
            "",
            &["delta_init", "gaussian"],
        ),
        ("kind = \"path\"\nnpos = 3", "", &["npos"]),
        (
            "kind = \"cope\"",
            "random_positions = 64\n",
            &[
                "random_positions = 64",
                "reads no position ids",
                "remove random_positions",
            ],
        ),
        (
            "kind = \"path\"",
            "random_positions = 64\n",
            &[
                "random_positions = 64",
                "reads no position ids",
                "remove random_positions",
            ],
        ),
    ] {
        let err = model(positional, extra).unwrap_err().to_string();
        for needle in needles {
            assert!(err.contains(needle), "{positional}: {err}");
        }
    }
    // PoPE reads positions: randomizing them is a real experiment.
    model("kind = \"pope\"", "random_positions = 64\n").unwrap();
    model("kind = \"path\"\nconv_size = 0", "").unwrap();
    // Parameters, per layer with positions: PoPE d_model; CoPE 2 npos d_head; PaTH d² + d K +
    // h d + h (d 16, 2 heads, heads of 8).
    for (positional, per_layer) in [
        ("kind = \"pope\"", 16),
        ("kind = \"cope\"\nnpos = 5", 2 * 5 * 8),
        ("kind = \"path\"", 256 + 48 + 32 + 2),
        ("kind = \"path\"\nconv_size = 0", 256 + 32 + 2),
    ] {
        let config = model(positional, "").unwrap();
        let none = model("kind = \"none\"", "").unwrap();
        // Each reads q and k, so each layer's key projection has its bias (16), which `none`'s
        // drops (the softmax cancels it there).
        assert_eq!(
            config.param_count() - none.param_count(),
            2 * (per_layer + 16),
            "{positional}"
        );
        let store = ParamStore::new(0);
        Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
        let scheme: usize = store
            .vars()
            .iter()
            .filter(|(n, _)| n.contains(".pope.") || n.contains(".cope.") || n.contains(".path."))
            .map(|(_, v)| v.elem_count())
            .sum();
        assert_eq!(scheme as u128, 2 * per_layer, "{positional}: built");
    }
}

#[test]
fn the_analyses_of_the_2025_schemes_give_known_answers() {
    use poslab::analysis::scores::{cope_counts, path_turning, pope_scores};
    let (ids, mask) = padded_batch(3, 10, 40);
    // PoPE with δ = 0: the score of unit magnitudes is even in the offset, and at offset 0 it is
    // d_head / sqrt(d_head).
    let store = ParamStore::new(2);
    let config = tiny_config(
        PositionalConfig::Pope(PopeOptions {
            delta_init: poslab::positional::DeltaInit::Zeros,
            ..Default::default()
        }),
        NormPlacement::Pre,
    );
    let encoder = Encoder::new(&config, store.var_builder(DType::F64, &Device::Cpu)).unwrap();
    let curves = pope_scores(&encoder, 6).unwrap();
    let hd = config.head_dim() as f64;
    assert_eq!(curves.offsets, (-6..=6).collect::<Vec<i64>>());
    assert_eq!(curves.curves.len(), config.n_layers * config.n_heads);
    for (_, _, c) in &curves.curves {
        let c: Vec<f64> = c.iter().map(|v| v.unwrap()).collect();
        assert!((c[6] - hd / hd.sqrt()).abs() < 1e-12);
        for o in 1..=6 {
            assert!((c[6 + o] - c[6 - o]).abs() < 1e-12, "odd at {o}");
            assert!(c[6 + o] < c[6], "offset {o} scores above 0");
        }
    }
    // And with the uniform start, left and right differ.
    let encoder = build(PositionalConfig::Pope(PopeOptions::default()), 2);
    let c = &pope_scores(&encoder, 6).unwrap().curves[0].2;
    assert!((c[7].unwrap() - c[5].unwrap()).abs() > 1e-3);

    // CoPE: a count runs from the key to the query, both included, over gates in (0, 1): it
    // lies in (0, |j - i| + 1) and grows with the distance on each side.
    let encoder = build(PositionalConfig::Cope(CopeOptions::default()), 5);
    let curves = cope_counts(&encoder, &ids, &mask).unwrap();
    for (_, _, c) in &curves.curves {
        for (k, &o) in curves.offsets.iter().enumerate() {
            let Some(p) = c[k] else { continue };
            assert!(
                p > 0.0 && p < o.unsigned_abs() as f64 + 1.0,
                "offset {o}: {p}"
            );
            if o > 0 {
                assert!(
                    p > c[k - 1].unwrap(),
                    "offset {o} counts less than {}",
                    o - 1
                );
            }
        }
    }

    // PaTH: every β near 0 (the bias at -60) leaves every key unturned; the trained-from-seed
    // reflections turn farther keys more on average.
    let store = ParamStore::new(6);
    let config = tiny_config(
        PositionalConfig::Path(PathOptions::default()),
        NormPlacement::Pre,
    );
    let encoder = Encoder::new(&config, store.var_builder(DType::F64, &Device::Cpu)).unwrap();
    let turned = path_turning(&encoder, &ids, &mask).unwrap();
    let c = &turned.curves[0].2;
    let mid = turned.offsets.iter().position(|&o| o == 0).unwrap();
    assert_eq!(c[mid], Some(1.0));
    assert!(c[mid + 6].unwrap() < c[mid + 1].unwrap());
    for (name, var) in store.vars() {
        if name.ends_with("path.beta.bias") {
            var.set(&(var.ones_like().unwrap() * -60.0).unwrap())
                .unwrap();
        }
    }
    let flat = path_turning(&encoder, &ids, &mask).unwrap();
    for (_, _, c) in &flat.curves {
        assert!(c.iter().flatten().all(|v| (v - 1.0).abs() < 1e-12));
    }
}

#[test]
fn the_memory_bound_counts_the_tables_each_path_of_a_layer_holds() {
    use poslab::limits::activation_bytes;
    use poslab::nn::{Backend, Compute, Kernels};
    let cpu = Device::Cpu;
    let on = |kernels: Kernels| Compute {
        device: &cpu,
        backend: Backend::default().with_kernels(kernels),
    };
    let config = |p: PositionalConfig| tiny_config(p, NormPlacement::Pre);
    let sin_add = config(PositionalConfig::SinusoidalAdd(Default::default()));
    let (h, l) = (sin_add.n_heads as u128, sin_add.n_layers as u128);
    let table = 4 * 512 * 512 * h * 4; // one (b, h, t, t) of f32 at batch 4, 512 tokens
                                       // (scheme, composed forward and training, fused forward and training)
    for (positional, composed, fused) in [
        (
            PositionalConfig::Path(PathOptions::default()),
            (8, 64),
            (1, 2),
        ),
        (
            PositionalConfig::Cope(CopeOptions::default()),
            (8, 64),
            (1, 2),
        ),
        (
            PositionalConfig::Pope(PopeOptions::default()),
            (2, 12),
            (1, 1),
        ),
        (PositionalConfig::Rope(Default::default()), (1, 1), (1, 1)),
    ] {
        let name = positional.name();
        let model = config(positional);
        let half = poslab::ModelConfig {
            dtype: poslab::Precision::Bf16,
            ..model.clone()
        };
        // The compositions: wherever the path is not known, on the reference kernels, and in
        // half precision on the CPU; the fused kernels: on the CPU in f32 with ops or layer.
        for (sizes, (forward, training), path) in [
            (model.sizes(), composed, "unknown"),
            (
                model.sizes_on(on(Kernels::Reference)),
                composed,
                "reference",
            ),
            (half.sizes_on(on(Kernels::Layer)), composed, "bf16"),
            (model.sizes_on(on(Kernels::Layer)), fused, "layer"),
            (model.sizes_on(on(Kernels::Ops)), fused, "ops"),
        ] {
            let plain = sin_add.sizes();
            assert_eq!(
                activation_bytes(&sizes, 4, 512, true) - activation_bytes(&plain, 4, 512, true),
                (training - 1) * table * l,
                "{name} training, {path}"
            );
            // A forward pass counts two layers' worth.
            assert_eq!(
                activation_bytes(&sizes, 4, 512, false) - activation_bytes(&plain, 4, 512, false),
                (forward - 1) * table * 2,
                "{name} forward, {path}"
            );
        }
    }
}

#[test]
fn a_length_that_fits_the_fused_kernels_is_not_refused_for_the_compositions_memory() {
    use poslab::nn::{Backend, Compute, Kernels};
    use poslab::runs::estimate::estimate;
    // PaTH tested at 900-1000 tokens in batches of 64: the composition would hold about
    // 7.7 GiB, the fused kernels about one attention table a layer (1 GiB).
    let config = poslab::runs::ExperimentConfig::from_toml_str(
        "name = \"long\"\nseeds = 1\n[model]\nd_model = 16\nn_heads = 2\nn_layers = 1\n\
         ffn_dim = 32\n[train]\nbudget = { steps = 1 }\nbatch_size = 32\n[[tasks]]\n\
         kind = \"reverse_string\"\nlengths = [1, 40]\ntest_lengths = [[450, 500]]\n\
         train_examples = 200\neval_examples = 60\n[[variants]]\nname = \"path\"\n\
         positional = { kind = \"path\" }\n",
    )
    .unwrap();
    let limits = poslab::limits::Limits {
        max_memory: 3 << 30,
        ..Default::default()
    };
    let cpu = Device::Cpu;
    let on = |kernels: Kernels| Compute {
        device: &cpu,
        backend: Backend::default().with_kernels(kernels),
    };
    let selection = Default::default();
    for kernels in [Kernels::Layer, Kernels::Ops] {
        let e = estimate(&config, &selection, 1, &limits, on(kernels)).unwrap();
        assert_eq!(e.cells.len(), 1);
    }
    assert_error_mentions(
        estimate(&config, &selection, 1, &limits, on(Kernels::Reference)),
        &[
            "testing: a batch of 64 x 1000 tokens",
            "7.7 GiB",
            "POSLAB_MAX_MEMORY",
        ],
    );
}
