"""Resuming the main job (issue 31): the `ckpt_path` key of ``conf/train.yaml`` in Hydra's grammar, the
``last`` value, and the exit status after a SIGTERM. In process, seconds; the job itself interrupted and
resumed is in ``tests/test_main_job.py``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

from lightning_roundpipe.train import CONF_DIR, _sigterm_exit, resolve_ckpt_path

CKPT = "/runs/train/2026-05-01_10-00-00/checkpoints/interrupted-step=5.ckpt"


def _ckpt_path(*overrides: str) -> object:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides)).ckpt_path


def test_ckpt_path_defaults_to_none() -> None:
    assert _ckpt_path() is None


@pytest.mark.parametrize("override", [
    f'ckpt_path="{CKPT}"',  # the documented form: shell 'ckpt_path="..."'
    f"ckpt_path='{CKPT}'",
    "ckpt_path=" + CKPT.replace("=", "\\="),  # Hydra's escape of `=` in an unquoted value
    f'+ckpt_path="{CKPT}"',  # the issue's `+` form: sets the key (it was a new key that run() never read)
    f'++ckpt_path="{CKPT}"',
])
def test_ckpt_path_with_equals_sign_reaches_the_config(override: str) -> None:
    """The job's own checkpoint names contain `=` (`interrupted-step=5.ckpt`); quoted or escaped they parse."""
    assert _ckpt_path(override) == CKPT


def test_unquoted_equals_sign_is_hydras_grammar_error() -> None:
    """Hydra's grammar: an unquoted `=` in a value is an error (the documented command quotes it)."""
    with pytest.raises(HydraException, match="mismatched input '='"):
        _ckpt_path(f"ckpt_path={CKPT}")


def test_ckpt_path_last_needs_no_quoting() -> None:
    assert _ckpt_path("ckpt_path=last") == "last"


class _Trainer:
    """What :func:`resolve_ckpt_path` reads of a ``Trainer``: ``callbacks`` and ``default_root_dir``."""

    def __init__(self, root: Path, callbacks: list) -> None:
        self.default_root_dir = str(root)
        self.callbacks = callbacks


def test_resolve_last_picks_the_newest_checkpoint_of_the_run_folder(tmp_path: Path) -> None:
    """``last``: the newest ``*.ckpt`` (modification time, as Lightning's ``"last"``) of the
    ``ModelCheckpoint`` folders and ``<default_root_dir>/checkpoints``, whatever its name."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    folder = tmp_path / "checkpoints"
    other = tmp_path / "elsewhere"
    folder.mkdir()
    other.mkdir()
    trainer = _Trainer(tmp_path, [ModelCheckpoint(dirpath=other)])
    files = [folder / "interrupted-step=2.ckpt", other / "interrupted-step=4.ckpt", folder / "last.ckpt"]
    now = time.time()
    for age, path in zip((30, 10, 20), files):  # step 4's is the newest
        path.write_bytes(b"")
        os.utime(path, (now - age, now - age))
    (folder / "notes.txt").write_text("not a checkpoint")
    assert resolve_ckpt_path("last", trainer) == str(files[1].resolve())
    os.utime(files[2], (now, now))
    assert resolve_ckpt_path("last", trainer) == str(files[2].resolve())


def test_resolve_last_without_checkpoint_warns_and_trains_from_scratch(tmp_path: Path) -> None:
    """As Lightning's ``ckpt_path="last"``: nothing to resume is a warning, not an error (a command that
    resumes when there is something to resume), with a HINT."""
    with pytest.warns(UserWarning, match=r"`ckpt_path=last`: no checkpoint .*HINT: "):
        assert resolve_ckpt_path("last", _Trainer(tmp_path, [])) is None


def test_resolve_other_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path is made absolute against the job's working directory (outside a Hydra run, as here: the
    current one; in a run, Hydra's original one); Lightning's own words pass through."""
    from hydra.core.hydra_config import HydraConfig

    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # another test may have set one
    monkeypatch.chdir(tmp_path)
    trainer = _Trainer(tmp_path, [])
    assert resolve_ckpt_path(None, trainer) is None
    assert resolve_ckpt_path("runs/interrupted-step=5.ckpt", trainer) == str(tmp_path / "runs" / "interrupted-step=5.ckpt")
    assert resolve_ckpt_path(CKPT, trainer) == CKPT
    assert resolve_ckpt_path("best", trainer) == "best" and resolve_ckpt_path("hpc", trainer) == "hpc"


def test_sigterm_exit_status() -> None:
    """Lightning 2.6 raises ``SIGTERMException()`` (code None: Python exits 0); the job exits 128 + SIGTERM,
    the status a shell shows for a process SIGTERM killed, and keeps a code Lightning sets itself."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    assert 128 + signal.SIGTERM == 143
    assert _sigterm_exit(SIGTERMException()) == 143
    exc = SIGTERMException()
    exc.code = 143  # Lightning-AI/pytorch-lightning#21623
    assert _sigterm_exit(exc) == 143
    exc.code = 7
    assert _sigterm_exit(exc) == 7


def test_a_ckpt_path_that_is_no_checkpoint_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    """`check_ckpt_file` runs beside the config's type check, before the model loads and the first
    validation (a new user waited for both before `FileNotFoundError` / `UnpicklingError: Memo value not
    found`). Oracle: a file `torch.save` wrote passes, as do the values Lightning or `last` resolve."""
    import torch

    from lightning_roundpipe.train import check_ckpt_file

    with pytest.raises(FileNotFoundError, match=r"`ckpt_path`: no such file.*HINT"):
        check_ckpt_file(str(tmp_path / "missing.ckpt"))
    (tmp_path / "notes.ckpt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"is not a checkpoint \(not a torch.save archive\).*HINT"):
        check_ckpt_file(str(tmp_path / "notes.ckpt"))
    with pytest.raises(ValueError, match=r"is not a checkpoint \(a folder\)"):
        check_ckpt_file(str(tmp_path))
    torch.save({"global_step": 2}, tmp_path / "interrupted-step=2.ckpt")
    for value in (str(tmp_path / "interrupted-step=2.ckpt"), None, "last", "best", "hpc"):
        check_ckpt_file(value)


def test_the_wall_time_line_counts_the_steps_this_run_trained() -> None:
    """A resumed fit trained `global_step - resumed step` steps (a new user's resumed run said `5 steps` for 3)."""
    from lightning_roundpipe.train import _steps_run

    assert _steps_run({}, 40) == "40 steps"
    assert _steps_run({"step": 0}, 40) == "40 steps"
    assert _steps_run({"step": 2}, 5) == "3 steps (from step 2 to 5)"
