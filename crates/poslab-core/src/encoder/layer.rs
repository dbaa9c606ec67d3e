//! One encoder layer: self-attention and a feed-forward block, each a residual branch with
//! LayerNorm before or after it; on the kernels, the whole layer as one node.

use candle::{ModuleT, Tensor};
use candle_nn::VarBuilder;

use crate::config::{ModelConfig, NormPlacement};
use crate::error::{Error, Result};
use crate::layers::LayerSpec;
#[cfg(feature = "kernels")]
use crate::nn::{
    encoder_layer, AttentionDropout, InputReflections, LayerMasks, LayerShape, Path, StackLayer,
    TransportShape,
};
use crate::nn::{
    layer_norm_with_bias, AttentionBias, AttentionInputs, Backend, Dropout, FeedForward,
    ForgetGates, LayerBias, LayerNorm, SelfAttention, SharedRng,
};
use crate::positional::ScoreBias;

/// One layer: self-attention and a feed-forward block, each a residual branch with LayerNorm
/// before (`pre`) or after (`post`) it.
#[derive(Debug)]
pub struct EncoderLayer {
    /// `None` in a first layer without attention norm (ModernBERT's).
    pub(super) attn_norm: Option<LayerNorm>,
    pub(super) attn: SelfAttention,
    pub(super) ffn_norm: LayerNorm,
    pub(super) ffn: FeedForward,
    pub(super) dropout: Dropout,
    pub(super) norm: NormPlacement,
    /// What the layer does with positions and which keys it sees.
    pub(super) spec: LayerSpec,
    /// Its parameters as one variable, in the fused kernel's order ([`EncoderLayer::pack`]);
    /// the modules then read views of it.
    pub(super) packed: Option<Tensor>,
    /// Whether `packed` ends with the forget gates the layer computes inside (FoX's).
    pub(super) packed_gates: bool,
}

impl EncoderLayer {
    /// What weight decay leaves alone: the norms and the biases.
    pub(super) fn undecayed(&self) -> Vec<Tensor> {
        let mut out: Vec<Tensor> = self
            .attn_norm
            .iter()
            .flat_map(LayerNorm::undecayed)
            .collect();
        out.extend(self.attn.undecayed());
        out.extend(self.ffn_norm.undecayed());
        out.extend(self.ffn.undecayed());
        out
    }
}

impl EncoderLayer {
    pub(super) fn new(
        config: &ModelConfig,
        i: usize,
        rng: &SharedRng,
        vb: VarBuilder,
    ) -> Result<Self> {
        let d = config.d_model;
        let eps = config.layer_norm_eps;
        let spec = config.layer_spec(i);
        // A key bias only where q and k are read (rotated, or scored by the scheme): elsewhere
        // softmax cancels it.
        let rotated = config.positional.reads_keys() && spec.positions;
        let norm = |name: &str| layer_norm_with_bias(d, eps, config.bias, vb.pp(name));
        Ok(Self {
            attn_norm: match i == 0 && !config.first_attn_norm {
                true => None,
                false => Some(norm("attn_norm")?),
            },
            attn: SelfAttention::new(
                d,
                config.n_heads,
                rotated,
                config.bias,
                // TUPE's scale makes room for its positional term, absent without positions.
                match spec.positions {
                    true => config.positional.score_scale(config.head_dim()),
                    false => None,
                },
                Dropout::new(config.attention_dropout, rng.clone()),
                vb.pp("attn"),
            )?,
            ffn_norm: norm("ffn_norm")?,
            ffn: FeedForward::new(
                d,
                config.ffn_dim,
                config.activation,
                config.bias,
                vb.pp("ffn"),
            )?,
            dropout: Dropout::new(config.dropout, rng.clone()),
            norm: config.norm,
            spec,
            packed: None,
            packed_gates: false,
        })
    }

    /// Packs the layer's parameters in `store` into one variable, in the order the fused layer
    /// kernel reads them ([`EncoderLayer::packed_params`]), with the forget `gates` it computes
    /// inside (FoX's) last; its modules then read views of it.
    /// The fused node then takes that variable as it is, and its gradient lands there whole: no
    /// concatenation forward, and no zero-fill and add per parameter backward. A layer the
    /// fused kernel does not compute (no attention norm, GeGLU) stays as it is.
    pub(super) fn pack(
        &mut self,
        store: &crate::ParamStore,
        gates: Option<&mut ForgetGates>,
    ) -> Result<()> {
        if let Some(parts) = self.pack_parts(gates)? {
            let packed = store.pack(parts)?;
            self.packed = Some(packed);
        }
        Ok(())
    }

    /// The parts [`EncoderLayer::pack`] packs, in order (`None` for a layer it leaves as it
    /// is); the caller sets `packed` to their variable.
    pub(super) fn pack_parts<'a>(
        &'a mut self,
        gates: Option<&'a mut ForgetGates>,
    ) -> Result<Option<Vec<crate::params::PackPart<'a>>>> {
        if !self.fusable() || self.packed.is_some() {
            return Ok(None);
        }
        self.packed_gates = gates.is_some();
        use crate::params::PackPart::Tensor as Part;
        let d = self.ffn_norm.weight().dim(0)?;
        let ffn = self.ffn.up().weight().dim(0)?;
        let Self {
            attn_norm: Some(attn_norm),
            attn,
            ffn_norm,
            ffn: feed_forward,
            ..
        } = self
        else {
            return Ok(None);
        };
        fn bias(b: Option<&mut Tensor>, n: usize) -> crate::params::PackPart<'_> {
            match b {
                Some(b) => crate::params::PackPart::Tensor(b),
                None => crate::params::PackPart::Zeros(n),
            }
        }
        let (an_w, an_b) = attn_norm.params_mut();
        let [q, k, v, o] = attn.projections_mut();
        let ((q_w, q_b), (k_w, k_b), (v_w, v_b)) = (q.params_mut(), k.params_mut(), v.params_mut());
        let (o_w, o_b) = o.params_mut();
        let (fn_w, fn_b) = ffn_norm.params_mut();
        let (up, down) = feed_forward.linears_mut();
        let ((up_w, up_b), (down_w, down_b)) = (up.params_mut(), down.params_mut());
        let mut parts = vec![
            Part(an_w),
            Part(an_b),
            Part(q_w),
            Part(k_w),
            Part(v_w),
            bias(q_b, d),
            bias(k_b, d),
            bias(v_b, d),
            Part(o_w),
            bias(o_b, d),
            Part(fn_w),
            Part(fn_b),
            Part(up_w),
            bias(up_b, ffn),
            Part(down_w),
            bias(down_b, d),
        ];
        if let Some(g) = gates {
            parts.extend([Part(&mut g.weight), Part(&mut g.bias)]);
        }
        Ok(Some(parts))
    }

    /// What the layer does with positions (from `[layers]`; every layer global without it).
    pub fn spec(&self) -> LayerSpec {
        self.spec
    }

    /// The attention input under pre-norm: `xs` normalised, or as it is in a first layer
    /// without attention norm.
    pub(super) fn pre_norm_input(&self, xs: &Tensor, backend: Backend) -> Result<Tensor> {
        Ok(match &self.attn_norm {
            Some(norm) => norm.forward(xs, backend)?,
            None => xs.clone(),
        })
    }

    /// What attention reads: the input normalised under pre-norm (as it is in a first layer
    /// without attention norm), the input itself under post-norm.
    pub(super) fn attention_input(&self, xs: &Tensor, backend: Backend) -> Result<Tensor> {
        match self.norm {
            NormPlacement::Pre => self.pre_norm_input(xs, backend),
            NormPlacement::Post => Ok(xs.clone()),
        }
    }

    /// Whether the fused layer kernel computes this layer: it normalises the attention input
    /// and runs a GELU or ReLU feed-forward.
    pub(super) fn fusable(&self) -> bool {
        self.attn_norm.is_some() && self.ffn.activation().fused().is_some()
    }

    /// The layer's parameters packed in the order of the fused layer kernel:
    /// `attn_norm.{weight,bias}`, `attn.{q,k,v}.weight`, `attn.{q,k,v}.bias` (zeros for a
    /// projection without bias), `attn.o.{weight,bias}`, `ffn_norm.{weight,bias}`,
    /// `ffn.up.{weight,bias}`, `ffn.down.{weight,bias}`, each flattened.
    #[cfg_attr(not(feature = "kernels"), allow(dead_code))]
    pub(super) fn packed_params(
        &self,
        attn_norm: &LayerNorm,
        gates: Option<&ForgetGates>,
    ) -> Result<Tensor> {
        if let Some(packed) = &self.packed {
            return Ok(match (gates, self.packed_gates) {
                (None, false) | (Some(_), true) => packed.clone(),
                (Some(g), false) => Tensor::cat(
                    &[packed, &g.weight.flatten_all()?, &g.bias.flatten_all()?],
                    0,
                )?,
                (None, true) => {
                    return Err(Error::Config(
                        "a layer packed with forget gates was run without them".into(),
                    ))
                }
            });
        }
        let (wqkv, bqkv) = self.attn.packed_qkv()?;
        let [_, _, _, o] = self.attn.projections();
        let (up, down) = (self.ffn.up(), self.ffn.down());
        let parts = [
            attn_norm.weight().clone(),
            attn_norm.bias().clone(),
            wqkv,
            bqkv,
            o.weight().clone(),
            o.bias_or_zeros()?,
            self.ffn_norm.weight().clone(),
            self.ffn_norm.bias().clone(),
            up.weight().clone(),
            up.bias_or_zeros()?,
            down.weight().clone(),
            down.bias_or_zeros()?,
        ]
        .into_iter()
        .chain(
            gates
                .into_iter()
                .flat_map(|g| [g.weight.clone(), g.bias.clone()]),
        )
        .map(|p| p.flatten_all());
        let parts = parts.collect::<candle::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// The layer as one node on the kernels ([`Kernels::Layer`](crate::nn::Kernels::Layer)),
    /// where they compute it: a layer with its attention norm and a GELU or ReLU feed-forward,
    /// whose scores are `q kᵀ` or a scheme's own that the fused layer computes (a polar form,
    /// gate counts, or a transport whose reflections it makes from its attention input; on the
    /// CPU: the device path computes `q kᵀ` alone), with no bias of the attention input beside.
    /// `None` where the layer runs as ops.
    #[cfg(feature = "kernels")]
    pub(super) fn forward_whole(
        &self,
        xs: &Tensor,
        inputs: AttentionInputs,
        own: Option<OwnBias>,
        train: bool,
        backend: Backend,
    ) -> Result<Option<Tensor>> {
        let reflections = match (inputs.rotary, inputs.score_bias, inputs.scores) {
            (None, None, Some(s)) => s.input_reflections(),
            _ => None,
        };
        let scores_fuse = match inputs.scores {
            None => true,
            Some(_) => {
                (inputs.fused_scores() || reflections.is_some())
                    && own.is_none()
                    && backend.path(xs) != Path::Device
            }
        };
        let (true, Some(attn_norm), true, true) = (
            backend.whole_layers(xs),
            &self.attn_norm,
            self.fusable(),
            scores_fuse,
        ) else {
            return Ok(None);
        };
        // A bias of the attention input: forget gates (FoX's) the layer computes inside; any
        // other needs that input outside too, where the LayerNorm then runs twice.
        let gates = own.and_then(|o| o.module.input_gates(o.layer));
        let bias = match (own, &gates, self.norm) {
            (None, _, _) | (Some(_), Some(_), _) => None,
            (Some(_), None, NormPlacement::Pre) => {
                own_bias(own, &attn_norm.forward(xs, backend)?, backend)?
            }
            (Some(_), None, NormPlacement::Post) => own_bias(own, xs, backend)?,
        };
        let inputs = AttentionInputs {
            score_bias: bias.as_ref().map(AttentionBias::from).or(inputs.score_bias),
            ..inputs
        };
        let inside = (gates.as_ref(), reflections);
        let out = self.forward_fused(xs, attn_norm, inputs, inside, train, backend)?;
        Ok(Some(out))
    }

    #[cfg(feature = "kernels")]
    /// The layer as one fused node ([`Kernels::Layer`]), computing `gates` or a transport's
    /// `reflections` inside.
    pub(super) fn forward_fused(
        &self,
        xs: &Tensor,
        attn_norm: &LayerNorm,
        inputs: AttentionInputs,
        (gates, reflections): (Option<&ForgetGates>, Option<InputReflections>),
        train: bool,
        backend: Backend,
    ) -> Result<Tensor> {
        let transport = match &reflections {
            Some(r) => Some(TransportShape {
                heads: self.attn.n_heads(),
                taps: r.taps()?,
            }),
            None => None,
        };
        let node = self.fused_node(xs, attn_norm, inputs, gates, transport, train, backend)?;
        let mut params = self.packed_params(attn_norm, gates)?;
        if let Some(r) = &reflections {
            // The reflections' weights after the layer's own.
            params = Tensor::cat(&[vec![params], r.flat()?].concat(), 0)?;
        }
        Ok(encoder_layer(
            xs,
            &params,
            node.shape,
            node.attention,
            node.masks,
            train,
            reflections
                .as_ref()
                .map(InputReflections::spec)
                .transpose()?,
            backend.path(xs) == Path::Device,
        )?)
    }

    /// What the fused node of this layer reads besides its input and parameters; dropout masks
    /// are drawn here, in the order the composition draws them, so both paths see the same
    /// masks.
    #[cfg(feature = "kernels")]
    #[allow(clippy::too_many_arguments)]
    fn fused_node(
        &self,
        xs: &Tensor,
        attn_norm: &LayerNorm,
        inputs: AttentionInputs,
        gates: Option<&ForgetGates>,
        transport: Option<TransportShape>,
        train: bool,
        backend: Backend,
    ) -> Result<StackLayer> {
        let (b, t, d) = xs.dims3()?;
        let (dtype, device) = (xs.dtype(), xs.device());
        let heads = self.attn.n_heads();
        let attention = match backend.path(xs) {
            // Drawn by the device path's kernels from a seed.
            Path::Device => self
                .attn
                .dropout()
                .seeded(train)
                .map(AttentionDropout::Seeded),
            _ => self
                .attn
                .dropout()
                .attention_multipliers(xs, &(b, heads, t, t).into(), train, backend)?
                .map(AttentionDropout::Drawn),
        };
        let masks = LayerMasks {
            attention,
            attention_out: self
                .dropout
                .multipliers(&(b, t, d).into(), dtype, device, train)?,
            ffn_out: self
                .dropout
                .multipliers(&(b, t, d).into(), dtype, device, train)?,
        };
        let shape = LayerShape {
            d,
            ffn: self.ffn.up().weight().dim(0)?,
            eps: attn_norm.eps(),
            pre_norm: self.norm == NormPlacement::Pre,
            activation: match self.ffn.activation().fused() {
                Some(act) => act,
                None => return Err(Error::Config("GeGLU layers run as ops".into())),
            },
            gates: match gates {
                Some(g) => g.weight.dim(0)?,
                None => 0,
            },
            transport,
        };
        Ok(StackLayer {
            shape,
            attention: self.attn.fused_core(inputs, backend),
            masks,
        })
    }

    /// Whether this layer can run as one of a stack of layers on the device path
    /// ([`EncoderLayer::stack_layer`]): where it would run as one node there, packed with its
    /// neighbours ([`super::Encoder::pack`]), with no bias of its attention input computed
    /// outside (FoX's gates are computed inside).
    #[cfg(feature = "kernels")]
    pub(super) fn stacks(
        &self,
        xs: &Tensor,
        inputs: &AttentionInputs,
        own: Option<OwnBias>,
        backend: Backend,
    ) -> bool {
        // Its own bias: none (packed without gates), or gates (packed with them).
        let own_fits = match own {
            None => !self.packed_gates,
            Some(o) => self.packed_gates && o.module.input_gates(o.layer).is_some(),
        };
        backend.path(xs) == Path::Device
            && backend.whole_layers(xs)
            && self.fusable()
            && self.packed.is_some()
            && inputs.scores.is_none()
            && own_fits
    }

    /// This layer as one of a stack ([`EncoderLayer::stacks`]): what its node reads besides
    /// its input and parameters, with its dropout masks drawn.
    #[cfg(feature = "kernels")]
    pub(super) fn stack_layer(
        &self,
        xs: &Tensor,
        inputs: AttentionInputs,
        own: Option<OwnBias>,
        train: bool,
        backend: Backend,
    ) -> Result<StackLayer> {
        let Some(attn_norm) = &self.attn_norm else {
            return Err(Error::Config(
                "a layer without attention norm runs as ops, not in a stack".into(),
            ));
        };
        let gates = own.and_then(|o| o.module.input_gates(o.layer));
        self.fused_node(xs, attn_norm, inputs, gates.as_ref(), None, train, backend)
    }

    /// # Shapes
    /// - `xs`: `(b, t, d_model)`; `inputs`: the padding bias, rotation and score bias;
    ///   `own`: a bias this layer computes from its attention input (FoX), in place of
    ///   `inputs.score_bias`
    /// - returns `(b, t, d_model)`
    pub(super) fn forward_t(
        &self,
        xs: &Tensor,
        inputs: AttentionInputs,
        own: Option<OwnBias>,
        train: bool,
        backend: Backend,
    ) -> Result<Tensor> {
        #[cfg(feature = "kernels")]
        if let Some(out) = self.forward_whole(xs, inputs, own, train, backend)? {
            return Ok(out);
        }
        let own_bias = |x: &Tensor| own_bias(own, x, backend);
        let attn = |x: &Tensor| -> Result<Tensor> {
            let bias = own_bias(x)?;
            let inputs = AttentionInputs {
                score_bias: bias.as_ref().map(AttentionBias::from).or(inputs.score_bias),
                ..inputs
            };
            let y = self.attn.forward_t(x, inputs, train, backend)?;
            Ok(self.dropout.forward_t(&y, train)?)
        };
        let ffn = |x: &Tensor| -> Result<Tensor> {
            Ok(self
                .dropout
                .forward_t(&self.ffn.forward(x, backend)?, train)?)
        };
        Ok(match self.norm {
            NormPlacement::Pre => {
                let xs = (xs + attn(&self.pre_norm_input(xs, backend)?)?)?;
                (&xs + ffn(&self.ffn_norm.forward(&xs, backend)?)?)?
            }
            NormPlacement::Post => {
                // Post-norm layers always have their attention norm (validated).
                let sum = (xs + attn(xs)?)?;
                let xs = match &self.attn_norm {
                    Some(norm) => norm.forward(&sum, backend)?,
                    None => sum,
                };
                self.ffn_norm.forward(&(&xs + ffn(&xs)?)?, backend)?
            }
        })
    }
}

/// A score bias a layer computes from its own attention input: the module, and the layer.
#[derive(Clone, Copy)]
pub(super) struct OwnBias<'a> {
    pub(super) module: &'a ScoreBias,
    pub(super) layer: usize,
}

/// The bias `own` computes from the attention input `x`, if any.
pub(super) fn own_bias(
    own: Option<OwnBias>,
    x: &Tensor,
    backend: Backend,
) -> Result<Option<LayerBias>> {
    match own {
        Some(OwnBias { module, layer }) => module.input_bias(layer, x, backend),
        None => Ok(None),
    }
}
