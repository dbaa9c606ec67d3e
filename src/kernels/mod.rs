//! poslab's kernels: the fused CPU kernels with their hand-written backward passes ([`cpu`]),
//! the device path that runs an encoder layer as a sequence of CUDA launches, with its CPU twin
//! ([`gpu`]), and the one-kernel CUDA ops ([`cuda_ops`]).
//!
//! A leaf: kernels take tensors, slices, shapes and the specs of [`spec`], and know no module
//! of the model, no scheme and no config. The model's ops choose among them and their reference
//! compositions in one place each (`nn::Backend::path`).

#[macro_use]
mod simd;
mod real;

pub mod cpu;
pub mod cuda_ops;
pub mod gpu;
pub mod spec;

pub(crate) use real::Real;

/// The size from which `tune_allocator` (the lab's) leaves allocations to `mmap`: each one is
/// then faulted in afresh, which is why the fused layer does not keep attention weights this
/// large for its backward.
pub const MMAP_THRESHOLD: usize = 32 << 20;
pub(crate) use simd::count_dispatch;
pub use simd::{simd_dispatches, SimdLevel};

pub use cpu::{head_product_gflops, linear_pass_gflops, matmul_gflops, HeadProduct, LinearPass};
