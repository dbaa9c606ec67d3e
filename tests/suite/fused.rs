//! The fast paths against the reference: poslab's fused CPU kernels (per op, and whole encoder
//! layers with a hand-written backward) must give the reference compositions' outputs and
//! gradients, for every scheme, both norm placements, with padding and with dropout, in f32 and
//! f64, within the tolerances stated here.
//!
//! Tolerances are relative to the largest magnitude of the reference tensor. The f64 paths
//! differ only in the order of additions (measured 2e-15); f32 also differs in the fused
//! `exp` and `erf` (errors below 2e-7 absolute) and in accumulation order (measured 1.1e-6).

use candle::{DType, Device, Tensor, Var};
use poslab::nn::{Backend, Kernels};
use poslab::{Encoder, ModelConfig, NormPlacement, ParamStore, PositionalConfig};

use crate::common::*;

const TOL_F64: f64 = 1e-13;
const TOL_F32: f64 = 1e-5;

fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F64 {
        TOL_F64
    } else {
        TOL_F32
    }
}

/// `max |a - b| / max |b|` (b the reference), 0 for two zero tensors; infinite where `a` is not
/// finite and `b` is (a NaN would pass every `max`).
fn relative_error(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    if a.iter()
        .zip(b)
        .any(|(x, y)| !x.is_finite() && y.is_finite())
    {
        return f64::INFINITY;
    }
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
    if scale == 0.0 {
        diff
    } else {
        diff / scale
    }
}

/// A fixed random tensor in `[-1, 1)`.
fn random(dims: &[usize], seed: u64, dtype: DType) -> Tensor {
    use rand::Rng as _;
    let mut rng = poslab::rng::stream(seed, "fused test");
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// The hidden states and every variable's gradient (by name) of a projection loss.
struct Run {
    hidden: Vec<f64>,
    grads: Vec<(String, Vec<f64>)>,
}

fn run_encoder(config: &ModelConfig, dtype: DType, backend: Backend, train: bool) -> Run {
    run_encoder_on(config, dtype, backend, train, (5, 13))
}

fn run_encoder_on(
    config: &ModelConfig,
    dtype: DType,
    backend: Backend,
    train: bool,
    shape: (usize, usize),
) -> Run {
    run_encoder_packed(config, dtype, backend, train, shape, false).0
}

/// [`run_encoder_on`] with the encoder's layers packed into one variable each (as training
/// packs them) or not; also how many variables its store then holds, and how many named
/// parameters. Gradients are by parameter name, packed or not.
fn run_encoder_packed(
    config: &ModelConfig,
    dtype: DType,
    backend: Backend,
    train: bool,
    (b, t): (usize, usize),
    pack: bool,
) -> (Run, usize, usize) {
    {
        let store = ParamStore::new(7);
        let mut encoder = Encoder::new(config, store.var_builder(dtype, &Device::Cpu))
            .unwrap()
            .with_backend(backend);
        liven(&store);
        let unpacked = store.num_params();
        if pack {
            encoder.pack(&store).unwrap();
        }
        assert_eq!(store.num_params(), unpacked, "packing adds no parameter");
        encoder.set_dropout_seed(11);
        let (ids, mask) = padded_batch(b, t, config.vocab_size as u32);
        let hidden = encoder.forward_t(&ids, &mask, train).unwrap();
        let r = random(hidden.dims(), 3, dtype);
        let grads = hidden
            .mul(&r)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let grads = store.gradients(&grads).unwrap();
        let params = store.params();
        for (name, _) in &params {
            assert!(
                grads.iter().any(|(n, _)| n == name),
                "{}: `{name}` got no gradient",
                backend.kernels.name()
            );
        }
        let run = Run {
            hidden: values(&hidden),
            grads: grads
                .iter()
                .map(|(name, g)| (name.clone(), values(g)))
                .collect(),
        };
        (run, store.vars().len(), params.len())
    }
}

/// Returns the worst relative error of `fast` against `reference`, asserting each is within
/// `tol`.
fn compare(fast: &Run, reference: &Run, tol: f64, what: &str) -> f64 {
    let mut worst = relative_error(&fast.hidden, &reference.hidden);
    assert!(
        worst <= tol,
        "{what}: hidden states differ by {worst:e} (tolerance {tol:e})"
    );
    assert_eq!(fast.grads.len(), reference.grads.len(), "{what}: variables");
    let dape = reference.grads.iter().any(|(n, _)| n.contains(".dape."));
    for ((name, g), (ref_name, r)) in fast.grads.iter().zip(&reference.grads) {
        assert_eq!(name, ref_name);
        let err = relative_error(g, r);
        // A gradient summing t² terms of dS, whose rows sum to zero, is small beside the terms
        // it sums, and the rounding of them shows 10x more; 20x under DAPE, whose MLP adds its
        // input gradient to those terms (FIRE's output bias in f32: 1.6e-4 where 1e-5 is the
        // tolerance of the rest).
        let tol = match (sums_cancelling_rows(name, dape), dape) {
            (true, true) => 20.0 * tol,
            (true, false) => 10.0 * tol,
            _ => tol,
        };
        assert!(
            err <= tol,
            "{what}: gradient of `{name}` differs by {err:e} (tolerance {tol:e})"
        );
        worst = worst.max(err);
    }
    worst
}

/// The compositions with the attention dropout the device path draws (from a seed a layer).
fn seeded_reference() -> poslab::nn::Backend {
    on(Kernels::Reference).with_seeded_attention_dropout()
}

/// A config wider than the tiny one, with widths that are not multiples of the kernels' 16
/// lanes and a sequence length (13) that is not either.
fn medium_config(positional: poslab::PositionalConfig, norm: NormPlacement) -> ModelConfig {
    ModelConfig {
        vocab_size: 50,
        d_model: 40,
        n_heads: 4,
        n_layers: 2,
        ffn_dim: 72,
        ..tiny_config(positional, norm)
    }
}

#[test]
fn fused_kernels_match_the_reference_for_every_scheme_norm_dtype_and_dropout() {
    let mut worst = [0.0f64; 2];
    for positional in all_schemes() {
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            for (size, mut config) in [
                ("tiny", tiny_config(positional.clone(), norm)),
                ("medium", medium_config(positional.clone(), norm)),
            ] {
                for dropout in [0.0, 0.2] {
                    config.dropout = dropout;
                    config.attention_dropout = dropout;
                    for (slot, dtype) in [DType::F32, DType::F64].into_iter().enumerate() {
                        let train = dropout > 0.0;
                        let reference = run_encoder(&config, dtype, on(Kernels::Reference), train);
                        for kernels in [Kernels::Ops, Kernels::Layer] {
                            let what = format!(
                                "{} {norm:?} {size} dropout {dropout} {dtype:?} {}",
                                positional.name(),
                                kernels.name()
                            );
                            let fast = run_encoder(&config, dtype, on(kernels), train);
                            worst[slot] = worst[slot].max(compare(
                                &fast,
                                &reference,
                                tolerance(dtype),
                                &what,
                            ));
                        }
                        // The CUDA path's ops (poslab-kernels/src/cuda_ops.rs), wired as on a GPU, computed here.
                        let what = format!(
                            "{} {norm:?} {size} dropout {dropout} {dtype:?} gpu ops on the cpu",
                            positional.name()
                        );
                        let (gpu_ops, calls) = with_op_calls(|| {
                            run_encoder(&config, dtype, twin(Kernels::Ops), train)
                        });
                        // The CUDA path draws its attention dropout from a seed.
                        let reference = run_encoder(&config, dtype, seeded_reference(), train);
                        // Per layer at least two LayerNorms, a softmax and a GELU (two
                        // rotations more under RoPE; no softmax where the scheme makes the
                        // weights).
                        let per_layer = match positional.placement() {
                            poslab::Placement::Rotation => 6,
                            poslab::Placement::Weights => 3,
                            _ => 4,
                        };
                        assert!(
                            calls >= per_layer * config.n_layers,
                            "{what}: {calls} gpu ops ran"
                        );
                        worst[slot] =
                            worst[slot].max(compare(&gpu_ops, &reference, tolerance(dtype), &what));
                    }
                }
            }
        }
    }
    eprintln!(
        "fused vs reference, worst relative error: f32 {:.1e}, f64 {:.1e}",
        worst[0], worst[1]
    );
}

/// The device path: each encoder layer as the CUDA path's sequence of device operations
/// (`poslab-kernels/src/gpu/`), computed by their CPU twin, against the reference compositions, forward and
/// every gradient, for every scheme, both norm placements, two sizes, with and without dropout
/// (the attention's drawn from a seed, in the fused attention's tile loop, and by the
/// compositions under [`seeded_reference`]), in f32 and f64, at the fused kernels' tolerances;
/// and that the path ran, by its count of operations.
#[test]
fn device_path_layers_match_the_reference_for_every_scheme_norm_dtype_and_dropout() {
    use poslab::nn::device_path;
    let mut worst = [0.0f64; 2];
    for positional in all_schemes() {
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            for (size, mut config) in [
                ("tiny", tiny_config(positional.clone(), norm)),
                ("medium", medium_config(positional.clone(), norm)),
            ] {
                for dropout in [0.0, 0.2] {
                    config.dropout = dropout;
                    config.attention_dropout = dropout;
                    for (slot, dtype) in [DType::F32, DType::F64].into_iter().enumerate() {
                        let train = dropout > 0.0;
                        let reference = run_encoder(&config, dtype, seeded_reference(), train);
                        let what = format!(
                            "{} {norm:?} {size} dropout {dropout} {dtype:?} device path",
                            positional.name()
                        );
                        let before = device_path::counts();
                        let (device, _) = with_op_calls(|| {
                            run_encoder(&config, dtype, twin(Kernels::Layer), train)
                        });
                        let ran = device_path::counts() - before;
                        // forward (12 post-norm, 13 pre-norm; 9 and 10 where the attention
                        // is one fused kernel writing the heads side by side), then the
                        // backward (at least 19, fused) with the forward kept (train) or
                        // recomputed
                        let per_layer = if train { 9 + 19 } else { 2 * 9 + 19 };
                        // A scheme that computes its own scores runs as a composition on
                        // every device: its layers make no device launches.
                        let composed = matches!(
                            positional.placement(),
                            poslab::Placement::Scores | poslab::Placement::Weights
                        );
                        assert!(
                            composed || ran.launches() >= per_layer * config.n_layers,
                            "{what}: {ran:?} device operations"
                        );
                        worst[slot] =
                            worst[slot].max(compare(&device, &reference, tolerance(dtype), &what));
                    }
                }
            }
        }
    }
    eprintln!(
        "device path vs reference, worst relative error: f32 {:.1e}, f64 {:.1e}",
        worst[0], worst[1]
    );
}

/// Biases of the offset alone (ALiBi, T5, KERPLE, FIRE) over shared positions reach the device
/// path's fused attention as their `2t - 1` values per head: the forward and every gradient (T5's
/// table, KERPLE's `r1` and `r2`, FIRE's MLP through the per-offset sums) match the reference at
/// the fused tolerances, over two tiles of keys (t = 70 > 64), in both directions and causal; and
/// each step launches exactly what the same model without a bias launches, and one launch a
/// layer more for a bias owed a gradient (its sum by offset; ALiBi's slopes are fixed) (a bias
/// table takes the softmax path, with its `t × t` scores: more launches). Causal FIRE
/// normalises by the query's position, not by offset, and keeps its table.
#[test]
fn biases_of_the_offset_reach_the_fused_device_attention_with_their_gradients() {
    use poslab::nn::device_path;
    let shape = (1, 70); // one sequence: no padding, so FIRE's bias is one block
    let launches = |config: &ModelConfig, dtype: DType| {
        let before = device_path::counts();
        let run = run_encoder_on(config, dtype, twin(Kernels::Layer), true, shape);
        (run, (device_path::counts() - before).launches())
    };
    for positional in [
        PositionalConfig::Alibi(Default::default()),
        PositionalConfig::T5(Default::default()),
        PositionalConfig::Kerple(Default::default()),
        PositionalConfig::Fire(Default::default()),
    ] {
        for causal in [false, true] {
            let mut config = tiny_config(positional.clone(), NormPlacement::Pre);
            config.max_len = 80;
            config.causal = causal;
            let plain = ModelConfig {
                positional: PositionalConfig::None(Default::default()),
                ..config.clone()
            };
            for dtype in [DType::F32, DType::F64] {
                let what = format!("{} causal {causal} {dtype:?}", positional.name());
                let reference = run_encoder_on(&config, dtype, on(Kernels::Reference), true, shape);
                let (device, ran) = launches(&config, dtype);
                compare(&device, &reference, tolerance(dtype), &what);
                let (_, unbiased) = launches(&plain, dtype);
                let by_offset = !(causal && positional.name() == "fire");
                let summed = match positional.name() {
                    "alibi" => 0,
                    _ => config.n_layers,
                };
                match by_offset {
                    true => assert_eq!(ran, unbiased + summed, "{what}: launches against no bias"),
                    false => assert!(ran > unbiased, "{what}: a table takes the softmax path"),
                }
            }
        }
    }
}

/// No `t × t` tensor on the device path where the attention is fused: a training step of a
/// 2,048-token sequence on the twin, for a scheme of each kind the fused attention takes (none,
/// a rotation, biases by offset, FoX's running sums), allocates at its peak less than half of
/// one layer's scores (`b h t²` f32 values, 32 MiB here), where the softmax path holds several
/// of them at once; with attention dropout too, which the fused attention draws per tile from a
/// seed (a drawn mask would be a `t × t` tensor, and the softmax path's).
#[test]
fn fused_device_layers_make_no_t_by_t_tensor() {
    use poslab::nn::device_path;
    let (b, t) = (1, 2048);
    for (positional, attention_dropout) in [
        PositionalConfig::SinusoidalAdd(Default::default()),
        PositionalConfig::Rope(Default::default()),
        PositionalConfig::Alibi(Default::default()),
        PositionalConfig::T5(Default::default()),
        PositionalConfig::Fox(Default::default()),
    ]
    .into_iter()
    .flat_map(|p| [(p.clone(), 0.0), (p, 0.1)])
    {
        let mut config = tiny_config(positional.clone(), NormPlacement::Pre);
        config.max_len = t;
        config.attention_dropout = attention_dropout;
        let scores = b * config.n_heads * t * t * 4;
        device_path::reset_peak_bytes();
        let before = device_path::live_bytes();
        run_encoder_on(&config, DType::F32, twin(Kernels::Layer), true, (b, t));
        let peak = device_path::peak_bytes() - before;
        eprintln!(
            "{} attention dropout {attention_dropout}: peak {:.1} MiB, one layer's scores {:.1} MiB",
            positional.name(),
            peak as f64 / (1 << 20) as f64,
            scores as f64 / (1 << 20) as f64
        );
        assert!(
            peak < scores / 2,
            "{} attention dropout {attention_dropout}: the device path's peak {peak} bytes, one \
             layer's scores {scores}",
            positional.name()
        );
    }
}

/// ReLU in the feed-forward block (the DeepMind length-generalization models): the fused layer
/// and the fused ops match the composition, forward and backward, for a scheme of each place,
/// both norm placements, with and without dropout.
#[test]
fn relu_layers_match_the_reference() {
    use poslab::PositionalConfig as P;
    for positional in [
        P::SinusoidalAdd(Default::default()),
        P::Rope(poslab::RopeOptions::default()),
        P::Alibi(Default::default()),
    ] {
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            let mut config = medium_config(positional.clone(), norm);
            config.activation = poslab::nn::Activation::Relu;
            for dropout in [0.0, 0.2] {
                config.dropout = dropout;
                for dtype in [DType::F32, DType::F64] {
                    let train = dropout > 0.0;
                    let reference = run_encoder(&config, dtype, on(Kernels::Reference), train);
                    for kernels in [Kernels::Ops, Kernels::Layer] {
                        let what = format!(
                            "relu {} {norm:?} dropout {dropout} {dtype:?} {}",
                            positional.name(),
                            kernels.name()
                        );
                        let fast = run_encoder(&config, dtype, on(kernels), train);
                        compare(&fast, &reference, tolerance(dtype), &what);
                    }
                    let (device, _) =
                        with_op_calls(|| run_encoder(&config, dtype, twin(Kernels::Layer), train));
                    let what = format!("relu {} {norm:?} {dtype:?} device", positional.name());
                    compare(&device, &reference, tolerance(dtype), &what);
                }
            }
            // GELU and ReLU are different models: the switch is not ignored.
            let gelu = ModelConfig {
                activation: poslab::nn::Activation::Gelu,
                ..config.clone()
            };
            let (a, b) = (
                run_encoder(&config, DType::F64, on(Kernels::Layer), false),
                run_encoder(&gelu, DType::F64, on(Kernels::Layer), false),
            );
            assert!(relative_error(&a.hidden, &b.hidden) > 1e-3);
        }
    }
}

#[test]
fn layer_kernel_gives_the_same_bits_with_saved_or_recomputed_activations() {
    // Training mode keeps the activations (and attention weights) inside the op; evaluation mode
    // keeps none and the backward recomputes them. Without dropout the two are the same
    // computation, so the results must be identical to the bit.
    for positional in all_schemes() {
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            let config = medium_config(positional.clone(), norm);
            // The CPU's layer, and the device path's (by its twin).
            for device in [false, true] {
                let backend = match device {
                    false => on(Kernels::Layer),
                    true => twin(Kernels::Layer),
                };
                let run = |train| run_encoder(&config, DType::F32, backend, train);
                let (kept, recomputed) = (run(true), run(false));
                assert_eq!(kept.hidden, recomputed.hidden, "{}", positional.name());
                for ((name, a), (_, b)) in kept.grads.iter().zip(&recomputed.grads) {
                    assert_eq!(
                        a,
                        b,
                        "{} {norm:?} device {device}: `{name}`",
                        positional.name()
                    );
                }
            }
        }
    }
}

/// A config and batch big enough for the kernels' parallel paths: gemm splitting work across
/// threads, weight gradients as two half-sums (560 rows).
fn wide_config(positional: poslab::PositionalConfig, norm: NormPlacement) -> ModelConfig {
    ModelConfig {
        vocab_size: 60,
        d_model: 64,
        n_heads: 4,
        n_layers: 2,
        ffn_dim: 128,
        max_len: 80,
        ..tiny_config(positional, norm)
    }
}
const WIDE_BATCH: (usize, usize) = (8, 70);

#[test]
fn wide_shapes_match_the_reference() {
    use poslab::PositionalConfig as P;
    for positional in [
        P::SinusoidalAdd(Default::default()),
        P::Rope(poslab::RopeOptions::default()),
    ] {
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            let config = wide_config(positional.clone(), norm);
            for dtype in [DType::F32, DType::F64] {
                let reference =
                    run_encoder_on(&config, dtype, on(Kernels::Reference), false, WIDE_BATCH);
                let fast = run_encoder_on(&config, dtype, on(Kernels::Layer), false, WIDE_BATCH);
                let what = format!("wide {} {norm:?} {dtype:?}", positional.name());
                compare(&fast, &reference, tolerance(dtype), &what);
            }
        }
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    for positional in [
        poslab::PositionalConfig::Rope(poslab::RopeOptions::default()),
        poslab::PositionalConfig::Learned(Default::default()),
    ] {
        let mut config = wide_config(positional, NormPlacement::Pre);
        config.dropout = 0.1;
        config.attention_dropout = 0.1;
        let in_pool = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| {
                    run_encoder_on(&config, DType::F32, on(Kernels::Layer), true, WIDE_BATCH)
                })
        };
        let (one, three) = (in_pool(1), in_pool(3));
        assert_eq!(one.hidden, three.hidden);
        for ((name, a), (_, b)) in one.grads.iter().zip(&three.grads) {
            assert_eq!(a, b, "`{name}`");
        }
    }
}

/// `f` on a variable of `x`'s values and the gradient of `sum(f(x) * r)`, under `kernels`.
fn value_and_grad(
    x: &Tensor,
    kernels: Kernels,
    f: &dyn Fn(&Tensor, Backend) -> Tensor,
) -> (Vec<f64>, Vec<f64>) {
    let var = Var::from_tensor(x).unwrap();
    let y = f(var.as_tensor(), on(kernels));
    let r = random(y.dims(), 9, y.dtype());
    let grads = y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    (values(&y), values(grads.get(var.as_tensor()).unwrap()))
}

fn assert_op_matches(name: &str, x: &Tensor, f: &dyn Fn(&Tensor, Backend) -> Tensor) {
    let tol = tolerance(x.dtype());
    let (y_ref, g_ref) = value_and_grad(x, Kernels::Reference, f);
    let (y, g) = value_and_grad(x, Kernels::Ops, f);
    let (ey, eg) = (relative_error(&y, &y_ref), relative_error(&g, &g_ref));
    assert!(
        ey <= tol,
        "{name} {:?}: forward differs by {ey:e}",
        x.dtype()
    );
    assert!(
        eg <= tol,
        "{name} {:?}: backward differs by {eg:e}",
        x.dtype()
    );
}

#[test]
fn fused_ops_match_their_compositions_forward_and_backward() {
    for dtype in [DType::F32, DType::F64] {
        // RoPE on (b, h, t, d_head), both pairings.
        let x = random(&[2, 3, 11, 20], 1, dtype);
        for interleaved in [true, false] {
            let rope = poslab::positional::Rope::new(
                &poslab::RopeOptions {
                    base: 10_000.0,
                    pairing: if interleaved {
                        poslab::RopePairing::Interleaved
                    } else {
                        poslab::RopePairing::Half
                    },
                    ..Default::default()
                },
                20,
                16,
                dtype,
                &Device::Cpu,
            )
            .unwrap();
            assert_op_matches(&format!("rope interleaved={interleaved}"), &x, &|x, b| {
                rope.apply(x, 3, b).unwrap()
            });
        }
        // Softmax with a key-padding bias, (b, h, t, t).
        let scores = (random(&[3, 2, 17, 17], 2, dtype) * 4.0).unwrap();
        let (_, mask) = padded_batch(3, 17, 10);
        let bias = poslab::nn::key_padding_bias(&mask, dtype).unwrap();
        assert_op_matches("masked softmax", &scores, &|s, b| {
            poslab::nn::masked_softmax(s, &bias, b).unwrap()
        });
        // GELU over a range wide enough to reach both tails.
        let x = (random(&[7, 37], 3, dtype) * 6.0).unwrap();
        assert_op_matches("gelu", &x, &|x, b| poslab::nn::gelu(x, b).unwrap());
        // log sigmoid (FoX's gates), both tails.
        let z = (random(&[5, 41], 10, dtype) * 30.0).unwrap();
        assert_op_matches("log sigmoid", &z, &|z, b| {
            poslab::nn::log_sigmoid(z, b).unwrap()
        });
        // LayerNorm with non-trivial weight and bias.
        let x = random(&[4, 5, 40], 4, dtype).affine(3.0, 0.5).unwrap();
        let ln_params = ParamStore::new(5);
        let ln =
            poslab::nn::layer_norm(40, 1e-5, ln_params.var_builder(dtype, &Device::Cpu)).unwrap();
        assert_op_matches("layer norm", &x, &|x, b| ln.forward(x, b).unwrap());
        // Linear, with and without a bias.
        let x = random(&[3, 7, 24], 6, dtype);
        let w = random(&[18, 24], 7, dtype);
        let b = random(&[18], 8, dtype);
        for bias in [Some(b.clone()), None] {
            let lin = poslab::nn::Linear::new(w.clone(), bias.clone());
            assert_op_matches(&format!("linear bias={}", bias.is_some()), &x, &|x, b| {
                lin.forward(x, b).unwrap()
            });
        }
    }
}

#[test]
fn the_fused_channel_mlp_matches_its_composition_forward_and_backward() {
    // DAPE's x + y + MLP([x; y]) over the channels of every pair: 150 positions (two full
    // blocks of 64 and a part), 3 channels in each of x and y, width 7, inputs spread over
    // both sides of the LeakyReLU; y one block per block of x and one for all (its gradient
    // then summed over the blocks); the output and the gradients of x, y and every weight.
    for dtype in [DType::F32, DType::F64] {
        let tol = tolerance(dtype);
        for y_blocks in [2, 1] {
            let vars = [
                random(&[2, 3, 150], 20, dtype).affine(3.0, 0.0).unwrap(),
                random(&[y_blocks, 3, 150], 25, dtype)
                    .affine(3.0, 0.0)
                    .unwrap(),
                random(&[7, 6], 21, dtype),
                random(&[7], 22, dtype),
                random(&[3, 7], 23, dtype),
            ]
            .map(|t| candle::Var::from_tensor(&t).unwrap());
            let r = random(&[2, 3, 150], 24, dtype);
            let run = |kernels: Kernels| -> (Vec<f64>, Vec<Vec<f64>>) {
                let [x, y, w1, c1, w2] = &vars;
                let weights = (w1.as_tensor(), c1.as_tensor(), w2.as_tensor());
                let out = poslab::nn::channel_mlp(x, y, weights, 0.01, on(kernels)).unwrap();
                let grads = out.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
                let g = vars
                    .iter()
                    .map(|v| values(grads.get(v.as_tensor()).unwrap()))
                    .collect();
                (values(&out), g)
            };
            let (out_ref, g_ref) = run(Kernels::Reference);
            let (out, g) = run(Kernels::Ops);
            let err = relative_error(&out, &out_ref);
            assert!(err <= tol, "{dtype:?} y x{y_blocks} forward: {err:e}");
            let names = ["x", "y", "w1", "c1", "w2"];
            for (name, (g, r)) in names.iter().zip(g.iter().zip(&g_ref)) {
                let err = relative_error(g, r);
                assert!(err <= tol, "{dtype:?} y x{y_blocks} d{name}: {err:e}");
                assert!(r.iter().any(|v| v.abs() > 1e-3), "d{name} is zero");
            }
            // Both sides of the activation were in play: W1 [x; y] + c1 takes both signs.
            let u = Tensor::cat(
                &[
                    vars[0].as_tensor(),
                    &vars[1].broadcast_as((2, 3, 150)).unwrap(),
                ],
                1,
            )
            .unwrap();
            let pre = vars[2]
                .broadcast_matmul(&u)
                .unwrap()
                .broadcast_add(&vars[3].reshape((1, 7, 1)).unwrap())
                .unwrap();
            let pre = values(&pre);
            assert!(pre.iter().any(|v| *v > 0.5) && pre.iter().any(|v| *v < -0.5));
        }
    }
}

#[test]
fn fused_f32_gelu_and_its_derivative_are_within_3e7_of_the_exact_values() {
    // The f32 kernel uses Abramowitz & Stegun's erf (absolute error 1.5e-7) and a polynomial
    // exp; the exact values come from f64 erf. Bounds: GELU 2e-7 relative to max(1, |x|),
    // its derivative 3e-7 absolute (erf's error plus the rounding of values near 1.1).
    let xs: Vec<f32> = (-4000..=4000).map(|i| i as f32 * 0.0025).collect();
    let x = Tensor::from_vec(xs.clone(), xs.len(), &Device::Cpu).unwrap();
    let (y, g) = {
        let var = Var::from_tensor(&x).unwrap();
        let y = poslab::nn::gelu(var.as_tensor(), on(Kernels::Ops)).unwrap();
        let grads = y.sum_all().unwrap().backward().unwrap();
        (values(&y), values(grads.get(var.as_tensor()).unwrap()))
    };
    let mut worst = (0.0f64, 0.0f64);
    for (i, &x) in xs.iter().enumerate() {
        let x = f64::from(x);
        let cdf = 0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2));
        let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
        let (ey, eg) = ((y[i] - x * cdf).abs(), (g[i] - (cdf + x * pdf)).abs());
        worst = (worst.0.max(ey / x.abs().max(1.0)), worst.1.max(eg));
    }
    eprintln!(
        "f32 GELU vs exact: value {:.2e}, derivative {:.2e}",
        worst.0, worst.1
    );
    assert!(worst.0 < 2e-7, "GELU error {:e}", worst.0);
    assert!(worst.1 < 3e-7, "GELU derivative error {:e}", worst.1);
}

#[test]
fn fused_f32_log_sigmoid_and_its_derivative_are_within_3e7_relative_of_the_exact_values() {
    // The f32 kernel uses a polynomial exp and ln (each about 1 ulp) and ln(1 + u) corrected
    // for the rounding of 1 + u; the exact values come from f64. Relative bounds, since FoX's
    // gates live near 0 (log sigmoid(5) = -0.0067) and in the far tail the value is e^z.
    let mut zs: Vec<f32> = (-8000..=8000).map(|i| i as f32 * 0.005).collect();
    zs.extend([-80.0, -30.0, 30.0, 80.0, 0.0, -0.0, 1e-6, -1e-6]);
    let z = Tensor::from_vec(zs.clone(), zs.len(), &Device::Cpu).unwrap();
    let (y, g) = {
        let var = Var::from_tensor(&z).unwrap();
        let y = poslab::nn::log_sigmoid(var.as_tensor(), on(Kernels::Ops)).unwrap();
        let grads = y.sum_all().unwrap().backward().unwrap();
        (values(&y), values(grads.get(var.as_tensor()).unwrap()))
    };
    let mut worst = (0.0f64, 0.0f64);
    for (i, &z) in zs.iter().enumerate() {
        let z = f64::from(z);
        let exact = if z >= 0.0 {
            -(-z).exp().ln_1p()
        } else {
            z - z.exp().ln_1p()
        };
        let slope = 1.0 / (1.0 + z.exp());
        assert!(y[i] <= 0.0, "log sigmoid({z}) = {} > 0", y[i]);
        let (ey, eg) = (
            (y[i] - exact).abs() / exact.abs(),
            (g[i] - slope).abs() / slope.max(f64::MIN_POSITIVE),
        );
        worst = (
            worst.0.max(ey),
            worst.1.max(if slope > 1e-30 { eg } else { 0.0 }),
        );
    }
    eprintln!(
        "f32 log sigmoid vs exact, relative: value {:.2e}, derivative {:.2e}",
        worst.0, worst.1
    );
    assert!(worst.0 < 3e-7, "log sigmoid error {:e}", worst.0);
    assert!(worst.1 < 3e-7, "log sigmoid derivative error {:e}", worst.1);
}

#[test]
fn every_instruction_set_level_gives_the_same_bits() {
    // The kernels are compiled for AVX-512, for AVX2 + FMA and for the baseline target, chosen
    // at run time: a machine without AVX-512 runs the other two. Capping the level here runs
    // them on this machine; all must agree to the bit (and so with the reference, tested above).
    use poslab::nn::{simd_dispatches, SimdLevel};
    let detected = SimdLevel::detected();
    let levels: Vec<SimdLevel> = [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512]
        .into_iter()
        .filter(|l| *l <= detected)
        .collect();
    eprintln!("instruction set levels run: {levels:?}");
    let configs = [
        wide_config(
            poslab::PositionalConfig::Rope(poslab::RopeOptions::default()),
            NormPlacement::Pre,
        ),
        medium_config(
            poslab::PositionalConfig::SinusoidalAdd(Default::default()),
            NormPlacement::Post,
        ),
        // FoX: its gates (log sigmoid) and its bias built from running sums in the attention.
        medium_config(
            poslab::PositionalConfig::Fox(Default::default()),
            NormPlacement::Pre,
        ),
    ];
    for (i, config) in configs.iter().enumerate() {
        let mut runs = Vec::new();
        for &level in &levels {
            let batch = if i == 0 { WIDE_BATCH } else { (5, 13) };
            let before = simd_dispatches()[level as usize];
            let backend = on(Kernels::Layer).with_simd(level);
            let run = run_encoder_on(config, DType::F32, backend, true, batch);
            // The level reached the kernels (forward and backward).
            assert!(simd_dispatches()[level as usize] > before, "{level:?}");
            runs.push((level, run));
        }
        let (first_level, first) = &runs[0];
        for (level, run) in &runs[1..] {
            assert_eq!(run.hidden, first.hidden, "{level:?} vs {first_level:?}");
            for ((name, a), (_, b)) in run.grads.iter().zip(&first.grads) {
                assert_eq!(a, b, "{level:?} vs {first_level:?}: `{name}`");
            }
        }
    }
}

#[test]
fn an_encoder_computes_with_its_own_backend() {
    // The backend is a value the encoder is built with: its SIMD level reaches every kernel of
    // its forward pass and of the backward pass after it, outside any scope.
    use poslab::nn::{simd_dispatches, Backend, SimdLevel};
    let config = medium_config(
        poslab::PositionalConfig::Rope(poslab::RopeOptions::default()),
        NormPlacement::Pre,
    );
    let store = ParamStore::new(7);
    let level = SimdLevel::Baseline;
    let backend = Backend::default().with_simd(level);
    let encoder = Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu))
        .unwrap()
        .with_backend(backend);
    assert_eq!(encoder.backend(), backend);
    let (ids, mask) = padded_batch(3, 9, config.vocab_size as u32);
    let before = simd_dispatches()[level as usize];
    let hidden = encoder.forward_t(&ids, &mask, false).unwrap();
    let forward = simd_dispatches()[level as usize];
    assert!(
        forward > before,
        "the forward pass ran no kernel at {level:?}"
    );
    hidden.sum_all().unwrap().backward().unwrap();
    assert!(
        simd_dispatches()[level as usize] > forward,
        "the backward pass ran no kernel at {level:?}"
    );
    // The same bits as at the machine's own level.
    let native = Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
    assert_eq!(native.backend().simd, SimdLevel::detected());
    let again = native.forward_t(&ids, &mask, false).unwrap();
    assert_eq!(values(&hidden), values(&again));
}

#[test]
fn embedding_extras_match_the_reference() {
    use poslab::PositionalConfig as P;
    for norm in [NormPlacement::Pre, NormPlacement::Post] {
        let mut config = medium_config(P::Learned(Default::default()), norm);
        config.embeddings = poslab::config::EmbeddingExtras {
            token_types: 2,
            norm: true,
            first_position: 2,
        };
        for dtype in [DType::F32, DType::F64] {
            let reference = run_encoder(&config, dtype, on(Kernels::Reference), false);
            for kernels in [Kernels::Ops, Kernels::Layer] {
                let what = format!("embedding extras {norm:?} {dtype:?} {}", kernels.name());
                let fast = run_encoder(&config, dtype, on(kernels), false);
                compare(&fast, &reference, tolerance(dtype), &what);
            }
        }
        // The extras change the model: they are not ignored.
        let plain = ModelConfig {
            embeddings: Default::default(),
            ..config.clone()
        };
        let (a, b) = (
            run_encoder(&config, DType::F64, on(Kernels::Layer), false),
            run_encoder(&plain, DType::F64, on(Kernels::Layer), false),
        );
        assert!(relative_error(&a.hidden, &b.hidden) > 1e-3);
    }
}

/// Sliding windows (`[layers]` local entries) and causal masks in the fused kernels, applied
/// in place, match the composition's materialised window bias, forward and backward, for a
/// scheme of each place, with position-free layers among them.
#[test]
fn local_windows_match_the_reference() {
    use poslab::{LayerKind, LayerPlan};
    let plan = LayerPlan {
        local_window: Some(4),
        ..LayerPlan::new(vec![
            LayerKind::Local,
            LayerKind::Global,
            LayerKind::LocalNone,
        ])
    };
    for (name, causal) in ["rope", "alibi", "kerple", "fox", "none"]
        .into_iter()
        .flat_map(|n| [(n, false), (n, true)])
    {
        let positional = all_schemes()
            .into_iter()
            .find(|p| p.name() == name)
            .unwrap();
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            for dropout in [0.0, 0.2] {
                // Causal too: a local layer's window and the mask together, and the global
                // layer's products in bands (only the keys at or before each query).
                let mut config = ModelConfig {
                    n_layers: 3,
                    ..medium_config(positional.clone(), norm)
                }
                .with_layer_plan(plan.clone())
                .with_causal(causal);
                config.dropout = dropout;
                config.attention_dropout = dropout;
                for dtype in [DType::F32, DType::F64] {
                    let train = dropout > 0.0;
                    let reference = run_encoder(&config, dtype, on(Kernels::Reference), train);
                    for kernels in [Kernels::Ops, Kernels::Layer] {
                        let what = format!(
                            "{name} causal {causal} {norm:?} dropout {dropout} {dtype:?} {}",
                            kernels.name()
                        );
                        let fast = run_encoder(&config, dtype, on(kernels), train);
                        compare(&fast, &reference, tolerance(dtype), &what);
                    }
                    for kernels in [Kernels::Ops, Kernels::Layer] {
                        let (gpu, _) =
                            with_op_calls(|| run_encoder(&config, dtype, on(kernels), train));
                        let what = format!("{name} gpu {}", kernels.name());
                        compare(&gpu, &reference, tolerance(dtype), &what);
                    }
                }
            }
        }
    }
}

/// ModernBERT's block options (no biases, GeGLU, no attention norm in layer 0): the fused
/// kernels (the layer kernel with zero biases where it applies, the fused ops elsewhere) match
/// the composition, forward and backward.
#[test]
fn blocks_without_biases_with_geglu_and_no_first_norm_match_the_reference() {
    use poslab::{Activation, LayerKind, LayerPlan};
    let windows = LayerPlan {
        local_window: Some(4),
        ..LayerPlan::new(vec![LayerKind::Global, LayerKind::Local])
    };
    for name in ["rope", "alibi", "sinusoidal_add"] {
        let positional = all_schemes()
            .into_iter()
            .find(|p| p.name() == name)
            .unwrap();
        for (activation, first_attn_norm) in [
            (Activation::Gelu, true),
            (Activation::Geglu, true),
            (Activation::Gelu, false),
            (Activation::Geglu, false),
        ] {
            for dropout in [0.0, 0.2] {
                let mut config = ModelConfig {
                    bias: false,
                    activation,
                    first_attn_norm,
                    dropout,
                    attention_dropout: dropout,
                    embeddings: poslab::EmbeddingExtras {
                        norm: true,
                        ..Default::default()
                    },
                    ..medium_config(positional.clone(), NormPlacement::Pre)
                };
                if name != "sinusoidal_add" {
                    config = config.with_layer_plan(windows.clone());
                }
                for dtype in [DType::F32, DType::F64] {
                    let train = dropout > 0.0;
                    let reference = run_encoder(&config, dtype, on(Kernels::Reference), train);
                    assert!(
                        reference.grads.iter().all(|(n, _)| !n.ends_with(".bias")),
                        "{name}: a bias variable exists without biases"
                    );
                    for kernels in [Kernels::Ops, Kernels::Layer] {
                        let what = format!(
                            "{name} {activation:?} first_attn_norm {first_attn_norm} dropout \
                             {dropout} {dtype:?} {}",
                            kernels.name()
                        );
                        let fast = run_encoder(&config, dtype, on(kernels), train);
                        compare(&fast, &reference, tolerance(dtype), &what);
                    }
                    // The device path: its layer where it applies, the one-kernel ops elsewhere.
                    let (device, _) =
                        with_op_calls(|| run_encoder(&config, dtype, twin(Kernels::Layer), train));
                    let reference = run_encoder(&config, dtype, seeded_reference(), train);
                    let what = format!("{name} {activation:?} {first_attn_norm} {dtype:?} device");
                    compare(&device, &reference, tolerance(dtype), &what);
                }
            }
        }
    }
}

#[test]
fn a_pool_of_its_own_gives_the_same_bits_at_any_width() {
    // nn::with_threads runs a job on a rayon pool of its own: the kernels split their work over
    // it, and the results (forward and every gradient) do not depend on its width, nor on
    // whether the caller was outside any pool. A batch big enough that the kernels and gemm do
    // split (gemm at 2^18 multiply-adds, the fused loops by chunks).
    use poslab::nn::with_threads;
    let config = medium_config(
        poslab::PositionalConfig::Rope(poslab::RopeOptions::default()),
        NormPlacement::Pre,
    );
    let store = ParamStore::new(11);
    let encoder = Encoder::new(&config, store.var_builder(DType::F32, &Device::Cpu)).unwrap();
    let (ids, mask) = padded_batch(16, 33, config.vocab_size as u32);
    let run = || {
        let hidden = encoder.forward_t(&ids, &mask, false).unwrap();
        let grads = hidden.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let mut bits = values(&hidden);
        for (_, var) in store.vars() {
            bits.extend(values(grads.get(var.as_tensor()).expect("a gradient")));
        }
        bits
    };
    let outside = run();
    assert!(outside.iter().any(|v| *v != 0.0));
    for threads in [1, 2, 3] {
        let inside = with_threads(threads, run);
        assert!(
            outside
                .iter()
                .zip(&inside)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{threads} threads"
        );
    }
}

/// Packing each layer's parameters into one variable (what training does, so that the fused
/// layer reads them whole and its gradient lands in one place) changes no number: for every
/// scheme, both norm placements, with and without biases (whose missing parts are packed as
/// zeros), with dropout (attention dropout pre-norm), under every kernels and on the device
/// path (its CPU twin), the hidden states and every named parameter's gradient are the
/// unpacked encoder's, bit for bit. On the device path every layer then goes into one variable and the layers run as one node
/// (`encoder_stack`), for every scheme but those that score by their own function (they keep
/// a variable a layer): the stack gives the separate layers' bits too, over three layers (its
/// backward passes the input gradient through two buffers in turn) and, where the scheme takes
/// one, a plan of a global, a local and a position-free layer.
#[test]
fn packed_layers_give_the_unpacked_bits_under_every_kernels_and_the_device_path() {
    let own_scores = [
        "pope",
        "cope",
        "path",
        "stick_breaking",
        "grape_m",
        "grape_a",
    ];
    let (mut stacked, mut plans) = (0, 0);
    for positional in all_schemes() {
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            for bias in [true, false] {
                let mut on_cpu = 0;
                let mut config = tiny_config(positional.clone(), norm);
                config.bias = bias;
                config.dropout = 0.1;
                // Post-norm without attention dropout: the device path's fused attention, which
                // reads a bias by offset as it is.
                config.attention_dropout = match norm {
                    NormPlacement::Pre => 0.1,
                    NormPlacement::Post => 0.0,
                };
                config.n_layers = 3;
                if bias {
                    use poslab::LayerKind::{Global, Local, None};
                    let planned = ModelConfig {
                        layers: Some(poslab::LayerPlan {
                            local_window: Some(4),
                            ..poslab::LayerPlan::new(vec![Global, Local, None])
                        }),
                        ..config.clone()
                    };
                    if planned.validate().is_ok() {
                        config = planned;
                        plans += 1;
                    }
                }
                for (kernels, device) in [
                    (Kernels::Reference, false),
                    (Kernels::Ops, false),
                    (Kernels::Layer, false),
                    (Kernels::Layer, true),
                ] {
                    let what = format!(
                        "{} {norm:?} bias {bias} {} device {device}",
                        positional.name(),
                        kernels.name()
                    );
                    let backend = match device {
                        false => on(kernels),
                        true => twin(kernels),
                    };
                    let run = |pack: bool| {
                        run_encoder_packed(&config, DType::F32, backend, true, (4, 9), pack)
                    };
                    let ((plain, plain_vars, plain_params), (packed, packed_vars, packed_params)) =
                        (run(false), run(true));
                    assert_eq!(plain_params, packed_params, "{what}: named parameters");
                    // Each layer's variables (8 without biases, 16 with) became one.
                    assert!(
                        packed_vars + 7 * config.n_layers <= plain_vars,
                        "{what}: {packed_vars} variables packed, {plain_vars} not"
                    );
                    match (kernels, device) {
                        (Kernels::Layer, false) => on_cpu = packed_vars,
                        (Kernels::Layer, true) => {
                            // DAPE's MLP over a bias scheme's scores makes it a score function.
                            let dape = format!("{positional:?}").contains("adaptive: Some");
                            let stacks = !own_scores.contains(&positional.name()) && !dape;
                            let fewer = (config.n_layers - 1) * usize::from(stacks);
                            assert_eq!(
                                packed_vars + fewer,
                                on_cpu,
                                "{what}: the layers' variables on the device path (stacked: \
                                 {stacks})"
                            );
                            stacked += usize::from(stacks);
                        }
                        _ => {}
                    }
                    assert_eq!(packed.hidden, plain.hidden, "{what}: hidden states");
                    assert_eq!(packed.grads.len(), plain.grads.len(), "{what}: gradients");
                    for ((name, a), (other, b)) in packed.grads.iter().zip(&plain.grads) {
                        assert_eq!(name, other, "{what}");
                        if name.starts_with("layers.") {
                            assert!(
                                b.iter().any(|g| *g != 0.0),
                                "{what}: `{name}` got no gradient"
                            );
                        }
                        assert_eq!(a, b, "{what}: the gradient of `{name}`");
                    }
                }
            }
        }
    }
    assert!(stacked >= 40, "{stacked} stacked encoders");
    assert!(plans >= 40, "{plans} encoders with a plan");
}

/// How many nodes a training forward's graph has that a variable reaches (what the backward
/// walks: candle's `sorted_nodes`).
fn graph_nodes(config: &ModelConfig, kernels: Kernels) -> usize {
    let store = ParamStore::new(7);
    let encoder = Encoder::new(config, store.var_builder(DType::F32, &Device::Cpu))
        .unwrap()
        .with_backend(on(kernels));
    let (ids, mask) = padded_batch(5, 13, config.vocab_size as u32);
    let hidden = encoder.forward_t(&ids, &mask, true).unwrap();
    hidden.sum_all().unwrap().sorted_nodes().len()
}

#[test]
fn pope_and_cope_layers_run_as_one_fused_node_on_the_cpu() {
    // PoPE's scores are a polar form of q and k, CoPE's gate-counted: the fused attention
    // kernel computes both itself. Under the fused layer a step's graph is then sin_add's plus
    // the scheme's parameters and their few ops (measured at 2 layers, pre-norm: PoPE and CoPE
    // 62 nodes, sin_add 55), where the composition's is several times larger (PoPE 337, CoPE
    // 325). A scheme silently composed of ops fails this.
    use poslab::positional::{CopeOptions, PopeOptions};
    for scheme in [
        PositionalConfig::Pope(PopeOptions::default()),
        PositionalConfig::Cope(CopeOptions::default()),
    ] {
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            let own = tiny_config(scheme.clone(), norm);
            let plain = tiny_config(PositionalConfig::SinusoidalAdd(Default::default()), norm);
            let fused = graph_nodes(&own, Kernels::Layer);
            let baseline = graph_nodes(&plain, Kernels::Layer);
            let composed = graph_nodes(&own, Kernels::Reference);
            let (layers, name) = (own.n_layers, scheme.name());
            eprintln!("{name} {norm:?}: fused {fused}, sin_add {baseline}, composed {composed}");
            assert!(
                fused <= baseline + 5 * layers,
                "{name} {norm:?}: the fused step has {fused} graph nodes, sin_add's {baseline}"
            );
            assert!(
                composed >= 3 * fused,
                "{name} {norm:?}: composed has {composed} graph nodes, fused {fused}"
            );
        }
    }
}

#[test]
fn path_layers_run_as_one_fused_node_that_makes_their_reflections_on_the_cpu() {
    // PaTH's scores are a transport of q and k by reflections made from the attention input.
    // Under the fused layer the layer makes the reflections itself and its attention kernel
    // carries the keys: a step's graph is then sin_add's plus the reflections' weights and
    // their joining to the layer's (measured at 2 layers, conv 3: 72 nodes pre-norm, 69
    // post-norm, sin_add 55 and 52; no conv: 68 and 65). Under `ops` the reflections are one
    // fused node beside their two projections and the attention's, the rest of the layer
    // separate nodes (112 and 109; the layer's count before it took the reflections in);
    // composed, the UT transform's inverses and products are hundreds of nodes a layer (881 and
    // 863). A layer that leaves the reflections outside, or a scheme composed of ops, fails
    // this.
    use poslab::positional::PathOptions;
    for options in [PathOptions::default(), PathOptions { conv_size: 0 }] {
        let scheme = PositionalConfig::Path(options.clone());
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            let own = tiny_config(scheme.clone(), norm);
            let plain = tiny_config(PositionalConfig::SinusoidalAdd(Default::default()), norm);
            let layer = graph_nodes(&own, Kernels::Layer);
            let baseline = graph_nodes(&plain, Kernels::Layer);
            let ops = graph_nodes(&own, Kernels::Ops);
            let composed = graph_nodes(&own, Kernels::Reference);
            let (layers, k) = (own.n_layers, options.conv_size);
            eprintln!(
                "path conv {k} {norm:?}: layer {layer}, sin_add {baseline}, ops {ops}, composed \
                 {composed}"
            );
            assert!(
                layer <= baseline + 10 * layers,
                "path conv {k} {norm:?}: the fused step has {layer} graph nodes, sin_add's \
                 {baseline}"
            );
            assert!(
                ops >= layer + 12 * layers,
                "path conv {k} {norm:?}: under ops {ops} graph nodes, under layer {layer}"
            );
            assert!(
                composed >= 3 * ops,
                "path conv {k} {norm:?}: composed has {composed} graph nodes, ops {ops}"
            );
        }
    }
}

/// The heads [`device_path_heads_give_the_compositions_loss_and_gradients`] checks, each with
/// its kernels on the device path: xent, weighted_sum, xent_back and the fill of the bias
/// gradient's row of ones, then the pooling's two (mean) or the fill of the hidden states'
/// gradient (first token).
pub(crate) fn heads_to_check() -> Vec<(poslab::HeadConfig, usize)> {
    use poslab::{HeadConfig, Pooling};
    vec![
        (
            HeadConfig::Classify {
                classes: 3,
                pooling: Pooling::Mean,
            },
            6,
        ),
        (
            HeadConfig::Classify {
                classes: 4,
                pooling: Pooling::First,
            },
            5,
        ),
        (HeadConfig::Tag { classes: 5 }, 4),
        (HeadConfig::Mlm, 4),
    ]
}

/// A batch of five sequences of 1 to 7 tokens for `head` on `device`: classes, tags with
/// unscored tokens, or masked tokens (half of them, seeded).
pub(crate) fn head_batch(head: &poslab::HeadConfig, device: &Device) -> poslab::data::Batch {
    use poslab::data::{make_batch, MlmMasking, Sample, Target, NOT_SCORED};
    use poslab::HeadConfig;
    let samples: Vec<Sample> = [3usize, 7, 5, 1, 6]
        .iter()
        .enumerate()
        .map(|(i, &n)| Sample {
            ids: (0..n)
                .map(|j| ((2 + 7 * i + 3 * j) % 38 + 2) as u32)
                .collect(),
            target: match head {
                HeadConfig::Classify { classes, .. } => Target::Class((i % classes) as u32),
                HeadConfig::Tag { classes } => Target::Tags(
                    (0..n)
                        .map(|j| match (i + j) % 4 {
                            0 => NOT_SCORED,
                            k => ((j + k) % classes) as i64,
                        })
                        .collect(),
                ),
                HeadConfig::Mlm => Target::Masked,
            },
            tape: None,
        })
        .collect();
    let refs: Vec<&Sample> = samples.iter().collect();
    let masking = MlmMasking {
        mask_prob: 0.5,
        mask_id: 1,
        regular_ids: (2..40).collect(),
    };
    let mut rng = poslab::rng::stream(3, "masks");
    let masks = matches!(head, HeadConfig::Mlm).then_some((&masking, &mut rng));
    let batch = make_batch(&refs, 0, masks, device).unwrap();
    assert!(batch.weights.is_none() || batch.scored > 0);
    batch
}

/// One training step's loss on `batch` and every variable's gradient, by name, through
/// `TaskModel::training_loss` (`fused`) or `TaskModel::loss` (the composition after the
/// encoder), with the device path's operations counted meanwhile.
pub(crate) fn head_step(
    head: &poslab::HeadConfig,
    batch: &poslab::data::Batch,
    dtype: DType,
    device: &Device,
    fused: bool,
    backend: Backend,
) -> (
    f64,
    Vec<(String, Vec<f64>)>,
    poslab::nn::device_path::Counts,
) {
    use poslab::nn::device_path;
    let store = ParamStore::new(5);
    let config = tiny_config(
        PositionalConfig::SinusoidalAdd(Default::default()),
        NormPlacement::Pre,
    );
    let model = poslab::TaskModel::new(&config, head, store.var_builder(dtype, device))
        .unwrap()
        .with_backend(backend);
    let before = device_path::counts();
    let loss = match fused {
        true => model.training_loss(batch).unwrap(),
        false => model.loss(batch, 0, true).unwrap().0,
    };
    assert_eq!(loss.dims(), &[] as &[usize], "{head:?}: a scalar loss");
    let grads = store.gradients(&loss.backward().unwrap()).unwrap();
    assert_eq!(
        grads.len(),
        store.params().len(),
        "{head:?}: every variable"
    );
    let grads = grads.iter().map(|(n, g)| (n.clone(), values(g))).collect();
    (values(&loss)[0], grads, device_path::counts() - before)
}

/// The worst relative error of a loss and its gradients against another's, each asserted
/// within `tol`, and none of the reference's gradients zero.
pub(crate) fn head_error(
    (loss, grads): (f64, &[(String, Vec<f64>)]),
    (ref_loss, ref_grads): (f64, &[(String, Vec<f64>)]),
    tol: f64,
    what: &str,
) -> f64 {
    let mut worst = (loss - ref_loss).abs() / ref_loss.abs();
    assert!(worst <= tol, "{what}: loss {loss} against {ref_loss}");
    assert_eq!(grads.len(), ref_grads.len(), "{what}: variables");
    for ((name, g), (ref_name, r)) in grads.iter().zip(ref_grads) {
        assert_eq!(name, ref_name);
        assert!(
            r.iter().any(|v| *v != 0.0),
            "{what}: `{name}` has no gradient"
        );
        let err = relative_error(g, r);
        assert!(
            err <= tol,
            "{what}: gradient of `{name}` differs by {err:e}"
        );
        worst = worst.max(err);
    }
    worst
}

/// A task head and its loss on the device path (one node, `poslab-kernels/src/gpu/head.rs`, computed by its
/// CPU twin) against the composition of candle ops that `TaskModel::loss` runs on the same
/// encoder: the loss and the gradient of every variable, for each readout (mean and first-token
/// pooling, token tags with unscored tokens, masked-LM), over sequences of different lengths,
/// in f32 and f64, at the fused kernels' tolerances; and that the node ran, by its exact count
/// of kernels and products (the composition's ops are candle's, which the count leaves out).
#[test]
fn device_path_heads_give_the_compositions_loss_and_gradients() {
    let mut worst = [0.0f64; 2];
    for (head, head_kernels) in heads_to_check() {
        let batch = head_batch(&head, &Device::Cpu);
        for (slot, dtype) in [DType::F32, DType::F64].into_iter().enumerate() {
            let what = format!("{head:?} {dtype:?}");
            let twin = twin(Kernels::Layer);
            let (loss, grads, fused) = head_step(&head, &batch, dtype, &Device::Cpu, true, twin);
            let (ref_loss, ref_grads, composed) =
                head_step(&head, &batch, dtype, &Device::Cpu, false, twin);
            assert_eq!(
                (
                    fused.kernels - composed.kernels,
                    fused.gemms - composed.gemms
                ),
                (head_kernels, 4),
                "{what}: the head's kernels and products"
            );
            let err = head_error(
                (loss, &grads),
                (ref_loss, &ref_grads),
                tolerance(dtype),
                &what,
            );
            worst[slot] = worst[slot].max(err);
        }
    }
    eprintln!(
        "device path's head vs the composition, worst relative error: f32 {:.1e}, f64 {:.1e}",
        worst[0], worst[1]
    );
}

/// One LayerNorm's step on `device` with `kernels`: its output and the gradients of its input,
/// weight and bias (of `(y ⊙ r).sum()`, `r` fixed), as f64 values, and the device-path
/// operations it issued. The inputs are rounded to `inputs` first, so that a half run and its
/// f64 reference read the same values.
pub(crate) fn norm_step(
    device: &Device,
    dtype: DType,
    inputs: DType,
    backend: Backend,
) -> (Vec<Vec<f64>>, poslab::nn::device_path::Counts) {
    use candle_nn::{VarBuilder, VarMap};
    let (shape, d) = ([3usize, 7, 40], 40);
    let vm = VarMap::new();
    let ln = poslab::nn::layer_norm(d, 1e-5, VarBuilder::from_varmap(&vm, dtype, device)).unwrap();
    let given = |t: Tensor| {
        t.to_dtype(inputs)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.to_device(device))
            .unwrap()
    };
    {
        let data = vm.data().lock().unwrap();
        data["weight"]
            .set(&given(
                random(&[d], 11, DType::F64).affine(0.5, 1.0).unwrap(),
            ))
            .unwrap();
        data["bias"]
            .set(&given(random(&[d], 12, DType::F64)))
            .unwrap();
    }
    let x = Var::from_tensor(&given(
        random(&shape, 13, DType::F64).affine(3.0, 0.5).unwrap(),
    ))
    .unwrap();
    let r = given(random(&shape, 14, DType::F64));
    let before = poslab::nn::device_path::counts();
    let out = {
        let y = ln.forward(x.as_tensor(), backend).unwrap();
        let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let grad = |t: &Tensor| values(grads.get(t).expect("a gradient"));
        vec![
            values(&y),
            grad(x.as_tensor()),
            grad(ln.weight()),
            grad(ln.bias()),
        ]
    };
    (out, poslab::nn::device_path::counts() - before)
}

/// The largest relative error of [`norm_step`]'s four results against a reference's, each
/// asserted under `tol`.
pub(crate) fn norm_error(a: &[Vec<f64>], b: &[Vec<f64>], tol: f64, what: &str) -> f64 {
    let mut worst = 0.0f64;
    for (part, (a, b)) in ["output", "dx", "dweight", "dbias"]
        .iter()
        .zip(a.iter().zip(b))
    {
        let err = relative_error(a, b);
        assert!(
            err < tol,
            "{what} {part}: relative error {err:e} (bar {tol:e})"
        );
        worst = worst.max(err);
    }
    worst
}

/// A LayerNorm outside the encoder layers (the pre-norm encoder's final norm) runs as one node
/// on the device path (`poslab-kernels/src/gpu/norm.rs`): its output and the gradients of its input,
/// weight and bias are the composition's (`Kernels::Reference`) in f32 and f64 at the fused
/// kernels' tolerances, and in bf16 and f16 within the half precisions' bars of the f64
/// composition of the same rounded inputs; its forward is one kernel, its backward two and one
/// product.
#[test]
fn device_path_layer_norm_gives_the_compositions_values_and_gradients() {
    let cpu = &Device::Cpu;
    for (dtype, tol) in [
        (DType::F32, TOL_F32),
        (DType::F64, TOL_F64),
        (DType::BF16, crate::precision::BF16_TOL),
        (DType::F16, crate::precision::F16_TOL),
    ] {
        let (node, counts) = norm_step(cpu, dtype, dtype, twin(Kernels::Layer));
        assert_eq!(
            (counts.kernels, counts.gemms, counts.copies),
            (3, 1, 0),
            "{dtype:?}: the node's kernels, products and copies"
        );
        let reference = match dtype {
            DType::F32 | DType::F64 => norm_step(cpu, dtype, dtype, on(Kernels::Reference)).0,
            _ => norm_step(cpu, DType::F64, dtype, on(Kernels::Reference)).0,
        };
        let what = format!("device path's LayerNorm {dtype:?}");
        let err = norm_error(&node, &reference, tol, &what);
        eprintln!("{what}: worst relative error {err:.1e}");
    }
}

/// A second backward of one head node finds its kept logits spent and runs the forward again
/// (with the bias the backward is given): every gradient is the first backward's, bit for bit,
/// for every head.
#[test]
fn a_second_backward_of_the_head_node_recomputes_its_forward_to_the_same_bits() {
    for (head, _) in heads_to_check() {
        let batch = head_batch(&head, &Device::Cpu);
        let store = ParamStore::new(5);
        let config = tiny_config(
            PositionalConfig::SinusoidalAdd(Default::default()),
            NormPlacement::Pre,
        );
        let model =
            poslab::TaskModel::new(&config, &head, store.var_builder(DType::F32, &Device::Cpu))
                .unwrap()
                .with_backend(twin(Kernels::Layer));
        let (first, second) = {
            let loss = model.training_loss(&batch).unwrap();
            let grads = |g: &candle::backprop::GradStore| -> Vec<(String, Vec<f64>)> {
                let named = store.gradients(g).unwrap();
                named.iter().map(|(n, g)| (n.clone(), values(g))).collect()
            };
            (
                grads(&loss.backward().unwrap()),
                grads(&loss.backward().unwrap()),
            )
        };
        assert_eq!(
            first.len(),
            store.params().len(),
            "{head:?}: every variable"
        );
        assert_eq!(first, second, "{head:?}: the second backward's gradients");
    }
}

/// `Learner`, the library's training loop, takes the head node on the device path as `train`
/// does: on the twin its step makes the node's four products beyond what the composition's
/// step makes, and its losses over three steps stay within f32's bar of the plain CPU's (the
/// fused CPU layers and the composed head), for every head.
#[test]
fn the_learner_takes_the_head_node_on_the_device_path() {
    use poslab::nn::device_path;
    use poslab::Learner;
    let config = tiny_config(
        PositionalConfig::SinusoidalAdd(Default::default()),
        NormPlacement::Pre,
    );
    for (head, _) in heads_to_check() {
        let batch = head_batch(&head, &Device::Cpu);
        let losses = |on_device_path: bool| -> Vec<f64> {
            let backend = match on_device_path {
                true => twin(Kernels::Layer),
                false => on(Kernels::Layer),
            };
            let mut learner = Learner::new(&config, &head, 3, &Device::Cpu)
                .unwrap()
                .with_backend(backend);
            (0..3)
                .map(|_| {
                    learner
                        .step(&batch.ids, &batch.mask, &batch.targets)
                        .unwrap()
                })
                .collect()
        };
        let (on_twin, on_cpu) = (losses(true), losses(false));
        for (step, (a, b)) in on_twin.iter().zip(&on_cpu).enumerate() {
            assert!(
                (a - b).abs() <= TOL_F32 * b.abs(),
                "{head:?} step {step}: loss {a} on the twin, {b} on the CPU"
            );
        }
        let mut learner = Learner::new(&config, &head, 3, &Device::Cpu)
            .unwrap()
            .with_backend(twin(Kernels::Layer));
        let (composed, stepped) = {
            let before = device_path::counts();
            let loss = learner.model().loss(&batch, 0, true).unwrap().0;
            loss.backward().unwrap();
            let between = device_path::counts();
            learner
                .step(&batch.ids, &batch.mask, &batch.targets)
                .unwrap();
            (between - before, device_path::counts() - between)
        };
        assert_eq!(
            stepped.gemms - composed.gemms,
            4,
            "{head:?}: the head node's products in the learner's step"
        );
    }
}
