"""The wheel ships the Hydra configs: `conf/` works from an installed wheel, not only from the repository."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "outputs", "multirun", "wandb", "*.egg-info",
                                "__pycache__", ".pytest_cache", "lightning_logs")


def _can_build_here() -> bool:
    """Whether this environment has the build backend pyproject.toml asks for (setuptools >= 68, and
    `wheel` for setuptools < 70.1, whose bdist_wheel is built in), so pip need not fetch it."""
    try:
        major, minor = (int(x) for x in importlib.metadata.version("setuptools").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (70, 1) or ((major, minor) >= (68, 0) and importlib.util.find_spec("wheel") is not None)


def test_wheel_ships_conf_and_the_app_composes_from_it(tmp_path: Path) -> None:
    # build from a copy: setuptools reuses ./build, which could hold files deleted since
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    isolation = ["--no-build-isolation"] if _can_build_here() else []  # else pip fetches the build backend
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", *isolation, "-w", str(tmp_path / "dist"),
                          "-q"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("lightning_roundpipe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    conf_files = sorted(p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml"))
    assert conf_files and "train.yaml" in conf_files
    missing = [f for f in conf_files if f"lightning_roundpipe/conf/{f}" not in names]
    assert not missing, f"not in the wheel: {missing}"
    data = sorted(p.name for p in (ROOT / "lightning_roundpipe" / "simulate" / "data").iterdir() if p.suffix in (".csv", ".md"))
    assert data and all(f"lightning_roundpipe/simulate/data/{name}" in names for name in data), data

    # install it alone (no source tree on the path, another working directory) and run the app's `--cfg job`
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                          str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(site), "WANDB_MODE": "disabled"}
    code = ("import sys, lightning_roundpipe.train as t; print(t.CONF_DIR); sys.argv = ['train', '--cfg', 'job',"
            " 'trainer.max_steps=5', 'model=tiny_lora']; t.main()")
    work = tmp_path / "elsewhere"
    work.mkdir()
    out = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    conf_dir, _, config = out.stdout.partition("\n")
    assert Path(conf_dir) == site / "lightning_roundpipe" / "conf"
    assert "max_steps: 5" in config and "lightning_roundpipe.recipes.smollm2.tiny_smollm2" in config
