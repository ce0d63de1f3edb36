"""pytest plugin: Lightning's own tests under `RoundPipeStrategy` on 2 CPU virtual devices.

Loaded with ``-p roundpipe_plugin`` (this folder on ``PYTHONPATH``; ``run.sh`` does both). It changes three
things, before any test module is imported:

- ``Trainer(...)``: where a test leaves the choice to Lightning (``strategy`` ``"auto"``, ``accelerator``
  ``"auto"`` or ``"cpu"``, ``devices`` ``"auto"``, ``1`` or ``"1"``, one node), the Trainer gets
  ``strategy=RoundPipeStrategy(partition="default")``, ``accelerator="cpu"``, ``devices=2``. A test that
  names another strategy, accelerator or device count keeps it.
- ``BoringModel`` (Lightning's demo model, the base of most tests): its ``layer`` is an ``nn.Sequential``
  (what RoundPipe pipelines) of one ``Linear(32, 2)`` (``ROUNDPIPE_LT_LAYERS=1``, the default: the same
  parameters, keys ``layer.0.weight``, ``layer.weight`` readable) or of ``Linear(32, 32), ReLU(),
  Linear(32, 2)`` (``ROUNDPIPE_LT_LAYERS=3``: more than one stage per device). A test's own model with a
  ``layer = nn.Linear(...)`` and nothing else to pipeline gets the same when a RoundPipe Trainer runs it.

``ROUNDPIPE_LT_OFF=1`` turns both off (the same test ids under the default strategy: the oracle).

Every test records how many Trainers the plugin changed (``roundpipe_trainers`` in the junit
properties, with ``--junitxml``); a test with 0 ran under the default strategy only.
"""

from __future__ import annotations

import functools
import os

import pytest
from torch import nn

_LAYERS = int(os.environ.get("ROUNDPIPE_LT_LAYERS", "1"))
_CHANGED = [0]  # Trainers given RoundPipe in the current test


def _auto(value, allowed) -> bool:
    return value in allowed


def _patch_trainer() -> None:
    from lightning.pytorch import Trainer

    import lightning_roundpipe

    original = Trainer.__init__
    if getattr(original, "_roundpipe_harness", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        strategy = kwargs.get("strategy", "auto")
        accelerator = kwargs.get("accelerator", "auto")
        devices = kwargs.get("devices", "auto")
        if (isinstance(strategy, str) and strategy == "auto" and _auto(accelerator, ("auto", "cpu"))
                and _auto(devices, ("auto", 1, "1")) and kwargs.get("num_nodes", 1) == 1 and not args):
            kwargs.update(strategy=lightning_roundpipe.RoundPipeStrategy(partition="default"),
                          accelerator="cpu", devices=2)
            _CHANGED[0] += 1
        original(self, *args, **kwargs)

    __init__._roundpipe_harness = True
    Trainer.__init__ = __init__


class LinearSequence(nn.Sequential):
    """An ``nn.Sequential`` that reads like the ``Linear`` it holds (module level: a model pickled for a
    ``ddp_spawn`` test unpickles in the spawned process)."""

    weight = property(lambda self: self[-1].weight)
    bias = property(lambda self: self[-1].bias)
    in_features = property(lambda self: self[0].in_features)
    out_features = property(lambda self: self[-1].out_features)


def _sequence(linear):
    """``linear`` as an ``nn.Sequential`` (what RoundPipe pipelines): the same ``Linear`` (its parameters, the
    same objects) as the one layer, with its ``weight``, ``bias``, ``in_features`` and ``out_features`` readable
    as before (tests read ``self.layer.weight``); with ``ROUNDPIPE_LT_LAYERS=3`` a ``Linear, ReLU, Linear``
    sequence (new parameters) when ``linear`` is BoringModel's ``Linear(32, 2)``."""
    if _LAYERS == 3 and (linear.in_features, linear.out_features) == (32, 2):
        return LinearSequence(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    return LinearSequence(linear)


def _patch_boring_model() -> None:
    from lightning.pytorch.demos import boring_classes
    from torch import nn

    cls = boring_classes.BoringModel
    original = cls.__init__
    if getattr(original, "_roundpipe_harness", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if type(getattr(self, "layer", None)) is nn.Linear:
            self.layer = _sequence(self.layer)

    __init__._roundpipe_harness = True
    cls.__init__ = __init__


def _patch_run() -> None:
    """A test's own model that sets ``self.layer = nn.Linear(...)`` after ``BoringModel.__init__`` (and has no
    other pipelinable module) gets it as a sequence when a RoundPipe Trainer runs it (before the strategy's
    setup, so ``configure_optimizers`` sees the same parameters)."""
    from lightning.pytorch import Trainer
    from torch import nn

    import lightning_roundpipe
    from lightning_roundpipe.adapters import is_supported

    original = Trainer._run
    if getattr(original, "_roundpipe_harness", False):
        return

    @functools.wraps(original)
    def _run(self, model, *args, **kwargs):
        if (isinstance(self.strategy, lightning_roundpipe.RoundPipeStrategy)
                and type(getattr(model, "layer", None)) is nn.Linear
                and not any(is_supported(m) for n, m in model.named_modules() if n)):
            model.layer = _sequence(model.layer)
        return original(self, model, *args, **kwargs)

    _run._roundpipe_harness = True
    Trainer._run = _run


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("ROUNDPIPE_LT_OFF") == "1":  # the oracle: the same ids under the default strategy
        return
    os.environ.setdefault("LIGHTNING_ROUNDPIPE_CHECK_STREAMS", "1")  # fail where a GPU would (as the project's tests)
    os.environ.setdefault("WANDB_MODE", "disabled")
    _patch_trainer()
    _patch_boring_model()
    _patch_run()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    _CHANGED[0] = 0
    yield
    item.user_properties.append(("roundpipe_trainers", _CHANGED[0]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``ROUNDPIPE_LT_REASONS=FILE``: one line per failed phase, written as it happens (a run cut by its
    timeout keeps them): ``id<TAB>phase<TAB>the error's first line``."""
    path = os.environ.get("ROUNDPIPE_LT_REASONS")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):  # xdist: the controller writes
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    message = (crash.message if crash is not None else str(report.longrepr)).replace("\n", " | ")[:400]
    with open(path, "a") as out:
        out.write(f"{report.nodeid}\t{report.when}\t{message}\n")
