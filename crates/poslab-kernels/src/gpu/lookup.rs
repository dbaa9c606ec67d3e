//! The token embedding's lookup on the device path: candle's gather going forward, and going
//! backward [`Stream::embedding_back`] in place of candle's `index_add`.
//!
//! candle's CUDA `index_add` gives each of the table's columns one thread, which walks every
//! token in turn: at width 768 and 16,384 tokens, 768 threads each adding 16,384 rows (its
//! cost: the book's performance page, "Measurements behind the code's choices"). `embedding_back` reads each token's row once per block of
//! columns and sums in token order, without atomics, as candle's CPU `index_add` does: on the
//! CPU twin the gradient is candle's bits.

use candle::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::{Buf, Stream};

/// `table` `(vocab, d)` at `ids` (u32, any shape): `(ids..., d)`.
///
/// # Shapes
/// - `table`: `(vocab, d)`, f64, f32, bf16 or f16
/// - `ids`: any shape, u32
/// - returns `(ids..., d)`
pub fn lookup(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (vocab, d) = table.dims2()?;
    let mut dims = ids.dims().to_vec();
    dims.push(d);
    let flat = ids.flatten_all()?.contiguous()?;
    // The op gives the rows their shape itself: a reshape after it would be one more node,
    // whose backward candle adds into a zero-filled tensor (two launches a step).
    table.contiguous()?.apply_op2(
        &flat,
        Lookup {
            vocab,
            shape: Shape::from(dims),
        },
    )
}

/// The lookup as a candle op on `(table, ids)`, its output of `shape` `(ids..., d)`.
struct Lookup {
    vocab: usize,
    shape: Shape,
}

/// The lookup's backward as a candle op on `(gradient (n, d), ids (n))`: the table's gradient.
struct LookupGrad {
    vocab: usize,
}

impl CustomOp2 for Lookup {
    fn name(&self) -> &'static str {
        "poslab-token-lookup"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        gather(s1, l1, s2, l2, &self.shape)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        gather(s1, l1, s2, l2, &self.shape)
    }

    fn bwd(
        &self,
        _table: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let table_grad = grad.apply_op2_no_bwd(ids, &LookupGrad { vocab: self.vocab })?;
        Ok((Some(table_grad), None))
    }
}

/// The table's rows at the ids, on either backend: candle's own gather, `n` rows of `d` given
/// `shape` (`(ids..., d)`).
fn gather<B: candle::backend::BackendStorage>(
    table: &B,
    l1: &Layout,
    ids: &B,
    l2: &Layout,
    shape: &Shape,
) -> Result<(B, Shape)> {
    if shape.elem_count() != l2.shape().elem_count() * l1.dims()[1] {
        candle::bail!(
            "token lookup: {} ids of a table {:?} cannot fill {shape:?}",
            l2.shape().elem_count(),
            l1.dims()
        )
    }
    let out = table.index_select(ids, l1, l2, 0)?;
    Ok((out, shape.clone()))
}

impl LookupGrad {
    /// The gradient through `stream`, from the memory of the op's two inputs.
    fn run(&self, stream: &dyn Stream, g: super::Mem, ids: super::Mem) -> Result<(Buf, Shape)> {
        let n = ids.len;
        if n == 0 || !g.len.is_multiple_of(n) {
            candle::bail!("token lookup: a gradient of {} values for {n} ids", g.len)
        }
        let d = g.len / n;
        let out = stream.alloc(g.dtype, self.vocab * d)?;
        stream.embedding_back(ids, g, out.mem(), self.vocab, d)?;
        Ok((out, Shape::from((self.vocab, d))))
    }
}

impl CustomOp2 for LookupGrad {
    fn name(&self) -> &'static str {
        "poslab-token-lookup-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        use super::twin::Twin;
        let (out, shape) = self.run(&Twin, Twin::mem(s1, l1)?, Twin::mem(s2, l2)?)?;
        Ok((out.into_cpu_storage()?, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        use super::cuda::{mem, CudaStream};
        use candle::backend::BackendStorage;
        let stream = CudaStream::new(s1.device());
        let (out, shape) = self.run(&stream, mem(s1, l1)?, mem(s2, l2)?)?;
        Ok((out.into_cuda_storage()?, shape))
    }
}

#[cfg(test)]
mod tests {
    use candle::{DType, Device, Tensor, Var};

    /// The lookup and its gradient on the device path's twin against candle's embedding (its
    /// `index_select` and, backward, `index_add`), with ids repeated, ids no token has, and a
    /// 2-d batch: the same values, and the gradient candle's bits (token order, one add a
    /// token) in f64 and f32; in bf16, where candle rounds after every add and the kernel once
    /// (it sums in f32), within 2 bf16 steps (2^-7 relative). Fails when a row is summed
    /// twice, missed, or a row without tokens is not zero.
    #[test]
    fn the_device_lookups_gradient_is_candles_index_add() {
        let (vocab, d) = (11, 37);
        let ids = Tensor::new(&[[3u32, 7, 3, 0], [10, 3, 7, 7]], &Device::Cpu).unwrap();
        for dtype in [DType::F64, DType::F32, DType::BF16] {
            let table = Var::from_tensor(
                &Tensor::arange(0u32, (vocab * d) as u32, &Device::Cpu)
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .affine(0.37, -40.0)
                    .unwrap()
                    .sin()
                    .unwrap()
                    .reshape((vocab, d))
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )
            .unwrap();
            // A gradient with every token's row distinct: the loss weighs each output value.
            let weights = Tensor::arange(0u32, (8 * d) as u32, &Device::Cpu)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .affine(0.61, 1.0)
                .unwrap()
                .cos()
                .unwrap()
                .reshape((2, 4, d))
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let run = |device: bool| {
                let out = if device {
                    super::lookup(table.as_tensor(), &ids).unwrap()
                } else {
                    let embedding = candle_nn::Embedding::new(table.as_tensor().clone(), d);
                    candle::Module::forward(&embedding, &ids).unwrap()
                };
                let grads = (&out * &weights)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let g = grads.get(table.as_tensor()).unwrap().clone();
                let bits = |t: &Tensor| {
                    t.to_dtype(DType::F64)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f64>()
                        .unwrap()
                };
                (out.dims().to_vec(), bits(&out), bits(&g))
            };
            let device = run(true);
            let candle = run(false);
            assert_eq!(device.0, vec![2, 4, d], "{dtype:?}");
            assert_eq!(device.1, candle.1, "{dtype:?}: forward");
            if dtype == DType::BF16 {
                for (a, b) in device.2.iter().zip(&candle.2) {
                    assert!(
                        (a - b).abs() <= 2f64.powi(-6) * b.abs().max(1.0),
                        "{a} vs {b}"
                    );
                }
            } else {
                assert_eq!(device.2, candle.2, "{dtype:?}: gradient");
            }
            // Rows without tokens (ids 1, 2, 4..6, 8, 9) have zero gradient; id 3's has three
            // tokens' worth: not all zero.
            let g = &device.2;
            assert!(g[d..2 * d].iter().all(|v| *v == 0.0), "{dtype:?}");
            assert!(g[3 * d..4 * d].iter().any(|v| *v != 0.0), "{dtype:?}");
        }
    }
}
