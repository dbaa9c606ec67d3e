//! The crate front page's program, from outside: two schemes, a padded batch, three training
//! steps, the score bias of a scheme. Only `poslab` is a dependency; candle comes through it.

use poslab::prelude::*;

fn main() -> poslab::Result<()> {
    let device = Device::Cpu;
    let ids = Tensor::new(&[[5u32, 8, 13, 0], [3, 1, 4, 1]], &device)?;
    let mask = Tensor::new(&[[1u32, 1, 1, 0], [1, 1, 1, 1]], &device)?; // 0: padding
    let labels = Tensor::new(&[0u32, 1], &device)?;
    let head = HeadConfig::Classify {
        classes: 2,
        pooling: Pooling::Mean,
    };
    for scheme in [
        PositionalConfig::Rope(RopeOptions::default()),
        PositionalConfig::Alibi(Default::default()),
    ] {
        let config = ModelConfig::default()
            .with_vocab_size(16)
            .with_positional(scheme);
        let mut learner = Learner::new(&config, &head, 42, &device)?;
        let encoder = learner.model().encoder();
        let hidden = encoder.forward_t(&ids, &mask, false)?; // (2, 4, 64)
        let bias = encoder.score_bias(0, &Positions::range(0, 4)?)?; // ALiBi's, or None
        let losses: Vec<f64> = (0..3)
            .map(|_| learner.step(&ids, &mask, &labels))
            .collect::<poslab::Result<_>>()?;
        println!(
            "{}: hidden {:?}, score bias {:?}, losses {losses:.4?}",
            config.positional.name(),
            hidden.dims(),
            bias.map(|b| b.dims().to_vec())
        );
    }
    // The types of public fields are reachable at public paths; candle is poslab's own.
    let _: poslab::Activation = ModelConfig::default().activation;
    let _: poslab::candle::DType = poslab::candle::DType::F32;
    let _: poslab::candle_nn::Init = poslab::candle_nn::Init::Const(0.0);
    Ok(())
}
