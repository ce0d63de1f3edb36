"""Layering and start-up (DESIGN.md section 3): the pure packages load without Lightning, the strategy
is registered with Lightning in either import order, and the `roundpipe` command answers `--help`
and argument errors without importing torch or Lightning. Each check runs in a fresh interpreter
(`sys.modules` of this pytest process already holds everything)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run_python(code: str, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout_s)


def loaded_after(statement: str) -> dict[str, bool]:
    """Which of lightning, pytorch_lightning, torch, transformers are in `sys.modules` after `statement`."""
    out = run_python(f"""
        import json, sys
        {statement}
        print(json.dumps({{m: m in sys.modules for m in ("lightning", "pytorch_lightning", "torch", "transformers")}}))
    """)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("package", ["schedule", "partition", "simulate"])
def test_pure_packages_import_neither_lightning_nor_torch(package: str) -> None:
    loaded = loaded_after(f"import lightning_roundpipe.{package}")
    assert loaded == {"lightning": False, "pytorch_lightning": False, "torch": False, "transformers": False}


@pytest.mark.parametrize("order", ["roundpipe_first", "lightning_first"])
def test_trainer_strategy_string_in_either_import_order(order: str) -> None:
    """`import lightning_roundpipe` itself loads neither torch nor Lightning; `Trainer(strategy="roundpipe")`
    works whichever is imported first; the classes load on first access."""
    imports = {
        "roundpipe_first": textwrap.dedent("""
            import sys
            import lightning_roundpipe
            assert "lightning" not in sys.modules and "torch" not in sys.modules
            assert "RoundPipeStrategy" in dir(lightning_roundpipe) and "RoundPipeStrategy" in lightning_roundpipe.__all__
            try:
                lightning_roundpipe.NoSuchName
            except AttributeError as err:
                assert "NoSuchName" in str(err)
            else:
                raise AssertionError("no AttributeError")
            assert lightning_roundpipe.RoundPipeStrategy.__module__ == "lightning_roundpipe.integration.strategy"
            import lightning as L
        """),
        "lightning_first": "import lightning as L\nimport lightning_roundpipe",
    }[order]
    out = run_python(imports + """
from lightning.pytorch.strategies import StrategyRegistry
from lightning_roundpipe.integration.strategy import RoundPipeStrategy
assert StrategyRegistry.get("roundpipe").__class__ is RoundPipeStrategy
trainer = L.Trainer(strategy="roundpipe", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                    enable_model_summary=False)
assert type(trainer.strategy) is RoundPipeStrategy, trainer.strategy
import sys
assert not any(type(f).__name__ == "_RegisterOnImport" for f in sys.meta_path), "the import hook stays installed"
print("ok")
""")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["simulate", "--devices", "x"], ["nosuchcommand"]])
def test_cli_help_and_argument_errors_import_no_lightning(argv: list[str]) -> None:
    """`roundpipe --help` and argument errors return without importing torch or Lightning (the reason
    they take well under 2 s; times in `python benchmarks/startup.py`)."""
    out = run_python("""
        import json, sys
        from lightning_roundpipe.cli import main
        try:
            code = main(sys.argv[1:])
        except SystemExit as exit_:
            code = exit_.code
        print(json.dumps({"code": code, "lightning": "lightning" in sys.modules, "torch": "torch" in sys.modules}))
    """, *argv)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["code"] == (0 if "--help" in argv else 2)
    assert not result["lightning"] and not result["torch"], result
