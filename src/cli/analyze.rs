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
}

pub fn run(a: Args) -> Result<()> {
    let threads = super::threads(a.threads)?.unwrap_or_else(poslab::nn::cores);
    let request = a.request;
    let report = poslab::nn::with_threads(threads, move || request.run())?;
    out!("{}", report.summary);
    outln!(
        "files in {}: {}",
        report.dir.display(),
        report.files.join(", ")
    );
    Ok(())
}
