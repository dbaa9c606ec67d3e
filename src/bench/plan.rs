//! What `poslab bench` runs: every variant in a child process of its own (so its peak memory
//! is its own), interleaved rounds of variants or of poslab and PyTorch, and what they come to.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::{costs, ratios, Cost, Options, Ratio, Record, Shape, TorchRecord, TORCH_VARIANTS};
use crate::device::{device_name, gpu_name};
use crate::error::{Error, Result};

/// A bench: what to measure, and how.
pub struct Plan {
    /// The shape, variants, repetitions, device and backend of each measurement.
    pub options: Options,
    /// The device as the command line gave it (`auto`, `cpu`, `cuda:1`), passed on to children.
    pub device_flag: crate::device::DeviceSpec,
    /// Measure every variant in this process instead of a child each.
    pub in_process: bool,
    /// Interleaved rounds: of poslab and PyTorch with [`Plan::torch`], else of the variants.
    pub rounds: Option<usize>,
    /// The PyTorch script to run beside poslab.
    pub torch: Option<Torch>,
}

/// The project's own PyTorch encoder and its timer (`benches/torch_at_shape.py`), built into
/// the binary: `poslab bench --torch` with no path runs it from a temporary file.
pub const TORCH_SCRIPT: &str = include_str!("../../benches/torch_at_shape.py");

/// The PyTorch side of a bench: a script, and the Python that runs it.
pub struct Torch {
    /// The script: the built-in one's temporary file, `benches/torch_at_shape.py`, or the
    /// fixed-shape `shared/bench/torch_reference.py`.
    pub script: PathBuf,
    /// A Python with torch installed.
    pub python: PathBuf,
    /// Whether the script runs any shape, device and dtype (it takes `--d-model`); the shared
    /// reference runs one fixed shape in f32 on the CPU.
    takes_shape: bool,
    /// The variants the script runs, under `poslab bench`'s names.
    pub variants: Vec<String>,
    /// torch's version, as the script reported it (scripts that take the shape answer
    /// `--probe`).
    pub version: Option<String>,
    /// The built-in script's temporary file, removed when the bench is done.
    _built_in: Option<tempfile::TempPath>,
}

/// What `torch_at_shape.py --probe` prints.
#[derive(serde::Deserialize)]
struct Probe {
    torch: String,
    variants: Vec<String>,
}

impl Torch {
    /// The built-in script (`benches/torch_at_shape.py`) run by `python`, probed before anything
    /// runs.
    pub fn built_in(python: &Path, shape: &Shape, device: &candle::Device) -> Result<Self> {
        let mut file = tempfile::Builder::new()
            .prefix("poslab-torch-")
            .suffix(".py")
            .tempfile()
            .map_err(|e| Error::io(std::env::temp_dir(), e))?;
        std::io::Write::write_all(&mut file, TORCH_SCRIPT.as_bytes())
            .map_err(|e| Error::io(file.path(), e))?;
        let path = file.into_temp_path();
        let mut torch = Self::new(&path, python, shape, device)?;
        torch._built_in = Some(path);
        Ok(torch)
    }

    /// `script` run by `python`, checked before anything runs: it must exist, a script that
    /// takes the shape must import torch (it is asked for its variants), and a fixed-shape
    /// script is refused for another shape, device or dtype (the ratios would compare
    /// different work).
    pub fn new(
        script: &Path,
        python: &Path,
        shape: &Shape,
        device: &candle::Device,
    ) -> Result<Self> {
        if !script.exists() {
            return Err(Error::Input(format!(
                "--torch {}: no such file (give no path for poslab's own PyTorch model, \
                 benches/torch_at_shape.py; or shared/bench/torch_reference.py)",
                script.display()
            )));
        }
        if !script.is_file() {
            return Err(Error::Input(format!(
                "--torch {}: not a regular file (a folder, device or pipe): give the path of \
                 the PyTorch script",
                script.display()
            )));
        }
        let takes_shape =
            crate::io::read_text_bounded(script, crate::io::MAX_CONFIG_BYTES, "PyTorch script")?
                .contains("--d-model");
        let reference_setting = *shape == Shape::default() && device.is_cpu();
        if !takes_shape && !reference_setting {
            return Err(Error::Input(format!(
                "--torch {} runs PyTorch on the CPU in f32 at its own fixed shape (width 256, 4 \
                 heads, 4 layers, FFN 1024, batch 32 x 128), but this bench runs {} in {} at \
                 {}: the ratios would compare different work. Use --torch with no path, which \
                 runs poslab's own PyTorch model (benches/torch_at_shape.py) at this shape, \
                 device and dtype",
                script.display(),
                device_name(device),
                shape.dtype.name(),
                shape.describe()
            )));
        }
        let (version, variants) = match takes_shape {
            true => {
                let probe = Self::probe(script, python)?;
                (Some(probe.torch), probe.variants)
            }
            false => (None, TORCH_VARIANTS.map(String::from).to_vec()),
        };
        Ok(Self {
            script: script.into(),
            python: python.into(),
            takes_shape,
            variants,
            version,
            _built_in: None,
        })
    }

    /// `script --probe`: torch's version and the script's variants, or the script's own words
    /// on why not (torch missing, most often).
    fn probe(script: &Path, python: &Path) -> Result<Probe> {
        let out = Command::new(python)
            .arg(script)
            .arg("--probe")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| {
                Error::Input(format!(
                    "--python {}: cannot run it ({e}): pass a Python with torch installed",
                    python.display()
                ))
            })?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let why = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("no message");
            return Err(Error::Input(format!(
                "--torch: {} {} --probe failed: {why} (pass --python for another Python)",
                python.display(),
                script.display()
            )));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().rev().find(|l| l.trim_start().starts_with('{'));
        line.and_then(|l| serde_json::from_str::<Probe>(l).ok())
            .ok_or_else(|| {
                Error::Input(format!(
                    "--torch {}: its --probe printed no {{\"torch\": ..., \"variants\": [...]}} \
                     line",
                    script.display()
                ))
            })
    }
}

impl Torch {
    /// Whether the script times products (`--products`): the fixed-shape reference does not.
    pub fn check_products(&self) -> Result<()> {
        match self.takes_shape {
            true => Ok(()),
            false => Err(Error::Input(format!(
                "--products --torch {}: that script runs one fixed model and has no --products \
                 mode; give --torch no path (poslab's own benches/torch_at_shape.py)",
                self.script.display()
            ))),
        }
    }

    /// One round of PyTorch's rates, in GFLOP/s by [`super::products::Product::name`], for the
    /// step's matrix products at `shape` (`torch_at_shape.py --products`: `torch.matmul`'s
    /// products as its autograd runs them, best of `reps` after `warm`), on `threads` threads.
    pub fn products(
        &self,
        shape: &Shape,
        threads: usize,
        warm: usize,
        reps: usize,
    ) -> Result<std::collections::BTreeMap<String, f64>> {
        self.check_products()?;
        let mut cmd = Command::new(&self.python);
        cmd.arg(&self.script).arg("--products");
        for (flag, value) in shape.flags() {
            cmd.args([flag.to_string(), value.to_string()]);
        }
        cmd.args(["--train-iters", &reps.max(1).to_string()])
            .args(["--warm", &warm.to_string()])
            .args(["--threads", &threads.to_string()]);
        #[derive(serde::Deserialize)]
        struct Rates {
            products: std::collections::BTreeMap<String, f64>,
        }
        let line = self.json_line(&mut cmd, "with --products")?;
        serde_json::from_str::<Rates>(&line)
            .map(|r| r.products)
            .map_err(|e| {
                Error::Input(format!(
                    "the PyTorch script {} --products printed no {{\"products\": {{...}}}} \
                     line ({e})",
                    self.script.display()
                ))
            })
    }

    /// Runs `cmd` (this script, its stderr shown) and returns the last line of its output that
    /// opens a JSON object; `what` says which run in the errors.
    fn json_line(&self, cmd: &mut Command, what: &str) -> Result<String> {
        let out = cmd
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| Error::io(&self.python, e))?;
        if !out.status.success() {
            return Err(Error::Input(format!(
                "the PyTorch script {} failed {what} ({}): its own message is above",
                self.script.display(),
                out.status
            )));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .rev()
            .find(|l| l.trim_start().starts_with('{'))
            .map(str::to_string)
            .ok_or_else(|| {
                Error::Input(format!(
                    "the PyTorch script {} printed no JSON line {what}",
                    self.script.display()
                ))
            })
    }
}

/// What a bench measured.
pub enum Outcome {
    /// One record per variant.
    Records(Vec<Record>),
    /// Each variant's cost over the first, from interleaved rounds of the variants.
    Costs {
        /// Per variant.
        costs: Vec<Cost>,
        /// Every round's records.
        rounds: Vec<Vec<Record>>,
    },
    /// poslab over PyTorch per variant, from interleaved rounds of the two.
    Ratios {
        /// Per variant.
        ratios: Vec<Ratio>,
        /// Every round's pairs.
        rounds: Vec<Vec<(Record, TorchRecord)>>,
    },
}

impl Outcome {
    /// The printed table.
    pub fn table(&self) -> String {
        match self {
            Outcome::Records(records) => super::table(records),
            Outcome::Costs { costs, rounds } => {
                let variants: Vec<String> = costs.iter().map(|c| c.variant.clone()).collect();
                super::cost_table(costs)
                    + &super::best_round_shares(&variants, rounds.iter().flatten())
            }
            Outcome::Ratios { ratios, rounds } => {
                let variants: Vec<String> = ratios.iter().map(|r| r.variant.clone()).collect();
                let poslab = rounds.iter().flatten().map(|(r, _)| r);
                super::ratio_table(ratios) + &super::best_round_shares(&variants, poslab)
            }
        }
    }

    /// The JSON document: `header` (see [`Plan::header`]) with the results.
    pub fn json(&self, mut header: serde_json::Value) -> serde_json::Value {
        match self {
            Outcome::Records(records) => header["results"] = value(records),
            Outcome::Costs { costs, rounds } => {
                header["costs"] = value(costs);
                header["rounds"] = value(rounds);
            }
            Outcome::Ratios { ratios, rounds } => {
                header["ratios"] = value(ratios);
                header["rounds"] = value(rounds);
            }
        }
        header
    }
}

fn value<T: serde::Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).expect("bench records serialize")
}

impl Plan {
    /// The variants a bench runs when none are named: every scheme with its default options
    /// but `none` (with PyTorch, those its script runs), where the shape allows it. A shape
    /// that no variant fits is refused with the first one's reason.
    pub fn default_variants(
        shape: &Shape,
        torch: Option<&Torch>,
        limits: &crate::limits::Limits,
        compute: crate::nn::Compute<'_>,
    ) -> Result<Vec<String>> {
        let pool: Vec<String> = match torch {
            Some(torch) => torch.variants.clone(),
            None => shape.variant_names(),
        };
        let mut refusal = None;
        let fit: Vec<String> = pool
            .into_iter()
            .filter(|v| v != "none")
            .filter(|v| match shape.model_config(v, limits, compute) {
                Ok(_) => true,
                Err(e) => {
                    refusal.get_or_insert(e);
                    false
                }
            })
            .collect();
        match refusal {
            Some(e) if fit.is_empty() => Err(e),
            _ => Ok(fit),
        }
    }

    /// Every variant known and valid at this shape (before any runs), and run by the PyTorch
    /// script if there is one.
    pub fn check(&self) -> Result<()> {
        if self.options.variants.is_empty() {
            return Err(Error::Input("no variants to measure".into()));
        }
        for v in &self.options.variants {
            self.options.shape.positional(v)?;
            self.options
                .shape
                .model_config(v, &self.options.limits, self.options.compute())
                .map_err(|e| match e {
                    Error::Config(why) => Error::Config(format!("bench variant `{v}`: {why}")),
                    e => e,
                })?;
            if let Some(torch) = self.torch.as_ref().filter(|t| !t.variants.contains(v)) {
                return Err(Error::Input(format!(
                    "--torch: the PyTorch script has no `{v}` variant; it runs {}",
                    torch.variants.join(", ")
                )));
            }
        }
        Ok(())
    }

    fn kernels(&self) -> &'static str {
        let dtype = self.options.shape.dtype.compute_dtype(candle::DType::F32);
        self.options
            .backend
            .kernels_on(&self.options.device, dtype)
            .name()
    }

    /// The line that says what runs: device, threads, kernels, SIMD level and shape.
    pub fn banner(&self) -> String {
        let (device, shape) = (&self.options.device, &self.options.shape);
        let device = match gpu_name(device) {
            Some(gpu) => format!("{} ({gpu})", device_name(device)),
            None => device_name(device),
        };
        format!(
            "poslab bench on {device} ({} thread{}, {} kernels, {:?} SIMD, {}): vocab {}, {}",
            self.options.threads,
            if self.options.threads == 1 { "" } else { "s" },
            self.kernels(),
            self.options.backend.simd,
            shape.dtype.name(),
            shape.vocab,
            shape.describe()
        )
    }

    /// What the JSON document says about the run before its results.
    pub fn header(&self) -> serde_json::Value {
        let device = &self.options.device;
        serde_json::json!({
            "device": device_name(device),
            "gpu": gpu_name(device),
            "threads": self.options.threads,
            "kernels": self.kernels(),
            "simd": format!("{:?}", self.options.backend.simd),
            "shape": self.options.shape,
            "torch": self.torch.as_ref().and_then(|t| t.version.clone()),
        })
    }

    /// Runs the bench; `log` gets each phase and round.
    pub fn run(&self, log: &mut dyn FnMut(&str)) -> Result<Outcome> {
        let variants = &self.options.variants;
        if let Some(torch) = &self.torch {
            let n = self.rounds.unwrap_or(3).max(1);
            let mut rounds = Vec::new();
            for round in 0..n {
                log(&format!("round {} of {n}", round + 1));
                let mut pairs = Vec::new();
                for variant in variants {
                    // Alternate which goes first, so a drift in machine speed favours neither.
                    let pair = if round % 2 == 0 {
                        let p = self.in_child(variant)?;
                        (p, self.torch_run(torch, variant, log)?)
                    } else {
                        let t = self.torch_run(torch, variant, log)?;
                        (self.in_child(variant)?, t)
                    };
                    log(&pair_line(&pair.0, &pair.1));
                    pairs.push(pair);
                }
                rounds.push(pairs);
            }
            let ratios = ratios(variants, &rounds);
            return Ok(Outcome::Ratios { ratios, rounds });
        }
        if let Some(n) = self.rounds.filter(|&n| n > 1 && !self.in_process) {
            // The order reversed every other round, so a drift in machine speed favours no
            // variant.
            let mut rounds = Vec::new();
            for round in 0..n {
                log(&format!("round {} of {n}", round + 1));
                let mut order: Vec<&String> = variants.iter().collect();
                if round % 2 == 1 {
                    order.reverse();
                }
                let mut records = order
                    .into_iter()
                    .map(|v| self.in_child(v))
                    .collect::<Result<Vec<_>>>()?;
                records.sort_by_key(|r| variants.iter().position(|v| *v == r.variant));
                rounds.push(records);
            }
            let costs = costs(variants, &rounds);
            return Ok(Outcome::Costs { costs, rounds });
        }
        let records = if self.in_process || variants.len() == 1 {
            super::run(&self.options, &mut |phase| log(&format!("  {phase}")))?
        } else {
            variants
                .iter()
                .map(|v| self.in_child(v))
                .collect::<Result<Vec<_>>>()?
        };
        Ok(Outcome::Records(records))
    }

    /// `variant` measured by `poslab bench --in-process --json` in a child process.
    fn in_child(&self, variant: &str) -> Result<Record> {
        let (options, shape) = (&self.options, &self.options.shape);
        let exe = std::env::current_exe().map_err(|e| Error::io(Path::new("poslab"), e))?;
        let mut cmd = Command::new(&exe);
        cmd.arg("bench");
        for (flag, value) in shape.flags().into_iter().chain([
            ("--warmup", options.warmup),
            ("--forward-reps", options.forward_reps),
            ("--train-reps", options.train_reps),
            ("--threads", self.options.threads),
        ]) {
            cmd.args([flag.to_string(), value.to_string()]);
        }
        cmd.args([
            "--device",
            &self.device_flag.to_string(),
            "--dtype",
            shape.dtype.name(),
        ])
        .args(["--kernels", options.backend.kernels.name()])
        .args(["--simd", options.backend.simd.name()])
        .args(["--json", "--in-process", "--variants", variant]);
        let out = cmd
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| Error::io(&exe, e))?;
        if !out.status.success() {
            return Err(Error::Input(format!("the bench of {variant} failed")));
        }
        let bad = |e: String| Error::Input(format!("a bench child's JSON: {e}"));
        let doc: serde_json::Value =
            serde_json::from_slice(&out.stdout).map_err(|e| bad(e.to_string()))?;
        let mut records: Vec<Record> =
            serde_json::from_value(doc["results"].clone()).map_err(|e| bad(e.to_string()))?;
        records.pop().ok_or_else(|| bad("no result".into()))
    }

    /// `variant` measured by the PyTorch script.
    fn torch_run(
        &self,
        torch: &Torch,
        variant: &str,
        log: &mut dyn FnMut(&str),
    ) -> Result<TorchRecord> {
        log(&format!("  {variant}: PyTorch"));
        let (options, shape) = (&self.options, &self.options.shape);
        let mut cmd = Command::new(&torch.python);
        cmd.arg(&torch.script).arg(variant);
        if torch.takes_shape {
            for (flag, value) in shape.flags() {
                cmd.args([flag.to_string(), value.to_string()]);
            }
            cmd.args(["--dtype", shape.dtype.name()]);
            cmd.args(["--device", &device_name(&options.device)]);
        }
        cmd.args(["--fwd-iters", &options.forward_reps.max(1).to_string()])
            .args(["--train-iters", &options.train_reps.max(1).to_string()])
            .args(["--warm", &options.warmup.to_string()])
            .args(["--threads", &self.options.threads.to_string()]);
        let line = torch.json_line(&mut cmd, &format!("for {variant}"))?;
        TorchRecord::from_json(&line)
    }
}

/// A poslab / PyTorch pair of one round on a line, logged as soon as both are in.
fn pair_line(p: &Record, t: &TorchRecord) -> String {
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let (train, forward) = (p.train_rate(), p.forward_rate());
    format!(
        "  {}: training tok/s poslab {train:.0} / PyTorch {:.0} ({:.2}x), forward {forward:.0} / \
         {:.0} ({:.2}x)",
        p.variant,
        t.train_tokens_per_s,
        ratio(train, t.train_tokens_per_s),
        t.forward_tokens_per_s,
        ratio(forward, t.forward_tokens_per_s),
    )
}
