//! The model's trainable variables: created from the seeded generator, saved and loaded by name.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};

use candle::backprop::GradStore;
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
/// (the lab's `train::optim::AdamW::from_store`).
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
///
/// A group of parameters can be packed into one variable ([`ParamStore::pack`]: an encoder
/// layer's, in the order its fused kernel reads them); each keeps its name, and the module reads
/// a view of the packed variable. Saving, loading and the optimizer's state stay by name.
#[derive(Clone, Debug)]
pub struct ParamStore {
    seed: u64,
    inner: Arc<Mutex<Inner>>,
    /// The least value of each bounded variable, by name, as its module declared it.
    bounds: Arc<Mutex<BTreeMap<String, f64>>>,
    /// The variables weight decay leaves alone, by name, as their modules declared them.
    undecayed: Arc<Mutex<std::collections::BTreeSet<String>>>,
}

#[derive(Debug, Default)]
struct Inner {
    params: BTreeMap<String, Param>,
    /// Packed variables ([`ParamStore::pack`]), each under the prefix its parameters share.
    packs: Vec<(String, Var)>,
}

/// A named parameter: a variable of its own, or a part of a packed one.
#[derive(Clone, Debug)]
enum Param {
    Var(Var),
    /// `view` is `packs[pack].narrow(0, offset, n).reshape(shape)`: what the module reads.
    Part {
        pack: usize,
        offset: usize,
        view: Tensor,
    },
}

impl Param {
    /// The value the model reads (the variable, or the view of the packed one).
    fn tensor(&self) -> &Tensor {
        match self {
            Param::Var(v) => v.as_tensor(),
            Param::Part { view, .. } => view,
        }
    }
}

/// One piece of a packed variable ([`ParamStore::pack`]), in order.
#[derive(Debug)]
pub enum PackPart<'a> {
    /// A tensor: one of the store's variables (then packed, and the tensor replaced by its view)
    /// or a constant (its values copied in, never trained).
    Tensor(&'a mut Tensor),
    /// `n` zeros that are no parameter (a projection without bias, read by a fused kernel).
    Zeros(usize),
}

impl PackPart<'_> {
    /// The values it takes in the packed variable.
    pub fn len(&self) -> usize {
        match self {
            Self::Tensor(t) => t.elem_count(),
            Self::Zeros(n) => *n,
        }
    }

    /// Whether it takes none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A variable of the store and the named parameters it holds, for an optimizer.
#[derive(Clone, Debug)]
pub struct StoredVar {
    /// The variable.
    pub var: Var,
    /// `(name, offset, shape)` of each parameter in the variable (flattened), in order of
    /// offset; one covering it all for a variable of its own.
    pub parts: Vec<(String, usize, Shape)>,
}

impl ParamStore {
    /// An empty store whose variables will be drawn from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            inner: Arc::default(),
            bounds: Arc::default(),
            undecayed: Arc::default(),
        }
    }

    /// The name of the parameter `tensor` is (a variable, or the view of a packed one).
    fn name_of(params: &BTreeMap<String, Param>, tensor: &Tensor) -> Option<String> {
        let id = tensor.id();
        params
            .iter()
            .find(|(_, p)| p.tensor().id() == id)
            .map(|(n, _)| n.clone())
    }

    /// Holds `bounds` (a model's [`crate::Encoder::constraints`]): loads refuse values below
    /// them, and an optimizer built by the lab's `train::optim::AdamW::from_store` keeps the
    /// variables at or above them. A bound on a tensor that is not one of the store's variables
    /// is an error.
    pub fn constrain(&self, bounds: &[LowerBound]) -> Result<()> {
        let inner = self.lock();
        let mut held = self.bounds.lock().expect("parameter bounds lock poisoned");
        for bound in bounds {
            let name =
                match Self::name_of(&inner.params, &bound.var) {
                    Some(name) if matches!(inner.params[&name], Param::Var(_)) => name,
                    Some(name) => {
                        return Err(Error::Config(format!(
                        "`{name}` is packed with other parameters and cannot be bounded: bound \
                         it before packing, or leave it out of the pack"
                    )))
                    }
                    None => return Err(Error::Config(
                        "a bounded tensor is not a variable of this store: constrain the store \
                         the model was built from"
                            .into(),
                    )),
                };
            held.insert(name, bound.min);
        }
        Ok(())
    }

    /// Holds `tensors` (a model's [`crate::model::TaskModel::undecayed`] or
    /// [`crate::Encoder::undecayed`]) as variables weight decay leaves alone; tensors that are
    /// no variables of this store (a model without biases reads fixed zeros) are skipped.
    pub fn exempt_from_decay(&self, tensors: &[Tensor]) {
        let inner = self.lock();
        let mut held = self
            .undecayed
            .lock()
            .expect("decay exemptions lock poisoned");
        for t in tensors {
            if let Some(name) = Self::name_of(&inner.params, t) {
                held.insert(name);
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

    /// A `VarBuilder` over plain (detached) copies of the parameters' current values: a model
    /// built from it computes without recording an autograd graph (inference), and does not
    /// see later updates.
    pub fn frozen_var_builder(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        let tensors: HashMap<String, Tensor> = self
            .params()
            .into_iter()
            .map(|(name, t)| (name, t.detach()))
            .collect();
        VarBuilder::from_tensors(tensors, dtype, device)
    }

    /// Packs `parts`, in order and flattened, into one new variable, and returns it: each part
    /// that is a variable of this store keeps its name (for saving, loading, decay and the
    /// optimizer's state) and is replaced, where the module holds it, by a view of the packed
    /// variable; a gradient reaches the packed variable from a kernel that reads it whole
    /// (an encoder layer's fused node) or through the views. Constants and zeros are packed as
    /// values no optimizer updates. A bounded variable cannot be packed.
    ///
    /// One variable instead of a dozen means one gradient where candle would otherwise
    /// zero-fill and add for each part, and no concatenation a step.
    pub fn pack(&self, parts: Vec<PackPart<'_>>) -> Result<Tensor> {
        let mut inner = self.lock();
        let first = parts.iter().find_map(|p| match p {
            PackPart::Tensor(t) => Some((t.dtype(), t.device().clone())),
            PackPart::Zeros(_) => None,
        });
        let Some((dtype, device)) = first else {
            return Err(Error::Config(
                "nothing to pack: no tensor among the parts".into(),
            ));
        };
        let mut values = Vec::with_capacity(parts.len());
        let mut named: Vec<(String, usize, &mut Tensor)> = Vec::new();
        let mut offset = 0;
        for part in parts {
            let n = match part {
                PackPart::Zeros(n) => {
                    values.push(Tensor::zeros(n, dtype, &device)?);
                    n
                }
                PackPart::Tensor(t) => {
                    values.push(t.detach().flatten_all()?);
                    let n = t.elem_count();
                    match Self::name_of(&inner.params, t) {
                        Some(name) if !matches!(inner.params[&name], Param::Var(_)) => {
                            return Err(Error::Config(format!("`{name}` is packed already")))
                        }
                        Some(name) if self.bound(&name).is_some() => {
                            return Err(Error::Config(format!(
                                "`{name}` is bounded and cannot be packed"
                            )))
                        }
                        Some(name) => named.push((name, offset, t)),
                        None => {}
                    }
                    n
                }
            };
            offset += n;
        }
        if named.is_empty() {
            return Err(Error::Config(
                "nothing to pack: no part is a variable of this store".into(),
            ));
        }
        let var = Var::from_tensor(&Tensor::cat(&values, 0)?)?;
        drop(values);
        let prefix = common_prefix(named.iter().map(|(n, _, _)| n.as_str()));
        let pack = inner.packs.len();
        for (name, offset, t) in named {
            let view = var
                .as_tensor()
                .narrow(0, offset, t.elem_count())?
                .reshape(t.shape())?;
            *t = view.clone();
            inner
                .params
                .insert(name, Param::Part { pack, offset, view });
        }
        inner.packs.push((prefix, var.clone()));
        Ok(var.as_tensor().clone())
    }

    /// The store's variables, sorted by name: each parameter of its own, and each packed
    /// variable under the prefix its parameters share (`layers.0`).
    pub fn vars(&self) -> Vec<(String, Var)> {
        let inner = self.lock();
        let mut out: Vec<(String, Var)> = inner
            .params
            .iter()
            .filter_map(|(k, p)| match p {
                Param::Var(v) => Some((k.clone(), v.clone())),
                Param::Part { .. } => None,
            })
            .chain(inner.packs.iter().cloned())
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// The variables alone, for an optimizer.
    pub fn all_vars(&self) -> Vec<Var> {
        self.vars().into_iter().map(|(_, v)| v).collect()
    }

    /// The store's variables with the named parameters each holds, for an optimizer.
    pub fn stored_vars(&self) -> Vec<StoredVar> {
        let inner = self.lock();
        let mut out: Vec<StoredVar> = inner
            .packs
            .iter()
            .map(|(_, var)| StoredVar {
                var: var.clone(),
                parts: Vec::new(),
            })
            .collect();
        for (name, p) in &inner.params {
            match p {
                Param::Var(v) => out.push(StoredVar {
                    var: v.clone(),
                    parts: vec![(name.clone(), 0, v.shape().clone())],
                }),
                Param::Part { pack, offset, view } => {
                    out[*pack]
                        .parts
                        .push((name.clone(), *offset, view.shape().clone()))
                }
            }
        }
        for stored in &mut out {
            stored.parts.sort_by_key(|(_, offset, _)| *offset);
        }
        out
    }

    /// Every parameter's current value by name, sorted (views of packed variables included).
    pub fn params(&self) -> Vec<(String, Tensor)> {
        self.lock()
            .params
            .iter()
            .map(|(k, p)| (k.clone(), p.tensor().clone()))
            .collect()
    }

    /// The variable `name`, if the store holds it as a variable of its own (or it names a packed
    /// variable); [`ParamStore::value`] reads any parameter.
    pub fn get(&self, name: &str) -> Option<Var> {
        let inner = self.lock();
        match inner.params.get(name) {
            Some(Param::Var(v)) => Some(v.clone()),
            Some(Param::Part { .. }) => None,
            None => inner
                .packs
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone()),
        }
    }

    /// The current value of parameter `name`, packed or not.
    pub fn value(&self, name: &str) -> Option<Tensor> {
        self.lock().params.get(name).map(|p| p.tensor().clone())
    }

    /// The gradient of every parameter that has one in `grads`, sorted by name (a packed
    /// parameter's is the part of its packed variable's gradient).
    pub fn gradients(&self, grads: &GradStore) -> Result<Vec<(String, Tensor)>> {
        let inner = self.lock();
        let mut out = Vec::new();
        for (name, p) in &inner.params {
            let g = match p {
                Param::Var(v) => grads.get(v.as_tensor()).cloned(),
                Param::Part { pack, offset, view } => {
                    match grads.get(inner.packs[*pack].1.as_tensor()) {
                        Some(g) => Some(
                            g.flatten_all()?
                                .narrow(0, *offset, view.elem_count())?
                                .reshape(view.shape())?,
                        ),
                        None => None,
                    }
                }
            };
            if let Some(g) = g {
                out.push((name.clone(), g));
            }
        }
        Ok(out)
    }

    /// Sets parameter `name` to `value` (converted to its dtype and device; same shape).
    pub fn set(&self, name: &str, value: &Tensor) -> Result<()> {
        let inner = self.lock();
        let param = inner
            .params
            .get(name)
            .ok_or_else(|| Error::Input(format!("no parameter named `{name}` in the store")))?;
        Self::write(&inner, param, value)
    }

    fn write(inner: &Inner, param: &Param, value: &Tensor) -> Result<()> {
        let target = param.tensor();
        if value.dims() != target.dims() {
            return Err(Error::Input(format!(
                "a value of shape {:?} for a parameter of shape {:?}",
                value.dims(),
                target.dims()
            )));
        }
        let value = value.to_dtype(target.dtype())?.to_device(target.device())?;
        match param {
            Param::Var(v) => v.set(&value)?,
            Param::Part { pack, offset, .. } => inner.packs[*pack].1.as_tensor().slice_set(
                &value.flatten_all()?.contiguous()?,
                0,
                *offset,
            )?,
        }
        Ok(())
    }

    /// Total number of scalar parameters (what packing adds, zeros and constants, is none).
    pub fn num_params(&self) -> usize {
        self.lock()
            .params
            .values()
            .map(|p| p.tensor().elem_count())
            .sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("parameter store lock poisoned")
    }

    /// Writes every parameter to a safetensors file with `metadata`, atomically.
    pub fn save(&self, path: impl AsRef<Path>, metadata: HashMap<String, String>) -> Result<()> {
        save_tensors(path.as_ref(), self.params(), metadata)
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
        let names: Vec<String> = self.lock().params.keys().cloned().collect();
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
        let inner = self.lock();
        let vars: BTreeMap<&String, &[usize]> = inner
            .params
            .iter()
            .filter(|(name, _)| take(name))
            .map(|(name, p)| (name, p.tensor().dims()))
            .collect();
        let mut problems = Vec::new();
        for (name, dims) in vars.iter() {
            match shapes.get(*name) {
                None => problems.push(format!(
                    "missing tensor `{name}` (the model expects shape {dims:?})"
                )),
                Some(t) if t.as_slice() != *dims => problems.push(format!(
                    "tensor `{name}` has shape {t:?} in the file but the model expects {dims:?}"
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
        let inner = self.lock();
        let vars: BTreeMap<&String, &Param> =
            inner.params.iter().filter(|(name, _)| take(name)).collect();
        // Values: a corrupted file (NaN, inf) or a constrained variable out of its range would
        // compute silently wrong numbers.
        let mut bad_values = Vec::new();
        for (name, var) in vars.iter() {
            let Some(t) = tensors
                .get(*name)
                .filter(|t| t.dims() == var.tensor().dims())
            else {
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
        for (name, param) in vars.iter() {
            Self::write(&inner, param, &tensors[*name])?;
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

/// The variable `name` of `vb`, of `shape`, starting at `values` (one per element, row-major)
/// where candle's [`Init`] has no such form (GRAPE-M's spectrum). A variable that already exists
/// (loaded weights) is returned as it is; so is a tensor of a builder that makes no variables.
pub fn get_with_values(
    vb: &VarBuilder,
    shape: impl Into<Shape>,
    name: &str,
    values: Vec<f64>,
) -> Result<Tensor> {
    let shape = shape.into();
    if values.len() != shape.elem_count() {
        return Err(Error::Input(format!(
            "{} starting values for `{name}` of shape {shape:?}",
            values.len()
        )));
    }
    let fresh = !vb.contains_tensor(name);
    let tensor = vb.get_with_hints(shape.clone(), name, Init::Const(0.0))?;
    if fresh && tensor.is_variable() {
        let start = Tensor::from_vec(values, shape, &Device::Cpu)?
            .to_dtype(tensor.dtype())?
            .to_device(tensor.device())?;
        Var::from_tensor(&tensor)?.set(&start)?;
    }
    Ok(tensor)
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
        let mut inner = self.lock();
        if let Some(param) = inner.params.get(name) {
            let t = param.tensor();
            if t.shape() != &shape {
                candle::bail!(
                    "parameter `{name}` requested with shape {shape:?} but it exists as {:?}",
                    t.shape()
                )
            }
            return Ok(t.clone());
        }
        let values = sample(init, &shape, &mut rng::stream(self.seed, name));
        let tensor = Tensor::from_vec(values, shape, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)?;
        let var = Var::from_tensor(&tensor)?;
        inner
            .params
            .insert(name.to_string(), Param::Var(var.clone()));
        Ok(var.as_tensor().clone())
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _device: &Device) -> candle::Result<Tensor> {
        match self.lock().params.get(name) {
            Some(param) => Ok(param.tensor().clone()),
            None => candle::bail!("no parameter named `{name}` in the store"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.lock().params.contains_key(name)
    }
}

/// The dotted prefix `names` share (`layers.0` of `layers.0.attn.q.weight` and
/// `layers.0.ffn.up.bias`), or `packed` where they share none.
fn common_prefix<'a>(mut names: impl Iterator<Item = &'a str>) -> String {
    let Some(first) = names.next() else {
        return "packed".into();
    };
    let mut prefix: Vec<&str> = first.split('.').collect();
    prefix.pop();
    for name in names {
        let parts: Vec<&str> = name.split('.').collect();
        let same = prefix
            .iter()
            .zip(&parts)
            .take_while(|(a, b)| a == b)
            .count();
        prefix.truncate(same.min(parts.len().saturating_sub(1)));
    }
    match prefix.is_empty() {
        true => "packed".into(),
        false => prefix.join("."),
    }
}
