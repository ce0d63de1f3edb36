"""Start-up times of the `roundpipe` command and of the package imports (a benchmark, not a test).

    python benchmarks/startup.py [--repeats 5]

Each command runs in a fresh interpreter (``sys.executable``) ``--repeats`` times; the table gives the
median and the slowest wall time in seconds, process start included. The target (issue 8) is under
2 s for ``roundpipe --help`` and argument errors, which import neither torch nor Lightning; the
rows that import Lightning show what they would cost otherwise. Times depend on the disk cache and
on other load: run it twice and read the second.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES: list[tuple[str, list[str], int]] = [
    ("roundpipe --help", ["-m", "lightning_roundpipe.cli", "--help"], 0),
    ("roundpipe plan --help", ["-m", "lightning_roundpipe.cli", "plan", "--help"], 0),
    ("roundpipe plan --devices x (argument error)", ["-m", "lightning_roundpipe.cli", "plan", "--devices", "x"], 2),
    ("roundpipe nosuchcommand (argument error)", ["-m", "lightning_roundpipe.cli", "nosuchcommand"], 2),
    ("import lightning_roundpipe.schedule", ["-c", "import lightning_roundpipe.schedule"], 0),
    ("import lightning_roundpipe", ["-c", "import lightning_roundpipe"], 0),
    ("roundpipe train --help (Hydra)", ["-m", "lightning_roundpipe.cli", "train", "--help"], 0),
    ("import lightning_roundpipe, lightning; RoundPipeStrategy",
     ["-c", "import lightning_roundpipe, lightning; lightning_roundpipe.RoundPipeStrategy"], 0),
    ("python -c pass (interpreter alone)", ["-c", "pass"], 0),
]


def time_command(args: list[str], expected_code: int, repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` runs of ``python *args``.

    Raises:
        RuntimeError: if a run exits with another code than ``expected_code``.
    """
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True)
        times.append(time.perf_counter() - t)
        if proc.returncode != expected_code:
            raise RuntimeError(f"`python {' '.join(args)}` exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per command (default 5)")
    args = parser.parse_args(argv)
    width = max(len(name) for name, _, _ in CASES)
    print(f"{'command':<{width}}  median (s)  max (s)")
    for name, cmd, code in CASES:
        times = time_command(cmd, code, args.repeats)
        print(f"{name:<{width}}  {statistics.median(times):10.2f}  {max(times):7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
