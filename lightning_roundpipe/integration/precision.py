"""`RoundPipePrecision`: precision handling for CPU masters and stateless device workers.

DESIGN.md section 5. The main thread never autocasts (the model runs on the workers, which set
autocast themselves: it is thread-local); the plugin tells the runtime which dtype to upload
parameters in and which autocast dtype to use.

| precision   | CPU master | uploaded compute copy              | grads on CPU |
|-------------|------------|------------------------------------|--------------|
| 32-true     | fp32       | fp32                               | fp32         |
| bf16-mixed  | fp32       | bf16 weights, bf16 autocast        | fp32         |
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import Precision

SUPPORTED = ("32-true", "bf16-mixed")


class RoundPipePrecision(Precision):
    """Precision plugin of :class:`~lightning_roundpipe.RoundPipeStrategy`.

    Args:
        precision: ``"32-true"`` or ``"bf16-mixed"``.

    Raises:
        ValueError: for any other precision.
    """

    def __init__(self, precision: str = "32-true") -> None:
        precision = str(precision)
        aliases = {"32": "32-true", "bf16": "bf16-mixed"}
        precision = aliases.get(precision, precision)
        if precision not in SUPPORTED:
            raise ValueError(
                f"`RoundPipePrecision` does not support `precision={precision!r}` yet. Valid options: {list(SUPPORTED)}."
                " HINT: use `Trainer(precision='bf16-mixed')` for mixed precision with fp32 CPU master weights."
            )
        self.precision = precision

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """Dtype of the parameters uploaded to a device (``None``: as the master, fp32)."""
        return torch.bfloat16 if self.precision == "bf16-mixed" else None

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Dtype of ``torch.autocast`` on the device workers (``None``: no autocast)."""
        return torch.bfloat16 if self.precision == "bf16-mixed" else None

    @classmethod
    def from_lightning(cls, plugin: Precision) -> "RoundPipePrecision":
        """The RoundPipe plugin for the precision Lightning chose from ``Trainer(precision=...)``.

        Raises:
            ValueError: when that precision is not supported.
        """
        if isinstance(plugin, RoundPipePrecision):
            return plugin
        return cls(getattr(plugin, "precision", "32-true"))
