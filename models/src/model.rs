//! The seam between the model zoo and the trainer: [`Model`], plus the two module traits a
//! family implements ([`ImageClassifier`], [`LanguageModel`]) and the adapters that turn such a
//! module into a `Box<dyn Model>`.
//!
//! # Design
//!
//! The trainer is not generic over burn modules: it holds one `Box<dyn Model>` built from a
//! TOML `[model]` table, hands it batches, and moves everything else through flat `f32`
//! buffers (gradients out, parameters in, running statistics both ways), because that is what
//! compression, collectives and the flat-buffer optimizers consume. So the trait is object
//! safe, speaks burn tensors only for the batch and the loss, and offers exactly the
//! operations a data-parallel step needs, each implemented with bulk copies into caller-owned,
//! reused buffers (see [`crate::flat`]).
//!
//! A family only writes a burn module with a `forward`; the adapters supply loss, metrics,
//! truncated-BPTT state carrying and the flat views.

use burn::module::Module;
use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::prelude::*;
use burn::store::ModuleRecord;

use crate::flat::{self, ParamTable, TensorRole};

/// Errors of the model layer. Misuse that indicates a bug in the caller (buffer of the wrong
/// length) panics instead; see each method.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A configuration value is invalid.
    #[error("invalid model config: {0}")]
    Config(String),
    /// The batch does not fit the model (wrong kind or shape).
    #[error("batch does not fit model `{model}`: {reason}")]
    Batch {
        /// Model name.
        model: String,
        /// What is wrong.
        reason: String,
    },
    /// Saving or loading a record failed.
    #[error("model record: {0}")]
    Record(String),
}

/// What a model consumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputSpec {
    /// Image classification: `images` `[batch, channels, height, width]`, `labels` `[batch]`.
    Images {
        /// Input channels.
        channels: usize,
        /// Input height.
        height: usize,
        /// Input width.
        width: usize,
        /// Number of classes.
        num_classes: usize,
    },
    /// Next-token prediction: `inputs` and `targets` `[batch, seq]` token ids.
    Tokens {
        /// Vocabulary size.
        vocab: usize,
    },
}

/// One batch on the model's device.
#[derive(Debug, Clone)]
pub enum Batch {
    /// Images and class labels.
    Images {
        /// `[batch, channels, height, width]`.
        images: Tensor<4>,
        /// `[batch]`, class indices.
        labels: Tensor<1, Int>,
    },
    /// Token ids and next-token targets.
    Tokens {
        /// `[batch, seq]`.
        inputs: Tensor<2, Int>,
        /// `[batch, seq]`.
        targets: Tensor<2, Int>,
    },
}

impl Batch {
    /// Builds an image batch from host data (`images` row-major `[n, c, h, w]`).
    ///
    /// # Panics
    ///
    /// Panics if the lengths do not match `shape`.
    pub fn images_from_slice(
        images: &[f32],
        shape: [usize; 4],
        labels: &[i64],
        device: &Device,
    ) -> Self {
        assert_eq!(
            images.len(),
            shape.iter().product::<usize>(),
            "image data length"
        );
        assert_eq!(labels.len(), shape[0], "label count");
        Batch::Images {
            images: Tensor::from_data(TensorData::new(images.to_vec(), shape), device),
            labels: Tensor::from_data(TensorData::new(labels.to_vec(), [shape[0]]), device),
        }
    }

    /// Builds a token batch from host data (row-major `[batch, seq]`).
    ///
    /// # Panics
    ///
    /// Panics if the lengths do not match `shape`.
    pub fn tokens_from_slice(
        inputs: &[i64],
        targets: &[i64],
        shape: [usize; 2],
        device: &Device,
    ) -> Self {
        assert_eq!(inputs.len(), shape[0] * shape[1], "input length");
        assert_eq!(targets.len(), shape[0] * shape[1], "target length");
        Batch::Tokens {
            inputs: Tensor::from_data(TensorData::new(inputs.to_vec(), shape), device),
            targets: Tensor::from_data(TensorData::new(targets.to_vec(), shape), device),
        }
    }

    /// Number of examples (images, or sequences).
    pub fn batch_size(&self) -> usize {
        match self {
            Batch::Images { labels, .. } => labels.dims()[0],
            Batch::Tokens { inputs, .. } => inputs.dims()[0],
        }
    }
}

/// Loss and counts of one batch. Merge batches with [`Metrics::merge`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Metrics {
    /// Mean cross-entropy (nats) over `count` predictions.
    pub loss: f64,
    /// Correct top-1 predictions.
    pub correct: usize,
    /// Predictions scored: images, or tokens for a language model.
    pub count: usize,
}

impl Metrics {
    /// Top-1 accuracy in `[0, 1]` (0 when empty).
    pub fn accuracy(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.correct as f64 / self.count as f64
        }
    }

    /// Perplexity, `exp(loss)`.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }

    /// Combines two batches' metrics (count-weighted mean loss).
    pub fn merge(&mut self, other: &Metrics) {
        let total = self.count + other.count;
        if total > 0 {
            self.loss =
                (self.loss * self.count as f64 + other.loss * other.count as f64) / total as f64;
        }
        self.correct += other.correct;
        self.count = total;
    }
}

/// The loss of a batch before the backward pass.
#[derive(Debug)]
pub struct LossOutput {
    /// Scalar mean loss `[1]`, attached to the autodiff graph.
    pub loss: Tensor<1>,
    /// Metrics of the batch (computed from detached values).
    pub metrics: Metrics,
}

/// What the trainer uses: a model on an autodiff device, driven through batches and flat
/// `f32` buffers.
///
/// Every flat buffer follows [`Model::table`]: trainable parameters in module-visit order for
/// parameters and gradients, BatchNorm running statistics in the same order for buffers. The
/// order and names are identical on every worker that builds the same configuration.
pub trait Model: Send {
    /// Registry name of the model, e.g. `resnet20`.
    fn name(&self) -> &str;

    /// What the model consumes.
    fn input(&self) -> InputSpec;

    /// The autodiff device the model lives on.
    fn device(&self) -> &Device;

    /// The layout of parameters and buffers.
    fn table(&self) -> &ParamTable;

    /// Forward pass in training mode (dropout on, batch statistics) and the loss, attached to
    /// the graph. Recurrent models carry their (detached) hidden state from the previous call.
    fn forward_loss(&mut self, batch: Batch) -> Result<LossOutput, ModelError>;

    /// Backward pass from `loss` (as returned by [`Model::forward_loss`]); writes the gradient
    /// of every trainable parameter into `grads` (length `table().num_params()`), zeros for
    /// parameters unused in the forward pass.
    ///
    /// # Panics
    ///
    /// Panics if `grads` has the wrong length.
    fn backward_into(&mut self, loss: Tensor<1>, grads: &mut [f32]);

    /// [`Model::backward_into`]'s gradient as one flat tensor (length `table().num_params()`,
    /// the same layout) left on the model's device without autodiff: on a GPU, the gradient
    /// the device codecs read with no copy through the host. The default goes through
    /// [`Model::backward_into`] and a host buffer.
    fn backward_flat(&mut self, loss: Tensor<1>) -> Tensor<1> {
        let n = self.table().num_params();
        let mut grads = vec![0.0; n];
        self.backward_into(loss, &mut grads);
        let device = self.device().clone().without_autodiff();
        Tensor::from_data(TensorData::new(grads, [n]), &device)
    }

    /// [`Model::forward_loss`] then [`Model::backward_into`].
    fn forward_backward(&mut self, batch: Batch, grads: &mut [f32]) -> Result<Metrics, ModelError> {
        let out = self.forward_loss(batch)?;
        self.backward_into(out.loss, grads);
        Ok(out.metrics)
    }

    /// Loss and metrics in evaluation mode (no dropout, running statistics, no graph).
    /// Recurrent models carry an evaluation state separate from the training state.
    fn evaluate(&mut self, batch: Batch) -> Result<Metrics, ModelError>;

    /// Copies the trainable parameters into `out` (length `table().num_params()`).
    ///
    /// # Panics
    ///
    /// Panics if `out` has the wrong length.
    fn read_params(&self, out: &mut [f32]);

    /// Overwrites the trainable parameters from `src` (length `table().num_params()`). Cheap
    /// enough to call every step: one copy per tensor into its existing storage.
    ///
    /// # Panics
    ///
    /// Panics if `src` has the wrong length.
    fn write_params(&mut self, src: &[f32]);

    /// Updates the trainable parameters in place: calls `f(offset, values)` once per
    /// parameter tensor, in table order, where `values` is the tensor's own storage (no copy
    /// when nothing else holds it, which is the case between steps) and `offset` its position
    /// in the flat layout. This is how the trainer applies its optimizer without a flat copy
    /// of the parameters and a second copy back into the module.
    fn update_params(&mut self, f: &mut dyn FnMut(usize, &mut [f32]));

    /// Replaces every trainable parameter by `f(offset, values)`, in table order, where
    /// `values` is the parameter flattened on the model's device (without autodiff) and
    /// `offset` its position in the flat layout; `f` returns the new values, as many. On a
    /// GPU this is an optimizer step that never leaves the device. The default goes through
    /// [`Model::update_params`] (a copy to the host and back per parameter).
    fn update_params_on_device(&mut self, f: &mut dyn FnMut(usize, Tensor<1>) -> Tensor<1>) {
        let device = self.device().clone().without_autodiff();
        self.update_params(&mut |offset, values| {
            let n = values.len();
            let t = Tensor::<1>::from_data(TensorData::new(values.to_vec(), [n]), &device);
            let out = f(offset, t).into_data();
            values.copy_from_slice(out.as_slice::<f32>().expect("f32 values"));
        });
    }

    /// Copies the buffers (BatchNorm running statistics) into `out` (length
    /// `table().num_buffers()`).
    ///
    /// # Panics
    ///
    /// Panics if `out` has the wrong length.
    fn read_buffers(&self, out: &mut [f32]);

    /// Overwrites the buffers from `src` (length `table().num_buffers()`).
    ///
    /// # Panics
    ///
    /// Panics if `src` has the wrong length.
    fn write_buffers(&mut self, src: &[f32]);

    /// The module record (parameters and buffers) as bytes (burn's burnpack format).
    fn to_bytes(&self) -> Result<Vec<u8>, ModelError>;

    /// Loads a record written by [`Model::to_bytes`] of the same configuration. On error the
    /// model is unchanged.
    fn load_bytes(&mut self, bytes: &[u8]) -> Result<(), ModelError>;

    /// Forgets carried recurrent state (start of an epoch or of an evaluation pass). No-op for
    /// feed-forward models.
    fn reset_state(&mut self) {}

    /// The recurrent state carried into the next training batch, flat (empty when none is
    /// carried, and always for feed-forward models). Checkpoints store it so a resumed run
    /// continues exactly.
    fn carried_state(&self) -> Vec<f32> {
        Vec::new()
    }

    /// Restores [`Model::carried_state`]'s output; empty values mean no carried state.
    fn set_carried_state(&mut self, values: &[f32]) -> Result<(), ModelError> {
        if values.is_empty() {
            Ok(())
        } else {
            Err(ModelError::Record(format!(
                "a feed-forward model carries no recurrent state, got {} values",
                values.len()
            )))
        }
    }

    /// Starts an evaluation pass from a fresh recurrent state (each pass over the test set
    /// is then independent of the previous one). No-op for feed-forward models.
    fn reset_eval_state(&mut self) {}
}

/// An image classifier module: what an image family implements to be used through
/// [`ImageModel`].
pub trait ImageClassifier: Module + 'static {
    /// Logits for a batch of images.
    ///
    /// # Shapes
    ///
    /// - `images`: `[batch, channels, height, width]`
    /// - output: `[batch, num_classes]`
    fn forward(&self, images: Tensor<4>) -> Tensor<2>;
}

/// A language model module: what a sequence family implements to be used through
/// [`LmModel`].
pub trait LanguageModel: Module + 'static {
    /// Recurrent state carried between consecutive chunks of a sequence (truncated BPTT).
    type State: Send + 'static;

    /// Next-token logits for every position, and the state after the last position.
    ///
    /// # Shapes
    ///
    /// - `tokens`: `[batch, seq]`
    /// - output: `[batch, seq, vocab]`
    fn forward(
        &self,
        tokens: Tensor<2, Int>,
        state: Option<Self::State>,
    ) -> (Tensor<3>, Self::State);

    /// The state cut from the graph, so the next chunk does not backpropagate into this one.
    fn detach_state(state: Self::State) -> Self::State;

    /// Batch size the state was computed for (a state is dropped when the batch size changes).
    fn state_batch_size(state: &Self::State) -> usize;

    /// The values of a state, flat, for checkpoints ([`LanguageModel::state_from_values`]
    /// reads them back).
    fn state_values(state: &Self::State) -> Vec<f32>;

    /// Rebuilds a state written by [`LanguageModel::state_values`] on `device`; an error
    /// says why the values do not fit this model.
    fn state_from_values(&self, values: &[f32], device: &Device) -> Result<Self::State, String>;

    /// The longest sequence [`LanguageModel::forward`] takes (a transformer's context);
    /// `None`: any length. [`LmModel`] refuses longer batches with an error.
    fn max_seq_len(&self) -> Option<usize> {
        None
    }
}

/// Module plus its table and device; the part both adapters share.
#[derive(Debug)]
struct Core<M: Module> {
    name: String,
    device: Device,
    module: Option<M>,
    table: ParamTable,
    loss: CrossEntropyLoss,
}

impl<M: Module> Core<M> {
    fn new(name: String, module: M, device: &Device) -> Self {
        let table = ParamTable::of(&module);
        Self {
            name,
            device: device.clone(),
            module: Some(module),
            table,
            loss: CrossEntropyLossConfig::new().init(device),
        }
    }

    fn module(&self) -> &M {
        self.module
            .as_ref()
            .expect("module lost by an earlier panic during a write")
    }

    fn backward_into(&mut self, loss: Tensor<1>, grads: &mut [f32]) {
        assert_eq!(
            grads.len(),
            self.table.num_params(),
            "gradient buffer length"
        );
        let mut g = loss.backward();
        drop(loss);
        flat::grads_into(self.module(), &self.table, &mut g, grads);
    }

    fn backward_flat(&mut self, loss: Tensor<1>) -> Tensor<1> {
        let mut g = loss.backward();
        drop(loss);
        flat::grads_flat(self.module(), &self.table, &mut g, &self.device)
    }

    fn read(&self, role: TensorRole, out: &mut [f32]) {
        if role == TensorRole::Buffer {
            flat::sync_buffers(self.module());
        }
        flat::read_into(self.module(), &self.table, role, out);
    }

    fn write(&mut self, role: TensorRole, src: &[f32]) {
        let expected = match role {
            TensorRole::Param => self.table.num_params(),
            TensorRole::Buffer => self.table.num_buffers(),
        };
        assert_eq!(src.len(), expected, "flat buffer length");
        if role == TensorRole::Buffer {
            flat::sync_buffers(self.module());
        }
        let module = self.module.take().expect("module lost by an earlier panic");
        self.module = Some(flat::write_from(module, &self.table, role, src));
    }

    fn update_params(&mut self, f: &mut dyn FnMut(usize, &mut [f32])) {
        let module = self.module.take().expect("module lost by an earlier panic");
        self.module = Some(flat::update_in_place(module, &self.table, f));
    }

    fn update_params_on_device(&mut self, f: &mut dyn FnMut(usize, Tensor<1>) -> Tensor<1>) {
        let module = self.module.take().expect("module lost by an earlier panic");
        self.module = Some(flat::update_on_device(module, &self.table, f));
    }

    fn to_bytes(&self) -> Result<Vec<u8>, ModelError> {
        flat::sync_buffers(self.module());
        let bytes = self
            .module()
            .clone()
            .into_record()
            .into_bytes()
            .map_err(|e| ModelError::Record(format!("{e:?}")))?;
        Ok(bytes.to_vec())
    }

    fn load_bytes(&mut self, bytes: &[u8]) -> Result<(), ModelError> {
        let record = ModuleRecord::from_bytes(burn::tensor::Bytes::from_bytes_vec(bytes.to_vec()))
            .map_err(|e| ModelError::Record(format!("{e:?}")))?;
        let loaded = self
            .module()
            .clone()
            .try_load_record(record)
            .map_err(|e| ModelError::Record(format!("{e:?}")))?;
        self.module = Some(loaded);
        Ok(())
    }

    fn batch_error(&self, reason: impl Into<String>) -> ModelError {
        ModelError::Batch {
            model: self.name.clone(),
            reason: reason.into(),
        }
    }
}

/// Counts `argmax(logits) == targets` on detached values.
fn correct_count(logits: &Tensor<2>, targets: &Tensor<1, Int>) -> usize {
    let n = targets.dims()[0];
    let pred = logits.clone().detach().argmax(1).reshape([n]);
    let hits: i64 = pred.equal(targets.clone()).int().sum().into_scalar();
    hits as usize
}

/// Adapter from an [`ImageClassifier`] module to [`Model`] (cross-entropy loss, top-1).
#[derive(Debug)]
pub struct ImageModel<M: ImageClassifier> {
    core: Core<M>,
    input: InputSpec,
}

impl<M: ImageClassifier> ImageModel<M> {
    /// Wraps `module` (initialized on the autodiff `device`) whose input is `input`.
    ///
    /// # Panics
    ///
    /// Panics if `device` is not an autodiff device or `input` is not [`InputSpec::Images`].
    pub fn new(name: impl Into<String>, module: M, input: InputSpec, device: &Device) -> Self {
        assert!(device.is_autodiff(), "models train on an autodiff device");
        assert!(
            matches!(input, InputSpec::Images { .. }),
            "image model needs an image input"
        );
        Self {
            core: Core::new(name.into(), module, device),
            input,
        }
    }

    /// The wrapped module.
    pub fn module(&self) -> &M {
        self.core.module()
    }

    fn check(&self, batch: Batch) -> Result<(Tensor<4>, Tensor<1, Int>), ModelError> {
        let InputSpec::Images {
            channels,
            height,
            width,
            ..
        } = self.input
        else {
            unreachable!("checked in new")
        };
        match batch {
            Batch::Images { images, labels } => {
                let [n, c, h, w] = images.dims();
                if [c, h, w] != [channels, height, width] {
                    return Err(self.core.batch_error(format!(
                        "images are [{n}, {c}, {h}, {w}], expected [_, {channels}, {height}, {width}]"
                    )));
                }
                if labels.dims()[0] != n {
                    return Err(self
                        .core
                        .batch_error(format!("{n} images but {} labels", labels.dims()[0])));
                }
                Ok((images, labels))
            }
            Batch::Tokens { .. } => Err(self.core.batch_error("token batch for an image model")),
        }
    }

    fn metrics(&self, logits: Tensor<2>, labels: Tensor<1, Int>, loss: &Tensor<1>) -> Metrics {
        Metrics {
            loss: loss.clone().detach().into_scalar::<f32>() as f64,
            correct: correct_count(&logits, &labels),
            count: labels.dims()[0],
        }
    }
}

impl<M: ImageClassifier> Model for ImageModel<M> {
    fn name(&self) -> &str {
        &self.core.name
    }

    fn input(&self) -> InputSpec {
        self.input
    }

    fn device(&self) -> &Device {
        &self.core.device
    }

    fn table(&self) -> &ParamTable {
        &self.core.table
    }

    fn forward_loss(&mut self, batch: Batch) -> Result<LossOutput, ModelError> {
        let (images, labels) = self.check(batch)?;
        let logits = self.core.module().forward(images);
        let loss = self.core.loss.forward(logits.clone(), labels.clone());
        let metrics = self.metrics(logits, labels, &loss);
        Ok(LossOutput { loss, metrics })
    }

    fn backward_into(&mut self, loss: Tensor<1>, grads: &mut [f32]) {
        self.core.backward_into(loss, grads);
    }

    fn backward_flat(&mut self, loss: Tensor<1>) -> Tensor<1> {
        self.core.backward_flat(loss)
    }

    fn evaluate(&mut self, batch: Batch) -> Result<Metrics, ModelError> {
        let (images, labels) = self.check(batch)?;
        let module = self.core.module().valid();
        let images = images.without_autodiff();
        let labels = labels.without_autodiff();
        let logits = module.forward(images);
        let loss = self.core.loss.forward(logits.clone(), labels.clone());
        Ok(self.metrics(logits, labels, &loss))
    }

    fn read_params(&self, out: &mut [f32]) {
        self.core.read(TensorRole::Param, out);
    }

    fn write_params(&mut self, src: &[f32]) {
        self.core.write(TensorRole::Param, src);
    }

    fn update_params(&mut self, f: &mut dyn FnMut(usize, &mut [f32])) {
        self.core.update_params(f);
    }

    fn update_params_on_device(&mut self, f: &mut dyn FnMut(usize, Tensor<1>) -> Tensor<1>) {
        self.core.update_params_on_device(f);
    }

    fn read_buffers(&self, out: &mut [f32]) {
        self.core.read(TensorRole::Buffer, out);
    }

    fn write_buffers(&mut self, src: &[f32]) {
        self.core.write(TensorRole::Buffer, src);
    }

    fn to_bytes(&self) -> Result<Vec<u8>, ModelError> {
        self.core.to_bytes()
    }

    fn load_bytes(&mut self, bytes: &[u8]) -> Result<(), ModelError> {
        self.core.load_bytes(bytes)
    }
}

/// Adapter from a [`LanguageModel`] module to [`Model`]: cross-entropy over every position,
/// top-1 next-token accuracy, and truncated BPTT — the hidden state after one batch is
/// detached and carried into the next (separately for training and evaluation) until
/// [`Model::reset_state`] or a change of batch size.
pub struct LmModel<M: LanguageModel> {
    core: Core<M>,
    vocab: usize,
    train_state: Option<M::State>,
    eval_state: Option<M::State>,
}

impl<M: LanguageModel> core::fmt::Debug for LmModel<M> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("LmModel")
            .field("core", &self.core)
            .field("vocab", &self.vocab)
            .field("carries_train_state", &self.train_state.is_some())
            .field("carries_eval_state", &self.eval_state.is_some())
            .finish()
    }
}

impl<M: LanguageModel> LmModel<M> {
    /// Wraps `module` (initialized on the autodiff `device`) over a vocabulary of `vocab`.
    ///
    /// # Panics
    ///
    /// Panics if `device` is not an autodiff device.
    pub fn new(name: impl Into<String>, module: M, vocab: usize, device: &Device) -> Self {
        assert!(device.is_autodiff(), "models train on an autodiff device");
        Self {
            core: Core::new(name.into(), module, device),
            vocab,
            train_state: None,
            eval_state: None,
        }
    }

    /// The wrapped module.
    pub fn module(&self) -> &M {
        self.core.module()
    }

    /// Whether a training state is carried into the next batch.
    pub fn carries_state(&self) -> bool {
        self.train_state.is_some()
    }

    fn check(&self, batch: Batch) -> Result<(Tensor<2, Int>, Tensor<2, Int>), ModelError> {
        match batch {
            Batch::Tokens { inputs, targets } => {
                if inputs.dims() != targets.dims() {
                    return Err(self.core.batch_error(format!(
                        "inputs {:?} and targets {:?} differ in shape",
                        inputs.dims(),
                        targets.dims()
                    )));
                }
                let seq = inputs.dims()[1];
                if let Some(max) = self.core.module().max_seq_len().filter(|&m| seq > m) {
                    return Err(self.core.batch_error(format!(
                        "sequences of {seq} tokens are longer than the model's context of \
                         {max} (data.seq_len must be at most model.context)"
                    )));
                }
                Ok((inputs, targets))
            }
            Batch::Images { .. } => Err(self.core.batch_error("image batch for a language model")),
        }
    }

    /// Runs `module` on `inputs` from `state`; returns the loss, metrics and new state.
    fn run(
        module: &M,
        loss_fn: &CrossEntropyLoss,
        inputs: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        state: Option<M::State>,
    ) -> (Tensor<1>, Metrics, M::State) {
        let [b, t] = inputs.dims();
        let (logits, state) = module.forward(inputs, state);
        let vocab = logits.dims()[2];
        let logits = logits.reshape([b * t, vocab]);
        let targets = targets.reshape([b * t]);
        let loss = loss_fn.forward(logits.clone(), targets.clone());
        let metrics = Metrics {
            loss: loss.clone().detach().into_scalar::<f32>() as f64,
            correct: correct_count(&logits, &targets),
            count: b * t,
        };
        (loss, metrics, state)
    }
}

/// Drops a carried state whose batch size does not match `batch`.
fn matching<M: LanguageModel>(state: Option<M::State>, batch: usize) -> Option<M::State> {
    state.filter(|s| M::state_batch_size(s) == batch)
}

impl<M: LanguageModel> Model for LmModel<M> {
    fn name(&self) -> &str {
        &self.core.name
    }

    fn input(&self) -> InputSpec {
        InputSpec::Tokens { vocab: self.vocab }
    }

    fn device(&self) -> &Device {
        &self.core.device
    }

    fn table(&self) -> &ParamTable {
        &self.core.table
    }

    fn forward_loss(&mut self, batch: Batch) -> Result<LossOutput, ModelError> {
        let (inputs, targets) = self.check(batch)?;
        let state = matching::<M>(self.train_state.take(), inputs.dims()[0]);
        let (loss, metrics, state) =
            Self::run(self.core.module(), &self.core.loss, inputs, targets, state);
        self.train_state = Some(M::detach_state(state));
        Ok(LossOutput { loss, metrics })
    }

    fn backward_into(&mut self, loss: Tensor<1>, grads: &mut [f32]) {
        self.core.backward_into(loss, grads);
    }

    fn backward_flat(&mut self, loss: Tensor<1>) -> Tensor<1> {
        self.core.backward_flat(loss)
    }

    fn evaluate(&mut self, batch: Batch) -> Result<Metrics, ModelError> {
        let (inputs, targets) = self.check(batch)?;
        let state = matching::<M>(self.eval_state.take(), inputs.dims()[0]);
        let module = self.core.module().valid();
        let (_, metrics, state) = Self::run(
            &module,
            &self.core.loss,
            inputs.without_autodiff(),
            targets.without_autodiff(),
            state,
        );
        self.eval_state = Some(M::detach_state(state));
        Ok(metrics)
    }

    fn read_params(&self, out: &mut [f32]) {
        self.core.read(TensorRole::Param, out);
    }

    fn write_params(&mut self, src: &[f32]) {
        self.core.write(TensorRole::Param, src);
    }

    fn update_params(&mut self, f: &mut dyn FnMut(usize, &mut [f32])) {
        self.core.update_params(f);
    }

    fn update_params_on_device(&mut self, f: &mut dyn FnMut(usize, Tensor<1>) -> Tensor<1>) {
        self.core.update_params_on_device(f);
    }

    fn read_buffers(&self, out: &mut [f32]) {
        self.core.read(TensorRole::Buffer, out);
    }

    fn write_buffers(&mut self, src: &[f32]) {
        self.core.write(TensorRole::Buffer, src);
    }

    fn to_bytes(&self) -> Result<Vec<u8>, ModelError> {
        self.core.to_bytes()
    }

    fn load_bytes(&mut self, bytes: &[u8]) -> Result<(), ModelError> {
        self.core.load_bytes(bytes)
    }

    fn reset_state(&mut self) {
        self.train_state = None;
        self.eval_state = None;
    }

    fn carried_state(&self) -> Vec<f32> {
        self.train_state
            .as_ref()
            .map_or_else(Vec::new, M::state_values)
    }

    fn set_carried_state(&mut self, values: &[f32]) -> Result<(), ModelError> {
        self.train_state = if values.is_empty() {
            None
        } else {
            let state = self
                .core
                .module()
                .state_from_values(values, &self.core.device)
                .map_err(|e| ModelError::Record(format!("carried recurrent state: {e}")))?;
            Some(state)
        };
        Ok(())
    }

    fn reset_eval_state(&mut self) {
        self.eval_state = None;
    }
}
