//! Benchmarks of the hot pieces at the reference shape of `poslab bench` (width 256, 4 heads,
//! FFN 1024, batch 32 x 128 tokens): table building, RoPE, the masked softmax, LayerNorm, GELU,
//! attention and one encoder layer (with sinusoids, RoPE, ALiBi's and T5's score biases), each
//! forward and forward + backward, through the fused
//! kernels (`ops`, and `layer` for whole layers) and through the reference compositions.
//!
//! ```sh
//! cargo bench --bench kernels                 # everything (a few minutes)
//! cargo bench --bench kernels -- attention    # one group
//! ```

use std::sync::{Arc, Mutex};

use candle::{DType, Device, Tensor, Var};
use divan::Bencher;
use poslab::nn::{Backend, Kernels};
use poslab::positional::{sinusoidal_table, PositionTable, Rope};
use poslab::{Encoder, ModelConfig, NormPlacement, ParamStore, PositionalConfig, RopeOptions};
use rand::SeedableRng;

fn main() {
    poslab::tune_allocator();
    divan::main();
}

const B: usize = 32;
const T: usize = 128;
const D: usize = 256;
const H: usize = 4;
const FFN: usize = 1024;

/// The paths a piece can run through: the fused per-op kernels and the reference compositions.
const OPS: [&str; 2] = ["ops", "reference"];
/// For whole layers, also each layer as one node.
const LAYERS: [&str; 3] = ["layer", "ops", "reference"];

/// The backend of the kernels named `name`.
fn backend(name: &str) -> Backend {
    Backend::default().with_kernels(kernels(name))
}

fn kernels(name: &str) -> Kernels {
    match name {
        "layer" => Kernels::Layer,
        "ops" => Kernels::Ops,
        _ => Kernels::Reference,
    }
}

fn random(dims: &[usize], seed: u64) -> Tensor {
    let mut rng = poslab::rng::Rng::seed_from_u64(seed);
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| rand::Rng::random_range(&mut rng, -1.0..1.0))
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// Runs `f` on a variable holding `x` and, with `backward`, back-propagates `sum(f(x))`.
fn run(x: &Var, backward: bool, f: &dyn Fn(&Tensor) -> Tensor) {
    let y = f(x.as_tensor());
    if backward {
        divan::black_box(y.sum_all().unwrap().backward().unwrap());
    } else {
        divan::black_box(y);
    }
}

mod tables {
    use super::*;

    /// A 512 x 256 sinusoid in f64 on the host, the way every fixed table starts.
    #[divan::bench]
    fn sinusoid_512x256() -> Vec<f64> {
        sinusoidal_table(0, 512, D, 10_000.0, Default::default())
    }

    /// RoPE's cos and sin tables for 512 positions of a 64-wide head, rounded to f32 tensors.
    #[divan::bench]
    fn rope_tables_512() -> Rope {
        Rope::new(
            &RopeOptions::default(),
            D / H,
            512,
            DType::F32,
            &Device::Cpu,
        )
        .unwrap()
    }

    /// The rows of one batch from a built table (what every forward does).
    #[divan::bench]
    fn cached_rows(bencher: Bencher) {
        let table = PositionTable::new(D, 512, DType::F32, &Device::Cpu, |n| {
            sinusoidal_table(0, n, D, 10_000.0, Default::default())
        })
        .unwrap();
        bencher.bench(|| table.rows(0, T).unwrap());
    }
}

mod rope {
    use super::*;

    fn bench(bencher: Bencher, path: &str, backward: bool) {
        let rope = Rope::new(&RopeOptions::default(), D / H, T, DType::F32, &Device::Cpu).unwrap();
        let x = Var::from_tensor(&random(&[B, H, T, D / H], 1)).unwrap();
        bencher.bench(|| run(&x, backward, &|x| rope.apply(x, 0, backend(path)).unwrap()));
    }

    #[divan::bench(args = OPS)]
    fn forward(bencher: Bencher, path: &str) {
        bench(bencher, path, false);
    }

    #[divan::bench(args = OPS)]
    fn forward_backward(bencher: Bencher, path: &str) {
        bench(bencher, path, true);
    }
}

mod softmax {
    use super::*;

    fn bench(bencher: Bencher, path: &str, backward: bool) {
        let scores = Var::from_tensor(&(random(&[B, H, T, T], 2) * 4.0).unwrap()).unwrap();
        let bias = Tensor::zeros((B, T), DType::F32, &Device::Cpu).unwrap();
        bencher.bench(|| {
            run(&scores, backward, &|s| {
                poslab::nn::masked_softmax(s, &bias, backend(path)).unwrap()
            })
        });
    }

    #[divan::bench(args = OPS)]
    fn forward(bencher: Bencher, path: &str) {
        bench(bencher, path, false);
    }

    #[divan::bench(args = OPS)]
    fn forward_backward(bencher: Bencher, path: &str) {
        bench(bencher, path, true);
    }
}

mod layer_norm {
    use super::*;

    fn bench(bencher: Bencher, path: &str, backward: bool) {
        let params = ParamStore::new(0);
        let ln =
            poslab::nn::layer_norm(D, 1e-5, params.var_builder(DType::F32, &Device::Cpu)).unwrap();
        let x = Var::from_tensor(&random(&[B, T, D], 3)).unwrap();
        bencher.bench(|| run(&x, backward, &|x| ln.forward(x, backend(path)).unwrap()));
    }

    #[divan::bench(args = OPS)]
    fn forward(bencher: Bencher, path: &str) {
        bench(bencher, path, false);
    }

    #[divan::bench(args = OPS)]
    fn forward_backward(bencher: Bencher, path: &str) {
        bench(bencher, path, true);
    }
}

mod gelu {
    use super::*;

    fn bench(bencher: Bencher, path: &str, backward: bool) {
        let x = Var::from_tensor(&(random(&[B * T, FFN], 4) * 3.0).unwrap()).unwrap();
        bencher.bench(|| {
            run(&x, backward, &|x| {
                poslab::nn::gelu(x, backend(path)).unwrap()
            })
        });
    }

    #[divan::bench(args = OPS)]
    fn forward(bencher: Bencher, path: &str) {
        bench(bencher, path, false);
    }

    #[divan::bench(args = OPS)]
    fn forward_backward(bencher: Bencher, path: &str) {
        bench(bencher, path, true);
    }

    /// candle's own exact GELU (`Tensor::gelu_erf`), the op poslab's replace: about a third
    /// of a naive candle encoder's forward on this CPU (shared/bench/README.md).
    #[divan::bench(args = [false, true])]
    fn candle_gelu_erf(bencher: Bencher, backward: bool) {
        let x = Var::from_tensor(&(random(&[B * T, FFN], 4) * 3.0).unwrap()).unwrap();
        bencher.bench(|| run(&x, backward, &|x| x.gelu_erf().unwrap()));
    }
}

mod attention {
    use super::*;

    /// Multi-head self-attention with its four projections; `rope` rotates q and k.
    fn bench(bencher: Bencher, path: &str, with_rope: bool, backward: bool) {
        let params = ParamStore::new(0);
        let rng = Arc::new(Mutex::new(poslab::rng::Rng::seed_from_u64(0)));
        let attn = poslab::nn::SelfAttention::new(
            D,
            H,
            with_rope,
            true,
            None,
            poslab::nn::Dropout::new(0.0, rng),
            params.var_builder(DType::F32, &Device::Cpu),
        )
        .unwrap();
        let rope = Rope::new(&RopeOptions::default(), D / H, T, DType::F32, &Device::Cpu).unwrap();
        let rotary = with_rope.then(|| {
            rope.rotary(&poslab::Positions::range(0, T).unwrap())
                .unwrap()
        });
        let bias = Tensor::zeros((B, T), DType::F32, &Device::Cpu).unwrap();
        let x = Var::from_tensor(&random(&[B, T, D], 5)).unwrap();
        bencher.bench(|| {
            run(&x, backward, &|x| {
                let inputs = poslab::nn::AttentionInputs {
                    key_padding: &bias,
                    rotary: rotary.as_ref(),
                    score_bias: None,
                    window: poslab::nn::Window::ALL,
                    scores: None,
                };
                attn.forward_t(x, inputs, true, backend(path)).unwrap()
            })
        });
    }

    #[divan::bench(args = OPS)]
    fn forward(bencher: Bencher, path: &str) {
        bench(bencher, path, false, false);
    }

    #[divan::bench(args = OPS)]
    fn forward_backward(bencher: Bencher, path: &str) {
        bench(bencher, path, false, true);
    }

    #[divan::bench(args = OPS)]
    fn rope_forward_backward(bencher: Bencher, path: &str) {
        bench(bencher, path, true, true);
    }
}

mod encoder_layer {
    use super::*;

    /// One pre-norm encoder layer at the reference width (with the token embedding and the
    /// sinusoid in front of it, and the final LayerNorm after it).
    fn bench(bencher: Bencher, path: &str, positional: PositionalConfig, backward: bool) {
        let config = ModelConfig {
            vocab_size: 8192,
            d_model: D,
            n_heads: H,
            n_layers: 1,
            ffn_dim: FFN,
            activation: Default::default(),
            bias: true,
            first_attn_norm: true,
            max_len: T,
            norm: NormPlacement::Pre,
            dropout: 0.0,
            attention_dropout: 0.0,
            embed_scale: poslab::Scale::Value(1.0),
            token_init_std: poslab::Scale::Value(1.0),
            layer_norm_eps: 1e-5,
            dtype: poslab::Precision::F32,
            random_positions: None,
            embeddings: Default::default(),
            positional,
            layers: None,
            causal: false,
        };
        let params = ParamStore::new(0);
        let encoder = Encoder::new(&config, params.var_builder(DType::F32, &Device::Cpu))
            .unwrap()
            .with_backend(backend(path));
        let ids = Tensor::from_vec(
            (0..(B * T) as u32).map(|i| (i * 7919) % 8192).collect(),
            (B, T),
            &Device::Cpu,
        )
        .unwrap();
        let mask = Tensor::ones((B, T), DType::U32, &Device::Cpu).unwrap();
        bencher.bench(|| {
            let y = encoder.forward_t(&ids, &mask, backward).unwrap();
            if backward {
                divan::black_box(y.sum_all().unwrap().backward().unwrap());
            } else {
                divan::black_box(y);
            }
        });
    }

    #[divan::bench(args = LAYERS, sample_count = 20)]
    fn forward(bencher: Bencher, path: &str) {
        bench(
            bencher,
            path,
            PositionalConfig::SinusoidalAdd(Default::default()),
            false,
        );
    }

    #[divan::bench(args = LAYERS, sample_count = 20)]
    fn forward_backward(bencher: Bencher, path: &str) {
        bench(
            bencher,
            path,
            PositionalConfig::SinusoidalAdd(Default::default()),
            true,
        );
    }

    #[divan::bench(args = LAYERS, sample_count = 20)]
    fn rope_forward_backward(bencher: Bencher, path: &str) {
        bench(
            bencher,
            path,
            PositionalConfig::Rope(RopeOptions::default()),
            true,
        );
    }

    /// A score bias without weights (ALiBi): built on the host, added in the kernel.
    #[divan::bench(args = LAYERS, sample_count = 20)]
    fn alibi_forward_backward(bencher: Bencher, path: &str) {
        bench(
            bencher,
            path,
            PositionalConfig::Alibi(Default::default()),
            true,
        );
    }

    /// A learned score bias (T5's buckets): its gradient comes out of the kernel.
    #[divan::bench(args = LAYERS, sample_count = 20)]
    fn t5_forward_backward(bencher: Bencher, path: &str) {
        bench(
            bencher,
            path,
            PositionalConfig::T5(Default::default()),
            true,
        );
    }

    /// A score bias computed per layer from learned parameters (KERPLE).
    #[divan::bench(args = LAYERS, sample_count = 20)]
    fn kerple_forward_backward(bencher: Bencher, path: &str) {
        bench(
            bencher,
            path,
            PositionalConfig::Kerple(Default::default()),
            true,
        );
    }

    /// TUPE's untied term: two projections of the position rows and a product of heads.
    #[divan::bench(args = LAYERS, sample_count = 20)]
    fn untied_forward_backward(bencher: Bencher, path: &str) {
        bench(
            bencher,
            path,
            PositionalConfig::Untied(Default::default()),
            true,
        );
    }
}
