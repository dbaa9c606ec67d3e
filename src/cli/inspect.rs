//! `poslab inspect`: a model config validated and described.

use std::path::PathBuf;

use anyhow::{Context, Result};
use candle::{DType, Device};
use poslab::positional::{
    ConcatOptions, LearnedOptions, NoOptions, RopeOptions, SinusoidalOptions, T5Options,
    UntiedOptions, UntiedSource,
};
use poslab::{Encoder, ModelConfig, ParamStore, PositionalConfig};

/// Validate a model config and show its shape, where positions act, and the parameters of the
/// same shape under every positional scheme.
#[derive(clap::Args)]
pub struct Args {
    /// A model config, TOML or JSON. Default: configs/encoder.toml, embedded in the binary.
    #[arg(conflicts_with = "model")]
    pub config: Option<PathBuf>,
    /// A pretrained BERT-family encoder (a Hugging Face folder or Hub id): loaded, checked, and
    /// described as the poslab encoder it becomes.
    #[arg(long, value_name = "PATH_OR_HUB_ID")]
    pub model: Option<String>,
}

/// The embedded default, `configs/encoder.toml`.
const DEFAULT_CONFIG: &str = include_str!("../../configs/encoder.toml");

pub fn run(args: Args) -> Result<()> {
    if let Some(spec) = &args.model {
        let compute = super::Compute {
            device: "cpu".into(),
            dtype: None,
        };
        let model = super::load_pretrained(spec, &compute)?;
        outln!(
            "{spec}: a `{}` model, every tensor of model.safetensors mapped (src/pretrained/names.rs)",
            model.hf.model_type
        );
        match model.family {
            poslab::pretrained::Family::Bert | poslab::pretrained::Family::DistilBert => {
                outln!("positions: 0, 1, 2, ...")
            }
            poslab::pretrained::Family::Roberta { padding_idx } => outln!(
                "positions: from {} (padding_idx + 1), padded tokens at {padding_idx}",
                padding_idx + 1
            ),
        }
        outln!(
            "texts: at most {} tokens, special tokens included (--truncate cuts longer ones)",
            model.max_tokens()
        );
        outln!(
            "masked-LM head: {}",
            if model.mlm.is_some() {
                "yes (dense, GELU, LayerNorm, decoder tied to the word embeddings): predict --model fills masks"
            } else {
                "no (an encoder only): embed and analyze, not predict"
            }
        );
        outln!(
            "parameters: {} loaded (the file's pooler and attention key biases change no output \
             and are left out)\n",
            model.params.num_params()
        );
        return describe_config(model.encoder.config().clone(), "as a poslab encoder".into());
    }
    let (config, source) = match &args.config {
        Some(path) => (ModelConfig::load(path)?, path.display().to_string()),
        None => (
            ModelConfig::from_toml_str(DEFAULT_CONFIG)?,
            "configs/encoder.toml (embedded default)".to_string(),
        ),
    };
    describe_config(config, source)
}

/// The shape, where positions act, and the parameters of this shape under every scheme.
fn describe_config(config: ModelConfig, source: String) -> Result<()> {
    outln!("{source}: valid");
    outln!(
        "shape: {} layers, d_model {}, {} heads of {}, FFN {}, {}-norm, vocab {}, max_len {}",
        config.n_layers,
        config.d_model,
        config.n_heads,
        config.head_dim(),
        config.ffn_dim,
        config.norm,
        config.vocab_size,
        config.max_len
    );
    outln!(
        "dropout {} (embeddings, residual branches), {} (attention weights); embed_scale {}, token init std {}",
        config.dropout, config.attention_dropout, config.embed_scale, config.token_init_std
    );
    if config.dtype.is_half() {
        outln!(
            "activations: {} (mixed precision; weights, positional tables, softmax and LayerNorm statistics in f32)",
            config.dtype
        );
    }
    outln!("positional: {}", describe(&config.positional, &config));
    outln!("where: {}", config.positional.placement());
    let extras = &config.embeddings;
    if !extras.is_none() {
        outln!(
            "embeddings: {} token types (type 0 added to every token){}",
            extras.token_types,
            if extras.norm {
                ", then a LayerNorm"
            } else {
                ""
            }
        );
    }
    if let Some(n) = config.random_positions {
        outln!(
            "positions: randomized, each sequence's drawn from [0, {n}) and sorted (Ruoss et al. 2023)"
        );
    }

    // The same shape under each scheme, with the configured options where they apply.
    let pos_dim = match &config.positional {
        PositionalConfig::SinusoidalConcat(o) => o.pos_dim,
        _ => (config.d_model / 4).max(2) & !1,
    };
    let concat = |project| {
        PositionalConfig::SinusoidalConcat(ConcatOptions {
            pos_dim,
            base: poslab::positional::DEFAULT_BASE,
            layout: Default::default(),
            project,
        })
    };
    let mut schemes = vec![
        PositionalConfig::None(NoOptions {}),
        PositionalConfig::SinusoidalAdd(SinusoidalOptions::default()),
        concat(false),
        concat(true),
        PositionalConfig::Learned(LearnedOptions::default()),
        PositionalConfig::Rope(RopeOptions::default()),
        PositionalConfig::Alibi(NoOptions {}),
        PositionalConfig::T5(T5Options::default()),
        PositionalConfig::Kerple(NoOptions {}),
        PositionalConfig::Untied(UntiedOptions::default()),
        PositionalConfig::Untied(UntiedOptions {
            source: UntiedSource::Sinusoidal,
            ..Default::default()
        }),
    ];
    // The configured scheme with its own options, in place of its default-options row.
    match schemes
        .iter()
        .position(|s| label(s, pos_dim) == label(&config.positional, pos_dim))
    {
        Some(i) => schemes[i] = config.positional.clone(),
        None => schemes.push(config.positional.clone()),
    }
    outln!("\nparameters of this shape under each scheme:");
    outln!(
        "  {:<40} {:>10} {:>10} {:>10} {:>10} {:>8} {:>11}  where",
        "scheme",
        "tokens",
        "positions",
        "attention",
        "ffn",
        "norms",
        "total"
    );
    for positional in schemes {
        let label = label(&positional, pos_dim);
        let marker = if positional == config.positional {
            "*"
        } else {
            " "
        };
        let where_ = positional.placement();
        let variant = ModelConfig {
            positional,
            ..config.clone()
        };
        match variant.validate() {
            Err(e) => outln!("{marker} {label:<40} cannot be built at this shape: {e}"),
            Ok(()) => {
                let groups =
                    parameter_groups(&variant).with_context(|| format!("building {label}"))?;
                let total: usize = groups.iter().map(|g| g.1).sum();
                outln!(
                    "{marker} {label:<40} {:>10} {:>10} {:>10} {:>10} {:>8} {:>11}  {where_}",
                    groups[0].1,
                    groups[1].1,
                    groups[2].1,
                    groups[3].1,
                    groups[4].1,
                    total
                );
            }
        }
    }
    outln!(
        "\nFixed tables (sinusoids, RoPE cos/sin, ALiBi's slopes) are computed, not trained, and are \
         not counted. \"positions\" counts every positional weight: learned tables, the concat \
         projection, T5's bucket table, KERPLE's r1 and r2, TUPE's U_q and U_k. A key bias \
         exists only under rope: without a rotation softmax cancels a key bias exactly."
    );
    Ok(())
}

/// A scheme's row label: its name, with the options that tell rows apart.
fn label(positional: &PositionalConfig, pos_dim: usize) -> String {
    match positional {
        PositionalConfig::SinusoidalConcat(o) if o.project => {
            format!("sinusoidal_concat (pos_dim {pos_dim}, project)")
        }
        PositionalConfig::SinusoidalConcat(_) => format!("sinusoidal_concat (pos_dim {pos_dim})"),
        PositionalConfig::Untied(o) if o.source == UntiedSource::Sinusoidal => {
            "untied (sinusoidal)".into()
        }
        PositionalConfig::Untied(_) => "untied (learned)".into(),
        other => other.name().to_string(),
    }
}

/// Parameters by group, from the names in the store.
fn parameter_groups(config: &ModelConfig) -> Result<Vec<(&'static str, usize)>> {
    let store = ParamStore::new(0);
    Encoder::new(config, store.var_builder(DType::F32, &Device::Cpu))?;
    let mut groups = vec![
        ("token embedding", 0),
        ("positions", 0),
        ("attention", 0),
        ("feed-forward", 0),
        ("layer norms", 0),
    ];
    for (name, var) in store.vars() {
        let group = if name.starts_with("tok_emb") || name.starts_with("type_emb") {
            0
        } else if name.starts_with("pos_")
            || name.starts_with("rel_bias")
            || name.contains(".kerple.")
        {
            1
        } else if name.contains(".attn.") {
            2
        } else if name.contains(".ffn.") {
            3
        } else {
            4
        };
        groups[group].1 += var.elem_count();
    }
    Ok(groups)
}

fn describe(positional: &PositionalConfig, config: &ModelConfig) -> String {
    let d = config.d_model;
    let (h, dh) = (config.n_heads, config.head_dim());
    match positional {
        PositionalConfig::None(_) => "no positions (the bag-of-words control)".into(),
        PositionalConfig::SinusoidalAdd(o) => format!(
            "input side: tokens + sinusoid ({d} wide, base {}, {} layout)",
            o.base, o.layout
        ),
        PositionalConfig::SinusoidalConcat(o) if o.project => format!(
            "input side: [tokens {d} ; sinusoid {}] projected back to {d} (base {}, {} layout)",
            o.pos_dim, o.base, o.layout
        ),
        PositionalConfig::SinusoidalConcat(o) => format!(
            "input side: [tokens {} ; sinusoid {}] = {d} (base {}, {} layout)",
            d - o.pos_dim,
            o.pos_dim,
            o.base,
            o.layout
        ),
        PositionalConfig::Learned(o) => format!(
            "input side: tokens + learned table ({} x {d}, init N(0, {:.4}))",
            config.max_len, o.init_std
        ),
        PositionalConfig::Rope(o) => format!(
            "attention side: q and k rotated in every layer (head {dh}, base {}, {} pairing)",
            o.base, o.pairing
        ),
        PositionalConfig::Alibi(_) => {
            let slopes = poslab::positional::alibi_slopes(h);
            format!(
                "attention bias: -slope_h |i - j| on every layer's scores, {h} slopes {:.4}..{:.4} (Press et al.), no weights",
                slopes.first().copied().unwrap_or(0.0),
                slopes.last().copied().unwrap_or(0.0)
            )
        }
        PositionalConfig::T5(o) => format!(
            "attention bias: a learned ({} buckets x {h} heads) table shared by all layers, by T5's bucket of j - i (max_distance {})",
            o.buckets, o.max_distance
        ),
        PositionalConfig::Kerple(_) => format!(
            "attention bias: -r1_h ln(1 + r2_h |i - j|), r1 and r2 learned per head and layer ({h} x {} each, kept >= {})",
            config.n_layers,
            poslab::positional::KERPLE_MIN
        ),
        PositionalConfig::Untied(o) => format!(
            "attention bias: (p_i U_q)_h . (p_j U_k)_h / sqrt(2 x {dh}) in every layer, content scores scaled by 1/sqrt(2 x {dh}); p from {}, U_q and U_k ({d} x {d}) shared by all layers",
            match o.source {
                UntiedSource::Learned => format!("a learned table ({} x {d})", config.max_len),
                UntiedSource::Sinusoidal => format!("the sinusoid ({d} wide, base {}, {} layout)", o.base(), o.layout()),
            }
        ),
    }
}
