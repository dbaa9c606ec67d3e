//! The `poslab` command line.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use candle::{DType, Device};
use clap::{Parser, Subcommand};
use poslab::experiment::results::Outcome;
use poslab::experiment::{self, report, run, single, ExperimentConfig, Selection};
use poslab::infer::{Prediction, Predictor};
use poslab::positional::{
    ConcatOptions, LearnedOptions, NoOptions, RopeOptions, SinusoidalOptions,
};
use poslab::{Encoder, ModelConfig, ParamStore, Placement, PositionalConfig};

#[derive(Parser)]
#[command(
    name = "poslab",
    version,
    about = "A lab for transformer positional encodings"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where a model computes, and in what precision.
#[derive(clap::Args, Clone, Debug)]
struct Compute {
    /// cpu, cuda, cuda:N or auto (CUDA when built with the `cuda` feature and a GPU is present).
    #[arg(long, default_value = "auto")]
    device: String,
    /// Activations in f32, bf16 or f16: mixed precision, meant for CUDA. Weights, gradients,
    /// optimizer state, positional tables, RoPE angles and softmax / LayerNorm statistics stay
    /// f32. Default: the config's `[model] dtype` (f32 if absent), or as a saved model was trained.
    #[arg(long)]
    dtype: Option<poslab::Precision>,
}

#[derive(Subcommand)]
enum Command {
    /// Train every positional variant of an experiment on the same data, seeds and budget, and
    /// report scores by input length, the shuffle and shift tests, parameters and speed.
    Compare {
        /// Experiment config (TOML). Default: configs/compare.toml, embedded in the binary.
        config: Option<PathBuf>,
        #[command(flatten)]
        compute: Compute,
        /// Run only this task (repeatable).
        #[arg(long = "task", value_name = "NAME")]
        tasks: Vec<String>,
        /// Run only this variant (repeatable).
        #[arg(long = "variant", value_name = "NAME")]
        variants: Vec<String>,
        /// Run only this seed (repeatable).
        #[arg(long = "seed", value_name = "N")]
        seeds: Vec<u64>,
        /// Where run folders are made.
        #[arg(long, default_value = "runs")]
        runs_dir: PathBuf,
        /// The exact run folder to write (instead of runs/<name>-<timestamp>).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Cells trained at once (default: one per CPU core, one thread each; 1 on CUDA).
        #[arg(long)]
        jobs: Option<usize>,
        /// No progress bars.
        #[arg(long, short)]
        quiet: bool,
    },
    /// Train one model (any task, any positional choice) with checkpoints; a stopped run
    /// continues with --resume and ends with the same weights as one that never stopped.
    Train {
        /// A train config (TOML): name, seed, [model], [positional], [train], [task].
        #[arg(long, required_unless_present = "resume", conflicts_with = "resume")]
        config: Option<PathBuf>,
        /// Continue the run in this folder from its latest checkpoint.
        #[arg(long, value_name = "RUN_DIR")]
        resume: Option<PathBuf>,
        /// The run folder (default: runs/<name>-<timestamp>).
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, default_value = "runs")]
        runs_dir: PathBuf,
        /// (--dtype applies to a new run; a resumed run keeps the dtype it was started with.)
        #[command(flatten)]
        compute: Compute,
        /// Stop once this many steps are done, after saving a checkpoint (what a kill would
        /// leave); continue later with --resume.
        #[arg(long, value_name = "STEPS")]
        stop_after: Option<usize>,
        /// No progress bar.
        #[arg(long, short)]
        quiet: bool,
    },
    /// Labels and probabilities (classification), tags per word (tagging) or the top fills of
    /// each [MASK] (MLM) for new text, from a trained model's folder.
    Predict {
        /// A model folder: config.json, model.safetensors, tokenizer.json.
        #[arg(long, value_name = "DIR")]
        run: PathBuf,
        /// Texts to read (or use --input).
        texts: Vec<String>,
        /// A file of texts, one per line; `-` reads standard input.
        #[arg(long, value_name = "FILE")]
        input: Option<PathBuf>,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        /// Fills shown per mask.
        #[arg(long, default_value_t = 5)]
        top_k: usize,
        /// Cut texts longer than a learned position table instead of refusing them.
        #[arg(long)]
        truncate: bool,
        #[command(flatten)]
        compute: Compute,
    },
    /// Pooled sentence vectors of texts, one JSON object per line.
    Embed {
        /// A model folder: config.json, model.safetensors, tokenizer.json.
        #[arg(long, value_name = "DIR")]
        run: PathBuf,
        texts: Vec<String>,
        #[arg(long, value_name = "FILE")]
        input: Option<PathBuf>,
        #[arg(long)]
        truncate: bool,
        #[command(flatten)]
        compute: Compute,
    },
    /// What a positional scheme encodes: the table as CSV and heatmap, distance matrices,
    /// distance against offset, the relative-shift property, a linear position probe,
    /// wavelengths, RoPE's decay; for a trained model (--run) its table and how its attention
    /// logits split into content and position terms.
    Analyze {
        /// `sinusoidal` or `rope`; or give --run instead.
        #[arg(value_parser = ["sinusoidal", "rope"], required_unless_present = "run", conflicts_with = "run")]
        scheme: Option<String>,
        /// A trained model's folder.
        #[arg(long, value_name = "DIR")]
        run: Option<PathBuf>,
        /// Width of the table (sinusoidal) or of a head (rope).
        #[arg(long, default_value_t = 64)]
        dim: usize,
        #[arg(long, default_value_t = 10_000.0)]
        base: f64,
        /// Sinusoidal layout: interleaved or half.
        #[arg(long, default_value = "interleaved")]
        layout: String,
        /// RoPE pairing: interleaved or half.
        #[arg(long, default_value = "interleaved")]
        pairing: String,
        /// Positions analysed (a learned table: all its rows).
        #[arg(long, default_value_t = 128)]
        positions: usize,
        /// First position (sinusoidal).
        #[arg(long, default_value_t = 0)]
        start: usize,
        /// Reference position (row) of the offset curves.
        #[arg(long, default_value_t = 0)]
        reference: usize,
        /// Bases compared in the wavelength plot.
        #[arg(long, value_delimiter = ',', default_values_t = vec![100.0, 10_000.0, 100_000_000.0])]
        bases: Vec<f64>,
        /// Evaluation text for the attention terms of --run, one text per line (default: the
        /// model's own test set, remade from its config.json).
        #[arg(long, value_name = "FILE")]
        text: Option<PathBuf>,
        /// Texts used for the attention terms.
        #[arg(long, default_value_t = 64)]
        texts: usize,
        /// Output folder (default: runs/analysis-<what>-<timestamp>).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Forward and training-step throughput of every positional variant at a reference shape
    /// (that of shared/bench/torch_reference.py by default), with FLOP counts and peak memory.
    Bench {
        /// Variants (sin_add, sin_concat, sin_concat_proj, learned, rope, none); default all but none.
        #[arg(long, value_delimiter = ',')]
        variants: Vec<String>,
        #[arg(long, default_value_t = 8192)]
        vocab: usize,
        #[arg(long, default_value_t = 256)]
        d_model: usize,
        #[arg(long, default_value_t = 4)]
        heads: usize,
        #[arg(long, default_value_t = 4)]
        layers: usize,
        #[arg(long, default_value_t = 1024)]
        ffn: usize,
        #[arg(long, default_value_t = 32)]
        batch: usize,
        #[arg(long, default_value_t = 128)]
        seq: usize,
        /// Untimed steps before each phase.
        #[arg(long, default_value_t = 2)]
        warmup: usize,
        /// Timed forward passes (0 skips them).
        #[arg(long, default_value_t = 10)]
        forward_reps: usize,
        /// Timed training steps (0 skips them).
        #[arg(long, default_value_t = 6)]
        train_reps: usize,
        /// Threads for matrix multiplies (default: every core).
        #[arg(long)]
        threads: Option<usize>,
        #[arg(long, default_value = "auto")]
        device: String,
        /// One JSON document instead of the table.
        #[arg(long)]
        json: bool,
        /// Measure every variant in this process (by default each runs in a fresh child
        /// process, so peak memory is its own).
        #[arg(long)]
        in_process: bool,
        /// Which kernels the layers run with: layer (each encoder layer one fused node, the
        /// default), ops (fused per-op kernels) or reference (compositions of candle ops).
        #[arg(long, value_parser = ["layer", "ops", "reference"])]
        kernels: Option<String>,
        /// Cap the instruction sets of poslab's fused kernels (avx512, avx2 or baseline), to
        /// see what a machine without AVX-512 gets; matrix multiplies (gemm) still pick their
        /// own kernels from the CPU at run time.
        #[arg(long, value_parser = ["avx512", "avx2", "baseline"])]
        simd: Option<String>,
        /// The PyTorch reference script (shared/bench/torch_reference.py): run it beside
        /// poslab, interleaved per variant, and report the ratios.
        #[arg(long)]
        torch: Option<PathBuf>,
        /// The Python that runs --torch (one with torch installed).
        #[arg(long, default_value = "python3")]
        python: PathBuf,
        /// Interleaved rounds of poslab and PyTorch with --torch.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Activations in f32, bf16 or f16 (mixed precision; weights and optimizer stay f32).
        #[arg(long, default_value = "f32")]
        dtype: poslab::Precision,
    },
    /// Merge the results of run folders (cells split across machines with --task, --variant,
    /// --seed) into one report.
    Report {
        /// Run folders holding results.json.
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        /// Output folder (default: runs/<experiment>-report-<timestamp>).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Validate a model config and show its shape, where positions act, and the parameters of
    /// the same shape under every positional scheme.
    Inspect {
        /// A model config, TOML or JSON.
        #[arg(default_value = "configs/encoder.toml")]
        config: PathBuf,
    },
}

fn main() -> ExitCode {
    // POSLAB_DEFAULT_ALLOCATOR=1 keeps glibc's defaults (to measure what the tuning buys).
    if std::env::var_os("POSLAB_DEFAULT_ALLOCATOR").is_none() {
        poslab::tune_allocator();
    }
    let result = match Cli::parse().command {
        Command::Compare {
            config,
            compute,
            tasks,
            variants,
            seeds,
            runs_dir,
            out,
            jobs,
            quiet,
        } => compare(
            config.as_deref(),
            &compute,
            Selection {
                tasks,
                variants,
                seeds,
            },
            &runs_dir,
            out,
            jobs,
            quiet,
        ),
        Command::Train {
            config,
            resume,
            out,
            runs_dir,
            compute,
            stop_after,
            quiet,
        } => train(config, resume, out, &runs_dir, &compute, stop_after, quiet),
        Command::Predict {
            run,
            texts,
            input,
            json,
            top_k,
            truncate,
            compute,
        } => predict(&run, texts, input, json, top_k, truncate, &compute),
        Command::Embed {
            run,
            texts,
            input,
            truncate,
            compute,
        } => embed(&run, texts, input, truncate, &compute),
        Command::Analyze {
            scheme,
            run,
            dim,
            base,
            layout,
            pairing,
            positions,
            start,
            reference,
            bases,
            text,
            texts,
            out,
        } => analyze(AnalyzeArgs {
            scheme,
            run,
            dim,
            base,
            layout,
            pairing,
            positions,
            start,
            reference,
            bases,
            text,
            texts,
            out,
        }),
        Command::Bench {
            variants,
            vocab,
            d_model,
            heads,
            layers,
            ffn,
            batch,
            seq,
            warmup,
            forward_reps,
            train_reps,
            threads,
            device,
            json,
            in_process,
            kernels,
            simd,
            torch,
            python,
            rounds,
            dtype,
        } => bench(BenchArgs {
            shape: poslab::bench::Shape {
                vocab,
                d_model,
                n_heads: heads,
                n_layers: layers,
                ffn_dim: ffn,
                batch,
                seq,
                dtype,
                ..Default::default()
            },
            variants,
            warmup,
            forward_reps,
            train_reps,
            threads,
            device,
            json,
            in_process,
            kernels,
            simd,
            torch,
            python,
            rounds,
        }),
        Command::Report { runs, out } => merge_reports(&runs, out),
        Command::Inspect { config } => inspect(&config),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn compare(
    path: Option<&Path>,
    compute: &Compute,
    selection: Selection,
    runs_dir: &Path,
    out: Option<PathBuf>,
    jobs: Option<usize>,
    quiet: bool,
) -> Result<()> {
    let started = Instant::now();
    let (mut config, source) = match path {
        Some(p) => (ExperimentConfig::load(p)?, p.display().to_string()),
        None => (
            ExperimentConfig::from_toml_str(experiment::DEFAULT_CONFIG)
                .context("the embedded configs/compare.toml")?,
            "configs/compare.toml (embedded default)".to_string(),
        ),
    };
    if let Some(dtype) = compute.dtype {
        config.model.dtype = dtype;
    }
    let (tasks, variants, seeds) = config.select(&selection)?;
    let cells = tasks.len() * variants.len() * seeds.len();
    let device = poslab::device::parse_device(&compute.device)?;
    // Small models train fastest as one single-threaded job per core; a lone cell gets every
    // core for its matrix multiplies. candle reads RAYON_NUM_THREADS at each multiply, so this
    // is set before any tensor work.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let jobs = match (jobs, device.is_cpu()) {
        (Some(j), _) => j.max(1),
        (None, true) => cores,
        (None, false) => 1,
    }
    .min(cells.max(1));
    if device.is_cpu() && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", (cores / jobs).max(1).to_string());
    }
    let dir = match out {
        Some(dir) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            dir
        }
        None => experiment::new_run_dir(runs_dir, &config.name)?,
    };
    poslab::io::write_atomic(&dir.join("config.toml"), config.to_toml().as_bytes())?;
    eprintln!(
        "poslab compare: {source} on {} -> {}",
        poslab::device::device_name(&device),
        dir.display()
    );
    let output = run::run(
        &config,
        &run::RunOptions {
            device,
            dir: dir.clone(),
            selection,
            progress: !quiet,
            jobs,
        },
        &|line| eprintln!("{line}"),
    )?;
    let table = report::write_report(&dir, &output.results, &output.timings, &[])?;
    println!("{table}");
    println!(
        "run folder: {} (report.md, results.csv, summary.csv, results.json, timing.json, plots/, models/)",
        dir.display()
    );
    println!("total time: {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn train(
    config: Option<PathBuf>,
    resume: Option<PathBuf>,
    out: Option<PathBuf>,
    runs_dir: &Path,
    compute: &Compute,
    stop_after: Option<usize>,
    quiet: bool,
) -> Result<()> {
    let device = poslab::device::parse_device(&compute.device)?;
    let options = |dir: PathBuf| single::TrainOptions {
        dir,
        device: device.clone(),
        progress: !quiet,
        stop_after,
        hub: poslab::text::HubSource::from_env(),
    };
    let (end, dir) = match (config, resume) {
        (_, Some(dir)) => {
            if let Some(dtype) = compute.dtype {
                anyhow::bail!(
                    "--dtype {dtype} with --resume: a resumed run keeps the dtype it was started \
                     with (its config.json), so that it ends as an uninterrupted run would; drop --dtype"
                );
            }
            eprintln!("poslab train: resuming {}", dir.display());
            (single::resume(&options(dir.clone()))?, dir)
        }
        (Some(path), None) => {
            let mut config = single::TrainRunConfig::load(&path)?;
            if let Some(dtype) = compute.dtype {
                config.model.dtype = dtype;
            }
            let dir = match out {
                Some(dir) => dir,
                None => experiment::new_run_dir(runs_dir, &config.name)?,
            };
            eprintln!("poslab train: {} -> {}", path.display(), dir.display());
            (single::start(&config, &options(dir.clone()))?, dir)
        }
        (None, None) => unreachable!("clap requires --config or --resume"),
    };
    match end {
        single::TrainEnd::Stopped { step } => println!(
            "stopped after step {step} as asked, with a checkpoint; continue with: poslab train --resume {}",
            dir.display()
        ),
        single::TrainEnd::Finished(m) => {
            println!(
                "{}: {} steps, {} tokens, final train loss {:.4}, {:.0} tokens/s, {} parameters{}",
                m.name,
                m.steps,
                m.tokens,
                m.final_train_loss,
                m.tokens_per_second,
                m.params,
                if m.stopped_early {
                    format!(", stopped early (kept step {})", m.kept_step)
                } else {
                    String::new()
                }
            );
            for e in &m.evaluations {
                match &e.outcome {
                    Outcome::Scored { accuracy, loss } => {
                        println!("  test {:<10} accuracy {:5.1}%  loss {loss:.4}", e.name, 100.0 * accuracy)
                    }
                    Outcome::Unavailable { reason } => println!("  test {:<10} n/a: {reason}", e.name),
                }
            }
            for note in &m.notes {
                println!("  note: {note}");
            }
            println!("model folder: {} (config.json, model.safetensors, tokenizer.json, metrics.json)", dir.display());
            println!("try it: poslab predict --run {} \"your text here\"", dir.display());
        }
    }
    Ok(())
}

/// Texts from the arguments and from `--input` (a file, or `-` for standard input).
fn gather_texts(mut texts: Vec<String>, input: Option<PathBuf>) -> Result<Vec<String>> {
    if let Some(path) = input {
        let content = if path.as_os_str() == "-" {
            std::io::read_to_string(std::io::stdin()).context("reading standard input")?
        } else {
            std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?
        };
        texts.extend(
            content
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(String::from),
        );
    }
    if texts.is_empty() {
        anyhow::bail!(
            "no text given: pass texts as arguments or --input FILE (- for standard input)"
        );
    }
    Ok(texts)
}

fn load_model(dir: &Path, compute: &Compute) -> Result<poslab::saved::Loaded> {
    let device = poslab::device::parse_device(&compute.device)?;
    poslab::saved::load_as(dir, DType::F32, &device, compute.dtype)
        .with_context(|| format!("loading the model in {}", dir.display()))
}

fn predict(
    run: &Path,
    texts: Vec<String>,
    input: Option<PathBuf>,
    json: bool,
    top_k: usize,
    truncate: bool,
    compute: &Compute,
) -> Result<()> {
    let texts = gather_texts(texts, input)?;
    let loaded = load_model(run, compute)?;
    let outputs = Predictor::new(&loaded, truncate).predict(&texts, top_k.max(1))?;
    for (i, out) in outputs.iter().enumerate() {
        if let Some(note) = &out.note {
            eprintln!("text {}: {note}", i + 1);
        }
        if json {
            println!("{}", serde_json::to_string(out)?);
            continue;
        }
        match &out.value {
            Prediction::Class {
                label,
                probabilities,
            } => {
                let others: Vec<String> = probabilities
                    .iter()
                    .skip(1)
                    .take(3)
                    .map(|s| format!("{} {:.3}", s.label, s.probability))
                    .collect();
                println!(
                    "{label}\t{:.3}\t{}\t({})",
                    probabilities[0].probability,
                    out.text,
                    others.join(", ")
                );
            }
            Prediction::Tags { words, tags } => {
                let pairs: Vec<String> = words
                    .iter()
                    .zip(tags)
                    .map(|(w, t)| format!("{w}/{t}"))
                    .collect();
                println!("{}", pairs.join(" "));
            }
            Prediction::Fills { masks } => {
                println!("{}", out.text);
                for m in masks {
                    let fills: Vec<String> = m
                        .fills
                        .iter()
                        .map(|f| format!("{} {:.3}", f.label, f.probability))
                        .collect();
                    println!("  word {}: {}", m.word + 1, fills.join(", "));
                }
            }
        }
    }
    Ok(())
}

fn embed(
    run: &Path,
    texts: Vec<String>,
    input: Option<PathBuf>,
    truncate: bool,
    compute: &Compute,
) -> Result<()> {
    let texts = gather_texts(texts, input)?;
    let loaded = load_model(run, compute)?;
    for (i, out) in Predictor::new(&loaded, truncate)
        .embed(&texts)?
        .iter()
        .enumerate()
    {
        if let Some(note) = &out.note {
            eprintln!("text {}: {note}", i + 1);
        }
        println!("{}", serde_json::to_string(out)?);
    }
    Ok(())
}

struct AnalyzeArgs {
    scheme: Option<String>,
    run: Option<PathBuf>,
    dim: usize,
    base: f64,
    layout: String,
    pairing: String,
    positions: usize,
    start: usize,
    reference: usize,
    bases: Vec<f64>,
    text: Option<PathBuf>,
    texts: usize,
    out: Option<PathBuf>,
}

/// A `snake_case` option parsed like the configs parse it (same names, same error).
fn parse_option<T: serde::de::DeserializeOwned>(what: &str, value: &str) -> Result<T> {
    serde_json::from_value(serde_json::Value::String(value.into()))
        .with_context(|| format!("--{what} {value}"))
}

fn analyze(a: AnalyzeArgs) -> Result<()> {
    use poslab::analysis::{self, Table};
    if a.positions < 2 {
        anyhow::bail!(
            "--positions {} is too few: analyse at least 2 positions",
            a.positions
        );
    }
    if !(a.base.is_finite() && a.base > 1.0) || a.bases.iter().any(|b| !(b.is_finite() && *b > 1.0))
    {
        anyhow::bail!("bases must be finite numbers greater than 1");
    }
    let mut options = analysis::Options {
        reference: a.reference,
        bases: a.bases.clone(),
        seed: 0,
        rope: false,
    };
    let mut summary = String::new();
    let mut files = Vec::new();
    let (table, label, loaded) = match (&a.scheme, &a.run) {
        (_, Some(dir)) => {
            let loaded = load_model(
                dir,
                &Compute {
                    device: "cpu".into(),
                    dtype: Some(poslab::Precision::F32),
                },
            )?;
            let m = &loaded.config.model;
            let table = match &m.positional {
                PositionalConfig::Learned(_) => {
                    let w = loaded
                        .params
                        .get("pos_emb.weight")
                        .context("the model's learned table `pos_emb.weight`")?;
                    let values = w.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                    Some(Table {
                        title: format!("learned table of {}", dir.display()),
                        start: 0,
                        rows: m.max_len,
                        dim: m.d_model,
                        values,
                        pairs: None,
                    })
                }
                other => analysis::fixed_table(other, m.d_model, m.head_dim(), a.positions),
            };
            options.rope = matches!(m.positional, PositionalConfig::Rope(_));
            let name = dir
                .file_name()
                .map_or("run".into(), |n| n.to_string_lossy().into_owned());
            (table, name, Some(loaded))
        }
        (Some(scheme), None) => {
            if a.dim < 2 || a.dim % 2 != 0 {
                anyhow::bail!(
                    "--dim {} must be even (a table of (sin, cos) pairs) and at least 2",
                    a.dim
                );
            }
            let table = if scheme == "rope" {
                options.rope = true;
                Table::rope(
                    a.dim,
                    a.base,
                    parse_option("pairing", &a.pairing)?,
                    a.positions,
                )
            } else {
                Table::sinusoidal(
                    a.dim,
                    a.base,
                    parse_option("layout", &a.layout)?,
                    a.positions,
                    a.start,
                )
            };
            (Some(table), scheme.clone(), None)
        }
        (None, None) => unreachable!("clap requires a scheme or --run"),
    };
    let dir = match &a.out {
        Some(dir) => dir.clone(),
        None => experiment::new_run_dir(Path::new("runs"), &format!("analysis-{label}"))?,
    };
    match &table {
        Some(table) => {
            let result = analysis::analyze(table, &options);
            summary.push_str(&result.summary());
            files.extend(result.write(table, &dir)?);
        }
        None => {
            summary.push_str("no position table: this model has no positional scheme (`none`)\n")
        }
    }
    if let Some(loaded) = &loaded {
        match &loaded.config.model.positional {
            PositionalConfig::SinusoidalAdd(_) | PositionalConfig::Learned(_) => {
                let batch = analysis::terms::evaluation_batch(loaded, a.texts, a.text.as_deref());
                match batch {
                    // Without --text, a model that cannot remake its evaluation text still gets
                    // its table analysed.
                    Err(e) if a.text.is_none() => summary.push_str(&format!("attention terms skipped: {e}\n")),
                    Err(e) => return Err(e.into()),
                    Ok((ids, mask, cut)) => {
                        let terms = analysis::terms::attention_terms(loaded, &ids, &mask)?;
                        summary.push_str(&format!(
                            "attention logits (W_q(x+p))·(W_k(y+p')) split into four terms, on {} texts{}:\n",
                            ids.dim(0)?,
                            if cut > 0 { format!(" ({cut} cut to the learned table)") } else { String::new() }
                        ));
                        summary.push_str(&analysis::terms::summary(&terms));
                        files.extend(analysis::write_terms(&terms, "attention logits: content and position terms per head", &dir)?);
                    }
                }
            }
            other => summary.push_str(&format!(
                "attention terms: not defined for `{}` (positions are not added to the token embeddings)\n",
                other.name()
            )),
        }
        poslab::io::write_atomic(&dir.join("summary.txt"), summary.as_bytes())?;
    }
    print!("{summary}");
    println!("files in {}: {}", dir.display(), files.join(", "));
    Ok(())
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
    rounds: usize,
}

fn bench(args: BenchArgs) -> Result<()> {
    if let Some(n) = args.threads {
        // candle reads this at every matrix multiply; set before any tensor work.
        std::env::set_var("RAYON_NUM_THREADS", n.max(1).to_string());
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
        poslab::bench::VARIANTS[..5]
            .iter()
            .map(|s| s.to_string())
            .collect()
    } else {
        args.variants.clone()
    };
    for v in &variants {
        args.shape.positional(v)?;
    }
    let threads = candle::utils::get_num_threads();
    let shape = &args.shape;
    let child = args.in_process && args.json;
    if !child {
        eprintln!(
            "poslab bench on {} ({threads} thread{}, {} kernels, {:?} SIMD): vocab {}, width {}, {} heads, {} layers, FFN {}, batch {} x {}",
            poslab::device::device_name(&device),
            if threads == 1 { "" } else { "s" },
            poslab::nn::current_kernels().name(),
            poslab::nn::simd_level(),
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
        for (flag, value) in [
            ("--vocab", shape.vocab),
            ("--d-model", shape.d_model),
            ("--heads", shape.n_heads),
            ("--layers", shape.n_layers),
            ("--ffn", shape.ffn_dim),
            ("--batch", shape.batch),
            ("--seq", shape.seq),
            ("--warmup", args.warmup),
            ("--forward-reps", args.forward_reps),
            ("--train-reps", args.train_reps),
            ("--threads", threads),
        ] {
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
        "threads": threads,
        "kernels": poslab::nn::current_kernels().name(),
        "simd": format!("{:?}", poslab::nn::simd_level()),
        "shape": shape,
    });

    if let Some(script) = &args.torch {
        if !script.is_file() {
            anyhow::bail!(
                "--torch {}: no such file (it is shared/bench/torch_reference.py)",
                script.display()
            );
        }
        let torch = |variant: &str| -> Result<poslab::bench::TorchRecord> {
            eprintln!("  {variant}: PyTorch");
            let out = std::process::Command::new(&args.python)
                .arg(script)
                .arg(variant)
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
        for round in 0..args.rounds.max(1) {
            eprintln!("round {} of {}", round + 1, args.rounds.max(1));
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
            println!("{}", serde_json::to_string_pretty(&doc)?);
        } else {
            print!("{}", poslab::bench::ratio_table(&ratios));
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
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", poslab::bench::table(&records));
    }
    Ok(())
}

fn merge_reports(runs: &[PathBuf], out: Option<PathBuf>) -> Result<()> {
    let loaded = runs
        .iter()
        .map(|d| {
            let (r, t) = report::load_run(d)?;
            Ok((d.clone(), r, t))
        })
        .collect::<Result<Vec<_>>>()?;
    let (results, timings) = report::merge(loaded)?;
    let dir = match out {
        Some(dir) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            dir
        }
        None => {
            experiment::new_run_dir(Path::new("runs"), &format!("{}-report", results.experiment))?
        }
    };
    let table = report::write_report(&dir, &results, &timings, runs)?;
    println!("{table}");
    println!(
        "merged {} run folders ({} cells) into {}",
        runs.len(),
        results.cells.len(),
        dir.display()
    );
    Ok(())
}

/// Parameters by group, from the names in the store.
fn parameter_groups(config: &ModelConfig) -> Result<Vec<(&'static str, usize)>> {
    let store = ParamStore::new(0);
    Encoder::new(config, store.var_builder(DType::F32, &Device::Cpu))?;
    let mut groups = vec![
        ("token embedding", 0),
        ("position table", 0),
        ("attention", 0),
        ("feed-forward", 0),
        ("layer norms", 0),
    ];
    for (name, var) in store.vars() {
        let group = if name.starts_with("tok_emb") {
            0
        } else if name.starts_with("pos_") {
            1
        } else if name.contains(".attn.") {
            2
        } else if name.contains(".ffn.") {
            3
        } else {
            4
        };
        groups[group].1 += var.elem_count();
    }
    Ok(groups)
}

fn describe(positional: &PositionalConfig, config: &ModelConfig) -> String {
    let d = config.d_model;
    match positional {
        PositionalConfig::None(_) => "no positions (the bag-of-words control)".into(),
        PositionalConfig::SinusoidalAdd(o) => format!(
            "input side: tokens + sinusoid ({d} wide, base {}, {} layout)",
            o.base, o.layout
        ),
        PositionalConfig::SinusoidalConcat(o) if o.project => format!(
            "input side: [tokens {d} ; sinusoid {}] projected back to {d} (base {}, {} layout)",
            o.pos_dim, o.base, o.layout
        ),
        PositionalConfig::SinusoidalConcat(o) => format!(
            "input side: [tokens {} ; sinusoid {}] = {d} (base {}, {} layout)",
            d - o.pos_dim,
            o.pos_dim,
            o.base,
            o.layout
        ),
        PositionalConfig::Learned(o) => format!(
            "input side: tokens + learned table ({} x {d}, init N(0, {:.4}))",
            config.max_len, o.init_std
        ),
        PositionalConfig::Rope(o) => format!(
            "attention side: q and k rotated in every layer (head {}, base {}, {} pairing)",
            config.head_dim(),
            o.base,
            o.pairing
        ),
    }
}

fn inspect(path: &Path) -> Result<()> {
    let config = ModelConfig::load(path)?;
    println!("{}: valid", path.display());
    println!(
        "shape: {} layers, d_model {}, {} heads of {}, FFN {}, {}-norm, vocab {}, max_len {}",
        config.n_layers,
        config.d_model,
        config.n_heads,
        config.head_dim(),
        config.ffn_dim,
        config.norm,
        config.vocab_size,
        config.max_len
    );
    println!(
        "dropout {} (embeddings, residual branches), {} (attention weights); embed_scale {}, token init std {}",
        config.dropout, config.attention_dropout, config.embed_scale, config.token_init_std
    );
    if config.dtype.is_half() {
        println!(
            "activations: {} (mixed precision; weights, positional tables, softmax and LayerNorm statistics in f32)",
            config.dtype
        );
    }
    println!("positional: {}", describe(&config.positional, &config));

    // The same shape under each scheme, with the configured options where they apply.
    let pos_dim = match &config.positional {
        PositionalConfig::SinusoidalConcat(o) => o.pos_dim,
        _ => (config.d_model / 4).max(2) & !1,
    };
    let schemes = [
        PositionalConfig::None(NoOptions {}),
        PositionalConfig::SinusoidalAdd(SinusoidalOptions::default()),
        PositionalConfig::SinusoidalConcat(ConcatOptions {
            pos_dim,
            base: poslab::positional::DEFAULT_BASE,
            layout: Default::default(),
            project: false,
        }),
        PositionalConfig::SinusoidalConcat(ConcatOptions {
            pos_dim,
            base: poslab::positional::DEFAULT_BASE,
            layout: Default::default(),
            project: true,
        }),
        PositionalConfig::Learned(LearnedOptions::default()),
        PositionalConfig::Rope(RopeOptions::default()),
    ];
    println!("\nparameters of this shape under each scheme:");
    println!(
        "  {:<40} {:>10} {:>10} {:>10} {:>10} {:>8} {:>11}  where",
        "scheme", "tokens", "positions", "attention", "ffn", "norms", "total"
    );
    for positional in schemes {
        let label = match &positional {
            PositionalConfig::SinusoidalConcat(o) if o.project => {
                format!("sinusoidal_concat (pos_dim {pos_dim}, project)")
            }
            PositionalConfig::SinusoidalConcat(_) => {
                format!("sinusoidal_concat (pos_dim {pos_dim})")
            }
            other => other.name().to_string(),
        };
        let marker = if positional == config.positional {
            "*"
        } else {
            " "
        };
        let variant = ModelConfig {
            positional,
            ..config.clone()
        };
        let where_ = match variant.positional.placement() {
            Placement::Nowhere => "nowhere",
            Placement::Input => "input",
            Placement::Attention => "attention",
        };
        match variant.validate() {
            Err(e) => println!("{marker} {label:<40} cannot be built at this shape: {e}"),
            Ok(()) => {
                let groups =
                    parameter_groups(&variant).with_context(|| format!("building {label}"))?;
                let total: usize = groups.iter().map(|g| g.1).sum();
                println!(
                    "{marker} {label:<40} {:>10} {:>10} {:>10} {:>10} {:>8} {:>11}  {where_}",
                    groups[0].1, groups[1].1, groups[2].1, groups[3].1, groups[4].1, total
                );
            }
        }
    }
    println!(
        "\nFixed tables (sinusoids, RoPE cos/sin) are computed, not trained, and are not counted. \
         A key bias exists only under rope: without it softmax cancels a key bias exactly."
    );
    Ok(())
}
