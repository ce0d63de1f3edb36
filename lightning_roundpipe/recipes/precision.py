"""The main job's automatic precision (``trainer.precision=auto``, the default of ``conf/trainer``).

bf16-mixed where the hardware computes bf16 natively: a CUDA GPU of compute capability 8.0 or more
(``torch.cuda.is_bf16_supported(including_emulation=False)``), or a CPU with bf16 instructions
(``avx512_bf16`` or ``amx_bf16`` on x86, ``bf16``/``sve_bf16`` on ARM, as
``torch.cpu.get_capabilities()`` reports them; ``/proc/cpuinfo`` flags where torch lacks that
function), unless oneDNN, which runs torch's CPU matmuls, is capped below them by
``ONEDNN_MAX_CPU_ISA`` (or its old name ``DNNL_MAX_CPU_ISA``), e.g. ``AVX2``: then a bf16 matmul takes
oneDNN's emulated path (measured 79x slower than fp32 for a 1-thread 1024x1024 matmul on an
AVX512-BF16 CPU capped at AVX2), as on a CPU without the features. Elsewhere bf16 is emulated through fp32 and several times slower than fp32 itself, so the
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

ISA_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""oneDNN's variables capping the instruction sets its kernels use (the first one set counts)."""

ISA_CAPS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
"""oneDNN ISA caps below AVX512_CORE_BF16 (oneDNN's names): no native bf16 dot products under them."""

ISA_CAPS_WITHOUT_AMX = ISA_CAPS_WITHOUT_BF16 + ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512")
"""oneDNN ISA caps that leave out AMX (``amx_bf16`` tiles unused under them; ``avx512_bf16`` still used)."""

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


def _isa_cap() -> tuple[str, str] | None:
    """``(variable, ISA)`` of the oneDNN ISA cap set in the environment (upper case), else ``None``."""
    import os

    for variable in ISA_CAP_VARIABLES:
        value = os.environ.get(variable, "").strip()
        if value:
            return variable, value.upper()
    return None


def native_bf16(accelerator: str) -> tuple[bool, str]:
    """Whether ``accelerator`` computes bf16 natively, and what was detected (a phrase for the line).

    Args:
        accelerator: ``trainer.accelerator``: ``"cuda"``/``"gpu"`` (the current CUDA device is
            checked), ``"auto"`` (CUDA when available, else the CPU) or anything else (the CPU).

    Returns:
        ``(native, detected)``, e.g. ``(False, "CPU: avx512_bf16=False, amx_bf16=False in torch.cpu.get_capabilities()")``
        or, under ``ONEDNN_MAX_CPU_ISA=AVX2``, ``(False, "CPU: avx512_bf16=True, amx_bf16=False in
        torch.cpu.get_capabilities(), unused under ONEDNN_MAX_CPU_ISA=AVX2")``.
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
    usable = dict(flags)
    cap = _isa_cap()
    if cap is not None:  # oneDNN kernels capped below an instruction set: its bf16 features go unused
        if cap[1] in ISA_CAPS_WITHOUT_BF16:
            usable = {name: False for name in usable}
        elif cap[1] in ISA_CAPS_WITHOUT_AMX:
            usable = {name: value and not name.startswith("amx") for name, value in usable.items()}
        if any(flags.values()) and usable != flags:
            unused = ", ".join(name for name, value in flags.items() if value and not usable[name])
            return any(usable.values()), f"CPU: {listed} in {source}, {unused} unused under {cap[0]}={cap[1]}"
    return any(usable.values()), f"CPU: {listed} in {source}"


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
