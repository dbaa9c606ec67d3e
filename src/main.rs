//! The `poslab` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use candle::{DType, Device};
use clap::{Parser, Subcommand};
use poslab::positional::{
    ConcatOptions, LearnedOptions, NoOptions, RopeOptions, SinusoidalOptions,
};
use poslab::{Encoder, ModelConfig, ParamStore, Placement, PositionalConfig};

#[derive(Parser)]
#[command(
    name = "poslab",
    version,
    about = "A lab for transformer positional encodings"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a model config and show its shape, where positions act, and the parameters of
    /// the same shape under every positional scheme.
    Inspect {
        /// A model config, TOML or JSON.
        #[arg(default_value = "configs/encoder.toml")]
        config: PathBuf,
    },
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Inspect { config } => inspect(&config),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Parameters by group, from the names in the store.
fn parameter_groups(config: &ModelConfig) -> Result<Vec<(&'static str, usize)>> {
    let store = ParamStore::new(0);
    Encoder::new(config, store.var_builder(DType::F32, &Device::Cpu))?;
    let mut groups = vec![
        ("token embedding", 0),
        ("position table", 0),
        ("attention", 0),
        ("feed-forward", 0),
        ("layer norms", 0),
    ];
    for (name, var) in store.vars() {
        let group = if name.starts_with("tok_emb") {
            0
        } else if name.starts_with("pos_emb") {
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
    match positional {
        PositionalConfig::None(_) => "no positions (the bag-of-words control)".into(),
        PositionalConfig::SinusoidalAdd(o) => format!(
            "input side: tokens + sinusoid ({d} wide, base {}, {} layout)",
            o.base, o.layout
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
            "attention side: q and k rotated in every layer (head {}, base {}, {} pairing)",
            config.head_dim(),
            o.base,
            o.pairing
        ),
    }
}

fn inspect(path: &PathBuf) -> Result<()> {
    let config = ModelConfig::load(path)?;
    println!("{}: valid", path.display());
    println!(
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
    println!(
        "dropout {} (embeddings, residual branches), {} (attention weights); embed_scale {}",
        config.dropout, config.attention_dropout, config.embed_scale
    );
    println!("positional: {}", describe(&config.positional, &config));

    // The same shape under each scheme, with the configured options where they apply.
    let pos_dim = match &config.positional {
        PositionalConfig::SinusoidalConcat(o) => o.pos_dim,
        _ => (config.d_model / 4).max(2) & !1,
    };
    let schemes = [
        PositionalConfig::None(NoOptions {}),
        PositionalConfig::SinusoidalAdd(SinusoidalOptions::default()),
        PositionalConfig::SinusoidalConcat(ConcatOptions {
            pos_dim,
            base: poslab::positional::DEFAULT_BASE,
            layout: Default::default(),
            project: false,
        }),
        PositionalConfig::Learned(LearnedOptions::default()),
        PositionalConfig::Rope(RopeOptions::default()),
    ];
    println!("\nparameters of this shape under each scheme:");
    println!(
        "  {:<30} {:>10} {:>10} {:>10} {:>10} {:>8} {:>11}  where",
        "scheme", "tokens", "positions", "attention", "ffn", "norms", "total"
    );
    for positional in schemes {
        let name = positional.name();
        let variant = ModelConfig {
            positional,
            ..config.clone()
        };
        let marker = if variant.positional.name() == config.positional.name() {
            "*"
        } else {
            " "
        };
        let where_ = match variant.positional.placement() {
            Placement::Nowhere => "nowhere".to_string(),
            Placement::Input => "input".to_string(),
            Placement::Attention => "attention".to_string(),
        };
        match variant.validate() {
            Err(e) => println!("{marker} {name:<30} cannot be built at this shape: {e}"),
            Ok(()) => {
                let groups = parameter_groups(&variant)
                    .with_context(|| format!("building the {name} variant"))?;
                let total: usize = groups.iter().map(|g| g.1).sum();
                let note = match name {
                    "sinusoidal_concat" => format!(" (pos_dim {pos_dim})"),
                    _ => String::new(),
                };
                println!(
                    "{marker} {:<30} {:>10} {:>10} {:>10} {:>10} {:>8} {:>11}  {where_}",
                    format!("{name}{note}"),
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
    println!(
        "\nFixed tables (sinusoids, RoPE cos/sin) are computed, not trained, and are not counted. \
         A key bias exists only under rope: without it softmax cancels a key bias exactly."
    );
    Ok(())
}
