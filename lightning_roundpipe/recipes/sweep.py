"""The Hydra callback that ends every multirun of the main job with a table of its jobs.

Each job of ``python -m lightning_roundpipe.train -m ...`` (or ``hparams_search=...``) writes
``metrics.json`` into its output folder (``lightning_roundpipe.train.main``); at the end of the sweep
:class:`SweepSummary` reads them back, prints one row per job with the overrides that differ between
jobs, the final validation loss, and the last training step's tokens/s and mean bubble, and writes the
same table to ``<sweep dir>/summary.md``. It works with any launcher (it only reads files).

Imports neither torch nor Lightning (Hydra instantiates its callbacks before every run).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

METRICS_FILE = "metrics.json"
"""Name of the file each job writes into its output folder (a JSON object; see ``train.main``)."""

COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("val_loss_after", "val loss", "{:.4f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("bubble_pct", "bubble (%)", "{:.1f}"),
    ("step_s", "step (s)", "{:.3f}"),
    ("fit_s", "fit (s)", "{:.1f}"),
)
"""(metrics key, column title, format) of the table, after the job number and the swept overrides."""


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key, value


def read_jobs(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Every job's ``metrics.json`` under ``sweep_dir``, sorted by job number (jobs that failed have none)."""
    jobs = []
    for path in Path(sweep_dir).glob(f"**/{METRICS_FILE}"):
        try:
            jobs.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(jobs, key=lambda job: (job.get("job", math.inf), str(job.get("overrides"))))


def format_table(jobs: list[dict[str, Any]]) -> str:
    """A Markdown table: job number, the overrides whose values differ between jobs, then :data:`COLUMNS`.

    A value a job did not record (e.g. the bubble of ``strategy=auto``) shows as ``-``.
    """
    parsed = [dict(_split(o) for o in job.get("overrides", [])) for job in jobs]
    keys = sorted({k for p in parsed for k in p})
    swept = [k for k in keys if len(jobs) == 1 or len({p.get(k) for p in parsed}) > 1]
    header = ["job", *swept, *(title for _, title, _ in COLUMNS)]
    rows = []
    for job, overrides in zip(jobs, parsed):
        cells = [str(job.get("job", "?")), *(overrides.get(k, "") for k in swept)]
        for key, _, fmt in COLUMNS:
            value = job.get(key)
            cells.append(fmt.format(value) if isinstance(value, (int, float)) and math.isfinite(value) else "-")
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows)])


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks`` in ``conf/hydra/default.yaml``): the table of the sweep's jobs.

    Args:
        filename: written into the sweep folder (``hydra.sweep.dir``); ``None``: print only.
    """

    def __init__(self, filename: str | None = "summary.md") -> None:
        self.filename = filename
        self.table: str | None = None

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        jobs = read_jobs(sweep_dir)
        if not jobs:
            print(f"Sweep summary: no job wrote {METRICS_FILE} under {sweep_dir}.", flush=True)
            return
        self.table = format_table(jobs)
        print(f"Sweep summary ({len(jobs)} jobs; tokens/s, bubble and step of each job's last training step):",
              flush=True)
        print(self.table, flush=True)
        if self.filename:
            (sweep_dir / self.filename).write_text(self.table + "\n")
