//! A tour of the encoder API: every positional scheme built from one config and one seed,
//! a padded batch encoded, the shift test, one backward pass, and a checkpoint round trip.
//!
//! cargo run --release --example encoder_tour

use std::collections::HashMap;

use anyhow::Result;
use candle::{DType, Device, Tensor, D};
use poslab::{Encoder, ModelConfig, ParamStore, PositionalConfig};

fn main() -> Result<()> {
    // The config next to this crate, wherever the example is run from.
    let base = ModelConfig::load(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/encoder.toml"))?;
    let device = Device::Cpu;
    // Every scheme with its default options (the concatenation 32 wide).
    let schemes = PositionalConfig::catalog(32);

    // Two sequences, the second padded at the end.
    let ids = Tensor::new(
        &[[17u32, 42, 7, 99, 3, 250], [8, 15, 16, 23, 0, 0]],
        &device,
    )?;
    let mask = Tensor::new(&[[1u32, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], &device)?;
    let real = mask.to_dtype(DType::F32)?.unsqueeze(2)?;

    println!(
        "{:<18} {:>9} {:>12} {:>16}",
        "scheme", "params", "shift by 5", "non-zero grads"
    );
    for positional in schemes {
        let config = ModelConfig {
            positional,
            dropout: 0.0,
            attention_dropout: 0.0,
            ..base.clone()
        };
        let params = ParamStore::new(42); // shared layers start identical across schemes
        let encoder = Encoder::new(&config, params.var_builder(DType::F32, &device))?;

        let hidden = encoder.forward_t(&ids, &mask, false)?; // (2, 6, d_model)

        // The shift test: the same text at positions 5.. instead of 0..
        let shifted = encoder.forward_at(&ids, &mask, 5, false)?;
        let shift = (&hidden - shifted)?
            .abs()?
            .broadcast_mul(&real)?
            .max_keepdim(D::Minus1)?
            .max_all()?
            .to_scalar::<f32>()?;

        // One backward pass of a scalar that reads the first coordinate of every real token:
        // every trainable variable gets a non-zero gradient.
        let loss = hidden
            .narrow(D::Minus1, 0, 1)?
            .broadcast_mul(&real)?
            .sum_all()?;
        let grads = loss.backward()?;
        let mut with_grad = 0;
        for var in params.all_vars() {
            if let Some(g) = grads.get(var.as_tensor()) {
                with_grad += usize::from(g.abs()?.max_all()?.to_scalar::<f32>()? > 0.0);
            }
        }

        println!(
            "{:<18} {:>9} {:>12.2e} {:>12}/{:<3}",
            config.positional.scheme().label(),
            params.num_params(),
            shift,
            with_grad,
            params.all_vars().len()
        );

        // Save and reload: the same outputs, bit for bit.
        let path = std::env::temp_dir().join(format!(
            "poslab-tour-{}.safetensors",
            config
                .positional
                .scheme()
                .label()
                .replace([' ', '(', ')', ','], "_")
        ));
        params.save(
            &path,
            HashMap::from([("config".to_string(), config.to_json())]),
        )?;
        let reloaded = ParamStore::new(0);
        let again = Encoder::new(&config, reloaded.var_builder(DType::F32, &device))?;
        reloaded.load(&path)?;
        let same = again
            .forward_t(&ids, &mask, false)?
            .eq(&encoder.forward_t(&ids, &mask, false)?)?
            .min_all()?
            .to_scalar::<u8>()?
            == 1;
        assert!(same, "round trip changed outputs");
        std::fs::remove_file(path)?;
    }
    println!(
        "\nnone ignores positions, and rope, alibi, t5 and kerple see only relative ones: they are \
         unmoved by the shift; the absolute schemes (and untied, TUPE's) move."
    );
    Ok(())
}
