"""The RoundPipe paper's reference figures, shipped with the package (``lightning_roundpipe/simulate/data/``).

Figures from the paper's artifact (arXiv 2604.27085), see ``data/README.md``:

- ``paper_layer_timings_4090.csv``: per-layer forward/backward times on one RTX 4090 (the input of
  ``roundpipe simulate --layer-timings paper``);
- ``paper_simulated_bubbles.csv``: the paper's simulated bubble table (8 GPUs, 16 microbatches);
- ``paper_throughput_8x4090.csv``: measured tokens/s on 8x RTX 4090.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PAPER_DATA_DIR", "PAPER_DATA_FILES", "paper_data_path", "paper_reference"]

#: Folder of the packaged reference files.
PAPER_DATA_DIR: Path = Path(__file__).resolve().parent / "data"
#: The packaged reference files.
PAPER_DATA_FILES: tuple[str, ...] = (
    "paper_layer_timings_4090.csv",
    "paper_simulated_bubbles.csv",
    "paper_throughput_8x4090.csv",
    "README.md",
)


def paper_data_path(name: str = "paper_layer_timings_4090.csv") -> Path:
    """Path of one packaged reference file.

    Args:
        name: a file of :data:`PAPER_DATA_FILES`; the ``paper_`` prefix and the ``.csv`` suffix may be
            left out (``"layer_timings_4090"``, ``"simulated_bubbles"``, ``"throughput_8x4090"``).

    Raises:
        ValueError: ``name`` is not one of the packaged files (the valid names listed).
        FileNotFoundError: the file is missing from the installation (a broken install).
    """
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a str, got {type(name).__name__}.")
    candidates = [name, f"{name}.csv", f"paper_{name}", f"paper_{name}.csv"]
    match = next((c for c in candidates if c in PAPER_DATA_FILES), None)
    if match is None:
        raise ValueError(
            f"Unknown paper data file {name!r}; valid names: {list(PAPER_DATA_FILES)}."
            " HINT: the `paper_` prefix and the `.csv` suffix may be left out, e.g. 'layer_timings_4090'."
        )
    path = PAPER_DATA_DIR / match
    if not path.is_file():
        raise FileNotFoundError(
            f"The packaged paper data file {path} is missing. HINT: reinstall `lightning_roundpipe`"
            " (`pip install -e .`); the files are package data of `lightning_roundpipe.simulate`."
        )
    return path


def _csv_rows(name: str) -> list[list[str]]:
    text = paper_data_path(name).read_text(encoding="utf-8")
    return [[cell.strip() for cell in line.split(",")] for line in text.splitlines() if line.strip() and not line.startswith("#")]


def paper_reference(model: str) -> dict[str, float]:
    """The paper's figures for one of its models (8x RTX 4090, 16 microbatches of 4 x 2048 tokens).

    Args:
        model: the paper's column name (``"Qwen3-1.7B"``, ``"Llama3.1-8B"``, ``"GPT-OSS-20B"``,
            ``"Qwen3-32B"``, ``"Qwen3-235B-A22B-LoRA"``); case is ignored.

    Returns:
        What is known of ``one_iteration_idle_pct`` and ``steady_idle_pct`` (the paper's simulated
        idle of RoundPipe, percent) and ``async_tokens_per_s`` / ``sync_tokens_per_s`` (its measured
        RoundPipe and RoundPipe-sync-optimizer throughput); empty for a model the paper has not.
    """
    out: dict[str, float] = {}
    wanted = {("paper_simulated_bubbles.csv", "roundpipe_one_iteration"): "one_iteration_idle_pct",
              ("paper_simulated_bubbles.csv", "roundpipe_steady"): "steady_idle_pct",
              ("paper_throughput_8x4090.csv", "roundpipe"): "async_tokens_per_s",
              ("paper_throughput_8x4090.csv", "roundpipe_sync_optimizer"): "sync_tokens_per_s"}
    for (name, row_name), key in wanted.items():
        header, *rows = _csv_rows(name)
        columns = [c.lower() for c in header]
        if model.lower() not in columns:
            continue
        column = columns.index(model.lower())
        for row in rows:
            if row[0] == row_name and column < len(row) and row[column]:
                out[key] = float(row[column])
    return out
