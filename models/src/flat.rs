//! Flat `f32` views of a module: the parameter table, gradients → flat buffer, flat buffer →
//! parameters, and BatchNorm running statistics → flat buffer and back.
//!
//! # Why a table and not `ParamId`s
//!
//! burn draws a fresh random [`ParamId`](burn::module::ParamId) for every parameter at init, so
//! ids differ between workers and between runs. The data-parallel trainer lines workers up by
//! the *module-visit order* instead: `Module::visit` walks fields in declaration order,
//! recursively, which is the same on every process that builds the same architecture. The
//! [`ParamTable`] records that order once, with hierarchical names (`features.0.weight`), shapes
//! and offsets into two flat buffers: one for trainable parameters, one for buffers (BatchNorm
//! running statistics, which are not trained but must be broadcast, averaged and checkpointed).
//!
//! # Why it is fast
//!
//! The per-step paths do one bulk copy per tensor and no allocation in the steady state:
//! - gradients are *removed* from burn's [`Gradients`] container, so the backend hands back
//!   uniquely owned storage and reading it is zero-copy; one `copy_from_slice` moves it into
//!   the caller's reused buffer;
//! - writing parameters takes each parameter tensor out of the module, recycles its storage
//!   (zero-copy when nothing else holds it, which is the case between steps), overwrites it
//!   with one `copy_from_slice` and puts it back as a fresh leaf that requires gradients;
//! - [`update_in_place`] goes one better for the optimizer: it hands each parameter's own
//!   storage to a closure, so the update is written where the next forward pass reads it and
//!   no flat copy of the parameters is needed at all.
//!
//! Reading parameters (`read_params`) copies twice; the trainer keeps its own flat copy of the
//! parameters, so that path is only used for broadcasts and checkpoints.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::Gradients;

/// Whether a float tensor of a module is trained (a parameter) or only carried (a buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorRole {
    /// A trainable parameter: it has a gradient and lives in the flat parameter buffer.
    Param,
    /// A buffer, such as BatchNorm `running_mean` / `running_var`: no gradient, lives in the
    /// flat buffer of buffers.
    Buffer,
}

/// One float tensor of a module, in module-visit order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamEntry {
    /// Hierarchical, stable name, e.g. `features.0.weight` (field names joined by `.`; `Vec`
    /// elements are their index).
    pub name: String,
    /// Tensor shape (burn layout: `Linear` weights are `[d_in, d_out]`).
    pub shape: Vec<usize>,
    /// Number of elements.
    pub numel: usize,
    /// Offset of the first element in the flat buffer of its role.
    pub offset: usize,
    /// Parameter or buffer.
    pub role: TensorRole,
}

/// The deterministic layout of a module's float tensors: names, shapes and flat offsets, in
/// module-visit order. Built once per model; identical on every worker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParamTable {
    entries: Vec<ParamEntry>,
    num_params: usize,
    num_buffers: usize,
}

impl ParamTable {
    /// Builds the table of `module`, which must live on an autodiff device (that is how
    /// trainable parameters are told from buffers). Parameters that are still lazily
    /// uninitialized are *not* initialized: their shapes come from their declarations, so the
    /// table of a 138 M-parameter model costs nothing.
    pub fn of<M: Module>(module: &M) -> Self {
        let mut builder = TableBuilder {
            path: Vec::new(),
            table: ParamTable::default(),
        };
        module.visit(&mut builder);
        builder.table
    }

    /// All entries (parameters and buffers) in module-visit order.
    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    /// The trainable parameters, in order.
    pub fn params(&self) -> impl Iterator<Item = &ParamEntry> {
        self.entries.iter().filter(|e| e.role == TensorRole::Param)
    }

    /// The buffers, in order.
    pub fn buffers(&self) -> impl Iterator<Item = &ParamEntry> {
        self.entries.iter().filter(|e| e.role == TensorRole::Buffer)
    }

    /// Total number of trainable scalars (the length of the flat parameter / gradient buffer).
    pub fn num_params(&self) -> usize {
        self.num_params
    }

    /// Total number of buffer scalars (the length of the flat buffer of buffers).
    pub fn num_buffers(&self) -> usize {
        self.num_buffers
    }

    /// The entry with this name, if any.
    pub fn get(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|e| e.name == name)
    }
}

struct TableBuilder {
    path: Vec<String>,
    table: ParamTable,
}

impl ModuleVisitor for TableBuilder {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let shape = param.lazy_shape().to_vec();
        let numel = shape.iter().product();
        // A lazily initialized tensor is always a declared parameter (running statistics are
        // created eagerly); an initialized one tells us through `is_require_grad`.
        let role = if !param.is_initialized() || param.val().is_require_grad() {
            TensorRole::Param
        } else {
            TensorRole::Buffer
        };
        let t = &mut self.table;
        let offset = match role {
            TensorRole::Param => {
                t.num_params += numel;
                t.num_params - numel
            }
            TensorRole::Buffer => {
                t.num_buffers += numel;
                t.num_buffers - numel
            }
        };
        t.entries.push(ParamEntry {
            name: self.path.join("."),
            shape,
            numel,
            offset,
            role,
        });
    }
}

/// Moves the gradients of `module`'s trainable parameters out of `grads` into `out` (length
/// [`ParamTable::num_params`]), in table order. A parameter that took no part in the forward
/// pass has no gradient and gets zeros, so every worker's buffer has the same layout.
///
/// # Panics
///
/// Panics if `table` is not the table of `module`, if `out` has the wrong length, or if a
/// gradient is not `f32`.
pub fn grads_into<M: Module>(
    module: &M,
    table: &ParamTable,
    grads: &mut Gradients,
    out: &mut [f32],
) {
    assert_eq!(out.len(), table.num_params(), "gradient buffer length");
    each_grad(module, table, grads, &mut |entry, grad| {
        let dst = &mut out[entry.offset..entry.offset + entry.numel];
        match grad {
            Some(grad) => copy_into(grad, dst, &entry.name),
            None => dst.fill(0.0),
        }
    });
}

/// The gradients of `module`'s trainable parameters out of `grads` as one flat tensor on
/// the device they were computed on (`device` without autodiff), in table order, zeros for a
/// parameter that took no part in the forward pass: [`grads_into`]'s layout without leaving
/// the device (a GPU's gradient goes to the device codecs with no host copy).
///
/// # Panics
///
/// Panics if `table` is not the table of `module`.
pub fn grads_flat<M: Module>(
    module: &M,
    table: &ParamTable,
    grads: &mut Gradients,
    device: &Device,
) -> Tensor<1> {
    let device = device.clone().without_autodiff();
    let mut parts = Vec::new();
    each_grad(module, table, grads, &mut |entry, grad| {
        parts.push(grad.unwrap_or_else(|| Tensor::zeros([entry.numel], &device)));
    });
    if parts.is_empty() {
        Tensor::zeros([0], &device)
    } else {
        Tensor::cat(parts, 0)
    }
}

/// Calls `f` with each trainable parameter's table entry and its gradient, taken out of
/// `grads` and flattened (`None` for a parameter that took no part in the forward pass),
/// in table order.
fn each_grad<M: Module>(
    module: &M,
    table: &ParamTable,
    grads: &mut Gradients,
    f: &mut dyn FnMut(&ParamEntry, Option<Tensor<1>>),
) {
    let mut visitor = EachGrad {
        entries: &table.entries,
        index: 0,
        grads,
        f,
    };
    module.visit(&mut visitor);
    assert_eq!(
        visitor.index,
        table.entries.len(),
        "table does not match module"
    );
}

struct EachGrad<'a> {
    entries: &'a [ParamEntry],
    index: usize,
    grads: &'a mut Gradients,
    f: &'a mut dyn FnMut(&ParamEntry, Option<Tensor<1>>),
}

impl ModuleVisitor for EachGrad<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let entry = &self.entries[self.index];
        self.index += 1;
        if entry.role != TensorRole::Param {
            return;
        }
        let grad = param.val().grad_remove(self.grads);
        (self.f)(entry, grad.map(|g| g.reshape([entry.numel])));
    }
}

/// Copies a tensor's values into `dst` (one `memcpy` when the storage is not shared).
fn copy_into<const D: usize>(tensor: Tensor<D>, dst: &mut [f32], name: &str) {
    let data = tensor.into_data();
    let src = data
        .as_slice::<f32>()
        .unwrap_or_else(|e| panic!("tensor `{name}` is not f32: {e:?}"));
    assert_eq!(src.len(), dst.len(), "tensor `{name}` length");
    dst.copy_from_slice(src);
}

/// Copies every tensor of `role` into `out`, in table order.
///
/// # Panics
///
/// Panics if `table` is not the table of `module` or `out` has the wrong length.
pub fn read_into<M: Module>(module: &M, table: &ParamTable, role: TensorRole, out: &mut [f32]) {
    let expected = match role {
        TensorRole::Param => table.num_params(),
        TensorRole::Buffer => table.num_buffers(),
    };
    assert_eq!(out.len(), expected, "flat buffer length");
    let mut visitor = Reader {
        entries: &table.entries,
        index: 0,
        role,
        out,
    };
    module.visit(&mut visitor);
    assert_eq!(
        visitor.index,
        table.entries.len(),
        "table does not match module"
    );
}

struct Reader<'a> {
    entries: &'a [ParamEntry],
    index: usize,
    role: TensorRole,
    out: &'a mut [f32],
}

impl ModuleVisitor for Reader<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let entry = &self.entries[self.index];
        self.index += 1;
        if entry.role == self.role {
            let dst = &mut self.out[entry.offset..entry.offset + entry.numel];
            copy_into(param.val(), dst, &entry.name);
        }
    }
}

/// Overwrites every tensor of `role` with values from `src` (table order) and returns the
/// module. Devices, `ParamId`s and gradient requirements are kept; parameters stay trainable
/// leaves. The storage of each tensor is reused when nothing else holds it.
///
/// # Panics
///
/// Panics if `table` is not the table of `module` or `src` has the wrong length.
pub fn write_from<M: Module>(module: M, table: &ParamTable, role: TensorRole, src: &[f32]) -> M {
    let expected = match role {
        TensorRole::Param => table.num_params(),
        TensorRole::Buffer => table.num_buffers(),
    };
    assert_eq!(src.len(), expected, "flat buffer length");
    map_role(module, table, role, &mut |offset, dst| {
        dst.copy_from_slice(&src[offset..offset + dst.len()])
    })
}

/// Runs `f` on the values of `tensor` and returns a tensor with its shape, device and gradient
/// requirement holding the result. The storage is modified in place when this tensor is its
/// only owner; otherwise it is copied once.
fn modify<const D: usize>(tensor: Tensor<D>, f: impl FnOnce(&mut [f32])) -> Tensor<D> {
    let device = tensor.device();
    let require_grad = tensor.is_require_grad();
    // Dropping the autodiff wrapper first lets the backend hand back the storage without a
    // copy when this is its only owner.
    let mut data = tensor.without_autodiff().into_data();
    if data.as_mut_slice::<f32>().is_err() {
        // Not plain f32 storage (another dtype): convert once.
        data = data.convert::<f32>();
    }
    f(data
        .as_mut_slice::<f32>()
        .expect("f32 storage after conversion"));
    let out = Tensor::<D>::from_data(data, &device);
    if require_grad {
        out.require_grad()
    } else {
        out
    }
}

/// Calls `f(offset, values)` on every trainable parameter of `module`, in table order, with
/// the tensor's own storage (modified in place when the tensor is its only owner, else
/// copied once), and returns the module. `ParamId`s, devices and gradient requirements are
/// kept.
///
/// # Panics
///
/// Panics if `table` is not the table of `module`.
pub fn update_in_place<M: Module>(
    module: M,
    table: &ParamTable,
    f: &mut dyn FnMut(usize, &mut [f32]),
) -> M {
    map_role(module, table, TensorRole::Param, f)
}

/// Calls `f(offset, values)` on every tensor of `role` (see [`update_in_place`]); behind
/// [`write_from`] and [`update_in_place`].
fn map_role<M: Module>(
    module: M,
    table: &ParamTable,
    role: TensorRole,
    f: &mut dyn FnMut(usize, &mut [f32]),
) -> M {
    map_with(module, table, role, Apply::Host(f))
}

/// Replaces every trainable parameter of `module` by `f(offset, values)`, in table order,
/// with `values` the parameter flattened on its device without autodiff (no copy to the
/// host): see `Model::update_params_on_device`. `ParamId`s, devices and gradient
/// requirements are kept.
///
/// # Panics
///
/// Panics if `table` is not the table of `module`, or `f` returns another length.
pub fn update_on_device<M: Module>(
    module: M,
    table: &ParamTable,
    f: &mut dyn FnMut(usize, Tensor<1>) -> Tensor<1>,
) -> M {
    map_with(module, table, TensorRole::Param, Apply::Device(f))
}

/// What a mapping does to each tensor of its role.
enum Apply<'a> {
    /// Works on the values in host memory, in place.
    Host(&'a mut dyn FnMut(usize, &mut [f32])),
    /// Returns new values from the flattened tensor, on its device.
    Device(&'a mut dyn FnMut(usize, Tensor<1>) -> Tensor<1>),
}

/// The one mapper behind [`map_role`] and [`update_on_device`].
fn map_with<'a, M: Module>(
    module: M,
    table: &'a ParamTable,
    role: TensorRole,
    apply: Apply<'a>,
) -> M {
    let mut mapper = Updater {
        entries: &table.entries,
        index: 0,
        role,
        apply,
    };
    let module = module.map(&mut mapper);
    assert_eq!(
        mapper.index,
        table.entries.len(),
        "table does not match module"
    );
    module
}

struct Updater<'a> {
    entries: &'a [ParamEntry],
    index: usize,
    role: TensorRole,
    apply: Apply<'a>,
}

impl ModuleMapper for Updater<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let entry = &self.entries[self.index];
        self.index += 1;
        if entry.role != self.role {
            return param;
        }
        let (offset, numel) = (entry.offset, entry.numel);
        let apply = &mut self.apply;
        param.map(|tensor| {
            assert_eq!(tensor.shape().num_elements(), numel, "tensor length");
            match apply {
                Apply::Host(f) => modify(tensor, |values| f(offset, values)),
                Apply::Device(f) => replace_on_device(tensor, |flat| f(offset, flat)),
            }
        })
    }
}

/// `tensor` replaced by `f` of its flattened values on its device (without autodiff),
/// reshaped back, its autodiff and gradient requirement kept.
fn replace_on_device<const D: usize>(
    tensor: Tensor<D>,
    f: impl FnOnce(Tensor<1>) -> Tensor<1>,
) -> Tensor<D> {
    let shape = tensor.shape();
    let numel = shape.num_elements();
    let require_grad = tensor.is_require_grad();
    let autodiff = tensor.is_autodiff();
    let out = f(tensor.without_autodiff().reshape([numel]));
    assert_eq!(out.dims(), [numel], "updated length");
    let out: Tensor<D> = out.reshape(shape);
    let out = if autodiff { out.autodiff() } else { out };
    if require_grad {
        out.require_grad()
    } else {
        out
    }
}

/// Makes BatchNorm running statistics current. burn folds the latest update into a running
/// state lazily (on the next update, or when a validation copy is taken); reading or writing
/// the buffers first forces that fold so that the values seen are the ones the next forward
/// uses.
pub fn sync_buffers<M: Module>(module: &M) {
    let _ = module.valid();
}

/// `values` as a flat tensor on `device` (without autodiff): one upload on a GPU.
pub fn upload(values: &[f32], device: &crate::Device) -> Tensor<1> {
    let device = device.clone().without_autodiff();
    Tensor::<1>::from_data(
        burn::tensor::TensorData::new(values.to_vec(), [values.len()]),
        &device,
    )
}

/// The values of a flat `f32` tensor, copied to the host.
pub fn download(t: Tensor<1>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 values")
}
