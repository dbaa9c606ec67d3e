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

struct Slot {
    name: String,
    var: Var,
    /// First and second moment estimates `[m; v]`, `(2, ...var shape)`.
    moments: Tensor,
    decay: bool,
    /// Projected back to at least this after every step (see [`AdamW::from_store`]).
    lower_bound: Option<f64>,
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
}

impl Slot {
    /// Sets values below the variable's lower bound to it.
    fn project(&self) -> Result<()> {
        if let Some(lo) = self.lower_bound {
            let w = self.var.as_detached_tensor();
            self.var.set(&w.clamp(lo, f64::MAX)?)?;
        }
        Ok(())
    }
}

impl AdamW {
    /// AdamW over `vars` (name, variable) with `config`, every one decayed and none bounded;
    /// [`AdamW::from_store`] applies what a store holds (exemptions from decay, bounds).
    pub fn new(vars: Vec<(String, Var)>, config: AdamWConfig) -> Result<Self> {
        let slots = vars
            .into_iter()
            .map(|(name, var)| {
                let mut shape = vec![2];
                shape.extend_from_slice(var.dims());
                Ok(Slot {
                    decay: true,
                    lower_bound: None,
                    moments: Tensor::zeros(shape, var.dtype(), var.device())?,
                    name,
                    var,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            slots,
            step: 0,
            config,
        })
    }

    /// AdamW over every variable of `store`, each bounded variable kept at or above the bound
    /// the store holds ([`crate::ParamStore::constrain`]) after every step, and not decayed.
    pub fn from_store(store: &crate::ParamStore, config: AdamWConfig) -> Result<Self> {
        let mut optimizer = Self::new(store.vars(), config)?;
        for slot in &mut optimizer.slots {
            slot.lower_bound = store.bound(&slot.name);
            slot.decay = store.decays(&slot.name);
        }
        Ok(optimizer)
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
        for slot in &mut self.slots {
            let Some(g) = grads.get(slot.var.as_tensor()) else {
                continue;
            };
            // A variable's gradient may carry the graph it was computed from (candle detaches
            // the gradients of intermediate nodes only); the moments made from it would hold
            // that graph, and with it every step's activations, from step to step.
            let g = &g.detach();
            let decay_factor = if slot.decay && weight_decay > 0.0 {
                1.0 - lr * weight_decay
            } else {
                1.0
            };
            if crate::nn::fused_for(g) {
                crate::nn::adamw_step(
                    slot.var.as_tensor(),
                    &slot.moments,
                    g,
                    (beta1, beta2, eps),
                    grad_scale,
                    lr,
                    decay_factor,
                    (bias1, bias2),
                )?;
                slot.project()?;
                continue;
            }
            let g = if grad_scale == 1.0 {
                g.clone()
            } else {
                (g * grad_scale)?
            };
            let m = ((slot.moments.get(0)? * beta1)? + (&g * (1.0 - beta1))?)?;
            let v = ((slot.moments.get(1)? * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let m_hat = (&m / bias1)?;
            let v_hat = (&v / bias2)?;
            let update = (m_hat / (v_hat.sqrt()? + eps)?)?;
            let w = slot.var.as_detached_tensor();
            let w = if decay_factor != 1.0 {
                (w * decay_factor)?
            } else {
                w
            };
            slot.var.set(&(w - (update * lr)?)?)?;
            slot.moments = Tensor::stack(&[m, v], 0)?;
            slot.project()?;
        }
        Ok(())
    }

    /// The moments by name (`m.<var>`, `v.<var>`) and the step count, for a checkpoint.
    pub fn state(&self) -> (HashMap<String, Tensor>, u64) {
        let mut tensors = HashMap::new();
        for slot in &self.slots {
            for (i, prefix) in ["m", "v"].into_iter().enumerate() {
                let moment = slot.moments.get(i).expect("moments hold m and v");
                tensors.insert(format!("{prefix}.{}", slot.name), moment);
            }
        }
        (tensors, self.step)
    }

    /// Restores [`AdamW::state`]; every moment must be present with its variable's shape.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step: u64) -> Result<()> {
        for slot in &mut self.slots {
            let mut moments = Vec::with_capacity(2);
            for prefix in ["m", "v"] {
                let key = format!("{prefix}.{}", slot.name);
                let t = tensors
                    .get(&key)
                    .ok_or_else(|| Error::Input(format!("optimizer state lacks `{key}`")))?;
                if t.dims() != slot.var.dims() {
                    return Err(Error::Input(format!(
                        "optimizer state `{key}` has shape {:?}, the variable {:?}",
                        t.dims(),
                        slot.var.dims()
                    )));
                }
                moments.push(t.to_dtype(slot.var.dtype())?.to_device(slot.var.device())?);
            }
            slot.moments = Tensor::stack(&moments, 0)?;
        }
        self.step = step;
        Ok(())
    }
}

/// The L2 norm of all gradients of `vars` together.
///
/// The squares are summed on the gradients' device and read back once: on a GPU, one wait for
/// the queued work per step instead of one per variable.
pub fn global_grad_norm(grads: &GradStore, vars: &[Var]) -> Result<f64> {
    let squares = vars
        .iter()
        .filter_map(|var| grads.get(var.as_tensor()))
        .map(|g| g.sqr()?.sum_all()?.to_dtype(DType::F64))
        .collect::<candle::Result<Vec<_>>>()?;
    if squares.is_empty() {
        return Ok(0.0);
    }
    Ok(Tensor::stack(&squares, 0)?
        .sum_all()?
        .to_scalar::<f64>()?
        .sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::Device;

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
            crate::nn::with_kernels(kernels, || {
                let w = Var::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
                let mut opt =
                    AdamW::new(vec![("w".into(), w.clone())], AdamWConfig::default()).unwrap();
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
        let norm = global_grad_norm(&grads, &[a, b.clone(), c.clone()]).unwrap();
        assert!((norm - 102f64.sqrt()).abs() < 1e-12, "{norm}");
        assert_eq!(global_grad_norm(&grads, &[c]).unwrap(), 0.0);
    }

    #[test]
    fn fused_step_matches_the_composition_over_several_steps() {
        use rand::{Rng as _, SeedableRng};
        for dtype in [DType::F32, DType::F64] {
            let run = |kernels: crate::nn::Kernels| {
                crate::nn::with_kernels(kernels, || {
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
                    let mut opt = AdamW::new(vars.to_vec(), config).unwrap();
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
