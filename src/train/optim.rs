//! AdamW (Loshchilov & Hutter) with decoupled weight decay and an inspectable state.

use std::collections::HashMap;

use candle::backprop::GradStore;
use candle::{DType, Tensor, Var};

use crate::error::{Error, Result};

/// AdamW's constants; the learning rate comes per step from the schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// The first moment's decay (default 0.9).
    pub beta1: f64,
    /// The second moment's decay (default 0.999).
    pub beta2: f64,
    /// Added to the root of the second moment (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay, times the learning rate (default 0.01).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// PyTorch's `AdamW` defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// One of a variable's named parameters: all of it, or a part of a packed variable
/// ([`crate::ParamStore::pack`]).
struct Part {
    name: String,
    /// Where it starts in the variable, flattened; its moments `[m; v]` start at twice that.
    offset: usize,
    shape: candle::Shape,
    decay: bool,
    /// Projected back to at least this after every step (see [`AdamW::from_store`]).
    lower_bound: Option<f64>,
}

struct Slot {
    var: Var,
    /// The named parameters the variable holds, in order of offset.
    parts: Vec<Part>,
    /// First and second moment estimates, flat: each part's `[m; v]` (`2 n` values) at twice
    /// its offset.
    moments: Tensor,
}

/// AdamW as in PyTorch: `w <- w (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)`.
///
/// Built from a store ([`AdamW::from_store`]), it leaves biases and LayerNorm parameters
/// undecayed, as the modules that made them declare ([`crate::Encoder::undecayed`]); weights
/// and embeddings are decayed. Variables without a
/// gradient in a step are left as they are.
pub struct AdamW {
    slots: Vec<Slot>,
    step: u64,
    config: AdamWConfig,
    /// The most values the composed update takes at once ([`COMPOSED_BATCH`]).
    batch_values: usize,
    /// Where the updates compute: the model's backend ([`AdamW::with_backend`]).
    backend: crate::nn::Backend,
}

/// The values of one step's composed update at once, at most (see [`AdamW::composed_update`]).
const COMPOSED_BATCH: usize = 1 << 24;

/// What every variable's update in a step shares.
struct Constants {
    betas: (f64, f64),
    eps: f64,
    /// `1 - beta^step` of each moment.
    bias: (f64, f64),
    lr: f64,
    grad_scale: f64,
    weight_decay: f64,
}

impl Part {
    fn len(&self) -> usize {
        self.shape.elem_count()
    }

    /// What the weights are multiplied by before the update: `1 - lr wd` where decayed.
    fn decay_factor(&self, lr: f64, weight_decay: f64) -> f64 {
        if self.decay && weight_decay > 0.0 {
            1.0 - lr * weight_decay
        } else {
            1.0
        }
    }
}

impl Slot {
    /// The part's values in `t` (the variable, its gradient), flat.
    fn of(t: &Tensor, part: &Part) -> Result<Tensor> {
        Ok(t.flatten_all()?.narrow(0, part.offset, part.len())?)
    }

    /// The part's moments `[m; v]`, flat (a view: writes reach the slot's moments).
    fn moments_of(&self, part: &Part) -> Result<Tensor> {
        Ok(self.moments.narrow(0, 2 * part.offset, 2 * part.len())?)
    }

    /// Writes `values` (flat) over the part of the variable.
    fn write(&self, part: &Part, values: &Tensor) -> Result<()> {
        if part.offset == 0 && part.len() == self.var.elem_count() {
            self.var.set(&values.reshape(self.var.shape())?)?;
        } else {
            self.var.as_detached_tensor().flatten_all()?.slice_set(
                &values.contiguous()?,
                0,
                part.offset,
            )?;
        }
        Ok(())
    }

    /// Parts updated together by the composition share these: the decay, the dtype and the
    /// device.
    fn group_key(&self, part: &Part) -> (bool, DType, candle::DeviceLocation) {
        (part.decay, self.var.dtype(), self.var.device().location())
    }

    /// Sets the part's values below its lower bound to it.
    fn project(&self, part: &Part) -> Result<()> {
        if let Some(lo) = part.lower_bound {
            let w = Self::of(&self.var.as_detached_tensor(), part)?;
            self.write(part, &w.clamp(lo, f64::MAX)?)?;
        }
        Ok(())
    }
}

impl AdamW {
    /// AdamW over `vars` (name, variable) with `config`, every one decayed and none bounded;
    /// [`AdamW::from_store`] applies what a store holds (exemptions from decay, bounds).
    pub fn new(vars: Vec<(String, Var)>, config: AdamWConfig) -> Result<Self> {
        let vars = vars
            .into_iter()
            .map(|(name, var)| crate::params::StoredVar {
                parts: vec![(name, 0, var.shape().clone())],
                var,
            })
            .collect();
        Self::over(vars, config, |_| (true, None))
    }

    /// AdamW over `vars`, each named parameter's decay and bound from `rules`.
    fn over(
        vars: Vec<crate::params::StoredVar>,
        config: AdamWConfig,
        rules: impl Fn(&str) -> (bool, Option<f64>),
    ) -> Result<Self> {
        let slots = vars
            .into_iter()
            .map(|stored| {
                let parts = stored
                    .parts
                    .into_iter()
                    .map(|(name, offset, shape)| {
                        let (decay, lower_bound) = rules(&name);
                        Part {
                            name,
                            offset,
                            shape,
                            decay,
                            lower_bound,
                        }
                    })
                    .collect();
                let var = stored.var;
                Ok(Slot {
                    moments: Tensor::zeros(2 * var.elem_count(), var.dtype(), var.device())?,
                    parts,
                    var,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            slots,
            step: 0,
            config,
            batch_values: COMPOSED_BATCH,
            backend: crate::nn::Backend::default(),
        })
    }

    /// This optimizer updating where `backend` says: the backend of the model it trains (by
    /// default [`crate::nn::Backend::default`]).
    pub fn with_backend(mut self, backend: crate::nn::Backend) -> Self {
        self.set_backend(backend);
        self
    }

    /// Updates where `backend` says from now on ([`AdamW::with_backend`]).
    pub fn set_backend(&mut self, backend: crate::nn::Backend) {
        self.backend = backend;
    }

    /// AdamW over every variable of `store`, each bounded variable kept at or above the bound
    /// the store holds ([`crate::ParamStore::constrain`]) after every step, and not decayed.
    /// A packed variable ([`crate::ParamStore::pack`]) is one slot whose named parameters keep
    /// their own decay (and state names); what packing added, zeros and constants, is left as
    /// it is.
    pub fn from_store(store: &crate::ParamStore, config: AdamWConfig) -> Result<Self> {
        Self::over(store.stored_vars(), config, |name| {
            (store.decays(name), store.bound(name))
        })
    }

    /// Updates taken so far.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// One update with learning rate `lr`, every gradient multiplied by `grad_scale` (gradient
    /// clipping).
    pub fn step(&mut self, grads: &GradStore, lr: f64, grad_scale: f64) -> Result<()> {
        self.step += 1;
        let AdamWConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.config;
        let bias1 = 1.0 - beta1.powi(self.step as i32);
        let bias2 = 1.0 - beta2.powi(self.step as i32);
        // The parts the fused kernels do not update (a GPU's, the reference kernels'), with
        // their gradients, grouped by what their update shares: the decay, dtype and device.
        let mut groups: Vec<Vec<(usize, usize, Tensor)>> = Vec::new();
        // The variables the device path updates (CUDA's, or its CPU twin's), all at once.
        let mut on_device: Vec<(usize, Tensor)> = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            let Some(g) = grads.get(slot.var.as_tensor()) else {
                continue;
            };
            // A variable's gradient may carry the graph it was computed from (candle detaches
            // the gradients of intermediate nodes only); the moments made from it would hold
            // that graph, and with it every step's activations, from step to step.
            let g = g.detach();
            if self.backend.device_optimizer(&g) {
                on_device.push((i, g.contiguous()?));
                continue;
            }
            if self.backend.path(&g) == crate::nn::Path::Fused {
                let w = slot.var.as_detached_tensor();
                for part in &slot.parts {
                    crate::kernels::cpu::adamw_step(
                        &Slot::of(&w, part)?,
                        &slot.moments_of(part)?,
                        &Slot::of(&g, part)?,
                        (beta1, beta2, eps),
                        grad_scale,
                        lr,
                        part.decay_factor(lr, weight_decay),
                        (bias1, bias2),
                    )?;
                    slot.project(part)?;
                }
                continue;
            }
            for (j, part) in slot.parts.iter().enumerate() {
                let key = slot.group_key(part);
                let entry = (i, j, Slot::of(&g, part)?);
                match groups.iter_mut().find(|group| {
                    let (i, j, _) = group[0];
                    self.slots[i].group_key(&self.slots[i].parts[j]) == key
                }) {
                    Some(group) => group.push(entry),
                    None => groups.push(vec![entry]),
                }
            }
        }
        self.device_update(
            &on_device,
            &crate::kernels::gpu::AdamWStep {
                beta1,
                beta2,
                eps,
                bias1,
                bias2,
                lr,
                grad_scale,
            },
            weight_decay,
        )?;
        let constants = Constants {
            betas: (beta1, beta2),
            eps,
            bias: (bias1, bias2),
            lr,
            grad_scale,
            weight_decay,
        };
        for group in groups {
            // A bounded number of values at once: the update's temporaries stay bounded.
            let mut start = 0;
            while start < group.len() {
                let mut end = start;
                let mut values = 0;
                while end < group.len()
                    && (end == start || values + group[end].2.elem_count() <= self.batch_values)
                {
                    values += group[end].2.elem_count();
                    end += 1;
                }
                self.composed_update(&group[start..end], &constants)?;
                start = end;
            }
        }
        Ok(())
    }

    /// The update of `vars` (slot, gradient) on the device path: per device, every named part
    /// of every variable in one multi-tensor launch, weights and moments in place, the bounded
    /// ones held at their bound in the same launch.
    fn device_update(
        &mut self,
        vars: &[(usize, Tensor)],
        step: &crate::kernels::gpu::AdamWStep,
        weight_decay: f64,
    ) -> Result<()> {
        use crate::kernels::gpu as device;
        let mut devices: Vec<candle::DeviceLocation> = Vec::new();
        for (_, g) in vars {
            if !devices.contains(&g.device().location()) {
                devices.push(g.device().location());
            }
        }
        for location in devices {
            let here: Vec<&(usize, Tensor)> = vars
                .iter()
                .filter(|(_, g)| g.device().location() == location)
                .collect();
            let slots = &self.slots;
            let mut tensors = Vec::with_capacity(2 * here.len());
            for (i, _) in &here {
                tensors.push(slots[*i].var.as_tensor());
                tensors.push(&slots[*i].moments);
            }
            let grads: Vec<device::Held<'_>> =
                here.iter().map(|(_, g)| device::Held::of(g)).collect();
            let stream = device::stream_for(here[0].1.device())?;
            device::with_writable(&tensors, |mems| {
                let mut parts = Vec::new();
                for (((i, _), wm), g) in here.iter().zip(mems.chunks_exact(2)).zip(&grads) {
                    let g = g.mem()?;
                    for part in &slots[*i].parts {
                        let (at, n) = (part.offset, part.len());
                        parts.push(device::AdamWPart {
                            w: wm[0].at(at, n)?,
                            g: g.at(at, n)?,
                            mv: wm[1].at(2 * at, 2 * n)?,
                            decay_factor: part.decay_factor(step.lr, weight_decay),
                            lower: part.lower_bound,
                        });
                    }
                }
                stream.adamw(&parts, step)
            })?;
        }
        Ok(())
    }

    /// AdamW as a composition of tensor ops over several parameters at once, `(slot, part,
    /// gradient)` of one group: their gradients, moments and weights laid end to end, the
    /// update computed on those, and each parameter's part written back. The same elementwise
    /// operations as one parameter at a time, so the same bits, in about a dozen kernel
    /// launches for the group instead of about twenty per parameter (on a GPU, where each
    /// launch costs more than the arithmetic of a small variable).
    fn composed_update(&mut self, group: &[(usize, usize, Tensor)], c: &Constants) -> Result<()> {
        let (beta1, beta2) = c.betas;
        let slots = &self.slots;
        // The group's parts laid end to end.
        let moment = |k: usize| -> Result<Tensor> {
            let parts = group
                .iter()
                .map(|(i, j, _)| {
                    let part = &slots[*i].parts[*j];
                    let n = part.len();
                    Ok(slots[*i].moments_of(part)?.narrow(0, k * n, n)?)
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Tensor::cat(&parts, 0)?)
        };
        let gradients: Vec<&Tensor> = group.iter().map(|(_, _, g)| g).collect();
        let g = Tensor::cat(&gradients, 0)?;
        let g = if c.grad_scale == 1.0 {
            g
        } else {
            (g * c.grad_scale)?
        };
        let m = ((moment(0)? * beta1)? + (&g * (1.0 - beta1))?)?;
        let v = ((moment(1)? * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
        let m_hat = (&m / c.bias.0)?;
        let v_hat = (&v / c.bias.1)?;
        let update = (m_hat / (v_hat.sqrt()? + c.eps)?)?;
        let weights = group
            .iter()
            .map(|(i, j, _)| Slot::of(&slots[*i].var.as_detached_tensor(), &slots[*i].parts[*j]))
            .collect::<Result<Vec<_>>>()?;
        let w = Tensor::cat(&weights, 0)?;
        let (i0, j0, _) = group[0];
        let decay_factor = slots[i0].parts[j0].decay_factor(c.lr, c.weight_decay);
        let w = if decay_factor != 1.0 {
            (w * decay_factor)?
        } else {
            w
        };
        let w = (w - (update * c.lr)?)?;
        let mut at = 0;
        for (i, j, _) in group {
            let slot = &self.slots[*i];
            let part = &slot.parts[*j];
            let n = part.len();
            slot.write(part, &w.narrow(0, at, n)?)?;
            let mv = Tensor::cat(&[m.narrow(0, at, n)?, v.narrow(0, at, n)?], 0)?;
            slot.moments.slice_set(&mv, 0, 2 * part.offset)?;
            slot.project(part)?;
            at += n;
        }
        Ok(())
    }

    /// The moments by name (`m.<var>`, `v.<var>`) and the step count, for a checkpoint.
    pub fn state(&self) -> (HashMap<String, Tensor>, u64) {
        let mut tensors = HashMap::new();
        for slot in &self.slots {
            for part in &slot.parts {
                let mv = slot.moments_of(part).expect("moments hold every part");
                for (k, prefix) in ["m", "v"].into_iter().enumerate() {
                    let moment = mv
                        .narrow(0, k * part.len(), part.len())
                        .and_then(|t| t.reshape(&part.shape))
                        .expect("moments hold m and v");
                    tensors.insert(format!("{prefix}.{}", part.name), moment);
                }
            }
        }
        (tensors, self.step)
    }

    /// Restores [`AdamW::state`]; every moment must be present with its variable's shape.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step: u64) -> Result<()> {
        for slot in &mut self.slots {
            let (dtype, device) = (slot.var.dtype(), slot.var.device().clone());
            let moments = Tensor::zeros(2 * slot.var.elem_count(), dtype, &device)?;
            for part in &slot.parts {
                let mut mv = Vec::with_capacity(2);
                for prefix in ["m", "v"] {
                    let key = format!("{prefix}.{}", part.name);
                    let t = tensors
                        .get(&key)
                        .ok_or_else(|| Error::Input(format!("optimizer state lacks `{key}`")))?;
                    if t.dims() != part.shape.dims() {
                        return Err(Error::Input(format!(
                            "optimizer state `{key}` has shape {:?}, the variable {:?}",
                            t.dims(),
                            part.shape.dims()
                        )));
                    }
                    mv.push(t.to_dtype(dtype)?.to_device(&device)?.flatten_all()?);
                }
                moments.slice_set(&Tensor::cat(&mv, 0)?, 0, 2 * part.offset)?;
            }
            slot.moments = moments;
        }
        self.step = step;
        Ok(())
    }
}

/// The L2 norm of all gradients of `vars` together ([`grad_norm`] of those that have one).
pub fn global_grad_norm(
    grads: &GradStore,
    vars: &[Var],
    backend: crate::nn::Backend,
) -> Result<f64> {
    let gradients: Vec<Tensor> = vars
        .iter()
        .filter_map(|var| grads.get(var.as_tensor()).cloned())
        .collect();
    grad_norm(&gradients, backend)
}

/// The L2 norm of `gradients` together: each one's sum of squares (in its dtype), then their
/// sum in f64, in the order given.
///
/// The squares are summed on the gradients' device and read back once: on a GPU, one wait for
/// the queued work per step instead of one per variable. Where the optimizer takes the device
/// path (CUDA), every gradient's squares are summed in f64 by one multi-tensor launch
/// (`device_sum_squares`) instead of four launches a gradient; their sum is then taken in the
/// same order.
pub fn grad_norm(gradients: &[Tensor], backend: crate::nn::Backend) -> Result<f64> {
    Ok(grad_norm_with(gradients, None, backend)?.0)
}

/// [`grad_norm`], and the value of the one-value tensor `with` (the loss, as f64) read in the
/// same copy: a training step's one read from a GPU.
pub fn grad_norm_with(
    gradients: &[Tensor],
    with: Option<&Tensor>,
    backend: crate::nn::Backend,
) -> Result<(f64, Option<f64>)> {
    if let Some(with) = with {
        if with.elem_count() != 1 {
            return Err(Error::Input(format!(
                "a value read with the gradient norm must be one value, not {:?}",
                with.dims()
            )));
        }
    }
    if let Some((sums, value)) = device_sum_squares(gradients, with, backend)? {
        return Ok((sums.iter().sum::<f64>().sqrt(), value));
    }
    let squares = gradients
        .iter()
        .map(|g| g.sqr()?.sum_all()?.to_dtype(DType::F64))
        .collect::<candle::Result<Vec<_>>>()?;
    let total = match squares.is_empty() {
        true => Tensor::zeros(
            1,
            DType::F64,
            with.map_or(&candle::Device::Cpu, |w| w.device()),
        )?,
        false => Tensor::stack(&squares, 0)?.sum_all()?.reshape(1)?,
    };
    let read = match with {
        Some(w) => Tensor::cat(&[total, w.to_dtype(DType::F64)?.reshape(1)?], 0)?,
        None => total,
    };
    let values = read.to_vec1::<f64>()?;
    Ok((values[0].sqrt(), values.get(1).copied()))
}

/// Each gradient's sum of squares in f64 through the device path's one launch, where the
/// optimizer takes that path for every gradient (of one dtype, on one device, contiguous);
/// `None` elsewhere.
fn device_sum_squares(
    gradients: &[Tensor],
    with: Option<&Tensor>,
    backend: crate::nn::Backend,
) -> Result<Option<(Vec<f64>, Option<f64>)>> {
    use crate::kernels::gpu as device;
    let Some(first) = gradients.first() else {
        return Ok(None);
    };
    let on_path = gradients.iter().all(|g| {
        backend.device_optimizer(g)
            && g.dtype() == first.dtype()
            && g.device().same_device(first.device())
            && g.is_contiguous()
    });
    let with_on_path = with.is_none_or(|w| w.device().same_device(first.device()));
    if !on_path || !with_on_path {
        return Ok(None);
    }
    let held: Vec<device::Held<'_>> = gradients.iter().map(device::Held::of).collect();
    let mems = held
        .iter()
        .map(|h| h.mem())
        .collect::<candle::Result<Vec<_>>>()?;
    let with = with.map(Tensor::contiguous).transpose()?;
    let with_held = with.as_ref().map(device::Held::of);
    let with_mem = with_held.as_ref().map(device::Held::mem).transpose()?;
    let stream = device::stream_for(first.device())?;
    let read = stream.sum_squares(&mems, with_mem)?;
    Ok(Some((read.sums, read.with)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::Device;

    /// `f` given the backend of `kernels`: a test's choice, as a value.
    fn with_kernels<R>(kernels: crate::nn::Kernels, f: impl FnOnce(crate::nn::Backend) -> R) -> R {
        f(crate::nn::Backend::default().with_kernels(kernels))
    }

    #[test]
    fn matches_a_hand_computed_adamw_step() {
        // One scalar, w = 1, loss = 3w: g = 3. Step 1: m_hat = 3, v_hat = 9, update = 3/(3+eps).
        let w = Var::new(&[1.0f64], &Device::Cpu).unwrap();
        let config = AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(vec![("w.weight".into(), w.clone())], config).unwrap();
        let grads = (w.as_tensor() * 3.0)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        opt.step(&grads, 0.01, 1.0).unwrap();
        let expected = 1.0 * (1.0 - 0.01 * 0.1) - 0.01 * 3.0 / (3.0 + 1e-8);
        let got = w.to_vec1::<f64>().unwrap()[0];
        assert!((got - expected).abs() < 1e-15, "{got} vs {expected}");
        let (state, step) = opt.state();
        assert_eq!(step, 1);
        let m = state["m.w.weight"].to_vec1::<f64>().unwrap()[0];
        assert!((m - 0.3).abs() < 1e-15, "first moment {m}");
    }

    #[test]
    fn the_moments_hold_no_graph_when_a_gradient_carries_one() {
        // candle leaves a variable's gradient undetached: one built from tracked tensors (as a
        // custom op's backward may hand it) carries their graph. The moments must not keep it
        // from step to step, in the composed update (the GPU's) or the fused one.
        for kernels in [crate::nn::Kernels::Reference, crate::nn::Kernels::Ops] {
            with_kernels(kernels, |backend| {
                let w = Var::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
                let mut opt = AdamW::new(vec![("w".into(), w.clone())], AdamWConfig::default())
                    .unwrap()
                    .with_backend(backend);
                for _ in 0..2 {
                    let mut grads = (w.as_tensor() * 3.0)
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let tracked = (w.as_tensor() * 2.0).unwrap();
                    assert!(tracked.track_op());
                    grads.insert(w.as_tensor(), tracked);
                    opt.step(&grads, 0.01, 0.5).unwrap();
                }
                for (name, moment) in opt.state().0 {
                    assert!(!moment.track_op(), "{kernels:?}: {name} holds a graph");
                }
                assert!(!w.as_detached_tensor().track_op());
            });
        }
    }

    #[test]
    fn the_grouped_composition_gives_each_variables_own_bits() {
        // The composed update (a GPU's) lays the variables of a group end to end; each value
        // must come out as the update of its variable alone gives it: decayed and undecayed
        // groups, a bounded variable, a variable without a gradient in one step, clipping,
        // and groups split into batches of a few values.
        use rand::{Rng as _, SeedableRng};
        let config = AdamWConfig {
            beta1: 0.9,
            beta2: 0.98,
            eps: 1e-6,
            weight_decay: 0.05,
        };
        let sizes = [
            ("a.weight", vec![4, 9]),
            ("a.bias", vec![4]),
            ("b.weight", vec![7]),
            ("c.scale", vec![3]),
        ];
        // The composition in one batch and in batches of 10 values, then the device path (its
        // multi-tensor update, by its CPU twin): every one gives each variable's own bits.
        for (batch_values, device) in [(usize::MAX, false), (10, false), (usize::MAX, true)] {
            let kernels = match device {
                false => crate::nn::Kernels::Reference,
                true => crate::nn::Kernels::Layer,
            };
            let before = crate::kernels::gpu::counts();
            let backend = crate::nn::Backend::default().with_kernels(kernels);
            let backend = if device {
                backend.as_on_cuda()
            } else {
                backend
            };
            {
                {
                    let mut rng = crate::rng::Rng::seed_from_u64(8);
                    let mut random = |dims: &[usize]| -> Tensor {
                        let n: usize = dims.iter().product();
                        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
                        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
                    };
                    let vars: Vec<(String, Var)> = sizes
                        .iter()
                        .map(|(name, dims)| {
                            (name.to_string(), Var::from_tensor(&random(dims)).unwrap())
                        })
                        .collect();
                    // The reference: each variable alone, as the composition did.
                    let own: Vec<(Var, Tensor)> = vars
                        .iter()
                        .map(|(_, v)| {
                            let copy = Var::from_tensor(&v.as_tensor().copy().unwrap()).unwrap();
                            let mut dims = vec![2];
                            dims.extend_from_slice(v.dims());
                            (copy, Tensor::zeros(dims, DType::F32, &Device::Cpu).unwrap())
                        })
                        .collect();
                    let mut own = own;
                    let mut opt = AdamW::new(vars.clone(), config)
                        .unwrap()
                        .with_backend(backend);
                    opt.batch_values = batch_values;
                    opt.slots[1].parts[0].decay = false; // a bias
                    opt.slots[3].parts[0].decay = false;
                    opt.slots[3].parts[0].lower_bound = Some(0.2);
                    for step in 1..=4u64 {
                        let (lr, scale) = (0.01 * step as f64, if step == 2 { 0.5 } else { 1.0 });
                        let mut grads = (vars[0].1.as_tensor().sum_all().unwrap() * 0.0)
                            .unwrap()
                            .backward()
                            .unwrap();
                        let mut given = Vec::new();
                        for (k, (_, v)) in vars.iter().enumerate() {
                            // c.scale gets no gradient in step 3
                            let g = random(v.dims());
                            if !(k == 3 && step == 3) {
                                grads.insert(v.as_tensor(), g.clone());
                                given.push(Some(g));
                            } else {
                                grads.remove(v.as_tensor());
                                given.push(None);
                            }
                        }
                        opt.step(&grads, lr, scale).unwrap();
                        let bias1 = 1.0 - 0.9f64.powi(step as i32);
                        let bias2 = 1.0 - 0.98f64.powi(step as i32);
                        for (k, ((w, mv), g)) in own.iter_mut().zip(given).enumerate() {
                            let Some(g) = g else { continue };
                            let g = if scale == 1.0 {
                                g
                            } else {
                                (g * scale).unwrap()
                            };
                            let m = ((mv.get(0).unwrap() * 0.9).unwrap()
                                + (&g * (1.0 - 0.9)).unwrap())
                            .unwrap();
                            let v = ((mv.get(1).unwrap() * 0.98).unwrap()
                                + (g.sqr().unwrap() * (1.0 - 0.98)).unwrap())
                            .unwrap();
                            let update = ((&m / bias1).unwrap()
                                / ((&v / bias2).unwrap().sqrt().unwrap() + 1e-6).unwrap())
                            .unwrap();
                            let decayed = k == 0 || k == 2;
                            let x = w.as_detached_tensor();
                            let x = if decayed {
                                (x * (1.0 - lr * 0.05)).unwrap()
                            } else {
                                x
                            };
                            let mut x = (x - (update * lr).unwrap()).unwrap();
                            if k == 3 {
                                x = x.clamp(0.2, f64::MAX).unwrap();
                            }
                            w.set(&x).unwrap();
                            *mv = Tensor::stack(&[m, v], 0).unwrap();
                        }
                    }
                    let bits = |t: &Tensor| -> Vec<u32> {
                        t.flatten_all()
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap()
                            .iter()
                            .map(|x| x.to_bits())
                            .collect()
                    };
                    // The device path divides by the bias corrections where the composition
                    // multiplies by their reciprocals (candle's `tensor / scalar`): 1 ulp apart
                    // now and then, so it is held to 1e-6 (and to the fused CPU update's bits in
                    // `the_device_update_gives_the_fused_cpu_bits`).
                    let close = |a: &Tensor, b: &Tensor, what: &str| {
                        if !device {
                            return assert_eq!(bits(a), bits(b), "{what}");
                        }
                        let (a, b) = (values(a), values(b));
                        for (x, y) in a.iter().zip(&b) {
                            assert!(
                                (x - y).abs() <= 1e-6 * y.abs().max(1e-3),
                                "{what}: {x} vs {y}"
                            );
                        }
                    };
                    for (k, ((name, v), (w, mv))) in vars.iter().zip(&own).enumerate() {
                        let what = format!("{name}: weights (batches of {batch_values})");
                        close(v.as_tensor(), w.as_tensor(), &what);
                        close(&opt.slots[k].moments, mv, &format!("{name}: moments"));
                    }
                }
            }
            // The device path: one kernel a step (after one copy of the variables' addresses).
            let launched = (crate::kernels::gpu::counts() - before).kernels;
            assert_eq!(launched, if device { 4 } else { 0 }, "device {device}");
        }
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    #[test]
    fn the_device_update_gives_the_fused_cpu_bits() {
        // The device path's multi-tensor AdamW (its CPU twin) and the CPU's fused update do the
        // same arithmetic in the same order: the same bits, over steps with decay, clipping and
        // a bound.
        use rand::{Rng as _, SeedableRng};
        let train = |device: bool| -> Vec<Vec<f32>> {
            let backend = crate::nn::Backend::default().with_kernels(crate::nn::Kernels::Layer);
            let backend = if device {
                backend.as_on_cuda()
            } else {
                backend
            };
            let run = || {
                let mut rng = crate::rng::Rng::seed_from_u64(3);
                let mut random = |n: usize| -> Tensor {
                    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
                    Tensor::from_vec(v, n, &Device::Cpu).unwrap()
                };
                let vars: Vec<(String, Var)> = [("w", 70_000), ("b", 5), ("s", 3)]
                    .iter()
                    .map(|(name, n)| (name.to_string(), Var::from_tensor(&random(*n)).unwrap()))
                    .collect();
                let mut opt = AdamW::new(vars.clone(), AdamWConfig::default())
                    .unwrap()
                    .with_backend(backend);
                opt.slots[1].parts[0].decay = false;
                opt.slots[2].parts[0].lower_bound = Some(0.1);
                for step in 1..=3 {
                    let mut grads = (vars[0].1.as_tensor().sum_all().unwrap() * 0.0)
                        .unwrap()
                        .backward()
                        .unwrap();
                    for (_, v) in &vars {
                        grads.insert(v.as_tensor(), random(v.elem_count()));
                    }
                    let scale = if step == 2 { 0.7 } else { 1.0 };
                    opt.step(&grads, 0.01, scale).unwrap();
                }
                let mut out: Vec<Vec<f32>> = vars.iter().map(|(_, v)| values(v)).collect();
                out.extend(opt.slots.iter().map(|s| values(&s.moments)));
                out
            };
            let before = crate::kernels::gpu::counts().kernels;
            let out = run();
            let launched = crate::kernels::gpu::counts().kernels - before;
            assert_eq!(launched, if device { 3 } else { 0 }, "device {device}");
            out
        };
        let bits = |v: Vec<Vec<f32>>| -> Vec<Vec<u32>> {
            v.into_iter()
                .map(|v| v.into_iter().map(f32::to_bits).collect())
                .collect()
        };
        assert_eq!(bits(train(true)), bits(train(false)));
    }

    #[test]
    fn global_norm_covers_every_gradient_and_skips_variables_without_one() {
        // loss = sum(3a) + sum(b^2) with a = [1, 2] (f32), b = [[1, -2], [0, 4]] (f64), and c
        // unused: gradients [3, 3] and [[2, -4], [0, 8]], norm sqrt(18 + 84) = sqrt(102).
        let a = Var::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
        let b = Var::new(&[[1.0f64, -2.0], [0.0, 4.0]], &Device::Cpu).unwrap();
        let c = Var::new(&[5.0f32], &Device::Cpu).unwrap();
        let loss = ((a.as_tensor() * 3.0)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_dtype(DType::F64))
        .unwrap()
        .add(&b.as_tensor().sqr().unwrap().sum_all().unwrap())
        .unwrap();
        let grads = loss.backward().unwrap();
        assert!(grads.get(c.as_tensor()).is_none());
        let backend = crate::nn::Backend::default();
        let norm = global_grad_norm(&grads, &[a, b.clone(), c.clone()], backend).unwrap();
        assert!((norm - 102f64.sqrt()).abs() < 1e-12, "{norm}");
        assert_eq!(global_grad_norm(&grads, &[c], backend).unwrap(), 0.0);
    }

    #[test]
    fn the_device_paths_gradient_norm_is_the_composed_one_in_one_launch() {
        // Views into one packed gradient (as a ParamStore's parts are), longer than one chunk
        // of the kernel, with a known sum of squares: values k / 1000 for k < n, so each part's
        // is sum(k^2) / 1e6 over its range.
        let n = 3 * crate::kernels::gpu::ADAMW_CHUNK / 2 + 7;
        let sum_sq =
            |r: std::ops::Range<usize>| -> f64 { r.map(|k| (k as f64 / 1000.0).powi(2)).sum() };
        for dtype in [DType::F32, DType::F64] {
            let packed = Tensor::arange(0u32, n as u32, &Device::Cpu)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .affine(1e-3, 0.0)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let split = crate::kernels::gpu::ADAMW_CHUNK + 3;
            let parts = vec![
                packed.narrow(0, 0, split).unwrap(),
                packed.narrow(0, split, n - split).unwrap(),
            ];
            let expected = (sum_sq(0..split) + sum_sq(split..n)).sqrt();
            let composed = grad_norm(&parts, crate::nn::Backend::default()).unwrap();
            let before = crate::kernels::gpu::counts();
            let twin = crate::nn::Backend::default().as_on_cuda();
            let device = grad_norm(&parts, twin).unwrap();
            let counts = crate::kernels::gpu::counts() - before;
            // One launch and two copies (the parts' table there, the sums back).
            assert_eq!((counts.kernels, counts.copies), (1, 2), "{dtype:?}");
            // f32: the values are f32 roundings of k / 1000 (relative 6e-8 each); f64 exact
            // up to the order of the sum.
            let tol = if dtype == DType::F32 { 1e-6 } else { 1e-12 };
            assert!(
                (device - expected).abs() <= tol * expected,
                "{dtype:?}: {device} vs {expected}"
            );
            assert!(
                (device - composed).abs() <= tol * expected,
                "{dtype:?}: {device} vs {composed}"
            );
            // The loss read in the same copy: one conversion more, no other read; the same
            // norm, and the loss's value exactly, on both paths.
            let loss = Tensor::new(2.75f32 / 3.0, &Device::Cpu).unwrap();
            let want_loss = f64::from(2.75f32 / 3.0);
            for (backend, norm) in [(crate::nn::Backend::default(), composed), (twin, device)] {
                let before = crate::kernels::gpu::counts();
                let (got, value) = grad_norm_with(&parts, Some(&loss), backend).unwrap();
                let counts = crate::kernels::gpu::counts() - before;
                assert_eq!((got, value), (norm, Some(want_loss)), "{dtype:?}");
                let on_twin = backend.device_optimizer(&parts[0]);
                let copies = if on_twin { 3 } else { 0 };
                assert_eq!(
                    counts.copies, copies,
                    "{dtype:?}: the loss's one conversion"
                );
            }
            let scalar = Tensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
            assert!(grad_norm_with(&parts, Some(&scalar), twin).is_err());
        }
    }

    #[test]
    fn fused_step_matches_the_composition_over_several_steps() {
        use rand::{Rng as _, SeedableRng};
        for dtype in [DType::F32, DType::F64] {
            let run = |kernels: crate::nn::Kernels| {
                with_kernels(kernels, |backend| {
                    let mut rng = crate::rng::Rng::seed_from_u64(4);
                    let mut random = |n: usize| -> Tensor {
                        let v: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
                        Tensor::from_vec(v, n, &Device::Cpu)
                            .unwrap()
                            .to_dtype(dtype)
                            .unwrap()
                    };
                    let vars = [("a.weight", 37), ("a.bias", 5)]
                        .map(|(name, n)| (name.to_string(), Var::from_tensor(&random(n)).unwrap()));
                    let config = AdamWConfig {
                        beta1: 0.9,
                        beta2: 0.98,
                        eps: 1e-6,
                        weight_decay: 0.05,
                    };
                    let mut opt = AdamW::new(vars.to_vec(), config)
                        .unwrap()
                        .with_backend(backend);
                    for step in 0..4 {
                        let r = [random(37), random(5)];
                        let loss = vars
                            .iter()
                            .zip(&r)
                            .map(|((_, v), r)| {
                                v.as_tensor()
                                    .sqr()
                                    .unwrap()
                                    .mul(r)
                                    .unwrap()
                                    .sum_all()
                                    .unwrap()
                            })
                            .reduce(|a, b| (a + b).unwrap())
                            .unwrap();
                        let grads = loss.backward().unwrap();
                        opt.step(&grads, 0.01, if step == 2 { 0.5 } else { 1.0 })
                            .unwrap();
                    }
                    let mut out: Vec<f64> = Vec::new();
                    for (_, v) in &vars {
                        out.extend(v.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap());
                    }
                    let (state, _) = opt.state();
                    let mut keys: Vec<_> = state.keys().cloned().collect();
                    keys.sort();
                    for k in keys {
                        out.extend(
                            state[&k]
                                .to_dtype(DType::F64)
                                .unwrap()
                                .flatten_all()
                                .unwrap()
                                .to_vec1::<f64>()
                                .unwrap(),
                        );
                    }
                    out
                })
            };
            let (fused, reference) = (
                run(crate::nn::Kernels::Layer),
                run(crate::nn::Kernels::Reference),
            );
            let tol = if dtype == DType::F64 { 1e-14 } else { 1e-6 };
            for (i, (a, b)) in fused.iter().zip(&reference).enumerate() {
                assert!(
                    (a - b).abs() <= tol * b.abs().max(1e-3),
                    "{dtype:?} value {i}: fused {a} vs composed {b}"
                );
            }
        }
    }
}
