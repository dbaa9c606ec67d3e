//! `poslab embed`: pooled sentence vectors from a trained model, or from a pretrained
//! BERT-family encoder (`--model`).

use std::path::PathBuf;

use anyhow::Result;
use poslab::infer::Predictor;

use super::{gather_texts, load_model, Compute};

/// Pooled sentence vectors of texts, one JSON object per line.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub source: super::ModelSource,
    /// With --model: the mean over real tokens (sentence-transformers' pooling) or the first
    /// token ([CLS] / <s>).
    #[arg(long, value_enum, default_value = "mean")]
    pub pooling: PretrainedPooling,
    /// With --model: scale each vector to unit length (as sentence-transformers' Normalize).
    #[arg(long)]
    pub normalize: bool,
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
    #[command(flatten)]
    pub quiet: super::Quiet,
}

/// How a pretrained encoder's hidden states become one vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PretrainedPooling {
    Mean,
    Cls,
}

pub fn run(args: Args) -> Result<()> {
    let Args {
        source: super::ModelSource { run, model },
        pooling,
        normalize,
        texts,
        input,
        truncate,
        rope_scaling,
        compute,
        quiet,
    } = args;
    let texts = gather_texts(texts, input)?;
    let Some(run) = run else {
        let spec = model.expect("clap requires --run or --model");
        if rope_scaling.is_some() {
            anyhow::bail!(
                "--rope-scaling applies to RoPE models; a BERT-family encoder has a learned table"
            );
        }
        let meter = poslab::progress::Meter::new("poslab embed");
        return quiet.metered(&meter, || {
            embed_pretrained(
                &spec, &texts, pooling, normalize, truncate, &compute, &meter,
            )
        });
    };
    if normalize || pooling != PretrainedPooling::Mean {
        anyhow::bail!(
            "--pooling and --normalize apply to a pretrained encoder (--model); a poslab model \
             pools as it was trained"
        );
    }
    let (run, compute) = (&run, &compute);
    let loaded = load_model(run, compute)?;
    let meter = poslab::progress::Meter::new("poslab embed");
    let limits = super::limits()?;
    let outputs = quiet.metered(&meter, || {
        Predictor::new(&loaded, truncate)
            .with_limits(limits)
            .with_rope_scaling(rope_scaling)?
            .with_meter(&meter)
            .embed(&texts)
    })?;
    for (i, out) in outputs.iter().enumerate() {
        if let Some(note) = &out.note {
            errln!("text {}: {note}", i + 1);
        }
        outln!("{}", serde_json::to_string(out)?);
    }
    Ok(())
}

/// `embed --model`: batches of 32 texts through the pretrained encoder.
fn embed_pretrained(
    spec: &str,
    texts: &[String],
    pooling: PretrainedPooling,
    normalize: bool,
    truncate: bool,
    compute: &Compute,
    meter: &poslab::progress::Meter,
) -> Result<()> {
    use candle::IndexOp as _;
    let model = super::load_pretrained(spec, compute)?;
    let unk = model.tokenizer.unk_id();
    let batches = texts.len().div_ceil(32);
    meter.plan("batch", batches, batches as f64);
    for chunk in texts.chunks(32) {
        meter.start(format!("{} texts", chunk.len()));
        let batch = model.batch(chunk, truncate)?;
        let hidden = model.hidden(&batch.ids, &batch.mask)?;
        let vectors = match pooling {
            PretrainedPooling::Mean => {
                poslab::pretrained::mean_pool(&hidden, &batch.mask, normalize)?
            }
            PretrainedPooling::Cls => {
                let first = hidden.i((.., 0))?;
                match normalize {
                    true => poslab::pretrained::unit_rows(&first)?,
                    false => first,
                }
            }
        };
        let ids = batch.ids.to_vec2::<u32>()?;
        for (i, (text, vector)) in chunk.iter().zip(vectors.to_vec2::<f32>()?).enumerate() {
            let real = &ids[i][..batch.lengths[i]];
            let out = poslab::infer::Output {
                text: text.clone(),
                value: poslab::infer::Embedding { embedding: vector },
                unknown_tokens: real.iter().filter(|&&id| Some(id) == unk).count(),
                note: None,
            };
            outln!("{}", serde_json::to_string(&out)?);
        }
        meter.done(1.0);
    }
    Ok(())
}
