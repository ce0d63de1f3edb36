"""Layer profiles, hardware model and the automatic partitioner (DESIGN.md section 6)."""

from lightning_roundpipe.partition.profile import HardwareModel, LayerProfile
from lightning_roundpipe.partition.types import PartitionPlan

__all__ = ["HardwareModel", "LayerProfile", "PartitionPlan"]
