"""The Lightning layer: strategy, precision plugin, callbacks (thin: Lightning hooks only)."""

from lightning_roundpipe.integration.data_parallel import DataParallel
from lightning_roundpipe.integration.callbacks import RoundPipeMetricsCallback
from lightning_roundpipe.integration.precision import RoundPipePrecision
from lightning_roundpipe.integration.strategy import RoundPipeStrategy

__all__ = ["DataParallel", "RoundPipeMetricsCallback", "RoundPipePrecision", "RoundPipeStrategy"]
