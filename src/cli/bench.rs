//! `poslab bench`: forward and training throughput of every variant, optionally side by side
//! with the PyTorch reference.

use std::path::PathBuf;

use anyhow::{Context, Result};

/// Forward and training-step throughput of every positional variant at a reference shape (that
/// of shared/bench/torch_reference.py by default), with FLOP counts and peak memory.
#[derive(clap::Args)]
pub struct Args {
    /// Variants: every scheme with its default options (sin_add, sin_concat, sin_concat_proj,
    /// learned, rope, rope_partial, prope, alibi, t5, kerple, fire, untied, untied_sinusoidal,
    /// fox, none); default all but none (with --torch: the five the PyTorch reference has).
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
    /// Threads for matrix multiplies (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// One JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Measure every variant in this process (by default each runs in a fresh child
    /// process, so peak memory is its own).
    #[arg(long)]
    pub in_process: bool,
    /// Which kernels the layers run with: layer (each encoder layer one fused node, the
    /// default), ops (fused per-op kernels) or reference (compositions of candle ops).
    #[arg(long, value_parser = ["layer", "ops", "reference"])]
    pub kernels: Option<String>,
    /// Cap the instruction sets of poslab's fused kernels (avx512, avx2 or baseline), to
    /// see what a machine without AVX-512 gets; matrix multiplies (gemm) still pick their
    /// own kernels from the CPU at run time.
    #[arg(long, value_parser = ["avx512", "avx2", "baseline"])]
    pub simd: Option<String>,
    /// The PyTorch reference script (shared/bench/torch_reference.py): run it beside
    /// poslab, interleaved per variant, and report the ratios.
    #[arg(long)]
    pub torch: Option<PathBuf>,
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
}

pub fn run(a: Args) -> Result<()> {
    let args = BenchArgs {
        shape: poslab::bench::Shape {
            vocab: a.vocab,
            d_model: a.d_model,
            n_heads: a.heads,
            n_layers: a.layers,
            ffn_dim: a.ffn,
            batch: a.batch,
            seq: a.seq,
            dtype: a.dtype,
            ..Default::default()
        },
        variants: a.variants,
        warmup: a.warmup,
        forward_reps: a.forward_reps,
        train_reps: a.train_reps,
        threads: a.threads,
        device: a.device,
        json: a.json,
        in_process: a.in_process,
        kernels: a.kernels,
        simd: a.simd,
        torch: a.torch,
        python: a.python,
        rounds: a.rounds,
    };
    if let Some(n) = args.threads {
        super::check_workers("--threads", n, "threads")?;
        // candle reads this at every matrix multiply; set before any tensor work.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    if let Some(k) = &args.kernels {
        // Read once, at the first layer; children inherit it.
        std::env::set_var("POSLAB_KERNELS", k);
    }
    poslab::nn::cap_simd(match args.simd.as_deref() {
        Some("baseline") => Some(poslab::nn::SimdLevel::Baseline),
        Some("avx2") => Some(poslab::nn::SimdLevel::Avx2),
        _ => None,
    });
    let device = poslab::device::parse_device(&args.device)?;
    let variants = if args.variants.is_empty() {
        let pool: Vec<String> = if args.torch.is_some() {
            poslab::bench::TORCH_VARIANTS.map(String::from).to_vec()
        } else {
            args.shape.variant_names()
        };
        pool.into_iter().filter(|v| v != "none").collect()
    } else {
        args.variants.clone()
    };
    for v in &variants {
        args.shape.positional(v)?;
        if args.torch.is_some() && !poslab::bench::TORCH_VARIANTS.contains(&v.as_str()) {
            anyhow::bail!(
                "--torch: the PyTorch reference has no `{v}` variant; it runs {}",
                poslab::bench::TORCH_VARIANTS.join(", ")
            );
        }
    }
    let shape = &args.shape;
    // The PyTorch script is checked before anything runs: a missing file, or the fixed-shape
    // reference asked for another shape, device or dtype.
    let takes_shape = match &args.torch {
        Some(script) => {
            if !script.exists() {
                anyhow::bail!(
                    "--torch {}: no such file (shared/bench/torch_reference.py, or \
                 benches/torch_at_shape.py for other shapes, devices and dtypes)",
                    script.display()
                );
            }
            if !script.is_file() {
                anyhow::bail!(
                    "--torch {}: not a regular file (a folder, device or pipe): give the path \
                     of the PyTorch script",
                    script.display()
                );
            }
            // The shared reference runs one fixed shape in f32 on the CPU; benches/torch_at_shape.py
            // runs its model at any shape, device and dtype, and says so by taking --d-model.
            let takes_shape = poslab::io::read_text_bounded(
                script,
                poslab::io::MAX_CONFIG_BYTES,
                "PyTorch script",
            )?
            .contains("--d-model");
            let reference_setting = *shape == poslab::bench::Shape::default() && device.is_cpu();
            if !takes_shape && !reference_setting {
                anyhow::bail!(
                "--torch {} runs PyTorch on the CPU in f32 at its own fixed shape (width 256, 4 \
                 heads, 4 layers, FFN 1024, batch 32 x 128), but this bench runs {} in {} at \
                 width {}, {} heads, {} layers, FFN {}, batch {} x {}: the ratios would compare \
                 different work. Use --torch benches/torch_at_shape.py, which runs that \
                 script's model at this shape, device and dtype (it finds the script through \
                 POSLAB_TORCH_REFERENCE or ../shared/bench/torch_reference.py)",
                script.display(),
                poslab::device::device_name(&device),
                shape.dtype.name(),
                shape.d_model,
                shape.n_heads,
                shape.n_layers,
                shape.ffn_dim,
                shape.batch,
                shape.seq
            );
            }
            takes_shape
        }
        None => false,
    };
    let threads = candle::utils::get_num_threads();
    let kernels =
        poslab::nn::kernels_on(&device, shape.dtype.compute_dtype(candle::DType::F32)).name();
    let device_label = match poslab::device::gpu_name(&device) {
        Some(gpu) => format!("{} ({gpu})", poslab::device::device_name(&device)),
        None => poslab::device::device_name(&device),
    };
    let child = args.in_process && args.json;
    if !child {
        eprintln!(
            "poslab bench on {device_label} ({threads} thread{}, {kernels} kernels, {:?} SIMD, {}): vocab {}, width {}, {} heads, {} layers, FFN {}, batch {} x {}",
            if threads == 1 { "" } else { "s" },
            poslab::nn::simd_level(),
            shape.dtype.name(),
            shape.vocab,
            shape.d_model,
            shape.n_heads,
            shape.n_layers,
            shape.ffn_dim,
            shape.batch,
            shape.seq
        );
    }
    let options = poslab::bench::Options {
        shape: shape.clone(),
        variants: variants.clone(),
        warmup: args.warmup,
        forward_reps: args.forward_reps,
        train_reps: args.train_reps,
        device: device.clone(),
    };
    // One child process per variant: its peak memory is its own, not the heap an earlier
    // variant left behind.
    let in_child = |variant: &str| -> Result<poslab::bench::Record> {
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.arg("bench");
        for (flag, value) in shape_flags(shape).into_iter().chain([
            ("--warmup", args.warmup),
            ("--forward-reps", args.forward_reps),
            ("--train-reps", args.train_reps),
            ("--threads", threads),
        ]) {
            cmd.args([flag.to_string(), value.to_string()]);
        }
        cmd.args([
            "--device",
            &args.device,
            "--dtype",
            shape.dtype.name(),
            "--json",
            "--in-process",
            "--variants",
            variant,
        ]);
        if let Some(simd) = &args.simd {
            cmd.args(["--simd", simd]);
        }
        let out = cmd
            .stderr(std::process::Stdio::inherit())
            .output()
            .context("running a bench child process")?;
        if !out.status.success() {
            anyhow::bail!("the bench of {variant} failed");
        }
        let doc: serde_json::Value =
            serde_json::from_slice(&out.stdout).context("reading a bench child's JSON")?;
        let mut records: Vec<poslab::bench::Record> =
            serde_json::from_value(doc["results"].clone())?;
        records.pop().context("a bench child returned no result")
    };
    let header = serde_json::json!({
        "device": poslab::device::device_name(&device),
        "gpu": poslab::device::gpu_name(&device),
        "threads": threads,
        "kernels": kernels,
        "simd": format!("{:?}", poslab::nn::simd_level()),
        "shape": shape,
    });

    if let Some(script) = &args.torch {
        let torch = |variant: &str| -> Result<poslab::bench::TorchRecord> {
            eprintln!("  {variant}: PyTorch");
            let mut cmd = std::process::Command::new(&args.python);
            cmd.arg(script).arg(variant);
            if takes_shape {
                for (flag, value) in shape_flags(shape) {
                    cmd.args([flag.to_string(), value.to_string()]);
                }
                cmd.args(["--dtype", shape.dtype.name()]);
                cmd.args(["--device", &poslab::device::device_name(&device)]);
            }
            let out = cmd
                .args(["--fwd-iters", &args.forward_reps.max(1).to_string()])
                .args(["--train-iters", &args.train_reps.max(1).to_string()])
                .args(["--warm", &args.warmup.to_string()])
                .args(["--threads", &threads.to_string()])
                .stderr(std::process::Stdio::inherit())
                .output()
                .with_context(|| {
                    format!("running {} {}", args.python.display(), script.display())
                })?;
            if !out.status.success() {
                anyhow::bail!(
                    "the PyTorch reference failed for {variant} (is torch installed for {}? pass --python)",
                    args.python.display()
                );
            }
            let text = String::from_utf8_lossy(&out.stdout);
            let line = text
                .lines()
                .rev()
                .find(|l| l.trim_start().starts_with('{'))
                .context("the PyTorch reference printed no JSON line")?;
            Ok(poslab::bench::TorchRecord::from_json(
                &serde_json::from_str(line)?,
            )?)
        };
        let mut rounds = Vec::new();
        let n = args.rounds.unwrap_or(3).max(1);
        for round in 0..n {
            eprintln!("round {} of {n}", round + 1);
            let mut pairs = Vec::new();
            for variant in &variants {
                // Alternate which goes first, so a drift in machine speed favours neither.
                let (p, t) = if round % 2 == 0 {
                    let p = in_child(variant)?;
                    (p, torch(variant)?)
                } else {
                    let t = torch(variant)?;
                    (in_child(variant)?, t)
                };
                pairs.push((p, t));
            }
            rounds.push(pairs);
        }
        let ratios = poslab::bench::ratios(&variants, &rounds);
        if args.json {
            let mut doc = header;
            doc["ratios"] = serde_json::to_value(&ratios)?;
            doc["rounds"] = serde_json::to_value(&rounds)?;
            outln!("{}", serde_json::to_string_pretty(&doc)?);
        } else {
            out!("{}", poslab::bench::ratio_table(&ratios));
        }
        return Ok(());
    }

    if args.rounds.is_some_and(|n| n > 1) && !args.in_process {
        // Interleaved rounds, the order reversed every other round, so a drift in machine
        // speed favours no variant.
        let n = args.rounds.unwrap_or(1);
        let mut rounds = Vec::new();
        for round in 0..n {
            eprintln!("round {} of {n}", round + 1);
            let mut order: Vec<&String> = variants.iter().collect();
            if round % 2 == 1 {
                order.reverse();
            }
            let mut records = order
                .into_iter()
                .map(|v| in_child(v))
                .collect::<Result<Vec<_>>>()?;
            records.sort_by_key(|r| variants.iter().position(|v| *v == r.variant));
            rounds.push(records);
        }
        let costs = poslab::bench::costs(&variants, &rounds);
        if args.json {
            let mut doc = header;
            doc["costs"] = serde_json::to_value(&costs)?;
            doc["rounds"] = serde_json::to_value(&rounds)?;
            outln!("{}", serde_json::to_string_pretty(&doc)?);
        } else {
            out!("{}", poslab::bench::cost_table(&costs));
        }
        return Ok(());
    }
    let records = if args.in_process || variants.len() == 1 {
        poslab::bench::run(&options, &mut |phase| eprintln!("  {phase}"))?
    } else {
        variants
            .iter()
            .map(|v| in_child(v))
            .collect::<Result<Vec<_>>>()?
    };
    if args.json {
        let mut doc = header;
        doc["results"] = serde_json::to_value(&records)?;
        outln!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        out!("{}", poslab::bench::table(&records));
    }
    Ok(())
}

/// The shape as the flags of `poslab bench` (benches/torch_at_shape.py takes the same).
fn shape_flags(shape: &poslab::bench::Shape) -> [(&'static str, usize); 7] {
    [
        ("--vocab", shape.vocab),
        ("--d-model", shape.d_model),
        ("--heads", shape.n_heads),
        ("--layers", shape.n_layers),
        ("--ffn", shape.ffn_dim),
        ("--batch", shape.batch),
        ("--seq", shape.seq),
    ]
}

struct BenchArgs {
    shape: poslab::bench::Shape,
    variants: Vec<String>,
    warmup: usize,
    forward_reps: usize,
    train_reps: usize,
    threads: Option<usize>,
    device: String,
    json: bool,
    in_process: bool,
    kernels: Option<String>,
    simd: Option<String>,
    torch: Option<PathBuf>,
    python: PathBuf,
    rounds: Option<usize>,
}
