//! Launch the quantized decode gemv: build the space the blueprint describes, bind four tensors
//! to it, and run one kernel.
//!
//! Every binding is stated in **values**: the weight's shape and strides count the values its
//! words hold, and `.packed(field)` says how many share one word. Nothing here widens a scale,
//! and nothing carries a quantization scheme — a scale is an ordinary operand, bound as the
//! stored words it lies in and read in its own width, whatever that width is.
//!
//! Scalar, though, and that is the orientation rather than a default worth tuning: a unit owns
//! `rows_per_unit` output rows against one block, and those scales sit a row apart in the scales
//! buffer. A wide read wants a unit owning consecutive blocks, which is the opposite of the
//! interleave the fold is built on.

use cubecl::prelude::ComptimeOptionArgs;
use cubecl::{client::Client, prelude::*};
use cubek_tile::{Launcher, Projection, kind::Field, launch::Grid, layout::PhysicalAxisMap};

use crate::{
    definition::MatmulSetupError,
    routine::BlueprintStrategy,
    tiled::{
        M, N,
        quant_gemv::{
            base::{QuantGemvProblem, QuantGemvRoutine},
            kernel::{KB, KI, quant_gemv_kernel},
        },
    },
};

/// The element each of the four operands is read at.
///
/// Off the bindings rather than on them, because one of them is not a binding's to answer: the
/// weight's buffer holds `u32` words and `served` is what they decode to, which is also the
/// element the contraction runs in. At `f32` the partials never round-trip through a narrower
/// element between `K` steps, which is what a long walk needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantGemvElems {
    pub served: ElemType,
    pub x: ElemType,
    /// The per-tensor level's stored element, where the scheme has one. One number, read as
    /// the word it fills: a width that does not fill one is refused.
    pub tensor_scale: ElemType,
    pub out: ElemType,
}

/// The four tensors a launch binds, each stated in values.
pub struct QuantGemvBindings {
    /// The activations, `[rows, d_in]`.
    pub x: TensorBinding,
    /// The packed weight, `[d_out, d_in]` in values over a buffer of `u32` words.
    pub weights: TensorBinding,
    /// The scale levels, innermost first, each stated in scales whatever element they are
    /// stored at: the block level, then the factor over the whole tensor where the scheme has
    /// one. What a level covers is read off its own shape: `[d_out, d_in / block]` distinguishes
    /// every block, a single element covers the tensor.
    pub scales: Vec<TensorBinding>,
    /// The result, `[d_out, rows]` — the weight's rows are the output's, this orientation
    /// putting them on the buffer's outer dim.
    pub out: TensorBinding,
}

/// `y = (W ⊗ s) · x`, one launch.
#[allow(clippy::result_large_err)]
pub fn launch_ref(
    client: &Client,
    bindings: QuantGemvBindings,
    problem: &QuantGemvProblem,
    strategy: &BlueprintStrategy<(), QuantGemvRoutine>,
    dtypes: QuantGemvElems,
) -> Result<(), MatmulSetupError> {
    let plane_dim = client.properties().hardware.plane_size_max as usize;
    let blueprint = QuantGemvRoutine::blueprint(strategy, problem, plane_dim)?;

    let QuantGemvBindings {
        x,
        weights,
        scales,
        out,
    } = bindings;
    let (factor, block, blocks) = (problem.factor(), problem.block, problem.blocks());
    // The kernel's own statement of the space; every axis static, so the launcher stamps
    // nothing on.
    let plane_size = client.properties().hardware.plane_size_max;
    let launch = {
        let partitioning = blueprint.partitioning(problem);
        let concrete = partitioning.space().clone();
        let (cube_count, cube_dim) = blueprint.grid(problem, plane_size);
        Launcher::new(
            client,
            partitioning,
            &concrete,
            Grid::Stated {
                cube_count,
                cube_dim,
            },
        )?
    };

    // `K` is one physical dim that `(KB, KI)` partition, so each operand spanning both says so;
    // the scales span `KB` alone and address it as it stands.
    let split = || PhysicalAxisMap::disjoint(&[(KB, block), (KI, 1)]);
    let w_op = launch
        .arg(weights)
        .gathered(Projection::new(
            &[M, KB, KI],
            &[PhysicalAxisMap::of(M), split()],
        ))
        .packed(problem.field)
        // The served width, which is a whole word: the buffer binds one word wide.
        .vectorize(factor)
        .build()?;
    let x_op = launch
        .arg(x)
        .gathered(Projection::new(
            &[N, KB, KI],
            &[PhysicalAxisMap::of(N), split()],
        ))
        // One word's worth of activations a step, so both operands serve the same count and the
        // contraction folds a whole line. Leave it scalar and the engine serves one value a
        // step, unpacks the word's other values and discards them.
        .vectorize(factor)
        .build()?;
    // The block level first, the factor over the whole tensor where the scheme has one; each
    // addresses exactly the axes its own shape distinguishes. An extent of one is an axis a level
    // does not vary along, which is what makes it cover a tile of the tiles below it.
    if !(1..=2).contains(&scales.len()) {
        return Err(MatmulSetupError::InvalidConfig(Box::new(format!(
            "QuantGemv: {} scale levels, where a scheme carries a block level and at most one \
             factor over the whole tensor",
            scales.len()
        ))));
    }
    let field_of = |elem: ElemType| match elem {
        ElemType::Float(kind) => Ok(Field::of_float(kind)),
        other => Err(MatmulSetupError::InvalidConfig(Box::new(format!(
            "QuantGemv: a scale is a float, got {other:?}"
        )))),
    };
    // Stated once, by the problem: the plan distributed the blocks in words of this field, and the
    // binding reads them in the same one.
    let block_field = problem.scale_field();
    let tensor_field = field_of(dtypes.tensor_scale)?;
    if scales.len() > 1 && tensor_field.per_word() != 1 {
        return Err(MatmulSetupError::InvalidConfig(Box::new(format!(
            "QuantGemv: a per-tensor scale is one number read as the word it fills; it is \
             stored {} to a word",
            tensor_field.per_word()
        ))));
    }
    let mut levels = Vec::new();
    for (level, binding) in scales.into_iter().enumerate() {
        let field = match level {
            0 => block_field,
            _ => tensor_field,
        };
        let dims: Vec<usize> = binding.shape.iter().copied().collect();
        let full = [(M, problem.d_out), (KB, blocks)];
        if dims.len() != full.len() {
            return Err(MatmulSetupError::InvalidConfig(Box::new(format!(
                "QuantGemv: a scale level has rank {} where its axes are {:?}",
                dims.len(),
                full.map(|(axis, _)| axis)
            ))));
        }
        // An axis at its full extent is one the level distinguishes; an axis of one is one it does
        // not, and that is the whole of "this level covers a tile of the tiles below it".
        let mut maps = Vec::new();
        for (extent, (axis, whole)) in dims.iter().zip(full) {
            match extent {
                e if *e == whole => maps.push(PhysicalAxisMap::of(axis)),
                1 => maps.push(PhysicalAxisMap::broadcast()),
                other => {
                    return Err(MatmulSetupError::InvalidConfig(Box::new(format!(
                        "QuantGemv: a scale level spans {other} of {axis:?}, which is neither its \
                         {whole} tiles nor one covering them all"
                    ))));
                }
            }
        }
        let projection = Projection::new(&[M, KB], &maps);
        // Every scale a word holds, a read: the unit that reads the word owns the blocks of every
        // field in it, which the plan distributed on the problem's own count of them.
        levels.push(
            launch
                .arg(binding)
                .gathered(projection)
                .packed(field)
                .build()?,
        );
    }
    let mut levels = levels.into_iter();
    let block_scale = levels.next().expect("a block level, checked above").arg();
    let global_scale = match levels.next() {
        Some(global) => ComptimeOptionArgs::Some(global.arg()),
        None => ComptimeOptionArgs::None,
    };
    // Each unit holds a partial of its group's cell, so the accumulator stays scalar: the fold
    // requires it.
    let out_op = launch.arg(out).axes(&[M, N]).build()?;

    quant_gemv_kernel::launch(
        client,
        launch.cube_count(),
        launch.cube_dim(),
        x_op.vector_size,
        out_op.vector_size,
        w_op.arg(),
        x_op.arg(),
        block_scale,
        global_scale,
        out_op.arg(),
        launch.partitioning_arg(),
        blueprint,
        *problem,
        dtypes.served,
        dtypes.x,
        ElemType::from_scale_dtype(problem.scales),
        dtypes.out,
    );
    Ok(())
}
