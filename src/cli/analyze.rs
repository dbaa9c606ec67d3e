//! `poslab analyze`: what a positional scheme encodes, by name or in a trained model
//! ([`poslab::analysis::command`]).

use anyhow::Result;

/// The command's flags: the library's request.
pub type Args = poslab::analysis::command::Request;

pub fn run(a: Args) -> Result<()> {
    let report = a.run()?;
    out!("{}", report.summary);
    outln!(
        "files in {}: {}",
        report.dir.display(),
        report.files.join(", ")
    );
    Ok(())
}
