"""Partition result type, shared by the partitioner and the strategy (pure data)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_roundpipe.schedule.plan import tiling_gap


@dataclass(frozen=True)
class PartitionPlan:
    """Where the layer sequence is cut, separately for forward and backward.

    Attributes:
        forward_stages: ascending ``range`` s of layer indices; together they cover ``0..L-1`` once.
        backward_stages: ``range`` s in execution order, the tail (last layers plus loss) first;
            together they cover ``0..L-1`` once.
        objective_s: the partitioner's objective, ``max(num_stages, num_devices) x largest stage
            cost``, seconds per microbatch; ``None`` for a hand-written partition.
    """

    forward_stages: tuple[range, ...]
    backward_stages: tuple[range, ...]
    objective_s: float | None = None

    def validate(self, num_layers: int) -> "PartitionPlan":
        """Check that both directions tile ``0..num_layers-1`` in order.

        Raises:
            ValueError: naming the first gap or overlap, with a hint.
        """
        _check_tiling(self.forward_stages, num_layers, "forward_stages")
        _check_tiling(tuple(reversed(self.backward_stages)), num_layers, "backward_stages (reversed)")
        return self


def _check_tiling(ranges: tuple[range, ...], num_layers: int, name: str) -> None:
    gap = tiling_gap(ranges)
    if gap is not None:
        raise ValueError(
            f"`{name}` must tile layers 0..{num_layers - 1} with consecutive non-empty ranges; got {list(ranges)!r}"
            f" (expected a range starting at layer {gap[1]}). HINT: forward stages ascend, backward stages"
            " are listed tail first, e.g. forward=[range(0, 3), range(3, 5)], backward=[range(4, 5), range(0, 4)]."
        )
    covered = ranges[-1].stop if ranges else 0
    if covered != num_layers:
        raise ValueError(f"`{name}` covers layers 0..{covered - 1} but the model's layer sequence has {num_layers} layers"
                         f" (0..{num_layers - 1}). HINT: a Hugging Face causal LM's sequence is the prefix (embedding),"
                         " one entry per decoder layer, then the tail (norm, LM head, loss): num_hidden_layers + 2;"
                         " RoundPipe's setup line prints it.")
