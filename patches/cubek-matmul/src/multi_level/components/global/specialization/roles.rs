use crate::{
    definition::MatmulSetupError,
    multi_level::components::global::{MaxGlobalReaderPlanes, specialization::config::LoadFlows},
};

// Plane-flow vocabulary lives at the root of `multi_level`; re-export it here so a
// caller reading specialization config finds the roles beside it.
pub use crate::multi_level::{
    PlaneFlowConfig, PlaneFlowCounts, PlaneFlowPartition, PlaneFlowPartitionRule,
};

/// Build a [`PlaneFlowConfig`] from matmul-specific load-flow inputs.
pub fn make_plane_flow_config(
    load_flows: LoadFlows,
    reader_tasks: Option<MaxGlobalReaderPlanes>,
    num_main_flow_planes: u32,
) -> Result<PlaneFlowConfig, MatmulSetupError> {
    let counts = match reader_tasks {
        Some(reader_tasks) => load_flows.to_plane_flow_counts(num_main_flow_planes, reader_tasks),

        None => {
            if load_flows.has_specialization() {
                return Err(MatmulSetupError::InvalidConfig(Box::new(
                    "Error: Load specialization config has specialization but no reader tasks were given."
                        .to_string(),
                )));
            } else {
                PlaneFlowCounts {
                    main_flow: num_main_flow_planes,
                    load_only: 0,
                }
            }
        }
    };

    // TODO make possible to select LoadOnlyLast
    let rule = match counts.load_only {
        0 => PlaneFlowPartitionRule::MainFlowOnly,
        _ => PlaneFlowPartitionRule::LoadOnlyFirst {
            load_only: counts.load_only,
        },
    };

    Ok(PlaneFlowConfig {
        counts,
        partition_rule: rule,
    })
}
