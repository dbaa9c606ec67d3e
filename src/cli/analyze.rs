//! `poslab analyze`: what a positional scheme encodes, by name or in a trained model
//! ([`poslab::analysis::command`]).

use anyhow::Result;

/// The command's flags: the library's request, and the threads it computes on.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub request: poslab::analysis::command::Request,
    /// Threads to compute with (default: RAYON_NUM_THREADS when set, else every core). The
    /// results do not depend on it.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Which kernels a model's layers compute with (--run, --model): layer (the default), ops
    /// or reference. Default: POSLAB_KERNELS when set, else layer.
    #[arg(long, value_parser = super::kernels_parser())]
    pub kernels: Option<poslab::nn::Kernels>,
}

pub fn run(a: Args) -> Result<()> {
    let threads = super::threads(a.threads)?.unwrap_or_else(poslab::nn::cores);
    let mut request = a.request;
    request.backend = poslab::nn::Backend::default().with_kernels(super::kernels(a.kernels)?);
    let report = poslab::nn::with_threads(threads, move || request.run())?;
    out!("{}", report.summary);
    outln!(
        "files in {}: {}",
        report.dir.display(),
        report.files.join(", ")
    );
    Ok(())
}
