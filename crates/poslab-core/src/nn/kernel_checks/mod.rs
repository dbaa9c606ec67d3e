//! The kernels (`poslab_kernels`) held to the reference compositions beside the ops that choose
//! them: forward and every gradient, at every instruction set level the machine has.

mod attention;
mod cuda_ops;
mod layer;
mod reflections;
mod running_sums;
