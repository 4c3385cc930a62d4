//! Weights out and in as safetensors files with PyTorch's names: `dtrain export` and
//! `[model] init_from`.
//!
//! The names and layouts come from the model family
//! ([`dtrain_models::ModelFamily::torch_layout`], tables in `models/README.md`): a file
//! written here loads into the PyTorch module of the same architecture with
//! `load_state_dict(strict=True)` (torchvision's for the ImageNet models, the twins of
//! `experiments/vs_pytorch/models.py` for the others), and a `state_dict` saved by PyTorch
//! (`safetensors.torch.save_file`) loads here. Tensors are `F32`, except BatchNorm's
//! `num_batches_tracked` (`I64`, shape `[]`, written as the checkpoint's step).
//!
//! Reading checks the whole file before anything is used: a file that is not safetensors,
//! a missing or extra tensor, another shape or dtype is an error naming the file and the
//! tensor, never a silent skip.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use dtrain_models::{cpu_device, Model, ModelSpec, TorchValues};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use thiserror::Error;

use crate::checkpoint::{self, Checkpoint, CheckpointError};
use crate::config::RunConfig;
use crate::trainer::{checkpoint_dir_name, RunDir};

/// Why weights could not be exported or loaded.
#[derive(Debug, Error)]
pub enum ExportError {
    /// Reading or writing a checkpoint or the output file failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A file is unreadable or does not fit the model.
    #[error("{path}: {what}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong (names the tensor where one is at fault).
        what: String,
    },
}

fn file_error(path: &Path, what: impl Into<String>) -> ExportError {
    ExportError::File {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

/// What [`export_run`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    /// The checkpoint's step.
    pub step: u64,
    /// The checkpoint directory read.
    pub checkpoint: PathBuf,
    /// The model's `kind`.
    pub model: String,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes written.
    pub bytes: usize,
}

/// Writes the parameters and BatchNorm buffers of run `run_dir`'s checkpoint at `step`
/// (default: the latest) to `out` as safetensors with PyTorch's names, atomically.
pub fn export_run(run_dir: &Path, step: Option<u64>, out: &Path) -> Result<Exported, ExportError> {
    let run = RunDir {
        root: run_dir.to_path_buf(),
    };
    let dir = match step {
        Some(s) => {
            let dir = run.checkpoints().join(checkpoint_dir_name(s));
            if !dir.is_dir() {
                let have: Vec<String> = run
                    .checkpoint_dirs()
                    .iter()
                    .rev()
                    .map(|(s, _)| s.to_string())
                    .collect();
                return Err(file_error(
                    run_dir,
                    format!(
                        "no checkpoint at step {s} (checkpoints at steps: {})",
                        if have.is_empty() {
                            "none".into()
                        } else {
                            have.join(", ")
                        }
                    ),
                ));
            }
            dir
        }
        None => run
            .latest()
            .or_else(|| run.checkpoint_dirs().first().map(|(_, d)| d.clone()))
            .ok_or_else(|| file_error(run_dir, "no checkpoint (not a run directory?)"))?,
    };
    let file = dir.join("rank-0.ckpt");
    let ck = Checkpoint::load(&file)?;
    let config_text = String::from_utf8(ck.bytes("config.toml")?.to_vec())
        .map_err(|_| file_error(&file, "its config.toml section is not UTF-8"))?;
    let config = RunConfig::parse(
        &config_text,
        &format!("{}:config.toml", file.display()),
        &[],
    )
    .map_err(|e| file_error(&file, e.to_string()))?;
    let step = ck
        .json::<serde_json::Value>("meta")?
        .get("step")
        .and_then(|s| s.as_u64())
        .ok_or_else(|| file_error(&file, "its meta section has no step"))?;
    let spec = &config.model.spec;
    let model = spec
        .build(&cpu_device())
        .map_err(|e| file_error(&file, format!("model: {e}")))?;
    let table = model.table();
    let params = ck.f32("params")?;
    let buffers = ck.f32("buffers")?;
    if params.len() != table.num_params() || buffers.len() != table.num_buffers() {
        return Err(file_error(
            &file,
            format!(
                "holds {} parameters / {} buffer values, its model {} has {} / {}",
                params.len(),
                buffers.len(),
                spec.kind(),
                table.num_params(),
                table.num_buffers()
            ),
        ));
    }
    let (tensors, bytes) = write_weights(spec, table, &params, &buffers, step, out)?;
    Ok(Exported {
        step,
        checkpoint: dir,
        model: spec.kind().to_string(),
        tensors,
        bytes,
    })
}

/// Writes the flat `params` and `buffers` of the model `spec` builds (whose table is
/// `table`) to `out` as safetensors with PyTorch's names, atomically; `step` goes into the
/// metadata and `num_batches_tracked`. Returns the number of tensors and of bytes written.
pub fn write_weights(
    spec: &ModelSpec,
    table: &dtrain_models::ParamTable,
    params: &[f32],
    buffers: &[f32],
    step: u64,
    out: &Path,
) -> Result<(usize, usize), ExportError> {
    let layout = spec
        .torch_layout(table)
        .map_err(|e| file_error(out, e.to_string()))?;
    let tensors = layout.gather(table, params, buffers, step);
    let bytes = encode(&tensors, spec, step).map_err(|e| file_error(out, e))?;
    checkpoint::write_atomic(out, &bytes)?;
    Ok((tensors.len(), bytes.len()))
}

/// The safetensors bytes of `tensors`, with the metadata PyTorch's `save_file` writes
/// (`format = pt`) plus the model spec (JSON) and the step.
fn encode(
    tensors: &[(String, Vec<usize>, TorchValues)],
    spec: &ModelSpec,
    step: u64,
) -> Result<Vec<u8>, String> {
    let raw: Vec<(&str, &[usize], Dtype, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape, values)| {
            let (dtype, bytes) = match values {
                TorchValues::F32(v) => (
                    Dtype::F32,
                    v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
                ),
                TorchValues::I64(v) => (
                    Dtype::I64,
                    v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
                ),
            };
            (name.as_str(), shape.as_slice(), dtype, bytes)
        })
        .collect();
    let mut views = Vec::with_capacity(raw.len());
    for (name, shape, dtype, bytes) in &raw {
        let view = TensorView::new(*dtype, shape.to_vec(), bytes)
            .map_err(|e| format!("tensor {name:?}: {e}"))?;
        views.push((*name, view));
    }
    let metadata = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        (
            "dtrain.model".to_string(),
            serde_json::to_string(spec).unwrap_or_default(),
        ),
        ("dtrain.step".to_string(), step.to_string()),
    ]);
    safetensors::serialize(views, Some(metadata)).map_err(|e| e.to_string())
}

/// Reads the safetensors file `path` into name → (shape, values). Tensors must be `F32` or
/// `I64`.
pub fn read_safetensors(
    path: &Path,
) -> Result<BTreeMap<String, (Vec<usize>, TorchValues)>, ExportError> {
    let bytes = std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| file_error(path, format!("not a readable safetensors file: {e}")))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.iter() {
        let data = view.data();
        let values = match view.dtype() {
            Dtype::F32 => TorchValues::F32(
                data.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            Dtype::I64 => TorchValues::I64(
                data.chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
            ),
            other => {
                return Err(file_error(
                    path,
                    format!(
                        "tensor {name:?} is {other:?}; dtrain reads F32 tensors (and I64 \
                         num_batches_tracked)"
                    ),
                ))
            }
        };
        out.insert(name.to_string(), (view.shape().to_vec(), values));
    }
    Ok(out)
}

/// Checks, before any work starts, that the safetensors file `path` fits the model `spec`
/// builds (every tensor by name, shape and dtype), without initialising the model.
pub fn check_init_from(spec: &ModelSpec, path: &Path) -> Result<(), ExportError> {
    let file = read_safetensors(path)?;
    let model = spec
        .build(&cpu_device())
        .map_err(|e| file_error(path, format!("model: {e}")))?;
    spec.torch_layout(model.table())
        .and_then(|layout| layout.verify(&file))
        .map_err(|e| misfit(path, spec, e))
}

fn misfit(path: &Path, spec: &ModelSpec, e: dtrain_models::ModelError) -> ExportError {
    let e = e.to_string();
    file_error(
        path,
        format!(
            "does not fit model {}: {}",
            spec.kind(),
            e.trim_start_matches("model record: ")
        ),
    )
}

/// Replaces `model`'s parameters and buffers (the model `spec` builds) with the tensors of
/// the safetensors file `path`, which must hold exactly the model's PyTorch-named tensors
/// ([`dtrain_models::TorchLayout::scatter`]). Nothing is written unless all of it fits.
pub fn load_into(spec: &ModelSpec, model: &mut dyn Model, path: &Path) -> Result<(), ExportError> {
    let file = read_safetensors(path)?;
    let table = model.table().clone();
    let layout = spec
        .torch_layout(&table)
        .map_err(|e| file_error(path, e.to_string()))?;
    let mut params = vec![0.0; table.num_params()];
    let mut buffers = vec![0.0; table.num_buffers()];
    model.read_params(&mut params);
    model.read_buffers(&mut buffers);
    layout
        .scatter(&table, &file, &mut params, &mut buffers)
        .map_err(|e| misfit(path, spec, e))?;
    model.write_params(&params);
    if !buffers.is_empty() {
        model.write_buffers(&buffers);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lenet() -> (ModelSpec, Box<dyn Model>) {
        let spec: ModelSpec = toml::from_str("kind = \"lenet\"\n").unwrap();
        let model = spec.build(&cpu_device()).unwrap();
        (spec, model)
    }

    #[test]
    fn a_written_file_loads_back_and_bad_files_are_named_errors() {
        let dir = tempfile::tempdir().unwrap();
        let (spec, mut model) = lenet();
        let table = model.table().clone();
        let params: Vec<f32> = (0..table.num_params())
            .map(|i| (i % 97) as f32 * 0.01)
            .collect();
        let layout = spec.torch_layout(&table).unwrap();
        let tensors = layout.gather(&table, &params, &[], 5);
        let path = dir.path().join("w.safetensors");
        std::fs::write(&path, encode(&tensors, &spec, 5).unwrap()).unwrap();
        load_into(&spec, model.as_mut(), &path).unwrap();
        let mut back = vec![0.0; table.num_params()];
        model.read_params(&mut back);
        assert_eq!(back, params);

        // Truncated: one line naming the file.
        let bytes = std::fs::read(&path).unwrap();
        let cut = dir.path().join("cut.safetensors");
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        let err = load_into(&spec, model.as_mut(), &cut)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cut.safetensors: not a readable safetensors file"),
            "{err}"
        );
        assert!(!err.contains('\n'), "{err}");
        // Another architecture: the first mismatching tensor is named.
        let mlp: ModelSpec = toml::from_str("kind = \"mlp\"\n").unwrap();
        let mut other = mlp.build(&cpu_device()).unwrap();
        let err = load_into(&mlp, other.as_mut(), &path)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("does not fit model mlp: tensor \"conv1.bias\" is not a tensor"),
            "{err}"
        );
    }
}
