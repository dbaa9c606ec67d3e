//! Every layer of an encoder as one node on the device path ([`crate::gpu`]).
//!
//! A layer as its own node ([`super::encoder_layer`]) costs the step a handful of candle
//! tensors besides its work: its output, its score bias input, the gradient it returns and its
//! views, and a zero-fill and an add for each of the two gradients candle accumulates (the
//! layer's input and its packed parameters). With the layers' parameters packed in one
//! variable, this node runs them one after another on the same stream, the same operations in
//! the same order, and pays those once for the stack: the step's results are the same bits
//! (the tests compare them). The backward writes each layer's parameter gradient into its
//! place in the stack's, and the layers' input gradients into two buffers taken in turn; the
//! column sums of every layer read one row of ones.
//!
//! The price is memory at the end of the backward: candle adds the stack's parameter gradient
//! to zeros of its size, so three copies of it live at once (one layer's, separately).

use std::sync::Mutex;

use candle::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::layer::LayerOp;
use super::Attention;
use crate::gpu as device;
use crate::spec::{AttentionDropout, LayerMasks, LayerShape};

/// One layer of a stack: what [`super::encoder_layer`] takes besides its input and parameters.
pub struct StackLayer {
    pub shape: LayerShape,
    pub attention: Attention,
    pub masks: LayerMasks,
}

/// What a training forward keeps for the backward: the input of every layer after the first,
/// and each layer's activations.
struct Kept {
    inputs: Vec<device::Buf>,
    saved: Vec<device::layer::Saved>,
}

struct StackOp {
    layers: Vec<LayerOp>,
    /// Where each layer's parameters start in the packed vector (they follow one another).
    params_at: Vec<usize>,
    /// Where each layer's score bias gradient starts in the bias input, and its length.
    biases: Vec<(usize, usize)>,
    keep: bool,
    kept: Mutex<Option<Kept>>,
}

/// Every layer of an encoder, in order, as one node on the device path: the same as
/// [`super::encoder_layer`] on each layer in turn (with `device` set), its parameters packed
/// one layer after another in `params`.
///
/// # Shapes
/// - `x`: `(b, t, d)`; `params`: the layers' packed vectors one after another
/// - returns `(b, t, d)`
pub fn encoder_stack(
    x: &Tensor,
    params: &Tensor,
    layers: Vec<StackLayer>,
    keep_activations: bool,
) -> Result<Tensor> {
    if layers.is_empty() {
        candle::bail!("an encoder stack of no layers");
    }
    let stream = crate::gpu::stream_for(x.device())?;
    let compute = crate::gpu::compute_dtype(x.dtype());
    let (mut ops, mut params_at, mut biases, mut bias_inputs) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut at, mut bias_at) = (0, 0);
    for layer in layers {
        let drawn = matches!(layer.masks.attention, Some(AttentionDropout::Drawn(_)));
        let attention = match crate::gpu::layer::fuses(&*stream, drawn) {
            true => layer.attention,
            false => layer.attention.without_offsets()?,
        };
        let attention = attention.in_dtype(compute)?;
        let nb = attention.bias_grad_len();
        if nb > 0 {
            let input = attention.score_bias_input(x)?;
            if input.elem_count() != nb {
                candle::bail!(
                    "an encoder stack's layer owes {nb} score bias gradients for an input of {}",
                    input.elem_count()
                );
            }
            bias_inputs.push(input);
        }
        let op = LayerOp::new(layer.shape, attention, layer.masks, keep_activations);
        params_at.push(at);
        biases.push((bias_at, nb));
        at += op.packed_len();
        bias_at += nb;
        ops.push(op);
    }
    // A bias several layers share enters once for each, as a view of its own: candle's backward
    // then reaches the shared tensor from the last layer's view to the first's, and sums its
    // gradient in the order it does over separate layers' nodes, to the same bits.
    let shared = |t: &Tensor| bias_inputs.iter().filter(|u| u.id() == t.id()).count() > 1;
    let bias_inputs = bias_inputs
        .iter()
        .map(|t| match shared(t) {
            true => t.reshape(t.shape()),
            false => Ok(t.clone()),
        })
        .collect::<Result<Vec<_>>>()?;
    // The layers' biases one after another: of one shape (every layer's the same kind),
    // stacked as they are; else flattened.
    let same = bias_inputs.windows(2).all(|w| w[0].dims() == w[1].dims());
    let bias = match (bias_inputs.is_empty(), same) {
        (true, _) => Tensor::zeros(0, compute, x.device())?,
        (false, true) => Tensor::cat(&bias_inputs, 0)?,
        (false, false) => {
            let flat = bias_inputs.iter().map(Tensor::flatten_all);
            Tensor::cat(&flat.collect::<Result<Vec<_>>>()?, 0)?
        }
    };
    let params = params.to_dtype(x.dtype())?.contiguous()?;
    let op = StackOp {
        layers: ops,
        params_at,
        biases,
        keep: keep_activations,
        kept: Mutex::new(None),
    };
    x.contiguous()?.apply_op3(&params, &bias, op)
}

impl StackOp {
    fn dims(&self, l: &Layout, lp: &Layout) -> Result<(usize, usize, usize)> {
        let dims = match l.dims() {
            [b, t, d] => (*b, *t, *d),
            dims => candle::bail!("encoder stack: x must be (b, t, d_model), got {dims:?}"),
        };
        let len: usize = self.layers.iter().map(LayerOp::packed_len).sum();
        if lp.dims() != [len] {
            candle::bail!(
                "encoder stack: packed parameters {:?}, expected ({len})",
                lp.dims()
            );
        }
        Ok(dims)
    }

    /// Layer `i`'s parameters in `p`.
    fn params(&self, p: device::Mem, i: usize) -> Result<device::Mem> {
        p.at(self.params_at[i], self.layers[i].packed_len())
    }

    /// The forward on `stream`: the last layer's output, and `keep`ing, what the backward reads.
    fn run(
        &self,
        stream: &dyn device::Stream,
        x: device::Mem,
        p: device::Mem,
        dims: (usize, usize, usize),
        keep: bool,
    ) -> Result<(device::Buf, Option<Kept>)> {
        let mut kept = Kept {
            inputs: Vec::new(),
            saved: Vec::new(),
        };
        let mut y: Option<device::Buf> = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let input = y.as_ref().map_or(x, device::Buf::mem);
            let (out, saved) = layer.device_run(stream, input, self.params(p, i)?, dims, keep)?;
            if let (true, Some(saved)) = (keep, saved) {
                kept.saved.push(saved);
            }
            if let (true, Some(input)) = (keep, y.replace(out)) {
                kept.inputs.push(input);
            }
        }
        let Some(y) = y else {
            candle::bail!("an encoder stack of no layers")
        };
        Ok((y, keep.then_some(kept)))
    }

    /// The forward on `stream`, keeping what the backward reads when training.
    fn forward(
        &self,
        stream: &dyn device::Stream,
        x: device::Mem,
        p: device::Mem,
        dims: (usize, usize, usize),
    ) -> Result<device::Buf> {
        let (y, kept) = self.run(stream, x, p, dims, self.keep)?;
        *self.kept.lock().expect("stack activations lock poisoned") = kept;
        Ok(y)
    }

    /// `[dx | dparams | d(score biases)]` on `stream`, from what the forward kept (else it is
    /// recomputed).
    fn backward(
        &self,
        stream: &dyn device::Stream,
        [x, p, gy]: [device::Mem; 3],
        dims: (usize, usize, usize),
    ) -> Result<device::Buf> {
        let taken = self
            .kept
            .lock()
            .expect("stack activations lock poisoned")
            .take();
        let layers = self.layers.len();
        let kept = match taken {
            Some(k) if k.saved.len() == layers && k.inputs.len() == layers - 1 => k,
            _ => match self.run(stream, x, p, dims, true)?.1 {
                Some(k) if k.saved.len() == layers => k,
                _ => candle::bail!("device path: a training forward kept nothing"),
            },
        };
        let (b, t, d) = dims;
        let (nx, np) = (b * t * d, p.len);
        let nb: usize = self.biases.iter().map(|&(_, n)| n).sum();
        let dt = x.dtype;
        let out = stream.alloc(dt, nx + np + nb)?;
        let ones = device::layer::ones(stream, b, t, dt)?;
        // Layer i > 0 writes its input gradient into turns[(i - 1) % 2], which layer i - 1 reads.
        let turns = (0..(layers - 1).min(2))
            .map(|_| stream.alloc(dt, nx))
            .collect::<Result<Vec<_>>>()?;
        let Kept {
            mut inputs,
            mut saved,
        } = kept;
        for i in (0..layers).rev() {
            let Some(sv) = saved.pop() else {
                candle::bail!("device path: layer {i}'s activations were not kept")
            };
            // `inputs` holds the inputs of layers 1 to i.
            let input = match i {
                0 => x,
                _ => match inputs.last() {
                    Some(buf) => buf.mem(),
                    None => candle::bail!("device path: layer {i}'s input was not kept"),
                },
            };
            let gy_i = match i + 1 == layers {
                true => gy,
                false => turns[i % 2].mem(),
            };
            let (bias_at, bias_len) = self.biases[i];
            let into = device::layer::Grads {
                dx: match i {
                    0 => out.at(0, nx)?,
                    _ => turns[(i - 1) % 2].mem(),
                },
                dp: out.at(nx + self.params_at[i], self.layers[i].packed_len())?,
                dbias: out.at(nx + np + bias_at, bias_len)?,
                ones: ones.mem(),
            };
            let mems = (input, self.params(p, i)?, gy_i);
            self.layers[i].device_backward_into(stream, Some(sv), mems, dims, into)?;
            if i > 0 {
                inputs.pop();
            }
        }
        Ok(out)
    }
}

/// The stack as a candle op on `(x, packed parameters, score biases or empty)`.
impl CustomOp3 for StackOp {
    fn name(&self) -> &'static str {
        "poslab-encoder-stack"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = self.dims(l1, l2)?;
        let inputs = [(s1, l1), (s2, l2), (s3, l3)];
        let (y, _) = device::on_twin(inputs, |s, [x, p, _]| self.forward(s, x, p, dims))?;
        Ok((y, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
        s3: &candle::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        let dims = self.dims(l1, l2)?;
        let inputs = [(s1, l1), (s2, l2), (s3, l3)];
        let (y, _) = device::on_cuda(inputs, |s, [x, p, _]| self.forward(s, x, p, dims))?;
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        params: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let grads = x.apply_op3_no_bwd(params, &g, &StackGrad { stack: self })?;
        super::layer::split_gradients(&grads, (x, params, bias), bias.elem_count() > 0)
    }
}

/// The backward of [`StackOp`] as a no-gradient op on `(x, params, dy)`.
struct StackGrad<'a> {
    stack: &'a StackOp,
}

impl CustomOp3 for StackGrad<'_> {
    fn name(&self) -> &'static str {
        "poslab-encoder-stack-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = self.stack.dims(l1, l2)?;
        let inputs = [(s1, l1), (s2, l2), (s3, l3)];
        let (out, len) = device::on_twin(inputs, |s, m| self.stack.backward(s, m, dims))?;
        Ok((out, Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
        s3: &candle::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        let dims = self.stack.dims(l1, l2)?;
        let inputs = [(s1, l1), (s2, l2), (s3, l3)];
        let (out, len) = device::on_cuda(inputs, |s, m| self.stack.backward(s, m, dims))?;
        Ok((out, Shape::from(len)))
    }
}
