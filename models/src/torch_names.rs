//! PyTorch's names and layouts for a model's tensors: what `dtrain export` writes to a
//! safetensors file and what `[model] init_from` reads back.
//!
//! A [`TorchLayout`] lists, for one model, every tensor of the PyTorch module of the same
//! architecture — torchvision's `alexnet`, `vgg*`, `resnet18/34/50`, or the twins of
//! `experiments/vs_pytorch/models.py` for the CIFAR models, the MLP, LeNet-5, the LSTM and
//! the GPT — with its name, its shape in PyTorch's layout, and where its values are in
//! dtrain's flat buffers ([`crate::ParamTable`]). Each family says how its names map
//! ([`crate::ModelFamily::torch_layout`]); what every family shares is here:
//!
//! - burn's `Linear` weight is `[d_in, d_out]`, PyTorch's `[d_out, d_in]`: transposed
//!   (embeddings are `[vocab, d]` in both and are not);
//! - burn's `BatchNorm` / `LayerNorm` `gamma` / `beta` are PyTorch's `weight` / `bias`;
//! - PyTorch's `BatchNorm` keeps a `num_batches_tracked` counter (int64, shape `[]`) that
//!   dtrain has no use for: written as the run's step, required on reading (so a strict
//!   PyTorch `state_dict` loads both ways) and otherwise ignored;
//! - burn's LSTM has one `Linear` per gate and transform, PyTorch's one matrix per
//!   transform with the gates stacked in the order input, forget, cell, output.
//!
//! This file knows no file format: it moves values between dtrain's flat buffers and
//! named row-major `f32` arrays. The framework writes and reads the safetensors files.

use std::collections::BTreeMap;

use crate::flat::{ParamTable, TensorRole};
use crate::ModelError;

/// One part of a PyTorch tensor: a dtrain tensor (index into the table's entries), possibly
/// transposed (a 2-D `Linear` weight).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// Index into [`ParamTable::entries`].
    pub entry: usize,
    /// Whether the 2-D tensor is transposed on the way to PyTorch.
    pub transpose: bool,
}

/// Where a PyTorch tensor's values come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TorchSource {
    /// dtrain tensors, each transposed where marked, stacked along dimension 0.
    Parts(Vec<Part>),
    /// BatchNorm's `num_batches_tracked`: an int64 scalar dtrain does not keep.
    BatchesTracked,
}

/// One tensor of the PyTorch module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TorchTensor {
    /// PyTorch's `state_dict` key, e.g. `layer1.0.conv1.weight`.
    pub name: String,
    /// Shape in PyTorch's layout.
    pub shape: Vec<usize>,
    /// Where the values are in dtrain's buffers.
    pub source: TorchSource,
}

/// Every tensor of the PyTorch module of one model, in dtrain's table order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TorchLayout {
    /// The tensors.
    pub tensors: Vec<TorchTensor>,
}

/// A named array in PyTorch's layout, row-major.
#[derive(Debug, Clone, PartialEq)]
pub enum TorchValues {
    /// A float tensor.
    F32(Vec<f32>),
    /// An int64 tensor (`num_batches_tracked`).
    I64(Vec<i64>),
}

impl TorchLayout {
    /// The layout every family starts from: one PyTorch tensor per dtrain tensor, named by
    /// `rename(module path)` + the leaf name (`gamma` → `weight`, `beta` → `bias`), 2-D
    /// weights of modules whose name does not end in `embedding` transposed, and
    /// `num_batches_tracked` after each `running_var`.
    pub fn generic(table: &ParamTable, rename: impl Fn(&str) -> String) -> Self {
        let mut tensors = Vec::new();
        for (i, e) in table.entries().iter().enumerate() {
            let (path, leaf) = e.name.rsplit_once('.').unwrap_or(("", e.name.as_str()));
            let leaf = match leaf {
                "gamma" => "weight",
                "beta" => "bias",
                other => other,
            };
            let module = path.rsplit('.').next().unwrap_or("");
            let transpose =
                leaf == "weight" && e.shape.len() == 2 && !module.ends_with("embedding");
            let prefix = rename(path);
            let join = |leaf: &str| {
                if prefix.is_empty() {
                    leaf.to_string()
                } else {
                    format!("{prefix}.{leaf}")
                }
            };
            let mut shape = e.shape.clone();
            if transpose {
                shape.reverse();
            }
            tensors.push(TorchTensor {
                name: join(leaf),
                shape,
                source: TorchSource::Parts(vec![Part {
                    entry: i,
                    transpose,
                }]),
            });
            if leaf == "running_var" {
                tensors.push(TorchTensor {
                    name: join("num_batches_tracked"),
                    shape: Vec::new(),
                    source: TorchSource::BatchesTracked,
                });
            }
        }
        TorchLayout { tensors }
    }

    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&TorchTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Every tensor's values in PyTorch's layout, from dtrain's flat `params` and `buffers`
    /// (of `table`); `num_batches_tracked` is `step`.
    ///
    /// # Panics
    ///
    /// Panics if the buffers are not the lengths `table` says.
    pub fn gather(
        &self,
        table: &ParamTable,
        params: &[f32],
        buffers: &[f32],
        step: u64,
    ) -> Vec<(String, Vec<usize>, TorchValues)> {
        assert_eq!(params.len(), table.num_params(), "parameter buffer length");
        assert_eq!(buffers.len(), table.num_buffers(), "buffer length");
        self.tensors
            .iter()
            .map(|t| {
                let values = match &t.source {
                    TorchSource::BatchesTracked => {
                        TorchValues::I64(vec![i64::try_from(step).unwrap_or(i64::MAX)])
                    }
                    TorchSource::Parts(parts) => {
                        let mut out = Vec::with_capacity(t.shape.iter().product());
                        for p in parts {
                            let e = &table.entries()[p.entry];
                            let flat = match e.role {
                                TensorRole::Param => params,
                                TensorRole::Buffer => buffers,
                            };
                            let src = &flat[e.offset..e.offset + e.numel];
                            if p.transpose {
                                let (r, c) = (e.shape[0], e.shape[1]);
                                for j in 0..c {
                                    out.extend((0..r).map(|i| src[i * c + j]));
                                }
                            } else {
                                out.extend_from_slice(src);
                            }
                        }
                        TorchValues::F32(out)
                    }
                };
                (t.name.clone(), t.shape.clone(), values)
            })
            .collect()
    }

    /// Checks that `file` (name → shape and values, PyTorch's layout) holds exactly this
    /// layout's tensors: the error names the first tensor that is missing, extra, of another
    /// shape, length or dtype.
    pub fn verify(
        &self,
        file: &BTreeMap<String, (Vec<usize>, TorchValues)>,
    ) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Record(m));
        if let Some(extra) = file.keys().find(|k| self.get(k).is_none()) {
            return bad(format!(
                "tensor {extra:?} is not a tensor of this model (its first is {:?})",
                self.tensors.first().map_or("", |t| t.name.as_str())
            ));
        }
        for t in &self.tensors {
            let Some((shape, values)) = file.get(&t.name) else {
                return bad(format!("tensor {:?} is missing", t.name));
            };
            if *shape != t.shape {
                return bad(format!(
                    "tensor {:?} has shape {shape:?}, this model's is {:?}",
                    t.name, t.shape
                ));
            }
            let len = match values {
                TorchValues::F32(v) => v.len(),
                TorchValues::I64(v) => v.len(),
            };
            if len != t.shape.iter().product::<usize>() {
                return bad(format!(
                    "tensor {:?} holds {len} values for the shape {shape:?}",
                    t.name
                ));
            }
            match (&t.source, values) {
                (TorchSource::BatchesTracked, TorchValues::I64(_))
                | (TorchSource::Parts(_), TorchValues::F32(_)) => {}
                (TorchSource::BatchesTracked, _) => {
                    return bad(format!("tensor {:?} must be int64", t.name))
                }
                (TorchSource::Parts(_), _) => {
                    return bad(format!("tensor {:?} must be float32", t.name))
                }
            }
        }
        Ok(())
    }

    /// Writes the named tensors `file` (PyTorch's layout) into dtrain's flat `params` and
    /// `buffers` (of `table`), after [`TorchLayout::verify`]: nothing is written unless every
    /// tensor fits.
    pub fn scatter(
        &self,
        table: &ParamTable,
        file: &BTreeMap<String, (Vec<usize>, TorchValues)>,
        params: &mut [f32],
        buffers: &mut [f32],
    ) -> Result<(), ModelError> {
        self.verify(file)?;
        for t in &self.tensors {
            let (TorchSource::Parts(parts), Some((_, TorchValues::F32(v)))) =
                (&t.source, file.get(&t.name))
            else {
                continue;
            };
            let mut at = 0;
            for p in parts {
                let e = &table.entries()[p.entry];
                let flat: &mut [f32] = match e.role {
                    TensorRole::Param => params,
                    TensorRole::Buffer => buffers,
                };
                let dst = &mut flat[e.offset..e.offset + e.numel];
                let src = &v[at..at + e.numel];
                if p.transpose {
                    let (r, c) = (e.shape[0], e.shape[1]);
                    for j in 0..c {
                        for i in 0..r {
                            dst[i * c + j] = src[j * r + i];
                        }
                    }
                } else {
                    dst.copy_from_slice(src);
                }
                at += e.numel;
            }
        }
        Ok(())
    }
}

/// `path` with its leading `{module}.{i}` replaced by `to(i)` (the rest kept), or `None`
/// when `path` does not start with `module` and an index.
pub(crate) fn reindex(path: &str, module: &str, to: impl Fn(usize) -> String) -> Option<String> {
    let rest = path.strip_prefix(module)?.strip_prefix('.')?;
    let (index, tail) = rest.split_once('.').unwrap_or((rest, ""));
    let i: usize = index.parse().ok()?;
    let head = to(i);
    Some(if tail.is_empty() {
        head
    } else {
        format!("{head}.{tail}")
    })
}

/// How many layers `module.{i}` `table` has (the count of distinct `i`).
pub(crate) fn count_indexed(table: &ParamTable, module: &str) -> usize {
    let mut seen = std::collections::BTreeSet::new();
    for e in table.entries() {
        if let Some(rest) = e
            .name
            .strip_prefix(module)
            .and_then(|r| r.strip_prefix('.'))
        {
            if let Some(i) = rest.split('.').next().and_then(|i| i.parse::<usize>().ok()) {
                seen.insert(i);
            }
        }
    }
    seen.len()
}

/// A classifier head's names: one layer is the twins' `classifier`, several are at
/// `classifier.{at[i]}` (torchvision's `Sequential` indices, dropout and ReLU between).
pub(crate) fn classifier_name(i: usize, layers: usize, at: [usize; 3]) -> String {
    if layers == 1 {
        "classifier".into()
    } else {
        format!("classifier.{}", at.get(i).copied().unwrap_or(i))
    }
}

/// The LSTM's layout: the generic one, with each layer's eight gate transforms
/// (`layers.{i}.{input,forget,output,cell}_gate.{input,hidden}_transform.{weight,bias}`)
/// stacked into PyTorch's `weight_ih_l0`, `weight_hh_l0`, `bias_ih_l0`, `bias_hh_l0` of a
/// one-layer `nn.LSTM` at `layers.{i}`, gates in the order input, forget, cell, output.
pub(crate) fn lstm_layout(table: &ParamTable) -> Result<TorchLayout, ModelError> {
    let generic = TorchLayout::generic(table, |p| p.to_string());
    let mut tensors = Vec::new();
    // (layer prefix, transform, leaf) → parts in gate order.
    let mut stacked: BTreeMap<(String, &str, &str), [Option<Part>; 4]> = BTreeMap::new();
    const GATES: [&str; 4] = ["input_gate", "forget_gate", "cell_gate", "output_gate"];
    for (t, e) in generic.tensors.iter().zip(table.entries()) {
        let gate = GATES
            .iter()
            .enumerate()
            .find_map(|(g, name)| e.name.find(&format!(".{name}.")).map(|at| (g, at, name)));
        let Some((g, at, name)) = gate else {
            tensors.push(t.clone());
            continue;
        };
        let layer = e.name[..at].to_string();
        let rest = &e.name[at + name.len() + 2..];
        let key = match rest {
            "input_transform.weight" => ("ih", "weight"),
            "input_transform.bias" => ("ih", "bias"),
            "hidden_transform.weight" => ("hh", "weight"),
            "hidden_transform.bias" => ("hh", "bias"),
            _ => {
                return Err(ModelError::Config(format!(
                    "unexpected LSTM tensor {:?}",
                    e.name
                )))
            }
        };
        let TorchSource::Parts(parts) = &t.source else {
            unreachable!("the generic layout of a float tensor has parts")
        };
        let slot = stacked.entry((layer, key.0, key.1)).or_default();
        slot[g] = Some(parts[0].clone());
    }
    for ((layer, transform, leaf), parts) in stacked {
        let parts: Vec<Part> = parts.into_iter().flatten().collect();
        if parts.len() != 4 {
            return Err(ModelError::Config(format!(
                "LSTM layer {layer:?} does not have four gates"
            )));
        }
        let e = &table.entries()[parts[0].entry];
        let shape = if leaf == "weight" {
            vec![4 * e.shape[1], e.shape[0]]
        } else {
            vec![4 * e.shape[0]]
        };
        tensors.push(TorchTensor {
            name: format!("{layer}.{leaf}_{transform}_l0"),
            shape,
            source: TorchSource::Parts(parts),
        });
    }
    Ok(TorchLayout { tensors })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{cpu_device, ModelSpec};

    fn layout(toml_spec: &str) -> (ParamTable, TorchLayout) {
        let spec: ModelSpec = toml::from_str(toml_spec).unwrap();
        let model = spec.build(&cpu_device()).unwrap();
        let table = model.table().clone();
        let layout = spec.torch_layout(&table).unwrap();
        (table, layout)
    }

    fn names(l: &TorchLayout) -> Vec<(&str, Vec<usize>)> {
        l.tensors
            .iter()
            .map(|t| (t.name.as_str(), t.shape.clone()))
            .collect()
    }

    #[test]
    fn lenet_has_the_twins_names_with_linear_weights_transposed() {
        let (_, l) = layout("kind = \"lenet\"\n");
        assert_eq!(
            names(&l),
            [
                ("conv1.weight", vec![6, 1, 5, 5]),
                ("conv1.bias", vec![6]),
                ("conv2.weight", vec![16, 6, 5, 5]),
                ("conv2.bias", vec![16]),
                ("fc1.weight", vec![120, 400]),
                ("fc1.bias", vec![120]),
                ("fc2.weight", vec![84, 120]),
                ("fc2.bias", vec![84]),
                ("fc3.weight", vec![10, 84]),
                ("fc3.bias", vec![10]),
            ]
        );
    }

    #[test]
    fn gather_then_scatter_is_the_identity_and_mismatches_name_the_tensor() {
        let (table, l) =
            layout("kind = \"lstm\"\nvariant = \"word\"\nvocab = 50\nembed = 8\nhidden = 8\n");
        let n = table.num_params();
        let params: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let out = l.gather(&table, &params, &[], 3);
        let names: Vec<&str> = out.iter().map(|(n, _, _)| n.as_str()).collect();
        assert!(names.contains(&"layers.1.weight_ih_l0"), "{names:?}");
        assert!(names.contains(&"decoder_bias"), "{names:?}");
        let mut file: BTreeMap<_, _> = out.into_iter().map(|(n, s, v)| (n, (s, v))).collect();
        let mut back = vec![0.0; n];
        l.scatter(&table, &file, &mut back, &mut []).unwrap();
        assert_eq!(back, params);
        // PyTorch's gate order: the forget gate's input weights are rows 8..16 of
        // weight_ih, and its bias values follow the input gate's.
        let e = table
            .get("layers.0.forget_gate.input_transform.bias")
            .unwrap();
        let (_, TorchValues::F32(b)) = &file["layers.0.bias_ih_l0"] else {
            panic!()
        };
        assert_eq!(&b[8..16], &params[e.offset..e.offset + 8]);

        let shape = &mut file.get_mut("embedding.weight").unwrap().0;
        shape.reverse();
        let err = l
            .scatter(&table, &file, &mut back, &mut [])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"embedding.weight\" has shape [8, 50]"),
            "{err}"
        );
        file.remove("embedding.weight");
        let err = l
            .scatter(&table, &file, &mut back, &mut [])
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"embedding.weight\" is missing"), "{err}");
        file.insert("extra".into(), (vec![], TorchValues::F32(vec![0.0])));
        let err = l
            .scatter(&table, &file, &mut back, &mut [])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"extra\" is not a tensor of this model"),
            "{err}"
        );
    }

    #[test]
    fn torchvision_resnet18_names_and_batch_norm_counters() {
        let (table, l) = layout("kind = \"resnet\"\nvariant = \"resnet18\"\n");
        let n = names(&l);
        for (name, shape) in [
            ("conv1.weight", vec![64, 3, 7, 7]),
            ("bn1.weight", vec![64]),
            ("bn1.running_var", vec![64]),
            ("bn1.num_batches_tracked", vec![]),
            ("layer1.0.conv1.weight", vec![64, 64, 3, 3]),
            ("layer2.0.downsample.0.weight", vec![128, 64, 1, 1]),
            ("layer2.0.downsample.1.bias", vec![128]),
            ("layer4.1.bn2.running_mean", vec![512]),
            ("fc.weight", vec![1000, 512]),
            ("fc.bias", vec![1000]),
        ] {
            assert!(
                n.contains(&(name, shape.clone())),
                "{name} {shape:?} not in {n:?}"
            );
        }
        // torchvision's resnet18 state_dict: 122 tensors (62 parameters; 20 BatchNorms with
        // 3 buffers each).
        assert_eq!(l.tensors.len(), 122);
        let floats: usize = l
            .tensors
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum::<usize>()
            - 20;
        assert_eq!(floats, table.num_params() + table.num_buffers());
    }

    #[test]
    fn cifar_resnet_alexnet_vgg_and_gpt_names() {
        let (_, l) = layout("kind = \"resnet\"\nvariant = \"resnet20\"\n");
        let n = names(&l);
        assert!(n.contains(&("blocks.8.bn2.weight", vec![64])), "{n:?}");
        assert!(
            n.contains(&("blocks.3.conv1.weight", vec![32, 16, 3, 3])),
            "{n:?}"
        );
        assert!(n.contains(&("fc.weight", vec![10, 64])), "{n:?}");
        let (_, l) = layout("kind = \"alexnet\"\nvariant = \"cifar\"\n");
        let n = names(&l);
        assert!(
            n.contains(&("features.4.weight", vec![256, 256, 3, 3])),
            "{n:?}"
        );
        assert!(n.contains(&("classifier.weight", vec![10, 256])), "{n:?}");
        let (_, l) = layout("kind = \"alexnet\"\nvariant = \"imagenet\"\n");
        let n = names(&l);
        assert!(
            n.contains(&("features.10.weight", vec![256, 256, 3, 3])),
            "{n:?}"
        );
        assert!(
            n.contains(&("classifier.6.weight", vec![1000, 4096])),
            "{n:?}"
        );
        let (_, l) =
            layout("kind = \"vgg\"\nvariant = \"vgg11\"\nbatch_norm = true\nhead = \"imagenet\"\n");
        let n = names(&l);
        // torchvision vgg11_bn: conv 0, bn 1, relu 2, pool 3, conv 4, bn 5, …
        assert!(
            n.contains(&("features.4.weight", vec![128, 64, 3, 3])),
            "{n:?}"
        );
        assert!(n.contains(&("features.5.running_mean", vec![128])), "{n:?}");
        assert!(
            n.contains(&("features.25.weight", vec![512, 512, 3, 3])),
            "{n:?}"
        );
        assert!(
            n.contains(&("classifier.3.weight", vec![4096, 4096])),
            "{n:?}"
        );
        let (_, l) = layout("kind = \"vgg\"\nvariant = \"vgg11\"\n");
        let n = names(&l);
        assert!(
            n.contains(&("features.7.weight", vec![512, 512, 3, 3])),
            "{n:?}"
        );
        assert!(n.contains(&("classifier.weight", vec![10, 512])), "{n:?}");
        let (_, l) = layout(
            "kind = \"gpt\"\nvocab = 40\nd_model = 16\nheads = 2\nlayers = 1\ncontext = 8\n",
        );
        let n = names(&l);
        assert!(
            n.contains(&("token_embedding.weight", vec![40, 16])),
            "{n:?}"
        );
        assert!(
            n.contains(&("blocks.0.attention.query.weight", vec![16, 16])),
            "{n:?}"
        );
        assert!(
            n.contains(&("blocks.0.mlp.fc.weight", vec![64, 16])),
            "{n:?}"
        );
        assert!(n.contains(&("final_norm.weight", vec![16])), "{n:?}");
    }
}
