"""CPU virtual devices that outnumber the usable cores (each device's compute thread needs one) are
said to the user. Oracle: the affinity mask, set by the test."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_roundpipe.runtime import backends


def _made(monkeypatch, cores: int, num_devices: int) -> list[warnings.WarningMessage]:
    monkeypatch.setattr(backends.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = backends.make_backends([torch.device("cpu")] * num_devices, check_streams=False)
    assert len(made) == num_devices
    for backend in made:
        backend.close()
    return [w for w in caught if "usable core" in str(w.message)]


@pytest.mark.parametrize("cores, num_devices, warned", [(1, 2, True), (2, 3, True), (2, 2, False), (4, 1, False)])
def test_more_cpu_devices_than_cores_warns(monkeypatch, cores, num_devices, warned):
    caught = _made(monkeypatch, cores, num_devices)
    assert bool(caught) is warned
    if warned:
        message = str(caught[0].message)
        assert f"{num_devices} CPU virtual devices on {cores} usable core(s)" in message
        assert f"devices={cores}" in message
