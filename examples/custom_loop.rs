//! A training loop of your own over poslab's encoder, on data held in memory.
//!
//! cargo run --release --example custom_loop
//!
//! The task: in a sequence of random tokens, was token 1 before token 2? Order alone decides it,
//! so the `none` control stays at chance while RoPE learns it. The loop is yours: the encoder
//! and AdamW come from poslab, the head (a candle-nn linear layer on the mean of the hidden
//! states), the batches and the schedule from this file.

use poslab::candle::{DType, Device, Module, Tensor, D};
use poslab::candle_nn;
use poslab::prelude::*;
use poslab::train::optim::{AdamW, AdamWConfig};
use rand::{Rng, SeedableRng};

const VOCAB: u32 = 20;
const LEN: usize = 12;

/// `n` sequences of `LEN` tokens from 3..VOCAB with a 1 and a 2 at random places; label 1 when
/// the 1 comes first.
fn data(n: usize, seed: u64) -> (Vec<Vec<u32>>, Vec<u32>) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let mut seq: Vec<u32> = (0..LEN).map(|_| rng.random_range(3..VOCAB)).collect();
            let (a, b) = (rng.random_range(0..LEN), rng.random_range(0..LEN - 1));
            let b = if b >= a { b + 1 } else { b };
            seq[a] = 1;
            seq[b] = 2;
            (seq, u32::from(a < b))
        })
        .unzip()
}

fn accuracy(logits: &Tensor, labels: &Tensor) -> poslab::Result<f64> {
    let hits = logits.argmax(D::Minus1)?.eq(labels)?.to_dtype(DType::F64)?;
    Ok(hits.mean_all()?.to_scalar::<f64>()?)
}

fn main() -> poslab::Result<()> {
    let device = Device::Cpu;
    let (train, train_labels) = data(2048, 1);
    let (test, test_labels) = data(512, 2);
    let tensor = |rows: &[Vec<u32>]| Tensor::new(rows.to_vec(), &device);
    let (test_ids, test_y) = (tensor(&test)?, Tensor::new(test_labels, &device)?);
    let test_mask = test_ids.ones_like()?;

    for scheme in [
        PositionalConfig::None(NoOptions {}),
        PositionalConfig::Rope(RopeOptions::default()),
    ] {
        let config = ModelConfig::default()
            .with_vocab_size(VOCAB as usize)
            .with_dropout(0.0, 0.0)
            .with_positional(scheme);
        let (mut encoder, params) = Encoder::seeded(&config, 0, &device)?;
        // Each layer's weights as one variable, as poslab's runs train them: the same numbers,
        // one gradient a layer instead of a dozen (fewer kernel launches on a GPU).
        encoder.pack(&params)?;
        // Your own head, its weights in the same store (so the optimizer sees them).
        let vb = params.var_builder(DType::F32, &device);
        let head = candle_nn::linear(config.d_model, 2, vb.pp("my_head"))?;
        // Like the encoder's biases (Encoder::seeded declared them), the head's bias is not
        // weight-decayed: the store holds that, and the optimizer reads it from there.
        params.exempt_from_decay(&head.bias().into_iter().cloned().collect::<Vec<_>>());
        let mut adamw = AdamW::from_store(&params, AdamWConfig::default())?;
        let forward = |ids: &Tensor, mask: &Tensor, train: bool| -> poslab::Result<Tensor> {
            let hidden = encoder.forward_t(ids, mask, train)?; // (b, t, d)
            Ok(head.forward(&hidden.mean(1)?)?) // (b, 2)
        };
        let steps = 300;
        for step in 0..steps {
            let at = (step * 32) % train.len();
            let ids = tensor(&train[at..at + 32])?;
            let y = Tensor::new(&train_labels[at..at + 32], &device)?;
            let logits = forward(&ids, &ids.ones_like()?, true)?;
            let loss = poslab::model::cross_entropy(&logits, &y, None)?;
            let lr = 2e-3 * (1.0 - step as f64 / steps as f64); // linear decay: your schedule
            adamw.step(&loss.backward()?, lr, 1.0)?;
        }
        let acc = accuracy(&forward(&test_ids, &test_mask, false)?, &test_y)?;
        println!(
            "{:<5} test accuracy {:.1}%",
            config.positional.name(),
            100.0 * acc
        );
    }
    Ok(())
}
