//! LSTM language model (word- or character-level): embedding → dropout → `layers` LSTMs with
//! dropout between them → dropout → linear decoder, optionally tied to the embedding
//! (Press & Wolf 2017). Trained with truncated BPTT: [`LmModel`] carries the
//! detached hidden state of each batch into the next.

use burn::module::Param;
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer, Linear, LinearConfig, Lstm,
    LstmConfig, LstmState,
};
use burn::prelude::*;

use serde::{Deserialize, Serialize};

use crate::family::{autodiff, ModelFamily};
use crate::flat::ParamTable;
use crate::layers::{check_dropout, check_positive, require_vocab};
use crate::meprop::{meprop_forward, meprop_linear};
use crate::model::{LanguageModel, LmModel, Model};
use crate::torch_names::TorchLayout;
use crate::ModelError;

/// Configuration of [`LstmLm`].
#[derive(Debug, Clone, PartialEq)]
pub struct LstmLmConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Embedding width (must equal `hidden` when `tied`).
    pub embed: usize,
    /// Hidden width of every LSTM layer.
    pub hidden: usize,
    /// Number of stacked LSTM layers.
    pub layers: usize,
    /// Dropout on the embedding output, between layers and before the decoder.
    pub dropout: f64,
    /// Decoder weight shared with the embedding.
    pub tied: bool,
    /// meProp on the decoder (ALGORITHMS.md §11): when set, the decoder back-propagates
    /// through only the `k` vocabulary columns with the largest `Σ |∂L/∂logits|` over the
    /// batch and all time steps (unified mode). `None` is ordinary backprop.
    pub meprop_k: Option<usize>,
}

impl LstmLmConfig {
    /// Word-level model: 2 layers of 200, embedding 200, dropout 0.2, tied (a PTB-"small"-sized
    /// model, trainable on a CPU).
    pub fn word(vocab: usize) -> Self {
        Self {
            vocab,
            embed: 200,
            hidden: 200,
            layers: 2,
            dropout: 0.2,
            tied: true,
            meprop_k: None,
        }
    }

    /// Character-level model: 2 layers of 256, embedding 64, dropout 0.1, untied.
    pub fn char(vocab: usize) -> Self {
        Self {
            vocab,
            embed: 64,
            hidden: 256,
            layers: 2,
            dropout: 0.1,
            tied: false,
            meprop_k: None,
        }
    }

    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ModelError> {
        check_positive("vocab", self.vocab)?;
        check_positive("embed", self.embed)?;
        check_positive("hidden", self.hidden)?;
        check_positive("layers", self.layers)?;
        check_dropout(self.dropout)?;
        if let Some(k) = self.meprop_k {
            check_positive("meprop_k", k)?;
        }
        if self.tied && self.embed != self.hidden {
            return Err(ModelError::Config(format!(
                "tied weights need embed == hidden, got {} and {}",
                self.embed, self.hidden
            )));
        }
        Ok(())
    }

    /// Builds the module on `device`. Embedding and decoder weights are uniform in
    /// ±0.1 (Zaremba et al.); LSTM weights use burn's Xavier-normal default.
    ///
    /// # Panics
    ///
    /// Panics if the configuration is invalid (see [`LstmLmConfig::validate`]).
    pub fn init(&self, device: &Device) -> LstmLm {
        self.validate().expect("invalid LSTM LM config");
        let uniform = Initializer::Uniform {
            min: -0.1,
            max: 0.1,
        };
        LstmLm {
            embedding: EmbeddingConfig::new(self.vocab, self.embed)
                .with_initializer(uniform.clone())
                .init(device),
            layers: (0..self.layers)
                .map(|i| {
                    let d_in = if i == 0 { self.embed } else { self.hidden };
                    LstmConfig::new(d_in, self.hidden, true).init(device)
                })
                .collect(),
            dropout: DropoutConfig::new(self.dropout).init(),
            decoder: (!self.tied).then(|| {
                LinearConfig::new(self.hidden, self.vocab)
                    .with_initializer(uniform)
                    .init(device)
            }),
            decoder_bias: self
                .tied
                .then(|| Initializer::Zeros.init([self.vocab], device)),
            meprop_k: self.meprop_k,
        }
    }
}

/// LSTM language model. Parameters: `embedding.weight` `[vocab, embed]`, `layers.{i}.*` (burn
/// LSTM gates), `decoder.weight` `[hidden, vocab]` and `decoder.bias` when untied, or
/// `decoder_bias` `[vocab]` when tied (the decoder weight is then `embedding.weight`ᵀ).
#[derive(Module, Debug)]
pub struct LstmLm {
    embedding: Embedding,
    layers: Vec<Lstm>,
    dropout: Dropout,
    decoder: Option<Linear>,
    decoder_bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    meprop_k: Option<usize>,
}

impl LanguageModel for LstmLm {
    /// One LSTM state (cell, hidden: `[batch, hidden]`) per layer.
    type State = Vec<LstmState<2>>;

    /// # Shapes
    ///
    /// - `tokens`: `[batch, seq]`
    /// - `state`: per layer, cell and hidden `[batch, hidden]`
    /// - output: `[batch, seq, vocab]`
    fn forward(
        &self,
        tokens: Tensor<2, Int>,
        state: Option<Self::State>,
    ) -> (Tensor<3>, Self::State) {
        let [b, t] = tokens.dims();
        let mut x = self.dropout.forward(self.embedding.forward(tokens));
        let mut carried = state.map(Vec::into_iter);
        let mut next = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let s = carried.as_mut().and_then(Iterator::next);
            let (y, s) = layer.forward(x, s);
            x = self.dropout.forward(y);
            next.push(s);
        }
        let hidden = x.dims()[2];
        let x = x.reshape([b * t, hidden]);
        let logits = match (&self.decoder, &self.decoder_bias, self.meprop_k) {
            (Some(decoder), _, None) => crate::matmul::linear(decoder, x),
            (Some(decoder), _, Some(k)) => meprop_forward(decoder, x, k),
            (None, Some(bias), None) => {
                let weight = self.embedding.weight.val().transpose();
                crate::matmul::matmul(x, weight) + bias.val().unsqueeze::<2>()
            }
            (None, Some(bias), Some(k)) => {
                let weight = self.embedding.weight.val().transpose();
                meprop_linear(x, weight, Some(bias.val()), k)
            }
            (None, None, _) => unreachable!("init builds a decoder or a tied bias"),
        };
        let vocab = logits.dims()[1];
        (logits.reshape([b, t, vocab]), next)
    }

    fn detach_state(state: Self::State) -> Self::State {
        state
            .into_iter()
            .map(|s| LstmState::new(s.cell.detach(), s.hidden.detach()))
            .collect()
    }

    fn state_batch_size(state: &Self::State) -> usize {
        state.first().map_or(0, |s| s.hidden.dims()[0])
    }

    /// Per layer: the cell values, then the hidden values (each `[batch, hidden]`, row-major).
    fn state_values(state: &Self::State) -> Vec<f32> {
        let mut out = Vec::new();
        for s in state {
            for t in [&s.cell, &s.hidden] {
                let data = t.clone().into_data().convert::<f32>();
                out.extend_from_slice(data.as_slice::<f32>().expect("f32 after convert"));
            }
        }
        out
    }

    fn state_from_values(&self, values: &[f32], device: &Device) -> Result<Self::State, String> {
        let per_row: usize = self.layers.iter().map(|l| 2 * l.d_hidden).sum();
        if per_row == 0 || !values.len().is_multiple_of(per_row) {
            return Err(format!(
                "{} values are not a whole number of batch rows of {per_row} (2 × hidden per layer)",
                values.len()
            ));
        }
        let batch = values.len() / per_row;
        let mut rest = values;
        let mut state = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let n = batch * l.d_hidden;
            let mut take = || {
                let (head, tail) = rest.split_at(n);
                rest = tail;
                Tensor::<2>::from_data(TensorData::new(head.to_vec(), [batch, l.d_hidden]), device)
            };
            let cell = take();
            let hidden = take();
            state.push(LstmState::new(cell, hidden));
        }
        Ok(state)
    }
}

/// LSTM LM variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LstmVariant {
    /// Word level ([`LstmLmConfig::word`]).
    Word,
    /// Character level ([`LstmLmConfig::char`]).
    Char,
}

/// Registry spec of `kind = "lstm"`; `vocab` defaults to the corpus vocabulary (the trainer
/// fills it in from the text dataset).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LstmLmSpec {
    /// `word` or `char`.
    pub variant: LstmVariant,
    /// Vocabulary size (default: the corpus's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab: Option<usize>,
    /// Embedding width.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embed: Option<usize>,
    /// Hidden width.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden: Option<usize>,
    /// Number of LSTM layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<usize>,
    /// Dropout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
    /// Tie decoder and embedding weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tied: Option<bool>,
    /// meProp's `k` on the decoder (ALGORITHMS.md §11). Unset: ordinary backprop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meprop_k: Option<usize>,
}

impl LstmLmSpec {
    /// The resolved configuration; an error when `vocab` is unset (the trainer sets it from
    /// the corpus before building).
    pub fn config(&self) -> Result<LstmLmConfig, ModelError> {
        Ok(self.config_with_vocab(require_vocab(self.vocab)?))
    }

    fn config_with_vocab(&self, vocab: usize) -> LstmLmConfig {
        let base = match self.variant {
            LstmVariant::Word => LstmLmConfig::word(vocab),
            LstmVariant::Char => LstmLmConfig::char(vocab),
        };
        LstmLmConfig {
            vocab,
            embed: self.embed.unwrap_or(base.embed),
            hidden: self.hidden.unwrap_or(base.hidden),
            layers: self.layers.unwrap_or(base.layers),
            dropout: self.dropout.unwrap_or(base.dropout),
            tied: self.tied.unwrap_or(base.tied),
            meprop_k: self.meprop_k.or(base.meprop_k),
        }
    }
}

impl ModelFamily for LstmLmSpec {
    const VARIANTS: &'static [&'static str] = &["word", "char"];
    const SUMMARY: &'static str =
        "LSTM language model (embedding, n LSTM layers, dropout, optionally tied decoder; truncated BPTT)";

    const LANGUAGE_MODEL: bool = true;

    /// The twin's names: `embedding.weight`, one single-layer `nn.LSTM` per layer at
    /// `layers.{i}` (`weight_ih_l0`, `weight_hh_l0`, `bias_ih_l0`, `bias_hh_l0`, gates
    /// stacked input, forget, cell, output), `decoder_bias` (tied) or `decoder.*`.
    fn torch_layout(&self, table: &ParamTable) -> Result<TorchLayout, ModelError> {
        crate::torch_names::lstm_layout(table)
    }

    fn build(&self, device: &Device) -> Result<Box<dyn Model>, ModelError> {
        let config = self.config()?;
        config.validate()?;
        let device = autodiff(device);
        let module = config.init(&device);
        let name = match self.variant {
            LstmVariant::Word => "lstm-word",
            LstmVariant::Char => "lstm-char",
        };
        Ok(Box::new(LmModel::new(name, module, config.vocab, &device)))
    }

    fn check(&self) -> Result<(), ModelError> {
        self.config_with_vocab(self.vocab.unwrap_or(1)).validate()
    }

    fn vocab(&self) -> Option<usize> {
        self.vocab
    }

    fn set_vocab(&mut self, vocab: usize) {
        self.vocab = Some(vocab);
    }
}
