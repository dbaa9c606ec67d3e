//! The subcommands of the `poslab` binary, one module each, and what they share.

/// `println!` that returns from the enclosing function (which returns `anyhow::Result`) with
/// [`OutputFailed`] instead of panicking when standard output is closed or full.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($arg)*) {
            return Err($crate::cli::OutputFailed(e).into());
        }
    }};
}

/// `eprintln!` that never panics: progress and notes go to standard error, which a closed pipe
/// (`poslab compare 2>&1 | head -n 1`) or a dead `tee` may have closed; the run goes on.
macro_rules! errln {
    ($($arg:tt)*) => {
        poslab::io::note(&format!($($arg)*))
    };
}

/// `print!` as [`outln!`].
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = write!(std::io::stdout(), $($arg)*) {
            return Err($crate::cli::OutputFailed(e).into());
        }
    }};
}

pub mod analyze;
pub mod bench;
pub mod compare;
pub mod embed;
pub mod env;
pub mod inspect;
pub mod interrupt;
pub mod predict;
pub mod report;
pub mod train;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle::DType;

/// Writing to standard output failed: a closed pipe (`poslab ... | head -1`), which ends the
/// program quietly as Unix tools do, or another error (a full disk), reported in one line.
#[derive(Debug)]
pub struct OutputFailed(pub std::io::Error);

impl std::fmt::Display for OutputFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "writing the output: {}", self.0)
    }
}

impl std::error::Error for OutputFailed {}

impl OutputFailed {
    /// Whether the reader went away (a closed pipe): nothing is wrong, there is no one to tell.
    pub fn is_closed_pipe(&self) -> bool {
        self.0.kind() == std::io::ErrorKind::BrokenPipe
    }
}

/// Refuses `flag n` (threads or jobs) outside 1..=4 per core: more only wait on each other.
pub fn check_workers(flag: &str, n: usize, what: &str) -> Result<()> {
    let most = 4 * poslab::nn::cores();
    if n == 0 || n > most {
        anyhow::bail!(
            "{flag} {n}: give from 1 to {most} {what} (4 per CPU core here; more only wait on \
             each other)"
        );
    }
    Ok(())
}

/// The threads a command computes with: `--threads` when given, else `RAYON_NUM_THREADS` when
/// you set it to a count (0 or not a number: unset, as rayon reads it), else `None` (the
/// library's default); either is checked. The count is passed on as a value; poslab never sets
/// the variable.
pub fn threads(flag: Option<usize>) -> Result<Option<usize>> {
    let (from, n) = match flag {
        Some(n) => ("--threads", n),
        None => match std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|n| *n > 0)
        {
            Some(n) => ("RAYON_NUM_THREADS", n),
            None => return Ok(None),
        },
    };
    check_workers(from, n, "threads")?;
    Ok(Some(n))
}

/// The interval of progress lines, checked: `--log-every`.
pub fn log_interval(seconds: f64) -> Result<std::time::Duration> {
    if !(seconds.is_finite() && (0.05..=86_400.0).contains(&seconds)) {
        anyhow::bail!(
            "--log-every {seconds}: give the seconds between progress lines, from 0.05 to 86400"
        );
    }
    Ok(std::time::Duration::from_secs_f64(seconds))
}

/// A flag that takes one of the library's plain enums: `values` with their help (none where
/// empty), each by the library's own name for it (`name`). The library's enums know nothing of
/// clap.
pub fn choices<T: Copy + Send + Sync + 'static>(
    values: &'static [(T, &'static str)],
    name: fn(T) -> &'static str,
) -> impl clap::builder::TypedValueParser<Value = T> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser as _};
    let listed = values.iter().map(move |&(v, help)| match help {
        "" => PossibleValue::new(name(v)),
        help => PossibleValue::new(name(v)).help(help),
    });
    PossibleValuesParser::new(listed).map(move |chosen| {
        let found = values.iter().find(|&&(v, _)| name(v) == chosen);
        found.expect("clap accepts only the listed names").0
    })
}

/// `--kernels`' values.
const KERNELS: &[(poslab::nn::Kernels, &str)] = &[
    (
        poslab::nn::Kernels::Reference,
        "Compositions of differentiable candle tensor ops: the specification the others are \
         tested against",
    ),
    (
        poslab::nn::Kernels::Ops,
        "Fused per-op kernels with hand-written backward passes: linear, LayerNorm, masked \
         softmax, GELU, RoPE, and the attention core from packed QKV",
    ),
    (
        poslab::nn::Kernels::Layer,
        "Each encoder layer as one node with a hand-written backward (the default)",
    ),
];

/// `--kernels`: `reference`, `ops` or `layer`, each described (bench's long help).
pub fn kernels_described() -> impl clap::builder::TypedValueParser<Value = poslab::nn::Kernels> {
    choices(KERNELS, poslab::nn::Kernels::name)
}

/// `--kernels`: `reference`, `ops` or `layer`, the flag's own help describing them.
pub fn kernels_parser() -> impl clap::builder::TypedValueParser<Value = poslab::nn::Kernels> {
    use poslab::nn::Kernels;
    const NAMED: &[(Kernels, &str)] = &[
        (Kernels::Reference, ""),
        (Kernels::Ops, ""),
        (Kernels::Layer, ""),
    ];
    choices(NAMED, Kernels::name)
}

/// The kernels a command computes with: `--kernels` when given, else `POSLAB_KERNELS` when
/// set, else the library's default (`layer`).
pub fn kernels(flag: Option<poslab::nn::Kernels>) -> Result<poslab::nn::Kernels> {
    match flag {
        Some(k) => Ok(k),
        None => Ok(env::kernels()
            .map_err(anyhow::Error::msg)?
            .unwrap_or_default()),
    }
}

/// `-q`: no progress on standard error (what a command that can run long shows otherwise: a
/// bar on a terminal after a second, a line every 30 s in a log).
#[derive(clap::Args, Clone, Copy)]
pub struct Quiet {
    /// Show no progress on standard error.
    #[arg(short, long)]
    pub quiet: bool,
}

impl Quiet {
    /// Runs `work` with `meter`'s progress shown as this command shows it.
    pub fn metered<R>(self, meter: &poslab::progress::Meter, work: impl FnOnce() -> R) -> R {
        let progress = poslab::progress::Progress::for_stderr(
            self.quiet,
            poslab::progress::Progress::DEFAULT_EVERY,
        );
        poslab::progress::with_meter(progress, meter, &|line| errln!("{line}"), work)
    }
}

/// The sizes a command allows: `POSLAB_MAX_PARAMS` and `POSLAB_MAX_MEMORY`, else the defaults.
pub fn limits() -> Result<poslab::limits::Limits> {
    env::limits().map_err(anyhow::Error::msg)
}

/// Where a model computes, in what precision, with which kernels, and on how many threads.
#[derive(clap::Args, Clone, Debug)]
pub struct Compute {
    /// cpu, cuda, cuda:N or auto (CUDA when built with the `cuda` feature and a GPU is present).
    #[arg(long, default_value_t = poslab::device::DeviceSpec::Auto)]
    pub device: poslab::device::DeviceSpec,
    /// Activations in f32, bf16 or f16: mixed precision, meant for CUDA. Weights, gradients,
    /// optimizer state, positional tables, RoPE angles and softmax / LayerNorm statistics stay
    /// f32. Default: the config's `[model] dtype` (f32 if absent), or as a saved model was trained.
    #[arg(long)]
    pub dtype: Option<poslab::Precision>,
    /// Threads to compute with, per job for `compare` (default: RAYON_NUM_THREADS when set,
    /// else every core, shared out among `compare`'s jobs). The results do not depend on it.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Which kernels the layers compute with: layer (each encoder layer one fused node with a
    /// hand-written backward, the default), ops (fused per-op kernels) or reference
    /// (compositions of candle ops, the specification). Default: POSLAB_KERNELS when set, else
    /// layer. The kernels agree to within rounding, not bit for bit.
    #[arg(long, value_parser = kernels_parser())]
    pub kernels: Option<poslab::nn::Kernels>,
}

impl Compute {
    /// The backend the command's models compute with: [`kernels`] at the CPU's best SIMD
    /// level.
    pub fn backend(&self) -> Result<poslab::nn::Backend> {
        Ok(poslab::nn::Backend::default().with_kernels(kernels(self.kernels)?))
    }

    /// `--threads` or `RAYON_NUM_THREADS`, checked ([`threads`]); `None` when neither is given.
    pub fn threads(&self) -> Result<Option<usize>> {
        threads(self.threads)
    }

    /// `f` on a rayon pool of its own, [`Compute::threads`] wide (every core by default): what
    /// `predict` and `embed` compute on.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> Result<R> + Send) -> Result<R> {
        let n = self.threads()?.unwrap_or_else(poslab::nn::cores);
        poslab::nn::with_threads(n, f)
    }
}

/// The model `predict` and `embed` read: one poslab trained, or a pretrained encoder.
#[derive(clap::Args)]
#[group(required = true, multiple = false)]
pub struct ModelSource {
    /// A model folder poslab trained: config.json, model.safetensors, tokenizer.json.
    #[arg(long, value_name = "DIR")]
    pub run: Option<PathBuf>,
    /// A pretrained BERT-family encoder (bert, roberta; predict needs its masked-LM head, as in
    /// BertForMaskedLM): a Hugging Face folder, or a Hub id (owner/name[@revision]) read from
    /// the Hugging Face cache (HF_HUB_OFFLINE honoured).
    #[arg(long, value_name = "PATH_OR_HUB_ID")]
    pub model: Option<String>,
}

/// Texts from the arguments and from `--input` (a file, or `-` for standard input).
pub fn gather_texts(mut texts: Vec<String>, input: Option<PathBuf>) -> Result<Vec<String>> {
    if let Some(path) = input {
        let content = if path.as_os_str() == "-" {
            use std::io::Read as _;
            let mut text = String::new();
            let max = poslab::io::MAX_DATA_BYTES;
            std::io::stdin()
                .take(max + 1)
                .read_to_string(&mut text)
                .context("reading standard input")?;
            if text.len() as u64 > max {
                anyhow::bail!(
                    "standard input is larger than {}: give the texts in parts",
                    poslab::io::human_bytes(max)
                );
            }
            text
        } else {
            poslab::io::read_text_bounded(&path, poslab::io::MAX_DATA_BYTES, "text")?
        };
        // A leading byte-order mark (some editors write one) is not text.
        let content = content.strip_prefix('\u{feff}').unwrap_or(&content);
        texts.extend(
            content
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(String::from),
        );
    }
    if texts.is_empty() {
        anyhow::bail!(
            "no text given: pass texts as arguments or --input FILE (- for standard input)"
        );
    }
    Ok(texts)
}

pub fn load_model(dir: &Path, compute: &Compute) -> Result<poslab::saved::Loaded> {
    if let Some(what) = poslab::runs::folder::not_a_model(dir) {
        anyhow::bail!("{}: {what}", dir.display());
    }
    let device = compute.device.open()?;
    let limits = limits()?;
    let mut loaded = poslab::saved::load_within(dir, (DType::F32, &device, compute.dtype), &limits)
        .with_context(|| format!("loading the model in {}", dir.display()))?;
    loaded.model.set_backend(compute.backend()?);
    Ok(loaded)
}

/// `--rope-scaling KIND[:FACTOR]`, as clap parses it.
pub fn parse_rope_scaling(
    spec: &str,
) -> std::result::Result<poslab::positional::RopeScaling, String> {
    poslab::positional::RopeScaling::parse_spec(spec)
}

/// The help of `--rope-scaling`.
pub const ROPE_SCALING_HELP: &str = "Read with RoPE's frequencies rescaled (rope models), to go \
past the training length: KIND[:FACTOR], KIND one of linear, ntk, dynamic_ntk, yarn, FACTOR a \
number of at least 1 or auto (the default: the longest text over the training's longest)";

/// Loads a pretrained encoder from `--model` (a folder or a Hub id).
pub fn load_pretrained(spec: &str, compute: &Compute) -> Result<poslab::pretrained::Pretrained> {
    if compute
        .dtype
        .is_some_and(|d| d != poslab::Precision::default())
    {
        anyhow::bail!("--dtype applies to poslab's own models; a pretrained encoder runs in f32");
    }
    let device = compute.device.open()?;
    let mut model = poslab::pretrained::Pretrained::open_within(spec, &device, &limits()?)
        .with_context(|| format!("loading the pretrained model {spec}"))?;
    model.encoder.set_backend(compute.backend()?);
    Ok(model)
}

/// `s` for a count other than one: `1 task`, `2 tasks`.
pub(crate) fn plural(n: usize) -> &'static str {
    match n {
        1 => "",
        _ => "s",
    }
}

/// Removes a run folder this command made for a run that failed before it wrote anything but
/// its start (the lock, the manifest, the config): a failed start leaves nothing behind that
/// `inspect` would call unfinished. A folder holding anything else stays as it is.
pub fn discard_failed_start(dir: &std::path::Path) {
    const START: [&str; 4] = [
        ".poslab-lock",
        "run.json",
        "config.toml",
        poslab::saved::TRAIN_CONFIG,
    ];
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut files = Vec::new();
    let mut folders = Vec::new();
    for entry in entries {
        let Ok(entry) = entry else { return };
        let (path, name) = (entry.path(), entry.file_name());
        match entry.file_type() {
            Ok(t) if t.is_file() && START.iter().any(|s| name == *s) => files.push(path),
            Ok(t)
                if t.is_dir() && std::fs::read_dir(&path).is_ok_and(|mut d| d.next().is_none()) =>
            {
                folders.push(path)
            }
            _ => return,
        }
    }
    for file in files {
        let _ = std::fs::remove_file(file);
    }
    for folder in folders {
        let _ = std::fs::remove_dir(folder);
    }
    let _ = std::fs::remove_dir(dir);
}
