//! `poslab bench`: forward and training throughput of every variant, optionally side by side
//! with the PyTorch reference.

use std::path::PathBuf;

use anyhow::Result;

/// Forward and training-step throughput of every positional variant at a reference shape (that
/// of shared/bench/torch_reference.py by default), with FLOP counts and peak memory.
#[derive(clap::Args)]
pub struct Args {
    /// Variants: every scheme with its default options (sin_add, sin_concat, sin_concat_proj,
    /// learned, rope, rope_partial, prope, alibi, alibi_adaptive (under DAPE's MLP), t5, kerple,
    /// fire, untied, untied_sinusoidal, fox, pope, cope, path, stick_breaking, grape_m, grape_a,
    /// none), each also with `+causal` (the same model with a causal mask:
    /// `sin_add,sin_add+causal`); default all but none (with --torch: those the PyTorch script
    /// runs).
    #[arg(long, value_delimiter = ',')]
    pub variants: Vec<String>,
    #[arg(long, default_value_t = 8192)]
    pub vocab: usize,
    #[arg(long, default_value_t = 256)]
    pub d_model: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 1024)]
    pub ffn: usize,
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Untimed steps before each phase.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Timed forward passes (0 skips them).
    #[arg(long, default_value_t = 10)]
    pub forward_reps: usize,
    /// Timed training steps (0 skips them).
    #[arg(long, default_value_t = 6)]
    pub train_reps: usize,
    /// Threads to compute with: the fused kernels and their matrix multiplies (default:
    /// RAYON_NUM_THREADS when set, else every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value_t = poslab::device::DeviceSpec::Auto)]
    pub device: poslab::device::DeviceSpec,
    /// One JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Measure every variant in this process (by default each runs in a fresh child
    /// process, so peak memory is its own).
    #[arg(long)]
    pub in_process: bool,
    /// Which kernels the layers run with: layer (each encoder layer one fused node, the
    /// default), ops (fused per-op kernels) or reference (compositions of candle ops).
    /// Default: POSLAB_KERNELS, else layer.
    #[arg(long, value_parser = super::kernels_described())]
    pub kernels: Option<poslab::nn::Kernels>,
    /// Cap the instruction sets of poslab's fused kernels, to see what a machine without
    /// AVX-512 gets; matrix multiplies (gemm) still pick their own kernels from the CPU at run
    /// time.
    #[arg(long, value_parser = super::choices(SIMD, poslab::nn::SimdLevel::name))]
    pub simd: Option<poslab::nn::SimdLevel>,
    /// Run PyTorch beside poslab, interleaved per variant, and report the ratios: with no
    /// path, poslab's own PyTorch model of the bench encoder (benches/torch_at_shape.py, built
    /// in), at this shape, device and dtype; or a script's path (the fixed-shape
    /// shared/bench/torch_reference.py runs only the default shape).
    #[arg(long, num_args = 0..=1, value_name = "SCRIPT")]
    pub torch: Option<Option<PathBuf>>,
    /// The Python that runs --torch (one with torch installed).
    #[arg(long, default_value = "python3")]
    pub python: PathBuf,
    /// Interleaved rounds: of poslab and PyTorch with --torch (default 3); otherwise (default
    /// 1), with more than one, of the variants (each a child process, the order alternating),
    /// reported as each one's cost over the first listed.
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Activations in f32, bf16 or f16 (mixed precision; weights and optimizer stay f32).
    #[arg(long, default_value = "f32")]
    pub dtype: poslab::Precision,
    /// Instead of the variants: time the matrix products of one encoder layer's training step
    /// one by one (each linear layer's output, input gradient and weight gradient over batch x
    /// seq rows, and the attention's six products per head) through the calls the fused
    /// layers make, beside gemm at 1024^3; with --torch, beside PyTorch's products as its
    /// autograd runs them, in interleaved --rounds (default 3). CPU, f32; each rate the best of
    /// --train-reps runs.
    #[arg(long)]
    pub products: bool,
    /// Instead of timing: count what one training step asks of a GPU (kernel launches, cuBLAS
    /// calls and copies) and its peak memory, through the CUDA path: on a GPU, or on the CPU by
    /// the device path's twin. With --json: `launches_per_step` and `peak_device_bytes`.
    #[arg(long, conflicts_with_all = ["products", "torch"])]
    pub launches: bool,
}

/// `--simd`'s values.
const SIMD: &[(poslab::nn::SimdLevel, &str)] = &[
    (
        poslab::nn::SimdLevel::Baseline,
        "The build's baseline target (SSE2 on x86-64)",
    ),
    (poslab::nn::SimdLevel::Avx2, "AVX2 and FMA"),
    (poslab::nn::SimdLevel::Avx512, "AVX-512 (F and VL)"),
];

pub fn run(a: Args) -> Result<()> {
    let shape = poslab::bench::Shape {
        vocab: a.vocab,
        d_model: a.d_model,
        n_heads: a.heads,
        n_layers: a.layers,
        ffn_dim: a.ffn,
        batch: a.batch,
        seq: a.seq,
        dtype: a.dtype,
        ..Default::default()
    };
    let threads = super::threads(a.threads)?.unwrap_or_else(poslab::nn::cores);
    check_repetitions(&a)?;
    let limits = super::limits()?;
    let mut backend = poslab::nn::Backend::default().with_kernels(super::kernels(a.kernels)?);
    if let Some(simd) = a.simd {
        backend = backend.with_simd(simd);
    }
    let device = a.device.open()?;
    let compute = poslab::nn::Compute {
        device: &device,
        backend,
    };
    if a.products {
        check_products(&a, &shape, compute, &limits)?;
    }
    let torch = match &a.torch {
        Some(Some(script)) => Some(poslab::bench::Torch::new(
            script, &a.python, &shape, &device,
        )?),
        Some(None) => Some(poslab::bench::Torch::built_in(&a.python, &shape, &device)?),
        None => None,
    };
    if a.products {
        return products(&a, &shape, threads, torch.as_ref());
    }
    let variants = match a.variants.is_empty() {
        true => poslab::bench::Plan::default_variants(&shape, torch.as_ref(), &limits, compute)?,
        false => a.variants.clone(),
    };
    let options = poslab::bench::Options {
        shape,
        variants,
        warmup: a.warmup,
        forward_reps: a.forward_reps,
        train_reps: a.train_reps,
        device,
        backend,
        limits,
        threads,
    };
    match a.launches {
        true => launches(options, a.json),
        false => timed(&a, options, torch),
    }
}

/// `--launches`: one training step of each variant, its device operations and memory counted.
fn launches(options: poslab::bench::Options, json: bool) -> Result<()> {
    let options = poslab::bench::Options {
        warmup: 0,
        forward_reps: 0,
        train_reps: 1,
        ..options
    };
    for v in &options.variants {
        options
            .shape
            .model_config(v, &options.limits, options.compute())?;
    }
    // The heap is counted from here: each model's parameters, moments and step.
    poslab::heap::start_counting();
    let counts = poslab::bench::launches::count(&options, &mut |l| errln!("{l}"))?;
    match json {
        true => outln!("{}", serde_json::to_string_pretty(&counts)?),
        false => out!("{}", poslab::bench::launches::table(&counts)),
    }
    Ok(())
}

/// The timed benchmark: each variant's forward and training step, beside PyTorch's if asked.
fn timed(
    a: &Args,
    options: poslab::bench::Options,
    torch: Option<poslab::bench::Torch>,
) -> Result<()> {
    let plan = poslab::bench::Plan {
        options,
        device_flag: a.device,
        in_process: a.in_process,
        rounds: a.rounds,
        torch,
    };
    plan.check()?;
    // A child (a variant measured for its parent) prints its JSON only.
    if !(a.in_process && a.json) {
        errln!("{}", plan.banner());
    }
    let outcome = plan.run(&mut |line| errln!("{line}"))?;
    match a.json {
        true => outln!(
            "{}",
            serde_json::to_string_pretty(&outcome.json(plan.header()))?
        ),
        false => out!("{}", outcome.table()),
    }
    Ok(())
}

/// The most untimed steps before a phase, timed steps of a phase, and rounds: far past any
/// measurement's need, and short of a run that never ends.
const MAX_WARMUP: usize = 10_000;
const MAX_REPS: usize = 100_000;
const MAX_ROUNDS: usize = 100;

/// Repetitions and rounds that measure something, and end.
fn check_repetitions(a: &Args) -> Result<()> {
    for (flag, n, max) in [
        ("--warmup", a.warmup, MAX_WARMUP),
        ("--forward-reps", a.forward_reps, MAX_REPS),
        ("--train-reps", a.train_reps, MAX_REPS),
    ] {
        if n > max {
            anyhow::bail!("{flag} {n}: give at most {max}");
        }
    }
    if let Some(n) = a.rounds.filter(|n| !(1..=MAX_ROUNDS).contains(n)) {
        anyhow::bail!("--rounds {n}: give from 1 to {MAX_ROUNDS} rounds");
    }
    if a.products && a.train_reps == 0 {
        anyhow::bail!("--products --train-reps 0: each product's rate is the best of --train-reps runs; give at least 1");
    }
    if !a.products && a.forward_reps == 0 && a.train_reps == 0 {
        anyhow::bail!(
            "--forward-reps 0 --train-reps 0: nothing to measure; give either at least 1"
        );
    }
    Ok(())
}

/// `--products` measures the CPU's f32 products of the encoder layers, the same for every
/// variant.
fn check_products(
    a: &Args,
    shape: &poslab::bench::Shape,
    compute: poslab::nn::Compute<'_>,
    limits: &poslab::limits::Limits,
) -> Result<()> {
    let device = compute.device;
    let refuse = |why: &str| Err(poslab::Error::Input(format!("--products: {why}")).into());
    if !device.is_cpu() {
        return refuse("it times the CPU's matrix products (gemm); add --device cpu");
    }
    if a.dtype != poslab::Precision::F32 {
        return refuse("it times f32 products; drop --dtype");
    }
    if !a.variants.is_empty() {
        return refuse(
            "the encoder layers' products are the same for every variant; drop --variants",
        );
    }
    // The shape's own checks (heads, sizes, memory), as a bench of it would make them.
    shape.model_config("sin_add", limits, compute)?;
    Ok(())
}

fn products(
    a: &Args,
    shape: &poslab::bench::Shape,
    threads: usize,
    torch: Option<&poslab::bench::Torch>,
) -> Result<()> {
    use poslab::bench::products;
    if let Some(t) = torch {
        t.check_products()?;
    }
    let list = products::step_products(shape);
    let rounds = a.rounds.unwrap_or(if torch.is_some() { 3 } else { 1 });
    let mut torch_round = torch.map(|t| move || t.products(shape, threads, a.warmup, a.train_reps));
    let torch_fn = torch_round
        .as_mut()
        .map(|f| f as &mut dyn FnMut() -> poslab::Result<_>);
    let rates = products::measure(
        &list,
        threads,
        a.train_reps,
        rounds,
        torch_fn,
        &mut |line| errln!("{line}"),
    )?;
    let rows = shape.batch * shape.seq;
    match a.json {
        true => outln!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "threads": threads,
                "rows": rows,
                "torch": torch.and_then(|t| t.version.clone()),
                "products": rates,
                "step_ms": {
                    "poslab": products::step_ms(&rates, false),
                    "torch": products::step_ms(&rates, true),
                },
            }))?
        ),
        false => out!("{}", products::table(&rates, rows, threads)),
    }
    Ok(())
}
