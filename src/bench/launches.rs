//! `poslab bench --launches`: what one training step asks of a GPU, counted on any device.
//!
//! The step (forward with the loss, backward, AdamW) runs as it does on CUDA: on a GPU itself,
//! or on the CPU with every encoder layer on the device path's CPU twin
//! ([`crate::nn::Backend::as_on_cuda`]), which issues the same operations in the same order. Two
//! counts make `launches_per_step`:
//! - the device path's operations, exactly: kernel launches, cuBLAS calls and copies
//!   ([`crate::nn::device_path::counts`]);
//! - candle's, bounded from above by the tensors the step creates: each of candle's kernels
//!   makes one, and views (reshapes, narrows, transposes) and detached handles count too though
//!   they launch nothing.
//!
//! `peak_device_bytes` is the high-water mark of memory in use during the step: on CUDA that of
//! the memory pool candle allocates from (as PyTorch's `max_memory_allocated`), on the CPU that
//! of the process's heap ([`crate::heap`], when its global allocator counts), where every tensor
//! then lives.

use candle::{DType, Device, Tensor};
use serde::Serialize;

use super::{batch, sync, Options};
use crate::error::{Error, Result};
use crate::model::{HeadConfig, Pooling, TaskModel};
use crate::nn::device_path;
use crate::params::ParamStore;
use crate::train::optim::{AdamW, AdamWConfig};

/// One variant's step, counted.
#[derive(Clone, Debug, Serialize)]
pub struct Launches {
    /// The variant's name.
    pub variant: String,
    /// `cuda` or `cpu twin`.
    pub device: String,
    /// Kernels, cuBLAS calls and copies of the device path, and candle's tensors: an upper
    /// bound of what a GPU launches for the step.
    pub launches_per_step: usize,
    /// The device path's kernel launches.
    pub kernels: usize,
    /// The device path's cuBLAS calls.
    pub gemms: usize,
    /// The device path's copies and conversions.
    pub copies: usize,
    /// Tensors candle created in the step.
    pub candle_tensors: usize,
    /// The most memory in use at once during the step (None where it cannot be read).
    pub peak_device_bytes: Option<u64>,
    /// Parameters, their gradients and AdamW's two moments, in bytes (f32): the part of the
    /// peak that does not depend on the batch.
    pub state_bytes: u64,
}

/// The serial number the next tensor gets: the tensors created between two readings.
fn tensor_serial() -> Result<usize> {
    let t = Tensor::zeros((), DType::U8, &Device::Cpu)?;
    let id = format!("{:?}", t.id());
    id.trim_start_matches("TensorId(")
        .trim_end_matches(')')
        .parse()
        .map_err(|_| Error::Input(format!("cannot read a tensor's serial from {id}")))
}

/// Counts one training step of every variant of `options` (after one step unmeasured, so that
/// AdamW's moments exist and every kernel is loaded).
pub fn count(options: &Options, progress: &mut dyn FnMut(&str)) -> Result<Vec<Launches>> {
    let shape = &options.shape;
    let head = HeadConfig::Classify {
        classes: shape.classes,
        pooling: Pooling::Mean,
    };
    let on_cpu = options.device.is_cpu();
    let mut out = Vec::new();
    for variant in &options.variants {
        progress(&format!("{variant}: one training step, counted"));
        // On the CPU the device path's twin: the CPU computing as CUDA does.
        let backend = match on_cpu {
            true => options.backend.as_on_cuda(),
            false => options.backend,
        };
        let compute = crate::nn::Compute {
            device: &options.device,
            backend,
        };
        let run = || -> Result<Launches> {
            let config = shape.model_config(variant, &options.limits, compute)?;
            let params = ParamStore::new(0);
            let mut model = TaskModel::new(
                &config,
                &head,
                params.var_builder(DType::F32, &options.device),
            )?
            .with_backend(backend);
            // As training packs it: one variable a layer.
            model.pack(&params)?;
            params.constrain(&model.encoder().constraints())?;
            params.exempt_from_decay(&model.undecayed());
            let mut optimizer = AdamW::from_store(
                &params,
                AdamWConfig {
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.01,
                },
            )?
            .with_backend(backend);
            let batch = batch(shape, &options.device)?;
            let mut step = || -> Result<()> {
                let loss = model.training_loss(&batch)?;
                let grads = loss.backward()?;
                optimizer.step(&grads, 1e-4, 1.0)?;
                sync(&params.vars()[0].1)
            };
            step()?;
            crate::heap::reset_peak();
            crate::device::reset_peak_memory(&options.device);
            let (ops, tensors) = (device_path::counts(), tensor_serial()?);
            step()?;
            let ops = device_path::counts() - ops;
            let tensors = tensor_serial()? - tensors - 1;
            let peak = match on_cpu {
                true => crate::heap::peak_bytes().map(|b| b as u64),
                false => crate::device::peak_memory_mib(&options.device)
                    .map(|m| (m * 1024.0 * 1024.0) as u64),
            };
            Ok(Launches {
                variant: variant.clone(),
                device: if on_cpu { "cpu twin" } else { "cuda" }.into(),
                launches_per_step: ops.launches() + tensors,
                kernels: ops.kernels,
                gemms: ops.gemms,
                copies: ops.copies,
                candle_tensors: tensors,
                peak_device_bytes: peak,
                state_bytes: 4 * 4 * params.num_params() as u64,
            })
        };
        let counted = crate::nn::with_threads(options.threads.max(1), run)?;
        progress(&line(&counted));
        out.push(counted);
    }
    Ok(out)
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// One variant's counts on a line.
pub fn line(l: &Launches) -> String {
    format!(
        "{}: {} launches a step on the {} ({} kernels, {} cuBLAS calls, {} copies on the device \
         path; at most {} of candle's), peak {} ({} of parameters, gradients and moments)",
        l.variant,
        l.launches_per_step,
        l.device,
        l.kernels,
        l.gemms,
        l.copies,
        l.candle_tensors,
        l.peak_device_bytes.map_or("unknown".into(), gib),
        gib(l.state_bytes),
    )
}

/// The counts as a table.
pub fn table(rows: &[Launches]) -> String {
    let mut t = crate::render::table::TextTable::new(
        [
            "variant",
            "launches/step",
            "kernels",
            "cuBLAS",
            "copies",
            "candle (at most)",
            "peak",
            "of which state",
        ],
        [false, true, true, true, true, true, true, true],
    );
    for l in rows {
        t.push([
            l.variant.clone(),
            l.launches_per_step.to_string(),
            l.kernels.to_string(),
            l.gemms.to_string(),
            l.copies.to_string(),
            l.candle_tensors.to_string(),
            l.peak_device_bytes.map_or("unknown".into(), gib),
            gib(l.state_bytes),
        ]);
    }
    t.text()
}
