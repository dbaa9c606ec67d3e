//! `poslab analyze`: what a positional scheme encodes, by name or in a trained model.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle::DType;
use poslab::experiment;
use poslab::PositionalConfig;

use super::{load_model, parse_option, Compute};

/// The most positions an analysis takes: tables and their distance matrices grow with its
/// square.
const MAX_POSITIONS: usize = 8192;
/// The most positions of an attention-bias analysis: a `P x P` matrix per head and layer.
const MAX_BIAS_POSITIONS: usize = 1024;

/// What a positional scheme encodes: the table as CSV and heatmap, distance matrices, distance
/// against offset, the relative-shift property, a linear position probe, wavelengths, RoPE's
/// decay; an attention bias by offset, per head; for a trained model (--run) its table, its
/// learned score biases, and how its attention logits split into content and position terms.
#[derive(clap::Args)]
pub struct Args {
    /// `sinusoidal`, `rope`, or an attention bias: `alibi`, `t5`, `kerple`; or give --run.
    #[arg(value_parser = ["sinusoidal", "rope", "alibi", "t5", "kerple"], required_unless_present = "run", conflicts_with = "run")]
    pub scheme: Option<String>,
    /// Heads of an attention bias (alibi, kerple).
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    /// T5: buckets.
    #[arg(long, default_value_t = 32)]
    pub buckets: usize,
    /// T5: the distance from which offsets share the last bucket.
    #[arg(long, default_value_t = 128)]
    pub max_distance: usize,
    /// A trained model's folder.
    #[arg(long, value_name = "DIR")]
    pub run: Option<PathBuf>,
    /// Width of the table (sinusoidal) or of a head (rope).
    #[arg(long, default_value_t = 64)]
    pub dim: usize,
    #[arg(long, default_value_t = 10_000.0)]
    pub base: f64,
    /// Sinusoidal layout: interleaved or half.
    #[arg(long, default_value = "interleaved")]
    pub layout: String,
    /// RoPE pairing: interleaved or half.
    #[arg(long, default_value = "interleaved")]
    pub pairing: String,
    /// Positions analysed (a learned table: all its rows); at most 8192, 1024 for attention
    /// biases.
    #[arg(long, default_value_t = 128)]
    pub positions: usize,
    /// First position (sinusoidal).
    #[arg(long, default_value_t = 0)]
    pub start: usize,
    /// Reference position (row) of the offset curves.
    #[arg(long, default_value_t = 0)]
    pub reference: usize,
    /// Bases compared in the wavelength plot.
    #[arg(long, value_delimiter = ',', default_values_t = vec![100.0, 10_000.0, 100_000_000.0])]
    pub bases: Vec<f64>,
    /// Evaluation text for the attention terms of --run, one text per line (default: the
    /// model's own test set, remade from its config.json).
    #[arg(long, value_name = "FILE")]
    pub text: Option<PathBuf>,
    /// Texts used for the attention terms.
    #[arg(long, default_value_t = 64)]
    pub texts: usize,
    /// Output folder (default: runs/analysis-<what>-<timestamp>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    use poslab::analysis::{self, Table};
    if a.positions < 2 || a.positions > MAX_POSITIONS {
        anyhow::bail!(
            "--positions {} is out of range: analyse between 2 and {MAX_POSITIONS} positions",
            a.positions
        );
    }
    if a.reference >= a.positions {
        anyhow::bail!(
            "--reference {} is not among the {} positions analysed: use a row below {}",
            a.reference,
            a.positions,
            a.positions
        );
    }
    let bias_positions = a.positions.min(MAX_BIAS_POSITIONS);
    if let Some(scheme @ ("alibi" | "t5" | "kerple")) = a.scheme.as_deref() {
        return bias_by_name(scheme, &a, bias_positions);
    }
    if !(a.base.is_finite() && a.base > 1.0) || a.bases.iter().any(|b| !(b.is_finite() && *b > 1.0))
    {
        anyhow::bail!("bases must be finite numbers greater than 1");
    }
    let mut options = analysis::Options {
        reference: a.reference,
        bases: a.bases.clone(),
        seed: 0,
        rope: false,
    };
    let mut summary = String::new();
    let mut files = Vec::new();
    let (table, label, loaded) = match (&a.scheme, &a.run) {
        (_, Some(dir)) => {
            let loaded = load_model(
                dir,
                &Compute {
                    device: "cpu".into(),
                    dtype: Some(poslab::Precision::F32),
                },
            )?;
            let m = &loaded.config.model;
            let table = match &m.positional {
                p if p.has_learned_table() => {
                    let w = loaded
                        .params
                        .get("pos_emb.weight")
                        .context("the model's learned table `pos_emb.weight`")?;
                    let values = w.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                    Some(Table {
                        title: format!("learned table of {}", dir.display()),
                        start: 0,
                        rows: m.max_len,
                        dim: m.d_model,
                        values,
                        pairs: None,
                    })
                }
                other => analysis::fixed_table(other, m.d_model, m.head_dim(), a.positions),
            };
            options.rope = matches!(m.positional, PositionalConfig::Rope(_));
            let name = dir
                .file_name()
                .map_or("run".into(), |n| n.to_string_lossy().into_owned());
            (table, name, Some(loaded))
        }
        (Some(scheme), None) => {
            if a.dim < 2 || a.dim % 2 != 0 {
                anyhow::bail!(
                    "--dim {} must be even (a table of (sin, cos) pairs) and at least 2",
                    a.dim
                );
            }
            let table = if scheme == "rope" {
                options.rope = true;
                Table::rope(
                    a.dim,
                    a.base,
                    parse_option("pairing", &a.pairing)?,
                    a.positions,
                )
            } else {
                Table::sinusoidal(
                    a.dim,
                    a.base,
                    parse_option("layout", &a.layout)?,
                    a.positions,
                    a.start,
                )
            };
            (Some(table), scheme.clone(), None)
        }
        (None, None) => unreachable!("clap requires a scheme or --run"),
    };
    let dir = match &a.out {
        Some(dir) => dir.clone(),
        None => experiment::new_run_dir(Path::new("runs"), &format!("analysis-{label}"))?,
    };
    match &table {
        Some(table) => {
            let result = analysis::analyze(table, &options);
            summary.push_str(&result.summary());
            files.extend(result.write(table, &dir)?);
        }
        None => match &loaded {
            Some(l) if l.config.model.positional.name() != "none" => summary.push_str(&format!(
                "no position table: `{}` acts {} without one\n",
                l.config.model.positional.name(),
                l.config.model.positional.placement()
            )),
            _ => summary
                .push_str("no position table: this model has no positional scheme (`none`)\n"),
        },
    }
    if let Some(loaded) = &loaded {
        let encoder = loaded.model.encoder();
        if let Some(bias) = analysis::bias::encoder_biases(encoder, bias_positions)? {
            summary.push_str(&bias.summary());
            files.extend(bias.write(&dir)?);
        }
        match &loaded.config.model.positional {
            PositionalConfig::SinusoidalAdd(_) | PositionalConfig::Learned(_) => {
                let batch = analysis::terms::evaluation_batch(loaded, a.texts, a.text.as_deref());
                match batch {
                    // Without --text, a model that cannot remake its evaluation text still gets
                    // its table analysed.
                    Err(e) if a.text.is_none() => summary.push_str(&format!("attention terms skipped: {e}\n")),
                    Err(e) => return Err(e.into()),
                    Ok((ids, mask, cut)) => {
                        let terms = analysis::terms::attention_terms(loaded, &ids, &mask)?;
                        summary.push_str(&format!(
                            "attention logits (W_q(x+p))·(W_k(y+p')) split into four terms, on {} texts{}:\n",
                            ids.dim(0)?,
                            if cut > 0 { format!(" ({cut} cut to the learned table)") } else { String::new() }
                        ));
                        summary.push_str(&analysis::terms::summary(&terms));
                        files.extend(analysis::write_terms(&terms, "attention logits: content and position terms per head", &dir)?);
                    }
                }
            }
            other => summary.push_str(&format!(
                "attention terms: not defined for `{}` (positions are not added to the token embeddings)\n",
                other.name()
            )),
        }
        poslab::io::write_atomic(&dir.join("summary.txt"), summary.as_bytes())?;
    }
    print!("{summary}");
    println!("files in {}: {}", dir.display(), files.join(", "));
    Ok(())
}

/// `analyze alibi | t5 | kerple`: the bias by offset, per head.
fn bias_by_name(scheme: &str, a: &Args, positions: usize) -> Result<()> {
    use poslab::positional::{NoOptions, T5Options};
    if a.heads == 0 || a.heads > 64 {
        anyhow::bail!("--heads {} must be between 1 and 64", a.heads);
    }
    let positional = match scheme {
        "alibi" => PositionalConfig::Alibi(NoOptions {}),
        "kerple" => PositionalConfig::Kerple(NoOptions {}),
        _ => PositionalConfig::T5(T5Options {
            buckets: a.buckets,
            max_distance: a.max_distance,
        }),
    };
    positional
        .validate_options(2 * a.heads, 2)
        .map_err(anyhow::Error::msg)?;
    let bias = poslab::analysis::bias::scheme_biases(&positional, a.heads, positions)?;
    let dir = match &a.out {
        Some(dir) => dir.clone(),
        None => experiment::new_run_dir(Path::new("runs"), &format!("analysis-{scheme}"))?,
    };
    let summary = bias.summary();
    let files = bias.write(&dir)?;
    poslab::io::write_atomic(&dir.join("summary.txt"), summary.as_bytes())?;
    print!("{summary}");
    println!("files in {}: {}", dir.display(), files.join(", "));
    Ok(())
}
