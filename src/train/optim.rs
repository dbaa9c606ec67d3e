//! AdamW (Loshchilov & Hutter) with decoupled weight decay and an inspectable state.

use std::collections::HashMap;

use candle::backprop::GradStore;
use candle::{DType, Tensor, Var};

use crate::error::{Error, Result};

/// AdamW's constants; the learning rate comes per step from the schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

struct Slot {
    name: String,
    var: Var,
    /// First and second moment estimates.
    m: Tensor,
    v: Tensor,
    decay: bool,
}

/// AdamW as in PyTorch: `w <- w (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)`.
///
/// Biases and LayerNorm parameters are not decayed (decaying them pulls normalisation gains
/// toward zero for no regularising benefit); weights and embeddings are. Variables without a
/// gradient in a step are left as they are.
pub struct AdamW {
    slots: Vec<Slot>,
    step: u64,
    config: AdamWConfig,
}

/// Whether a variable is decayed, by name.
pub fn decays(name: &str) -> bool {
    !(name.ends_with(".bias") || name.contains("norm."))
}

impl AdamW {
    pub fn new(vars: Vec<(String, Var)>, config: AdamWConfig) -> Result<Self> {
        let slots = vars
            .into_iter()
            .map(|(name, var)| {
                Ok(Slot {
                    decay: decays(&name),
                    m: var.zeros_like()?,
                    v: var.zeros_like()?,
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
            let g = if grad_scale == 1.0 {
                g.clone()
            } else {
                (g * grad_scale)?
            };
            slot.m = ((&slot.m * beta1)? + (&g * (1.0 - beta1))?)?;
            slot.v = ((&slot.v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let m_hat = (&slot.m / bias1)?;
            let v_hat = (&slot.v / bias2)?;
            let update = (m_hat / (v_hat.sqrt()? + eps)?)?;
            let w = slot.var.as_detached_tensor();
            let w = if slot.decay && weight_decay > 0.0 {
                (w * (1.0 - lr * weight_decay))?
            } else {
                w
            };
            slot.var.set(&(w - (update * lr)?)?)?;
        }
        Ok(())
    }

    /// The moments by name (`m.<var>`, `v.<var>`) and the step count, for a checkpoint.
    pub fn state(&self) -> (HashMap<String, Tensor>, u64) {
        let mut tensors = HashMap::new();
        for slot in &self.slots {
            tensors.insert(format!("m.{}", slot.name), slot.m.clone());
            tensors.insert(format!("v.{}", slot.name), slot.v.clone());
        }
        (tensors, self.step)
    }

    /// Restores [`AdamW::state`]; every moment must be present with its variable's shape.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step: u64) -> Result<()> {
        for slot in &mut self.slots {
            for (prefix, target) in [("m", &mut slot.m), ("v", &mut slot.v)] {
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
                *target = t.to_dtype(slot.var.dtype())?.to_device(slot.var.device())?;
            }
        }
        self.step = step;
        Ok(())
    }
}

/// The L2 norm of all gradients of `vars` together.
pub fn global_grad_norm(grads: &GradStore, vars: &[Var]) -> Result<f64> {
    let mut sum = 0.0;
    for var in vars {
        if let Some(g) = grads.get(var.as_tensor()) {
            sum += g
                .sqr()?
                .sum_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
        }
    }
    Ok(sum.sqrt())
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
        // A bias is not decayed.
        assert!(!decays("layers.0.attn.q.bias") && !decays("final_norm.weight"));
        assert!(decays("tok_emb.weight") && decays("layers.0.ffn.up.weight"));
        let (state, step) = opt.state();
        assert_eq!(step, 1);
        let m = state["m.w.weight"].to_vec1::<f64>().unwrap()[0];
        assert!((m - 0.3).abs() < 1e-15, "first moment {m}");
    }
}
