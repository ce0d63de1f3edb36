"""The Lightning layer: strategy, precision plugin, callbacks (thin: Lightning hooks only)."""

# order matters: the first module imports Lightning, whose import registers the strategy (``_register``),
# which imports ``strategy`` and with it ``data_parallel``; ``data_parallel`` must not be half-imported then
from lightning_roundpipe.integration.callbacks import RoundPipeMetricsCallback
from lightning_roundpipe.integration.precision import RoundPipePrecision
from lightning_roundpipe.integration.strategy import RoundPipeStrategy
from lightning_roundpipe.integration.data_parallel import DataParallel  # noqa: I001

__all__ = ["DataParallel", "RoundPipeMetricsCallback", "RoundPipePrecision", "RoundPipeStrategy"]
