"""Per-device timelines -> bubble %, transfer bytes and GiB/s; logging helpers."""

from lightning_roundpipe.metrics.step import step_metrics
from lightning_roundpipe.metrics.timeline import Interval, Timeline

__all__ = ["Interval", "Timeline", "step_metrics"]
