"""The `roundpipe` command: `roundpipe plan`, `roundpipe simulate`, `roundpipe max-seq`, `roundpipe train` (Hydra)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of `roundpipe` / `python -m lightning_roundpipe.cli`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":
        from lightning_roundpipe.train import main as train_main

        sys.argv = [sys.argv[0]] + argv[1:]
        train_main()
        return 0
    parser = argparse.ArgumentParser(prog="roundpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,simulate,max-seq,train}")
    sub.add_parser("train", help="fine-tune with the Hydra config in conf/ (takes Hydra overrides)")
    try:
        from lightning_roundpipe.cli import plan_cmd
        plan_cmd.add_parser(sub)
    except ImportError:
        pass
    try:
        from lightning_roundpipe.cli import simulate_cmd
        simulate_cmd.add_parser(sub)
    except ImportError:
        pass
    try:
        from lightning_roundpipe.cli import max_seq_cmd
        max_seq_cmd.add_parser(sub)
    except ImportError:
        pass
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
