//! Dropout with masks from poslab's own seeded generator.

use std::sync::{Arc, Mutex};

use candle::{DType, Device, ModuleT, Result, Tensor};
use rand::RngCore;

use super::Backend;
use crate::kernels::spec::SeededDropout;
use crate::rng::Rng;

/// One generator shared by every dropout site of a model: masks are drawn in forward order, so
/// the same seed and the same batches give the same masks.
pub type SharedRng = Arc<Mutex<Rng>>;

/// Inverted dropout: in training each unit is zeroed with probability `p` and the survivors are
/// scaled by `1 / (1 - p)`; in evaluation it is the identity.
///
/// candle's `ops::dropout` draws from the device generator, which cannot be seeded on CPU, so
/// masks are drawn here on the host and uploaded.
#[derive(Clone, Debug)]
pub struct Dropout {
    p: f64,
    rng: SharedRng,
}

impl Dropout {
    /// Dropout with probability `p`, its masks drawn from `rng` (seeded, so runs repeat).
    pub fn new(p: f64, rng: SharedRng) -> Self {
        Self { p, rng }
    }

    fn mask(&self, shape: &candle::Shape, dtype: DType, device: &Device) -> Result<Tensor> {
        // Keep a unit when a uniform u32 is at or above p * 2^32: exactly probability 1 - p
        // up to 2^-32.
        let threshold = (self.p * 4_294_967_296.0) as u64;
        let n = shape.elem_count();
        let mut rng = self.rng.lock().expect("dropout generator lock poisoned");
        let mut keep = || u64::from(rng.next_u32()) >= threshold;
        let mask = if dtype == DType::F64 {
            let scale = 1.0 / (1.0 - self.p);
            let v: Vec<f64> = (0..n).map(|_| if keep() { scale } else { 0.0 }).collect();
            Tensor::from_vec(v, shape, &Device::Cpu)?
        } else {
            let scale = (1.0 / (1.0 - self.p)) as f32;
            let v: Vec<f32> = (0..n).map(|_| if keep() { scale } else { 0.0 }).collect();
            Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)?
        };
        mask.to_device(device)
    }
}

impl Dropout {
    /// The multipliers this dropout would apply to a tensor of `shape` (drawn from the shared
    /// generator exactly as [`ModuleT::forward_t`] draws them), or none when it is inactive.
    pub(crate) fn multipliers(
        &self,
        shape: &candle::Shape,
        dtype: DType,
        device: &Device,
        train: bool,
    ) -> Result<Option<Tensor>> {
        if !train || self.p == 0.0 {
            return Ok(None);
        }
        self.mask(shape, dtype, device).map(Some)
    }
}

impl Dropout {
    /// A seeded dropout (one `u64` drawn from the shared generator) for a mask the kernels
    /// draw themselves, or none when it is inactive.
    pub(crate) fn seeded(&self, train: bool) -> Option<SeededDropout> {
        if !train || self.p == 0.0 {
            return None;
        }
        let mut rng = self.rng.lock().expect("dropout generator lock poisoned");
        Some(SeededDropout {
            seed: rng.next_u64(),
            p: self.p,
        })
    }

    /// The attention weights' multipliers for a `(b, h, t, t)` tensor like `like`, drawn as
    /// `backend` draws them ([`Backend::seeds_attention_dropout`]), or none when inactive.
    pub(crate) fn attention_multipliers(
        &self,
        like: &Tensor,
        shape: &candle::Shape,
        train: bool,
        backend: Backend,
    ) -> Result<Option<Tensor>> {
        match backend.seeds_attention_dropout(like) {
            true => self
                .seeded(train)
                .map(|d| d.mask(shape, like.dtype(), like.device()))
                .transpose(),
            false => self.multipliers(shape, like.dtype(), like.device(), train),
        }
    }

    /// [`ModuleT::forward_t`] on attention weights `(b, h, t, t)`, their multipliers drawn as
    /// `backend` draws them.
    pub(crate) fn forward_attention(
        &self,
        weights: &Tensor,
        train: bool,
        backend: Backend,
    ) -> Result<Tensor> {
        match self.attention_multipliers(weights, weights.shape(), train, backend)? {
            Some(mask) => weights.mul(&mask),
            None => Ok(weights.clone()),
        }
    }
}

impl ModuleT for Dropout {
    /// `xs` with each entry zeroed with probability `p` and the rest scaled by `1 / (1 - p)` in
    /// training; `xs` unchanged otherwise.
    ///
    /// # Shapes
    /// Any shape; the output has the input's.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        match self.multipliers(xs.shape(), xs.dtype(), xs.device(), train)? {
            Some(mask) => xs.mul(&mask),
            None => Ok(xs.clone()),
        }
    }
}
