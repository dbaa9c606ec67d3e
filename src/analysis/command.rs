//! `poslab analyze`: what a positional scheme encodes, by name, in a model poslab trained, or
//! in a pretrained encoder. [`Request`] is what the command's flags ask for; [`Request::run`]
//! writes the files and returns the summary.

use std::path::{Path, PathBuf};

use candle::{DType, Tensor};

use crate::analysis::{self, Table};
use crate::error::{Error, Result};
use crate::positional::{FixedTable, Knobs, Measure, Portrait, RopePairing, TableLayout};
use crate::PositionalConfig;

/// Returns an input error with a formatted message.
macro_rules! bail {
    ($($t:tt)*) => {
        return Err(Error::Input(format!($($t)*)))
    };
}

/// The most positions an analysis takes: tables and their distance matrices grow with its
/// square.
const MAX_POSITIONS: usize = 8192;
/// The most positions of an attention-bias analysis: a `P x P` matrix per head and layer.
const MAX_BIAS_POSITIONS: usize = 1024;
/// The widest table or head analysed by name.
const MAX_DIM: usize = 8192;
/// The most values of a table analysed by name (`--positions x --dim`): 2^24, 128 MiB of f64.
const MAX_TABLE_VALUES: usize = 1 << 24;

/// The name `analyze` gives the sinusoidal table, which is `sinusoidal_add`'s (and the default
/// without --run or --model).
const SINUSOIDAL: &str = "sinusoidal";

/// The schemes `analyze` takes by name: `sinusoidal` (the sinusoidal table), then every scheme of
/// [`PositionalConfig::catalog`]; a scheme that exists only in a trained model says so.
pub fn scheme_names() -> Vec<&'static str> {
    let mut names = vec![SINUSOIDAL];
    names.extend(PositionalConfig::names());
    names
}

/// What a positional scheme encodes: the table as CSV and heatmap, row norms and principal
/// components, distance matrices, distance against offset, the relative-shift property, a linear
/// position probe, wavelengths, RoPE's decay; an attention bias by offset, per head; for a
/// trained model (--run) its table, its learned score biases, and how its attention logits split
/// into content and position terms. The `poslab analyze` command's flags, each field's default
/// [`Request::default`]'s.
#[derive(Clone, Debug)]
pub struct Request {
    /// A scheme drawn by name ([`scheme_names`]): `sinusoidal`, `rope`, `prope` (its spectrum
    /// beside RoPE's and `fraction`'s), or an attention bias: `alibi`, `t5`, `kerple`, `fire` (at
    /// two lengths: its interpolation); or give --run (learned positions, FoX's gates, CoPE's
    /// counts and PaTH's transport exist only in a trained model).
    pub scheme: Option<String>,
    /// A pretrained BERT-family encoder (a Hugging Face folder or Hub id): its learned position
    /// table, with the same measures, pictures and CSVs as a trained model's.
    pub model: Option<String>,
    /// Heads of an attention bias (alibi, kerple).
    pub heads: usize,
    /// T5: buckets.
    pub buckets: usize,
    /// T5: the distance from which offsets share the last bucket.
    pub max_distance: usize,
    /// RoPE: the share of each head rotated (its first int(dim x fraction) coordinates).
    pub fraction: f64,
    /// p-RoPE: the share of a head's frequency pairs that rotate (the fastest).
    pub keep: f64,
    /// FIRE: the threshold L (default: --positions, standing for the training length); its
    /// bias is drawn at --positions and at 4 times as many.
    pub threshold: Option<f64>,
    /// RoPE: the factor of the scalings whose wavelengths are compared.
    pub factor: f64,
    /// RoPE: the training length the scalings start from (default: --positions, or a trained
    /// model's max_len).
    pub original_max_len: Option<usize>,
    /// With --run of a rope model: read the text with RoPE's frequencies rescaled,
    /// `KIND[:FACTOR]` (see `predict --help`); its factor also sets the wavelengths compared.
    pub rope_scaling: Option<crate::positional::RopeScaling>,
    /// A trained model's folder.
    pub run: Option<PathBuf>,
    /// Width of the table (sinusoidal) or of a head (rope).
    pub dim: usize,
    /// The base of the sinusoid's or rotation's frequencies.
    pub base: f64,
    /// Sinusoidal layout.
    pub layout: TableLayout,
    /// RoPE pairing.
    pub pairing: RopePairing,
    /// Positions analysed (a learned table: all its rows); at most 8192, 1024 for attention
    /// biases.
    pub positions: usize,
    /// First position (sinusoidal).
    pub start: usize,
    /// Reference position (row) of the offset curves.
    pub reference: usize,
    /// Bases compared in the wavelength plot.
    pub bases: Vec<f64>,
    /// Evaluation text for the attention terms of --run, one text per line (default: the
    /// model's own test set, remade from its config.json).
    pub text: Option<PathBuf>,
    /// Texts used for the attention terms.
    pub texts: usize,
    /// Output folder (default: `runs/analysis-<what>-<timestamp>`).
    pub out: Option<PathBuf>,
    /// The kernels and instruction sets a model's passes compute with.
    pub backend: crate::nn::Backend,
    /// How large a model, and the batch of text it reads, may be.
    pub limits: crate::limits::Limits,
}

/// The attention tables of `(b, h, t, t)` an analysis of text holds beside a forward pass's, a
/// layer: the four terms of the logits and the weights, kept for every layer.
const ANALYSIS_TABLES: usize = 5;

impl Default for Request {
    /// What `poslab analyze` takes when a flag is not given.
    fn default() -> Self {
        Self {
            scheme: None,
            model: None,
            heads: 8,
            buckets: 32,
            max_distance: 128,
            fraction: 1.0,
            keep: 0.75,
            threshold: None,
            factor: 4.0,
            original_max_len: None,
            rope_scaling: None,
            run: None,
            dim: 64,
            base: 10_000.0,
            layout: TableLayout::Interleaved,
            pairing: RopePairing::Interleaved,
            positions: 128,
            start: 0,
            reference: 0,
            bases: vec![100.0, 10_000.0, 100_000_000.0],
            text: None,
            texts: 64,
            out: None,
            backend: crate::nn::Backend::default(),
            limits: crate::limits::Limits::default(),
        }
    }
}

/// What an analysis wrote, and its summary.
#[derive(Debug)]
pub struct Report {
    /// The folder of its files.
    pub dir: PathBuf,
    /// The summary (also in `summary.txt`).
    pub summary: String,
    /// The files written, by name.
    pub files: Vec<String>,
}

/// What is analysed: a table, and what comes with it.
struct Subject {
    /// The position table, if the scheme has one.
    table: Option<Table>,
    /// Names the default output folder.
    label: String,
    /// A model poslab trained (`--run`).
    loaded: Option<crate::saved::Loaded>,
    /// A pretrained encoder (`--model`).
    pretrained: Option<crate::pretrained::Pretrained>,
    /// RoPE's (rotated width, base, trained length), for the scaled-wavelengths plot; set
    /// exactly when the table is RoPE's (whose analysis adds the decay of its scores).
    wavelengths: Option<(usize, f64, usize)>,
}

impl Request {
    /// Analyses what was asked into `--out` (default `runs/analysis-<what>-<timestamp>`):
    /// CSVs, PNGs and `summary.txt`.
    pub fn run(&self) -> Result<Report> {
        self.check_sizes()?;
        let bias_positions = self.positions.min(MAX_BIAS_POSITIONS);
        let by_name = match (&self.scheme, &self.model, &self.run) {
            (Some(name), _, _) => Some(name.as_str()),
            (None, None, None) => Some(SINUSOIDAL),
            _ => None,
        };
        let table = match by_name.map(|name| self.portrait(name)).transpose()? {
            Some(Portrait::Table(table)) => Some(table),
            Some(drawn) => return self.draw(by_name.unwrap_or_default(), drawn, bias_positions),
            None => None,
        };
        self.check_frequencies()?;
        let mut subject = self.subject(by_name, table)?;
        self.check_table(subject.table.as_ref())?;
        let dir = self.out_dir(&subject.label)?;
        let mut summary = String::new();
        let mut files = Vec::new();
        let options = analysis::Options {
            reference: self.reference,
            bases: self.bases.clone(),
            seed: 0,
            rope: subject.wavelengths.is_some(),
        };
        let mut page = analysis::page::Page::new(format!("poslab analyze: {}", subject.label));
        if subject
            .loaded
            .as_ref()
            .is_some_and(|l| l.config.model.causal)
        {
            summary.push_str(
                "causal model: every query reads the keys at or before it only; what is shown \
                 for keys after the query (offsets j - i > 0) is never read\n",
            );
        }
        match &subject.table {
            Some(table) => {
                let result = analysis::analyze(table, &options)?;
                summary.push_str(&result.summary());
                files.extend(result.write(table, &dir)?);
                page.table(table, &self.bases);
                page.analysis(&result);
            }
            None => summary.push_str(&no_table(subject.loaded.as_ref())),
        }
        if let Some(rope) = subject.wavelengths {
            self.wavelengths(rope, &dir, &mut summary, &mut files, &mut page)?;
        }
        if let Some(model) = &subject.pretrained {
            self.pretrained_terms(model, &dir, &mut summary, &mut files, &mut page)?;
        }
        if let Some(loaded) = &mut subject.loaded {
            self.trained(
                loaded,
                bias_positions,
                &dir,
                &mut summary,
                &mut files,
                &mut page,
            )?;
        }
        finish(dir, summary, files, page)
    }

    /// Refuses evaluation text `ids` `(b, t)` whose analysis by `encoder` would need more
    /// memory than [`Request::limits`] allows: a forward pass with every layer's attention
    /// tables, and the terms of each, kept.
    fn check_text(&self, encoder: &crate::Encoder, ids: &Tensor) -> Result<()> {
        let (b, t) = ids.dims2()?;
        let mut sizes = encoder.config().sizes_on(encoder.compute());
        sizes.score_tensors[1] = sizes.score_tensors[0] + ANALYSIS_TABLES;
        self.limits
            .check_batch(
                &sizes,
                b,
                t,
                true,
                &format!(
                    "analyze: {b} texts of up to {t} tokens (fewer --texts or shorter lines fit)"
                ),
            )
            .map_err(Error::Config)
    }

    /// The scheme named `name` as the flags draw it by name ([`Portray::without_model`]); `sinusoidal`
    /// is `sinusoidal_add`'s table.
    ///
    /// [`Portray::without_model`]: crate::positional::Portray::without_model
    fn portrait(&self, name: &str) -> Result<Portrait> {
        let scheme = match name {
            SINUSOIDAL => "sinusoidal_add",
            other => other,
        };
        let Some(config) = PositionalConfig::named(scheme, self.dim) else {
            bail!(
                "`{name}` is not a scheme analyze draws by name: use one of {}",
                scheme_names().join(", ")
            );
        };
        let knobs = Knobs {
            dim: self.dim,
            base: self.base,
            layout: self.layout,
            pairing: self.pairing,
            fraction: self.fraction,
            keep: self.keep,
            buckets: self.buckets,
            max_distance: self.max_distance,
            threshold: self.threshold.unwrap_or(self.interpolated_length() as f64),
            heads: self.heads,
        };
        config.scheme().without_model(&knobs).map_err(Error::Input)
    }

    /// A scheme by name without a table of positions: its bias by offset, the offset index of
    /// its learned values, its interpolation, or its rotation's spectrum.
    fn draw(&self, name: &str, portrait: Portrait, bias_positions: usize) -> Result<Report> {
        let (d_model, head_dim) = match &portrait {
            Portrait::Spectrum { .. } => (self.dim, self.dim),
            _ => {
                if self.heads == 0 || self.heads > 64 {
                    bail!("--heads {} must be between 1 and 64", self.heads);
                }
                (2 * self.heads, 2)
            }
        };
        if let Some(config) = portrait.config() {
            config
                .validate_options(d_model, head_dim)
                .map_err(Error::Config)?;
        }
        match portrait {
            Portrait::Table(_) => bail!("{name}: a table is analysed as a subject"),
            Portrait::Bias(config) => {
                let bias = analysis::bias::scheme_biases(
                    &config,
                    self.heads,
                    bias_positions,
                    self.backend,
                )?;
                self.bias_report(name, bias)
            }
            Portrait::Index(config) => match config.scheme().offset_index(bias_positions) {
                Some(index) => {
                    self.bias_report(name, analysis::bias::index_drawing(index, bias_positions))
                }
                None => bail!("{name}: no offset index to draw"),
            },
            Portrait::Interpolation {
                config,
                title,
                note,
            } => self.interpolation(name, &config, title, note),
            Portrait::Spectrum { base, keep, .. } => self.spectrum(name, base, keep),
        }
    }

    /// The flags' bounds, before anything is read or written.
    fn check_sizes(&self) -> Result<()> {
        let a = self;
        if a.positions < 2 || a.positions > MAX_POSITIONS {
            bail!(
                "--positions {} is out of range: analyse between 2 and {MAX_POSITIONS} positions",
                a.positions
            );
        }
        if a.reference >= a.positions {
            bail!(
                "--reference {} is not among the {} positions analysed: use a row below {}",
                a.reference,
                a.positions,
                a.positions
            );
        }
        if a.dim > MAX_DIM || a.positions * a.dim.min(MAX_DIM) > MAX_TABLE_VALUES {
            bail!(
                "--dim {} x --positions {}: a table of at most {MAX_DIM} columns and \
                 {MAX_TABLE_VALUES} values in all is analysed; lower --dim or --positions",
                a.dim,
                a.positions
            );
        }
        if a.start > crate::positional::MAX_POSITION - a.positions {
            bail!(
                "--start {}: positions from there would pass the largest supported, {}; start \
                 at most at {}",
                a.start,
                crate::positional::MAX_POSITION,
                crate::positional::MAX_POSITION - a.positions
            );
        }
        if a.texts == 0 || a.texts > 100_000 {
            bail!(
                "--texts {}: give the number of texts for the attention terms, from 1 to 100000",
                a.texts
            );
        }
        Ok(())
    }

    /// The bounds of the frequencies' flags, for a table or a model.
    fn check_frequencies(&self) -> Result<()> {
        let a = self;
        if !(a.base.is_finite() && a.base > 1.0)
            || a.bases.iter().any(|b| !(b.is_finite() && *b > 1.0))
        {
            bail!("bases must be finite numbers greater than 1");
        }
        if !(a.factor.is_finite() && a.factor >= 1.0) || a.original_max_len == Some(0) {
            bail!(
                "--factor {} must be a number of at least 1, and --original-max-len at least 1",
                a.factor
            );
        }
        Ok(())
    }

    /// A table needs 2 rows, and the reference row among them.
    fn check_table(&self, table: Option<&Table>) -> Result<()> {
        let Some(table) = table else {
            return Ok(());
        };
        if table.rows < 2 {
            bail!(
                "{}: {} row: distances, offsets and fits need at least 2 positions",
                table.title,
                table.rows
            );
        }
        if self.reference >= table.rows {
            bail!(
                "--reference {} is not among the {} rows of the {}: use a row below {}",
                self.reference,
                table.rows,
                table.title,
                table.rows
            );
        }
        Ok(())
    }

    /// `--out`, or a new `runs/analysis-<label>-<timestamp>`.
    fn out_dir(&self, label: &str) -> Result<PathBuf> {
        match &self.out {
            Some(dir) => Ok(dir.clone()),
            None => crate::io::new_run_dir(Path::new("runs"), "analysis", label),
        }
    }

    /// What `--model`, `--run` or the scheme's name (`name`, drawn as `table`) gives to
    /// analyse.
    fn subject(&self, name: Option<&str>, table: Option<FixedTable>) -> Result<Subject> {
        if let Some(spec) = &self.model {
            return self.pretrained_subject(spec);
        }
        if let Some(dir) = &self.run {
            return self.trained_subject(dir);
        }
        let (Some(name), Some(table)) = (name, table) else {
            bail!("give a scheme's name, --run DIR or --model PATH_OR_HUB_ID to analyse");
        };
        let a = self;
        if a.dim < 2 || !a.dim.is_multiple_of(2) {
            bail!(
                "--dim {} must be even (a table of (sin, cos) pairs) and at least 2",
                a.dim
            );
        }
        let mut subject = Subject {
            table: None,
            label: name.into(),
            loaded: None,
            pretrained: None,
            wavelengths: None,
        };
        if let FixedTable::Rotation { dim: rd, base, .. } = table {
            if !(a.fraction > 0.0 && a.fraction <= 1.0) || rd < 2 || !rd.is_multiple_of(2) {
                bail!(
                    "--fraction {} of --dim {} rotates int({} x {}) = {rd} coordinates: it must \
                     be in (0, 1] and leave an even number, at least 2",
                    a.fraction,
                    a.dim,
                    a.dim,
                    a.fraction
                );
            }
            let original = a.original_max_len.unwrap_or(a.positions);
            subject.wavelengths = Some((rd, base, original));
        }
        subject.table = Some(Table::fixed(table, a.positions, a.start));
        Ok(subject)
    }

    /// A pretrained encoder's learned table (from the row its positions start at), or its
    /// rotation's table (ModernBERT).
    fn pretrained_subject(&self, spec: &str) -> Result<Subject> {
        let mut model =
            crate::pretrained::Pretrained::open_within(spec, &candle::Device::Cpu, &self.limits)?;
        model.encoder.set_backend(self.backend);
        let label = Path::new(spec)
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned());
        let config = model.encoder.config();
        let table = match model.encoder.learned_table() {
            None => analysis::fixed_table(
                &config.positional,
                config.d_model,
                config.head_dim(),
                self.positions,
            ),
            Some(w) => {
                // RoBERTa's first real token reads row padding_idx + 1: the table from there.
                let offset = config.embeddings.first_position;
                let w = w.narrow(0, offset, model.max_tokens())?;
                let (rows, dim) = w.dims2()?;
                let values = w.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                let title = match offset {
                    0 => format!("learned table of {spec}"),
                    o => format!(
                        "learned table of {spec} (rows from {o}, where its positions start)"
                    ),
                };
                Some(Table {
                    title,
                    start: 0,
                    rows,
                    dim,
                    values,
                    pairs: None,
                })
            }
        };
        Ok(Subject {
            table,
            label,
            loaded: None,
            pretrained: Some(model),
            wavelengths: None,
        })
    }

    /// A trained model's learned table, or its scheme's fixed one.
    fn trained_subject(&self, dir: &Path) -> Result<Subject> {
        if let Some(what) = crate::runs::folder::not_a_model(dir) {
            bail!("--run {}: {what}", dir.display());
        }
        let mut loaded = crate::saved::load_within(
            dir,
            (
                DType::F32,
                &candle::Device::Cpu,
                Some(crate::Precision::F32),
            ),
            &self.limits,
        )?;
        loaded.model.set_backend(self.backend);
        let m = &loaded.config.model;
        let table = match loaded.model.encoder().learned_table() {
            Some(w) => Some(Table {
                title: format!("learned table of {}", dir.display()),
                start: 0,
                rows: m.max_len,
                dim: m.d_model,
                values: w.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?,
                pairs: None,
            }),
            None => analysis::fixed_table(&m.positional, m.d_model, m.head_dim(), self.positions),
        };
        let wavelengths = match m.positional.scheme().fixed_table(m.d_model, m.head_dim()) {
            Some(FixedTable::Rotation { dim, base, .. }) => {
                Some((dim, base, self.original_max_len.unwrap_or(m.max_len)))
            }
            _ => None,
        };
        let label = run_label(dir);
        Ok(Subject {
            table,
            label,
            loaded: Some(loaded),
            pretrained: None,
            wavelengths,
        })
    }

    /// RoPE's wavelengths under each scaling at the factor asked for.
    fn wavelengths(
        &self,
        (rd, base, original): (usize, f64, usize),
        dir: &Path,
        summary: &mut String,
        files: &mut Vec<String>,
        page: &mut analysis::page::Page,
    ) -> Result<()> {
        let factor = match self.rope_scaling.as_ref().map(|s| s.factor()) {
            Some(crate::positional::Factor::Value(f)) => f,
            _ => self.factor,
        };
        let curves = analysis::rope::scaled_wavelengths(rd, base, factor, original);
        page.scaled_wavelengths(&curves, original);
        files.extend(analysis::rope::write_wavelengths(
            &curves, original, factor, dir,
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
        Ok(())
    }

    /// A pretrained encoder on real text: with a rotation in every layer (ModernBERT), which
    /// frequency pairs each layer uses (Barbero et al. 2025); else TUPE's split of the first
    /// layer's logits.
    fn pretrained_terms(
        &self,
        model: &crate::pretrained::Pretrained,
        dir: &Path,
        summary: &mut String,
        files: &mut Vec<String>,
        page: &mut analysis::page::Page,
    ) -> Result<()> {
        let (texts, source) = analysis::terms::pretrained_texts(self.texts, self.text.as_deref())?;
        let batch = model.batch(&texts, true)?;
        let encoder = &model.encoder;
        self.check_text(encoder, &batch.ids)?;
        if encoder.config().positional.placement() == crate::Placement::Rotation {
            summary.push_str(&format!("on {} texts of {source}: ", texts.len()));
            return rotation_analysis(encoder, &batch.ids, &batch.mask, dir, summary, files);
        }
        summary.push_str(&format!(
            "attention logits of the first layer (W_q(x+p))·(W_k(y+p')) split into four terms \
             (the embedding LayerNorm split exactly), on {} texts of {source}:\n",
            texts.len()
        ));
        write_terms(encoder, &batch.ids, &batch.mask, dir, summary, files, page)
    }

    /// What only a trained model has: its score biases, its scheme's own measures, RoPE's pair
    /// energy, and the split of its logits into content and position terms.
    fn trained(
        &self,
        loaded: &mut crate::saved::Loaded,
        bias_positions: usize,
        dir: &Path,
        summary: &mut String,
        files: &mut Vec<String>,
        page: &mut analysis::page::Page,
    ) -> Result<()> {
        if let Some(bias) = analysis::bias::encoder_biases(loaded.model.encoder(), bias_positions)?
        {
            summary.push_str(&bias.summary());
            files.extend(bias.write(dir)?);
            page.bias(&bias);
        }
        scheme_analysis(loaded, self, dir, summary, files)?;
        let text = self.text.as_deref();
        if loaded.config.model.positional.placement() == crate::Placement::Rotation {
            match analysis::terms::evaluation_batch(loaded, self.texts, text) {
                // Without --text, a model that cannot remake its evaluation text still gets
                // its table analysed.
                Err(e) if text.is_none() => {
                    summary.push_str(&format!("RoPE pair energy skipped: {e}\n"))
                }
                Err(e) => return Err(e),
                Ok((ids, mask, _)) => {
                    self.check_text(loaded.model.encoder(), &ids)?;
                    if let Some(scaling) = &self.rope_scaling {
                        rescale(loaded, scaling, ids.dim(1)?)?;
                        summary.push_str(&format!(
                            "read with rope scaling {}\n",
                            serde_json::to_string(&loaded.config.model.positional)
                                .expect("configs serialize")
                        ));
                    }
                    let encoder = loaded.model.encoder();
                    rotation_analysis(encoder, &ids, &mask, dir, summary, files)?;
                }
            }
        }
        let positional = &loaded.config.model.positional;
        if !loaded.model.encoder().has_position_terms() {
            summary.push_str(&format!(
                "attention terms: not defined for `{}` (positions are not joined to the token \
                 embeddings)\n",
                positional.name()
            ));
            return Ok(());
        }
        let (ids, mask, cut) = match analysis::terms::evaluation_batch(loaded, self.texts, text) {
            Err(e) if text.is_none() => {
                summary.push_str(&format!("attention terms skipped: {e}\n"));
                return Ok(());
            }
            batch => batch?,
        };
        self.check_text(loaded.model.encoder(), &ids)?;
        summary.push_str(&format!(
            "attention logits (W_q(x+p))·(W_k(y+p')) split into four terms (x the content, p the \
             positions: [x ; 0] and [0 ; p] for a concatenation), on {} texts{}:\n",
            ids.dim(0)?,
            match cut {
                0 => String::new(),
                cut => format!(" ({cut} cut to the learned table)"),
            }
        ));
        write_terms(
            loaded.model.encoder(),
            &ids,
            &mask,
            dir,
            summary,
            files,
            page,
        )
    }
}

/// The line for a subject without a table.
fn no_table(loaded: Option<&crate::saved::Loaded>) -> String {
    match loaded {
        Some(l) if l.config.model.positional.name() != "none" => format!(
            "no position table: `{}` acts in the {} (see below)\n",
            l.config.model.positional.name(),
            l.config.model.positional.placement()
        ),
        _ => "no position table: this model has no positional scheme (`none`)\n".into(),
    }
}

/// The split of an encoder's logits into content and position terms, as text and files.
fn write_terms(
    encoder: &crate::Encoder,
    ids: &candle::Tensor,
    mask: &candle::Tensor,
    dir: &Path,
    summary: &mut String,
    files: &mut Vec<String>,
    page: &mut analysis::page::Page,
) -> Result<()> {
    let terms = analysis::terms::attention_terms(encoder, ids, mask)?;
    summary.push_str(&analysis::terms::summary(&terms));
    let title = "attention logits: content and position terms per head";
    files.extend(analysis::write_terms(&terms, title, dir)?);
    page.terms(&terms, title);
    Ok(())
}

/// A rotation's analysis of a model on a batch: each layer's q and k energy per RoPE frequency
/// pair, and what the rotation adds to its scores, as text and files.
fn rotation_analysis(
    encoder: &crate::Encoder,
    ids: &candle::Tensor,
    mask: &candle::Tensor,
    dir: &Path,
    summary: &mut String,
    files: &mut Vec<String>,
) -> Result<()> {
    use crate::analysis;
    let energy = analysis::rope::pair_energy(encoder, ids, mask)?;
    summary.push_str(&analysis::rope::energy_summary(&energy));
    files.extend(analysis::rope::write_energy(&energy, dir)?);
    let terms = analysis::terms::rotation_terms(encoder, ids, mask)?;
    summary.push_str(&analysis::terms::rotation_summary(&terms));
    files.extend(analysis::terms::write_rotation_terms(&terms, dir)?);
    Ok(())
}

/// What only a trained model of some schemes has ([`Portray::measure`]): FIRE's curves at the
/// training length and 4x; p-RoPE's spectrum; FoX's gates on the evaluation text; PoPE's score
/// against the offset; CoPE's counts and PaTH's turning of keys on the evaluation text.
///
/// [`Portray::measure`]: crate::positional::Portray::measure
fn scheme_analysis(
    loaded: &crate::saved::Loaded,
    a: &Request,
    dir: &Path,
    summary: &mut String,
    files: &mut Vec<String>,
) -> Result<()> {
    use crate::analysis::{self, schemes};
    let encoder = loaded.model.encoder();
    let model = &loaded.config.model;
    let name = model.positional.name();
    let Some(measure) = model.positional.scheme().measure() else {
        // Scores of the scheme's own with no measure of their own (GRAPE's): what its learned
        // parameters hold, summarised (a score bias's analysis lists them already).
        let positional = encoder.positional();
        if positional.score_bias().is_none() {
            for line in positional.notes()? {
                summary.push_str(&format!("{name}: {line}\n"));
            }
        }
        return Ok(());
    };
    let text = match measure.reads_text() {
        false => None,
        true => match analysis::terms::evaluation_batch(loaded, a.texts, a.text.as_deref()) {
            Err(e) if a.text.is_none() => {
                let what = match measure {
                    Measure::Gates => "FoX gates".to_string(),
                    _ => format!("{name} on text"),
                };
                summary.push_str(&format!("{what} skipped: {e}\n"));
                return Ok(());
            }
            Err(e) => return Err(e),
            Ok((ids, mask, _)) => {
                a.check_text(encoder, &ids)?;
                Some((ids, mask))
            }
        },
    };
    match (measure, text) {
        (Measure::Interpolation, _) => {
            let trained = model.max_len.clamp(2, MAX_BIAS_POSITIONS);
            let lengths = [trained, (4 * trained).min(MAX_BIAS_POSITIONS)];
            let mut curves = schemes::fire_curves(
                format!("{name}: the learned bias per head, at the training length and 4x"),
                &lengths,
                |n| {
                    encoder
                        .score_bias(0, &crate::Positions::range(0, n)?)?
                        .ok_or_else(|| Error::Config(format!("{name} has no score bias")))
                },
            )?;
            curves.notes = encoder.positional().notes()?;
            summary.push_str(&curves.summary());
            files.extend(curves.write(dir)?);
        }
        (Measure::Spectrum { base, keep }, _) => {
            let spectra = schemes::rotation_spectra(model.head_dim(), base, keep);
            let (text, written) = schemes::write_spectra(&spectra, model.head_dim(), dir)?;
            summary.push_str(&text);
            files.extend(written);
        }
        (Measure::PolarScores, _) => {
            let curves = analysis::scores::pope_scores(encoder, model.max_len.clamp(2, 512))?;
            summary.push_str(&curves.summary());
            files.extend(curves.write(dir)?);
        }
        (Measure::Gates, Some((ids, mask))) => {
            let tokenizer = &loaded.tokenizer;
            let gates = schemes::fox_gates(encoder, &ids, &mask, |id| {
                tokenizer
                    .id_to_token(id)
                    .unwrap_or_else(|| format!("#{id}"))
            })?;
            summary.push_str(&gates.summary());
            files.extend(gates.write(dir)?);
        }
        (Measure::Counts, Some((ids, mask))) => {
            let curves = analysis::scores::cope_counts(encoder, &ids, &mask)?;
            summary.push_str(&curves.summary());
            files.extend(curves.write(dir)?);
        }
        (Measure::Turning, Some((ids, mask))) => {
            let curves = analysis::scores::path_turning(encoder, &ids, &mask)?;
            summary.push_str(&curves.summary());
            files.extend(curves.write(dir)?);
        }
        (Measure::Weights, Some((ids, mask))) => {
            let curves = analysis::scores::stick_weights(encoder, &ids, &mask)?;
            summary.push_str(&curves.summary());
            files.extend(curves.write(dir)?);
        }
        (Measure::Gates | Measure::Counts | Measure::Turning | Measure::Weights, None) => {}
    }
    Ok(())
}

impl Request {
    /// A scheme's learned bias at initialisation (seed 0) at --positions and 4x as many, its
    /// threshold (FIRE's) at --positions: past the threshold, the longer sequence's curve is the
    /// shorter's stretched over its span.
    fn interpolation(
        &self,
        name: &str,
        config: &PositionalConfig,
        title: String,
        note: String,
    ) -> Result<Report> {
        let short = self.interpolated_length();
        let (module, _store) = analysis::bias::module_by_name(config, self.heads, short)?;
        let mut curves = analysis::schemes::fire_curves(title, &[short, 4 * short], |n| {
            let positions = crate::Positions::range(0, n)?;
            analysis::bias::shared_bias(&module, &positions, name, self.backend)
        })?;
        curves.notes = module.notes()?;
        curves.notes.push(note);
        let dir = self.out_dir(name)?;
        let summary = curves.summary();
        let files = curves.write(&dir)?;
        let mut page = analysis::page::Page::new(format!("poslab analyze: {name}"));
        page.fire(&curves);
        finish(dir, summary, files, page)
    }

    /// The shorter length an interpolation is drawn at (--positions, bounded so that 4 times as
    /// many fit an attention-bias analysis); a threshold not given is this length.
    fn interpolated_length(&self) -> usize {
        self.positions.min(MAX_BIAS_POSITIONS / 4)
    }

    /// A rotation's spectrum at `keep` beside RoPE's and `fraction`'s at the same share, for a
    /// head of --dim.
    fn spectrum(&self, name: &str, base: f64, keep: f64) -> Result<Report> {
        let spectra = analysis::schemes::rotation_spectra(self.dim, base, keep);
        let dir = self.out_dir(name)?;
        let (summary, files) = analysis::schemes::write_spectra(&spectra, self.dim, &dir)?;
        finish(
            dir,
            summary,
            files,
            analysis::page::Page::new(format!("poslab analyze: {name}")),
        )
    }

    /// A bias by offset, per head, as text, files and a page.
    fn bias_report(&self, name: &str, bias: analysis::bias::BiasAnalysis) -> Result<Report> {
        let dir = self.out_dir(name)?;
        let summary = bias.summary();
        let files = bias.write(&dir)?;
        let mut page = analysis::page::Page::new(format!("poslab analyze: {name}"));
        page.bias(&bias);
        finish(dir, summary, files, page)
    }
}

/// Writes `summary.txt` and `report.html` beside an analysis's `files` in `dir`.
fn finish(
    dir: PathBuf,
    summary: String,
    mut files: Vec<String>,
    page: analysis::page::Page,
) -> Result<Report> {
    crate::io::write_atomic(&dir.join("summary.txt"), summary.as_bytes())?;
    crate::io::write_atomic(
        &dir.join("report.html"),
        page.render(&summary, &files).as_bytes(),
    )?;
    files.push("report.html".into());
    Ok(Report {
        dir,
        summary,
        files,
    })
}

/// Rebuilds a loaded rope model with its frequencies rescaled (the same weights); an `auto`
/// factor is the text's length `longest` over the model's `max_len`, at least 1.
fn rescale(
    loaded: &mut crate::saved::Loaded,
    scaling: &crate::positional::RopeScaling,
    longest: usize,
) -> Result<()> {
    let model = &loaded.config.model;
    let resolved = scaling.resolved(
        longest as f64 / model.max_len.max(1) as f64,
        model.max_len.max(1),
    );
    let Some(positional) = model.positional.with_scaling(Some(resolved)) else {
        bail!(
            "--rope-scaling applies to rope models; this one's scheme is `{}`",
            model.positional.name()
        );
    };
    let config = crate::ModelConfig {
        positional,
        ..model.clone()
    };
    let encoder = loaded.model.encoder();
    let vb = loaded.params.var_builder(encoder.dtype(), encoder.device());
    let backend = encoder.backend();
    loaded.model =
        crate::model::TaskModel::new(&config, &loaded.config.head, vb)?.with_backend(backend);
    loaded.config.model = config;
    Ok(())
}

/// How an analysis of the trained model in `dir` is named: its folder's name, or for a model of
/// a compare run (`<run>/models/<task>/<variant>/seed<N>`) `<task>-<variant>-seed<N>`, which
/// keeps what the bare `seed<N>` loses.
fn run_label(dir: &Path) -> String {
    let parts: Vec<String> = dir
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .filter(|c| c != ".")
        .collect();
    match parts.as_slice() {
        [.., models, task, variant, seed] if models == "models" && seed.starts_with("seed") => {
            format!("{task}-{variant}-{seed}")
        }
        [.., last] => last.clone(),
        [] => "run".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compare_models_analysis_keeps_its_task_and_variant() {
        let label = |p: &str| run_label(Path::new(p));
        assert_eq!(
            label("runs/compare-1/models/word_order/rope/seed0/"),
            "word_order-rope-seed0"
        );
        assert_eq!(label("./models/t/v/seed2"), "t-v-seed2");
        assert_eq!(label("runs/reviews-20261127"), "reviews-20261127");
        assert_eq!(label("runs/x/other/t/v/seed0"), "seed0");
        assert_eq!(label("seed0"), "seed0");
    }
}
