//! Helpers shared by the test modules: fixtures, tiny configs, comparisons.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle::{DType, Device, Tensor, Var};
use poslab::positional::{
    ConcatOptions, LearnedOptions, NoOptions, RopeOptions, SinusoidalOptions,
};
use poslab::{Encoder, ModelConfig, NormPlacement, ParamStore, PositionalConfig};

pub fn fixture_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// All tensors of a fixture file, on the CPU, as stored (f32 / i64).
pub fn load_fixture(name: &str) -> HashMap<String, Tensor> {
    candle::safetensors::load(fixture_path(name), &Device::Cpu)
        .unwrap_or_else(|e| panic!("fixture {name}: {e}"))
}

/// The names of the whole-encoder fixtures in `tests/fixtures` (scheme x norm, and the
/// randomized-position ones).
pub fn encoder_fixture_names() -> Vec<String> {
    encoder_fixtures_in(&fixture_path(""))
        .into_iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

/// Every `encoder_*.safetensors` in `dir`, sorted.
pub fn encoder_fixtures_in(dir: &Path) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading fixtures in {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with("encoder_") && n.ends_with(".safetensors")
        })
        .collect();
    paths.sort();
    paths
}

/// A whole-encoder fixture: its model config, weights, inputs and expected output.
pub struct EncoderFixture {
    pub name: String,
    pub config: ModelConfig,
    pub weights: HashMap<String, Tensor>,
    pub input_ids: Tensor,
    pub attention_mask: Tensor,
    /// Each token's position (`position_ids`; `0..t` for fixtures that have none).
    pub positions: poslab::Positions,
    pub expected: Tensor,
    /// Key biases the reference carries but poslab leaves out where they cannot act (every
    /// scheme but rope: softmax cancels them). The reference outputs were computed with them.
    pub dropped_key_biases: Vec<Tensor>,
}

/// Maps the reference's config (metadata `config`) onto poslab's; an option poslab does not
/// know is an error naming it.
pub fn config_from_reference(meta: &serde_json::Value) -> Result<ModelConfig, String> {
    use poslab::positional::{T5Options, UntiedOptions, UntiedSource};
    let s = |k: &str| {
        meta[k]
            .as_str()
            .map(String::from)
            .ok_or(format!("no string `{k}`"))
    };
    let u = |k: &str| {
        meta[k]
            .as_u64()
            .map(|v| v as usize)
            .ok_or(format!("no integer `{k}`"))
    };
    let f = |k: &str| meta[k].as_f64().ok_or(format!("no number `{k}`"));
    let layout: poslab::TableLayout =
        serde_json::from_value(meta["layout"].clone()).map_err(|e| e.to_string())?;
    let pairing =
        serde_json::from_value(meta["rope_pairing"].clone()).map_err(|e| e.to_string())?;
    // DAPE's MLP: null, or {"width": W}.
    let adaptive: Option<poslab::positional::Adaptive> =
        serde_json::from_value(meta["adaptive"].clone()).map_err(|e| format!("adaptive: {e}"))?;
    let positional = match s("positional")?.as_str() {
        "none" => PositionalConfig::None(NoOptions {}),
        "sinusoidal_add" => PositionalConfig::SinusoidalAdd(SinusoidalOptions {
            base: f("base")?,
            layout,
        }),
        "sinusoidal_concat" => PositionalConfig::SinusoidalConcat(ConcatOptions {
            pos_dim: u("pos_dim")?,
            base: f("base")?,
            layout,
            project: false,
        }),
        "learned" => PositionalConfig::Learned(LearnedOptions::default()),
        "rope" => PositionalConfig::Rope(RopeOptions {
            base: f("base")?,
            pairing,
            fraction: meta["rope_fraction"].as_f64().unwrap_or(1.0),
            // The reference's scaling tables use poslab's names (kind, factor,
            // original_max_len, beta_fast, beta_slow).
            scaling: match &meta["rope_scaling"] {
                serde_json::Value::Null => None,
                s => Some(
                    serde_json::from_value(s.clone())
                        .map_err(|e| format!("rope_scaling {s}: {e}"))?,
                ),
            },
        }),
        "alibi" => PositionalConfig::Alibi(poslab::positional::AlibiOptions { adaptive }),
        "t5" => PositionalConfig::T5(T5Options {
            buckets: u("t5_buckets")?,
            max_distance: u("t5_max_distance")?,
            adaptive,
        }),
        "kerple" => PositionalConfig::Kerple(poslab::positional::KerpleOptions { adaptive }),
        "prope" => PositionalConfig::Prope(poslab::positional::PropeOptions {
            base: f("base")?,
            pairing,
            keep: f("prope_keep")?,
            ..Default::default()
        }),
        "fire" => PositionalConfig::Fire(poslab::positional::FireOptions {
            adaptive,
            ..poslab::positional::FireOptions::threshold(f("fire_threshold")?)
        }),
        "fox" => PositionalConfig::Fox(NoOptions {}),
        "pope" => PositionalConfig::Pope(poslab::positional::PopeOptions {
            base: f("base")?,
            ..Default::default()
        }),
        "cope" => PositionalConfig::Cope(poslab::positional::CopeOptions {
            npos: u("cope_npos")?,
        }),
        "path" => PositionalConfig::Path(poslab::positional::PathOptions {
            conv_size: u("path_conv_size")?,
        }),
        "stick_breaking" => {
            PositionalConfig::StickBreaking(poslab::positional::StickBreakingOptions {
                attend_current: meta["sb_attend_current"]
                    .as_bool()
                    .ok_or("no boolean `sb_attend_current`")?,
                remainder: serde_json::from_value(meta["sb_remainder"].clone())
                    .map_err(|e| format!("sb_remainder: {e}"))?,
            })
        }
        "grape_m" => PositionalConfig::GrapeM(poslab::positional::GrapeMOptions {
            base: f("base")?,
            log_freq_scale: f("grape_log_freq_scale")?,
        }),
        "grape_a" => PositionalConfig::GrapeA(poslab::positional::GrapeAOptions {
            p_dim: u("grape_p_dim")?,
        }),
        "untied" => PositionalConfig::Untied(match s("untied_source")?.as_str() {
            "learned" => UntiedOptions::default(),
            "sinusoidal" => UntiedOptions {
                source: UntiedSource::Sinusoidal,
                base: Some(f("base")?),
                layout: Some(layout),
                init_std: None,
            },
            other => return Err(format!("unknown untied_source {other}")),
        }),
        other => return Err(format!("unknown positional {other}")),
    };
    Ok(ModelConfig {
        vocab_size: u("vocab")?,
        d_model: u("d_model")?,
        n_heads: u("heads")?,
        n_layers: u("layers")?,
        ffn_dim: u("ffn_dim")?,
        activation: Default::default(),
        bias: true,
        first_attn_norm: true,
        max_len: u("max_len")?,
        norm: serde_json::from_value(meta["norm"].clone()).map_err(|e| e.to_string())?,
        dropout: 0.0,
        attention_dropout: 0.0,
        embed_scale: poslab::Scale::Value(f("embed_scale")?),
        token_init_std: poslab::Scale::Value(1.0),
        layer_norm_eps: 1e-5,
        dtype: Default::default(),
        random_positions: None,
        embeddings: Default::default(),
        positional,
        layers: None,
        causal: meta["causal"].as_bool().unwrap_or(false),
    })
}

/// A fixture from `tests/fixtures`.
pub fn load_encoder_fixture(name: &str) -> EncoderFixture {
    load_encoder_fixture_from(&fixture_path(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// A whole-encoder fixture from any path; what poslab cannot read is an error.
pub fn load_encoder_fixture_from(path: &Path) -> Result<EncoderFixture, String> {
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let meta = poslab::params::read_metadata(path).map_err(|e| e.to_string())?;
    let meta: serde_json::Value =
        serde_json::from_str(meta.get("config").ok_or("no config metadata")?)
            .map_err(|e| e.to_string())?;
    let mut weights = candle::safetensors::load(path, &Device::Cpu).map_err(|e| e.to_string())?;
    let mut take = |key: &str| weights.remove(key).ok_or(format!("no tensor `{key}`"));
    let input_ids = take("input_ids")?;
    let attention_mask = take("attention_mask")?;
    let expected = take("expected_hidden")?;
    let positions = match weights.remove("position_ids") {
        Some(p) => poslab::Positions::from_tensor(&p).map_err(|e| e.to_string())?,
        None => poslab::Positions::range(0, input_ids.dim(1).unwrap()).unwrap(),
    };
    let config = config_from_reference(&meta)?;
    let mut dropped_key_biases = Vec::new();
    if !config.positional.reads_keys() {
        for i in 0..config.n_layers {
            let key = format!("layers.{i}.attn.k.bias");
            dropped_key_biases.push(weights.remove(&key).ok_or(format!("no tensor `{key}`"))?);
        }
    }
    // FIRE's output bias adds the same number to every score of a head, which softmax cancels:
    // poslab's FIRE has none (the reference's is non-zero and its outputs match without it),
    // except under DAPE's MLP, which reads the bias.
    let adaptive = !meta["adaptive"].is_null();
    if config.positional.name() == "fire" && !adaptive {
        weights
            .remove("fire.mlp2.bias")
            .ok_or("no tensor `fire.mlp2.bias`")?;
    }
    // DAPE's output bias, likewise.
    if adaptive {
        for i in 0..config.n_layers {
            let key = format!("layers.{i}.attn.dape.mlp2.bias");
            weights.remove(&key).ok_or(format!("no tensor `{key}`"))?;
        }
    }
    // Under a causal mask CoPE's right table and GRAPE-AP's right projection are never read,
    // and poslab makes them no variables (they could never learn); the reference keeps them in
    // the layout.
    if let (true, Some((unread, _))) = (config.causal, right_side(config.positional.name())) {
        for i in 0..config.n_layers {
            let key = format!("layers.{i}.attn.{unread}");
            weights.remove(&key).ok_or(format!("no tensor `{key}`"))?;
        }
    }
    Ok(EncoderFixture {
        name,
        config,
        dropped_key_biases,
        weights,
        input_ids,
        attention_mask,
        positions,
        expected,
    })
}

impl EncoderFixture {
    /// An encoder in `dtype` holding the fixture's weights (loaded by name), and its store.
    pub fn encoder(&self, dtype: DType) -> (Encoder, ParamStore) {
        self.encoder_on(dtype, &Device::Cpu)
    }

    /// [`Self::encoder`] with the weights on `device`.
    pub fn encoder_on(&self, dtype: DType, device: &Device) -> (Encoder, ParamStore) {
        let store = ParamStore::new(0);
        let encoder = Encoder::new(&self.config, store.var_builder(dtype, device)).unwrap();
        store.assign(&self.weights, Path::new(&self.name)).unwrap();
        (encoder, store)
    }

    /// The encoder's hidden states on the fixture's inputs at its positions.
    pub fn hidden(&self, encoder: &Encoder) -> Tensor {
        encoder
            .forward_with(
                &self.input_ids,
                &self.attention_mask,
                &self.positions,
                false,
            )
            .unwrap()
    }
}

/// Largest absolute difference, over all elements, as f64; infinite where any difference is
/// not finite (a NaN would pass a maximum).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    largest((a - b).unwrap().abs().unwrap())
}

/// The largest value of `diff`, infinite where any is not finite.
fn largest(diff: Tensor) -> f64 {
    let values = diff.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    match values.iter().all(|v| v.is_finite()) {
        true => values.into_iter().fold(0.0, f64::max),
        false => f64::INFINITY,
    }
}

/// Largest absolute difference at real (unpadded) positions of `(b, t, d)` tensors.
pub fn max_abs_diff_real(a: &Tensor, b: &Tensor, mask: &Tensor) -> f64 {
    let mask = mask.to_dtype(DType::F64).unwrap().unsqueeze(2).unwrap();
    let diff = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
        .unwrap()
        .abs()
        .unwrap();
    // Padded positions are chosen out, not multiplied away (0 x NaN is NaN).
    let real = mask.broadcast_as(diff.shape()).unwrap().ne(0.0).unwrap();
    largest(real.where_cond(&diff, &diff.zeros_like().unwrap()).unwrap())
}

/// A tiny config of each of the five schemes (and both norms), for property and gradient tests.
pub fn tiny_config(positional: PositionalConfig, norm: NormPlacement) -> ModelConfig {
    ModelConfig {
        vocab_size: 40,
        d_model: 16,
        n_heads: 2,
        n_layers: 2,
        ffn_dim: 24,
        activation: Default::default(),
        bias: true,
        first_attn_norm: true,
        max_len: 32,
        norm,
        dropout: 0.0,
        attention_dropout: 0.0,
        embed_scale: poslab::Scale::Value(1.0),
        token_init_std: poslab::Scale::Value(1.0),
        layer_norm_eps: 1e-5,
        dtype: Default::default(),
        random_positions: None,
        embeddings: Default::default(),
        positional,
        layers: None,
        causal: false,
    }
}

/// One config per scheme (all nine), with non-default options where a scheme has them.
pub fn all_schemes() -> Vec<PositionalConfig> {
    use poslab::{RopePairing, TableLayout};
    vec![
        PositionalConfig::None(NoOptions {}),
        PositionalConfig::SinusoidalAdd(SinusoidalOptions::default()),
        PositionalConfig::SinusoidalAdd(SinusoidalOptions {
            base: 100.0,
            layout: TableLayout::Half,
        }),
        PositionalConfig::SinusoidalConcat(ConcatOptions {
            pos_dim: 6,
            base: 10_000.0,
            layout: TableLayout::Interleaved,
            project: false,
        }),
        PositionalConfig::SinusoidalConcat(ConcatOptions {
            pos_dim: 6,
            base: 10_000.0,
            layout: TableLayout::Half,
            project: true,
        }),
        PositionalConfig::Learned(LearnedOptions::default()),
        PositionalConfig::Rope(RopeOptions::default()),
        PositionalConfig::Rope(RopeOptions {
            base: 500_000.0,
            pairing: RopePairing::Half,
            ..Default::default()
        }),
        // Partial rotation (heads of 8 and 10 rotate 4 and 6) with YaRN's ramp and attention
        // factor; and with dynamic NTK.
        PositionalConfig::Rope(RopeOptions {
            pairing: RopePairing::Half,
            fraction: 0.6,
            scaling: Some(poslab::positional::RopeScaling::Yarn {
                factor: poslab::positional::Factor::Value(4.0),
                original_max_len: Some(6),
                beta_fast: 32.0,
                beta_slow: 1.0,
            }),
            ..Default::default()
        }),
        PositionalConfig::Rope(RopeOptions {
            fraction: 0.6,
            scaling: Some(poslab::positional::RopeScaling::DynamicNtk {
                factor: poslab::positional::Factor::Value(2.0),
                original_max_len: Some(6),
            }),
            ..Default::default()
        }),
        PositionalConfig::Alibi(Default::default()),
        PositionalConfig::T5(poslab::positional::T5Options::default()),
        // Few buckets and a short reach: the log buckets and the far bucket both in play.
        PositionalConfig::T5(poslab::positional::T5Options {
            buckets: 8,
            max_distance: 6,
            adaptive: None,
        }),
        PositionalConfig::Kerple(Default::default()),
        PositionalConfig::Untied(poslab::positional::UntiedOptions::default()),
        PositionalConfig::Untied(poslab::positional::UntiedOptions {
            source: poslab::positional::UntiedSource::Sinusoidal,
            base: Some(100.0),
            layout: Some(TableLayout::Half),
            init_std: None,
        }),
        PositionalConfig::Prope(poslab::positional::PropeOptions::keep(0.5)),
        PositionalConfig::Prope(poslab::positional::PropeOptions {
            pairing: RopePairing::Half,
            keep: 0.75,
            base: 500.0,
            ..Default::default()
        }),
        PositionalConfig::Fire(Default::default()),
        // A threshold below the tests' spans: inputs interpolated over the span.
        PositionalConfig::Fire(poslab::positional::FireOptions {
            threshold: 3.0,
            width: 6,
            adaptive: None,
        }),
        PositionalConfig::Fox(NoOptions {}),
        PositionalConfig::Pope(Default::default()),
        PositionalConfig::Pope(poslab::positional::PopeOptions {
            base: 100.0,
            delta_init: poslab::positional::DeltaInit::Zeros,
        }),
        // Few rows: counts past 3 read the last row.
        PositionalConfig::Cope(poslab::positional::CopeOptions { npos: 4 }),
        PositionalConfig::Path(Default::default()),
        PositionalConfig::Path(poslab::positional::PathOptions { conv_size: 0 }),
        PositionalConfig::StickBreaking(Default::default()),
        PositionalConfig::StickBreaking(poslab::positional::StickBreakingOptions {
            attend_current: true,
            remainder: poslab::positional::Remainder::Bias,
        }),
        PositionalConfig::GrapeM(Default::default()),
        PositionalConfig::GrapeM(poslab::positional::GrapeMOptions {
            base: 100.0,
            log_freq_scale: 1.0,
        }),
        PositionalConfig::GrapeA(Default::default()),
        PositionalConfig::GrapeA(poslab::positional::GrapeAOptions { p_dim: 2 }),
        // DAPE's MLP on each bias scheme it applies to, narrow and wide.
        PositionalConfig::Alibi(poslab::positional::AlibiOptions {
            adaptive: Some(poslab::positional::Adaptive { width: 4 }),
        }),
        PositionalConfig::Kerple(poslab::positional::KerpleOptions {
            adaptive: Some(Default::default()),
        }),
        PositionalConfig::Fire(poslab::positional::FireOptions {
            threshold: 3.0,
            width: 6,
            adaptive: Some(poslab::positional::Adaptive { width: 5 }),
        }),
        PositionalConfig::T5(poslab::positional::T5Options {
            buckets: 8,
            max_distance: 6,
            adaptive: Some(poslab::positional::Adaptive { width: 3 }),
        }),
    ]
}

/// Whether a scheme's outputs depend on the batch's length (dynamic NTK RoPE: its base grows
/// with the largest position in the batch, padding included, as transformers computes it).
pub fn depends_on_batch_length(positional: &PositionalConfig) -> bool {
    matches!(
        positional,
        PositionalConfig::Rope(o)
            if matches!(o.scaling, Some(poslab::positional::RopeScaling::DynamicNtk { .. }))
    )
}

/// A batch of token ids `(b, t)` from a fixed pattern, and a mask with padding at the end of
/// all but the first sequence.
pub fn padded_batch(b: usize, t: usize, vocab: u32) -> (Tensor, Tensor) {
    let mut ids = Vec::with_capacity(b * t);
    let mut mask = Vec::with_capacity(b * t);
    for i in 0..b {
        let real = t - (i % t.min(4));
        for j in 0..t {
            ids.push(((i * 7 + j * 13 + 3) as u32) % vocab);
            mask.push(u32::from(j < real));
        }
    }
    (
        Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap(),
        Tensor::from_vec(mask, (b, t), &Device::Cpu).unwrap(),
    )
}

/// Asserts that an error's message contains every needle, and returns the message.
pub fn assert_error_mentions<T: std::fmt::Debug, E: std::fmt::Display>(
    result: Result<T, E>,
    needles: &[&str],
) -> String {
    let message = match result {
        Ok(v) => panic!("accepted what it should refuse: {v:?}"),
        Err(e) => e.to_string(),
    };
    for needle in needles {
        assert!(
            message.contains(needle),
            "message {message:?} lacks {needle:?}"
        );
    }
    message
}

/// The bit patterns of an f32 tensor's values.
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// A tensor's values as f64, flattened.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// A fixed random projection of the hidden states at real positions: a scalar that depends on
/// every output coordinate.
pub fn projection(dims: &[usize], seed: u64) -> Tensor {
    use rand::Rng as _;
    let mut rng = poslab::rng::stream(seed, "loss projection");
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

pub fn loss(encoder: &Encoder, ids: &Tensor, mask: &Tensor, r: &Tensor, train: bool) -> Tensor {
    let t = ids.dim(1).unwrap();
    let positions = poslab::Positions::range(0, t).unwrap();
    loss_at(encoder, ids, mask, &positions, r, train)
}

/// [`loss`] with every token at its own position.
pub fn loss_at(
    encoder: &Encoder,
    ids: &Tensor,
    mask: &Tensor,
    positions: &poslab::Positions,
    r: &Tensor,
    train: bool,
) -> Tensor {
    let hidden = encoder.forward_with(ids, mask, positions, train).unwrap();
    let real = mask.to_dtype(hidden.dtype()).unwrap().unsqueeze(2).unwrap();
    hidden
        .mul(&r.to_dtype(hidden.dtype()).unwrap())
        .unwrap()
        .broadcast_mul(&real)
        .unwrap()
        .sum_all()
        .unwrap()
}

/// Asserts every variable of `store` got a finite gradient with some non-zero entry; returns
/// the gradients as flat f64 vectors.
pub fn check_all_gradients(
    store: &ParamStore,
    grads: &candle::backprop::GradStore,
    what: &str,
) -> Vec<(String, Var, Vec<f64>)> {
    let vars = store.vars();
    assert!(!vars.is_empty());
    vars.into_iter()
        .map(|(name, var)| {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{what}: `{name}` received no gradient"));
            // Variables keep their dtype under mixed precision, and so do their gradients.
            assert_eq!(g.dtype(), var.dtype(), "{what}: `{name}` gradient dtype");
            let g = values(g);
            assert!(
                g.iter().all(|v| v.is_finite()),
                "{what}: `{name}` has a non-finite gradient"
            );
            let max = g.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            // FIRE's L = |l_multiplier| threshold acts only where it exceeds a sequence's span
            // (the normaliser is max(L, span)); with every span above it (a small threshold,
            // randomized positions) its gradient is exactly zero by definition.
            // `recent::fire_l_multiplier_learns_where_l_is_the_larger` checks both sides.
            let inactive = name == "fire.l_multiplier" && max == 0.0;
            assert!(
                max > 1e-12 || inactive,
                "{what}: `{name}` has an all-zero gradient"
            );
            (name, var, g)
        })
        .collect()
}

/// `tiny_config` with dropout 0.1 on the embeddings, both residual branches and the attention
/// weights.
pub fn tiny_dropout_config(positional: PositionalConfig, norm: NormPlacement) -> ModelConfig {
    ModelConfig {
        dropout: 0.1,
        attention_dropout: 0.1,
        ..tiny_config(positional, norm)
    }
}

/// Gives the variables that start at exactly zero and gate others (CoPE's tables, whose zero
/// term leaves the key bias and the gates without any gradient) fixed values in `[-0.5, 0.5)`,
/// so that a test of gradients sees every path carry one.
pub fn liven(store: &ParamStore) {
    use rand::Rng as _;
    let mut rng = poslab::rng::stream(17, "liven");
    for (name, var) in store.vars() {
        if name.contains(".cope.") {
            let v: Vec<f64> = (0..var.elem_count())
                .map(|_| rng.random_range(-0.5..0.5))
                .collect();
            let t = Tensor::from_vec(v, var.dims(), &Device::Cpu)
                .unwrap()
                .to_dtype(var.dtype())
                .unwrap()
                .to_device(var.device())
                .unwrap();
            var.set(&t).unwrap();
        }
    }
}

/// One backward pass in training mode: an encoder of `config` (f32 weights seeded 3, on
/// `device`, dropout seed 5) on a padded `(4, 12)` batch, through [`loss`]; every variable's
/// gradient checked by [`check_all_gradients`]. The dropout masks come from poslab's own host
/// generator, so every device sees the same ones.
pub fn training_gradients(
    config: &ModelConfig,
    device: &Device,
    what: &str,
) -> Vec<(String, Var, Vec<f64>)> {
    training_gradients_on(config, device, what, poslab::nn::Backend::default())
}

/// [`training_gradients`] of an encoder computing with `backend`.
pub fn training_gradients_on(
    config: &ModelConfig,
    device: &Device,
    what: &str,
    backend: poslab::nn::Backend,
) -> Vec<(String, Var, Vec<f64>)> {
    let store = ParamStore::new(3);
    let encoder = Encoder::new(config, store.var_builder(DType::F32, device))
        .unwrap()
        .with_backend(backend);
    liven(&store);
    encoder.set_dropout_seed(5);
    let (ids, mask) = padded_batch(4, 12, 40);
    let on = |t: Tensor| t.to_device(device).unwrap();
    let r = projection(&[4, 12, config.d_model], 2);
    let grads = loss(&encoder, &on(ids), &on(mask), &on(r), true)
        .backward()
        .unwrap();
    check_all_gradients(&store, &grads, what)
}

/// A scheme's variable that only keys after the query read, beside its left twin (the names
/// under `layers.{i}.attn.`): what a causal model has none of.
pub fn right_side(scheme: &str) -> Option<(&'static str, &'static str)> {
    match scheme {
        "cope" => Some(("cope.right", "cope.left")),
        "grape_a" => Some(("grape.p_right.weight", "grape.p.weight")),
        _ => None,
    }
}

/// Whether variable `name`'s gradient sums `dS` over every pair of tokens, whose rows sum to
/// zero, so that it is small beside the terms it sums and their rounding shows more: FIRE's
/// module (its bias is shared by every pair), DAPE's MLPs, and under them (`dape`) the key
/// bias, which reaches the loss only through the MLP (the softmax cancels its direct part).
pub fn sums_cancelling_rows(name: &str, dape: bool) -> bool {
    name.starts_with("fire.") || name.contains(".dape.") || (dape && name.ends_with("attn.k.bias"))
}

/// Relative L2 error of gradient `g` of `name` against `reference`, asserted below `tol`.
pub fn assert_relative_l2(what: &str, name: &str, g: &[f64], reference: &[f64], tol: f64) -> f64 {
    assert_relative_l2_of(what, name, g, reference, tol, 0.0)
}

/// [`assert_relative_l2`] relative to `reference`'s L2 norm or `floor`, whichever is larger:
/// for a gradient that sums terms which may cancel, the size of those terms.
pub fn assert_relative_l2_of(
    what: &str,
    name: &str,
    g: &[f64],
    reference: &[f64],
    tol: f64,
    floor: f64,
) -> f64 {
    let diff: f64 = g.iter().zip(reference).map(|(a, b)| (a - b).powi(2)).sum();
    let norm: f64 = reference
        .iter()
        .map(|b| b * b)
        .sum::<f64>()
        .max(floor * floor);
    // Two exact zeros (a variable inactive by construction) agree.
    let rel = if diff == 0.0 {
        0.0
    } else {
        (diff / norm).sqrt()
    };
    assert!(
        rel < tol,
        "{what}: `{name}` relative L2 error {rel:e} >= {tol:e}"
    );
    rel
}

/// Options of a `train` run into `dir` on the CPU, quiet, offline, optionally stopping after
/// `stop_after` steps.
pub fn options(dir: &Path, stop_after: Option<usize>) -> poslab::runs::train_run::TrainOptions {
    poslab::runs::train_run::TrainOptions {
        dir: dir.to_path_buf(),
        device: Device::Cpu,
        progress: poslab::progress::Progress::Quiet,
        stop_after,
        hub: poslab::text::HubSource::from_vars(None, None, Some("1")),
        threads: None,
        backend: Default::default(),
        limits: Default::default(),
    }
}

/// A headless Chromium on `PATH`: Debian's `chromium-headless-shell` (what `.ci/run` installs),
/// or another Chromium. Without one, a browser test fails under CI and is skipped, saying so,
/// elsewhere (`None`).
pub fn headless_browser() -> Option<std::path::PathBuf> {
    let names = [
        "chromium-headless-shell",
        "chrome-headless-shell",
        "chromium",
        "google-chrome",
    ];
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .flat_map(|dir| names.map(|n| dir.join(n)))
        .find(|p| p.is_file());
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI needs a headless Chromium for the report.html tests: .ci/run installs \
             chromium-headless-shell"
        );
        eprintln!(
            "skipped: no headless Chromium on PATH (apt-get install chromium-headless-shell)"
        );
    }
    found
}

/// Runs `browser` on `page` with `args`, at most 120 s: (stdout, stderr). Both go to files
/// (a page's DOM fills a pipe, and a browser blocked on it never ends).
pub fn browse(
    browser: &std::path::Path,
    profile: &std::path::Path,
    page: &std::path::Path,
    args: &[&str],
) -> (String, String) {
    use std::process::Command;
    std::fs::create_dir_all(profile).unwrap();
    let (out, err) = (profile.join("stdout"), profile.join("stderr"));
    let mut child = Command::new(browser)
        .args([
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=10000",
        ])
        .arg(format!(
            "--user-data-dir={}",
            profile.join("data").display()
        ))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("the browser starts");
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed().as_secs() > 120 {
            child.kill().ok();
            panic!("{} did not finish within 120 s", browser.display());
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let read =
        |p: &std::path::Path| String::from_utf8_lossy(&std::fs::read(p).unwrap()).into_owned();
    (read(&out), read(&err))
}

/// The DOM of `page` as `browser` draws it, checked: no console message, and the page's script
/// finished (`<body data-rendered="ok">`).
pub fn drawn_page(
    browser: &std::path::Path,
    profile: &std::path::Path,
    page: &std::path::Path,
) -> String {
    let (dom, log) = browse(browser, profile, page, &["--dump-dom"]);
    let console: Vec<&str> = log.lines().filter(|l| l.contains(":CONSOLE")).collect();
    assert!(console.is_empty(), "console messages: {console:#?}");
    assert!(
        dom.contains("<body data-rendered=\"ok\">"),
        "the page's script did not finish: {}",
        &dom[..dom.len().min(2000)]
    );
    dom
}

/// A 1280 x 2400 screenshot of `page` (written into `dir`), as RGB(A) pixels; asserted not
/// blank: more than 2% of its pixels are not white.
pub fn screenshot(
    browser: &std::path::Path,
    profile: &std::path::Path,
    page: &std::path::Path,
    dir: &std::path::Path,
) -> Vec<Vec<u8>> {
    let shot = dir.join("shot.png");
    browse(
        browser,
        profile,
        page,
        &[
            "--window-size=1280,2400",
            &format!("--screenshot={}", shot.display()),
        ],
    );
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&shot).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    let pixels: Vec<Vec<u8>> = buf[..info.buffer_size()]
        .chunks(channels)
        .map(<[u8]>::to_vec)
        .collect();
    let inked = pixels.iter().filter(|p| !near(p, (255, 255, 255))).count();
    assert!(
        inked * 50 > pixels.len(),
        "the screenshot is nearly blank: {inked} of {} pixels inked",
        pixels.len()
    );
    pixels
}

/// Whether pixel `p` is within 40 (summed over channels) of `rgb`.
pub fn near(p: &[u8], (r, g, b): (i32, i32, i32)) -> bool {
    (i32::from(p[0]) - r).abs() + (i32::from(p[1]) - g).abs() + (i32::from(p[2]) - b).abs() < 40
}

/// Every file under `dir` (recursively) whose extension is `ext`, in directory order.
pub fn files_with_extension(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files_with_extension(&path, ext));
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
    out
}

/// The backend of `kernels` at the CPU's best SIMD level: a test's choice of kernels, as the
/// value a model is built with.
pub fn on(kernels: poslab::nn::Kernels) -> poslab::nn::Backend {
    poslab::nn::Backend::default().with_kernels(kernels)
}

/// [`on`] with the CPU computing as CUDA does: the CUDA path's ops (`kernels = ops`) or the
/// device path's layers (`layer`), by their CPU twins.
pub fn twin(kernels: poslab::nn::Kernels) -> poslab::nn::Backend {
    on(kernels).as_on_cuda()
}

/// `f`'s value, and how many of the CUDA path's one-kernel ops it ran (their forwards): how a
/// test tells that [`twin`]'s ops were taken.
pub fn with_op_calls<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = poslab::nn::cuda_op_calls();
    let out = f();
    (out, poslab::nn::cuda_op_calls() - before)
}
