//! `poslab analyze`: what a positional scheme encodes, by name or in a trained model
//! ([`poslab::analysis::command`]). The flags are the library's [`Request`], with its defaults.

use std::path::PathBuf;

use anyhow::Result;
use poslab::analysis::command::Request;
use poslab::positional::{RopePairing, TableLayout};

/// The library's defaults, which the flags show.
fn defaults() -> Request {
    Request::default()
}

/// `--layout`'s values.
const LAYOUTS: &[(TableLayout, &str)] = &[
    (
        TableLayout::Interleaved,
        "Sine and cosine of each frequency side by side (the default)",
    ),
    (TableLayout::Half, "Every sine, then every cosine"),
];

/// `--pairing`'s values.
const PAIRINGS: &[(RopePairing, &str)] = &[
    (
        RopePairing::Interleaved,
        "Pairs `(x[2i], x[2i+1])` (the default)",
    ),
    (RopePairing::Half, "Pairs `(x[i], x[i + d_head/2])`"),
];

/// The command's flags: what to analyse, and the threads and kernels it computes with.
#[derive(clap::Args)]
pub struct Args {
    /// `sinusoidal`, `rope`, `prope` (its spectrum beside RoPE's and `fraction`'s), or an
    /// attention bias: `alibi`, `t5`, `kerple`, `fire` (at two lengths: its interpolation); or
    /// give --run (learned positions, FoX's gates, CoPE's counts and PaTH's transport exist only
    /// in a trained model).
    #[arg(value_parser = clap::builder::PossibleValuesParser::new(poslab::analysis::command::scheme_names()), required_unless_present_any = ["run", "model"], conflicts_with_all = ["run", "model"])]
    pub scheme: Option<String>,
    /// A pretrained BERT-family encoder (a Hugging Face folder or Hub id): its learned position
    /// table, with the same measures, pictures and CSVs as a trained model's.
    #[arg(long, value_name = "PATH_OR_HUB_ID", conflicts_with = "run")]
    pub model: Option<String>,
    /// Heads of an attention bias (alibi, kerple).
    #[arg(long, default_value_t = defaults().heads)]
    pub heads: usize,
    /// T5: buckets.
    #[arg(long, default_value_t = defaults().buckets)]
    pub buckets: usize,
    /// T5: the distance from which offsets share the last bucket.
    #[arg(long, default_value_t = defaults().max_distance)]
    pub max_distance: usize,
    /// RoPE: the share of each head rotated (its first int(dim x fraction) coordinates).
    #[arg(long, default_value_t = defaults().fraction)]
    pub fraction: f64,
    /// p-RoPE: the share of a head's frequency pairs that rotate (the fastest).
    #[arg(long, default_value_t = defaults().keep)]
    pub keep: f64,
    /// FIRE: the threshold L (default: --positions, standing for the training length); its
    /// bias is drawn at --positions and at 4 times as many.
    #[arg(long)]
    pub threshold: Option<f64>,
    /// RoPE: the factor of the scalings whose wavelengths are compared.
    #[arg(long, default_value_t = defaults().factor)]
    pub factor: f64,
    /// RoPE: the training length the scalings start from (default: --positions, or a trained
    /// model's max_len).
    #[arg(long)]
    pub original_max_len: Option<usize>,
    /// With --run of a rope model: read the text with RoPE's frequencies rescaled,
    /// `KIND[:FACTOR]` (see `predict --help`); its factor also sets the wavelengths compared.
    #[arg(long, value_name = "KIND[:FACTOR]", value_parser = poslab::positional::RopeScaling::parse_spec, requires = "run")]
    pub rope_scaling: Option<poslab::positional::RopeScaling>,
    /// A trained model's folder.
    #[arg(long, value_name = "DIR")]
    pub run: Option<PathBuf>,
    /// Width of the table (sinusoidal) or of a head (rope).
    #[arg(long, default_value_t = defaults().dim)]
    pub dim: usize,
    /// The base of the sinusoid's or rotation's frequencies.
    #[arg(long, default_value_t = defaults().base)]
    pub base: f64,
    /// Sinusoidal layout.
    #[arg(long, value_parser = super::choices(LAYOUTS, TableLayout::name), default_value_t = defaults().layout)]
    pub layout: TableLayout,
    /// RoPE pairing.
    #[arg(long, value_parser = super::choices(PAIRINGS, RopePairing::name), default_value_t = defaults().pairing)]
    pub pairing: RopePairing,
    /// Positions analysed (a learned table: all its rows); at most 8192, 1024 for attention
    /// biases.
    #[arg(long, default_value_t = defaults().positions)]
    pub positions: usize,
    /// First position (sinusoidal).
    #[arg(long, default_value_t = defaults().start)]
    pub start: usize,
    /// Reference position (row) of the offset curves.
    #[arg(long, default_value_t = defaults().reference)]
    pub reference: usize,
    /// Bases compared in the wavelength plot.
    #[arg(long, value_delimiter = ',', default_values_t = defaults().bases)]
    pub bases: Vec<f64>,
    /// Evaluation text for the attention terms of --run, one text per line (default: the
    /// model's own test set, remade from its config.json).
    #[arg(long, value_name = "FILE")]
    pub text: Option<PathBuf>,
    /// Texts used for the attention terms.
    #[arg(long, default_value_t = defaults().texts)]
    pub texts: usize,
    /// Output folder (default: `runs/analysis-<what>-<timestamp>`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Threads to compute with (default: RAYON_NUM_THREADS when set, else every core). The
    /// results do not depend on it.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Which kernels a model's layers compute with (--run, --model): layer (the default), ops
    /// or reference. Default: POSLAB_KERNELS when set, else layer.
    #[arg(long, value_parser = super::kernels_parser())]
    pub kernels: Option<poslab::nn::Kernels>,
    #[command(flatten)]
    pub quiet: super::Quiet,
}

impl Args {
    /// The library's request these flags make, computing with `backend`.
    fn request(self, backend: poslab::nn::Backend, limits: poslab::limits::Limits) -> Request {
        Request {
            scheme: self.scheme,
            model: self.model,
            heads: self.heads,
            buckets: self.buckets,
            max_distance: self.max_distance,
            fraction: self.fraction,
            keep: self.keep,
            threshold: self.threshold,
            factor: self.factor,
            original_max_len: self.original_max_len,
            rope_scaling: self.rope_scaling,
            run: self.run,
            dim: self.dim,
            base: self.base,
            layout: self.layout,
            pairing: self.pairing,
            positions: self.positions,
            start: self.start,
            reference: self.reference,
            bases: self.bases,
            text: self.text,
            texts: self.texts,
            out: self.out,
            backend,
            limits,
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    let threads = super::threads(a.threads)?.unwrap_or_else(poslab::nn::cores);
    let backend = poslab::nn::Backend::default().with_kernels(super::kernels(a.kernels)?);
    let quiet = a.quiet;
    let request = a.request(backend, super::limits()?);
    let meter = poslab::progress::Meter::new("poslab analyze");
    let report = quiet.metered(&meter, || {
        poslab::nn::with_threads(threads, move || request.run())
    })?;
    out!("{}", report.summary);
    outln!(
        "files in {}: {}",
        report.dir.display(),
        report.files.join(", ")
    );
    Ok(())
}
