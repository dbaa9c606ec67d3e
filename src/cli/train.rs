//! `poslab train`: one model, checkpointed and resumable.

use std::path::{Path, PathBuf};

use anyhow::Result;
use poslab::runs;
use poslab::runs::results::Outcome;

use super::Compute;

/// Train one model (any task, any positional choice) with checkpoints; a stopped run continues
/// with --resume and ends with the same weights as one that never stopped.
#[derive(clap::Args)]
pub struct Args {
    /// A train config (TOML): name, seed, [model] and [positional] (or init = { model = ... }
    /// to fine-tune a pretrained encoder), [train], [task].
    #[arg(long, required_unless_present = "resume", conflicts_with = "resume")]
    pub config: Option<PathBuf>,
    /// Continue the run in this folder from its latest checkpoint.
    #[arg(long, value_name = "RUN_DIR")]
    pub resume: Option<PathBuf>,
    /// The run folder (default: runs/train-<name>-<timestamp>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long, default_value = "runs")]
    pub runs_dir: PathBuf,
    /// (--dtype applies to a new run; a resumed run keeps the dtype it was started with.)
    #[command(flatten)]
    pub compute: Compute,
    /// Stop once this many steps are done, after saving a checkpoint (what a kill would
    /// leave); continue later with --resume.
    #[arg(long, value_name = "STEPS")]
    pub stop_after: Option<usize>,
    /// No progress bar or progress lines.
    #[arg(long, short)]
    pub quiet: bool,
    /// Where standard error is not a terminal (a cluster job's log), print a progress line
    /// (step, loss, time spent and left) every this many seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = poslab::progress::Progress::DEFAULT_EVERY.as_secs_f64())]
    pub log_every: f64,
}

pub fn run(args: Args) -> Result<()> {
    let Args {
        config,
        resume,
        out,
        runs_dir,
        compute,
        stop_after,
        quiet,
        log_every,
    } = args;
    let every = super::log_interval(log_every)?;
    let threads = compute.threads()?;
    if stop_after == Some(0) {
        anyhow::bail!(
            "--stop-after 0 would stop before the first step: give the number of steps to train \
             before stopping (at least 1)"
        );
    }
    let device = compute.device.open()?;
    let (backend, limits) = (compute.backend()?, super::limits()?);
    let options = |dir: PathBuf| runs::train_run::TrainOptions {
        dir,
        device: device.clone(),
        progress: poslab::progress::Progress::for_stderr(quiet, every),
        stop_after,
        hub: poslab::text::HubSource::from_env(),
        threads,
        backend,
        limits,
    };
    let (end, dir) = match (config, resume) {
        (_, Some(dir)) => {
            if let Some(dtype) = compute.dtype {
                anyhow::bail!(
                    "--dtype {dtype} with --resume: a resumed run keeps the dtype it was started \
                     with (its config.json), so that it ends as an uninterrupted run would; drop --dtype"
                );
            }
            errln!("poslab train: resuming {}", dir.display());
            (runs::train_run::resume(&options(dir.clone()))?, dir)
        }
        (Some(path), None) => {
            let mut config = runs::train_run::TrainRunConfig::load(&path)?;
            if let Some(dtype) = compute.dtype {
                config.set_dtype(dtype);
            }
            let created = out.is_none();
            let dir = match out {
                Some(dir) => dir,
                None => poslab::io::new_run_dir(&runs_dir, "train", &config.name)?,
            };
            errln!("poslab train: {} -> {}", path.display(), dir.display());
            match runs::train_run::start(&config, &options(dir.clone())) {
                Ok(end) => (end, dir),
                Err(e) => {
                    if created {
                        super::discard_failed_start(&dir);
                    }
                    return Err(e.into());
                }
            }
        }
        (None, None) => unreachable!("clap requires --config or --resume"),
    };
    match end {
        runs::train_run::TrainEnd::Stopped { step } => outln!(
            "stopped after step {step} as asked, with a checkpoint; continue with: poslab train --resume {}",
            dir.display()
        ),
        runs::train_run::TrainEnd::Finished(m) => print_finished(&m, &dir)?,
    }
    Ok(())
}

/// A finished run's record: its training, its test scores (with the perplexity of next-token
/// prediction), where its model is.
fn print_finished(m: &runs::train_run::Metrics, dir: &Path) -> Result<()> {
    let next_token = runs::train_run::TrainRunConfig::load(dir.join(runs::train_run::TRAIN_CONFIG))
        .is_ok_and(|c| matches!(c.task.kind, poslab::tasks::TaskKind::Lm(_)));
    outln!(
        "{}: {} steps, {} tokens, final train loss {:.4}, {:.0} tokens/s, {} parameters{}",
        m.name,
        m.summary.steps,
        m.summary.tokens,
        m.summary.final_train_loss,
        m.tokens_per_second,
        m.summary.params,
        if m.summary.stopped_early {
            format!(", stopped early (kept step {})", m.summary.kept_step)
        } else {
            String::new()
        }
    );
    for e in &m.summary.evaluations {
        match &e.outcome {
            Outcome::Scored { accuracy, loss, .. } => {
                let perplexity = match next_token {
                    true => format!("  perplexity {:.2}", loss.exp()),
                    false => String::new(),
                };
                outln!(
                    "  test {:<10} accuracy {:5.1}%  loss {loss:.4}{perplexity}",
                    e.name,
                    100.0 * accuracy
                )
            }
            Outcome::Unavailable { reason } => outln!("  test {:<10} n/a: {reason}", e.name),
        }
    }
    for note in &m.notes {
        outln!("  note: {note}");
    }
    outln!(
        "model folder: {} (config.json, model.safetensors, tokenizer.json, metrics.json)",
        dir.display()
    );
    outln!(
        "try it: poslab predict --run {} \"your text here\"",
        dir.display()
    );
    Ok(())
}
