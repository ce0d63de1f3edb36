"""lightning_roundpipe: RoundPipe (arXiv 2604.27085) pipeline training for PyTorch Lightning.

``import lightning_roundpipe`` registers ``Trainer(strategy="roundpipe")``.
"""

import time as _time

_IMPORT_START_S = _time.perf_counter()
"""``time.perf_counter()`` when Python began importing this package, before torch and Lightning: the
main job (``python -m lightning_roundpipe.train``) counts its printed wall time from here."""

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_roundpipe.integration import (  # noqa: E402
    RoundPipeMetricsCallback,
    RoundPipePrecision,
    RoundPipeStrategy,
)

RoundPipeStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
__all__ = ["RoundPipeMetricsCallback", "RoundPipePrecision", "RoundPipeStrategy", "__version__"]
