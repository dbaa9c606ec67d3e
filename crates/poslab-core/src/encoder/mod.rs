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

mod checks;
mod layer;
mod probes;

use std::sync::{Arc, Mutex};

use candle::{DType, Module, ModuleT, Tensor};
use candle_nn::{Embedding, Init, VarBuilder};
use rand::SeedableRng;

use crate::config::{ModelConfig, NormPlacement};
use crate::error::{Error, Result};
use crate::nn::{
    key_padding_bias, layer_norm_with_bias, AttentionBias, AttentionInputs, Backend, Dropout,
    LayerNorm, QkScores, Rotary, SharedRng,
};
use crate::params::LowerBound;
use crate::positional::{BiasBatch, InputPositions, LayerBiases, PositionalModule, Positions};
use crate::rng;

pub use layer::EncoderLayer;
use layer::OwnBias;
pub use probes::ScoreTerms;

/// What a rotation, score-bias or scores scheme gives every layer for one batch.
struct Placed<'a> {
    rotary: Option<Rotary>,
    /// The rotation of local layers, where `[layers] rope_base` gives them their own base.
    local_rotary: Option<Rotary>,
    biases: Option<LayerBiases>,
    /// Whether `biases` are given by offset, `(1, h, 2t - 1)` each
    /// ([`crate::positional::BiasModule::offset_biases`]).
    by_offset: bool,
    /// Each layer's own scores (`None` for a layer without positions).
    scores: Vec<Option<Box<dyn QkScores + 'a>>>,
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
    /// Every layer's parameters in one variable, one layer after another, where the layers run
    /// on the device path ([`Encoder::pack`]): there they run as one node.
    stack: Option<Tensor>,
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
            stack: None,
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
        if self.backend.device_layer(self.tok_emb.embeddings()) && input_ids.dtype() == DType::U32 {
            let table = self.tok_emb.embeddings();
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
        let inputs: Vec<_> = (0..self.layers.len())
            .map(|i| self.layer_inputs(&placed, &padding, i))
            .collect();
        #[cfg(feature = "kernels")]
        if let Some(stack) = self.stacked(&x, &inputs) {
            let layers = self.layers.iter().zip(inputs);
            let layers = layers
                .map(|(l, (inputs, own))| l.stack_layer(&x, inputs, own, train, self.backend))
                .collect::<Result<Vec<_>>>()?;
            x = crate::nn::encoder_stack(&x, stack, layers, train)?;
            return self.finish(x, params);
        }
        for (layer, (inputs, own)) in self.layers.iter().zip(inputs) {
            x = layer.forward_t(&x, inputs, own, train, self.backend)?;
        }
        self.finish(x, params)
    }

    /// The final norm, then the parameters' `dtype` (which pooling, heads and losses read).
    fn finish(&self, x: Tensor, dtype: DType) -> Result<Tensor> {
        let x = match &self.final_norm {
            Some(norm) => norm.forward(&x, self.backend)?,
            None => x,
        };
        Ok(x.to_dtype(dtype)?)
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
            by_offset: false,
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
                // The device path's layers read a bias of offsets per tile, with no t × t table.
                let offsets = match self.backend.device_layer(&x) {
                    true => bias.offset_biases(&batch)?,
                    false => None,
                };
                placed.by_offset = offsets.is_some();
                placed.biases = Some(match offsets {
                    Some(offsets) => offsets,
                    None => bias.layer_biases(&batch)?,
                });
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
        let window = spec.keys();
        if !spec.positions {
            let inputs = AttentionInputs {
                window,
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
            score_bias: placed.biases.as_ref().and_then(|b| b.layer(i)).map(
                match placed.by_offset {
                    true => AttentionBias::Offsets,
                    false => AttentionBias::Table,
                },
            ),
            window,
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
    ///
    /// Where the layers run on the device path, every layer's parameters go into one variable,
    /// one layer after another, and the layers then run as one node (the kernels'
    /// `encoder_stack`), where the scheme gives their attention its inputs before the first
    /// layer (not a score function's: those layers keep a variable each).
    pub fn pack(&mut self, store: &crate::ParamStore) -> Result<()> {
        let stacks = self.backend.device_layer(self.tok_emb.embeddings())
            && !matches!(self.positional, PositionalModule::Scores(_))
            && self.stack.is_none()
            && self
                .layers
                .iter()
                .all(|l| l.fusable() && l.packed.is_none());
        let mut gates = self.positional.input_gates_mut().into_iter();
        let mut layers = self.layers.iter_mut().map(|l| (l, gates.next().flatten()));
        if !stacks {
            for (layer, gates) in layers {
                layer.pack(store, gates)?;
            }
            return Ok(());
        }
        let (mut parts, mut lens) = (Vec::new(), Vec::new());
        for (i, (layer, gates)) in layers.by_ref().enumerate() {
            let Some(own) = layer.pack_parts(gates)? else {
                return Err(Error::Config(format!(
                    "layer {i} cannot be packed with the others"
                )));
            };
            lens.push(own.iter().map(crate::params::PackPart::len).sum::<usize>());
            parts.extend(own);
        }
        let stack = store.pack(parts)?;
        let mut at = 0;
        for (layer, len) in self.layers.iter_mut().zip(lens) {
            layer.packed = Some(stack.narrow(0, at, len)?);
            at += len;
        }
        self.stack = Some(stack);
        Ok(())
    }

    /// The stack's packed parameters, where every layer runs in it ([`EncoderLayer::stacks`])
    /// with these `inputs`.
    #[cfg(feature = "kernels")]
    fn stacked(
        &self,
        x: &Tensor,
        inputs: &[(AttentionInputs<'_>, Option<OwnBias<'_>>)],
    ) -> Option<&Tensor> {
        let mut layers = self.layers.iter().zip(inputs);
        match layers.all(|(l, (inputs, own))| l.stacks(x, inputs, *own, self.backend)) {
            true => self.stack.as_ref(),
            false => None,
        }
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
}
