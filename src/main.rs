//! The `poslab` command line: parses and dispatches; each subcommand's code is in `cli/<name>.rs`.

#[macro_use]
mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The system allocator, counting live bytes: `bench --launches` reads its high-water mark.
#[global_allocator]
static HEAP: poslab::heap::Counting = poslab::heap::Counting;

#[derive(Parser)]
#[command(
    name = "poslab",
    version,
    about = "A lab for transformer positional encodings"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train every positional variant of an experiment on the same data, seeds and budget, and
    /// report scores by input length, the shuffle and shift tests, parameters and speed.
    Compare(cli::compare::Args),
    /// Train one model (any task, any positional choice) with checkpoints; a stopped run
    /// continues with --resume and ends with the same weights as one that never stopped.
    Train(cli::train::Args),
    /// Labels and probabilities (classification), tags per word (tagging) or the top fills of
    /// each [MASK] (MLM) for new text, from a trained model's folder.
    Predict(cli::predict::Args),
    /// Pooled sentence vectors of texts, one JSON object per line.
    Embed(cli::embed::Args),
    /// What a positional scheme encodes: tables, distances, offsets, probes, wavelengths,
    /// RoPE's decay, attention biases by offset; for a trained model (--run) its table, its
    /// learned biases and how its attention logits split into content and position terms.
    Analyze(cli::analyze::Args),
    /// Forward and training-step throughput of every positional variant at a reference shape
    /// (that of shared/bench/torch_reference.py by default), with FLOP counts and peak memory.
    Bench(cli::bench::Args),
    /// Merge the results of run folders (cells split across machines with --shard, --task,
    /// --variant, --seed) into one report: strictly, or partially with --allow-partial (exit
    /// status 3).
    Report(cli::report::Args),
    /// Validate a model config and show its shape, where positions act, and the parameters of
    /// the same shape under every positional scheme.
    Inspect(cli::inspect::Args),
}

fn main() -> ExitCode {
    // Every POSLAB_* variable is read as set, or refused: never silently ignored.
    match cli::env::check() {
        Ok(warnings) => warnings.iter().for_each(|w| errln!("{w}")),
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::FAILURE;
        }
    }
    // POSLAB_DEFAULT_ALLOCATOR=1 keeps glibc's defaults (to measure what the tuning buys).
    if std::env::var_os("POSLAB_DEFAULT_ALLOCATOR").is_none() {
        poslab::tune_allocator();
    }
    let result = match Cli::parse().command {
        Command::Compare(args) => {
            // First, before any thread starts: Ctrl-C then says how to continue.
            let interrupt = cli::interrupt::Interrupt::install();
            cli::compare::run(args, &interrupt)
        }
        Command::Train(args) => cli::train::run(args),
        Command::Predict(args) => args.compute.clone().run(|| cli::predict::run(args)),
        Command::Embed(args) => args.compute.clone().run(|| cli::embed::run(args)),
        Command::Analyze(args) => cli::analyze::run(args),
        Command::Bench(args) => cli::bench::run(args),
        Command::Report(args) => cli::report::run(args),
        Command::Inspect(args) => cli::inspect::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe downstream: stop quietly, as Unix tools do.
        Err(e)
            if e.downcast_ref::<cli::OutputFailed>()
                .is_some_and(|o| o.is_closed_pipe()) =>
        {
            ExitCode::SUCCESS
        }
        // A partial merge was written and said so: its own exit status.
        Err(e) if e.downcast_ref::<cli::report::PartialMerge>().is_some() => ExitCode::from(3),
        Err(e) => {
            use std::io::Write as _;
            // stderr may be closed too; there is then nowhere left to say anything.
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
