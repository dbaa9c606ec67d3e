//! Train a classifier on your own TSV with the library API, as `poslab train` does.
//!
//! cargo run --release --example train_classifier
//!
//! It trains on examples/data/reviews.tsv (labels that depend on word order) with RoPE and the
//! word-level tokenizer configs/train_reviews.toml names (one id per word of the training
//! texts), and writes a model folder to runs/examples/reviews, which the `predict` example (and
//! `poslab predict`) then use. Paths are the crate's, wherever the example is run from.

use std::path::Path;

use anyhow::Result;
use poslab::runs::results::Outcome;
use poslab::runs::train_run::{self, TrainEnd, TrainOptions, TrainRunConfig};

pub const MODEL_DIR: &str = "runs/examples/reviews";

fn main() -> Result<()> {
    // The config names its data relative to the crate: run from there.
    std::env::set_current_dir(env!("CARGO_MANIFEST_DIR"))?;
    let config = TrainRunConfig::load("configs/train_reviews.toml")?;
    let dir = Path::new(MODEL_DIR);
    if dir.exists() {
        std::fs::remove_dir_all(dir)?; // a fresh run each time
    }
    let options = TrainOptions {
        progress: poslab::progress::Progress::for_stderr(
            false,
            poslab::progress::Progress::DEFAULT_EVERY,
        ),
        // Every core, the fused layer kernels and the default size limits.
        ..TrainOptions::new(dir, poslab::device::parse_device("auto")?)
    };
    let TrainEnd::Finished(metrics) = train_run::start(&config, &options)? else {
        unreachable!("no stop was asked for");
    };
    println!(
        "trained {} parameters for {} steps ({:.0} tokens/s); final train loss {:.4}",
        metrics.summary.params,
        metrics.summary.steps,
        metrics.tokens_per_second,
        metrics.summary.final_train_loss
    );
    for e in &metrics.summary.evaluations {
        if let Outcome::Scored { accuracy, .. } = e.outcome {
            println!("  {:<10} {:5.1}%", e.name, 100.0 * accuracy);
        }
    }
    println!("model folder: {MODEL_DIR}; next: cargo run --release --example predict");
    Ok(())
}
