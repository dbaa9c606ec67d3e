//! `poslab embed`: pooled sentence vectors from a trained model.

use std::path::PathBuf;

use anyhow::Result;
use poslab::infer::Predictor;

use super::{gather_texts, load_model, Compute};

/// Pooled sentence vectors of texts, one JSON object per line.
#[derive(clap::Args)]
pub struct Args {
    /// A model folder: config.json, model.safetensors, tokenizer.json.
    #[arg(long, value_name = "DIR")]
    pub run: PathBuf,
    /// Texts to embed (or use --input).
    pub texts: Vec<String>,
    /// A file of texts, one per line; `-` reads standard input.
    #[arg(long, value_name = "FILE")]
    pub input: Option<PathBuf>,
    /// Cut texts longer than the model can read (a learned position table, or randomized
    /// positions' range) to fit, instead of refusing them.
    #[arg(long)]
    pub truncate: bool,
    #[arg(long, value_name = "KIND[:FACTOR]", value_parser = super::parse_rope_scaling, help = super::ROPE_SCALING_HELP)]
    pub rope_scaling: Option<poslab::positional::RopeScaling>,
    #[command(flatten)]
    pub compute: Compute,
}

pub fn run(args: Args) -> Result<()> {
    let Args {
        run,
        texts,
        input,
        truncate,
        rope_scaling,
        compute,
    } = args;
    let (run, compute) = (&run, &compute);
    let texts = gather_texts(texts, input)?;
    let loaded = load_model(run, compute)?;
    for (i, out) in Predictor::new(&loaded, truncate)
        .with_rope_scaling(rope_scaling)?
        .embed(&texts)?
        .iter()
        .enumerate()
    {
        if let Some(note) = &out.note {
            eprintln!("text {}: {note}", i + 1);
        }
        outln!("{}", serde_json::to_string(out)?);
    }
    Ok(())
}
