"""The schedule's intermediate representation: one :class:`Action` per unit of device work.

An action names a stage (``stage_index``), what is done with it (``kind``) and, for compute
actions, which microbatch (``microbatch_index``). The string form follows
``torch.distributed.pipelining``: ``"3F1"`` is stage 3, forward, microbatch 1; ``"3LOAD"`` uploads
stage 3's weights; ``"3DROP"`` releases them (and, for a backward stage, sends its gradients D2H).

Pure data: no torch, no devices.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class ActionKind(str, enum.Enum):
    """What a device does for one action.

    - ``F``: forward of one microbatch through a forward stage (no autograd state kept).
    - ``X``: fused tail: forward, loss and backward of one microbatch in one stage (never recomputed).
    - ``B``: backward of one microbatch through a backward stage: recompute its layers' forward from
      the saved stage-boundary input, then run backward (input and weight gradients together).
    - ``W``: weight-gradient-only backward (zero-bubble baselines only; simulator use).
    - ``LOAD``: H2D upload of the stage's weights (a prefetch when issued before the previous stage ends).
    - ``DROP``: release the stage's weights; for a stage with trainable weights also D2H its gradients.
    """

    F = "F"
    X = "X"
    B = "B"
    W = "W"
    LOAD = "LOAD"
    DROP = "DROP"

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.X, ActionKind.B, ActionKind.W)


_ACTION_RE = re.compile(r"^(\d+)(LOAD|DROP|F|X|B|W)(\d*)$")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work on one device.

    Attributes:
        stage_index: index of the stage in the plan's ``stages`` (forward stages first, then backward).
        kind: the :class:`ActionKind`.
        microbatch_index: microbatch for compute actions; ``None`` for ``LOAD``/``DROP``.
    """

    stage_index: int
    kind: ActionKind
    microbatch_index: int | None = None

    def __post_init__(self) -> None:
        kind = ActionKind(self.kind)
        object.__setattr__(self, "kind", kind)
        if self.stage_index < 0:
            raise ValueError(f"`stage_index` must be >= 0, got {self.stage_index}.")
        if kind.is_compute and (self.microbatch_index is None or self.microbatch_index < 0):
            raise ValueError(f"A `{kind.value}` action needs a `microbatch_index` >= 0, got {self.microbatch_index!r}.")
        if not kind.is_compute and self.microbatch_index is not None:
            raise ValueError(f"A `{kind.value}` action takes no `microbatch_index`, got {self.microbatch_index!r}.")

    def __str__(self) -> str:
        mb = "" if self.microbatch_index is None else str(self.microbatch_index)
        return f"{self.stage_index}{self.kind.value}{mb}"

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse the string form (``"3F1"``, ``"0LOAD"``, ``"5DROP"``).

        Raises:
            ValueError: when ``text`` is not of that form.
        """
        m = _ACTION_RE.match(text.strip())
        if m is None:
            raise ValueError(
                f"Cannot parse action {text!r}: expected `<stage><kind>[<microbatch>]` with kind one of"
                f" {[k.value for k in ActionKind]}, e.g. '3F1' or '0LOAD'."
            )
        stage, kind, mb = m.groups()
        return cls(int(stage), ActionKind(kind), int(mb) if mb else None)
