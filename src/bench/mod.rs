//! `poslab bench`: forward and training-step throughput of every positional variant at a
//! reference shape, with FLOP counts, effective GFLOP/s and peak memory.
//!
//! The default shape and variants are those of `shared/bench/torch_reference.py`, so the two
//! can be run side by side: vocab 8192, width 256, 4 heads, 4 layers, FFN 1024, exact GELU,
//! pre-norm, dropout 0, mean pooling into 2 classes, batch 32 x 128 tokens without padding.

use std::time::Instant;

use candle::{DType, Device, Tensor};
use rand::Rng as _;
use serde::Serialize;

use crate::config::{Choices, ModelConfig, ModelShape, Precision};
use crate::data::Batch;
use crate::error::{Error, Result};
use crate::limits::Limits;
use crate::model::{HeadConfig, Pooling, TaskModel};
use crate::params::ParamStore;
use crate::positional::{Placement, PositionalConfig};
use crate::render::table::TextTable;
use crate::train::optim::{AdamW, AdamWConfig};

pub mod launches;
mod plan;
pub mod products;

pub use plan::{Outcome, Plan, Torch};

/// The model and batch measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Shape {
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width.
    pub d_model: usize,
    /// Attention heads per layer.
    pub n_heads: usize,
    /// Encoder layers.
    pub n_layers: usize,
    /// Feed-forward width.
    pub ffn_dim: usize,
    /// Sequences per batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The sinusoid's width in the concatenated variants.
    pub pos_dim: usize,
    /// Classes of the classification head.
    pub classes: usize,
    /// Activations in f32, bf16 or f16.
    pub dtype: Precision,
}

impl Default for Shape {
    fn default() -> Self {
        Self {
            vocab: 8192,
            d_model: 256,
            n_heads: 4,
            n_layers: 4,
            ffn_dim: 1024,
            batch: 32,
            seq: 128,
            pos_dim: 64,
            classes: 2,
            dtype: Precision::F32,
        }
    }
}

/// A variant's name with this after it is the same model with a causal mask in every layer
/// (`sin_add+causal`): measured beside the encoder, it shows what the mask saves.
pub const CAUSAL_SUFFIX: &str = "+causal";

/// The variants `shared/bench/torch_reference.py` runs, by its names.
pub const TORCH_VARIANTS: [&str; 5] = [
    "sin_add",
    "sin_concat",
    "sin_concat_proj",
    "learned",
    "rope",
];

impl Shape {
    /// `width 256, 4 heads, 4 layers, FFN 1024, batch 32 x 128`.
    pub fn describe(&self) -> String {
        format!(
            "width {}, {} heads, {} layers, FFN {}, batch {} x {}",
            self.d_model, self.n_heads, self.n_layers, self.ffn_dim, self.batch, self.seq
        )
    }

    /// The shape as the flags of `poslab bench` (benches/torch_at_shape.py takes the same).
    pub fn flags(&self) -> [(&'static str, usize); 7] {
        [
            ("--vocab", self.vocab),
            ("--d-model", self.d_model),
            ("--heads", self.n_heads),
            ("--layers", self.n_layers),
            ("--ffn", self.ffn_dim),
            ("--batch", self.batch),
            ("--seq", self.seq),
        ]
    }

    /// Every variant measured, named: each scheme of [`PositionalConfig::catalog`] with its
    /// default options, in the forms and under the names of the PyTorch reference where it has
    /// the scheme ([`Bench::benchmarked`]: its RoPE rotates halves, and RoPE on half of each
    /// head follows it). The control without positions comes last.
    ///
    /// [`Bench::benchmarked`]: crate::positional::Bench::benchmarked
    pub fn variants(&self) -> Vec<(String, PositionalConfig)> {
        let mut out: Vec<(String, PositionalConfig)> = Vec::new();
        let mut last = Vec::new();
        for positional in PositionalConfig::catalog(self.pos_dim) {
            let forms = match positional.scheme().benchmarked() {
                Some(forms) => forms,
                // A second form of a scheme is named by its label: `untied_sinusoidal`.
                None if out.iter().any(|(n, _)| n == positional.name()) => vec![(
                    positional
                        .scheme()
                        .label()
                        .replace(['(', ')', ','], "")
                        .replace(' ', "_"),
                    positional,
                )],
                None => vec![(positional.name().to_string(), positional)],
            };
            for (name, form) in forms {
                match form.placement() {
                    Placement::Nowhere => last.push((name, form)),
                    _ => out.push((name, form)),
                }
            }
        }
        out.extend(last);
        out
    }

    /// The names of [`Shape::variants`], in order.
    pub fn variant_names(&self) -> Vec<String> {
        self.variants().into_iter().map(|(n, _)| n).collect()
    }

    /// The positional choice of a variant named as in [`Shape::variants`] (with or without
    /// [`CAUSAL_SUFFIX`]).
    pub fn positional(&self, variant: &str) -> Result<PositionalConfig> {
        let variant = variant.strip_suffix(CAUSAL_SUFFIX).unwrap_or(variant);
        self.variants()
            .into_iter()
            .find(|(n, _)| n == variant)
            .map(|(_, p)| p)
            .ok_or_else(|| {
                Error::Config(format!(
                    "unknown bench variant `{variant}`: use {}, each with or without \
                     `{CAUSAL_SUFFIX}` (the same model with a causal mask)",
                    self.variant_names().join(", ")
                ))
            })
    }

    /// The model config of `variant` at this shape (a name of [`Shape::variant_names`]), its
    /// size and batch checked against `limits`; an unknown name is an error listing the known
    /// ones.
    pub fn model_config(
        &self,
        variant: &str,
        limits: &Limits,
        compute: crate::nn::Compute<'_>,
    ) -> Result<ModelConfig> {
        let positional = self.positional(variant)?;
        let shape = ModelShape {
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            ffn_dim: self.ffn_dim,
            dropout: 0.0,
            attention_dropout: 0.0,
            dtype: self.dtype,
            ..ModelShape::default()
        };
        let choices = Choices {
            causal: Some(variant.ends_with(CAUSAL_SUFFIX)),
            ..Choices::of(&positional)
        };
        let config = shape.model_config(&choices, self.vocab, self.seq);
        for (flag, n, what) in [
            ("--batch", self.batch, "sequences per batch"),
            ("--seq", self.seq, "tokens per sequence"),
        ] {
            if n == 0 {
                return Err(Error::Config(format!(
                    "{flag} 0: give at least 1 of the {what}"
                )));
            }
        }
        config.validate()?;
        config.check_limits(limits)?;
        limits
            .check_batch(
                &config.sizes_on(compute),
                self.batch,
                self.seq,
                true,
                "bench",
            )
            .map_err(Error::Config)?;
        Ok(config)
    }

    /// Forward and training FLOPs of `model` at this shape, as the PyTorch reference counts
    /// them: 2 per multiply-add of every matrix multiply (projections, FFN, the head, and the
    /// scheme's own: [`Bench::forward_flops`], such as the concat projection) plus `4 L T^2 d B`
    /// for the two attention products. A training step is counted as three forwards.
    ///
    /// [`Bench::forward_flops`]: crate::positional::Bench::forward_flops
    pub fn flops(&self, model: &ModelConfig) -> (f64, f64) {
        let (d, f, l) = (
            self.d_model as f64,
            self.ffn_dim as f64,
            self.n_layers as f64,
        );
        let (b, t) = (self.batch as f64, self.seq as f64);
        let per_token = l * (4.0 * d * d + 2.0 * d * f);
        let forward = 2.0 * per_token * b * t
            + 2.0 * d * self.classes as f64 * b
            + 4.0 * l * t * t * d * b
            + model
                .positional
                .scheme()
                .forward_flops(&model.scheme_shape(), self.batch, self.seq);
        (forward, 3.0 * forward)
    }
}

/// Timings of repeated steps.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct Timing {
    /// How many steps were timed.
    pub reps: usize,
    /// The median step, ms.
    pub median_ms: f64,
    /// The fastest step, ms.
    pub min_ms: f64,
    /// The slowest step, ms.
    pub max_ms: f64,
    /// Tokens per second at the median.
    pub tokens_per_s: f64,
    /// FLOPs per second at the median, in billions.
    pub gflops: f64,
}

impl Timing {
    fn of(mut ms: Vec<f64>, tokens: f64, flops: f64) -> Self {
        ms.sort_by(f64::total_cmp);
        let n = ms.len();
        let median = if n % 2 == 1 {
            ms[n / 2]
        } else {
            (ms[n / 2 - 1] + ms[n / 2]) / 2.0
        };
        Self {
            reps: n,
            median_ms: median,
            min_ms: ms[0],
            max_ms: ms[n - 1],
            tokens_per_s: tokens / (median / 1e3),
            gflops: flops / (median / 1e3) / 1e9,
        }
    }
}

/// One variant's figures.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct Record {
    /// The variant's name.
    pub variant: String,
    /// Trainable parameters.
    pub params: usize,
    /// Floating-point operations of one forward pass, in billions.
    pub forward_gflop: f64,
    /// Floating-point operations of one training step (3 × the forward), in billions.
    pub train_gflop: f64,
    /// Forward timings, if the forward phase ran.
    pub forward: Option<Timing>,
    /// Training-step timings, if the training phase ran.
    pub train: Option<Timing>,
    /// Medians of a training step's parts: forward with the loss, backward, optimizer.
    pub train_parts_ms: Option<[f64; 3]>,
    /// Peak resident memory of the process during the phase, in MiB (Linux).
    pub forward_peak_rss_mib: Option<f64>,
    /// Peak resident memory during training, in MiB (Linux).
    pub train_peak_rss_mib: Option<f64>,
    /// Peak GPU memory held by tensors during the phase, in MiB (CUDA; see
    /// [`crate::device::peak_memory_mib`]).
    #[serde(default)]
    pub forward_peak_gpu_mib: Option<f64>,
    /// Peak GPU memory held by tensors during training, in MiB (CUDA).
    #[serde(default)]
    pub train_peak_gpu_mib: Option<f64>,
    /// Cores' worth of CPU other processes used during the timed part of each phase (Linux):
    /// on a shared machine, runs where this is large are not to be trusted.
    #[serde(default)]
    pub forward_foreign_cores: Option<f64>,
    /// Cores' worth of CPU other processes used during the timed training steps (Linux).
    #[serde(default)]
    pub train_foreign_cores: Option<f64>,
    /// The kernels the layers ran with (`layer`, `ops` or `reference`).
    #[serde(default)]
    pub kernels: String,
    /// The f32 matrix-multiply peak measured right after the training phase, on the same
    /// threads, in GFLOP/s (CPU; see [`matmul_peak`]).
    #[serde(default)]
    pub matmul_peak_gflops: Option<f64>,
}

impl Record {
    /// Training tokens/s at the median step (0 when the phase did not run).
    pub fn train_rate(&self) -> f64 {
        self.train.as_ref().map_or(0.0, |t| t.tokens_per_s)
    }

    /// Forward tokens/s at the median pass (0 when the phase did not run).
    pub fn forward_rate(&self) -> f64 {
        self.forward.as_ref().map_or(0.0, |t| t.tokens_per_s)
    }

    /// The figures on a line, logged as soon as they are in: a bench cut short still says what
    /// it measured.
    pub fn line(&self) -> String {
        let rate = |t: &Option<Timing>| match t {
            Some(t) => format!("{:.0} tok/s", t.tokens_per_s),
            None => "not measured".into(),
        };
        let mut line = format!(
            "{}: training {}, forward {}",
            self.variant,
            rate(&self.train),
            rate(&self.forward)
        );
        if let Some(mib) = self.train_peak_gpu_mib {
            line += &format!(", training peak GPU {mib:.0} MiB");
        }
        line
    }
}

/// The matrix-multiply peak of this machine at these threads, in GFLOP/s: the best of a
/// 1024³ product and the step's largest (tokens × FFN × width), through the gemm call the
/// layers make, best of a few repetitions. A training step's share of it is the headline of
/// `bench` at small shapes, where the step is far from the matmul library's speed.
pub fn matmul_peak(shape: &Shape) -> f64 {
    let tokens = shape.batch * shape.seq;
    let square = crate::nn::matmul_gflops(1024, 1024, 1024, 5);
    let step = crate::nn::matmul_gflops(tokens, shape.ffn_dim, shape.d_model, 5);
    square.max(step)
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// The model and batch.
    pub shape: Shape,
    /// The variants to measure, by name.
    pub variants: Vec<String>,
    /// Untimed steps before each timed phase.
    pub warmup: usize,
    /// Timed forward passes per variant.
    pub forward_reps: usize,
    /// Timed training steps per variant.
    pub train_reps: usize,
    /// Where to run.
    pub device: Device,
    /// The kernels and instruction sets the models compute with.
    pub backend: crate::nn::Backend,
    /// How large the models and their batches may be.
    pub limits: Limits,
    /// Threads: each phase runs on a rayon pool of its own this wide.
    pub threads: usize,
}

impl Options {
    /// Where the bench's models compute: its device and backend.
    pub fn compute(&self) -> crate::nn::Compute<'_> {
        crate::nn::Compute {
            device: &self.device,
            backend: self.backend,
        }
    }
}

/// `VmRSS` or `VmHWM` of this process in MiB.
fn proc_status_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// Busy CPU time of the whole machine and of this process, in clock ticks (Linux).
#[derive(Clone, Copy, Debug)]
struct CpuSnap {
    at: Instant,
    machine: u64,
    process: u64,
}

fn cpu_snap() -> Option<CpuSnap> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let v: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    if v.len() < 8 {
        return None;
    }
    // user nice system idle iowait irq softirq steal: busy is all but idle and iowait.
    let machine = v.iter().sum::<u64>() - v[3] - v[4];
    let own = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest: Vec<&str> = own[own.rfind(')')? + 2..].split_whitespace().collect();
    let process = rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?;
    Some(CpuSnap {
        at: Instant::now(),
        machine,
        process,
    })
}

/// Average cores used by other processes between two snapshots.
fn foreign_cores(a: Option<CpuSnap>, b: Option<CpuSnap>) -> Option<f64> {
    let (a, b) = (a?, b?);
    #[cfg(unix)]
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    #[cfg(not(unix))]
    let ticks = 100.0;
    let seconds = (b.at - a.at).as_secs_f64();
    if seconds <= 0.0 || ticks <= 0.0 {
        return None;
    }
    let other = (b.machine - a.machine).saturating_sub(b.process - a.process) as f64;
    Some(other / ticks / seconds)
}

/// Resets the peak-RSS mark to the current RSS (Linux 4.0+); false where that is not possible.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn batch(shape: &Shape, device: &Device) -> Result<Batch> {
    let mut rng = crate::rng::stream(0, "bench/batch");
    let n = shape.batch * shape.seq;
    let ids: Vec<u32> = (0..n)
        .map(|_| rng.random_range(0..shape.vocab as u32))
        .collect();
    let labels: Vec<u32> = (0..shape.batch)
        .map(|_| rng.random_range(0..shape.classes as u32))
        .collect();
    let max_id = ids.iter().copied().max().unwrap_or(0);
    Ok(Batch {
        lengths: vec![shape.seq; shape.batch],
        positions: None,
        max_id,
        ids: Tensor::from_vec(ids, (shape.batch, shape.seq), device)?,
        mask: Tensor::ones((shape.batch, shape.seq), DType::U32, device)?,
        targets: Tensor::from_vec(labels, shape.batch, device)?,
        weights: None,
        counted: None,
        real_tokens: n,
        scored: shape.batch,
    })
}

fn sync(t: &Tensor) -> Result<()> {
    // Reading a value waits for queued device work (CUDA), so timings cover the computation.
    t.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?;
    Ok(())
}

/// Measures every variant of `options`, calling `progress` before each phase.
pub fn run(options: &Options, progress: &mut dyn FnMut(&str)) -> Result<Vec<Record>> {
    let shape = &options.shape;
    let head = HeadConfig::Classify {
        classes: shape.classes,
        pooling: Pooling::Mean,
    };
    let mut records = Vec::new();
    // Each phase runs on a pool of its own, as compare's jobs do (see nn::with_threads), with
    // the models' backend in force for everything measured, backward and optimizer included.
    let threads = options.threads.max(1);
    let measured = |f: &(dyn Fn() -> Result<Phase> + Sync)| crate::nn::with_threads(threads, f);
    for variant in &options.variants {
        let config = shape.model_config(variant, &options.limits, options.compute())?;
        let (forward_flops, train_flops) = shape.flops(&config);
        let params = ParamStore::new(0);
        let mut model = TaskModel::new(
            &config,
            &head,
            params.var_builder(DType::F32, &options.device),
        )?
        .with_backend(options.backend);
        // As training packs it: one variable a layer.
        model.pack(&params)?;
        let batch = batch(shape, &options.device)?;

        // Forward without gradients: the same weights as plain tensors, so no graph is kept.
        progress(&format!("{variant}: forward"));
        let frozen = TaskModel::new(
            &config,
            &head,
            params.frozen_var_builder(DType::F32, &options.device),
        )?
        .with_backend(options.backend);
        let forward = measured(&|| time_forward(options, &frozen, &batch, forward_flops))?;
        drop(frozen);

        progress(&format!("{variant}: training step"));
        let train = measured(&|| time_training(options, &model, &params, &batch, train_flops))?;
        let matmul_peak_gflops = (options.device.is_cpu() && options.train_reps > 0)
            .then(|| crate::nn::with_threads(threads, || matmul_peak(shape)));
        records.push(Record {
            variant: variant.clone(),
            params: params.num_params(),
            forward_gflop: forward_flops / 1e9,
            train_gflop: train_flops / 1e9,
            forward: forward.timing,
            forward_peak_rss_mib: forward.peak_rss_mib,
            train_peak_rss_mib: train.peak_rss_mib,
            forward_peak_gpu_mib: forward.peak_gpu_mib,
            train_peak_gpu_mib: train.peak_gpu_mib,
            train: train.timing,
            train_parts_ms: train.parts_ms,
            forward_foreign_cores: forward.foreign_cores,
            train_foreign_cores: train.foreign_cores,
            kernels: (options.backend)
                .kernels_on(&options.device, shape.dtype.compute_dtype(DType::F32))
                .name()
                .to_string(),
            matmul_peak_gflops,
        });
        progress(&records[records.len() - 1].line());
    }
    Ok(records)
}

/// What one phase (forward or training step) measured; all `None` when it ran no repetitions.
#[derive(Default)]
struct Phase {
    timing: Option<Timing>,
    peak_rss_mib: Option<f64>,
    peak_gpu_mib: Option<f64>,
    foreign_cores: Option<f64>,
    parts_ms: Option<[f64; 3]>,
}

impl Phase {
    /// Repetitions of `rep` after `warmup` unmeasured ones (`rep` is told whether it is
    /// measured), with the peak memory and the other processes' use of the cores over the
    /// measured ones.
    fn measure(
        options: &Options,
        reps: usize,
        mut rep: impl FnMut(bool) -> Result<f64>,
    ) -> Result<(Vec<f64>, Self)> {
        if reps == 0 {
            return Ok((Vec::new(), Self::default()));
        }
        reset_peak_rss();
        crate::device::reset_peak_memory(&options.device);
        let mut cpu = None;
        let mut ms = Vec::new();
        for i in 0..options.warmup + reps {
            if i == options.warmup {
                cpu = cpu_snap();
            }
            let measured = i >= options.warmup;
            let t = rep(measured)?;
            if measured {
                ms.push(t);
            }
        }
        let phase = Self {
            foreign_cores: foreign_cores(cpu, cpu_snap()),
            peak_rss_mib: proc_status_mib("VmHWM"),
            peak_gpu_mib: crate::device::peak_memory_mib(&options.device),
            ..Self::default()
        };
        Ok((ms, phase))
    }
}

/// Forward passes of `model` (no gradients) on `batch`.
fn time_forward(options: &Options, model: &TaskModel, batch: &Batch, flops: f64) -> Result<Phase> {
    let tokens = (options.shape.batch * options.shape.seq) as f64;
    let positions = batch.positions(0)?;
    let (ms, mut phase) = Phase::measure(options, options.forward_reps, |_| {
        let started = Instant::now();
        let logits = model.logits(&batch.ids, &batch.mask, &positions, false)?;
        sync(&logits)?;
        Ok(started.elapsed().as_secs_f64() * 1e3)
    })?;
    if !ms.is_empty() {
        phase.timing = Some(Timing::of(ms, tokens, flops));
    }
    Ok(phase)
}

/// Training steps of `model` on `batch`: forward with the loss, backward, AdamW; each part
/// timed.
fn time_training(
    options: &Options,
    model: &TaskModel,
    params: &ParamStore,
    batch: &Batch,
    flops: f64,
) -> Result<Phase> {
    if options.train_reps == 0 {
        return Ok(Phase::default());
    }
    let tokens = (options.shape.batch * options.shape.seq) as f64;
    params.constrain(&model.encoder().constraints())?;
    params.exempt_from_decay(&model.undecayed());
    let mut optimizer = AdamW::from_store(
        params,
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
    )?
    .with_backend(model.encoder().backend());
    let mut parts = [Vec::new(), Vec::new(), Vec::new()];
    let (ms, mut phase) = Phase::measure(options, options.train_reps, |measured| {
        let started = Instant::now();
        let loss = model.training_loss(batch)?;
        sync(&loss)?;
        let forward_done = Instant::now();
        let grads = loss.backward()?;
        if !options.device.is_cpu() {
            // Wait for the queued backward kernels, so the parts split where they ran.
            if let Some(g) = params
                .vars()
                .iter()
                .find_map(|(_, v)| grads.get(v.as_tensor()))
            {
                sync(g)?;
            }
        }
        let backward_done = Instant::now();
        optimizer.step(&grads, 1e-4, 1.0)?;
        sync(&params.vars()[0].1)?;
        let done = Instant::now();
        if measured {
            parts[0].push((forward_done - started).as_secs_f64() * 1e3);
            parts[1].push((backward_done - forward_done).as_secs_f64() * 1e3);
            parts[2].push((done - backward_done).as_secs_f64() * 1e3);
        }
        Ok((done - started).as_secs_f64() * 1e3)
    })?;
    phase.parts_ms = Some(parts.map(|p| Timing::of(p, tokens, 0.0).median_ms));
    phase.timing = Some(Timing::of(ms, tokens, flops));
    Ok(phase)
}

/// Milliseconds with the digits that matter at their size (a GPU step can take 3 ms).
fn ms(v: f64) -> String {
    if v < 10.0 {
        format!("{v:.2}")
    } else if v < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

/// The printed table.
pub fn table(records: &[Record]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let gpu = records
        .iter()
        .any(|r| r.forward_peak_gpu_mib.is_some() || r.train_peak_gpu_mib.is_some());
    let memory = if gpu { "peak GPU" } else { "peak RSS" };
    let memory_of = |r: &Record| {
        if gpu {
            [r.forward_peak_gpu_mib, r.train_peak_gpu_mib]
        } else {
            [r.forward_peak_rss_mib, r.train_peak_rss_mib]
        }
    };
    let mut main = TextTable::new(
        [
            "variant",
            "params",
            "forward tok/s (ms)",
            "train tok/s (ms)",
            memory,
            memory,
        ],
        [false, true, true, true, true, true],
    )
    .with_units([
        "",
        "",
        "median, min..max ms",
        "median, min..max ms",
        "forward",
        "train",
    ]);
    let cell = |t: &Option<Timing>| match t {
        Some(t) => format!(
            "{:.0} ({}, {}..{})",
            t.tokens_per_s,
            ms(t.median_ms),
            ms(t.min_ms),
            ms(t.max_ms)
        ),
        None => "-".into(),
    };
    let mib = |m: Option<f64>| m.map_or("-".into(), |m| format!("{m:.0} MiB"));
    for r in records {
        let [forward, train] = memory_of(r);
        main.push([
            r.variant.clone(),
            r.params.to_string(),
            cell(&r.forward),
            cell(&r.train),
            mib(forward),
            mib(train),
        ]);
    }
    out.push_str(&main.text());
    let busy: Vec<String> = records
        .iter()
        .filter_map(|r| {
            let worst = r
                .forward_foreign_cores
                .into_iter()
                .chain(r.train_foreign_cores)
                .fold(0.0f64, f64::max);
            (worst > 0.2).then(|| format!("{} ({worst:.2} cores)", r.variant))
        })
        .collect();
    if !busy.is_empty() {
        let _ = writeln!(
            out,
            "\nwarning: other processes were busy during {}; those figures are not reliable",
            busy.join(", ")
        );
    }
    let _ = writeln!(
        out,
        "\ntraining step, median of each part: forward with the loss / backward / optimizer"
    );
    let mut parts = TextTable::new(["variant", "parts"], [false, false]);
    for r in records {
        if let Some([f, b, o]) = r.train_parts_ms {
            parts.push([
                r.variant.clone(),
                format!("{} / {} / {} ms", ms(f), ms(b), ms(o)),
            ]);
        }
    }
    out.push_str(&parts.list(2));
    let _ = writeln!(
        out,
        "\nFLOPs per step (forward / training = 3 x forward) and effective rates at the median:"
    );
    let rate = |t: &Option<Timing>| {
        t.as_ref()
            .map_or("-".into(), |t| format!("{:.1} GFLOP/s", t.gflops))
    };
    let mut flops = TextTable::new(["variant", "GFLOP", "rates"], [false, true, false]);
    for r in records {
        flops.push([
            r.variant.clone(),
            format!("{:.2} / {:.2} GFLOP", r.forward_gflop, r.train_gflop),
            format!("forward {}, training {}", rate(&r.forward), rate(&r.train)),
        ]);
    }
    out.push_str(&flops.list(2));
    out.push_str(&share_table(records, ""));
    out
}

/// Each variant's training rate as a share of the matmul peak measured beside it, from the
/// round where it trained fastest (the least disturbed), or nothing when no peak was measured.
pub fn best_round_shares<'a>(
    variants: &[String],
    rounds: impl Iterator<Item = &'a Record>,
) -> String {
    let rounds: Vec<&Record> = rounds.collect();
    let best: Vec<Record> = variants
        .iter()
        .filter_map(|v| {
            rounds
                .iter()
                .filter(|r| &r.variant == v && r.train.is_some())
                .min_by(|a, b| {
                    let ms = |r: &Record| r.train.as_ref().map_or(f64::NAN, |t| t.median_ms);
                    ms(a).total_cmp(&ms(b))
                })
                .map(|r| (*r).clone())
        })
        .collect();
    share_table(&best, ", in each variant's fastest round")
}

/// The share table of [`table`] and [`best_round_shares`].
fn share_table(records: &[Record], which: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let shares: Vec<_> = records
        .iter()
        .filter_map(|r| Some((r, r.train.as_ref()?, r.matmul_peak_gflops?)))
        .collect();
    if !shares.is_empty() {
        let _ = writeln!(
            out,
            "\ntraining rate as a share of the f32 matmul peak measured right after it{which} \
             (gemm, same threads; best of 1024^3 and tokens x FFN x width):"
        );
        let mut table = TextTable::new(["variant", "peak", "share"], [false, true, true]);
        for (r, t, peak) in shares {
            table.push([
                r.variant.clone(),
                format!("{peak:.1} GFLOP/s"),
                format!("{:.0}%", 100.0 * t.gflops / peak),
            ]);
        }
        out.push_str(&table.list(2));
    }
    out
}

/// One run of the PyTorch reference (`shared/bench/torch_reference.py`), the fields poslab
/// compares.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct TorchRecord {
    /// The variant's name, as the reference names it.
    pub variant: String,
    /// Median forward tokens per second.
    pub forward_tokens_per_s: f64,
    /// Median training tokens per second.
    pub train_tokens_per_s: f64,
    /// Medians of a training step's parts, ms: forward with the loss, backward, optimizer.
    pub train_parts_ms: Option<[f64; 3]>,
    /// Peak resident memory of the training phase, MiB.
    pub train_peak_rss_mib: Option<f64>,
    /// `torch.cuda.max_memory_allocated` of the training phase, MiB (benches/torch_at_shape.py
    /// on a GPU).
    #[serde(default)]
    pub train_peak_gpu_mib: Option<f64>,
    /// Cores' worth of CPU other processes used during the forward phase.
    pub forward_foreign_cores: Option<f64>,
    /// Cores' worth of CPU other processes used during the training phase.
    pub train_foreign_cores: Option<f64>,
}

/// The JSON line the PyTorch script prints (the keys of `shared/bench/torch_reference.py`).
#[derive(serde::Deserialize)]
struct TorchLine {
    variant: String,
    fwd_tokens_per_s_median: f64,
    train_tokens_per_s_median: f64,
    train_part_medians_ms: Option<TorchParts>,
    peak_rss_train_phase_mib: Option<f64>,
    peak_gpu_train_phase_mib: Option<f64>,
    fwd_foreign_cores: Option<f64>,
    train_foreign_cores: Option<f64>,
}

/// A training step's parts as the PyTorch script names them, ms.
#[derive(serde::Deserialize)]
struct TorchParts {
    fwd: f64,
    bwd: f64,
    opt: f64,
}

impl TorchRecord {
    /// From the JSON line the reference script prints.
    pub fn from_json(line: &str) -> Result<Self> {
        let line: TorchLine = serde_json::from_str(line).map_err(|e| {
            Error::Input(format!(
                "the PyTorch reference printed an unexpected line: {e}"
            ))
        })?;
        Ok(Self {
            variant: line.variant,
            forward_tokens_per_s: line.fwd_tokens_per_s_median,
            train_tokens_per_s: line.train_tokens_per_s_median,
            train_parts_ms: line.train_part_medians_ms.map(|p| [p.fwd, p.bwd, p.opt]),
            train_peak_rss_mib: line.peak_rss_train_phase_mib,
            train_peak_gpu_mib: line.peak_gpu_train_phase_mib,
            forward_foreign_cores: line.fwd_foreign_cores,
            train_foreign_cores: line.train_foreign_cores,
        })
    }
}

/// poslab against PyTorch for one variant over interleaved rounds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Ratio {
    /// The variant's name.
    pub variant: String,
    /// Interleaved rounds measured (poslab, then PyTorch, in each).
    pub rounds: usize,
    /// Medians over the rounds of each round's median tokens/s.
    pub poslab_forward: f64,
    /// PyTorch's forward tokens/s, as `poslab_forward`.
    pub torch_forward: f64,
    /// poslab's training tokens/s: the median over the rounds of each round's median.
    pub poslab_train: f64,
    /// PyTorch's training tokens/s, as `poslab_train`.
    pub torch_train: f64,
    /// poslab / PyTorch throughput: of the medians, and the lowest and highest of a round.
    pub forward_ratio: f64,
    /// The lowest and highest forward ratio of a round.
    pub forward_ratio_range: [f64; 2],
    /// poslab / PyTorch training throughput, of the medians.
    pub train_ratio: f64,
    /// The lowest and highest training ratio of a round.
    pub train_ratio_range: [f64; 2],
    /// The best round of each side (highest tokens/s), poslab and PyTorch: on a shared host,
    /// contention only ever slows a run, so the best round is each side's least disturbed one.
    pub best_forward: [f64; 2],
    /// The best round's training tokens/s of each side, poslab and PyTorch.
    pub best_train: [f64; 2],
    /// The slowest round of each side over its best, poslab and PyTorch (1 = steady rounds).
    pub train_spread: [f64; 2],
    /// poslab's medians of a training step's parts, ms: forward with the loss, backward, optimizer.
    pub poslab_train_parts_ms: Option<[f64; 3]>,
    /// PyTorch's medians of the same parts, ms.
    pub torch_train_parts_ms: Option<[f64; 3]>,
    /// Largest peak RSS of a training phase over the rounds, MiB.
    pub poslab_train_peak_rss_mib: Option<f64>,
    /// PyTorch's largest peak RSS of a training phase over the rounds, MiB.
    pub torch_train_peak_rss_mib: Option<f64>,
    /// Largest peak GPU memory of a training phase over the rounds, MiB (on a GPU).
    pub poslab_train_peak_gpu_mib: Option<f64>,
    /// PyTorch's largest peak GPU memory of a training phase over the rounds, MiB.
    pub torch_train_peak_gpu_mib: Option<f64>,
    /// The most other processes used during any timed phase of the variant, in cores.
    pub worst_foreign_cores: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The ratios of interleaved rounds: `rounds[i]` holds each variant's poslab record and
/// PyTorch record of round `i`.
pub fn ratios(variants: &[String], rounds: &[Vec<(Record, TorchRecord)>]) -> Vec<Ratio> {
    variants
        .iter()
        .map(|variant| {
            let pairs: Vec<&(Record, TorchRecord)> = rounds
                .iter()
                .flat_map(|r| r.iter().filter(|(p, _)| &p.variant == variant))
                .collect();
            let of = |f: &dyn Fn(&(Record, TorchRecord)) -> Option<f64>| -> Vec<f64> {
                pairs.iter().filter_map(|p| f(p)).collect()
            };
            let pf = of(&|(p, _)| p.forward.as_ref().map(|t| t.tokens_per_s));
            let pt = of(&|(p, _)| p.train.as_ref().map(|t| t.tokens_per_s));
            let tf = of(&|(_, t)| Some(t.forward_tokens_per_s));
            let tt = of(&|(_, t)| Some(t.train_tokens_per_s));
            let per_round = |a: &[f64], b: &[f64]| -> [f64; 2] {
                let r: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
                [
                    r.iter().copied().fold(f64::INFINITY, f64::min),
                    r.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                ]
            };
            let parts = |v: Vec<[f64; 3]>| -> Option<[f64; 3]> {
                (!v.is_empty()).then(|| [0, 1, 2].map(|i| median(v.iter().map(|p| p[i]).collect())))
            };
            let max = |v: Vec<f64>| v.into_iter().reduce(f64::max);
            let best = |v: &[f64]| v.iter().copied().fold(f64::NAN, f64::max);
            let spread = |v: &[f64]| best(v) / v.iter().copied().fold(f64::NAN, f64::min);
            let foreign = of(&|(p, t)| {
                [
                    p.forward_foreign_cores,
                    p.train_foreign_cores,
                    t.forward_foreign_cores,
                    t.train_foreign_cores,
                ]
                .into_iter()
                .flatten()
                .reduce(f64::max)
            });
            let (pfm, ptm, tfm, ttm) = (
                median(pf.clone()),
                median(pt.clone()),
                median(tf.clone()),
                median(tt.clone()),
            );
            Ratio {
                variant: variant.clone(),
                rounds: pairs.len(),
                poslab_forward: pfm,
                torch_forward: tfm,
                poslab_train: ptm,
                torch_train: ttm,
                forward_ratio: pfm / tfm,
                forward_ratio_range: per_round(&pf, &tf),
                train_ratio: ptm / ttm,
                train_ratio_range: per_round(&pt, &tt),
                best_forward: [best(&pf), best(&tf)],
                best_train: [best(&pt), best(&tt)],
                train_spread: [spread(&pt), spread(&tt)],
                poslab_train_parts_ms: parts(of_parts(&pairs, true)),
                torch_train_parts_ms: parts(of_parts(&pairs, false)),
                poslab_train_peak_rss_mib: max(of(&|(p, _)| p.train_peak_rss_mib)),
                torch_train_peak_rss_mib: max(of(&|(_, t)| t.train_peak_rss_mib)),
                poslab_train_peak_gpu_mib: max(of(&|(p, _)| p.train_peak_gpu_mib)),
                torch_train_peak_gpu_mib: max(of(&|(_, t)| t.train_peak_gpu_mib)),
                worst_foreign_cores: foreign.into_iter().fold(0.0, f64::max),
            }
        })
        .collect()
}

fn of_parts(pairs: &[&(Record, TorchRecord)], poslab: bool) -> Vec<[f64; 3]> {
    pairs
        .iter()
        .filter_map(|(p, t)| {
            if poslab {
                p.train_parts_ms
            } else {
                t.train_parts_ms
            }
        })
        .collect()
}

/// What a variant costs over the first one, from interleaved rounds of child processes.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct Cost {
    /// The variant's name.
    pub variant: String,
    /// Interleaved rounds measured.
    pub rounds: usize,
    /// Best round (least disturbed: contention only slows) of the step medians, ms.
    pub best_train_ms: f64,
    /// Best round of the forward medians, ms.
    pub best_forward_ms: f64,
    /// `best / best of the first variant - 1`.
    pub train_cost: f64,
    /// `best_forward_ms / best of the first variant - 1`.
    pub forward_cost: f64,
    /// The same paired within each round (`variant / first - 1`): median, lowest..highest.
    pub train_cost_paired: [f64; 3],
}

/// Costs over `variants[0]` from `rounds[i]`, every variant's record of round `i`.
pub fn costs(variants: &[String], rounds: &[Vec<Record>]) -> Vec<Cost> {
    let ms = |r: &Record, train: bool| {
        let t = if train { &r.train } else { &r.forward };
        t.as_ref().map_or(f64::NAN, |t| t.median_ms)
    };
    let of = |variant: &str| -> Vec<&Record> {
        rounds
            .iter()
            .filter_map(|round| round.iter().find(|r| r.variant == variant))
            .collect()
    };
    let best = |v: &[&Record], train: bool| v.iter().map(|r| ms(r, train)).fold(f64::NAN, f64::min);
    let base = variants.first().map(|v| of(v)).unwrap_or_default();
    let (base_train, base_forward) = (best(&base, true), best(&base, false));
    variants
        .iter()
        .map(|variant| {
            let recs = of(variant);
            let (train, forward) = (best(&recs, true), best(&recs, false));
            let mut paired: Vec<f64> = recs
                .iter()
                .zip(&base)
                .map(|(r, b)| ms(r, true) / ms(b, true) - 1.0)
                .collect();
            paired.sort_by(f64::total_cmp);
            Cost {
                variant: variant.clone(),
                rounds: recs.len(),
                best_train_ms: train,
                best_forward_ms: forward,
                train_cost: train / base_train - 1.0,
                forward_cost: forward / base_forward - 1.0,
                train_cost_paired: [
                    median(paired.clone()),
                    paired.first().copied().unwrap_or(f64::NAN),
                    paired.last().copied().unwrap_or(f64::NAN),
                ],
            }
        })
        .collect()
}

/// The table of [`costs`].
pub fn cost_table(costs: &[Cost]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let (rounds, base) = costs
        .first()
        .map_or((0, ""), |c| (c.rounds, c.variant.as_str()));
    let _ = writeln!(
        out,
        "cost over {base}, {rounds} interleaved round{} (best round of each; paired: this / {base} in the same round, median lowest..highest)",
        if rounds == 1 { "" } else { "s" }
    );
    let mut table = TextTable::new(
        [
            "variant",
            "train ms/step",
            "cost",
            "forward ms/step",
            "cost",
            "train cost paired",
        ],
        [false, true, true, true, true, true],
    );
    let pct = |v: f64| format!("{:+.1}%", 100.0 * v);
    for c in costs {
        let [m, lo, hi] = c.train_cost_paired;
        table.push([
            c.variant.clone(),
            format!("{:.0}", c.best_train_ms),
            pct(c.train_cost),
            format!("{:.0}", c.best_forward_ms),
            pct(c.forward_cost),
            format!("{} ({}..{})", pct(m), pct(lo), pct(hi)),
        ]);
    }
    out.push_str(&table.text());
    out
}

/// The side-by-side report of [`ratios`]: the throughput table, then each framework's step
/// parts, best rounds and positional overheads, then what made the figures unsteady.
pub fn ratio_table(ratios: &[Ratio]) -> String {
    let rounds = ratios.first().map_or(0, |r| r.rounds);
    let mut out = format!(
        "poslab vs PyTorch, {rounds} interleaved round{} (medians of the rounds' medians; ratio = \
         poslab / PyTorch, lowest..highest round)\n",
        if rounds == 1 { "" } else { "s" }
    );
    out.push_str(&ratio_main(ratios).text());
    out.push_str("\ntraining step parts, ms (forward / backward / optimizer), poslab | torch\n");
    let parts = |p: Option<[f64; 3]>| {
        p.map_or("-".into(), |[a, b, c]| {
            format!("{} / {} / {}", ms(a), ms(b), ms(c))
        })
    };
    out.push_str(&ratio_list(ratios, |r| {
        vec![
            parts(r.poslab_train_parts_ms),
            "|".into(),
            parts(r.torch_train_parts_ms),
        ]
    }));
    out.push_str(
        "\nbest round of each side (the least contended: a shared host only ever slows a run)\n",
    );
    out.push_str(&ratio_list(ratios, |r| {
        let [f, t] = [r.best_forward, r.best_train];
        vec![
            format!("forward {:.0} | {:.0}", f[0], f[1]),
            format!("{:.2}x", f[0] / f[1]),
            format!("train {:.0} | {:.0}", t[0], t[1]),
            format!("{:.2}x", t[0] / t[1]),
        ]
    }));
    if let Some(base) = ratios.iter().find(|r| r.variant == "sin_add") {
        out.push_str(
            "\ntraining cost over sin_add (time per step), poslab | torch: medians; best rounds\n",
        );
        let others: Vec<&Ratio> = ratios.iter().filter(|r| r.variant != "sin_add").collect();
        let pct = |a: f64, b: f64| format!("{:+.1}%", (a / b - 1.0) * 100.0);
        out.push_str(&ratio_list(others, |r| {
            vec![
                format!(
                    "{} | {};",
                    pct(base.poslab_train, r.poslab_train),
                    pct(base.torch_train, r.torch_train)
                ),
                format!(
                    "{} | {}",
                    pct(base.best_train[0], r.best_train[0]),
                    pct(base.best_train[1], r.best_train[1])
                ),
            ]
        }));
    }
    out.push_str(&ratio_warnings(ratios));
    out
}

/// Throughput of both sides with their ratio, and peak memory, per variant.
fn ratio_main(ratios: &[Ratio]) -> TextTable {
    let gpu = ratios.iter().any(|r| r.poslab_train_peak_gpu_mib.is_some());
    let memory = if gpu {
        "train peak GPU MiB"
    } else {
        "train peak RSS MiB"
    };
    let mut table = TextTable::new(
        [
            "variant",
            "forward tok/s poslab | torch",
            "train tok/s poslab | torch",
            memory,
        ],
        [false, true, true, true],
    );
    let side = |p: f64, t: f64, ratio: f64, [lo, hi]: [f64; 2]| {
        format!("{p:.0} | {t:.0}  {ratio:.2}x ({lo:.2}..{hi:.2})")
    };
    for r in ratios {
        let memory = if gpu {
            (r.poslab_train_peak_gpu_mib, r.torch_train_peak_gpu_mib)
        } else {
            (r.poslab_train_peak_rss_mib, r.torch_train_peak_rss_mib)
        };
        let rss = match memory {
            (Some(a), Some(b)) => format!("{a:.0} | {b:.0}"),
            (Some(a), None) => format!("{a:.0} | -"),
            _ => "-".into(),
        };
        table.push([
            r.variant.clone(),
            side(
                r.poslab_forward,
                r.torch_forward,
                r.forward_ratio,
                r.forward_ratio_range,
            ),
            side(
                r.poslab_train,
                r.torch_train,
                r.train_ratio,
                r.train_ratio_range,
            ),
            rss,
        ]);
    }
    table
}

/// An indented list with a line per variant: its name, then `cells` of it, aligned.
fn ratio_list<'a>(
    ratios: impl IntoIterator<Item = &'a Ratio>,
    cells: impl Fn(&Ratio) -> Vec<String>,
) -> String {
    let rows: Vec<Vec<String>> = ratios
        .into_iter()
        .map(|r| std::iter::once(r.variant.clone()).chain(cells(r)).collect())
        .collect();
    let columns = rows.first().map_or(1, Vec::len);
    let mut list = TextTable::new(vec![String::new(); columns], vec![false; columns]);
    for row in rows {
        list.push(row);
    }
    list.list(2)
}

/// Notes on rounds that differed, and warnings on other processes that were busy.
fn ratio_warnings(ratios: &[Ratio]) -> String {
    let mut out = String::new();
    let unsteady: Vec<String> = ratios
        .iter()
        .filter(|r| r.train_spread.iter().any(|s| *s > 1.25))
        .map(|r| {
            format!(
                "{} (slowest round {:.2}x | {:.2}x slower)",
                r.variant, r.train_spread[0], r.train_spread[1]
            )
        })
        .collect();
    if !unsteady.is_empty() {
        out.push_str(&format!(
            "\nnote: rounds differed by more than 25% for {}; where nothing in this machine was \
             busy, the host was (steal or a sibling hyperthread): read the best-round ratios\n",
            unsteady.join(", ")
        ));
    }
    let busy: Vec<String> = ratios
        .iter()
        .filter(|r| r.worst_foreign_cores > 0.2)
        .map(|r| format!("{} ({:.2} cores)", r.variant, r.worst_foreign_cores))
        .collect();
    if !busy.is_empty() {
        out.push_str(&format!(
            "\nwarning: other processes were busy during {}; rerun when the machine is idle\n",
            busy.join(", ")
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_count_the_encoder_and_each_schemes_own_products() {
        let shape = Shape::default();
        let (d, f, l, p) = (256.0, 1024.0, 4.0, 64.0);
        let (b, t) = (32.0, 128.0);
        // Per token: q, k, v, o (4 d^2) and the FFN (2 d f) per layer; the head once per
        // sequence; the two attention products 4 L T^2 d per sequence.
        let encoder = 2.0 * l * (4.0 * d * d + 2.0 * d * f) * b * t
            + 2.0 * d * 2.0 * b
            + 4.0 * l * t * t * d * b;
        let limits = Limits::default();
        for name in shape.variant_names() {
            let cpu = candle::Device::Cpu;
            let compute = crate::nn::Compute {
                device: &cpu,
                backend: Default::default(),
            };
            let config = shape.model_config(&name, &limits, compute).unwrap();
            let own = match name.as_str() {
                "sin_concat_proj" => 2.0 * (d + p) * d * b * t,
                "untied" | "untied_sinusoidal" => 2.0 * (2.0 * t * d * d) + 2.0 * t * t * d,
                // q' k'ᵀ over twice the head's width.
                "pope" => l * 2.0 * t * t * d * b,
                // q times the two tables of 64 rows.
                "cope" => l * 4.0 * t * d * 64.0 * b,
                // W_w (d x d), W_b (4 heads), the conv of width 3, and the transport.
                "path" => {
                    l * (2.0 * t * d * (d + 4.0) + 2.0 * t * d * 3.0 + 4.0 * t * (t - 1.0) * d) * b
                }
                // DAPE's MLP at width 32 over 4 heads: 8 -> 32 -> 4 per pair.
                "alibi_adaptive" => l * 2.0 * t * t * (8.0 * 32.0 + 32.0 * 4.0) * b,
                // Both sides of 4 heads: the projection (p_dim 8), the edges and the sum over
                // the side.
                "grape_a" => {
                    l * 2.0 * 4.0 * (2.0 * t * d * 8.0 + 2.0 * t * t * 8.0 + 2.0 * t * t * t) * b
                }
                // No products of their own: stick-breaking's weights are a walk over each row.
                _ => 0.0,
            };
            let (forward, train) = shape.flops(&config);
            assert_eq!(forward, encoder + own, "{name}");
            assert_eq!(train, 3.0 * forward, "{name}");
        }
    }

    fn timing(tokens_per_s: f64) -> Timing {
        Timing {
            reps: 1,
            median_ms: 4096.0 / tokens_per_s * 1e3,
            min_ms: 0.0,
            max_ms: 0.0,
            tokens_per_s,
            gflops: 0.0,
        }
    }

    fn pair(variant: &str, poslab: [f64; 2], torch: [f64; 2]) -> (Record, TorchRecord) {
        (
            Record {
                variant: variant.into(),
                params: 0,
                forward_gflop: 0.0,
                train_gflop: 0.0,
                forward: Some(timing(poslab[0])),
                train: Some(timing(poslab[1])),
                train_parts_ms: None,
                forward_peak_rss_mib: None,
                forward_peak_gpu_mib: None,
                train_peak_gpu_mib: None,
                train_peak_rss_mib: Some(400.0),
                forward_foreign_cores: Some(0.0),
                train_foreign_cores: Some(0.0),
                kernels: "layer".into(),
                matmul_peak_gflops: None,
            },
            TorchRecord {
                variant: variant.into(),
                forward_tokens_per_s: torch[0],
                train_tokens_per_s: torch[1],
                train_parts_ms: None,
                train_peak_rss_mib: Some(1200.0),
                train_peak_gpu_mib: None,
                forward_foreign_cores: Some(0.0),
                train_foreign_cores: Some(0.0),
            },
        )
    }

    #[test]
    fn costs_pair_rounds_and_take_each_variants_best() {
        // tokens/s per (forward, train); a step is 4096 tokens.
        let rec = |v: &str, f: f64, t: f64| pair(v, [f, t], [1.0, 1.0]).0;
        let rounds = vec![
            vec![rec("a", 4096.0, 4096.0), rec("b", 4096.0, 2048.0)],
            // A disturbed round: everything slower, b's pairing still 2x.
            vec![rec("a", 2048.0, 1024.0), rec("b", 2048.0, 512.0)],
        ];
        let variants = vec!["a".to_string(), "b".to_string()];
        let c = costs(&variants, &rounds);
        assert_eq!(c[0].train_cost, 0.0);
        assert_eq!(c[1].best_train_ms, 2000.0); // its best round: 4096 tokens at 2048/s
        assert!((c[1].train_cost - 1.0).abs() < 1e-12, "{}", c[1].train_cost);
        assert_eq!(c[1].train_cost_paired, [1.0, 1.0, 1.0]);
        assert!(cost_table(&c).contains("+100.0%"));
    }

    #[test]
    fn ratios_report_medians_best_rounds_and_unsteady_hosts() {
        // Two rounds on a host that halves whichever side it lands on.
        let rounds = vec![
            vec![
                pair("sin_add", [8000.0, 2600.0], [7000.0, 1300.0]),
                pair("rope", [8000.0, 2400.0], [7000.0, 2500.0]),
            ],
            vec![
                pair("sin_add", [4000.0, 1400.0], [7500.0, 2500.0]),
                pair("rope", [8000.0, 2400.0], [7000.0, 2500.0]),
            ],
        ];
        let variants = vec!["sin_add".to_string(), "rope".to_string()];
        let r = ratios(&variants, &rounds);
        let add = &r[0];
        assert_eq!(add.rounds, 2);
        // Medians of two rounds are their means; per-round ratios span 2.0 and 0.56.
        assert_eq!((add.poslab_train, add.torch_train), (2000.0, 1900.0));
        assert!((add.train_ratio - 2000.0 / 1900.0).abs() < 1e-12);
        assert!((add.train_ratio_range[0] - 0.56).abs() < 1e-12);
        assert!((add.train_ratio_range[1] - 2.0).abs() < 1e-12);
        // Best rounds: each side's fastest, whichever round it came from.
        assert_eq!(add.best_train, [2600.0, 2500.0]);
        assert_eq!(add.best_forward, [8000.0, 7500.0]);
        assert!((add.train_spread[0] - 2600.0 / 1400.0).abs() < 1e-12);
        assert_eq!(r[1].train_spread, [1.0, 1.0]);

        let table = ratio_table(&r);
        assert!(table.contains("train 2600 | 2500  1.04x"), "{table}");
        // rope's step against sin_add's, from the best rounds: 2600 / 2400 - 1 = +8.3%.
        assert!(table.contains("+8.3% | +0.0%"), "{table}");
        assert!(
            table.contains("rounds differed by more than 25% for sin_add"),
            "{table}"
        );
        assert!(!table.contains("25% for sin_add (slowest round 1.86x | 1.92x slower), rope"));
    }
}
