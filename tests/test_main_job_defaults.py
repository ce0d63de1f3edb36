"""The main job's run-time defaults (issue 20): the automatic precision and progress lines where stdout
is not a terminal.

Oracles: the precision rule stated here (bf16-mixed where the accelerator computes bf16 natively: a
CPU listing ``avx512_bf16`` or ``amx_bf16``, a GPU of compute capability 8.0 or more; else 32-true),
with the detection mocked both ways; for the progress lines, Lightning's batch counting (a line every
``refresh_rate`` batches and at the last).
"""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest
import torch

from lightning_roundpipe.recipes import precision as precision_module
from lightning_roundpipe.recipes.precision import resolve_precision
from lightning_roundpipe.train import _instantiate_dict, build_trainer
from test_config import _compose

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _x86_cpu(monkeypatch: pytest.MonkeyPatch, **flags: bool) -> None:
    """``torch.cpu.get_capabilities()`` of an x86 CPU with the given bf16 flags (the others off); no CUDA."""
    capabilities = {"architecture": "x86_64", "avx2": True, "avx512_f": True, "avx512_bw": True,
                    **{name: False for name in BF16_FLAGS}, **flags}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for variable in precision_module.ISA_CAP_VARIABLES:  # no oneDNN ISA cap from the caller's environment
        monkeypatch.delenv(variable, raising=False)


def _precision_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Precision:")]


@pytest.mark.parametrize("flags", [{}, {"avx512_bf16": True}, {"amx_bf16": True}, {"avx512_bf16": True, "amx_bf16": True}])
def test_auto_precision_follows_native_bf16(monkeypatch, caplog, tmp_path: Path, flags: dict[str, bool]) -> None:
    """The default `trainer.precision=auto` on a CPU: bf16-mixed where it lists avx512_bf16 or amx_bf16,
    else 32-true; one line names what was detected, the choice and the override, and the config
    (logged as the run's hyperparameters) holds the choice."""
    _x86_cpu(monkeypatch, **flags)
    expected = "bf16-mixed" if any(flags.values()) else "32-true"
    override = "32-true" if expected == "bf16-mixed" else "bf16-mixed"
    cfg = _compose(f"paths.output_dir={tmp_path}")
    assert cfg.trainer.precision == "auto" and cfg.trainer.accelerator == "cpu"
    with caplog.at_level(logging.INFO):
        trainer = build_trainer(cfg, "auto", [], [], devices=1, enable_progress_bar=False)
    assert trainer.precision == expected
    assert cfg.trainer.precision == expected
    (line,) = _precision_lines(caplog)
    assert "\n" not in line and line.startswith(f"Precision: {expected} (trainer.precision=auto;")
    for name in BF16_FLAGS:
        assert f"{name}={flags.get(name, False)}" in line, line
    assert line.endswith(f"Override with trainer.precision={override}."), line


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("asked", ["bf16-mixed", "bf16-true", "32-true"])
def test_precision_set_by_the_user_is_kept(monkeypatch, caplog, tmp_path: Path, native: bool, asked: str) -> None:
    """`trainer.precision=...` on the command line is what runs, native bf16 or not; only bf16 asked for on
    a CPU that emulates it gets a line (that it is emulated), which does not change the choice."""
    _x86_cpu(monkeypatch, amx_bf16=native)
    cfg = _compose(f"trainer.precision={asked}", f"paths.output_dir={tmp_path}")
    with caplog.at_level(logging.INFO):
        trainer = build_trainer(cfg, "auto", [], [], devices=1, enable_progress_bar=False)
    assert trainer.precision == asked and cfg.trainer.precision == asked
    lines = _precision_lines(caplog)
    if asked.startswith("bf16") and not native:
        (line,) = lines
        assert line.startswith(f"Precision: {asked} as set") and "emulated" in line, line
    else:
        assert lines == []
    # a precision passed to build_trainer wins over the config, also over `auto`
    trainer = build_trainer(_compose(f"paths.output_dir={tmp_path}"), "auto", [], [], devices=1,
                            enable_progress_bar=False, precision=asked)
    assert trainer.precision == asked


@pytest.mark.parametrize("flags", ["fpu sse2 avx2 avx512f avx512bw", "fpu avx512f avx512_bf16", "fpu amx_bf16 amx_tile"])
def test_cpu_flags_where_torch_has_no_capabilities(monkeypatch, tmp_path: Path, flags: str) -> None:
    """Without `torch.cpu.get_capabilities()`, the `flags` lines of /proc/cpuinfo decide, by the same rule."""
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for variable in precision_module.ISA_CAP_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("".join(f"processor\t: {i}\nflags\t\t: {flags}\n\n" for i in range(2)))
    monkeypatch.setattr(precision_module, "CPUINFO", cpuinfo)
    expected = "bf16-mixed" if {"avx512_bf16", "amx_bf16"} & set(flags.split()) else "32-true"
    chosen, line = resolve_precision("auto", "cpu")
    assert chosen == expected
    assert str(cpuinfo) in line and "amx_bf16=" in line


@pytest.mark.parametrize("variable", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
@pytest.mark.parametrize("cap,avx512_native,amx_native", [
    ("AVX2", False, False), ("avx2", False, False), ("AVX512_CORE_VNNI", False, False),
    ("AVX512_CORE_BF16", True, False), ("AVX512_CORE_AMX", True, True), ("ALL", True, True)])
def test_onednn_isa_cap_below_bf16_means_emulated(monkeypatch, variable: str, cap: str, avx512_native: bool,
                                                   amx_native: bool) -> None:
    """oneDNN capped below the CPU's bf16 instructions (`ONEDNN_MAX_CPU_ISA=AVX2`, or the old name
    `DNNL_MAX_CPU_ISA`) runs bf16 matmuls emulated (79x slower than fp32 measured, 1 thread, 1024x1024):
    `auto` picks 32-true there and the line names the cap; caps that keep the instructions change nothing.
    Oracle: oneDNN's ISA order (AVX512_CORE_BF16 adds avx512_bf16, AVX512_CORE_AMX adds amx_bf16)."""
    for flags, native in (({"avx512_bf16": True}, avx512_native), ({"amx_bf16": True}, amx_native),
                          ({"avx512_bf16": True, "amx_bf16": True}, avx512_native or amx_native)):
        _x86_cpu(monkeypatch, **flags)
        monkeypatch.setenv(variable, cap)
        chosen, line = resolve_precision("auto", "cpu")
        assert chosen == ("bf16-mixed" if native else "32-true"), (flags, line)
        assert (f"under {variable}={cap.upper()}" in line) == (chosen == "32-true" or len(flags) == 2 and not amx_native)
        # a bf16 precision set by the user is kept, with the emulation named
        asked, line = resolve_precision("bf16-mixed", "cpu")
        assert asked == "bf16-mixed" and (line is not None) == (not native)


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (8, 0), (8, 9), (9, 0)])
def test_cuda_precision_by_compute_capability(monkeypatch, capability: tuple[int, int]) -> None:
    """On CUDA (`trainer.accelerator` cuda, or auto with CUDA present): bf16-mixed from compute capability
    8.0 (Ampere) on, 32-true before (bf16 emulated: V100, T4)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation or capability >= (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    expected = "bf16-mixed" if capability[0] >= 8 else "32-true"
    for accelerator in ("cuda", "gpu", "auto"):
        chosen, line = resolve_precision("auto", accelerator)
        assert chosen == expected
        assert f"compute capability {capability[0]}.{capability[1]}" in line and "Test GPU" in line
    # `trainer.accelerator=cpu` on a CUDA machine: the CPU decides
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"architecture": "x86_64", "avx512_bf16": False,
                                                                  "amx_bf16": False})
    assert resolve_precision("auto", "cpu")[0] == "32-true"


# ----------------------------------------------------------------------------------- progress lines

def _expected_lines(total: int, every: int) -> list[int]:
    return [n for n in range(1, total + 1) if n % every == 0 or n == total]


class _Out(io.StringIO):
    def __init__(self, terminal: bool) -> None:
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


@pytest.mark.parametrize("refresh_rate,log_every_n_steps", [(3, 50), (None, 2)])
def test_progress_lines(caplog, tmp_path: Path, refresh_rate: int | None, log_every_n_steps: int) -> None:
    """`ProgressLines`: a line every `refresh_rate` batches (default: `log_every_n_steps`) and at the last,
    in training (with the progress-bar metrics) and in validation; each says batches done out of the
    total, the percentage and the seconds per batch."""
    import re

    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_roundpipe.recipes.callbacks import ProgressLines

    class Logged(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("train/loss", out["loss"], prog_bar=True)
            return out

    bar = ProgressLines(refresh_rate=refresh_rate)
    trainer = pl.Trainer(max_steps=7, limit_val_batches=5, num_sanity_val_steps=0,
                         log_every_n_steps=log_every_n_steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, callbacks=[bar],
                         default_root_dir=tmp_path)
    assert trainer.progress_bar_callback is bar
    every = refresh_rate or log_every_n_steps
    with caplog.at_level(logging.INFO):
        trainer.fit(Logged())
        trainer.validate(Logged(), verbose=False)
    messages = [r.getMessage() for r in caplog.records]
    train = [m for m in messages if m.startswith("Epoch 0: ")]
    assert [int(re.match(r"Epoch 0: (\d+)/7 \((\d+)%\)", m).group(1)) for m in train] == _expected_lines(7, every)
    assert all(re.search(r", [0-9.]+ s/batch, ", m) and " | train/loss=" in m for m in train), train
    assert train[-1].startswith("Epoch 0: 7/7 (100%)") and "0 s left" in train[-1]
    val = [m for m in messages if m.startswith("Validation: ")]
    assert [int(re.match(r"Validation: (\d+)/5 ", m).group(1)) for m in val] == _expected_lines(5, every)
    with pytest.raises(ValueError, match="refresh_rate"):
        ProgressLines(refresh_rate=0)


@pytest.mark.parametrize("terminal", [True, False])
def test_app_progress_bar_follows_stdout(monkeypatch, tmp_path: Path, terminal: bool) -> None:
    """The app's trainer: a live bar where stdout is a terminal, progress lines where it is a file or a
    pipe (a live bar would print nothing there until it closes); none with the progress bar off or
    with a bar of the user's among the callbacks."""
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE

    from lightning_roundpipe.recipes.callbacks import ProgressLines, StepProgressBar

    monkeypatch.setattr(sys, "stdout", _Out(terminal))
    cfg = _compose(f"paths.output_dir={tmp_path}")
    trainer = build_trainer(cfg, "auto", [], _instantiate_dict(cfg.callbacks), devices=1)
    if terminal:
        assert isinstance(trainer.progress_bar_callback, StepProgressBar if _RICH_AVAILABLE else TQDMProgressBar)
    else:
        assert type(trainer.progress_bar_callback) is ProgressLines
    assert build_trainer(cfg, "auto", [], [], devices=1, enable_progress_bar=False).progress_bar_callback is None
    mine = TQDMProgressBar(refresh_rate=5)
    assert build_trainer(cfg, "auto", [], [mine], devices=1).progress_bar_callback is mine


# ------------------------------------------------------------------ fused AdamW under a mixed precision

@pytest.mark.parametrize("fused", [True, False])
def test_fused_adamw_updates_reach_the_devices_under_bf16_mixed(fused: bool) -> None:
    """The main job's optimizer, `AdamW(fused=True)`, under bf16-mixed: its steps reach the devices'
    bf16 upload copies. `torch._fused_adamw_` updates the fp32 masters in place without bumping
    `Tensor._version`, which was all the weight store looked at: every step after the first computed
    with the initial weights (the main job's loss rose, 4.20 to 5.25 over 40 steps). Oracle: the default
    strategy under bf16-mixed, within the bound of test_precision.py (relative error of the update
    <= 2 x DEPTH x STEPS x u)."""
    import lightning_roundpipe
    from _helpers import MLPModule, VectorData, loader, trainer
    from test_precision import DEPTH, STEPS, flat, relative, unit_roundoff

    class WithAdamW(MLPModule):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05, fused=fused)

    def fit(strategy, devices: int) -> tuple[torch.Tensor, torch.Tensor]:
        module = WithAdamW(scheduler=False)
        before = flat(module.parameters())
        t = trainer(strategy, devices, max_steps=STEPS, precision="bf16-mixed")
        t.fit(module, loader(VectorData(n=7 * STEPS)))
        return before, flat(module.parameters())

    before, ref = fit("auto", 1)
    same, got = fit(lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), 2)
    update = ref - before
    assert torch.equal(same, before) and update.norm() > 0
    assert relative(got - before, update) <= 2 * DEPTH * STEPS * unit_roundoff(torch.bfloat16)


# ------------------------------------------------------------------------- config types (issue 31)

@pytest.mark.parametrize("override,key,expected", [
    ("trainer.max_steps=two", "trainer.max_steps='two'", "`int`"),
    ("trainer.limit_val_batches=all", "trainer.limit_val_batches='all'", "`int | float | None`"),
    ("trainer.enable_progress_bar=3", "trainer.enable_progress_bar=3", "`bool | None`"),
    ("data.batch_size=eight", "data.batch_size='eight'", "`int`"),
])
def test_wrong_config_type_names_its_key(tmp_path: Path, override: str, key: str, expected: str) -> None:
    """A command-line value of the wrong type fails at once with a `TypeError` naming the key, its value and
    the type the target's parameter takes (Lightning's own error, `'<' not supported between instances of
    'str' and 'int'`, named none), before the model is loaded. Oracle: the annotations of
    `lightning.pytorch.Trainer.__init__` and `ShakespeareDataModule.__init__`."""
    from lightning_roundpipe.train import run

    cfg = _compose("model=tiny_lora", override, f"paths.output_dir={tmp_path}")
    with pytest.raises(TypeError, match="HINT") as error:
        run(cfg)
    assert f"`{key}`" in str(error.value) and expected in str(error.value), str(error.value)


@pytest.mark.parametrize("overrides", [
    (), ("experiment=ci",), ("trainer.devices=3", "trainer.precision=bf16-mixed", "trainer.limit_val_batches=0.5"),
    ("trainer.val_check_interval=100", "trainer.deterministic=warn", "trainer.gradient_clip_val=1", "trainer.precision=32"),
    ("+trainer.max_time=00:00:10:00", "data.files=[hamlet_gut.txt,macbeth_gut.txt]", "data.val_blocks=null"),
])
def test_valid_config_types_pass(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    """The default config, the CI preset and valid overrides of each kind of annotation pass the check; each
    is also what Lightning's `Trainer` accepts (oracle: building it)."""
    from lightning_roundpipe.recipes.config_check import check_config_types

    cfg = _compose(*overrides, f"paths.output_dir={tmp_path}")
    check_config_types(cfg)
    build_trainer(cfg, "auto", [], [], devices=1, enable_progress_bar=False)


def test_mask_builder_called_without_deprecated_keyword() -> None:
    """The HF adapter calls transformers' `create_causal_mask` with its current keyword only (`cache`; both it and
    the deprecated `past_key_values` gave a FutureWarning, "Both `past_key_values` and `cache` are set", on
    every run). Oracle: the call under `warnings.simplefilter("error")` and the model's own mask."""
    import warnings

    from transformers import masking_utils

    from _helpers import tiny_hf
    from lightning_roundpipe.adapters.hf_causal_lm import _mask_call

    model = tiny_hf("llama")
    hidden = torch.zeros(2, 8, model.config.hidden_size)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # padding: an explicit mask
    positions = torch.arange(8).unsqueeze(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _mask_call(masking_utils.create_causal_mask, model.config, hidden, mask, positions)
    expected = masking_utils.create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=mask,
                                                cache=None, position_ids=positions)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("given,import_torch_first,expected", [
    (None, False, ("set", "PASSIVE")), ("ACTIVE", False, ("given", "ACTIVE")), (None, True, ("late", None)),
])
def test_app_sets_passive_openmp_before_torch(given: str | None, import_torch_first: bool,
                                              expected: tuple[str, str | None]) -> None:
    """Issue 31: the app sets `OMP_WAIT_POLICY=PASSIVE` when it is imported before torch (libgomp reads the
    variable when torch loads it), keeps a value the user gave, and only suggests it (a line with a HINT)
    where torch came first. Oracle: the environment and `sys.modules` of a fresh interpreter."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    code = ("import sys, os\n" + ("import torch\n" if import_torch_first else "") +
            "import lightning_roundpipe.train as app\n"
            "print(app._OPENMP, os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    state, value, torch_loaded = out.stdout.split()
    assert (state, None if value == "None" else value) == expected
    assert torch_loaded == str(import_torch_first)  # the app itself imports no torch before the setting
    from lightning_roundpipe.train import _OPENMP_LINES

    assert "HINT: `export OMP_WAIT_POLICY=PASSIVE`" in _OPENMP_LINES["late"]


def test_progress_lines_after_a_mid_epoch_resume(caplog, tmp_path: Path) -> None:
    """Resumed mid-epoch (`ckpt_path`), Lightning calls no `on_train_epoch_start`: the lines still say
    batches done out of the epoch's total, with the seconds per batch of the batches this run trained,
    not `3 batches, -0.00 s/batch` (a new user's resumed main job). Oracle: the uninterrupted run's lines."""
    import re

    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_roundpipe.recipes.callbacks import ProgressLines

    class SaveAtStep3(pl.Callback):  # a checkpoint from inside the epoch, as the job's on-exception one
        def on_train_batch_end(self, trainer, *_):
            if trainer.global_step == 3:
                trainer.save_checkpoint(tmp_path / "step3.ckpt")

    def fit(callbacks=(), ckpt_path=None) -> list[str]:
        trainer = pl.Trainer(max_steps=6, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
                             accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_model_summary=False, callbacks=[ProgressLines(refresh_rate=1), *callbacks],
                             default_root_dir=tmp_path)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            trainer.fit(BoringModel(), ckpt_path=ckpt_path)
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Epoch 0: ")]

    def done_of_total(lines: list[str]) -> list[str]:
        assert all(re.search(r"\), [0-9.]+ s/batch, ", m) for m in lines), lines
        return [re.match(r"Epoch 0: (\d+/\d+ \(\d+%\))", m).group(1) for m in lines]

    straight = done_of_total(fit([SaveAtStep3()]))
    resumed = done_of_total(fit(ckpt_path=str(tmp_path / "step3.ckpt")))
    assert resumed == straight[3:] == ["4/6 (67%)", "5/6 (83%)", "6/6 (100%)"], (straight, resumed)
