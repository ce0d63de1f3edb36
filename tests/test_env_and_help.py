"""Bad values of the checking mode's environment variables are refused once, on the thread that makes
the devices (not once per stream worker behind a "stream worker stopped" error), and every `roundpipe`
subcommand prints its help (argparse formats help strings with `%`: a bare `5 %` crashed `max-seq --help`)."""

import subprocess
import sys

import pytest
import torch

from lightning_roundpipe.runtime.backends import make_backends
from lightning_roundpipe.runtime.backends.budget import MEASURE_ENV, measuring_default
from lightning_roundpipe.runtime.execution.jitter import JITTER_ENV


@pytest.mark.parametrize("value", ["abc", "1.5", " "])
def test_a_bad_jitter_seed_is_refused_when_the_devices_are_made(monkeypatch, value):
    monkeypatch.setenv(JITTER_ENV, value)
    if not value.strip():  # blank: jitter off, nothing to refuse
        backends = make_backends([torch.device("cpu")] * 2)
        for backend in backends:
            backend.close()
        return
    with pytest.raises(ValueError, match=f"`{JITTER_ENV}={value}` is not an int.*HINT"):
        make_backends([torch.device("cpu")] * 2)


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("true", True), ("TRUE", True), ("0", False),
                                                 ("false", False), ("", False)])
def test_measure_device_memory_variable_takes_the_checking_modes_values(monkeypatch, value, expected):
    monkeypatch.setenv(MEASURE_ENV, value)
    assert measuring_default() is expected


@pytest.mark.parametrize("value", ["yes", "off", "2"])
def test_measure_device_memory_variable_refuses_other_values_when_the_devices_are_made(monkeypatch, value):
    monkeypatch.setenv(MEASURE_ENV, value)
    with pytest.raises(ValueError, match=f"`{MEASURE_ENV}={value}` is not understood; valid values: 1, true, 0, false"):
        make_backends([torch.device("cpu")] * 2)


@pytest.mark.parametrize("command", ["plan", "simulate", "max-seq"])
def test_every_subcommand_prints_its_help(command):
    result = subprocess.run([sys.executable, "-m", "lightning_roundpipe.cli", command, "--help"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and "Traceback" not in result.stderr
