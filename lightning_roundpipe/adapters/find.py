"""Which module of a LightningModule RoundPipe pipelines (``RoundPipeStrategy(module=...)``)."""

from __future__ import annotations

from torch import nn

from lightning_roundpipe.adapters import FAMILIES, is_supported


def find_pipelined_module(lm: nn.Module, module_name: str | None) -> nn.Module:
    """The module of ``lm`` (a LightningModule) that RoundPipe pipelines: the submodule at the dotted
    path ``module_name`` when given, else the one supported model it holds (an HF causal LM of a
    supported family, also under PEFT, or an ``nn.Sequential``; outermost first).

    Raises:
        ValueError: no submodule at ``module_name``; no supported module; several (name them).
    """
    if module_name is not None:
        try:
            mod = lm.get_submodule(module_name)
        except AttributeError:
            children = [n for n, _ in lm.named_children()]
            raise ValueError(
                f"`RoundPipeStrategy(module={module_name!r})`: the LightningModule has no submodule of that name."
                f" Its children are {children}."
            ) from None
        return mod
    found = [(n, m) for n, m in lm.named_children() if is_supported(m)]
    if not found:  # look deeper, outermost first
        found = [(n, m) for n, m in lm.named_modules() if n and is_supported(m)]
        found = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o != n)]
    if len(found) == 1:
        return found[0][1]
    if not found:
        children = {n: type(m).__name__ for n, m in lm.named_children()}
        raise ValueError(
            f"RoundPipe found no module to pipeline in `{type(lm).__name__}`: none of its submodules ({children}) is a"
            f" supported Hugging Face causal LM ({', '.join(k for k in sorted(FAMILIES) if k != 'generic')}, or another"
            " with the standard decoder-only layout; also under PEFT) or an `nn.Sequential`."
            " HINT: express the model as an `nn.Sequential` whose inputs and outputs carry the batch on dim 0 and"
            " point `RoundPipeStrategy(module='<attribute>')` at it, or use a supported model family."
        )
    raise ValueError(
        f"RoundPipe found several modules it could pipeline in `{type(lm).__name__}`: {[n for n, _ in found]}."
        " HINT: choose one with `RoundPipeStrategy(module='<attribute>')`."
    )

