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
        _check_tiling(self.backward_stages, num_layers, "backward_stages", tail_first=True)
        return self


def _check_tiling(given: tuple[range, ...], num_layers: int, name: str, tail_first: bool = False) -> None:
    """``given`` (ascending, or tail first) must tile ``0..num_layers-1``; errors quote it as the user wrote it."""
    ranges = tuple(reversed(given)) if tail_first else tuple(given)
    gap = tiling_gap(ranges)
    if gap is not None:
        order = "in descending order (the tail first)" if tail_first else "in ascending order"
        entry = len(ranges) - 1 - gap[0] if tail_first else gap[0]
        if tail_first and tiling_gap(tuple(given)) is None:
            hint = f"the list ascends; give it tail first: `{name}={list(ranges)!r}`."
        else:
            hint = ("forward stages ascend, backward stages are listed tail first, e.g."
                    " forward=[range(0, 3), range(3, 5)], backward=[range(4, 5), range(0, 4)].")
        raise ValueError(
            f"`{name}` must tile layers 0..{num_layers - 1} with consecutive non-empty ranges {order}; got"
            f" {list(given)!r} (entry {entry} should be a range starting at layer {gap[1]}). HINT: {hint}"
        )
    covered = ranges[-1].stop if ranges else 0
    if covered != num_layers:
        raise ValueError(f"`{name}` covers layers 0..{covered - 1} but the model's layer sequence has {num_layers} layers"
                         f" (0..{num_layers - 1}). HINT: a Hugging Face causal LM's sequence is the prefix (embedding),"
                         " one entry per decoder layer, then the tail (norm, LM head, loss): num_hidden_layers + 2;"
                         " RoundPipe's setup line prints it.")
