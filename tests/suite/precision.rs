//! Mixed precision (`dtype = "bf16" | "f16"`): activations in a half type, parameters, tables,
//! softmax and LayerNorm statistics in f32. Half precision is for CUDA, but the same code runs
//! on the CPU (candle's generic kernels), so its numbers are checked here against the float64
//! reference.

use candle::{DType, Device};
use poslab::{NormPlacement, Precision};

use crate::common::*;

/// Worst error at real positions against the float64 reference over the encoder fixtures,
/// measured (CPU, candle 0.11): bf16 3.2e-2, f16 4.8e-3. A half type keeps 8 (bf16) or 11
/// (f16) significant bits, about 4e-3 and 5e-4 relative per rounding, and the hidden states,
/// LayerNorm outputs, are of order 1.
pub const BF16_TOL: f64 = 6e-2;
pub const F16_TOL: f64 = 1e-2;

/// Runs `f` as the CPU computes (`false`), or as CUDA does (`true`: the device path's layers,
/// by their CPU twin), checking that the device path then ran where its layers can (a scheme
/// that computes its own scores runs as a composition on every device).
fn on_path<R>(
    device: bool,
    positional: &poslab::PositionalConfig,
    what: &str,
    f: impl FnOnce(poslab::nn::Backend) -> R,
) -> R {
    let composed = matches!(
        positional.placement(),
        poslab::Placement::Scores | poslab::Placement::Weights
    );
    if !device {
        return f(poslab::nn::Backend::default());
    }
    let before = poslab::nn::device_path::counts().launches();
    let out = f(twin(poslab::nn::Kernels::Layer));
    let ran = poslab::nn::device_path::counts().launches() - before;
    assert!(composed || ran > 0, "{what}: the device path did not run");
    out
}

#[test]
fn half_precision_encoders_track_the_float64_reference() {
    for (name, device) in encoder_fixture_names()
        .into_iter()
        .flat_map(|n| [(n.clone(), false), (n, true)])
    {
        for (precision, tol) in [(Precision::Bf16, BF16_TOL), (Precision::F16, F16_TOL)] {
            let mut fx = load_encoder_fixture(&name);
            fx.config.dtype = precision;
            let what = format!("{name} {precision} device path {device}");
            let (mut encoder, _) = fx.encoder(DType::F32);
            let hidden = on_path(device, &fx.config.positional, &what, |backend| {
                encoder.set_backend(backend);
                fx.hidden(&encoder)
            });
            let name = &what;
            // The output is handed back in the parameters' dtype, for f32 pooling and loss.
            assert_eq!(hidden.dtype(), DType::F32, "{name} {precision}");
            let err = max_abs_diff_real(&hidden, &fx.expected, &fx.attention_mask);
            eprintln!("{name} {precision}: max abs error at real positions {err:.2e}");
            assert!(err <= tol, "{name} {precision}: error {err:e} > {tol:e}");
            // And it really computed in half precision: f32 is within 1e-4 (usually ~1e-6).
            assert!(
                err > 1e-4,
                "{name} {precision}: error {err:e} is f32's; were activations cast?"
            );
        }
    }
}

/// Each variable's f32 gradient norm without attention dropout, by name. A dropout mask can
/// leave a gradient that sums many terms far smaller than they are (FIRE's `c` once 0.0008
/// where it is 0.10 without, a GRAPE-M frequency a quarter of its size), while its
/// half-precision error is the rounding of those terms, the same with dropout or without
/// (FIRE's `c`: 6.6e-4 in bf16 against 5.6e-4). Each gradient is held relative to the larger
/// of its own norm and this.
fn undropped_norms(
    config: &poslab::ModelConfig,
    what: &str,
) -> std::collections::HashMap<String, f64> {
    let config = poslab::ModelConfig {
        attention_dropout: 0.0,
        dtype: Precision::F32,
        ..config.clone()
    };
    training_gradients_on(&config, &Device::Cpu, what, poslab::nn::Backend::default())
        .into_iter()
        .map(|(name, _, g)| (name, g.iter().map(|v| v * v).sum::<f64>().sqrt()))
        .collect()
}

/// Every scheme, both norm placements, in bf16 and f16, on the CPU's path and the device path's
/// twin, with dropout (0.1 everywhere; dropout seed 5): every variable gets a gradient within
/// the half types' bars of f32's, relative to the larger of its norm and its norm without
/// attention dropout ([`undropped_norms`]). The device path draws its attention dropout from a
/// seed, and is held to an f32 reference that draws the same.
///
/// The bars hold these draws. Over eight dropout seeds the sums over cancelling rows (DAPE's
/// and FIRE's biases, the key bias) passed them on some draws and not on others, on either
/// path (up to 1.3 in bf16 and 0.44 in f16): a relative error of a sum that cancels measures
/// the draw as much as the arithmetic.
#[test]
fn half_precision_gradients_reach_every_variable_and_match_f32() {
    let mut worst = [0.0f64; 2];
    for positional in all_schemes() {
        for norm in [NormPlacement::Pre, NormPlacement::Post] {
            let config = tiny_dropout_config(positional.clone(), norm);
            // Every variable gets a finite, non-zero gradient in its own dtype (f32).
            let gradients = |precision: Precision, backend, attention_dropout| {
                let config = poslab::ModelConfig {
                    dtype: precision,
                    attention_dropout,
                    ..config.clone()
                };
                let what = format!("{} {norm:?} {precision}", positional.name());
                training_gradients_on(&config, &Device::Cpu, &what, backend)
            };
            let p = config.attention_dropout;
            let reference = gradients(Precision::F32, poslab::nn::Backend::default(), p);
            let seeded = poslab::nn::Backend::default().with_seeded_attention_dropout();
            let seeded_reference = gradients(Precision::F32, seeded, p);
            let floors = undropped_norms(&config, positional.name());
            let both = [Precision::Bf16, Precision::F16];
            for (slot, (precision, device)) in both
                .into_iter()
                .flat_map(|p| [(p, false), (p, true)])
                .enumerate()
            {
                let slot = slot / 2;
                let what = format!(
                    "{} {norm:?} {precision} device path {device}",
                    positional.name()
                );
                let tol = if precision == Precision::Bf16 {
                    0.1
                } else {
                    0.02
                };
                let reference = match device {
                    true => &seeded_reference,
                    false => &reference,
                };
                let half = on_path(device, &positional, &what, |b| gradients(precision, b, p));
                let dape = reference.iter().any(|(n, _, _)| n.contains(".dape."));
                for ((name, _, g), (_, _, g32)) in half.iter().zip(reference) {
                    // The cancellation shows the half-precision scores' rounding 2.5x more; under
                    // DAPE's MLP, nearly linear over the pairs at initialisation, 4x (measured at
                    // most 0.27 in bf16 and 0.076 in f16, FIRE's and DAPE's biases), and 8x in
                    // f16 (the device path's draw: 0.12, KERPLE's second layer); KERPLE's r1 and
                    // r2 4x, as below.
                    let cancelling = dape && sums_cancelling_rows(name, dape);
                    let tol = if cancelling && precision == Precision::F16 {
                        8.0 * tol
                    } else if cancelling || name.contains(".kerple.") {
                        4.0 * tol
                    } else if sums_cancelling_rows(name, dape) {
                        2.5 * tol
                    } else {
                        tol
                    };
                    let rel = assert_relative_l2_of(&what, name, g, g32, tol, floors[name]);
                    worst[slot] = worst[slot].max(rel);
                }
            }
        }
    }
    eprintln!(
        "gradients against f32: worst relative L2 error bf16 {:.2e}, f16 {:.2e}",
        worst[0], worst[1]
    );
}

/// The device path's fused attention in half precision, without attention dropout and with it
/// (drawn in the tile loop from a seed; the f32 reference draws the same): every scheme it takes
/// trains on the twin with every variable's gradient within the half types' bars of f32's
/// (relative L2: bf16 0.1, f16 0.02; 2.5x for the sums over cancelling rows, as above, and 4x
/// for KERPLE's), as on the CPU.
#[test]
fn half_precision_fused_attention_gradients_match_f32() {
    use poslab::PositionalConfig as P;
    let mut worst = [0.0f64; 2];
    for (positional, attention_dropout) in [
        P::SinusoidalAdd(Default::default()),
        P::Rope(Default::default()),
        P::Alibi(Default::default()),
        P::T5(Default::default()),
        P::Kerple(Default::default()),
        P::Fire(Default::default()),
        P::Fox(Default::default()),
    ]
    .into_iter()
    .flat_map(|p| [(p.clone(), 0.0), (p, 0.1)])
    {
        let config = poslab::ModelConfig {
            attention_dropout,
            ..tiny_dropout_config(positional.clone(), NormPlacement::Pre)
        };
        let floors = undropped_norms(&config, positional.name());
        let gradients = |precision: Precision, backend| {
            let config = poslab::ModelConfig {
                dtype: precision,
                ..config.clone()
            };
            let what = format!("{} {precision} fused", positional.name());
            training_gradients_on(&config, &Device::Cpu, &what, backend)
        };
        let seeded = poslab::nn::Backend::default().with_seeded_attention_dropout();
        let reference = gradients(Precision::F32, seeded);
        for (slot, (precision, tol)) in [(Precision::Bf16, 0.1), (Precision::F16, 0.02)]
            .into_iter()
            .enumerate()
        {
            let what = format!(
                "{} {precision} fused device path, attention dropout {attention_dropout}",
                positional.name()
            );
            let half = on_path(true, &positional, &what, |b| gradients(precision, b));
            for ((name, _, g), (_, _, g32)) in half.iter().zip(&reference) {
                // KERPLE's r1 and r2 shape a bias every pair shares, as FIRE's module does: their
                // gradients sum dS over rows that sum to zero, 4x (the second layer's r2,
                // measured: bf16 0.36 on the CPU's kernels and 0.23 fused, f16 0.058 and 0.053).
                let tol = match (sums_cancelling_rows(name, false), name.contains(".kerple.")) {
                    (_, true) => 4.0 * tol,
                    (true, false) => 2.5 * tol,
                    (false, false) => tol,
                };
                let rel = assert_relative_l2_of(&what, name, g, g32, tol, floors[name]);
                worst[slot] = worst[slot].max(rel);
            }
        }
    }
    eprintln!(
        "fused attention's gradients against f32: worst relative L2 error bf16 {:.2e}, f16 {:.2e}",
        worst[0], worst[1]
    );
}

#[test]
fn precision_names_parse_and_bad_ones_say_what_is_allowed() {
    for (text, p) in [
        ("f32", Precision::F32),
        ("bf16", Precision::Bf16),
        ("BF16", Precision::Bf16),
        ("f16", Precision::F16),
        ("half", Precision::F16),
    ] {
        assert_eq!(text.parse::<Precision>().unwrap(), p);
    }
    assert_error_mentions("fp8".parse::<Precision>(), &["fp8", "f32, bf16, f16"]);

    let base =
        "vocab_size = 10\nd_model = 8\nn_heads = 2\nn_layers = 1\nffn_dim = 16\nmax_len = 8\n";
    let config = poslab::ModelConfig::from_toml_str(&format!(
        "{base}dtype = \"bf16\"\n[positional]\nkind = \"rope\"\n"
    ))
    .unwrap();
    assert_eq!(config.dtype, Precision::Bf16);
    // Saved with the run and read back.
    let back = poslab::ModelConfig::from_json_str(&config.to_json()).unwrap();
    assert_eq!(back, config);
    // Absent means f32, so configs written before the option still load.
    let old = poslab::ModelConfig::from_toml_str(&format!("{base}[positional]\nkind = \"none\"\n"))
        .unwrap();
    assert_eq!(old.dtype, Precision::F32);
    assert_error_mentions(
        poslab::ModelConfig::from_toml_str(&format!(
            "{base}dtype = \"fp8\"\n[positional]\nkind = \"none\"\n"
        )),
        &["dtype", "bf16"],
    );
}
