//! One positional module inside your own attention: RoPE's rotation and ALiBi's bias from
//! poslab, the attention itself written with candle ops.
//!
//! cargo run --release --example positional_module
//!
//! Both are relative: moving every position by the same amount leaves the attention weights as
//! they were, which this program checks.

use poslab::candle::{DType, Device, Tensor, D};
use poslab::positional::{Alibi, Rope, RopeOptions};
use poslab::Positions;

/// softmax(q kᵀ / sqrt(d) + bias) over the keys.
///
/// # Shapes
/// - `q`, `k`: `(b, h, t, d)`; `bias`: `(1 or b, h, t, t)`; returns `(b, h, t, t)`
fn attention_weights(q: &Tensor, k: &Tensor, bias: Option<&Tensor>) -> poslab::Result<Tensor> {
    let d = q.dim(D::Minus1)? as f64;
    let scores = (q.matmul(&k.t()?)? / d.sqrt())?;
    let scores = match bias {
        Some(b) => scores.broadcast_add(b)?,
        None => scores,
    };
    Ok(poslab::nn::softmax_last_dim(&scores)?)
}

fn max_difference(a: &Tensor, b: &Tensor) -> poslab::Result<f32> {
    Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?)
}

fn main() -> poslab::Result<()> {
    let device = Device::Cpu;
    let (b, h, t, d) = (2, 4, 10, 16);
    // Seeded queries and keys (candle's own random generator is not seeded).
    let mut rng = poslab::rng::stream(0, "positional_module example");
    let mut uniform = |n: usize| -> Vec<f32> {
        use rand::Rng;
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    };
    let q = Tensor::from_vec(uniform(b * h * t * d), (b, h, t, d), &device)?;
    let k = Tensor::from_vec(uniform(b * h * t * d), (b, h, t, d), &device)?;

    // RoPE: tables computed once for the head width, rows taken for any positions.
    // The rotation runs on poslab's kernels: the backend says which (the fused CPU kernels by
    // default; `Backend::reference()` for the compositions of candle ops).
    let rope = Rope::new(&RopeOptions::default(), d, 64, DType::F32, &device)?;
    let backend = poslab::nn::Backend::default();
    let at = |start| -> poslab::Result<Tensor> {
        let rotation = rope.rotary(&Positions::range(start, t)?)?;
        let (q, k) = (rotation.apply(&q, backend)?, rotation.apply(&k, backend)?);
        attention_weights(&q, &k, None)
    };
    let moved = max_difference(&at(0)?, &at(100)?)?;
    println!("RoPE: attention weights at positions 0.. and 100.. differ by {moved:.1e}");
    assert!(moved < 1e-5);

    // ALiBi: a (1, h, t, t) bias of the positions, added to the scores.
    let alibi = Alibi::new(h);
    let at = |start| -> poslab::Result<Tensor> {
        let bias = alibi.bias(&Positions::range(start, t)?, DType::F32, &device)?;
        attention_weights(&q, &k, Some(&bias))
    };
    let moved = max_difference(&at(0)?, &at(100)?)?;
    println!(
        "ALiBi (slopes {:?}): moved by 100, weights differ by {moved:.1e}",
        alibi.slopes()
    );
    assert!(moved < 1e-5);
    Ok(())
}
