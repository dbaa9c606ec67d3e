//! `poslab analyze`: what a positional scheme encodes, by name or in a trained model.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle::DType;
use poslab::PositionalConfig;

use super::{load_model, parse_option, Compute};

/// The most positions an analysis takes: tables and their distance matrices grow with its
/// square.
const MAX_POSITIONS: usize = 8192;
/// The most positions of an attention-bias analysis: a `P x P` matrix per head and layer.
const MAX_BIAS_POSITIONS: usize = 1024;
/// The widest table or head analysed by name.
const MAX_DIM: usize = 8192;
/// The most values of a table analysed by name (`--positions x --dim`): 2^24, 128 MiB of f64.
const MAX_TABLE_VALUES: usize = 1 << 24;

/// What a positional scheme encodes: the table as CSV and heatmap, row norms and principal
/// components, distance matrices, distance against offset, the relative-shift property, a linear
/// position probe, wavelengths, RoPE's decay; an attention bias by offset, per head; for a
/// trained model (--run) its table, its learned score biases, and how its attention logits split
/// into content and position terms.
#[derive(clap::Args)]
pub struct Args {
    /// `sinusoidal`, `rope`, `prope` (its spectrum beside RoPE's and `fraction`'s), or an
    /// attention bias: `alibi`, `t5`, `kerple`, `fire` (at two lengths: its interpolation); or
    /// give --run (FoX's gates exist only in a trained model).
    #[arg(value_parser = ["sinusoidal", "rope", "prope", "alibi", "t5", "kerple", "fire", "fox"], required_unless_present_any = ["run", "model"], conflicts_with_all = ["run", "model"])]
    pub scheme: Option<String>,
    /// A pretrained BERT-family encoder (a Hugging Face folder or Hub id): its learned position
    /// table, with the same measures, pictures and CSVs as a trained model's.
    #[arg(long, value_name = "PATH_OR_HUB_ID", conflicts_with = "run")]
    pub model: Option<String>,
    /// Heads of an attention bias (alibi, kerple).
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    /// T5: buckets.
    #[arg(long, default_value_t = 32)]
    pub buckets: usize,
    /// T5: the distance from which offsets share the last bucket.
    #[arg(long, default_value_t = 128)]
    pub max_distance: usize,
    /// RoPE: the share of each head rotated (its first int(dim x fraction) coordinates).
    #[arg(long, default_value_t = 1.0)]
    pub fraction: f64,
    /// p-RoPE: the share of a head's frequency pairs that rotate (the fastest).
    #[arg(long, default_value_t = 0.75)]
    pub keep: f64,
    /// FIRE: the threshold L (default: --positions, standing for the training length); its
    /// bias is drawn at --positions and at 4 times as many.
    #[arg(long)]
    pub threshold: Option<f64>,
    /// RoPE: the factor of the scalings whose wavelengths are compared.
    #[arg(long, default_value_t = 4.0)]
    pub factor: f64,
    /// RoPE: the training length the scalings start from (default: --positions, or a trained
    /// model's max_len).
    #[arg(long)]
    pub original_max_len: Option<usize>,
    /// With --run of a rope model: read the text with RoPE's frequencies rescaled,
    /// KIND[:FACTOR] (see `predict --help`); its factor also sets the wavelengths compared.
    #[arg(long, value_name = "KIND[:FACTOR]", value_parser = super::parse_rope_scaling, requires = "run")]
    pub rope_scaling: Option<poslab::positional::RopeScaling>,
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
    if a.dim > MAX_DIM || a.positions * a.dim.min(MAX_DIM) > MAX_TABLE_VALUES {
        anyhow::bail!(
            "--dim {} x --positions {}: a table of at most {MAX_DIM} columns and {MAX_TABLE_VALUES} \
             values in all is analysed; lower --dim or --positions",
            a.dim,
            a.positions
        );
    }
    if a.start > poslab::positional::MAX_POSITION - a.positions {
        anyhow::bail!(
            "--start {}: positions from there would pass the largest supported, {}; start at \
             most at {}",
            a.start,
            poslab::positional::MAX_POSITION,
            poslab::positional::MAX_POSITION - a.positions
        );
    }
    if a.texts == 0 || a.texts > 100_000 {
        anyhow::bail!(
            "--texts {}: give the number of texts for the attention terms, from 1 to 100000",
            a.texts
        );
    }
    let bias_positions = a.positions.min(MAX_BIAS_POSITIONS);
    match a.scheme.as_deref() {
        Some(scheme @ ("alibi" | "t5" | "kerple")) => {
            return bias_by_name(scheme, &a, bias_positions)
        }
        Some("fire") => return fire_by_name(&a),
        Some("prope") => return prope_by_name(&a),
        Some("fox") => anyhow::bail!(
            "fox: FoX's bias comes from the content (forget gates of each layer's input), so it \
             exists only in a trained model: give --run DIR of a fox model"
        ),
        _ => {}
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
    // RoPE's (rotated width, base, trained length), for the scaled-wavelengths plot.
    let mut wavelengths: Option<(usize, f64, usize)> = None;
    if !(a.factor.is_finite() && a.factor >= 1.0) || a.original_max_len == Some(0) {
        anyhow::bail!(
            "--factor {} must be a number of at least 1, and --original-max-len at least 1",
            a.factor
        );
    }
    let mut pretrained = None;
    let (table, label, mut loaded) = match (&a.scheme, &a.run) {
        _ if a.model.is_some() => {
            let spec = a.model.as_deref().expect("checked");
            let cpu = Compute {
                device: "cpu".into(),
                dtype: None,
            };
            let model = super::load_pretrained(spec, &cpu)?;
            let label = Path::new(spec)
                .file_name()
                .map_or("model".into(), |n| n.to_string_lossy().into_owned());
            let config = model.encoder.config();
            if config.positional.placement() == poslab::Placement::Attention {
                // No table (ModernBERT): its rotation's own table, at the global base.
                let table = analysis::fixed_table(
                    &config.positional,
                    config.d_model,
                    config.head_dim(),
                    a.positions,
                );
                pretrained = Some(model);
                (table, label, None)
            } else {
                let w = model
                    .params
                    .get("pos_emb.weight")
                    .context("the model's position table")?;
                // RoBERTa's first real token reads row padding_idx + 1: the table from there.
                let offset = model.encoder.config().embeddings.first_position;
                let w = w.narrow(0, offset, model.max_tokens())?;
                let (rows, dim) = w.dims2()?;
                let values = w.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                let title = match offset {
                    0 => format!("learned table of {spec}"),
                    o => format!(
                        "learned table of {spec} (rows from {o}, where its positions start)"
                    ),
                };
                let label = Path::new(spec)
                    .file_name()
                    .map_or("model".into(), |n| n.to_string_lossy().into_owned());
                let table = Table {
                    title,
                    start: 0,
                    rows,
                    dim,
                    values,
                    pairs: None,
                };
                pretrained = Some(model);
                (Some(table), label, None)
            }
        }
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
            if let PositionalConfig::Rope(o) = &m.positional {
                let original = a.original_max_len.unwrap_or(m.max_len);
                wavelengths = Some((o.rotary_dim(m.head_dim()), o.base, original));
            }
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
                let rd = poslab::positional::rotary_dim(a.dim, a.fraction);
                if !(a.fraction > 0.0 && a.fraction <= 1.0) || rd < 2 || rd % 2 != 0 {
                    anyhow::bail!(
                        "--fraction {} of --dim {} rotates int({} x {}) = {rd} coordinates: it \
                         must be in (0, 1] and leave an even number, at least 2",
                        a.fraction,
                        a.dim,
                        a.dim,
                        a.fraction
                    );
                }
                let original = a.original_max_len.unwrap_or(a.positions);
                wavelengths = Some((rd, a.base, original));
                Table::rope(
                    rd,
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
    if let Some(table) = &table {
        if table.rows < 2 {
            anyhow::bail!(
                "{}: {} row: distances, offsets and fits need at least 2 positions",
                table.title,
                table.rows
            );
        }
        if a.reference >= table.rows {
            anyhow::bail!(
                "--reference {} is not among the {} rows of the {}: use a row below {}",
                a.reference,
                table.rows,
                table.title,
                table.rows
            );
        }
    }
    let dir = match &a.out {
        Some(dir) => dir.clone(),
        None => poslab::io::new_run_dir(Path::new("runs"), &format!("analysis-{label}"))?,
    };
    match &table {
        Some(table) => {
            let result = analysis::analyze(table, &options);
            summary.push_str(&result.summary());
            files.extend(result.write(table, &dir)?);
        }
        None => match &loaded {
            Some(l) if l.config.model.positional.name() != "none" => summary.push_str(&format!(
                "no position table: `{}` acts as an {} (see below)\n",
                l.config.model.positional.name(),
                l.config.model.positional.placement()
            )),
            _ => summary
                .push_str("no position table: this model has no positional scheme (`none`)\n"),
        },
    }
    if let Some((rd, base, original)) = wavelengths {
        let factor = match a.rope_scaling.as_ref().map(|s| s.factor()) {
            Some(poslab::positional::Factor::Value(f)) => f,
            _ => a.factor,
        };
        let curves = analysis::rope::scaled_wavelengths(rd, base, factor, original);
        files.extend(analysis::rope::write_wavelengths(
            &curves, original, factor, &dir,
        )?);
        summary.push_str(&format!(
            "RoPE wavelengths of {} pairs, trained length {original}, factor {factor}: fastest \
             {:.1} positions; slowest {}\n",
            rd / 2,
            curves[0].1[0],
            curves
                .iter()
                .map(|(label, w)| format!("{label} {:.0}", w[w.len() - 1]))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if let Some(model) = pretrained
        .as_ref()
        .filter(|m| m.encoder.config().positional.placement() == poslab::Placement::Attention)
    {
        // A rotation in every layer (ModernBERT): which frequency pairs each layer's queries
        // and keys use, global layers beside local ones (Barbero et al. 2025).
        let (texts, source) = analysis::terms::pretrained_texts(a.texts, a.text.as_deref())?;
        let batch = model.batch(&texts, true)?;
        summary.push_str(&format!("on {} texts of {source}: ", texts.len()));
        rotation_analysis(
            &model.encoder,
            &batch.ids,
            &batch.mask,
            &dir,
            &mut summary,
            &mut files,
        )?;
        poslab::io::write_atomic(&dir.join("summary.txt"), summary.as_bytes())?;
    } else if let Some(model) = &pretrained {
        // TUPE's analysis of BERT: the first layer's logits on real text, split exactly.
        let (texts, source) = analysis::terms::pretrained_texts(a.texts, a.text.as_deref())?;
        let batch = model.batch(&texts, true)?;
        let terms = analysis::terms::attention_terms(&model.encoder, &batch.ids, &batch.mask)?;
        summary.push_str(&format!(
            "attention logits of the first layer (W_q(x+p))·(W_k(y+p')) split into four terms \
             (the embedding LayerNorm split exactly), on {} texts of {source}:\n",
            texts.len()
        ));
        summary.push_str(&analysis::terms::summary(&terms));
        files.extend(analysis::write_terms(
            &terms,
            "attention logits: content and position terms per head",
            &dir,
        )?);
        poslab::io::write_atomic(&dir.join("summary.txt"), summary.as_bytes())?;
    }
    if let Some(loaded) = &mut loaded {
        let encoder = loaded.model.encoder();
        if let Some(bias) = analysis::bias::encoder_biases(encoder, bias_positions)? {
            summary.push_str(&bias.summary());
            files.extend(bias.write(&dir)?);
        }
        scheme_analysis(loaded, &a, &dir, &mut summary, &mut files)?;
        if loaded.config.model.positional.placement() == poslab::Placement::Attention {
            match analysis::terms::evaluation_batch(loaded, a.texts, a.text.as_deref()) {
                Err(e) if a.text.is_none() => {
                    summary.push_str(&format!("RoPE pair energy skipped: {e}\n"))
                }
                Err(e) => return Err(e.into()),
                Ok((ids, mask, _)) => {
                    if let Some(scaling) = &a.rope_scaling {
                        rescale(loaded, scaling, ids.dim(1)?)?;
                        summary.push_str(&format!(
                            "read with rope scaling {}\n",
                            serde_json::to_string(&loaded.config.model.positional)?
                        ));
                    }
                    let encoder = loaded.model.encoder();
                    rotation_analysis(encoder, &ids, &mask, &dir, &mut summary, &mut files)?;
                }
            }
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
                        let terms = analysis::terms::attention_terms(loaded.model.encoder(), &ids, &mask)?;
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
    out!("{summary}");
    outln!("files in {}: {}", dir.display(), files.join(", "));
    Ok(())
}

/// A rotation's analysis of a model on a batch: each layer's q and k energy per RoPE frequency
/// pair, and what the rotation adds to its scores, as text and files.
fn rotation_analysis(
    encoder: &poslab::Encoder,
    ids: &candle::Tensor,
    mask: &candle::Tensor,
    dir: &Path,
    summary: &mut String,
    files: &mut Vec<String>,
) -> Result<()> {
    use poslab::analysis;
    let energy = analysis::rope::pair_energy(encoder, ids, mask)?;
    summary.push_str(&analysis::rope::energy_summary(&energy));
    files.extend(analysis::rope::write_energy(&energy, dir)?);
    let terms = analysis::terms::rotation_terms(encoder, ids, mask)?;
    summary.push_str(&analysis::terms::rotation_summary(&terms));
    files.extend(analysis::terms::write_rotation_terms(&terms, dir)?);
    Ok(())
}

/// What only a trained FIRE, p-RoPE or FoX model has: FIRE's curves at the training length and
/// 4x; p-RoPE's spectrum; FoX's gates on the evaluation text.
fn scheme_analysis(
    loaded: &poslab::saved::Loaded,
    a: &Args,
    dir: &Path,
    summary: &mut String,
    files: &mut Vec<String>,
) -> Result<()> {
    use poslab::analysis::{self, schemes};
    let encoder = loaded.model.encoder();
    let model = &loaded.config.model;
    match &model.positional {
        PositionalConfig::Fire(_) => {
            let trained = model.max_len.clamp(2, MAX_BIAS_POSITIONS);
            let lengths = [trained, (4 * trained).min(MAX_BIAS_POSITIONS)];
            let mut curves = schemes::fire_curves(
                "fire: the learned bias per head, at the training length and 4x".into(),
                &lengths,
                |n| {
                    Ok(encoder
                        .score_bias(0, &poslab::Positions::range(0, n)?)?
                        .expect("fire has a score bias"))
                },
            )?;
            if let poslab::positional::PositionalModule::ScoreBias(bias) = encoder.positional() {
                curves.notes = bias.notes()?;
            }
            summary.push_str(&curves.summary());
            files.extend(curves.write(dir)?);
        }
        PositionalConfig::Prope(o) => {
            let spectra = schemes::rotation_spectra(model.head_dim(), o.base, o.keep);
            let (text, written) = schemes::write_spectra(&spectra, model.head_dim(), dir)?;
            summary.push_str(&text);
            files.extend(written);
        }
        PositionalConfig::Fox(_) => {
            match analysis::terms::evaluation_batch(loaded, a.texts, a.text.as_deref()) {
                Err(e) if a.text.is_none() => {
                    summary.push_str(&format!("FoX gates skipped: {e}\n"))
                }
                Err(e) => return Err(e.into()),
                Ok((ids, mask, _)) => {
                    let tokenizer = &loaded.tokenizer;
                    let gates = schemes::fox_gates(encoder, &ids, &mask, |id| {
                        tokenizer
                            .id_to_token(id)
                            .unwrap_or_else(|| format!("#{id}"))
                    })?;
                    summary.push_str(&gates.summary());
                    files.extend(gates.write(dir)?);
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// `analyze fire`: FIRE at initialisation (seed 0) at --positions and 4x as many, with the
/// threshold at --positions: past the threshold, the longer sequence's curve is the shorter's
/// stretched over its span.
fn fire_by_name(a: &Args) -> Result<()> {
    use poslab::positional::FireOptions;
    if a.heads == 0 || a.heads > 64 {
        anyhow::bail!("--heads {} must be between 1 and 64", a.heads);
    }
    let short = a.positions.min(MAX_BIAS_POSITIONS / 4);
    let threshold = a.threshold.unwrap_or(short as f64);
    let positional = PositionalConfig::Fire(FireOptions::threshold(threshold));
    positional
        .validate_options(2 * a.heads, 2)
        .map_err(anyhow::Error::msg)?;
    let (module, _store) = poslab::analysis::bias::module_by_name(&positional, a.heads, short)?;
    let mut curves = poslab::analysis::schemes::fire_curves(
        format!(
            "fire, {} heads, threshold {threshold}: the bias at initialisation (seed 0)",
            a.heads
        ),
        &[short, 4 * short],
        |n| {
            let positions = poslab::Positions::range(0, n)?;
            poslab::analysis::bias::shared_bias(&module, &positions, "fire")
        },
    )?;
    curves.notes = module.notes()?;
    curves.notes.push(
        "inputs sign(j - i) ln(|c| |j - i| + 1) / ln(|c| max(L, span) + 1): up to the threshold \
         the curve is the raw one; at 4x the span it is stretched to the same [-1, 1] \
         (fire_by_relative_offset.png)"
            .into(),
    );
    let dir = match &a.out {
        Some(dir) => dir.clone(),
        None => poslab::io::new_run_dir(Path::new("runs"), "analysis-fire")?,
    };
    let summary = curves.summary();
    let files = curves.write(&dir)?;
    poslab::io::write_atomic(&dir.join("summary.txt"), summary.as_bytes())?;
    out!("{summary}");
    outln!("files in {}: {}", dir.display(), files.join(", "));
    Ok(())
}

/// `analyze prope`: p-RoPE's spectrum at --keep beside RoPE's and `fraction`'s at the same
/// share, for a head of --dim.
fn prope_by_name(a: &Args) -> Result<()> {
    let positional = PositionalConfig::Prope(poslab::positional::PropeOptions {
        base: a.base,
        keep: a.keep,
        ..Default::default()
    });
    positional
        .validate_options(a.dim, a.dim)
        .map_err(anyhow::Error::msg)?;
    let spectra = poslab::analysis::schemes::rotation_spectra(a.dim, a.base, a.keep);
    let dir = match &a.out {
        Some(dir) => dir.clone(),
        None => poslab::io::new_run_dir(Path::new("runs"), "analysis-prope")?,
    };
    let (summary, files) = poslab::analysis::schemes::write_spectra(&spectra, a.dim, &dir)?;
    poslab::io::write_atomic(&dir.join("summary.txt"), summary.as_bytes())?;
    out!("{summary}");
    outln!("files in {}: {}", dir.display(), files.join(", "));
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
        None => poslab::io::new_run_dir(Path::new("runs"), &format!("analysis-{scheme}"))?,
    };
    let summary = bias.summary();
    let files = bias.write(&dir)?;
    poslab::io::write_atomic(&dir.join("summary.txt"), summary.as_bytes())?;
    out!("{summary}");
    outln!("files in {}: {}", dir.display(), files.join(", "));
    Ok(())
}

/// Rebuilds a loaded rope model with its frequencies rescaled (the same weights); an `auto`
/// factor is the text's length `longest` over the model's `max_len`, at least 1.
fn rescale(
    loaded: &mut poslab::saved::Loaded,
    scaling: &poslab::positional::RopeScaling,
    longest: usize,
) -> Result<()> {
    let model = &loaded.config.model;
    let PositionalConfig::Rope(options) = &model.positional else {
        anyhow::bail!(
            "--rope-scaling applies to rope models; this one's scheme is `{}`",
            model.positional.name()
        );
    };
    let config = poslab::ModelConfig {
        positional: PositionalConfig::Rope(poslab::RopeOptions {
            scaling: Some(scaling.resolved(
                longest as f64 / model.max_len.max(1) as f64,
                model.max_len.max(1),
            )),
            ..options.clone()
        }),
        ..model.clone()
    };
    let encoder = loaded.model.encoder();
    let vb = loaded.params.var_builder(encoder.dtype(), encoder.device());
    loaded.model = poslab::model::TaskModel::new(&config, &loaded.config.head, vb)?;
    loaded.config.model = config;
    Ok(())
}
