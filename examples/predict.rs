//! Use a trained model on new text: labels with probabilities, and sentence vectors.
//!
//! cargo run --release --example predict [MODEL_DIR]
//!
//! MODEL_DIR defaults to runs/examples/reviews (made by the `train_classifier` example); any
//! model folder works, including those `poslab compare` saves under runs/*/models/.

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle::{DType, Device};
use poslab::infer::{Prediction, Predictor};

fn main() -> Result<()> {
    // A folder given on the command line is read from where the example runs; the default is
    // the one `train_classifier` writes inside the crate.
    let dir = match std::env::args().nth(1) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("runs/examples/reviews"),
    };
    if !dir.join("config.json").exists() {
        bail!(
            "{} holds no model yet: run `cargo run --release --example train_classifier` first",
            dir.display()
        );
    }
    let loaded = poslab::saved::load(&dir, DType::F32, &Device::Cpu)?;
    let texts: Vec<String> = [
        "the food was bad but the wine was great",
        "the wine was great but the food was bad",
        "although the service was awful the dessert was superb",
        "the coffee was not good",
    ]
    .map(String::from)
    .to_vec();
    let predictor = Predictor::new(&loaded, false);
    for out in predictor.predict(&texts, 3)? {
        if let Prediction::Class {
            label,
            probabilities,
        } = &out.value
        {
            println!(
                "{label:>8} ({:.3})  {}",
                probabilities[0].probability, out.text
            );
        }
    }
    // Sentence vectors: the two orders of the same words land far apart.
    let v = predictor.embed(&texts[..2])?;
    let (a, b) = (&v[0].value.embedding, &v[1].value.embedding);
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |x: &[f32]| x.iter().map(|v| v * v).sum::<f32>().sqrt();
    println!(
        "cosine between the first two (same words, other order): {:.3}",
        dot / (norm(a) * norm(b))
    );
    Ok(())
}
