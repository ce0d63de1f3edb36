"""lightning_roundpipe: RoundPipe (arXiv 2604.27085) pipeline training for PyTorch Lightning.

``import lightning_roundpipe`` registers ``Trainer(strategy="roundpipe")``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_roundpipe.integration import RoundPipeMetricsCallback, RoundPipePrecision, RoundPipeStrategy

RoundPipeStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
__all__ = ["RoundPipeMetricsCallback", "RoundPipePrecision", "RoundPipeStrategy", "__version__"]
