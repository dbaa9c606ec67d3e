//! poslab's kernels: the fused CPU kernels with their hand-written backward passes ([`cpu`]),
//! the device path that runs an encoder layer as a sequence of CUDA launches, with its CPU twin
//! ([`gpu`]), and the one-kernel CUDA ops ([`cuda_ops`]).
//!
//! The kernels themselves come with the default feature `fused`; without it this crate is the
//! specs and the instruction-set levels alone, and a model computes with compositions of candle
//! ops.
//!
//! A leaf: kernels take tensors, slices, shapes and the specs of [`spec`], and know no module
//! of the model, no scheme and no config. The model's ops choose among them and their reference
//! compositions in one place each (`poslab_core::nn::Backend::path`).
//!
//! The fused softmax of scores with a key-padding bias, differentiable, at the best instruction
//! set the CPU has: each row sums to 1, and a padded key gets no weight.
//!
//! ```
//! # #[cfg(feature = "fused")] {
//! use candle::{Device, Tensor, Var};
//! use poslab_kernels::{cpu, spec, SimdLevel};
//!
//! let scores = Var::new(&[[[[0.5f32, -1.0, 2.0], [1.0, 0.0, 3.0]]]], &Device::Cpu)?; // (1, 1, 2, 3)
//! let real = Tensor::new(&[[1u32, 1, 0]], &Device::Cpu)?; // the third key is padding
//! let bias = spec::key_padding_bias(&real, candle::DType::F32)?;
//! let weights = cpu::masked_softmax(scores.as_tensor(), &bias, SimdLevel::detected())?;
//! let rows = weights.squeeze(0)?.squeeze(0)?.to_vec2::<f32>()?;
//! for row in &rows {
//!     assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
//!     assert_eq!(row[2], 0.0);
//! }
//! // Its hand-written backward: the gradient of the first weight reaches every score of its row.
//! let grads = weights.narrow(3, 0, 1)?.sum_all()?.backward()?;
//! assert_eq!(grads.get(scores.as_tensor()).unwrap().dims(), [1, 1, 2, 3]);
//! # }
//! # Ok::<(), candle::Error>(())
//! ```

#[macro_use]
mod simd;
#[cfg(feature = "fused")]
mod real;

#[cfg(feature = "fused")]
pub mod cpu;
#[cfg(feature = "fused")]
pub mod cuda_ops;
#[cfg(feature = "fused")]
pub mod gpu;
pub mod spec;
#[doc(hidden)]
pub mod testing;

#[cfg(feature = "fused")]
pub use real::Real;

/// The size from which `tune_allocator` (the lab's) leaves allocations to `mmap`: each one is
/// then faulted in afresh, which is why the fused layer does not keep attention weights this
/// large for its backward.
pub const MMAP_THRESHOLD: usize = 32 << 20;
#[cfg(feature = "fused")]
pub use simd::count_dispatch;
pub use simd::{simd_dispatches, SimdLevel};

#[cfg(feature = "fused")]
pub use cpu::{head_product_gflops, linear_pass_gflops, matmul_gflops, HeadProduct, LinearPass};

/// The CPU cores this process may use (at least one): what the thread counts left to poslab
/// share out.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs `f` on a rayon pool of `threads` threads of its own (at least one), the calling thread
/// waiting for it. The fused kernels and gemm split their work over the pool `f` runs on: on a
/// pool of its own with one thread they run inline, where from a thread outside any pool each
/// op would be handed to the process-wide pool and waited for (which several jobs at once
/// share, one op at a time). The kernels' results do not depend on the thread count, so
/// neither do `f`'s. If the pool cannot be built, `f` runs here.
pub fn with_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    match rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(|i| format!("poslab-compute-{i}"))
        .build()
    {
        Ok(pool) => pool.install(f),
        Err(_) => f(),
    }
}
