//! GPT: a decoder-only transformer language model (Radford et al. 2019, GPT-2's layout).
//!
//! Token embedding + learned positional embedding (`context` positions) → dropout →
//! `layers` pre-LayerNorm blocks → final LayerNorm → logits through the **tied** token
//! embedding (no separate output matrix, no output bias). Each block is
//!
//! ```text
//! x = x + dropout(out_proj(causal_attention(LayerNorm(x))))      (heads heads, attention
//!                                                                  weights dropped out too)
//! x = x + dropout(proj(GELU(fc(LayerNorm(x)))))                  (d_model → mlp_ratio·d_model → d_model)
//! ```
//!
//! with biases in every linear layer and LayerNorm, GELU in GPT-2's tanh form, and GPT-2's
//! initialization: weights and embeddings `N(0, 0.02)`, the two residual projections of each
//! block `N(0, 0.02/√(2·layers))`, biases zero, LayerNorm `γ = 1`, `β = 0`.
//!
//! Every batch is independent: nothing is carried from one batch to the next (the state of
//! [`LanguageModel`] is `()`, so [`Model::carried_state`] is
//! empty), and a batch longer than `context` tokens is refused with an error.
//!
//! # Parameters
//!
//! All weights are real matrices in the [`ParamTable`](crate::ParamTable), so matrix methods
//! (PowerSGD) treat them as such: `token_embedding.weight` `[vocab, d_model]`,
//! `position_embedding.weight` `[context, d_model]`, per block `blocks.{i}.attention.{query,
//! key, value, output}.weight` `[d_model, d_model]` (burn layout `[d_in, d_out]`),
//! `blocks.{i}.mlp.fc.weight` `[d_model, mlp_ratio·d_model]`, `blocks.{i}.mlp.proj.weight`
//! `[mlp_ratio·d_model, d_model]`; the biases and the LayerNorms' `gamma` / `beta` are
//! vectors. The count is `V·d + C·d + L·(2·r·d² + 4·d² + (r + 9)·d) + 2·d` for vocabulary
//! `V`, context `C`, width `d`, `L` layers and MLP ratio `r` — 124 439 808 for GPT-2 small.

use burn::module::Param;
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig,
    Linear,
};
use burn::prelude::*;
use burn::tensor::activation::{gelu_approximate, softmax};
use serde::{Deserialize, Serialize};

use crate::family::{autodiff, ModelFamily};
use crate::layers::{check_dropout, check_positive, require_vocab};
use crate::model::{LanguageModel, LmModel, Model};
use crate::ModelError;

/// Standard deviation of GPT-2's weight initialization.
const INIT_STD: f64 = 0.02;

/// Configuration of [`Gpt`].
#[derive(Debug, Clone, PartialEq)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Positions of the learned positional embedding: the longest sequence the model takes.
    pub context: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads per block (must divide `d_model`).
    pub heads: usize,
    /// Number of transformer blocks.
    pub layers: usize,
    /// Hidden width of the MLP as a multiple of `d_model`.
    pub mlp_ratio: usize,
    /// Dropout on the embeddings, the attention weights, and the attention and MLP outputs.
    pub dropout: f64,
}

impl GptConfig {
    /// The "mini" GPT: 4 layers, 256 wide, 4 heads, 256 positions, MLP ratio 4, dropout 0.1
    /// (trainable on a CPU).
    pub fn mini(vocab: usize) -> Self {
        Self {
            vocab,
            context: 256,
            d_model: 256,
            heads: 4,
            layers: 4,
            mlp_ratio: 4,
            dropout: 0.1,
        }
    }

    /// GPT-2 small's shape: 12 layers, 768 wide, 12 heads, 1024 positions, MLP ratio 4,
    /// dropout 0.1 (with GPT-2's 50 257-token vocabulary: 124 439 808 parameters).
    pub fn gpt2_small(vocab: usize) -> Self {
        Self {
            vocab,
            context: 1024,
            d_model: 768,
            heads: 12,
            layers: 12,
            mlp_ratio: 4,
            dropout: 0.1,
        }
    }

    /// Checks the configuration; errors name the key.
    pub fn validate(&self) -> Result<(), ModelError> {
        check_positive("vocab", self.vocab)?;
        check_positive("context", self.context)?;
        check_positive("d_model", self.d_model)?;
        check_positive("heads", self.heads)?;
        check_positive("layers", self.layers)?;
        check_positive("mlp_ratio", self.mlp_ratio)?;
        check_dropout(self.dropout)?;
        if !self.d_model.is_multiple_of(self.heads) {
            return Err(ModelError::Config(format!(
                "heads = {} must divide d_model = {}",
                self.heads, self.d_model
            )));
        }
        Ok(())
    }

    /// Builds the module on `device` with GPT-2's initialization (see the module docs).
    /// Parameters are initialized lazily, on first use.
    ///
    /// # Panics
    ///
    /// Panics if the configuration is invalid (see [`GptConfig::validate`]).
    pub fn init(&self, device: &Device) -> Gpt {
        self.validate().expect("invalid GPT config");
        let d = self.d_model;
        let normal = Initializer::Normal {
            mean: 0.0,
            std: INIT_STD,
        };
        let embedding = |n: usize| {
            EmbeddingConfig::new(n, d)
                .with_initializer(normal.clone())
                .init(device)
        };
        let residual_std = INIT_STD / ((2 * self.layers) as f64).sqrt();
        Gpt {
            token_embedding: embedding(self.vocab),
            position_embedding: embedding(self.context),
            dropout: DropoutConfig::new(self.dropout).init(),
            blocks: (0..self.layers)
                .map(|_| self.block(INIT_STD, residual_std, device))
                .collect(),
            final_norm: LayerNormConfig::new(d).init(device),
            context: self.context,
        }
    }

    fn block(&self, std: f64, residual_std: f64, device: &Device) -> GptBlock {
        let d = self.d_model;
        let hidden = self.mlp_ratio * d;
        GptBlock {
            attention_norm: LayerNormConfig::new(d).init(device),
            attention: CausalSelfAttention {
                query: linear(d, d, std, device),
                key: linear(d, d, std, device),
                value: linear(d, d, std, device),
                output: linear(d, d, residual_std, device),
                attention_dropout: DropoutConfig::new(self.dropout).init(),
                heads: self.heads,
            },
            mlp_norm: LayerNormConfig::new(d).init(device),
            mlp: GptMlp {
                fc: linear(d, hidden, std, device),
                proj: linear(hidden, d, residual_std, device),
            },
            dropout: DropoutConfig::new(self.dropout).init(),
        }
    }
}

/// A linear layer `[d_in, d_out]` with weights `N(0, std)` and a zero bias.
fn linear(d_in: usize, d_out: usize, std: f64, device: &Device) -> Linear {
    let weight: Param<Tensor<2>> = Initializer::Normal { mean: 0.0, std }.init_with(
        [d_in, d_out],
        Some(d_in),
        Some(d_out),
        device,
    );
    Linear {
        weight,
        bias: Some(Initializer::Zeros.init([d_out], device)),
    }
}

/// Causal multi-head self-attention with separate query, key, value and output projections.
#[derive(Module, Debug)]
pub struct CausalSelfAttention {
    query: Linear,
    key: Linear,
    value: Linear,
    output: Linear,
    attention_dropout: Dropout,
    #[module(skip)]
    heads: usize,
}

impl CausalSelfAttention {
    /// # Shapes
    ///
    /// - `x`: `[batch, seq, d_model]`
    /// - `mask`: `[batch, heads, seq, seq]`, `true` above the diagonal (future positions)
    /// - output: `[batch, seq, d_model]` (before the residual dropout)
    fn forward(&self, x: Tensor<3>, mask: Tensor<4, Bool>) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let h = self.heads;
        let head = d / h;
        let split = |y: Tensor<3>| y.reshape([b, t, h, head]).swap_dims(1, 2);
        let q = split(self.query.forward(x.clone()));
        let k = split(self.key.forward(x.clone()));
        let v = split(self.value.forward(x));
        let scores = q
            .matmul(k.swap_dims(2, 3))
            .mul_scalar(1.0 / (head as f64).sqrt());
        let weights = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3);
        let weights = self.attention_dropout.forward(weights);
        let y = weights.matmul(v).swap_dims(1, 2).reshape([b, t, d]);
        self.output.forward(y)
    }
}

/// The block's MLP: `fc` → GELU → `proj`.
#[derive(Module, Debug)]
pub struct GptMlp {
    fc: Linear,
    proj: Linear,
}

/// One pre-LayerNorm transformer block.
#[derive(Module, Debug)]
pub struct GptBlock {
    attention_norm: LayerNorm,
    attention: CausalSelfAttention,
    mlp_norm: LayerNorm,
    mlp: GptMlp,
    dropout: Dropout,
}

impl GptBlock {
    /// # Shapes
    ///
    /// - `x`: `[batch, seq, d_model]`
    /// - `mask`: `[batch, heads, seq, seq]`
    /// - output: `[batch, seq, d_model]`
    fn forward(&self, x: Tensor<3>, mask: Tensor<4, Bool>) -> Tensor<3> {
        let a = self
            .attention
            .forward(self.attention_norm.forward(x.clone()), mask);
        let x = x + self.dropout.forward(a);
        let m = self.mlp.fc.forward(self.mlp_norm.forward(x.clone()));
        let m = self.mlp.proj.forward(gelu_approximate(m));
        x + self.dropout.forward(m)
    }
}

/// The GPT module; see the [module docs](self) for the architecture and parameter names.
#[derive(Module, Debug)]
pub struct Gpt {
    token_embedding: Embedding,
    position_embedding: Embedding,
    dropout: Dropout,
    blocks: Vec<GptBlock>,
    final_norm: LayerNorm,
    #[module(skip)]
    context: usize,
}

impl Gpt {
    /// Next-token logits for every position.
    ///
    /// # Shapes
    ///
    /// - `tokens`: `[batch, seq]` with `seq ≤ context`
    /// - output: `[batch, seq, vocab]`
    ///
    /// # Panics
    ///
    /// Panics if `seq > context` ([`LmModel`] refuses such batches with an error first).
    pub fn logits(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = tokens.dims();
        assert!(
            t <= self.context,
            "sequence of {t} tokens exceeds the context of {}",
            self.context
        );
        let device = tokens.device();
        let positions = self
            .position_embedding
            .weight
            .val()
            .narrow(0, 0, t)
            .unsqueeze::<3>();
        let mut x = self
            .dropout
            .forward(self.token_embedding.forward(tokens) + positions);
        let heads = self.blocks.first().map_or(1, |blk| blk.attention.heads);
        // `true` above the diagonal: position i may not attend to j > i.
        let mask = Tensor::<2, Bool>::tril_mask([t, t], 0, &device)
            .unsqueeze::<4>()
            .expand([b, heads, t, t]);
        for block in &self.blocks {
            x = block.forward(x, mask.clone());
        }
        let x = self.final_norm.forward(x);
        let d = x.dims()[2];
        let weight = self.token_embedding.weight.val();
        let vocab = weight.dims()[0];
        x.reshape([b * t, d])
            .matmul(weight.transpose())
            .reshape([b, t, vocab])
    }
}

impl LanguageModel for Gpt {
    /// Nothing is carried between batches.
    type State = ();

    /// # Shapes
    ///
    /// - `tokens`: `[batch, seq]` with `seq ≤ context`
    /// - output: `[batch, seq, vocab]`
    fn forward(&self, tokens: Tensor<2, Int>, _state: Option<()>) -> (Tensor<3>, ()) {
        (self.logits(tokens), ())
    }

    fn detach_state(state: ()) {
        state
    }

    /// Always 0, so the adapter never feeds a state back (there is none).
    fn state_batch_size(_state: &()) -> usize {
        0
    }

    fn state_values(_state: &()) -> Vec<f32> {
        Vec::new()
    }

    fn state_from_values(&self, values: &[f32], _device: &Device) -> Result<(), String> {
        if values.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "a GPT carries no state between batches, got {} values",
                values.len()
            ))
        }
    }

    fn max_seq_len(&self) -> Option<usize> {
        Some(self.context)
    }
}

/// GPT variants: the defaults of the keys left unset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum GptVariant {
    /// [`GptConfig::mini`] (the default).
    #[default]
    #[serde(rename = "mini")]
    Mini,
    /// [`GptConfig::gpt2_small`].
    #[serde(rename = "gpt2-small")]
    Gpt2Small,
}

/// Registry spec of `kind = "gpt"`. `vocab` defaults to the corpus vocabulary (the trainer
/// fills it in from the text dataset); the other keys default to the variant's values.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GptSpec {
    /// `mini` (default) or `gpt2-small`.
    pub variant: GptVariant,
    /// Vocabulary size (default: the corpus's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vocab: Option<usize>,
    /// Transformer blocks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layers: Option<usize>,
    /// Width of the residual stream.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub d_model: Option<usize>,
    /// Attention heads (must divide `d_model`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heads: Option<usize>,
    /// Positions: the longest sequence (`data.seq_len`) the model takes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<usize>,
    /// MLP hidden width as a multiple of `d_model` (4).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlp_ratio: Option<usize>,
    /// Dropout (0.1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
}

impl GptSpec {
    /// The resolved configuration; an error when `vocab` is unset (the trainer sets it from
    /// the corpus before building).
    pub fn config(&self) -> Result<GptConfig, ModelError> {
        Ok(self.config_with_vocab(require_vocab(self.vocab)?))
    }

    /// The configuration with vocabulary `vocab`: the variant's values where a key is unset.
    fn config_with_vocab(&self, vocab: usize) -> GptConfig {
        let base = match self.variant {
            GptVariant::Mini => GptConfig::mini(vocab),
            GptVariant::Gpt2Small => GptConfig::gpt2_small(vocab),
        };
        GptConfig {
            vocab,
            context: self.context.unwrap_or(base.context),
            d_model: self.d_model.unwrap_or(base.d_model),
            heads: self.heads.unwrap_or(base.heads),
            layers: self.layers.unwrap_or(base.layers),
            mlp_ratio: self.mlp_ratio.unwrap_or(base.mlp_ratio),
            dropout: self.dropout.unwrap_or(base.dropout),
        }
    }
}

impl ModelFamily for GptSpec {
    const VARIANTS: &'static [&'static str] = &["mini", "gpt2-small"];
    const SUMMARY: &'static str =
        "GPT decoder-only transformer LM (pre-LayerNorm, causal attention, GELU MLP, learned positions, tied embeddings)";
    const LANGUAGE_MODEL: bool = true;

    fn build(&self, device: &Device) -> Result<Box<dyn Model>, ModelError> {
        let config = self.config()?;
        config.validate()?;
        let device = autodiff(device);
        let module = config.init(&device);
        Ok(Box::new(LmModel::new("gpt", module, config.vocab, &device)))
    }

    /// [`GptConfig::validate`] with any vocabulary (`vocab` may still be unset here).
    fn check(&self) -> Result<(), ModelError> {
        self.config_with_vocab(self.vocab.unwrap_or(1)).validate()
    }

    fn vocab(&self) -> Option<usize> {
        self.vocab
    }

    fn set_vocab(&mut self, vocab: usize) {
        self.vocab = Some(vocab);
    }

    fn context(&self) -> Option<usize> {
        Some(self.config_with_vocab(1).context)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Batch;
    use crate::ParamTable;

    /// The closed-form parameter count (see the module docs).
    fn closed_form(c: &GptConfig) -> usize {
        let (v, t, d, l, r) = (c.vocab, c.context, c.d_model, c.layers, c.mlp_ratio);
        let attention = 4 * (d * d + d); // query, key, value, output: weight + bias
        let mlp = (d * r * d + r * d) + (r * d * d + d); // fc, proj
        let norms = 2 * 2 * d; // two LayerNorms, gamma + beta
        v * d + t * d + l * (attention + mlp + norms) + 2 * d
    }

    fn tiny() -> GptConfig {
        GptConfig {
            vocab: 13,
            context: 8,
            d_model: 16,
            heads: 4,
            layers: 2,
            mlp_ratio: 4,
            dropout: 0.0,
        }
    }

    #[test]
    fn parameter_count_is_the_closed_form() {
        let device = Device::flex().autodiff();
        for c in [
            tiny(),
            GptConfig {
                mlp_ratio: 2,
                layers: 3,
                ..tiny()
            },
            GptConfig::mini(65),
            GptConfig {
                heads: 1,
                context: 3,
                ..GptConfig::mini(10_000)
            },
        ] {
            let table = ParamTable::of(&c.init(&device));
            assert_eq!(table.num_params(), closed_form(&c), "{c:?}");
            assert_eq!(table.num_buffers(), 0);
        }
    }

    #[test]
    fn gpt2_small_has_124_439_808_parameters() {
        let c = GptConfig::gpt2_small(50_257);
        // wte 50257·768 + wpe 1024·768 + 12 blocks · (12·768² + 13·768) + final LN 2·768.
        let by_hand = 50_257 * 768 + 1024 * 768 + 12 * (12 * 768 * 768 + 13 * 768) + 2 * 768;
        assert_eq!(by_hand, 124_439_808);
        assert_eq!(closed_form(&c), by_hand);
        let spec: GptSpec =
            toml::from_str("variant = \"gpt2-small\"\nvocab = 50257\n").expect("parses");
        // Parameters are lazy: the table reads declared shapes, nothing is allocated.
        let model = spec.build(&Device::flex()).expect("builds");
        assert_eq!(model.table().num_params(), 124_439_808);
    }

    #[test]
    fn weights_are_matrices_with_stable_names() {
        let table = ParamTable::of(&tiny().init(&Device::flex().autodiff()));
        let shape = |n: &str| table.get(n).unwrap_or_else(|| panic!("{n}")).shape.clone();
        assert_eq!(shape("token_embedding.weight"), [13, 16]);
        assert_eq!(shape("position_embedding.weight"), [8, 16]);
        for p in ["query", "key", "value", "output"] {
            assert_eq!(shape(&format!("blocks.1.attention.{p}.weight")), [16, 16]);
            assert_eq!(shape(&format!("blocks.1.attention.{p}.bias")), [16]);
        }
        assert_eq!(shape("blocks.0.mlp.fc.weight"), [16, 64]);
        assert_eq!(shape("blocks.0.mlp.proj.weight"), [64, 16]);
        assert_eq!(shape("blocks.0.attention_norm.gamma"), [16]);
        assert_eq!(shape("final_norm.beta"), [16]);
        // Tied: no output matrix.
        assert!(table.params().all(|p| p.shape != [16, 13]));
    }

    #[test]
    fn a_later_token_does_not_change_earlier_logits() {
        let device = Device::flex();
        device.seed(7);
        let gpt = tiny().init(&device);
        let a: Vec<i64> = vec![1, 5, 2, 9, 3, 3, 7, 0];
        let mut b = a.clone();
        b[5] = 11;
        let run = |tokens: &[i64]| {
            let t = Tensor::<2, Int>::from_data(TensorData::new(tokens.to_vec(), [1, 8]), &device);
            gpt.logits(t).into_data().try_to_vec::<f32>().unwrap()
        };
        let (la, lb) = (run(&a), run(&b));
        let v = 13;
        assert_eq!(la[..5 * v], lb[..5 * v], "positions before the change");
        assert_ne!(la[5 * v..6 * v], lb[5 * v..6 * v], "the changed position");
    }

    #[test]
    fn initial_loss_is_about_ln_vocab_and_gradients_are_finite() {
        let device = Device::flex().autodiff();
        device.seed(3);
        let config = GptConfig {
            vocab: 50,
            ..tiny()
        };
        let mut model = LmModel::new("gpt", config.init(&device), config.vocab, &device);
        let inputs: Vec<i64> = (0..32).map(|i| (i * 7 % 50) as i64).collect();
        let targets: Vec<i64> = (0..32).map(|i| (i * 11 % 50) as i64).collect();
        let batch = Batch::tokens_from_slice(&inputs, &targets, [4, 8], &device);
        let mut grads = vec![0.0f32; model.table().num_params()];
        let metrics = model.forward_backward(batch, &mut grads).unwrap();
        let ln_v = (50f64).ln();
        assert!(
            (metrics.loss - ln_v).abs() < 0.1,
            "loss {} vs ln 50 = {ln_v}",
            metrics.loss
        );
        assert!(grads.iter().all(|g| g.is_finite()));
        assert!(grads.iter().any(|g| *g != 0.0));
        assert!(model.carried_state().is_empty(), "a GPT carries no state");
    }

    #[test]
    fn a_batch_longer_than_the_context_is_an_error() {
        let device = Device::flex().autodiff();
        let config = tiny();
        let mut model = LmModel::new("gpt", config.init(&device), config.vocab, &device);
        let tokens = vec![1i64; 9];
        let batch = Batch::tokens_from_slice(&tokens, &tokens, [1, 9], &device);
        let err = model.forward_loss(batch).unwrap_err().to_string();
        assert!(err.contains("context"), "{err}");
    }

    #[test]
    fn spec_defaults_and_errors() {
        let spec: GptSpec = toml::from_str("layers = 2\nd_model = 32\nheads = 4\n").unwrap();
        assert_eq!(spec.context(), Some(256));
        assert!(
            matches!(spec.build(&Device::flex()), Err(ModelError::Config(m)) if m.contains("vocab"))
        );
        let bad: GptSpec = toml::from_str("d_model = 30\nheads = 4\n").unwrap();
        assert!(bad.check().unwrap_err().to_string().contains("heads"));
        assert!(toml::from_str::<GptSpec>("width = 3\n").is_err());
        let c = GptSpec {
            vocab: Some(7),
            ..spec
        }
        .config()
        .unwrap();
        assert_eq!((c.mlp_ratio, c.dropout, c.context), (4, 0.1, 256));
    }
}
