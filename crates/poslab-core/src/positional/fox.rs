//! Data-dependent decay, the Forgetting Transformer's (Lin et al., ICLR 2025), in the
//! bidirectional form of x-transformers' `DataDependentAlibi(causal=False)`: ALiBi whose slope
//! each token sets through a forget gate. A **contextual** scheme: the position signal comes
//! from the content, and no position id is read.
//!
//! Every layer computes `2 · heads` gates from its attention input `x` (the `x` that q, k and v
//! are projected from), `g = log sigmoid(x Wᵀ + b)` (`layers.{i}.attn.fox.{weight,bias}`, `b`
//! starting at 5, so that gates start near 1 and forget little), and with `G` their running sum
//! along the tokens:
//!
//! ```text
//! bias[h, i, j] = G_h[i] - G_h[j]        keys at or before the query (j <= i): the forward
//!                                        gates' sum over tokens j+1..i
//!               = G'_h[j] - G'_h[i]      keys after it (j > i): the backward gates' (heads + h)
//!                                        sum over tokens i+1..j
//! ```
//!
//! Each `g` is at most 0, so the bias is 0 on the diagonal and at most 0 elsewhere: a key's
//! score decays with how much forgetting lies between it and the query. With right padding the
//! sums between two real tokens cover real tokens only, so padding changes nothing at real
//! positions. The paper's model is causal (forward gates only); an encoder needs both
//! directions, which is why there are two gates per head.

use super::{Bench, Describe, Named, Portray, ScoreMemory};
use candle::Tensor;
use candle_nn::{Init, VarBuilder};

use super::{
    BiasBatch, BiasModule, Knobs, LayerBiases, Measure, Placement, Portrait, PositionalModule,
    Scheme, SchemeShape, ScoreBias,
};
use crate::error::Result;
use crate::nn::{AttentionBias, ForgetGates, LayerBias};

/// The gates' initial bias: `sigmoid(5) = 0.993`, little forgetting at the start (FoX's).
pub const FOX_GATE_BIAS: f64 = 5.0;

/// The `fox` scheme (its options are [`super::NoOptions`]).
#[derive(Clone, Copy, Debug)]
pub struct FoxScheme;

impl Named for FoxScheme {
    fn name(&self) -> &'static str {
        "fox"
    }
}

impl Scheme for FoxScheme {
    fn placement(&self) -> Placement {
        Placement::ScoreBias
    }

    fn check_random_positions(&self, range: usize) -> std::result::Result<(), String> {
        Err(format!(
            "random_positions = {range} with positional `fox`: FoX's decay comes from the \
             content (forget gates summed along the tokens) and reads no position ids, so \
             randomizing them would change nothing; remove random_positions"
        ))
    }

    fn param_count(&self, shape: &SchemeShape) -> u128 {
        // Layers without positions (`[layers]`'s `none`) have no gates.
        let (h, d, l) = (
            shape.n_heads as u128,
            shape.d_model as u128,
            shape.layers.count(shape.n_layers) as u128,
        );
        l * (2 * h * d + 2 * h)
    }

    fn build(&self, shape: &SchemeShape, vb: VarBuilder) -> Result<PositionalModule> {
        // Layers without positions (`[layers]`'s `none`) get no gates.
        let layers = (0..shape.n_layers)
            .map(|i| {
                shape
                    .layers
                    .contains(i)
                    .then(|| {
                        FoxGates::new(
                            shape.d_model,
                            shape.n_heads,
                            vb.pp(format!("layers.{i}.attn.fox")),
                        )
                    })
                    .transpose()
            })
            .collect::<Result<_>>()?;
        Ok(PositionalModule::ScoreBias(ScoreBias::new(Fox(layers))))
    }
}

impl Describe for FoxScheme {
    fn describe(&self, shape: &SchemeShape) -> String {
        format!(
            "attention bias from content: per layer, {} forget gates log sigmoid(x W^T + b) of \
             the attention input ({} forward, {} backward), the bias the gates' sum between \
             query and key (b starts at {FOX_GATE_BIAS}); no position ids",
            2 * shape.n_heads,
            shape.n_heads,
            shape.n_heads
        )
    }
}

impl Portray for FoxScheme {
    fn without_model(&self, _knobs: &Knobs) -> std::result::Result<Portrait, String> {
        Err(
            "fox: FoX's bias comes from the content (forget gates of each layer's input), so \
             it exists only in a trained model: give --run DIR of a fox model"
                .into(),
        )
    }

    fn measure(&self) -> Option<Measure> {
        Some(Measure::Gates)
    }
}

impl Bench for FoxScheme {}

impl ScoreMemory for FoxScheme {}

/// One layer's forget gates: `2 · heads` of them, from the attention input.
#[derive(Clone, Debug)]
pub struct FoxGates {
    /// `(2h, d)`: the forward gates' rows, then the backward gates'; and their bias `(2h)`
    gates: ForgetGates,
}

impl FoxGates {
    /// The gates of `heads` heads over a `d_model`-wide input, weights under `vb` (`fox.weight`,
    /// `fox.bias`).
    pub fn new(d_model: usize, heads: usize, vb: VarBuilder) -> Result<Self> {
        let bound = 1.0 / (d_model as f64).sqrt();
        let weight = vb.get_with_hints(
            (2 * heads, d_model),
            "weight",
            Init::Uniform {
                lo: -bound,
                up: bound,
            },
        )?;
        let bias = vb.get_with_hints(2 * heads, "bias", Init::Const(FOX_GATE_BIAS))?;
        Self::from_tensors(weight, bias)
    }

    /// From given weights `(2h, d)` and bias `(2h)` (for tests and analysis).
    pub fn from_tensors(weight: Tensor, bias: Tensor) -> Result<Self> {
        Ok(Self {
            gates: ForgetGates { weight, bias },
        })
    }

    /// The gates as [`ForgetGates`]: their weights, and the composition every path shares.
    pub fn forget_gates(&self) -> &ForgetGates {
        &self.gates
    }

    /// `log sigmoid(x Wᵀ + b)` ([`ForgetGates::log_gates`]).
    ///
    /// # Shapes
    /// - `x`: `(b, t, d)`; returns `(b, t, 2h)`, every value at most 0
    pub fn log_gates(&self, x: &Tensor, backend: crate::nn::Backend) -> Result<Tensor> {
        Ok(self.gates.log_gates(x, backend)?)
    }

    /// The gates' running sums `[G; G']` along the tokens, whose two-sided differences are the
    /// bias (`G[i] - G[j]` for keys at or before the query, `G'[j] - G'[i]` after it): what
    /// attention reads ([`AttentionBias::SidedSums`]).
    ///
    /// # Shapes
    /// - `x`: `(b, t, d)`; returns `(2, b, h, t)`; differentiable in the gates and `x`
    pub fn sums(&self, x: &Tensor, backend: crate::nn::Backend) -> Result<Tensor> {
        Ok(self.gates.sums(x, backend)?)
    }

    /// The bias as a table.
    ///
    /// # Shapes
    /// - `x`: `(b, t, d)`; returns `(b, h, t, t)`; differentiable in the gates and `x`
    pub fn bias(&self, x: &Tensor, backend: crate::nn::Backend) -> Result<Tensor> {
        Ok(AttentionBias::SidedSums(&self.sums(x, backend)?).table(backend)?)
    }
}

/// Every layer's gates; `None` for a layer without positions.
#[derive(Clone, Debug)]
pub struct Fox(pub Vec<Option<FoxGates>>);

impl BiasModule for Fox {
    fn layer_biases(&self, _batch: &BiasBatch) -> Result<LayerBiases> {
        Ok(LayerBiases::FromInput)
    }

    fn undecayed(&self) -> Vec<Tensor> {
        self.0
            .iter()
            .flatten()
            .map(|g| g.gates.bias.clone())
            .collect()
    }

    fn input_bias(
        &self,
        layer: usize,
        x: &Tensor,
        backend: crate::nn::Backend,
    ) -> Result<Option<LayerBias>> {
        self.0
            .get(layer)
            .and_then(Option::as_ref)
            .map(|g| g.sums(x, backend).map(LayerBias::SidedSums))
            .transpose()
    }

    fn input_gates(&self, layer: usize) -> Option<ForgetGates> {
        Some(self.0.get(layer)?.as_ref()?.forget_gates().clone())
    }

    fn input_gates_mut(&mut self) -> Vec<Option<&mut ForgetGates>> {
        self.0
            .iter_mut()
            .map(|g| g.as_mut().map(|g| &mut g.gates))
            .collect()
    }

    fn per_layer(&self) -> bool {
        true
    }

    fn notes(&self) -> Result<Vec<String>> {
        self.0
            .iter()
            .enumerate()
            .map(|(l, g)| {
                let Some(g) = g else {
                    return Ok(format!("layer {l}: no positions"));
                };
                let bias = g
                    .forget_gates()
                    .bias
                    .to_dtype(candle::DType::F64)?
                    .to_vec1::<f64>()?;
                Ok(format!(
                    "layer {l}: gate biases [{}] (forward, then backward)",
                    super::list(&bias)
                ))
            })
            .collect()
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.0
            .iter()
            .flatten()
            .flat_map(|g| [g.gates.weight.clone(), g.gates.bias.clone()])
            .collect()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
