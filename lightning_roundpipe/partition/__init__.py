"""Layer profiles, hardware model and the automatic partitioner (DESIGN.md section 6).

Pure: no Lightning, no devices (the cost model may build a model on torch's meta device).
"""

from lightning_roundpipe.partition.candidates import (
    candidate_partitions,
    filling_stage_counts,
    partition_with_stage_count,
    stage_count,
)
from lightning_roundpipe.partition.costmodel import (
    CostModel,
    LayerCost,
    LoRASpec,
    ModelledProfiles,
    ModelShape,
    meta_param_counts,
    model_profiles,
)
from lightning_roundpipe.partition.partitioner import (
    METHODS,
    StageSummary,
    auto_partition,
    describe_stages,
    min_stage_memory_bytes,
    plan_objective_s,
    schedule_ranges,
    stage_cost_s,
    stage_memory,
)
from lightning_roundpipe.partition.presets import preset_config, preset_hf_config, preset_names
from lightning_roundpipe.partition.profile import (
    DEFAULT_HOST_OPTIMIZER_BYTES_PER_S,
    HardwareModel,
    LayerProfile,
    SharedWeight,
    optimizer_step_bytes,
)
from lightning_roundpipe.partition.seqlen import peak_device_memory_bytes, planned_max_seq_len
from lightning_roundpipe.partition.types import PartitionPlan

__all__ = [
    "DEFAULT_HOST_OPTIMIZER_BYTES_PER_S", "HardwareModel", "LayerProfile", "PartitionPlan", "SharedWeight",
    "optimizer_step_bytes",
    "METHODS", "StageSummary", "auto_partition", "describe_stages", "min_stage_memory_bytes", "plan_objective_s",
    "candidate_partitions", "filling_stage_counts", "partition_with_stage_count", "stage_count", "schedule_ranges",
    "stage_cost_s", "stage_memory",
    "CostModel", "LayerCost", "LoRASpec", "ModelledProfiles", "ModelShape", "meta_param_counts", "model_profiles",
    "preset_config", "preset_hf_config", "preset_names", "peak_device_memory_bytes", "planned_max_seq_len",
]
