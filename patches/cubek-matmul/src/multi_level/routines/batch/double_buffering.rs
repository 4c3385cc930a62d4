use std::fmt::Display;

use cubecl::{CubeCount, CubeDim, client::Client, ir::AddressType};

use crate::{
    definition::{MatmulElems, MatmulProblem, MatmulSetupError, MatmulVectorSizes},
    multi_level::{
        BatchMatmulRoutine, ExpandInfo, LaunchInfo,
        args::{ConfigRuntimeArg, InputRuntimeArg, MatmulArgs, OutputRuntimeArg, RuntimeConfig},
        batch_validate_blueprint,
        components::{
            batch::{
                BatchMatmulFamily, PartitionedBatchMatmulFamily, RowMajorGlobalPartitionMatmul,
            },
            global::{
                PlaneWriterFamily,
                multi_stage::double_buffering::DoubleBufferingMatmulFamily,
                read::{
                    async_full_cyclic::AsyncFullCyclicLoading,
                    async_full_strided::AsyncFullStridedLoading,
                    async_full_tma::AsyncFullTmaLoading,
                    async_partial_cyclic::AsyncPartialCyclicLoading,
                    async_partial_strided::AsyncPartialStridedLoading,
                    async_partial_tma::AsyncPartialTmaLoading,
                    sync_full_cyclic::SyncFullCyclicLoading,
                    sync_full_tilewise::SyncFullTilewiseLoading,
                    sync_partial_cyclic::SyncPartialCyclicLoading,
                    sync_partial_tilewise::SyncPartialTilewiseLoading,
                },
            },
            stage::{NumStages, PlanePartitioner},
            tile::TileMatmulKind,
        },
        definition::{BatchMatmulBlueprint, CubeMappingLaunch, MultiRowStrategy},
        routines::{
            TilingArgs,
            selector::{PlaneTilingBlueprintOptions, infer_blueprint_plane},
        },
        tile::{ColMajorTilingOrder, RowMajorTilingOrder},
    },
    routine::{BlueprintStrategy, DeviceSettings, Routine},
};

/// Plane accelerated double buffered matmul with cyclic readers
pub struct CyclicDoubleBufferingAlgorithm;

/// Plane accelerated double buffered matmul with cyclic readers
pub struct AsyncCyclicDoubleBufferingAlgorithm;

/// Plane accelerated double buffered matmul with tilewise readers
pub struct TilewiseDoubleBufferingAlgorithm;

/// Plane accelerated double buffered matmul with tilewise reader on Lhs and cyclic on Rhs
pub struct HybridDoubleBufferingAlgorithm;

/// Plane accelerated double buffered matmul with TMA readers
pub struct TmaDoubleBufferingAlgorithm;

/// Plane accelerated double buffered matmul with cyclic readers
pub struct AsyncStridedDoubleBufferingAlgorithm;

#[derive(Debug, Clone, Copy)]
pub struct DoubleBufferingArgs {
    pub tile_matmul: TileMatmulKind,
    pub specialized: bool,
}

impl Default for DoubleBufferingArgs {
    fn default() -> Self {
        Self {
            tile_matmul: TileMatmulKind::Cmma,
            specialized: false,
        }
    }
}

impl TilingArgs for DoubleBufferingArgs {
    fn set_tile_matmul(&mut self, kind: TileMatmulKind) {
        self.tile_matmul = kind;
    }
}

impl Display for DoubleBufferingArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.specialized { "_specialized" } else { "" })
    }
}

macro_rules! double_buffering_impl {
    ($algo:ident, $batch:ty) => {
        impl<RC> Routine<RC> for $algo
        where
            RC: RuntimeConfig,
        {
            type Strategy = DoubleBufferingArgs;
            type Blueprint = BatchMatmulBlueprint;
        }

        impl<RC> BatchMatmulRoutine<RC> for $algo
        where
            RC: RuntimeConfig,
        {
            #[allow(clippy::too_many_arguments, clippy::result_large_err)]
            fn launch<MA: MatmulArgs<Config = RC>>(
                client: &Client,
                cube_dim: CubeDim,
                cube_count: CubeCount,
                address_type: AddressType,
                input: InputRuntimeArg<MA>,
                output: OutputRuntimeArg<MA>,
                config: ConfigRuntimeArg<MA>,
                cube_count_input: CubeMappingLaunch,
                blueprint: Self::Blueprint,
                dtypes: &MatmulElems,
                vector_sizes: &MatmulVectorSizes,
            ) -> Result<(), MatmulSetupError> {
                {
                    unsafe {
                        <$batch>::launch_unchecked::<MA>(
                            client,
                            cube_dim,
                            cube_count,
                            address_type,
                            input,
                            output,
                            config,
                            cube_count_input,
                            blueprint,
                            dtypes,
                            vector_sizes,
                        )?
                    }
                    Ok(())
                }
            }

            #[allow(clippy::result_large_err)]
            fn validate_blueprint(
                client: &Client,
                blueprint: &Self::Blueprint,
                problem: &MatmulProblem,
                dtypes: &MatmulElems,
                vector_sizes: &MatmulVectorSizes,
            ) -> Result<(), MatmulSetupError> {
                batch_validate_blueprint::<$batch, RC>(
                    client,
                    blueprint,
                    problem,
                    dtypes,
                    vector_sizes,
                )
            }

            fn num_stages() -> NumStages {
                <$batch>::num_stages()
            }

            fn expand_blueprint(
                problem: &MatmulProblem,
                device_settings: &DeviceSettings,
                strategy: &BlueprintStrategy<RC, Self>,
            ) -> Result<ExpandInfo<Self::Blueprint>, MatmulSetupError> {
                let mut dtypes = MatmulElems::from_globals(&problem.global_dtypes);

                let tile_matmul = match strategy {
                    BlueprintStrategy::Forced(blueprint) => blueprint.tile_matmul,
                    BlueprintStrategy::Inferred(args) => args.tile_matmul,
                };

                if tile_matmul.can_cast_stage_element() {
                    dtypes.adjust_stage_dtypes();
                }

                let (blueprint, dtypes) = match strategy {
                    BlueprintStrategy::Forced(blueprint) => (blueprint.clone(), dtypes),
                    BlueprintStrategy::Inferred(strategy) => infer_blueprint_plane(
                        tile_matmul,
                        &device_settings.client,
                        problem,
                        device_settings.plane_dim,
                        dtypes,
                        &device_settings.vector_sizes,
                        PlaneTilingBlueprintOptions {
                            specialized: strategy.specialized,
                            multi_row_strategy: MultiRowStrategy::Adaptive {
                                minimum_stage_count: 8,
                            },
                            swizzled: tile_matmul.should_swizzle(&device_settings.client),
                            stage_buffering: <$batch>::num_stages().stage_buffering(),
                            ..Default::default()
                        },
                    )?,
                };
                Ok(ExpandInfo { blueprint, dtypes })
            }

            fn prepare(
                problem: &MatmulProblem,
                device_settings: &DeviceSettings,
                expand_info: ExpandInfo<Self::Blueprint>,
            ) -> Result<LaunchInfo<BatchMatmulBlueprint>, MatmulSetupError> {
                let ExpandInfo { blueprint, dtypes } = expand_info;

                <Self as BatchMatmulRoutine<RC>>::validate_blueprint(
                    &device_settings.client,
                    &blueprint,
                    problem,
                    &dtypes,
                    &device_settings.vector_sizes,
                )?;

                let cubedim_resource =
                    <$batch>::cubedim_resource(&blueprint, &dtypes, &device_settings.vector_sizes)?;

                LaunchInfo::new(
                    blueprint,
                    dtypes,
                    problem,
                    cubedim_resource,
                    device_settings,
                )
            }
        }
    };
}

double_buffering_impl!(
    CyclicDoubleBufferingAlgorithm,
    PartitionedBatchMatmulFamily<
        RC,
        DoubleBufferingMatmulFamily<
            PlanePartitioner,
            RC,
            SyncPartialCyclicLoading<RowMajorTilingOrder>,
            SyncPartialCyclicLoading<RowMajorTilingOrder>,
            SyncFullCyclicLoading<RowMajorTilingOrder>,
            PlaneWriterFamily,
        >,
        RowMajorGlobalPartitionMatmul,
    >
);

double_buffering_impl!(
    AsyncCyclicDoubleBufferingAlgorithm,
    PartitionedBatchMatmulFamily<
        RC,
        DoubleBufferingMatmulFamily<
            PlanePartitioner,
            RC,
            AsyncPartialCyclicLoading<RowMajorTilingOrder>,
            AsyncPartialCyclicLoading<RowMajorTilingOrder>,
            AsyncFullCyclicLoading<RowMajorTilingOrder>,
            PlaneWriterFamily,
        >,
        RowMajorGlobalPartitionMatmul,
    >
);

double_buffering_impl!(
    TilewiseDoubleBufferingAlgorithm,
    PartitionedBatchMatmulFamily<
        RC,
        DoubleBufferingMatmulFamily<
            PlanePartitioner,
            RC,
            SyncPartialTilewiseLoading<RowMajorTilingOrder>,
            SyncPartialTilewiseLoading<ColMajorTilingOrder>,
            SyncFullTilewiseLoading<ColMajorTilingOrder>,
            PlaneWriterFamily,
        >,
        RowMajorGlobalPartitionMatmul,
    >
);

double_buffering_impl!(
    HybridDoubleBufferingAlgorithm,
    PartitionedBatchMatmulFamily<
        RC,
        DoubleBufferingMatmulFamily<
            PlanePartitioner,
            RC,
            SyncPartialTilewiseLoading<RowMajorTilingOrder>,
            SyncPartialCyclicLoading<RowMajorTilingOrder>,
            SyncFullCyclicLoading<RowMajorTilingOrder>,
            PlaneWriterFamily,
        >,
        RowMajorGlobalPartitionMatmul,
    >
);

double_buffering_impl!(
    TmaDoubleBufferingAlgorithm,
    PartitionedBatchMatmulFamily<
        RC,
        DoubleBufferingMatmulFamily<
            PlanePartitioner,
            RC,
            AsyncPartialTmaLoading,
            AsyncPartialTmaLoading,
            AsyncFullTmaLoading,
            PlaneWriterFamily,
        >,
        RowMajorGlobalPartitionMatmul,
    >
);

double_buffering_impl!(
    AsyncStridedDoubleBufferingAlgorithm,
    PartitionedBatchMatmulFamily<
        RC,
        DoubleBufferingMatmulFamily<
            PlanePartitioner,
            RC,
            AsyncPartialStridedLoading,
            AsyncPartialStridedLoading,
            AsyncFullStridedLoading,
            PlaneWriterFamily,
        >,
        RowMajorGlobalPartitionMatmul,
    >
);
