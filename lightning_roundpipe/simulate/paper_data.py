"""The RoundPipe paper's reference figures, shipped with the package (``lightning_roundpipe/simulate/data/``).

Figures from the paper's artifact (arXiv 2604.27085), see ``data/README.md``:

- ``paper_layer_timings_4090.csv``: per-layer forward/backward times on one RTX 4090 (the input of
  ``roundpipe simulate --layer-timings paper``);
- ``paper_simulated_bubbles.csv``: the paper's simulated bubble table (8 GPUs, 16 microbatches);
- ``paper_throughput_8x4090.csv``: measured tokens/s on 8x RTX 4090.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PAPER_DATA_DIR", "PAPER_DATA_FILES", "paper_data_path"]

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
