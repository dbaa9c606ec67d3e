//! `poslab inspect`: a model config validated and described.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle::{DType, Device};
use poslab::positional::DEFAULT_BASE;
use poslab::render::table::TextTable;
use poslab::runs;
use poslab::runs::folder::{self, FolderKind};
use poslab::runs::{merge, ExperimentConfig, Selection};
use poslab::{Encoder, ModelConfig, ParamStore, PositionalConfig};

/// Validate a config and say what it holds: a model config (its shape, where positions act,
/// and the parameters of the same shape under every scheme), an experiment config (its cells),
/// a train config; or a folder: a compare run (its cells done and how to continue it), a
/// report, a train run, a trained model.
#[derive(clap::Args)]
pub struct Args {
    /// A model, experiment or train config (TOML; a model config may be JSON), or a run, report
    /// or model folder. Default: configs/encoder.toml, embedded in the binary.
    #[arg(conflicts_with = "model", value_name = "CONFIG_OR_FOLDER")]
    pub config: Option<PathBuf>,
    /// A pretrained BERT-family encoder (a Hugging Face folder or Hub id): loaded, checked, and
    /// described as the poslab encoder it becomes.
    #[arg(long, value_name = "PATH_OR_HUB_ID")]
    pub model: Option<String>,
}

/// The embedded default, `configs/encoder.toml`.
const DEFAULT_CONFIG: &str = include_str!("../../configs/encoder.toml");

pub fn run(args: Args) -> Result<()> {
    if let Some(spec) = &args.model {
        return inspect_pretrained(spec);
    }
    let Some(path) = &args.config else {
        return describe_config(
            ModelConfig::from_toml_str(DEFAULT_CONFIG)?,
            "configs/encoder.toml (embedded default)".to_string(),
        );
    };
    if path.is_dir() {
        return describe_folder(path);
    }
    let text = poslab::io::read_text_bounded(path, poslab::io::MAX_CONFIG_BYTES, "config")?;
    // What the file holds, by its top-level keys: an experiment has [[variants]] (or
    // [[tasks]]), a train config a [task]; anything else is read as a model config.
    let keys: Vec<String> = text
        .parse::<toml::Table>()
        .map(|t| t.keys().cloned().collect())
        .unwrap_or_default();
    let has = |k: &str| keys.iter().any(|x| x == k);
    if has("variants") || has("tasks") {
        describe_experiment(path)
    } else if has("task") {
        describe_train_config(path)
    } else {
        describe_config(ModelConfig::load(path)?, path.display().to_string())
    }
}

/// An experiment config: what it runs, how many cells, and how to check it all.
fn describe_experiment(path: &Path) -> Result<()> {
    let config = ExperimentConfig::load(path)?;
    config.check_limits(&super::limits()?)?;
    let cells = config.cells(&Selection::default())?.len();
    outln!(
        "{}: a valid experiment config (for poslab compare), `{}`: {} task{} x {} variant{} x {} \
         seed{} = {cells} cells",
        path.display(),
        config.name,
        config.tasks.len(),
        super::plural(config.tasks.len()),
        config.variants.len(),
        super::plural(config.variants.len()),
        config.seeds,
        super::plural(config.seeds as usize)
    );
    let m = &config.model;
    outln!(
        "model: {} layers, d_model {}, {} heads, FFN {} ({}), {}-norm, {}",
        m.n_layers,
        m.d_model,
        m.n_heads,
        m.ffn_dim,
        if m.activation.is_gelu() {
            "gelu"
        } else {
            "relu"
        },
        m.norm,
        m.dtype
    );
    outln!(
        "train: {}, batch {}, lr {}",
        budget(&config.train),
        config.train.batch_size,
        config.train.lr
    );
    for task in &config.tasks {
        outln!("task {}", task_line(task));
    }
    for v in &config.variants {
        outln!(
            "variant {}: {} ({}){}{}",
            v.name,
            v.positional.name(),
            v.positional.placement(),
            v.random_positions.map_or(String::new(), |n| format!(
                ", randomized positions from [0, {n})"
            )),
            match v.causal.unwrap_or(config.model.causal) {
                true => ", causal",
                false => "",
            }
        );
    }
    outln!(
        "seeds: {}..{}; config SHA-256 {} (what its run folders record)",
        config.first_seed,
        config.first_seed + config.seeds - 1,
        folder::config_sha256(&config)
    );
    outln!(
        "check every cell (its data, model and memory) and estimate its cost: poslab compare {} \
         --dry-run [--shard K/N]",
        path.display()
    );
    Ok(())
}

/// A task's name, its kind where that differs, and the lengths it is tested at.
fn task_line(task: &poslab::tasks::TaskSpec) -> String {
    let ranges = task.test_ranges();
    format!(
        "{}{}{}",
        task.name,
        if task.kind.name() == task.name {
            String::new()
        } else {
            format!(" ({})", task.kind.name())
        },
        if ranges.is_empty() {
            String::new()
        } else {
            format!(
                ": tested at lengths {}",
                ranges
                    .iter()
                    .map(|[a, b]| format!("{a}-{b}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    )
}

/// A `poslab train` config.
fn describe_train_config(path: &Path) -> Result<()> {
    let config = runs::train_run::TrainRunConfig::load(path)?;
    config.check_limits(&super::limits()?)?;
    outln!(
        "{}: a valid train config (for poslab train), run `{}`, seed {}",
        path.display(),
        config.name,
        config.seed
    );
    describe_train(&config);
    outln!("run it: poslab train --config {}", path.display());
    Ok(())
}

fn describe_train(config: &runs::train_run::TrainRunConfig) {
    use std::io::Write as _;
    let mut out = std::io::stdout();
    let model = match (&config.init, &config.positional) {
        (Some(init), _) => format!("fine-tunes the pretrained {}", init.model),
        (None, Some(p)) => format!("positional {} ({})", p.name(), p.placement()),
        (None, None) => "no model".into(),
    };
    let _ = writeln!(
        out,
        "task {} ({}); {model}; {}, checkpoint every {} steps",
        config.task.name,
        config.task.kind.name(),
        budget(&config.train),
        config.checkpoint_every
    );
}

/// A folder: a compare run, a report, a train run or a trained model.
fn describe_folder(dir: &Path) -> Result<()> {
    let busy = match poslab::io::FolderLock::shared(dir) {
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    };
    if let Some(manifest) = folder::read_manifest(dir)? {
        describe_run_folder(dir, &manifest)?;
    } else if dir.join(runs::train_run::TRAIN_CONFIG).is_file() {
        describe_train_folder(dir)?;
    } else if dir.join(poslab::saved::CONFIG).is_file() && !poslab::pretrained::is_hf_folder(dir) {
        let loaded = poslab::saved::load(dir, DType::F32, &Device::Cpu)?;
        let c = &loaded.config;
        outln!(
            "{}: a trained poslab model: task {}, seed {}, {} parameters; predict, embed and \
             analyze read it with --run {}\n",
            dir.display(),
            c.task,
            c.seed,
            loaded.params.num_params(),
            dir.display()
        );
        return describe_config(c.model.clone(), "its encoder".into());
    } else if poslab::pretrained::is_hf_folder(dir) {
        anyhow::bail!(
            "{} is a Hugging Face model folder: inspect it with --model {}",
            dir.display(),
            dir.display()
        );
    } else {
        anyhow::bail!(
            "{} holds no poslab run, report or model (no run.json, train.toml or config.json)",
            dir.display()
        );
    }
    if let Some(busy) = busy {
        outln!("now: {busy}");
    }
    Ok(())
}

/// A compare run folder or a report, as its manifest describes it.
fn describe_run_folder(dir: &Path, manifest: &folder::Manifest) -> Result<()> {
    let config = folder::load_run_config(dir)?;
    outln!(
        "{}: {} of experiment `{}` (config SHA-256 {:.16}…)",
        dir.display(),
        folder::describe(manifest),
        config.name,
        manifest.config_sha256
    );
    match manifest.kind {
        FolderKind::Compare => {
            let cells = config.cells(&manifest.selection.selection()?)?;
            let done = folder::cells_done(dir, &config, &cells);
            let finished = dir.join(folder::RESULTS_JSON).is_file();
            outln!(
                "cells: {done} of {} done{}",
                cells.len(),
                if finished {
                    "; finished (results.json, report.md)"
                } else {
                    ""
                }
            );
            if !finished {
                // A run resumes with the kernels it began with.
                let kernels = match manifest.kernels.as_deref() {
                    Some(k) if k != poslab::nn::Backend::default().kernels.name() => {
                        format!(" --kernels {k}")
                    }
                    _ => String::new(),
                };
                outln!(
                    "unfinished: continue it with poslab compare {} --out {}{}{kernels} (the \
                     same command continues it)",
                    dir.join(folder::CONFIG_TOML).display(),
                    dir.display(),
                    manifest.selection.flags()
                );
            }
        }
        FolderKind::Report => {
            for s in &manifest.sources {
                outln!("  merged: {s}");
            }
            match merge::load_run(dir) {
                Ok((results, _)) => match &results.partial {
                    Some(p) => outln!("{p}: missing {}", p.missing.join(", ")),
                    None => outln!("complete: {} cells", results.cells.len()),
                },
                Err(_) => outln!("unfinished: no results.json (run the merge again)"),
            }
        }
    }
    Ok(())
}

/// A `poslab train` run folder: finished, or where it would resume.
fn describe_train_folder(dir: &Path) -> Result<()> {
    let config = runs::train_run::TrainRunConfig::load(dir.join(runs::train_run::TRAIN_CONFIG))?;
    outln!("{}: a poslab train run, `{}`", dir.display(), config.name);
    describe_train(&config);
    if dir.join(runs::train_run::METRICS).is_file() {
        outln!("finished: metrics.json and the model (config.json, model.safetensors)");
    } else if let Some(why) = runs::train_run::stopped(dir) {
        outln!(
            "stopped for good: {why}; resuming would stop at the same step, so start a changed \
             config into another --out"
        );
    } else {
        outln!(
            "unfinished: {}; continue it with poslab train --resume {}",
            match runs::train_run::latest_checkpoint_step(dir) {
                Some(step) => format!("latest checkpoint at step {step}"),
                None => "no checkpoint yet".into(),
            },
            dir.display()
        );
    }
    Ok(())
}

/// `600 steps` or `1000000 tokens`.
fn budget(train: &poslab::train::TrainConfig) -> String {
    match train.budget {
        poslab::train::Budget::Steps(n) => format!("{n} steps"),
        poslab::train::Budget::Tokens(n) => format!("{n} tokens"),
    }
}

/// `--model`: a pretrained encoder, loaded and described.
fn inspect_pretrained(spec: &str) -> Result<()> {
    let compute = super::Compute {
        device: poslab::device::DeviceSpec::Cpu,
        dtype: None,
        threads: None,
        kernels: None,
    };
    let model = super::load_pretrained(spec, &compute)?;
    let modern = model.family == poslab::pretrained::Family::ModernBert;
    outln!(
        "{spec}: a `{}` model, every tensor of model.safetensors mapped ({})",
        model.hf.model_type,
        if modern {
            "src/pretrained/modernbert.rs: Wqkv split into q, k and v"
        } else {
            "src/pretrained/names.rs"
        }
    );
    match model.family {
        poslab::pretrained::Family::Bert | poslab::pretrained::Family::DistilBert => {
            outln!("positions: 0, 1, 2, ...")
        }
        poslab::pretrained::Family::Roberta { padding_idx } => outln!(
            "positions: from {} (padding_idx + 1), padded tokens at {padding_idx}",
            padding_idx + 1
        ),
        poslab::pretrained::Family::ModernBert => outln!(
            "positions: no table; q and k rotated (RoPE, half pairing) in every layer, a base \
             per kind of layer (src/pretrained/modernbert.rs)"
        ),
    }
    outln!(
        "texts: at most {} tokens, special tokens included (--truncate cuts longer ones)",
        model.max_tokens()
    );
    outln!(
        "masked-LM head: {}",
        if model.mlm.is_some() {
            "yes (dense, GELU, LayerNorm, decoder tied to the word embeddings): predict --model fills masks"
        } else {
            "no (an encoder only): embed and analyze, not predict"
        }
    );
    outln!(
        "parameters: {} loaded{}\n",
        model.params.num_params(),
        if modern {
            " (no biases; GeGLU feed-forwards; no attention norm in layer 0)"
        } else {
            " (the file's pooler and attention key biases change no output and are left out)"
        }
    );
    describe_config(model.encoder.config().clone(), "as a poslab encoder".into())
}

/// The shape, where positions act, and the parameters of this shape under every scheme.
fn describe_config(config: ModelConfig, source: String) -> Result<()> {
    let limits = super::limits()?;
    config.check_limits(&limits)?;
    outln!("{source}: valid");
    describe_shape(&config)?;
    if let Some(plan) = &config.layers {
        describe_layers(&config, plan)?;
    }
    describe_inputs(&config)?;
    scheme_table(&config, &limits)
}

/// Sizes, dropout, dtype, the scheme and where it acts.
fn describe_shape(config: &ModelConfig) -> Result<()> {
    outln!(
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
    outln!(
        "dropout {} (embeddings, residual branches), {} (attention weights); embed_scale {}, token init std {}",
        config.dropout, config.attention_dropout, config.embed_scale, config.token_init_std
    );
    if config.causal {
        outln!(
            "causal: every query sees the keys at or before it only (a decoder's mask, in every layer)"
        );
    }
    if config.dtype.is_half() {
        outln!(
            "activations: {} (mixed precision; weights, positional tables, softmax and LayerNorm statistics in f32)",
            config.dtype
        );
    }
    outln!(
        "positional: {}",
        config.positional.scheme().describe(&config.scheme_shape())
    );
    outln!("where: {}", config.positional.placement());
    Ok(())
}

/// The layer plan, layer by layer.
fn describe_layers(config: &ModelConfig, plan: &poslab::layers::LayerPlan) -> Result<()> {
    outln!(
        "layers: {} of {} with positions; pattern [{}] repeated",
        config.scheme_shape().layers.count(config.n_layers),
        config.n_layers,
        plan.pattern
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    if plan.rope_base.is_some() {
        for (kind, local) in [("global", false), ("local", true)] {
            let scheme = config.layer_positional(local);
            outln!(
                "  {kind} layers: {}",
                scheme.scheme().describe(&config.scheme_shape())
            );
        }
    }
    for i in 0..config.n_layers {
        let spec = config.layer_spec(i);
        let scheme = match spec.positions {
            true => config.positional.name(),
            false => "no positions",
        };
        let keys = match spec.window {
            Some(w) => format!("keys within {} (window {w})", w / 2),
            None => "every key".into(),
        };
        outln!(
            "  layer {i:>2}  {:<10}  {scheme}; {keys}",
            plan.kind(i).name()
        );
    }
    Ok(())
}

/// Token types, an embedding norm, randomized positions.
fn describe_inputs(config: &ModelConfig) -> Result<()> {
    let extras = &config.embeddings;
    if !extras.is_none() {
        outln!(
            "embeddings: {} token types (type 0 added to every token){}",
            extras.token_types,
            if extras.norm {
                ", then a LayerNorm"
            } else {
                ""
            }
        );
    }
    if let Some(n) = config.random_positions {
        outln!(
            "positions: randomized, each sequence's drawn from [0, {n}) and sorted (Ruoss et al. 2023)"
        );
    }
    Ok(())
}

/// The parameters of this shape under every scheme, the configured one marked.
fn scheme_table(config: &ModelConfig, limits: &poslab::limits::Limits) -> Result<()> {
    // The same shape under each scheme, with the configured options where they apply.
    let pos_dim = match config.positional.scheme().pos_dim() {
        Some(pos_dim) => pos_dim,
        None => (config.d_model / 4).max(2) & !1,
    };
    let mut schemes = PositionalConfig::catalog(pos_dim);
    let label = |p: &PositionalConfig| p.scheme().label();
    // The configured scheme with its own options, in place of its default-options row.
    match schemes
        .iter()
        .position(|s| label(s) == label(&config.positional))
    {
        Some(i) => schemes[i] = config.positional.clone(),
        None => schemes.push(config.positional.clone()),
    }
    outln!("\nparameters of this shape under each scheme:");
    let mut table = TextTable::new(
        [
            "  scheme",
            "tokens",
            "positions",
            "attention",
            "ffn",
            "norms",
            "total",
            "where",
        ],
        [false, true, true, true, true, true, true, false],
    );
    for positional in schemes {
        let marker = if positional == config.positional {
            "*"
        } else {
            " "
        };
        table.push(scheme_row(config, positional, marker, limits)?);
    }
    out!("{}", table.text());
    outln!(
        "\nFixed tables (sinusoids, RoPE and p-RoPE cos/sin, ALiBi's slopes) are computed, not \
         trained, and are not counted. \"positions\" counts every weight a scheme's module holds: \
         learned tables, the concat projection, T5's bucket table, KERPLE's r1 and r2, FIRE's MLP, \
         c and l_multiplier, TUPE's U_q and U_k, FoX's gates. A key bias exists only under a \
         rotation (rope, prope): without one softmax cancels a key bias exactly."
    );
    Ok(())
}

/// A row of [`scheme_table`]: `config`'s shape under `positional`, its parameters by group, or
/// why it cannot be built.
fn scheme_row(
    config: &ModelConfig,
    positional: PositionalConfig,
    marker: &str,
    limits: &poslab::limits::Limits,
) -> Result<Vec<String>> {
    let label = positional.scheme().label();
    let where_ = positional.placement();
    // The same layer plan, without a rotation's bases for a scheme that has none.
    let layers = config.layers.clone().map(|mut plan| {
        if positional.with_base(DEFAULT_BASE).is_none() {
            plan.rope_base = None;
        }
        plan
    });
    let variant = ModelConfig {
        positional,
        layers,
        ..config.clone()
    };
    let name = format!("{marker} {label}");
    Ok(
        match variant
            .validate()
            .and_then(|()| variant.check_limits(limits))
        {
            Err(e) => [name]
                .into_iter()
                .chain(std::iter::repeat_n("-".to_string(), 6))
                .chain([format!("cannot be built at this shape: {e}")])
                .collect(),
            Ok(()) => {
                let groups =
                    parameter_groups(&variant).with_context(|| format!("building {label}"))?;
                let total: usize = groups.iter().map(|g| g.1).sum();
                [name]
                    .into_iter()
                    .chain(groups.iter().map(|g| g.1.to_string()))
                    .chain([total.to_string(), where_.to_string()])
                    .collect()
            }
        },
    )
}

/// Parameters by group: the scheme's own (as its module holds them), then the others by the
/// layer they belong to.
fn parameter_groups(config: &ModelConfig) -> Result<Vec<(&'static str, usize)>> {
    let store = ParamStore::new(0);
    let encoder = Encoder::new(config, store.var_builder(DType::F32, &Device::Cpu))?;
    let positional: std::collections::HashSet<_> = encoder
        .positional()
        .parameters()
        .iter()
        .map(|t| t.id())
        .collect();
    let mut groups = vec![
        ("token embedding", 0),
        ("positions", 0),
        ("attention", 0),
        ("feed-forward", 0),
        ("layer norms", 0),
    ];
    for (name, var) in store.vars() {
        let group = if positional.contains(&var.as_tensor().id()) {
            1
        } else if name.starts_with("tok_emb") || name.starts_with("type_emb") {
            0
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
