//! The model's trainable variables: created from the seeded generator, saved and loaded by name.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};

use candle::{DType, Device, Shape, Tensor, Var};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use rand::Rng as _;
use rand_distr::StandardNormal;

use crate::error::{Error, Result};
use crate::rng;

/// A variable that must stay at or above `min`: declared by the module that creates it (KERPLE's
/// `r1`, `r2`), applied by the optimizer after every step
/// ([`crate::train::optim::AdamW::from_store`]).
#[derive(Clone, Debug)]
pub struct LowerBound {
    /// The bounded variable.
    pub var: Tensor,
    /// Its least value.
    pub min: f64,
}

/// Every trainable variable of a model, by name (`layers.0.attn.q.weight`, ...).
///
/// It is the `VarBuilder` backend models are built from: each variable is drawn from the named
/// stream `rng::stream(seed, name)`, so the same seed gives the same weights bit for bit, and two
/// models that share a variable's name and shape (say the attention of `sinusoidal_add` and of
/// `rope`) start it from the same values, whatever else they hold.
#[derive(Clone, Debug)]
pub struct ParamStore {
    seed: u64,
    vars: Arc<Mutex<BTreeMap<String, Var>>>,
    /// The least value of each bounded variable, by name, as its module declared it.
    bounds: Arc<Mutex<BTreeMap<String, f64>>>,
    /// The variables weight decay leaves alone, by name, as their modules declared them.
    undecayed: Arc<Mutex<std::collections::BTreeSet<String>>>,
}

impl ParamStore {
    /// An empty store whose variables will be drawn from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            vars: Arc::default(),
            bounds: Arc::default(),
            undecayed: Arc::default(),
        }
    }

    /// Holds `bounds` (a model's [`crate::Encoder::constraints`]): loads refuse values below
    /// them, and an optimizer built by [`crate::train::optim::AdamW::from_store`] keeps the
    /// variables at or above them. A bound on a tensor that is not one of the store's variables
    /// is an error.
    pub fn constrain(&self, bounds: &[LowerBound]) -> Result<()> {
        let vars = self.lock();
        let mut held = self.bounds.lock().expect("parameter bounds lock poisoned");
        for bound in bounds {
            let id = bound.var.id();
            let name = vars
                .iter()
                .find(|(_, v)| v.as_tensor().id() == id)
                .map(|(n, _)| n.clone())
                .ok_or_else(|| {
                    Error::Config(
                        "a bounded tensor is not a variable of this store: constrain the store \
                         the model was built from"
                            .into(),
                    )
                })?;
            held.insert(name, bound.min);
        }
        Ok(())
    }

    /// Holds `tensors` (a model's [`crate::model::TaskModel::undecayed`] or
    /// [`crate::Encoder::undecayed`]) as variables weight decay leaves alone; tensors that are
    /// no variables of this store (a model without biases reads fixed zeros) are skipped.
    pub fn exempt_from_decay(&self, tensors: &[Tensor]) {
        let vars = self.lock();
        let mut held = self
            .undecayed
            .lock()
            .expect("decay exemptions lock poisoned");
        for t in tensors {
            if let Some((name, _)) = vars.iter().find(|(_, v)| v.as_tensor().id() == t.id()) {
                held.insert(name.clone());
            }
        }
    }

    /// Whether weight decay applies to variable `name`: not to a variable its module exempted
    /// ([`ParamStore::exempt_from_decay`]), nor to a bounded one (its size is not a capacity to
    /// shrink).
    pub fn decays(&self, name: &str) -> bool {
        let exempt = self
            .undecayed
            .lock()
            .expect("decay exemptions lock poisoned")
            .contains(name);
        !exempt && self.bound(name).is_none()
    }

    /// The least value of the variable `name`, if it is bounded.
    pub fn bound(&self, name: &str) -> Option<f64> {
        self.bounds
            .lock()
            .expect("parameter bounds lock poisoned")
            .get(name)
            .copied()
    }

    /// The seed variables are drawn from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// A `VarBuilder` whose `get` creates (or returns) variables in this store.
    pub fn var_builder(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self.clone()), dtype, device.clone())
    }

    /// A `VarBuilder` over plain (detached) copies of the variables' current values: a model
    /// built from it computes without recording an autograd graph (inference), and does not
    /// see later updates.
    pub fn frozen_var_builder(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        let tensors: HashMap<String, Tensor> = self
            .vars()
            .into_iter()
            .map(|(name, var)| (name, var.as_detached_tensor()))
            .collect();
        VarBuilder::from_tensors(tensors, dtype, device)
    }

    /// All variables, sorted by name.
    pub fn vars(&self) -> Vec<(String, Var)> {
        self.lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The variables alone, for an optimizer.
    pub fn all_vars(&self) -> Vec<Var> {
        self.lock().values().cloned().collect()
    }

    /// The variable `name`, if the store holds it.
    pub fn get(&self, name: &str) -> Option<Var> {
        self.lock().get(name).cloned()
    }

    /// Total number of scalar parameters.
    pub fn num_params(&self) -> usize {
        self.lock().values().map(|v| v.elem_count()).sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Var>> {
        self.vars.lock().expect("parameter store lock poisoned")
    }

    /// Writes every variable to a safetensors file with `metadata`, atomically.
    pub fn save(&self, path: impl AsRef<Path>, metadata: HashMap<String, String>) -> Result<()> {
        let tensors: Vec<(String, Tensor)> = self
            .vars()
            .into_iter()
            .map(|(name, var)| (name, var.as_tensor().clone()))
            .collect();
        save_tensors(path.as_ref(), tensors, metadata)
    }

    /// Loads a safetensors file written by [`ParamStore::save`] (or any file with the same names
    /// and shapes) into the variables, and returns its metadata.
    ///
    /// Nothing is changed unless the file holds exactly the model's variables with exactly their
    /// shapes; otherwise the error lists every missing, unexpected and mis-shaped tensor.
    pub fn load(&self, path: impl AsRef<Path>) -> Result<HashMap<String, String>> {
        self.load_file(&mut crate::weights::WeightsFile::open(path.as_ref())?)
    }

    /// [`ParamStore::load`] from a file already open (its header read once).
    pub fn load_file(
        &self,
        file: &mut crate::weights::WeightsFile,
    ) -> Result<HashMap<String, String>> {
        let path = file.path().to_path_buf();
        // Names and shapes from the header first: nothing is read from a file of another model.
        self.check_shapes(&file.shapes(), &path, |_| true)?;
        let names: Vec<String> = self.lock().keys().cloned().collect();
        let tensors = names
            .into_iter()
            .map(|n| Ok((n.clone(), file.read(&n)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        self.assign(&tensors, &path)?;
        Ok(file.metadata().clone())
    }

    /// Refuses `shapes` (a file's tensors by name) that are not exactly the variables `take`
    /// accepts with their shapes, listing every missing, unexpected and mis-shaped tensor.
    pub fn check_shapes(
        &self,
        shapes: &HashMap<String, Vec<usize>>,
        source: &Path,
        take: impl Fn(&str) -> bool,
    ) -> Result<()> {
        let all = self.lock();
        let vars: std::collections::BTreeMap<&String, &Var> =
            all.iter().filter(|(name, _)| take(name)).collect();
        let mut problems = Vec::new();
        for (name, var) in vars.iter() {
            match shapes.get(*name) {
                None => problems.push(format!(
                    "missing tensor `{name}` (the model expects shape {:?})",
                    var.dims()
                )),
                Some(t) if t.as_slice() != var.dims() => problems.push(format!(
                    "tensor `{name}` has shape {t:?} in the file but the model expects {:?}",
                    var.dims()
                )),
                Some(_) => {}
            }
        }
        let mut unexpected: Vec<_> = shapes
            .iter()
            .filter(|(name, _)| take(name) && !vars.contains_key(name))
            .map(|(name, t)| format!("unexpected tensor `{name}` {t:?}"))
            .collect();
        unexpected.sort();
        problems.extend(unexpected);
        if problems.is_empty() {
            return Ok(());
        }
        let n = problems.len();
        let mut message = format!(
            "does not match the model ({n} problem{}; was it saved from a model with another \
             config or positional scheme?):",
            if n == 1 { "" } else { "s" }
        );
        for p in problems.iter().take(20) {
            message.push_str("\n  - ");
            message.push_str(p);
        }
        if n > 20 {
            message.push_str(&format!("\n  ... and {} more", n - 20));
        }
        Err(Error::Checkpoint {
            path: source.into(),
            message,
        })
    }

    /// Sets the variables from `tensors` (converted to each variable's dtype and device), after
    /// checking that the names and shapes match exactly. `source` names them in errors.
    pub fn assign(&self, tensors: &HashMap<String, Tensor>, source: &Path) -> Result<()> {
        self.assign_where(tensors, source, |_| true)
    }

    /// As [`ParamStore::assign`], for the names `take` accepts, of variables and tensors
    /// alike (other variables keep their values, other tensors are not read): a pretrained
    /// encoder's weights under a new head.
    pub fn assign_where(
        &self,
        tensors: &HashMap<String, Tensor>,
        source: &Path,
        take: impl Fn(&str) -> bool,
    ) -> Result<()> {
        let shapes: HashMap<String, Vec<usize>> = tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.dims().to_vec()))
            .collect();
        self.check_shapes(&shapes, source, &take)?;
        let all = self.lock();
        let vars: std::collections::BTreeMap<&String, &Var> =
            all.iter().filter(|(name, _)| take(name)).collect();
        // Values: a corrupted file (NaN, inf) or a constrained variable out of its range would
        // compute silently wrong numbers.
        let mut bad_values = Vec::new();
        for (name, var) in vars.iter() {
            let Some(t) = tensors.get(*name).filter(|t| t.dims() == var.dims()) else {
                continue;
            };
            let values = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                bad_values.push(format!(
                    "tensor `{name}` holds {v} at flat index {i}: the file is corrupt, or was \
                     saved from a run that diverged; use another checkpoint"
                ));
            } else if let Some(lo) = self.bound(name) {
                if let Some(v) = values.iter().find(|&&v| v < lo) {
                    bad_values.push(format!(
                        "tensor `{name}` holds {v}, below its least value {lo} (it must stay \
                         positive): the file was not saved by poslab's training"
                    ));
                }
            }
        }
        if !bad_values.is_empty() {
            return Err(Error::Checkpoint {
                path: source.into(),
                message: format!("holds unusable weights:\n  - {}", bad_values.join("\n  - ")),
            });
        }
        for (name, var) in vars.iter() {
            let t = &tensors[*name];
            var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
        }
        Ok(())
    }
}

/// Writes named tensors (on any device) to a safetensors file with `metadata`, atomically.
///
/// The file's bytes depend only on its content as long as `metadata` has at most one key:
/// safetensors writes the metadata map in hash order.
pub fn save_tensors(
    path: &Path,
    tensors: Vec<(String, Tensor)>,
    metadata: HashMap<String, String>,
) -> Result<()> {
    let bytes = safetensors::serialize(tensors, Some(metadata)).map_err(|e| Error::Checkpoint {
        path: path.into(),
        message: format!("cannot serialize: {e}"),
    })?;
    crate::io::write_atomic(path, &bytes)
}

/// Reads every tensor (onto the CPU) and the metadata of a safetensors file that holds at most
/// `max_elements` values (what the caller expects; a file claiming more is refused before any
/// tensor is read). Tensors of a dtype poslab does not load are refused by name.
pub fn load_tensors(
    path: &Path,
    max_elements: u128,
) -> Result<(HashMap<String, Tensor>, HashMap<String, String>)> {
    let mut file = crate::weights::WeightsFile::open(path)?;
    let tensors = file.read_all(max_elements)?;
    Ok((tensors, file.metadata().clone()))
}

/// Reads only the metadata of a safetensors file.
pub fn read_metadata(path: impl AsRef<Path>) -> Result<HashMap<String, String>> {
    Ok(crate::weights::WeightsFile::open(path.as_ref())?
        .metadata()
        .clone())
}

/// Draws `n` values of `init` for a variable of `shape` from `rng`.
fn sample(init: Init, shape: &Shape, rng: &mut rng::Rng) -> Vec<f64> {
    let n = shape.elem_count();
    let normal = |rng: &mut rng::Rng, mean: f64, std: f64| -> Vec<f64> {
        (0..n)
            .map(|_| mean + std * rng.sample::<f64, _>(StandardNormal))
            .collect()
    };
    let uniform = |rng: &mut rng::Rng, lo: f64, up: f64| -> Vec<f64> {
        (0..n)
            .map(|_| lo + (up - lo) * rng.random::<f64>())
            .collect()
    };
    match init {
        Init::Const(c) => vec![c; n],
        Init::Randn { mean, stdev } => normal(rng, mean, stdev),
        Init::Uniform { lo, up } => uniform(rng, lo, up),
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
            match dist {
                NormalOrUniform::Normal => normal(rng, 0.0, std),
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    uniform(rng, -bound, bound)
                }
            }
        }
    }
}

impl SimpleBackend for ParamStore {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> candle::Result<Tensor> {
        let mut vars = self.lock();
        if let Some(var) = vars.get(name) {
            if var.shape() != &shape {
                candle::bail!(
                    "parameter `{name}` requested with shape {shape:?} but it exists as {:?}",
                    var.shape()
                )
            }
            return Ok(var.as_tensor().clone());
        }
        let values = sample(init, &shape, &mut rng::stream(self.seed, name));
        let tensor = Tensor::from_vec(values, shape, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)?;
        let var = Var::from_tensor(&tensor)?;
        vars.insert(name.to_string(), var.clone());
        Ok(var.as_tensor().clone())
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _device: &Device) -> candle::Result<Tensor> {
        match self.lock().get(name) {
            Some(var) => Ok(var.as_tensor().clone()),
            None => candle::bail!("no parameter named `{name}` in the store"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.lock().contains_key(name)
    }
}
