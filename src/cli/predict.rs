//! `poslab predict`: labels, tags or mask fills for new text from a trained model.

use std::path::PathBuf;

use anyhow::Result;
use poslab::infer::{Prediction, Predictor};

use super::{gather_texts, load_model, Compute};

/// Labels and probabilities (classification), tags per word (tagging) or the top fills of
/// each [MASK] (MLM) for new text, from a trained model's folder.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub source: super::ModelSource,
    /// Texts to read (or use --input).
    pub texts: Vec<String>,
    /// A file of texts, one per line; `-` reads standard input.
    #[arg(long, value_name = "FILE")]
    pub input: Option<PathBuf>,
    /// One JSON object per line.
    #[arg(long)]
    pub json: bool,
    /// Fills shown per mask (masks are numbered by their word in the text, from 0, in the
    /// text output and in --json alike).
    #[arg(long, default_value_t = 5)]
    pub top_k: usize,
    /// Cut texts longer than a learned position table instead of refusing them.
    #[arg(long)]
    pub truncate: bool,
    #[arg(long, value_name = "KIND[:FACTOR]", value_parser = super::parse_rope_scaling, help = super::ROPE_SCALING_HELP)]
    pub rope_scaling: Option<poslab::positional::RopeScaling>,
    #[command(flatten)]
    pub compute: Compute,
    #[command(flatten)]
    pub quiet: super::Quiet,
}

pub fn run(args: Args) -> Result<()> {
    let Args {
        source: super::ModelSource { run, model },
        texts,
        input,
        json,
        top_k,
        truncate,
        rope_scaling,
        compute,
        quiet,
    } = args;
    if top_k == 0 {
        anyhow::bail!(
            "--top-k 0 would show no fill: give the number of fills per mask, at least 1"
        );
    }
    let texts = gather_texts(texts, input)?;
    let meter = poslab::progress::Meter::new("poslab predict");
    let outputs = quiet.metered(&meter, || -> Result<_> {
        Ok(match (run, model) {
            (_, Some(spec)) => {
                if rope_scaling.is_some() {
                    anyhow::bail!(
                        "--rope-scaling applies to RoPE models; a BERT-family encoder has a \
                         learned table"
                    );
                }
                super::load_pretrained(&spec, &compute)?.fill_masks(&texts, top_k, truncate)?
            }
            (Some(run), None) => {
                let loaded = load_model(&run, &compute)?;
                Predictor::new(&loaded, truncate)
                    .with_limits(super::limits()?)
                    .with_rope_scaling(rope_scaling)?
                    .with_meter(&meter)
                    .predict(&texts, top_k)?
            }
            (None, None) => unreachable!("clap requires --run or --model"),
        })
    })?;
    for (i, out) in outputs.iter().enumerate() {
        if let Some(note) = &out.note {
            errln!("text {}: {note}", i + 1);
        }
        if json {
            outln!("{}", serde_json::to_string(out)?);
        } else {
            print_one(i, out)?;
        }
    }
    Ok(())
}

/// Text `i`'s prediction as lines: the label and its probability, tagged words, or fills.
fn print_one(i: usize, out: &poslab::infer::Output<Prediction>) -> Result<()> {
    if out.unknown_tokens > 0 {
        errln!(
            "text {}: {} token{} not in the model's vocabulary (all read as one unknown \
             token); the answer is less sure than it looks",
            i + 1,
            out.unknown_tokens,
            if out.unknown_tokens == 1 {
                " is"
            } else {
                "s are"
            }
        );
    }
    match &out.value {
        Prediction::Class {
            label,
            probabilities,
        } => {
            let others: Vec<String> = probabilities
                .iter()
                .skip(1)
                .take(3)
                .map(|s| format!("{} {:.3}", s.label, s.probability))
                .collect();
            outln!(
                "{label}\t{:.3}\t{}\t({})",
                probabilities[0].probability,
                out.text,
                others.join(", ")
            );
        }
        Prediction::Tags { words, tags } => {
            let pairs: Vec<String> = words
                .iter()
                .zip(tags)
                .map(|(w, t)| format!("{w}/{t}"))
                .collect();
            outln!("{}", pairs.join(" "));
        }
        Prediction::Fills { masks } => {
            outln!("{}", out.text);
            for m in masks {
                let fills: Vec<String> = m
                    .fills
                    .iter()
                    .map(|f| format!("{} {:.3}", f.label, f.probability))
                    .collect();
                // Words count from 0, as in --json.
                outln!("  word {}: {}", m.word, fills.join(", "));
            }
        }
    }
    Ok(())
}
