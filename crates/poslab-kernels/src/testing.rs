//! Inputs for the kernels' tests, here and in the crates that hold the kernels to their
//! reference compositions: fixed pseudo-random values, the same on every machine.

use candle::{DType, Device, Result, Tensor};

/// `len` values in [0, 1) from a fixed linear congruential sequence, one per `seed`.
pub fn uniform(len: usize, seed: u64) -> impl Iterator<Item = f64> {
    let mut x = seed;
    (0..len).map(move |_| {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (x >> 11) as f64 / (1u64 << 53) as f64
    })
}

/// `len` values in [-1, 1) ([`uniform`] of `seed`) as a CPU tensor of `dims` in `dtype`.
pub fn tensor(len: usize, seed: u64, dims: &[usize], dtype: DType) -> Result<Tensor> {
    let values: Vec<f64> = uniform(len, seed).map(|u| u * 2.0 - 1.0).collect();
    Tensor::from_vec(values, dims, &Device::Cpu)?.to_dtype(dtype)
}
