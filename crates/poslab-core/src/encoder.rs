//! The transformer encoder, top to bottom.
//!
//! ```text
//! ids (b, t), positions (1 or b, t)                          (default 0..t for every sequence)
//! ids ──tok_emb──▶ (b, t, d_tok) × embed_scale
//!     ──InputPositions::join──▶ (b, t, d_model)              none | add | concat | learned
//!     (+ type_emb[0]) (──embed_norm──▶)                      BERT-family extras, off by default
//!     ──dropout──▶ N × EncoderLayer ──▶ final_norm (pre-norm only) ──▶ (b, t, d_model)
//!
//! EncoderLayer, pre-norm:  x = x + drop(attn(LN(x)));  x = x + drop(ffn(LN(x)))
//!               post-norm: x = LN(x + drop(attn(x)));  x = LN(x + drop(ffn(x)))
//! attn rotates q and k by the positions' RoPE tables (rope | prope), or adds the positions'
//! score bias to its scores (alibi | t5 | kerple | fire | untied), or a bias computed from its
//! own input (fox); padded keys get no weight.
//! ```

use std::sync::{Arc, Mutex};

use candle::{DType, Module, ModuleT, Tensor};
use candle_nn::{Embedding, Init, VarBuilder};
use rand::SeedableRng;

use crate::config::{ModelConfig, NormPlacement};
use crate::error::{Error, Result};
use crate::layers::LayerSpec;
#[cfg(feature = "kernels")]
use crate::nn::{encoder_layer, InputReflections, LayerMasks, LayerShape, Path, TransportShape};
use crate::nn::{
    key_padding_bias, layer_norm_with_bias, AttentionBias, AttentionInputs, Backend, Dropout,
    FeedForward, ForgetGates, LayerBias, LayerNorm, QkScores, Rotary, SelfAttention, SharedRng,
};
use crate::params::LowerBound;
use crate::positional::{
    BiasBatch, InputPositions, LayerBiases, PositionalModule, Positions, ScoreBias,
};
use crate::rng;

/// One layer: self-attention and a feed-forward block, each a residual branch with LayerNorm
/// before (`pre`) or after (`post`) it.
#[derive(Debug)]
pub struct EncoderLayer {
    /// `None` in a first layer without attention norm (ModernBERT's).
    attn_norm: Option<LayerNorm>,
    attn: SelfAttention,
    ffn_norm: LayerNorm,
    ffn: FeedForward,
    dropout: Dropout,
    norm: NormPlacement,
    /// What the layer does with positions and which keys it sees.
    spec: LayerSpec,
    /// Its parameters as one variable, in the fused kernel's order ([`EncoderLayer::pack`]);
    /// the modules then read views of it.
    packed: Option<Tensor>,
    /// Whether `packed` ends with the forget gates the layer computes inside (FoX's).
    packed_gates: bool,
}

impl EncoderLayer {
    /// What weight decay leaves alone: the norms and the biases.
    fn undecayed(&self) -> Vec<Tensor> {
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
    fn new(config: &ModelConfig, i: usize, rng: &SharedRng, vb: VarBuilder) -> Result<Self> {
        let d = config.d_model;
        let eps = config.layer_norm_eps;
        let spec = config.layer_spec(i);
        // A key bias only where q and k are read (rotated, or scored by the scheme): elsewhere
        // softmax cancels it.
        let rotated = config.positional.placement().reads_keys() && spec.positions;
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
    fn pack(&mut self, store: &crate::ParamStore, gates: Option<&mut ForgetGates>) -> Result<()> {
        if !self.fusable() || self.packed.is_some() {
            return Ok(());
        }
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
            return Ok(());
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
        self.packed_gates = gates.is_some();
        if let Some(g) = gates {
            parts.extend([Part(&mut g.weight), Part(&mut g.bias)]);
        }
        self.packed = Some(store.pack(parts)?);
        Ok(())
    }

    /// What the layer does with positions (from `[layers]`; every layer global without it).
    pub fn spec(&self) -> LayerSpec {
        self.spec
    }

    /// The attention input under pre-norm: `xs` normalised, or as it is in a first layer
    /// without attention norm.
    fn pre_norm_input(&self, xs: &Tensor, backend: Backend) -> Result<Tensor> {
        Ok(match &self.attn_norm {
            Some(norm) => norm.forward(xs, backend)?,
            None => xs.clone(),
        })
    }

    /// What attention reads: the input normalised under pre-norm (as it is in a first layer
    /// without attention norm), the input itself under post-norm.
    fn attention_input(&self, xs: &Tensor, backend: Backend) -> Result<Tensor> {
        match self.norm {
            NormPlacement::Pre => self.pre_norm_input(xs, backend),
            NormPlacement::Post => Ok(xs.clone()),
        }
    }

    /// Whether the fused layer kernel computes this layer: it normalises the attention input
    /// and runs a GELU or ReLU feed-forward.
    fn fusable(&self) -> bool {
        self.attn_norm.is_some() && self.ffn.activation().fused().is_some()
    }

    /// The layer's parameters packed in the order of the fused layer kernel:
    /// `attn_norm.{weight,bias}`, `attn.{q,k,v}.weight`, `attn.{q,k,v}.bias` (zeros for a
    /// projection without bias), `attn.o.{weight,bias}`, `ffn_norm.{weight,bias}`,
    /// `ffn.up.{weight,bias}`, `ffn.down.{weight,bias}`, each flattened.
    #[cfg_attr(not(feature = "kernels"), allow(dead_code))]
    fn packed_params(&self, attn_norm: &LayerNorm, gates: Option<&ForgetGates>) -> Result<Tensor> {
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
    fn forward_whole(
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
    /// `reflections` inside; dropout masks are drawn in the order the composition draws them,
    /// so both paths see the same masks.
    fn forward_fused(
        &self,
        xs: &Tensor,
        attn_norm: &LayerNorm,
        inputs: AttentionInputs,
        (gates, reflections): (Option<&ForgetGates>, Option<InputReflections>),
        train: bool,
        backend: Backend,
    ) -> Result<Tensor> {
        let (b, t, d) = xs.dims3()?;
        let (dtype, device) = (xs.dtype(), xs.device());
        let heads = self.attn.n_heads();
        let masks = LayerMasks {
            attention: self.attn.dropout().multipliers(
                &(b, heads, t, t).into(),
                dtype,
                device,
                train,
            )?,
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
            transport: match &reflections {
                Some(r) => Some(TransportShape {
                    heads,
                    taps: r.taps()?,
                }),
                None => None,
            },
        };
        let mut params = self.packed_params(attn_norm, gates)?;
        if let Some(r) = &reflections {
            // The reflections' weights after the layer's own.
            params = Tensor::cat(&[vec![params], r.flat()?].concat(), 0)?;
        }
        Ok(encoder_layer(
            xs,
            &params,
            shape,
            self.attn.fused_core(inputs, backend),
            masks,
            train,
            reflections
                .as_ref()
                .map(InputReflections::spec)
                .transpose()?,
            backend.path(xs) == Path::Device,
        )?)
    }

    /// # Shapes
    /// - `xs`: `(b, t, d_model)`; `inputs`: the padding bias, rotation and score bias;
    ///   `own`: a bias this layer computes from its attention input (FoX), in place of
    ///   `inputs.score_bias`
    /// - returns `(b, t, d_model)`
    fn forward_t(
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

/// What a rotation, score-bias or scores scheme gives every layer for one batch.
struct Placed<'a> {
    rotary: Option<Rotary>,
    /// The rotation of local layers, where `[layers] rope_base` gives them their own base.
    local_rotary: Option<Rotary>,
    biases: Option<LayerBiases>,
    /// Each layer's own scores (`None` for a layer without positions).
    scores: Vec<Option<Box<dyn QkScores + 'a>>>,
}

/// A score bias a layer computes from its own attention input: the module, and the layer.
#[derive(Clone, Copy)]
struct OwnBias<'a> {
    module: &'a ScoreBias,
    layer: usize,
}

/// The bias `own` computes from the attention input `x`, if any.
fn own_bias(own: Option<OwnBias>, x: &Tensor, backend: Backend) -> Result<Option<LayerBias>> {
    match own {
        Some(OwnBias { module, layer }) => module.input_bias(layer, x, backend),
        None => Ok(None),
    }
}

/// One layer's attention scores split into four terms ([`Encoder::score_terms`]).
#[derive(Clone, Debug)]
pub struct ScoreTerms {
    /// The layer.
    pub layer: usize,
    /// The layer's window: a query reads only keys at most this far away (`None`: every key).
    pub max_offset: Option<usize>,
    /// The scores, `(b, h, t, t)`.
    pub scores: Tensor,
    /// content·content, content·position, position·content, position·position, each like
    /// `scores`; they sum to it.
    pub terms: [Tensor; 4],
}

/// A transformer encoder with a swappable positional scheme.
///
/// The scheme acts in exactly one of three places, and [`PositionalModule`] says which: joined
/// with the token embeddings (none, sinusoidal add or concat, learned), a rotation of q and k
/// inside every attention layer (rope, prope), or a bias on every layer's attention scores
/// (alibi, t5, kerple, fire, untied, fox).
#[derive(Debug)]
pub struct Encoder {
    config: ModelConfig,
    tok_emb: Embedding,
    positional: PositionalModule,
    /// The rotation of local layers with their own base (`[layers] rope_base.local`).
    local_rotation: Option<PositionalModule>,
    /// The token-type table `(token_types, d_model)`; its row 0 is added to every token.
    type_emb: Option<Tensor>,
    embed_norm: Option<LayerNorm>,
    embed_dropout: Dropout,
    layers: Vec<EncoderLayer>,
    final_norm: Option<LayerNorm>,
    dropout_rng: SharedRng,
    /// The kernels and instruction sets its passes compute with.
    backend: Backend,
}

impl Encoder {
    /// Builds the encoder of `config` from `vb` (usually [`crate::ParamStore::var_builder`]).
    /// The config is validated here; dropout masks start from seed 0 until
    /// [`Encoder::set_dropout_seed`] is called.
    pub fn new(config: &ModelConfig, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
        crate::limits::check_weights_fit(config.param_count(), &config.sizes())
            .map_err(Error::Config)?;
        if !matches!(
            vb.dtype(),
            DType::F32 | DType::F64 | DType::BF16 | DType::F16
        ) {
            return Err(Error::Config(format!(
                "the encoder's weights are floats: a VarBuilder of {:?} cannot hold them; build \
                 it with DType::F32 (half-precision activations come from the config's dtype)",
                vb.dtype()
            )));
        }
        let dropout_rng: SharedRng = Arc::new(Mutex::new(rng::Rng::seed_from_u64(0)));

        let d_tok = config.token_dim();
        let tok_weight = vb.get_with_hints(
            (config.vocab_size, d_tok),
            "tok_emb.weight",
            Init::Randn {
                mean: 0.0,
                stdev: config.token_init_std.value(config.d_model),
            },
        )?;
        let tok_emb = Embedding::new(tok_weight, d_tok);
        let positional = PositionalModule::new(
            &config.layer_positional(false),
            config.scheme_shape(),
            vb.clone(),
        )?;
        let local = config.layer_positional(true);
        let local_rotation = match (0..config.n_layers).any(|i| config.layer_spec(i).local_base) {
            true if local != config.layer_positional(false) => Some(PositionalModule::new(
                &local,
                config.scheme_shape(),
                vb.clone(),
            )?),
            _ => None,
        };
        let extras = &config.embeddings;
        let type_emb = match extras.token_types {
            0 => None,
            n => Some(vb.get_with_hints(
                (n, config.d_model),
                "type_emb.weight",
                Init::Randn {
                    mean: 0.0,
                    stdev: 0.02,
                },
            )?),
        };
        let norm = |name: &str| {
            layer_norm_with_bias(
                config.d_model,
                config.layer_norm_eps,
                config.bias,
                vb.pp(name),
            )
        };
        let embed_norm = match extras.norm {
            true => Some(norm("embed_norm")?),
            false => None,
        };
        let layers = (0..config.n_layers)
            .map(|i| EncoderLayer::new(config, i, &dropout_rng, vb.pp(format!("layers.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = match config.norm {
            NormPlacement::Pre => Some(norm("final_norm")?),
            NormPlacement::Post => None,
        };
        Ok(Self {
            config: config.clone(),
            tok_emb,
            positional,
            local_rotation,
            type_emb,
            embed_norm,
            embed_dropout: Dropout::new(config.dropout, dropout_rng.clone()),
            layers,
            final_norm,
            dropout_rng,
            backend: Backend::default(),
        })
    }

    /// This encoder computing with `backend` (by default [`Backend::default`]: the fused layer
    /// kernel at the CPU's best SIMD level).
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.set_backend(backend);
        self
    }

    /// Computes with `backend` from now on (see [`Encoder::with_backend`]).
    pub fn set_backend(&mut self, backend: Backend) {
        self.backend = backend;
    }

    /// The kernels and instruction sets this encoder's passes compute with.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The encoder of `config` with its weights drawn from `seed` (the same seed, the same
    /// weights, bit for bit), in f32 on `device`, and the store that holds them (train them
    /// with the lab's `train::Learner` or `train::optim::AdamW::from_store`, save
    /// them with [`ParamStore::save`](crate::ParamStore::save)).
    pub fn seeded(
        config: &ModelConfig,
        seed: u64,
        device: &candle::Device,
    ) -> Result<(Self, crate::ParamStore)> {
        let params = crate::ParamStore::new(seed);
        let encoder = Self::new(config, params.var_builder(DType::F32, device))?;
        params.constrain(&encoder.constraints())?;
        params.exempt_from_decay(&encoder.undecayed());
        Ok((encoder, params))
    }

    /// The config the encoder was built from.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The dtype of its weights and activations.
    pub fn dtype(&self) -> DType {
        self.tok_emb.embeddings().dtype()
    }

    /// Where it computes: its device and backend.
    pub fn compute(&self) -> crate::nn::Compute<'_> {
        crate::nn::Compute {
            device: self.device(),
            backend: self.backend(),
        }
    }

    /// The device its weights live on.
    pub fn device(&self) -> &candle::Device {
        self.tok_emb.embeddings().device()
    }

    /// The token embeddings of `input_ids` `(b, t)`: `(b, t, d_tok)`. On the device path (CUDA)
    /// the lookup's backward is poslab's kernel, not candle's `index_add`, whose CUDA kernel
    /// walks every token in one thread a column.
    fn embed_tokens(&self, input_ids: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "kernels")]
        let table = self.tok_emb.embeddings();
        #[cfg(feature = "kernels")]
        if self.backend.path(table) == Path::Device
            && self.backend.whole_layers(table)
            && input_ids.dtype() == DType::U32
        {
            return Ok(crate::kernels::gpu::lookup::lookup(table, input_ids)?);
        }
        Ok(self.tok_emb.forward(input_ids)?)
    }

    /// The token embedding table, `(vocab_size, d_tok)` (a tied masked-LM decoder reads it).
    pub fn token_embeddings(&self) -> &Tensor {
        self.tok_emb.embeddings()
    }

    /// The positional module, in the place its scheme acts.
    pub fn positional(&self) -> &PositionalModule {
        &self.positional
    }

    /// The input-side positional module (for schemes that act at the input, and `none`).
    pub fn input_positions(&self) -> Option<&InputPositions> {
        match &self.positional {
            PositionalModule::Input(input) => Some(input),
            _ => None,
        }
    }

    /// The learned position table `(max_len, d_model)` of a `learned` or `untied` scheme.
    pub fn learned_table(&self) -> Option<&Tensor> {
        self.positional.learned_table()
    }

    /// The most tokens a sequence may have, where a learned table bounds it: its rows, less
    /// the embedding's `first_position` (RoBERTa's offset).
    pub fn max_positions(&self) -> Option<usize> {
        let first = self.config.embeddings.first_position;
        self.positional
            .max_positions()
            .map(|rows| rows.saturating_sub(first))
    }

    /// `positions` moved to where this encoder's sequences start (`first_position`).
    fn starting_at_first(&self, positions: &Positions) -> Result<Positions> {
        match self.config.embeddings.first_position {
            0 => Ok(positions.clone()),
            first => positions.shifted(first),
        }
    }

    /// Restarts the dropout masks from `seed` (a trainer reseeds per step, so a resumed run draws
    /// the same masks as one that never stopped).
    pub fn set_dropout_seed(&self, seed: u64) {
        *self
            .dropout_rng
            .lock()
            .expect("dropout generator lock poisoned") = rng::Rng::seed_from_u64(seed);
    }

    /// The last hidden states, positions starting at 0.
    ///
    /// # Shapes
    /// - `input_ids`: `(b, t)` of u8, u32 or i64 ids below `vocab_size`
    /// - `attention_mask`: `(b, t)`, 1 for real tokens and 0 for padding; every sequence needs at
    ///   least one real token
    /// - returns `(b, t, d_model)`; values at padded positions are computed but carry no meaning
    pub fn forward_t(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        train: bool,
    ) -> Result<Tensor> {
        self.forward_at(input_ids, attention_mask, 0, train)
    }

    /// As [`Encoder::forward_t`], with the first token at position `start` (the shift test: a
    /// relative scheme should not care, an absolute one may).
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `(b, t)`, as in [`Encoder::forward_t`]
    /// - returns `(b, t, d_model)`
    pub fn forward_at(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        start: usize,
        train: bool,
    ) -> Result<Tensor> {
        let t = input_ids.dim(1).unwrap_or(0);
        let positions = Positions::range(start, t.max(1))?;
        self.forward_with(input_ids, attention_mask, &positions, train)
    }

    /// As [`Encoder::forward_t`], with every token at its own position (randomized positions,
    /// or a reference's `position_ids`).
    ///
    /// # Shapes
    /// - `positions`: `(1 or b, t)`, one row for the whole batch or one per sequence
    pub fn forward_with(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        positions: &Positions,
        train: bool,
    ) -> Result<Tensor> {
        let (b, t) = self.check_input(input_ids, attention_mask)?;
        self.forward_checked(input_ids, attention_mask, positions, train, (b, t))
    }

    /// [`Encoder::forward_with`] of a batch built on the host (the lab's `data::make_batch`),
    /// checked from what was counted there (its largest id and its sequences' lengths) instead
    /// of reading its ids and mask back from the device.
    pub(crate) fn forward_built(
        &self,
        batch: &crate::batch::Batch,
        positions: &Positions,
        train: bool,
    ) -> Result<Tensor> {
        let (b, t) = self.check_shapes(&batch.ids, &batch.mask)?;
        if batch.max_id as usize >= self.config.vocab_size {
            return Err(Error::Input(format!(
                "token id {} is outside the vocabulary of {} ids: the tokenizer and the \
                 model's vocab_size disagree",
                batch.max_id, self.config.vocab_size
            )));
        }
        if batch.lengths.len() != b || batch.lengths.iter().any(|&n| n == 0 || n > t) {
            return Err(Error::Input(format!(
                "a batch of {b} sequences of at most {t} tokens lists the lengths {:?}: every \
                 sequence needs from 1 to {t} real tokens",
                batch.lengths
            )));
        }
        self.forward_checked(&batch.ids, &batch.mask, positions, train, (b, t))
    }

    /// The forward of inputs already checked, `(b, t)` their shape.
    fn forward_checked(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        positions: &Positions,
        train: bool,
        (b, t): (usize, usize),
    ) -> Result<Tensor> {
        positions.check_batch(b, t)?;
        let positions = &self.starting_at_first(positions)?;

        let x = self.embed_tokens(input_ids)?; // (b, t, d_tok)
        let scale = self.config.embed_scale.value(self.config.d_model);
        let x = if scale == 1.0 { x } else { (x * scale)? };
        let params = x.dtype();
        // The scheme, in its one place: the input, a rotation, or a bias on the scores.
        let (x, placed) = self.place(x, positions, attention_mask)?; // (b, t, d_model)

        let x = self.embedding_extras(x)?;
        // Mixed precision: positions join in the parameters' dtype, then the activations
        // move to the compute dtype; the padding and score biases stay put for the f32
        // softmax.
        let x = x.to_dtype(self.config.dtype.compute_dtype(params))?;
        let mut x = self.embed_dropout.forward_t(&x, train)?;

        let padding = key_padding_bias(attention_mask, params)?; // (b, t)
        for (i, layer) in self.layers.iter().enumerate() {
            let (inputs, own) = self.layer_inputs(&placed, &padding, i);
            x = layer.forward_t(&x, inputs, own, train, self.backend)?;
        }
        let x = match &self.final_norm {
            Some(norm) => norm.forward(&x, self.backend)?,
            None => x,
        };
        // Pooling, heads and losses read the parameters' dtype.
        Ok(x.to_dtype(params)?)
    }

    /// The scheme, in its one place, for a batch at `positions`: joined with the token
    /// embeddings `x` (returned), a rotation of q and k, or a bias on the scores.
    ///
    /// # Shapes
    /// - `x`: `(b, t, d_tok)`, returns `(b, t, d_model)`; `mask`: `(b, t)`
    fn place(
        &self,
        x: Tensor,
        positions: &Positions,
        mask: &Tensor,
    ) -> Result<(Tensor, Placed<'_>)> {
        let mut placed = Placed {
            rotary: None,
            local_rotary: None,
            biases: None,
            scores: Vec::new(),
        };
        if let Some(PositionalModule::Rotation(rope)) = &self.local_rotation {
            placed.local_rotary = Some(rope.rotary(positions)?);
        }
        let batch = BiasBatch {
            positions,
            mask: Some(mask),
            dtype: x.dtype(),
            device: x.device(),
            backend: self.backend,
        };
        let x = match &self.positional {
            PositionalModule::Input(input) => input.join(&x, positions, self.backend)?,
            PositionalModule::Rotation(rope) => {
                placed.rotary = Some(rope.rotary(positions)?);
                x
            }
            PositionalModule::ScoreBias(bias) => {
                placed.biases = Some(bias.layer_biases(&batch)?);
                x
            }
            PositionalModule::Scores(scores) => {
                placed.scores = scores.batch_scores(&batch)?;
                x
            }
        };
        Ok((x, placed))
    }

    /// Layer `i`'s attention inputs, and its own bias where the scheme computes it from the
    /// layer's input (FoX).
    fn layer_inputs<'a>(
        &'a self,
        placed: &'a Placed<'a>,
        padding: &'a Tensor,
        i: usize,
    ) -> (AttentionInputs<'a>, Option<OwnBias<'a>>) {
        let spec = self.layers[i].spec;
        let max_offset = spec.max_offset();
        if !spec.positions {
            let inputs = AttentionInputs {
                max_offset,
                ..AttentionInputs::padding(padding)
            };
            return (inputs, None);
        }
        let rotary = match (spec.local_base, &placed.local_rotary) {
            (true, Some(local)) => Some(local),
            _ => placed.rotary.as_ref(),
        };
        let inputs = AttentionInputs {
            key_padding: padding,
            rotary,
            score_bias: placed
                .biases
                .as_ref()
                .and_then(|b| b.layer(i))
                .map(AttentionBias::Table),
            max_offset,
            scores: placed.scores.get(i).and_then(Option::as_deref),
        };
        let own = match (&self.positional, &placed.biases) {
            (PositionalModule::ScoreBias(module), Some(LayerBiases::FromInput)) => {
                Some(OwnBias { module, layer: i })
            }
            _ => None,
        };
        (inputs, own)
    }

    /// Packs each layer's parameters in `store` (the store the encoder was built from) into one
    /// variable a layer, in the order the fused layer kernel reads them: for training, where
    /// each layer is then one node whose gradient lands in one variable (see
    /// [`crate::ParamStore::pack`]). Names, values, saving, loading and every kernel's results
    /// stay as they are; layers the fused kernel does not compute are left unpacked.
    pub fn pack(&mut self, store: &crate::ParamStore) -> Result<()> {
        for (i, layer) in self.layers.iter_mut().enumerate() {
            layer.pack(store, self.positional.input_gates_mut(i))?;
        }
        Ok(())
    }

    /// Bounds the model's variables must stay within, as its modules declare them: an optimizer
    /// applies them after every step (the lab's `train::optim::AdamW::from_store`).
    pub fn constraints(&self) -> Vec<LowerBound> {
        self.positional.constraints()
    }

    /// The variables weight decay leaves alone, as the modules that made them declare them:
    /// LayerNorm gains and shifts, and biases (decaying them pulls normalisation gains toward 0
    /// and shifts the activations' means). Held by [`crate::ParamStore::exempt_from_decay`].
    pub fn undecayed(&self) -> Vec<Tensor> {
        let mut out: Vec<Tensor> = self
            .embed_norm
            .iter()
            .flat_map(LayerNorm::undecayed)
            .collect();
        out.extend(self.positional.undecayed());
        for layer in &self.layers {
            out.extend(layer.undecayed());
        }
        out.extend(self.final_norm.iter().flat_map(LayerNorm::undecayed));
        out
    }

    /// Layer `i`'s score bias for `positions` of sequences with no padding (an attention-bias
    /// scheme whose bias does not depend on the content), `(r, h, t, t)`: what `analyze` shows
    /// of TUPE's position-to-position term and the learned KERPLE, T5 and FIRE biases.
    pub fn score_bias(&self, layer: usize, positions: &Positions) -> Result<Option<Tensor>> {
        match &self.positional {
            PositionalModule::ScoreBias(bias)
                if layer < self.layers.len() && self.layers[layer].spec.positions =>
            {
                let biases = bias.layer_biases(&BiasBatch {
                    positions,
                    mask: None,
                    dtype: self.dtype(),
                    device: self.device(),
                    backend: self.backend,
                })?;
                Ok(biases.layer(layer).cloned())
            }
            _ => Ok(None),
        }
    }

    /// Whether [`Encoder::score_terms`] is defined: positions joined to the token embeddings.
    pub fn has_position_terms(&self) -> bool {
        matches!(&self.positional, PositionalModule::Input(input) if input.splits())
    }

    /// For an encoder whose positions are joined to the token embeddings (`sinusoidal_add`,
    /// `learned`, `sinusoidal_concat`): per layer, the attention scores and their
    /// content·content, content·position, position·content and position·position terms (see
    /// [`SelfAttention::score_terms`]), each `(b, h, t, t)`.
    ///
    /// The residual stream is split as `(h - p) + p`, `p` the positional part of the embedding
    /// ([`crate::positional::InputPositions::split`]: the added vectors, or a concatenation's
    /// `[0 ; PE]` through its projection, where `q = W_q [x ; p] = W_qx x + W_qp p`), which
    /// stay in it additively under pre-norm, so every layer is decomposed; under post-norm the
    /// first LayerNorm mixes them, so only the first layer is. An embedding LayerNorm (BERT's)
    /// is split exactly the same way ([`crate::nn::LayerNorm::split`]: both parts over the sum's
    /// standard deviation, the bias and the token-type row with the content), so a BERT's first
    /// layer is decomposed too: TUPE's analysis of BERT. Layers are returned in order with their
    /// index and their window: a local layer's scores beyond it are never read, and each layer
    /// runs as the model runs it (its window, a local layer's own rotation), so the next layer's
    /// input is the model's.
    pub fn score_terms(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<Vec<ScoreTerms>> {
        let (_, t) = self.check_input(input_ids, attention_mask)?;
        let at = self.starting_at_first(&Positions::range(0, t)?)?;
        let refused = || {
            Error::Input(format!(
                "attention terms need positions joined to the token embeddings \
                 (sinusoidal_add, sinusoidal_concat or learned); this encoder's are `{}`",
                self.config.positional.name()
            ))
        };
        let PositionalModule::Input(input) = &self.positional else {
            return Err(refused());
        };
        let scale = self.config.embed_scale.value(self.config.d_model);
        let tokens = (self.embed_tokens(input_ids)? * scale)?;
        // (b, t, d_model) content and (1 or b, t, d_model) positions, summing to the embedding.
        let split = input.split(&tokens, &at, self.backend)?;
        let (content, positions) = split.ok_or_else(refused)?;
        let content = match &self.type_emb {
            Some(table) => content.broadcast_add(&table.get(0)?)?,
            None => content,
        };
        // The positional part of the residual stream as the first layer receives it.
        let (mut h, positions) = match &self.embed_norm {
            Some(norm) => {
                let (c, p) = norm.split(&content, &positions)?;
                ((c + &p)?, p)
            }
            None => (
                content.broadcast_add(&positions)?,
                positions.broadcast_as(content.shape())?.contiguous()?,
            ),
        };
        let padding = key_padding_bias(attention_mask, h.dtype())?;
        // What each layer reads besides its input (a local layer's rotation), as the model has it.
        let (_, placed) = self.place(tokens.clone(), &at, attention_mask)?;
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let content = (&h - &positions)?;
            let (inputs, own) = self.layer_inputs(&placed, &padding, i);
            let split = match self.config.norm {
                NormPlacement::Pre => {
                    let (c, p) = match &layer.attn_norm {
                        Some(norm) => norm.split(&content, &positions)?,
                        None => (content, positions.clone()),
                    };
                    layer.attn.score_terms(&c, &p, self.backend)?
                }
                NormPlacement::Post if i == 0 => {
                    layer.attn.score_terms(&content, &positions, self.backend)?
                }
                NormPlacement::Post => break,
            };
            out.push(ScoreTerms {
                layer: i,
                max_offset: inputs.max_offset,
                scores: split.0,
                terms: split.1,
            });
            h = layer.forward_t(&h, inputs, own, false, self.backend)?;
        }
        Ok(out)
    }

    /// Runs the batch through every layer with the tokens at `0..t` and no dropout, calling
    /// `visit(layer, its input x, its attention inputs)` before each;
    /// returns the last layer's output (before the final LayerNorm). What the analyses below
    /// read, from one walk.
    fn walk(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        mut visit: impl FnMut(&EncoderLayer, &Tensor, &AttentionInputs) -> Result<()>,
    ) -> Result<Tensor> {
        let (_, t) = self.check_input(input_ids, attention_mask)?;
        let positions = self.starting_at_first(&Positions::range(0, t)?)?;
        let x = self.embed_tokens(input_ids)?;
        let x = (x * self.config.embed_scale.value(self.config.d_model))?;
        let (x, placed) = self.place(x, &positions, attention_mask)?;
        let mut x = self.embedding_extras(x)?;
        let padding = key_padding_bias(attention_mask, x.dtype())?;
        for (i, layer) in self.layers.iter().enumerate() {
            let (inputs, own) = self.layer_inputs(&placed, &padding, i);
            visit(layer, &x, &inputs)?;
            x = layer.forward_t(&x, inputs, own, false, self.backend)?;
        }
        Ok(x)
    }

    /// Every layer's attention scores with and without its rotation, over the tokens at `0..t`:
    /// `c rot(q) rot(k)ᵀ` and `c q kᵀ` (`c` the score scale), each `(b, h, t, t)`, their
    /// difference what the rotation (the position) adds to the content's score. A layer without
    /// a rotation (no positions, or a scheme that does not rotate) gives the same tensor twice.
    pub fn rotation_scores(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let mut out = Vec::with_capacity(self.layers.len());
        let backend = self.backend;
        self.walk(input_ids, attention_mask, |layer, x, inputs| {
            let a = layer.attention_input(x, backend)?;
            let (q, k) = layer.attn.queries_keys(&a, backend)?; // (b, h, t, d_head)
            let c = layer.attn.score_scale();
            let plain = (q.matmul(&k.t()?)? * c)?;
            let rotated = match inputs.rotary {
                Some(r) => (r.apply(&q, backend)?.matmul(&r.apply(&k, backend)?.t()?)? * c)?,
                None => plain.clone(),
            };
            out.push((rotated, plain));
            Ok(())
        })?;
        Ok(out)
    }

    /// Every layer's queries and keys before any rotation, `(b, h, t, d_head)` each, with the
    /// tokens at `0..t`: what RoPE's frequency pairs carry in a trained model.
    pub fn queries_keys(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let mut out = Vec::with_capacity(self.layers.len());
        let backend = self.backend;
        self.walk(input_ids, attention_mask, |layer, x, _| {
            let a = layer.attention_input(x, backend)?;
            out.push(layer.attn.queries_keys(&a, backend)?);
            Ok(())
        })?;
        Ok(out)
    }

    /// The hidden states at every depth, with the tokens at `0..t` and no dropout: the
    /// embeddings (positions joined, the embedding LayerNorm applied), then each layer's output
    /// (the last before the final LayerNorm): transformers' `hidden_states` (whose last entry
    /// is after the final norm for ModernBERT: the last hidden state).
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `(b, t)`; returns `n_layers + 1` tensors `(b, t, d_model)`
    pub fn hidden_states(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let mut out = Vec::with_capacity(self.layers.len() + 1);
        let last = self.walk(input_ids, attention_mask, |_, x, _| {
            out.push(x.clone());
            Ok(())
        })?;
        out.push(last);
        Ok(out)
    }

    /// Every layer's attention input (after its LayerNorm under pre-norm), `(b, t, d_model)`,
    /// with the tokens at `0..t`: what q, k, v (and FoX's gates) are computed from.
    pub fn attention_inputs(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let mut out = Vec::with_capacity(self.layers.len());
        let backend = self.backend;
        self.walk(input_ids, attention_mask, |layer, x, _| {
            out.push(layer.attention_input(x, backend)?);
            Ok(())
        })?;
        Ok(out)
    }

    /// The BERT-family extras after positions join: the token-type row, then the LayerNorm.
    ///
    /// # Shapes
    /// - `x`: `(b, t, d_model)`; returns the same
    fn embedding_extras(&self, x: Tensor) -> Result<Tensor> {
        let x = match &self.type_emb {
            Some(table) => x.broadcast_add(&table.get(0)?)?,
            None => x,
        };
        Ok(match &self.embed_norm {
            Some(norm) => norm.forward(&x, self.backend)?,
            None => x,
        })
    }

    /// Rejects inputs the model cannot take, with the reason and the fix: their shapes, then
    /// their values (read back from the device).
    fn check_input(&self, ids: &Tensor, mask: &Tensor) -> Result<(usize, usize)> {
        let (b, t) = self.check_shapes(ids, mask)?;
        self.check_values(ids, mask, t)?;
        Ok((b, t))
    }

    /// The checks of [`Encoder::check_input`] that read nothing back: shapes and dtypes.
    fn check_shapes(&self, ids: &Tensor, mask: &Tensor) -> Result<(usize, usize)> {
        let (b, t) = ids.dims2().map_err(|_| {
            Error::Input(format!(
                "input_ids must be (batch, seq_len), got shape {:?}",
                ids.shape()
            ))
        })?;
        if mask.dims() != ids.dims() {
            return Err(Error::Input(format!(
                "attention_mask has shape {:?} but input_ids has {:?}: they must match",
                mask.shape(),
                ids.shape()
            )));
        }
        if b == 0 || t == 0 {
            return Err(Error::Input(format!(
                "empty batch: input_ids has shape {:?}",
                ids.shape()
            )));
        }
        if !matches!(ids.dtype(), DType::U8 | DType::U32 | DType::I64) {
            return Err(Error::Input(format!(
                "input_ids must hold integer ids (u8, u32 or i64), got {:?}",
                ids.dtype()
            )));
        }
        Ok((b, t))
    }

    /// The checks of [`Encoder::check_input`] on values: ids within the vocabulary, a mask of
    /// 0 and 1 with a real token in every sequence.
    fn check_values(&self, ids: &Tensor, mask: &Tensor, t: usize) -> Result<()> {
        let vocab = self.config.vocab_size as i64;
        let flat = ids.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
        if let Some((i, &id)) = flat
            .iter()
            .enumerate()
            .find(|(_, &id)| id < 0 || id >= vocab)
        {
            return Err(Error::Input(format!(
                "token id {id} at (sequence {}, position {}) is outside the vocabulary of \
                 {vocab} ids: the tokenizer and the model's vocab_size disagree",
                i / t,
                i % t
            )));
        }
        let mask_rows = mask.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        for (i, row) in mask_rows.iter().enumerate() {
            if let Some(v) = row.iter().find(|&&v| v != 0.0 && v != 1.0) {
                return Err(Error::Input(format!(
                    "attention_mask holds {v} in sequence {i}: use 1 for real tokens and 0 for padding"
                )));
            }
            if row.iter().all(|&v| v == 0.0) {
                return Err(Error::Input(format!(
                    "sequence {i} of the batch has no real tokens (its attention_mask is all 0): \
                     drop empty sequences before encoding"
                )));
            }
        }
        Ok(())
    }
}
