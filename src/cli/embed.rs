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
    pub texts: Vec<String>,
    #[arg(long, value_name = "FILE")]
    pub input: Option<PathBuf>,
    #[arg(long)]
    pub truncate: bool,
    #[command(flatten)]
    pub compute: Compute,
}

pub fn run(args: Args) -> Result<()> {
    let Args {
        run,
        texts,
        input,
        truncate,
        compute,
    } = args;
    let (run, compute) = (&run, &compute);
    let texts = gather_texts(texts, input)?;
    let loaded = load_model(run, compute)?;
    for (i, out) in Predictor::new(&loaded, truncate)
        .embed(&texts)?
        .iter()
        .enumerate()
    {
        if let Some(note) = &out.note {
            eprintln!("text {}: {note}", i + 1);
        }
        println!("{}", serde_json::to_string(out)?);
    }
    Ok(())
}
