"""The main job's automatic precision (``trainer.precision=auto``, the default of ``conf/trainer``).

bf16-mixed where the hardware computes bf16 natively: a CUDA GPU of compute capability 8.0 or more
(``torch.cuda.is_bf16_supported(including_emulation=False)``), or a CPU with bf16 instructions
(``avx512_bf16`` or ``amx_bf16`` on x86, ``bf16``/``sve_bf16`` on ARM, as
``torch.cpu.get_capabilities()`` reports them; ``/proc/cpuinfo`` flags where torch lacks that
function). Elsewhere bf16 is emulated through fp32 and several times slower than fp32 itself, so the
job runs 32-true. :func:`resolve_precision` returns the choice and the one line that states what was
detected, what was chosen and how to override it.
"""

from __future__ import annotations

from pathlib import Path

AUTO = "auto"
"""The ``trainer.precision`` value that asks for the automatic choice."""

X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 CPU features that compute bf16 natively (AVX512-BF16 dot products, AMX-BF16 tiles)."""

ARM_BF16_FLAGS = ("bf16", "sve_bf16")
"""ARM64 CPU features that compute bf16 natively (FEAT_BF16, SVE-BF16)."""

CPUINFO = Path("/proc/cpuinfo")
"""Where the CPU flags are read when torch has no ``torch.cpu.get_capabilities()``."""


def _cpu_flags() -> tuple[dict[str, bool], str]:
    """The bf16 features of this CPU and where they were read: ``torch.cpu.get_capabilities()``,
    else the ``flags``/``Features`` lines of ``/proc/cpuinfo`` (empty when neither is available)."""
    import torch

    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is not None:
        capabilities = get_capabilities()
        return {name: bool(capabilities.get(name, False)) for name in (*X86_BF16_FLAGS, *ARM_BF16_FLAGS)
                if name in capabilities}, "torch.cpu.get_capabilities()"
    try:
        text = CPUINFO.read_text()
    except OSError:
        return {}, "no CPU feature source"
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    names = (*X86_BF16_FLAGS, "bf16", "svebf16") if "Features" in text else X86_BF16_FLAGS  # ARM64 lists `Features`
    return {name: name in flags for name in names}, str(CPUINFO)


def native_bf16(accelerator: str) -> tuple[bool, str]:
    """Whether ``accelerator`` computes bf16 natively, and what was detected (a phrase for the line).

    Args:
        accelerator: ``trainer.accelerator``: ``"cuda"``/``"gpu"`` (the current CUDA device is
            checked), ``"auto"`` (CUDA when available, else the CPU) or anything else (the CPU).

    Returns:
        ``(native, detected)``, e.g. ``(False, "CPU: avx512_bf16=False, amx_bf16=False in torch.cpu.get_capabilities()")``.
    """
    import torch

    if accelerator in ("cuda", "gpu") or (accelerator == AUTO and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            return False, "no CUDA device"
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        major, minor = torch.cuda.get_device_capability()
        return native, f"CUDA {torch.cuda.get_device_name()} (compute capability {major}.{minor}, native bf16 from 8.0)"
    flags, source = _cpu_flags()
    listed = ", ".join(f"{name}={value}" for name, value in flags.items()) or "no bf16 feature listed"
    return any(flags.values()), f"CPU: {listed} in {source}"


def resolve_precision(precision: str | int | None, accelerator: str) -> tuple[str | int | None, str | None]:
    """The precision the main job runs and the line that says why.

    ``"auto"``: ``"bf16-mixed"`` where :func:`native_bf16` holds, else ``"32-true"``, with one line
    (what was detected, what was chosen, how to override). A bf16 precision set by the user is kept as
    set; on a CPU that emulates bf16 the line says so. Any other value is returned unchanged, without
    a line.

    Args:
        precision: ``trainer.precision`` (``"auto"`` or one of Lightning's values).
        accelerator: ``trainer.accelerator``.

    Returns:
        ``(precision, line)``; ``line`` is ``None`` when there is nothing to say.
    """
    if precision == AUTO:
        native, detected = native_bf16(accelerator)
        if native:
            return "bf16-mixed", (f"Precision: bf16-mixed (trainer.precision=auto; native bf16 detected: {detected})."
                                  " Override with trainer.precision=32-true.")
        return "32-true", (f"Precision: 32-true (trainer.precision=auto; no native bf16: {detected}; emulated bf16"
                           " is several times slower than fp32). Override with trainer.precision=bf16-mixed.")
    if isinstance(precision, str) and precision.startswith("bf16"):
        native, detected = native_bf16(accelerator)
        if not native:
            return precision, (f"Precision: {precision} as set, but no native bf16 ({detected}): bf16 is emulated"
                               " and several times slower than fp32. trainer.precision=auto picks 32-true here.")
    return precision, None
